//! `InferenceService.spec`: what a platform team declares.
//!
//! Doc comments here are what `kubectl explain inferenceservice.spec...` prints, so they
//! are written for the person reading them there. Invariants the API server can check
//! live in the schema as OpenAPI bounds and CEL rules (`x-kubernetes-validations`) with
//! messages a person understands; every string and list is bounded (`maxLength`,
//! `maxItems`) so the API server's CEL cost estimate stays within its limits.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{EnvVar, ResourceRequirements, Toleration};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::status::InferenceServiceStatus;

/// Most groups one InferenceService may run; keeps list sizes and CEL costs bounded.
pub const MAX_REPLICAS_LIMIT: i32 = 1000;
/// Most GPUs one group (tensor × pipeline) may span.
pub const MAX_GROUP_GPUS: i32 = 512;

/// Declares a model served by groups of Slipway engine pods: the release bundle to
/// serve, how each replica is split over GPUs, how much capacity to keep across fault
/// domains, the SLO users are promised, and how new releases roll out.
// Each printcolumn(...) repeats `type_ = ...`; clippy reads the repeats as duplicated
// attributes of the struct.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "slipway.dev",
    version = "v1alpha1",
    kind = "InferenceService",
    plural = "inferenceservices",
    singular = "inferenceservice",
    shortname = "infsvc",
    category = "slipway",
    namespaced,
    status = "InferenceServiceStatus",
    derive = "PartialEq",
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "Desired",
        type_ = "integer",
        json_path = ".status.replicas.desired"
    ),
    printcolumn(
        name = "Serving",
        type_ = "integer",
        json_path = ".status.replicas.serving"
    ),
    printcolumn(name = "Stable", type_ = "string", json_path = ".status.stableRelease"),
    printcolumn(
        name = "Canary",
        type_ = "integer",
        json_path = ".status.canaryRelease.weight"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = whole_nodes_rule())]
pub struct InferenceServiceSpec {
    /// The release bundle to serve: model, tokenizer, adapters, chat template, KV
    /// namespace and engine. It is the unit of rollout: changing anything in it starts a
    /// canary rollout of the new bundle, identified by its hash.
    pub release: ReleaseBundle,

    /// The model name clients send in the OpenAI API's `model` field, and that
    /// `/v1/models` lists. Unset: the InferenceService's name. It is not part of the
    /// release bundle, so a new release keeps the name clients already use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 128))]
    #[x_kube(validation = Rule::new("self.matches('^[A-Za-z0-9][A-Za-z0-9._:/-]*$')").message("servedModelName must start with a letter or digit and hold only letters, digits, '.', '_', ':', '/' and '-'"))]
    pub served_model_name: Option<String>,

    /// How one replica (a "group") is split over GPUs.
    #[serde(default)]
    pub parallelism: Parallelism,

    /// How many groups to run, and how they must survive the loss of a fault domain.
    pub capacity: CapacitySpec,

    /// The latency and availability users are promised, as a share of requests: a
    /// request is good when it succeeds with its TTFT and its TPOT both within their
    /// thresholds, and `availability` is the share of requests that must be good (one
    /// objective for all targets, not a percentile per target). The engine counts the
    /// good requests; rollouts are judged on them.
    #[serde(default)]
    pub slo: SloSpec,

    /// How a new release is rolled out and when it is rolled back.
    #[serde(default)]
    pub rollout: RolloutSpec,

    /// How a pod stops: endpoint propagation delay and the longest drain allowed.
    #[serde(default)]
    pub drain: DrainSpec,

    /// Overrides merged into every engine pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_template: Option<PodOverrides>,

    /// The router that carries client traffic: the client Service selects its pods,
    /// and it sends each request to the stable or canary release by the canary's
    /// request weight. Where its pods run, and an optional Gateway API route to it.
    #[serde(default)]
    pub router: RouterSpec,
}

// ---------------------------------------------------------------------------------------
// release
// ---------------------------------------------------------------------------------------

