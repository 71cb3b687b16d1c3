//! Reader tests on files built by [`GgufWriter`]: every value type, layout rules,
//! and the hostile-input checks (each must be an error, never a panic).

use super::write::GgufWriter;
use super::*;

fn every_value_type() -> GgufWriter {
    GgufWriter::new()
        .metadata("general.architecture", Value::String("llama".into()))
        .metadata("u8", Value::U8(200))
        .metadata("i8", Value::I8(-100))
        .metadata("u16", Value::U16(60_000))
        .metadata("i16", Value::I16(-30_000))
        .metadata("u32", Value::U32(4_000_000_000))
        .metadata("i32", Value::I32(-2_000_000_000))
        .metadata("f32", Value::F32(1e-5))
        .metadata("bool", Value::Bool(true))
        .metadata("string", Value::String("héllo ✓".into()))
        .metadata("u64", Value::U64(u64::MAX))
        .metadata("i64", Value::I64(i64::MIN))
        .metadata("f64", Value::F64(-0.25))
        .metadata(
            "a.str",
            Value::Array(Array::String(vec!["a".into(), "".into(), "ü".into()])),
        )
        .metadata("a.i32", Value::Array(Array::I32(vec![1, -2, 3])))
        .metadata("a.f32", Value::Array(Array::F32(vec![0.5, -1.5])))
        .metadata("a.bool", Value::Array(Array::Bool(vec![true, false])))
        .metadata("a.u8", Value::Array(Array::U8(vec![])))
        .metadata(
            "a.nested",
            Value::Array(Array::Array(vec![
                Array::U16(vec![1, 2]),
                Array::String(vec!["x".into()]),
            ])),
        )
}

fn small_model() -> GgufWriter {
    every_value_type()
        .tensor_f32("a", &[4, 2], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
        // 64 elements of Q4_1 = 2 blocks of 20 bytes.
        .tensor("q", GgmlType::Q4_1, &[64], (0..40).collect())
        .tensor("scalar", GgmlType::F16, &[], vec![0x00, 0x3c])
}

#[test]
fn every_metadata_type_round_trips() {
    let w = every_value_type();
    let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
    let m = f.metadata();
    assert_eq!(f.version(), 3);
    assert_eq!(m.len(), 19);
    for (key, value) in &w.metadata {
        assert_eq!(m.get(key), Some(value), "{key}");
    }
    assert_eq!(m.architecture().unwrap(), "llama");
    assert_eq!(m.get_str("string").unwrap(), "héllo ✓");
    assert_eq!(m.get_str_array("a.str").unwrap(), ["a", "", "ü"]);
    assert_eq!(m.get_f32_array("a.f32").unwrap(), [0.5, -1.5]);
    assert_eq!(m.get_u32("u32").unwrap(), 4_000_000_000);
    // File order is kept.
    assert_eq!(m.iter().nth(1).unwrap().0, "u8");
}

#[test]
fn tensors_are_located_and_sized_by_type() {
    let f = GgufFile::from_bytes(small_model().to_bytes()).unwrap();
    assert_eq!(f.tensors().len(), 3);
    assert_eq!(f.data_offset() % DEFAULT_ALIGNMENT, 0);

    let a = f.tensor("a").unwrap();
    assert_eq!(
        (a.dtype, a.dims, a.row_len(), a.n_rows()),
        (GgmlType::F32, &[4, 2][..], 4, 2)
    );
    let floats: Vec<f32> = a
        .data
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(floats, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]);

    let q = f.tensor("q").unwrap();
    assert_eq!(q.data, (0..40).collect::<Vec<u8>>());
    assert_eq!(f.tensor_info("q").unwrap().offset % DEFAULT_ALIGNMENT, 0);

    let s = f.tensor("scalar").unwrap();
    assert_eq!((s.n_elements(), s.data), (1, &[0x00, 0x3c][..]));

    assert_eq!(
        f.tensor("nope").unwrap_err().to_string(),
        "missing tensor nope"
    );
}

#[test]
fn custom_alignment_is_honoured() {
    let bytes = GgufWriter::new()
        .metadata("general.alignment", Value::U32(64))
        .tensor_f32("x", &[3], &[1.0, 2.0, 3.0])
        .tensor_f32("y", &[1], &[4.0])
        .to_bytes();
    let f = GgufFile::from_bytes(bytes).unwrap();
    assert_eq!(f.alignment(), 64);
    assert_eq!(f.data_offset() % 64, 0);
    assert_eq!(f.tensor_info("y").unwrap().offset, 64);
    assert_eq!(f.tensor("y").unwrap().data, 4.0f32.to_le_bytes());
}

