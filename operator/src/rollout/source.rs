//! Metrics sources for rollout analysis: the counters of each release over the short
//! and the long window, as an [`analysis::MetricsReading`].
//!
//! - `Scrape` (default): the operator GETs `http://<pod IP>:8000/metrics` of the
//!   release's ready pods and keeps per-pod counter samples in memory ([`SampleStore`],
//!   pure). Increases are summed per pod with counter resets handled (a value that went
//!   down restarted from 0). After an operator restart the store is empty: a window
//!   that began before the store did and whose pods already had requests is *partial*
//!   until the window has passed, and analysis reports `MetricsWarmup` meanwhile.
//! - `Prometheus`: instant queries over the HTTP API (`GET <url>/api/v1/query`):
//!
//!   ```text
//!   good:     sum(increase(slipway_requests_slo_met_total{release="<hash>"}[<window>]))
//!   eligible: sum(increase(slipway_requests_total{release="<hash>",outcome=~"ok|error|rejected_503"}[<window>]))
//!   ```
//!
//!   An empty result (no series yet) is 0 requests, which analysis reads as
//!   inconclusive. Prometheus holds history, so its windows are never partial.
//!
//! The same scrapes and store feed measured demand ([`crate::demand`]): it reads all of
//! a service's releases, every outcome of `slipway_requests_total` and
//! `slipway_generation_tokens_total`.
//!
//! The text-format parser reads only the counters it needs (`slipway_requests_total`
//! with its `outcome` label, `slipway_requests_slo_met_total` and
//! `slipway_generation_tokens_total`); no maintained Rust
//! crate parses the exposition format (prometheus-client only writes it), and these
//! lines are simple: `name{label="value",...} number [timestamp]`.
//!
//! Tests that run engines on 127.0.0.1 ports instead of pods build the reader with
//! [`Reader::with_address_map`]; the operator binary has no way to redirect a scrape.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::Deserialize;
use slipway_api::duration;
use slipway_api::spec::{AnalysisSpec, MetricsSourceKind};
use slipway_contract::metrics::{
    GENERATION_TOKENS, OUTCOME_LABEL, Outcome, RELEASE_LABEL, REQUESTS, REQUESTS_SLO_MET,
    counter_total, router,
};

use super::analysis::{MetricsReading, ReleaseWindows, WindowCounts};

/// `outcome` values that count as eligible: the server served or failed the user.
pub fn eligible_outcomes() -> impl Iterator<Item = &'static str> {
    Outcome::ALL
        .into_iter()
        .filter(|o| o.is_slo_eligible())
        .map(Outcome::as_str)
}
/// Timeout of one scrape or query.
pub const HTTP_TIMEOUT: Duration = Duration::from_secs(5);

/// The counters of one pod (or one release), summed over its label sets.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Counters {
    /// Requests that met the SLO.
    pub good: f64,
    /// Requests eligible for the SLI (ok + error + rejected_503).
    pub eligible: f64,
    /// Every request that ended, whatever its outcome (rejections included).
    pub requests: f64,
    /// Requests refused before they ran (429 and 503).
    pub rejected: f64,
    /// Generated tokens.
    pub generated_tokens: f64,
}

impl Counters {
    /// Field-wise increase from `old` to `self`; a counter that went down restarted
    /// from 0, so its whole value is the increase.
    #[must_use]
    pub fn increase_since(self, old: Self) -> Self {
        let inc = |new: f64, old: f64| if new >= old { new - old } else { new };
        Self {
            good: inc(self.good, old.good),
            eligible: inc(self.eligible, old.eligible),
            requests: inc(self.requests, old.requests),
            rejected: inc(self.rejected, old.rejected),
            generated_tokens: inc(self.generated_tokens, old.generated_tokens),
        }
    }

    /// Field-wise sum.
    #[must_use]
    pub fn plus(self, other: Self) -> Self {
        Self {
            good: self.good + other.good,
            eligible: self.eligible + other.eligible,
            requests: self.requests + other.requests,
            rejected: self.rejected + other.rejected,
            generated_tokens: self.generated_tokens + other.generated_tokens,
        }
    }

