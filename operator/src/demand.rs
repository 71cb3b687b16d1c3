//! Measured demand: the arrival rate of requests (or tokens) at a service's engines,
//! and its peak over a lookback window, as a [`DemandReading`] for [`crate::scaling`].
//!
//! Demand is everything that arrived, admitted or not: a request the engine refused
//! (429, 503) is counted, because refusing it is what too little capacity looks like.
//! The engines count requests once, when they end (`slipway_requests_total`, every
//! outcome), so the rate lags arrivals by one request's latency, seconds against a
//! rate window of minutes. In tokens (`OutputTokensPerSecond`) demand is the generated
//! tokens plus, per refused request, the mean output of the served ones
//! ([`rate_of`]).
//!
//! Sources, as the rollout analysis has them (`rollout.analysis.metrics`):
//! - `Scrape`: the operator reads `/metrics` of every ready leader pod of every
//!   release, keeps per-pod samples ([`SampleStore`], counter resets handled), and
//!   keeps the history of its own rate readings ([`RateHistory`]) to find the peak.
//!   After an operator restart the history is short: the reading says how much of the
//!   peak window it covers, and [`crate::scaling`] keeps the peak status recorded.
//! - `Prometheus`: `sum(increase(...[rateWindow]))` for the current rate, and the same
//!   under `max_over_time(...[peakWindow:step])` for the peak.
//!
//! The router (when it exists) will be a third source: its counters see requests no
//! engine saw. Until then the engines' own counters are the demand.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde::{Deserialize, Serialize};
use slipway_api::duration;
use slipway_api::spec::{
    CapacitySpec, DemandUnit, MeasuredDemand, MetricsSource, MetricsSourceKind,
};
use slipway_contract::metrics::{
    GENERATION_TOKENS, OUTCOME_LABEL, Outcome, RELEASE_LABEL, REQUESTS, counter_total,
};

use crate::rollout::source::{Counters, SampleStore, Scraper, Target};

/// What the demand source showed, as plain data (fixtures state it in a few lines).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DemandReading {
    /// Arrival rate over the rate window, in the spec's unit.
    #[serde(default)]
    pub current: f64,
    /// The highest current rate over the part of the peak window the source covers.
    #[serde(default)]
    pub peak: f64,
    /// The current rate one rate window ago ([`RateHistory::window_before`]): with
    /// `current`, how fast demand rises.
    #[serde(default)]
    pub previous: Option<f64>,
    /// Seconds of the peak window the readings cover (less than the window after an
    /// operator restart with the `Scrape` source).
    #[serde(default)]
    pub covered_seconds: u64,
    /// Where it was read from, for status and events.
    #[serde(default)]
    pub source: String,
    /// When it was read.
    pub at: Option<Time>,
    /// Why there is no usable reading: the rate cannot be trusted, so nothing may be
    /// decided from it.
    #[serde(default)]
    pub missing: Option<String>,
}

/// A measured demand's windows, parsed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Windows {
    pub rate: Duration,
    pub peak: Duration,
    pub stabilization: Duration,
}

impl Windows {
    /// The spec's windows (the CRD rejects what does not parse; defaults stand in).
    pub fn of(measured: &MeasuredDemand) -> Self {
        let parse = |text: &str, default: u64| {
            duration::parse(text).unwrap_or(Duration::from_secs(default))
        };
        Self {
            rate: parse(&measured.rate_window, 60),
            peak: parse(&measured.peak_window, 900),
            stabilization: parse(&measured.scale_down_stabilization, 300),
        }
    }

    /// How often demand is read: a quarter of the rate window, so a peak that lasts one
    /// window is seen near its top.
    pub fn interval(&self) -> Duration {
        (self.rate / 4).max(Duration::from_secs(1))
    }
}

/// Demand per second over `window_seconds` from counter increases.
///
/// Requests: every request that ended. Tokens: the generated tokens, plus for each
/// refused request the mean output of the requests that ran (refused requests
/// generate nothing, yet they wanted tokens). With nothing served there is no mean,
/// and refusals add nothing.
pub fn rate_of(increase: &Counters, window_seconds: f64, unit: DemandUnit) -> f64 {
    if window_seconds <= 0.0 {
        return 0.0;
    }
    let per_window = match unit {
        DemandUnit::RequestsPerSecond => increase.requests,
        DemandUnit::OutputTokensPerSecond => {
            let served = (increase.requests - increase.rejected).max(0.0);
            let mean_output = if served > 0.0 {
                increase.generated_tokens / served
            } else {
                0.0
            };
            increase.generated_tokens + increase.rejected.max(0.0) * mean_output
        }
    };
    per_window / window_seconds
}

