//! The Prometheus rules of the SLO: recording rules for the SLI and the burn rate of
//! each release over each window, and the multi-window, multi-burn-rate alerts.
//!
//! Every name and number comes from where the canary analysis takes it: the engine's
//! counters, labels and SLO-eligible outcomes from `slipway-contract` (through the
//! analysis's own [`eligible_outcomes`]), the burn-rate arithmetic and the tiers from
//! [`slipway_api::slo`], the per-service objective from the operator's
//! [`SLO_OBJECTIVE`] gauge. So the alerts page on the SLI the analysis rolls back on:
//!
//! ```text
//! SLI(w)  = Σ rate(slo_met[w]) / Σ rate(requests{outcome ∈ eligible}[w])   by (model, release)
//! burn(w) = (1 − SLI(w)) / (1 − objective(release))
//! alert   = burn(long) > B and burn(short) > B
//! ```
//!
//! The objective of a release is the `slo.availability` the operator reports for it;
//! a release no operator reports (engines run without one) falls back to
//! [`DEFAULT_AVAILABILITY`]. An SLI without eligible requests is NaN, which never
//! compares greater than a threshold: no evidence never pages.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;
use slipway_api::slo::{BURN_RATE_TIERS, BurnRateTier, DEFAULT_AVAILABILITY};
use slipway_contract::metrics::{
    MODEL_LABEL, OUTCOME_LABEL, Outcome, RELEASE_LABEL, REQUESTS, REQUESTS_SLO_MET, counter_total,
};
use slipway_operator::metrics::SLO_OBJECTIVE;
use slipway_operator::rollout::source::eligible_outcomes;

/// The rule group's name.
pub const GROUP: &str = "slipway-slo";
/// The recorded objective per release.
pub const OBJECTIVE: &str = "slipway:slo_objective:ratio";
/// The generated dashboard's uid. It lives here, beside the links that use it, so
/// the dashboard (which reads the rules' names) and the rules do not import each other.
pub const DASHBOARD_UID: &str = "slipway";
/// Where the alerts link: the generated dashboard, relative to the Grafana the team
/// runs.
fn dashboard_link(release: &str) -> String {
    format!("/d/{DASHBOARD_UID}/slipway?var-{RELEASE_LABEL}={release}")
}

/// A Prometheus rule file.
#[derive(Debug, Clone, Serialize)]
pub struct RuleFile {
    pub groups: Vec<RuleGroup>,
}

#[derive(Debug, Clone, Serialize)]
pub struct RuleGroup {
    pub name: String,
    pub rules: Vec<Rule>,
}

/// A recording rule or an alert.
#[derive(Debug, Clone, Serialize)]
#[serde(untagged)]
pub enum Rule {
    Record {
        record: String,
        expr: String,
    },
    Alert {
        alert: String,
        expr: String,
        labels: BTreeMap<String, String>,
        annotations: BTreeMap<String, String>,
    },
}

/// A window as Prometheus writes durations (`5m`, `1h`, `3d`): the largest unit that
/// divides it.
#[must_use]
pub fn prom_duration(window: Duration) -> String {
    let s = window.as_secs();
    match s {
        0 => "0s".to_owned(),
        _ if s.is_multiple_of(86_400) => format!("{}d", s / 86_400),
        _ if s.is_multiple_of(3_600) => format!("{}h", s / 3_600),
        _ if s.is_multiple_of(60) => format!("{}m", s / 60),
        _ => format!("{s}s"),
    }
}

/// The windows some tier reads, shortest first.
#[must_use]
pub fn windows() -> Vec<Duration> {
    let mut windows: Vec<Duration> = BURN_RATE_TIERS
        .iter()
        .flat_map(|t| [t.short_window, t.long_window])
        .collect();
    windows.sort();
    windows.dedup();
    windows
}

/// Rate of eligible requests by model and release over `window`.
#[must_use]
pub fn eligible_rate(window: Duration) -> String {
    format!("slipway:requests_eligible:rate{}", prom_duration(window))
}

/// Rate of SLO-met requests by model and release over `window`.
#[must_use]
pub fn slo_met_rate(window: Duration) -> String {
    format!("slipway:requests_slo_met:rate{}", prom_duration(window))
}

