//! The boundary between scheduling and compute: a [`ModelRunner`] runs one batched
//! forward step over many sequences at once (prefill chunks and decode tokens
//! mixed), each with its own positions and paged-KV block table.
//!
//! Contract of [`ModelRunner::forward`]:
//! - every [`SeqChunk`] is a different sequence; its `tokens` occupy positions
//!   `start_pos..start_pos + tokens.len()`, and positions before `start_pos` must have
//!   been written by earlier steps through the same block table;
//! - `block_table` covers every position up to the chunk's last one; the blocks a
//!   chunk writes belong to it alone in this batch (shared, read-only prefix blocks
//!   are fine);
//! - the result holds the logits each chunk asked for, in chunk order;
//! - a chunk's `adapter`, when set, indexes the runner's [`ModelRunner::adapters`];
//!   its rows get that LoRA adapter's low-rank products on top of the base ones.
//!
//! Serving calls [`ModelRunner::execute`] instead, as vLLM v1's model runner does: the
//! step and how each sequence samples go down, and only the sampled tokens come back
//! ([`ModelOutput`]), chosen on the runner's worker thread beside the forward pass (on
//! the GPU, by the sampling kernels, where they apply). [`ModelRunner::forward`]
//! stays for whoever needs the logits themselves (scoring, benchmarks, the oracle
//! tests).
//!
//! LoRA in a batch follows Punica's SGMV (segmented gather matrix-vector products,
//! Chen et al. 2023, the kernels vLLM's LoRA runs on): the base product runs once over
//! every row of the step, then [`Batch::adapter_segments`] cuts the rows into
//! segments of consecutive rows that share an adapter, and each segment runs that
//! adapter's shrink (`x·Aᵀ`) and expand (`·Bᵀ·alpha/r`) added onto the base output.
//! Punica rather than S-LoRA: S-LoRA's own contribution is paging thousands of
//! adapters through GPU memory beside the KV cache; the adapters of a release are a
//! handful, resident for the process's life, so only the segmented product applies.
//! A segment (a prefill chunk, or neighbouring sequences of one adapter) reads its
//! `A` and `B` once while they are hot, where a per-row gather (Punica's BGMV) would
//! fetch them per row.
//!
//! The CPU backend ([`cpu`]) and the device backend ([`device`]: the device forward
//! pass, on CUDA kernels on a GPU with feature `cuda` ([`cuda`]), or on their CPU
//! twins) implement it; [`select`] picks one at run time.

pub mod cpu;
pub mod cuda;
pub mod device;

use std::ops::Range;
use std::sync::Arc;

use crate::model::gguf::GgufFile;
use crate::model::llama::{LlamaConfig, LlamaWeights};
use crate::model::lora::LoraAdapter;
use crate::sampling::{SampledToken, SeqSampling};

/// Which logits a chunk wants back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsWanted {
    /// None (a prefill chunk that is not the last).
    None,
    /// Only for the last token (decode; last prefill chunk).
    Last,
    /// For every token (scoring).
    All,
}

/// Consecutive tokens of one sequence.
#[derive(Clone, Debug)]
pub struct SeqChunk {
    /// Token ids.
    pub tokens: Vec<u32>,
    /// Position of `tokens[0]`.
    pub start_pos: usize,
    /// Block ids holding positions `0..`, `block_size` positions each.
    pub block_table: Vec<u32>,
    /// Logits to return.
    pub logits: LogitsWanted,
    /// The LoRA adapter of this sequence (an index into the runner's
    /// [`ModelRunner::adapters`]); `None` for the base model.
    pub adapter: Option<u16>,
}

/// Consecutive rows (tokens) of a batch that use one LoRA adapter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// The adapter (an index into the runner's [`ModelRunner::adapters`]).
    pub adapter: u16,
    /// The rows, in the order the batch's tokens are laid out.
    pub rows: Range<usize>,
}

/// One forward step.
#[derive(Clone, Debug, Default)]
pub struct Batch {
    /// The sequences of this step.
    pub seqs: Vec<SeqChunk>,
}

