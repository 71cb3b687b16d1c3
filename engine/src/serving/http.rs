//! The OpenAI-compatible HTTP API (axum): `/v1/completions`, `/v1/chat/completions`
//! (SSE streaming and not), `/v1/models`, `/health`, `/ready`.
//!
//! Handlers never touch scheduler state: they tokenize, submit to the
//! [`EngineHandle`] and turn its event stream into text (incremental decoding, stop
//! strings). Every failure is one [`ApiError`] with an OpenAI-style body, malformed
//! JSON included; every response carries `x-request-id`, and every log line of a
//! request runs in a span with it. Dropping a streaming response (client gone)
//! drops the engine stream, which frees the request's KV before the next step.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::Stream;
use serde::Deserialize;
use serde_json::{Value, json};
use tracing::Instrument;

use super::block_manager::CacheKey;
use super::engine::{EngineError, EngineHandle, Event, GenerateRequest, RequestStream};
use super::text::StopMatcher;
use crate::sampling::SamplingParams;
use crate::template::{ChatMessage, ChatTemplate, RenderOptions};
use crate::tokenizer::{DecodeOptions, IncrementalDecoder, Tokenizer};

/// Largest request body accepted.
pub const MAX_BODY_BYTES: usize = 1 << 20;
/// Most stop strings per request.
pub const MAX_STOPS: usize = 16;

/// What the handlers share.
pub struct AppState {
    /// The engine.
    pub engine: EngineHandle,
    /// The model's tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// The model's chat template, if it has one.
    pub template: Option<ChatTemplate>,
    /// Name served in `model` fields and `/v1/models`.
    pub model_name: String,
    /// KV namespace of this release (prefix-cache separation).
    pub kv_namespace: String,
    /// Context length.
    pub max_model_len: usize,
    /// `max_tokens` when a request does not say.
    pub default_max_tokens: usize,
    /// False while draining or before warm-up.
    pub ready: AtomicBool,
    /// Signalled by `POST /admin/drain` (the server then drains as on SIGTERM).
    pub drain: tokio::sync::Notify,
    next_request: AtomicU64,
}

impl AppState {
    /// State for a loaded, ready engine.
    #[must_use]
    pub fn new(
        engine: EngineHandle,
        tokenizer: Arc<Tokenizer>,
        template: Option<ChatTemplate>,
        model_name: String,
        kv_namespace: String,
        max_model_len: usize,
    ) -> Self {
        Self {
            engine,
            tokenizer,
            template,
            model_name,
            kv_namespace,
            max_model_len,
            default_max_tokens: 256,
            ready: AtomicBool::new(true),
            drain: tokio::sync::Notify::new(),
            next_request: AtomicU64::new(1),
        }
    }
}

/// Every failure of the API, as a status and an OpenAI-style error body.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    /// The request is malformed or asks for something unsupported (400).
    #[error("{message}")]
    BadRequest {
        /// What is wrong, for a person.
        message: String,
        /// The offending field, if one.
        param: Option<String>,
    },
    /// The body is over [`MAX_BODY_BYTES`] (413).
    #[error("request body is larger than {MAX_BODY_BYTES} bytes")]
    TooLarge,
    /// The model named is not served here (404).
    #[error("model `{0}` does not exist; see /v1/models")]
    UnknownModel(String),
    /// Draining or shut down (503, with Retry-After).
    #[error("{0}")]
    Unavailable(String),
}

impl ApiError {
    fn bad(message: impl Into<String>, param: Option<&str>) -> Self {
        Self::BadRequest {
            message: message.into(),
            param: param.map(Into::into),
        }
    }

    /// The HTTP status.
    #[must_use]
    pub fn status(&self) -> StatusCode {
        match self {
            Self::BadRequest { .. } => StatusCode::BAD_REQUEST,
            Self::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::UnknownModel(_) => StatusCode::NOT_FOUND,
            Self::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (kind, code, param) = match &self {
            Self::BadRequest { param, .. } => ("invalid_request_error", None, param.clone()),
            Self::TooLarge => ("invalid_request_error", Some("body_too_large"), None),
            Self::UnknownModel(_) => ("invalid_request_error", Some("model_not_found"), None),
            Self::Unavailable(_) => ("service_unavailable", Some("unavailable"), None),
        };
        let body = json!({"error": {"message": self.to_string(), "type": kind, "param": param, "code": code}});
        let mut r = (self.status(), Json(body)).into_response();
        if matches!(self, Self::Unavailable(_)) {
            r.headers_mut()
                .insert("retry-after", HeaderValue::from_static("5"));
        }
        r
    }
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> Self {
        match r {
            JsonRejection::BytesRejection(_) => Self::TooLarge,
            JsonRejection::MissingJsonContentType(_) => Self::bad(
                "expected a JSON body with `Content-Type: application/json`",
                None,
            ),
            other => Self::bad(format!("invalid JSON body: {}", other.body_text()), None),
        }
    }
}

/// The routes, apart from serving them.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { "ok" }))
        .route("/ready", get(ready))
        .route("/admin/drain", post(drain))
        .fallback(|| async { ApiError::bad("no such endpoint", None) })
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&state),
            request_id,
        ))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// Gives every request an id (the client's `x-request-id` if sane), a span with it,
