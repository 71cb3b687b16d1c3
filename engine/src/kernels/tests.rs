//! Property tests: every kernel path against plain dequantize-then-multiply.

use half::f16;
use proptest::prelude::*;

use super::pack::dequantize_matrix;
use super::*;

fn random_blocks(format: WeightFormat, rows: usize, cols: usize, seed: &[u8]) -> Vec<u8> {
    let nb = rows * cols / QK;
    let mut out = Vec::with_capacity(nb * format.block_bytes());
    let mut it = seed.iter().cycle().copied();
    let mut next = move || it.next().unwrap_or(0);
    for i in 0..nb {
        let d =
            f16::from_f32(0.001 + f32::from(next()) / 2048.0 * if i % 3 == 0 { 4.0 } else { 1.0 });
        out.extend_from_slice(&d.to_le_bytes());
        match format {
            WeightFormat::Q4_1 => {
                let m = f16::from_f32(-f32::from(next()) / 512.0);
                out.extend_from_slice(&m.to_le_bytes());
                for _ in 0..QK / 2 {
                    out.push(next());
                }
            }
            WeightFormat::Q8_0 => {
                for _ in 0..QK {
                    out.push(next());
                }
            }
            _ => unreachable!("float formats are not packed"),
        }
    }
    out
}

/// Exact product plus the bound on what 8-bit activations may change: each
/// activation moves by at most half a quantization step `d_x / 2` (plus the f16
/// rounding of `d_x`, relative 2^-11 of `|x|`), so a row moves by at most
/// `sum |w| * (d_x / 2 + |x| 2^-10)`.
fn reference(w: &[f32], x: &[f32], rows: usize, cols: usize, n: usize) -> (Vec<f64>, Vec<f64>) {
    let mut exact = vec![0f64; n * rows];
    let mut bound = vec![0f64; n * rows];
    for t in 0..n {
        let xr = &x[t * cols..(t + 1) * cols];
        for r in 0..rows {
            let wr = &w[r * cols..(r + 1) * cols];
            let mut s = 0f64;
            let mut b = 0f64;
            for (wb, xb) in wr.chunks(QK).zip(xr.chunks(QK)) {
                let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
                for (&wv, &xv) in wb.iter().zip(xb) {
                    s += f64::from(wv) * f64::from(xv);
                    b += f64::from(wv.abs())
                        * (f64::from(amax) / 127.0 * 0.51 + f64::from(xv.abs()) / 1024.0);
                }
            }
            exact[t * rows + r] = s;
            bound[t * rows + r] = b + 1e-4 * s.abs() + 1e-5;
        }
    }
    (exact, bound)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn products_match_dequantized_reference(
        rows in 1usize..41,
        cb in 1usize..5,
        // Past two row blocks of `matmul`'s task grid (64 rows each), ragged ends included.
        n in 1usize..140,
        q8 in any::<bool>(),
        seed in proptest::collection::vec(any::<u8>(), 64..256),
        xs in proptest::collection::vec(-4.0f32..4.0, 1..64),
    ) {
        let cols = cb * QK;
        let format = if q8 { WeightFormat::Q8_0 } else { WeightFormat::Q4_1 };
        let raw = random_blocks(format, rows, cols, &seed);
        let dense = dequantize_matrix(format, &raw, rows, cols).unwrap();
        // Split the rows in two parts to exercise packing of stacked tensors.
        let split = rows / 2 * format.row_bytes(cols).unwrap();
        let packed = PackedMatrix::pack(cols, &[
            RowSource { format, rows: rows / 2, data: &raw[..split] },
            RowSource { format, rows: rows - rows / 2, data: &raw[split..] },
        ]).unwrap();
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            packed.dequantize_row(r, &mut row);
            prop_assert_eq!(&row[..], &dense[r * cols..(r + 1) * cols]);
        }
        let x: Vec<f32> = (0..n * cols).map(|i| xs[i % xs.len()] * (1.0 + (i % 7) as f32 * 0.3)).collect();
        let (exact, bound) = reference(&dense, &x, rows, cols, n);
        let mut acts = QuantActs::default();
        acts.quantize(Isa::Scalar, &x, n, cols).unwrap();
        let mut results = Vec::new();
        for isa in Isa::all_available() {
            let mut out = vec![0f32; n * rows];
            matmul(isa, &packed, &acts, &mut out).unwrap();
            for i in 0..n * rows {
                prop_assert!((f64::from(out[i]) - exact[i]).abs() <= bound[i],
                    "{isa:?} {format:?} [{i}]: {} vs exact {} (bound {})", out[i], exact[i], bound[i]);
            }
            results.push(out);
        }
        // The SIMD and scalar kernels compute the same integer sums; only float
        // association differs.
        for other in &results[1..] {
            for (a, b) in results[0].iter().zip(other) {
                prop_assert!((a - b).abs() <= 1e-4 * a.abs().max(1.0));
            }
        }
    }
}

