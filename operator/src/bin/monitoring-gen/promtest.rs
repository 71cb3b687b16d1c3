//! The `promtool test rules` file of the SLO rules, generated from the same tiers and
//! arithmetic as the rules, so each threshold is tested where it is.
//!
//! Per tier (burn rate B, long window L, short window S; 1000 eligible requests a
//! minute; series from 0 to L + S), one release per case:
//!
//! | release      | what it serves                                           | fires |
//! |--------------|----------------------------------------------------------|-------|
//! | `burning`    | 2B worth of slow (SLO-missing) requests throughout       | yes   |
//! | `over`       | 1.05B                                                    | yes   |
//! | `under`      | 0.95B                                                    | no    |
//! | `short_only` | healthy, then 3B for the last S + 2m (long window < B)   | no    |
//! | `long_only`  | 2B until L − S, 0.5B since (long window > B, short < B)  | at L − S, not at L + S |
//! | `excluded`   | healthy, plus as many 429s and cancellations (not eligible) | no |
//! | `lenient`    | 2B against 0.999, but its operator reports objective 0.99 | no   |
//! | `strict`     | 0.5B against 0.999, but its operator reports 0.9999 (5B) | yes   |
//! | `erroring`   | 2B as `error` outcomes                                   | yes   |
//! | `shedding`   | 2B as `rejected_503` outcomes                            | yes   |
//!
//! The alert tests list every release that must fire, at L − S and at L + S; promtool
//! fails on a missing alert and on an unexpected one, so "stays silent" is tested as
//! much as "fires". Expected values come from [`slipway_api::slo::burn_rate`].

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;
use slipway_api::slo::{
    BURN_RATE_TIERS, BurnRateTier, DEFAULT_AVAILABILITY, bad_share_at, burn_rate,
};
use slipway_contract::metrics::{
    MODEL_LABEL, OUTCOME_LABEL, Outcome, RELEASE_LABEL, REQUESTS, REQUESTS_SLO_MET, counter_total,
};
use slipway_operator::metrics::{INFERENCESERVICE_LABEL, NAMESPACE_LABEL, SLO_OBJECTIVE};

use crate::rules::{self, prom_duration};

/// Where the rules are, relative to the test file.
pub const RULES_FROM_TEST: &str = "../slo-rules.yaml";
/// Eligible requests per minute of every case.
const PER_MINUTE: f64 = 1000.0;
const MODEL: &str = "smol";

#[derive(Debug, Serialize)]
pub struct TestFile {
    rule_files: Vec<String>,
    evaluation_interval: String,
    tests: Vec<TestGroup>,
}

#[derive(Debug, Serialize)]
struct TestGroup {
    name: String,
    interval: String,
    input_series: Vec<InputSeries>,
    alert_rule_test: Vec<AlertTest>,
    promql_expr_test: Vec<ExprTest>,
}

#[derive(Debug, Serialize)]
struct InputSeries {
    series: String,
    values: String,
}

#[derive(Debug, Serialize)]
struct AlertTest {
    eval_time: String,
    alertname: String,
    exp_alerts: Vec<ExpAlert>,
}

#[derive(Debug, Serialize)]
struct ExpAlert {
    exp_labels: BTreeMap<String, String>,
    exp_annotations: BTreeMap<String, String>,
}

#[derive(Debug, Serialize)]
struct ExprTest {
    expr: String,
    eval_time: String,
    exp_samples: Vec<ExpSample>,
}

#[derive(Debug, Serialize)]
struct ExpSample {
    labels: String,
    value: f64,
}

/// How bad requests end.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Bad {
    /// Succeeded but missed TTFT or TPOT.
    Slow,
    Error,
    Shed,
}

/// Requests per minute of one phase, by how they end.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Mix {
    good: f64,
    slow: f64,
    error: f64,
    shed: f64,
    /// Not eligible: over the tenant's rate, or cancelled by the client.
    ineligible: f64,
}

