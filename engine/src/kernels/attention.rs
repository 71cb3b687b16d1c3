//! Causal grouped-query attention of one query token over a paged f16 KV store.
//!
//! The query heads sharing one KV head are processed together so each cached key
//! and value is read (and converted from f16) once per group. Keys are stored
//! transposed per block, so a block's scores are `head_dim` broadcast multiply-adds
//! over its slots (no horizontal sums). The inner loops are plain Rust the compiler vectorizes; on AVX-512 machines the same
//! code is compiled again with those features enabled (see `avx512::attend`).

use half::f16;
use half::slice::HalfFloatSliceExt;

/// Geometry of one layer of the paged KV store: `[block][k|v][kv_head]`, then keys
/// transposed as `[dim][slot]` and values as `[slot][dim]`.
#[derive(Clone, Copy, Debug)]
pub struct KvLayout {
    /// Tokens per block.
    pub block_size: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Dimensions per head.
    pub head_dim: usize,
}

impl KvLayout {
    /// Elements of one block (keys and values of every head).
    #[must_use]
    pub fn block_elems(&self) -> usize {
        2 * self.kv_heads * self.block_size * self.head_dim
    }

    /// Bytes of one block of one layer (elements are f16).
    #[must_use]
    pub fn block_bytes(&self) -> usize {
        self.block_elems() * std::mem::size_of::<f16>()
    }

    /// Offset of `(block, k_or_v, head)` within a layer.
    #[must_use]
    pub fn offset(&self, block: usize, v: bool, head: usize) -> usize {
        block * self.block_elems()
            + (usize::from(v) * self.kv_heads + head) * self.block_size * self.head_dim
    }
}

/// One attention problem: a query token of a group of heads.
#[derive(Debug)]
pub struct AttnQuery<'a> {
    /// The layer's KV elements.
    pub layer: &'a [f16],
    /// Its geometry.
    pub layout: KvLayout,
    /// The sequence's block table.
    pub table: &'a [u32],
    /// Position of the query token; it attends to positions `0..=pos`.
    pub pos: usize,
    /// KV head index.
    pub kv_head: usize,
    /// Query vectors of the heads sharing `kv_head`, `group * head_dim`.
    pub q: &'a [f32],
    /// `1 / sqrt(head_dim)`.
    pub scale: f32,
}

#[inline(always)]
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// Computes the attention output of every query head in `query.q` into `out`
/// (same shape), using `scores` as scratch.
///
/// # Panics
/// When the block table does not cover `pos` or a block lies outside `layer`.
#[inline(always)]
pub fn attend_impl(query: &AttnQuery<'_>, scores: &mut Vec<f32>, out: &mut [f32]) {
    // The common geometry gets constant trip counts, so the inner loops become
    // straight-line vector code.
    match (query.layout.block_size, query.layout.head_dim) {
        (16, 64) => attend_body::<16, 64>(query, scores, out),
        _ => attend_body::<0, 0>(query, scores, out),
    }
}

/// The attention body; `BS`/`HD` are the block size and head size when known at
/// compile time, 0 when taken from the layout.
#[inline(always)]
fn attend_body<const BS: usize, const HD: usize>(
    query: &AttnQuery<'_>,
    scratch: &mut Vec<f32>,
    out: &mut [f32],
) {
    let AttnQuery {
        layer,
        layout,
        table,
        pos,
        kv_head,
        q,
        scale,
    } = *query;
    let bs = if BS == 0 { layout.block_size } else { BS };
    let hd = if HD == 0 { layout.head_dim } else { HD };
    let group = q.len() / hd;
    let ctx = pos + 1;
    let nblk = ctx.div_ceil(bs);
    // Scores are laid out in whole blocks (`cap` per head); slots past `pos` in the
    // last block are computed from whatever the block holds and then ignored.
    let cap = nblk * bs;
    scratch.clear();
    scratch.resize(group * hd + group * cap + bs * hd, 0.0);
    let (qs, rest) = scratch.split_at_mut(group * hd);
    let (scores, block_f32) = rest.split_at_mut(group * cap);
    // llama.cpp converts Q to f16 to multiply it with its f16 keys.
    for (o, &v) in qs.iter_mut().zip(q) {
        *o = super::quant::round_f16(v) * scale;
    }
    for (bi, &block) in table[..nblk].iter().enumerate() {
        let kt = &mut block_f32[..hd * bs];
        layer[layout.offset(block as usize, false, kv_head)..][..hd * bs].convert_to_f32_slice(kt);
        for h in 0..group {
            let dst = &mut scores[h * cap + bi * bs..][..bs];
            if BS > 0 {
                // A local fixed-size accumulator stays in one vector register.
                let mut acc = [0f32; BS];
                for (row, &qd) in kt.chunks_exact(BS).zip(&qs[h * hd..(h + 1) * hd]) {
                    for s in 0..BS {
                        acc[s] += qd * row[s];
                    }
                }
                dst.copy_from_slice(&acc);
            } else {
                for (row, &qd) in kt.chunks_exact(bs).zip(&qs[h * hd..(h + 1) * hd]) {
                    for (a, k) in dst.iter_mut().zip(row) {
                        *a += qd * k;
                    }
                }
            }
        }
    }
    for h in 0..group {
        super::ops::softmax_in_place(&mut scores[h * cap..h * cap + ctx]);
    }
    out.fill(0.0);
    for (bi, &block) in table[..nblk].iter().enumerate() {
        let n = bs.min(ctx - bi * bs);
        let vb = &mut block_f32[..n * hd];
        layer[layout.offset(block as usize, true, kv_head)..][..n * hd].convert_to_f32_slice(vb);
        for (s, v) in vb.chunks_exact(hd).enumerate() {
            for h in 0..group {
                axpy(
                    &mut out[h * hd..(h + 1) * hd],
                    scores[h * cap + bi * bs + s],
                    v,
                );
            }
        }
    }
}

/// [`attend_impl`] compiled for the best instruction set available.
pub fn attend(query: &AttnQuery<'_>, scores: &mut Vec<f32>, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    match super::Isa::detect() {
        super::Isa::Avx512Vnni => return super::avx512::attend(query, scores, out),
        super::Isa::Avx2 => return super::avx2::attend(query, scores, out),
        super::Isa::Scalar => {}
    }
    attend_impl(query, scores, out);
}
