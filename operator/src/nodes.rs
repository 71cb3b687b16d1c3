//! Node changes that matter to fault domains, turned into the InferenceServices they
//! concern.
//!
//! `FaultTolerant` and the ready-group counts are computed from where groups run
//! (nodes → domains, and only on Ready nodes), so a node that turns NotReady, comes
//! back, is deleted or is relabelled has to reconcile the InferenceServices it concerns
//! at once, not at the next resync: a lost zone would otherwise go unreported until a
//! pod happened to change.
//!
//! Nodes change for many reasons that do not matter here (heartbeats, images,
//! allocatable), so [`NodeChanges`] remembers each node as `plan` sees it (its labels,
//! Ready, cordon and taints, [`ObservedNode`]) and reports only the nodes whose view
//! changed. A relist (watch restart) is compared as a whole, so it reports what moved
//! while the watch was down, and nothing otherwise.
//!
//! [`concerned`] then maps those changes to InferenceServices with a lookup over the
//! operator's caches (plain data): a service is concerned when one of its pods runs on
//! the changed node, or on a node in the changed node's fault domain under the
//! service's own topology key (before or after the change, so a relabel out of a
//! domain counts for both). A node event no longer reconciles every InferenceService:
//! at 1,000 of them, one kubelet flapping cost 1,000 reconciles.
//!
//! What is not mapped: a node in a domain where a service has no pod. Such a change can
//! only move that service's list of lost or eligible domains, which its next reconcile
//! (a pod event, or the resync) picks up.

use std::collections::{BTreeSet, HashMap};

use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt as _;
use kube::runtime::watcher::Event;

use crate::observed::{ObservedNode, node_from};

/// One node whose fault-domain view changed: `None` before means new, `None` after
/// means deleted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeChange {
    pub name: String,
    pub before: Option<ObservedNode>,
    pub after: Option<ObservedNode>,
}

/// The fault-domain view of every node, and what an event changed of it.
#[derive(Debug, Default)]
pub struct NodeChanges {
    seen: HashMap<String, ObservedNode>,
    /// The nodes of a relist in progress (between `Init` and `InitDone`).
    relist: Option<HashMap<String, ObservedNode>>,
}

impl NodeChanges {
    /// Every node as `plan` sees it, after the events taken so far.
    pub fn current(&self) -> &HashMap<String, ObservedNode> {
        &self.seen
    }

    /// Takes one watch event; returns the nodes whose view `plan` reads changed (none
    /// for a heartbeat, and none until a relist is complete).
    pub fn update(&mut self, event: Event<(String, ObservedNode)>) -> Vec<NodeChange> {
        match event {
            Event::Init => {
                self.relist = Some(HashMap::new());
                Vec::new()
            }
            Event::InitApply((name, node)) => {
                self.relist
                    .get_or_insert_with(HashMap::new)
                    .insert(name, node);
                Vec::new()
            }
            Event::InitDone => {
                let fresh = self.relist.take().unwrap_or_default();
                let mut changes: Vec<NodeChange> = fresh
                    .iter()
                    .filter(|(name, node)| self.seen.get(*name) != Some(node))
                    .map(|(name, node)| NodeChange {
                        name: name.clone(),
                        before: self.seen.get(name).cloned(),
                        after: Some(node.clone()),
                    })
                    .collect();
                changes.extend(
                    self.seen
                        .iter()
                        .filter(|(name, _)| !fresh.contains_key(*name))
                        .map(|(name, node)| NodeChange {
                            name: name.clone(),
                            before: Some(node.clone()),
                            after: None,
                        }),
                );
                changes.sort_by(|a, b| a.name.cmp(&b.name));
                self.seen = fresh;
                changes
            }
            Event::Apply((name, node)) => {
                let before = self.seen.insert(name.clone(), node.clone());
                if before.as_ref() == Some(&node) {
                    Vec::new()
                } else {
                    vec![NodeChange {
                        name,
                        before,
                        after: Some(node),
                    }]
                }
            }
            Event::Delete((name, _)) => match self.seen.remove(&name) {
                Some(before) => vec![NodeChange {
                    name,
                    before: Some(before),
                    after: None,
                }],
                None => Vec::new(),
            },
        }
    }
}

/// An InferenceService as the mapping reads it: where it is and which node label is
/// its fault domain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceKey {
    pub namespace: String,
    pub name: String,
    pub domain_key: String,
}

