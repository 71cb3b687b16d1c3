//! The device forward pass: a [`ModelRunner`] over any [`Device`]. With
//! [`super::CpuDevice`] it runs on the CPU twins (tests, no GPU needed); with
//! `CudaDevice` it is the CUDA backend.
//!
//! Invariants:
//! - weights stay in their GGUF block encoding on the device (Q4_1/Q8_0); norms are
//!   uploaded as f32; projections that read the same input (Q/K/V, gate/up) write
//!   side by side into one output row;
//! - the KV pool has one more block than it reports: padding tokens of a decode
//!   bucket write there, so padding never touches a sequence's blocks;
//! - a step of decode tokens only (one token per sequence, last logits) is padded to
//!   a batch-size bucket and, on a device that records, replayed as one CUDA graph;
//!   the graph's launches read every per-step input from fixed device buffers, which
//!   are written before each replay. Growing a buffer drops every recorded graph;
//! - [`ModelRunner::execute`] chooses tokens where the logits are: greedy rows by the
//!   argmax every step computes, top-k/top-p rows by the sampling kernel, and only the
//!   ids come back. What the kernels do not cover (penalties, top-k of 0 or above
//!   256, log-probabilities) is sampled on the host from that row alone, read back,
//!   on the same worker thread (`choice` says why, per case).

use std::collections::HashSet;

use super::twin::{KvParams, MatShape, QuantFormat, SampleParams};
use super::{Device, DeviceError, RopeParams, check_sample_params};
use crate::backend::{
    BackendError, Batch, KvGeometry, Logits, LogitsWanted, ModelOutput, ModelRunner,
    validate_batch, validate_sampling,
};
use crate::kernels::quant::{WeightFormat, dequantize_row};
use crate::model::gguf::{GgmlType, GgufError, GgufFile};
use crate::model::llama::{LlamaConfig, ModelError};
use crate::sampling::SeqSampling;

/// Settings of a device runner.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceConfig {
    /// Positions per KV block.
    pub block_size: usize,
    /// KV blocks; `None`: as many as `memory_fraction` of the free device memory holds
    /// after the weights (required for devices that report no memory limit).
    pub num_blocks: Option<usize>,
    /// Share of free device memory the KV pool may take.
    pub memory_fraction: f64,
    /// Decode batch sizes recorded as graphs (ascending; empty: no graphs).
    pub graph_buckets: Vec<usize>,
}

impl Default for DeviceConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_blocks: None,
            memory_fraction: 0.85,
            graph_buckets: vec![1, 2, 4, 8, 16, 32, 64, 128, 256],
        }
    }
}

impl DeviceConfig {
    /// Checks the values.
    ///
    /// # Errors
    /// The first bad value.
    pub fn validate(&self) -> Result<(), DeviceConfigError> {
        if self.block_size == 0 || self.num_blocks == Some(0) {
            return Err(DeviceConfigError::EmptyKvStore {
                block_size: self.block_size,
                num_blocks: self.num_blocks,
            });
        }
        if !(self.memory_fraction > 0.0 && self.memory_fraction <= 1.0) {
            return Err(DeviceConfigError::MemoryFraction(self.memory_fraction));
        }
        if self.graph_buckets.contains(&0) || !self.graph_buckets.is_sorted() {
            return Err(DeviceConfigError::GraphBuckets(self.graph_buckets.clone()));
        }
        Ok(())
    }
}

/// A bad [`DeviceConfig`].
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum DeviceConfigError {
    /// No position to store: zero positions per block, or zero blocks.
    #[error(
        "KV store needs blocks of at least one position: block_size {block_size}, num_blocks {num_blocks:?}"
    )]
    EmptyKvStore {
        /// Positions per block.
        block_size: usize,
        /// Blocks, if set.
        num_blocks: Option<usize>,
    },
    /// The share of device memory is outside (0, 1].
    #[error("memory_fraction must be in (0, 1]: {0}")]
    MemoryFraction(f64),
    /// Graph batch sizes with a zero or out of order.
    #[error("graph buckets must be ascending and positive: {0:?}")]
    GraphBuckets(Vec<usize>),
}

