//! The router in front of real `slipway-engine serve` processes on the real model, each
//! a process of its own, nothing mocked (issue #22, "Real engines"):
//! - two engines behind the router serve chat and completions, streamed and not, and
//!   the router counts them per release;
//! - a prefix-heavy run: the engines report cached tokens where the router's prefix
//!   index predicted them, and every system prompt stays on one engine;
//! - an engine killed mid-load: its streams end with an explicit SSE error event, and
//!   every later request is served by the other;
//! - a draining engine gets nothing new and still finishes its stream;
//! - a 10 % canary gets 10 % of requests (within binomial tolerance), and a session
//!   stays on one release;
//! - the router's own drain: a stream in flight completes, `/ready` turns 503, exit 0;
//! - a client that goes away mid-stream cancels its request in the engine.
//!
//! The engines run with `--threads 1` and small `max_tokens`, so each test takes a few
//! seconds on a 2-core machine; the tests of this file run one at a time ([`SERIAL`]),
//! so they never compete with each other for the cores. Nothing here asserts a timing;
//! every wait is bounded by a generous timeout and fails with what it was waiting for.
//!
//! Needs `target/<profile>/slipway-engine` (the workspace's `cargo test` builds it;
//! else `cargo build -p slipway-engine`) and the model (`make model`).

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use serde_json::{Value, json};
use slipway_contract::ServeArgs;
use slipway_contract::metrics::{self, counter_total, router as names};
use slipway_engine::testing::{EngineProcess, finish_reason, read_sse, serve_args};
use slipway_router::discovery::{STATIC_CANARY, STATIC_STABLE};
use slipway_router::split::session_draw;

const MODEL: &str = "smollm2";
/// Generous bound of every wait: a loaded 2-core machine is slow, never this slow.
const PATIENCE: Duration = Duration::from_secs(60);

/// One test at a time: each starts two or three processes that each want a core.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Flags for the engines of the tests that need a stream still running seconds after
/// it started (a drain, a kill): each decode step takes at least 40 ms (test-only
/// fault injection), so a long stream lasts as long on a fast build as on a slow one.
/// These tests once leaned on the dev build's slowness (100 ms and more a token); at a
/// few milliseconds a token, 96 tokens can end before the checks that need them running.
const PACED: &[&str] = &["--inject-delay-ms", "40"];

/// An engine with `--threads 1` and `extra` flags, its logs at `warn`.
fn engine(extra: &[&str]) -> EngineProcess {
    let args = ServeArgs {
        threads: Some(1),
        max_model_len: Some(2048),
        kv_blocks: Some(512),
        ..serve_args(MODEL)
    }
    .with_extra_args(extra)
    .unwrap_or_else(|e| panic!("{extra:?}: {e}"));
    let mut command = EngineProcess::command(&args);
    command.env("RUST_LOG", "warn");
    EngineProcess::spawn_command(command)
}

/// The router over `stable` (and `canary` at `weight` %), on a free port.
fn router(stable: &[&EngineProcess], canary: Option<(&EngineProcess, u8)>) -> EngineProcess {
    let urls = |engines: &[&EngineProcess]| {
        engines
            .iter()
            .map(|e| e.base().to_owned())
            .collect::<Vec<_>>()
            .join(",")
    };
    let mut command = Command::new(env!("CARGO_BIN_EXE_slipway-router"));
    command.args(["--port", "0", "--stable", &urls(stable)]);
    if let Some((engine, weight)) = canary {
        command.args([
            "--canary",
            engine.base(),
            "--canary-weight",
            &weight.to_string(),
        ]);
    }
    command.env("RUST_LOG", "warn").stderr(Stdio::inherit());
    EngineProcess::spawn_command(command)
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(PATIENCE)
        .build()
        .expect("an HTTP client")
}

/// Polls `check` every 50 ms until it gives a value, for at most [`PATIENCE`].
async fn eventually<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + PATIENCE;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the router has read the engines' load reports (its `/v1/models` comes
/// from them), so every test starts from the cost policy with a fresh view.
async fn wait_for_models(http: &reqwest::Client, router: &EngineProcess) {
    let url = router.url("/v1/models");
    eventually(
        "the router to list the model from the engines' load reports",
        || {
            let url = url.clone();
            async move {
                let v: Value = http.get(&url).send().await.ok()?.json().await.ok()?;
                (v["data"][0]["id"] == MODEL).then_some(())
            }
        },
    )
    .await;
}

