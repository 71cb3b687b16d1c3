//! Scheduler tests with a fake model.
//!
//! The fake model keeps a simulated paged KV store (block → token at each slot) and,
//! for every scheduled chunk, checks that all earlier positions reachable through
//! the chunk's block table hold exactly the sequence's tokens — so a wrong prefix
//! hit, a block shared while written, or a stale table fails the test. Its "next
//! token" is a hash of the whole context, so outputs depend on every token.

use std::collections::HashMap;

use proptest::prelude::*;

use super::*;
use crate::sampling::SampledToken;

const EOS: u32 = 0;

struct FakeModel {
    block_size: usize,
    kv: HashMap<(u32, usize), u32>,
    /// When set, tokens are drawn from 1.. so EOS never comes.
    never_eos: bool,
}

impl FakeModel {
    fn new(block_size: usize) -> Self {
        Self {
            block_size,
            kv: HashMap::new(),
            never_eos: true,
        }
    }

    fn next_token(&self, ctx: &[u32]) -> u32 {
        let mut h: u64 = 1469598103934665603;
        for &t in ctx {
            h = (h ^ u64::from(t)).wrapping_mul(1099511628211);
        }
        let t = (h % 50) as u32;
        if self.never_eos { t + 1 } else { t }
    }

    /// Runs a step: checks and writes the KV, samples from the full context.
    fn run(&mut self, s: &Scheduler, out: &SchedulerOutput) -> ModelOutput {
        let bs = self.block_size;
        let sampled = out
            .seqs
            .iter()
            .map(|seq| {
                let prompt = s.reqs[&seq.id].req.prompt.clone();
                let mut ctx = prompt;
                ctx.extend(s.output_of(seq.id).unwrap_or_default());
                for (p, want) in ctx.iter().enumerate().take(seq.start_pos) {
                    let b = seq.block_table[p / bs];
                    assert_eq!(
                        self.kv.get(&(b, p % bs)),
                        Some(want),
                        "request {} reads a wrong KV entry at position {p}",
                        seq.id
                    );
                }
                for (i, &t) in seq.tokens.iter().enumerate() {
                    let p = seq.start_pos + i;
                    assert_eq!(t, ctx[p], "scheduled token differs from the sequence");
                    let b = seq.block_table[p / bs];
                    self.kv.insert((b, p % bs), t);
                }
                seq.samples.then(|| {
                    let token = self.next_token(&ctx);
                    SampledToken {
                        token,
                        stop: token == EOS,
                        logprob: None,
                    }
                })
            })
            .collect();
        ModelOutput { sampled }
    }
}

fn config(num_blocks: usize, max_num_seqs: usize, budget: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs,
        max_batched_tokens: budget,
        max_model_len: 1024,
        blocks: BlockManagerConfig {
            num_blocks,
            block_size: 4,
            enable_prefix_cache: true,
        },
    }
}

fn req(id: RequestId, prompt: Vec<u32>, max_tokens: usize) -> SchedRequest {
    SchedRequest {
        id,
        prompt,
        max_tokens,
        cache_key: CacheKey::default(),
        adapter: None,
    }
}

/// Runs until idle; returns each request's tokens and finish reason.
fn run_all(
    s: &mut Scheduler,
    model: &mut FakeModel,
    max_steps: usize,
) -> HashMap<RequestId, (Vec<u32>, FinishReason)> {
    let mut done = HashMap::new();
    let mut tokens: HashMap<RequestId, Vec<u32>> = HashMap::new();
    for _ in 0..max_steps {
        if s.is_idle() {
            return done;
        }
        let out = s.schedule();
        assert!(out.batch().num_tokens() <= s.config().max_batched_tokens);
        let m = model.run(s, &out);
        for o in s.update(&out, &m) {
            // A preempted request's tokens are kept, so its stream continues.
            tokens.entry(o.id).or_default().extend(o.token);
            if let Some(r) = o.finished {
                done.insert(o.id, (tokens.remove(&o.id).unwrap_or_default(), r));
            }
        }
        s.check_invariants().expect("invariants");
    }
    panic!("not idle after {max_steps} steps");
}

fn solo(prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let mut s = Scheduler::new(config(64, 1, 8)).expect("config");
    s.add(req(1, prompt.to_vec(), max_tokens)).expect("add");
    run_all(&mut s, &mut FakeModel::new(4), 10_000)
        .remove(&1)
        .expect("finished")
        .0
}

