//! AVX-512 VNNI integer kernel over the packed layout (see [`super::pack`]).
//!
//! For one group of 16 rows and a tile of up to eight activation rows, each block
//! costs eight `vpdpbusd` per activation row (u8 weights × i8 activations, 64 MACs
//! each), one conversion and two FMAs; the unpacked weight vectors are reused across
//! the tile. Callers must have checked [`available`] first.
#![allow(unsafe_code)]

use std::arch::x86_64::{
    __m256i, __m512, __m512i, _mm256_loadu_si256, _mm512_add_epi32, _mm512_add_epi64,
    _mm512_add_ps, _mm512_and_si512, _mm512_castps512_ps256, _mm512_castsi512_si256,
    _mm512_cvtepi32_ps, _mm512_cvtph_ps, _mm512_cvtps_epi64, _mm512_dpbusd_epi32,
    _mm512_extractf32x8_ps, _mm512_extracti64x4_epi64, _mm512_fmadd_ps, _mm512_load_si512,
    _mm512_loadu_ps, _mm512_max_ps, _mm512_min_ps, _mm512_mul_ps, _mm512_set1_epi8,
    _mm512_set1_epi32, _mm512_set1_ps, _mm512_setzero_ps, _mm512_setzero_si512, _mm512_srli_epi16,
    _mm512_storeu_ps, _mm512_storeu_si512, _mm512_sub_epi32,
};

use std::ops::Range;

use super::attention::{BlockWeights, F16Ops, ROWS, ScoresF16, ValuesF16};
use super::exact;
use super::pack::{GROUP, PackedKind, PackedMatrix, QuantActs};
use super::quant::QK;

/// Whether the kernel runs here: cpuid reports every feature it is compiled with and
/// a probe of its instructions ran ([`super::probe`]; cpuid alone says what the CPU
/// has, not what runs in this VM).
#[must_use]
pub fn available() -> bool {
    super::probe::Extension::Avx512Vnni.runs()
}

/// Computes row group `g` of `w` times the activation rows `acts` of `x` into
/// `out[(t - acts.start) * GROUP + lane]`.
///
/// # Panics
/// When the shapes disagree, or when called on a CPU without the features
/// [`available`] checks.
pub fn group(w: &PackedMatrix, g: usize, x: &QuantActs, acts: Range<usize>, out: &mut [f32]) {
    assert!(
        available(),
        "AVX-512 VNNI kernel called on a CPU without it"
    );
    assert!(x.cols == w.cols() && g < w.groups() && acts.end <= x.n);
    assert!(out.len() >= acts.len() * GROUP);
    assert!(x.q.len() >= x.n * x.cols && x.d.len() >= x.n * w.nblocks());
    assert!(x.s.len() == x.d.len() && x.qsum.len() == x.d.len());
    let nibble = w.kind() == PackedKind::Nibble;
    let mut t = acts.start;
    while t < acts.end {
        // Eight rows share each block's unpacked weights where there are eight:
        // the unpacking is a quarter of a four-row tile's vector operations.
        let left = acts.end - t;
        let nt = if left >= 8 { 8 } else { left.min(4) };
        let i = t - acts.start;
        let o = &mut out[i * GROUP..(i + nt) * GROUP];
        // The first tile asks for the next group's weights as it goes
        // ([`PackedMatrix::prefetch_block`]).
        let prefetch = t == acts.start;
        // SAFETY: the features were checked above; shapes (group in range, activation
        // rows t..t+nt within x, o holding nt*16 floats) were asserted above.
        unsafe {
            match (nt, nibble) {
                (8, true) => tile::<8, true>(w, g, x, t, o, prefetch),
                (8, false) => tile::<8, false>(w, g, x, t, o, prefetch),
                (4, true) => tile::<4, true>(w, g, x, t, o, prefetch),
                (4, false) => tile::<4, false>(w, g, x, t, o, prefetch),
                (3, true) => tile::<3, true>(w, g, x, t, o, prefetch),
                (3, false) => tile::<3, false>(w, g, x, t, o, prefetch),
                (2, true) => tile::<2, true>(w, g, x, t, o, prefetch),
                (2, false) => tile::<2, false>(w, g, x, t, o, prefetch),
                (_, true) => tile::<1, true>(w, g, x, t, o, prefetch),
                (_, false) => tile::<1, false>(w, g, x, t, o, prefetch),
            }
        }
        t += nt;
    }
}

