//! `plan(isvc, observed, now) -> Plan`: every decision the operator makes, as a pure
//! function of the object, what the cluster shows ([`Observed`]) and the time.
//!
//! Decisions: how many groups ([`crate::scaling`]: static or measured demand, then the
//! capacity math from `slipway-api`), the shape of each group ([`crate::groups`]), the
//! pods, Services and PodDisruptionBudget that should exist, the router in front of
//! them ([`crate::router`]: the client Service selects its pods, each release's Service
//! its leaders), which children to delete
//! (scale-in takes groups from the most crowded fault domain, [`rollout::assign`];
//! outdated or broken groups are recreated whole), the status with its conditions, and
//! the events a person would want to see.
//!
//! Group lifecycle, per index `g < desired`:
//! - no pods → create them all (`Starting`);
//! - a pod with another template hash → delete the group, recreate it (`Replacing`);
//! - a pod failed, is missing, is on a NotReady node, or is being deleted while its
//!   peers live → the group is broken. Pods on a NotReady node are force-deleted (their
//!   kubelet cannot drain them), so the group is recreated on the nodes that remain. It is recreated whole after a backoff (10 s doubling, capped at 5 min)
//!   and at most [`MAX_GROUP_RESTARTS`] times; after that it is `Held`: left as it is,
//!   reported in `Degraded`, and counted as lost capacity. The count resets after the
//!   group has run ready for [`RESTART_RESET`], when the spec changes the group's
//!   pods (a new template is a new chance), or when the group's Service is deleted.
//! - only terminating pods → wait until they are gone (names are reused).
//!
//! When every group is ready and nothing else is in motion but one domain holds so
//! many groups that losing it is not survivable, one group is drained and recreated so
//! the scheduler's spread puts it in an emptier domain ([`crate::placement`]).
//!
//! Children of the kinds in [`crate::observed::LabelledKind`] that carry the instance
//! labels but are not in this plan are deleted (orphans by label).
//!
//! Invariants: `plan` never writes the spec; it applies pods only for ranks that do
//! not exist (pod specs are immutable; changes go through recreation); an unchanged
//! cluster yields the same objects, the same status and no events.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Service, ServiceAccount, ServicePort, ServiceSpec};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{
    LabelSelector, ObjectMeta, OwnerReference, Time,
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use k8s_openapi::jiff::SignedDuration;
use kube::Resource;
use kube::api::DynamicObject;
use slipway_api::InferenceService;
use slipway_api::bundle::bundle_hash;
use slipway_api::capacity::{CapacityPlan, worst_domain_loss};
use slipway_api::drain::{DrainBudget, DrainInput, drain_budget};
use slipway_api::spec::InferenceServiceSpec;
use slipway_api::status::{CapacityStatus, InferenceServiceStatus, ReplicaCounts, condition};
use slipway_contract::{RouterArgs, ServeArgs};

use crate::conditions::{self, Change, Computed};
use crate::groups::{GroupShape, group_shape};
use crate::labels;
use crate::observed::{GroupRecord, LabelledKind, Observed, ObservedNode, ObservedPod, Phase};
use crate::placement;
use crate::pod::{ModelStaging, render, serve_args};
use crate::rollout;
use crate::router;
use crate::scaling;

/// Recreations of one group before it is held.
pub const MAX_GROUP_RESTARTS: u32 = 5;
/// First backoff before recreating a broken group; doubles per restart.
pub const RESTART_BACKOFF_BASE: Duration = Duration::from_secs(10);
/// Longest backoff between recreations.
pub const RESTART_BACKOFF_MAX: Duration = Duration::from_secs(300);
/// A group ready this long after its last restart gets its restart count back.
pub const RESTART_RESET: Duration = Duration::from_secs(600);

/// What should exist and be reported.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Objects to server-side apply, in order (leaders before workers).
    pub apply: Vec<Child>,
    /// Children to delete (draining happens through the pods' preStop and grace).
    pub delete: Vec<ChildRef>,
    /// Pods on NotReady nodes, deleted with no grace period: their kubelet can neither
    /// drain them nor confirm they stopped, so a plain delete would leave them
    /// Terminating for good, holding the names their recreated groups need.
    pub force_delete_pods: Vec<String>,
    /// The status to write through the status subresource.
    pub status: InferenceServiceStatus,
    /// Events for transitions; empty when nothing changed.
    pub events: Vec<PlannedEvent>,
    /// When to look again even if nothing changes (a backoff ending).
    pub requeue_after: Option<Duration>,
    /// The spec cannot be planned; the reason is in `Ready=False`. Wait for a change.
    pub invalid: Option<String>,
}

/// A child object.
#[derive(Debug, Clone, PartialEq)]
pub enum Child {
    Pod(Box<Pod>),
    Service(Box<Service>),
    PodDisruptionBudget(Box<PodDisruptionBudget>),
    Deployment(Box<Deployment>),
    ServiceAccount(Box<ServiceAccount>),
    Role(Box<Role>),
    RoleBinding(Box<RoleBinding>),
    /// A Gateway API HTTPRoute, typed by the cluster's CRD (see [`crate::router`]).
    HttpRoute(Box<DynamicObject>),
}

impl Child {
    /// The child's kind and name.
    pub fn reference(&self) -> ChildRef {
        let (kind, meta) = match self {
            Self::Pod(pod) => (ChildKind::Pod, &pod.metadata),
            Self::Service(service) => (ChildKind::Service, &service.metadata),
            Self::PodDisruptionBudget(pdb) => (ChildKind::PodDisruptionBudget, &pdb.metadata),
            Self::Deployment(deployment) => (ChildKind::Deployment, &deployment.metadata),
            Self::ServiceAccount(account) => (ChildKind::ServiceAccount, &account.metadata),
            Self::Role(role) => (ChildKind::Role, &role.metadata),
            Self::RoleBinding(binding) => (ChildKind::RoleBinding, &binding.metadata),
            Self::HttpRoute(route) => (ChildKind::HttpRoute, &route.metadata),
        };
        ChildRef {
            kind,
            name: meta.name.clone().unwrap_or_default(),
        }
    }
}

