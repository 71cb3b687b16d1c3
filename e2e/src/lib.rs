//! End-to-end test support for Slipway on a real Kubernetes control plane.
//!
//! The control plane (etcd, kube-apiserver, kube-controller-manager,
//! kube-scheduler, kubectl, kwok) is built from source by `e2e/cluster/build`
//! and started on 127.0.0.1 by `e2e/cluster/up`; GPU nodes are faked by KWOK,
//! and two real nodes (kubelet, containerd, runc, CNI) run the engine image.
//! This crate wraps those scripts in a fixture:
//!
//! - [`ClusterGuard`] brings the cluster up once per test run (or reuses a
//!   running one) and stops every process it started, by PID, when dropped —
//!   also when a test fails or panics.
//! - [`TestNamespace`] gives each test its own namespace, deleted afterwards.
//! - [`wait`] waits on conditions with a timeout and a readable error; tests
//!   never sleep to synchronise.
//! - [`rbac`] runs a client under the operator's own RBAC identity, and
//!   [`audit`] finds the requests the API server denied it.
//! - [`real_nodes`] finds the real nodes (kubelet + containerd), places pods on
//!   them, signals their containers, stops their kubelets, and gives pods the
//!   model through a claim.
//! - [`packaging`] renders the Helm chart and the kustomization (`manifests/`) and
//!   compares their objects.
//!
//! Invariant: nothing here listens on anything but 127.0.0.1 or inside the
//! network namespaces the harness creates, and nothing here silently skips — a
//! missing binary or a failed build is an error.

pub mod audit;
pub mod build;
mod cluster;
pub mod crd;
mod error;
pub mod manifests;
mod namespace;
pub mod packaging;
pub mod rbac;
pub mod real_nodes;
pub mod sockets;
pub mod wait;

pub use cluster::{Cluster, ClusterGuard};

/// Sets up a test binary's logs: text for people reading its output, colours only on
/// a terminal, `RUST_LOG` or else `info`. Keep the guard for the whole run.
///
/// # Panics
/// If a log subscriber is already installed.
#[must_use]
pub fn test_logs() -> slipway_telemetry::Telemetry {
    slipway_telemetry::Telemetry::init(
        "slipway-e2e",
        Some(slipway_telemetry::LogFormat::Text),
        "info",
        None,
    )
    .expect("setting up the test's logs")
}
pub use error::{Error, Result};
pub use namespace::TestNamespace;
