//! The one error type of the e2e support library.

use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

/// Result of e2e support operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong while preparing or observing the cluster.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A helper program (a cluster script, kubectl) could not be started.
    #[error("could not start `{command}`: {source}")]
    Spawn {
        command: String,
        #[source]
        source: std::io::Error,
    },
    /// A helper program ran and failed.
    #[error("`{command}` failed ({status}):\n{stderr}")]
    CommandFailed {
        command: String,
        status: ExitStatus,
        stderr: String,
    },
    /// `e2e/cluster/up` finished without reporting one of its outputs.
    #[error("`{command}` did not print `{key}=...` on stdout; it printed:\n{stdout}")]
    MissingOutput {
        command: String,
        key: &'static str,
        stdout: String,
    },
    /// A file the tests need could not be read or written.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A manifest is not the YAML the tests expect.
    #[error("{path}: {reason}")]
    Manifest { path: PathBuf, reason: String },
    /// The kubeconfig written by `up` (or built for a token) is unusable.
    #[error("kubeconfig {path}: {source}")]
    Kubeconfig {
        path: PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    /// A request to the API server failed.
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// The watch behind a wait failed (not a timeout: the API refused or broke it).
    #[error("watching for {what}: {source}")]
    Watch {
        what: String,
        #[source]
        source: kube::runtime::watcher::Error,
    },
    /// A once-per-run setup step failed (reported to every test that needs it).
    #[error("{what} failed: {reason}")]
    Setup { what: String, reason: String },
    /// A bounded wait ran out; `last_seen` says what the cluster showed instead.
    #[error("timed out after {timeout:?} waiting for {what}; last seen: {last_seen}")]
    Timeout {
        what: String,
        timeout: Duration,
        last_seen: String,
    },
}
