//! Actor tests with a fake runner whose logits depend on the whole context, read
//! back through its own paged store (so a wrong block table changes the output).

use std::collections::HashMap;

use super::*;
use crate::backend::{BackendError, Batch, KvGeometry, Logits};
use crate::model::llama::LlamaConfig;
use crate::serving::block_manager::{BlockConfigError, BlockManagerConfig};

const VOCAB: usize = 64;
const EOS: u32 = 1;

struct FakeRunner {
    config: LlamaConfig,
    geometry: KvGeometry,
    kv: HashMap<(u32, usize), u32>,
    /// Every step fails, as a broken forward pass would.
    broken: bool,
}

impl FakeRunner {
    fn new(num_blocks: usize) -> Self {
        Self {
            config: LlamaConfig {
                vocab: VOCAB,
                ..LlamaConfig::default()
            },
            geometry: KvGeometry {
                block_size: 4,
                num_blocks,
            },
            kv: HashMap::new(),
            broken: false,
        }
    }
}

impl ModelRunner for FakeRunner {
    fn config(&self) -> &LlamaConfig {
        &self.config
    }

    fn kv_geometry(&self) -> KvGeometry {
        self.geometry
    }

    fn forward(&mut self, batch: &Batch) -> Result<Logits, BackendError> {
        if self.broken {
            return Err(BackendError::InvalidBatch("broken on purpose".into()));
        }
        let bs = self.geometry.block_size;
        let mut logits = Logits {
            vocab: VOCAB,
            ..Logits::default()
        };
        for seq in &batch.seqs {
            for (i, &t) in seq.tokens.iter().enumerate() {
                let p = seq.start_pos + i;
                let b = *seq
                    .block_table
                    .get(p / bs)
                    .ok_or_else(|| BackendError::InvalidBatch("short block table".into()))?;
                self.kv.insert((b, p % bs), t);
            }
            let start = logits.data.len() / VOCAB;
            if seq.logits != crate::backend::LogitsWanted::None {
                let end = seq.start_pos + seq.tokens.len();
                let mut h: u64 = 1469598103934665603;
                for p in 0..end {
                    let t = self.kv[&(seq.block_table[p / bs], p % bs)];
                    h = (h ^ u64::from(t)).wrapping_mul(1099511628211);
                }
                let mut row = vec![0f32; VOCAB];
                row[2 + (h % (VOCAB as u64 - 2)) as usize] = 1.0;
                logits.data.extend(row);
            }
            logits.spans.push(start..logits.data.len() / VOCAB);
        }
        Ok(logits)
    }
}

fn config(num_blocks: usize, max_num_seqs: usize) -> EngineConfig {
    EngineConfig {
        scheduler: SchedulerConfig {
            max_num_seqs,
            max_batched_tokens: 32,
            max_model_len: 256,
            blocks: BlockManagerConfig {
                num_blocks,
                block_size: 4,
                enable_prefix_cache: true,
            },
        },
        command_capacity: 16,
        ..EngineConfig::default()
    }
}

fn request(prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        prompt,
        max_tokens,
        sampling: SamplingParams::default(),
        eos: vec![EOS],
        cache_key: CacheKey::default(),
        adapter: None,
    }
}

async fn collect(mut stream: RequestStream) -> (Vec<u32>, Event) {
    let mut tokens = Vec::new();
    while let Some(e) = stream.events.recv().await {
        match e {
            Event::Token(t) => tokens.push(t),
            other => return (tokens, other),
        }
    }
    panic!("stream ended without a final event");
}

async fn solo(prompt: Vec<u32>, max_tokens: usize) -> Vec<u32> {
    let (h, _task) = spawn(Box::new(FakeRunner::new(64)), config(64, 1)).expect("config");
    let s = h
        .submit(request(prompt, max_tokens))
        .await
        .expect("accepted");
    collect(s).await.0
}

