//! The operator's own pods on the real nodes: the CPU sample (on real nodes, its
//! model and a LoRA adapter from a `pvc://` claim) becomes Ready through the
//! kubelet's probes and answers as the base model and as the adapter; a group drains its in-flight streams when its pod is deleted; a slow
//! canary is rolled back on real pods while serving never drops below N_healthy; a
//! killed engine recreates its group; a stopped kubelet loses its zone, and the
//! cluster recovers when it comes back; measured demand adds and removes groups
//! under a ramp of real traffic.
//!
//! The sample is sized for two small nodes in two zones: N_healthy = 1, fLoss = 0.5,
//! so two groups, one per zone (spread by the operator's topology constraint).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use futures::future::join_all;
use k8s_openapi::api::core::v1::{Event, Node, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, ListParams};
use kube::{Api, ResourceExt as _};
use serde_json::{Value, json};
use slipway_api::testing::condition;
use slipway_contract::metrics::{RELEASE_LABEL, REQUESTS, counter_total, router};
use slipway_e2e::real_nodes::{self, RealNode};

use crate::support::{
    ENGINE_PORT, Env, FollowedLog, OperatorProcess, POD_READY, ROUTER_PORT, RealNs, Streamed,
    apply, chat, engine_endpoints, fault_injection_image, http, kubelet_lines, node_of, pod_ip,
    pod_ready, real_namespace, real_sample, router_endpoints, stream_completion,
};

pub const ISVC: &str = "smollm2";
/// Label selecting the sample's engine pods (the operator's instance label).
const INSTANCE: &str = "app.kubernetes.io/instance=smollm2";
/// Streams in flight during the drain test, and their length.
const STREAMS: usize = 16;
/// Long enough that streams are still running when SIGTERM arrives (about 10 tokens/s
/// per stream here), within the sample's `maxOutputTokens` raised to 128 for the test.
const STREAM_TOKENS: u32 = 96;

/// A namespace, the operator acting on it, and the sample applied and Ready.
pub struct Running {
    pub ns: RealNs,
    pub operator: OperatorProcess,
}

impl Running {
    async fn start(env: &Env, isvc: Value) -> anyhow::Result<Self> {
        Self::start_with(env, isvc, 2).await
    }

    /// Applies `isvc` and waits until `groups` groups are ready.
    pub async fn start_with(env: &Env, isvc: Value, groups: i64) -> anyhow::Result<Self> {
        let ns = real_namespace(env).await?;
        let operator = OperatorProcess::start(env, &ns).await?;
        let mut running = Self { ns, operator };
        let mut isvc = isvc;
        isvc["metadata"]["namespace"] = json!(running.ns.name());
        apply(&running.ns, &isvc).await?;
        running.wait_ready(groups, POD_READY * 2).await?;
        Ok(running)
    }

    async fn status(&self) -> anyhow::Result<Value> {
        Ok(self.ns.isvcs().get(ISVC).await?.data["status"].clone())
    }

