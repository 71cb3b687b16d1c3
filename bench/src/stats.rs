//! Accounting: from per-request records to the numbers a capacity decision uses.
//!
//! Pure functions over plain data. Rules, all deliberate:
//! - Nothing is dropped: every offered request is counted in exactly one outcome, and
//!   the success rate's denominator is every offered request.
//! - A request that was admitted but did not complete is an *infinite* latency in the
//!   TTFT (if no token came), TPOT and E2E distributions, so a percentile that falls
//!   on it is reported as `null` (infinite), never as the timeout value.
//! - Rejected and never-sent requests are not latencies at all; they count against
//!   the success rate and goodput.
//! - SLO-goodput counts completed requests that met every target, per second of the
//!   arrival window.
//! - Little's law (L = λW) is checked between two independent pieces of bookkeeping:
//!   the server's own gauges of requests running and waiting (L, sampled during the
//!   run: [`crate::occupancy`]) and the client records' send/done timestamps (λ, W).

use std::time::Duration;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};
use slipway_contract::metrics::SloTargets;

use crate::occupancy::{ServerSample, time_average};
use crate::record::{Outcome, RequestRecord};

/// Service-level objective the run is judged against.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Slo {
    /// Time-to-first-token target, milliseconds.
    pub ttft_ms: f64,
    /// Time-per-output-token target, milliseconds.
    pub tpot_ms: f64,
    /// Percentile at which both targets must hold (e.g. 99).
    pub percentile: f64,
    /// Minimum fraction of offered requests that must complete.
    pub min_success: f64,
}

impl Default for Slo {
    fn default() -> Self {
        Self {
            ttft_ms: 2000.0,
            tpot_ms: 150.0,
            percentile: 99.0,
            min_success: 0.99,
        }
    }
}

impl Slo {
    /// Whether one request met every per-request target.
    #[must_use]
    pub fn met_by(&self, r: &RequestRecord) -> bool {
        r.outcome == Outcome::Completed && self.targets().met_seconds(r.ttft_s(), r.tpot_s())
    }

    /// The per-request latency targets, as the engine and the router count them.
    #[must_use]
    pub fn targets(&self) -> SloTargets {
        let from_ms =
            |ms: f64| Duration::try_from_secs_f64(ms.max(0.0) / 1000.0).unwrap_or(Duration::MAX);
        SloTargets {
            ttft: from_ms(self.ttft_ms),
            tpot: from_ms(self.tpot_ms),
        }
    }

    /// One line for reports.
    #[must_use]
    pub fn describe(&self) -> String {
        format!(
            "TTFT P{p} ≤ {} ms, TPOT P{p} ≤ {} ms, success ≥ {:.1}%",
            self.ttft_ms,
            self.tpot_ms,
            self.min_success * 100.0,
            p = self.percentile
        )
    }
}

/// Percentiles of one latency, in milliseconds; `None` means infinite (the
/// percentile falls on a request that never produced that number).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Latency {
    /// Finite samples.
    pub count: u64,
    /// Samples that are infinite (admitted but never finished).
    pub infinite: u64,
    /// Mean of the finite samples.
    pub mean_ms: Option<f64>,
    /// Median.
    pub p50_ms: Option<f64>,
    /// 95th percentile.
    pub p95_ms: Option<f64>,
    /// 99th percentile.
    pub p99_ms: Option<f64>,
}

/// Builds percentiles from finite samples (seconds) plus `infinite` unfinished ones.
struct LatencyAcc {
    hist: Histogram<u64>,
    sum_s: f64,
    infinite: u64,
}

impl LatencyAcc {
    fn new() -> Self {
        // 3 significant digits (0.1%) is far finer than anything an SLO is set at;
        // auto-resizing, so no sample is ever out of range.
        #[allow(clippy::expect_used)]
        let hist = Histogram::new(3).expect("3 significant figures is a valid precision (1..=5)");
        Self {
            hist,
            sum_s: 0.0,
            infinite: 0,
        }
    }

