//! Tensor × pipeline parallelism on the CPU backend: each rank holds one stage (a
//! contiguous run of layers, [`RankLayout::layers`]), of each layer its tensor shard
//! (see [`TensorShard`]), and the KV blocks of those layers and KV heads; the leader
//! drives steps.
//!
//! A step, with `s` stages of `t` tensor ranks (rank = stage × t + tensor rank):
//! 1. the leader (rank 0, stage 0) checks the batch, then sends its description
//!    ([`StepFrame::Run`], or [`StepFrame::Sample`] with each sequence's sampling) to
//!    every other rank;
//! 2. every tensor rank of stage 0 embeds the tokens (the embedding is replicated)
//!    and runs its layers over its shard: per layer, attention over its own query
//!    and KV heads and an all-reduce (an exact integer sum among the stage's tensor
//!    ranks, see [`crate::kernels::exact`]) of the output projection's partial
//!    product, then its MLP columns and a second all-reduce of the down projection's; the norms and residual adds run
//!    on every tensor rank over the same (reduced) states. Each tensor rank sends
//!    the hidden states (`tokens × dim` f32, the same on all of them) to its peer of
//!    stage 1, which runs its layers the same way, and so on;
//! 3. tensor rank 0 of the last stage applies the final norm and the output head to
//!    the rows the batch asked logits for (with one stage, that is the leader). Serving's steps ([`ModelRunner::execute`]) carry each
//!    sequence's sampling, and the last stage samples beside its logits and sends the
//!    leader only the tokens (11 bytes a sequence, where a logits row of SmolLM2 is
//!    192 KiB); a [`ModelRunner::forward`] step sends the rows asked for (only
//!    those) to the leader.
//!
//! Block ids come from the leader's scheduler and are valid on every rank: every
//! rank's KV store has the same number of blocks, each holding its own layers' and
//! KV heads' keys and values only.
//!
//! Steps run one at a time, without micro-batching: while stage 1 computes, stage 0
//! waits for the logits. Micro-batching would overlap stages on different parts of a
//! step, but every step's tokens depend on the previous step's samples, so it only
//! pays with several independent batches in flight, which the scheduler does not
//! form; the split's point here is memory (each rank holds `1/s` of the layers and
//! of the KV cache), not throughput.
//!
//! Failure: any error once a step is sent fails the group for good. The leader drops
//! its transport (every worker sees the connection close and exits with an error
//! naming rank 0); a worker that fails returns its error from [`run_worker`] and its
//! transport closes, so the leader's step fails naming that worker. The transport
//! bounds every wait by the step timeout, so no rank hangs on a dead peer.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::layout::{LayoutError, ParallelLayout, RankLayout};
use super::step::{
    IncomingStep, OutgoingStep, StepFrame, StepFrameError, decode_sampled, encode_sampled,
};
use super::transport::{FrameKind, Transport, TransportError};
use crate::backend::cpu::{CpuBackend, CpuConfig, StageInput, StageOutput};
use crate::backend::{
    BackendError, Batch, KvGeometry, Logits, ModelOutput, ModelRunner, sample_on_host,
    validate_sampling,
};
use crate::model::gguf::GgufFile;
use crate::model::llama::{LlamaConfig, LlamaWeights, ModelError, ModelPart, TensorShard};
use crate::model::lora::LoraAdapter;
use crate::sampling::SeqSampling;

/// Why a pipeline stage could not start, or a worker stopped serving steps.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error("loading stage {stage} (layers {layers:?}): {source}")]
    Load {
        stage: usize,
        layers: std::ops::Range<usize>,
        #[source]
        source: ModelError,
    },
    #[error("the stage's CPU backend: {0}")]
    Backend(String),
    #[error("rank {rank}: {detail}")]
    Mismatch { rank: usize, detail: String },
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error("step {step}: the leader's step frame is malformed: {source}")]
    Frame {
        step: u64,
        #[source]
        source: StepFrameError,
    },
    #[error("step {step}: {source}")]
    Step {
        step: u64,
        #[source]
        source: BackendError,
    },
}

impl PipelineError {
    /// The ranks this error blames, as [`TransportError::blamed`]; none for a local
    /// failure.
    #[must_use]
    pub fn blamed(&self) -> Vec<usize> {
        match self {
            Self::Transport(e) => e.blamed(),
            Self::Frame { .. } => vec![0],
            _ => Vec::new(),
        }
    }
}

