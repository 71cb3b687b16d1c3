//! The adapter loader's checks, each refusal with its reason, on tiny files built
//! in memory; and the low-rank product against a plain reference.

use std::path::Path;

use half::f16;

use super::*;
use crate::model::gguf::write::GgufWriter;
use crate::model::gguf::{GgmlType, Value};

/// A base "model" with the tensors the loader looks at: a llama file whose layer 0
/// has q (8→8), k (8→4) and down (16→8).
fn base_file() -> GgufFile {
    let w = |n: usize| vec![0f32; n];
    let bytes = GgufWriter::new()
        .metadata("general.architecture", Value::String("llama".into()))
        .metadata("general.type", Value::String("model".into()))
        .tensor_f32("blk.0.attn_q.weight", &[8, 8], &w(64))
        .tensor_f32("blk.0.attn_k.weight", &[8, 4], &w(32))
        .tensor_f32("blk.0.ffn_down.weight", &[16, 8], &w(128))
        .tensor_f32("blk.0.attn_norm.weight", &[8], &w(8))
        .to_bytes();
    GgufFile::from_bytes(bytes).expect("base")
}

fn base(file: &GgufFile) -> BaseModel<'_> {
    BaseModel {
        file,
        path: Path::new("/nonexistent/base.gguf"),
        sha256: Some(Sha256Digest([7; 32])),
        served_name: "smol",
    }
}

/// Deterministic values in (-1, 1).
fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = (i as u32)
                .wrapping_mul(2_654_435_761)
                .wrapping_add(seed.wrapping_mul(40_503));
            (x % 2001) as f32 / 1000.0 - 1.0
        })
        .collect()
}

/// The metadata of a valid adapter, alpha 4.
fn adapter_meta() -> GgufWriter {
    GgufWriter::new()
        .metadata("general.architecture", Value::String("llama".into()))
        .metadata("general.type", Value::String("adapter".into()))
        .metadata("adapter.type", Value::String("lora".into()))
        .metadata("adapter.lora.alpha", Value::F32(4.0))
}

/// A valid rank-2 adapter of q and down.
fn good() -> GgufWriter {
    adapter_meta()
        .tensor_f32("blk.0.attn_q.weight.lora_a", &[8, 2], &values(16, 1))
        .tensor_f32("blk.0.attn_q.weight.lora_b", &[2, 8], &values(16, 2))
        .tensor_f32("blk.0.ffn_down.weight.lora_a", &[16, 2], &values(32, 3))
        .tensor_f32("blk.0.ffn_down.weight.lora_b", &[2, 8], &values(16, 4))
}

fn read_bytes(w: &GgufWriter) -> Result<(f32, Vec<LayerPairs>), LoraProblem> {
    let file = GgufFile::from_bytes(w.to_bytes()).expect("adapter parses");
    let b = base_file();
    read(&file, &base(&b), &mut Some(Sha256Digest([7; 32])))
}

#[test]
fn a_valid_adapter_loads_with_alpha_over_rank() {
    let (alpha, layers) = read_bytes(&good()).expect("loads");
    assert_eq!(alpha, 4.0);
    assert_eq!(layers.len(), 1);
    let q = layers[0][Projection::Q as usize].as_ref().expect("q pair");
    assert_eq!((q.rank(), q.cols(), q.rows(), q.scale()), (2, 8, 8, 2.0));
    let down = layers[0][Projection::Down as usize]
        .as_ref()
        .expect("down pair");
    assert_eq!((down.rank(), down.cols(), down.rows()), (2, 16, 8));
    assert!(layers[0][Projection::K as usize].is_none());
    // A: 2 rows of 8, as stored.
    assert_eq!(q.a, values(16, 1));
}

