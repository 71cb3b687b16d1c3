//! Writes the InferenceService CRD to `manifests/crds/inferenceservice.yaml` (or the
//! path given), or checks that the file there is up to date with `--check`.

use std::{path::PathBuf, process::ExitCode};

fn main() -> ExitCode {
    let mut check = false;
    let mut path = None;
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--check" => check = true,
            "-h" | "--help" => {
                println!(
                    "usage: crdgen [--check] [PATH]\n\nWrites the generated InferenceService CRD to PATH (default {}).\nWith --check, writes nothing and fails if PATH differs from the generated CRD.",
                    slipway_api::CRD_PATH
                );
                return ExitCode::SUCCESS;
            }
            other => path = Some(PathBuf::from(other)),
        }
    }
    let path = path.unwrap_or_else(|| PathBuf::from(slipway_api::CRD_PATH));
    let yaml = match slipway_api::crd_yaml() {
        Ok(yaml) => yaml,
        Err(error) => {
            eprintln!("crdgen: cannot serialize the CRD: {error}");
            return ExitCode::FAILURE;
        }
    };
    if check {
        let current = std::fs::read_to_string(&path).unwrap_or_default();
        if current != yaml {
            eprintln!("crdgen: {} is stale; run `make generate`", path.display());
            return ExitCode::FAILURE;
        }
        return ExitCode::SUCCESS;
    }
    if let Err(error) = std::fs::write(&path, yaml) {
        eprintln!("crdgen: cannot write {}: {error}", path.display());
        return ExitCode::FAILURE;
    }
    eprintln!("crdgen: wrote {}", path.display());
    ExitCode::SUCCESS
}
