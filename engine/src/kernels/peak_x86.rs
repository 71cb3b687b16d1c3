//! The x86 inner loops of [`super::peak`]: int8 multiply-add chains held in registers,
//! and a streaming read with wide loads. Each public function checks its CPU features
//! and returns `None` without them.
//!
//! The multiply-add loops keep their operands in registers and touch no memory. Each
//! iteration passes the multiplicand through an empty `asm!` block, so the compiler
//! must treat it as a new value: without that, the AVX2 product (whose result does not
//! depend on the accumulator) would be hoisted out of the loop and only the additions
//! would remain.
#![allow(unsafe_code)]

use std::arch::asm;
use std::arch::x86_64::{
    __m256i, __m512i, _mm256_add_epi32, _mm256_add_epi64, _mm256_dpbusd_avx_epi32,
    _mm256_extract_epi64, _mm256_loadu_si256, _mm256_madd_epi16, _mm256_maddubs_epi16,
    _mm256_set1_epi8, _mm256_set1_epi16, _mm256_setzero_si256, _mm512_add_epi64,
    _mm512_dpbusd_epi32, _mm512_loadu_si512, _mm512_reduce_add_epi32, _mm512_reduce_add_epi64,
    _mm512_set1_epi8, _mm512_setzero_si512,
};

use super::probe::Extension;

/// Independent `vpdpbusd` accumulators: enough to cover its latency (5 cycles) on two
/// ports, and few enough to stay in the 32 vector registers with both operands.
const VNNI_CHAINS: usize = 16;
/// Independent AVX-VNNI accumulators: with both operands, within the 16 `ymm`
/// registers a VEX encoding can name (16 would spill to the stack).
const AVX_VNNI_CHAINS: usize = 12;
/// Independent `vpmaddubsw` → `vpmaddwd` → `vpaddd` chains: each has its own
/// multiplicand (so the products cannot be shared), and all fit in 16 `ymm` registers
/// with the other operand, the ones and the temporaries.
const AVX2_CHAINS: usize = 4;
/// 256-bit loads in flight per iteration of the read loop.
const READ_LANES: usize = 8;

/// Multiply-adds per iteration of [`vnni512`].
pub const VNNI512_MACS_PER_ITER: u64 = (VNNI_CHAINS * 64) as u64;
/// Multiply-adds per iteration of [`avx_vnni`].
pub const AVX_VNNI_MACS_PER_ITER: u64 = (AVX_VNNI_CHAINS * 32) as u64;
/// Multiply-adds per iteration of [`avx2`].
pub const AVX2_MACS_PER_ITER: u64 = (AVX2_CHAINS * 32) as u64;

/// Whether [`vnni512`] and [`read_avx512`] run here: exactly when the engine's AVX-512
/// VNNI kernel does (cpuid and a probe, [`super::probe`]), so the ceiling is measured
/// with what the engine runs.
#[must_use]
pub fn has_vnni512() -> bool {
    Extension::Avx512Vnni.runs()
}

/// Whether [`avx_vnni`] runs here (cpuid and a probe, [`super::probe`]).
#[must_use]
pub fn has_avx_vnni() -> bool {
    Extension::AvxVnni.runs()
}

/// Whether [`avx2`] and [`read_avx2`] run here: exactly when the engine's AVX2 kernel
/// does (cpuid and a probe, [`super::probe`]).
#[must_use]
pub fn has_avx2() -> bool {
    Extension::Avx2.runs()
}

