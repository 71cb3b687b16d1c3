//! The Slipway operator: reconciles `InferenceService` objects into fault-tolerant
//! groups of engine pods.
//!
//! Shape (STYLE.md, "Operator"): [`reconcile`] observes the children and nodes,
//! [`plan()`] decides everything as a pure function of that and the time, and
//! `reconcile` server-side-applies the result with one field manager, deletes what the
//! plan drops, writes status through the status subresource only and records the
//! plan's events. [`leader`] makes sure only one replica does this at a time.
//!
//! - [`groups`]: how one replica (`tensor × pipeline` GPUs) is split into pods.
//! - [`pod`]: the engine pod of one rank (why pods, not StatefulSets, is there).
//! - [`router`]: the router in front of the engines (Deployment, its read-only RBAC,
//!   PDB, the client Service, an optional Gateway API HTTPRoute).
//! - [`plan`](mod@plan): objects, scale-in, group restarts, status and events.
//! - [`types`]: the plain types `plan` and the renderers share (a leaf).
//! - [`model`]: where the engine finds the model, and what stages it there.
//! - [`conditions`]: condition merging and transition detection.
//! - [`observed`]: the plain-data view of the cluster `plan` reads.
//! - [`nodes`]: node changes (readiness, labels, taints, deletion) that reconcile everything.
//! - [`placement`]: which domains the pods can run in, and which group to move back.
//! - [`rollout`]: canary rollouts (pure state machine, burn-rate analysis, metrics sources).
//! - [`demand`]: measured demand (arrival rate and its peak) from the engines' counters.
//! - [`scaling`]: how many healthy groups the demand needs, with hysteresis (pure).
//! - [`spec_error`]: why a spec cannot be planned, with the condition reason of each case.

pub mod conditions;
pub mod demand;
pub mod error;
pub mod groups;
pub mod labels;
pub mod leader;
pub mod metrics;
pub mod model;
pub mod nodes;
pub mod observed;
pub mod placement;
pub mod plan;
pub mod pod;
pub mod reconcile;
pub mod rollout;
pub mod router;
pub mod scaling;
pub mod spec_error;
pub mod types;

pub use error::Error;
pub use observed::Observed;
pub use plan::{Plan, plan};
