//! `slipway-engine serve` as a real child process on the real SmolLM2 model, driven
//! over real HTTP: drain on SIGTERM (everything admitted completes, new requests
//! get 503 + Retry-After, exit 0), the shutdown budget ending leftovers with an
//! explicit error, an open-loop overload burst (rejections carry Retry-After,
//! `/health` stays fast, every admitted request completes, `promtool check metrics`
//! is clean), 50 clients dropping mid-stream (KV back to idle), and the prefix cache
//! over HTTP.
//!
//! A missing model or promtool fails with instructions, never skips. The tests run
//! one at a time (a shared lock): each starts its own server, and on a small
//! machine parallel servers would only measure each other.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use slipway_contract::ServeArgs;
use slipway_contract::metrics::{
    KV_USAGE, MODEL_LABEL, OUTCOME_LABEL, Outcome, RELEASE_LABEL, REQUESTS, RUNNING, counter_total,
};
use slipway_engine::testing::{EngineProcess, finish_reason, read_sse, serve_args};

static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const MODEL: &str = "smol";

/// Starts `serve` on a free port with this file's defaults and `extra` flags, and
/// waits until it listens.
fn start_server(extra: &[&str]) -> EngineProcess {
    assert!(
        cfg!(feature = "fault-injection") || !extra.iter().any(|a| a.starts_with("--inject")),
        "this test needs the engine's test-only fault injection: run it with \
             `--features fault-injection` (`make test` and the workspace's `cargo test` do)"
    );
    let args = ServeArgs {
        release: "r1".into(),
        max_model_len: Some(1024),
        kv_blocks: Some(1024),
        ..serve_args(MODEL)
    }
    .with_extra_args(extra)
    .unwrap_or_else(|e| panic!("{extra:?}: {e}"));
    EngineProcess::spawn(&args)
}

/// Waits for `server` to exit within `within`.
async fn exit_status(server: &mut EngineProcess, within: Duration) -> std::process::ExitStatus {
    server
        .exit_within(within)
        .await
        .unwrap_or_else(|| panic!("serve did not exit within {within:?}"))
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .expect("client")
}

fn completion(prompt: &str, max_tokens: usize, stream: bool) -> Value {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
           "temperature": 0, "stream": stream})
}

async fn metrics_text(c: &reqwest::Client, s: &EngineProcess) -> String {
    c.get(s.url("/metrics"))
        .send()
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("metrics body")
}

