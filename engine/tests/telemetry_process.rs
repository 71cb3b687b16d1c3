//! Logs and traces of a real `slipway-engine serve` process.
//!
//! Logs: off a terminal, with no `--log-format`, every line is a JSON object and none
//! carries an escape code (what `kubectl logs` shows).
//!
//! Traces: request traces reach a real trace backend: Jaeger (built from its Go module by
//! `make jaeger`, path in `$SLIPWAY_JAEGER`) receives OTLP/HTTP from a real
//! `slipway-engine serve` on the real model. After requests carrying known W3C
//! `traceparent` headers, Jaeger's query API must hold one trace per sampled request,
//! joined to the caller's span, with the engine's phases in order and their
//! attributes, and no prompt or output text anywhere. The engine's JSON log lines
//! about those requests carry the same trace id.
//!
//! A missing Jaeger binary or model fails with instructions; it never skips.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use slipway_contract::{LogFormat, ServeArgs};
use slipway_engine::testing::{ChildGuard, EngineProcess, read_sse, serve_args};

/// A prompt word that must never appear in a span.
const SECRET: &str = "Zanzibarite";

fn jaeger_binary() -> PathBuf {
    let path = std::env::var_os("SLIPWAY_JAEGER").map(PathBuf::from).unwrap_or_else(|| {
        panic!("SLIPWAY_JAEGER is not set: run `make jaeger` (it builds Jaeger and prints its path), or the tests through `make test`")
    });
    assert!(
        path.is_file(),
        "SLIPWAY_JAEGER={} does not exist: run `make jaeger`",
        path.display()
    );
    path
}

