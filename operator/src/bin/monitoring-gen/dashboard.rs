//! The Grafana dashboard (`manifests/monitoring/dashboard.json`): the SLO per release
//! (TTFT and TPOT percentiles, SLO-met share, burn rates, outcomes), the engines'
//! queue, running requests, KV use and prefix hits, and the operator's view (canary
//! weight, rollbacks, groups desired, ready and serving).
//!
//! Every metric name is a constant: the engine's contract (`slipway-contract`), the
//! operator's [`slipway_operator::metrics`] and the recording rules of [`crate::rules`].
//!
//! Template variables: `datasource`, `release` (the engines' `release` label),
//! `namespace` and `inferenceservice` (the operator's per-service labels). The e2e
//! test runs every target's PromQL against a real Prometheus, with `$release`,
//! `$namespace` and `$inferenceservice` as `.*` and `$__rate_interval`/`$__range` as
//! windows.

use serde_json::{Value, json};
use slipway_api::slo::BURN_RATE_TIERS;
use slipway_contract::metrics::{OUTCOME_LABEL, RELEASE_LABEL, REQUESTS, counter_total};
use slipway_operator::metrics::{
    CANARY_WEIGHT, GROUPS_DESIRED, GROUPS_READY, GROUPS_SERVING, INFERENCESERVICE_LABEL,
    NAMESPACE_LABEL, ROLLBACKS,
};

use crate::rules;

/// A query of a panel and its legend.
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    pub expr: String,
    pub legend: String,
}

/// A panel: what it shows and how.
#[derive(Debug, Clone, PartialEq)]
pub struct Panel {
    pub title: &'static str,
    pub description: String,
    /// Grafana unit (`s`, `percentunit`, `reqps`, `short`, `percent`).
    pub unit: &'static str,
    /// `timeseries` or `stat`.
    pub kind: &'static str,
    pub targets: Vec<Target>,
}

/// A titled row of panels.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub title: &'static str,
    pub panels: Vec<Panel>,
}

fn target(expr: String, legend: &str) -> Target {
    Target {
        expr,
        legend: legend.to_owned(),
    }
}

/// `{release=~"$release"}`.
fn by_release() -> String {
    format!("{{{RELEASE_LABEL}=~\"${RELEASE_LABEL}\"}}")
}

/// `{namespace=~"$namespace",inferenceservice=~"$inferenceservice"}`.
fn by_service() -> String {
    format!(
        "{{{NAMESPACE_LABEL}=~\"${NAMESPACE_LABEL}\",{INFERENCESERVICE_LABEL}=~\"${INFERENCESERVICE_LABEL}\"}}"
    )
}

fn quantiles(histogram: &str) -> Vec<Target> {
    [("P50", 0.5), ("P99", 0.99)]
        .into_iter()
        .map(|(name, q)| {
            target(
                format!(
                    "histogram_quantile({q}, sum by ({RELEASE_LABEL}, le) (rate({histogram}_bucket{}[$__rate_interval])))",
                    by_release()
                ),
                &format!("{{{{{RELEASE_LABEL}}}}} {name}"),
            )
        })
        .collect()
}

fn rate_by_release(counter_family: &str) -> String {
    format!(
        "sum by ({RELEASE_LABEL}) (rate({}{}[$__rate_interval]))",
        counter_total(counter_family),
        by_release()
    )
}

