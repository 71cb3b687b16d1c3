//! Teacher-forced agreement with a llama.cpp oracle, shared by the base model's
//! oracle test (`model_oracle.rs`) and the LoRA adapter's (`lora_oracle.rs`): both
//! hold our engine to the same bar.
//!
//! The bar: at every position where llama.cpp's top-1 leads its top-2 by at least
//! 1.0 nat our argmax is the same token; at least 95 % of all positions agree; the
//! mean |Δ log-probability| of the actual token is at most 0.3.

use slipway_engine::generate::PositionScore;
use slipway_engine::testing::{Oracle, OraclePrompt};
use slipway_engine::tokenizer::{DecodeOptions, Tokenizer};

/// How our scores compare with an oracle's over all usable positions.
#[derive(Debug, Default)]
pub struct Agreement {
    /// Positions compared.
    pub total: usize,
    /// Of those, where our argmax is llama.cpp's top-1.
    pub agree: usize,
    /// Positions where llama.cpp's top-1 margin is ≥ 1.0.
    pub confident: usize,
    /// Of those, where we agree.
    pub confident_agree: usize,
    /// Mean |our log-probability − llama.cpp's| of the actual next token.
    pub mean_delta: f64,
    /// The confident positions that disagree, described.
    pub failures: Vec<String>,
}

impl Agreement {
    /// One line of numbers, for the test's output.
    pub fn summary(&self) -> String {
        format!(
            "{}/{} argmax agree ({:.1}%), {}/{} where margin >= 1.0, mean |Δ logprob| = {:.4}",
            self.agree,
            self.total,
            100.0 * self.agree as f64 / self.total.max(1) as f64,
            self.confident_agree,
            self.confident,
            self.mean_delta
        )
    }

    /// Panics unless the bar in the module docs is met.
    pub fn assert_bar(&self, what: &str) {
        assert!(self.total > 0, "{what}: no position compared");
        assert!(
            self.failures.is_empty(),
            "{what}: confident positions disagree:\n{}",
            self.failures.join("\n")
        );
        assert!(
            self.agree as f64 >= 0.95 * self.total as f64,
            "{what}: only {}/{} positions agree",
            self.agree,
            self.total
        );
        assert!(
            self.mean_delta <= 0.3,
            "{what}: mean logprob delta {}",
            self.mean_delta
        );
    }
}

/// Scores the oracle's prompts teacher-forced through `score` (see [`teacher_forced`]),
/// prints the numbers under `what` and holds them to the bar.
///
/// # Panics
/// Where [`Agreement::assert_bar`] does.
pub fn assert_agrees(
    what: &str,
    oracle: &Oracle,
    tokenizer: &Tokenizer,
    score: impl FnMut(&[u32]) -> Vec<PositionScore>,
) {
    let a = teacher_forced(oracle, tokenizer, score);
    println!("{what}, teacher-forced: {}", a.summary());
    a.assert_bar(what);
}

/// How many leading steps of `p` llama.cpp actually conditioned on as recorded.
///
/// The oracle's `continuation` ids lose byte tokens where a character spans
/// several tokens (its `continuation_text` shows the full character, the ids only
/// its last bytes), so after the first such gap llama.cpp's `steps` were computed
/// from a history the ids do not reproduce. A step counts while the bytes of the
/// ids up to and including it are a prefix of `continuation_text`.
pub fn consistent_steps(tokenizer: &Tokenizer, p: &OraclePrompt) -> usize {
    let text = p.continuation_text.as_bytes();
    (0..p.steps.len())
        .take_while(|&i| {
            let bytes = tokenizer
                .decode_bytes(&p.continuation[..=i], DecodeOptions { skip_special: true })
                .expect("oracle ids decode");
            text.starts_with(&bytes)
        })
        .count()
}

/// Scores every oracle prompt with its recorded continuation through `score`
/// (teacher-forced: `score(tokens)[i]` rates `tokens[i + 1]`) and compares each
/// usable step with llama.cpp's.
pub fn teacher_forced(
    oracle: &Oracle,
    tokenizer: &Tokenizer,
    mut score: impl FnMut(&[u32]) -> Vec<PositionScore>,
) -> Agreement {
    let mut a = Agreement::default();
    let mut lp_delta = 0f64;
    for p in &oracle.prompts {
        let mut tokens = p.prompt_tokens.clone();
        tokens.extend(&p.continuation);
        let scores = score(&tokens);
        // scores[i] predicts tokens[i + 1]; the continuation starts at prompt_len.
        let first = p.prompt_tokens.len() - 1;
        let usable = consistent_steps(tokenizer, p);
        if usable < p.steps.len() {
            println!(
                "{}: {} of {} steps usable (the oracle's ids drop bytes of a split character there)",
                p.id,
                usable,
                p.steps.len()
            );
        }
        for (i, step) in p.steps.iter().enumerate().take(usable) {
            let s = &scores[first + i];
            assert_eq!(
                s.token, step.token,
                "{}: continuation/step mismatch in the oracle",
                p.id
            );
            let (top1, lp1) = step.top[0];
            let margin = lp1 - step.top.get(1).map_or(f32::NEG_INFINITY, |t| t.1);
            a.total += 1;
            let ok = s.argmax == top1;
            a.agree += usize::from(ok);
            if margin >= 1.0 {
                a.confident += 1;
                a.confident_agree += usize::from(ok);
                if !ok {
                    a.failures.push(format!(
                        "{} step {i}: ours {} vs llama.cpp {top1} (margin {margin:.2})",
                        p.id, s.argmax
                    ));
                }
            }
            lp_delta += f64::from(
                (s.logprob
                    - step
                        .top
                        .iter()
                        .find(|t| t.0 == step.token)
                        .map_or(lp1, |t| t.1))
                .abs(),
            );
        }
    }
    a.mean_delta = lp_delta / a.total.max(1) as f64;
    a
}
