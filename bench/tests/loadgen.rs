//! The load generator against an in-process server with known, injected behaviour.
//!
//! Latency bounds below are logical: a measured TTFT can never be shorter than the
//! delay the server injects before its first token, and the upper bounds are loose
//! (seconds) so that only a wrong measurement base, not a slow machine, fails them.

#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{Behaviour, start};
use slipway_bench::client::{Client, ClientConfig};
use slipway_bench::record::Outcome;
use slipway_bench::runner::{RunLimits, Sessions, closed_loop, open_loop};
use slipway_bench::stats::{DEFAULT_BUCKETS, MIN_SERVER_SAMPLES, Slo, summarize};
use slipway_bench::workload::{Api, LengthDist, RequestPlan, WorkloadSpec, generate};

fn client(url: &str, api: Api, timeout: Duration) -> Client {
    Client::new(ClientConfig {
        base_url: url.into(),
        model: "fake".into(),
        api,
        timeout,
        api_key: None,
        ignore_eos: true,
    })
    .unwrap()
}

fn spec(out_tokens: u32) -> WorkloadSpec {
    WorkloadSpec {
        prompt_tokens: LengthDist::Fixed { value: 20 },
        output_tokens: LengthDist::Fixed { value: out_tokens },
        ..WorkloadSpec::default()
    }
}

/// `n` requests arriving `gap_s` apart, starting at `gap_s`.
fn plans(spec: &WorkloadSpec, n: usize, gap_s: f64) -> Vec<RequestPlan> {
    let arrivals: Vec<f64> = (1..=n).map(|i| i as f64 * gap_s).collect();
    generate(spec, &arrivals, 3).unwrap()
}

