//! Router tests on the real model through `tower::ServiceExt::oneshot`.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request as HttpRequest, StatusCode};
use tower::ServiceExt;

use super::*;
use crate::backend::cpu::{CpuBackend, CpuConfig};
use crate::backend::{BackendError, Batch, KvGeometry, Logits, ModelRunner};
use crate::model::gguf::GgufFile;
use crate::model::llama::{LlamaConfig, LlamaWeights};
use crate::serving::block_manager::BlockManagerConfig;
use crate::serving::engine::{BoxedRunner, EngineConfig, spawn_with_metrics};
use crate::serving::metrics::{ServingMetrics, SloTargets};
use crate::serving::scheduler::SchedulerConfig;
use crate::testing::model_path;

const MODEL: &str = "smollm2";

fn state() -> Arc<AppState> {
    state_with(admission::AdmissionConfig::default(), ApiConfig::default())
}

/// A state on the real model with these admission limits and API settings (the
/// pool-dependent and model-dependent fields are filled in here).
fn state_with(adm: admission::AdmissionConfig, api: ApiConfig) -> Arc<AppState> {
    state_on(adm, api, |r| Box::new(r))
}

/// The real model's runner with every forward step failing, as a broken forward
/// pass (a kernel or device error) would.
struct BrokenRunner(CpuBackend);

impl ModelRunner for BrokenRunner {
    fn config(&self) -> &LlamaConfig {
        self.0.config()
    }

    fn kv_geometry(&self) -> KvGeometry {
        self.0.kv_geometry()
    }

    fn forward(&mut self, _: &Batch) -> Result<Logits, BackendError> {
        Err(BackendError::InvalidBatch("broken on purpose".into()))
    }
}

/// Like [`state_with`], with the runner `wrap` makes of the real model's.
fn state_on(
    adm: admission::AdmissionConfig,
    api: ApiConfig,
    wrap: impl FnOnce(CpuBackend) -> BoxedRunner,
) -> Arc<AppState> {
    let path = model_path();
    let file = GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let weights = Arc::new(LlamaWeights::from_gguf(&file).expect("weights"));
    let tokenizer = Tokenizer::from_metadata(file.metadata()).expect("tokenizer");
    let template = ChatTemplate::from_metadata(file.metadata(), &tokenizer).expect("template");
    let runner = CpuBackend::new(
        weights,
        &CpuConfig {
            num_blocks: 128,
            ..CpuConfig::default()
        },
    )
    .expect("backend");
    let g = runner.kv_geometry();
    let config = EngineConfig {
        scheduler: SchedulerConfig {
            max_num_seqs: 8,
            max_batched_tokens: 256,
            max_model_len: 512,
            blocks: BlockManagerConfig {
                num_blocks: g.num_blocks,
                block_size: g.block_size,
                enable_prefix_cache: true,
            },
        },
        command_capacity: 16,
        ..EngineConfig::default()
    };
    let metrics = Arc::new(ServingMetrics::new(MODEL, "test"));
    let (engine, _task) =
        spawn_with_metrics(wrap(runner), config, Arc::clone(&metrics)).expect("config");
    let admission = Admission::new(admission::AdmissionConfig {
        max_num_seqs: 8,
        kv_budget_blocks: g.num_blocks,
        block_size: g.block_size,
        ..adm
    })
    .expect("admission");
    Arc::new(
        AppState::new(
            engine,
            ModelText {
                tokenizer: Arc::new(tokenizer),
                template: Some(template),
            },
            ApiConfig {
                model_name: MODEL.into(),
                kv_namespace: "test".into(),
                max_model_len: 512,
                kv_blocks: g.num_blocks,
                kv_block_size: g.block_size,
                ..api
            },
            admission,
            metrics,
        )
        .expect("state"),
    )
}

