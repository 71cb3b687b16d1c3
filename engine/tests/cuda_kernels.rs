//! Each CUDA kernel against an independent CPU implementation (the CPU backend's
//! kernels, or a property of the result), one test body per kernel run on every
//! device (candle's `test_device!` pattern):
//! - `*_cpu`: the device is `CpuDevice`, whose kernels are the CPU twins — so in
//!   `make test` (no GPU) the bodies run and the twins are checked;
//! - `*_cuda` (feature `cuda`, run by `make test-gpu` on a GPU machine): the device is
//!   the GPU. Without a GPU these fail, saying why: they never skip.
//!
//! Tolerances are stated per test: they cover f32 summation order (the kernels reduce
//! in trees, the references in sequence or in f64) and, for values stored as f16, one
//! rounding step of f16.

// A failed device call fails the test with the call's error.
#![allow(clippy::unwrap_used)]

use half::f16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use slipway_engine::backend::device::twin::{
    KvParams, MatShape, QuantFormat, SampleParams, from_f16_bits, to_f16_bits,
};
use slipway_engine::backend::device::{Device, RopeParams};
use slipway_engine::kernels::attention::{AttnScratch, AttnTile, F16Ops, KvLayout, attend_impl};
use slipway_engine::kernels::ops;
use slipway_engine::kernels::quant::{WeightFormat, dequantize_row};
use slipway_engine::kv::KvCache;
use slipway_engine::sampling::argmax;

macro_rules! test_device {
    ($body:ident) => {
        paste_tests!($body);
    };
}

/// Instantiates `$body` per device: `<body>_cpu` always, `<body>_cuda` with `cuda`.
macro_rules! paste_tests {
    ($body:ident) => {
        mod $body {
            #[test]
            fn cpu() {
                super::$body(&slipway_engine::backend::device::CpuDevice);
            }

            #[cfg(feature = "cuda")]
            #[test]
            fn cuda() {
                super::$body(&super::gpu());
            }
        }
    };
}

#[cfg(feature = "cuda")]
fn gpu() -> slipway_engine::backend::cuda::gpu::CudaDevice {
    slipway_engine::backend::cuda::gpu::CudaDevice::open(0)
        .unwrap_or_else(|e| panic!("the CUDA kernel tests need a GPU: {e}"))
}

fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

fn randn(r: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| r.random_range(-1.0f32..1.0) * scale)
        .collect()
}

/// Random ggml blocks for `rows × cols`.
fn random_blocks(r: &mut StdRng, fmt: QuantFormat, rows: usize, cols: usize) -> Vec<u8> {
    let nb = rows * cols / 32;
    let mut out = Vec::with_capacity(nb * fmt.block_bytes());
    for _ in 0..nb {
        let d = f16::from_f32(r.random_range(0.001f32..0.05));
        out.extend_from_slice(&d.to_le_bytes());
        match fmt {
            QuantFormat::Q4_1 => {
                let m = f16::from_f32(r.random_range(-0.2f32..0.0));
                out.extend_from_slice(&m.to_le_bytes());
                out.extend((0..16).map(|_| r.random::<u8>()));
            }
            QuantFormat::Q8_0 => out.extend((0..32).map(|_| r.random::<u8>())),
        }
    }
    out
}

fn weight_format(fmt: QuantFormat) -> WeightFormat {
    match fmt {
        QuantFormat::Q4_1 => WeightFormat::Q4_1,
        QuantFormat::Q8_0 => WeightFormat::Q8_0,
    }
}

fn dequantized(fmt: QuantFormat, w: &[u8], rows: usize, cols: usize) -> Vec<f32> {
    let rb = cols / 32 * fmt.block_bytes();
    let mut out = vec![0f32; rows * cols];
    for r in 0..rows {
        dequantize_row(
            weight_format(fmt),
            &w[r * rb..(r + 1) * rb],
            &mut out[r * cols..(r + 1) * cols],
        )
        .expect("row");
    }
    out
}

/// `|a - b| <= atol + rtol * |b|` elementwise, with the first offender in the message.
fn assert_close(what: &str, got: &[f32], want: &[f32], atol: f32, rtol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= atol + rtol * w.abs(),
            "{what}: element {i}: got {g}, want {w} (atol {atol}, rtol {rtol})"
        );
    }
}

