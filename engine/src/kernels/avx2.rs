//! AVX2 integer kernel over the packed layout (see [`super::pack`]), for x86 CPUs
//! without AVX-512 VNNI (AMD Zen 2/3, many cloud VMs). Without it those machines fall
//! back to the scalar kernel, which is tens of times slower.
//!
//! AVX2 has no `vpdpbusd`, so each 4-byte dot product is `vpmaddubsw` (u8 × i8 into
//! saturating i16 pairs) then `vpmaddwd` against ones (i16 pairs into i32), as ggml's
//! AVX2 path does. The pairs cannot saturate: nibble weights are at most 15, and byte
//! weights are re-centred to i8 and multiplied as `|w| · sign(x, w)`, so a pair is at
//! most 2 · 128 · 127 < 2^15 (activations are clamped to ±127 when quantized). The
//! re-centred byte product already equals `isum − 128 · qsum`, the correction the other
//! kernels apply. Sixteen row lanes are two 8-lane halves. Callers must have checked
//! [`available`] first.
#![allow(unsafe_code)]

use std::arch::x86_64::{
    __m256, __m256i, _mm_loadu_si128, _mm256_abs_epi8, _mm256_add_epi32, _mm256_add_epi64,
    _mm256_add_pd, _mm256_and_si256, _mm256_castpd_si256, _mm256_castps256_ps128,
    _mm256_cvtepi32_ps, _mm256_cvtph_ps, _mm256_cvtps_pd, _mm256_extractf128_ps, _mm256_fmadd_ps,
    _mm256_loadu_si256, _mm256_madd_epi16, _mm256_maddubs_epi16, _mm256_max_ps, _mm256_min_ps,
    _mm256_mul_ps, _mm256_set1_epi8, _mm256_set1_epi16, _mm256_set1_epi32, _mm256_set1_epi64x,
    _mm256_set1_pd, _mm256_set1_ps, _mm256_setzero_ps, _mm256_setzero_si256, _mm256_sign_epi8,
    _mm256_srli_epi16, _mm256_storeu_ps, _mm256_storeu_si256, _mm256_sub_epi64, _mm256_xor_si256,
};

use std::ops::Range;

use super::attention::F16Ops;
use super::exact;
use super::pack::{GROUP, PackedKind, PackedMatrix, QuantActs};
use super::quant::QK;

/// Whether the kernel runs here: cpuid reports every feature it is compiled with and
/// a probe of its instructions ran ([`super::probe`]; cpuid alone says what the CPU
/// has, not what runs in this VM).
#[must_use]
pub fn available() -> bool {
    super::probe::Extension::Avx2.runs()
}

/// Computes row group `g` of `w` times the activation rows `acts` of `x` into
/// `out[(t - acts.start) * GROUP + lane]`.
///
/// # Panics
/// When the shapes disagree, or when called on a CPU without the features
/// [`available`] checks.
pub fn group(w: &PackedMatrix, g: usize, x: &QuantActs, acts: Range<usize>, out: &mut [f32]) {
    assert!(available(), "AVX2 kernel called on a CPU without it");
    assert!(x.cols == w.cols() && g < w.groups() && acts.end <= x.n);
    assert!(out.len() >= acts.len() * GROUP);
    assert!(x.q.len() >= x.n * x.cols && x.d.len() >= x.n * w.nblocks());
    assert!(x.s.len() == x.d.len() && x.qsum.len() == x.d.len());
    let nibble = w.kind() == PackedKind::Nibble;
    let mut t = acts.start;
    while t < acts.end {
        let nt = (acts.end - t).min(4);
        let i = t - acts.start;
        let o = &mut out[i * GROUP..(i + nt) * GROUP];
        // The first tile asks for the next group's weights as it goes
        // ([`PackedMatrix::prefetch_block`]).
        let prefetch = t == acts.start;
        // SAFETY: the features were checked above; shapes (group in range, activation
        // rows t..t+nt within x, o holding nt*16 floats) were asserted above.
        unsafe {
            if nibble {
                tile::<true>(w, g, x, (t, nt), o, prefetch);
            } else {
                tile::<false>(w, g, x, (t, nt), o, prefetch);
            }
        }
        t += nt;
    }
}