#[test]
fn no_alpha_means_scale_one_as_in_llama_cpp() {
    let w = GgufWriter::new()
        .metadata("general.architecture", Value::String("llama".into()))
        .metadata("general.type", Value::String("adapter".into()))
        .metadata("adapter.type", Value::String("lora".into()))
        .tensor_f32("blk.0.attn_k.weight.lora_a", &[8, 3], &values(24, 1))
        .tensor_f32("blk.0.attn_k.weight.lora_b", &[3, 4], &values(12, 2));
    let (alpha, layers) = read_bytes(&w).expect("loads");
    assert_eq!(alpha, 0.0);
    assert_eq!(
        layers[0][Projection::K as usize]
            .as_ref()
            .map(LoraPair::scale),
        Some(1.0)
    );
}

#[test]
fn f16_tensors_are_widened() {
    let half = |v: &[f32]| -> Vec<u8> {
        v.iter()
            .flat_map(|x| f16::from_f32(*x).to_le_bytes())
            .collect()
    };
    let (a, b) = (values(16, 1), values(16, 2));
    let w = adapter_meta()
        .tensor(
            "blk.0.attn_q.weight.lora_a",
            GgmlType::F16,
            &[8, 2],
            half(&a),
        )
        .tensor(
            "blk.0.attn_q.weight.lora_b",
            GgmlType::F16,
            &[2, 8],
            half(&b),
        );
    let (_, layers) = read_bytes(&w).expect("loads");
    let q = layers[0][Projection::Q as usize].as_ref().expect("q");
    for (x, y) in q.a.iter().zip(&a) {
        assert_eq!(*x, f16::from_f32(*y).to_f32());
    }
}

#[test]
fn a_file_that_is_not_an_adapter_is_refused() {
    let b = base_file();
    // The base model itself.
    let err = read(&b, &base(&b), &mut None).expect_err("a model is no adapter");
    assert!(
        matches!(&err, LoraProblem::NotAnAdapter { found: Some(t) } if t == "model"),
        "{err}"
    );
    assert!(err.to_string().contains("not a LoRA adapter"), "{err}");
    let no_type = GgufWriter::new()
        .metadata("general.architecture", Value::String("llama".into()))
        .tensor_f32("blk.0.attn_q.weight.lora_a", &[8, 2], &values(16, 1));
    assert!(matches!(
        read_bytes(&no_type),
        Err(LoraProblem::NotAnAdapter { found: None })
    ));
}

#[test]
fn another_architecture_or_adapter_type_is_refused() {
    let w = GgufWriter::new()
        .metadata("general.architecture", Value::String("qwen2".into()))
        .metadata("general.type", Value::String("adapter".into()))
        .metadata("adapter.type", Value::String("lora".into()));
    let err = read_bytes(&w).expect_err("qwen2");
    assert!(err.to_string().contains("\"qwen2\""), "{err}");
    let w = GgufWriter::new()
        .metadata("general.architecture", Value::String("llama".into()))
        .metadata("general.type", Value::String("adapter".into()))
        .metadata("adapter.type", Value::String("control_vector".into()));
    assert!(matches!(
        read_bytes(&w),
        Err(LoraProblem::AdapterType { .. })
    ));
}

#[test]
fn wrong_shapes_and_ranks_are_refused_with_the_tensor() {
    // lora_a reads 6 columns where attn_q has 8.
    let w = adapter_meta()
        .tensor_f32("blk.0.attn_q.weight.lora_a", &[6, 2], &values(12, 1))
        .tensor_f32("blk.0.attn_q.weight.lora_b", &[2, 8], &values(16, 2));
    let err = read_bytes(&w).expect_err("wrong cols");
    assert!(
        matches!(&err, LoraProblem::Shape { tensor, .. } if tensor == "blk.0.attn_q.weight.lora_a"),
        "{err}"
    );
    // lora_b writes 8 rows where attn_k has 4.
    let w = adapter_meta()
        .tensor_f32("blk.0.attn_k.weight.lora_a", &[8, 2], &values(16, 1))
        .tensor_f32("blk.0.attn_k.weight.lora_b", &[2, 8], &values(16, 2));
    let err = read_bytes(&w).expect_err("wrong rows");
    assert!(
        err.to_string().contains("blk.0.attn_k.weight.lora_b"),
        "{err}"
    );
    // Rank 2 against rank 3.
    let w = adapter_meta()
        .tensor_f32("blk.0.attn_q.weight.lora_a", &[8, 2], &values(16, 1))
        .tensor_f32("blk.0.attn_q.weight.lora_b", &[3, 8], &values(24, 2));
    let err = read_bytes(&w).expect_err("rank mismatch");
    assert!(
        matches!(
            err,
            LoraProblem::Rank {
                a_rank: 2,
                b_rank: 3,
                ..
            }
        ),
        "{err}"
    );
    // A 3-D tensor.
    let w = adapter_meta()
        .tensor_f32("blk.0.attn_q.weight.lora_a", &[8, 2, 1], &values(16, 1))
        .tensor_f32("blk.0.attn_q.weight.lora_b", &[2, 8], &values(16, 2));
    assert!(matches!(read_bytes(&w), Err(LoraProblem::Shape { .. })));
}

