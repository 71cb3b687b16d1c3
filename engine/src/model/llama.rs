//! The llama architecture: hyper-parameters from GGUF metadata and weights from its
//! tensors, repacked for the CPU kernels.
//!
//! Invariants: Q and K weights are used as stored — GGUF llama files permute them so
//! ggml's "normal" RoPE (adjacent pairs) is correct, and the forward pass rotates
//! adjacent pairs accordingly. Without `output.weight` the output head is the token
//! embedding (tied). Projections reading the same input (Q/K/V, gate/up) are stacked
//! into one matrix when their formats allow, so each runs as one product.

use std::borrow::Cow;
use std::ops::Range;

use crate::kernels::{self, KernelError, PackedMatrix, QuantActs, RowSource, WeightFormat};
use crate::model::gguf::{GgmlType, GgufError, GgufFile, TensorView};

/// Errors building a model from a file.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The file could not be read or lacks a key or tensor.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// The file is not a llama model.
    #[error("unsupported architecture {0:?} (only llama is implemented)")]
    Architecture(String),
    /// Hyper-parameters or tensor shapes are inconsistent.
    #[error("invalid model: {0}")]
    Invalid(String),
    /// A tensor could not be prepared for the kernels.
    #[error("tensor {tensor}: {source}")]
    Kernel {
        /// Tensor name.
        tensor: String,
        /// What the kernels said.
        #[source]
        source: KernelError,
    },
}

/// Hyper-parameters of a llama model.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Transformer blocks.
    pub n_layers: usize,
    /// Embedding width.
    pub dim: usize,
    /// MLP hidden width.
    pub ffn_dim: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `n_heads`).
    pub n_kv_heads: usize,
    /// Dimensions per head.
    pub head_dim: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Rotated dimensions per head.
    pub rope_dims: usize,
    /// RoPE frequency base.
    pub rope_base: f32,
    /// RMSNorm epsilon.
    pub norm_eps: f32,
    /// Trained context length.
    pub context_length: usize,
}

impl Default for LlamaConfig {
    /// SmolLM2-135M's shape.
    fn default() -> Self {
        Self {
            n_layers: 30,
            dim: 576,
            ffn_dim: 1536,
            n_heads: 9,
            n_kv_heads: 3,
            head_dim: 64,
            vocab: 49152,
            rope_dims: 64,
            rope_base: 100_000.0,
            norm_eps: 1e-5,
            context_length: 8192,
        }
    }
}

