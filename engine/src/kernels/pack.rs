//! Repacked weight matrices and 8-bit quantized activations, the two operands of the
//! integer matrix kernels.
//!
//! Weights are repacked once at load time into groups of [`GROUP`] rows interleaved
//! four bytes at a time, the layout of the VNNI `dpbusd` instruction: one 64-byte
//! vector holds four consecutive quants of the same block from each of 16 rows, so a
//! broadcast 4-byte slice of an activation block multiplies all 16 rows at once and
//! each 32-bit lane ends up with one row's block dot product (no horizontal sums).
//!
//! Every weight is `d * u + m` with `u` unsigned: Q4_1 nibbles keep their scale and
//! minimum; Q8_0 quants are stored as `q + 128` and the kernel subtracts
//! `128 * sum(x_q)` exactly in integers, so Q8_0 × Q8 products are exact like ggml's.
//!
//! Layout per (group, block), `stride` bytes, 64-byte aligned: 16 × f16 `d`, 16 × f16
//! `m` (64 bytes), then the quants: nibbles as 4 chunks of 64 bytes (chunk `i`, row
//! `r`, byte `e`: element `4i+e` in the low nibble and `16+4i+e` in the high one), or
//! bytes as 8 chunks (chunk `j` holds elements `4j..4j+4`). Rows past `rows` are zero.

use half::f16;
use rayon::prelude::*;

use super::buffer::ZeroedBuffer;
use super::quant::{
    Q4_1_BLOCK_BYTES, Q8_0_BLOCK_BYTES, QK, WeightFormat, dequantize_row, round_f16,
};
use super::{Isa, KernelError};

/// Rows interleaved per group.
pub const GROUP: usize = 16;
const SCALE_BYTES: usize = 64;

/// How the quants of a packed matrix are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackedKind {
    /// 4-bit unsigned quants (from Q4_1), weight = `d * u + m`.
    Nibble,
    /// 8-bit quants stored offset by +128 (from Q8_0), weight = `d * (u - 128)`.
    Byte,
}

impl PackedKind {
    fn quant_bytes(self) -> usize {
        match self {
            Self::Nibble => GROUP * QK / 2,
            Self::Byte => GROUP * QK,
        }
    }
}

/// A weight matrix (`rows` outputs × `cols` inputs) in the interleaved layout.
#[derive(Debug)]
pub struct PackedMatrix {
    rows: usize,
    cols: usize,
    kind: PackedKind,
    storage: ZeroedBuffer,
}

/// A slice of rows in ggml layout that becomes part of a packed matrix.
#[derive(Clone, Copy, Debug)]
pub struct RowSource<'a> {
    /// Encoding of `data`.
    pub format: WeightFormat,
    /// Number of rows in `data`.
    pub rows: usize,
    /// The raw rows, `rows * format.row_bytes(cols)` bytes.
    pub data: &'a [u8],
}

