//! GGUF metadata values and typed access to them.
//!
//! Values are owned (copied out of the file) because they are small next to the
//! tensors and because the tokenizer and the model configuration outlive any one
//! borrow of the mapping. Arrays are stored as typed vectors so that the large
//! ones (token lists, merges, token types, scores) cost what they cost on disk and
//! can be handed out as slices.
//!
//! Getters are strict about kinds (a string is never silently read as a number) but
//! convert integers losslessly between widths and signedness, because converters
//! disagree on whether e.g. `llama.block_count` is `u32` or `i32`.

use std::collections::HashMap;

use super::GgufError;

/// The GGUF metadata value type ids (`gguf_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl ValueType {
    /// Maps a GGUF value type id to a type; `None` for ids GGUF does not define.
    #[must_use]
    pub fn from_id(id: u32) -> Option<Self> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// The GGUF id of this type.
    #[must_use]
    pub fn id(self) -> u32 {
        use ValueType::*;
        match self {
            U8 => 0,
            I8 => 1,
            U16 => 2,
            I16 => 3,
            U32 => 4,
            I32 => 5,
            F32 => 6,
            Bool => 7,
            String => 8,
            Array => 9,
            U64 => 10,
            I64 => 11,
            F64 => 12,
        }
    }

    /// The smallest number of bytes one value of this type occupies in a file: the
    /// parser uses it to reject element counts that could not possibly fit in what
    /// is left of the file *before* allocating for them.
    #[must_use]
    pub fn min_encoded_size(self) -> u64 {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 => 8,
            // u64 length, possibly zero bytes
            String => 8,
            // u32 element type + u64 count
            Array => 12,
        }
    }

    /// Lower-case name used in error messages (`"u32"`, `"string"`, ...).
    #[must_use]
    pub fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Array),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A homogeneous metadata array. Arrays of arrays are allowed by the format (each
/// inner array may have its own element type).
#[derive(Debug, Clone, PartialEq)]
pub enum Array {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    Array(Vec<Array>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl Array {
    /// The element type.
    #[must_use]
    pub fn elem_type(&self) -> ValueType {
        match self {
            Array::U8(_) => ValueType::U8,
            Array::I8(_) => ValueType::I8,
            Array::U16(_) => ValueType::U16,
            Array::I16(_) => ValueType::I16,
            Array::U32(_) => ValueType::U32,
            Array::I32(_) => ValueType::I32,
            Array::F32(_) => ValueType::F32,
            Array::Bool(_) => ValueType::Bool,
            Array::String(_) => ValueType::String,
            Array::Array(_) => ValueType::Array,
            Array::U64(_) => ValueType::U64,
            Array::I64(_) => ValueType::I64,
            Array::F64(_) => ValueType::F64,
        }
    }

    /// Number of elements.
    #[must_use]
    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::String(v) => v.len(),
            Array::Array(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F64(v) => v.len(),
        }
    }

    /// Whether the array has no elements.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Value {
    /// The value's GGUF type.
    #[must_use]
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(_) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// Describes the type for error messages; arrays include their element type.
    fn type_description(&self) -> String {
        match self {
            Value::Array(a) => format!("array of {}", a.elem_type().name()),
            v => v.value_type().name().to_owned(),
        }
    }

    /// The value as an `i128` if it is an integer of any width: wide enough to hold
    /// every GGUF integer, so range checks below are exact.
    fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v.into(),
            Value::I8(v) => v.into(),
            Value::U16(v) => v.into(),
            Value::I16(v) => v.into(),
            Value::U32(v) => v.into(),
            Value::I32(v) => v.into(),
            Value::U64(v) => v.into(),
            Value::I64(v) => v.into(),
            _ => return None,
        })
    }
}

/// All key/value pairs of a GGUF file, in file order, with lookup by key.
#[derive(Debug, Clone, Default)]
pub struct Metadata {
    entries: Vec<(String, Value)>,
    index: HashMap<String, usize>,
}