    /// Whether any counter went down since `old`: the process restarted.
    fn reset_since(self, old: Self) -> bool {
        self.good < old.good
            || self.eligible < old.eligible
            || self.requests < old.requests
            || self.rejected < old.rejected
            || self.generated_tokens < old.generated_tokens
    }

    fn scaled(self, by: f64) -> Self {
        Self {
            good: self.good * by,
            eligible: self.eligible * by,
            requests: self.requests * by,
            rejected: self.rejected * by,
            generated_tokens: self.generated_tokens * by,
        }
    }

    fn any(&self) -> bool {
        self.requests > 0.0 || self.good > 0.0 || self.generated_tokens > 0.0
    }
}

/// Which metric families a scrape reads: the engine's, or the router's, which count
/// the same things at the gateway (the client-side boundary).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Families {
    /// `slipway_requests_total`, `slipway_requests_slo_met_total`,
    /// `slipway_generation_tokens_total` of an engine pod.
    Engine,
    /// `slipway_router_requests_total` and `slipway_router_requests_slo_met_total` of
    /// a router pod, one series per release it routes to.
    Router,
}

/// Reads the counters of `release` from an engine's Prometheus text: the SLO-met
/// count, `slipway_requests_total` by outcome and the generated tokens. Lines it does
/// not need, or cannot parse, are skipped.
pub fn parse_counters(text: &str, release: &str) -> Counters {
    parse_family_counters(text, release, Families::Engine)
}

/// Reads the counters of `release` from the text of `families`' process.
pub fn parse_family_counters(text: &str, release: &str, families: Families) -> Counters {
    let (good_name, requests_name, tokens_name) = match families {
        Families::Engine => (
            counter_total(REQUESTS_SLO_MET),
            counter_total(REQUESTS),
            Some(counter_total(GENERATION_TOKENS)),
        ),
        Families::Router => (
            counter_total(router::REQUESTS_SLO_MET),
            counter_total(router::REQUESTS),
            None,
        ),
    };
    let mut counters = Counters::default();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((name, labels, value)) = parse_line(line) else {
            continue;
        };
        if labels.get(RELEASE_LABEL).map(String::as_str) != Some(release) {
            continue;
        }
        if name == good_name {
            counters.good += value;
        } else if tokens_name.as_deref() == Some(name) {
            counters.generated_tokens += value;
        } else if name == requests_name {
            let outcome = labels
                .get(OUTCOME_LABEL)
                .and_then(|o| Outcome::ALL.into_iter().find(|known| known.as_str() == o));
            counters.requests += value;
            if outcome.is_some_and(Outcome::is_slo_eligible) {
                counters.eligible += value;
            }
            if outcome.is_some_and(Outcome::is_rejection) {
                counters.rejected += value;
            }
        }
    }
    counters
}

/// `name{a="b",...} value [timestamp]` → parts; `None` when malformed.
fn parse_line(line: &str) -> Option<(&str, BTreeMap<String, String>, f64)> {
    let name_end = line.find(|c: char| c == '{' || c.is_whitespace())?;
    let name = &line[..name_end];
    let mut rest = &line[name_end..];
    let mut labels = BTreeMap::new();
    if let Some(body) = rest.strip_prefix('{') {
        let mut chars = body.char_indices();
        let mut key = String::new();
        loop {
            let (i, c) = chars.next()?;
            match c {
                '}' => {
                    rest = &body[i + 1..];
                    break;
                }
                ',' | ' ' => {}
                '=' => {
                    if chars.next()?.1 != '"' {
                        return None;
                    }
                    let mut value = String::new();
                    loop {
                        let (_, c) = chars.next()?;
                        match c {
                            '"' => break,
                            '\\' => match chars.next()?.1 {
                                'n' => value.push('\n'),
                                other => value.push(other),
                            },
                            other => value.push(other),
                        }
                    }
                    labels.insert(std::mem::take(&mut key), value);
                }
                other => key.push(other),
            }
        }
    }
    let value = rest.split_whitespace().next()?.parse::<f64>().ok()?;
    Some((name, labels, value))
}

#[derive(Debug, Clone, Default)]
struct PodSeries {
    release: String,
    samples: VecDeque<(f64, Counters)>,
    /// The pod had requests before its first sample: requests before it are unseen.
    first_nonzero: bool,
}