/// The source's own rate readings over the peak window (times in seconds on any
/// monotonic clock).
#[derive(Debug, Clone, Default)]
pub struct RateHistory {
    readings: VecDeque<(f64, f64)>,
}

impl RateHistory {
    /// Records the rate read at `t` and forgets what is older than `keep` seconds.
    pub fn record(&mut self, t: f64, rate: f64, keep: f64) {
        self.readings.push_back((t, rate));
        while self.readings.front().is_some_and(|(at, _)| *at <= t - keep) {
            self.readings.pop_front();
        }
    }

    /// The highest rate recorded in the peak window `(t − window, t]`.
    pub fn peak(&self, t: f64, window: f64) -> f64 {
        self.readings
            .iter()
            .filter(|(at, _)| *at > t - window)
            .map(|(_, r)| *r)
            .fold(0.0, f64::max)
    }

    /// The rate one window before `t`: the highest reading in `[t − 2·window, t −
    /// window]`, else the last one before that. The highest, because a reading that
    /// dipped (a drained pod's last requests are never scraped) would otherwise make
    /// the next one look like a rise, and a rise asks for groups ahead of it.
    pub fn window_before(&self, t: f64, window: f64) -> Option<f64> {
        let in_range = self
            .readings
            .iter()
            .filter(|(at, _)| *at >= t - 2.0 * window && *at <= t - window)
            .map(|(_, r)| *r)
            .reduce(f64::max);
        in_range.or_else(|| {
            self.readings
                .iter()
                .rev()
                .find(|(at, _)| *at <= t - window)
                .map(|(_, r)| *r)
        })
    }

    /// Seconds from the first reading to `t`, plus the rate window the first reading
    /// already looked back over.
    pub fn covered(&self, t: f64, rate_window: f64) -> f64 {
        self.readings
            .front()
            .map_or(0.0, |(first, _)| t - first + rate_window)
    }
}

/// The scrape source's reading at `t`: rate over the rate window from the store, peak
/// from the history (which this reading joins). A partial window (the store began
/// inside it while the pods already had requests) is missing data, not a low rate.
/// `at` is left for the caller (the reader stamps its reconcile's time).
pub fn scrape_reading(
    store: &SampleStore,
    history: &mut RateHistory,
    t: f64,
    windows: &Windows,
    unit: DemandUnit,
    releases: &[String],
) -> DemandReading {
    let rate_window = windows.rate.as_secs_f64();
    let pods = store.pods_of(|r| releases.iter().any(|x| x == r));
    let source = format!(
        "scrape of {pods} engine pod{}",
        if pods == 1 { "" } else { "s" }
    );
    let (increase, partial) =
        store.increase_over_window(|r| releases.iter().any(|x| x == r), t, rate_window);
    if partial {
        return DemandReading {
            source,
            missing: Some(format!(
                "warming up: the engines had requests before the operator started, and the {} s rate window is not yet covered",
                windows.rate.as_secs()
            )),
            ..DemandReading::default()
        };
    }
    let rate = rate_of(&increase, rate_window, unit);
    let previous = history.window_before(t, rate_window);
    let peak_window = windows.peak.as_secs_f64();
    history.record(t, rate, peak_window.max(2.0 * rate_window));
    DemandReading {
        current: rate,
        peak: history.peak(t, peak_window),
        previous,
        covered_seconds: history.covered(t, rate_window) as u64,
        source,
        at: None,
        missing: None,
    }
}

/// The PromQL of a service's demand: the current rate over the rate window and its
/// highest value over the peak window (a subquery stepping a quarter of the rate
/// window), over the given releases.
pub fn promql(releases: &[String], windows: &Windows, unit: DemandUnit) -> (String, String) {
    let selector = format!("{RELEASE_LABEL}=~\"{}\"", releases.join("|"));
    let w = format!("{}ms", windows.rate.as_millis());
    let requests = |extra: &str| {
        format!(
            "sum(increase({}{{{selector}{extra}}}[{w}]))",
            counter_total(REQUESTS)
        )
    };
    let per_window = match unit {
        DemandUnit::RequestsPerSecond => requests(""),
        DemandUnit::OutputTokensPerSecond => {
            let rejected = Outcome::regex(Outcome::is_rejection);
            let tokens = format!(
                "sum(increase({}{{{selector}}}[{w}]))",
                counter_total(GENERATION_TOKENS)
            );
            let refused = requests(&format!(",{OUTCOME_LABEL}=~\"{rejected}\""));
            let served = requests(&format!(",{OUTCOME_LABEL}!~\"{rejected}\""));
            format!("({tokens} + {refused} * ({tokens} / clamp_min({served}, 1)))")
        }
    };
    let seconds = windows.rate.as_secs_f64();
    let current = format!("{per_window} / {seconds}");
    let step = format!("{}ms", windows.interval().as_millis());
    let peak = format!(
        "max_over_time(({per_window})[{}ms:{step}]) / {seconds}",
        windows.peak.as_millis()
    );
    (current, peak)
}

