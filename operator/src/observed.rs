//! What the cluster shows about one InferenceService, as plain data.
//!
//! `observe` (in [`crate::reconcile`]) lists the children and nodes and converts them
//! with the functions here; [`crate::plan()`] reads only these types, so the YAML
//! fixtures of the plan tests can state a cluster in a few lines.
//!
//! Invariant: conversion never fails. A child whose labels cannot be read (no group
//! or rank) is reported as `unparsed` and deleted as an orphan, never guessed at.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{ContainerStateTerminated, Node, Pod, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde::{Deserialize, Serialize};

use crate::labels;

/// Everything `plan` needs to know about the cluster.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Observed {
    /// Engine pods of this InferenceService.
    #[serde(default)]
    pub pods: Vec<ObservedPod>,
    /// Headless group Services: the restart record of each group.
    #[serde(default)]
    pub groups: Vec<GroupRecord>,
    /// Names of the per-release Services that exist.
    #[serde(default)]
    pub release_services: BTreeSet<String>,
    /// Nodes by name.
    #[serde(default)]
    pub nodes: BTreeMap<String, ObservedNode>,
    /// Leader pods listed as ready endpoints of a per-release Service: the router
    /// sends them requests.
    #[serde(default)]
    pub serving_pods: BTreeSet<String>,
    /// Children carrying our labels whose group or rank cannot be read: deleted.
    #[serde(default)]
    pub unparsed_pods: Vec<String>,
    /// The router's pods (its Deployment owns them; the plan never deletes them): what
    /// the rollout's `Router` metrics source scrapes.
    #[serde(default)]
    pub router_pods: Vec<RouterPod>,
    /// Release bundles by short hash, as their per-release Services keep them: how the
    /// stable release is rendered again after the spec moved on to a canary.
    #[serde(default)]
    pub release_bundles: BTreeMap<String, slipway_api::spec::ReleaseBundle>,
    /// The rollout analysis reading, when a rollout is in progress.
    #[serde(default)]
    pub metrics: Option<crate::rollout::analysis::MetricsReading>,
    /// The measured-demand reading (`capacity.demand.measured` only).
    #[serde(default)]
    pub demand: Option<crate::demand::DemandReading>,
    /// Other autoscalers that target this InferenceService, as "Kind namespace/name".
    #[serde(default)]
    pub external_scalers: Vec<String>,
    /// Not read from the cluster: the operator's own `--otlp-endpoint`, where the
    /// engine pods it renders export request traces.
    #[serde(default)]
    pub engine_otlp_endpoint: Option<String>,
    /// Not read from the cluster: the operator's `--router-image`; `None` is
    /// [`slipway_contract::operator::DEFAULT_ROUTER_IMAGE`].
    #[serde(default)]
    pub router_image: Option<String>,
    /// Children other than pods and Services that carry the instance labels, by kind:
    /// whichever the plan no longer renders is deleted.
    #[serde(default)]
    pub labelled: BTreeMap<LabelledKind, BTreeSet<String>>,
    /// The cluster serves no `gateway.networking.k8s.io/v1` HTTPRoute (its CRD is not
    /// installed): `spec.router.httpRoute` cannot be honoured, and nothing else waits.
    #[serde(default)]
    pub http_route_crd_missing: bool,
}

/// Kinds of children found by label and deleted when the plan drops them (pods and
/// Services have rules of their own in `plan`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum LabelledKind {
    Deployment,
    ServiceAccount,
    Role,
    RoleBinding,
    PodDisruptionBudget,
    #[serde(rename = "HTTPRoute")]
    HttpRoute,
}

/// The pod phase, as far as groups care.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum Phase {
    #[default]
    Pending,
    Running,
    Succeeded,
    Failed,
    Unknown,
}

/// One router pod.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RouterPod {
    pub name: String,
    pub uid: Option<String>,
    pub ip: Option<String>,
    pub ready: bool,
}

/// Sorts the pods listed by the instance selector into engine pods, router pods and
/// unparsed children (deleted as orphans). The router's pods carry the instance labels
/// too, but no group: its Deployment owns them, and they are never orphans.
pub fn sort_pods(pods: &[Pod], observed: &mut Observed) {
    for pod in pods {
        if let Some(router) = router_pod_from(pod) {
            observed.router_pods.push(router);
        } else if let Some(engine) = pod_from(pod) {
            observed.pods.push(engine);
        } else {
            observed
                .unparsed_pods
                .push(pod.metadata.name.clone().unwrap_or_default());
        }
    }
}

