//! A pipeline group on real pods: `parallelism.pipeline: 2` on CPU is two pods, one
//! per real node; the worker finds its leader by the leader's stable DNS name under
//! the group's headless Service (answered by the nodes' cluster DNS); the leader is
//! Ready only once the worker joined and answers a chat request, while the worker
//! serves no API and is no endpoint; killing the worker's engine fails the group, and
//! the operator recreates both pods, which serve again.
//!
//! Placement: the two real nodes are two zones of one region. A multi-pod group is
//! held in one value of `colocationTopologyKey`; CPU ranks talk TCP over the pods'
//! network, so the region is their fabric here (CPU nodes carry no NVLink domain, and
//! one zone is one node). Each rank requests more than half of a node's CPU, as a GPU
//! rank takes its node's GPUs, so the scheduler must put the two ranks on two nodes.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use k8s_openapi::api::core::v1::{Event, Node, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::api::{ListParams, LogParams};
use kube::{Api, ResourceExt as _};
use serde_json::json;
use slipway_e2e::real_nodes::RealNode;

use crate::operator::{ISVC, Running};
use crate::support::{
    ENGINE_PORT, Env, FollowedLog, POD_READY, chat, engine_endpoints, http, node_of, pod_ip,
    pod_ready, real_sample, router_endpoints, strip_ansi,
};

/// The label both real nodes share (`e2e/cluster/real-nodes`: `region=e2e`).
const REGION: &str = "topology.kubernetes.io/region";
/// What the engine logs once every rank of its group is connected.
const FORMED: &str = "parallel group formed";

