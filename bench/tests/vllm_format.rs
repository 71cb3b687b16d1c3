//! The client against vLLM's streaming format, without vLLM: an in-process server
//! replays recorded-shape vLLM SSE bodies (`tests/fixtures/vllm-*.sse`) event by
//! event, and the client must fill the record as it would against vLLM itself.

#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::header;
use axum::response::Response;
use axum::routing::post;
use futures::stream::{self, StreamExt};
use serde_json::Value;
use slipway_bench::client::{Client, ClientConfig, RunClock};
use slipway_bench::record::{Outcome, RequestRecord};
use slipway_bench::workload::{Api, RequestPlan};
use tokio::sync::watch;

const COMPLETIONS: &str = include_str!("fixtures/vllm-completions.sse");
const CHAT: &str = include_str!("fixtures/vllm-chat.sse");
const GAP: Duration = Duration::from_millis(30);

type Seen = Arc<Mutex<Vec<Value>>>;

/// Streams `fixture` one event at a time, `GAP` apart, as vLLM paces tokens.
fn replay(fixture: &'static str) -> Response {
    let events: Vec<Bytes> = fixture
        .split_inclusive("\n\n")
        .map(|e| Bytes::from_static(e.as_bytes()))
        .collect();
    let body = stream::iter(events).then(|e| async move {
        tokio::time::sleep(GAP).await;
        Ok::<_, std::convert::Infallible>(e)
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .body(Body::from_stream(body))
        .unwrap()
}

async fn serve() -> (String, Seen) {
    let seen: Seen = Arc::default();
    let app = Router::new()
        .route(
            "/v1/completions",
            post(|State(s): State<Seen>, Json(b): Json<Value>| async move {
                s.lock().unwrap().push(b);
                replay(COMPLETIONS)
            }),
        )
        .route(
            "/v1/chat/completions",
            post(|State(s): State<Seen>, Json(b): Json<Value>| async move {
                s.lock().unwrap().push(b);
                replay(CHAT)
            }),
        )
        .with_state(Arc::clone(&seen));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, seen)
}

async fn send(url: &str, api: Api, max_tokens: u32) -> RequestRecord {
    let client = Client::new(ClientConfig {
        base_url: url.into(),
        model: "HuggingFaceTB/SmolLM2-135M-Instruct".into(),
        api,
        timeout: Duration::from_secs(30),
        api_key: None,
        ignore_eos: true,
    })
    .unwrap();
    let plan = RequestPlan {
        id: 0,
        arrival_s: 0.0,
        system: Some("You are terse.".into()),
        prompt: "Request 0: the river".into(),
        prompt_tokens: 12,
        max_tokens,
        tenant: Some("a".into()),
        deadline_ms: None,
    };
    let clock = RunClock::start();
    let mut rec = RequestRecord::new(&plan, 0.0);
    rec.sent_s = Some(clock.now_s());
    let (_stop_tx, stop) = watch::channel(false);
    client.send(&plan, &mut rec, clock, stop).await;
    rec
}

#[tokio::test]
async fn vllm_completions_stream_fills_the_record() {
    let (url, seen) = serve().await;
    let r = send(&url, Api::Completions, 5).await;
    assert_eq!(r.outcome, Outcome::Completed, "{r:?}");
    assert_eq!(r.http_status, Some(200));
    // Four chunks carried text; the empty one (a partial UTF-8 token) has no
    // timestamp, but N_out comes from vLLM's usage chunk.
    assert_eq!(r.token_s.len(), 4);
    assert_eq!(r.server_prompt_tokens, Some(12));
    assert_eq!(r.server_output_tokens, Some(5));
    assert_eq!(r.n_out(), 5);
    // Tokens arrive GAP apart: TTFT covers one gap, TPOT averages over N_out − 1 = 4
    // intervals that span the five remaining gaps up to [DONE].
    let ttft = r.ttft_s().unwrap();
    assert!(ttft >= GAP.as_secs_f64(), "ttft {ttft}");
    let tpot = r.tpot_s().unwrap();
    let e2e = r.e2e_s().unwrap();
    assert!((tpot - (e2e - ttft) / 4.0).abs() < 1e-12);
    assert!(e2e >= 7.0 * GAP.as_secs_f64(), "e2e {e2e}: ends at [DONE]");
    assert!(r.token_s.windows(2).all(|w| w[0] < w[1]));
    // What vLLM needs to stream usage and honour the workload's length.
    let body = seen.lock().unwrap()[0].clone();
    assert_eq!(body["stream"], true);
    assert_eq!(body["stream_options"]["include_usage"], true);
    assert_eq!(body["ignore_eos"], true);
    assert_eq!(body["max_tokens"], 5);
    assert_eq!(body["user"], "a");
    assert!(
        body["prompt"]
            .as_str()
            .unwrap()
            .starts_with("You are terse.\n\nRequest 0:")
    );
}

#[tokio::test]
async fn vllm_chat_stream_with_role_chunk_fills_the_record() {
    let (url, seen) = serve().await;
    let r = send(&url, Api::Chat, 3).await;
    assert_eq!(r.outcome, Outcome::Completed, "{r:?}");
    // The role-only first chunk is not a token: TTFT is the first content.
    assert_eq!(r.token_s.len(), 3);
    assert!(r.ttft_s().unwrap() >= 2.0 * GAP.as_secs_f64());
    assert_eq!(r.server_prompt_tokens, Some(20));
    assert_eq!(r.server_output_tokens, Some(3));
    let body = seen.lock().unwrap()[0].clone();
    assert_eq!(body["messages"][0]["role"], "system");
    assert_eq!(body["messages"][1]["content"], "Request 0: the river");
}
