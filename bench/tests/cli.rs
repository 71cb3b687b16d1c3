//! `slipway-bench sweep` end to end against the in-process fake server: it must find
//! the frontier the server's capacity implies and write every output file.

#![allow(clippy::unwrap_used)]

mod common;

use std::process::Command;
use std::time::Duration;

use common::{Behaviour, start};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweep_writes_summary_records_plot_and_capacity_note() {
    // Each stream lasts ≥ 400 ms and the server takes at most one at a time (503
    // otherwise). With evenly spaced arrivals, 1 req/s never overlaps (1 s apart) and
    // 20 req/s always does (50 ms apart), so the frontier lies in [1, 20).
    let url = start(Behaviour {
        ttft: Duration::from_millis(300),
        tpot: Duration::from_millis(25),
        max_running: Some(1),
        ..Behaviour::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("sweep");
    let workload = dir.path().join("w.yaml");
    std::fs::write(
        &workload,
        "promptTokens: {kind: fixed, value: 16}\noutputTokens: {kind: fixed, value: 5}\n",
    )
    .unwrap();
    let bin = env!("CARGO_BIN_EXE_slipway-bench");
    let args = [
        "sweep",
        "--url",
        &url,
        "--label",
        "fake",
        "--workload",
        workload.to_str().unwrap(),
        "--arrival",
        "constant",
        "--rates",
        "1,20",
        "--refine",
        "0",
        "--duration",
        "3",
        "--drain",
        "10",
        "--warmup",
        "0",
        "--quiet",
        "--out",
        out.to_str().unwrap(),
    ]
    .map(String::from);
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
    assert!(stdout.contains("replicaGoodput:"), "{stdout}");
    for f in [
        "sweep.json",
        "sweep.svg",
        "sweep.png",
        "capacity.yaml",
        "rate-1/records.jsonl",
        "rate-1/summary.json",
        "rate-20/records.jsonl",
    ] {
        assert!(
            out.join(f).metadata().unwrap().len() > 0,
            "{f} missing or empty"
        );
    }
    let sweep: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("sweep.json")).unwrap()).unwrap();
    assert_eq!(sweep["frontier"]["rate"], 1.0, "{sweep:#}");
    let points = sweep["points"].as_array().unwrap();
    assert_eq!(points.len(), 2);
    assert_eq!(points[1]["summary"]["sloPass"], false);
    assert!(points[1]["summary"]["counts"]["rejected"].as_u64().unwrap() > 0);
    let png = std::fs::read(out.join("sweep.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    let records = std::fs::read_to_string(out.join("rate-20/records.jsonl")).unwrap();
    assert_eq!(
        records.lines().count() as u64,
        points[1]["summary"]["counts"]["offered"].as_u64().unwrap()
    );

    // `compare` of a sweep with itself: every ratio is 1 and the combined plot is written.
    let sweep_json = out.join("sweep.json");
    let stem = dir.path().join("cmp");
    let cmp = Command::new(bin)
        .args([
            "compare",
            sweep_json.to_str().unwrap(),
            sweep_json.to_str().unwrap(),
            "--plot",
            stem.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&cmp.stdout);
    assert!(cmp.status.success(), "{text}");
    assert!(
        text.contains("goodput frontier") && text.contains("1.00×"),
        "{text}"
    );
    assert!(dir.path().join("cmp.png").exists() && dir.path().join("cmp.svg").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_replays_a_trace_and_accounts_for_every_line() {
    let url = start(Behaviour {
        ttft: Duration::from_millis(20),
        tpot: Duration::from_millis(5),
        reject_every: Some(3),
        ..Behaviour::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("t.jsonl");
    // Synthetic prompts are tagged with their line number, so the fake server rejects
    // line 1 (tag 1 % 3 == 1); ids follow sorted arrival: line 1, line 2, line 0.
    std::fs::write(
        &trace,
        "{\"timestamp\": 0.3, \"promptTokens\": 20, \"outputTokens\": 3}\n\
         {\"timestamp\": 0.1, \"promptTokens\": 20, \"outputTokens\": 2, \"tenant\": \"a\"}\n\
         {\"arrivalMs\": 200, \"prompt\": \"Request 5: hello\", \"outputTokens\": 2}\n",
    )
    .unwrap();
    let out = dir.path().join("run");
    let args = [
        "run",
        "--url",
        &url,
        "--trace",
        trace.to_str().unwrap(),
        "--warmup",
        "0",
        "--quiet",
        "--out",
        out.to_str().unwrap(),
    ]
    .map(String::from);
    let bin = env!("CARGO_BIN_EXE_slipway-bench");
    let result = tokio::task::spawn_blocking(move || Command::new(bin).args(args).output())
        .await
        .unwrap()
        .unwrap();
    assert!(
        result.status.success(),
        "{}",
        String::from_utf8_lossy(&result.stderr)
    );
    let recs: Vec<serde_json::Value> = std::fs::read_to_string(out.join("records.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let outcomes: Vec<&str> = recs
        .iter()
        .map(|r| r["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(outcomes, ["rejected", "completed", "completed"]);
    assert_eq!(recs[0]["tenant"], "a");
    assert_eq!(recs[2]["serverOutputTokens"], 3);
}

#[test]
fn help_explains_the_commands() {
    let out = Command::new(env!("CARGO_BIN_EXE_slipway-bench"))
        .arg("--help")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    for word in ["run", "sweep", "compare", "scheduled"] {
        assert!(text.contains(word), "{word} not in --help:\n{text}");
    }
}
