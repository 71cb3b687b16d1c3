//! The leader's step frame: what every rank of a pipeline needs to run a step (the
//! [`Batch`]: each chunk's tokens, start position, block table, logits wanted and
//! adapter; and, when the last stage samples, each sequence's [`SeqSampling`]), or
//! that there is no step (an idle keep-alive, or the end of the group). One typed
//! definition, [`StepFrame`], encoded by the leader and decoded by every worker; and
//! the last stage's reply when it sampled ([`encode_sampled`], [`decode_sampled`]).
//!
//! Payload of a [`FrameKind::Batch`](super::FrameKind::Batch) frame, raw little-endian:
//!
//! | bytes | field                                                        |
//! |-------|--------------------------------------------------------------|
//! | 1     | command: 1 run, 2 idle, 3 stop, 4 run and sample              |
//! | 4     | run, sample: sequences, u32                                   |
//!
//! then per sequence: tokens u32, blocks u32, start position u64, logits wanted u8
//! (0 none, 1 last, 2 all), adapter flag u8 (0 none, 1 set), adapter u16, the token
//! ids (u32 each), the block ids (u32 each). A "run and sample" frame then has one
//! sampling entry per sequence: a flag u8 (0: samples nothing), and when set the
//! parameters (temperature f32, top-k u64, top-p f32, seed u64, repetition,
//! frequency and presence penalties f32), a draw flag u8 and the draw f64, a
//! log-probability flag u8, the history (count u32, tokens u32) and the stop tokens
//! (count u32, tokens u32).
//!
//! The sampled reply ([`FrameKind::Sampled`](super::FrameKind::Sampled)): a count
//! u32, then per sequence a flag u8 (0: sampled nothing), token u32, stop flag u8,
//! log-probability flag u8 and log-probability f32: 11 bytes a sequence, where the
//! logits row it replaces is 4 bytes per vocabulary entry.
//!
//! Decoding never panics and never allocates more than the frame's own size: every
//! count is checked against the bytes left before anything is reserved for it, and a
//! frame with bytes left over is refused. What it decodes is only well-formed, not
//! valid: the stage checks the batch against its vocabulary and KV store before it
//! writes anything.

use crate::backend::{Batch, LogitsWanted, ModelOutput, SeqChunk};
use crate::sampling::{SampledToken, SamplingParams, SeqSampling};

const RUN: u8 = 1;
const IDLE: u8 = 2;
const STOP: u8 = 3;
const SAMPLE: u8 = 4;
/// Bytes of a sampled reply's entry.
const SAMPLED_ENTRY: usize = 1 + 4 + 1 + 1 + 4;
/// Bytes of a sequence's fixed fields.
const SEQ_HEADER: usize = 4 + 4 + 8 + 1 + 1 + 2;

/// What the leader tells every rank for one step id.
#[derive(Clone, Debug)]
pub enum StepFrame<B, S> {
    /// Run this batch; the last stage returns the logits asked for.
    Run(B),
    /// Run this batch; the last stage samples (one entry per sequence) and returns
    /// only the tokens.
    Sample(B, S),
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
    #[error("sequence {seq}: {what} flag {value} (0 or 1)")]
    BadFlag {
        what: &'static str,
        seq: usize,
        value: u8,
    },
    #[error("{got} {what} for {want} sequences")]
    CountMismatch {
        what: &'static str,
        got: usize,
        want: usize,
    },
    #[error("sequence {seq}: top-k {value} does not fit this platform")]
    BadTopK { seq: usize, value: u64 },
}

/// A frame the leader sends.
pub type OutgoingStep<'a> = StepFrame<&'a Batch, &'a [Option<SeqSampling>]>;
/// A frame a worker receives.
pub type IncomingStep = StepFrame<Batch, Vec<Option<SeqSampling>>>;

fn count(n: usize) -> Result<u32, StepFrameError> {
    u32::try_from(n).map_err(|_| StepFrameError::TooLarge(n))
}

