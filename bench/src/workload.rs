//! The workload: what each request asks for.
//!
//! A [`WorkloadSpec`] (YAML or JSON) describes prompt and output length
//! distributions, the fraction of requests that share a system prompt (to exercise
//! prefix caches), tenants and deadlines. [`generate`] turns it and a seed into
//! concrete [`RequestPlan`]s, deterministically, so two servers measured one after
//! the other see byte-identical prompts.
//!
//! Prompt text is synthetic: words drawn from a list of common English words, each of
//! which is a single token (with its leading space) for the GPT-2-style BPE
//! vocabularies of small llama-family models, so `prompt_tokens` is close to what the
//! server counts (the server's own count is recorded too). Every unshared prompt starts
//! with a unique request tag so no two requests share a prefix by accident.
//!
//! Two ways to share a prefix: `sharedPrefix` (one system prompt, a fraction of the
//! requests: a hot spot when the fraction is 1) and `systemPrompts` (a multi-tenant
//! workload: a fixed set of system prompts, one per tenant, and every request one of
//! them plus a short user turn).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, LogNormal};
use serde::{Deserialize, Serialize};

use crate::BenchError;

/// A distribution of token counts.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "camelCase")]
pub enum LengthDist {
    /// Always `value`.
    Fixed {
        /// The token count.
        value: u32,
    },
    /// Uniform on `[min, max]`, both inclusive.
    Uniform {
        /// Smallest count.
        min: u32,
        /// Largest count.
        max: u32,
    },
    /// Log-normal with the given median and sigma (of the underlying normal),
    /// clamped to `[min, max]`: the long right tail of real chat prompts.
    LogNormal {
        /// The median token count.
        median: f64,
        /// Sigma of ln(count).
        sigma: f64,
        /// Lower clamp.
        min: u32,
        /// Upper clamp.
        max: u32,
    },
}

impl LengthDist {
    fn validate(&self, what: &str) -> Result<(), BenchError> {
        let bad = |m: String| Err(BenchError::InvalidSpec(format!("{what}: {m}")));
        match *self {
            Self::Fixed { value: 0 } => bad("fixed length must be ≥ 1".into()),
            Self::Uniform { min, max } if min == 0 || min > max => {
                bad(format!("uniform needs 1 ≤ min ≤ max, got [{min}, {max}]"))
            }
            Self::LogNormal {
                median,
                sigma,
                min,
                max,
            } if !(median > 0.0 && sigma >= 0.0 && sigma.is_finite()) || min == 0 || min > max => {
                bad("log-normal needs median > 0, finite sigma ≥ 0, 1 ≤ min ≤ max".into())
            }
            _ => Ok(()),
        }
    }

    fn sample(&self, rng: &mut StdRng) -> u32 {
        match *self {
            Self::Fixed { value } => value,
            Self::Uniform { min, max } => rng.random_range(min..=max),
            Self::LogNormal {
                median,
                sigma,
                min,
                max,
            } => {
                // Validated: median > 0 and sigma finite ≥ 0, so construction cannot fail;
                // fall back to the median rather than panic if it ever did.
                let x = LogNormal::new(median.ln(), sigma).map_or(median, |d| d.sample(rng));
                (x.round() as u32).clamp(min, max)
            }
        }
    }
}

/// Requests that share one system prompt.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SharedPrefix {
    /// Fraction of requests (0..=1) whose prompt starts with the shared prefix.
    pub fraction: f64,
    /// Length of the shared prefix in tokens, counted inside the prompt length. A
    /// sharing request drawn shorter than the prefix plus its tag is lengthened to
    /// that (the prefix is never cut, or it would not be shared), and its plan
    /// carries the real length.
    pub tokens: u32,
}

/// A multi-tenant workload: `count` system prompts (tenant `k` owns prompt `k`), each
/// of a length drawn once from `tokens`; every request is one of them, drawn uniformly,
/// followed by its user turn (`promptTokens`, which then counts the user turn only).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SystemPrompts {
    /// How many distinct system prompts (tenants).
    pub count: u32,
    /// Length of each system prompt, tokens (drawn once per prompt, not per request).
    pub tokens: LengthDist,
}

