//! Choosing an endpoint within a release: hard filters, then a cost.
//!
//! The shape follows llm-d's inference scheduler: **filters first**, each endpoint that
//! fails one is excluded with a reason (a metric label), in a fixed order — the model is
//! not served, not ready, terminating, backing off after a 503/429, saturated (a fresh
//! load report with `waiting >= saturation_waiting`). The order matters only for which
//! reason is reported when several apply; the first that applies is.
//!
//! Among the rest, the [`RoutePolicy::Cost`] policy follows Dynamo's KV router:
//!
//! ```text
//! cost = prefill_load_scale × (prompt blocks − overlap blocks) + decode blocks
//! ```
//!
//! with the overlap credited from the router's [`crate::prefix`] index and the decode
//! blocks the engine's last load report (`context_blocks`) plus the blocks of requests
//! the router sent since that report was taken (`pending_blocks`), so a burst does not
//! land on one endpoint before its next report.
//!
//! Decode blocks are counted per request, a shared prefix once for every request that
//! holds it: each running request costs a forward pass per step and attends over its
//! whole context, whether or not its blocks are shared. (Counting the pool's distinct
//! blocks instead makes requests that share one prefix look almost free, so one
//! replica takes all of a hot prefix's traffic.) The router's own corrections — blocks
//! sent since the report, blocks finished since — are per request too, so the units
//! agree.
//!
//! Lowest cost first; ties go to fewer requests in flight, then rotate with the caller's
//! round-robin counter so equal endpoints share the load.
//!
//! Two rules the formula and the fallback carry:
//! - **Hot spots.** With one prefix shared by all traffic, every endpoint that holds it
//!   has full overlap, and the one that holds it first would get everything under a
//!   prefix-only score. Here a replica's saved prefill (`scale × overlap`) is weighed
//!   against its decode load: once its decode blocks exceed what a cold replica would
//!   pay to prefill the prompt, the cold one is cheaper and traffic spreads (and the cold
//!   one then holds the prefix too).
//! - **Never a frozen choice.** Without a fresh load report for every eligible endpoint
//!   the costs are not comparable (a missing report is not zero load), so the policy
//!   falls back to least-in-flight, the router's own instant count, for all of them.
//!
//! Pure: plain data in, a [`Ranking`] out, `now` as a parameter.

use std::time::{Duration, Instant};

use slipway_contract::router::{RoutePolicy, RouterArgs};

/// The choice's parameters, from the router's command line.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Params {
    /// How to order the eligible endpoints.
    pub policy: RoutePolicy,
    /// Weight of one uncached prompt block against one decode block in use.
    pub prefill_load_scale: f64,
    /// Requests waiting at which an endpoint is saturated. 0 turns the filter off: a
    /// threshold every endpoint always meets would refuse all traffic.
    pub saturation_waiting: usize,
    /// Age beyond which a load report is stale.
    pub load_stale: Duration,
}

impl Params {
    /// The parameters `args` gives.
    #[must_use]
    pub fn from_args(args: &RouterArgs) -> Self {
        Self {
            policy: args.policy,
            prefill_load_scale: args.prefill_load_scale,
            saturation_waiting: args.saturation_waiting,
            load_stale: args.load_stale,
        }
    }
}

/// An endpoint's last load report, as the router sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadView {
    /// Requests waiting in the engine's queue.
    pub waiting: usize,
    /// KV blocks in the running requests' contexts, a shared prefix once per request
    /// (the engine's `context_blocks`): the decode load.
    pub context_blocks: usize,
    /// Blocks of requests the router sent since this report was taken (not in it yet).
    pub pending_blocks: usize,
    /// Uncached prompt blocks of the router's requests here still waiting for their
    /// first token: prefill work the engine has queued or is doing (Dynamo counts a
    /// worker's active prefill blocks the same way).
    pub prefill_backlog_blocks: usize,
    /// When the report was read.
    pub taken_at: Instant,
}

