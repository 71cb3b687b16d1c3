//! The thin I/O around [`plan()`]: observe → plan → apply → delete → status → events.
//!
//! Invariants: every write uses the one field manager [`labels::FIELD_MANAGER`]; the
//! InferenceService is only written through its status subresource, and only when the
//! status changed; events come from the plan, which emits them on transitions only, so
//! a no-op reconcile writes nothing at all. An invalid spec waits for a change; an API
//! error is retried after a bounded delay.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::{BoxFuture, FutureExt as _, Shared};
use futures::{StreamExt, future, stream};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{Node, Pod, Service, ServiceAccount};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, PartialObjectMeta,
    Patch, PatchParams,
};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use slipway_api::InferenceService;
use slipway_api::spec::MetricsSourceKind;
use slipway_api::status::InferenceServiceStatus;
use tracing::{debug, info, warn};

use crate::demand::DemandReader;
use crate::error::Error;
use crate::labels;
use crate::metrics::{self, Metrics, ServiceGauges};
use crate::nodes;
use crate::observed::{self, LabelledKind, Observed};
use crate::plan::{self, Plan};
use crate::rollout;
use crate::router;
use crate::types::{Child, ChildKind, EventType as PlannedType};

/// Resync period: look again even when nothing changed, in case a watch missed it.
pub const RESYNC: Duration = Duration::from_secs(300);
/// Delay before retrying after an API error (transient by assumption; bounded).
pub const ERROR_REQUEUE: Duration = Duration::from_secs(10);

/// Shared by every reconcile.
pub struct Context {
    pub client: Client,
    pub recorder: Recorder,
    pub metrics: Arc<Metrics>,
    /// Reads the SLO counters of rollouts (scrape samples live here).
    pub rollout_metrics: rollout::source::Reader,
    /// Reads measured demand (its samples and rate history live here).
    pub demand: DemandReader,
    /// Where engine pods export request traces (`--otlp-endpoint`).
    pub engine_otlp_endpoint: Option<String>,
    /// The router pods' image (`--router-image`); `None` is the default image.
    pub router_image: Option<String>,
    /// What the watches keep in memory, read by `observe` instead of a list per
    /// reconcile. [`run`] fills them; a context that never ran has caches that never
    /// become ready.
    pub caches: Caches,
    /// The status this process last wrote, per InferenceService.
    pub written: WrittenStatuses,
}

/// The status this process last wrote to each InferenceService (by uid), as the API
/// server returned it, until the controller's cache shows it.
///
/// The cache lags this process's own writes: a reconcile started by another watch
/// (a node coming back) can read the object as it was before the last status write.
/// Planned from that older status, a condition that flipped and flipped back looks
/// unchanged, and its event is lost (a zone's recovery went unreported so). Only the
/// leader writes status, so what it wrote last is the newest; an entry goes once the
/// cache holds the same status, so the map holds only the objects whose cache lags.
#[derive(Clone, Default)]
pub struct WrittenStatuses(Arc<std::sync::Mutex<HashMap<String, InferenceServiceStatus>>>);

impl WrittenStatuses {
    /// The status to plan from: what this process wrote last when the cache has not
    /// caught up with it, else the cached one.
    fn previous(&self, isvc: &InferenceService) -> Option<InferenceServiceStatus> {
        let uid = isvc.metadata.uid.as_deref()?;
        let mut written = metrics::lock(&self.0);
        let newest = newer_status(isvc.status.as_ref(), written.get(uid));
        if newest.is_none() {
            written.remove(uid);
        }
        newest
    }

    fn remember(&self, isvc: &InferenceService, status: Option<InferenceServiceStatus>) {
        let (Some(uid), Some(status)) = (isvc.metadata.uid.clone(), status) else {
            return;
        };
        metrics::lock(&self.0).insert(uid, status);
    }

    fn forget(&self, isvc: &InferenceService) {
        if let Some(uid) = isvc.metadata.uid.as_deref() {
            metrics::lock(&self.0).remove(uid);
        }
    }
}

/// What this process wrote when the cached status differs from it (the cache has not
/// seen the write yet); `None` when the cache holds it, or nothing was written.
fn newer_status(
    cached: Option<&InferenceServiceStatus>,
    written: Option<&InferenceServiceStatus>,
) -> Option<InferenceServiceStatus> {
    written.filter(|w| cached != Some(*w)).cloned()
}

/// The reflector stores `observe` reads. Pods and Services are not among them: the
/// plan decides from them whether a group is whole and what was restarted, and a
/// cache that has not yet seen the pod this operator just created would make it
/// recreate the group. A stale name below costs at most a delete answered 404.
#[derive(Clone)]
pub struct Caches {
    /// Every node (fault domains, readiness).
    pub nodes: Store<Node>,
    /// The names (metadata only) of the children found by label and deleted when the
    /// plan drops them, except HTTPRoutes, whose CRD may be missing.
    pub deployments: Store<PartialObjectMeta<Deployment>>,
    pub service_accounts: Store<PartialObjectMeta<ServiceAccount>>,
    pub roles: Store<PartialObjectMeta<Role>>,
    pub role_bindings: Store<PartialObjectMeta<RoleBinding>>,
    pub disruption_budgets: Store<PartialObjectMeta<PodDisruptionBudget>>,
    /// Resolves once every store above has had its first list, with the name of the
    /// first one whose watch is gone otherwise. It is one future shared by every
    /// reconcile because `Store::wait_until_ready` wakes only the last of several
    /// concurrent waiters (its readiness is a oneshot receiver, which keeps one
    /// waker), and the controller polls its reconciles concurrently in one task: two
    /// InferenceServices reconciled at start-up left one asleep for good.
    ready: Shared<BoxFuture<'static, Result<(), &'static str>>>,
}

