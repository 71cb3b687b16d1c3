//! Model files and architectures: the GGUF reader ([`gguf`]) and the networks
//! built from its tensors.
//!
//! Invariant: nothing here downloads; models are loaded from a local path.

pub mod gguf;
pub mod llama;
