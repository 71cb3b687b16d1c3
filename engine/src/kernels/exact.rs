//! Exact, order-independent sums for row-parallel products (issue #15): the
//! attention output and MLP down projections, whose input columns a tensor group
//! splits over its ranks.
//!
//! Why: a float sum depends on its order. One process sums a row's K blocks in one
//! run; a tensor rank sums only its blocks and the all-reduce adds the ranks'
//! partials. The difference (about 1e-7 relative) is tiny, but the next product
//! re-quantizes its input to int8, so it moves an element across a rounding boundary
//! now and then, and 30 layers amplify that to a max |Δlogit| of about 2 on
//! SmolLM2-135M (26 of 1004 teacher-forced positions changed their top-1).
//!
//! How: every block's contribution is computed in f32 as before, by the same
//! operations on every instruction set and in every process (the same weights and
//! the same quantized activations give the same bits), then rounded to i64 fixed
//! point with [`FRAC_BITS`] fraction bits. Integer addition is associative, so the
//! sum of a row's terms is the same whatever the order and grouping: one process,
//! any tensor split, any all-reduce order. The total becomes f32 once, at the end
//! ([`to_f32`]).
//!
//! The contribution of block `b` to row `r` of activation row `t`, scaled by
//! 2^[`FRAC_BITS`] (exact: a power of two, and `d·d_x`, `m·s_x` are products of f16
//! values, exact in f32):
//! - Q4_1 nibbles: `fma(d · (d_x · 2^F), isum, m · (s_x · 2^F))`
//! - Q8_0 bytes: `(d · (d_x · 2^F)) · (isum − 128 · qsum)`
//!
//! then clamped to ±[`TERM_LIMIT`] (x86 `max`/`min` semantics, so a NaN becomes
//! the lower bound on every path) and rounded to the nearest integer, ties to even.
//!
//! Range: a term is at most 2^51 (a block contributing at most 2^19 = 524,288 to
//! an output, far past what any real model's 32-column block does; larger ones
//! saturate there), and a row sums at most [`MAX_TERMS`] of them, so no total can
//! overflow: 2^11 · 2^51 = 2^62 (inputs of up to 65,536 columns; wider ones are
//! refused). Precision: each term is rounded to 2^-33 absolute, so a 1,536-column
//! row is within 48 · 2^-33 ≈ 5.6e-9 of its f32 terms' exact sum — below an f32 ulp
//! of any output above 1/16, and far below the int8 activation rounding every product
//! already has.
//!
//! Cost: exact sums replace one FMA per block and row by an FMA, a clamp, two
//! conversions and two 64-bit adds per 16 rows; see [`crate::backend::cpu`] for
//! where they run and what they cost.

/// Fraction bits of the fixed-point sums.
pub const FRAC_BITS: u32 = 32;

/// 2^[`FRAC_BITS`]: the factor a term is computed at.
pub const SCALE: f32 = (1u64 << FRAC_BITS) as f32;

/// The largest term magnitude, scaled: 2^51 (a contribution of 2^19).
pub const TERM_LIMIT: f32 = (1u64 << 51) as f32;

/// The most terms (blocks) one exact sum adds: 2^62 / [`TERM_LIMIT`].
pub const MAX_TERMS: usize = 1 << 11;

/// 1.5 · 2^52: adding it to an f64 of magnitude at most 2^51 leaves no fraction
/// bits, so the FPU's rounding (to nearest, ties to even) makes it an integer whose
/// bit pattern, less this constant's, is that integer.
pub(super) const MAGIC: f64 = 6_755_399_441_055_744.0;

/// A term already scaled by [`SCALE`], clamped and rounded to fixed point: what
/// every SIMD path computes lane by lane (AVX-512 with `vcvtps2qq`, AVX2 with the
/// [`MAGIC`] addition).
#[inline]
#[must_use]
pub fn fixed(scaled: f32) -> i64 {
    // `a > b ? a : b` and `a < b ? a : b`, as `maxps`/`minps`: a NaN takes the bound.
    let c = if scaled > -TERM_LIMIT {
        scaled
    } else {
        -TERM_LIMIT
    };
    let c = if c < TERM_LIMIT { c } else { TERM_LIMIT };
    (f64::from(c) + MAGIC)
        .to_bits()
        .cast_signed()
        .wrapping_sub(MAGIC.to_bits().cast_signed())
}

/// A fixed-point total as f32, rounded once.
#[inline]
#[must_use]
pub fn to_f32(v: i64) -> f32 {
    v as f32 * (1.0 / SCALE)
}

/// Adds `other` to `acc` element-wise. Wrapping, so the result does not depend on
/// the order even for values no kernel produces (a corrupt peer's), and never panics.
pub fn add(acc: &mut [i64], other: &[i64]) {
    for (a, b) in acc.iter_mut().zip(other) {
        *a = a.wrapping_add(*b);
    }
}

/// The f32 value of every fixed-point total in `from`, into `out` (of the same length).
pub fn to_f32_slice(from: &[i64], out: &mut [f32]) {
    for (o, v) in out.iter_mut().zip(from) {
        *o = to_f32(*v);
    }
}
