//! The offered-rate sweep and the goodput frontier, as pure decisions.
//!
//! A sweep walks a ladder of offered rates upward until a rate fails the SLO, then
//! bisects between the last passing and the first failing rate a few times. The
//! frontier is the highest passing rate below the lowest failing one; a pass *above* a
//! failure (noise) never raises it, because capacity planning must not rest on luck.
//! The SLO-goodput measured at the frontier is `capacity.replicaGoodput`.

use serde::{Deserialize, Serialize};

use crate::stats::{Slo, Summary};

/// The rates a sweep may try.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SweepPlan {
    /// Ladder of offered rates (requests/s), ascending.
    pub rates: Vec<f64>,
    /// Bisection steps between the last pass and the first failure.
    pub refine: u32,
}

/// A geometric ladder from `start` to `max` (inclusive if hit), multiplying by `factor`.
#[must_use]
pub fn geometric_ladder(start: f64, max: f64, factor: f64) -> Vec<f64> {
    let mut out = Vec::new();
    if !(start > 0.0 && factor > 1.0 && max.is_finite()) {
        return out;
    }
    let mut r = start;
    while r <= max * (1.0 + 1e-9) {
        // Round to 4 significant decimals so rates print and compare cleanly.
        out.push((r * 1e4).round() / 1e4);
        r *= factor;
    }
    out
}

fn bounds(done: &[(f64, bool)]) -> (Option<f64>, Option<f64>) {
    let first_fail = done
        .iter()
        .filter(|(_, ok)| !ok)
        .map(|(r, _)| *r)
        .reduce(f64::min);
    let best_pass = done
        .iter()
        .filter(|(r, ok)| *ok && first_fail.is_none_or(|f| *r < f))
        .map(|(r, _)| *r)
        .reduce(f64::max);
    (best_pass, first_fail)
}

/// The next rate to try given `(rate, passed)` results so far, or `None` when done.
#[must_use]
pub fn next_rate(plan: &SweepPlan, done: &[(f64, bool)]) -> Option<f64> {
    let tried = |r: f64| done.iter().any(|(d, _)| (d - r).abs() < 1e-9);
    let (pass, fail) = bounds(done);
    match fail {
        None => plan.rates.iter().copied().find(|&r| !tried(r)),
        Some(hi) => {
            let lo = pass?;
            let refinements = done
                .iter()
                .filter(|(r, _)| !plan.rates.iter().any(|p| (p - r).abs() < 1e-9))
                .count();
            // Rounded like the ladder, so it prints (and names its directory) cleanly.
            let mid = ((lo + hi) / 2.0 * 1e4).round() / 1e4;
            (refinements < plan.refine as usize && !tried(mid)).then_some(mid)
        }
    }
}

/// The frontier: the highest passing rate below the lowest failing one.
#[must_use]
pub fn frontier_rate(done: &[(f64, bool)]) -> Option<f64> {
    bounds(done).0
}

/// One measured point of a sweep.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SweepPoint {
    /// Offered rate, requests/s.
    pub rate: f64,
    /// What was measured there.
    pub summary: Summary,
}

/// A finished sweep, as written to `sweep.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SweepResult {
    /// Which server (free text, e.g. `llama-server -np 8`).
    pub label: String,
    /// The workload, described.
    pub workload: String,
    /// The arrival process, described.
    pub arrivals: String,
    /// The SLO every point was judged against.
    pub slo: Slo,
    /// Points in the order they were run.
    pub points: Vec<SweepPoint>,
    /// The frontier, if any rate passed.
    pub frontier: Option<Frontier>,
}

/// The goodput frontier.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Frontier {
    /// Highest passing offered rate, requests/s.
    pub rate: f64,
    /// SLO-goodput measured there, requests/s: the `capacity.replicaGoodput` value.
    pub goodput_rps: f64,
    /// Output tokens/s there.
    pub output_tokens_per_s: f64,
    /// Output tokens/s of SLO-meeting requests there (goodput in tokens).
    pub goodput_output_tokens_per_s: f64,
}

impl SweepResult {
    /// Whether every rate tried passed the SLO: the frontier is then only the highest
    /// rate offered, a lower bound of the real one.
    #[must_use]
    pub fn frontier_is_lower_bound(&self) -> bool {
        self.frontier.is_some() && self.points.iter().all(|p| p.summary.slo_pass)
    }

    /// Fills `frontier` from the points.
    pub fn compute_frontier(&mut self) {
        let done: Vec<(f64, bool)> = self
            .points
            .iter()
            .map(|p| (p.rate, p.summary.slo_pass))
            .collect();
        self.frontier = frontier_rate(&done).and_then(|r| {
            self.points
                .iter()
                .find(|p| (p.rate - r).abs() < 1e-9)
                .map(|p| Frontier {
                    rate: r,
                    goodput_rps: p.summary.goodput_rps,
                    output_tokens_per_s: p.summary.output_tokens_per_s,
                    goodput_output_tokens_per_s: p.summary.goodput_output_tokens_per_s,
                })
        });
    }

    /// Points sorted by rate (for tables and plots).
    #[must_use]
    pub fn sorted_points(&self) -> Vec<&SweepPoint> {
        let mut v: Vec<&SweepPoint> = self.points.iter().collect();
        v.sort_by(|a, b| a.rate.total_cmp(&b.rate));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(plan: &SweepPlan, capacity: f64) -> Vec<(f64, bool)> {
        let mut done = Vec::new();
        while let Some(r) = next_rate(plan, &done) {
            done.push((r, r <= capacity));
            assert!(done.len() < 100, "sweep must terminate");
        }
        done
    }

    #[test]
    fn ladder_stops_at_first_failure_then_bisects() {
        let plan = SweepPlan {
            rates: vec![1.0, 2.0, 4.0, 8.0],
            refine: 2,
        };
        let done = run(&plan, 3.0);
        assert_eq!(
            done,
            vec![
                (1.0, true),
                (2.0, true),
                (4.0, false),
                (3.0, true),
                (3.5, false)
            ]
        );
        assert_eq!(frontier_rate(&done), Some(3.0));
    }

    #[test]
    fn bisection_rates_are_rounded() {
        let plan = SweepPlan {
            rates: vec![0.1, 0.2],
            refine: 1,
        };
        let done = run(&plan, 0.12);
        assert_eq!(done, vec![(0.1, true), (0.2, false), (0.15, false)]);
    }

    #[test]
    fn all_pass_gives_the_top_rate_and_first_fail_gives_none() {
        let plan = SweepPlan {
            rates: vec![1.0, 2.0],
            refine: 3,
        };
        assert_eq!(frontier_rate(&run(&plan, 10.0)), Some(2.0));
        let done = run(&plan, 0.5);
        assert_eq!(done, vec![(1.0, false)]);
        assert_eq!(frontier_rate(&done), None);
    }

    #[test]
    fn a_lucky_pass_above_a_failure_does_not_raise_the_frontier() {
        let done = [(1.0, true), (2.0, false), (3.0, true)];
        assert_eq!(frontier_rate(&done), Some(1.0));
    }

    #[test]
    fn geometric_ladder_is_ascending_and_bounded() {
        assert_eq!(geometric_ladder(0.1, 0.8, 2.0), vec![0.1, 0.2, 0.4, 0.8]);
        assert!(geometric_ladder(0.0, 1.0, 2.0).is_empty());
        assert!(geometric_ladder(1.0, 2.0, 1.0).is_empty());
    }
}
