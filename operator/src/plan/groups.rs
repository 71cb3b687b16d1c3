//! The lifecycle of each group the rollout keeps (the shape of one group is
//! [`crate::groups`]): what the live pods say about it, whether it is created,
//! replaced, recreated after a failure, backed off or held, and which ready group to
//! move out of a crowded fault domain.
//!
//! Per index `g < desired`:
//! - no pods → create them all (`Starting`);
//! - a pod with another template hash → delete the group, recreate it (`Replacing`);
//! - a pod failed, is missing, is on a NotReady node, or is being deleted while its
//!   peers live → the group is broken and recreated whole after [`RESTART_BACKOFF`], at most
//!   [`MAX_GROUP_RESTARTS`] times; after that it is `Held`;
//! - only terminating pods → wait until they are gone (names are reused).
//!
//! The restart count lives on the group's Service ([`GroupRecord`]), so it survives
//! the pods; it resets after the group has run ready for [`RESTART_RESET`] and when a
//! new template replaces the group.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::SignedDuration;
use slipway_contract::Backoff;

use crate::observed::{GroupRecord, Observed, ObservedNode, ObservedPod, Phase};
use crate::placement::{self, Move};
use crate::pod::render;
use crate::rollout::GroupCounts;
use crate::types::{Child, ChildKind, ChildRef, Context, PlannedEvent};

use super::events;

/// Recreations of one group before it is held.
pub const MAX_GROUP_RESTARTS: u32 = 5;
/// The wait before recreating a broken group, by its earlier restarts: none for the
/// first (a single failure is recreated at once), then 10 s doubling per restart,
/// capped at 5 min.
pub const RESTART_BACKOFF: Backoff =
    Backoff::new(Duration::from_secs(10), Duration::from_secs(300));
/// A group ready this long after its last restart gets its restart count back.
pub const RESTART_RESET: Duration = Duration::from_secs(600);

/// Time from `then` to `now`; `then` unset is "long ago".
fn since(then: Option<&Time>, now: &Time) -> Duration {
    match then {
        None => Duration::MAX,
        Some(then) => {
            let elapsed: SignedDuration = now.0.duration_since(then.0);
            Duration::from_secs(u64::try_from(elapsed.as_secs()).unwrap_or(0))
        }
    }
}

/// The earlier of two optional deadlines.
pub(super) fn earliest(a: Option<Duration>, b: Option<Duration>) -> Option<Duration> {
    a.into_iter().chain(b).min()
}

fn node_of<'a>(pod: &ObservedPod, observed: &'a Observed) -> Option<&'a ObservedNode> {
    pod.node.as_ref().and_then(|node| observed.nodes.get(node))
}

/// A pod whose node is NotReady is lost: it serves nobody and cannot be drained.
pub(super) fn on_lost_node(pod: &ObservedPod, observed: &Observed) -> bool {
    node_of(pod, observed).is_some_and(|node| !node.ready)
}

fn on_ready_node(pod: &ObservedPod, observed: &Observed) -> bool {
    node_of(pod, observed).is_some_and(|node| node.ready)
}

/// A record with no restarts: a new group, or one that earned a clean slate.
fn fresh_record(group: u32) -> GroupRecord {
    GroupRecord {
        group,
        restarts: 0,
        last_restart: None,
    }
}

/// What the live (not terminating) pods say about each group index, read once: the
/// rollout counts releases from it and scale-in chooses by placement.
pub(super) struct LiveGroups {
    /// The release each group runs (its leader's, else its first pod's).
    release: BTreeMap<u32, String>,
    /// Whether every live pod of the group is ready and running on a Ready node.
    ready: BTreeMap<u32, bool>,
    /// The fault domain of each group's leader.
    placed: BTreeMap<u32, String>,
}

