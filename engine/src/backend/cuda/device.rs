//! The operations the device forward pass needs, behind one trait with two
//! implementations: [`CpuDevice`] (host vectors and the CPU twins) and, with feature
//! `cuda`, `CudaDevice` (device buffers and the NVRTC-compiled kernels). The runner
//! and the kernel tests are written once against [`Device`] (candle's `test_device!`
//! pattern: one body, instantiated per device).
//!
//! Every kernel method takes whole buffers plus integer offsets, never sub-views, so
//! the CUDA implementation passes fixed pointers that a captured CUDA graph can
//! replay.

use super::twin::{self, KvParams, MatShape, QuantFormat, SampleParams};

/// Errors of a device operation.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// No usable device (no driver, no GPU, NVRTC missing); the message says which.
    #[error("CUDA device not available: {0}")]
    Unavailable(String),
    /// A driver, NVRTC or launch call failed.
    #[error("CUDA call failed: {0}")]
    Driver(String),
    /// Operands that do not fit the operation (an engine bug, reported).
    #[error("device operands: {0}")]
    Shape(String),
}

/// Element types that live in device buffers.
pub trait Elem: Copy + Default + Send + Sync + std::fmt::Debug + DevRepr + 'static {}
impl Elem for f32 {}
impl Elem for u32 {}
impl Elem for u16 {}
impl Elem for u8 {}

/// What a device buffer element must also be for the CUDA implementation.
#[cfg(feature = "cuda")]
pub trait DevRepr: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits {}
#[cfg(feature = "cuda")]
impl<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits> DevRepr for T {}
/// What a device buffer element must also be for the CUDA implementation.
#[cfg(not(feature = "cuda"))]
pub trait DevRepr {}
#[cfg(not(feature = "cuda"))]
impl<T> DevRepr for T {}

/// Parameters of [`Device::rope_store_kv`] beyond the KV geometry.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeParams {
    /// Rotated dimensions per head.
    pub rope_dims: usize,
    /// `base^(-2 / rope_dims)`.
    pub theta_scale: f32,
}

/// A compute device: buffers and the kernels of the llama forward pass.
pub trait Device {
    /// A buffer of `T` on the device.
    type Buf<T: Elem>;

    /// A short name for logs and test output.
    fn name(&self) -> String;
    /// A zeroed buffer.
    ///
    /// # Errors
    /// Out of memory or a driver failure.
    fn zeros<T: Elem>(&self, len: usize) -> Result<Self::Buf<T>, DeviceError>;
    /// A buffer holding `src`.
    ///
    /// # Errors
    /// Out of memory or a driver failure.
    fn upload<T: Elem>(&self, src: &[T]) -> Result<Self::Buf<T>, DeviceError>;
    /// Overwrites the first `src.len()` elements of `dst`.
    ///
    /// # Errors
    /// `src` longer than `dst`, or a driver failure.
    fn write<T: Elem>(&self, dst: &mut Self::Buf<T>, src: &[T]) -> Result<(), DeviceError>;
    /// Copies the first `len` elements back (waits for the work queued before).
    ///
    /// # Errors
    /// `len` past the buffer, or a driver failure (a failed kernel shows up here).
    fn read<T: Elem>(&self, src: &Self::Buf<T>, len: usize) -> Result<Vec<T>, DeviceError>;
    /// Elements in a buffer.
    fn len<T: Elem>(&self, buf: &Self::Buf<T>) -> usize;
    /// Free device memory in bytes (`None`: not a memory-limited device).
    ///
    /// # Errors
    /// A driver failure.
    fn free_memory(&self) -> Result<Option<usize>, DeviceError>;