/// Kinds of children.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ChildKind {
    Pod,
    Service,
    PodDisruptionBudget,
    Deployment,
    ServiceAccount,
    Role,
    RoleBinding,
    HttpRoute,
}

impl ChildKind {
    /// The Kubernetes kind.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pod => "Pod",
            Self::Service => "Service",
            Self::PodDisruptionBudget => "PodDisruptionBudget",
            Self::Deployment => "Deployment",
            Self::ServiceAccount => "ServiceAccount",
            Self::Role => "Role",
            Self::RoleBinding => "RoleBinding",
            Self::HttpRoute => "HTTPRoute",
        }
    }
}

impl From<LabelledKind> for ChildKind {
    fn from(kind: LabelledKind) -> Self {
        match kind {
            LabelledKind::Deployment => Self::Deployment,
            LabelledKind::ServiceAccount => Self::ServiceAccount,
            LabelledKind::Role => Self::Role,
            LabelledKind::RoleBinding => Self::RoleBinding,
            LabelledKind::PodDisruptionBudget => Self::PodDisruptionBudget,
            LabelledKind::HttpRoute => Self::HttpRoute,
        }
    }
}

/// A child by kind and name (in the InferenceService's namespace).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ChildRef {
    pub kind: ChildKind,
    pub name: String,
}

/// `Normal` or `Warning`, as events have it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    Normal,
    Warning,
}

/// An event to record on the InferenceService.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedEvent {
    pub type_: EventType,
    pub reason: &'static str,
    pub note: String,
}

/// Everything about one InferenceService that rendering needs, read once.
#[derive(Debug, Clone)]
pub struct Context<'a> {
    pub name: &'a str,
    pub namespace: &'a str,
    pub spec: &'a InferenceServiceSpec,
    pub owner: OwnerReference,
    /// Short release-bundle hash.
    pub release: &'a str,
    pub kv_namespace: String,
    pub shape: GroupShape,
    pub drain: DrainBudget,
    pub model: ModelStaging,
    /// The engine container's `serve` arguments (user's extras merged and checked).
    pub serve: ServeArgs,
    /// Where engines export request traces (the operator's `--otlp-endpoint`).
    pub engine_otlp_endpoint: Option<&'a str>,
    /// The router container's arguments.
    pub router: RouterArgs,
}

/// What happens to one group in this plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GroupState {
    Starting,
    Running,
    Replacing,
    Recreating,
    BackingOff,
    Held,
    Terminating,
}

/// Plans one InferenceService. See the module documentation.
pub fn plan(isvc: &InferenceService, observed: &Observed, now: &Time) -> Plan {
    let previous = isvc.status.clone().unwrap_or_default();
    let generation = isvc.metadata.generation.unwrap_or(0);
    let hash = bundle_hash(&isvc.spec.release);
    let (Some(name), Some(namespace), Some(owner)) = (
        isvc.metadata.name.as_deref(),
        isvc.metadata.namespace.as_deref(),
        isvc.controller_owner_ref(&()),
    ) else {
        return invalid(
            &previous,
            generation,
            now,
            "the object has no name, namespace or uid".to_owned(),
        );
    };
    // A rollout is running, or about to start (the spec names a new, untried bundle):
    // no scale-down meanwhile.
    let rolling = previous.canary_release.is_some()
        || previous.stable_release.as_deref().is_some_and(|stable| {
            stable != hash.short() && !previous.failed_releases.iter().any(|f| f == hash.short())
        });
    let cold_start = scaling::cold_start(&observed.pods).or_else(|| {
        previous
            .capacity
            .as_ref()
            .and_then(|c| c.cold_start_seconds)
            .and_then(|s| u64::try_from(s).ok())
            .map(Duration::from_secs)
    });
    let checked = (|| -> Result<_, String> {
        labels::check_name(name)?;
        let shape = group_shape(&isvc.spec.parallelism).map_err(|e| format!("parallelism: {e}"))?;
        let capacity = scaling::decide(&scaling::Input {
            spec: &isvc.spec.capacity,
            previous: &previous,
            demand: observed.demand.as_ref(),
            rolling,
            settling: observed.pods.iter().any(|p| p.terminating || !p.ready),
            cold_start,
            now,
        })
        .map_err(|e| format!("capacity: {e}"))?;
        let drain =
            drain_budget(&DrainInput::from_spec(&isvc.spec).map_err(|e| format!("slo: {e}"))?);
        let model = ModelStaging::parse(
            &isvc.spec.release.model.uri,
            isvc.spec.release.model.sha256.as_deref(),
        )?;
        let kv_namespace = isvc
            .spec
            .release
            .kv_namespace
            .clone()
            .unwrap_or_else(|| hash.derived_kv_namespace());
        let serve = serve_args(
            name,
            &isvc.spec,
            hash.short(),
            &kv_namespace,
            &model,
            &drain,
            observed.engine_otlp_endpoint.as_deref(),
        )?;
        let router = router::args(name, &drain, observed.engine_otlp_endpoint.as_deref())?;
        Ok((shape, capacity, drain, model, kv_namespace, serve, router))
    })();
    let (shape, capacity, drain, model, kv_namespace, serve, router) = match checked {
        Ok(parts) => parts,
        Err(reason) => return invalid(&previous, generation, now, reason),
    };
    // The stable release: status says, else what most live pods run, else the spec's.
    let stable = previous
        .stable_release
        .clone()
        .or_else(|| majority_release(observed))
        .unwrap_or_else(|| hash.short().to_owned());
    // Its bundle, to render its groups again after the spec moved on (kept on its
    // per-release Service; a mismatching hash is ignored).
    let stable_spec = (stable != hash.short())
        .then(|| observed.release_bundles.get(&stable))
        .flatten()
        .filter(|bundle| bundle_hash(bundle).short() == stable)
        .map(|bundle| InferenceServiceSpec {
            release: bundle.clone(),
            ..isvc.spec.clone()
        });
    let ctx = Context {
        name,
        namespace,
        spec: &isvc.spec,
        owner,
        release: hash.short(),
        kv_namespace,
        shape,
        drain,
        model,
        serve,
        engine_otlp_endpoint: observed.engine_otlp_endpoint.as_deref(),
        router,
    };
    let stable_ctx = if stable == ctx.release {
        Some(ctx.clone())
    } else {
        stable_spec
            .as_ref()
            .and_then(|spec| release_context(&ctx, spec, &stable))
    };
    plan_valid(
        &ctx,
        &Stable {
            release: &stable,
            ctx: stable_ctx.as_ref(),
        },
        &Sizing {
            decision: &capacity,
            cold_start,
        },
        &previous,
        generation,
        observed,
        now,
    )
}

