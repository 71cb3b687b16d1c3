//! The LoRA oracle (`tests/fixtures/smollm2-lora-llamacpp.json`) belongs to the adapter
//! in the cache: its `adapter_sha256` is the file's, so an adapter made by a changed
//! generator cannot be tested against outputs recorded with another. And it asks the
//! same questions as the base oracle, so the two can be compared prompt by prompt.
//! A missing adapter fails with instructions (`make lora-adapter`), never skips.

use sha2::{Digest, Sha256};
use slipway_engine::testing::{Oracle, lora_adapter_path, lora_oracle_path, oracle};

fn lora_fixture() -> (Oracle, serde_json::Value) {
    let path = lora_oracle_path();
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{} not readable: {e}", path.display()));
    let typed = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{} is not in the oracle format: {e}", path.display()));
    let raw = serde_json::from_str(&text).expect("valid JSON");
    (typed, raw)
}

#[test]
fn fixture_was_recorded_with_the_cached_adapter() {
    let (_, raw) = lora_fixture();
    let recorded = raw["adapter_sha256"]
        .as_str()
        .expect("the LoRA oracle names its adapter's sha256");
    let path = lora_adapter_path();
    let bytes =
        std::fs::read(&path).unwrap_or_else(|e| panic!("{} not readable: {e}", path.display()));
    let actual = hex::encode(Sha256::digest(&bytes));
    assert_eq!(
        actual,
        recorded,
        "{} is not the adapter the LoRA oracle was recorded with: run `make lora-adapter`, \
         or re-record the oracle (engine/scripts/record-lora-oracle) if the generator changed",
        path.display()
    );
}

#[test]
fn fixture_asks_the_base_oracles_questions() {
    let (lora, raw) = lora_fixture();
    let base = oracle();
    assert_eq!(lora.model_sha256, base.model_sha256);
    assert!(raw["adapter"]["rank"].as_u64().is_some_and(|r| r > 0));
    assert_eq!(lora.prompts.len(), base.prompts.len());
    for (l, b) in lora.prompts.iter().zip(&base.prompts) {
        assert_eq!((&l.id, &l.prompt_tokens), (&b.id, &b.prompt_tokens));
        assert_eq!(l.steps.len(), l.continuation.len(), "{}", l.id);
        for (step, &token) in l.steps.iter().zip(&l.continuation) {
            assert_eq!(step.token, token, "{}", l.id);
            assert_eq!(step.top.len(), 5, "{}", l.id);
        }
    }
}
