//! The leader's step frame: what every rank of a pipeline needs to run a step (the
//! [`Batch`]: each chunk's tokens, start position, block table, logits wanted and
//! adapter), or that there is no step (an idle keep-alive, or the end of the group).
//! One typed definition, [`StepFrame`], encoded by the leader and decoded by every
//! worker.
//!
//! Payload of a [`FrameKind::Batch`](super::FrameKind::Batch) frame, raw little-endian:
//!
//! | bytes | field                                                        |
//! |-------|--------------------------------------------------------------|
//! | 1     | command: 1 run, 2 idle, 3 stop                               |
//! | 4     | run only: sequences, u32                                      |
//!
//! then per sequence: tokens u32, blocks u32, start position u64, logits wanted u8
//! (0 none, 1 last, 2 all), adapter flag u8 (0 none, 1 set), adapter u16, the token
//! ids (u32 each), the block ids (u32 each).
//!
//! Decoding never panics and never allocates more than the frame's own size: every
//! count is checked against the bytes left before anything is reserved for it, and a
//! frame with bytes left over is refused. What it decodes is only well-formed, not
//! valid: the stage checks the batch against its vocabulary and KV store before it
//! writes anything.

use crate::backend::{Batch, LogitsWanted, SeqChunk};

const RUN: u8 = 1;
const IDLE: u8 = 2;
const STOP: u8 = 3;
/// Bytes of a sequence's fixed fields.
const SEQ_HEADER: usize = 4 + 4 + 8 + 1 + 1 + 2;

/// What the leader tells every rank for one step id.
#[derive(Clone, Debug)]
pub enum StepFrame<B> {
    /// Run this batch.
    Run(B),
    /// No step: the leader is alive and idle (sent so a worker waiting for work can
    /// tell an idle leader from a dead one).
    Idle,
    /// The group is done: exit cleanly.
    Stop,
}

/// Why a step frame could not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StepFrameError {
    #[error("an empty step frame")]
    Empty,
    #[error("unknown step command {0}")]
    UnknownCommand(u8),
    #[error("truncated: {what} needs {need} bytes, {left} left")]
    Truncated {
        what: &'static str,
        need: usize,
        left: usize,
    },
    #[error("sequence {seq}: logits wanted {value} (0, 1 or 2)")]
    BadLogits { seq: usize, value: u8 },
    #[error("sequence {seq}: adapter flag {value} (0 or 1)")]
    BadAdapterFlag { seq: usize, value: u8 },
    #[error("sequence {seq}: start position {value} does not fit this platform")]
    BadPosition { seq: usize, value: u64 },
    #[error("{0} bytes left over after the last sequence")]
    Trailing(usize),
    #[error("a batch of {0} sequences, tokens or blocks does not fit a u32 count")]
    TooLarge(usize),
}

impl StepFrame<&Batch> {
    /// Writes the frame's payload into `out` (cleared first, its capacity reused).
    ///
    /// # Errors
    /// [`StepFrameError::TooLarge`] for a count over `u32::MAX`.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<(), StepFrameError> {
        out.clear();
        let batch = match self {
            Self::Run(batch) => batch,
            Self::Idle => {
                out.push(IDLE);
                return Ok(());
            }
            Self::Stop => {
                out.push(STOP);
                return Ok(());
            }
        };
        let count = |n: usize| u32::try_from(n).map_err(|_| StepFrameError::TooLarge(n));
        out.push(RUN);
        out.extend_from_slice(&count(batch.seqs.len())?.to_le_bytes());
        for s in &batch.seqs {
            out.extend_from_slice(&count(s.tokens.len())?.to_le_bytes());
            out.extend_from_slice(&count(s.block_table.len())?.to_le_bytes());
            out.extend_from_slice(&(s.start_pos as u64).to_le_bytes());
            out.push(match s.logits {
                LogitsWanted::None => 0,
                LogitsWanted::Last => 1,
                LogitsWanted::All => 2,
            });
            out.push(u8::from(s.adapter.is_some()));
            out.extend_from_slice(&s.adapter.unwrap_or(0).to_le_bytes());
            for t in &s.tokens {
                out.extend_from_slice(&t.to_le_bytes());
            }
            for b in &s.block_table {
                out.extend_from_slice(&b.to_le_bytes());
            }
        }
        Ok(())
    }
}

