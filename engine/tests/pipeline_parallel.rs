//! Pipeline parallelism on the real SmolLM2-135M-Instruct Q4_1 (issue #15): stages
//! chained in one process, and `pipeline: 2` groups of two ranks (threads) over
//! loopback TCP, against the single process. Each stage runs the single process's
//! arithmetic for its layers and hidden states travel as exact f32 bits, so the
//! logits must be bit-identical, not merely close. Failures are asserted by whom they
//! blame; timeouts only bound a broken build.

use std::net::TcpListener;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use slipway_engine::backend::cpu::{CpuBackend, CpuConfig, StageInput, StageOutput};
use slipway_engine::backend::{BackendError, Batch, Logits, LogitsWanted, ModelRunner, SeqChunk};
use slipway_engine::generate::score;
use slipway_engine::kv::BlockAllocator;
use slipway_engine::model::gguf::GgufFile;
use slipway_engine::model::llama::{LlamaConfig, LlamaWeights, ModelPart};
use slipway_engine::parallel::step::StepFrame;
use slipway_engine::parallel::transport::FrameKind;
use slipway_engine::parallel::{
    ModelShape, ParallelLayout, PipelineError, PipelineRunner, StageRunner, TcpConfig,
    TcpTransport, Transport, TransportError, run_worker,
};
use slipway_engine::sampling::{SamplingParams, SeqSampling, argmax};
use slipway_engine::testing::{model_path, oracle};
use slipway_engine::tokenizer::Tokenizer;

#[path = "support/agreement.rs"]
mod agreement;

const BLOCKS: usize = 512;
/// Generous: only a hang would reach it.
const LONG: Duration = Duration::from_secs(120);

fn file() -> &'static GgufFile {
    static F: OnceLock<GgufFile> = OnceLock::new();
    F.get_or_init(|| {
        let path = model_path();
        GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    })
}

fn cpu_config() -> CpuConfig {
    CpuConfig {
        num_blocks: BLOCKS,
        ..CpuConfig::default()
    }
}

/// The single process, shared by the tests (one at a time).
fn single() -> MutexGuard<'static, CpuBackend> {
    static S: OnceLock<Mutex<CpuBackend>> = OnceLock::new();
    S.get_or_init(|| {
        let weights = LlamaWeights::from_gguf(file()).expect("weights");
        Mutex::new(CpuBackend::new(Arc::new(weights), &cpu_config()).expect("backend"))
    })
    .lock()
    .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn layout(pipeline: usize) -> ParallelLayout {
    let config = LlamaConfig::from_gguf(file()).expect("config");
    let shape = ModelShape::from_tensors(&config, file().tensors());
    ParallelLayout::new(&shape, 1, pipeline).expect("layout")
}

fn tcp_config(rank: usize, world: usize, leader: &str, step_timeout: Duration) -> TcpConfig {
    TcpConfig {
        rank,
        world,
        leader: leader.parse().expect("leader address"),
        rendezvous_timeout: LONG,
        step_timeout,
    }
}

/// A worker rank's thread: loads its stage, joins, serves steps.
type Worker = JoinHandle<Result<(), PipelineError>>;

/// A `pipeline`-stage group on loopback: the leader's runner and the workers'
/// threads, the leader's transport passed through `lead` and each worker's through
/// `wrap` (tests count or break them there).
fn group_with<L, W>(
    pipeline: usize,
    step_timeout: Duration,
    lead: impl FnOnce(TcpTransport) -> L,
    wrap: impl Fn(TcpTransport) -> W + Send + Clone + 'static,
) -> (PipelineRunner<L>, Vec<Worker>)
where
    L: Transport<Tensor = [f32]>,
    W: Transport<Tensor = [f32]>,
{
    let group = layout(pipeline);
    let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port");
    let leader = listener.local_addr().expect("its address").to_string();
    let mut workers = Vec::new();
    for rank in 1..pipeline {
        let config = tcp_config(rank, pipeline, &leader, step_timeout);
        let (group, wrap) = (group.clone(), wrap.clone());
        workers.push(thread::spawn(move || {
            let mut stage = StageRunner::load(file(), &group, rank, &cpu_config())?;
            let transport = TcpTransport::join(&config)?;
            run_worker(wrap(transport), &mut stage)
        }));
    }
    let stage = StageRunner::load(file(), &group, 0, &cpu_config()).expect("stage 0");
    let config = tcp_config(0, pipeline, &leader, step_timeout);
    let transport = TcpTransport::lead(&listener, &config).expect("rendezvous");
    let runner = PipelineRunner::new(stage, lead(transport)).expect("leader");
    (runner, workers)
}

