//! Logs and request traces, set up once per process the same way in every Slipway
//! binary (engine, operator, and the router when it exists).
//!
//! - **Logs** go to stderr as text or JSON ([`LogFormat`], from the command line the
//!   operator renders). JSON lines carry the fields of every enclosing span, so a
//!   line logged inside a request's span carries its `request_id` and `trace_id`.
//!   `RUST_LOG` filters them.
//! - **Traces** are exported over OTLP/HTTP only when an endpoint is configured.
//!   Only spans whose target is [`TRACE_TARGET`] become OpenTelemetry spans: the
//!   request spans a server opens on purpose, never an incidental span of a library.
//!   Without an endpoint no OpenTelemetry layer is installed at all.
//!
//! A server joins each request to its caller's W3C trace with [`join_trace`].
//!
//! Every binary also stops the same way: [`stop_signal`] resolves on SIGTERM or Ctrl-C.

use std::io::IsTerminal as _;
use std::time::Duration;

use opentelemetry::trace::{TraceContextExt as _, TraceId, TracerProvider as _};
use opentelemetry::{KeyValue, propagation::TextMapPropagator as _};
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{IdGenerator as _, RandomIdGenerator, Sampler, SdkTracerProvider};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{EnvFilter, Layer as _, filter};

pub use signal::stop_signal;
pub use slipway_contract::{LogFormat, TelemetryArgs};

mod signal;

/// The target of the spans that are exported as traces: create a request's spans
/// with `tracing::info_span!(target: TRACE_TARGET, ...)`.
pub const TRACE_TARGET: &str = "slipway::trace";

/// How long shutdown waits for the last spans to reach the collector.
const EXPORT_FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

/// Errors setting telemetry up.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The OTLP exporter could not be built from the endpoint.
    #[error("OTLP exporter for {endpoint}: {source}")]
    Exporter {
        /// The traces URL.
        endpoint: String,
        /// Why.
        #[source]
        source: opentelemetry_otlp::ExporterBuildError,
    },
    /// A global subscriber was already installed.
    #[error("installing the log subscriber: {0}")]
    Subscriber(#[from] tracing_subscriber::util::TryInitError),
}

/// Where and how to export traces.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceExport {
    /// The collector's base URL (spans go to `URL/v1/traces`).
    pub endpoint: String,
    /// Fraction of root requests traced (a caller's sampling decision wins).
    pub sample_ratio: f64,
    /// Resource attributes naming this process beyond its service name (for example
    /// the release it serves).
    pub attributes: Vec<(&'static str, String)>,
}

impl TraceExport {
    /// The export `args` ask for, if any.
    #[must_use]
    pub fn from_args(args: &TelemetryArgs) -> Option<Self> {
        args.otlp_endpoint.as_ref().map(|endpoint| Self {
            endpoint: endpoint.clone(),
            sample_ratio: args.trace_sample_ratio,
            attributes: Vec::new(),
        })
    }

    /// `self` with one more resource attribute.
    #[must_use]
    pub fn with_attribute(mut self, key: &'static str, value: impl Into<String>) -> Self {
        self.attributes.push((key, value.into()));
        self
    }
}

/// The OTLP/HTTP traces URL under a collector's base URL.
#[must_use]
pub fn traces_url(endpoint: &str) -> String {
    let base = endpoint.trim_end_matches('/');
    if base.ends_with("/v1/traces") {
        base.to_owned()
    } else {
        format!("{base}/v1/traces")
    }
}

/// The installed logs and (when configured) trace exporter. Keep it for the life of
/// the process and call [`Telemetry::shutdown`] before exiting, so the last spans are
/// sent.
#[derive(Debug)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Installs the global subscriber: logs in `format` (resolved against whether
    /// stderr is a terminal) filtered by `RUST_LOG` or else `default_filter`, and,
    /// with `traces`, an OTLP exporter for [`TRACE_TARGET`] spans of `service`.
    ///
    /// # Errors
    /// A bad exporter endpoint, or a subscriber already installed.
    pub fn init(
        service: &'static str,
        format: Option<LogFormat>,
        default_filter: &str,
        traces: Option<&TraceExport>,
    ) -> Result<Self, TelemetryError> {
        let terminal = std::io::stderr().is_terminal();
        let env_filter =
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
        // Request spans are always open for the log layer, whatever `RUST_LOG` says,
        // so that any line logged inside one carries its request and trace ids.
        let log_filter = filter::filter_fn(|m| m.is_span() && m.target() == TRACE_TARGET);
        let logs = match LogFormat::resolve(format, terminal) {
            LogFormat::Text => tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_ansi(terminal)
                .boxed(),
            LogFormat::Json => tracing_subscriber::fmt::layer()
                .json()
                .with_writer(std::io::stderr)
                .with_current_span(false)
                .with_span_list(true)
                .boxed(),
        }
        .with_filter(filter::FilterExt::or(env_filter, log_filter));

        let provider = traces.map(|t| provider(service, t)).transpose()?;
        let otel = provider.as_ref().map(|p| {
            tracing_opentelemetry::layer()
                .with_tracer(p.tracer(service))
                // Attributes are what a request did, not where the process was.
                .with_location(false)
                .with_threads(false)
                .with_tracked_inactivity(false)
                .with_filter(
                    filter::Targets::new().with_target(TRACE_TARGET, tracing::Level::TRACE),
                )
        });
        tracing_subscriber::registry()
            .with(logs)
            .with(otel)
            .try_init()?;
        if let Some(t) = traces {
            tracing::info!(
                endpoint = %traces_url(&t.endpoint),
                sample_ratio = t.sample_ratio,
                "exporting request traces over OTLP/HTTP"
            );
        }
        Ok(Self { provider })
    }

    /// Sends the spans still buffered and stops the exporter.
    pub fn shutdown(mut self) {
        self.flush_and_stop();
    }

    fn flush_and_stop(&mut self) {
        if let Some(p) = self.provider.take()
            && let Err(error) = p.shutdown_with_timeout(EXPORT_FLUSH_TIMEOUT)
        {
            tracing::warn!(%error, "the last request traces may not have been exported");
        }
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        self.flush_and_stop();
    }
}