impl Caches {
    pub fn new(
        nodes: Store<Node>,
        deployments: Store<PartialObjectMeta<Deployment>>,
        service_accounts: Store<PartialObjectMeta<ServiceAccount>>,
        roles: Store<PartialObjectMeta<Role>>,
        role_bindings: Store<PartialObjectMeta<RoleBinding>>,
        disruption_budgets: Store<PartialObjectMeta<PodDisruptionBudget>>,
    ) -> Self {
        let ready = {
            let (nodes, deployments, service_accounts, roles, role_bindings, disruption_budgets) = (
                nodes.clone(),
                deployments.clone(),
                service_accounts.clone(),
                roles.clone(),
                role_bindings.clone(),
                disruption_budgets.clone(),
            );
            async move {
                nodes.wait_until_ready().await.map_err(|_| "nodes")?;
                deployments
                    .wait_until_ready()
                    .await
                    .map_err(|_| "deployments")?;
                service_accounts
                    .wait_until_ready()
                    .await
                    .map_err(|_| "serviceaccounts")?;
                roles.wait_until_ready().await.map_err(|_| "roles")?;
                role_bindings
                    .wait_until_ready()
                    .await
                    .map_err(|_| "rolebindings")?;
                disruption_budgets
                    .wait_until_ready()
                    .await
                    .map_err(|_| "poddisruptionbudgets")
            }
            .boxed()
            .shared()
        };
        Self {
            nodes,
            deployments,
            service_accounts,
            roles,
            role_bindings,
            disruption_budgets,
            ready,
        }
    }

    /// Empty stores that no watch fills (until [`run`] replaces them).
    fn unfilled() -> Self {
        Self::new(
            reflector::store().0,
            reflector::store().0,
            reflector::store().0,
            reflector::store().0,
            reflector::store().0,
            reflector::store().0,
        )
    }

    /// Waits until every store has had its first list; any number of callers at once.
    ///
    /// # Errors
    /// [`Error::Cache`] naming a store whose watch ended before its first list.
    pub async fn wait_until_ready(&self) -> Result<(), Error> {
        self.ready.clone().await.map_err(Error::Cache)
    }
}

impl Context {
    pub fn new(client: Client, identity: &str, metrics: Arc<Metrics>) -> Self {
        let reporter = Reporter {
            controller: labels::FIELD_MANAGER.to_owned(),
            instance: Some(identity.to_owned()),
        };
        Self {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            metrics,
            rollout_metrics: rollout::source::Reader::new(),
            demand: DemandReader::new(),
            engine_otlp_endpoint: None,
            router_image: None,
            caches: Caches::unfilled(),
            written: WrittenStatuses::default(),
        }
    }
}

/// What every watch of our children selects: the objects this operator manages.
fn owned_config() -> watcher::Config {
    watcher::Config::default().labels(&format!("{}={}", labels::MANAGED_BY, labels::FIELD_MANAGER))
}

/// The namespaced or cluster-wide API for `K`.
fn scoped<K>(client: &Client, namespace: Option<&str>) -> Api<K>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
    K::DynamicType: Default,
{
    match namespace {
        Some(namespace) => Api::namespaced(client.clone(), namespace),
        None => Api::all(client.clone()),
    }
}

/// Runs the controller until `shutdown` resolves; watches one namespace when
/// `namespace` is set, else all.
///
/// The caches (reflector stores) are filled by the watches the controller needs
/// anyway: the nodes and the names of the labelled children (what `observe` reads, see
/// [`Caches`]), and the engine pods, slimmed to their labels and node (what maps a
/// node event to the InferenceServices it concerns). Each watch feeds its cache and
/// the controller's triggers through one connection.
pub async fn run(
    ctx: Context,
    namespace: Option<String>,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    let client = ctx.client.clone();
    let namespace = namespace.as_deref();
    let owned = owned_config;
    let (node_cache, node_writer) = reflector::store::<Node>();
    let (pod_cache, pod_writer) = reflector::store::<Pod>();
    let (deployments, deployment_names) = names_watch::<Deployment>(&client, namespace);
    let (service_accounts, service_account_names) =
        names_watch::<ServiceAccount>(&client, namespace);
    let (roles, role_names) = names_watch::<Role>(&client, namespace);
    let (role_bindings, role_binding_names) = names_watch::<RoleBinding>(&client, namespace);
    let (disruption_budgets, disruption_budget_names) =
        names_watch::<PodDisruptionBudget>(&client, namespace);
    let ctx = Arc::new(Context {
        caches: Caches::new(
            node_cache,
            deployments,
            service_accounts,
            roles,
            role_bindings,
            disruption_budgets,
        ),
        ..ctx
    });
    let pods = watcher::watcher(scoped::<Pod>(&client, namespace), owned())
        .default_backoff()
        .modify(slim_pod)
        .reflect(pod_writer)
        .touched_objects();
    let nodes = watcher::watcher(Api::<Node>::all(client.clone()), watcher::Config::default())
        .default_backoff()
        .modify(slim_node)
        .reflect(node_writer);
    let controller = Controller::new(
        scoped::<InferenceService>(&client, namespace),
        watcher::Config::default(),
    );
    let node_triggers = node_triggers(nodes, controller.store(), pod_cache);
    controller
        .owns_stream(pods)
        .owns(scoped::<Service>(&client, namespace), owned())
        .owns_stream(disruption_budget_names)
        // The router's objects: one deleted or changed by hand is put back at once.
        .owns_stream(deployment_names)
        .owns_stream(service_account_names)
        .owns_stream(role_names)
        .owns_stream(role_binding_names)
        // Endpoint changes move `serving`. The endpoint-slice controller copies a
        // Service's labels onto its slices, so ours carry the instance label.
        .watches(
            scoped::<EndpointSlice>(&client, namespace),
            owned(),
            |slice| {
                let namespace = slice.namespace();
                slice.labels().get(labels::INSTANCE).map(|instance| {
                    let object = ObjectRef::new(instance);
                    match namespace {
                        Some(namespace) => object.within(&namespace),
                        None => object,
                    }
                })
            },
        )
        // Fault domains follow the nodes: a zone going NotReady must show at once, in
        // the InferenceServices that run there.
        .reconcile_on(node_triggers)
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            if let Err(error) = result {
                warn!(%error, "reconcile loop error");
            }
        })
        .await;
}