impl LlamaConfig {
    /// Reads `llama.*` metadata.
    ///
    /// # Errors
    /// Missing or mistyped keys, another architecture, or inconsistent values.
    pub fn from_gguf(file: &GgufFile) -> Result<Self, ModelError> {
        let md = file.metadata();
        let arch = md.architecture()?;
        if arch != "llama" {
            return Err(ModelError::Architecture(arch.to_owned()));
        }
        let u = |k: &str| md.get_u32(&format!("llama.{k}")).map(|v| v as usize);
        let dim = u("embedding_length")?;
        let n_heads = u("attention.head_count")?;
        let head_dim = dim.checked_div(n_heads).unwrap_or(0);
        let vocab = match md.get_u32_opt("llama.vocab_size")? {
            Some(v) => v as usize,
            None => md.get_str_array("tokenizer.ggml.tokens")?.len(),
        };
        let cfg = Self {
            n_layers: u("block_count")?,
            dim,
            ffn_dim: u("feed_forward_length")?,
            n_heads,
            n_kv_heads: md
                .get_u32_opt("llama.attention.head_count_kv")?
                .map_or(n_heads, |v| v as usize),
            head_dim,
            vocab,
            rope_dims: md
                .get_u32_opt("llama.rope.dimension_count")?
                .map_or(head_dim, |v| v as usize),
            rope_base: md.get_f32_opt("llama.rope.freq_base")?.unwrap_or(10_000.0),
            norm_eps: md.get_f32("llama.attention.layer_norm_rms_epsilon")?,
            context_length: u("context_length")?,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the values fit together.
    ///
    /// # Errors
    /// [`ModelError::Invalid`] naming the first inconsistency.
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |m: String| Err(ModelError::Invalid(m));
        if self.n_layers == 0 || self.dim == 0 || self.ffn_dim == 0 || self.vocab == 0 {
            return bad(format!("zero-sized dimension in {self:?}"));
        }
        if self.n_heads == 0
            || self.n_kv_heads == 0
            || !self.n_heads.is_multiple_of(self.n_kv_heads)
        {
            return bad(format!(
                "{} heads cannot share {} KV heads",
                self.n_heads, self.n_kv_heads
            ));
        }
        if self.head_dim * self.n_heads != self.dim {
            return bad(format!(
                "{} heads do not divide width {}",
                self.n_heads, self.dim
            ));
        }
        if self.rope_dims > self.head_dim || !self.rope_dims.is_multiple_of(2) {
            return bad(format!(
                "rope over {} of {} head dims",
                self.rope_dims, self.head_dim
            ));
        }
        if !(self.rope_base > 0.0 && self.norm_eps >= 0.0) {
            return bad(format!(
                "rope base {} / norm eps {}",
                self.rope_base, self.norm_eps
            ));
        }
        Ok(())
    }

    /// Key/value width (`n_kv_heads * head_dim`).
    #[must_use]
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

/// A linear layer `y = W x`, one or more stacked parts.
#[derive(Debug)]
pub enum Linear {
    /// Block-quantized weights, run by the integer kernels.
    Packed(PackedMatrix),
    /// Float weights (`rows × cols`, row-major), run in f32.
    Dense {
        /// Output rows.
        rows: usize,
        /// Input columns.
        cols: usize,
        /// Weights.
        w: Vec<f32>,
    },
}

impl Linear {
    /// Output rows.
    #[must_use]
    pub fn rows(&self) -> usize {
        match self {
            Self::Packed(m) => m.rows(),
            Self::Dense { rows, .. } => *rows,
        }
    }

    /// `out[t] = W x[t]` for `n` rows of `x`.
    ///
    /// # Errors
    /// Shape mismatches from the kernels.
    pub fn forward(
        &self,
        isa: kernels::Isa,
        x: &[f32],
        n: usize,
        acts: &mut QuantActs,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        match self {
            Self::Packed(m) => {
                acts.quantize(isa, x, n, m.cols())?;
                kernels::matmul(isa, m, acts, out)
            }
            Self::Dense { rows, cols, w } => {
                if x.len() != n * cols || out.len() != n * rows {
                    return Err(KernelError::Shape(format!(
                        "dense {rows}×{cols} on {} inputs",
                        x.len()
                    )));
                }
                for (xr, or) in x.chunks_exact(*cols).zip(out.chunks_exact_mut(*rows)) {
                    for (o, wr) in or.iter_mut().zip(w.chunks_exact(*cols)) {
                        *o = wr.iter().zip(xr).map(|(a, b)| a * b).sum();
                    }
                }
                Ok(())
            }
        }
    }

    /// [`Linear::forward`] with exact sums ([`kernels::exact`]): `out[t]` is `W x[t]`
    /// in fixed point, the same bits for any split of the input columns once the
    /// parts' outputs are added. Block-quantized weights sum one term per block, as
    /// the integer kernels do; float weights one term per product `w · x` (rounded to
    /// f32), so their columns may split anywhere.
    ///
    /// # Errors
    /// Shape mismatches from the kernels; [`KernelError::Unsupported`] for more
    /// terms than [`kernels::exact::MAX_TERMS`] per row.
    pub fn forward_exact(
        &self,
        isa: kernels::Isa,
        x: &[f32],
        n: usize,
        acts: &mut QuantActs,
        out: &mut [i64],
    ) -> Result<(), KernelError> {
        use kernels::exact;
        match self {
            Self::Packed(m) => {
                acts.quantize(isa, x, n, m.cols())?;
                kernels::matmul_exact(isa, m, acts, out)
            }
            Self::Dense { rows, cols, w } => {
                if x.len() != n * cols || out.len() != n * rows {
                    return Err(KernelError::Shape(format!(
                        "dense {rows}×{cols} on {} inputs",
                        x.len()
                    )));
                }
                if *cols > exact::MAX_TERMS {
                    return Err(KernelError::Unsupported(format!(
                        "exact sums over {cols} float columns (at most {})",
                        exact::MAX_TERMS
                    )));
                }
                for (xr, or) in x.chunks_exact(*cols).zip(out.chunks_exact_mut(*rows)) {
                    for (o, wr) in or.iter_mut().zip(w.chunks_exact(*cols)) {
                        *o = wr.iter().zip(xr).fold(0i64, |acc, (a, b)| {
                            acc.wrapping_add(exact::fixed(a * b * exact::SCALE))
                        });
                    }
                }
                Ok(())
            }
        }
    }
}

/// The token embedding table, kept in its file encoding and dequantized per lookup.
#[derive(Debug)]
pub struct Embedding {
    format: WeightFormat,
    dim: usize,
    row_bytes: usize,
    data: Vec<u8>,
}

impl Embedding {
    /// Writes the embedding of `token` into `out` (`dim` floats).
    ///
    /// # Errors
    /// [`KernelError::Shape`] when the token is outside the table.
    pub fn lookup(&self, token: u32, out: &mut [f32]) -> Result<(), KernelError> {
        let start = token as usize * self.row_bytes;
        let row = self
            .data
            .get(start..start + self.row_bytes)
            .ok_or_else(|| {
                KernelError::Shape(format!("token {token} outside the embedding table"))
            })?;
        kernels::quant::dequantize_row(self.format, row, &mut out[..self.dim])
    }
}

/// Weights of one transformer block.
#[derive(Debug)]
pub struct Layer {
    /// RMSNorm before attention.
    pub attn_norm: Vec<f32>,
    /// Stacked Q, K, V projections (`dim + 2 * kv_dim` rows).
    pub qkv: Vec<Linear>,
    /// Attention output projection.
    pub wo: Linear,
    /// RMSNorm before the MLP.
    pub ffn_norm: Vec<f32>,
    /// Stacked gate and up projections (`2 * ffn_dim` rows).
    pub gate_up: Vec<Linear>,
    /// Down projection.
    pub down: Linear,
}

/// The final norm and the output head, held by the last pipeline stage.
#[derive(Debug)]
pub struct OutputHead {
    /// Final RMSNorm.
    pub norm: Vec<f32>,
    /// Output head (the embedding matrix when tied).
    pub output: Linear,
}

/// One tensor rank's shard of every layer it holds: its query heads with the KV heads
/// they read, and its MLP hidden columns. Q/K/V and gate/up keep only the shard's
/// output rows (column-parallel); the attention output and down projections keep only
/// the shard's input columns (row-parallel), so each rank's product is a partial sum
/// of the whole one and an all-reduce completes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorShard {
    /// Query heads held.
    pub q_heads: Range<usize>,
    /// KV heads held: the ones the query heads read.
    pub kv_heads: Range<usize>,
    /// MLP hidden columns held.
    pub ffn: Range<usize>,
}

/// Which part of a model a process holds: a contiguous run of layers, with the token
/// embedding when it is the first stage and the output head when it is the last, and
/// of each layer a tensor shard or all of it. A single process holds the whole model
/// ([`ModelPart::whole`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelPart {
    /// The layers, as model layer indices.
    pub layers: Range<usize>,
    /// Whether the token embedding is held (the first stage).
    pub embeds: bool,
    /// Whether the final norm and output head are held (the last stage).
    pub head: bool,
    /// The tensor shard of each layer held; `None` for whole layers.
    pub shard: Option<TensorShard>,
}