/// The router pod `pod` is, if it is one (its `app.kubernetes.io/component`).
pub fn router_pod_from(pod: &Pod) -> Option<RouterPod> {
    let meta = &pod.metadata;
    let is_router = meta
        .labels
        .as_ref()
        .and_then(|l| l.get(labels::COMPONENT))
        .is_some_and(|c| c == labels::ROUTER_COMPONENT);
    if !is_router {
        return None;
    }
    let status = pod.status.as_ref();
    Some(RouterPod {
        name: meta.name.clone()?,
        uid: meta.uid.clone(),
        ip: status.and_then(|s| s.pod_ip.clone()),
        ready: status
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True")),
    })
}

/// One engine pod.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ObservedPod {
    pub name: String,
    /// `metadata.uid`: who the pod is. Names are reused when a group is recreated, so
    /// anything remembered about a pod across reconciles is keyed by this.
    #[serde(default)]
    pub uid: Option<String>,
    pub group: u32,
    pub rank: u32,
    /// `slipway.dev/template-hash`; `None` (no annotation) counts as outdated.
    #[serde(default)]
    pub template_hash: Option<String>,
    #[serde(default)]
    pub release: String,
    #[serde(default)]
    pub phase: Phase,
    /// The pod's `Ready` condition.
    #[serde(default)]
    pub ready: bool,
    #[serde(default)]
    pub node: Option<String>,
    /// Has a deletionTimestamp.
    #[serde(default)]
    pub terminating: bool,
    /// Why it is not ready, when the pod says (a waiting or terminated reason).
    #[serde(default)]
    pub problem: Option<String>,
    /// `status.podIP`: where the `Scrape` metrics source reads `/metrics`.
    #[serde(default)]
    pub ip: Option<String>,
    /// `metadata.creationTimestamp`.
    #[serde(default)]
    pub created: Option<Time>,
    /// When its `Ready` condition last turned True (while it is True).
    #[serde(default)]
    pub ready_since: Option<Time>,
}

/// A node, as fault domains see it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct ObservedNode {
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// The node's `Ready` condition.
    #[serde(default)]
    pub ready: bool,
    /// Cordoned (`spec.unschedulable`): no new pod lands there.
    #[serde(default)]
    pub unschedulable: bool,
    /// The node's taints; which of them keep our pods off is [`crate::placement`]'s call.
    #[serde(default)]
    pub taints: Vec<NodeTaint>,
}

/// One node taint, as the scheduler matches it against tolerations.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct NodeTaint {
    pub key: String,
    #[serde(default)]
    pub value: Option<String>,
    pub effect: String,
}

/// A group's restart record, kept in annotations of its headless Service because
/// the Service outlives the group's pods.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GroupRecord {
    pub group: u32,
    #[serde(default)]
    pub restarts: u32,
    #[serde(default)]
    pub last_restart: Option<Time>,
}

/// Converts a pod listed by the instance selector. `None` when its group or rank
/// label is missing or not a number.
pub fn pod_from(pod: &Pod) -> Option<ObservedPod> {
    let meta = &pod.metadata;
    let labels = meta.labels.as_ref()?;
    let number = |key: &str| labels.get(key)?.parse::<u32>().ok();
    let status = pod.status.as_ref();
    let phase = match status.and_then(|s| s.phase.as_deref()) {
        Some("Running") => Phase::Running,
        Some("Succeeded") => Phase::Succeeded,
        Some("Failed") => Phase::Failed,
        Some("Unknown") => Phase::Unknown,
        _ => Phase::Pending,
    };
    let ready_condition = status
        .and_then(|s| s.conditions.as_ref())
        .and_then(|conditions| {
            conditions
                .iter()
                .find(|c| c.type_ == "Ready" && c.status == "True")
        });
    let ready = ready_condition.is_some();
    let problem = status
        .and_then(|s| {
            s.init_container_statuses
                .iter()
                .flatten()
                .chain(s.container_statuses.iter().flatten())
                .find_map(|c| {
                    let state = c.state.as_ref()?;
                    let why = match (&state.waiting, &state.terminated) {
                        (Some(waiting), _) => waiting.reason.clone()?,
                        (None, Some(terminated)) => termination(terminated)?,
                        (None, None) => return None,
                    };
                    Some(format!("{}: {why}", c.name))
                })
        })
        .or_else(|| status.and_then(|s| s.reason.clone()));
    Some(ObservedPod {
        name: meta.name.clone()?,
        uid: meta.uid.clone(),
        group: number(labels::GROUP)?,
        rank: number(labels::RANK)?,
        template_hash: meta
            .annotations
            .as_ref()
            .and_then(|a| a.get(labels::TEMPLATE_HASH).cloned()),
        release: labels.get(labels::RELEASE).cloned().unwrap_or_default(),
        phase,
        ready,
        node: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
        terminating: meta.deletion_timestamp.is_some(),
        problem,
        ip: status.and_then(|s| s.pod_ip.clone()),
        created: meta.creation_timestamp.clone(),
        ready_since: ready_condition.and_then(|c| c.last_transition_time.clone()),
    })
}