    fn add(&mut self, s: Option<f64>) {
        match s {
            Some(s) => {
                // Microseconds; a negative value (clock skew between tasks) is clamped.
                let us = (s.max(0.0) * 1e6).round() as u64;
                // `record` grows the auto-resizing histogram; `saturating_record`
                // would clamp to its current (tiny) range instead.
                if self.hist.record(us).is_err() {
                    self.hist.saturating_record(us);
                }
                self.sum_s += s.max(0.0);
            }
            None => self.infinite += 1,
        }
    }

    fn percentile(&self, p: f64) -> Option<f64> {
        let finite = self.hist.len();
        let total = finite + self.infinite;
        if total == 0 {
            return None;
        }
        // Nearest-rank over all samples, infinite ones sorted last.
        let rank = ((p / 100.0) * total as f64).ceil().max(1.0) as u64;
        if rank > finite {
            return None;
        }
        let q = rank as f64 / finite as f64;
        Some(self.hist.value_at_quantile(q) as f64 / 1000.0)
    }

    fn finish(&self) -> Latency {
        let n = self.hist.len();
        Latency {
            count: n,
            infinite: self.infinite,
            mean_ms: (n > 0).then(|| self.sum_s / n as f64 * 1000.0),
            p50_ms: self.percentile(50.0),
            p95_ms: self.percentile(95.0),
            p99_ms: self.percentile(99.0),
        }
    }
}

/// Latencies of the requests whose prompt length falls in `[lo, hi)`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Bucket {
    /// Inclusive lower bound, tokens.
    pub lo: u32,
    /// Exclusive upper bound, tokens (`None` = unbounded).
    pub hi: Option<u32>,
    /// Offered requests in the bucket.
    pub offered: u64,
    /// Time to first token.
    pub ttft: Latency,
    /// Time per output token.
    pub tpot: Latency,
    /// End to end.
    pub e2e: Latency,
}

/// Count of requests per outcome.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Counts {
    /// Every request the schedule produced.
    pub offered: u64,
    /// Sent and not refused at the door.
    pub admitted: u64,
    /// Finished normally.
    pub completed: u64,
    /// Refused with 429/503.
    pub rejected: u64,
    /// Of the rejected, how many carried `Retry-After`.
    pub rejected_with_retry_after: u64,
    /// Hit the client's hard timeout.
    pub timed_out: u64,
    /// Abandoned at a deadline or at the end of the run.
    pub cancelled: u64,
    /// Failed otherwise.
    pub errors: u64,
    /// Never sent because the in-flight cap was reached.
    pub client_capped: u64,
}

/// What the server's prefix cache saved, from its `usage` reports: over completed
/// requests that reported cached tokens (`prompt_tokens_details.cached_tokens`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PrefixCache {
    /// Completed requests whose usage reported cached tokens.
    pub requests: u64,
    /// Their prompt tokens, as the server counted them.
    pub prompt_tokens: u64,
    /// Of those, the tokens served from the prefix cache.
    pub cached_tokens: u64,
    /// `cached_tokens / prompt_tokens`; `None` when nothing reported.
    pub hit_rate: Option<f64>,
}

/// Little's-law check: the requests in the server, as its own gauges count them (L),
/// against the client's arrival rate times its mean time in flight (λW).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct LittleCheck {
    /// L: the server's requests running plus waiting, time-averaged over the run from
    /// scrapes of its `/metrics`; `None` when it was not measured (see
    /// `server_samples`).
    pub server_in_system: Option<f64>,
    /// Scrapes of the server's gauges within the run; 0 when the server exports none
    /// of the gauges [`crate::occupancy`] reads.
    pub server_samples: usize,
    /// λ: sends per second over the run, from the client's records.
    pub arrival_rate: f64,
    /// W: mean time in flight (send → done), from the client's records, seconds.
    pub mean_time_in_system_s: f64,
    /// λW.
    pub predicted: f64,
    /// |L − λW| / max(L, λW), when L was measured.
    pub relative_error: Option<f64>,
    /// How far L may be from the true time average only because it was sampled, in
    /// requests (see [`sampling_allowance`]); 0 when L was not measured.
    pub sampling_allowance: f64,
    /// Whether L and λW agree: |L − λW| within [`LITTLE_TOLERANCE`] of the larger
    /// plus the `sampling_allowance`; `None` when L was not measured. `false` means
    /// the client's and the server's accounts of the same requests disagree.
    pub consistent: Option<bool>,
}

