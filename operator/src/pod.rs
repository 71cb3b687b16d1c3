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
//! `--shutdown-timeout` all come from one [`slipway_api::drain::DrainBudget`]; the
//! security context is the "restricted" Pod Security Standard; every pod carries the
//! release short hash and its group and rank as labels.

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
use sha2::{Digest, Sha256};
use slipway_api::spec::Device;

use crate::groups::PodShape;
use crate::labels;
use crate::plan::Context;

/// Where the model volume is mounted in the engine container.
const MODEL_DIR: &str = "/models";
/// UID/GID of the distroless "nonroot" user; any non-zero id satisfies the policy.
const NON_ROOT_ID: i64 = 65532;
/// Startup probe: 180 × 10 s = 30 min to stage and load a model before the kubelet
/// gives up (the pod then fails and its group is recreated with backoff).
const STARTUP_PERIOD_SECONDS: i32 = 10;
const STARTUP_FAILURE_THRESHOLD: i32 = 180;

/// Where the engine finds the model, and what stages it there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelStaging {
    /// A path inside the image (or a volume the user mounts by other means).
    Path(String),
    /// `pvc://<claim>/<path>`: the claim is mounted read-only.
    Claim { claim: String, path: String },
    /// `https://…`: an init container fetches and verifies it into an emptyDir.
    Fetch { url: String, sha256: String },
}

impl ModelStaging {
    /// Reads a model URI.
    ///
    /// # Errors
    /// A sentence for the `Ready=False` condition when the URI has no usable form.
    pub fn parse(uri: &str, sha256: Option<&str>) -> Result<Self, String> {
        if let Some(rest) = uri.strip_prefix("pvc://") {
            return match rest.split_once('/') {
                Some((claim, path)) if !claim.is_empty() && !path.is_empty() => Ok(Self::Claim {
                    claim: claim.to_owned(),
                    path: path.to_owned(),
                }),
                _ => Err(format!("model uri {uri:?}: expected pvc://<claim>/<path>")),
            };
        }
        if uri.starts_with("https://") || uri.starts_with("http://") {
            let sha256 = sha256.ok_or_else(|| {
                format!("model uri {uri:?} is fetched over the network, so release.model.sha256 is required to verify it")
            })?;
            return Ok(Self::Fetch {
                url: uri.to_owned(),
                sha256: sha256.to_owned(),
            });
        }
        let path = uri.strip_prefix("file://").unwrap_or(uri);
        if path.starts_with('/') {
            Ok(Self::Path(path.to_owned()))
        } else {
            Err(format!(
                "model uri {uri:?}: expected an absolute path, file://, pvc:// or https://"
            ))
        }
    }

    /// The path the engine opens.
    pub fn engine_path(&self) -> String {
        match self {
            Self::Path(path) => path.clone(),
            Self::Claim { path, .. } => format!("{MODEL_DIR}/{path}"),
            Self::Fetch { .. } => format!("{MODEL_DIR}/model.gguf"),
        }
    }
}

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
    match &ctx.model {
        ModelStaging::Path(_) => {}
        ModelStaging::Claim { claim, .. } => {
            volumes.push(Volume {
                name: "model".to_owned(),
                persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                    claim_name: claim.clone(),
                    read_only: Some(true),
                }),
                ..Volume::default()
            });
            mounts.push(model_mount(true));
        }
        ModelStaging::Fetch { url, sha256 } => {
            volumes.push(Volume {
                name: "model".to_owned(),
                empty_dir: Some(EmptyDirVolumeSource::default()),
                ..Volume::default()
            });
            init_containers.push(Container {
                name: "fetch-model".to_owned(),
                image: Some(spec.release.engine.image.clone()),
                args: Some(vec![
                    "fetch".to_owned(),
                    url.clone(),
                    "--sha256".to_owned(),
                    sha256.clone(),
                    "--dest".to_owned(),
                    ctx.model.engine_path(),
                ]),
                volume_mounts: Some(vec![model_mount(false), mounts[0].clone()]),
                security_context: Some(container_security_context()),
                ..Container::default()
            });
            mounts.push(model_mount(true));
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

    let engine = Container {
        name: "engine".to_owned(),
        image: Some(spec.release.engine.image.clone()),
        args: Some(engine_args(ctx, group, shape)),
        env: Some(engine_env(ctx, group, shape, overrides.env.clone())),
        ports: Some(vec![ContainerPort {
            name: Some("http".to_owned()),
            container_port: labels::ENGINE_PORT,
            protocol: Some("TCP".to_owned()),
            ..ContainerPort::default()
        }]),
        resources: Some(ResourceRequirements {
            claims: None,
            ..resources
        }),
        // Loading a model can take minutes; liveness only starts once it is ready.
        startup_probe: Some(probe(
            "/ready",
            STARTUP_PERIOD_SECONDS,
            STARTUP_FAILURE_THRESHOLD,
        )),
        readiness_probe: Some(probe("/ready", 5, 2)),
        liveness_probe: Some(probe("/health", 10, 3)),
        lifecycle: (ctx.drain.pre_stop_delay_seconds > 0).then(|| Lifecycle {
            pre_stop: Some(LifecycleHandler {
                // A sleep action needs no shell in the image (the engine image is static).
                sleep: Some(SleepAction {
                    seconds: i64::try_from(ctx.drain.pre_stop_delay_seconds).unwrap_or(i64::MAX),
                }),
                ..LifecycleHandler::default()
            }),
            ..Lifecycle::default()
        }),
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
        security_context: Some(PodSecurityContext {
            run_as_non_root: Some(true),
            run_as_user: Some(NON_ROOT_ID),
            run_as_group: Some(NON_ROOT_ID),
            fs_group: Some(NON_ROOT_ID),
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".to_owned(),
                ..SeccompProfile::default()
            }),
            ..PodSecurityContext::default()
        }),
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