#[test]
fn bad_alignment_is_rejected() {
    for a in [0u32, 3, 48] {
        let bytes = GgufWriter::new()
            .metadata("general.alignment", Value::U32(a))
            .to_bytes();
        assert!(
            matches!(GgufFile::from_bytes(bytes), Err(GgufError::BadAlignment(_))),
            "{a}"
        );
    }
    let bytes = GgufWriter::new()
        .metadata("general.alignment", Value::String("32".into()))
        .to_bytes();
    assert!(matches!(
        GgufFile::from_bytes(bytes),
        Err(GgufError::KeyType { .. })
    ));
}

#[test]
fn every_truncation_is_an_error() {
    let bytes = small_model().to_bytes();
    // The last tensor's padding is not data, so only cuts before its end must fail.
    let f = GgufFile::from_bytes(bytes.clone()).unwrap();
    let s = f.tensor_info("scalar").unwrap();
    let needed = (f.data_offset() + s.offset + s.size) as usize;
    for cut in 0..needed {
        assert!(
            GgufFile::from_bytes(bytes[..cut].to_vec()).is_err(),
            "cut at {cut}"
        );
    }
}

#[test]
fn header_errors_are_specific() {
    let good = GgufWriter::new().to_bytes();
    let mut bad = good.clone();
    bad[0] = b'X';
    assert!(matches!(
        GgufFile::from_bytes(bad),
        Err(GgufError::BadMagic(_))
    ));

    let mut v1 = good.clone();
    v1[4..8].copy_from_slice(&1u32.to_le_bytes());
    assert!(matches!(
        GgufFile::from_bytes(v1),
        Err(GgufError::UnsupportedVersion(1))
    ));

    let mut be = good.clone();
    be[4..8].copy_from_slice(&3u32.to_be_bytes());
    assert!(matches!(
        GgufFile::from_bytes(be),
        Err(GgufError::BigEndian(_))
    ));
}

#[test]
fn huge_counts_fail_before_allocating() {
    // Header claiming 2^60 metadata pairs in a 24-byte file.
    let mut bytes = GgufWriter::new().to_bytes();
    bytes[16..24].copy_from_slice(&(1u64 << 60).to_le_bytes());
    assert!(matches!(
        GgufFile::from_bytes(bytes),
        Err(GgufError::CountTooLarge {
            what: "metadata",
            ..
        })
    ));

    let mut bytes = GgufWriter::new().to_bytes();
    bytes[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(
        GgufFile::from_bytes(bytes),
        Err(GgufError::CountTooLarge { what: "tensor", .. })
    ));

    // An array whose length field claims u64::MAX strings.
    let mut bytes = GgufWriter::new()
        .metadata("k", Value::Array(Array::String(vec![])))
        .to_bytes();
    let len_at = bytes.len() - 8;
    bytes[len_at..].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(
        GgufFile::from_bytes(bytes),
        Err(GgufError::CountTooLarge { .. })
    ));

    // A string whose length exceeds the file.
    let mut bytes = GgufWriter::new()
        .metadata("k", Value::String("abc".into()))
        .to_bytes();
    let len_at = bytes.len() - 3 - 8;
    bytes[len_at..len_at + 8].copy_from_slice(&(u64::MAX - 1).to_le_bytes());
    assert!(matches!(
        GgufFile::from_bytes(bytes),
        Err(GgufError::Truncated { .. })
    ));
}

#[test]
fn deep_nesting_is_refused() {
    let mut a = Array::U8(vec![1]);
    for _ in 0..MAX_ARRAY_DEPTH {
        a = Array::Array(vec![a]);
    }
    let bytes = GgufWriter::new()
        .metadata("deep", Value::Array(a))
        .to_bytes();
    assert!(matches!(
        GgufFile::from_bytes(bytes),
        Err(GgufError::ArrayTooDeep { .. })
    ));
}

#[test]
fn structural_errors_in_metadata() {
    let dup = GgufWriter::new()
        .metadata("k", Value::U8(1))
        .metadata("k", Value::U8(2))
        .to_bytes();
    assert!(matches!(GgufFile::from_bytes(dup), Err(GgufError::DuplicateKey(k)) if k == "k"));

    let mut unknown = GgufWriter::new().metadata("k", Value::U8(1)).to_bytes();
    let type_at = unknown.len() - 1 - 4;
    unknown[type_at..type_at + 4].copy_from_slice(&13u32.to_le_bytes());
    assert_eq!(
        GgufFile::from_bytes(unknown).unwrap_err().to_string(),
        "metadata key k has value type id 13, which GGUF does not define"
    );

    let mut not_utf8 = GgufWriter::new()
        .metadata("k", Value::String("ab".into()))
        .to_bytes();
    let n = not_utf8.len();
    not_utf8[n - 1] = 0xff;
    assert!(matches!(
        GgufFile::from_bytes(not_utf8),
        Err(GgufError::InvalidUtf8 { .. })
    ));
}

