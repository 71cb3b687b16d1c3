//! Throughput measurements of a [`ModelRunner`] in the shapes llama.cpp's
//! `llama-bench` and `llama-batched-bench` use, so `make bench-model` can print
//! ratios against them measured in the same run. Timing only; nothing here asserts
//! on speed.
//!
//! - prompt processing: one `prompt_tokens`-token prompt in a single step (pp512);
//! - single-stream decode: `gen_tokens` steps of one token from an empty context
//!   (tg128); both after one untimed step of each, as llama-bench warms up;
//! - aggregate decode: `parallel` sequences each prefilled with `batch_prompt`
//!   tokens (untimed), then `gen_tokens` steps of one token per sequence, timed as
//!   total generated tokens / time (batched-bench's S_TG).
//!
//! [`TokenMacs`] and [`weight_bytes_per_token`] are the work per token that turns
//! these rates into fractions of the machine's ceilings (see
//! [`crate::kernels::peak`]): multiply-adds for the compute-bound shapes, bytes of
//! weights streamed for single-stream decode.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::backend::{Batch, LogitsWanted, ModelOutput, ModelRunner, SeqChunk};
use crate::generate::GenerateError;
use crate::kv::BlockAllocator;
use crate::model::llama::LlamaConfig;
use crate::sampling::{SamplingParams, SeqSampling};

/// What to measure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BenchConfig {
    /// Prompt length for prompt processing.
    pub prompt_tokens: usize,
    /// Decode steps per measurement.
    pub gen_tokens: usize,
    /// Prompt length per sequence before the aggregate decode.
    pub batch_prompt: usize,
    /// Concurrent sequences for aggregate decode.
    pub parallel: Vec<usize>,
    /// Repetitions of every test: the prompt and single-stream tests, and each
    /// aggregate decode, prefill included. Each rate reported is the tokens of all
    /// repetitions over their total time (llama-bench averages its repetitions too).
    pub repetitions: usize,
}

impl Default for BenchConfig {
    fn default() -> Self {
        Self {
            prompt_tokens: 512,
            gen_tokens: 128,
            batch_prompt: 128,
            parallel: vec![16, 64],
            repetitions: 3,
        }
    }
}

impl BenchConfig {
    /// Checks the values.
    ///
    /// # Errors
    /// [`BenchConfigError::Zero`] naming the first size that is 0.
    pub fn validate(&self) -> Result<(), BenchConfigError> {
        for (field, value) in [
            ("prompt_tokens", self.prompt_tokens),
            ("gen_tokens", self.gen_tokens),
            ("batch_prompt", self.batch_prompt),
            ("repetitions", self.repetitions),
        ] {
            if value == 0 {
                return Err(BenchConfigError::Zero(field));
            }
        }
        Ok(())
    }

    /// KV blocks the runs need at once.
    #[must_use]
    pub fn blocks_needed(&self, block_size: usize) -> usize {
        let per_seq = (self.batch_prompt + self.gen_tokens).div_ceil(block_size);
        let most = self.parallel.iter().copied().max().unwrap_or(1);
        (most * per_seq).max((self.prompt_tokens + self.gen_tokens).div_ceil(block_size))
    }
}

/// A bad [`BenchConfig`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BenchConfigError {
    /// A size (the field named) is 0.
    #[error("every size must be positive; {0} is 0")]
    Zero(&'static str),
}

/// Measured tokens per second.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchReport {
    /// Prompt processing.
    pub prompt_tps: f64,
    /// Single-stream decode.
    pub decode_tps: f64,
    /// `(parallel, aggregate decode tokens/s)`.
    pub aggregate_tps: Vec<(usize, f64)>,
    /// `(parallel, bytes each counter advanced per aggregate decode step)`: with a
    /// parallel group's counters ([`crate::parallel::loopback::Counting`]), what each
    /// rank sends per step; empty lists without counters.
    pub bytes_per_decode_step: Vec<(usize, Vec<f64>)>,
}

/// Token ids for synthetic prompts (fixed, spread over the vocabulary).
fn synthetic(n: usize, salt: usize, vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((i * 7919 + salt * 104_729 + 17) % vocab) as u32)
        .collect()
}

/// Greedy sampling for `n` sequences: steps run as serving runs them
/// ([`ModelRunner::execute`]), sampling beside the forward pass, so a parallel group
/// sends the leader tokens, not logits rows.
fn greedy(n: usize) -> Vec<Option<SeqSampling>> {
    let one = SeqSampling {
        params: SamplingParams::default(),
        uniform: None,
        history: Vec::new(),
        stop_tokens: Vec::new(),
        logprob: false,
    };
    vec![Some(one); n]
}

