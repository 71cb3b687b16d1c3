//! The status a plan reports: its conditions (`Ready`, `Progressing`, `Degraded`,
//! `FaultTolerant`, `RolledBack`, `DemandKnown`, `ScalerConflict`, `HTTPRouteReady`),
//! computed purely from this plan and merged with the previous ones so
//! `lastTransitionTime` only moves when a status flips, and the replica counts.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use slipway_api::capacity::{CapacityPlan, worst_domain_loss};
use slipway_api::status::{CapacityStatus, InferenceServiceStatus, ReplicaCounts, condition};

use crate::conditions::{self, Computed};
use crate::labels;
use crate::observed::{Observed, ObservedNode};
use crate::rollout;
use crate::router;
use crate::scaling;
use crate::types::Context;

use super::groups::{MAX_GROUP_RESTARTS, Tally};

/// What the status is computed from.
pub(super) struct Facts<'a, 'b> {
    pub ctx: &'a Context<'b>,
    pub previous: &'a InferenceServiceStatus,
    pub observed: &'a Observed,
    pub rollout: &'a rollout::Decision,
    pub sizing: &'a scaling::Decision,
    pub cold_start: Option<Duration>,
    pub tally: &'a Tally,
    /// Groups the rollout keeps.
    pub desired: u32,
    /// Pods of groups beyond `desired` are still there.
    pub scaling_in: bool,
    /// Why a group is being moved, when one is.
    pub rebalancing: Option<&'a str>,
    /// Fault domains with nodes but no Ready node.
    pub lost_domains: &'a [String],
}

/// Every condition this plan computes, in the order they are reported.
pub(super) fn conditions(facts: &Facts<'_, '_>) -> Vec<Computed> {
    let ctx = facts.ctx;
    let mut computed = vec![ready(facts), progressing(facts), degraded(facts.tally)];
    computed.push(fault_tolerance(
        &facts.tally.per_domain,
        facts.lost_domains,
        &facts.sizing.capacity,
        &ctx.spec.capacity.fault_domain.topology_key,
    ));
    if let Some(rolled_back) = rollout::rolled_back_condition(ctx.release, &facts.rollout.state) {
        computed.push(rolled_back);
    }
    computed.push(facts.sizing.condition.clone());
    computed.push(scaler_conflict(&facts.observed.external_scalers));
    computed.extend(router::http_route_condition(
        ctx.spec.router.http_route.as_ref(),
        &labels::client_service(ctx.name),
        facts.observed.http_route_crd_missing,
        &facts.previous.conditions,
    ));
    computed
}

/// The status to write: `computed` merged into the previous conditions, the counts,
/// and the rollout's state.
pub(super) fn status(
    facts: &Facts<'_, '_>,
    computed: &[Computed],
    generation: i64,
    now: &Time,
) -> InferenceServiceStatus {
    let capacity_status = CapacityStatus {
        cold_start_seconds: facts
            .cold_start
            .and_then(|c| i64::try_from(c.as_secs()).ok()),
        ..facts.sizing.status.clone()
    };
    let count = |n: u32| i32::try_from(n).unwrap_or(i32::MAX);
    let state = &facts.rollout.state;
    InferenceServiceStatus {
        observed_generation: Some(generation),
        conditions: conditions::merge(&facts.previous.conditions, computed, generation, now),
        replicas: ReplicaCounts {
            desired: count(facts.desired),
            healthy_needed: count(facts.sizing.capacity.healthy_needed),
            ready: count(facts.tally.ready),
            serving: count(facts.tally.serving),
            updated: count(facts.tally.updated),
        },
        stable_release: state.stable_release.clone(),
        canary_release: state.canary_release.clone(),
        capacity: (capacity_status != CapacityStatus::default()).then_some(capacity_status),
        rollout_hold: state.rollout_hold.clone(),
        last_rollback: state.last_rollback.clone(),
        failed_releases: state.failed_releases.clone(),
    }
}

/// `Ready`: enough groups ready to carry peak demand.
fn ready(facts: &Facts<'_, '_>) -> Computed {
    let ready = facts.tally.ready;
    let needed = facts.sizing.capacity.healthy_needed;
    let enough = ready >= needed && ready > 0;
    Computed::new(
        condition::READY,
        enough,
        if enough {
            "EnoughGroupsReady"
        } else {
            "NotEnoughGroupsReady"
        },
        format!(
            "{ready} of {} groups ready; {needed} needed to carry peak demand",
            facts.desired
        ),
    )
}

/// `Progressing`: a canary rollout, a group being moved, groups starting or
/// draining, else stable.
fn progressing(facts: &Facts<'_, '_>) -> Computed {
    let desired = facts.desired;
    let busy = facts.tally.busy;
    if let Some(progress) = &facts.rollout.progress {
        Computed::new(
            condition::PROGRESSING,
            true,
            "CanaryRollout",
            progress.clone(),
        )
    } else if let Some(note) = facts.rebalancing {
        Computed::new(condition::PROGRESSING, true, "Rebalancing", note.to_owned())
    } else if busy > 0 || facts.scaling_in {
        Computed::new(
            condition::PROGRESSING,
            true,
            if facts.scaling_in {
                "ScalingIn"
            } else {
                "GroupsStarting"
            },
            format!(
                "{busy} of {desired} groups not ready yet{}",
                if facts.scaling_in {
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
    }
}

/// `Degraded`: groups held after too many restarts, else groups restarting.
fn degraded(tally: &Tally) -> Computed {
    if !tally.held.is_empty() {
        Computed::new(
            condition::DEGRADED,
            true,
            "GroupsHeld",
            format!(
                "held after {MAX_GROUP_RESTARTS} restarts and counted as lost capacity: {}",
                tally.held.join(", ")
            ),
        )
    } else if !tally.broken.is_empty() {
        Computed::new(
            condition::DEGRADED,
            true,
            "GroupsRestarting",
            tally.broken.join(", "),
        )
    } else {
        Computed::new(condition::DEGRADED, false, "Healthy", "no group is failing")
    }
}

/// Fault domains that have nodes under `key` but no Ready node: lost, though their
/// nodes still exist (a zone whose nodes were deleted is simply no longer observed).
/// Pods on NotReady nodes never count as ready groups, so a lost domain holds none
/// and the worst-loss report alone would name a surviving domain instead.
pub(super) fn lost_domains(nodes: &BTreeMap<String, ObservedNode>, key: &str) -> Vec<String> {
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
