//! The router's live view of one InferenceService: where requests go (the release
//! split and the SLO), which engine endpoints each release has, and what the router
//! knows about each (readiness, its last load report, its backoff, the requests the
//! router has in flight there), plus the prefix index.
//!
//! Discovery ([`crate::discovery`]) and the load poller ([`crate::load`]) write it; the
//! proxy reads a [`Choice`] from it per request and holds an [`InFlight`] guard per
//! attempt. The decisions themselves are [`crate::choose`]'s; this module only turns
//! the view into its plain inputs.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use slipway_contract::LoadReport;
use slipway_contract::metrics::SloTargets;

use crate::choose::{self, Candidate, Exclusion, LoadView, Params, Ranking};
use crate::prefix::PrefixIndex;
use crate::split::Split;

/// An engine endpoint as discovery reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Discovered {
    /// Base URL, `http://host:port`.
    pub url: String,
    /// The release it serves.
    pub release: String,
    /// Ready (Kubernetes' `ready` condition; always true on the command line).
    pub ready: bool,
    /// Terminating: gets nothing new.
    pub terminating: bool,
}

/// One request the router has in flight at an endpoint.
#[derive(Debug)]
struct Sent {
    id: u64,
    at: Instant,
    /// KV blocks it will hold.
    blocks: usize,
    /// Its prompt blocks the endpoint was not predicted to hold: its prefill work.
    uncached: usize,
    /// No token has come back yet: its prefill is queued or running.
    prefilling: bool,
}

#[derive(Debug)]
struct Endpoint {
    found: Discovered,
    /// The last load report and when it was taken.
    load: Option<(LoadReport, Instant)>,
    /// The last poll failed to connect: not ready until one succeeds.
    unreachable: bool,
    backoff_until: Option<Instant>,
    /// Requests in flight here.
    in_flight: Vec<Sent>,
    /// Requests that were running when the last report was taken and have finished
    /// since: (finished at, blocks they held). The report still counts their blocks.
    finished_since_report: Vec<(Instant, usize)>,
}

impl Endpoint {
    fn candidate(&self, model: &str, overlap_blocks: usize) -> Candidate {
        let load = self.load.as_ref().map(|(report, taken_at)| LoadView {
            waiting: report.waiting,
            // What finished after the report was taken no longer holds its blocks:
            // without this, an engine that just finished a long prompt looks loaded
            // until its next report, and the next request sharing that prompt goes
            // to the engine without its prefix.
            context_blocks: report.context_blocks.saturating_sub(
                self.finished_since_report
                    .iter()
                    .filter(|(finished, _)| finished > taken_at)
                    .map(|(_, blocks)| blocks)
                    .sum(),
            ),
            // What the router sent after the report was taken is not in it yet.
            pending_blocks: self
                .in_flight
                .iter()
                .filter(|sent| sent.at > *taken_at)
                .map(|sent| sent.blocks)
                .sum(),
            prefill_backlog_blocks: self
                .in_flight
                .iter()
                .filter(|sent| sent.prefilling)
                .map(|sent| sent.uncached)
                .sum(),
            taken_at: *taken_at,
        });
        let report = self.load.as_ref().map(|(r, _)| r);
        Candidate {
            // Before its first report an endpoint is assumed to serve the model; a
            // wrong guess costs one 404, answered to the client as the engine wrote it.
            serves_model: model.is_empty()
                || report.is_none_or(|r| r.models.iter().any(|m| m == model)),
            ready: self.found.ready && !self.unreachable,
            terminating: self.found.terminating || report.is_some_and(|r| r.draining),
            backoff_until: self.backoff_until,
            load,
            in_flight: u32::try_from(self.in_flight.len()).unwrap_or(u32::MAX),
            overlap_blocks,
        }
    }
}

#[derive(Debug)]
struct View {
    split: Option<Split>,
    slo: SloTargets,
    endpoints: BTreeMap<String, Endpoint>,
}

/// One request's ranking within its release.
#[derive(Clone, Debug, PartialEq)]
pub struct Choice {
    /// Endpoint URLs, best first: the first is tried, the rest are the retry order.
    pub urls: Vec<String>,
    /// Predicted overlap blocks of each URL in `urls`.
    pub overlap_blocks: Vec<usize>,
    /// Endpoints a hard filter left out, and why.
    pub excluded: Vec<Exclusion>,
    /// Backoff ends of the excluded endpoints (for the router's own Retry-After).
    pub backoffs: Vec<Instant>,
    /// The cost policy fell back to least-in-flight (stale load).
    pub fell_back: bool,
}

