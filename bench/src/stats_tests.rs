//! Tests of the accounting rules in `stats`.

use proptest::prelude::*;

use super::*;

/// A completed request sent at `t`, first token after `ttft`, then `n - 1` tokens
/// `tpot` apart.
fn done(id: u64, t: f64, ttft: f64, tpot: f64, n: u32) -> RequestRecord {
    let tokens: Vec<f64> = (0..n).map(|i| t + ttft + f64::from(i) * tpot).collect();
    RequestRecord {
        id,
        tenant: None,
        prompt_tokens: 100,
        shared_prefix: false,
        max_tokens: n,
        scheduled_s: t,
        sent_s: Some(t),
        done_s: tokens.last().copied(),
        token_s: tokens,
        outcome: Outcome::Completed,
        http_status: Some(200),
        retry_after: None,
        server_prompt_tokens: None,
        server_output_tokens: None,
        server_cached_tokens: None,
        error: None,
    }
}

fn with(mut r: RequestRecord, outcome: Outcome) -> RequestRecord {
    r.outcome = outcome;
    r
}

/// An honest server's gauges, scraped every 10 ms from 0: each request is in the
/// system while the client has it in flight, and `extra_s` after.
fn server_of(records: &[RequestRecord], extra_s: f64) -> Vec<ServerSample> {
    scraped(records, 0.0, 0.01, extra_s)
}

/// The server's gauges scraped every `interval` from `phase` on: each request is in
/// the system while the client has it in flight, and `extra_s` after.
fn scraped(
    records: &[RequestRecord],
    phase: f64,
    interval: f64,
    extra_s: f64,
) -> Vec<ServerSample> {
    let end = records.iter().filter_map(|r| r.done_s).fold(0.0, f64::max);
    (0..)
        .map(|i| phase + f64::from(i) * interval)
        .take_while(|&t| t <= end)
        .map(|t| ServerSample {
            t,
            in_system: records
                .iter()
                .filter(|r| {
                    r.sent_s.is_some_and(|s| s <= t) && r.done_s.is_some_and(|d| t < d + extra_s)
                })
                .count() as f64,
        })
        .collect()
}

#[test]
fn percentiles_of_known_latencies() {
    // TTFT 10, 20, ..., 1000 ms: nearest-rank P50 = 500, P99 = 990.
    let recs: Vec<_> = (1..=100)
        .map(|i| done(i, 0.0, f64::from(i as u32) / 100.0, 0.05, 3))
        .collect();
    let s = summarize(
        &recs,
        &server_of(&recs, 0.0),
        10.0,
        Some(10.0),
        Slo::default(),
        DEFAULT_BUCKETS,
    );
    let p50 = s.ttft.p50_ms.unwrap();
    let p99 = s.ttft.p99_ms.unwrap();
    assert!((p50 - 500.0).abs() < 1.0, "{p50}");
    assert!((p99 - 990.0).abs() < 1.0, "{p99}");
    let tpot = s.tpot.p99_ms.unwrap();
    assert!((tpot - 50.0).abs() < 0.1, "{tpot}");
    assert_eq!(s.counts.completed, 100);
    assert!((s.goodput_rps - 10.0).abs() < 1e-9);
    assert!(s.slo_pass, "{:?}", s.slo_failures);
}

#[test]
fn timeouts_are_infinite_never_finite_latencies() {
    // 97 fast requests and 3 that timed out after their first token: P99 of E2E must
    // be infinite, not the timeout value.
    let mut recs: Vec<_> = (0..97).map(|i| done(i, 0.0, 0.1, 0.01, 4)).collect();
    for i in 97..100 {
        recs.push(with(done(i, 0.0, 0.1, 10.0, 2), Outcome::TimedOut));
    }
    let s = summarize(
        &recs,
        &server_of(&recs, 0.0),
        10.0,
        Some(10.0),
        Slo::default(),
        DEFAULT_BUCKETS,
    );
    assert_eq!(s.counts.timed_out, 3);
    assert_eq!(s.e2e.count, 97);
    assert_eq!(s.e2e.infinite, 3);
    assert_eq!(s.e2e.p99_ms, None);
    assert!(s.e2e.p50_ms.unwrap() < 200.0);
    assert_eq!(s.tpot.p99_ms, None);
    // TTFT was seen for the timed-out ones, so it stays finite.
    assert!(s.ttft.p99_ms.is_some());
    assert!(!s.slo_pass);
    assert!(
        s.slo_failures.iter().any(|f| f.contains("TPOT")),
        "{:?}",
        s.slo_failures
    );
}

