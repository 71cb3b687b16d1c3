//! The engine's Prometheus metrics (the contract the operator's rollout analysis and
//! Prometheus queries read), exposed at `GET /metrics` by `slipway-engine serve`.
//!
//! Every series carries the labels `model` and `release` (the `--release` flag), and
//! `slipway_requests_total` also `outcome`. The per-request families (requests, SLO
//! met, the four latency histograms, prompt and generated tokens) also carry
//! `adapter` for a request to a LoRA adapter — its served name (`--lora NAME=...`) —
//! and no `adapter` label for the base model, so the base model's series are exactly
//! what they were before adapters existed (in PromQL `adapter=""` selects them). The
//! label's values are fixed at start-up (the release's adapters), so cardinality
//! stays bounded. The engine-wide gauges and the prefix-cache counters describe the
//! shared engine and carry no adapter:
//! - counter `slipway_requests_total{outcome}`, outcome ∈ ok | rejected_429 |
//!   rejected_503 | cancelled | error; a request counts once, when it ends;
//! - counter `slipway_requests_slo_met_total`: successful requests whose TTFT ≤
//!   `--slo-ttft-ms` and TPOT ≤ `--slo-tpot-ms` (TPOT = (E2E − TTFT)/(N_out − 1); a
//!   one-token output meets TPOT trivially) — see [`SloTargets::met`];
//! - histograms (seconds) `slipway_time_to_first_token_seconds`,
//!   `slipway_inter_token_latency_seconds`, `slipway_e2e_request_latency_seconds`,
//!   `slipway_request_queue_time_seconds`;
//! - gauges `slipway_num_requests_running`, `slipway_num_requests_waiting`,
//!   `slipway_kv_cache_usage_perc` (a fraction, 0..1);
//! - counters `slipway_prompt_tokens_total`, `slipway_generation_tokens_total`,
//!   `slipway_prefix_cache_queries_total`, `slipway_prefix_cache_hits_total` (tokens).
//!
//! The Gateway API Inference Extension's model-server protocol (the endpoint picker
//! that routes by load) needs a waiting-queue size and a KV-cache utilisation: point
//! its model-server metric mapping at `slipway_num_requests_waiting` (queue size) and
//! `slipway_kv_cache_usage_perc` (KV utilisation, 0..1, as vLLM's
//! `vllm:kv_cache_usage_perc`).
//!
//! Who writes what: the engine actor owns the gauges, the token and prefix-cache
//! counters and the queue-time histogram (it alone sees the scheduler); the HTTP
//! layer owns outcomes, SLO and the client-side latencies (TTFT is measured from the
//! request's arrival to its first token leaving the engine).
//!
//! Two text formats: Prometheus text 0.0.4 (the default; `promtool check metrics`
//! reads it) and OpenMetrics 1.0 for scrapers that ask for it in `Accept`.
//! prometheus-client writes OpenMetrics, where a counter's family is named without
//! `_total`; [`openmetrics_to_prometheus_text`] renames counter families so the
//! 0.0.4 text names them as their samples.

use std::borrow::Cow;
use std::collections::HashSet;
use std::sync::atomic::AtomicU64;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use slipway_contract::metrics as names;
/// How a request ended, as counted in `slipway_requests_total{outcome}`: the
/// contract's type, which the operator's analysis reads.
pub use slipway_contract::metrics::Outcome;
/// The SLO's latency targets the SLO-met counter applies: the contract's type, shared
/// with the router and the load generator.
pub use slipway_contract::metrics::SloTargets;
use slipway_contract::metrics::{
    ADAPTER_LABEL, GENERATION_TOKENS, MODEL_LABEL, OUTCOME_LABEL, RELEASE_LABEL, REQUESTS,
    REQUESTS_SLO_MET,
};