/// Relative tolerance of the Little's-law check. The two sides differ honestly by
/// the client's share of each request (connection, parsing, tokenising before the
/// server's queue, the last bytes after it), by the server updating its gauges
/// between its steps; each is a few percent of a request's time in the system. A
/// lost or mis-stamped record, or requests one side keeps and the other does not,
/// move it by more. Sampling the gauges is allowed for separately
/// ([`sampling_allowance`]): with few, short requests it is larger than this.
pub const LITTLE_TOLERANCE: f64 = 0.2;

/// Fewest server samples in a run for the check to be made: a shorter run is not
/// evidence either way.
pub const MIN_SERVER_SAMPLES: usize = 10;

/// Checks L = λW over `[0, end]`, where `end` is the last request's done time: L from
/// the `server` samples, λ and W from the `records`.
#[must_use]
pub fn littles_law(records: &[RequestRecord], server: &[ServerSample]) -> LittleCheck {
    let end = records.iter().filter_map(|r| r.done_s).fold(0.0, f64::max);
    let times: Vec<f64> = records
        .iter()
        .filter_map(RequestRecord::in_flight_s)
        .collect();
    let (lambda, w) = if end > 0.0 && !times.is_empty() {
        (
            times.len() as f64 / end,
            times.iter().sum::<f64>() / times.len() as f64,
        )
    } else {
        (0.0, 0.0)
    };
    let predicted = lambda * w;
    let server_samples = server.iter().filter(|s| s.t <= end).count();
    let l = (server_samples >= MIN_SERVER_SAMPLES)
        .then(|| time_average(server, end))
        .flatten();
    let relative_error = l.map(|l| {
        let scale = l.max(predicted);
        if scale > 0.0 {
            (l - predicted).abs() / scale
        } else {
            0.0
        }
    });
    let allowance = if l.is_some() {
        sampling_allowance(server, end, times.len())
    } else {
        0.0
    };
    LittleCheck {
        server_in_system: l,
        server_samples,
        arrival_rate: lambda,
        mean_time_in_system_s: w,
        predicted,
        relative_error,
        sampling_allowance: allowance,
        consistent: l
            .map(|l| (l - predicted).abs() <= LITTLE_TOLERANCE * l.max(predicted) + allowance),
    }
}

/// How far the sampled time average of `requests` requests over `[0, end]` may be
/// from the true one, in requests. A sample's value holds until the next, so each
/// request's span is counted from the first sample after it starts to the first
/// after it ends: both ends move by less than the widest gap between samples, so
/// its share of L is off by less than `gap / end`, either way. The bound is the sum
/// of those, not a statistical one: arrivals at a fixed rate can fall on the same
/// phase of the scrapes every time, and then every request is off the same way.
/// With two 95 ms requests scraped every 50 ms, L can be 45 % away from λW by
/// sampling alone; with requests much longer than a gap the allowance is small.
#[must_use]
pub fn sampling_allowance(server: &[ServerSample], end: f64, requests: usize) -> f64 {
    if end <= 0.0 {
        return 0.0;
    }
    let mut times: Vec<f64> = server.iter().map(|s| s.t).filter(|&t| t <= end).collect();
    times.sort_by(f64::total_cmp);
    // Between samples only: the runner scrapes before the first send and until after
    // the last request is done, so the edges hold no request's start or end.
    let widest = times.windows(2).map(|w| w[1] - w[0]).fold(0.0, f64::max);
    widest * requests as f64 / end
}