/// How many groups, and what the count was sized from.
struct Sizing<'a> {
    decision: &'a scaling::Decision,
    cold_start: Option<Duration>,
}

/// The stable release and, when its bundle is known, how to render it.
struct Stable<'a, 'b> {
    release: &'a str,
    ctx: Option<&'a Context<'b>>,
}

/// The release most live pods run.
fn majority_release(observed: &Observed) -> Option<String> {
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for pod in observed
        .pods
        .iter()
        .filter(|p| !p.terminating && !p.release.is_empty())
    {
        *counts.entry(pod.release.as_str()).or_default() += 1;
    }
    counts
        .into_iter()
        .max_by_key(|(_, n)| *n)
        .map(|(release, _)| release.to_owned())
}

/// `base` with another release bundle (`spec` differs from base's only in `release`).
fn release_context<'a>(
    base: &Context<'a>,
    spec: &'a InferenceServiceSpec,
    release: &'a str,
) -> Option<Context<'a>> {
    let model = ModelStaging::parse(
        &spec.release.model.uri,
        spec.release.model.sha256.as_deref(),
    )
    .ok()?;
    let kv_namespace = spec
        .release
        .kv_namespace
        .clone()
        .unwrap_or_else(|| format!("release-{release}"));
    // Its own drain budget: maxOutputTokens is part of the bundle.
    let drain = drain_budget(&DrainInput::from_spec(spec).ok()?);
    let serve = serve_args(
        base.name,
        spec,
        release,
        &kv_namespace,
        &model,
        &drain,
        base.engine_otlp_endpoint,
    )
    .ok()?;
    Some(Context {
        spec,
        release,
        kv_namespace,
        drain,
        model,
        serve,
        ..base.clone()
    })
}