// Tolerance: exact (dequantization is the same two f16 loads, one multiply, one add).
fn embed_gathers_rows<D: Device>(d: &D) {
    let mut r = rng(1);
    let (vocab, dim) = (50, 96);
    for fmt in [QuantFormat::Q8_0, QuantFormat::Q4_1] {
        let table = random_blocks(&mut r, fmt, vocab, dim);
        let tokens = [3u32, 0, 49, 3, 17];
        let mut out = d.zeros::<f32>(tokens.len() * dim).unwrap();
        d.embed(
            fmt,
            &d.upload(&table).unwrap(),
            &d.upload(&tokens).unwrap(),
            &mut out,
            tokens.len(),
            dim,
        )
        .unwrap();
        let got = d.read(&out, tokens.len() * dim).unwrap();
        let all = dequantized(fmt, &table, vocab, dim);
        let want: Vec<f32> = tokens
            .iter()
            .flat_map(|&t| all[t as usize * dim..(t as usize + 1) * dim].to_vec())
            .collect();
        assert_close(&format!("embed {fmt:?}"), &got, &want, 0.0, 0.0);
    }
}
test_device!(embed_gathers_rows);

// Tolerance: 1e-5 relative (f32 tree sum vs the CPU's f64 sum of squares).
fn rms_norm_selects_and_normalizes_rows<D: Device>(d: &D) {
    let mut r = rng(2);
    let (n, dim, eps) = (6, 576, 1e-5);
    let x = randn(&mut r, n * dim, 3.0);
    let w = randn(&mut r, dim, 1.0);
    let rows = [5u32, 0, 2];
    let mut out = d.zeros::<f32>(rows.len() * dim).unwrap();
    d.rms_norm(
        &d.upload(&x).unwrap(),
        &d.upload(&w).unwrap(),
        &d.upload(&rows).unwrap(),
        &mut out,
        rows.len(),
        dim,
        eps,
    )
    .unwrap();
    let got = d.read(&out, rows.len() * dim).unwrap();
    let sel: Vec<f32> = rows
        .iter()
        .flat_map(|&i| x[i as usize * dim..][..dim].to_vec())
        .collect();
    let mut want = vec![0f32; sel.len()];
    ops::rms_norm(&sel, &w, eps, &mut want);
    assert_close("rms_norm", &got, &want, 1e-6, 1e-5);
}
test_device!(rms_norm_selects_and_normalizes_rows);

// Tolerance: the residual sum exactly; the norm 1e-5 relative.
fn add_rms_norm_updates_the_residual<D: Device>(d: &D) {
    let mut r = rng(3);
    let (n, dim, eps) = (4, 576, 1e-5);
    let x = randn(&mut r, n * dim, 2.0);
    let y = randn(&mut r, n * dim, 2.0);
    let w = randn(&mut r, dim, 1.0);
    let mut xb = d.upload(&x).unwrap();
    let mut out = d.zeros::<f32>(n * dim).unwrap();
    d.add_rms_norm(
        &mut xb,
        &d.upload(&y).unwrap(),
        &d.upload(&w).unwrap(),
        &mut out,
        n,
        dim,
        eps,
    )
    .unwrap();
    let sum: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
    assert_close("residual", &d.read(&xb, n * dim).unwrap(), &sum, 0.0, 0.0);
    let mut want = vec![0f32; n * dim];
    ops::rms_norm(&sum, &w, eps, &mut want);
    assert_close(
        "add_rms_norm",
        &d.read(&out, n * dim).unwrap(),
        &want,
        1e-6,
        1e-5,
    );
    let mut xb = d.upload(&x).unwrap();
    d.add(&mut xb, &d.upload(&y).unwrap(), n * dim).unwrap();
    assert_close("add", &d.read(&xb, n * dim).unwrap(), &sum, 0.0, 0.0);
}
test_device!(add_rms_norm_updates_the_residual);

