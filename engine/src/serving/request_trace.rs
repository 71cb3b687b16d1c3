//! The engine actor's part of a request's trace: its wait in the queue, each prefill
//! chunk (with the prompt tokens the prefix cache served) and its decode, as spans
//! under the HTTP request's span, the span [`super::engine::EngineHandle::submit`]
//! was called in. A span's lifetime is its duration, so each is opened and dropped
//! at the moment its phase starts and ends. Without a trace exporter they are
//! log-only spans: lines logged through [`RequestTrace::in_scope`] carry the
//! request's id and trace id.

use slipway_telemetry::TRACE_TARGET;
use tracing::Span;

/// The open spans of one request in the engine.
#[derive(Debug)]
pub(super) struct RequestTrace {
    request: Span,
    queue: Option<Span>,
    decode: Option<Span>,
}

impl RequestTrace {
    /// A request just entered the queue.
    pub(super) fn queued(request: Span) -> Self {
        let queue = tracing::info_span!(target: TRACE_TARGET, parent: &request, "queue");
        Self {
            request,
            queue: Some(queue),
            decode: None,
        }
    }

    /// Whether the request is still computing its prompt (no token out yet).
    pub(super) fn in_prefill(&self) -> bool {
        self.decode.is_none()
    }

    /// The request got its first step: its queue wait ends.
    pub(super) fn scheduled(&mut self) {
        self.queue = None;
    }

    /// The span of one prefill chunk, open while its forward step runs.
    pub(super) fn prefill_chunk(
        &self,
        tokens: usize,
        start_pos: usize,
        prefix_hit_tokens: usize,
    ) -> Span {
        tracing::info_span!(
            target: TRACE_TARGET,
            parent: &self.request,
            "prefill_chunk",
            tokens,
            start_pos,
            prefix_hit_tokens,
        )
    }

    /// A token came out; the first one starts the decode phase.
    pub(super) fn token(&mut self) {
        if self.decode.is_none() {
            self.decode = Some(tracing::info_span!(
                target: TRACE_TARGET,
                parent: &self.request,
                "decode",
                output_tokens = tracing::field::Empty,
            ));
        }
    }

    /// The request ended having generated `generated` tokens; its spans close when
    /// `self` is dropped.
    pub(super) fn finished(&self, generated: usize) {
        if let Some(decode) = &self.decode {
            decode.record("output_tokens", generated);
        }
    }

    /// Runs `f` (a log line about this request) inside the request's span.
    pub(super) fn in_scope<T>(&self, f: impl FnOnce() -> T) -> T {
        self.request.in_scope(f)
    }
}
