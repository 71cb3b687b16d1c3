//! Helpers shared by the parallel-group tests on the real SmolLM2-135M-Instruct Q4_1
//! (`pipeline_parallel`, `tensor_parallel`): the single process, loopback groups of
//! ranks as threads, teacher-forced and batched runs, and transports that count or
//! break. Each test crate uses a subset.

use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use slipway_engine::backend::cpu::{CpuBackend, CpuConfig};
use slipway_engine::backend::{Batch, Logits, LogitsWanted, ModelRunner, SeqChunk};
use slipway_engine::kv::BlockAllocator;
use slipway_engine::model::gguf::GgufFile;
use slipway_engine::model::llama::{LlamaConfig, LlamaWeights};
use slipway_engine::parallel::loopback::{self, LoopbackConfig};
pub use slipway_engine::parallel::loopback::{Counting, Worker};
use slipway_engine::parallel::transport::FrameKind;
use slipway_engine::parallel::{
    ModelShape, ParallelLayout, PipelineRunner, TcpConfig, TcpTransport, Transport, TransportError,
};
use slipway_engine::sampling::{SamplingParams, SeqSampling, argmax};
use slipway_engine::testing::{model_path, oracle};

pub const BLOCKS: usize = 512;
/// Generous: only a hang would reach it.
pub const LONG: Duration = Duration::from_secs(120);

pub fn file() -> &'static GgufFile {
    static F: OnceLock<GgufFile> = OnceLock::new();
    F.get_or_init(|| {
        let path = model_path();
        GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    })
}

pub fn cpu_config() -> CpuConfig {
    CpuConfig {
        num_blocks: BLOCKS,
        ..CpuConfig::default()
    }
}

/// The single process, shared by the tests (one at a time).
pub fn single() -> MutexGuard<'static, CpuBackend> {
    static S: OnceLock<Mutex<CpuBackend>> = OnceLock::new();
    S.get_or_init(|| {
        let weights = LlamaWeights::from_gguf(file()).expect("weights");
        Mutex::new(CpuBackend::new(Arc::new(weights), &cpu_config()).expect("backend"))
    })
    .lock()
    .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The single process with exact sums ([`CpuBackend::set_exact_sums`]), as every
/// tensor group computes; shared by the tests (one at a time).
pub fn single_exact() -> MutexGuard<'static, CpuBackend> {
    static S: OnceLock<Mutex<CpuBackend>> = OnceLock::new();
    S.get_or_init(|| {
        let weights = LlamaWeights::from_gguf(file()).expect("weights");
        let mut backend = CpuBackend::new(Arc::new(weights), &cpu_config()).expect("backend");
        backend.set_exact_sums(true);
        Mutex::new(backend)
    })
    .lock()
    .unwrap_or_else(std::sync::PoisonError::into_inner)
}

pub fn layout(tensor: usize, pipeline: usize) -> ParallelLayout {
    layout_of(file(), tensor, pipeline)
}

/// `model` split over `tensor × pipeline` ranks.
pub fn layout_of(model: &GgufFile, tensor: usize, pipeline: usize) -> ParallelLayout {
    let config = LlamaConfig::from_gguf(model).expect("config");
    let shape = ModelShape::from_tensors(&config, model.tensors());
    ParallelLayout::new(&shape, tensor, pipeline).expect("layout")
}

pub fn tcp_config(rank: usize, world: usize, leader: &str, step_timeout: Duration) -> TcpConfig {
    TcpConfig {
        rank,
        world,
        leader: leader.parse().expect("leader address"),
        rendezvous_timeout: LONG,
        step_timeout,
    }
}

/// A `tensor × pipeline` group on loopback: the leader's runner and the workers'
/// threads, the leader's transport passed through `lead` and each worker's through
/// `wrap` (tests count or break them there).
pub fn group_with<L, W>(
    (tensor, pipeline): (usize, usize),
    step_timeout: Duration,
    lead: impl FnOnce(TcpTransport) -> L,
    wrap: impl Fn(TcpTransport) -> W + Send + Clone + 'static,
) -> (PipelineRunner<L>, Vec<Worker>)
where
    L: Transport<Tensor = [f32], SumTensor = [i64]> + Send,
    W: Transport<Tensor = [f32], SumTensor = [i64]> + Send,
{
    group_of(file(), (tensor, pipeline), step_timeout, lead, wrap)
}

