//! `slipway-engine`: the engine's command line.
//!
//! Subcommands are variants of [`Command`], each with its own `clap::Args` struct
//! and `run_*` function; `generate` and `score` join `tokenize` here. The two a pod
//! runs, `serve` and `fetch`, are [`slipway_contract::EngineCommand`]: the operator
//! renders pods from that same type, so the flags cannot drift apart. Serving
//! never downloads: `--model` (or `SLIPWAY_MODEL`) names a local GGUF file, which
//! `fetch` (the operator's init container) stages beforehand for network sources.
//! Results go to stdout; logs go to stderr (`RUST_LOG` filters them; `--log-format`
//! of `serve`/`fetch` picks text or JSON, JSON by default off a terminal, so
//! `kubectl logs` never sees colours). `serve --otlp-endpoint` exports request
//! traces ([`slipway_telemetry`]). A failure prints one `Error: ...` line
//! last, which the pod's termination message picks up, and exits with a code from
//! [`slipway_contract::exit`].

mod commands;
mod serve;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use slipway_contract::{EngineCommand, exit};
use slipway_engine::fetch::{FetchError, VerifyError};
use slipway_engine::model::gguf::GgufFile;
use slipway_engine::model::lora::LoraError;
use slipway_engine::tokenizer::{DecodeOptions, EncodeOptions, Tokenizer};
use slipway_telemetry::{Telemetry, TraceExport};

#[derive(Debug, Parser)]
#[command(name = "slipway-engine", version, about = "Slipway inference engine")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once per process; boxing the large variant would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// Turn text into the model's token ids (special tokens such as
    /// <|im_start|> are recognised; BOS/EOS are added as the model's metadata says).
    Tokenize(TokenizeArgs),
    /// Write the GGUF's vocabulary as an equivalent Hugging Face tokenizer.json on
    /// stdout (for `serve --tokenizer` tests; engine/scripts/make-tokenizer-json).
    #[command(hide = true)]
    TokenizerJson(ModelArgs),
    /// Generate a continuation of a prompt (greedy by default).
    Generate(commands::GenerateArgs),
    /// Teacher-forced scoring: per position the actual next token's log-probability,
    /// the argmax and the top-k, plus the perplexity.
    Score(commands::ScoreArgs),
    /// Measure prompt processing, single-stream and aggregate decode tokens/s.
    Bench(commands::BenchArgs),
    /// Measure this machine's ceilings: int8 multiply-adds/s and streaming read
    /// bandwidth, per thread count (the denominators of `make bench-model`'s fractions).
    Ceilings(commands::CeilingsArgs),
    /// `serve` and `fetch`: what the operator's pods run.
    #[command(flatten)]
    Pod(EngineCommand),
}

/// Where the model file is.
#[derive(Debug, Args)]
struct ModelArgs {
    /// Path of a GGUF model file (`make model` fetches the test model).
    #[arg(long, env = "SLIPWAY_MODEL", value_name = "PATH")]
    model: PathBuf,
}

#[derive(Debug, Args)]
struct TokenizeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The text to tokenize (may start with '-').
    #[arg(long, allow_hyphen_values = true)]
    text: String,
    /// Print `{"tokens":[...]}` instead of one `id<TAB>piece` line per token.
    #[arg(long)]
    json: bool,
}

/// Log lines shown when `RUST_LOG` is unset: warnings, and `fetch`'s progress lines
/// (they are its log).
const DEFAULT_LOG_FILTER: &str = "warn,slipway_engine::fetch=info";

fn main() -> ExitCode {
    let cli = Cli::parse();
    let (log_format, traces) = match &cli.command {
        Command::Pod(EngineCommand::Serve(args)) => (
            args.telemetry.logs.log_format,
            TraceExport::from_args(&args.telemetry)
                .map(|t| t.with_attribute("slipway.release", args.release.clone())),
        ),
        Command::Pod(EngineCommand::Fetch(args)) => (args.logs.log_format, None),
        _ => (None, None),
    };
    let telemetry = match Telemetry::init(
        "slipway-engine",
        log_format,
        DEFAULT_LOG_FILTER,
        traces.as_ref(),
    ) {
        Ok(t) => t,
        Err(error) => {
            eprintln!("Error: {error}");
            return ExitCode::from(u8::try_from(exit::FAILURE).unwrap_or(1));
        }
    };
    let result = match cli.command {
        Command::Tokenize(args) => run_tokenize(&args),
        Command::TokenizerJson(args) => run_tokenizer_json(&args),
        Command::Generate(args) => commands::run_generate(&args),
        Command::Score(args) => commands::run_score(&args),
        Command::Bench(args) => commands::run_bench(&args),
        Command::Ceilings(args) => commands::run_ceilings(&args),
        Command::Pod(EngineCommand::Serve(args)) => serve::run_serve(&args),
        Command::Pod(EngineCommand::Fetch(args)) => slipway_engine::fetch::run(&args)
            .map(drop)
            .map_err(Into::into),
    };
    // The last spans leave before the exit line.
    telemetry.shutdown();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // One line, last: the pod's termination message (FallbackToLogsOnError).
            eprintln!("Error: {error:#}");
            ExitCode::from(exit_code(&error))
        }
    }
}

/// [`exit::MODEL_REJECTED`] when the model or a LoRA adapter is not the release's,
/// else [`exit::FAILURE`].
fn exit_code(error: &anyhow::Error) -> u8 {
    let rejected = error.chain().any(|cause| {
        matches!(
            cause.downcast_ref::<VerifyError>(),
            Some(VerifyError::Mismatch { .. })
        ) || matches!(
            cause.downcast_ref::<FetchError>(),
            Some(FetchError::ChecksumMismatch { .. })
        ) || cause
            .downcast_ref::<LoraError>()
            .is_some_and(LoraError::is_rejection)
    });
    let code = if rejected {
        exit::MODEL_REJECTED
    } else {
        exit::FAILURE
    };
    u8::try_from(code).unwrap_or(1)
}

fn open_tokenizer(model: &ModelArgs) -> anyhow::Result<(GgufFile, Tokenizer)> {
    let file = GgufFile::open(&model.model)?;
    let tokenizer = Tokenizer::from_metadata(file.metadata())
        .with_context(|| format!("loading the tokenizer of {}", model.model.display()))?;
    Ok((file, tokenizer))
}

fn run_tokenize(args: &TokenizeArgs) -> anyhow::Result<()> {
    let (_file, tokenizer) = open_tokenizer(&args.model)?;
    let tokens = tokenizer.encode_with(&args.text, EncodeOptions::default());
    if args.json {
        println!("{}", serde_json::json!({ "tokens": tokens }));
    } else {
        for &id in &tokens {
            // A token may hold part of a multi-byte character: show such pieces
            // as escaped bytes rather than as replacement characters.
            let bytes = tokenizer.decode_bytes(&[id], DecodeOptions::default())?;
            match std::str::from_utf8(&bytes) {
                Ok(piece) => println!("{id}\t{piece:?}"),
                Err(_) => println!("{id}\tb\"{}\"", bytes.escape_ascii()),
            }
        }
    }
    Ok(())
}

fn run_tokenizer_json(args: &ModelArgs) -> anyhow::Result<()> {
    let file = GgufFile::open(&args.model)?;
    let json = slipway_engine::tokenizer::tokenizer_json::from_metadata(file.metadata())
        .with_context(|| format!("writing the vocabulary of {}", args.model.display()))?;
    println!("{json}");
    Ok(())
}
