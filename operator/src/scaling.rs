//! How many healthy groups the demand needs, decided purely from the spec, the last
//! decision (in status), the demand reading and the time.
//!
//! `D_peak` is the spec's static number, or measured:
//! `max(peak over peakWindow, current + rise over one cold start, static floor)` ×
//! (1 + headroom). The rise is the current rate's increase over the last rate window,
//! extrapolated over the groups' measured cold start: a group asked for now serves
//! only that much later. The capacity rule stays `slipway_api::capacity`'s
//! (`N_healthy = ceil(D_peak / G)`, then `fLoss` on top, min/max).
//!
//! Hysteresis, against the last decision (`status.replicas.healthyNeeded`):
//! - **up** at once, by as many groups as needed;
//! - **down** only once the need has stayed lower for `scaleDownStabilization`
//!   (`status.capacity.scaleDownPendingSince`), one healthy group per step, the next
//!   step only after the last one's groups drained, and never while a rollout runs;
//! - **no usable reading** holds the last decision and says why in `DemandKnown`. It
//!   never scales to the minimum; a new object with no data yet starts from the static
//!   floor, else from `minReplicas`.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use slipway_api::capacity::{CapacityError, CapacityInput, CapacityPlan, plan_capacity};
use slipway_api::spec::{CapacitySpec, DemandUnit};
use slipway_api::status::{CapacityStatus, DemandStatus, InferenceServiceStatus, condition};

use crate::conditions::Computed;
use crate::demand::{DemandReading, Windows};
use crate::observed::ObservedPod;

/// Everything the decision reads.
#[derive(Debug, Clone, Copy)]
pub struct Input<'a> {
    pub spec: &'a CapacitySpec,
    /// The status the last reconcile wrote.
    pub previous: &'a InferenceServiceStatus,
    /// The demand reading (measured demand only).
    pub demand: Option<&'a DemandReading>,
    /// A rollout is in progress: no scale-down.
    pub rolling: bool,
    /// Groups are still draining or starting: the next scale-down step waits.
    pub settling: bool,
    /// The groups' cold start, freshly measured or as status last recorded.
    pub cold_start: Option<Duration>,
    pub now: &'a Time,
}

/// The decision.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub capacity: CapacityPlan,
    /// `status.capacity` (cold start is filled in by the caller).
    pub status: CapacityStatus,
    /// `DemandKnown`.
    pub condition: Computed,
    /// The numbers behind the count, for events: "measured demand 2.4 req/s (peak over
    /// 15m, +10 % headroom) needs 5 healthy groups, 8 with fLoss 0.34".
    pub why: String,
    /// A scale-down just became pending: its event note.
    pub pending_note: Option<String>,
    /// When to look again (the next reading, or a stabilisation window ending).
    pub requeue_after: Option<Duration>,
}

/// Short unit for messages.
pub fn unit_name(unit: DemandUnit) -> &'static str {
    match unit {
        DemandUnit::RequestsPerSecond => "req/s",
        DemandUnit::OutputTokensPerSecond => "tokens/s",
    }
}

