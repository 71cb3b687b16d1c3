//! Where groups may run, and which group to move when they crowd one fault domain.
//!
//! The scheduler spreads group leaders over fault domains (`maxSkew: 1`), but only as
//! each pod is placed. Two things leave groups crowded afterwards: a domain lost and
//! regained (its groups were recreated on the survivors), and rollout churn (a group
//! recreated while another release's pod still counted in the spread). Nothing moves a
//! running pod back, so the operator does, one group at a time, and only while that is
//! safe: see [`group_to_move`].
//!
//! "Eligible" follows the scheduler's own filters for the pods' `nodeSelector` and
//! `tolerations` (the spread constraint honours both), so a domain the pods can never
//! land on never attracts a move. Free resources are not modelled: a moved group that
//! cannot fit its new domain stays Pending, which `Progressing` reports.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Toleration;
use slipway_api::spec::PodOverrides;

use crate::observed::{NodeTaint, ObservedNode};

/// Whether `tolerations` let a pod onto a node with `taint` (the scheduler's rule:
/// `Exists` with no key tolerates everything; an empty effect matches every effect).
pub fn tolerates(tolerations: &[Toleration], taint: &NodeTaint) -> bool {
    tolerations.iter().any(|t| {
        let effect_matches = t
            .effect
            .as_deref()
            .is_none_or(|e| e.is_empty() || e == taint.effect);
        let key = t.key.as_deref().unwrap_or_default();
        let key_matches = key.is_empty() || key == taint.key;
        let value_matches = match t.operator.as_deref() {
            Some("Exists") => true,
            // `Equal` is the default; an empty key is only valid with `Exists`.
            _ => {
                !key.is_empty()
                    && t.value.as_deref().unwrap_or_default()
                        == taint.value.as_deref().unwrap_or_default()
            }
        };
        effect_matches && key_matches && value_matches
    })
}

/// Whether the pods can be scheduled onto `node` now: Ready, not cordoned, matching the
/// node selector, every hard taint tolerated.
pub fn can_run_on(node: &ObservedNode, overrides: &PodOverrides) -> bool {
    node.ready
        && !node.unschedulable
        && overrides
            .node_selector
            .iter()
            .all(|(key, value)| node.labels.get(key) == Some(value))
        && node
            .taints
            .iter()
            .filter(|t| t.effect == "NoSchedule" || t.effect == "NoExecute")
            .all(|t| tolerates(&overrides.tolerations, t))
}

/// Domains (values of `key`) with at least one node the pods can run on.
pub fn eligible_domains(
    nodes: &BTreeMap<String, ObservedNode>,
    key: &str,
    overrides: &PodOverrides,
) -> BTreeSet<String> {
    nodes
        .values()
        .filter(|node| can_run_on(node, overrides))
        .filter_map(|node| node.labels.get(key).cloned())
        .collect()
}

/// One group to drain so the scheduler places it again in a less crowded domain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Move {
    pub group: u32,
    pub from: String,
    pub from_groups: u32,
    pub to: String,
    pub to_groups: u32,
}

