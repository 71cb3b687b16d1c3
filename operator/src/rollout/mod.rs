//! Canary rollouts of release bundles: a pure state machine [`decide`] that `plan`
//! calls with plain data (group counts per release, the previous status, the metrics
//! reading, `now`) and that returns how many groups each release gets and the rollout
//! part of the status. No I/O: the metrics are read by [`source`] before `plan`.
//!
//! Lifecycle (state lives in `status`, so a restarted operator resumes where it was):
//! - `spec.release` hashes to the stable release → steady; a canary in progress is
//!   removed at once (the spec was reverted).
//! - it hashes to a release in `failedReleases` → steady on stable; not retried while
//!   the spec names it (GitOps re-applying the same spec does not loop).
//! - otherwise a rollout: `canaryRelease {hash, step, weight, stepStartedAt}`. A new
//!   hash (also mid-canary) starts at step 0 and abandons the previous canary.
//!
//! One step at weight w of N groups: `c = ceil(N·w/100)` canary groups (at least 1),
//! enough to carry w % of the demand. The router splits requests by
//! `status.canaryRelease.weight` ([`request_weight`]), not by group count: it is w
//! once the c groups are ready, so a 10 % step of 3 groups sends 10 % of requests to
//! its one canary group, not a third. While fewer are ready it is what the ready ones
//! carry (`ready / N`, never above w), and 0 until one is ready: the canary never gets
//! more requests than its ready groups are sized for, and none before it serves.
//! **Surge first, then drain**: canary groups are added while the groups alive stay
//! within `N + maxSurge`; a stable group is removed only once a canary group is ready
//! to take its place (stable ≥ N − ready canary), and never while ready groups would
//! drop below N_healthy. The step's shape reached (c ready canary groups, N − c stable)
//! starts its clock (`stepStartedAt`); it advances after its pause, on a `Good`
//! analysis verdict only. A last step below 100 % is followed by an implicit 100 %
//! step. After the 100 % step the canary becomes stable.
//!
//! Rollback (burn rates over both windows, canary significantly worse than stable,
//! `inconclusivePolicy`, or canary groups not ready within `progressDeadline`): canary
//! groups go to zero (drained through preStop and grace), stable back to N, the hash
//! joins `failedReleases`, `lastRollback` says why. Stable capacity lost mid-rollout
//! (ready groups below N_healthy) pauses the rollout with a `Capacity` hold.

pub mod analysis;
pub mod source;

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use slipway_api::duration;
use slipway_api::spec::{InconclusivePolicy, RolloutSpec};
use slipway_api::status::{CanaryStatus, HoldGate, RollbackRecord, RolloutHold};

use crate::types::{EventType, PlannedEvent};
use analysis::{MetricsReading, Thresholds, Verdict, judge};

/// The reason of the event a rollback emits (the operator counts rollbacks by it).
pub const ROLLED_BACK_EVENT: &str = "RolledBack";

/// Most remembered failed releases (the CRD's bound); the oldest are forgotten first.
pub const MAX_FAILED_RELEASES: usize = 64;

/// Alive and ready groups of one release.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GroupCounts {
    /// Groups with live (not terminating) pods.
    pub alive: u32,
    /// Groups whose every pod is ready.
    pub ready: u32,
}

/// The rollout part of the previous status.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RolloutState {
    pub stable_release: Option<String>,
    pub canary_release: Option<CanaryStatus>,
    pub rollout_hold: Option<RolloutHold>,
    pub last_rollback: Option<RollbackRecord>,
    pub failed_releases: Vec<String>,
}

/// Everything [`decide`] looks at.
#[derive(Debug, Clone)]
pub struct Input<'a> {
    pub spec: &'a RolloutSpec,
    /// `slo.availability`: the objective burn rates are measured against.
    pub objective: f64,
    /// Short hash of the release the spec names.
    pub target: &'a str,
    /// Short hash of the release that serves now (status, or inferred from the pods).
    pub stable: &'a str,
    pub previous: &'a RolloutState,
    /// N_provisioned and N_healthy.
    pub desired: u32,
    pub needed: u32,
    pub stable_groups: GroupCounts,
    pub canary_groups: GroupCounts,
    pub metrics: Option<&'a MetricsReading>,
    pub now: &'a Time,
}