impl PipelineError {
    /// A step's error on a worker: a transport failure inside the step (an
    /// all-reduce) keeps the rank it blames.
    fn in_step(step: u64, source: BackendError) -> Self {
        match source {
            BackendError::Group(e) => Self::Transport(e),
            source => Self::Step { step, source },
        }
    }
}

/// One rank's stage: its CPU backend (holding only its layers, and of each only its
/// tensor shard) and where it sits in the group.
#[derive(Debug)]
pub struct StageRunner {
    backend: CpuBackend,
    layout: RankLayout,
    world: usize,
    /// The rank that computes the logits (tensor rank 0 of the last stage).
    head_rank: usize,
    /// The stage's tensor ranks, ascending: this rank's all-reduce set.
    tensor_group: Vec<usize>,
}

impl StageRunner {
    /// Loads rank `rank`'s part of `group` from `file`: only its layers' weights, of
    /// each only its tensor shard, are read and packed (see
    /// [`LlamaWeights::from_gguf_part`]) and its KV store holds only its layers and
    /// KV heads.
    ///
    /// # Errors
    /// [`PipelineError`] for a rank outside the group, a model that cannot load or a
    /// backend that cannot start.
    pub fn load(
        file: &GgufFile,
        group: &ParallelLayout,
        rank: usize,
        config: &CpuConfig,
    ) -> Result<Self, PipelineError> {
        let layout = group.rank(rank)?;
        let weights = LlamaWeights::from_gguf_part(file, &Self::part_of(&layout, group.tensor()))
            .map_err(|source| PipelineError::Load {
            stage: layout.stage,
            layers: layout.layers.clone(),
            source,
        })?;
        let backend = CpuBackend::new(Arc::new(weights), config).map_err(PipelineError::Backend)?;
        Self::new(backend, group, rank)
    }

    /// Wraps a backend already loaded with rank `rank`'s part of `group`.
    ///
    /// # Errors
    /// [`PipelineError::Mismatch`] when the backend holds another part.
    pub fn new(
        backend: CpuBackend,
        group: &ParallelLayout,
        rank: usize,
    ) -> Result<Self, PipelineError> {
        let layout = group.rank(rank)?;
        let want = Self::part_of(&layout, group.tensor());
        if *backend.part() != want {
            return Err(PipelineError::Mismatch {
                rank,
                detail: format!(
                    "the backend holds {:?}, the stage is {want:?}",
                    backend.part()
                ),
            });
        }
        Ok(Self {
            backend,
            tensor_group: layout.tensor_group.clone().collect(),
            layout,
            world: group.world_size(),
            head_rank: group.head_rank(),
        })
    }

    /// The model part of `layout` in a group of `tensor` ranks per stage.
    #[must_use]
    pub fn part_of(layout: &RankLayout, tensor: usize) -> ModelPart {
        ModelPart {
            layers: layout.layers.clone(),
            embeds: layout.embeds,
            head: layout.head,
            shard: (tensor > 1).then(|| TensorShard {
                q_heads: layout.q_heads.clone(),
                kv_heads: layout.kv_heads.clone(),
                ffn: layout.ffn.clone(),
            }),
        }
    }

    /// Runs this rank's part of `step`: its layers over its shard, with the stage's
    /// two all-reduces per layer through `transport` when the stage has several
    /// tensor ranks.
    fn run<'s, T: Transport<Tensor = [f32], SumTensor = [i64]> + Send>(
        &'s mut self,
        transport: &mut T,
        batch: &Batch,
        step: u64,
        input: StageInput<'_>,
    ) -> Result<StageOutput<'s>, BackendError> {
        if self.tensor_group.len() == 1 {
            return self.backend.forward_stage(batch, input);
        }
        let group = &self.tensor_group;
        self.backend.forward_shard(batch, input, &mut |buf| {
            transport
                .all_reduce_sum(group, step, buf)
                .map_err(BackendError::from)
        })
    }

    /// The stage's backend.
    #[must_use]
    pub fn backend(&self) -> &CpuBackend {
        &self.backend
    }

    /// Where this stage sits in the group.
    #[must_use]
    pub fn layout(&self) -> &RankLayout {
        &self.layout
    }

    fn check_transport<T: Transport + ?Sized>(&self, transport: &T) -> Result<(), PipelineError> {
        if transport.rank() != self.layout.rank || transport.world_size() != self.world {
            return Err(PipelineError::Mismatch {
                rank: self.layout.rank,
                detail: format!(
                    "the transport is rank {} of {}, the stage rank {} of {}",
                    transport.rank(),
                    transport.world_size(),
                    self.layout.rank,
                    self.world
                ),
            });
        }
        Ok(())
    }
}

