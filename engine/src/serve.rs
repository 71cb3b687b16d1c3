//! `slipway-engine serve`: load the model, start the engine actor and the HTTP API,
//! and drain on SIGTERM, Ctrl-C or `POST /admin/drain`.
//!
//! Drain order: `/ready` turns false and new requests get 503 with `Retry-After` at
//! once; admitted requests keep running until none is left or `--shutdown-timeout`
//! passes; those still running then are ended with an explicit error (an SSE
//! `error` object then `[DONE]`, or a 503 JSON body), counted as outcome `error`;
//! then the listener closes and the process exits 0.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use slipway_engine::backend::cpu::CpuConfig;
use slipway_engine::backend::cuda::runner::DeviceConfig;
use slipway_engine::backend::{BackendOptions, DeviceChoice, select};
use slipway_engine::model::gguf::GgufFile;
use slipway_engine::model::llama::LlamaConfig;
use slipway_engine::serving::admission::{Admission, AdmissionConfig, TenantRate};
use slipway_engine::serving::block_manager::BlockManagerConfig;
use slipway_engine::serving::engine::{EngineConfig, spawn_with_metrics};
use slipway_engine::serving::http::{ApiConfig, AppState, FaultConfig, ModelText, router};
use slipway_engine::serving::metrics::{ServingMetrics, SloTargets};
use slipway_engine::serving::scheduler::SchedulerConfig;
use slipway_engine::template::ChatTemplate;
use slipway_engine::tokenizer::Tokenizer;

/// KV blocks when neither `--kv-blocks` nor `--kv-memory` is given.
const DEFAULT_KV_BLOCKS: usize = 2048;

/// `serve` options.
#[derive(Debug, Args)]
#[command(
    after_help = "Metrics (GET /metrics, Prometheus text; OpenMetrics on Accept): \
slipway_requests_total{outcome}, slipway_requests_slo_met_total, latency histograms, \
slipway_num_requests_waiting (queue size) and slipway_kv_cache_usage_perc (KV \
utilisation, 0..1) for the Gateway API Inference Extension's endpoint picker."
)]
pub struct ServeArgs {
    /// Path of a GGUF model file (`make model` fetches the test model).
    #[arg(long, env = "SLIPWAY_MODEL", value_name = "PATH")]
    pub model: PathBuf,
    /// Address to listen on. Keep the loopback default unless a proxy or the pod
    /// network must reach the engine.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: std::net::IpAddr,
    /// TCP port to listen on (0: any free port, printed at start).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Name served as `model` in the API (default: the file name without extension).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Release bundle hash this engine serves (the operator sets it); the `release`
    /// label of every metric.
    #[arg(long, default_value = "dev")]
    pub release: String,
    /// Prefix-cache namespace: requests under different namespaces never share KV
    /// blocks. The operator sets it from the release so releases never mix caches.
    #[arg(long, default_value = "default")]
    pub kv_namespace: String,
    /// SLO time-to-first-token target in ms (the InferenceService's default, 2 s):
    /// a successful request within it and --slo-tpot-ms counts in
    /// slipway_requests_slo_met_total.
    #[arg(long, default_value_t = 2000)]
    pub slo_ttft_ms: u64,
    /// SLO time-per-output-token target in ms (the InferenceService's default):
    /// (E2E − TTFT)/(output tokens − 1).
    #[arg(long, default_value_t = 150)]
    pub slo_tpot_ms: u64,
    /// Most requests running (holding KV) at once; more wait in the queue.
    #[arg(long, default_value_t = 64)]
    pub max_num_seqs: usize,
    /// Most requests waiting beyond --max-num-seqs; more are refused with 503 and
    /// Retry-After.
    #[arg(long, default_value_t = 256)]
    pub max_queue: usize,
    /// A request whose estimated wait before starting exceeds this many ms is
    /// refused (503, Retry-After) rather than queued to miss its deadline.
    #[arg(long, default_value_t = 20_000)]
    pub max_queue_wait_ms: u64,
    /// Token budget of one forward step: running decodes first, then prefill chunks
    /// with what is left. Smaller keeps inter-token latency low under load.
    #[arg(long, default_value_t = 512)]
    pub max_batched_tokens: usize,
    /// KV blocks (16 positions each) in the pool: the engine's memory for context
    /// [default: 2048]. Admitted work never claims more than the pool: a request
    /// reserves blocks for its prompt plus max_tokens.
    #[arg(long, conflicts_with = "kv_memory")]
    pub kv_blocks: Option<usize>,
    /// KV pool size as memory instead of blocks, e.g. 512MiB, 2GiB, 1500000000
    /// (the number of blocks that fit).
    #[arg(long, value_parser = parse_size)]
    pub kv_memory: Option<u64>,
    /// Per-tenant rate in tokens (prompt + max_tokens) per second; over it, 429 with
    /// Retry-After. The tenant is the API key (Authorization: Bearer) or the
    /// x-tenant header. Off by default.
    #[arg(long)]
    pub tenant_rate: Option<f64>,
    /// Per-tenant burst in tokens [default: 10 s of --tenant-rate, at least one full
    /// context].
    #[arg(long, requires = "tenant_rate")]
    pub tenant_burst: Option<f64>,
    /// Context length (prompt + output), at most the model's trained length.
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Seconds admitted requests get to finish after a drain starts; those still
    /// running then end with an explicit error. The operator sets it from the pod's
    /// termination grace period.
    #[arg(long, default_value_t = 30)]
    pub shutdown_timeout: u64,
    /// CPU worker threads (0: one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Backend: `cpu`, `cuda` (fail if the GPU backend cannot start), or `auto`
    /// (CUDA when this binary has the `cuda` feature and a GPU with its driver is
    /// present, else the CPU backend, with a log line saying why).
    #[arg(long, default_value = "auto", value_parser = clap::value_parser!(DeviceChoice))]
    pub device: DeviceChoice,
    /// GPU ordinal for `--device cuda|auto`.
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
    /// TEST ONLY (fault injection for rollout tests): ms of delay added to every
    /// decode step, making the release slow. 0 (off) in production.
    #[arg(long, default_value_t = 0)]
    pub inject_delay_ms: u64,
    /// TEST ONLY (fault injection for rollout tests): fraction 0..1 of admitted
    /// requests that fail with a 500 error, counted as outcome=error. 0 (off) in
    /// production.
    #[arg(long, default_value_t = 0.0)]
    pub inject_error_rate: f64,
    /// TEST ONLY: seed of the --inject-error-rate draw, for repeatable runs.
    #[arg(long, default_value_t = 0)]
    pub inject_seed: u64,
}

