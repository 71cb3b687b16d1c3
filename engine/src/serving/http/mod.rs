//! The OpenAI-compatible HTTP API (axum): `/v1/completions`, `/v1/chat/completions`
//! (SSE streaming and not), `/v1/models`, `/health`, `/ready`, `/metrics`. Nothing
//! else: this port is what the client Service exposes, so it carries no admin
//! endpoint (drain comes from SIGTERM, see `serve`).
//!
//! Handlers never touch scheduler state: they validate ([`openai_types`]), pass
//! admission ([`crate::serving::admission`]), submit to the [`EngineHandle`] and turn
//! its event stream into text ([`stream`]). Every failure is one [`ApiError`] with an
//! OpenAI-style body, malformed JSON included; every response carries
//! `x-request-id`, and every log line of a request runs in a span with it.
//!
//! Order for a generation request: parse and validate (4xx, not counted as an
//! outcome) → draining? (503) → admission (429/503 with `Retry-After`) → fault
//! injection, test-only (500) → submit. From admission on, a [`track::Tracker`]
//! counts the request once in `slipway_requests_total` when it ends.
//!
//! Tenants: the `Authorization: Bearer` key when there is one (a digest of it, never
//! the key itself, is kept), else the `x-tenant` header; neither → no tenant limit.
//!
//! Served names: the base model's ([`ApiConfig::model_name`]) and one per LoRA
//! adapter ([`ApiConfig::adapters`], as vLLM's `--lora-modules`); `/v1/models` and the
//! load report list them all, a request's `model` picks one, and any other name is a
//! 404 that lists them.

mod errors;
mod openai_types;
mod stream;
mod track;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::sse::Sse;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use rand::{Rng as _, SeedableRng as _};
use serde_json::{Value, json};
use sha2::Digest as _;
use slipway_contract::{LoadReport, paths};
use slipway_telemetry::{TRACE_TARGET, join_trace};
use tracing::Instrument;

pub use errors::{ApiError, DRAIN_RETRY_AFTER_SECS, FAILED_RETRY_AFTER_SECS};
pub use openai_types::MAX_STOPS;

use openai_types::{ChatBody, CompletionBody, Prepared, chat_messages, parse, prepare};
use stream::{Detok, Meta};
use track::Tracker;

use super::admission::{self, Admission, Rejection};
use super::engine::{EngineError, EngineHandle};
use super::metrics::{Outcome, ServingMetrics, SloTargets};
use super::text::StopMatcher;
use crate::template::{ChatTemplate, RenderOptions};
use crate::tokenizer::{DecodeOptions, IncrementalDecoder, Tokenizer};

/// Largest request body accepted.
pub const MAX_BODY_BYTES: usize = 1 << 20;

/// Test-only fault injection (`--inject-error-rate`): a seeded fraction of admitted
/// requests fail with a 500.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FaultConfig {
    /// Fraction of admitted requests that fail, 0..=1 (0: off).
    pub error_rate: f64,
    /// Seed of the draw, so a test run is repeatable.
    pub seed: u64,
}

impl Default for FaultConfig {
    fn default() -> Self {
        Self {
            error_rate: 0.0,
            seed: 0,
        }
    }
}

/// Settings of the API.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiConfig {
    /// Name served in `model` fields and `/v1/models`.
    pub model_name: String,
    /// The served names of the LoRA adapters, in the runner's adapter order (a
    /// request naming `adapters[i]` runs under the runner's adapter `i`).
    pub adapters: Vec<String>,
    /// The release bundle hash served (`--release`), an attribute of every trace.
    pub release: String,
    /// KV namespace of this release (prefix-cache separation).
    pub kv_namespace: String,
    /// Context length.
    pub max_model_len: usize,
    /// The most tokens one request may generate (`--max-output-tokens`): more is a
    /// 400 naming the limit; a request that does not say gets this many, capped by
    /// what the context leaves.
    pub max_output_tokens: usize,
    /// The SLO latency targets counted in `slipway_requests_slo_met_total`.
    pub slo: SloTargets,
    /// KV blocks in the pool and positions per block, for the load report (`GET /load`).
    pub kv_blocks: usize,
    /// Token positions per KV block.
    pub kv_block_size: usize,
    /// Test-only faults.
    pub faults: FaultConfig,
}

