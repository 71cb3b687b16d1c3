//! `slipway-engine serve`: the engine container's command line.
//!
//! The operator starts from [`ServeArgs::for_model`] (the parser's own defaults), sets
//! what it decides from the InferenceService, merges the user's
//! `release.engine.args` with [`ServeArgs::with_extra_args`] and renders the result
//! with [`ServeArgs::to_args`]: the pod carries one canonical argument list, each flag
//! once.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, FromArgMatches as _, ValueEnum};

use crate::fetch::Sha256Digest;
use crate::group::GroupArgs;
use crate::lora::{LoraAdapter, LoraArgsError, LoraModule, NamedSha256};
use crate::telemetry::TelemetryArgs;
#[cfg(feature = "fault-injection")]
use crate::units::parse_fraction;
use crate::units::{format_millis, parse_millis, parse_size};

/// Which backend to run on (`serve --device`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, ValueEnum)]
pub enum DeviceChoice {
    /// The CPU backend.
    Cpu,
    /// The CUDA backend; the engine exits with the reason when it cannot start.
    Cuda,
    /// CUDA when this binary has the `cuda` feature and a GPU with its driver is
    /// present, else the CPU backend, with a log line saying why. For people: the
    /// operator always says which device a pod has.
    #[default]
    Auto,
}

impl DeviceChoice {
    /// The flag value.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            Self::Cuda => "cuda",
            Self::Auto => "auto",
        }
    }
}

impl std::str::FromStr for DeviceChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        <Self as ValueEnum>::from_str(s, false)
            .map_err(|_| format!("unknown device {s:?} (cpu, cuda or auto)"))
    }
}