/// What the rollout wants.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// Groups that should run the stable release.
    pub stable_target: u32,
    /// Groups that should run the canary (`canary` names it).
    pub canary_target: u32,
    /// The canary release being rolled out, if any.
    pub canary: Option<String>,
    pub state: RolloutState,
    pub events: Vec<PlannedEvent>,
    /// Look again by then (analysis interval, a pause ending).
    pub requeue_after: Option<Duration>,
    /// A sentence for `Progressing` while a rollout runs.
    pub progress: Option<String>,
}

/// The analysis interval, parsed (30 s if unparsable; the CRD validates it).
pub fn interval(spec: &RolloutSpec) -> Duration {
    duration::parse(&spec.analysis.interval).unwrap_or(Duration::from_secs(30))
}

/// The steps with the implicit final 100 % step: (weight, pause).
fn steps(spec: &RolloutSpec) -> Vec<(u32, Option<Duration>)> {
    let mut steps: Vec<(u32, Option<Duration>)> = spec
        .steps
        .iter()
        .map(|s| {
            (
                u32::try_from(s.weight.clamp(1, 100)).unwrap_or(100),
                s.pause.as_deref().and_then(|p| duration::parse(p).ok()),
            )
        })
        .collect();
    if steps.last().is_none_or(|(w, _)| *w < 100) {
        steps.push((100, None));
    }
    steps
}

/// Canary groups for a weight: `ceil(N·w/100)`, within 1..=N.
pub fn canary_groups_for(desired: u32, weight: u32) -> u32 {
    (desired * weight).div_ceil(100).clamp(1, desired.max(1))
}

/// The request weight the router gives the canary at a step of `weight` percent with
/// `ready` of its groups ready among `desired`: the step's weight once the groups sized
/// for it are ready, else what the ready ones can carry (`ready / desired` of the
/// demand, rounded down), 0 with none ready. `canary_groups_for` rounds up, so the
/// groups of a step always carry at least its weight.
pub fn request_weight(weight: u32, desired: u32, ready: u32) -> u32 {
    let carried = (ready.min(desired) * 100).checked_div(desired).unwrap_or(0);
    weight.min(carried)
}

/// Whole seconds from `then` to `now` (0 if `then` is later).
fn elapsed(then: &Time, now: &Time) -> Duration {
    Duration::from_secs(u64::try_from(now.0.duration_since(then.0).as_secs()).unwrap_or(0))
}

fn steady(input: &Input<'_>, mut state: RolloutState, events: Vec<PlannedEvent>) -> Decision {
    state.stable_release = Some(input.stable.to_owned());
    state.canary_release = None;
    state.rollout_hold = None;
    Decision {
        stable_target: input.desired,
        canary_target: 0,
        canary: None,
        state,
        events,
        requeue_after: None,
        progress: None,
    }
}

