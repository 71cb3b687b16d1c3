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