    /// Polls the status (every 250 ms) until `found` yields, for at most `timeout`;
    /// fails early if the operator exits.
    pub async fn until<T>(
        &mut self,
        what: &str,
        timeout: Duration,
        mut found: impl FnMut(&Value) -> Option<T>,
    ) -> anyhow::Result<T> {
        let deadline = Instant::now() + timeout;
        loop {
            let status = self.status().await?;
            if let Some(t) = found(&status) {
                return Ok(t);
            }
            self.operator.ensure_running()?;
            if Instant::now() >= deadline {
                let pods = self.pod_summary().await.unwrap_or_default();
                bail!(
                    "timed out after {timeout:?} waiting for {what}; status:\n{}\npods: {pods}\noperator log:\n{}",
                    serde_yaml::to_string(&status).unwrap_or_default(),
                    self.operator.tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    pub async fn wait_ready(&mut self, groups: i64, timeout: Duration) -> anyhow::Result<Value> {
        self.until(
            &format!("{ISVC} Ready with {groups} ready groups"),
            timeout,
            |s| {
                (s["replicas"]["desired"] == groups
                    && s["replicas"]["ready"] == groups
                    && condition(s, "Ready").is_some_and(|c| c["status"] == "True"))
                .then(|| s.clone())
            },
        )
        .await
    }

    /// The InferenceService's engine pods (its router pods carry the same instance
    /// label, and are no group).
    pub async fn engine_pods(&self) -> anyhow::Result<Vec<Pod>> {
        let selector = format!(
            "{INSTANCE},{}={}",
            slipway_contract::labels::COMPONENT,
            slipway_contract::labels::ENGINE_COMPONENT
        );
        Ok(self
            .ns
            .pods()
            .list(&ListParams::default().labels(&selector))
            .await?
            .items)
    }

    pub async fn pod_summary(&self) -> anyhow::Result<String> {
        Ok(self
            .engine_pods()
            .await?
            .iter()
            .map(|p| {
                format!(
                    "{} on {:?} phase {:?} ready {}{}",
                    p.name_any(),
                    node_of(p),
                    p.status.as_ref().and_then(|s| s.phase.clone()),
                    pod_ready(p),
                    if p.metadata.deletion_timestamp.is_some() {
                        " (terminating)"
                    } else {
                        ""
                    }
                )
            })
            .collect::<Vec<_>>()
            .join("; "))
    }

    pub fn kubectl_get_wide(&self, env: &Env) -> String {
        env.cluster
            .kubectl(
                &[
                    "get",
                    "inferenceservices,pods",
                    "-o",
                    "wide",
                    "-n",
                    self.ns.name(),
                ],
                Duration::from_secs(30),
            )
            .unwrap_or_else(|e| format!("(kubectl get failed: {e})"))
    }
}

/// Every engine pod of the sample is Ready on a real node, and the two zones each
/// hold one.
async fn ensure_on_real_nodes(running: &Running) -> anyhow::Result<Vec<Pod>> {
    let pods = running.engine_pods().await?;
    let real: BTreeSet<&str> = running.ns.nodes.iter().map(RealNode::name).collect();
    let mut zones = BTreeSet::new();
    for pod in &pods {
        let node = node_of(pod).unwrap_or_default();
        ensure!(
            real.contains(node.as_str()),
            "{} runs on {node:?}, not on a real node ({real:?})",
            pod.name_any()
        );
        ensure!(pod_ready(pod), "{} is not Ready", pod.name_any());
        zones.insert(running.ns.node(&node)?.zone().to_owned());
    }
    ensure!(
        zones.len() == 2,
        "the groups are not spread over both zones: {zones:?}"
    );
    Ok(pods)
}

/// The test LoRA adapter (`make lora-adapter`) as a release adapter on the model
/// claim, with the digest its llama.cpp oracle recorded: the engine verifies it.
fn claim_adapter() -> anyhow::Result<Value> {
    let fixture = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../engine/tests/fixtures/smollm2-lora-llamacpp.json"
    );
    let oracle: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture).with_context(|| format!("reading {fixture}"))?,
    )
    .with_context(|| format!("parsing {fixture}"))?;
    let sha256 = oracle["adapter_sha256"]
        .as_str()
        .with_context(|| format!("{fixture} has no adapter_sha256"))?;
    Ok(json!({
        "name": LORA_ADAPTER,
        "uri": format!("pvc://{}/{LORA_ADAPTER_FILE}", real_nodes::MODEL_CLAIM),
        "sha256": sha256,
    }))
}

/// The adapter's model name, and its file in the model cache.
const LORA_ADAPTER: &str = "lora-test";
const LORA_ADAPTER_FILE: &str = "smollm2-lora-test.gguf";

pub async fn cpu_sample_is_ready_on_real_nodes_and_answers(env: Arc<Env>) -> anyhow::Result<()> {
    // With a LoRA adapter from the model's claim: the operator stages it, the engine
    // verifies and loads it, and a request naming it is answered by it.
    let mut isvc = real_sample("")?;
    isvc["spec"]["release"]["adapters"] = json!([claim_adapter()?]);
    let running = Running::start(&env, isvc).await?;
    let pods = ensure_on_real_nodes(&running).await?;
    // Readiness came from the kubelets' probes of /ready.
    for pod in &pods {
        let node = node_of(pod).unwrap_or_default();
        let probes = env.cluster.kubectl(
            &[
                "get",
                "--raw",
                &format!("/api/v1/nodes/{node}/proxy/metrics/probes"),
            ],
            Duration::from_secs(30),
        )?;
        ensure!(
            probes.lines().any(|l| l.starts_with("prober_probe_total")
                && l.contains("probe_type=\"Readiness\"")
                && l.contains("result=\"successful\"")
                && l.contains(&format!("pod=\"{}\"", pod.name_any()))),
            "{node}'s kubelet reports no successful readiness probe of {}",
            pod.name_any()
        );
    }
    // A request to a leader's pod IP from its release Service's EndpointSlice (the
    // client Service selects the router pods).
    let ready: Vec<_> = engine_endpoints(&running.ns.admin, running.ns.name(), ISVC)
        .await?
        .into_iter()
        .filter(|e| e.ready)
        .collect();
    ensure!(
        ready.len() == 2,
        "the release Service has {} ready endpoints, not 2: {ready:?}",
        ready.len()
    );
    let isvc = running.ns.isvcs().get(ISVC).await?;
    let served = isvc.data["spec"]["servedModelName"]
        .as_str()
        .unwrap_or(ISVC)
        .to_owned();
    let (model, text) = chat(&http()?, &ready[0].ip, &served).await?;
    ensure!(
        model == served,
        "the engine answered as {model:?}, not the served model name {served:?}"
    );
    let (model, adapted) = chat(&http()?, &ready[0].ip, LORA_ADAPTER).await?;
    ensure!(
        model == LORA_ADAPTER,
        "a request naming the adapter was answered as {model:?}"
    );
    tracing::info!(endpoint = %ready[0].ip, %text, %adapted, "\n{}", running.kubectl_get_wide(&env));
    Ok(())
}

/// An endpoint's (ready, serving, terminating), or `None` once it left the slices.
type EndpointState = Option<(bool, bool, bool)>;

/// The states one endpoint went through, sampled until it left the slices or for
/// `patience`. It leaves only once the pod object is gone, which comes after the engine's
/// last log line (the kubelet reports the exit, then the pod is removed): the watch
/// ends on its own, not when the streams do.
async fn watch_endpoint(
    admin: kube::Client,
    namespace: String,
    pod: String,
    patience: Duration,
) -> anyhow::Result<Vec<(Timestamp, EndpointState)>> {
    let mut states: Vec<(Timestamp, EndpointState)> = Vec::new();
    let deadline = Instant::now() + patience;
    while Instant::now() < deadline {
        let now = engine_endpoints(&admin, &namespace, ISVC)
            .await?
            .into_iter()
            .find(|e| e.pod == pod)
            .map(|e| (e.ready, e.serving, e.terminating));
        if states.last().map(|(_, s)| *s) != Some(now) {
            states.push((Timestamp::now(), now));
        }
        if now.is_none() && states.len() > 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(states)
}

pub async fn drain_under_load_finishes_every_stream(env: Arc<Env>) -> anyhow::Result<()> {
    let mut isvc = real_sample("")?;
    isvc["spec"]["release"]["engine"]["maxOutputTokens"] = json!(128);
    // Paced (the test image's fault injection: every decode step 60 ms slower), so
    // the streams' 96 tokens outlast the 2 s preStop sleep however fast the engine
    // decodes: unpaced, 16 streams ended before SIGTERM once a decode step of 16
    // took 14 ms.
    isvc["spec"]["release"]["engine"]["image"] = json!(fault_injection_image()?);
    isvc["spec"]["release"]["engine"]["args"] =
        json!(["--kv-blocks", "256", "--inject-delay-ms", "60"]);
    let running = Running::start(&env, isvc).await?;
    let pods = ensure_on_real_nodes(&running).await?;
    let pod = pods
        .iter()
        .find(|p| p.name_any().contains("-g0-"))
        .context("no pod of group 0")?
        .clone();
    let name = pod.name_any();
    let node = running.ns.node(&node_of(&pod).unwrap_or_default())?.clone();
    let ip = pod_ip(&pod)?;
    let grace = pod
        .spec
        .as_ref()
        .and_then(|s| s.termination_grace_period_seconds)
        .context("the operator's pod has no grace period")?;

    let log = FollowedLog::start(running.ns.pods(), &name, "engine");
    let http = http()?;
    let (started_tx, mut started_rx) = tokio::sync::mpsc::channel(STREAMS);
    let streams: Vec<_> = (0..STREAMS)
        .map(|_| {
            tokio::spawn(stream_completion(
                http.clone(),
                ip.clone(),
                ISVC.to_owned(),
                STREAM_TOKENS,
                started_tx.clone(),
            ))
        })
        .collect();
    drop(started_tx);
    let admitted = tokio::time::timeout(Duration::from_secs(120), async {
        for _ in 0..STREAMS {
            started_rx
                .recv()
                .await
                .context("a stream ended before its first token")?;
        }
        anyhow::Ok(())
    })
    .await;
    ensure!(
        matches!(admitted, Ok(Ok(()))),
        "not all {STREAMS} streams got a first token: {admitted:?}"
    );

    let watcher = tokio::spawn(watch_endpoint(
        running.ns.admin.clone(),
        running.ns.name().to_owned(),
        name.clone(),
        Duration::from_secs(u64::try_from(grace).unwrap_or(0) + 60),
    ));
    let deleted_at = Timestamp::now();
    running
        .ns
        .pods()
        .delete(&name, &DeleteParams::default())
        .await?;

    let mut outcomes: Vec<Streamed> = Vec::new();
    for (i, result) in join_all(streams).await.into_iter().enumerate() {
        let streamed = result
            .context("stream task panicked")?
            .with_context(|| format!("stream {i}"))?;
        ensure!(
            streamed.finish_reason.is_some() && streamed.error.is_none(),
            "stream {i} did not finish cleanly: {streamed:?}"
        );
        outcomes.push(streamed);
    }
    let lines = log.finish(Duration::from_secs(grace as u64 + 30)).await?;
    let at = |needle: &str| {
        lines
            .iter()
            .find(|(_, l)| l.contains(needle))
            .map(|(t, _)| *t)
            .with_context(|| format!("{name}'s engine never logged {needle:?}"))
    };
    let sigterm = at("SIGTERM")?;
    let exited = at("drained; exiting")?;
    let pod_key = format!("pod=\"{}/{name}\"", running.ns.name());
    let pre_stop = kubelet_lines(&node, &["Running preStop hook", &pod_key])?
        .last()
        .map(|(t, _)| *t)
        .with_context(|| {
            format!(
                "{}'s kubelet log has no preStop hook for {pod_key}",
                node.name()
            )
        })?;
    let last_token = outcomes
        .iter()
        .filter_map(|s| s.last_token)
        .max()
        .context("no stream saw a token")?;
    let states = watcher.await.context("endpoint watcher panicked")??;

    let delay = running.status().await.ok();
    let pre_stop_delay = real_sample("")?["spec"]["drain"]["preStopDelaySeconds"]
        .as_f64()
        .unwrap_or(0.0);
    ensure!(
        sigterm.duration_since(pre_stop).as_secs_f64() >= pre_stop_delay - 0.2,
        "SIGTERM ({sigterm}) came less than the {pre_stop_delay} s preStop sleep after the hook started ({pre_stop})"
    );
    let exit_after = exited.duration_since(deleted_at).as_secs_f64();
    ensure!(
        exit_after < grace as f64,
        "the engine exited {exit_after:.1} s after deletion, past the {grace} s grace period"
    );
    ensure!(
        last_token > sigterm,
        "every stream ended ({last_token}) before SIGTERM ({sigterm}): the drain had nothing in flight"
    );
    ensure!(
        states.iter().any(|(_, s)| *s == Some((false, true, true))),
        "the endpoint was never seen terminating while still serving: {states:?}"
    );
    ensure!(
        matches!(states.last(), Some((_, None))),
        "the endpoint did not leave the EndpointSlice: {states:?}"
    );
    let timeline = format!(
        "drain of {name} on {} with {STREAMS} streams of {STREAM_TOKENS} tokens (grace {grace} s):\n\
         deleted          {deleted_at}\n\
         preStop started  {pre_stop}\n\
         SIGTERM          {sigterm}\n\
         last token       {last_token}\n\
         engine exited    {exited}\n\
         endpoint states (ready, serving, terminating): {states:?}\n\
         finish reasons: {:?}\n\
         status after: {}\n",
        node.name(),
        outcomes
            .iter()
            .map(|s| s.finish_reason.clone().unwrap_or_default())
            .collect::<BTreeSet<_>>(),
        delay.map(|s| s.to_string()).unwrap_or_default(),
    );
    write_report("drain-timeline.txt", &timeline)?;
    tracing::info!("\n{timeline}");
    Ok(())
}

fn write_report(file: &str, text: &str) -> anyhow::Result<()> {
    let dir = real_nodes::slipway_cache().join("e2e-reports");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join(file), text)?;
    Ok(())
}

/// How the requests of an open-loop load ended.
#[derive(Debug, Default)]
struct LoadReport {
    sent: u64,
    /// Completed with 200.
    ok: u64,
    /// Refused at admission (429 or 503): never admitted, so never lost.
    refused: u64,
    /// Anything else: a transport error, a cut connection, another status. Once a
    /// request was admitted, this is a lost request.
    lost: u64,
    /// Completed within TTFT target + (tokens − 1) × TPOT target (E2E bound: the
    /// requests are not streamed).
    slo_met: u64,
}

/// Where load goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Via {
    /// The engines' ready endpoints (their release Services'), round-robin.
    Engines,
    /// The router pods (the client Service's endpoints), round-robin between them.
    Router,
}