fn plan_valid(
    ctx: &Context<'_>,
    stable: &Stable<'_, '_>,
    sizing: &Sizing<'_>,
    previous: &InferenceServiceStatus,
    generation: i64,
    observed: &Observed,
    now: &Time,
) -> Plan {
    let capacity = &sizing.decision.capacity;
    let mut apply = Vec::new();
    let mut delete = BTreeSet::new();
    let mut events = Vec::new();
    let mut requeue: Option<Duration>;
    let domain_key = &ctx.spec.capacity.fault_domain.topology_key;
    let mut group_services = Vec::new();

    let mut ready_groups = 0;
    let mut serving_groups = 0;
    let mut updated_groups = 0;
    let mut busy = 0; // groups not yet running as planned
    let mut broken: Vec<String> = Vec::new();
    let mut held: Vec<String> = Vec::new();
    let mut groups_per_domain: BTreeMap<String, u32> = BTreeMap::new();
    // Where each ready group's leader runs (for rebalancing).
    let mut group_domains: BTreeMap<u32, String> = BTreeMap::new();
    // A pod whose node is NotReady is lost: it serves nobody and cannot be drained.
    let on_lost_node = |pod: &ObservedPod| {
        pod.node
            .as_ref()
            .and_then(|node| observed.nodes.get(node))
            .is_some_and(|node| !node.ready)
    };

    // Rollout: which release each group index runs.
    let world = ctx.shape.pods.len();
    let mut existing: BTreeMap<u32, String> = BTreeMap::new();
    let mut group_ready: BTreeMap<u32, bool> = BTreeMap::new();
    // Where each live group's leader is placed: scale-in takes from crowded domains.
    let mut placed: BTreeMap<u32, String> = BTreeMap::new();
    for pod in &observed.pods {
        if pod.terminating {
            continue;
        }
        if pod.rank == 0 || !existing.contains_key(&pod.group) {
            existing.insert(pod.group, pod.release.clone());
        }
        if pod.rank == 0
            && let Some(domain) = pod
                .node
                .as_ref()
                .and_then(|node| observed.nodes.get(node))
                .and_then(|node| node.labels.get(domain_key))
        {
            placed.insert(pod.group, domain.clone());
        }
        let on_ready_node = pod
            .node
            .as_ref()
            .and_then(|node| observed.nodes.get(node))
            .is_some_and(|node| node.ready);
        let ok = pod.ready && on_ready_node && pod.phase == Phase::Running;
        let entry = group_ready.entry(pod.group).or_insert(true);
        *entry = *entry && ok;
    }
    let count_release = |release: &str| {
        let mut counts = rollout::GroupCounts::default();
        for (group, r) in &existing {
            if r == release {
                counts.alive += 1;
                let live = observed
                    .pods
                    .iter()
                    .filter(|p| p.group == *group && !p.terminating)
                    .count();
                if group_ready.get(group).copied().unwrap_or(false) && live >= world {
                    counts.ready += 1;
                }
            }
        }
        counts
    };
    let state = rollout::RolloutState {
        stable_release: previous.stable_release.clone(),
        canary_release: previous.canary_release.clone(),
        rollout_hold: previous.rollout_hold.clone(),
        last_rollback: previous.last_rollback.clone(),
        failed_releases: previous.failed_releases.clone(),
    };
    let decision = rollout::decide(&rollout::Input {
        spec: &ctx.spec.rollout,
        objective: ctx.spec.slo.availability,
        target: ctx.release,
        stable: stable.release,
        previous: &state,
        desired: capacity.provisioned,
        needed: capacity.healthy_needed,
        stable_groups: count_release(stable.release),
        canary_groups: if ctx.release == stable.release {
            rollout::GroupCounts::default()
        } else {
            count_release(ctx.release)
        },
        metrics: observed.metrics.as_ref(),
        now,
    });
    // After a promotion the canary is the stable release already in this plan.
    let stable_now = decision
        .state
        .stable_release
        .as_deref()
        .unwrap_or(stable.release);
    let mut wants = vec![(stable_now, decision.stable_target)];
    if let Some(canary) = &decision.canary {
        wants.push((canary.as_str(), decision.canary_target));
    }
    let assignment = rollout::assign(&existing, &wants, &placed);
    let desired = u32::try_from(assignment.len()).unwrap_or(u32::MAX);
    events.extend(decision.events.iter().cloned());
    requeue = decision.requeue_after;
    if let Some(after) = sizing.decision.requeue_after {
        requeue = Some(requeue.map_or(after, |r| r.min(after)));
    }

    for (&group, release) in &assignment {
        let ctx = if *release == ctx.release {
            ctx
        } else if let Some(stable_ctx) = stable.ctx {
            stable_ctx
        } else {
            // The stable bundle is unknown (its per-release Service is gone): its
            // groups are left as they are and cannot be recreated.
            let live = observed
                .pods
                .iter()
                .filter(|p| p.group == group && !p.terminating)
                .count();
            if live > 0 && group_ready.get(&group).copied().unwrap_or(false) {
                ready_groups += 1;
            } else {
                busy += 1;
                broken.push(format!(
                    "group {group} (release {release} cannot be recreated: its bundle is unknown)"
                ));
            }
            continue;
        };
        let pods: Vec<&ObservedPod> = observed.pods.iter().filter(|p| p.group == group).collect();
        let mut record = observed
            .groups
            .iter()
            .find(|r| r.group == group)
            .cloned()
            .unwrap_or(GroupRecord {
                group,
                restarts: 0,
                last_restart: None,
            });
        let rendered: Vec<(Pod, String)> = ctx
            .shape
            .pods
            .iter()
            .map(|shape| render(ctx, group, shape))
            .collect();
        let world = rendered.len();
        let live: Vec<&&ObservedPod> = pods.iter().filter(|p| !p.terminating).collect();
        let outdated = live.iter().any(|p| {
            rendered
                .get(p.rank as usize)
                .is_none_or(|(_, hash)| p.template_hash.as_deref() != Some(hash.as_str()))
        });
        let failed = live
            .iter()
            .find(|p| matches!(p.phase, Phase::Failed | Phase::Succeeded));
        let missing = !live.is_empty() && live.len() < world;
        let lost = live.iter().find(|p| on_lost_node(p));
        let delete_live = |delete: &mut BTreeSet<ChildRef>| {
            for pod in &live {
                delete.insert(ChildRef {
                    kind: ChildKind::Pod,
                    name: pod.name.clone(),
                });
            }
        };

        let state = if outdated {
            delete_live(&mut delete);
            // A new template is a new chance: a held group is released by a spec change.
            record = GroupRecord {
                group,
                restarts: 0,
                last_restart: None,
            };
            GroupState::Replacing
        } else if failed.is_some() || missing || lost.is_some() {
            let why = match (failed, lost) {
                (Some(pod), _) => format!(
                    "pod {} {}",
                    pod.name,
                    pod.problem
                        .as_deref()
                        .map_or_else(|| "failed".to_owned(), |p| format!("failed ({p})"))
                ),
                (None, Some(pod)) => format!(
                    "pod {} is on node {}, which is not Ready",
                    pod.name,
                    pod.node.as_deref().unwrap_or_default()
                ),
                (None, None) => format!("{} of its {world} pods are gone", world - live.len()),
            };
            if record.restarts >= MAX_GROUP_RESTARTS {
                held.push(format!("group {group} ({why})"));
                GroupState::Held
            } else {
                let wait = backoff(record.restarts)
                    .saturating_sub(since(record.last_restart.as_ref(), now));
                if wait > Duration::ZERO {
                    requeue = Some(requeue.map_or(wait, |r| r.min(wait)));
                    // No countdown in the message: it would change the status on every
                    // reconcile and make each status write trigger the next reconcile.
                    broken.push(format!(
                        "group {group} ({why}; waiting out the restart backoff)"
                    ));
                    GroupState::BackingOff
                } else {
                    delete_live(&mut delete);
                    record.restarts += 1;
                    record.last_restart = Some(now.clone());
                    broken.push(format!("group {group} ({why})"));
                    events.push(PlannedEvent {
                        type_: EventType::Warning,
                        reason: "GroupRecreated",
                        note: format!(
                            "recreating group {group} (restart {} of {MAX_GROUP_RESTARTS}): {why}",
                            record.restarts
                        ),
                    });
                    GroupState::Recreating
                }
            }
        } else if !pods.is_empty() && live.is_empty() {
            GroupState::Terminating
        } else if live.is_empty() {
            for (pod, _) in &rendered {
                apply.push(Child::Pod(Box::new(pod.clone())));
            }
            GroupState::Starting
        } else {
            GroupState::Running
        };

        let on_ready_node = |pod: &ObservedPod| {
            pod.node
                .as_ref()
                .and_then(|node| observed.nodes.get(node))
                .is_some_and(|node| node.ready)
        };
        let ready =
            state == GroupState::Running && live.iter().all(|p| p.ready && on_ready_node(p));
        if ready {
            ready_groups += 1;
            // Only leaders serve (workers are not in the client Service).
            if live
                .iter()
                .filter(|p| p.rank == 0)
                .any(|p| observed.serving_pods.contains(&p.name))
            {
                serving_groups += 1;
            }
            let leader_domain = live
                .iter()
                .find(|p| p.rank == 0)
                .and_then(|p| observed.nodes.get(p.node.as_deref().unwrap_or_default()))
                .and_then(|node| node.labels.get(domain_key).cloned())
                .unwrap_or_else(|| format!("(nodes without {domain_key})"));
            *groups_per_domain.entry(leader_domain.clone()).or_default() += 1;
            group_domains.insert(group, leader_domain);
            if record.restarts > 0 && since(record.last_restart.as_ref(), now) >= RESTART_RESET {
                record = GroupRecord {
                    group,
                    restarts: 0,
                    last_restart: None,
                };
            }
        } else {
            busy += 1;
        }
        if state == GroupState::Running && live.iter().all(|p| p.release == ctx.release) {
            updated_groups += 1;
        }
        group_services.push(group_service(ctx, &record));
    }

    let scaling_in = observed
        .pods
        .iter()
        .any(|p| !assignment.contains_key(&p.group));
    let lost = lost_domains(&observed.nodes, domain_key);
    // Groups crowded into one domain (after a domain came back, or rollout churn) are
    // moved one at a time, and only when everything else is settled and the rest still
    // carry peak demand: the move drains a group like a scale-in does.
    let settled = decision.canary.is_none()
        && previous.canary_release.is_none()
        && busy == 0
        && broken.is_empty()
        && held.is_empty()
        && !scaling_in
        && lost.is_empty()
        && observed.pods.iter().all(|p| !p.terminating);
    let rebalance = (settled
        && ready_groups == desired
        && ready_groups > capacity.healthy_needed
        && !worst_domain_loss(&groups_per_domain, capacity.healthy_needed).tolerant)
        .then(|| {
            let overrides = ctx.spec.pod_template.clone().unwrap_or_default();
            placement::group_to_move(
                &group_domains,
                &placement::eligible_domains(&observed.nodes, domain_key, &overrides),
            )
        })
        .flatten();
    let rebalancing = rebalance.map(|m| {
        for pod in observed
            .pods
            .iter()
            .filter(|p| p.group == m.group && !p.terminating)
        {
            delete.insert(ChildRef {
                kind: ChildKind::Pod,
                name: pod.name.clone(),
            });
        }
        let note = format!(
            "moving group {} out of {domain_key}={} ({} of {ready_groups} ready groups; losing it would leave {}, {} needed) so the spread places it in {domain_key}={} ({} groups)",
            m.group,
            m.from,
            m.from_groups,
            ready_groups - m.from_groups,
            capacity.healthy_needed,
            m.to,
            m.to_groups
        );
        events.push(PlannedEvent {
            type_: EventType::Normal,
            reason: "Rebalancing",
            note: note.clone(),
        });
        note
    });

    // Scale-in and leftovers: every group `assign` did not keep (chosen by domain there).
    let mut orphans: Vec<&ObservedPod> = observed
        .pods
        .iter()
        .filter(|p| !assignment.contains_key(&p.group) && !p.terminating)
        .collect();
    orphans.sort_by(|a, b| b.group.cmp(&a.group).then(a.rank.cmp(&b.rank)));
    for pod in orphans {
        delete.insert(ChildRef {
            kind: ChildKind::Pod,
            name: pod.name.clone(),
        });
    }
    for name in &observed.unparsed_pods {
        delete.insert(ChildRef {
            kind: ChildKind::Pod,
            name: name.clone(),
        });
    }
    for record in observed
        .groups
        .iter()
        .filter(|r| !assignment.contains_key(&r.group))
    {
        delete.insert(ChildRef {
            kind: ChildKind::Service,
            name: labels::group_service(ctx.name, record.group),
        });
    }
    let current_release_service = labels::release_service(ctx.name, ctx.release);
    let mut releases_kept: BTreeSet<String> = observed
        .pods
        .iter()
        .map(|p| labels::release_service(ctx.name, &p.release))
        .collect();
    // The stable release's Service keeps its bundle: it stays while the rollout runs.
    releases_kept.insert(labels::release_service(ctx.name, stable.release));
    for service in &observed.release_services {
        if *service != current_release_service && !releases_kept.contains(service) {
            delete.insert(ChildRef {
                kind: ChildKind::Service,
                name: service.clone(),
            });
        }
    }

    apply.extend(
        group_services
            .into_iter()
            .map(|s| Child::Service(Box::new(s))),
    );
    // Clients reach the router; the router reaches each release's leaders through
    // that release's Service.
    apply.push(Child::Service(Box::new(router::client_service(ctx))));
    apply.push(Child::Service(Box::new(release_service(
        ctx,
        &current_release_service,
    ))));
    if let Some(stable_ctx) = stable.ctx.filter(|s| s.release != ctx.release) {
        apply.push(Child::Service(Box::new(release_service(
            stable_ctx,
            &labels::release_service(ctx.name, stable.release),
        ))));
    }
    apply.push(Child::PodDisruptionBudget(Box::new(pdb(
        ctx,
        capacity.healthy_needed,
    ))));
    let router_image = observed
        .router_image
        .as_deref()
        .unwrap_or(router::DEFAULT_IMAGE);
    apply.extend(router::children(ctx, router_image, &ctx.router));
    let route_spec = ctx.spec.router.http_route.as_ref();
    if let Some(route) = route_spec.filter(|_| !observed.http_route_crd_missing) {
        apply.push(Child::HttpRoute(Box::new(router::http_route(ctx, route))));
    }
    // Orphans by label: what carries our labels and this plan no longer renders.
    let rendered: BTreeSet<ChildRef> = apply.iter().map(Child::reference).collect();
    for (&kind, names) in &observed.labelled {
        for name in names {
            let child = ChildRef {
                kind: kind.into(),
                name: name.clone(),
            };
            if !rendered.contains(&child) {
                delete.insert(child);
            }
        }
    }

    // Status.
    let needed = capacity.healthy_needed;
    let mut computed = vec![Computed::new(
        condition::READY,
        ready_groups >= needed && ready_groups > 0,
        if ready_groups >= needed && ready_groups > 0 {
            "EnoughGroupsReady"
        } else {
            "NotEnoughGroupsReady"
        },
        format!("{ready_groups} of {desired} groups ready; {needed} needed to carry peak demand"),
    )];
    computed.push(if let Some(progress) = &decision.progress {
        Computed::new(
            condition::PROGRESSING,
            true,
            "CanaryRollout",
            progress.clone(),
        )
    } else if let Some(note) = &rebalancing {
        Computed::new(condition::PROGRESSING, true, "Rebalancing", note.clone())
    } else if busy > 0 || scaling_in {
        Computed::new(
            condition::PROGRESSING,
            true,
            if scaling_in {
                "ScalingIn"
            } else {
                "GroupsStarting"
            },
            format!(
                "{busy} of {desired} groups not ready yet{}",
                if scaling_in {
                    "; draining groups beyond the desired count"
                } else {
                    ""
                }
            ),
        )
    } else {
        Computed::new(
            condition::PROGRESSING,
            false,
            "Stable",
            format!("all {desired} groups ready"),
        )
    });
    computed.push(if !held.is_empty() {
        Computed::new(
            condition::DEGRADED,
            true,
            "GroupsHeld",
            format!(
                "held after {MAX_GROUP_RESTARTS} restarts and counted as lost capacity: {}",
                held.join(", ")
            ),
        )
    } else if !broken.is_empty() {
        Computed::new(
            condition::DEGRADED,
            true,
            "GroupsRestarting",
            broken.join(", "),
        )
    } else {
        Computed::new(condition::DEGRADED, false, "Healthy", "no group is failing")
    });
    computed.push(fault_tolerance(
        &groups_per_domain,
        &lost,
        capacity,
        domain_key,
    ));
    if let Some(rolled_back) = rollout::rolled_back_condition(ctx.release, &decision.state) {
        computed.push(rolled_back);
    }
    computed.push(sizing.decision.condition.clone());
    computed.push(scaler_conflict(&observed.external_scalers));
    computed.extend(router::http_route_condition(
        route_spec,
        &labels::client_service(ctx.name),
        observed.http_route_crd_missing,
        &previous.conditions,
    ));

    for new in &computed {
        let change = conditions::change(&previous.conditions, new);
        if let Some(event) = condition_event(new, change) {
            events.push(event);
        }
    }
    // During a rollout `desired` moves with the surge; the rollout events say why. A
    // new healthy count is an event whenever it happens.
    let rolling = decision.canary.is_some() || previous.canary_release.is_some();
    let healthy_changed = previous.observed_generation.is_some()
        && previous.replicas.healthy_needed != i32::try_from(needed).unwrap_or(i32::MAX);
    let desired_changed = previous.replicas.desired != i32::try_from(desired).unwrap_or(i32::MAX);
    if (!rolling && desired_changed) || healthy_changed {
        events.insert(
            0,
            PlannedEvent {
                type_: EventType::Normal,
                reason: "Scaled",
                note: format!(
                    "healthy groups needed {} → {needed}, desired groups {} → {desired}: {}",
                    previous.replicas.healthy_needed,
                    previous.replicas.desired,
                    sizing.decision.why
                ),
            },
        );
    }
    if let Some(note) = &sizing.decision.pending_note {
        events.push(PlannedEvent {
            type_: EventType::Normal,
            reason: "ScaleDownPending",
            note: note.clone(),
        });
    }
    let capacity_status = CapacityStatus {
        cold_start_seconds: sizing
            .cold_start
            .and_then(|c| i64::try_from(c.as_secs()).ok()),
        ..sizing.decision.status.clone()
    };

    let count = |n: u32| i32::try_from(n).unwrap_or(i32::MAX);
    let status = InferenceServiceStatus {
        observed_generation: Some(generation),
        conditions: conditions::merge(&previous.conditions, &computed, generation, now),
        replicas: ReplicaCounts {
            desired: count(desired),
            healthy_needed: count(needed),
            ready: count(ready_groups),
            serving: count(serving_groups),
            updated: count(updated_groups),
        },
        stable_release: decision.state.stable_release.clone(),
        canary_release: decision.state.canary_release.clone(),
        capacity: (capacity_status != CapacityStatus::default()).then_some(capacity_status),
        rollout_hold: decision.state.rollout_hold.clone(),
        last_rollback: decision.state.last_rollback.clone(),
        failed_releases: decision.state.failed_releases.clone(),
    };
    // Pods on NotReady nodes (being deleted by anyone, or by this plan) go without a
    // grace period. Engines keep no state two copies could corrupt, and the kubelet
    // stops the old process when it comes back.
    let mut force_delete_pods = Vec::new();
    for pod in observed.pods.iter().filter(|p| on_lost_node(p)) {
        let this_plan = delete.remove(&ChildRef {
            kind: ChildKind::Pod,
            name: pod.name.clone(),
        });
        if this_plan || pod.terminating {
            force_delete_pods.push(pod.name.clone());
        }
    }
    Plan {
        apply,
        delete: delete.into_iter().collect(),
        force_delete_pods,
        status,
        events,
        requeue_after: requeue,
        invalid: None,
    }
}