impl Batch {
    /// Tokens in the step.
    #[must_use]
    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.tokens.len()).sum()
    }

    /// The rows (tokens, in batch order) whose logits the step returns, and each
    /// chunk's span of those rows: the layout of [`Logits`].
    #[must_use]
    pub fn logits_rows(&self) -> (Vec<usize>, Vec<Range<usize>>) {
        let mut spans = Vec::with_capacity(self.seqs.len());
        let mut rows = Vec::new();
        let mut t0 = 0;
        for s in &self.seqs {
            let len = s.tokens.len();
            let start = rows.len();
            match s.logits {
                LogitsWanted::None => {}
                LogitsWanted::Last if len > 0 => rows.push(t0 + len - 1),
                LogitsWanted::Last => {}
                LogitsWanted::All => rows.extend(t0..t0 + len),
            }
            spans.push(start..rows.len());
            t0 += len;
        }
        (rows, spans)
    }

    /// The rows of the step per adapter: one [`Segment`] per run of consecutive
    /// sequences with the same adapter, in row order; base-model rows are in none.
    #[must_use]
    pub fn adapter_segments(&self) -> Vec<Segment> {
        let mut out: Vec<Segment> = Vec::new();
        let mut row = 0;
        for s in &self.seqs {
            let rows = row..row + s.tokens.len();
            row = rows.end;
            let Some(adapter) = s.adapter else { continue };
            match out.last_mut() {
                Some(last) if last.adapter == adapter && last.rows.end == rows.start => {
                    last.rows.end = rows.end;
                }
                _ => out.push(Segment { adapter, rows }),
            }
        }
        out
    }
}

/// Logits of a step: `rows` of `vocab` floats; `spans[i]` are chunk `i`'s rows.
#[derive(Clone, Debug, Default)]
pub struct Logits {
    /// Vocabulary size (row length).
    pub vocab: usize,
    /// Row-major logits.
    pub data: Vec<f32>,
    /// Rows of each chunk, in batch order.
    pub spans: Vec<Range<usize>>,
}

impl Logits {
    /// Row `i`.
    ///
    /// # Panics
    /// When `i` is out of range.
    #[must_use]
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }

    /// The rows of chunk `seq`.
    ///
    /// # Panics
    /// When `seq` is out of range.
    pub fn rows_of(&self, seq: usize) -> impl Iterator<Item = &[f32]> {
        self.spans[seq].clone().map(|i| self.row(i))
    }

    /// The last row of chunk `seq`, if it asked for any.
    #[must_use]
    pub fn last_of(&self, seq: usize) -> Option<&[f32]> {
        let span = self.spans.get(seq)?;
        (!span.is_empty()).then(|| self.row(span.end - 1))
    }
}

/// What a step sampled, as vLLM v1's `ModelRunnerOutput`: per batch sequence, in
/// batch order, its token (`None` where the chunk sampled nothing).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ModelOutput {
    /// One entry per [`Batch::seqs`].
    pub sampled: Vec<Option<SampledToken>>,
}

/// Checks a step's sampling against its batch: one entry per sequence, and a
/// sequence that samples asks for its last logits row (so a runner has it); a draw
/// exactly when the sampling is not greedy.
///
/// # Errors
/// [`BackendError::InvalidBatch`] naming the first offending sequence.
pub fn validate_sampling(
    batch: &Batch,
    sampling: &[Option<SeqSampling>],
) -> Result<(), BackendError> {
    if sampling.len() != batch.seqs.len() {
        return Err(BackendError::InvalidBatch(format!(
            "{} sampling entries for {} sequences",
            sampling.len(),
            batch.seqs.len()
        )));
    }
    for (i, (s, chunk)) in sampling.iter().zip(&batch.seqs).enumerate() {
        let Some(s) = s else { continue };
        if chunk.logits == LogitsWanted::None {
            return Err(BackendError::InvalidBatch(format!(
                "sequence {i}: samples but asks for no logits"
            )));
        }
        if s.uniform.is_some() == s.params.is_greedy() {
            return Err(BackendError::InvalidBatch(format!(
                "sequence {i}: a draw is needed exactly when sampling is not greedy"
            )));
        }
    }
    Ok(())
}

/// Samples a step's logits on the host: each sampling sequence from its last row.
#[must_use]
pub fn sample_on_host(logits: &Logits, sampling: &[Option<SeqSampling>]) -> ModelOutput {
    ModelOutput {
        sampled: sampling
            .iter()
            .enumerate()
            .map(|(i, s)| Some(s.as_ref()?.sample_row(logits.last_of(i)?)))
            .collect(),
    }
}