/// Everything that changes a release's outputs or KV-cache layout, and nothing else.
// The transition rule spells optional fields out with has() rather than CEL's `.?`
// optionals: the API server accepts both, but kube's client-side evaluator, which the
// crds tests use, parses only the former.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new(
    "!has(self.kvNamespace) || !has(oldSelf.kvNamespace) || self.kvNamespace != oldSelf.kvNamespace || (self.model == oldSelf.model && has(self.tokenizer) == has(oldSelf.tokenizer) && (!has(self.tokenizer) || self.tokenizer == oldSelf.tokenizer) && (has(self.adapters) && size(self.adapters) > 0) == (has(oldSelf.adapters) && size(oldSelf.adapters) > 0) && (!has(self.adapters) || !has(oldSelf.adapters) || self.adapters == oldSelf.adapters))"
).message(
    "a new model must not share KV/prefix-cache entries with the old one: when model, tokenizer or adapters change, change kvNamespace too (or leave it unset to derive it from the release hash)"
))]
// The engine applies LoRA adapters on its CPU backend only (it refuses them on CUDA at
// start-up); refused here so the user hears it at apply time, not from a crashing pod.
#[x_kube(validation = Rule::new(
    "!has(self.adapters) || size(self.adapters) == 0 || !has(self.engine.device) || self.engine.device != 'CUDA'"
).message("adapters are served on device CPU only for now: the CUDA backend does not apply LoRA adapters yet"))]
pub struct ReleaseBundle {
    /// The model weights.
    pub model: ModelSource,

    /// The tokenizer. Unset: the tokenizer embedded in the model file is used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<ArtifactSource>,

    /// LoRA adapters loaded next to the model, addressed by name in requests.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    #[x_kube(validation = Rule::new("self.all(a, self.exists_one(b, b.name == a.name))").message("adapter names must be unique"))]
    pub adapters: Vec<Adapter>,

    /// A Jinja chat template that replaces the one stored in the model file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 65536))]
    pub chat_template: Option<String>,

    /// Names the prefix-cache space of this release: requests only share cached KV
    /// blocks within one namespace. Unset: derived from the release hash, so every
    /// release gets its own. If set, it must change whenever the model, tokenizer or
    /// adapters change, since KV entries of one model are garbage to another.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 63))]
    #[x_kube(validation = Rule::new("self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')").message("kvNamespace must be a DNS label: lowercase letters, digits and '-', starting and ending with a letter or digit, at most 63 characters"))]
    pub kv_namespace: Option<String>,

    /// The engine that serves the model.
    pub engine: EngineSpec,
}

/// Where a model comes from and how to verify it.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ModelSource {
    /// Where the engine loads the model from: a path inside the image or a mounted
    /// volume (`file:///models/x.gguf` or `/models/x.gguf`), a file on a
    /// PersistentVolumeClaim mounted read-only (`pvc://<claim>/<path>`), or an
    /// `https://` (or `http://`) URL an init container fetches. The file is llama.cpp's
    /// GGUF (weights, tokenizer and chat template in one file); the engine refuses any
    /// other format.
    #[schemars(length(min = 1, max = 2048))]
    pub uri: String,

    /// SHA-256 of the model file, 64 lowercase hex characters. Whatever the source, the
    /// engine hashes the file before loading it and refuses one that does not match.
    /// Required for URL sources.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    #[x_kube(validation = sha256_rule())]
    pub sha256: Option<String>,
}

/// A separately shipped artifact (tokenizer) and how to verify it.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ArtifactSource {
    /// Where the engine loads it from, in the forms of `model.uri`: a path, a file on
    /// a PersistentVolumeClaim (`pvc://<claim>/<path>`), or an `https://` URL an init
    /// container fetches (then `sha256` is required).
    #[schemars(length(min = 1, max = 2048))]
    pub uri: String,

    /// SHA-256 of the file, 64 lowercase hex characters. The engine verifies it
    /// before loading the file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    #[x_kube(validation = sha256_rule())]
    pub sha256: Option<String>,
}

/// A LoRA adapter served next to the base model.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Adapter {
    /// The name requests use to select this adapter (the OpenAI `model` field).
    #[schemars(length(min = 1, max = 63))]
    #[x_kube(validation = Rule::new("self.matches('^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$')").message("adapter name must be lowercase letters, digits, '-' or '.', starting and ending with a letter or digit"))]
    pub name: String,

    /// Where the engine loads the adapter (llama.cpp's LoRA GGUF) from, in the forms
    /// of `model.uri`: a path, `pvc://<claim>/<path>`, or an `https://` URL an init
    /// container fetches (then `sha256` is required).
    #[schemars(length(min = 1, max = 2048))]
    pub uri: String,

    /// SHA-256 of the adapter file, 64 lowercase hex characters. The engine verifies
    /// it before loading the file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    #[x_kube(validation = sha256_rule())]
    pub sha256: Option<String>,
}

/// The engine container of a release.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct EngineSpec {
    /// The slipway-engine container image.
    #[schemars(length(min = 1, max = 512))]
    pub image: String,

    /// Which accelerator the engine runs on. `CUDA` requests `tensor × pipeline` GPUs
    /// per group; `CPU` requests none (for small models and tests).
    #[serde(default)]
    pub device: Device,

    /// The most tokens one request may generate. The engine enforces it, and the pod's
    /// termination grace period is sized so a stream of this length can finish.
    #[serde(default = "default_max_output_tokens")]
    #[schemars(range(min = 1, max = 131072))]
    pub max_output_tokens: i32,

    /// Extra command-line arguments for `slipway-engine serve`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(max = 1024)))]
    pub args: Vec<String>,

    /// Extra environment variables for the engine container.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub env: Vec<EnvVar>,

    /// CPU and memory for the engine container. GPUs are added by the operator from
    /// `parallelism`; do not list them here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
}

