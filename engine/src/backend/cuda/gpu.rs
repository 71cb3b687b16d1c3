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
use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaGraph, CudaSlice, CudaStream, LaunchArgs, LaunchConfig,
    PushKernelArg, sys,
};
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};

use super::sources::{KERNEL_FILES, MATVEC_MAX_TOKENS, nvrtc_options, program};
use crate::backend::device::twin::{KvParams, MatShape, QuantFormat, SampleParams};
use crate::backend::device::{Checked, Device, DeviceError, Elem, RopeParams};

fn drv(e: impl std::fmt::Display) -> DeviceError {
    DeviceError::Driver(e.to_string())
}

/// An `int` kernel argument (the `Device` checks made sure it fits; this converts).
fn int(x: usize, what: &str) -> Result<i32, DeviceError> {
    i32::try_from(x).map_err(|_| DeviceError::Shape(format!("{what} = {x} exceeds i32")))
}

/// A launch's grid: `(ceil(x.0 / x.1), y)` blocks of `threads` threads.
#[derive(Clone, Copy, Debug)]
struct Grid {
    /// Items along x and items per block.
    x: (usize, usize),
    /// Blocks along y.
    y: usize,
    /// Threads per block.
    threads: u32,
}

impl Grid {
    /// One block of `threads` per item.
    fn per_item(n: usize, threads: u32) -> Self {
        Self {
            x: (n, 1),
            y: 1,
            threads,
        }
    }