fn model_mount(read_only: bool) -> VolumeMount {
    VolumeMount {
        name: "model".to_owned(),
        mount_path: MODEL_DIR.to_owned(),
        read_only: Some(read_only),
        ..VolumeMount::default()
    }
}

fn container_security_context() -> SecurityContext {
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

/// `slipway-engine serve` arguments that tie the engine to its release, SLO, drain
/// budget and place in the group; the user's own arguments come last.
fn engine_args(ctx: &Context<'_>, group: u32, shape: &PodShape) -> Vec<String> {
    let mut args = vec![
        "serve".to_owned(),
        "--model".to_owned(),
        ctx.model.engine_path(),
        "--port".to_owned(),
        labels::ENGINE_PORT.to_string(),
        "--release".to_owned(),
        ctx.release.to_owned(),
        "--kv-namespace".to_owned(),
        ctx.kv_namespace.clone(),
        "--slo-ttft-ms".to_owned(),
        ctx.slo_ttft_ms.to_string(),
        "--slo-tpot-ms".to_owned(),
        ctx.slo_tpot_ms.to_string(),
        "--max-output-tokens".to_owned(),
        ctx.spec.release.engine.max_output_tokens.to_string(),
        "--shutdown-timeout".to_owned(),
        format!("{}s", ctx.drain.engine_shutdown_seconds),
        "--group-index".to_owned(),
        group.to_string(),
        "--rank".to_owned(),
        shape.rank.to_string(),
        "--world-size".to_owned(),
        ctx.shape.world_size().to_string(),
    ];
    args.extend(ctx.spec.release.engine.args.iter().cloned());
    args
}

fn engine_env(ctx: &Context<'_>, group: u32, shape: &PodShape, extra: Vec<EnvVar>) -> Vec<EnvVar> {
    let var = |name: &str, value: String| EnvVar {
        name: name.to_owned(),
        value: Some(value),
        value_from: None,
    };
    let mut env = vec![
        var("SLIPWAY_GROUP_INDEX", group.to_string()),
        var("SLIPWAY_RANK", shape.rank.to_string()),
        var("SLIPWAY_WORLD_SIZE", ctx.shape.world_size().to_string()),
        var(
            "SLIPWAY_LEADER_ADDR",
            format!(
                "{}:{}",
                labels::leader_host(ctx.name, ctx.namespace, group),
                labels::ENGINE_PORT
            ),
        ),
        var("SLIPWAY_TENSOR_PARALLEL", ctx.shape.tensor.to_string()),
        var("SLIPWAY_PIPELINE_PARALLEL", ctx.shape.pipeline.to_string()),
        var("SLIPWAY_FIRST_STAGE", shape.first_stage.to_string()),
        var("SLIPWAY_STAGE_COUNT", shape.stage_count.to_string()),
        var("SLIPWAY_RELEASE", ctx.release.to_owned()),
    ];
    env.extend(ctx.spec.release.engine.env.iter().cloned());
    env.extend(extra);
    env
}