/// The value of the series `name{model,release[,outcome]}`.
fn metric(text: &str, name: &str, outcome: Option<Outcome>) -> f64 {
    let labels = match outcome {
        Some(o) => format!(
            "{{{MODEL_LABEL}=\"{MODEL}\",{RELEASE_LABEL}=\"r1\",{OUTCOME_LABEL}=\"{}\"}}",
            o.as_str()
        ),
        None => format!("{{{MODEL_LABEL}=\"{MODEL}\",{RELEASE_LABEL}=\"r1\"}}"),
    };
    let series = format!("{name}{labels}");
    text.lines()
        .find_map(|l| {
            let (n, v) = l.rsplit_once(' ')?;
            (n == series).then(|| v.parse().ok()).flatten()
        })
        .unwrap_or_else(|| panic!("{series} not in /metrics:\n{text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_with_16_streams_in_flight_completes_them_all_and_exits_0() {
    let _one = ONE_AT_A_TIME.lock().await;
    // 40 ms a decode step at least (test-only injection): the 40-token streams are still
    // running when the checks below need them to, however fast the build.
    let mut server = start_server(&[
        "--max-num-seqs",
        "16",
        "--shutdown-timeout-ms",
        "60000",
        "--inject-delay-ms",
        "40",
    ]);
    let c = client();
    let (started_tx, mut started) = tokio::sync::mpsc::unbounded_channel();
    let mut streams = Vec::new();
    for i in 0..16 {
        let (c, url, tx) = (c.clone(), server.url("/v1/completions"), started_tx.clone());
        streams.push(tokio::spawn(async move {
            let resp = c
                .post(url)
                .json(&completion(
                    &format!("Story {i}: once upon a time"),
                    40,
                    true,
                ))
                .send()
                .await
                .expect("POST");
            assert_eq!(resp.status(), 200);
            read_sse(resp, || {
                let _ = tx.send(());
            })
            .await
        }));
    }
    for _ in 0..16 {
        started.recv().await.expect("a stream started");
    }
    server.sigterm();
    // /ready turns false at once; new requests get 503 with Retry-After.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let r = c
            .get(server.url("/ready"))
            .send()
            .await
            .expect("GET /ready");
        if r.status() == 503 {
            break;
        }
        assert!(Instant::now() < deadline, "/ready stayed {}", r.status());
    }
    let r = c
        .post(server.url("/v1/completions"))
        .json(&completion("Too late", 4, false))
        .send()
        .await
        .expect("POST while draining");
    assert_eq!(r.status(), 503);
    assert!(r.headers().contains_key("retry-after"));
    let v: Value = r.json().await.expect("JSON error");
    assert!(v["error"]["message"].is_string(), "{v}");
    for (i, s) in streams.into_iter().enumerate() {
        let chunks = s.await.expect("stream task");
        assert_eq!(
            chunks.last().map(String::as_str),
            Some("[DONE]"),
            "stream {i}"
        );
        let reason = finish_reason(&chunks);
        assert!(
            matches!(reason.as_deref(), Some("length" | "stop")),
            "stream {i} ended with {reason:?}: {chunks:?}"
        );
    }
    let status = exit_status(&mut server, Duration::from_secs(30)).await;
    assert!(status.success(), "exit status {status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_still_running_when_the_shutdown_budget_ends_get_an_explicit_error() {
    let _one = ONE_AT_A_TIME.lock().await;
    // 50 ms per decode step (test-only injection): 300 tokens take 15 s, far past the
    // 1 s budget.
    let mut server = start_server(&["--shutdown-timeout-ms", "1000", "--inject-delay-ms", "50"]);
    let c = client();
    let (tx, mut started) = tokio::sync::mpsc::unbounded_channel();
    let streaming = {
        let (c, url) = (c.clone(), server.url("/v1/completions"));
        tokio::spawn(async move {
            let resp = c
                .post(url)
                .json(&completion("A very long story:", 300, true))
                .send()
                .await
                .expect("POST");
            read_sse(resp, || {
                let _ = tx.send(());
            })
            .await
        })
    };
    let whole = {
        let (c, url) = (c.clone(), server.url("/v1/completions"));
        tokio::spawn(async move {
            let r = c
                .post(url)
                .json(&completion("Another long story:", 300, false))
                .send()
                .await
                .expect("POST");
            (r.status(), r.json::<Value>().await.expect("JSON"))
        })
    };
    started.recv().await.expect("the stream started");
    // Both admitted and running before the drain starts.
    let deadline = Instant::now() + Duration::from_secs(20);
    while metric(&metrics_text(&c, &server).await, RUNNING, None) < 2.0 {
        assert!(Instant::now() < deadline, "the second request never ran");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    server.sigterm();
    let chunks = streaming.await.expect("stream task");
    assert_eq!(chunks.last().map(String::as_str), Some("[DONE]"));
    let err: Value =
        serde_json::from_str(&chunks[chunks.len() - 2]).expect("an error object before [DONE]");
    assert!(
        err["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("shut down")),
        "{err}"
    );
    let (status, body) = whole.await.expect("request task");
    assert_eq!(status, 503, "{body}");
    assert!(body["error"]["message"].is_string(), "{body}");
    let status = exit_status(&mut server, Duration::from_secs(10)).await;
    assert!(status.success(), "exit status {status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_open_loop_burst_is_shed_with_retry_after_while_health_stays_fast() {
    let _one = ONE_AT_A_TIME.lock().await;
    let server = start_server(&["--max-num-seqs", "4", "--max-queue", "4"]);
    let c = client();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let health = {
        let (c, url, done) = (c.clone(), server.url("/health"), done.clone());
        tokio::spawn(async move {
            let mut worst = Duration::ZERO;
            let mut probes = 0;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let t = Instant::now();
                let r = c
                    .get(&url)
                    .timeout(Duration::from_secs(5))
                    .send()
                    .await
                    .expect("GET /health");
                assert_eq!(r.status(), 200);
                worst = worst.max(t.elapsed());
                probes += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            (worst, probes)
        })
    };
    // Open loop: 48 arrivals at once, far above the 8 the server admits.
    let burst: Vec<_> = (0..48)
        .map(|i| {
            let (c, url) = (c.clone(), server.url("/v1/completions"));
            tokio::spawn(async move {
                let r = c
                    .post(url)
                    .json(&completion(&format!("Item {i} of the list is"), 16, false))
                    .send()
                    .await
                    .expect("POST");
                let status = r.status().as_u16();
                let retry = r
                    .headers()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse::<u64>().ok());
                (status, retry, r.json::<Value>().await.expect("JSON body"))
            })
        })
        .collect();
    let (mut ok, mut shed) = (0, 0);
    for t in burst {
        let (status, retry, body) = t.await.expect("request task");
        match status {
            200 => {
                ok += 1;
                assert!(
                    matches!(
                        body["choices"][0]["finish_reason"].as_str(),
                        Some("length" | "stop")
                    ),
                    "{body}"
                );
            }
            503 => {
                shed += 1;
                assert!(retry.is_some_and(|s| s >= 1), "503 without Retry-After");
                assert!(body["error"]["message"].is_string(), "{body}");
            }
            other => panic!("unexpected status {other}: {body}"),
        }
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let (worst, probes) = health.await.expect("health task");
    assert!(probes >= 1);
    assert!(worst < Duration::from_secs(1), "/health took {worst:?}");
    assert!(ok >= 8, "only {ok} admitted");
    assert!(shed >= 1, "nothing was shed");
    let text = metrics_text(&c, &server).await;
    assert_eq!(
        metric(&text, &counter_total(REQUESTS), Some(Outcome::Ok)),
        f64::from(ok)
    );
    assert_eq!(
        metric(&text, &counter_total(REQUESTS), Some(Outcome::Rejected503)),
        f64::from(shed)
    );
    promtool_check(&text);
}

/// `promtool check metrics` on real output; fails (never skips) without promtool.
fn promtool_check(text: &str) {
    use std::io::Write as _;
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "promtool not runnable ({e}): install it with \
                 `scripts/ensure-debian-packages promtool=prometheus` (make test-serve does)"
            )
        });
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("writing to promtool");
    let out = child.wait_with_output().expect("promtool");
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_clients_dropping_mid_stream_leave_kv_usage_at_idle() {
    let _one = ONE_AT_A_TIME.lock().await;
    // 50 × (prompt + 200 tokens) ≈ 700 blocks: all admitted at once.
    let server = start_server(&["--max-num-seqs", "64"]);
    let c = client();
    let idle = metric(&metrics_text(&c, &server).await, KV_USAGE, None);
    let clients: Vec<_> = (0..50)
        .map(|i| {
            let (c, url) = (c.clone(), server.url("/v1/completions"));
            tokio::spawn(async move {
                let mut resp = c
                    .post(url)
                    .json(&completion(&format!("Client {i} says"), 200, true))
                    .send()
                    .await
                    .expect("POST");
                assert_eq!(resp.status(), 200);
                // One chunk, then go away mid-stream.
                let first = resp.chunk().await.expect("a chunk");
                assert!(first.is_some());
                drop(resp);
            })
        })
        .collect();
    for t in clients {
        t.await.expect("client task");
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let text = metrics_text(&c, &server).await;
        let kv = metric(&text, KV_USAGE, None);
        let running = metric(&text, RUNNING, None);
        let cancelled = metric(&text, &counter_total(REQUESTS), Some(Outcome::Cancelled));
        if kv == idle && running == 0.0 && cancelled == 50.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "after 50 disconnects: KV usage {kv} (idle {idle}), {running} running, {cancelled} cancelled"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_shared_prefix_hits_the_cache_over_http_only_under_the_same_salt() {
    let _one = ONE_AT_A_TIME.lock().await;
    let server = start_server(&[]);
    let c = client();
    let prefix = "The harbor master counted the boats twice. ".repeat(25);
    let ask = |question: &str, salt: &str| {
        json!({"model": MODEL, "prompt": format!("{prefix}{question}"), "max_tokens": 2,
               "temperature": 0, "cache_salt": salt})
    };
    let cached = |v: &Value| {
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or_else(|| panic!("no cached_tokens: {v}"))
    };
    let post = |body: Value| {
        let c = c.clone();
        let url = server.url("/v1/completions");
        async move {
            let r = c.post(url).json(&body).send().await.expect("POST");
            assert_eq!(r.status(), 200);
            r.json::<Value>().await.expect("JSON")
        }
    };
    let first = post(ask(" Question one?", "a")).await;
    assert!(
        first["usage"]["prompt_tokens"].as_u64() >= Some(200),
        "{first}"
    );
    assert_eq!(cached(&first), 0);
    let second = post(ask(" A different question?", "a")).await;
    assert!(cached(&second) >= 192, "{second}");
    let other_salt = post(ask(" A different question?", "b")).await;
    assert_eq!(cached(&other_salt), 0, "{other_salt}");
}
