//! Portable integer kernel over the packed layout: the fallback on CPUs without
//! AVX-512 VNNI and the twin the SIMD kernel is tested against. It computes the same
//! integer block sums and the same scale arithmetic, one lane at a time.

use super::pack::{GROUP, PackedKind, PackedMatrix, QuantActs};
use super::quant::QK;

/// Computes row group `g` of `w` times every activation row of `x` into
/// `out[t * GROUP + lane]`.
///
/// # Panics
/// When the shapes disagree (an internal invariant of [`super::matmul`]).
pub fn group(w: &PackedMatrix, g: usize, x: &QuantActs, out: &mut [f32]) {
    assert!(x.cols == w.cols() && out.len() >= x.n * GROUP && g < w.groups());
    let nb = w.nblocks();
    let stride = w.stride();
    let kind = w.kind();
    let gdata = &w.data()[g * w.group_bytes()..][..w.group_bytes()];
    for t in 0..x.n {
        for lane in 0..GROUP {
            let mut acc = 0f32;
            for b in 0..nb {
                let blk = &gdata[b * stride..][..stride];
                let xq = &x.q[t * x.cols + b * QK..][..QK];
                let mut isum = 0i32;
                for (k, &q) in xq.iter().enumerate() {
                    isum +=
                        i32::from(PackedMatrix::quant_in_block(kind, blk, lane, k)) * i32::from(q);
                }
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
            out[t * GROUP + lane] = acc;
        }
    }
}
