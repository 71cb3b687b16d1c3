//! What every e2e test starts from: the cluster, an admin client, a namespace.

use std::sync::Arc;

use anyhow::Context as _;
use kube::api::DynamicObject;
use kube::core::{ApiResource, GroupVersionKind};
use kube::{Api, Client};
use serde_json::{Value, json};
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

/// A valid InferenceService that sets every field a validation rule looks at
/// (so each invalid variant differs from it in exactly one place).
pub fn valid_inference_service(name: &str) -> Value {
    json!({
        "apiVersion": format!("{}/{}", crd::GROUP, crd::VERSION),
        "kind": crd::KIND,
        "metadata": { "name": name },
        "spec": {
            "release": {
                "model": {
                    "uri": "file:///models/smollm2-135m-instruct-q4_1.gguf",
                    "sha256": "a".repeat(64),
                },
                "tokenizer": { "uri": "file:///models/tokenizer.json", "sha256": "b".repeat(64) },
                "adapters": [
                    { "name": "support-bot", "uri": "file:///adapters/support.gguf", "sha256": "c".repeat(64) },
                ],
                "kvNamespace": "smollm2-v1",
                "engine": { "image": "ghcr.io/slipway-dev/engine:0.1.0", "device": "CPU", "maxOutputTokens": 512 },
            },
            "parallelism": { "tensor": 2, "pipeline": 1, "gpusPerNode": 8 },
            "capacity": {
                "demand": {"static": 40.0},
                "replicaGoodput": 12.5,
                "demandUnit": "RequestsPerSecond",
                "faultDomain": { "topologyKey": "topology.kubernetes.io/zone", "fLoss": 0.34 },
                "minReplicas": 2,
                "maxReplicas": 12,
            },
            "slo": {
                "ttft": { "threshold": "2s" },
                "tpot": { "threshold": "150ms" },
                "availability": 0.999,
            },
            "rollout": {
                "steps": [
                    { "weight": 10, "pause": "5m" },
                    { "weight": 50, "pause": "10m" },
                    { "weight": 100 },
                ],
                "analysis": {
                    "interval": "30s",
                    "shortWindow": "1m",
                    "longWindow": "5m",
                    "inconclusivePolicy": "RollbackAfter",
                    "inconclusiveTimeout": "15m",
                    "metrics": { "source": "Scrape" },
                },
                "maxSurge": 1,
            },
            "drain": { "preStopDelaySeconds": 10, "maxDrainSeconds": 600 },
        },
    })
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
