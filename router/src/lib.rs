//! `slipway-router`: the traffic layer between clients and the engines of one
//! InferenceService.
//!
//! A request goes through three decisions, each a plain function over plain data:
//! 1. [`split`]: stable or canary, by the canary's request weight (1 % steps), sticky by
//!    a session header when the client sends one.
//! 2. [`choose`]: within that release, hard filters (model served, ready, not
//!    terminating, not backing off, not saturated), then the lowest
//!    `prefill_load_scale × uncached prompt blocks + decode blocks in use`, with the
//!    uncached blocks from the router's own [`prefix`] index.
//! 3. [`retry`]: what to do after an attempt failed, never once a byte has reached the
//!    client.
//!
//! The rest is I/O in thin layers: [`endpoints`] (the live view: Kubernetes or the
//! command line, load reports, in-flight counts), [`proxy`] (forwarding and streaming),
//! [`metrics`] (measured at the gateway) and [`server`] (routes, readiness, drain).

pub mod choose;
pub mod discovery;
pub mod endpoints;
pub mod load;
pub mod metrics;
pub mod prefix;
pub mod proxy;
pub mod retry;
pub mod server;
pub mod split;
