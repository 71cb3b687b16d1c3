//! The GPU backend: CUDA kernels (the top-level `kernels/*.cu`, compiled by NVRTC at
//! start-up) behind the same [`crate::backend::ModelRunner`] trait as the CPU backend.
//!
//! - [`twin`]: the CPU twin of every kernel (same arguments and layouts, plain Rust);
//! - [`device`]: the [`device::Device`] trait the forward pass is written against, and
//!   [`device::CpuDevice`] running it on the twins (always built: the kernel-vs-twin
//!   tests and the whole device forward pass run in `make test` on the CPU);
//! - [`runner`]: [`runner::DeviceRunner`], the llama forward pass over a device, with
//!   decode steps recorded as CUDA graphs per batch-size bucket;
//! - `gpu` (feature `cuda`): `CudaDevice`, the device on an NVIDIA GPU via cudarc with
//!   dynamic loading, so the crate builds and runs without CUDA installed.

pub mod device;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod runner;
pub mod sources;
pub mod twin;

/// The CUDA backend: the device forward pass on a GPU.
#[cfg(feature = "cuda")]
pub type CudaBackend = runner::DeviceRunner<gpu::CudaDevice>;
