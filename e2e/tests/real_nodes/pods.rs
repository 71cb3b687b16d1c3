//! A pod written by hand (not by the operator) proves the node infrastructure on its
//! own: on each real node, the engine image starts under the restricted Pod Security
//! Standard with the model from the claim, the kubelet's readiness probe on `/ready`
//! makes it Ready (the kubelet's own probe metrics say so), it answers a chat request
//! on its pod IP, and deleting it runs the preStop hook, then SIGTERM, and the engine
//! drains and exits 0 within its grace period.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, ensure};
use futures::future::try_join_all;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, PostParams};
use serde_json::json;
use slipway_e2e::real_nodes::{self, RealNode};
use slipway_e2e::wait;

use crate::support::{
    ENGINE_PORT, Env, FollowedLog, POD_READY, RealNs, chat, engine_image, http, kubelet_lines,
    model_file, node_of, pod_ip, pod_ready, real_namespace,
};

const SERVED_NAME: &str = "smollm2-by-hand";
const PRE_STOP_SECONDS: i64 = 2;
const GRACE_SECONDS: i64 = 30;

/// An engine pod serving the claim's model on `node`, written as a user would; also the
/// server the DNS test resolves (`dns.rs`).
pub fn hand_written_pod(node: &RealNode) -> anyhow::Result<Pod> {
    let placement = real_nodes::placement();
    let model = format!("/models/{}", model_file()?);
    let pod = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": { "name": format!("engine-{}", node.name()), "labels": { "app": "hand-written-engine" } },
        "spec": {
            "nodeSelector": { "kubernetes.io/hostname": node.name() },
            "tolerations": placement["tolerations"],
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": GRACE_SECONDS,
            "automountServiceAccountToken": false,
            "enableServiceLinks": false,
            "securityContext": {
                "runAsNonRoot": true,
                "runAsUser": 65532,
                "runAsGroup": 65532,
                "seccompProfile": { "type": "RuntimeDefault" },
            },
            "containers": [{
                "name": "engine",
                "image": engine_image()?,
                "imagePullPolicy": "IfNotPresent",
                "args": [
                    "serve", "--model", model, "--host", "0.0.0.0",
                    "--port", ENGINE_PORT.to_string(), "--served-model-name", SERVED_NAME,
                    "--kv-blocks", "128",
                ],
                // The engine logs its drain (SIGTERM, exit) at info; its default is warn.
                "env": [{ "name": "RUST_LOG", "value": "info" }],
                "ports": [{ "name": "http", "containerPort": ENGINE_PORT }],
                "readinessProbe": { "httpGet": { "path": "/ready", "port": "http" }, "periodSeconds": 1, "failureThreshold": 1 },
                "lifecycle": { "preStop": { "sleep": { "seconds": PRE_STOP_SECONDS } } },
                "resources": { "requests": { "cpu": "100m", "memory": "256Mi" }, "limits": { "memory": "1Gi" } },
                "securityContext": {
                    "allowPrivilegeEscalation": false,
                    "readOnlyRootFilesystem": true,
                    "runAsNonRoot": true,
                    "capabilities": { "drop": ["ALL"] },
                },
                "volumeMounts": [
                    { "name": "models", "mountPath": "/models", "readOnly": true },
                    { "name": "tmp", "mountPath": "/tmp" },
                ],
            }],
            "volumes": [
                { "name": "models", "persistentVolumeClaim": { "claimName": real_nodes::MODEL_CLAIM, "readOnly": true } },
                { "name": "tmp", "emptyDir": {} },
            ],
        },
    });
    Ok(serde_json::from_value(pod)?)
}

pub async fn a_hand_written_engine_pod_is_probed_ready_and_drains_on_each_real_node(
    env: Arc<Env>,
) -> anyhow::Result<()> {
    let ns = real_namespace(&env).await?;
    // Both nodes at once: each pod loads the model in its own time.
    try_join_all(ns.nodes.iter().map(|node| one_node(&env, &ns, node))).await?;
    Ok(())
}