/// Decides the capacity. See the module documentation.
///
/// # Errors
/// [`CapacityError`] when the spec's numbers cannot be planned (the CRD rejects them).
pub fn decide(input: &Input<'_>) -> Result<Decision, CapacityError> {
    let spec = input.spec;
    let unit = unit_name(spec.demand_unit);
    let floor = spec.demand.static_peak;
    let Some(measured) = &spec.demand.measured else {
        let demand = floor.unwrap_or(0.0);
        let capacity = plan_capacity(&CapacityInput::new(spec, demand))?;
        return Ok(Decision {
            capacity,
            status: CapacityStatus::default(),
            condition: Computed::new(
                condition::DEMAND_KNOWN,
                true,
                "Static",
                format!(
                    "static demand {} {unit} (spec.capacity.demand.static)",
                    round(demand)
                ),
            ),
            why: format!(
                "static demand {} {unit} {}",
                round(demand),
                needs(spec, &capacity)
            ),
            pending_note: None,
            requeue_after: None,
        });
    };
    let windows = Windows::of(measured);
    let previous_capacity = input.previous.capacity.clone().unwrap_or_default();
    let last_healthy = u32::try_from(input.previous.replicas.healthy_needed)
        .ok()
        .filter(|_| input.previous.observed_generation.is_some());

    let usable = input
        .demand
        .filter(|r| r.missing.is_none() && r.at.is_some());
    let (target, demand_status, condition, basis) = match usable {
        Some(reading) => {
            let peak_window = windows.peak.as_secs();
            // After an operator restart the source has seen less than the peak window:
            // the peak recorded in status still counts while it is inside the window.
            let mut peak = reading.peak;
            if reading.covered_seconds < peak_window
                && let Some(recorded) = &previous_capacity.demand
                && seconds_between(&recorded.measured_at, input.now) < peak_window
            {
                peak = peak.max(recorded.peak);
            }
            let rise = reading
                .previous
                .map_or(0.0, |before| (reading.current - before).max(0.0));
            let ahead = input.cold_start.map_or(0.0, |cold| {
                rise * cold.as_secs_f64() / windows.rate.as_secs_f64()
            });
            let predicted = reading.current + ahead;
            let base = peak.max(predicted).max(floor.unwrap_or(0.0));
            let demand = base * (1.0 + measured.headroom);
            let capacity = plan_capacity(&CapacityInput::new(spec, demand))?;
            let basis = if floor.is_some_and(|f| f >= peak.max(predicted)) {
                format!("the static floor {} {unit}", round(base))
            } else if predicted > peak {
                format!(
                    "{} {unit} expected in one cold start ({} s) at the current rise",
                    round(predicted),
                    input.cold_start.map_or(0, |c| c.as_secs())
                )
            } else {
                format!("peak {} {unit} over {}", round(peak), measured.peak_window)
            };
            let status = DemandStatus {
                current: round(reading.current),
                peak: round(peak),
                source: reading.source.clone(),
                measured_at: reading.at.clone().unwrap_or_else(|| input.now.clone()),
            };
            let message = format!(
                "{} {unit} now, peak {} {unit} over {}, from {}",
                round(reading.current),
                round(peak),
                measured.peak_window,
                reading.source
            );
            (
                capacity.healthy_needed,
                Some(status),
                Computed::new(condition::DEMAND_KNOWN, true, "Measured", message),
                format!(
                    "measured demand {} {unit} ({basis}, +{:.0} % headroom)",
                    round(demand),
                    measured.headroom * 100.0
                ),
            )
        }
        None => {
            let why = input
                .demand
                .and_then(|r| r.missing.clone())
                .unwrap_or_else(|| "not read yet".to_owned());
            let start = || {
                plan_capacity(&CapacityInput::new(spec, floor.unwrap_or(0.0)))
                    .map(|c| c.healthy_needed)
            };
            let (held, basis) = match (last_healthy, floor) {
                (Some(held), _) => (
                    held,
                    format!("measured demand unavailable ({why}), the last decision holds:"),
                ),
                (None, Some(floor)) => (
                    start()?,
                    format!(
                        "measured demand not read yet ({why}), starting from the static floor {} {unit}:",
                        round(floor)
                    ),
                ),
                (None, None) => (
                    start()?,
                    format!("measured demand not read yet ({why}), starting from minReplicas:"),
                ),
            };
            (
                held,
                previous_capacity.demand.clone(),
                Computed::new(
                    condition::DEMAND_KNOWN,
                    false,
                    "NoDemandData",
                    format!("measured demand unavailable ({why}); holding {held} healthy groups"),
                ),
                basis,
            )
        }
    };

    // Hysteresis against the last decision. Without data there is nothing to compare:
    // the last decision and any pending scale-down stay as they are.
    let mut pending = previous_capacity.scale_down_pending_since.clone();
    let mut pending_note = None;
    let mut requeue = Some(windows.interval());
    let healthy = match (usable, last_healthy) {
        (None, _) | (Some(_), None) => target,
        (Some(_), Some(last)) if target >= last => {
            pending = None;
            target
        }
        (Some(_), Some(last)) => {
            let since = pending.get_or_insert_with(|| {
                pending_note = Some(format!(
                    "demand needs {target} healthy groups, {last} decided: one is removed once the need has stayed lower for {}",
                    measured.scale_down_stabilization
                ));
                input.now.clone()
            });
            let waited = Duration::from_secs(seconds_between(since, input.now));
            if input.rolling || input.settling {
                last
            } else if waited >= windows.stabilization {
                last - 1
            } else {
                let left = windows.stabilization - waited;
                requeue = requeue.map(|r| r.min(left));
                last
            }
        }
    };
    let capacity = healthy_plan(spec, healthy)?;
    let why = if healthy > target {
        format!(
            "{basis} needs {target} healthy groups; {healthy} kept ({} with fLoss {}) until the need has stayed lower for {}",
            capacity.provisioned, spec.fault_domain.f_loss, measured.scale_down_stabilization
        )
    } else {
        format!("{basis} {}", needs(spec, &capacity))
    };
    Ok(Decision {
        why,
        capacity,
        status: CapacityStatus {
            demand: demand_status,
            cold_start_seconds: None,
            scale_down_pending_since: pending,
        },
        condition,
        pending_note,
        requeue_after: requeue,
    })
}

/// The cold start of the most recently created group whose pods are all ready: from
/// its first pod's creation to its last pod's readiness. `None` until such a group
/// exists (its pods carry both times).
pub fn cold_start(pods: &[ObservedPod]) -> Option<Duration> {
    let mut groups: BTreeMap<u32, Vec<&ObservedPod>> = BTreeMap::new();
    for pod in pods.iter().filter(|p| !p.terminating) {
        groups.entry(pod.group).or_default().push(pod);
    }
    groups
        .values()
        .filter_map(|pods| {
            let created = pods.iter().map(|p| p.created.as_ref()).min()??;
            let mut ready = Vec::new();
            for pod in pods {
                ready.push(pod.ready_since.as_ref().filter(|_| pod.ready)?);
            }
            let ready = ready.into_iter().max()?;
            Some((created.clone(), seconds_between(created, ready)))
        })
        .max_by(|a, b| a.0.0.cmp(&b.0.0))
        .map(|(_, seconds)| Duration::from_secs(seconds))
}