impl PackedMatrix {
    /// Packs the rows of one or more ggml tensors (stacked in order) into one matrix,
    /// so projections that read the same input (Q, K, V; gate, up) run as one product.
    ///
    /// # Errors
    /// [`KernelError::Shape`] when the parts disagree on format, `cols` is not a whole
    /// number of blocks, or a part's byte length does not match its shape;
    /// [`KernelError::Unsupported`] for formats that are not block-quantized.
    pub fn pack(cols: usize, parts: &[RowSource<'_>]) -> Result<Self, KernelError> {
        let Some(first) = parts.first() else {
            return Err(KernelError::Shape("no rows to pack".into()));
        };
        let kind = match first.format {
            WeightFormat::Q4_1 => PackedKind::Nibble,
            WeightFormat::Q8_0 => PackedKind::Byte,
            other => {
                return Err(KernelError::Unsupported(format!(
                    "packing {other:?} weights"
                )));
            }
        };
        if cols == 0 || !cols.is_multiple_of(QK) {
            return Err(KernelError::Shape(format!(
                "{cols} columns is not a multiple of {QK}"
            )));
        }
        let row_bytes = first.format.row_bytes(cols)?;
        let mut rows = 0usize;
        for p in parts {
            if p.format != first.format {
                return Err(KernelError::Shape(format!(
                    "cannot pack {:?} rows with {:?} rows",
                    p.format, first.format
                )));
            }
            let need = p
                .rows
                .checked_mul(row_bytes)
                .ok_or_else(|| KernelError::Shape("matrix too large".into()))?;
            if p.data.len() != need {
                return Err(KernelError::Shape(format!(
                    "{} rows of {cols} {:?} need {need} bytes, got {}",
                    p.rows,
                    p.format,
                    p.data.len()
                )));
            }
            rows += p.rows;
        }
        let mut m = Self::zeroed(rows, cols, kind);
        let mut r = 0;
        for p in parts {
            for row in p.data.chunks_exact(row_bytes) {
                m.put_row(r, row);
                r += 1;
            }
        }
        Ok(m)
    }

    fn zeroed(rows: usize, cols: usize, kind: PackedKind) -> Self {
        let groups = rows.div_ceil(GROUP);
        let len = groups * (cols / QK) * (SCALE_BYTES + kind.quant_bytes());
        Self {
            rows,
            cols,
            kind,
            storage: ZeroedBuffer::new(len),
        }
    }

    fn put_row(&mut self, r: usize, src: &[u8]) {
        let (g, lane) = (r / GROUP, r % GROUP);
        let stride = self.stride();
        let nblocks = self.nblocks();
        let kind = self.kind;
        let data = self.data_mut();
        for b in 0..nblocks {
            let blk = &mut data[(g * nblocks + b) * stride..][..stride];
            match kind {
                PackedKind::Nibble => {
                    let s = &src[b * Q4_1_BLOCK_BYTES..][..Q4_1_BLOCK_BYTES];
                    blk[2 * lane..2 * lane + 2].copy_from_slice(&s[0..2]);
                    blk[32 + 2 * lane..32 + 2 * lane + 2].copy_from_slice(&s[2..4]);
                    let qs = &s[4..20];
                    for i in 0..4 {
                        for e in 0..4 {
                            // qs[k] holds element k (low) and k + 16 (high): the same
                            // pairing the chunk layout uses, so bytes copy unchanged.
                            blk[SCALE_BYTES + i * 64 + lane * 4 + e] = qs[4 * i + e];
                        }
                    }
                }
                PackedKind::Byte => {
                    let s = &src[b * Q8_0_BLOCK_BYTES..][..Q8_0_BLOCK_BYTES];
                    blk[2 * lane..2 * lane + 2].copy_from_slice(&s[0..2]);
                    for j in 0..8 {
                        for e in 0..4 {
                            let q = s[2 + 4 * j + e].cast_signed();
                            blk[SCALE_BYTES + j * 64 + lane * 4 + e] = (i16::from(q) + 128) as u8;
                        }
                    }
                }
            }
        }
    }

    /// Output rows.
    #[must_use]
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input columns.
    #[must_use]
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Quant storage kind.
    #[must_use]
    pub fn kind(&self) -> PackedKind {
        self.kind
    }

    /// Row groups (rows rounded up to [`GROUP`]).
    #[must_use]
    pub fn groups(&self) -> usize {
        self.rows.div_ceil(GROUP)
    }

    /// Quantization blocks per row.
    #[must_use]
    pub fn nblocks(&self) -> usize {
        self.cols / QK
    }

    /// Bytes per (group, block).
    #[must_use]
    pub fn stride(&self) -> usize {
        SCALE_BYTES + self.kind.quant_bytes()
    }

    /// The packed bytes; group `g` block `b` starts at `(g * nblocks + b) * stride`,
    /// 64-byte aligned.
    #[must_use]
    pub fn data(&self) -> &[u8] {
        self.storage.bytes()
    }

    fn data_mut(&mut self) -> &mut [u8] {
        self.storage.bytes_mut()
    }

    /// Bytes of one group (all its blocks).
    #[must_use]
    pub fn group_bytes(&self) -> usize {
        self.nblocks() * self.stride()
    }

    /// Asks the CPU to bring block `b` of group `g` into its caches; nothing when there
    /// is no such group. The tile kernels ask for the next group's blocks as they
    /// compute the current one's: tasks walk their groups in order, and a decode step's
    /// weights come from memory, where the tiles waited on each group's first loads.
    #[inline(always)]
    pub fn prefetch_block(&self, g: usize, b: usize) {
        if g >= self.groups() || b >= self.nblocks() {
            return;
        }
        super::prefetch(
            &self.data()[g * self.group_bytes() + b * self.stride()..][..self.stride()],
            super::CacheLevel::L2,
        );
    }

    /// The unsigned quant `u` of row lane `lane` (0..16), element `k` of a block.
    #[must_use]
    pub fn quant_in_block(kind: PackedKind, blk: &[u8], lane: usize, k: usize) -> u8 {
        match kind {
            PackedKind::Nibble => {
                let (kk, shift) = if k < QK / 2 { (k, 0) } else { (k - QK / 2, 4) };
                (blk[SCALE_BYTES + (kk / 4) * 64 + lane * 4 + kk % 4] >> shift) & 0x0f
            }
            PackedKind::Byte => blk[SCALE_BYTES + (k / 4) * 64 + lane * 4 + k % 4],
        }
    }

    /// Scale `d` and minimum `m` of row lane `lane` in a block.
    #[must_use]
    pub fn scales_in_block(blk: &[u8], lane: usize) -> (f32, f32) {
        let d = f16::from_le_bytes([blk[2 * lane], blk[2 * lane + 1]]).to_f32();
        let m = f16::from_le_bytes([blk[32 + 2 * lane], blk[33 + 2 * lane]]).to_f32();
        (d, m)
    }

    /// Dequantizes row `r` (reference path for tests and embedding lookups).
    ///
    /// # Panics
    /// When `r >= rows` or `out.len() != cols`.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        assert!(
            r < self.rows && out.len() == self.cols,
            "row {r} out of range"
        );
        let (g, lane) = (r / GROUP, r % GROUP);
        let stride = self.stride();
        let data = self.data();
        for (b, o) in out.chunks_exact_mut(QK).enumerate() {
            let blk = &data[(g * self.nblocks() + b) * stride..][..stride];
            let (d, m) = Self::scales_in_block(blk, lane);
            for (k, v) in o.iter_mut().enumerate() {
                let u = f32::from(Self::quant_in_block(self.kind, blk, lane, k));
                *v = match self.kind {
                    PackedKind::Nibble => d * u + m,
                    PackedKind::Byte => d * (u - 128.0),
                };
            }
        }
    }
}

