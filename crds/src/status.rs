//! `InferenceService.status`: what the operator observed and decided, following the
//! Kubernetes API conventions (`observedGeneration`, standard `conditions`), so that
//! "what serves, and why is it stuck" is one `kubectl get -o yaml` away.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Condition types the operator sets on an InferenceService.
pub mod condition {
    /// Enough groups serve the stable release to carry peak demand (N_healthy).
    /// False with a reason naming the failed check (e.g. `CapacityBoundsInverted`,
    /// `EngineArgsRejected`; the README lists them) when the spec cannot be planned.
    pub const READY: &str = "Ready";
    /// A rollout or a scale change is in progress.
    pub const PROGRESSING: &str = "Progressing";
    /// Fewer groups serve than needed, or a group is held after repeated failures.
    pub const DEGRADED: &str = "Degraded";
    /// Losing the worst fault domain would still leave N_healthy groups; the message
    /// names the worst domain.
    pub const FAULT_TOLERANT: &str = "FaultTolerant";
    /// The last rollout was rolled back; see `status.lastRollback`.
    pub const ROLLED_BACK: &str = "RolledBack";
    /// The demand the group count is sized for is known: static, or measured from
    /// fresh data. False while measured demand cannot be read; the last decision holds.
    pub const DEMAND_KNOWN: &str = "DemandKnown";
    /// Another autoscaler (a HorizontalPodAutoscaler or a KEDA ScaledObject) targets
    /// this InferenceService. The operator alone sets group counts and ignores it.
    pub const SCALER_CONFLICT: &str = "ScalerConflict";
    /// `spec.router.httpRoute`: whether the HTTPRoute to the router Service is applied
    /// (False with reason `GatewayAPIMissing` when the cluster has no HTTPRoute CRD).
    pub const HTTP_ROUTE_READY: &str = "HTTPRouteReady";
}

/// What the operator observed and decided.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct InferenceServiceStatus {
    /// The `metadata.generation` this status was computed from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// Standard conditions: Ready, Progressing, Degraded, FaultTolerant, RolledBack,
    /// DemandKnown, ScalerConflict.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub conditions: Vec<Condition>,

    /// Group counts.
    #[serde(default)]
    pub replicas: ReplicaCounts,

    /// Hash (short form) of the release bundle serving most traffic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stable_release: Option<String>,

    /// The release being rolled out, if a rollout is in progress.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub canary_release: Option<CanaryStatus>,

    /// Why the rollout is waiting, whenever it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout_hold: Option<RolloutHold>,

    /// What the group count was sized from: the measured demand, the groups' cold
    /// start, and a pending scale-down.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<CapacityStatus>,

    /// The most recent automatic rollback.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_rollback: Option<RollbackRecord>,

    /// Hashes of release bundles that were rolled back. They are not retried until the
    /// spec names a different bundle, so a GitOps tool re-applying the same spec does not
    /// loop.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub failed_releases: Vec<String>,
}

/// Group counts. A group is one replica: `tensor × pipeline` GPUs in one or more pods.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaCounts {
    /// Groups the operator wants running (N_provisioned, plus surge during a rollout).
    #[serde(default)]
    pub desired: i32,
    /// Groups needed to carry peak demand (N_healthy).
    #[serde(default)]
    pub healthy_needed: i32,
    /// Groups whose every pod is Ready.
    #[serde(default)]
    pub ready: i32,
    /// Ready groups that are also in the client Service's endpoints (receiving traffic).
    #[serde(default)]
    pub serving: i32,
    /// Groups running the release in the spec.
    #[serde(default)]
    pub updated: i32,
}

/// What the group count was sized from.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct CapacityStatus {
    /// The last reading of measured demand (`spec.capacity.demand.measured` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub demand: Option<DemandStatus>,

    /// Seconds from creating the most recently started group to all its pods being
    /// ready: how far ahead a scale-up must be asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cold_start_seconds: Option<i64>,

    /// Since when the demand has needed fewer groups than run. A group is removed once
    /// this is `scaleDownStabilization` old.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_down_pending_since: Option<Time>,
}

/// One reading of measured demand, in the spec's `demandUnit`.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DemandStatus {
    /// The arrival rate over `rateWindow`.
    pub current: f64,
    /// The highest current rate over `peakWindow` (`D_peak` before headroom).
    pub peak: f64,
    /// Where it was read: the engines' scrape or Prometheus.
    pub source: String,
    /// When it was read.
    pub measured_at: Time,
}

/// The release being rolled out.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct CanaryStatus {
    /// Short hash of the canary release bundle.
    pub hash: String,
    /// Index of the current step in `spec.rollout.steps`.
    pub step: i32,
    /// Percent of requests the router sends to the canary now: the step's weight once
    /// the canary groups sized for it are ready, less while fewer are (never more than
    /// the ready canary groups' share of all groups), 0 until one is ready.
    pub weight: i32,
    /// When the current step's canary groups were all ready (its pause and analysis
    /// count from here). Kept in status so an operator restart resumes the step
    /// instead of starting it again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_started_at: Option<Time>,
}

/// What a rollout is waiting on.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum HoldGate {
    /// A step's pause has not elapsed.
    Pause,
    /// Analysis windows hold fewer requests than `minRequests`.
    Inconclusive,
    /// The metrics window is not yet full (e.g. after an operator restart).
    MetricsWarmup,
    /// Canary groups are not ready yet.
    CanaryNotReady,
    /// The surge budget or cluster capacity leaves no room for another canary group.
    Capacity,
}

/// Why a rollout is waiting, and since when.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RolloutHold {
    /// The gate that holds the rollout.
    pub gate: HoldGate,
    /// A sentence for people.
    pub reason: String,
    /// When the hold began.
    pub since: Time,
}

/// An automatic rollback.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RollbackRecord {
    /// Short hash of the release that was rolled back.
    pub release: String,
    /// Why, in a sentence.
    pub reason: String,
    /// Error-budget burn rate over the short window when it was rolled back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub short_burn_rate: Option<f64>,
    /// Error-budget burn rate over the long window when it was rolled back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub long_burn_rate: Option<f64>,
    /// When it was rolled back.
    pub time: Time,
}