fn put_u32s(out: &mut Vec<u8>, values: &[u32]) -> Result<(), StepFrameError> {
    out.extend_from_slice(&count(values.len())?.to_le_bytes());
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    Ok(())
}

fn put_sampling(out: &mut Vec<u8>, s: Option<&SeqSampling>) -> Result<(), StepFrameError> {
    let Some(s) = s else {
        out.push(0);
        return Ok(());
    };
    // Destructured whole, so a field added to either type breaks this build rather
    // than silently staying on the leader.
    let SeqSampling {
        params,
        uniform,
        history,
        stop_tokens,
        logprob,
    } = s;
    let SamplingParams {
        temperature,
        top_k,
        top_p,
        seed,
        repetition_penalty,
        frequency_penalty,
        presence_penalty,
    } = params;
    out.push(1);
    out.extend_from_slice(&temperature.to_le_bytes());
    out.extend_from_slice(&(*top_k as u64).to_le_bytes());
    out.extend_from_slice(&top_p.to_le_bytes());
    out.extend_from_slice(&seed.to_le_bytes());
    for f in [repetition_penalty, frequency_penalty, presence_penalty] {
        out.extend_from_slice(&f.to_le_bytes());
    }
    out.push(u8::from(uniform.is_some()));
    out.extend_from_slice(&uniform.unwrap_or(0.0).to_le_bytes());
    out.push(u8::from(*logprob));
    put_u32s(out, history)?;
    put_u32s(out, stop_tokens)
}

/// Writes the last stage's sampled reply into `out` (cleared first).
///
/// # Errors
/// [`StepFrameError::TooLarge`] for more than `u32::MAX` sequences.
pub fn encode_sampled(output: &ModelOutput, out: &mut Vec<u8>) -> Result<(), StepFrameError> {
    out.clear();
    out.extend_from_slice(&count(output.sampled.len())?.to_le_bytes());
    for s in &output.sampled {
        let t = s.unwrap_or(SampledToken {
            token: 0,
            stop: false,
            logprob: None,
        });
        out.push(u8::from(s.is_some()));
        out.extend_from_slice(&t.token.to_le_bytes());
        out.push(u8::from(t.stop));
        out.push(u8::from(t.logprob.is_some()));
        out.extend_from_slice(&t.logprob.unwrap_or(0.0).to_le_bytes());
    }
    Ok(())
}

/// Reads a sampled reply for a batch of `seqs` sequences.
///
/// # Errors
/// [`StepFrameError`] saying what is wrong with it, including another count.
pub fn decode_sampled(bytes: &[u8], seqs: usize) -> Result<ModelOutput, StepFrameError> {
    let mut r = Reader(bytes);
    let got = r.u32("the sampled count")? as usize;
    if got != seqs {
        return Err(StepFrameError::CountMismatch {
            what: "sampled entries",
            got,
            want: seqs,
        });
    }
    r.fits("the sampled entries", got, SAMPLED_ENTRY)?;
    let mut sampled = Vec::with_capacity(got);
    for seq in 0..got {
        let present = r.flag("sampled", seq)?;
        let token = r.u32("a sampled token")?;
        let stop = r.flag("stop", seq)?;
        let has_logprob = r.flag("log-probability", seq)?;
        let logprob = f32::from_le_bytes(r.array("a log-probability")?);
        sampled.push(present.then_some(SampledToken {
            token,
            stop,
            logprob: has_logprob.then_some(logprob),
        }));
    }
    if !r.0.is_empty() {
        return Err(StepFrameError::Trailing(r.0.len()));
    }
    Ok(ModelOutput { sampled })
}