/// Longest part of a termination message quoted in a condition or event.
const MESSAGE_QUOTE_LEN: usize = 300;

/// Why a container ended, for a person: the engine's own exit code meaning when it
/// has one, and the last line of its termination message (the engine's `Error: ...`
/// line, which kubelet copies from its log under `FallbackToLogsOnError`).
fn termination(terminated: &ContainerStateTerminated) -> Option<String> {
    let reason = match terminated.exit_code {
        slipway_contract::exit::MODEL_REJECTED => "model rejected".to_owned(),
        slipway_contract::exit::USAGE => "engine arguments rejected".to_owned(),
        _ => terminated.reason.clone()?,
    };
    // Only the engine's own error line is a reason; a killed process's message is just
    // whatever it logged last, so it is named by its exit code instead.
    let last_line = terminated
        .message
        .as_deref()
        .and_then(|m| m.lines().rev().find(|l| !l.trim().is_empty()))
        .and_then(|l| {
            let l = l.trim();
            l.strip_prefix("Error: ")
                .or_else(|| l.starts_with("error: ").then_some(l))
        });
    let reason = match (last_line, terminated.exit_code) {
        (None, code) if code != 0 => format!("{reason}, exit {code}"),
        _ => reason,
    };
    Some(match last_line {
        Some(line) if line.chars().count() > MESSAGE_QUOTE_LEN => format!(
            "{reason}: {}…",
            line.chars().take(MESSAGE_QUOTE_LEN).collect::<String>()
        ),
        Some(line) => format!("{reason}: {line}"),
        None => reason,
    })
}

/// Converts a group's headless Service. `None` when it is not a group Service.
pub fn group_from(service: &Service) -> Option<GroupRecord> {
    let group = service
        .metadata
        .labels
        .as_ref()?
        .get(labels::GROUP)?
        .parse()
        .ok()?;
    let annotations = service.metadata.annotations.as_ref();
    let annotation = |key: &str| annotations.and_then(|a| a.get(key));
    Some(GroupRecord {
        group,
        restarts: annotation(labels::RESTARTS)
            .and_then(|value| value.parse().ok())
            .unwrap_or(0),
        last_restart: annotation(labels::LAST_RESTART).and_then(|value| {
            serde_json::from_value(serde_json::Value::String(value.clone())).ok()
        }),
    })
}

