//! The device backend, whatever the device: the operations the device forward pass
//! needs behind one trait, [`Device`], with two implementations: [`CpuDevice`] (host
//! vectors and the CPU twins, always built) and, with feature `cuda`,
//! `backend::cuda::gpu::CudaDevice` (device buffers and the NVRTC-compiled kernels).
//! The runner and the kernel tests are written once against [`Device`] (candle's
//! `test_device!` pattern: one body, instantiated per device).
//!
//! - [`twin`]: the CPU twin of every kernel (same arguments and layouts, plain Rust);
//! - [`CpuDevice`] ([`cpu_device`]): the [`Device`] running on the twins, so the
//!   kernel-vs-twin tests and the whole device forward pass run in `make test`;
//! - [`runner`]: [`runner::DeviceRunner`], the llama forward pass over a device, with
//!   decode steps recorded as CUDA graphs per batch-size bucket.
//!
//! Operands are checked once, here: each kernel operation is a provided method of
//! [`Device`] that checks buffer sizes and argument ranges, returns
//! [`DeviceError::Shape`] on a misfit, skips empty launches, and only then calls the
//! device's own `launch_*` method. The twin is the reference the GPU is tested
//! against, so both devices refuse the same operands with the same error; a
//! `launch_*` method can only be reached through its check, since it needs a
//! [`Checked`] token that only this module makes.
//!
//! Every kernel method takes whole buffers plus integer offsets, never sub-views, so
//! the CUDA implementation passes fixed pointers that a captured CUDA graph can
//! replay.

mod cpu_device;
pub mod runner;
pub mod twin;

pub use cpu_device::CpuDevice;

use std::ops::Range;

use twin::{KvParams, MatShape, QuantFormat, SampleParams};

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

/// Proof that a [`Device`] provided method checked the operands of the `launch_*`
/// call it makes: only this module can make one, so a device's own code is never
/// reached with operands that were not checked.
#[derive(Debug)]
pub struct Checked(());

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

/// Checks that the integer arguments a kernel takes as `int` fit one.
fn fits_int(args: &[(&str, usize)]) -> Result<(), DeviceError> {
    match args.iter().find(|(_, v)| i32::try_from(*v).is_err()) {
        Some((what, v)) => Err(DeviceError::Shape(format!("{what} = {v} exceeds i32"))),
        None => Ok(()),
    }
}

/// Checks that `cols` is whole 32-element blocks (every quantized kernel reads so).
fn whole_blocks(what: &str, cols: usize) -> Result<(), DeviceError> {
    if !cols.is_multiple_of(crate::kernels::quant::QK) {
        return Err(DeviceError::Shape(format!(
            "{what}: {cols} columns are not whole blocks of 32"
        )));
    }
    Ok(())
}