/// One tenant of a multi-tenant workload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Tenant {
    /// Sent as the OpenAI `user` field, so a server can rate-limit per tenant.
    pub name: String,
    /// Relative share of requests.
    pub weight: f64,
}

/// Which OpenAI endpoint to call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Api {
    /// `/v1/completions` with a raw prompt.
    #[default]
    Completions,
    /// `/v1/chat/completions`; the shared prefix becomes the system message.
    Chat,
}

/// What the requests look like. Defaults are the issue's reference workload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default, deny_unknown_fields)]
pub struct WorkloadSpec {
    /// Prompt length in tokens (including the shared prefix when there is one).
    pub prompt_tokens: LengthDist,
    /// Output length in tokens; sent as `max_tokens` with `ignore_eos` so the server
    /// generates exactly that many.
    pub output_tokens: LengthDist,
    /// Optional shared system prompt.
    pub shared_prefix: Option<SharedPrefix>,
    /// Optional set of per-tenant system prompts (exclusive with `sharedPrefix`).
    pub system_prompts: Option<SystemPrompts>,
    /// Tenants; empty means a single anonymous tenant.
    pub tenants: Vec<Tenant>,
    /// A per-request deadline in milliseconds after arrival; the client cancels a
    /// request still running at its deadline (a user giving up).
    pub deadline_ms: Option<u64>,
    /// Endpoint to call.
    pub api: Api,
}

impl Default for WorkloadSpec {
    fn default() -> Self {
        Self {
            prompt_tokens: LengthDist::Uniform { min: 64, max: 512 },
            output_tokens: LengthDist::Uniform { min: 32, max: 128 },
            shared_prefix: None,
            system_prompts: None,
            tenants: Vec::new(),
            deadline_ms: None,
            api: Api::Completions,
        }
    }
}

impl WorkloadSpec {
    /// Parses YAML (a superset of JSON, so JSON files load too).
    ///
    /// # Errors
    /// [`BenchError::InvalidSpec`] on a parse error or invalid parameters.
    pub fn from_yaml(text: &str) -> Result<Self, BenchError> {
        let spec: Self =
            serde_yaml::from_str(text).map_err(|e| BenchError::InvalidSpec(e.to_string()))?;
        spec.validate()?;
        Ok(spec)
    }

    /// Checks every parameter.
    ///
    /// # Errors
    /// [`BenchError::InvalidSpec`] naming the first bad field.
    pub fn validate(&self) -> Result<(), BenchError> {
        self.prompt_tokens.validate("promptTokens")?;
        self.output_tokens.validate("outputTokens")?;
        if let Some(p) = self.shared_prefix
            && !((0.0..=1.0).contains(&p.fraction) && p.tokens > 0)
        {
            return Err(BenchError::InvalidSpec(
                "sharedPrefix needs 0 ≤ fraction ≤ 1 and tokens ≥ 1".into(),
            ));
        }
        if let Some(p) = self.system_prompts {
            p.tokens.validate("systemPrompts.tokens")?;
            if p.count == 0 {
                return Err(BenchError::InvalidSpec(
                    "systemPrompts needs count ≥ 1".into(),
                ));
            }
            if self.shared_prefix.is_some() {
                return Err(BenchError::InvalidSpec(
                    "sharedPrefix and systemPrompts are exclusive".into(),
                ));
            }
            if !self.tenants.is_empty() {
                return Err(BenchError::InvalidSpec(
                    "with systemPrompts the tenants are the prompts' owners; leave tenants empty"
                        .into(),
                ));
            }
        }
        if self
            .tenants
            .iter()
            .any(|t| !(t.weight.is_finite() && t.weight > 0.0))
        {
            return Err(BenchError::InvalidSpec(
                "tenant weights must be positive".into(),
            ));
        }
        Ok(())
    }