/// Size of the paged KV store a runner owns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvGeometry {
    /// Positions per block.
    pub block_size: usize,
    /// Blocks available.
    pub num_blocks: usize,
}

/// Errors of a forward step.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The batch breaks the contract (bad token, short block table, shared write block).
    #[error("invalid batch: {0}")]
    InvalidBatch(String),
    /// A kernel rejected its operands (an engine bug, reported instead of panicking).
    #[error(transparent)]
    Kernel(#[from] crate::kernels::KernelError),
    /// The device (GPU) failed.
    #[error(transparent)]
    Device(#[from] device::DeviceError),
    /// A pipeline stage was given a step it cannot run (an input of another stage).
    #[error("pipeline stage: {0}")]
    Stage(String),
    /// A rank of a parallel group failed (the error names it); the group is done.
    #[error("parallel group: {0}")]
    Group(#[from] crate::parallel::TransportError),
}

/// Checks a batch against the contract in the module docs for a store of `num_blocks`
/// blocks of `block_size` positions and a runner with `num_adapters` LoRA adapters.
///
/// # Errors
/// [`BackendError::InvalidBatch`] naming the first offending sequence.
pub fn validate_batch(
    batch: &Batch,
    vocab: usize,
    (block_size, num_blocks): (usize, usize),
    num_adapters: usize,
) -> Result<(), BackendError> {
    let mut written = std::collections::HashSet::new();
    for (i, s) in batch.seqs.iter().enumerate() {
        let bad = |m: String| Err(BackendError::InvalidBatch(format!("sequence {i}: {m}")));
        if s.tokens.is_empty() {
            return bad("no tokens".into());
        }
        if let Some(t) = s.tokens.iter().find(|&&t| t as usize >= vocab) {
            return bad(format!("token {t} outside the vocabulary of {vocab}"));
        }
        if let Some(a) = s.adapter
            && usize::from(a) >= num_adapters
        {
            return bad(format!(
                "LoRA adapter {a} outside the runner's {num_adapters} adapters"
            ));
        }
        let end = s.start_pos + s.tokens.len();
        let need = end.div_ceil(block_size);
        if s.block_table.len() < need {
            return bad(format!(
                "block table of {} blocks cannot hold {end} positions",
                s.block_table.len()
            ));
        }
        if let Some(b) = s.block_table[..need]
            .iter()
            .find(|&&b| b as usize >= num_blocks)
        {
            return bad(format!("block {b} outside the KV store of {num_blocks}"));
        }
        for bi in s.start_pos / block_size..need {
            if !written.insert(s.block_table[bi]) {
                return bad(format!(
                    "block {} is written by two sequences",
                    s.block_table[bi]
                ));
            }
        }
    }
    Ok(())
}

/// Which backend to run on (`serve --device`): the command line's own type.
pub use slipway_contract::DeviceChoice;

/// The backend [`select`] started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// The CPU backend.
    Cpu,
    /// The CUDA backend.
    Cuda,
}

/// Settings of both backends, for [`select`].
#[derive(Clone, Debug, Default)]
pub struct BackendOptions {
    /// The CPU backend's.
    pub cpu: cpu::CpuConfig,
    /// The CUDA backend's.
    pub cuda: device::runner::DeviceConfig,
    /// GPU ordinal.
    pub gpu: usize,
    /// LoRA adapters to serve next to the model (CPU backend only, for now).
    pub adapters: Vec<Arc<LoraAdapter>>,
}

/// Errors of [`select`].
#[derive(Debug, thiserror::Error)]
pub enum SelectError {
    /// The CUDA backend could not start (and CUDA was asked for).
    #[error("CUDA backend unavailable: {0}")]
    CudaUnavailable(String),
    /// The model could not be loaded for the CPU backend.
    #[error(transparent)]
    Model(#[from] crate::model::llama::ModelError),
    /// The CPU backend could not start.
    #[error("CPU backend: {0}")]
    Cpu(String),
    /// LoRA adapters were given with `--device cuda`.
    #[error(
        "LoRA adapters need --device cpu for now: the CUDA backend does not apply them ({0} given)"
    )]
    AdaptersNeedCpu(usize),
}