/// Checks the geometry both KV kernels assume: whole query groups per KV head, and
/// integer arguments that fit the kernels' `int`s.
fn kv_geometry(kv: &KvParams) -> Result<(), DeviceError> {
    if kv.n_kv_heads == 0 || !kv.n_heads.is_multiple_of(kv.n_kv_heads) {
        return Err(DeviceError::Shape(format!(
            "KV geometry: query heads must be whole groups per KV head: {kv:?}"
        )));
    }
    fits_int(&[
        ("layer", kv.layer),
        ("num_blocks", kv.num_blocks),
        ("block_size", kv.block_size),
        ("n_heads", kv.n_heads),
        ("n_kv_heads", kv.n_kv_heads),
        ("head_dim", kv.head_dim),
    ])
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

/// A compute device: buffers and the kernels of the llama forward pass.
///
/// Callers use the provided methods (`write`, `read`, `embed`, ...): they check the
/// operands and call the device's `launch_*`/`*_unchecked` method, which a device
/// implements on operands that fit (see the module docs).
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
    /// Elements in a buffer.
    fn len<T: Elem>(&self, buf: &Self::Buf<T>) -> usize;
    /// Free device memory in bytes (`None`: not a memory-limited device).
    ///
    /// # Errors
    /// A driver failure.
    fn free_memory(&self) -> Result<Option<usize>, DeviceError>;

    /// Overwrites the first `src.len()` elements of `dst` (`src` not empty, fits).
    ///
    /// # Errors
    /// A driver failure.
    fn write_unchecked<T: Elem>(
        &self,
        dst: &mut Self::Buf<T>,
        src: &[T],
        checked: Checked,
    ) -> Result<(), DeviceError>;
    /// Copies elements `range` back (not empty, fits).
    ///
    /// # Errors
    /// A driver failure (a failed kernel shows up here).
    fn read_unchecked<T: Elem>(
        &self,
        src: &Self::Buf<T>,
        range: Range<usize>,
        checked: Checked,
    ) -> Result<Vec<T>, DeviceError>;

    /// [`Device::embed`] on checked operands, `n > 0`.
    ///
    /// # Errors
    /// A launch failure.
    #[allow(clippy::too_many_arguments)] // mirrors the kernel
    fn launch_embed(
        &self,
        fmt: QuantFormat,
        table: &Self::Buf<u8>,
        tokens: &Self::Buf<u32>,
        out: &mut Self::Buf<f32>,
        n: usize,
        dim: usize,
        checked: Checked,
    ) -> Result<(), DeviceError>;
    /// [`Device::rms_norm`] on checked operands, `n > 0`.
    ///
    /// # Errors
    /// A launch failure.
    #[allow(clippy::too_many_arguments)] // mirrors the kernel
    fn launch_rms_norm(
        &self,
        x: &Self::Buf<f32>,
        w: &Self::Buf<f32>,
        rows: &Self::Buf<u32>,
        out: &mut Self::Buf<f32>,
        n: usize,
        dim: usize,
        eps: f32,
        checked: Checked,
    ) -> Result<(), DeviceError>;
    /// [`Device::add_rms_norm`] on checked operands, `n > 0`.
    ///
    /// # Errors
    /// A launch failure.
    #[allow(clippy::too_many_arguments)] // mirrors the kernel
    fn launch_add_rms_norm(
        &self,
        x: &mut Self::Buf<f32>,
        y: &Self::Buf<f32>,
        w: &Self::Buf<f32>,
        out: &mut Self::Buf<f32>,
        n: usize,
        dim: usize,
        eps: f32,
        checked: Checked,
    ) -> Result<(), DeviceError>;
    /// [`Device::add`] on checked operands, `len > 0`.
    ///
    /// # Errors
    /// A launch failure.
    fn launch_add(
        &self,
        x: &mut Self::Buf<f32>,
        y: &Self::Buf<f32>,
        len: usize,
        checked: Checked,
    ) -> Result<(), DeviceError>;
    /// [`Device::matmul`] on checked operands, `s.n > 0` and `s.rows > 0`.
    ///
    /// # Errors
    /// A launch failure.
    fn launch_matmul(
        &self,
        fmt: QuantFormat,
        w: &Self::Buf<u8>,
        x: &Self::Buf<f32>,
        y: &mut Self::Buf<f32>,
        s: MatShape,
        checked: Checked,
    ) -> Result<(), DeviceError>;
    /// [`Device::silu_mul`] on checked operands, `n * ffn > 0`.
    ///
    /// # Errors
    /// A launch failure.
    fn launch_silu_mul(
        &self,
        gate_up: &Self::Buf<f32>,
        out: &mut Self::Buf<f32>,
        ffn: usize,
        n: usize,
        checked: Checked,
    ) -> Result<(), DeviceError>;
    /// [`Device::rope_store_kv`] on checked operands, `n > 0`.
    ///
    /// # Errors
    /// A launch failure.
    #[allow(clippy::too_many_arguments)] // mirrors the kernel
    fn launch_rope_store_kv(
        &self,
        qkv: &mut Self::Buf<f32>,
        pos: &Self::Buf<u32>,
        slots: &Self::Buf<u32>,
        k_cache: &mut Self::Buf<u16>,
        v_cache: &mut Self::Buf<u16>,
        kv: &KvParams,
        rope: RopeParams,
        n: usize,
        checked: Checked,
    ) -> Result<(), DeviceError>;
    /// [`Device::paged_attention`] on checked operands, `n > 0`.
    ///
    /// # Errors
    /// A launch failure.
    #[allow(clippy::too_many_arguments)] // mirrors the kernel
    fn launch_paged_attention(
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
        checked: Checked,
    ) -> Result<(), DeviceError>;
    /// [`Device::argmax_rows`] on checked operands, `rows > 0`.
    ///
    /// # Errors
    /// A launch failure.
    fn launch_argmax_rows(
        &self,
        logits: &Self::Buf<f32>,
        rows: usize,
        vocab: usize,
        out: &mut Self::Buf<u32>,
        checked: Checked,
    ) -> Result<(), DeviceError>;
    /// [`Device::sample_top_k_top_p`] on checked operands, `rows` not empty.
    ///
    /// # Errors
    /// A launch failure.
    #[allow(clippy::too_many_arguments)] // mirrors the kernel
    fn launch_sample_top_k_top_p(
        &self,
        logits: &Self::Buf<f32>,
        scratch: &mut Self::Buf<f32>,
        rows: Range<usize>,
        vocab: usize,
        p: SampleParams,
        uniforms: &Self::Buf<f32>,
        out: &mut Self::Buf<u32>,
        checked: Checked,
    ) -> Result<(), DeviceError>;

    /// Overwrites the first `src.len()` elements of `dst`.
    ///
    /// # Errors
    /// [`DeviceError::Shape`] when `src` is longer than `dst`; a driver failure.
    fn write<T: Elem>(&self, dst: &mut Self::Buf<T>, src: &[T]) -> Result<(), DeviceError> {
        need("write", self.len(dst), src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        self.write_unchecked(dst, src, Checked(()))
    }

    /// Copies the first `len` elements back (waits for the work queued before).
    ///
    /// # Errors
    /// [`DeviceError::Shape`] when `len` is past the buffer; a driver failure (a
    /// failed kernel shows up here).
    fn read<T: Elem>(&self, src: &Self::Buf<T>, len: usize) -> Result<Vec<T>, DeviceError> {
        self.read_range(src, 0..len)
    }

    /// Copies elements `range` back (waits for the work queued before).
    ///
    /// # Errors
    /// [`DeviceError::Shape`] when `range` is past the buffer; a driver failure.
    fn read_range<T: Elem>(
        &self,
        src: &Self::Buf<T>,
        range: Range<usize>,
    ) -> Result<Vec<T>, DeviceError> {
        need("read", self.len(src), range.end)?;
        if range.is_empty() {
            return Ok(Vec::new());
        }
        self.read_unchecked(src, range, Checked(()))
    }

    /// See `embed.cu`: `out[t] = dequantize(table row tokens[t])` for `n` tokens.
    ///
    /// # Errors
    /// [`DeviceError::Shape`] for operands that do not fit; a launch failure.
    fn embed(
        &self,
        fmt: QuantFormat,
        table: &Self::Buf<u8>,
        tokens: &Self::Buf<u32>,
        out: &mut Self::Buf<f32>,
        n: usize,
        dim: usize,
    ) -> Result<(), DeviceError> {
        whole_blocks("embed", dim)?;
        fits_int(&[("n", n), ("dim", dim)])?;
        need("embed tokens", self.len(tokens), n)?;
        need("embed out", self.len(out), n * dim)?;
        need("embed table", self.len(table), dim / 32 * fmt.block_bytes())?;
        if n == 0 {
            return Ok(()); // a zero-sized grid is a launch error
        }
        self.launch_embed(fmt, table, tokens, out, n, dim, Checked(()))
    }

    /// See `rmsnorm.cu` (`rms_norm`): `n` rows of `x` selected by `rows`.
    ///
    /// # Errors
    /// [`DeviceError::Shape`] for operands that do not fit; a launch failure.
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
    ) -> Result<(), DeviceError> {
        fits_int(&[("n", n), ("dim", dim)])?;
        need("rms_norm x", self.len(x), dim)?;
        need("rms_norm w", self.len(w), dim)?;
        need("rms_norm rows", self.len(rows), n)?;
        need("rms_norm out", self.len(out), n * dim)?;
        if n == 0 {
            return Ok(()); // a zero-sized grid is a launch error
        }
        self.launch_rms_norm(x, w, rows, out, n, dim, eps, Checked(()))
    }

    /// See `rmsnorm.cu` (`add_rms_norm`): `x += y`, then `out = rmsnorm(x) * w`.
    ///
    /// # Errors
    /// [`DeviceError::Shape`] for operands that do not fit; a launch failure.
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
    ) -> Result<(), DeviceError> {
        fits_int(&[("n", n), ("dim", dim)])?;
        need("add_rms_norm x", self.len(x), n * dim)?;
        need("add_rms_norm y", self.len(y), n * dim)?;
        need("add_rms_norm w", self.len(w), dim)?;
        need("add_rms_norm out", self.len(out), n * dim)?;
        if n == 0 {
            return Ok(()); // a zero-sized grid is a launch error
        }
        self.launch_add_rms_norm(x, y, w, out, n, dim, eps, Checked(()))
    }

    /// See `silu_mul.cu` (`add`): `x[i] += y[i]` for `len` elements.
    ///
    /// # Errors
    /// [`DeviceError::Shape`] for operands that do not fit; a launch failure.
    fn add(
        &self,
        x: &mut Self::Buf<f32>,
        y: &Self::Buf<f32>,
        len: usize,
    ) -> Result<(), DeviceError> {
        fits_int(&[("len", len)])?;
        need("add x", self.len(x), len)?;
        need("add y", self.len(y), len)?;
        if len == 0 {
            return Ok(()); // a zero-sized grid is a launch error
        }
        self.launch_add(x, y, len, Checked(()))
    }

    /// See `matmul.cu`; the device picks the decode or the tiled kernel by `s.n`.
    ///
    /// # Errors
    /// [`DeviceError::Shape`] for operands that do not fit; a launch failure.
    fn matmul(
        &self,
        fmt: QuantFormat,
        w: &Self::Buf<u8>,
        x: &Self::Buf<f32>,
        y: &mut Self::Buf<f32>,
        s: MatShape,
    ) -> Result<(), DeviceError> {
        whole_blocks("matmul", s.cols)?;
        fits_int(&[
            ("rows", s.rows),
            ("cols", s.cols),
            ("n", s.n),
            ("ldy", s.ldy),
            ("yoff", s.yoff),
        ])?;
        need("matmul x", self.len(x), s.n * s.cols)?;
        need(
            "matmul y",
            self.len(y),
            s.n.saturating_sub(1) * s.ldy + s.yoff + s.rows,
        )?;
        need(
            "matmul w",
            self.len(w),
            s.rows * s.cols / 32 * fmt.block_bytes(),
        )?;
        if s.n == 0 || s.rows == 0 {
            return Ok(()); // a zero-sized grid is a launch error
        }
        self.launch_matmul(fmt, w, x, y, s, Checked(()))
    }

    /// See `silu_mul.cu` (`silu_mul`): `out[t][j] = silu(gate[t][j]) * up[t][j]`.
    ///
    /// # Errors
    /// [`DeviceError::Shape`] for operands that do not fit; a launch failure.
    fn silu_mul(
        &self,
        gate_up: &Self::Buf<f32>,
        out: &mut Self::Buf<f32>,
        ffn: usize,
        n: usize,
    ) -> Result<(), DeviceError> {
        fits_int(&[("ffn", ffn), ("n", n), ("n * ffn", n * ffn)])?;
        need("silu_mul in", self.len(gate_up), 2 * n * ffn)?;
        need("silu_mul out", self.len(out), n * ffn)?;
        if n * ffn == 0 {
            return Ok(()); // a zero-sized grid is a launch error
        }
        self.launch_silu_mul(gate_up, out, ffn, n, Checked(()))
    }

    /// See `rope_kv.cu`: rotates q and k of `n` tokens, stores k and v in the cache.
    ///
    /// # Errors
    /// [`DeviceError::Shape`] for operands that do not fit; a launch failure.
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
    ) -> Result<(), DeviceError> {
        kv_geometry(kv)?;
        fits_int(&[("n", n), ("rope_dims", rope.rope_dims)])?;
        if rope.rope_dims > kv.head_dim {
            return Err(DeviceError::Shape(format!(
                "rope_dims {} exceeds head_dim {}",
                rope.rope_dims, kv.head_dim
            )));
        }
        need("rope qkv", self.len(qkv), n * kv.qkv_width())?;
        need("rope pos", self.len(pos), n)?;
        need("rope slots", self.len(slots), n)?;
        need(
            "rope k cache",
            self.len(k_cache),
            kv.cache_len(kv.layer + 1),
        )?;
        need(
            "rope v cache",
            self.len(v_cache),
            kv.cache_len(kv.layer + 1),
        )?;
        if n == 0 {
            return Ok(()); // a zero-sized grid is a launch error
        }
        self.launch_rope_store_kv(qkv, pos, slots, k_cache, v_cache, kv, rope, n, Checked(()))
    }

    /// See `attention.cu`: causal GQA of `n` tokens over the paged cache.
    ///
    /// # Errors
    /// [`DeviceError::Shape`] for operands that do not fit; a launch failure.
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
    ) -> Result<(), DeviceError> {
        kv_geometry(kv)?;
        fits_int(&[("n", n)])?;
        // One warp holds a head: 32 lanes times at most HD_MAX / 32 dimensions each.
        if !(kv.head_dim.is_multiple_of(32) && (32..=256).contains(&kv.head_dim)) {
            return Err(DeviceError::Shape(format!(
                "attention: head_dim {} is not a multiple of 32 in 32..=256",
                kv.head_dim
            )));
        }
        need("attention qkv", self.len(qkv), n * kv.qkv_width())?;
        need("attention out", self.len(out), n * kv.n_heads * kv.head_dim)?;
        need("attention pos", self.len(pos), n)?;
        need("attention table offsets", self.len(table_off), n)?;
        need(
            "attention k cache",
            self.len(k_cache),
            kv.cache_len(kv.layer + 1),
        )?;
        need(
            "attention v cache",
            self.len(v_cache),
            kv.cache_len(kv.layer + 1),
        )?;
        if n == 0 {
            return Ok(()); // a zero-sized grid is a launch error
        }
        self.launch_paged_attention(
            qkv,
            k_cache,
            v_cache,
            block_tables,
            table_off,
            pos,
            out,
            kv,
            scale,
            n,
            Checked(()),
        )
    }

    /// See `sample.cu` (`argmax_rows`): each row's largest logit's index.
    ///
    /// # Errors
    /// [`DeviceError::Shape`] for operands that do not fit; a launch failure.
    fn argmax_rows(
        &self,
        logits: &Self::Buf<f32>,
        rows: usize,
        vocab: usize,
        out: &mut Self::Buf<u32>,
    ) -> Result<(), DeviceError> {
        fits_int(&[("rows", rows), ("vocab", vocab)])?;
        need("argmax logits", self.len(logits), rows * vocab)?;
        need("argmax out", self.len(out), rows)?;
        if rows == 0 {
            return Ok(()); // a zero-sized grid is a launch error
        }
        self.launch_argmax_rows(logits, rows, vocab, out, Checked(()))
    }

    /// See `sample.cu` (`sample_top_k_top_p`), over logits rows `rows` (row `r` reads
    /// `uniforms[r]`, works in `scratch` row `r`, writes `out[r]`), all with `p`.
    ///
    /// # Errors
    /// [`DeviceError::Shape`] for parameters out of the kernel's range
    /// ([`check_sample_params`]) or operands that do not fit; a launch failure.
    #[allow(clippy::too_many_arguments)] // mirrors the kernel
    fn sample_top_k_top_p(
        &self,
        logits: &Self::Buf<f32>,
        scratch: &mut Self::Buf<f32>,
        rows: Range<usize>,
        vocab: usize,
        p: SampleParams,
        uniforms: &Self::Buf<f32>,
        out: &mut Self::Buf<u32>,
    ) -> Result<(), DeviceError> {
        check_sample_params(p)?;
        fits_int(&[("rows", rows.len()), ("vocab", vocab)])?;
        need("sample logits", self.len(logits), rows.end * vocab)?;
        need("sample scratch", self.len(scratch), rows.end * vocab)?;
        need("sample uniforms", self.len(uniforms), rows.end)?;
        need("sample out", self.len(out), rows.end)?;
        if rows.is_empty() {
            return Ok(()); // a zero-sized grid is a launch error
        }
        self.launch_sample_top_k_top_p(logits, scratch, rows, vocab, p, uniforms, out, Checked(()))
    }

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
