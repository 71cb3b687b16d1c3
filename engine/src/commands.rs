//! The compute subcommands of `slipway-engine`: `generate`, `score`, `bench` and
//! `ceilings`.
//! Each loads the model onto the CPU backend and prints its result on stdout.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use slipway_engine::backend::ModelRunner as _;
use slipway_engine::backend::cpu::{CpuBackend, CpuConfig};
use slipway_engine::generate::{generate, perplexity, score};
use slipway_engine::kernels::Isa;
use slipway_engine::kernels::peak::{self, MacInstruction};
use slipway_engine::kv::BlockAllocator;
use slipway_engine::model::gguf::GgufFile;
use slipway_engine::model::llama::{LlamaConfig, LlamaWeights};
use slipway_engine::model_bench::{self, BenchConfig, TokenMacs};
use slipway_engine::parallel::loopback::{self, Counting, LoopbackConfig};
use slipway_engine::parallel::{ModelShape, ParallelLayout, Transport as _};
use slipway_engine::sampling::{Sampler, SamplingParams};
use slipway_engine::template::{ChatMessage, ChatTemplate, RenderOptions};
use slipway_engine::tokenizer::{EncodeOptions, Tokenizer};

/// Model and backend options shared by the compute subcommands.
#[derive(Debug, Args)]
pub struct RunnerArgs {
    /// Path of a GGUF model file (`make model` fetches the test model).
    #[arg(long, env = "SLIPWAY_MODEL", value_name = "PATH")]
    pub model: PathBuf,
    /// Worker threads (0: one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
}

struct Loaded {
    file: GgufFile,
    tokenizer: Tokenizer,
    weights: Arc<LlamaWeights>,
}

fn load(args: &RunnerArgs) -> anyhow::Result<Loaded> {
    let file = GgufFile::open(&args.model)?;
    let tokenizer = Tokenizer::from_metadata(file.metadata())
        .with_context(|| format!("loading the tokenizer of {}", args.model.display()))?;
    let weights = Arc::new(
        LlamaWeights::from_gguf(&file)
            .with_context(|| format!("loading {}", args.model.display()))?,
    );
    Ok(Loaded {
        file,
        tokenizer,
        weights,
    })
}

fn backend(
    weights: &Arc<LlamaWeights>,
    threads: usize,
    positions: usize,
    sequences: usize,
) -> anyhow::Result<CpuBackend> {
    let block_size = CpuConfig::default().block_size;
    let num_blocks = sequences * positions.div_ceil(block_size).max(1);
    let config = CpuConfig {
        threads,
        block_size,
        num_blocks,
    };
    CpuBackend::new(Arc::clone(weights), &config).map_err(|e| anyhow::anyhow!(e))
}

/// `generate` options.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    runner: RunnerArgs,
    /// The prompt text (special tokens such as <|im_start|> are recognised).
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt as one user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Most tokens to generate (stops earlier at an end-of-generation token).
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Keep only the k most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Nucleus sampling threshold.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// RNG seed (same seed, same output).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print `{"prompt_tokens":[…],"tokens":[…],"text":"…"}`.
    #[arg(long)]
    json: bool,
}

/// Runs `generate`.
///
/// # Errors
/// Loading, template, sampling-parameter or forward errors.
pub fn run_generate(args: &GenerateArgs) -> anyhow::Result<()> {
    let m = load(&args.runner)?;
    let prompt = if args.chat {
        let template = ChatTemplate::from_metadata(m.file.metadata(), &m.tokenizer)?;
        template.render(
            &[ChatMessage::new("user", args.prompt.clone())],
            RenderOptions::default(),
        )?
    } else {
        args.prompt.clone()
    };
    let prompt_tokens = m.tokenizer.encode_with(&prompt, EncodeOptions::default());
    let params = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
        ..SamplingParams::default()
    };
    params.validate()?;
    let mut runner = backend(
        &m.weights,
        args.runner.threads,
        prompt_tokens.len() + args.max_tokens,
        1,
    )?;
    let mut alloc = BlockAllocator::new(runner.kv_geometry().num_blocks);
    let mut sampler = Sampler::new(params);
    let tokens = generate(
        &mut runner,
        &mut alloc,
        &prompt_tokens,
        args.max_tokens,
        &mut sampler,
        m.tokenizer.eog_tokens(),
    )?;
    // The end-of-generation token ends the text; it is not part of it.
    let shown = tokens
        .iter()
        .copied()
        .filter(|t| !m.tokenizer.is_eog(*t))
        .collect::<Vec<_>>();
    let text = m.tokenizer.decode(&shown)?;
    if args.json {
        println!(
            "{}",
            serde_json::json!({ "prompt_tokens": prompt_tokens, "tokens": tokens, "text": text })
        );
    } else {
        println!("{text}");
    }
    Ok(())
}

