//! Forwarding one OpenAI request: pick the release ([`crate::split`]), rank its
//! endpoints ([`crate::endpoints::Live::choose`]), try them in order while the retry
//! rules allow ([`crate::retry`]), then relay the chosen engine's answer chunk by chunk
//! while measuring it ([`Relay`]).
//!
//! The first byte of a relayed answer is the point of no return: before it a refused
//! connection, a 503 or a 429 moves on to the next-best endpoint; after it the client
//! gets what the engine sent and, if the engine breaks off, an explicit SSE error
//! event. A client that goes away drops the relay, which drops the upstream response
//! and so cancels the request in the engine.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use futures::{Stream, StreamExt as _};
use serde_json::{Value, json};
use slipway_contract::metrics::{Outcome, SloTargets, time_per_output_token};
use slipway_telemetry::{TRACE_TARGET, inject_trace, join_trace};
use tracing::Instrument as _;

use crate::choose::{Exclusion, Params};
use crate::endpoints::{InFlight, Live};
use crate::metrics::RouterMetrics;
use crate::prefix;
use crate::retry::{self, Failure, Next, RetryPolicy};
use crate::split::session_draw;

/// Token positions per engine KV block: the tolerance of a prefix prediction.
const KV_BLOCK_TOKENS: u64 = 16;
/// The most of a non-streamed answer the router keeps to read its `usage`.
const MAX_KEPT_BODY: usize = 4 << 20;

/// Everything the request handlers share.
#[derive(Debug)]
pub struct App {
    /// The live view.
    pub live: Arc<Live>,
    /// The router's metrics.
    pub metrics: RouterMetrics,
    /// The client for the engines (pooled connections).
    pub client: reqwest::Client,
    /// How endpoints are chosen.
    pub params: Params,
    /// When to retry.
    pub retry: RetryPolicy,
    /// Characters per prefix-index block.
    pub block_chars: usize,
    /// The stickiness header.
    pub session_header: HeaderName,
    /// False before the view is synced and while draining.
    pub ready: AtomicBool,
    /// Requests being handled (drain waits for 0).
    pub active: AtomicUsize,
}

/// Counts a request as active until dropped.
struct Active(Arc<App>);

impl Active {
    fn new(app: &Arc<App>) -> Self {
        app.active.fetch_add(1, Ordering::Relaxed);
        Self(Arc::clone(app))
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::Relaxed);
    }
}

/// An OpenAI-style error answer.
fn error(status: StatusCode, kind: &str, message: &str, retry_after: Option<u64>) -> Response {
    let body = json!({"error": {"message": message, "type": kind, "param": null, "code": status.as_u16()}});
    let mut response = (status, axum::Json(body)).into_response();
    if let Some(secs) = retry_after
        && let Ok(value) = HeaderValue::from_str(&secs.to_string())
    {
        response.headers_mut().insert(header::RETRY_AFTER, value);
    }
    response
}

/// The request headers an engine needs: who the tenant is, the request id, what the
/// client accepts. Tracing headers are written by [`inject_trace`].
const FORWARDED: [HeaderName; 4] = [
    header::AUTHORIZATION,
    header::ACCEPT,
    HeaderName::from_static("x-tenant"),
    REQUEST_ID,
];

/// The response headers a client needs from the engine.
const RELAYED: [HeaderName; 4] = [
    header::CONTENT_TYPE,
    header::CACHE_CONTROL,
    header::RETRY_AFTER,
    HeaderName::from_static("x-request-id"),
];

/// `POST /v1/chat/completions` and `POST /v1/completions`.
pub async fn forward(
    State(app): State<Arc<App>>,
    uri: Uri,
    mut headers: HeaderMap,
    body: Bytes,
) -> Response {
    // One id from the client through the router to the engine, so their log lines
    // join: the client's when it is sane, else a fresh one.
    let request_id = headers
        .get(REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic()))
        .map_or_else(
            || format!("rt-{:016x}", rand::random::<u64>()),
            str::to_owned,
        );
    if let Ok(value) = HeaderValue::from_str(&request_id) {
        headers.insert(REQUEST_ID, value);
    }
    let span = tracing::info_span!(
        target: TRACE_TARGET,
        "route",
        otel.name = %format!("route {}", uri.path()),
        otel.kind = "server",
        request_id = %request_id,
        trace_id = tracing::field::Empty,
        release = tracing::field::Empty,
        endpoint = tracing::field::Empty,
        retries = tracing::field::Empty,
        predicted_cached_blocks = tracing::field::Empty,
        http.response.status_code = tracing::field::Empty,
    );
    span.record("trace_id", join_trace(&span, &headers));
    let response = route(app, uri, headers, body, span.clone())
        .instrument(span.clone())
        .await;
    span.record("http.response.status_code", response.status().as_u16());
    let mut response = response;
    if let Ok(value) = HeaderValue::from_str(&request_id) {
        response.headers_mut().insert(REQUEST_ID, value);
    }
    response
}

