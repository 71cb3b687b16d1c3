//! A small in-process OpenAI-compatible server with injected latencies and failures,
//! so the load generator's accounting can be checked against known ground truth.
//!
//! Behaviour is a pure function of the request tag ("Request {i}:") in the prompt, so
//! which request is rejected, fails or hangs does not depend on arrival order.

#![allow(dead_code, clippy::unwrap_used)]

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::stream::{self, StreamExt};
use serde_json::{Value, json};
use slipway_contract::metrics::{MODEL_LABEL, RELEASE_LABEL, RUNNING, WAITING};

/// What the fake server does.
#[derive(Debug, Clone, Default)]
pub struct Behaviour {
    /// Delay before the first token.
    pub ttft: Duration,
    /// Delay between tokens.
    pub tpot: Duration,
    /// Request `i` with `i % n == 1` gets 429 with `Retry-After: 2`.
    pub reject_every: Option<u64>,
    /// Request `i` with `i % n == 2` gets 503 without `Retry-After`.
    pub overload_every: Option<u64>,
    /// Request `i` with `i % n == 3` gets 500.
    pub fail_every: Option<u64>,
    /// Request `i` with `i % n == 0` sends one token and then never finishes.
    pub hang_every: Option<u64>,
    /// Reject with 503 whenever more than this many streams are already running.
    pub max_running: Option<usize>,
    /// Added to the running count `/metrics` reports: a server whose gauge counts
    /// requests it does not hold (0: the gauge is honest).
    pub phantom_running: usize,
}

#[derive(Clone)]
struct AppState {
    b: Arc<Behaviour>,
    running: Arc<AtomicUsize>,
}

/// Decrements the running count when the stream (or the rejected response) is dropped.
struct Running(Arc<AtomicUsize>);
impl Drop for Running {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn tag(text: &str) -> u64 {
    text.split("Request ")
        .nth(1)
        .and_then(|s| s.split(':').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

async fn handle(state: AppState, body: Value, chat: bool) -> Response {
    let prompt = if chat {
        body["messages"]
            .as_array()
            .and_then(|m| m.last())
            .and_then(|m| m["content"].as_str())
            .unwrap_or("")
            .to_owned()
    } else {
        body["prompt"].as_str().unwrap_or("").to_owned()
    };
    let i = tag(&prompt);
    let n_out = body["max_tokens"].as_u64().unwrap_or(4);
    let hit = |every: Option<u64>, r: u64| every.is_some_and(|n| i % n == r);
    let b = state.b.clone();
    if hit(b.reject_every, 1) {
        let mut h = HeaderMap::new();
        h.insert("retry-after", HeaderValue::from_static("2"));
        return (
            StatusCode::TOO_MANY_REQUESTS,
            h,
            Json(json!({"error": {"message": "tenant over rate"}})),
        )
            .into_response();
    }
    if hit(b.overload_every, 2) {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"error": {"message": "overloaded"}})),
        )
            .into_response();
    }
    if hit(b.fail_every, 3) {
        return (StatusCode::INTERNAL_SERVER_ERROR, "boom").into_response();
    }
    let now = state.running.fetch_add(1, Ordering::SeqCst);
    let guard = Running(state.running.clone());
    if b.max_running.is_some_and(|m| now >= m) {
        drop(guard);
        let mut h = HeaderMap::new();
        h.insert("retry-after", HeaderValue::from_static("1"));
        return (StatusCode::SERVICE_UNAVAILABLE, h, "busy").into_response();
    }
    let hang = hit(b.hang_every, 0);
    let prompt_tokens = prompt.split_whitespace().count();
    let events = stream::unfold(0u64, move |k| {
        let b = b.clone();
        async move {
            if k == 0 {
                tokio::time::sleep(b.ttft).await;
            } else if k < n_out {
                if hang {
                    std::future::pending::<()>().await;
                }
                tokio::time::sleep(b.tpot).await;
            }
            let data = if k < n_out {
                let fin = if k + 1 == n_out { json!("length") } else { Value::Null };
                if chat {
                    json!({"choices": [{"index": 0, "delta": {"content": " tok"}, "finish_reason": fin}]}).to_string()
                } else {
                    json!({"choices": [{"index": 0, "text": " tok", "finish_reason": fin}]}).to_string()
                }
            } else if k == n_out {
                json!({"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n_out, "total_tokens": prompt_tokens as u64 + n_out}}).to_string()
            } else if k == n_out + 1 {
                "[DONE]".to_owned()
            } else {
                return None;
            };
            Some((Ok::<_, Infallible>(Event::default().data(data)), k + 1))
        }
    })
    // Holds the running slot until the stream is dropped (finished or disconnected).
    .map(move |e| {
        let _ = &guard;
        e
    });
    Sse::new(events).into_response()
}

/// The engine's gauges of requests running (the streams being served) and waiting
/// (none: the fake server queues nothing), as the engine names them.
async fn metrics(State(s): State<AppState>) -> String {
    let running = s.running.load(Ordering::SeqCst) + s.b.phantom_running;
    let gauge = |name: &str, value: usize| {
        format!(
            "# TYPE {name} gauge\n{name}{{{MODEL_LABEL}=\"fake\",{RELEASE_LABEL}=\"test\"}} {value}\n"
        )
    };
    gauge(RUNNING, running) + &gauge(WAITING, 0)
}

/// Starts the fake server on 127.0.0.1 with an ephemeral port; returns its base URL.
pub async fn start(b: Behaviour) -> String {
    let state = AppState {
        b: Arc::new(b),
        running: Arc::new(AtomicUsize::new(0)),
    };
    let app = Router::new()
        .route(
            "/v1/completions",
            post(|State(s): State<AppState>, Json(v): Json<Value>| handle(s, v, false)),
        )
        .route(
            "/v1/chat/completions",
            post(|State(s): State<AppState>, Json(v): Json<Value>| handle(s, v, true)),
        )
        .route("/metrics", get(metrics))
        .with_state(state);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    format!("http://{addr}")
}
