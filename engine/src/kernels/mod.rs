//! CPU compute kernels: ggml block formats, repacked integer matrix products with
//! 8-bit activations (AVX-512 VNNI, else AVX2, else a portable fallback, chosen at run
//! time), and
//! the float helpers of the forward pass.
//!
//! Invariant: every product path computes the same integer block sums as the scalar
//! kernel, which is tested against plain dequantize-then-multiply; the only
//! difference to the exact product is the activation rounding ggml also does.
//! [`matmul_exact`] sums the same block terms in fixed point ([`exact`]): its
//! results are the same bits on every path and for any split of the columns.

pub mod attention;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub mod buffer;
pub mod exact;
pub mod ops;
pub mod pack;
pub mod peak;
#[cfg(target_arch = "x86_64")]
mod peak_x86;
#[cfg(target_arch = "x86_64")]
mod probe;
pub mod quant;
mod scalar;
#[cfg(test)]
mod tests;

use std::ops::Range;

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
    /// AVX-512 with VNNI (`vpdpbusd`) and DQ (`vcvtps2qq`, for exact sums).
    Avx512Vnni,
}

impl Isa {
    /// The fastest instruction set that runs here: cpuid reports it and a probe of its
    /// instructions ran in a child process (`kernels::probe`). cpuid alone says what
    /// the CPU has, not what runs in this VM; a set it advertises may still fault with
    /// SIGILL. Probed once per process.
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

    /// Every instruction set usable here, by the same rule as [`Self::detect`] (for
    /// tests that compare them).
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

    /// How it is named in reports.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Scalar => "scalar",
            Self::Avx2 => "AVX2",
            Self::Avx512Vnni => "AVX-512 VNNI",
        }
    }
}

/// Which cache [`prefetch`] fills.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CacheLevel {
    /// Level 1 (`prefetcht0`): for data needed next, already in level 2.
    L1,
    /// Level 2 (`prefetcht1`): for data further ahead, still in memory.
    L2,
}

/// Asks the CPU to bring `data` into `level`, a line at a time, while the caller
/// computes on what it already has: decode's weight groups and KV blocks come from
/// memory, at addresses the hardware prefetcher cannot guess. From memory, ask for
/// level 2: a level-1 request holds one of the core's few level-1 miss buffers until
/// its line arrives, and a block's 32–64 lines asked at once filled them, so the loads
/// behind them waited as if unprefetched (Zen 4: decode attention over KV from memory
/// took 490 ns per block of one head with level-1 requests, 320 with level-2 ones and
/// 290 with the KV in cache).
#[inline(always)]
pub(crate) fn prefetch<T>(data: &[T], level: CacheLevel) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _MM_HINT_T1, _mm_prefetch};
        const LINE: usize = 64;
        let start = data.as_ptr().cast::<i8>();
        for offset in (0..std::mem::size_of_val(data)).step_by(LINE) {
            // SAFETY: `offset` is inside the slice, so the address is in bounds; a
            // prefetch is a hint that never faults and changes nothing a program can
            // observe.
            #[allow(unsafe_code)]
            unsafe {
                let line = start.add(offset);
                match level {
                    CacheLevel::L1 => _mm_prefetch::<_MM_HINT_T0>(line),
                    CacheLevel::L2 => _mm_prefetch::<_MM_HINT_T1>(line),
                }
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (data, level);
}

fn group_kernel(
    isa: Isa,
    w: &PackedMatrix,
    g: usize,
    x: &QuantActs,
    acts: Range<usize>,
    out: &mut [f32],
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => avx512::group(w, g, x, acts, out),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2::group(w, g, x, acts, out),
        _ => scalar::group(w, g, x, acts, out),
    }
}

/// [`ops::silu_mul_in_place_impl`] compiled for `isa`: the same bits on every path.
fn silu_mul_in_place(isa: Isa, gate: &mut [f32], up: &[f32]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => avx512::silu_mul_in_place(gate, up),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2::silu_mul_in_place(gate, up),
        _ => ops::silu_mul_in_place_impl(gate, up),
    }
}

fn group_kernel_exact(
    isa: Isa,
    w: &PackedMatrix,
    g: usize,
    x: &QuantActs,
    acts: Range<usize>,
    out: &mut [i64],
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => avx512::group_exact(w, g, x, acts, out),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2::group_exact(w, g, x, acts, out),
        _ => scalar::group_exact(w, g, x, acts, out),
    }
}