/// A metadata-only watch of our `K`s (labels, owners and names are all that is read
/// of them): its store, and its stream of touched objects for the controller.
fn names_watch<K>(
    client: &Client,
    namespace: Option<&str>,
) -> (
    Store<PartialObjectMeta<K>>,
    impl futures::Stream<Item = Result<PartialObjectMeta<K>, watcher::Error>> + Send + 'static,
)
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let (store, writer) = reflector::store::<PartialObjectMeta<K>>();
    let stream = watcher::watcher(
        scoped::<PartialObjectMeta<K>>(client, namespace),
        owned_config(),
    )
    .default_backoff()
    .modify(|object| object.managed_fields_mut().clear())
    .reflect(writer)
    .touched_objects();
    (store, stream)
}

/// The InferenceServices each node event concerns ([`nodes::concerned`]), looked up in
/// the caches when the event arrives. Watch errors are logged; the watcher retries
/// with its default backoff.
fn node_triggers(
    events: impl futures::Stream<Item = Result<watcher::Event<Node>, watcher::Error>> + Send + 'static,
    services: Store<InferenceService>,
    pods: Store<Pod>,
) -> impl futures::Stream<Item = ObjectRef<InferenceService>> + Send + 'static {
    let mut changes = nodes::NodeChanges::default();
    events
        .filter_map(move |event| {
            let changed = match event {
                Ok(event) => changes.update(nodes::view(event)),
                Err(error) => {
                    warn!(%error, "watching nodes failed; retrying");
                    Vec::new()
                }
            };
            let refs: Vec<ObjectRef<InferenceService>> = if changed.is_empty() {
                Vec::new()
            } else {
                let keys: Vec<nodes::ServiceKey> = services
                    .state()
                    .iter()
                    .filter_map(|isvc| {
                        Some(nodes::ServiceKey {
                            namespace: isvc.namespace()?,
                            name: isvc.name_any(),
                            domain_key: isvc.spec.capacity.fault_domain.topology_key.clone(),
                        })
                    })
                    .collect();
                let placed: Vec<nodes::PlacedPod> = pods
                    .state()
                    .iter()
                    .filter_map(|pod| {
                        Some(nodes::PlacedPod {
                            namespace: pod.namespace()?,
                            instance: pod.labels().get(labels::INSTANCE)?.clone(),
                            node: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
                        })
                    })
                    .collect();
                let found = nodes::concerned(&changed, &keys, &placed, changes.current());
                debug!(
                    nodes = changed.len(),
                    services = found.len(),
                    "nodes changed as fault domains see them"
                );
                found
                    .into_iter()
                    .map(|(namespace, name)| ObjectRef::new(&name).within(&namespace))
                    .collect()
            };
            future::ready((!refs.is_empty()).then(|| stream::iter(refs)))
        })
        .flatten()
}

/// What the pod cache keeps of a pod: its metadata without managed fields, and of its
/// spec only the node. The controller's owner lookup reads the metadata; the node
/// mapping reads the instance label and the node. At thousands of pods the rest
/// (containers, status) would be most of the operator's memory.
fn slim_pod(pod: &mut Pod) {
    pod.managed_fields_mut().clear();
    pod.annotations_mut().clear();
    pod.spec = Some(k8s_openapi::api::core::v1::PodSpec {
        node_name: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
        ..Default::default()
    });
    pod.status = None;
}

/// What the node cache keeps of a node: all `observed::node_from` reads (labels,
/// spec, conditions), without managed fields and the image list.
fn slim_node(node: &mut Node) {
    node.managed_fields_mut().clear();
    if let Some(status) = node.status.as_mut() {
        status.images = None;
    }
}

/// One reconcile of one InferenceService.
///
/// # Errors
/// [`Error`] from the stage that failed; the controller retries after [`ERROR_REQUEUE`].
pub async fn reconcile(isvc: Arc<InferenceService>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = Instant::now();
    let result = reconcile_inner(&isvc, &ctx).await;
    ctx.metrics.observe_reconcile(
        started.elapsed(),
        result.as_ref().err().map(Error::category),
    );
    result
}