/// A pod of an InferenceService (its instance label) and the node it is bound to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlacedPod {
    pub namespace: String,
    pub instance: String,
    pub node: Option<String>,
}

/// The InferenceServices (namespace, name) that `changes` concern: those with a pod on
/// a changed node, or on a node of the changed node's domain (its value of the
/// service's `domain_key`, before or after the change). `nodes` is the current view,
/// read for the domains of the nodes the pods run on.
pub fn concerned(
    changes: &[NodeChange],
    services: &[ServiceKey],
    pods: &[PlacedPod],
    nodes: &HashMap<String, ObservedNode>,
) -> BTreeSet<(String, String)> {
    if changes.is_empty() {
        return BTreeSet::new();
    }
    let mut nodes_of: HashMap<(&str, &str), BTreeSet<&str>> = HashMap::new();
    for pod in pods {
        if let Some(node) = pod.node.as_deref() {
            nodes_of
                .entry((pod.namespace.as_str(), pod.instance.as_str()))
                .or_default()
                .insert(node);
        }
    }
    let changed: BTreeSet<&str> = changes.iter().map(|c| c.name.as_str()).collect();
    let mut found = BTreeSet::new();
    for service in services {
        let Some(used) = nodes_of.get(&(service.namespace.as_str(), service.name.as_str())) else {
            continue;
        };
        if used.iter().any(|node| changed.contains(node)) {
            found.insert((service.namespace.clone(), service.name.clone()));
            continue;
        }
        let key = service.domain_key.as_str();
        let domains: BTreeSet<&str> = used
            .iter()
            .filter_map(|node| nodes.get(*node)?.labels.get(key))
            .map(String::as_str)
            .collect();
        let touches = changes.iter().any(|change| {
            [&change.before, &change.after]
                .into_iter()
                .flatten()
                .filter_map(|node| node.labels.get(key))
                .any(|domain| domains.contains(domain.as_str()))
        });
        if touches {
            found.insert((service.namespace.clone(), service.name.clone()));
        }
    }
    found
}