async fn send(
    app: &Router,
    method: &str,
    uri: &str,
    body: Body,
    json: bool,
) -> (StatusCode, String, Option<String>) {
    let mut req = HttpRequest::builder().method(method).uri(uri);
    if json {
        req = req.header("content-type", "application/json");
    }
    let resp = app
        .clone()
        .oneshot(req.body(body).expect("request"))
        .await
        .expect("infallible");
    let status = resp.status();
    let rid = resp
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .expect("body");
    (status, String::from_utf8_lossy(&bytes).into_owned(), rid)
}

async fn post(app: &Router, uri: &str, v: &Value) -> (StatusCode, Value) {
    let (s, b, rid) = send(app, "POST", uri, Body::from(v.to_string()), true).await;
    assert!(rid.is_some(), "no request id");
    (s, serde_json::from_str(&b).unwrap_or(Value::String(b)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_chat_models_and_stop_strings() {
    let app = router(state());
    let (s, v) = post(
        &app,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let text = v["choices"][0]["text"].as_str().expect("text").to_string();
    assert_eq!(v["usage"]["completion_tokens"], 12);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    // A stop string from the middle of that text cuts it there.
    let cut = text
        .char_indices()
        .nth(text.chars().count() / 2)
        .map_or(0, |(i, _)| i);
    let stop: String = text[cut..].chars().take(3).collect();
    let (_, v2) = post(
        &app,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0, "stop": [stop.clone()]}),
    )
    .await;
    let want = &text[..text.find(&stop).expect("stop occurs")];
    assert_eq!(v2["choices"][0]["text"], want);
    assert_eq!(v2["choices"][0]["finish_reason"], "stop");

    let (s, v) = post(
        &app,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "temperature": 0}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert!(v["choices"][0]["message"]["content"].is_string());

    let (s, b, _) = send(&app, "GET", "/v1/models", Body::empty(), false).await;
    assert_eq!(s, StatusCode::OK);
    assert!(b.contains(MODEL));
    assert_eq!(
        send(&app, "GET", "/health", Body::empty(), false).await.0,
        StatusCode::OK
    );
    assert_eq!(
        send(&app, "GET", "/ready", Body::empty(), false).await.0,
        StatusCode::OK
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_chat_sends_chunks_usage_and_done() {
    let app = router(state());
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Count to five."}],
                      "max_tokens": 6, "temperature": 0, "stream": true,
                      "stream_options": {"include_usage": true}});
    let (s, b, _) = send(
        &app,
        "POST",
        "/v1/chat/completions",
        Body::from(body.to_string()),
        true,
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{b}");
    let data: Vec<&str> = b.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(data.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).expect("json chunk"))
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let last = chunks.last().expect("usage chunk");
    assert_eq!(last["usage"]["completion_tokens"], 6);
    assert!(
        chunks
            .iter()
            .any(|c| c["choices"][0]["finish_reason"] == "length")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_get_openai_errors_and_the_server_keeps_serving() {
    let app = router(state());
    let long = "word ".repeat(700);
    let many_stops: Vec<String> = (0..100).map(|i| format!("s{i}")).collect();
    let ok_chat = |extra: Value| {
        let mut v = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
        if let (Some(o), Some(e)) = (v.as_object_mut(), extra.as_object()) {
            o.extend(e.clone());
        }
        v
    };
    let cases: Vec<(&str, &str, Body)> = vec![
        ("invalid JSON", "/v1/completions", Body::from("{not json")),
        ("not an object", "/v1/completions", Body::from("[1,2]")),
        (
            "invalid UTF-8",
            "/v1/completions",
            Body::from(vec![b'{', 0xff, 0xfe, b'}']),
        ),
        (
            "missing prompt",
            "/v1/completions",
            Body::from(json!({"model": MODEL}).to_string()),
        ),
        (
            "missing model",
            "/v1/completions",
            Body::from(json!({"prompt": "x"}).to_string()),
        ),
        (
            "wrong type prompt",
            "/v1/completions",
            Body::from(json!({"model": MODEL, "prompt": 5}).to_string()),
        ),
        (
            "empty prompt",
            "/v1/completions",
            Body::from(json!({"model": MODEL, "prompt": ""}).to_string()),
        ),
        (
            "prompt over context",
            "/v1/completions",
            Body::from(json!({"model": MODEL, "prompt": long}).to_string()),
        ),
        (
            "max_tokens 0",
            "/v1/completions",
            Body::from(json!({"model": MODEL, "prompt": "x", "max_tokens": 0}).to_string()),
        ),
        (
            "max_tokens negative",
            "/v1/completions",
            Body::from(json!({"model": MODEL, "prompt": "x", "max_tokens": -3}).to_string()),
        ),
        (
            "max_tokens absurd",
            "/v1/completions",
            Body::from(
                json!({"model": MODEL, "prompt": "x", "max_tokens": 10_000_000_000i64}).to_string(),
            ),
        ),
        (
            "temperature negative",
            "/v1/completions",
            Body::from(json!({"model": MODEL, "prompt": "x", "temperature": -1}).to_string()),
        ),
        (
            "top_p zero",
            "/v1/completions",
            Body::from(json!({"model": MODEL, "prompt": "x", "top_p": 0}).to_string()),
        ),
        (
            "unknown model",
            "/v1/completions",
            Body::from(json!({"model": "gpt-9", "prompt": "x"}).to_string()),
        ),
        (
            "n = 2",
            "/v1/completions",
            Body::from(json!({"model": MODEL, "prompt": "x", "n": 2}).to_string()),
        ),
        (
            "unknown field",
            "/v1/completions",
            Body::from(json!({"model": MODEL, "prompt": "x", "best_of": 3}).to_string()),
        ),
        (
            "huge stop list",
            "/v1/completions",
            Body::from(json!({"model": MODEL, "prompt": "x", "stop": many_stops}).to_string()),
        ),
        (
            "stop wrong type",
            "/v1/completions",
            Body::from(json!({"model": MODEL, "prompt": "x", "stop": 7}).to_string()),
        ),
        (
            "stream_options without stream",
            "/v1/completions",
            Body::from(
                json!({"model": MODEL, "prompt": "x", "stream_options": {"include_usage": true}})
                    .to_string(),
            ),
        ),
        (
            "body over the limit",
            "/v1/completions",
            Body::from(vec![b' '; MAX_BODY_BYTES + 10]),
        ),
        (
            "unknown role",
            "/v1/chat/completions",
            Body::from(
                json!({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]})
                    .to_string(),
            ),
        ),
        (
            "non-string content",
            "/v1/chat/completions",
            Body::from(
                json!({"model": MODEL, "messages": [{"role": "user", "content": 42}]}).to_string(),
            ),
        ),
        (
            "image content part",
            "/v1/chat/completions",
            Body::from(
                json!({"model": MODEL, "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]})
                .to_string(),
            ),
        ),
        (
            "empty messages",
            "/v1/chat/completions",
            Body::from(json!({"model": MODEL, "messages": []}).to_string()),
        ),
        (
            "messages not a list",
            "/v1/chat/completions",
            Body::from(ok_chat(json!({"messages": "hi"})).to_string()),
        ),
        (
            "seed wrong type",
            "/v1/chat/completions",
            Body::from(ok_chat(json!({"seed": "abc"})).to_string()),
        ),
        (
            "unknown endpoint",
            "/v1/embeddings",
            Body::from(json!({}).to_string()),
        ),
    ];
    assert!(cases.len() >= 20);
    for (name, uri, body) in cases {
        let (s, b, rid) = send(&app, "POST", uri, body, true).await;
        assert!(s.is_client_error(), "{name}: status {s}, body {b}");
        assert!(rid.is_some(), "{name}: no request id");
        let v: Value =
            serde_json::from_str(&b).unwrap_or_else(|e| panic!("{name}: not JSON ({e}): {b}"));
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{name}: {v}"
        );
        assert!(v["error"]["type"].is_string(), "{name}: {v}");
    }
    // Without a JSON content type.
    let (s, b, _) = send(&app, "POST", "/v1/completions", Body::from("{}"), false).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{b}");
    assert!(b.contains("Content-Type"), "{b}");
    // Still serving.
    let (s, v) = post(&app, "/v1/chat/completions", &ok_chat(json!({}))).await;
    assert_eq!(s, StatusCode::OK, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_turns_ready_off_and_refuses_new_requests_with_retry_after() {
    let state = state();
    let app = router(Arc::clone(&state));
    // What `serve` does on SIGTERM.
    state.ready.store(false, Ordering::Relaxed);
    assert_eq!(
        send(&app, "GET", "/ready", Body::empty(), false).await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    let req = HttpRequest::builder()
        .method("POST")
        .uri("/v1/completions")
        .header("content-type", "application/json")
        .body(Body::from(
            json!({"model": MODEL, "prompt": "x"}).to_string(),
        ))
        .expect("request");
    let resp = app.clone().oneshot(req).await.expect("infallible");
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(resp.headers().contains_key("retry-after"));
    assert_eq!(
        send(&app, "GET", "/health", Body::empty(), false).await.0,
        StatusCode::OK
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_report_shows_requests_in_flight_their_blocks_and_draining() {
    let state = state();
    let app = router(Arc::clone(&state));
    let load = |app: Router| async move {
        let (status, body, _) = send(&app, "GET", "/load", Body::empty(), false).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        serde_json::from_str::<LoadReport>(&body).unwrap_or_else(|e| panic!("{e}: {body}"))
    };
    let idle = load(app.clone()).await;
    assert_eq!(idle.models, vec![MODEL.to_owned()]);
    assert_eq!((idle.kv_blocks_total, idle.kv_block_size), (128, 16));
    assert_eq!(
        (idle.running, idle.context_blocks, idle.draining),
        (0, 0, false)
    );

    // A stream held open after its first chunk is running and holds blocks.
    let req = HttpRequest::builder()
        .method("POST")
        .uri("/v1/completions")
        .header("content-type", "application/json")
        .body(Body::from(
            json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200,
                   "ignore_eos": true, "stream": true})
            .to_string(),
        ))
        .expect("request");
    let resp = app.clone().oneshot(req).await.expect("infallible");
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body().into_data_stream();
    let _first = futures::StreamExt::next(&mut body).await;
    let mut busy = load(app.clone()).await;
    for _ in 0..100 {
        if busy.running > 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        busy = load(app.clone()).await;
    }
    assert_eq!(busy.running, 1, "{busy:?}");
    // One request alone: its context is the blocks its prompt and first token hold.
    assert!(busy.context_blocks >= 1, "{busy:?}");
    drop(body);

    state.ready.store(false, Ordering::Relaxed);
    assert!(load(app).await.draining);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_client_can_drain_through_the_serving_port() {
    let state = state();
    let app = router(Arc::clone(&state));
    for (method, path) in [
        ("POST", "/admin/drain"),
        ("GET", "/admin/drain"),
        ("POST", "/drain"),
    ] {
        let (s, b, _) = send(&app, method, path, Body::empty(), false).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{method} {path}: {b}");
        assert!(b.contains("no such endpoint"), "{b}");
    }
    assert!(state.ready.load(Ordering::Relaxed), "still ready");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_output_tokens_is_enforced_and_is_the_default() {
    let app = router(state_with(
        admission::AdmissionConfig::default(),
        ApiConfig {
            max_output_tokens: 16,
            ..ApiConfig::default()
        },
    ));
    let ask = |extra: Value| {
        let mut v = json!({"model": MODEL, "prompt": "Once upon a time", "temperature": 0,
                           "ignore_eos": true});
        if let (Some(body), Some(extra)) = (v.as_object_mut(), extra.as_object()) {
            body.extend(extra.clone());
        }
        v
    };
    let (s, v) = post(&app, "/v1/completions", &ask(json!({"max_tokens": 17}))).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("limit of 16 output tokens"), "{v}");
    assert_eq!(v["error"]["param"], "max_tokens");
    let (s, v) = post(
        &app,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "max_completion_tokens": 100}),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    // At the limit: served in full; unsaid: the limit is the default.
    for extra in [json!({"max_tokens": 16}), json!({})] {
        let (s, v) = post(&app, "/v1/completions", &ask(extra.clone())).await;
        assert_eq!(s, StatusCode::OK, "{extra}: {v}");
        assert_eq!(v["usage"]["completion_tokens"], 16, "{extra}: {v}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_content_may_be_a_list_of_text_parts() {
    let app = router(state());
    let ask = |content: Value| {
        json!({"model": MODEL, "messages": [{"role": "user", "content": content}],
               "max_tokens": 6, "temperature": 0})
    };
    let (s, plain) = post(&app, "/v1/chat/completions", &ask(json!("Say hi.\nNow."))).await;
    assert_eq!(s, StatusCode::OK, "{plain}");
    let (s, parts) = post(
        &app,
        "/v1/chat/completions",
        &ask(json!([{"type": "text", "text": "Say hi."}, {"type": "text", "text": "Now."}])),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{parts}");
    // Parts are joined with newlines: the same prompt, so the same greedy answer.
    assert_eq!(
        plain["usage"]["prompt_tokens"],
        parts["usage"]["prompt_tokens"]
    );
    assert_eq!(
        plain["choices"][0]["message"]["content"],
        parts["choices"][0]["message"]["content"]
    );
}

fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            let (name, v) = l.rsplit_once(' ')?;
            (name == series).then(|| v.parse().ok()).flatten()
        })
        .unwrap_or_else(|| panic!("{series} not in:\n{text}"))
}

async fn completion_tokens(r: Response) -> f64 {
    let b = axum::body::to_bytes(r.into_body(), usize::MAX)
        .await
        .expect("body");
    let v: Value = serde_json::from_slice(&b).expect("json");
    v["usage"]["completion_tokens"].as_f64().expect("usage")
}

async fn post_as(app: &Router, tenant: &str, v: &Value) -> Response {
    let req = HttpRequest::builder()
        .method("POST")
        .uri("/v1/completions")
        .header("content-type", "application/json")
        .header("x-tenant", tenant)
        .body(Body::from(v.to_string()))
        .expect("request");
    app.clone().oneshot(req).await.expect("infallible")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_over_their_rate_get_429_and_metrics_count_outcomes() {
    // SLO targets no request here can miss, so the SLO-met count is exact.
    let generous = SloTargets {
        ttft: Duration::from_secs(3600),
        tpot: Duration::from_secs(3600),
    };
    let st = state_with(
        admission::AdmissionConfig {
            tenant_rate: Some(admission::TenantRate {
                tokens_per_s: 0.5,
                burst: 40.0,
            }),
            ..admission::AdmissionConfig::default()
        },
        ApiConfig {
            slo: generous,
            ..ApiConfig::default()
        },
    );
    let app = router(Arc::clone(&st));
    // Each costs its prompt plus 16 tokens: the burst of 40 holds one at a time.
    let req = json!({"model": MODEL, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0});
    let mut generated = Vec::new();
    let r = post_as(&app, "alice", &req).await;
    assert_eq!(r.status(), StatusCode::OK);
    generated.push(completion_tokens(r).await);
    let r = post_as(&app, "alice", &req).await;
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = r.headers()["retry-after"]
        .to_str()
        .expect("ascii")
        .parse()
        .expect("seconds");
    assert!(retry >= 1, "{retry}");
    let b = axum::body::to_bytes(r.into_body(), usize::MAX)
        .await
        .expect("body");
    let v: Value = serde_json::from_slice(&b).expect("json");
    assert_eq!(v["error"]["code"], "rate_limit_exceeded", "{v}");
    // Another tenant is not limited by alice's use.
    let r = post_as(&app, "bob", &req).await;
    assert_eq!(r.status(), StatusCode::OK);
    generated.push(completion_tokens(r).await);
    let total: f64 = generated.iter().sum();

    let lab = format!("{{model=\"{MODEL}\",release=\"test\"}}");
    // The engine task updates its gauges on its next loop after the last token was
    // sent, which can be just after the response ended: wait for it to settle.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let text = loop {
        let (s, text, _) = send(&app, "GET", "/metrics", Body::empty(), false).await;
        assert_eq!(s, StatusCode::OK);
        let running = metric(&text, &format!("slipway_num_requests_running{lab}"));
        if running == 0.0 || std::time::Instant::now() > deadline {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let l = |o: &str| {
        format!("slipway_requests_total{{model=\"{MODEL}\",release=\"test\",outcome=\"{o}\"}}")
    };
    assert_eq!(metric(&text, &l("ok")), 2.0);
    assert_eq!(metric(&text, &l("rejected_429")), 1.0);
    assert_eq!(metric(&text, &l("rejected_503")), 0.0);
    assert_eq!(
        metric(&text, &format!("slipway_generation_tokens_total{lab}")),
        total
    );
    assert_eq!(
        metric(
            &text,
            &format!("slipway_time_to_first_token_seconds_count{lab}")
        ),
        2.0
    );
    assert_eq!(
        metric(
            &text,
            &format!("slipway_e2e_request_latency_seconds_count{lab}")
        ),
        2.0
    );
    assert_eq!(
        metric(
            &text,
            &format!("slipway_inter_token_latency_seconds_count{lab}")
        ),
        total - 2.0
    );
    assert_eq!(
        metric(&text, &format!("slipway_num_requests_running{lab}")),
        0.0
    );
    assert_eq!(
        metric(&text, &format!("slipway_kv_cache_usage_perc{lab}")),
        0.0
    );
    let prompt = metric(&text, &format!("slipway_prompt_tokens_total{lab}"));
    assert_eq!(
        metric(&text, &format!("slipway_prefix_cache_queries_total{lab}")),
        prompt
    );
    // Both successful requests met the (generous) SLO; the rejected one is not
    // counted.
    assert_eq!(
        metric(&text, &format!("slipway_requests_slo_met_total{lab}")),
        2.0
    );
    // OpenMetrics on request.
    let req = HttpRequest::builder()
        .uri("/metrics")
        .header("accept", "application/openmetrics-text;version=1.0.0")
        .body(Body::empty())
        .expect("request");
    let r = app.clone().oneshot(req).await.expect("infallible");
    assert!(
        r.headers()["content-type"]
            .to_str()
            .expect("ascii")
            .starts_with("application/openmetrics-text")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn injected_faults_fail_that_share_of_requests_with_500() {
    let always = state_with(
        admission::AdmissionConfig::default(),
        ApiConfig {
            faults: FaultConfig {
                error_rate: 1.0,
                seed: 7,
            },
            ..ApiConfig::default()
        },
    );
    let app = router(Arc::clone(&always));
    let (s, v) = post(
        &app,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "x", "max_tokens": 2}),
    )
    .await;
    assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR, "{v}");
    assert_eq!(v["error"]["type"], "server_error");
    assert_eq!(always.metrics.requests(Outcome::Error), 1);
    assert_eq!(always.admission.load().in_flight, 0);
    // A rate outside [0, 1] is refused.
    let bad = ApiConfig {
        faults: FaultConfig {
            error_rate: 1.5,
            seed: 0,
        },
        ..ApiConfig::default()
    };
    assert_eq!(bad.validate(), Err(ApiConfigError::ErrorRate(1.5)));
}

/// The `data:` payloads of an SSE body, the last one `[DONE]`.
fn sse_data(body: &str) -> Vec<&str> {
    let data: Vec<&str> = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{body}");
    data
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_forward_step_is_a_500_without_retry_after() {
    let state = state_on(
        admission::AdmissionConfig::default(),
        ApiConfig::default(),
        |r| Box::new(BrokenRunner(r)),
    );
    let app = router(Arc::clone(&state));
    let req = HttpRequest::builder()
        .method("POST")
        .uri("/v1/completions")
        .header("content-type", "application/json")
        .body(Body::from(
            json!({"model": MODEL, "prompt": "x", "max_tokens": 2}).to_string(),
        ))
        .expect("request");
    let resp = app.clone().oneshot(req).await.expect("infallible");
    assert_eq!(resp.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert!(!resp.headers().contains_key("retry-after"));
    let b = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .expect("body");
    let v: Value = serde_json::from_slice(&b).expect("JSON error");
    assert_eq!(v["error"]["type"], "server_error", "{v}");
    assert_eq!(v["error"]["code"], "engine_error", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("broken on purpose")),
        "{v}"
    );
    // A stream has started (200) when the step fails: it ends with the same error.
    let (s, b, _) = send(
        &app,
        "POST",
        "/v1/completions",
        Body::from(
            json!({"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": true}).to_string(),
        ),
        true,
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{b}");
    let data = sse_data(&b);
    let err: Value = serde_json::from_str(data[data.len() - 2]).expect("an error object");
    assert_eq!(err["error"]["type"], "server_error", "{err}");
    assert_eq!(err["error"]["code"], "engine_error", "{err}");
    assert_eq!(state.metrics.requests(Outcome::Error), 2);
    assert_eq!(state.admission.load().in_flight, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_aborted_at_shutdown_are_503s_with_retry_after() {
    let state = state();
    let app = router(Arc::clone(&state));
    let long = |stream: bool| {
        json!({"model": MODEL, "prompt": "A very long story:", "max_tokens": 400,
               "ignore_eos": true, "stream": stream})
        .to_string()
    };
    let whole = {
        let app = app.clone();
        let body = long(false);
        tokio::spawn(async move {
            let req = HttpRequest::builder()
                .method("POST")
                .uri("/v1/completions")
                .header("content-type", "application/json")
                .body(Body::from(body))
                .expect("request");
            app.oneshot(req).await.expect("infallible")
        })
    };
    let streaming = {
        let app = app.clone();
        let body = long(true);
        tokio::spawn(
            async move { send(&app, "POST", "/v1/completions", Body::from(body), true).await },
        )
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while state.engine.stats().await.expect("running").running < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "the requests never ran"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // What `serve` does when the drain's shutdown budget is over.
    state
        .engine
        .abort_all("the server shut down before this request finished")
        .await
        .expect("running");
    let resp = whole.await.expect("request task");
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        resp.headers().get("retry-after").map(|v| v.as_bytes()),
        Some(FAILED_RETRY_AFTER_SECS.to_string().as_bytes())
    );
    let b = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .expect("body");
    let v: Value = serde_json::from_slice(&b).expect("JSON error");
    assert_eq!(v["error"]["type"], "service_unavailable", "{v}");
    assert_eq!(v["error"]["code"], "request_aborted", "{v}");
    assert_eq!(
        v["error"]["message"],
        "the server shut down before this request finished"
    );
    let (s, b, _) = streaming.await.expect("stream task");
    assert_eq!(s, StatusCode::OK, "{b}");
    let data = sse_data(&b);
    let err: Value = serde_json::from_str(data[data.len() - 2]).expect("an error object");
    assert_eq!(err["error"]["type"], "service_unavailable", "{err}");
    assert_eq!(err["error"]["code"], "request_aborted", "{err}");
    assert_eq!(state.metrics.requests(Outcome::Error), 2);
    assert_eq!(state.admission.load().in_flight, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ignore_eos_generates_exactly_max_tokens() {
    let app = router(state());
    let body = |ignore: bool| {
        json!({"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}],
               "max_tokens": 64, "temperature": 0, "ignore_eos": ignore})
    };
    // The model ends this answer by itself well within 64 tokens...
    let (s, v) = post(&app, "/v1/chat/completions", &body(false)).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    // ...unless told to ignore end-of-generation tokens.
    let (s, v) = post(&app, "/v1/chat/completions", &body(true)).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 64, "{v}");
}
