//! [`CudaDevice`]: the [`Device`] on an NVIDIA GPU through cudarc (dynamic loading:
//! the crate builds with no CUDA installed; the driver and NVRTC are looked up at run
//! time). One context, one stream; every kernel of the top-level `kernels/` compiled
//! by NVRTC for the device's architecture once, at [`CudaDevice::open`].
//!
//! Decode steps are recorded as CUDA graphs ([`Device::begin_capture`]) on that stream
//! and replayed; recorded launches hold the buffer pointers and integer arguments of
//! their recording, which the runner keeps fixed per bucket.
//!
//! cudarc panics when a CUDA library is missing, so `open` probes for the driver and
//! NVRTC libraries first and reports their absence as [`DeviceError::Unavailable`].
#![allow(unsafe_code)] // kernel launches and graph handles are FFI

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaGraph, CudaSlice, CudaStream, LaunchConfig, PushKernelArg, sys,
};
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};

use super::device::{Device, DeviceError, Elem, RopeParams, check_sample_params, need};
use super::sources::{KERNEL_FILES, MATVEC_MAX_TOKENS, nvrtc_options, program};
use super::twin::{KvParams, MatShape, QuantFormat, SampleParams};

fn drv(e: impl std::fmt::Display) -> DeviceError {
    DeviceError::Driver(e.to_string())
}

fn int(x: usize, what: &str) -> Result<i32, DeviceError> {
    i32::try_from(x).map_err(|_| DeviceError::Shape(format!("{what} = {x} exceeds i32")))
}

fn blocks(n: usize, per: usize) -> Result<u32, DeviceError> {
    u32::try_from(n.div_ceil(per)).map_err(|_| DeviceError::Shape(format!("grid of {n}/{per}")))
}

fn cfg(grid: (u32, u32), block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0, grid.1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A recorded graph. CUDA graph handles may move between threads as long as no two
/// threads use one at the same time; the runner (and so this device) is used by one
/// thread at a time (`&mut` forward steps), which is what cudarc's `!Send` guards.
struct SendGraph(CudaGraph);
// SAFETY: see above: the graph is only touched through `&CudaDevice` methods called by
// the single owner of the runner; it is never shared between threads concurrently.
unsafe impl Send for SendGraph {}

/// Whether the CUDA driver and NVRTC libraries can be loaded (without loading them in a
/// way that panics).
#[must_use]
pub fn libraries_present() -> (bool, bool) {
    // SAFETY: the probes only try to dlopen the libraries by name and drop them.
    unsafe {
        (
            cudarc::driver::sys::is_culib_present(),
            cudarc::nvrtc::sys::is_culib_present(),
        )
    }
}

/// Compiles every kernel file with NVRTC for compute capability `major.minor`
/// (needs only NVRTC, no driver or GPU: `make check-kernels` runs it in CI).
///
/// # Errors
/// [`DeviceError::Unavailable`] without NVRTC; [`DeviceError::Driver`] with NVRTC's
/// log when a file does not compile.
pub fn compile_all(
    major: i32,
    minor: i32,
) -> Result<Vec<(&'static str, cudarc::nvrtc::Ptx)>, DeviceError> {
    if !libraries_present().1 {
        return Err(DeviceError::Unavailable(
            "NVRTC (libnvrtc.so.13) is not on the library path".into(),
        ));
    }
    KERNEL_FILES
        .iter()
        .map(|(file, src, _)| {
            let opts = CompileOptions {
                options: nvrtc_options(major, minor),
                name: Some((*file).to_owned()),
                ..CompileOptions::default()
            };
            compile_ptx_with_opts(program(src), opts)
                .map(|ptx| (*file, ptx))
                .map_err(|e| DeviceError::Driver(format!("NVRTC compiling {file}: {e}")))
        })
        .collect()
}

/// The CUDA device.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    funcs: HashMap<&'static str, CudaFunction>,
    graphs: RefCell<HashMap<usize, SendGraph>>,
    name: String,
    arch: (i32, i32),
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("name", &self.name)
            .field("arch", &self.arch)
            .finish_non_exhaustive()
    }
}