impl StepFrame<Batch> {
    /// Reads a frame's payload.
    ///
    /// # Errors
    /// [`StepFrameError`] saying what is wrong with it.
    pub fn decode(bytes: &[u8]) -> Result<Self, StepFrameError> {
        let (&command, rest) = bytes.split_first().ok_or(StepFrameError::Empty)?;
        let mut r = Reader(rest);
        let frame = match command {
            RUN => {
                let seqs = r.u32("the sequence count")? as usize;
                // Each sequence takes at least its fixed fields: a count that cannot fit
                // is refused before anything is reserved for it.
                r.fits("the sequences", seqs, SEQ_HEADER)?;
                let mut batch = Batch {
                    seqs: Vec::with_capacity(seqs),
                };
                for seq in 0..seqs {
                    batch.seqs.push(r.seq(seq)?);
                }
                Self::Run(batch)
            }
            IDLE => Self::Idle,
            STOP => Self::Stop,
            other => return Err(StepFrameError::UnknownCommand(other)),
        };
        if !r.0.is_empty() {
            return Err(StepFrameError::Trailing(r.0.len()));
        }
        Ok(frame)
    }
}

/// A cursor over a payload that checks every read against the bytes left.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, what: &'static str, need: usize) -> Result<&'a [u8], StepFrameError> {
        if need > self.0.len() {
            return Err(StepFrameError::Truncated {
                what,
                need,
                left: self.0.len(),
            });
        }
        let (head, rest) = self.0.split_at(need);
        self.0 = rest;
        Ok(head)
    }

    /// Checks `count` items of `size` bytes fit in what is left.
    fn fits(&self, what: &'static str, count: usize, size: usize) -> Result<(), StepFrameError> {
        let need = count.saturating_mul(size);
        if need > self.0.len() {
            return Err(StepFrameError::Truncated {
                what,
                need,
                left: self.0.len(),
            });
        }
        Ok(())
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], StepFrameError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(what, N)?);
        Ok(out)
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, StepFrameError> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u32s(&mut self, what: &'static str, count: usize) -> Result<Vec<u32>, StepFrameError> {
        self.fits(what, count, 4)?;
        let bytes = self.take(what, count * 4)?;
        let (words, _) = bytes.as_chunks::<4>();
        Ok(words.iter().map(|w| u32::from_le_bytes(*w)).collect())
    }

    fn seq(&mut self, seq: usize) -> Result<SeqChunk, StepFrameError> {
        let tokens = self.u32("a sequence's token count")? as usize;
        let blocks = self.u32("a sequence's block count")? as usize;
        let start = u64::from_le_bytes(self.array("a start position")?);
        let start_pos = usize::try_from(start)
            .map_err(|_| StepFrameError::BadPosition { seq, value: start })?;
        let [logits, flag] = self.array("the logits wanted and adapter flag")?;
        let logits = match logits {
            0 => LogitsWanted::None,
            1 => LogitsWanted::Last,
            2 => LogitsWanted::All,
            value => return Err(StepFrameError::BadLogits { seq, value }),
        };
        let adapter = u16::from_le_bytes(self.array("an adapter")?);
        let adapter = match flag {
            0 => None,
            1 => Some(adapter),
            value => return Err(StepFrameError::BadAdapterFlag { seq, value }),
        };
        Ok(SeqChunk {
            tokens: self.u32s("a sequence's tokens", tokens)?,
            start_pos,
            block_table: self.u32s("a sequence's block table", blocks)?,
            logits,
            adapter,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch() -> Batch {
        Batch {
            seqs: vec![
                SeqChunk {
                    tokens: vec![1, 49151, 7],
                    start_pos: 0,
                    block_table: vec![3, 9],
                    logits: LogitsWanted::All,
                    adapter: None,
                },
                SeqChunk {
                    tokens: vec![42],
                    start_pos: 1_000_000,
                    block_table: (0..70).collect(),
                    logits: LogitsWanted::Last,
                    adapter: Some(u16::MAX),
                },
                SeqChunk {
                    tokens: vec![5; 40],
                    start_pos: 17,
                    block_table: vec![u32::MAX],
                    logits: LogitsWanted::None,
                    adapter: Some(0),
                },
            ],
        }
    }

    fn encoded(frame: &StepFrame<&Batch>) -> Vec<u8> {
        let mut out = vec![0xAA; 3];
        frame.encode(&mut out).expect("encodes");
        out
    }

    /// `Batch` has no `PartialEq`; its debug form shows every field.
    fn same(a: &StepFrame<Batch>, b: &StepFrame<&Batch>) -> bool {
        format!("{a:?}") == format!("{b:?}")
    }

    #[test]
    fn every_frame_round_trips() {
        let b = batch();
        let empty = Batch::default();
        for frame in [
            StepFrame::Run(&b),
            StepFrame::Run(&empty),
            StepFrame::Idle,
            StepFrame::Stop,
        ] {
            let bytes = encoded(&frame);
            let back = StepFrame::decode(&bytes).expect("decodes");
            assert!(same(&back, &frame), "{back:?} vs {frame:?}");
        }
    }

    #[test]
    fn the_layout_is_the_documented_one() {
        let b = Batch {
            seqs: vec![SeqChunk {
                tokens: vec![0x0102_0304],
                start_pos: 5,
                block_table: vec![6],
                logits: LogitsWanted::Last,
                adapter: Some(0x0708),
            }],
        };
        let bytes = encoded(&StepFrame::Run(&b));
        let want: Vec<u8> = [
            &[1u8][..],
            &[1, 0, 0, 0],
            &[1, 0, 0, 0],
            &[1, 0, 0, 0],
            &[5, 0, 0, 0, 0, 0, 0, 0],
            &[1, 1],
            &[8, 7],
            &[4, 3, 2, 1],
            &[6, 0, 0, 0],
        ]
        .concat();
        assert_eq!(bytes, want);
    }

    #[test]
    fn every_truncation_is_an_error_never_a_panic() {
        let b = batch();
        let bytes = encoded(&StepFrame::Run(&b));
        for len in 0..bytes.len() {
            let got = StepFrame::decode(&bytes[..len]);
            assert!(
                got.is_err(),
                "{len} of {} bytes decoded: {got:?}",
                bytes.len()
            );
        }
    }

    #[test]
    fn bad_fields_are_named() {
        let b = batch();
        let good = encoded(&StepFrame::Run(&b));
        let decode = |patch: &dyn Fn(&mut Vec<u8>)| {
            let mut bytes = good.clone();
            patch(&mut bytes);
            StepFrame::decode(&bytes).expect_err("malformed")
        };
        assert_eq!(decode(&|b| b[0] = 9), StepFrameError::UnknownCommand(9));
        // Sequence 0's fixed fields start after the command and the count.
        let seq0 = 5;
        assert_eq!(
            decode(&|b| b[seq0 + 16] = 3),
            StepFrameError::BadLogits { seq: 0, value: 3 }
        );
        assert_eq!(
            decode(&|b| b[seq0 + 17] = 2),
            StepFrameError::BadAdapterFlag { seq: 0, value: 2 }
        );
        assert_eq!(decode(&|b| b.push(0)), StepFrameError::Trailing(1));
        assert_eq!(
            StepFrame::decode(&[IDLE, 0]).expect_err("trailing"),
            StepFrameError::Trailing(1)
        );
        assert_eq!(
            StepFrame::decode(&[]).expect_err("empty"),
            StepFrameError::Empty
        );
    }

    #[test]
    fn huge_counts_are_refused_before_allocating() {
        // A run of u32::MAX sequences in a 5-byte frame.
        let frame = [RUN, 0xFF, 0xFF, 0xFF, 0xFF];
        assert!(matches!(
            StepFrame::decode(&frame),
            Err(StepFrameError::Truncated {
                what: "the sequences",
                ..
            })
        ));
        // One sequence claiming u32::MAX tokens.
        let mut frame = vec![RUN, 1, 0, 0, 0];
        frame.extend_from_slice(&u32::MAX.to_le_bytes());
        frame.extend_from_slice(&[0u8; SEQ_HEADER - 4]);
        assert!(matches!(
            StepFrame::decode(&frame),
            Err(StepFrameError::Truncated {
                what: "a sequence's tokens",
                ..
            })
        ));
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_payloads_decode_or_fail_without_panicking(
            tail in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200),
        ) {
            // Mostly runs with small counts, so the decoder gets deep into sequences.
            let mut bytes = vec![RUN, (tail.len() % 4) as u8, 0, 0, 0];
            bytes.extend_from_slice(&tail);
            let _outcome = StepFrame::decode(&bytes);
            let _outcome = StepFrame::decode(&tail);
        }
    }
}
