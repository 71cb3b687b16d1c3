//! The transport a group's ranks talk through: point-to-point frames (the leader's
//! step description, hidden states between stages, logits to the leader) and the
//! all-reduce of tensor parallelism. [`super::tcp::TcpTransport`] implements it over
//! TCP for the CPU backend; NCCL can implement it for CUDA, its tensors being device
//! buffers ([`Transport::Tensor`], [`Transport::SumTensor`]) and its byte frames
//! going over the same TCP links it needs anyway to exchange its unique id at
//! rendezvous.
//!
//! The all-reduce sums 64-bit integers: the exact fixed-point partial sums of the
//! row-parallel products ([`crate::kernels::exact`]). Integer sums do not depend on
//! their order, so every rank, and the single process, ends with the same bits
//! whatever order the transport adds in (NCCL's ring included: `ncclInt64`,
//! `ncclSum`).
//!
//! Every call names the step it belongs to, and every receive names the step and kind
//! it expects: a frame of another step or kind is a protocol error naming the sender,
//! never silently consumed. A failed call fails the transport for good (every later
//! call returns the same error) and tells the other ranks, because a group is one
//! failure unit: there is no recovering a step some ranks finished and others did not.

use std::fmt;
use std::time::Duration;

/// What a frame carries, for the receiver to check against what it expects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameKind {
    /// The leader's description of a step (chunks, positions, block tables).
    Batch,
    /// Hidden states from one pipeline stage to the next.
    Hidden,
    /// The output head's logits, from the head's rank to the leader.
    Logits,
    /// The tokens the last stage sampled, to the leader.
    Sampled,
}

impl fmt::Display for FrameKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Batch => "batch",
            Self::Hidden => "hidden states",
            Self::Logits => "logits",
            Self::Sampled => "sampled tokens",
        })
    }
}

/// When a failure happened: while the group was forming, or in a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Rendezvous,
    Step(u64),
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Rendezvous => f.write_str("rendezvous"),
            Self::Step(step) => write!(f, "step {step}"),
        }
    }
}

/// Ranks as a person reads them: `2` or `2, 5`.
fn list(ranks: &[usize]) -> String {
    ranks
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Why a transport call failed. Every variant that involves a peer names it; see
/// [`TransportError::blamed`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    #[error("rendezvous at {leader}: rank(s) {} did not join within {timeout:?}", list(.missing))]
    RanksMissing {
        leader: String,
        missing: Vec<usize>,
        timeout: Duration,
    },
    #[error(
        "rendezvous: the leader (rank 0) at {leader} could not be reached within {timeout:?}: {reason}"
    )]
    LeaderUnreachable {
        leader: String,
        timeout: Duration,
        reason: String,
    },
    #[error("rank {rank} sent nothing for {timeout:?} during {phase} (dead or stuck)")]
    PeerSilent {
        rank: usize,
        phase: Phase,
        timeout: Duration,
    },
    #[error("rank {rank} closed its connection during {phase} (it exited or crashed)")]
    PeerClosed { rank: usize, phase: Phase },
    #[error("the connection to rank {rank} failed during {phase}: {reason}")]
    PeerIo {
        rank: usize,
        phase: Phase,
        reason: String,
    },
    #[error("rank {rank} aborted the group: {reason}")]
    PeerAborted {
        rank: usize,
        /// The rank the aborting rank blamed, when it blamed one.
        culprit: Option<usize>,
        reason: String,
    },
    #[error("rank {rank} broke the protocol during {phase}: {detail}")]
    Protocol {
        rank: usize,
        phase: Phase,
        detail: String,
    },
    #[error("this rank's own setup failed: {0}")]
    Local(String),
    #[error("invalid transport call: {0}")]
    Usage(String),
}

impl TransportError {
    /// The ranks this error blames (the missing, dead, silent or misbehaving peers,
    /// or the one an aborting peer blamed), for logs and for the tests.
    #[must_use]
    pub fn blamed(&self) -> Vec<usize> {
        match self {
            Self::RanksMissing { missing, .. } => missing.clone(),
            Self::LeaderUnreachable { .. } => vec![0],
            Self::PeerSilent { rank, .. }
            | Self::PeerClosed { rank, .. }
            | Self::PeerIo { rank, .. }
            | Self::Protocol { rank, .. } => vec![*rank],
            Self::PeerAborted { rank, culprit, .. } => vec![culprit.unwrap_or(*rank)],
            Self::Local(_) | Self::Usage(_) => Vec::new(),
        }
    }
}

/// Point-to-point frames and an all-reduce between the ranks of one group.
///
/// Calls block until done, a peer fails, or the step timeout passes; none waits
/// forever. After any error the transport is failed: every later call returns that
/// error again.
pub trait Transport {
    /// What the collectives move: `[f32]` in host memory for TCP, a device buffer
    /// for NCCL.
    type Tensor: ?Sized;

    /// What the all-reduce sums: fixed-point `[i64]` in host memory for TCP, an
    /// int64 device buffer for NCCL.
    type SumTensor: ?Sized;

    /// This rank.
    fn rank(&self) -> usize;

    /// Ranks in the group.
    fn world_size(&self) -> usize;

    /// Sends `payload` to rank `to` as one frame of `kind` in `step`.
    ///
    /// # Errors
    /// [`TransportError`] naming `to` when it is gone or stops reading.
    fn send_bytes(
        &mut self,
        to: usize,
        step: u64,
        kind: FrameKind,
        payload: &[u8],
    ) -> Result<(), TransportError>;

    /// The next frame from rank `from`, which must be of `kind` in `step`; its
    /// payload stays valid until the next call.
    ///
    /// # Errors
    /// [`TransportError`] naming `from` when it is gone, silent for the step timeout,
    /// or sent another frame than expected.
    fn recv_bytes(
        &mut self,
        from: usize,
        step: u64,
        kind: FrameKind,
    ) -> Result<&[u8], TransportError>;

    /// Sends `tensor` to rank `to` as one frame of `kind` in `step`.
    ///
    /// # Errors
    /// As [`Transport::send_bytes`].
    fn send_tensor(
        &mut self,
        to: usize,
        step: u64,
        kind: FrameKind,
        tensor: &Self::Tensor,
    ) -> Result<(), TransportError>;

    /// Receives the next frame from rank `from` into `out`, whose size must be the
    /// frame's.
    ///
    /// # Errors
    /// As [`Transport::recv_bytes`], and a size that differs from `out`'s.
    fn recv_tensor(
        &mut self,
        from: usize,
        step: u64,
        kind: FrameKind,
        out: &mut Self::Tensor,
    ) -> Result<(), TransportError>;

    /// Replaces `buf` on every rank of `ranks` (ascending, this rank included) with
    /// the element-wise sum of their `buf`s, wrapping on overflow (the exact sums
    /// never reach it). Integer sums are exact, so every rank of the set ends with
    /// the same bits in any order of addition.
    ///
    /// # Errors
    /// [`TransportError`] naming a rank of the set that is gone, silent or sent a
    /// buffer of another size; [`TransportError::Usage`] for a set that is not
    /// ascending or lacks this rank.
    fn all_reduce_sum(
        &mut self,
        ranks: &[usize],
        step: u64,
        buf: &mut Self::SumTensor,
    ) -> Result<(), TransportError>;
}
