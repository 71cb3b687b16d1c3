//! ggml tensor element types as stored in GGUF tensor infos.
//!
//! The type id numbering and the block layouts follow ggml's `ggml_type` enum and
//! `type_traits` table (ggml/src/ggml.c). Every type whose layout is known is listed,
//! so the loader can bounds-check any tensor of a well-formed file; which of them the
//! engine can *compute* with is a separate question answered by
//! [`GgmlType::is_supported`]. An id that is not in the table cannot be sized and is
//! rejected when the file is opened.

use std::fmt;

/// The element type of a tensor (ggml's `ggml_type`).
///
/// Quantized types store `block_size()` consecutive elements of a row in
/// `type_size()` bytes; unquantized types have a block size of 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    Iq2Xxs,
    Iq2Xs,
    Iq3Xxs,
    Iq1S,
    Iq4Nl,
    Iq3S,
    Iq2S,
    Iq4Xs,
    I8,
    I16,
    I32,
    I64,
    F64,
    Iq1M,
    Bf16,
    Tq1_0,
    Tq2_0,
}

impl GgmlType {
    /// Maps a GGUF tensor type id to a type, or `None` when the id is not one whose
    /// layout we know (ids 4 and 5 were removed from ggml; 31..33 are retired repacks).
    #[must_use]
    pub fn from_id(id: u32) -> Option<Self> {
        use GgmlType::*;
        Some(match id {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            9 => Q8_1,
            10 => Q2K,
            11 => Q3K,
            12 => Q4K,
            13 => Q5K,
            14 => Q6K,
            15 => Q8K,
            16 => Iq2Xxs,
            17 => Iq2Xs,
            18 => Iq3Xxs,
            19 => Iq1S,
            20 => Iq4Nl,
            21 => Iq3S,
            22 => Iq2S,
            23 => Iq4Xs,
            24 => I8,
            25 => I16,
            26 => I32,
            27 => I64,
            28 => F64,
            29 => Iq1M,
            30 => Bf16,
            34 => Tq1_0,
            35 => Tq2_0,
            _ => return None,
        })
    }

    /// The GGUF type id (inverse of [`GgmlType::from_id`]).
    #[must_use]
    pub fn id(self) -> u32 {
        use GgmlType::*;
        match self {
            F32 => 0,
            F16 => 1,
            Q4_0 => 2,
            Q4_1 => 3,
            Q5_0 => 6,
            Q5_1 => 7,
            Q8_0 => 8,
            Q8_1 => 9,
            Q2K => 10,
            Q3K => 11,
            Q4K => 12,
            Q5K => 13,
            Q6K => 14,
            Q8K => 15,
            Iq2Xxs => 16,
            Iq2Xs => 17,
            Iq3Xxs => 18,
            Iq1S => 19,
            Iq4Nl => 20,
            Iq3S => 21,
            Iq2S => 22,
            Iq4Xs => 23,
            I8 => 24,
            I16 => 25,
            I32 => 26,
            I64 => 27,
            F64 => 28,
            Iq1M => 29,
            Bf16 => 30,
            Tq1_0 => 34,
            Tq2_0 => 35,
        }
    }

    /// Number of elements in one block (1 for unquantized types).
    #[must_use]
    pub fn block_size(self) -> u64 {
        use GgmlType::*;
        match self {
            F32 | F16 | Bf16 | I8 | I16 | I32 | I64 | F64 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q8_1 | Iq4Nl => 32,
            Q2K | Q3K | Q4K | Q5K | Q6K | Q8K | Iq2Xxs | Iq2Xs | Iq3Xxs | Iq1S | Iq3S | Iq2S
            | Iq4Xs | Iq1M | Tq1_0 | Tq2_0 => 256,
        }
    }

    /// Bytes used by one block (ggml's `type_size`).
    #[must_use]
    pub fn type_size(self) -> u64 {
        use GgmlType::*;
        match self {
            F32 => 4,
            F16 | Bf16 => 2,
            I8 => 1,
            I16 => 2,
            I32 => 4,
            I64 | F64 => 8,
            // f16 scale + 16 bytes of nibbles
            Q4_0 => 18,
            // f16 scale + f16 min + 16 bytes of nibbles
            Q4_1 => 20,
            Q5_0 => 22,
            Q5_1 => 24,
            // f16 scale + 32 int8
            Q8_0 => 34,
            Q8_1 => 36,
            Q2K => 84,
            Q3K => 110,
            Q4K => 144,
            Q5K => 176,
            Q6K => 210,
            Q8K => 292,
            Iq2Xxs => 66,
            Iq2Xs => 74,
            Iq3Xxs => 98,
            Iq1S => 50,
            Iq4Nl => 18,
            Iq3S => 110,
            Iq2S => 82,
            Iq4Xs => 136,
            Iq1M => 56,
            Tq1_0 => 54,
            Tq2_0 => 66,
        }
    }

    /// Whether the engine's kernels can read this type. The loader hands out data
    /// only for supported types ([`super::GgufFile::tensor`]); extend this together
    /// with the kernels.
    #[must_use]
    pub fn is_supported(self) -> bool {
        matches!(
            self,
            GgmlType::F32 | GgmlType::F16 | GgmlType::Q8_0 | GgmlType::Q4_1
        )
    }

    /// ggml's name for the type (`"Q4_1"`, `"F16"`, ...), as llama.cpp prints it.
    #[must_use]
    pub fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "F32",
            F16 => "F16",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q8_1 => "Q8_1",
            Q2K => "Q2_K",
            Q3K => "Q3_K",
            Q4K => "Q4_K",
            Q5K => "Q5_K",
            Q6K => "Q6_K",
            Q8K => "Q8_K",
            Iq2Xxs => "IQ2_XXS",
            Iq2Xs => "IQ2_XS",
            Iq3Xxs => "IQ3_XXS",
            Iq1S => "IQ1_S",
            Iq4Nl => "IQ4_NL",
            Iq3S => "IQ3_S",
            Iq2S => "IQ2_S",
            Iq4Xs => "IQ4_XS",
            I8 => "I8",
            I16 => "I16",
            I32 => "I32",
            I64 => "I64",
            F64 => "F64",
            Iq1M => "IQ1_M",
            Bf16 => "BF16",
            Tq1_0 => "TQ1_0",
            Tq2_0 => "TQ2_0",
        }
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_unknown_ids_are_rejected() {
        let mut known = 0;
        for id in 0..64 {
            if let Some(t) = GgmlType::from_id(id) {
                assert_eq!(t.id(), id, "{t}");
                assert!(t.type_size() > 0 && t.block_size() > 0);
                known += 1;
            }
        }
        assert_eq!(known, 31);
        assert_eq!(GgmlType::from_id(4), None);
        assert_eq!(GgmlType::from_id(36), None);
    }

    #[test]
    fn layouts_of_the_types_the_engine_computes_with() {
        // These sizes are the on-disk contract the kernels rely on.
        assert_eq!(
            (GgmlType::Q4_1.block_size(), GgmlType::Q4_1.type_size()),
            (32, 20)
        );
        assert_eq!(
            (GgmlType::Q8_0.block_size(), GgmlType::Q8_0.type_size()),
            (32, 34)
        );
        assert_eq!(GgmlType::F16.type_size(), 2);
        assert!(GgmlType::Q4_1.is_supported());
        assert!(!GgmlType::Q4K.is_supported());
    }
}
