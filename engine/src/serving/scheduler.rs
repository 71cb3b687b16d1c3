//! Continuous-batching scheduler (the shape of vLLM v1's): synchronous, deterministic,
//! with no model and no async runtime inside.
//!
//! Each step, [`Scheduler::schedule`] spends a token budget (`max_batched_tokens`):
//! 1. running requests first, oldest first — one token each when decoding, a chunk of
//!    what is left when a prefill did not fit in one step (chunked prefill);
//! 2. then waiting requests, first come first served, with what is left of the budget,
//!    up to `max_num_seqs` running. A request at the head of the queue that does not
//!    fit blocks those behind it (no overtaking, so no starvation).
//!
//! When a running request needs a block and none is free, the newest running request
//! is preempted by recompute: its blocks are freed and it goes back to the front of
//! the queue, keeping its generated tokens, which are prefilled again (the prefix
//! cache usually makes that cheap).
//!
//! [`Scheduler::update`] takes the sampled tokens of the step, advances each request
//! and finishes those that produced an end-of-generation token or reached
//! `max_tokens` or the context length. Stop strings are text, which this layer does
//! not see: the caller detects them and calls [`Scheduler::finish`], exactly as for a
//! cancellation.
//!
//! Invariant: a request is in exactly one of `waiting` or `running`, and holds KV
//! blocks only while running.

use std::collections::{HashMap, VecDeque};

use super::block_manager::{BlockConfigError, BlockManager, BlockManagerConfig, CacheKey};
use crate::backend::{Batch, LogitsWanted, ModelOutput, SeqChunk};

/// Identifier of a request.
pub type RequestId = u64;

/// Settings of the scheduler.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Most requests running (holding KV) at once.
    pub max_num_seqs: usize,
    /// Most tokens in one forward step.
    pub max_batched_tokens: usize,
    /// Context length: prompt + output never exceed it.
    pub max_model_len: usize,
    /// The KV pool.
    pub blocks: BlockManagerConfig,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            max_num_seqs: 64,
            max_batched_tokens: 512,
            max_model_len: 8192,
            blocks: BlockManagerConfig::default(),
        }
    }
}

impl SchedulerConfig {
    /// Checks the values.
    ///
    /// # Errors
    /// The first bad value.
    pub fn validate(&self) -> Result<(), SchedulerConfigError> {
        self.blocks.validate()?;
        if self.max_num_seqs == 0 {
            return Err(SchedulerConfigError::Zero("max_num_seqs"));
        }
        if self.max_batched_tokens == 0 {
            return Err(SchedulerConfigError::Zero("max_batched_tokens"));
        }
        if self.max_model_len < 2 {
            return Err(SchedulerConfigError::MaxModelLen(self.max_model_len));
        }
        Ok(())
    }
}

/// A bad [`SchedulerConfig`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SchedulerConfigError {
    /// The KV pool.
    #[error(transparent)]
    Blocks(#[from] BlockConfigError),
    /// A limit (the field named) that must be at least 1 is 0.
    #[error("{0} must be at least 1")]
    Zero(&'static str),
    /// A context too short for a prompt token and a generated one.
    #[error("max_model_len must be at least 2, got {0}")]
    MaxModelLen(usize),
}

/// Why a request finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// An end-of-generation token or a stop string.
    Stop,
    /// `max_tokens` or the context length.
    Length,
    /// Cancelled by the client (or it went away).
    Cancelled,
    /// The engine failed while running it.
    Error,
}

impl FinishReason {
    /// The OpenAI `finish_reason` string.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Cancelled => "cancelled",
            Self::Error => "error",
        }
    }
}

/// A request as the scheduler sees it: tokens and when to stop.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchedRequest {
    /// Unique id (the caller's).
    pub id: RequestId,
    /// Prompt token ids (not empty).
    pub prompt: Vec<u32>,
    /// Most tokens to generate (≥ 1).
    pub max_tokens: usize,
    /// Prefix-cache separation (namespace, adapter, salt).
    pub cache_key: CacheKey,
    /// The LoRA adapter it runs under (an index into the runner's adapters).
    pub adapter: Option<u16>,
}