fn provider(service: &'static str, t: &TraceExport) -> Result<SdkTracerProvider, TelemetryError> {
    let endpoint = traces_url(&t.endpoint);
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_endpoint(endpoint.clone())
        .build()
        .map_err(|source| TelemetryError::Exporter { endpoint, source })?;
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(service)
        .with_attributes(
            t.attributes
                .iter()
                .map(|(k, v)| KeyValue::new(*k, v.clone())),
        )
        .build();
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        // A caller's decision (the traceparent's sampled flag) wins; roots draw.
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            t.sample_ratio,
        ))))
        .with_resource(resource)
        .build())
}

/// Joins `span` (a [`TRACE_TARGET`] request span) to the caller's trace named by
/// the W3C `traceparent` in `headers`, and returns the trace id to log: the span's
/// own when traces are exported, else the caller's, else a fresh random one, so
/// log lines of one request always share an id.
#[must_use]
pub fn join_trace(span: &tracing::Span, headers: &http::HeaderMap) -> String {
    let parent =
        TraceContextPropagator::new().extract(&opentelemetry_http::HeaderExtractor(headers));
    let remote = parent.span().span_context().trace_id();
    // Fails only when the span is not an OpenTelemetry span (no exporter, or
    // disabled): then the caller's id is the one to log.
    let _ = span.set_parent(parent);
    let own = span.context().span().span_context().trace_id();
    let id = [own, remote]
        .into_iter()
        .find(|id| *id != TraceId::INVALID)
        .unwrap_or_else(|| RandomIdGenerator::default().new_trace_id());
    id.to_string()
}

/// Writes the trace context of `span` (a request span joined with [`join_trace`]) into
/// `outgoing` as a W3C `traceparent` for the next hop, so the engine's spans go under
/// the router's. When the span is not exported (no OTLP endpoint), the caller's own
/// `traceparent` and `tracestate` pass through unchanged, so the next hop still joins
/// the client's trace.
pub fn inject_trace(
    span: &tracing::Span,
    incoming: &http::HeaderMap,
    outgoing: &mut http::HeaderMap,
) {
    TraceContextPropagator::new().inject_context(
        &span.context(),
        &mut opentelemetry_http::HeaderInjector(outgoing),
    );
    if !outgoing.contains_key(TRACEPARENT) {
        for name in [TRACEPARENT, TRACESTATE] {
            if let Some(value) = incoming.get(name) {
                outgoing.insert(name, value.clone());
            }
        }
    }
}

const TRACEPARENT: &str = "traceparent";
const TRACESTATE: &str = "tracestate";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traces_url_appends_the_signal_path_once() {
        assert_eq!(traces_url("http://c:4318"), "http://c:4318/v1/traces");
        assert_eq!(traces_url("http://c:4318/"), "http://c:4318/v1/traces");
        assert_eq!(
            traces_url("http://c:4318/v1/traces"),
            "http://c:4318/v1/traces"
        );
    }

    #[test]
    fn a_callers_trace_id_is_kept_without_an_exporter() {
        let mut headers = http::HeaderMap::new();
        headers.insert(
            "traceparent",
            http::HeaderValue::from_static(
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            ),
        );
        let id = join_trace(&tracing::Span::none(), &headers);
        assert_eq!(id, "4bf92f3577b34da6a3ce929d0e0e4736");
    }

    #[test]
    fn without_a_caller_each_request_gets_its_own_trace_id() {
        let headers = http::HeaderMap::new();
        let a = join_trace(&tracing::Span::none(), &headers);
        let b = join_trace(&tracing::Span::none(), &headers);
        assert_eq!(a.len(), 32);
        assert_ne!(a, b);
        assert_ne!(a, TraceId::INVALID.to_string());
    }

    #[test]
    fn without_an_exporter_the_callers_traceparent_passes_through() {
        let mut incoming = http::HeaderMap::new();
        let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        incoming.insert("traceparent", http::HeaderValue::from_static(parent));
        let mut outgoing = http::HeaderMap::new();
        inject_trace(&tracing::Span::none(), &incoming, &mut outgoing);
        assert_eq!(
            outgoing.get("traceparent").and_then(|v| v.to_str().ok()),
            Some(parent)
        );
        let mut none = http::HeaderMap::new();
        inject_trace(&tracing::Span::none(), &http::HeaderMap::new(), &mut none);
        assert!(none.is_empty());
    }
}