pub async fn a_pipeline_group_spans_two_nodes_and_is_recreated_whole(
    env: Arc<Env>,
) -> anyhow::Result<()> {
    let admin = env.cluster.client().await.context("admin client")?;
    let nodes = env.cluster.real_nodes(&admin).await?;
    let rank_cpu = more_than_half_a_node(&admin, &nodes).await?;
    let mut isvc = real_sample("")?;
    let spec = &mut isvc["spec"];
    spec["parallelism"] = json!({"pipeline": 2, "colocationTopologyKey": REGION});
    // One group: N_healthy = 1 and no fault-domain headroom (the group spans both zones).
    spec["capacity"]["faultDomain"]["fLoss"] = json!(0.0);
    spec["capacity"]["minReplicas"] = json!(1);
    spec["release"]["engine"]["resources"]["requests"]["cpu"] = json!(format!("{rank_cpu}m"));
    let mut running = Running::start_with(&env, isvc, 1).await?;
    let pods_api = running.ns.pods();
    let namespace = running.ns.name().to_owned();

    let (leader, worker) = group_of_two(&running, &nodes).await?;
    let (leader_name, worker_name) = (leader.name_any(), worker.name_any());

    // The worker reached the leader by its DNS name, and the leader turned Ready only
    // after the group formed (its readiness is "every rank joined, model loaded").
    let leader_dns = format!("{ISVC}-g0-r0.{ISVC}-g0.{namespace}.svc");
    let worker_lines = logs(&pods_api, &worker_name).await?;
    ensure!(
        worker_lines
            .iter()
            .any(|(_, l)| l.contains(FORMED) && l.contains(&leader_dns)),
        "{worker_name} never logged joining its group through {leader_dns}:\n{}",
        render(&worker_lines)
    );
    let leader_lines = logs(&pods_api, &leader_name).await?;
    let (formed_at, _) = leader_lines
        .iter()
        .find(|(_, l)| l.contains(FORMED))
        .with_context(|| {
            format!(
                "{leader_name} never logged its group forming:\n{}",
                render(&leader_lines)
            )
        })?;
    let ready_at = ready_since(&leader)?;
    // The condition's time has whole seconds: compare with the formation's second.
    ensure!(
        ready_at.as_second() >= formed_at.as_second(),
        "{leader_name} turned Ready at {ready_at}, before its group formed at {formed_at}"
    );

    // Only the leader serves: it is the release Service's one endpoint, it answers a
    // chat request, and the worker answers no API and is no endpoint of any Service.
    let endpoints = engine_endpoints(&admin, &namespace, ISVC).await?;
    let leader_ip = pod_ip(&leader)?;
    let worker_ip = pod_ip(&worker)?;
    ensure!(
        endpoints.len() == 1 && endpoints[0].pod == leader_name && endpoints[0].ready,
        "the release Service's endpoints are {endpoints:?}, not the ready leader {leader_name} alone"
    );
    let routers = router_endpoints(&admin, &namespace, ISVC).await?;
    ensure!(
        routers
            .iter()
            .all(|e| e.pod != worker_name && e.ip != worker_ip),
        "the worker {worker_name} is an endpoint of the client Service: {routers:?}"
    );
    let http = http()?;
    let served = running.ns.isvcs().get(ISVC).await?.data["spec"]["servedModelName"]
        .as_str()
        .unwrap_or(ISVC)
        .to_owned();
    let (model, text) = chat(&http, &leader_ip, &served).await?;
    ensure!(
        model == served,
        "the leader answered as {model:?}, not {served:?}"
    );
    let url = format!("http://{worker_ip}:{ENGINE_PORT}/v1/models");
    let status = http
        .get(&url)
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .with_context(|| format!("GET {url}"))?
        .status();
    ensure!(
        status == reqwest::StatusCode::NOT_FOUND,
        "the worker serves the API: GET {url} answered {status}"
    );
    tracing::info!(%leader_name, %worker_name, %text, "pipeline 2 answered across two nodes");

    // Kill the worker's engine: the group fails as one and comes back as one.
    let leader_log = FollowedLog::start(pods_api.clone(), &leader_name, "engine");
    let old_uids: BTreeSet<String> = [&leader, &worker].iter().filter_map(|p| p.uid()).collect();
    let worker_node = running
        .ns
        .node(&node_of(&worker).unwrap_or_default())?
        .clone();
    worker_node.signal_container(&engine_container_id(&worker)?, "SIGKILL")?;
    let killed_at = Instant::now();

    let deadline = killed_at + POD_READY * 2;
    let (new_leader, new_worker) = loop {
        if let (Some(l), Some(w)) = (
            pods_api.get_opt(&leader_name).await?,
            pods_api.get_opt(&worker_name).await?,
        ) && [&l, &w]
            .iter()
            .all(|p| p.uid().is_some_and(|u| !old_uids.contains(&u)) && pod_ready(p))
        {
            break (l, w);
        }
        running.operator.ensure_running()?;
        if Instant::now() >= deadline {
            bail!(
                "the group was not recreated whole and Ready within {:?} of killing {worker_name}'s engine \
                 (old uids {old_uids:?}); pods: {}\noperator log:\n{}",
                POD_READY * 2,
                summary(&pods_api).await,
                running.operator.tail()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };

    // The old leader's engine ended: the group's failure reached it (the worker's rank
    // named), or the operator's recreation deleted it first (SIGTERM).
    let old_leader_lines = leader_log.finish(Duration::from_secs(60)).await?;
    let ended_by = old_leader_lines
        .iter()
        .find(|(_, l)| {
            (l.contains("parallel group failed") && l.contains("rank 1")) || l.contains("SIGTERM")
        })
        .map(|(_, l)| l.clone())
        .with_context(|| {
            format!(
                "the old {leader_name}'s engine ended without a group failure naming rank 1 or a SIGTERM:\n{}",
                render(&old_leader_lines)
            )
        })?;
    let events = Api::<Event>::namespaced(admin.clone(), &namespace)
        .list(&ListParams::default())
        .await?;
    let recreated = events
        .items
        .iter()
        .filter(|e| e.reason.as_deref() == Some("GroupRecreated"))
        .filter_map(|e| e.message.clone())
        .collect::<Vec<_>>();
    ensure!(
        recreated.len() == 1
            && recreated[0].contains("recreating group 0 (restart 1 of")
            && recreated[0].contains(&format!("{ISVC}-g0-r")),
        "want one GroupRecreated event for group 0 naming its failed pod, got {recreated:?}"
    );

    // The new group: again one pod per node, formed, serving.
    let (leader, worker) = group_of_two(&running, &nodes).await?;
    ensure!(
        leader.uid() == new_leader.uid() && worker.uid() == new_worker.uid(),
        "the group changed again after it was recreated: {}",
        summary(&pods_api).await
    );
    running.wait_ready(1, POD_READY).await?;
    let (model, text) = chat(&http, &pod_ip(&leader)?, &served).await?;
    ensure!(
        model == served,
        "the recreated leader answered as {model:?}, not {served:?}"
    );
    tracing::info!(
        after = ?killed_at.elapsed(),
        %ended_by,
        event = %recreated[0],
        %text,
        "\n{}",
        running.kubectl_get_wide(&env)
    );
    Ok(())
}

/// Millicores one rank requests: more than half of the smallest real node's
/// allocatable CPU, so two ranks never fit on one node.
async fn more_than_half_a_node(admin: &kube::Client, nodes: &[RealNode]) -> anyhow::Result<u64> {
    let api = Api::<Node>::all(admin.clone());
    let mut smallest = u64::MAX;
    for node in nodes {
        let object = api.get(node.name()).await?;
        let cpu = object
            .status
            .as_ref()
            .and_then(|s| s.allocatable.as_ref())
            .and_then(|a| a.get("cpu"))
            .map(|q| q.0.clone())
            .with_context(|| format!("{} reports no allocatable CPU", node.name()))?;
        let millis = millicores(&cpu)
            .with_context(|| format!("{}'s allocatable CPU {cpu:?}", node.name()))?;
        smallest = smallest.min(millis);
    }
    ensure!(smallest != u64::MAX, "no real nodes");
    Ok(smallest / 2 + 1)
}

/// A CPU quantity in millicores (`"2"`, `"1500m"`, `"1.5"`).
fn millicores(quantity: &str) -> Option<u64> {
    if let Some(m) = quantity.strip_suffix('m') {
        return m.parse().ok();
    }
    let cores: f64 = quantity.parse().ok()?;
    (cores.is_finite() && cores >= 0.0).then(|| (cores * 1000.0).round() as u64)
}

/// The group's leader and worker: Ready, on two different real nodes.
async fn group_of_two(running: &Running, nodes: &[RealNode]) -> anyhow::Result<(Pod, Pod)> {
    let mut pods = running.engine_pods().await?;
    pods.retain(|p| p.metadata.deletion_timestamp.is_none());
    pods.sort_by_key(|p| p.name_any());
    let names: Vec<String> = pods.iter().map(|p| p.name_any()).collect();
    ensure!(
        names == [format!("{ISVC}-g0-r0"), format!("{ISVC}-g0-r1")],
        "want group 0's leader and worker, have {names:?}"
    );
    let real: BTreeSet<&str> = nodes.iter().map(RealNode::name).collect();
    let placed: BTreeSet<String> = pods.iter().filter_map(node_of).collect();
    for pod in &pods {
        ensure!(
            node_of(pod).is_some_and(|n| real.contains(n.as_str())) && pod_ready(pod),
            "{} is not Ready on a real node: {}",
            pod.name_any(),
            summary(&running.ns.pods()).await
        );
    }
    ensure!(
        placed.len() == 2,
        "the two ranks share a node: {}",
        summary(&running.ns.pods()).await
    );
    let worker = pods.pop().context("no worker")?;
    let leader = pods.pop().context("no leader")?;
    Ok((leader, worker))
}

/// When the pod's Ready condition last turned True.
fn ready_since(pod: &Pod) -> anyhow::Result<Timestamp> {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready" && c.status == "True"))
        .and_then(|c| c.last_transition_time.as_ref())
        .map(|t| t.0)
        .with_context(|| format!("{} has no Ready=True condition time", pod.name_any()))
}

fn engine_container_id(pod: &Pod) -> anyhow::Result<String> {
    pod.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.name == "engine"))
        .and_then(|c| c.container_id.clone())
        .with_context(|| format!("{}'s engine container has no id", pod.name_any()))
}

