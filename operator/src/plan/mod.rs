//! `plan(isvc, observed, now) -> Plan`: every decision the operator makes, as a pure
//! function of the object, what the cluster shows ([`Observed`]) and the time.
//!
//! This module only orchestrates; each decision has its own home:
//! - how many groups: [`crate::scaling`] (static or measured demand, then the capacity
//!   math from `slipway-api`); the shape of each group: [`crate::groups`];
//! - which release runs where: `releases` (the stable release and how to render it,
//!   the canary step from [`crate::rollout`], and which group index runs which
//!   release; scale-in takes groups from the most crowded fault domain);
//! - each group's lifecycle: `groups` (start, replace an outdated group, recreate a
//!   broken one whole after a backoff, hold it after [`MAX_GROUP_RESTARTS`], move a
//!   group out of a crowded domain);
//! - the other children and what to delete: `children` (the Services, the
//!   PodDisruptionBudget, the router from [`crate::router`], orphans by label);
//! - the status with its conditions: `status`; the events a person would want to
//!   see: `events`.
//!
//! The shared plain types ([`Context`], [`Child`], [`ChildRef`], [`PlannedEvent`]) live
//! in [`crate::types`] and are re-exported here; no module imports this one back.
//!
//! A broken group is one with a pod that failed, is missing, is on a NotReady node, or
//! is being deleted while its peers live. Pods on a NotReady node are force-deleted
//! (their kubelet cannot drain them), so the group is recreated on the nodes that
//! remain. It is recreated whole after [`RESTART_BACKOFF`] (10 s doubling, capped at
//! 5 min) and at most [`MAX_GROUP_RESTARTS`] times; after that it is `Held`: left as
//! it is, reported in `Degraded`, and counted as lost capacity. The count resets
//! after the group has run ready for [`RESTART_RESET`], when the spec changes the
//! group's pods (a new template is a new chance), or when the group's Service is
//! deleted.
//!
//! When every group is ready and nothing else is in motion but one domain holds so
//! many groups that losing it is not survivable, one group is drained and recreated so
//! the scheduler's spread puts it in an emptier domain ([`crate::placement`]).
//!
//! Invariants: `plan` never writes the spec; it applies pods only for ranks that do
//! not exist (pod specs are immutable; changes go through recreation); an unchanged
//! cluster yields the same objects, the same status and no events.

mod children;
mod events;
mod failure;
mod groups;
mod releases;
mod status;

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};
use kube::Resource;
use slipway_api::InferenceService;
use slipway_api::bundle::{BundleHash, bundle_hash};
use slipway_api::drain::{DrainInput, drain_budget};
use slipway_api::status::{InferenceServiceStatus, condition};

use crate::conditions::{self, Change, Computed};
use crate::groups::group_shape;
use crate::labels;
use crate::model::BundleStaging;
use crate::observed::Observed;
use crate::pod::serve_args;
use crate::router;
use crate::scaling;
use crate::spec_error::SpecError;

use groups::{GroupsPlan, LiveGroups, earliest};
use releases::{Releases, Stable};

pub use crate::types::{Child, ChildKind, ChildRef, Context, EventType, PlannedEvent};
pub use failure::{APPLY_FAILED, ApplyFailure, apply_failed};
pub use groups::{MAX_GROUP_RESTARTS, RESTART_BACKOFF, RESTART_RESET};

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
    /// The spec cannot be planned; why is in `Ready=False` (its reason is
    /// [`SpecError::reason`]). Wait for a change.
    pub invalid: Option<SpecError>,
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
        return invalid(&previous, generation, now, SpecError::MissingIdentity);
    };
    let cold_start = scaling::cold_start(&observed.pods).or_else(|| {
        previous
            .capacity
            .as_ref()
            .and_then(|c| c.cold_start_seconds)
            .and_then(|s| u64::try_from(s).ok())
            .map(Duration::from_secs)
    });
    let sizing_input = scaling::Input {
        spec: &isvc.spec.capacity,
        previous: &previous,
        demand: observed.demand.as_ref(),
        rolling: releases::rollout_pending(&previous, hash.short()),
        settling: observed.pods.iter().any(|p| p.terminating || !p.ready),
        cold_start,
        now,
    };
    let identity = Identity {
        name,
        namespace,
        owner,
    };
    let (ctx, capacity) = match read_spec(isvc, observed, identity, &hash, &sizing_input) {
        Ok(read) => read,
        Err(reason) => return invalid(&previous, generation, now, reason),
    };
    let stable = releases::stable_release(&previous, observed, ctx.release);
    let stable_spec = releases::stable_spec(&isvc.spec, observed, &stable, ctx.release);
    let stable_ctx = if stable == ctx.release {
        Some(ctx.clone())
    } else {
        stable_spec
            .as_ref()
            .and_then(|spec| releases::release_context(&ctx, spec, &stable))
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

/// Who the InferenceService is, from its metadata.
struct Identity<'a> {
    name: &'a str,
    namespace: &'a str,
    owner: OwnerReference,
}

