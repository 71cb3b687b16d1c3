//! Safe retries: what to do after an attempt failed, and how long an endpoint that said
//! "busy" is left alone.
//!
//! A request is retried on the next endpoint of its ranking only when the client cannot
//! have seen anything of the failed attempt and the failure says the engine did not take
//! the work: a connection failure, or a 503 (draining, overloaded) or 429 (queue full)
//! answered before the first byte of the body reached the client. Never after that
//! byte — the client would get a second, spliced answer — and never on a 500 or another
//! 4xx, which would fail the same way elsewhere (or have done work already). Retries are
//! bounded in count and in total time.
//!
//! Pure: elapsed times and `now` are parameters.

use std::time::{Duration, Instant, SystemTime};

/// The longest `Retry-After` the router honours: an engine asking for more is treated as
/// asking for this, so a bad header cannot take an endpoint out for hours.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(600);

/// How long an endpoint that answered 503/429 without `Retry-After` gets nothing new.
pub const DEFAULT_BACKOFF: Duration = Duration::from_secs(1);

/// The retry bounds (`--max-retries`, `--retry-budget-ms`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Most retries after the first attempt.
    pub max_retries: u32,
    /// Most time since the request arrived at which a retry may still start.
    pub budget: Duration,
}

/// How one attempt failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// No connection (refused, reset before an answer, timed out connecting).
    Connect,
    /// The engine answered this status before any byte of the body reached the client.
    Status {
        /// The HTTP status.
        code: u16,
        /// Its `Retry-After`, parsed ([`parse_retry_after`]).
        retry_after: Option<Duration>,
    },
    /// The upstream broke after the first byte reached the client.
    AfterFirstByte,
}

impl Failure {
    /// The engine did not take the work and nothing reached the client.
    fn is_retryable(&self) -> bool {
        match self {
            Self::Connect => true,
            Self::Status { code, .. } => matches!(code, 429 | 503),
            Self::AfterFirstByte => false,
        }
    }
}

/// What to do after a failed attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// Try the next endpoint of the ranking.
    RetryOnNext,
    /// Answer the client with this failure.
    GiveUp,
}

impl RetryPolicy {
    /// The policy `args` gives.
    #[must_use]
    pub fn from_args(args: &slipway_contract::router::RouterArgs) -> Self {
        Self {
            max_retries: args.max_retries,
            budget: args.retry_budget,
        }
    }

    /// After `failure`, with `retries_so_far` retries already made and `elapsed` since
    /// the request arrived: retry only a connection failure or a 503/429, only while
    /// `retries_so_far < max_retries` and `elapsed < budget`; after the first byte,
    /// never.
    #[must_use]
    pub fn after(&self, failure: &Failure, retries_so_far: u32, elapsed: Duration) -> Next {
        if failure.is_retryable() && retries_so_far < self.max_retries && elapsed < self.budget {
            Next::RetryOnNext
        } else {
            Next::GiveUp
        }
    }
}

