//! What the router measures, at the client-side boundary the design defines: TTFT,
//! TPOT and E2E per release as the client sees them (queueing, retries and the network
//! included), outcomes, the SLO-met count the rollout's `Router` metrics source reads,
//! and why each choice was made (decisions, predicted and actual cached tokens,
//! retries, exclusions).
//!
//! Every family carries the release; labels stay bounded (the two releases of one
//! InferenceService, the policies, the fixed reasons).

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use slipway_contract::metrics::router as names;
use slipway_contract::metrics::{OUTCOME_LABEL, Outcome, RELEASE_LABEL};

type Labels = Vec<(&'static str, String)>;
type HistogramFamily = Family<Labels, Histogram, fn() -> Histogram>;

const LATENCY_BUCKETS: [f64; 17] = [
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
];
const TOKEN_BUCKETS: [f64; 15] = [
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
];
const E2E_BUCKETS: [f64; 12] = [
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0,
];

fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS)
}
fn token_histogram() -> Histogram {
    Histogram::new(TOKEN_BUCKETS)
}
fn e2e_histogram() -> Histogram {
    Histogram::new(E2E_BUCKETS)
}

/// How the prefix index's prediction compared with the cached tokens the engine
/// reported, within one engine KV block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prediction {
    /// Predicted and reported agree within one block.
    Matched,
    /// The router predicted more than the engine had.
    Over,
    /// The engine had more than the router predicted.
    Under,
}

impl Prediction {
    /// The `result` label value.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Matched => "matched",
            Self::Over => "over",
            Self::Under => "under",
        }
    }

    /// Compares `predicted` with `actual` cached tokens, `tolerance` being one block.
    #[must_use]
    pub fn of(predicted: u64, actual: u64, tolerance: u64) -> Self {
        if predicted.abs_diff(actual) <= tolerance {
            Self::Matched
        } else if predicted > actual {
            Self::Over
        } else {
            Self::Under
        }
    }
}

/// The router's metric families.
#[derive(Debug)]
pub struct RouterMetrics {
    registry: Registry,
    requests: Family<Labels, Counter>,
    slo_met: Family<Labels, Counter>,
    ttft: HistogramFamily,
    tpot: HistogramFamily,
    e2e: HistogramFamily,
    decisions: Family<Labels, Counter>,
    predicted_cached: Family<Labels, Counter>,
    cached: Family<Labels, Counter>,
    prompt_tokens: Family<Labels, Counter>,
    predictions: Family<Labels, Counter>,
    retries: Family<Labels, Counter>,
    excluded: Family<Labels, Counter>,
    endpoints: Family<Labels, Gauge>,
    in_flight: Family<Labels, Gauge>,
}

fn release(release: &str) -> Labels {
    vec![(RELEASE_LABEL, release.to_owned())]
}

impl Default for RouterMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl RouterMetrics {
    /// Registers every family (counter names without `_total`: the encoder adds it).
    #[must_use]
    pub fn new() -> Self {
        let mut m = Self {
            registry: Registry::default(),
            requests: Family::default(),
            slo_met: Family::default(),
            ttft: Family::new_with_constructor(latency_histogram),
            tpot: Family::new_with_constructor(token_histogram),
            e2e: Family::new_with_constructor(e2e_histogram),
            decisions: Family::default(),
            predicted_cached: Family::default(),
            cached: Family::default(),
            prompt_tokens: Family::default(),
            predictions: Family::default(),
            retries: Family::default(),
            excluded: Family::default(),
            endpoints: Family::default(),
            in_flight: Family::default(),
        };
        let r = &mut m.registry;
        r.register(
            names::REQUESTS,
            "Requests through the router by release and how they ended",
            m.requests.clone(),
        );
        r.register(
            names::REQUESTS_SLO_MET,
            "Successful requests whose TTFT and TPOT, measured at the router, met the InferenceService's targets",
            m.slo_met.clone(),
        );
        r.register(
            names::TTFT,
            "Arrival at the router to the first token relayed to the client",
            m.ttft.clone(),
        );
        r.register(
            names::TPOT,
            "(E2E - TTFT) / (output tokens - 1) at the router, streams of two tokens or more",
            m.tpot.clone(),
        );
        r.register(
            names::E2E,
            "Arrival at the router to the last byte relayed, successful requests",
            m.e2e.clone(),
        );
        r.register(
            names::DECISIONS,
            "Endpoint choices by release and the policy that decided (least-in-flight when the load view was stale)",
            m.decisions.clone(),
        );
        r.register(
            names::PREDICTED_CACHED_TOKENS,
            "Prompt tokens the prefix index predicted cached on the chosen endpoint",
            m.predicted_cached.clone(),
        );
        r.register(
            names::CACHED_TOKENS,
            "Prompt tokens the engines reported cached",
            m.cached.clone(),
        );
        r.register(
            names::PROMPT_TOKENS,
            "Prompt tokens of routed requests, as the engines reported them",
            m.prompt_tokens.clone(),
        );
        r.register(
            names::PREFIX_PREDICTIONS,
            "Requests by how the predicted cached tokens compared with the engine's (within one KV block)",
            m.predictions.clone(),
        );
        r.register(
            names::RETRIES,
            "Attempts retried on another endpoint, by reason",
            m.retries.clone(),
        );
        r.register(
            names::EXCLUDED,
            "Endpoints left out of a choice by a hard filter, by reason",
            m.excluded.clone(),
        );
        r.register(
            names::ENDPOINTS,
            "Endpoints known, by release and state",
            m.endpoints.clone(),
        );
        r.register(
            names::IN_FLIGHT,
            "Requests in flight through the router",
            m.in_flight.clone(),
        );
        m
    }

