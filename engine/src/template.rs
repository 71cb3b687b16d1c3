//! Chat templates: the Jinja template stored in a GGUF (`tokenizer.chat_template`)
//! rendered with `minijinja` the way Hugging Face `transformers` renders it, so a
//! chat request becomes exactly the prompt the model was trained on.
//!
//! What `transformers.apply_chat_template` provides and we reproduce:
//! - environment options `trim_blocks` and `lstrip_blocks` on, loop controls
//!   (`break`/`continue`) enabled;
//! - variables `messages`, `add_generation_prompt`, `bos_token`, `eos_token`
//!   (plus `tools`/`documents` left undefined, which templates test with `is defined`);
//! - functions `raise_exception(msg)` (a render error carrying the message) and
//!   `strftime_now(fmt)` (current UTC time);
//! - a `tojson` filter that matches Python's `json.dumps(ensure_ascii=False)`
//!   (`", "`/`": "` separators, no HTML escaping) rather than minijinja's
//!   HTML-safe one, with the `indent` and `sort_keys` options;
//! - Python string/dict/list methods (`.strip()`, `.items()`, `.startswith()`,
//!   ...) through `minijinja-contrib`'s pycompat callback.
//!
//! Invariant: rendering is a pure function of (template, messages, options), except
//! `strftime_now`, which reads the clock.

use std::fmt::Write as _;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, context};

use crate::model::gguf::{GgufError, Metadata};
use crate::tokenizer::Tokenizer;

/// The metadata key holding the default chat template.
pub const CHAT_TEMPLATE_KEY: &str = "tokenizer.chat_template";
const TEMPLATE_NAME: &str = "chat";

/// Errors loading or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("the model has no chat template ({CHAT_TEMPLATE_KEY} is missing)")]
    Missing,
    // minijinja's message is in the text and not also a `source`: an error chain
    // printer would repeat it. Its plain form is one line (the alternate form adds a
    // source listing), so `serve`'s last `Error: ...` line carries all of it.
    #[error("chat template does not compile: {0}")]
    Compile(Error),
    #[error("chat template failed to render: {0}")]
    Render(Error),
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    /// A message with this role and content.
    #[must_use]
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// The conversation every template is rendered on at start-up: a system and a user
/// message.
#[must_use]
pub fn startup_conversation() -> [ChatMessage; 2] {
    [
        ChatMessage::new("system", "You are a helpful assistant."),
        ChatMessage::new("user", "Hello!"),
    ]
}

/// Rendering options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RenderOptions {
    /// End with the header of an assistant turn, so the model writes the reply.
    pub add_generation_prompt: bool,
}

impl Default for RenderOptions {
    fn default() -> Self {
        Self {
            add_generation_prompt: true,
        }
    }
}

/// A compiled chat template with the special-token strings it may reference.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// The model's own template, with BOS/EOS strings taken from its vocabulary.
    ///
    /// # Errors
    /// [`TemplateError::Missing`] if the GGUF has no template; a compile error.
    pub fn from_metadata(md: &Metadata, tokenizer: &Tokenizer) -> Result<Self, TemplateError> {
        let source = md
            .get_str_opt(CHAT_TEMPLATE_KEY)?
            .ok_or(TemplateError::Missing)?;
        Self::with_tokenizer(source, tokenizer)
    }

    /// Compiles `source` with BOS/EOS strings taken from `tokenizer`.
    ///
    /// # Errors
    /// [`TemplateError::Compile`] when the template is not valid Jinja.
    pub fn with_tokenizer(source: &str, tokenizer: &Tokenizer) -> Result<Self, TemplateError> {
        let text = |id: Option<u32>| {
            id.and_then(|id| tokenizer.token_text(id))
                .unwrap_or_default()
                .to_owned()
        };
        Self::new(source, &text(tokenizer.bos()), &text(tokenizer.eos()))
    }

    /// The template `serve` uses: `override_source` (`--chat-template`, e.g. a
    /// release bundle's) if given, else the model's own; `None` when there is none
    /// that compiles (`/v1/chat/completions` is then refused per request).
    ///
    /// Both are rendered once on [`startup_conversation`]. An override that does
    /// not compile or render is refused: the release names it, so serving without
    /// it would serve something else. The model's own template is only logged when
    /// it fails: one that does not compile is dropped (as before, but no longer
    /// silently), and one that cannot render a system message is kept, because
    /// some models' templates refuse that role by design (a request's render error
    /// is that request's 400).
    ///
    /// # Errors
    /// [`TemplateError::Compile`] or [`TemplateError::Render`] for the override,
    /// with minijinja's message.
    pub fn for_serving(
        md: &Metadata,
        tokenizer: &Tokenizer,
        override_source: Option<&str>,
    ) -> Result<Option<Self>, TemplateError> {
        if let Some(source) = override_source {
            let template = Self::with_tokenizer(source, tokenizer)?;
            template.render_startup_conversation()?;
            tracing::info!("chat template: the --chat-template override");
            return Ok(Some(template));
        }
        match Self::from_metadata(md, tokenizer) {
            Ok(template) => {
                if let Err(error) = template.render_startup_conversation() {
                    tracing::warn!(%error, "the model's chat template cannot render a system and a user message; chat requests it cannot render will be refused");
                }
                Ok(Some(template))
            }
            Err(TemplateError::Missing) => {
                tracing::info!("the model has no chat template; /v1/chat/completions is refused");
                Ok(None)
            }
            Err(error) => {
                tracing::warn!(%error, "the model's chat template is unusable; /v1/chat/completions is refused");
                Ok(None)
            }
        }
    }

    /// Renders [`startup_conversation`] with a generation prompt: the start-up check
    /// that a template works on the simplest chat there is.
    ///
    /// # Errors
    /// [`TemplateError::Render`] with minijinja's message.
    pub fn render_startup_conversation(&self) -> Result<String, TemplateError> {
        self.render(&startup_conversation(), RenderOptions::default())
    }

    /// Compiles `source` (e.g. a template override from a release bundle).
    ///
    /// # Errors
    /// [`TemplateError::Compile`] when the template is not valid Jinja.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_owned())
            .map_err(TemplateError::Compile)?;
        Ok(Self {
            env,
            bos_token: bos_token.to_owned(),
            eos_token: eos_token.to_owned(),
        })
    }

    /// Renders the conversation.
    ///
    /// # Errors
    /// [`TemplateError::Render`], including the template's own `raise_exception`
    /// (e.g. "Conversation roles must alternate").
    pub fn render(
        &self,
        messages: &[ChatMessage],
        options: RenderOptions,
    ) -> Result<String, TemplateError> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(TemplateError::Render)?;
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => options.add_generation_prompt,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
            })
            .map_err(TemplateError::Render)
    }
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(fmt)`: the current UTC time formatted with `strftime` directives
/// (templates use it for "Today Date: 26 Jul 2024"), by jiff's `strtime`, which
/// already reaches the engine through k8s-openapi.
fn strftime_now(format: String) -> Result<String, Error> {
    strftime(&format, jiff::Timestamp::now())
}

fn strftime(format: &str, at: jiff::Timestamp) -> Result<String, Error> {
    jiff::fmt::strtime::format(format, &at.to_zoned(jiff::tz::TimeZone::UTC)).map_err(|error| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now({format:?}): {error}"),
        )
    })
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False,
/// indent=indent, sort_keys=sort_keys)`.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&value, indent, sort_keys.unwrap_or(false), 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

