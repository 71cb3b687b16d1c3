//! The OpenAI request bodies we accept, and their validation into a [`Prepared`]
//! engine request. Unknown fields are refused by name (a silently ignored field
//! would be a silently wrong answer); so are `n > 1`, non-text content parts and
//! values out of range.

use serde::Deserialize;
use serde_json::Value;

use super::ApiConfig;
use super::errors::ApiError;
use crate::sampling::SamplingParams;
use crate::serving::block_manager::CacheKey;
use crate::serving::engine::GenerateRequest;
use crate::template::ChatMessage;

/// Most stop strings per request.
pub const MAX_STOPS: usize = 16;

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// Fields common to both endpoints; anything else is refused by name.
#[derive(Debug, Deserialize)]
pub(super) struct Common {
    model: String,
    #[serde(default)]
    max_tokens: Option<i64>,
    #[serde(default)]
    max_completion_tokens: Option<i64>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    stop: Option<Stop>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    n: Option<i64>,
    #[serde(default)]
    cache_salt: Option<String>,
    #[serde(default)]
    user: Option<String>,
    /// vLLM's extension: generate exactly `max_tokens` (benchmarks rely on it).
    #[serde(default)]
    ignore_eos: bool,
}

/// `POST /v1/completions`.
#[derive(Debug, Deserialize)]
pub(super) struct CompletionBody {
    pub(super) prompt: String,
    #[serde(flatten)]
    pub(super) common: Common,
}

/// One chat message as clients send it: `content` is a string or a list of parts.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct InMessage {
    role: String,
    content: Value,
    #[serde(default)]
    #[allow(dead_code)] // accepted (OpenAI clients send it), not used by the template
    name: Option<String>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize)]
pub(super) struct ChatBody {
    pub(super) messages: Vec<InMessage>,
    #[serde(flatten)]
    pub(super) common: Common,
}

/// Fields of [`Common`]: serde's `deny_unknown_fields` does not work through
/// `flatten`, so unknown fields are refused here, by name.
const COMMON_FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "cache_salt",
    "user",
    "ignore_eos",
];

/// Parses a body that has the common fields plus `own`.
pub(super) fn parse<T: serde::de::DeserializeOwned>(
    body: Result<axum::Json<Value>, axum::extract::rejection::JsonRejection>,
    own: &str,
) -> Result<T, ApiError> {
    let axum::Json(v) = body?;
    let Some(obj) = v.as_object() else {
        return Err(ApiError::bad("the body must be a JSON object", None));
    };
    if let Some(k) = obj
        .keys()
        .find(|k| k.as_str() != own && !COMMON_FIELDS.contains(&k.as_str()))
    {
        return Err(ApiError::bad(
            format!("unsupported field `{k}`"),
            Some(k.as_str()),
        ));
    }
    serde_json::from_value(v).map_err(|e| ApiError::bad(format!("invalid request: {e}"), None))
}

/// The text of a message's `content`: a string, or a list of `{"type": "text",
/// "text": ...}` parts joined with newlines (as vLLM joins them).
///
/// # Errors
/// A 400 for any other shape or part type (images, audio: not supported).
pub(super) fn content_text(content: &Value) -> Result<String, ApiError> {
    let parts = match content {
        Value::String(s) => return Ok(s.clone()),
        Value::Array(parts) => parts,
        _ => {
            return Err(ApiError::bad(
                "message content must be a string or a list of text parts",
                Some("messages"),
            ));
        }
    };
    let mut texts = Vec::with_capacity(parts.len());
    for part in parts {
        match (part.get("type").and_then(Value::as_str), part.get("text")) {
            (Some("text"), Some(Value::String(t))) => texts.push(t.as_str()),
            (Some("text"), _) => {
                return Err(ApiError::bad(
                    "a text content part needs a string `text`",
                    Some("messages"),
                ));
            }
            (Some(other), _) => {
                return Err(ApiError::bad(
                    format!("content parts of type `{other}` are not supported; only `text`"),
                    Some("messages"),
                ));
            }
            (None, _) => {
                return Err(ApiError::bad(
                    "each content part needs a `type`",
                    Some("messages"),
                ));
            }
        }
    }
    Ok(texts.join("\n"))
}

/// The messages as the chat template takes them.
///
/// # Errors
/// A 400 for no messages, an unknown role or unsupported content.
pub(super) fn chat_messages(messages: &[InMessage]) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad(
            "messages must not be empty",
            Some("messages"),
        ));
    }
    messages
        .iter()
        .map(|m| {
            if !matches!(m.role.as_str(), "system" | "user" | "assistant") {
                return Err(ApiError::bad(
                    format!("unknown role `{}`", m.role),
                    Some("messages"),
                ));
            }
            Ok(ChatMessage::new(m.role.clone(), content_text(&m.content)?))
        })
        .collect()
}

