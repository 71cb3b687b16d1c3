//! The engine's metric names and labels that the operator (rollout analysis) and
//! Prometheus queries read. The engine registers its families under these names; the
//! operator parses scrapes and writes PromQL with them. The SLO-met rule the
//! counters apply ([`SloTargets`], [`time_per_output_token`]) is defined here too.

use std::time::Duration;

/// Counter family of requests by how they ended (exposed as `slipway_requests_total`).
pub const REQUESTS: &str = "slipway_requests";
/// Counter family of successful requests that met the SLO's TTFT and TPOT targets
/// (exposed as `slipway_requests_slo_met_total`).
pub const REQUESTS_SLO_MET: &str = "slipway_requests_slo_met";

/// Counter of generated (output) tokens (exposed as `slipway_generation_tokens_total`):
/// measured demand in tokens per second reads it.
pub const GENERATION_TOKENS: &str = "slipway_generation_tokens";

/// Histogram: request arrival to its first generated token (TTFT).
pub const TTFT: &str = "slipway_time_to_first_token_seconds";
/// Histogram: time between consecutive generated tokens of a request.
pub const INTER_TOKEN: &str = "slipway_inter_token_latency_seconds";
/// Histogram: request arrival to its last token, successful requests.
pub const E2E: &str = "slipway_e2e_request_latency_seconds";
/// Histogram: time a request waited in the engine's queue before its first step.
pub const QUEUE_TIME: &str = "slipway_request_queue_time_seconds";
/// Gauge: requests running (holding KV blocks).
pub const RUNNING: &str = "slipway_num_requests_running";
/// Gauge: requests waiting in the engine's queue (the Gateway API Inference
/// Extension's queue-size metric).
pub const WAITING: &str = "slipway_num_requests_waiting";
/// Gauge: fraction of KV-cache blocks in use, 0..1 (the Inference Extension's KV
/// utilisation metric).
pub const KV_USAGE: &str = "slipway_kv_cache_usage_perc";
/// Counter family: prompt tokens of admitted requests.
pub const PROMPT_TOKENS: &str = "slipway_prompt_tokens";
/// Counter family: prompt tokens looked up in the prefix cache.
pub const PREFIX_QUERIES: &str = "slipway_prefix_cache_queries";
/// Counter family: of those, tokens found.
pub const PREFIX_HITS: &str = "slipway_prefix_cache_hits";

/// Label: the release bundle's short hash (`serve --release`).
pub const RELEASE_LABEL: &str = "release";
/// Label: the served model name (`serve --served-model-name`).
pub const MODEL_LABEL: &str = "model";
/// Label of [`REQUESTS`]: an [`Outcome`].
pub const OUTCOME_LABEL: &str = "outcome";
/// Label of the engine's per-request families (requests, SLO met, latencies, tokens)
/// for a request to a LoRA adapter: the adapter's served name (`serve --lora
/// NAME=...`). The base model's series have no such label (PromQL: `adapter=""`),
/// so a reader that ignores it sums every served name of a release.
pub const ADAPTER_LABEL: &str = "adapter";

/// The SLO's per-request latency targets (the CRD's `slo.ttft` and `slo.tpot`,
/// `--slo-ttft-ms` and `--slo-tpot-ms` of the engine and the router): what
/// [`REQUESTS_SLO_MET`] and [`router::REQUESTS_SLO_MET`] count against, and what the
/// load generator judges its records by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SloTargets {
    /// Time to first token.
    pub ttft: Duration,
    /// Time per output token after the first ([`time_per_output_token`]).
    pub tpot: Duration,
}

impl Default for SloTargets {
    /// The CRD's defaults: TTFT 2 s, TPOT 150 ms.
    fn default() -> Self {
        Self {
            ttft: Duration::from_secs(2),
            tpot: Duration::from_millis(150),
        }
    }
}

impl SloTargets {
    /// Whether a successful request met both targets, given its TTFT (`None`: no
    /// first token), its end-to-end latency and its output tokens.
    #[must_use]
    pub fn met(&self, ttft: Option<Duration>, e2e: Duration, output_tokens: u64) -> bool {
        ttft.is_some_and(|ttft| {
            let ttft = ttft.as_secs_f64();
            self.met_seconds(
                Some(ttft),
                time_per_output_token(ttft, e2e.as_secs_f64(), output_tokens),
            )
        })
    }

    /// Whether a successful request met both targets, from its TTFT and TPOT in
    /// seconds: TTFT within its target (a request without a first token has no TTFT
    /// and does not meet it), and TPOT within its own (one without a TPOT, a single
    /// output token, meets it trivially).
    #[must_use]
    pub fn met_seconds(&self, ttft_s: Option<f64>, tpot_s: Option<f64>) -> bool {
        ttft_s.is_some_and(|t| t <= self.ttft.as_secs_f64())
            && tpot_s.is_none_or(|t| t <= self.tpot.as_secs_f64())
    }
}

/// Time per output token (TPOT), seconds: (E2E − TTFT) / (output tokens − 1), the gap
/// between tokens after the first; `None` under two output tokens, where there is no
/// gap. The one definition the engine's and the router's SLO counters, the router's
/// TPOT histogram and the load generator's reports use.
#[must_use]
pub fn time_per_output_token(ttft_s: f64, e2e_s: f64, output_tokens: u64) -> Option<f64> {
    (output_tokens >= 2).then(|| (e2e_s - ttft_s).max(0.0) / (output_tokens - 1) as f64)
}

