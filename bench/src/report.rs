//! Human-readable reports: the run summary, the sweep table, the capacity note, and
//! the side-by-side comparison of two servers. Pure string building.

use std::fmt::Write as _;

use serde::Serialize;
use slipway_api::spec::DemandUnit;

use crate::stats::{LITTLE_TOLERANCE, Latency, LittleCheck, MIN_SERVER_SAMPLES, Summary};
use crate::sweep::{SweepPoint, SweepResult};

/// A latency percentile for a table: `inf` when infinite, `-` when there were no samples.
fn ms(v: Option<f64>, l: &Latency) -> String {
    match v {
        Some(v) => format!("{v:.0}"),
        None if l.count + l.infinite == 0 => "-".into(),
        None => "inf".into(),
    }
}

/// The summary of one run as a table.
#[must_use]
pub fn summary_table(label: &str, s: &Summary) -> String {
    let c = &s.counts;
    let mut o = String::new();
    let rate = s
        .offered_rate
        .map_or("closed loop".into(), |r| format!("{r} req/s offered"));
    let _ = writeln!(o, "== {label}: {rate}, window {:.0} s ==", s.window_s);
    let _ = writeln!(
        o,
        "requests: offered {} | admitted {} | completed {} | rejected {} ({} with Retry-After) | timed out {} | cancelled {} | errors {} | client-capped {}",
        c.offered,
        c.admitted,
        c.completed,
        c.rejected,
        c.rejected_with_retry_after,
        c.timed_out,
        c.cancelled,
        c.errors,
        c.client_capped
    );
    let _ = writeln!(
        o,
        "success {:.1}% | SLO met {} | SLO-goodput {:.3} req/s | throughput {:.3} req/s, {:.1} output tok/s",
        s.success_rate * 100.0,
        s.slo_met,
        s.goodput_rps,
        s.throughput_rps,
        s.output_tokens_per_s
    );
    let _ = writeln!(
        o,
        "{:<8} {:>8} {:>8} {:>8} {:>8} {:>7} {:>5}",
        "ms", "mean", "P50", "P95", "P99", "n", "inf"
    );
    for (name, l) in [
        ("TTFT", &s.ttft),
        ("TPOT", &s.tpot),
        ("ITL", &s.itl),
        ("E2E", &s.e2e),
    ] {
        let _ = writeln!(
            o,
            "{name:<8} {:>8} {:>8} {:>8} {:>8} {:>7} {:>5}",
            l.mean_ms.map_or("-".into(), |m| format!("{m:.0}")),
            ms(l.p50_ms, l),
            ms(l.p95_ms, l),
            ms(l.p99_ms, l),
            l.count,
            l.infinite
        );
    }
    if !s.by_prompt_length.is_empty() {
        let _ = writeln!(
            o,
            "by prompt length (tokens): TTFT P50/P99, TPOT P50/P99, E2E P99 (ms)"
        );
        for b in &s.by_prompt_length {
            let hi = b.hi.map_or("∞".into(), |h| h.to_string());
            let _ = writeln!(
                o,
                "  [{:>4}, {:>4}) n={:<5} TTFT {}/{}  TPOT {}/{}  E2E {}",
                b.lo,
                hi,
                b.offered,
                ms(b.ttft.p50_ms, &b.ttft),
                ms(b.ttft.p99_ms, &b.ttft),
                ms(b.tpot.p50_ms, &b.tpot),
                ms(b.tpot.p99_ms, &b.tpot),
                ms(b.e2e.p99_ms, &b.e2e)
            );
        }
    }
    if let Some(h) = s.prefix_cache.hit_rate {
        let _ = writeln!(
            o,
            "prefix cache (server usage): {} of {} prompt tokens cached ({:.1}%) over {} requests",
            s.prefix_cache.cached_tokens,
            s.prefix_cache.prompt_tokens,
            h * 100.0,
            s.prefix_cache.requests
        );
    }
    let _ = writeln!(o, "Little's law: {}", little_line(&s.little));
    let verdict = if s.slo_pass {
        "PASS".to_owned()
    } else {
        format!("FAIL: {}", s.slo_failures.join("; "))
    };
    let _ = writeln!(o, "SLO ({}): {verdict}", s.slo.describe());
    o
}

fn point_row(p: &SweepPoint) -> String {
    let s = &p.summary;
    format!(
        "{:>8.3} {:>9.3} {:>8.1} {:>8} {:>8} {:>8} {:>8} {:>9.1} {:>6}",
        p.rate,
        s.goodput_rps,
        s.success_rate * 100.0,
        ms(s.ttft.p50_ms, &s.ttft),
        ms(s.ttft.p99_ms, &s.ttft),
        ms(s.tpot.p50_ms, &s.tpot),
        ms(s.tpot.p99_ms, &s.tpot),
        s.output_tokens_per_s,
        if s.slo_pass { "pass" } else { "FAIL" }
    )
}

