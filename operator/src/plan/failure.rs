//! A plan the API server refused: what the status and events say about it.
//!
//! Applying a child can fail for good (a Service with no ClusterIP left in the
//! range, a quota, an admission webhook). Retrying is right, but silence is not: the
//! object shows `Ready=False` with reason [`APPLY_FAILED`] and the API's own message,
//! and one Warning event of the same reason, on the transition only (the same failure
//! retried every [`crate::reconcile::ERROR_REQUEUE`] writes nothing more).
//!
//! Only `Ready` is replaced; every other field stays as the previous status had it,
//! so the plan's own transitions (a new group count, a lost domain) are still
//! reported, as events too, by the first reconcile whose apply succeeds. That
//! reconcile computes `Ready` from the cluster again, which clears the failure.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use slipway_api::status::{InferenceServiceStatus, condition};

use crate::conditions::{self, Change, Computed};
use crate::types::{EventType, PlannedEvent};

/// The reason of `Ready=False` and of the Warning event when a child cannot be applied.
pub const APPLY_FAILED: &str = "ApplyFailed";

/// One child the API server refused, and its answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApplyFailure {
    pub kind: &'static str,
    pub name: String,
    /// The API's message (a `Status`'s `message`), or the client error's text when
    /// the server never answered.
    pub message: String,
}

impl ApplyFailure {
    /// The condition's and event's message.
    pub fn note(&self) -> String {
        format!("cannot apply {} {}: {}", self.kind, self.name, self.message)
    }
}

/// The status to write and the events to record after `failure`: `previous` with
/// `Ready=False`/[`APPLY_FAILED`] and `observedGeneration` set; one Warning event
/// unless `previous` already said exactly this.
pub fn apply_failed(
    previous: &InferenceServiceStatus,
    generation: i64,
    failure: &ApplyFailure,
    now: &Time,
) -> (InferenceServiceStatus, Vec<PlannedEvent>) {
    let note = failure.note();
    let computed = Computed::new(condition::READY, false, APPLY_FAILED, note.clone());
    let events = match conditions::change(&previous.conditions, &computed) {
        Change::Unchanged => Vec::new(),
        _ => vec![PlannedEvent {
            type_: EventType::Warning,
            reason: APPLY_FAILED,
            note,
        }],
    };
    let status = InferenceServiceStatus {
        observed_generation: Some(generation),
        conditions: conditions::merge(&previous.conditions, &[computed], generation, now),
        ..previous.clone()
    };
    (status, events)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::Timestamp;

    fn time(seconds: i64) -> Time {
        Time(Timestamp::from_second(seconds).unwrap_or(Timestamp::UNIX_EPOCH))
    }

    fn exhausted() -> ApplyFailure {
        ApplyFailure {
            kind: "Service",
            name: "chat-g3".into(),
            message: "Internal error occurred: failed to allocate a serviceIP: range is full"
                .into(),
        }
    }

    fn ready(status: &InferenceServiceStatus) -> (&str, &str, &str, &Time) {
        let c = status
            .conditions
            .iter()
            .find(|c| c.type_ == condition::READY)
            .expect("a Ready condition");
        (&c.status, &c.reason, &c.message, &c.last_transition_time)
    }

    #[test]
    fn a_refused_apply_is_reported_once_in_ready_and_as_a_warning() {
        let ready_before = InferenceServiceStatus {
            conditions: conditions::merge(
                &[],
                &[
                    Computed::new(condition::READY, true, "Enough", "3 of 3"),
                    Computed::new(condition::DEGRADED, false, "Healthy", ""),
                ],
                1,
                &time(10),
            ),
            ..InferenceServiceStatus::default()
        };
        let (first, events) = apply_failed(&ready_before, 2, &exhausted(), &time(20));
        assert_eq!(
            ready(&first),
            (
                "False",
                APPLY_FAILED,
                "cannot apply Service chat-g3: Internal error occurred: failed to allocate a serviceIP: range is full",
                &time(20)
            )
        );
        assert_eq!(first.observed_generation, Some(2));
        assert_eq!(events.len(), 1);
        assert_eq!(
            (events[0].type_, events[0].reason),
            (EventType::Warning, APPLY_FAILED)
        );
        assert!(events[0].note.contains("range is full"));
        // Other conditions are the previous status's, untouched.
        let degraded = |s: &InferenceServiceStatus| {
            s.conditions
                .iter()
                .find(|c| c.type_ == condition::DEGRADED)
                .cloned()
        };
        assert_eq!(degraded(&first), degraded(&ready_before));

        // The same failure on the next retry: the same status, no event.
        let (again, events) = apply_failed(&first, 2, &exhausted(), &time(30));
        assert_eq!(again, first);
        assert!(events.is_empty());

        // Another child refused: same condition status (time kept), a new event.
        let other = ApplyFailure {
            name: "chat-g4".into(),
            ..exhausted()
        };
        let (moved, events) = apply_failed(&again, 2, &other, &time(40));
        assert_eq!(ready(&moved).3, &time(20));
        assert_eq!(events.len(), 1);
    }

    #[test]
    fn a_new_object_that_never_applied_gets_a_status() {
        let (status, events) = apply_failed(
            &InferenceServiceStatus::default(),
            1,
            &exhausted(),
            &time(5),
        );
        assert_eq!(ready(&status).1, APPLY_FAILED);
        assert_eq!(events.len(), 1);
    }
}
