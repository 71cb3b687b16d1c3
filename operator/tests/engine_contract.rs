//! The operator/engine contract, tested from the engine's side.
//!
//! 1. Every pod the operator renders for every sample in `manifests/samples/` runs
//!    containers the engine accepts: their arguments parse with the engine's own
//!    parser in canonical form, and no environment variable is one the engine would
//!    ignore ([`common::check_engine_contract`]; `plan_fixtures` applies the same
//!    check to every pod of every fixture).
//! 2. The CPU samples' first pod is started exactly as the kubelet would start it:
//!    the real `slipway-engine` binary (the image's entrypoint) with the container's
//!    args and env and nothing else in its environment. Only what must differ on
//!    this machine is remapped: the model path (to the real model, whose sha256 the
//!    engine verifies against the sample's), each LoRA adapter's path (to the test
//!    adapter, with its digest where the sample gives one: the engine loads and
//!    verifies adapters at start-up), and the address (loopback, a free port)
//!    instead of all the pod's addresses on 8000. Then:
//!    - its readiness path (the pod's startup probe) answers 200 within the startup
//!      probe's budget;
//!    - a chat request naming the served model answers, and another name gets 404;
//!    - SIGTERM with streams in flight finishes every stream with a finish reason,
//!      and the process exits 0 within `terminationGracePeriodSeconds − preStop`,
//!      the time the kubelet gives it after the preStop hook.
//! 3. A model whose sha256 is not the release's makes the engine exit with the
//!    contract's model-rejected code and a last line the operator reports.

mod common;

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Container, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::{Value, json};
use slipway_api::InferenceService;
use slipway_api::spec::Device;
use slipway_contract::{EngineCommand, LoraModule, NamedSha256, ServeArgs, exit};
use slipway_engine::fetch::file_sha256;
use slipway_engine::testing::{
    EngineProcess, finish_reason, lora_adapter_path, model_path, read_sse, refused,
};
use slipway_operator::observed::Observed;
use slipway_operator::plan::{Child as PlanChild, plan};

use common::{check_engine_contract, sample_json, sample_stems};

/// Streams in flight when SIGTERM arrives.
const STREAMS: usize = 4;

fn now() -> Time {
    serde_json::from_value(json!("2026-01-01T00:00:00Z")).expect("a timestamp")
}

fn sample(stem: &str) -> InferenceService {
    let value = sample_json(stem).unwrap_or_else(|e| panic!("{e}"));
    serde_json::from_value(value).unwrap_or_else(|e| panic!("{stem}: {e}"))
}

/// The pods a plan of an empty cluster applies.
fn rendered_pods(isvc: &InferenceService) -> Vec<Pod> {
    let plan = plan(isvc, &Observed::default(), &now());
    assert_eq!(plan.invalid, None, "the sample is valid");
    plan.apply
        .into_iter()
        .filter_map(|child| match child {
            PlanChild::Pod(pod) => Some(*pod),
            _ => None,
        })
        .collect()
}

