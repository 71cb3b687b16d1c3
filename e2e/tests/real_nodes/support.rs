//! What the real-node tests share: a restricted namespace with the model claim, the
//! CPU sample placed on real nodes, HTTP to pod IPs (plain requests and SSE streams),
//! container logs with the runtime's timestamps, kubelet log lines, EndpointSlices,
//! and the operator as a process under its own identity.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::{Context as _, bail, ensure};
use futures::{AsyncBufReadExt as _, StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::jiff::Timestamp;
use kube::api::{DynamicObject, ListParams, LogParams, Patch, PatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::{Api, Client, ResourceExt as _};
use serde_json::{Value, json};
use slipway_contract::OperatorArgs;
use slipway_e2e::build::cargo_build_features;
use slipway_e2e::rbac::OperatorIdentity;
use slipway_e2e::real_nodes::{self, ModelClaim, RealNode};
use slipway_e2e::{Cluster, TestNamespace, crd, manifests};
use slipway_engine::testing::ChildGuard;

/// The engine's port in every pod (the operator's, and the hand-written pod's).
pub const ENGINE_PORT: u16 = slipway_contract::ENGINE_PORT;
/// The router's port in its pods.
pub const ROUTER_PORT: u16 = slipway_contract::router::ROUTER_PORT;
/// Bound for an engine pod to be scheduled, started, loaded and probed ready.
pub const POD_READY: Duration = Duration::from_secs(180);

/// Handed to each test.
pub struct Env {
    pub name: &'static str,
    pub cluster: Arc<Cluster>,
}

/// The operator binary, built once per run by the first test that needs it (so the
/// image and pod tests do not depend on it). It is the operator's test build
/// (`fault-injection`), which accepts the engine's `--inject-*` flags in
/// `release.engine.args`: only the rollout test passes them. Copied out of cargo's
/// target directory, so another test binary's build of the plain operator cannot
/// replace it underneath.
fn operator_bin() -> anyhow::Result<PathBuf> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let built =
                cargo_build_features("slipway-operator", "slipway-operator", &["fault-injection"])
                    .map_err(|e| e.to_string())?;
            let dir = real_nodes::slipway_cache().join("real-nodes-e2e");
            let copy = dir.join("slipway-operator-fault-injection");
            std::fs::create_dir_all(&dir)
                .and_then(|()| {
                    // A new file, never rewriting one a running operator executes.
                    let _ = std::fs::remove_file(&copy);
                    std::fs::copy(&built, &copy)
                })
                .map_err(|e| format!("copying {} to {}: {e}", built.display(), copy.display()))?;
            Ok(copy)
        })
        .clone()
        .map_err(|e| anyhow::anyhow!("building slipway-operator: {e}"))
}

/// A test's namespace (restricted Pod Security, model claim) and the real nodes.
pub struct RealNs {
    pub admin: Client,
    pub namespace: TestNamespace,
    pub nodes: Vec<RealNode>,
    // Dropped after the namespace's pods: declared last.
    _model: ModelClaim,
}

impl RealNs {
    pub fn name(&self) -> &str {
        self.namespace.name()
    }

    pub fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.admin.clone(), self.name())
    }

    pub fn isvcs(&self) -> Api<DynamicObject> {
        let resource = ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk(crd::GROUP, crd::VERSION, crd::KIND),
            "inferenceservices",
        );
        Api::namespaced_with(self.admin.clone(), self.name(), &resource)
    }

    pub fn node(&self, name: &str) -> anyhow::Result<&RealNode> {
        self.nodes
            .iter()
            .find(|n| n.name() == name)
            .with_context(|| format!("{name} is not a real node"))
    }
}

/// A fresh namespace that enforces the `restricted` Pod Security Standard, with the
/// model claim ([`real_nodes::MODEL_CLAIM`]) bound in it.
pub async fn real_namespace(env: &Env) -> anyhow::Result<RealNs> {
    let admin = env.cluster.client().await.context("admin client")?;
    let nodes = env.cluster.real_nodes(&admin).await?;
    let namespace = TestNamespace::create(&env.cluster, &admin, env.name).await?;
    let labels = json!({"metadata": {"labels": {
        "pod-security.kubernetes.io/enforce": "restricted",
        "pod-security.kubernetes.io/enforce-version": "latest",
    }}});
    Api::<Namespace>::all(admin.clone())
        .patch(
            namespace.name(),
            &PatchParams::default(),
            &Patch::Merge(&labels),
        )
        .await
        .context("labelling the namespace restricted")?;
    let model = ModelClaim::create(&env.cluster, &admin, namespace.name(), &model_file()?)
        .await
        .context("the model claim")?;
    Ok(RealNs {
        admin,
        namespace,
        nodes,
        _model: model,
    })
}

