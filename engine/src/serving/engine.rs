//! The engine actor: one tokio task owns the [`Scheduler`], the [`ModelRunner`] and
//! (through the scheduler) the block tables. Callers hold a cloneable
//! [`EngineHandle`] that sends commands over a bounded channel; each request gets
//! its own stream of [`Event`]s back.
//!
//! Ordering of one loop turn: take every pending command (submits, cancels), drop
//! requests whose receiver is gone (a disconnected client frees its KV here, before
//! the next step), schedule, execute the step on a blocking thread (the runner's
//! forward pass, sampling and stop-token checks, so the runtime keeps serving HTTP
//! meanwhile), update the scheduler with the sampled tokens, send events. The actor
//! hands the runner plain data (the batch and each sequence's [`SeqSampling`], with
//! this token's draw from the request's seeded RNG) and gets plain data back
//! ([`ModelOutput`]); it never sees logits.
//!
//! Shutdown: when every handle is dropped the command channel closes and the actor
//! ends every request with [`RequestError::Shutdown`] and returns the runner. A send to a
//! closed actor is reported as [`EngineError::Closed`], never a panic.
//! [`EngineHandle::abort_all`] ends every request with [`RequestError::Aborted`]
//! without stopping the actor (the end of a drain's shutdown budget). A failed
//! forward step ends its requests with [`RequestError::Backend`].
//!
//! Metrics: the actor alone sees the scheduler, so it keeps the gauges (running,
//! waiting, KV usage), the token and prefix-cache counters and the queue-time
//! histogram of [`ServingMetrics`] current, after every command batch and step.
//!
//! LoRA: a request names an adapter by its index in the runner's
//! [`ModelRunner::adapters`]; the actor refuses an index the runner does not serve
//! and writes the adapter's identity (name and file sha256) into the request's
//! [`CacheKey`] itself, so no caller can make two adapters, or an adapter and the
//! base model, share prefix-cache blocks.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use super::block_manager::CacheKey;
use super::metrics::ServingMetrics;
use super::request_trace::RequestTrace;
use super::scheduler::{
    AddError, FinishReason, RequestId, SchedRequest, Scheduler, SchedulerConfig,
    SchedulerConfigError,
};
use crate::backend::{ModelOutput, ModelRunner};
use crate::sampling::{Sampler, SamplingParams, SeqSampling};

/// A model runner the actor can move to a blocking thread.
pub type BoxedRunner = Box<dyn ModelRunner + Send>;

/// Settings of the actor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// Scheduler and KV pool.
    pub scheduler: SchedulerConfig,
    /// Capacity of the command channel (back-pressure on submitters).
    pub command_capacity: usize,
    /// Test-only fault injection: a pause added after every step that generates
    /// tokens (a slow release for rollout tests). Zero in production.
    pub inject_step_delay: Duration,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            scheduler: SchedulerConfig::default(),
            command_capacity: 1024,
            inject_step_delay: Duration::ZERO,
        }
    }
}

impl EngineConfig {
    /// Checks the values.
    ///
    /// # Errors
    /// The first bad value.
    pub fn validate(&self) -> Result<(), EngineConfigError> {
        self.scheduler.validate()?;
        if self.command_capacity == 0 {
            return Err(EngineConfigError::CommandCapacity);
        }
        Ok(())
    }
}

/// A bad [`EngineConfig`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EngineConfigError {
    /// The scheduler's or its KV pool's.
    #[error(transparent)]
    Scheduler(#[from] SchedulerConfigError),
    /// A command channel that holds nothing.
    #[error("command_capacity must be at least 1")]
    CommandCapacity,
}

/// What to generate.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateRequest {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Sampling settings.
    pub sampling: SamplingParams,
    /// End-of-generation tokens.
    pub eos: Vec<u32>,
    /// Prefix-cache separation. Its `adapter` is overwritten by the engine from
    /// `adapter`.
    pub cache_key: CacheKey,
    /// The LoRA adapter to run under (an index into the runner's
    /// [`ModelRunner::adapters`]); `None` for the base model.
    pub adapter: Option<u16>,
}

