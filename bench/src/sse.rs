//! Server-sent events, as OpenAI-compatible servers stream them.
//!
//! [`SseParser`] is fed raw body bytes in whatever pieces the network delivers and
//! yields complete events' `data` payloads; [`parse_chunk`] reads one payload of a
//! `/v1/completions` or `/v1/chat/completions` stream. Both are pure, so the odd
//! splits real networks produce (a UTF-8 character or a `\r\n` cut in two) are tested
//! without a socket.
//!
//! Follows the WHATWG event-stream rules that matter here: lines end in `\n`, `\r\n`
//! or `\r`; a blank line ends an event; `data:` lines of one event are joined with
//! `\n`; lines starting with `:` are comments (keep-alives); other fields are ignored.
//!
//! Kept by hand rather than `eventsource-stream`, which was considered: that crate
//! drops an event the body ends without its blank line (the browser rule), where
//! [`SseParser::finish`] keeps it because servers do end streams so and the payload
//! is a request's `[DONE]` or last chunk; it would also bring `nom` for about seventy
//! lines that the split tests below pin down.

use serde::Deserialize;

/// Incremental event-stream parser.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
    data: Option<String>,
    /// The previous chunk ended in `\r`; a leading `\n` of the next one belongs to it.
    skip_lf: bool,
}

impl SseParser {
    /// A parser with nothing buffered.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds bytes; returns the `data` of every event completed by them.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        let mut out = Vec::new();
        for &b in bytes {
            if self.skip_lf {
                self.skip_lf = false;
                if b == b'\n' {
                    continue;
                }
            }
            match b {
                b'\n' | b'\r' => {
                    self.skip_lf = b == b'\r';
                    let line = std::mem::take(&mut self.buf);
                    self.line(&line, &mut out);
                }
                _ => self.buf.push(b),
            }
        }
        out
    }

    fn line(&mut self, line: &[u8], out: &mut Vec<String>) {
        if line.is_empty() {
            if let Some(d) = self.data.take() {
                out.push(d);
            }
            return;
        }
        if line[0] == b':' {
            return;
        }
        let text = String::from_utf8_lossy(line);
        let (field, value) = match text.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (text.as_ref(), ""),
        };
        if field == "data" {
            match &mut self.data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(value);
                }
                None => self.data = Some(value.to_owned()),
            }
        }
    }

    /// Data of an event cut off by the end of the body without its blank line.
    /// Servers do this; the payload is still whole.
    pub fn finish(&mut self) -> Option<String> {
        if !self.buf.is_empty() {
            let line = std::mem::take(&mut self.buf);
            let mut out = Vec::new();
            self.line(&line, &mut out);
        }
        self.data.take()
    }
}

/// What one stream payload says.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Chunk {
    /// Generated text carried by this chunk (empty for role-only or final chunks).
    pub text: String,
    /// Usage counts (prompt, completion), when the server sends them.
    pub usage: Option<(u32, u32)>,
    /// Cached prompt tokens (`usage.prompt_tokens_details.cached_tokens`), when sent.
    pub cached_tokens: Option<u32>,
    /// `finish_reason`, when set.
    pub finish_reason: Option<String>,
    /// The `[DONE]` sentinel.
    pub done: bool,
    /// An in-stream error object's message.
    pub error: Option<String>,
}

#[derive(Deserialize)]
struct Payload {
    #[serde(default)]
    choices: Vec<Choice>,
    usage: Option<Usage>,
    error: Option<ErrorBody>,
    /// `"error"` in the bare error objects older vLLM versions stream
    /// (`{"object": "error", "message": ...}`), which have no `error` field.
    object: Option<String>,
    message: Option<String>,
}

