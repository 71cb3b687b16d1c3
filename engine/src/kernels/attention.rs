//! Causal grouped-query attention over a paged f16 KV store, flash-attention style
//! (online softmax: Milakov & Gimelshein, 2018; tiling: Dao et al., FlashAttention,
//! 2022).
//!
//! The unit of work is a tile: consecutive query tokens of one sequence and the query
//! heads sharing one KV head. The tile walks the sequence's blocks once; each key and
//! value block is converted from f16 once for all the tile's rows, and every row
//! keeps a running maximum and sum of its softmax, rescaling its output when the
//! maximum grows. Keys are stored transposed per block, so a block's scores are
//! `head_dim` broadcast multiply-adds over its slots (no horizontal sums), four rows
//! at a time so each key row loaded serves four. A prefill chunk is cut into tiles of
//! [`QUERY_TILE`] tokens; a decode step is a tile of one.
//!
//! The loops are plain Rust the compiler vectorizes, compiled again with AVX2 or
//! AVX-512 enabled (`avx2::attend`, `avx512::attend`). Invariant: every path does the
//! same operations in the same order (fixed reduction trees; products accumulate by
//! fused multiply-add, which rounds once on every path: the FMA instruction with AVX2
//! and AVX-512, a correctly rounded `fmaf` on the portable one, slow only on the CPUs
//! without FMA that take it), so the result does not depend on the instruction set,
//! nor on which other rows share a row's tile. A multiply and an add were two vector
//! operations per product, on a quarter of a prompt's time.

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::ops::exp;
use super::{CacheLevel, prefetch};

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

#[inline(always)]
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y = a.mul_add(*x, *y);
    }
}

/// Query tokens per tile of [`attend`] in a prefill chunk: enough rows (times
/// the group) to amortise each block's f16 conversion, few enough that the tile's
/// queries and accumulators stay in L1 next to the converted block.
pub const QUERY_TILE: usize = 16;

/// One tile of attention problems: consecutive query tokens of one sequence, and the
/// query heads sharing one KV head.
#[derive(Debug)]
pub struct AttnTile<'a> {
    /// The layer's KV elements.
    pub layer: &'a [f16],
    /// Its geometry.
    pub layout: KvLayout,
    /// The sequence's block table.
    pub table: &'a [u32],
    /// Position of the first query token; token `i` attends to `0..=pos + i`.
    pub pos: usize,
    /// Query tokens in the tile.
    pub tokens: usize,
    /// KV head index.
    pub kv_head: usize,
    /// Query heads sharing `kv_head`.
    pub group: usize,
    /// Query vectors: token `i`'s `group * head_dim` values start at `q[i * q_stride]`.
    pub q: &'a [f32],
    /// Distance between consecutive tokens' query vectors in `q`.
    pub q_stride: usize,
    /// `1 / sqrt(head_dim)`.
    pub scale: f32,
    /// The tile computed after this one on the same worker, when known: its first
    /// blocks are requested while this tile's last ones are computed, so it does not
    /// start on blocks still in memory.
    pub next: Option<NextTile<'a>>,
}

/// What [`AttnTile::next`] needs to request a tile's first blocks.
#[derive(Clone, Copy, Debug)]
pub struct NextTile<'a> {
    /// Its sequence's block table.
    pub table: &'a [u32],
    /// Its KV head.
    pub kv_head: usize,
    /// Its last query token's position: the blocks it reads end there.
    pub last: usize,
}

/// Reusable buffers of [`attend`] (one per worker).
#[derive(Debug, Default)]
pub struct AttnScratch {
    q16: Vec<f16>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    scores: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f64>,
}

/// Query rows scored together against one converted key block: each key row
/// loaded is used `ROWS` times, and `ROWS` accumulators of 16 slots stay in registers.
pub(super) const ROWS: usize = 4;

/// Computes every query row of `tile` into `out` (`tokens * group * head_dim`, token
/// by token, head by head), as the module describes.
///
/// # Panics
/// When the block table does not cover the last token, a block lies outside `layer`,
/// or `q`/`out` are too short.
#[inline(always)]
pub fn attend_impl(tile: &AttnTile<'_>, scratch: &mut AttnScratch, out: &mut [f32], f16: F16Ops) {
    match (tile.layout.block_size, tile.layout.head_dim) {
        (16, 64) => tile_body::<16, 64>(tile, scratch, out, f16),
        _ => tile_body::<0, 0>(tile, scratch, out, f16),
    }
}