impl ModelPart {
    /// Every layer, the embedding and the head.
    #[must_use]
    pub fn whole(n_layers: usize) -> Self {
        Self {
            layers: 0..n_layers,
            embeds: true,
            head: true,
            shard: None,
        }
    }

    /// The shard this part holds of `config`'s layers: all of them without one.
    #[must_use]
    pub fn shard_of(&self, config: &LlamaConfig) -> TensorShard {
        self.shard.clone().unwrap_or(TensorShard {
            q_heads: 0..config.n_heads,
            kv_heads: 0..config.n_kv_heads,
            ffn: 0..config.ffn_dim,
        })
    }

    /// Whether this is the whole model of `n_layers` layers.
    #[must_use]
    pub fn is_whole(&self, n_layers: usize) -> bool {
        *self == Self::whole(n_layers)
    }
}

/// The weights of a llama model, or of one pipeline stage of it ([`ModelPart`]).
#[derive(Debug)]
pub struct LlamaWeights {
    /// Hyper-parameters (of the whole model, whatever part is held).
    pub config: LlamaConfig,
    /// What this holds: `layers[i]` is model layer `part.layers.start + i`.
    pub part: ModelPart,
    /// Token embeddings, when [`ModelPart::embeds`].
    pub embed: Option<Embedding>,
    /// Transformer blocks of [`ModelPart::layers`].
    pub layers: Vec<Layer>,
    /// Final norm and output head, when [`ModelPart::head`].
    pub head: Option<OutputHead>,
}

