//! `/metrics` (Prometheus text format) and `/healthz` for the operator.
//!
//! Low cardinality by construction:
//! - reconciles, reconcile errors by [`crate::Error::category`] (a fixed set of words),
//!   a reconcile-duration histogram, and whether this replica leads;
//! - per InferenceService (labels `namespace`, `inferenceservice`), what the last
//!   reconcile decided: groups desired, ready and serving, the canary's weight (0
//!   without a rollout), rollbacks so far, and the SLO objective of each release it
//!   runs (label `release`: the stable and the canary bundle). The generated alert
//!   rules (`manifests/monitoring/`) divide by this objective, so alerts burn against
//!   each service's `slo.availability`, as its canary analysis does.
//!
//! Only the leader reports services: a replica that loses the Lease drops them, so a
//! sum over replicas counts each service once. A service not reconciled for
//! [`SERVICE_TTL`] (deleted: without a finalizer, no reconcile sees it go) is dropped. A scrape through a Prometheus job whose
//! target labels include `namespace` (a ServiceMonitor) needs `honorLabels: true` to
//! keep the service's namespace.
//!
//! The names are the constants below; the dashboard generator reads them, never a copy.
//! Written by hand: a dozen series do not justify another dependency.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use slipway_api::InferenceServiceStatus;
use slipway_contract::metrics::{RELEASE_LABEL, counter_total};

/// Counter family: reconciles run.
pub const RECONCILES: &str = "slipway_operator_reconciles";
/// Counter family: failed reconciles by `category`.
pub const RECONCILE_ERRORS: &str = "slipway_operator_reconcile_errors";
/// Histogram: seconds per reconcile.
pub const RECONCILE_DURATION: &str = "slipway_operator_reconcile_duration_seconds";
/// Gauge: 1 while this replica holds the leader Lease.
pub const LEADER: &str = "slipway_operator_leader";
/// Gauge: groups the operator wants running (`status.replicas.desired`).
pub const GROUPS_DESIRED: &str = "slipway_operator_groups_desired";
/// Gauge: groups whose every pod is Ready (`status.replicas.ready`).
pub const GROUPS_READY: &str = "slipway_operator_groups_ready";
/// Gauge: ready groups in the client Service's endpoints (`status.replicas.serving`).
pub const GROUPS_SERVING: &str = "slipway_operator_groups_serving";
/// Gauge: percent of groups running the canary (`status.canaryRelease.weight`; 0
/// without a rollout).
pub const CANARY_WEIGHT: &str = "slipway_operator_canary_weight_percent";
/// Counter family: automatic rollbacks.
pub const ROLLBACKS: &str = "slipway_operator_rollbacks";
/// Gauge: `slo.availability` of the service, per release it runs.
pub const SLO_OBJECTIVE: &str = "slipway_operator_slo_objective";

/// Label of the per-service series: the InferenceService's namespace.
pub const NAMESPACE_LABEL: &str = "namespace";
/// Label of the per-service series: the InferenceService's name.
pub const INFERENCESERVICE_LABEL: &str = "inferenceservice";

/// A service's series are dropped when it has not been reconciled for this long:
/// three of the controller's resyncs ([`crate::reconcile::RESYNC`]).
pub const SERVICE_TTL: Duration = Duration::from_secs(3 * 300);

/// Upper bounds (seconds) of the duration histogram's buckets.
const BUCKETS: [f64; 9] = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];

/// What one reconcile decided about one InferenceService, as the gauges show it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ServiceGauges {
    pub desired: i32,
    pub ready: i32,
    pub serving: i32,
    /// Percent of groups on the canary; 0 without a rollout.
    pub canary_weight: i32,
    /// `slo.availability`.
    pub objective: f64,
    /// The releases it runs: stable, then the canary if any.
    pub releases: Vec<String>,
}

impl ServiceGauges {
    /// The gauges of a planned status and the spec's objective.
    #[must_use]
    pub fn from_status(status: &InferenceServiceStatus, objective: f64) -> Self {
        let canary = status.canary_release.as_ref();
        Self {
            desired: status.replicas.desired,
            ready: status.replicas.ready,
            serving: status.replicas.serving,
            canary_weight: canary.map_or(0, |c| c.weight),
            objective,
            releases: status
                .stable_release
                .iter()
                .cloned()
                .chain(canary.map(|c| c.hash.clone()))
                .collect(),
        }
    }
}