/// How an instruction set's attention reads the f16 store: every block converted
/// once into f32 buffers ([`WidenF16`]), which a tile of several passes over its rows
/// reuses; and, where the instruction set has them, kernels that convert as they
/// multiply, for a tile of one pass (a decode step's heads of one KV head), whose
/// every converted value is used once: writing it out and reading it back was a
/// third of the work. Both do the same operations in the same order.
#[derive(Clone, Copy, Debug)]
pub struct F16Ops {
    widen: WidenF16,
    one_pass: Option<(ScoresF16, ValuesF16)>,
}

impl F16Ops {
    /// Conversion by the `half` crate, no one-pass kernels: the plain Rust path.
    #[must_use]
    pub fn portable() -> Self {
        Self {
            widen: widen_portable,
            one_pass: None,
        }
    }

    /// An instruction set's conversion and, when it has them, its one-pass kernels
    /// (for blocks of 16 slots and heads of 64 dimensions).
    #[must_use]
    pub(super) fn new(widen: WidenF16, one_pass: Option<(ScoresF16, ValuesF16)>) -> Self {
        Self { widen, one_pass }
    }
}

/// Scores of `nr` (1..=[`ROWS`]) query rows (`q`, 64 each, scaled) against one f16 key
/// block of 16 slots (`[dim][slot]`) into `out` (`nr` rows of 16): the operations of
/// `score_rows::<16, 64, nr>` in its order.
pub(super) type ScoresF16 = fn(usize, &[f32], &[f16], &mut [f32]);

/// The weighted values of `nr` rows over one f16 value block (`[slot][64]`) added into
/// `out`: the operations of `add_values::<64, nr>` in its order.
pub(super) type ValuesF16 = fn(&BlockWeights<'_>, usize, &[f16], &mut [f32]);

/// Converts f16 values to f32 (`src` and `dst` of one length), once per key and value
/// block of a tile. Every instruction set's conversion is exact, so all paths see the
/// same values; the vector ones (`avx512::widen_f16`, `avx2::widen_f16`) exist
/// because the `half` crate's slice conversion calls a function per 8 values, which
/// took a fifth of batched decode.
pub type WidenF16 = fn(&[f16], &mut [f32]);

/// The [`WidenF16`] of `isa`'s attention.
#[must_use]
pub fn widen_for(isa: super::Isa) -> WidenF16 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        super::Isa::Avx512Vnni => super::avx512::widen_f16,
        #[cfg(target_arch = "x86_64")]
        super::Isa::Avx2 => super::avx2::widen_f16,
        _ => widen_portable,
    }
}

/// [`WidenF16`] without vector instructions (the `half` crate's conversion).
pub fn widen_portable(src: &[f16], dst: &mut [f32]) {
    src.convert_to_f32_slice(dst);
}

