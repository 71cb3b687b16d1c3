//! Judging a release on its error budget: pure math over the request counts of a
//! window, no I/O.
//!
//! - SLI over a window = Δgood / Δeligible, where eligible = ok + error + rejected_503
//!   (the server failed the user) and good = `slipway_requests_slo_met_total`
//!   (rejected_429 and cancelled requests are not eligible: the tenant or the client
//!   chose them).
//! - Burn rate = (1 − SLI) / (1 − objective), objective = `slo.availability`
//!   ([`slipway_api::slo`], shared with the generated Prometheus alerts). Burn 1
//!   spends the budget exactly over the SLO period; 14.4 spends a 30-day budget's 2 %
//!   in an hour.
//! - **Abort** when the short window burns above `shortBurnRateThreshold` *and* the
//!   long window above `longBurnRateThreshold` (multi-window burn-rate alerting, SRE
//!   workbook ch. 5: 14.4 over 1 h confirmed by 5 m; the CRD's defaults scale the
//!   windows to a rollout step: 14.4 over 1 m and 5 m).
//! - Also **abort** when the canary is significantly worse than stable at equal load:
//!   a one-sided two-proportion z-test on the long window's bad-request share,
//!   z > [`Z_CRITICAL`] (p < 0.001), only when both releases carry at least
//!   `minRequests`, the canary's long-window burn exceeds 1 (it actually eats budget),
//!   and per-group load is within [`EQUAL_LOAD_RATIO`] of each other (a canary that
//!   gets twice the load per group is not comparable).
//! - A window with fewer than `minRequests` eligible requests is **inconclusive**,
//!   never good; so is a source that could not be read.

use serde::{Deserialize, Serialize};

/// One-sided critical value of the canary-vs-stable z-test (p < 0.001).
pub const Z_CRITICAL: f64 = 3.09;
/// Per-group request rates within this factor of each other count as equal load.
pub const EQUAL_LOAD_RATIO: f64 = 2.0;

/// Counter increases of one release over one window.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WindowCounts {
    /// Requests that met the SLO.
    #[serde(default)]
    pub good: f64,
    /// Requests eligible for the SLI (ok + error + rejected_503).
    #[serde(default)]
    pub eligible: f64,
    /// The source saw only part of the window (it started inside it, e.g. after an
    /// operator restart with the `Scrape` source); the counts are a lower bound.
    #[serde(default)]
    pub partial: bool,
}

impl WindowCounts {
    /// Good over eligible; `None` without eligible requests.
    pub fn sli(&self) -> Option<f64> {
        (self.eligible > 0.0).then(|| (self.good / self.eligible).clamp(0.0, 1.0))
    }

    /// Requests that were not good.
    pub fn bad(&self) -> f64 {
        (self.eligible - self.good).max(0.0)
    }
}

/// One release's counts over the short and the long window.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReleaseWindows {
    pub short: WindowCounts,
    pub long: WindowCounts,
}

/// What the metrics source returned for one analysis, as plain data.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MetricsReading {
    /// Short hash of the canary release these counts are for.
    #[serde(default)]
    pub canary_release: String,
    #[serde(default)]
    pub canary: Option<ReleaseWindows>,
    #[serde(default)]
    pub stable: Option<ReleaseWindows>,
    /// The source could not be read; the sentence says why.
    #[serde(default)]
    pub error: Option<String>,
}

/// The analysis settings, parsed.
#[derive(Debug, Clone, PartialEq)]
pub struct Thresholds {
    pub objective: f64,
    pub short_window: String,
    pub long_window: String,
    pub short_burn: f64,
    pub long_burn: f64,
    pub min_requests: f64,
}

/// The outcome of one analysis.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Enough evidence, within budget.
    Good { short_burn: f64, long_burn: f64 },
    /// Roll back.
    Abort {
        reason: String,
        short_burn: f64,
        long_burn: f64,
    },
    /// Not enough evidence (or none could be read).
    Inconclusive { reason: String },
    /// Within budget so far, but a window is only partly seen.
    Warmup { reason: String },
}

/// Error-budget burn rate of a window: (1 − SLI) / (1 − objective); 0 without
/// requests (no evidence is handled as inconclusive before this is used).
/// The arithmetic is [`slipway_api::slo::burn_rate`], which the generated Prometheus
/// alerts (`manifests/monitoring/`) share.
pub fn burn_rate(counts: &WindowCounts, objective: f64) -> f64 {
    counts
        .sli()
        .map_or(0.0, |sli| slipway_api::slo::burn_rate(sli, objective))
}

