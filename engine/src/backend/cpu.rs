//! The CPU [`ModelRunner`]: a batched llama forward pass over the integer kernels,
//! on a persistent rayon pool.
//!
//! All tokens of a step go through each matrix product together (one weight pass per
//! step, however many sequences), then attention runs against the paged store in one
//! parallel pass over (sequence, query tile, KV head): tiles of [`QUERY_TILE`] tokens
//! for a prefill chunk, of one token for a decode. Within a layer every token's keys
//! and values are stored before any attention, so a prefill chunk sees its own
//! earlier tokens. Per-token results do not depend on what else is in the batch: the
//! kernels compute each token's row with the same operations in the same order (an
//! attention row's result does not depend on the other rows of its tile either).
//!
//! Split decode steps ([`CpuBackend::decode_parts`]): a step of decodes alone, of
//! enough sequences, runs instead as one part per thread, consecutive sequences of
//! about equal cost, each part through every layer on its own single-thread pool
//! (products of fewer rows, but no pass split between the threads and no hand-off
//! of a layer's rows from core to core), sharing the KV store through its
//! per-layer locks. Its logits are the whole step's, bit for bit, by the property
//! above.
//!
//! LoRA adapters ([`CpuBackend::with_adapters`]): after each base product, the rows
//! of each adapter segment ([`Batch::adapter_segments`]) get that adapter's low-rank
//! product added ([`lora::add_segment`]) — q/k/v before RoPE and the KV write, o,
//! gate/up before SwiGLU, down — the segmented scheme described in [`super`]. A row's
//! low-rank product is computed alone, so the batch-independence above still holds.
//!
//! Pipeline stages ([`CpuBackend::forward_stage`], issue #15): a backend may hold one
//! stage of the model ([`crate::model::llama::ModelPart`]): a run of layers, with
//! the embedding on the first stage and the final norm and head on the last, and a KV
//! store of its own layers only, addressed by the leader's block ids. A stage starts
//! from token ids or the previous stage's hidden states and ends with logits or
//! hidden states for the next. Whole passes and stages run the same layer loop, so a
//! pipeline's logits are the single process's, bit for bit.
//!
//! Tensor shards ([`CpuBackend::forward_shard`]): a backend may hold, of each layer,
//! some query heads with the KV heads they read and some MLP columns
//! ([`crate::model::llama::TensorShard`]); the same loop then runs attention over
//! its heads only and hands the output and down projections' partial products to
//! the caller's all-reduce before each residual add.
//!
//! Exact sums ([`crate::kernels::exact`], issue #15): a shard computes those two
//! row-parallel products in fixed point, so that the all-reduce's integer sum is
//! bit for bit what one process computes with [`CpuBackend::set_exact_sums`]; summed
//! in f32, the split's other summation order reached a max |Δlogit| of 2.18 on
//! SmolLM2-135M, through the next layers' int8 re-quantisation. A whole model and a
//! pipeline stage without shards sum in f32 unless switched, because exact sums cost
//! the single process about 7 % of prompt processing (two threads, SmolLM2-135M
//! Q4_1, pp512 331 → 292 tok/s paired medians, tg128 85 → 77, aggregate decode of 16
//! 152 → 141): more than the 3 % that would make them the default. A pipeline
//! without tensor split stays the single process's bits either way, since its
//! stages run the same arithmetic as one process.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use half::f16;
use rayon::prelude::*;

use super::{
    BackendError, Batch, KvGeometry, Logits, ModelOutput, ModelRunner, Segment, SeqChunk,
    sample_on_host, validate_sampling,
};
use crate::kernels::attention::{AttnScratch, AttnTile, KvLayout, NextTile, QUERY_TILE, attend};
use crate::kernels::{self, Isa, PackedMatrix, QuantActs, exact, ops};
use crate::kv::KvCache;
use crate::model::llama::{Linear, LlamaConfig, LlamaWeights, ModelPart, OutputHead};
use crate::model::lora::{self, LoraAdapter, Projection};
use crate::sampling::SeqSampling;

/// Settings of the CPU backend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuConfig {
    /// Worker threads (0: one per available core).
    pub threads: usize,
    /// Positions per KV block.
    pub block_size: usize,
    /// KV blocks per layer.
    pub num_blocks: usize,
}

impl Default for CpuConfig {
    fn default() -> Self {
        Self {
            threads: 0,
            block_size: 16,
            num_blocks: 1024,
        }
    }
}

impl CpuConfig {
    /// Checks the values.
    ///
    /// # Errors
    /// [`CpuConfigError::EmptyKvStore`] with the two sizes.
    pub fn validate(&self) -> Result<(), CpuConfigError> {
        if self.block_size == 0 || self.num_blocks == 0 {
            return Err(CpuConfigError::EmptyKvStore {
                block_size: self.block_size,
                num_blocks: self.num_blocks,
            });
        }
        Ok(())
    }
}

/// A bad [`CpuConfig`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CpuConfigError {
    /// No position to store: zero positions per block, or zero blocks.
    #[error(
        "KV store needs blocks of at least one position, got block_size {block_size} and num_blocks {num_blocks}"
    )]
    EmptyKvStore {
        /// Positions per block.
        block_size: usize,
        /// Blocks per layer.
        num_blocks: usize,
    },
}

/// What a pipeline step starts from ([`CpuBackend::forward_stage`]).
#[derive(Debug)]
pub enum StageInput<'a> {
    /// The batch's token ids, embedded here (the first stage).
    Tokens,
    /// The previous stage's hidden states, `tokens × dim` row-major. The buffer is
    /// swapped with the backend's working one, not copied: the caller gets back a
    /// buffer to receive the next step's states into.
    Hidden(&'a mut Vec<f32>),
}