fn cpu_sample_path() -> PathBuf {
    manifests::samples_dir().join("smollm2-cpu.yaml")
}

/// The CPU sample as checked in.
pub fn sample() -> anyhow::Result<Value> {
    manifests::load_documents(&cpu_sample_path())?
        .into_iter()
        .next()
        .context("manifests/samples/smollm2-cpu.yaml is empty")
}

/// The engine image the samples name (and `e2e/cluster/build-images` imports).
pub fn engine_image() -> anyhow::Result<String> {
    sample()?["spec"]["release"]["engine"]["image"]
        .as_str()
        .map(str::to_owned)
        .context("the CPU sample names no engine image")
}

/// The test build of the engine image (`fault-injection`: `serve --inject-*`), which
/// `e2e/cluster/build-images` tags `<tag>-fault-injection`.
pub fn fault_injection_image() -> anyhow::Result<String> {
    Ok(format!("{}-fault-injection", engine_image()?))
}

/// The model file the CPU sample serves (the last part of its `model.uri`).
pub fn model_file() -> anyhow::Result<String> {
    let uri = sample()?["spec"]["release"]["model"]["uri"]
        .as_str()
        .map(str::to_owned)
        .context("the CPU sample has no model.uri")?;
    uri.rsplit('/')
        .next()
        .filter(|f| !f.is_empty())
        .map(str::to_owned)
        .with_context(|| format!("no file name in model uri {uri}"))
}

/// The CPU sample in `namespace`, on real nodes, its model from the claim, sized for
/// two small nodes: one group needed, survive losing one of two zones (2 groups).
pub fn real_sample(namespace: &str) -> anyhow::Result<Value> {
    let mut isvc = sample()?;
    isvc["metadata"]["namespace"] = json!(namespace);
    let spec = &mut isvc["spec"];
    spec["release"]["model"]["uri"] = json!(format!(
        "pvc://{}/{}",
        real_nodes::MODEL_CLAIM,
        model_file()?
    ));
    spec["release"]["engine"]["maxOutputTokens"] = json!(64);
    spec["release"]["engine"]["resources"] = json!({
        "requests": {"cpu": "100m", "memory": "256Mi"},
        "limits": {"memory": "1Gi"},
    });
    // A small KV pool: two engines share one machine's memory with the build.
    spec["release"]["engine"]["args"] = json!(["--kv-blocks", "256"]);
    spec["capacity"]["demand"] = json!({"static": 0.5});
    spec["capacity"]["replicaGoodput"] = json!(0.5);
    spec["capacity"]["faultDomain"]["fLoss"] = json!(0.5);
    spec["drain"] = json!({"preStopDelaySeconds": 2, "maxDrainSeconds": 60});
    let placement = real_nodes::placement();
    spec["podTemplate"] = json!({
        "nodeSelector": placement["nodeSelector"],
        "tolerations": placement["tolerations"],
        // The engine logs its drain (SIGTERM, exit) at info; its default is warn.
        "env": [{"name": "RUST_LOG", "value": "info"}],
    });
    // The router's pods too: they watch the API server and route to both nodes' engines.
    spec["router"] = json!({
        "nodeSelector": placement["nodeSelector"],
        "tolerations": placement["tolerations"],
    });
    Ok(isvc)
}

/// Applies an InferenceService as a GitOps tool would.
pub async fn apply(ns: &RealNs, isvc: &Value) -> anyhow::Result<()> {
    let name = isvc["metadata"]["name"]
        .as_str()
        .context("InferenceService without a name")?;
    ns.isvcs()
        .patch(
            name,
            &PatchParams::apply("gitops").force(),
            &Patch::Apply(isvc),
        )
        .await
        .with_context(|| format!("applying InferenceService {name}"))?;
    Ok(())
}

pub fn pod_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

pub fn pod_ip(pod: &Pod) -> anyhow::Result<String> {
    pod.status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .with_context(|| format!("pod {} has no IP", pod.name_any()))
}

pub fn node_of(pod: &Pod) -> Option<String> {
    pod.spec.as_ref().and_then(|s| s.node_name.clone())
}

/// An HTTP client for pod IPs: never through a proxy from the environment.
pub fn http() -> anyhow::Result<reqwest::Client> {
    Ok(reqwest::Client::builder()
        .no_proxy()
        .connect_timeout(Duration::from_secs(5))
        .build()?)
}