/// Drains `server` (SIGTERM) and checks it exits 0 within 30 s.
async fn drain(server: &mut EngineProcess) {
    server.sigterm();
    let status = server
        .exit_within(Duration::from_secs(30))
        .await
        .expect("serve exits");
    assert!(status.success(), "serve exited with {status}");
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A Jaeger all-in-one (in-memory storage) on free loopback ports; killed on drop.
struct Jaeger {
    process: ChildGuard,
    otlp_http: u16,
    query_http: u16,
    _dir: tempfile::TempDir,
}

impl Jaeger {
    async fn start() -> Self {
        let dir = tempfile::tempdir().expect("a temp dir");
        let (otlp_http, query_http, query_grpc) = (free_port(), free_port(), free_port());
        // Only what the test needs: OTLP/HTTP in, memory storage, the query API out;
        // no fixed ports (the collector's own metrics are off).
        let config = format!(
            r"service:
  extensions: [jaeger_storage, jaeger_query]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics:
      level: none
    logs:
      level: warn
extensions:
  jaeger_query:
    storage:
      traces: memory
    http:
      endpoint: 127.0.0.1:{query_http}
    grpc:
      endpoint: 127.0.0.1:{query_grpc}
  jaeger_storage:
    backends:
      memory:
        memory:
          max_traces: 10000
receivers:
  otlp:
    protocols:
      http:
        endpoint: 127.0.0.1:{otlp_http}
processors:
  batch:
    timeout: 100ms
exporters:
  jaeger_storage_exporter:
    trace_storage: memory
"
        );
        let path = dir.path().join("jaeger.yaml");
        std::fs::write(&path, config).expect("writing the Jaeger config");
        let process = ChildGuard::spawn(
            "jaeger",
            Command::new(jaeger_binary())
                .arg(format!("--config={}", path.display()))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::inherit()),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let mut jaeger = Self {
            process,
            otlp_http,
            query_http,
            _dir: dir,
        };
        let client = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Err(e) = jaeger.process.ensure_running() {
                panic!("at start-up: {e}");
            }
            let up = client.get(jaeger.query("/api/services")).send().await;
            if up.is_ok_and(|r| r.status().is_success()) {
                return jaeger;
            }
            assert!(
                Instant::now() < deadline,
                "jaeger did not answer within 60 s"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn otlp_endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.otlp_http)
    }

    fn query(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.query_http)
    }

    /// The trace's spans once Jaeger has `at_least` of them (up to 30 s).
    async fn trace(&self, trace_id: &str, at_least: usize) -> Vec<Value> {
        let client = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let found = client
                .get(self.query(&format!("/api/traces/{trace_id}")))
                .send()
                .await;
            if let Ok(r) = found
                && r.status().is_success()
            {
                let body: Value = r.json().await.expect("Jaeger's JSON");
                let spans = body["data"][0]["spans"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default();
                if spans.len() >= at_least {
                    return spans;
                }
            }
            assert!(
                Instant::now() < deadline,
                "trace {trace_id} did not reach Jaeger with {at_least} spans within 30 s"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Whether Jaeger holds any span of `trace_id` (asked after another trace of the
    /// same export arrived, so an absence is not a delay).
    async fn has_trace(&self, trace_id: &str) -> bool {
        let r = reqwest::Client::new()
            .get(self.query(&format!("/api/traces/{trace_id}")))
            .send()
            .await
            .expect("asking Jaeger");
        r.status().is_success()
            && r.json::<Value>().await.expect("Jaeger's JSON")["data"][0]["spans"]
                .as_array()
                .is_some_and(|s| !s.is_empty())
    }
}

/// A span's tags as strings.
fn tags(span: &Value) -> BTreeMap<String, String> {
    span["tags"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| {
            let v = &t["value"];
            let text = v.as_str().map_or_else(|| v.to_string(), str::to_owned);
            (t["key"].as_str().unwrap_or_default().to_owned(), text)
        })
        .collect()
}

fn named<'a>(spans: &'a [Value], name: &str) -> Vec<&'a Value> {
    let mut found: Vec<&Value> = spans
        .iter()
        .filter(|s| s["operationName"] == name)
        .collect();
    found.sort_by_key(|s| s["startTime"].as_u64());
    found
}

fn start(span: &Value) -> u64 {
    span["startTime"].as_u64().expect("startTime")
}

fn end(span: &Value) -> u64 {
    start(span) + span["duration"].as_u64().expect("duration")
}

/// The trace as an indented tree, one line per span with its duration and the
/// attributes this test is about (printed; `--nocapture` shows it).
fn render_tree(spans: &[Value], parent: Option<&str>, depth: usize, out: &mut String) {
    let mut children: Vec<&Value> = spans
        .iter()
        .filter(|s| {
            let p = parent_of(s);
            match parent {
                Some(id) => p == Some(id),
                // The roots: their parent is the caller's span, not in this trace.
                None => !spans
                    .iter()
                    .any(|o| Some(o["spanID"].as_str().unwrap_or("")) == p),
            }
        })
        .collect();
    children.sort_by_key(|s| start(s));
    for s in children {
        let attrs: Vec<String> = tags(s)
            .into_iter()
            .filter(|(k, _)| !k.starts_with("otel.") && k != "target" && k != "span.kind")
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        out.push_str(&format!(
            "{:indent$}{} [{} µs] {}\n",
            "",
            s["operationName"].as_str().unwrap_or("?"),
            s["duration"],
            attrs.join(" "),
            indent = depth * 2
        ));
        render_tree(spans, s["spanID"].as_str(), depth + 1, out);
    }
}

fn parent_of(span: &Value) -> Option<&str> {
    span["references"]
        .as_array()?
        .iter()
        .find(|r| r["refType"] == "CHILD_OF")?["spanID"]
        .as_str()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_is_one_trace_in_jaeger_with_its_phases_in_order() {
    let jaeger = Jaeger::start().await;
    let log = tempfile::NamedTempFile::new().expect("a log file");
    let mut args = ServeArgs {
        release: "r1".into(),
        max_model_len: Some(1024),
        kv_blocks: Some(256),
        ..serve_args("smol")
    };
    args.telemetry.logs.log_format = Some(LogFormat::Json);
    args.telemetry.otlp_endpoint = Some(jaeger.otlp_endpoint());
    let mut command = EngineProcess::command(&args);
    command
        .env("RUST_LOG", "info")
        .stderr(log.reopen().expect("the log file"));
    let mut server = EngineProcess::spawn_command(command);
    let client = reqwest::Client::new();

    // A non-streamed and a streamed chat request, each from a known caller span; a
    // third whose caller decided not to sample.
    let sampled = [
        (
            "4bf92f3577b34da6a3ce929d0e0e4736",
            "00f067aa0ba902b7",
            false,
        ),
        ("5cf92f3577b34da6a3ce929d0e0e4737", "10f067aa0ba902b8", true),
    ];
    for (trace, parent, stream) in sampled {
        let body = json!({"model": "smol", "max_tokens": 8, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": format!("Say something about {SECRET} please.")}]});
        let response = client
            .post(server.url("/v1/chat/completions"))
            .header("traceparent", format!("00-{trace}-{parent}-01"))
            .json(&body)
            .send()
            .await
            .expect("the chat request");
        assert_eq!(response.status(), 200);
        if stream {
            let payloads = read_sse(response, || {}).await;
            assert_eq!(payloads.last().map(String::as_str), Some("[DONE]"));
        } else {
            let _: Value = response.json().await.expect("a JSON answer");
        }
    }
    let unsampled = "6cf92f3577b34da6a3ce929d0e0e4738";
    let response = client
        .post(server.url("/v1/completions"))
        .header("traceparent", format!("00-{unsampled}-20f067aa0ba902b9-00"))
        .json(&json!({"model": "smol", "prompt": "Hello", "max_tokens": 2}))
        .send()
        .await
        .expect("the unsampled request");
    assert_eq!(response.status(), 200);
    // Drain: the exporter flushes on the way out.
    drain(&mut server).await;

    for (trace, caller_span, stream) in sampled {
        let spans = jaeger.trace(trace, 6).await;
        let mut tree = String::new();
        render_tree(&spans, None, 0, &mut tree);
        println!("trace {trace} as Jaeger holds it:\n{tree}");
        let text = serde_json::to_string(&spans).expect("spans as text");
        assert!(!text.contains(SECRET), "a span carries prompt text: {text}");

        let roots = named(&spans, "POST /v1/chat/completions");
        assert_eq!(roots.len(), 1, "one request span: {text}");
        let root = roots[0];
        assert_eq!(
            parent_of(root),
            Some(caller_span),
            "joined to the caller's span"
        );
        let root_id = root["spanID"].as_str().expect("spanID");
        let t = tags(root);
        assert_eq!(t.get("release").map(String::as_str), Some("r1"), "{t:?}");
        assert_eq!(t.get("model").map(String::as_str), Some("smol"), "{t:?}");
        assert_eq!(t.get("outcome").map(String::as_str), Some("ok"), "{t:?}");
        assert_eq!(
            t.get("finish_reason").map(String::as_str),
            Some("length"),
            "{t:?}"
        );
        assert_eq!(
            t.get("output_tokens").map(String::as_str),
            Some("8"),
            "{t:?}"
        );
        assert_eq!(
            t.get("request_id").map(String::len).map(|n| n > 0),
            Some(true)
        );
        let prompt_tokens: u64 = t["prompt_tokens"].parse().expect("prompt_tokens");
        assert!(prompt_tokens > 10, "{t:?}");

        let phase = |name: &str| {
            let found = named(&spans, name);
            assert!(!found.is_empty(), "no {name} span: {text}");
            for s in &found {
                assert_eq!(
                    parent_of(s),
                    Some(root_id),
                    "{name} is not under the request"
                );
            }
            found
        };
        let (admission, queue, prefill, decode, relay) = (
            phase("admission")[0],
            phase("queue")[0],
            phase("prefill_chunk"),
            phase("decode")[0],
            phase("stream")[0],
        );
        // In order: admitted, queued, prefilled, then decoded; all within the request.
        assert!(start(admission) <= start(queue), "{text}");
        assert!(end(queue) <= start(prefill[0]) + 1, "{text}");
        assert!(
            end(prefill[prefill.len() - 1]) <= start(decode) + 1,
            "{text}"
        );
        assert!(end(decode) <= end(root) + 1, "{text}");
        assert!(start(root) <= start(admission), "{text}");
        assert_eq!(
            tags(relay).get("streaming").map(String::as_str),
            Some(if stream { "true" } else { "false" })
        );
        let chunk_tokens: u64 = prefill
            .iter()
            .map(|s| tags(s)["tokens"].parse::<u64>().expect("tokens"))
            .sum();
        let hit: u64 = tags(prefill[0])["prefix_hit_tokens"].parse().expect("hit");
        assert_eq!(
            chunk_tokens + hit,
            prompt_tokens,
            "prefill covers the prompt: {text}"
        );
        assert_eq!(
            tags(decode).get("output_tokens").map(String::as_str),
            Some("8")
        );
    }
    assert!(
        !jaeger.has_trace(unsampled).await,
        "a request whose caller said not sampled was exported"
    );

    // The JSON log line of each request carries its request id and trace id.
    let lines = std::fs::read_to_string(log.path()).expect("the engine's log");
    for (trace, _, _) in sampled {
        let done = lines
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|l| {
                l["fields"]["message"] == "done"
                    && l["spans"]
                        .as_array()
                        .is_some_and(|s| s.iter().any(|s| s["trace_id"] == trace))
            });
        let done =
            done.unwrap_or_else(|| panic!("no `done` line with trace id {trace} in:\n{lines}"));
        let span = done["spans"]
            .as_array()
            .and_then(|s| s.first())
            .expect("the request span");
        assert!(
            span["request_id"].as_str().is_some_and(|id| !id.is_empty()),
            "{done}"
        );
    }
    assert!(
        lines.lines().all(|l| !l.contains('\u{1b}')),
        "escape codes in a log that is not a terminal"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn off_a_terminal_logs_default_to_json_lines_without_colours() {
    let log = tempfile::NamedTempFile::new().expect("a log file");
    let mut command = EngineProcess::command(&ServeArgs {
        kv_blocks: Some(64),
        ..serve_args("smol")
    });
    command
        .env("RUST_LOG", "info")
        .env_remove("SLIPWAY_LOG_FORMAT")
        .stderr(log.reopen().expect("the log file"));
    let mut server = EngineProcess::spawn_command(command);
    let response = reqwest::Client::new()
        .post(server.url("/v1/completions"))
        .header("x-request-id", "logs-1")
        .json(&json!({"model": "smol", "prompt": "Hello", "max_tokens": 2}))
        .send()
        .await
        .expect("a request");
    assert_eq!(response.status(), 200);
    drain(&mut server).await;

    let lines = std::fs::read_to_string(log.path()).expect("the engine's log");
    let parsed: Vec<Value> = lines
        .lines()
        .map(|l| {
            assert!(!l.contains('\u{1b}'), "an escape code in {l:?}");
            serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l:?}"))
        })
        .collect();
    let about_the_request: Vec<&Value> = parsed
        .iter()
        .filter(|l| {
            l["spans"]
                .as_array()
                .is_some_and(|s| s.iter().any(|s| s["request_id"] == "logs-1"))
        })
        .collect();
    assert!(
        about_the_request.len() >= 2,
        "the request's `request ended` and `done` lines: {lines}"
    );
    for line in about_the_request {
        let span = &line["spans"][0];
        assert_eq!(span["trace_id"].as_str().map(str::len), Some(32), "{line}");
    }
}
