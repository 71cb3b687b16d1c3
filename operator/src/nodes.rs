//! Node changes that matter to fault domains, turned into "reconcile everything".
//!
//! `FaultTolerant` and the ready-group counts are computed from where groups run
//! (nodes → domains, and only on Ready nodes), so a node that turns NotReady, comes
//! back, is deleted or is relabelled has to reconcile every InferenceService at once,
//! not at the next resync: a lost zone would otherwise go unreported until a pod
//! happened to change.
//!
//! Nodes change for many reasons that do not matter here (heartbeats, images,
//! allocatable), so [`NodeChanges`] remembers each node as `plan` sees it (its labels,
//! Ready, cordon and taints, [`ObservedNode`]) and fires only when that view changes. A relist
//! (watch restart) is compared as a whole, so it fires once if anything moved while
//! the watch was down, and not at all otherwise.

use std::collections::HashMap;

use futures::{Stream, StreamExt as _, future};
use k8s_openapi::api::core::v1::Node;
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, ResourceExt as _};
use tracing::{debug, warn};

use crate::observed::{ObservedNode, node_from};

/// The fault-domain view of every node, and whether an event changed it.
#[derive(Debug, Default)]
pub struct NodeChanges {
    seen: HashMap<String, ObservedNode>,
    /// The nodes of a relist in progress (between `Init` and `InitDone`).
    relist: Option<HashMap<String, ObservedNode>>,
}

impl NodeChanges {
    /// Takes one watch event; `true` when what `plan` sees of the nodes changed.
    pub fn update(&mut self, event: Event<(String, ObservedNode)>) -> bool {
        match event {
            Event::Init => {
                self.relist = Some(HashMap::new());
                false
            }
            Event::InitApply((name, node)) => {
                self.relist
                    .get_or_insert_with(HashMap::new)
                    .insert(name, node);
                false
            }
            Event::InitDone => {
                let fresh = self.relist.take().unwrap_or_default();
                let changed = fresh != self.seen;
                self.seen = fresh;
                changed
            }
            Event::Apply((name, node)) => self.seen.insert(name, node.clone()) != Some(node),
            Event::Delete((name, _)) => self.seen.remove(&name).is_some(),
        }
    }
}

/// A stream that yields once per node change that matters (see the module doc).
/// Watch errors are logged and retried with the watcher's default backoff.
pub fn triggers(client: Client) -> impl Stream<Item = ()> + Send + 'static {
    let mut changes = NodeChanges::default();
    watcher::watcher(Api::<Node>::all(client), watcher::Config::default())
        .default_backoff()
        .filter_map(move |event| {
            let fire = match event {
                Ok(event) => changes.update(view(event)),
                Err(error) => {
                    warn!(%error, "watching nodes failed; retrying");
                    false
                }
            };
            if fire {
                debug!(
                    "nodes changed as fault domains see them; reconciling every InferenceService"
                );
            }
            future::ready(fire.then_some(()))
        })
}

/// The event with each node reduced to what `plan` reads of it.
fn view(event: Event<Node>) -> Event<(String, ObservedNode)> {
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

    fn node(zone: &str, ready: bool) -> ObservedNode {
        ObservedNode {
            labels: [("topology.kubernetes.io/zone".to_owned(), zone.to_owned())].into(),
            ready,
            ..ObservedNode::default()
        }
    }

    fn named(name: &str, zone: &str, ready: bool) -> (String, ObservedNode) {
        (name.to_owned(), node(zone, ready))
    }

    #[test]
    fn fires_on_readiness_labels_and_deletion_only() {
        let mut changes = NodeChanges::default();
        assert!(
            changes.update(Event::Apply(named("n1", "a", true))),
            "a new node"
        );
        assert!(
            !changes.update(Event::Apply(named("n1", "a", true))),
            "a heartbeat"
        );
        assert!(
            changes.update(Event::Apply(named("n1", "a", false))),
            "NotReady"
        );
        assert!(
            changes.update(Event::Apply(named("n1", "b", false))),
            "relabelled"
        );
        assert!(
            changes.update(Event::Delete(named("n1", "b", false))),
            "deleted"
        );
        assert!(
            !changes.update(Event::Delete(named("n1", "b", false))),
            "deleted twice"
        );
    }

    #[test]
    fn a_relist_fires_once_and_only_if_something_moved() {
        let mut changes = NodeChanges::default();
        let relist = |changes: &mut NodeChanges, nodes: &[(String, ObservedNode)]| {
            let mut fired = vec![changes.update(Event::Init)];
            for n in nodes {
                fired.push(changes.update(Event::InitApply(n.clone())));
            }
            fired.push(changes.update(Event::InitDone));
            fired
        };
        let fleet = [named("n1", "a", true), named("n2", "b", true)];
        assert_eq!(
            relist(&mut changes, &fleet),
            [false, false, false, true],
            "first list"
        );
        assert_eq!(
            relist(&mut changes, &fleet),
            [false, false, false, false],
            "unchanged"
        );
        // n2 vanished while the watch was down.
        assert_eq!(relist(&mut changes, &fleet[..1]), [false, false, true]);
        assert!(
            changes.update(Event::Apply(named("n2", "b", true))),
            "n2 is new again"
        );
    }
}
