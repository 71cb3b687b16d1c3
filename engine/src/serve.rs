//! `slipway-engine serve`: verify and load the model, start the engine actor and the
//! HTTP API, and drain on SIGTERM or Ctrl-C. The flags are
//! [`slipway_contract::ServeArgs`], the type the operator renders pods from.
//!
//! Drain order: `/ready` turns false and new requests get 503 with `Retry-After` at
//! once; admitted requests keep running until none is left or `--shutdown-timeout-ms`
//! passes; those still running then are ended with an explicit error (an SSE
//! `error` object then `[DONE]`, or a 503 JSON body), counted as outcome `error`;
//! then the listener closes and the process exits 0. There is no drain endpoint: in
//! a pod the kubelet's SIGTERM (after the preStop hook) is the one way to drain, so
//! no client reaching the serving port can take a replica out.
//!
//! Parallel groups (`--tensor-parallel T --pipeline-parallel P`, issue #15): every
//! rank loads only its stage's layers, and of each only its tensor shard. A worker (`--rank` > 0) joins the group at `--leader-address` and
//! computes the leader's steps ([`slipway_engine::parallel::run_worker`]); it serves
//! only the probes (`/ready` once the group formed), exits 0 when the leader ends the
//! group (the leader drained) and non-zero when the group fails. The leader (rank 0) loads stage 0, forms the group (the
//! workers join only once loaded) and only then listens, so it is ready exactly when
//! every rank joined and loaded; it runs the scheduler, admission and HTTP over a
//! [`slipway_engine::parallel::PipelineRunner`], sending keep-alives every quarter
//! step timeout while idle. When the group fails (a rank dead, silent for the step
//! timeout, or aborting), `/ready` turns false, the failed step's requests and every
//! other one end with an explicit error naming the rank, the listener closes and the
//! process exits non-zero. The CUDA backend is refused for groups, as are LoRA
//! adapters.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use slipway_contract::ServeArgs;
use slipway_engine::backend::cpu::CpuConfig;
use slipway_engine::backend::device::runner::DeviceConfig;
use slipway_engine::backend::{BackendOptions, select};
use slipway_engine::backend::{Device, DeviceChoice};
use slipway_engine::kernels::attention::KvLayout;
use slipway_engine::model::gguf::GgufFile;
use slipway_engine::model::llama::LlamaConfig;
use slipway_engine::model::lora;
use slipway_engine::parallel::{
    ModelShape, ParallelLayout, PipelineRunner, StageRunner, TcpConfig, TcpTransport, run_worker,
};
use slipway_engine::serving::admission::{Admission, AdmissionConfig, TenantRate};
use slipway_engine::serving::block_manager::BlockManagerConfig;
use slipway_engine::serving::engine::BoxedRunner;
use slipway_engine::serving::engine::{EngineConfig, spawn_with_metrics};
use slipway_engine::serving::http::{ApiConfig, AppState, ModelText, router};
use slipway_engine::serving::metrics::{ServingMetrics, SloTargets};
use slipway_engine::serving::scheduler::SchedulerConfig;
use slipway_engine::template::ChatTemplate;
use slipway_engine::tokenizer::Tokenizer;

/// KV blocks when neither `--kv-blocks` nor `--kv-memory` is given.
const DEFAULT_KV_BLOCKS: usize = 2048;

