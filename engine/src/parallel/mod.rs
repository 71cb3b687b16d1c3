//! Parallel groups: one model served by `tensor × pipeline` ranks (processes, on one
//! host or several pods) as one engine (issue #15).
//!
//! - [`layout`]: which layers, heads, MLP columns and vocab rows each rank holds,
//!   computed from the model's shape alone. A `tensor` that does not divide the
//!   model's heads is refused naming both numbers (SmolLM2-135M: 9 query and 3 KV
//!   heads, so `tensor: 3` works and `tensor: 2` fails).
//!
//! Rank numbering, shared with the contract's `--rank`: `rank = stage × tensor +
//! tensor_rank`. Rank 0 is the leader: it serves HTTP, admits requests and runs the
//! scheduler; every other rank computes only.

pub mod layout;

pub use layout::{LayoutError, ModelShape, ParallelLayout, RankLayout};
