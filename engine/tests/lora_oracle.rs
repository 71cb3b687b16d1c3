//! A LoRA adapter on the real SmolLM2-135M-Instruct Q4_1 against llama.cpp run with
//! the same adapter (`--lora`, recorded in `tests/fixtures/smollm2-lora-llamacpp.json`
//! by `engine/scripts/record-lora-oracle`): teacher-forced agreement at the base
//! model's bar. The adapter is per request: the same runner, asked for the base
//! model, agrees with the base oracle. A missing model or adapter fails with
//! instructions, never skips.

use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use slipway_engine::backend::cpu::{CpuBackend, CpuConfig};
use slipway_engine::backend::{Batch, LogitsWanted, ModelRunner as _, SeqChunk};
use slipway_engine::generate::{PositionScore, score_with};
use slipway_engine::kv::BlockAllocator;
use slipway_engine::model::gguf::GgufFile;
use slipway_engine::model::llama::LlamaWeights;
use slipway_engine::model::lora::{BaseModel, load_adapters};
use slipway_engine::sampling::{SamplingParams, SeqSampling, argmax};
use slipway_engine::testing::{Oracle, lora_adapter_path, lora_oracle_path, model_path, oracle};
use slipway_engine::tokenizer::Tokenizer;

#[path = "support/agreement.rs"]
mod agreement;

const BLOCKS: usize = 512;
/// The adapter's index in the runner.
const ADAPTER: Option<u16> = Some(0);

struct Fixture {
    runner: CpuBackend,
    alloc: BlockAllocator,
    tokenizer: Tokenizer,
}

/// The LoRA oracle and the adapter sha256 it was recorded with.
fn lora_oracle() -> (Oracle, String) {
    let path = lora_oracle_path();
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("LoRA oracle not readable at {}: {e}", path.display()));
    let raw: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    let sha = raw["adapter_sha256"]
        .as_str()
        .expect("the LoRA oracle names its adapter's sha256")
        .to_owned();
    let oracle = serde_json::from_value(raw)
        .unwrap_or_else(|e| panic!("{} is not in the oracle format: {e}", path.display()));
    (oracle, sha)
}