/// One chat request for `model` to an engine at `ip`; returns the `model` it answered
/// as and the message.
pub async fn chat(
    http: &reqwest::Client,
    ip: &str,
    model: &str,
) -> anyhow::Result<(String, String)> {
    let url = format!("http://{ip}:{ENGINE_PORT}/v1/chat/completions");
    let response = http
        .post(&url)
        .timeout(Duration::from_secs(60))
        .json(&json!({
            "model": model,
            "messages": [{"role": "user", "content": "Name one colour."}],
            "max_tokens": 12,
        }))
        .send()
        .await
        .with_context(|| format!("POST {url}"))?;
    let status = response.status();
    let body: Value = response
        .json()
        .await
        .with_context(|| format!("POST {url}: body"))?;
    ensure!(status.is_success(), "POST {url}: {status}: {body}");
    let model = body["model"].as_str().unwrap_or_default().to_owned();
    let text = body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    ensure!(!text.is_empty(), "POST {url}: no message in {body}");
    Ok((model, text))
}

/// What one streamed completion saw.
#[derive(Debug, Clone, Default)]
pub struct Streamed {
    pub chunks: usize,
    pub finish_reason: Option<String>,
    pub error: Option<String>,
    pub first_token: Option<Timestamp>,
    pub last_token: Option<Timestamp>,
}

/// A streamed completion of exactly `max_tokens` tokens (`ignore_eos`) from the engine
/// at `ip`. `started` is told once the first token arrived (the request is admitted).
pub async fn stream_completion(
    http: reqwest::Client,
    ip: String,
    model: String,
    max_tokens: u32,
    started: tokio::sync::mpsc::Sender<()>,
) -> anyhow::Result<Streamed> {
    let url = format!("http://{ip}:{ENGINE_PORT}/v1/completions");
    let response = http
        .post(&url)
        .timeout(Duration::from_secs(240))
        .json(&json!({
            "model": model,
            "prompt": "The history of the lighthouse begins",
            "max_tokens": max_tokens,
            "ignore_eos": true,
            "stream": true,
        }))
        .send()
        .await
        .with_context(|| format!("POST {url}"))?;
    ensure!(
        response.status().is_success(),
        "POST {url}: {}",
        response.status()
    );
    let mut seen = Streamed::default();
    let mut buffer = String::new();
    let mut bytes = response.bytes_stream();
    while let Some(chunk) = bytes.next().await {
        let chunk = chunk.with_context(|| format!("reading the stream of {url}"))?;
        buffer.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buffer.find("\n\n") {
            let event: String = buffer.drain(..end + 2).collect();
            for data in event.lines().filter_map(|l| l.strip_prefix("data:")) {
                let data = data.trim();
                if data == "[DONE]" {
                    return Ok(seen);
                }
                let value: Value = serde_json::from_str(data)
                    .with_context(|| format!("SSE data is not JSON: {data}"))?;
                if !value["error"].is_null() {
                    seen.error = Some(value["error"].to_string());
                    continue;
                }
                let choice = &value["choices"][0];
                if choice["text"].as_str().is_some_and(|t| !t.is_empty()) {
                    let now = Timestamp::now();
                    if seen.first_token.is_none() {
                        seen.first_token = Some(now);
                        // The receiver may be gone (the test stopped waiting): fine.
                        let _ = started.send(()).await;
                    }
                    seen.last_token = Some(now);
                    seen.chunks += 1;
                }
                if let Some(reason) = choice["finish_reason"].as_str() {
                    seen.finish_reason = Some(reason.to_owned());
                }
            }
        }
    }
    bail!("the stream of {url} ended without [DONE] after {seen:?}")
}

/// A container's log, followed from the start with the runtime's timestamps until
/// the container exits (or the task is aborted).
pub struct FollowedLog {
    task: tokio::task::JoinHandle<anyhow::Result<Vec<(Timestamp, String)>>>,
}

impl FollowedLog {
    pub fn start(pods: Api<Pod>, pod: &str, container: &str) -> Self {
        let pod = pod.to_owned();
        let params = LogParams {
            container: Some(container.to_owned()),
            follow: true,
            timestamps: true,
            ..LogParams::default()
        };
        let task = tokio::spawn(async move {
            let reader = pods.log_stream(&pod, &params).await?;
            let mut lines = reader.lines();
            let mut out = Vec::new();
            while let Some(line) = lines.try_next().await? {
                if let Some((time, text)) = line.split_once(' ')
                    && let Ok(time) = time.parse::<Timestamp>()
                {
                    out.push((time, strip_ansi(text)));
                }
            }
            Ok(out)
        });
        Self { task }
    }

    /// The lines, once the log ended; at most `timeout`.
    pub async fn finish(self, timeout: Duration) -> anyhow::Result<Vec<(Timestamp, String)>> {
        match tokio::time::timeout(timeout, self.task).await {
            Ok(joined) => joined.context("the log task panicked")?,
            Err(_) => bail!("the container's log did not end within {timeout:?}"),
        }
    }
}