/// The sweep as a table, one row per offered rate.
#[must_use]
pub fn sweep_table(r: &SweepResult) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "== sweep: {} ==", r.label);
    let _ = writeln!(o, "workload: {}; arrivals: {}", r.workload, r.arrivals);
    let _ = writeln!(o, "SLO: {}", r.slo.describe());
    let _ = writeln!(
        o,
        "{:>8} {:>9} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9} {:>6}",
        "rate/s",
        "goodput/s",
        "succ%",
        "TTFTp50",
        "TTFTp99",
        "TPOTp50",
        "TPOTp99",
        "out tok/s",
        "SLO"
    );
    for p in r.sorted_points() {
        let _ = writeln!(o, "{}", point_row(p));
    }
    match &r.frontier {
        Some(f) => {
            let _ = writeln!(
                o,
                "frontier: {:.3} req/s offered, SLO-goodput {:.3} req/s{}",
                f.rate,
                f.goodput_rps,
                if r.frontier_is_lower_bound() {
                    " (every rate passed: a lower bound; offer higher rates to find it)"
                } else {
                    ""
                }
            );
        }
        None => {
            let _ = writeln!(
                o,
                "frontier: none (the lowest rate tried already failed the SLO)"
            );
        }
    }
    o
}

/// The capacity note to paste into an `InferenceService`, with what it was measured
/// under. `replicaGoodput` is in `unit`, SLO-meeting requests/s or their generated
/// tokens/s at the frontier, and `demandUnit` names it, so the operator compares it with
/// demand counted the same way; the other unit's value is a comment.
#[must_use]
pub fn capacity_note(r: &SweepResult, unit: DemandUnit) -> String {
    match &r.frontier {
        Some(f) => {
            let requests = format!("{:.3}", f.goodput_rps);
            let tokens = format!("{:.1}", f.goodput_output_tokens_per_s);
            let (goodput, other) = match unit {
                DemandUnit::RequestsPerSecond => (
                    requests,
                    format!(
                        "in tokens: replicaGoodput {tokens} with demandUnit OutputTokensPerSecond"
                    ),
                ),
                DemandUnit::OutputTokensPerSecond => (
                    tokens,
                    format!(
                        "in requests: replicaGoodput {requests} with demandUnit RequestsPerSecond"
                    ),
                ),
            };
            format!(
                "# measured by slipway-bench against {}\n# workload: {}\n# arrivals: {}\n# SLO: {}\n\
                 # frontier {:.3} req/s offered; {other}\n\
                 capacity:\n  replicaGoodput: {goodput}\n  demandUnit: {}\n",
                r.label,
                r.workload,
                r.arrivals,
                r.slo.describe(),
                f.rate,
                demand_unit_name(unit),
            )
        }
        None => format!(
            "# no capacity.replicaGoodput: {} failed the SLO ({}) at every rate tried\n",
            r.label,
            r.slo.describe()
        ),
    }
}

/// `capacity.demandUnit`'s spelling in the InferenceService.
fn demand_unit_name(unit: DemandUnit) -> &'static str {
    match unit {
        DemandUnit::RequestsPerSecond => "RequestsPerSecond",
        DemandUnit::OutputTokensPerSecond => "OutputTokensPerSecond",
    }
}

fn ratio_value(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

/// One metric of a comparison: ours, the peer's, and the ratio in the direction where
/// greater than 1 means we are better.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Compared {
    /// Our value (`None`: none, or an infinite percentile).
    pub ours: Option<f64>,
    /// The peer's value.
    pub peer: Option<f64>,
    /// ours/peer for rates, peer/ours for latencies: > 1 is better for us.
    pub ratio: Option<f64>,
}

impl Compared {
    fn higher_better(ours: Option<f64>, peer: Option<f64>) -> Self {
        Self {
            ours,
            peer,
            ratio: ratio_value(ours, peer),
        }
    }

    fn lower_better(ours: Option<f64>, peer: Option<f64>) -> Self {
        Self {
            ours,
            peer,
            ratio: ratio_value(peer, ours),
        }
    }
}