/// Completes a tensor shard's partial products: replaces the buffer, exact
/// fixed-point sums ([`crate::kernels::exact`]), with its element-wise sum over the
/// stage's tensor ranks ([`CpuBackend::forward_shard`]).
pub type AllReduce<'a> = &'a mut (dyn FnMut(&mut [i64]) -> Result<(), BackendError> + Send);

/// What a pipeline step produced.
#[derive(Debug)]
pub enum StageOutput<'a> {
    /// The last stage's logits.
    Logits(Logits),
    /// The hidden states for the next stage, `tokens × dim` row-major.
    Hidden(&'a [f32]),
}

#[derive(Default)]
struct Scratch {
    x: Vec<f32>,
    h: Vec<f32>,
    qkv: Vec<f32>,
    attn: Vec<f32>,
    attn_tiles: Vec<f32>,
    proj: Vec<f32>,
    /// A row-parallel product's exact sums, before the all-reduce.
    fixed: Vec<i64>,
    gate_up: Vec<f32>,
    ffn: Vec<f32>,
    acts: QuantActs,
}

/// The CPU backend: weights, KV store, thread pool, scratch buffers.
pub struct CpuBackend {
    weights: Arc<LlamaWeights>,
    kv: KvCache,
    pool: Arc<rayon::ThreadPool>,
    /// One single-thread pool per worker of `pool` (none with one worker): the parts
    /// of a split decode step, each on its own ([`split_decode`]).
    part_pools: Arc<Vec<rayon::ThreadPool>>,
    /// Whether decode steps may be split ([`CpuBackend::set_split_decode`]).
    split_decode: bool,
    isa: Isa,
    scratch: Scratch,
    /// The working buffers of a split step's parts, one per part.
    part_scratch: Vec<Scratch>,
    adapters: Vec<Arc<LoraAdapter>>,
    exact_sums: bool,
}

/// What a step reads, borrowed from the backend: the model, the KV store (written
/// through its per-layer locks) and the settings. The parts of a split decode step
/// share one, each with its own [`Scratch`].
#[derive(Clone, Copy)]
struct Forward<'a> {
    weights: &'a LlamaWeights,
    kv: &'a KvCache,
    isa: Isa,
    adapters: &'a [Arc<LoraAdapter>],
    exact_sums: bool,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend")
            .field("isa", &self.isa)
            .field("threads", &self.pool.current_num_threads())
            .field("adapters", &self.adapters.len())
            .finish_non_exhaustive()
    }
}

impl CpuBackend {
    /// A backend over `weights` with a fresh KV store.
    ///
    /// # Errors
    /// An invalid config or a thread pool that cannot start.
    pub fn new(weights: Arc<LlamaWeights>, config: &CpuConfig) -> Result<Self, String> {
        config.validate().map_err(|e| e.to_string())?;
        let c = &weights.config;
        // A tensor rank stores the KV heads of its shard only.
        let layout = KvLayout {
            block_size: config.block_size,
            kv_heads: weights.part.shard_of(c).kv_heads.len(),
            head_dim: c.head_dim,
        };
        // A pipeline stage stores its own layers only; the block ids are the leader's,
        // valid on every stage.
        let kv = KvCache::new(weights.layers.len(), config.num_blocks, layout);
        let pool = Arc::new(
            rayon::ThreadPoolBuilder::new()
                .num_threads(config.threads)
                .thread_name(|i| format!("slipway-cpu-{i}"))
                .build()
                .map_err(|e| e.to_string())?,
        );
        let workers = pool.current_num_threads();
        let part_pools = Arc::new(if workers > 1 {
            (0..workers)
                .map(|part| {
                    rayon::ThreadPoolBuilder::new()
                        .num_threads(1)
                        .thread_name(move |_| format!("slipway-part-{part}"))
                        .build()
                        .map_err(|e| e.to_string())
                })
                .collect::<Result<_, _>>()?
        } else {
            Vec::new()
        });
        let isa = Isa::detect();
        tracing::info!(
            ?isa,
            layers = ?weights.part.layers,
            threads = workers,
            blocks = config.num_blocks,
            kv_bytes = kv.bytes(),
            "CPU backend ready"
        );
        Ok(Self {
            weights,
            kv,
            pool,
            part_pools,
            split_decode: true,
            isa,
            scratch: Scratch::default(),
            part_scratch: Vec::new(),
            adapters: Vec::new(),
            exact_sums: false,
        })
    }

    /// Serves `adapters` next to the model: [`super::SeqChunk::adapter`] indexes them.
    ///
    /// # Errors
    /// An adapter whose shapes do not fit the model, or more than `u16::MAX`.
    pub fn with_adapters(mut self, adapters: Vec<Arc<LoraAdapter>>) -> Result<Self, String> {
        let c = &self.weights.config;
        let (dim, kv, ffn) = (c.dim, c.kv_dim(), c.ffn_dim);
        if self.weights.part.shard.is_some() && !adapters.is_empty() {
            return Err("LoRA adapters on a tensor shard are not supported".to_owned());
        }
        if adapters.len() > usize::from(u16::MAX) {
            return Err(format!(
                "{} LoRA adapters; at most {}",
                adapters.len(),
                u16::MAX
            ));
        }
        for a in &adapters {
            a.check_shapes(c.n_layers, |p| match p {
                Projection::Q | Projection::O => (dim, dim),
                Projection::K | Projection::V => (dim, kv),
                Projection::Gate | Projection::Up => (dim, ffn),
                Projection::Down => (ffn, dim),
            })?;
            tracing::info!(
                adapter = a.name(),
                pairs = a.num_pairs(),
                rank = a.max_rank(),
                alpha = a.alpha(),
                "LoRA adapter ready"
            );
        }
        self.adapters = adapters;
        Ok(self)
    }

    /// The part of the model this backend holds.
    #[must_use]
    pub fn part(&self) -> &ModelPart {
        &self.weights.part
    }