/// Parses a byte size: a number with an optional K/M/G/T suffix, binary (KiB, MiB,
/// ...) or decimal (KB, MB, ...; bare K/M/G/T are binary).
///
/// # Errors
/// A message for anything else.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a size like 512MiB or 2GiB"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024f64.powi(2),
        "g" | "gib" => 1024f64.powi(3),
        "t" | "tib" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        other => return Err(format!("unknown size unit `{other}` in `{s}`")),
    };
    let bytes = n * mult;
    if !(1.0..1.8e19).contains(&bytes) {
        return Err(format!("`{s}` is out of range"));
    }
    Ok(bytes as u64)
}

/// Bytes of one KV block on the CPU backend: keys and values (f32) of every layer
/// and KV head for `block_size` positions.
#[must_use]
pub fn kv_block_bytes(c: &LlamaConfig, block_size: usize) -> u64 {
    (c.n_layers * 2 * c.n_kv_heads * c.head_dim * block_size * std::mem::size_of::<f32>()) as u64
}

/// Bytes of one KV block on the CUDA backend: f16 keys and values.
#[must_use]
pub fn gpu_kv_block_bytes(c: &LlamaConfig, block_size: usize) -> u64 {
    kv_block_bytes(c, block_size) / 2
}

/// How many blocks of `per_block` bytes fit in `bytes` (`--kv-memory`).
fn blocks_in(bytes: u64, per_block: u64) -> anyhow::Result<usize> {
    let blocks = usize::try_from(bytes / per_block).unwrap_or(usize::MAX);
    anyhow::ensure!(
        blocks > 0,
        "--kv-memory {bytes} bytes holds no KV block ({per_block} bytes each)"
    );
    Ok(blocks)
}

