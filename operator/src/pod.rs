//! Renders one engine pod of one group.
//!
//! Why pods managed directly rather than a StatefulSet per group: a group is the
//! failure unit, so when one rank dies every rank must be recreated together, with the
//! operator's bounded restarts and backoff. A StatefulSet would recreate only the one
//! pod (and restart containers in place), fighting that rule; its ordered rollout and
//! PVC templates buy nothing here. Pods give the group the same stable DNS names
//! (`hostname` + `subdomain` under the group's headless Service) and leave every
//! restart decision in [`crate::plan()`]. Pods run with `restartPolicy: Never` for the
//! same reason: a crashed rank makes its pod `Failed`, and the operator recreates the
//! group.
//!
//! Invariants: the pod's grace period, preStop sleep and the engine's
//! `--shutdown-timeout-ms` all come from one [`slipway_api::drain::DrainBudget`]; the
//! security context is the "restricted" Pod Security Standard; every pod carries the
//! release short hash and its group and rank as labels.
//!
//! The containers' arguments are [`slipway_contract::EngineCommand`] values rendered
//! with `to_args`, never string literals: the engine parses them with the same type.
//! A pod whose process is exactly one rank of a group of several (every pod of a
//! multi-rank CPU group, see [`crate::groups`]) is told its place with the contract's
//! [`GroupArgs`]: `--tensor-parallel`, `--pipeline-parallel`, `--rank` and
//! `--leader-address`, the leader pod's stable DNS name under the group's headless
//! Service with [`GROUP_PORT`], declared on the leader's container as
//! [`GROUP_PORT_NAME`]. The operator owns these flags: `release.engine.args` may not
//! set them ([`serve_args`]). The timeouts (`--rendezvous-timeout-ms`,
//! `--step-timeout-ms`) are tuning the spec derives nothing for, so the user's
//! `release.engine.args` may set them; otherwise they keep the engine's defaults.
//! The operator sets no environment variable of its own (the engine reads none that
//! the operator would set); only the user's `env` is passed.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, Capabilities, Container, ContainerPort, EmptyDirVolumeSource, EnvVar, HTTPGetAction,
    Lifecycle, LifecycleHandler, PersistentVolumeClaimVolumeSource, Pod, PodAffinity,
    PodAffinityTerm, PodSecurityContext, PodSpec, Probe, ResourceRequirements, SeccompProfile,
    SecurityContext, SleepAction, TopologySpreadConstraint, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use sha2::{Digest, Sha256};
use slipway_api::drain::DrainBudget;
use slipway_api::duration;
use slipway_api::spec::{Device, InferenceServiceSpec};
use slipway_contract::{
    DeviceChoice, ENGINE_PORT, EngineCommand, FetchArgs, GROUP_PORT, GROUP_PORT_NAME, GroupArgs,
    HostPort, LogArgs, LogFormat, LoraModule, NamedSha256, ServeArgs, TelemetryArgs, paths,
};

use crate::groups::PodShape;
use crate::labels;
use crate::model::{BundleStaging, Source};
use crate::spec_error::SpecError;
use crate::types::Context;

/// Kubelet copies the tail of a failed container's log into its termination message
/// when the container wrote none, so the engine's `Error: ...` line reaches the
/// pod's status, where [`crate::observed`] reads it.
pub(crate) const TERMINATION_MESSAGE_POLICY: &str = "FallbackToLogsOnError";
/// UID/GID of the distroless "nonroot" user; any non-zero id satisfies the policy.
const NON_ROOT_ID: i64 = 65532;
/// Startup probe: 180 × 10 s = 30 min to stage and load a model before the kubelet
/// gives up (the pod then fails and its group is recreated with backoff).
const STARTUP_PERIOD_SECONDS: i32 = 10;
const STARTUP_FAILURE_THRESHOLD: i32 = 180;

