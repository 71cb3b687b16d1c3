//! Float element-wise operations of the llama forward pass, written as ggml writes
//! them (same formulas and accumulation precision) so results stay close to
//! llama.cpp's.

use rayon::prelude::*;

/// RMSNorm of each `dim`-sized row of `x` into `out`, times `weight`:
/// `out = x / sqrt(mean(x²) + eps) * weight` (sum of squares in f64, like ggml).
///
/// # Panics
/// When `weight.len() != dim` or the buffers are not whole rows of equal length.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let dim = weight.len();
    assert!(dim > 0 && x.len() == out.len() && x.len().is_multiple_of(dim));
    // Runs of NORM_ROWS rows in parallel on the current pool: a prompt's norms on one
    // thread left the other idle for 3 % of prompt processing. A decode step's 16
    // rows are two runs, too little to split.
    x.par_chunks(NORM_ROWS * dim)
        .zip(out.par_chunks_mut(NORM_ROWS * dim))
        .with_min_len(2)
        .for_each(|(xr, or)| {
            let sums = if xr.len() == NORM_ROWS * dim {
                sum_squares::<NORM_ROWS>(xr, dim)
            } else {
                // The last run, shorter: its rows one at a time.
                let mut sums = [0f64; NORM_ROWS];
                for (sum, row) in sums.iter_mut().zip(xr.chunks_exact(dim)) {
                    [*sum] = sum_squares::<1>(row, dim);
                }
                sums
            };
            for ((xr, or), &sum) in xr
                .chunks_exact(dim)
                .zip(or.chunks_exact_mut(dim))
                .zip(&sums)
            {
                let mean = (sum / dim as f64) as f32;
                let scale = 1.0 / (mean + eps).sqrt();
                for ((o, &v), &w) in or.iter_mut().zip(xr).zip(weight) {
                    *o = v * scale * w;
                }
            }
        });
}

/// Rows whose sums of squares [`rms_norm`] advances together.
const NORM_ROWS: usize = 8;

/// The sums of squares of the `R` rows of `x` (`dim` each), each in order
/// in f64 as ggml sums: one row's sum is a chain of dependent adds, which left the
/// core waiting on each; `R` rows side by side are `R` chains at once, each summed
/// exactly as alone (a decode step of 16 rows: 3–4 µs less per norm).
#[inline(always)]
fn sum_squares<const R: usize>(x: &[f32], dim: usize) -> [f64; R] {
    let rows: [&[f32]; R] = std::array::from_fn(|r| &x[r * dim..(r + 1) * dim]);
    let mut acc = [0f64; R];
    for i in 0..dim {
        for (a, row) in acc.iter_mut().zip(&rows) {
            let v = f64::from(row[i]);
            *a += v * v;
        }
    }
    acc
}