    /// Runs one pipeline step over this backend's layers: from the batch's token ids
    /// on the first stage, from the previous stage's hidden states on the others; to
    /// the logits the batch asks for on the last stage, to the hidden states for the
    /// next stage on the others (borrowed from the backend's working buffer, valid
    /// until the next step). A whole model's step returns its logits, as
    /// [`ModelRunner::forward`] does.
    ///
    /// # Errors
    /// [`BackendError::InvalidBatch`] as [`ModelRunner::forward`];
    /// [`BackendError::Stage`] for an input this stage does not take (token ids
    /// where it does not embed, hidden states where it does or of the wrong size). No
    /// KV is written in either case.
    pub fn forward_stage(
        &mut self,
        batch: &Batch,
        input: StageInput<'_>,
    ) -> Result<StageOutput<'_>, BackendError> {
        self.forward_shard(batch, input, &mut |_| Ok(()))
    }

    /// [`CpuBackend::forward_stage`] on a tensor shard: `all_reduce` replaces each
    /// layer's partial attention output and partial MLP output (`tokens × dim`) with
    /// their sum over the stage's tensor ranks, twice per layer, in layer order. It
    /// runs on the backend's pool, hence `Send`.
    ///
    /// # Errors
    /// As [`CpuBackend::forward_stage`], and whatever `all_reduce` returns.
    pub fn forward_shard(
        &mut self,
        batch: &Batch,
        input: StageInput<'_>,
        all_reduce: AllReduce<'_>,
    ) -> Result<StageOutput<'_>, BackendError> {
        self.validate(batch)?;
        let logits = if batch.seqs.is_empty() {
            self.weights.head.as_ref().map(|_| Logits {
                vocab: self.weights.config.vocab,
                ..Logits::default()
            })
        } else {
            // A shard's step waits on its peers in the all-reduce, where a worker kept
            // awake would take a core from the ranks that share the machine.
            let awake = self.weights.part.shard.is_none();
            let pool = Arc::clone(&self.pool);
            let (fwd, scratch, _) = self.forward_view();
            run_step(&pool, awake, || fwd.run(scratch, batch, input, all_reduce))?
        };
        Ok(match logits {
            Some(logits) => StageOutput::Logits(logits),
            None => {
                let rows = batch.num_tokens() * self.weights.config.dim;
                StageOutput::Hidden(&self.scratch.x[..rows])
            }
        })
    }

    /// Forces an instruction set (tests compare the portable and SIMD paths).
    pub fn set_isa(&mut self, isa: Isa) {
        self.isa = isa;
    }

    /// Sums the row-parallel products exactly ([`crate::kernels::exact`]) on a whole
    /// model or a pipeline stage too, as a tensor shard always does: its logits are
    /// then bit for bit those of any tensor split of the same model (what
    /// `tests/tensor_parallel.rs` compares against). Off by default, because it
    /// costs about 7 % of prompt processing (see the module docs); `slipway-engine
    /// bench --exact-sums` measures it.
    pub fn set_exact_sums(&mut self, exact: bool) {
        self.exact_sums = exact;
    }

    /// Checks `batch` against this backend's vocabulary, KV store and adapters.
    pub(crate) fn validate(&self, batch: &Batch) -> Result<(), BackendError> {
        super::validate_batch(
            batch,
            self.weights.config.vocab,
            (self.kv.layout().block_size, self.kv.num_blocks()),
            self.adapters.len(),
        )
    }

    /// The step's view of the backend, and the working buffers of a whole step and of
    /// a split step's parts.
    fn forward_view(&mut self) -> (Forward<'_>, &mut Scratch, &mut Vec<Scratch>) {
        let fwd = Forward {
            weights: &self.weights,
            kv: &self.kv,
            isa: self.isa,
            adapters: &self.adapters,
            exact_sums: self.exact_sums,
        };
        (fwd, &mut self.scratch, &mut self.part_scratch)
    }
}

