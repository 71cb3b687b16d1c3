//! CPU twins of the CUDA kernels in the top-level `kernels/`: the same arguments, the
//! same layouts and the same arithmetic, on host slices (STYLE.md: every kernel has a
//! CPU twin). [`super::CpuDevice`] runs the device forward pass on them, so the
//! orchestration of the GPU backend is exercised on machines without a GPU, and the
//! kernel tests compare each kernel with its twin.
//!
//! Invariants shared with the kernels: quantized weights stay in ggml's on-disk block
//! layout; the KV cache holds f16 bits as `[layer][block][kv_head][slot][head_dim]`;
//! a token's cache slot is `block * block_size + offset`.

use half::f16;

use crate::kernels::quant::{Q4_1_BLOCK_BYTES, Q8_0_BLOCK_BYTES, QK};

/// A quantized weight format the kernels read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantFormat {
    /// ggml Q4_1 (20-byte blocks).
    Q4_1,
    /// ggml Q8_0 (34-byte blocks).
    Q8_0,
}

impl QuantFormat {
    /// Bytes per 32-element block.
    #[must_use]
    pub fn block_bytes(self) -> usize {
        match self {
            Self::Q4_1 => Q4_1_BLOCK_BYTES,
            Self::Q8_0 => Q8_0_BLOCK_BYTES,
        }
    }

    /// The kernel-name suffix (`matvec_q4_1`, ...).
    #[must_use]
    pub fn suffix(self) -> &'static str {
        match self {
            Self::Q4_1 => "q4_1",
            Self::Q8_0 => "q8_0",
        }
    }
}

fn f16_bits(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Element `k` of one block (prelude.cuh `dequant`).
#[must_use]
pub fn dequant(fmt: QuantFormat, blk: &[u8], k: usize) -> f32 {
    match fmt {
        QuantFormat::Q4_1 => {
            let q = blk[4 + (k & 15)];
            let v = if k < 16 { q & 15 } else { q >> 4 };
            f32::from(v) * f16_bits(blk, 0) + f16_bits(blk, 2)
        }
        QuantFormat::Q8_0 => f32::from(blk[2 + k].cast_signed()) * f16_bits(blk, 0),
    }
}

/// f32 → f16 bits, round to nearest even (PTX `cvt.rn.f16.f32`).
#[must_use]
pub fn to_f16_bits(x: f32) -> u16 {
    f16::from_f32(x).to_bits()
}

/// f16 bits → f32 (PTX `cvt.f32.f16`).
#[must_use]
pub fn from_f16_bits(h: u16) -> f32 {
    f16::from_bits(h).to_f32()
}

/// `embed_q8_0` / `embed_q4_1`: `out[t] = dequantize(table row tokens[t])`.
///
/// # Panics
/// When a token is outside the table (the host validates tokens first).
pub fn embed(fmt: QuantFormat, table: &[u8], tokens: &[u32], out: &mut [f32], dim: usize) {
    let row_bytes = dim / QK * fmt.block_bytes();
    for (t, &tok) in tokens.iter().enumerate() {
        let row = &table[tok as usize * row_bytes..][..row_bytes];
        for e in 0..dim {
            out[t * dim + e] = dequant(fmt, &row[e / QK * fmt.block_bytes()..], e % QK);
        }
    }
}

/// `rms_norm`: `out[i] = x[rows[i]] * rsqrt(mean(x[rows[i]]²) + eps) * w`.
pub fn rms_norm(x: &[f32], w: &[f32], rows: &[u32], out: &mut [f32], dim: usize, eps: f32) {
    for (i, &r) in rows.iter().enumerate() {
        let xr = &x[r as usize * dim..][..dim];
        let ss: f32 = xr.iter().map(|v| v * v).sum();
        let scale = 1.0 / (ss / dim as f32 + eps).sqrt();
        for e in 0..dim {
            out[i * dim + e] = xr[e] * scale * w[e];
        }
    }
}

/// `add_rms_norm`: `x[i] += y[i]`, then `out[i] = rmsnorm(x[i]) * w`, for `n` rows.
pub fn add_rms_norm(
    x: &mut [f32],
    y: &[f32],
    w: &[f32],
    out: &mut [f32],
    n: usize,
    dim: usize,
    eps: f32,
) {
    for (a, b) in x[..n * dim].iter_mut().zip(&y[..n * dim]) {
        *a += b;
    }
    let rows: Vec<u32> = (0..n as u32).collect();
    rms_norm(x, w, &rows, out, dim, eps);
}

/// `add`: `x[i] += y[i]` for `len` elements.
pub fn add(x: &mut [f32], y: &[f32], len: usize) {
    for (a, b) in x[..len].iter_mut().zip(&y[..len]) {
        *a += b;
    }
}

/// `silu_mul`: `out[t][j] = silu(gate_up[t][j]) * gate_up[t][ffn + j]`.
pub fn silu_mul(gate_up: &[f32], out: &mut [f32], ffn: usize, n: usize) {
    for t in 0..n {
        for j in 0..ffn {
            let g = gate_up[t * 2 * ffn + j];
            let u = gate_up[t * 2 * ffn + ffn + j];
            out[t * ffn + j] = g / (1.0 + (-g).exp()) * u;
        }
    }
}

/// Shape of a product `y = W x` (see `matmul.cu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatShape {
    /// Weight rows (outputs per token).
    pub rows: usize,
    /// Weight columns (inputs per token), a multiple of 32.
    pub cols: usize,
    /// Tokens.
    pub n: usize,
    /// Output row stride.
    pub ldy: usize,
    /// Output column offset (stacked projections write side by side).
    pub yoff: usize,
}