/// The summary of one run (one offered rate).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Summary {
    /// Configured mean arrival rate, requests/s (`None` for closed loop).
    pub offered_rate: Option<f64>,
    /// Length of the arrival window, seconds: the denominator of every rate.
    pub window_s: f64,
    /// Outcome counts.
    pub counts: Counts,
    /// Completed / offered.
    pub success_rate: f64,
    /// Completed requests that met every SLO target.
    pub slo_met: u64,
    /// SLO-goodput, requests/s.
    pub goodput_rps: f64,
    /// Completed requests per second.
    pub throughput_rps: f64,
    /// Output tokens of completed requests per second.
    pub output_tokens_per_s: f64,
    /// Output tokens of SLO-meeting requests per second (goodput in tokens).
    pub goodput_output_tokens_per_s: f64,
    /// Time to first token.
    pub ttft: Latency,
    /// Time per output token.
    pub tpot: Latency,
    /// Inter-token (inter-chunk) latency.
    pub itl: Latency,
    /// End to end.
    pub e2e: Latency,
    /// Per prompt-length bucket.
    pub by_prompt_length: Vec<Bucket>,
    /// The server's prefix-cache hits (absent in summaries written before it existed).
    #[serde(default)]
    pub prefix_cache: PrefixCache,
    /// Little's-law check.
    pub little: LittleCheck,
    /// The SLO applied.
    pub slo: Slo,
    /// Whether the run meets the SLO at its percentile.
    pub slo_pass: bool,
    /// Why not, when it does not.
    pub slo_failures: Vec<String>,
}

/// Prompt-length bucket edges used by default (tokens).
pub const DEFAULT_BUCKETS: &[u32] = &[128, 256, 512, 1024];

fn latencies<'a>(records: impl Iterator<Item = &'a RequestRecord>) -> (Latency, Latency, Latency) {
    let (mut ttft, mut tpot, mut e2e) = (LatencyAcc::new(), LatencyAcc::new(), LatencyAcc::new());
    for r in records.filter(|r| r.admitted()) {
        ttft.add(r.ttft_s());
        e2e.add(r.e2e_s());
        // TPOT is defined for N_out ≥ 2; an unfinished request that was asked for at
        // least two tokens is an infinite TPOT, a finished one-token answer is none.
        match r.tpot_s() {
            Some(t) => tpot.add(Some(t)),
            None if r.outcome != Outcome::Completed && r.max_tokens >= 2 => tpot.add(None),
            None => {}
        }
    }
    (ttft.finish(), tpot.finish(), e2e.finish())
}

/// Percentile `p` of a [`Latency`], for the SLO check.
fn at(l: &Latency, p: f64) -> Option<f64> {
    match p {
        p if (p - 50.0).abs() < f64::EPSILON => l.p50_ms,
        p if (p - 95.0).abs() < f64::EPSILON => l.p95_ms,
        _ => l.p99_ms,
    }
}

