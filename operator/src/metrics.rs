//! `/metrics` (OpenMetrics text) and `/healthz` for the operator.
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
//! [`SERVICE_TTL`] (deleted: without a finalizer, no reconcile sees it go) is dropped.
//! A scrape through a Prometheus job whose target labels include `namespace` (a
//! ServiceMonitor) needs `honorLabels: true` to keep the service's namespace. Label values are Kubernetes names, release hashes and
//! fixed words, none of which can hold a quote, a backslash or a newline, so the
//! encoder writing them unescaped is safe.
//!
//! The names are the constants below; the dashboard generator reads them, never a copy.
//! The families are prometheus-client's, as in the engine and the router, served as
//! the OpenMetrics text it renders (counters as `<name>_total`); the state kept beside
//! them is only what the families cannot know: when each service was last reconciled
//! and which releases its objective series carry.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use slipway_api::InferenceServiceStatus;
use slipway_contract::metrics::RELEASE_LABEL;

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
/// Label of the reconcile errors: [`crate::Error::category`].
pub const CATEGORY_LABEL: &str = "category";

/// The `Content-Type` of `/metrics`: the OpenMetrics text prometheus-client writes.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

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

/// Label values of one series, in the order they are written.
type Labels = Vec<(&'static str, String)>;

/// What the families cannot tell about one service: when it was last reconciled (for
/// [`SERVICE_TTL`]) and the releases its objective series carry (a release it no
/// longer runs loses its series).
#[derive(Debug, Clone)]
struct Service {
    releases: Vec<String>,
    seen: Instant,
}

/// The operator's metric families.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    reconciles: Counter,
    errors: Family<Labels, Counter>,
    duration: Histogram,
    leader: Gauge,
    desired: Family<Labels, Gauge>,
    ready: Family<Labels, Gauge>,
    serving: Family<Labels, Gauge>,
    canary_weight: Family<Labels, Gauge>,
    rollbacks: Family<Labels, Counter>,
    objective: Family<Labels, Gauge<f64, AtomicU64>>,
    /// Keyed by (namespace, name). Held while a service's series change, so a
    /// reconcile and an expiry never interleave on one service.
    services: Mutex<BTreeMap<(String, String), Service>>,
}

/// A poisoned lock only means another thread panicked mid-update; the values are
/// still usable.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

fn service_labels(namespace: &str, name: &str) -> Labels {
    vec![
        (NAMESPACE_LABEL, namespace.to_owned()),
        (INFERENCESERVICE_LABEL, name.to_owned()),
    ]
}