/// `matvec_*` / `matmul_*`: `y[t * ldy + yoff + r] = sum_k W[r][k] x[t][k]`.
///
/// Rows are computed in parallel on the current rayon pool (the twin runs the whole
/// model in tests); each output is one sequential f32 sum, whatever the split.
pub fn matmul(fmt: QuantFormat, w: &[u8], x: &[f32], y: &mut [f32], s: MatShape) {
    use rayon::prelude::*;
    let nb = s.cols / QK;
    let bb = fmt.block_bytes();
    // Row-major [row][token] first, so rows can go to threads; then scattered.
    let mut by_row = vec![0f32; s.rows * s.n];
    by_row
        .par_chunks_mut(s.n.max(1))
        .enumerate()
        .for_each(|(r, out)| {
            let row = &w[r * nb * bb..][..nb * bb];
            let wrow: Vec<f32> = (0..s.cols)
                .map(|k| dequant(fmt, &row[k / QK * bb..], k % QK))
                .collect();
            for (t, o) in out.iter_mut().enumerate() {
                let xr = &x[t * s.cols..][..s.cols];
                *o = wrow.iter().zip(xr).map(|(a, b)| a * b).sum();
            }
        });
    for r in 0..s.rows {
        for t in 0..s.n {
            y[t * s.ldy + s.yoff + r] = by_row[r * s.n + t];
        }
    }
}

/// Geometry of the device KV cache and the attention heads.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvParams {
    /// The layer to read or write.
    pub layer: usize,
    /// Blocks per layer.
    pub num_blocks: usize,
    /// Positions per block.
    pub block_size: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// Dimensions per head.
    pub head_dim: usize,
}