fn group(pipeline: usize) -> (PipelineRunner<TcpTransport>, Vec<Worker>) {
    group_with(pipeline, LONG, |t| t, |t| t)
}

/// Stops the group and checks every worker exited cleanly.
fn finish<T: Transport<Tensor = [f32]>>(mut runner: PipelineRunner<T>, workers: Vec<Worker>) {
    runner.stop().expect("stop");
    for (i, w) in workers.into_iter().enumerate() {
        let rank = i + 1;
        match w.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("rank {rank} failed: {e}"),
            Err(_) => panic!("rank {rank}'s thread panicked"),
        }
    }
}

fn chunk(tokens: &[u32], start_pos: usize, table: &[u32], logits: LogitsWanted) -> SeqChunk {
    SeqChunk {
        tokens: tokens.to_vec(),
        start_pos,
        block_table: table.to_vec(),
        logits,
        adapter: None,
    }
}

/// Largest |a − b| over two logits of the same layout.
fn max_delta(a: &Logits, b: &Logits) -> f32 {
    assert_eq!(a.spans, b.spans, "logits spans differ");
    assert_eq!(a.data.len(), b.data.len(), "logits sizes differ");
    a.data
        .iter()
        .zip(&b.data)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

#[test]
fn stages_chained_in_one_process_equal_the_whole_model() {
    let parts = [0..10, 10..20, 20..30].map(|layers| ModelPart {
        embeds: layers.start == 0,
        head: layers.end == 30,
        layers,
    });
    let mut stages: Vec<CpuBackend> = parts
        .iter()
        .map(|part| {
            let weights = LlamaWeights::from_gguf_part(file(), part).expect("stage weights");
            assert_eq!(weights.layers.len(), 10);
            assert_eq!(weights.embed.is_some(), part.embeds);
            assert_eq!(weights.head.is_some(), part.head);
            CpuBackend::new(Arc::new(weights), &cpu_config()).expect("stage backend")
        })
        .collect();
    let oracle = oracle();
    let prompt = &oracle.prompts[0].prompt_tokens;
    let table: Vec<u32> = (0..(prompt.len() + 2).div_ceil(16) as u32).collect();
    // A prefill then a decode step, so the second step reads each stage's own KV.
    let steps = [
        Batch {
            seqs: vec![chunk(prompt, 0, &table, LogitsWanted::All)],
        },
        Batch {
            seqs: vec![chunk(&[1], prompt.len(), &table, LogitsWanted::Last)],
        },
    ];
    let mut whole = single();
    for batch in &steps {
        let want = whole.forward(batch).expect("whole model");
        let mut hidden = Vec::new();
        let mut got = None;
        for (i, stage) in stages.iter_mut().enumerate() {
            let input = if i == 0 {
                StageInput::Tokens
            } else {
                StageInput::Hidden(&mut hidden)
            };
            match stage.forward_stage(batch, input).expect("stage step") {
                StageOutput::Hidden(x) => hidden = x.to_vec(),
                StageOutput::Logits(l) => got = Some(l),
            }
        }
        let got = got.expect("the last stage returns logits");
        assert_eq!(max_delta(&got, &want), 0.0, "chained stages differ");
    }
    // Each stage refuses the other stages' inputs, and whole passes.
    let batch = &steps[1];
    let err = stages[1]
        .forward_stage(batch, StageInput::Tokens)
        .expect_err("tokens into a middle stage");
    assert!(matches!(err, BackendError::Stage(_)), "{err}");
    let err = stages[0]
        .forward_stage(batch, StageInput::Hidden(&mut vec![0.0; 576]))
        .expect_err("hidden states into the first stage");
    assert!(matches!(err, BackendError::Stage(_)), "{err}");
    let err = stages[2]
        .forward_stage(batch, StageInput::Hidden(&mut vec![0.0; 5]))
        .expect_err("hidden states of the wrong size");
    assert!(err.to_string().contains("5 hidden-state floats"), "{err}");
    let err = stages[2]
        .forward(batch)
        .expect_err("a whole pass on a stage");
    assert!(err.to_string().contains("layers 20..30"), "{err}");
}

/// Every oracle conversation (prompt and recorded continuation), teacher-forced in
/// one chunk with logits for every position.
fn teacher_forced_logits(runner: &mut dyn ModelRunner, alloc: &mut BlockAllocator) -> Vec<Logits> {
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

#[test]
fn pipeline_2_teacher_forced_logits_equal_the_single_process() {
    let want = {
        let mut whole = single();
        teacher_forced_logits(&mut *whole, &mut BlockAllocator::new(BLOCKS))
    };
    let (mut runner, workers) = group(2);
    let got = teacher_forced_logits(&mut runner, &mut BlockAllocator::new(BLOCKS));
    let (mut positions, mut max) = (0, 0f32);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        max = max.max(max_delta(g, w));
        for (r, (a, b)) in g.rows_of(0).zip(w.rows_of(0)).enumerate() {
            assert_eq!(argmax(a), argmax(b), "conversation {i} position {r}: top-1");
            positions += 1;
        }
    }
    println!("pipeline 2: {positions} positions, same top-1 on all, max |Δlogit| = {max}");
    assert_eq!(
        max, 0.0,
        "pipeline 2 logits differ from the single process's"
    );
    // And the oracle's own bar, through the pipeline.
    let oracle = oracle();
    let tokenizer = Tokenizer::from_metadata(file().metadata()).expect("tokenizer");
    let mut alloc = BlockAllocator::new(BLOCKS);
    agreement::assert_agrees("pipeline 2", &oracle, &tokenizer, |tokens| {
        score(&mut runner, &mut alloc, tokens, 1).expect("score")
    });
    finish(runner, workers);
}

/// Each of `prompts`, prefilled in chunks of up to 40 tokens then `steps` greedy
/// decode steps, all in shared batches: the first half starts at step 0, the second
/// half one step later, so steps mix prefill chunks with other sequences' decodes.
/// Returns every sequence's logits rows and greedy tokens.
fn batched(
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

#[test]
fn pipeline_2_serves_16_concurrent_sequences_as_the_single_process_does_alone() {
    let oracle = oracle();
    let mut prompts: Vec<Vec<u32>> = oracle
        .prompts
        .iter()
        .map(|p| p.prompt_tokens.clone())
        .collect();
    // Sixteen sequences of mixed lengths: the oracle prompts and cuts of them.
    let mut cut = 0;
    while prompts.len() < 16 {
        let p = &oracle.prompts[cut % oracle.prompts.len()].prompt_tokens;
        prompts.push(p[..(2 + 7 * cut).min(p.len())].to_vec());
        cut += 1;
    }
    prompts.truncate(16);
    let steps = 4;
    let solo: Vec<_> = {
        let mut whole = single();
        prompts
            .iter()
            .map(|p| batched(&mut *whole, std::slice::from_ref(p), steps).remove(0))
            .collect()
    };
    let (mut runner, workers) = group(2);
    let together = batched(&mut runner, &prompts, steps);
    let mut max = 0f32;
    for (i, ((rows, toks), (solo_rows, solo_toks))) in together.iter().zip(&solo).enumerate() {
        assert_eq!(toks, solo_toks, "sequence {i}: greedy tokens differ");
        assert_eq!(rows.len(), solo_rows.len(), "sequence {i}: row count");
        for (a, b) in rows.iter().zip(solo_rows) {
            max = a.iter().zip(b).fold(max, |m, (x, y)| m.max((x - y).abs()));
        }
    }
    println!("pipeline 2, 16 sequences batched vs alone: max |Δlogit| = {max}");
    assert_eq!(max, 0.0, "batched pipeline logits differ from solo runs");
    finish(runner, workers);
}

#[test]
fn pipeline_2_samples_on_its_last_stage_as_the_single_process_does() {
    let oracle = oracle();
    let prompts: Vec<&[u32]> = oracle
        .prompts
        .iter()
        .take(4)
        .map(|p| p.prompt_tokens.as_slice())
        .collect();
    // Greedy with a log-probability; seeded temperature, top-k and top-p with a
    // fresh draw each step; greedy under every penalty (reading the history); and a
    // sequence that samples nothing.
    let sampling = |step: usize, history: &[Vec<u32>]| -> Vec<Option<SeqSampling>> {
        let base = |params: SamplingParams, uniform, history: Vec<u32>, logprob| SeqSampling {
            params,
            uniform,
            history,
            stop_tokens: vec![2],
            logprob,
        };
        vec![
            Some(base(SamplingParams::default(), None, Vec::new(), true)),
            Some(base(
                SamplingParams {
                    temperature: 0.8,
                    top_k: 40,
                    top_p: 0.95,
                    seed: 7,
                    ..SamplingParams::default()
                },
                Some((0.11 + 0.37 * step as f64).fract()),
                Vec::new(),
                false,
            )),
            Some(base(
                SamplingParams {
                    repetition_penalty: 1.3,
                    frequency_penalty: 0.4,
                    presence_penalty: 0.2,
                    ..SamplingParams::default()
                },
                None,
                history[2].clone(),
                true,
            )),
            None,
        ]
    };
    let mut whole = single();
    let (mut runner, workers) = group(2);
    let mut alloc = BlockAllocator::new(BLOCKS);
    let steps = 6;
    let tables: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            let mut t = Vec::new();
            alloc.ensure(&mut t, p.len() + steps, 16).expect("blocks");
            t
        })
        .collect();
    let mut history: Vec<Vec<u32>> = prompts.iter().map(|p| p.to_vec()).collect();
    let mut sampled = 0;
    for step in 0..steps {
        let batch = Batch {
            seqs: (0..prompts.len())
                .map(|i| {
                    let (tokens, start) = if step == 0 {
                        (prompts[i].to_vec(), 0)
                    } else {
                        (
                            vec![*history[i].last().expect("a token")],
                            history[i].len() - 1,
                        )
                    };
                    chunk(&tokens, start, &tables[i], LogitsWanted::Last)
                })
                .collect(),
        };
        let sampling = sampling(step, &history);
        let want = whole.execute(&batch, &sampling).expect("single process");
        let got = runner.execute(&batch, &sampling).expect("pipeline 2");
        assert_eq!(got, want, "step {step}: sampled otherwise");
        for (i, s) in want.sampled.iter().enumerate() {
            // The sequence that samples nothing is fed a fixed token.
            history[i].push(s.map_or(1, |s| s.token));
            sampled += usize::from(s.is_some());
        }
    }
    println!("pipeline 2 sampled {sampled} tokens on its last stage, all as the single process");
    finish(runner, workers);
}