/// [`group`] with exact sums ([`exact`]): the same block dot products, each block's
/// term rounded to fixed point and summed in 64-bit lanes, into
/// `out[(t - acts.start) * GROUP + lane]`.
///
/// # Panics
/// As [`group`].
pub fn group_exact(w: &PackedMatrix, g: usize, x: &QuantActs, acts: Range<usize>, out: &mut [i64]) {
    assert!(available(), "AVX2 kernel called on a CPU without it");
    assert!(x.cols == w.cols() && g < w.groups() && acts.end <= x.n);
    assert!(out.len() >= acts.len() * GROUP);
    assert!(x.q.len() >= x.n * x.cols && x.d.len() >= x.n * w.nblocks());
    assert!(x.s.len() == x.d.len() && x.qsum.len() == x.d.len());
    let nibble = w.kind() == PackedKind::Nibble;
    let mut t = acts.start;
    while t < acts.end {
        let nt = (acts.end - t).min(4);
        let i = t - acts.start;
        let o = &mut out[i * GROUP..(i + nt) * GROUP];
        // SAFETY: the features were checked above; shapes (group in range, activation
        // rows t..t+nt within x, o holding nt*16 integers) were asserted above.
        unsafe {
            if nibble {
                tile_exact::<true>(w, g, x, t, nt, o);
            } else {
                tile_exact::<false>(w, g, x, t, nt, o);
            }
        }
        t += nt;
    }
}

/// [`tile`] with exact sums: each block's term is computed scaled ([`exact`]),
/// clamped, widened to f64 (exact) and made an integer by the magic-number addition
/// [`exact::fixed`] describes (AVX2 has no float-to-i64 conversion), then added to
/// 64-bit accumulators, four lanes a register.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_exact<const NIBBLE: bool>(
    w: &PackedMatrix,
    g: usize,
    x: &QuantActs,
    t0: usize,
    nt: usize,
    out: &mut [i64],
) {
    let nb = w.nblocks();
    let stride = w.stride();
    let cols = x.cols;
    let gdata = &w.data()[g * w.group_bytes()..][..w.group_bytes()];
    // acc[t][q]: lanes 4q..4q+4 of activation row t0 + t.
    let mut acc: [[__m256i; 4]; 4] = [[_mm256_setzero_si256(); 4]; 4];
    let mask = _mm256_set1_epi8(0x0f);
    let recentre = _mm256_set1_epi8(i8::MIN);
    let ones = _mm256_set1_epi16(1);
    let (lo, hi) = (
        _mm256_set1_ps(-exact::TERM_LIMIT),
        _mm256_set1_ps(exact::TERM_LIMIT),
    );
    let magic = _mm256_set1_pd(exact::MAGIC);
    let magic_bits = _mm256_set1_epi64x(exact::MAGIC.to_bits().cast_signed());
    for b in 0..nb {
        let blk = &gdata[b * stride..][..stride];
        let p = blk.as_ptr();
        let mut wv: [[__m256i; 2]; 8] = [[_mm256_setzero_si256(); 2]; 8];
        for h in 0..2 {
            if NIBBLE {
                for i in 0..4 {
                    // SAFETY: half h of chunk i of the 256 nibble bytes is within the
                    // block (64 scale bytes + 4 · 64).
                    let v = unsafe { _mm256_loadu_si256(p.add(64 + i * 64 + h * 32).cast()) };
                    wv[i][h] = _mm256_and_si256(v, mask);
                    wv[4 + i][h] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask);
                }
            } else {
                for (j, v) in wv.iter_mut().enumerate() {
                    // SAFETY: half h of chunk j of the 512 byte quants is within the
                    // block (64 scale bytes + 8 · 64).
                    let raw = unsafe { _mm256_loadu_si256(p.add(64 + j * 64 + h * 32).cast()) };
                    v[h] = _mm256_xor_si256(raw, recentre);
                }
            }
        }
        // SAFETY: the 64 scale bytes (16 f16 `d`, then 16 f16 `m`) start the block.
        let (d, m) = unsafe {
            (
                [
                    _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
                    _mm256_cvtph_ps(_mm_loadu_si128(p.add(16).cast())),
                ],
                [
                    _mm256_cvtph_ps(_mm_loadu_si128(p.add(32).cast())),
                    _mm256_cvtph_ps(_mm_loadu_si128(p.add(48).cast())),
                ],
            )
        };
        for (t, a) in acc.iter_mut().enumerate().take(nt) {
            let row = t0 + t;
            let xb = &x.q[row * cols + b * QK..][..QK];
            let bi = row * nb + b;
            for h in 0..2 {
                let mut isum = _mm256_setzero_si256();
                for (j, wj) in wv.iter().enumerate() {
                    let xj = _mm256_set1_epi32(i32::from_le_bytes([
                        xb[4 * j] as u8,
                        xb[4 * j + 1] as u8,
                        xb[4 * j + 2] as u8,
                        xb[4 * j + 3] as u8,
                    ]));
                    let pairs = if NIBBLE {
                        _mm256_maddubs_epi16(wj[h], xj)
                    } else {
                        _mm256_maddubs_epi16(_mm256_abs_epi8(wj[h]), _mm256_sign_epi8(xj, wj[h]))
                    };
                    isum = _mm256_add_epi32(isum, _mm256_madd_epi16(pairs, ones));
                }
                let dx = _mm256_mul_ps(d[h], _mm256_set1_ps(x.d[bi] * exact::SCALE));
                let term = if NIBBLE {
                    let ms = _mm256_mul_ps(m[h], _mm256_set1_ps(x.s[bi] * exact::SCALE));
                    _mm256_fmadd_ps(dx, _mm256_cvtepi32_ps(isum), ms)
                } else {
                    _mm256_mul_ps(dx, _mm256_cvtepi32_ps(isum))
                };
                // max then min with the term first: a NaN takes the lower bound, as in
                // `exact::fixed`.
                let term = _mm256_min_ps(_mm256_max_ps(term, lo), hi);
                let halves = [
                    _mm256_castps256_ps128(term),
                    _mm256_extractf128_ps::<1>(term),
                ];
                for (q, half) in halves.into_iter().enumerate() {
                    let shifted = _mm256_add_pd(_mm256_cvtps_pd(half), magic);
                    let fixed = _mm256_sub_epi64(_mm256_castpd_si256(shifted), magic_bits);
                    a[2 * h + q] = _mm256_add_epi64(a[2 * h + q], fixed);
                }
            }
        }
    }
    for (t, a) in acc.iter().enumerate().take(nt) {
        for (q, v) in a.iter().enumerate() {
            let o = &mut out[t * GROUP + q * 4..][..4];
            // SAFETY: o holds exactly 4 integers.
            unsafe { _mm256_storeu_si256(o.as_mut_ptr().cast(), *v) };
        }
    }
}