impl Mix {
    /// [`PER_MINUTE`] eligible requests burning at `burn` against the default objective.
    fn burning(burn: f64, bad: Bad) -> Self {
        let n = PER_MINUTE * bad_share_at(burn, DEFAULT_AVAILABILITY);
        let mut mix = Self {
            good: PER_MINUTE - n,
            ..Self::default()
        };
        match bad {
            Bad::Slow => mix.slow = n,
            Bad::Error => mix.error = n,
            Bad::Shed => mix.shed = n,
        }
        mix
    }

    fn healthy() -> Self {
        Self::burning(0.0, Bad::Slow)
    }

    /// Requests per minute of an outcome of `slipway_requests_total`.
    fn outcome(&self, outcome: Outcome) -> f64 {
        match outcome {
            Outcome::Ok => self.good + self.slow,
            Outcome::Error => self.error,
            Outcome::Rejected503 => self.shed,
            Outcome::Rejected429 | Outcome::Cancelled => self.ineligible,
        }
    }
}

/// One release's phases (minutes, mix) and the objective its operator reports.
struct Case {
    release: &'static str,
    phases: Vec<(u64, Mix)>,
    objective: Option<f64>,
}

/// promtool's expanding notation of a counter growing at each phase's rate per
/// minute, from 0: one value per minute, `1 + Σ minutes` in all.
fn counter_values(phases: &[(u64, f64)]) -> String {
    let mut parts = Vec::new();
    let mut value = 0.0;
    for (i, &(minutes, rate)) in phases.iter().enumerate() {
        if i == 0 {
            parts.push(format!("0+{rate}x{minutes}"));
        } else if minutes > 0 {
            parts.push(format!("{}+{rate}x{}", value + rate, minutes - 1));
        }
        value += rate * minutes as f64;
    }
    parts.join(" ")
}

fn selector(name: &str, labels: &[(&str, &str)]) -> String {
    let body: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
    format!("{name}{{{}}}", body.join(","))
}

/// Go's `%.4g` for a value in [1, 1000): what Prometheus's `humanize` writes there.
fn humanize(value: f64) -> String {
    assert!(
        (1.0..1000.0).contains(&value),
        "humanize is emulated only in [1, 1000): {value}"
    );
    let integer_digits = value.log10().floor() as usize + 1;
    let text = format!("{value:.*}", 4usize.saturating_sub(integer_digits));
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        text
    }
}

fn minutes(m: u64) -> String {
    prom_duration(Duration::from_secs(m * 60))
}

fn cases(tier: &BurnRateTier) -> Vec<Case> {
    let (l, s) = (
        tier.long_window.as_secs() / 60,
        tier.short_window.as_secs() / 60,
    );
    let end = l + s;
    let b = tier.burn_rate;
    let whole = |mix: Mix| vec![(end, mix)];
    vec![
        Case {
            release: "burning",
            phases: whole(Mix::burning(2.0 * b, Bad::Slow)),
            objective: None,
        },
        Case {
            release: "over",
            phases: whole(Mix::burning(1.05 * b, Bad::Slow)),
            objective: None,
        },
        Case {
            release: "under",
            phases: whole(Mix::burning(0.95 * b, Bad::Slow)),
            objective: None,
        },
        Case {
            release: "short_only",
            phases: vec![
                (end - s - 2, Mix::healthy()),
                (s + 2, Mix::burning(3.0 * b, Bad::Slow)),
            ],
            objective: None,
        },
        Case {
            release: "long_only",
            // Recovered to 0.5B, not to 0: the short window's own threshold silences it.
            phases: vec![
                (l - s, Mix::burning(2.0 * b, Bad::Slow)),
                (2 * s, Mix::burning(0.5 * b, Bad::Slow)),
            ],
            objective: None,
        },
        Case {
            release: "excluded",
            phases: whole(Mix {
                ineligible: PER_MINUTE,
                ..Mix::healthy()
            }),
            objective: None,
        },
        Case {
            release: "lenient",
            phases: whole(Mix::burning(2.0 * b, Bad::Slow)),
            objective: Some(0.99),
        },
        Case {
            release: "strict",
            phases: whole(Mix::burning(0.5 * b, Bad::Slow)),
            objective: Some(0.9999),
        },
        Case {
            release: "erroring",
            phases: whole(Mix::burning(2.0 * b, Bad::Error)),
            objective: None,
        },
        Case {
            release: "shedding",
            phases: whole(Mix::burning(2.0 * b, Bad::Shed)),
            objective: None,
        },
    ]
}