/// One tile: `NT` activation rows from `t0` against row group `g`, into `out`
/// (`NT * GROUP` floats); with `prefetch`, each block also requests the same block of
/// group `g + 1`.
///
/// Written over raw pointers so that the row loop unrolls and the `NT` accumulators
/// stay in registers: with checked slices the compiler kept them on the stack, and a
/// load and a store per row and block were a third of the tile's samples.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
unsafe fn tile<const NT: usize, const NIBBLE: bool>(
    w: &PackedMatrix,
    g: usize,
    x: &QuantActs,
    t0: usize,
    out: &mut [f32],
    prefetch: bool,
) {
    let nb = w.nblocks();
    let stride = w.stride();
    let cols = x.cols;
    let gdata = w.data()[g * w.group_bytes()..][..w.group_bytes()].as_ptr();
    // Row t0's quants and block sums; row t0 + t is `t * cols` and `t * nb` further.
    let xq = x.q[t0 * cols..][..NT * cols].as_ptr();
    let xd = x.d[t0 * nb..][..NT * nb].as_ptr();
    let xs = x.s[t0 * nb..][..NT * nb].as_ptr();
    let xqsum = x.qsum[t0 * nb..][..NT * nb].as_ptr();
    const { assert!(NT <= 8, "rows! below unrolls eight rows") };
    let mut acc: [__m512; NT] = [_mm512_setzero_ps(); NT];
    let mask = _mm512_set1_epi8(0x0f);
    for b in 0..nb {
        // SAFETY: block b of the group starts b * stride bytes in, within the group's
        // slice, 64-byte aligned as PackedMatrix guarantees.
        let blk = unsafe { gdata.add(b * stride) };
        if prefetch {
            w.prefetch_block(g + 1, b);
        }
        let mut wv: [__m512i; 8] = [_mm512_setzero_si512(); 8];
        // SAFETY: blk points at `stride` bytes (64 scale bytes + 256 or 512 quant
        // bytes), 64-byte aligned.
        let sc = unsafe { _mm512_load_si512(blk.cast()) };
        let dv = _mm512_cvtph_ps(_mm512_castsi512_si256(sc));
        let mv = _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(sc));
        if NIBBLE {
            for i in 0..4 {
                // SAFETY: chunk i of the 256 nibble bytes lies within the block.
                let v = unsafe { _mm512_load_si512(blk.add(64 + i * 64).cast()) };
                wv[i] = _mm512_and_si512(v, mask);
                wv[4 + i] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), mask);
            }
        } else {
            for (j, v) in wv.iter_mut().enumerate() {
                // SAFETY: chunk j of the 512 byte quants lies within the block.
                *v = unsafe { _mm512_load_si512(blk.add(64 + j * 64).cast()) };
            }
        }
        // One row's block: its eight dot products, then the float epilogue.
        let row = |t: usize, a: __m512| {
            // SAFETY: t < NT and b < nb, so the block's QK quants of row t0 + t and its
            // sums lie within the slices taken above (each NT rows long).
            let (xb, bi) = unsafe { (xq.add(t * cols + b * QK), t * nb + b) };
            // SAFETY: xb + 4j + 4 <= xb + QK, within the row's block; unaligned read.
            let dword = |j: usize| unsafe { xb.add(4 * j).cast::<i32>().read_unaligned() };
            let mut i0 = _mm512_setzero_si512();
            let mut i1 = _mm512_setzero_si512();
            for j in (0..8).step_by(2) {
                i0 = _mm512_dpbusd_epi32(i0, wv[j], _mm512_set1_epi32(dword(j)));
                i1 = _mm512_dpbusd_epi32(i1, wv[j + 1], _mm512_set1_epi32(dword(j + 1)));
            }
            let mut isum = _mm512_add_epi32(i0, i1);
            // SAFETY: bi < NT * nb, within the sums' slices.
            let (d, s, qsum) = unsafe { (*xd.add(bi), *xs.add(bi), *xqsum.add(bi)) };
            if !NIBBLE {
                isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(128 * qsum));
            }
            let a = _mm512_fmadd_ps(
                _mm512_mul_ps(dv, _mm512_set1_ps(d)),
                _mm512_cvtepi32_ps(isum),
                a,
            );
            if NIBBLE {
                _mm512_fmadd_ps(mv, _mm512_set1_ps(s), a)
            } else {
                a
            }
        };
        // Unrolled by hand (the branches fold, NT being a constant): left as a loop,
        // the Q8_0 tile's larger body was not unrolled and its accumulators went to
        // the stack.
        macro_rules! rows {
            ($($t:literal)*) => { $( if $t < NT { acc[$t] = row($t, acc[$t]); } )* };
        }
        rows!(0 1 2 3 4 5 6 7);
    }
    for (t, a) in acc.iter().enumerate() {
        let o = &mut out[t * GROUP..(t + 1) * GROUP];
        // SAFETY: o holds exactly 16 floats.
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), *a) };
    }
}