/// The metrics compared at one offered rate both sweeps measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EqualLoad {
    /// The offered rate, requests/s.
    pub rate: f64,
    /// TTFT P99, ms.
    pub ttft_p99_ms: Compared,
    /// TPOT P99, ms.
    pub tpot_p99_ms: Compared,
    /// Output tokens/s of completed requests.
    pub output_tokens_per_s: Compared,
    /// Mean output tokens per completed request: equal unless a server stopped early
    /// (no `ignore_eos`), which would make its work lighter.
    pub mean_output_tokens: Compared,
}

/// Two sweeps side by side, as written by `compare --json`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Comparison {
    /// The system under test.
    pub ours: String,
    /// The peer.
    pub peer: String,
    /// The workload (ours; a mismatch sets `comparable` false).
    pub workload: String,
    /// The SLO (ours).
    pub slo: String,
    /// Same workload and SLO on both sides.
    pub comparable: bool,
    /// SLO-goodput at the frontier, requests/s.
    pub goodput_frontier_rps: Compared,
    /// When we have a frontier and the peer failed even its lowest rate, its frontier
    /// lies below that rate, so the ratio is at least our goodput over that rate.
    pub goodput_frontier_ratio_at_least: Option<f64>,
    /// Output tokens/s at each side's own frontier.
    pub frontier_output_tokens_per_s: Compared,
    /// The highest rate both measured at which the peer still passed (or, if it never
    /// passed, the lowest common rate); `None` when no rate is common.
    pub equal_load: Option<EqualLoad>,
}

fn mean_output_tokens(s: &Summary) -> Option<f64> {
    (s.counts.completed > 0).then(|| s.output_tokens_per_s * s.window_s / s.counts.completed as f64)
}

/// The points compared at equal offered load: the highest rate both sweeps measured
/// at which the peer still passed, else the lowest common rate.
fn equal_load_points<'a>(
    a: &'a SweepResult,
    b: &'a SweepResult,
) -> Option<(&'a SweepPoint, &'a SweepPoint)> {
    let common: Vec<(&SweepPoint, &SweepPoint)> = a
        .sorted_points()
        .into_iter()
        .filter_map(|pa| {
            b.points
                .iter()
                .find(|pb| (pb.rate - pa.rate).abs() < 1e-9)
                .map(|pb| (pa, pb))
        })
        .collect();
    common
        .iter()
        .rev()
        .find(|(_, pb)| pb.summary.slo_pass)
        .or_else(|| common.first())
        .copied()
}

/// Compares `a` (ours) with `b` (the peer).
#[must_use]
pub fn compare(a: &SweepResult, b: &SweepResult) -> Comparison {
    let equal_load = equal_load_points(a, b).map(|(pa, pb)| {
        let (sa, sb) = (&pa.summary, &pb.summary);
        EqualLoad {
            rate: pa.rate,
            ttft_p99_ms: Compared::lower_better(sa.ttft.p99_ms, sb.ttft.p99_ms),
            tpot_p99_ms: Compared::lower_better(sa.tpot.p99_ms, sb.tpot.p99_ms),
            output_tokens_per_s: Compared::higher_better(
                Some(sa.output_tokens_per_s),
                Some(sb.output_tokens_per_s),
            ),
            mean_output_tokens: Compared::higher_better(
                mean_output_tokens(sa),
                mean_output_tokens(sb),
            ),
        }
    });
    let ours_goodput = a.frontier.as_ref().map(|f| f.goodput_rps);
    let peer_lowest = b.sorted_points().first().map(|p| p.rate);
    let goodput_frontier_ratio_at_least = match (ours_goodput, &b.frontier, peer_lowest) {
        (Some(g), None, Some(lo)) if lo > 0.0 => Some(g / lo),
        _ => None,
    };
    Comparison {
        goodput_frontier_ratio_at_least,
        ours: a.label.clone(),
        peer: b.label.clone(),
        workload: a.workload.clone(),
        slo: a.slo.describe(),
        comparable: a.workload == b.workload && a.slo == b.slo,
        goodput_frontier_rps: Compared::higher_better(
            a.frontier.as_ref().map(|f| f.goodput_rps),
            b.frontier.as_ref().map(|f| f.goodput_rps),
        ),
        frontier_output_tokens_per_s: Compared::higher_better(
            a.frontier.as_ref().map(|f| f.output_tokens_per_s),
            b.frontier.as_ref().map(|f| f.output_tokens_per_s),
        ),
        equal_load,
    }
}

