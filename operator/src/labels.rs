//! Names and labels of everything the operator creates for an InferenceService.
//!
//! Invariants: every child carries `app.kubernetes.io/instance = <isvc name>` and
//! `app.kubernetes.io/managed-by = slipway-operator`, which is how orphans are found
//! and deleted by label; every name is a DNS-1035 label (≤ 63 characters), which
//! [`check_name`] guarantees by bounding the InferenceService's own name.

use std::collections::BTreeMap;

use crate::spec_error::SpecError;

pub use slipway_contract::labels::{
    COMPONENT, ENDPOINT_SLICE_SERVICE, ENGINE_COMPONENT, FIELD_MANAGER, INSTANCE, MANAGED_BY, NAME,
    PART_OF, RANK, RELEASE, ROUTER_COMPONENT, VERSION, release_service, router,
};

/// Group index, `0..desired`.
pub const GROUP: &str = "slipway.dev/group";

/// Hash of the rendered pod: a pod whose hash differs from the plan's is outdated and
/// its group is recreated (pod specs are immutable).
pub const TEMPLATE_HASH: &str = "slipway.dev/template-hash";
/// On a group's headless Service: how often the group was recreated after a failure.
pub const RESTARTS: &str = "slipway.dev/restarts";
/// On a group's headless Service: when the group was last recreated (RFC 3339).
pub const LAST_RESTART: &str = "slipway.dev/last-restart";

/// On a per-release Service: the release bundle as JSON (see `plan`, rollouts).
pub const BUNDLE: &str = "slipway.dev/bundle";

/// Longest InferenceService name that keeps every child name within 63 characters:
/// `<name>-<10-char hash>` for the per-release Service and `<name>-g999-r511` for pods.
pub const MAX_NAME_LEN: usize = 63 - 1 - slipway_api::bundle::SHORT_HASH_LEN;

/// Checks that children of `name` get valid names.
///
/// # Errors
/// [`SpecError::NameTooLong`] when the name is too long.
pub fn check_name(name: &str) -> Result<(), SpecError> {
    if name.len() > MAX_NAME_LEN {
        return Err(SpecError::NameTooLong {
            name: name.to_owned(),
            max: MAX_NAME_LEN,
        });
    }
    Ok(())
}

/// Labels every child of `instance` carries (and that select them).
pub fn instance_selector(instance: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (INSTANCE.to_owned(), instance.to_owned()),
        (MANAGED_BY.to_owned(), FIELD_MANAGER.to_owned()),
    ])
}

/// The label selector string for [`instance_selector`].
pub fn instance_selector_string(instance: &str) -> String {
    format!("{INSTANCE}={instance},{MANAGED_BY}={FIELD_MANAGER}")
}

/// Labels of every engine pod of `instance`.
pub fn engine_selector(instance: &str) -> BTreeMap<String, String> {
    let mut labels = instance_selector(instance);
    labels.insert(COMPONENT.to_owned(), ENGINE_COMPONENT.to_owned());
    labels
}

/// Labels of the router pods of `instance` (the client Service selects these).
pub fn router_selector(instance: &str) -> BTreeMap<String, String> {
    let mut labels = instance_selector(instance);
    labels.insert(COMPONENT.to_owned(), ROUTER_COMPONENT.to_owned());
    labels
}

/// Labels of one group's pods.
pub fn group_selector(instance: &str, group: u32) -> BTreeMap<String, String> {
    let mut labels = engine_selector(instance);
    labels.insert(GROUP.to_owned(), group.to_string());
    labels
}

/// Name of the client Service (it selects the router pods), of the engines'
/// PodDisruptionBudget and of the HTTPRoute.
pub fn client_service(instance: &str) -> String {
    instance.to_owned()
}

/// Name of a group's headless Service: the subdomain of its pods' DNS names.
pub fn group_service(instance: &str, group: u32) -> String {
    format!("{instance}-g{group}")
}

/// Name (and hostname) of a pod.
pub fn pod(instance: &str, group: u32, rank: u32) -> String {
    format!("{instance}-g{group}-r{rank}")
}

/// The stable DNS name of a group's leader: `<pod>.<group service>.<namespace>.svc`.
pub fn leader_host(instance: &str, namespace: &str, group: u32) -> String {
    format!(
        "{}.{}.{namespace}.svc",
        pod(instance, group, 0),
        group_service(instance, group)
    )
}