impl Forward<'_> {
    /// Adds each segment's low-rank products for `projs` of `layer` onto `out`.
    fn add_lora(
        adapters: &[Arc<LoraAdapter>],
        segments: &[Segment],
        (layer, projs): (usize, &[(Projection, usize)]),
        x: (&[f32], usize),
        out: (&mut [f32], usize),
    ) {
        let (out, out_width) = out;
        for seg in segments {
            // Validated against the table before the step.
            if let Some(a) = adapters.get(usize::from(seg.adapter)) {
                lora::add_segment(a, layer, projs, seg.rows.clone(), x, (&mut *out, out_width));
            }
        }
    }

    fn run_linear(
        isa: Isa,
        parts: &[Linear],
        x: &[f32],
        n: usize,
        sc_acts: &mut QuantActs,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let rows: usize = parts.iter().map(Linear::rows).sum();
        out.resize(n * rows, 0.0);
        if let [only] = parts {
            only.forward(isa, x, n, sc_acts, out)?;
            return Ok(());
        }
        let mut r0 = 0;
        let mut part_out = Vec::new();
        for p in parts {
            part_out.resize(n * p.rows(), 0.0);
            p.forward(isa, x, n, sc_acts, &mut part_out)?;
            for (t, src) in part_out.chunks_exact(p.rows()).enumerate() {
                out[t * rows + r0..t * rows + r0 + p.rows()].copy_from_slice(src);
            }
            r0 += p.rows();
        }
        Ok(())
    }

    /// A row-parallel product (attention output, MLP down) into `out`: given an
    /// all-reduce, with exact sums, in fixed point through it (it completes a shard's
    /// partial sums; a no-op on whole layers), then f32; else in f32 directly, which
    /// only a backend without a shard does. LoRA adapters, refused on shards, are
    /// added by the caller after the sum.
    fn row_parallel(
        isa: Isa,
        layer: &Linear,
        x: &[f32],
        n: usize,
        (acts, fixed): (&mut QuantActs, &mut Vec<i64>),
        out: &mut Vec<f32>,
        all_reduce: Option<AllReduce<'_>>,
    ) -> Result<(), BackendError> {
        let Some(all_reduce) = all_reduce else {
            return Self::run_linear(isa, std::slice::from_ref(layer), x, n, acts, out);
        };
        fixed.resize(n * layer.rows(), 0);
        out.resize(n * layer.rows(), 0.0);
        layer.forward_exact(isa, x, n, acts, fixed)?;
        all_reduce(fixed)?;
        exact::to_f32_slice(fixed, out);
        Ok(())
    }

    /// Runs `batch` through the layers this backend holds, from `input`; returns the
    /// logits when it holds the head, else leaves the hidden states in `scratch.x`.
    /// Single-process and pipeline-stage steps share it, so a stage runs exactly the
    /// single process's arithmetic for its layers.
    fn run(
        &self,
        sc: &mut Scratch,
        batch: &Batch,
        input: StageInput<'_>,
        all_reduce: AllReduce<'_>,
    ) -> Result<Option<Logits>, BackendError> {
        let w = self.weights;
        let dim = w.config.dim;
        let n = batch.num_tokens();
        let x = &mut sc.x;
        // Both checked before any layer runs, so a refused step writes no KV.
        match input {
            StageInput::Tokens => {
                let embed = w.embed.as_ref().ok_or_else(|| {
                    BackendError::Stage(format!(
                        "token ids given to the stage of layers {:?}, which does not embed",
                        w.part.layers
                    ))
                })?;
                x.resize(n * dim, 0.0);
                for (t, tok) in batch.seqs.iter().flat_map(|s| s.tokens.iter()).enumerate() {
                    embed.lookup(*tok, &mut x[t * dim..(t + 1) * dim])?;
                }
            }
            StageInput::Hidden(hidden) => {
                if w.embed.is_some() || hidden.len() != n * dim {
                    return Err(BackendError::Stage(format!(
                        "{} hidden-state floats given to the stage of layers {:?} for {n} \
tokens of width {dim}{}",
                        hidden.len(),
                        w.part.layers,
                        if w.embed.is_some() {
                            ", which embeds token ids itself"
                        } else {
                            ""
                        }
                    )));
                }
                // The caller's buffer becomes the next working one: no copy.
                std::mem::swap(x, hidden);
            }
        }
        self.run_layers(sc, batch, all_reduce)?;
        w.head
            .as_ref()
            .map(|head| self.output_head(sc, batch, head))
            .transpose()
    }

    /// The layer loop over the step's hidden states in `scratch.x`, over the heads
    /// and MLP columns this backend holds (all of them, or a tensor shard's).
    fn run_layers(
        &self,
        sc: &mut Scratch,
        batch: &Batch,
        all_reduce: AllReduce<'_>,
    ) -> Result<(), BackendError> {
        let w = self.weights;
        let c = &w.config;
        let first_layer = w.part.layers.start;
        let isa = self.isa;
        // A shard's partial sums must be exact for the all-reduce to complete them
        // to the single process's bits.
        let exact = self.exact_sums || w.part.shard.is_some();
        let shard = w.part.shard_of(c);
        let (dim, hd) = (c.dim, c.head_dim);
        // This backend's query width, KV width and MLP width: the whole model's
        // without a shard.
        let (qd, kvd, ffn) = (
            shard.q_heads.len() * hd,
            shard.kv_heads.len() * hd,
            shard.ffn.len(),
        );
        let group = c.n_heads / c.n_kv_heads;
        let layout = self.kv.layout();
        let n: usize = batch.num_tokens();
        // Per token: position, owning chunk and RoPE table.
        let mut pos = Vec::with_capacity(n);
        let mut seq_of = Vec::with_capacity(n);
        for (i, s) in batch.seqs.iter().enumerate() {
            for j in 0..s.tokens.len() {
                pos.push(s.start_pos + j);
                seq_of.push(i);
            }
        }
        let bs = layout.block_size;
        // Where each token's keys and values go: (block, slot).
        let slots: Vec<(u32, usize)> = pos
            .iter()
            .zip(&seq_of)
            .map(|(&p, &i)| (batch.seqs[i].block_table[p / bs], p % bs))
            .collect();
        let rope: Vec<Vec<(f32, f32)>> = pos
            .iter()
            .map(|&p| ops::rope_table(p, c.rope_dims, c.rope_base))
            .collect();
        sc.h.resize(n * dim, 0.0);
        sc.attn.resize(n * qd, 0.0);
        sc.attn_tiles.resize(n * qd, 0.0);
        let tiles = attention_tiles(batch, shard.kv_heads.len());
        sc.ffn.resize(n * ffn, 0.0);
        let scale = 1.0 / (hd as f32).sqrt();
        let segments = batch.adapter_segments();
        let adapters = &self.adapters;
        let qkv_w = qd + 2 * kvd;
        // Adapters are refused on shards, so these offsets are the whole model's.
        let (qkv_lora, gate_up_lora) = (
            [
                (Projection::Q, 0),
                (Projection::K, qd),
                (Projection::V, qd + kvd),
            ],
            [(Projection::Gate, 0), (Projection::Up, ffn)],
        );
        for (li, layer) in w.layers.iter().enumerate() {
            // LoRA adapters are indexed by model layer, the stage's KV by its own.
            let model_layer = first_layer + li;
            // Requested a product ahead of the writes below.
            self.kv.prefetch_slots(li, slots.iter().copied());
            ops::rms_norm(&sc.x, &layer.attn_norm, c.norm_eps, &mut sc.h);
            Self::run_linear(isa, &layer.qkv, &sc.h, n, &mut sc.acts, &mut sc.qkv)?;
            Self::add_lora(
                adapters,
                &segments,
                (model_layer, &qkv_lora),
                (&sc.h, dim),
                (&mut sc.qkv, qkv_w),
            );
            // Rotated in parallel (a prompt's rows are many), stored in order.
            sc.qkv
                .par_chunks_exact_mut(qkv_w)
                .zip(rope.par_iter())
                .with_min_len(16)
                .for_each(|(row, table)| ops::rope_in_place(&mut row[..qd + kvd], hd, table));
            let mut writer = self.kv.layer_writer(li);
            for (row, &(block, slot)) in sc.qkv.chunks_exact(qkv_w).zip(&slots) {
                let (k, v) = row[qd..].split_at(kvd);
                writer.write(block, slot, k, v);
            }
            drop(writer);
            // Held for the attention pass only: the other parts of a split step wait on
            // it to store their own positions of this layer.
            let kv_read = self.kv.layer(li);
            let kv_layer: &[f16] = &kv_read;
            let qkv = &sc.qkv;
            // Each tile's output is one contiguous run of `attn_tiles` (its tokens, each
            // with the heads of its group): split off in task order, computed in one
            // parallel pass, then copied to the tokens' rows.
            let width = group * hd;
            let mut rest = sc.attn_tiles.as_mut_slice();
            let mut jobs = Vec::with_capacity(tiles.len());
            for (i, tile) in tiles.iter().enumerate() {
                let (mine, tail) = std::mem::take(&mut rest).split_at_mut(tile.tokens * width);
                // A worker takes a contiguous run of the tasks, so the next in order is
                // most often its next.
                let next = tiles.get(i + 1).map(|n| {
                    let s = &batch.seqs[n.seq];
                    NextTile {
                        table: &s.block_table,
                        kv_head: n.kv_head,
                        last: s.start_pos + n.first + n.tokens - 1,
                    }
                });
                jobs.push((tile, next, mine));
                rest = tail;
            }
            jobs.into_par_iter().for_each_init(
                AttnScratch::default,
                |scratch, (tile, next, out)| {
                    let s = &batch.seqs[tile.seq];
                    let t = AttnTile {
                        layer: kv_layer,
                        layout,
                        table: &s.block_table,
                        pos: s.start_pos + tile.first,
                        tokens: tile.tokens,
                        kv_head: tile.kv_head,
                        group,
                        q: &qkv[tile.token() * qkv_w + tile.kv_head * width..],
                        q_stride: qkv_w,
                        scale,
                        next,
                    };
                    attend(isa, &t, scratch, out);
                },
            );
            drop(kv_read);
            let rows = tiles.iter().flat_map(|tile| {
                (tile.token()..tile.token() + tile.tokens).map(|t| t * qd + tile.kv_head * width)
            });
            for (at, src) in rows.zip(sc.attn_tiles.chunks_exact(width)) {
                sc.attn[at..at + width].copy_from_slice(src);
            }
            // A shard's product is a partial sum over its heads.
            Self::row_parallel(
                isa,
                &layer.wo,
                &sc.attn,
                n,
                (&mut sc.acts, &mut sc.fixed),
                &mut sc.proj,
                exact.then_some(&mut *all_reduce),
            )?;
            Self::add_lora(
                adapters,
                &segments,
                (model_layer, &[(Projection::O, 0)]),
                (&sc.attn, qd),
                (&mut sc.proj, dim),
            );
            ops::add_in_place(&mut sc.x, &sc.proj);
            ops::rms_norm(&sc.x, &layer.ffn_norm, c.norm_eps, &mut sc.h);
            match fused_gate_up(&layer.gate_up, ffn) {
                // LoRA adds to the gate and up values before the SwiGLU, so a batch with
                // adapters takes the product whole.
                Some(m) if segments.is_empty() => {
                    sc.acts.quantize(isa, &sc.h, n, m.cols())?;
                    kernels::matmul_swiglu(isa, m, &sc.acts, &mut sc.ffn)?;
                }
                _ => {
                    Self::run_linear(isa, &layer.gate_up, &sc.h, n, &mut sc.acts, &mut sc.gate_up)?;
                    Self::add_lora(
                        adapters,
                        &segments,
                        (model_layer, &gate_up_lora),
                        (&sc.h, dim),
                        (&mut sc.gate_up, 2 * ffn),
                    );
                    ops::swiglu(&sc.gate_up, ffn, &mut sc.ffn);
                }
            }
            // A shard's product is a partial sum over its MLP columns.
            Self::row_parallel(
                isa,
                &layer.down,
                &sc.ffn,
                n,
                (&mut sc.acts, &mut sc.fixed),
                &mut sc.proj,
                exact.then_some(&mut *all_reduce),
            )?;
            Self::add_lora(
                adapters,
                &segments,
                (model_layer, &[(Projection::Down, 0)]),
                (&sc.ffn, ffn),
                (&mut sc.proj, dim),
            );
            ops::add_in_place(&mut sc.x, &sc.proj);
        }
        Ok(())
    }

    /// The final norm and output head over the rows the batch asked logits for.
    fn output_head(
        &self,
        sc: &mut Scratch,
        batch: &Batch,
        head: &OutputHead,
    ) -> Result<Logits, BackendError> {
        let c = &self.weights.config;
        let (dim, isa) = (c.dim, self.isa);
        // Only the rows someone asked for go through the (large) output head.
        let (rows, spans) = batch.logits_rows();
        let m = rows.len();
        let mut sel = Vec::with_capacity(m * dim);
        for &r in &rows {
            sel.extend_from_slice(&sc.x[r * dim..(r + 1) * dim]);
        }
        sc.h.resize(m * dim, 0.0);
        ops::rms_norm(&sel, &head.norm, c.norm_eps, &mut sc.h);
        let mut data = Vec::new();
        Self::run_linear(
            isa,
            std::slice::from_ref(&head.output),
            &sc.h,
            m,
            &mut sc.acts,
            &mut data,
        )?;
        Ok(Logits {
            vocab: c.vocab,
            data,
            spans,
        })
    }
}

