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
        acts.quantize(&x, n, cols).unwrap();
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

#[test]
fn quantized_activations_follow_ggml() {
    let x: Vec<f32> = (0..32).map(|i| i as f32 - 15.5).collect();
    let mut a = QuantActs::default();
    a.quantize(&x, 1, 32).unwrap();
    assert_eq!(a.d[0], f16::from_f32(15.5 / 127.0).to_f32());
    assert_eq!(a.q[31], 127);
    assert_eq!(a.q[0], -127);
    assert_eq!(a.qsum[0], a.q.iter().map(|&q| i32::from(q)).sum::<i32>());
    let zeros = vec![0f32; 64];
    a.quantize(&zeros, 2, 32).unwrap();
    assert!(a.q.iter().all(|&q| q == 0) && a.d.iter().all(|&d| d == 0.0));
    assert!(a.quantize(&zeros, 1, 48).is_err());
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
    acts.quantize(&[0.5; 64], 1, 64).unwrap();
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