/// [`group`] with exact sums ([`exact`]): the same block dot products, each block's
/// term rounded to fixed point and summed in 64-bit lanes, into
/// `out[(t - acts.start) * GROUP + lane]`.
///
/// # Panics
/// As [`group`].
pub fn group_exact(w: &PackedMatrix, g: usize, x: &QuantActs, acts: Range<usize>, out: &mut [i64]) {
    assert!(
        available(),
        "AVX-512 VNNI kernel called on a CPU without it"
    );
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
            match (nt, nibble) {
                (4, true) => tile_exact::<4, true>(w, g, x, t, o),
                (4, false) => tile_exact::<4, false>(w, g, x, t, o),
                (3, true) => tile_exact::<3, true>(w, g, x, t, o),
                (3, false) => tile_exact::<3, false>(w, g, x, t, o),
                (2, true) => tile_exact::<2, true>(w, g, x, t, o),
                (2, false) => tile_exact::<2, false>(w, g, x, t, o),
                (_, true) => tile_exact::<1, true>(w, g, x, t, o),
                (_, false) => tile_exact::<1, false>(w, g, x, t, o),
            }
        }
        t += nt;
    }
}

/// [`tile`] with exact sums: the integer part is the same; each block's term is
/// computed scaled ([`exact`]: one multiply, one FMA or multiply), clamped,
/// converted to i64 with `vcvtps2qq` (rounding to nearest even, the default MXCSR
/// mode) and added to two 8-lane i64 accumulators per activation row.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vnni,f16c,fma")]
unsafe fn tile_exact<const NT: usize, const NIBBLE: bool>(
    w: &PackedMatrix,
    g: usize,
    x: &QuantActs,
    t0: usize,
    out: &mut [i64],
) {
    let nb = w.nblocks();
    let stride = w.stride();
    let cols = x.cols;
    let gdata = &w.data()[g * w.group_bytes()..][..w.group_bytes()];
    // acc[t]: lanes 0..8 and 8..16 of activation row t0 + t.
    let mut acc: [[__m512i; 2]; NT] = [[_mm512_setzero_si512(); 2]; NT];
    let mask = _mm512_set1_epi8(0x0f);
    let (lo, hi) = (
        _mm512_set1_ps(-exact::TERM_LIMIT),
        _mm512_set1_ps(exact::TERM_LIMIT),
    );
    for b in 0..nb {
        let blk = gdata[b * stride..][..stride].as_ptr();
        let mut wv: [__m512i; 8] = [_mm512_setzero_si512(); 8];
        // SAFETY: blk points at `stride` bytes (64 scale bytes + 256 or 512 quant
        // bytes) starting 64-byte aligned, as PackedMatrix guarantees.
        let sc = unsafe { _mm512_load_si512(blk.cast()) };
        let dv = _mm512_cvtph_ps(_mm512_castsi512_si256(sc));
        let mv = _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(sc));
        if NIBBLE {
            for i in 0..4 {
                // SAFETY: chunk i of the 256 nibble bytes lies within the block.
                let v = unsafe { _mm512_load_si512(blk.add(64 + i * 64).cast()) };
                wv[i] = _mm512_and_si512(v, mask);
                wv[4 + i] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), mask);
            }
        } else {
            for (j, v) in wv.iter_mut().enumerate() {
                // SAFETY: chunk j of the 512 byte quants lies within the block.
                *v = unsafe { _mm512_load_si512(blk.add(64 + j * 64).cast()) };
            }
        }
        for (t, a) in acc.iter_mut().enumerate() {
            let row = t0 + t;
            let xb = &x.q[row * cols + b * QK..][..QK];
            let dword = |j: usize| {
                i32::from_le_bytes([
                    xb[4 * j] as u8,
                    xb[4 * j + 1] as u8,
                    xb[4 * j + 2] as u8,
                    xb[4 * j + 3] as u8,
                ])
            };
            let mut i0 = _mm512_setzero_si512();
            let mut i1 = _mm512_setzero_si512();
            for j in (0..8).step_by(2) {
                i0 = _mm512_dpbusd_epi32(i0, wv[j], _mm512_set1_epi32(dword(j)));
                i1 = _mm512_dpbusd_epi32(i1, wv[j + 1], _mm512_set1_epi32(dword(j + 1)));
            }
            let mut isum = _mm512_add_epi32(i0, i1);
            let bi = row * nb + b;
            if !NIBBLE {
                isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(128 * x.qsum[bi]));
            }
            let dx = _mm512_mul_ps(dv, _mm512_set1_ps(x.d[bi] * exact::SCALE));
            let term = if NIBBLE {
                let ms = _mm512_mul_ps(mv, _mm512_set1_ps(x.s[bi] * exact::SCALE));
                _mm512_fmadd_ps(dx, _mm512_cvtepi32_ps(isum), ms)
            } else {
                _mm512_mul_ps(dx, _mm512_cvtepi32_ps(isum))
            };
            // max then min with the term first: a NaN takes the lower bound, as in
            // `exact::fixed`.
            let term = _mm512_min_ps(_mm512_max_ps(term, lo), hi);
            a[0] = _mm512_add_epi64(a[0], _mm512_cvtps_epi64(_mm512_castps512_ps256(term)));
            a[1] = _mm512_add_epi64(a[1], _mm512_cvtps_epi64(_mm512_extractf32x8_ps::<1>(term)));
        }
    }
    for (t, a) in acc.iter().enumerate() {
        for (h, v) in a.iter().enumerate() {
            let o = &mut out[t * GROUP + h * 8..][..8];
            // SAFETY: o holds exactly 8 integers.
            unsafe { _mm512_storeu_si512(o.as_mut_ptr().cast(), *v) };
        }
    }
}

