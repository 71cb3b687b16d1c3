//! `/metrics` (Prometheus text format) and `/healthz` for the operator.
//!
//! Three series, low cardinality by construction: reconciles, reconcile errors by
//! [`crate::Error::category`] (a fixed set of words), and a reconcile-duration
//! histogram. Written by hand: three series do not justify another dependency.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;

/// Upper bounds (seconds) of the duration histogram's buckets.
const BUCKETS: [f64; 9] = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];

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
            // A poisoned lock only means another thread panicked mid-increment; the
            // counts are still usable.
            let mut errors = self.errors.lock().unwrap_or_else(|e| e.into_inner());
            *errors.entry(category).or_default() += 1;
        }
    }

    /// Whether this replica currently leads.
    pub fn set_leader(&self, leader: bool) {
        self.leader.store(leader, Ordering::Relaxed);
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP slipway_operator_reconciles_total Reconciles run."
        );
        let _ = writeln!(out, "# TYPE slipway_operator_reconciles_total counter");
        let _ = writeln!(
            out,
            "slipway_operator_reconciles_total {}",
            self.reconciles.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP slipway_operator_reconcile_errors_total Failed reconciles by category."
        );
        let _ = writeln!(
            out,
            "# TYPE slipway_operator_reconcile_errors_total counter"
        );
        for (category, count) in self.errors.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let _ = writeln!(
                out,
                "slipway_operator_reconcile_errors_total{{category=\"{category}\"}} {count}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP slipway_operator_reconcile_duration_seconds Time per reconcile."
        );
        let _ = writeln!(
            out,
            "# TYPE slipway_operator_reconcile_duration_seconds histogram"
        );
        let mut cumulative = 0;
        for (i, bound) in BUCKETS.iter().enumerate() {
            cumulative += self.buckets[i].load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "slipway_operator_reconcile_duration_seconds_bucket{{le=\"{bound}\"}} {cumulative}"
            );
        }
        cumulative += self.buckets[BUCKETS.len()].load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "slipway_operator_reconcile_duration_seconds_bucket{{le=\"+Inf\"}} {cumulative}"
        );
        let sum = self.duration_sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "slipway_operator_reconcile_duration_seconds_sum {sum}");
        let _ = writeln!(
            out,
            "slipway_operator_reconcile_duration_seconds_count {cumulative}"
        );
        let _ = writeln!(
            out,
            "# HELP slipway_operator_leader 1 while this replica holds the leader Lease."
        );
        let _ = writeln!(out, "# TYPE slipway_operator_leader gauge");
        let _ = writeln!(
            out,
            "slipway_operator_leader {}",
            u8::from(self.leader.load(Ordering::Relaxed))
        );
        out
    }
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
}
