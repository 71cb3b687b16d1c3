//! The contract between the Slipway operator and the engine it runs: everything that
//! crosses the pod boundary as a command line, a port, an HTTP path, an exit code or a
//! metric name. The operator's own command line ([`OperatorArgs`]) is here too: its
//! Deployment and the tests that start it are its callers.
//!
//! Both sides use these types: the engine's `main` parses its `serve` and `fetch`
//! subcommands with [`EngineCommand`], and the operator builds every container's
//! arguments from the same value with [`EngineCommand::to_args`]. A flag therefore
//! cannot exist on one side only, and `parse(to_args(x)) == x` is tested for every
//! field.
//!
//! Why a crate of its own rather than `ServeArgs` in the engine crate or in
//! `slipway-api`: the operator must not link the engine (its kernels, the CUDA
//! backend, the model loader) to learn its flags, and the API crate stays free of a
//! command-line parser (it is the CRD's types only). This crate depends on `clap`
//! and `hex`, nothing else.
//!
//! Units: every duration on the command line is whole milliseconds (flags end in
//! `-ms`) and goes through [`units::parse_millis`]; the user's `1m30s` style stays in
//! the CRD and is converted by the operator. The one exception is the operator's lease
//! timings, whole seconds as its Deployment has always passed them
//! ([`units::parse_seconds`]). Sizes take binary or decimal suffixes
//! ([`units::parse_size`]).

pub mod backoff;
pub mod fetch;
pub mod group;
pub mod labels;
pub mod lora;
pub mod metrics;
pub mod operator;
pub mod router;
pub mod serve;
pub mod telemetry;
pub mod units;

pub use backoff::Backoff;
pub use fetch::{FetchArgs, InvalidSha256, Sha256Digest};
pub use group::{GROUP_PORT, GROUP_PORT_NAME, GroupArgs, GroupArgsError, HostPort};
pub use lora::{LoraAdapter, LoraModule, NamedSha256};
pub use operator::OperatorArgs;
pub use router::{LoadReport, RoutePolicy, RouterArgs};
#[cfg(feature = "fault-injection")]
pub use serve::FaultArgs;
pub use serve::{DeviceChoice, ServeArgs};
pub use telemetry::{LogArgs, LogFormat, TelemetryArgs};

/// The port the engine serves HTTP on inside a pod (`serve --port`).
pub const ENGINE_PORT: u16 = 8000;

/// HTTP paths the kubelet and the operator use.
pub mod paths {
    /// Alive (the process answers): the liveness probe.
    pub const HEALTH: &str = "/health";
    /// Loaded, warm and not draining: the startup and readiness probes.
    pub const READY: &str = "/ready";
    /// Prometheus text (OpenMetrics on `Accept`): the operator's scrape.
    pub const METRICS: &str = "/metrics";
    /// The engine's load as JSON ([`crate::LoadReport`]): the router's endpoint choice.
    pub const LOAD: &str = "/load";
}

/// The readiness line: what a Slipway server prints on stdout, once, when it serves.
///
/// `slipway-engine serve` prints `listening on http://HOST:PORT` after its model is
/// loaded and its port bound, so requests are answered from then on; `slipway-router`
/// prints it once its port is bound. With `--port 0` the line is the only way to
/// learn the port, which makes it an interface, not a log line: nothing else goes to
/// a server's stdout (logs go to stderr), and this module is its one definition.
/// Readers: the tests (`slipway_engine::testing::EngineProcess`) and the scripts
/// (`scripts/wait-listening`, which matches the same prefix).
pub mod listening {
    use std::net::SocketAddr;

    /// What the line starts with; the rest is the server's base URL.
    pub const PREFIX: &str = "listening on ";

    /// The line for a server bound to `address`.
    #[must_use]
    pub fn line(address: SocketAddr) -> String {
        format!("{PREFIX}http://{address}")
    }

    /// The base URL (`http://HOST:PORT`) in `line`, if it is the readiness line.
    #[must_use]
    pub fn url(line: &str) -> Option<&str> {
        line.strip_prefix(PREFIX).map(str::trim)
    }
}

/// Exit codes of `slipway-engine`, for reasons the operator reports by name.
pub mod exit {
    /// Any other failure (bad flag values, a model that cannot load, an address in use).
    pub const FAILURE: i32 = 1;
    /// The model file failed verification (`--model-sha256` or `fetch --sha256`
    /// mismatch): restarting the pod cannot help until the release changes.
    pub const MODEL_REJECTED: i32 = 3;
    /// clap's own code for a command line it cannot parse.
    pub const USAGE: i32 = 2;
}

/// The engine subcommands a pod runs: `serve` (the engine container) and `fetch` (the
/// init container staging a model). The engine's CLI flattens this enum into its own,
/// so these are parsed by exactly this type.
// One value per process or rendered container: boxing `Serve` to shrink it would buy
// nothing and cost clap's derive a wrapper.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, clap::Subcommand)]
pub enum EngineCommand {
    /// Serve the model over an OpenAI-compatible HTTP API (continuous batching,
    /// prefix cache, SSE streaming); drains on SIGTERM.
    Serve(ServeArgs),
    /// Download a model file from an http(s) URL into --dest, verified by its sha256:
    /// resumable, retried with backoff, bounded by timeouts (the operator's init
    /// container).
    Fetch(FetchArgs),
}

impl EngineCommand {
    /// The container `args` that run this command: the subcommand, then its flags.
    #[must_use]
    pub fn to_args(&self) -> Vec<String> {
        match self {
            Self::Serve(args) => std::iter::once("serve".to_owned())
                .chain(args.to_args())
                .collect(),
            Self::Fetch(args) => std::iter::once("fetch".to_owned())
                .chain(args.to_args())
                .collect(),
        }
    }

    /// Parses container `args` (without the program name) as the engine would.
    ///
    /// # Errors
    /// clap's error, as the engine would print it.
    pub fn parse_args<I, S>(args: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = S>,
        S: Into<std::ffi::OsString> + Clone,
    {
        let argv = std::iter::once(std::ffi::OsString::from("slipway-engine"))
            .chain(args.into_iter().map(Into::into));
        <Pod as clap::Parser>::try_parse_from(argv).map(|pod| pod.command)
    }
}

/// Parses `args` (without the program name) with the flags of `T` alone, as the
/// program `program` parses them: environment variables included, and clap's error
/// (which names `program`) for an unknown flag or a bad value. The one parse of
/// [`OperatorArgs::parse_args`], [`RouterArgs`] and [`ServeArgs::with_extra_args`].
pub(crate) fn parse_flags<T, I, S>(program: &'static str, args: I) -> Result<T, clap::Error>
where
    T: clap::Args + clap::FromArgMatches,
    I: IntoIterator<Item = S>,
    S: Into<std::ffi::OsString> + Clone,
{
    let mut cmd = T::augment_args(clap::Command::new(program));
    let argv =
        std::iter::once(std::ffi::OsString::from(program)).chain(args.into_iter().map(Into::into));
    let matches = cmd.try_get_matches_from_mut(argv)?;
    T::from_arg_matches(&matches)
}

/// A parser holding only the pod subcommands (the engine binary has more).
#[derive(Debug, clap::Parser)]
#[command(name = "slipway-engine")]
struct Pod {
    #[command(subcommand)]
    command: EngineCommand,
}

#[cfg(test)]
mod tests;