/// [`super::ops::silu_mul_in_place_impl`] compiled with AVX-512 enabled.
///
/// # Panics
/// As that function; and when called on a CPU without the features [`available`]
/// checks.
pub fn silu_mul_in_place(gate: &mut [f32], up: &[f32]) {
    assert!(available(), "AVX-512 SwiGLU called on a CPU without it");
    // SAFETY: the features the function is compiled for were checked just above.
    unsafe { silu_mul_in_place_avx512(gate, up) }
}

#[target_feature(enable = "avx512f")]
fn silu_mul_in_place_avx512(gate: &mut [f32], up: &[f32]) {
    super::ops::silu_mul_in_place_impl(gate, up);
}

/// [`super::attention::attend_impl`] compiled with AVX-512 enabled.
///
/// # Panics
/// When called on a CPU without the features [`available`] checks.
pub fn attend(
    tile: &super::attention::AttnTile<'_>,
    scratch: &mut super::attention::AttnScratch,
    out: &mut [f32],
) {
    assert!(available(), "AVX-512 attention called on a CPU without it");
    // SAFETY: the features the function is compiled for were checked just above.
    unsafe { attend_avx512(tile, scratch, out) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c,fma")]
fn attend_avx512(
    tile: &super::attention::AttnTile<'_>,
    scratch: &mut super::attention::AttnScratch,
    out: &mut [f32],
) {
    let one_pass: (ScoresF16, ValuesF16) = (scores_f16, values_f16);
    super::attention::attend_impl(tile, scratch, out, F16Ops::new(widen_f16, Some(one_pass)));
}

/// [`ScoresF16`]: each key row converted (`vcvtph2ps`) as it is loaded, the
/// accumulators in registers.
///
/// # Panics
/// When `nr` is not 1..=4, the slices are shorter than the shapes say, or on a CPU
/// without the features [`available`] checks.
fn scores_f16(nr: usize, q: &[f32], k: &[half::f16], out: &mut [f32]) {
    assert!(
        (1..=ROWS).contains(&nr)
            && q.len() >= nr * 64
            && k.len() >= 64 * 16
            && out.len() >= nr * 16,
        "one-pass scores of {nr} rows: q {}, keys {}, out {}",
        q.len(),
        k.len(),
        out.len()
    );
    assert!(available(), "AVX-512 attention called on a CPU without it");
    // SAFETY: the lengths were checked above against what the body reads and writes,
    // and the features it is compiled for just above.
    unsafe {
        match nr {
            1 => scores_f16_avx512::<1>(q, k, out),
            2 => scores_f16_avx512::<2>(q, k, out),
            3 => scores_f16_avx512::<3>(q, k, out),
            _ => scores_f16_avx512::<4>(q, k, out),
        }
    }
}

/// # Safety
/// `q` holds `NR * 64` values, `k` `64 * 16`, `out` `NR * 16`; the CPU has AVX-512F and
/// F16C.
#[target_feature(enable = "avx512f,f16c,fma")]
unsafe fn scores_f16_avx512<const NR: usize>(q: &[f32], k: &[half::f16], out: &mut [f32]) {
    let mut even = [_mm512_setzero_ps(); NR];
    let mut odd = [_mm512_setzero_ps(); NR];
    let keys = k.as_ptr().cast::<__m256i>();
    for d in (0..64).step_by(2) {
        // SAFETY: rows d and d + 1 of 16 f16 (32 bytes each) lie within the 64 rows of
        // `k`; the loads are unaligned.
        let (r0, r1) = unsafe {
            (
                _mm512_cvtph_ps(_mm256_loadu_si256(keys.add(d))),
                _mm512_cvtph_ps(_mm256_loadu_si256(keys.add(d + 1))),
            )
        };
        for j in 0..NR {
            let row = &q[j * 64..][..64];
            even[j] = _mm512_fmadd_ps(_mm512_set1_ps(row[d]), r0, even[j]);
            odd[j] = _mm512_fmadd_ps(_mm512_set1_ps(row[d + 1]), r1, odd[j]);
        }
    }
    for j in 0..NR {
        let dst = &mut out[j * 16..][..16];
        // SAFETY: `dst` holds the 16 values stored; the store is unaligned.
        unsafe { _mm512_storeu_ps(dst.as_mut_ptr(), _mm512_add_ps(even[j], odd[j])) };
    }
}

/// [`ValuesF16`]: each value row converted as it is loaded, the rows' sums in
/// registers.
///
/// # Panics
/// When `nr` is not 1..=4, `v` holds fewer than the most visible slots' rows, `out`
/// fewer than `nr` rows, or on a CPU without the features [`available`] checks.
fn values_f16(w: &BlockWeights<'_>, nr: usize, v: &[half::f16], out: &mut [f32]) {
    let most = w.visible[..nr.min(ROWS)].iter().copied().max().unwrap_or(0);
    assert!(
        (1..=ROWS).contains(&nr)
            && v.len() >= most * 64
            && out.len() >= nr * 64
            && most <= w.bs
            && w.p.len() >= (nr - 1) * w.bs + most,
        "one-pass values of {nr} rows: {most} slots, values {}, out {}",
        v.len(),
        out.len()
    );
    assert!(available(), "AVX-512 attention called on a CPU without it");
    // SAFETY: the lengths were checked above against what the body reads and writes,
    // and the features it is compiled for just above.
    unsafe {
        match nr {
            1 => values_f16_avx512::<1>(w, most, v, out),
            2 => values_f16_avx512::<2>(w, most, v, out),
            3 => values_f16_avx512::<3>(w, most, v, out),
            _ => values_f16_avx512::<4>(w, most, v, out),
        }
    }
}

/// # Safety
/// `v` holds `most * 64` values and `out` `NR * 64`; the CPU has AVX-512F and F16C.
#[target_feature(enable = "avx512f,f16c,fma")]
unsafe fn values_f16_avx512<const NR: usize>(
    w: &BlockWeights<'_>,
    most: usize,
    v: &[half::f16],
    out: &mut [f32],
) {
    let mut acc = [[_mm512_setzero_ps(); 4]; NR];
    for (j, a) in acc.iter_mut().enumerate() {
        for (c, x) in a.iter_mut().enumerate() {
            // SAFETY: row j's 64 outputs lie within `out`; the load is unaligned.
            *x = unsafe { _mm512_loadu_ps(out.as_ptr().add(j * 64 + c * 16)) };
            if w.rescale[j] != 1.0 {
                *x = _mm512_mul_ps(*x, _mm512_set1_ps(w.rescale[j]));
            }
        }
    }
    let values = v.as_ptr().cast::<__m256i>();
    for slot in 0..most {
        // SAFETY: slot < most, and `v` holds `most` rows of 64 f16 (four 32-byte
        // loads each); the loads are unaligned.
        let row: [__m512; 4] = unsafe {
            let at = values.add(slot * 4);
            [
                _mm512_cvtph_ps(_mm256_loadu_si256(at)),
                _mm512_cvtph_ps(_mm256_loadu_si256(at.add(1))),
                _mm512_cvtph_ps(_mm256_loadu_si256(at.add(2))),
                _mm512_cvtph_ps(_mm256_loadu_si256(at.add(3))),
            ]
        };
        for (j, a) in acc.iter_mut().enumerate() {
            if slot < w.visible[j] {
                let p = _mm512_set1_ps(w.p[j * w.bs + slot]);
                for (x, r) in a.iter_mut().zip(&row) {
                    *x = _mm512_fmadd_ps(p, *r, *x);
                }
            }
        }
    }
    for (j, a) in acc.iter().enumerate() {
        for (c, x) in a.iter().enumerate() {
            // SAFETY: row j's 64 outputs lie within `out`; the store is unaligned.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(j * 64 + c * 16), *x) };
        }
    }
}

/// [`super::attention::WidenF16`] 16 values at a time (`vcvtph2ps`), exact as every
/// path's conversion.
///
/// # Panics
/// When `src` and `dst` differ in length, or on a CPU without the features
/// [`available`] checks.
pub fn widen_f16(src: &[half::f16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "f16 → f32 of two lengths");
    assert!(available(), "avx512 conversion called on a CPU without it");
    // SAFETY: the features the function is compiled for were checked just above.
    unsafe { widen_f16_avx512(src, dst) }
}

#[target_feature(enable = "avx512f,f16c")]
fn widen_f16_avx512(src: &[half::f16], dst: &mut [f32]) {
    use half::slice::HalfFloatSliceExt as _;
    use std::arch::x86_64::{_mm256_loadu_si256, _mm512_cvtph_ps, _mm512_storeu_ps};
    let whole = src.len() / 16 * 16;
    for i in (0..whole).step_by(16) {
        // SAFETY: i + 16 <= whole <= the length of both slices (asserted equal), and
        // the load and store are unaligned.
        unsafe {
            let h = _mm256_loadu_si256(src.as_ptr().add(i).cast());
            _mm512_storeu_ps(dst.as_mut_ptr().add(i), _mm512_cvtph_ps(h));
        }
    }
    src[whole..].convert_to_f32_slice(&mut dst[whole..]);
}

/// [`super::pack::quantize_blocks`] 16 values at a time, the same bits: the largest
/// magnitude is exact in any order, `vcvtps2dq` rounds to nearest even as the
/// portable rounding does, and values that are not numbers are masked to 0 as the
/// portable cast makes them.
///
/// # Panics
/// When the slices are not whole blocks of one count, or on a CPU without the
/// features [`available`] checks.
pub fn quantize_blocks(x: &[f32], q: &mut [i8], d: &mut [f32], s: &mut [f32], qsum: &mut [i32]) {
    assert!(
        available(),
        "avx512 quantization called on a CPU without it"
    );
    let blocks = d.len();
    assert!(x.len() == blocks * QK && q.len() == x.len());
    assert!(s.len() == blocks && qsum.len() == blocks);
    // SAFETY: the features the function is compiled for were checked just above.
    unsafe { quantize_blocks_avx512(x, q, d, s, qsum) }
}

#[target_feature(enable = "avx512f,avx512bw")]
fn quantize_blocks_avx512(x: &[f32], q: &mut [i8], d: &mut [f32], s: &mut [f32], qsum: &mut [i32]) {
    use super::pack::{block_scale, store_block_sums};
    use std::arch::x86_64::{
        _CMP_ORD_Q, _mm_storeu_si128, _mm512_abs_ps, _mm512_cmp_ps_mask, _mm512_cvtepi32_epi8,
        _mm512_loadu_ps, _mm512_maskz_cvtps_epi32, _mm512_maskz_mov_ps, _mm512_max_epi32,
        _mm512_min_epi32, _mm512_reduce_add_epi32, _mm512_reduce_max_ps,
    };
    let (lo, hi) = (_mm512_set1_epi32(-127), _mm512_set1_epi32(127));
    for (bi, (xb, qb)) in x.chunks_exact(QK).zip(q.chunks_exact_mut(QK)).enumerate() {
        // SAFETY: xb holds QK = 32 floats, read unaligned.
        let halves = unsafe {
            [
                _mm512_loadu_ps(xb.as_ptr()),
                _mm512_loadu_ps(xb.as_ptr().add(16)),
            ]
        };
        let magnitude = |v: __m512| {
            _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_ORD_Q>(v, v), _mm512_abs_ps(v))
        };
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(magnitude(halves[0]), magnitude(halves[1])));
        let (dv, id) = block_scale(amax);
        let idv = _mm512_set1_ps(id);
        let mut sum = _mm512_setzero_si512();
        for (h, &v) in halves.iter().enumerate() {
            let scaled = _mm512_mul_ps(v, idv);
            let ordered = _mm512_cmp_ps_mask::<_CMP_ORD_Q>(scaled, scaled);
            let r = _mm512_maskz_cvtps_epi32(ordered, scaled);
            let r = _mm512_min_epi32(_mm512_max_epi32(r, lo), hi);
            sum = _mm512_add_epi32(sum, r);
            // SAFETY: qb holds 32 bytes; this half's 16 are written unaligned.
            unsafe {
                _mm_storeu_si128(qb.as_mut_ptr().add(16 * h).cast(), _mm512_cvtepi32_epi8(r))
            };
        }
        store_block_sums(bi, (dv, _mm512_reduce_add_epi32(sum)), d, s, qsum);
    }
}