impl LiveGroups {
    pub(super) fn read(observed: &Observed, domain_key: &str) -> Self {
        let mut live = Self {
            release: BTreeMap::new(),
            ready: BTreeMap::new(),
            placed: BTreeMap::new(),
        };
        for pod in observed.pods.iter().filter(|p| !p.terminating) {
            if pod.rank == 0 || !live.release.contains_key(&pod.group) {
                live.release.insert(pod.group, pod.release.clone());
            }
            if pod.rank == 0
                && let Some(domain) =
                    node_of(pod, observed).and_then(|node| node.labels.get(domain_key))
            {
                live.placed.insert(pod.group, domain.clone());
            }
            let ok = pod.ready && on_ready_node(pod, observed) && pod.phase == Phase::Running;
            let entry = live.ready.entry(pod.group).or_insert(true);
            *entry = *entry && ok;
        }
        live
    }

    pub(super) fn releases(&self) -> &BTreeMap<u32, String> {
        &self.release
    }

    pub(super) fn placed(&self) -> &BTreeMap<u32, String> {
        &self.placed
    }

    fn is_ready(&self, group: u32) -> bool {
        self.ready.get(&group).copied().unwrap_or(false)
    }

    /// Groups running `release`, and how many of them have all `world` pods ready.
    pub(super) fn count(&self, release: &str, observed: &Observed, world: usize) -> GroupCounts {
        let mut counts = GroupCounts::default();
        for (&group, r) in &self.release {
            if r == release {
                counts.alive += 1;
                if self.is_ready(group) && live_pods(observed, group) >= world {
                    counts.ready += 1;
                }
            }
        }
        counts
    }
}

fn live_pods(observed: &Observed, group: u32) -> usize {
    observed
        .pods
        .iter()
        .filter(|p| p.group == group && !p.terminating)
        .count()
}

/// What happens to one group in this plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GroupState {
    Starting,
    Running,
    Replacing,
    Recreating,
    BackingOff,
    Held,
    Terminating,
}

/// How the groups stand, for status and for deciding whether anything is in motion.
#[derive(Debug, Default)]
pub(super) struct Tally {
    pub ready: u32,
    /// Ready groups whose leader is in the client Service's endpoints.
    pub serving: u32,
    /// Running groups whose pods all run the spec's release.
    pub updated: u32,
    /// Groups not yet running as planned.
    pub busy: u32,
    /// Broken groups being restarted (or backing off), with why.
    pub broken: Vec<String>,
    /// Groups held after [`MAX_GROUP_RESTARTS`], with why.
    pub held: Vec<String>,
    /// Ready groups per fault domain of their leader.
    pub per_domain: BTreeMap<String, u32>,
    /// Where each ready group's leader runs (for rebalancing).
    pub leader_domains: BTreeMap<u32, String>,
}

/// What the groups need.
pub(super) struct Input<'a, 'b> {
    pub ctx: &'a Context<'b>,
    /// How to render the stable release when it is not the spec's; `None` when its
    /// bundle is unknown.
    pub stable_ctx: Option<&'a Context<'b>>,
    /// The release each kept group index runs.
    pub assignment: &'a BTreeMap<u32, String>,
    pub live: &'a LiveGroups,
    pub observed: &'a Observed,
    pub domain_key: &'a str,
    pub now: &'a Time,
}

/// The groups' part of the plan.
#[derive(Debug, Default)]
pub(super) struct GroupsPlan {
    /// Pods to create, group by group, leaders first.
    pub pods: Vec<Child>,
    /// The restart record of each rendered group, kept on its headless Service.
    pub records: Vec<GroupRecord>,
    pub delete: BTreeSet<ChildRef>,
    pub events: Vec<PlannedEvent>,
    /// The earliest restart backoff ending.
    pub requeue: Option<Duration>,
    pub tally: Tally,
}

/// Plans every group the rollout keeps, in index order.
pub(super) fn plan_groups(input: &Input<'_, '_>) -> GroupsPlan {
    let mut plan = GroupsPlan::default();
    for (&group, release) in input.assignment {
        if *release == input.ctx.release {
            plan.group(input.ctx, group, input);
        } else if let Some(stable_ctx) = input.stable_ctx {
            plan.group(stable_ctx, group, input);
        } else {
            plan.unrenderable(group, release, input);
        }
    }
    plan
}