/// Retry-After as seconds (integer) or an HTTP date relative to `now_unix_secs`; None if
/// absent/unparseable; capped at 10 minutes ([`MAX_RETRY_AFTER`]).
///
/// A date in the past means "now" (zero). A number too large for a u64 is still a
/// number of seconds, so it is capped rather than ignored.
#[must_use]
pub fn parse_retry_after(value: &str, now_unix_secs: u64) -> Option<Duration> {
    let value = value.trim();
    if value.is_empty() {
        return None;
    }
    if value.bytes().all(|b| b.is_ascii_digit()) {
        let secs = value.parse::<u64>().unwrap_or(u64::MAX);
        return Some(Duration::from_secs(secs).min(MAX_RETRY_AFTER));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    let at_unix = at.duration_since(SystemTime::UNIX_EPOCH).ok()?;
    let wait = at_unix.saturating_sub(Duration::from_secs(now_unix_secs));
    Some(wait.min(MAX_RETRY_AFTER))
}

/// How long an endpoint gets nothing new after a 503/429: its Retry-After, else a
/// default of 1 s ([`DEFAULT_BACKOFF`]). Capped at [`MAX_RETRY_AFTER`] whatever the
/// caller parsed.
#[must_use]
pub fn backoff_for(retry_after: Option<Duration>) -> Duration {
    retry_after.unwrap_or(DEFAULT_BACKOFF).min(MAX_RETRY_AFTER)
}

/// When every endpoint of the release is excluded/saturated: the Retry-After (whole
/// seconds ≥ 1) the router answers with, from the soonest backoff end among them, else
/// 1 s.
///
/// Backoffs already over are ignored (those endpoints were excluded for another reason,
/// such as saturation, which a second is the router's guess for). Rounded up, so a client
/// that honours it does not come back just before the endpoint is free.
#[must_use]
pub fn retry_after_when_all_busy(backoffs: &[Instant], now: Instant) -> u64 {
    backoffs
        .iter()
        .filter(|&&until| until > now)
        .map(|&until| until.saturating_duration_since(now))
        .min()
        .map_or(1, |wait| {
            let whole = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
            whole.clamp(1, MAX_RETRY_AFTER.as_secs())
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: RetryPolicy = RetryPolicy {
        max_retries: 2,
        budget: Duration::from_secs(5),
    };

    fn status(code: u16) -> Failure {
        Failure::Status {
            code,
            retry_after: None,
        }
    }

    #[test]
    fn retries_connect_503_and_429_within_bounds() {
        for failure in [
            Failure::Connect,
            status(503),
            status(429),
            Failure::Status {
                code: 503,
                retry_after: Some(Duration::from_secs(30)),
            },
        ] {
            assert_eq!(
                POLICY.after(&failure, 0, Duration::ZERO),
                Next::RetryOnNext,
                "{failure:?}"
            );
            assert_eq!(
                POLICY.after(&failure, 1, Duration::from_millis(4_999)),
                Next::RetryOnNext,
                "{failure:?}"
            );
        }
    }

    #[test]
    fn other_statuses_are_not_retried() {
        for code in [400, 401, 403, 404, 408, 413, 422, 500, 501, 502, 504, 200] {
            assert_eq!(
                POLICY.after(&status(code), 0, Duration::ZERO),
                Next::GiveUp,
                "status {code}"
            );
        }
    }

    #[test]
    fn retries_stop_at_the_count() {
        assert_eq!(
            POLICY.after(&Failure::Connect, 1, Duration::ZERO),
            Next::RetryOnNext
        );
        assert_eq!(
            POLICY.after(&Failure::Connect, 2, Duration::ZERO),
            Next::GiveUp
        );
        assert_eq!(POLICY.after(&status(503), 3, Duration::ZERO), Next::GiveUp);
        let none = RetryPolicy {
            max_retries: 0,
            ..POLICY
        };
        assert_eq!(
            none.after(&Failure::Connect, 0, Duration::ZERO),
            Next::GiveUp
        );
    }

    #[test]
    fn retries_stop_at_the_budget() {
        assert_eq!(
            POLICY.after(&Failure::Connect, 0, Duration::from_secs(5)),
            Next::GiveUp
        );
        assert_eq!(
            POLICY.after(&status(429), 0, Duration::from_secs(60)),
            Next::GiveUp
        );
    }

    #[test]
    fn never_after_the_first_byte() {
        let generous = RetryPolicy {
            max_retries: u32::MAX,
            budget: Duration::MAX,
        };
        for policy in [POLICY, generous] {
            for retries in [0, 1, 2, 100, u32::MAX] {
                for elapsed in [
                    Duration::ZERO,
                    Duration::from_millis(1),
                    Duration::from_secs(3),
                ] {
                    assert_eq!(
                        policy.after(&Failure::AfterFirstByte, retries, elapsed),
                        Next::GiveUp,
                        "{policy:?} retries {retries} elapsed {elapsed:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn retry_after_seconds() {
        assert_eq!(parse_retry_after("0", 0), Some(Duration::ZERO));
        assert_eq!(parse_retry_after("5", 0), Some(Duration::from_secs(5)));
        assert_eq!(
            parse_retry_after(" 120 ", 0),
            Some(Duration::from_secs(120))
        );
        assert_eq!(parse_retry_after("600", 0), Some(MAX_RETRY_AFTER));
        assert_eq!(parse_retry_after("86400", 0), Some(MAX_RETRY_AFTER));
        assert_eq!(
            parse_retry_after("99999999999999999999999", 0),
            Some(MAX_RETRY_AFTER)
        );
    }

    #[test]
    fn retry_after_http_date() {
        // Sun, 06 Nov 1994 08:49:37 GMT is 784111777 (RFC 9110's example date).
        let date = "Sun, 06 Nov 1994 08:49:37 GMT";
        assert_eq!(
            parse_retry_after(date, 784_111_777 - 30),
            Some(Duration::from_secs(30))
        );
        assert_eq!(parse_retry_after(date, 784_111_777), Some(Duration::ZERO));
        assert_eq!(
            parse_retry_after(date, 784_111_777 + 3_600),
            Some(Duration::ZERO),
            "a date in the past means now"
        );
        assert_eq!(
            parse_retry_after(date, 784_111_777 - 86_400),
            Some(MAX_RETRY_AFTER)
        );
        // The obsolete formats HTTP still accepts.
        assert_eq!(
            parse_retry_after("Sunday, 06-Nov-94 08:49:37 GMT", 784_111_777 - 7),
            Some(Duration::from_secs(7))
        );
        assert_eq!(
            parse_retry_after("Sun Nov  6 08:49:37 1994", 784_111_777 - 7),
            Some(Duration::from_secs(7))
        );
    }

    #[test]
    fn retry_after_unparseable_is_none() {
        for value in [
            "",
            "  ",
            "-5",
            "1.5",
            "soon",
            "5s",
            "+5",
            "Sun, 32 Nov 1994 08:49:37 GMT",
        ] {
            assert_eq!(parse_retry_after(value, 0), None, "{value:?}");
        }
    }

    #[test]
    fn backoff_is_retry_after_or_one_second() {
        assert_eq!(backoff_for(None), Duration::from_secs(1));
        assert_eq!(
            backoff_for(Some(Duration::from_secs(7))),
            Duration::from_secs(7)
        );
        assert_eq!(backoff_for(Some(Duration::ZERO)), Duration::ZERO);
        assert_eq!(
            backoff_for(Some(Duration::from_secs(3_600))),
            MAX_RETRY_AFTER
        );
    }

    #[test]
    fn all_busy_answers_the_soonest_backoff_in_whole_seconds() {
        let now = Instant::now();
        let s = Duration::from_secs;
        assert_eq!(retry_after_when_all_busy(&[], now), 1);
        assert_eq!(retry_after_when_all_busy(&[now + s(5), now + s(3)], now), 3);
        // Rounded up, and never 0.
        assert_eq!(
            retry_after_when_all_busy(&[now + Duration::from_millis(2_100)], now),
            3
        );
        assert_eq!(
            retry_after_when_all_busy(&[now + Duration::from_millis(1)], now),
            1
        );
        // Backoffs already over are ignored; none left gives the default.
        assert_eq!(retry_after_when_all_busy(&[now, now - s(4)], now), 1);
        assert_eq!(retry_after_when_all_busy(&[now - s(4), now + s(9)], now), 9);
    }

    #[test]
    fn policy_comes_from_the_router_args() {
        let args = slipway_contract::router::RouterArgs::for_inference_service("chat").unwrap();
        let p = RetryPolicy::from_args(&args);
        assert_eq!(p.max_retries, args.max_retries);
        assert_eq!(p.budget, args.retry_budget);
    }
}
