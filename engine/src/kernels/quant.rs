//! Block quantization formats as ggml stores them, and their dequantization.
//!
//! Invariants: a Q4_1 block is 20 bytes (`d: f16, m: f16, qs: [u8; 16]`, element `j`
//! in the low nibble of `qs[j]`, element `j + 16` in the high nibble), a Q8_0 block is
//! 34 bytes (`d: f16, qs: [i8; 32]`); both hold [`QK`] elements. Dequantization is the
//! reference every faster path is tested against.

use half::f16;

use super::KernelError;

/// Elements per quantization block (ggml's `QK4_1` and `QK8_0`).
pub const QK: usize = 32;

/// Bytes of one Q4_1 block.
pub const Q4_1_BLOCK_BYTES: usize = 20;
/// Bytes of one Q8_0 block.
pub const Q8_0_BLOCK_BYTES: usize = 34;

/// The tensor encodings the kernels accept, in ggml's on-disk layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightFormat {
    /// 32-bit floats.
    F32,
    /// IEEE half floats.
    F16,
    /// 4-bit unsigned quants with a per-block scale and minimum.
    Q4_1,
    /// 8-bit signed quants with a per-block scale.
    Q8_0,
}

impl WeightFormat {
    /// Elements per block (1 for the float formats).
    #[must_use]
    pub fn block_elems(self) -> usize {
        match self {
            Self::F32 | Self::F16 => 1,
            Self::Q4_1 | Self::Q8_0 => QK,
        }
    }

    /// Bytes per block.
    #[must_use]
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 => 2,
            Self::Q4_1 => Q4_1_BLOCK_BYTES,
            Self::Q8_0 => Q8_0_BLOCK_BYTES,
        }
    }

    /// Bytes of a row of `n` elements.
    ///
    /// # Errors
    /// [`KernelError::Shape`] when `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: usize) -> Result<usize, KernelError> {
        if !n.is_multiple_of(self.block_elems()) {
            return Err(KernelError::Shape(format!(
                "{self:?} row of {n} elements is not a whole number of {}-element blocks",
                self.block_elems()
            )));
        }
        Ok(n / self.block_elems() * self.block_bytes())
    }
}

fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// Dequantizes one row of `out.len()` elements from `src`.
///
/// # Errors
/// [`KernelError::Shape`] when `src` does not hold exactly that many elements.
pub fn dequantize_row(
    format: WeightFormat,
    src: &[u8],
    out: &mut [f32],
) -> Result<(), KernelError> {
    let need = format.row_bytes(out.len())?;
    if src.len() != need {
        return Err(KernelError::Shape(format!(
            "{format:?} row of {} elements needs {need} bytes, got {}",
            out.len(),
            src.len()
        )));
    }
    match format {
        WeightFormat::F32 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        WeightFormat::F16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        WeightFormat::Q4_1 => {
            for (o, b) in out
                .chunks_exact_mut(QK)
                .zip(src.chunks_exact(Q4_1_BLOCK_BYTES))
            {
                let d = f16_at(b, 0);
                let m = f16_at(b, 2);
                for j in 0..QK / 2 {
                    let q = b[4 + j];
                    o[j] = f32::from(q & 0x0f) * d + m;
                    o[j + QK / 2] = f32::from(q >> 4) * d + m;
                }
            }
        }
        WeightFormat::Q8_0 => {
            for (o, b) in out
                .chunks_exact_mut(QK)
                .zip(src.chunks_exact(Q8_0_BLOCK_BYTES))
            {
                let d = f16_at(b, 0);
                for j in 0..QK {
                    o[j] = f32::from(b[2 + j].cast_signed()) * d;
                }
            }
        }
    }
    Ok(())
}

/// Rounds through f16 the way ggml stores activation scales, so our activation
/// quantization produces the same scales as llama.cpp's.
#[must_use]
pub fn round_f16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_1_block_dequantizes_low_then_high_nibbles() {
        let mut b = vec![0u8; Q4_1_BLOCK_BYTES];
        b[0..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b[2..4].copy_from_slice(&f16::from_f32(-1.0).to_le_bytes());
        for j in 0..16 {
            b[4 + j] = (j as u8) | ((15 - j as u8) << 4);
        }
        let mut out = [0f32; 32];
        dequantize_row(WeightFormat::Q4_1, &b, &mut out).unwrap();
        for j in 0..16 {
            assert_eq!(out[j], j as f32 * 0.5 - 1.0);
            assert_eq!(out[j + 16], (15 - j) as f32 * 0.5 - 1.0);
        }
    }

    #[test]
    fn q8_0_block_is_signed() {
        let mut b = vec![0u8; Q8_0_BLOCK_BYTES];
        b[0..2].copy_from_slice(&f16::from_f32(0.25).to_le_bytes());
        for j in 0..32 {
            b[2 + j] = (j as i8 - 16).cast_unsigned();
        }
        let mut out = [0f32; 32];
        dequantize_row(WeightFormat::Q8_0, &b, &mut out).unwrap();
        for (j, o) in out.iter().enumerate() {
            assert_eq!(*o, (j as f32 - 16.0) * 0.25);
        }
    }

    #[test]
    fn wrong_lengths_are_errors() {
        let mut out = [0f32; 33];
        assert!(dequantize_row(WeightFormat::Q4_1, &[0; 20], &mut out).is_err());
        let mut out = [0f32; 32];
        assert!(dequantize_row(WeightFormat::Q8_0, &[0; 20], &mut out).is_err());
        let mut out = [0f32; 2];
        dequantize_row(WeightFormat::F16, &[0, 0x3c, 0, 0xc0], &mut out).unwrap();
        assert_eq!(out, [1.0, -2.0]);
    }
}