/// and the header on the response.
async fn request_id(State(state): State<Arc<AppState>>, mut req: Request, next: Next) -> Response {
    let id = req
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic()))
        .map_or_else(
            || format!("req-{}", state.next_request.fetch_add(1, Ordering::Relaxed)),
            str::to_string,
        );
    let span = tracing::info_span!("request", request_id = %id, method = %req.method(), path = %req.uri().path());
    req.extensions_mut().insert(RequestId(id.clone()));
    let mut resp = next.run(req).instrument(span.clone()).await;
    span.in_scope(|| tracing::info!(status = resp.status().as_u16(), "done"));
    if let Ok(v) = HeaderValue::from_str(&id) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

#[derive(Clone, Debug)]
struct RequestId(String);

async fn ready(State(state): State<Arc<AppState>>) -> Response {
    if state.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ready").into_response()
    } else {
        ApiError::Unavailable("draining".into()).into_response()
    }
}

/// Stops admitting at once (`/ready` false, new requests 503) and wakes the server's
/// drain, which lets admitted requests finish.
async fn drain(State(state): State<Arc<AppState>>) -> Json<Value> {
    state.ready.store(false, Ordering::Relaxed);
    state.drain.notify_one();
    tracing::info!("drain requested");
    Json(json!({"draining": true}))
}

async fn models(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": 0, "owned_by": "slipway"
    }]}))
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// Fields common to both endpoints; anything else is refused by name.
#[derive(Debug, Deserialize)]
struct Common {
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
}

#[derive(Debug, Deserialize)]
struct CompletionBody {
    prompt: String,
    #[serde(flatten)]
    common: Common,
}

#[derive(Debug, Deserialize)]
struct ChatBody {
    messages: Vec<ChatMessage>,
    #[serde(flatten)]
    common: Common,
}

/// A validated request, ready for the engine.
struct Prepared {
    gen_req: GenerateRequest,
    stops: Vec<String>,
    stream: bool,
    include_usage: bool,
    chat: bool,
    model: String,
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
];