impl std::fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `serve` options.
#[derive(Debug, Clone, PartialEq, Args)]
// A flag given twice takes the last value, so `release.engine.args` can override a
// default the operator wrote; the operator refuses overrides of what it owns.
#[command(args_override_self = true)]
#[command(
    after_help = "Metrics (GET /metrics, Prometheus text; OpenMetrics on Accept): \
slipway_requests_total{outcome}, slipway_requests_slo_met_total, latency histograms, \
slipway_num_requests_waiting (queue size) and slipway_kv_cache_usage_perc (KV \
utilisation, 0..1) for the Gateway API Inference Extension's endpoint picker.\n\
Drain: SIGTERM (or Ctrl-C) stops admitting at once (/ready turns 503), lets admitted \
requests finish within --shutdown-timeout-ms, ends what is left with an explicit error, \
and exits 0."
)]
pub struct ServeArgs {
    /// Path of a GGUF model file (`make model` fetches the test model).
    #[arg(long, env = "SLIPWAY_MODEL", value_name = "PATH")]
    pub model: PathBuf,
    /// SHA-256 of the model file (64 hex digits). The engine hashes the file before
    /// loading it and exits with code 3 and the reason when it does not match.
    #[arg(long, value_name = "HEX")]
    pub model_sha256: Option<Sha256Digest>,
    /// A Hugging Face `tokenizer.json` used instead of the vocabulary inside the GGUF.
    /// Its vocabulary must fit the model's embedding, or the engine refuses to start.
    #[arg(long, value_name = "PATH")]
    pub tokenizer: Option<PathBuf>,
    /// SHA-256 of --tokenizer (64 hex digits), verified before it is loaded.
    #[arg(long, value_name = "HEX", requires = "tokenizer")]
    pub tokenizer_sha256: Option<Sha256Digest>,
    /// A Jinja chat template used instead of the GGUF's `tokenizer.chat_template`
    /// (the template's text, not a path). One that cannot render a two-message
    /// conversation is refused at start-up with the renderer's error.
    #[arg(long, value_name = "TEMPLATE")]
    pub chat_template: Option<String>,
    /// A LoRA adapter (llama.cpp's adapter GGUF) served next to the base model as
    /// the model name NAME; repeat for more. Requests pick one with `model`. Only
    /// the CPU backend applies adapters for now: with adapters, `--device cuda` is
    /// refused at start-up and `--device auto` runs on the CPU.
    #[arg(long = "lora", value_name = "NAME=PATH")]
    pub lora: Vec<LoraModule>,
    /// SHA-256 of an adapter given with --lora, verified before it is loaded; repeat
    /// per adapter.
    #[arg(long = "lora-sha256", value_name = "NAME=HEX")]
    pub lora_sha256: Vec<NamedSha256>,
    /// Address to listen on. The loopback default suits a laptop; in a pod the
    /// operator passes 0.0.0.0 so the kubelet's probes and the Services reach it.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// TCP port to listen on (0: any free port, printed at start).
    #[arg(long, default_value_t = crate::ENGINE_PORT)]
    pub port: u16,
    /// Name served as `model` in the API; requests naming another model get 404
    /// [default: the model file's name without extension].
    #[arg(long, value_name = "NAME")]
    pub served_model_name: Option<String>,
    /// Release bundle hash this engine serves (the operator sets it); the `release`
    /// label of every metric.
    #[arg(long, default_value = "dev")]
    pub release: String,
    /// Prefix-cache namespace: requests under different namespaces never share KV
    /// blocks. The operator sets it from the release so releases never mix caches.
    #[arg(long, default_value = "default")]
    pub kv_namespace: String,
    /// SLO time-to-first-token target in ms: a successful request within it and
    /// --slo-tpot-ms counts in slipway_requests_slo_met_total.
    #[arg(long = "slo-ttft-ms", value_name = "MS", default_value = "2000", value_parser = parse_millis)]
    pub slo_ttft: Duration,
    /// SLO time-per-output-token target in ms: (E2E − TTFT)/(output tokens − 1).
    #[arg(long = "slo-tpot-ms", value_name = "MS", default_value = "150", value_parser = parse_millis)]
    pub slo_tpot: Duration,
    /// The most tokens one request may generate: a request asking for more gets a 400
    /// naming this limit; one that does not say gets at most this many. The pod's
    /// drain budget assumes this bound.
    #[arg(long, value_name = "N", default_value_t = 1024,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_output_tokens: u32,
    /// Most requests running (holding KV) at once; more wait in the queue.
    #[arg(long, value_name = "N", default_value_t = 64)]
    pub max_num_seqs: usize,
    /// Most requests waiting beyond --max-num-seqs; more are refused with 503 and
    /// Retry-After.
    #[arg(long, value_name = "N", default_value_t = 256)]
    pub max_queue: usize,
    /// A request whose estimated wait before starting exceeds this many ms is
    /// refused (503, Retry-After) rather than queued to miss its deadline.
    #[arg(long = "max-queue-wait-ms", value_name = "MS", default_value = "20000", value_parser = parse_millis)]
    pub max_queue_wait: Duration,
    /// Token budget of one forward step: running decodes first, then prefill chunks
    /// with what is left. Smaller keeps inter-token latency low under load.
    #[arg(long, value_name = "N", default_value_t = 512)]
    pub max_batched_tokens: usize,
    /// KV blocks (16 positions each) in the pool: the engine's memory for context
    /// [default: 2048 on the CPU; on a GPU, what free memory holds]. Admitted work
    /// never claims more than the pool: a request reserves blocks for its prompt plus
    /// max_tokens.
    #[arg(long, value_name = "N", conflicts_with = "kv_memory")]
    pub kv_blocks: Option<usize>,
    /// KV pool size as memory instead of blocks, e.g. 512MiB, 2GiB, 1500000000
    /// (the number of blocks that fit).
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub kv_memory: Option<u64>,
    /// Per-tenant rate in tokens (prompt + max_tokens) per second; over it, 429 with
    /// Retry-After. The tenant is the API key (Authorization: Bearer) or the
    /// x-tenant header. Off by default.
    #[arg(long, value_name = "TOKENS_PER_S", value_parser = parse_positive)]
    pub tenant_rate: Option<f64>,
    /// Per-tenant burst in tokens [default: 10 s of --tenant-rate, at least one full
    /// context].
    #[arg(long, value_name = "TOKENS", requires = "tenant_rate", value_parser = parse_positive)]
    pub tenant_burst: Option<f64>,
    /// Context length (prompt + output), at most the model's trained length
    /// [default: the trained length].
    #[arg(long, value_name = "N")]
    pub max_model_len: Option<usize>,
    /// Ms admitted requests get to finish after a drain starts; those still running
    /// then end with an explicit error. The operator sets it from the pod's
    /// termination grace period, minus the preStop delay and a margin.
    #[arg(long = "shutdown-timeout-ms", value_name = "MS", default_value = "30000", value_parser = parse_millis)]
    pub shutdown_timeout: Duration,
    /// CPU worker threads [default: one per core].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..))]
    pub threads: Option<u16>,
    /// Backend to run on.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    pub device: DeviceChoice,
    /// GPU ordinal for `--device cuda|auto` [default: 0].
    #[arg(long, value_name = "ORDINAL")]
    pub gpu: Option<usize>,
    /// Logs and request traces.
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
    /// This process's place in a tensor × pipeline group (default: the whole group).
    #[command(flatten)]
    pub group: GroupArgs,
    /// Test-only fault injection (`fault-injection` builds only).
    #[cfg(feature = "fault-injection")]
    #[command(flatten)]
    pub faults: FaultArgs,
}

