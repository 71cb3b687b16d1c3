//! The boundary between scheduling and compute: a [`ModelRunner`] runs one batched
//! forward step over many sequences at once (prefill chunks and decode tokens
//! mixed), each with its own positions and paged-KV block table.
//!
//! Contract of [`ModelRunner::forward`]:
//! - every [`SeqChunk`] is a different sequence; its `tokens` occupy positions
//!   `start_pos..start_pos + tokens.len()`, and positions before `start_pos` must have
//!   been written by earlier steps through the same block table;
//! - `block_table` covers every position up to the chunk's last one; the blocks a
//!   chunk writes belong to it alone in this batch (shared, read-only prefix blocks
//!   are fine);
//! - the result holds the logits each chunk asked for, in chunk order.
//!
//! The CPU backend ([`cpu`]) implements it today; a CUDA backend will implement the
//! same trait.

pub mod cpu;

use std::ops::Range;

use crate::model::llama::LlamaConfig;

/// Which logits a chunk wants back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsWanted {
    /// None (a prefill chunk that is not the last).
    None,
    /// Only for the last token (decode; last prefill chunk).
    Last,
    /// For every token (scoring).
    All,
}

/// Consecutive tokens of one sequence.
#[derive(Clone, Debug)]
pub struct SeqChunk {
    /// Token ids.
    pub tokens: Vec<u32>,
    /// Position of `tokens[0]`.
    pub start_pos: usize,
    /// Block ids holding positions `0..`, `block_size` positions each.
    pub block_table: Vec<u32>,
    /// Logits to return.
    pub logits: LogitsWanted,
}

/// One forward step.
#[derive(Clone, Debug, Default)]
pub struct Batch {
    /// The sequences of this step.
    pub seqs: Vec<SeqChunk>,
}

impl Batch {
    /// Tokens in the step.
    #[must_use]
    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.tokens.len()).sum()
    }
}

/// Logits of a step: `rows` of `vocab` floats; `spans[i]` are chunk `i`'s rows.
#[derive(Clone, Debug, Default)]
pub struct Logits {
    /// Vocabulary size (row length).
    pub vocab: usize,
    /// Row-major logits.
    pub data: Vec<f32>,
    /// Rows of each chunk, in batch order.
    pub spans: Vec<Range<usize>>,
}

impl Logits {
    /// Row `i`.
    ///
    /// # Panics
    /// When `i` is out of range.
    #[must_use]
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }

    /// The rows of chunk `seq`.
    ///
    /// # Panics
    /// When `seq` is out of range.
    pub fn rows_of(&self, seq: usize) -> impl Iterator<Item = &[f32]> {
        self.spans[seq].clone().map(|i| self.row(i))
    }

    /// The last row of chunk `seq`, if it asked for any.
    #[must_use]
    pub fn last_of(&self, seq: usize) -> Option<&[f32]> {
        let span = self.spans.get(seq)?;
        (!span.is_empty()).then(|| self.row(span.end - 1))
    }
}

/// Size of the paged KV store a runner owns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvGeometry {
    /// Positions per block.
    pub block_size: usize,
    /// Blocks available.
    pub num_blocks: usize,
}

/// Errors of a forward step.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The batch breaks the contract (bad token, short block table, shared write block).
    #[error("invalid batch: {0}")]
    InvalidBatch(String),
    /// A kernel rejected its operands (an engine bug, reported instead of panicking).
    #[error(transparent)]
    Kernel(#[from] crate::kernels::KernelError),
}

/// A model that can run batched forward steps against its own paged KV store.
pub trait ModelRunner {
    /// The architecture hyper-parameters.
    fn config(&self) -> &LlamaConfig;
    /// The KV store's shape (the block manager sizes its pool from it).
    fn kv_geometry(&self) -> KvGeometry;
    /// Runs one step; see the module docs for the contract.
    ///
    /// # Errors
    /// [`BackendError::InvalidBatch`] when the batch breaks the contract; nothing is
    /// written to the KV store in that case.
    fn forward(&mut self, batch: &Batch) -> Result<Logits, BackendError>;
}
