//! Runs a load: open loop (arrivals on a schedule) or closed loop (sessions).
//!
//! Open loop: one task walks the schedule and, at each arrival time, either spawns the
//! request or — when `max_in_flight` requests are already out — records it as
//! `ClientCapped`. It never waits for a response before the next arrival, so a slow
//! server cannot slow the offered load (no coordinated omission), and it never queues
//! in the client, where the wait would be hidden from the server's numbers.
//!
//! Closed loop: N sessions, each sending its next request when the previous one ended
//! plus a think time. Use it for interactive-session questions, never for capacity.
//!
//! While a run lasts, the server's own gauges of requests running and waiting are
//! scraped every [`SAMPLE_INTERVAL`] (the first scrape before the first send), for the
//! Little's-law check ([`crate::occupancy`]). After the arrival window the run waits up to `drain` for stragglers, then cancels
//! them (outcome `Cancelled`, "run ended"): nothing is left uncounted.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use indicatif::ProgressBar;
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand_distr::{Distribution, Exp};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::client::{Client, RunClock};
use crate::occupancy::{SAMPLE_INTERVAL, ServerSample};
use crate::record::{Outcome, RequestRecord};
use crate::workload::RequestPlan;

/// How long a run lasts and how much it may have outstanding.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RunLimits {
    /// Arrival window, seconds: open-loop arrivals after it are not sent; closed-loop
    /// sessions start no request after it.
    pub window_s: f64,
    /// Grace after the window for requests in flight, seconds; then they are cancelled.
    pub drain_s: f64,
    /// Cap on requests in flight (open loop).
    pub max_in_flight: usize,
}

/// Everything a run produced.
#[derive(Debug, Clone, Default)]
pub struct RunOutput {
    /// One record per offered request, sorted by id.
    pub records: Vec<RequestRecord>,
    /// The server's requests in system, sampled during the run (empty when it exports
    /// no such gauges).
    pub server: Vec<ServerSample>,
    /// Most requests that were in flight at once.
    pub peak_in_flight: usize,
}

/// Shared bookkeeping of the in-flight set.
#[derive(Clone, Default)]
struct InFlight {
    now: Arc<AtomicUsize>,
    peak: Arc<AtomicUsize>,
}

impl InFlight {
    fn enter(&self) {
        let n = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.peak.fetch_max(n, Ordering::SeqCst);
    }

    fn leave(&self) {
        self.now.fetch_sub(1, Ordering::SeqCst);
    }

    fn finish(self, mut records: Vec<RequestRecord>, server: Vec<ServerSample>) -> RunOutput {
        records.sort_by_key(|r| r.id);
        RunOutput {
            records,
            server,
            peak_in_flight: self.peak.load(Ordering::SeqCst),
        }
    }
}

/// Scrapes the server's requests in system every [`SAMPLE_INTERVAL`] until stopped.
struct Sampler {
    stop: watch::Sender<bool>,
    task: Option<tokio::task::JoinHandle<Vec<ServerSample>>>,
    first: Vec<ServerSample>,
}

impl Sampler {
    /// Takes the first sample now (before the run sends anything) and, when the
    /// server has the gauges, keeps sampling in a task.
    async fn start(client: &Client, clock: RunClock) -> Self {
        let (stop, mut stopped) = watch::channel(false);
        let Some(first) = client.server_in_system(clock).await else {
            return Self {
                stop,
                task: None,
                first: Vec::new(),
            };
        };
        let client = client.clone();
        let task = tokio::spawn(async move {
            let mut samples = Vec::new();
            let mut ticks = tokio::time::interval(SAMPLE_INTERVAL);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticks.tick().await;
            loop {
                tokio::select! {
                    _ = stopped.wait_for(|s| *s) => break,
                    _ = ticks.tick() => {}
                }
                // A scrape that fails holds the last value (the average is a step
                // function); the run is not the place to give up on the server.
                if let Some(sample) = client.server_in_system(clock).await {
                    samples.push(sample);
                }
            }
            samples
        });
        Self {
            stop,
            task: Some(task),
            first: vec![first],
        }
    }

    /// Stops sampling; every sample, in time order.
    async fn finish(self) -> Vec<ServerSample> {
        let _ = self.stop.send(true);
        let mut samples = self.first;
        if let Some(task) = self.task {
            match task.await {
                Ok(more) => samples.extend(more),
                Err(error) => tracing::error!(%error, "server sampling task failed"),
            }
        }
        samples
    }
}

fn tick(progress: Option<&ProgressBar>, r: &RequestRecord, in_flight: &InFlight) {
    if let Some(p) = progress {
        p.inc(1);
        // Only failures worth reading one by one; rejections and caps are counted in
        // the summary and can come by the thousand under overload.
        if r.outcome == Outcome::Error {
            p.println(format!(
                "request {} {:?}{}",
                r.id,
                r.outcome,
                r.error
                    .as_ref()
                    .map(|e| format!(": {e}"))
                    .unwrap_or_default()
            ));
        }
        p.set_message(format!(
            "in flight {}",
            in_flight.now.load(Ordering::SeqCst)
        ));
    }
}

async fn one(
    client: Client,
    plan: RequestPlan,
    mut rec: RequestRecord,
    clock: RunClock,
    stop: watch::Receiver<bool>,
    in_flight: InFlight,
) -> RequestRecord {
    client.send(&plan, &mut rec, clock, stop).await;
    in_flight.leave();
    rec
}