async fn reconcile_inner(isvc: &InferenceService, ctx: &Context) -> Result<Action, Error> {
    if isvc.metadata.deletion_timestamp.is_some() {
        // Owner references let the garbage collector take the children.
        if let Some(namespace) = isvc.namespace() {
            ctx.metrics.forget_service(&namespace, &isvc.name_any());
        }
        ctx.written.forget(isvc);
        return Ok(Action::await_change());
    }
    // Planned from the newest status: what this process wrote, if the cache lags it.
    let newer;
    let isvc = match ctx.written.previous(isvc) {
        Some(status) => {
            newer = InferenceService {
                status: Some(status),
                ..isvc.clone()
            };
            &newer
        }
        None => isvc,
    };
    let namespace = isvc
        .namespace()
        .ok_or(Error::MissingMetadata("namespace"))?;
    let name = isvc.name_any();
    let mut observed = observe(&ctx.client, &ctx.caches, &namespace, &name).await?;
    observed.metrics = read_rollout_metrics(isvc, &observed, ctx, &namespace, &name).await;
    observed.external_scalers = external_scalers(&ctx.client, &namespace, &name).await;
    observed
        .engine_otlp_endpoint
        .clone_from(&ctx.engine_otlp_endpoint);
    observed.router_image.clone_from(&ctx.router_image);
    // Whole seconds: what the API server stores, so an unchanged status compares equal.
    let now =
        Time(Timestamp::from_second(Timestamp::now().as_second()).unwrap_or(Timestamp::UNIX_EPOCH));
    observed.demand = ctx
        .demand
        .read(
            &format!("{namespace}/{name}"),
            &isvc.spec.capacity,
            &isvc.spec.rollout.analysis.metrics,
            &leader_targets(&observed, |_| true),
            &now,
        )
        .await;
    if let Some(missing) = observed.demand.as_ref().and_then(|d| d.missing.as_ref()) {
        warn!(%name, %namespace, %missing, "measured demand unavailable; holding the last decision");
    }
    let plan = plan::plan(isvc, &observed, &now);

    if let Err(error) = apply(&ctx.client, &namespace, &plan).await {
        report_apply_failure(isvc, ctx, &namespace, &error, &now).await;
        return Err(error);
    }
    delete(&ctx.client, &namespace, &plan).await?;
    if isvc.status.as_ref() != Some(&plan.status) {
        let written = publish_status(&ctx.client, &namespace, &name, &plan.status).await?;
        ctx.written.remember(isvc, written.status);
    }
    record_events(isvc, ctx, &plan.events).await;
    let rollbacks = plan
        .events
        .iter()
        .filter(|e| e.reason == rollout::ROLLED_BACK_EVENT)
        .count();
    ctx.metrics.observe_service(
        &namespace,
        &name,
        ServiceGauges::from_status(&plan.status, isvc.spec.slo.availability),
        rollbacks as u64,
    );
    if !plan.apply.is_empty() || !plan.delete.is_empty() || !plan.events.is_empty() {
        info!(
            %name,
            %namespace,
            desired = plan.status.replicas.desired,
            ready = plan.status.replicas.ready,
            deleted = plan.delete.len(),
            events = plan.events.len(),
            "reconciled"
        );
    }
    Ok(match (&plan.invalid, plan.requeue_after) {
        (Some(reason), _) => {
            warn!(%name, %namespace, %reason, "invalid spec; waiting for a change");
            Action::await_change()
        }
        (None, Some(after)) => Action::requeue(after.min(RESYNC)),
        (None, None) => Action::requeue(RESYNC),
    })
}

/// The analysis reading while a rollout is in progress (the spec names a release that
/// is neither stable nor failed); `None` otherwise. Reads leaders only: a group serves
/// through its rank-0 pod, so its counters are the group's.
async fn read_rollout_metrics(
    isvc: &InferenceService,
    observed: &Observed,
    ctx: &Context,
    namespace: &str,
    name: &str,
) -> Option<rollout::analysis::MetricsReading> {
    let status = isvc.status.as_ref()?;
    let stable = status.stable_release.as_deref()?;
    let target = slipway_api::bundle::bundle_hash(&isvc.spec.release);
    let canary = target.short();
    if canary == stable || status.failed_releases.iter().any(|f| f == canary) {
        return None;
    }
    let targets = match isvc.spec.rollout.analysis.metrics.source {
        MetricsSourceKind::Router => router_targets(observed),
        _ => leader_targets(observed, |release| release == canary || release == stable),
    };
    let reading = ctx
        .rollout_metrics
        .read(
            &format!("{namespace}/{name}"),
            &isvc.spec.rollout.analysis,
            canary,
            stable,
            &targets,
        )
        .await;
    if let Some(error) = &reading.error {
        warn!(%name, %namespace, %error, "rollout metrics unreadable; analysis is inconclusive");
    }
    Some(reading)
}

/// The ready router pods, as scrape targets of the `Router` metrics source: each
/// counts every release it routes to.
fn router_targets(observed: &Observed) -> Vec<rollout::source::Target> {
    observed
        .router_pods
        .iter()
        .filter(|p| p.ready)
        .filter_map(|p| {
            Some(rollout::source::Target {
                pod: p.name.clone(),
                uid: p.uid.clone()?,
                ip: p.ip.clone()?,
                release: String::new(),
            })
        })
        .collect()
}

/// The ready leader pods whose release `includes` accepts, as scrape targets: a group
/// serves through its rank-0 pod, so its counters are the group's.
fn leader_targets(
    observed: &Observed,
    includes: impl Fn(&str) -> bool,
) -> Vec<rollout::source::Target> {
    observed
        .pods
        .iter()
        .filter(|p| p.rank == 0 && p.ready && !p.terminating && includes(&p.release))
        .filter_map(|p| {
            Some(rollout::source::Target {
                pod: p.name.clone(),
                uid: p.uid.clone()?,
                ip: p.ip.clone()?,
                release: p.release.clone(),
            })
        })
        .collect()
}