/// Reads one gauge's value from a service's gauges.
type GaugeOf = fn(&ServiceGauges) -> i32;

/// One service's series.
#[derive(Debug, Clone, Default)]
struct Service {
    gauges: ServiceGauges,
    rollbacks: u64,
    seen: Option<Instant>,
}

/// The operator's counters.
#[derive(Debug, Default)]
pub struct Metrics {
    reconciles: AtomicU64,
    /// Per bucket (cumulative at render time), then +Inf.
    buckets: [AtomicU64; BUCKETS.len() + 1],
    /// Sum of durations in microseconds.
    duration_sum_micros: AtomicU64,
    errors: Mutex<BTreeMap<&'static str, u64>>,
    leader: AtomicBool,
    /// Keyed by (namespace, name).
    services: Mutex<BTreeMap<(String, String), Service>>,
}

/// A poisoned lock only means another thread panicked mid-update; the values are
/// still usable.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

impl Metrics {
    /// Records one reconcile.
    pub fn observe_reconcile(&self, took: Duration, error: Option<&'static str>) {
        self.reconciles.fetch_add(1, Ordering::Relaxed);
        let seconds = took.as_secs_f64();
        let bucket = BUCKETS
            .iter()
            .position(|&b| seconds <= b)
            .unwrap_or(BUCKETS.len());
        self.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        self.duration_sum_micros.fetch_add(
            u64::try_from(took.as_micros()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        if let Some(category) = error {
            *lock(&self.errors).entry(category).or_default() += 1;
        }
    }

    /// Records what a reconcile of `namespace/name` decided, and the rollbacks it made
    /// (the counter starts at 0 the first time a service is seen, so its first
    /// rollback is an increase).
    pub fn observe_service(
        &self,
        namespace: &str,
        name: &str,
        gauges: ServiceGauges,
        rollbacks: u64,
    ) {
        self.observe_service_at(namespace, name, gauges, rollbacks, Instant::now());
    }

    fn observe_service_at(
        &self,
        namespace: &str,
        name: &str,
        gauges: ServiceGauges,
        rollbacks: u64,
        now: Instant,
    ) {
        let mut services = lock(&self.services);
        let service = services
            .entry((namespace.to_owned(), name.to_owned()))
            .or_default();
        service.gauges = gauges;
        service.rollbacks += rollbacks;
        service.seen = Some(now);
    }

    /// Drops the services not reconciled within [`SERVICE_TTL`] before `now`.
    fn expire(&self, now: Instant) {
        lock(&self.services).retain(|_, s| {
            s.seen
                .is_some_and(|seen| now.saturating_duration_since(seen) < SERVICE_TTL)
        });
    }

    /// Drops a deleted service's series.
    pub fn forget_service(&self, namespace: &str, name: &str) {
        lock(&self.services).remove(&(namespace.to_owned(), name.to_owned()));
    }

    /// Whether this replica currently leads. A replica that stops leading drops the
    /// services' series: the new leader reports them.
    pub fn set_leader(&self, leader: bool) {
        self.leader.store(leader, Ordering::Relaxed);
        if !leader {
            lock(&self.services).clear();
        }
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let reconciles = counter_total(RECONCILES);
        header(&mut out, &reconciles, "Reconciles run.", "counter");
        let _ = writeln!(
            out,
            "{reconciles} {}",
            self.reconciles.load(Ordering::Relaxed)
        );
        let errors = counter_total(RECONCILE_ERRORS);
        header(
            &mut out,
            &errors,
            "Failed reconciles by category.",
            "counter",
        );
        for (category, count) in lock(&self.errors).iter() {
            let _ = writeln!(out, "{errors}{{category=\"{category}\"}} {count}");
        }
        header(
            &mut out,
            RECONCILE_DURATION,
            "Time per reconcile.",
            "histogram",
        );
        let mut cumulative = 0;
        for (i, bound) in BUCKETS.iter().enumerate() {
            cumulative += self.buckets[i].load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "{RECONCILE_DURATION}_bucket{{le=\"{bound}\"}} {cumulative}"
            );
        }
        cumulative += self.buckets[BUCKETS.len()].load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "{RECONCILE_DURATION}_bucket{{le=\"+Inf\"}} {cumulative}"
        );
        let sum = self.duration_sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{RECONCILE_DURATION}_sum {sum}");
        let _ = writeln!(out, "{RECONCILE_DURATION}_count {cumulative}");
        header(
            &mut out,
            LEADER,
            "1 while this replica holds the leader Lease.",
            "gauge",
        );
        let _ = writeln!(
            out,
            "{LEADER} {}",
            u8::from(self.leader.load(Ordering::Relaxed))
        );
        self.render_services(&mut out);
        out
    }