const LIMITS: RunLimits = RunLimits {
    window_s: 60.0,
    drain_s: 30.0,
    max_in_flight: 1000,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttft_tpot_and_e2e_match_injected_latencies() {
    let ttft = 0.2;
    let tpot = 0.03;
    let url = start(Behaviour {
        ttft: Duration::from_secs_f64(ttft),
        tpot: Duration::from_secs_f64(tpot),
        ..Behaviour::default()
    })
    .await;
    for api in [Api::Completions, Api::Chat] {
        let w = WorkloadSpec { api, ..spec(6) };
        let out = open_loop(
            &client(&url, api, Duration::from_secs(30)),
            plans(&w, 4, 0.05),
            LIMITS,
            None,
        )
        .await;
        assert_eq!(out.records.len(), 4);
        for r in &out.records {
            assert_eq!(r.outcome, Outcome::Completed, "{r:?}");
            assert_eq!(r.token_s.len(), 6, "one timestamp per streamed token");
            assert_eq!(r.server_output_tokens, Some(6));
            assert_eq!(r.server_prompt_tokens, Some(18), "tag (2 words) + 16 words");
            let (t, p, e) = (r.ttft_s().unwrap(), r.tpot_s().unwrap(), r.e2e_s().unwrap());
            assert!(t >= ttft && t < ttft + 2.0, "ttft {t}");
            assert!(p >= tpot && p < tpot + 0.5, "tpot {p}");
            // E2E is stamped when the stream ends, apart from the token stamps: it
            // covers the injected TTFT and five injected gaps, and it ends no earlier
            // than the last token arrived (and not long after: the usage chunk and
            // [DONE] follow at once).
            let last_token = r.token_s.last().unwrap() - r.scheduled_s;
            assert!(e >= ttft + 5.0 * tpot, "e2e {e}");
            assert!(
                e >= last_token && e < last_token + 0.5,
                "e2e {e}, last token {last_token}"
            );
            assert!(r.itl_s().all(|g| g >= 0.0));
        }
        let s = summarize(
            &out.records,
            &out.server,
            1.0,
            None,
            Slo::default(),
            DEFAULT_BUCKETS,
        );
        assert!(s.ttft.p50_ms.unwrap() >= ttft * 1000.0 * 0.999);
        assert_eq!(s.counts.completed, 4);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejections_errors_and_timeouts_are_counted_not_turned_into_latencies() {
    let url = start(Behaviour {
        ttft: Duration::from_millis(20),
        tpot: Duration::from_millis(5),
        reject_every: Some(3),
        overload_every: Some(5),
        fail_every: Some(7),
        hang_every: Some(11),
        ..Behaviour::default()
    })
    .await;
    let w = spec(4);
    let reqs = plans(&w, 40, 0.01);
    let out = open_loop(
        &client(&url, Api::Completions, Duration::from_millis(1500)),
        reqs,
        LIMITS,
        None,
    )
    .await;
    let by = |o: Outcome| out.records.iter().filter(|r| r.outcome == o).count();
    // Ids 0..40 by the fake server's rules, in priority order reject > overload > fail > hang.
    let reject: Vec<u64> = (0..40).filter(|i| i % 3 == 1).collect();
    let overload: Vec<u64> = (0..40).filter(|i| i % 3 != 1 && i % 5 == 2).collect();
    let fail: Vec<u64> = (0..40)
        .filter(|i| i % 3 != 1 && i % 5 != 2 && i % 7 == 3)
        .collect();
    let hang: Vec<u64> = (0..40)
        .filter(|i| i % 3 != 1 && i % 5 != 2 && i % 7 != 3 && i % 11 == 0)
        .collect();
    assert_eq!(by(Outcome::Rejected), reject.len() + overload.len());
    assert_eq!(by(Outcome::Error), fail.len());
    assert_eq!(by(Outcome::TimedOut), hang.len());
    assert_eq!(
        by(Outcome::Completed),
        40 - reject.len() - overload.len() - fail.len() - hang.len()
    );
    for r in &out.records {
        match r.outcome {
            Outcome::Rejected if reject.contains(&r.id) => {
                assert_eq!(
                    (r.http_status, r.retry_after.as_deref()),
                    (Some(429), Some("2"))
                );
            }
            Outcome::Rejected => {
                assert_eq!((r.http_status, r.retry_after.as_deref()), (Some(503), None))
            }
            Outcome::TimedOut => {
                assert!(hang.contains(&r.id));
                assert_eq!(r.e2e_s(), None);
                assert_eq!(r.tpot_s(), None);
                assert!(
                    r.ttft_s().is_some(),
                    "the hung stream did send its first token"
                );
            }
            Outcome::Error => assert!(r.error.as_deref().unwrap().contains("500")),
            _ => {}
        }
    }
    let s = summarize(
        &out.records,
        &out.server,
        0.4,
        Some(100.0),
        Slo::default(),
        DEFAULT_BUCKETS,
    );
    assert_eq!(s.counts.rejected_with_retry_after as usize, reject.len());
    assert_eq!(s.e2e.infinite as usize, fail.len() + hang.len());
    assert_eq!(s.e2e.p99_ms, None, "P99 falls on an unfinished request");
    assert!(!s.slo_pass);
    // Rejected, failed and timed-out requests leave both accounts alike: the server's
    // gauge of running streams agrees with the client's λW.
    assert_eq!(s.little.consistent, Some(true), "{:?}", s.little);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_loop_keeps_its_schedule_when_the_server_is_slow() {
    // Every response takes ≥ 3 s; 19 arrivals are scheduled within the first second.
    // A closed loop (or a client that waits for a free connection) could only have sent
    // one request before the first response; an honest open loop has sent all of them.
    let url = start(Behaviour {
        ttft: Duration::from_secs(3),
        tpot: Duration::from_millis(1),
        ..Behaviour::default()
    })
    .await;
    let w = spec(2);
    let out = open_loop(
        &client(&url, Api::Completions, Duration::from_secs(30)),
        plans(&w, 19, 0.05),
        LIMITS,
        None,
    )
    .await;
    let first_response = out
        .records
        .iter()
        .filter_map(|r| r.token_s.first())
        .copied()
        .fold(f64::INFINITY, f64::min);
    assert!(out.records.iter().all(|r| r.outcome == Outcome::Completed));
    assert!(
        out.records
            .iter()
            .all(|r| r.sent_s.unwrap() < first_response)
    );
    assert_eq!(out.peak_in_flight, 19);
    // TTFT is measured from the schedule, so it includes any client lateness too.
    assert!(out.records.iter().all(|r| r.ttft_s().unwrap() >= 3.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_cap_is_reported_never_queued() {
    let url = start(Behaviour {
        ttft: Duration::from_secs(3),
        tpot: Duration::from_millis(1),
        ..Behaviour::default()
    })
    .await;
    let w = spec(2);
    let limits = RunLimits {
        max_in_flight: 5,
        ..LIMITS
    };
    let out = open_loop(
        &client(&url, Api::Completions, Duration::from_secs(30)),
        plans(&w, 19, 0.05),
        limits,
        None,
    )
    .await;
    // None of the first five can finish within the first second, so exactly the other
    // fourteen arrive to a full cap.
    let capped: Vec<u64> = out
        .records
        .iter()
        .filter(|r| r.outcome == Outcome::ClientCapped)
        .map(|r| r.id)
        .collect();
    assert_eq!(capped, (5..19).collect::<Vec<_>>());
    assert!(
        out.records
            .iter()
            .filter(|r| r.outcome == Outcome::ClientCapped)
            .all(|r| r.sent_s.is_none())
    );
    let s = summarize(
        &out.records,
        &out.server,
        1.0,
        Some(19.0),
        Slo::default(),
        DEFAULT_BUCKETS,
    );
    assert_eq!(s.counts.client_capped, 14);
    assert_eq!(s.counts.offered, 19);
    assert!((s.success_rate - 5.0 / 19.0).abs() < 1e-12);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadlines_and_the_end_of_the_run_cancel_requests() {
    let url = start(Behaviour {
        ttft: Duration::from_secs(5),
        tpot: Duration::from_millis(1),
        ..Behaviour::default()
    })
    .await;
    let w = WorkloadSpec {
        deadline_ms: Some(300),
        ..spec(2)
    };
    let c = client(&url, Api::Completions, Duration::from_secs(30));
    let out = open_loop(&c, plans(&w, 3, 0.01), LIMITS, None).await;
    assert!(
        out.records
            .iter()
            .all(|r| r.outcome == Outcome::Cancelled
                && r.error.as_deref() == Some("deadline passed"))
    );
    let short = RunLimits {
        window_s: 0.1,
        drain_s: 0.2,
        max_in_flight: 10,
    };
    let out = open_loop(&c, plans(&spec(2), 3, 0.01), short, None).await;
    assert!(
        out.records
            .iter()
            .all(|r| r.outcome == Outcome::Cancelled && r.error.as_deref() == Some("run ended"))
    );
    let s = summarize(
        &out.records,
        &out.server,
        0.1,
        None,
        Slo::default(),
        DEFAULT_BUCKETS,
    );
    assert_eq!((s.counts.cancelled, s.ttft.infinite), (3, 3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_loop_sessions_never_exceed_their_concurrency() {
    let url = start(Behaviour {
        ttft: Duration::from_millis(30),
        tpot: Duration::from_millis(5),
        ..Behaviour::default()
    })
    .await;
    let w = spec(3);
    let reqs = generate(&w, &[0.0; 12], 1).unwrap();
    let limits = RunLimits {
        window_s: 60.0,
        drain_s: 10.0,
        max_in_flight: 1,
    };
    let out = closed_loop(
        &client(&url, Api::Completions, Duration::from_secs(30)),
        reqs,
        Sessions {
            count: 3,
            think_s: 0.01,
            seed: 1,
        },
        limits,
        None,
    )
    .await;
    assert_eq!(out.records.len(), 12, "all plans used, none lost");
    assert!(out.records.iter().all(|r| r.outcome == Outcome::Completed));
    assert!(out.peak_in_flight <= 3);
}

/// Little's law between independent accounts: the client's λW from its records, L
/// from the server's own gauge of running streams scraped during the run. An honest
/// gauge agrees, in an open and in a closed loop; a gauge that counts three requests
/// the server does not hold fails the check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn littles_law_checks_the_clients_records_against_the_servers_gauge() {
    for (closed, phantom, consistent) in [(false, 0, true), (false, 3, false), (true, 0, true)] {
        let url = start(Behaviour {
            ttft: Duration::from_millis(100),
            tpot: Duration::from_millis(20),
            phantom_running: phantom,
            ..Behaviour::default()
        })
        .await;
        let c = client(&url, Api::Completions, Duration::from_secs(30));
        let reqs = plans(&spec(10), 30, 0.05);
        let out = if closed {
            let sessions = Sessions {
                count: 3,
                think_s: 0.0,
                seed: 1,
            };
            closed_loop(&c, reqs, sessions, LIMITS, None).await
        } else {
            open_loop(&c, reqs, LIMITS, None).await
        };
        let s = summarize(
            &out.records,
            &out.server,
            1.5,
            None,
            Slo::default(),
            DEFAULT_BUCKETS,
        );
        let l = &s.little;
        assert_eq!(s.counts.completed, 30);
        assert!(l.server_samples >= MIN_SERVER_SAMPLES, "{l:?}");
        assert!(
            l.predicted > 2.0,
            "several requests in flight on average: {l:?}"
        );
        assert_eq!(
            l.consistent,
            Some(consistent),
            "closed loop {closed}, phantom {phantom}: {l:?}"
        );
    }
}