fn format_of(t: &TensorView<'_>) -> Result<WeightFormat, ModelError> {
    Ok(match t.dtype {
        GgmlType::F32 => WeightFormat::F32,
        GgmlType::F16 => WeightFormat::F16,
        GgmlType::Q4_1 => WeightFormat::Q4_1,
        GgmlType::Q8_0 => WeightFormat::Q8_0,
        other => {
            return Err(GgufError::UnsupportedTensorType {
                dtype: other.name().to_owned(),
                tensor: t.name.to_owned(),
            }
            .into());
        }
    })
}

fn matrix<'a>(
    file: &'a GgufFile,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<(TensorView<'a>, WeightFormat), ModelError> {
    let t = file.tensor(name)?;
    if t.dims.len() != 2 || t.dims[0] != cols as u64 || t.dims[1] != rows as u64 {
        return Err(ModelError::Invalid(format!(
            "{name} has shape {:?}, expected [{cols}, {rows}]",
            t.dims
        )));
    }
    let f = format_of(&t)?;
    Ok((t, f))
}

/// The bytes of rows `rows` and input columns `cols` of a `total_cols`-wide matrix
/// stored as `data`: borrowed when whole rows are kept, else one copy of the kept
/// columns of each row (a row-parallel shard), which must start and end on quant
/// blocks.
fn shard_bytes<'a>(
    name: &str,
    data: &'a [u8],
    format: WeightFormat,
    total_cols: usize,
    rows: &Range<usize>,
    cols: &Range<usize>,
) -> Result<Cow<'a, [u8]>, ModelError> {
    let kerr = |source| ModelError::Kernel {
        tensor: name.to_owned(),
        source,
    };
    let row_bytes = format.row_bytes(total_cols).map_err(kerr)?;
    let kept = data
        .get(rows.start * row_bytes..rows.end * row_bytes)
        .ok_or_else(|| ModelError::Invalid(format!("{name}: rows {rows:?} outside the data")))?;
    if *cols == (0..total_cols) {
        return Ok(Cow::Borrowed(kept));
    }
    let start = format.row_bytes(cols.start).map_err(kerr)?;
    let end = format.row_bytes(cols.end).map_err(kerr)?;
    let mut out = Vec::with_capacity(rows.len() * (end - start));
    for row in kept.chunks_exact(row_bytes) {
        out.extend_from_slice(&row[start..end]);
    }
    Ok(Cow::Owned(out))
}