/// The plan for exactly `healthy` healthy groups.
fn healthy_plan(spec: &CapacitySpec, healthy: u32) -> Result<CapacityPlan, CapacityError> {
    plan_capacity(&CapacityInput::new(
        spec,
        f64::from(healthy) * spec.replica_goodput,
    ))
}

fn needs(spec: &CapacitySpec, capacity: &CapacityPlan) -> String {
    format!(
        "needs {} healthy groups, {} with fLoss {}",
        capacity.healthy_needed, capacity.provisioned, spec.fault_domain.f_loss
    )
}

/// Three decimals: enough for rates, and stable in status.
fn round(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

fn seconds_between(then: &Time, now: &Time) -> u64 {
    u64::try_from(now.0.duration_since(then.0).as_secs()).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::Timestamp;
    use proptest::prelude::*;
    use slipway_api::spec::{DemandSpec, MeasuredDemand};
    use slipway_api::status::ReplicaCounts;

    fn spec(floor: Option<f64>) -> CapacitySpec {
        serde_json::from_value(serde_json::json!({
            "demand": {"measured": {"rateWindow": "1m", "peakWindow": "5m", "headroom": 0.1, "scaleDownStabilization": "2m"}},
            "replicaGoodput": 1.0,
            "faultDomain": {"fLoss": 0.34},
            "maxReplicas": 1000,
        }))
        .map(|mut s: CapacitySpec| {
            s.demand = DemandSpec {
                static_peak: floor,
                measured: Some(MeasuredDemand {
                    headroom: 0.1,
                    ..MeasuredDemand::default()
                }),
            };
            s
        })
        .unwrap()
    }

    fn at(seconds: i64) -> Time {
        Time(Timestamp::from_second(1_767_225_600 + seconds).unwrap())
    }

    fn previous(healthy: u32, pending_for: Option<i64>, now: i64) -> InferenceServiceStatus {
        InferenceServiceStatus {
            observed_generation: Some(1),
            replicas: ReplicaCounts {
                healthy_needed: i32::try_from(healthy).unwrap(),
                ..ReplicaCounts::default()
            },
            capacity: Some(CapacityStatus {
                scale_down_pending_since: pending_for.map(|s| at(now - s)),
                ..CapacityStatus::default()
            }),
            ..InferenceServiceStatus::default()
        }
    }

    fn reading(current: f64, peak: f64, now: i64) -> DemandReading {
        DemandReading {
            current,
            peak: peak.max(current),
            previous: Some(current),
            covered_seconds: 600,
            source: "test".to_owned(),
            at: Some(at(now)),
            missing: None,
        }
    }

    #[test]
    fn tokens_are_named_in_the_reason() {
        let mut s = spec(None);
        s.demand_unit = DemandUnit::OutputTokensPerSecond;
        let r = reading(120.0, 120.0, 0);
        let d = decide(&Input {
            spec: &s,
            previous: &previous(10, None, 0),
            demand: Some(&r),
            rolling: false,
            settling: false,
            cold_start: None,
            now: &at(0),
        })
        .unwrap();
        // 120 tokens/s + 10 % at 1 token/s per group: 132 healthy groups.
        assert_eq!(d.capacity.healthy_needed, 132);
        assert!(d.why.contains("132 tokens/s"), "{}", d.why);
    }

    proptest! {
        /// Whatever the reading: scale-down is at most one group per decision, never
        /// during a rollout or while groups settle, never before the stabilisation
        /// window; without data nothing changes; scale-up is never held back.
        #[test]
        fn one_step_down_at_most_and_only_when_allowed(
            last in 1u32..40,
            current in 0.0f64..60.0,
            peak_extra in 0.0f64..10.0,
            pending_for in proptest::option::of(0i64..400),
            rolling: bool,
            settling: bool,
            missing: bool,
        ) {
            let now = 1000;
            let s = spec(None);
            let mut r = reading(current, current + peak_extra, now);
            if missing {
                r.missing = Some("unreadable".to_owned());
            }
            let d = decide(&Input {
                spec: &s,
                previous: &previous(last, pending_for, now),
                demand: Some(&r),
                rolling,
                settling,
                cold_start: None,
                now: &at(now),
            }).unwrap();
            let healthy = d.capacity.healthy_needed;
            let wanted = ((current + peak_extra) * 1.1 * 1000.0).round() / 1000.0;
            let wanted = wanted.ceil() as u32;
            if missing {
                prop_assert_eq!(healthy, last);
            } else if wanted >= last {
                prop_assert_eq!(healthy, wanted);
            } else {
                prop_assert!(healthy == last || healthy == last - 1);
                if healthy == last - 1 {
                    prop_assert!(!rolling && !settling);
                    prop_assert!(pending_for.is_some_and(|p| p >= 120));
                }
            }
        }
    }
}