/// Reads the spec into what rendering needs and sizes the group count on the way.
/// The checks run in this order, so the first problem is the one reported.
///
/// # Errors
/// The sentence for `Ready=False` when the spec cannot be planned.
fn read_spec<'a>(
    isvc: &'a InferenceService,
    observed: &'a Observed,
    identity: Identity<'a>,
    hash: &'a BundleHash,
    sizing: &scaling::Input<'_>,
) -> Result<(Context<'a>, scaling::Decision), SpecError> {
    let Identity {
        name,
        namespace,
        owner,
    } = identity;
    labels::check_name(name)?;
    let shape = group_shape(&isvc.spec.parallelism, isvc.spec.release.engine.device)?;
    let capacity = scaling::decide(sizing)?;
    let drain = drain_budget(&DrainInput::from_spec(&isvc.spec).map_err(|error| {
        SpecError::SloThreshold {
            field: "slo",
            error,
        }
    })?);
    let staging = BundleStaging::parse(&isvc.spec.release)?;
    let kv_namespace = isvc
        .spec
        .release
        .kv_namespace
        .clone()
        .unwrap_or_else(|| hash.derived_kv_namespace());
    let engine_otlp_endpoint = observed.engine_otlp_endpoint.as_deref();
    let serve = serve_args(
        name,
        &isvc.spec,
        hash.short(),
        &kv_namespace,
        &staging,
        &drain,
        engine_otlp_endpoint,
    )?;
    let router = router::args(name, &drain, engine_otlp_endpoint)?;
    let ctx = Context {
        name,
        namespace,
        spec: &isvc.spec,
        owner,
        release: hash.short(),
        kv_namespace,
        shape,
        drain,
        staging,
        serve,
        engine_otlp_endpoint,
        router,
    };
    Ok((ctx, capacity))
}

/// How many groups, and what the count was sized from.
struct Sizing<'a> {
    decision: &'a scaling::Decision,
    cold_start: Option<Duration>,
}

/// Plans a spec that passed its checks: releases, then groups, then the other
/// children, then status and events, each from what the steps before it decided.
fn plan_valid(
    ctx: &Context<'_>,
    stable: &Stable<'_, '_>,
    sizing: &Sizing<'_>,
    previous: &InferenceServiceStatus,
    generation: i64,
    observed: &Observed,
    now: &Time,
) -> Plan {
    let needed = sizing.decision.capacity.healthy_needed;
    let domain_key = ctx.spec.capacity.fault_domain.topology_key.as_str();
    let live = LiveGroups::read(observed, domain_key);
    let Releases {
        decision,
        assignment,
    } = releases::assign_releases(
        ctx,
        stable,
        &sizing.decision.capacity,
        previous,
        observed,
        &live,
        now,
    );
    let desired = u32::try_from(assignment.len()).unwrap_or(u32::MAX);
    let GroupsPlan {
        pods,
        records,
        mut delete,
        events: group_events,
        requeue: group_requeue,
        tally,
    } = groups::plan_groups(&groups::Input {
        ctx,
        stable_ctx: stable.ctx,
        assignment: &assignment,
        live: &live,
        observed,
        domain_key,
        now,
    });
    // The rollout's events come first, then the groups' in index order.
    let mut events = decision.events.clone();
    events.extend(group_events);
    let requeue = earliest(
        earliest(decision.requeue_after, sizing.decision.requeue_after),
        group_requeue,
    );

    let scaling_in = observed
        .pods
        .iter()
        .any(|p| !assignment.contains_key(&p.group));
    let lost_domains = status::lost_domains(&observed.nodes, domain_key);
    // Groups crowded into one domain (after a domain came back, or rollout churn) are
    // moved one at a time, and only when everything else is settled.
    let settled = decision.canary.is_none()
        && previous.canary_release.is_none()
        && tally.busy == 0
        && tally.broken.is_empty()
        && tally.held.is_empty()
        && !scaling_in
        && lost_domains.is_empty()
        && observed.pods.iter().all(|p| !p.terminating);
    let rebalancing = groups::group_to_rebalance(ctx, observed, &tally, settled, desired, needed)
        .map(|m| {
            let (pods, note) = groups::rebalance(&m, observed, tally.ready, needed, domain_key);
            delete.extend(pods);
            events.push(events::rebalancing(&note));
            note
        });

    delete.extend(children::leftovers(
        ctx,
        stable.release,
        &assignment,
        observed,
    ));
    let mut apply = pods;
    apply.extend(children::shared_children(
        ctx, stable, &records, needed, observed,
    ));
    delete.extend(children::orphans_by_label(observed, &apply));

    let facts = status::Facts {
        ctx,
        previous,
        observed,
        rollout: &decision,
        sizing: sizing.decision,
        cold_start: sizing.cold_start,
        tally: &tally,
        desired,
        scaling_in,
        rebalancing: rebalancing.as_deref(),
        lost_domains: &lost_domains,
    };
    let computed = status::conditions(&facts);
    events.extend(events::condition_events(previous, &computed));
    let rolling = decision.canary.is_some() || previous.canary_release.is_some();
    if let Some(scaled) = events::scaled(previous, rolling, needed, desired, &sizing.decision.why) {
        events.insert(0, scaled);
    }
    if let Some(note) = &sizing.decision.pending_note {
        events.push(events::scale_down_pending(note));
    }
    let status = status::status(&facts, &computed, generation, now);
    // Pods on NotReady nodes (being deleted by anyone, or by this plan) go without a
    // grace period.
    let force_delete_pods = children::force_deletions(observed, &mut delete);
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

/// The plan for a spec that cannot be planned: `Ready=False` with the error's reason
/// and message, nothing applied or deleted, and the rest of the status as it was.
fn invalid(
    previous: &InferenceServiceStatus,
    generation: i64,
    now: &Time,
    error: SpecError,
) -> Plan {
    let computed = Computed::new(condition::READY, false, error.reason(), error.to_string());
    let events = match conditions::change(&previous.conditions, &computed) {
        Change::Unchanged => Vec::new(),
        _ => vec![events::invalid_spec(&error)],
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
        invalid: Some(error),
    }
}