// Tolerance: 1e-5 × sum(|w||x|) per output (f32 accumulation in any order).
fn matmul_matches_dequantized_product<D: Device>(d: &D) {
    let mut r = rng(4);
    // Rows not a multiple of the tiles; token counts on both sides of the switch from
    // the decode kernel to the tiled one (8), and past one tile (32).
    for fmt in [QuantFormat::Q4_1, QuantFormat::Q8_0] {
        for &(rows, cols, n) in &[
            (70, 64, 1),
            (131, 576, 3),
            (64, 96, 8),
            (77, 576, 9),
            (200, 1536, 40),
        ] {
            let w = random_blocks(&mut r, fmt, rows, cols);
            let x = randn(&mut r, n * cols, 1.0);
            // Written into the middle of wider rows, as stacked projections are.
            let (ldy, yoff) = (rows + 5, 3);
            let mut y = d.upload(&vec![7.0f32; n * ldy]).unwrap();
            let shape = MatShape {
                rows,
                cols,
                n,
                ldy,
                yoff,
            };
            d.matmul(
                fmt,
                &d.upload(&w).unwrap(),
                &d.upload(&x).unwrap(),
                &mut y,
                shape,
            )
            .unwrap();
            let got = d.read(&y, n * ldy).unwrap();
            let wf = dequantized(fmt, &w, rows, cols);
            for t in 0..n {
                for c in 0..ldy {
                    let g = got[t * ldy + c];
                    if c < yoff || c >= yoff + rows {
                        assert_eq!(
                            g, 7.0,
                            "{fmt:?} {rows}x{cols} n={n}: wrote outside its columns at ({t},{c})"
                        );
                        continue;
                    }
                    let row = &wf[(c - yoff) * cols..][..cols];
                    let xr = &x[t * cols..][..cols];
                    let want: f64 = row
                        .iter()
                        .zip(xr)
                        .map(|(a, b)| f64::from(*a) * f64::from(*b))
                        .sum();
                    let mag: f64 = row
                        .iter()
                        .zip(xr)
                        .map(|(a, b)| f64::from((a * b).abs()))
                        .sum();
                    assert!(
                        (f64::from(g) - want).abs() <= 1e-5 * mag + 1e-6,
                        "{fmt:?} {rows}x{cols} n={n} ({t},{c}): got {g}, want {want}"
                    );
                }
            }
        }
    }
}
test_device!(matmul_matches_dequantized_product);

// Tolerance: 1e-6 relative (expf vs Rust's exp).
fn silu_mul_matches_swiglu<D: Device>(d: &D) {
    let mut r = rng(5);
    let (n, ffn) = (3, 1536);
    let gu = randn(&mut r, n * 2 * ffn, 6.0);
    let mut out = d.zeros::<f32>(n * ffn).unwrap();
    d.silu_mul(&d.upload(&gu).unwrap(), &mut out, ffn, n)
        .unwrap();
    let mut want = vec![0f32; n * ffn];
    ops::swiglu(&gu, ffn, &mut want);
    assert_close(
        "silu_mul",
        &d.read(&out, n * ffn).unwrap(),
        &want,
        1e-6,
        1e-5,
    );
}
test_device!(silu_mul_matches_swiglu);

const HEADS: usize = 9;
const KV_HEADS: usize = 3;
const HD: usize = 64;
const BS: usize = 16;
const BLOCKS: usize = 24;

fn kv_params(layer: usize) -> KvParams {
    KvParams {
        layer,
        num_blocks: BLOCKS,
        block_size: BS,
        n_heads: HEADS,
        n_kv_heads: KV_HEADS,
        head_dim: HD,
    }
}