async fn get_text(http: &reqwest::Client, url: &str) -> String {
    let response = http
        .get(url)
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"));
    response
        .text()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: reading the body: {e}"))
}

async fn scrape(http: &reqwest::Client, server: &EngineProcess) -> String {
    get_text(http, &server.url("/metrics")).await
}

/// The sum of the samples of `name` whose labels include `labels` (Prometheus text).
fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (family, rest) = series.split_once('{').unwrap_or((series, ""));
            let selected = family == name
                && labels
                    .iter()
                    .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")));
            selected.then(|| value.parse::<f64>().ok()).flatten()
        })
        .sum()
}

/// Requests an engine finished ok.
fn engine_ok(text: &str) -> f64 {
    sample(
        text,
        &counter_total(metrics::REQUESTS),
        &[(metrics::OUTCOME_LABEL, "ok")],
    )
}

/// Requests an engine answered, whatever their outcome.
fn engine_requests(text: &str) -> f64 {
    sample(text, &counter_total(metrics::REQUESTS), &[])
}

/// Requests the router finished with `outcome` for `release`.
fn router_requests(text: &str, release: &str, outcome: &str) -> f64 {
    sample(
        text,
        &counter_total(names::REQUESTS),
        &[
            (metrics::RELEASE_LABEL, release),
            (metrics::OUTCOME_LABEL, outcome),
        ],
    )
}

async fn post(http: &reqwest::Client, server: &EngineProcess, path: &str, body: &Value) -> Value {
    post_with(http, server, path, body, &[]).await
}

async fn post_with(
    http: &reqwest::Client,
    server: &EngineProcess,
    path: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> Value {
    let mut request = http.post(server.url(path)).json(body);
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    let response = request
        .send()
        .await
        .unwrap_or_else(|e| panic!("POST {path}: {e}"));
    let status = response.status();
    let text = response
        .text()
        .await
        .unwrap_or_else(|e| panic!("POST {path}: reading the body: {e}"));
    assert_eq!(status, 200, "POST {path} {body}: {text}");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("POST {path}: not JSON ({e}): {text}"))
}

/// Sends a streamed request and reads its SSE payloads to `[DONE]` or the end.
async fn stream(
    http: &reqwest::Client,
    server: &EngineProcess,
    path: &str,
    body: &Value,
    first: impl FnMut(),
) -> Vec<String> {
    let response = http
        .post(server.url(path))
        .json(body)
        .send()
        .await
        .unwrap_or_else(|e| panic!("POST {path} (stream): {e}"));
    assert_eq!(response.status(), 200, "POST {path} (stream) {body}");
    read_sse(response, first).await
}

/// The text of streamed chat or completion chunks.
fn streamed_text(payloads: &[String]) -> String {
    payloads
        .iter()
        .filter_map(|p| serde_json::from_str::<Value>(p).ok())
        .filter_map(|v| {
            let choice = &v["choices"][0];
            choice["delta"]["content"]
                .as_str()
                .or_else(|| choice["text"].as_str())
                .map(str::to_owned)
        })
        .collect()
}

/// The `error` objects among SSE payloads.
fn stream_errors(payloads: &[String]) -> Vec<Value> {
    payloads
        .iter()
        .filter_map(|p| serde_json::from_str::<Value>(p).ok())
        .filter_map(|v| v.get("error").cloned())
        .collect()
}

/// A stream that ended as a successful one does: no error, a finish reason, `[DONE]`.
fn assert_complete(payloads: &[String], what: &str) {
    assert!(
        stream_errors(payloads).is_empty(),
        "{what}: error event in {payloads:?}"
    );
    assert!(
        finish_reason(payloads).is_some(),
        "{what}: no finish_reason in {payloads:?}"
    );
    assert_eq!(
        payloads.last().map(String::as_str),
        Some("[DONE]"),
        "{what}: no [DONE]"
    );
}