/// TEST ONLY flags that make a release misbehave, for the rollout tests. They exist
/// only in builds with the `fault-injection` feature, never in the release image.
#[cfg(feature = "fault-injection")]
#[derive(Debug, Clone, PartialEq, Default, Args)]
pub struct FaultArgs {
    /// TEST ONLY: ms of delay added to every decode step, making the release slow.
    #[arg(long = "inject-delay-ms", value_name = "MS", default_value = "0", value_parser = parse_millis)]
    pub inject_delay: Duration,
    /// TEST ONLY: fraction 0..1 of admitted requests that fail with a 500 error,
    /// counted as outcome=error.
    #[arg(long, value_name = "FRACTION", default_value_t = 0.0, value_parser = parse_fraction)]
    pub inject_error_rate: f64,
    /// TEST ONLY: seed of the --inject-error-rate draw, for repeatable runs.
    #[arg(long, value_name = "SEED", default_value_t = 0)]
    pub inject_seed: u64,
}

impl ServeArgs {
    /// The parser's defaults for everything but the model.
    ///
    /// # Errors
    /// Never for a path that is valid UTF-8; clap's error otherwise.
    pub fn for_model(model: impl Into<PathBuf>) -> Result<Self, clap::Error> {
        let model: PathBuf = model.into();
        let mut cmd = Self::augment_args(clap::Command::new("serve"));
        // `--model=PATH`, so a path that starts with '-' is still a value.
        let flag = {
            let mut flag = std::ffi::OsString::from("--model=");
            flag.push(model.as_os_str());
            flag
        };
        let matches = cmd.try_get_matches_from_mut([std::ffi::OsString::from("serve"), flag])?;
        Self::from_arg_matches(&matches)
    }

    /// `self` with `extra` flags applied on top, as the engine would read
    /// `to_args(self)` followed by `extra`: a later flag overrides an earlier one.
    ///
    /// # Errors
    /// clap's error for an unknown flag or a bad value in `extra`.
    pub fn with_extra_args<S: AsRef<str>>(&self, extra: &[S]) -> Result<Self, clap::Error> {
        let argv = self
            .to_args()
            .into_iter()
            .chain(extra.iter().map(|s| s.as_ref().to_owned()));
        crate::parse_flags("serve", argv)
    }

    /// The long names (without `--`, sorted) of the flags `extra` sets, whatever their values:
    /// the operator refuses some flags in `release.engine.args` even when they repeat
    /// a default, since it sets them per pod after the merge.
    ///
    /// # Errors
    /// clap's error for an unknown flag or a bad value in `extra`.
    pub fn flags_in<S: AsRef<str>>(extra: &[S]) -> Result<Vec<String>, clap::Error> {
        // `--model` is required of a command line, not of a fragment of one.
        let mut cmd = Self::augment_args(clap::Command::new("serve"))
            .mut_arg("model", |arg| arg.required(false));
        let argv =
            std::iter::once("serve".to_owned()).chain(extra.iter().map(|s| s.as_ref().to_owned()));
        let matches = cmd.try_get_matches_from_mut(argv)?;
        let mut given: Vec<String> = cmd
            .get_arguments()
            .filter(|arg| {
                matches.value_source(arg.get_id().as_str())
                    == Some(clap::parser::ValueSource::CommandLine)
            })
            .filter_map(|arg| arg.get_long().map(str::to_owned))
            .collect();
        given.sort();
        Ok(given)
    }