// Tolerance: q 1e-5 relative + 1e-6; stored k/v within one f16 step (2^-10 relative):
// the rotation's cos/sin may round differently, which can move an f16 rounding.
fn rope_rotates_q_and_stores_kv<D: Device>(d: &D) {
    let mut r = rng(6);
    let p = kv_params(1);
    let width = p.qkv_width();
    let positions = [0u32, 5, 17, 300, 4095];
    let slots: Vec<u32> = [7usize, 0, 23, 12, 5]
        .iter()
        .enumerate()
        .map(|(i, &b)| (b * BS + (i * 5) % BS) as u32)
        .collect();
    let n = positions.len();
    let qkv = randn(&mut r, n * width, 2.0);
    let (base, rope_dims) = (100_000.0f32, HD);
    let rope = RopeParams {
        rope_dims,
        theta_scale: base.powf(-2.0 / rope_dims as f32),
    };
    let mut q = d.upload(&qkv).unwrap();
    let mut kc = d.zeros::<u16>(p.cache_len(2)).unwrap();
    let mut vc = d.zeros::<u16>(p.cache_len(2)).unwrap();
    d.rope_store_kv(
        &mut q,
        &d.upload(&positions).unwrap(),
        &d.upload(&slots).unwrap(),
        &mut kc,
        &mut vc,
        &p,
        rope,
        n,
    )
    .unwrap();
    let got_q = d.read(&q, n * width).unwrap();
    let kc = d.read(&kc, p.cache_len(2)).unwrap();
    let vc = d.read(&vc, p.cache_len(2)).unwrap();
    // Reference: the CPU backend's RoPE and its KV cache (a different layout).
    let layout = KvLayout {
        block_size: BS,
        kv_heads: KV_HEADS,
        head_dim: HD,
    };
    let cpu_kv = KvCache::new(2, BLOCKS, layout);
    let mut written = 0;
    for t in 0..n {
        let mut row = qkv[t * width..(t + 1) * width].to_vec();
        let table = ops::rope_table(positions[t] as usize, rope_dims, base);
        ops::rope_in_place(&mut row[..(HEADS + KV_HEADS) * HD], HD, &table);
        assert_close(
            "rotated q",
            &got_q[t * width..t * width + HEADS * HD],
            &row[..HEADS * HD],
            1e-5,
            1e-5,
        );
        assert_eq!(
            &got_q[t * width + HEADS * HD..(t + 1) * width],
            &qkv[t * width + HEADS * HD..(t + 1) * width],
            "k/v in the row are left as they were"
        );
        let (k, v) = row[HEADS * HD..].split_at(KV_HEADS * HD);
        let (blk, off) = (slots[t] as usize / BS, slots[t] as usize % BS);
        cpu_kv.write(1, blk as u32, off, k, v);
        let layer = cpu_kv.layer(1);
        for h in 0..KV_HEADS {
            for dd in 0..HD {
                let want_k = layer[layout.offset(blk, false, h) + dd * BS + off].to_f32();
                let want_v = layer[layout.offset(blk, true, h) + off * HD + dd].to_f32();
                let got_k = from_f16_bits(kc[p.at(blk, h, off) + dd]);
                let got_v = from_f16_bits(vc[p.at(blk, h, off) + dd]);
                assert!(
                    (got_k - want_k).abs() <= want_k.abs() / 1024.0 + 1e-6,
                    "k t={t} h={h} d={dd}: {got_k} vs {want_k}"
                );
                assert_eq!(got_v, want_v, "v t={t} h={h} d={dd}");
                written += 2;
            }
        }
    }
    // Nothing else was written: layer 0 and unused slots stay zero.
    let nonzero = kc.iter().chain(&vc).filter(|&&b| b != 0).count();
    assert!(
        nonzero <= written,
        "{nonzero} non-zero cache entries, {written} written"
    );
    assert!(
        kc[..p.cache_len(1)].iter().all(|&b| b == 0),
        "layer 0 untouched"
    );
}
test_device!(rope_rotates_q_and_stores_kv);

