//! `slipway-router`: the traffic layer's command line, and the engine's load report it
//! reads.
//!
//! The operator renders the router Deployment's arguments from [`RouterArgs`] and the
//! router parses its command line with the same type, as with the engine's
//! [`crate::ServeArgs`]. [`LoadReport`] is the JSON body of the engine's
//! [`crate::paths::LOAD`]: the engine serialises it, the router deserialises it.

use std::net::IpAddr;
use std::time::Duration;

use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};

use crate::telemetry::{TelemetryArgs, parse_http_url};
use crate::units::{format_millis, parse_millis};

/// The port the router serves HTTP on inside a pod (`--port`).
pub const ROUTER_PORT: u16 = 8080;

/// The header that pins a conversation to one release and, within it, to the endpoint
/// holding its prefix (`--session-header`).
pub const DEFAULT_SESSION_HEADER: &str = "x-session-id";

/// How the router picks an endpoint within a release (`--policy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, ValueEnum)]
pub enum RoutePolicy {
    /// The lowest `prefill_load_scale × uncached prompt blocks + decode blocks in use`
    /// among the endpoints that pass the hard filters.
    #[default]
    Cost,
    /// The fewest requests the router has in flight (the peer the cost policy falls
    /// back to when its load view is stale).
    LeastInFlight,
    /// In turn, as a Kubernetes Service spreads connections: the benchmark's baseline.
    RoundRobin,
}

impl RoutePolicy {
    /// The flag value, also the `policy` label of the router's decision metric.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Cost => "cost",
            Self::LeastInFlight => "least-in-flight",
            Self::RoundRobin => "round-robin",
        }
    }
}

impl std::fmt::Display for RoutePolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `slipway-router` options.
#[derive(Debug, Clone, PartialEq, Args)]
#[command(args_override_self = true)]
#[command(group = clap::ArgGroup::new("endpoints").required(true).args(["inference_service", "stable"]))]
#[command(
    after_help = "Endpoints come from Kubernetes (--inference-service: the object's stable and \
canary release, the canary's request weight and the SLO, and the EndpointSlices of its \
per-release Services) or from the command line (--stable, --canary, --canary-weight).\n\
Retries: before the first byte reaches the client, a connection failure, 503 or 429 is \
retried on the next-best endpoint of the same release; after it, never (the stream ends \
with an SSE error event).\n\
Drain: SIGTERM turns /ready to 503, lets streams in flight finish within \
--shutdown-timeout-ms, then exits 0."
)]
pub struct RouterArgs {
    /// Address to listen on (the operator passes 0.0.0.0 in a pod).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// TCP port to listen on (0: any free port, printed at start).
    #[arg(long, default_value_t = ROUTER_PORT)]
    pub port: u16,
    /// The InferenceService whose traffic this router carries: its releases, canary
    /// weight and SLO are read from the API server.
    #[arg(long, value_name = "NAME", conflicts_with_all = ["stable", "canary", "canary_weight", "slo_ttft", "slo_tpot"])]
    pub inference_service: Option<String>,
    /// Namespace of --inference-service [default: the pod's own, from the service
    /// account].
    #[arg(
        long,
        env = "POD_NAMESPACE",
        value_name = "NAMESPACE",
        requires = "inference_service"
    )]
    pub namespace: Option<String>,
    /// Without Kubernetes: the stable release's engine base URLs (comma-separated or
    /// repeated), e.g. http://127.0.0.1:8000.
    #[arg(long, value_name = "URL", value_delimiter = ',', value_parser = parse_http_url)]
    pub stable: Vec<String>,
    /// Without Kubernetes: the canary release's engine base URLs.
    #[arg(long, value_name = "URL", value_delimiter = ',', value_parser = parse_http_url, requires = "stable")]
    pub canary: Vec<String>,
    /// Without Kubernetes: percent of requests (0..=100) sent to --canary.
    #[arg(long, value_name = "PERCENT", default_value_t = 0,
          value_parser = clap::value_parser!(u8).range(0..=100), requires = "canary")]
    pub canary_weight: u8,
    /// Without Kubernetes: the SLO's time-to-first-token target in ms, for the
    /// router's SLO-met counter.
    #[arg(long = "slo-ttft-ms", value_name = "MS", default_value = "2000", value_parser = parse_millis)]
    pub slo_ttft: Duration,
    /// Without Kubernetes: the SLO's time-per-output-token target in ms.
    #[arg(long = "slo-tpot-ms", value_name = "MS", default_value = "150", value_parser = parse_millis)]
    pub slo_tpot: Duration,
    /// How an endpoint is chosen within a release.
    #[arg(long, value_enum, default_value_t = RoutePolicy::Cost)]
    pub policy: RoutePolicy,
    /// Weight of one uncached prompt block against one decode block in use (Dynamo's
    /// `prefill_load_scale`). The default, 4, is the best of 1, 4 and 8 measured with
    /// `make bench-router` on the CPU engine (router/BENCHMARKS.md): at 1 a tenant's
    /// requests left the replica holding its prefix at the first imbalance and paid a
    /// cold prefill each time; at 8 a hot prefix stayed on one replica too long. At 4
    /// a request leaves its prefix only for a replica running about four fewer
    /// requests of the same length.
    #[arg(long, value_name = "SCALE", default_value_t = 4.0, value_parser = parse_non_negative)]
    pub prefill_load_scale: f64,
    /// An endpoint with this many requests waiting in its queue is saturated and gets
    /// nothing new until it drains below.
    #[arg(long, value_name = "N", default_value_t = 16)]
    pub saturation_waiting: usize,
    /// Characters of prompt text per block of the router's prefix index (about one
    /// engine KV block of 16 tokens).
    #[arg(long, value_name = "CHARS", default_value_t = 64,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub prefix_block_chars: u32,
    /// Request header whose value keeps a conversation on one release and endpoint.
    #[arg(long, value_name = "NAME", default_value = DEFAULT_SESSION_HEADER)]
    pub session_header: String,
    /// How often each endpoint's load report (GET /load) is read.
    #[arg(long = "load-interval-ms", value_name = "MS", default_value = "200", value_parser = parse_millis)]
    pub load_interval: Duration,
    /// A load report older than this is stale: the choice falls back to the fewest
    /// requests in flight.
    #[arg(long = "load-stale-ms", value_name = "MS", default_value = "2000", value_parser = parse_millis)]
    pub load_stale: Duration,
    /// Most retries of one request on other endpoints, before its first byte.
    #[arg(long, value_name = "N", default_value_t = 2)]
    pub max_retries: u32,
    /// Most time one request may spend on retries before the router gives up.
    #[arg(long = "retry-budget-ms", value_name = "MS", default_value = "5000", value_parser = parse_millis)]
    pub retry_budget: Duration,
    /// Ms streams in flight get to finish after SIGTERM.
    #[arg(long = "shutdown-timeout-ms", value_name = "MS", default_value = "30000", value_parser = parse_millis)]
    pub shutdown_timeout: Duration,
    /// Logs and request traces.
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
}