fn default_max_output_tokens() -> i32 {
    1024
}

/// Which accelerator the engine runs on.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Device {
    /// NVIDIA GPUs through CUDA; each pod requests `nvidia.com/gpu`.
    #[default]
    #[serde(rename = "CUDA")]
    Cuda,
    /// The engine's CPU backend; pods request no GPUs.
    #[serde(rename = "CPU")]
    Cpu,
}

// ---------------------------------------------------------------------------------------
// parallelism
// ---------------------------------------------------------------------------------------

/// How one replica is split. One group = `tensor × pipeline` ranks = one replica =
/// one scheduling and failure unit. On CUDA a rank is a GPU, and a group larger than
/// one node becomes several pods (a leader and workers) that are placed and restarted
/// together; it must fill whole nodes (`tensor × pipeline` a multiple of
/// `gpusPerNode`). On CPU (`release.engine.device: CPU`) every rank is a pod of its
/// own, one engine process each, and `gpusPerNode` places nothing.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("self.tensor * self.pipeline <= 512").message("a group may span at most 512 GPUs (tensor × pipeline)")
)]
pub struct Parallelism {
    /// Tensor-parallel degree: GPUs that split every layer. Kept inside one pod (one
    /// node's NVLink) whenever it fits.
    #[serde(default = "one")]
    #[schemars(range(min = 1, max = 64))]
    pub tensor: i32,

    /// Pipeline-parallel degree: stages that split the layers.
    #[serde(default = "one")]
    #[schemars(range(min = 1, max = 64))]
    pub pipeline: i32,

    /// GPUs on each node. A CUDA group larger than this is split over several nodes
    /// and must fill them: `tensor × pipeline` must be a multiple of it. Not used on
    /// CPU, where each rank is a pod of its own.
    #[serde(default = "default_gpus_per_node")]
    #[schemars(range(min = 1, max = 16))]
    pub gpus_per_node: i32,

    /// The node label whose values are racks or NVLink domains. All pods of a
    /// multi-pod group are placed in one value of it (required pod affinity), so the
    /// group's pipeline traffic stays on the fast fabric. A node without this label
    /// takes no pod of a multi-pod group: a CPU group of several ranks needs a key
    /// its nodes carry (e.g. `topology.kubernetes.io/zone`).
    #[serde(default = "default_colocation_key")]
    #[schemars(length(min = 1, max = 316))]
    pub colocation_topology_key: String,
}

impl Default for Parallelism {
    fn default() -> Self {
        Self {
            tensor: 1,
            pipeline: 1,
            gpus_per_node: default_gpus_per_node(),
            colocation_topology_key: default_colocation_key(),
        }
    }
}

/// What [`Parallelism::fills_whole_nodes`] says, as the CEL rule the API server runs. It
/// lives on the spec, not on `parallelism`, because it needs `release.engine.device`:
/// the two are the one statement of the rule, side by side, and `crds/tests/crd.rs`
/// checks that they agree on every shape.
fn whole_nodes_rule() -> kube::core::Rule {
    kube::core::Rule::new(
        "(has(self.release.engine.device) && self.release.engine.device == 'CPU') || self.parallelism.tensor * self.parallelism.pipeline <= self.parallelism.gpusPerNode || (self.parallelism.tensor * self.parallelism.pipeline) % self.parallelism.gpusPerNode == 0",
    )
    .message(WHOLE_NODES_MESSAGE)
}

/// The message of [`whole_nodes_rule`].
pub const WHOLE_NODES_MESSAGE: &str = "a CUDA group larger than one node must fill whole nodes: tensor × pipeline must be a multiple of gpusPerNode (on CPU every rank is a pod and gpusPerNode is not used)";

impl Parallelism {
    /// Whether a group of this shape on `device` can be placed, as the CRD's rule says
    /// (its CEL twin is on the spec, where the device is visible): on CUDA a group that
    /// fits one node is one pod, and a larger one must fill the nodes it spans, so
    /// `tensor × pipeline` must be at most `gpusPerNode` or a multiple of it. On CPU
    /// every rank is a pod of its own and `gpusPerNode` places nothing. A non-positive
    /// `gpusPerNode` (the schema's bounds refuse it) fits nothing on CUDA.
    #[must_use]
    pub fn fills_whole_nodes(&self, device: Device) -> bool {
        if device == Device::Cpu {
            return true;
        }
        let ranks = i64::from(self.tensor) * i64::from(self.pipeline);
        let per_node = i64::from(self.gpus_per_node);
        per_node > 0 && (ranks <= per_node || ranks % per_node == 0)
    }
}