/// [`group_with`] over `model`.
pub fn group_of<L, W>(
    model: &'static GgufFile,
    (tensor, pipeline): (usize, usize),
    step_timeout: Duration,
    lead: impl FnOnce(TcpTransport) -> L,
    wrap: impl Fn(TcpTransport) -> W + Send + Clone + 'static,
) -> (PipelineRunner<L>, Vec<Worker>)
where
    L: Transport<Tensor = [f32], SumTensor = [i64]> + Send,
    W: Transport<Tensor = [f32], SumTensor = [i64]> + Send,
{
    let config = LoopbackConfig {
        cpu: cpu_config(),
        rendezvous_timeout: LONG,
        step_timeout,
    };
    loopback::start(
        model,
        &layout_of(model, tensor, pipeline),
        &config,
        lead,
        wrap,
    )
    .expect("a loopback group")
}

pub fn group(tensor: usize, pipeline: usize) -> (PipelineRunner<TcpTransport>, Vec<Worker>) {
    group_with((tensor, pipeline), LONG, |t| t, |t| t)
}

/// Stops the group and checks every worker exited cleanly.
pub fn finish<T: Transport<Tensor = [f32], SumTensor = [i64]> + Send>(
    runner: PipelineRunner<T>,
    workers: Vec<Worker>,
) {
    if let Err(e) = loopback::finish(runner, workers) {
        panic!("{e}");
    }
}

pub fn chunk(tokens: &[u32], start_pos: usize, table: &[u32], logits: LogitsWanted) -> SeqChunk {
    SeqChunk {
        tokens: tokens.to_vec(),
        start_pos,
        block_table: table.to_vec(),
        logits,
        adapter: None,
    }
}