struct Entry {
    store: SampleStore,
    history: RateHistory,
    last: Option<(Instant, DemandReading)>,
}

/// Reads measured demand; one per operator, shared by reconciles. A reading is reused
/// within its interval, so the status write it causes does not make the next reconcile
/// read (and write) again.
pub struct DemandReader {
    scraper: Scraper,
    epoch: Instant,
    entries: Mutex<HashMap<String, Entry>>,
}

impl Default for DemandReader {
    fn default() -> Self {
        Self::new()
    }
}

impl DemandReader {
    /// A reader that scrapes each pod at `<pod IP>:8000`.
    pub fn new() -> Self {
        Self::with_address_map(HashMap::new())
    }

    /// A reader that scrapes `address_map[pod IP]` for the IPs it names (tests: engines
    /// on 127.0.0.1 ports standing in for pods).
    pub fn with_address_map(address_map: HashMap<String, String>) -> Self {
        Self {
            scraper: Scraper::new(address_map),
            epoch: Instant::now(),
            entries: Mutex::new(HashMap::new()),
        }
    }

    /// Reads the demand of the InferenceService `key` from its ready leader pods
    /// (`targets`, every release) or from Prometheus, as `metrics` says. `None` when
    /// the spec's demand is static.
    pub async fn read(
        &self,
        key: &str,
        capacity: &CapacitySpec,
        metrics: &MetricsSource,
        targets: &[Target],
        now: &Time,
    ) -> Option<DemandReading> {
        self.read_at(key, capacity, metrics, targets, now, Instant::now())
            .await
    }

    /// [`DemandReader::read`] at `clock` on the monotonic clock (`now` is the same
    /// moment on the wall clock, for the reading's `at`): a reading is reused until an
    /// interval after it, and samples are stamped `clock`. Tests pass a later `clock`
    /// instead of sleeping through the interval.
    pub async fn read_at(
        &self,
        key: &str,
        capacity: &CapacitySpec,
        metrics: &MetricsSource,
        targets: &[Target],
        now: &Time,
        clock: Instant,
    ) -> Option<DemandReading> {
        let measured = capacity.demand.measured.as_ref()?;
        let windows = Windows::of(measured);
        if let Some((at, reading)) = self
            .entries
            .lock()
            .ok()
            .and_then(|e| e.get(key).and_then(|e| e.last.clone()))
            && clock.saturating_duration_since(at) < windows.interval()
        {
            return Some(reading);
        }
        let mut releases: Vec<String> = targets.iter().map(|t| t.release.clone()).collect();
        releases.sort();
        releases.dedup();
        let unit = capacity.demand_unit;
        let reading = match metrics.source {
            MetricsSourceKind::Prometheus => match &metrics.prometheus {
                Some(p) => self.prometheus(&p.url, &releases, &windows, unit).await,
                None => Err("metrics.source Prometheus without metrics.prometheus.url".to_owned()),
            },
            // The router's counters are for canary analysis; demand is what the
            // engines were asked, rejections included, so it reads them.
            MetricsSourceKind::Scrape | MetricsSourceKind::Router => {
                self.scrape(key, targets, &releases, &windows, unit, clock)
                    .await
            }
        };
        let reading = match reading {
            Ok(reading) => reading,
            Err(missing) => DemandReading {
                source: source_name(metrics, targets.len()),
                missing: Some(missing),
                ..DemandReading::default()
            },
        };
        let reading = DemandReading {
            at: Some(now.clone()),
            ..reading
        };
        if let Ok(mut entries) = self.entries.lock() {
            let entry = entries.entry(key.to_owned()).or_insert_with(|| Entry {
                store: SampleStore::new(self.seconds_at(clock)),
                history: RateHistory::default(),
                last: None,
            });
            entry.last = Some((clock, reading.clone()));
        }
        Some(reading)
    }