impl Metadata {
    /// Adds a pair; a key seen twice is an error (llama.cpp rejects such files too,
    /// and silently preferring one copy would hide a broken converter).
    pub(crate) fn insert(&mut self, key: String, value: Value) -> Result<(), GgufError> {
        if self.index.contains_key(&key) {
            return Err(GgufError::DuplicateKey(key));
        }
        self.index.insert(key.clone(), self.entries.len());
        self.entries.push((key, value));
        Ok(())
    }

    /// Number of pairs.
    #[must_use]
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no pairs.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Pairs in file order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// The raw value of `key`, if present.
    #[must_use]
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.entries[i].1)
    }

    /// Whether `key` is present.
    #[must_use]
    pub fn contains(&self, key: &str) -> bool {
        self.index.contains_key(key)
    }

    fn require(&self, key: &str) -> Result<&Value, GgufError> {
        self.get(key)
            .ok_or_else(|| GgufError::MissingKey(key.to_owned()))
    }

    fn type_error(key: &str, value: &Value, expected: &'static str) -> GgufError {
        GgufError::KeyType {
            key: key.to_owned(),
            actual: value.type_description(),
            expected,
        }
    }

    fn integer<T: TryFrom<i128>>(&self, key: &str, expected: &'static str) -> Result<T, GgufError> {
        let value = self.require(key)?;
        value
            .as_integer()
            .and_then(|i| T::try_from(i).ok())
            .ok_or_else(|| Self::type_error(key, value, expected))
    }

    /// An integer key that fits in `u32`.
    ///
    /// # Errors
    /// [`GgufError::MissingKey`] when absent, [`GgufError::KeyType`] when the value is
    /// not an integer or is out of range.
    pub fn get_u32(&self, key: &str) -> Result<u32, GgufError> {
        self.integer(key, "u32")
    }

    /// An integer key that fits in `u64`. Errors as [`Metadata::get_u32`].
    ///
    /// # Errors
    /// See [`Metadata::get_u32`].
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        self.integer(key, "u64")
    }

    /// An integer key that fits in `i32`. Errors as [`Metadata::get_u32`].
    ///
    /// # Errors
    /// See [`Metadata::get_u32`].
    pub fn get_i32(&self, key: &str) -> Result<i32, GgufError> {
        self.integer(key, "i32")
    }

    /// An `f32` key (`f64` values are not narrowed silently).
    ///
    /// # Errors
    /// [`GgufError::MissingKey`] or [`GgufError::KeyType`].
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        match self.require(key)? {
            Value::F32(v) => Ok(*v),
            other => Err(Self::type_error(key, other, "f32")),
        }
    }

    /// A `bool` key.
    ///
    /// # Errors
    /// [`GgufError::MissingKey`] or [`GgufError::KeyType`].
    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        match self.require(key)? {
            Value::Bool(v) => Ok(*v),
            other => Err(Self::type_error(key, other, "bool")),
        }
    }

    /// A string key.
    ///
    /// # Errors
    /// [`GgufError::MissingKey`] or [`GgufError::KeyType`].
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        match self.require(key)? {
            Value::String(v) => Ok(v),
            other => Err(Self::type_error(key, other, "string")),
        }
    }

    /// An array key of any element type.
    ///
    /// # Errors
    /// [`GgufError::MissingKey`] or [`GgufError::KeyType`].
    pub fn get_array(&self, key: &str) -> Result<&Array, GgufError> {
        match self.require(key)? {
            Value::Array(a) => Ok(a),
            other => Err(Self::type_error(key, other, "array")),
        }
    }

    /// An array-of-strings key.
    ///
    /// # Errors
    /// [`GgufError::MissingKey`] or [`GgufError::KeyType`].
    pub fn get_str_array(&self, key: &str) -> Result<&[String], GgufError> {
        match self.require(key)? {
            Value::Array(Array::String(v)) => Ok(v),
            other => Err(Self::type_error(key, other, "array of string")),
        }
    }

    /// An array-of-`i32` key.
    ///
    /// # Errors
    /// [`GgufError::MissingKey`] or [`GgufError::KeyType`].
    pub fn get_i32_array(&self, key: &str) -> Result<&[i32], GgufError> {
        match self.require(key)? {
            Value::Array(Array::I32(v)) => Ok(v),
            other => Err(Self::type_error(key, other, "array of i32")),
        }
    }

    /// An array-of-`f32` key.
    ///
    /// # Errors
    /// [`GgufError::MissingKey`] or [`GgufError::KeyType`].
    pub fn get_f32_array(&self, key: &str) -> Result<&[f32], GgufError> {
        match self.require(key)? {
            Value::Array(Array::F32(v)) => Ok(v),
            other => Err(Self::type_error(key, other, "array of f32")),
        }
    }

    /// `get_u32`, with a missing key as `Ok(None)` (a wrong type is still an error).
    ///
    /// # Errors
    /// [`GgufError::KeyType`].
    pub fn get_u32_opt(&self, key: &str) -> Result<Option<u32>, GgufError> {
        optional(self.get_u32(key))
    }

    /// `get_f32`, with a missing key as `Ok(None)`.
    ///
    /// # Errors
    /// [`GgufError::KeyType`].
    pub fn get_f32_opt(&self, key: &str) -> Result<Option<f32>, GgufError> {
        optional(self.get_f32(key))
    }

    /// `get_bool`, with a missing key as `Ok(None)`.
    ///
    /// # Errors
    /// [`GgufError::KeyType`].
    pub fn get_bool_opt(&self, key: &str) -> Result<Option<bool>, GgufError> {
        optional(self.get_bool(key))
    }

    /// `get_str`, with a missing key as `Ok(None)`.
    ///
    /// # Errors
    /// [`GgufError::KeyType`].
    pub fn get_str_opt(&self, key: &str) -> Result<Option<&str>, GgufError> {
        optional(self.get_str(key))
    }

    /// `general.architecture` (e.g. `"llama"`): the prefix of the model's hyper-
    /// parameter keys.
    ///
    /// # Errors
    /// [`GgufError::MissingKey`] or [`GgufError::KeyType`].
    pub fn architecture(&self) -> Result<&str, GgufError> {
        self.get_str("general.architecture")
    }
}