/// A long stream: `max_tokens` tokens whatever the model would rather do.
fn long_stream(max_tokens: u32) -> Value {
    json!({
        "model": MODEL,
        "prompt": "Once upon a time, in a land far away,",
        "max_tokens": max_tokens,
        "ignore_eos": true,
        "temperature": 0,
        "stream": true,
    })
}

fn running(load: &Value) -> u64 {
    load["running"].as_u64().unwrap_or(0)
}

async fn load(http: &reqwest::Client, engine: &EngineProcess) -> Value {
    let text = get_text(http, &engine.url("/load")).await;
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("/load is not JSON ({e}): {text}"))
}

#[tokio::test]
async fn two_engines_serve_chat_and_completions_through_the_router_and_it_counts_them() {
    let _serial = SERIAL.lock().await;
    let (a, b) = (engine(&[]), engine(&[]));
    let router = router(&[&a, &b], None);
    let http = client();
    wait_for_models(&http, &router).await;

    let models: Value = serde_json::from_str(&get_text(&http, &router.url("/v1/models")).await)
        .expect("/v1/models is JSON");
    let ids: Vec<&str> = models["data"]
        .as_array()
        .expect("a model list")
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert_eq!(ids, [MODEL], "{models}");

    // Chat, whole and streamed (with and without the usage chunk): greedy, so the
    // streamed text is the whole answer's, chunk for chunk through the router.
    let chat = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8,
        "temperature": 0,
    });
    let whole = post(&http, &router, "/v1/chat/completions", &chat).await;
    assert_eq!(whole["object"], "chat.completion", "{whole}");
    let content = whole["choices"][0]["message"]["content"]
        .as_str()
        .expect("message content");
    assert!(!content.is_empty(), "{whole}");
    assert!(
        whole["usage"]["prompt_tokens"].as_u64() > Some(0),
        "{whole}"
    );

    let mut streamed = chat.clone();
    streamed["stream"] = json!(true);
    let payloads = stream(&http, &router, "/v1/chat/completions", &streamed, || {}).await;
    assert_complete(&payloads, "streamed chat");
    assert_eq!(streamed_text(&payloads), content);
    // The router asks the engine for the usage chunk (it measures TPOT from it) and
    // takes it out again when the client did not ask.
    assert!(
        payloads.iter().all(|p| !p.contains("\"usage\"")),
        "a usage chunk the client did not ask for: {payloads:?}"
    );
    streamed["stream_options"] = json!({"include_usage": true});
    let payloads = stream(&http, &router, "/v1/chat/completions", &streamed, || {}).await;
    assert_complete(&payloads, "streamed chat with usage");
    let usage: Vec<Value> = payloads
        .iter()
        .filter_map(|p| serde_json::from_str::<Value>(p).ok())
        .filter(|v| v["usage"].is_object())
        .collect();
    assert_eq!(usage.len(), 1, "one usage chunk: {payloads:?}");
    assert_eq!(
        usage[0]["usage"]["completion_tokens"],
        whole["usage"]["completion_tokens"]
    );

    // Completions, whole and streamed.
    let completion = json!({
        "model": MODEL,
        "prompt": "The capital of France is",
        "max_tokens": 6,
        "temperature": 0,
    });
    let whole = post(&http, &router, "/v1/completions", &completion).await;
    assert_eq!(whole["object"], "text_completion", "{whole}");
    let text = whole["choices"][0]["text"]
        .as_str()
        .expect("completion text");
    let mut streamed = completion.clone();
    streamed["stream"] = json!(true);
    let payloads = stream(&http, &router, "/v1/completions", &streamed, || {}).await;
    assert_complete(&payloads, "streamed completion");
    assert_eq!(streamed_text(&payloads), text);

    // A model no engine serves is the client's mistake: 404 as from the engine, not a
    // 503 to retry, and not a request the SLO counts.
    let unknown = http
        .post(router.url("/v1/completions"))
        .json(&json!({"model": "no-such-model", "prompt": "x", "max_tokens": 1}))
        .send()
        .await
        .expect("POST with an unknown model");
    assert_eq!(unknown.status(), 404);
    let body: Value = unknown.json().await.expect("an OpenAI error body");
    assert_eq!(body["error"]["code"], "model_not_found", "{body}");

    // Five requests, every one counted ok for the stable release, and every one served
    // by one of the two engines. A stream is counted when the engine's body ends,
    // which can be just after the client stopped reading at `[DONE]`.
    let metrics_url = router.url("/metrics");
    let routed = eventually("the router to count five requests ok", || {
        let (http, url) = (http.clone(), metrics_url.clone());
        async move {
            let text = http.get(&url).send().await.ok()?.text().await.ok()?;
            (router_requests(&text, STATIC_STABLE, "ok") >= 5.0).then_some(text)
        }
    })
    .await;
    assert_eq!(
        router_requests(&routed, STATIC_STABLE, "ok"),
        5.0,
        "{routed}"
    );
    assert_eq!(
        sample(&routed, &counter_total(names::REQUESTS), &[]),
        5.0,
        "only the five served requests count: {routed}"
    );
    let served = engine_ok(&scrape(&http, &a).await) + engine_ok(&scrape(&http, &b).await);
    assert_eq!(served, 5.0);
}