/// `score` options.
#[derive(Debug, Args)]
pub struct ScoreArgs {
    #[command(flatten)]
    runner: RunnerArgs,
    /// Text to score (tokenized like a prompt).
    #[arg(long, conflicts_with = "tokens", required_unless_present = "tokens")]
    text: Option<String>,
    /// Token ids to score, comma-separated.
    #[arg(long, value_delimiter = ',')]
    tokens: Option<Vec<u32>>,
    /// Alternatives to list per position.
    #[arg(long, default_value_t = 5)]
    top_k: usize,
    /// Print JSON (one object with `positions` and `perplexity`).
    #[arg(long)]
    json: bool,
}

/// Runs `score`.
///
/// # Errors
/// Loading or forward errors, or fewer than two tokens.
pub fn run_score(args: &ScoreArgs) -> anyhow::Result<()> {
    let m = load(&args.runner)?;
    let tokens = match (&args.tokens, &args.text) {
        (Some(t), _) => t.clone(),
        (None, Some(text)) => m.tokenizer.encode_with(text, EncodeOptions::default()),
        (None, None) => anyhow::bail!("give --text or --tokens"),
    };
    let mut runner = backend(&m.weights, args.runner.threads, tokens.len(), 1)?;
    let mut alloc = BlockAllocator::new(runner.kv_geometry().num_blocks);
    let scores = score(&mut runner, &mut alloc, &tokens, args.top_k)
        .context("scoring needs at least two tokens")?;
    let ppl = perplexity(&scores);
    if args.json {
        let positions: Vec<_> = scores
            .iter()
            .enumerate()
            .map(|(i, s)| {
                serde_json::json!({
                    "position": i + 1,
                    "token": s.token,
                    "logprob": s.logprob,
                    "argmax": s.argmax,
                    "top": s.top.iter().map(|&(t, lp)| serde_json::json!({"token": t, "logprob": lp})).collect::<Vec<_>>(),
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::json!({ "tokens": tokens, "positions": positions, "perplexity": ppl })
        );
    } else {
        for (i, s) in scores.iter().enumerate() {
            println!(
                "{}\t{}\t{:.4}\targmax {}",
                i + 1,
                s.token,
                s.logprob,
                s.argmax
            );
        }
        println!("perplexity {ppl:.4}");
    }
    Ok(())
}

/// `bench` options.
#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(flatten)]
    runner: RunnerArgs,
    /// Prompt-processing prompt length.
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    /// Decode steps per measurement.
    #[arg(long, default_value_t = 128)]
    gen_tokens: usize,
    /// Prompt per sequence before aggregate decode.
    #[arg(long, default_value_t = 128)]
    batch_prompt: usize,
    /// Concurrent sequences for aggregate decode.
    #[arg(long, value_delimiter = ',', default_value = "16,64")]
    parallel: Vec<usize>,
    /// Repetitions of each test (prompt, single-stream, and each aggregate decode with
    /// its prefill); each rate is the tokens of all repetitions over their total time.
    #[arg(long, default_value_t = 3)]
    repetitions: usize,
    /// Split every layer over this many tensor ranks (as `serve --tensor-parallel`).
    /// The ranks of a group run as threads of this process, joined over loopback TCP
    /// as separate processes join, so the split's cost per step is measured against
    /// the single process on the same machine. `--threads` is shared among a stage's
    /// tensor ranks (at least one each), which compute at the same time; pipeline
    /// stages take turns, so each gets all of them.
    #[arg(long, value_name = "N", default_value_t = 1)]
    tensor_parallel: usize,
    /// Split the layers into this many pipeline stages (as `serve
    /// --pipeline-parallel`), run as `--tensor-parallel` says.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pipeline_parallel: usize,
    /// Sum the attention output and MLP down products of a single process exactly,
    /// as a tensor group always does (`CpuBackend::set_exact_sums`), to measure what
    /// that costs. Refused with a group.
    #[arg(long)]
    exact_sums: bool,
    /// Run every decode step whole, its products split between the threads, instead
    /// of splitting a step's sequences between them (`CpuBackend::set_split_decode`),
    /// to measure what the split gives. Single process only.
    #[arg(long)]
    no_split_decode: bool,
}

/// Runs `bench`, printing one JSON object with the kernels' instruction set (as the
/// backend chose it: [`Isa::detect`]), tokens/s and the work per token
/// (multiply-adds per prompt and per decoded token, bytes of weights per decoded
/// token) that turns them into fractions of `ceilings`; for a parallel group also
/// the payload bytes each rank sends per aggregate decode step.
///
/// # Errors
/// Loading, group or forward errors.
pub fn run_bench(args: &BenchArgs) -> anyhow::Result<()> {
    let config = BenchConfig {
        prompt_tokens: args.prompt_tokens,
        gen_tokens: args.gen_tokens,
        batch_prompt: args.batch_prompt,
        parallel: args.parallel.clone(),
        repetitions: args.repetitions,
    };
    config.validate()?;
    let block_size = CpuConfig::default().block_size;
    let blocks = config.blocks_needed(block_size);
    let (report, (macs, weight_bytes)) = if args.tensor_parallel * args.pipeline_parallel == 1 {
        let m = load(&args.runner)?;
        let mut runner = backend(&m.weights, args.runner.threads, blocks * block_size, 1)?;
        runner.set_exact_sums(args.exact_sums);
        runner.set_split_decode(!args.no_split_decode);
        let report = model_bench::run(&mut runner, &config, &[])?;
        (report, work_per_token(&m.file)?)
    } else {
        let (report, file) = bench_group(args, &config, blocks)?;
        (report, work_per_token(file)?)
    };
    let agg: serde_json::Map<String, serde_json::Value> = report
        .aggregate_tps
        .iter()
        .map(|(n, t)| (n.to_string(), serde_json::json!(t)))
        .collect();
    let bytes: serde_json::Map<String, serde_json::Value> = report
        .bytes_per_decode_step
        .iter()
        .map(|(n, b)| (n.to_string(), serde_json::json!(b)))
        .collect();
    println!(
        "{}",
        serde_json::json!({
            "isa": Isa::detect().name(),
            "tensor_parallel": args.tensor_parallel,
            "pipeline_parallel": args.pipeline_parallel,
            "pp_tps": report.prompt_tps,
            "tg_tps": report.decode_tps,
            "aggregate_tps": agg,
            "bytes_per_decode_step_per_rank": bytes,
            "macs_per_token": {
                "prefill": macs.prefill_per_token(config.prompt_tokens),
                "decode": macs.decode_per_token(),
            },
            "weight_bytes_per_token": weight_bytes,
        })
    );
    Ok(())
}

/// Multiply-adds and bytes of weights one token costs (see [`model_bench`]).
fn work_per_token(file: &GgufFile) -> anyhow::Result<(TokenMacs, u64)> {
    let model = LlamaConfig::from_gguf(file)?;
    let tensors: Vec<(&str, u64)> = file.tensors().map(|t| (t.name.as_str(), t.size)).collect();
    Ok((
        TokenMacs::of(&model),
        model_bench::weight_bytes_per_token(&tensors, model.vocab),
    ))
}

/// The measurements on a `--tensor-parallel × --pipeline-parallel` group of threads
/// on loopback, each rank's sent bytes counted.
fn bench_group(
    args: &BenchArgs,
    config: &BenchConfig,
    blocks: usize,
) -> anyhow::Result<(model_bench::BenchReport, &'static GgufFile)> {
    // A tensor rank always sums exactly and a pipeline stage as the single process
    // does by default; the switch is for the single process only.
    anyhow::ensure!(
        !args.no_split_decode,
        "--no-split-decode measures the single process; a group runs its steps whole"
    );
    anyhow::ensure!(
        !args.exact_sums,
        "--exact-sums measures the single process; a group decides its sums itself \
(tensor ranks always sum exactly), so drop it or --tensor-parallel/--pipeline-parallel"
    );
    // The ranks' threads borrow the file for as long as they run; this command ends
    // with them, so the mapping is simply kept until the process exits.
    let file: &'static GgufFile = Box::leak(Box::new(GgufFile::open(&args.runner.model)?));
    let model = LlamaConfig::from_gguf(file)?;
    let layout = ParallelLayout::new(
        &ModelShape::from_tensors(&model, file.tensors()),
        args.tensor_parallel,
        args.pipeline_parallel,
    )
    .with_context(|| format!("splitting {} over the group", args.runner.model.display()))?;
    let threads = match args.runner.threads {
        0 => std::thread::available_parallelism().map_or(1, usize::from),
        n => n,
    };
    let loopback = LoopbackConfig {
        cpu: CpuConfig {
            threads: (threads / args.tensor_parallel).max(1),
            num_blocks: blocks,
            ..CpuConfig::default()
        },
        rendezvous_timeout: Duration::from_secs(300),
        step_timeout: Duration::from_secs(60),
    };
    let sent: Vec<Arc<AtomicU64>> = (0..layout.world_size())
        .map(|_| Arc::new(AtomicU64::new(0)))
        .collect();
    let (lead, workers_sent) = (Arc::clone(&sent[0]), sent.clone());
    let (mut runner, workers) = loopback::start(
        file,
        &layout,
        &loopback,
        |inner| Counting { inner, sent: lead },
        move |inner| {
            let sent = Arc::clone(&workers_sent[inner.rank()]);
            Counting { inner, sent }
        },
    )?;
    let report = model_bench::run(&mut runner, config, &sent)?;
    loopback::finish(runner, workers)?;
    Ok((report, file))
}

/// `ceilings` options.
#[derive(Debug, Args)]
pub struct CeilingsArgs {
    /// Thread counts to measure at (each a separate run, threads started together).
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    threads: Vec<usize>,
    /// Timed runs per measurement (the best is reported).
    #[arg(long, default_value_t = 3)]
    repetitions: usize,
    /// Seconds of multiply-adds per thread per timed run.
    #[arg(long, default_value_t = 0.5)]
    mac_seconds: f64,
}

/// Runs `ceilings`, printing one JSON object: the multiply-add instruction and the
/// loads used, and per thread count the int8 multiply-adds/s and read bytes/s.
///
/// # Errors
/// A non-positive or non-finite `--mac-seconds`.
pub fn run_ceilings(args: &CeilingsArgs) -> anyhow::Result<()> {
    let per_run = std::time::Duration::try_from_secs_f64(args.mac_seconds)
        .ok()
        .filter(|d| !d.is_zero())
        .context("--mac-seconds must be a positive number of seconds")?;
    let instruction = MacInstruction::detect();
    let mut macs = serde_json::Map::new();
    for &t in &args.threads {
        let rate = peak::mac_rate(instruction, t, per_run, args.repetitions)
            .context("the detected multiply-add instruction does not run")?;
        tracing::info!(
            threads = t,
            macs_per_s = rate.per_second,
            checksum = rate.checksum,
            "int8 multiply-adds"
        );
        macs.insert(t.to_string(), serde_json::json!(rate.per_second));
    }
    let buffer = peak::read_buffer(peak::read_buffer_words());
    let mut reads = serde_json::Map::new();
    for &t in &args.threads {
        let rate = peak::read_rate(&buffer, t, args.repetitions);
        tracing::info!(
            threads = t,
            bytes_per_s = rate.per_second,
            checksum = rate.checksum,
            "streaming read"
        );
        reads.insert(t.to_string(), serde_json::json!(rate.per_second));
    }
    println!(
        "{}",
        serde_json::json!({
            "mac_instruction": instruction.name(),
            "macs_per_s": macs,
            "read_loads": peak::read_loads(),
            "read_buffer_bytes": std::mem::size_of_val(buffer.as_slice()),
            "read_bytes_per_s": reads,
        })
    );
    Ok(())
}