/// The pod for `shape` in `group`, and the hash that identifies its content.
pub fn render(ctx: &Context<'_>, group: u32, shape: &PodShape) -> (Pod, String) {
    let name = labels::pod(ctx.name, group, shape.rank);
    let mut pod_labels = labels::group_selector(ctx.name, group);
    pod_labels.insert(labels::RANK.to_owned(), shape.rank.to_string());
    pod_labels.insert(labels::RELEASE.to_owned(), ctx.release.to_owned());
    pod_labels.insert(labels::NAME.to_owned(), "slipway-engine".to_owned());
    pod_labels.insert(labels::PART_OF.to_owned(), "slipway".to_owned());

    let spec = pod_spec(ctx, group, shape);
    // Hash what the pod runs and how it is labelled: a change to either needs a new pod.
    let hash = {
        let content = serde_json::json!({ "labels": &pod_labels, "spec": &spec });
        let digest = Sha256::digest(content.to_string().as_bytes());
        hex::encode(&digest[..8])
    };
    let pod = Pod {
        metadata: ObjectMeta {
            name: Some(name),
            namespace: Some(ctx.namespace.to_owned()),
            labels: Some(pod_labels),
            annotations: Some(BTreeMap::from([(
                labels::TEMPLATE_HASH.to_owned(),
                hash.clone(),
            )])),
            owner_references: Some(vec![ctx.owner.clone()]),
            ..ObjectMeta::default()
        },
        spec: Some(spec),
        status: None,
    };
    (pod, hash)
}