fn input_series(case: &Case) -> Vec<InputSeries> {
    let mut series = Vec::new();
    for outcome in Outcome::ALL {
        let rates: Vec<(u64, f64)> = case
            .phases
            .iter()
            .map(|&(m, mix)| (m, mix.outcome(outcome)))
            .collect();
        series.push(InputSeries {
            series: selector(
                &counter_total(REQUESTS),
                &[
                    (MODEL_LABEL, MODEL),
                    (OUTCOME_LABEL, outcome.as_str()),
                    (RELEASE_LABEL, case.release),
                ],
            ),
            values: counter_values(&rates),
        });
    }
    let good: Vec<(u64, f64)> = case.phases.iter().map(|&(m, mix)| (m, mix.good)).collect();
    series.push(InputSeries {
        series: selector(
            &counter_total(REQUESTS_SLO_MET),
            &[(MODEL_LABEL, MODEL), (RELEASE_LABEL, case.release)],
        ),
        values: counter_values(&good),
    });
    if let Some(objective) = case.objective {
        let total: u64 = case.phases.iter().map(|(m, _)| m).sum();
        series.push(InputSeries {
            series: selector(
                SLO_OBJECTIVE,
                &[
                    (NAMESPACE_LABEL, "ns"),
                    (INFERENCESERVICE_LABEL, "svc"),
                    (RELEASE_LABEL, case.release),
                ],
            ),
            values: format!("{objective}+0x{total}"),
        });
    }
    series
}

/// The long-window burn rate of a case whose mix is the same throughout (what the
/// alert's `$value` is).
fn steady_burn(case: &Case) -> f64 {
    let mix = case.phases[0].1;
    let eligible = mix.good + mix.slow + mix.error + mix.shed;
    burn_rate(
        mix.good / eligible,
        case.objective.unwrap_or(DEFAULT_AVAILABILITY),
    )
}

fn expected(tier: &BurnRateTier, cases: &[Case], firing: &[&str]) -> Vec<ExpAlert> {
    firing
        .iter()
        .map(|release| {
            let case = cases
                .iter()
                .find(|c| c.release == *release)
                .unwrap_or_else(|| panic!("no case {release}"));
            let mut labels = rules::alert_labels(tier);
            labels.insert(MODEL_LABEL.to_owned(), MODEL.to_owned());
            labels.insert(RELEASE_LABEL.to_owned(), (*release).to_owned());
            ExpAlert {
                exp_labels: labels,
                exp_annotations: rules::annotations(
                    tier,
                    MODEL,
                    release,
                    &humanize(steady_burn(case)),
                ),
            }
        })
        .collect()
}

