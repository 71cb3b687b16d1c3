//! Capacity math: how many groups carry the peak, how many to run so a fault-domain
//! loss still leaves enough, and whether an actual placement achieves that.
//!
//! `N_healthy = ceil(D_peak / G_replica)` and
//! `N_provisioned = max(minReplicas, ceil(N_healthy / (1 − fLoss)))`, capped at
//! `maxReplicas`.
//!
//! The spec's numbers are decimals a person typed (`7.5`, `0.34`). Dividing them as
//! floating point puts `ceil` one off on exact boundaries (`0.3 * 3 / 0.3` is not 3), so
//! every input is first rounded to an integer count of thousandths ([`RESOLUTION`]) and
//! the divisions are exact integer ceilings.

use std::collections::BTreeMap;

/// Inputs are read to this many parts per unit (0.001).
pub const RESOLUTION: u64 = 1000;

/// Why capacity cannot be computed from a spec. The CRD's validation rejects these
/// before they reach the operator; this type keeps the function total anyway.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CapacityError {
    #[error("replicaGoodput {0} is not positive at a resolution of 0.001")]
    GoodputNotPositive(f64),
    #[error("peak demand {0} must be a finite number ≥ 0")]
    DemandInvalid(f64),
    #[error("fLoss {0} must be at least 0 and less than 1 (at a resolution of 0.001)")]
    FLossOutOfRange(f64),
    #[error("minReplicas {min} exceeds maxReplicas {max}")]
    MinAboveMax { min: u32, max: u32 },
    #[error("{0} is too large to plan for")]
    Overflow(&'static str),
}

/// The capacity fields of a spec, as plain numbers; `peak_demand` is `D_peak`, static
/// or measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CapacityInput {
    pub peak_demand: f64,
    pub replica_goodput: f64,
    pub f_loss: f64,
    pub min_replicas: u32,
    pub max_replicas: u32,
}

impl CapacityInput {
    /// The spec's numbers with `peak_demand` as the demand to size for.
    #[must_use]
    pub fn new(spec: &crate::spec::CapacitySpec, peak_demand: f64) -> Self {
        Self {
            peak_demand,
            replica_goodput: spec.replica_goodput,
            f_loss: spec.fault_domain.f_loss,
            min_replicas: u32::try_from(spec.min_replicas).unwrap_or(0),
            max_replicas: u32::try_from(spec.max_replicas).unwrap_or(0),
        }
    }
}

/// How many groups to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CapacityPlan {
    /// Groups that carry the peak: `ceil(D_peak / G_replica)`.
    pub healthy_needed: u32,
    /// Groups fault tolerance asks for before the `maxReplicas` cap.
    pub fault_tolerant_target: u32,
    /// Groups to run: the target, at least `minReplicas`, at most `maxReplicas`.
    pub provisioned: u32,
    /// True when `maxReplicas` cut the count below what fault tolerance needs: losing
    /// an `fLoss` share of groups would then leave fewer than `healthy_needed`.
    pub capped: bool,
}

fn to_thousandths(value: f64) -> Option<u64> {
    let scaled = (value * RESOLUTION as f64).round();
    // `as` saturates; reject what saturated or was never finite.
    (value.is_finite() && scaled >= 0.0 && scaled < u64::MAX as f64).then_some(scaled as u64)
}

/// Computes `N_healthy` and `N_provisioned` for a spec.
///
/// # Errors
/// Returns [`CapacityError`] for a goodput that rounds to zero, a negative or
/// non-finite demand, an `fLoss` outside `[0, 1)`, or `minReplicas > maxReplicas`.
pub fn plan_capacity(input: &CapacityInput) -> Result<CapacityPlan, CapacityError> {
    let demand =
        to_thousandths(input.peak_demand).ok_or(CapacityError::DemandInvalid(input.peak_demand))?;
    let goodput = to_thousandths(input.replica_goodput)
        .filter(|&g| g > 0)
        .ok_or(CapacityError::GoodputNotPositive(input.replica_goodput))?;
    let f_loss = to_thousandths(input.f_loss)
        .filter(|&f| f < RESOLUTION)
        .ok_or(CapacityError::FLossOutOfRange(input.f_loss))?;
    if input.min_replicas > input.max_replicas {
        return Err(CapacityError::MinAboveMax {
            min: input.min_replicas,
            max: input.max_replicas,
        });
    }

    let healthy_needed = u32::try_from(demand.div_ceil(goodput))
        .map_err(|_| CapacityError::Overflow("peak demand / replicaGoodput"))?;
    let surviving_share = RESOLUTION - f_loss;
    let fault_tolerant_target =
        u32::try_from((u64::from(healthy_needed) * RESOLUTION).div_ceil(surviving_share))
            .map_err(|_| CapacityError::Overflow("N_healthy / (1 - fLoss)"))?;
    let wanted = fault_tolerant_target.max(input.min_replicas);
    let provisioned = wanted.min(input.max_replicas);
    Ok(CapacityPlan {
        healthy_needed,
        fault_tolerant_target,
        provisioned,
        capped: provisioned < fault_tolerant_target,
    })
}