fn pod_spec(ctx: &Context<'_>, group: u32, shape: &PodShape) -> PodSpec {
    let spec = ctx.spec;
    let overrides = spec.pod_template.clone().unwrap_or_default();
    let mut volumes = vec![Volume {
        name: "scratch".to_owned(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Volume::default()
    }];
    let mut mounts = vec![VolumeMount {
        name: "scratch".to_owned(),
        mount_path: "/tmp".to_owned(),
        ..VolumeMount::default()
    }];
    let mut init_containers = Vec::new();
    for artifact in ctx.staging.artifacts() {
        let mount = |read_only: bool| VolumeMount {
            name: artifact.volume.clone(),
            mount_path: artifact.dir.clone(),
            read_only: Some(read_only),
            ..VolumeMount::default()
        };
        match &artifact.source {
            Source::Path(_) => {}
            Source::Claim { claim, .. } => {
                volumes.push(Volume {
                    name: artifact.volume.clone(),
                    persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                        claim_name: claim.clone(),
                        read_only: Some(true),
                    }),
                    ..Volume::default()
                });
                mounts.push(mount(true));
            }
            Source::Fetch { url, sha256 } => {
                volumes.push(Volume {
                    name: artifact.volume.clone(),
                    empty_dir: Some(EmptyDirVolumeSource::default()),
                    ..Volume::default()
                });
                let fetch = FetchArgs {
                    logs: LogArgs {
                        log_format: Some(LogFormat::Json),
                    },
                    ..FetchArgs::new(url.clone(), *sha256, artifact.engine_path())
                };
                init_containers.push(Container {
                    name: format!("fetch-{}", artifact.volume),
                    image: Some(spec.release.engine.image.clone()),
                    args: Some(EngineCommand::Fetch(fetch).to_args()),
                    volume_mounts: Some(vec![mount(false), mounts[0].clone()]),
                    security_context: Some(container_security_context()),
                    termination_message_policy: Some(TERMINATION_MESSAGE_POLICY.to_owned()),
                    ..Container::default()
                });
                mounts.push(mount(true));
            }
        }
    }

    let mut resources = spec.release.engine.resources.clone().unwrap_or_default();
    if spec.release.engine.device == Device::Cuda {
        let gpus = Quantity(shape.gpus.to_string());
        resources
            .limits
            .get_or_insert_with(BTreeMap::new)
            .insert("nvidia.com/gpu".to_owned(), gpus.clone());
        resources
            .requests
            .get_or_insert_with(BTreeMap::new)
            .insert("nvidia.com/gpu".to_owned(), gpus);
    }

    let http = |path: &str| HTTPGetAction {
        path: Some(path.to_owned()),
        port: IntOrString::String("http".to_owned()),
        ..HTTPGetAction::default()
    };
    let probe = |path: &str, period: i32, failures: i32| Probe {
        http_get: Some(http(path)),
        period_seconds: Some(period),
        failure_threshold: Some(failures),
        ..Probe::default()
    };

    let env: Vec<EnvVar> = spec
        .release
        .engine
        .env
        .iter()
        .chain(&overrides.env)
        .cloned()
        .collect();
    let serve = ServeArgs {
        group: group_args(ctx, group, shape),
        ..ctx.serve.clone()
    };
    let mut ports = vec![ContainerPort {
        name: Some("http".to_owned()),
        container_port: i32::from(ctx.serve.port),
        protocol: Some("TCP".to_owned()),
        ..ContainerPort::default()
    }];
    // Only the leader's port is fixed; the other ranks listen where the leader tells
    // its peers at rendezvous.
    if serve.group.rank == 0 && !serve.group.is_single_process() {
        ports.push(ContainerPort {
            name: Some(GROUP_PORT_NAME.to_owned()),
            container_port: i32::from(GROUP_PORT),
            protocol: Some("TCP".to_owned()),
            ..ContainerPort::default()
        });
    }
    let engine = Container {
        name: "engine".to_owned(),
        image: Some(spec.release.engine.image.clone()),
        args: Some(EngineCommand::Serve(serve).to_args()),
        env: (!env.is_empty()).then_some(env),
        ports: Some(ports),
        resources: Some(ResourceRequirements {
            claims: None,
            ..resources
        }),
        // Loading a model can take minutes; liveness only starts once it is ready.
        startup_probe: Some(probe(
            paths::READY,
            STARTUP_PERIOD_SECONDS,
            STARTUP_FAILURE_THRESHOLD,
        )),
        readiness_probe: Some(probe(paths::READY, 5, 2)),
        liveness_probe: Some(probe(paths::HEALTH, 10, 3)),
        // The engine's last line on failure is `Error: <why>` (a model that failed
        // verification, a bad flag): it becomes the termination message the operator
        // reports.
        termination_message_policy: Some(TERMINATION_MESSAGE_POLICY.to_owned()),
        lifecycle: pre_stop(&ctx.drain),
        security_context: Some(container_security_context()),
        volume_mounts: Some(mounts),
        ..Container::default()
    };

    let group_labels = labels::group_selector(ctx.name, group);
    let affinity = (ctx.shape.pods.len() > 1).then(|| Affinity {
        pod_affinity: Some(PodAffinity {
            required_during_scheduling_ignored_during_execution: Some(vec![PodAffinityTerm {
                label_selector: Some(LabelSelector {
                    match_labels: Some(group_labels.clone()),
                    ..LabelSelector::default()
                }),
                topology_key: spec.parallelism.colocation_topology_key.clone(),
                ..PodAffinityTerm::default()
            }]),
            ..PodAffinity::default()
        }),
        ..Affinity::default()
    });
    // Groups are spread by their leaders; workers follow their leader by affinity.
    let spread = (shape.rank == 0).then(|| {
        let mut leaders = labels::engine_selector(ctx.name);
        leaders.insert(labels::RANK.to_owned(), "0".to_owned());
        vec![TopologySpreadConstraint {
            max_skew: 1,
            topology_key: spec.capacity.fault_domain.topology_key.clone(),
            when_unsatisfiable: "DoNotSchedule".to_owned(),
            label_selector: Some(LabelSelector {
                match_labels: Some(leaders),
                ..LabelSelector::default()
            }),
            // A lost (tainted, NotReady) domain must not block placing groups elsewhere.
            node_taints_policy: Some("Honor".to_owned()),
            ..TopologySpreadConstraint::default()
        }]
    });

    PodSpec {
        hostname: Some(labels::pod(ctx.name, group, shape.rank)),
        subdomain: Some(labels::group_service(ctx.name, group)),
        restart_policy: Some("Never".to_owned()),
        termination_grace_period_seconds: Some(
            i64::try_from(ctx.drain.termination_grace_period_seconds).unwrap_or(i64::MAX),
        ),
        automount_service_account_token: Some(false),
        enable_service_links: Some(false),
        security_context: Some(pod_security_context()),
        init_containers: (!init_containers.is_empty()).then_some(init_containers),
        containers: vec![engine],
        volumes: Some(volumes),
        affinity,
        topology_spread_constraints: spread,
        node_selector: (!overrides.node_selector.is_empty()).then_some(overrides.node_selector),
        tolerations: (!overrides.tolerations.is_empty()).then_some(overrides.tolerations),
        service_account_name: overrides.service_account_name,
        priority_class_name: overrides.priority_class_name,
        ..PodSpec::default()
    }
}

