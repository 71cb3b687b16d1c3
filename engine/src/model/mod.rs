//! Model files and architectures: the GGUF reader ([`gguf`]), the networks built
//! from its tensors ([`llama`]) and the LoRA adapters served next to them ([`lora`]).
//!
//! Invariant: nothing here downloads; models are loaded from a local path.

pub mod gguf;
pub mod llama;
pub mod lora;
