//! The children besides the groups' pods, and which children go.
//!
//! Rendered: one headless Service per group (DNS for its pods, home of its restart
//! record), the router's client Service, one Service per live release (its leaders,
//! the router's endpoints for it, and its bundle), the PodDisruptionBudget, the
//! router ([`crate::router`]) and the optional HTTPRoute.
//!
//! Deleted: pods of groups the rollout did not keep (scale-in), pods whose labels do
//! not parse, Services of groups and releases that are gone, and anything of the kinds
//! in [`crate::observed::LabelledKind`] that carries the instance labels but is no
//! longer rendered (orphans by label). Pods on NotReady nodes are force-deleted.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::labels;
use crate::observed::{GroupRecord, Observed};
use crate::router;
use crate::types::{Child, ChildKind, ChildRef, Context};

use super::groups::{on_lost_node, pod_ref};
use super::releases::Stable;

/// The children the plan applies after the groups' pods, in order: group Services,
/// the client Service, the release Services, the PodDisruptionBudget, the router and
/// the HTTPRoute.
pub(super) fn shared_children(
    ctx: &Context<'_>,
    stable: &Stable<'_, '_>,
    records: &[GroupRecord],
    healthy_needed: u32,
    observed: &Observed,
) -> Vec<Child> {
    let mut apply: Vec<Child> = records
        .iter()
        .map(|record| Child::Service(Box::new(group_service(ctx, record))))
        .collect();
    // Clients reach the router; the router reaches each release's leaders through
    // that release's Service.
    apply.push(Child::Service(Box::new(router::client_service(ctx))));
    apply.push(Child::Service(Box::new(release_service(
        ctx,
        &labels::release_service(ctx.name, ctx.release),
    ))));
    if let Some(stable_ctx) = stable.ctx.filter(|s| s.release != ctx.release) {
        apply.push(Child::Service(Box::new(release_service(
            stable_ctx,
            &labels::release_service(ctx.name, stable.release),
        ))));
    }
    apply.push(Child::PodDisruptionBudget(Box::new(pdb(
        ctx,
        healthy_needed,
    ))));
    let router_image = observed
        .router_image
        .as_deref()
        .unwrap_or(slipway_contract::operator::DEFAULT_ROUTER_IMAGE);
    apply.extend(router::children(ctx, router_image, &ctx.router));
    if let Some(route) = ctx
        .spec
        .router
        .http_route
        .as_ref()
        .filter(|_| !observed.http_route_crd_missing)
    {
        apply.push(Child::HttpRoute(Box::new(router::http_route(ctx, route))));
    }
    apply
}

/// What the groups left behind: pods and Services of group indices the rollout did
/// not keep, pods whose labels do not parse, and Services of releases no pod runs
/// (the stable release's stays while the rollout runs: it keeps the bundle).
pub(super) fn leftovers(
    ctx: &Context<'_>,
    stable_release: &str,
    assignment: &BTreeMap<u32, String>,
    observed: &Observed,
) -> Vec<ChildRef> {
    let mut gone: Vec<ChildRef> = observed
        .pods
        .iter()
        .filter(|p| !assignment.contains_key(&p.group) && !p.terminating)
        .map(|pod| pod_ref(&pod.name))
        .collect();
    gone.extend(observed.unparsed_pods.iter().map(|name| pod_ref(name)));
    gone.extend(
        observed
            .groups
            .iter()
            .filter(|r| !assignment.contains_key(&r.group))
            .map(|record| ChildRef {
                kind: ChildKind::Service,
                name: labels::group_service(ctx.name, record.group),
            }),
    );
    let current_release_service = labels::release_service(ctx.name, ctx.release);
    let mut releases_kept: BTreeSet<String> = observed
        .pods
        .iter()
        .map(|p| labels::release_service(ctx.name, &p.release))
        .collect();
    releases_kept.insert(labels::release_service(ctx.name, stable_release));
    gone.extend(
        observed
            .release_services
            .iter()
            .filter(|service| {
                **service != current_release_service && !releases_kept.contains(*service)
            })
            .map(|service| ChildRef {
                kind: ChildKind::Service,
                name: service.clone(),
            }),
    );
    gone
}