/// The packed `[gate; up]` matrix of a layer when [`kernels::matmul_swiglu`] can
/// take it: one matrix of `2 * ffn` rows in whole groups (the loader stacks the two
/// when they share a block format).
fn fused_gate_up(gate_up: &[Linear], ffn: usize) -> Option<&PackedMatrix> {
    match gate_up {
        [Linear::Packed(m)] if m.rows() == 2 * ffn && ffn.is_multiple_of(kernels::GROUP) => Some(m),
        _ => None,
    }
}

/// One attention task of a step: `tokens` consecutive tokens, from `first`, of chunk
/// `seq` (whose first token is row `row` of the step), for one KV head.
struct Tile {
    seq: usize,
    row: usize,
    first: usize,
    tokens: usize,
    kv_head: usize,
}

impl Tile {
    /// Row of the tile's first token in the step.
    fn token(&self) -> usize {
        self.row + self.first
    }
}

/// The attention tasks of a step, the same for every layer: each chunk in tiles of
/// [`QUERY_TILE`] tokens (a decode step is a tile of one) for each KV head, so a
/// prefill and a batch of decodes are both one parallel pass.
fn attention_tiles(batch: &Batch, kv_heads: usize) -> Vec<Tile> {
    let mut tiles = Vec::new();
    let mut row = 0;
    for (seq, s) in batch.seqs.iter().enumerate() {
        let len = s.tokens.len();
        for first in (0..len).step_by(QUERY_TILE) {
            for kv_head in 0..kv_heads {
                tiles.push(Tile {
                    seq,
                    row,
                    first,
                    tokens: QUERY_TILE.min(len - first),
                    kv_head,
                });
            }
        }
        row += len;
    }
    tiles
}