/// HorizontalPodAutoscalers and KEDA ScaledObjects in the namespace whose
/// `scaleTargetRef` names this InferenceService. A list that fails (KEDA not
/// installed, or not allowed) finds none: this only feeds a condition.
async fn external_scalers(client: &Client, namespace: &str, name: &str) -> Vec<String> {
    let targets_us = |kind: Option<&str>, target: Option<&str>, api_version: Option<&str>| {
        kind == Some(InferenceService::kind(&()).as_ref())
            && target == Some(name)
            && api_version.is_none_or(|v| v.starts_with(slipway_api::GROUP))
    };
    let mut found = Vec::new();
    match Api::<HorizontalPodAutoscaler>::namespaced(client.clone(), namespace)
        .list(&ListParams::default())
        .await
    {
        Ok(list) => {
            for hpa in list.items {
                let target = &hpa.spec.scale_target_ref;
                if targets_us(
                    Some(&target.kind),
                    Some(&target.name),
                    target.api_version.as_deref(),
                ) {
                    found.push(format!(
                        "HorizontalPodAutoscaler {namespace}/{}",
                        hpa.name_any()
                    ));
                }
            }
        }
        Err(error) => warn!(%error, %namespace, "cannot list HorizontalPodAutoscalers"),
    }
    let scaled_object = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("keda.sh", "v1alpha1", "ScaledObject"),
        "scaledobjects",
    );
    if let Ok(list) =
        Api::<DynamicObject>::namespaced_with(client.clone(), namespace, &scaled_object)
            .list(&ListParams::default())
            .await
    {
        for object in list.items {
            let target = &object.data["spec"]["scaleTargetRef"];
            if targets_us(
                target["kind"].as_str(),
                target["name"].as_str(),
                target["apiVersion"].as_str(),
            ) {
                found.push(format!("ScaledObject {namespace}/{}", object.name_any()));
            }
        }
    }
    found.sort();
    found
}

/// The child and the API's answer of a failed apply; `None` for any other error.
pub fn apply_failure(error: &Error) -> Option<plan::ApplyFailure> {
    let Error::Apply { kind, name, source } = error else {
        return None;
    };
    let message = match source {
        kube::Error::Api(status) if !status.message.is_empty() => status.message.clone(),
        other => other.to_string(),
    };
    Some(plan::ApplyFailure {
        kind,
        name: name.clone(),
        message,
    })
}

/// Says in status (`Ready=False`, [`plan::APPLY_FAILED`]) and in a Warning event that
/// a child could not be applied; the caller still returns the error, so the apply is
/// retried. A failure to report is logged only: the retry reports again.
async fn report_apply_failure(
    isvc: &InferenceService,
    ctx: &Context,
    namespace: &str,
    error: &Error,
    now: &Time,
) {
    let Some(failure) = apply_failure(error) else {
        return;
    };
    let name = isvc.name_any();
    let previous = isvc.status.clone().unwrap_or_default();
    let generation = isvc.metadata.generation.unwrap_or(0);
    let (status, events) = plan::apply_failed(&previous, generation, &failure, now);
    if isvc.status.as_ref() != Some(&status) {
        match publish_status(&ctx.client, namespace, &name, &status).await {
            Ok(written) => ctx.written.remember(isvc, written.status),
            Err(error) => {
                warn!(%error, %name, %namespace, "could not report the failed apply in status");
            }
        }
    }
    record_events(isvc, ctx, &events).await;
}

/// Records planned events on the InferenceService. An event that cannot be recorded
/// must not fail the reconcile that did the work: it is logged.
async fn record_events(isvc: &InferenceService, ctx: &Context, events: &[plan::PlannedEvent]) {
    let reference = isvc.object_ref(&());
    for event in events {
        let published = ctx
            .recorder
            .publish(
                &Event {
                    type_: match event.type_ {
                        PlannedType::Normal => EventType::Normal,
                        PlannedType::Warning => EventType::Warning,
                    },
                    reason: event.reason.to_owned(),
                    note: Some(event.note.clone()),
                    action: event_action(&event.note),
                    secondary: None,
                },
                &reference,
            )
            .await;
        if let Err(error) = published {
            warn!(%error, name = %isvc.name_any(), reason = event.reason, "could not record event");
        }
    }
}

fn error_policy(isvc: Arc<InferenceService>, error: &Error, _ctx: Arc<Context>) -> Action {
    warn!(%error, category = error.category(), name = %isvc.name_any(), "reconcile failed; retrying");
    Action::requeue(ERROR_REQUEUE)
}