/// Largest |a − b| over two logits of the same layout.
pub fn max_delta(a: &Logits, b: &Logits) -> f32 {
    assert_eq!(a.spans, b.spans, "logits spans differ");
    assert_eq!(a.data.len(), b.data.len(), "logits sizes differ");
    a.data
        .iter()
        .zip(&b.data)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// Every oracle conversation (prompt and recorded continuation), teacher-forced in
/// one chunk with logits for every position.
pub fn teacher_forced_logits(
    runner: &mut dyn ModelRunner,
    alloc: &mut BlockAllocator,
) -> Vec<Logits> {
    let bs = runner.kv_geometry().block_size;
    oracle()
        .prompts
        .iter()
        .map(|p| {
            let mut tokens = p.prompt_tokens.clone();
            tokens.extend(&p.continuation);
            let mut table = Vec::new();
            alloc.ensure(&mut table, tokens.len(), bs).expect("blocks");
            let batch = Batch {
                seqs: vec![chunk(&tokens, 0, &table, LogitsWanted::All)],
            };
            let logits = runner.forward(&batch).expect("forward");
            alloc.release(&table).expect("release");
            logits
        })
        .collect()
}

/// Each of `prompts`, prefilled in chunks of up to 40 tokens then `steps` greedy
/// decode steps, all in shared batches: the first half starts at step 0, the second
/// half one step later, so steps mix prefill chunks with other sequences' decodes.
/// Returns every sequence's logits rows and greedy tokens.
pub fn batched(
    runner: &mut dyn ModelRunner,
    prompts: &[Vec<u32>],
    steps: usize,
) -> Vec<(Vec<Vec<f32>>, Vec<u32>)> {
    struct St {
        table: Vec<u32>,
        fed: usize,
        rows: Vec<Vec<f32>>,
        toks: Vec<u32>,
    }
    let bs = runner.kv_geometry().block_size;
    let mut alloc = BlockAllocator::new(BLOCKS);
    let mut st: Vec<St> = prompts
        .iter()
        .map(|p| {
            let mut table = Vec::new();
            alloc
                .ensure(&mut table, p.len() + steps, bs)
                .expect("blocks");
            St {
                table,
                fed: 0,
                rows: Vec::new(),
                toks: Vec::new(),
            }
        })
        .collect();
    let half = prompts.len().div_ceil(2);
    for step in 0.. {
        let mut batch = Batch::default();
        let mut members = Vec::new();
        for (i, (p, s)) in prompts.iter().zip(&st).enumerate() {
            if step == 0 && i >= half || s.toks.len() == steps {
                continue;
            }
            let tokens = if s.fed < p.len() {
                p[s.fed..p.len().min(s.fed + 40)].to_vec()
            } else {
                vec![*s.toks.last().expect("a sampled token")]
            };
            batch
                .seqs
                .push(chunk(&tokens, s.fed, &s.table, LogitsWanted::All));
            members.push(i);
        }
        if members.is_empty() {
            break;
        }
        let out = runner.forward(&batch).expect("batched forward");
        for (k, &i) in members.iter().enumerate() {
            let s = &mut st[i];
            s.fed += batch.seqs[k].tokens.len();
            s.rows.extend(out.rows_of(k).map(<[f32]>::to_vec));
            if s.fed >= prompts[i].len() {
                s.toks.push(argmax(s.rows.last().expect("a row")) as u32);
            }
        }
    }
    st.into_iter().map(|s| (s.rows, s.toks)).collect()
}

/// A worker transport that, once `batches` step frames have arrived, drops its
/// connections at the next call: the worker dies mid-step, after the step's
/// description and before the hidden states (or its first all-reduce).
pub struct DiesMidStep {
    pub inner: Option<TcpTransport>,
    pub batches: usize,
}

impl DiesMidStep {
    fn live(&mut self) -> Result<&mut TcpTransport, TransportError> {
        if self.batches == 0 {
            self.inner = None;
        }
        self.inner
            .as_mut()
            .ok_or_else(|| TransportError::Local("the test dropped this rank's links".into()))
    }
}

impl Transport for DiesMidStep {
    type Tensor = [f32];
    type SumTensor = [i64];

    fn rank(&self) -> usize {
        self.inner.as_ref().map_or(1, Transport::rank)
    }

    fn world_size(&self) -> usize {
        self.inner.as_ref().map_or(2, Transport::world_size)
    }

    fn send_bytes(
        &mut self,
        to: usize,
        step: u64,
        kind: FrameKind,
        payload: &[u8],
    ) -> Result<(), TransportError> {
        self.live()?.send_bytes(to, step, kind, payload)
    }

    fn recv_bytes(
        &mut self,
        from: usize,
        step: u64,
        kind: FrameKind,
    ) -> Result<&[u8], TransportError> {
        self.live()?;
        if kind == FrameKind::Batch {
            self.batches -= 1;
        }
        self.inner
            .as_mut()
            .ok_or_else(|| TransportError::Local("no links".into()))?
            .recv_bytes(from, step, kind)
    }

    fn send_tensor(
        &mut self,
        to: usize,
        step: u64,
        kind: FrameKind,
        tensor: &[f32],
    ) -> Result<(), TransportError> {
        self.live()?.send_tensor(to, step, kind, tensor)
    }

    fn recv_tensor(
        &mut self,
        from: usize,
        step: u64,
        kind: FrameKind,
        out: &mut [f32],
    ) -> Result<(), TransportError> {
        self.live()?.recv_tensor(from, step, kind, out)
    }

    fn all_reduce_sum(
        &mut self,
        ranks: &[usize],
        step: u64,
        buf: &mut [i64],
    ) -> Result<(), TransportError> {
        self.live()?.all_reduce_sum(ranks, step, buf)
    }
}

/// Sixteen prompts of mixed lengths: the oracle prompts and cuts of them.
pub fn sixteen_prompts() -> Vec<Vec<u32>> {
    let oracle = oracle();
    let mut prompts: Vec<Vec<u32>> = oracle
        .prompts
        .iter()
        .map(|p| p.prompt_tokens.clone())
        .collect();
    let mut cut = 0;
    while prompts.len() < 16 {
        let p = &oracle.prompts[cut % oracle.prompts.len()].prompt_tokens;
        prompts.push(p[..(2 + 7 * cut).min(p.len())].to_vec());
        cut += 1;
    }
    prompts.truncate(16);
    prompts
}

/// Prefills 16 greedy streams (oracle prompts, repeated) through `runner` and returns
/// the next step: one decode token per stream, with its sampling.
pub fn sixteen_streams_prefilled(
    runner: &mut impl ModelRunner,
) -> (Batch, Vec<Option<SeqSampling>>) {
    let oracle = oracle();
    let streams = 16;
    let mut alloc = BlockAllocator::new(BLOCKS);
    let prompts: Vec<&[u32]> = (0..streams)
        .map(|i| {
            oracle.prompts[i % oracle.prompts.len()]
                .prompt_tokens
                .as_slice()
        })
        .collect();
    let tables: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            let mut t = Vec::new();
            alloc.ensure(&mut t, p.len() + 1, 16).expect("blocks");
            t
        })
        .collect();
    let greedy = || SeqSampling {
        params: SamplingParams::default(),
        uniform: None,
        history: Vec::new(),
        stop_tokens: vec![2],
        logprob: false,
    };
    let sampling: Vec<_> = (0..streams).map(|_| Some(greedy())).collect();
    let prefill = Batch {
        seqs: (0..streams)
            .map(|i| chunk(prompts[i], 0, &tables[i], LogitsWanted::Last))
            .collect(),
    };
    let first = runner.execute(&prefill, &sampling).expect("prefill");
    let decode = Batch {
        seqs: (0..streams)
            .map(|i| {
                let token = first.sampled[i].expect("sampled").token;
                chunk(&[token], prompts[i].len(), &tables[i], LogitsWanted::Last)
            })
            .collect(),
    };
    (decode, sampling)
}