    /// See `embed.cu`.
    ///
    /// # Errors
    /// A launch failure.
    fn embed(
        &self,
        fmt: QuantFormat,
        table: &Self::Buf<u8>,
        tokens: &Self::Buf<u32>,
        out: &mut Self::Buf<f32>,
        n: usize,
        dim: usize,
    ) -> Result<(), DeviceError>;
    /// See `rmsnorm.cu` (`rms_norm`): `n` rows selected by `rows`.
    ///
    /// # Errors
    /// A launch failure.
    #[allow(clippy::too_many_arguments)] // mirrors the kernel
    fn rms_norm(
        &self,
        x: &Self::Buf<f32>,
        w: &Self::Buf<f32>,
        rows: &Self::Buf<u32>,
        out: &mut Self::Buf<f32>,
        n: usize,
        dim: usize,
        eps: f32,
    ) -> Result<(), DeviceError>;
    /// See `rmsnorm.cu` (`add_rms_norm`).
    ///
    /// # Errors
    /// A launch failure.
    #[allow(clippy::too_many_arguments)] // mirrors the kernel
    fn add_rms_norm(
        &self,
        x: &mut Self::Buf<f32>,
        y: &Self::Buf<f32>,
        w: &Self::Buf<f32>,
        out: &mut Self::Buf<f32>,
        n: usize,
        dim: usize,
        eps: f32,
    ) -> Result<(), DeviceError>;
    /// See `silu_mul.cu` (`add`).
    ///
    /// # Errors
    /// A launch failure.
    fn add(
        &self,
        x: &mut Self::Buf<f32>,
        y: &Self::Buf<f32>,
        len: usize,
    ) -> Result<(), DeviceError>;
    /// See `matmul.cu`; the device picks the decode or the tiled kernel by `s.n`.
    ///
    /// # Errors
    /// A launch failure.
    fn matmul(
        &self,
        fmt: QuantFormat,
        w: &Self::Buf<u8>,
        x: &Self::Buf<f32>,
        y: &mut Self::Buf<f32>,
        s: MatShape,
    ) -> Result<(), DeviceError>;
    /// See `silu_mul.cu` (`silu_mul`).
    ///
    /// # Errors
    /// A launch failure.
    fn silu_mul(
        &self,
        gate_up: &Self::Buf<f32>,
        out: &mut Self::Buf<f32>,
        ffn: usize,
        n: usize,
    ) -> Result<(), DeviceError>;
    /// See `rope_kv.cu`.
    ///
    /// # Errors
    /// A launch failure.
    #[allow(clippy::too_many_arguments)] // mirrors the kernel
    fn rope_store_kv(
        &self,
        qkv: &mut Self::Buf<f32>,
        pos: &Self::Buf<u32>,
        slots: &Self::Buf<u32>,
        k_cache: &mut Self::Buf<u16>,
        v_cache: &mut Self::Buf<u16>,
        kv: &KvParams,
        rope: RopeParams,
        n: usize,
    ) -> Result<(), DeviceError>;
    /// See `attention.cu`.
    ///
    /// # Errors
    /// A launch failure.
    #[allow(clippy::too_many_arguments)] // mirrors the kernel
    fn paged_attention(
        &self,
        qkv: &Self::Buf<f32>,
        k_cache: &Self::Buf<u16>,
        v_cache: &Self::Buf<u16>,
        block_tables: &Self::Buf<u32>,
        table_off: &Self::Buf<u32>,
        pos: &Self::Buf<u32>,
        out: &mut Self::Buf<f32>,
        kv: &KvParams,
        scale: f32,
        n: usize,
    ) -> Result<(), DeviceError>;
    /// See `sample.cu` (`argmax_rows`).
    ///
    /// # Errors
    /// A launch failure.
    fn argmax_rows(
        &self,
        logits: &Self::Buf<f32>,
        rows: usize,
        vocab: usize,
        out: &mut Self::Buf<u32>,
    ) -> Result<(), DeviceError>;
    /// See `sample.cu` (`sample_top_k_top_p`); `scratch` holds `rows × vocab` floats.
    ///
    /// # Errors
    /// Parameters out of the kernel's range, or a launch failure.
    #[allow(clippy::too_many_arguments)] // mirrors the kernel
    fn sample_top_k_top_p(
        &self,
        logits: &Self::Buf<f32>,
        scratch: &mut Self::Buf<f32>,
        rows: usize,
        vocab: usize,
        p: SampleParams,
        uniforms: &Self::Buf<f32>,
        out: &mut Self::Buf<u32>,
    ) -> Result<(), DeviceError>;