/// Activation rows one task takes: their quants (at most 96 KiB for the widest
/// input, 1,536 columns) stay in L1/L2 while every weight group of the task
/// streams past them. Without this blocking a 512-token prompt streamed all of its
/// activations from far caches once per group: 512-row products ran at 80 GMAC/s
/// against 177 for 16 rows (two threads); blocked, one thread does 295 GMAC per
/// CPU-second at 512 rows and 267 at 16 (AMD EPYC, AVX-512 VNNI, peak 380).
const ROW_BLOCK: usize = 64;

/// `out[t][r] = sum_k w[r][k] * x[t][k]` for every activation row `t`.
///
/// The work is a grid of tasks on the current rayon pool, each a block of up to
/// [`ROW_BLOCK`] activation rows times a run of weight groups (a cache-blocked outer
/// loop as in BLIS: a group's weights stay in L1 across the block's rows, the
/// block's activations in L2 across its groups). Decode-sized batches are one row
/// block, split by groups only.
///
/// # Errors
/// [`KernelError::Shape`] when `x.cols != w.cols()` or `out` is not `x.n * w.rows()`.
pub fn matmul(
    isa: Isa,
    w: &PackedMatrix,
    x: &QuantActs,
    out: &mut [f32],
) -> Result<(), KernelError> {
    check_shapes(w, x, out.len())?;
    grid((w.groups(), w.rows()), x.n, out, 1, |g, acts, tile| {
        group_kernel(isa, w, g, x, acts, tile);
    });
    Ok(())
}

/// The SwiGLU of a stacked `[gate; up]` product: `w` holds `2 * ffn` rows, gate rows
/// first, and `out[t][j] = silu(gate_j · x_t) * (up_j · x_t)` for `j < ffn`
/// ([`ops::silu_mul`], as [`ops::swiglu`] computes it from the whole product).
///
/// Each task computes a gate group and the up group of the same columns into two
/// tiles and writes only their SwiGLU: a prompt's `[gate | up]` product (6 MB for
/// 512 tokens of SmolLM2) is never written out and read back, which a separate pass
/// over it spent 6 % of prompt processing on.
///
/// # Errors
/// [`KernelError::Shape`] as [`matmul`] (with `out` of `x.n * ffn`), and when the
/// gate rows are not whole groups.
pub fn matmul_swiglu(
    isa: Isa,
    w: &PackedMatrix,
    x: &QuantActs,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let ffn = w.rows() / 2;
    if !w.rows().is_multiple_of(2) || !ffn.is_multiple_of(GROUP) {
        return Err(KernelError::Shape(format!(
            "SwiGLU of {} stacked gate and up rows: not two halves of whole {GROUP}-row groups",
            w.rows()
        )));
    }
    check_shapes(w, x, 2 * out.len())?;
    let gate_groups = ffn / GROUP;
    grid((gate_groups, ffn), x.n, out, 2, |g, acts, tiles| {
        let (gate, up) = tiles.split_at_mut(acts.len() * GROUP);
        group_kernel(isa, w, g, x, acts.clone(), gate);
        group_kernel(isa, w, gate_groups + g, x, acts, up);
        silu_mul_in_place(isa, gate, up);
    });
    Ok(())
}

/// [`matmul`] with exact sums: `out[t][r]` is row `r`'s sum in [`exact`] fixed point,
/// the same bits on every instruction set and for any split of the columns (the
/// fixed-point sums of column ranges add up to the whole's, in any order).
///
/// # Errors
/// As [`matmul`], and [`KernelError::Unsupported`] for more than
/// [`exact::MAX_TERMS`] blocks per row, past which the sum could overflow.
pub fn matmul_exact(
    isa: Isa,
    w: &PackedMatrix,
    x: &QuantActs,
    out: &mut [i64],
) -> Result<(), KernelError> {
    check_shapes(w, x, out.len())?;
    if w.nblocks() > exact::MAX_TERMS {
        return Err(KernelError::Unsupported(format!(
            "exact sums over {} columns (at most {})",
            w.cols(),
            exact::MAX_TERMS * QK
        )));
    }
    grid((w.groups(), w.rows()), x.n, out, 1, |g, acts, tile| {
        group_kernel_exact(isa, w, g, x, acts, tile);
    });
    Ok(())
}

