//! The events a person would want to see, on transitions only: a condition that
//! flipped, a group recreated or moved, a new group count, a pending scale-down, an
//! invalid spec. An unchanged cluster yields none. (The rollout's own events come
//! from [`crate::rollout`].)

use slipway_api::status::{InferenceServiceStatus, condition};

use crate::conditions::{self, Change, Computed};
use crate::router;
use crate::spec_error::SpecError;
use crate::types::{EventType, PlannedEvent};

/// The events the changes from the previous conditions to `computed` deserve.
pub(super) fn condition_events(
    previous: &InferenceServiceStatus,
    computed: &[Computed],
) -> Vec<PlannedEvent> {
    computed
        .iter()
        .filter_map(|new| condition_event(new, conditions::change(&previous.conditions, new)))
        .collect()
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

/// A new group count. During a rollout (`rolling`) the desired count moves with the
/// surge and the rollout events say why, so only a new healthy count is reported
/// then; otherwise either count changing is.
pub(super) fn scaled(
    previous: &InferenceServiceStatus,
    rolling: bool,
    needed: u32,
    desired: u32,
    why: &str,
) -> Option<PlannedEvent> {
    let healthy_changed = previous.observed_generation.is_some()
        && previous.replicas.healthy_needed != i32::try_from(needed).unwrap_or(i32::MAX);
    let desired_changed = previous.replicas.desired != i32::try_from(desired).unwrap_or(i32::MAX);
    ((!rolling && desired_changed) || healthy_changed).then(|| PlannedEvent {
        type_: EventType::Normal,
        reason: "Scaled",
        note: format!(
            "healthy groups needed {} → {needed}, desired groups {} → {desired}: {why}",
            previous.replicas.healthy_needed, previous.replicas.desired,
        ),
    })
}

/// A scale-down just became pending.
pub(super) fn scale_down_pending(note: &str) -> PlannedEvent {
    PlannedEvent {
        type_: EventType::Normal,
        reason: "ScaleDownPending",
        note: note.to_owned(),
    }
}

/// A broken group is recreated whole, for the `restarts`-th time of `max_restarts`.
pub(super) fn group_recreated(
    group: u32,
    restarts: u32,
    max_restarts: u32,
    why: &str,
) -> PlannedEvent {
    PlannedEvent {
        type_: EventType::Warning,
        reason: "GroupRecreated",
        note: format!("recreating group {group} (restart {restarts} of {max_restarts}): {why}"),
    }
}

/// A ready group is drained so the spread places it in an emptier domain.
pub(super) fn rebalancing(note: &str) -> PlannedEvent {
    PlannedEvent {
        type_: EventType::Normal,
        reason: "Rebalancing",
        note: note.to_owned(),
    }
}

/// The spec cannot be planned: the same reason as the `Ready=False` condition.
pub(super) fn invalid_spec(error: &SpecError) -> PlannedEvent {
    PlannedEvent {
        type_: EventType::Warning,
        reason: error.reason(),
        note: error.to_string(),
    }
}