/// Fault domains that have nodes under `key` but no Ready node: lost, though their
/// nodes still exist (a zone whose nodes were deleted is simply no longer observed).
/// Pods on NotReady nodes never count as ready groups, so a lost domain holds none
/// and the worst-loss report alone would name a surviving domain instead.
fn lost_domains(nodes: &BTreeMap<String, ObservedNode>, key: &str) -> Vec<String> {
    let mut any_ready: BTreeMap<&str, bool> = BTreeMap::new();
    for node in nodes.values() {
        if let Some(domain) = node.labels.get(key) {
            *any_ready.entry(domain.as_str()).or_default() |= node.ready;
        }
    }
    any_ready
        .into_iter()
        .filter(|(_, ready)| !ready)
        .map(|(domain, _)| domain.to_owned())
        .collect()
}

/// `FaultTolerant` from where ready groups run, naming any lost domain first.
fn fault_tolerance(
    groups_per_domain: &BTreeMap<String, u32>,
    lost: &[String],
    capacity: &CapacityPlan,
    key: &str,
) -> Computed {
    let lost_note = match lost {
        [] => String::new(),
        [one] => format!("{key}={one} has no Ready node; "),
        many => format!(
            "{} have no Ready node; ",
            many.iter()
                .map(|domain| format!("{key}={domain}"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let report = worst_domain_loss(groups_per_domain, capacity.healthy_needed);
    let Some(worst) = report.worst_domain.as_deref() else {
        return Computed::new(
            condition::FAULT_TOLERANT,
            false,
            "NoGroupsReady",
            format!("{lost_note}no group is ready, so none can survive a domain loss"),
        );
    };
    let placed = report.groups_lost + report.groups_left;
    let summary = format!(
        "{lost_note}losing {key}={worst} ({} of {placed} ready groups) leaves {}, {} needed",
        report.groups_lost, report.groups_left, capacity.healthy_needed
    );
    if report.tolerant {
        Computed::new(
            condition::FAULT_TOLERANT,
            true,
            "SurvivesWorstDomainLoss",
            summary,
        )
    } else if capacity.capped {
        // The cap, not the placement, is the cause: say so first.
        Computed::new(
            condition::FAULT_TOLERANT,
            false,
            "CappedByMaxReplicas",
            format!(
                "maxReplicas {} is below the {} groups fault tolerance needs; {summary}",
                capacity.provisioned, capacity.fault_tolerant_target
            ),
        )
    } else {
        Computed::new(
            condition::FAULT_TOLERANT,
            false,
            "WorstDomainLossTooLarge",
            format!("{summary}: {} short", report.shortfall),
        )
    }
}

/// `ScalerConflict`: whether another autoscaler targets this InferenceService. The
/// operator never fights it (it is the only writer of group counts); it says so.
fn scaler_conflict(external: &[String]) -> Computed {
    if external.is_empty() {
        Computed::new(
            condition::SCALER_CONFLICT,
            false,
            "OperatorOwnsGroupCount",
            "no other autoscaler targets this InferenceService",
        )
    } else {
        Computed::new(condition::SCALER_CONFLICT, true, "OtherAutoscaler", {
            let (verb, them) = if external.len() == 1 {
                ("targets", "it")
            } else {
                ("target", "them")
            };
            format!(
                "{} {verb} this InferenceService; the operator alone sets group counts (from spec.capacity) and ignores {them}: remove {them} or point {them} elsewhere",
                external.join(", ")
            )
        })
    }
}

/// The event a condition change deserves, if any.
fn condition_event(new: &Computed, change: Change) -> Option<PlannedEvent> {
    let event = |type_, reason| {
        Some(PlannedEvent {
            type_,
            reason,
            note: new.message.clone(),
        })
    };
    match (new.type_, new.status, change) {
        (_, _, Change::Unchanged) => None,
        (condition::READY, true, Change::New | Change::Flipped) => {
            event(EventType::Normal, "Ready")
        }
        (condition::READY, false, Change::Flipped) => event(EventType::Warning, "NotReady"),
        (condition::FAULT_TOLERANT, false, Change::Flipped) => {
            event(EventType::Warning, "DomainLossNotSurvivable")
        }
        (condition::FAULT_TOLERANT, true, Change::Flipped) => {
            event(EventType::Normal, "DomainLossSurvivable")
        }
        // The message names the held groups, so a newly held group is a change too.
        (condition::DEGRADED, true, _) if new.reason == "GroupsHeld" => {
            event(EventType::Warning, "GroupHeld")
        }
        (condition::DEMAND_KNOWN, false, Change::New | Change::Flipped) => {
            event(EventType::Warning, "DemandUnknown")
        }
        (condition::SCALER_CONFLICT, true, _) => event(EventType::Warning, "ScalerConflict"),
        (condition::HTTP_ROUTE_READY, false, Change::New | Change::Flipped | Change::Reason)
            if new.reason == router::GATEWAY_API_MISSING =>
        {
            event(EventType::Warning, router::GATEWAY_API_MISSING)
        }
        _ => None,
    }
}

fn invalid(previous: &InferenceServiceStatus, generation: i64, now: &Time, reason: String) -> Plan {
    let computed = Computed::new(condition::READY, false, "InvalidSpec", reason.clone());
    let events = match conditions::change(&previous.conditions, &computed) {
        Change::Unchanged => Vec::new(),
        _ => vec![PlannedEvent {
            type_: EventType::Warning,
            reason: "InvalidSpec",
            note: reason.clone(),
        }],
    };
    Plan {
        apply: Vec::new(),
        delete: Vec::new(),
        force_delete_pods: Vec::new(),
        status: InferenceServiceStatus {
            observed_generation: Some(generation),
            conditions: conditions::merge(&previous.conditions, &[computed], generation, now),
            ..previous.clone()
        },
        events,
        requeue_after: None,
        invalid: Some(reason),
    }
}

/// Backoff before the recreation that follows `restarts` earlier ones: none for the
/// first (a single failure is recreated at once), then 10 s doubling, capped at 5 min.
pub fn backoff(restarts: u32) -> Duration {
    match restarts {
        0 => Duration::ZERO,
        n => RESTART_BACKOFF_BASE
            .saturating_mul(1u32.checked_shl(n - 1).unwrap_or(u32::MAX))
            .min(RESTART_BACKOFF_MAX),
    }
}

/// Time from `then` to `now`; `then` unset is "long ago".
fn since(then: Option<&Time>, now: &Time) -> Duration {
    match then {
        None => Duration::MAX,
        Some(then) => {
            let elapsed: SignedDuration = now.0.duration_since(then.0);
            Duration::from_secs(u64::try_from(elapsed.as_secs()).unwrap_or(0))
        }
    }
}

fn meta(ctx: &Context<'_>, name: String, labels: BTreeMap<String, String>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name),
        namespace: Some(ctx.namespace.to_owned()),
        labels: Some(labels),
        owner_references: Some(vec![ctx.owner.clone()]),
        ..ObjectMeta::default()
    }
}

fn http_port() -> Vec<ServicePort> {
    vec![ServicePort {
        name: Some("http".to_owned()),
        port: 80,
        target_port: Some(IntOrString::String("http".to_owned())),
        protocol: Some("TCP".to_owned()),
        ..ServicePort::default()
    }]
}

/// The headless Service of a group: DNS for its pods, home of its restart record.
fn group_service(ctx: &Context<'_>, record: &GroupRecord) -> Service {
    let mut service_labels = labels::instance_selector(ctx.name);
    service_labels.insert(labels::GROUP.to_owned(), record.group.to_string());
    let mut metadata = meta(
        ctx,
        labels::group_service(ctx.name, record.group),
        service_labels,
    );
    let mut annotations =
        BTreeMap::from([(labels::RESTARTS.to_owned(), record.restarts.to_string())]);
    if let Some(time) = &record.last_restart {
        annotations.insert(labels::LAST_RESTART.to_owned(), time.0.to_string());
    }
    metadata.annotations = Some(annotations);
    Service {
        metadata,
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".to_owned()),
            selector: Some(labels::group_selector(ctx.name, record.group)),
            // Workers resolve their leader before anyone is ready.
            publish_not_ready_addresses: Some(true),
            ports: Some(http_port()),
            ..ServiceSpec::default()
        }),
        status: None,
    }
}

/// A release's Service: the leaders of its groups, the router's endpoints for it.
fn release_service(ctx: &Context<'_>, name: &str) -> Service {
    // Leaders only: the leader of a group owns HTTP; its workers serve nothing.
    let mut selector = labels::engine_selector(ctx.name);
    selector.insert(labels::RANK.to_owned(), "0".to_owned());
    selector.insert(labels::RELEASE.to_owned(), ctx.release.to_owned());
    let mut service_labels = labels::instance_selector(ctx.name);
    service_labels.insert(labels::RELEASE.to_owned(), ctx.release.to_owned());
    let mut metadata = meta(ctx, name.to_owned(), service_labels);
    // The bundle, so this release can be rendered again after the spec moved on.
    metadata.annotations = Some(BTreeMap::from([(
        labels::BUNDLE.to_owned(),
        serde_json::to_string(&ctx.spec.release).unwrap_or_default(),
    )]));
    Service {
        metadata,
        spec: Some(ServiceSpec {
            selector: Some(selector),
            ports: Some(http_port()),
            ..ServiceSpec::default()
        }),
        status: None,
    }
}

/// Keeps the pods of `N_healthy` groups up through voluntary disruptions.
fn pdb(ctx: &Context<'_>, healthy_needed: u32) -> PodDisruptionBudget {
    let pods = healthy_needed.saturating_mul(ctx.shape.world_size());
    PodDisruptionBudget {
        metadata: meta(
            ctx,
            labels::client_service(ctx.name),
            labels::instance_selector(ctx.name),
        ),
        spec: Some(PodDisruptionBudgetSpec {
            min_available: Some(IntOrString::Int(i32::try_from(pods).unwrap_or(i32::MAX))),
            selector: Some(LabelSelector {
                match_labels: Some(labels::engine_selector(ctx.name)),
                ..LabelSelector::default()
            }),
            ..PodDisruptionBudgetSpec::default()
        }),
        status: None,
    }
}