/// Side-by-side comparison of `a` (ours) against `b` (the peer), with ratios.
///
/// "Equal offered load" is the highest rate both sweeps measured at which the peer
/// still passed (or, if it never passed, the lowest common rate).
#[must_use]
pub fn compare_table(a: &SweepResult, b: &SweepResult) -> String {
    let c = compare(a, b);
    let mut o = String::new();
    let _ = writeln!(o, "== {} vs {} ==", c.ours, c.peer);
    let _ = writeln!(o, "workload: {}; SLO: {}", c.workload, c.slo);
    if !c.comparable {
        let _ = writeln!(
            o,
            "WARNING: the two sweeps used different workloads or SLOs; ratios are not comparable"
        );
    }
    let row = |o: &mut String, name: &str, m: &Compared, fmt: &dyn Fn(Option<f64>) -> String| {
        let ratio = m.ratio.map_or("n/a".into(), |r| format!("{r:.2}×"));
        let _ = writeln!(
            o,
            "{name:<38} {:>16} {:>16} {:>8}",
            fmt(m.ours),
            fmt(m.peer),
            ratio
        );
    };
    let rate = |v: Option<f64>| v.map_or("none".into(), |v| format!("{v:.3}"));
    let tok = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.1}"));
    let _ = writeln!(o, "{:<38} {:>16} {:>16} {:>8}", "", c.ours, c.peer, "ratio");
    row(
        &mut o,
        "goodput frontier (req/s)",
        &c.goodput_frontier_rps,
        &rate,
    );
    for (name, sweep) in [(&c.ours, a), (&c.peer, b)] {
        if let Some(top) = sweep
            .frontier
            .as_ref()
            .filter(|_| sweep.frontier_is_lower_bound())
        {
            let _ = writeln!(
                o,
                "  {name} passed every rate up to {:.3} req/s: its frontier is a lower bound, \
and so is any ratio it is in",
                top.rate
            );
        }
    }
    if let (Some(r), Some(lo)) = (
        c.goodput_frontier_ratio_at_least,
        b.sorted_points().first().map(|p| p.rate),
    ) {
        let _ = writeln!(
            o,
            "  {} failed the SLO at its lowest rate ({lo:.3} req/s): frontier ratio > {r:.2}×",
            c.peer
        );
    }
    row(
        &mut o,
        "output tok/s at own frontier",
        &c.frontier_output_tokens_per_s,
        &tok,
    );
    match (&c.equal_load, equal_load_points(a, b)) {
        (Some(e), Some((pa, pb))) => {
            let _ = writeln!(o, "at equal offered load {:.3} req/s:", e.rate);
            // Lower latency is better, so the ratio shown is peer/ours (>1 = we are
            // faster); an infinite percentile (unfinished requests) prints as inf.
            let (sa, sb) = (&pa.summary, &pb.summary);
            for (name, m, la, lb) in [
                (
                    "  TTFT P99 (ms; ratio peer/ours)",
                    &e.ttft_p99_ms,
                    &sa.ttft,
                    &sb.ttft,
                ),
                (
                    "  TPOT P99 (ms; ratio peer/ours)",
                    &e.tpot_p99_ms,
                    &sa.tpot,
                    &sb.tpot,
                ),
            ] {
                let ratio = m.ratio.map_or("n/a".into(), |r| format!("{r:.2}×"));
                let _ = writeln!(
                    o,
                    "{name:<38} {:>16} {:>16} {:>8}",
                    ms(m.ours, la),
                    ms(m.peer, lb),
                    ratio
                );
            }
            row(&mut o, "  output tokens/s", &e.output_tokens_per_s, &tok);
            row(
                &mut o,
                "  mean output tok/completed request",
                &e.mean_output_tokens,
                &tok,
            );
        }
        _ => {
            let _ = writeln!(
                o,
                "no offered rate was measured in both sweeps; no equal-load comparison"
            );
        }
    }
    o
}

