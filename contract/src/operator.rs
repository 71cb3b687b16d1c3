//! `slipway-operator`: the operator's own command line.
//!
//! The operator's `main` parses its command line with [`OperatorArgs`]. What starts an
//! operator builds one: the tests that run it as a host process build an
//! [`OperatorArgs`] and pass [`OperatorArgs::to_args`], and the tests of the Helm chart
//! and of `manifests/operator/deployment.yaml` (which cannot use a Rust type) parse the
//! Deployment's `args` with [`OperatorArgs::parse_args`], so a flag renamed or dropped
//! here fails them rather than a pod.
//!
//! The flag names and defaults are the ones the chart and the manifests have always
//! passed. Two differ from this crate's conventions and stay so for them: the lease
//! timings are whole seconds (`-seconds`, [`units::parse_seconds`]), not milliseconds,
//! and a flag given twice is an error rather than the later one winning (nothing merges
//! a user's fragment into the operator's command line).
//!
//! Several flags also read an environment variable when the flag is absent; the
//! Deployment sets `POD_NAME` and `POD_NAMESPACE` from the pod's own metadata, so
//! `--identity` and `--lease-namespace` are normally not on its command line.
//!
//! [`units::parse_seconds`]: crate::units::parse_seconds

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::time::Duration;

use clap::Args;

use crate::telemetry::{LogArgs, parse_http_url};
use crate::units::{format_seconds, parse_seconds};

/// Where the operator serves `/metrics` and `/healthz` when not told
/// (`--metrics-addr`): loopback, so a laptop run exposes nothing; the Deployment passes
/// `0.0.0.0:8080` for the kubelet's probes and the metrics Service.
pub const DEFAULT_METRICS_ADDR: SocketAddr =
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 8080));

/// The namespace of the leader-election Lease when neither `--lease-namespace` nor
/// `POD_NAMESPACE` says: the one `manifests/` installs into.
pub const DEFAULT_LEASE_NAMESPACE: &str = "slipway-system";

/// The name of the leader-election Lease (`--lease-name`).
pub const DEFAULT_LEASE_NAME: &str = "slipway-operator";

/// How long a Lease stays valid without renewal (`--lease-duration-seconds`).
pub const DEFAULT_LEASE_DURATION: Duration = Duration::from_secs(15);

/// Time between renewals and acquisition attempts (`--lease-retry-seconds`).
pub const DEFAULT_LEASE_RETRY: Duration = Duration::from_secs(2);

/// The router image when the operator is given none (`--router-image`): named as the
/// operator's and the engine's images are in `manifests/`.
pub const DEFAULT_ROUTER_IMAGE: &str = "ghcr.io/slipway-dev/slipway-router:0.1.0";

