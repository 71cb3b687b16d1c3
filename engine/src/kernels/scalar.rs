//! Portable integer kernel over the packed layout: the fallback on CPUs without
//! AVX-512 VNNI and the twin the SIMD kernel is tested against. It computes the same
//! integer block sums and the same scale arithmetic, one lane at a time.

use std::ops::Range;

use super::exact;
use super::pack::{GROUP, PackedKind, PackedMatrix, QuantActs};
use super::quant::QK;

/// Computes row group `g` of `w` times the activation rows `acts` of `x` into
/// `out[(t - acts.start) * GROUP + lane]`.
///
/// # Panics
/// When the shapes disagree (an internal invariant of [`super::matmul`]).
pub fn group(w: &PackedMatrix, g: usize, x: &QuantActs, acts: Range<usize>, out: &mut [f32]) {
    assert!(x.cols == w.cols() && g < w.groups() && acts.end <= x.n);
    assert!(out.len() >= acts.len() * GROUP);
    let nb = w.nblocks();
    let stride = w.stride();
    let kind = w.kind();
    let gdata = &w.data()[g * w.group_bytes()..][..w.group_bytes()];
    for (i, t) in acts.enumerate() {
        for lane in 0..GROUP {
            let mut acc = 0f32;
            for b in 0..nb {
                let blk = &gdata[b * stride..][..stride];
                let isum = block_isum(kind, blk, lane, x, t, b);
                let bi = t * nb + b;
                let (d, m) = PackedMatrix::scales_in_block(blk, lane);
                match kind {
                    PackedKind::Nibble => {
                        acc += d * x.d[bi] * isum as f32;
                        acc += m * x.s[bi];
                    }
                    PackedKind::Byte => {
                        acc += d * x.d[bi] * (isum - 128 * x.qsum[bi]) as f32;
                    }
                }
            }
            out[i * GROUP + lane] = acc;
        }
    }
}

/// [`group`] with exact sums: each block's term as [`exact`] defines it, summed in
/// fixed point, into `out[(t - acts.start) * GROUP + lane]`.
///
/// # Panics
/// When the shapes disagree (an internal invariant of [`super::matmul_exact`]).
pub fn group_exact(w: &PackedMatrix, g: usize, x: &QuantActs, acts: Range<usize>, out: &mut [i64]) {
    assert!(x.cols == w.cols() && g < w.groups() && acts.end <= x.n);
    assert!(out.len() >= acts.len() * GROUP);
    let nb = w.nblocks();
    let stride = w.stride();
    let kind = w.kind();
    let gdata = &w.data()[g * w.group_bytes()..][..w.group_bytes()];
    for (i, t) in acts.enumerate() {
        for lane in 0..GROUP {
            let mut acc = 0i64;
            for b in 0..nb {
                let blk = &gdata[b * stride..][..stride];
                let isum = block_isum(kind, blk, lane, x, t, b);
                let bi = t * nb + b;
                let (d, m) = PackedMatrix::scales_in_block(blk, lane);
                let dx = d * (x.d[bi] * exact::SCALE);
                let term = match kind {
                    PackedKind::Nibble => dx.mul_add(isum as f32, m * (x.s[bi] * exact::SCALE)),
                    PackedKind::Byte => dx * (isum - 128 * x.qsum[bi]) as f32,
                };
                acc = acc.wrapping_add(exact::fixed(term));
            }
            out[i * GROUP + lane] = acc;
        }
    }
}

/// The integer dot product of row lane `lane`'s quants in block `blk` with block
/// `b` of activation row `t` (unsigned weights, before any offset correction).
fn block_isum(kind: PackedKind, blk: &[u8], lane: usize, x: &QuantActs, t: usize, b: usize) -> i32 {
    let xq = &x.q[t * x.cols + b * QK..][..QK];
    let mut isum = 0i32;
    for (k, &q) in xq.iter().enumerate() {
        isum += i32::from(PackedMatrix::quant_in_block(kind, blk, lane, k)) * i32::from(q);
    }
    isum
}
