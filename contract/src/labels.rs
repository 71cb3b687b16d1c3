//! Labels and names that another process selects by: the router finds the engine
//! endpoints of a release through the operator's per-release Service, and both sides
//! name it with [`release_service`]. The operator's own labels module re-exports these
//! and adds what only it reads.

/// The one field manager of every write the operator makes (also the `managed-by`
/// label value of its children).
pub const FIELD_MANAGER: &str = "slipway-operator";

pub const NAME: &str = "app.kubernetes.io/name";
pub const INSTANCE: &str = "app.kubernetes.io/instance";
pub const COMPONENT: &str = "app.kubernetes.io/component";
pub const MANAGED_BY: &str = "app.kubernetes.io/managed-by";
pub const PART_OF: &str = "app.kubernetes.io/part-of";
pub const VERSION: &str = "app.kubernetes.io/version";
/// Short release-bundle hash.
pub const RELEASE: &str = "slipway.dev/release";
/// Rank inside the group; 0 is the leader.
pub const RANK: &str = "slipway.dev/rank";

/// `app.kubernetes.io/component` of engine pods.
pub const ENGINE_COMPONENT: &str = "engine";
/// `app.kubernetes.io/component` of router pods.
pub const ROUTER_COMPONENT: &str = "router";

/// The label Kubernetes puts on an EndpointSlice: the name of its Service.
pub const ENDPOINT_SLICE_SERVICE: &str = "kubernetes.io/service-name";

/// Name of a release's Service (its ready leaders are the router's endpoints).
#[must_use]
pub fn release_service(instance: &str, release: &str) -> String {
    format!("{instance}-{release}")
}

/// Name of an InferenceService's router Deployment, ServiceAccount, Role and PDB.
#[must_use]
pub fn router(instance: &str) -> String {
    format!("{instance}-router")
}
