//! The tiled attention kernel against a naive reference: dequantize the f16 store,
//! score every visible position in f64, take the full softmax, sum the values.
//!
//! Tolerance: `2e-6 * (1 + max|v|)` absolute per output. The kernel's scores are f32
//! sums of `head_dim` products (relative error ~`head_dim * 2^-24`, about 4e-6 of
//! `|q||k|` at 64 dims, and our scores stay under ~8), so each weight `exp(s - max)`
//! is off by ~1e-6 relative; the output, a convex combination of values, then moves
//! by ~1e-6 of `max|v|`, plus f32 rounding of the running sums.

use half::f16;
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::kernels::Isa;

/// One problem: a pool of random blocks, a scattered block table, a tile.
struct Case {
    layout: KvLayout,
    kv: Vec<f16>,
    table: Vec<u32>,
    pos: usize,
    tokens: usize,
    kv_head: usize,
    group: usize,
    q: Vec<f32>,
    q_stride: usize,
}

impl Case {
    fn new(geometry: (usize, usize, usize, usize), pos: usize, tokens: usize, seed: u64) -> Self {
        let (block_size, head_dim, kv_heads, group) = geometry;
        let layout = KvLayout {
            block_size,
            kv_heads,
            head_dim,
        };
        let mut r = StdRng::seed_from_u64(seed);
        let needed = (pos + tokens).div_ceil(block_size);
        let blocks = needed + 3;
        let kv = (0..blocks * layout.block_elems())
            .map(|_| f16::from_f32(r.random_range(-2.0f32..2.0)))
            .collect();
        // A scattered table: the tile's blocks are not in order in the pool.
        let mut pool: Vec<u32> = (0..blocks as u32).collect();
        for i in (1..pool.len()).rev() {
            pool.swap(i, r.random_range(0..=i));
        }
        let table = pool[..needed].to_vec();
        let q_stride = kv_heads * group * head_dim;
        let q = (0..tokens * q_stride)
            .map(|_| r.random_range(-1.5f32..1.5))
            .collect();
        Self {
            layout,
            kv,
            table,
            pos,
            tokens,
            kv_head: r.random_range(0..kv_heads),
            group,
            q,
            q_stride,
        }
    }

    fn tile(&self) -> AttnTile<'_> {
        let width = self.group * self.layout.head_dim;
        AttnTile {
            layer: &self.kv,
            layout: self.layout,
            table: &self.table,
            pos: self.pos,
            tokens: self.tokens,
            kv_head: self.kv_head,
            group: self.group,
            q: &self.q[self.kv_head * width..],
            q_stride: self.q_stride,
            scale: 1.0 / (self.layout.head_dim as f32).sqrt(),
            // Requests (hints only) that run the next-tile path on every case.
            next: Some(NextTile {
                table: &self.table,
                kv_head: (self.kv_head + 1) % self.layout.kv_heads,
                last: self.pos + self.tokens - 1,
            }),
        }
    }

    /// Every output row in f64, and the largest `|v|` in the store.
    fn reference(&self) -> (Vec<f64>, f64) {
        let l = self.layout;
        let (bs, hd) = (l.block_size, l.head_dim);
        let t = self.tile();
        let at = |p: usize, v: bool, d: usize| {
            let base = l.offset(self.table[p / bs] as usize, v, self.kv_head);
            let e = if v {
                base + (p % bs) * hd + d
            } else {
                base + d * bs + p % bs
            };
            f64::from(self.kv[e].to_f32())
        };
        let mut out = Vec::new();
        for i in 0..self.tokens {
            let ctx = self.pos + i + 1;
            for h in 0..self.group {
                let q = &t.q[i * t.q_stride + h * hd..][..hd];
                // The kernel's input transform (llama.cpp's f16 Q), then exact math.
                let q: Vec<f64> = q
                    .iter()
                    .map(|&x| f64::from(crate::kernels::quant::round_f16(x) * t.scale))
                    .collect();
                let scores: Vec<f64> = (0..ctx)
                    .map(|p| (0..hd).map(|d| q[d] * at(p, false, d)).sum())
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = w.iter().sum();
                for d in 0..hd {
                    out.push((0..ctx).map(|p| w[p] * at(p, true, d)).sum::<f64>() / total);
                }
            }
        }
        let vmax = self
            .kv
            .iter()
            .map(|v| f64::from(v.to_f32().abs()))
            .fold(0.0, f64::max);
        (out, vmax)
    }

    fn run(&self, isa: Isa) -> Vec<f32> {
        let mut out = vec![f32::NAN; self.tokens * self.group * self.layout.head_dim];
        attend(isa, &self.tile(), &mut AttnScratch::default(), &mut out);
        out
    }
}