impl Default for ApiConfig {
    fn default() -> Self {
        Self {
            model_name: "model".into(),
            adapters: Vec::new(),
            release: "dev".into(),
            kv_namespace: "default".into(),
            max_model_len: 2048,
            max_output_tokens: 1024,
            slo: SloTargets::default(),
            kv_blocks: 0,
            kv_block_size: 16,
            faults: FaultConfig::default(),
        }
    }
}

impl ApiConfig {
    /// Checks the values.
    ///
    /// # Errors
    /// The first bad value.
    pub fn validate(&self) -> Result<(), ApiConfigError> {
        if self.max_model_len < 2 {
            return Err(ApiConfigError::MaxModelLen(self.max_model_len));
        }
        if self.max_output_tokens == 0 {
            return Err(ApiConfigError::NoOutputTokens);
        }
        let r = self.faults.error_rate;
        if !(0.0..=1.0).contains(&r) {
            return Err(ApiConfigError::ErrorRate(r));
        }
        for (i, a) in self.adapters.iter().enumerate() {
            if *a == self.model_name || self.adapters[..i].contains(a) {
                return Err(ApiConfigError::NameServedTwice(a.clone()));
            }
        }
        if self.adapters.len() > usize::from(u16::MAX) {
            return Err(ApiConfigError::TooManyAdapters(self.adapters.len()));
        }
        Ok(())
    }

    /// Every name a request may give as `model`: the base model's, then the adapters'.
    #[must_use]
    pub fn served_names(&self) -> Vec<String> {
        std::iter::once(&self.model_name)
            .chain(&self.adapters)
            .cloned()
            .collect()
    }
}

/// A bad [`ApiConfig`].
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ApiConfigError {
    /// A context too short for a prompt token and a generated one.
    #[error("max_model_len must be at least 2, got {0}")]
    MaxModelLen(usize),
    /// No request could generate anything.
    #[error("max_output_tokens must be at least 1")]
    NoOutputTokens,
    /// A share of requests to fail outside [0, 1].
    #[error("inject-error-rate must be in [0, 1], got {0}")]
    ErrorRate(f64),
    /// A LoRA adapter's name that another adapter or the base model also has.
    #[error(
        "LoRA adapter name {0:?} is served twice (adapters and the base model need names of their own)"
    )]
    NameServedTwice(String),
    /// More adapters than a request's adapter index can name.
    #[error("{0} LoRA adapters; at most {max}", max = u16::MAX)]
    TooManyAdapters(usize),
}

/// The model's text side: tokenizer and chat template.
pub struct ModelText {
    /// The tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// The chat template, if the model has one.
    pub template: Option<ChatTemplate>,
}

/// What the handlers share.
pub struct AppState {
    /// The engine.
    pub engine: EngineHandle,
    /// The model's tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// The model's chat template, if it has one.
    pub template: Option<ChatTemplate>,
    /// Settings.
    pub config: ApiConfig,
    /// Admission control.
    pub admission: Arc<Admission>,
    /// The process's metrics (shared with the engine actor).
    pub metrics: Arc<ServingMetrics>,
    /// False while draining or before warm-up.
    pub ready: AtomicBool,
    faults: Mutex<rand::rngs::StdRng>,
    next_request: AtomicU64,
}

impl AppState {
    /// State for a loaded, ready engine.
    ///
    /// # Errors
    /// An invalid config.
    pub fn new(
        engine: EngineHandle,
        model: ModelText,
        config: ApiConfig,
        admission: Arc<Admission>,
        metrics: Arc<ServingMetrics>,
    ) -> Result<Self, ApiConfigError> {
        config.validate()?;
        Ok(Self {
            engine,
            tokenizer: model.tokenizer,
            template: model.template,
            faults: Mutex::new(rand::rngs::StdRng::seed_from_u64(config.faults.seed)),
            config,
            admission,
            metrics,
            ready: AtomicBool::new(true),
            next_request: AtomicU64::new(1),
        })
    }

    /// Whether this request draws an injected fault.
    fn inject_fault(&self) -> bool {
        let rate = self.config.faults.error_rate;
        rate > 0.0
            && self
                .faults
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .random::<f64>()
                < rate
    }
}

/// The routes, apart from serving them.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route(paths::HEALTH, get(|| async { "ok" }))
        .route(paths::READY, get(ready))
        .route(paths::METRICS, get(metrics))
        .route(paths::LOAD, get(load))
        .fallback(
            |method: axum::http::Method, uri: axum::http::Uri| async move {
                ApiError::NoRoute(format!("{method} {}", uri.path()))
            },
        )
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&state),
            request_id,
        ))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// Gives every request an id (the client's `x-request-id` if sane), a span with it,