    /// Starts recording the launches that follow for replay under `key` (CUDA
    /// graphs); `Ok(false)` when the device does not record (the launches then simply
    /// run).
    ///
    /// # Errors
    /// A driver failure.
    fn begin_capture(&self) -> Result<bool, DeviceError> {
        Ok(false)
    }
    /// Ends a recording started by [`Device::begin_capture`] and keeps it as `key`.
    ///
    /// # Errors
    /// A driver failure (the launches recorded are then lost).
    fn end_capture(&self, _key: usize) -> Result<(), DeviceError> {
        Ok(())
    }
    /// Replays recording `key`; `Ok(false)` when there is none.
    ///
    /// # Errors
    /// A driver failure.
    fn replay(&self, _key: usize) -> Result<bool, DeviceError> {
        Ok(false)
    }
    /// Forgets every recording (buffers they point at are about to change).
    fn drop_captures(&self) {}
}

/// Checks `need <= have` for a buffer argument.
///
/// # Errors
/// [`DeviceError::Shape`] naming the argument.
pub fn need(what: &str, have: usize, need: usize) -> Result<(), DeviceError> {
    if need > have {
        return Err(DeviceError::Shape(format!(
            "{what}: {need} elements needed, buffer holds {have}"
        )));
    }
    Ok(())
}

/// The host device: buffers are vectors, kernels are the CPU twins.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuDevice;

impl Device for CpuDevice {
    type Buf<T: Elem> = Vec<T>;

    fn name(&self) -> String {
        "cpu-twin".into()
    }

    fn zeros<T: Elem>(&self, len: usize) -> Result<Vec<T>, DeviceError> {
        Ok(vec![T::default(); len])
    }

    fn upload<T: Elem>(&self, src: &[T]) -> Result<Vec<T>, DeviceError> {
        Ok(src.to_vec())
    }

    fn write<T: Elem>(&self, dst: &mut Vec<T>, src: &[T]) -> Result<(), DeviceError> {
        need("write", dst.len(), src.len())?;
        dst[..src.len()].copy_from_slice(src);
        Ok(())
    }

    fn read<T: Elem>(&self, src: &Vec<T>, len: usize) -> Result<Vec<T>, DeviceError> {
        need("read", src.len(), len)?;
        Ok(src[..len].to_vec())
    }

    fn len<T: Elem>(&self, buf: &Vec<T>) -> usize {
        buf.len()
    }

    fn free_memory(&self) -> Result<Option<usize>, DeviceError> {
        Ok(None)
    }

    fn embed(
        &self,
        fmt: QuantFormat,
        table: &Vec<u8>,
        tokens: &Vec<u32>,
        out: &mut Vec<f32>,
        n: usize,
        dim: usize,
    ) -> Result<(), DeviceError> {
        need("embed out", out.len(), n * dim)?;
        twin::embed(fmt, table, &tokens[..n], out, dim);
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        rows: &Vec<u32>,
        out: &mut Vec<f32>,
        n: usize,
        dim: usize,
        eps: f32,
    ) -> Result<(), DeviceError> {
        need("rms_norm out", out.len(), n * dim)?;
        twin::rms_norm(x, w, &rows[..n], out, dim, eps);
        Ok(())
    }

    fn add_rms_norm(
        &self,
        x: &mut Vec<f32>,
        y: &Vec<f32>,
        w: &Vec<f32>,
        out: &mut Vec<f32>,
        n: usize,
        dim: usize,
        eps: f32,
    ) -> Result<(), DeviceError> {
        need("add_rms_norm", x.len().min(y.len()).min(out.len()), n * dim)?;
        twin::add_rms_norm(x, y, w, out, n, dim, eps);
        Ok(())
    }

    fn add(&self, x: &mut Vec<f32>, y: &Vec<f32>, len: usize) -> Result<(), DeviceError> {
        need("add", x.len().min(y.len()), len)?;
        twin::add(x, y, len);
        Ok(())
    }

