//! The cluster DNS of the real nodes (`e2e/cluster/real-nodes`: a CoreDNS in each
//! node). A pod on either node finds an engine pod by its `<hostname>.<subdomain>`
//! name under a headless Service (what a parallel group's worker does to find its
//! leader), short through the search path the kubelet wrote and fully qualified, and
//! fetches that engine's `/health`; a name outside the cluster resolves to nothing.
//! The client is the engine image's own `fetch` (reqwest over the image's libc
//! resolver), the image having no shell: each lookup is one container, the two that
//! must resolve as init containers, the one that must not as the main container.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use futures::future::try_join_all;
use k8s_openapi::api::core::v1::{ContainerStatus, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{ListParams, PostParams};
use kube::{Api, ResourceExt as _};
use serde_json::{Value, json};
use slipway_e2e::real_nodes::{self, RealNode};
use slipway_e2e::wait;

use crate::pods::hand_written_pod;
use crate::support::{
    ENGINE_PORT, Env, POD_READY, RealNs, engine_image, node_of, pod_ip, pod_ready, real_namespace,
};

const SERVICE: &str = "dns-probe";
const TARGET: &str = "target";
/// The sha256 of `ok`, the engine's `/health` body: `fetch` verifies what it got.
const HEALTH_SHA256: &str = "2689367b205c16ce32ed4200942b8b8b1e262dfc70d9bc9fbc77c49699a4f1df";
const OUTSIDE: &str = "example.com";

pub async fn a_pod_on_each_node_resolves_cluster_names_only(env: Arc<Env>) -> anyhow::Result<()> {
    let ns = real_namespace(&env).await?;
    let services: Api<Service> = Api::namespaced(ns.admin.clone(), ns.name());
    let service: Service = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": SERVICE},
        "spec": {
            "clusterIP": "None",
            "selector": {"app": "hand-written-engine"},
            "ports": [{"name": "http", "port": ENGINE_PORT}],
        },
    }))?;
    services.create(&PostParams::default(), &service).await?;
    let first = ns.nodes.first().context("no real node")?;
    let mut target = hand_written_pod(first)?;
    target.metadata.name = Some(TARGET.to_owned());
    let spec = target.spec.as_mut().context("the engine pod has no spec")?;
    spec.hostname = Some(TARGET.to_owned());
    spec.subdomain = Some(SERVICE.to_owned());
    let pods = ns.pods();
    pods.create(&PostParams::default(), &target).await?;
    let target = wait::for_object(
        &pods,
        TARGET,
        &format!("{TARGET} Ready on {}", first.name()),
        POD_READY,
        |p: Option<&Pod>| p.is_some_and(pod_ready),
    )
    .await?;
    let target_ip = pod_ip(&target)?;
    // The name exists once the EndpointSlice controller published the ready pod with
    // its hostname; CoreDNS answers from its watch of the slices.
    let slices: Api<EndpointSlice> = Api::namespaced(ns.admin.clone(), ns.name());
    let selector = format!("kubernetes.io/service-name={SERVICE}");
    let deadline = Instant::now() + POD_READY;
    loop {
        let listed = slices
            .list(&ListParams::default().labels(&selector))
            .await?;
        let published = listed
            .items
            .iter()
            .flat_map(|s| s.endpoints.iter().flatten())
            .any(|e| e.hostname.as_deref() == Some(TARGET) && e.addresses.contains(&target_ip));
        if published {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "{SERVICE}'s EndpointSlices never listed {TARGET} at {target_ip}: {:?}",
            listed.items
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    try_join_all(ns.nodes.iter().map(|node| resolve_from(&ns, node))).await?;
    Ok(())
}

/// `slipway-engine fetch` of `http://<host>:<engine port>/health`, once, into a file of
/// its own in /tmp (a verified file already there would be kept without a request).
fn fetch(name: &str, host: &str) -> anyhow::Result<Value> {
    Ok(json!({
        "name": name,
        "image": engine_image()?,
        "imagePullPolicy": "IfNotPresent",
        "args": [
            "fetch", format!("http://{host}:{ENGINE_PORT}/health"),
            "--sha256", HEALTH_SHA256, "--dest", format!("/tmp/{name}"),
            "--retries", "0", "--timeout-ms", "30000",
        ],
        // The last line of the log (`Error: <why>`) becomes the termination message.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}},
        "securityContext": {
            "allowPrivilegeEscalation": false,
            "readOnlyRootFilesystem": true,
            "runAsNonRoot": true,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }))
}

/// A pod on `node` whose init containers fetch the target by its short and its full
/// name (each must succeed for the next to run) and whose container then tries a name
/// outside the cluster (which must fail to resolve).
async fn resolve_from(ns: &RealNs, node: &RealNode) -> anyhow::Result<()> {
    let name = format!("resolver-{}", node.name());
    let short = format!("{TARGET}.{SERVICE}");
    let full = format!("{TARGET}.{SERVICE}.{}.svc.cluster.local", ns.name());
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node.name()},
            "tolerations": real_nodes::placement()["tolerations"],
            "restartPolicy": "Never",
            "automountServiceAccountToken": false,
            "enableServiceLinks": false,
            "securityContext": {
                "runAsNonRoot": true,
                "runAsUser": 65532,
                "runAsGroup": 65532,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "initContainers": [fetch("short", &short)?, fetch("full", &full)?],
            "containers": [fetch("outside", OUTSIDE)?],
            "volumes": [{"name": "tmp", "emptyDir": {}}],
        },
    }))?;
    let pods = ns.pods();
    pods.create(&PostParams::default(), &pod).await?;
    let done = wait::for_object(
        &pods,
        &name,
        &format!("{name} finished"),
        POD_READY,
        |p: Option<&Pod>| {
            p.and_then(|p| p.status.as_ref())
                .and_then(|s| s.phase.as_deref())
                .is_some_and(|phase| phase == "Succeeded" || phase == "Failed")
        },
    )
    .await?;
    let status = done.status.clone().unwrap_or_default();
    let shown = serde_yaml::to_string(&status).unwrap_or_default();
    ensure!(
        node_of(&done).as_deref() == Some(node.name()),
        "{name} ran on {:?}, not {}",
        node_of(&done),
        node.name()
    );
    for (container, host) in [("short", &short), ("full", &full)] {
        let exit = terminated(status.init_container_statuses.as_deref(), container);
        ensure!(
            exit.as_ref().is_some_and(|(code, _)| *code == 0),
            "on {}, fetching {host}'s /health failed: {exit:?}; {} status:\n{shown}",
            node.name(),
            done.name_any()
        );
    }
    let exit = terminated(status.container_statuses.as_deref(), "outside");
    ensure!(
        exit.as_ref()
            .is_some_and(|(code, message)| *code != 0 && message.contains("dns error")),
        "on {}, {OUTSIDE} did not fail to resolve: {exit:?}; {name} status:\n{shown}",
        node.name()
    );
    Ok(())
}

/// A terminated container's exit code and message.
fn terminated(statuses: Option<&[ContainerStatus]>, name: &str) -> Option<(i32, String)> {
    let state = statuses?.iter().find(|c| c.name == name)?.state.as_ref()?;
    let terminated = state.terminated.as_ref()?;
    Some((
        terminated.exit_code,
        terminated.message.clone().unwrap_or_default(),
    ))
}