/// Counter samples of every scraped pod, with the window math. Times are seconds on
/// any monotonic clock.
#[derive(Debug, Clone)]
pub struct SampleStore {
    started: f64,
    pods: BTreeMap<String, PodSeries>,
}

impl SampleStore {
    pub fn new(started: f64) -> Self {
        Self {
            started,
            pods: BTreeMap::new(),
        }
    }

    /// Records one scrape of one pod; `pod` is its identity (UID), not its name.
    pub fn record(&mut self, t: f64, pod: &str, release: &str, counters: Counters) {
        let series = self
            .pods
            .entry(pod.to_owned())
            .or_insert_with(|| PodSeries {
                release: release.to_owned(),
                samples: VecDeque::new(),
                first_nonzero: counters.any(),
            });
        series.samples.push_back((t, counters));
    }

    /// Drops samples no window reaches any more (keeping one baseline before it).
    pub fn prune(&mut self, t: f64, longest: f64) {
        let horizon = t - longest;
        for series in self.pods.values_mut() {
            while series.samples.len() > 1 && series.samples[1].0 <= horizon {
                series.samples.pop_front();
            }
        }
        self.pods
            .retain(|_, s| s.samples.back().is_some_and(|(at, _)| *at > horizon));
    }

    /// Increases of `release`'s counters over `(t − window, t]`.
    pub fn window(&self, release: &str, t: f64, window: f64) -> WindowCounts {
        let (counts, partial) = self.increase(|r| r == release, t, window);
        WindowCounts {
            good: counts.good,
            eligible: counts.eligible,
            partial,
        }
    }

    /// Increases over `(t − window, t]`, summed over the pods whose release `includes`
    /// accepts, and whether the store saw only part of the window (it started inside
    /// it while a pod already had requests: the counts are then a lower bound). Each
    /// pod's increase runs from its last sample at or before the window's start, so a
    /// window between samples counts a little more than its length.
    pub fn increase(
        &self,
        includes: impl Fn(&str) -> bool,
        t: f64,
        window: f64,
    ) -> (Counters, bool) {
        self.increase_from(includes, t, window, false)
    }

    /// [`SampleStore::increase`] with each pod's counters at the window's start
    /// interpolated between the samples around it, so the increase spans the window
    /// exactly: what a rate (increase ÷ window) needs when samples do not fall on the
    /// window's start. A reset between those samples leaves the earlier one as the start.
    pub fn increase_over_window(
        &self,
        includes: impl Fn(&str) -> bool,
        t: f64,
        window: f64,
    ) -> (Counters, bool) {
        self.increase_from(includes, t, window, true)
    }

    fn increase_from(
        &self,
        includes: impl Fn(&str) -> bool,
        t: f64,
        window: f64,
        interpolate: bool,
    ) -> (Counters, bool) {
        let start = t - window;
        let mut out = Counters::default();
        let mut partial = false;
        for series in self.pods.values().filter(|s| includes(&s.release)) {
            let samples = &series.samples;
            // Baseline: the last sample at or before the window's start, else the first.
            let base = samples
                .iter()
                .rposition(|(at, _)| *at <= start)
                .unwrap_or(0);
            if samples[base].0 > start && series.first_nonzero && self.started > start {
                partial = true;
            }
            let mut previous = samples[base].1;
            if samples[base].0 > start && !series.first_nonzero {
                // Seen from its first request on: everything counts.
                out = out.plus(previous);
            }
            for (i, (at, now)) in samples.iter().enumerate().skip(base + 1) {
                let mut increase = now.increase_since(previous);
                let before = samples[i - 1].0;
                // Only the part of the first interval inside the window counts (unless
                // the counter reset in it: then where it stood at the start is unknown).
                if interpolate
                    && i == base + 1
                    && before < start
                    && *at > before
                    && !now.reset_since(previous)
                {
                    increase = increase.scaled((at - start) / (at - before));
                }
                out = out.plus(increase);
                previous = *now;
            }
        }
        (out, partial)
    }

    /// How many pods whose release `includes` accepts have samples.
    pub fn pods_of(&self, includes: impl Fn(&str) -> bool) -> usize {
        self.pods.values().filter(|s| includes(&s.release)).count()
    }