fn check_shapes(w: &PackedMatrix, x: &QuantActs, out_len: usize) -> Result<(), KernelError> {
    let (n, rows) = (x.n, w.rows());
    if x.cols != w.cols() || out_len != n * rows {
        return Err(KernelError::Shape(format!(
            "{}×{} weights times {n}×{} activations into {out_len} outputs",
            rows,
            w.cols(),
            x.cols,
        )));
    }
    Ok(())
}

/// Runs `kernel(group, activation rows, tiles)` over the task grid [`matmul`]
/// describes, for `groups` output groups of an output row `row_len` wide, and copies
/// each group's tile (the first `acts.len() * GROUP` values of `tiles`) into `out`.
/// `tiles` holds `tiles_per_task` tiles: the rest are the kernel's scratch.
fn grid<T: Copy + Default + Send>(
    (groups, row_len): (usize, usize),
    n: usize,
    out: &mut [T],
    tiles_per_task: usize,
    kernel: impl Fn(usize, Range<usize>, &mut [T]) + Sync,
) {
    if n == 0 {
        return;
    }
    let row_blocks = n.div_ceil(ROW_BLOCK);
    let threads = rayon::current_num_threads().max(1);
    // Several tasks per thread so an uneven split (or a busy core) evens out.
    let group_runs = (threads * 4).div_ceil(row_blocks).clamp(1, groups);
    let run_len = groups.div_ceil(group_runs);
    let group_runs = groups.div_ceil(run_len);
    let shared = SharedOut::new(out, row_len);
    (0..row_blocks * group_runs).into_par_iter().for_each_init(
        || vec![T::default(); tiles_per_task * ROW_BLOCK.min(n) * GROUP],
        |tiles, task| {
            let (rb, run) = (task / group_runs, task % group_runs);
            let acts = rb * ROW_BLOCK..((rb + 1) * ROW_BLOCK).min(n);
            let m = acts.len() * GROUP;
            for g in run * run_len..((run + 1) * run_len).min(groups) {
                let r0 = g * GROUP;
                let width = GROUP.min(row_len - r0);
                kernel(g, acts.clone(), &mut tiles[..tiles_per_task * m]);
                for (i, t) in acts.clone().enumerate() {
                    shared.write(t, r0, &tiles[i * GROUP..i * GROUP + width]);
                }
            }
        },
    );
}

/// The output of one [`matmul`], written by all of its tasks at once. Each task owns
/// a rectangle of it (its activation rows × its groups' columns), so the writes never
/// overlap; a slice cannot express a rectangle, hence the pointer.
struct SharedOut<'a, T> {
    ptr: *mut T,
    len: usize,
    row_len: usize,
    _buffer: std::marker::PhantomData<&'a mut [T]>,
}

// SAFETY: the tasks sharing it write disjoint elements (see `write`), and it holds
// the `&mut` borrow of the buffer for as long as it lives.
#[allow(unsafe_code)]
unsafe impl<T: Send> Sync for SharedOut<'_, T> {}

impl<'a, T: Copy> SharedOut<'a, T> {
    fn new(out: &'a mut [T], row_len: usize) -> Self {
        Self {
            ptr: out.as_mut_ptr(),
            len: out.len(),
            row_len,
            _buffer: std::marker::PhantomData,
        }
    }

    /// Writes `vals` at row `t`, columns `r0..`; callers write each element once.
    fn write(&self, t: usize, r0: usize, vals: &[T]) {
        let at = t * self.row_len + r0;
        assert!(r0 + vals.len() <= self.row_len && at + vals.len() <= self.len);
        // SAFETY: the range is inside the buffer (asserted), which outlives every
        // task, and no other task writes it (each element belongs to one task).
        #[allow(unsafe_code)]
        unsafe {
            let dst = self.ptr.add(at);
            if let Ok(group) = <&[T; GROUP]>::try_from(vals) {
                // A whole group, the common case: a copy of fixed size is a few
                // vector moves; a call to memmove per group and row was 5 % of
                // prompt processing.
                dst.cast::<[T; GROUP]>().write_unaligned(*group);
            } else {
                dst.copy_from_nonoverlapping(vals.as_ptr(), vals.len());
            }
        }
    }
}