#[test]
fn tensors_the_engine_cannot_apply_are_refused() {
    let pair = |w: GgufWriter, name: &str| {
        w.tensor_f32(&format!("{name}.lora_a"), &[8, 2], &values(16, 1))
            .tensor_f32(&format!("{name}.lora_b"), &[2, 8], &values(16, 2))
    };
    // A layer the base does not have.
    let err = read_bytes(&pair(adapter_meta(), "blk.3.attn_q.weight")).expect_err("blk.3");
    assert!(
        matches!(&err, LoraProblem::NotInBase(t) if t.starts_with("blk.3.")),
        "{err}"
    );
    // The output head: llama.cpp could, this engine does not.
    let err = read_bytes(&pair(adapter_meta(), "output.weight")).expect_err("output");
    assert!(matches!(err, LoraProblem::UnsupportedTarget(_)), "{err}");
    // Half a pair.
    let w = adapter_meta().tensor_f32("blk.0.attn_q.weight.lora_b", &[2, 8], &values(16, 2));
    let err = read_bytes(&w).expect_err("half");
    assert!(
        matches!(
            err,
            LoraProblem::MissingHalf {
                present: "lora_b",
                missing: "lora_a",
                ..
            }
        ),
        "{err}"
    );
    // A tensor that is no LoRA half.
    let w = good().tensor_f32("blk.0.attn_q.bias", &[8], &values(8, 1));
    assert!(matches!(
        read_bytes(&w),
        Err(LoraProblem::UnexpectedTensor(_))
    ));
    // A quantized half.
    let w = adapter_meta()
        .tensor(
            "blk.0.attn_q.weight.lora_a",
            GgmlType::Q8_0,
            &[32, 2],
            vec![0; 68],
        )
        .tensor_f32("blk.0.attn_q.weight.lora_b", &[2, 8], &values(16, 2));
    assert!(matches!(read_bytes(&w), Err(LoraProblem::Dtype { .. })));
    // Nothing at all.
    assert!(matches!(
        read_bytes(&adapter_meta()),
        Err(LoraProblem::Empty)
    ));
}

#[test]
fn norm_tensors_are_skipped_as_llama_cpp_skips_them() {
    let w = good().tensor_f32("blk.0.attn_norm.weight", &[8], &values(8, 1));
    let (_, layers) = read_bytes(&w).expect("loads");
    assert_eq!(layers[0].iter().flatten().count(), 2);
}

#[test]
fn a_recorded_base_hash_must_be_the_served_models() {
    let b = base_file();
    let recorded = |hex: &str| {
        GgufFile::from_bytes(
            good()
                .metadata(BASE_SHA256_KEY, Value::String(hex.into()))
                .to_bytes(),
        )
        .expect("adapter")
    };
    let ours = hex::encode([7u8; 32]);
    read(
        &recorded(&ours),
        &base(&b),
        &mut Some(Sha256Digest([7; 32])),
    )
    .expect("same base");
    let err = read(
        &recorded(&hex::encode([8u8; 32])),
        &base(&b),
        &mut Some(Sha256Digest([7; 32])),
    )
    .expect_err("other base");
    assert!(matches!(err, LoraProblem::BaseModel { .. }), "{err}");
    assert!(err.to_string().contains(BASE_SHA256_KEY), "{err}");
}

