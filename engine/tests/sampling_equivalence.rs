//! Greedy and seeded sampling through the engine actor give the tokens recorded in
//! `fixtures/sampled_tokens.txt`, on the real SmolLM2-135M-Instruct Q4_1 (CPU backend);
//! and the device runner, which samples where its logits are, chooses what the host
//! sampler chooses from its full logits (`*::cpu` on the CPU twins in `make test`,
//! `*::cuda` with feature `cuda` on a GPU).
//!
//! The fixture was recorded before sampling moved from the actor into the model
//! runner (when the actor sampled each step's logits itself), so this test holds the
//! runner's sampling to the tokens the old path chose: greedy, seeded temperature with
//! top-p, seeded top-k with top-p, and seeded sampling with penalties, twelve requests
//! in one batch. Rewrite it only for a change that is meant to change tokens:
//! `SLIPWAY_RECORD_SAMPLING_FIXTURE=1 cargo test -p slipway-engine --test
//! sampling_equivalence` (see `fixtures/README.md`). A missing model fails with
//! instructions (`make model`), never skips.

use std::fmt::Write as _;

use slipway_engine::backend::device::runner::{DeviceConfig, DeviceRunner};
use slipway_engine::backend::device::{CpuDevice, Device};
use slipway_engine::backend::{Batch, LogitsWanted, ModelRunner, SeqChunk};
use slipway_engine::kv::BlockAllocator;
use slipway_engine::model::gguf::GgufFile;
use slipway_engine::sampling::{Sampler, SamplingParams, SeqSampling};
use slipway_engine::serving::block_manager::CacheKey;
use slipway_engine::serving::engine::{Event, GenerateRequest};
use slipway_engine::testing::model_path;
use slipway_engine::tokenizer::Tokenizer;

#[path = "support/real_engine.rs"]
mod real_engine;
use real_engine::{cpu_runner, spawn_engine};

const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/sampled_tokens.txt"
);
const RECORD: &str = "SLIPWAY_RECORD_SAMPLING_FIXTURE";

/// The sampling modes, by name.
fn modes() -> Vec<(&'static str, SamplingParams)> {
    let seeded = |seed| SamplingParams {
        seed,
        ..SamplingParams::default()
    };
    vec![
        ("greedy", SamplingParams::default()),
        (
            "temperature-top-p",
            SamplingParams {
                temperature: 0.8,
                top_p: 0.9,
                ..seeded(7)
            },
        ),
        (
            "top-k-top-p",
            SamplingParams {
                temperature: 1.0,
                top_k: 40,
                top_p: 0.95,
                ..seeded(11)
            },
        ),
        (
            "penalties",
            SamplingParams {
                temperature: 0.7,
                repetition_penalty: 1.3,
                frequency_penalty: 0.2,
                presence_penalty: 0.1,
                ..seeded(3)
            },
        ),
    ]
}

const PROMPTS: [&str; 3] = [
    "The river ran past the old mill and",
    "Write a short poem about winter:",
    "Q: What is the capital of France?\nA:",
];