/// A validated request, ready for the engine.
pub(super) struct Prepared {
    pub(super) gen_req: GenerateRequest,
    pub(super) stops: Vec<String>,
    pub(super) stream: bool,
    pub(super) include_usage: bool,
    pub(super) chat: bool,
    pub(super) model: String,
}

/// Checks the common fields against the server's settings.
///
/// # Errors
/// A 400 (or 404 for an unknown model) naming what is wrong.
pub(super) fn prepare(
    config: &ApiConfig,
    eos: &[u32],
    prompt: Vec<u32>,
    c: Common,
    chat: bool,
) -> Result<Prepared, ApiError> {
    let adapter = if c.model == config.model_name {
        None
    } else {
        match config.adapters.iter().position(|a| *a == c.model) {
            // ApiConfig::validate keeps the count within u16.
            Some(i) => Some(u16::try_from(i).unwrap_or(u16::MAX)),
            None => {
                return Err(ApiError::UnknownModel {
                    model: c.model,
                    served: config.served_names(),
                });
            }
        }
    };
    if let Some(n) = c.n
        && n != 1
    {
        return Err(ApiError::bad(
            format!("n = {n} is not supported; only n = 1"),
            Some("n"),
        ));
    }
    if c.stream_options.is_some() && !c.stream {
        return Err(ApiError::bad(
            "stream_options needs stream: true",
            Some("stream_options"),
        ));
    }
    if prompt.is_empty() {
        return Err(ApiError::bad("the prompt is empty", Some("prompt")));
    }
    if prompt.len() >= config.max_model_len {
        return Err(ApiError::bad(
            format!(
                "the prompt has {} tokens; the context is {}",
                prompt.len(),
                config.max_model_len
            ),
            Some("prompt"),
        ));
    }
    let room = config.max_model_len - prompt.len();
    let max_tokens = match c.max_completion_tokens.or(c.max_tokens) {
        None => config.max_output_tokens.min(room),
        Some(m) if m < 1 => {
            return Err(ApiError::bad(
                format!("max_tokens must be at least 1, got {m}"),
                Some("max_tokens"),
            ));
        }
        Some(m) if m as u64 > config.max_output_tokens as u64 => {
            return Err(ApiError::bad(
                format!(
                    "max_tokens = {m} exceeds this server's limit of {} output tokens per request",
                    config.max_output_tokens
                ),
                Some("max_tokens"),
            ));
        }
        Some(m) if m as u64 > room as u64 => {
            return Err(ApiError::bad(
                format!(
                    "max_tokens = {m} plus the prompt's {} tokens exceeds the context of {}",
                    prompt.len(),
                    config.max_model_len
                ),
                Some("max_tokens"),
            ));
        }
        Some(m) => m as usize,
    };
    let sampling = SamplingParams {
        temperature: c.temperature.unwrap_or(1.0),
        top_p: c.top_p.unwrap_or(1.0),
        seed: c.seed.unwrap_or_else(rand::random),
        ..SamplingParams::default()
    };
    sampling
        .validate()
        .map_err(|e| ApiError::bad(e.to_string(), Some(e.param())))?;
    let stops = match c.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    if stops.len() > MAX_STOPS {
        return Err(ApiError::bad(
            format!("at most {MAX_STOPS} stop strings"),
            Some("stop"),
        ));
    }
    if stops.iter().any(|s| s.is_empty() || s.len() > 256) {
        return Err(ApiError::bad(
            "stop strings must be 1 to 256 bytes",
            Some("stop"),
        ));
    }
    let _ = c.user;
    Ok(Prepared {
        gen_req: GenerateRequest {
            prompt,
            max_tokens,
            sampling,
            eos: if c.ignore_eos {
                Vec::new()
            } else {
                eos.to_vec()
            },
            // The engine writes the adapter's identity into the key itself.
            cache_key: CacheKey {
                namespace: config.kv_namespace.clone(),
                adapter: None,
                salt: c.cache_salt,
            },
            adapter,
        },
        stops,
        stream: c.stream,
        include_usage: c.stream_options.is_some_and(|o| o.include_usage),
        chat,
        model: c.model,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn content_is_a_string_or_text_parts() {
        assert_eq!(content_text(&json!("hi")).expect("string"), "hi");
        assert_eq!(
            content_text(&json!([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]))
                .expect("parts"),
            "a\nb"
        );
        for bad in [
            json!(42),
            json!(null),
            json!([{"type": "image_url", "image_url": {"url": "x"}}]),
            json!([{"type": "text"}]),
            json!([{"text": "no type"}]),
            json!(["plain string part"]),
        ] {
            let e = content_text(&bad).expect_err("refused");
            assert_eq!(e.status(), axum::http::StatusCode::BAD_REQUEST, "{bad}");
        }
    }
}