#[test]
fn rejections_count_against_success_not_latency() {
    let mut recs: Vec<_> = (0..8).map(|i| done(i, 0.0, 0.1, 0.01, 4)).collect();
    let mut rej = done(8, 0.0, 0.0, 0.0, 0);
    rej.outcome = Outcome::Rejected;
    rej.http_status = Some(429);
    rej.retry_after = Some("1".into());
    rej.done_s = Some(0.01);
    recs.push(rej);
    let mut capped = RequestRecord::new(
        &crate::workload::RequestPlan {
            id: 9,
            arrival_s: 0.0,
            system: None,
            prompt: String::new(),
            prompt_tokens: 100,
            max_tokens: 4,
            tenant: None,
            deadline_ms: None,
        },
        0.0,
    );
    capped.outcome = Outcome::ClientCapped;
    recs.push(capped);
    let s = summarize(
        &recs,
        &server_of(&recs, 0.0),
        1.0,
        Some(10.0),
        Slo::default(),
        DEFAULT_BUCKETS,
    );
    assert_eq!(s.counts.offered, 10);
    assert_eq!(s.counts.admitted, 8);
    assert_eq!(s.counts.rejected, 1);
    assert_eq!(s.counts.rejected_with_retry_after, 1);
    assert_eq!(s.counts.client_capped, 1);
    assert_eq!(
        s.ttft.count + s.ttft.infinite,
        8,
        "rejections are not latencies"
    );
    assert!((s.success_rate - 0.8).abs() < 1e-12);
    assert!((s.goodput_rps - 8.0).abs() < 1e-12);
    assert!(!s.slo_pass);
}

#[test]
fn goodput_counts_only_requests_meeting_every_target() {
    let slo = Slo {
        ttft_ms: 500.0,
        tpot_ms: 50.0,
        percentile: 99.0,
        min_success: 0.0,
    };
    let recs = vec![
        done(0, 0.0, 0.1, 0.01, 5), // meets both
        done(1, 0.0, 0.9, 0.01, 5), // TTFT too slow
        done(2, 0.0, 0.1, 0.2, 5),  // TPOT too slow
        done(3, 0.0, 0.2, 1.0, 1),  // one token: TPOT undefined, TTFT ok
    ];
    let s = summarize(
        &recs,
        &server_of(&recs, 0.0),
        2.0,
        None,
        slo,
        DEFAULT_BUCKETS,
    );
    assert_eq!(s.slo_met, 2);
    assert!((s.goodput_rps - 1.0).abs() < 1e-12);
    assert_eq!(s.tpot.count, 3);
}

#[test]
fn prefix_hit_rate_counts_completed_requests_that_reported_cached_tokens() {
    let mut a = done(0, 0.0, 0.1, 0.01, 3);
    (a.server_prompt_tokens, a.server_cached_tokens) = (Some(400), Some(384));
    let mut b = done(1, 0.0, 0.1, 0.01, 3);
    (b.server_prompt_tokens, b.server_cached_tokens) = (Some(400), Some(0));
    // A server that reports no cached count, and a request that did not finish, are
    // left out rather than counted as misses.
    let mut c = done(2, 0.0, 0.1, 0.01, 3);
    c.server_prompt_tokens = Some(400);
    let mut d = with(done(3, 0.0, 0.1, 0.01, 3), Outcome::TimedOut);
    (d.server_prompt_tokens, d.server_cached_tokens) = (Some(400), Some(400));
    let recs = [a, b, c, d];
    let s = summarize(
        &recs,
        &server_of(&recs, 0.0),
        1.0,
        None,
        Slo::default(),
        DEFAULT_BUCKETS,
    );
    assert_eq!(
        (
            s.prefix_cache.requests,
            s.prefix_cache.prompt_tokens,
            s.prefix_cache.cached_tokens
        ),
        (2, 800, 384)
    );
    assert!((s.prefix_cache.hit_rate.unwrap() - 0.48).abs() < 1e-12);
    let none = summarize(&[], &[], 1.0, None, Slo::default(), DEFAULT_BUCKETS);
    assert_eq!(none.prefix_cache.hit_rate, None);
}

#[test]
fn buckets_split_by_prompt_length() {
    let mut a = done(0, 0.0, 0.1, 0.01, 3);
    a.prompt_tokens = 64;
    let mut b = done(1, 0.0, 0.7, 0.01, 3);
    b.prompt_tokens = 300;
    let s = summarize(&[a, b], &[], 1.0, None, Slo::default(), &[128, 256, 512]);
    let edges: Vec<_> = s
        .by_prompt_length
        .iter()
        .map(|b| (b.lo, b.hi, b.offered))
        .collect();
    assert_eq!(edges, vec![(0, Some(128), 1), (256, Some(512), 1)]);
    assert!(s.by_prompt_length[1].ttft.p50_ms.unwrap() > 600.0);
}