/// `tokens` of one sequence from position `start_pos`, its blocks `table`; logits of
/// the last.
fn chunk(tokens: Vec<u32>, start_pos: usize, table: &[u32]) -> SeqChunk {
    SeqChunk {
        tokens,
        start_pos,
        block_table: table.to_vec(),
        logits: LogitsWanted::Last,
        adapter: None,
    }
}

/// The token sequence `i` sampled (0 if it sampled none, which greedy steps never do).
fn token(out: &ModelOutput, i: usize) -> u32 {
    out.sampled.get(i).copied().flatten().map_or(0, |s| s.token)
}

/// Runs all measurements. `sent` are byte counters (one per rank of a parallel group,
/// none for a single process), read around each aggregate decode.
///
/// # Errors
/// Too few KV blocks or a backend error.
pub fn run(
    runner: &mut dyn ModelRunner,
    config: &BenchConfig,
    sent: &[Arc<AtomicU64>],
) -> Result<BenchReport, GenerateError> {
    let read = || -> Vec<u64> { sent.iter().map(|c| c.load(Ordering::Relaxed)).collect() };
    let geo = runner.kv_geometry();
    let vocab = runner.config().vocab;
    let mut alloc = BlockAllocator::new(geo.num_blocks);

    let mut table = Vec::new();
    alloc.ensure(
        &mut table,
        config.prompt_tokens.max(config.gen_tokens),
        geo.block_size,
    )?;
    // One untimed prompt and decode step first, as llama-bench warms up by default:
    // the first step pays for faulting in the KV blocks and scratch buffers the timed
    // ones reuse (about a second per GiB on our VMs), which llama.cpp pays at start.
    let warm_up = synthetic(config.prompt_tokens, config.repetitions, vocab);
    runner.execute(
        &Batch {
            seqs: vec![chunk(warm_up, 0, &table)],
        },
        &greedy(1),
    )?;
    let warm_up = synthetic(1, config.repetitions, vocab);
    runner.execute(
        &Batch {
            seqs: vec![chunk(warm_up, 0, &table)],
        },
        &greedy(1),
    )?;
    let (mut prompt_s, mut decode_s) = (0f64, 0f64);
    for rep in 0..config.repetitions {
        let prompt = synthetic(config.prompt_tokens, rep, vocab);
        let t = Instant::now();
        runner.execute(
            &Batch {
                seqs: vec![chunk(prompt, 0, &table)],
            },
            &greedy(1),
        )?;
        prompt_s += t.elapsed().as_secs_f64();

        let mut tok = synthetic(1, rep, vocab)[0];
        let t = Instant::now();
        for pos in 0..config.gen_tokens {
            let out = runner.execute(
                &Batch {
                    seqs: vec![chunk(vec![tok], pos, &table)],
                },
                &greedy(1),
            )?;
            tok = token(&out, 0);
        }
        decode_s += t.elapsed().as_secs_f64();
        tracing::info!(rep, prompt_s, decode_s, "bench repetition");
    }
    let reps = config.repetitions as f64;
    let prompt_tps = reps * config.prompt_tokens as f64 / prompt_s;
    let decode_tps = reps * config.gen_tokens as f64 / decode_s;
    alloc.release(&table)?;

    let mut aggregate_tps = Vec::new();
    let mut bytes_per_decode_step = Vec::new();
    for &np in &config.parallel {
        let (mut decode_s, mut sent_bytes) = (0f64, vec![0u64; sent.len()]);
        for rep in 0..config.repetitions {
            let before = read();
            decode_s += aggregate_decode(runner, config, &mut alloc, (np, rep))?;
            for ((total, after), before) in sent_bytes.iter_mut().zip(read()).zip(&before) {
                *total += after - before;
            }
        }
        let steps = (config.repetitions * config.gen_tokens) as f64;
        let tps = np as f64 * steps / decode_s;
        tracing::info!(parallel = np, tps, "aggregate decode");
        aggregate_tps.push((np, tps));
        bytes_per_decode_step.push((np, sent_bytes.iter().map(|&b| b as f64 / steps).collect()));
    }
    Ok(BenchReport {
        prompt_tps,
        decode_tps,
        aggregate_tps,
        bytes_per_decode_step,
    })
}

