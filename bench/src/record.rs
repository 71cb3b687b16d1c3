//! Per-request records: what the client saw, with a timestamp for every token.
//!
//! All times are seconds on the run clock (zero = start of the run). Latencies are
//! measured from `scheduled_s`, the moment the open-loop schedule said the request
//! arrives, not from when the client got round to sending it, so a client that falls
//! behind shows up as latency instead of vanishing (no coordinated omission).
//!
//! Invariant: only a `Completed` record has a finite end-to-end latency; a timed-out,
//! cancelled or failed request never turns into a number that looks like a latency.

use serde::{Deserialize, Serialize};
use slipway_contract::metrics::time_per_output_token;

/// How a request ended. Every offered request ends in exactly one of these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Outcome {
    /// The stream finished normally.
    Completed,
    /// The server refused it (429 or 503).
    Rejected,
    /// The client's hard timeout fired before the stream finished.
    TimedOut,
    /// The client gave up: the request's deadline passed, or the run ended.
    Cancelled,
    /// Any other failure: connection error, non-2xx status, malformed stream.
    Error,
    /// Never sent: the cap on requests in flight was reached when it arrived.
    /// Reported, never queued in the client (queueing would hide the overload).
    ClientCapped,
}

impl Outcome {
    /// All outcomes, in report order.
    pub const ALL: [Self; 6] = [
        Self::Completed,
        Self::Rejected,
        Self::TimedOut,
        Self::Cancelled,
        Self::Error,
        Self::ClientCapped,
    ];
}

/// Everything the client observed about one request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RequestRecord {
    /// Request index in the run.
    pub id: u64,
    /// Tenant, if the workload has tenants.
    pub tenant: Option<String>,
    /// Intended prompt length (the workload's number, used for buckets).
    pub prompt_tokens: u32,
    /// Whether the prompt began with the shared prefix.
    pub shared_prefix: bool,
    /// Requested output length.
    pub max_tokens: u32,
    /// When the schedule said it arrives.
    pub scheduled_s: f64,
    /// When the client started sending it; `None` if it was never sent.
    pub sent_s: Option<f64>,
    /// Arrival time of each streamed content chunk (normally one token each).
    pub token_s: Vec<f64>,
    /// When the client stopped waiting (stream end, error, timeout, cancel).
    pub done_s: Option<f64>,
    /// How it ended.
    pub outcome: Outcome,
    /// HTTP status, when a response head arrived.
    pub http_status: Option<u16>,
    /// The `Retry-After` header of a rejection, verbatim.
    pub retry_after: Option<String>,
    /// Prompt tokens as counted by the server (`usage`), when reported.
    pub server_prompt_tokens: Option<u32>,
    /// Output tokens as counted by the server (`usage`), when reported.
    pub server_output_tokens: Option<u32>,
    /// Prompt tokens the server took from its prefix cache
    /// (`usage.prompt_tokens_details.cached_tokens`), when reported.
    #[serde(default)]
    pub server_cached_tokens: Option<u32>,
    /// Short error description for `Error` (and the reason for `Cancelled`).
    pub error: Option<String>,
}

impl RequestRecord {
    /// A record for a request that has not been sent yet.
    #[must_use]
    pub fn new(plan: &crate::workload::RequestPlan, scheduled_s: f64) -> Self {
        Self {
            id: plan.id,
            tenant: plan.tenant.clone(),
            prompt_tokens: plan.prompt_tokens,
            shared_prefix: plan.system.is_some(),
            max_tokens: plan.max_tokens,
            scheduled_s,
            sent_s: None,
            token_s: Vec::new(),
            done_s: None,
            outcome: Outcome::ClientCapped,
            http_status: None,
            retry_after: None,
            server_prompt_tokens: None,
            server_output_tokens: None,
            server_cached_tokens: None,
            error: None,
        }
    }