const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// What the router read from a request body.
struct Request {
    model: String,
    streaming: bool,
    /// The client asked for the usage chunk of a stream.
    wants_usage: bool,
    /// The body as the engines get it.
    upstream: Bytes,
}

fn read_request(body: &Bytes) -> Result<(Request, Value), String> {
    let mut value: Value = serde_json::from_slice(body)
        .map_err(|e| format!("the request body is not valid JSON: {e}"))?;
    if !value.is_object() {
        return Err("the request body must be a JSON object".to_owned());
    }
    let model = value["model"].as_str().unwrap_or_default().to_owned();
    let streaming = value["stream"].as_bool().unwrap_or(false);
    let wants_usage = value["stream_options"]["include_usage"]
        .as_bool()
        .unwrap_or(false);
    // The router measures TPOT and cached tokens from the usage chunk: it asks for it
    // and takes it out of the stream again when the client did not.
    let upstream = if streaming && !wants_usage {
        value["stream_options"] = json!({"include_usage": true});
        Bytes::from(value.to_string())
    } else {
        body.clone()
    };
    Ok((
        Request {
            model,
            streaming,
            wants_usage,
            upstream,
        },
        value,
    ))
}

async fn route(
    app: Arc<App>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
    span: tracing::Span,
) -> Response {
    let arrived = Instant::now();
    let active = Active::new(&app);
    let (request, value) = match read_request(&body) {
        Ok(parsed) => parsed,
        Err(message) => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                &message,
                None,
            );
        }
    };
    let Some(split) = app.live.split() else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "the router has not yet read which releases serve this model",
            Some(1),
        );
    };
    let draw = headers
        .get(&app.session_header)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty())
        .map_or_else(rand::random::<u64>, session_draw);
    let release = split.release(split.pick(draw)).to_owned();
    span.record("release", release.as_str());

    let text = prefix::prompt_text(&value);
    let prompt_chars = text.chars().count();
    let hashes = prefix::block_hashes(&text, app.block_chars);
    let prompt_blocks = prompt_chars.div_ceil(app.block_chars);
    let choice = app.live.choose(
        &release,
        &request.model,
        &hashes,
        prompt_blocks,
        &app.params,
        arrived,
    );
    for why in &choice.excluded {
        app.metrics.excluded(&release, why.as_str());
    }
    if choice.urls.is_empty()
        && !choice.excluded.is_empty()
        && choice
            .excluded
            .iter()
            .all(|&why| why == Exclusion::ModelNotServed)
    {
        // The client named a model no endpoint serves: its own mistake, answered as
        // the engine would (404), not a 503 to retry, and not counted against the SLO.
        let body = json!({"error": {
            "message": format!("model `{}` does not exist; see /v1/models", request.model),
            "type": "invalid_request_error",
            "param": null,
            "code": "model_not_found",
        }});
        return (StatusCode::NOT_FOUND, axum::Json(body)).into_response();
    }
    if choice.urls.is_empty() {
        let retry_after = retry::retry_after_when_all_busy(&choice.backoffs, Instant::now());
        app.metrics.request_ended(&release, Outcome::Rejected503);
        tracing::warn!(%release, excluded = choice.excluded.len(), "no endpoint can take the request");
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            &format!(
                "every endpoint of release {release} is saturated, backing off or not ready ({} known)",
                choice.excluded.len()
            ),
            Some(retry_after),
        );
    }
    let policy = if choice.fell_back {
        slipway_contract::RoutePolicy::LeastInFlight
    } else {
        app.params.policy
    };
    app.metrics.decided(&release, policy.as_str());

    let mut retries = 0;
    let mut last_refusal = None;
    for (i, url) in choice.urls.iter().enumerate() {
        let overlap = choice.overlap_blocks.get(i).copied().unwrap_or(0);
        span.record("endpoint", url.as_str());
        span.record("predicted_cached_blocks", overlap);
        let in_flight = app.live.start(
            url,
            prompt_blocks + 1,
            prompt_blocks.saturating_sub(overlap),
            &hashes,
        );
        let mut outgoing = HeaderMap::new();
        for name in &FORWARDED {
            if let Some(v) = headers.get(name) {
                outgoing.insert(name.clone(), v.clone());
            }
        }
        outgoing.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        inject_trace(&span, &headers, &mut outgoing);
        let sent = app
            .client
            .post(format!("{url}{}", uri.path()))
            .headers(outgoing)
            .body(request.upstream.clone())
            .send()
            .await;
        let failure = match sent {
            Err(e) => {
                tracing::warn!(%url, error = %e, "engine unreachable");
                app.live
                    .back_off(url, retry::backoff_for(None), Instant::now());
                Failure::Connect
            }
            Ok(response)
                if matches!(
                    response.status(),
                    StatusCode::SERVICE_UNAVAILABLE | StatusCode::TOO_MANY_REQUESTS
                ) =>
            {
                let retry_after = response
                    .headers()
                    .get(header::RETRY_AFTER)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| retry::parse_retry_after(v, unix_now()));
                app.live
                    .back_off(url, retry::backoff_for(retry_after), Instant::now());
                let failure = Failure::Status {
                    code: response.status().as_u16(),
                    retry_after,
                };
                last_refusal = Some(response);
                failure
            }
            Ok(response) => {
                span.record("retries", retries);
                let measure = Measure {
                    app: Arc::clone(&app),
                    release,
                    arrived,
                    streaming: request.streaming,
                    strip_usage: request.streaming && !request.wants_usage,
                    predicted_overlap_chars: overlap * app.block_chars,
                    prompt_chars,
                    slo: app.live.slo(),
                    status: response.status(),
                    first_token: None,
                    content_events: 0,
                    usage: None,
                    saw_done: false,
                    saw_error: false,
                    ended: false,
                    kept: Vec::new(),
                    in_flight,
                    _active: active,
                };
                return relay(response, measure, span);
            }
        };
        drop(in_flight);
        let reason = match failure {
            Failure::Connect => "connect",
            Failure::Status { code: 429, .. } => "429",
            _ => "503",
        };
        match app.retry.after(&failure, retries, arrived.elapsed()) {
            Next::RetryOnNext if i + 1 < choice.urls.len() => {
                retries += 1;
                app.metrics.retried(&release, reason);
                tracing::info!(%url, reason, retries, "retrying on the next endpoint");
            }
            _ => break,
        }
    }
    span.record("retries", retries);
    // Every attempt failed before a byte reached the client.
    match last_refusal {
        Some(response) => {
            let outcome = if response.status() == StatusCode::TOO_MANY_REQUESTS {
                Outcome::Rejected429
            } else {
                Outcome::Rejected503
            };
            app.metrics.request_ended(&release, outcome);
            let status = response.status();
            let mut out = Response::builder().status(status);
            for name in &RELAYED {
                if let Some(v) = response.headers().get(name) {
                    out = out.header(name, v);
                }
            }
            let body = response.bytes().await.unwrap_or_default();
            out.body(Body::from(body))
                .unwrap_or_else(|_| StatusCode::BAD_GATEWAY.into_response())
        }
        None => {
            app.metrics.request_ended(&release, Outcome::Rejected503);
            error(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                &format!("no endpoint of release {release} could be reached"),
                Some(1),
            )
        }
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The engine's `usage`, as far as the router reads it.
#[derive(Clone, Copy, Debug, Default)]
struct Usage {
    prompt: u64,
    completion: u64,
    cached: u64,
}

fn usage_of(v: &Value) -> Option<Usage> {
    let u = v.get("usage").filter(|u| u.is_object())?;
    Some(Usage {
        prompt: u["prompt_tokens"].as_u64().unwrap_or(0),
        completion: u["completion_tokens"].as_u64().unwrap_or(0),
        cached: u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0),
    })
}