/// `slipway-operator` options.
#[derive(Debug, Clone, PartialEq, Eq, Args)]
#[command(after_help = "Leader election: every replica competes for one Lease \
(--lease-namespace/--lease-name); only its holder reconciles. The holder renews it every \
--lease-retry-seconds; when it stops renewing, another replica takes over once \
--lease-duration-seconds have passed.\n\
Shutdown: SIGTERM (or Ctrl-C) lets in-flight reconciles finish, releases the Lease and \
exits 0. A replica that loses the Lease exits with an error, to be restarted as a \
candidate.")]
pub struct OperatorArgs {
    /// Address of the /metrics and /healthz listener (port 0: any free port).
    #[arg(long, env = "SLIPWAY_METRICS_ADDR", value_name = "ADDR", default_value_t = DEFAULT_METRICS_ADDR)]
    pub metrics_addr: SocketAddr,
    /// Namespace of the leader-election Lease (in a pod: its own, from POD_NAMESPACE).
    #[arg(long, env = "POD_NAMESPACE", value_name = "NAMESPACE", default_value = DEFAULT_LEASE_NAMESPACE)]
    pub lease_namespace: String,
    /// Name of the leader-election Lease. Replicas with the same Lease take turns;
    /// operators with different ones act at once.
    #[arg(long, value_name = "NAME", default_value = DEFAULT_LEASE_NAME)]
    pub lease_name: String,
    /// This replica's identity in the Lease [default: the pod's name from POD_NAME, else
    /// HOSTNAME-PID].
    #[arg(long, env = "POD_NAME", value_name = "NAME")]
    pub identity: Option<String>,
    /// Watch only InferenceServices in this namespace [default: all namespaces].
    #[arg(long, env = "SLIPWAY_WATCH_NAMESPACE", value_name = "NAMESPACE")]
    pub namespace: Option<String>,
    /// Seconds a Lease stays valid without renewal: how long the other replicas wait
    /// for a leader that stopped renewing.
    #[arg(long = "lease-duration-seconds", value_name = "SECONDS", default_value = "15", value_parser = parse_seconds)]
    pub lease_duration: Duration,
    /// Seconds between renewals of a held Lease and between attempts to acquire one.
    #[arg(long = "lease-retry-seconds", value_name = "SECONDS", default_value = "2", value_parser = parse_seconds)]
    pub lease_retry: Duration,
    /// Log line format.
    #[command(flatten)]
    pub logs: LogArgs,
    /// OTLP/HTTP collector (base URL, e.g. http://collector:4318) that the engine
    /// pods this operator renders export request traces to. Unset: engines export
    /// none. One InferenceService can still choose its own in `release.engine.args`.
    #[arg(long, value_name = "URL", value_parser = parse_http_url)]
    pub otlp_endpoint: Option<String>,
    /// The image of the router pods put in front of each InferenceService's engines.
    #[arg(long, env = "SLIPWAY_ROUTER_IMAGE", value_name = "IMAGE", default_value = DEFAULT_ROUTER_IMAGE)]
    pub router_image: String,
}

/// The parser's defaults, as if no flag and no environment variable were given.
impl Default for OperatorArgs {
    fn default() -> Self {
        Self {
            metrics_addr: DEFAULT_METRICS_ADDR,
            lease_namespace: DEFAULT_LEASE_NAMESPACE.to_owned(),
            lease_name: DEFAULT_LEASE_NAME.to_owned(),
            identity: None,
            namespace: None,
            lease_duration: DEFAULT_LEASE_DURATION,
            lease_retry: DEFAULT_LEASE_RETRY,
            logs: LogArgs::default(),
            otlp_endpoint: None,
            router_image: DEFAULT_ROUTER_IMAGE.to_owned(),
        }
    }
}

impl OperatorArgs {
    /// Parses a command line (without the program name) as `slipway-operator` would,
    /// environment variables included.
    ///
    /// # Errors
    /// clap's error, as the operator would print it: an unknown flag, a bad value, a
    /// flag given twice.
    pub fn parse_args<I, S>(args: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = S>,
        S: Into<std::ffi::OsString> + Clone,
    {
        crate::parse_flags("slipway-operator", args)
    }

    /// The flags that reproduce `self` when parsed. Unset options stay out (so the
    /// environment can still fill them, as it fills `--identity` in a pod); everything
    /// else is written, so no environment variable overrides it.
    #[must_use]
    pub fn to_args(&self) -> Vec<String> {
        // Destructured without `..`: a field that is not written here fails to compile.
        let Self {
            metrics_addr,
            lease_namespace,
            lease_name,
            identity,
            namespace,
            lease_duration,
            lease_retry,
            logs,
            otlp_endpoint,
            router_image,
        } = self;
        let mut out = Vec::new();
        // `--flag=value`: a value starting with '-' is never taken for a flag.
        let mut flag = |name: &str, value: String| out.push(format!("--{name}={value}"));
        flag("metrics-addr", metrics_addr.to_string());
        flag("lease-namespace", lease_namespace.clone());
        flag("lease-name", lease_name.clone());
        if let Some(identity) = identity {
            flag("identity", identity.clone());
        }
        if let Some(namespace) = namespace {
            flag("namespace", namespace.clone());
        }
        flag("lease-duration-seconds", format_seconds(*lease_duration));
        flag("lease-retry-seconds", format_seconds(*lease_retry));
        if let Some(url) = otlp_endpoint {
            flag("otlp-endpoint", url.clone());
        }
        flag("router-image", router_image.clone());
        out.extend(logs.to_args());
        out
    }
}