/// The live view, shared by discovery, the load poller and the proxy.
#[derive(Debug)]
pub struct Live {
    view: Mutex<View>,
    prefix: Mutex<PrefixIndex>,
    next_id: AtomicU64,
    round_robin: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every update keeps the view consistent at each step; a panic elsewhere leaves
    // nothing half-written worth refusing traffic for.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Blocks the index remembers per endpoint: about a 2,048-block KV pool's worth.
const PREFIX_BLOCKS_PER_ENDPOINT: usize = 4096;
/// How long the index believes an endpoint still holds a prefix it was sent.
const PREFIX_TTL: Duration = Duration::from_secs(120);

impl Live {
    /// An empty view with these SLO targets.
    #[must_use]
    pub fn new(slo: SloTargets) -> Self {
        Self {
            view: Mutex::new(View {
                split: None,
                slo,
                endpoints: BTreeMap::new(),
            }),
            prefix: Mutex::new(PrefixIndex::new(PREFIX_BLOCKS_PER_ENDPOINT, PREFIX_TTL)),
            next_id: AtomicU64::new(1),
            round_robin: AtomicU64::new(0),
        }
    }

    /// Where requests go now.
    pub fn set_split(&self, split: Split, slo: SloTargets) {
        let mut view = lock(&self.view);
        view.split = Some(split);
        view.slo = slo;
    }

    /// The split, if known.
    #[must_use]
    pub fn split(&self) -> Option<Split> {
        lock(&self.view).split.clone()
    }

    /// The SLO targets.
    #[must_use]
    pub fn slo(&self) -> SloTargets {
        lock(&self.view).slo
    }

    /// Replaces the endpoint set with what discovery sees; what the router knew about
    /// endpoints that stay (load, in-flight requests, backoff) is kept.
    pub fn set_endpoints(&self, found: Vec<Discovered>) {
        let mut view = lock(&self.view);
        let mut old = std::mem::take(&mut view.endpoints);
        let mut gone: Vec<String> = old.keys().cloned().collect();
        for d in found {
            gone.retain(|u| *u != d.url);
            let endpoint = match old.remove(&d.url) {
                Some(mut e) => {
                    e.found = d.clone();
                    e
                }
                None => Endpoint {
                    found: d.clone(),
                    load: None,
                    unreachable: false,
                    backoff_until: None,
                    in_flight: Vec::new(),
                    finished_since_report: Vec::new(),
                },
            };
            view.endpoints.insert(d.url, endpoint);
        }
        drop(view);
        let mut prefix = lock(&self.prefix);
        for url in gone {
            prefix.forget(&url);
        }
    }

    /// Every endpoint URL, for the load poller.
    #[must_use]
    pub fn urls(&self) -> Vec<String> {
        lock(&self.view).endpoints.keys().cloned().collect()
    }

    /// Endpoint counts per (release, state): `eligible`, `not_ready`, `terminating`.
    #[must_use]
    pub fn census(&self) -> BTreeMap<(String, &'static str), usize> {
        let view = lock(&self.view);
        let mut out = BTreeMap::new();
        for e in view.endpoints.values() {
            let c = e.candidate("", 0);
            let state = if c.terminating {
                "terminating"
            } else if !c.ready {
                "not_ready"
            } else {
                "eligible"
            };
            *out.entry((e.found.release.clone(), state)).or_insert(0) += 1;
        }
        out
    }

    /// A load poll's result: a report taken at `taken_at`, or `None` when the
    /// endpoint could not be reached.
    pub fn record_load(&self, url: &str, report: Option<LoadReport>, taken_at: Instant) {
        let mut view = lock(&self.view);
        if let Some(e) = view.endpoints.get_mut(url) {
            match report {
                Some(r) => {
                    e.load = Some((r, taken_at));
                    e.unreachable = false;
                    // What finished before this report is already out of it.
                    e.finished_since_report
                        .retain(|(finished, _)| *finished > taken_at);
                }
                None => e.unreachable = true,
            }
        }
    }

    /// Sends nothing new to `url` for `duration` (a 503/429 answer, a refused
    /// connection).
    pub fn back_off(&self, url: &str, duration: Duration, now: Instant) {
        if let Some(e) = lock(&self.view).endpoints.get_mut(url) {
            let until = now + duration;
            e.backoff_until = Some(e.backoff_until.map_or(until, |u| u.max(until)));
        }
    }

    /// Models served by some endpoint (from their load reports), sorted.
    #[must_use]
    pub fn models(&self) -> Vec<String> {
        let view = lock(&self.view);
        let mut models: Vec<String> = view
            .endpoints
            .values()
            .filter_map(|e| e.load.as_ref())
            .flat_map(|(r, _)| r.models.iter().cloned())
            .collect();
        models.sort();
        models.dedup();
        models
    }