/// Reads the pods, Services and endpoints of one InferenceService, and the nodes and
/// labelled children from the caches (waiting for their first list).
///
/// # Errors
/// [`Error::Observe`] when a list fails; [`Error::Cache`] when a cache can never
/// fill (its watch is gone).
pub async fn observe(
    client: &Client,
    caches: &Caches,
    namespace: &str,
    name: &str,
) -> Result<Observed, Error> {
    let selector = ListParams::default().labels(&labels::instance_selector_string(name));
    let pods = Api::<Pod>::namespaced(client.clone(), namespace)
        .list(&selector)
        .await
        .map_err(|source| Error::Observe {
            what: "pods",
            source,
        })?;
    let services = Api::<Service>::namespaced(client.clone(), namespace)
        .list(&selector)
        .await
        .map_err(|source| Error::Observe {
            what: "services",
            source,
        })?;
    caches.wait_until_ready().await?;

    let mut observed = Observed::default();
    observed::sort_pods(&pods.items, &mut observed);
    for service in &services.items {
        let service_labels = service.labels();
        if let Some(record) = observed::group_from(service) {
            observed.groups.push(record);
        } else if let Some(release) = service_labels.get(labels::RELEASE) {
            observed.release_services.insert(service.name_any());
            let bundle = service
                .annotations()
                .get(labels::BUNDLE)
                .and_then(|json| serde_json::from_str(json).ok());
            if let Some(bundle) = bundle {
                observed.release_bundles.insert(release.clone(), bundle);
            }
        }
    }
    observed.nodes = caches
        .nodes
        .state()
        .iter()
        .map(|node| (node.name_any(), observed::node_from(node)))
        .collect();
    // Serving: ready endpoints of the per-release Services, which the router sends to.
    let slices = if observed.release_services.is_empty() {
        Vec::new()
    } else {
        let names: Vec<&str> = observed
            .release_services
            .iter()
            .map(String::as_str)
            .collect();
        Api::<EndpointSlice>::namespaced(client.clone(), namespace)
            .list(&ListParams::default().labels(&format!(
                "{} in ({})",
                labels::ENDPOINT_SLICE_SERVICE,
                names.join(",")
            )))
            .await
            .map_err(|source| Error::Observe {
                what: "endpointslices",
                source,
            })?
            .items
    };
    observed.serving_pods = slices
        .iter()
        .flat_map(|slice| slice.endpoints.iter().flatten())
        .filter(|endpoint| {
            endpoint
                .conditions
                .as_ref()
                .and_then(|c| c.ready)
                .unwrap_or(false)
        })
        .filter_map(|endpoint| endpoint.target_ref.as_ref()?.name.clone())
        .collect();
    let selector_labels = labels::instance_selector(name);
    observed.labelled = BTreeMap::from([
        (
            LabelledKind::Deployment,
            cached_names(&caches.deployments, namespace, &selector_labels),
        ),
        (
            LabelledKind::ServiceAccount,
            cached_names(&caches.service_accounts, namespace, &selector_labels),
        ),
        (
            LabelledKind::Role,
            cached_names(&caches.roles, namespace, &selector_labels),
        ),
        (
            LabelledKind::RoleBinding,
            cached_names(&caches.role_bindings, namespace, &selector_labels),
        ),
        (
            LabelledKind::PodDisruptionBudget,
            cached_names(&caches.disruption_budgets, namespace, &selector_labels),
        ),
    ]);
    // HTTPRoutes are a CRD of their own: a cluster without it answers 404, which is a
    // fact for the plan (a condition), never a failed reconcile.
    match Api::<DynamicObject>::namespaced_with(
        client.clone(),
        namespace,
        &router::http_route_resource(),
    )
    .list(&selector)
    .await
    {
        Ok(routes) => {
            observed.labelled.insert(
                LabelledKind::HttpRoute,
                routes.items.iter().map(ResourceExt::name_any).collect(),
            );
        }
        Err(kube::Error::Api(status)) if status.code == 404 => {
            observed.http_route_crd_missing = true;
        }
        Err(source) => {
            return Err(Error::Observe {
                what: "httproutes",
                source,
            });
        }
    }
    Ok(observed)
}

/// Names of the `K`s in `namespace` whose labels include `selector`, from a cache
/// (which [`Caches::wait_until_ready`] has seen filled).
fn cached_names<K>(
    store: &Store<PartialObjectMeta<K>>,
    namespace: &str,
    selector: &BTreeMap<String, String>,
) -> BTreeSet<String>
where
    K: Resource<DynamicType = ()> + Clone + 'static,
{
    store
        .state()
        .iter()
        .filter(|object| object.namespace().as_deref() == Some(namespace))
        .filter(|object| {
            let labels = object.labels();
            selector
                .iter()
                .all(|(key, value)| labels.get(key) == Some(value))
        })
        .map(|object| object.name_any())
        .collect()
}

async fn apply_one<K>(
    client: &Client,
    namespace: &str,
    kind: &'static str,
    object: &K,
) -> Result<(), Error>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + Serialize
        + std::fmt::Debug,
{
    let name = object.meta().name.clone().unwrap_or_default();
    Api::<K>::namespaced(client.clone(), namespace)
        .patch(
            &name,
            &PatchParams::apply(labels::FIELD_MANAGER).force(),
            &Patch::Apply(object),
        )
        .await
        .map_err(|source| Error::Apply { kind, name, source })?;
    Ok(())
}

/// Server-side applies every object of the plan, in order.
async fn apply(client: &Client, namespace: &str, plan: &Plan) -> Result<(), Error> {
    for child in &plan.apply {
        match child {
            Child::Pod(pod) => apply_one(client, namespace, "Pod", pod.as_ref()).await?,
            Child::Service(service) => {
                apply_one(client, namespace, "Service", service.as_ref()).await?
            }
            Child::PodDisruptionBudget(pdb) => {
                apply_one(client, namespace, "PodDisruptionBudget", pdb.as_ref()).await?
            }
            Child::Deployment(deployment) => {
                apply_one(client, namespace, "Deployment", deployment.as_ref()).await?
            }
            Child::ServiceAccount(account) => {
                apply_one(client, namespace, "ServiceAccount", account.as_ref()).await?
            }
            Child::Role(role) => apply_one(client, namespace, "Role", role.as_ref()).await?,
            Child::RoleBinding(binding) => {
                apply_one(client, namespace, "RoleBinding", binding.as_ref()).await?
            }
            Child::HttpRoute(route) => apply_http_route(client, namespace, route).await?,
        }
    }
    Ok(())
}

