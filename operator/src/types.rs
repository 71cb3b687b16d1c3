//! The plain types the planner and the renderers share: the [`Context`] every renderer
//! reads, the [`Child`] objects they render (named by [`ChildRef`]) and the
//! [`PlannedEvent`]s a plan records.
//!
//! A leaf: [`crate::plan`], [`crate::pod`], [`crate::router`] and [`crate::rollout`]
//! all import these, and this module imports none of them back, so the planner can
//! call the renderers without a cycle.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Service, ServiceAccount};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::DynamicObject;
use slipway_api::drain::DrainBudget;
use slipway_api::spec::InferenceServiceSpec;
use slipway_contract::{RouterArgs, ServeArgs};

use crate::groups::GroupShape;
use crate::model::BundleStaging;
use crate::observed::LabelledKind;

/// A child object.
#[derive(Debug, Clone, PartialEq)]
pub enum Child {
    Pod(Box<Pod>),
    Service(Box<Service>),
    PodDisruptionBudget(Box<PodDisruptionBudget>),
    Deployment(Box<Deployment>),
    ServiceAccount(Box<ServiceAccount>),
    Role(Box<Role>),
    RoleBinding(Box<RoleBinding>),
    /// A Gateway API HTTPRoute, typed by the cluster's CRD (see [`crate::router`]).
    HttpRoute(Box<DynamicObject>),
}

impl Child {
    /// The child's kind and name.
    pub fn reference(&self) -> ChildRef {
        let (kind, meta) = match self {
            Self::Pod(pod) => (ChildKind::Pod, &pod.metadata),
            Self::Service(service) => (ChildKind::Service, &service.metadata),
            Self::PodDisruptionBudget(pdb) => (ChildKind::PodDisruptionBudget, &pdb.metadata),
            Self::Deployment(deployment) => (ChildKind::Deployment, &deployment.metadata),
            Self::ServiceAccount(account) => (ChildKind::ServiceAccount, &account.metadata),
            Self::Role(role) => (ChildKind::Role, &role.metadata),
            Self::RoleBinding(binding) => (ChildKind::RoleBinding, &binding.metadata),
            Self::HttpRoute(route) => (ChildKind::HttpRoute, &route.metadata),
        };
        ChildRef {
            kind,
            name: meta.name.clone().unwrap_or_default(),
        }
    }
}

/// Kinds of children.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ChildKind {
    Pod,
    Service,
    PodDisruptionBudget,
    Deployment,
    ServiceAccount,
    Role,
    RoleBinding,
    HttpRoute,
}

impl ChildKind {
    /// The Kubernetes kind.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pod => "Pod",
            Self::Service => "Service",
            Self::PodDisruptionBudget => "PodDisruptionBudget",
            Self::Deployment => "Deployment",
            Self::ServiceAccount => "ServiceAccount",
            Self::Role => "Role",
            Self::RoleBinding => "RoleBinding",
            Self::HttpRoute => "HTTPRoute",
        }
    }
}

impl From<LabelledKind> for ChildKind {
    fn from(kind: LabelledKind) -> Self {
        match kind {
            LabelledKind::Deployment => Self::Deployment,
            LabelledKind::ServiceAccount => Self::ServiceAccount,
            LabelledKind::Role => Self::Role,
            LabelledKind::RoleBinding => Self::RoleBinding,
            LabelledKind::PodDisruptionBudget => Self::PodDisruptionBudget,
            LabelledKind::HttpRoute => Self::HttpRoute,
        }
    }
}

/// A child by kind and name (in the InferenceService's namespace).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ChildRef {
    pub kind: ChildKind,
    pub name: String,
}

/// `Normal` or `Warning`, as events have it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    Normal,
    Warning,
}

/// An event to record on the InferenceService.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedEvent {
    pub type_: EventType,
    pub reason: &'static str,
    pub note: String,
}

/// Everything about one InferenceService that rendering needs, read once.
#[derive(Debug, Clone)]
pub struct Context<'a> {
    pub name: &'a str,
    pub namespace: &'a str,
    pub spec: &'a InferenceServiceSpec,
    pub owner: OwnerReference,
    /// Short release-bundle hash.
    pub release: &'a str,
    pub kv_namespace: String,
    pub shape: GroupShape,
    pub drain: DrainBudget,
    /// Where the engine finds the bundle's files.
    pub staging: BundleStaging,
    /// The engine container's `serve` arguments (user's extras merged and checked).
    pub serve: ServeArgs,
    /// Where engines export request traces (the operator's `--otlp-endpoint`).
    pub engine_otlp_endpoint: Option<&'a str>,
    /// The router container's arguments.
    pub router: RouterArgs,
}

impl Context<'_> {
    /// The metadata of a child named `name`: in the InferenceService's namespace and
    /// owned by it, so the garbage collector removes it with the InferenceService.
    pub fn child_meta(&self, name: String, labels: BTreeMap<String, String>) -> ObjectMeta {
        ObjectMeta {
            name: Some(name),
            namespace: Some(self.namespace.to_owned()),
            labels: Some(labels),
            owner_references: Some(vec![self.owner.clone()]),
            ..ObjectMeta::default()
        }
    }
}
