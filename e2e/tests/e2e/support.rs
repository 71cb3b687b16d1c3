//! What every e2e test starts from: the cluster, an admin client, a namespace.

use std::sync::Arc;

use anyhow::Context as _;
use kube::api::DynamicObject;
use kube::core::{ApiResource, GroupVersionKind};
use kube::{Api, Client};
use serde_json::Value;
use slipway_e2e::{Cluster, TestNamespace, crd};

/// Handed to each test: its name and the shared cluster.
pub struct TestContext {
    pub name: &'static str,
    pub cluster: Arc<Cluster>,
}

impl TestContext {
    pub fn new(name: &'static str, cluster: Arc<Cluster>) -> Self {
        Self { name, cluster }
    }

    /// An admin client bound to this test's runtime.
    pub async fn admin(&self) -> anyhow::Result<Client> {
        self.cluster.client().await.context("admin client")
    }

    /// A fresh namespace for this test, deleted when dropped.
    pub async fn namespace(&self, admin: &Client) -> anyhow::Result<TestNamespace> {
        TestNamespace::create(&self.cluster, admin, self.name)
            .await
            .context("creating the test namespace")
    }
}

/// The InferenceService API, untyped so tests can send objects the Rust types
/// could never produce (that is what validation tests are for).
pub fn inference_services(client: &Client, namespace: &str) -> Api<DynamicObject> {
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(crd::GROUP, crd::VERSION, crd::KIND),
        "inferenceservices",
    );
    Api::namespaced_with(client.clone(), namespace, &resource)
}

/// Turn a JSON value into the DynamicObject the API takes.
pub fn dynamic(value: Value) -> anyhow::Result<DynamicObject> {
    serde_json::from_value(value).context("object is not a Kubernetes object")
}

/// The API server's message for a rejected request, or why there was none.
pub fn rejection_message<T>(result: &Result<T, kube::Error>) -> Option<String> {
    match result {
        Err(kube::Error::Api(status)) => Some(format!("{} ({})", status.message, status.code)),
        _ => None,
    }
}