/// One event of a request's stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// A generated token.
    Token(u32),
    /// The request ended; no more events follow.
    Finished {
        /// Why.
        reason: FinishReason,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Generated tokens.
        completion_tokens: usize,
        /// Prompt tokens served from the prefix cache.
        cached_tokens: usize,
    },
    /// The request failed after it was accepted; no more events follow.
    Error(RequestError),
}

/// Why an accepted request failed. The HTTP layer answers the first two with 503
/// (the request may succeed elsewhere or later) and a backend failure with 500.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The engine stopped (every handle dropped) before the request finished.
    #[error("the engine shut down")]
    Shutdown,
    /// Ended by [`EngineHandle::abort_all`]; the reason it was given.
    #[error("{0}")]
    Aborted(String),
    /// The model runner failed the step that carried the request.
    #[error("engine error: {0}")]
    Backend(String),
}

/// Errors of the handle.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    /// The actor has stopped.
    #[error("the engine has shut down")]
    Closed,
    /// The request could never run.
    #[error(transparent)]
    Rejected(#[from] AddError),
}

/// A snapshot of the engine's state, for metrics and admission.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineStats {
    /// Requests running.
    pub running: usize,
    /// Requests waiting.
    pub waiting: usize,
    /// Fraction of KV blocks in use.
    pub kv_usage: f64,
    /// Free KV blocks.
    pub free_blocks: usize,
    /// Prefix-cache tokens queried.
    pub prefix_queries: u64,
    /// Prefix-cache tokens hit.
    pub prefix_hits: u64,
}

enum Command {
    Submit {
        id: RequestId,
        req: Box<GenerateRequest>,
        events: mpsc::UnboundedSender<Event>,
        accepted: oneshot::Sender<Result<(), AddError>>,
        /// The caller's span: the request's spans in the engine go under it.
        span: tracing::Span,
    },
    Cancel(RequestId),
    Stats(oneshot::Sender<EngineStats>),
    AbortAll(String),
}

/// A cloneable handle to the actor.
#[derive(Clone, Debug)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    next_id: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

/// A submitted request: its id and its event stream. Dropping it cancels the request.
#[derive(Debug)]
pub struct RequestStream {
    /// The request's id in the engine.
    pub id: RequestId,
    /// Its events.
    pub events: mpsc::UnboundedReceiver<Event>,
}

impl EngineHandle {
    /// Queues a request; returns its stream once the engine accepted it. The
    /// request's queue, prefill and decode spans go under the current span.
    ///
    /// # Errors
    /// [`EngineError::Rejected`] if it could never run, [`EngineError::Closed`]
    /// after shutdown.
    pub async fn submit(&self, req: GenerateRequest) -> Result<RequestStream, EngineError> {
        let id = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (events_tx, events) = mpsc::unbounded_channel();
        let (accepted, accepted_rx) = oneshot::channel();
        self.tx
            .send(Command::Submit {
                id,
                req: Box::new(req),
                events: events_tx,
                accepted,
                span: tracing::Span::current(),
            })
            .await
            .map_err(|_| EngineError::Closed)?;
        accepted_rx.await.map_err(|_| EngineError::Closed)??;
        Ok(RequestStream { id, events })
    }

    /// Cancels a request (its blocks are freed before the next step).
    ///
    /// # Errors
    /// [`EngineError::Closed`] after shutdown.
    pub async fn cancel(&self, id: RequestId) -> Result<(), EngineError> {
        self.tx
            .send(Command::Cancel(id))
            .await
            .map_err(|_| EngineError::Closed)
    }

    /// Ends every admitted request now with [`RequestError::Aborted`] carrying `message`,
    /// freeing their blocks; the engine keeps serving new requests.
    ///
    /// # Errors
    /// [`EngineError::Closed`] after shutdown.
    pub async fn abort_all(&self, message: impl Into<String>) -> Result<(), EngineError> {
        self.tx
            .send(Command::AbortAll(message.into()))
            .await
            .map_err(|_| EngineError::Closed)
    }