impl OutgoingStep<'_> {
    /// Writes the frame's payload into `out` (cleared first, its capacity reused).
    ///
    /// # Errors
    /// [`StepFrameError::TooLarge`] for a count over `u32::MAX`;
    /// [`StepFrameError::CountMismatch`] for sampling entries that are not one per
    /// sequence.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<(), StepFrameError> {
        out.clear();
        let (batch, sampling) = match self {
            Self::Run(batch) => (batch, None),
            Self::Sample(batch, sampling) => (batch, Some(sampling)),
            Self::Idle => {
                out.push(IDLE);
                return Ok(());
            }
            Self::Stop => {
                out.push(STOP);
                return Ok(());
            }
        };
        out.push(if sampling.is_some() { SAMPLE } else { RUN });
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
        if let Some(sampling) = sampling {
            if sampling.len() != batch.seqs.len() {
                return Err(StepFrameError::CountMismatch {
                    what: "sampling entries",
                    got: sampling.len(),
                    want: batch.seqs.len(),
                });
            }
            for s in sampling.iter() {
                put_sampling(out, s.as_ref())?;
            }
        }
        Ok(())
    }
}

impl IncomingStep {
    /// Reads a frame's payload.
    ///
    /// # Errors
    /// [`StepFrameError`] saying what is wrong with it.
    pub fn decode(bytes: &[u8]) -> Result<Self, StepFrameError> {
        let (&command, rest) = bytes.split_first().ok_or(StepFrameError::Empty)?;
        let mut r = Reader(rest);
        let frame = match command {
            RUN | SAMPLE => {
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
                if command == RUN {
                    Self::Run(batch)
                } else {
                    r.fits("the sampling entries", seqs, 1)?;
                    let sampling = (0..seqs)
                        .map(|seq| r.sampling(seq))
                        .collect::<Result<_, _>>()?;
                    Self::Sample(batch, sampling)
                }
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

    fn f32(&mut self, what: &'static str) -> Result<f32, StepFrameError> {
        self.array(what).map(f32::from_le_bytes)
    }

    fn flag(&mut self, what: &'static str, seq: usize) -> Result<bool, StepFrameError> {
        match self.array::<1>(what)? {
            [0] => Ok(false),
            [1] => Ok(true),
            [value] => Err(StepFrameError::BadFlag { what, seq, value }),
        }
    }

    fn counted_u32s(&mut self, what: &'static str) -> Result<Vec<u32>, StepFrameError> {
        let n = self.u32(what)? as usize;
        self.u32s(what, n)
    }

    fn sampling(&mut self, seq: usize) -> Result<Option<SeqSampling>, StepFrameError> {
        if !self.flag("sampling", seq)? {
            return Ok(None);
        }
        let temperature = self.f32("a temperature")?;
        let top_k = u64::from_le_bytes(self.array("a top-k")?);
        let top_k =
            usize::try_from(top_k).map_err(|_| StepFrameError::BadTopK { seq, value: top_k })?;
        let top_p = self.f32("a top-p")?;
        let seed = u64::from_le_bytes(self.array("a seed")?);
        let repetition_penalty = self.f32("a repetition penalty")?;
        let frequency_penalty = self.f32("a frequency penalty")?;
        let presence_penalty = self.f32("a presence penalty")?;
        let has_uniform = self.flag("draw", seq)?;
        let uniform = f64::from_le_bytes(self.array("a draw")?);
        let logprob = self.flag("log-probability", seq)?;
        Ok(Some(SeqSampling {
            params: SamplingParams {
                temperature,
                top_k,
                top_p,
                seed,
                repetition_penalty,
                frequency_penalty,
                presence_penalty,
            },
            uniform: has_uniform.then_some(uniform),
            logprob,
            history: self.counted_u32s("a history")?,
            stop_tokens: self.counted_u32s("stop tokens")?,
        }))
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

    fn encoded(frame: &OutgoingStep<'_>) -> Vec<u8> {
        let mut out = vec![0xAA; 3];
        frame.encode(&mut out).expect("encodes");
        out
    }

    /// `Batch` has no `PartialEq`; its debug form shows every field.
    fn same(a: &IncomingStep, b: &OutgoingStep<'_>) -> bool {
        format!("{a:?}") == format!("{b:?}")
    }

    /// One entry per sequence of [`batch`]: seeded with penalties and a
    /// log-probability, nothing, greedy.
    fn sampling() -> Vec<Option<SeqSampling>> {
        vec![
            Some(SeqSampling {
                params: SamplingParams {
                    temperature: 0.7,
                    top_k: 40,
                    top_p: 0.9,
                    seed: u64::MAX - 1,
                    repetition_penalty: 1.1,
                    frequency_penalty: 0.5,
                    presence_penalty: -0.25,
                },
                uniform: Some(0.123_456_789_012_345),
                history: vec![1, 49151, 7, 7],
                stop_tokens: vec![2, 0],
                logprob: true,
            }),
            None,
            Some(SeqSampling {
                params: SamplingParams::default(),
                uniform: None,
                history: Vec::new(),
                stop_tokens: vec![2],
                logprob: false,
            }),
        ]
    }

    #[test]
    fn every_frame_round_trips() {
        let (b, sampling) = (batch(), sampling());
        let empty = Batch::default();
        let frames: [OutgoingStep<'_>; 6] = [
            StepFrame::Run(&b),
            StepFrame::Run(&empty),
            StepFrame::Sample(&b, &sampling),
            StepFrame::Sample(&empty, &[]),
            StepFrame::Idle,
            StepFrame::Stop,
        ];
        for frame in frames {
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
        let (b, sampling) = (batch(), sampling());
        let frames: [OutgoingStep<'_>; 2] = [StepFrame::Run(&b), StepFrame::Sample(&b, &sampling)];
        for frame in frames {
            let bytes = encoded(&frame);
            for len in 0..bytes.len() {
                let got = StepFrame::decode(&bytes[..len]);
                assert!(
                    got.is_err(),
                    "{len} of {} bytes decoded: {got:?}",
                    bytes.len()
                );
            }
        }
    }

    #[test]
    fn sampling_must_be_one_entry_per_sequence() {
        let (b, sampling) = (batch(), sampling());
        let err = StepFrame::Sample(&b, &sampling[..2])
            .encode(&mut Vec::new())
            .expect_err("two entries for three sequences");
        assert_eq!(
            err,
            StepFrameError::CountMismatch {
                what: "sampling entries",
                got: 2,
                want: 3
            }
        );
    }

    #[test]
    fn sampled_replies_round_trip_and_bad_ones_are_errors() {
        let output = ModelOutput {
            sampled: vec![
                Some(SampledToken {
                    token: 49151,
                    stop: true,
                    logprob: Some(-0.5),
                }),
                None,
                Some(SampledToken {
                    token: 0,
                    stop: false,
                    logprob: None,
                }),
            ],
        };
        let mut bytes = vec![0xAA];
        encode_sampled(&output, &mut bytes).expect("encodes");
        assert_eq!(bytes.len(), 4 + 3 * SAMPLED_ENTRY);
        assert_eq!(decode_sampled(&bytes, 3), Ok(output));
        assert_eq!(
            decode_sampled(&bytes, 2),
            Err(StepFrameError::CountMismatch {
                what: "sampled entries",
                got: 3,
                want: 2
            })
        );
        for len in 0..bytes.len() {
            assert!(decode_sampled(&bytes[..len], 3).is_err(), "{len} bytes");
        }
        let mut bad = bytes.clone();
        bad[4] = 7;
        assert_eq!(
            decode_sampled(&bad, 3),
            Err(StepFrameError::BadFlag {
                what: "sampled",
                seq: 0,
                value: 7
            })
        );
        bytes.push(0);
        assert_eq!(decode_sampled(&bytes, 3), Err(StepFrameError::Trailing(1)));
        // A count the payload cannot hold is refused before allocating.
        assert!(matches!(
            decode_sampled(&u32::MAX.to_le_bytes(), u32::MAX as usize),
            Err(StepFrameError::Truncated { .. })
        ));
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
            bytes[0] = SAMPLE;
            let _outcome = StepFrame::decode(&bytes);
            let _outcome = decode_sampled(&tail, tail.len() / SAMPLED_ENTRY);
        }
    }
}
