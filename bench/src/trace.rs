//! Replay of a recorded trace (JSONL, one request per line).
//!
//! Each line has an arrival time (`timestamp` in seconds from the start of the trace,
//! or `arrivalMs`), either a literal `prompt` or a `promptTokens` count (synthetic text
//! of that length is generated), `outputTokens`, and optionally `tenant` and
//! `deadlineMs`. Lines are sorted by arrival; the first arrival is kept as-is (a
//! trace that starts at t = 5 s waits 5 s), and `speedup` divides every offset.
//!
//! Blank lines and lines starting with `#` are skipped; any other unparsable line is
//! an error naming its line number, never silently dropped.

use rand::SeedableRng;
use rand::rngs::StdRng;
use serde::Deserialize;

use crate::BenchError;
use crate::workload::RequestPlan;

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct TraceLine {
    timestamp: Option<f64>,
    arrival_ms: Option<f64>,
    prompt: Option<String>,
    system: Option<String>,
    prompt_tokens: Option<u32>,
    output_tokens: u32,
    tenant: Option<String>,
    deadline_ms: Option<u64>,
}

/// Parses a JSONL trace into request plans, sorted by arrival and divided by `speedup`.
///
/// # Errors
/// [`BenchError::Trace`] naming the first bad line.
pub fn parse_trace(text: &str, speedup: f64, seed: u64) -> Result<Vec<RequestPlan>, BenchError> {
    if !(speedup.is_finite() && speedup > 0.0) {
        return Err(BenchError::InvalidSpec(format!(
            "speedup must be positive, got {speedup}"
        )));
    }
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line_no = n + 1;
        let trimmed = line.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let bad = |msg: String| BenchError::Trace { line: line_no, msg };
        let l: TraceLine = serde_json::from_str(trimmed).map_err(|e| bad(e.to_string()))?;
        let arrival_s = match (l.timestamp, l.arrival_ms) {
            (Some(t), None) => t,
            (None, Some(ms)) => ms / 1000.0,
            _ => {
                return Err(bad(
                    "exactly one of `timestamp` and `arrivalMs` is required".into(),
                ));
            }
        };
        if !(arrival_s.is_finite() && arrival_s >= 0.0) {
            return Err(bad(format!("arrival time must be ≥ 0, got {arrival_s}")));
        }
        if l.output_tokens == 0 {
            return Err(bad("outputTokens must be ≥ 1".into()));
        }
        let (prompt, prompt_tokens) = match (l.prompt, l.prompt_tokens) {
            // A literal prompt's token count is unknown until the server reports it;
            // word count is a stand-in for length bucketing only.
            (Some(p), tokens) => {
                let est = tokens.unwrap_or(p.split_whitespace().count() as u32);
                (p, est)
            }
            (None, Some(t)) if t > 0 => {
                let plan = crate::workload::generate(
                    &crate::workload::WorkloadSpec {
                        prompt_tokens: crate::workload::LengthDist::Fixed { value: t },
                        ..Default::default()
                    },
                    &[0.0],
                    rand::Rng::random(&mut rng),
                )?;
                (
                    plan[0]
                        .prompt
                        .replacen("Request 0:", &format!("Request {n}:"), 1),
                    t,
                )
            }
            _ => {
                return Err(bad(
                    "either `prompt` or a positive `promptTokens` is required".into(),
                ));
            }
        };
        out.push(RequestPlan {
            id: 0,
            arrival_s: arrival_s / speedup,
            system: l.system,
            prompt,
            prompt_tokens,
            max_tokens: l.output_tokens,
            tenant: l.tenant,
            deadline_ms: l.deadline_ms,
        });
    }
    out.sort_by(|a, b| a.arrival_s.total_cmp(&b.arrival_s));
    for (i, r) in out.iter_mut().enumerate() {
        r.id = i as u64;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sorts_and_scales_a_trace() {
        let t = r#"
# a comment
{"timestamp": 2.0, "promptTokens": 50, "outputTokens": 8, "tenant": "t1"}
{"arrivalMs": 500, "prompt": "hello there world", "outputTokens": 4, "deadlineMs": 900}

"#;
        let r = parse_trace(t, 2.0, 1).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].arrival_s, 0.25);
        assert_eq!(r[0].prompt, "hello there world");
        assert_eq!(r[0].prompt_tokens, 3);
        assert_eq!(r[0].deadline_ms, Some(900));
        assert_eq!(r[1].arrival_s, 1.0);
        assert_eq!(r[1].prompt_tokens, 50);
        assert_eq!(r[1].tenant.as_deref(), Some("t1"));
        assert_eq!((r[0].id, r[1].id), (0, 1));
    }

    #[test]
    fn bad_lines_are_errors_with_line_numbers() {
        let e = parse_trace("{\"timestamp\": 1, \"outputTokens\": 3}\n", 1.0, 0).unwrap_err();
        assert!(matches!(e, BenchError::Trace { line: 1, .. }), "{e}");
        let e = parse_trace("\n{\"timestamp\": 1, \"prompt\": \"x\"}", 1.0, 0).unwrap_err();
        assert!(matches!(e, BenchError::Trace { line: 2, .. }), "{e}");
        assert!(parse_trace("not json", 1.0, 0).is_err());
        let both = r#"{"timestamp": 1, "arrivalMs": 1, "prompt": "x", "outputTokens": 1}"#;
        assert!(parse_trace(both, 1.0, 0).is_err());
    }
}
