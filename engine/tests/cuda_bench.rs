//! The GPU benchmark's engine side (`make bench-gpu` runs it on the device machine;
//! `engine/scripts/bench-gpu --cpu` runs it small on the CPU backend, to exercise the
//! harness). Ignored by `cargo test`: it measures, it asserts nothing about speed.
//!
//! Prints one JSON line (`BENCH {...}`) with, for the runner chosen by
//! SLIPWAY_BENCH_DEVICE (`cuda`, `cpu`, or `cpu-twin`):
//! - single-stream decode tokens/s (one sequence, one token per step);
//! - aggregate decode tokens/s at each batch size in SLIPWAY_BENCH_BATCHES (default
//!   16,64,256), every sequence decoding one token per step;
//! - prefill tokens/s of one SLIPWAY_BENCH_PREFILL-token prompt (default 512).
//!
//! Decode steps take the greedy token on the device where it can (only ids return).
//! Each measurement follows warm-up steps (on the GPU: graph capture for the bucket).

// A failed call fails the benchmark with its error.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Instant;

use slipway_engine::backend::cpu::{CpuBackend, CpuConfig};
use slipway_engine::backend::device::runner::{DeviceConfig, DeviceRunner};
use slipway_engine::backend::device::{CpuDevice, Device};
use slipway_engine::backend::{Batch, LogitsWanted, ModelRunner, SeqChunk};
use slipway_engine::kv::BlockAllocator;
use slipway_engine::model::gguf::GgufFile;
use slipway_engine::model::llama::LlamaWeights;
use slipway_engine::sampling::argmax;
use slipway_engine::testing::model_path;

/// A runner that can take one greedy step.
trait Greedy: ModelRunner {
    fn greedy(&mut self, batch: &Batch) -> Vec<u32>;
}

impl<D: Device> Greedy for DeviceRunner<D> {
    fn greedy(&mut self, batch: &Batch) -> Vec<u32> {
        self.forward_greedy(batch)
            .unwrap()
            .into_iter()
            .map(|t| t.unwrap_or(0))
            .collect()
    }
}

impl Greedy for CpuBackend {
    fn greedy(&mut self, batch: &Batch) -> Vec<u32> {
        let l = self.forward(batch).unwrap();
        (0..batch.seqs.len())
            .map(|i| l.last_of(i).map_or(0, |r| argmax(r) as u32))
            .collect()
    }
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .map(|v| v.parse().unwrap_or_else(|e| panic!("{name}={v}: {e}")))
        .unwrap_or(default)
}

/// Prefills `b` sequences of `prompt` tokens, then runs `steps` decode steps of all
/// of them (after `warmup` untimed ones); returns tokens/s of the timed steps.
fn decode_rate(r: &mut dyn Greedy, b: usize, prompt: usize, warmup: usize, steps: usize) -> f64 {
    let bs = r.kv_geometry().block_size;
    let mut alloc = BlockAllocator::new(r.kv_geometry().num_blocks);
    let tables: Vec<Vec<u32>> = (0..b)
        .map(|_| {
            let mut t = Vec::new();
            alloc
                .ensure(&mut t, prompt + warmup + steps, bs)
                .expect("KV blocks for the benchmark");
            t
        })
        .collect();
    let vocab = r.config().vocab as u32;
    let prefill = Batch {
        seqs: (0..b)
            .map(|i| SeqChunk {
                tokens: (0..prompt)
                    .map(|j| ((i * 131 + j * 7) as u32) % vocab)
                    .collect(),
                start_pos: 0,
                block_table: tables[i].clone(),
                logits: LogitsWanted::Last,
                adapter: None,
            })
            .collect(),
    };
    let mut next = r.greedy(&prefill);
    let mut t0 = Instant::now();
    for s in 0..warmup + steps {
        if s == warmup {
            t0 = Instant::now();
        }
        let batch = Batch {
            seqs: (0..b)
                .map(|i| SeqChunk {
                    tokens: vec![next[i]],
                    start_pos: prompt + s,
                    block_table: tables[i].clone(),
                    logits: LogitsWanted::Last,
                    adapter: None,
                })
                .collect(),
        };
        next = r.greedy(&batch);
    }
    (b * steps) as f64 / t0.elapsed().as_secs_f64()
}