fn default_colocation_key() -> String {
    "slipway.dev/nvlink-domain".to_owned()
}

fn one() -> i32 {
    1
}

fn default_gpus_per_node() -> i32 {
    8
}

// ---------------------------------------------------------------------------------------
// capacity
// ---------------------------------------------------------------------------------------

/// How many groups to run: `N_healthy = ceil(D_peak / replicaGoodput)` groups carry
/// the peak demand `D_peak`; `N_provisioned = max(minReplicas, ceil(N_healthy / (1 −
/// fLoss)))` groups run, capped at `maxReplicas`, so losing an `fLoss` share of them
/// still leaves `N_healthy`. `D_peak` is written by hand (`demand.static`) or measured
/// from the traffic that arrives (`demand.measured`). Numbers are read to a resolution
/// of 0.001.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("self.replicaGoodput > 0.0").message("replicaGoodput must be positive"),
    validation = Rule::new("self.minReplicas <= self.maxReplicas").message("minReplicas must not exceed maxReplicas")
)]
pub struct CapacitySpec {
    /// The demand to carry, in `demandUnit`s: a static peak, a measured one, or both
    /// (measured, never sized below the static value).
    pub demand: DemandSpec,

    /// What one group sustains while meeting the SLO, in `demandUnit`s.
    /// Measure it with `slipway-bench sweep`, which prints this value.
    pub replica_goodput: f64,

    /// The unit of demand and replicaGoodput. Measured demand counts requests
    /// (`RequestsPerSecond`) or generated tokens (`OutputTokensPerSecond`).
    #[serde(default)]
    pub demand_unit: DemandUnit,

    /// Which failures the capacity must survive.
    #[serde(default)]
    pub fault_domain: FaultDomain,

    /// Never run fewer groups than this.
    #[serde(default = "one")]
    #[schemars(range(min = 1, max = 1000))]
    pub min_replicas: i32,

    /// Never run more groups than this. If the cap is below what fault tolerance needs,
    /// status condition `FaultTolerant` says so.
    #[serde(default = "default_max_replicas")]
    #[schemars(range(min = 1, max = 1000))]
    pub max_replicas: i32,
}

/// Where `D_peak` comes from. `static` alone: a number written by hand. `measured`
/// alone: the peak of the arrival rate the engines count. Both: measured, with
/// `static` as its floor.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("has(self.static) || has(self.measured)").message("capacity.demand needs static, measured, or both (measured with static as its floor)"),
    validation = Rule::new("!has(self.static) || self.static > 0.0").message("demand.static must be positive")
)]
pub struct DemandSpec {
    /// The peak demand to carry, in `demandUnit`s. With `measured`: the floor, so
    /// measured demand never sizes below it (e.g. a launch known in advance).
    #[serde(default, rename = "static", skip_serializing_if = "Option::is_none")]
    pub static_peak: Option<f64>,

    /// Measure demand from the engines' request counters (rejected requests
    /// included: they are demand too) and size for its recent peak.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured: Option<MeasuredDemand>,
}

/// How demand is measured and turned into a group count. The current rate is the
/// arrival rate over `rateWindow`, read every quarter of it; `D_peak` is the highest
/// current rate over `peakWindow`, plus `headroom`. More groups are asked for at once
/// (ahead of a rising rate by the groups' measured cold start); fewer only after the
/// need stayed lower for `scaleDownStabilization`, one group at a time, each drained
/// before the next, and never during a rollout.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("duration(self.rateWindow) <= duration(self.peakWindow)").message("demand.measured.rateWindow must not be longer than peakWindow"),
    validation = Rule::new("duration(self.rateWindow) >= duration('4s')").message("demand.measured.rateWindow must be at least 4s (it is read every quarter of it)")
)]
pub struct MeasuredDemand {
    /// The window of the current arrival rate (e.g. "1m"). Shorter reacts faster to a
    /// ramp and is noisier.
    #[serde(default = "default_rate_window")]
    #[schemars(length(max = 32), pattern(crate::duration::PATTERN))]
    #[x_kube(validation = positive_duration("demand.measured.rateWindow"))]
    pub rate_window: String,

    /// The lookback over which the highest current rate is the peak (e.g. "15m").
    #[serde(default = "default_peak_window")]
    #[schemars(length(max = 32), pattern(crate::duration::PATTERN))]
    #[x_kube(validation = positive_duration("demand.measured.peakWindow"))]
    pub peak_window: String,

