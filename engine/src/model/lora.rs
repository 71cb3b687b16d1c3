//! LoRA adapters in llama.cpp's adapter GGUF format, loaded next to the base model,
//! and their low-rank product.
//!
//! The file (what llama.cpp's `convert_lora_to_gguf.py` writes and its
//! `llama_adapter_lora_init` reads): `general.type = "adapter"`, `adapter.type =
//! "lora"`, `general.architecture` equal to the base model's, `adapter.lora.alpha`
//! (f32; absent means 0), and per adapted weight `W` (ggml shape `[in, out]`) two
//! tensors `W.lora_a` (`[in, r]`: `r` rows of `in`) and `W.lora_b` (`[r, out]`), f32
//! or f16. The adapted output is `W x + scale · B (A x)` with `scale = alpha / r`, or
//! 1 when alpha is 0 — llama.cpp's `get_scale` with an adapter scale of 1, `r` read
//! per pair.
//!
//! What start-up refuses, each with its own [`LoraProblem`]: a file that is not a
//! LoRA adapter, another architecture, a recorded base-model hash that is not the
//! served model's ([`BASE_SHA256_KEY`]: no standard key records one — gguf-py's
//! `general.base_model.*` names a model but never hashes it — so a file without it is
//! accepted), a tensor for a weight the base lacks or this engine does not adapt
//! (only the seven llama projections: q, k, v, o, gate, up, down), an `A` without its
//! `B`, shapes that do not match the base weight, `A` and `B` of different ranks, and
//! any type but f32/f16. `*_norm.weight` tensors are skipped with a warning, as
//! llama.cpp skips them.
//!
//! Weights are kept in f32 (f16 is widened at load). The identity of an adapter —
//! its name and the sha256 of its file — is what the prefix cache keys its blocks by
//! ([`LoraAdapter::identity`]), so a changed file never reuses KV.
//!
//! The product ([`LoraPair::add_rows`]) is row-wise: each row's `A x` then `B t` is
//! computed with the same operations in the same order whatever else is in the
//! batch, so a request's result does not depend on its neighbours. How rows are
//! grouped by adapter within a step is the backend's business (see
//! [`crate::backend::Batch::adapter_segments`]).

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rayon::prelude::*;
use slipway_contract::Sha256Digest;

use crate::fetch::{VerifyError, file_sha256};
use crate::kernels::WeightFormat;
use crate::model::gguf::{GgmlType, GgufError, GgufFile, TensorInfo};

/// Metadata key of an optional base-model sha256 (64 hex digits) an adapter may
/// record; when present it must equal the served model file's sha256.
pub const BASE_SHA256_KEY: &str = "adapter.base_model.sha256";

/// The base weights an adapter can adapt, in a layer's order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Projection {
    /// `attn_q`.
    Q,
    /// `attn_k`.
    K,
    /// `attn_v`.
    V,
    /// `attn_output`.
    O,
    /// `ffn_gate`.
    Gate,
    /// `ffn_up`.
    Up,
    /// `ffn_down`.
    Down,
}

impl Projection {
    /// Every projection, in index order.
    pub const ALL: [Self; 7] = [
        Self::Q,
        Self::K,
        Self::V,
        Self::O,
        Self::Gate,
        Self::Up,
        Self::Down,
    ];

    /// The weight's name inside a block (`blk.N.<name>.weight`).
    #[must_use]
    pub fn tensor_name(self) -> &'static str {
        match self {
            Self::Q => "attn_q",
            Self::K => "attn_k",
            Self::V => "attn_v",
            Self::O => "attn_output",
            Self::Gate => "ffn_gate",
            Self::Up => "ffn_up",
            Self::Down => "ffn_down",
        }
    }

    fn index(self) -> usize {
        self as usize
    }

    fn from_tensor_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.tensor_name() == name)
    }
}