    /// Prometheus text.
    #[must_use]
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }

    /// A request ended with `outcome`.
    pub fn request_ended(&self, rel: &str, outcome: Outcome) {
        let mut labels = release(rel);
        labels.push((OUTCOME_LABEL, outcome.as_str().to_owned()));
        self.requests.get_or_create(&labels).inc();
    }

    /// A successful request met the SLO.
    pub fn slo_met(&self, rel: &str) {
        self.slo_met.get_or_create(&release(rel)).inc();
    }

    /// Latencies of a request, in seconds.
    pub fn observe_ttft(&self, rel: &str, seconds: f64) {
        self.ttft.get_or_create(&release(rel)).observe(seconds);
    }

    /// Time per output token, in seconds.
    pub fn observe_tpot(&self, rel: &str, seconds: f64) {
        self.tpot.get_or_create(&release(rel)).observe(seconds);
    }

    /// End to end, in seconds.
    pub fn observe_e2e(&self, rel: &str, seconds: f64) {
        self.e2e.get_or_create(&release(rel)).observe(seconds);
    }

    /// An endpoint was chosen by `policy`.
    pub fn decided(&self, rel: &str, policy: &str) {
        let mut labels = release(rel);
        labels.push((names::POLICY_LABEL, policy.to_owned()));
        self.decisions.get_or_create(&labels).inc();
    }

    /// The engine's usage of a routed request against the router's prediction.
    pub fn prefix_outcome(&self, rel: &str, predicted: u64, cached: u64, prompt: u64, block: u64) {
        let labels = release(rel);
        self.predicted_cached
            .get_or_create(&labels)
            .inc_by(predicted);
        self.cached.get_or_create(&labels).inc_by(cached);
        self.prompt_tokens.get_or_create(&labels).inc_by(prompt);
        let mut labels = labels;
        labels.push((
            names::RESULT_LABEL,
            Prediction::of(predicted, cached, block).as_str().to_owned(),
        ));
        self.predictions.get_or_create(&labels).inc();
    }

    /// An attempt was retried elsewhere.
    pub fn retried(&self, rel: &str, reason: &str) {
        let mut labels = release(rel);
        labels.push((names::REASON_LABEL, reason.to_owned()));
        self.retries.get_or_create(&labels).inc();
    }

    /// An endpoint was left out of a choice.
    pub fn excluded(&self, rel: &str, reason: &str) {
        let mut labels = release(rel);
        labels.push((names::REASON_LABEL, reason.to_owned()));
        self.excluded.get_or_create(&labels).inc();
    }

    /// Sets the count of endpoints of `rel` in `state`.
    pub fn set_endpoints(&self, rel: &str, state: &str, count: usize) {
        let mut labels = release(rel);
        labels.push(("state", state.to_owned()));
        self.endpoints
            .get_or_create(&labels)
            .set(i64::try_from(count).unwrap_or(i64::MAX));
    }

    /// Forgets the endpoint gauges (the set of releases changed).
    pub fn clear_endpoints(&self) {
        self.endpoints.clear();
    }

    /// A request entered (+1) or left (−1) the router.
    pub fn in_flight(&self, rel: &str, delta: i64) {
        self.in_flight.get_or_create(&release(rel)).inc_by(delta);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_render_under_the_contract_names_with_the_release() {
        let m = RouterMetrics::new();
        m.request_ended("abc", Outcome::Ok);
        m.slo_met("abc");
        m.observe_ttft("abc", 0.2);
        m.prefix_outcome("abc", 64, 48, 300, 16);
        let text = m.render();
        for line in [
            "slipway_router_requests_total{release=\"abc\",outcome=\"ok\"} 1",
            "slipway_router_requests_slo_met_total{release=\"abc\"} 1",
            "slipway_router_time_to_first_token_seconds_count{release=\"abc\"} 1",
            "slipway_router_predicted_cached_tokens_total{release=\"abc\"} 64",
            "slipway_router_cached_tokens_total{release=\"abc\"} 48",
            "slipway_router_prefix_predictions_total{release=\"abc\",result=\"matched\"} 1",
        ] {
            assert!(text.contains(line), "missing {line} in\n{text}");
        }
    }

    #[test]
    fn predictions_compare_within_one_block() {
        assert_eq!(Prediction::of(64, 48, 16), Prediction::Matched);
        assert_eq!(Prediction::of(96, 48, 16), Prediction::Over);
        assert_eq!(Prediction::of(0, 48, 16), Prediction::Under);
    }
}