#[cfg(feature = "cuda")]
fn start_cuda(
    file: &GgufFile,
    options: &BackendOptions,
) -> Result<Box<dyn ModelRunner + Send>, String> {
    let dev = cuda::gpu::CudaDevice::open(options.gpu).map_err(|e| e.to_string())?;
    let runner = device::runner::DeviceRunner::new(dev, file, options.cuda.clone())
        .map_err(|e| e.to_string())?;
    Ok(Box::new(runner))
}

#[cfg(not(feature = "cuda"))]
fn start_cuda(
    _file: &GgufFile,
    _options: &BackendOptions,
) -> Result<Box<dyn ModelRunner + Send>, String> {
    Err("this binary was built without the `cuda` feature".into())
}

/// Starts the backend `choice` names for the model in `file`. With LoRA adapters only
/// the CPU backend serves: `cuda` is refused, `auto` takes the CPU (and logs why).
///
/// # Errors
/// [`SelectError::CudaUnavailable`] when CUDA was asked for and cannot start,
/// [`SelectError::AdaptersNeedCpu`] when it was asked for with adapters; model or
/// CPU backend errors otherwise.
pub fn select(
    choice: DeviceChoice,
    file: &GgufFile,
    options: &BackendOptions,
) -> Result<(Box<dyn ModelRunner + Send>, Device), SelectError> {
    let adapters = options.adapters.len();
    if adapters > 0 {
        match choice {
            DeviceChoice::Cuda => return Err(SelectError::AdaptersNeedCpu(adapters)),
            DeviceChoice::Auto => tracing::warn!(
                adapters,
                "LoRA adapters are served by the CPU backend only; --device auto takes the CPU"
            ),
            DeviceChoice::Cpu => {}
        }
    } else if choice != DeviceChoice::Cpu {
        match start_cuda(file, options) {
            Ok(runner) => return Ok((runner, Device::Cuda)),
            Err(reason) if choice == DeviceChoice::Cuda => {
                return Err(SelectError::CudaUnavailable(reason));
            }
            Err(reason) => {
                tracing::warn!(%reason, "CUDA backend unavailable; using the CPU backend");
            }
        }
    }
    let weights = Arc::new(LlamaWeights::from_gguf(file)?);
    let runner = cpu::CpuBackend::new(weights, &options.cpu)
        .and_then(|r| r.with_adapters(options.adapters.clone()))
        .map_err(SelectError::Cpu)?;
    Ok((Box::new(runner), Device::Cpu))
}

/// A model that can run batched forward steps against its own paged KV store.
pub trait ModelRunner {
    /// The architecture hyper-parameters.
    fn config(&self) -> &LlamaConfig;
    /// The KV store's shape (the block manager sizes its pool from it).
    fn kv_geometry(&self) -> KvGeometry;
    /// The LoRA adapters a [`SeqChunk::adapter`] may name, by index; none unless the
    /// backend applies adapters.
    fn adapters(&self) -> &[Arc<LoraAdapter>] {
        &[]
    }
    /// How often serving must call [`ModelRunner::idle`] while it has no step to
    /// run; `None` (the default): never. A pipeline's leader needs it so its workers,
    /// waiting for the next step, can tell an idle leader from a dead one.
    fn idle_interval(&self) -> Option<std::time::Duration> {
        None
    }

    /// Called while there is no step, at least every [`ModelRunner::idle_interval`].
    ///
    /// # Errors
    /// [`BackendError::Group`] when a parallel group has failed.
    fn idle(&mut self) -> Result<(), BackendError> {
        Ok(())
    }

    /// Runs one step and returns the logits asked for; see the module docs for the
    /// contract.
    ///
    /// # Errors
    /// [`BackendError::InvalidBatch`] when the batch breaks the contract; nothing is
    /// written to the KV store in that case.
    fn forward(&mut self, batch: &Batch) -> Result<Logits, BackendError>;