    /// When the store began (an operator restart begins a new one).
    pub fn started(&self) -> f64 {
        self.started
    }

    /// Whether any pod of `release` has samples.
    pub fn has(&self, release: &str) -> bool {
        self.pods.values().any(|s| s.release == release)
    }
}

/// The two PromQL queries of a release over a window (seconds, as milliseconds so any
/// duration string maps exactly).
pub fn promql(release: &str, window: Duration) -> (String, String) {
    let w = format!("{}ms", window.as_millis());
    (
        format!(
            "sum(increase({}{{{RELEASE_LABEL}=\"{release}\"}}[{w}]))",
            counter_total(REQUESTS_SLO_MET)
        ),
        format!(
            "sum(increase({}{{{RELEASE_LABEL}=\"{release}\",{OUTCOME_LABEL}=~\"{}\"}}[{w}]))",
            counter_total(REQUESTS),
            Outcome::regex(Outcome::is_slo_eligible)
        ),
    )
}

#[derive(Deserialize)]
struct QueryResponse {
    status: String,
    #[serde(default)]
    error: Option<String>,
    #[serde(default)]
    data: Option<QueryData>,
}

#[derive(Deserialize)]
struct QueryData {
    #[serde(default)]
    result: Vec<QuerySample>,
}

#[derive(Deserialize)]
struct QuerySample {
    value: (serde_json::Value, String),
}

/// The scalar of an instant-vector query response (sum over its samples; none → 0).
///
/// # Errors
/// A sentence when the response is not a successful vector.
pub fn parse_query_response(body: &str) -> Result<f64, String> {
    let response: QueryResponse =
        serde_json::from_str(body).map_err(|e| format!("malformed query response: {e}"))?;
    if response.status != "success" {
        return Err(format!(
            "query failed: {}",
            response.error.unwrap_or(response.status)
        ));
    }
    let mut total = 0.0;
    for sample in response.data.map(|d| d.result).unwrap_or_default() {
        let v: f64 = sample
            .value
            .1
            .parse()
            .map_err(|_| format!("not a number: {:?}", sample.value.1))?;
        if v.is_finite() {
            total += v;
        }
    }
    Ok(total)
}

/// A pod of a release to scrape.
#[derive(Debug, Clone)]
pub struct Target {
    pub pod: String,
    /// The pod's UID: its samples are kept under it, because a recreated group reuses
    /// pod names, and a canary pod named like the rolled-back one before it is a new
    /// pod of another release.
    pub uid: String,
    pub ip: String,
    pub release: String,
}

/// The HTTP side of both sources: GETs engine pods' `/metrics` and runs Prometheus
/// instant queries. Shared by rollout analysis and measured demand.
pub struct Scraper {
    http: reqwest::Client,
    address_map: HashMap<String, String>,
}

/// One round of router scrapes: (series key, release, counters) per router pod and
/// release, and a sentence per router that failed.
#[derive(Debug, Default)]
pub struct ScrapedRouters {
    pub counters: Vec<(String, String, Counters)>,
    pub failures: Vec<String>,
}