/// The rows of `raw` (`rows` × `nb` blocks of `format`), keeping blocks `blocks` of
/// each: one rank's row-parallel shard.
fn column_shard(
    format: WeightFormat,
    raw: &[u8],
    nb: usize,
    blocks: std::ops::Range<usize>,
) -> Vec<u8> {
    let bb = format.block_bytes();
    raw.chunks_exact(nb * bb)
        .flat_map(|row| &row[blocks.start * bb..blocks.end * bb])
        .copied()
        .collect()
}

fn exact_product(
    isa: Isa,
    format: WeightFormat,
    raw: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
) -> Vec<i64> {
    let packed = PackedMatrix::pack(
        cols,
        &[RowSource {
            format,
            rows,
            data: raw,
        }],
    )
    .unwrap();
    let mut acts = QuantActs::default();
    acts.quantize(Isa::Scalar, x, n, cols).unwrap();
    let mut out = vec![0i64; n * rows];
    matmul_exact(isa, &packed, &acts, &mut out).unwrap();
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Exact sums: the same bits on every instruction set, within the float
    /// kernels' bound of the dequantized product, and the same bits again when the
    /// columns are split in three and the parts' sums are added in any order (what
    /// a tensor group's ranks and its all-reduce do).
    #[test]
    fn exact_products_are_the_same_bits_on_every_path_and_split(
        rows in 1usize..41,
        cb in 1usize..9,
        // Past two row blocks of `matmul`'s task grid, ragged ends and every tile
        // height included.
        n in 1usize..140,
        q8 in any::<bool>(),
        cuts in (0usize..9, 0usize..9),
        seed in proptest::collection::vec(any::<u8>(), 64..256),
        xs in proptest::collection::vec(-4.0f32..4.0, 1..64),
    ) {
        let cols = cb * QK;
        let format = if q8 { WeightFormat::Q8_0 } else { WeightFormat::Q4_1 };
        let raw = random_blocks(format, rows, cols, &seed);
        let dense = dequantize_matrix(format, &raw, rows, cols).unwrap();
        let x: Vec<f32> = (0..n * cols).map(|i| xs[i % xs.len()] * (1.0 + (i % 7) as f32 * 0.3)).collect();
        let (exact, bound) = reference(&dense, &x, rows, cols, n);
        let whole = exact_product(Isa::Scalar, format, &raw, rows, cols, &x, n);
        for (i, v) in whole.iter().enumerate() {
            let got = f64::from(exact::to_f32(*v));
            prop_assert!((got - exact[i]).abs() <= bound[i],
                "{format:?} [{i}]: {got} vs exact {} (bound {})", exact[i], bound[i]);
        }
        for isa in Isa::all_available() {
            prop_assert_eq!(&exact_product(isa, format, &raw, rows, cols, &x, n), &whole, "{:?}", isa);
        }
        // Three column ranges (some may be empty), on the fastest path.
        let (a, b) = (cuts.0.min(cb), cuts.1.min(cb));
        let (a, b) = (a.min(b), a.max(b));
        let mut sum = vec![0i64; n * rows];
        for blocks in [b..cb, 0..a, a..b] {
            if blocks.is_empty() {
                continue;
            }
            let part = column_shard(format, &raw, cb, blocks.clone());
            let xcols = blocks.len() * QK;
            let xp: Vec<f32> = x.chunks_exact(cols)
                .flat_map(|r| &r[blocks.start * QK..blocks.end * QK])
                .copied()
                .collect();
            let partial = exact_product(Isa::detect(), format, &part, rows, xcols, &xp, n);
            exact::add(&mut sum, &partial);
        }
        prop_assert_eq!(sum, whole);
    }
}

