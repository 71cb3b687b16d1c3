//! The server's own count of the requests in it, for the Little's-law check.
//!
//! Little's law (L = λW) only checks something when L and λW come from independent
//! bookkeeping. λ and W come from the client's records (sends, and the time from send
//! to done); L comes from the server: the engine's gauges of requests running and
//! waiting (`slipway_num_requests_running` + `slipway_num_requests_waiting`, or vLLM's
//! `vllm:num_requests_running` + `vllm:num_requests_waiting`), scraped from its
//! `/metrics` every [`SAMPLE_INTERVAL`] during the run and averaged over time. A lost
//! or mis-stamped record, a latency measured from the wrong base, or a server that
//! holds requests the client gave up on moves one side and not the other.
//!
//! Pure parts here ([`in_system`], [`time_average`]); the runner does the sampling.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use slipway_contract::metrics::{RUNNING, WAITING};

/// How often the runner scrapes the server's gauges.
pub const SAMPLE_INTERVAL: Duration = Duration::from_millis(50);

/// The gauges whose sum is the requests in the server: Slipway's engine, then vLLM.
const GAUGES: [&str; 4] = [
    RUNNING,
    WAITING,
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
];

/// One scrape of the server's gauges.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ServerSample {
    /// Run-clock time of the scrape (the middle of its round trip), seconds.
    pub t: f64,
    /// Requests running plus waiting in the server, summed over its series.
    pub in_system: f64,
}

/// The requests running plus waiting that a Prometheus or OpenMetrics text reports,
/// summed over every series of those gauges; `None` when it has none of them.
#[must_use]
pub fn in_system(text: &str) -> Option<f64> {
    let mut total = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        if !GAUGES.contains(&&line[..name_end]) {
            continue;
        }
        let rest = &line[name_end..];
        let rest = if rest.starts_with('{') {
            &rest[labels_end(rest)..]
        } else {
            rest
        };
        if let Some(value) = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        {
            *total.get_or_insert(0.0) += value;
        }
    }
    total
}

/// The byte after the `}` closing the label set `{...}` at the start of `s` (a `}`
/// inside a quoted value does not close it); `s.len()` when it is not closed.
fn labels_end(s: &str) -> usize {
    let (mut quoted, mut escaped) = (false, false);
    for (i, c) in s.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            '}' if !quoted => return i + 1,
            _ => {}
        }
    }
    s.len()
}

/// The time average over `[0, end]` of the step function the samples describe: each
/// value holds from its sample to the next, the first back to 0 (the runner takes it
/// before the first send) and the last until `end`. Samples after `end` are ignored.
/// `None` without a sample in the window or with `end` not positive.
#[must_use]
pub fn time_average(samples: &[ServerSample], end: f64) -> Option<f64> {
    let mut window: Vec<ServerSample> = samples.iter().copied().filter(|s| s.t <= end).collect();
    window.sort_by(|a, b| a.t.total_cmp(&b.t));
    if window.is_empty() || end <= 0.0 {
        return None;
    }
    let mut area = 0.0;
    for (i, s) in window.iter().enumerate() {
        let from = if i == 0 { 0.0 } else { s.t };
        let to = window.get(i + 1).map_or(end, |next| next.t);
        area += s.in_system * (to - from);
    }
    Some(area / end)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn running_and_waiting_are_summed_over_series() {
        let text = "# HELP slipway_num_requests_running Requests running.\n\
            # TYPE slipway_num_requests_running gauge\n\
            slipway_num_requests_running{model=\"m\",release=\"a\"} 3\n\
            slipway_num_requests_running{model=\"m\",release=\"b}\"} 1\n\
            slipway_num_requests_waiting{model=\"m\",release=\"a\"} 2 1700000000000\n\
            slipway_num_requests_running_other 100\n\
            slipway_requests_total{outcome=\"ok\"} 7\n";
        assert_eq!(in_system(text), Some(6.0));
        let vllm = "vllm:num_requests_running{model_name=\"x\"} 4.0\n\
            vllm:num_requests_waiting{model_name=\"x\"} 1.0\n";
        assert_eq!(in_system(vllm), Some(5.0));
        assert_eq!(in_system("slipway_router_requests_in_flight 3\n"), None);
        assert_eq!(in_system(""), None);
    }

    #[test]
    fn the_average_holds_each_sample_until_the_next() {
        let s = |t, in_system| ServerSample { t, in_system };
        // 0 over [0, 1), 2 over [1, 3), 1 over [3, 4]: (0 + 4 + 1) / 4.
        let samples = [s(0.01, 0.0), s(1.0, 2.0), s(3.0, 1.0), s(9.0, 50.0)];
        let l = time_average(&samples, 4.0).expect("samples in the window");
        assert!((l - 5.0 / 4.0).abs() < 1e-12, "{l}");
        assert_eq!(time_average(&[], 4.0), None);
        assert_eq!(time_average(&samples[3..], 4.0), None);
    }
}
