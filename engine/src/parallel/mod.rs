//! Parallel groups: one model served by `tensor × pipeline` ranks (processes, on one
//! host or several pods) as one engine (issue #15). What is not wired yet is listed at
//! the end.
//!
//! - [`layout`]: which layers, heads, MLP columns and vocab rows each rank holds,
//!   computed from the model's shape alone. A `tensor` that does not divide the
//!   model's heads is refused naming both numbers (SmolLM2-135M: 9 query and 3 KV
//!   heads, so `tensor: 3` works and `tensor: 2` fails).
//! - [`transport`]: the [`Transport`] trait (frames to and from a rank, all-reduce
//!   sum over a set of ranks, every call tagged with a step id) and its errors, each
//!   naming the rank to blame.
//! - [`tcp`]: the TCP implementation for the CPU backend (rendezvous through the
//!   leader, full mesh, gather-and-broadcast all-reduce). NCCL would implement the
//!   same trait for CUDA, with device buffers as its tensors.
//! - [`step`]: the leader's step frame (the batch: chunks, positions, block tables,
//!   logits wanted, adapters; or idle, or stop), encoded once for every rank.
//! - [`pipeline`]: tensor × pipeline groups on the CPU backend. [`StageRunner`] holds
//!   one rank's part: its stage's layers, and of each only its tensor shard (its query
//!   heads' Q rows and their KV heads' K/V rows, its MLP columns' gate/up rows, and the
//!   matching input columns of the attention output and down projections), with a KV
//!   store of its own layers and KV heads, addressed by the leader's block ids;
//!   [`PipelineRunner`] is the leader's [`crate::backend::ModelRunner`], running its
//!   part of stage 0 and driving the others, with keep-alives while idle so waiting
//!   workers can tell an idle leader from a dead one; [`run_worker`] is a worker
//!   rank's loop. Pipeline logits are bit-identical to the single process's
//!   (`tests/pipeline_parallel.rs`), and so are tensor-parallel ones: the
//!   row-parallel products sum in exact fixed point ([`crate::kernels::exact`]) and
//!   the all-reduce adds those integers, so the split changes no bit; the single
//!   process computes the same with `CpuBackend::set_exact_sums`
//!   (`tests/tensor_parallel.rs`).
//! - [`loopback`]: a whole group as threads of one process over loopback TCP, and a
//!   transport that counts the bytes a rank sends: what `slipway-engine bench
//!   --tensor-parallel/--pipeline-parallel` (`make bench-parallel`, table in
//!   `engine/BENCHMARKS.md`) and the equivalence tests run.
//!
//! Rank numbering, shared with the contract's `--rank`: `rank = stage × tensor +
//! tensor_rank`. Rank 0 is the leader: it serves HTTP, admits requests and runs the
//! scheduler; every other rank computes only.
//!
//! Frame format (see `wire`): a 24-byte header (magic `SLPW`, version 1, kind u8, two
//! zero bytes, step id u64 LE, payload length u64 LE) then the payload; tensors are
//! raw little-endian f32, the all-reduce's exact sums raw little-endian i64. One
//! reusable buffer per direction per link; `TCP_NODELAY`.
//!
//! Topology: every rank connects to the leader's address and says its rank; the
//! leader sends everyone the table of listening addresses; workers connect pairwise
//! (each to every lower-ranked worker). Rendezvous is bounded by
//! `--rendezvous-timeout-ms` and fails naming the ranks that did not join; every
//! receive afterwards by `--step-timeout-ms`, failing naming the dead or silent peer.
//! A failing rank tells its peers (an abort frame naming the rank it blames), so the
//! whole group fails within about one step timeout, never hangs.
//!
//! Left (the rest of #15):
//! - A vocab-parallel output head (the head is whole on tensor rank 0 of the last
//!   stage, see [`layout`]), and LoRA adapters on tensor shards (refused).
//! - Overlap: a tensor rank computes nothing while its all-reduce is in flight, and a
//!   step's stages run one after the other (no micro-batching, see [`pipeline`]).
//! - `serve` runs tensor × pipeline groups (see `serve.rs`; workers answer only
//!   `/health` and `/ready`, ready once the group formed); it refuses LoRA adapters
//!   and the CUDA backend in a group. NCCL behind [`Transport`] for CUDA.
//! - Operator (done for CPU, see `operator/src/groups.rs` and `pod.rs`): a CPU group
//!   is one pod per rank, each given `--tensor-parallel`, `--pipeline-parallel`,
//!   `--rank` and `--leader-address` (the rank-0 pod's DNS name under the group's
//!   headless Service, which publishes not-ready addresses). Left: a CUDA pod holding
//!   several GPUs needs one process driving several ranks (with NCCL), so it is told
//!   nothing yet. On real nodes (the e2e harness runs CoreDNS) a `pipeline: 2` group
//!   spans two nodes, serves, and is recreated whole when a rank dies
//!   (`e2e/tests/real_nodes/groups.rs`).

pub mod layout;
pub mod loopback;
pub mod pipeline;
pub mod step;
pub mod tcp;
pub mod transport;
mod wire;

#[cfg(test)]
mod tcp_tests;

pub use layout::{LayoutError, ModelShape, ParallelLayout, RankLayout};
pub use pipeline::{PipelineError, PipelineRunner, StageRunner, run_worker};
pub use tcp::{TcpConfig, TcpTransport};
pub use transport::{FrameKind, Phase, Transport, TransportError};