/// What the router measures of one relayed answer, recorded once when it ends (or is
/// dropped: the client went away).
struct Measure {
    app: Arc<App>,
    release: String,
    arrived: Instant,
    streaming: bool,
    strip_usage: bool,
    predicted_overlap_chars: usize,
    prompt_chars: usize,
    slo: SloTargets,
    status: StatusCode,
    first_token: Option<Instant>,
    content_events: u64,
    usage: Option<Usage>,
    saw_done: bool,
    saw_error: bool,
    ended: bool,
    /// A non-streamed answer, kept to read its usage at the end.
    kept: Vec<u8>,
    in_flight: InFlight,
    _active: Active,
}

impl Measure {
    /// Reads one SSE event (without its blank line); returns whether to pass it on.
    fn event(&mut self, event: &str) -> bool {
        let Some(data) = event
            .lines()
            .find_map(|l| l.strip_prefix("data:").map(str::trim_start))
        else {
            return true;
        };
        if data == "[DONE]" {
            self.saw_done = true;
            return true;
        }
        let Ok(v) = serde_json::from_str::<Value>(data) else {
            return true;
        };
        if v.get("error").is_some() {
            self.saw_error = true;
        }
        let choice = &v["choices"][0];
        let content = choice["delta"]["content"]
            .as_str()
            .or_else(|| choice["text"].as_str())
            .unwrap_or_default();
        if !content.is_empty() {
            self.content_events += 1;
            if self.first_token.is_none() {
                self.first_token = Some(Instant::now());
                // Its prefill is done: no longer part of the endpoint's backlog.
                self.in_flight.first_token();
            }
        }
        if let Some(usage) = usage_of(&v) {
            self.usage = Some(usage);
            // The usage-only chunk the router asked for on the client's behalf.
            let usage_only = v["choices"].as_array().is_none_or(Vec::is_empty);
            return !(self.strip_usage && usage_only);
        }
        true
    }