/// Converts a node.
pub fn node_from(node: &Node) -> ObservedNode {
    let spec = node.spec.as_ref();
    ObservedNode {
        labels: node.metadata.labels.clone().unwrap_or_default(),
        unschedulable: spec.and_then(|s| s.unschedulable).unwrap_or(false),
        taints: spec
            .and_then(|s| s.taints.as_ref())
            .into_iter()
            .flatten()
            .map(|t| NodeTaint {
                key: t.key.clone(),
                value: t.value.clone(),
                effect: t.effect.clone(),
            })
            .collect(),
        ready: node
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|conditions| {
                conditions
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True")
            }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        ContainerState, ContainerStatus, PodCondition, PodSpec, PodStatus,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use k8s_openapi::jiff::Timestamp;

    #[test]
    fn router_pods_are_neither_engine_pods_nor_orphans() {
        let pod = |name: &str, labels: &[(&str, &str)]| Pod {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                uid: Some(format!("uid-{name}")),
                labels: Some(
                    labels
                        .iter()
                        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                        .collect(),
                ),
                ..ObjectMeta::default()
            },
            status: Some(PodStatus {
                pod_ip: Some("10.0.0.9".to_owned()),
                conditions: Some(vec![PodCondition {
                    type_: "Ready".to_owned(),
                    status: "True".to_owned(),
                    ..PodCondition::default()
                }]),
                ..PodStatus::default()
            }),
            ..Pod::default()
        };
        let mut observed = Observed::default();
        sort_pods(
            &[
                pod(
                    "m-router-abc",
                    &[(labels::COMPONENT, labels::ROUTER_COMPONENT)],
                ),
                pod(
                    "m-g0-r0",
                    &[
                        (labels::COMPONENT, labels::ENGINE_COMPONENT),
                        (labels::GROUP, "0"),
                        (labels::RANK, "0"),
                    ],
                ),
                pod("m-stray", &[(labels::COMPONENT, labels::ENGINE_COMPONENT)]),
            ],
            &mut observed,
        );
        assert_eq!(
            observed.router_pods,
            vec![RouterPod {
                name: "m-router-abc".to_owned(),
                uid: Some("uid-m-router-abc".to_owned()),
                ip: Some("10.0.0.9".to_owned()),
                ready: true,
            }]
        );
        assert_eq!(observed.pods.len(), 1);
        assert_eq!(observed.unparsed_pods, vec!["m-stray".to_owned()]);
    }

    #[test]
    fn a_failed_rank_is_read_with_its_reason() {
        let pod = Pod {
            metadata: ObjectMeta {
                name: Some("m-g2-r1".to_owned()),
                labels: Some(BTreeMap::from([
                    (labels::GROUP.to_owned(), "2".to_owned()),
                    (labels::RANK.to_owned(), "1".to_owned()),
                    (labels::RELEASE.to_owned(), "abc".to_owned()),
                ])),
                annotations: Some(BTreeMap::from([(
                    labels::TEMPLATE_HASH.to_owned(),
                    "h".to_owned(),
                )])),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                node_name: Some("n1".to_owned()),
                ..PodSpec::default()
            }),
            status: Some(PodStatus {
                phase: Some("Failed".to_owned()),
                conditions: Some(vec![PodCondition {
                    type_: "Ready".to_owned(),
                    status: "False".to_owned(),
                    ..PodCondition::default()
                }]),
                container_statuses: Some(vec![ContainerStatus {
                    name: "engine".to_owned(),
                    state: Some(ContainerState {
                        terminated: Some(ContainerStateTerminated {
                            reason: Some("OOMKilled".to_owned()),
                            ..ContainerStateTerminated::default()
                        }),
                        ..ContainerState::default()
                    }),
                    ..ContainerStatus::default()
                }]),
                ..PodStatus::default()
            }),
        };
        let observed = pod_from(&pod).expect("labels are complete");
        assert_eq!((observed.group, observed.rank), (2, 1));
        assert_eq!(observed.phase, Phase::Failed);
        assert!(!observed.ready);
        assert_eq!(observed.problem.as_deref(), Some("engine: OOMKilled"));
        assert_eq!(observed.template_hash.as_deref(), Some("h"));
        assert_eq!(observed.node.as_deref(), Some("n1"));

        let mut unlabelled = pod;
        unlabelled.metadata.labels =
            Some(BTreeMap::from([(labels::GROUP.to_owned(), "x".to_owned())]));
        assert_eq!(
            pod_from(&unlabelled),
            None,
            "a pod without a numeric group/rank is never guessed at"
        );
    }

    #[test]
    fn the_restart_record_written_by_plan_reads_back() {
        // `plan` writes the time with `Timestamp`'s Display; the record must parse it.
        let when = Timestamp::from_second(1_767_229_200).expect("valid time");
        let service = Service {
            metadata: ObjectMeta {
                labels: Some(BTreeMap::from([(labels::GROUP.to_owned(), "4".to_owned())])),
                annotations: Some(BTreeMap::from([
                    (labels::RESTARTS.to_owned(), "3".to_owned()),
                    (labels::LAST_RESTART.to_owned(), when.to_string()),
                ])),
                ..ObjectMeta::default()
            },
            ..Service::default()
        };
        assert_eq!(
            group_from(&service),
            Some(GroupRecord {
                group: 4,
                restarts: 3,
                last_restart: Some(Time(when)),
            })
        );
    }

    #[test]
    fn a_model_that_fails_verification_is_named_with_the_engines_reason() {
        let terminated = |exit_code: i32, message: Option<&str>| ContainerStateTerminated {
            exit_code,
            reason: Some("Error".to_owned()),
            message: message.map(str::to_owned),
            ..ContainerStateTerminated::default()
        };
        let log = "2026-01-01T00:00:00Z INFO serving\n\
                   Error: model /models/m.gguf failed verification: its sha256 is 00ff (10 bytes), the release names b179\n";
        assert_eq!(
            termination(&terminated(
                slipway_contract::exit::MODEL_REJECTED,
                Some(log)
            ))
            .as_deref(),
            Some(
                "model rejected: model /models/m.gguf failed verification: its sha256 is 00ff (10 bytes), the release names b179"
            )
        );
        assert_eq!(
            termination(&terminated(
                slipway_contract::exit::USAGE,
                Some("error: unexpected argument '--rank' found")
            ))
            .as_deref(),
            Some("engine arguments rejected: error: unexpected argument '--rank' found")
        );
        assert_eq!(
            termination(&terminated(1, None)).as_deref(),
            Some("Error, exit 1")
        );
        // A killed engine's message is its last log line: named by the exit code instead.
        assert_eq!(
            termination(&terminated(
                137,
                Some("2026-01-01T00:00:00Z INFO request done")
            ))
            .as_deref(),
            Some("Error, exit 137")
        );
        let long = format!("Error: {}", "x".repeat(1000));
        let quoted = termination(&terminated(1, Some(&long))).unwrap_or_default();
        assert!(quoted.chars().count() < 320, "{quoted}");
    }
}
