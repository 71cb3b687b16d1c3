//! Token sampling: greedy, temperature, top-k, top-p, and repetition / frequency /
//! presence penalties, with a seeded RNG so the same seed gives the same tokens.
//!
//! Order (as llama.cpp's default chain): penalties on the raw logits, then top-k,
//! temperature, softmax, top-p, and a draw. Temperature 0 is greedy (argmax, lowest
//! id on ties) and consumes no randomness.
//!
//! The rule is a plain function of the logits and one uniform draw
//! ([`sample_token`]); the draw comes from the request's own seeded RNG
//! ([`Sampler::draw`]). That split is what lets the model runner sample on its
//! worker thread (or on the GPU) from a [`SeqSampling`] of plain data, while the RNG
//! stays with the request (see [`SeqSampling`] for why).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Sampling settings of one request.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy.
    pub temperature: f32,
    /// Keep only the `k` most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches `p` (1.0: all).
    pub top_p: f32,
    /// RNG seed.
    pub seed: u64,
    /// Divides positive (multiplies negative) logits of tokens already seen (1.0: off).
    pub repetition_penalty: f32,
    /// Subtracted once per previous occurrence (0: off).
    pub frequency_penalty: f32,
    /// Subtracted once if the token occurred (0: off).
    pub presence_penalty: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
        }
    }
}

impl SamplingParams {
    /// Whether this is greedy decoding (argmax, no randomness).
    #[must_use]
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Whether a penalty reads the tokens so far.
    #[must_use]
    pub fn penalizes(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.frequency_penalty != 0.0
            || self.presence_penalty != 0.0
    }

    /// Checks the ranges.
    ///
    /// # Errors
    /// The first value out of range.
    pub fn validate(&self) -> Result<(), SamplingError> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(SamplingError::Temperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::TopP(self.top_p));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return Err(SamplingError::RepetitionPenalty(self.repetition_penalty));
        }
        if !self.frequency_penalty.is_finite() {
            return Err(SamplingError::FrequencyPenalty(self.frequency_penalty));
        }
        if !self.presence_penalty.is_finite() {
            return Err(SamplingError::PresencePenalty(self.presence_penalty));
        }
        Ok(())
    }
}

/// A sampling setting out of range.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum SamplingError {
    /// Negative, or not finite.
    #[error("temperature must be ≥ 0, got {0}")]
    Temperature(f32),
    /// Outside (0, 1].
    #[error("top_p must be in (0, 1], got {0}")]
    TopP(f32),
    /// Not positive, or not finite.
    #[error("repetition_penalty must be > 0, got {0}")]
    RepetitionPenalty(f32),
    /// Not finite.
    #[error("frequency_penalty must be finite, got {0}")]
    FrequencyPenalty(f32),
    /// Not finite.
    #[error("presence_penalty must be finite, got {0}")]
    PresencePenalty(f32),
}

impl SamplingError {
    /// The OpenAI request field that holds the bad value.
    #[must_use]
    pub fn param(&self) -> &'static str {
        match self {
            Self::Temperature(_) => "temperature",
            Self::TopP(_) => "top_p",
            Self::RepetitionPenalty(_) => "repetition_penalty",
            Self::FrequencyPenalty(_) => "frequency_penalty",
            Self::PresencePenalty(_) => "presence_penalty",
        }
    }
}

/// Index of the largest value (the lowest index among equal maxima).
#[must_use]
pub fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best
}

/// Picks the next token from `logits` given the tokens so far (`history`, read by
/// the penalties) and `uniform`, a draw in `[0, 1)` (unused when greedy).
#[must_use]
pub fn sample_token(p: &SamplingParams, logits: &[f32], history: &[u32], uniform: f64) -> u32 {
    if p.is_greedy() && !p.penalizes() {
        // Nothing changes the logits: no copy of the row (a vocabulary of floats per
        // sequence and step).
        return argmax(logits) as u32;
    }
    let mut l = logits.to_vec();
    if p.penalizes() {
        let mut counts = std::collections::HashMap::<u32, u32>::new();
        for &t in history {
            *counts.entry(t).or_default() += 1;
        }
        for (&t, &n) in &counts {
            if let Some(v) = l.get_mut(t as usize) {
                *v = if *v > 0.0 {
                    *v / p.repetition_penalty
                } else {
                    *v * p.repetition_penalty
                };
                *v -= n as f32 * p.frequency_penalty + p.presence_penalty;
            }
        }
    }
    if p.is_greedy() {
        return argmax(&l) as u32;
    }
    let mut cand: Vec<(u32, f32)> = l.iter().enumerate().map(|(i, &v)| (i as u32, v)).collect();
    cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if p.top_k > 0 {
        cand.truncate(p.top_k);
    }
    let max = cand[0].1;
    let mut probs: Vec<f64> = cand
        .iter()
        .map(|&(_, v)| f64::from((v - max) / p.temperature).exp())
        .collect();
    let total: f64 = probs.iter().sum();
    let mut keep = probs.len();
    if p.top_p < 1.0 {
        let mut acc = 0.0;
        for (i, q) in probs.iter().enumerate() {
            acc += q / total;
            if acc >= f64::from(p.top_p) {
                keep = i + 1;
                break;
            }
        }
    }
    probs.truncate(keep);
    let total: f64 = probs.iter().sum();
    let mut r = uniform * total;
    for (i, q) in probs.iter().enumerate() {
        if r < *q {
            return cand[i].0;
        }
        r -= q;
    }
    cand[keep - 1].0
}