fn group(tier: &BurnRateTier) -> TestGroup {
    let (l, s) = (
        tier.long_window.as_secs() / 60,
        tier.short_window.as_secs() / 60,
    );
    let cases = cases(tier);
    let always = ["burning", "over", "strict", "erroring", "shedding"];
    let mut early: Vec<&str> = always.to_vec();
    early.push("long_only");
    let alertname = rules::alert_name(tier);
    let end = minutes(l + s);
    let burning = &cases[0];
    let recorded = |name: String, release: &str| {
        selector(&name, &[(MODEL_LABEL, MODEL), (RELEASE_LABEL, release)])
    };
    TestGroup {
        name: format!(
            "{alertname}: {}x over {} and {}",
            tier.burn_rate,
            prom_duration(tier.long_window),
            prom_duration(tier.short_window)
        ),
        interval: "1m".to_owned(),
        input_series: cases.iter().flat_map(input_series).collect(),
        alert_rule_test: vec![
            AlertTest {
                eval_time: minutes(l - s),
                alertname: alertname.clone(),
                exp_alerts: expected(tier, &cases, &early),
            },
            AlertTest {
                eval_time: end.clone(),
                alertname: alertname.clone(),
                exp_alerts: expected(tier, &cases, &always),
            },
        ],
        promql_expr_test: vec![
            // The recorded burn of a steady case is the analysis's burn rate (to 1 %).
            ExprTest {
                expr: format!(
                    "round(100 * {})",
                    recorded(rules::burn(tier.long_window), "burning")
                ),
                eval_time: end.clone(),
                exp_samples: vec![ExpSample {
                    labels: format!("{{{MODEL_LABEL}=\"{MODEL}\",{RELEASE_LABEL}=\"burning\"}}"),
                    value: (100.0 * steady_burn(burning)).round(),
                }],
            },
            // Ineligible outcomes do not lower the SLI.
            ExprTest {
                expr: recorded(rules::sli(tier.short_window), "excluded"),
                eval_time: end.clone(),
                exp_samples: vec![ExpSample {
                    labels: recorded(rules::sli(tier.short_window), "excluded"),
                    value: 1.0,
                }],
            },
            // The operator's objective where it reports one, the default elsewhere.
            ExprTest {
                expr: format!(
                    "{}{{{RELEASE_LABEL}=~\"strict|burning\"}}",
                    rules::OBJECTIVE
                ),
                eval_time: end,
                exp_samples: vec![
                    ExpSample {
                        labels: format!("{}{{{RELEASE_LABEL}=\"strict\"}}", rules::OBJECTIVE),
                        value: 0.9999,
                    },
                    ExpSample {
                        labels: format!("{}{{{RELEASE_LABEL}=\"burning\"}}", rules::OBJECTIVE),
                        value: DEFAULT_AVAILABILITY,
                    },
                ],
            },
        ],
    }
}

/// The whole test file.
#[must_use]
pub fn test_file() -> TestFile {
    TestFile {
        rule_files: vec![RULES_FROM_TEST.to_owned()],
        evaluation_interval: "1m".to_owned(),
        tests: BURN_RATE_TIERS.iter().map(group).collect(),
    }
}

/// The test file as YAML.
///
/// # Errors
/// Only if serialization fails.
pub fn test_yaml() -> Result<String, serde_yaml::Error> {
    Ok(format!(
        "{}{}",
        crate::HEADER,
        serde_yaml::to_string(&test_file())?
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_continue_across_phases() {
        assert_eq!(counter_values(&[(3, 10.0)]), "0+10x3");
        // 0 10 20 30 | 50 70: three minutes at 10, two at 20.
        assert_eq!(counter_values(&[(3, 10.0), (2, 20.0)]), "0+10x3 50+20x1");
    }

    #[test]
    fn humanize_matches_gos_four_significant_digits() {
        assert_eq!(humanize(28.8), "28.8");
        assert_eq!(humanize(72.000_000_000_1), "72");
        assert_eq!(humanize(15.119_999_999), "15.12");
        assert_eq!(humanize(1.05), "1.05");
        assert_eq!(humanize(123.456), "123.5");
    }

    #[test]
    fn every_case_spans_the_same_minutes() {
        for tier in BURN_RATE_TIERS {
            let span = (tier.long_window + tier.short_window).as_secs() / 60;
            for case in cases(&tier) {
                let total: u64 = case.phases.iter().map(|(m, _)| m).sum();
                assert_eq!(total, span, "{} {}", tier.name, case.release);
            }
        }
    }

    #[test]
    fn the_cases_sit_where_the_table_says() {
        let tier = slipway_api::slo::FAST_BURN;
        let cases = cases(&tier);
        let burn = |r: &str| steady_burn(cases.iter().find(|c| c.release == r).expect(r));
        assert!(burn("over") > tier.burn_rate && burn("under") < tier.burn_rate);
        assert!(burn("lenient") < tier.burn_rate, "{}", burn("lenient"));
        assert!((burn("strict") - 5.0 * tier.burn_rate).abs() < 1e-6);
    }
}