    /// Whether the server took the request in (sent and not refused at the door).
    #[must_use]
    pub fn admitted(&self) -> bool {
        self.sent_s.is_some() && !matches!(self.outcome, Outcome::Rejected | Outcome::ClientCapped)
    }

    /// Output tokens: the server's count when it reported one, else the chunks seen.
    #[must_use]
    pub fn n_out(&self) -> u32 {
        self.server_output_tokens
            .unwrap_or(self.token_s.len() as u32)
    }

    /// Time to first token, from the scheduled arrival; `None` if no token came.
    #[must_use]
    pub fn ttft_s(&self) -> Option<f64> {
        self.token_s.first().map(|t| t - self.scheduled_s)
    }

    /// End-to-end latency; `None` unless the request completed.
    #[must_use]
    pub fn e2e_s(&self) -> Option<f64> {
        match (self.outcome, self.done_s) {
            (Outcome::Completed, Some(done)) => Some(done - self.scheduled_s),
            _ => None,
        }
    }

    /// Time per output token, (E2E − TTFT)/(N_out − 1); `None` unless the request
    /// completed with at least two output tokens.
    #[must_use]
    pub fn tpot_s(&self) -> Option<f64> {
        match (self.e2e_s(), self.ttft_s()) {
            (Some(e2e), Some(ttft)) => time_per_output_token(ttft, e2e, u64::from(self.n_out())),
            _ => None,
        }
    }

    /// Gaps between consecutive chunks.
    pub fn itl_s(&self) -> impl Iterator<Item = f64> + '_ {
        self.token_s.windows(2).map(|w| w[1] - w[0])
    }

    /// Time in the client's in-flight set (sent → done), for Little's law.
    #[must_use]
    pub fn in_flight_s(&self) -> Option<f64> {
        Some(self.done_s? - self.sent_s?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(outcome: Outcome, tokens: &[f64], done: f64) -> RequestRecord {
        RequestRecord {
            id: 0,
            tenant: None,
            prompt_tokens: 10,
            shared_prefix: false,
            max_tokens: 4,
            scheduled_s: 1.0,
            sent_s: Some(1.1),
            token_s: tokens.to_vec(),
            done_s: Some(done),
            outcome,
            http_status: Some(200),
            retry_after: None,
            server_prompt_tokens: None,
            server_output_tokens: None,
            server_cached_tokens: None,
            error: None,
        }
    }

    #[test]
    fn latencies_of_a_completed_stream() {
        let r = rec(Outcome::Completed, &[1.5, 1.6, 1.7, 1.8], 1.9);
        assert!((r.ttft_s().unwrap() - 0.5).abs() < 1e-12);
        assert!((r.e2e_s().unwrap() - 0.9).abs() < 1e-12);
        // (0.9 − 0.5) / 3
        assert!((r.tpot_s().unwrap() - 0.4 / 3.0).abs() < 1e-12);
        let itl: Vec<f64> = r.itl_s().collect();
        assert_eq!(itl.len(), 3);
        assert!((r.in_flight_s().unwrap() - 0.8).abs() < 1e-12);
    }

    #[test]
    fn unfinished_streams_have_no_e2e_or_tpot() {
        for o in [Outcome::TimedOut, Outcome::Cancelled, Outcome::Error] {
            let r = rec(o, &[1.5, 1.6], 30.0);
            assert_eq!(r.e2e_s(), None, "{o:?}");
            assert_eq!(r.tpot_s(), None, "{o:?}");
            assert!(r.ttft_s().is_some());
        }
        let one = rec(Outcome::Completed, &[1.5], 1.5);
        assert_eq!(one.tpot_s(), None, "TPOT needs two tokens");
    }

    #[test]
    fn server_token_count_wins_over_chunk_count() {
        let mut r = rec(Outcome::Completed, &[1.5, 1.9], 1.9);
        r.server_output_tokens = Some(5);
        assert!((r.tpot_s().unwrap() - 0.4 / 4.0).abs() < 1e-12);
    }
}