/// Open-loop load through `via`'s ready endpoints, round-robin, as a Service would
/// spread it (there is no kube-proxy: the endpoints are read from the EndpointSlices
/// every second), at `rate(seconds since start)` requests per second. Stops when
/// `stop` is set.
async fn service_load(
    admin: kube::Client,
    namespace: String,
    via: Via,
    rate: impl Fn(f64) -> f64 + Send + 'static,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<LoadReport> {
    const TOKENS: u32 = 6;
    // The sample's SLO (slo.ttft 2 s, slo.tpot 150 ms) as an E2E bound.
    let slo_e2e = Duration::from_millis(2000 + 150 * u64::from(TOKENS - 1));
    let http = http()?;
    let port = match via {
        Via::Engines => ENGINE_PORT,
        Via::Router => ROUTER_PORT,
    };
    let counts: Arc<[AtomicU64; 5]> = Arc::new(Default::default());
    let in_flight = Arc::new(tokio::sync::Semaphore::new(32));
    let mut ips: Vec<String> = Vec::new();
    let mut refreshed = Instant::now() - Duration::from_secs(10);
    let mut next = 0usize;
    let started = Instant::now();
    let mut due = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(900);
    while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
        if refreshed.elapsed() >= Duration::from_secs(1) {
            let endpoints = match via {
                Via::Engines => engine_endpoints(&admin, &namespace, ISVC).await?,
                Via::Router => router_endpoints(&admin, &namespace, ISVC).await?,
            };
            ips = endpoints
                .into_iter()
                .filter(|e| e.ready)
                .map(|e| e.ip)
                .collect();
            refreshed = Instant::now();
        }
        if !ips.is_empty()
            && let Ok(permit) = Arc::clone(&in_flight).try_acquire_owned()
        {
            let ip = ips[next % ips.len()].clone();
            next += 1;
            let (http, counts) = (http.clone(), Arc::clone(&counts));
            tokio::spawn(async move {
                let _permit = permit;
                counts[0].fetch_add(1, Ordering::Relaxed);
                let sent = Instant::now();
                let status = http
                    .post(format!("http://{ip}:{port}/v1/completions"))
                    .timeout(Duration::from_secs(60))
                    .json(&json!({"model": ISVC, "prompt": "Once upon a time", "max_tokens": TOKENS, "ignore_eos": true}))
                    .send()
                    .await
                    .map(|r| r.status());
                // A non-streamed completion's headers come when generation ends, so
                // the time to `send`'s return is the request's E2E latency.
                let slot = match status {
                    Ok(s) if s.is_success() => {
                        if sent.elapsed() <= slo_e2e {
                            counts[4].fetch_add(1, Ordering::Relaxed);
                        }
                        1
                    }
                    Ok(s) if s.as_u16() == 429 || s.as_u16() == 503 => 2,
                    _ => 3,
                };
                counts[slot].fetch_add(1, Ordering::Relaxed);
            });
        }
        let r = rate(started.elapsed().as_secs_f64()).max(0.01);
        due += Duration::from_secs_f64(1.0 / r);
        tokio::time::sleep_until(due.into()).await;
    }
    // Let the requests in flight end before counting.
    let _ = in_flight.acquire_many(32).await;
    let c = |i: usize| counts[i].load(Ordering::Relaxed);
    Ok(LoadReport {
        sent: c(0),
        ok: c(1),
        refused: c(2),
        lost: c(3),
        slo_met: c(4),
    })
}