#[derive(Deserialize)]
struct Choice {
    /// `/v1/completions`.
    text: Option<String>,
    /// `/v1/chat/completions`.
    delta: Option<Delta>,
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct Delta {
    content: Option<String>,
}

#[derive(Deserialize)]
struct Usage {
    prompt_tokens: Option<u32>,
    completion_tokens: Option<u32>,
    prompt_tokens_details: Option<PromptTokensDetails>,
}

#[derive(Deserialize)]
struct PromptTokensDetails {
    cached_tokens: Option<u32>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum ErrorBody {
    Object { message: String },
    Text(String),
}

/// Parses one `data` payload.
///
/// # Errors
/// The JSON error when the payload is neither `[DONE]` nor a JSON object of the
/// expected shape.
pub fn parse_chunk(data: &str) -> Result<Chunk, serde_json::Error> {
    if data.trim() == "[DONE]" {
        return Ok(Chunk {
            done: true,
            ..Chunk::default()
        });
    }
    let p: Payload = serde_json::from_str(data)?;
    let mut c = Chunk::default();
    for ch in p.choices {
        if let Some(t) = ch.text {
            c.text.push_str(&t);
        }
        if let Some(t) = ch.delta.and_then(|d| d.content) {
            c.text.push_str(&t);
        }
        if ch.finish_reason.is_some() {
            c.finish_reason = ch.finish_reason;
        }
    }
    if let Some(u) = p.usage {
        c.cached_tokens = u.prompt_tokens_details.and_then(|d| d.cached_tokens);
        c.usage = u.prompt_tokens.zip(u.completion_tokens);
    }
    c.error = p.error.map(|e| match e {
        ErrorBody::Object { message } => message,
        ErrorBody::Text(t) => t,
    });
    if c.error.is_none() && p.object.as_deref() == Some("error") {
        c.error = Some(
            p.message
                .unwrap_or_else(|| "error object without message".into()),
        );
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_survive_any_split_of_the_byte_stream() {
        let body = "data: {\"a\":\"é\"}\r\n\r\n: keep-alive\n\ndata: x\ndata: y\n\nevent: e\ndata: [DONE]\n\n";
        let want = vec![
            "{\"a\":\"é\"}".to_owned(),
            "x\ny".to_owned(),
            "[DONE]".to_owned(),
        ];
        let bytes = body.as_bytes();
        for cut in 0..bytes.len() {
            let mut p = SseParser::new();
            let mut got = p.push(&bytes[..cut]);
            got.extend(p.push(&bytes[cut..]));
            assert_eq!(got, want, "cut at {cut}");
        }
        // One byte at a time, too.
        let mut p = SseParser::new();
        let got: Vec<String> = bytes
            .iter()
            .flat_map(|b| p.push(std::slice::from_ref(b)))
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn a_final_event_without_blank_line_is_recovered() {
        let mut p = SseParser::new();
        assert!(p.push(b"data: [DONE]").is_empty());
        assert_eq!(p.finish().as_deref(), Some("[DONE]"));
    }

    #[test]
    fn completion_chat_usage_and_error_chunks() {
        let c =
            parse_chunk(r#"{"choices":[{"text":" hi","index":0,"finish_reason":null}]}"#).unwrap();
        assert_eq!(c.text, " hi");
        let c = parse_chunk(r#"{"choices":[{"delta":{"content":"yo"},"index":0}]}"#).unwrap();
        assert_eq!(c.text, "yo");
        let c = parse_chunk(r#"{"choices":[{"delta":{"role":"assistant"},"index":0}]}"#).unwrap();
        assert!(c.text.is_empty());
        let c = parse_chunk(
            r#"{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}}"#,
        )
        .unwrap();
        assert_eq!(c.usage, Some((7, 3)));
        assert_eq!(c.cached_tokens, None);
        let c = parse_chunk(
            r#"{"choices":[],"usage":{"prompt_tokens":400,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":384}}}"#,
        )
        .unwrap();
        assert_eq!((c.usage, c.cached_tokens), (Some((400, 3)), Some(384)));
        let c = parse_chunk(r#"{"choices":[{"text":"","finish_reason":"length"}]}"#).unwrap();
        assert_eq!(c.finish_reason.as_deref(), Some("length"));
        let c = parse_chunk(r#"{"error":{"message":"boom","code":500}}"#).unwrap();
        assert_eq!(c.error.as_deref(), Some("boom"));
        assert!(parse_chunk("[DONE]").unwrap().done);
        assert!(parse_chunk("not json").is_err());
    }

    /// Every payload of a fixture stream, parsed.
    fn replay(fixture: &str) -> Vec<Chunk> {
        let mut p = SseParser::new();
        let mut data = p.push(fixture.as_bytes());
        data.extend(p.finish());
        data.iter().map(|d| parse_chunk(d).unwrap()).collect()
    }

    #[test]
    fn vllm_completions_stream_with_usage_chunk_and_done() {
        // vLLM's /v1/completions stream with stream_options.include_usage: one chunk per
        // token (an incomplete UTF-8 token streams as empty text), the last token
        // together with finish_reason, then a usage chunk with no choices, then [DONE].
        let chunks = replay(include_str!("../tests/fixtures/vllm-completions.sse"));
        assert_eq!(chunks.len(), 7);
        let texts: Vec<&str> = chunks.iter().map(|c| c.text.as_str()).collect();
        assert_eq!(texts, [" the", " river", "", " é", " and", "", ""]);
        assert_eq!(chunks[4].finish_reason.as_deref(), Some("length"));
        assert!(chunks[..5].iter().all(|c| c.usage.is_none()));
        assert_eq!(chunks[5].usage, Some((12, 5)));
        assert!(chunks[6].done);
        assert!(chunks.iter().all(|c| c.error.is_none()));
    }

    #[test]
    fn vllm_chat_stream_with_role_chunk_and_continuous_usage() {
        // The first chunk carries only the role (empty content, not a token); with
        // continuous_usage_stats every chunk carries running usage, and the last
        // word's chunk also carries finish_reason.
        let chunks = replay(include_str!("../tests/fixtures/vllm-chat.sse"));
        let texts: Vec<&str> = chunks.iter().map(|c| c.text.as_str()).collect();
        assert_eq!(texts, ["", "The", " garden", " is", "", ""]);
        let usage: Vec<Option<(u32, u32)>> = chunks.iter().map(|c| c.usage).collect();
        assert_eq!(
            usage,
            [
                None,
                Some((20, 1)),
                Some((20, 2)),
                Some((20, 3)),
                Some((20, 3)),
                None
            ]
        );
        assert_eq!(chunks[3].finish_reason.as_deref(), Some("length"));
        assert!(chunks[5].done);
    }

    #[test]
    fn vllm_error_objects_old_and_new_are_errors() {
        let new = parse_chunk(
            r#"{"error":{"object":"error","message":"prompt too long","type":"BadRequestError","param":null,"code":400}}"#,
        )
        .unwrap();
        assert_eq!(new.error.as_deref(), Some("prompt too long"));
        let old = parse_chunk(
            r#"{"object":"error","message":"engine dead","type":"InternalServerError","param":null,"code":500}"#,
        )
        .unwrap();
        assert_eq!(old.error.as_deref(), Some("engine dead"));
        // An ordinary chunk's `object` is not an error.
        let ok = parse_chunk(r#"{"object":"text_completion","choices":[{"text":"x"}]}"#).unwrap();
        assert!(ok.error.is_none());
    }
}