// Tolerance: 2e-5 absolute + 1e-4 relative (f32; different summation orders and exp).
fn paged_attention_matches_cpu_attention<D: Device>(d: &D) {
    let mut r = rng(7);
    let p = kv_params(1);
    let width = p.qkv_width();
    // Random f16 keys and values in every block of layer 1, the same in both layouts.
    let layout = KvLayout {
        block_size: BS,
        kv_heads: KV_HEADS,
        head_dim: HD,
    };
    let cpu_kv = KvCache::new(2, BLOCKS, layout);
    let mut kc = vec![0u16; p.cache_len(2)];
    let mut vc = vec![0u16; p.cache_len(2)];
    for blk in 0..BLOCKS {
        for off in 0..BS {
            let k: Vec<f32> = randn(&mut r, KV_HEADS * HD, 1.5)
                .iter()
                .map(|&v| from_f16_bits(to_f16_bits(v)))
                .collect();
            let v: Vec<f32> = randn(&mut r, KV_HEADS * HD, 1.0)
                .iter()
                .map(|&v| from_f16_bits(to_f16_bits(v)))
                .collect();
            cpu_kv.write(1, blk as u32, off, &k, &v);
            for h in 0..KV_HEADS {
                for dd in 0..HD {
                    kc[p.at(blk, h, off) + dd] = to_f16_bits(k[h * HD + dd]);
                    vc[p.at(blk, h, off) + dd] = to_f16_bits(v[h * HD + dd]);
                }
            }
        }
    }
    // Three sequences with scattered tables; tokens at several context lengths
    // (1, a block edge, past 32 lanes, most of the pool).
    let tables: Vec<Vec<u32>> = vec![
        vec![5, 2, 9],
        vec![
            0, 23, 11, 4, 17, 8, 1, 3, 6, 7, 10, 12, 13, 14, 15, 16, 18, 19, 20, 21,
        ],
        vec![22],
    ];
    let toks: Vec<(usize, u32)> =
        vec![(0, 0), (0, 15), (0, 16), (0, 40), (1, 33), (1, 319), (2, 9)];
    let mut flat = Vec::new();
    let mut offs = Vec::new();
    for t in &tables {
        offs.push(flat.len() as u32);
        flat.extend_from_slice(t);
    }
    let n = toks.len();
    let qkv = randn(&mut r, n * width, 1.0);
    let pos: Vec<u32> = toks.iter().map(|t| t.1).collect();
    let toff: Vec<u32> = toks.iter().map(|t| offs[t.0]).collect();
    let scale = 1.0 / (HD as f32).sqrt();
    let mut out = d.zeros::<f32>(n * HEADS * HD).unwrap();
    d.paged_attention(
        &d.upload(&qkv).unwrap(),
        &d.upload(&kc).unwrap(),
        &d.upload(&vc).unwrap(),
        &d.upload(&flat).unwrap(),
        &d.upload(&toff).unwrap(),
        &d.upload(&pos).unwrap(),
        &mut out,
        &p,
        scale,
        n,
    )
    .unwrap();
    let got = d.read(&out, n * HEADS * HD).unwrap();
    let group = HEADS / KV_HEADS;
    let mut scratch = AttnScratch::default();
    let cpu_layer = cpu_kv.layer(1);
    for (t, &(seq, ps)) in toks.iter().enumerate() {
        for kh in 0..KV_HEADS {
            let tile = AttnTile {
                layer: &cpu_layer,
                layout,
                table: &tables[seq],
                pos: ps as usize,
                tokens: 1,
                kv_head: kh,
                group,
                q: &qkv[t * width + kh * group * HD..][..group * HD],
                q_stride: width,
                scale,
                next: None,
            };
            let mut want = vec![0f32; group * HD];
            attend_impl(&tile, &mut scratch, &mut want, F16Ops::portable());
            let g = &got[(t * HEADS + kh * group) * HD..][..group * HD];
            assert_close(
                &format!("attention token {t} (pos {ps}) kv head {kh}"),
                g,
                &want,
                2e-5,
                1e-4,
            );
        }
    }
}
test_device!(paged_attention_matches_cpu_attention);

// Tolerance: exact (argmax; ties go to the lowest index).
fn argmax_picks_the_lowest_maximum<D: Device>(d: &D) {
    let mut r = rng(8);
    let (rows, vocab) = (5, 49152);
    let mut logits = randn(&mut r, rows * vocab, 10.0);
    // Row 1: a tie between 100 and 40000; row 2: the last element; row 3: all equal.
    logits[vocab + 100] = 50.0;
    logits[vocab + 40000] = 50.0;
    logits[2 * vocab + vocab - 1] = 60.0;
    logits[3 * vocab..4 * vocab].fill(-1.0);
    let mut out = d.zeros::<u32>(rows).unwrap();
    d.argmax_rows(&d.upload(&logits).unwrap(), rows, vocab, &mut out)
        .unwrap();
    let got = d.read(&out, rows).unwrap();
    let want: Vec<u32> = logits
        .chunks_exact(vocab)
        .map(|row| argmax(row) as u32)
        .collect();
    assert_eq!(got, want);
    assert_eq!(&got[1..4], &[100, vocab as u32 - 1, 0]);
}
test_device!(argmax_picks_the_lowest_maximum);