/// A transport that counts the payload bytes it sends.
struct Counting {
    inner: TcpTransport,
    sent: Arc<AtomicU64>,
}

impl Counting {
    fn count(&self, bytes: usize) {
        self.sent.fetch_add(bytes as u64, Ordering::Relaxed);
    }
}

impl Transport for Counting {
    type Tensor = [f32];

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
        buf: &mut [f32],
    ) -> Result<(), TransportError> {
        self.inner.all_reduce_sum(ranks, step, buf)
    }
}

#[test]
fn a_decode_step_of_16_streams_sends_hidden_states_down_and_only_tokens_back() {
    let (leader_sent, worker_sent) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let (l, w) = (Arc::clone(&leader_sent), Arc::clone(&worker_sent));
    let (mut runner, workers) = group_with(
        2,
        LONG,
        |inner| Counting { inner, sent: l },
        move |inner| Counting {
            inner,
            sent: Arc::clone(&w),
        },
    );
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
    let (l0, w0) = (
        leader_sent.load(Ordering::Relaxed),
        worker_sent.load(Ordering::Relaxed),
    );
    runner.execute(&decode, &sampling).expect("decode");
    let leader_bytes = leader_sent.load(Ordering::Relaxed) - l0;
    let worker_bytes = worker_sent.load(Ordering::Relaxed) - w0;
    let hidden = (streams * 576 * 4) as u64;
    println!(
        "decode step of {streams} streams, payload bytes sent: rank 0 {leader_bytes} \
({hidden} of hidden states, {} of step description), rank 1 {worker_bytes}",
        leader_bytes - hidden
    );
    // Rank 1 sends the count and 11 bytes per stream: no logits row.
    assert_eq!(worker_bytes, 4 + 11 * streams as u64);
    assert!(leader_bytes > hidden && leader_bytes < hidden + 100 * streams as u64);
    finish(runner, workers);
}