/// Why an adapter cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum LoraProblem {
    /// The file's sha256 is not the one `--lora-sha256` names.
    #[error("failed verification: its sha256 is {actual}, the release names {expected}")]
    Mismatch {
        /// The digest given.
        expected: Sha256Digest,
        /// The file's.
        actual: Sha256Digest,
    },
    /// Reading the file to hash it failed.
    #[error(transparent)]
    Read(#[from] VerifyError),
    /// Not a GGUF file, or a malformed one.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// `general.type` is not `adapter`: a model, or something else.
    #[error(
        "not a LoRA adapter: general.type is {}, an adapter's is \"adapter\"",
        shown(found)
    )]
    NotAnAdapter {
        /// What the file says (`None`: the key is absent).
        found: Option<String>,
    },
    /// `adapter.type` is not `lora`.
    #[error(
        "adapter.type is {}; only \"lora\" adapters are supported",
        shown(found)
    )]
    AdapterType {
        /// What the file says.
        found: Option<String>,
    },
    /// Made for another architecture.
    #[error("made for architecture {adapter:?}, the base model is {base:?}")]
    Architecture {
        /// The adapter's `general.architecture`.
        adapter: String,
        /// The base model's.
        base: String,
    },
    /// Records a base-model hash that is not the served model's.
    #[error(
        "made for the base model with sha256 {recorded} ({BASE_SHA256_KEY}), the served model's is {actual}"
    )]
    BaseModel {
        /// The digest the adapter records.
        recorded: String,
        /// The served model file's.
        actual: Sha256Digest,
    },
    /// A tensor name that is neither `*.lora_a` nor `*.lora_b`.
    #[error("tensor {0} is not a LoRA tensor (names end in .lora_a or .lora_b)")]
    UnexpectedTensor(String),
    /// A pair for a weight this engine does not adapt.
    #[error(
        "tensor {0} adapts a weight other than a block's q, k, v, o, gate, up or down projection"
    )]
    UnsupportedTarget(String),
    /// A pair for a weight the base model does not have.
    #[error("tensor {0} adapts a weight the base model does not have (another base model?)")]
    NotInBase(String),
    /// Half a pair.
    #[error("{weight} has {present} but no {missing}")]
    MissingHalf {
        /// The adapted weight.
        weight: String,
        /// The half that is there.
        present: &'static str,
        /// The half that is not.
        missing: &'static str,
    },
    /// A tensor's shape does not fit the base weight.
    #[error("tensor {tensor} has shape {found:?}; the base weight {weight} {expected}")]
    Shape {
        /// The adapter tensor.
        tensor: String,
        /// Its ggml shape.
        found: Vec<u64>,
        /// The weight it adapts.
        weight: String,
        /// What fits, in words.
        expected: String,
    },
    /// `A` and `B` of one weight disagree on the rank.
    #[error("{weight}: lora_a has rank {a_rank}, lora_b has rank {b_rank}")]
    Rank {
        /// The adapted weight.
        weight: String,
        /// `lora_a`'s rows.
        a_rank: u64,
        /// `lora_b`'s row length.
        b_rank: u64,
    },
    /// A tensor type other than f32 or f16.
    #[error("tensor {tensor} is {dtype}; LoRA tensors must be f32 or f16")]
    Dtype {
        /// The adapter tensor.
        tensor: String,
        /// Its type.
        dtype: GgmlType,
    },
    /// No pair at all.
    #[error("holds no LoRA tensor pairs")]
    Empty,
    /// The name is the base model's served name.
    #[error("its name is the base model's served name; requests could not tell them apart")]
    NameTaken,
}

/// A metadata string as an error shows it: quoted, or "absent".
fn shown(value: &Option<String>) -> String {
    value
        .as_ref()
        .map_or_else(|| "absent".to_owned(), |v| format!("{v:?}"))
}

/// An adapter that cannot be served, and which one.
#[derive(Debug, thiserror::Error)]
#[error("LoRA adapter {name:?} ({}): {problem}", path.display())]
pub struct LoraError {
    /// The adapter's name (`--lora NAME=...`).
    pub name: String,
    /// Its file.
    pub path: PathBuf,
    /// What is wrong.
    pub problem: Box<LoraProblem>,
}

impl LoraError {
    /// Whether the file is not the release's (a sha256 mismatch): restarting cannot
    /// help until the release changes, like a rejected model.
    #[must_use]
    pub fn is_rejection(&self) -> bool {
        matches!(*self.problem, LoraProblem::Mismatch { .. })
    }
}

/// One adapted weight: `A` (`rank × cols`) and `B` (`rows × rank`), f32, with the
/// scale applied to `B (A x)`. `B` is kept transposed (`rank × rows`), so the expand
/// runs along the output row (`Σ_k t_k · Bᵀ_k`, vectorizable) instead of a
/// rank-long dot product per output.
#[derive(Clone, Debug)]
pub struct LoraPair {
    rank: usize,
    cols: usize,
    rows: usize,
    a: Vec<f32>,
    bt: Vec<f32>,
    scale: f32,
}