    fn render_services(&self, out: &mut String) {
        self.expire(Instant::now());
        let services = lock(&self.services);
        let gauges: [(&str, &str, GaugeOf); 4] = [
            (
                GROUPS_DESIRED,
                "Groups the operator wants running (status.replicas.desired).",
                |g| g.desired,
            ),
            (
                GROUPS_READY,
                "Groups whose every pod is Ready (status.replicas.ready).",
                |g| g.ready,
            ),
            (
                GROUPS_SERVING,
                "Ready groups receiving traffic (status.replicas.serving).",
                |g| g.serving,
            ),
            (
                CANARY_WEIGHT,
                "Percent of groups running the canary release; 0 without a rollout.",
                |g| g.canary_weight,
            ),
        ];
        for (name, help, value) in gauges {
            header(out, name, help, "gauge");
            for ((namespace, isvc), service) in services.iter() {
                let _ = writeln!(
                    out,
                    "{name}{} {}",
                    labels(&[(NAMESPACE_LABEL, namespace), (INFERENCESERVICE_LABEL, isvc)]),
                    value(&service.gauges)
                );
            }
        }
        let rollbacks = counter_total(ROLLBACKS);
        header(
            out,
            &rollbacks,
            "Automatic rollbacks of a canary release.",
            "counter",
        );
        for ((namespace, isvc), service) in services.iter() {
            let _ = writeln!(
                out,
                "{rollbacks}{} {}",
                labels(&[(NAMESPACE_LABEL, namespace), (INFERENCESERVICE_LABEL, isvc)]),
                service.rollbacks
            );
        }
        header(
            out,
            SLO_OBJECTIVE,
            "slo.availability of the service, per release it runs (stable and canary).",
            "gauge",
        );
        for ((namespace, isvc), service) in services.iter() {
            for release in &service.gauges.releases {
                let _ = writeln!(
                    out,
                    "{SLO_OBJECTIVE}{} {}",
                    labels(&[
                        (NAMESPACE_LABEL, namespace),
                        (INFERENCESERVICE_LABEL, isvc),
                        (RELEASE_LABEL, release),
                    ]),
                    service.gauges.objective
                );
            }
        }
    }
}