/// A worker transport that, once `batches` step frames have arrived, drops its
/// connections at the next call: the worker dies mid-step, after the step's
/// description and before the hidden states.
struct DiesMidStep {
    inner: Option<TcpTransport>,
    batches: usize,
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
        buf: &mut [f32],
    ) -> Result<(), TransportError> {
        self.live()?.all_reduce_sum(ranks, step, buf)
    }
}

#[test]
fn a_worker_dying_mid_step_fails_the_leaders_step_naming_it() {
    let (mut runner, mut workers) = group_with(
        2,
        LONG,
        |t| t,
        |t| DiesMidStep {
            inner: Some(t),
            batches: 2,
        },
    );
    let mut alloc = BlockAllocator::new(BLOCKS);
    let prompt = &oracle().prompts[0].prompt_tokens;
    let mut table = Vec::new();
    alloc
        .ensure(&mut table, prompt.len() + 1, 16)
        .expect("blocks");
    let prefill = Batch {
        seqs: vec![chunk(prompt, 0, &table, LogitsWanted::Last)],
    };
    let failures = runner.failures();
    runner.forward(&prefill).expect("step 1 runs");
    assert_eq!(*failures.borrow(), None);
    let decode = Batch {
        seqs: vec![chunk(&[1], prompt.len(), &table, LogitsWanted::Last)],
    };
    let err = runner.forward(&decode).expect_err("rank 1 died in step 2");
    let BackendError::Group(transport) = &err else {
        panic!("not a group error: {err}");
    };
    assert_eq!(transport.blamed(), [1], "{err}");
    assert!(err.to_string().contains("rank 1"), "{err}");
    println!("the leader's step 2 failed with: {err}");
    // The group is done: later steps fail at once with the same error, and whoever
    // watches the group (serving) has been told.
    let again = runner.forward(&decode).expect_err("the group failed");
    assert_eq!(again.to_string(), err.to_string());
    assert_eq!(
        failures.borrow().as_deref(),
        Some(transport.to_string().as_str())
    );
    let worker = workers.remove(0).join().expect("the worker's thread");
    let err = worker.expect_err("the worker lost its links");
    assert!(err.to_string().contains("test dropped"), "{err}");
}