async fn one_node(env: &Env, ns: &RealNs, node: &RealNode) -> anyhow::Result<()> {
    let pods = ns.pods();
    let pod = hand_written_pod(node)?;
    let name = pod.metadata.name.clone().unwrap_or_default();
    pods.create(&PostParams::default(), &pod)
        .await
        .with_context(|| format!("creating {name} (restricted namespace)"))?;
    let ready = wait::for_object(
        &pods,
        &name,
        &format!("{name} Ready on {}", node.name()),
        POD_READY,
        |p: Option<&Pod>| p.is_some_and(pod_ready),
    )
    .await?;
    ensure!(
        node_of(&ready).as_deref() == Some(node.name()),
        "{name} runs on {:?}, not {}",
        node_of(&ready),
        node.name()
    );
    let ip = pod_ip(&ready)?;

    // The kubelet's own prober counted successful readiness probes of this pod.
    let probes = env.cluster.kubectl(
        &[
            "get",
            "--raw",
            &format!("/api/v1/nodes/{}/proxy/metrics/probes", node.name()),
        ],
        Duration::from_secs(30),
    )?;
    let probed = probes.lines().any(|l| {
        l.starts_with("prober_probe_total")
            && l.contains("probe_type=\"Readiness\"")
            && l.contains("result=\"successful\"")
            && l.contains(&format!("pod=\"{name}\""))
    });
    ensure!(
        probed,
        "{}'s kubelet reports no successful readiness probe of {name}:\n{probes}",
        node.name()
    );

    let http = http()?;
    let (model, text) = chat(&http, &ip, SERVED_NAME).await?;
    ensure!(
        model == SERVED_NAME,
        "{name} answered as model {model:?}, not {SERVED_NAME}"
    );
    tracing::info!(pod = %name, node = node.name(), %ip, answer = %text, "hand-written pod answered");

    // Delete: preStop (sleep), then SIGTERM; the engine drains and exits 0.
    let log = FollowedLog::start(pods.clone(), &name, "engine");
    let deleted_at = k8s_openapi::jiff::Timestamp::now();
    pods.delete(&name, &DeleteParams::default()).await?;
    let lines = log
        .finish(Duration::from_secs(GRACE_SECONDS as u64 + 30))
        .await?;
    let sigterm = lines
        .iter()
        .find(|(_, l)| l.contains("SIGTERM"))
        .map(|(t, _)| *t)
        .with_context(|| format!("{name}'s engine never logged SIGTERM:\n{lines:#?}"))?;
    let exited = lines
        .iter()
        .find(|(_, l)| l.contains("drained; exiting"))
        .map(|(t, _)| *t)
        .with_context(|| format!("{name}'s engine never logged its exit:\n{lines:#?}"))?;
    let pod_key = format!("pod=\"{}/{name}\"", ns.name());
    let pre_stop = kubelet_lines(node, &["Running preStop hook", &pod_key])?;
    let (pre_stop_at, _) = pre_stop.last().with_context(|| {
        format!(
            "{}'s kubelet log has no preStop hook for {pod_key}",
            node.name()
        )
    })?;
    ensure!(
        pre_stop_at.duration_since(deleted_at).as_secs_f64() > -1.0,
        "the preStop hook of {pod_key} ({pre_stop_at}) ran before it was deleted ({deleted_at})"
    );
    let pre_stop_seconds = sigterm.duration_since(*pre_stop_at).as_secs_f64();
    ensure!(
        pre_stop_seconds >= PRE_STOP_SECONDS as f64 - 0.2,
        "SIGTERM came {pre_stop_seconds:.2} s after the preStop hook started; the hook sleeps {PRE_STOP_SECONDS} s"
    );
    let total = exited.duration_since(deleted_at).as_secs_f64();
    ensure!(
        total < GRACE_SECONDS as f64,
        "{name} took {total:.1} s to exit, past its {GRACE_SECONDS} s grace period"
    );
    tracing::info!(
        pod = %name,
        pre_stop_started = %pre_stop_at,
        sigterm = %sigterm,
        exited = %exited,
        "drain timeline of the hand-written pod"
    );
    Ok(())
}