/// Why a request cannot be added.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AddError {
    /// Empty prompt.
    #[error("the prompt has no tokens")]
    EmptyPrompt,
    /// `max_tokens` of 0.
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    /// Longer than the context.
    #[error("prompt of {prompt} tokens leaves no room in a context of {max_model_len}")]
    TooLong {
        /// Prompt tokens.
        prompt: usize,
        /// The context length.
        max_model_len: usize,
    },
    /// Could never fit in the KV pool even alone.
    #[error("request needs {need} KV blocks, the pool has {total}")]
    TooManyBlocks {
        /// Blocks needed for prompt + max_tokens.
        need: usize,
        /// Blocks in the pool.
        total: usize,
    },
    /// The id is taken.
    #[error("request id {0} is already in use")]
    DuplicateId(RequestId),
    /// A LoRA adapter the model runner does not serve.
    #[error("LoRA adapter {adapter} is not served (the runner has {served})")]
    UnknownAdapter {
        /// The index asked for.
        adapter: u16,
        /// Adapters the runner serves.
        served: usize,
    },
}

#[derive(Clone, Debug)]
struct ReqState {
    req: SchedRequest,
    output: Vec<u32>,
    /// Positions whose KV is in the store.
    computed: usize,
    /// Prefix-cache hit of its first admission (reported in usage).
    cached_tokens: Option<usize>,
    preemptions: u32,
}

impl ReqState {
    fn len(&self) -> usize {
        self.req.prompt.len() + self.output.len()
    }

    fn token(&self, pos: usize) -> u32 {
        let p = self.req.prompt.len();
        if pos < p {
            self.req.prompt[pos]
        } else {
            self.output[pos - p]
        }
    }

    fn tokens(&self, range: std::ops::Range<usize>) -> Vec<u32> {
        range.map(|p| self.token(p)).collect()
    }
}

/// One sequence's part of a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScheduledSeq {
    /// The request.
    pub id: RequestId,
    /// Tokens to compute.
    pub tokens: Vec<u32>,
    /// Position of `tokens[0]`.
    pub start_pos: usize,
    /// The request's block table.
    pub block_table: Vec<u32>,
    /// Whether this chunk ends at the request's last token, so a token is sampled.
    pub samples: bool,
    /// The request's LoRA adapter.
    pub adapter: Option<u16>,
}

/// What to run this step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SchedulerOutput {
    /// Sequences in batch order.
    pub seqs: Vec<ScheduledSeq>,
    /// Requests preempted (blocks freed, back in the queue) to make room.
    pub preempted: Vec<RequestId>,
}

impl SchedulerOutput {
    /// Whether there is nothing to run.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }

    /// The forward batch of this step.
    #[must_use]
    pub fn batch(&self) -> Batch {
        Batch {
            seqs: self
                .seqs
                .iter()
                .map(|s| SeqChunk {
                    tokens: s.tokens.clone(),
                    start_pos: s.start_pos,
                    block_table: s.block_table.clone(),
                    logits: if s.samples {
                        LogitsWanted::Last
                    } else {
                        LogitsWanted::None
                    },
                    adapter: s.adapter,
                })
                .collect(),
        }
    }
}

/// What happened to one request in a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestOutput {
    /// The request.
    pub id: RequestId,
    /// The token generated this step, if any.
    pub token: Option<u32>,
    /// Set when the request finished (its blocks are already freed).
    pub finished: Option<FinishReason>,
    /// Prompt tokens served from the prefix cache (on its first token).
    pub cached_tokens: usize,
}

/// The scheduler: queue, running set, KV blocks.
#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    blocks: BlockManager,
    reqs: HashMap<RequestId, ReqState>,
    waiting: VecDeque<RequestId>,
    running: Vec<RequestId>,
}

impl Scheduler {
    /// An idle scheduler.
    ///
    /// # Errors
    /// An invalid config.
    pub fn new(config: SchedulerConfig) -> Result<Self, SchedulerConfigError> {
        config.validate()?;
        let blocks = BlockManager::new(config.blocks.clone())?;
        Ok(Self {
            config,
            blocks,
            reqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
        })
    }

    /// The settings.
    #[must_use]
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// The block manager (read-only: usage, prefix-cache counters).
    #[must_use]
    pub fn blocks(&self) -> &BlockManager {
        &self.blocks
    }