#[test]
fn the_leader_dying_mid_step_ends_the_workers_loop_naming_rank_0() {
    let group = layout(2);
    let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port");
    let leader = listener.local_addr().expect("its address").to_string();
    let config = tcp_config(1, 2, &leader, LONG);
    let worker = thread::spawn(move || {
        let mut stage = StageRunner::load(file(), &group, 1, &cpu_config())?;
        run_worker(TcpTransport::join(&config)?, &mut stage)
    });
    // A bare leader: it describes step 1, then goes away before its hidden states.
    let mut transport =
        TcpTransport::lead(&listener, &tcp_config(0, 2, &leader, LONG)).expect("rendezvous");
    let batch = Batch {
        seqs: vec![chunk(&[1, 2, 3], 0, &[0], LogitsWanted::Last)],
    };
    let mut frame = Vec::new();
    StepFrame::Run(&batch).encode(&mut frame).expect("encode");
    transport
        .send_bytes(1, 1, FrameKind::Batch, &frame)
        .expect("send the step");
    drop(transport);
    let err = worker
        .join()
        .expect("the worker's thread")
        .expect_err("the leader is gone");
    assert_eq!(err.blamed(), [0], "{err}");
    assert!(
        matches!(
            err,
            PipelineError::Transport(TransportError::PeerClosed { rank: 0, .. })
        ),
        "{err}"
    );
}