/// Serves the leader's steps on a worker rank until the leader says stop (`Ok`) or
/// the group fails. The transport is consumed: when this returns, its connections
/// close, so the other ranks learn at once that this one is gone.
///
/// # Errors
/// [`PipelineError::Transport`] naming the peer that died, went silent or aborted
/// the group; [`PipelineError::Frame`] for a step frame that cannot be read;
/// [`PipelineError::Step`] for a step this stage could not run.
pub fn run_worker<T: Transport<Tensor = [f32], SumTensor = [i64]> + Send>(
    mut transport: T,
    stage: &mut StageRunner,
) -> Result<(), PipelineError> {
    stage.check_transport(&transport)?;
    let me = stage.layout.clone();
    if me.is_leader() {
        return Err(PipelineError::Mismatch {
            rank: 0,
            detail: "rank 0 leads the group; it runs no worker loop".to_owned(),
        });
    }
    let dim = stage.backend.config().dim;
    let (mut hidden, mut reply) = (Vec::new(), Vec::new());
    for step in 1u64.. {
        let frame = transport.recv_bytes(0, step, FrameKind::Batch)?;
        let (batch, sampling) = match IncomingStep::decode(frame)
            .map_err(|source| PipelineError::Frame { step, source })?
        {
            StepFrame::Run(batch) => (batch, None),
            StepFrame::Sample(batch, sampling) => (batch, Some(sampling)),
            StepFrame::Idle => continue,
            StepFrame::Stop => {
                tracing::info!(rank = me.rank, step, "the leader stopped the group");
                return Ok(());
            }
        };
        let fail = |source| PipelineError::in_step(step, source);
        // Checked before sizing the receive buffer by the batch's token count.
        stage.backend.validate(&batch).map_err(fail)?;
        if let Some(sampling) = &sampling {
            validate_sampling(&batch, sampling).map_err(fail)?;
        }
        let input = match me.receives_from {
            Some(from) => {
                hidden.resize(batch.num_tokens() * dim, 0.0);
                transport.recv_tensor(from, step, FrameKind::Hidden, &mut hidden)?;
                StageInput::Hidden(&mut hidden)
            }
            None => StageInput::Tokens,
        };
        match stage
            .run(&mut transport, &batch, step, input)
            .map_err(fail)?
        {
            // The last stage's tensor ranks other than the head's are done.
            StageOutput::Hidden(x) => {
                if let Some(to) = me.sends_to {
                    transport.send_tensor(to, step, FrameKind::Hidden, x)?;
                }
            }
            StageOutput::Logits(logits) => match &sampling {
                // Sampled here, beside the logits: only the tokens go back.
                Some(sampling) => {
                    let output = sample_on_host(&logits, sampling);
                    encode_sampled(&output, &mut reply)
                        .map_err(|source| PipelineError::Frame { step, source })?;
                    transport.send_bytes(0, step, FrameKind::Sampled, &reply)?;
                }
                None => transport.send_tensor(0, step, FrameKind::Logits, &logits.data)?,
            },
        }
    }
    Ok(())
}

/// The leader's [`ModelRunner`] of a tensor × pipeline group: runs its part of stage
/// 0 here and the other ranks through the transport (see the module docs for a
/// step).
///
/// LoRA adapters: a chunk's adapter id travels with the step; every rank must have
/// loaded the same adapters in the same order.
#[derive(Debug)]
pub struct PipelineRunner<T: Transport<Tensor = [f32], SumTensor = [i64]> + Send> {
    stage: StageRunner,
    /// `None` once the group failed (dropping it closed the connections).
    transport: Option<T>,
    /// Why the group ended (failed, or stopped): every step asked after returns it,
    /// blaming the same rank as the first error did.
    failed: Option<TransportError>,
    /// The last step id sent.
    step: u64,
    /// The step frame's encoding buffer, reused.
    frame: Vec<u8>,
    /// How often serving must call [`ModelRunner::idle`] while there is no step.
    keep_alive: Option<Duration>,
    /// Set once when the group fails (not when it is stopped), for whoever must act
    /// on it: serving stops being ready and exits non-zero.
    failure: watch::Sender<Option<String>>,
}