/// A request's sampling settings with its own seeded RNG stream.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

impl Sampler {
    /// A sampler seeded from `params.seed`.
    #[must_use]
    pub fn new(params: SamplingParams) -> Self {
        let rng = StdRng::seed_from_u64(params.seed);
        Self { params, rng }
    }

    /// The settings.
    #[must_use]
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The draw for the next token: one uniform in `[0, 1)` from the stream, or
    /// `None` when greedy (which consumes no randomness).
    pub fn draw(&mut self) -> Option<f64> {
        (!self.params.is_greedy()).then(|| self.rng.random::<f64>())
    }

    /// Picks the next token from `logits` given the tokens so far (`history`, used
    /// by the penalties).
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let uniform = self.draw().unwrap_or(0.0);
        sample_token(&self.params, logits, history, uniform)
    }
}

/// How one sequence picks its next token in a step: plain data the actor hands the
/// model runner with the batch (vLLM's per-request sampling metadata).
///
/// The request's sampler state travels in here as data, not as a handle: the actor
/// draws this token's uniform from the request's seeded RNG ([`Sampler::draw`]) and
/// sends the draw, so the runner keeps no per-request state, nothing has to be
/// created or freed on the runner when requests come and go (or are preempted), and
/// data flows one way: the step's description down, the sampled tokens back. The
/// draws are those the actor's own sampling took before, in the same order (one per
/// sampled token, none when greedy), so seeded requests choose the same tokens. It
/// is also the interface of the GPU sampling kernel, which takes one uniform per row.
#[derive(Clone, Debug, PartialEq)]
pub struct SeqSampling {
    /// The request's settings.
    pub params: SamplingParams,
    /// This token's draw, in `[0, 1)`; `None` when greedy.
    pub uniform: Option<f64>,
    /// The tokens so far (prompt, then output) when a penalty reads them
    /// ([`SamplingParams::penalizes`]); empty otherwise, so the common case copies
    /// nothing per step.
    pub history: Vec<u32>,
    /// Tokens that end the request: the runner checks the sampled token against them.
    pub stop_tokens: Vec<u32>,
    /// Whether to return the sampled token's log-probability.
    pub logprob: bool,
}

/// The token a sequence sampled in a step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampledToken {
    /// The token.
    pub token: u32,
    /// Whether it is one of the sequence's stop tokens (the request ends with it).
    pub stop: bool,
    /// Its log-probability under the model's distribution (the softmax of the raw
    /// logits, before penalties and temperature), when asked for.
    pub logprob: Option<f32>,
}

impl SeqSampling {
    /// The choice from a whole logits row, on the host.
    #[must_use]
    pub fn sample_row(&self, row: &[f32]) -> SampledToken {
        let token = sample_token(
            &self.params,
            row,
            &self.history,
            self.uniform.unwrap_or(0.0),
        );
        let logprob = self.logprob.then(|| {
            crate::kernels::ops::log_softmax(row)
                .get(token as usize)
                .copied()
                .unwrap_or(f32::NEG_INFINITY)
        });
        self.sampled(token, logprob)
    }

    /// `token`, chosen elsewhere (on a device), with its stop check.
    #[must_use]
    pub fn sampled(&self, token: u32, logprob: Option<f32>) -> SampledToken {
        SampledToken {
            token,
            stop: self.stop_tokens.contains(&token),
            logprob,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            seed: 7,
            ..SamplingParams::default()
        }
    }

