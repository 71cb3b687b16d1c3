//! The router of one InferenceService: the objects that put `slipway-router` between
//! clients and engines, rendered as plain values for [`crate::plan()`].
//!
//! - A Deployment of [`REPLICAS`] router pods, spread over the fault domains the groups
//!   are spread over, with the engines' restricted security context and the same drain
//!   rules: preStop sleep, `terminationGracePeriodSeconds` and the router's
//!   `--shutdown-timeout-ms` come from one [`DrainBudget`], so a stream the router
//!   relays when it is told to stop can still finish.
//! - Its ServiceAccount, and a Role with a RoleBinding that grant it only reads in the
//!   InferenceService's namespace: `get`/`list`/`watch` of this one InferenceService (by
//!   `resourceNames`, so the router watches it with a `metadata.name` field selector)
//!   and `list`/`watch` of EndpointSlices (their names are generated, so they cannot be
//!   named). The operator holds both rules itself, so it may grant them without the
//!   `escalate` or `bind` verbs.
//! - A PodDisruptionBudget that keeps one router pod through voluntary disruptions.
//! - The client Service, which selects the router pods: clients reach engines only
//!   through the router, and the router reaches the leaders of each release through
//!   that release's Service. Worker ranks never receive client traffic.
//! - When `spec.router.httpRoute` asks, a Gateway API `HTTPRoute` to the client Service,
//!   as a [`DynamicObject`]: its schema is the cluster's CRD, never a copy here.
//!
//! The router's arguments are a [`RouterArgs`] rendered with `to_args`, never string
//! literals: the router parses its command line with the same type.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use k8s_openapi::api::apps::v1::{
    Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment,
};
use k8s_openapi::api::core::v1::{
    Container, ContainerPort, EnvVar, EnvVarSource, HTTPGetAction, ObjectFieldSelector, PodSpec,
    PodTemplateSpec, Probe, ResourceRequirements, Service, ServiceAccount, ServicePort,
    ServiceSpec, TopologySpreadConstraint,
};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use serde_json::json;
use slipway_api::drain::DrainBudget;
use slipway_api::spec::{GatewayParentRef, HttpRouteSpec};
use slipway_api::status::condition;
use slipway_contract::router::ROUTER_PORT;
use slipway_contract::{LogArgs, LogFormat, RouterArgs, TelemetryArgs, paths};

use crate::conditions::Computed;
use crate::labels;
use crate::pod::{
    TERMINATION_MESSAGE_POLICY, container_security_context, first_line, pod_security_context,
    pre_stop,
};
use crate::spec_error::SpecError;
use crate::types::{Child, Context};

/// Router pods per InferenceService: one can be lost (or drained) while the other
/// carries the traffic.
pub const REPLICAS: i32 = 2;

/// The Gateway API group of the HTTPRoute and of the Gateways it attaches to.
pub const GATEWAY_API_GROUP: &str = "gateway.networking.k8s.io";

/// What a router pod asks for: it relays bytes and keeps a small prefix index, so
/// little CPU and memory; the limit stops a leak from taking the node.
const CPU_REQUEST: &str = "100m";
const MEMORY_REQUEST: &str = "64Mi";
const MEMORY_LIMIT: &str = "512Mi";

/// The node label that spreads router pods of one zone over nodes.
const HOSTNAME_KEY: &str = "kubernetes.io/hostname";

/// The HTTPRoute's API (`gateway.networking.k8s.io/v1`, plural `httproutes`).
pub fn http_route_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(GATEWAY_API_GROUP, "v1", "HTTPRoute"),
        "httproutes",
    )
}