/// The group flags of the pod `shape` of `group`: its place in the group when its
/// process is exactly one rank of a group of several, else none (the user's timeouts,
/// which a single process ignores, are kept either way).
///
/// A CUDA pod holding several GPUs of a multi-rank group gets no group flags: its one
/// process would have to drive one rank per GPU, which comes with the NCCL transport.
/// Until then it runs as it always did, and nothing on its command line claims a
/// group that does not form.
fn group_args(ctx: &Context<'_>, group: u32, shape: &PodShape) -> GroupArgs {
    let tuning = ctx.serve.group.clone();
    let Some(rank) = ctx.shape.engine_rank(shape) else {
        return tuning;
    };
    GroupArgs {
        tensor_parallel: ctx.shape.tensor,
        pipeline_parallel: ctx.shape.pipeline,
        rank,
        // Kubernetes names never hold what a host may not (':', '/', spaces), so this
        // is always an address; were it not, the engine would refuse to start naming
        // the missing --leader-address, rather than run alone.
        leader_address: HostPort::new(
            labels::leader_host(ctx.name, ctx.namespace, group),
            GROUP_PORT,
        )
        .ok(),
        ..tuning
    }
}

/// The preStop hook of a drain budget: a sleep while endpoint removal propagates, so
/// no new request arrives once the process stops admitting. None when the delay is 0.
pub(crate) fn pre_stop(drain: &DrainBudget) -> Option<Lifecycle> {
    (drain.pre_stop_delay_seconds > 0).then(|| Lifecycle {
        pre_stop: Some(LifecycleHandler {
            // A sleep action needs no shell in the image (both images are static).
            sleep: Some(SleepAction {
                seconds: i64::try_from(drain.pre_stop_delay_seconds).unwrap_or(i64::MAX),
            }),
            ..LifecycleHandler::default()
        }),
        ..Lifecycle::default()
    })
}

/// The "restricted" Pod Security Standard at pod level, as the non-root user the
/// images run as (the router's pods share it).
pub(crate) fn pod_security_context() -> PodSecurityContext {
    PodSecurityContext {
        run_as_non_root: Some(true),
        run_as_user: Some(NON_ROOT_ID),
        run_as_group: Some(NON_ROOT_ID),
        fs_group: Some(NON_ROOT_ID),
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".to_owned(),
            ..SeccompProfile::default()
        }),
        ..PodSecurityContext::default()
    }
}

/// The "restricted" Pod Security Standard for one container: no privilege, no
/// capability, a read-only root filesystem.
pub(crate) fn container_security_context() -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        privileged: Some(false),
        read_only_root_filesystem: Some(true),
        run_as_non_root: Some(true),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".to_owned()]),
            ..Capabilities::default()
        }),
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".to_owned(),
            ..SeccompProfile::default()
        }),
        ..SecurityContext::default()
    }
}