/// Every row and panel, in order.
#[must_use]
pub fn rows() -> Vec<Row> {
    use slipway_contract::metrics::{
        INTER_TOKEN, KV_USAGE, PREFIX_HITS, PREFIX_QUERIES, RUNNING, TTFT, WAITING,
    };
    let release_legend = format!("{{{{{RELEASE_LABEL}}}}}");
    let service_legend = format!("{{{{{NAMESPACE_LABEL}}}}}/{{{{{INFERENCESERVICE_LABEL}}}}}");
    let windows = rules::windows();
    let sli_windows = [
        BURN_RATE_TIERS[0].short_window,
        BURN_RATE_TIERS[0].long_window,
    ];
    vec![
        Row {
            title: "SLO per release",
            panels: vec![
                Panel {
                    title: "TTFT P50 / P99",
                    description: "Time to first token: request arrival to its first generated token, per release.".to_owned(),
                    unit: "s",
                    kind: "timeseries",
                    targets: quantiles(TTFT),
                },
                Panel {
                    title: "TPOT P50 / P99",
                    description: "Time per output token after the first, per release: the engine's inter-token latency (each gap between consecutive tokens is one observation).".to_owned(),
                    unit: "s",
                    kind: "timeseries",
                    targets: quantiles(INTER_TOKEN),
                },
                Panel {
                    title: "SLO-met ratio",
                    description: "Share of eligible requests (ok, error, rejected_503) that met the TTFT and TPOT targets: the SLI the canary analysis and the alerts judge.".to_owned(),
                    unit: "percentunit",
                    kind: "timeseries",
                    targets: sli_windows
                        .iter()
                        .map(|&w| {
                            target(
                                format!("{}{}", rules::sli(w), by_release()),
                                &format!("{release_legend} {}", rules::prom_duration(w)),
                            )
                        })
                        .collect(),
                },
                Panel {
                    title: "Error-budget burn rate",
                    description: format!(
                        "(1 − SLI) / (1 − objective) over each alert window. Alerts: {}.",
                        BURN_RATE_TIERS
                            .iter()
                            .map(|t| format!(
                                "{} when {}x over {} and {} ({})",
                                rules::alert_name(t),
                                t.burn_rate,
                                rules::prom_duration(t.long_window),
                                rules::prom_duration(t.short_window),
                                t.severity.as_str()
                            ))
                            .collect::<Vec<_>>()
                            .join("; ")
                    ),
                    unit: "short",
                    kind: "timeseries",
                    targets: windows
                        .iter()
                        .map(|&w| {
                            target(
                                format!("{}{}", rules::burn(w), by_release()),
                                &format!("{release_legend} {}", rules::prom_duration(w)),
                            )
                        })
                        .collect(),
                },
                Panel {
                    title: "Requests by outcome",
                    description: "Requests per second by how they ended.".to_owned(),
                    unit: "reqps",
                    kind: "timeseries",
                    targets: vec![target(
                        format!(
                            "sum by ({RELEASE_LABEL}, {OUTCOME_LABEL}) (rate({}{}[$__rate_interval]))",
                            counter_total(REQUESTS),
                            by_release()
                        ),
                        &format!("{release_legend} {{{{{OUTCOME_LABEL}}}}}"),
                    )],
                },
            ],
        },
        Row {
            title: "Engines",
            panels: vec![
                Panel {
                    title: "Queue (waiting requests)",
                    description: "Requests waiting in the engines' queues, per release.".to_owned(),
                    unit: "short",
                    kind: "timeseries",
                    targets: vec![target(
                        format!("sum by ({RELEASE_LABEL}) ({WAITING}{})", by_release()),
                        &release_legend,
                    )],
                },
                Panel {
                    title: "Running requests",
                    description: "Requests running (holding KV blocks), per release.".to_owned(),
                    unit: "short",
                    kind: "timeseries",
                    targets: vec![target(
                        format!("sum by ({RELEASE_LABEL}) ({RUNNING}{})", by_release()),
                        &release_legend,
                    )],
                },
                Panel {
                    title: "KV cache use",
                    description: "Fraction of KV blocks in use: mean and fullest engine per release.".to_owned(),
                    unit: "percentunit",
                    kind: "timeseries",
                    targets: ["avg", "max"]
                        .into_iter()
                        .map(|agg| {
                            target(
                                format!("{agg} by ({RELEASE_LABEL}) ({KV_USAGE}{})", by_release()),
                                &format!("{release_legend} {agg}"),
                            )
                        })
                        .collect(),
                },
                Panel {
                    title: "Prefix-cache hit ratio",
                    description: "Prompt tokens found in the prefix cache, of those looked up.".to_owned(),
                    unit: "percentunit",
                    kind: "timeseries",
                    targets: vec![target(
                        format!(
                            "{} / {}",
                            rate_by_release(PREFIX_HITS),
                            rate_by_release(PREFIX_QUERIES)
                        ),
                        &release_legend,
                    )],
                },
            ],
        },
        Row {
            title: "Rollouts and groups (operator)",
            panels: vec![
                Panel {
                    title: "Canary weight",
                    description: "Percent of groups running the canary release (status.canaryRelease.weight); 0 without a rollout.".to_owned(),
                    unit: "percent",
                    kind: "timeseries",
                    targets: vec![target(format!("{CANARY_WEIGHT}{}", by_service()), &service_legend)],
                },
                Panel {
                    title: "Rollbacks",
                    description: "Automatic rollbacks in the dashboard's time range.".to_owned(),
                    unit: "short",
                    kind: "stat",
                    targets: vec![target(
                        format!(
                            "sum by ({NAMESPACE_LABEL}, {INFERENCESERVICE_LABEL}) (increase({}{}[$__range]))",
                            counter_total(ROLLBACKS),
                            by_service()
                        ),
                        &service_legend,
                    )],
                },
                Panel {
                    title: "Groups: desired, ready, serving",
                    description: "Groups the operator wants, groups whose every pod is Ready, and ready groups receiving traffic.".to_owned(),
                    unit: "short",
                    kind: "timeseries",
                    targets: [("desired", GROUPS_DESIRED), ("ready", GROUPS_READY), ("serving", GROUPS_SERVING)]
                        .into_iter()
                        .map(|(what, name)| {
                            target(format!("{name}{}", by_service()), &format!("{service_legend} {what}"))
                        })
                        .collect(),
                },
            ],
        },
    ]
}