    /// Requests waiting.
    #[must_use]
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Requests running.
    #[must_use]
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Whether nothing is waiting or running.
    #[must_use]
    pub fn is_idle(&self) -> bool {
        self.reqs.is_empty()
    }

    /// Whether `id` is waiting or running.
    #[must_use]
    pub fn contains(&self, id: RequestId) -> bool {
        self.reqs.contains_key(&id)
    }

    /// Queues a request.
    ///
    /// # Errors
    /// [`AddError`] when it could never run.
    pub fn add(&mut self, req: SchedRequest) -> Result<(), AddError> {
        if req.prompt.is_empty() {
            return Err(AddError::EmptyPrompt);
        }
        if req.max_tokens == 0 {
            return Err(AddError::ZeroMaxTokens);
        }
        if req.prompt.len() >= self.config.max_model_len {
            return Err(AddError::TooLong {
                prompt: req.prompt.len(),
                max_model_len: self.config.max_model_len,
            });
        }
        let most = (req.prompt.len() + req.max_tokens).min(self.config.max_model_len);
        let need = self.blocks.blocks_for(most);
        if need > self.blocks.num_blocks() {
            return Err(AddError::TooManyBlocks {
                need,
                total: self.blocks.num_blocks(),
            });
        }
        if self.reqs.contains_key(&req.id) {
            return Err(AddError::DuplicateId(req.id));
        }
        let id = req.id;
        self.reqs.insert(
            id,
            ReqState {
                req,
                output: Vec::new(),
                computed: 0,
                cached_tokens: None,
                preemptions: 0,
            },
        );
        self.waiting.push_back(id);
        Ok(())
    }

    /// Ends a request now (cancellation, stop string, error), freeing its blocks.
    /// Returns whether it was known.
    pub fn finish(&mut self, id: RequestId) -> bool {
        if self.reqs.remove(&id).is_none() {
            return false;
        }
        self.waiting.retain(|&w| w != id);
        if let Some(i) = self.running.iter().position(|&r| r == id) {
            self.running.remove(i);
            // Running requests always hold blocks; ignore the impossible error.
            let _ = self.blocks.free(id);
        }
        true
    }

    /// Ends every request (shutdown); returns their ids.
    pub fn finish_all(&mut self) -> Vec<RequestId> {
        let mut ids: Vec<RequestId> = self.running.clone();
        ids.extend(self.waiting.iter().copied());
        for &id in &ids {
            self.finish(id);
        }
        ids
    }