/// One round of scrapes: the counters read, and a sentence per pod that failed.
pub struct Scraped<'a> {
    pub counters: Vec<(&'a Target, Counters)>,
    pub failures: Vec<(&'a Target, String)>,
}

impl Scraper {
    /// A scraper that reads each pod at `<pod IP>:8000`, except the IPs `address_map`
    /// names (test-only: engines on 127.0.0.1 ports standing in for pods).
    pub fn new(address_map: HashMap<String, String>) -> Self {
        Self {
            http: reqwest::Client::builder()
                .timeout(HTTP_TIMEOUT)
                .build()
                .unwrap_or_default(),
            address_map,
        }
    }

    /// Scrapes every target once, in order.
    pub async fn scrape<'a>(&self, targets: &'a [Target]) -> Scraped<'a> {
        let mut scraped = Scraped {
            counters: Vec::new(),
            failures: Vec::new(),
        };
        for target in targets {
            let address = self
                .address_map
                .get(&target.ip)
                .cloned()
                .unwrap_or_else(|| format!("{}:{}", target.ip, slipway_contract::ENGINE_PORT));
            match self.get_text(&address).await {
                Ok(text) => scraped
                    .counters
                    .push((target, parse_counters(&text, &target.release))),
                Err(e) => scraped
                    .failures
                    .push((target, format!("{} ({address}): {e}", target.pod))),
            }
        }
        scraped
    }

    /// Scrapes every router pod once (at the router's port): per pod, the counters of
    /// each of `releases`, as if each were a pod of its own (`<uid>/<release>`), so the
    /// sample store's per-pod window math applies unchanged.
    pub async fn scrape_routers(&self, routers: &[Target], releases: &[&str]) -> ScrapedRouters {
        let mut scraped = ScrapedRouters::default();
        for target in routers {
            let address = self
                .address_map
                .get(&target.ip)
                .cloned()
                .unwrap_or_else(|| {
                    format!("{}:{}", target.ip, slipway_contract::router::ROUTER_PORT)
                });
            match self.get_text(&address).await {
                Ok(text) => {
                    for release in releases {
                        scraped.counters.push((
                            format!("{}/{release}", target.uid),
                            (*release).to_owned(),
                            parse_family_counters(&text, release, Families::Router),
                        ));
                    }
                }
                Err(e) => scraped
                    .failures
                    .push(format!("router {} ({address}): {e}", target.pod)),
            }
        }
        scraped
    }

    async fn get_text(&self, address: &str) -> reqwest::Result<String> {
        self.http
            .get(format!(
                "http://{address}{}",
                slipway_contract::paths::METRICS
            ))
            .send()
            .await?
            .error_for_status()?
            .text()
            .await
    }

    /// One instant query's scalar (see [`parse_query_response`]).
    ///
    /// # Errors
    /// A sentence naming the server when it cannot be reached or the query fails.
    pub async fn query(&self, url: &str, promql: &str) -> Result<f64, String> {
        let response = self
            .http
            .get(format!("{}/api/v1/query", url.trim_end_matches('/')))
            .query(&[("query", promql)])
            .send()
            .await
            .map_err(|e| format!("{url}: {e}"))?;
        let body = response.text().await.map_err(|e| format!("{url}: {e}"))?;
        parse_query_response(&body).map_err(|e| format!("{url}: {e}"))
    }
}

struct Entry {
    store: SampleStore,
    last: Option<(Instant, String, String, MetricsReading)>,
}

/// One round of reads: `(series, release, counters)` samples, why the round is
/// incomplete (if it is), and when it was taken.
struct Round {
    samples: Vec<(String, String, Counters)>,
    error: Option<String>,
    at: Instant,
}

/// Reads metrics for rollouts; one per operator, shared by reconciles. Readings are
/// reused within an analysis interval, so the status write a reading causes does not
/// make the next reconcile read (and write) again.
pub struct Reader {
    scraper: Scraper,
    epoch: Instant,
    entries: Mutex<HashMap<String, Entry>>,
}

impl Default for Reader {
    fn default() -> Self {
        Self::new()
    }
}

impl Reader {
    /// A reader that scrapes each pod at `<pod IP>:8000`.
    pub fn new() -> Self {
        Self::with_address_map(HashMap::new())
    }

    /// A reader that scrapes `address_map[pod IP]` instead of `<pod IP>:8000` for the
    /// IPs it names (test-only: engines on 127.0.0.1 ports standing in for pods).
    pub fn with_address_map(address_map: HashMap<String, String>) -> Self {
        Self {
            scraper: Scraper::new(address_map),
            epoch: Instant::now(),
            entries: Mutex::new(HashMap::new()),
        }
    }

    /// Reads the canary's and stable's windows for the InferenceService `key`.
    pub async fn read(
        &self,
        key: &str,
        analysis: &AnalysisSpec,
        canary: &str,
        stable: &str,
        targets: &[Target],
    ) -> MetricsReading {
        self.read_at(key, analysis, canary, stable, targets, Instant::now())
            .await
    }