/// One repetition of the aggregate decode of `np` sequences: prefills them (untimed),
/// then times `gen_tokens` steps of one token each; returns the seconds those took.
fn aggregate_decode(
    runner: &mut dyn ModelRunner,
    config: &BenchConfig,
    alloc: &mut BlockAllocator,
    (np, rep): (usize, usize),
) -> Result<f64, GenerateError> {
    let vocab = runner.config().vocab;
    let mut tables = Vec::with_capacity(np);
    for _ in 0..np {
        let mut t = Vec::new();
        alloc.ensure(
            &mut t,
            config.batch_prompt + config.gen_tokens,
            runner.kv_geometry().block_size,
        )?;
        tables.push(t);
    }
    let mut next = vec![0u32; np];
    // Prefill in steps of at most 512 tokens, as llama-batched-bench's ubatch; each
    // repetition's prompts differ.
    let per_step = (512 / config.batch_prompt).max(1);
    for group in (0..np).collect::<Vec<_>>().chunks(per_step) {
        let seqs = group
            .iter()
            .map(|&i| {
                let prompt = synthetic(config.batch_prompt, 100 + rep * np + i, vocab);
                chunk(prompt, 0, &tables[i])
            })
            .collect();
        let out = runner.execute(&Batch { seqs }, &greedy(group.len()))?;
        for (k, &i) in group.iter().enumerate() {
            next[i] = token(&out, k);
        }
    }
    let t = Instant::now();
    for step in 0..config.gen_tokens {
        let seqs = (0..np)
            .map(|i| chunk(vec![next[i]], config.batch_prompt + step, &tables[i]))
            .collect();
        let out = runner.execute(&Batch { seqs }, &greedy(np))?;
        for (i, n) in next.iter_mut().enumerate() {
            *n = token(&out, i);
        }
    }
    let seconds = t.elapsed().as_secs_f64();
    for t in &tables {
        alloc.release(t)?;
    }
    Ok(seconds)
}

/// Weight multiply-adds one token costs, from the model's shapes: the int8 matrix
/// products only (attention's scores and weighted sums, which grow with the context
/// and run in f32, are not counted).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenMacs {
    /// Q, K, V, output, gate, up and down projections of every layer.
    pub layers: u64,
    /// The output head (vocabulary × embedding), paid only by tokens whose logits are
    /// computed.
    pub head: u64,
}

impl TokenMacs {
    /// Counts them for `c`.
    #[must_use]
    pub fn of(c: &LlamaConfig) -> Self {
        let [dim, q, kv, ffn, vocab] = [
            c.dim,
            c.n_heads * c.head_dim,
            c.n_kv_heads * c.head_dim,
            c.ffn_dim,
            c.vocab,
        ]
        .map(|n| n as u64);
        let attention = dim * (q + 2 * kv) + q * dim;
        let mlp = 3 * dim * ffn;
        Self {
            layers: c.n_layers as u64 * (attention + mlp),
            head: vocab * dim,
        }
    }

    /// Per token of one `prompt_tokens`-token prompt step, which computes logits for
    /// its last token only (as the benchmark's prompt step and llama-bench's pp do).
    #[must_use]
    pub fn prefill_per_token(&self, prompt_tokens: usize) -> f64 {
        self.layers as f64 + self.head as f64 / prompt_tokens.max(1) as f64
    }

    /// Per decoded token (every one computes its logits).
    #[must_use]
    pub fn decode_per_token(&self) -> u64 {
        self.layers + self.head
    }
}