/// `x += y`.
///
/// # Panics
/// When the lengths differ.
pub fn add_in_place(x: &mut [f32], y: &[f32]) {
    assert_eq!(x.len(), y.len());
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// `e^x` in plain arithmetic, so a loop of them vectorizes (libm's `expf` is a call
/// per element): the softmax's weights and SiLU's sigmoid. Cephes' `expf`:
/// `x = n ln2 + r` with `|r| <= ln2 / 2` (ln 2 split in two constants, Cody-Waite), a
/// degree-5 polynomial for `e^r`, times `2^n` built in the exponent bits. Relative
/// error below 2^-23 (tested; measured 0.7 × 2^-23). Saturates: 0 from -87 down,
/// where `e^x < 2^-125` is nothing beside a softmax row's largest weight of 1, and
/// for `-inf` and NaN; `e^88` from 88 up (`e^x` overflows f32 past 88.7), which
/// leaves `1 / (1 + e^x)` at 0 to f32 precision.
#[inline(always)]
#[must_use]
pub fn exp(x: f32) -> f32 {
    // Adding 1.5 * 2^23 rounds to an integer, which lands in the low mantissa bits.
    const SHIFTER: f32 = 12_582_912.0;
    let xc = if x > -87.0 { x } else { -87.0 };
    let xc = if xc < 88.0 { xc } else { 88.0 };
    let t = xc * std::f32::consts::LOG2_E + SHIFTER;
    let n = t - SHIFTER;
    let r = xc - n * 0.693_359_4 - n * -2.121_944_4e-4;
    let mut p = 1.987_569_2e-4;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // n is in -126..=127 here, so n + 127 is a normal exponent.
    let biased = t.to_bits().wrapping_sub(0x4B40_0000).wrapping_add(127);
    let scaled = y * f32::from_bits(biased << 23);
    if x > -87.0 { scaled } else { 0.0 }
}

/// SwiGLU on a fused `[gate | up]` row layout: for each row of `2 * ffn` values,
/// `out = silu(gate) * up` with `silu(g) = g / (1 + e^-g)`.
///
/// # Panics
/// When `gate_up` is not `2 * ffn` times the rows of `out`.
pub fn swiglu(gate_up: &[f32], ffn: usize, out: &mut [f32]) {
    assert!(ffn > 0 && gate_up.len() == 2 * out.len() && out.len().is_multiple_of(ffn));
    // Rows in parallel on the current pool: a prompt's rows are megabytes, too
    // much for one thread to stream while the others wait.
    gate_up
        .par_chunks_exact(2 * ffn)
        .zip(out.par_chunks_exact_mut(ffn))
        .with_min_len(16)
        .for_each(|(gu, o)| {
            let (g, u) = gu.split_at(ffn);
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                *o = silu_mul(g, u);
            }
        });
}

/// One SwiGLU output from its gate and up values: `silu(g) * u`, `silu(g) = g / (1 +
/// e^-g)`. [`swiglu`] and the fused product (`kernels::matmul_swiglu`) both use it,
/// so they give the same bits.
#[inline(always)]
#[must_use]
pub fn silu_mul(g: f32, u: f32) -> f32 {
    g / (1.0 + exp(-g)) * u
}

/// `gate[i] = silu_mul(gate[i], up[i])`, for the instruction sets' copies to compile
/// (`avx512::silu_mul_in_place`, `avx2::silu_mul_in_place`): the same operations in
/// the same order, so the same bits, 16 or 8 lanes at a time.
///
/// # Panics
/// When the slices differ in length.
#[inline(always)]
pub fn silu_mul_in_place_impl(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "SwiGLU of gate and up of two lengths");
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = silu_mul(*g, u);
    }
}

/// Cosines and sines of ggml's "normal" RoPE for one position: pair `i` (dims `2i`,
/// `2i+1`) rotates by `pos * base^(-2i/n_dims)`. The angle is advanced by repeated
/// f32 multiplication, as ggml does, to round the same way.
#[must_use]
pub fn rope_table(pos: usize, n_dims: usize, freq_base: f32) -> Vec<(f32, f32)> {
    let theta_scale = freq_base.powf(-2.0 / n_dims as f32);
    let mut theta = pos as f32;
    (0..n_dims / 2)
        .map(|_| {
            let cs = (theta.cos(), theta.sin());
            theta *= theta_scale;
            cs
        })
        .collect()
}

/// Rotates every `head_dim` head of `x` in place with `table` (from [`rope_table`]),
/// rotating adjacent pairs (`x[2i]`, `x[2i+1]`) — ggml's normal mode, which the
/// permuted Q/K weights in llama GGUF files expect. Dimensions past the table stay.
///
/// # Panics
/// When `x` is not a whole number of heads or the table is wider than a head.
pub fn rope_in_place(x: &mut [f32], head_dim: usize, table: &[(f32, f32)]) {
    assert!(head_dim > 0 && x.len().is_multiple_of(head_dim) && table.len() * 2 <= head_dim);
    for head in x.chunks_exact_mut(head_dim) {
        for (pair, &(c, s)) in head.chunks_exact_mut(2).zip(table) {
            let (x0, x1) = (pair[0], pair[1]);
            pair[0] = x0 * c - x1 * s;
            pair[1] = x0 * s + x1 * c;
        }
    }
}