#[inline(always)]
fn tile_body<const BS: usize, const HD: usize>(
    tile: &AttnTile<'_>,
    scratch: &mut AttnScratch,
    out: &mut [f32],
    f16: F16Ops,
) {
    let AttnTile {
        layer,
        layout,
        table,
        pos,
        tokens,
        kv_head,
        group,
        q,
        q_stride,
        scale,
        next,
    } = *tile;
    let bs = if BS == 0 { layout.block_size } else { BS };
    let hd = if HD == 0 { layout.head_dim } else { HD };
    let rows = tokens * group;
    let out = &mut out[..rows * hd];
    let one_pass = f16
        .one_pass
        .filter(|_| BS == 16 && HD == 64 && rows <= ROWS);
    let AttnScratch {
        q16,
        q: qs,
        k,
        v,
        scores,
        max,
        sum,
    } = scratch;
    qs.resize(rows * hd, 0.0);
    q16.resize(group * hd, f16::ZERO);
    for (i, dst) in qs.chunks_exact_mut(group * hd).enumerate() {
        // llama.cpp converts Q to f16 to multiply it with its f16 keys.
        q16.convert_from_f32_slice(&q[i * q_stride..][..group * hd]);
        q16.convert_to_f32_slice(dst);
        for x in dst {
            *x *= scale;
        }
    }
    max.clear();
    max.resize(rows, f32::NEG_INFINITY);
    sum.clear();
    sum.resize(rows, 0.0);
    k.resize(bs * hd, 0.0);
    v.resize(bs * hd, 0.0);
    scores.resize(ROWS * bs, 0.0);
    out.fill(0.0);
    let last = pos + tokens - 1;
    let blocks = &table[..=last / bs];
    for (bi, &block) in blocks.iter().enumerate() {
        let start = bi * bs;
        // Request the block PREFETCH_AHEAD past this one into level 2 (past the tile's
        // last block, one of the next tile's first; on the first block, every block
        // up to there), and the next one from level 2 into level 1, so the loads that
        // start it do not wait on level 2 (a tenth of decode attention).
        let far = if bi == 0 {
            1..=PREFETCH_AHEAD
        } else {
            PREFETCH_AHEAD..=PREFETCH_AHEAD
        };
        let requests = far
            .map(|later| (later, CacheLevel::L2))
            .chain((bi > 0).then_some((1, CacheLevel::L1)));
        for (later, level) in requests {
            let (table, head, first, last) = match (blocks.get(bi + later), next) {
                (Some(_), _) => (blocks, kv_head, bi + later, last),
                (None, Some(n)) => (n.table, n.kv_head, bi + later - blocks.len(), n.last),
                (None, None) => continue,
            };
            if let Some(&block) = table.get(first).filter(|_| first <= last / bs) {
                let seen = bs.min(last + 1 - first * bs);
                let keys = &layer[layout.offset(block as usize, false, head)..][..hd * bs];
                let values = &layer[layout.offset(block as usize, true, head)..][..seen * hd];
                prefetch(keys, level);
                prefetch(values, level);
            }
        }
        // Slots of this block the tile's last token sees; earlier tokens see fewer.
        let seen = bs.min(last + 1 - start);
        let keys = &layer[layout.offset(block as usize, false, kv_head)..][..hd * bs];
        let values = &layer[layout.offset(block as usize, true, kv_head)..][..seen * hd];
        if one_pass.is_none() {
            (f16.widen)(keys, k);
            (f16.widen)(values, &mut v[..seen * hd]);
        }
        // Tokens before the block's first position see none of it.
        let mut r = start.saturating_sub(pos) * group;
        while r < rows {
            let nr = ROWS.min(rows - r);
            let q = &qs[r * hd..];
            // A decode's group of 3 heads is one pass of 3 rows, not three of one.
            match (one_pass, nr) {
                (Some((scores_f16, _)), _) => scores_f16(nr, q, keys, scores),
                (None, ROWS) => score_rows::<BS, HD, ROWS>(q, k, (bs, hd), scores),
                (None, 3) => score_rows::<BS, HD, 3>(q, k, (bs, hd), scores),
                (None, 2) => score_rows::<BS, HD, 2>(q, k, (bs, hd), scores),
                (None, _) => score_rows::<BS, HD, 1>(q, k, (bs, hd), scores),
            }
            let mut visible = [0; ROWS];
            let mut rescale = [1.0; ROWS];
            for j in 0..nr {
                let row = r + j;
                visible[j] = bs.min(pos + row / group + 1 - start);
                rescale[j] = softmax_block::<BS>(
                    &mut scores[j * bs..][..bs],
                    visible[j],
                    (&mut max[row], &mut sum[row]),
                );
            }
            let block = BlockWeights {
                p: scores,
                bs,
                visible: &visible,
                rescale: &rescale,
            };
            let outs = &mut out[r * hd..(r + nr) * hd];
            // The rows' value sums advance together, each value row loaded once for
            // all of them: one row alone was a chain of dependent multiply-adds.
            match (one_pass, nr) {
                (Some((_, values_f16)), _) => values_f16(&block, nr, values, outs),
                (None, ROWS) => add_values::<HD, ROWS>(&block, v, outs),
                (None, 3) => add_values::<HD, 3>(&block, v, outs),
                (None, 2) => add_values::<HD, 2>(&block, v, outs),
                (None, _) => add_values::<HD, 1>(&block, v, outs),
            }
            r += nr;
        }
    }
    for (o, &l) in out.chunks_exact_mut(hd).zip(sum.iter()) {
        let inv = (1.0 / l) as f32;
        for x in o {
            *x *= inv;
        }
    }
}