/// Bytes of weights one single-stream decode step reads, from the model file's
/// tensors `(name, bytes)`: every tensor in full, except that the token embedding is
/// only looked up (one of its `vocab` rows) when the file has a separate
/// `output.weight`; without one it is the output head and read in full.
#[must_use]
pub fn weight_bytes_per_token(tensors: &[(&str, u64)], vocab: usize) -> u64 {
    let untied = tensors.iter().any(|&(name, _)| name == "output.weight");
    tensors
        .iter()
        .map(|&(name, bytes)| {
            if untied && name == "token_embd.weight" {
                bytes / vocab.max(1) as u64
            } else {
                bytes
            }
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{BackendError, KvGeometry, Logits};

    /// Records each step's sequences as `(tokens, start position)` and answers
    /// uniform logits; refuses a step whose block table does not cover its tokens.
    struct Recorder {
        config: LlamaConfig,
        geometry: KvGeometry,
        steps: Vec<Vec<(Vec<u32>, usize)>>,
    }

    impl ModelRunner for Recorder {
        fn config(&self) -> &LlamaConfig {
            &self.config
        }

        fn kv_geometry(&self) -> KvGeometry {
            self.geometry
        }

        fn forward(&mut self, batch: &Batch) -> Result<Logits, BackendError> {
            let mut logits = Logits {
                vocab: self.config.vocab,
                ..Logits::default()
            };
            for (i, s) in batch.seqs.iter().enumerate() {
                let end = s.start_pos + s.tokens.len();
                if s.block_table.len() * self.geometry.block_size < end {
                    return Err(BackendError::InvalidBatch("short block table".into()));
                }
                logits.data.extend(vec![0.0; self.config.vocab]);
                logits.spans.push(i..i + 1);
            }
            self.steps.push(
                batch
                    .seqs
                    .iter()
                    .map(|s| (s.tokens.clone(), s.start_pos))
                    .collect(),
            );
            Ok(logits)
        }
    }

    #[test]
    fn each_repetition_prefills_and_decodes_every_parallel_batch_anew() {
        let config = BenchConfig {
            prompt_tokens: 8,
            gen_tokens: 3,
            batch_prompt: 4,
            parallel: vec![2, 5],
            repetitions: 2,
        };
        let mut runner = Recorder {
            config: LlamaConfig {
                vocab: 50,
                ..LlamaConfig::default()
            },
            // Exactly what the runs need at once: a repetition that kept its blocks
            // would leave the next too few.
            geometry: KvGeometry {
                block_size: 4,
                num_blocks: config.blocks_needed(4),
            },
            steps: Vec::new(),
        };
        let report = run(&mut runner, &config, &[]).expect("bench runs");
        let parallel: Vec<usize> = report.aggregate_tps.iter().map(|&(n, _)| n).collect();
        assert_eq!(parallel, [2, 5]);
        assert!(
            report
                .aggregate_tps
                .iter()
                .all(|&(_, tps)| tps.is_finite() && tps > 0.0)
        );
        // After the warm-up and prompt/single-stream steps: per width and repetition,
        // one prefill step (5 prompts of 4 fit one 512-token step), then 3 decode
        // steps of one token per sequence at positions 4, 5, 6.
        let single = 2 + 2 * (1 + 3);
        let aggregate = &runner.steps[single..];
        assert_eq!(aggregate.len(), 2 * 2 * (1 + 3));
        let mut prompts = Vec::new();
        for (i, (np, _rep)) in [(2, 0), (2, 1), (5, 0), (5, 1)].into_iter().enumerate() {
            let steps = &aggregate[i * 4..(i + 1) * 4];
            assert!(steps[0].iter().all(|(t, p)| t.len() == 4 && *p == 0));
            assert_eq!(steps[0].len(), np);
            prompts.push(steps[0][0].0.clone());
            for (k, step) in steps[1..].iter().enumerate() {
                assert_eq!(step.len(), np);
                assert!(step.iter().all(|(t, p)| t.len() == 1 && *p == 4 + k));
            }
        }
        assert_ne!(
            prompts[0], prompts[1],
            "each repetition prefills new prompts"
        );
    }

    #[test]
    fn token_macs_match_a_hand_count() {
        // 2 layers, dim 8, 2 query heads and 1 key/value head of 4, MLP 16, vocab 10.
        let c = LlamaConfig {
            n_layers: 2,
            dim: 8,
            ffn_dim: 16,
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 4,
            vocab: 10,
            ..LlamaConfig::default()
        };
        // Per layer: Q 8·8 + K 8·4 + V 8·4 + O 8·8 = 192; gate, up, down 3·8·16 = 384.
        let m = TokenMacs::of(&c);
        assert_eq!(
            m,
            TokenMacs {
                layers: 2 * (192 + 384),
                head: 80
            }
        );
        assert_eq!(m.decode_per_token(), 1152 + 80);
        assert!((m.prefill_per_token(4) - (1152.0 + 20.0)).abs() < 1e-9);
    }

    #[test]
    fn smollm2_135m_costs_about_135m_macs_per_decoded_token() {
        let m = TokenMacs::of(&LlamaConfig::default());
        // 30 · (576·(576 + 2·192) + 576·576 + 3·576·1536) + 49152·576.
        assert_eq!(m.layers, 106_168_320);
        assert_eq!(m.head, 28_311_552);
        assert_eq!(m.decode_per_token(), 134_479_872);
    }

    #[test]
    fn weight_bytes_count_the_embedding_only_when_it_is_the_head() {
        let tied = [("token_embd.weight", 1000), ("blk.0.attn_q.weight", 50)];
        assert_eq!(weight_bytes_per_token(&tied, 10), 1050);
        let untied = [
            ("token_embd.weight", 1000),
            ("blk.0.attn_q.weight", 50),
            ("output.weight", 900),
        ];
        assert_eq!(weight_bytes_per_token(&untied, 10), 100 + 50 + 900);
    }
}