/// The rollout state machine. See the module documentation.
pub fn decide(input: &Input<'_>) -> Decision {
    let previous = input.previous;
    let mut events = Vec::new();
    let state = previous.clone();
    if input.target == input.stable {
        if let Some(canary) = &previous.canary_release {
            events.push(PlannedEvent {
                type_: EventType::Normal,
                reason: "RolloutReverted",
                note: format!(
                    "spec names the stable release {} again: canary {} removed",
                    input.stable, canary.hash
                ),
            });
        }
        return steady(input, state, events);
    }
    if previous.failed_releases.iter().any(|f| f == input.target) {
        // The rollback itself already reported; staying put is silent.
        return steady(input, state, events);
    }

    let steps = steps(input.spec);
    let (step, started) = match &previous.canary_release {
        Some(c) if c.hash == input.target => (
            usize::try_from(c.step).unwrap_or(0).min(steps.len() - 1),
            c.step_started_at.clone(),
        ),
        other => {
            let note = match other {
                Some(old) => format!(
                    "rolling out {} (abandoning canary {} at step {})",
                    input.target, old.hash, old.step
                ),
                None => format!("rolling out {} over stable {}", input.target, input.stable),
            };
            events.push(PlannedEvent {
                type_: EventType::Normal,
                reason: "RolloutStarted",
                note,
            });
            (0, None)
        }
    };
    let (weight, pause) = steps[step];
    let n = input.desired;
    let c_target = canary_groups_for(n, weight);
    let s_target = n - c_target;
    let surge = u32::try_from(input.spec.max_surge.max(1)).unwrap_or(1);
    let (canary, stable) = (input.canary_groups, input.stable_groups);

    // Drain: a stable group goes only when a ready canary group replaces it, and
    // never below N_healthy ready groups.
    let ready_total = canary.ready + stable.ready;
    let capacity_lost = ready_total < input.needed;
    let floor_ready = stable
        .alive
        .saturating_sub(ready_total.saturating_sub(input.needed));
    let stable_now = s_target
        .max(n.saturating_sub(canary.ready.min(c_target)))
        .max(floor_ready.min(stable.alive));
    // Surge first: add canary groups within N + maxSurge alive groups, counting the
    // stable groups this plan keeps or adds (N can grow mid-rollout with demand).
    let room = (n + surge).saturating_sub(canary.alive + stable.alive.max(stable_now));
    let canary_now = canary.alive.min(c_target) + c_target.saturating_sub(canary.alive).min(room);

    let thresholds = thresholds(input);
    let verdict = match input.metrics {
        _ if canary.ready == 0 => Verdict::Inconclusive {
            reason: "no canary group is ready yet".to_owned(),
        },
        Some(reading) if reading.canary_release == input.target => {
            judge(&thresholds, reading, canary.ready, stable.ready)
        }
        _ => Verdict::Inconclusive {
            reason: "no metrics read for this canary yet".to_owned(),
        },
    };

    let mut decision = Decision {
        stable_target: stable_now,
        canary_target: canary_now,
        canary: Some(input.target.to_owned()),
        state: state.clone(),
        events,
        requeue_after: Some(interval(input.spec)),
        progress: None,
    };
    let step_label = format!("step {} of {} ({weight}%)", step + 1, steps.len());

    if let Verdict::Abort {
        reason,
        short_burn,
        long_burn,
    } = &verdict
    {
        return rollback(
            input,
            decision.events,
            reason.clone(),
            Some((*short_burn, *long_burn)),
        );
    }

    let hold = |gate: HoldGate, reason: String| -> RolloutHold {
        let since = match &previous.rollout_hold {
            Some(h) if h.gate == gate => h.since.clone(),
            _ => input.now.clone(),
        };
        RolloutHold {
            gate,
            reason,
            since,
        }
    };
    let reached = canary.ready >= c_target && stable.alive <= s_target;
    let mut started_at = if reached { started.clone() } else { None };
    let mut next_step = step;
    let mut rollout_hold = None;
    if capacity_lost {
        let h = hold(
            HoldGate::Capacity,
            format!(
                "stable capacity lost: {ready_total} ready groups, {} needed; the rollout is paused",
                input.needed
            ),
        );
        if previous
            .rollout_hold
            .as_ref()
            .is_none_or(|p| p.gate != HoldGate::Capacity)
        {
            decision.events.push(PlannedEvent {
                type_: EventType::Warning,
                reason: "RolloutPaused",
                note: h.reason.clone(),
            });
        }
        rollout_hold = Some(h);
        started_at = started.clone();
    } else if !reached {
        let h = if canary.ready >= c_target {
            hold(
                HoldGate::Capacity,
                format!(
                    "draining {} stable groups at {step_label}",
                    stable.alive - s_target
                ),
            )
        } else if canary_now < c_target && canary.ready >= canary.alive {
            hold(
                HoldGate::Capacity,
                format!(
                    "maxSurge {surge} leaves no room for another canary group until stable groups drain"
                ),
            )
        } else {
            hold(
                HoldGate::CanaryNotReady,
                format!(
                    "{} of {c_target} canary groups ready at {step_label}",
                    canary.ready
                ),
            )
        };
        if h.gate == HoldGate::CanaryNotReady {
            let deadline =
                duration::parse(&input.spec.progress_deadline).unwrap_or(Duration::from_secs(600));
            if elapsed(&h.since, input.now) >= deadline {
                return rollback(
                    input,
                    decision.events,
                    format!(
                        "progress deadline {} passed: {}",
                        input.spec.progress_deadline, h.reason
                    ),
                    None,
                );
            }
        }
        rollout_hold = Some(h);
    } else {
        let since = started.unwrap_or_else(|| input.now.clone());
        started_at = Some(since.clone());
        match verdict {
            Verdict::Inconclusive { reason } => {
                let policy = input.spec.analysis.inconclusive_policy;
                let h = hold(HoldGate::Inconclusive, reason.clone());
                let timeout = input
                    .spec
                    .analysis
                    .inconclusive_timeout
                    .as_deref()
                    .and_then(|t| duration::parse(t).ok());
                match (policy, timeout) {
                    (InconclusivePolicy::Rollback, _) => {
                        return rollback(
                            input,
                            decision.events,
                            format!("inconclusive: {reason}"),
                            None,
                        );
                    }
                    (InconclusivePolicy::RollbackAfter, Some(timeout))
                        if elapsed(&h.since, input.now) >= timeout =>
                    {
                        return rollback(
                            input,
                            decision.events,
                            format!(
                                "inconclusive for {}: {reason}",
                                input
                                    .spec
                                    .analysis
                                    .inconclusive_timeout
                                    .as_deref()
                                    .unwrap_or_default()
                            ),
                            None,
                        );
                    }
                    _ => rollout_hold = Some(h),
                }
            }
            Verdict::Warmup { reason } => {
                rollout_hold = Some(hold(HoldGate::MetricsWarmup, reason))
            }
            Verdict::Abort { .. } => {}
            Verdict::Good { .. } => {
                let waited = elapsed(&since, input.now);
                match pause {
                    Some(pause) if waited < pause => {
                        rollout_hold = Some(hold(
                            HoldGate::Pause,
                            format!(
                                "{step_label} pauses {} before the next step",
                                input
                                    .spec
                                    .steps
                                    .get(step)
                                    .and_then(|s| s.pause.clone())
                                    .unwrap_or_default()
                            ),
                        ));
                        let left = pause - waited;
                        decision.requeue_after = decision.requeue_after.map(|r| r.min(left));
                    }
                    _ if step + 1 < steps.len() => {
                        next_step = step + 1;
                        started_at = None;
                        decision.events.push(PlannedEvent {
                            type_: EventType::Normal,
                            reason: "StepAdvanced",
                            note: format!(
                                "canary {}: {step_label} passed; now step {} of {} ({}%)",
                                input.target,
                                next_step + 1,
                                steps.len(),
                                steps[next_step].0
                            ),
                        });
                    }
                    _ => {
                        decision.events.push(PlannedEvent {
                            type_: EventType::Normal,
                            reason: "Promoted",
                            note: format!(
                                "{} is stable after {} steps; {} drained",
                                input.target,
                                steps.len(),
                                input.stable
                            ),
                        });
                        let mut state = state;
                        state.stable_release = Some(input.target.to_owned());
                        state.canary_release = None;
                        state.rollout_hold = None;
                        return Decision {
                            stable_target: n,
                            canary_target: 0,
                            canary: None,
                            state,
                            events: decision.events,
                            requeue_after: None,
                            progress: None,
                        };
                    }
                }
            }
        }
    }
    let current_weight = i32::try_from(request_weight(weight, n, canary.ready)).unwrap_or(0);
    decision.state.stable_release = Some(input.stable.to_owned());
    decision.state.canary_release = Some(CanaryStatus {
        hash: input.target.to_owned(),
        step: i32::try_from(next_step).unwrap_or(0),
        weight: current_weight,
        step_started_at: started_at,
    });
    decision.progress = Some(match &rollout_hold {
        Some(h) => format!("canary {} at {step_label}: {}", input.target, h.reason),
        None => format!("canary {} at {step_label}", input.target),
    });
    decision.state.rollout_hold = rollout_hold;
    decision
}