/// Summarises one run.
///
/// `server` is the server's gauges sampled during the run (for Little's law; empty
/// when it exports none); `window_s` is the arrival window (the denominator of
/// rates); `buckets` are the upper edges of the prompt-length buckets.
#[must_use]
pub fn summarize(
    records: &[RequestRecord],
    server: &[ServerSample],
    window_s: f64,
    offered_rate: Option<f64>,
    slo: Slo,
    buckets: &[u32],
) -> Summary {
    let mut c = Counts {
        offered: records.len() as u64,
        ..Counts::default()
    };
    let mut itl = LatencyAcc::new();
    let mut out_tokens = 0u64;
    let mut prefix_cache = PrefixCache::default();
    for r in records {
        c.admitted += u64::from(r.admitted());
        match r.outcome {
            Outcome::Completed => {
                c.completed += 1;
                out_tokens += u64::from(r.n_out());
                if let (Some(p), Some(cached)) = (r.server_prompt_tokens, r.server_cached_tokens) {
                    prefix_cache.requests += 1;
                    prefix_cache.prompt_tokens += u64::from(p);
                    prefix_cache.cached_tokens += u64::from(cached);
                }
            }
            Outcome::Rejected => {
                c.rejected += 1;
                c.rejected_with_retry_after += u64::from(r.retry_after.is_some());
            }
            Outcome::TimedOut => c.timed_out += 1,
            Outcome::Cancelled => c.cancelled += 1,
            Outcome::Error => c.errors += 1,
            Outcome::ClientCapped => c.client_capped += 1,
        }
        for g in r.itl_s() {
            itl.add(Some(g));
        }
    }
    prefix_cache.hit_rate = (prefix_cache.prompt_tokens > 0)
        .then(|| prefix_cache.cached_tokens as f64 / prefix_cache.prompt_tokens as f64);
    let (ttft, tpot, e2e) = latencies(records.iter());
    let mut by_prompt_length = Vec::new();
    let mut lo = 0;
    for hi in buckets.iter().copied().map(Some).chain([None]) {
        let in_bucket =
            |r: &&RequestRecord| r.prompt_tokens >= lo && hi.is_none_or(|h| r.prompt_tokens < h);
        let offered = records.iter().filter(in_bucket).count() as u64;
        if offered > 0 {
            let (ttft, tpot, e2e) = latencies(records.iter().filter(in_bucket));
            by_prompt_length.push(Bucket {
                lo,
                hi,
                offered,
                ttft,
                tpot,
                e2e,
            });
        }
        lo = hi.unwrap_or(u32::MAX);
    }
    let slo_met = records.iter().filter(|r| slo.met_by(r)).count() as u64;
    let slo_met_tokens: u64 = records
        .iter()
        .filter(|r| slo.met_by(r))
        .map(|r| u64::from(r.n_out()))
        .sum();
    let success_rate = if c.offered > 0 {
        c.completed as f64 / c.offered as f64
    } else {
        0.0
    };
    let per_s = |n: u64| {
        if window_s > 0.0 {
            n as f64 / window_s
        } else {
            0.0
        }
    };
    let little = littles_law(records, server);

    let mut slo_failures = Vec::new();
    let p = slo.percentile;
    let check = |name: &str, l: &Latency, target: f64, f: &mut Vec<String>| match at(l, p) {
        None if l.count + l.infinite > 0 => {
            f.push(format!("{name} P{p} is infinite (unfinished requests)"))
        }
        Some(v) if v > target => f.push(format!("{name} P{p} {v:.0} ms > {target} ms")),
        _ => {}
    };
    check("TTFT", &ttft, slo.ttft_ms, &mut slo_failures);
    check("TPOT", &tpot, slo.tpot_ms, &mut slo_failures);
    if success_rate < slo.min_success {
        slo_failures.push(format!(
            "success {:.1}% < {:.1}%",
            success_rate * 100.0,
            slo.min_success * 100.0
        ));
    }
    if c.offered == 0 {
        slo_failures.push("no requests offered".into());
    }
    Summary {
        offered_rate,
        window_s,
        success_rate,
        slo_met,
        goodput_rps: per_s(slo_met),
        throughput_rps: per_s(c.completed),
        output_tokens_per_s: per_s(out_tokens),
        goodput_output_tokens_per_s: per_s(slo_met_tokens),
        counts: c,
        ttft,
        tpot,
        itl: itl.finish(),
        e2e,
        by_prompt_length,
        prefix_cache,
        little,
        slo,
        slo_pass: slo_failures.is_empty(),
        slo_failures,
    }
}

#[cfg(test)]
#[path = "stats_tests.rs"]
mod tests;