/// A pod's engine log so far, with the runtime's timestamps.
async fn logs(pods: &Api<Pod>, name: &str) -> anyhow::Result<Vec<(Timestamp, String)>> {
    let params = LogParams {
        container: Some("engine".to_owned()),
        timestamps: true,
        ..LogParams::default()
    };
    let text = pods
        .logs(name, &params)
        .await
        .with_context(|| format!("reading {name}'s engine log"))?;
    Ok(text
        .lines()
        .filter_map(|line| {
            let (time, text) = line.split_once(' ')?;
            Some((time.parse().ok()?, strip_ansi(text)))
        })
        .collect())
}

fn render(lines: &[(Timestamp, String)]) -> String {
    let tail = &lines[lines.len().saturating_sub(40)..];
    tail.iter()
        .map(|(t, l)| format!("{t} {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every pod of the namespace: name, uid, node, phase, readiness, the engine's state,
/// and the last lines of its log, for failure messages.
async fn summary(pods: &Api<Pod>) -> String {
    let list = match pods.list(&ListParams::default()).await {
        Ok(list) => list.items,
        Err(error) => return format!("(listing pods failed: {error})"),
    };
    let mut out = String::new();
    for pod in list {
        let name = pod.name_any();
        let engine = pod
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .and_then(|cs| cs.iter().find(|c| c.name == "engine"))
            .and_then(|c| c.state.as_ref())
            .map(|s| serde_json::to_string(s).unwrap_or_default());
        out.push_str(&format!(
            "\n- {name} uid {:?} on {:?} phase {:?} ready {}{} engine {engine:?}",
            pod.uid(),
            node_of(&pod),
            pod.status.as_ref().and_then(|s| s.phase.clone()),
            pod_ready(&pod),
            if pod.metadata.deletion_timestamp.is_some() {
                " (terminating)"
            } else {
                ""
            },
        ));
        if name.contains("-g0-")
            && let Ok(lines) = logs(pods, &name).await
        {
            let tail = &lines[lines.len().saturating_sub(8)..];
            for (t, l) in tail {
                out.push_str(&format!("\n    {t} {l}"));
            }
        }
    }
    out
}