/// About 1,500 characters of system prompt on `topic`, distinct from the first word.
fn system_prompt(topic: &str) -> String {
    let mut text = format!("{topic} expert. You answer questions about {topic} only.");
    let mut n = 0;
    while text.chars().count() < 1500 {
        n += 1;
        text.push_str(&format!(
            " Rule {n} of {topic}: be precise, cite fact {} and keep the answer short.",
            n * 7 + topic.len()
        ));
    }
    text.chars().take(1500).collect()
}

#[tokio::test]
async fn prefix_heavy_requests_land_where_the_router_predicted_their_cached_tokens() {
    let _serial = SERIAL.lock().await;
    let (a, b) = (engine(&[]), engine(&[]));
    let router = router(&[&a, &b], None);
    let http = client();
    wait_for_models(&http, &router).await;

    const ROUNDS: usize = 4;
    let topics = ["Astronomy", "Cooking", "Sailing", "Gardening"];
    let predictions = counter_total(names::PREFIX_PREDICTIONS);
    let predicted_total = counter_total(names::PREDICTED_CACHED_TOKENS);
    let cached_total = counter_total(names::CACHED_TOKENS);
    let rel = (metrics::RELEASE_LABEL, STATIC_STABLE);
    // Per topic: which engine served each request (0 or 1), and per repeat the router's
    // prediction, the engine's cached tokens and the router's verdict.
    let mut served_by: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    let mut repeats = Vec::new();
    let mut fell_back = 0.0;
    // Interleaved, so each repeat comes after the other prompts went somewhere too.
    for round in 0..ROUNDS {
        for topic in topics {
            let body = json!({
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": system_prompt(topic)},
                    {"role": "user", "content": format!("Question {round}: one fact about {topic}, number {}.", round * 13 + 1)},
                ],
                "max_tokens": 2,
                "temperature": 0,
            });
            let before = (
                scrape(&http, &router).await,
                engine_ok(&scrape(&http, &a).await),
                engine_ok(&scrape(&http, &b).await),
            );
            let answer = post(&http, &router, "/v1/chat/completions", &body).await;
            let after = (
                scrape(&http, &router).await,
                engine_ok(&scrape(&http, &a).await),
                engine_ok(&scrape(&http, &b).await),
            );
            let engine = match (after.1 - before.1, after.2 - before.2) {
                (1.0, 0.0) => 0,
                (0.0, 1.0) => 1,
                other => panic!("one request, one engine's ok count should move: {other:?}"),
            };
            served_by.entry(topic).or_default().push(engine);
            let delta = |name: &str, labels: &[(&str, &str)]| {
                sample(&after.0, name, labels) - sample(&before.0, name, labels)
            };
            fell_back += delta(
                &counter_total(names::DECISIONS),
                &[rel, (names::POLICY_LABEL, "least-in-flight")],
            );
            let predicted = delta(&predicted_total, &[rel]);
            let cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_f64()
                .unwrap_or_else(|| panic!("no cached_tokens in {answer}"));
            assert_eq!(
                delta(&cached_total, &[rel]),
                cached,
                "the router counts the cached tokens the engine reported"
            );
            let verdict = ["matched", "over", "under"]
                .into_iter()
                .find(|r| delta(&predictions, &[rel, (names::RESULT_LABEL, r)]) == 1.0)
                .unwrap_or_else(|| panic!("no prediction verdict for {topic} round {round}"));
            if round > 0 {
                repeats.push((topic, round, predicted, cached, verdict));
            }
        }
    }
    eprintln!("served by: {served_by:?}");
    eprintln!("repeats (topic, round, predicted, cached, verdict): {repeats:?}");

    // The cost policy made the choices: an engine whose load report the router cannot
    // read (another build of the contract, say) leaves the view stale, and every choice
    // then falls back to least-in-flight, which can keep prompts in place by luck alone.
    let requests = (ROUNDS * topics.len()) as f64;
    assert!(
        fell_back < requests / 2.0,
        "{fell_back} of {requests} choices fell back to least-in-flight on a stale load view"
    );
    // Each system prompt stays where its cache is.
    for (topic, engines) in &served_by {
        assert!(
            engines.iter().all(|&e| e == engines[0]),
            "{topic} moved between engines: {engines:?} \
             ({fell_back} choices fell back to least-in-flight on a stale load view)"
        );
    }
    // Every repeat found its prefix cached (the system prompt is 26–28 blocks of 16
    // tokens), and the router predicted it within one block for most of them.
    for &(topic, round, _, cached, _) in &repeats {
        assert!(
            cached >= 320.0,
            "{topic} round {round}: only {cached} cached tokens"
        );
    }
    let matched = repeats.iter().filter(|r| r.4 == "matched").count();
    assert!(
        matched * 2 > repeats.len(),
        "only {matched} of {} repeats matched: {repeats:?}",
        repeats.len()
    );
    let routed = scrape(&http, &router).await;
    let (predicted, cached) = (
        sample(&routed, &predicted_total, &[rel]),
        sample(&routed, &cached_total, &[rel]),
    );
    assert!(
        (predicted - cached).abs() <= 16.0 * repeats.len() as f64,
        "predicted {predicted} cached tokens in all, the engines reported {cached}"
    );
    // The engines' own counters agree: hits only where the router sent repeats.
    let hits = sample(
        &scrape(&http, &a).await,
        &counter_total(metrics::PREFIX_HITS),
        &[],
    ) + sample(
        &scrape(&http, &b).await,
        &counter_total(metrics::PREFIX_HITS),
        &[],
    );
    assert_eq!(
        hits, cached,
        "engine prefix hits against the usage reported"
    );
}