impl<T: Transport<Tensor = [f32], SumTensor = [i64]> + Send> PipelineRunner<T> {
    /// The leader of a formed group: `stage` is rank 0's, `transport` rank 0's.
    ///
    /// # Errors
    /// [`PipelineError::Mismatch`] when either is not rank 0 of the same group.
    pub fn new(stage: StageRunner, transport: T) -> Result<Self, PipelineError> {
        stage.check_transport(&transport)?;
        if !stage.layout.is_leader() || stage.world < 2 {
            return Err(PipelineError::Mismatch {
                rank: stage.layout.rank,
                detail: "the group's leader is rank 0 of a group of several ranks".to_owned(),
            });
        }
        Ok(Self {
            stage,
            transport: Some(transport),
            failed: None,
            step: 0,
            frame: Vec::new(),
            keep_alive: None,
            failure: watch::Sender::new(None),
        })
    }

    /// Asks serving to send a keep-alive every `interval` while idle
    /// ([`ModelRunner::idle_interval`]); a quarter of the step timeout leaves a worker
    /// several chances to hear from a live leader before it gives up on it.
    #[must_use]
    pub fn with_keep_alive(mut self, interval: Duration) -> Self {
        self.keep_alive = Some(interval);
        self
    }

    /// Watches for the group's failure: the value turns from `None` to the reason,
    /// once. A stopped group is not a failed one.
    #[must_use]
    pub fn failures(&self) -> watch::Receiver<Option<String>> {
        self.failure.subscribe()
    }

    /// Tells every worker the leader is alive with no step to run. Serving calls it
    /// while idle, at least every half step timeout, so waiting workers do not take
    /// the leader for dead.
    ///
    /// # Errors
    /// [`BackendError::Group`] when the group has failed.
    pub fn keep_alive(&mut self) -> Result<(), BackendError> {
        self.broadcast(&StepFrame::Idle).map(drop)
    }

    /// Ends the group: every worker's [`run_worker`] returns `Ok`. Steps asked after
    /// it fail.
    ///
    /// # Errors
    /// [`BackendError::Group`] when the group had already failed.
    pub fn stop(&mut self) -> Result<(), BackendError> {
        self.broadcast(&StepFrame::Stop)?;
        self.transport = None;
        self.failed = Some(TransportError::Usage("the group was stopped".to_owned()));
        Ok(())
    }

    fn fail(&mut self, error: &BackendError) {
        // Closing the connections is what tells the workers, at once.
        self.transport = None;
        if self.failed.is_none() {
            let error = match error {
                BackendError::Group(e) => e.clone(),
                other => TransportError::Local(format!("a step failed on the leader: {other}")),
            };
            self.failure.send_replace(Some(error.to_string()));
            self.failed = Some(error);
        }
    }

    /// The error of a step asked once the group has ended.
    fn ended(failed: Option<&TransportError>) -> BackendError {
        BackendError::Group(
            failed
                .cloned()
                .unwrap_or_else(|| TransportError::Local("the group has no links".to_owned())),
        )
    }

    fn transport(&mut self) -> Result<&mut T, BackendError> {
        match (&mut self.transport, &self.failed) {
            (Some(t), None) => Ok(t),
            (_, failed) => Err(Self::ended(failed.as_ref())),
        }
    }

    /// Sends `frame` to every worker as the next step; returns its step id.
    fn broadcast(&mut self, frame: &OutgoingStep<'_>) -> Result<u64, BackendError> {
        frame
            .encode(&mut self.frame)
            .map_err(|e| BackendError::InvalidBatch(e.to_string()))?;
        let step = self.step + 1;
        let world = self.stage.world;
        let frame = std::mem::take(&mut self.frame);
        let sent = self.transport().and_then(|t| {
            (1..world).try_for_each(|rank| {
                t.send_bytes(rank, step, FrameKind::Batch, &frame)
                    .map_err(BackendError::from)
            })
        });
        self.frame = frame;
        self.step = step;
        if let Err(e) = &sent {
            self.fail(e);
        }
        sent.map(|()| step)
    }

    /// The leader's part of a step already broadcast: stage 0's layers (with its
    /// tensor group), the hidden states on to stage 1. Returns the logits when the
    /// leader holds the head (a single stage of tensor ranks).
    fn run_stage_0(&mut self, batch: &Batch, step: u64) -> Result<Option<Logits>, BackendError> {
        let next = self.stage.layout.sends_to;
        let transport = match (&mut self.transport, &self.failed) {
            (Some(t), None) => t,
            (_, failed) => return Err(Self::ended(failed.as_ref())),
        };
        match self.stage.run(transport, batch, step, StageInput::Tokens)? {
            StageOutput::Hidden(x) => {
                let next = next.ok_or_else(|| {
                    BackendError::Stage("the leader's stage has neither a head nor a next".into())
                })?;
                transport.send_tensor(next, step, FrameKind::Hidden, x)?;
                Ok(None)
            }
            StageOutput::Logits(logits) => Ok(Some(logits)),
        }
    }