/// Every (prompt, mode) request at once, so the steps batch sequences of different
/// modes; one line per request: `prompt-index mode finish-reason: token ids`.
async fn sample_all() -> String {
    let (runner, tokenizer) = cpu_runner(256);
    let handle = spawn_engine(runner, 16);
    let mut streams = Vec::new();
    for (i, prompt) in PROMPTS.iter().enumerate() {
        for (name, sampling) in modes() {
            let request = GenerateRequest {
                prompt: tokenizer.encode(prompt),
                max_tokens: 24,
                sampling,
                eos: tokenizer.eog_tokens().to_vec(),
                cache_key: CacheKey {
                    namespace: "equivalence".into(),
                    adapter: None,
                    salt: None,
                },
                adapter: None,
            };
            let stream = handle.submit(request).await.expect("accepted");
            streams.push((format!("{i} {name}"), stream));
        }
    }
    let mut out = String::new();
    for (label, mut stream) in streams {
        let mut tokens = Vec::new();
        let reason = loop {
            match stream.events.recv().await {
                Some(Event::Token(t)) => tokens.push(t.to_string()),
                Some(Event::Finished { reason, .. }) => break format!("{reason:?}"),
                Some(other) => panic!("{label}: {other:?}"),
                None => panic!("{label}: stream ended without a final event"),
            }
        };
        writeln!(out, "{label} {reason}: {}", tokens.join(" ")).expect("string");
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_and_seeded_sampling_give_the_recorded_tokens() {
    let got = sample_all().await;
    if std::env::var_os(RECORD).is_some() {
        std::fs::write(FIXTURE, &got).unwrap_or_else(|e| panic!("writing {FIXTURE}: {e}"));
        eprintln!("recorded {FIXTURE}:\n{got}");
        return;
    }
    let want = std::fs::read_to_string(FIXTURE).unwrap_or_else(|e| {
        panic!("{FIXTURE}: {e} (record it with {RECORD}=1, see fixtures/README.md)")
    });
    for (g, w) in got.lines().zip(want.lines()) {
        assert_eq!(g, w, "sampled tokens differ from the recorded ones");
    }
    assert_eq!(
        got.lines().count(),
        want.lines().count(),
        "requests recorded"
    );
    // Each sampling mode chose differently from greedy somewhere, so the fixture
    // really holds seeded draws (a sampler that ignored its settings would fail).
    let tokens_of = |label: &str| {
        want.lines()
            .find(|l| l.starts_with(label))
            .and_then(|l| l.split_once(": "))
            .map(|(_, t)| t.to_owned())
    };
    for i in 0..PROMPTS.len() {
        let greedy = tokens_of(&format!("{i} greedy"));
        for (name, _) in modes().iter().skip(1) {
            assert_ne!(tokens_of(&format!("{i} {name}")), greedy, "{i} {name}");
        }
    }
}

/// Decode steps after the prefill in the device check.
const DEVICE_STEPS: usize = 6;

/// Step by step, the device runner's `execute` chooses the tokens (and log-probability)
/// that the host sampler chooses from the same runner's full logits with the same
/// draws: greedy by the device argmax, top-k/top-p by the sampling kernel (two
/// neighbouring rows with the same settings share a launch), and on the host what the
/// kernels do not cover (top-k of 0, penalties, a log-probability).
fn device_execute_samples_as_the_host_does<D: Device>(dev: D) {
    let path = model_path();
    let file = GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let tokenizer = Tokenizer::from_metadata(file.metadata()).expect("tokenizer");
    let mut runner = DeviceRunner::new(
        dev,
        &file,
        DeviceConfig {
            num_blocks: Some(64),
            ..DeviceConfig::default()
        },
    )
    .unwrap_or_else(|e| panic!("device runner: {e}"));
    let bs = runner.kv_geometry().block_size;
    let mut seqs: Vec<(SamplingParams, bool)> =
        modes().into_iter().map(|(_, p)| (p, false)).collect();
    // A second top-k/top-p sequence right after the first, and greedy with its
    // log-probability.
    seqs.insert(
        3,
        (
            SamplingParams {
                seed: 12,
                ..seqs[2].0.clone()
            },
            false,
        ),
    );
    seqs.push((SamplingParams::default(), true));
    let eos = tokenizer.eog_tokens().to_vec();
    let mut alloc = BlockAllocator::new(64);
    let mut samplers: Vec<Sampler> = seqs.iter().map(|(p, _)| Sampler::new(p.clone())).collect();
    let mut histories: Vec<Vec<u32>> = Vec::new();
    let mut tables: Vec<Vec<u32>> = Vec::new();
    for (i, _) in seqs.iter().enumerate() {
        let prompt = tokenizer.encode(PROMPTS[i % PROMPTS.len()]);
        let mut table = Vec::new();
        alloc
            .ensure(&mut table, prompt.len() + DEVICE_STEPS + 1, bs)
            .expect("blocks");
        histories.push(prompt);
        tables.push(table);
    }
    let mut fed: Vec<usize> = vec![0; seqs.len()];
    for step in 0..=DEVICE_STEPS {
        let batch = Batch {
            seqs: (0..seqs.len())
                .map(|i| SeqChunk {
                    tokens: histories[i][fed[i]..].to_vec(),
                    start_pos: fed[i],
                    block_table: tables[i].clone(),
                    logits: LogitsWanted::Last,
                    adapter: None,
                })
                .collect(),
        };
        let sampling: Vec<Option<SeqSampling>> = seqs
            .iter()
            .zip(&mut samplers)
            .zip(&histories)
            .map(|(((params, logprob), sampler), history)| {
                Some(SeqSampling {
                    params: params.clone(),
                    uniform: sampler.draw(),
                    history: history.clone(),
                    stop_tokens: eos.clone(),
                    logprob: *logprob,
                })
            })
            .collect();
        let logits = runner.forward(&batch).expect("forward");
        // The same step again, sampling on the runner: it rewrites the same KV.
        let got = runner.execute(&batch, &sampling).expect("execute").sampled;
        assert_eq!(got.len(), seqs.len());
        for (i, (got, smp)) in got.iter().zip(&sampling).enumerate() {
            let smp = smp.as_ref().expect("every sequence samples");
            let want = smp.sample_row(logits.last_of(i).expect("last row"));
            assert_eq!(
                got.as_ref(),
                Some(&want),
                "step {step}, sequence {i}: {smp:?}"
            );
            assert_eq!(want.logprob.is_some(), smp.logprob);
        }
        for (i, got) in got.iter().enumerate() {
            fed[i] = histories[i].len();
            histories[i].push(got.as_ref().expect("sampled").token);
        }
    }
}

macro_rules! test_device {
    ($name:ident) => {
        mod $name {
            #[test]
            fn cpu() {
                super::$name(super::CpuDevice);
            }

            #[cfg(feature = "cuda")]
            #[test]
            fn cuda() {
                let dev = slipway_engine::backend::cuda::gpu::CudaDevice::open(0)
                    .unwrap_or_else(|e| panic!("the CUDA sampling test needs a GPU: {e}"));
                super::$name(dev);
            }
        }
    };
}

test_device!(device_execute_samples_as_the_host_does);