impl RouterArgs {
    /// The parser's defaults, for the router of one InferenceService.
    ///
    /// # Errors
    /// clap's error for a name clap cannot take (never for a Kubernetes name).
    pub fn for_inference_service(name: &str) -> Result<Self, clap::Error> {
        Self::parse_from([format!("--inference-service={name}")])
    }

    /// `self` with `extra` flags applied on top (a later flag overrides an earlier
    /// one), as the router reads `to_args(self)` followed by `extra`.
    ///
    /// # Errors
    /// clap's error for an unknown flag or a bad value in `extra`.
    pub fn with_extra_args<S: AsRef<str>>(&self, extra: &[S]) -> Result<Self, clap::Error> {
        let mut argv = self.to_args();
        argv.extend(extra.iter().map(|s| s.as_ref().to_owned()));
        Self::parse_from(argv)
    }

    pub(crate) fn parse_from(args: impl IntoIterator<Item = String>) -> Result<Self, clap::Error> {
        crate::parse_flags("slipway-router", args)
    }

    /// The flags that reproduce `self` when parsed.
    #[must_use]
    pub fn to_args(&self) -> Vec<String> {
        // Destructured without `..`: a field that is not written here fails to compile.
        let Self {
            host,
            port,
            inference_service,
            namespace,
            stable,
            canary,
            canary_weight,
            slo_ttft,
            slo_tpot,
            policy,
            prefill_load_scale,
            saturation_waiting,
            prefix_block_chars,
            session_header,
            load_interval,
            load_stale,
            max_retries,
            retry_budget,
            shutdown_timeout,
            telemetry,
        } = self;
        let mut out = Vec::new();
        let mut flag = |name: &str, value: String| out.push(format!("--{name}={value}"));
        flag("host", host.to_string());
        flag("port", port.to_string());
        if let Some(name) = inference_service {
            flag("inference-service", name.clone());
        }
        if let Some(ns) = namespace {
            flag("namespace", ns.clone());
        }
        for url in stable {
            flag("stable", url.clone());
        }
        for url in canary {
            flag("canary", url.clone());
        }
        // The static-mode flags conflict with --inference-service, so they are
        // written only where they may be given.
        if inference_service.is_none() {
            if !canary.is_empty() {
                flag("canary-weight", canary_weight.to_string());
            }
            flag("slo-ttft-ms", format_millis(*slo_ttft));
            flag("slo-tpot-ms", format_millis(*slo_tpot));
        }
        flag("policy", policy.to_string());
        flag("prefill-load-scale", prefill_load_scale.to_string());
        flag("saturation-waiting", saturation_waiting.to_string());
        flag("prefix-block-chars", prefix_block_chars.to_string());
        flag("session-header", session_header.clone());
        flag("load-interval-ms", format_millis(*load_interval));
        flag("load-stale-ms", format_millis(*load_stale));
        flag("max-retries", max_retries.to_string());
        flag("retry-budget-ms", format_millis(*retry_budget));
        flag("shutdown-timeout-ms", format_millis(*shutdown_timeout));
        out.extend(telemetry.to_args());
        out
    }
}

fn parse_non_negative(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!("`{s}` is not a non-negative number")),
    }
}

/// The engine's load, as `GET /load` answers it (JSON): what the router's endpoint
/// choice reads, cheaper to produce and parse than a whole Prometheus scrape.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadReport {
    /// The release bundle this engine serves (`serve --release`).
    pub release: String,
    /// The model names a request may name (the base model; adapters when served).
    pub models: Vec<String>,
    /// Requests running (holding KV blocks).
    pub running: usize,
    /// Requests waiting in the queue.
    pub waiting: usize,
    /// KV blocks the running requests' attention reads each decode step, counted per
    /// request: a prefix shared by n running requests counts n times. This is the
    /// decode load (every running request costs a forward pass per step, over its
    /// whole context); the memory held is the engine's exported KV usage.
    pub context_blocks: usize,
    /// KV blocks in the pool.
    pub kv_blocks_total: usize,
    /// Token positions per KV block.
    pub kv_block_size: usize,
    /// Draining: admits nothing new.
    pub draining: bool,
}