#[test]
fn fixed_point_rounds_to_even_and_saturates() {
    assert_eq!(exact::fixed(2.5), 2);
    assert_eq!(exact::fixed(3.5), 4);
    assert_eq!(exact::fixed(-2.5), -2);
    assert_eq!(exact::fixed(-0.75), -1);
    let limit = 1i64 << 51;
    assert_eq!(exact::fixed(exact::TERM_LIMIT), limit);
    assert_eq!(exact::fixed(1e30), limit);
    assert_eq!(exact::fixed(f32::NEG_INFINITY), -limit);
    assert_eq!(
        exact::fixed(f32::NAN),
        -limit,
        "a NaN takes the lower bound"
    );
    for v in [1.0f32, -0.1, 3.25e-3, 1234.5678] {
        let back = exact::to_f32(exact::fixed(v * exact::SCALE));
        assert!(
            (back - v).abs() <= 2f32.powi(-33) + v.abs() * f32::EPSILON,
            "{v} came back as {back}"
        );
    }
    let mut acc = [i64::MAX, 1];
    exact::add(&mut acc, &[1, 2]);
    assert_eq!(acc, [i64::MIN, 3], "adds wrap, never panic");
}

/// Terms past the limit saturate at it on every path, and a row wider than the
/// sums can hold is refused.
#[test]
fn exact_products_saturate_huge_terms_and_refuse_too_many() {
    // The largest f16 scale and quants times activations of 60,000: each block's
    // term is about 1.6e13, past 2^19.
    let (rows, cols, nb) = (3, 4 * QK, 4);
    let mut raw = Vec::new();
    for _ in 0..rows * nb {
        raw.extend_from_slice(&f16::MAX.to_le_bytes());
        raw.extend_from_slice(&[127u8; QK]);
    }
    let x = vec![60_000f32; 2 * cols];
    for isa in Isa::all_available() {
        let out = exact_product(isa, WeightFormat::Q8_0, &raw, rows, cols, &x, 2);
        assert_eq!(out, vec![4 * (1i64 << 51); 2 * rows], "{isa:?}");
        let neg: Vec<f32> = x.iter().map(|v| -v).collect();
        let out = exact_product(isa, WeightFormat::Q8_0, &raw, rows, cols, &neg, 2);
        assert_eq!(out, vec![-4 * (1i64 << 51); 2 * rows], "{isa:?}");
    }
    let wide = (exact::MAX_TERMS + 1) * QK;
    let raw = random_blocks(WeightFormat::Q4_1, 1, wide, &[9, 8, 7]);
    let m = PackedMatrix::pack(
        wide,
        &[RowSource {
            format: WeightFormat::Q4_1,
            rows: 1,
            data: &raw,
        }],
    )
    .unwrap();
    let mut acts = QuantActs::default();
    acts.quantize(Isa::Scalar, &vec![0.5; wide], 1, wide)
        .unwrap();
    let err = matmul_exact(Isa::Scalar, &m, &acts, &mut [0i64; 1]).unwrap_err();
    assert!(matches!(err, KernelError::Unsupported(_)), "{err}");
}

#[test]
fn quantized_activations_follow_ggml() {
    let x: Vec<f32> = (0..32).map(|i| i as f32 - 15.5).collect();
    let mut a = QuantActs::default();
    a.quantize(Isa::Scalar, &x, 1, 32).unwrap();
    assert_eq!(a.d[0], f16::from_f32(15.5 / 127.0).to_f32());
    assert_eq!(a.q[31], 127);
    assert_eq!(a.q[0], -127);
    assert_eq!(a.qsum[0], a.q.iter().map(|&q| i32::from(q)).sum::<i32>());
    let zeros = vec![0f32; 64];
    a.quantize(Isa::Scalar, &zeros, 2, 32).unwrap();
    assert!(a.q.iter().all(|&q| q == 0) && a.d.iter().all(|&d| d == 0.0));
    assert!(a.quantize(Isa::Scalar, &zeros, 1, 48).is_err());
}

#[test]
fn mismatched_shapes_are_errors() {
    let raw = random_blocks(WeightFormat::Q4_1, 2, 32, &[1, 2, 3]);
    assert!(
        PackedMatrix::pack(
            64,
            &[RowSource {
                format: WeightFormat::Q4_1,
                rows: 2,
                data: &raw
            }]
        )
        .is_err()
    );
    let m = PackedMatrix::pack(
        32,
        &[RowSource {
            format: WeightFormat::Q4_1,
            rows: 2,
            data: &raw,
        }],
    )
    .unwrap();
    let mut acts = QuantActs::default();
    acts.quantize(Isa::Scalar, &[0.5; 64], 1, 64).unwrap();
    assert!(matmul(Isa::Scalar, &m, &acts, &mut [0.0; 2]).is_err());
    let f = [0u8; 8];
    assert!(
        PackedMatrix::pack(
            32,
            &[RowSource {
                format: WeightFormat::F32,
                rows: 2,
                data: &f
            }]
        )
        .is_err()
    );
}