/// Errors building a device runner.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The model file.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A tensor of the file.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// The device.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// A bad setting.
    #[error(transparent)]
    Config(#[from] DeviceConfigError),
    /// Something the device kernels do not handle.
    #[error("{0}")]
    Unsupported(String),
}

/// A quantized matrix on the device.
struct DevLinear<D: Device> {
    fmt: QuantFormat,
    rows: usize,
    cols: usize,
    w: D::Buf<u8>,
}

struct DevLayer<D: Device> {
    attn_norm: D::Buf<f32>,
    qkv: Vec<DevLinear<D>>,
    wo: DevLinear<D>,
    ffn_norm: D::Buf<f32>,
    gate_up: Vec<DevLinear<D>>,
    down: DevLinear<D>,
}

/// Per-step buffers, grown on demand (never shrunk).
struct Scratch<D: Device> {
    tokens: D::Buf<u32>,
    pos: D::Buf<u32>,
    slots: D::Buf<u32>,
    table_off: D::Buf<u32>,
    tables: D::Buf<u32>,
    ident: D::Buf<u32>,
    rows: D::Buf<u32>,
    ids: D::Buf<u32>,
    x: D::Buf<f32>,
    h: D::Buf<f32>,
    qkv: D::Buf<f32>,
    attn: D::Buf<f32>,
    proj: D::Buf<f32>,
    gate_up: D::Buf<f32>,
    ffn: D::Buf<f32>,
    logits: D::Buf<f32>,
    /// The sampling kernel's per-row draws, working copy of the logits, and picks.
    uniforms: D::Buf<f32>,
    sample_work: D::Buf<f32>,
    sampled: D::Buf<u32>,
    /// Tokens, logits rows and table entries the buffers hold.
    cap: (usize, usize, usize),
}

/// One step's inputs, on the host.
#[derive(Default)]
struct StepInputs {
    tokens: Vec<u32>,
    pos: Vec<u32>,
    slots: Vec<u32>,
    table_off: Vec<u32>,
    tables: Vec<u32>,
    rows: Vec<u32>,
    spans: Vec<std::ops::Range<usize>>,
}

/// The llama forward pass on a [`Device`].
pub struct DeviceRunner<D: Device> {
    dev: D,
    config: LlamaConfig,
    device_config: DeviceConfig,
    embed: DevLinear<D>,
    layers: Vec<DevLayer<D>>,
    output_norm: D::Buf<f32>,
    output: DevLinear<D>,
    k_cache: D::Buf<u16>,
    v_cache: D::Buf<u16>,
    /// Blocks reported to the scheduler (the pool holds one more, for padding).
    num_blocks: usize,
    scratch: Option<Scratch<D>>,
    captured: HashSet<usize>,
}

impl<D: Device> std::fmt::Debug for DeviceRunner<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceRunner")
            .field("device", &self.dev.name())
            .field("num_blocks", &self.num_blocks)
            .finish_non_exhaustive()
    }
}

fn quant_format(t: GgmlType, name: &str) -> Result<QuantFormat, LoadError> {
    match t {
        GgmlType::Q4_1 => Ok(QuantFormat::Q4_1),
        GgmlType::Q8_0 => Ok(QuantFormat::Q8_0),
        other => Err(LoadError::Unsupported(format!(
            "{name} is {}: the device kernels read Q4_1 and Q8_0 matrices",
            other.name()
        ))),
    }
}

