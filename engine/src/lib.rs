//! The Slipway inference engine: GGUF model, tokenizer, scheduler, paged KV cache,
//! CPU and CUDA backends, and the OpenAI-compatible HTTP server.
//!
//! This crate is intentionally nearly empty: the model core arrives with the engine
//! core issue, serving with the serving issue.

pub mod backend;
pub mod bench;
pub mod fetch;
pub mod generate;
pub mod kernels;
pub mod kv;
pub mod model;
pub mod sampling;
pub mod serving;
pub mod template;
pub mod testing;
pub mod tokenizer;