#[test]
fn every_samples_pods_run_containers_the_engine_accepts() {
    let stems = sample_stems();
    assert!(stems.len() >= 3, "samples found: {stems:?}");
    let mut errors = Vec::new();
    for stem in &stems {
        let isvc = sample(stem);
        let pods = rendered_pods(&isvc);
        assert!(!pods.is_empty(), "{stem} renders pods");
        for pod in &pods {
            if let Err(e) = check_engine_contract(pod, &isvc.spec) {
                errors.push(format!("{stem}: {e}"));
            }
        }
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

/// Starts the container's command with only what this machine needs remapped.
fn start(container: &Container, serve: &ServeArgs) -> EngineProcess {
    let adapter = lora_adapter_path();
    let (adapter_sha256, _) = file_sha256(&adapter).expect("hashing the test adapter");
    let local = ServeArgs {
        model: model_path(),
        lora: serve
            .lora
            .iter()
            .map(|m| LoraModule {
                name: m.name.clone(),
                path: adapter.clone(),
            })
            .collect(),
        lora_sha256: serve
            .lora_sha256
            .iter()
            .map(|d| NamedSha256 {
                name: d.name.clone(),
                sha256: adapter_sha256,
            })
            .collect(),
        host: IpAddr::V4(Ipv4Addr::LOCALHOST),
        port: 0,
        ..serve.clone()
    };
    let mut command = EngineProcess::command(&local);
    command.env_clear();
    for var in container.env.iter().flatten() {
        command.env(&var.name, var.value.clone().unwrap_or_default());
    }
    EngineProcess::spawn_command(command)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_cpu_samples_pods_start_serve_and_drain_as_rendered() {
    let cpu_samples: Vec<String> = sample_stems()
        .into_iter()
        .filter(|stem| sample(stem).spec.release.engine.device == Device::Cpu)
        .collect();
    assert!(!cpu_samples.is_empty(), "a CPU sample exists");
    for stem in &cpu_samples {
        run_pod_as_rendered(stem).await;
    }
}

async fn run_pod_as_rendered(stem: &str) {
    let isvc = sample(stem);
    let pod = rendered_pods(&isvc).into_iter().next().expect("a pod");
    let pod_spec = pod.spec.clone().expect("a pod spec");
    let container = pod_spec
        .containers
        .iter()
        .find(|c| c.name == "engine")
        .expect("the engine container");
    let args = container.args.clone().unwrap_or_default();
    let Ok(EngineCommand::Serve(serve)) = EngineCommand::parse_args(&args) else {
        panic!("{stem}: the engine container runs `serve`: {args:?}");
    };
    let served = serve
        .served_model_name
        .clone()
        .expect("the operator names the served model");
    assert!(
        serve.model_sha256.is_some(),
        "{stem}: the CPU samples name the model's sha256, so the engine verifies it"
    );
    let startup = container.startup_probe.clone().expect("a startup probe");
    let ready_path = startup
        .http_get
        .as_ref()
        .and_then(|g| g.path.clone())
        .expect("an HTTP startup probe");
    let startup_budget = Duration::from_secs(
        u64::try_from(
            startup.period_seconds.unwrap_or(10) * startup.failure_threshold.unwrap_or(3),
        )
        .unwrap_or(0),
    );
    let grace = pod_spec
        .termination_grace_period_seconds
        .expect("a grace period");
    let pre_stop = container
        .lifecycle
        .as_ref()
        .and_then(|l| l.pre_stop.as_ref())
        .and_then(|h| h.sleep.as_ref())
        .map_or(0, |s| s.seconds);
    let after_pre_stop = Duration::from_secs(u64::try_from(grace - pre_stop).unwrap_or(0));

    let started = Instant::now();
    let mut engine = start(container, &serve);
    let client = reqwest::Client::new();
    loop {
        let ready = client.get(engine.url(&ready_path)).send().await;
        if ready.is_ok_and(|r| r.status() == 200) {
            break;
        }
        assert!(
            started.elapsed() < startup_budget,
            "{stem}: {ready_path} not 200 within the startup probe's {startup_budget:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let chat = |model: &str, max_tokens: u32, stream: bool| {
        json!({"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
               "ignore_eos": stream,
               "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    };
    let answer = client
        .post(engine.url("/v1/chat/completions"))
        .json(&chat(&served, 16, false))
        .send()
        .await
        .expect("POST chat");
    assert_eq!(answer.status(), 200, "{stem}: chat with model {served:?}");
    let answer: Value = answer.json().await.expect("a JSON answer");
    assert!(
        answer["choices"][0]["message"]["content"]
            .as_str()
            .is_some_and(|t| !t.trim().is_empty()),
        "{stem}: {answer}"
    );
    assert_eq!(answer["model"], served.as_str());
    let unknown = client
        .post(engine.url("/v1/chat/completions"))
        .json(&chat("some-other-model", 4, false))
        .send()
        .await
        .expect("POST chat");
    assert_eq!(unknown.status(), 404, "{stem}: another model name");

    // Streams in flight, then the kubelet's SIGTERM (after preStop).
    let (first_tx, mut first) = tokio::sync::mpsc::unbounded_channel();
    let mut streams = Vec::new();
    for _ in 0..STREAMS {
        let (client, url, tx) = (
            client.clone(),
            engine.url("/v1/chat/completions"),
            first_tx.clone(),
        );
        let body = chat(&served, 48, true);
        streams.push(tokio::spawn(async move {
            let response = client.post(url).json(&body).send().await.expect("POST");
            assert_eq!(response.status(), 200);
            read_sse(response, || {
                let _ = tx.send(());
            })
            .await
        }));
    }
    for _ in 0..STREAMS {
        first.recv().await.expect("every stream started");
    }
    let term = Instant::now();
    engine.sigterm();
    for (i, stream) in streams.into_iter().enumerate() {
        let events = stream.await.expect("stream task");
        assert_eq!(
            events.last().map(String::as_str),
            Some("[DONE]"),
            "{stem}: stream {i}"
        );
        assert_eq!(
            finish_reason(&events).as_deref(),
            Some("length"),
            "{stem}: stream {i} finished in full, not cut by the drain"
        );
    }
    let status = engine.exit_within(after_pre_stop).await;
    let took = term.elapsed();
    assert!(
        status.is_some_and(|s| s.success()),
        "{stem}: exit {status:?} within terminationGracePeriodSeconds {grace} − preStop {pre_stop} s (took {took:?})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_that_is_not_the_releases_is_refused_with_the_model_rejected_code() {
    let isvc = sample("smollm2-cpu");
    let pod = rendered_pods(&isvc).into_iter().next().expect("a pod");
    let container = pod.spec.expect("spec").containers.remove(0);
    let Ok(EngineCommand::Serve(serve)) =
        EngineCommand::parse_args(container.args.clone().unwrap_or_default())
    else {
        panic!("the engine container runs `serve`");
    };
    let wrong = ServeArgs {
        model_sha256: Some(slipway_contract::Sha256Digest([0x5a; 32])),
        model: model_path(),
        port: 0,
        host: IpAddr::V4(Ipv4Addr::LOCALHOST),
        ..serve
    };
    let mut command = EngineProcess::command(&wrong);
    command.env_clear();
    let (status, stderr) = refused(command);
    assert_eq!(status.code(), Some(exit::MODEL_REJECTED));
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("Error: model ") && last.contains("failed verification"),
        "the last line is the reason the operator reports: {last:?}"
    );
    assert!(
        last.contains(&"5a".repeat(32)),
        "it names the expected hash: {last}"
    );
}