fn header(out: &mut String, name: &str, help: &str, kind: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// `{a="b",...}` with values escaped as the text format requires.
fn labels(pairs: &[(&str, &str)]) -> String {
    let body: Vec<String> = pairs
        .iter()
        .map(|(key, value)| {
            let value = value
                .replace('\\', "\\\\")
                .replace('"', "\\\"")
                .replace('\n', "\\n");
            format!("{key}=\"{value}\"")
        })
        .collect();
    format!("{{{}}}", body.join(","))
}

/// The HTTP routes: `/metrics` and `/healthz` (the process is up and serving).
pub fn router(metrics: Arc<Metrics>) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(|State(metrics): State<Arc<Metrics>>| async move { metrics.render() }),
        )
        .route("/healthz", get(|| async { (StatusCode::OK, "ok") }))
        .with_state(metrics)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative_and_errors_are_by_category() {
        let metrics = Metrics::default();
        metrics.observe_reconcile(Duration::from_millis(5), None);
        metrics.observe_reconcile(Duration::from_millis(200), Some("Apply"));
        metrics.observe_reconcile(Duration::from_secs(60), Some("Apply"));
        let text = metrics.render();
        assert!(
            text.contains("slipway_operator_reconciles_total 3"),
            "{text}"
        );
        assert!(
            text.contains("slipway_operator_reconcile_errors_total{category=\"Apply\"} 2"),
            "{text}"
        );
        assert!(text.contains("_bucket{le=\"0.01\"} 1"), "{text}");
        assert!(text.contains("_bucket{le=\"0.25\"} 2"), "{text}");
        assert!(text.contains("_bucket{le=\"+Inf\"} 3"), "{text}");
        assert!(text.contains("_count 3"), "{text}");
    }

    fn gauges() -> ServiceGauges {
        ServiceGauges {
            desired: 4,
            ready: 3,
            serving: 2,
            canary_weight: 34,
            objective: 0.99,
            releases: vec!["stable1234".to_owned(), "canary5678".to_owned()],
        }
    }

    #[test]
    fn services_render_their_gauges_rollbacks_and_objective_per_release() {
        let metrics = Metrics::default();
        metrics.observe_service("ns", "smol", gauges(), 0);
        let text = metrics.render();
        let base = r#"{namespace="ns",inferenceservice="smol"}"#;
        for line in [
            format!("slipway_operator_groups_desired{base} 4"),
            format!("slipway_operator_groups_ready{base} 3"),
            format!("slipway_operator_groups_serving{base} 2"),
            format!("slipway_operator_canary_weight_percent{base} 34"),
            // Seen with no rollback yet: the counter exists at 0.
            format!("slipway_operator_rollbacks_total{base} 0"),
            r#"slipway_operator_slo_objective{namespace="ns",inferenceservice="smol",release="stable1234"} 0.99"#.to_owned(),
            r#"slipway_operator_slo_objective{namespace="ns",inferenceservice="smol",release="canary5678"} 0.99"#.to_owned(),
        ] {
            assert!(text.contains(&line), "{line} missing from\n{text}");
        }
        metrics.observe_service("ns", "smol", gauges(), 1);
        metrics.observe_service("ns", "smol", gauges(), 0);
        assert!(
            metrics
                .render()
                .contains(&format!("slipway_operator_rollbacks_total{base} 1"))
        );
    }

    #[test]
    fn gauges_come_from_the_planned_status() {
        let status: InferenceServiceStatus = serde_json::from_value(serde_json::json!({
            "replicas": {"desired": 5, "healthyNeeded": 3, "ready": 4, "serving": 3, "updated": 1},
            "stableRelease": "aaaa",
            "canaryRelease": {"hash": "bbbb", "step": 1, "weight": 50},
        }))
        .expect("a valid status");
        let g = ServiceGauges::from_status(&status, 0.999);
        assert_eq!(
            g,
            ServiceGauges {
                desired: 5,
                ready: 4,
                serving: 3,
                canary_weight: 50,
                objective: 0.999,
                releases: vec!["aaaa".to_owned(), "bbbb".to_owned()],
            }
        );
        let steady = InferenceServiceStatus {
            canary_release: None,
            ..status
        };
        let g = ServiceGauges::from_status(&steady, 0.999);
        assert_eq!((g.canary_weight, g.releases), (0, vec!["aaaa".to_owned()]));
    }

    #[test]
    fn losing_the_lease_or_the_service_drops_its_series() {
        let metrics = Metrics::default();
        metrics.set_leader(true);
        metrics.observe_service("ns", "a", gauges(), 0);
        metrics.observe_service("ns", "b", gauges(), 0);
        metrics.forget_service("ns", "a");
        let text = metrics.render();
        assert!(!text.contains(r#"inferenceservice="a""#), "{text}");
        assert!(text.contains(r#"inferenceservice="b""#), "{text}");
        metrics.set_leader(false);
        let text = metrics.render();
        assert!(!text.contains("inferenceservice="), "{text}");
        assert!(text.contains("slipway_operator_leader 0"), "{text}");
    }

    #[test]
    fn a_service_not_reconciled_within_the_ttl_is_dropped() {
        let metrics = Metrics::default();
        let t0 = Instant::now();
        metrics.observe_service_at("ns", "old", gauges(), 0, t0);
        metrics.observe_service_at("ns", "new", gauges(), 0, t0 + SERVICE_TTL);
        metrics.expire(t0 + SERVICE_TTL);
        let keys: Vec<_> = lock(&metrics.services).keys().cloned().collect();
        assert_eq!(keys, [("ns".to_owned(), "new".to_owned())]);
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(labels(&[("a", "x\"y\\z\n")]), r#"{a="x\"y\\z\n"}"#);
    }
}