/// The engine's `serve` arguments for one release: what the operator decides from the
/// InferenceService, then the user's `release.engine.args` on top.
///
/// # Errors
/// [`SpecError`]: an argument the engine would reject, one that overrides a value
/// the operator owns (the drain budget, probes and metrics labels depend on those),
/// or any group flag but the timeouts (each pod's place in its group is the
/// operator's, whatever the value).
/// The sha256s, SLO thresholds and `maxOutputTokens` are checked again as the engine
/// reads them.
pub fn serve_args(
    name: &str,
    spec: &InferenceServiceSpec,
    release: &str,
    kv_namespace: &str,
    staging: &BundleStaging,
    drain: &DrainBudget,
    otlp_endpoint: Option<&str>,
) -> Result<ServeArgs, SpecError> {
    let engine = &spec.release.engine;
    let release_bundle = &spec.release;
    let defaults = ServeArgs::for_model(staging.model.engine_path())
        .map_err(|e| SpecError::ModelPathRejected(first_line(&e)))?;
    let sha256 = |field: String, hex: &str| {
        hex.parse()
            .map_err(|error| SpecError::ArtifactSha256Invalid { field, error })
    };
    let slo = |field: &'static str, threshold: &str| {
        duration::parse(threshold).map_err(|error| SpecError::SloThreshold { field, error })
    };
    let decided = ServeArgs {
        model_sha256: spec
            .release
            .model
            .sha256
            .as_deref()
            .map(|hex| sha256("release.model".to_owned(), hex))
            .transpose()?,
        tokenizer: staging.tokenizer.as_ref().map(|t| t.engine_path().into()),
        tokenizer_sha256: release_bundle
            .tokenizer
            .as_ref()
            .and_then(|t| t.sha256.as_deref())
            .map(|hex| sha256("release.tokenizer".to_owned(), hex))
            .transpose()?,
        chat_template: release_bundle.chat_template.clone(),
        lora: staging
            .adapters
            .iter()
            .map(|(name, artifact)| LoraModule {
                name: name.clone(),
                path: artifact.engine_path().into(),
            })
            .collect(),
        lora_sha256: release_bundle
            .adapters
            .iter()
            .enumerate()
            .filter_map(|(i, a)| {
                a.sha256.as_deref().map(|hex| {
                    sha256(format!("release.adapters[{i}]"), hex).map(|sha256| NamedSha256 {
                        name: a.name.clone(),
                        sha256,
                    })
                })
            })
            .collect::<Result<_, _>>()?,
        // All addresses of the pod's own network namespace: the pod IP the kubelet
        // probes and the Services target, and loopback for `kubectl port-forward`.
        // The namespace has no other interface, so this exposes nothing more; binding
        // the pod IP itself would need it passed in through the downward API and would
        // break port-forward.
        host: IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        port: ENGINE_PORT,
        served_model_name: Some(
            spec.served_model_name
                .clone()
                .unwrap_or_else(|| name.to_owned()),
        ),
        release: release.to_owned(),
        kv_namespace: kv_namespace.to_owned(),
        slo_ttft: slo("slo.ttft", &spec.slo.ttft.threshold)?,
        slo_tpot: slo("slo.tpot", &spec.slo.tpot.threshold)?,
        max_output_tokens: u32::try_from(engine.max_output_tokens)
            .map_err(|_| SpecError::MaxOutputTokensNotPositive)?,
        shutdown_timeout: Duration::from_secs(drain.engine_shutdown_seconds),
        // `auto` is for people; a pod holding GPUs must never fall back to the CPU.
        device: match engine.device {
            Device::Cpu => DeviceChoice::Cpu,
            Device::Cuda => DeviceChoice::Cuda,
        },
        // JSON lines for the cluster's log collector; the user's args may still
        // choose text, or send one service's traces elsewhere.
        telemetry: TelemetryArgs {
            logs: LogArgs {
                log_format: Some(LogFormat::Json),
            },
            otlp_endpoint: otlp_endpoint.map(str::to_owned),
            ..defaults.telemetry.clone()
        },
        ..defaults
    };
    let merged = decided
        .with_extra_args(&engine.args)
        .map_err(|e| SpecError::EngineArgsRejected(first_line(&e)))?;
    let mut overridden = owned_flags(&decided, &merged);
    // The group flags are set per pod after this merge, so a user's value would be
    // lost without a word even when it repeats a default: any mention is refused.
    let given = ServeArgs::flags_in(&engine.args)
        .map_err(|e| SpecError::EngineArgsRejected(first_line(&e)))?;
    overridden.extend(
        GROUP_FLAGS
            .into_iter()
            .filter(|(flag, _)| given.iter().any(|g| flag.strip_prefix("--") == Some(g))),
    );
    if !overridden.is_empty() {
        return Err(SpecError::EngineArgsOverrideOperator { flags: overridden });
    }
    Ok(merged)
}