fn thresholds(input: &Input<'_>) -> Thresholds {
    let a = &input.spec.analysis;
    Thresholds {
        objective: input.objective,
        short_window: a.short_window.clone(),
        long_window: a.long_window.clone(),
        short_burn: a.short_burn_rate_threshold,
        long_burn: a.long_burn_rate_threshold,
        min_requests: f64::from(a.min_requests.max(1)),
    }
}

fn rollback(
    input: &Input<'_>,
    mut events: Vec<PlannedEvent>,
    reason: String,
    burns: Option<(f64, f64)>,
) -> Decision {
    let mut state = input.previous.clone();
    state.failed_releases.retain(|f| f != input.target);
    state.failed_releases.push(input.target.to_owned());
    if state.failed_releases.len() > MAX_FAILED_RELEASES {
        let extra = state.failed_releases.len() - MAX_FAILED_RELEASES;
        state.failed_releases.drain(..extra);
    }
    let round = |x: f64| (x * 100.0).round() / 100.0;
    state.last_rollback = Some(RollbackRecord {
        release: input.target.to_owned(),
        reason: reason.clone(),
        short_burn_rate: burns.map(|b| round(b.0)),
        long_burn_rate: burns.map(|b| round(b.1)),
        time: input.now.clone(),
    });
    events.push(PlannedEvent {
        type_: EventType::Warning,
        reason: ROLLED_BACK_EVENT,
        note: format!("rolled back {} to {}: {reason}", input.target, input.stable),
    });
    steady(input, state, events)
}