/// Server-side applies the HTTPRoute. Its CRD removed since `observe` looked (404) only
/// skips it: the next reconcile observes the CRD missing and says so in a condition.
async fn apply_http_route(
    client: &Client,
    namespace: &str,
    route: &DynamicObject,
) -> Result<(), Error> {
    let name = route.name_any();
    let result = Api::<DynamicObject>::namespaced_with(
        client.clone(),
        namespace,
        &router::http_route_resource(),
    )
    .patch(
        &name,
        &PatchParams::apply(labels::FIELD_MANAGER).force(),
        &Patch::Apply(route),
    )
    .await;
    match result {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 404 => {
            warn!(%name, %namespace, "the HTTPRoute CRD is gone; the route is not applied");
            Ok(())
        }
        Err(source) => Err(Error::Apply {
            kind: "HTTPRoute",
            name,
            source,
        }),
    }
}

/// Deletes what the plan drops; already gone is fine.
async fn delete(client: &Client, namespace: &str, plan: &Plan) -> Result<(), Error> {
    for child in &plan.delete {
        let params = DeleteParams::default();
        let name = child.name.as_str();
        let kind = child.kind.as_str();
        let result = match child.kind {
            ChildKind::Pod => delete_one::<Pod>(client, namespace, name, &params).await,
            ChildKind::Service => delete_one::<Service>(client, namespace, name, &params).await,
            ChildKind::PodDisruptionBudget => {
                delete_one::<PodDisruptionBudget>(client, namespace, name, &params).await
            }
            ChildKind::Deployment => {
                delete_one::<Deployment>(client, namespace, name, &params).await
            }
            ChildKind::ServiceAccount => {
                delete_one::<ServiceAccount>(client, namespace, name, &params).await
            }
            ChildKind::Role => delete_one::<Role>(client, namespace, name, &params).await,
            ChildKind::RoleBinding => {
                delete_one::<RoleBinding>(client, namespace, name, &params).await
            }
            ChildKind::HttpRoute => Api::<DynamicObject>::namespaced_with(
                client.clone(),
                namespace,
                &router::http_route_resource(),
            )
            .delete(name, &params)
            .await
            .map(|_| ()),
        };
        match result {
            Ok(()) => {}
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(source) => {
                return Err(Error::Delete {
                    kind,
                    name: child.name.clone(),
                    source,
                });
            }
        }
    }
    let force = DeleteParams {
        grace_period_seconds: Some(0),
        ..DeleteParams::default()
    };
    for name in &plan.force_delete_pods {
        match Api::<Pod>::namespaced(client.clone(), namespace)
            .delete(name, &force)
            .await
        {
            Ok(_) => info!(pod = %name, "force-deleted a pod on a NotReady node"),
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(source) => {
                return Err(Error::Delete {
                    kind: "Pod",
                    name: name.clone(),
                    source,
                });
            }
        }
    }
    Ok(())
}

async fn delete_one<K>(
    client: &Client,
    namespace: &str,
    name: &str,
    params: &DeleteParams,
) -> Result<(), kube::Error>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug,
{
    Api::<K>::namespaced(client.clone(), namespace)
        .delete(name, params)
        .await
        .map(|_| ())
}