/// and the header on the response. An API request's span is also the root of its
/// trace, joined to the caller's W3C `traceparent`; its other attributes are
/// recorded as they become known ([`track::Tracker`], [`stream`]). Probes and
/// scrapes get a log-only span: they are not traced.
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
    let path = req.uri().path();
    let span = if path.starts_with("/v1/") && req.method() == axum::http::Method::POST {
        let span = tracing::info_span!(
            target: TRACE_TARGET,
            "request",
            otel.name = %format!("POST {path}"),
            otel.kind = "server",
            request_id = %id,
            trace_id = tracing::field::Empty,
            release = %state.config.release,
            model = %state.config.model_name,
            prompt_tokens = tracing::field::Empty,
            cached_tokens = tracing::field::Empty,
            output_tokens = tracing::field::Empty,
            finish_reason = tracing::field::Empty,
            outcome = tracing::field::Empty,
            slo_met = tracing::field::Empty,
            http.response.status_code = tracing::field::Empty,
        );
        span.record("trace_id", join_trace(&span, req.headers()));
        span
    } else {
        tracing::info_span!("request", request_id = %id, method = %req.method(), path = %path)
    };
    req.extensions_mut().insert(RequestId(id.clone()));
    let mut resp = next.run(req).instrument(span.clone()).await;
    let status = resp.status().as_u16();
    span.record("http.response.status_code", status);
    span.in_scope(|| tracing::info!(status, "done"));
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
        ApiError::unavailable("draining", DRAIN_RETRY_AFTER_SECS).into_response()
    }
}

/// Prometheus text 0.0.4, or OpenMetrics when the scraper asks for it.
async fn metrics(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    let openmetrics = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("application/openmetrics-text"));
    let (body, ctype) = if openmetrics {
        (
            state.metrics.openmetrics(),
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )
    } else {
        (
            state.metrics.prometheus_text(),
            "text/plain; version=0.0.4; charset=utf-8",
        )
    };
    ([(header::CONTENT_TYPE, ctype)], body).into_response()
}

/// The router's view of this engine: cheap to answer (gauges the engine actor keeps
/// current every step, no round trip through it) and typed on both sides.
async fn load(State(state): State<Arc<AppState>>) -> Json<LoadReport> {
    let m = &state.metrics;
    Json(LoadReport {
        release: state.config.release.clone(),
        models: state.config.served_names(),
        running: usize::try_from(m.running.get()).unwrap_or(0),
        waiting: usize::try_from(m.waiting.get()).unwrap_or(0),
        context_blocks: usize::try_from(m.context_blocks.get()).unwrap_or(0),
        kv_blocks_total: state.config.kv_blocks,
        kv_block_size: state.config.kv_block_size,
        draining: !state.ready.load(Ordering::Relaxed),
    })
}

/// The base model, then each LoRA adapter with the base as its `parent` (as vLLM
/// lists its `--lora-modules`).
async fn models(State(state): State<Arc<AppState>>) -> Json<Value> {
    let base = &state.config.model_name;
    let data: Vec<Value> = std::iter::once(json!({
        "id": base, "object": "model", "created": 0, "owned_by": "slipway", "root": base, "parent": null
    }))
    .chain(state.config.adapters.iter().map(|a| {
        json!({"id": a, "object": "model", "created": 0, "owned_by": "slipway", "root": a, "parent": base})
    }))
    .collect();
    Json(json!({"object": "list", "data": data}))
}

/// The tenant of a request: a digest of its bearer key, else its `x-tenant`.
fn tenant(headers: &HeaderMap) -> Option<String> {
    let key = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|k| !k.is_empty());
    if let Some(k) = key {
        let d = sha2::Sha256::digest(k.as_bytes());
        return Some(format!("key:{}", hex::encode(&d[..8])));
    }
    headers
        .get("x-tenant")
        .and_then(|v| v.to_str().ok())
        .filter(|t| !t.is_empty() && t.len() <= 128)
        .map(|t| format!("tenant:{t}"))
}

