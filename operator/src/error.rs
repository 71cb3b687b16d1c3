//! The operator's one error type. Each variant is a stage of a reconcile; its
//! [`Error::category`] is the `category` label of the error metric and the reason of
//! the warning event, so it must stay a short, stable, low-cardinality word.

/// What went wrong while reconciling.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Listing children, nodes or endpoints failed.
    #[error("observing {what}: {source}")]
    Observe {
        what: &'static str,
        #[source]
        source: kube::Error,
    },
    /// A cache (reflector store) lost its watch before its first list.
    #[error("the {0} cache is gone: its watch stopped")]
    Cache(&'static str),
    /// Server-side apply of a child failed.
    #[error("applying {kind} {name}: {source}")]
    Apply {
        kind: &'static str,
        name: String,
        #[source]
        source: kube::Error,
    },
    /// Deleting a child failed.
    #[error("deleting {kind} {name}: {source}")]
    Delete {
        kind: &'static str,
        name: String,
        #[source]
        source: kube::Error,
    },
    /// Writing the status subresource failed.
    #[error("writing status: {0}")]
    Status(#[source] kube::Error),
    /// A child could not be serialized for apply (a bug in the plan).
    #[error("serializing {kind}: {source}")]
    Serialize {
        kind: &'static str,
        #[source]
        source: serde_json::Error,
    },
    /// The object lacks a namespace or name (the API server never sends such).
    #[error("the InferenceService has no {0}")]
    MissingMetadata(&'static str),
    /// The leader-election Lease could not be read or written.
    #[error("leader election: {0}")]
    Lease(#[source] kube::Error),
}

impl Error {
    /// A stable one-word category for metrics and event reasons.
    pub fn category(&self) -> &'static str {
        match self {
            Self::Observe { .. } => "Observe",
            Self::Cache(_) => "Cache",
            Self::Apply { .. } => "Apply",
            Self::Delete { .. } => "Delete",
            Self::Status(_) => "Status",
            Self::Serialize { .. } => "Serialize",
            Self::MissingMetadata(_) => "MissingMetadata",
            Self::Lease(_) => "Lease",
        }
    }
}