/// Writes the status subresource, never the spec.
async fn publish_status(
    client: &Client,
    namespace: &str,
    name: &str,
    status: &InferenceServiceStatus,
) -> Result<InferenceService, Error> {
    let patch = serde_json::json!({
        "apiVersion": InferenceService::api_version(&()),
        "kind": InferenceService::kind(&()),
        "status": status,
    });
    Api::<InferenceService>::namespaced(client.clone(), namespace)
        .patch_status(
            name,
            &PatchParams::apply(labels::FIELD_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await
        .map_err(Error::Status)
}

/// The `action` of a recorded event. kube's `Recorder` folds events with the same type,
/// reason and action into one series that keeps the first note, so two different
/// decisions with one reason (rolling out bundle A, later bundle B) would show only A.
/// A digest of the note keeps different decisions apart while exact repeats still
/// count up one series.
fn event_action(note: &str) -> String {
    use std::hash::{Hash as _, Hasher as _};
    let mut hasher = std::hash::DefaultHasher::new();
    note.hash(&mut hasher);
    format!("Reconcile/{:016x}", hasher.finish())
}

#[cfg(test)]
mod tests {
    use futures::stream::FuturesUnordered;

    use super::*;

    /// The CPU sample, as the controller's cache would hold it, with `uid` and
    /// `status`.
    fn cached(uid: &str, status: Option<&InferenceServiceStatus>) -> InferenceService {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../manifests/samples/smollm2-cpu.yaml"
        );
        let text = std::fs::read_to_string(path).expect("the CPU sample");
        let mut isvc: InferenceService = serde_yaml::from_str(&text).expect("a valid sample");
        isvc.metadata.uid = Some(uid.to_owned());
        isvc.status = status.cloned();
        isvc
    }

    fn status(stable: &str) -> InferenceServiceStatus {
        InferenceServiceStatus {
            stable_release: Some(stable.to_owned()),
            ..InferenceServiceStatus::default()
        }
    }

    #[test]
    fn a_reconcile_plans_from_the_status_it_wrote_until_the_cache_shows_it() {
        let written = WrittenStatuses::default();
        let (before, after) = (status("old"), status("new"));
        // Nothing written: the cache's status.
        assert_eq!(written.previous(&cached("a", Some(&before))), None);
        written.remember(&cached("a", Some(&before)), Some(after.clone()));
        // The cache lags the write: the written status, as long as it lags.
        assert_eq!(
            written.previous(&cached("a", Some(&before))),
            Some(after.clone())
        );
        assert_eq!(written.previous(&cached("a", None)), Some(after.clone()));
        // Another object is not affected.
        assert_eq!(written.previous(&cached("b", Some(&before))), None);
        // The cache caught up: its status, and the entry is gone, so a later status
        // in the cache (from another writer) is taken as it is.
        assert_eq!(written.previous(&cached("a", Some(&after))), None);
        assert_eq!(written.previous(&cached("a", Some(&before))), None);
        // Deleted: forgotten.
        written.remember(&cached("a", Some(&before)), Some(after.clone()));
        written.forget(&cached("a", Some(&before)));
        assert_eq!(written.previous(&cached("a", Some(&before))), None);
    }

    /// The controller polls its reconciles in one task, each with its own waker; all
    /// that wait for the caches at start-up must wake once the first lists arrive.
    #[tokio::test]
    async fn every_reconcile_waiting_for_the_caches_wakes_when_they_fill() {
        let (nodes, mut node_writer) = reflector::store::<Node>();
        let (deployments, mut deployment_writer) = reflector::store();
        let (service_accounts, mut service_account_writer) = reflector::store();
        let (roles, mut role_writer) = reflector::store();
        let (role_bindings, mut role_binding_writer) = reflector::store();
        let (budgets, mut budget_writer) = reflector::store();
        let caches = Caches::new(
            nodes,
            deployments,
            service_accounts,
            roles,
            role_bindings,
            budgets,
        );
        let mut waiting: FuturesUnordered<_> = (0..3)
            .map(|_| {
                let caches = caches.clone();
                async move { caches.wait_until_ready().await }
            })
            .collect();
        assert!(futures::poll!(waiting.next()).is_pending());
        node_writer.apply_watcher_event(&watcher::Event::InitDone);
        deployment_writer.apply_watcher_event(&watcher::Event::InitDone);
        service_account_writer.apply_watcher_event(&watcher::Event::InitDone);
        role_writer.apply_watcher_event(&watcher::Event::InitDone);
        role_binding_writer.apply_watcher_event(&watcher::Event::InitDone);
        assert!(
            futures::poll!(waiting.next()).is_pending(),
            "ready before the last cache filled"
        );
        budget_writer.apply_watcher_event(&watcher::Event::InitDone);
        let woken = tokio::time::timeout(Duration::from_secs(10), async {
            let mut woken = 0;
            while let Some(result) = waiting.next().await {
                assert!(result.is_ok());
                woken += 1;
            }
            woken
        })
        .await;
        assert_eq!(woken.ok(), Some(3), "a waiter was never woken");
    }

    #[tokio::test]
    async fn a_cache_whose_watch_is_gone_is_named() {
        let (nodes, node_writer) = reflector::store::<Node>();
        drop(node_writer);
        let caches = Caches::new(
            nodes,
            reflector::store().0,
            reflector::store().0,
            reflector::store().0,
            reflector::store().0,
            reflector::store().0,
        );
        let error = caches.wait_until_ready().await;
        assert!(matches!(error, Err(Error::Cache("nodes"))), "{error:?}");
    }

    /// The API server's answer when the service range is exhausted, as kube returns it.
    fn refused(code: u16, message: &str) -> kube::Error {
        kube::Error::Api(
            kube::core::Status {
                code,
                message: message.to_owned(),
                reason: "InternalError".to_owned(),
                ..kube::core::Status::failure(message, "InternalError")
            }
            .boxed(),
        )
    }

    #[test]
    fn a_refused_apply_carries_the_api_message_into_status() {
        let error = Error::Apply {
            kind: "Service",
            name: "chat-g3".to_owned(),
            source: refused(
                500,
                "Internal error occurred: failed to allocate a serviceIP: range is full",
            ),
        };
        let failure = apply_failure(&error).expect("an apply failure");
        assert_eq!(
            failure,
            plan::ApplyFailure {
                kind: "Service",
                name: "chat-g3".to_owned(),
                message: "Internal error occurred: failed to allocate a serviceIP: range is full"
                    .to_owned(),
            }
        );
        let now = Time(Timestamp::from_second(100).unwrap_or(Timestamp::UNIX_EPOCH));
        let (status, events) =
            plan::apply_failed(&InferenceServiceStatus::default(), 1, &failure, &now);
        let ready = &status.conditions[0];
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            ("False", plan::APPLY_FAILED)
        );
        assert!(ready.message.contains("range is full"), "{}", ready.message);
        assert_eq!(events.len(), 1);
    }

    #[test]
    fn only_apply_errors_are_reported_as_apply_failures() {
        let error = Error::Delete {
            kind: "Pod",
            name: "chat-g0-r0".to_owned(),
            source: refused(409, "conflict"),
        };
        assert_eq!(apply_failure(&error), None);
        assert_eq!(apply_failure(&Error::Cache("nodes")), None);
    }
}