/// The sample name of a counter family in the text format.
#[must_use]
pub fn counter_total(family: &str) -> String {
    format!("{family}_total")
}

/// How a request ended, the `outcome` label of [`REQUESTS`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Completed (EOS, stop string or length).
    Ok,
    /// Refused: the tenant is over its token rate.
    Rejected429,
    /// Refused: overloaded, draining, or could not start before its deadline.
    Rejected503,
    /// The client cancelled or went away.
    Cancelled,
    /// The server failed it (engine error, shutdown timeout, injected fault).
    Error,
}

impl Outcome {
    /// Every outcome, in label order.
    pub const ALL: [Self; 5] = [
        Self::Ok,
        Self::Rejected429,
        Self::Rejected503,
        Self::Cancelled,
        Self::Error,
    ];

    /// The `outcome` label value.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Rejected429 => "rejected_429",
            Self::Rejected503 => "rejected_503",
            Self::Cancelled => "cancelled",
            Self::Error => "error",
        }
    }

    /// Whether the engine refused the request before running it. A refused request is
    /// still demand: the operator sizes capacity for it.
    #[must_use]
    pub fn is_rejection(self) -> bool {
        matches!(self, Self::Rejected429 | Self::Rejected503)
    }

    /// Whether the request counts against the SLO's availability: the server either
    /// served it or failed it. A tenant over its own rate (429) and a client that went
    /// away are not the server's doing.
    #[must_use]
    pub fn is_slo_eligible(self) -> bool {
        matches!(self, Self::Ok | Self::Error | Self::Rejected503)
    }

    /// The PromQL regex (`ok|rejected_503|error`) that matches the [`OUTCOME_LABEL`] of
    /// the outcomes `keep` accepts, in label order.
    #[must_use]
    pub fn regex(keep: impl Fn(Self) -> bool) -> String {
        Self::ALL
            .into_iter()
            .filter(|&o| keep(o))
            .map(Self::as_str)
            .collect::<Vec<_>>()
            .join("|")
    }
}

/// The router's metric families (`slipway-router`'s `/metrics`), measured at the
/// gateway: the client-side boundary, queueing and the network included. Every family
/// carries [`RELEASE_LABEL`]; the rollout's `Router` metrics source reads
/// [`router::REQUESTS`] and [`router::REQUESTS_SLO_MET`] as it reads the engine's.
pub mod router {
    /// Counter family of requests by release and [`super::Outcome`].
    pub const REQUESTS: &str = "slipway_router_requests";
    /// Counter family of successful requests that met the InferenceService's TTFT and
    /// TPOT targets, by release.
    pub const REQUESTS_SLO_MET: &str = "slipway_router_requests_slo_met";
    /// Histogram: request arrival at the router to the first token relayed.
    pub const TTFT: &str = "slipway_router_time_to_first_token_seconds";
    /// Histogram: (E2E − TTFT) / (output tokens − 1), streams of two tokens or more.
    pub const TPOT: &str = "slipway_router_time_per_output_token_seconds";
    /// Histogram: request arrival to the last byte relayed, successful requests.
    pub const E2E: &str = "slipway_router_e2e_request_latency_seconds";
    /// Counter family of endpoint choices, by release and policy.
    pub const DECISIONS: &str = "slipway_router_decisions";
    /// Counter family: prompt tokens the router predicted to be cached where it sent
    /// them (from its prefix index).
    pub const PREDICTED_CACHED_TOKENS: &str = "slipway_router_predicted_cached_tokens";
    /// Counter family: prompt tokens the engines reported as cached
    /// (`usage.prompt_tokens_details.cached_tokens`).
    pub const CACHED_TOKENS: &str = "slipway_router_cached_tokens";
    /// Counter family: prompt tokens of routed requests, as the engines reported them.
    pub const PROMPT_TOKENS: &str = "slipway_router_prompt_tokens";
    /// Counter family of requests by how the prediction compared with the engine's
    /// report (`result`: matched within one KV block, over, under).
    pub const PREFIX_PREDICTIONS: &str = "slipway_router_prefix_predictions";
    /// Counter family of retries, by release and reason.
    pub const RETRIES: &str = "slipway_router_retries";
    /// Counter family of endpoints left out of a choice, by release and reason.
    pub const EXCLUDED: &str = "slipway_router_endpoints_excluded";
    /// Gauge family: endpoints known, by release and state (`eligible`, ...).
    pub const ENDPOINTS: &str = "slipway_router_endpoints";
    /// Gauge family: requests in flight through the router, by release.
    pub const IN_FLIGHT: &str = "slipway_router_requests_in_flight";

    /// Label of [`RETRIES`] and [`EXCLUDED`]: why.
    pub const REASON_LABEL: &str = "reason";
    /// Label of [`PREFIX_PREDICTIONS`].
    pub const RESULT_LABEL: &str = "result";
    /// Label of [`DECISIONS`]: the `--policy` that decided.
    pub const POLICY_LABEL: &str = "policy";
}
