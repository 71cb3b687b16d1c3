//! One namespace per test, so tests can run in parallel on one cluster and a
//! failing test leaves nothing behind that confuses the next.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};

use crate::cluster::{Cluster, KUBECTL_TIMEOUT};
use crate::error::Result;
use crate::wait;

/// Label on every namespace a test created, to find leftovers of a crashed run.
pub const TEST_NAMESPACE_LABEL: &str = "slipway.dev/e2e-test";

/// A namespace owned by one test; deleted (without waiting) when dropped.
#[derive(Debug)]
pub struct TestNamespace {
    name: String,
    cluster: Cluster,
}

impl TestNamespace {
    /// Create a fresh namespace named after the test, and wait until its
    /// `default` ServiceAccount exists — before that, pods are rejected by the
    /// ServiceAccount admission plugin.
    ///
    /// # Errors
    /// When the namespace cannot be created or never gets its ServiceAccount.
    pub async fn create(cluster: &Cluster, client: &Client, test_name: &str) -> Result<Self> {
        let name = namespace_name(test_name);
        let namespace = Namespace {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                labels: Some([(TEST_NAMESPACE_LABEL.to_owned(), sanitize(test_name, 63))].into()),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        };
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &namespace)
            .await?;
        // Own the namespace from here on, so a failed wait still deletes it.
        let owned = Self {
            name,
            cluster: cluster.clone(),
        };
        let service_accounts = Api::<ServiceAccount>::namespaced(client.clone(), &owned.name);
        wait::for_object(
            &service_accounts,
            "default",
            "the namespace's default ServiceAccount",
            Duration::from_secs(30),
            |account: Option<&ServiceAccount>| account.is_some(),
        )
        .await?;
        Ok(owned)
    }

    /// The namespace's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for TestNamespace {
    fn drop(&mut self) {
        // Not waiting: finalisation of the namespace's objects is the namespace
        // controller's job and would only slow the run down.
        let deleted = self.cluster.kubectl(
            &[
                "delete",
                "namespace",
                &self.name,
                "--wait=false",
                "--ignore-not-found",
            ],
            KUBECTL_TIMEOUT,
        );
        if let Err(error) = deleted {
            tracing::warn!(%error, namespace = %self.name, "could not delete test namespace");
        }
    }
}

/// `e2e-<test>-<pid><n>`: unique within the run (counter) and across runs that
/// share a reused cluster (pid), and a valid DNS label.
fn namespace_name(test_name: &str) -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let suffix = format!(
        "-{:x}{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    let prefix = sanitize(&format!("e2e-{test_name}"), 63 - suffix.len());
    format!("{prefix}{suffix}")
}

/// Lower-case alphanumerics and dashes, at most `max_len`, not ending in a dash.
fn sanitize(raw: &str, max_len: usize) -> String {
    let mut label: String = raw
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .take(max_len)
        .collect();
    while label.ends_with('-') {
        label.pop();
    }
    label
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespace_names_are_dns_labels() {
        let name = namespace_name(
            "crd_validation::Rejects_EVERY invalid object in the table, really every one",
        );
        assert!(name.len() <= 63, "{name} is longer than 63");
        assert!(
            name.starts_with("e2e-crd-validation--rejects-every"),
            "{name}"
        );
        assert!(
            name.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'),
            "{name} has characters a DNS label cannot"
        );
        assert_ne!(namespace_name("same"), namespace_name("same"));
    }

    #[test]
    fn sanitize_never_ends_with_a_dash() {
        assert_eq!(sanitize("a::b", 2), "a");
        assert_eq!(sanitize("Scheduling::gpu_pod", 63), "scheduling--gpu-pod");
    }
}