fn prefill_rate(r: &mut dyn Greedy, len: usize, reps: usize) -> f64 {
    let bs = r.kv_geometry().block_size;
    let mut alloc = BlockAllocator::new(r.kv_geometry().num_blocks);
    let mut table = Vec::new();
    alloc.ensure(&mut table, len, bs).expect("KV blocks");
    let vocab = r.config().vocab as u32;
    let batch = Batch {
        seqs: vec![SeqChunk {
            tokens: (0..len).map(|j| (j as u32 * 13) % vocab).collect(),
            start_pos: 0,
            block_table: table,
            logits: LogitsWanted::Last,
            adapter: None,
        }],
    };
    r.greedy(&batch); // warm-up
    let t0 = Instant::now();
    for _ in 0..reps {
        r.greedy(&batch);
    }
    (len * reps) as f64 / t0.elapsed().as_secs_f64()
}

#[test]
#[ignore = "a benchmark: run by engine/scripts/bench-gpu"]
fn bench_engine() {
    let device = std::env::var("SLIPWAY_BENCH_DEVICE").unwrap_or_else(|_| "cuda".into());
    let batches: Vec<usize> = std::env::var("SLIPWAY_BENCH_BATCHES")
        .unwrap_or_else(|_| "16,64,256".into())
        .split(',')
        .map(|v| {
            v.trim()
                .parse()
                .unwrap_or_else(|e| panic!("batch {v}: {e}"))
        })
        .collect();
    let steps = env_usize("SLIPWAY_BENCH_STEPS", 128);
    let warmup = env_usize("SLIPWAY_BENCH_WARMUP", 8);
    let prompt = env_usize("SLIPWAY_BENCH_PROMPT", 16);
    let prefill = env_usize("SLIPWAY_BENCH_PREFILL", 512);
    let path = model_path();
    let file = GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let blocks = batches.iter().max().copied().unwrap_or(1).max(1)
        * (prompt + warmup + steps).div_ceil(16)
        + prefill.div_ceil(16)
        + 16;
    let dcfg = DeviceConfig {
        num_blocks: Some(blocks),
        ..DeviceConfig::default()
    };
    let mut runner: Box<dyn Greedy> = match device.as_str() {
        #[cfg(feature = "cuda")]
        "cuda" => {
            let dev = slipway_engine::backend::cuda::gpu::CudaDevice::open(0)
                .unwrap_or_else(|e| panic!("bench on cuda: {e}"));
            Box::new(DeviceRunner::new(dev, &file, dcfg).unwrap())
        }
        "cpu-twin" => Box::new(DeviceRunner::new(CpuDevice, &file, dcfg).unwrap()),
        "cpu" => {
            let w = Arc::new(LlamaWeights::from_gguf(&file).unwrap());
            Box::new(
                CpuBackend::new(
                    w,
                    &CpuConfig {
                        num_blocks: blocks,
                        ..CpuConfig::default()
                    },
                )
                .unwrap(),
            )
        }
        other => panic!("SLIPWAY_BENCH_DEVICE={other}: cpu, cpu-twin or (with feature cuda) cuda"),
    };
    let single = decode_rate(runner.as_mut(), 1, prompt, warmup, steps);
    let mut aggregate = Vec::new();
    for &b in &batches {
        aggregate.push(format!(
            "\"{b}\": {:.1}",
            decode_rate(runner.as_mut(), b, prompt, warmup, steps)
        ));
    }
    let pf = prefill_rate(runner.as_mut(), prefill, 3);
    println!(
        "BENCH {{\"engine\": \"slipway-{device}\", \"decode_single_tok_s\": {single:.1}, \"decode_aggregate_tok_s\": {{{}}}, \"prefill_tok_s\": {pf:.1}, \"prompt\": {prompt}, \"steps\": {steps}, \"prefill_len\": {prefill}}}",
        aggregate.join(", ")
    );
}
