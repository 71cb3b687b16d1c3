//! Pipeline parallelism on the real SmolLM2-135M-Instruct Q4_1 (issue #15): stages
//! chained in one process, and `pipeline: 2` groups of two ranks (threads) over
//! loopback TCP, against the single process. Each stage runs the single process's
//! arithmetic for its layers and hidden states travel as exact f32 bits, so the
//! logits must be bit-identical, not merely close. Failures are asserted by whom they
//! blame; timeouts only bound a broken build.

use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;

use slipway_engine::backend::cpu::{CpuBackend, StageInput, StageOutput};
use slipway_engine::backend::{BackendError, Batch, LogitsWanted, ModelRunner};
use slipway_engine::generate::score;
use slipway_engine::kv::BlockAllocator;
use slipway_engine::model::llama::{LlamaWeights, ModelPart};
use slipway_engine::parallel::step::StepFrame;
use slipway_engine::parallel::transport::FrameKind;
use slipway_engine::parallel::{
    PipelineError, StageRunner, TcpTransport, Transport, TransportError, run_worker,
};
use slipway_engine::sampling::{SamplingParams, SeqSampling, argmax};
use slipway_engine::testing::oracle;
use slipway_engine::tokenizer::Tokenizer;

#[path = "support/agreement.rs"]
mod agreement;
#[path = "support/parallel.rs"]
#[allow(dead_code)]
mod parallel;

use parallel::*;

#[test]
fn stages_chained_in_one_process_equal_the_whole_model() {
    let parts = [0..10, 10..20, 20..30].map(|layers| ModelPart {
        embeds: layers.start == 0,
        head: layers.end == 30,
        shard: None,
        layers,
    });
    let mut stages: Vec<CpuBackend> = parts
        .iter()
        .map(|part| {
            let weights = LlamaWeights::from_gguf_part(file(), part).expect("stage weights");
            assert_eq!(weights.layers.len(), 10);
            assert_eq!(weights.embed.is_some(), part.embeds);
            assert_eq!(weights.head.is_some(), part.head);
            CpuBackend::new(Arc::new(weights), &cpu_config()).expect("stage backend")
        })
        .collect();
    let oracle = oracle();
    let prompt = &oracle.prompts[0].prompt_tokens;
    let table: Vec<u32> = (0..(prompt.len() + 2).div_ceil(16) as u32).collect();
    // A prefill then a decode step, so the second step reads each stage's own KV.
    let steps = [
        Batch {
            seqs: vec![chunk(prompt, 0, &table, LogitsWanted::All)],
        },
        Batch {
            seqs: vec![chunk(&[1], prompt.len(), &table, LogitsWanted::Last)],
        },
    ];
    let mut whole = single();
    for batch in &steps {
        let want = whole.forward(batch).expect("whole model");
        let mut hidden = Vec::new();
        let mut got = None;
        for (i, stage) in stages.iter_mut().enumerate() {
            let input = if i == 0 {
                StageInput::Tokens
            } else {
                StageInput::Hidden(&mut hidden)
            };
            match stage.forward_stage(batch, input).expect("stage step") {
                StageOutput::Hidden(x) => hidden = x.to_vec(),
                StageOutput::Logits(l) => got = Some(l),
            }
        }
        let got = got.expect("the last stage returns logits");
        assert_eq!(max_delta(&got, &want), 0.0, "chained stages differ");
    }
    // Each stage refuses the other stages' inputs, and whole passes.
    let batch = &steps[1];
    let err = stages[1]
        .forward_stage(batch, StageInput::Tokens)
        .expect_err("tokens into a middle stage");
    assert!(matches!(err, BackendError::Stage(_)), "{err}");
    let err = stages[0]
        .forward_stage(batch, StageInput::Hidden(&mut vec![0.0; 576]))
        .expect_err("hidden states into the first stage");
    assert!(matches!(err, BackendError::Stage(_)), "{err}");
    let err = stages[2]
        .forward_stage(batch, StageInput::Hidden(&mut vec![0.0; 5]))
        .expect_err("hidden states of the wrong size");
    assert!(err.to_string().contains("5 hidden-state floats"), "{err}");
    let err = stages[2]
        .forward(batch)
        .expect_err("a whole pass on a stage");
    assert!(err.to_string().contains("layers 20..30"), "{err}");
}