fn with_rollout(mut isvc: Value) -> Value {
    // Objective 0.9: a canary whose requests all miss TPOT burns 10x; thresholds of 5.
    isvc["spec"]["slo"]["availability"] = json!(0.9);
    isvc["spec"]["slo"]["tpot"]["threshold"] = json!("250ms");
    isvc["spec"]["rollout"] = json!({
        "steps": [{"weight": 50}, {"weight": 100}],
        "maxSurge": 1,
        "analysis": {
            "interval": "2s",
            "shortWindow": "8s",
            "longWindow": "16s",
            "shortBurnRateThreshold": 5,
            "longBurnRateThreshold": 5,
            "minRequests": 6,
            "inconclusivePolicy": "Hold",
            "metrics": {"source": "Router"},
        },
    });
    isvc
}

/// The rollout analysis reads the router (`metrics.source: Router`): the load goes
/// through the router pods, which measure each release's TTFT, TPOT and outcomes at
/// the gateway, and the slow bundle is rolled back on that evidence alone.
pub async fn a_slow_canary_is_rolled_back_then_a_good_bundle_is_promoted(
    env: Arc<Env>,
) -> anyhow::Result<()> {
    let base = with_rollout(real_sample("")?);
    let mut running = Running::start(&env, base.clone()).await?;
    let stable = running.status().await?["stableRelease"]
        .as_str()
        .context("no stableRelease once Ready")?
        .to_owned();
    let healthy = running.status().await?["replicas"]["healthyNeeded"]
        .as_i64()
        .context("no healthyNeeded")?;

    let stop = Arc::new(AtomicBool::new(false));
    let load = tokio::spawn(service_load(
        running.ns.admin.clone(),
        running.ns.name().to_owned(),
        Via::Router,
        |_| 4.0,
        Arc::clone(&stop),
    ));
    let mut min_serving = i64::MAX;
    let mut sample = |s: &Value| {
        if let Some(serving) = s["replicas"]["serving"].as_i64() {
            min_serving = min_serving.min(serving);
        }
    };

    // The bad bundle: every decode step 600 ms slower (the test image's fault
    // injection, through release.engine.args), so every request misses TPOT.
    let mut bad = base.clone();
    bad["metadata"]["namespace"] = json!(running.ns.name());
    bad["spec"]["release"]["engine"]["image"] = json!(fault_injection_image()?);
    bad["spec"]["release"]["engine"]["args"] =
        json!(["--kv-blocks", "256", "--inject-delay-ms", "600"]);
    apply(&running.ns, &bad).await?;
    let rollback = running
        .until(
            "the slow canary rolled back",
            Duration::from_secs(420),
            |s| {
                sample(s);
                let rolled = condition(s, "RolledBack").is_some_and(|c| c["status"] == "True");
                (rolled
                    && s["lastRollback"]["release"]
                        .as_str()
                        .is_some_and(|r| r != stable))
                .then(|| s.clone())
            },
        )
        .await?;
    let last = &rollback["lastRollback"];
    ensure!(
        last["shortBurnRate"].as_f64().is_some_and(|b| b > 5.0)
            && last["longBurnRate"].as_f64().is_some_and(|b| b > 5.0),
        "the rollback has no burn rates above the thresholds: {last}"
    );
    ensure!(
        rollback["stableRelease"] == stable.as_str(),
        "the stable release changed in a rollback: {rollback}"
    );
    write_report(
        "rollback-status.yaml",
        &serde_yaml::to_string(&rollback).unwrap_or_default(),
    )?;

    // A good bundle (a changed engine argument, no fault) is promoted.
    let mut good = base.clone();
    good["metadata"]["namespace"] = json!(running.ns.name());
    good["spec"]["release"]["engine"]["args"] = json!(["--kv-blocks", "192"]);
    apply(&running.ns, &good).await?;
    let promoted = running
        .until("the good bundle promoted", Duration::from_secs(600), |s| {
            sample(s);
            let new_stable = s["stableRelease"].as_str().is_some_and(|r| r != stable);
            (new_stable
                && s["canaryRelease"].is_null()
                && condition(s, "Ready").is_some_and(|c| c["status"] == "True"))
            .then(|| s.clone())
        })
        .await?;
    stop.store(true, Ordering::Relaxed);
    let report = load.await.context("load task panicked")??;
    let (sent, failed) = (report.sent, report.refused + report.lost);
    ensure!(
        min_serving >= healthy,
        "serving dropped to {min_serving} groups during the rollouts, below N_healthy = {healthy}"
    );
    tracing::info!(sent, failed, min_serving, promoted = %promoted["stableRelease"], "rollouts on real pods done");
    Ok(())
}