impl GroupsPlan {
    /// A group of a stable release whose bundle is unknown (its per-release Service is
    /// gone): left as it is, since it cannot be recreated.
    fn unrenderable(&mut self, group: u32, release: &str, input: &Input<'_, '_>) {
        if live_pods(input.observed, group) > 0 && input.live.is_ready(group) {
            self.tally.ready += 1;
        } else {
            self.tally.busy += 1;
            self.tally.broken.push(format!(
                "group {group} (release {release} cannot be recreated: its bundle is unknown)"
            ));
        }
    }

    /// One group rendered with `ctx`, its release's context.
    fn group(&mut self, ctx: &Context<'_>, group: u32, input: &Input<'_, '_>) {
        let observed = input.observed;
        let pods: Vec<&ObservedPod> = observed.pods.iter().filter(|p| p.group == group).collect();
        let mut record = observed
            .groups
            .iter()
            .find(|r| r.group == group)
            .cloned()
            .unwrap_or_else(|| fresh_record(group));
        let live: Vec<&ObservedPod> = pods.iter().copied().filter(|p| !p.terminating).collect();
        let state = self.next_state(ctx, group, &pods, &live, &mut record, input);

        let ready = state == GroupState::Running
            && live.iter().all(|p| p.ready && on_ready_node(p, observed));
        if ready {
            self.count_ready(group, &live, &mut record, input);
        } else {
            self.tally.busy += 1;
        }
        if state == GroupState::Running && live.iter().all(|p| p.release == ctx.release) {
            self.tally.updated += 1;
        }
        self.records.push(record);
    }

    /// The group's state in this plan, with the pods it creates or deletes.
    fn next_state(
        &mut self,
        ctx: &Context<'_>,
        group: u32,
        pods: &[&ObservedPod],
        live: &[&ObservedPod],
        record: &mut GroupRecord,
        input: &Input<'_, '_>,
    ) -> GroupState {
        let rendered: Vec<(Pod, String)> = ctx
            .shape
            .pods
            .iter()
            .map(|shape| render(ctx, group, shape))
            .collect();
        let outdated = live.iter().any(|p| {
            rendered
                .get(p.rank as usize)
                .is_none_or(|(_, hash)| p.template_hash.as_deref() != Some(hash.as_str()))
        });
        if outdated {
            self.delete_pods(live);
            // A new template is a new chance: a held group is released by a spec change.
            *record = fresh_record(group);
            GroupState::Replacing
        } else if let Some(why) = broken(live, rendered.len(), input.observed) {
            self.restart(group, &why, live, record, input.now)
        } else if !pods.is_empty() && live.is_empty() {
            GroupState::Terminating
        } else if live.is_empty() {
            for (pod, _) in rendered {
                self.pods.push(Child::Pod(Box::new(pod)));
            }
            GroupState::Starting
        } else {
            GroupState::Running
        }
    }

    /// A broken group: held after too many restarts, else recreated once its backoff
    /// is over.
    fn restart(
        &mut self,
        group: u32,
        why: &str,
        live: &[&ObservedPod],
        record: &mut GroupRecord,
        now: &Time,
    ) -> GroupState {
        if record.restarts >= MAX_GROUP_RESTARTS {
            self.tally.held.push(format!("group {group} ({why})"));
            return GroupState::Held;
        }
        let wait = RESTART_BACKOFF
            .delay(record.restarts)
            .saturating_sub(since(record.last_restart.as_ref(), now));
        if wait > Duration::ZERO {
            self.requeue = earliest(self.requeue, Some(wait));
            // No countdown in the message: it would change the status on every
            // reconcile and make each status write trigger the next reconcile.
            self.tally.broken.push(format!(
                "group {group} ({why}; waiting out the restart backoff)"
            ));
            return GroupState::BackingOff;
        }
        self.delete_pods(live);
        record.restarts += 1;
        record.last_restart = Some(now.clone());
        self.tally.broken.push(format!("group {group} ({why})"));
        self.events.push(events::group_recreated(
            group,
            record.restarts,
            MAX_GROUP_RESTARTS,
            why,
        ));
        GroupState::Recreating
    }