#[test]
fn pipeline_2_teacher_forced_logits_equal_the_single_process() {
    let want = {
        let mut whole = single();
        teacher_forced_logits(&mut *whole, &mut BlockAllocator::new(BLOCKS))
    };
    let (mut runner, workers) = group(1, 2);
    let got = teacher_forced_logits(&mut runner, &mut BlockAllocator::new(BLOCKS));
    let (mut positions, mut max) = (0, 0f32);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        max = max.max(max_delta(g, w));
        for (r, (a, b)) in g.rows_of(0).zip(w.rows_of(0)).enumerate() {
            assert_eq!(argmax(a), argmax(b), "conversation {i} position {r}: top-1");
            positions += 1;
        }
    }
    println!("pipeline 2: {positions} positions, same top-1 on all, max |Δlogit| = {max}");
    assert_eq!(
        max, 0.0,
        "pipeline 2 logits differ from the single process's"
    );
    // And the oracle's own bar, through the pipeline.
    let oracle = oracle();
    let tokenizer = Tokenizer::from_metadata(file().metadata()).expect("tokenizer");
    let mut alloc = BlockAllocator::new(BLOCKS);
    agreement::assert_agrees("pipeline 2", &oracle, &tokenizer, |tokens| {
        score(&mut runner, &mut alloc, tokens, 1).expect("score")
    });
    finish(runner, workers);
}

#[test]
fn pipeline_2_serves_16_concurrent_sequences_as_the_single_process_does_alone() {
    let prompts = sixteen_prompts();
    let steps = 4;
    let solo: Vec<_> = {
        let mut whole = single();
        prompts
            .iter()
            .map(|p| batched(&mut *whole, std::slice::from_ref(p), steps).remove(0))
            .collect()
    };
    let (mut runner, workers) = group(1, 2);
    let together = batched(&mut runner, &prompts, steps);
    let mut max = 0f32;
    for (i, ((rows, toks), (solo_rows, solo_toks))) in together.iter().zip(&solo).enumerate() {
        assert_eq!(toks, solo_toks, "sequence {i}: greedy tokens differ");
        assert_eq!(rows.len(), solo_rows.len(), "sequence {i}: row count");
        for (a, b) in rows.iter().zip(solo_rows) {
            max = a.iter().zip(b).fold(max, |m, (x, y)| m.max((x - y).abs()));
        }
    }
    println!("pipeline 2, 16 sequences batched vs alone: max |Δlogit| = {max}");
    assert_eq!(max, 0.0, "batched pipeline logits differ from solo runs");
    finish(runner, workers);
}

#[test]
fn pipeline_2_samples_on_its_last_stage_as_the_single_process_does() {
    let oracle = oracle();
    let prompts: Vec<&[u32]> = oracle
        .prompts
        .iter()
        .take(4)
        .map(|p| p.prompt_tokens.as_slice())
        .collect();
    // Greedy with a log-probability; seeded temperature, top-k and top-p with a
    // fresh draw each step; greedy under every penalty (reading the history); and a
    // sequence that samples nothing.
    let sampling = |step: usize, history: &[Vec<u32>]| -> Vec<Option<SeqSampling>> {
        let base = |params: SamplingParams, uniform, history: Vec<u32>, logprob| SeqSampling {
            params,
            uniform,
            history,
            stop_tokens: vec![2],
            logprob,
        };
        vec![
            Some(base(SamplingParams::default(), None, Vec::new(), true)),
            Some(base(
                SamplingParams {
                    temperature: 0.8,
                    top_k: 40,
                    top_p: 0.95,
                    seed: 7,
                    ..SamplingParams::default()
                },
                Some((0.11 + 0.37 * step as f64).fract()),
                Vec::new(),
                false,
            )),
            Some(base(
                SamplingParams {
                    repetition_penalty: 1.3,
                    frequency_penalty: 0.4,
                    presence_penalty: 0.2,
                    ..SamplingParams::default()
                },
                None,
                history[2].clone(),
                true,
            )),
            None,
        ]
    };
    let mut whole = single();
    let (mut runner, workers) = group(1, 2);
    let mut alloc = BlockAllocator::new(BLOCKS);
    let steps = 6;
    let tables: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            let mut t = Vec::new();
            alloc.ensure(&mut t, p.len() + steps, 16).expect("blocks");
            t
        })
        .collect();
    let mut history: Vec<Vec<u32>> = prompts.iter().map(|p| p.to_vec()).collect();
    let mut sampled = 0;
    for step in 0..steps {
        let batch = Batch {
            seqs: (0..prompts.len())
                .map(|i| {
                    let (tokens, start) = if step == 0 {
                        (prompts[i].to_vec(), 0)
                    } else {
                        (
                            vec![*history[i].last().expect("a token")],
                            history[i].len() - 1,
                        )
                    };
                    chunk(&tokens, start, &tables[i], LogitsWanted::Last)
                })
                .collect(),
        };
        let sampling = sampling(step, &history);
        let want = whole.execute(&batch, &sampling).expect("single process");
        let got = runner.execute(&batch, &sampling).expect("pipeline 2");
        assert_eq!(got, want, "step {step}: sampled otherwise");
        for (i, s) in want.sampled.iter().enumerate() {
            // The sequence that samples nothing is fed a fixed token.
            history[i].push(s.map_or(1, |s| s.token));
            sampled += usize::from(s.is_some());
        }
    }
    println!("pipeline 2 sampled {sampled} tokens on its last stage, all as the single process");
    finish(runner, workers);
}