#[tokio::test]
async fn killing_an_engine_mid_stream_ends_its_streams_with_an_error_and_later_requests_go_to_the_other()
 {
    let _serial = SERIAL.lock().await;
    let (doomed, survivor) = (engine(PACED), engine(PACED));
    let router = router(&[&doomed, &survivor], None);
    let http = client();
    wait_for_models(&http, &router).await;

    // Four long streams, spread over both engines by the router's in-flight count.
    let (started_tx, mut started_rx) = tokio::sync::mpsc::unbounded_channel();
    let mut streams = Vec::new();
    for i in 0..4 {
        let (http, url, started) = (http.clone(), router.url(""), started_tx.clone());
        streams.push(tokio::spawn(async move {
            let response = http
                .post(format!("{url}/v1/completions"))
                .json(&long_stream(200))
                .send()
                .await
                .unwrap_or_else(|e| panic!("stream {i}: {e}"));
            assert_eq!(response.status(), 200, "stream {i}");
            read_sse(response, || {
                let _ = started.send(i);
            })
            .await
        }));
    }
    for _ in 0..4 {
        tokio::time::timeout(PATIENCE, started_rx.recv())
            .await
            .expect("every stream's first event");
    }
    let (on_doomed, on_survivor) = (
        running(&load(&http, &doomed).await),
        running(&load(&http, &survivor).await),
    );
    assert!(
        on_doomed > 0 && on_survivor > 0,
        "the streams should be spread: {on_doomed} and {on_survivor} running"
    );
    let survivor_before = engine_ok(&scrape(&http, &survivor).await);

    drop(doomed); // SIGKILL

    let mut cut = 0;
    for (i, s) in streams.into_iter().enumerate() {
        let payloads = s.await.expect("stream task");
        let errors = stream_errors(&payloads);
        if errors.is_empty() {
            assert_complete(&payloads, &format!("stream {i}"));
        } else {
            cut += 1;
            assert_eq!(errors.len(), 1, "stream {i}: {payloads:?}");
            assert!(
                errors[0]["message"].as_str().is_some(),
                "stream {i}: an error event without a message: {payloads:?}"
            );
            assert_eq!(
                payloads.last().map(String::as_str),
                Some("[DONE]"),
                "stream {i}: the error event ends with [DONE]"
            );
            assert_eq!(finish_reason(&payloads), None, "stream {i}: {payloads:?}");
        }
    }
    assert_eq!(
        u64::try_from(cut).ok(),
        Some(on_doomed),
        "every stream on the killed engine ends with an error event, the others complete"
    );

    // Requests after the kill, streamed and not, all succeed on the survivor: the
    // first ones may still try the dead engine and be retried before their first byte.
    for i in 0..6 {
        let body = json!({"model": MODEL, "prompt": format!("Request {i} after the kill:"), "max_tokens": 3, "temperature": 0});
        if i % 2 == 0 {
            post(&http, &router, "/v1/completions", &body).await;
        } else {
            let mut body = body;
            body["stream"] = json!(true);
            let payloads = stream(&http, &router, "/v1/completions", &body, || {}).await;
            assert_complete(&payloads, &format!("request {i} after the kill"));
        }
    }
    let survivor_after = engine_ok(&scrape(&http, &survivor).await);
    assert_eq!(
        survivor_after - survivor_before,
        6.0 + on_survivor as f64,
        "the survivor served its streams and every later request"
    );
    let routed = scrape(&http, &router).await;
    assert_eq!(
        router_requests(&routed, STATIC_STABLE, "error"),
        on_doomed as f64,
        "{routed}"
    );
}