/// L (the server's gauges) against λW (the client's records), and the verdict.
fn little_line(l: &LittleCheck) -> String {
    let predicted = format!(
        "λW={:.3}/s×{:.3}s={:.3} (client)",
        l.arrival_rate, l.mean_time_in_system_s, l.predicted
    );
    match (l.server_in_system, l.relative_error) {
        (Some(server), Some(error)) => format!(
            "L={server:.3} (server running+waiting, {} samples) vs {predicted} → {} ({:.1}% apart, tolerance {:.0}% + {:.3} for sampling)",
            l.server_samples,
            if l.consistent == Some(true) {
                "consistent"
            } else {
                "INCONSISTENT: the server and the client disagree on the requests in flight"
            },
            error * 100.0,
            LITTLE_TOLERANCE * 100.0,
            l.sampling_allowance
        ),
        _ if l.server_samples == 0 => {
            format!("{predicted}; not checked: the server's /metrics has no running/waiting gauges")
        }
        _ => format!(
            "{predicted}; not checked: {} server samples in the run (fewer than {MIN_SERVER_SAMPLES})",
            l.server_samples
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::{DEFAULT_BUCKETS, Slo, summarize};
    use crate::sweep::SweepPoint;

    fn sweep(label: &str, points: &[(f64, bool, f64, Option<f64>)]) -> SweepResult {
        let mut r = SweepResult {
            label: label.into(),
            workload: "w".into(),
            arrivals: "a".into(),
            slo: Slo::default(),
            points: points
                .iter()
                .map(|&(rate, pass, goodput, ttft_p99)| {
                    let mut s =
                        summarize(&[], &[], 1.0, Some(rate), Slo::default(), DEFAULT_BUCKETS);
                    s.slo_pass = pass;
                    s.goodput_rps = goodput;
                    s.goodput_output_tokens_per_s = goodput * 80.0;
                    s.ttft.p99_ms = ttft_p99;
                    s.ttft.count = 1;
                    SweepPoint { rate, summary: s }
                })
                .collect(),
            frontier: None,
        };
        r.compute_frontier();
        r
    }

    #[test]
    fn capacity_note_is_yaml_with_the_frontier_goodput() {
        let r = sweep(
            "srv",
            &[
                (0.2, true, 0.19, Some(900.0)),
                (0.4, true, 0.38, Some(1500.0)),
                (0.8, false, 0.3, None),
            ],
        );
        // The fixture's goodput in tokens is 80 per request: 0.38 req/s is 30.4 tokens/s.
        for (unit, goodput) in [
            (DemandUnit::RequestsPerSecond, 0.38),
            (DemandUnit::OutputTokensPerSecond, 30.4),
        ] {
            let note = capacity_note(&r, unit);
            let v: serde_yaml::Value = serde_yaml::from_str(&note).unwrap();
            assert_eq!(
                v["capacity"]["replicaGoodput"].as_f64(),
                Some(goodput),
                "{note}"
            );
            // The unit reads back as the API's own value, so the operator sizes with it.
            let written: DemandUnit =
                serde_yaml::from_value(v["capacity"]["demandUnit"].clone()).unwrap();
            assert_eq!(written, unit, "{note}");
            assert!(note.contains("# SLO: TTFT P99 ≤ 2000 ms"), "{note}");
        }
        let none = capacity_note(
            &sweep("srv", &[(0.2, false, 0.0, None)]),
            DemandUnit::RequestsPerSecond,
        );
        assert!(none.starts_with("# no capacity.replicaGoodput"), "{none}");
    }

    #[test]
    fn compare_reports_ratios_at_equal_load_and_infinite_percentiles() {
        let ours = sweep(
            "ours",
            &[
                (0.2, true, 0.2, Some(500.0)),
                (0.4, true, 0.4, Some(800.0)),
                (0.8, true, 0.79, Some(1900.0)),
            ],
        );
        let peer = sweep(
            "peer",
            &[(0.2, true, 0.2, Some(1000.0)), (0.4, false, 0.1, None)],
        );
        let t = compare_table(&ours, &peer);
        assert!(t.contains("goodput frontier"), "{t}");
        // Frontier 0.79 vs 0.2 → 3.95×; equal load is 0.2 (the peer's last pass).
        assert!(t.contains("3.95×"), "{t}");
        assert!(t.contains("at equal offered load 0.200"), "{t}");
        assert!(t.contains("2.00×"), "TTFT P99 ratio peer/ours: {t}");
        // Ours never failed: its frontier is only the top of the ladder, and says so.
        assert!(
            t.contains("ours passed every rate up to 0.800 req/s"),
            "{t}"
        );
        assert!(!t.contains("peer passed every rate"), "{t}");
        assert!(ours.frontier_is_lower_bound() && !peer.frontier_is_lower_bound());
        assert!(sweep_table(&ours).contains("every rate passed: a lower bound"));
        assert!(!sweep_table(&peer).contains("lower bound"));
        let s = summary_table("x", &peer.points[1].summary);
        assert!(s.contains("inf"), "{s}");
        assert_eq!(compare(&ours, &peer).goodput_frontier_ratio_at_least, None);
        // A peer that fails its lowest rate has a frontier below it: a lower bound.
        let failing = sweep("peer", &[(0.2, false, 0.05, None)]);
        let c = compare(&ours, &failing);
        assert_eq!(c.goodput_frontier_rps.ratio, None);
        assert!((c.goodput_frontier_ratio_at_least.unwrap() - 0.79 / 0.2).abs() < 1e-12);
        assert!(compare_table(&ours, &failing).contains("frontier ratio > 3.95×"));
    }
}