/// The router's command line for `name`'s router pods.
///
/// Every field that the parser can fill from the operator's own environment
/// (`POD_NAMESPACE`, `SLIPWAY_LOG_FORMAT`, `OTEL_EXPORTER_OTLP_ENDPOINT`) is set here,
/// so what the operator renders never depends on the environment it runs in. The
/// namespace is left unset: the router reads `POD_NAMESPACE` from its own pod.
///
/// # Errors
/// [`SpecError::RouterArgsRejected`] when the parser refuses the name (no Kubernetes
/// name is refused).
pub fn args(
    name: &str,
    drain: &DrainBudget,
    otlp_endpoint: Option<&str>,
) -> Result<RouterArgs, SpecError> {
    let defaults = RouterArgs::for_inference_service(name)
        .map_err(|e| SpecError::RouterArgsRejected(first_line(&e)))?;
    Ok(RouterArgs {
        // All addresses of the pod's network namespace, as the engine binds (the
        // kubelet's probes and the Service reach the pod IP; port-forward loopback).
        host: IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        port: ROUTER_PORT,
        namespace: None,
        // What the router relays must finish within the same budget as the engine's
        // own drain: after preStop, before the kubelet's SIGKILL.
        shutdown_timeout: Duration::from_secs(drain.engine_shutdown_seconds),
        telemetry: TelemetryArgs {
            logs: LogArgs {
                log_format: Some(LogFormat::Json),
            },
            otlp_endpoint: otlp_endpoint.map(str::to_owned),
            ..defaults.telemetry.clone()
        },
        ..defaults
    })
}

/// Every router object of `ctx`'s InferenceService, in the order they are applied (the
/// identity before the pods that run as it), without the client Service and the
/// HTTPRoute ([`client_service`], [`http_route`]).
pub fn children(ctx: &Context<'_>, image: &str, args: &RouterArgs) -> Vec<Child> {
    vec![
        Child::ServiceAccount(Box::new(service_account(ctx))),
        Child::Role(Box::new(role(ctx))),
        Child::RoleBinding(Box::new(role_binding(ctx))),
        Child::Deployment(Box::new(deployment(ctx, image, args))),
        Child::PodDisruptionBudget(Box::new(pdb(ctx))),
    ]
}

fn meta(ctx: &Context<'_>, name: String) -> ObjectMeta {
    let mut object_labels = labels::instance_selector(ctx.name);
    object_labels.insert(
        labels::COMPONENT.to_owned(),
        labels::ROUTER_COMPONENT.to_owned(),
    );
    ctx.child_meta(name, object_labels)
}

fn service_account(ctx: &Context<'_>) -> ServiceAccount {
    ServiceAccount {
        metadata: meta(ctx, labels::router(ctx.name)),
        ..ServiceAccount::default()
    }
}

/// Reads only, in this namespace only: the InferenceService (its releases, canary
/// weight and SLO) and the EndpointSlices of its per-release Services.
fn role(ctx: &Context<'_>) -> Role {
    Role {
        metadata: meta(ctx, labels::router(ctx.name)),
        rules: Some(vec![
            PolicyRule {
                api_groups: Some(vec![slipway_api::GROUP.to_owned()]),
                resources: Some(vec!["inferenceservices".to_owned()]),
                resource_names: Some(vec![ctx.name.to_owned()]),
                verbs: vec!["get".to_owned(), "list".to_owned(), "watch".to_owned()],
                ..PolicyRule::default()
            },
            PolicyRule {
                api_groups: Some(vec!["discovery.k8s.io".to_owned()]),
                resources: Some(vec!["endpointslices".to_owned()]),
                verbs: vec!["list".to_owned(), "watch".to_owned()],
                ..PolicyRule::default()
            },
        ]),
    }
}

fn role_binding(ctx: &Context<'_>) -> RoleBinding {
    RoleBinding {
        metadata: meta(ctx, labels::router(ctx.name)),
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".to_owned()),
            kind: "Role".to_owned(),
            name: labels::router(ctx.name),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".to_owned(),
            name: labels::router(ctx.name),
            namespace: Some(ctx.namespace.to_owned()),
            ..Subject::default()
        }]),
    }
}