#[test]
fn decodes_go_first_and_prefill_is_chunked() {
    let mut s = Scheduler::new(config(64, 8, 6)).expect("config");
    let mut model = FakeModel::new(4);
    s.add(req(1, vec![1, 2, 3], 10)).expect("add");
    let out = s.schedule();
    assert_eq!(out.seqs.len(), 1);
    assert!(out.seqs[0].samples);
    let m = model.run(&s, &out);
    s.update(&out, &m);
    s.add(req(2, (1..=12).collect(), 10)).expect("add");
    let out = s.schedule();
    // Request 1 decodes one token, request 2 prefills 5 of its 12 with the rest.
    assert_eq!(out.seqs[0].id, 1);
    assert_eq!(out.seqs[0].tokens.len(), 1);
    assert_eq!(out.seqs[1].id, 2);
    assert_eq!(out.seqs[1].tokens, vec![1, 2, 3, 4, 5]);
    assert!(!out.seqs[1].samples);
    assert_eq!(out.batch().seqs[1].logits, LogitsWanted::None);
    let m = model.run(&s, &out);
    let r = s.update(&out, &m);
    assert_eq!(r.len(), 1, "only the decode produced a token");
    let out = s.schedule();
    assert_eq!(out.seqs[1].start_pos, 5);
    assert_eq!(out.seqs[1].tokens.len(), 5);
}

#[test]
fn running_cap_and_fcfs_order() {
    let mut s = Scheduler::new(config(64, 2, 100)).expect("config");
    for id in 1..=3 {
        s.add(req(id, vec![id as u32; 3], 5)).expect("add");
    }
    let out = s.schedule();
    let ids: Vec<_> = out.seqs.iter().map(|q| q.id).collect();
    assert_eq!(ids, vec![1, 2]);
    assert_eq!(s.num_waiting(), 1);
}

#[test]
fn head_of_queue_that_does_not_fit_blocks_the_rest() {
    // 4 blocks of 4: request 1 takes 3 blocks, request 2 needs 2, request 3 one.
    let mut s = Scheduler::new(config(4, 8, 100)).expect("config");
    s.add(req(1, vec![1; 12], 1)).expect("add");
    s.add(req(2, vec![2; 8], 1)).expect("add");
    s.add(req(3, vec![3; 2], 1)).expect("add");
    let out = s.schedule();
    let ids: Vec<_> = out.seqs.iter().map(|q| q.id).collect();
    assert_eq!(ids, vec![1], "3 must not overtake 2");
}

#[test]
fn finishes_on_eos_max_tokens_and_cancel() {
    let mut model = FakeModel::new(4);
    model.never_eos = false;
    // Find a prompt whose first generated token is EOS.
    let eos_prompt = (0..1000u32)
        .map(|i| vec![i, i + 1])
        .find(|p| model.next_token(p) == EOS)
        .expect("some prompt leads to EOS");
    let mut s = Scheduler::new(config(64, 8, 100)).expect("config");
    s.add(req(1, eos_prompt, 10)).expect("add");
    s.add(req(2, vec![7, 7, 7, 7, 7, 7], 3)).expect("add");
    s.add(req(3, vec![9; 5], 100)).expect("add");
    let out = s.schedule();
    let m = model.run(&s, &out);
    let r = s.update(&out, &m);
    assert_eq!(r[0].finished, Some(FinishReason::Stop));
    assert!(s.finish(3), "cancel a running request");
    assert!(!s.contains(3));
    s.check_invariants().expect("invariants");
    let first = r.iter().find(|o| o.id == 2).and_then(|o| o.token);
    let done = run_all(&mut s, &mut model, 100);
    let (rest, reason) = &done[&2];
    let toks: Vec<u32> = first.into_iter().chain(rest.iter().copied()).collect();
    if !toks.contains(&EOS) {
        assert_eq!((toks.len(), *reason), (3, FinishReason::Length));
    }
    assert_eq!(s.blocks().num_free(), 64, "every block is back");
}

#[test]
fn context_length_ends_generation() {
    let mut c = config(64, 8, 100);
    c.max_model_len = 8;
    let mut s = Scheduler::new(c).expect("config");
    assert!(matches!(
        s.add(req(9, vec![1; 8], 1)),
        Err(AddError::TooLong { .. })
    ));
    s.add(req(1, vec![1; 5], 100)).expect("add");
    let done = run_all(&mut s, &mut FakeModel::new(4), 100);
    assert_eq!(done[&1].0.len(), 3);
    assert_eq!(done[&1].1, FinishReason::Length);
}