    /// One line describing the workload, for reports and the capacity note.
    #[must_use]
    pub fn describe(&self) -> String {
        let d = |l: &LengthDist| match *l {
            LengthDist::Fixed { value } => format!("{value}"),
            LengthDist::Uniform { min, max } => format!("U[{min},{max}]"),
            LengthDist::LogNormal {
                median,
                sigma,
                min,
                max,
            } => {
                format!("LogN(median {median}, σ {sigma})∩[{min},{max}]")
            }
        };
        let mut s = match self.system_prompts {
            Some(p) => format!(
                "{} system prompts of {} tok + user turn {} tok, output {} tok, {:?}",
                p.count,
                d(&p.tokens),
                d(&self.prompt_tokens),
                d(&self.output_tokens),
                self.api
            ),
            None => format!(
                "prompt {} tok, output {} tok, {:?}",
                d(&self.prompt_tokens),
                d(&self.output_tokens),
                self.api
            ),
        };
        if let Some(p) = self.shared_prefix {
            s += &format!(
                ", {:.0}% share a {}-tok prefix",
                p.fraction * 100.0,
                p.tokens
            );
        }
        if !self.tenants.is_empty() {
            s += &format!(", {} tenants", self.tenants.len());
        }
        if let Some(d) = self.deadline_ms {
            s += &format!(", deadline {d} ms");
        }
        s
    }
}

/// One concrete request, fully decided before the run starts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RequestPlan {
    /// Index in the run, also the request tag inside the prompt.
    pub id: u64,
    /// Arrival offset from the start of the run, seconds (open loop and replay).
    pub arrival_s: f64,
    /// System prompt (the shared prefix), if this request has one.
    pub system: Option<String>,
    /// The user prompt.
    pub prompt: String,
    /// Intended prompt length in tokens (system + prompt); used for length buckets.
    pub prompt_tokens: u32,
    /// Tokens to generate.
    pub max_tokens: u32,
    /// Tenant name, if any.
    pub tenant: Option<String>,
    /// Give up after this many milliseconds.
    pub deadline_ms: Option<u64>,
}

/// Common English words that are one token each (with a leading space) in GPT-2-style
/// BPE vocabularies; the exact count is checked against the server's `usage`.
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "time", "people", "year",
    "water", "city", "house", "world", "light", "river", "music", "school", "market", "garden",
    "paper", "story", "table", "window", "family", "power", "money", "letter", "mountain",
    "morning", "night", "road", "ship", "train", "friend", "color", "number", "voice", "field",
];

/// Tokens the request tag ("Request 123:") is counted as; the server's own count is
/// recorded, and the real-engine test checks the two agree.
const TAG_TOKENS: u32 = 4;

/// Deterministic text of `n` single-token words drawn with `rng`.
fn words(rng: &mut StdRng, n: u32) -> String {
    let mut s = String::with_capacity(n as usize * 6);
    for i in 0..n {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(WORDS[rng.random_range(0..WORDS.len())]);
    }
    s
}

/// The shared system prompt: a fixed function of its length, independent of the seed,
/// so every run and every server sees the same one.
#[must_use]
pub fn shared_prefix_text(tokens: u32) -> String {
    words(&mut StdRng::seed_from_u64(0x5eed_5a7e), tokens)
}

/// The system prompts of a `systemPrompts` workload, `(tokens, text)` each: a fixed
/// function of the spec, independent of the run's seed, so every point of a sweep and
/// every server or routing policy sees the same tenants. Each prompt is drawn from its
/// own stream, so no two share a first block by construction of the seed.
#[must_use]
pub fn system_prompt_texts(p: &SystemPrompts) -> Vec<(u32, String)> {
    let mut lengths = StdRng::seed_from_u64(0x7e4a_4e75);
    (0..p.count)
        .map(|k| {
            let tokens = p.tokens.sample(&mut lengths);
            let mut rng = StdRng::seed_from_u64(0x5eed_5a7e ^ u64::from(k + 1).rotate_left(17));
            (tokens, words(&mut rng, tokens))
        })
        .collect()
}

