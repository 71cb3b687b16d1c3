//! The `Scrape` metrics source (rollout analysis and measured demand) against real
//! `slipway-engine serve` processes on the real SmolLM2 model: a stable engine, and a
//! canary engine with test-only fault injection (`--inject-delay-ms`) that breaks the
//! TPOT target. The reader maps the "pod IPs" it is given to the engines' 127.0.0.1
//! ports (the test-only address map of `rollout::source`, standing in for the pod
//! network), reads both releases' windows from `/metrics`, and analysis must abort the
//! canary on its burn rate while stable burns nothing. Measured demand reads one
//! engine's request and token counters the same way.
//!
//! Needs the engine binary (built by the workspace tests, or `SLIPWAY_ENGINE_BIN`) and
//! the model (`make model`, or `SLIPWAY_MODEL`); a missing one fails with instructions.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use slipway_api::spec::AnalysisSpec;
use slipway_contract::ServeArgs;
use slipway_engine::testing::{EngineProcess, serve_args};
use slipway_operator::rollout::analysis::{Thresholds, Verdict, judge};
use slipway_operator::rollout::source::{Reader, Target};

const MODEL_NAME: &str = "smol";
const REQUESTS: usize = 12;

fn start_engine(release: &str, extra: &[&str]) -> EngineProcess {
    let args = ServeArgs {
        threads: Some(1),
        kv_blocks: Some(256),
        max_model_len: Some(512),
        release: release.to_owned(),
        slo_tpot: Duration::from_millis(60),
        ..serve_args(MODEL_NAME)
    }
    .with_extra_args(extra)
    .unwrap_or_else(|e| panic!("{extra:?}: {e}"));
    EngineProcess::spawn(&args)
}