fn parse<T: serde::de::DeserializeOwned>(
    body: Result<Json<Value>, JsonRejection>,
    own: &str,
) -> Result<T, ApiError> {
    let Json(v) = body?;
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

fn prepare(
    state: &AppState,
    prompt: Vec<u32>,
    c: Common,
    chat: bool,
) -> Result<Prepared, ApiError> {
    if c.model != state.model_name {
        return Err(ApiError::UnknownModel(c.model));
    }
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
    if prompt.len() >= state.max_model_len {
        return Err(ApiError::bad(
            format!(
                "the prompt has {} tokens; the context is {}",
                prompt.len(),
                state.max_model_len
            ),
            Some("prompt"),
        ));
    }
    let room = state.max_model_len - prompt.len();
    let max_tokens = match c.max_completion_tokens.or(c.max_tokens) {
        None => state.default_max_tokens.min(room),
        Some(m) if m < 1 => {
            return Err(ApiError::bad(
                format!("max_tokens must be at least 1, got {m}"),
                Some("max_tokens"),
            ));
        }
        Some(m) if m as u64 > room as u64 => {
            return Err(ApiError::bad(
                format!(
                    "max_tokens = {m} plus the prompt's {} tokens exceeds the context of {}",
                    prompt.len(),
                    state.max_model_len
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
        .map_err(|m| ApiError::bad(m, Some("temperature")))?;
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
            eos: state.tokenizer.eog_tokens().to_vec(),
            cache_key: CacheKey {
                namespace: state.kv_namespace.clone(),
                adapter: None,
                salt: c.cache_salt,
            },
        },
        stops,
        stream: c.stream,
        include_usage: c.stream_options.is_some_and(|o| o.include_usage),
        chat,
        model: state.model_name.clone(),
    })
}

async fn completions(
    State(state): State<Arc<AppState>>,
    axum::Extension(rid): axum::Extension<RequestId>,
    body: Result<Json<Value>, JsonRejection>,
) -> Result<Response, ApiError> {
    let b: CompletionBody = parse(body, "prompt")?;
    let prompt = state.tokenizer.encode(&b.prompt);
    let p = prepare(&state, prompt, b.common, false)?;
    run(state, p, rid).await
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    axum::Extension(rid): axum::Extension<RequestId>,
    body: Result<Json<Value>, JsonRejection>,
) -> Result<Response, ApiError> {
    let b: ChatBody = parse(body, "messages")?;
    if b.messages.is_empty() {
        return Err(ApiError::bad(
            "messages must not be empty",
            Some("messages"),
        ));
    }
    if let Some(m) = b
        .messages
        .iter()
        .find(|m| !matches!(m.role.as_str(), "system" | "user" | "assistant"))
    {
        return Err(ApiError::bad(
            format!("unknown role `{}`", m.role),
            Some("messages"),
        ));
    }
    let template = state.template.as_ref().ok_or_else(|| {
        ApiError::bad("this model has no chat template; use /v1/completions", None)
    })?;
    let text = template
        .render(&b.messages, RenderOptions::default())
        .map_err(|e| ApiError::bad(format!("chat template: {e}"), Some("messages")))?;
    let prompt = state.tokenizer.encode(&text);
    let p = prepare(&state, prompt, b.common, true)?;
    run(state, p, rid).await
}

/// Turns engine events into text pieces and a final state.
struct Detok {
    tokenizer: Arc<Tokenizer>,
    decoder: IncrementalDecoder,
    stops: StopMatcher,
}

enum Piece {
    Text(String),
    Done {
        text: String,
        reason: &'static str,
        usage: Value,
    },
    Failed(String),
}

impl Detok {
    fn next(&mut self, e: Option<Event>, done_by_stop: &mut bool) -> Piece {
        match e {
            Some(Event::Token(t)) => {
                let text = self.decoder.push(&self.tokenizer, t).unwrap_or_default();
                let step = self.stops.push(&text);
                if step.stopped {
                    *done_by_stop = true;
                }
                Piece::Text(step.emit)
            }
            Some(Event::Finished {
                reason,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            }) => {
                let mut text = self.decoder.finish();
                text = self.stops.push(&text).emit;
                text.push_str(&self.stops.finish());
                Piece::Done {
                    text,
                    reason: reason.as_str(),
                    usage: usage(prompt_tokens, completion_tokens, cached_tokens),
                }
            }
            Some(Event::Error(m)) => Piece::Failed(m),
            None => Piece::Failed("the engine shut down".into()),
        }
    }
}

fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
           "prompt_tokens_details": {"cached_tokens": cached}})
}

async fn run(state: Arc<AppState>, p: Prepared, rid: RequestId) -> Result<Response, ApiError> {
    if !state.ready.load(Ordering::Relaxed) {
        return Err(ApiError::Unavailable(
            "the server is draining; retry on another replica".into(),
        ));
    }
    let prompt_tokens = p.gen_req.prompt.len();
    let stream = state
        .engine
        .submit(p.gen_req.clone())
        .await
        .map_err(|e| match e {
            EngineError::Closed => ApiError::Unavailable("the engine is shutting down".into()),
            EngineError::Rejected(r) => ApiError::bad(r.to_string(), None),
        })?;
    let detok = Detok {
        tokenizer: Arc::clone(&state.tokenizer),
        decoder: IncrementalDecoder::new(DecodeOptions { skip_special: true }),
        stops: StopMatcher::new(p.stops.clone()),
    };
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let id = format!("{}-{}", if p.chat { "chatcmpl" } else { "cmpl" }, rid.0);
    if p.stream {
        Ok(Sse::new(sse(stream, detok, p, id, created, prompt_tokens)).into_response())
    } else {
        collect(stream, detok, &p, &id, created).await
    }
}

async fn collect(
    mut stream: RequestStream,
    mut detok: Detok,
    p: &Prepared,
    id: &str,
    created: u64,
) -> Result<Response, ApiError> {
    let mut text = String::new();
    let mut by_stop = false;
    let mut completion = 0;
    let prompt = p.gen_req.prompt.len();
    loop {
        let e = stream.events.recv().await;
        if matches!(e, Some(Event::Token(_))) {
            completion += 1;
        }
        match detok.next(e, &mut by_stop) {
            Piece::Text(t) => {
                text.push_str(&t);
                if by_stop {
                    // Dropping the stream cancels the request in the engine.
                    drop(stream);
                    return Ok(body(
                        p,
                        id,
                        created,
                        &text,
                        "stop",
                        usage(prompt, completion, 0),
                    ));
                }
            }
            Piece::Done {
                text: t,
                reason,
                usage,
            } => {
                text.push_str(&t);
                return Ok(body(p, id, created, &text, reason, usage));
            }
            Piece::Failed(m) => return Err(ApiError::Unavailable(m)),
        }
    }
}