    fn config(self) -> Result<LaunchConfig, DeviceError> {
        let dim = |v: usize| {
            u32::try_from(v).map_err(|_| DeviceError::Shape(format!("grid of {self:?}")))
        };
        Ok(LaunchConfig {
            grid_dim: (dim(self.x.0.div_ceil(self.x.1))?, dim(self.y)?, 1),
            block_dim: (self.threads, 1, 1),
            shared_mem_bytes: 0,
        })
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

    /// Launches kernel `name` on `grid` with the arguments `args` pushes, in the
    /// order of the kernel's signature.
    ///
    /// # Safety
    /// `args` pushes exactly the kernel's parameters, with matching types, and every
    /// buffer holds what the kernel reads and writes for this grid.
    unsafe fn launch<'a>(
        &'a self,
        name: &str,
        grid: Grid,
        args: impl FnOnce(&mut LaunchArgs<'a>),
    ) -> Result<(), DeviceError> {
        let f: &'a CudaFunction = self
            .funcs
            .get(name)
            .ok_or_else(|| DeviceError::Driver(format!("kernel {name} not loaded")))?;
        let config = grid.config()?;
        let mut b = self.stream.launch_builder(f);
        args(&mut b);
        // SAFETY: the caller's contract (see `# Safety`).
        unsafe { b.launch(config) }
            .map(|_| ())
            .map_err(|e| DeviceError::Driver(format!("launching {name}: {e}")))
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

    fn len<T: Elem>(&self, buf: &CudaSlice<T>) -> usize {
        buf.len()
    }

    fn free_memory(&self) -> Result<Option<usize>, DeviceError> {
        let (free, _total) = self.ctx.mem_get_info().map_err(drv)?;
        Ok(Some(free))
    }

    fn write_unchecked<T: Elem>(
        &self,
        dst: &mut CudaSlice<T>,
        src: &[T],
        _: Checked,
    ) -> Result<(), DeviceError> {
        let mut view = dst.slice_mut(0..src.len());
        self.stream.memcpy_htod(src, &mut view).map_err(drv)
    }

    fn read_unchecked<T: Elem>(
        &self,
        src: &CudaSlice<T>,
        range: Range<usize>,
        _: Checked,
    ) -> Result<Vec<T>, DeviceError> {
        self.stream.clone_dtoh(&src.slice(range)).map_err(drv)
    }

    fn launch_embed(
        &self,
        fmt: QuantFormat,
        table: &CudaSlice<u8>,
        tokens: &CudaSlice<u32>,
        out: &mut CudaSlice<f32>,
        n: usize,
        dim: usize,
        _: Checked,
    ) -> Result<(), DeviceError> {
        // The table holds every token's row: the runner validated the tokens.
        let name = format!("embed_{}", fmt.suffix());
        let (ni, di) = (int(n, "n")?, int(dim, "dim")?);
        // SAFETY: the arguments follow embed.cu's signature; `Device::embed`
        // checked every buffer against this grid (the `Checked` argument).
        unsafe {
            self.launch(&name, Grid::per_item(n, 256), |b| {
                b.arg(table).arg(tokens).arg(out).arg(&ni).arg(&di);
            })
        }
    }

    fn launch_rms_norm(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        rows: &CudaSlice<u32>,
        out: &mut CudaSlice<f32>,
        n: usize,
        dim: usize,
        eps: f32,
        _: Checked,
    ) -> Result<(), DeviceError> {
        let di = int(dim, "dim")?;
        // SAFETY: the arguments follow rmsnorm.cu (rms_norm)'s signature; `Device::rms_norm`
        // checked every buffer against this grid (the `Checked` argument).
        unsafe {
            self.launch("rms_norm", Grid::per_item(n, 256), |b| {
                b.arg(x).arg(w).arg(rows).arg(out).arg(&di).arg(&eps);
            })
        }
    }

    fn launch_add_rms_norm(
        &self,
        x: &mut CudaSlice<f32>,
        y: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        n: usize,
        dim: usize,
        eps: f32,
        _: Checked,
    ) -> Result<(), DeviceError> {
        let di = int(dim, "dim")?;
        // SAFETY: the arguments follow rmsnorm.cu (add_rms_norm)'s signature; `Device::add_rms_norm`
        // checked every buffer against this grid (the `Checked` argument).
        unsafe {
            self.launch("add_rms_norm", Grid::per_item(n, 256), |b| {
                b.arg(x).arg(y).arg(w).arg(out).arg(&di).arg(&eps);
            })
        }
    }

    fn launch_add(
        &self,
        x: &mut CudaSlice<f32>,
        y: &CudaSlice<f32>,
        len: usize,
        _: Checked,
    ) -> Result<(), DeviceError> {
        let li = int(len, "len")?;
        let grid = Grid {
            x: (len, 256),
            y: 1,
            threads: 256,
        };
        // SAFETY: the arguments follow silu_mul.cu (add)'s signature; `Device::add`
        // checked every buffer against this grid (the `Checked` argument).
        unsafe {
            self.launch("add", grid, |b| {
                b.arg(x).arg(y).arg(&li);
            })
        }
    }

    fn launch_matmul(
        &self,
        fmt: QuantFormat,
        w: &CudaSlice<u8>,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
        s: MatShape,
        _: Checked,
    ) -> Result<(), DeviceError> {
        let decode = s.n <= MATVEC_MAX_TOKENS;
        let (kind, rows_per_block, tokens_per_block) = if decode {
            ("matvec", 8, 8)
        } else {
            ("matmul", 64, 32)
        };
        let name = format!("{kind}_{}", fmt.suffix());
        let grid = Grid {
            x: (s.rows, rows_per_block),
            y: s.n.div_ceil(tokens_per_block),
            threads: 256,
        };
        let a = [
            int(s.rows, "rows")?,
            int(s.cols, "cols")?,
            int(s.n, "n")?,
            int(s.ldy, "ldy")?,
            int(s.yoff, "yoff")?,
        ];
        // SAFETY: the arguments follow matmul.cu's signature; `Device::matmul`
        // checked every buffer against this grid (the `Checked` argument).
        unsafe {
            self.launch(&name, grid, |b| {
                b.arg(w).arg(x).arg(y);
                for v in &a {
                    b.arg(v);
                }
            })
        }
    }

    fn launch_silu_mul(
        &self,
        gate_up: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        ffn: usize,
        n: usize,
        _: Checked,
    ) -> Result<(), DeviceError> {
        let (fi, ni) = (int(ffn, "ffn")?, int(n, "n")?);
        let grid = Grid {
            x: (n * ffn, 256),
            y: 1,
            threads: 256,
        };
        // SAFETY: the arguments follow silu_mul.cu (silu_mul)'s signature; `Device::silu_mul`
        // checked every buffer against this grid (the `Checked` argument).
        unsafe {
            self.launch("silu_mul", grid, |b| {
                b.arg(gate_up).arg(out).arg(&fi).arg(&ni);
            })
        }
    }

    fn launch_rope_store_kv(
        &self,
        qkv: &mut CudaSlice<f32>,
        pos: &CudaSlice<u32>,
        slots: &CudaSlice<u32>,
        k_cache: &mut CudaSlice<u16>,
        v_cache: &mut CudaSlice<u16>,
        kv: &KvParams,
        rope: RopeParams,
        n: usize,
        _: Checked,
    ) -> Result<(), DeviceError> {
        // Slots were validated against the pool by the runner.
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
        // SAFETY: the arguments follow rope_kv.cu's signature; `Device::rope_store_kv`
        // checked every buffer against this grid (the `Checked` argument).
        unsafe {
            self.launch("rope_store_kv", Grid::per_item(n, 256), |b| {
                b.arg(qkv).arg(pos).arg(slots).arg(k_cache).arg(v_cache);
                for v in &a {
                    b.arg(v);
                }
                b.arg(&rope.theta_scale).arg(&ni);
            })
        }
    }

    fn launch_paged_attention(
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
        _: Checked,
    ) -> Result<(), DeviceError> {
        // Block tables cover every position: validated by the runner.
        let a = [
            int(kv.layer, "layer")?,
            int(kv.num_blocks, "num_blocks")?,
            int(kv.block_size, "block_size")?,
            int(kv.n_heads, "n_heads")?,
            int(kv.n_kv_heads, "n_kv_heads")?,
            int(kv.head_dim, "head_dim")?,
        ];
        let ni = int(n, "n")?;
        let grid = Grid {
            x: (n, 1),
            y: kv.n_heads,
            threads: 32,
        };
        // SAFETY: the arguments follow attention.cu's signature; `Device::paged_attention`
        // checked every buffer against this grid (the `Checked` argument).
        unsafe {
            self.launch("paged_attention", grid, |b| {
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
            })
        }
    }

    fn launch_argmax_rows(
        &self,
        logits: &CudaSlice<f32>,
        rows: usize,
        vocab: usize,
        out: &mut CudaSlice<u32>,
        _: Checked,
    ) -> Result<(), DeviceError> {
        let vi = int(vocab, "vocab")?;
        // SAFETY: the arguments follow sample.cu (argmax_rows)'s signature; `Device::argmax_rows`
        // checked every buffer against this grid (the `Checked` argument).
        unsafe {
            self.launch("argmax_rows", Grid::per_item(rows, 1024), |b| {
                b.arg(logits).arg(&vi).arg(out);
            })
        }
    }

    fn launch_sample_top_k_top_p(
        &self,
        logits: &CudaSlice<f32>,
        scratch: &mut CudaSlice<f32>,
        rows: Range<usize>,
        vocab: usize,
        p: SampleParams,
        uniforms: &CudaSlice<f32>,
        out: &mut CudaSlice<u32>,
        _: Checked,
    ) -> Result<(), DeviceError> {
        // The parameters are in the kernel's range: checked with the sizes.
        let (vi, ki) = (int(vocab, "vocab")?, int(p.top_k, "top_k")?);
        // The kernel samples from its arguments' row 0: views start at `rows.start`.
        let logits = logits.slice(rows.start * vocab..);
        let mut scratch = scratch.slice_mut(rows.start * vocab..);
        let uniforms = uniforms.slice(rows.start..);
        let mut out = out.slice_mut(rows.start..);
        // SAFETY: the arguments follow sample.cu (sample_top_k_top_p)'s signature; `Device::sample_top_k_top_p`
        // checked every buffer against this grid (the `Checked` argument).
        unsafe {
            self.launch(
                "sample_top_k_top_p",
                Grid::per_item(rows.len(), 1024),
                |b| {
                    b.arg(&logits)
                        .arg(&mut scratch)
                        .arg(&vi)
                        .arg(&ki)
                        .arg(&p.top_p)
                        .arg(&p.temperature)
                        .arg(&uniforms)
                        .arg(&mut out);
                },
            )
        }
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