/// The event with each node reduced to what `plan` reads of it.
pub fn view(event: Event<Node>) -> Event<(String, ObservedNode)> {
    let view = |node: Node| (node.name_any(), node_from(&node));
    match event {
        Event::Init => Event::Init,
        Event::InitApply(node) => Event::InitApply(view(node)),
        Event::InitDone => Event::InitDone,
        Event::Apply(node) => Event::Apply(view(node)),
        Event::Delete(node) => Event::Delete(view(node)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ZONE: &str = "topology.kubernetes.io/zone";

    fn node(zone: &str, ready: bool) -> ObservedNode {
        ObservedNode {
            labels: [(ZONE.to_owned(), zone.to_owned())].into(),
            ready,
            ..ObservedNode::default()
        }
    }

    fn named(name: &str, zone: &str, ready: bool) -> (String, ObservedNode) {
        (name.to_owned(), node(zone, ready))
    }

    fn fires(changes: Vec<NodeChange>) -> bool {
        !changes.is_empty()
    }

    #[test]
    fn fires_on_readiness_labels_and_deletion_only() {
        let mut changes = NodeChanges::default();
        assert!(
            fires(changes.update(Event::Apply(named("n1", "a", true)))),
            "a new node"
        );
        assert!(
            !fires(changes.update(Event::Apply(named("n1", "a", true)))),
            "a heartbeat"
        );
        assert_eq!(
            changes.update(Event::Apply(named("n1", "a", false))),
            [NodeChange {
                name: "n1".into(),
                before: Some(node("a", true)),
                after: Some(node("a", false)),
            }],
            "NotReady"
        );
        assert!(
            fires(changes.update(Event::Apply(named("n1", "b", false)))),
            "relabelled"
        );
        assert!(
            fires(changes.update(Event::Delete(named("n1", "b", false)))),
            "deleted"
        );
        assert!(
            !fires(changes.update(Event::Delete(named("n1", "b", false)))),
            "deleted twice"
        );
    }

    #[test]
    fn a_relist_reports_once_and_only_what_moved() {
        let mut changes = NodeChanges::default();
        let relist = |changes: &mut NodeChanges, nodes: &[(String, ObservedNode)]| {
            let mut fired = vec![changes.update(Event::Init)];
            for n in nodes {
                fired.push(changes.update(Event::InitApply(n.clone())));
            }
            fired.push(changes.update(Event::InitDone));
            fired.into_iter().map(|c| c.len()).collect::<Vec<_>>()
        };
        let fleet = [named("n1", "a", true), named("n2", "b", true)];
        assert_eq!(relist(&mut changes, &fleet), [0, 0, 0, 2], "first list");
        assert_eq!(relist(&mut changes, &fleet), [0, 0, 0, 0], "unchanged");
        // n2 vanished while the watch was down.
        let mut gone = NodeChanges {
            seen: changes.seen.clone(),
            relist: None,
        };
        gone.update(Event::Init);
        gone.update(Event::InitApply(fleet[0].clone()));
        assert_eq!(
            gone.update(Event::InitDone),
            [NodeChange {
                name: "n2".into(),
                before: Some(node("b", true)),
                after: None,
            }]
        );
        assert!(
            fires(gone.update(Event::Apply(named("n2", "b", true)))),
            "n2 is new again"
        );
    }

    fn service(name: &str, domain_key: &str) -> ServiceKey {
        ServiceKey {
            namespace: "ns".into(),
            name: name.into(),
            domain_key: domain_key.into(),
        }
    }

    fn pod(instance: &str, node: Option<&str>) -> PlacedPod {
        PlacedPod {
            namespace: "ns".into(),
            instance: instance.into(),
            node: node.map(str::to_owned),
        }
    }

    fn names(found: BTreeSet<(String, String)>) -> Vec<String> {
        found.into_iter().map(|(_, name)| name).collect()
    }

    /// Zones a (n1, n2), b (n3), c (n4); rack labels cut across zones.
    fn fleet() -> HashMap<String, ObservedNode> {
        let mut nodes: HashMap<String, ObservedNode> = [
            named("n1", "a", true),
            named("n2", "a", true),
            named("n3", "b", true),
            named("n4", "c", true),
        ]
        .into();
        for (name, rack) in [("n1", "r1"), ("n2", "r2"), ("n3", "r1"), ("n4", "r2")] {
            nodes
                .get_mut(name)
                .unwrap()
                .labels
                .insert("rack".into(), rack.into());
        }
        nodes
    }

    #[test]
    fn a_node_event_concerns_only_services_on_that_node_or_in_its_domain() {
        let nodes = fleet();
        let services = [
            service("on-n1", ZONE),
            service("on-n2", ZONE),
            service("on-n3", ZONE),
            service("pending", ZONE),
            service("no-pods", ZONE),
            service("racked-n3", "rack"),
        ];
        let pods = [
            pod("on-n1", Some("n1")),
            pod("on-n2", Some("n2")),
            pod("on-n3", Some("n3")),
            pod("pending", None),
            pod("racked-n3", Some("n3")),
            // Same name in another namespace: not ours.
            PlacedPod {
                namespace: "other".into(),
                instance: "no-pods".into(),
                node: Some("n1".into()),
            },
        ];
        let mut n1_down = nodes["n1"].clone();
        n1_down.ready = false;
        let n1 = NodeChange {
            name: "n1".into(),
            before: Some(nodes["n1"].clone()),
            after: Some(n1_down),
        };
        // n1 is in zone a (n1's and n2's services) and rack r1 (n3's rack service).
        assert_eq!(
            names(concerned(
                std::slice::from_ref(&n1),
                &services,
                &pods,
                &nodes
            )),
            ["on-n1", "on-n2", "racked-n3"]
        );
        // A node in zone c, where nobody runs, concerns nobody.
        let n4 = NodeChange {
            name: "n4".into(),
            before: Some(nodes["n4"].clone()),
            after: None,
        };
        assert!(concerned(&[n4], &services, &pods, &nodes).is_empty());
        // A new node joining zone b concerns zone b's services (before: none).
        let joined = NodeChange {
            name: "n5".into(),
            before: None,
            after: Some(node("b", true)),
        };
        assert_eq!(
            names(concerned(&[joined], &services, &pods, &nodes)),
            ["on-n3"]
        );
        // A node relabelled from zone c into zone b: its "after" domain counts.
        let relabelled = NodeChange {
            name: "n4".into(),
            before: Some(node("c", true)),
            after: Some(node("b", true)),
        };
        assert_eq!(
            names(concerned(&[relabelled], &services, &pods, &nodes)),
            ["on-n3"]
        );
        assert!(concerned(&[], &services, &pods, &nodes).is_empty());
    }
}