#[test]
fn rejects_what_can_never_run() {
    let mut s = Scheduler::new(config(4, 8, 100)).expect("config");
    assert_eq!(s.add(req(1, vec![], 5)), Err(AddError::EmptyPrompt));
    assert_eq!(s.add(req(1, vec![1], 0)), Err(AddError::ZeroMaxTokens));
    assert!(matches!(
        s.add(req(1, vec![1; 10], 10)),
        Err(AddError::TooManyBlocks { need: 5, total: 4 })
    ));
    s.add(req(1, vec![1], 1)).expect("add");
    assert_eq!(s.add(req(1, vec![1], 1)), Err(AddError::DuplicateId(1)));
}

#[test]
fn preempts_the_newest_and_recomputes_to_the_same_result() {
    // 6 blocks of 4; two requests of 6 prompt + 12 output need 5 blocks each.
    let mut s = Scheduler::new(config(6, 8, 100)).expect("config");
    let p1 = vec![1, 2, 3, 4, 5, 6];
    let p2 = vec![6, 5, 4, 3, 2, 1];
    s.add(req(1, p1.clone(), 12)).expect("add");
    s.add(req(2, p2.clone(), 12)).expect("add");
    let mut model = FakeModel::new(4);
    let mut saw_preemption = false;
    let mut done = HashMap::new();
    let mut toks: HashMap<RequestId, Vec<u32>> = HashMap::new();
    while !s.is_idle() {
        let out = s.schedule();
        if !out.preempted.is_empty() {
            assert_eq!(out.preempted, vec![2], "the newest is preempted");
            saw_preemption = true;
        }
        let m = model.run(&s, &out);
        for o in s.update(&out, &m) {
            toks.entry(o.id).or_default().extend(o.token);
            if o.finished.is_some() {
                done.insert(o.id, toks.remove(&o.id).unwrap_or_default());
            }
        }
        s.check_invariants().expect("invariants");
    }
    assert!(saw_preemption);
    assert_eq!(done[&1], solo(&p1, 12));
    assert_eq!(done[&2], solo(&p2, 12));
}

#[test]
fn shared_prefix_is_served_from_the_cache() {
    let mut s = Scheduler::new(config(64, 8, 100)).expect("config");
    let mut model = FakeModel::new(4);
    let prefix: Vec<u32> = (1..=17).collect();
    s.add(req(1, prefix.clone(), 2)).expect("add");
    run_all(&mut s, &mut model, 100);
    let mut p2 = prefix.clone();
    p2.extend([40, 41]);
    s.add(req(2, p2.clone(), 2)).expect("add");
    let out = s.schedule();
    assert_eq!(out.seqs[0].start_pos, 16, "four full blocks hit");
    let m = model.run(&s, &out);
    let r = s.update(&out, &m);
    assert_eq!(r[0].cached_tokens, 16);
    // Another salt: no hit.
    let mut other = req(3, p2, 2);
    other.cache_key.salt = Some("tenant-b".into());
    s.finish(2);
    s.add(other).expect("add");
    let out = s.schedule();
    assert_eq!(out.seqs[0].start_pos, 0);
    let stats = s.blocks().prefix_stats();
    assert_eq!(stats.hits, 16);
    assert_eq!(stats.queries, 17 + 19 + 19);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Any mix of requests, under any budget and pool size that can hold each
    /// request alone, completes with exactly the tokens each produces alone.
    #[test]
    fn batching_and_preemption_do_not_change_results(
        prompts in prop::collection::vec((prop::collection::vec(1u32..4, 1..20), 1usize..12), 1..10),
        num_blocks in 8usize..24,
        max_num_seqs in 1usize..6,
        budget in 1usize..24,
        cancel in prop::option::of(0usize..10),
    ) {
        let mut s = Scheduler::new(config(num_blocks, max_num_seqs, budget)).expect("config");
        let mut model = FakeModel::new(4);
        for (i, (p, n)) in prompts.iter().enumerate() {
            s.add(req(i as RequestId, p.clone(), *n)).expect("fits alone");
        }
        let cancelled = cancel.filter(|&c| c < prompts.len()).map(|c| c as RequestId);
        if let Some(c) = cancelled {
            prop_assert!(s.finish(c));
        }
        let done = run_all(&mut s, &mut model, 100_000);
        prop_assert_eq!(s.blocks().num_free(), num_blocks);
        for (i, (p, n)) in prompts.iter().enumerate() {
            let id = i as RequestId;
            if Some(id) == cancelled {
                prop_assert!(!done.contains_key(&id));
                continue;
            }
            let (toks, reason) = &done[&id];
            prop_assert_eq!(toks, &solo(p, *n));
            prop_assert_eq!(*reason, FinishReason::Length);
        }
    }
}
