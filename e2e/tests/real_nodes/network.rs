//! Every server of a real node listens on its own loopback or its node IP, inside the
//! network namespace the harness created for it, never in the host's namespace.

use std::net::IpAddr;
use std::sync::Arc;

use anyhow::{Context as _, ensure};
use slipway_e2e::sockets::listening_addresses;

use crate::support::Env;

fn netns(pid: u32) -> anyhow::Result<std::path::PathBuf> {
    std::fs::read_link(format!("/proc/{pid}/ns/net"))
        .with_context(|| format!("reading the network namespace of pid {pid}"))
}

pub async fn node_processes_listen_only_inside_their_namespace(
    env: Arc<Env>,
) -> anyhow::Result<()> {
    let admin = env.cluster.client().await?;
    let host = netns(std::process::id())?;
    for node in env.cluster.real_nodes(&admin).await? {
        let processes = node.processes()?;
        let names: Vec<&str> = processes.iter().map(|(n, _)| n.as_str()).collect();
        for want in ["kubelet", "containerd", "apiserver-proxy"] {
            ensure!(
                names.contains(&want),
                "{} runs no {want} (pid files: {names:?})",
                node.name()
            );
        }
        for (name, pid) in &processes {
            ensure!(
                netns(*pid)? != host,
                "{}'s {name} (pid {pid}) runs in the host's network namespace",
                node.name()
            );
            for address in listening_addresses(*pid)? {
                let ip = address.ip();
                let allowed = ip.is_loopback()
                    || matches!(ip, IpAddr::V4(v4) if v4.octets()[..2] == [10, 86]);
                ensure!(
                    allowed,
                    "{}'s {name} (pid {pid}) listens on {address}: only its loopback or node IP may be used",
                    node.name()
                );
            }
        }
    }
    Ok(())
}