    /// A step whose last stage returns its logits.
    fn run_for_logits(&mut self, batch: &Batch, step: u64) -> Result<Logits, BackendError> {
        let (head_rank, vocab) = (self.stage.head_rank, self.stage.backend.config().vocab);
        if let Some(logits) = self.run_stage_0(batch, step)? {
            return Ok(logits);
        }
        let (rows, spans) = batch.logits_rows();
        let mut data = vec![0f32; rows.len() * vocab];
        self.transport()?
            .recv_tensor(head_rank, step, FrameKind::Logits, &mut data)?;
        Ok(Logits { vocab, data, spans })
    }

    /// A step whose last stage samples and returns the tokens.
    fn run_for_tokens(
        &mut self,
        batch: &Batch,
        sampling: &[Option<SeqSampling>],
        step: u64,
    ) -> Result<ModelOutput, BackendError> {
        let head_rank = self.stage.head_rank;
        if let Some(logits) = self.run_stage_0(batch, step)? {
            return Ok(sample_on_host(&logits, sampling));
        }
        let reply = self
            .transport()?
            .recv_bytes(head_rank, step, FrameKind::Sampled)?;
        decode_sampled(reply, batch.seqs.len()).map_err(|e| {
            BackendError::Group(TransportError::Protocol {
                rank: head_rank,
                phase: super::transport::Phase::Step(step),
                detail: format!("an unreadable sampled reply: {e}"),
            })
        })
    }

    /// Runs `step` (already broadcast) through `run`, failing the group on an error:
    /// the workers are mid-step, and only that ends it for them.
    fn finish_step<R>(
        &mut self,
        step: u64,
        run: impl FnOnce(&mut Self) -> Result<R, BackendError>,
    ) -> Result<R, BackendError> {
        let out = run(self);
        if let Err(e) = &out {
            tracing::error!(step, error = %e, "pipeline step failed; failing the group");
            self.fail(e);
        }
        out
    }
}

impl<T: Transport<Tensor = [f32], SumTensor = [i64]> + Send> ModelRunner for PipelineRunner<T> {
    fn config(&self) -> &LlamaConfig {
        self.stage.backend.config()
    }

    fn kv_geometry(&self) -> KvGeometry {
        self.stage.backend.kv_geometry()
    }

    fn adapters(&self) -> &[Arc<LoraAdapter>] {
        self.stage.backend.adapters()
    }

    fn idle_interval(&self) -> Option<Duration> {
        self.keep_alive
    }

    fn idle(&mut self) -> Result<(), BackendError> {
        self.keep_alive()
    }

    fn forward(&mut self, batch: &Batch) -> Result<Logits, BackendError> {
        // An invalid batch is refused here, before any rank hears of it: the group
        // stays healthy.
        self.stage.backend.validate(batch)?;
        if batch.seqs.is_empty() {
            return Ok(Logits {
                vocab: self.config().vocab,
                ..Logits::default()
            });
        }
        let step = self.broadcast(&StepFrame::Run(batch))?;
        self.finish_step(step, |r| r.run_for_logits(batch, step))
    }

    /// Samples on the last stage, beside its logits: a decode step sends the leader a
    /// few bytes per sequence instead of a row of logits.
    fn execute(
        &mut self,
        batch: &Batch,
        sampling: &[Option<SeqSampling>],
    ) -> Result<ModelOutput, BackendError> {
        validate_sampling(batch, sampling)?;
        self.stage.backend.validate(batch)?;
        if batch.seqs.is_empty() {
            return Ok(ModelOutput::default());
        }
        let step = self.broadcast(&StepFrame::Sample(batch, sampling))?;
        self.finish_step(step, |r| r.run_for_tokens(batch, sampling, step))
    }
}

impl<T: Transport<Tensor = [f32], SumTensor = [i64]> + Send> Drop for PipelineRunner<T> {
    fn drop(&mut self) {
        // Best effort, so the workers of a runner dropped without `stop` exit cleanly
        // rather than on a closed connection; a failed group's are closed already.
        if self.failed.is_none() {
            let _ignored = self.broadcast(&StepFrame::Stop);
        }
    }
}
