//! LoRA adapters in the engine actor on the real SmolLM2-135M-Instruct Q4_1 (CPU
//! backend) with the test adapter: base and adapter requests share batches without
//! changing each other's greedy results, and a prefix cached under one never serves
//! another. A missing model or adapter fails with instructions, never skips.

use std::sync::Arc;

use slipway_engine::backend::cpu::{CpuBackend, CpuConfig};
use slipway_engine::model::gguf::GgufFile;
use slipway_engine::model::llama::LlamaWeights;
use slipway_engine::model::lora::{BaseModel, load_adapters};
use slipway_engine::sampling::SamplingParams;
use slipway_engine::serving::block_manager::CacheKey;
use slipway_engine::serving::engine::{EngineHandle, Event, GenerateRequest, RequestStream};
use slipway_engine::testing::{lora_adapter_path, model_path};
use slipway_engine::tokenizer::Tokenizer;

#[path = "support/real_engine.rs"]
#[allow(dead_code)]
// shared by several test binaries; this one loads the model itself, for its adapters
mod real_engine;
use real_engine::spawn_engine;

const BLOCKS: usize = 768;
/// The test adapter, and the same file under a second name.
const ADAPTER: Option<u16> = Some(0);
const TWIN: Option<u16> = Some(1);

fn engine(max_num_seqs: usize) -> (EngineHandle, Tokenizer) {
    let path = model_path();
    let file = GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let spec = |name: &str| slipway_contract::LoraAdapter {
        name: name.into(),
        path: lora_adapter_path(),
        sha256: None,
    };
    let adapters = load_adapters(
        &[spec("test"), spec("twin")],
        &BaseModel {
            file: &file,
            path: &path,
            sha256: None,
            served_name: "smollm2",
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let weights = Arc::new(LlamaWeights::from_gguf(&file).expect("weights"));
    let tokenizer = Tokenizer::from_metadata(file.metadata()).expect("tokenizer");
    let runner = CpuBackend::new(
        weights,
        &CpuConfig {
            num_blocks: BLOCKS,
            ..CpuConfig::default()
        },
    )
    .and_then(|r| r.with_adapters(adapters))
    .expect("backend");
    let handle = spawn_engine(runner, max_num_seqs);
    (handle, tokenizer)
}

fn request(
    tokenizer: &Tokenizer,
    prompt: &str,
    max_tokens: usize,
    (adapter, salt): (Option<u16>, &str),
) -> GenerateRequest {
    GenerateRequest {
        prompt: tokenizer.encode(prompt),
        max_tokens,
        sampling: SamplingParams::default(),
        eos: tokenizer.eog_tokens().to_vec(),
        // The engine fills in the adapter's identity itself.
        cache_key: CacheKey {
            namespace: "test".into(),
            adapter: None,
            salt: Some(salt.into()),
        },
        adapter,
    }
}

async fn collect(mut s: RequestStream) -> (Vec<u32>, Event) {
    let mut tokens = Vec::new();
    while let Some(e) = s.events.recv().await {
        match e {
            Event::Token(t) => tokens.push(t),
            other => return (tokens, other),
        }
    }
    panic!("stream ended without a final event");
}

fn prompts() -> Vec<String> {
    let words = [
        "river", "engine", "harbor", "violet", "number", "garden", "winter", "signal",
    ];
    (0..8)
        .map(|i| {
            let body: Vec<&str> = (0..(3 + (i * 11) % 45))
                .map(|j| words[(i + 2 * j) % words.len()])
                .collect();
            format!("Story {i}: {}. Then", body.join(" "))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_base_and_eight_adapter_streams_at_once_equal_their_solo_results() {
    let (h, tok) = engine(16);
    // Each prompt under the base model and under the adapter, alternating, so the
    // batches cut into many adapter segments.
    let runs: Vec<(String, Option<u16>)> = prompts()
        .into_iter()
        .flat_map(|p| [(p.clone(), None), (p, ADAPTER)])
        .collect();
    let mut solo = Vec::new();
    for (p, adapter) in &runs {
        let s = h
            .submit(request(&tok, p, 12, (*adapter, "solo")))
            .await
            .expect("accepted");
        solo.push(collect(s).await.0);
    }
    // The adapter does change the greedy tokens (else this test shows nothing).
    let changed = solo.chunks(2).filter(|pair| pair[0] != pair[1]).count();
    println!("the adapter changed {changed} of 8 greedy outputs");
    assert!(
        changed >= 4,
        "the adapter changed only {changed} of 8 greedy outputs"
    );
    // Another salt, so the concurrent run computes every prompt again.
    let mut streams = Vec::new();
    for (p, adapter) in &runs {
        streams.push(
            h.submit(request(&tok, p, 12, (*adapter, "batch")))
                .await
                .expect("accepted"),
        );
    }
    let tasks: Vec<_> = streams
        .into_iter()
        .map(|s| tokio::spawn(collect(s)))
        .collect();
    for (i, task) in tasks.into_iter().enumerate() {
        let (tokens, end) = task.await.expect("collector");
        assert!(matches!(end, Event::Finished { .. }), "{end:?}");
        let who = if runs[i].1.is_some() {
            "adapter"
        } else {
            "base"
        };
        assert_eq!(
            tokens,
            solo[i],
            "prompt {} ({who}) differs when batched",
            i / 2
        );
    }
    let st = h.stats().await.expect("running");
    assert_eq!((st.running, st.waiting, st.free_blocks), (0, 0, BLOCKS));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_200_token_prefix_is_cached_per_adapter_and_never_across() {
    let (h, tok) = engine(4);
    let mut prefix = String::new();
    while tok.encode(&prefix).len() < 200 {
        prefix.push_str("The harbor master counted the boats twice. ");
    }
    let prefix_ids = tok.encode(&prefix)[..200].to_vec();
    let ask = |adapter: Option<u16>, question: &str| {
        let mut r = request(&tok, "", 4, (adapter, "shared"));
        r.prompt = prefix_ids.clone();
        r.prompt.extend(tok.encode(question));
        r
    };
    let cached = |end: Event| match end {
        Event::Finished { cached_tokens, .. } => cached_tokens,
        other => panic!("{other:?}"),
    };
    let names = [(ADAPTER, "adapter"), (None, "base"), (TWIN, "twin")];
    // First under each: whatever the others cached, nothing is shared across.
    for (adapter, who) in names {
        let (_, end) = collect(
            h.submit(ask(adapter, " Question one?"))
                .await
                .expect("accepted"),
        )
        .await;
        assert_eq!(cached(end), 0, "{who} hit another's prefix");
    }
    // Again under each: its own prefix is there.
    for (adapter, who) in names {
        let (_, end) = collect(
            h.submit(ask(adapter, " A different question?"))
                .await
                .expect("accepted"),
        )
        .await;
        let hit = cached(end);
        assert!(hit >= 192, "{who}: only {hit} prefix tokens hit");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapter_the_runner_does_not_serve_is_refused_at_submit() {
    let (h, tok) = engine(4);
    let err = h
        .submit(request(&tok, "Hello", 4, (Some(2), "x")))
        .await
        .expect_err("no third adapter");
    assert!(
        err.to_string().contains("LoRA adapter 2 is not served"),
        "{err}"
    );
    // The engine keeps serving.
    let mut ok = request(&tok, "Hello", 4, (ADAPTER, "x"));
    ok.eos.clear();
    let (tokens, _) = collect(h.submit(ok).await.expect("accepted")).await;
    assert_eq!(tokens.len(), 4);
}