fn assert_matches_reference(case: &Case) {
    let (want, vmax) = case.reference();
    let tol = 2e-6 * (1.0 + vmax);
    for isa in Isa::all_available() {
        let got = case.run(isa);
        for (k, (&g, &w)) in got.iter().zip(&want).enumerate() {
            let hd = case.layout.head_dim;
            let (row, d) = (k / hd, k % hd);
            assert!(
                (f64::from(g) - w).abs() <= tol,
                "{isa:?}: token {} head {} dim {d}: {g} vs {w} (tolerance {tol})",
                row / case.group,
                row % case.group,
            );
        }
    }
}

/// (block size, head dim, KV heads, group): the model's geometry (the compiled
/// fast path), its head size with odd blocks, and small heads.
const GEOMETRIES: [(usize, usize, usize, usize); 6] = [
    (16, 64, 3, 3),
    (16, 64, 1, 1),
    (5, 64, 2, 3),
    (16, 8, 2, 1),
    (3, 4, 1, 3),
    (1, 8, 2, 3),
];

proptest! {
    #[test]
    fn tiled_attention_matches_the_naive_reference(
        geometry in proptest::sample::select(&GEOMETRIES[..]),
        pos in 0usize..70,
        tokens in 1usize..=20,
        seed in any::<u64>(),
    ) {
        assert_matches_reference(&Case::new(geometry, pos, tokens, seed));
    }
}

#[test]
fn edge_tiles_match_the_naive_reference() {
    for (geometry, pos, tokens) in [
        // A prefill chunk from position 0 whose end is mid-block.
        ((16, 64, 3, 3), 0, 37),
        // A tile starting mid-block and crossing two block edges.
        ((16, 64, 3, 3), 13, 20),
        // Decode: one token, context one past a block edge.
        ((16, 64, 3, 3), 16, 1),
        // More rows than one register block, ending on a partial one.
        ((16, 64, 1, 1), 30, 7),
        ((3, 4, 2, 3), 4, 11),
    ] {
        assert_matches_reference(&Case::new(geometry, pos, tokens, 42));
    }
}

#[test]
fn slots_past_the_context_are_never_read_into_the_result() {
    // Stale keys and values past the last token (another sequence's, or inf/NaN
    // garbage) must not change anything: the same case with them poisoned gives
    // bit-identical outputs.
    for tokens in [9, 1] {
        poisoned_slots_change_nothing(tokens);
    }
}

fn poisoned_slots_change_nothing(tokens: usize) {
    let clean = Case::new((16, 64, 3, 3), 5, tokens, 7);
    let mut poisoned = Case::new((16, 64, 3, 3), 5, tokens, 7);
    let l = poisoned.layout;
    let last = poisoned.pos + poisoned.tokens - 1;
    let block = poisoned.table[last / l.block_size] as usize;
    for slot in last % l.block_size + 1..l.block_size {
        for h in 0..l.kv_heads {
            for d in 0..l.head_dim {
                poisoned.kv[l.offset(block, false, h) + d * l.block_size + slot] = f16::INFINITY;
                poisoned.kv[l.offset(block, true, h) + slot * l.head_dim + d] = f16::NAN;
            }
        }
    }
    for isa in Isa::all_available() {
        assert_eq!(
            clean.run(isa),
            poisoned.run(isa),
            "{isa:?}, {tokens} tokens"
        );
    }
}