impl KvParams {
    /// Width of a `[q | k | v]` row.
    #[must_use]
    pub fn qkv_width(&self) -> usize {
        (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
    }

    /// Index of `(block, kv_head, offset, dim 0)` in the cache.
    #[must_use]
    pub fn at(&self, block: usize, kv_head: usize, offset: usize) -> usize {
        ((self.layer * self.num_blocks + block) * self.n_kv_heads + kv_head)
            * self.block_size
            * self.head_dim
            + offset * self.head_dim
    }

    /// Cache elements (f16) of all `layers` layers.
    #[must_use]
    pub fn cache_len(&self, layers: usize) -> usize {
        layers * self.num_blocks * self.n_kv_heads * self.block_size * self.head_dim
    }
}

/// `rope_store_kv`: rotates q in place, writes rotated k and v (as f16) to the cache.
#[allow(clippy::too_many_arguments)] // mirrors the kernel's argument list
pub fn rope_store_kv(
    qkv: &mut [f32],
    pos: &[u32],
    slots: &[u32],
    k_cache: &mut [u16],
    v_cache: &mut [u16],
    p: &KvParams,
    rope_dims: usize,
    theta_scale: f32,
) {
    let width = p.qkv_width();
    let hd = p.head_dim;
    for (t, (&ps, &slot)) in pos.iter().zip(slots).enumerate() {
        let row = &mut qkv[t * width..(t + 1) * width];
        let (block, off) = (slot as usize / p.block_size, slot as usize % p.block_size);
        for head in 0..p.n_heads + p.n_kv_heads {
            for i in 0..hd / 2 {
                let (mut x0, mut x1) = (row[head * hd + 2 * i], row[head * hd + 2 * i + 1]);
                if 2 * i < rope_dims {
                    let mut theta = ps as f32;
                    for _ in 0..i {
                        theta *= theta_scale;
                    }
                    let (c, s) = (theta.cos(), theta.sin());
                    (x0, x1) = (x0 * c - x1 * s, x0 * s + x1 * c);
                }
                if head < p.n_heads {
                    row[head * hd + 2 * i] = x0;
                    row[head * hd + 2 * i + 1] = x1;
                } else {
                    let at = p.at(block, head - p.n_heads, off) + 2 * i;
                    k_cache[at] = to_f16_bits(x0);
                    k_cache[at + 1] = to_f16_bits(x1);
                }
            }
        }
        let v = &row[(p.n_heads + p.n_kv_heads) * hd..];
        for h in 0..p.n_kv_heads {
            let at = p.at(block, h, off);
            for d in 0..hd {
                v_cache[at + d] = to_f16_bits(v[h * hd + d]);
            }
        }
    }
}

/// `paged_attention`: causal GQA of each token (position `pos[t]`, block table at
/// `block_tables[table_off[t]..]`) over the cache; `out` is `n × n_heads × head_dim`.
///
/// Computed as plain softmax (scores, max, exponentials, sum) rather than the kernel's
/// online form: the two agree to rounding, which is what the twin test checks.
#[allow(clippy::too_many_arguments)] // mirrors the kernel's argument list
pub fn paged_attention(
    qkv: &[f32],
    k_cache: &[u16],
    v_cache: &[u16],
    block_tables: &[u32],
    table_off: &[u32],
    pos: &[u32],
    out: &mut [f32],
    p: &KvParams,
    scale: f32,
) {
    let width = p.qkv_width();
    let hd = p.head_dim;
    let group = p.n_heads / p.n_kv_heads;
    let mut scores = Vec::new();
    for (t, (&off, &ps)) in table_off.iter().zip(pos).enumerate() {
        let table = &block_tables[off as usize..];
        let ctx = ps as usize + 1;
        for h in 0..p.n_heads {
            let kvh = h / group;
            let q: Vec<f32> = qkv[t * width + h * hd..][..hd]
                .iter()
                .map(|&v| from_f16_bits(to_f16_bits(v)) * scale)
                .collect();
            let at = |j: usize| p.at(table[j / p.block_size] as usize, kvh, j % p.block_size);
            scores.clear();
            for j in 0..ctx {
                let k = &k_cache[at(j)..][..hd];
                scores.push(
                    q.iter()
                        .zip(k)
                        .map(|(a, &b)| a * from_f16_bits(b))
                        .sum::<f32>(),
                );
            }
            let m = scores.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let mut l = 0f32;
            for s in &mut scores {
                *s = (*s - m).exp();
                l += *s;
            }
            let o = &mut out[(t * p.n_heads + h) * hd..][..hd];
            o.fill(0.0);
            for (j, &e) in scores.iter().enumerate() {
                let v = &v_cache[at(j)..][..hd];
                for (od, &vd) in o.iter_mut().zip(v) {
                    *od += e * from_f16_bits(vd);
                }
            }
            for od in o.iter_mut() {
                *od /= l;
            }
        }
    }
}

/// `argmax_rows`: per row, the index of the largest value (lowest among ties).
pub fn argmax_rows(logits: &[f32], vocab: usize, out: &mut [u32]) {
    for (o, row) in out.iter_mut().zip(logits.chunks_exact(vocab)) {
        *o = crate::sampling::argmax(row) as u32;
    }
}

/// Parameters of on-device sampling.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleParams {
    /// Candidates kept, 1..=256.
    pub top_k: usize,
    /// Nucleus mass in (0, 1].
    pub top_p: f32,
    /// Softmax temperature, > 0.
    pub temperature: f32,
}

/// Most candidates the sampling kernel keeps.
pub const TOPK_MAX: usize = 256;

/// `sample_top_k_top_p`: the CPU sampler's rule with a given uniform per row.
pub fn sample_top_k_top_p(
    logits: &[f32],
    vocab: usize,
    p: SampleParams,
    uniforms: &[f32],
    out: &mut [u32],
) {
    for ((o, row), &u) in out.iter_mut().zip(logits.chunks_exact(vocab)).zip(uniforms) {
        let mut cand: Vec<(u32, f32)> = row
            .iter()
            .enumerate()
            .map(|(i, &v)| (i as u32, v))
            .collect();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        cand.truncate(p.top_k.clamp(1, TOPK_MAX).min(vocab));
        let w = |v: f32| f64::from((v - cand[0].1) / p.temperature).exp();
        let total: f64 = cand.iter().map(|c| w(c.1)).sum();
        let mut keep = cand.len();
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, c) in cand.iter().enumerate() {
                acc += w(c.1) / total;
                if acc >= f64::from(p.top_p) {
                    keep = i + 1;
                    break;
                }
            }
        }
        let kept: f64 = cand[..keep].iter().map(|c| w(c.1)).sum();
        let mut x = f64::from(u) * kept;
        *o = cand[keep - 1].0;
        for c in &cand[..keep] {
            let q = w(c.1);
            if x < q {
                *o = c.0;
                break;
            }
            x -= q;
        }
    }
}