#[tokio::test]
async fn concurrent_streams_equal_their_solo_results() {
    // Few blocks, so preemption happens too.
    let (h, _task) = spawn(Box::new(FakeRunner::new(24)), config(24, 6)).expect("config");
    let prompts: Vec<Vec<u32>> = (0..12u32)
        .map(|i| (0..(3 + i * 2)).map(|j| 2 + (i + j) % 7).collect())
        .collect();
    let mut streams = Vec::new();
    for p in &prompts {
        streams.push(h.submit(request(p.clone(), 16)).await.expect("accepted"));
    }
    let tasks: Vec<_> = streams
        .into_iter()
        .map(|s| tokio::spawn(collect(s)))
        .collect();
    for (p, task) in prompts.iter().zip(tasks) {
        let (tokens, end) = task.await.expect("collector");
        assert_eq!(tokens, solo(p.clone(), 16).await);
        assert!(matches!(
            end,
            Event::Finished {
                reason: FinishReason::Length,
                completion_tokens: 16,
                ..
            }
        ));
    }
    let st = h.stats().await.expect("running");
    assert_eq!((st.running, st.waiting, st.free_blocks), (0, 0, 24));
}

#[tokio::test]
async fn disconnect_and_cancel_free_blocks_at_once() {
    let (h, _task) = spawn(Box::new(FakeRunner::new(64)), config(64, 8)).expect("config");
    let mut dropped = h.submit(request(vec![2; 10], 200)).await.expect("accepted");
    assert!(matches!(dropped.events.recv().await, Some(Event::Token(_))));
    drop(dropped);
    let mut cancelled = h.submit(request(vec![3; 10], 200)).await.expect("accepted");
    assert!(matches!(
        cancelled.events.recv().await,
        Some(Event::Token(_))
    ));
    h.cancel(cancelled.id).await.expect("running");
    let (_, end) = collect(cancelled).await;
    assert!(matches!(
        end,
        Event::Finished {
            reason: FinishReason::Cancelled,
            ..
        }
    ));
    // The stats command reaps streams dropped before it was sent.
    let st = h.stats().await.expect("running");
    assert_eq!((st.running, st.waiting), (0, 0));
    assert_eq!(st.free_blocks, 64);
}

#[tokio::test]
async fn rejects_and_shuts_down_cleanly() {
    let (h, task) = spawn(Box::new(FakeRunner::new(8)), config(8, 8)).expect("config");
    let err = h.submit(request(vec![2; 40], 10)).await.unwrap_err();
    assert!(matches!(
        err,
        EngineError::Rejected(AddError::TooManyBlocks { .. })
    ));
    let err = h.submit(request(vec![], 10)).await.unwrap_err();
    assert_eq!(err, EngineError::Rejected(AddError::EmptyPrompt));
    let s = h.submit(request(vec![2; 4], 3)).await.expect("accepted");
    let (tokens, _) = collect(s).await;
    assert_eq!(tokens.len(), 3);
    let h2 = h.clone();
    drop(h);
    drop(h2);
    let runner = task.await.expect("actor ends without panicking");
    assert_eq!(runner.kv_geometry().num_blocks, 8);
}

#[tokio::test]
async fn abort_all_ends_every_request_with_an_error_and_the_engine_keeps_serving() {
    let (h, _task) = spawn(Box::new(FakeRunner::new(64)), config(64, 2)).expect("config");
    // Two running and one waiting, all long.
    let mut streams = Vec::new();
    for i in 0..3u32 {
        streams.push(
            h.submit(request(vec![2 + i; 6], 200))
                .await
                .expect("accepted"),
        );
    }
    assert!(matches!(
        streams[0].events.recv().await,
        Some(Event::Token(_))
    ));
    h.abort_all("shutdown budget over").await.expect("running");
    for s in streams {
        let (_, end) = collect(s).await;
        assert_eq!(
            end,
            Event::Error(RequestError::Aborted("shutdown budget over".into()))
        );
    }
    let st = h.stats().await.expect("running");
    assert_eq!((st.running, st.waiting, st.free_blocks), (0, 0, 64));
    let s = h.submit(request(vec![2; 4], 3)).await.expect("accepted");
    assert_eq!(collect(s).await.0.len(), 3);
}