/// The SLI (SLO-met share of eligible requests) over `window`.
#[must_use]
pub fn sli(window: Duration) -> String {
    format!("slipway:slo_met:ratio_rate{}", prom_duration(window))
}

/// The error-budget burn rate over `window`.
#[must_use]
pub fn burn(window: Duration) -> String {
    format!("slipway:error_budget_burn:rate{}", prom_duration(window))
}

/// The alert of a tier.
#[must_use]
pub fn alert_name(tier: &BurnRateTier) -> String {
    format!("SlipwayErrorBudgetBurn{}", tier.name)
}

/// The `outcome` regex of the eligible outcomes, as the analysis's Prometheus source
/// writes it.
#[must_use]
pub fn eligible_regex() -> String {
    Outcome::regex(Outcome::is_slo_eligible)
}

/// The recording rules and alerts.
#[must_use]
pub fn rule_file() -> RuleFile {
    let by = format!("{MODEL_LABEL}, {RELEASE_LABEL}");
    let windows = windows();
    let mut rules = Vec::new();
    for &window in &windows {
        let w = prom_duration(window);
        rules.push(Rule::Record {
            record: eligible_rate(window),
            expr: format!(
                "sum by ({by}) (rate({}{{{OUTCOME_LABEL}=~\"{}\"}}[{w}]))",
                counter_total(REQUESTS),
                eligible_regex()
            ),
        });
        rules.push(Rule::Record {
            record: slo_met_rate(window),
            expr: format!(
                "sum by ({by}) (rate({}[{w}]))",
                counter_total(REQUESTS_SLO_MET)
            ),
        });
        // Good can run a scrape ahead of eligible; the analysis clamps the SLI too.
        rules.push(Rule::Record {
            record: sli(window),
            expr: format!(
                "clamp({} / {}, 0, 1)",
                slo_met_rate(window),
                eligible_rate(window)
            ),
        });
    }
    // Every release with requests in the longest window gets an objective, so every
    // SLI has a burn rate (also for a release whose engines are gone).
    let longest = windows.last().copied().unwrap_or(Duration::ZERO);
    rules.push(Rule::Record {
        record: OBJECTIVE.to_owned(),
        expr: format!(
            "max by ({RELEASE_LABEL}) ({SLO_OBJECTIVE}) or on ({RELEASE_LABEL}) (0 * max by ({RELEASE_LABEL}) ({}) + {DEFAULT_AVAILABILITY})",
            eligible_rate(longest)
        ),
    });
    for &window in &windows {
        // group_left keeps the SLI's labels (model); one objective per release.
        rules.push(Rule::Record {
            record: burn(window),
            expr: format!(
                "(1 - {}) / on ({RELEASE_LABEL}) group_left () (1 - {OBJECTIVE})",
                sli(window)
            ),
        });
    }
    for tier in BURN_RATE_TIERS {
        rules.push(Rule::Alert {
            alert: alert_name(&tier),
            expr: format!(
                "{long} > {b} and on ({RELEASE_LABEL}) {short} > {b}",
                long = burn(tier.long_window),
                short = burn(tier.short_window),
                b = tier.burn_rate
            ),
            labels: alert_labels(&tier),
            annotations: annotations(
                &tier,
                &format!("{{{{ $labels.{MODEL_LABEL} }}}}"),
                &format!("{{{{ $labels.{RELEASE_LABEL} }}}}"),
                "{{ $value | humanize }}",
            ),
        });
    }
    RuleFile {
        groups: vec![RuleGroup {
            name: GROUP.to_owned(),
            rules,
        }],
    }
}

/// The labels an alert of `tier` adds to the release's.
#[must_use]
pub fn alert_labels(tier: &BurnRateTier) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("severity".to_owned(), tier.severity.as_str().to_owned()),
        ("long_window".to_owned(), prom_duration(tier.long_window)),
    ])
}