    /// Extra demand to size for, as a fraction of the peak (0.1 = 10 % more).
    #[serde(default = "default_headroom")]
    #[schemars(range(min = 0.0, max = 10.0))]
    pub headroom: f64,

    /// How long the demand must need fewer groups before one is removed.
    #[serde(default = "default_scale_down_stabilization")]
    #[schemars(length(max = 32), pattern(crate::duration::PATTERN))]
    #[x_kube(validation = positive_duration("demand.measured.scaleDownStabilization"))]
    pub scale_down_stabilization: String,
}

impl Default for MeasuredDemand {
    fn default() -> Self {
        Self {
            rate_window: default_rate_window(),
            peak_window: default_peak_window(),
            headroom: default_headroom(),
            scale_down_stabilization: default_scale_down_stabilization(),
        }
    }
}

fn default_rate_window() -> String {
    "1m".to_owned()
}

fn default_peak_window() -> String {
    "15m".to_owned()
}

fn default_headroom() -> f64 {
    0.1
}

fn default_scale_down_stabilization() -> String {
    "5m".to_owned()
}

fn default_max_replicas() -> i32 {
    100
}

/// The unit demand and goodput are measured in.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DemandUnit {
    /// Requests per second.
    #[default]
    RequestsPerSecond,
    /// Generated (output) tokens per second. Measured: the generated tokens, plus, for
    /// each rejected request, the mean output of the requests that were served.
    OutputTokensPerSecond,
}

/// The failure unit capacity is sized against.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.fLoss >= 0.0 && self.fLoss < 1.0").message("fLoss must be at least 0 and less than 1"))]
pub struct FaultDomain {
    /// The node label whose values are the fault domains (zones, racks, ...). Groups are
    /// spread over its values.
    #[serde(default = "default_topology_key")]
    #[schemars(length(min = 1, max = 316))]
    pub topology_key: String,

    /// The share of groups the service must be able to lose at once (e.g. 0.34 for one
    /// of three zones) and still run N_healthy. 0: no headroom for a domain loss.
    #[serde(default, rename = "fLoss")]
    pub f_loss: f64,
}

impl Default for FaultDomain {
    fn default() -> Self {
        Self {
            topology_key: default_topology_key(),
            f_loss: 0.0,
        }
    }
}

fn default_topology_key() -> String {
    "topology.kubernetes.io/zone".to_owned()
}

// ---------------------------------------------------------------------------------------
// slo
// ---------------------------------------------------------------------------------------

/// The promise made to users, as a share of requests. A request is "good" when it
/// succeeds with its TTFT within `ttft.threshold` and its TPOT within `tpot.threshold`,
/// both at once (the engine counts each request once, in
/// `slipway_requests_slo_met_total`); the SLI is the share of good requests, and
/// `availability` is the share it must reach. There is no percentile per target: a
/// promise of "P99 TTFT ≤ 2s and P99 TPOT ≤ 150ms" is written as those thresholds with
/// `availability: 0.99`, which is a little stricter (99 % of requests meet both at once).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.availability > 0.0 && self.availability < 1.0").message("slo.availability must be between 0 and 1, exclusive (e.g. 0.999)"))]
pub struct SloSpec {
    /// Time to first token: submit to the first token the client sees.
    #[serde(default = "default_ttft")]
    pub ttft: LatencyTarget,

    /// Time per output token after the first: (E2E − TTFT) / (N_out − 1).
    #[serde(default = "default_tpot")]
    pub tpot: LatencyTarget,

    /// The objective: the share of requests that must be good (e.g. 0.999). The error
    /// budget is 1 − availability. Rollouts are judged by how fast a release burns it
    /// (`rollout.analysis`); the generated alerts use the burn-rate tiers of a 30-day
    /// budget period (14.4× over 1 h spends 2 % of it).
    #[serde(default = "default_availability")]
    pub availability: f64,
}

impl Default for SloSpec {
    fn default() -> Self {
        Self {
            ttft: default_ttft(),
            tpot: default_tpot(),
            availability: default_availability(),
        }
    }
}

fn default_ttft() -> LatencyTarget {
    LatencyTarget {
        threshold: "2s".to_owned(),
    }
}

fn default_tpot() -> LatencyTarget {
    LatencyTarget {
        threshold: "150ms".to_owned(),
    }
}

fn default_availability() -> f64 {
    crate::slo::DEFAULT_AVAILABILITY
}

/// A latency threshold that every good request meets.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LatencyTarget {
    /// The latency a request must not exceed to count as good, e.g. "2s" or "150ms".
    #[schemars(length(max = 32), pattern(crate::duration::PATTERN))]
    #[x_kube(validation = positive_duration("latency threshold"))]
    pub threshold: String,
}

