//! The backend's own run-time compile path (cudarc's NVRTC, dynamically loaded) turns
//! every kernel file into PTX for sm_90 that defines every entry point the backend
//! loads. Needs NVRTC on the library path and no GPU: `make check-kernels` runs it
//! with the PyPI wheel's libnvrtc; without NVRTC it fails, saying so.
#![cfg(feature = "cuda")]

use slipway_engine::backend::cuda::gpu::compile_all;
use slipway_engine::backend::cuda::sources::KERNEL_FILES;

#[test]
fn every_kernel_compiles_for_sm_90_with_its_entry_points() {
    let ptx = compile_all(9, 0).unwrap_or_else(|e| {
        panic!("{e} (make check-kernels puts the PyPI wheel's NVRTC on LD_LIBRARY_PATH)")
    });
    assert_eq!(ptx.len(), KERNEL_FILES.len());
    for ((file, p), (_, _, entries)) in ptx.iter().zip(KERNEL_FILES) {
        let text = p.to_src();
        assert!(
            text.contains(".target sm_90"),
            "{file}: {}",
            &text[..200.min(text.len())]
        );
        for e in *entries {
            assert!(
                text.contains(&format!(".entry {e}(")),
                "{file}: no entry point {e} in its PTX"
            );
        }
    }
}