fn deployment(ctx: &Context<'_>, image: &str, args: &RouterArgs) -> Deployment {
    let selector = labels::router_selector(ctx.name);
    let mut pod_labels = selector.clone();
    pod_labels.insert(labels::NAME.to_owned(), "slipway-router".to_owned());
    pod_labels.insert(labels::PART_OF.to_owned(), "slipway".to_owned());

    let probe = |path: &str, period: i32, failures: i32| Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.to_owned()),
            port: IntOrString::String("http".to_owned()),
            ..HTTPGetAction::default()
        }),
        period_seconds: Some(period),
        failure_threshold: Some(failures),
        ..Probe::default()
    };
    let router = Container {
        name: "router".to_owned(),
        image: Some(image.to_owned()),
        args: Some(args.to_args()),
        // `--namespace` is read from here (RouterArgs.namespace's env), not rendered.
        env: Some(vec![EnvVar {
            name: "POD_NAMESPACE".to_owned(),
            value_from: Some(EnvVarSource {
                field_ref: Some(ObjectFieldSelector {
                    field_path: "metadata.namespace".to_owned(),
                    ..ObjectFieldSelector::default()
                }),
                ..EnvVarSource::default()
            }),
            ..EnvVar::default()
        }]),
        ports: Some(vec![ContainerPort {
            name: Some("http".to_owned()),
            container_port: i32::from(args.port),
            protocol: Some("TCP".to_owned()),
            ..ContainerPort::default()
        }]),
        resources: Some(ResourceRequirements {
            requests: Some(BTreeMap::from([
                ("cpu".to_owned(), Quantity(CPU_REQUEST.to_owned())),
                ("memory".to_owned(), Quantity(MEMORY_REQUEST.to_owned())),
            ])),
            limits: Some(BTreeMap::from([(
                "memory".to_owned(),
                Quantity(MEMORY_LIMIT.to_owned()),
            )])),
            ..ResourceRequirements::default()
        }),
        readiness_probe: Some(probe(paths::READY, 5, 2)),
        liveness_probe: Some(probe(paths::HEALTH, 10, 3)),
        termination_message_policy: Some(TERMINATION_MESSAGE_POLICY.to_owned()),
        lifecycle: pre_stop(&ctx.drain),
        security_context: Some(container_security_context()),
        ..Container::default()
    };
    let spread = |key: &str, when: &str| TopologySpreadConstraint {
        max_skew: 1,
        topology_key: key.to_owned(),
        when_unsatisfiable: when.to_owned(),
        label_selector: Some(LabelSelector {
            match_labels: Some(selector.clone()),
            ..LabelSelector::default()
        }),
        // A lost (tainted, NotReady) domain must not block placing a router elsewhere.
        node_taints_policy: Some("Honor".to_owned()),
        ..TopologySpreadConstraint::default()
    };
    let placement = &ctx.spec.router;
    let pod = PodSpec {
        service_account_name: Some(labels::router(ctx.name)),
        // The router watches the API server with this account's token.
        automount_service_account_token: Some(true),
        enable_service_links: Some(false),
        termination_grace_period_seconds: Some(
            i64::try_from(ctx.drain.termination_grace_period_seconds).unwrap_or(i64::MAX),
        ),
        security_context: Some(pod_security_context()),
        containers: vec![router],
        // Across the groups' fault domains, as strictly as the groups are; within one,
        // on different nodes when there are.
        topology_spread_constraints: Some(vec![
            spread(
                &ctx.spec.capacity.fault_domain.topology_key,
                "DoNotSchedule",
            ),
            spread(HOSTNAME_KEY, "ScheduleAnyway"),
        ]),
        node_selector: (!placement.node_selector.is_empty())
            .then(|| placement.node_selector.clone()),
        tolerations: (!placement.tolerations.is_empty()).then(|| placement.tolerations.clone()),
        ..PodSpec::default()
    };
    Deployment {
        metadata: meta(ctx, labels::router(ctx.name)),
        spec: DeploymentSpec {
            replicas: Some(REPLICAS),
            selector: LabelSelector {
                match_labels: Some(selector),
                ..LabelSelector::default()
            },
            // A new router pod is ready before an old one drains: the pods that carry
            // traffic never drop below REPLICAS during an update.
            strategy: Some(DeploymentStrategy {
                type_: Some("RollingUpdate".to_owned()),
                rolling_update: Some(RollingUpdateDeployment {
                    max_surge: Some(IntOrString::Int(1)),
                    max_unavailable: Some(IntOrString::Int(0)),
                }),
            }),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(pod_labels),
                    ..ObjectMeta::default()
                }),
                spec: Some(pod),
            },
            ..DeploymentSpec::default()
        },
        status: None,
    }
}

