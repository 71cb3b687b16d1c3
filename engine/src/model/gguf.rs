//! GGUF reader: parses the header, metadata and tensor infos of a GGUF file and
//! hands out tensor data as borrowed slices of a read-only memory map.
//!
//! Format (little-endian, versions 2 and 3; see ggml's docs/gguf.md and
//! ggml/src/gguf.cpp): magic `GGUF`, `u32` version, `u64` tensor count, `u64`
//! metadata count, the metadata pairs, the tensor infos (name, `u32` rank, `u64`
//! dims, `u32` type, `u64` offset), then padding to `general.alignment` (default 32)
//! and the tensor data, each tensor at an aligned offset from the data start.
//!
//! Invariants, relied on by everything that reads a [`TensorView`]:
//! - a file that opens has every tensor's bytes inside the file, at an offset that is
//!   a multiple of the alignment, with `data.len() == n_elements / block_size *
//!   type_size` and a row length (`dims[0]`) that is a whole number of blocks;
//! - no input makes the parser panic, read out of bounds, recurse without limit, or
//!   allocate more than a small multiple of the file's size: every count read from
//!   the file is checked against the bytes left before anything is reserved for it.
//!
//! Version 1 files (32-bit counts, 2023) are rejected; llama.cpp dropped them too.

#![allow(unsafe_code)] // one `Mmap::map` call, see SAFETY below

mod metadata;
mod types;
pub mod write;

use std::collections::HashMap;
use std::fs::File;
use std::ops::Deref;
use std::path::{Path, PathBuf};

pub use metadata::{Array, Metadata, Value, ValueType};
pub use types::GgmlType;

/// The four bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Data alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml tensors have at most four dimensions (`GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;
/// Nesting limit for arrays of arrays. GGUF allows nesting, real files use none;
/// the limit keeps a hostile file from exhausting the stack through recursion.
pub const MAX_ARRAY_DEPTH: usize = 8;

/// Everything that can go wrong reading a GGUF file or its metadata.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot read GGUF file {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("not a GGUF file: starts with {0:02x?}, expected \"GGUF\"")]
    BadMagic([u8; 4]),
    #[error("unsupported GGUF version {0} (this reader supports versions 2 and 3)")]
    UnsupportedVersion(u32),
    #[error(
        "GGUF file is big-endian (version field {0:#010x}); only little-endian files are supported"
    )]
    BigEndian(u32),
    #[error(
        "GGUF file is truncated: reading {what} at byte {offset} needs {needed} bytes, {available} left"
    )]
    Truncated {
        what: &'static str,
        offset: u64,
        needed: u64,
        available: u64,
    },
    #[error(
        "{what} count {count} at byte {offset} cannot fit in the {available} bytes left in the file"
    )]
    CountTooLarge {
        what: &'static str,
        count: u64,
        offset: u64,
        available: u64,
    },
    #[error("{what} at byte {offset} is not valid UTF-8")]
    InvalidUtf8 { what: &'static str, offset: u64 },
    #[error("metadata key {key} has value type id {id}, which GGUF does not define")]
    UnknownValueType { key: String, id: u32 },
    #[error("metadata key {key} nests arrays deeper than {MAX_ARRAY_DEPTH} levels")]
    ArrayTooDeep { key: String },
    #[error("duplicate metadata key {0}")]
    DuplicateKey(String),
    #[error("general.alignment is {0}; it must be a non-zero power of two")]
    BadAlignment(u64),
    #[error("duplicate tensor name {0}")]
    DuplicateTensor(String),
    #[error("tensor {tensor} has {n_dims} dimensions; at most {MAX_DIMS} are allowed")]
    TooManyDims { tensor: String, n_dims: u32 },
    #[error("unsupported tensor type {dtype} in tensor {tensor}")]
    UnsupportedTensorType { dtype: String, tensor: String },
    #[error("tensor {tensor} of type {dtype} has shape {dims:?}: {reason}")]
    BadShape {
        tensor: String,
        dtype: GgmlType,
        dims: Vec<u64>,
        reason: &'static str,
    },
    #[error("tensor {tensor} data offset {offset} is not a multiple of the alignment {alignment}")]
    Misaligned {
        tensor: String,
        offset: u64,
        alignment: u64,
    },
    #[error(
        "tensor {tensor} needs bytes {start}..{end} of the data section, which has {available}"
    )]
    TensorOutOfBounds {
        tensor: String,
        start: u64,
        end: u64,
        available: u64,
    },
    #[error("missing tensor {0}")]
    MissingTensor(String),
    #[error("missing metadata key {0}")]
    MissingKey(String),
    #[error("metadata key {key} has type {actual}, expected {expected}")]
    KeyType {
        key: String,
        actual: String,
        expected: &'static str,
    },
}