/// Orphans by label: what carries our labels and this plan no longer renders.
pub(super) fn orphans_by_label(observed: &Observed, apply: &[Child]) -> Vec<ChildRef> {
    let rendered: BTreeSet<ChildRef> = apply.iter().map(Child::reference).collect();
    observed
        .labelled
        .iter()
        .flat_map(|(&kind, names)| {
            names.iter().map(move |name| ChildRef {
                kind: kind.into(),
                name: name.clone(),
            })
        })
        .filter(|child| !rendered.contains(child))
        .collect()
}

/// Takes the pods on NotReady nodes out of `delete` and returns those to delete with
/// no grace period: the ones this plan deletes and the ones already being deleted.
/// Engines keep no state two copies could corrupt, and the kubelet stops the old
/// process when it comes back.
pub(super) fn force_deletions(observed: &Observed, delete: &mut BTreeSet<ChildRef>) -> Vec<String> {
    let mut force = Vec::new();
    for pod in observed.pods.iter().filter(|p| on_lost_node(p, observed)) {
        let this_plan = delete.remove(&pod_ref(&pod.name));
        if this_plan || pod.terminating {
            force.push(pod.name.clone());
        }
    }
    force
}

fn http_port() -> Vec<ServicePort> {
    vec![ServicePort {
        name: Some("http".to_owned()),
        port: 80,
        target_port: Some(IntOrString::String("http".to_owned())),
        protocol: Some("TCP".to_owned()),
        ..ServicePort::default()
    }]
}

/// The headless Service of a group: DNS for its pods, home of its restart record.
fn group_service(ctx: &Context<'_>, record: &GroupRecord) -> Service {
    let mut service_labels = labels::instance_selector(ctx.name);
    service_labels.insert(labels::GROUP.to_owned(), record.group.to_string());
    let mut metadata = ctx.child_meta(
        labels::group_service(ctx.name, record.group),
        service_labels,
    );
    let mut annotations =
        BTreeMap::from([(labels::RESTARTS.to_owned(), record.restarts.to_string())]);
    if let Some(time) = &record.last_restart {
        annotations.insert(labels::LAST_RESTART.to_owned(), time.0.to_string());
    }
    metadata.annotations = Some(annotations);
    Service {
        metadata,
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".to_owned()),
            selector: Some(labels::group_selector(ctx.name, record.group)),
            // Workers resolve their leader before anyone is ready.
            publish_not_ready_addresses: Some(true),
            ports: Some(http_port()),
            ..ServiceSpec::default()
        }),
        status: None,
    }
}

/// A release's Service: the leaders of its groups, the router's endpoints for it.
fn release_service(ctx: &Context<'_>, name: &str) -> Service {
    // Leaders only: the leader of a group owns HTTP; its workers serve nothing.
    let mut selector = labels::engine_selector(ctx.name);
    selector.insert(labels::RANK.to_owned(), "0".to_owned());
    selector.insert(labels::RELEASE.to_owned(), ctx.release.to_owned());
    let mut service_labels = labels::instance_selector(ctx.name);
    service_labels.insert(labels::RELEASE.to_owned(), ctx.release.to_owned());
    let mut metadata = ctx.child_meta(name.to_owned(), service_labels);
    // The bundle, so this release can be rendered again after the spec moved on.
    metadata.annotations = Some(BTreeMap::from([(
        labels::BUNDLE.to_owned(),
        serde_json::to_string(&ctx.spec.release).unwrap_or_default(),
    )]));
    Service {
        metadata,
        spec: Some(ServiceSpec {
            selector: Some(selector),
            ports: Some(http_port()),
            ..ServiceSpec::default()
        }),
        status: None,
    }
}

/// Keeps the pods of `N_healthy` groups up through voluntary disruptions.
fn pdb(ctx: &Context<'_>, healthy_needed: u32) -> PodDisruptionBudget {
    let pods = healthy_needed.saturating_mul(ctx.shape.world_size());
    PodDisruptionBudget {
        metadata: ctx.child_meta(
            labels::client_service(ctx.name),
            labels::instance_selector(ctx.name),
        ),
        spec: Some(PodDisruptionBudgetSpec {
            min_available: Some(IntOrString::Int(i32::try_from(pods).unwrap_or(i32::MAX))),
            selector: Some(LabelSelector {
                match_labels: Some(labels::engine_selector(ctx.name)),
                ..LabelSelector::default()
            }),
            ..PodDisruptionBudgetSpec::default()
        }),
        status: None,
    }
}