/// One-sided two-proportion z statistic for "the canary's bad share is higher than
/// stable's". `None` when either side is empty or the pooled share is 0 or 1 (no
/// variance: nothing to test).
pub fn worse_z(canary: &WindowCounts, stable: &WindowCounts) -> Option<f64> {
    let (n1, n2) = (canary.eligible, stable.eligible);
    if n1 <= 0.0 || n2 <= 0.0 {
        return None;
    }
    let (p1, p2) = (canary.bad() / n1, stable.bad() / n2);
    let pooled = (canary.bad() + stable.bad()) / (n1 + n2);
    let variance = pooled * (1.0 - pooled) * (1.0 / n1 + 1.0 / n2);
    (variance > 0.0).then(|| (p1 - p2) / variance.sqrt())
}

/// Judges the canary (with stable as the comparison) for one analysis interval.
/// `canary_groups`/`stable_groups` are the ready groups of each release, for the
/// equal-load check.
pub fn judge(
    t: &Thresholds,
    reading: &MetricsReading,
    canary_groups: u32,
    stable_groups: u32,
) -> Verdict {
    if let Some(error) = &reading.error {
        return Verdict::Inconclusive {
            reason: format!("metrics source unreachable: {error}"),
        };
    }
    let Some(canary) = reading.canary else {
        return Verdict::Inconclusive {
            reason: "no samples of the canary yet".to_owned(),
        };
    };
    for (name, window) in [
        (&t.short_window, canary.short),
        (&t.long_window, canary.long),
    ] {
        if window.eligible < t.min_requests {
            return Verdict::Inconclusive {
                reason: format!(
                    "waiting for {} requests in the {name} window (have {})",
                    t.min_requests, window.eligible as u64
                ),
            };
        }
    }
    let short_burn = burn_rate(&canary.short, t.objective);
    let long_burn = burn_rate(&canary.long, t.objective);
    if short_burn > t.short_burn && long_burn > t.long_burn {
        return Verdict::Abort {
            reason: format!(
                "error budget burning {short_burn:.1}x over {} and {long_burn:.1}x over {} (thresholds {} and {})",
                t.short_window, t.long_window, t.short_burn, t.long_burn
            ),
            short_burn,
            long_burn,
        };
    }
    if let Some(stable) = reading.stable
        && stable.long.eligible >= t.min_requests
        && long_burn > 1.0
        && equal_load(&canary.long, canary_groups, &stable.long, stable_groups)
        && let Some(z) = worse_z(&canary.long, &stable.long)
        && z > Z_CRITICAL
    {
        return Verdict::Abort {
            reason: format!(
                "canary significantly worse than stable at equal load over {}: {:.2}% bad vs {:.2}% (z = {z:.1} > {Z_CRITICAL})",
                t.long_window,
                100.0 * canary.long.bad() / canary.long.eligible,
                100.0 * stable.long.bad() / stable.long.eligible
            ),
            short_burn,
            long_burn,
        };
    }
    if canary.short.partial || canary.long.partial {
        return Verdict::Warmup {
            reason: format!(
                "the {} window is not yet full (the metrics source started inside it)",
                if canary.long.partial {
                    &t.long_window
                } else {
                    &t.short_window
                }
            ),
        };
    }
    Verdict::Good {
        short_burn,
        long_burn,
    }
}

