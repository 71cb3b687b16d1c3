//! The Slipway inference engine: GGUF model, tokenizer, scheduler, paged KV cache,
//! CPU and CUDA backends, and the OpenAI-compatible HTTP server.
//!
//! - [`model`]: the GGUF reader and the forward pass; [`backend`] and [`kernels`]: CPU
//!   and CUDA compute; [`tokenizer`], [`template`] and [`sampling`]: text in and out.
//! - [`kv`]: paged key/value storage; [`serving`]: the engine actor (scheduler, block
//!   manager, prefix cache, admission) and its HTTP API.
//! - [`generate`]: single-sequence generation and scoring (CLI, oracle tests);
//!   [`model_bench`]: `make bench-model`'s throughput shapes, beside llama.cpp's (the
//!   load generator is the separate `slipway-bench` crate).
//! - [`parallel`]: tensor × pipeline groups: the layout of a model over ranks and the
//!   transport between them.
//! - [`fetch`]: staging a model file (the pod's init container); `testing` (feature
//!   `testing`, test builds only): helpers the tests of this and other crates share.

pub mod backend;
pub mod fetch;
pub mod generate;
pub mod kernels;
pub mod kv;
pub mod model;
pub mod model_bench;
pub mod parallel;
pub mod sampling;
pub mod serving;
pub mod template;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod tokenizer;