/// Rows of activations quantized to 8 bits in blocks of [`QK`], as ggml's Q8_0/Q8_1
/// do (`d = amax / 127` rounded to f16, quants rounded to nearest even).
#[derive(Debug, Default, Clone)]
pub struct QuantActs {
    /// Number of rows (tokens).
    pub n: usize,
    /// Columns per row.
    pub cols: usize,
    /// Quants, `n * cols`.
    pub q: Vec<i8>,
    /// Per-block scales (f16-rounded), `n * cols / QK`.
    pub d: Vec<f32>,
    /// Per-block `d * sum(q)` rounded to f16, as ggml's Q8_1 stores it (Q4_1 minimum term).
    pub s: Vec<f32>,
    /// Per-block integer `sum(q)` (exact Q8_0 offset correction).
    pub qsum: Vec<i32>,
}

impl QuantActs {
    /// Quantizes `n` rows of `cols` values from `x` (row-major) with `isa`'s
    /// instructions (the same bits on every instruction set), reusing buffers.
    ///
    /// # Errors
    /// [`KernelError::Shape`] when `cols` is not a multiple of [`QK`] or `x` is not `n * cols` long.
    pub fn quantize(
        &mut self,
        isa: Isa,
        x: &[f32],
        n: usize,
        cols: usize,
    ) -> Result<(), KernelError> {
        if !cols.is_multiple_of(QK) || x.len() != n * cols {
            return Err(KernelError::Shape(format!(
                "cannot quantize {} values as {n} rows of {cols}",
                x.len()
            )));
        }
        let nb = n * cols / QK;
        self.n = n;
        self.cols = cols;
        self.q.resize(n * cols, 0);
        self.d.resize(nb, 0.0);
        self.s.resize(nb, 0.0);
        self.qsum.resize(nb, 0);
        let blocks: QuantizeBlocks = match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => super::avx512::quantize_blocks,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => super::avx2::quantize_blocks,
            _ => quantize_blocks,
        };
        // Rows are independent: two tasks per thread, so a batch of decodes does not
        // quantize on one thread while the others wait for the product.
        let per_row = cols / QK;
        let rows_per_task = n.div_ceil(2 * rayon::current_num_threads()).max(1);
        x.par_chunks(cols * rows_per_task)
            .zip(self.q.par_chunks_mut(cols * rows_per_task))
            .zip(self.d.par_chunks_mut(per_row * rows_per_task))
            .zip(self.s.par_chunks_mut(per_row * rows_per_task))
            .zip(self.qsum.par_chunks_mut(per_row * rows_per_task))
            .for_each(|((((x, q), d), s), qsum)| blocks(x, q, d, s, qsum));
        Ok(())
    }
}

