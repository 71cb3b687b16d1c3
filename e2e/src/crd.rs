//! Installing Slipway's CRDs (`manifests/crds/`) into the cluster, once per run.

use std::sync::OnceLock;
use std::time::Duration;

use crate::cluster::{Cluster, KUBECTL_TIMEOUT};
use crate::error::{Error, Result};
use crate::manifests;

/// The InferenceService API.
pub const GROUP: &str = "slipway.dev";
/// The served version the tests use.
pub const VERSION: &str = "v1alpha1";
/// The kind.
pub const KIND: &str = "InferenceService";
/// The CRD's name (`<plural>.<group>`).
pub const CRD_NAME: &str = "inferenceservices.slipway.dev";

/// How long a CRD may take to become Established after it is applied.
const ESTABLISHED_TIMEOUT: Duration = Duration::from_secs(60);

/// Server-side apply every CRD in `manifests/crds/` and wait until each is
/// Established. Runs once per process; concurrent callers wait for the first.
///
/// # Errors
/// When kubectl rejects a CRD or one is not Established in time; every caller
/// sees the same error.
pub fn ensure_installed(cluster: &Cluster) -> Result<()> {
    static INSTALLED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    INSTALLED
        .get_or_init(|| install(cluster).map_err(|error| error.to_string()))
        .clone()
        .map_err(|reason| Error::Setup {
            what: "installing manifests/crds/".to_owned(),
            reason,
        })
}

fn install(cluster: &Cluster) -> Result<()> {
    let dir = manifests::crds_dir();
    let dir = dir.to_string_lossy();
    // --force-conflicts: the checked-in CRD is what the tests are about, even on a
    // reused cluster where someone applied another version by hand.
    cluster.kubectl(
        &[
            "apply",
            "--server-side",
            "--force-conflicts",
            "--field-manager",
            crate::rbac::FIELD_MANAGER,
            "-f",
            &dir,
        ],
        KUBECTL_TIMEOUT,
    )?;
    cluster.wait_established(&["-f", &dir], ESTABLISHED_TIMEOUT)
}