/// Sums `slipway_requests_total` of each release over the engines' ready endpoints:
/// the engines' own count of what reached them, independent of the router.
async fn requests_by_release(
    running: &Running,
) -> anyhow::Result<std::collections::BTreeMap<String, f64>> {
    let http = http()?;
    let mut by_release = std::collections::BTreeMap::new();
    for endpoint in engine_endpoints(&running.ns.admin, running.ns.name(), ISVC).await? {
        if !endpoint.ready {
            continue;
        }
        let text = http
            .get(format!("http://{}:{ENGINE_PORT}/metrics", endpoint.ip))
            .timeout(Duration::from_secs(10))
            .send()
            .await?
            .text()
            .await?;
        let requests = format!("{}{{", counter_total(REQUESTS));
        let release_label = format!("{RELEASE_LABEL}=\"");
        for line in text.lines().filter(|l| l.starts_with(&requests)) {
            let release = line
                .split(&release_label)
                .nth(1)
                .and_then(|r| r.split('"').next())
                .unwrap_or_default()
                .to_owned();
            let value: f64 = line
                .rsplit(' ')
                .next()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0.0);
            *by_release.entry(release).or_insert(0.0) += value;
        }
    }
    Ok(by_release)
}

/// The router gives a canary its step's request weight, whatever the group counts:
/// with three stable groups and one canary group at weight 10 (a share of groups would
/// send it 25 %), 1,000 requests through the two router pods reach the canary's
/// engines 10 % ± 3 % of the time, as the engines themselves count them. The router
/// pods run on the real nodes, watch the API server under the Role the operator
/// rendered, and route to engines on both nodes.
pub async fn the_router_sends_a_ten_percent_canary_ten_percent_of_requests(
    env: Arc<Env>,
) -> anyhow::Result<()> {
    const REQUESTS: usize = 1000;
    let mut base = real_sample("")?;
    // Three stable groups, no spare: N_healthy = 1.5 / 0.5, fLoss 0.
    base["spec"]["capacity"]["demand"] = json!({"static": 1.5});
    base["spec"]["capacity"]["faultDomain"]["fLoss"] = json!(0.0);
    // Hold the first step: a long pause, and analysis that never has enough evidence.
    base["spec"]["rollout"] = json!({
        "steps": [{"weight": 10, "pause": "30m"}, {"weight": 100}],
        "maxSurge": 1,
        "analysis": {
            "interval": "5s",
            "minRequests": 1000000,
            "inconclusivePolicy": "Hold",
            "metrics": {"source": "Router"},
        },
    });
    let mut running = Running::start_with(&env, base.clone(), 3).await?;
    let stable = running.status().await?["stableRelease"]
        .as_str()
        .context("no stableRelease once Ready")?
        .to_owned();

    let mut canary = base.clone();
    canary["metadata"]["namespace"] = json!(running.ns.name());
    canary["spec"]["release"]["engine"]["args"] = json!(["--kv-blocks", "192"]);
    apply(&running.ns, &canary).await?;
    let canary_release = running
        .until("the canary at weight 10", Duration::from_secs(420), |s| {
            (s["canaryRelease"]["weight"] == 10)
                .then(|| s["canaryRelease"]["hash"].as_str().map(str::to_owned))
                .flatten()
        })
        .await?;

    // Both router pods see the canary's engine as eligible before any request counts.
    let http = http()?;
    let deadline = Instant::now() + Duration::from_secs(120);
    let routers = loop {
        let routers: Vec<String> = router_endpoints(&running.ns.admin, running.ns.name(), ISVC)
            .await?
            .into_iter()
            .filter(|e| e.ready)
            .map(|e| e.ip)
            .collect();
        let mut seen = 0;
        for ip in &routers {
            let text = http
                .get(format!("http://{ip}:{ROUTER_PORT}/metrics"))
                .timeout(Duration::from_secs(10))
                .send()
                .await?
                .text()
                .await?;
            let eligible = format!(
                "{}{{{RELEASE_LABEL}=\"{canary_release}\",state=\"eligible\"}} 1",
                router::ENDPOINTS
            );
            if text.lines().any(|l| l == eligible) {
                seen += 1;
            }
        }
        if routers.len() == 2 && seen == 2 {
            break routers;
        }
        ensure!(
            Instant::now() < deadline,
            "the router pods {routers:?} do not both route to the canary {canary_release} after 120 s"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };

    let before = requests_by_release(&running).await?;
    let in_flight = Arc::new(tokio::sync::Semaphore::new(8));
    let mut tasks = Vec::new();
    for i in 0..REQUESTS {
        let permit = Arc::clone(&in_flight).acquire_owned().await?;
        let (http, ip) = (http.clone(), routers[i % routers.len()].clone());
        tasks.push(tokio::spawn(async move {
            let _permit = permit;
            http.post(format!("http://{ip}:{ROUTER_PORT}/v1/completions"))
                .timeout(Duration::from_secs(60))
                .json(&json!({"model": ISVC, "prompt": "Hi", "max_tokens": 1}))
                .send()
                .await
                .map(|r| r.status().is_success())
                .unwrap_or(false)
        }));
    }
    let mut ok = 0;
    for task in join_all(tasks).await {
        if task.unwrap_or(false) {
            ok += 1;
        }
    }
    ensure!(
        ok == REQUESTS,
        "only {ok} of {REQUESTS} requests through the router succeeded"
    );
    let after = requests_by_release(&running).await?;
    let grew = |release: &str| {
        after.get(release).copied().unwrap_or(0.0) - before.get(release).copied().unwrap_or(0.0)
    };
    let (to_canary, to_stable) = (grew(&canary_release), grew(&stable));
    let share = to_canary / (to_canary + to_stable);
    let groups: Vec<String> = running
        .engine_pods()
        .await?
        .iter()
        .map(|p| {
            p.labels()
                .get("slipway.dev/release")
                .cloned()
                .unwrap_or_default()
        })
        .collect();
    write_report(
        "router-canary-share.txt",
        &format!(
            "{REQUESTS} requests through {} router pods: canary {canary_release} {to_canary}, stable {stable} {to_stable} (share {:.2} %); engine pods by release: {groups:?}\n",
            routers.len(),
            share * 100.0
        ),
    )?;
    ensure!(
        (to_canary + to_stable - REQUESTS as f64).abs() < 0.5,
        "the engines counted {} requests, not {REQUESTS}",
        to_canary + to_stable
    );
    ensure!(
        (0.07..=0.13).contains(&share),
        "the canary at weight 10 received {:.1} % of the requests ({to_canary} of {})",
        share * 100.0,
        to_canary + to_stable
    );
    Ok(())
}

pub async fn a_killed_engine_recreates_its_group(env: Arc<Env>) -> anyhow::Result<()> {
    let mut running = Running::start(&env, real_sample("")?).await?;
    let pods = ensure_on_real_nodes(&running).await?;
    let victim = pods
        .iter()
        .find(|p| p.name_any().contains("-g0-"))
        .context("no pod of group 0")?
        .clone();
    let name = victim.name_any();
    let old_uid = victim.uid().unwrap_or_default();
    let node = running
        .ns
        .node(&node_of(&victim).unwrap_or_default())?
        .clone();
    let container = victim
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.name == "engine"))
        .and_then(|c| c.container_id.clone())
        .context("the engine container has no id")?;
    node.signal_container(&container, "SIGKILL")?;
    let killed_at = Instant::now();

    // The pod fails (restartPolicy Never), and the operator recreates the group.
    let pods_api = running.ns.pods();
    let deadline = Instant::now() + POD_READY * 2;
    let recreated = loop {
        if let Some(pod) = pods_api.get_opt(&name).await?
            && pod.uid().unwrap_or_default() != old_uid
            && pod_ready(&pod)
        {
            break pod;
        }
        running.operator.ensure_running()?;
        if Instant::now() >= deadline {
            bail!(
                "group 0 was not recreated within {:?} of killing its engine; pods: {}\noperator log:\n{}",
                POD_READY * 2,
                running.pod_summary().await.unwrap_or_default(),
                running.operator.tail()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let events = Api::<Event>::namespaced(running.ns.admin.clone(), running.ns.name())
        .list(&ListParams::default())
        .await?;
    let recreation = events
        .items
        .iter()
        .find(|e| e.reason.as_deref() == Some("GroupRecreated"))
        .with_context(|| {
            format!(
                "no GroupRecreated event; events: {:?}",
                events
                    .items
                    .iter()
                    .map(|e| (e.reason.clone(), e.message.clone()))
                    .collect::<Vec<_>>()
            )
        })?;
    let note = recreation.message.clone().unwrap_or_default();
    ensure!(
        note.contains("restart 1 of"),
        "the recreation is not counted against the bounded restarts: {note:?}"
    );
    running.wait_ready(2, POD_READY).await?;
    tracing::info!(
        pod = %name,
        node = node.name(),
        after = ?killed_at.elapsed(),
        new_node = ?node_of(&recreated),
        %note,
        "group recreated after its engine was killed"
    );
    Ok(())
}

/// Starts a stopped kubelet again when dropped, so a failed test never leaves a
/// node down for the next one.
struct KubeletBack(Option<RealNode>);

impl Drop for KubeletBack {
    fn drop(&mut self) {
        if let Some(node) = self.0.take()
            && let Err(error) = node.start_kubelet()
        {
            eprintln!(
                "error: could not start {}'s kubelet again: {error}",
                node.name()
            );
        }
    }
}

fn node_ready(node: &Node) -> Option<bool> {
    node.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "Ready")
        .map(|c| c.status == "True")
}

pub async fn a_stopped_kubelet_loses_its_zone_and_recovers(env: Arc<Env>) -> anyhow::Result<()> {
    let mut running = Running::start(&env, real_sample("")?).await?;
    ensure_on_real_nodes(&running).await?;
    let lost = running.ns.nodes[0].clone();
    let zone = lost.zone().to_owned();
    let nodes: Api<Node> = Api::all(running.ns.admin.clone());

    lost.stop_kubelet()?;
    let mut back = KubeletBack(Some(lost.clone()));
    slipway_e2e::wait::for_object(
        &nodes,
        lost.name(),
        &format!("{} NotReady after its kubelet stopped", lost.name()),
        Duration::from_secs(150),
        |n: Option<&Node>| n.and_then(node_ready) == Some(false),
    )
    .await?;
    let fault = running
        .until(
            &format!("FaultTolerant naming the lost zone {zone}"),
            Duration::from_secs(60),
            |s| {
                condition(s, "FaultTolerant")
                    // "…=<zone> has no Ready node": the worst-loss summary names a
                    // zone even before any loss, so the zone alone would match at once.
                    .filter(|c| {
                        c["message"]
                            .as_str()
                            .is_some_and(|m| m.contains(&format!("={zone} has no Ready node")))
                    })
                    .cloned()
            },
        )
        .await?;
    // Its group is recreated on the surviving node.
    let survivor = running.ns.nodes[1].name().to_owned();
    running
        .until(
            &format!("both groups ready on {survivor}"),
            POD_READY * 2,
            |s| (s["replicas"]["ready"] == 2).then_some(()),
        )
        .await?;
    let pods = running.engine_pods().await?;
    let ready_elsewhere = pods
        .iter()
        .filter(|p| pod_ready(p) && node_of(p).as_deref() == Some(survivor.as_str()))
        .count();
    ensure!(
        ready_elsewhere == 2,
        "{ready_elsewhere} ready groups on {survivor}, not 2: {}",
        running.pod_summary().await.unwrap_or_default()
    );

    // The kubelet comes back: the node and the status recover.
    back.0 = None;
    lost.start_kubelet()?;
    slipway_e2e::wait::for_object(
        &nodes,
        lost.name(),
        &format!("{} Ready again", lost.name()),
        Duration::from_secs(120),
        |n: Option<&Node>| n.and_then(node_ready) == Some(true),
    )
    .await?;
    running
        .until("FaultTolerant True again", POD_READY * 2, |s| {
            condition(s, "FaultTolerant")
                .filter(|c| c["status"] == "True")
                .cloned()
        })
        .await?;
    tracing::info!(lost = %fault, "zone loss reported and recovered");
    Ok(())
}

/// The ramp of [`measured_demand_follows_a_ramp`]: 0.1 → 3 req/s over 60 s (3× one
/// group's declared goodput of 1 req/s), 3 req/s for 40 s, back to 0.1 over 20 s, then
/// 0.1 req/s.
fn ramp(t: f64) -> f64 {
    match t {
        t if t < 60.0 => 0.1 + 2.9 * t / 60.0,
        t if t < 100.0 => 3.0,
        t if t < 120.0 => 3.0 - 2.9 * (t - 100.0) / 20.0,
        _ => 0.1,
    }
}

/// Measured demand on real pods: an open-loop ramp through the release Service makes
/// the operator add groups as the engines' request counters rise, then remove them,
/// one at a time through drain, once the demand has stayed low for the stabilisation
/// window. No admitted request is lost on the way; the SLO-met fraction, and demand,
/// desired and ready groups over time go to `e2e-reports/capacity-ramp.txt`. An
/// autoscaler pointed at the object afterwards is reported (`ScalerConflict`), not
/// fought: this also proves the operator's RBAC may list them.
pub async fn measured_demand_follows_a_ramp(env: Arc<Env>) -> anyhow::Result<()> {
    let mut isvc = real_sample("")?;
    isvc["spec"]["capacity"] = json!({
        "demand": {"measured": {
            "rateWindow": "20s",
            "peakWindow": "40s",
            "headroom": 0,
            "scaleDownStabilization": "30s",
        }},
        "replicaGoodput": 1.0,
        "faultDomain": {"fLoss": 0},
        "minReplicas": 1,
        "maxReplicas": 4,
    });
    let mut running = Running::start_with(&env, isvc, 1).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let load = tokio::spawn(service_load(
        running.ns.admin.clone(),
        running.ns.name().to_owned(),
        Via::Engines,
        ramp,
        Arc::clone(&stop),
    ));
    let started = Instant::now();
    let mut timeline =
        String::from("t_s  demand_now  demand_peak  desired  ready  healthy_needed\n");
    let mut peak_desired = 0;
    let mut record = |s: &Value, timeline: &mut String| {
        let desired = s["replicas"]["desired"].as_i64().unwrap_or(0);
        peak_desired = peak_desired.max(desired);
        let line = format!(
            "{:>4.0}  {:>10.2}  {:>11.2}  {:>7}  {:>5}  {:>14}\n",
            started.elapsed().as_secs_f64(),
            s["capacity"]["demand"]["current"]
                .as_f64()
                .unwrap_or(f64::NAN),
            s["capacity"]["demand"]["peak"].as_f64().unwrap_or(f64::NAN),
            desired,
            s["replicas"]["ready"].as_i64().unwrap_or(0),
            s["replicas"]["healthyNeeded"].as_i64().unwrap_or(0),
        );
        if !timeline.ends_with(&line[6..]) {
            timeline.push_str(&line);
        }
    };
    // Up: three groups needed at 3 req/s; they are added while the load is at its top.
    let up = running
        .until(
            "3 ready groups under the ramp",
            Duration::from_secs(150),
            |s| {
                record(s, &mut timeline);
                (s["replicas"]["ready"].as_i64().is_some_and(|r| r >= 3)).then(|| s.clone())
            },
        )
        .await?;
    ensure!(
        condition(&up, "DemandKnown").is_some_and(|c| c["status"] == "True"),
        "demand was not measured: {up}"
    );
    // Down: after the ramp, back to one group, one step at a time.
    let down = running
        .until(
            "back to 1 group after the ramp",
            Duration::from_secs(300),
            |s| {
                record(s, &mut timeline);
                (started.elapsed() > Duration::from_secs(120)
                    && s["replicas"]["desired"] == 1
                    && s["replicas"]["ready"] == 1)
                    .then(|| s.clone())
            },
        )
        .await?;
    stop.store(true, Ordering::Relaxed);
    let report = load.await.context("load task panicked")??;
    let events = Api::<Event>::namespaced(running.ns.admin.clone(), running.ns.name())
        .list(&ListParams::default())
        .await?;
    let scaled: Vec<String> = events
        .items
        .iter()
        .filter(|e| e.reason.as_deref() == Some("Scaled"))
        .map(|e| e.message.clone().unwrap_or_default())
        .collect();
    let slo_met = report.slo_met as f64 / report.ok.max(1) as f64;
    let summary = format!(
        "{timeline}\nrequests sent {}, ok {}, refused {}, lost {}; SLO met (E2E bound) {:.1} % of ok\npeak desired groups {peak_desired}\nScaled events:\n  {}\n",
        report.sent,
        report.ok,
        report.refused,
        report.lost,
        slo_met * 100.0,
        scaled.join("\n  ")
    );
    write_report("capacity-ramp.txt", &summary)?;
    tracing::info!("\n{summary}");
    ensure!(
        report.lost == 0,
        "{} admitted requests were lost while groups were added and drained:\n{summary}",
        report.lost
    );
    ensure!(
        peak_desired >= 3,
        "the ramp to 3 req/s never asked for 3 groups:\n{summary}"
    );
    ensure!(
        scaled.len() >= 3,
        "expected Scaled events up and (stepwise) down, got {scaled:?}"
    );
    ensure!(
        condition(&down, "ScalerConflict").is_some_and(|c| c["status"] == "False"),
        "ScalerConflict before any autoscaler exists: {down}"
    );

    // Another autoscaler aimed at the object is reported, and the count stays ours.
    let hpa: k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler = serde_json::from_value(
        json!({
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": "smollm2", "namespace": running.ns.name()},
            "spec": {
                "scaleTargetRef": {"apiVersion": "slipway.dev/v1alpha1", "kind": "InferenceService", "name": ISVC},
                "minReplicas": 2,
                "maxReplicas": 3,
            },
        }),
    )?;
    Api::<k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler>::namespaced(
        running.ns.admin.clone(),
        running.ns.name(),
    )
    .create(&Default::default(), &hpa)
    .await?;
    let conflict = running
        .until(
            "ScalerConflict naming the HPA",
            Duration::from_secs(60),
            |s| {
                condition(s, "ScalerConflict")
                    .filter(|c| c["status"] == "True")
                    .and_then(|c| c["message"].as_str())
                    .filter(|m| m.contains("HorizontalPodAutoscaler"))
                    .map(|_| s.clone())
            },
        )
        .await?;
    ensure!(
        conflict["replicas"]["desired"] == 1,
        "the group count moved with the HPA: {conflict}"
    );
    Ok(())
}
