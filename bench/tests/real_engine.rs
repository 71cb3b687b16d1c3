//! `slipway-bench sweep` against the real engine: `slipway-engine serve` on the real
//! SmolLM2-135M-Instruct Q4_1 model, a short two-rate sweep of a small workload with a
//! shared prefix, and checks that it wrote the summary, the per-request records, the
//! plot and the capacity note, that every request is accounted for, and that Little's
//! law holds between the engine's own running + waiting gauges and the client's λW.
//!
//! A smoke test of the tool on a real server (seconds), not a benchmark: it asserts no
//! latency. The engine binary is the one `cargo test` builds beside this test (the
//! engine is a workspace member with integration tests, so `make test` builds it);
//! `SLIPWAY_ENGINE_BIN` overrides. A missing binary or model fails with instructions.

#![allow(clippy::unwrap_used)]

use std::process::Command;

use serde_json::Value;
use slipway_contract::ServeArgs;
use slipway_engine::testing::{EngineProcess, serve_args};

/// The name the engine serves (it answers 404 to any other `model`).
const MODEL_NAME: &str = "bench";

fn start_engine() -> EngineProcess {
    // Returns once the model is loaded and the port bound (its readiness line).
    EngineProcess::spawn(&ServeArgs {
        threads: Some(2),
        kv_blocks: Some(512),
        max_model_len: Some(1024),
        ..serve_args(MODEL_NAME)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_sweep_against_the_real_engine_writes_summary_records_and_plot() {
    let engine = start_engine();
    eprintln!("engine at {}", engine.base());

    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("sweep");
    let workload = dir.path().join("w.yaml");
    std::fs::write(
        &workload,
        "promptTokens: {kind: uniform, min: 32, max: 96}\n\
         outputTokens: {kind: uniform, min: 8, max: 16}\n\
         sharedPrefix: {fraction: 0.5, tokens: 24}\n",
    )
    .unwrap();
    let args: Vec<String> = [
        "sweep",
        "--url",
        engine.base(),
        "--model",
        MODEL_NAME,
        "--label",
        "slipway-engine (test)",
        "--workload",
        workload.to_str().unwrap(),
        "--rates",
        "1,2",
        "--refine",
        "0",
        "--duration",
        "4",
        "--drain",
        "60",
        "--timeout",
        "60",
        "--warmup",
        "1",
        "--quiet",
        "--out",
        out.to_str().unwrap(),
    ]
    .map(String::from)
    .to_vec();
    let bin = env!("CARGO_BIN_EXE_slipway-bench");
    let result = tokio::task::spawn_blocking(move || Command::new(bin).args(args).output())
        .await
        .unwrap()
        .unwrap();
    let stdout = String::from_utf8_lossy(&result.stdout);
    assert!(
        result.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&result.stderr)
    );
    assert!(
        stdout.contains("== sweep: slipway-engine (test) =="),
        "{stdout}"
    );

    for f in ["sweep.json", "sweep.svg", "sweep.png", "capacity.yaml"] {
        assert!(
            out.join(f).metadata().unwrap().len() > 0,
            "{f} missing or empty"
        );
    }
    assert_eq!(
        &std::fs::read(out.join("sweep.png")).unwrap()[..8],
        b"\x89PNG\r\n\x1a\n"
    );
    let sweep: Value =
        serde_json::from_slice(&std::fs::read(out.join("sweep.json")).unwrap()).unwrap();
    let points = sweep["points"].as_array().unwrap();
    assert!(!points.is_empty(), "{sweep:#}");
    let mut shared = 0;
    for p in points {
        let d = out.join(format!("rate-{}", p["rate"].as_f64().unwrap()));
        let summary: Value =
            serde_json::from_slice(&std::fs::read(d.join("summary.json")).unwrap()).unwrap();
        assert_eq!(summary, p["summary"]);
        let c = &summary["counts"];
        let n = |k: &str| c[k].as_u64().unwrap();
        let records: Vec<Value> = std::fs::read_to_string(d.join("records.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(records.len() as u64, n("offered"));
        assert!(n("offered") > 0);
        let ends = [
            "completed",
            "rejected",
            "timedOut",
            "cancelled",
            "errors",
            "clientCapped",
        ];
        assert_eq!(ends.iter().map(|k| n(k)).sum::<u64>(), n("offered"), "{c}");
        assert_eq!(n("errors"), 0, "the engine refused requests: {records:#?}");
        assert!(n("completed") > 0, "{c}");
        // L from the engine's running + waiting gauges, scraped during the run,
        // against λW from the client's records.
        let little = &summary["little"];
        eprintln!("rate {}: Little's law {little}", p["rate"]);
        assert!(
            little["serverSamples"].as_u64().unwrap() >= 10,
            "{summary:#}"
        );
        assert_eq!(little["consistent"], true, "{summary:#}");
        for r in records.iter().filter(|r| r["outcome"] == "completed") {
            let planned_in = r["promptTokens"].as_i64().unwrap();
            let server_in = r["serverPromptTokens"].as_i64().unwrap();
            let max_out = r["maxTokens"].as_u64().unwrap();
            let server_out = r["serverOutputTokens"].as_u64().unwrap();
            let chunks = r["tokenS"].as_array().unwrap().len() as u64;
            assert!(chunks >= 1 && chunks <= server_out, "{r}");
            // The bench sends `ignore_eos`, which the engine honours: every request
            // generates exactly what the workload asked for.
            assert_eq!(server_out, max_out, "{r}");
            // The synthetic prompt's planned length is what the real tokenizer counts
            // (the words are single tokens; the tag and the prefix separator differ by a
            // token or two), so length buckets and shared-prefix sizes mean what they say.
            assert!(
                (server_in - planned_in).abs() <= 3,
                "planned {planned_in} prompt tokens, the engine counted {server_in}: {r}"
            );
            shared += usize::from(r["sharedPrefix"] == true);
        }
    }
    assert!(shared > 0, "no completed request used the shared prefix");
    drop(engine);
}