/// Numerically stable in-place softmax.
pub fn softmax_in_place(x: &mut [f32]) {
    let max = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let mut sum = 0f64;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += f64::from(*v);
    }
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// Log-softmax of `x` (for scoring): `x - max - ln(sum(exp(x - max)))`.
#[must_use]
pub fn log_softmax(x: &[f32]) -> Vec<f32> {
    let max = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let sum: f64 = x.iter().map(|&v| f64::from(v - max).exp()).sum();
    let lse = max as f64 + sum.ln();
    x.iter().map(|&v| (f64::from(v) - lse) as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_unit_rows() {
        let x = [3.0, 4.0, 0.0, 0.0];
        let mut out = [0.0; 4];
        rms_norm(&x, &[1.0, 1.0, 2.0, 2.0], 0.0, &mut out);
        let s = 1.0 / (25.0f32 / 4.0).sqrt();
        assert_eq!(out, [3.0 * s, 4.0 * s, 0.0, 0.0]);
    }

    #[test]
    fn rms_norm_rows_side_by_side_equal_each_row_alone() {
        // 21 rows: two runs of eight summed side by side, then five alone.
        let dim = 96;
        let x: Vec<f32> = (0..21 * dim)
            .map(|i| ((i * 7919) % 1000) as f32 / 37.0 - 13.0)
            .collect();
        let weight: Vec<f32> = (0..dim).map(|i| 0.5 + i as f32 / 64.0).collect();
        let mut out = vec![0.0; x.len()];
        rms_norm(&x, &weight, 1e-5, &mut out);
        for (xr, or) in x.chunks_exact(dim).zip(out.chunks_exact(dim)) {
            let sum: f64 = xr.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
            let scale = 1.0 / ((sum / dim as f64) as f32 + 1e-5).sqrt();
            let alone: Vec<f32> = xr
                .iter()
                .zip(&weight)
                .map(|(&v, &w)| v * scale * w)
                .collect();
            assert_eq!(or, &alone[..]);
        }
    }

    #[test]
    fn rope_rotates_pairs_and_preserves_norm() {
        let table = rope_table(3, 4, 10000.0);
        let mut x = [1.0, 0.0, 0.0, 1.0];
        rope_in_place(&mut x, 4, &table);
        assert!((x[0] - 3f32.cos()).abs() < 1e-6 && (x[1] - 3f32.sin()).abs() < 1e-6);
        let th = 3.0 * 10000f32.powf(-0.5);
        assert!((x[2] + th.sin()).abs() < 1e-5 && (x[3] - th.cos()).abs() < 1e-5);
        let zero = rope_table(0, 4, 10000.0);
        assert!(zero.iter().all(|&(c, s)| c == 1.0 && s == 0.0));
    }

    #[test]
    fn softmax_sums_to_one_and_log_softmax_agrees() {
        let mut x = vec![1.0, 2.0, 3.0, -1000.0];
        let ls = log_softmax(&x);
        softmax_in_place(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        for (p, l) in x.iter().zip(&ls) {
            assert!((p - l.exp()).abs() < 1e-6);
        }
    }

    #[test]
    fn swiglu_matches_formula() {
        let gu = [1.0, -2.0, 3.0, 4.0];
        let mut out = [0.0; 2];
        swiglu(&gu, 2, &mut out);
        assert!((out[0] - 3.0 / (1.0 + (-1f32).exp())).abs() < 1e-6);
        assert!((out[1] - 4.0 * -2.0 / (1.0 + 2f32.exp())).abs() < 1e-6);
    }
}