/// Where and how a tensor is stored. Shapes use ggml order: `dims[0]` is the
/// contiguous (row) length, so a `[n_embd, n_vocab]` matrix has `n_vocab` rows of
/// `n_embd` elements.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: GgmlType,
    pub dims: Vec<u64>,
    /// Offset from the start of the data section.
    pub offset: u64,
    /// Bytes of data (`n_elements / block_size * type_size`).
    pub size: u64,
}

impl TensorInfo {
    /// Product of the dimensions (1 for a rank-0 tensor).
    #[must_use]
    pub fn n_elements(&self) -> u64 {
        // Checked when the file was parsed, so it cannot overflow here.
        self.dims.iter().product()
    }
}

/// A borrowed tensor: its name, type, shape (ggml order) and raw bytes.
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    pub name: &'a str,
    pub dtype: GgmlType,
    pub dims: &'a [u64],
    pub data: &'a [u8],
}

impl TensorView<'_> {
    /// Product of the dimensions.
    #[must_use]
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Row length (`dims[0]`), or 1 for a rank-0 tensor.
    #[must_use]
    pub fn row_len(&self) -> u64 {
        self.dims.first().copied().unwrap_or(1)
    }

    /// Number of rows (product of `dims[1..]`).
    #[must_use]
    pub fn n_rows(&self) -> u64 {
        self.dims.iter().skip(1).product()
    }
}

