//! [`SpecError`]: why an InferenceService's spec cannot be planned. Its
//! [`SpecError::reason`] is both the `Ready=False` condition's reason and the Warning
//! event's reason, so a person (or an alert) can tell the cases apart without parsing
//! the message; the message names the field and the value.
//!
//! Most of these the CRD's schema already rejects; the operator still refuses them
//! rather than guess. A leaf: it knows the checks' error types, not the checks.

use slipway_api::capacity::CapacityError;
use slipway_api::duration::DurationError;
use slipway_contract::InvalidSha256;

use crate::groups::ShapeError;

/// Why a spec cannot be planned. See the module documentation.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SpecError {
    /// The object lacks a name, namespace or uid (the API server never sends such).
    #[error("the object has no name, namespace or uid")]
    MissingIdentity,
    /// The name leaves no room for its children's names.
    #[error(
        "metadata.name {name:?} has {} characters; at most {max} leave room for the names of its pods and Services",
        name.len()
    )]
    NameTooLong {
        /// `metadata.name`.
        name: String,
        /// The longest name that does.
        max: usize,
    },
    /// The parallelism cannot be split into pods.
    #[error("parallelism: {0}")]
    Parallelism(#[from] ShapeError),
    /// The capacity numbers cannot be planned.
    #[error("capacity: {0}")]
    Capacity(#[from] CapacityError),
    /// An SLO threshold is not a duration.
    #[error("{field}: {error}")]
    SloThreshold {
        /// `slo`, `slo.ttft` or `slo.tpot`.
        field: &'static str,
        /// Why it does not parse.
        error: DurationError,
    },
    /// An artifact's URI has no form the operator can stage.
    #[error("{field}.uri {uri:?}: expected {expected}")]
    ArtifactUri {
        /// The artifact's field, e.g. `release.adapters[1]`.
        field: String,
        /// The URI as written.
        uri: String,
        /// The forms that would do.
        expected: &'static str,
    },
    /// An artifact fetched over the network has no sha256 to verify it with.
    #[error(
        "{field}.uri {uri:?} is fetched over the network, so {field}.sha256 is required to verify it"
    )]
    ArtifactSha256Missing {
        /// The artifact's field.
        field: String,
        /// The URI as written.
        uri: String,
    },
    /// An artifact's sha256 is not 64 hex digits.
    #[error("{field}.sha256: {error}")]
    ArtifactSha256Invalid {
        /// The artifact's field.
        field: String,
        /// The value.
        error: InvalidSha256,
    },
    /// The engine's parser refuses the model's path (its first line of error).
    #[error("release.model.uri: {0}")]
    ModelPathRejected(String),
    /// `release.engine.maxOutputTokens` is negative.
    #[error("release.engine.maxOutputTokens must be positive")]
    MaxOutputTokensNotPositive,
    /// The engine's parser refuses `release.engine.args` (its first line of error).
    #[error("release.engine.args: {0}")]
    EngineArgsRejected(String),
    /// `release.engine.args` sets flags the operator derives from the spec.
    #[error(
        "release.engine.args must not set {}: the operator sets them from the InferenceService ({})",
        .flags.iter().map(|(flag, _)| *flag).collect::<Vec<_>>().join(", "),
        .flags.iter().map(|(flag, from)| format!("{flag} from {from}")).collect::<Vec<_>>().join("; ")
    )]
    EngineArgsOverrideOperator {
        /// Each flag with the field a user changes instead.
        flags: Vec<(&'static str, &'static str)>,
    },
    /// The router's parser refuses its arguments (no Kubernetes name is refused).
    #[error("router arguments: {0}")]
    RouterArgsRejected(String),
}

impl SpecError {
    /// The CamelCase reason of the `Ready=False` condition and the Warning event.
    #[must_use]
    pub fn reason(&self) -> &'static str {
        match self {
            Self::MissingIdentity => "MissingIdentity",
            Self::NameTooLong { .. } => "NameTooLong",
            Self::Parallelism(ShapeError::NotPositive { .. }) => "ParallelismNotPositive",
            Self::Parallelism(ShapeError::PartialNode { .. }) => "ParallelismDoesNotFitNode",
            Self::Capacity(CapacityError::GoodputNotPositive(_)) => "GoodputNotPositive",
            Self::Capacity(CapacityError::DemandInvalid(_)) => "DemandInvalid",
            Self::Capacity(CapacityError::FLossOutOfRange(_)) => "FLossOutOfRange",
            Self::Capacity(CapacityError::MinAboveMax { .. }) => "CapacityBoundsInverted",
            Self::Capacity(CapacityError::Overflow(_)) => "CapacityOverflow",
            Self::SloThreshold { .. } => "SloThresholdInvalid",
            Self::ArtifactUri { .. } | Self::ModelPathRejected(_) => "ArtifactUriInvalid",
            Self::ArtifactSha256Missing { .. } => "ArtifactSha256Missing",
            Self::ArtifactSha256Invalid { .. } => "ArtifactSha256Invalid",
            Self::MaxOutputTokensNotPositive => "MaxOutputTokensNotPositive",
            Self::EngineArgsRejected(_) => "EngineArgsRejected",
            Self::EngineArgsOverrideOperator { .. } => "EngineArgsOverrideOperator",
            Self::RouterArgsRejected(_) => "RouterArgsRejected",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_are_camel_case_words_and_messages_name_the_value() {
        let cases = [
            (
                SpecError::NameTooLong {
                    name: "x".repeat(53),
                    max: 52,
                },
                "NameTooLong",
                "has 53 characters; at most 52",
            ),
            (
                SpecError::Capacity(CapacityError::MinAboveMax { min: 5, max: 2 }),
                "CapacityBoundsInverted",
                "capacity: minReplicas 5 exceeds maxReplicas 2",
            ),
            (
                SpecError::Parallelism(ShapeError::PartialNode {
                    tensor: 4,
                    pipeline: 5,
                    gpus_per_node: 8,
                }),
                "ParallelismDoesNotFitNode",
                "parallelism: a CUDA group of tensor 4 × pipeline 5 = 20 GPUs spans nodes of 8 GPUs without filling them",
            ),
            (
                SpecError::EngineArgsOverrideOperator {
                    flags: vec![
                        ("--port", "the pod's port"),
                        ("--device", "release.engine.device"),
                    ],
                },
                "EngineArgsOverrideOperator",
                "must not set --port, --device: the operator sets them from the InferenceService (--port from the pod's port; --device from release.engine.device)",
            ),
        ];
        for (error, reason, message) in cases {
            assert_eq!(error.reason(), reason);
            assert!(error.to_string().contains(message), "{error}");
            assert!(
                reason.starts_with(|c: char| c.is_ascii_uppercase())
                    && reason.chars().all(|c| c.is_ascii_alphanumeric()),
                "{reason}"
            );
        }
    }
}