/// Drops terminal colour codes (`ESC [ ... m`) from a log line.
pub fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Lines of a node's kubelet log that contain every one of `needles`, with their
/// time (klog's `I1201 20:44:01.123456` prefix, in this machine's UTC, this year).
pub fn kubelet_lines(
    node: &RealNode,
    needles: &[&str],
) -> anyhow::Result<Vec<(Timestamp, String)>> {
    let path = node.kubelet_log();
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let year = Timestamp::now().to_string()[..4].to_owned();
    Ok(text
        .lines()
        .filter(|line| needles.iter().all(|n| line.contains(n)))
        .filter_map(|line| {
            let mmdd = line.get(1..5)?;
            let time = line.get(6..21)?;
            let stamp = format!("{year}-{}-{}T{time}Z", &mmdd[..2], &mmdd[2..]);
            Some((stamp.parse().ok()?, line.to_owned()))
        })
        .collect())
}

/// One endpoint of a Service as its EndpointSlices show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointView {
    pub pod: String,
    pub ip: String,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
}

/// Every engine endpoint of InferenceService `instance`: the leaders its per-release
/// Services select, from their EndpointSlices (which carry their Services' labels).
/// The client Service selects the router pods, so its endpoints are no engines.
pub async fn engine_endpoints(
    admin: &Client,
    namespace: &str,
    instance: &str,
) -> anyhow::Result<Vec<EndpointView>> {
    endpoints_of(
        admin,
        namespace,
        &format!("app.kubernetes.io/instance={instance},slipway.dev/release"),
    )
    .await
}

/// The router pods of InferenceService `instance`: the endpoints of its client Service.
pub async fn router_endpoints(
    admin: &Client,
    namespace: &str,
    instance: &str,
) -> anyhow::Result<Vec<EndpointView>> {
    endpoints_of(
        admin,
        namespace,
        &format!("kubernetes.io/service-name={instance}"),
    )
    .await
}

/// Every endpoint of the EndpointSlices `selector` lists.
async fn endpoints_of(
    admin: &Client,
    namespace: &str,
    selector: &str,
) -> anyhow::Result<Vec<EndpointView>> {
    let slices = Api::<EndpointSlice>::namespaced(admin.clone(), namespace)
        .list(&ListParams::default().labels(selector))
        .await?;
    let mut out = Vec::new();
    for slice in slices.items {
        for endpoint in slice.endpoints.unwrap_or_default() {
            let conditions = endpoint.conditions.unwrap_or_default();
            out.push(EndpointView {
                pod: endpoint.target_ref.and_then(|r| r.name).unwrap_or_default(),
                ip: endpoint.addresses.first().cloned().unwrap_or_default(),
                ready: conditions.ready == Some(true),
                serving: conditions.serving == Some(true),
                terminating: conditions.terminating == Some(true),
            });
        }
    }
    out.sort_by(|a, b| a.pod.cmp(&b.pod));
    Ok(out)
}

/// The operator as a host process under the identity of `manifests/rbac/`, acting on
/// one namespace; killed (by its handle) when dropped. The host routes to pod IPs, so
/// its direct scrape of engine pods reaches them as it would in a cluster.
pub struct OperatorProcess {
    process: ChildGuard,
    pub log: PathBuf,
    _identity: OperatorIdentity,
}

impl OperatorProcess {
    pub async fn start(env: &Env, ns: &RealNs) -> anyhow::Result<Self> {
        let identity = OperatorIdentity::bind(&env.cluster, &ns.admin, &ns.namespace)
            .await
            .context("binding the operator's ServiceAccount")?;
        let log = env
            .cluster
            .workdir()
            .join("operator-logs")
            .join(format!("{}.log", ns.name()));
        if let Some(dir) = log.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let file = std::fs::File::create(&log)?;
        let args = OperatorArgs {
            namespace: Some(ns.name().to_owned()),
            lease_namespace: ns.name().to_owned(),
            identity: Some("real-nodes-e2e".to_owned()),
            metrics_addr: (Ipv4Addr::LOCALHOST, 0).into(),
            ..OperatorArgs::default()
        };
        let process = ChildGuard::spawn(
            "slipway-operator",
            Command::new(operator_bin()?)
                .env("KUBECONFIG", identity.kubeconfig())
                .env("RUST_LOG", "info,slipway_operator=debug")
                .args(args.to_args())
                .stdout(file.try_clone()?)
                .stderr(file),
        )?;
        Ok(Self {
            process,
            log,
            _identity: identity,
        })
    }

    /// The last lines of the operator's log, for failure messages.
    pub fn tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// Fails when the operator exited.
    pub fn ensure_running(&mut self) -> anyhow::Result<()> {
        if let Err(exited) = self.process.ensure_running() {
            bail!("{exited}:\n{}", self.tail());
        }
        Ok(())
    }
}