impl ModelRunner for CpuBackend {
    fn config(&self) -> &LlamaConfig {
        &self.weights.config
    }

    fn kv_geometry(&self) -> KvGeometry {
        KvGeometry {
            block_size: self.kv.layout().block_size,
            num_blocks: self.kv.num_blocks(),
        }
    }

    fn adapters(&self) -> &[Arc<LoraAdapter>] {
        &self.adapters
    }

    fn forward(&mut self, batch: &Batch) -> Result<Logits, BackendError> {
        self.validate_whole_step(batch)?;
        self.forward_checked(batch)
    }

    /// As the default, except that a split decode step samples each part's rows on
    /// that part's thread, beside its forward pass, instead of on one thread after
    /// both.
    fn execute(
        &mut self,
        batch: &Batch,
        sampling: &[Option<SeqSampling>],
    ) -> Result<ModelOutput, BackendError> {
        validate_sampling(batch, sampling)?;
        self.validate_whole_step(batch)?;
        let Some(parts) = self.decode_parts(batch) else {
            return Ok(sample_on_host(&self.forward_checked(batch)?, sampling));
        };
        let outputs = self.run_split(batch, &parts, |seqs, logits| {
            sample_on_host(&logits, &sampling[seqs])
        })?;
        Ok(ModelOutput {
            sampled: outputs.into_iter().flat_map(|o| o.sampled).collect(),
        })
    }
}

fn whole_model_without_logits() -> BackendError {
    BackendError::Stage("a whole model returned no logits".into())
}

impl CpuBackend {
    /// [`ModelRunner::forward`] of a batch [`CpuBackend::validate_whole_step`] passed.
    fn forward_checked(&mut self, batch: &Batch) -> Result<Logits, BackendError> {
        if batch.seqs.is_empty() {
            return Ok(Logits {
                vocab: self.weights.config.vocab,
                ..Logits::default()
            });
        }
        if let Some(parts) = self.decode_parts(batch) {
            let vocab = self.weights.config.vocab;
            let mut joined = Logits {
                vocab,
                data: Vec::new(),
                spans: Vec::with_capacity(batch.seqs.len()),
            };
            for logits in self.run_split(batch, &parts, |_, logits| logits)? {
                let rows = joined.data.len() / vocab.max(1);
                joined.data.extend_from_slice(&logits.data);
                joined
                    .spans
                    .extend(logits.spans.iter().map(|s| s.start + rows..s.end + rows));
            }
            return Ok(joined);
        }
        let pool = Arc::clone(&self.pool);
        let (fwd, scratch, _) = self.forward_view();
        run_step(&pool, true, || {
            fwd.run(scratch, batch, StageInput::Tokens, &mut |_| Ok(()))
        })?
        .ok_or_else(whole_model_without_logits)
    }

    /// Lets decode steps be split between the threads ([`split_decode`]); on by
    /// default. Tests and `slipway-engine bench --no-split-decode` turn it off to
    /// compare: the logits are the same bits either way.
    pub fn set_split_decode(&mut self, split: bool) {
        self.split_decode = split;
    }

    /// How [`ModelRunner::forward`] splits `batch` between the threads, as ranges of
    /// `batch.seqs` each run through every layer by one thread alone ([`split_decode`]),
    /// or `None` when it runs the step whole.
    #[must_use]
    pub fn decode_parts(&self, batch: &Batch) -> Option<Vec<Range<usize>>> {
        let block_size = self.kv.layout().block_size;
        self.split_decode
            .then(|| split_decode(batch, self.part_pools.len(), block_size))
            .flatten()
    }

    /// Checks `batch` as [`CpuBackend::validate`] does, and that this backend holds
    /// the whole model (a stage runs `forward_stage`).
    fn validate_whole_step(&self, batch: &Batch) -> Result<(), BackendError> {
        self.validate(batch)?;
        let part = &self.weights.part;
        if !part.is_whole(self.weights.config.n_layers) {
            return Err(BackendError::Stage(format!(
                "this backend holds layers {:?} of {} only; it runs pipeline steps \
(`forward_stage`), not whole forward passes",
                part.layers, self.weights.config.n_layers
            )));
        }
        Ok(())
    }