fn release_labels(namespace: &str, name: &str, release: &str) -> Labels {
    let mut labels = service_labels(namespace, name);
    labels.push((RELEASE_LABEL, release.to_owned()));
    labels
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every family (counter names without `_total`: the encoder adds it).
    #[must_use]
    pub fn new() -> Self {
        let mut m = Self {
            registry: Registry::default(),
            reconciles: Counter::default(),
            errors: Family::default(),
            duration: Histogram::new(BUCKETS),
            leader: Gauge::default(),
            desired: Family::default(),
            ready: Family::default(),
            serving: Family::default(),
            canary_weight: Family::default(),
            rollbacks: Family::default(),
            objective: Family::default(),
            services: Mutex::new(BTreeMap::new()),
        };
        // prometheus-client ends each help text with a full stop.
        let r = &mut m.registry;
        r.register(RECONCILES, "Reconciles run", m.reconciles.clone());
        r.register(
            RECONCILE_ERRORS,
            "Failed reconciles by category",
            m.errors.clone(),
        );
        r.register(RECONCILE_DURATION, "Time per reconcile", m.duration.clone());
        r.register(
            LEADER,
            "1 while this replica holds the leader Lease",
            m.leader.clone(),
        );
        r.register(
            GROUPS_DESIRED,
            "Groups the operator wants running (status.replicas.desired)",
            m.desired.clone(),
        );
        r.register(
            GROUPS_READY,
            "Groups whose every pod is Ready (status.replicas.ready)",
            m.ready.clone(),
        );
        r.register(
            GROUPS_SERVING,
            "Ready groups receiving traffic (status.replicas.serving)",
            m.serving.clone(),
        );
        r.register(
            CANARY_WEIGHT,
            "Percent of groups running the canary release; 0 without a rollout",
            m.canary_weight.clone(),
        );
        r.register(
            ROLLBACKS,
            "Automatic rollbacks of a canary release",
            m.rollbacks.clone(),
        );
        r.register(
            SLO_OBJECTIVE,
            "slo.availability of the service, per release it runs (stable and canary)",
            m.objective.clone(),
        );
        m
    }

    /// Records one reconcile.
    pub fn observe_reconcile(&self, took: Duration, error: Option<&'static str>) {
        self.reconciles.inc();
        self.duration.observe(took.as_secs_f64());
        if let Some(category) = error {
            self.errors
                .get_or_create(&vec![(CATEGORY_LABEL, category.to_owned())])
                .inc();
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
        let labels = service_labels(namespace, name);
        for (family, value) in [
            (&self.desired, gauges.desired),
            (&self.ready, gauges.ready),
            (&self.serving, gauges.serving),
            (&self.canary_weight, gauges.canary_weight),
        ] {
            family.get_or_create(&labels).set(i64::from(value));
        }
        self.rollbacks.get_or_create(&labels).inc_by(rollbacks);
        let key = (namespace.to_owned(), name.to_owned());
        if let Some(previous) = services.get(&key) {
            for gone in previous
                .releases
                .iter()
                .filter(|r| !gauges.releases.contains(r))
            {
                self.objective
                    .remove(&release_labels(namespace, name, gone));
            }
        }
        for release in &gauges.releases {
            self.objective
                .get_or_create(&release_labels(namespace, name, release))
                .set(gauges.objective);
        }
        services.insert(
            key,
            Service {
                releases: gauges.releases,
                seen: now,
            },
        );
    }

    /// Removes every series of one service; the caller holds the services lock.
    fn remove_series(&self, (namespace, name): &(String, String), service: &Service) {
        let labels = service_labels(namespace, name);
        for family in [
            &self.desired,
            &self.ready,
            &self.serving,
            &self.canary_weight,
        ] {
            family.remove(&labels);
        }
        self.rollbacks.remove(&labels);
        for release in &service.releases {
            self.objective
                .remove(&release_labels(namespace, name, release));
        }
    }

    /// Drops the services not reconciled within [`SERVICE_TTL`] before `now`.
    fn expire(&self, now: Instant) {
        lock(&self.services).retain(|key, service| {
            let live = now.saturating_duration_since(service.seen) < SERVICE_TTL;
            if !live {
                self.remove_series(key, service);
            }
            live
        });
    }

    /// Drops a deleted service's series.
    pub fn forget_service(&self, namespace: &str, name: &str) {
        let mut services = lock(&self.services);
        let key = (namespace.to_owned(), name.to_owned());
        if let Some(service) = services.remove(&key) {
            self.remove_series(&key, &service);
        }
    }

    /// Whether this replica currently leads. A replica that stops leading drops the
    /// services' series: the new leader reports them.
    pub fn set_leader(&self, leader: bool) {
        self.leader.set(i64::from(leader));
        if !leader {
            let mut services = lock(&self.services);
            for family in [
                &self.desired,
                &self.ready,
                &self.serving,
                &self.canary_weight,
            ] {
                family.clear();
            }
            self.rollbacks.clear();
            self.objective.clear();
            services.clear();
        }
    }

    /// The OpenMetrics text exposition ([`CONTENT_TYPE`]), after dropping the
    /// services past their TTL.
    pub fn render(&self) -> String {
        self.expire(Instant::now());
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// The HTTP routes: `/metrics` and `/healthz` (the process is up and serving).
pub fn router(metrics: Arc<Metrics>) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(|State(metrics): State<Arc<Metrics>>| async move {
                ([(header::CONTENT_TYPE, CONTENT_TYPE)], metrics.render()).into_response()
            }),
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
        let mut text = String::new();
        encode(&mut text, &metrics.registry).expect("encodes");
        assert!(!text.contains(r#"inferenceservice="old""#), "{text}");
        assert!(text.contains(r#"inferenceservice="new""#), "{text}");
    }

    #[test]
    fn a_release_no_longer_run_loses_its_objective_series() {
        let metrics = Metrics::default();
        metrics.observe_service("ns", "smol", gauges(), 0);
        let promoted = ServiceGauges {
            canary_weight: 0,
            releases: vec!["canary5678".to_owned()],
            ..gauges()
        };
        metrics.observe_service("ns", "smol", promoted, 0);
        let text = metrics.render();
        assert!(!text.contains(r#"release="stable1234""#), "{text}");
        assert!(text.contains(r#"release="canary5678"} 0.99"#), "{text}");
    }

    #[test]
    fn the_exposition_is_openmetrics() {
        let text = Metrics::default().render();
        assert!(text.ends_with("# EOF\n"), "{text}");
        assert!(
            text.contains("# TYPE slipway_operator_reconcile_duration_seconds histogram"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE slipway_operator_reconciles counter"),
            "{text}"
        );
    }
}
