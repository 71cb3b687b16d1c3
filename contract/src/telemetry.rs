//! Logs and traces: the flags every Slipway process takes for them.
//!
//! The operator renders `--log-format=json` and its own `--otlp-endpoint` into every
//! engine container from these types, and the engine (and the operator itself) parse
//! them with the same types, so a pod's log and trace settings cannot drift from
//! what the parser accepts.

use clap::{Args, ValueEnum};

use crate::units::parse_fraction;

/// How log lines are written (`--log-format`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event; colours only on a terminal.
    Text,
    /// One JSON object per line, with the fields of every enclosing span (request id,
    /// trace id): what log collectors read. Never colours.
    Json,
}

impl LogFormat {
    /// The flag value.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Text => "text",
            Self::Json => "json",
        }
    }

    /// The format to use: the one asked for, else text on a terminal and JSON
    /// everywhere else (a pod's log, a file, a pipe), so `kubectl logs` never sees
    /// escape codes.
    #[must_use]
    pub fn resolve(asked: Option<Self>, log_stream_is_terminal: bool) -> Self {
        asked.unwrap_or(if log_stream_is_terminal {
            Self::Text
        } else {
            Self::Json
        })
    }
}

impl std::fmt::Display for LogFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `--log-format`, alone: for commands that export no traces (`fetch`, the operator).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Args)]
pub struct LogArgs {
    /// Log line format [default: text on a terminal, json otherwise].
    #[arg(long, value_enum, env = "SLIPWAY_LOG_FORMAT", value_name = "FORMAT")]
    pub log_format: Option<LogFormat>,
}

impl LogArgs {
    /// The flags that reproduce `self` when parsed.
    #[must_use]
    pub fn to_args(&self) -> Vec<String> {
        let Self { log_format } = self;
        log_format
            .map(|f| format!("--log-format={f}"))
            .into_iter()
            .collect()
    }
}

/// Logs and request traces of a serving process (`serve`, later the router).
#[derive(Debug, Clone, PartialEq, Args)]
pub struct TelemetryArgs {
    #[command(flatten)]
    pub logs: LogArgs,
    /// OTLP/HTTP endpoint to export request traces to, as a base URL such as
    /// http://collector:4318 (spans go to URL/v1/traces). Unset: no traces are
    /// recorded or sent, at no cost. Prompts and outputs are never in a span.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT", value_name = "URL", value_parser = parse_http_url)]
    pub otlp_endpoint: Option<String>,
    /// Fraction of requests to trace when the caller sent no sampling decision; a
    /// W3C `traceparent` header's sampled flag is always obeyed.
    #[arg(long, value_name = "FRACTION", default_value_t = 1.0, value_parser = parse_fraction)]
    pub trace_sample_ratio: f64,
}

impl Default for TelemetryArgs {
    fn default() -> Self {
        Self {
            logs: LogArgs::default(),
            otlp_endpoint: None,
            trace_sample_ratio: 1.0,
        }
    }
}

impl TelemetryArgs {
    /// The flags that reproduce `self` when parsed.
    #[must_use]
    pub fn to_args(&self) -> Vec<String> {
        let Self {
            logs,
            otlp_endpoint,
            trace_sample_ratio,
        } = self;
        let mut out = logs.to_args();
        if let Some(url) = otlp_endpoint {
            out.push(format!("--otlp-endpoint={url}"));
        }
        out.push(format!("--trace-sample-ratio={trace_sample_ratio}"));
        out
    }
}

/// An http:// or https:// URL with a host (the OTLP exporter's endpoint).
///
/// # Errors
/// A message naming what is wrong.
pub fn parse_http_url(s: &str) -> Result<String, String> {
    let rest = s
        .strip_prefix("http://")
        .or_else(|| s.strip_prefix("https://"))
        .ok_or_else(|| format!("`{s}` is not an http:// or https:// URL"))?;
    if rest.is_empty() || rest.starts_with('/') {
        return Err(format!("`{s}` has no host"));
    }
    Ok(s.to_owned())
}
