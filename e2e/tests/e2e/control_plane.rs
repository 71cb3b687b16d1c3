//! The control plane itself, as the issue limits it: every component is
//! reachable on 127.0.0.1 only, and each is one we can stop by its PID.

use std::collections::BTreeSet;

use anyhow::{Context as _, ensure};

use crate::support::TestContext;

/// Nothing is reachable from outside the machine.
pub async fn every_component_listens_on_loopback_only(context: TestContext) -> anyhow::Result<()> {
    let components = context.cluster.component_pids()?;
    let names: BTreeSet<&str> = components.iter().map(|(name, _)| name.as_str()).collect();
    for expected in [
        "etcd",
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
        "kwok-controller",
    ] {
        ensure!(
            names.contains(expected),
            "no PID file for {expected}: {names:?}"
        );
    }
    for (component, pid) in &components {
        let addresses = slipway_e2e::sockets::listening_addresses(*pid)
            .with_context(|| format!("reading the sockets of {component} (pid {pid})"))?;
        ensure!(
            !addresses.is_empty(),
            "{component} (pid {pid}) listens on nothing"
        );
        let exposed: Vec<_> = addresses.iter().filter(|a| !a.ip().is_loopback()).collect();
        ensure!(
            exposed.is_empty(),
            "{component} listens beyond loopback: {exposed:?}"
        );
    }
    Ok(())
}