#[test]
fn tensor_type_errors_name_type_and_tensor() {
    let unknown = GgufWriter::new()
        .tensor_raw("blk.0.w", 99, &[32], vec![0; 32])
        .to_bytes();
    assert_eq!(
        GgufFile::from_bytes(unknown).unwrap_err().to_string(),
        "unsupported tensor type id 99 in tensor blk.0.w"
    );

    // A known layout the kernels do not handle: the file opens (so its tokenizer
    // and metadata stay usable) but its data is refused by name.
    let q4k = GgufWriter::new()
        .tensor("blk.0.ffn", GgmlType::Q4K, &[256], vec![0; 144])
        .to_bytes();
    let f = GgufFile::from_bytes(q4k).unwrap();
    assert_eq!(
        f.tensor("blk.0.ffn").unwrap_err().to_string(),
        "unsupported tensor type Q4_K in tensor blk.0.ffn"
    );
    assert_eq!(f.raw_tensor("blk.0.ffn").unwrap().data.len(), 144);
}

#[test]
fn tensor_layout_errors() {
    let partial_block = GgufWriter::new()
        .tensor("t", GgmlType::Q8_0, &[33], vec![0; 68])
        .to_bytes();
    assert!(matches!(
        GgufFile::from_bytes(partial_block),
        Err(GgufError::BadShape { .. })
    ));

    let five_dims = GgufWriter::new()
        .tensor_f32("t", &[1, 1, 1, 1, 1], &[0.0])
        .to_bytes();
    assert!(matches!(
        GgufFile::from_bytes(five_dims),
        Err(GgufError::TooManyDims { n_dims: 5, .. })
    ));

    let overflow = GgufWriter::new()
        .tensor_f32("t", &[u64::MAX / 2, 4], &[0.0])
        .to_bytes();
    assert!(matches!(
        GgufFile::from_bytes(overflow),
        Err(GgufError::BadShape { .. })
    ));

    // Claims more data than the file holds.
    let short = GgufWriter::new()
        .tensor("t", GgmlType::F32, &[1024], vec![0; 16])
        .to_bytes();
    assert!(matches!(
        GgufFile::from_bytes(short),
        Err(GgufError::TensorOutOfBounds { .. })
    ));

    let dup = GgufWriter::new()
        .tensor_f32("t", &[1], &[0.0])
        .tensor_f32("t", &[1], &[0.0])
        .to_bytes();
    assert!(matches!(
        GgufFile::from_bytes(dup),
        Err(GgufError::DuplicateTensor(_))
    ));
}

#[test]
fn misaligned_and_wrapping_offsets_are_rejected() {
    let bytes = GgufWriter::new().tensor_f32("t", &[1], &[0.0]).to_bytes();
    let f = GgufFile::from_bytes(bytes.clone()).unwrap();
    // The offset field is the last 8 bytes of the (only) tensor info, just before
    // the padding that leads to the data section.
    let info_end = 24 + 8 + 1 + 4 + 8 + 4 + 8;
    assert!(f.data_offset() as usize >= info_end);
    let mut misaligned = bytes.clone();
    misaligned[info_end - 8..info_end].copy_from_slice(&4u64.to_le_bytes());
    assert!(matches!(
        GgufFile::from_bytes(misaligned),
        Err(GgufError::Misaligned { .. })
    ));

    let mut wrapping = bytes;
    wrapping[info_end - 8..info_end].copy_from_slice(&(u64::MAX - 31).to_le_bytes());
    assert!(matches!(
        GgufFile::from_bytes(wrapping),
        Err(GgufError::TensorOutOfBounds { .. })
    ));
}

#[test]
fn open_reports_the_path_on_io_errors() {
    let err = GgufFile::open(Path::new("/nonexistent/model.gguf")).unwrap_err();
    assert!(err.to_string().contains("/nonexistent/model.gguf"), "{err}");
}

#[test]
fn open_maps_a_file_from_disk() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    std::fs::write(&path, small_model().to_bytes()).unwrap();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.tensor("q").unwrap().data.len(), 40);
}