fn fixture() -> MutexGuard<'static, Fixture> {
    static F: OnceLock<Mutex<Fixture>> = OnceLock::new();
    let m = F.get_or_init(|| {
        let path = model_path();
        let file = GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        // Loaded as `serve` loads it: verified against the digest the oracle was
        // recorded with, then checked against the base model.
        let (_, sha) = lora_oracle();
        let adapters = load_adapters(
            &[slipway_contract::LoraAdapter {
                name: "test".into(),
                path: lora_adapter_path(),
                sha256: Some(sha.parse().expect("a sha256")),
            }],
            &BaseModel {
                file: &file,
                path: &path,
                sha256: None,
                served_name: "smollm2",
            },
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let weights = Arc::new(LlamaWeights::from_gguf(&file).expect("weights"));
        let runner = CpuBackend::new(
            weights,
            &CpuConfig {
                // Two threads on any machine, so decode steps can be split in two.
                threads: 2,
                num_blocks: BLOCKS,
                ..CpuConfig::default()
            },
        )
        .and_then(|r| r.with_adapters(adapters))
        .expect("backend");
        assert_eq!(runner.adapters().len(), 1);
        let tokenizer = Tokenizer::from_metadata(file.metadata()).expect("tokenizer");
        Mutex::new(Fixture {
            runner,
            alloc: BlockAllocator::new(BLOCKS),
            tokenizer,
        })
    });
    // A failed test poisons the lock; the fixture itself is still consistent.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Teacher-forced scores of `tokens` under `adapter` (or the base model).
fn scores(
    (runner, alloc): (&mut CpuBackend, &mut BlockAllocator),
    tokens: &[u32],
    adapter: Option<u16>,
) -> Vec<PositionScore> {
    score_with(runner, alloc, tokens, 1, adapter).expect("score")
}

/// Teacher-forced agreement of the shared runner under `adapter` with `oracle`.
fn assert_agrees(what: &str, oracle: &Oracle, adapter: Option<u16>) {
    let mut f = fixture();
    let Fixture {
        runner,
        alloc,
        tokenizer,
    } = &mut *f;
    agreement::assert_agrees(what, oracle, tokenizer, |t| {
        scores((runner, alloc), t, adapter)
    });
}

#[test]
fn with_the_adapter_we_agree_with_llama_cpp_with_the_adapter() {
    assert_agrees("the LoRA adapter", &lora_oracle().0, ADAPTER);
}

#[test]
fn without_the_adapter_the_same_runner_agrees_with_the_base_oracle() {
    assert_agrees("the base model beside an adapter", &oracle(), None);
}

#[test]
fn the_adapter_changes_the_greedy_tokens_and_leaves_no_trace() {
    let (lora, _) = lora_oracle();
    let base = oracle();
    let mut f = fixture();
    let Fixture { runner, alloc, .. } = &mut *f;
    // llama.cpp's greedy continuations differ with the adapter: it is big enough to
    // test something.
    let changed = lora
        .prompts
        .iter()
        .zip(&base.prompts)
        .filter(|(l, b)| l.continuation != b.continuation)
        .count();
    assert!(
        changed * 2 >= lora.prompts.len(),
        "the adapter changes only {changed} of {} greedy continuations",
        lora.prompts.len()
    );
    // Ours too, and alternating base and adapter requests gives each the same
    // scores every time: nothing of one leaks into the other.
    // `story`: llama.cpp's tokens part at the second step.
    let p = lora
        .prompts
        .iter()
        .find(|p| p.id == "story")
        .expect("the oracle has the story prompt");
    let mut tokens = p.prompt_tokens.clone();
    tokens.extend(&p.continuation);
    let with = scores((runner, alloc), &tokens, ADAPTER);
    let without = scores((runner, alloc), &tokens, None);
    assert_ne!(
        with.iter().map(|s| s.argmax).collect::<Vec<_>>(),
        without.iter().map(|s| s.argmax).collect::<Vec<_>>()
    );
    assert_eq!(scores((runner, alloc), &tokens, ADAPTER), with);
    assert_eq!(scores((runner, alloc), &tokens, None), without);
}

/// Greedy decode steps of `prompts` together, every other sequence with the adapter,
/// with decode steps split between the threads or not; every step's logits.
fn decode_together(
    (runner, alloc): (&mut CpuBackend, &mut BlockAllocator),
    prompts: &[&[u32]],
    steps: usize,
    split: bool,
) -> Vec<Vec<f32>> {
    let bs = runner.kv_geometry().block_size;
    let tables: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            let mut table = Vec::new();
            alloc
                .ensure(&mut table, p.len() + steps, bs)
                .expect("blocks");
            table
        })
        .collect();
    let chunk = |i: usize, tokens: Vec<u32>, start_pos: usize| SeqChunk {
        tokens,
        start_pos,
        block_table: tables[i].clone(),
        logits: LogitsWanted::Last,
        adapter: if i.is_multiple_of(2) { ADAPTER } else { None },
    };
    runner.set_split_decode(split);
    let prefill = Batch {
        seqs: prompts
            .iter()
            .enumerate()
            .map(|(i, p)| chunk(i, p.to_vec(), 0))
            .collect(),
    };
    let mut logits = vec![runner.forward(&prefill).expect("prefill").data];
    for step in 0..steps {
        let last = logits.last().expect("a step");
        let batch = Batch {
            seqs: prompts
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let row = &last[i * runner.config().vocab..][..runner.config().vocab];
                    chunk(i, vec![argmax(row) as u32], p.len() + step)
                })
                .collect(),
        };
        let parts = runner.decode_parts(&batch).map(|p| p.len());
        assert_eq!(parts, split.then_some(2), "step {step}: parts of the split");
        let out = runner.forward(&batch).expect("decode").data;
        // Sampling the same step again (its KV writes are the same values) picks the
        // same tokens, each part sampling its own rows when split.
        let greedy = SeqSampling {
            params: SamplingParams::default(),
            uniform: None,
            history: Vec::new(),
            stop_tokens: Vec::new(),
            logprob: false,
        };
        let sampled = runner
            .execute(&batch, &vec![Some(greedy); prompts.len()])
            .expect("decode and sample");
        let vocab = runner.config().vocab;
        for (i, s) in sampled.sampled.iter().enumerate() {
            let want = argmax(&out[i * vocab..][..vocab]) as u32;
            assert_eq!(
                s.map(|s| s.token),
                Some(want),
                "step {step}: token of sequence {i}"
            );
        }
        logits.push(out);
    }
    runner.set_split_decode(true);
    for t in &tables {
        alloc.release(t).expect("release");
    }
    logits
}

#[test]
fn a_split_decode_step_gives_the_whole_steps_logits_bit_for_bit() {
    let base = oracle();
    let mut f = fixture();
    let Fixture { runner, alloc, .. } = &mut *f;
    // Sixteen sequences of mixed lengths, so the parts differ in size.
    let prompts: Vec<&[u32]> = (0..16)
        .map(|i| {
            let p = &base.prompts[i % base.prompts.len()].prompt_tokens;
            &p[..p.len().min(3 + 5 * i)]
        })
        .collect();
    let whole = decode_together((runner, alloc), &prompts, 4, false);
    let split = decode_together((runner, alloc), &prompts, 4, true);
    for (step, (w, s)) in whole.iter().zip(&split).enumerate() {
        let same = w.len() == s.len() && w.iter().zip(s).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(
            same,
            "step {step}: the split step's logits differ from the whole step's"
        );
    }
}