#[tokio::test]
async fn a_draining_engine_gets_no_new_requests_and_finishes_its_stream() {
    let _serial = SERIAL.lock().await;
    let (a, b) = (engine(PACED), engine(PACED));
    let router = router(&[&a, &b], None);
    let http = client();
    wait_for_models(&http, &router).await;

    // A long stream, so the engine it lands on stays alive draining.
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let long = {
        let (http, url) = (http.clone(), router.url("/v1/completions"));
        tokio::spawn(async move {
            let response = http
                .post(url)
                .json(&long_stream(256))
                .send()
                .await
                .expect("the long stream");
            assert_eq!(response.status(), 200);
            let mut started = Some(started_tx);
            read_sse(response, || {
                if let Some(tx) = started.take() {
                    let _ = tx.send(());
                }
            })
            .await
        })
    };
    tokio::time::timeout(PATIENCE, started_rx)
        .await
        .expect("the long stream's first event")
        .expect("the stream task is alive");
    let (mut draining, other) = if running(&load(&http, &a).await) == 1 {
        (a, b)
    } else {
        assert_eq!(
            running(&load(&http, &b).await),
            1,
            "the long stream runs somewhere"
        );
        (b, a)
    };
    draining.sigterm();
    let drained_before = engine_requests(&scrape(&http, &draining).await);
    let other_before = engine_ok(&scrape(&http, &other).await);
    // The router learns it from the engine's load report.
    let endpoints = router.url("/metrics");
    eventually("the router to see the engine terminating", || {
        let (http, url) = (http.clone(), endpoints.clone());
        async move {
            let text = http.get(&url).send().await.ok()?.text().await.ok()?;
            let terminating = sample(
                &text,
                names::ENDPOINTS,
                &[
                    (metrics::RELEASE_LABEL, STATIC_STABLE),
                    ("state", "terminating"),
                ],
            );
            (terminating == 1.0).then_some(())
        }
    })
    .await;

    for i in 0..8 {
        let body = json!({"model": MODEL, "prompt": format!("While draining, request {i}:"), "max_tokens": 2, "temperature": 0});
        post(&http, &router, "/v1/completions", &body).await;
    }
    // Still draining (its stream runs), and it saw none of the eight, not even to
    // refuse them: the router sent every one to the other engine.
    let drained_load = load(&http, &draining).await;
    assert_eq!(drained_load["draining"], true, "{drained_load}");
    assert_eq!(running(&drained_load), 1, "the long stream still runs");
    let ready = http
        .get(draining.url("/ready"))
        .send()
        .await
        .expect("/ready while draining");
    assert_eq!(ready.status(), 503);
    assert_eq!(
        engine_requests(&scrape(&http, &draining).await),
        drained_before,
        "the draining engine got a request"
    );
    assert_eq!(engine_ok(&scrape(&http, &other).await) - other_before, 8.0);
    let routed = scrape(&http, &router).await;
    assert_eq!(
        sample(&routed, &counter_total(names::RETRIES), &[]),
        0.0,
        "no request needed a retry: {routed}"
    );

    let payloads = long.await.expect("the long stream's task");
    assert_complete(&payloads, "the draining engine's stream");
    assert_eq!(finish_reason(&payloads).as_deref(), Some("length"));
    let status = draining
        .exit_within(PATIENCE)
        .await
        .expect("the drained engine exits");
    assert!(status.success(), "{status}");
}

