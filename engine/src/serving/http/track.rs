//! [`Tracker`]: one admitted request's metrics and admission permit, from admission
//! to its end. It counts the request exactly once: explicitly with
//! [`Tracker::finish`], or as `cancelled` when dropped unfinished (the client went
//! away and its response future or stream was dropped).

use std::sync::Arc;
use std::time::Instant;

use crate::serving::admission::Permit;
use crate::serving::metrics::{Outcome, ServingMetrics, SloTargets, meets_slo};
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
    slo: SloTargets,
    permit: Option<Permit>,
    arrived: Instant,
    first: Option<Instant>,
    last: Option<Instant>,
    tokens: usize,
    done: bool,
}

impl Tracker {
    /// Starts tracking a request that arrived at `arrived` and holds `permit`.
    #[must_use]
    pub fn new(
        metrics: Arc<ServingMetrics>,
        slo: SloTargets,
        permit: Permit,
        arrived: Instant,
    ) -> Self {
        Self {
            metrics,
            slo,
            permit: Some(permit),
            arrived,
            first: None,
            last: None,
            tokens: 0,
            done: false,
        }
    }

    /// A token came out of the engine.
    pub fn token(&mut self) {
        let now = Instant::now();
        match self.last {
            None => {
                self.first = Some(now);
                self.metrics
                    .ttft
                    .observe(now.duration_since(self.arrived).as_secs_f64());
            }
            Some(last) => self
                .metrics
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
        self.metrics.request_ended(outcome);
        let permit = self.permit.take();
        if outcome == Outcome::Ok {
            let e2e = Instant::now().duration_since(self.arrived);
            self.metrics.e2e.observe(e2e.as_secs_f64());
            let ttft = self.first.map(|f| f.duration_since(self.arrived));
            if meets_slo(ttft, e2e, self.tokens, &self.slo) {
                self.metrics.slo_met();
            }
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