#[test]
fn littles_law_agrees_with_an_honest_servers_gauges() {
    let recs: Vec<_> = (0..50)
        .map(|i| done(i, f64::from(i as u32) * 0.1, 0.3, 0.02, 10))
        .collect();
    let l = littles_law(&recs, &server_of(&recs, 0.0));
    assert_eq!(l.consistent, Some(true), "{l:?}");
    assert!(l.relative_error.is_some_and(|e| e < 0.01), "{l:?}");
    assert!(l.server_in_system.is_some_and(|l| l > 1.0), "{l:?}");
}

#[test]
fn littles_law_fails_when_the_client_and_the_server_disagree() {
    let recs: Vec<_> = (0..50)
        .map(|i| done(i, f64::from(i as u32) * 0.1, 0.3, 0.02, 10))
        .collect();
    let server = server_of(&recs, 0.0);
    // Every record's done time written 0.5 s late: latencies that did not happen.
    let late: Vec<_> = recs
        .iter()
        .cloned()
        .map(|mut r| {
            r.done_s = r.done_s.map(|d| d + 0.5);
            r
        })
        .collect();
    let l = littles_law(&late, &server);
    assert_eq!(l.consistent, Some(false), "{l:?}");
    // A server that keeps each request 0.5 s after the client saw it end.
    let l = littles_law(&recs, &server_of(&recs, 0.5));
    assert_eq!(l.consistent, Some(false), "{l:?}");
}

#[test]
fn littles_law_is_not_checked_without_enough_server_samples() {
    let recs: Vec<_> = (0..50)
        .map(|i| done(i, f64::from(i as u32) * 0.1, 0.3, 0.02, 10))
        .collect();
    let none = littles_law(&recs, &[]);
    assert_eq!(
        (none.consistent, none.server_samples),
        (None, 0),
        "{none:?}"
    );
    assert!(none.predicted > 1.0, "λW is still reported: {none:?}");
    let few = littles_law(&recs, &server_of(&recs, 0.0)[..MIN_SERVER_SAMPLES - 1]);
    assert_eq!(few.consistent, None, "{few:?}");
}

#[test]
fn few_short_requests_are_judged_with_their_sampling_error() {
    // CI's case: two ~95 ms requests 2 s apart, scraped every 50 ms. Where the scrapes
    // fall decides whether each is seen once or twice, so L is ±50 % of λW by
    // sampling alone.
    let recs = [done(0, 0.5, 0.05, 0.005, 10), done(1, 2.5, 0.05, 0.005, 10)];
    let seen_once = littles_law(&recs, &scraped(&recs, 0.049, 0.05, 0.0));
    assert!(
        seen_once
            .relative_error
            .is_some_and(|e| e > LITTLE_TOLERANCE),
        "{seen_once:?}"
    );
    assert_eq!(seen_once.consistent, Some(true), "{seen_once:?}");
    // The allowance does not hide a server that keeps each request 0.5 s longer.
    let longer = scraped(&recs, 0.049, 0.05, 0.5);
    let l = littles_law(&recs, &longer);
    assert_eq!(l.consistent, Some(false), "{l:?}");
}

proptest! {
    #[test]
    fn an_honest_server_is_consistent_wherever_its_scrapes_fall(
        phase in 0.0..0.05f64,
        count in 2usize..40,
        spacing in 0.05..1.0f64,
        ttft in 0.02..0.3f64,
    ) {
        let recs: Vec<_> = (0..count)
            .map(|i| done(i as u64, 1.0 + i as f64 * spacing, ttft, 0.005, 10))
            .collect();
        let l = littles_law(&recs, &scraped(&recs, phase, 0.05, 0.0));
        prop_assert_eq!(l.consistent, Some(true), "{:?}", l);
    }

    #[test]
    fn every_offered_request_is_counted_exactly_once(outcomes in prop::collection::vec(0usize..6, 0..200)) {
        let recs: Vec<_> = outcomes.iter().enumerate().map(|(i, &o)| {
            let mut r = done(i as u64, 0.0, 0.1, 0.01, 3);
            r.outcome = Outcome::ALL[o];
            if r.outcome == Outcome::ClientCapped { r.sent_s = None; }
            r
        }).collect();
        let s = summarize(&recs, &server_of(&recs, 0.0), 1.0, None, Slo::default(), DEFAULT_BUCKETS);
        let c = &s.counts;
        prop_assert_eq!(c.completed + c.rejected + c.timed_out + c.cancelled + c.errors + c.client_capped, c.offered);
        prop_assert_eq!(c.offered, recs.len() as u64);
        prop_assert_eq!(s.e2e.count + s.e2e.infinite, c.admitted);
        prop_assert_eq!(s.e2e.count, c.completed);
    }
}