/// Labels of a per-request series: `outcome` where the family has it, then
/// `adapter` for an adapter's series (none for the base model's).
type Labels = Vec<(&'static str, String)>;

/// The per-request series of one served model name: the base model or one LoRA
/// adapter. Handles share their series with the registry.
#[derive(Debug, Clone)]
pub struct RequestMetrics {
    /// `slipway_requests_total`, one counter per [`Outcome::ALL`].
    requests: Vec<Counter>,
    slo_met: Counter,
    /// Arrival to first token.
    pub ttft: Histogram,
    /// Between consecutive tokens of a request.
    pub inter_token: Histogram,
    /// Arrival to the last token.
    pub e2e: Histogram,
    /// Queued in the engine until first scheduled.
    pub queue_time: Histogram,
    /// Prompt tokens of admitted requests.
    pub prompt_tokens: Counter,
    /// Generated tokens.
    pub generation_tokens: Counter,
}

impl RequestMetrics {
    fn outcome(&self, outcome: Outcome) -> &Counter {
        let i = Outcome::ALL.iter().position(|&o| o == outcome).unwrap_or(0);
        &self.requests[i]
    }
}

/// The metrics of one serving process. Cloning the metric handles inside shares
/// them, so the actor and the HTTP layer update the same series.
#[derive(Debug)]
pub struct ServingMetrics {
    registry: Registry,
    /// Per served name: the base model first, then each adapter in `--lora` order.
    lanes: Vec<RequestMetrics>,
    /// Requests running (holding KV).
    pub running: Gauge,
    /// Requests waiting in the engine's queue.
    pub waiting: Gauge,
    /// Fraction of KV blocks in use.
    pub kv_usage: Gauge<f64, AtomicU64>,
    /// KV blocks in the running requests' contexts, counted per request (a shared
    /// prefix once per request): not exported, read by the load report.
    pub context_blocks: Gauge,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_queries: Counter,
    /// Of those, tokens found.
    pub prefix_hits: Counter,
}

fn latency_buckets() -> Histogram {
    Histogram::new(LATENCY_BUCKETS.iter().copied())
}
fn token_buckets() -> Histogram {
    Histogram::new(TOKEN_BUCKETS.iter().copied())
}
fn e2e_buckets() -> Histogram {
    Histogram::new(E2E_BUCKETS.iter().copied())
}

type HistogramFamily = Family<Labels, Histogram, fn() -> Histogram>;

const LATENCY_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
];
const TOKEN_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
];
const E2E_BUCKETS: &[f64] = &[
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0,
];

impl ServingMetrics {
    /// Registers every series with the labels `model` and `release`, for a process
    /// serving no adapters.
    #[must_use]
    pub fn new(model: &str, release: &str) -> Self {
        Self::with_adapters(model, release, &[])
    }

    /// Registers every series with the labels `model` and `release`, and the
    /// per-request ones once for the base model and once per adapter name. Every
    /// outcome of `slipway_requests_total` of every served name starts at 0, so rates
    /// exist from the first scrape.
    #[must_use]
    pub fn with_adapters(model: &str, release: &str, adapters: &[String]) -> Self {
        let labels = [
            (Cow::Borrowed(MODEL_LABEL), Cow::Owned(model.to_owned())),
            (Cow::Borrowed(RELEASE_LABEL), Cow::Owned(release.to_owned())),
        ];
        let mut registry = Registry::with_labels(labels.into_iter());
        let requests: Family<Labels, Counter> = Family::default();
        let slo_met: Family<Labels, Counter> = Family::default();
        let ttft: HistogramFamily = Family::new_with_constructor(latency_buckets);
        let inter_token: HistogramFamily = Family::new_with_constructor(token_buckets);
        let e2e: HistogramFamily = Family::new_with_constructor(e2e_buckets);
        let queue_time: HistogramFamily = Family::new_with_constructor(latency_buckets);
        let prompt_tokens: Family<Labels, Counter> = Family::default();
        let generation_tokens: Family<Labels, Counter> = Family::default();
        let lanes = std::iter::once(None)
            .chain(adapters.iter().map(Some))
            .map(|adapter| {
                let with = |mut l: Labels| {
                    if let Some(a) = adapter {
                        l.push((ADAPTER_LABEL, a.clone()));
                    }
                    l
                };
                let own = with(Vec::new());
                RequestMetrics {
                    requests: Outcome::ALL
                        .iter()
                        .map(|o| {
                            requests
                                .get_or_create(&with(vec![(OUTCOME_LABEL, o.as_str().to_owned())]))
                                .clone()
                        })
                        .collect(),
                    slo_met: slo_met.get_or_create(&own).clone(),
                    ttft: ttft.get_or_create(&own).clone(),
                    inter_token: inter_token.get_or_create(&own).clone(),
                    e2e: e2e.get_or_create(&own).clone(),
                    queue_time: queue_time.get_or_create(&own).clone(),
                    prompt_tokens: prompt_tokens.get_or_create(&own).clone(),
                    generation_tokens: generation_tokens.get_or_create(&own).clone(),
                }
            })
            .collect();
        let m = Self {
            lanes,
            running: Gauge::default(),
            waiting: Gauge::default(),
            kv_usage: Gauge::default(),
            context_blocks: Gauge::default(),
            prefix_queries: Counter::default(),
            prefix_hits: Counter::default(),
            registry: Registry::default(),
        };
        // Counter names are given without `_total`: the encoder appends it.
        let r = &mut registry;
        r.register(
            REQUESTS,
            "Requests by how they ended (counted once, at the end)",
            requests,
        );
        r.register(
            REQUESTS_SLO_MET,
            "Successful requests whose TTFT and TPOT met --slo-ttft-ms and --slo-tpot-ms",
            slo_met,
        );
        r.register(
            names::TTFT,
            "Request arrival to its first generated token",
            ttft,
        );
        r.register(
            names::INTER_TOKEN,
            "Time between consecutive generated tokens of a request",
            inter_token,
        );
        r.register(
            names::E2E,
            "Request arrival to its last token, successful requests",
            e2e,
        );
        r.register(
            names::QUEUE_TIME,
            "Time a request waited in the engine's queue before its first step",
            queue_time,
        );
        r.register(
            names::RUNNING,
            "Requests running (holding KV blocks)",
            m.running.clone(),
        );
        r.register(
            names::WAITING,
            "Requests waiting in the engine's queue (the inference gateway's queue size)",
            m.waiting.clone(),
        );
        r.register(
            names::KV_USAGE,
            "Fraction of KV-cache blocks in use, 0..1 (the inference gateway's KV utilisation)",
            m.kv_usage.clone(),
        );
        r.register(
            names::PROMPT_TOKENS,
            "Prompt tokens of admitted requests",
            prompt_tokens,
        );
        r.register(GENERATION_TOKENS, "Generated tokens", generation_tokens);
        r.register(
            names::PREFIX_QUERIES,
            "Prompt tokens looked up in the prefix cache",
            m.prefix_queries.clone(),
        );
        r.register(
            names::PREFIX_HITS,
            "Prompt tokens found in the prefix cache",
            m.prefix_hits.clone(),
        );
        Self { registry, ..m }
    }