    /// The engine's current state.
    ///
    /// # Errors
    /// [`EngineError::Closed`] after shutdown.
    pub async fn stats(&self) -> Result<EngineStats, EngineError> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Command::Stats(tx))
            .await
            .map_err(|_| EngineError::Closed)?;
        rx.await.map_err(|_| EngineError::Closed)
    }
}

struct Active {
    events: mpsc::UnboundedSender<Event>,
    adapter: Option<u16>,
    /// The request's settings and seeded RNG: each step that samples for it takes one
    /// draw here and sends it down with the batch.
    sampler: Sampler,
    /// Prompt and output so far, for the penalties (sent only when one is on).
    history: Vec<u32>,
    /// Tokens that end the request (the runner checks each sampled token).
    eos: Vec<u32>,
    prompt_tokens: usize,
    generated: usize,
    submitted: Instant,
    scheduled: bool,
    trace: RequestTrace,
}

/// What the loop owns besides the runner.
struct Actor {
    s: Scheduler,
    active: HashMap<RequestId, Active>,
    metrics: Arc<ServingMetrics>,
    /// Prefix-cache counters already added to the metrics.
    prefix_seen: (u64, u64),
    /// The prefix-cache identity of each of the runner's adapters, by index.
    adapter_keys: Vec<String>,
}

impl Actor {
    /// Brings the gauges and prefix-cache counters up to date.
    fn publish(&mut self) {
        let st = stats_of(&self.s);
        let m = &self.metrics;
        m.running.set(st.running as i64);
        m.waiting.set(st.waiting as i64);
        m.kv_usage.set(st.kv_usage);
        m.context_blocks
            .set(i64::try_from(self.s.blocks().context_blocks()).unwrap_or(i64::MAX));
        m.prefix_queries
            .inc_by(st.prefix_queries.saturating_sub(self.prefix_seen.0));
        m.prefix_hits
            .inc_by(st.prefix_hits.saturating_sub(self.prefix_seen.1));
        self.prefix_seen = (st.prefix_queries, st.prefix_hits);
    }
}

/// Starts the actor on the current tokio runtime, with metrics of its own.
///
/// # Errors
/// An invalid config.
pub fn spawn(
    runner: BoxedRunner,
    config: EngineConfig,
) -> Result<(EngineHandle, tokio::task::JoinHandle<BoxedRunner>), EngineConfigError> {
    spawn_with_metrics(runner, config, Arc::new(ServingMetrics::new("", "")))
}

/// Starts the actor on the current tokio runtime, keeping `metrics` current.
///
/// # Errors
/// An invalid config.
pub fn spawn_with_metrics(
    runner: BoxedRunner,
    config: EngineConfig,
    metrics: Arc<ServingMetrics>,
) -> Result<(EngineHandle, tokio::task::JoinHandle<BoxedRunner>), EngineConfigError> {
    config.validate()?;
    let scheduler = Scheduler::new(config.scheduler.clone())?;
    let (tx, rx) = mpsc::channel(config.command_capacity);
    let actor = Actor {
        s: scheduler,
        active: HashMap::new(),
        metrics,
        prefix_seen: (0, 0),
        adapter_keys: runner.adapters().iter().map(|a| a.identity()).collect(),
    };
    let task = tokio::spawn(run(runner, actor, rx, config.inject_step_delay));
    Ok((
        EngineHandle {
            tx,
            next_id: std::sync::Arc::new(std::sync::atomic::AtomicU64::new(1)),
        },
        task,
    ))
}

fn stats_of(s: &Scheduler) -> EngineStats {
    let b = s.blocks();
    let p = b.prefix_stats();
    EngineStats {
        running: s.num_running(),
        waiting: s.num_waiting(),
        kv_usage: b.usage(),
        free_blocks: b.num_free(),
        prefix_queries: p.queries,
        prefix_hits: p.hits,
    }
}