    /// Ranks the endpoints of `release` for a request naming `model` whose prompt
    /// hashes to `hashes` (`prompt_blocks` blocks).
    #[must_use]
    pub fn choose(
        &self,
        release: &str,
        model: &str,
        hashes: &[u64],
        prompt_blocks: usize,
        params: &Params,
        now: Instant,
    ) -> Choice {
        let prefix = lock(&self.prefix);
        let view = lock(&self.view);
        let mut urls = Vec::new();
        let mut candidates = Vec::new();
        for (url, e) in &view.endpoints {
            if e.found.release == release {
                urls.push(url.clone());
                candidates.push(e.candidate(model, prefix.overlap(url, hashes, now)));
            }
        }
        drop((view, prefix));
        let turn = self.round_robin.fetch_add(1, Ordering::Relaxed);
        let Ranking {
            order,
            excluded,
            fell_back,
        } = choose::rank(&candidates, prompt_blocks, params, now, turn);
        Choice {
            urls: order.iter().map(|&i| urls[i].clone()).collect(),
            overlap_blocks: order
                .iter()
                .map(|&i| candidates[i].overlap_blocks)
                .collect(),
            backoffs: excluded
                .iter()
                .filter_map(|&(i, _)| candidates[i].backoff_until)
                .collect(),
            excluded: excluded.into_iter().map(|(_, why)| why).collect(),
            fell_back,
        }
    }