async fn complete(http: &reqwest::Client, address: &str) {
    let response = http
        .post(format!("http://{address}/v1/completions"))
        .json(&serde_json::json!({"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 6, "ignore_eos": true}))
        .send()
        .await
        .expect("completion request");
    assert!(
        response.status().is_success(),
        "completion failed: {}",
        response.status()
    );
}

fn analysis() -> AnalysisSpec {
    AnalysisSpec {
        interval: "1s".to_owned(),
        short_window: "30s".to_owned(),
        long_window: "60s".to_owned(),
        min_requests: 10,
        ..AnalysisSpec::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scrape_reads_real_engines_and_a_slow_canary_burns_its_budget() {
    let stable = start_engine("stable0001", &[]);
    let canary = start_engine("canary0001", &["--inject-delay-ms", "150"]);
    let reader = Reader::with_address_map(HashMap::from([
        ("10.0.0.1".to_owned(), stable.address().to_owned()),
        ("10.0.0.2".to_owned(), canary.address().to_owned()),
    ]));
    let targets = [
        Target {
            pod: "svc-g0-r0".to_owned(),
            uid: "uid-g0".to_owned(),
            ip: "10.0.0.1".to_owned(),
            release: "stable0001".to_owned(),
        },
        Target {
            pod: "svc-g1-r0".to_owned(),
            uid: "uid-g1".to_owned(),
            ip: "10.0.0.2".to_owned(),
            release: "canary0001".to_owned(),
        },
    ];
    let spec = analysis();
    // First look before any request: both counters are seen from zero.
    let t0 = Instant::now();
    let before = reader
        .read_at("ml/svc", &spec, "canary0001", "stable0001", &targets, t0)
        .await;
    assert_eq!(before.error, None);
    let http = reqwest::Client::new();
    for _ in 0..REQUESTS {
        complete(&http, stable.address()).await;
        complete(&http, canary.address()).await;
    }
    // Within the 1 s interval the first reading is reused; a reading one interval
    // later scrapes again (each completion returned after the engine counted it).
    let reused = reader
        .read_at("ml/svc", &spec, "canary0001", "stable0001", &targets, t0)
        .await;
    assert_eq!(reused, before);
    let reading = reader
        .read_at(
            "ml/svc",
            &spec,
            "canary0001",
            "stable0001",
            &targets,
            t0 + Duration::from_secs(1),
        )
        .await;
    assert_eq!(reading.error, None);
    let canary_w = reading.canary.expect("canary windows");
    let stable_w = reading.stable.expect("stable windows");
    let n = REQUESTS as f64;
    assert_eq!(
        (canary_w.long.eligible, canary_w.short.eligible),
        (n, n),
        "{reading:?}"
    );
    assert_eq!(stable_w.long.eligible, n, "{reading:?}");
    assert!(
        !canary_w.long.partial && !stable_w.long.partial,
        "seen from zero: {reading:?}"
    );
    assert_eq!(
        canary_w.long.good, 0.0,
        "150 ms per step breaks a 60 ms TPOT: {reading:?}"
    );
    assert_eq!(stable_w.long.good, n, "stable meets its SLO: {reading:?}");

    let thresholds = Thresholds {
        objective: 0.99,
        short_window: spec.short_window.clone(),
        long_window: spec.long_window.clone(),
        short_burn: spec.short_burn_rate_threshold,
        long_burn: spec.long_burn_rate_threshold,
        min_requests: 10.0,
    };
    match judge(&thresholds, &reading, 1, 1) {
        Verdict::Abort {
            short_burn,
            long_burn,
            ..
        } => {
            assert!((short_burn - 100.0).abs() < 1e-9 && (long_burn - 100.0).abs() < 1e-9);
        }
        other => panic!("expected an abort, got {other:?}"),
    }
}

#[tokio::test]
async fn an_unreachable_pod_makes_the_reading_inconclusive() {
    // Port 1 on loopback: nothing listens there.
    let reader = Reader::with_address_map(HashMap::from([(
        "10.0.0.9".to_owned(),
        "127.0.0.1:1".to_owned(),
    )]));
    let targets = [Target {
        pod: "svc-g1-r0".to_owned(),
        uid: "uid-g1".to_owned(),
        ip: "10.0.0.9".to_owned(),
        release: "canary0001".to_owned(),
    }];
    let reading = reader
        .read("ml/svc", &analysis(), "canary0001", "stable0001", &targets)
        .await;
    let error = reading
        .error
        .clone()
        .expect("an error for the unreachable canary pod");
    assert!(error.contains("svc-g1-r0"), "{error}");
    let thresholds = Thresholds {
        objective: 0.99,
        short_window: "30s".to_owned(),
        long_window: "60s".to_owned(),
        short_burn: 14.4,
        long_burn: 14.4,
        min_requests: 10.0,
    };
    assert!(matches!(
        judge(&thresholds, &reading, 1, 1),
        Verdict::Inconclusive { .. }
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_canary_reusing_a_pod_name_is_read_from_its_own_pod() {
    // After a rollback the next canary's group gets the same index, so its pod has the
    // rolled-back canary's name; it is another pod (UID) of another release.
    let old = start_engine("canary0001", &[]);
    let new = start_engine("canary0002", &[]);
    let reader = Reader::with_address_map(HashMap::from([
        ("10.0.0.2".to_owned(), old.address().to_owned()),
        ("10.0.0.3".to_owned(), new.address().to_owned()),
    ]));
    let pod = |uid: &str, ip: &str, release: &str| Target {
        pod: "svc-g2-r0".to_owned(),
        uid: uid.to_owned(),
        ip: ip.to_owned(),
        release: release.to_owned(),
    };
    let spec = analysis();
    let t0 = Instant::now();
    let first = [pod("uid-1", "10.0.0.2", "canary0001")];
    let reading = reader
        .read_at("ml/svc", &spec, "canary0001", "stable0001", &first, t0)
        .await;
    assert_eq!(reading.error, None);
    assert!(reading.canary.is_some(), "{reading:?}");

    let next = [pod("uid-2", "10.0.0.3", "canary0002")];
    let before = reader
        .read_at("ml/svc", &spec, "canary0002", "stable0001", &next, t0)
        .await;
    assert_eq!(before.error, None);
    let http = reqwest::Client::new();
    for _ in 0..REQUESTS {
        complete(&http, new.address()).await;
    }
    let reading = reader
        .read_at(
            "ml/svc",
            &spec,
            "canary0002",
            "stable0001",
            &next,
            t0 + Duration::from_secs(1),
        )
        .await;
    let canary = reading
        .canary
        .unwrap_or_else(|| panic!("the new canary has samples: {reading:?}"));
    assert_eq!(canary.long.eligible, REQUESTS as f64, "{reading:?}");
    assert!(!canary.long.partial, "seen from zero: {reading:?}");
}

/// Measured demand reads the same real engine's counters: every request that ended
/// (requests/s) and the tokens it generated (tokens/s), through the operator's own
/// scrape of `/metrics`, from a first sample at zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn measured_demand_reads_a_real_engines_requests_and_tokens() {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use k8s_openapi::jiff::Timestamp;
    use slipway_api::spec::{CapacitySpec, DemandUnit, MetricsSource};
    use slipway_operator::demand::DemandReader;

    let engine = start_engine("demand0001", &[]);
    let reader = DemandReader::with_address_map(HashMap::from([(
        "10.0.0.9".to_owned(),
        engine.address().to_owned(),
    )]));
    let targets = [Target {
        pod: "svc-g0-r0".to_owned(),
        uid: "uid-demand".to_owned(),
        ip: "10.0.0.9".to_owned(),
        release: "demand0001".to_owned(),
    }];
    let spec = |unit: DemandUnit| -> CapacitySpec {
        let mut spec: CapacitySpec = serde_json::from_value(serde_json::json!({
            // Read every 5 s; the test's requests all fall in one 20 s window.
            "demand": {"measured": {"rateWindow": "20s", "peakWindow": "1m"}},
            "replicaGoodput": 1.0,
        }))
        .expect("capacity spec");
        spec.demand_unit = unit;
        spec
    };
    let now = Time(Timestamp::now());
    let t0 = Instant::now();
    // The next reading, one 5 s interval later.
    let t1 = t0 + Duration::from_secs(5);
    let metrics = MetricsSource::default();
    let (requests, tokens) = (
        spec(DemandUnit::RequestsPerSecond),
        spec(DemandUnit::OutputTokensPerSecond),
    );
    let first = reader
        .read_at("ml/req", &requests, &metrics, &targets, &now, t0)
        .await
        .expect("measured");
    assert_eq!((first.current, first.missing.as_deref()), (0.0, None));
    reader
        .read_at("ml/tok", &tokens, &metrics, &targets, &now, t0)
        .await
        .expect("measured");
    let http = reqwest::Client::new();
    for _ in 0..6 {
        complete(&http, engine.address()).await;
    }
    let reading = reader
        .read_at("ml/req", &requests, &metrics, &targets, &now, t1)
        .await
        .expect("measured");
    assert_eq!(reading.missing, None, "{reading:?}");
    assert!(
        (reading.current - 6.0 / 20.0).abs() < 1e-9,
        "6 requests in a 20 s window: {reading:?}"
    );
    assert_eq!(reading.peak, reading.current);
    assert_eq!(reading.source, "scrape of 1 engine pod");
    let reading = reader
        .read_at("ml/tok", &tokens, &metrics, &targets, &now, t1)
        .await
        .expect("measured");
    assert!(
        (reading.current - 36.0 / 20.0).abs() < 1e-9,
        "6 × 6 generated tokens in a 20 s window: {reading:?}"
    );
}