fn handle(cmd: Command, a: &mut Actor) {
    let (s, active) = (&mut a.s, &mut a.active);
    match cmd {
        Command::Submit {
            id,
            req,
            events,
            accepted,
            span,
        } => {
            let req = *req;
            let mut cache_key = req.cache_key;
            let adapter_key = match req.adapter {
                None => Ok(None),
                Some(i) => match a.adapter_keys.get(usize::from(i)) {
                    Some(key) => Ok(Some(key.clone())),
                    None => Err(AddError::UnknownAdapter {
                        adapter: i,
                        served: a.adapter_keys.len(),
                    }),
                },
            };
            let added = match adapter_key {
                Ok(key) => {
                    cache_key.adapter = key;
                    s.add(SchedRequest {
                        id,
                        prompt: req.prompt.clone(),
                        max_tokens: req.max_tokens,
                        cache_key,
                        adapter: req.adapter,
                    })
                }
                Err(e) => Err(e),
            };
            if added.is_ok() {
                a.metrics
                    .of(req.adapter)
                    .prompt_tokens
                    .inc_by(req.prompt.len() as u64);
                active.insert(
                    id,
                    Active {
                        events,
                        adapter: req.adapter,
                        sampler: Sampler::new(req.sampling),
                        eos: req.eos,
                        prompt_tokens: req.prompt.len(),
                        history: req.prompt,
                        generated: 0,
                        submitted: Instant::now(),
                        scheduled: false,
                        trace: RequestTrace::queued(span),
                    },
                );
            }
            // The submitter may have gone away meanwhile; the next turn notices.
            let _ = accepted.send(added);
        }
        Command::Cancel(id) => {
            s.finish(id);
            if let Some(a) = active.remove(&id) {
                let _ = a.events.send(finished(&a, FinishReason::Cancelled, 0));
            }
        }
        Command::Stats(reply) => {
            // Streams dropped before this command are gone in the answer.
            reap(s, active);
            let _ = reply.send(stats_of(s));
        }
        Command::AbortAll(message) => {
            s.finish_all();
            for (id, a) in active.drain() {
                a.trace
                    .in_scope(|| tracing::warn!(request = id, %message, "request aborted"));
                let _ = a
                    .events
                    .send(Event::Error(RequestError::Aborted(message.clone())));
            }
        }
    }
}

/// Ends the requests whose client dropped its stream, freeing their blocks.
fn reap(s: &mut Scheduler, active: &mut HashMap<RequestId, Active>) {
    let gone: Vec<RequestId> = active
        .iter()
        .filter(|(_, a)| a.events.is_closed())
        .map(|(&id, _)| id)
        .collect();
    for id in gone {
        if let Some(a) = active.remove(&id) {
            a.trace
                .in_scope(|| tracing::debug!(request = id, "client went away; request cancelled"));
        }
        s.finish(id);
    }
}

fn finished(a: &Active, reason: FinishReason, cached_tokens: usize) -> Event {
    Event::Finished {
        reason,
        prompt_tokens: a.prompt_tokens,
        completion_tokens: a.generated,
        cached_tokens,
    }
}

/// The next command, waiting as long as it takes; meanwhile the runner hears from
/// the actor every [`ModelRunner::idle_interval`] (a pipeline's keep-alive).
async fn next_command(
    rx: &mut mpsc::Receiver<Command>,
    runner: &mut BoxedRunner,
) -> Option<Command> {
    let Some(every) = runner.idle_interval() else {
        return rx.recv().await;
    };
    loop {
        match tokio::time::timeout(every, rx.recv()).await {
            Ok(cmd) => return cmd,
            // A keep-alive is a few bytes on a socket: not worth a blocking thread.
            Err(_elapsed) => {
                if let Err(error) = runner.idle() {
                    // The runner reports its own failure (a failed group ends
                    // serving); the next step would fail with the same error.
                    tracing::debug!(%error, "keep-alive failed");
                }
            }
        }
    }
}

