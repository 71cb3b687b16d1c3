//! The kernel sources, compiled into the binary so a carried binary needs no source
//! tree, and the NVRTC options shared with `engine/scripts/nvrtc-compile.py` (which
//! check-kernels runs in CI): each file is compiled as `prelude.cuh` + the file.

/// Helpers every kernel file uses (f16 conversion, block formats, reductions).
pub const PRELUDE: &str = include_str!("../../../../kernels/prelude.cuh");

/// `(file name, source)` of every kernel file, and the entry points it defines.
pub const KERNEL_FILES: &[(&str, &str, &[&str])] = &[
    (
        "embed.cu",
        include_str!("../../../../kernels/embed.cu"),
        &["embed_q8_0", "embed_q4_1"],
    ),
    (
        "rmsnorm.cu",
        include_str!("../../../../kernels/rmsnorm.cu"),
        &["rms_norm", "add_rms_norm"],
    ),
    (
        "matmul.cu",
        include_str!("../../../../kernels/matmul.cu"),
        &["matvec_q4_1", "matvec_q8_0", "matmul_q4_1", "matmul_q8_0"],
    ),
    (
        "rope_kv.cu",
        include_str!("../../../../kernels/rope_kv.cu"),
        &["rope_store_kv"],
    ),
    (
        "attention.cu",
        include_str!("../../../../kernels/attention.cu"),
        &["paged_attention"],
    ),
    (
        "silu_mul.cu",
        include_str!("../../../../kernels/silu_mul.cu"),
        &["silu_mul", "add"],
    ),
    (
        "sample.cu",
        include_str!("../../../../kernels/sample.cu"),
        &["argmax_rows", "sample_top_k_top_p"],
    ),
];

/// Tokens up to which the decode kernel (`matvec_*`) runs instead of the tiled one.
pub const MATVEC_MAX_TOKENS: usize = 8;

/// The full text NVRTC compiles for one kernel file.
#[must_use]
pub fn program(source: &str) -> String {
    format!("{PRELUDE}\n{source}")
}

/// NVRTC options for a device of compute capability `major.minor` (keep in sync with
/// `engine/scripts/nvrtc-compile.py`).
#[must_use]
pub fn nvrtc_options(major: i32, minor: i32) -> Vec<String> {
    vec![
        format!("--gpu-architecture=compute_{major}{minor}"),
        "--std=c++17".into(),
        "-default-device".into(),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `.cu` file in the top-level `kernels/` is compiled by the backend, and
    /// every entry point a file lists is defined in it.
    #[test]
    fn every_kernel_file_is_listed_with_its_entry_points() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../kernels");
        let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
            .expect("kernels/ at the repository root")
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".cu"))
            .collect();
        on_disk.sort();
        let mut listed: Vec<String> = KERNEL_FILES.iter().map(|f| f.0.to_owned()).collect();
        listed.sort();
        assert_eq!(on_disk, listed);
        for (name, src, entries) in KERNEL_FILES {
            for e in *entries {
                assert!(
                    src.contains(&format!("extern \"C\" __global__ void {e}(")),
                    "{name} does not define {e}"
                );
            }
        }
    }
}