/// Drives the open-loop schedule in `plans` (each plan's `arrival_s`).
pub async fn open_loop(
    client: &Client,
    plans: Vec<RequestPlan>,
    limits: RunLimits,
    progress: Option<&ProgressBar>,
) -> RunOutput {
    let clock = RunClock::start();
    let sampler = Sampler::start(client, clock).await;
    let (stop_tx, stop_rx) = watch::channel(false);
    let in_flight = InFlight::default();
    let mut tasks = JoinSet::new();
    let mut records = Vec::with_capacity(plans.len());
    for plan in plans.into_iter().filter(|p| p.arrival_s < limits.window_s) {
        // Collect what has finished so far, so memory stays bounded on long runs.
        while let Some(Ok(r)) = tasks.try_join_next() {
            tick(progress, &r, &in_flight);
            records.push(r);
        }
        tokio::time::sleep_until(clock.at(plan.arrival_s)).await;
        let mut rec = RequestRecord::new(&plan, plan.arrival_s);
        if in_flight.now.load(Ordering::SeqCst) >= limits.max_in_flight {
            rec.outcome = Outcome::ClientCapped;
            tick(progress, &rec, &in_flight);
            records.push(rec);
            continue;
        }
        rec.sent_s = Some(clock.now_s());
        in_flight.enter();
        tasks.spawn(one(
            client.clone(),
            plan,
            rec,
            clock,
            stop_rx.clone(),
            in_flight.clone(),
        ));
    }
    drain(
        tasks,
        clock,
        limits,
        stop_tx,
        progress,
        &in_flight,
        &mut records,
    )
    .await;
    in_flight.finish(records, sampler.finish().await)
}

async fn drain(
    mut tasks: JoinSet<RequestRecord>,
    clock: RunClock,
    limits: RunLimits,
    stop_tx: watch::Sender<bool>,
    progress: Option<&ProgressBar>,
    in_flight: &InFlight,
    records: &mut Vec<RequestRecord>,
) {
    let cancel_at = clock.at(limits.window_s + limits.drain_s);
    let mut stopped = false;
    loop {
        tokio::select! {
            next = tasks.join_next() => match next {
                Some(Ok(r)) => {
                    tick(progress, &r, in_flight);
                    records.push(r);
                }
                Some(Err(error)) => tracing::error!(%error, "request task failed"),
                None => break,
            },
            () = tokio::time::sleep_until(cancel_at), if !stopped => {
                stopped = true;
                // Receivers may all be gone already; then there is nothing to cancel.
                let _ = stop_tx.send(true);
            }
        }
    }
}

/// Closed-loop configuration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sessions {
    /// Concurrent sessions.
    pub count: usize,
    /// Mean think time between a response and the next request, seconds
    /// (exponentially distributed; 0 = none).
    pub think_s: f64,
    /// Seed for think times.
    pub seed: u64,
}

/// Runs `sessions` closed-loop sessions drawing requests from `plans` in order until
/// the window ends or the plans run out.
pub async fn closed_loop(
    client: &Client,
    plans: Vec<RequestPlan>,
    sessions: Sessions,
    limits: RunLimits,
    progress: Option<&ProgressBar>,
) -> RunOutput {
    let clock = RunClock::start();
    let sampler = Sampler::start(client, clock).await;
    let (stop_tx, stop_rx) = watch::channel(false);
    let in_flight = InFlight::default();
    let queue = Arc::new(Mutex::new(plans.into_iter()));
    let mut tasks: JoinSet<Vec<RequestRecord>> = JoinSet::new();
    for s in 0..sessions.count {
        let (client, queue, stop, in_flight) = (
            client.clone(),
            queue.clone(),
            stop_rx.clone(),
            in_flight.clone(),
        );
        let progress = progress.cloned();
        let mut rng = StdRng::seed_from_u64(sessions.seed.wrapping_add(s as u64));
        let think = (sessions.think_s > 0.0)
            .then(|| Exp::new(1.0 / sessions.think_s).ok())
            .flatten();
        tasks.spawn(async move {
            let mut mine = Vec::new();
            loop {
                let t = clock.now_s();
                let next = queue.lock().unwrap_or_else(PoisonError::into_inner).next();
                let Some(plan) = next.filter(|_| t < limits.window_s && !*stop.borrow()) else {
                    break;
                };
                // In a closed loop the request "arrives" when its session sends it.
                let mut rec = RequestRecord::new(&plan, t);
                rec.sent_s = Some(t);
                in_flight.enter();
                let r = one(
                    client.clone(),
                    plan,
                    rec,
                    clock,
                    stop.clone(),
                    in_flight.clone(),
                )
                .await;
                tick(progress.as_ref(), &r, &in_flight);
                mine.push(r);
                if let Some(d) = &think {
                    tokio::time::sleep(Duration::from_secs_f64(d.sample(&mut rng))).await;
                }
            }
            mine
        });
    }
    let cancel_at = clock.at(limits.window_s + limits.drain_s);
    let mut records = Vec::new();
    let mut stopped = false;
    loop {
        tokio::select! {
            next = tasks.join_next() => match next {
                Some(Ok(rs)) => records.extend(rs),
                Some(Err(error)) => tracing::error!(%error, "session task failed"),
                None => break,
            },
            () = tokio::time::sleep_until(cancel_at), if !stopped => {
                stopped = true;
                let _ = stop_tx.send(true);
            }
        }
    }
    in_flight.finish(records, sampler.finish().await)
}