    fn matmul(
        &self,
        fmt: QuantFormat,
        w: &Vec<u8>,
        x: &Vec<f32>,
        y: &mut Vec<f32>,
        s: MatShape,
    ) -> Result<(), DeviceError> {
        need("matmul x", x.len(), s.n * s.cols)?;
        need(
            "matmul y",
            y.len(),
            s.n.saturating_sub(1) * s.ldy + s.yoff + s.rows,
        )?;
        need(
            "matmul w",
            w.len(),
            s.rows * s.cols / 32 * fmt.block_bytes(),
        )?;
        twin::matmul(fmt, w, x, y, s);
        Ok(())
    }

    fn silu_mul(
        &self,
        gate_up: &Vec<f32>,
        out: &mut Vec<f32>,
        ffn: usize,
        n: usize,
    ) -> Result<(), DeviceError> {
        need("silu_mul out", out.len(), n * ffn)?;
        twin::silu_mul(gate_up, out, ffn, n);
        Ok(())
    }

    fn rope_store_kv(
        &self,
        qkv: &mut Vec<f32>,
        pos: &Vec<u32>,
        slots: &Vec<u32>,
        k_cache: &mut Vec<u16>,
        v_cache: &mut Vec<u16>,
        kv: &KvParams,
        rope: RopeParams,
        n: usize,
    ) -> Result<(), DeviceError> {
        need("rope qkv", qkv.len(), n * kv.qkv_width())?;
        twin::rope_store_kv(
            qkv,
            &pos[..n],
            &slots[..n],
            k_cache,
            v_cache,
            kv,
            rope.rope_dims,
            rope.theta_scale,
        );
        Ok(())
    }

    fn paged_attention(
        &self,
        qkv: &Vec<f32>,
        k_cache: &Vec<u16>,
        v_cache: &Vec<u16>,
        block_tables: &Vec<u32>,
        table_off: &Vec<u32>,
        pos: &Vec<u32>,
        out: &mut Vec<f32>,
        kv: &KvParams,
        scale: f32,
        n: usize,
    ) -> Result<(), DeviceError> {
        need("attention out", out.len(), n * kv.n_heads * kv.head_dim)?;
        twin::paged_attention(
            qkv,
            k_cache,
            v_cache,
            block_tables,
            &table_off[..n],
            &pos[..n],
            out,
            kv,
            scale,
        );
        Ok(())
    }

    fn argmax_rows(
        &self,
        logits: &Vec<f32>,
        rows: usize,
        vocab: usize,
        out: &mut Vec<u32>,
    ) -> Result<(), DeviceError> {
        need("argmax logits", logits.len(), rows * vocab)?;
        twin::argmax_rows(&logits[..rows * vocab], vocab, &mut out[..rows]);
        Ok(())
    }

    fn sample_top_k_top_p(
        &self,
        logits: &Vec<f32>,
        _scratch: &mut Vec<f32>,
        rows: usize,
        vocab: usize,
        p: SampleParams,
        uniforms: &Vec<f32>,
        out: &mut Vec<u32>,
    ) -> Result<(), DeviceError> {
        check_sample_params(p)?;
        need("sample logits", logits.len(), rows * vocab)?;
        twin::sample_top_k_top_p(
            &logits[..rows * vocab],
            vocab,
            p,
            uniforms,
            &mut out[..rows],
        );
        Ok(())
    }
}

/// The range the sampling kernel handles (the host samples otherwise).
///
/// # Errors
/// [`DeviceError::Shape`] for `top_k` outside `1..=256`, `top_p` outside `(0, 1]` or a
/// temperature that is not positive.
pub fn check_sample_params(p: SampleParams) -> Result<(), DeviceError> {
    let top_k_ok = (1..=twin::TOPK_MAX).contains(&p.top_k);
    let top_p_ok = p.top_p > 0.0 && p.top_p <= 1.0;
    let temperature_ok = p.temperature > 0.0 && p.temperature.is_finite();
    if !(top_k_ok && top_p_ok && temperature_ok) {
        return Err(DeviceError::Shape(format!(
            "device sampling needs top_k in 1..={}, top_p in (0, 1], temperature > 0: {p:?}",
            twin::TOPK_MAX
        )));
    }
    Ok(())
}