#[tokio::test]
async fn a_ten_percent_canary_gets_ten_percent_of_requests_and_sessions_stick_to_one_release() {
    let _serial = SERIAL.lock().await;
    let (stable, canary) = (engine(&[]), engine(&["--release", "canary-bundle"]));
    let router = router(&[&stable], Some((&canary, 10)));
    let http = client();
    wait_for_models(&http, &router).await;

    // 300 one-token requests, eight at a time.
    const N: usize = 300;
    let url = router.url("/v1/completions");
    let statuses: Vec<u16> = futures::stream::iter(0..N)
        .map(|i| {
            let (http, url) = (http.clone(), url.clone());
            async move {
                let body = json!({"model": MODEL, "prompt": format!("Hi {i}"), "max_tokens": 1});
                let response = http.post(&url).json(&body).send().await;
                let response = response.unwrap_or_else(|e| panic!("request {i}: {e}"));
                let status = response.status().as_u16();
                let _ = response.bytes().await;
                status
            }
        })
        .buffer_unordered(8)
        .collect()
        .await;
    assert!(statuses.iter().all(|&s| s == 200), "{statuses:?}");

    let routed = scrape(&http, &router).await;
    let to_canary = router_requests(&routed, STATIC_CANARY, "ok");
    let to_stable = router_requests(&routed, STATIC_STABLE, "ok");
    assert_eq!(to_canary + to_stable, N as f64, "{routed}");
    // Binomial(300, 0.1): mean 30, σ ≈ 5.2; ±4σ fails a correct split about once in
    // 16,000 runs.
    let (mean, sigma) = (N as f64 * 0.1, (N as f64 * 0.1 * 0.9).sqrt());
    assert!(
        (to_canary - mean).abs() <= 4.0 * sigma,
        "the canary got {to_canary} of {N} requests at weight 10 %"
    );
    // The engines saw the same split.
    assert_eq!(engine_ok(&scrape(&http, &canary).await), to_canary);
    assert_eq!(engine_ok(&scrape(&http, &stable).await), to_stable);

    // Sessions: every request of one session on one release, the one its session
    // draw picks at 10 % (SHA-256 of the id, bucket < weight: the same on any router).
    let mut on_canary = 0;
    for s in 0..40 {
        let session = format!("session-{s}");
        let before = scrape(&http, &router).await;
        let requests = (0..3).map(|turn| {
            let (http, url, session) = (http.clone(), url.clone(), session.clone());
            async move {
                let body =
                    json!({"model": MODEL, "prompt": format!("Turn {turn}"), "max_tokens": 1});
                let response = http
                    .post(&url)
                    .header("x-session-id", &session)
                    .json(&body)
                    .send()
                    .await
                    .unwrap_or_else(|e| panic!("{session} turn {turn}: {e}"));
                assert_eq!(response.status(), 200, "{session} turn {turn}");
                let _ = response.bytes().await;
            }
        });
        futures::future::join_all(requests).await;
        let after = scrape(&http, &router).await;
        let moved = |release: &str| {
            router_requests(&after, release, "ok") - router_requests(&before, release, "ok")
        };
        let want_canary = session_draw(&session) % 100 < 10;
        let (want, other) = if want_canary {
            on_canary += 1;
            (STATIC_CANARY, STATIC_STABLE)
        } else {
            (STATIC_STABLE, STATIC_CANARY)
        };
        assert_eq!(
            (moved(want), moved(other)),
            (3.0, 0.0),
            "{session}: all three turns on {want}"
        );
    }
    assert!(
        on_canary > 0 && on_canary < 40,
        "the session ids should exercise both releases ({on_canary} of 40 on the canary)"
    );
}

