//! Status conditions: computed purely, merged so `lastTransitionTime` moves only when
//! a condition's status flips, and turned into events only on transitions.
//!
//! Invariants: a condition type the operator does not compute (e.g. `RolledBack`,
//! owned by rollouts) is kept as it is; every computed condition carries the
//! generation it was computed from; an unchanged condition produces no event, so a
//! no-op reconcile emits nothing.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

/// A condition as `plan` decides it, before merging.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Computed {
    pub type_: &'static str,
    pub status: bool,
    pub reason: &'static str,
    pub message: String,
}

impl Computed {
    pub fn new(
        type_: &'static str,
        status: bool,
        reason: &'static str,
        message: impl Into<String>,
    ) -> Self {
        Self {
            type_,
            status,
            reason,
            message: message.into(),
        }
    }
}

fn status_string(status: bool) -> String {
    if status { "True" } else { "False" }.to_owned()
}

/// Merges freshly computed conditions into the previous ones.
pub fn merge(
    previous: &[Condition],
    computed: &[Computed],
    generation: i64,
    now: &Time,
) -> Vec<Condition> {
    let mut merged: Vec<Condition> = previous
        .iter()
        .filter(|old| !computed.iter().any(|new| new.type_ == old.type_))
        .cloned()
        .collect();
    for new in computed {
        let status = status_string(new.status);
        let last_transition_time = previous
            .iter()
            .find(|old| old.type_ == new.type_ && old.status == status)
            .map_or_else(|| now.clone(), |old| old.last_transition_time.clone());
        merged.push(Condition {
            type_: new.type_.to_owned(),
            status,
            reason: new.reason.to_owned(),
            message: new.message.clone(),
            observed_generation: Some(generation),
            last_transition_time,
        });
    }
    // A stable order keeps the status patch identical when nothing changed.
    merged.sort_by(|a, b| a.type_.cmp(&b.type_));
    merged
}

/// How a condition changed between the previous status and this plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// It did not exist before.
    New,
    /// Its status flipped.
    Flipped,
    /// Same status, another reason.
    Reason,
    /// Same status and reason, another message.
    Message,
    Unchanged,
}

/// Compares a computed condition with its previous state.
pub fn change(previous: &[Condition], new: &Computed) -> Change {
    match previous.iter().find(|old| old.type_ == new.type_) {
        None => Change::New,
        Some(old) if old.status != status_string(new.status) => Change::Flipped,
        Some(old) if old.reason != new.reason => Change::Reason,
        Some(old) if old.message != new.message => Change::Message,
        Some(_) => Change::Unchanged,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::Timestamp;

    fn time(seconds: i64) -> Time {
        Time(Timestamp::from_second(seconds).unwrap_or(Timestamp::UNIX_EPOCH))
    }

    #[test]
    fn transition_time_moves_only_on_a_flip() {
        let first = merge(
            &[],
            &[Computed::new("Ready", false, "Starting", "0 of 3")],
            1,
            &time(100),
        );
        assert_eq!(first[0].last_transition_time, time(100));

        let same = merge(
            &first,
            &[Computed::new("Ready", false, "Waiting", "1 of 3")],
            2,
            &time(200),
        );
        assert_eq!(
            same[0].last_transition_time,
            time(100),
            "reason/message changes keep the time"
        );
        assert_eq!(same[0].observed_generation, Some(2));

        let flipped = merge(
            &same,
            &[Computed::new("Ready", true, "Enough", "3 of 3")],
            2,
            &time(300),
        );
        assert_eq!(flipped[0].last_transition_time, time(300));
    }

    #[test]
    fn conditions_owned_by_others_are_kept() {
        let rolled_back = Condition {
            type_: "RolledBack".to_owned(),
            status: "True".to_owned(),
            reason: "BurnRate".to_owned(),
            message: String::new(),
            observed_generation: Some(1),
            last_transition_time: time(1),
        };
        let merged = merge(
            std::slice::from_ref(&rolled_back),
            &[Computed::new("Ready", true, "Enough", "")],
            3,
            &time(5),
        );
        assert!(merged.contains(&rolled_back));
        assert_eq!(merged.len(), 2);
    }

    #[test]
    fn changes_are_classified() {
        let previous = merge(
            &[],
            &[Computed::new("Ready", true, "Enough", "3 of 3")],
            1,
            &time(1),
        );
        assert_eq!(
            change(&previous, &Computed::new("Ready", true, "Enough", "3 of 3")),
            Change::Unchanged
        );
        assert_eq!(
            change(&previous, &Computed::new("Ready", true, "Enough", "4 of 3")),
            Change::Message
        );
        assert_eq!(
            change(&previous, &Computed::new("Ready", true, "Other", "3 of 3")),
            Change::Reason
        );
        assert_eq!(
            change(
                &previous,
                &Computed::new("Ready", false, "Enough", "3 of 3")
            ),
            Change::Flipped
        );
        assert_eq!(
            change(&previous, &Computed::new("Degraded", false, "Healthy", "")),
            Change::New
        );
    }
}