/// Keeps one router pod through voluntary disruptions (a node drain takes one at a time).
fn pdb(ctx: &Context<'_>) -> PodDisruptionBudget {
    PodDisruptionBudget {
        metadata: meta(ctx, labels::router(ctx.name)),
        spec: Some(PodDisruptionBudgetSpec {
            min_available: Some(IntOrString::Int(1)),
            selector: Some(LabelSelector {
                match_labels: Some(labels::router_selector(ctx.name)),
                ..LabelSelector::default()
            }),
            ..PodDisruptionBudgetSpec::default()
        }),
        status: None,
    }
}

/// The client Service: port 80 to the router pods' `http` port.
pub fn client_service(ctx: &Context<'_>) -> Service {
    Service {
        metadata: ctx.child_meta(
            labels::client_service(ctx.name),
            labels::instance_selector(ctx.name),
        ),
        spec: Some(ServiceSpec {
            selector: Some(labels::router_selector(ctx.name)),
            ports: Some(vec![ServicePort {
                name: Some("http".to_owned()),
                port: 80,
                target_port: Some(IntOrString::String("http".to_owned())),
                protocol: Some("TCP".to_owned()),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        status: None,
    }
}

/// The HTTPRoute that attaches the client Service (port 80) to the user's Gateways.
pub fn http_route(ctx: &Context<'_>, spec: &HttpRouteSpec) -> DynamicObject {
    let parent_refs: Vec<serde_json::Value> = spec
        .parent_refs
        .iter()
        .map(|parent| {
            let mut reference = json!({
                "group": GATEWAY_API_GROUP,
                "kind": "Gateway",
                "name": parent.name,
            });
            if let Some(namespace) = &parent.namespace {
                reference["namespace"] = json!(namespace);
            }
            if let Some(section) = &parent.section_name {
                reference["sectionName"] = json!(section);
            }
            reference
        })
        .collect();
    let name = labels::client_service(ctx.name);
    let mut route = DynamicObject::new(&name, &http_route_resource())
        .within(ctx.namespace)
        .data(json!({
            "spec": {
                "parentRefs": parent_refs,
                "rules": [{
                    "backendRefs": [{"kind": "Service", "name": name, "port": 80}],
                }],
            },
        }));
    route.metadata.labels = meta(ctx, name).labels;
    route.metadata.owner_references = Some(vec![ctx.owner.clone()]);
    route
}

/// The reason of `HTTPRouteReady=False` when the cluster serves no HTTPRoute.
pub const GATEWAY_API_MISSING: &str = "GatewayAPIMissing";

/// `HTTPRouteReady`, while `spec.router.httpRoute` is set or the previous status still
/// has it (to say the route was removed); `None` otherwise.
pub fn http_route_condition(
    spec: Option<&HttpRouteSpec>,
    route_name: &str,
    crd_missing: bool,
    previous: &[Condition],
) -> Option<Computed> {
    match spec {
        Some(_) if crd_missing => Some(Computed::new(
            condition::HTTP_ROUTE_READY,
            false,
            GATEWAY_API_MISSING,
            format!(
                "spec.router.httpRoute is set, but the cluster serves no {GATEWAY_API_GROUP}/v1 HTTPRoute: install the Gateway API CRDs; everything else is reconciled, and clients reach the router through Service {route_name}"
            ),
        )),
        Some(spec) => Some(Computed::new(
            condition::HTTP_ROUTE_READY,
            true,
            "Applied",
            format!(
                "HTTPRoute {route_name} sends traffic from {} to Service {route_name} port 80 (the router)",
                spec.parent_refs
                    .iter()
                    .map(parent_name)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )),
        None => previous
            .iter()
            .any(|c| c.type_ == condition::HTTP_ROUTE_READY)
            .then(|| {
                Computed::new(
                    condition::HTTP_ROUTE_READY,
                    false,
                    "NotRequested",
                    "spec.router.httpRoute is unset: no HTTPRoute is rendered",
                )
            }),
    }
}

/// `Gateway ns/name:section` for a person.
fn parent_name(parent: &GatewayParentRef) -> String {
    let mut text = String::from("Gateway ");
    if let Some(namespace) = &parent.namespace {
        text.push_str(namespace);
        text.push('/');
    }
    text.push_str(&parent.name);
    if let Some(section) = &parent.section_name {
        text.push(':');
        text.push_str(section);
    }
    text
}