    /// Decides the next step.
    pub fn schedule(&mut self) -> SchedulerOutput {
        let mut out = SchedulerOutput::default();
        let mut budget = self.config.max_batched_tokens;

        // 1. Running requests, oldest first.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let (len, computed) = {
                let s = &self.reqs[&id];
                (s.len(), s.computed)
            };
            let n = (len - computed).min(budget);
            if n == 0 {
                i += 1;
                continue;
            }
            // Make room, preempting the newest running request until it fits.
            let scheduled = loop {
                match self.blocks.grow(id, computed + n) {
                    Ok(()) => break true,
                    Err(_) => {
                        let Some(&victim) = self.running.last() else {
                            break false;
                        };
                        self.preempt(victim);
                        out.preempted.push(victim);
                        out.seqs.retain(|s| s.id != victim);
                        if victim == id {
                            break false;
                        }
                    }
                }
            };
            if !scheduled {
                break;
            }
            out.seqs.push(self.chunk(id, computed, n));
            budget -= n;
            i += 1;
        }
        // Budget given back by preempted requests' chunks is not reused this step:
        // recompute after preemption should not jump the queue in the same step.

        // 2. Waiting requests, first come first served.
        while budget > 0
            && self.running.len() < self.config.max_num_seqs
            && out.preempted.is_empty()
        {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            let s = &self.reqs[&id];
            let all = s.tokens(0..s.len());
            let key = s.req.cache_key.clone();
            let hit = self.blocks.lookup_prefix(&all, &key);
            let start = hit.tokens;
            let n = (all.len() - start).min(budget);
            if self.blocks.allocate(id, &hit, start + n).is_err() {
                break;
            }
            self.blocks.record_query(all.len(), hit.tokens);
            self.waiting.pop_front();
            self.running.push(id);
            if let Some(s) = self.reqs.get_mut(&id) {
                s.computed = start;
                s.cached_tokens.get_or_insert(start);
            }
            out.seqs.push(self.chunk(id, start, n));
            budget -= n;
        }
        out
    }

    fn chunk(&self, id: RequestId, start: usize, n: usize) -> ScheduledSeq {
        let s = &self.reqs[&id];
        ScheduledSeq {
            id,
            tokens: s.tokens(start..start + n),
            start_pos: start,
            block_table: self.blocks.block_table(id).to_vec(),
            samples: start + n == s.len(),
            adapter: s.req.adapter,
        }
    }

    fn preempt(&mut self, id: RequestId) {
        if let Some(i) = self.running.iter().position(|&r| r == id) {
            self.running.remove(i);
        }
        let _ = self.blocks.free(id);
        if let Some(s) = self.reqs.get_mut(&id) {
            s.computed = 0;
            s.preemptions += 1;
        }
        self.waiting.push_front(id);
    }

    /// Applies a step's results (`model.sampled` in the order of `sched.seqs`):
    /// advances computed positions, registers newly full blocks in the prefix cache,
    /// appends sampled tokens and finishes requests (on a stop token, as the runner
    /// found it, or on length). Sequences that are no longer running (finished or
    /// cancelled in between) are skipped.
    pub fn update(&mut self, sched: &SchedulerOutput, model: &ModelOutput) -> Vec<RequestOutput> {
        let mut outs = Vec::new();
        for (k, seq) in sched.seqs.iter().enumerate() {
            if !self.running.contains(&seq.id) {
                continue;
            }
            let Some(s) = self.reqs.get_mut(&seq.id) else {
                continue;
            };
            if s.computed != seq.start_pos {
                // Preempted and rescheduled since: this result is stale.
                continue;
            }
            s.computed = seq.start_pos + seq.tokens.len();
            let written = s.tokens(0..s.computed);
            let key = s.req.cache_key.clone();
            let _ = self.blocks.commit(seq.id, &written, &key);
            let sampled = if seq.samples {
                model.sampled.get(k).copied().flatten()
            } else {
                None
            };
            let Some(s) = self.reqs.get_mut(&seq.id) else {
                continue;
            };
            let Some(sampled) = sampled else {
                continue;
            };
            let tok = sampled.token;
            s.output.push(tok);
            let finished = if sampled.stop {
                Some(FinishReason::Stop)
            } else if s.output.len() >= s.req.max_tokens || s.len() >= self.config.max_model_len {
                Some(FinishReason::Length)
            } else {
                None
            };
            let cached_tokens = s.cached_tokens.unwrap_or(0);
            if finished.is_some() {
                self.finish(seq.id);
            }
            outs.push(RequestOutput {
                id: seq.id,
                token: Some(tok),
                finished,
                cached_tokens,
            });
        }
        outs
    }

    /// Tokens generated so far by `id`.
    #[must_use]
    pub fn output_of(&self, id: RequestId) -> Option<&[u32]> {
        self.reqs.get(&id).map(|s| s.output.as_slice())
    }

    /// How many times `id` was preempted.
    #[must_use]
    pub fn preemptions_of(&self, id: RequestId) -> Option<u32> {
        self.reqs.get(&id).map(|s| s.preemptions)
    }

    /// Checks the scheduler's own invariants plus the pool's; for tests.
    ///
    /// # Errors
    /// The first broken invariant.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.blocks.check_invariants()?;
        if self.running.len() > self.config.max_num_seqs {
            return Err("too many running".into());
        }
        for id in &self.running {
            if self.waiting.contains(id) {
                return Err(format!("{id} both waiting and running"));
            }
        }
        let holders: std::collections::HashSet<_> = self.blocks.seq_ids().collect();
        let running: std::collections::HashSet<_> = self.running.iter().copied().collect();
        if holders != running {
            return Err(format!("block holders {holders:?} != running {running:?}"));
        }
        if self.reqs.len() != self.running.len() + self.waiting.len() {
            return Err("request map out of step with the queues".into());
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "scheduler_tests.rs"]
mod tests;