/// Bytes of one KV block: keys and values (f16 on both backends) of `layers` layers
/// (the model's, or a pipeline stage's) and `kv_heads` KV heads (the model's, or a
/// tensor rank's) for `block_size` positions.
fn kv_block_bytes(c: &LlamaConfig, block_size: usize, layers: usize, kv_heads: usize) -> u64 {
    let layout = KvLayout {
        block_size,
        kv_heads,
        head_dim: c.head_dim,
    };
    (layers * layout.block_bytes()) as u64
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

/// This process's place in a parallel group.
struct Group {
    layout: ParallelLayout,
    tcp: TcpConfig,
}

/// The group the flags describe, or `None` for a single process. A model that cannot
/// be split as asked is refused naming the model's numbers; the CUDA backend is
/// refused because groups run on the CPU backend only.
fn plan_group(
    args: &ServeArgs,
    file: &GgufFile,
    config: &LlamaConfig,
) -> anyhow::Result<Option<Group>> {
    let group = &args.group;
    if group.is_single_process() {
        return Ok(None);
    }
    let shape = ModelShape::from_tensors(config, file.tensors());
    let layout = ParallelLayout::new(
        &shape,
        group.tensor_parallel as usize,
        group.pipeline_parallel as usize,
    )
    .with_context(|| format!("splitting {} over the group", args.model.display()))?;
    anyhow::ensure!(
        args.device != DeviceChoice::Cuda,
        "--tensor-parallel {} --pipeline-parallel {} runs on the CPU backend only for now, \
not --device cuda",
        group.tensor_parallel,
        group.pipeline_parallel
    );
    let tcp = TcpConfig::from_args(group)?
        .context("a group of several ranks without a leader address")?;
    Ok(Some(Group { layout, tcp }))
}

/// A worker rank: loads its stage, joins the group and computes the leader's steps
/// until the leader ends the group (`Ok`) or the group fails (an error naming the
/// rank to blame, and a non-zero exit).
///
/// It serves no API, only the probes on `--host`/`--port`: `/health` from the start,
/// `/ready` once the group formed (every rank joined and loaded) and until it ends.
/// The readiness line is printed once the stage is loaded and the probes answer.
fn serve_worker(
    args: &ServeArgs,
    file: GgufFile,
    group: &Group,
    cpu: &CpuConfig,
) -> anyhow::Result<()> {
    let rank = group.tcp.rank;
    // One thread answers the probes; the steps run on this one and the stage's pool.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let addr = SocketAddr::new(args.host, args.port);
    let listener = rt
        .block_on(tokio::net::TcpListener::bind(addr))
        .with_context(|| format!("binding {addr}"))?;
    let local = listener.local_addr()?;
    let joined = Arc::new(AtomicBool::new(false));
    let probes = worker_probes(Arc::clone(&joined));
    rt.spawn(async move {
        if let Err(error) = axum::serve(listener, probes).await {
            tracing::error!(%error, "the probe endpoint failed");
        }
    });
    let mut stage = StageRunner::load(&file, &group.layout, rank, cpu)?;
    // As in `run_serve`: the stage's weights are copied out; unmapping returns the
    // pages read while loading them.
    drop(file);
    tracing::info!(rank, layers = ?stage.layout().layers, leader = %group.tcp.leader, %local, "stage loaded; joining the group");
    println!("{}", slipway_contract::listening::line(local));
    let transport = TcpTransport::join(&group.tcp).context("joining the parallel group")?;
    joined.store(true, Ordering::Relaxed);
    let result = run_worker(transport, &mut stage);
    joined.store(false, Ordering::Relaxed);
    result.with_context(|| format!("rank {rank} of the parallel group"))?;
    tracing::info!(rank, "the leader ended the group; exiting");
    Ok(())
}

/// A worker's probes: alive always, ready while it is in a formed group.
fn worker_probes(joined: Arc<AtomicBool>) -> axum::Router {
    use axum::http::StatusCode;
    use axum::routing::get;
    use slipway_contract::paths;
    axum::Router::new()
        .route(paths::HEALTH, get(|| async { "ok" }))
        .route(
            paths::READY,
            get(move || async move {
                if joined.load(Ordering::Relaxed) {
                    (StatusCode::OK, "ready")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "not in a formed group")
                }
            }),
        )
}

