//! Human-readable reports: the run summary, the sweep table, the capacity note, and
//! the side-by-side comparison of two servers. Pure string building.

use std::fmt::Write as _;

use crate::stats::{Latency, Summary};
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
    let l = &s.little;
    let _ = writeln!(
        o,
        "Little's law: L={:.3} vs λW={:.3}×{:.3}s={:.3} → {}",
        l.mean_in_flight,
        l.arrival_rate,
        l.mean_time_in_system_s,
        l.predicted,
        if l.consistent {
            "consistent"
        } else {
            "INCONSISTENT bookkeeping"
        }
    );
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
                "frontier: {:.3} req/s offered, SLO-goodput {:.3} req/s",
                f.rate, f.goodput_rps
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

/// The capacity note to paste into an `InferenceService`, with what it was measured under.
#[must_use]
pub fn capacity_note(r: &SweepResult) -> String {
    match &r.frontier {
        Some(f) => format!(
            "# measured by slipway-bench against {}\n# workload: {}\n# arrivals: {}\n# SLO: {}\n\
             # frontier {:.3} req/s offered; in tokens: replicaGoodput {:.1} with demandUnit OutputTokensPerSecond\n\
             capacity:\n  replicaGoodput: {:.3}\n  demandUnit: RequestsPerSecond\n",
            r.label,
            r.workload,
            r.arrivals,
            r.slo.describe(),
            f.rate,
            f.goodput_output_tokens_per_s,
            f.goodput_rps,
        ),
        None => format!(
            "# no capacity.replicaGoodput: {} failed the SLO ({}) at every rate tried\n",
            r.label,
            r.slo.describe()
        ),
    }
}

fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}×", a / b),
        _ => "n/a".into(),
    }
}

/// Side-by-side comparison of `a` (ours) against `b` (the peer), with ratios a/b.
///
/// "Equal offered load" is the highest rate both sweeps measured at which the peer
/// still passed (or, if it never passed, the lowest common rate).
#[must_use]
pub fn compare_table(a: &SweepResult, b: &SweepResult) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "== {} vs {} ==", a.label, b.label);
    let _ = writeln!(o, "workload: {}; SLO: {}", a.workload, a.slo.describe());
    if a.workload != b.workload || a.slo != b.slo {
        let _ = writeln!(
            o,
            "WARNING: the two sweeps used different workloads or SLOs; ratios are not comparable"
        );
    }
    let fa = a.frontier.as_ref().map(|f| f.goodput_rps);
    let fb = b.frontier.as_ref().map(|f| f.goodput_rps);
    let show = |v: Option<f64>| v.map_or("none".into(), |v| format!("{v:.3}"));
    let _ = writeln!(
        o,
        "{:<34} {:>14} {:>14} {:>8}",
        "", a.label, b.label, "ratio"
    );
    let _ = writeln!(
        o,
        "{:<34} {:>14} {:>14} {:>8}",
        "goodput frontier (req/s)",
        show(fa),
        show(fb),
        ratio(fa, fb)
    );
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
    let at = common
        .iter()
        .rev()
        .find(|(_, pb)| pb.summary.slo_pass)
        .or_else(|| common.first());
    if let Some((pa, pb)) = at {
        let (sa, sb) = (&pa.summary, &pb.summary);
        let _ = writeln!(o, "at equal offered load {:.3} req/s:", pa.rate);
        // Lower latency is better, so the ratio shown is peer/ours (>1 = we are faster).
        let _ = writeln!(
            o,
            "{:<34} {:>14} {:>14} {:>8}",
            "  TTFT P99 (ms; ratio peer/ours)",
            ms(sa.ttft.p99_ms, &sa.ttft),
            ms(sb.ttft.p99_ms, &sb.ttft),
            ratio(sb.ttft.p99_ms, sa.ttft.p99_ms)
        );
        let _ = writeln!(
            o,
            "{:<34} {:>14} {:>14} {:>8}",
            "  TPOT P99 (ms; ratio peer/ours)",
            ms(sa.tpot.p99_ms, &sa.tpot),
            ms(sb.tpot.p99_ms, &sb.tpot),
            ratio(sb.tpot.p99_ms, sa.tpot.p99_ms)
        );
        let _ = writeln!(
            o,
            "{:<34} {:>14.1} {:>14.1} {:>8}",
            "  output tokens/s",
            sa.output_tokens_per_s,
            sb.output_tokens_per_s,
            ratio(Some(sa.output_tokens_per_s), Some(sb.output_tokens_per_s))
        );
    } else {
        let _ = writeln!(
            o,
            "no offered rate was measured in both sweeps; no equal-load comparison"
        );
    }
    o
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
        let note = capacity_note(&r);
        let v: serde_yaml::Value = serde_yaml::from_str(&note).unwrap();
        assert_eq!(v["capacity"]["replicaGoodput"].as_f64(), Some(0.38));
        assert_eq!(
            v["capacity"]["demandUnit"].as_str(),
            Some("RequestsPerSecond")
        );
        assert!(note.contains("# SLO: TTFT P99 ≤ 2000 ms"), "{note}");
        let none = capacity_note(&sweep("srv", &[(0.2, false, 0.0, None)]));
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
        let s = summary_table("x", &peer.points[1].summary);
        assert!(s.contains("inf"), "{s}");
    }
}
