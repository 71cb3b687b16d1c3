//! Building the workspace's binaries for tests that run them as processes.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use serde_json::Value;

use crate::error::{Error, Result};
use crate::manifests::repo_root;

/// Removes from `command`'s environment the variables cargo set for this test
/// process about the package under test (`CARGO_PKG_NAME`, `CARGO_MANIFEST_DIR`, ...;
/// [`is_package_var`]), so a cargo the command starts, directly or through a script,
/// builds as one started from a shell does. ring's build script declares
/// `rerun-if-env-changed` on some of them: a build started from a test found them
/// changed against one started from make and rebuilt ring and every crate above it
/// (rustls, reqwest, the slipway crates), in both profiles, and the next make build
/// rebuilt them back (minutes of a cold `make test`). `CARGO` stays: it picks the
/// toolchain that built the tests.
pub fn without_package_env(command: &mut Command) -> &mut Command {
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(is_package_var) {
            command.env_remove(name);
        }
    }
    command
}

/// Whether cargo sets variable `name` for a test or build script of one package
/// (from cargo's list of the environment it gives crates).
fn is_package_var(name: &str) -> bool {
    name.starts_with("CARGO_PKG_")
        || name.starts_with("CARGO_MANIFEST_")
        || matches!(
            name,
            "CARGO_CRATE_NAME"
                | "CARGO_BIN_NAME"
                | "CARGO_PRIMARY_PACKAGE"
                | "CARGO_TARGET_TMPDIR"
                | "OUT_DIR"
        )
}

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
    let output = without_package_env(&mut Command::new(&cargo))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn package_variables_are_removed_and_the_toolchain_and_target_kept() {
        for name in [
            "CARGO_PKG_NAME",
            "CARGO_PKG_VERSION_MAJOR",
            "CARGO_MANIFEST_DIR",
            "CARGO_MANIFEST_LINKS",
            "CARGO_CRATE_NAME",
            "CARGO_TARGET_TMPDIR",
            "OUT_DIR",
        ] {
            assert!(is_package_var(name), "{name}");
        }
        for name in [
            "CARGO",
            "CARGO_TARGET_DIR",
            "CARGO_HOME",
            "RUSTFLAGS",
            "PATH",
        ] {
            assert!(!is_package_var(name), "{name}");
        }
    }

    #[test]
    fn a_command_does_not_inherit_the_test_package_s_variables() {
        // cargo sets these for this test process; a command that builds must not see them.
        assert!(std::env::var_os("CARGO_PKG_NAME").is_some());
        let mut command = Command::new("env");
        let output = without_package_env(&mut command)
            .output()
            .expect("env runs");
        let seen = String::from_utf8_lossy(&output.stdout);
        assert!(!seen.lines().any(|l| l.starts_with("CARGO_PKG_")), "{seen}");
        assert!(!seen.lines().any(|l| l.starts_with("CARGO_MANIFEST_DIR=")));
        assert!(seen.lines().any(|l| l.starts_with("PATH=")));
    }
}