    async fn prometheus(
        &self,
        url: &str,
        releases: &[String],
        windows: &Windows,
        unit: DemandUnit,
    ) -> Result<DemandReading, String> {
        if releases.is_empty() {
            return Err("no ready engine pod names a release to query".to_owned());
        }
        let (current, peak) = promql(releases, windows, unit);
        let current = self.scraper.query(url, &current).await?;
        let peak = self.scraper.query(url, &peak).await?;
        Ok(DemandReading {
            current,
            peak: peak.max(current),
            previous: None,
            covered_seconds: windows.peak.as_secs(),
            source: format!("Prometheus {url}"),
            at: None,
            missing: None,
        })
    }

    /// Seconds from this reader's start to `clock`: the sample store's clock.
    fn seconds_at(&self, clock: Instant) -> f64 {
        clock.saturating_duration_since(self.epoch).as_secs_f64()
    }

    async fn scrape(
        &self,
        key: &str,
        targets: &[Target],
        releases: &[String],
        windows: &Windows,
        unit: DemandUnit,
        clock: Instant,
    ) -> Result<DemandReading, String> {
        if targets.is_empty() {
            return Err("no engine pod is ready to be read".to_owned());
        }
        let scraped = self.scraper.scrape(targets).await;
        if !scraped.failures.is_empty() {
            // A pod that cannot be read would make the rate look lower than it is.
            let why: Vec<&str> = scraped.failures.iter().map(|(_, w)| w.as_str()).collect();
            return Err(format!("engines unreadable: {}", why.join("; ")));
        }
        let t = self.seconds_at(clock);
        let mut entries = self
            .entries
            .lock()
            .map_err(|_| "demand store poisoned".to_owned())?;
        let entry = entries.entry(key.to_owned()).or_insert_with(|| Entry {
            store: SampleStore::new(t),
            history: RateHistory::default(),
            last: None,
        });
        for (target, counters) in scraped.counters {
            entry
                .store
                .record(t, &target.uid, &target.release, counters);
        }
        entry.store.prune(t, windows.rate.as_secs_f64());
        Ok(scrape_reading(
            &entry.store,
            &mut entry.history,
            t,
            windows,
            unit,
            releases,
        ))
    }
}