#[tokio::test]
async fn a_failed_step_ends_its_requests_with_a_backend_error_and_frees_their_blocks() {
    let runner = FakeRunner {
        broken: true,
        ..FakeRunner::new(64)
    };
    let (h, _task) = spawn(Box::new(runner), config(64, 2)).expect("config");
    let s = h.submit(request(vec![2; 6], 20)).await.expect("accepted");
    let (tokens, end) = collect(s).await;
    assert!(tokens.is_empty());
    assert_eq!(
        end,
        Event::Error(RequestError::Backend(
            "invalid batch: broken on purpose".into()
        ))
    );
    let st = h.stats().await.expect("the engine keeps running");
    assert_eq!((st.running, st.waiting, st.free_blocks), (0, 0, 64));
}

#[tokio::test]
async fn requests_still_running_when_the_engine_stops_end_with_shutdown() {
    let (h, task) = spawn(Box::new(FakeRunner::new(64)), config(64, 1)).expect("config");
    let mut running = h.submit(request(vec![2; 6], 200)).await.expect("accepted");
    let waiting = h.submit(request(vec![3; 6], 200)).await.expect("accepted");
    assert!(matches!(running.events.recv().await, Some(Event::Token(_))));
    drop(h);
    for s in [running, waiting] {
        let (_, end) = collect(s).await;
        assert_eq!(end, Event::Error(RequestError::Shutdown));
    }
    task.await.expect("actor ends without panicking");
}

#[tokio::test]
async fn metrics_follow_the_engine() {
    let metrics = Arc::new(ServingMetrics::new("m", "r"));
    let (h, _task) = spawn_with_metrics(
        Box::new(FakeRunner::new(64)),
        config(64, 4),
        Arc::clone(&metrics),
    )
    .expect("config");
    let mut s = h.submit(request(vec![2; 9], 200)).await.expect("accepted");
    assert!(matches!(s.events.recv().await, Some(Event::Token(_))));
    // While it runs it holds KV and counts as running.
    let _ = h.stats().await.expect("running");
    assert_eq!(metrics.running.get(), 1);
    assert!(metrics.kv_usage.get() > 0.0);
    drop(s);
    let _ = h.stats().await.expect("running");
    // The next turn (another request) publishes the freed state.
    let s = h.submit(request(vec![2; 9], 5)).await.expect("accepted");
    assert_eq!(collect(s).await.0.len(), 5);
    let _ = h.stats().await.expect("running");
    assert_eq!(metrics.running.get(), 0);
    assert_eq!(metrics.waiting.get(), 0);
    assert!(metrics.kv_usage.get().abs() < 1e-12);
    assert_eq!(metrics.of(None).prompt_tokens.get(), 18);
    assert!(metrics.of(None).generation_tokens.get() >= 6);
    // The second prompt shares the first's two full 4-token blocks.
    assert_eq!(metrics.prefix_queries.get(), 18);
    assert_eq!(metrics.prefix_hits.get(), 8);
    let text = metrics.prometheus_text();
    assert!(
        text.contains("slipway_request_queue_time_seconds_count{model=\"m\",release=\"r\"} 2"),
        "{text}"
    );
}

#[test]
fn invalid_configs_name_the_bad_value() {
    let mut c = config(64, 1);
    c.scheduler.blocks.block_size = 0;
    let e = c.validate().expect_err("an empty pool");
    assert_eq!(
        e,
        EngineConfigError::Scheduler(SchedulerConfigError::Blocks(BlockConfigError::EmptyPool {
            num_blocks: 64,
            block_size: 0
        }))
    );
    assert_eq!(
        e.to_string(),
        "the KV pool needs at least one block of one position, got 64 blocks of 0"
    );
    let mut c = config(64, 1);
    c.scheduler.max_batched_tokens = 0;
    assert_eq!(
        c.validate(),
        Err(SchedulerConfigError::Zero("max_batched_tokens").into())
    );
    let mut c = config(64, 1);
    c.scheduler.max_model_len = 1;
    assert_eq!(
        c.validate().map_err(|e| e.to_string()),
        Err("max_model_len must be at least 2, got 1".into())
    );
    let mut c = config(64, 1);
    c.command_capacity = 0;
    assert_eq!(c.validate(), Err(EngineConfigError::CommandCapacity));
    assert!(spawn(Box::new(FakeRunner::new(64)), c).is_err());
}