    /// The per-request series of the base model (`None`) or of adapter `adapter`
    /// (its index in `--lora` order). An index past the adapters given at start-up
    /// (an engine bug: requests are checked against the runner's adapters first)
    /// lands in the base model's series rather than failing the request.
    #[must_use]
    pub fn of(&self, adapter: Option<u16>) -> &RequestMetrics {
        let lane = adapter.map_or(0, |a| usize::from(a) + 1);
        self.lanes.get(lane).unwrap_or(&self.lanes[0])
    }

    /// Counts a request that ended.
    pub fn request_ended(&self, adapter: Option<u16>, outcome: Outcome) {
        self.of(adapter).outcome(outcome).inc();
    }

    /// The count of one outcome so far, over every served name.
    #[must_use]
    pub fn requests(&self, outcome: Outcome) -> u64 {
        self.lanes.iter().map(|l| l.outcome(outcome).get()).sum()
    }

    /// Counts a successful request that met the SLO.
    pub fn slo_met(&self, adapter: Option<u16>) {
        self.of(adapter).slo_met.inc();
    }

    /// Successful requests that met the SLO so far, over every served name.
    #[must_use]
    pub fn slo_met_count(&self) -> u64 {
        self.lanes.iter().map(|l| l.slo_met.get()).sum()
    }

    /// OpenMetrics 1.0 text (prometheus-client's own format, ends with `# EOF`).
    #[must_use]
    pub fn openmetrics(&self) -> String {
        let mut s = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut s, &self.registry);
        s
    }

    /// Prometheus text format 0.0.4.
    #[must_use]
    pub fn prometheus_text(&self) -> String {
        openmetrics_to_prometheus_text(&self.openmetrics())
    }
}