fn source_name(metrics: &MetricsSource, pods: usize) -> String {
    match (&metrics.source, &metrics.prometheus) {
        (MetricsSourceKind::Prometheus, Some(p)) => format!("Prometheus {}", p.url),
        _ => format!(
            "scrape of {pods} engine pod{}",
            if pods == 1 { "" } else { "s" }
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counters(requests: f64, rejected: f64, tokens: f64) -> Counters {
        Counters {
            requests,
            rejected,
            generated_tokens: tokens,
            ..Counters::default()
        }
    }

    #[test]
    fn refused_requests_are_demand() {
        let c = counters(120.0, 20.0, 1000.0);
        assert_eq!(rate_of(&c, 60.0, DemandUnit::RequestsPerSecond), 2.0);
        // 100 served made 1000 tokens: 10 each; 20 refused wanted 200 more.
        assert_eq!(rate_of(&c, 60.0, DemandUnit::OutputTokensPerSecond), 20.0);
        // Nothing served: no mean output, refusals add no tokens.
        let c = counters(5.0, 5.0, 0.0);
        assert_eq!(rate_of(&c, 10.0, DemandUnit::OutputTokensPerSecond), 0.0);
        assert_eq!(rate_of(&c, 0.0, DemandUnit::RequestsPerSecond), 0.0);
    }

    fn windows(rate: u64, peak: u64) -> Windows {
        Windows {
            rate: Duration::from_secs(rate),
            peak: Duration::from_secs(peak),
            stabilization: Duration::from_secs(60),
        }
    }

    fn read(
        store: &SampleStore,
        history: &mut RateHistory,
        t: f64,
        w: &Windows,
        releases: &[&str],
    ) -> DemandReading {
        let releases: Vec<String> = releases.iter().map(|r| (*r).to_owned()).collect();
        scrape_reading(
            store,
            history,
            t,
            w,
            DemandUnit::RequestsPerSecond,
            &releases,
        )
    }

    #[test]
    fn the_peak_is_the_highest_rate_over_the_peak_window_with_resets_handled() {
        let w = windows(10, 40);
        let mut store = SampleStore::new(0.0);
        let mut history = RateHistory::default();
        // Pod a from 0: 1 req/s, then 5 req/s from t=20; it restarts (counter drops) at t=40.
        let counts = [
            (0.0, 0.0),
            (10.0, 10.0),
            (20.0, 20.0),
            (30.0, 70.0),
            (40.0, 3.0),
            (50.0, 13.0),
        ];
        let mut readings = Vec::new();
        for (t, requests) in counts {
            store.record(t, "a", "r", counters(requests, 0.0, 0.0));
            readings.push(read(&store, &mut history, t, &w, &["r"]));
        }
        let rates: Vec<f64> = readings.iter().map(|r| r.current).collect();
        // The reset at t=40 counts its 3 requests, never a negative increase.
        assert_eq!(rates, vec![0.0, 1.0, 1.0, 5.0, 0.3, 1.0]);
        let last = &readings[5];
        assert_eq!(last.peak, 5.0);
        assert_eq!(
            last.previous,
            Some(5.0),
            "one window before t=50: the highest reading of t=30 and t=40 (5 and 0.3)"
        );
        assert_eq!(
            last.covered_seconds, 40,
            "readings back to t=20, each looking back 10 s"
        );
        assert_eq!(last.source, "scrape of 1 engine pod");
        // Past the peak window the spike is forgotten.
        for t in [60.0, 70.0, 80.0] {
            store.record(t, "a", "r", counters(13.0 + (t - 50.0), 0.0, 0.0));
            read(&store, &mut history, t, &w, &["r"]);
        }
        assert_eq!(history.peak(80.0, 40.0), 1.0);
    }

    #[test]
    fn a_store_that_began_inside_the_window_is_missing_data_not_a_low_rate() {
        let w = windows(60, 600);
        let mut store = SampleStore::new(100.0);
        let mut history = RateHistory::default();
        store.record(100.0, "a", "r", counters(500.0, 0.0, 0.0));
        store.record(115.0, "a", "r", counters(530.0, 0.0, 0.0));
        let got = read(&store, &mut history, 115.0, &w, &["r"]);
        assert!(got.missing.unwrap_or_default().contains("warming up"));
        store.record(160.0, "a", "r", counters(620.0, 0.0, 0.0));
        let got = read(&store, &mut history, 160.0, &w, &["r"]);
        assert_eq!((got.current, got.missing), (2.0, None));
    }

    #[test]
    fn a_window_between_samples_is_measured_over_its_own_length() {
        // 1 req/s, sampled every 20 s; a 30 s window starts between two samples.
        let w = windows(30, 60);
        let mut store = SampleStore::new(0.0);
        let mut history = RateHistory::default();
        for t in [0.0, 20.0, 40.0] {
            store.record(t, "a", "r", counters(t, 0.0, 0.0));
        }
        assert_eq!(read(&store, &mut history, 40.0, &w, &["r"]).current, 1.0);
        // Counting from the sample before the window would read 40 / 30 = 1.33.
        let (whole, _) = store.increase(|_| true, 40.0, 30.0);
        assert_eq!(whole.requests, 40.0);
    }

    #[test]
    fn other_services_releases_are_not_demand() {
        let w = windows(10, 40);
        let mut store = SampleStore::new(0.0);
        let mut history = RateHistory::default();
        store.record(0.0, "a", "mine", counters(0.0, 0.0, 0.0));
        store.record(0.0, "b", "theirs", counters(0.0, 0.0, 0.0));
        store.record(10.0, "a", "mine", counters(10.0, 0.0, 0.0));
        store.record(10.0, "b", "theirs", counters(500.0, 0.0, 0.0));
        assert_eq!(read(&store, &mut history, 10.0, &w, &["mine"]).current, 1.0);
    }

    #[test]
    fn promql_names_the_releases_windows_and_rejections() {
        let w = windows(60, 900);
        let (current, peak) = promql(
            &["a1".to_owned(), "b2".to_owned()],
            &w,
            DemandUnit::RequestsPerSecond,
        );
        assert_eq!(
            current,
            r#"sum(increase(slipway_requests_total{release=~"a1|b2"}[60000ms])) / 60"#
        );
        assert_eq!(
            peak,
            r#"max_over_time((sum(increase(slipway_requests_total{release=~"a1|b2"}[60000ms])))[900000ms:15000ms]) / 60"#
        );
        let (tokens, _) = promql(&["a1".to_owned()], &w, DemandUnit::OutputTokensPerSecond);
        assert!(tokens.contains("slipway_generation_tokens_total"));
        assert!(tokens.contains(r#"outcome=~"rejected_429|rejected_503""#));
        assert!(tokens.contains(r#"outcome!~"rejected_429|rejected_503""#));
    }
}