#[tokio::test]
async fn sigterm_drains_the_router_its_stream_in_flight_completes_and_it_exits_zero() {
    let _serial = SERIAL.lock().await;
    let engine = engine(PACED);
    let mut router = router(&[&engine], None);
    let http = client();
    wait_for_models(&http, &router).await;

    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let in_flight = {
        let (http, url) = (http.clone(), router.url("/v1/completions"));
        tokio::spawn(async move {
            let response = http
                .post(url)
                .json(&long_stream(96))
                .send()
                .await
                .expect("the stream");
            assert_eq!(response.status(), 200);
            let mut started = Some(started_tx);
            read_sse(response, || {
                if let Some(tx) = started.take() {
                    let _ = tx.send(());
                }
            })
            .await
        })
    };
    tokio::time::timeout(PATIENCE, started_rx)
        .await
        .expect("the stream's first event")
        .expect("the stream task is alive");

    router.sigterm();
    let ready_url = router.url("/ready");
    eventually("the router's /ready to turn 503", || {
        let (http, url) = (http.clone(), ready_url.clone());
        async move {
            let status = http.get(&url).send().await.ok()?.status();
            (status == 503).then_some(())
        }
    })
    .await;
    // Still draining, not gone: the stream has not finished.
    assert!(
        !in_flight.is_finished(),
        "the stream finished before /ready turned"
    );

    let payloads = in_flight.await.expect("the stream's task");
    assert_complete(&payloads, "the stream the router drained");
    assert_eq!(finish_reason(&payloads).as_deref(), Some("length"));
    assert!(!streamed_text(&payloads).is_empty());
    let status = router
        .exit_within(PATIENCE)
        .await
        .expect("the router exits once drained");
    assert!(
        status.success(),
        "the router exits 0 after its drain: {status}"
    );
}

#[tokio::test]
async fn a_client_that_goes_away_mid_stream_cancels_its_request_in_the_engine() {
    let _serial = SERIAL.lock().await;
    let engine = engine(&[]);
    let router = router(&[&engine], None);
    let http = client();
    wait_for_models(&http, &router).await;

    let response = http
        .post(router.url("/v1/completions"))
        .json(&long_stream(512))
        .send()
        .await
        .expect("the stream");
    assert_eq!(response.status(), 200);
    let mut body = response.bytes_stream();
    let first = body.next().await;
    assert!(matches!(first, Some(Ok(_))), "no first chunk: {first:?}");
    assert_eq!(running(&load(&http, &engine).await), 1);
    // The client goes away after its first chunk, 500 tokens early.
    drop(body);

    eventually("the engine to stop running the abandoned request", || {
        let http = http.clone();
        let engine = &engine;
        async move { (running(&load(&http, engine).await) == 0).then_some(()) }
    })
    .await;
    let engine_text = scrape(&http, &engine).await;
    assert_eq!(
        sample(
            &engine_text,
            &counter_total(metrics::REQUESTS),
            &[(metrics::OUTCOME_LABEL, "cancelled")],
        ),
        1.0,
        "the engine counts the abandoned request cancelled:\n{engine_text}"
    );
    let router_text = eventually("the router to count the request cancelled", || {
        let (http, router) = (http.clone(), &router);
        async move {
            let text = scrape(&http, router).await;
            (router_requests(&text, STATIC_STABLE, "cancelled") == 1.0).then_some(text)
        }
    })
    .await;
    assert_eq!(router_requests(&router_text, STATIC_STABLE, "ok"), 0.0);
}