/// How many blocks ahead of the one computed [`prefetch`] asks for: one block of one
/// head is computed in less time than memory takes to deliver it. A sequence's blocks
/// lie wherever the allocator put them, so the hardware prefetcher cannot guess the
/// next one; without this, batched decode waited on memory for each block in turn
/// (the KV of 64 sequences is far larger than the caches and is read once per step).
const PREFETCH_AHEAD: usize = 2;

/// Folds one block into one query row's running softmax: `s` holds the row's
/// scores for the block's slots, of which the first `n` are visible to it, and
/// becomes their weights; `max` and `sum` are the row's running maximum and sum of
/// weights. Returns the factor the row's output accumulated so far must be scaled by.
#[inline(always)]
fn softmax_block<const BS: usize>(
    s: &mut [f32],
    n: usize,
    (max, sum): (&mut f32, &mut f64),
) -> f32 {
    // Slots past the row's position weigh exactly 0, whatever their keys hold.
    for x in &mut s[n..] {
        *x = f32::NEG_INFINITY;
    }
    let larger = |a: f32, b: f32| if b > a { b } else { a };
    let block_max = if BS > 0 {
        reduce::<BS>(s, larger)
    } else {
        s.iter().copied().fold(f32::NEG_INFINITY, larger)
    };
    let new_max = larger(*max, block_max);
    // 0 on the row's first block (max = -inf): nothing accumulated yet.
    let rescale = exp(*max - new_max);
    *max = new_max;
    for x in s.iter_mut() {
        *x = exp(*x - new_max);
    }
    let block_sum = if BS > 0 {
        reduce::<BS>(s, |a, b| a + b)
    } else {
        s.iter().sum()
    };
    // The running sum in f64, as ops::softmax_in_place sums.
    *sum = *sum * f64::from(rescale) + f64::from(block_sum);
    rescale
}

/// One block's softmax weights for a run of query rows (from [`softmax_block`]).
#[derive(Debug)]
pub(super) struct BlockWeights<'a> {
    /// Row `j`'s weight of slot `i` is `p[j * bs + i]`.
    pub(super) p: &'a [f32],
    pub(super) bs: usize,
    /// Slots each row sees.
    pub(super) visible: &'a [usize; ROWS],
    /// Factor each row's output so far is scaled by first.
    pub(super) rescale: &'a [f32; ROWS],
}

/// Adds `NR` rows' weighted sums of one block's values (`v`, `head_dim` per slot)
/// into their outputs `out` (`NR` rows of `head_dim`), after scaling each by its
/// rescale factor. A row's operations and their order do not depend on `NR`, so a
/// row's result is the same whichever rows share its run. `HD` is `head_dim` when
/// known at compile time, 0 otherwise.
#[inline(always)]
fn add_values<const HD: usize, const NR: usize>(w: &BlockWeights<'_>, v: &[f32], out: &mut [f32]) {
    let hd = out.len() / NR;
    let most = w.visible[..NR].iter().copied().max().unwrap_or(0);
    if HD > 0 {
        // Local accumulators stay in vector registers across the block's slots.
        let mut acc = [[0f32; HD]; NR];
        for (j, a) in acc.iter_mut().enumerate() {
            a.copy_from_slice(&out[j * HD..][..HD]);
            if w.rescale[j] != 1.0 {
                for x in a.iter_mut() {
                    *x *= w.rescale[j];
                }
            }
        }
        for (slot, vs) in v.chunks_exact(HD).take(most).enumerate() {
            for (j, a) in acc.iter_mut().enumerate() {
                if slot < w.visible[j] {
                    let p = w.p[j * w.bs + slot];
                    for d in 0..HD {
                        a[d] = p.mul_add(vs[d], a[d]);
                    }
                }
            }
        }
        for (j, a) in acc.iter().enumerate() {
            out[j * HD..][..HD].copy_from_slice(a);
        }
    } else {
        for (j, o) in out.chunks_exact_mut(hd).enumerate() {
            if w.rescale[j] != 1.0 {
                for x in o.iter_mut() {
                    *x *= w.rescale[j];
                }
            }
            let p = &w.p[j * w.bs..][..w.visible[j]];
            for (&p, vs) in p.iter().zip(v.chunks_exact(hd)) {
                axpy(o, p, vs);
            }
        }
    }
}

