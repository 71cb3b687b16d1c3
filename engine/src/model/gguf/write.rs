//! A small GGUF writer, the inverse of the reader: builds GGUF v3 images in memory.
//!
//! It exists so tests can build tiny models and hostile files byte for byte (the
//! design's "tiny model built by a test helper"), and so fuzz seeds are generated
//! rather than hand-assembled. It writes what it is given: shapes and data lengths
//! are not validated, which is exactly what tests of the reader's checks need.

use super::{Array, DEFAULT_ALIGNMENT, GGUF_MAGIC, GgmlType, Value};

/// One tensor to write.
#[derive(Debug, Clone)]
struct PendingTensor {
    name: String,
    type_id: u32,
    dims: Vec<u64>,
    data: Vec<u8>,
}

/// Builder for a GGUF v3 file.
#[derive(Debug, Clone, Default)]
pub struct GgufWriter {
    pub(super) metadata: Vec<(String, Value)>,
    tensors: Vec<PendingTensor>,
}

impl GgufWriter {
    /// An empty file (no metadata, no tensors).
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a metadata pair (duplicates are written as given).
    #[must_use]
    pub fn metadata(mut self, key: &str, value: Value) -> Self {
        self.metadata.push((key.to_owned(), value));
        self
    }

    /// Appends a tensor with raw little-endian data already in `dtype`'s layout.
    #[must_use]
    pub fn tensor(self, name: &str, dtype: GgmlType, dims: &[u64], data: Vec<u8>) -> Self {
        self.tensor_raw(name, dtype.id(), dims, data)
    }

    /// Appends an `F32` tensor.
    #[must_use]
    pub fn tensor_f32(self, name: &str, dims: &[u64], values: &[f32]) -> Self {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.tensor(name, GgmlType::F32, dims, data)
    }

    /// Appends a tensor with an arbitrary type id (for testing unknown types).
    #[must_use]
    pub fn tensor_raw(mut self, name: &str, type_id: u32, dims: &[u64], data: Vec<u8>) -> Self {
        self.tensors.push(PendingTensor {
            name: name.to_owned(),
            type_id,
            dims: dims.to_vec(),
            data,
        });
        self
    }

    /// Serializes the file: header, metadata, tensor infos, padding to the
    /// alignment (from a `general.alignment` pair if one was given), tensor data
    /// each padded to the alignment.
    #[must_use]
    pub fn to_bytes(&self) -> Vec<u8> {
        let alignment = self
            .metadata
            .iter()
            .find_map(|(k, v)| match (k.as_str(), v) {
                ("general.alignment", Value::U32(a)) if a.is_power_of_two() => Some(u64::from(*a)),
                _ => None,
            })
            .unwrap_or(DEFAULT_ALIGNMENT);
        let pad = |n: u64| n.next_multiple_of(alignment);

        let mut out = Vec::new();
        out.extend_from_slice(&GGUF_MAGIC);
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_str(&mut out, key);
            out.extend_from_slice(&value.value_type().id().to_le_bytes());
            put_value(&mut out, value);
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            put_str(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.type_id.to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offset = pad(offset + t.data.len() as u64);
        }
        if !self.tensors.is_empty() {
            out.resize(pad(out.len() as u64) as usize, 0);
            for t in &self.tensors {
                out.extend_from_slice(&t.data);
                out.resize(pad(out.len() as u64) as usize, 0);
            }
        }
        out
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::U8(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::Bool(v) => out.push(u8::from(*v)),
        Value::String(s) => put_str(out, s),
        Value::Array(a) => put_array(out, a),
    }
}

fn put_array(out: &mut Vec<u8>, a: &Array) {
    out.extend_from_slice(&a.elem_type().id().to_le_bytes());
    out.extend_from_slice(&(a.len() as u64).to_le_bytes());
    macro_rules! le {
        ($v:expr) => {
            for x in $v {
                out.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match a {
        Array::U8(v) => le!(v),
        Array::I8(v) => le!(v),
        Array::U16(v) => le!(v),
        Array::I16(v) => le!(v),
        Array::U32(v) => le!(v),
        Array::I32(v) => le!(v),
        Array::F32(v) => le!(v),
        Array::U64(v) => le!(v),
        Array::I64(v) => le!(v),
        Array::F64(v) => le!(v),
        Array::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
        Array::String(v) => v.iter().for_each(|s| put_str(out, s)),
        Array::Array(v) => v.iter().for_each(|inner| put_array(out, inner)),
    }
}