/// One endpoint of the release, as the choice needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Candidate {
    /// It serves the model (or adapter) the request names.
    pub serves_model: bool,
    /// Its EndpointSlice condition says ready (or, without Kubernetes, it answers).
    pub ready: bool,
    /// Its pod is terminating or its engine is draining.
    pub terminating: bool,
    /// It answered 503/429 and gets nothing new until then.
    pub backoff_until: Option<Instant>,
    /// Its last load report, if any was read.
    pub load: Option<LoadView>,
    /// Requests the router has in flight to it now.
    pub in_flight: u32,
    /// Leading prompt blocks it is believed to hold ([`crate::prefix::PrefixIndex::overlap`]).
    pub overlap_blocks: usize,
}

/// Why an endpoint was not eligible for a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Exclusion {
    /// It does not serve the requested model or adapter.
    ModelNotServed,
    /// Not ready.
    NotReady,
    /// Terminating or draining.
    Terminating,
    /// Inside a backoff after a 503/429.
    BackingOff,
    /// A fresh load report shows its queue at the saturation threshold.
    Saturated,
}

impl Exclusion {
    /// Every reason, in filter order (to pre-register metric label values).
    pub const ALL: [Self; 5] = [
        Self::ModelNotServed,
        Self::NotReady,
        Self::Terminating,
        Self::BackingOff,
        Self::Saturated,
    ];

    /// The metric label value.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ModelNotServed => "model_not_served",
            Self::NotReady => "not_ready",
            Self::Terminating => "terminating",
            Self::BackingOff => "backing_off",
            Self::Saturated => "saturated",
        }
    }
}

impl std::fmt::Display for Exclusion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The outcome of [`rank`].
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Ranking {
    /// Candidate indexes, best first (the retry order).
    pub order: Vec<usize>,
    /// Candidates that failed a hard filter, by index, with the first filter they failed.
    pub excluded: Vec<(usize, Exclusion)>,
    /// True when the cost policy fell back to least-in-flight because some eligible
    /// candidate's load is missing or older than `load_stale`.
    pub fell_back: bool,
}

/// Dynamo's KV router cost of sending a request of `prompt_blocks` blocks to an
/// endpoint with this load and overlap: lower is better.
#[must_use]
pub fn cost(load: &LoadView, overlap_blocks: usize, prompt_blocks: usize, scale: f64) -> f64 {
    let uncached = prompt_blocks
        .saturating_sub(overlap_blocks)
        .saturating_add(load.prefill_backlog_blocks);
    let decode = load.context_blocks.saturating_add(load.pending_blocks);
    // usize → f64 loses precision only past 2^53 blocks, far beyond any KV pool.
    scale * uncached as f64 + decode as f64
}

/// Orders `candidates` for one request of `prompt_blocks` blocks: excluded ones apart,
/// eligible ones best first. `round_robin` is a counter the caller advances per request;
/// it rotates ties (and the round-robin policy) so equal endpoints share the load.
/// If every candidate is excluded, `order` is empty.
#[must_use]
pub fn rank(
    candidates: &[Candidate],
    prompt_blocks: usize,
    params: &Params,
    now: Instant,
    round_robin: u64,
) -> Ranking {
    let mut excluded = Vec::new();
    let mut eligible = Vec::with_capacity(candidates.len());
    for (i, c) in candidates.iter().enumerate() {
        match exclusion(c, params, now) {
            Some(reason) => excluded.push((i, reason)),
            None => eligible.push(i),
        }
    }

    let mut fell_back = false;
    let keyed: Vec<Keyed> = match params.policy {
        RoutePolicy::RoundRobin => eligible.iter().map(|&index| Keyed::flat(index)).collect(),
        RoutePolicy::LeastInFlight => eligible
            .iter()
            .map(|&index| Keyed::in_flight(index, candidates))
            .collect(),
        RoutePolicy::Cost => {
            let loads: Option<Vec<LoadView>> = eligible
                .iter()
                .map(|&i| fresh_load(&candidates[i], params.load_stale, now))
                .collect();
            match loads {
                Some(loads) => eligible
                    .iter()
                    .zip(loads)
                    .map(|(&index, load)| {
                        let c = &candidates[index];
                        Keyed {
                            index,
                            cost: cost(
                                &load,
                                c.overlap_blocks,
                                prompt_blocks,
                                params.prefill_load_scale,
                            ),
                            in_flight: c.in_flight,
                        }
                    })
                    .collect(),
                None => {
                    fell_back = true;
                    eligible
                        .iter()
                        .map(|&index| Keyed::in_flight(index, candidates))
                        .collect()
                }
            }
        }
    };

    Ranking {
        order: order_with_rotated_ties(keyed, round_robin),
        excluded,
        fell_back,
    }
}