/// `f` folded over the first `N` values of `x` as a fixed tree (halves combined
/// pairwise), so it vectorizes and rounds the same way on every instruction set.
#[inline(always)]
fn reduce<const N: usize>(x: &[f32], f: impl Fn(f32, f32) -> f32) -> f32 {
    let mut m = [0f32; N];
    m.copy_from_slice(&x[..N]);
    let mut w = N;
    while w > 1 {
        let half = w / 2;
        for i in 0..half {
            m[i] = f(m[i], m[w - 1 - i]);
        }
        w -= half;
    }
    m[0]
}

/// [`attend_impl`] compiled for `isa` (the plain Rust for
/// [`super::Isa::Scalar`]).
///
/// # Panics
/// As [`attend_tile_impl`]; and when `isa` is not available on this CPU.
pub fn attend(isa: super::Isa, tile: &AttnTile<'_>, scratch: &mut AttnScratch, out: &mut [f32]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        super::Isa::Avx512Vnni => super::avx512::attend(tile, scratch, out),
        #[cfg(target_arch = "x86_64")]
        super::Isa::Avx2 => super::avx2::attend(tile, scratch, out),
        _ => attend_impl(tile, scratch, out, F16Ops::portable()),
    }
}

/// Scores of `NR` query rows (`q`, `hd` each, already scaled) against one key block
/// (`k`, transposed `[dim][slot]`, `bs` slots) into `out` (`NR` rows of `bs`). Each
/// score sums over dimensions in order. `BS`/`HD` are `bs`
/// and `hd` when known at compile time, 0 otherwise.
#[inline(always)]
fn score_rows<const BS: usize, const HD: usize, const NR: usize>(
    q: &[f32],
    k: &[f32],
    (bs, hd): (usize, usize),
    out: &mut [f32],
) {
    if BS > 0 && HD > 0 {
        // Fixed-size accumulators stay in vector registers, and each key row loaded
        // serves all NR query rows. Each row sums even and odd dimensions apart and
        // adds the two at the end: one sum was a chain of HD dependent
        // multiply-adds, each waiting for the last.
        let mut even = [[0f32; BS]; NR];
        let mut odd = [[0f32; BS]; NR];
        let k = &k[..HD * BS];
        // Rows of exactly HD, so indexing them by d < HD needs no bounds checks.
        let q: [&[f32]; NR] = std::array::from_fn(|j| &q[j * HD..][..HD]);
        for d in (0..HD - 1).step_by(2) {
            let (r0, r1) = (&k[d * BS..][..BS], &k[(d + 1) * BS..][..BS]);
            for j in 0..NR {
                let (q0, q1) = (q[j][d], q[j][d + 1]);
                for s in 0..BS {
                    even[j][s] = q0.mul_add(r0[s], even[j][s]);
                    odd[j][s] = q1.mul_add(r1[s], odd[j][s]);
                }
            }
        }
        if HD % 2 == 1 {
            let r0 = &k[(HD - 1) * BS..][..BS];
            for j in 0..NR {
                let q0 = q[j][HD - 1];
                for s in 0..BS {
                    even[j][s] = q0.mul_add(r0[s], even[j][s]);
                }
            }
        }
        for ((o, e), od) in out.chunks_exact_mut(BS).zip(&even).zip(&odd) {
            for s in 0..BS {
                o[s] = e[s] + od[s];
            }
        }
    } else {
        for j in 0..NR {
            let dst = &mut out[j * bs..][..bs];
            dst.fill(0.0);
            for (row, &qd) in k.chunks_exact(bs).zip(&q[j * hd..][..hd]) {
                for (a, k) in dst.iter_mut().zip(row) {
                    *a = qd.mul_add(*k, *a);
                }
            }
        }
    }
}

#[cfg(test)]
#[path = "attention_tests.rs"]
mod tests;