/// The prompt seed of one measured point of a run at `rate`: the same for every server
/// measured at that rate (so they see identical prompts), different between rates (so
/// no point's prompts are already in a prefix cache from an earlier point).
#[must_use]
pub fn point_seed(seed: u64, rate: f64) -> u64 {
    seed ^ rate
        .to_bits()
        .rotate_left(29)
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// Draws `arrivals.len()` requests from `spec`; request `i` arrives at `arrivals[i]`.
///
/// # Errors
/// [`BenchError::InvalidSpec`] when the spec is invalid.
pub fn generate(
    spec: &WorkloadSpec,
    arrivals: &[f64],
    seed: u64,
) -> Result<Vec<RequestPlan>, BenchError> {
    spec.validate()?;
    // A separate stream from the arrival schedule's, so changing the rate does not
    // change which prompts are drawn.
    let mut rng = StdRng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15);
    let total_weight: f64 = spec.tenants.iter().map(|t| t.weight).sum();
    let prefix = spec
        .shared_prefix
        .map(|p| (p, shared_prefix_text(p.tokens)));
    let systems = spec.system_prompts.as_ref().map(system_prompt_texts);
    let mut out = Vec::with_capacity(arrivals.len());
    for (i, &arrival_s) in arrivals.iter().enumerate() {
        let prompt_tokens = spec.prompt_tokens.sample(&mut rng);
        let max_tokens = spec.output_tokens.sample(&mut rng);
        if let Some(systems) = &systems {
            // The user turn is `promptTokens` long on top of the tenant's system prompt.
            let k = rng.random_range(0..systems.len());
            let (system_tokens, text) = &systems[k];
            let user_words = prompt_tokens.saturating_sub(TAG_TOKENS);
            let tag = format!("Request {i}:");
            let body = words(&mut rng, user_words);
            out.push(RequestPlan {
                id: i as u64,
                arrival_s,
                system: Some(text.clone()),
                prompt: if body.is_empty() {
                    tag
                } else {
                    format!("{tag} {body}")
                },
                prompt_tokens: system_tokens + TAG_TOKENS + user_words,
                max_tokens,
                tenant: Some(format!("tenant-{k}")),
                deadline_ms: spec.deadline_ms,
            });
            continue;
        }
        let system = match &prefix {
            Some((p, text)) if rng.random_bool(p.fraction) => Some((p.tokens, text.clone())),
            _ => None,
        };
        let tenant = if spec.tenants.is_empty() {
            None
        } else {
            let mut x = rng.random_range(0.0..total_weight);
            let mut pick = &spec.tenants[spec.tenants.len() - 1];
            for t in &spec.tenants {
                if x < t.weight {
                    pick = t;
                    break;
                }
                x -= t.weight;
            }
            Some(pick.name.clone())
        };
        // The tag costs a few tokens; the rest are words. A sharing prompt is at
        // least the prefix plus the tag.
        let prefix_tokens = system.as_ref().map_or(0, |(t, _)| *t);
        let prompt_tokens = prompt_tokens.max(prefix_tokens + TAG_TOKENS);
        let tag = format!("Request {i}:");
        let user_words = prompt_tokens - prefix_tokens - TAG_TOKENS;
        let body = words(&mut rng, user_words);
        out.push(RequestPlan {
            id: i as u64,
            arrival_s,
            system: system.map(|(_, text)| text),
            prompt: if body.is_empty() {
                tag
            } else {
                format!("{tag} {body}")
            },
            prompt_tokens,
            max_tokens,
            tenant,
            deadline_ms: spec.deadline_ms,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_spec_round_trips_and_defaults_fill_in() {
        let y = "promptTokens: {kind: fixed, value: 100}\n\
                 sharedPrefix: {fraction: 0.5, tokens: 256}\n\
                 tenants: [{name: a, weight: 3}, {name: b, weight: 1}]\n\
                 deadlineMs: 5000\napi: chat\n";
        let s = WorkloadSpec::from_yaml(y).unwrap();
        assert_eq!(s.prompt_tokens, LengthDist::Fixed { value: 100 });
        assert_eq!(s.output_tokens, WorkloadSpec::default().output_tokens);
        assert_eq!(s.api, Api::Chat);
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(WorkloadSpec::from_yaml(&json).unwrap(), s);
    }

    #[test]
    fn invalid_specs_are_rejected_with_the_field_named() {
        let e =
            WorkloadSpec::from_yaml("promptTokens: {kind: uniform, min: 10, max: 5}").unwrap_err();
        assert!(e.to_string().contains("promptTokens"), "{e}");
        assert!(WorkloadSpec::from_yaml("sharedPrefix: {fraction: 1.5, tokens: 3}").is_err());
        assert!(WorkloadSpec::from_yaml("nonsense: 1").is_err());
    }

    #[test]
    fn generation_is_deterministic_and_respects_lengths() {
        let spec = WorkloadSpec::default();
        let arrivals: Vec<f64> = (0..200).map(f64::from).collect();
        let a = generate(&spec, &arrivals, 5).unwrap();
        assert_eq!(a, generate(&spec, &arrivals, 5).unwrap());
        for r in &a {
            assert!((64..=512).contains(&r.prompt_tokens));
            assert!((32..=128).contains(&r.max_tokens));
            // Tag (≈4 tokens) plus one word per remaining token.
            let n_words = r.prompt.split(' ').count() as u32;
            assert_eq!(n_words, 2 + r.prompt_tokens - 4);
        }
    }

    #[test]
    fn shared_prefix_fraction_and_tenant_weights_are_honoured() {
        let spec = WorkloadSpec {
            shared_prefix: Some(SharedPrefix {
                fraction: 0.5,
                tokens: 256,
            }),
            prompt_tokens: LengthDist::Uniform { min: 300, max: 400 },
            tenants: vec![
                Tenant {
                    name: "a".into(),
                    weight: 3.0,
                },
                Tenant {
                    name: "b".into(),
                    weight: 1.0,
                },
            ],
            ..WorkloadSpec::default()
        };
        let arrivals = vec![0.0; 4000];
        let reqs = generate(&spec, &arrivals, 9).unwrap();
        let shared: Vec<_> = reqs.iter().filter_map(|r| r.system.as_ref()).collect();
        // Binomial(4000, 0.5): sd ≈ 32, so ±200 is > 6 sigma.
        assert!((shared.len() as i64 - 2000).abs() < 200, "{}", shared.len());
        assert!(shared.iter().all(|s| **s == shared_prefix_text(256)));
        let a = reqs
            .iter()
            .filter(|r| r.tenant.as_deref() == Some("a"))
            .count();
        assert!((a as i64 - 3000).abs() < 200, "{a}");
        // Unshared prompts never share their first words: each starts with its own tag.
        assert!(reqs[1].prompt.starts_with("Request 1:"));
    }

    #[test]
    fn system_prompts_are_fixed_per_tenant_and_every_request_has_one() {
        let spec = WorkloadSpec {
            system_prompts: Some(SystemPrompts {
                count: 8,
                tokens: LengthDist::Uniform { min: 300, max: 500 },
            }),
            prompt_tokens: LengthDist::Uniform { min: 16, max: 48 },
            ..WorkloadSpec::default()
        };
        spec.validate().unwrap();
        let systems = system_prompt_texts(&spec.system_prompts.unwrap());
        assert_eq!(systems.len(), 8);
        for (tokens, text) in &systems {
            assert!((300..=500).contains(tokens), "{tokens}");
            assert_eq!(text.split(' ').count() as u32, *tokens);
        }
        // Distinct from their first block (16 tokens) on.
        let starts: std::collections::HashSet<String> = systems
            .iter()
            .map(|(_, t)| t.split(' ').take(16).collect::<Vec<_>>().join(" "))
            .collect();
        assert_eq!(starts.len(), 8);
        let arrivals = vec![0.0; 4000];
        // Independent of the seed: two points of a sweep see the same tenants.
        let (a, b) = (
            generate(&spec, &arrivals, 1).unwrap(),
            generate(&spec, &arrivals, 2).unwrap(),
        );
        assert_ne!(a, b);
        let mut per_tenant = std::collections::HashMap::new();
        for r in a.iter().chain(&b) {
            let tenant = r.tenant.as_deref().unwrap();
            let k: usize = tenant.strip_prefix("tenant-").unwrap().parse().unwrap();
            let (tokens, text) = &systems[k];
            assert_eq!(r.system.as_deref(), Some(text.as_str()));
            let user_words = r.prompt.split(' ').count() as u32 - 2;
            assert!((12..=44).contains(&user_words), "{user_words}");
            assert_eq!(r.prompt_tokens, tokens + TAG_TOKENS + user_words);
            *per_tenant.entry(k).or_insert(0u32) += 1;
        }
        // Uniform over 8 tenants: 1000 each of 8000, sd ≈ 30, so ±200 is > 6 sigma.
        assert_eq!(per_tenant.len(), 8);
        assert!(
            per_tenant.values().all(|n| (800..1200).contains(n)),
            "{per_tenant:?}"
        );
        assert!(
            spec.describe()
                .starts_with("8 system prompts of U[300,500] tok")
        );
    }

    #[test]
    fn system_prompts_exclude_a_shared_prefix_and_explicit_tenants() {
        let y = "systemPrompts: {count: 2, tokens: {kind: fixed, value: 10}}\n";
        assert!(WorkloadSpec::from_yaml(y).is_ok());
        let both = format!("{y}sharedPrefix: {{fraction: 1, tokens: 5}}\n");
        assert!(WorkloadSpec::from_yaml(&both).is_err());
        let tenants = format!("{y}tenants: [{{name: a, weight: 1}}]\n");
        assert!(WorkloadSpec::from_yaml(&tenants).is_err());
        assert!(
            WorkloadSpec::from_yaml("systemPrompts: {count: 0, tokens: {kind: fixed, value: 1}}")
                .is_err()
        );
    }

    #[test]
    fn points_at_different_rates_never_share_prompts() {
        let spec = WorkloadSpec::default();
        let arrivals = vec![0.0; 50];
        let at = |rate: f64| generate(&spec, &arrivals, point_seed(1, rate)).unwrap();
        assert_eq!(at(0.3), at(0.3));
        let (a, b) = (at(0.3), at(0.375));
        for (x, y) in a.iter().zip(&b) {
            // Same tag, but the words after it differ within the first KV block.
            let (wx, wy): (Vec<&str>, Vec<&str>) = (
                x.prompt.split(' ').skip(2).take(12).collect(),
                y.prompt.split(' ').skip(2).take(12).collect(),
            );
            assert_ne!(wx, wy, "request {} repeats its prompt start", x.id);
        }
    }

    #[test]
    fn bench_serving_workload_files_are_the_issues_workloads() {
        let a = WorkloadSpec::from_yaml(include_str!("../workloads/reference.yaml")).unwrap();
        assert_eq!(a, WorkloadSpec::default());
        let b = WorkloadSpec::from_yaml(include_str!("../workloads/shared-prefix.yaml")).unwrap();
        assert_eq!(
            b,
            WorkloadSpec {
                shared_prefix: Some(SharedPrefix {
                    fraction: 0.5,
                    tokens: 256
                }),
                ..WorkloadSpec::default()
            }
        );
        assert!(
            b.describe().contains("50% share a 256-tok prefix"),
            "{}",
            b.describe()
        );
    }

    #[test]
    fn half_the_shared_prefix_workload_starts_with_the_same_256_words() {
        let spec =
            WorkloadSpec::from_yaml(include_str!("../workloads/shared-prefix.yaml")).unwrap();
        let arrivals = vec![0.0; 2000];
        let reqs = generate(&spec, &arrivals, 1).unwrap();
        let prefix = shared_prefix_text(256);
        assert_eq!(prefix.split(' ').count(), 256);
        let sharing: Vec<_> = reqs.iter().filter(|r| r.system.is_some()).collect();
        // Binomial(2000, 0.5): sd ≈ 22, so ±150 is > 6 sigma.
        assert!(
            (sharing.len() as i64 - 1000).abs() < 150,
            "{}",
            sharing.len()
        );
        for r in &reqs {
            let user_words = r.prompt.split(' ').count() as u32 - 2;
            match &r.system {
                Some(s) => {
                    assert_eq!(*s, prefix);
                    // The prefix is never cut: short draws are lengthened to hold it.
                    assert!(
                        (260..=512).contains(&r.prompt_tokens),
                        "{}",
                        r.prompt_tokens
                    );
                    assert_eq!(256 + TAG_TOKENS + user_words, r.prompt_tokens);
                }
                None => {
                    assert!((64..=512).contains(&r.prompt_tokens));
                    assert_eq!(TAG_TOKENS + user_words, r.prompt_tokens);
                }
            }
        }
        // The same seed gives the same requests, so both servers see identical prompts.
        assert_eq!(reqs, generate(&spec, &arrivals, 1).unwrap());
    }
}