    /// [`Reader::read`] at `now` on the monotonic clock: a reading is reused until an
    /// analysis interval after it, and samples are stamped `now`. Tests pass a later
    /// `now` instead of sleeping through the interval.
    pub async fn read_at(
        &self,
        key: &str,
        analysis: &AnalysisSpec,
        canary: &str,
        stable: &str,
        targets: &[Target],
        now: Instant,
    ) -> MetricsReading {
        let interval = duration::parse(&analysis.interval).unwrap_or(Duration::from_secs(30));
        if let Some((at, c, s, reading)) = self
            .entries
            .lock()
            .ok()
            .and_then(|e| e.get(key).and_then(|e| e.last.clone()))
            && now.saturating_duration_since(at) < interval
            && c == canary
            && s == stable
        {
            return reading;
        }
        let windows = (
            duration::parse(&analysis.short_window).unwrap_or(Duration::from_secs(60)),
            duration::parse(&analysis.long_window).unwrap_or(Duration::from_secs(300)),
        );
        let reading = match analysis.metrics.source {
            MetricsSourceKind::Prometheus => match &analysis.metrics.prometheus {
                Some(p) => self.prometheus(&p.url, canary, stable, windows).await,
                None => Err("metrics.source Prometheus without metrics.prometheus.url".to_owned()),
            },
            MetricsSourceKind::Scrape => Ok(self
                .scrape(key, canary, stable, windows, targets, now)
                .await),
            MetricsSourceKind::Router => Ok(self
                .scrape_routers(key, canary, stable, windows, targets, now)
                .await),
        };
        let reading = reading.unwrap_or_else(|error| MetricsReading {
            canary_release: canary.to_owned(),
            error: Some(error),
            ..MetricsReading::default()
        });
        if let Ok(mut entries) = self.entries.lock() {
            let entry = entries.entry(key.to_owned()).or_insert_with(|| Entry {
                store: SampleStore::new(self.seconds_at(now)),
                last: None,
            });
            entry.last = Some((now, canary.to_owned(), stable.to_owned(), reading.clone()));
        }
        reading
    }

    async fn prometheus(
        &self,
        url: &str,
        canary: &str,
        stable: &str,
        (short, long): (Duration, Duration),
    ) -> Result<MetricsReading, String> {
        let mut per_release = Vec::new();
        for release in [canary, stable] {
            let mut windows = Vec::new();
            for window in [short, long] {
                let (good, eligible) = promql(release, window);
                windows.push(WindowCounts {
                    good: self.scraper.query(url, &good).await?,
                    eligible: self.scraper.query(url, &eligible).await?,
                    partial: false,
                });
            }
            per_release.push(ReleaseWindows {
                short: windows[0],
                long: windows[1],
            });
        }
        Ok(MetricsReading {
            canary_release: canary.to_owned(),
            canary: Some(per_release[0]),
            stable: Some(per_release[1]),
            error: None,
        })
    }

    /// The `Router` source: `routers` are the router pods; each keeps one series per
    /// release it routes to.
    async fn scrape_routers(
        &self,
        key: &str,
        canary: &str,
        stable: &str,
        windows: (Duration, Duration),
        routers: &[Target],
        now: Instant,
    ) -> MetricsReading {
        let scraped = self
            .scraper
            .scrape_routers(routers, &[canary, stable])
            .await;
        let error = if routers.is_empty() {
            Some("no ready router pod to read".to_owned())
        } else if scraped.failures.is_empty() {
            None
        } else {
            // A router that could not be read holds part of the traffic: not evidence.
            Some(scraped.failures.join("; "))
        };
        let round = Round {
            samples: scraped.counters,
            error,
            at: now,
        };
        self.windows_of(key, canary, stable, windows, round)
    }

    /// The `Scrape` source: one series per engine pod.
    async fn scrape(
        &self,
        key: &str,
        canary: &str,
        stable: &str,
        windows: (Duration, Duration),
        targets: &[Target],
        now: Instant,
    ) -> MetricsReading {
        let scraped = self.scraper.scrape(targets).await;
        // Any unreadable canary pod makes the reading incomplete: not evidence.
        let error = scraped
            .failures
            .iter()
            .any(|(target, _)| target.release == canary)
            .then(|| {
                scraped
                    .failures
                    .iter()
                    .map(|(_, why)| why.as_str())
                    .collect::<Vec<_>>()
                    .join("; ")
            });
        let samples = scraped
            .counters
            .into_iter()
            .map(|(target, counters)| (target.uid.clone(), target.release.clone(), counters))
            .collect();
        let round = Round {
            samples,
            error,
            at: now,
        };
        self.windows_of(key, canary, stable, windows, round)
    }