/// The CEL rule shared by every sha256 field.
fn sha256_rule() -> kube::core::Rule {
    kube::core::Rule::new("self.matches('^[a-f0-9]{64}$')")
        .message("sha256 must be 64 lowercase hex characters")
}

/// The CEL rule shared by every duration field: it must parse and be positive.
fn positive_duration(field: &str) -> kube::core::Rule {
    kube::core::Rule::new("duration(self) > duration('0s')").message(kube::core::Message::Message(
        format!("{field} must be a positive duration such as \"150ms\", \"30s\" or \"5m\""),
    ))
}

// ---------------------------------------------------------------------------------------
// rollout
// ---------------------------------------------------------------------------------------

/// How a new release bundle goes out: canary steps, the analysis that judges each step
/// on the SLO's error budget, and how many extra groups may run meanwhile.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RolloutSpec {
    /// Canary steps in order. Each sets the share of requests (percent) the router
    /// sends to the new release, with enough canary groups to carry that share of the
    /// demand, then waits `pause` while analysis gathers evidence. After the last step
    /// the new release becomes stable.
    #[serde(default = "default_steps")]
    #[schemars(length(min = 1, max = 20))]
    #[x_kube(validation = Rule::new("self.all(s, s.weight > 0 && s.weight <= 100)").message("canary step weights must be within (0, 100]"))]
    #[x_kube(validation = Rule::new("self.map(s, s.weight).isSorted() && self.all(s, self.exists_one(t, t.weight == s.weight))").message("canary step weights must be strictly increasing"))]
    pub steps: Vec<CanaryStep>,

    /// How each step is judged.
    #[serde(default)]
    pub analysis: AnalysisSpec,

    /// Extra groups that may run during a rollout. Canary groups are added within this
    /// budget before stable groups are removed, so serving groups never drop below
    /// N_healthy.
    #[serde(default = "one")]
    #[schemars(range(min = 1, max = 100))]
    pub max_surge: i32,

    /// How long a step's canary groups may take to become ready. Past it, the rollout
    /// is rolled back with the reason (e.g. an image that cannot be pulled).
    #[serde(default = "default_progress_deadline")]
    #[schemars(length(max = 32), pattern(crate::duration::PATTERN))]
    #[x_kube(validation = positive_duration("rollout.progressDeadline"))]
    pub progress_deadline: String,
}

impl Default for RolloutSpec {
    fn default() -> Self {
        Self {
            steps: default_steps(),
            analysis: AnalysisSpec::default(),
            max_surge: 1,
            progress_deadline: default_progress_deadline(),
        }
    }
}

fn default_progress_deadline() -> String {
    "10m".to_owned()
}

fn default_steps() -> Vec<CanaryStep> {
    vec![
        CanaryStep {
            weight: 10,
            pause: Some("5m".to_owned()),
        },
        CanaryStep {
            weight: 50,
            pause: Some("10m".to_owned()),
        },
        CanaryStep {
            weight: 100,
            pause: None,
        },
    ]
}

/// One canary step.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CanaryStep {
    /// Percent of requests sent to the new release at this step, in (0, 100]; its
    /// groups are `ceil(groups × weight / 100)`, at least one.
    #[schemars(range(min = 1, max = 100))]
    pub weight: i32,

    /// How long to hold this step (and keep analysing) before the next. Unset: advance
    /// as soon as analysis has enough evidence.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32), pattern(crate::duration::PATTERN))]
    #[x_kube(validation = positive_duration("pause"))]
    pub pause: Option<String>,
}

/// Multi-window error-budget burn analysis. Burn rate = (1 − SLI) / (1 − objective),
/// where SLI = good / eligible requests in a window. A step aborts when both the short
/// and the long window burn faster than their thresholds. The defaults follow the
/// multi-window burn-rate alerting of the Google SRE workbook (14.4 over 5m and 1h),
/// scaled down to the minutes a rollout step lasts.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("self.inconclusivePolicy != 'RollbackAfter' || has(self.inconclusiveTimeout)").message("inconclusivePolicy RollbackAfter needs inconclusiveTimeout"),
    validation = Rule::new("duration(self.shortWindow) < duration(self.longWindow)").message("shortWindow must be shorter than longWindow")
)]
pub struct AnalysisSpec {
    /// How often the canary and stable releases are measured.
    #[serde(default = "default_interval")]
    #[schemars(length(max = 32), pattern(crate::duration::PATTERN))]
    #[x_kube(validation = positive_duration("analysis.interval"))]
    pub interval: String,

    /// The short burn-rate window: reacts fast, but alone is noisy.
    #[serde(default = "default_short_window")]
    #[schemars(length(max = 32), pattern(crate::duration::PATTERN))]
    #[x_kube(validation = positive_duration("analysis.shortWindow"))]
    pub short_window: String,