#[test]
fn every_isa_gives_the_same_bits() {
    // Same operations in the same order on every path (each fused multiply-add
    // rounds once everywhere),
    // so forcing an instruction set never changes a token.
    // A prefill tile, and tiles of one pass (a decode's group of 3 heads, and 1 to 4
    // rows of one head), which AVX-512 reads straight from f16.
    let cases = [
        ((16, 64, 3, 3), 21, 16),
        ((16, 64, 3, 3), 21, 1),
        ((16, 64, 3, 3), 15, 1),
        ((16, 64, 3, 3), 16, 1),
        ((16, 64, 2, 1), 40, 1),
        ((16, 64, 2, 1), 40, 2),
        ((16, 64, 2, 1), 47, 3),
        ((16, 64, 2, 1), 0, 4),
    ];
    for (geometry, pos, tokens) in cases {
        let case = Case::new(geometry, pos, tokens, 3);
        let scalar = case.run(Isa::Scalar);
        for isa in Isa::all_available() {
            assert_eq!(
                case.run(isa),
                scalar,
                "{isa:?} {geometry:?} pos {pos} tokens {tokens}"
            );
        }
    }
}

#[test]
fn a_tile_equals_its_tokens_one_at_a_time() {
    // Prefill tiles and decode steps see the same numbers: each row's result does
    // not depend on which other rows share its tile.
    let case = Case::new((16, 64, 3, 3), 3, 19, 11);
    let whole = case.run(Isa::detect());
    let width = case.group * case.layout.head_dim;
    for i in 0..case.tokens {
        let t = case.tile();
        let one = AttnTile {
            pos: case.pos + i,
            tokens: 1,
            q: &t.q[i * t.q_stride..],
            ..t
        };
        let mut out = vec![0f32; width];
        attend(Isa::detect(), &one, &mut AttnScratch::default(), &mut out);
        assert_eq!(out, whole[i * width..(i + 1) * width], "token {i}");
    }
}

#[test]
fn exp_is_within_one_epsilon_of_exp() {
    use crate::kernels::ops::exp;
    assert_eq!(exp(0.0), 1.0, "a softmax row's maximum weighs exactly 1");
    assert_eq!(exp(f32::NEG_INFINITY), 0.0);
    assert_eq!(exp(-100.0), 0.0);
    assert_eq!(
        exp(f32::INFINITY),
        exp(88.0),
        "saturates instead of overflowing"
    );
    assert!(exp(88.0).is_finite());
    let mut worst = 0f64;
    // Every 97th f32 in (-87, 88): all exponents, many mantissas.
    let mut x = f32::from_bits((-87.0f32).to_bits() - 1);
    let mut step = |x: f32| {
        let want = f64::from(x).exp();
        let eps = f64::from(f32::EPSILON) * want;
        worst = worst.max((f64::from(exp(x)) - want).abs() / eps);
    };
    while x < 0.0 {
        step(x);
        x = f32::from_bits(x.to_bits() - 97);
    }
    let mut x = f32::MIN_POSITIVE;
    while x < 88.0 {
        step(x);
        x = f32::from_bits(x.to_bits() + 97);
    }
    assert!(worst <= 1.0, "relative error {worst} x 2^-23");
}

#[test]
fn every_path_widens_every_f16_as_the_portable_conversion_does() {
    let all: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
    let mut want = vec![0f32; all.len()];
    widen_portable(&all, &mut want);
    let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
    for isa in Isa::all_available() {
        let widen = widen_for(isa);
        // Whole vectors, tails shorter than one, and starts off any alignment.
        for (start, len) in [(0, all.len()), (3, 37), (1, 15), (5, 0), (65_000, 536)] {
            let mut got = vec![f32::NAN; len];
            widen(&all[start..][..len], &mut got);
            for (i, (&g, &w)) in got.iter().zip(&want[start..]).enumerate() {
                assert!(
                    same(g, w),
                    "{isa:?}: f16 bits {:#06x} became {g} (bits {:#010x}), not {w}",
                    start + i,
                    g.to_bits()
                );
            }
        }
    }
}
