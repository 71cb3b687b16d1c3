//! The fake GPU fleet: KWOK nodes in three zones with NVLink-domain labels,
//! placed on by the real kube-scheduler and made Ready by KWOK.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{Context as _, ensure};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::{ListParams, PostParams};
use serde_json::json;
use slipway_e2e::wait;

use crate::support::TestContext;

const GPU: &str = "nvidia.com/gpu";
const ZONE: &str = "topology.kubernetes.io/zone";
const NVLINK_DOMAIN: &str = "slipway.dev/nvlink-domain";

/// A pod that only asks for GPUs; KWOK never runs its image.
fn gpu_pod(name: &str, gpus: u32) -> anyhow::Result<Pod> {
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": { "name": name },
        "spec": {
            "automountServiceAccountToken": false,
            "containers": [{
                "name": "engine",
                "image": "ghcr.io/slipway-dev/engine:e2e",
                "resources": {
                    "requests": { GPU: gpus.to_string() },
                    "limits": { GPU: gpus.to_string() },
                },
            }],
        },
    }))
    .context("pod manifest")
}

fn condition_is(pod: &Pod, kind: &str, status: &str) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|conditions| {
            conditions
                .iter()
                .any(|c| c.type_ == kind && c.status == status)
        })
}

pub async fn gpu_pod_is_scheduled_on_a_fake_gpu_node_and_becomes_ready(
    context: TestContext,
) -> anyhow::Result<()> {
    let admin = context.admin().await?;
    let namespace = context.namespace(&admin).await?;
    let pods = Api::<Pod>::namespaced(admin.clone(), namespace.name());
    pods.create(&PostParams::default(), &gpu_pod("four-gpus", 4)?)
        .await?;

    let ready = wait::for_object(
        &pods,
        "four-gpus",
        "the 4-GPU pod to be scheduled and Ready",
        wait::DEFAULT_TIMEOUT,
        |pod: Option<&Pod>| pod.is_some_and(|pod| condition_is(pod, "Ready", "True")),
    )
    .await?;
    let phase = ready.status.as_ref().and_then(|s| s.phase.as_deref());
    ensure!(phase == Some("Running"), "Ready pod is in phase {phase:?}");

    let node_name = ready
        .spec
        .as_ref()
        .and_then(|spec| spec.node_name.clone())
        .context("a Ready pod has no node")?;
    let node = Api::<Node>::all(admin).get(&node_name).await?;
    let gpus = node
        .status
        .as_ref()
        .and_then(|s| s.allocatable.as_ref())
        .and_then(|allocatable| allocatable.get(GPU))
        .map(|quantity| quantity.0.clone());
    ensure!(
        gpus.as_deref() == Some("8"),
        "pod landed on {node_name}, which has {gpus:?} GPUs allocatable"
    );
    Ok(())
}

pub async fn pod_needing_more_gpus_than_any_node_stays_pending(
    context: TestContext,
) -> anyhow::Result<()> {
    let admin = context.admin().await?;
    let namespace = context.namespace(&admin).await?;
    let pods = Api::<Pod>::namespaced(admin, namespace.name());
    pods.create(&PostParams::default(), &gpu_pod("nine-gpus", 9)?)
        .await?;

    // The scheduler records its verdict as PodScheduled=False/Unschedulable;
    // waiting for that condition (not for time to pass) proves it stays Pending.
    let unschedulable = wait::for_object(
        &pods,
        "nine-gpus",
        "the scheduler to report the 9-GPU pod Unschedulable",
        wait::DEFAULT_TIMEOUT,
        |pod: Option<&Pod>| {
            pod.and_then(|pod| pod.status.as_ref()?.conditions.as_ref())
                .is_some_and(|conditions| {
                    conditions.iter().any(|c| {
                        c.type_ == "PodScheduled"
                            && c.status == "False"
                            && c.reason.as_deref() == Some("Unschedulable")
                    })
                })
        },
    )
    .await?;
    let status = unschedulable
        .status
        .as_ref()
        .context("pod without status")?;
    ensure!(
        status.phase.as_deref() == Some("Pending"),
        "phase is {:?}",
        status.phase
    );
    let message = status
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "PodScheduled")
        .and_then(|c| c.message.clone())
        .unwrap_or_default();
    ensure!(
        message.contains("Insufficient nvidia.com/gpu"),
        "unschedulable for another reason: {message}"
    );
    ensure!(
        unschedulable
            .spec
            .as_ref()
            .and_then(|s| s.node_name.as_ref())
            .is_none(),
        "an unschedulable pod was bound to a node"
    );
    Ok(())
}

pub async fn fake_nodes_span_three_zones_with_nvlink_domains(
    context: TestContext,
) -> anyhow::Result<()> {
    let admin = context.admin().await?;
    let nodes = Api::<Node>::all(admin).list(&ListParams::default()).await?;
    let mut gpu_nodes_per_zone: BTreeMap<String, usize> = BTreeMap::new();
    let mut nvlink_domains = BTreeSet::new();
    let mut cpu_only = 0;
    for node in &nodes {
        let labels = node.metadata.labels.clone().unwrap_or_default();
        let ready = node
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|conditions| {
                conditions
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True")
            });
        let name = node.metadata.name.clone().unwrap_or_default();
        ensure!(ready, "node {name} is not Ready");
        let gpus = node
            .status
            .as_ref()
            .and_then(|s| s.capacity.as_ref())
            .and_then(|capacity| capacity.get(GPU));
        match gpus {
            Some(quantity) => {
                ensure!(quantity.0 == "8", "{name} has {} GPUs", quantity.0);
                let zone = labels
                    .get(ZONE)
                    .with_context(|| format!("{name} has no zone"))?;
                *gpu_nodes_per_zone.entry(zone.clone()).or_default() += 1;
                let domain = labels
                    .get(NVLINK_DOMAIN)
                    .with_context(|| format!("{name} has no NVLink domain"))?;
                nvlink_domains.insert(domain.clone());
            }
            None => cpu_only += 1,
        }
    }
    ensure!(
        gpu_nodes_per_zone.len() == 3 && gpu_nodes_per_zone.values().all(|&n| n >= 2),
        "GPU nodes per zone: {gpu_nodes_per_zone:?}"
    );
    ensure!(
        nvlink_domains.len() >= 3,
        "NVLink domains: {nvlink_domains:?}"
    );
    ensure!(cpu_only >= 1, "there is no node without GPUs");
    Ok(())
}
