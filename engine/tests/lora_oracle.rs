//! A LoRA adapter on the real SmolLM2-135M-Instruct Q4_1 against llama.cpp run with
//! the same adapter (`--lora`, recorded in `tests/fixtures/smollm2-lora-llamacpp.json`
//! by `engine/scripts/record-lora-oracle`): teacher-forced agreement at the base
//! model's bar. The adapter is per request: the same runner, asked for the base
//! model, agrees with the base oracle. A missing model or adapter fails with
//! instructions, never skips.

use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use slipway_engine::backend::ModelRunner as _;
use slipway_engine::backend::cpu::{CpuBackend, CpuConfig};
use slipway_engine::generate::{PositionScore, score_with};
use slipway_engine::kv::BlockAllocator;
use slipway_engine::model::gguf::GgufFile;
use slipway_engine::model::llama::LlamaWeights;
use slipway_engine::model::lora::{BaseModel, load_adapters};
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