    /// The adapters of `--lora` joined with their `--lora-sha256` digests.
    ///
    /// # Errors
    /// An adapter named twice, or a digest for no adapter or twice for one.
    pub fn lora_adapters(&self) -> Result<Vec<LoraAdapter>, LoraArgsError> {
        crate::lora::lora_adapters(&self.lora, &self.lora_sha256)
    }

    /// The flags that reproduce `self` when parsed (without the subcommand name).
    /// Options that are unset stay out; test-only faults appear only when on.
    #[must_use]
    pub fn to_args(&self) -> Vec<String> {
        // Destructured without `..`: a field that is not written here fails to
        // compile, so no flag can be forgotten.
        let Self {
            model,
            model_sha256,
            tokenizer,
            tokenizer_sha256,
            chat_template,
            lora,
            lora_sha256,
            host,
            port,
            served_model_name,
            release,
            kv_namespace,
            slo_ttft,
            slo_tpot,
            max_output_tokens,
            max_num_seqs,
            max_queue,
            max_queue_wait,
            max_batched_tokens,
            kv_blocks,
            kv_memory,
            tenant_rate,
            tenant_burst,
            max_model_len,
            shutdown_timeout,
            threads,
            device,
            gpu,
            telemetry,
            group,
            #[cfg(feature = "fault-injection")]
            faults,
        } = self;
        let mut out = Vec::new();
        let mut flag = |name: &str, value: String| {
            // `--flag=value`: a value starting with '-' is never read as a flag.
            out.push(format!("--{name}={value}"));
        };
        flag("model", model.display().to_string());
        if let Some(sha) = model_sha256 {
            flag("model-sha256", sha.to_string());
        }
        if let Some(path) = tokenizer {
            flag("tokenizer", path.display().to_string());
        }
        if let Some(sha) = tokenizer_sha256 {
            flag("tokenizer-sha256", sha.to_string());
        }
        if let Some(template) = chat_template {
            flag("chat-template", template.clone());
        }
        for module in lora {
            flag("lora", module.to_string());
        }
        for digest in lora_sha256 {
            flag("lora-sha256", digest.to_string());
        }
        flag("host", host.to_string());
        flag("port", port.to_string());
        if let Some(name) = served_model_name {
            flag("served-model-name", name.clone());
        }
        flag("release", release.clone());
        flag("kv-namespace", kv_namespace.clone());
        flag("slo-ttft-ms", format_millis(*slo_ttft));
        flag("slo-tpot-ms", format_millis(*slo_tpot));
        flag("max-output-tokens", max_output_tokens.to_string());
        flag("max-num-seqs", max_num_seqs.to_string());
        flag("max-queue", max_queue.to_string());
        flag("max-queue-wait-ms", format_millis(*max_queue_wait));
        flag("max-batched-tokens", max_batched_tokens.to_string());
        if let Some(blocks) = kv_blocks {
            flag("kv-blocks", blocks.to_string());
        }
        if let Some(bytes) = kv_memory {
            flag("kv-memory", bytes.to_string());
        }
        if let Some(rate) = tenant_rate {
            flag("tenant-rate", rate.to_string());
        }
        if let Some(burst) = tenant_burst {
            flag("tenant-burst", burst.to_string());
        }
        if let Some(len) = max_model_len {
            flag("max-model-len", len.to_string());
        }
        flag("shutdown-timeout-ms", format_millis(*shutdown_timeout));
        if let Some(threads) = threads {
            flag("threads", threads.to_string());
        }
        flag("device", device.to_string());
        if let Some(gpu) = gpu {
            flag("gpu", gpu.to_string());
        }
        #[cfg(feature = "fault-injection")]
        {
            let FaultArgs {
                inject_delay,
                inject_error_rate,
                inject_seed,
            } = faults;
            if !inject_delay.is_zero() {
                flag("inject-delay-ms", format_millis(*inject_delay));
            }
            if *inject_error_rate != 0.0 {
                flag("inject-error-rate", inject_error_rate.to_string());
            }
            if *inject_seed != 0 {
                flag("inject-seed", inject_seed.to_string());
            }
        }
        out.extend(telemetry.to_args());
        out.extend(group.to_args());
        out
    }
}

fn parse_positive(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("`{s}` is not a positive number")),
    }
}
