//! Building the workspace's binaries for tests that run them as processes.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use serde_json::Value;

use crate::error::{Error, Result};
use crate::manifests::repo_root;

/// Builds `bin` of `package` as `cargo build` would for a user and returns its path.
///
/// Uses the cargo that built the calling test (same toolchain and target directory):
/// a bare `cargo` could resolve to another toolchain and rebuild everything.
///
/// # Errors
/// cargo cannot start, the build fails, or cargo reports no such executable.
pub fn cargo_build(package: &str, bin: &str) -> Result<PathBuf> {
    cargo_build_features(package, bin, &[])
}

/// [`cargo_build`] with cargo features of `package` turned on (a test build, such as
/// the engine's `fault-injection`).
///
/// # Errors
/// As [`cargo_build`].
pub fn cargo_build_features(package: &str, bin: &str, features: &[&str]) -> Result<PathBuf> {
    let cargo = std::env::var("CARGO")
        .ok()
        .or_else(|| option_env!("CARGO").map(str::to_owned))
        .unwrap_or_else(|| "cargo".to_owned());
    let features = features.join(",");
    let command = format!("{cargo} build -p {package} --bin {bin} --features={features}");
    let output = Command::new(&cargo)
        .current_dir(repo_root())
        .args([
            "build",
            "--quiet",
            "-p",
            package,
            "--bin",
            bin,
            &format!("--features={features}"),
            "--message-format=json",
        ])
        .stderr(Stdio::inherit())
        .output()
        .map_err(|source| Error::Spawn {
            command: command.clone(),
            source,
        })?;
    if !output.status.success() {
        return Err(Error::CommandFailed {
            command,
            status: output.status,
            stderr: "(printed above)".to_owned(),
        });
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    stdout
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|message| message["target"]["name"] == bin)
        .find_map(|message| message["executable"].as_str().map(PathBuf::from))
        .ok_or_else(|| Error::MissingOutput {
            command,
            key: "executable",
            stdout: stdout.into_owned(),
        })
}