/// The bytes a file was parsed from: a read-only mapping, or an owned buffer (tests,
/// fuzzing, files built in memory).
enum Backing {
    Mmap(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Deref for Backing {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Backing::Mmap(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// An opened GGUF file.
pub struct GgufFile {
    bytes: Backing,
    version: u32,
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
    alignment: u64,
    /// Byte offset of the data section in the file (may equal the file length when
    /// there are no tensors).
    data_offset: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("metadata_pairs", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .finish_non_exhaustive()
    }
}

impl GgufFile {
    /// Memory-maps and parses the file at `path`.
    ///
    /// # Errors
    /// [`GgufError::Io`] if the file cannot be opened or mapped; any parse error if
    /// the contents are not a valid GGUF file.
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let io = |source| GgufError::Io {
            path: path.to_owned(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        // SAFETY: the mapping is read-only and private to this process. Its
        // soundness relies on nobody truncating or rewriting the file while it is
        // mapped (that would be undefined behaviour for any reader of a `&[u8]`);
        // model files are immutable artifacts by contract (verified by sha256 when
        // fetched, never written by the engine), which is the same assumption
        // llama.cpp makes with its mmap.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        let parsed = Self::parse(Backing::Mmap(map))?;
        tracing::debug!(
            path = %path.display(),
            version = parsed.version,
            tensors = parsed.tensors.len(),
            metadata = parsed.metadata.len(),
            "opened GGUF file"
        );
        Ok(parsed)
    }

    /// Parses a GGUF image held in memory.
    ///
    /// # Errors
    /// Any parse error if `bytes` is not a valid GGUF file.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self, GgufError> {
        Self::parse(Backing::Owned(bytes))
    }

    fn parse(bytes: Backing) -> Result<Self, GgufError> {
        let mut r = Reader::new(&bytes[..]);
        let magic: [u8; 4] = r.array("magic")?;
        if magic != GGUF_MAGIC {
            return Err(GgufError::BadMagic(magic));
        }
        let version = r.u32("version")?;
        match version {
            2 | 3 => {}
            // A big-endian writer stores 2 or 3 as 0x0?000000.
            v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => {
                return Err(GgufError::BigEndian(v));
            }
            v => return Err(GgufError::UnsupportedVersion(v)),
        }
        let n_tensors = r.u64("tensor count")?;
        let n_kv = r.u64("metadata count")?;

        // Smallest encodings: a pair is a key length, a type id and one byte; a
        // tensor info is a name length, a rank, a type and an offset.
        r.check_count("metadata", n_kv, 8 + 4 + 1)?;
        let mut metadata = Metadata::default();
        for _ in 0..n_kv {
            let key = r.string("metadata key")?;
            let type_id = r.u32("metadata value type")?;
            let ty = ValueType::from_id(type_id).ok_or_else(|| GgufError::UnknownValueType {
                key: key.clone(),
                id: type_id,
            })?;
            let value = r.value(&key, ty, 0)?;
            metadata.insert(key, value)?;
        }

        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(_) => {
                let a = metadata.get_u64("general.alignment")?;
                if a == 0 || !a.is_power_of_two() {
                    return Err(GgufError::BadAlignment(a));
                }
                a
            }
        };

        r.check_count("tensor", n_tensors, 8 + 4 + 4 + 8)?;
        // The count is now bounded by the file size, so reserving is safe.
        let mut tensors = Vec::with_capacity(usize::try_from(n_tensors).unwrap_or(0));
        let mut by_name = HashMap::new();
        for _ in 0..n_tensors {
            let info = r.tensor_info()?;
            if by_name.insert(info.name.clone(), tensors.len()).is_some() {
                return Err(GgufError::DuplicateTensor(info.name));
            }
            tensors.push(info);
        }

        let file_len = bytes.len() as u64;
        // `pos` is at most the file length, so this cannot overflow for any
        // alignment that fits in memory; checked anyway because alignment is input.
        let data_offset = r
            .pos()
            .checked_next_multiple_of(alignment)
            .ok_or(GgufError::BadAlignment(alignment))?;
        let available = file_len.saturating_sub(data_offset);
        for t in &tensors {
            if !t.offset.is_multiple_of(alignment) {
                return Err(GgufError::Misaligned {
                    tensor: t.name.clone(),
                    offset: t.offset,
                    alignment,
                });
            }
            let end = t.offset.checked_add(t.size);
            if end.is_none_or(|end| end > available) {
                return Err(GgufError::TensorOutOfBounds {
                    tensor: t.name.clone(),
                    start: t.offset,
                    end: end.unwrap_or(u64::MAX),
                    available,
                });
            }
        }

        Ok(Self {
            bytes,
            version,
            metadata,
            tensors,
            by_name,
            alignment,
            data_offset,
        })
    }

    /// The format version (2 or 3).
    #[must_use]
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The metadata pairs.
    #[must_use]
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// Data alignment in bytes.
    #[must_use]
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Byte offset of the data section within the file.
    #[must_use]
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// All tensor infos in file order (any type, supported or not).
    pub fn tensors(&self) -> impl ExactSizeIterator<Item = &TensorInfo> {
        self.tensors.iter()
    }

    /// The info of tensor `name`, whatever its type.
    #[must_use]
    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// Tensor `name` with its data, if its type is one the engine computes with.
    ///
    /// # Errors
    /// [`GgufError::MissingTensor`], or [`GgufError::UnsupportedTensorType`] when the
    /// file stores it in a type [`GgmlType::is_supported`] rejects.
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>, GgufError> {
        let view = self.raw_tensor(name)?;
        if !view.dtype.is_supported() {
            return Err(GgufError::UnsupportedTensorType {
                dtype: view.dtype.to_string(),
                tensor: name.to_owned(),
            });
        }
        Ok(view)
    }

    /// Tensor `name` with its data whatever its type (for tools that only copy or
    /// hash bytes).
    ///
    /// # Errors
    /// [`GgufError::MissingTensor`].
    pub fn raw_tensor(&self, name: &str) -> Result<TensorView<'_>, GgufError> {
        let &index = self
            .by_name
            .get(name)
            .ok_or_else(|| GgufError::MissingTensor(name.to_owned()))?;
        Ok(self.view(index))
    }

    fn view(&self, index: usize) -> TensorView<'_> {
        let info = &self.tensors[index];
        // `parse` checked every tensor's range against the data section, so the
        // sums fit in usize (they are at most the length of a slice) and the
        // slice is in bounds.
        let start = (self.data_offset + info.offset) as usize;
        let end = start + info.size as usize;
        TensorView {
            name: &info.name,
            dtype: info.dtype,
            dims: &info.dims,
            data: &self.bytes[start..end],
        }
    }
}

/// A bounds-checked little-endian cursor over the file bytes.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    fn pos(&self) -> u64 {
        self.pos as u64
    }

    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn bytes(&mut self, n: u64, what: &'static str) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                what,
                offset: self.pos(),
                needed: n,
                available: self.remaining(),
            });
        }
        // n <= remaining <= usize::MAX, so the cast is exact.
        let buf: &'a [u8] = self.buf;
        let out = &buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], GgufError> {
        let b = self.bytes(N as u64, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(b);
        Ok(out)
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Fails unless `count` items of at least `min_size` bytes each could fit in
    /// the rest of the file; called before any allocation sized by `count`.
    fn check_count(&self, what: &'static str, count: u64, min_size: u64) -> Result<(), GgufError> {
        if count
            .checked_mul(min_size)
            .is_none_or(|n| n > self.remaining())
        {
            return Err(GgufError::CountTooLarge {
                what,
                count,
                offset: self.pos(),
                available: self.remaining(),
            });
        }
        Ok(())
    }

    fn string(&mut self, what: &'static str) -> Result<String, GgufError> {
        let len = self.u64(what)?;
        let offset = self.pos();
        let raw = self.bytes(len, what)?;
        std::str::from_utf8(raw)
            .map(str::to_owned)
            .map_err(|_| GgufError::InvalidUtf8 { what, offset })
    }

    fn value(&mut self, key: &str, ty: ValueType, depth: usize) -> Result<Value, GgufError> {
        Ok(match ty {
            ValueType::U8 => Value::U8(u8::from_le_bytes(self.array("u8 value")?)),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.array("i8 value")?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array("u16 value")?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array("i16 value")?)),
            ValueType::U32 => Value::U32(self.u32("u32 value")?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array("i32 value")?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array("f32 value")?)),
            ValueType::U64 => Value::U64(self.u64("u64 value")?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array("i64 value")?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array("f64 value")?)),
            ValueType::Bool => Value::Bool(self.bool()?),
            ValueType::String => Value::String(self.string("string value")?),
            ValueType::Array => Value::Array(self.array_value(key, depth)?),
        })
    }

    fn bool(&mut self) -> Result<bool, GgufError> {
        // ggml writes 0 or 1; any non-zero byte reads as true, as in gguf.cpp.
        Ok(self.array::<1>("bool value")?[0] != 0)
    }

    fn array_value(&mut self, key: &str, depth: usize) -> Result<Array, GgufError> {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(GgufError::ArrayTooDeep {
                key: key.to_owned(),
            });
        }
        let type_id = self.u32("array element type")?;
        let ty = ValueType::from_id(type_id).ok_or_else(|| GgufError::UnknownValueType {
            key: key.to_owned(),
            id: type_id,
        })?;
        let count = self.u64("array length")?;
        self.check_count("array element", count, ty.min_encoded_size())?;
        // Bounded by the file size just above.
        let n = count as usize;

        fn fixed<'a, T, const N: usize>(
            r: &mut Reader<'a>,
            n: usize,
            what: &'static str,
            conv: fn([u8; N]) -> T,
        ) -> Result<Vec<T>, GgufError> {
            let raw = r.bytes((n * N) as u64, what)?;
            Ok(raw
                .chunks_exact(N)
                .map(|c| {
                    let mut a = [0u8; N];
                    a.copy_from_slice(c);
                    conv(a)
                })
                .collect())
        }

        Ok(match ty {
            ValueType::U8 => Array::U8(fixed(self, n, "u8 array", u8::from_le_bytes)?),
            ValueType::I8 => Array::I8(fixed(self, n, "i8 array", i8::from_le_bytes)?),
            ValueType::U16 => Array::U16(fixed(self, n, "u16 array", u16::from_le_bytes)?),
            ValueType::I16 => Array::I16(fixed(self, n, "i16 array", i16::from_le_bytes)?),
            ValueType::U32 => Array::U32(fixed(self, n, "u32 array", u32::from_le_bytes)?),
            ValueType::I32 => Array::I32(fixed(self, n, "i32 array", i32::from_le_bytes)?),
            ValueType::F32 => Array::F32(fixed(self, n, "f32 array", f32::from_le_bytes)?),
            ValueType::U64 => Array::U64(fixed(self, n, "u64 array", u64::from_le_bytes)?),
            ValueType::I64 => Array::I64(fixed(self, n, "i64 array", i64::from_le_bytes)?),
            ValueType::F64 => Array::F64(fixed(self, n, "f64 array", f64::from_le_bytes)?),
            ValueType::Bool => Array::Bool(fixed(self, n, "bool array", |[b]: [u8; 1]| b != 0)?),
            ValueType::String => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.string("string array element")?);
                }
                Array::String(v)
            }
            ValueType::Array => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.array_value(key, depth + 1)?);
                }
                Array::Array(v)
            }
        })
    }

    fn tensor_info(&mut self) -> Result<TensorInfo, GgufError> {
        let name = self.string("tensor name")?;
        let n_dims = self.u32("tensor rank")?;
        if n_dims as usize > MAX_DIMS {
            return Err(GgufError::TooManyDims {
                tensor: name,
                n_dims,
            });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(self.u64("tensor dimension")?);
        }
        let type_id = self.u32("tensor type")?;
        let offset = self.u64("tensor offset")?;
        let Some(dtype) = GgmlType::from_id(type_id) else {
            return Err(GgufError::UnsupportedTensorType {
                dtype: format!("id {type_id}"),
                tensor: name,
            });
        };
        let bad = |reason| GgufError::BadShape {
            tensor: name.clone(),
            dtype,
            dims: dims.clone(),
            reason,
        };
        // ggml stores ne[] as int64 and rejects totals past INT64_MAX; so do we,
        // which also keeps every size below comfortably inside u64.
        let n_elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n <= i64::MAX as u64)
            .ok_or_else(|| bad("element count overflows"))?;
        let row_len = dims.first().copied().unwrap_or(1);
        if !row_len.is_multiple_of(dtype.block_size()) {
            return Err(bad("row length is not a multiple of the block size"));
        }
        let size = (n_elements / dtype.block_size())
            .checked_mul(dtype.type_size())
            .ok_or_else(|| bad("byte size overflows"))?;
        Ok(TensorInfo {
            name,
            dtype,
            dims,
            offset,
            size,
        })
    }
}

#[cfg(test)]
mod tests;
