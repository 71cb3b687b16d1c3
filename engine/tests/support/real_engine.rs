//! The engine actor over the real model's CPU runner, configured the one way the
//! serving tests run it (shared by `serving_model`, `lora_serving` and
//! `sampling_equivalence`, which compare its results with solo runs or a fixture).

use std::sync::Arc;

use slipway_engine::backend::ModelRunner;
use slipway_engine::backend::cpu::{CpuBackend, CpuConfig};
use slipway_engine::model::gguf::GgufFile;
use slipway_engine::model::llama::LlamaWeights;
use slipway_engine::serving::block_manager::BlockManagerConfig;
use slipway_engine::serving::engine::{EngineConfig, EngineHandle, spawn};
use slipway_engine::serving::scheduler::SchedulerConfig;
use slipway_engine::testing::model_path;
use slipway_engine::tokenizer::Tokenizer;

/// The real model's CPU runner with a pool of `num_blocks` KV blocks, and its
/// tokenizer.
///
/// # Panics
/// If the model is missing (run `make model`) or does not load.
pub fn cpu_runner(num_blocks: usize) -> (CpuBackend, Tokenizer) {
    let path = model_path();
    let file = GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let weights = Arc::new(
        LlamaWeights::from_gguf(&file)
            .unwrap_or_else(|e| panic!("loading {}: {e}", path.display())),
    );
    let tokenizer = Tokenizer::from_metadata(file.metadata()).expect("tokenizer");
    let runner = CpuBackend::new(
        weights,
        &CpuConfig {
            num_blocks,
            ..CpuConfig::default()
        },
    )
    .expect("backend");
    (runner, tokenizer)
}

/// Starts the actor over `runner`: up to `max_num_seqs` sequences and 256 tokens a
/// step, 2,048-token contexts, the prefix cache on, over the runner's whole KV pool.
///
/// # Panics
/// If the configuration is refused (a test bug).
pub fn spawn_engine(
    runner: impl ModelRunner + Send + 'static,
    max_num_seqs: usize,
) -> EngineHandle {
    let geometry = runner.kv_geometry();
    let config = EngineConfig {
        scheduler: SchedulerConfig {
            max_num_seqs,
            max_batched_tokens: 256,
            max_model_len: 2048,
            blocks: BlockManagerConfig {
                num_blocks: geometry.num_blocks,
                block_size: geometry.block_size,
                enable_prefix_cache: true,
            },
        },
        command_capacity: 64,
        ..EngineConfig::default()
    };
    let (handle, _actor) = spawn(Box::new(runner), config).expect("config");
    handle
}