/// The group to move, given where each ready group's leader runs: the highest-index
/// group of the most crowded domain, when an eligible domain holds at least two groups
/// fewer (so the spread constraint sends its replacement there, and moving it makes
/// the spread strictly better). `None` when the spread is within one.
pub fn group_to_move(
    group_domains: &BTreeMap<u32, String>,
    eligible: &BTreeSet<String>,
) -> Option<Move> {
    let mut counts: BTreeMap<&str, u32> = eligible.iter().map(|d| (d.as_str(), 0)).collect();
    for domain in group_domains.values() {
        *counts.entry(domain.as_str()).or_default() += 1;
    }
    // Ties go to the first domain by name, so the choice is stable across reconciles.
    let (from, from_groups) = counts
        .iter()
        .fold(None, |best: Option<(&str, u32)>, (&d, &n)| match best {
            Some((_, m)) if m >= n => best,
            _ => Some((d, n)),
        })?;
    let (to, to_groups) = counts.iter().filter(|(d, _)| eligible.contains(**d)).fold(
        None,
        |best: Option<(&str, u32)>, (&d, &n)| match best {
            Some((_, m)) if m <= n => best,
            _ => Some((d, n)),
        },
    )?;
    if from_groups < to_groups + 2 {
        return None;
    }
    let group = group_domains
        .iter()
        .filter(|(_, d)| d.as_str() == from)
        .map(|(&g, _)| g)
        .max()?;
    Some(Move {
        group,
        from: from.to_owned(),
        from_groups,
        to: to.to_owned(),
        to_groups,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn taint(key: &str, value: Option<&str>, effect: &str) -> NodeTaint {
        NodeTaint {
            key: key.to_owned(),
            value: value.map(str::to_owned),
            effect: effect.to_owned(),
        }
    }

    fn toleration(key: &str, operator: &str, value: &str, effect: &str) -> Toleration {
        let opt = |s: &str| (!s.is_empty()).then(|| s.to_owned());
        Toleration {
            key: opt(key),
            operator: opt(operator),
            value: opt(value),
            effect: opt(effect),
            toleration_seconds: None,
        }
    }

    #[test]
    fn tolerations_follow_the_schedulers_rule() {
        let gpu = taint("nvidia.com/gpu", None, "NoSchedule");
        let pool = taint("pool", Some("real"), "NoSchedule");
        assert!(tolerates(
            &[toleration("nvidia.com/gpu", "Exists", "", "NoSchedule")],
            &gpu
        ));
        assert!(tolerates(
            &[toleration("nvidia.com/gpu", "Exists", "", "")],
            &gpu
        ));
        assert!(!tolerates(
            &[toleration("nvidia.com/gpu", "Exists", "", "NoExecute")],
            &gpu
        ));
        assert!(tolerates(&[toleration("", "Exists", "", "")], &pool));
        assert!(tolerates(
            &[toleration("pool", "Equal", "real", "NoSchedule")],
            &pool
        ));
        assert!(tolerates(&[toleration("pool", "", "real", "")], &pool));
        assert!(!tolerates(
            &[toleration("pool", "Equal", "kwok", "NoSchedule")],
            &pool
        ));
        assert!(!tolerates(&[], &pool));
    }

    #[test]
    fn eligible_domains_honour_selector_taints_readiness_and_cordons() {
        let node = |zone: &str, pool: &str, ready: bool, cordoned: bool, taints: Vec<NodeTaint>| {
            ObservedNode {
                labels: BTreeMap::from([
                    ("zone".to_owned(), zone.to_owned()),
                    ("pool".to_owned(), pool.to_owned()),
                ]),
                ready,
                unschedulable: cordoned,
                taints,
            }
        };
        let nodes = BTreeMap::from([
            (
                "a".to_owned(),
                node(
                    "za",
                    "real",
                    true,
                    false,
                    vec![taint("pool", Some("real"), "NoSchedule")],
                ),
            ),
            ("b".to_owned(), node("zb", "real", false, false, vec![])),
            ("c".to_owned(), node("zc", "real", true, true, vec![])),
            ("d".to_owned(), node("zd", "gpu", true, false, vec![])),
            (
                "e".to_owned(),
                node(
                    "ze",
                    "real",
                    true,
                    false,
                    vec![taint("other", None, "NoExecute")],
                ),
            ),
            (
                "f".to_owned(),
                node(
                    "zf",
                    "real",
                    true,
                    false,
                    vec![taint("other", None, "PreferNoSchedule")],
                ),
            ),
        ]);
        let overrides = PodOverrides {
            node_selector: BTreeMap::from([("pool".to_owned(), "real".to_owned())]),
            tolerations: vec![toleration("pool", "Equal", "real", "NoSchedule")],
            ..PodOverrides::default()
        };
        let eligible: Vec<String> = eligible_domains(&nodes, "zone", &overrides)
            .into_iter()
            .collect();
        assert_eq!(eligible, ["za", "zf"]);
    }

    fn domains(pairs: &[(u32, &str)]) -> BTreeMap<u32, String> {
        pairs.iter().map(|&(g, d)| (g, d.to_owned())).collect()
    }

    fn set(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|&n| n.to_owned()).collect()
    }

    #[test]
    fn the_highest_group_of_a_crowded_domain_moves_to_an_empty_one() {
        let placed = domains(&[(0, "b"), (1, "b")]);
        assert_eq!(
            group_to_move(&placed, &set(&["a", "b"])),
            Some(Move {
                group: 1,
                from: "b".to_owned(),
                from_groups: 2,
                to: "a".to_owned(),
                to_groups: 0,
            })
        );
    }

    #[test]
    fn a_spread_within_one_or_no_better_domain_moves_nothing() {
        assert_eq!(
            group_to_move(&domains(&[(0, "a"), (1, "b"), (2, "b")]), &set(&["a", "b"])),
            None
        );
        // The empty domain is not eligible (NotReady, cordoned or not selected).
        assert_eq!(
            group_to_move(&domains(&[(0, "b"), (1, "b")]), &set(&["b"])),
            None
        );
        assert_eq!(group_to_move(&BTreeMap::new(), &set(&["a"])), None);
    }

    #[test]
    fn a_move_always_narrows_the_spread() {
        // Every placement of up to 6 groups over 3 domains: after the move the crowded
        // domain still holds at least as many as the target (no ping-pong).
        let names = ["a", "b", "c"];
        for code in 0..3u32.pow(6) {
            for n in 0..=6u32 {
                let placed: BTreeMap<u32, String> = (0..n)
                    .map(|g| (g, names[((code / 3u32.pow(g)) % 3) as usize].to_owned()))
                    .collect();
                if let Some(m) = group_to_move(&placed, &set(&names)) {
                    // After the move: from − 1 ≥ to + 1.
                    assert!(m.from_groups >= m.to_groups + 2, "{placed:?}: {m:?}");
                    assert_eq!(placed.get(&m.group), Some(&m.from));
                }
            }
        }
    }
}