fn write_json(
    v: &Value,
    indent: Option<usize>,
    sort: bool,
    depth: usize,
    out: &mut String,
) -> Result<(), Error> {
    // Python: item separator ", " without indent, "," with it (then newline).
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            let s = v.to_string();
            // Python prints floats with a fractional part ("1.0"); minijinja does too
            // except for non-finite values, which Python writes as NaN/Infinity.
            match s.as_str() {
                "inf" => out.push_str("Infinity"),
                "-inf" => out.push_str("-Infinity"),
                "NaN" | "nan" => out.push_str("NaN"),
                _ => out.push_str(&s),
            }
        }
        ValueKind::String => json_string(v.as_str().unwrap_or_default(), out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_json(item, indent, sort, depth + 1, out)?;
            }
            if !items.is_empty() {
                newline(out, depth);
            }
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if sort {
                keys.sort();
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                json_string(&key.to_string(), out);
                out.push_str(": ");
                write_json(&v.get_item(key)?, indent, sort, depth + 1, out)?;
            }
            if !keys.is_empty() {
                newline(out, depth);
            }
            out.push('}');
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: cannot serialize a {} value", v.kind()),
            ));
        }
    }
    Ok(())
}

/// A JSON string literal as Python writes it with `ensure_ascii=False`.
fn json_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, messages: &[ChatMessage]) -> Result<String, TemplateError> {
        ChatTemplate::new(source, "<s>", "</s>")?.render(messages, RenderOptions::default())
    }

    #[test]
    fn chatml_with_trim_and_lstrip_blocks() {
        // trim_blocks drops the newline after a block tag; lstrip_blocks drops the
        // indentation before one (not before an expression).
        let src = "{{ bos_token }}{% for m in messages %}\n  {% if m.role %}<|{{ m.role }}|>{% endif %}{{ m['content'] | trim }}\n{% endfor %}\n{% if add_generation_prompt %}<|assistant|>{% endif %}";
        let out = render(src, &[ChatMessage::new("user", " hi ")]).unwrap();
        assert_eq!(out, "<s><|user|>hi\n<|assistant|>");
    }

    #[test]
    fn raise_exception_surfaces_the_message() {
        let err = render("{{ raise_exception('roles must alternate') }}", &[]).unwrap_err();
        assert!(err.to_string().contains("roles must alternate"), "{err}");
    }

    #[test]
    fn python_methods_and_loop_controls() {
        let src = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content.strip().upper() }}{{ m.content.startswith(' a') }}{% endfor %}";
        let out = render(
            src,
            &[
                ChatMessage::new("user", " ab "),
                ChatMessage::new("user", "x"),
            ],
        )
        .unwrap();
        assert_eq!(out, "ABTrue");
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let out = render(
            "{{ messages | tojson }}",
            &[ChatMessage::new("user", "é <b>\n\"q\"")],
        )
        .unwrap();
        assert_eq!(out, r#"[{"role": "user", "content": "é <b>\n\"q\""}]"#);
        let out = render(
            "{{ {'b': 1, 'a': [1.5, none, true]} | tojson(indent=2, sort_keys=true) }}",
            &[],
        )
        .unwrap();
        assert_eq!(
            out,
            "{\n  \"a\": [\n    1.5,\n    null,\n    true\n  ],\n  \"b\": 1\n}"
        );
    }

    #[test]
    fn strftime_formats_a_known_instant() {
        // 2024-07-26 13:05:09 UTC, a Friday.
        let t = jiff::Timestamp::from_second(
            1_722_000_000 - 1_722_000_000 % 86_400 + 13 * 3600 + 5 * 60 + 9,
        )
        .unwrap();
        assert_eq!(
            strftime("%d %b %Y %H:%M:%S %A %j %B %e %I%p %%", t).unwrap(),
            "26 Jul 2024 13:05:09 Friday 208 July 26 01PM %"
        );
        let unknown = strftime("%K", t).unwrap_err().to_string();
        assert!(unknown.contains("strftime_now(\"%K\")"), "{unknown}");
        assert!(
            render("{{ strftime_now('%Y') }}", &[])
                .unwrap()
                .starts_with("20")
        );
    }

    #[test]
    fn invalid_templates_fail_to_compile() {
        assert!(matches!(
            ChatTemplate::new("{% for %}", "", ""),
            Err(TemplateError::Compile(_))
        ));
    }

    /// A three-token vocabulary (`<s>`, `</s>`, `a`) with `chat_template` if given.
    fn model(chat_template: Option<&str>) -> (Metadata, Tokenizer) {
        use crate::model::gguf::{Array, Value as Gguf};
        let mut md = Metadata::default();
        let mut put = |k: &str, v: Gguf| md.insert(k.into(), v).unwrap();
        put("tokenizer.ggml.model", Gguf::String("gpt2".into()));
        put("tokenizer.ggml.pre", Gguf::String("smollm".into()));
        let tokens = ["<s>", "</s>", "a"].map(String::from).to_vec();
        put("tokenizer.ggml.tokens", Gguf::Array(Array::String(tokens)));
        put(
            "tokenizer.ggml.merges",
            Gguf::Array(Array::String(Vec::new())),
        );
        put("tokenizer.ggml.bos_token_id", Gguf::U32(0));
        put("tokenizer.ggml.eos_token_id", Gguf::U32(1));
        if let Some(t) = chat_template {
            put(CHAT_TEMPLATE_KEY, Gguf::String(t.into()));
        }
        let tokenizer = Tokenizer::from_metadata(&md).unwrap();
        (md, tokenizer)
    }

    const OWN: &str =
        "{% for m in messages %}{{ bos_token }}{{ m.content }}{{ eos_token }}{% endfor %}";
    const ONLY_ONE: &str =
        "{% if messages | length > 1 %}{{ raise_exception('one only') }}{% endif %}x";

    #[test]
    fn an_override_replaces_the_models_template() {
        let (md, tok) = model(Some(OWN));
        let own = ChatTemplate::for_serving(&md, &tok, None).unwrap().unwrap();
        assert_eq!(
            own.render_startup_conversation().unwrap(),
            "<s>You are a helpful assistant.</s><s>Hello!</s>"
        );
        let over =
            ChatTemplate::for_serving(&md, &tok, Some("{{ messages[1].content }}|{{ eos_token }}"))
                .unwrap()
                .unwrap();
        assert_eq!(over.render_startup_conversation().unwrap(), "Hello!|</s>");
    }

    #[test]
    fn an_override_that_cannot_render_two_messages_is_refused() {
        let (md, tok) = model(Some(OWN));
        let err = ChatTemplate::for_serving(&md, &tok, Some("{% if %}")).unwrap_err();
        assert!(matches!(err, TemplateError::Compile(_)), "{err}");
        let err = ChatTemplate::for_serving(&md, &tok, Some(ONLY_ONE)).unwrap_err();
        assert!(
            matches!(err, TemplateError::Render(_)) && err.to_string().contains("one only"),
            "{err}"
        );
    }

    #[test]
    fn the_models_own_template_is_dropped_or_kept_with_a_warning_never_refused() {
        // No template, or one that does not compile: no chat, but the model serves.
        assert!(
            ChatTemplate::for_serving(&model(None).0, &model(None).1, None)
                .unwrap()
                .is_none()
        );
        let (md, tok) = model(Some("{% for %}"));
        assert!(
            ChatTemplate::for_serving(&md, &tok, None)
                .unwrap()
                .is_none()
        );
        // One that refuses a system message is kept for the chats it can render.
        let (md, tok) = model(Some(ONLY_ONE));
        let kept = ChatTemplate::for_serving(&md, &tok, None).unwrap().unwrap();
        assert_eq!(
            kept.render(&[ChatMessage::new("user", "hi")], RenderOptions::default())
                .unwrap(),
            "x"
        );
    }
}
