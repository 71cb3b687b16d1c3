//! The one retry-delay policy of Slipway's retry loops: the engine's `fetch` (attempts
//! of a download), the operator's group restarts (recreations of a broken group) and
//! its leader election (attempts at the Lease).
//!
//! Exponential with a cap: after `n ≥ 1` failures in a row the next attempt waits
//! `min(first × 2^(n−1), max)`; before any failure it does not wait. A constant
//! policy is the case `first == max` ([`Backoff::constant`]).
//!
//! No jitter, on purpose: the operator computes a restart's delay inside its pure
//! plan from the restart count it keeps in status, so the same inputs must give the
//! same delay, and the leader election's timing is client-go's fixed retry period.
//!
//! Why not the `backoff` or `backon` crates: both are iterators of delays for a loop
//! that sleeps between attempts. The operator needs the delay of the n-th restart as
//! a function of a count that outlives the process (it is in the object's status),
//! which is the three lines of [`Backoff::delay`].

use std::time::Duration;

/// Exponential backoff with a cap, no jitter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The wait after the first failure; it doubles per further failure in a row.
    pub first: Duration,
    /// The longest wait.
    pub max: Duration,
}

impl Backoff {
    /// Waits `first` after one failure, doubling per failure in a row, capped at `max`.
    #[must_use]
    pub const fn new(first: Duration, max: Duration) -> Self {
        Self { first, max }
    }

    /// The same wait after every failure.
    #[must_use]
    pub const fn constant(every: Duration) -> Self {
        Self::new(every, every)
    }

    /// The wait before the attempt that follows `failures` failures in a row: none for
    /// 0, then `first × 2^(failures−1)`, capped at `max` (saturating, so any count is
    /// safe).
    #[must_use]
    pub fn delay(&self, failures: u32) -> Duration {
        match failures {
            0 => Duration::ZERO,
            n => self
                .first
                .saturating_mul(1u32.checked_shl(n - 1).unwrap_or(u32::MAX))
                .min(self.max),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_from_the_first_failure_and_caps() {
        let policy = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        let delays: Vec<_> = (0..=6).map(|n| policy.delay(n).as_millis()).collect();
        assert_eq!(delays, [0, 100, 200, 400, 800, 1000, 1000]);
        for n in [31, 32, 33, u32::MAX] {
            assert_eq!(policy.delay(n), policy.max, "{n}");
        }
    }

    #[test]
    fn a_constant_policy_waits_the_same_after_every_failure() {
        let policy = Backoff::constant(Duration::from_secs(2));
        for n in [1, 2, 10, u32::MAX] {
            assert_eq!(policy.delay(n), Duration::from_secs(2), "{n}");
        }
        assert_eq!(policy.delay(0), Duration::ZERO);
    }

    #[test]
    fn a_cap_below_the_first_wait_wins() {
        let policy = Backoff::new(Duration::from_secs(10), Duration::from_secs(3));
        assert_eq!(policy.delay(1), Duration::from_secs(3));
    }
}
