//! The Slipway operator: reconciles `InferenceService` objects into fault-tolerant
//! groups of engine pods.
//!
//! This crate is intentionally nearly empty: the controller (observe → pure `plan` →
//! server-side apply → status) arrives with the operator issue. The API types and
//! the capacity math it will use already live in `slipway-api`.