    /// Runs a decode step as `parts` (ranges of `batch.seqs`), each on its own
    /// single-thread pool through every layer and then through `finish` (given the
    /// part's range and logits) there too; returns what `finish` made, in batch order.
    fn run_split<R: Send>(
        &mut self,
        batch: &Batch,
        parts: &[Range<usize>],
        finish: impl Fn(Range<usize>, Logits) -> R + Sync,
    ) -> Result<Vec<R>, BackendError> {
        let batches: Vec<Batch> = parts
            .iter()
            .map(|r| Batch {
                seqs: batch.seqs[r.clone()].to_vec(),
            })
            .collect();
        let pools = Arc::clone(&self.part_pools);
        let (fwd, _, part_scratch) = self.forward_view();
        if part_scratch.len() < parts.len() {
            part_scratch.resize_with(parts.len(), Scratch::default);
        }
        let finish = &finish;
        let jobs = batches
            .iter()
            .zip(parts)
            .zip(part_scratch)
            .map(|((part, seqs), scratch)| {
                move || {
                    let logits = fwd
                        .run(scratch, part, StageInput::Tokens, &mut |_| Ok(()))?
                        .ok_or_else(whole_model_without_logits)?;
                    Ok(finish(seqs.clone(), logits))
                }
            })
            .collect();
        run_on_each(&pools, jobs).into_iter().collect()
    }
}

/// Sequences a part of a split decode step gets at least; fewer, and the step runs
/// whole. Measured (same binary, split or not, alternating, 2 threads): at 2 and 4
/// sequences whole steps are faster (411–537 vs 330–362 tok/s at 2); at 8 they are
/// even (split 889–922; whole 1,012–1,030 or 759–862, as the host's two states
/// have it); at 16 and 64 split steps win (see `engine/BENCHMARKS.md`).
const MIN_PART_SEQS: usize = 4;

/// What one decode sequence costs a part, in KV positions its attention reads: the
/// products of a token cost as much as attention over ~560 positions (in a decode
/// step of 16 sequences at ~190 positions, the products took 70 % of the step and
/// attention 24 %).
const TOKEN_COST_IN_POSITIONS: usize = 560;

/// How to split a decode step between `threads` (consecutive ranges of `batch.seqs`
/// of about equal cost), or `None` to run it whole.
///
/// A decode step of a few dozen sequences is a small-M product per weight matrix;
/// run whole, each of its ~270 parallel passes splits the rows of one product
/// between the threads and joins them, and each layer hands its rows from one core
/// to the other. Split, each thread runs its own sequences through every layer
/// alone, reading all the weights itself: two pinned one-thread processes with 8
/// sequences each made 1,199–1,221 tokens/s together, one two-thread process with 16
/// 833–1,089. So only steps of decodes alone (one token per sequence; a prompt chunk
/// keeps the threads on its own large products) of at least [`MIN_PART_SEQS`] a
/// part, and only when no part reads a block another part writes in this step, so
/// the result does not depend on which part runs first: each sequence's logits are
/// then the whole step's, bit for bit.
fn split_decode(batch: &Batch, threads: usize, block_size: usize) -> Option<Vec<Range<usize>>> {
    let seqs = &batch.seqs;
    if threads < 2
        || seqs.len() < threads * MIN_PART_SEQS
        || seqs.iter().any(|s| s.tokens.len() != 1)
    {
        return None;
    }
    let cost = |s: &SeqChunk| TOKEN_COST_IN_POSITIONS + s.start_pos + 1;
    let total: usize = seqs.iter().map(cost).sum();
    let mut parts = Vec::with_capacity(threads);
    let (mut start, mut sum) = (0, 0);
    for (i, s) in seqs.iter().enumerate() {
        sum += cost(s);
        // Cut where the running cost first reaches the next part's share.
        if parts.len() + 1 < threads && sum * threads >= total * (parts.len() + 1) {
            parts.push(start..i + 1);
            start = i + 1;
        }
    }
    parts.push(start..seqs.len());
    if parts.len() != threads || parts.iter().any(|p| p.len() < MIN_PART_SEQS) {
        return None;
    }
    writes_stay_in_their_part(batch, &parts, block_size).then_some(parts)
}

/// Whether every block a part writes this step is read and written by that part
/// alone.
fn writes_stay_in_their_part(batch: &Batch, parts: &[Range<usize>], block_size: usize) -> bool {
    let mut writer = std::collections::HashMap::new();
    for (p, range) in parts.iter().enumerate() {
        for s in &batch.seqs[range.clone()] {
            let Some(&block) = s.block_table.get(s.start_pos / block_size) else {
                return false;
            };
            if *writer.entry(block).or_insert(p) != p {
                return false;
            }
        }
    }
    parts.iter().enumerate().all(|(p, range)| {
        batch.seqs[range.clone()].iter().all(|s| {
            let read = &s.block_table[..s.block_table.len().min(s.start_pos / block_size + 1)];
            read.iter().all(|b| writer.get(b).is_none_or(|&w| w == p))
        })
    })
}

/// Runs `jobs[i]` on `pools[i]`, all at once, and returns their results in order;
/// the caller's thread waits.
fn run_on_each<R: Send>(
    pools: &[rayon::ThreadPool],
    jobs: Vec<impl FnOnce() -> R + Send>,
) -> Vec<R> {
    let mut results: Vec<Option<R>> = jobs.iter().map(|_| None).collect();
    spawn_each(pools, jobs.into_iter().zip(results.iter_mut()));
    results
        .into_iter()
        .map(|r| r.expect("a scope returns after its jobs have run"))
        .collect()
}