fn linear<D: Device>(
    dev: &D,
    file: &GgufFile,
    parts: &[(String, usize)],
    cols: usize,
) -> Result<Vec<DevLinear<D>>, LoadError> {
    let mut views = Vec::new();
    for (name, rows) in parts {
        let t = file.tensor(name)?;
        if t.dims != [cols as u64, *rows as u64] {
            return Err(ModelError::Invalid(format!(
                "{name} has shape {:?}, expected [{cols}, {rows}]",
                t.dims
            ))
            .into());
        }
        views.push((quant_format(t.dtype, name)?, *rows, t.data));
    }
    // One stacked matrix when every part has the same format: ggml rows are
    // independent, so the parts' bytes back to back are the stacked matrix.
    if views.iter().all(|v| v.0 == views[0].0) {
        let bytes: Vec<u8> = views.iter().flat_map(|v| v.2.iter().copied()).collect();
        return Ok(vec![DevLinear {
            fmt: views[0].0,
            rows: views.iter().map(|v| v.1).sum(),
            cols,
            w: dev.upload(&bytes)?,
        }]);
    }
    views
        .into_iter()
        .map(|(fmt, rows, data)| {
            Ok(DevLinear {
                fmt,
                rows,
                cols,
                w: dev.upload(data)?,
            })
        })
        .collect()
}

