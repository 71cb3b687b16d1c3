//! CPU compute kernels: ggml block formats, repacked integer matrix products with
//! 8-bit activations (AVX-512 VNNI, else AVX2, else a portable fallback, chosen at run
//! time), and
//! the float helpers of the forward pass.
//!
//! Invariant: every product path computes the same integer block sums as the scalar
//! kernel, which is tested against plain dequantize-then-multiply; the only
//! difference to the exact product is the activation rounding ggml also does.

pub mod attention;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub mod ops;
pub mod pack;
pub mod peak;
#[cfg(target_arch = "x86_64")]
mod peak_x86;
pub mod quant;
mod scalar;
#[cfg(test)]
mod tests;

use rayon::prelude::*;

pub use pack::{GROUP, PackedKind, PackedMatrix, QuantActs, RowSource};
pub use quant::{QK, WeightFormat};

/// Errors from building kernel operands.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// Shapes or byte lengths do not fit together.
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// A format the kernels do not handle.
    #[error("unsupported: {0}")]
    Unsupported(String),
}

/// Instruction set used for the integer products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Portable Rust.
    Scalar,
    /// AVX2 with FMA and F16C (`vpmaddubsw` + `vpmaddwd`).
    Avx2,
    /// AVX-512 with VNNI (`vpdpbusd`).
    Avx512Vnni,
}

impl Isa {
    /// The fastest instruction set this CPU supports.
    #[must_use]
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if avx512::available() {
                return Self::Avx512Vnni;
            }
            if avx2::available() {
                return Self::Avx2;
            }
        }
        Self::Scalar
    }

    /// Every instruction set usable here (for tests that compare them).
    #[must_use]
    pub fn all_available() -> Vec<Self> {
        let mut v = vec![Self::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if avx2::available() {
                v.push(Self::Avx2);
            }
            if avx512::available() {
                v.push(Self::Avx512Vnni);
            }
        }
        v
    }
}

fn group_kernel(isa: Isa, w: &PackedMatrix, g: usize, x: &QuantActs, out: &mut [f32]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => avx512::group(w, g, x, out),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2::group(w, g, x, out),
        _ => scalar::group(w, g, x, out),
    }
}

/// `out[t][r] = sum_k w[r][k] * x[t][k]` for every activation row `t`, rows of `w`
/// split across the current rayon pool.
///
/// `scratch` holds the group-major partial result between the parallel product and
/// the scatter into `out` (kept by the caller so large prompts do not reallocate).
///
/// # Errors
/// [`KernelError::Shape`] when `x.cols != w.cols()` or `out` is not `x.n * w.rows()`.
pub fn matmul(
    isa: Isa,
    w: &PackedMatrix,
    x: &QuantActs,
    scratch: &mut Vec<f32>,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let (n, rows) = (x.n, w.rows());
    if x.cols != w.cols() || out.len() != n * rows {
        return Err(KernelError::Shape(format!(
            "{}×{} weights times {n}×{} activations into {} outputs",
            rows,
            w.cols(),
            x.cols,
            out.len()
        )));
    }
    if n == 0 {
        return Ok(());
    }
    let groups = w.groups();
    let per_group = n * GROUP;
    scratch.resize(groups * per_group, 0.0);
    let threads = rayon::current_num_threads().max(1);
    // Several chunks per thread so an uneven split (or a busy core) evens out.
    let chunk_groups = groups.div_ceil(threads * 4).max(1);
    scratch
        .par_chunks_mut(chunk_groups * per_group)
        .enumerate()
        .for_each(|(ci, buf)| {
            for (k, gbuf) in buf.chunks_exact_mut(per_group).enumerate() {
                group_kernel(isa, w, ci * chunk_groups + k, x, gbuf);
            }
        });
    for (g, gbuf) in scratch.chunks_exact(per_group).enumerate() {
        let r0 = g * GROUP;
        let width = GROUP.min(rows - r0);
        for (t, vals) in gbuf.chunks_exact(GROUP).enumerate() {
            out[t * rows + r0..t * rows + r0 + width].copy_from_slice(&vals[..width]);
        }
    }
    Ok(())
}