/// Builds the layer(s) for matrices that read the same input: one stacked packed
/// matrix when all share a block format, else one layer each. Each part is `(name,
/// rows, kept rows)`, and every part keeps input columns `cols` of `total_cols`.
fn stacked(
    file: &GgufFile,
    parts: &[(&str, usize, Range<usize>)],
    total_cols: usize,
    cols: &Range<usize>,
) -> Result<Vec<Linear>, ModelError> {
    let views = parts
        .iter()
        .map(|(n, r, kept)| {
            let (t, f) = matrix(file, n, *r, total_cols)?;
            let data = shard_bytes(n, t.data, f, total_cols, kept, cols)?;
            Ok((data, f, kept.len()))
        })
        .collect::<Result<Vec<_>, ModelError>>()?;
    let cols = cols.len();
    let same_quant = views
        .iter()
        .all(|(_, f, _)| *f == views[0].1 && matches!(f, WeightFormat::Q4_1 | WeightFormat::Q8_0));
    let kerr = |tensor: &str| {
        let tensor = tensor.to_owned();
        move |source| ModelError::Kernel { tensor, source }
    };
    if same_quant && views.len() > 1 {
        let sources: Vec<RowSource<'_>> = views
            .iter()
            .map(|(data, f, rows)| RowSource {
                format: *f,
                rows: *rows,
                data,
            })
            .collect();
        return Ok(vec![Linear::Packed(
            PackedMatrix::pack(cols, &sources).map_err(kerr(parts[0].0))?,
        )]);
    }
    views
        .iter()
        .zip(parts)
        .map(|((data, f, rows), (name, _, _))| match f {
            WeightFormat::Q4_1 | WeightFormat::Q8_0 => PackedMatrix::pack(
                cols,
                &[RowSource {
                    format: *f,
                    rows: *rows,
                    data,
                }],
            )
            .map(Linear::Packed)
            .map_err(kerr(name)),
            WeightFormat::F16 | WeightFormat::F32 => {
                let rows = *rows;
                kernels::pack::dequantize_matrix(*f, data, rows, cols)
                    .map(|w| Linear::Dense { rows, cols, w })
                    .map_err(kerr(name))
            }
        })
        .collect()
}

/// One matrix, keeping input columns `cols` of `total_cols` (all rows).
fn single(
    file: &GgufFile,
    name: &str,
    rows: usize,
    total_cols: usize,
    cols: &Range<usize>,
) -> Result<Linear, ModelError> {
    let mut v = stacked(file, &[(name, rows, 0..rows)], total_cols, cols)?;
    v.pop()
        .ok_or_else(|| ModelError::Invalid(format!("{name} produced no layer")))
}

fn vector(file: &GgufFile, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
    let t = file.tensor(name)?;
    if t.n_elements() != len as u64 {
        return Err(ModelError::Invalid(format!(
            "{name} has shape {:?}, expected [{len}]",
            t.dims
        )));
    }
    let f = format_of(&t)?;
    let mut out = vec![0f32; len];
    kernels::quant::dequantize_row(f, t.data, &mut out).map_err(|source| ModelError::Kernel {
        tensor: name.to_owned(),
        source,
    })?;
    Ok(out)
}

impl LlamaWeights {
    /// Loads and repacks every tensor of a llama GGUF file.
    ///
    /// # Errors
    /// Missing or mis-shaped tensors, unsupported tensor types, bad metadata.
    pub fn from_gguf(file: &GgufFile) -> Result<Self, ModelError> {
        let c = LlamaConfig::from_gguf(file)?;
        let whole = ModelPart::whole(c.n_layers);
        Self::load_part(file, c, &whole)
    }