    fn outcome(&self) -> Option<Outcome> {
        match self.status.as_u16() {
            200..=299 if self.streaming && (self.saw_error || !self.saw_done) => {
                Some(Outcome::Error)
            }
            200..=299 => Some(Outcome::Ok),
            429 => Some(Outcome::Rejected429),
            503 => Some(Outcome::Rejected503),
            500..=599 => Some(Outcome::Error),
            // The client's own mistake (a bad body, an unknown model): not the
            // service's availability.
            _ => None,
        }
    }

    /// Records the request, once.
    fn end(&mut self, cancelled: bool) {
        if std::mem::replace(&mut self.ended, true) {
            return;
        }
        let m = &self.app.metrics;
        let rel = self.release.as_str();
        m.in_flight(rel, -1);
        if !self.streaming && self.usage.is_none() {
            self.usage = serde_json::from_slice::<Value>(&self.kept)
                .ok()
                .as_ref()
                .and_then(usage_of);
        }
        let outcome = if cancelled {
            Some(Outcome::Cancelled)
        } else {
            self.outcome()
        };
        let Some(outcome) = outcome else {
            return;
        };
        m.request_ended(rel, outcome);
        if let Some(u) = self.usage {
            // The index counts characters; the engine tokens: scale by this prompt's
            // own characters per token, in whole KV blocks as the engine caches them.
            let predicted = if self.prompt_chars == 0 {
                0
            } else {
                let tokens =
                    self.predicted_overlap_chars as u64 * u.prompt / self.prompt_chars as u64;
                (tokens.min(u.prompt.saturating_sub(1)) / KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS
            };
            m.prefix_outcome(rel, predicted, u.cached, u.prompt, KV_BLOCK_TOKENS);
        }
        if outcome != Outcome::Ok {
            return;
        }
        let e2e = self.arrived.elapsed();
        m.observe_e2e(rel, e2e.as_secs_f64());
        let tokens = self.usage.map_or(self.content_events, |u| {
            u.completion.max(self.content_events)
        });
        let met = if self.streaming {
            let ttft = self
                .first_token
                .map_or(e2e, |t| t.duration_since(self.arrived));
            m.observe_ttft(rel, ttft.as_secs_f64());
            let tpot = time_per_output_token(ttft.as_secs_f64(), e2e.as_secs_f64(), tokens);
            if let Some(tpot) = tpot {
                m.observe_tpot(rel, tpot);
            }
            self.slo.met_seconds(Some(ttft.as_secs_f64()), tpot)
        } else {
            // Unstreamed, the first token reaches the client with the last: the answer
            // met the SLO if it came no later than both targets allow.
            let budget = self.slo.ttft
                + self
                    .slo
                    .tpot
                    .saturating_mul(u32::try_from(tokens.saturating_sub(1)).unwrap_or(u32::MAX));
            e2e <= budget
        };
        if met {
            m.slo_met(rel);
        }
    }
}

impl Drop for Measure {
    fn drop(&mut self) {
        // Dropped before the end: the client went away mid-answer.
        self.end(true);
    }
}

fn sse_error(message: &str) -> Bytes {
    let event = json!({"error": {"message": message, "type": "server_error", "param": null, "code": "upstream_error"}});
    Bytes::from(format!("data: {event}\n\ndata: [DONE]\n\n"))
}

fn relay(response: reqwest::Response, measure: Measure, span: tracing::Span) -> Response {
    measure.app.metrics.in_flight(&measure.release, 1);
    let mut out = Response::builder().status(response.status());
    for name in &RELAYED {
        if let Some(v) = response.headers().get(name) {
            out = out.header(name, v);
        }
    }
    let body = Body::from_stream(relay_stream(response.bytes_stream(), measure, span));
    out.body(body)
        .unwrap_or_else(|_| StatusCode::BAD_GATEWAY.into_response())
}

struct RelayState<S> {
    upstream: S,
    measure: Measure,
    /// Bytes of a stream not yet split into whole events.
    pending: String,
    finished: bool,
    span: tracing::Span,
}

fn relay_stream<S>(
    upstream: S,
    measure: Measure,
    span: tracing::Span,
) -> impl Stream<Item = Result<Bytes, std::io::Error>> + Send
where
    S: Stream<Item = reqwest::Result<Bytes>> + Send + Unpin + 'static,
{
    let state = RelayState {
        upstream,
        measure,
        pending: String::new(),
        finished: false,
        span,
    };
    futures::stream::unfold(state, |mut st| async move {
        if st.finished {
            return None;
        }
        loop {
            match st.upstream.next().await {
                Some(Ok(chunk)) => {
                    if !st.measure.streaming {
                        if st.measure.kept.len() + chunk.len() <= MAX_KEPT_BODY {
                            st.measure.kept.extend_from_slice(&chunk);
                        }
                        return Some((Ok(chunk), st));
                    }
                    st.pending.push_str(&String::from_utf8_lossy(&chunk));
                    let mut out = String::new();
                    while let Some(end) = st.pending.find("\n\n") {
                        let event: String = st.pending.drain(..end + 2).collect();
                        if st.measure.event(event.trim_end_matches('\n')) {
                            out.push_str(&event);
                        }
                    }
                    // `[DONE]` ends the answer as the client sees it: record it before
                    // relaying it, so a client that stops reading there and closes the
                    // connection before the engine's body ends (as most do) is counted
                    // as served, not as cancelled when the relay is dropped.
                    if st.measure.saw_done {
                        st.measure.end(false);
                    }
                    if !out.is_empty() {
                        return Some((Ok(Bytes::from(out)), st));
                    }
                }
                // After `[DONE]` the client has the whole answer: nothing to add.
                Some(Err(_)) if st.measure.saw_done => return None,
                Some(Err(e)) => {
                    st.finished = true;
                    let _enter = st.span.enter();
                    tracing::warn!(error = %e, "engine broke off mid-answer");
                    drop(_enter);
                    st.measure.saw_error = true;
                    st.measure.end(false);
                    if st.measure.streaming {
                        return Some((
                            Ok(sse_error(&format!(
                                "the engine broke off the answer: {e}; it is not retried after the first byte"
                            ))),
                            st,
                        ));
                    }
                    return Some((Err(std::io::Error::other(e)), st));
                }
                None => {
                    st.finished = true;
                    let cut = st.measure.streaming && !st.measure.saw_done;
                    st.measure.end(false);
                    if cut {
                        return Some((
                            Ok(sse_error(
                                "the engine ended the stream without finishing it",
                            )),
                            st,
                        ));
                    }
                    return None;
                }
            }
        }
    })
}