    /// A request is being sent to `url`, holding about `blocks` KV blocks there until
    /// the guard drops, `uncached` of them to prefill until its first token
    /// ([`InFlight::first_token`]). The prefix index learns that `url` now holds
    /// `hashes`.
    #[must_use]
    pub fn start(
        self: &Arc<Self>,
        url: &str,
        blocks: usize,
        uncached: usize,
        hashes: &[u64],
    ) -> InFlight {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        if let Some(e) = lock(&self.view).endpoints.get_mut(url) {
            e.in_flight.push(Sent {
                id,
                at: now,
                blocks,
                uncached,
                prefilling: true,
            });
        }
        lock(&self.prefix).record(url, hashes, now);
        InFlight {
            live: Arc::clone(self),
            url: url.to_owned(),
            id,
        }
    }
}

/// One request in flight at one endpoint; counted until dropped.
#[derive(Debug)]
pub struct InFlight {
    live: Arc<Live>,
    url: String,
    id: u64,
}

impl InFlight {
    /// Its first token came back: its prefill is done.
    pub fn first_token(&self) {
        if let Some(e) = lock(&self.live.view).endpoints.get_mut(&self.url)
            && let Some(sent) = e.in_flight.iter_mut().find(|s| s.id == self.id)
        {
            sent.prefilling = false;
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(e) = lock(&self.live.view).endpoints.get_mut(&self.url) {
            let now = Instant::now();
            let taken_at = e.load.as_ref().map(|(_, at)| *at);
            e.in_flight.retain(|sent| {
                if sent.id != self.id {
                    return true;
                }
                // Sent before the last report: the report counts its blocks until
                // the next one. Sent after it: it was only pending, and is gone.
                if taken_at.is_some_and(|at| sent.at <= at) {
                    e.finished_since_report.push((now, sent.blocks));
                }
                false
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use slipway_contract::RoutePolicy;

    fn params() -> Params {
        Params {
            policy: RoutePolicy::Cost,
            prefill_load_scale: 1.0,
            saturation_waiting: 8,
            load_stale: Duration::from_secs(2),
        }
    }

    fn found(url: &str, release: &str) -> Discovered {
        Discovered {
            url: url.into(),
            release: release.into(),
            ready: true,
            terminating: false,
        }
    }

    fn report(release: &str, used: usize, draining: bool) -> LoadReport {
        LoadReport {
            release: release.into(),
            models: vec!["m".into()],
            running: 0,
            waiting: 0,
            context_blocks: used,
            kv_blocks_total: 100,
            kv_block_size: 16,
            draining,
        }
    }

    #[test]
    fn a_choice_stays_within_its_release_and_skips_draining_endpoints() {
        let live = Arc::new(Live::new(SloTargets {
            ttft: Duration::from_secs(1),
            tpot: Duration::from_millis(100),
        }));
        live.set_endpoints(vec![found("a", "s"), found("b", "s"), found("c", "k")]);
        let now = Instant::now();
        live.record_load("a", Some(report("s", 10, true)), now);
        live.record_load("b", Some(report("s", 50, false)), now);
        live.record_load("c", Some(report("k", 0, false)), now);
        let choice = live.choose("s", "m", &[], 4, &params(), now);
        assert_eq!(choice.urls, vec!["b".to_owned()]);
        assert_eq!(choice.excluded, vec![Exclusion::Terminating]);
    }

    #[test]
    fn requests_sent_after_a_report_count_until_they_finish() {
        let live = Arc::new(Live::new(SloTargets {
            ttft: Duration::from_secs(1),
            tpot: Duration::from_millis(100),
        }));
        live.set_endpoints(vec![found("a", "s"), found("b", "s")]);
        let before = Instant::now();
        live.record_load("a", Some(report("s", 10, false)), before);
        live.record_load("b", Some(report("s", 12, false)), before);
        std::thread::sleep(Duration::from_millis(2));
        // 10 blocks sent to `a` after its report: a now costs 20 against b's 12.
        let guard = live.start("a", 10, 0, &[]);
        let choice = live.choose("s", "m", &[], 0, &params(), Instant::now());
        assert_eq!(choice.urls.first().map(String::as_str), Some("b"));
        drop(guard);
        let choice = live.choose("s", "m", &[], 0, &params(), Instant::now());
        assert_eq!(choice.urls.first().map(String::as_str), Some("a"));
    }

    #[test]
    fn requests_finished_since_a_report_no_longer_count_as_its_decode_load() {
        let live = Arc::new(Live::new(SloTargets {
            ttft: Duration::from_secs(1),
            tpot: Duration::from_millis(100),
        }));
        live.set_endpoints(vec![found("a", "s"), found("b", "s")]);
        // 25 blocks sent to `a`, running when both reports are taken.
        let guard = live.start("a", 25, 0, &[]);
        std::thread::sleep(Duration::from_millis(2));
        let taken = Instant::now();
        live.record_load("a", Some(report("s", 25, false)), taken);
        live.record_load("b", Some(report("s", 10, false)), taken);
        let first = |live: &Live| {
            live.choose("s", "m", &[], 0, &params(), Instant::now())
                .urls
                .first()
                .cloned()
        };
        assert_eq!(first(&live).as_deref(), Some("b"));
        // It finishes before the next report: `a` holds nothing, whatever that report
        // said.
        std::thread::sleep(Duration::from_millis(2));
        drop(guard);
        assert_eq!(first(&live).as_deref(), Some("a"));
        // The next report shows it gone; nothing is subtracted twice.
        std::thread::sleep(Duration::from_millis(2));
        live.record_load("a", Some(report("s", 12, false)), Instant::now());
        assert_eq!(first(&live).as_deref(), Some("b"));
    }

    #[test]
    fn the_prefix_index_credits_the_endpoint_a_prompt_was_sent_to() {
        let live = Arc::new(Live::new(SloTargets {
            ttft: Duration::from_secs(1),
            tpot: Duration::from_millis(100),
        }));
        live.set_endpoints(vec![found("a", "s"), found("b", "s")]);
        let now = Instant::now();
        live.record_load("a", Some(report("s", 5, false)), now);
        live.record_load("b", Some(report("s", 0, false)), now);
        let hashes = [1, 2, 3, 4, 5, 6, 7, 8];
        drop(live.start("a", 0, 0, &hashes));
        let choice = live.choose("s", "m", &hashes, 8, &params(), Instant::now());
        assert_eq!(choice.urls.first().map(String::as_str), Some("a"));
        assert_eq!(choice.overlap_blocks.first(), Some(&8));
        // An endpoint that leaves takes its prefix entries with it.
        live.set_endpoints(vec![found("b", "s")]);
        live.set_endpoints(vec![found("a", "s"), found("b", "s")]);
        let choice = live.choose("s", "m", &hashes, 8, &params(), Instant::now());
        assert!(choice.overlap_blocks.iter().all(|&o| o == 0), "{choice:?}");
    }

    #[test]
    fn a_prefill_still_waiting_for_its_first_token_counts_until_it_comes() {
        let live = Arc::new(Live::new(SloTargets {
            ttft: Duration::from_secs(1),
            tpot: Duration::from_millis(100),
        }));
        live.set_endpoints(vec![found("a", "s"), found("b", "s")]);
        let now = Instant::now();
        live.record_load("a", Some(report("s", 0, false)), now);
        live.record_load("b", Some(report("s", 4, false)), now);
        // `a` has 25 uncached prompt blocks queued (reported load aside): the next
        // cold prompt goes to `b`, though `b` holds more decode blocks.
        let prefilling = live.start("a", 0, 25, &[]);
        let choice = live.choose("s", "m", &[], 25, &params(), Instant::now());
        assert_eq!(choice.urls.first().map(String::as_str), Some("b"));
        prefilling.first_token();
        let choice = live.choose("s", "m", &[], 25, &params(), Instant::now());
        assert_eq!(choice.urls.first().map(String::as_str), Some("a"));
    }
}