fn body(p: &Prepared, id: &str, created: u64, text: &str, reason: &str, usage: Value) -> Response {
    let choice = if p.chat {
        json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason, "logprobs": null})
    } else {
        json!({"index": 0, "text": text, "finish_reason": reason, "logprobs": null})
    };
    let object = if p.chat {
        "chat.completion"
    } else {
        "text_completion"
    };
    Json(
        json!({"id": id, "object": object, "created": created, "model": p.model,
                "choices": [choice], "usage": usage}),
    )
    .into_response()
}

fn chunk(p: &Prepared, id: &str, created: u64, text: Option<&str>, reason: Option<&str>) -> Value {
    let choice = if p.chat {
        let delta = text.map_or_else(|| json!({}), |t| json!({"content": t}));
        json!({"index": 0, "delta": delta, "finish_reason": reason, "logprobs": null})
    } else {
        json!({"index": 0, "text": text.unwrap_or(""), "finish_reason": reason, "logprobs": null})
    };
    let object = if p.chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    json!({"id": id, "object": object, "created": created, "model": p.model, "choices": [choice]})
}

fn sse(
    stream: RequestStream,
    detok: Detok,
    p: Prepared,
    id: String,
    created: u64,
    prompt_tokens: usize,
) -> impl Stream<Item = Result<SseEvent, std::convert::Infallible>> {
    struct St {
        stream: Option<RequestStream>,
        detok: Detok,
        p: Prepared,
        id: String,
        created: u64,
        queue: std::collections::VecDeque<SseEvent>,
        completion: usize,
        prompt_tokens: usize,
        started: bool,
    }
    let st = St {
        stream: Some(stream),
        detok,
        p,
        id,
        created,
        queue: Default::default(),
        completion: 0,
        prompt_tokens,
        started: false,
    };
    futures::stream::unfold(st, |mut st| async move {
        loop {
            if let Some(e) = st.queue.pop_front() {
                return Some((Ok(e), st));
            }
            let rx = st.stream.as_mut()?;
            if st.p.chat && !st.started {
                st.started = true;
                let mut c = chunk(&st.p, &st.id, st.created, None, None);
                c["choices"][0]["delta"] = json!({"role": "assistant", "content": ""});
                st.queue.push_back(SseEvent::default().data(c.to_string()));
                continue;
            }
            let e = rx.events.recv().await;
            if matches!(e, Some(Event::Token(_))) {
                st.completion += 1;
            }
            let mut by_stop = false;
            let (text, end) = match st.detok.next(e, &mut by_stop) {
                Piece::Text(t) if by_stop => {
                    (t, Some(("stop", usage(st.prompt_tokens, st.completion, 0))))
                }
                Piece::Text(t) => (t, None),
                Piece::Done {
                    text,
                    reason,
                    usage,
                } => (text, Some((reason, usage))),
                Piece::Failed(m) => {
                    st.stream = None;
                    let err = json!({"error": {"message": m, "type": "server_error", "param": null, "code": "engine_error"}});
                    st.queue
                        .push_back(SseEvent::default().data(err.to_string()));
                    st.queue.push_back(SseEvent::default().data("[DONE]"));
                    continue;
                }
            };
            if !text.is_empty() {
                let c = chunk(&st.p, &st.id, st.created, Some(&text), None);
                st.queue.push_back(SseEvent::default().data(c.to_string()));
            }
            if let Some((reason, usage)) = end {
                // Dropping the engine stream ends (or, on a stop string, cancels) it.
                st.stream = None;
                let c = chunk(&st.p, &st.id, st.created, None, Some(reason));
                st.queue.push_back(SseEvent::default().data(c.to_string()));
                if st.p.include_usage {
                    let mut u = json!({"id": st.id, "object": if st.p.chat { "chat.completion.chunk" } else { "text_completion" },
                                       "created": st.created, "model": st.p.model, "choices": []});
                    u["usage"] = usage;
                    st.queue.push_back(SseEvent::default().data(u.to_string()));
                }
                st.queue.push_back(SseEvent::default().data("[DONE]"));
            }
        }
    })
}

#[cfg(test)]
#[path = "http_tests.rs"]
mod tests;