    #[test]
    fn greedy_picks_argmax_lowest_on_ties() {
        let mut s = Sampler::new(params(0.0));
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0], &[]), 1);
    }

    #[test]
    fn same_seed_same_tokens_and_different_seed_differs() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let run = |seed| {
            let mut s = Sampler::new(SamplingParams {
                seed,
                ..params(1.0)
            });
            (0..64).map(|_| s.sample(&logits, &[])).collect::<Vec<_>>()
        };
        assert_eq!(run(1), run(1));
        assert_ne!(run(1), run(2));
    }

    #[test]
    fn top_k_one_and_tiny_top_p_are_greedy() {
        let logits = [0.5, 2.0, 1.9, 0.0];
        let mut k = Sampler::new(SamplingParams {
            top_k: 1,
            ..params(5.0)
        });
        let mut p = Sampler::new(SamplingParams {
            top_p: 0.01,
            ..params(5.0)
        });
        for _ in 0..32 {
            assert_eq!(k.sample(&logits, &[]), 1);
            assert_eq!(p.sample(&logits, &[]), 1);
        }
    }

    #[test]
    fn top_k_bounds_the_candidates() {
        let logits = [1.0, 1.0, 1.0, 1.0, -5.0];
        let mut s = Sampler::new(SamplingParams {
            top_k: 2,
            ..params(1.0)
        });
        let seen: std::collections::HashSet<u32> =
            (0..200).map(|_| s.sample(&logits, &[])).collect();
        assert_eq!(seen, [0, 1].into_iter().collect());
    }

    #[test]
    fn sampling_follows_the_distribution() {
        // p(0) = e^2 / (e^2 + 1) ≈ 0.88 at temperature 1.
        let mut s = Sampler::new(params(1.0));
        let zeros = (0..2000)
            .filter(|_| s.sample(&[2.0, 0.0], &[]) == 0)
            .count();
        assert!((1650..1870).contains(&zeros), "{zeros}");
    }

    #[test]
    fn penalties_move_greedy_away_from_repeats() {
        let logits = [2.0, 1.9, 0.0];
        let mut rep = Sampler::new(SamplingParams {
            repetition_penalty: 1.2,
            ..params(0.0)
        });
        assert_eq!(rep.sample(&logits, &[0]), 1);
        let mut freq = Sampler::new(SamplingParams {
            frequency_penalty: 0.06,
            ..params(0.0)
        });
        assert_eq!(freq.sample(&logits, &[0]), 0);
        assert_eq!(freq.sample(&logits, &[0, 0]), 1);
        let mut pres = Sampler::new(SamplingParams {
            presence_penalty: 0.5,
            ..params(0.0)
        });
        assert_eq!(pres.sample(&logits, &[0, 0, 0]), 1);
    }

    #[test]
    fn a_sampler_is_its_draws_fed_to_the_rule() {
        // The split the runner relies on: drawing here and sampling elsewhere gives
        // the tokens sampling here gave.
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let p = SamplingParams {
            top_p: 0.8,
            repetition_penalty: 1.1,
            ..params(0.9)
        };
        let (mut whole, mut draws) = (Sampler::new(p.clone()), Sampler::new(p.clone()));
        let history = [3, 4, 4];
        for _ in 0..64 {
            let u = draws.draw().expect("not greedy");
            assert_eq!(
                whole.sample(&logits, &history),
                sample_token(&p, &logits, &history, u)
            );
        }
        assert_eq!(
            Sampler::new(params(0.0)).draw(),
            None,
            "greedy draws nothing"
        );
    }

    #[test]
    fn validate_rejects_bad_ranges() {
        let err = |p: SamplingParams| p.validate().expect_err("out of range");
        let e = err(SamplingParams {
            temperature: -1.0,
            ..SamplingParams::default()
        });
        assert_eq!(e, SamplingError::Temperature(-1.0));
        assert_eq!(e.param(), "temperature");
        let e = err(SamplingParams {
            top_p: 0.0,
            ..SamplingParams::default()
        });
        assert_eq!(e, SamplingError::TopP(0.0));
        assert_eq!(e.param(), "top_p");
        assert_eq!(e.to_string(), "top_p must be in (0, 1], got 0");
        let e = err(SamplingParams {
            presence_penalty: f32::INFINITY,
            ..SamplingParams::default()
        });
        assert_eq!(e, SamplingError::PresencePenalty(f32::INFINITY));
        assert!(SamplingParams::default().validate().is_ok());
    }
}