    /// Runs one step and samples: `sampling[i]` says how sequence `i` picks its next
    /// token from its last logits row (`None`: it samples nothing this step). Called
    /// on the worker thread that runs the step, so sampling and the stop-token checks
    /// happen there, beside the forward pass.
    ///
    /// This default samples the logits of [`ModelRunner::forward`] on the host; a
    /// runner that can sample where its logits are (the device runner) overrides it,
    /// so only the tokens come back.
    ///
    /// # Errors
    /// As [`ModelRunner::forward`], and [`BackendError::InvalidBatch`] when
    /// `sampling` does not fit the batch ([`validate_sampling`]).
    fn execute(
        &mut self,
        batch: &Batch,
        sampling: &[Option<SeqSampling>],
    ) -> Result<ModelOutput, BackendError> {
        validate_sampling(batch, sampling)?;
        let logits = self.forward(batch)?;
        Ok(sample_on_host(&logits, sampling))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(len: usize, adapter: Option<u16>) -> SeqChunk {
        SeqChunk {
            tokens: vec![1; len],
            start_pos: 0,
            block_table: vec![0],
            logits: LogitsWanted::Last,
            adapter,
        }
    }

    #[test]
    fn adapter_segments_merge_neighbours_of_one_adapter_and_skip_the_base() {
        let batch = Batch {
            seqs: vec![
                chunk(3, Some(0)),
                chunk(2, Some(0)),
                chunk(4, None),
                chunk(1, Some(1)),
                chunk(5, Some(0)),
                chunk(1, Some(0)),
            ],
        };
        let seg = |adapter, rows| Segment { adapter, rows };
        assert_eq!(
            batch.adapter_segments(),
            [seg(0, 0..5), seg(1, 9..10), seg(0, 10..16)]
        );
        assert!(Batch::default().adapter_segments().is_empty());
    }

    fn seeded(uniform: Option<f64>, temperature: f32) -> SeqSampling {
        SeqSampling {
            params: crate::sampling::SamplingParams {
                temperature,
                ..Default::default()
            },
            uniform,
            history: Vec::new(),
            stop_tokens: vec![2],
            logprob: false,
        }
    }

    #[test]
    fn sampling_must_fit_the_batch() {
        let mut batch = Batch {
            seqs: vec![chunk(2, None), chunk(1, None)],
        };
        let greedy = || Some(seeded(None, 0.0));
        assert!(validate_sampling(&batch, &[greedy(), None]).is_ok());
        assert!(validate_sampling(&batch, &[greedy(), Some(seeded(Some(0.5), 1.0))]).is_ok());
        // One entry per sequence.
        assert!(validate_sampling(&batch, &[greedy()]).is_err());
        // A draw exactly when not greedy.
        assert!(validate_sampling(&batch, &[Some(seeded(Some(0.5), 0.0)), None]).is_err());
        assert!(validate_sampling(&batch, &[Some(seeded(None, 1.0)), None]).is_err());
        // A sampling sequence asks for its logits.
        batch.seqs[0].logits = LogitsWanted::None;
        let err = validate_sampling(&batch, &[greedy(), None]).expect_err("no logits");
        assert!(err.to_string().contains("sequence 0"), "{err}");
    }

    #[test]
    fn host_sampling_takes_each_sequences_last_row_and_checks_stop_tokens() {
        // Sequence 0 has two rows (its last one picks 2, a stop token); sequence 1
        // samples nothing; sequence 2 picks 1 and wants its log-probability.
        let logits = Logits {
            vocab: 3,
            data: vec![9.0, 0.0, 0.0, 0.0, 0.0, 9.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0],
            spans: vec![0..2, 2..3, 3..4],
        };
        let mut lp = seeded(None, 0.0);
        lp.logprob = true;
        let out = sample_on_host(&logits, &[Some(seeded(None, 0.0)), None, Some(lp)]);
        let [a, b, c] = out.sampled.as_slice() else {
            panic!("{out:?}")
        };
        assert_eq!(
            a.map(|t| (t.token, t.stop, t.logprob)),
            Some((2, true, None))
        );
        assert_eq!(*b, None);
        let c = c.expect("sampled");
        assert_eq!((c.token, c.stop), (1, false));
        let want = 1.0 - (2.0 * 1f32.exp() + 1.0).ln();
        assert!((c.logprob.expect("asked") - want).abs() < 1e-6, "{c:?}");
    }

    #[test]
    fn a_chunk_naming_an_adapter_the_runner_lacks_is_an_invalid_batch() {
        let batch = Batch {
            seqs: vec![chunk(2, Some(1))],
        };
        assert!(validate_batch(&batch, 10, (16, 4), 2).is_ok());
        let err = validate_batch(&batch, 10, (16, 4), 1).expect_err("one adapter");
        assert!(err.to_string().contains("LoRA adapter 1"), "{err}");
    }
}