async fn run(
    mut runner: BoxedRunner,
    mut a: Actor,
    mut rx: mpsc::Receiver<Command>,
    inject_step_delay: Duration,
) -> BoxedRunner {
    'outer: loop {
        if a.s.is_idle() {
            match next_command(&mut rx, &mut runner).await {
                Some(cmd) => handle(cmd, &mut a),
                None => break 'outer,
            }
        }
        loop {
            match rx.try_recv() {
                Ok(cmd) => handle(cmd, &mut a),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => break 'outer,
            }
        }
        // Disconnected clients free their blocks before the next step.
        reap(&mut a.s, &mut a.active);
        let out = a.s.schedule();
        a.publish();
        if out.is_empty() {
            // Nothing runnable (everything just finished or was cancelled): wait for
            // the next command instead of spinning.
            if !a.s.is_idle() {
                match next_command(&mut rx, &mut runner).await {
                    Some(cmd) => handle(cmd, &mut a),
                    None => break 'outer,
                }
            }
            continue;
        }
        let now = Instant::now();
        let mut prefill_spans = Vec::new();
        for seq in &out.seqs {
            let Some(r) = a.active.get_mut(&seq.id) else {
                continue;
            };
            // A request's first chunk starts after the prefix-cache hit.
            let prefix_hit = if r.scheduled { 0 } else { seq.start_pos };
            if !r.scheduled {
                r.scheduled = true;
                r.trace.scheduled();
                a.metrics
                    .of(r.adapter)
                    .queue_time
                    .observe(now.duration_since(r.submitted).as_secs_f64());
            }
            if r.trace.in_prefill() {
                prefill_spans.push(r.trace.prefill_chunk(
                    seq.tokens.len(),
                    seq.start_pos,
                    prefix_hit,
                ));
            }
        }
        let batch = out.batch();
        let sampling: Vec<Option<SeqSampling>> = out
            .seqs
            .iter()
            .map(|seq| {
                let r = a.active.get_mut(&seq.id).filter(|_| seq.samples)?;
                let params = r.sampler.params().clone();
                Some(SeqSampling {
                    uniform: r.sampler.draw(),
                    history: if params.penalizes() {
                        r.history.clone()
                    } else {
                        Vec::new()
                    },
                    params,
                    stop_tokens: r.eos.clone(),
                    logprob: false,
                })
            })
            .collect();
        let joined = tokio::task::spawn_blocking(move || {
            let r = runner.execute(&batch, &sampling);
            (runner, r)
        })
        .await;
        drop(prefill_spans);
        let output: ModelOutput = match joined {
            Ok((r, Ok(output))) => {
                runner = r;
                output
            }
            Ok((r, Err(error))) => {
                runner = r;
                tracing::error!(%error, "forward step failed; its requests are ended");
                for seq in &out.seqs {
                    a.s.finish(seq.id);
                    if let Some(r) = a.active.remove(&seq.id) {
                        r.trace.in_scope(|| {
                            tracing::warn!(request = seq.id, "request ended by the failed step");
                        });
                        let _ = r
                            .events
                            .send(Event::Error(RequestError::Backend(error.to_string())));
                    }
                }
                continue;
            }
            Err(join) => {
                // The runner panicked and is lost: nothing more can be served.
                tracing::error!(error = %join, "forward step panicked; engine stops");
                for (_, r) in a.active.drain() {
                    let _ = r.events.send(Event::Error(RequestError::Backend(
                        "the model runner panicked".into(),
                    )));
                }
                std::panic::resume_unwind(join.into_panic());
            }
        };
        if !inject_step_delay.is_zero() && output.sampled.iter().any(Option::is_some) {
            // Test-only fault injection (--inject-delay-ms): a slower decode step.
            tokio::time::sleep(inject_step_delay).await;
        }
        for o in a.s.update(&out, &output) {
            let Some(r) = a.active.get_mut(&o.id) else {
                continue;
            };
            let mut alive = true;
            if let Some(t) = o.token {
                r.history.push(t);
                r.generated += 1;
                r.trace.token();
                a.metrics.of(r.adapter).generation_tokens.inc();
                alive = r.events.send(Event::Token(t)).is_ok();
            }
            if let Some(reason) = o.finished {
                r.trace.finished(r.generated);
                let _ = r.events.send(finished(r, reason, o.cached_tokens));
                a.active.remove(&o.id);
            } else if !alive {
                a.s.finish(o.id);
                a.active.remove(&o.id);
            }
        }
        a.publish();
    }
    for (_, r) in a.active.drain() {
        let _ = r.events.send(Event::Error(RequestError::Shutdown));
    }
    a.s.finish_all();
    a.publish();
    runner
}

#[cfg(test)]
#[path = "engine_tests.rs"]
mod tests;