/// What losing the worst fault domain would do to a placement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DomainLossReport {
    /// The domain holding the most groups (ties: the first by name). `None` when no
    /// group is placed.
    pub worst_domain: Option<String>,
    /// Groups in the worst domain.
    pub groups_lost: u32,
    /// Placed groups left after losing the worst domain.
    pub groups_left: u32,
    /// Whether `groups_left ≥ healthy_needed`.
    pub tolerant: bool,
    /// How many groups short of `healthy_needed` the survivors are (0 when tolerant).
    pub shortfall: u32,
}

/// Checks a placement: given how many groups run in each fault domain, does losing the
/// worst domain keep at least `healthy_needed` groups?
///
/// Groups not yet placed on a node belong to no domain and are not counted: they serve
/// nothing, so they cannot be relied on after a loss either.
pub fn worst_domain_loss(
    groups_per_domain: &BTreeMap<String, u32>,
    healthy_needed: u32,
) -> DomainLossReport {
    let placed: u32 = groups_per_domain.values().sum();
    // `max_by_key` keeps the last maximum; iterate in reverse so ties go to the first name.
    let worst = groups_per_domain
        .iter()
        .rev()
        .max_by_key(|(_, groups)| **groups);
    let (worst_domain, groups_lost) = match worst {
        Some((domain, groups)) => (Some(domain.clone()), *groups),
        None => (None, 0),
    };
    let groups_left = placed - groups_lost;
    DomainLossReport {
        worst_domain,
        groups_lost,
        groups_left,
        tolerant: groups_left >= healthy_needed,
        shortfall: healthy_needed.saturating_sub(groups_left),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn input(demand: f64, goodput: f64, f_loss: f64) -> CapacityInput {
        CapacityInput {
            peak_demand: demand,
            replica_goodput: goodput,
            f_loss,
            min_replicas: 1,
            max_replicas: 1000,
        }
    }

    #[test]
    fn three_zones_survive_one() {
        let plan = plan_capacity(&input(20.0, 3.0, 0.34)).unwrap();
        assert_eq!(plan.healthy_needed, 7);
        // ceil(7 / 0.66) = ceil(10.6) = 11
        assert_eq!(plan.provisioned, 11);
        assert!(!plan.capped);
    }

    #[test]
    fn exact_boundaries_do_not_round_up() {
        // 0.3 * 3 / 0.3 in f64 is 3.0000000000000004: a float ceil would ask for 4.
        assert_eq!(
            plan_capacity(&input(0.3 * 3.0, 0.3, 0.0))
                .unwrap()
                .healthy_needed,
            3
        );
        assert_eq!(
            plan_capacity(&input(7.5, 2.5, 0.0)).unwrap().healthy_needed,
            3
        );
        // N_healthy = 3, fLoss = 0.25: 3 / 0.75 = 4 exactly.
        assert_eq!(
            plan_capacity(&input(3.0, 1.0, 0.25)).unwrap().provisioned,
            4
        );
        // One thousandth more demand needs one more group.
        assert_eq!(
            plan_capacity(&input(7.501, 2.5, 0.0))
                .unwrap()
                .healthy_needed,
            4
        );
    }

    #[test]
    fn min_and_max_bound_the_count() {
        let mut spec = input(1.0, 10.0, 0.0);
        spec.min_replicas = 3;
        assert_eq!(plan_capacity(&spec).unwrap().provisioned, 3);

        let mut spec = input(100.0, 1.0, 0.5);
        spec.max_replicas = 150;
        let plan = plan_capacity(&spec).unwrap();
        assert_eq!(plan.fault_tolerant_target, 200);
        assert_eq!(plan.provisioned, 150);
        assert!(plan.capped);
    }

    #[test]
    fn invalid_inputs_are_errors_not_panics() {
        assert!(matches!(
            plan_capacity(&input(1.0, 0.0, 0.0)),
            Err(CapacityError::GoodputNotPositive(_))
        ));
        assert!(matches!(
            plan_capacity(&input(1.0, 0.0004, 0.0)),
            Err(CapacityError::GoodputNotPositive(_))
        ));
        assert!(matches!(
            plan_capacity(&input(f64::NAN, 1.0, 0.0)),
            Err(CapacityError::DemandInvalid(_))
        ));
        assert!(matches!(
            plan_capacity(&input(1.0, 1.0, 1.0)),
            Err(CapacityError::FLossOutOfRange(_))
        ));
        assert!(matches!(
            plan_capacity(&input(1e300, 1.0, 0.0)),
            Err(CapacityError::DemandInvalid(_) | CapacityError::Overflow(_))
        ));
        let mut spec = input(1.0, 1.0, 0.0);
        spec.min_replicas = 5;
        spec.max_replicas = 4;
        assert!(matches!(
            plan_capacity(&spec),
            Err(CapacityError::MinAboveMax { .. })
        ));
    }

    #[test]
    fn worst_domain_is_named() {
        let placement = BTreeMap::from([
            ("zone-a".to_owned(), 2),
            ("zone-b".to_owned(), 4),
            ("zone-c".to_owned(), 4),
        ]);
        let report = worst_domain_loss(&placement, 6);
        assert_eq!(report.worst_domain.as_deref(), Some("zone-b"));
        assert_eq!(report.groups_lost, 4);
        assert_eq!(report.groups_left, 6);
        assert!(report.tolerant);

        let report = worst_domain_loss(&placement, 7);
        assert!(!report.tolerant);
        assert_eq!(report.shortfall, 1);

        let empty = worst_domain_loss(&BTreeMap::new(), 1);
        assert_eq!(empty.worst_domain, None);
        assert!(!empty.tolerant);
    }

    /// Thousandths as the spec's decimal numbers.
    fn milli(max: u64) -> impl Strategy<Value = f64> {
        (1..max).prop_map(|m| m as f64 / 1000.0)
    }

    proptest! {
        #[test]
        fn provisioned_survives_an_f_loss(
            demand in milli(1_000_000), goodput in milli(100_000), f in 0u64..1000,
        ) {
            let f_loss = f as f64 / 1000.0;
            let plan = plan_capacity(&input(demand, goodput, f_loss)).unwrap();
            // N_prov·(1 − f) ≥ N_healthy, exactly, in thousandths.
            if !plan.capped {
                prop_assert!(u64::from(plan.provisioned) * (1000 - f) >= u64::from(plan.healthy_needed) * 1000);
            }
            // And it is the smallest such count (unless minReplicas pushed it up).
            if plan.provisioned > 1 && !plan.capped {
                prop_assert!(u64::from(plan.provisioned - 1) * (1000 - f) < u64::from(plan.healthy_needed) * 1000);
            }
        }

        #[test]
        fn healthy_needed_is_exact_on_integer_multiples(k in 1u32..10_000, goodput in milli(100_000)) {
            let demand = f64::from(k) * goodput;
            prop_assert_eq!(plan_capacity(&input(demand, goodput, 0.0)).unwrap().healthy_needed, k);
        }

        #[test]
        fn monotonic_in_demand(a in milli(1_000_000), b in milli(1_000_000), goodput in milli(100_000), f in 0u64..1000) {
            let (low, high) = if a <= b { (a, b) } else { (b, a) };
            let f_loss = f as f64 / 1000.0;
            let low = plan_capacity(&input(low, goodput, f_loss)).unwrap();
            let high = plan_capacity(&input(high, goodput, f_loss)).unwrap();
            prop_assert!(low.healthy_needed <= high.healthy_needed);
            prop_assert!(low.provisioned <= high.provisioned);
        }

        #[test]
        fn spread_placement_of_the_target_tolerates_its_f_loss(
            healthy in 1u32..200, domains in 2usize..8,
        ) {
            // With d domains, losing one is a 1/d share: fLoss = ceil(1000/d) thousandths.
            let f = 1000u64.div_ceil(domains as u64);
            prop_assume!(f < 1000);
            let plan = plan_capacity(&input(f64::from(healthy), 1.0, f as f64 / 1000.0)).unwrap();
            // Round-robin: the best spread a scheduler can achieve.
            let mut placement = BTreeMap::new();
            for group in 0..plan.provisioned {
                *placement.entry(format!("zone-{}", group as usize % domains)).or_insert(0) += 1;
            }
            prop_assert!(worst_domain_loss(&placement, plan.healthy_needed).tolerant);
        }
    }
}
