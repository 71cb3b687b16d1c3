//! Serving: the KV block manager with its prefix cache, the continuous-batching
//! scheduler, and (around them) admission control, metrics, the engine actor and
//! the HTTP API.
//!
//! The block manager and the scheduler are synchronous and deterministic, free of
//! tokio and of any model: they take and return plain data, so every decision is a
//! plain test.

pub mod admission;
pub mod block_manager;
pub mod engine;
pub mod http;
pub mod metrics;
mod request_trace;
pub mod scheduler;
pub mod text;