    /// The long burn-rate window: confirms the short one is not a blip.
    #[serde(default = "default_long_window")]
    #[schemars(length(max = 32), pattern(crate::duration::PATTERN))]
    #[x_kube(validation = positive_duration("analysis.longWindow"))]
    pub long_window: String,

    /// Burn rate above which the short window votes to abort.
    #[serde(default = "default_burn_rate")]
    #[schemars(range(min = 1.0, max = 1000.0))]
    pub short_burn_rate_threshold: f64,

    /// Burn rate above which the long window votes to abort.
    #[serde(default = "default_burn_rate")]
    #[schemars(range(min = 1.0, max = 1000.0))]
    pub long_burn_rate_threshold: f64,

    /// Requests a window must hold to count as evidence. Fewer is inconclusive, never
    /// "good".
    #[serde(default = "default_min_requests")]
    #[schemars(range(min = 1, max = 1000000))]
    pub min_requests: i32,

    /// What to do while a window is inconclusive.
    #[serde(default)]
    pub inconclusive_policy: InconclusivePolicy,

    /// With `RollbackAfter`: how long a step may stay inconclusive before it is rolled
    /// back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32), pattern(crate::duration::PATTERN))]
    #[x_kube(validation = positive_duration("analysis.inconclusiveTimeout"))]
    pub inconclusive_timeout: Option<String>,

    /// Where the engine's SLO counters are read from.
    #[serde(default)]
    pub metrics: MetricsSource,
}

impl Default for AnalysisSpec {
    fn default() -> Self {
        Self {
            interval: default_interval(),
            short_window: default_short_window(),
            long_window: default_long_window(),
            short_burn_rate_threshold: default_burn_rate(),
            long_burn_rate_threshold: default_burn_rate(),
            min_requests: default_min_requests(),
            inconclusive_policy: InconclusivePolicy::default(),
            inconclusive_timeout: None,
            metrics: MetricsSource::default(),
        }
    }
}

fn default_interval() -> String {
    "30s".to_owned()
}

fn default_short_window() -> String {
    "1m".to_owned()
}

fn default_long_window() -> String {
    "5m".to_owned()
}

fn default_burn_rate() -> f64 {
    crate::slo::FAST_BURN.burn_rate
}

fn default_min_requests() -> i32 {
    100
}

/// What a rollout does while analysis lacks evidence.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum InconclusivePolicy {
    /// Stay at the current step and say so in status (`rolloutHold`).
    #[default]
    Hold,
    /// Roll back at once.
    Rollback,
    /// Hold, then roll back once `inconclusiveTimeout` has passed.
    RollbackAfter,
}

/// Where SLO counters come from.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.source != 'Prometheus' || has(self.prometheus)").message("metrics.source Prometheus needs metrics.prometheus.url"))]
pub struct MetricsSource {
    /// `Scrape`: the operator reads `/metrics` of the release's ready pods itself (no
    /// extra components). `Prometheus`: PromQL over the Prometheus HTTP API. `Router`:
    /// the operator reads the router pods' per-release counters (rollout analysis only;
    /// measured demand then scrapes the engine pods).
    #[serde(default)]
    pub source: MetricsSourceKind,

    /// The Prometheus to query when source is `Prometheus`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prometheus: Option<PrometheusSource>,
}

/// Which metrics source analysis reads.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum MetricsSourceKind {
    /// Scrape the engine pods directly.
    #[default]
    Scrape,
    /// Query a Prometheus server.
    Prometheus,
    /// Scrape the router pods: the release's TTFT, TPOT and outcomes measured at the
    /// gateway, queueing and network included, for any engine that speaks the OpenAI
    /// API. Measured demand still reads the engine pods.
    Router,
}

/// A Prometheus server's HTTP API.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PrometheusSource {
    /// Base URL of the Prometheus HTTP API, e.g. `http://prometheus.monitoring:9090`.
    #[schemars(length(min = 1, max = 2048))]
    #[x_kube(validation = Rule::new("self.startsWith('http://') || self.startsWith('https://')").message("prometheus.url must start with http:// or https://"))]
    pub url: String,
}

// ---------------------------------------------------------------------------------------
// drain, pod overrides
// ---------------------------------------------------------------------------------------

/// How an engine pod stops. The pod's termination grace period is
/// `preStopDelaySeconds + TTFT threshold + maxOutputTokens × TPOT threshold + margin`,
/// capped at `maxDrainSeconds`, so a stream admitted just before termination can finish;
/// the engine is told the part of it that is its own to drain in.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.preStopDelaySeconds < self.maxDrainSeconds").message("preStopDelaySeconds must be less than maxDrainSeconds"))]
pub struct DrainSpec {
    /// Seconds the preStop hook waits before the engine stops admitting, so endpoint
    /// removal reaches every load balancer first.
    #[serde(default = "default_pre_stop_delay")]
    #[schemars(range(min = 0, max = 300))]
    pub pre_stop_delay_seconds: i32,

