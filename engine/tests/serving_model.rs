//! The engine actor on the real SmolLM2-135M-Instruct Q4_1 (CPU backend): batching
//! does not change greedy results, and the prefix cache serves a shared prefix only
//! under the same cache key. A missing model fails with instructions (`make model`),
//! never skips.

use slipway_engine::sampling::SamplingParams;
use slipway_engine::serving::block_manager::CacheKey;
use slipway_engine::serving::engine::{EngineHandle, Event, GenerateRequest, RequestStream};
use slipway_engine::tokenizer::Tokenizer;

#[path = "support/real_engine.rs"]
mod real_engine;
use real_engine::{cpu_runner, spawn_engine};

const BLOCKS: usize = 768;

fn engine(max_num_seqs: usize) -> (EngineHandle, Tokenizer) {
    let (runner, tokenizer) = cpu_runner(BLOCKS);
    let handle = spawn_engine(runner, max_num_seqs);
    (handle, tokenizer)
}

fn request(
    tokenizer: &Tokenizer,
    prompt: &str,
    max_tokens: usize,
    salt: Option<&str>,
) -> GenerateRequest {
    GenerateRequest {
        prompt: tokenizer.encode(prompt),
        max_tokens,
        sampling: SamplingParams::default(),
        eos: tokenizer.eog_tokens().to_vec(),
        cache_key: CacheKey {
            namespace: "test".into(),
            adapter: None,
            salt: salt.map(Into::into),
        },
        adapter: None,
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
    (0..32)
        .map(|i| {
            let body: Vec<&str> = (0..(2 + (i * 7) % 40))
                .map(|j| words[(i + j) % words.len()])
                .collect();
            format!("Story {i}: {}. Next,", body.join(" "))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_concurrent_greedy_streams_equal_their_solo_results() {
    let (h, tok) = engine(32);
    let prompts = prompts();
    let mut solo = Vec::new();
    for p in &prompts {
        let s = h
            .submit(request(&tok, p, 12, Some("solo")))
            .await
            .expect("accepted");
        solo.push(collect(s).await.0);
    }
    // Another salt, so the concurrent run computes every prompt again rather than
    // reading the solo runs' KV.
    let mut streams = Vec::new();
    for p in &prompts {
        streams.push(
            h.submit(request(&tok, p, 12, Some("batch")))
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
        assert_eq!(tokens, solo[i], "prompt {i} differs when batched");
    }
    let st = h.stats().await.expect("running");
    assert_eq!((st.running, st.waiting, st.free_blocks), (0, 0, BLOCKS));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_200_token_prefix_hits_the_cache_only_under_the_same_salt() {
    let (h, tok) = engine(4);
    let mut prefix = String::new();
    while tok.encode(&prefix).len() < 200 {
        prefix.push_str("The harbor master counted the boats twice. ");
    }
    let ids = tok.encode(&prefix);
    let prefix_ids = &ids[..200];
    let mut first = request(&tok, "", 4, Some("a"));
    first.prompt = prefix_ids.to_vec();
    first.prompt.extend(tok.encode(" Question one?"));
    let (_, end) = collect(h.submit(first.clone()).await.expect("accepted")).await;
    assert!(
        matches!(
            end,
            Event::Finished {
                cached_tokens: 0,
                ..
            }
        ),
        "{end:?}"
    );

    let mut second = first.clone();
    second.prompt.truncate(200);
    second.prompt.extend(tok.encode(" A different question?"));
    let (_, end) = collect(h.submit(second.clone()).await.expect("accepted")).await;
    let Event::Finished { cached_tokens, .. } = end else {
        panic!("{end:?}");
    };
    assert!(
        cached_tokens >= 192,
        "only {cached_tokens} prefix tokens hit"
    );

    second.cache_key.salt = Some("b".into());
    let (_, end) = collect(h.submit(second.clone()).await.expect("accepted")).await;
    assert!(
        matches!(
            end,
            Event::Finished {
                cached_tokens: 0,
                ..
            }
        ),
        "{end:?}"
    );

    second.cache_key.salt = Some("a".into());
    second.cache_key.namespace = "another-release".into();
    let (_, end) = collect(h.submit(second).await.expect("accepted")).await;
    assert!(
        matches!(
            end,
            Event::Finished {
                cached_tokens: 0,
                ..
            }
        ),
        "{end:?}"
    );
}