// Tolerance: each candidate is picked for its probability's share of evenly spaced
// uniforms, within one pick (no randomness: uniforms are (i + 0.5) / N).
fn sampling_follows_top_k_top_p<D: Device>(d: &D) {
    let vocab = 1000;
    let mut r = rng(9);
    let base: Vec<f32> = randn(&mut r, vocab, 1.0);
    let mut row = base.clone();
    // Five clear candidates above the rest.
    let top = [
        (321usize, 6.0f32),
        (7, 5.5),
        (999, 5.0),
        (500, 4.0),
        (42, 3.0),
    ];
    for &(i, v) in &top {
        row[i] = v;
    }
    let n = 2000;
    let logits: Vec<f32> = (0..n).flat_map(|_| row.clone()).collect();
    let uniforms: Vec<f32> = (0..n).map(|i| (i as f32 + 0.5) / n as f32).collect();
    let lb = d.upload(&logits).unwrap();
    let ub = d.upload(&uniforms).unwrap();
    let mut scratch = d.zeros::<f32>(n * vocab).unwrap();
    for (p, kept) in [
        (
            SampleParams {
                top_k: 3,
                top_p: 1.0,
                temperature: 1.0,
            },
            3,
        ),
        (
            SampleParams {
                top_k: 5,
                top_p: 0.9,
                temperature: 0.7,
            },
            0,
        ),
        (
            SampleParams {
                top_k: 1,
                top_p: 1.0,
                temperature: 2.0,
            },
            1,
        ),
    ] {
        let mut out = d.zeros::<u32>(n).unwrap();
        d.sample_top_k_top_p(&lb, &mut scratch, 0..n, vocab, p, &ub, &mut out)
            .unwrap();
        let got = d.read(&out, n).unwrap();
        // Expected shares: softmax over the top_k at the temperature, cut at top_p.
        let w: Vec<f64> = top[..p.top_k]
            .iter()
            .map(|&(_, v)| f64::from((v - top[0].1) / p.temperature).exp())
            .collect();
        let total: f64 = w.iter().sum();
        let mut keep = w.len();
        let mut acc = 0.0;
        for (i, q) in w.iter().enumerate() {
            acc += q / total;
            if acc >= f64::from(p.top_p) {
                keep = i + 1;
                break;
            }
        }
        if kept > 0 {
            assert_eq!(keep, kept, "test setup");
        }
        let kept_total: f64 = w[..keep].iter().sum();
        for (i, &(id, _)) in top.iter().enumerate() {
            let count = got.iter().filter(|&&g| g as usize == id).count() as f64;
            let want = if i < keep {
                w[i] / kept_total * n as f64
            } else {
                0.0
            };
            assert!(
                (count - want).abs() <= 1.0,
                "{p:?}: token {id} picked {count} times, want {want:.1}"
            );
        }
        assert!(
            got.iter()
                .all(|&g| top[..keep].iter().any(|t| t.0 == g as usize)),
            "{p:?}: picked outside the kept candidates"
        );
    }
    // Out-of-range settings are refused, not run.
    let mut out = d.zeros::<u32>(n).unwrap();
    for bad in [
        SampleParams {
            top_k: 0,
            top_p: 1.0,
            temperature: 1.0,
        },
        SampleParams {
            top_k: 257,
            top_p: 1.0,
            temperature: 1.0,
        },
        SampleParams {
            top_k: 5,
            top_p: 0.0,
            temperature: 1.0,
        },
        SampleParams {
            top_k: 5,
            top_p: 1.0,
            temperature: 0.0,
        },
    ] {
        assert!(
            d.sample_top_k_top_p(&lb, &mut scratch, 0..n, vocab, bad, &ub, &mut out)
                .is_err(),
            "{bad:?} accepted"
        );
    }
}
test_device!(sampling_follows_top_k_top_p);