fn single<D: Device>(
    dev: &D,
    file: &GgufFile,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<DevLinear<D>, LoadError> {
    linear(dev, file, &[(name.to_owned(), rows)], cols)?
        .pop()
        .ok_or_else(|| LoadError::Unsupported(format!("{name} produced no matrix")))
}

fn norm<D: Device>(
    dev: &D,
    file: &GgufFile,
    name: &str,
    len: usize,
) -> Result<D::Buf<f32>, LoadError> {
    let t = file.tensor(name)?;
    let fmt = match t.dtype {
        GgmlType::F32 => WeightFormat::F32,
        GgmlType::F16 => WeightFormat::F16,
        other => {
            return Err(LoadError::Unsupported(format!(
                "{name} is {}: norms must be F32 or F16",
                other.name()
            )));
        }
    };
    let mut out = vec![0f32; len];
    dequantize_row(fmt, t.data, &mut out).map_err(|source| ModelError::Kernel {
        tensor: name.to_owned(),
        source,
    })?;
    Ok(dev.upload(&out)?)
}

/// How a device runner chooses one sequence's token.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Choice {
    /// The argmax every step computes on the device (greedy without penalties).
    Argmax,
    /// The top-k/top-p sampling kernel.
    Kernel(SampleParams),
    /// The host sampler on the sequence's logits row, read back alone, for the reason
    /// given: the kernels do not reproduce the host sampler in that case.
    Host(&'static str),
}

/// Where sequence sampling `s` is chosen on a device runner.
fn choice(s: &SeqSampling) -> Choice {
    if s.logprob {
        return Choice::Host("a log-probability needs the row's softmax normaliser");
    }
    if s.params.penalizes() {
        return Choice::Host("penalties read the sequence's history; no kernel applies them");
    }
    if s.params.is_greedy() {
        return Choice::Argmax;
    }
    let p = SampleParams {
        top_k: s.params.top_k,
        top_p: s.params.top_p,
        temperature: s.params.temperature,
    };
    match check_sample_params(p) {
        Ok(()) => Choice::Kernel(p),
        // top_k 0 means every token: the kernel keeps at most 256 candidates, so it
        // would sample from another distribution than the host sampler.
        Err(_) => Choice::Host("top_k is 0 (all tokens) or above the kernel's 256"),
    }
}

impl<D: Device> DeviceRunner<D> {
    /// Uploads the weights of a llama GGUF file and sizes the KV pool.
    ///
    /// # Errors
    /// A bad setting, a tensor the device kernels cannot read, a device failure, or a
    /// KV pool that would hold no block.
    pub fn new(dev: D, file: &GgufFile, device_config: DeviceConfig) -> Result<Self, LoadError> {
        device_config.validate()?;
        let c = LlamaConfig::from_gguf(file)?;
        if !c.head_dim.is_multiple_of(32)
            || c.head_dim > 256
            || !c.dim.is_multiple_of(32)
            || !c.ffn_dim.is_multiple_of(32)
        {
            return Err(LoadError::Unsupported(format!(
                "the device kernels need head_dim a multiple of 32 up to 256 and widths a multiple of 32: {c:?}"
            )));
        }
        let (dim, kvd, ffn) = (c.dim, c.kv_dim(), c.ffn_dim);
        let embed = single(&dev, file, "token_embd.weight", c.vocab, dim)?;
        let mut layers = Vec::with_capacity(c.n_layers);
        for i in 0..c.n_layers {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            layers.push(DevLayer {
                attn_norm: norm(&dev, file, &n("attn_norm"), dim)?,
                qkv: linear(
                    &dev,
                    file,
                    &[(n("attn_q"), dim), (n("attn_k"), kvd), (n("attn_v"), kvd)],
                    dim,
                )?,
                wo: single(&dev, file, &n("attn_output"), dim, dim)?,
                ffn_norm: norm(&dev, file, &n("ffn_norm"), dim)?,
                gate_up: linear(&dev, file, &[(n("ffn_gate"), ffn), (n("ffn_up"), ffn)], dim)?,
                down: single(&dev, file, &n("ffn_down"), dim, ffn)?,
            });
        }
        let output_name = if file.tensor_info("output.weight").is_some() {
            "output.weight"
        } else {
            "token_embd.weight"
        };
        let output = single(&dev, file, output_name, c.vocab, dim)?;
        let output_norm = norm(&dev, file, "output_norm.weight", dim)?;
        let bs = device_config.block_size;
        let block_bytes = 2 * c.n_layers * c.n_kv_heads * bs * c.head_dim * 2;
        let num_blocks = match (device_config.num_blocks, dev.free_memory()?) {
            (Some(b), _) => b,
            (None, Some(free)) => {
                // Leave room for the per-step buffers of a large prefill and the logits
                // of a full decode bucket (1 GiB is several times what they take).
                let usable = (free as f64 * device_config.memory_fraction) as usize;
                let blocks = usable.saturating_sub(1 << 30) / block_bytes;
                // Slots are 32-bit in the kernels.
                blocks.min(u32::MAX as usize / bs - 1)
            }
            (None, None) => {
                return Err(LoadError::Unsupported(format!(
                    "{} reports no memory size: set num_blocks",
                    dev.name()
                )));
            }
        };
        if num_blocks == 0 {
            return Err(LoadError::Unsupported(
                "no device memory left for the KV cache".into(),
            ));
        }
        let kv = KvParams {
            layer: 0,
            num_blocks: num_blocks + 1,
            block_size: bs,
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
        };
        let k_cache = dev.zeros::<u16>(kv.cache_len(c.n_layers))?;
        let v_cache = dev.zeros::<u16>(kv.cache_len(c.n_layers))?;
        tracing::info!(
            device = %dev.name(),
            num_blocks,
            kv_bytes = num_blocks * block_bytes,
            "device backend ready"
        );
        Ok(Self {
            dev,
            config: c,
            device_config,
            embed,
            layers,
            output_norm,
            output,
            k_cache,
            v_cache,
            num_blocks,
            scratch: None,
            captured: HashSet::new(),
        })
    }

    /// The device.
    pub fn device(&self) -> &D {
        &self.dev
    }

    /// Turns decode graphs off (`[]`) or sets their buckets.
    pub fn set_graph_buckets(&mut self, buckets: Vec<usize>) {
        self.dev.drop_captures();
        self.captured.clear();
        self.device_config.graph_buckets = buckets;
    }

    fn kv_params(&self, layer: usize) -> KvParams {
        KvParams {
            layer,
            num_blocks: self.num_blocks + 1,
            block_size: self.device_config.block_size,
            n_heads: self.config.n_heads,
            n_kv_heads: self.config.n_kv_heads,
            head_dim: self.config.head_dim,
        }
    }

    /// Host-side inputs of a step, padded to `bucket` decode tokens when given.
    fn inputs(&self, batch: &Batch, bucket: Option<usize>) -> StepInputs {
        let bs = self.device_config.block_size;
        let mut s = StepInputs::default();
        let mut t0 = 0;
        for chunk in &batch.seqs {
            let off = s.tables.len() as u32;
            let nblk = (chunk.start_pos + chunk.tokens.len()).div_ceil(bs);
            s.tables.extend_from_slice(&chunk.block_table[..nblk]);
            for (j, &tok) in chunk.tokens.iter().enumerate() {
                let p = chunk.start_pos + j;
                s.tokens.push(tok);
                s.pos.push(p as u32);
                s.slots
                    .push((chunk.block_table[p / bs] as usize * bs + p % bs) as u32);
                s.table_off.push(off);
            }
            let len = chunk.tokens.len();
            let start = s.rows.len();
            match chunk.logits {
                LogitsWanted::None => {}
                LogitsWanted::Last => s.rows.push((t0 + len - 1) as u32),
                LogitsWanted::All => s.rows.extend((t0..t0 + len).map(|r| r as u32)),
            }
            s.spans.push(start..s.rows.len());
            t0 += len;
        }
        if let Some(b) = bucket {
            // Padding tokens: token 0 at position 0 of the spare block, whose table is
            // that block alone; their logits rows are computed and ignored.
            let pad_table = s.tables.len() as u32;
            s.tables.push(self.num_blocks as u32);
            while s.tokens.len() < b {
                s.rows.push(s.tokens.len() as u32);
                s.tokens.push(0);
                s.pos.push(0);
                s.slots.push((self.num_blocks * bs) as u32);
                s.table_off.push(pad_table);
            }
        }
        s
    }

    /// Makes the step buffers hold `n` tokens, `m` logits rows, `t` table entries.
    fn ensure_capacity(&mut self, n: usize, m: usize, t: usize) -> Result<(), DeviceError> {
        if let Some(s) = &self.scratch
            && s.cap.0 >= n
            && s.cap.1 >= m
            && s.cap.2 >= t
        {
            return Ok(());
        }
        let old = self.scratch.as_ref().map_or((0, 0, 0), |s| s.cap);
        // Powers of two (at least 256 tokens, 16k table entries) so growth is rare.
        let grow =
            |have: usize, want: usize, min: usize| have.max(want.max(min).next_power_of_two());
        let (n, m, t) = (
            grow(old.0, n, 256),
            grow(old.1, m, 256),
            grow(old.2, t, 1 << 14),
        );
        let c = &self.config;
        let d = &self.dev;
        // Buffers are about to move: recorded graphs would launch on the old ones.
        d.drop_captures();
        self.captured.clear();
        self.scratch = None;
        let ident: Vec<u32> = (0..n as u32).collect();
        self.scratch = Some(Scratch {
            tokens: d.zeros(n)?,
            pos: d.zeros(n)?,
            slots: d.zeros(n)?,
            table_off: d.zeros(n)?,
            tables: d.zeros(t)?,
            ident: d.upload(&ident)?,
            rows: d.zeros(m)?,
            ids: d.zeros(m)?,
            x: d.zeros(n * c.dim)?,
            h: d.zeros(n * c.dim)?,
            qkv: d.zeros(n * (c.dim + 2 * c.kv_dim()))?,
            attn: d.zeros(n * c.dim)?,
            proj: d.zeros(n * c.dim)?,
            gate_up: d.zeros(n * 2 * c.ffn_dim)?,
            ffn: d.zeros(n * c.ffn_dim)?,
            logits: d.zeros(m * c.vocab)?,
            uniforms: d.zeros(m)?,
            sample_work: d.zeros(m * c.vocab)?,
            sampled: d.zeros(m)?,
            cap: (n, m, t),
        });
        tracing::debug!(tokens = n, rows = m, table = t, "device step buffers grown");
        Ok(())
    }

    fn run_linear(
        dev: &D,
        parts: &[DevLinear<D>],
        x: &D::Buf<f32>,
        y: &mut D::Buf<f32>,
        n: usize,
    ) -> Result<(), DeviceError> {
        let ldy: usize = parts.iter().map(|p| p.rows).sum();
        let mut yoff = 0;
        for p in parts {
            let shape = MatShape {
                rows: p.rows,
                cols: p.cols,
                n,
                ldy,
                yoff,
            };
            dev.matmul(p.fmt, &p.w, x, y, shape)?;
            yoff += p.rows;
        }
        Ok(())
    }

    /// Every launch of a step over `n` tokens and `m` logits rows, inputs already in
    /// the step buffers. Only launches: this is what a graph records.
    fn compute(&mut self, n: usize, m: usize) -> Result<(), DeviceError> {
        let c = &self.config;
        let (dim, ffn, eps) = (c.dim, c.ffn_dim, c.norm_eps);
        let rope = RopeParams {
            rope_dims: c.rope_dims,
            theta_scale: c.rope_base.powf(-2.0 / c.rope_dims as f32),
        };
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        let kvs: Vec<KvParams> = (0..self.layers.len()).map(|l| self.kv_params(l)).collect();
        let d = &self.dev;
        let s = self
            .scratch
            .as_mut()
            .ok_or_else(|| DeviceError::Shape("step buffers missing".into()))?;
        d.embed(self.embed.fmt, &self.embed.w, &s.tokens, &mut s.x, n, dim)?;
        for (li, layer) in self.layers.iter().enumerate() {
            if li == 0 {
                d.rms_norm(&s.x, &layer.attn_norm, &s.ident, &mut s.h, n, dim, eps)?;
            } else {
                // The previous layer's MLP output joins the residual here.
                d.add_rms_norm(&mut s.x, &s.proj, &layer.attn_norm, &mut s.h, n, dim, eps)?;
            }
            Self::run_linear(d, &layer.qkv, &s.h, &mut s.qkv, n)?;
            d.rope_store_kv(
                &mut s.qkv,
                &s.pos,
                &s.slots,
                &mut self.k_cache,
                &mut self.v_cache,
                &kvs[li],
                rope,
                n,
            )?;
            d.paged_attention(
                &s.qkv,
                &self.k_cache,
                &self.v_cache,
                &s.tables,
                &s.table_off,
                &s.pos,
                &mut s.attn,
                &kvs[li],
                scale,
                n,
            )?;
            Self::run_linear(d, std::slice::from_ref(&layer.wo), &s.attn, &mut s.proj, n)?;
            d.add_rms_norm(&mut s.x, &s.proj, &layer.ffn_norm, &mut s.h, n, dim, eps)?;
            Self::run_linear(d, &layer.gate_up, &s.h, &mut s.gate_up, n)?;
            d.silu_mul(&s.gate_up, &mut s.ffn, ffn, n)?;
            Self::run_linear(d, std::slice::from_ref(&layer.down), &s.ffn, &mut s.proj, n)?;
        }
        d.add(&mut s.x, &s.proj, n * dim)?;
        // Only the rows someone asked for go through the (large) output head.
        d.rms_norm(&s.x, &self.output_norm, &s.rows, &mut s.h, m, dim, eps)?;
        Self::run_linear(
            d,
            std::slice::from_ref(&self.output),
            &s.h,
            &mut s.logits,
            m,
        )?;
        d.argmax_rows(&s.logits, m, c.vocab, &mut s.ids)?;
        Ok(())
    }

    /// The decode bucket a batch runs in, if it is a decode-only batch that fits one.
    fn bucket_of(&self, batch: &Batch) -> Option<usize> {
        let decode_only = batch
            .seqs
            .iter()
            .all(|s| s.tokens.len() == 1 && s.logits == LogitsWanted::Last);
        if !decode_only {
            return None;
        }
        let n = batch.seqs.len();
        self.device_config
            .graph_buckets
            .iter()
            .copied()
            .find(|&b| b >= n)
    }

    /// Runs a validated, non-empty batch; returns the inputs (for the spans) and the
    /// number of logits rows computed.
    fn run(&mut self, batch: &Batch) -> Result<(StepInputs, usize), BackendError> {
        // No LoRA on the device backend: `serve` refuses adapters with --device cuda,
        // and a chunk naming one is refused here.
        validate_batch(
            batch,
            self.config.vocab,
            (self.device_config.block_size, self.num_blocks),
            0,
        )?;
        let bucket = self.bucket_of(batch);
        let inp = self.inputs(batch, bucket);
        let (n, m) = (inp.tokens.len(), inp.rows.len());
        self.ensure_capacity(n, m, inp.tables.len())?;
        {
            let d = &self.dev;
            let s = self
                .scratch
                .as_mut()
                .ok_or_else(|| DeviceError::Shape("step buffers missing".into()))?;
            d.write(&mut s.tokens, &inp.tokens)?;
            d.write(&mut s.pos, &inp.pos)?;
            d.write(&mut s.slots, &inp.slots)?;
            d.write(&mut s.table_off, &inp.table_off)?;
            d.write(&mut s.tables, &inp.tables)?;
            d.write(&mut s.rows, &inp.rows)?;
        }
        match bucket {
            Some(b) if self.captured.contains(&b) => {
                if !self.dev.replay(b)? {
                    return Err(DeviceError::Driver(format!("graph {b} vanished")).into());
                }
            }
            Some(b) => {
                if self.dev.begin_capture()? {
                    let r = self.compute(n, m);
                    // End the capture even after a failed launch, so the stream leaves
                    // capture mode.
                    let e = self.dev.end_capture(b);
                    r?;
                    e?;
                    self.captured.insert(b);
                    self.dev.replay(b)?;
                } else {
                    self.compute(n, m)?;
                }
            }
            None => self.compute(n, m)?,
        }
        Ok((inp, m))
    }

    /// A step that returns each chunk's greedy next token (argmax on the device; only
    /// ids come back), `None` for chunks that asked for no logits.
    ///
    /// # Errors
    /// As [`ModelRunner::forward`].
    pub fn forward_greedy(&mut self, batch: &Batch) -> Result<Vec<Option<u32>>, BackendError> {
        if batch.seqs.is_empty() {
            return Ok(Vec::new());
        }
        let (inp, m) = self.run(batch)?;
        let s = self
            .scratch
            .as_ref()
            .ok_or_else(|| DeviceError::Shape("step buffers missing".into()))?;
        let ids = self.dev.read(&s.ids, m)?;
        Ok(inp
            .spans
            .iter()
            .map(|sp| (!sp.is_empty()).then(|| ids[sp.end - 1]))
            .collect())
    }
}

impl<D: Device> DeviceRunner<D> {
    /// Chooses the token of every sampling sequence of a step that [`Self::run`] just
    /// computed (`spans`: each sequence's logits rows).
    fn sample(
        &mut self,
        spans: &[std::ops::Range<usize>],
        sampling: &[Option<SeqSampling>],
    ) -> Result<ModelOutput, BackendError> {
        let vocab = self.config.vocab;
        let real = spans.last().map_or(0, |s| s.end);
        // Each sampling sequence's (last) logits row and how its token is chosen.
        let plan: Vec<Option<(usize, Choice)>> = sampling
            .iter()
            .zip(spans)
            .map(|(s, span)| Some((span.end.checked_sub(1)?, choice(s.as_ref()?))))
            .collect();
        let has = |want: fn(&Choice) -> bool| plan.iter().flatten().any(|(_, c)| want(c));
        let d = &self.dev;
        let s = self
            .scratch
            .as_mut()
            .ok_or_else(|| DeviceError::Shape("step buffers missing".into()))?;
        let ids = if has(|c| *c == Choice::Argmax) {
            d.read(&s.ids, real)?
        } else {
            Vec::new()
        };
        let picked = if has(|c| matches!(c, Choice::Kernel(_))) {
            let mut uniforms = vec![0f32; real];
            for (p, smp) in plan.iter().zip(sampling) {
                if let (Some((row, Choice::Kernel(_))), Some(smp)) = (p, smp) {
                    // The kernel takes f32 draws: the host's f64 draw, rounded, so a
                    // token differs from the host sampler's only when the draw lies
                    // within that rounding (or the GPU's last-bit exp) of a boundary
                    // between two candidates.
                    uniforms[*row] = smp.uniform.unwrap_or(0.0) as f32;
                }
            }
            d.write(&mut s.uniforms, &uniforms)?;
            // One launch per run of neighbouring rows with the same parameters.
            let mut runs: Vec<(std::ops::Range<usize>, SampleParams)> = Vec::new();
            for &(row, c) in plan.iter().flatten() {
                let Choice::Kernel(p) = c else { continue };
                match runs.last_mut() {
                    Some((rows, q)) if *q == p && rows.end == row => rows.end += 1,
                    _ => runs.push((row..row + 1, p)),
                }
            }
            for (rows, p) in runs {
                d.sample_top_k_top_p(
                    &s.logits,
                    &mut s.sample_work,
                    rows,
                    vocab,
                    p,
                    &s.uniforms,
                    &mut s.sampled,
                )?;
            }
            d.read(&s.sampled, real)?
        } else {
            Vec::new()
        };
        let mut sampled = Vec::with_capacity(plan.len());
        for (p, smp) in plan.iter().zip(sampling) {
            let (Some((row, c)), Some(smp)) = (p, smp) else {
                sampled.push(None);
                continue;
            };
            sampled.push(Some(match c {
                Choice::Argmax => smp.sampled(ids[*row], None),
                Choice::Kernel(_) => smp.sampled(picked[*row], None),
                Choice::Host(reason) => {
                    tracing::trace!(reason, "sampling on the host");
                    let logits = d.read_range(&s.logits, row * vocab..(row + 1) * vocab)?;
                    smp.sample_row(&logits)
                }
            }));
        }
        Ok(ModelOutput { sampled })
    }
}

impl<D: Device> ModelRunner for DeviceRunner<D> {
    fn config(&self) -> &LlamaConfig {
        &self.config
    }

    fn kv_geometry(&self) -> KvGeometry {
        KvGeometry {
            block_size: self.device_config.block_size,
            num_blocks: self.num_blocks,
        }
    }

    fn forward(&mut self, batch: &Batch) -> Result<Logits, BackendError> {
        let vocab = self.config.vocab;
        if batch.seqs.is_empty() {
            validate_batch(
                batch,
                vocab,
                (self.device_config.block_size, self.num_blocks),
                0,
            )?;
            return Ok(Logits {
                vocab,
                ..Logits::default()
            });
        }
        let (inp, _) = self.run(batch)?;
        // Padding rows of a bucket come after the real ones: read only those.
        let real = inp.spans.last().map_or(0, |s| s.end);
        let s = self
            .scratch
            .as_ref()
            .ok_or_else(|| DeviceError::Shape("step buffers missing".into()))?;
        let data = self.dev.read(&s.logits, real * vocab)?;
        Ok(Logits {
            vocab,
            data,
            spans: inp.spans,
        })
    }

    fn execute(
        &mut self,
        batch: &Batch,
        sampling: &[Option<SeqSampling>],
    ) -> Result<ModelOutput, BackendError> {
        validate_sampling(batch, sampling)?;
        if batch.seqs.is_empty() {
            validate_batch(
                batch,
                self.config.vocab,
                (self.device_config.block_size, self.num_blocks),
                0,
            )?;
            return Ok(ModelOutput::default());
        }
        let (inp, _) = self.run(batch)?;
        self.sample(&inp.spans, sampling)
    }
}
