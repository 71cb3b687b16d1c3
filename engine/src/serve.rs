//! `slipway-engine serve`: load the model, start the engine actor and the HTTP API,
//! and drain on SIGTERM, Ctrl-C or `POST /admin/drain`.
//!
//! Drain order: `/ready` turns false and new requests get 503 with `Retry-After` at
//! once; admitted requests keep running until the engine is idle or
//! `--shutdown-timeout` passes; then the listener closes and the process exits 0.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use slipway_engine::backend::ModelRunner;
use slipway_engine::backend::cpu::{CpuBackend, CpuConfig};
use slipway_engine::model::gguf::GgufFile;
use slipway_engine::model::llama::LlamaWeights;
use slipway_engine::serving::block_manager::BlockManagerConfig;
use slipway_engine::serving::engine::{EngineConfig, spawn};
use slipway_engine::serving::http::{AppState, router};
use slipway_engine::serving::scheduler::SchedulerConfig;
use slipway_engine::template::ChatTemplate;
use slipway_engine::tokenizer::Tokenizer;

/// `serve` options.
#[derive(Debug, Args)]
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
    /// Release bundle hash this engine serves (the operator sets it); logged.
    #[arg(long, default_value = "dev")]
    pub release: String,
    /// Prefix-cache namespace: requests under different namespaces never share KV
    /// blocks. The operator sets it from the release so releases never mix caches.
    #[arg(long, default_value = "default")]
    pub kv_namespace: String,
    /// Most requests running (holding KV) at once; more wait in the queue.
    #[arg(long, default_value_t = 64)]
    pub max_num_seqs: usize,
    /// Token budget of one forward step: running decodes first, then prefill chunks
    /// with what is left. Smaller keeps inter-token latency low under load.
    #[arg(long, default_value_t = 512)]
    pub max_batched_tokens: usize,
    /// KV blocks (16 positions each) in the pool: the engine's memory for context.
    #[arg(long, default_value_t = 2048)]
    pub kv_blocks: usize,
    /// Context length (prompt + output), at most the model's trained length.
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Seconds admitted requests get to finish after a drain starts, before exit.
    #[arg(long, default_value_t = 30)]
    pub shutdown_timeout: u64,
    /// CPU worker threads (0: one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
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
    let weights = Arc::new(
        LlamaWeights::from_gguf(&file)
            .with_context(|| format!("loading {}", args.model.display()))?,
    );
    let trained = weights.config.context_length;
    let max_model_len = args.max_model_len.unwrap_or(trained).min(trained);
    let runner = CpuBackend::new(
        weights,
        &CpuConfig {
            threads: args.threads,
            num_blocks: args.kv_blocks,
            ..CpuConfig::default()
        },
    )
    .map_err(|e| anyhow::anyhow!(e))?;
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
        ..EngineConfig::default()
    };
    config.validate().map_err(|e| anyhow::anyhow!(e))?;
    let name = args.served_model_name.clone().unwrap_or_else(|| {
        args.model
            .file_stem()
            .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned())
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        let (engine, _task) = spawn(Box::new(runner), config).map_err(|e| anyhow::anyhow!(e))?;
        let state = Arc::new(AppState::new(
            engine.clone(),
            Arc::new(tokenizer),
            template,
            name.clone(),
            args.kv_namespace.clone(),
            max_model_len,
        ));
        let addr = SocketAddr::new(args.host, args.port);
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        let local = listener.local_addr()?;
        tracing::info!(%local, model = %name, release = %args.release, "serving");
        println!("listening on http://{local}");
        let shutdown = {
            let state = Arc::clone(&state);
            let timeout = Duration::from_secs(args.shutdown_timeout);
            async move {
                wait_for_drain(&state).await;
                state.ready.store(false, Ordering::Relaxed);
                tracing::info!(?timeout, "draining: admitting nothing new");
                let idle = async {
                    let mut tick = tokio::time::interval(Duration::from_millis(50));
                    loop {
                        tick.tick().await;
                        match engine.stats().await {
                            Ok(s) if s.running + s.waiting > 0 => {}
                            _ => break,
                        }
                    }
                };
                if tokio::time::timeout(timeout, idle).await.is_err() {
                    tracing::warn!("shutdown timeout reached with requests still running");
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