/// `RolledBack`: True while the spec still names the last rolled-back release.
pub fn rolled_back_condition(
    target: &str,
    state: &RolloutState,
) -> Option<crate::conditions::Computed> {
    let last = state.last_rollback.as_ref()?;
    let burns = match (last.short_burn_rate, last.long_burn_rate) {
        (Some(s), Some(l)) => format!(" (burn rates: short {s}, long {l})"),
        _ => String::new(),
    };
    Some(if last.release == target {
        crate::conditions::Computed::new(
            slipway_api::status::condition::ROLLED_BACK,
            true,
            "CanaryFailed",
            format!(
                "release {} was rolled back: {}{burns}; it is not retried while the spec names it",
                last.release, last.reason
            ),
        )
    } else {
        crate::conditions::Computed::new(
            slipway_api::status::condition::ROLLED_BACK,
            false,
            "SpecMovedOn",
            format!(
                "the spec no longer names {}, the last release rolled back",
                last.release
            ),
        )
    })
}

/// Which release each group index runs: existing groups keep their release while
/// their release still needs them, new groups take the lowest indices without live
/// pods (stable first; an index whose pods are still terminating is reused once they
/// are gone, as names are). `existing` maps indices with live pods to their release;
/// groups of other releases are left out, so they are drained.
///
/// When a release has more groups than it needs, the surplus is taken where it hurts
/// a fault-domain loss least: unplaced groups first (they serve nothing), then from
/// the domain holding the most kept groups (`placed`: index → domain of its leader),
/// highest index first among equals. Removing by index alone could empty one domain
/// while another keeps two, so that losing it leaves too few.
pub fn assign(
    existing: &std::collections::BTreeMap<u32, String>,
    wants: &[(&str, u32)],
    placed: &std::collections::BTreeMap<u32, String>,
) -> std::collections::BTreeMap<u32, String> {
    let mut out: std::collections::BTreeMap<u32, String> = existing
        .iter()
        .filter(|(_, release)| wants.iter().any(|(r, _)| r == release))
        .map(|(&index, release)| (index, release.clone()))
        .collect();
    for (release, count) in wants {
        loop {
            let mine: Vec<u32> = out
                .iter()
                .filter(|(_, r)| r.as_str() == *release)
                .map(|(&index, _)| index)
                .collect();
            if mine.len() <= *count as usize {
                break;
            }
            let mut load: std::collections::BTreeMap<&str, usize> =
                std::collections::BTreeMap::new();
            for index in out.keys() {
                if let Some(domain) = placed.get(index) {
                    *load.entry(domain.as_str()).or_default() += 1;
                }
            }
            let surplus = mine.iter().copied().max_by_key(|index| {
                let domain = placed.get(index);
                (
                    domain.is_none(),
                    domain.map_or(0, |d| load.get(d.as_str()).copied().unwrap_or(0)),
                    *index,
                )
            });
            if let Some(index) = surplus {
                out.remove(&index);
            }
        }
    }
    let mut next = 0u32;
    for (release, count) in wants {
        let have =
            u32::try_from(out.values().filter(|r| r.as_str() == *release).count()).unwrap_or(0);
        for _ in have..*count {
            while out.contains_key(&next) || existing.contains_key(&next) {
                next += 1;
            }
            out.insert(next, (*release).to_owned());
            next += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_weight_is_the_steps_once_its_groups_are_ready() {
        // (step weight, groups, ready canary groups) → request weight
        for (weight, desired, ready, expected) in [
            (10, 3, 0, 0),   // nothing serves yet
            (10, 3, 1, 10),  // one group carries 10 %, not the 33 % its count would say
            (50, 3, 1, 33),  // the 50 % step sized 2 groups; one ready carries a third
            (50, 3, 2, 50),  // both ready: the step's weight
            (1, 10, 1, 1),   // 1 % granularity
            (100, 4, 3, 75), // the last step while its groups come up
            (100, 4, 4, 100),
            (25, 0, 0, 0), // no groups at all
        ] {
            assert_eq!(
                request_weight(weight, desired, ready),
                expected,
                "step {weight} %, {ready} of {desired} groups ready"
            );
            assert!(ready < canary_groups_for(desired, weight) || expected == weight);
        }
    }
}
