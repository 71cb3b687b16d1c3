//! A whole group in one process: every rank a thread with its own stage and thread
//! pool, the ranks joined over loopback TCP exactly as separate processes join. It
//! exists to measure a split against the single process on one machine
//! (`slipway-engine bench --tensor-parallel T --pipeline-parallel P`) and to test
//! their equivalence; serving runs one rank per process (`serve`), one pod each.
//!
//! [`Counting`] wraps a rank's [`TcpTransport`] to count the payload bytes the rank
//! sends, which is how the benchmark and the tests measure a step's traffic.

use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use slipway_contract::HostPort;

use super::layout::ParallelLayout;
use super::pipeline::{PipelineError, PipelineRunner, StageRunner, run_worker};
use super::tcp::{TcpConfig, TcpTransport};
use super::transport::{FrameKind, Transport, TransportError};
use crate::backend::BackendError;
use crate::backend::cpu::CpuConfig;
use crate::model::gguf::GgufFile;

/// A worker rank's thread: it loads its stage, joins, and computes the leader's steps
/// until the leader stops the group ([`finish`]) or the group fails.
pub type Worker = JoinHandle<Result<(), PipelineError>>;

/// How the ranks of a loopback group run.
#[derive(Debug, Clone)]
pub struct LoopbackConfig {
    /// Every rank's CPU backend: threads of its own pool and KV blocks (every rank
    /// needs the same number; block ids are the leader's).
    pub cpu: CpuConfig,
    /// How long the leader waits for every rank to load and join.
    pub rendezvous_timeout: Duration,
    /// How long any rank waits on a peer within a step.
    pub step_timeout: Duration,
}

/// Starts `layout`'s group on loopback: the workers (ranks 1..) on threads of their
/// own, and the leader (rank 0) on the calling thread, returned as the
/// [`PipelineRunner`] that drives the steps. The leader's transport is passed through
/// `lead` and each worker's through `wrap`, where callers count it ([`Counting`]) or,
/// in tests, break it.
///
/// # Errors
/// [`PipelineError`] when no loopback port can be bound, the leader's stage does not
/// load, or the group does not form (naming the ranks that did not join).
pub fn start<L, W>(
    model: &'static GgufFile,
    layout: &ParallelLayout,
    config: &LoopbackConfig,
    lead: impl FnOnce(TcpTransport) -> L,
    wrap: impl Fn(TcpTransport) -> W + Send + Clone + 'static,
) -> Result<(PipelineRunner<L>, Vec<Worker>), PipelineError>
where
    L: Transport<Tensor = [f32], SumTensor = [i64]> + Send,
    W: Transport<Tensor = [f32], SumTensor = [i64]> + Send,
{
    let world = layout.world_size();
    let listener = TcpListener::bind("127.0.0.1:0")
        .map_err(|e| TransportError::Local(format!("binding a loopback port: {e}")))?;
    let port = listener
        .local_addr()
        .map_err(|e| TransportError::Local(format!("the loopback listener's address: {e}")))?
        .port();
    let leader = HostPort::new("127.0.0.1", port).map_err(TransportError::Local)?;
    let tcp = |rank| TcpConfig {
        rank,
        world,
        leader: leader.clone(),
        rendezvous_timeout: config.rendezvous_timeout,
        step_timeout: config.step_timeout,
    };
    let workers = (1..world)
        .map(|rank| {
            let (layout, cpu, wrap, tcp) =
                (layout.clone(), config.cpu.clone(), wrap.clone(), tcp(rank));
            thread::Builder::new()
                .name(format!("rank-{rank}"))
                .spawn(move || {
                    let mut stage = StageRunner::load(model, &layout, rank, &cpu)?;
                    let transport = TcpTransport::join(&tcp)?;
                    run_worker(wrap(transport), &mut stage)
                })
                .map_err(|e| TransportError::Local(format!("starting rank {rank}'s thread: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let stage = StageRunner::load(model, layout, 0, &config.cpu)?;
    let transport = TcpTransport::lead(&listener, &tcp(0))?;
    let runner = PipelineRunner::new(stage, lead(transport))?;
    Ok((runner, workers))
}

/// Why a loopback group did not end cleanly ([`finish`]).
#[derive(Debug, thiserror::Error)]
pub enum FinishError {
    /// The leader could not tell the workers to stop.
    #[error("stopping the group: {0}")]
    Stop(#[source] BackendError),
    /// A worker rank returned an error.
    #[error("rank {rank} failed: {source}")]
    Worker {
        rank: usize,
        #[source]
        source: PipelineError,
    },
    /// A worker rank's thread panicked.
    #[error("rank {0}'s thread panicked")]
    Panicked(usize),
}

/// Stops the group and waits for every worker, returning the first worker's error.
///
/// # Errors
/// The leader's stop, or the first worker that failed or panicked (by rank).
pub fn finish<T: Transport<Tensor = [f32], SumTensor = [i64]> + Send>(
    mut runner: PipelineRunner<T>,
    workers: Vec<Worker>,
) -> Result<(), FinishError> {
    runner.stop().map_err(FinishError::Stop)?;
    for (i, w) in workers.into_iter().enumerate() {
        let rank = i + 1;
        match w.join() {
            Ok(Ok(())) => {}
            Ok(Err(source)) => return Err(FinishError::Worker { rank, source }),
            Err(_) => return Err(FinishError::Panicked(rank)),
        }
    }
    Ok(())
}

/// A TCP transport that counts the payload bytes its rank sends (frame headers not
/// included), for a step's traffic per rank.
#[derive(Debug)]
pub struct Counting {
    pub inner: TcpTransport,
    /// Payload bytes sent so far; the caller keeps a clone to read from any thread.
    pub sent: Arc<AtomicU64>,
}

impl Counting {
    fn count(&self, bytes: usize) {
        self.sent.fetch_add(bytes as u64, Ordering::Relaxed);
    }
}

impl Transport for Counting {
    type Tensor = [f32];
    type SumTensor = [i64];

    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn send_bytes(
        &mut self,
        to: usize,
        step: u64,
        kind: FrameKind,
        payload: &[u8],
    ) -> Result<(), TransportError> {
        self.count(payload.len());
        self.inner.send_bytes(to, step, kind, payload)
    }

    fn recv_bytes(
        &mut self,
        from: usize,
        step: u64,
        kind: FrameKind,
    ) -> Result<&[u8], TransportError> {
        self.inner.recv_bytes(from, step, kind)
    }

    fn send_tensor(
        &mut self,
        to: usize,
        step: u64,
        kind: FrameKind,
        tensor: &[f32],
    ) -> Result<(), TransportError> {
        self.count(size_of_val(tensor));
        self.inner.send_tensor(to, step, kind, tensor)
    }

    fn recv_tensor(
        &mut self,
        from: usize,
        step: u64,
        kind: FrameKind,
        out: &mut [f32],
    ) -> Result<(), TransportError> {
        self.inner.recv_tensor(from, step, kind, out)
    }

    fn all_reduce_sum(
        &mut self,
        ranks: &[usize],
        step: u64,
        buf: &mut [i64],
    ) -> Result<(), TransportError> {
        // The TCP all-reduce gathers on the set's first rank, which sends the sum back
        // to each of the others.
        let copies = if ranks.first() == Some(&self.inner.rank()) {
            ranks.len() - 1
        } else {
            1
        };
        self.count(copies * size_of_val(buf));
        self.inner.all_reduce_sum(ranks, step, buf)
    }
}