/// Turns "missing key" into `None`, keeping every other error.
fn optional<T>(r: Result<T, GgufError>) -> Result<Option<T>, GgufError> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(GgufError::MissingKey(_)) => Ok(None),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn md(pairs: Vec<(&str, Value)>) -> Metadata {
        let mut m = Metadata::default();
        for (k, v) in pairs {
            m.insert(k.to_owned(), v).unwrap();
        }
        m
    }

    #[test]
    fn integers_convert_losslessly_and_only_losslessly() {
        let m = md(vec![
            ("a", Value::I32(7)),
            ("neg", Value::I32(-1)),
            ("big", Value::U64(u64::from(u32::MAX) + 1)),
        ]);
        assert_eq!(m.get_u32("a").unwrap(), 7);
        assert_eq!(m.get_u64("a").unwrap(), 7);
        assert_eq!(
            m.get_u32("neg").unwrap_err().to_string(),
            "metadata key neg has type i32, expected u32"
        );
        assert!(m.get_u32("big").is_err());
        assert_eq!(m.get_u64("big").unwrap(), u64::from(u32::MAX) + 1);
    }

    #[test]
    fn kinds_are_strict_and_errors_name_the_key() {
        let m = md(vec![
            ("s", Value::String("x".into())),
            ("f", Value::F64(1.0)),
            ("arr", Value::Array(Array::I32(vec![1, 2]))),
        ]);
        assert_eq!(
            m.get_u32("missing").unwrap_err().to_string(),
            "missing metadata key missing"
        );
        assert!(m.get_u32("s").is_err());
        assert!(m.get_f32("f").is_err());
        assert_eq!(m.get_i32_array("arr").unwrap(), &[1, 2]);
        assert_eq!(
            m.get_str_array("arr").unwrap_err().to_string(),
            "metadata key arr has type array of i32, expected array of string"
        );
        assert_eq!(m.get_str_opt("missing").unwrap(), None);
        assert!(m.get_str_opt("f").is_err());
    }

    #[test]
    fn duplicate_keys_are_rejected() {
        let mut m = Metadata::default();
        m.insert("k".into(), Value::U8(1)).unwrap();
        assert!(matches!(
            m.insert("k".into(), Value::U8(2)),
            Err(GgufError::DuplicateKey(_))
        ));
    }
}