/// The first hard filter `c` fails, in the documented order.
fn exclusion(c: &Candidate, params: &Params, now: Instant) -> Option<Exclusion> {
    if !c.serves_model {
        return Some(Exclusion::ModelNotServed);
    }
    if !c.ready {
        return Some(Exclusion::NotReady);
    }
    if c.terminating {
        return Some(Exclusion::Terminating);
    }
    if c.backoff_until.is_some_and(|until| until > now) {
        return Some(Exclusion::BackingOff);
    }
    // A stale report cannot prove saturation; the endpoint stays eligible and the
    // least-in-flight fallback keeps it from being flooded.
    let saturated = params.saturation_waiting > 0
        && fresh_load(c, params.load_stale, now)
            .is_some_and(|load| load.waiting >= params.saturation_waiting);
    saturated.then_some(Exclusion::Saturated)
}

/// The load report, if there is one no older than `stale`.
fn fresh_load(c: &Candidate, stale: Duration, now: Instant) -> Option<LoadView> {
    c.load
        .filter(|load| now.saturating_duration_since(load.taken_at) <= stale)
}

/// An eligible candidate with its sort key.
#[derive(Clone, Copy, Debug)]
struct Keyed {
    index: usize,
    cost: f64,
    in_flight: u32,
}

impl Keyed {
    /// All equal: pure rotation.
    fn flat(index: usize) -> Self {
        Self {
            index,
            cost: 0.0,
            in_flight: 0,
        }
    }

    /// Keyed by in-flight count alone.
    fn in_flight(index: usize, candidates: &[Candidate]) -> Self {
        Self {
            index,
            cost: 0.0,
            in_flight: candidates[index].in_flight,
        }
    }

    fn same_key(&self, other: &Self) -> bool {
        self.cost.total_cmp(&other.cost).is_eq() && self.in_flight == other.in_flight
    }
}