/// The annotations of an alert of `tier`, for a model, release and long-window burn
/// rate: Prometheus templates in the rule, their expansions in the promtool tests.
#[must_use]
pub fn annotations(
    tier: &BurnRateTier,
    model: &str,
    release: &str,
    value: &str,
) -> BTreeMap<String, String> {
    let (long, short) = (
        prom_duration(tier.long_window),
        prom_duration(tier.short_window),
    );
    BTreeMap::from([
        (
            "summary".to_owned(),
            format!(
                "{model} release {release} is burning its error budget at {value}x over {long} (threshold {}x)",
                tier.burn_rate
            ),
        ),
        (
            "description".to_owned(),
            format!(
                "Of the requests to release {release} of {model} that the SLO counts (outcome {eligible}), too few met the TTFT and TPOT targets: the error budget burns at {value}x over {long} and still above {b}x over {short}. At {b}x, {spent}% of a 30-day budget goes every {long}. The canary analysis judges releases on the same burn rate; the InferenceService running {release} names it in status.stableRelease or status.canaryRelease.hash.",
                eligible = eligible_outcomes().collect::<Vec<_>>().join(", "),
                b = tier.burn_rate,
                spent = (tier.budget_spent() * 100.0).round()
            ),
        ),
        ("dashboard".to_owned(), dashboard_link(release)),
    ])
}

/// The rule file as YAML, with the header saying how it is made.
///
/// # Errors
/// Only if serialization fails, which would be a bug in the types.
pub fn rules_yaml() -> Result<String, serde_yaml::Error> {
    Ok(format!(
        "{}{}",
        crate::HEADER,
        serde_yaml::to_string(&rule_file())?
    ))
}

/// The same groups in a `monitoring.coreos.com/v1` PrometheusRule, for
/// prometheus-operator.
///
/// # Errors
/// As [`rules_yaml`].
pub fn prometheus_rule_yaml() -> Result<String, serde_yaml::Error> {
    #[derive(Serialize)]
    #[serde(rename_all = "camelCase")]
    struct PrometheusRule {
        api_version: &'static str,
        kind: &'static str,
        metadata: serde_json::Value,
        spec: RuleFile,
    }
    let object = PrometheusRule {
        api_version: "monitoring.coreos.com/v1",
        kind: "PrometheusRule",
        metadata: serde_json::json!({
            "name": GROUP,
            "labels": {
                "app.kubernetes.io/name": "slipway",
                "app.kubernetes.io/component": "monitoring",
            },
        }),
        spec: rule_file(),
    };
    Ok(format!(
        "{}{}",
        crate::HEADER,
        serde_yaml::to_string(&object)?
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_use_the_largest_unit() {
        assert_eq!(prom_duration(Duration::from_secs(300)), "5m");
        assert_eq!(prom_duration(Duration::from_secs(3600)), "1h");
        assert_eq!(prom_duration(Duration::from_secs(72 * 3600)), "3d");
        assert_eq!(prom_duration(Duration::from_secs(90)), "90s");
    }

    #[test]
    fn every_window_of_every_tier_is_recorded_once() {
        let names: Vec<String> = windows().into_iter().map(prom_duration).collect();
        assert_eq!(names, ["5m", "30m", "1h", "6h", "3d"]);
    }

    #[test]
    fn eligible_outcomes_are_the_analysis_ones() {
        // The analysis's Prometheus query filters the same outcomes.
        let (_, eligible) = slipway_operator::rollout::source::promql("r", Duration::from_secs(60));
        assert!(
            eligible.contains(&format!("{OUTCOME_LABEL}=~\"{}\"", eligible_regex())),
            "{eligible}"
        );
        assert_eq!(eligible_regex(), "ok|rejected_503|error");
    }

    #[test]
    fn alerts_need_both_windows_above_the_tier_rate() {
        let file = rule_file();
        let alerts: Vec<(&str, &str)> = file.groups[0]
            .rules
            .iter()
            .filter_map(|r| match r {
                Rule::Alert { alert, expr, .. } => Some((alert.as_str(), expr.as_str())),
                Rule::Record { .. } => None,
            })
            .collect();
        assert_eq!(
            alerts,
            [
                (
                    "SlipwayErrorBudgetBurnFast",
                    "slipway:error_budget_burn:rate1h > 14.4 and on (release) slipway:error_budget_burn:rate5m > 14.4"
                ),
                (
                    "SlipwayErrorBudgetBurnMedium",
                    "slipway:error_budget_burn:rate6h > 6 and on (release) slipway:error_budget_burn:rate30m > 6"
                ),
                (
                    "SlipwayErrorBudgetBurnSlow",
                    "slipway:error_budget_burn:rate3d > 1 and on (release) slipway:error_budget_burn:rate6h > 1"
                ),
            ]
        );
    }
}