/// One tile: `nt` (at most 4) activation rows from `t0` against row group `g`, into
/// `out`; with `prefetch`, each block also requests the same block of group `g + 1`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const NIBBLE: bool>(
    w: &PackedMatrix,
    g: usize,
    x: &QuantActs,
    (t0, nt): (usize, usize),
    out: &mut [f32],
    prefetch: bool,
) {
    let nb = w.nblocks();
    let stride = w.stride();
    let cols = x.cols;
    let gdata = &w.data()[g * w.group_bytes()..][..w.group_bytes()];
    // acc[t][half]: lanes 0..8 and 8..16 of activation row t0 + t.
    let mut acc: [[__m256; 2]; 4] = [[_mm256_setzero_ps(); 2]; 4];
    let mask = _mm256_set1_epi8(0x0f);
    let recentre = _mm256_set1_epi8(i8::MIN);
    let ones = _mm256_set1_epi16(1);
    for b in 0..nb {
        if prefetch {
            w.prefetch_block(g + 1, b);
        }
        let blk = &gdata[b * stride..][..stride];
        let p = blk.as_ptr();
        // wv[j][half]: columns 4j..4j+4 of lanes 8·half..8·half+8 (u8 for nibbles, i8
        // re-centred for bytes).
        let mut wv: [[__m256i; 2]; 8] = [[_mm256_setzero_si256(); 2]; 8];
        for h in 0..2 {
            if NIBBLE {
                for i in 0..4 {
                    // SAFETY: half h of chunk i of the 256 nibble bytes is within the
                    // block (64 scale bytes + 4 · 64).
                    let v = unsafe { _mm256_loadu_si256(p.add(64 + i * 64 + h * 32).cast()) };
                    wv[i][h] = _mm256_and_si256(v, mask);
                    wv[4 + i][h] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask);
                }
            } else {
                for (j, v) in wv.iter_mut().enumerate() {
                    // SAFETY: half h of chunk j of the 512 byte quants is within the
                    // block (64 scale bytes + 8 · 64).
                    let raw = unsafe { _mm256_loadu_si256(p.add(64 + j * 64 + h * 32).cast()) };
                    v[h] = _mm256_xor_si256(raw, recentre);
                }
            }
        }
        // SAFETY: the 64 scale bytes (16 f16 `d`, then 16 f16 `m`) start the block.
        let (d, m) = unsafe {
            (
                [
                    _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
                    _mm256_cvtph_ps(_mm_loadu_si128(p.add(16).cast())),
                ],
                [
                    _mm256_cvtph_ps(_mm_loadu_si128(p.add(32).cast())),
                    _mm256_cvtph_ps(_mm_loadu_si128(p.add(48).cast())),
                ],
            )
        };
        for (t, a) in acc.iter_mut().enumerate().take(nt) {
            let row = t0 + t;
            let xb = &x.q[row * cols + b * QK..][..QK];
            let bi = row * nb + b;
            for h in 0..2 {
                let mut isum = _mm256_setzero_si256();
                for (j, wj) in wv.iter().enumerate() {
                    let xj = _mm256_set1_epi32(i32::from_le_bytes([
                        xb[4 * j] as u8,
                        xb[4 * j + 1] as u8,
                        xb[4 * j + 2] as u8,
                        xb[4 * j + 3] as u8,
                    ]));
                    let pairs = if NIBBLE {
                        _mm256_maddubs_epi16(wj[h], xj)
                    } else {
                        _mm256_maddubs_epi16(_mm256_abs_epi8(wj[h]), _mm256_sign_epi8(xj, wj[h]))
                    };
                    isum = _mm256_add_epi32(isum, _mm256_madd_epi16(pairs, ones));
                }
                a[h] = _mm256_fmadd_ps(
                    _mm256_mul_ps(d[h], _mm256_set1_ps(x.d[bi])),
                    _mm256_cvtepi32_ps(isum),
                    a[h],
                );
                if NIBBLE {
                    a[h] = _mm256_fmadd_ps(m[h], _mm256_set1_ps(x.s[bi]), a[h]);
                }
            }
        }
    }
    for (t, a) in acc.iter().enumerate().take(nt) {
        for (h, v) in a.iter().enumerate() {
            let o = &mut out[t * GROUP + h * 8..][..8];
            // SAFETY: o holds exactly 8 floats.
            unsafe { _mm256_storeu_ps(o.as_mut_ptr(), *v) };
        }
    }
}

