//! The error-budget arithmetic of the SLO, shared by the operator's canary analysis
//! and the Prometheus alerts generated from it (`manifests/monitoring/`), so the two
//! judge a release the same way and cannot drift apart.
//!
//! - SLI over a window = good / eligible requests (what counts as either is the
//!   engine's contract: `slipway-contract`'s metrics).
//! - Burn rate = (1 − SLI) / (1 − objective): 1 spends the error budget exactly over the
//!   SLO period, 14.4 spends 2 % of a 30-day budget in an hour.
//! - Alerts (and the analysis's defaults) follow the multi-window, multi-burn-rate
//!   alerting of the Google SRE workbook (ch. 5, "Alerting on SLOs"): a tier fires when
//!   both its long and its short window burn faster than its rate; the short window
//!   (1/12 of the long one) makes the alert stop soon after the burning stops.

use std::time::Duration;

/// The objective when `slo.availability` is unset, and the one the generated alerts
/// fall back to for a release no operator reports an objective for.
pub const DEFAULT_AVAILABILITY: f64 = 0.999;

/// The SLO period the workbook's burn rates are sized for (30 days).
pub const BUDGET_PERIOD: Duration = Duration::from_secs(30 * 24 * 3600);

/// Error-budget burn rate of a window whose SLI is `sli`, against `objective`:
/// (1 − SLI) / (1 − objective), never negative.
#[must_use]
pub fn burn_rate(sli: f64, objective: f64) -> f64 {
    let budget = (1.0 - objective).max(f64::MIN_POSITIVE);
    ((1.0 - sli) / budget).max(0.0)
}

/// The share of bad requests at which a window burns at `burn` against `objective`
/// (the inverse of [`burn_rate`]).
#[must_use]
pub fn bad_share_at(burn: f64, objective: f64) -> f64 {
    burn * (1.0 - objective)
}

/// Who an alert wakes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Severity {
    /// Someone is paged now.
    Page,
    /// A ticket: someone looks within working hours.
    Ticket,
}

impl Severity {
    /// The `severity` label value.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Page => "page",
            Self::Ticket => "ticket",
        }
    }
}

/// One tier of multi-window burn-rate alerting.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BurnRateTier {
    /// The tier's name, as in alert names (`Fast`, `Medium`, `Slow`).
    pub name: &'static str,
    pub severity: Severity,
    /// Both windows must burn faster than this.
    pub burn_rate: f64,
    /// The window that says the burn is significant.
    pub long_window: Duration,
    /// The window that says it is still going on.
    pub short_window: Duration,
}

impl BurnRateTier {
    /// The share of a [`BUDGET_PERIOD`] budget spent over the long window at exactly
    /// the tier's burn rate (0.02 for 14.4 over 1 h).
    #[must_use]
    pub fn budget_spent(&self) -> f64 {
        self.burn_rate * self.long_window.as_secs_f64() / BUDGET_PERIOD.as_secs_f64()
    }
}

const MINUTE: u64 = 60;
const HOUR: u64 = 60 * MINUTE;

/// 14.4× over 1 h, confirmed over 5 m: pages. Its rate is also the default of the
/// canary analysis's thresholds (`rollout.analysis.*BurnRateThreshold`), whose windows
/// are scaled down to the minutes a rollout step lasts.
pub const FAST_BURN: BurnRateTier = BurnRateTier {
    name: "Fast",
    severity: Severity::Page,
    burn_rate: 14.4,
    long_window: Duration::from_secs(HOUR),
    short_window: Duration::from_secs(5 * MINUTE),
};

/// 6× over 6 h, confirmed over 30 m: pages.
pub const MEDIUM_BURN: BurnRateTier = BurnRateTier {
    name: "Medium",
    severity: Severity::Page,
    burn_rate: 6.0,
    long_window: Duration::from_secs(6 * HOUR),
    short_window: Duration::from_secs(30 * MINUTE),
};

/// 1× over 3 d, confirmed over 6 h: a ticket.
pub const SLOW_BURN: BurnRateTier = BurnRateTier {
    name: "Slow",
    severity: Severity::Ticket,
    burn_rate: 1.0,
    long_window: Duration::from_secs(72 * HOUR),
    short_window: Duration::from_secs(6 * HOUR),
};

/// Every tier, fastest first.
pub const BURN_RATE_TIERS: [BurnRateTier; 3] = [FAST_BURN, MEDIUM_BURN, SLOW_BURN];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burn_rate_is_the_inverse_of_bad_share_at() {
        for objective in [0.9, 0.99, 0.999, 0.9999] {
            for burn in [0.5, 1.0, 6.0, 14.4] {
                let back = burn_rate(1.0 - bad_share_at(burn, objective), objective);
                assert!((back - burn).abs() < 1e-6, "{objective} {burn}: {back}");
            }
        }
    }

    #[test]
    fn tiers_spend_the_workbook_budget_shares() {
        // SRE workbook table 5-8: 2 %, 5 % and 10 % of a 30-day budget.
        let spent: Vec<f64> = BURN_RATE_TIERS
            .iter()
            .map(BurnRateTier::budget_spent)
            .collect();
        for (got, want) in spent.iter().zip([0.02, 0.05, 0.10]) {
            assert!((got - want).abs() < 1e-9, "{spent:?}");
        }
        for tier in BURN_RATE_TIERS {
            assert_eq!(tier.long_window.as_secs(), 12 * tier.short_window.as_secs());
        }
    }

    #[test]
    fn a_perfect_window_burns_nothing_and_a_better_than_perfect_one_too() {
        assert_eq!(burn_rate(1.0, 0.999), 0.0);
        assert_eq!(burn_rate(1.5, 0.999), 0.0);
        assert!((burn_rate(0.9, 0.99) - 10.0).abs() < 1e-9);
    }
}