/// Rewrites OpenMetrics text as Prometheus text 0.0.4: counter families take their
/// samples' `_total` name in `# HELP`/`# TYPE`, and `# UNIT`/`# EOF` (unknown to
/// 0.0.4) go. Samples are the same in both formats.
#[must_use]
pub fn openmetrics_to_prometheus_text(om: &str) -> String {
    let counters: HashSet<&str> = om
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|r| r.split_once(' '))
        .filter(|(_, kind)| *kind == "counter")
        .map(|(name, _)| name)
        .collect();
    let mut out = String::with_capacity(om.len() + 64);
    for line in om.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|p| {
            let rest = line.strip_prefix(p)?;
            let (name, tail) = rest.split_once(' ')?;
            counters
                .contains(name)
                .then(|| format!("{p}{name}_total {tail}"))
        });
        match renamed {
            Some(l) => out.push_str(&l),
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_has_the_contract_names_and_labels() {
        let m = ServingMetrics::new("smol", "abc123");
        m.request_ended(None, Outcome::Ok);
        m.request_ended(None, Outcome::Rejected503);
        m.slo_met(None);
        m.of(None).ttft.observe(0.2);
        m.kv_usage.set(0.25);
        m.prefix_hits.inc_by(192);
        let text = m.prometheus_text();
        for name in [
            "slipway_requests_total",
            "slipway_requests_slo_met_total",
            "slipway_time_to_first_token_seconds_bucket",
            "slipway_inter_token_latency_seconds_count",
            "slipway_e2e_request_latency_seconds_sum",
            "slipway_request_queue_time_seconds_count",
            "slipway_num_requests_running",
            "slipway_num_requests_waiting",
            "slipway_kv_cache_usage_perc",
            "slipway_prompt_tokens_total",
            "slipway_generation_tokens_total",
            "slipway_prefix_cache_queries_total",
            "slipway_prefix_cache_hits_total",
        ] {
            assert!(text.contains(name), "{name} missing:\n{text}");
        }
        assert!(
            text.contains("# TYPE slipway_requests_total counter"),
            "{text}"
        );
        assert!(!text.contains("# EOF"));
        let ok = text
            .lines()
            .find(|l| l.starts_with("slipway_requests_total{") && l.contains("outcome=\"ok\""))
            .expect("ok series");
        assert!(ok.contains("model=\"smol\"") && ok.contains("release=\"abc123\""));
        assert!(ok.ends_with(" 1"), "{ok}");
        // Every outcome is exposed from the start.
        for o in Outcome::ALL {
            assert!(
                text.contains(&format!("outcome=\"{}\"", o.as_str())),
                "{o:?}"
            );
        }
        assert!(
            text.contains("slipway_kv_cache_usage_perc{model=\"smol\",release=\"abc123\"} 0.25"),
            "{text}"
        );
        assert!(m.openmetrics().ends_with("# EOF\n"));
        assert_eq!(m.requests(Outcome::Rejected503), 1);
        assert_eq!(m.slo_met_count(), 1);
    }

    #[test]
    fn adapter_series_carry_the_adapter_label_and_the_base_keeps_its_own() {
        let m = ServingMetrics::with_adapters("smol", "abc123", &["sql".into(), "chat".into()]);
        m.request_ended(None, Outcome::Ok);
        m.request_ended(Some(0), Outcome::Ok);
        m.request_ended(Some(0), Outcome::Ok);
        m.slo_met(Some(1));
        m.of(Some(1)).generation_tokens.inc_by(5);
        let text = m.prometheus_text();
        let value = |series: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
                .unwrap_or_else(|| panic!("{series} missing:\n{text}"))
                .to_owned()
        };
        // The base model's series are unchanged by adapters being served.
        assert_eq!(
            value(r#"slipway_requests_total{model="smol",release="abc123",outcome="ok"}"#),
            "1"
        );
        assert_eq!(
            value(
                r#"slipway_requests_total{model="smol",release="abc123",outcome="ok",adapter="sql"}"#
            ),
            "2"
        );
        // Every outcome of every served name exists from the start.
        assert_eq!(
            value(
                r#"slipway_requests_total{model="smol",release="abc123",outcome="error",adapter="chat"}"#
            ),
            "0"
        );
        assert_eq!(
            value(
                r#"slipway_requests_slo_met_total{model="smol",release="abc123",adapter="chat"}"#
            ),
            "1"
        );
        assert_eq!(
            value(
                r#"slipway_generation_tokens_total{model="smol",release="abc123",adapter="chat"}"#
            ),
            "5"
        );
        assert!(
            text.contains(r#"slipway_time_to_first_token_seconds_count{model="smol",release="abc123",adapter="sql"} 0"#),
            "{text}"
        );
        // Engine-wide series carry no adapter.
        assert!(
            !text
                .lines()
                .any(|l| l.starts_with("slipway_kv_cache_usage_perc{") && l.contains("adapter"))
        );
        assert_eq!(m.requests(Outcome::Ok), 3);
        assert_eq!(m.slo_met_count(), 1);
        // An index past the adapters counts as the base model's.
        m.request_ended(Some(7), Outcome::Error);
        assert_eq!(m.of(None).outcome(Outcome::Error).get(), 1);
    }

    #[test]
    fn only_counter_families_are_renamed() {
        let om = "# HELP a_b Some.\n# TYPE a_b counter\na_b_total 1\n# HELP g G.\n# TYPE g gauge\ng 2\n# EOF\n";
        assert_eq!(
            openmetrics_to_prometheus_text(om),
            "# HELP a_b_total Some.\n# TYPE a_b_total counter\na_b_total 1\n# HELP g G.\n# TYPE g gauge\ng 2\n"
        );
    }
}