async fn completions(
    State(state): State<Arc<AppState>>,
    axum::Extension(rid): axum::Extension<RequestId>,
    headers: HeaderMap,
    body: Result<Json<Value>, JsonRejection>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let b: CompletionBody = parse(body, "prompt")?;
    let prompt = state.tokenizer.encode(&b.prompt);
    let p = prepare(
        &state.config,
        state.tokenizer.eog_tokens(),
        prompt,
        b.common,
        false,
    )?;
    run(state, p, rid, tenant(&headers), arrived).await
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    axum::Extension(rid): axum::Extension<RequestId>,
    headers: HeaderMap,
    body: Result<Json<Value>, JsonRejection>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let b: ChatBody = parse(body, "messages")?;
    let messages = chat_messages(&b.messages)?;
    let template = state.template.as_ref().ok_or_else(|| {
        ApiError::bad("this model has no chat template; use /v1/completions", None)
    })?;
    let text = template
        .render(&messages, RenderOptions::default())
        .map_err(|e| ApiError::bad(format!("chat template: {e}"), Some("messages")))?;
    let prompt = state.tokenizer.encode(&text);
    let p = prepare(
        &state.config,
        state.tokenizer.eog_tokens(),
        prompt,
        b.common,
        true,
    )?;
    run(state, p, rid, tenant(&headers), arrived).await
}

/// Admits and submits a validated request, then answers it.
async fn run(
    state: Arc<AppState>,
    p: Prepared,
    rid: RequestId,
    tenant: Option<String>,
    arrived: Instant,
) -> Result<Response, ApiError> {
    let m = &state.metrics;
    // A request refused before it is tracked still reports its outcome on its span.
    let refused = |outcome: Outcome| {
        m.request_ended(p.gen_req.adapter, outcome);
        tracing::Span::current().record("outcome", outcome.as_str());
    };
    tracing::Span::current().record("prompt_tokens", p.gen_req.prompt.len());
    if !state.ready.load(Ordering::Relaxed) {
        refused(Outcome::Rejected503);
        return Err(ApiError::unavailable(
            "the server is draining; retry on another replica",
            DRAIN_RETRY_AFTER_SECS,
        ));
    }
    let block_size = state.admission.config().block_size;
    let cost = admission::cost(p.gen_req.prompt.len(), p.gen_req.max_tokens, block_size);
    let admission_span = tracing::info_span!(
        target: TRACE_TARGET,
        "admission",
        cost_tokens = cost.tokens,
        cost_blocks = cost.blocks,
        admitted = tracing::field::Empty,
    );
    let admitted =
        admission_span.in_scope(|| state.admission.try_admit(tenant.as_deref(), cost, arrived));
    admission_span.record("admitted", admitted.is_ok());
    drop(admission_span);
    let permit = match admitted {
        Ok(permit) => permit,
        Err(r) => {
            match r {
                Rejection::NeverFits { .. } => {}
                Rejection::TenantRate { .. } => refused(Outcome::Rejected429),
                _ => refused(Outcome::Rejected503),
            }
            tracing::info!(reason = %r, "refused at admission");
            return Err(r.into());
        }
    };
    let mut tracker = Tracker::new(
        (Arc::clone(m), p.gen_req.adapter),
        state.config.slo,
        permit,
        arrived,
    );
    if state.inject_fault() {
        tracker.finish(Outcome::Error);
        return Err(ApiError::Internal(
            "injected fault (--inject-error-rate, a test-only setting)".into(),
        ));
    }
    let stream = match state.engine.submit(p.gen_req.clone()).await {
        Ok(s) => s,
        Err(EngineError::Closed) => {
            tracker.finish(Outcome::Error);
            return Err(ApiError::unavailable(
                "the engine is shutting down",
                DRAIN_RETRY_AFTER_SECS,
            ));
        }
        Err(EngineError::Rejected(r)) => {
            tracker.forget();
            return Err(ApiError::bad(r.to_string(), None));
        }
    };
    let detok = Detok {
        tokenizer: Arc::clone(&state.tokenizer),
        decoder: IncrementalDecoder::new(DecodeOptions { skip_special: true }),
        stops: StopMatcher::new(p.stops.clone()),
    };
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let id = format!("{}-{}", if p.chat { "chatcmpl" } else { "cmpl" }, rid.0);
    let streaming = p.stream;
    let meta = Meta { p, id, created };
    if streaming {
        Ok(Sse::new(stream::sse(stream, detok, meta, tracker)).into_response())
    } else {
        stream::collect(stream, detok, meta, tracker).await
    }
}

#[cfg(test)]
mod tests;