    /// Counts a ready group, where its leader runs, and gives back its restart count
    /// once it has run long enough.
    fn count_ready(
        &mut self,
        group: u32,
        live: &[&ObservedPod],
        record: &mut GroupRecord,
        input: &Input<'_, '_>,
    ) {
        let observed = input.observed;
        let domain_key = input.domain_key;
        self.tally.ready += 1;
        // Only leaders serve (workers are not in the client Service).
        if live
            .iter()
            .filter(|p| p.rank == 0)
            .any(|p| observed.serving_pods.contains(&p.name))
        {
            self.tally.serving += 1;
        }
        let leader_domain = live
            .iter()
            .find(|p| p.rank == 0)
            .and_then(|p| observed.nodes.get(p.node.as_deref().unwrap_or_default()))
            .and_then(|node| node.labels.get(domain_key).cloned())
            .unwrap_or_else(|| format!("(nodes without {domain_key})"));
        *self
            .tally
            .per_domain
            .entry(leader_domain.clone())
            .or_default() += 1;
        self.tally.leader_domains.insert(group, leader_domain);
        if record.restarts > 0 && since(record.last_restart.as_ref(), input.now) >= RESTART_RESET {
            *record = fresh_record(group);
        }
    }

    fn delete_pods(&mut self, pods: &[&ObservedPod]) {
        self.delete
            .extend(pods.iter().map(|pod| pod_ref(&pod.name)));
    }
}

/// Why a group with these live pods is broken, if it is: a pod failed, is on a
/// NotReady node, or some of its `world` pods are gone.
fn broken(live: &[&ObservedPod], world: usize, observed: &Observed) -> Option<String> {
    let failed = live
        .iter()
        .find(|p| matches!(p.phase, Phase::Failed | Phase::Succeeded));
    let missing = !live.is_empty() && live.len() < world;
    let lost = live.iter().find(|p| on_lost_node(p, observed));
    if failed.is_none() && !missing && lost.is_none() {
        return None;
    }
    Some(match (failed, lost) {
        (Some(pod), _) => format!(
            "pod {} {}",
            pod.name,
            pod.problem
                .as_deref()
                .map_or_else(|| "failed".to_owned(), |p| format!("failed ({p})"))
        ),
        (None, Some(pod)) => format!(
            "pod {} is on node {}, which is not Ready",
            pod.name,
            pod.node.as_deref().unwrap_or_default()
        ),
        (None, None) => format!("{} of its {world} pods are gone", world - live.len()),
    })
}

pub(super) fn pod_ref(name: &str) -> ChildRef {
    ChildRef {
        kind: ChildKind::Pod,
        name: name.to_owned(),
    }
}

/// A ready group to drain so the scheduler's spread puts it in an emptier domain:
/// only when nothing else is in motion (`settled`), every desired group is ready and
/// the others still carry peak demand, and losing the most crowded domain is not
/// survivable. The move drains a group like a scale-in does.
pub(super) fn group_to_rebalance(
    ctx: &Context<'_>,
    observed: &Observed,
    tally: &Tally,
    settled: bool,
    desired: u32,
    needed: u32,
) -> Option<Move> {
    let domain_key = ctx.spec.capacity.fault_domain.topology_key.as_str();
    let crowded = settled
        && tally.ready == desired
        && tally.ready > needed
        && !slipway_api::capacity::worst_domain_loss(&tally.per_domain, needed).tolerant;
    if !crowded {
        return None;
    }
    let overrides = ctx.spec.pod_template.clone().unwrap_or_default();
    placement::group_to_move(
        &tally.leader_domains,
        &placement::eligible_domains(&observed.nodes, domain_key, &overrides),
    )
}

/// The pods that moving group `m` deletes, and the sentence that says why.
pub(super) fn rebalance(
    m: &Move,
    observed: &Observed,
    ready: u32,
    needed: u32,
    domain_key: &str,
) -> (Vec<ChildRef>, String) {
    let pods = observed
        .pods
        .iter()
        .filter(|p| p.group == m.group && !p.terminating)
        .map(|pod| pod_ref(&pod.name))
        .collect();
    let note = format!(
        "moving group {} out of {domain_key}={} ({} of {ready} ready groups; losing it would leave {}, {needed} needed) so the spread places it in {domain_key}={} ({} groups)",
        m.group,
        m.from,
        m.from_groups,
        ready - m.from_groups,
        m.to,
        m.to_groups
    );
    (pods, note)
}