/// Sorts by (cost, in flight, index), then rotates each run of equal keys left by
/// `round_robin % run length`: among `k` equal endpoints, `k` successive counter
/// values put each of them first once.
fn order_with_rotated_ties(mut keyed: Vec<Keyed>, round_robin: u64) -> Vec<usize> {
    keyed.sort_by(|a, b| {
        a.cost
            .total_cmp(&b.cost)
            .then(a.in_flight.cmp(&b.in_flight))
            .then(a.index.cmp(&b.index))
    });
    let mut start = 0;
    while start < keyed.len() {
        let mut end = start + 1;
        while end < keyed.len() && keyed[end].same_key(&keyed[start]) {
            end += 1;
        }
        let run = &mut keyed[start..end];
        // `run.len()` ≥ 1 and fits in u64; the remainder is < run.len(), so fits usize.
        let shift = usize::try_from(round_robin % run.len() as u64).unwrap_or(0);
        run.rotate_left(shift);
        start = end;
    }
    keyed.into_iter().map(|k| k.index).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const STALE: Duration = Duration::from_secs(2);

    fn params(policy: RoutePolicy) -> Params {
        Params {
            policy,
            prefill_load_scale: 1.0,
            saturation_waiting: 16,
            load_stale: STALE,
        }
    }

    /// An eligible endpoint with a fresh, empty load report.
    fn idle(now: Instant) -> Candidate {
        Candidate {
            serves_model: true,
            ready: true,
            terminating: false,
            backoff_until: None,
            load: Some(LoadView {
                waiting: 0,
                context_blocks: 0,
                pending_blocks: 0,
                prefill_backlog_blocks: 0,
                taken_at: now,
            }),
            in_flight: 0,
            overlap_blocks: 0,
        }
    }

    fn loaded(now: Instant, context_blocks: usize, overlap_blocks: usize) -> Candidate {
        let mut c = idle(now);
        if let Some(load) = &mut c.load {
            load.context_blocks = context_blocks;
        }
        c.overlap_blocks = overlap_blocks;
        c
    }

    #[test]
    fn cost_table() {
        struct Row {
            name: &'static str,
            prompt_blocks: usize,
            scale: f64,
            /// (context_blocks, pending_blocks, overlap_blocks, in_flight) per candidate.
            candidates: &'static [(usize, usize, usize, u32)],
            round_robin: u64,
            expect: &'static [usize],
        }
        let rows = [
            Row {
                name: "overlap wins at equal load",
                prompt_blocks: 20,
                scale: 1.0,
                candidates: &[(10, 0, 0, 0), (10, 0, 15, 0), (10, 0, 5, 0)],
                round_robin: 0,
                expect: &[1, 2, 0],
            },
            Row {
                name: "load wins at equal overlap",
                prompt_blocks: 20,
                scale: 1.0,
                candidates: &[(30, 0, 5, 0), (10, 0, 5, 0), (20, 0, 5, 0)],
                round_robin: 0,
                expect: &[1, 2, 0],
            },
            Row {
                name: "pending blocks count as load",
                prompt_blocks: 4,
                scale: 1.0,
                candidates: &[(0, 12, 0, 0), (5, 0, 0, 0)],
                round_robin: 0,
                expect: &[1, 0],
            },
            Row {
                name: "a large scale makes overlap worth more than load",
                prompt_blocks: 20,
                scale: 4.0,
                // 4×20+0 = 80 vs 4×0+50 = 50.
                candidates: &[(0, 0, 0, 0), (50, 0, 20, 0)],
                round_robin: 0,
                expect: &[1, 0],
            },
            Row {
                name: "scale 0 is pure decode load",
                prompt_blocks: 20,
                scale: 0.0,
                candidates: &[(11, 0, 20, 0), (10, 0, 0, 0)],
                round_robin: 0,
                expect: &[1, 0],
            },
            Row {
                name: "overlap beyond the prompt saves no more than the prompt",
                prompt_blocks: 3,
                scale: 1.0,
                // Both cost 0 + 1: a tie on cost, broken by index at round_robin 0.
                candidates: &[(1, 0, 3, 0), (1, 0, 9, 0)],
                round_robin: 0,
                expect: &[0, 1],
            },
            Row {
                name: "equal cost: fewer in flight first",
                prompt_blocks: 10,
                scale: 1.0,
                candidates: &[(5, 0, 0, 3), (5, 0, 0, 1), (5, 0, 0, 2)],
                round_robin: 0,
                expect: &[1, 2, 0],
            },
            Row {
                name: "full ties rotate (counter 1)",
                prompt_blocks: 10,
                scale: 1.0,
                candidates: &[(5, 0, 0, 0), (5, 0, 0, 0), (5, 0, 0, 0)],
                round_robin: 1,
                expect: &[1, 2, 0],
            },
            Row {
                name: "full ties rotate (counter 5)",
                prompt_blocks: 10,
                scale: 1.0,
                candidates: &[(5, 0, 0, 0), (5, 0, 0, 0), (5, 0, 0, 0)],
                round_robin: 5,
                expect: &[2, 0, 1],
            },
            Row {
                name: "only the tied run rotates; the best stays first",
                prompt_blocks: 10,
                scale: 1.0,
                candidates: &[(9, 0, 0, 0), (1, 0, 0, 0), (9, 0, 0, 0)],
                round_robin: 1,
                expect: &[1, 2, 0],
            },
        ];
        let now = Instant::now();
        for row in rows {
            let candidates: Vec<Candidate> = row
                .candidates
                .iter()
                .map(|&(kv, pending, overlap, in_flight)| {
                    let mut c = loaded(now, kv, overlap);
                    if let Some(load) = &mut c.load {
                        load.pending_blocks = pending;
                    }
                    c.in_flight = in_flight;
                    c
                })
                .collect();
            let p = Params {
                prefill_load_scale: row.scale,
                ..params(RoutePolicy::Cost)
            };
            let r = rank(&candidates, row.prompt_blocks, &p, now, row.round_robin);
            assert_eq!(r.order, row.expect, "{}", row.name);
            assert!(!r.fell_back, "{}", row.name);
            assert!(r.excluded.is_empty(), "{}", row.name);
        }
    }

    #[test]
    fn equal_endpoints_share_the_first_place() {
        let now = Instant::now();
        let candidates = vec![idle(now); 4];
        let mut firsts = [0usize; 4];
        for counter in 0..400u64 {
            let r = rank(&candidates, 8, &params(RoutePolicy::Cost), now, counter);
            firsts[r.order[0]] += 1;
        }
        assert_eq!(firsts, [100; 4]);
    }

    #[test]
    fn hot_spot_loses_once_its_decode_load_outweighs_the_saved_prefill() {
        let now = Instant::now();
        let prompt_blocks = 10;
        let p = params(RoutePolicy::Cost);
        // The hot replica holds the whole shared prefix (saving scale × 10 = 10 blocks of
        // prefill); the cold one holds none of it and has no decode load.
        let cold = loaded(now, 0, 0); // cost 1×10 + 0 = 10
        // Decode blocks (11) > saved prefill (10): the cold replica is cheaper.
        let hot_busy = loaded(now, 11, prompt_blocks); // cost 0 + 11 = 11
        let r = rank(&[hot_busy, cold], prompt_blocks, &p, now, 0);
        assert_eq!(
            r.order,
            [1, 0],
            "the busy hot replica must not get everything"
        );

        // Decode blocks (9) < saved prefill (10): the prefix is worth more.
        let hot_light = loaded(now, 9, prompt_blocks); // cost 9 < 10
        let r = rank(&[hot_light, cold], prompt_blocks, &p, now, 0);
        assert_eq!(r.order, [0, 1], "with little decode load the prefix wins");
    }

    #[test]
    fn hot_spot_traffic_spreads_as_the_router_adds_pending_blocks() {
        // One shared prefix for all traffic, two replicas, only replica 0 holds it at
        // first. Each routed request adds its blocks to the chosen replica's pending
        // load (and, once routed, the prefix to its index). Traffic must not all pile
        // onto replica 0.
        let now = Instant::now();
        let prompt_blocks = 8;
        let mut candidates = [loaded(now, 0, prompt_blocks), loaded(now, 0, 0)];
        let mut sent = [0usize; 2];
        for counter in 0..40u64 {
            let r = rank(
                &candidates,
                prompt_blocks,
                &params(RoutePolicy::Cost),
                now,
                counter,
            );
            let best = r.order[0];
            sent[best] += 1;
            candidates[best].overlap_blocks = prompt_blocks;
            if let Some(load) = &mut candidates[best].load {
                load.pending_blocks += prompt_blocks;
            }
        }
        assert_eq!(sent, [20, 20], "balanced once both hold the prefix");
    }

    #[test]
    fn each_hard_filter_excludes_with_its_reason() {
        let now = Instant::now();
        let p = params(RoutePolicy::Cost);
        let mut not_served = idle(now);
        not_served.serves_model = false;
        let mut not_ready = idle(now);
        not_ready.ready = false;
        let mut terminating = idle(now);
        terminating.terminating = true;
        let mut backing_off = idle(now);
        backing_off.backoff_until = Some(now + Duration::from_secs(1));
        let mut saturated = idle(now);
        if let Some(load) = &mut saturated.load {
            load.waiting = 16;
        }
        let candidates = [
            not_served,
            not_ready,
            terminating,
            backing_off,
            saturated,
            idle(now),
        ];
        let r = rank(&candidates, 4, &p, now, 0);
        assert_eq!(r.order, [5]);
        assert_eq!(
            r.excluded,
            [
                (0, Exclusion::ModelNotServed),
                (1, Exclusion::NotReady),
                (2, Exclusion::Terminating),
                (3, Exclusion::BackingOff),
                (4, Exclusion::Saturated),
            ]
        );
        assert!(!r.fell_back);
    }

    #[test]
    fn the_first_failing_filter_is_the_reason() {
        let now = Instant::now();
        let mut c = idle(now);
        c.serves_model = false;
        c.ready = false;
        c.terminating = true;
        let r = rank(&[c], 4, &params(RoutePolicy::Cost), now, 0);
        assert_eq!(r.excluded, [(0, Exclusion::ModelNotServed)]);
        c.serves_model = true;
        let r = rank(&[c], 4, &params(RoutePolicy::Cost), now, 0);
        assert_eq!(r.excluded, [(0, Exclusion::NotReady)]);
        c.ready = true;
        let r = rank(&[c], 4, &params(RoutePolicy::Cost), now, 0);
        assert_eq!(r.excluded, [(0, Exclusion::Terminating)]);
    }

    #[test]
    fn backoff_ends_at_its_instant() {
        let now = Instant::now();
        let mut c = idle(now);
        c.backoff_until = Some(now);
        let r = rank(&[c], 4, &params(RoutePolicy::Cost), now, 0);
        assert_eq!(r.order, [0], "a backoff ending now is over");
        c.backoff_until = Some(now - Duration::from_secs(1));
        assert_eq!(rank(&[c], 4, &params(RoutePolicy::Cost), now, 0).order, [0]);
    }

    #[test]
    fn saturation_needs_a_fresh_report_at_the_threshold() {
        let now = Instant::now();
        let p = params(RoutePolicy::Cost);
        let with_waiting = |waiting: usize, age: Duration| {
            let mut c = idle(now - age);
            if let Some(load) = &mut c.load {
                load.waiting = waiting;
            }
            c
        };
        let below = with_waiting(15, Duration::ZERO);
        assert!(rank(&[below], 4, &p, now, 0).excluded.is_empty());
        let at = with_waiting(16, Duration::ZERO);
        assert_eq!(
            rank(&[at], 4, &p, now, 0).excluded,
            [(0, Exclusion::Saturated)]
        );
        // A stale report of a full queue proves nothing: eligible, via the fallback.
        let stale = with_waiting(100, STALE + Duration::from_millis(1));
        let r = rank(&[stale], 4, &p, now, 0);
        assert!(r.excluded.is_empty());
        assert!(r.fell_back);
        // 0 turns the filter off rather than refusing everything.
        let off = Params {
            saturation_waiting: 0,
            ..p
        };
        assert!(rank(&[at], 4, &off, now, 0).excluded.is_empty());
    }

    #[test]
    fn every_candidate_excluded_gives_an_empty_order() {
        let now = Instant::now();
        let mut c = idle(now);
        c.ready = false;
        for policy in [
            RoutePolicy::Cost,
            RoutePolicy::LeastInFlight,
            RoutePolicy::RoundRobin,
        ] {
            let r = rank(&[c, c], 4, &params(policy), now, 3);
            assert!(r.order.is_empty(), "{policy}");
            assert_eq!(r.excluded.len(), 2, "{policy}");
        }
        assert_eq!(
            rank(&[], 4, &params(RoutePolicy::Cost), now, 0),
            Ranking::default()
        );
    }

    #[test]
    fn missing_or_stale_load_falls_back_to_least_in_flight() {
        let now = Instant::now();
        let p = params(RoutePolicy::Cost);
        // Endpoint 0 would win on cost (full overlap, no load), but endpoint 1 has no
        // report: costs are not comparable, so the fewest in flight goes first.
        let mut best_cost = loaded(now, 0, 10);
        best_cost.in_flight = 5;
        let mut no_report = idle(now);
        no_report.load = None;
        no_report.in_flight = 1;
        let r = rank(&[best_cost, no_report], 10, &p, now, 0);
        assert!(r.fell_back);
        assert_eq!(r.order, [1, 0]);

        // The same with a report older than load_stale.
        let mut stale = loaded(now - STALE - Duration::from_millis(1), 0, 0);
        stale.in_flight = 1;
        let r = rank(&[best_cost, stale], 10, &p, now, 0);
        assert!(r.fell_back);
        assert_eq!(r.order, [1, 0]);

        // Exactly load_stale old is still fresh.
        let mut edge = loaded(now - STALE, 0, 0);
        edge.in_flight = 1;
        let r = rank(&[best_cost, edge], 10, &p, now, 0);
        assert!(!r.fell_back);
        assert_eq!(r.order, [0, 1]);
    }

    #[test]
    fn an_excluded_candidate_without_load_does_not_force_the_fallback() {
        let now = Instant::now();
        let mut gone = idle(now);
        gone.load = None;
        gone.terminating = true;
        let r = rank(
            &[gone, loaded(now, 3, 0)],
            4,
            &params(RoutePolicy::Cost),
            now,
            0,
        );
        assert!(!r.fell_back);
        assert_eq!(r.order, [1]);
    }

    #[test]
    fn the_fallback_rotates_ties_instead_of_freezing() {
        let now = Instant::now();
        let mut c = idle(now);
        c.load = None;
        let candidates = [c, c, c];
        let firsts: Vec<usize> = (0..3)
            .map(|counter| rank(&candidates, 4, &params(RoutePolicy::Cost), now, counter).order[0])
            .collect();
        assert_eq!(firsts, [0, 1, 2]);
    }

    #[test]
    fn least_in_flight_orders_by_in_flight_and_ignores_cost() {
        let now = Instant::now();
        let mut a = loaded(now, 0, 10);
        a.in_flight = 4;
        let mut b = loaded(now, 100, 0);
        b.in_flight = 2;
        let mut c = idle(now);
        c.load = None;
        c.in_flight = 2;
        let p = params(RoutePolicy::LeastInFlight);
        let r = rank(&[a, b, c], 10, &p, now, 0);
        assert_eq!(r.order, [1, 2, 0]);
        assert!(
            !r.fell_back,
            "least-in-flight is the policy, not a fallback"
        );
        assert_eq!(rank(&[a, b, c], 10, &p, now, 1).order, [2, 1, 0]);
    }

    #[test]
    fn round_robin_rotates_over_the_eligible_ones() {
        let now = Instant::now();
        let mut down = idle(now);
        down.ready = false;
        let candidates = [idle(now), down, loaded(now, 50, 0), idle(now)];
        let p = params(RoutePolicy::RoundRobin);
        let orders: Vec<Vec<usize>> = (0..4)
            .map(|counter| rank(&candidates, 4, &p, now, counter).order)
            .collect();
        assert_eq!(
            orders,
            [vec![0, 2, 3], vec![2, 3, 0], vec![3, 0, 2], vec![0, 2, 3]]
        );
        assert_eq!(
            rank(&candidates, 4, &p, now, 0).excluded,
            [(1, Exclusion::NotReady)]
        );
        assert_eq!(rank(&candidates, 4, &p, now, u64::MAX).order.len(), 3);
    }

    #[test]
    fn exclusion_labels() {
        let labels: Vec<&str> = Exclusion::ALL.iter().map(|e| e.as_str()).collect();
        assert_eq!(
            labels,
            [
                "model_not_served",
                "not_ready",
                "terminating",
                "backing_off",
                "saturated"
            ]
        );
        assert_eq!(Exclusion::Saturated.to_string(), "saturated");
    }

    #[test]
    fn params_come_from_the_router_args() {
        let args = RouterArgs::for_inference_service("chat").unwrap();
        let p = Params::from_args(&args);
        assert_eq!(p.policy, RoutePolicy::Cost);
        assert_eq!(p.saturation_waiting, args.saturation_waiting);
        assert_eq!(p.load_stale, args.load_stale);
        assert!((p.prefill_load_scale - args.prefill_load_scale).abs() < f64::EPSILON);
    }
}