/// [`super::ops::silu_mul_in_place_impl`] compiled with AVX2 enabled.
///
/// # Panics
/// As that function; and when called on a CPU without the features [`available`]
/// checks.
pub fn silu_mul_in_place(gate: &mut [f32], up: &[f32]) {
    assert!(available(), "AVX2 SwiGLU called on a CPU without it");
    // SAFETY: the features the function is compiled for were checked just above.
    unsafe { silu_mul_in_place_avx2(gate, up) }
}

#[target_feature(enable = "avx2,fma")]
fn silu_mul_in_place_avx2(gate: &mut [f32], up: &[f32]) {
    super::ops::silu_mul_in_place_impl(gate, up);
}

/// [`super::attention::attend_impl`] compiled with AVX2 enabled. It converts every
/// block once: the one-pass kernels exist for AVX-512 only, and no AVX2-only host was
/// at hand to measure one.
///
/// # Panics
/// When called on a CPU without the features [`available`] checks.
pub fn attend(
    tile: &super::attention::AttnTile<'_>,
    scratch: &mut super::attention::AttnScratch,
    out: &mut [f32],
) {
    assert!(available(), "AVX2 attention called on a CPU without it");
    // SAFETY: the features the function is compiled for were checked just above.
    unsafe { attend_avx2(tile, scratch, out) }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn attend_avx2(
    tile: &super::attention::AttnTile<'_>,
    scratch: &mut super::attention::AttnScratch,
    out: &mut [f32],
) {
    super::attention::attend_impl(tile, scratch, out, F16Ops::new(widen_f16, None));
}

/// [`super::attention::WidenF16`] 8 values at a time (`vcvtph2ps`), exact as every
/// path's conversion.
///
/// # Panics
/// When `src` and `dst` differ in length, or on a CPU without the features
/// [`available`] checks.
pub fn widen_f16(src: &[half::f16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "f16 → f32 of two lengths");
    assert!(available(), "avx2 conversion called on a CPU without it");
    // SAFETY: the features the function is compiled for were checked just above.
    unsafe { widen_f16_avx2(src, dst) }
}

#[target_feature(enable = "avx,f16c")]
fn widen_f16_avx2(src: &[half::f16], dst: &mut [f32]) {
    use half::slice::HalfFloatSliceExt as _;
    use std::arch::x86_64::{_mm_loadu_si128, _mm256_cvtph_ps, _mm256_storeu_ps};
    let whole = src.len() / 8 * 8;
    for i in (0..whole).step_by(8) {
        // SAFETY: i + 8 <= whole <= the length of both slices (asserted equal), and
        // the load and store are unaligned.
        unsafe {
            let h = _mm_loadu_si128(src.as_ptr().add(i).cast());
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
    }
    src[whole..].convert_to_f32_slice(&mut dst[whole..]);
}

/// [`super::pack::quantize_blocks`] 8 values at a time, the same bits: the largest
/// magnitude is exact in any order, `vcvtps2dq` rounds to nearest even as the
/// portable rounding does, and values that are not numbers are masked to 0 as the
/// portable cast makes them.
///
/// # Panics
/// When the slices are not whole blocks of one count, or on a CPU without the
/// features [`available`] checks.
pub fn quantize_blocks(x: &[f32], q: &mut [i8], d: &mut [f32], s: &mut [f32], qsum: &mut [i32]) {
    assert!(available(), "avx2 quantization called on a CPU without it");
    let blocks = d.len();
    assert!(x.len() == blocks * QK && q.len() == x.len());
    assert!(s.len() == blocks && qsum.len() == blocks);
    // SAFETY: the features the function is compiled for were checked just above.
    unsafe { quantize_blocks_avx2(x, q, d, s, qsum) }
}

#[target_feature(enable = "avx2")]
fn quantize_blocks_avx2(x: &[f32], q: &mut [i8], d: &mut [f32], s: &mut [f32], qsum: &mut [i32]) {
    use super::pack::{block_scale, store_block_sums};
    use std::arch::x86_64::{
        _CMP_ORD_Q, _mm_add_epi32, _mm_cvtsi128_si32, _mm_shuffle_epi32, _mm256_and_ps,
        _mm256_castps_si256, _mm256_castsi256_ps, _mm256_castsi256_si128, _mm256_cmp_ps,
        _mm256_cvtps_epi32, _mm256_cvtss_f32, _mm256_extracti128_si256, _mm256_loadu_ps,
        _mm256_max_epi32, _mm256_min_epi32, _mm256_packs_epi16, _mm256_packs_epi32,
        _mm256_permute2f128_ps, _mm256_permutevar8x32_epi32, _mm256_setr_epi32, _mm256_shuffle_ps,
    };
    let abs_bits = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let (lo, hi) = (_mm256_set1_epi32(-127), _mm256_set1_epi32(127));
    // packs interleave the 128-bit lanes; this puts the bytes back in order.
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (bi, (xb, qb)) in x.chunks_exact(QK).zip(q.chunks_exact_mut(QK)).enumerate() {
        // SAFETY: xb holds QK = 32 floats, read unaligned 8 at a time.
        let v: [__m256; 4] =
            std::array::from_fn(|i| unsafe { _mm256_loadu_ps(xb.as_ptr().add(8 * i)) });
        let magnitude = |v: __m256| {
            _mm256_and_ps(
                _mm256_and_ps(v, abs_bits),
                _mm256_cmp_ps::<_CMP_ORD_Q>(v, v),
            )
        };
        let mut m = _mm256_max_ps(
            _mm256_max_ps(magnitude(v[0]), magnitude(v[1])),
            _mm256_max_ps(magnitude(v[2]), magnitude(v[3])),
        );
        m = _mm256_max_ps(m, _mm256_permute2f128_ps::<1>(m, m));
        m = _mm256_max_ps(m, _mm256_shuffle_ps::<0b0100_1110>(m, m));
        m = _mm256_max_ps(m, _mm256_shuffle_ps::<0b1011_0001>(m, m));
        let (dv, id) = block_scale(_mm256_cvtss_f32(m));
        let idv = _mm256_set1_ps(id);
        let r: [__m256i; 4] = std::array::from_fn(|i| {
            let scaled = _mm256_mul_ps(v[i], idv);
            let ordered = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_ORD_Q>(scaled, scaled));
            let r = _mm256_and_si256(_mm256_cvtps_epi32(scaled), ordered);
            _mm256_min_epi32(_mm256_max_epi32(r, lo), hi)
        });
        let total = _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
        let mut t = _mm_add_epi32(
            _mm256_castsi256_si128(total),
            _mm256_extracti128_si256::<1>(total),
        );
        t = _mm_add_epi32(t, _mm_shuffle_epi32::<0b0100_1110>(t));
        t = _mm_add_epi32(t, _mm_shuffle_epi32::<0b1011_0001>(t));
        let bytes = _mm256_packs_epi16(
            _mm256_packs_epi32(r[0], r[1]),
            _mm256_packs_epi32(r[2], r[3]),
        );
        // SAFETY: qb holds 32 bytes, written unaligned.
        unsafe {
            _mm256_storeu_si256(
                qb.as_mut_ptr().cast(),
                _mm256_permutevar8x32_epi32(bytes, order),
            );
        }
        store_block_sums(bi, (dv, _mm_cvtsi128_si32(t)), d, s, qsum);
    }
}