/// Runs the server until drained.
///
/// # Errors
/// A model that cannot load, a bad setting, or an address that cannot be bound.
pub fn run_serve(args: &ServeArgs) -> anyhow::Result<()> {
    let file = GgufFile::open(&args.model)?;
    let tokenizer = Tokenizer::from_metadata(file.metadata())
        .with_context(|| format!("loading the tokenizer of {}", args.model.display()))?;
    let template = ChatTemplate::from_metadata(file.metadata(), &tokenizer).ok();
    let model_config = LlamaConfig::from_gguf(&file)
        .with_context(|| format!("loading {}", args.model.display()))?;
    let trained = model_config.context_length;
    let max_model_len = args.max_model_len.unwrap_or(trained).min(trained);
    let block_size = CpuConfig::default().block_size;
    // On the GPU, no size flag means "size the pool from free device memory".
    let gpu_blocks = match (args.kv_blocks, args.kv_memory) {
        (Some(b), _) => Some(b),
        (None, Some(bytes)) => Some(blocks_in(
            bytes,
            gpu_kv_block_bytes(&model_config, block_size),
        )?),
        (None, None) => None,
    };
    let cpu_blocks = match (args.kv_blocks, args.kv_memory) {
        (Some(b), _) => b,
        (None, Some(bytes)) => blocks_in(bytes, kv_block_bytes(&model_config, block_size))?,
        (None, None) => DEFAULT_KV_BLOCKS,
    };
    let options = BackendOptions {
        cpu: CpuConfig {
            threads: args.threads,
            num_blocks: cpu_blocks,
            block_size,
        },
        cuda: DeviceConfig {
            block_size,
            num_blocks: gpu_blocks,
            ..DeviceConfig::default()
        },
        gpu: args.gpu,
    };
    let (runner, device) = select(args.device, &file, &options)
        .with_context(|| format!("starting a backend for {}", args.model.display()))?;
    tracing::info!(?device, "backend started");
    let g = runner.kv_geometry();
    let config = EngineConfig {
        scheduler: SchedulerConfig {
            max_num_seqs: args.max_num_seqs,
            max_batched_tokens: args.max_batched_tokens,
            max_model_len,
            blocks: BlockManagerConfig {
                num_blocks: g.num_blocks,
                block_size: g.block_size,
                enable_prefix_cache: true,
            },
        },
        inject_step_delay: Duration::from_millis(args.inject_delay_ms),
        ..EngineConfig::default()
    };
    config.validate().map_err(|e| anyhow::anyhow!(e))?;
    let name = args.served_model_name.clone().unwrap_or_else(|| {
        args.model
            .file_stem()
            .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned())
    });
    let admission = Admission::new(AdmissionConfig {
        max_num_seqs: args.max_num_seqs,
        max_queue: args.max_queue,
        kv_budget_blocks: g.num_blocks,
        block_size: g.block_size,
        queue_deadline: Duration::from_millis(args.max_queue_wait_ms),
        tenant_rate: args.tenant_rate.map(|r| TenantRate {
            tokens_per_s: r,
            burst: args
                .tenant_burst
                .unwrap_or_else(|| (10.0 * r).max(max_model_len as f64)),
        }),
    })
    .map_err(|e| anyhow::anyhow!(e))?;
    let api = ApiConfig {
        model_name: name.clone(),
        kv_namespace: args.kv_namespace.clone(),
        max_model_len,
        slo: SloTargets {
            ttft: Duration::from_millis(args.slo_ttft_ms),
            tpot: Duration::from_millis(args.slo_tpot_ms),
        },
        faults: FaultConfig {
            error_rate: args.inject_error_rate,
            seed: args.inject_seed,
        },
        ..ApiConfig::default()
    };
    api.validate().map_err(|e| anyhow::anyhow!(e))?;
    if args.inject_delay_ms > 0 || args.inject_error_rate > 0.0 {
        tracing::warn!(
            delay_ms = args.inject_delay_ms,
            error_rate = args.inject_error_rate,
            "fault injection is on (test only)"
        );
    }
    let metrics = Arc::new(ServingMetrics::new(&name, &args.release));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        let (engine, _task) = spawn_with_metrics(runner, config, Arc::clone(&metrics))
            .map_err(|e| anyhow::anyhow!(e))?;
        let state = Arc::new(
            AppState::new(
                engine.clone(),
                ModelText {
                    tokenizer: Arc::new(tokenizer),
                    template,
                },
                api,
                Arc::clone(&admission),
                metrics,
            )
            .map_err(|e| anyhow::anyhow!(e))?,
        );
        let addr = SocketAddr::new(args.host, args.port);
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        let local = listener.local_addr()?;
        tracing::info!(%local, model = %name, release = %args.release, blocks = g.num_blocks, "serving");
        println!("listening on http://{local}");
        let shutdown = {
            let state = Arc::clone(&state);
            let timeout = Duration::from_secs(args.shutdown_timeout);
            async move {
                wait_for_drain(&state).await;
                state.ready.store(false, Ordering::Relaxed);
                tracing::info!(?timeout, "draining: admitting nothing new");
                // Admitted = holding an admission permit, released when its response
                // has been produced (streams: when the last event is queued).
                let idle = async {
                    let mut tick = tokio::time::interval(Duration::from_millis(50));
                    loop {
                        tick.tick().await;
                        if admission.load().in_flight == 0 {
                            break;
                        }
                    }
                };
                if tokio::time::timeout(timeout, idle).await.is_err() {
                    let left = admission.load().in_flight;
                    tracing::warn!(left, "shutdown timeout reached; ending the requests still running with an error");
                    let _ = engine
                        .abort_all("the server shut down before this request finished (--shutdown-timeout)")
                        .await;
                }
            }
        };
        axum::serve(listener, router(state))
            .with_graceful_shutdown(shutdown)
            .await
            .context("serving")?;
        tracing::info!("drained; exiting");
        Ok(())
    })
}

async fn wait_for_drain(state: &AppState) {
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(error) => {
                tracing::warn!(%error, "cannot watch SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = term => tracing::info!("SIGTERM"),
        r = tokio::signal::ctrl_c() => if r.is_ok() { tracing::info!("Ctrl-C") },
        () = state.drain.notified() => {},
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_and_decimal_units() {
        assert_eq!(parse_size("1500"), Ok(1500));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("2G"), Ok(2 << 30));
        assert_eq!(parse_size("1.5kb"), Ok(1500));
        for bad in ["", "MiB", "12XB", "-1", "0"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn kv_block_bytes_of_smollm2() {
        // 30 layers × (K + V) × 3 KV heads × 64 dims × 16 positions × 4 bytes.
        assert_eq!(kv_block_bytes(&LlamaConfig::default(), 16), 737_280);
    }
}