impl CudaDevice {
    /// Opens GPU `ordinal` and compiles every kernel for it.
    ///
    /// # Errors
    /// [`DeviceError::Unavailable`] without a driver, NVRTC or GPU;
    /// [`DeviceError::Driver`] when a kernel does not compile or load.
    pub fn open(ordinal: usize) -> Result<Self, DeviceError> {
        match libraries_present() {
            (false, _) => {
                return Err(DeviceError::Unavailable(
                    "the CUDA driver library (libcuda.so) is not installed".into(),
                ));
            }
            (true, false) => {
                return Err(DeviceError::Unavailable(
                    "NVRTC (libnvrtc.so.13) is not on the library path".into(),
                ));
            }
            (true, true) => {}
        }
        let count =
            CudaContext::device_count().map_err(|e| DeviceError::Unavailable(e.to_string()))?;
        if ordinal >= count.max(0) as usize {
            return Err(DeviceError::Unavailable(format!(
                "GPU {ordinal} requested, {count} present"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| DeviceError::Unavailable(e.to_string()))?;
        // One stream: cudarc's per-buffer event tracking only orders several streams,
        // and its event records would land inside graph captures.
        // SAFETY: every buffer of this device is used on `stream` alone.
        unsafe { ctx.disable_event_tracking() };
        // A non-default stream: the legacy default stream cannot be captured.
        let stream = ctx.new_stream().map_err(drv)?;
        let arch = ctx.compute_capability().map_err(drv)?;
        let name = ctx.name().map_err(drv)?;
        let started = std::time::Instant::now();
        let mut funcs = HashMap::new();
        for (file, ptx) in compile_all(arch.0, arch.1)? {
            let module = ctx
                .load_module(ptx)
                .map_err(|e| DeviceError::Driver(format!("loading {file}: {e}")))?;
            let entries = KERNEL_FILES
                .iter()
                .find(|f| f.0 == file)
                .map_or(&[][..], |f| f.2);
            for e in entries {
                let f = module
                    .load_function(e)
                    .map_err(|err| DeviceError::Driver(format!("{file}: {e}: {err}")))?;
                funcs.insert(*e, f);
            }
        }
        tracing::info!(
            gpu = %name,
            arch = format!("sm_{}{}", arch.0, arch.1),
            compile_ms = started.elapsed().as_millis() as u64,
            "CUDA kernels compiled"
        );
        Ok(Self {
            ctx,
            stream,
            funcs,
            graphs: RefCell::new(HashMap::new()),
            name,
            arch,
        })
    }

    fn f(&self, name: &str) -> Result<&CudaFunction, DeviceError> {
        self.funcs
            .get(name)
            .ok_or_else(|| DeviceError::Driver(format!("kernel {name} not loaded")))
    }

    /// Waits for every queued launch.
    ///
    /// # Errors
    /// The first failure of a queued launch.
    pub fn synchronize(&self) -> Result<(), DeviceError> {
        self.stream.synchronize().map_err(drv)
    }
}

impl Device for CudaDevice {
    type Buf<T: Elem> = CudaSlice<T>;

    fn name(&self) -> String {
        format!(
            "cuda:{} ({}, sm_{}{})",
            self.ctx.ordinal(),
            self.name,
            self.arch.0,
            self.arch.1
        )
    }

    fn zeros<T: Elem>(&self, len: usize) -> Result<CudaSlice<T>, DeviceError> {
        // cuMemAlloc rejects 0 bytes; a 1-element buffer stands in for an empty one.
        self.stream.alloc_zeros::<T>(len.max(1)).map_err(drv)
    }

    fn upload<T: Elem>(&self, src: &[T]) -> Result<CudaSlice<T>, DeviceError> {
        if src.is_empty() {
            return self.zeros(0);
        }
        self.stream.clone_htod(src).map_err(drv)
    }

    fn write<T: Elem>(&self, dst: &mut CudaSlice<T>, src: &[T]) -> Result<(), DeviceError> {
        need("write", dst.len(), src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        let mut view = dst.slice_mut(0..src.len());
        self.stream.memcpy_htod(src, &mut view).map_err(drv)
    }

    fn read<T: Elem>(&self, src: &CudaSlice<T>, len: usize) -> Result<Vec<T>, DeviceError> {
        need("read", src.len(), len)?;
        if len == 0 {
            return Ok(Vec::new());
        }
        self.stream.clone_dtoh(&src.slice(0..len)).map_err(drv)
    }

    fn len<T: Elem>(&self, buf: &CudaSlice<T>) -> usize {
        buf.len()
    }

    fn free_memory(&self) -> Result<Option<usize>, DeviceError> {
        let (free, _total) = self.ctx.mem_get_info().map_err(drv)?;
        Ok(Some(free))
    }

    fn embed(
        &self,
        fmt: QuantFormat,
        table: &CudaSlice<u8>,
        tokens: &CudaSlice<u32>,
        out: &mut CudaSlice<f32>,
        n: usize,
        dim: usize,
    ) -> Result<(), DeviceError> {
        need("embed out", out.len(), n * dim)?;
        if n == 0 {
            return Ok(()); // a zero-sized grid is a launch error
        }
        let f = self.f(if fmt == QuantFormat::Q8_0 {
            "embed_q8_0"
        } else {
            "embed_q4_1"
        })?;
        let (ni, di) = (int(n, "n")?, int(dim, "dim")?);
        let mut b = self.stream.launch_builder(f);
        b.arg(table).arg(tokens).arg(out).arg(&ni).arg(&di);
        // SAFETY: argument types and order match embed.cu's signature; buffer sizes
        // were checked above (the table holds every validated token's row).
        unsafe { b.launch(cfg((blocks(n, 1)?, 1), 256)) }.map_err(drv)?;
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        rows: &CudaSlice<u32>,
        out: &mut CudaSlice<f32>,
        n: usize,
        dim: usize,
        eps: f32,
    ) -> Result<(), DeviceError> {
        need("rms_norm out", out.len(), n * dim)?;
        need("rms_norm rows", rows.len(), n)?;
        if n == 0 {
            return Ok(()); // a zero-sized grid is a launch error
        }
        let di = int(dim, "dim")?;
        let mut b = self.stream.launch_builder(self.f("rms_norm")?);
        b.arg(x).arg(w).arg(rows).arg(out).arg(&di).arg(&eps);
        // SAFETY: matches rmsnorm.cu's rms_norm; sizes checked above.
        unsafe { b.launch(cfg((blocks(n, 1)?, 1), 256)) }.map_err(drv)?;
        Ok(())
    }

    fn add_rms_norm(
        &self,
        x: &mut CudaSlice<f32>,
        y: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        n: usize,
        dim: usize,
        eps: f32,
    ) -> Result<(), DeviceError> {
        need("add_rms_norm", x.len().min(y.len()).min(out.len()), n * dim)?;
        if n == 0 {
            return Ok(()); // a zero-sized grid is a launch error
        }
        let di = int(dim, "dim")?;
        let mut b = self.stream.launch_builder(self.f("add_rms_norm")?);
        b.arg(x).arg(y).arg(w).arg(out).arg(&di).arg(&eps);
        // SAFETY: matches rmsnorm.cu's add_rms_norm; sizes checked above.
        unsafe { b.launch(cfg((blocks(n, 1)?, 1), 256)) }.map_err(drv)?;
        Ok(())
    }

    fn add(
        &self,
        x: &mut CudaSlice<f32>,
        y: &CudaSlice<f32>,
        len: usize,
    ) -> Result<(), DeviceError> {
        need("add", x.len().min(y.len()), len)?;
        if len == 0 {
            return Ok(()); // a zero-sized grid is a launch error
        }
        let li = int(len, "len")?;
        let mut b = self.stream.launch_builder(self.f("add")?);
        b.arg(x).arg(y).arg(&li);
        // SAFETY: matches silu_mul.cu's add; sizes checked above.
        unsafe { b.launch(cfg((blocks(len, 256)?, 1), 256)) }.map_err(drv)?;
        Ok(())
    }

    fn matmul(
        &self,
        fmt: QuantFormat,
        w: &CudaSlice<u8>,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
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
        if s.n == 0 || s.rows == 0 {
            return Ok(()); // a zero-sized grid is a launch error
        }
        if !s.cols.is_multiple_of(32) {
            return Err(DeviceError::Shape(format!(
                "{} columns: not whole blocks",
                s.cols
            )));
        }
        let decode = s.n <= MATVEC_MAX_TOKENS;
        let name = match (decode, fmt) {
            (true, QuantFormat::Q4_1) => "matvec_q4_1",
            (true, QuantFormat::Q8_0) => "matvec_q8_0",
            (false, QuantFormat::Q4_1) => "matmul_q4_1",
            (false, QuantFormat::Q8_0) => "matmul_q8_0",
        };
        let grid = if decode {
            (blocks(s.rows, 8)?, blocks(s.n, 8)?)
        } else {
            (blocks(s.rows, 64)?, blocks(s.n, 32)?)
        };
        let a = [
            int(s.rows, "rows")?,
            int(s.cols, "cols")?,
            int(s.n, "n")?,
            int(s.ldy, "ldy")?,
            int(s.yoff, "yoff")?,
        ];
        let mut b = self.stream.launch_builder(self.f(name)?);
        b.arg(w).arg(x).arg(y);
        for v in &a {
            b.arg(v);
        }
        // SAFETY: matches matmul.cu's signatures; sizes checked above.
        unsafe { b.launch(cfg(grid, 256)) }.map_err(drv)?;
        Ok(())
    }

    fn silu_mul(
        &self,
        gate_up: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        ffn: usize,
        n: usize,
    ) -> Result<(), DeviceError> {
        need("silu_mul in", gate_up.len(), 2 * n * ffn)?;
        need("silu_mul out", out.len(), n * ffn)?;
        if n * ffn == 0 {
            return Ok(()); // a zero-sized grid is a launch error
        }
        let (fi, ni) = (int(ffn, "ffn")?, int(n, "n")?);
        int(n * ffn, "n * ffn")?;
        let mut b = self.stream.launch_builder(self.f("silu_mul")?);
        b.arg(gate_up).arg(out).arg(&fi).arg(&ni);
        // SAFETY: matches silu_mul.cu's silu_mul; sizes checked above.
        unsafe { b.launch(cfg((blocks(n * ffn, 256)?, 1), 256)) }.map_err(drv)?;
        Ok(())
    }

    fn rope_store_kv(
        &self,
        qkv: &mut CudaSlice<f32>,
        pos: &CudaSlice<u32>,
        slots: &CudaSlice<u32>,
        k_cache: &mut CudaSlice<u16>,
        v_cache: &mut CudaSlice<u16>,
        kv: &KvParams,
        rope: RopeParams,
        n: usize,
    ) -> Result<(), DeviceError> {
        need("rope qkv", qkv.len(), n * kv.qkv_width())?;
        need("rope pos/slots", pos.len().min(slots.len()), n)?;
        if n == 0 {
            return Ok(()); // a zero-sized grid is a launch error
        }
        need(
            "k cache",
            k_cache.len().min(v_cache.len()),
            kv.cache_len(kv.layer + 1),
        )?;
        let a = [
            int(kv.layer, "layer")?,
            int(kv.num_blocks, "num_blocks")?,
            int(kv.block_size, "block_size")?,
            int(kv.n_heads, "n_heads")?,
            int(kv.n_kv_heads, "n_kv_heads")?,
            int(kv.head_dim, "head_dim")?,
            int(rope.rope_dims, "rope_dims")?,
        ];
        let ni = int(n, "n")?;
        let mut b = self.stream.launch_builder(self.f("rope_store_kv")?);
        b.arg(qkv).arg(pos).arg(slots).arg(k_cache).arg(v_cache);
        for v in &a {
            b.arg(v);
        }
        b.arg(&rope.theta_scale).arg(&ni);
        // SAFETY: matches rope_kv.cu; sizes checked above; slots were validated against
        // the pool by the runner.
        unsafe { b.launch(cfg((blocks(n, 1)?, 1), 256)) }.map_err(drv)?;
        Ok(())
    }

    fn paged_attention(
        &self,
        qkv: &CudaSlice<f32>,
        k_cache: &CudaSlice<u16>,
        v_cache: &CudaSlice<u16>,
        block_tables: &CudaSlice<u32>,
        table_off: &CudaSlice<u32>,
        pos: &CudaSlice<u32>,
        out: &mut CudaSlice<f32>,
        kv: &KvParams,
        scale: f32,
        n: usize,
    ) -> Result<(), DeviceError> {
        need("attention qkv", qkv.len(), n * kv.qkv_width())?;
        need("attention out", out.len(), n * kv.n_heads * kv.head_dim)?;
        need("attention pos/offsets", pos.len().min(table_off.len()), n)?;
        if n == 0 {
            return Ok(()); // a zero-sized grid is a launch error
        }
        let a = [
            int(kv.layer, "layer")?,
            int(kv.num_blocks, "num_blocks")?,
            int(kv.block_size, "block_size")?,
            int(kv.n_heads, "n_heads")?,
            int(kv.n_kv_heads, "n_kv_heads")?,
            int(kv.head_dim, "head_dim")?,
        ];
        let ni = int(n, "n")?;
        let heads = u32::try_from(kv.n_heads).map_err(|_| DeviceError::Shape("heads".into()))?;
        let mut b = self.stream.launch_builder(self.f("paged_attention")?);
        b.arg(qkv)
            .arg(k_cache)
            .arg(v_cache)
            .arg(block_tables)
            .arg(table_off)
            .arg(pos)
            .arg(out);
        for v in &a {
            b.arg(v);
        }
        b.arg(&scale).arg(&ni);
        // SAFETY: matches attention.cu; sizes checked above; tables cover every
        // position (validated by the runner).
        unsafe { b.launch(cfg((blocks(n, 1)?, heads), 32)) }.map_err(drv)?;
        Ok(())
    }

    fn argmax_rows(
        &self,
        logits: &CudaSlice<f32>,
        rows: usize,
        vocab: usize,
        out: &mut CudaSlice<u32>,
    ) -> Result<(), DeviceError> {
        need("argmax logits", logits.len(), rows * vocab)?;
        need("argmax out", out.len(), rows)?;
        if rows == 0 {
            return Ok(()); // a zero-sized grid is a launch error
        }
        let vi = int(vocab, "vocab")?;
        let mut b = self.stream.launch_builder(self.f("argmax_rows")?);
        b.arg(logits).arg(&vi).arg(out);
        // SAFETY: matches sample.cu's argmax_rows; sizes checked above.
        unsafe { b.launch(cfg((blocks(rows, 1)?, 1), 1024)) }.map_err(drv)?;
        Ok(())
    }

    fn sample_top_k_top_p(
        &self,
        logits: &CudaSlice<f32>,
        scratch: &mut CudaSlice<f32>,
        rows: usize,
        vocab: usize,
        p: SampleParams,
        uniforms: &CudaSlice<f32>,
        out: &mut CudaSlice<u32>,
    ) -> Result<(), DeviceError> {
        check_sample_params(p)?;
        need(
            "sample logits",
            logits.len().min(scratch.len()),
            rows * vocab,
        )?;
        need("sample uniforms/out", uniforms.len().min(out.len()), rows)?;
        if rows == 0 {
            return Ok(()); // a zero-sized grid is a launch error
        }
        let (vi, ki) = (int(vocab, "vocab")?, int(p.top_k, "top_k")?);
        let mut b = self.stream.launch_builder(self.f("sample_top_k_top_p")?);
        b.arg(logits)
            .arg(scratch)
            .arg(&vi)
            .arg(&ki)
            .arg(&p.top_p)
            .arg(&p.temperature)
            .arg(uniforms)
            .arg(out);
        // SAFETY: matches sample.cu's sample_top_k_top_p; sizes and ranges checked above.
        unsafe { b.launch(cfg((blocks(rows, 1)?, 1), 1024)) }.map_err(drv)?;
        Ok(())
    }

    fn begin_capture(&self) -> Result<bool, DeviceError> {
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(drv)?;
        Ok(true)
    }

    fn end_capture(&self, key: usize) -> Result<(), DeviceError> {
        let graph = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(drv)?
            .ok_or_else(|| DeviceError::Driver("graph capture recorded nothing".into()))?;
        self.graphs.borrow_mut().insert(key, SendGraph(graph));
        Ok(())
    }

    fn replay(&self, key: usize) -> Result<bool, DeviceError> {
        match self.graphs.borrow().get(&key) {
            Some(g) => {
                g.0.launch().map_err(drv)?;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    fn drop_captures(&self) {
        self.graphs.borrow_mut().clear();
    }
}
