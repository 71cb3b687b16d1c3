//! The CUDA side of the device backend: the kernels (the top-level `kernels/*.cu`,
//! compiled by NVRTC at start-up) and the [`crate::backend::device::Device`] that
//! launches them. The device forward pass itself, the `Device` trait and its CPU twin
//! live in [`crate::backend::device`], always built.
//!
//! - [`sources`]: the kernel sources embedded in the binary and the NVRTC options
//!   (plain data: always built, so the source listing is checked without CUDA);
//! - `gpu` (feature `cuda`): `CudaDevice`, the device on an NVIDIA GPU via cudarc with
//!   dynamic loading, so the crate builds and runs without CUDA installed.

#[cfg(feature = "cuda")]
pub mod gpu;
pub mod sources;

/// The CUDA backend: the device forward pass on a GPU.
#[cfg(feature = "cuda")]
pub type CudaBackend = crate::backend::device::runner::DeviceRunner<gpu::CudaDevice>;
