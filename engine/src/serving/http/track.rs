//! [`Tracker`]: one admitted request's metrics and admission permit, from admission
//! to its end. It counts the request exactly once: explicitly with
//! [`Tracker::finish`], or as `cancelled` when dropped unfinished (the client went
//! away and its response future or stream was dropped).
//!
//! It also holds the request's trace span (the HTTP request span it was created in)
//! and records on it what the trace reports: outcome, SLO met, token counts.

use std::sync::Arc;
use std::time::Instant;

use slipway_telemetry::TRACE_TARGET;

use crate::serving::admission::Permit;
use crate::serving::metrics::{Outcome, ServingMetrics, SloTargets};
use crate::serving::scheduler::FinishReason;

/// The outcome a finish reason counts as.
#[must_use]
pub fn outcome_of(reason: FinishReason) -> Outcome {
    match reason {
        FinishReason::Stop | FinishReason::Length => Outcome::Ok,
        FinishReason::Cancelled => Outcome::Cancelled,
        FinishReason::Error => Outcome::Error,
    }
}

/// Latencies and outcome of one admitted request.
#[derive(Debug)]
pub struct Tracker {
    metrics: Arc<ServingMetrics>,
    /// The LoRA adapter the request names (its series' `adapter` label).
    adapter: Option<u16>,
    slo: SloTargets,
    permit: Option<Permit>,
    arrived: Instant,
    first: Option<Instant>,
    last: Option<Instant>,
    tokens: usize,
    done: bool,
    span: tracing::Span,
}

/// The token counts a finished request reports (`usage`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt: usize,
    /// Generated tokens.
    pub completion: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached: usize,
}

impl Tracker {
    /// Starts tracking a request to the base model or LoRA adapter `adapter` that
    /// arrived at `arrived` and holds `permit`, in the current (request) span.
    #[must_use]
    pub fn new(
        (metrics, adapter): (Arc<ServingMetrics>, Option<u16>),
        slo: SloTargets,
        permit: Permit,
        arrived: Instant,
    ) -> Self {
        Self {
            metrics,
            adapter,
            slo,
            permit: Some(permit),
            arrived,
            first: None,
            last: None,
            tokens: 0,
            done: false,
            span: tracing::Span::current(),
        }
    }

    /// The span of relaying the answer to the client, under the request's span.
    #[must_use]
    pub fn stream_span(&self, streaming: bool) -> tracing::Span {
        tracing::info_span!(target: TRACE_TARGET, parent: &self.span, "stream", streaming)
    }

    /// Records why and with what counts the generation ended.
    pub fn record_usage(&self, finish_reason: &str, usage: Usage) {
        let s = &self.span;
        s.record("finish_reason", finish_reason);
        s.record("cached_tokens", usage.cached);
    }

    /// A token came out of the engine.
    pub fn token(&mut self) {
        let now = Instant::now();
        match self.last {
            None => {
                self.first = Some(now);
                self.metrics
                    .of(self.adapter)
                    .ttft
                    .observe(now.duration_since(self.arrived).as_secs_f64());
            }
            Some(last) => self
                .metrics
                .of(self.adapter)
                .inter_token
                .observe(now.duration_since(last).as_secs_f64()),
        }
        self.last = Some(now);
        self.tokens += 1;
    }

    /// Counts the request as ended with `outcome` (once; later calls do nothing) and
    /// returns its admission share.
    pub fn finish(&mut self, outcome: Outcome) {
        if self.done {
            return;
        }
        self.done = true;
        self.metrics.request_ended(self.adapter, outcome);
        self.span.record("outcome", outcome.as_str());
        self.span.record("output_tokens", self.tokens);
        // Also the span's end: a trace span ends when it is last left, and a streamed
        // answer outlives the handler that entered it.
        self.span.in_scope(|| {
            tracing::info!(
                outcome = outcome.as_str(),
                output_tokens = self.tokens,
                "request ended"
            );
        });
        let permit = self.permit.take();
        if outcome == Outcome::Ok {
            let e2e = Instant::now().duration_since(self.arrived);
            self.metrics.of(self.adapter).e2e.observe(e2e.as_secs_f64());
            let ttft = self.first.map(|f| f.duration_since(self.arrived));
            let met = self.slo.met(ttft, e2e, self.tokens as u64);
            if met {
                self.metrics.slo_met(self.adapter);
            }
            self.span.record("slo_met", met);
            if let Some(p) = &permit {
                p.completed(e2e);
            }
        }
    }

    /// Ends tracking without counting: the request turned out to be invalid (a 4xx),
    /// which is no outcome of serving.
    pub fn forget(mut self) {
        self.done = true;
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        if !self.done {
            self.finish(Outcome::Cancelled);
        }
    }
}