fn datasource() -> Value {
    json!({"type": "prometheus", "uid": "${datasource}"})
}

fn variable(name: &str, query: String) -> Value {
    json!({
        "name": name,
        "label": name,
        "type": "query",
        "datasource": datasource(),
        "definition": query,
        "query": {"query": query, "refId": name},
        "refresh": 2,
        "includeAll": true,
        "multi": true,
        "allValue": ".*",
        "current": {"selected": true, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
    })
}

/// The dashboard as Grafana JSON.
#[must_use]
pub fn dashboard() -> Value {
    let mut panels = Vec::new();
    let (mut id, mut y) = (1, 0);
    for row in rows() {
        panels.push(json!({
            "id": id,
            "type": "row",
            "title": row.title,
            "collapsed": false,
            "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
            "panels": [],
        }));
        id += 1;
        y += 1;
        for (i, panel) in row.panels.iter().enumerate() {
            let targets: Vec<Value> = panel
                .targets
                .iter()
                .zip('A'..='Z')
                .map(|(t, ref_id)| {
                    json!({
                        "refId": ref_id.to_string(),
                        "datasource": datasource(),
                        "expr": t.expr,
                        "legendFormat": t.legend,
                    })
                })
                .collect();
            // Two panels a line, 12 columns each.
            let (x, row_y) = (12 * (i % 2), y + 8 * (i / 2));
            panels.push(json!({
                "id": id,
                "type": panel.kind,
                "title": panel.title,
                "description": panel.description,
                "datasource": datasource(),
                "gridPos": {"h": 8, "w": 12, "x": x, "y": row_y},
                "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
                "options": {
                    "legend": {"displayMode": "list", "placement": "bottom", "showLegend": true},
                    "tooltip": {"mode": "multi", "sort": "desc"},
                },
                "targets": targets,
            }));
            id += 1;
        }
        y += 8 * row.panels.len().div_ceil(2);
    }
    let service_probe = GROUPS_DESIRED;
    json!({
        "uid": rules::DASHBOARD_UID,
        "title": "Slipway",
        "description": "Generated by `make generate` (cargo run -p slipway-operator --bin monitoring-gen). Do not edit.",
        "tags": ["slipway"],
        "timezone": "browser",
        "editable": false,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": [
            {
                "name": "datasource",
                "label": "Data source",
                "type": "datasource",
                "query": "prometheus",
                "current": {},
            },
            variable(RELEASE_LABEL, format!("label_values({}, {RELEASE_LABEL})", counter_total(REQUESTS))),
            variable(NAMESPACE_LABEL, format!("label_values({service_probe}, {NAMESPACE_LABEL})")),
            variable(
                INFERENCESERVICE_LABEL,
                format!("label_values({service_probe}{{{NAMESPACE_LABEL}=~\"${NAMESPACE_LABEL}\"}}, {INFERENCESERVICE_LABEL})"),
            ),
        ]},
        "panels": panels,
    })
}