    /// Loads and repacks only the tensors of `part`: a pipeline stage's layers (of
    /// each only its [`TensorShard`]'s rows and columns), and the embedding or the
    /// head when it holds them.
    ///
    /// Memory: the file stays memory-mapped whole, but only `part`'s tensors are read
    /// (and copied into the kernels' packed layout), so the other stages' pages are
    /// never faulted in and the resident set is this part's weights.
    ///
    /// # Errors
    /// As [`LlamaWeights::from_gguf`], and a part outside the model's layers.
    pub fn from_gguf_part(file: &GgufFile, part: &ModelPart) -> Result<Self, ModelError> {
        let c = LlamaConfig::from_gguf(file)?;
        Self::load_part(file, c, part)
    }

    fn load_part(file: &GgufFile, c: LlamaConfig, part: &ModelPart) -> Result<Self, ModelError> {
        if part.layers.start > part.layers.end || part.layers.end > c.n_layers {
            return Err(ModelError::Invalid(format!(
                "layers {:?} of a model of {} layers",
                part.layers, c.n_layers
            )));
        }
        let (dim, kv, ffn) = (c.dim, c.kv_dim(), c.ffn_dim);
        let embed = if part.embeds {
            let (et, ef) = matrix(file, "token_embd.weight", c.vocab, dim)?;
            Some(Embedding {
                format: ef,
                dim,
                row_bytes: ef.row_bytes(dim).map_err(|source| ModelError::Kernel {
                    tensor: "token_embd.weight".into(),
                    source,
                })?,
                data: et.data.to_vec(),
            })
        } else {
            None
        };
        let shard = part.shard_of(&c);
        if shard.q_heads.end > c.n_heads
            || shard.kv_heads.end > c.n_kv_heads
            || shard.ffn.end > ffn
            || shard.q_heads.len() * c.n_kv_heads != shard.kv_heads.len() * c.n_heads
            || shard.q_heads.start * c.n_kv_heads != shard.kv_heads.start * c.n_heads
        {
            return Err(ModelError::Invalid(format!(
                "{shard:?} is not a shard of {} query heads reading {} KV heads and {ffn} \
MLP columns",
                c.n_heads, c.n_kv_heads
            )));
        }
        let hd = c.head_dim;
        let q_rows = shard.q_heads.start * hd..shard.q_heads.end * hd;
        let kv_rows = shard.kv_heads.start * hd..shard.kv_heads.end * hd;
        let all_dim = 0..dim;
        let mut layers = Vec::with_capacity(part.layers.len());
        for i in part.layers.clone() {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            layers.push(Layer {
                attn_norm: vector(file, &n("attn_norm"), dim)?,
                qkv: stacked(
                    file,
                    &[
                        (&n("attn_q"), dim, q_rows.clone()),
                        (&n("attn_k"), kv, kv_rows.clone()),
                        (&n("attn_v"), kv, kv_rows.clone()),
                    ],
                    dim,
                    &all_dim,
                )?,
                wo: single(file, &n("attn_output"), dim, dim, &q_rows)?,
                ffn_norm: vector(file, &n("ffn_norm"), dim)?,
                gate_up: stacked(
                    file,
                    &[
                        (&n("ffn_gate"), ffn, shard.ffn.clone()),
                        (&n("ffn_up"), ffn, shard.ffn.clone()),
                    ],
                    dim,
                    &all_dim,
                )?,
                down: single(file, &n("ffn_down"), dim, ffn, &shard.ffn)?,
            });
        }
        let head = if part.head {
            let output_name = if file.tensor_info("output.weight").is_some() {
                "output.weight"
            } else {
                "token_embd.weight"
            };
            Some(OutputHead {
                norm: vector(file, "output_norm.weight", dim)?,
                output: single(file, output_name, c.vocab, dim, &all_dim)?,
            })
        } else {
            None
        };
        Ok(Self {
            part: part.clone(),
            embed,
            layers,
            head,
            config: c,
        })
    }
}
