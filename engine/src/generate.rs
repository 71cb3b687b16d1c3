//! Single-sequence drivers over a [`ModelRunner`]: greedy/sampled generation and
//! teacher-forced scoring, used by the CLI, the oracle tests and the benchmark.
//! The serving scheduler drives the runner itself; these only borrow blocks from a
//! [`BlockAllocator`] and return them when done.

use crate::backend::{BackendError, Batch, LogitsWanted, ModelRunner, SeqChunk};
use crate::kernels::ops::log_softmax;
use crate::kv::{BlockAllocator, KvError};
use crate::sampling::{Sampler, argmax};

/// Errors of a generation or scoring run.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    /// The forward pass failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// Not enough KV blocks.
    #[error(transparent)]
    Kv(#[from] KvError),
    /// Nothing to condition on.
    #[error("the prompt has no tokens")]
    EmptyPrompt,
}

/// Tokens per prefill forward step.
pub const PREFILL_CHUNK: usize = 512;

/// Feeds `tokens` from position `start` through the runner in chunks (under LoRA
/// adapter `adapter`, if any), growing `table`; returns the logits rows `want` asks
/// for (per chunk).
fn feed(
    runner: &mut dyn ModelRunner,
    alloc: &mut BlockAllocator,
    table: &mut Vec<u32>,
    (tokens, start): (&[u32], usize),
    want: LogitsWanted,
    adapter: Option<u16>,
) -> Result<Vec<Vec<f32>>, GenerateError> {
    let bs = runner.kv_geometry().block_size;
    let mut rows = Vec::new();
    let mut pos = start;
    for chunk in tokens.chunks(PREFILL_CHUNK) {
        alloc.ensure(table, pos + chunk.len(), bs)?;
        let last = pos + chunk.len() == start + tokens.len();
        let logits = match want {
            LogitsWanted::Last if !last => LogitsWanted::None,
            other => other,
        };
        let batch = Batch {
            seqs: vec![SeqChunk {
                tokens: chunk.to_vec(),
                start_pos: pos,
                block_table: table.clone(),
                logits,
                adapter,
            }],
        };
        let out = runner.forward(&batch)?;
        rows.extend(out.rows_of(0).map(<[f32]>::to_vec));
        pos += chunk.len();
    }
    Ok(rows)
}

/// Generates up to `max_tokens` after `prompt`, stopping after any token in `stop`
/// (which is included in the result).
///
/// # Errors
/// An empty prompt, too few KV blocks, or a backend error.
pub fn generate(
    runner: &mut dyn ModelRunner,
    alloc: &mut BlockAllocator,
    prompt: &[u32],
    max_tokens: usize,
    sampler: &mut Sampler,
    stop: &[u32],
) -> Result<Vec<u32>, GenerateError> {
    if prompt.is_empty() {
        return Err(GenerateError::EmptyPrompt);
    }
    let mut table = Vec::new();
    let result = (|| {
        let mut history = prompt.to_vec();
        let mut out = Vec::new();
        if max_tokens == 0 {
            return Ok(out);
        }
        let mut logits = feed(
            runner,
            alloc,
            &mut table,
            (prompt, 0),
            LogitsWanted::Last,
            None,
        )?
        .pop()
        .unwrap_or_default();
        loop {
            let tok = sampler.sample(&logits, &history);
            out.push(tok);
            history.push(tok);
            if out.len() >= max_tokens || stop.contains(&tok) {
                return Ok(out);
            }
            logits = feed(
                runner,
                alloc,
                &mut table,
                (&[tok], history.len() - 1),
                LogitsWanted::Last,
                None,
            )?
            .pop()
            .unwrap_or_default();
        }
    })();
    alloc.release(&table)?;
    result
}

/// What the model thought at one position of a scored text.
#[derive(Clone, Debug, PartialEq)]
pub struct PositionScore {
    /// The token that actually follows.
    pub token: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// The model's most likely token.
    pub argmax: u32,
    /// The `k` most likely `(token, logprob)`, best first.
    pub top: Vec<(u32, f32)>,
}

/// Teacher-forced scoring: for every position `i ≥ 1` of `tokens`, how the model
/// rated `tokens[i]` given `tokens[..i]`.
///
/// # Errors
/// Fewer than two tokens, too few KV blocks, or a backend error.
pub fn score(
    runner: &mut dyn ModelRunner,
    alloc: &mut BlockAllocator,
    tokens: &[u32],
    top_k: usize,
) -> Result<Vec<PositionScore>, GenerateError> {
    score_with(runner, alloc, tokens, top_k, None)
}

/// [`score`] under the runner's LoRA adapter `adapter` (an index into
/// [`ModelRunner::adapters`]), or the base model for `None`.
///
/// # Errors
/// As [`score`]; an adapter the runner does not have is a backend error.
pub fn score_with(
    runner: &mut dyn ModelRunner,
    alloc: &mut BlockAllocator,
    tokens: &[u32],
    top_k: usize,
    adapter: Option<u16>,
) -> Result<Vec<PositionScore>, GenerateError> {
    if tokens.len() < 2 {
        return Err(GenerateError::EmptyPrompt);
    }
    let mut table = Vec::new();
    let rows = feed(
        runner,
        alloc,
        &mut table,
        (&tokens[..tokens.len() - 1], 0),
        LogitsWanted::All,
        adapter,
    );
    alloc.release(&table)?;
    Ok(rows?
        .iter()
        .zip(&tokens[1..])
        .map(|(row, &token)| {
            let lp = log_softmax(row);
            let mut order: Vec<u32> = (0..lp.len() as u32).collect();
            let k = top_k.min(order.len());
            if k > 0 {
                order.select_nth_unstable_by(k - 1, |&a, &b| {
                    lp[b as usize].total_cmp(&lp[a as usize]).then(a.cmp(&b))
                });
            }
            order.truncate(k);
            order.sort_by(|&a, &b| lp[b as usize].total_cmp(&lp[a as usize]).then(a.cmp(&b)));
            PositionScore {
                token,
                logprob: lp.get(token as usize).copied().unwrap_or(f32::NEG_INFINITY),
                argmax: argmax(row) as u32,
                top: order.iter().map(|&t| (t, lp[t as usize])).collect(),
            }
        })
        .collect())
}

/// Perplexity of scored positions: `exp(-mean logprob)`.
#[must_use]
pub fn perplexity(scores: &[PositionScore]) -> f64 {
    if scores.is_empty() {
        return f64::NAN;
    }
    let mean: f64 = scores.iter().map(|s| f64::from(s.logprob)).sum::<f64>() / scores.len() as f64;
    (-mean).exp()
}