/// Quantizes whole blocks of [`QK`] values: `x` into `q`, with one `d`, `s` and
/// `qsum` per block (the fields of [`QuantActs`]).
pub(super) type QuantizeBlocks = fn(&[f32], &mut [i8], &mut [f32], &mut [f32], &mut [i32]);

/// Rounds to nearest, ties to even, for |v| < 2^22: adding and subtracting
/// 1.5 × 2^23 leaves no fraction bits, so the FPU's default rounding does it. This
/// is what `round_ties_even` computes, without a libm call the baseline x86-64
/// target cannot inline (it was a fifth of prompt processing).
#[inline(always)]
fn round_even_small(v: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (v + MAGIC) - MAGIC
}

/// A block's scale `d = amax / 127` and the factor `127 / amax` its values are
/// multiplied by before rounding (0 for an all-zero block), as ggml computes them.
#[inline(always)]
pub(super) fn block_scale(amax: f32) -> (f32, f32) {
    (amax / 127.0, if amax > 0.0 { 127.0 / amax } else { 0.0 })
}

/// Stores block `bi`'s `d`, `s = d * sum(q)` (both rounded to f16, as ggml's Q8_1
/// stores them) and `sum(q)`.
#[inline(always)]
pub(super) fn store_block_sums(
    bi: usize,
    (dv, sum): (f32, i32),
    d: &mut [f32],
    s: &mut [f32],
    qsum: &mut [i32],
) {
    d[bi] = round_f16(dv);
    s[bi] = round_f16(dv * sum as f32);
    qsum[bi] = sum;
}

/// [`QuantizeBlocks`] in portable Rust, the reference every instruction set's
/// version equals bit for bit: a value that is not a number quantizes to 0, and an
/// infinite one makes its block all 0 with an infinite scale.
pub(super) fn quantize_blocks(
    x: &[f32],
    q: &mut [i8],
    d: &mut [f32],
    s: &mut [f32],
    qsum: &mut [i32],
) {
    for (bi, (xb, qb)) in x.chunks_exact(QK).zip(q.chunks_exact_mut(QK)).enumerate() {
        let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
        let (dv, id) = block_scale(amax);
        let mut sum = 0i32;
        for (q, v) in qb.iter_mut().zip(xb) {
            // |v * id| <= 127 (plus rounding), well inside the trick's range; NaN
            // stays NaN through clamp and becomes 0 in the cast.
            let r = round_even_small(v * id).clamp(-127.0, 127.0) as i32;
            *q = r as i8;
            sum += r;
        }
        store_block_sums(bi, (dv, sum), d, s, qsum);
    }
}

/// Dequantizes a whole ggml tensor of `rows × cols` into f32 (reference for tests and
/// for small float tensors).
///
/// # Errors
/// [`KernelError::Shape`] when the byte length does not match the shape.
pub fn dequantize_matrix(
    format: WeightFormat,
    data: &[u8],
    rows: usize,
    cols: usize,
) -> Result<Vec<f32>, KernelError> {
    let rb = format.row_bytes(cols)?;
    if data.len() != rows * rb {
        return Err(KernelError::Shape(format!(
            "{rows}×{cols} {format:?} needs {} bytes, got {}",
            rows * rb,
            data.len()
        )));
    }
    let mut out = vec![0f32; rows * cols];
    for (o, s) in out
        .chunks_exact_mut(cols.max(1))
        .zip(data.chunks_exact(rb.max(1)))
    {
        dequantize_row(format, s, o)?;
    }
    Ok(out)
}