    /// Seconds from this reader's start to `now`: the sample stores' clock.
    fn seconds_at(&self, now: Instant) -> f64 {
        now.saturating_duration_since(self.epoch).as_secs_f64()
    }

    /// Records one round of samples in the service's store and reads both releases'
    /// windows from it.
    fn windows_of(
        &self,
        key: &str,
        canary: &str,
        stable: &str,
        (short, long): (Duration, Duration),
        Round { samples, error, at }: Round,
    ) -> MetricsReading {
        let t = self.seconds_at(at);
        let Ok(mut entries) = self.entries.lock() else {
            return MetricsReading {
                canary_release: canary.to_owned(),
                error: Some("sample store poisoned".to_owned()),
                ..MetricsReading::default()
            };
        };
        let entry = entries.entry(key.to_owned()).or_insert_with(|| Entry {
            store: SampleStore::new(t),
            last: None,
        });
        for (series, release, counters) in samples {
            entry.store.record(t, &series, &release, counters);
        }
        entry.store.prune(t, long.as_secs_f64());
        let windows = |release: &str| {
            entry.store.has(release).then(|| ReleaseWindows {
                short: entry.store.window(release, t, short.as_secs_f64()),
                long: entry.store.window(release, t, long.as_secs_f64()),
            })
        };
        MetricsReading {
            canary_release: canary.to_owned(),
            canary: windows(canary),
            stable: windows(stable),
            error,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP slipway_requests_total Requests by outcome.
# TYPE slipway_requests_total counter
slipway_requests_total{model="smol",release="abc",outcome="ok"} 90
slipway_requests_total{model="smol",release="abc",outcome="error"} 4
slipway_requests_total{model="smol",release="abc",outcome="rejected_503"} 6
slipway_requests_total{model="smol",release="abc",outcome="rejected_429"} 50
slipway_requests_total{model="smol",release="abc",outcome="cancelled"} 7
slipway_requests_total{model="smol",release="other",outcome="ok"} 1000
slipway_requests_slo_met_total{model="smol \"q\"",release="abc"} 80 1700000000000
slipway_requests_slo_met_created{model="smol",release="abc"} 1.7e9
# EOF
"#;

    #[test]
    fn parses_only_eligible_outcomes_of_the_release() {
        assert_eq!(
            parse_counters(TEXT, "abc"),
            Counters {
                good: 80.0,
                eligible: 100.0,
                requests: 157.0,
                rejected: 56.0,
                generated_tokens: 0.0,
            }
        );
        assert_eq!(
            parse_counters(TEXT, "other"),
            Counters {
                good: 0.0,
                eligible: 1000.0,
                requests: 1000.0,
                rejected: 0.0,
                generated_tokens: 0.0,
            }
        );
    }

    fn c(good: f64, eligible: f64) -> Counters {
        Counters {
            good,
            eligible,
            ..Counters::default()
        }
    }

    #[test]
    fn windows_sum_increases_across_pods_and_resets() {
        let mut store = SampleStore::new(0.0);
        // Pod a seen from its start; pod b restarts (counter drops) at t=40.
        for (t, a, b) in [
            (0.0, c(0.0, 0.0), c(0.0, 0.0)),
            (20.0, c(10.0, 10.0), c(5.0, 10.0)),
            (40.0, c(20.0, 20.0), c(2.0, 3.0)),
            (60.0, c(30.0, 30.0), c(4.0, 6.0)),
        ] {
            store.record(t, "a", "r", a);
            store.record(t, "b", "r", b);
        }
        let long = store.window("r", 60.0, 100.0);
        assert_eq!(
            (long.good, long.eligible, long.partial),
            (39.0, 46.0, false)
        );
        let short = store.window("r", 60.0, 20.0);
        assert_eq!((short.good, short.eligible), (12.0, 13.0));
        assert_eq!(store.window("other", 60.0, 20.0), WindowCounts::default());
    }

    #[test]
    fn a_store_started_after_requests_is_partial_until_the_window_passes() {
        let mut store = SampleStore::new(100.0);
        store.record(100.0, "a", "r", c(500.0, 500.0));
        store.record(130.0, "a", "r", c(530.0, 540.0));
        let w = store.window("r", 130.0, 60.0);
        assert!(w.partial);
        assert_eq!((w.good, w.eligible), (30.0, 40.0));
        store.record(170.0, "a", "r", c(560.0, 580.0));
        let w = store.window("r", 170.0, 60.0);
        assert!(!w.partial, "the window now starts after the store did");
        // From the last sample at or before the window's start (t=100).
        assert_eq!((w.good, w.eligible), (60.0, 80.0));
    }

    #[test]
    fn a_reused_pod_name_of_another_release_is_a_new_pod() {
        // The rolled-back canary's pod and the next canary's pod share a name but not
        // a UID: the new release is seen from its own pod's first scrape.
        let mut store = SampleStore::new(0.0);
        store.record(0.0, "uid-old", "bad", c(0.0, 0.0));
        store.record(10.0, "uid-old", "bad", c(1.0, 5.0));
        store.record(20.0, "uid-new", "good", c(0.0, 0.0));
        store.record(30.0, "uid-new", "good", c(40.0, 40.0));
        assert!(store.has("good"));
        let w = store.window("good", 30.0, 60.0);
        assert_eq!((w.good, w.eligible, w.partial), (40.0, 40.0, false));
        let w = store.window("bad", 30.0, 60.0);
        assert_eq!((w.good, w.eligible), (1.0, 5.0));
    }

    #[test]
    fn prune_keeps_one_baseline() {
        let mut store = SampleStore::new(0.0);
        for t in 0..10 {
            store.record(f64::from(t) * 10.0, "a", "r", c(f64::from(t), f64::from(t)));
        }
        store.prune(90.0, 30.0);
        let w = store.window("r", 90.0, 30.0);
        assert_eq!(w.eligible, 3.0);
    }

    #[test]
    fn promql_queries_name_the_release_and_outcomes() {
        let (good, eligible) = promql("abc1234567", Duration::from_secs(300));
        assert_eq!(
            good,
            r#"sum(increase(slipway_requests_slo_met_total{release="abc1234567"}[300000ms]))"#
        );
        assert_eq!(
            eligible,
            r#"sum(increase(slipway_requests_total{release="abc1234567",outcome=~"ok|rejected_503|error"}[300000ms]))"#
        );
    }

    #[test]
    fn query_responses() {
        let ok = r#"{"status":"success","data":{"resultType":"vector","result":[{"metric":{},"value":[1700000000.1,"12.5"]}]}}"#;
        assert_eq!(parse_query_response(ok), Ok(12.5));
        let empty = r#"{"status":"success","data":{"resultType":"vector","result":[]}}"#;
        assert_eq!(parse_query_response(empty), Ok(0.0));
        let bad = r#"{"status":"error","errorType":"bad_data","error":"parse error"}"#;
        assert!(
            parse_query_response(bad)
                .unwrap_err()
                .contains("parse error")
        );
        assert!(parse_query_response("<html>").is_err());
    }

    #[test]
    fn router_counters_are_read_per_release_from_the_router_families() {
        let text = r#"# TYPE slipway_router_requests counter
slipway_router_requests_total{release="canary1",outcome="ok"} 9
slipway_router_requests_total{release="canary1",outcome="error"} 1
slipway_router_requests_total{release="stable1",outcome="ok"} 90
slipway_router_requests_total{release="stable1",outcome="cancelled"} 3
slipway_router_requests_slo_met_total{release="canary1"} 7
slipway_router_requests_slo_met_total{release="stable1"} 88
slipway_requests_total{release="canary1",outcome="ok"} 1000
"#;
        let canary = parse_family_counters(text, "canary1", Families::Router);
        assert_eq!(
            (canary.good, canary.eligible, canary.requests),
            (7.0, 10.0, 10.0)
        );
        let stable = parse_family_counters(text, "stable1", Families::Router);
        assert_eq!(
            (stable.good, stable.eligible, stable.requests),
            (88.0, 90.0, 93.0)
        );
        // The engine's families are not the router's.
        assert_eq!(parse_counters(text, "canary1").requests, 1000.0);
    }
}