#[test]
fn a_decode_step_of_16_streams_sends_hidden_states_down_and_only_tokens_back() {
    let (leader_sent, worker_sent) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let (l, w) = (Arc::clone(&leader_sent), Arc::clone(&worker_sent));
    let (mut runner, workers) = group_with(
        (1, 2),
        LONG,
        |inner| Counting { inner, sent: l },
        move |inner| Counting {
            inner,
            sent: Arc::clone(&w),
        },
    );
    let (decode, sampling) = sixteen_streams_prefilled(&mut runner);
    let streams = decode.seqs.len();
    let (l0, w0) = (
        leader_sent.load(Ordering::Relaxed),
        worker_sent.load(Ordering::Relaxed),
    );
    runner.execute(&decode, &sampling).expect("decode");
    let leader_bytes = leader_sent.load(Ordering::Relaxed) - l0;
    let worker_bytes = worker_sent.load(Ordering::Relaxed) - w0;
    let hidden = (streams * 576 * 4) as u64;
    println!(
        "decode step of {streams} streams, payload bytes sent: rank 0 {leader_bytes} \
({hidden} of hidden states, {} of step description), rank 1 {worker_bytes}",
        leader_bytes - hidden
    );
    // Rank 1 sends the count and 11 bytes per stream: no logits row.
    assert_eq!(worker_bytes, 4 + 11 * streams as u64);
    assert!(leader_bytes > hidden && leader_bytes < hidden + 100 * streams as u64);
    finish(runner, workers);
}

#[test]
fn a_worker_dying_mid_step_fails_the_leaders_step_naming_it() {
    let (mut runner, mut workers) = group_with(
        (1, 2),
        LONG,
        |t| t,
        |t| DiesMidStep {
            inner: Some(t),
            batches: 2,
        },
    );
    let mut alloc = BlockAllocator::new(BLOCKS);
    let prompt = &oracle().prompts[0].prompt_tokens;
    let mut table = Vec::new();
    alloc
        .ensure(&mut table, prompt.len() + 1, 16)
        .expect("blocks");
    let prefill = Batch {
        seqs: vec![chunk(prompt, 0, &table, LogitsWanted::Last)],
    };
    let failures = runner.failures();
    runner.forward(&prefill).expect("step 1 runs");
    assert_eq!(*failures.borrow(), None);
    let decode = Batch {
        seqs: vec![chunk(&[1], prompt.len(), &table, LogitsWanted::Last)],
    };
    let err = runner.forward(&decode).expect_err("rank 1 died in step 2");
    let BackendError::Group(transport) = &err else {
        panic!("not a group error: {err}");
    };
    assert_eq!(transport.blamed(), [1], "{err}");
    assert!(err.to_string().contains("rank 1"), "{err}");
    println!("the leader's step 2 failed with: {err}");
    // The group is done: later steps fail at once with the same error, and whoever
    // watches the group (serving) has been told.
    let again = runner.forward(&decode).expect_err("the group failed");
    assert_eq!(again.to_string(), err.to_string());
    assert_eq!(
        failures.borrow().as_deref(),
        Some(transport.to_string().as_str())
    );
    let worker = workers.remove(0).join().expect("the worker's thread");
    let err = worker.expect_err("the worker lost its links");
    assert!(err.to_string().contains("test dropped"), "{err}");
}

#[test]
fn the_leader_dying_mid_step_ends_the_workers_loop_naming_rank_0() {
    let group = layout(1, 2);
    let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port");
    let leader = listener.local_addr().expect("its address").to_string();
    let config = tcp_config(1, 2, &leader, LONG);
    let worker = thread::spawn(move || {
        let mut stage = StageRunner::load(file(), &group, 1, &cpu_config())?;
        run_worker(TcpTransport::join(&config)?, &mut stage)
    });
    // A bare leader: it describes step 1, then goes away before its hidden states.
    let mut transport =
        TcpTransport::lead(&listener, &tcp_config(0, 2, &leader, LONG)).expect("rendezvous");
    let batch = Batch {
        seqs: vec![chunk(&[1, 2, 3], 0, &[0], LogitsWanted::Last)],
    };
    let mut frame = Vec::new();
    StepFrame::Run(&batch).encode(&mut frame).expect("encode");
    transport
        .send_bytes(1, 1, FrameKind::Batch, &frame)
        .expect("send the step");
    drop(transport);
    let err = worker
        .join()
        .expect("the worker's thread")
        .expect_err("the leader is gone");
    assert_eq!(err.blamed(), [0], "{err}");
    assert!(
        matches!(
            err,
            PipelineError::Transport(TransportError::PeerClosed { rank: 0, .. })
        ),
        "{err}"
    );
}