/// The group flags the operator renders per pod ([`group_args`]), each with what the
/// user changes instead.
const GROUP_FLAGS: [(&str, &str); 4] = [
    ("--tensor-parallel", "parallelism.tensor"),
    ("--pipeline-parallel", "parallelism.pipeline"),
    ("--rank", "the pod's place in its group"),
    ("--leader-address", "the group's headless Service"),
];

/// The flags the operator owns that differ between `decided` and `merged`, each with
/// the field a user changes instead.
fn owned_flags(decided: &ServeArgs, merged: &ServeArgs) -> Vec<(&'static str, &'static str)> {
    let owned: [(&str, &str, bool); 17] = [
        (
            "--model",
            "release.model.uri",
            decided.model != merged.model,
        ),
        (
            "--model-sha256",
            "release.model.sha256",
            decided.model_sha256 != merged.model_sha256,
        ),
        (
            "--tokenizer",
            "release.tokenizer.uri",
            decided.tokenizer != merged.tokenizer,
        ),
        (
            "--tokenizer-sha256",
            "release.tokenizer.sha256",
            decided.tokenizer_sha256 != merged.tokenizer_sha256,
        ),
        (
            "--chat-template",
            "release.chatTemplate",
            decided.chat_template != merged.chat_template,
        ),
        ("--lora", "release.adapters", decided.lora != merged.lora),
        (
            "--lora-sha256",
            "release.adapters[].sha256",
            decided.lora_sha256 != merged.lora_sha256,
        ),
        ("--host", "the pod's network", decided.host != merged.host),
        ("--port", "the pod's port", decided.port != merged.port),
        (
            "--served-model-name",
            "spec.servedModelName",
            decided.served_model_name != merged.served_model_name,
        ),
        (
            "--release",
            "the release hash",
            decided.release != merged.release,
        ),
        (
            "--kv-namespace",
            "release.kvNamespace",
            decided.kv_namespace != merged.kv_namespace,
        ),
        (
            "--slo-ttft-ms",
            "slo.ttft",
            decided.slo_ttft != merged.slo_ttft,
        ),
        (
            "--slo-tpot-ms",
            "slo.tpot",
            decided.slo_tpot != merged.slo_tpot,
        ),
        (
            "--max-output-tokens",
            "release.engine.maxOutputTokens",
            decided.max_output_tokens != merged.max_output_tokens,
        ),
        (
            "--shutdown-timeout-ms",
            "the drain budget",
            decided.shutdown_timeout != merged.shutdown_timeout,
        ),
        (
            "--device",
            "release.engine.device",
            decided.device != merged.device,
        ),
    ];
    owned
        .into_iter()
        .filter(|(_, _, changed)| *changed)
        .map(|(flag, from, _)| (flag, from))
        .collect()
}

/// clap's message without its usage block.
pub(crate) fn first_line(error: &clap::Error) -> String {
    let text = error.to_string();
    let line = text.lines().next().unwrap_or_default();
    line.strip_prefix("error: ").unwrap_or(line).to_owned()
}