/// The dashboard as pretty JSON with a trailing newline.
///
/// # Errors
/// Only if serialization fails.
pub fn dashboard_json() -> Result<String, serde_json::Error> {
    Ok(format!("{}\n", serde_json::to_string_pretty(&dashboard())?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use slipway_engine::serving::metrics::ServingMetrics;

    #[test]
    fn engine_registers_every_family_the_dashboard_reads() {
        let text = ServingMetrics::new("m", "r").prometheus_text();
        use slipway_contract::metrics::{
            INTER_TOKEN, KV_USAGE, PREFIX_HITS, PREFIX_QUERIES, RUNNING, TTFT, WAITING,
        };
        for (name, kind) in [
            (TTFT.to_owned(), "histogram"),
            (INTER_TOKEN.to_owned(), "histogram"),
            (WAITING.to_owned(), "gauge"),
            (RUNNING.to_owned(), "gauge"),
            (KV_USAGE.to_owned(), "gauge"),
            (counter_total(PREFIX_QUERIES), "counter"),
            (counter_total(PREFIX_HITS), "counter"),
        ] {
            assert!(
                text.contains(&format!("# TYPE {name} {kind}\n")),
                "the engine registers no {kind} {name}:\n{text}"
            );
        }
    }

    #[test]
    fn the_issue_s_panels_are_there_each_with_a_query() {
        let titles: Vec<&str> = rows()
            .iter()
            .flat_map(|r| r.panels.iter().map(|p| p.title))
            .collect();
        assert_eq!(
            titles,
            [
                "TTFT P50 / P99",
                "TPOT P50 / P99",
                "SLO-met ratio",
                "Error-budget burn rate",
                "Requests by outcome",
                "Queue (waiting requests)",
                "Running requests",
                "KV cache use",
                "Prefix-cache hit ratio",
                "Canary weight",
                "Rollbacks",
                "Groups: desired, ready, serving",
            ]
        );
        for row in rows() {
            for panel in row.panels {
                assert!(!panel.targets.is_empty(), "{}", panel.title);
            }
        }
    }

    #[test]
    fn panel_ids_are_unique_and_every_panel_reads_the_datasource_variable() {
        let dashboard = dashboard();
        let panels = dashboard["panels"].as_array().cloned().unwrap_or_default();
        let mut ids: Vec<i64> = panels.iter().filter_map(|p| p["id"].as_i64()).collect();
        let n = ids.len();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), n);
        for panel in panels.iter().filter(|p| p["type"] != "row") {
            assert_eq!(panel["datasource"]["uid"], "${datasource}", "{panel}");
        }
    }

    #[test]
    fn the_burn_panel_reads_every_recorded_window() {
        let rows = rows();
        let burn = rows[0]
            .panels
            .iter()
            .find(|p| p.title == "Error-budget burn rate")
            .map(|p| p.targets.clone())
            .unwrap_or_default();
        for w in rules::windows() {
            assert!(
                burn.iter().any(|t| t.expr.starts_with(&rules::burn(w))),
                "{w:?}"
            );
        }
    }
}