    /// The longest a pod may take to stop, in seconds; caps the computed grace period.
    #[serde(default = "default_max_drain")]
    #[schemars(range(min = 1, max = 86400))]
    pub max_drain_seconds: i32,
}

impl Default for DrainSpec {
    fn default() -> Self {
        Self {
            pre_stop_delay_seconds: default_pre_stop_delay(),
            max_drain_seconds: default_max_drain(),
        }
    }
}

fn default_pre_stop_delay() -> i32 {
    10
}

fn default_max_drain() -> i32 {
    600
}

/// Fields merged into every engine pod the operator creates.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PodOverrides {
    /// Node labels the pods must match (e.g. a GPU node pool).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(length(max = 32))]
    pub node_selector: BTreeMap<String, String>,

    /// Taints the pods tolerate (e.g. `nvidia.com/gpu:NoSchedule`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub tolerations: Vec<Toleration>,

    /// The ServiceAccount the pods run as.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub service_account_name: Option<String>,

    /// The PriorityClass of the pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub priority_class_name: Option<String>,

    /// Environment variables added to every container (after the release's own).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub env: Vec<EnvVar>,
}

// ---------------------------------------------------------------------------------------
// router
// ---------------------------------------------------------------------------------------

/// The router Deployment of an InferenceService (two pods, spread over fault domains).
/// Not part of the release bundle: changing it never starts a rollout.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct RouterSpec {
    /// Node labels the router pods must match. Unset: any node (the router holds no
    /// GPU, so it need not share the engines' node pool).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(length(max = 32))]
    pub node_selector: BTreeMap<String, String>,

    /// Taints the router pods tolerate.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub tolerations: Vec<Toleration>,

    /// Also attach the router to Gateways of your own (Gateway API): the operator
    /// renders a `gateway.networking.k8s.io/v1` HTTPRoute, named like the
    /// InferenceService, whose backend is the router Service (port 80). Needs the
    /// Gateway API CRDs in the cluster; without them the rest still reconciles and the
    /// `HTTPRouteReady` condition says so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http_route: Option<HttpRouteSpec>,
}

/// The HTTPRoute the operator renders to the router Service.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HttpRouteSpec {
    /// The Gateways (or their listeners) the route attaches to, as the HTTPRoute's
    /// `spec.parentRefs`. The same rules as Gateway API's hold: a Gateway named twice
    /// needs a distinct `sectionName` in each reference.
    #[schemars(length(min = 1, max = 32))]
    #[x_kube(validation = Rule::new(
        "self.all(p1, self.all(p2, p1.name == p2.name && (has(p1.__namespace__) ? p1.__namespace__ : '') == (has(p2.__namespace__) ? p2.__namespace__ : '') ? has(p1.sectionName) == has(p2.sectionName) : true))"
    ).message("parentRefs: sectionName must be set in every reference to a Gateway named more than once"))]
    #[x_kube(validation = Rule::new(
        "self.all(p1, self.exists_one(p2, p1.name == p2.name && (has(p1.__namespace__) ? p1.__namespace__ : '') == (has(p2.__namespace__) ? p2.__namespace__ : '') && (has(p1.sectionName) ? p1.sectionName : '') == (has(p2.sectionName) ? p2.sectionName : '')))"
    ).message("parentRefs: each Gateway (and sectionName) may be named only once"))]
    pub parent_refs: Vec<GatewayParentRef>,
}

/// A Gateway the HTTPRoute attaches to (Gateway API's `ParentReference`, for the kind
/// `Gateway` of group `gateway.networking.k8s.io`).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct GatewayParentRef {
    /// The Gateway's name.
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(validation = Rule::new("self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$')").message("parentRefs.name must be a Gateway name: lowercase letters, digits, '-' and '.'"))]
    pub name: String,

    /// The Gateway's namespace. Unset: the InferenceService's. A Gateway in another
    /// namespace must allow routes from this one (its listeners' `allowedRoutes`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63))]
    #[x_kube(validation = Rule::new("self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')").message("parentRefs.namespace must be a namespace name (a DNS label)"))]
    pub namespace: Option<String>,

    /// One listener of the Gateway, by name. Unset: every listener that allows the
    /// route.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(validation = Rule::new("self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$')").message("parentRefs.sectionName must be a listener name: lowercase letters, digits, '-' and '.'"))]
    pub section_name: Option<String>,
}