impl LoraPair {
    /// A pair from its matrices (`a`: `rank × cols`, `b`: `rows × rank`).
    ///
    /// # Panics
    /// When the lengths do not match the shape (a caller bug).
    #[must_use]
    pub fn new(
        rank: usize,
        cols: usize,
        rows: usize,
        a: Vec<f32>,
        b: Vec<f32>,
        scale: f32,
    ) -> Self {
        assert_eq!(a.len(), rank * cols, "lora_a is rank × cols");
        assert_eq!(b.len(), rows * rank, "lora_b is rows × rank");
        let mut bt = vec![0f32; rank * rows];
        for (j, bj) in b.chunks_exact(rank).enumerate() {
            for (k, &v) in bj.iter().enumerate() {
                bt[k * rows + j] = v;
            }
        }
        Self {
            rank,
            cols,
            rows,
            a,
            bt,
            scale,
        }
    }

    /// The rank `r`.
    #[must_use]
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Input width (the base weight's columns).
    #[must_use]
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Output width (the base weight's rows).
    #[must_use]
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// `alpha / r` (or 1).
    #[must_use]
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// Adds `scale · B (A x)` of every row of `x` (rows `cols` wide) onto the
    /// columns `offset..offset + rows()` of the matching row of `out` (rows
    /// `out_width` wide): the shrink and expand of one segment, rows in parallel.
    ///
    /// # Panics
    /// When the slices do not hold the same number of rows of those widths.
    pub fn add_rows(&self, x: &[f32], out: &mut [f32], out_width: usize, offset: usize) {
        assert!(offset + self.rows <= out_width, "LoRA output past the row");
        let n = x.len() / self.cols;
        assert_eq!(n, out.len() / out_width, "row counts differ");
        let scratch = || (vec![0f32; self.rank], vec![0f32; self.rows]);
        // A decode segment's few rows cost less than handing them to the pool.
        if n * self.rank * (self.cols + self.rows) < PARALLEL_WORK {
            let mut s = scratch();
            for (o, xr) in out
                .chunks_exact_mut(out_width)
                .zip(x.chunks_exact(self.cols))
            {
                self.add_row(xr, &mut s, &mut o[offset..offset + self.rows]);
            }
            return;
        }
        out.par_chunks_mut(out_width)
            .zip(x.par_chunks(self.cols))
            .for_each_init(scratch, |s, (o, xr)| {
                self.add_row(xr, s, &mut o[offset..offset + self.rows]);
            });
    }

    /// One row: shrink `t = A x`, expand `d = Bᵀᵀ t` (summed over `k` in order), then
    /// `out += scale · d`.
    fn add_row(&self, x: &[f32], (t, d): &mut (Vec<f32>, Vec<f32>), out: &mut [f32]) {
        for (tk, ak) in t.iter_mut().zip(self.a.chunks_exact(self.cols)) {
            *tk = dot(ak, x);
        }
        d.fill(0.0);
        for (&tk, btk) in t.iter().zip(self.bt.chunks_exact(self.rows)) {
            for (dj, &b) in d.iter_mut().zip(btk) {
                *dj += tk * b;
            }
        }
        for (o, dj) in out.iter_mut().zip(d.iter()) {
            *o += self.scale * dj;
        }
    }
}

/// Multiply-adds below which a segment's rows run on the calling thread.
const PARALLEL_WORK: usize = 1 << 18;

/// A dot product with eight partial sums combined in a fixed order: fast enough to
/// vectorize, and the same for a row whatever batch it is in.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, ar) = a.split_at(a.len() - a.len() % 8);
    let (bc, br) = b.split_at(ac.len());
    for (x, y) in ac.chunks_exact(8).zip(bc.chunks_exact(8)) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    let tail: f32 = ar.iter().zip(br).map(|(x, y)| x * y).sum();
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// One layer's pairs, indexed like [`Projection::ALL`].
pub type LayerPairs = [Option<LoraPair>; 7];

/// A loaded adapter: its identity and, per layer and projection, the pair (if the
/// file adapts that weight).
#[derive(Debug)]
pub struct LoraAdapter {
    name: String,
    sha256: Sha256Digest,
    alpha: f32,
    layers: Vec<LayerPairs>,
}

impl LoraAdapter {
    /// An adapter from pairs already in memory (`layers[i][p]`: layer `i`,
    /// [`Projection::ALL`]`[p]`); the loader and tests build them.
    #[must_use]
    pub fn from_pairs(
        name: impl Into<String>,
        sha256: Sha256Digest,
        alpha: f32,
        layers: Vec<LayerPairs>,
    ) -> Self {
        Self {
            name: name.into(),
            sha256,
            alpha,
            layers,
        }
    }

    /// The name requests use (`model`).
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The file's sha256.
    #[must_use]
    pub fn sha256(&self) -> Sha256Digest {
        self.sha256
    }

    /// `adapter.lora.alpha`.
    #[must_use]
    pub fn alpha(&self) -> f32 {
        self.alpha
    }

    /// What the prefix cache keys this adapter's blocks by: the name and the file's
    /// content hash, so the same name over a changed file never reuses KV.
    #[must_use]
    pub fn identity(&self) -> String {
        format!("{}@sha256:{}", self.name, self.sha256)
    }

    /// The pair adapting `proj` of layer `layer`, if any.
    #[must_use]
    pub fn pair(&self, layer: usize, proj: Projection) -> Option<&LoraPair> {
        self.layers.get(layer)?[proj.index()].as_ref()
    }

    /// How many weights the adapter adapts.
    #[must_use]
    pub fn num_pairs(&self) -> usize {
        self.layers.iter().flatten().flatten().count()
    }

    /// The largest rank among its pairs.
    #[must_use]
    pub fn max_rank(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .flatten()
            .map(LoraPair::rank)
            .max()
            .unwrap_or(0)
    }

    /// Whether every pair fits a model of `n_layers` layers whose projection
    /// `p` of any layer is `shape(p) = (cols, rows)`; `Err` names the first that
    /// does not.
    ///
    /// # Errors
    /// A sentence naming the layer and projection.
    pub fn check_shapes(
        &self,
        n_layers: usize,
        shape: impl Fn(Projection) -> (usize, usize),
    ) -> Result<(), String> {
        if self.layers.len() > n_layers {
            return Err(format!(
                "adapter {:?} has {} layers, the model {n_layers}",
                self.name,
                self.layers.len()
            ));
        }
        for (i, layer) in self.layers.iter().enumerate() {
            for p in Projection::ALL {
                if let Some(pair) = &layer[p.index()] {
                    let (cols, rows) = shape(p);
                    if (pair.cols, pair.rows) != (cols, rows) {
                        return Err(format!(
                            "adapter {:?} blk.{i}.{}: {}×{} where the model has {rows}×{cols}",
                            self.name,
                            p.tensor_name(),
                            pair.rows,
                            pair.cols
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

/// The served base model, as adapters are checked against it.
#[derive(Debug)]
pub struct BaseModel<'a> {
    /// Its parsed file.
    pub file: &'a GgufFile,
    /// Its path (hashed when an adapter records a base hash and `sha256` is unknown).
    pub path: &'a Path,
    /// Its sha256 when already verified (`--model-sha256`).
    pub sha256: Option<Sha256Digest>,
    /// The name it is served as: no adapter may take it.
    pub served_name: &'a str,
}

/// Loads every adapter of `--lora`/`--lora-sha256`, in order, each verified and
/// checked against `base`; the first problem stops the start-up.
///
/// # Errors
/// [`LoraError`] naming the adapter and its problem.
pub fn load_adapters(
    adapters: &[slipway_contract::LoraAdapter],
    base: &BaseModel<'_>,
) -> Result<Vec<Arc<LoraAdapter>>, LoraError> {
    let mut base_sha = base.sha256;
    adapters
        .iter()
        .map(|a| {
            load(a, base, &mut base_sha)
                .map(Arc::new)
                .map_err(|problem| LoraError {
                    name: a.name.clone(),
                    path: a.path.clone(),
                    problem: Box::new(problem),
                })
        })
        .collect()
}

fn load(
    spec: &slipway_contract::LoraAdapter,
    base: &BaseModel<'_>,
    base_sha: &mut Option<Sha256Digest>,
) -> Result<LoraAdapter, LoraProblem> {
    if spec.name == base.served_name {
        return Err(LoraProblem::NameTaken);
    }
    // Verified before anything parses it.
    let (actual, _bytes) = file_sha256(&spec.path)?;
    if let Some(expected) = spec.sha256
        && expected != actual
    {
        return Err(LoraProblem::Mismatch { expected, actual });
    }
    let file = GgufFile::open(&spec.path)?;
    let (alpha, layers) = read(&file, base, base_sha)?;
    Ok(LoraAdapter::from_pairs(&spec.name, actual, alpha, layers))
}

/// The alpha and the pairs of an adapter file, checked against `base`.
///
/// # Errors
/// The first [`LoraProblem`] found.
pub fn read(
    file: &GgufFile,
    base: &BaseModel<'_>,
    base_sha: &mut Option<Sha256Digest>,
) -> Result<(f32, Vec<LayerPairs>), LoraProblem> {
    let md = file.metadata();
    let general_type = md.get_str_opt("general.type")?;
    if general_type != Some("adapter") {
        return Err(LoraProblem::NotAnAdapter {
            found: general_type.map(str::to_owned),
        });
    }
    let arch = md.architecture()?;
    let base_arch = base.file.metadata().architecture()?;
    if arch != base_arch {
        return Err(LoraProblem::Architecture {
            adapter: arch.to_owned(),
            base: base_arch.to_owned(),
        });
    }
    let adapter_type = md.get_str_opt("adapter.type")?;
    if adapter_type != Some("lora") {
        return Err(LoraProblem::AdapterType {
            found: adapter_type.map(str::to_owned),
        });
    }
    let alpha = md.get_f32_opt("adapter.lora.alpha")?.unwrap_or(0.0);
    if let Some(recorded) = md.get_str_opt(BASE_SHA256_KEY)? {
        let actual = match *base_sha {
            Some(d) => d,
            None => {
                let (d, _) = file_sha256(base.path)?;
                *base_sha = Some(d);
                d
            }
        };
        if recorded.parse::<Sha256Digest>().ok() != Some(actual) {
            return Err(LoraProblem::BaseModel {
                recorded: recorded.to_owned(),
                actual,
            });
        }
    }

    // (layer, projection) -> (lora_a, lora_b)
    type Halves<'f> = (Option<&'f TensorInfo>, Option<&'f TensorInfo>);
    let mut pairs: BTreeMap<(usize, Projection), Halves<'_>> = BTreeMap::new();
    for t in file.tensors() {
        let (weight, is_a) = if let Some(w) = t.name.strip_suffix(".lora_a") {
            (w, true)
        } else if let Some(w) = t.name.strip_suffix(".lora_b") {
            (w, false)
        } else if t.name.ends_with("_norm.weight") {
            tracing::warn!(tensor = %t.name, "LoRA norm tensors are not applied (llama.cpp skips them too)");
            continue;
        } else {
            return Err(LoraProblem::UnexpectedTensor(t.name.clone()));
        };
        let Some(target) = parse_target(weight) else {
            return Err(LoraProblem::UnsupportedTarget(t.name.clone()));
        };
        if base.file.tensor_info(weight).is_none() {
            return Err(LoraProblem::NotInBase(t.name.clone()));
        }
        let slot = pairs.entry(target).or_default();
        if is_a {
            slot.0 = Some(t);
        } else {
            slot.1 = Some(t);
        }
    }
    if pairs.is_empty() {
        return Err(LoraProblem::Empty);
    }
    let n_layers = pairs.keys().map(|&(l, _)| l + 1).max().unwrap_or(0);
    let mut layers: Vec<LayerPairs> = (0..n_layers).map(|_| Default::default()).collect();
    for ((layer, proj), halves) in pairs {
        let weight = format!("blk.{layer}.{}.weight", proj.tensor_name());
        let (a, b) = match halves {
            (Some(a), Some(b)) => (a, b),
            (a, _) => {
                let (present, missing) = if a.is_some() {
                    ("lora_a", "lora_b")
                } else {
                    ("lora_b", "lora_a")
                };
                return Err(LoraProblem::MissingHalf {
                    weight,
                    present,
                    missing,
                });
            }
        };
        let Some(w) = base.file.tensor_info(&weight) else {
            return Err(LoraProblem::NotInBase(weight));
        };
        let pair = pair_of(file, &weight, w, (a, b), alpha)?;
        layers[layer][proj.index()] = Some(pair);
    }
    Ok((alpha, layers))
}

/// `blk.N.<projection>.weight` → (N, projection).
fn parse_target(weight: &str) -> Option<(usize, Projection)> {
    let rest = weight.strip_prefix("blk.")?.strip_suffix(".weight")?;
    let (layer, name) = rest.split_once('.')?;
    Some((layer.parse().ok()?, Projection::from_tensor_name(name)?))
}

fn pair_of(
    file: &GgufFile,
    weight: &str,
    w: &TensorInfo,
    (a, b): (&TensorInfo, &TensorInfo),
    alpha: f32,
) -> Result<LoraPair, LoraProblem> {
    for t in [a, b] {
        if !matches!(t.dtype, GgmlType::F32 | GgmlType::F16) {
            return Err(LoraProblem::Dtype {
                tensor: t.name.clone(),
                dtype: t.dtype,
            });
        }
    }
    let [cols, rows] = w.dims[..] else {
        return Err(LoraProblem::NotInBase(a.name.clone()));
    };
    let shape = |t: &TensorInfo, expected: String| LoraProblem::Shape {
        tensor: t.name.clone(),
        found: t.dims.clone(),
        weight: weight.to_owned(),
        expected,
    };
    let &[a_cols, a_rank] = &a.dims[..] else {
        return Err(shape(
            a,
            format!("is [{cols}, {rows}], so lora_a must be [{cols}, r]"),
        ));
    };
    let &[b_rank, b_rows] = &b.dims[..] else {
        return Err(shape(
            b,
            format!("is [{cols}, {rows}], so lora_b must be [r, {rows}]"),
        ));
    };
    if a_cols != cols || a_rank == 0 {
        return Err(shape(
            a,
            format!("is [{cols}, {rows}], so lora_a must be [{cols}, r] with r ≥ 1"),
        ));
    }
    if b_rows != rows {
        return Err(shape(
            b,
            format!("is [{cols}, {rows}], so lora_b must be [r, {rows}]"),
        ));
    }
    if a_rank != b_rank {
        return Err(LoraProblem::Rank {
            weight: weight.to_owned(),
            a_rank,
            b_rank,
        });
    }
    let (rank, cols, rows) = (a_rank as usize, cols as usize, rows as usize);
    let a = floats(file, a, rank, cols)?;
    let b = floats(file, b, rows, rank)?;
    // llama.cpp's `get_scale` (adapter scale 1): alpha / r, or 1 without an alpha.
    let scale = if alpha == 0.0 {
        1.0
    } else {
        alpha / rank as f32
    };
    Ok(LoraPair::new(rank, cols, rows, a, b, scale))
}

fn floats(
    file: &GgufFile,
    t: &TensorInfo,
    rows: usize,
    cols: usize,
) -> Result<Vec<f32>, LoraProblem> {
    let format = match t.dtype {
        GgmlType::F32 => WeightFormat::F32,
        GgmlType::F16 => WeightFormat::F16,
        dtype => {
            return Err(LoraProblem::Dtype {
                tensor: t.name.clone(),
                dtype,
            });
        }
    };
    let view = file.raw_tensor(&t.name)?;
    crate::kernels::pack::dequantize_matrix(format, view.data, rows, cols).map_err(|e| {
        LoraProblem::Shape {
            tensor: t.name.clone(),
            found: t.dims.clone(),
            weight: t.name.clone(),
            expected: e.to_string(),
        }
    })
}

/// Rows `rows` of a batch: `x` rows are `in_width` wide, `out` rows `out_width`.
/// Adds the segment's low-rank products for `projs` (`(projection, column offset in
/// out)`) of `layer`.
pub fn add_segment(
    adapter: &LoraAdapter,
    layer: usize,
    projs: &[(Projection, usize)],
    rows: Range<usize>,
    (x, in_width): (&[f32], usize),
    (out, out_width): (&mut [f32], usize),
) {
    let xs = &x[rows.start * in_width..rows.end * in_width];
    let os = &mut out[rows.start * out_width..rows.end * out_width];
    for &(p, offset) in projs {
        if let Some(pair) = adapter.pair(layer, p) {
            pair.add_rows(xs, os, out_width, offset);
        }
    }
}

#[cfg(test)]
#[path = "lora_tests.rs"]
mod tests;