fn write(dir: &Path, name: &str, w: &GgufWriter) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, w.to_bytes()).expect("write");
    p
}

#[test]
fn load_adapters_verifies_the_sha256_first_and_names_the_adapter() {
    let dir = tempfile::tempdir().expect("tempdir");
    let good_path = write(dir.path(), "good.gguf", &good());
    let (digest, _) = file_sha256(&good_path).expect("hash");
    let b = base_file();
    let spec = |name: &str, path: &Path, sha256| slipway_contract::LoraAdapter {
        name: name.into(),
        path: path.to_owned(),
        sha256,
    };
    let loaded = load_adapters(&[spec("sql", &good_path, Some(digest))], &base(&b)).expect("loads");
    assert_eq!(loaded[0].identity(), format!("sql@sha256:{digest}"));
    assert_eq!(loaded[0].num_pairs(), 2);
    // Without a digest it loads too, and the identity still has the file's hash.
    let loaded = load_adapters(&[spec("sql", &good_path, None)], &base(&b)).expect("loads");
    assert_eq!(loaded[0].sha256(), digest);

    let err = load_adapters(
        &[spec("sql", &good_path, Some(Sha256Digest([1; 32])))],
        &base(&b),
    )
    .expect_err("wrong digest");
    assert!(err.is_rejection());
    let msg = err.to_string();
    assert!(
        msg.starts_with("LoRA adapter \"sql\" (") && msg.contains("failed verification"),
        "{msg}"
    );
    // A sha256 mismatch is found before the content is parsed.
    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"not gguf").expect("write");
    let err = load_adapters(&[spec("j", &junk, Some(Sha256Digest([1; 32])))], &base(&b))
        .expect_err("junk");
    assert!(err.is_rejection(), "{err}");
    let err = load_adapters(&[spec("j", &junk, None)], &base(&b)).expect_err("junk");
    assert!(matches!(*err.problem, LoraProblem::Gguf(_)), "{err}");
    assert!(!err.is_rejection());

    let err = load_adapters(&[spec("smol", &good_path, None)], &base(&b)).expect_err("name");
    assert!(matches!(*err.problem, LoraProblem::NameTaken), "{err}");
    let err = load_adapters(
        &[spec("gone", &dir.path().join("gone.gguf"), None)],
        &base(&b),
    )
    .expect_err("missing file");
    assert!(err.to_string().contains("gone.gguf"), "{err}");
}

#[test]
fn the_product_is_scale_b_a_x_and_independent_of_other_rows() {
    let (rank, cols, rows) = (3, 20, 11);
    let (a, b) = (values(rank * cols, 5), values(rows * rank, 6));
    let pair = LoraPair::new(rank, cols, rows, a.clone(), b.clone(), 0.75);
    let n = 9;
    let x = values(n * cols, 7);
    let width = rows + 4;
    let mut out = vec![1.0f32; n * width];
    pair.add_rows(&x, &mut out, width, 2);
    for t in 0..n {
        let xr = &x[t * cols..(t + 1) * cols];
        let tmp: Vec<f64> = (0..rank)
            .map(|k| {
                (0..cols)
                    .map(|i| f64::from(a[k * cols + i]) * f64::from(xr[i]))
                    .sum()
            })
            .collect();
        for j in 0..width {
            let want = if (2..2 + rows).contains(&j) {
                let jj = j - 2;
                1.0 + 0.75
                    * (0..rank)
                        .map(|k| f64::from(b[jj * rank + k]) * tmp[k])
                        .sum::<f64>()
            } else {
                1.0
            };
            let got = f64::from(out[t * width + j]);
            assert!(
                (got - want).abs() < 1e-4,
                "row {t} col {j}: {got} vs {want}"
            );
        }
    }
    // Row 4 alone gives bit-for-bit the row it gave among nine.
    let mut alone = vec![1.0f32; width];
    pair.add_rows(&x[4 * cols..5 * cols], &mut alone, width, 2);
    assert_eq!(alone, out[4 * width..5 * width]);
}