/// Spawns each job on the next pool, inside nested scopes that return when all have
/// run (rayon's scopes, as a pool's `install` would block the caller on the first).
fn spawn_each<'a, R: Send + 'a, F: FnOnce() -> R + Send + 'a>(
    pools: &[rayon::ThreadPool],
    mut jobs: impl Iterator<Item = (F, &'a mut Option<R>)>,
) {
    let (Some((pool, pools)), Some((job, result))) = (pools.split_first(), jobs.next()) else {
        return;
    };
    pool.in_place_scope(|scope| {
        scope.spawn(move |_| *result = Some(job()));
        spawn_each(pools, jobs);
    });
}

/// Runs one step on `pool`; with `awake`, the pool's other workers stay awake until it
/// returns.
///
/// Running the whole step inside the pool keeps the caller's thread a worker, so each
/// product's fork/join does not cross into a sleeping thread. But a step is hundreds
/// of parallel passes (products, quantizations, attention) with a few microseconds of
/// serial work between them (norms, the KV write), and between two passes rayon's
/// idle workers yield 32 times and then sleep: waking one again (a futex, and in a VM
/// an interrupt to a halted virtual CPU) cost more than a decode step's quantization
/// itself. So each other worker runs a job that takes the pool's pending work
/// (`rayon::yield_now`) and, finding none, yields its core as rayon's own idle rounds
/// do (`std::thread::yield_now`, so the HTTP and tokenizer threads get it whenever
/// they are runnable), until the step ends; between steps they sleep as before.
fn run_step<R: Send>(pool: &rayon::ThreadPool, awake: bool, step: impl FnOnce() -> R + Send) -> R {
    pool.install(|| {
        let me = match rayon::current_thread_index() {
            Some(me) if awake && rayon::current_num_threads() > 1 => me,
            _ => return step(),
        };
        /// Ends the other workers' jobs when the step returns or unwinds.
        struct Done(Arc<AtomicBool>);
        impl Drop for Done {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Release);
            }
        }
        let done = Done(Arc::new(AtomicBool::new(false)));
        let flag = Arc::clone(&done.0);
        rayon::spawn_broadcast(move |worker| {
            if worker.index() == me {
                return;
            }
            while !flag.load(Ordering::Acquire) {
                if rayon::yield_now() != Some(rayon::Yield::Executed) {
                    std::thread::yield_now();
                }
            }
        });
        step()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::LogitsWanted;

    /// A decode chunk at `pos` over `table` (blocks of 16 positions).
    fn decode(pos: usize, table: Vec<u32>) -> SeqChunk {
        SeqChunk {
            tokens: vec![1],
            start_pos: pos,
            block_table: table,
            logits: LogitsWanted::Last,
            adapter: None,
        }
    }

    /// `n` decodes at `pos`, each in blocks of its own from `first`.
    fn decodes(n: usize, pos: usize, first: u32) -> Vec<SeqChunk> {
        let blocks = u32::try_from(pos / 16 + 1).expect("small");
        (0..n)
            .map(|i| {
                let start = first + u32::try_from(i).expect("small") * blocks;
                decode(pos, (start..start + blocks).collect())
            })
            .collect()
    }

    #[test]
    fn equal_decodes_split_in_equal_halves() {
        let batch = Batch {
            seqs: decodes(16, 100, 0),
        };
        assert_eq!(split_decode(&batch, 2, 16), Some(vec![0..8, 8..16]));
        assert_eq!(
            split_decode(&batch, 4, 16),
            Some(vec![0..4, 4..8, 8..12, 12..16])
        );
    }

    #[test]
    fn long_contexts_weigh_more() {
        // Eight at 2,000 positions, then eight at 10: the first part ends early.
        let mut seqs = decodes(8, 2000, 0);
        seqs.extend(decodes(8, 10, 2000));
        let parts = split_decode(&Batch { seqs }, 2, 16).expect("split");
        assert_eq!(parts.len(), 2);
        assert!(
            parts[0].len() < 8 && parts[0].len() >= MIN_PART_SEQS,
            "{parts:?}"
        );
    }

    #[test]
    fn prompts_small_batches_and_one_thread_run_whole() {
        let mut with_prompt = Batch {
            seqs: decodes(16, 100, 0),
        };
        with_prompt.seqs[3].tokens = vec![1, 2];
        assert_eq!(split_decode(&with_prompt, 2, 16), None);
        let small = Batch {
            seqs: decodes(2 * MIN_PART_SEQS - 1, 100, 0),
        };
        assert_eq!(split_decode(&small, 2, 16), None);
        let batch = Batch {
            seqs: decodes(16, 100, 0),
        };
        assert_eq!(split_decode(&batch, 1, 16), None);
        // Heavier than a part's share, and too few after it for another part.
        let mut lopsided = decodes(MIN_PART_SEQS, 100_000, 0);
        lopsided.extend(decodes(MIN_PART_SEQS, 0, 100_000));
        assert_eq!(split_decode(&Batch { seqs: lopsided }, 2, 16), None);
    }

    #[test]
    fn a_block_written_in_one_part_and_used_in_another_keeps_the_step_whole() {
        // Sixteen sequences sharing two full blocks of prefix: still split.
        let shared: Vec<SeqChunk> = (0..16u32).map(|i| decode(40, vec![500, 501, i])).collect();
        let batch = Batch { seqs: shared };
        assert_eq!(split_decode(&batch, 2, 16), Some(vec![0..8, 8..16]));
        // The last sequence reads the block the first one writes.
        let mut reads = batch.clone();
        reads.seqs[15].block_table = vec![500, 0, 15];
        assert_eq!(split_decode(&reads, 2, 16), None);
        // Two sequences in different parts write the same block.
        let mut writes = batch;
        writes.seqs[15].block_table[2] = 0;
        assert_eq!(split_decode(&writes, 2, 16), None);
    }
}