/// Runs the server until drained.
///
/// # Errors
/// A model that cannot load, a bad setting, or an address that cannot be bound.
pub fn run_serve(args: &ServeArgs) -> anyhow::Result<()> {
    args.group.validate()?;
    if let Some(expected) = &args.model_sha256 {
        let started = std::time::Instant::now();
        let bytes = slipway_engine::fetch::verify_file(&args.model, expected)?;
        tracing::info!(model = %args.model.display(), bytes, elapsed = ?started.elapsed(), "model sha256 verified");
    }
    let file = GgufFile::open(&args.model)?;
    let tokenizer = Tokenizer::for_model(
        &file,
        args.tokenizer.as_deref(),
        args.tokenizer_sha256.as_ref(),
    )
    .with_context(|| {
        let path = args.tokenizer.as_deref().unwrap_or(&args.model);
        format!("loading the tokenizer {}", path.display())
    })?;
    let template =
        ChatTemplate::for_serving(file.metadata(), &tokenizer, args.chat_template.as_deref())
            .context("--chat-template")?;
    let model_config = LlamaConfig::from_gguf(&file)
        .with_context(|| format!("loading {}", args.model.display()))?;
    let group = plan_group(args, &file, &model_config)?;
    let name = args.served_model_name.clone().unwrap_or_else(|| {
        args.model
            .file_stem()
            .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned())
    });
    // LoRA adapters: verified, checked against this model and loaded before anything
    // starts; any problem ends the start-up with the adapter's name and the reason.
    let adapters = lora::load_adapters(
        &args.lora_adapters()?,
        &lora::BaseModel {
            file: &file,
            path: &args.model,
            sha256: args.model_sha256,
            served_name: &name,
        },
    )?;
    let adapter_names: Vec<String> = adapters.iter().map(|a| a.name().to_owned()).collect();
    let trained = model_config.context_length;
    let max_model_len = args.max_model_len.unwrap_or(trained).min(trained);
    let block_size = CpuConfig::default().block_size;
    // Every stage has the same blocks (their ids are the leader's), each holding its
    // own layers: `--kv-memory` is what the largest stage may use.
    let kv_layers = group.as_ref().map_or(model_config.n_layers, |g| {
        g.layout
            .stage_layers()
            .iter()
            .map(ExactSizeIterator::len)
            .max()
            .unwrap_or(0)
    });
    let kv_heads = model_config.n_kv_heads / group.as_ref().map_or(1, |g| g.layout.tensor());
    let per_block = kv_block_bytes(&model_config, block_size, kv_layers, kv_heads);
    // On the GPU, no size flag means "size the pool from free device memory".
    let gpu_blocks = match (args.kv_blocks, args.kv_memory) {
        (Some(b), _) => Some(b),
        (None, Some(bytes)) => Some(blocks_in(bytes, per_block)?),
        (None, None) => None,
    };
    let cpu_blocks = match (args.kv_blocks, args.kv_memory) {
        (Some(b), _) => b,
        (None, Some(bytes)) => blocks_in(bytes, per_block)?,
        (None, None) => DEFAULT_KV_BLOCKS,
    };
    let cpu = CpuConfig {
        // 0: one worker per core.
        threads: args.threads.map_or(0, usize::from),
        num_blocks: cpu_blocks,
        block_size,
    };
    anyhow::ensure!(
        group.is_none() || adapters.is_empty(),
        "LoRA adapters are not served by a parallel group yet ({} given)",
        adapters.len()
    );
    if let Some(g) = &group
        && !g.layout.rank(g.tcp.rank)?.is_leader()
    {
        return serve_worker(args, file, g, &cpu);
    }
    let options = BackendOptions {
        cpu: cpu.clone(),
        cuda: DeviceConfig {
            block_size,
            num_blocks: gpu_blocks,
            ..DeviceConfig::default()
        },
        gpu: args.gpu.unwrap_or(0),
        adapters,
    };
    let (runner, device, group_failures) = match &group {
        None => {
            let (runner, device) = select(args.device, &file, &options)
                .with_context(|| format!("starting a backend for {}", args.model.display()))?;
            (runner, device, None)
        }
        // The leader loads its stage, then forms the group: the workers load theirs
        // before they join, so once it is formed every rank is ready to compute, and
        // only then does the leader listen for requests.
        Some(g) => {
            let stage = StageRunner::load(&file, &g.layout, 0, &options.cpu)?;
            let transport = TcpTransport::join(&g.tcp).context("forming the parallel group")?;
            let runner =
                PipelineRunner::new(stage, transport)?.with_keep_alive(g.tcp.step_timeout / 4);
            let failures = runner.failures();
            let runner: BoxedRunner = Box::new(runner);
            (runner, Device::Cpu, Some(failures))
        }
    };
    // Every backend copies what it needs out of the file (repacked for the kernels,
    // or uploaded to the device). Unmapping it returns the pages read while loading,
    // so what stays resident is the packed weights and the KV store: a pipeline
    // stage's own, which is how memory per rank falls with the split.
    drop(file);
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
        #[cfg(feature = "fault-injection")]
        inject_step_delay: args.faults.inject_delay,
        ..EngineConfig::default()
    };
    config.validate()?;
    let admission = Admission::new(AdmissionConfig {
        max_num_seqs: args.max_num_seqs,
        max_queue: args.max_queue,
        kv_budget_blocks: g.num_blocks,
        block_size: g.block_size,
        queue_deadline: args.max_queue_wait,
        tenant_rate: args.tenant_rate.map(|r| TenantRate {
            tokens_per_s: r,
            burst: args
                .tenant_burst
                .unwrap_or_else(|| (10.0 * r).max(max_model_len as f64)),
        }),
    })?;
    // Without `fault-injection` the default fills in `faults` (off); with it, every
    // field is set and the update is a no-op clippy flags.
    #[allow(clippy::needless_update)]
    let api = ApiConfig {
        model_name: name.clone(),
        adapters: adapter_names.clone(),
        release: args.release.clone(),
        kv_namespace: args.kv_namespace.clone(),
        max_model_len,
        max_output_tokens: usize::try_from(args.max_output_tokens).unwrap_or(usize::MAX),
        slo: SloTargets {
            ttft: args.slo_ttft,
            tpot: args.slo_tpot,
        },
        kv_blocks: g.num_blocks,
        kv_block_size: g.block_size,
        #[cfg(feature = "fault-injection")]
        faults: slipway_engine::serving::http::FaultConfig {
            error_rate: args.faults.inject_error_rate,
            seed: args.faults.inject_seed,
        },
        ..ApiConfig::default()
    };
    api.validate()?;
    #[cfg(feature = "fault-injection")]
    if !args.faults.inject_delay.is_zero() || args.faults.inject_error_rate > 0.0 {
        tracing::warn!(
            delay = ?args.faults.inject_delay,
            error_rate = args.faults.inject_error_rate,
            "fault injection is on (test only)"
        );
    }
    let metrics = Arc::new(ServingMetrics::with_adapters(
        &name,
        &args.release,
        &adapter_names,
    ));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        let (engine, _task) = spawn_with_metrics(runner, config, Arc::clone(&metrics))?;
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
            )?,
        );
        let addr = SocketAddr::new(args.host, args.port);
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        let local = listener.local_addr()?;
        tracing::info!(%local, model = %name, release = %args.release, blocks = g.num_blocks, max_output_tokens = args.max_output_tokens, "serving");
        println!("{}", slipway_contract::listening::line(local));
        let group_failed = Arc::new(std::sync::OnceLock::new());
        let shutdown = {
            let state = Arc::clone(&state);
            let timeout = args.shutdown_timeout;
            let group_failed = Arc::clone(&group_failed);
            let (state_failed, engine_failed) = (Arc::clone(&state), engine.clone());
            let drain = async move {
                slipway_telemetry::stop_signal().await;
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
                        .abort_all("the server shut down before this request finished (--shutdown-timeout-ms)")
                        .await;
                }
            };
            // A failed group is a failed replica: not ready at once, every request
            // ended with an explicit error, then the listener closes and the process
            // exits non-zero (the operator recreates the group).
            let failed = async move {
                let Some(mut failures) = group_failures else {
                    return std::future::pending().await;
                };
                // The guard `wait_for` returns is not `Send`: read it in one statement.
                let reason = failures
                    .wait_for(Option::is_some)
                    .await
                    .map(|r| r.clone().unwrap_or_default());
                let Ok(reason) = reason else {
                    return std::future::pending().await;
                };
                state_failed.ready.store(false, Ordering::Relaxed);
                tracing::error!(%reason, "the parallel group failed; ending every request and exiting");
                let _ = engine_failed
                    .abort_all(format!("the parallel group failed: {reason}"))
                    .await;
                let _ = group_failed.set(reason);
            };
            async move {
                tokio::select! {
                    () = drain => {}
                    () = failed => {}
                }
            }
        };
        axum::serve(listener, router(state))
            .with_graceful_shutdown(shutdown)
            .await
            .context("serving")?;
        if let Some(reason) = group_failed.get() {
            anyhow::bail!("the parallel group failed: {reason}");
        }
        tracing::info!("drained; exiting");
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_block_bytes_of_smollm2() {
        // 30 layers × (K + V) × 3 KV heads × 64 dims × 16 positions × 2 bytes.
        assert_eq!(kv_block_bytes(&LlamaConfig::default(), 16, 30, 3), 368_640);
        // A stage of 15 layers: half.
        assert_eq!(kv_block_bytes(&LlamaConfig::default(), 16, 15, 3), 184_320);
        // A tensor rank of three, with one KV head: a third.
        assert_eq!(kv_block_bytes(&LlamaConfig::default(), 16, 30, 1), 122_880);
    }
}