/// `iters` × 16 × `vpdpbusd zmm` (64 u8×i8 multiply-adds each); returns a checksum of
/// the accumulators, or `None` without AVX-512 VNNI.
#[must_use]
pub fn vnni512(iters: u64, seed: u8) -> Option<i64> {
    if !has_vnni512() {
        return None;
    }
    // SAFETY: the features the function is compiled for were checked just above.
    Some(unsafe { vnni512_impl(iters, seed) })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn vnni512_impl(iters: u64, seed: u8) -> i64 {
    let mut a: __m512i = _mm512_set1_epi8(seed as i8);
    let b = _mm512_set1_epi8(1);
    let mut acc = [_mm512_setzero_si512(); VNNI_CHAINS];
    for _ in 0..iters {
        // SAFETY: an empty block that only claims to change `a`; no memory, stack or flags.
        unsafe { asm!("/* {0} */", inout(zmm_reg) a, options(nomem, nostack, preserves_flags)) };
        for c in &mut acc {
            *c = _mm512_dpbusd_epi32(*c, a, b);
        }
    }
    acc.iter()
        .map(|&c| i64::from(_mm512_reduce_add_epi32(c)))
        .sum()
}

/// `iters` × 12 × `vpdpbusd ymm` (AVX-VNNI, 32 multiply-adds each); returns a checksum,
/// or `None` without AVX-VNNI.
#[must_use]
pub fn avx_vnni(iters: u64, seed: u8) -> Option<i64> {
    if !has_avx_vnni() {
        return None;
    }
    // SAFETY: the features the function is compiled for were checked just above.
    Some(unsafe { avx_vnni_impl(iters, seed) })
}

#[target_feature(enable = "avx2,avxvnni")]
fn avx_vnni_impl(iters: u64, seed: u8) -> i64 {
    let mut a: __m256i = _mm256_set1_epi8(seed as i8);
    let b = _mm256_set1_epi8(1);
    let mut acc = [_mm256_setzero_si256(); AVX_VNNI_CHAINS];
    for _ in 0..iters {
        // SAFETY: an empty block that only claims to change `a`; no memory, stack or flags.
        unsafe { asm!("/* {0} */", inout(ymm_reg) a, options(nomem, nostack, preserves_flags)) };
        for c in &mut acc {
            *c = _mm256_dpbusd_avx_epi32(*c, a, b);
        }
    }
    acc.iter().map(|&c| sum_i32x8(c)).sum()
}

/// `iters` × 4 × (`vpmaddubsw` + `vpmaddwd` + `vpaddd`, 32 multiply-adds), the int8
/// dot product of CPUs without VNNI; returns a checksum, or `None` without AVX2.
#[must_use]
pub fn avx2(iters: u64, seed: u8) -> Option<i64> {
    if !has_avx2() {
        return None;
    }
    // SAFETY: the features the function is compiled for were checked just above.
    Some(unsafe { avx2_impl(iters, seed) })
}

#[target_feature(enable = "avx2")]
fn avx2_impl(iters: u64, seed: u8) -> i64 {
    // Small operands, so the saturating i16 pairs of vpmaddubsw never saturate.
    let mut a: [__m256i; AVX2_CHAINS] =
        std::array::from_fn(|i| _mm256_set1_epi8(((seed as usize + i) & 0x0f) as i8));
    let b = _mm256_set1_epi8(3);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_si256(); AVX2_CHAINS];
    for _ in 0..iters {
        // SAFETY: an empty block that only claims to change the multiplicands; no
        // memory, stack or flags.
        unsafe {
            asm!(
                "/* {0} {1} {2} {3} */",
                inout(ymm_reg) a[0],
                inout(ymm_reg) a[1],
                inout(ymm_reg) a[2],
                inout(ymm_reg) a[3],
                options(nomem, nostack, preserves_flags)
            );
        }
        for (c, &x) in acc.iter_mut().zip(&a) {
            *c = _mm256_add_epi32(*c, _mm256_madd_epi16(_mm256_maddubs_epi16(x, b), ones));
        }
    }
    acc.iter().map(|&c| sum_i32x8(c)).sum()
}

#[target_feature(enable = "avx2")]
fn sum_i32x8(v: __m256i) -> i64 {
    let mut lanes = [0i32; 8];
    // SAFETY: `lanes` is 32 writable bytes; the unaligned store needs no alignment.
    unsafe { std::arch::x86_64::_mm256_storeu_si256(lanes.as_mut_ptr().cast(), v) };
    lanes.iter().map(|&x| i64::from(x)).sum()
}

/// Wrapping sum of `words` with 512-bit loads, or `None` without AVX-512.
#[must_use]
pub fn read_avx512(words: &[u64]) -> Option<u64> {
    if !has_vnni512() {
        return None;
    }
    // SAFETY: the features the function is compiled for were checked just above.
    Some(unsafe { read_avx512_impl(words) })
}

#[target_feature(enable = "avx512f,avx512bw")]
fn read_avx512_impl(words: &[u64]) -> u64 {
    const STEP: usize = READ_LANES * 8;
    let mut acc = [_mm512_setzero_si512(); READ_LANES];
    let mut chunks = words.chunks_exact(STEP);
    for chunk in &mut chunks {
        for (j, a) in acc.iter_mut().enumerate() {
            // SAFETY: words j*8..j*8+8 lie within the chunk of STEP words; the
            // unaligned load needs no alignment.
            let v = unsafe { _mm512_loadu_si512(chunk.as_ptr().add(j * 8).cast()) };
            *a = _mm512_add_epi64(*a, v);
        }
    }
    let vec: u64 = acc
        .iter()
        .map(|&a| _mm512_reduce_add_epi64(a) as u64)
        .fold(0, u64::wrapping_add);
    chunks
        .remainder()
        .iter()
        .fold(vec, |s, &w| s.wrapping_add(w))
}

/// Wrapping sum of `words` with 256-bit loads, or `None` without AVX2.
#[must_use]
pub fn read_avx2(words: &[u64]) -> Option<u64> {
    if !has_avx2() {
        return None;
    }
    // SAFETY: the features the function is compiled for were checked just above.
    Some(unsafe { read_avx2_impl(words) })
}

#[target_feature(enable = "avx2")]
fn read_avx2_impl(words: &[u64]) -> u64 {
    const STEP: usize = READ_LANES * 4;
    let mut acc = [_mm256_setzero_si256(); READ_LANES];
    let mut chunks = words.chunks_exact(STEP);
    for chunk in &mut chunks {
        for (j, a) in acc.iter_mut().enumerate() {
            // SAFETY: words j*4..j*4+4 lie within the chunk of STEP words; the
            // unaligned load needs no alignment.
            let v = unsafe { _mm256_loadu_si256(chunk.as_ptr().add(j * 4).cast()) };
            *a = _mm256_add_epi64(*a, v);
        }
    }
    let vec = acc.iter().fold(0u64, |s, &a| {
        s.wrapping_add(_mm256_extract_epi64::<0>(a) as u64)
            .wrapping_add(_mm256_extract_epi64::<1>(a) as u64)
            .wrapping_add(_mm256_extract_epi64::<2>(a) as u64)
            .wrapping_add(_mm256_extract_epi64::<3>(a) as u64)
    });
    chunks
        .remainder()
        .iter()
        .fold(vec, |s, &w| s.wrapping_add(w))
}