/// Per-group request rates within [`EQUAL_LOAD_RATIO`].
fn equal_load(
    canary: &WindowCounts,
    canary_groups: u32,
    stable: &WindowCounts,
    stable_groups: u32,
) -> bool {
    if canary_groups == 0 || stable_groups == 0 {
        return false;
    }
    let c = canary.eligible / f64::from(canary_groups);
    let s = stable.eligible / f64::from(stable_groups);
    c > 0.0 && s > 0.0 && c / s <= EQUAL_LOAD_RATIO && s / c <= EQUAL_LOAD_RATIO
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn t() -> Thresholds {
        Thresholds {
            objective: 0.99,
            short_window: "1m".to_owned(),
            long_window: "5m".to_owned(),
            short_burn: 14.4,
            long_burn: 6.0,
            min_requests: 100.0,
        }
    }

    fn w(good: f64, eligible: f64) -> WindowCounts {
        WindowCounts {
            good,
            eligible,
            partial: false,
        }
    }

    fn reading(canary: ReleaseWindows, stable: Option<ReleaseWindows>) -> MetricsReading {
        MetricsReading {
            canary_release: "c".to_owned(),
            canary: Some(canary),
            stable,
            error: None,
        }
    }

    proptest! {
        #[test]
        fn burn_is_never_negative(good in 0.0f64..1e6, eligible in 0.0f64..1e6, objective in 0.5f64..0.99999) {
            prop_assert!(burn_rate(&w(good, eligible), objective) >= 0.0);
        }

        #[test]
        fn perfect_sli_burns_nothing(eligible in 1.0f64..1e6, objective in 0.5f64..0.99999) {
            prop_assert_eq!(burn_rate(&w(eligible, eligible), objective), 0.0);
        }

        #[test]
        fn burn_grows_with_bad_requests(eligible in 1u32..100_000, bad in 0u32..100_000, more in 1u32..1000, objective in 0.5f64..0.99999) {
            let bad = bad.min(eligible);
            let more_bad = (bad + more).min(eligible);
            let e = f64::from(eligible);
            let fewer = burn_rate(&w(e - f64::from(bad), e), objective);
            let worse = burn_rate(&w(e - f64::from(more_bad), e), objective);
            prop_assert!(worse >= fewer, "{worse} < {fewer}");
        }
    }

    #[test]
    fn burn_matches_the_definition() {
        // SLI 0.9 against 0.99: ten times the budget.
        let burn = burn_rate(&w(900.0, 1000.0), 0.99);
        assert!((burn - 10.0).abs() < 1e-9, "{burn}");
    }

    #[test]
    fn both_windows_must_burn_to_abort() {
        let bad_short = w(700.0, 1000.0); // burn 30
        let ok_long = w(4900.0, 5000.0); // burn 2
        let verdict = judge(
            &t(),
            &reading(
                ReleaseWindows {
                    short: bad_short,
                    long: ok_long,
                },
                None,
            ),
            1,
            3,
        );
        assert!(matches!(verdict, Verdict::Good { .. }), "{verdict:?}");
        let bad_long = w(3500.0, 5000.0); // burn 30
        let verdict = judge(
            &t(),
            &reading(
                ReleaseWindows {
                    short: bad_short,
                    long: bad_long,
                },
                None,
            ),
            1,
            3,
        );
        let Verdict::Abort {
            short_burn,
            long_burn,
            ..
        } = verdict
        else {
            panic!("{verdict:?}")
        };
        assert!((short_burn - 30.0).abs() < 1e-9 && (long_burn - 30.0).abs() < 1e-9);
    }

    #[test]
    fn too_few_requests_is_inconclusive_even_when_all_good() {
        let canary = ReleaseWindows {
            short: w(37.0, 37.0),
            long: w(500.0, 500.0),
        };
        let verdict = judge(&t(), &reading(canary, None), 1, 3);
        assert_eq!(
            verdict,
            Verdict::Inconclusive {
                reason: "waiting for 100 requests in the 1m window (have 37)".to_owned()
            }
        );
    }

    #[test]
    fn an_unreachable_source_is_inconclusive() {
        let verdict = judge(
            &t(),
            &MetricsReading {
                error: Some("connection refused".to_owned()),
                ..MetricsReading::default()
            },
            1,
            3,
        );
        assert!(
            matches!(verdict, Verdict::Inconclusive { reason } if reason.contains("unreachable"))
        );
    }

    #[test]
    fn canary_worse_than_stable_at_equal_load_aborts() {
        // Canary 5 % bad (burn 5, under both thresholds), stable 0.5 % bad.
        let canary = ReleaseWindows {
            short: w(950.0, 1000.0),
            long: w(4750.0, 5000.0),
        };
        let stable = ReleaseWindows {
            short: w(2985.0, 3000.0),
            long: w(14925.0, 15000.0),
        };
        let verdict = judge(&t(), &reading(canary, Some(stable)), 1, 3);
        assert!(
            matches!(&verdict, Verdict::Abort { reason, .. } if reason.contains("significantly worse")),
            "{verdict:?}"
        );
        // The same counts at unequal load (canary gets 3x the per-group traffic) are not compared.
        let verdict = judge(&t(), &reading(canary, Some(stable)), 1, 9);
        assert!(matches!(verdict, Verdict::Good { .. }), "{verdict:?}");
    }

    #[test]
    fn a_partial_window_is_warmup_not_good() {
        let mut long = w(5000.0, 5000.0);
        long.partial = true;
        let verdict = judge(
            &t(),
            &reading(
                ReleaseWindows {
                    short: w(1000.0, 1000.0),
                    long,
                },
                None,
            ),
            1,
            3,
        );
        assert!(matches!(verdict, Verdict::Warmup { .. }), "{verdict:?}");
    }

    #[test]
    fn z_test_is_undefined_without_variance() {
        assert_eq!(worse_z(&w(10.0, 10.0), &w(10.0, 10.0)), None);
        assert_eq!(worse_z(&w(0.0, 0.0), &w(10.0, 10.0)), None);
        let z = worse_z(&w(900.0, 1000.0), &w(990.0, 1000.0)).unwrap_or(0.0);
        assert!(z > 8.0, "{z}");
    }
}