proptest! {
    #[test]
    fn every_path_quantizes_activations_as_the_portable_code(
        rows in 1usize..6,
        blocks in 1usize..5,
        seed in any::<u64>(),
        specials in proptest::collection::vec((0usize..1000, 0usize..6), 0..4),
    ) {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let cols = blocks * QK;
        let mut x: Vec<f32> = (0..rows * cols)
            .map(|_| rng.random_range(-8.0f32..8.0) * 10f32.powi(rng.random_range(-3..3)))
            .collect();
        // Zero blocks, ties (ggml rounds 0.5 steps to even), and values that are not
        // finite numbers must all come out the same.
        let len = x.len();
        x[..QK.min(len)].fill(0.0);
        for (at, kind) in specials {
            x[at % len] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -0.0, 127.0, 0.5][kind];
        }
        let mut want = QuantActs::default();
        want.quantize(Isa::Scalar, &x, rows, cols).unwrap();
        for isa in Isa::all_available() {
            let mut got = QuantActs::default();
            got.quantize(isa, &x, rows, cols).unwrap();
            prop_assert_eq!(&got.q, &want.q, "{:?}", isa);
            prop_assert_eq!(&got.qsum, &want.qsum, "{:?}", isa);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&got.d), bits(&want.d), "{:?}", isa);
            prop_assert_eq!(bits(&got.s), bits(&want.s), "{:?}", isa);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// The fused product gives the bits of the product followed by `ops::swiglu`, on
    /// every path, past two row blocks and with several groups per half.
    #[test]
    fn fused_swiglu_is_the_product_then_swiglu(
        half_groups in 1usize..4,
        cb in 1usize..4,
        n in 1usize..140,
        q8 in any::<bool>(),
        seed in proptest::collection::vec(any::<u8>(), 64..256),
        xs in proptest::collection::vec(-4.0f32..4.0, 1..64),
    ) {
        let (ffn, cols) = (half_groups * GROUP, cb * QK);
        let format = if q8 { WeightFormat::Q8_0 } else { WeightFormat::Q4_1 };
        let raw = random_blocks(format, 2 * ffn, cols, &seed);
        let half = ffn * format.row_bytes(cols).unwrap();
        let packed = PackedMatrix::pack(cols, &[
            RowSource { format, rows: ffn, data: &raw[..half] },
            RowSource { format, rows: ffn, data: &raw[half..] },
        ]).unwrap();
        let x: Vec<f32> = (0..n * cols).map(|i| xs[i % xs.len()] * (1.0 + (i % 5) as f32 * 0.4)).collect();
        let mut acts = QuantActs::default();
        acts.quantize(Isa::Scalar, &x, n, cols).unwrap();
        for isa in Isa::all_available() {
            let mut gate_up = vec![0f32; n * 2 * ffn];
            matmul(isa, &packed, &acts, &mut gate_up).unwrap();
            let mut expected = vec![0f32; n * ffn];
            ops::swiglu(&gate_up, ffn, &mut expected);
            let mut fused = vec![f32::NAN; n * ffn];
            matmul_swiglu(isa, &packed, &acts, &mut fused).unwrap();
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&fused), bits(&expected), "{:?} {:?}", isa, format);
        }
    }
}

#[test]
fn fused_swiglu_refuses_halves_of_partial_groups() {
    let raw = random_blocks(WeightFormat::Q4_1, 2 * 8, 32, &[7, 9, 11]);
    let m = PackedMatrix::pack(
        32,
        &[RowSource {
            format: WeightFormat::Q4_1,
            rows: 16,
            data: &raw,
        }],
    )
    .unwrap();
    let mut acts = QuantActs::default();
    acts.quantize(Isa::Scalar, &[0.5; 32], 1, 32).unwrap();
    let err = matmul_swiglu(Isa::Scalar, &m, &acts, &mut [0.0; 8]).unwrap_err();
    assert!(err.to_string().contains("whole 16-row groups"), "{err}");
}
