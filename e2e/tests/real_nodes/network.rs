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
    // Pods reach the API server at the `kubernetes` Service's ClusterIP, which each node
    // binds on its own loopback device for its service-proxy (no kube-proxy here).
    let services: kube::Api<k8s_openapi::api::core::v1::Service> =
        kube::Api::namespaced(admin.clone(), "default");
    let kubernetes_ip: IpAddr = services
        .get("kubernetes")
        .await
        .context("reading the kubernetes Service")?
        .spec
        .and_then(|spec| spec.cluster_ip)
        .context("the kubernetes Service has no ClusterIP")?
        .parse()
        .context("the kubernetes Service's ClusterIP")?;
    // And the cluster DNS: the kube-dns Service's ClusterIP, which each node binds on its
    // loopback for its CoreDNS.
    let dns_ip: IpAddr =
        kube::Api::<k8s_openapi::api::core::v1::Service>::namespaced(admin.clone(), "kube-system")
            .get("kube-dns")
            .await
            .context("reading the kube-dns Service")?
            .spec
            .and_then(|spec| spec.cluster_ip)
            .context("the kube-dns Service has no ClusterIP")?
            .parse()
            .context("the kube-dns Service's ClusterIP")?;
    for node in env.cluster.real_nodes(&admin).await? {
        let processes = node.processes()?;
        let names: Vec<&str> = processes.iter().map(|(n, _)| n.as_str()).collect();
        for want in [
            "kubelet",
            "containerd",
            "apiserver-proxy",
            "service-proxy",
            "coredns",
        ] {
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
                    || matches!(ip, IpAddr::V4(v4) if v4.octets()[..2] == [10, 86])
                    || (name == "service-proxy" && ip == kubernetes_ip)
                    || (name == "coredns" && ip == dns_ip);
                ensure!(
                    allowed,
                    "{}'s {name} (pid {pid}) listens on {address}: only its loopback or node IP may be used \
                     (and the kubernetes Service's {kubernetes_ip}, by the service-proxy; kube-dns's {dns_ip}, by CoreDNS)",
                    node.name()
                );
            }
        }
    }
    Ok(())
}
