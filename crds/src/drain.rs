//! How long an engine pod may take to stop, and how that time is divided.
//!
//! A pod being deleted first runs its preStop hook (`preStopDelay`: load balancers stop
//! sending it requests), then the engine gets SIGTERM and drains: a stream admitted just
//! before can still need TTFT + maxOutputTokens × TPOT to finish. So
//!
//! `terminationGracePeriodSeconds = preStopDelay + TTFT + maxOutputTokens × TPOT + margin`,
//!
//! capped at `maxDrainSeconds`, and the engine's own shutdown budget is
//! `grace − preStopDelay − margin`: the three numbers come from one place and never
//! disagree. The margin leaves the engine time to flush and exit before the kubelet's
//! SIGKILL.

use std::time::Duration;

use crate::{duration, spec::InferenceServiceSpec};

/// Seconds kept between the engine's shutdown deadline and the kubelet's SIGKILL.
pub const SHUTDOWN_MARGIN_SECONDS: u64 = 5;

/// The drain-relevant numbers of a spec.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainInput {
    pub pre_stop_delay: Duration,
    pub ttft_target: Duration,
    pub tpot_target: Duration,
    pub max_output_tokens: u32,
    pub max_drain: Duration,
}

impl DrainInput {
    /// Reads the drain inputs from a spec.
    ///
    /// # Errors
    /// Fails when an SLO threshold is not a valid duration (the CRD rejects those).
    pub fn from_spec(spec: &InferenceServiceSpec) -> Result<Self, duration::DurationError> {
        Ok(Self {
            pre_stop_delay: Duration::from_secs(
                u64::try_from(spec.drain.pre_stop_delay_seconds).unwrap_or(0),
            ),
            ttft_target: duration::parse(&spec.slo.ttft.threshold)?,
            tpot_target: duration::parse(&spec.slo.tpot.threshold)?,
            max_output_tokens: u32::try_from(spec.release.engine.max_output_tokens).unwrap_or(0),
            max_drain: Duration::from_secs(
                u64::try_from(spec.drain.max_drain_seconds).unwrap_or(0),
            ),
        })
    }
}

/// The computed stop timings for an engine pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainBudget {
    /// The pod's `terminationGracePeriodSeconds`.
    pub termination_grace_period_seconds: u64,
    /// The preStop hook's sleep, in seconds.
    pub pre_stop_delay_seconds: u64,
    /// The engine's `--shutdown-timeout`: what is left for draining after preStop and
    /// before the margin.
    pub engine_shutdown_seconds: u64,
    /// True when `maxDrainSeconds` cut the grace period below what the longest stream
    /// needs: such a stream may be ended early with an explicit error.
    pub capped: bool,
}

/// Computes the grace period and the engine's shutdown budget.
pub fn drain_budget(input: &DrainInput) -> DrainBudget {
    let longest_stream = input
        .ttft_target
        .saturating_add(input.tpot_target.saturating_mul(input.max_output_tokens));
    let pre_stop_delay_seconds = ceil_seconds(input.pre_stop_delay);
    let needed = pre_stop_delay_seconds
        .saturating_add(ceil_seconds(longest_stream))
        .saturating_add(SHUTDOWN_MARGIN_SECONDS);
    let cap = ceil_seconds(input.max_drain);
    let grace = needed.min(cap);
    DrainBudget {
        termination_grace_period_seconds: grace,
        pre_stop_delay_seconds,
        engine_shutdown_seconds: grace
            .saturating_sub(pre_stop_delay_seconds)
            .saturating_sub(SHUTDOWN_MARGIN_SECONDS),
        capped: needed > cap,
    }
}

fn ceil_seconds(duration: Duration) -> u64 {
    let whole = duration.as_secs();
    if duration.subsec_nanos() > 0 {
        whole.saturating_add(1)
    } else {
        whole
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn input(
        pre_stop: u64,
        ttft_ms: u64,
        tpot_ms: u64,
        max_out: u32,
        max_drain: u64,
    ) -> DrainInput {
        DrainInput {
            pre_stop_delay: Duration::from_secs(pre_stop),
            ttft_target: Duration::from_millis(ttft_ms),
            tpot_target: Duration::from_millis(tpot_ms),
            max_output_tokens: max_out,
            max_drain: Duration::from_secs(max_drain),
        }
    }

    #[test]
    fn defaults_give_room_for_the_longest_stream() {
        // 10 s preStop + 2 s TTFT + 1024 × 150 ms (153.6 s) + 5 s margin = 170.6 → 171 s.
        let budget = drain_budget(&input(10, 2000, 150, 1024, 600));
        assert_eq!(budget.termination_grace_period_seconds, 171);
        assert_eq!(budget.engine_shutdown_seconds, 156);
        assert!(!budget.capped);
    }

    #[test]
    fn max_drain_caps_and_says_so() {
        let budget = drain_budget(&input(10, 2000, 150, 1024, 60));
        assert_eq!(budget.termination_grace_period_seconds, 60);
        assert_eq!(budget.engine_shutdown_seconds, 45);
        assert!(budget.capped);
    }

    #[test]
    fn reads_the_spec_defaults() {
        let spec: InferenceServiceSpec = serde_yaml::from_str(
            "release: {model: {uri: /m.gguf}, engine: {image: e}}\ncapacity: {demand: {static: 1}, replicaGoodput: 1}",
        )
        .unwrap();
        let budget = drain_budget(&DrainInput::from_spec(&spec).unwrap());
        assert_eq!(budget.termination_grace_period_seconds, 171);
    }

    proptest! {
        #[test]
        fn the_parts_never_exceed_the_whole(
            pre_stop in 0u64..300, ttft in 0u64..60_000, tpot in 0u64..2000,
            max_out in 0u32..100_000, max_drain in 1u64..86_400,
        ) {
            let budget = drain_budget(&input(pre_stop, ttft, tpot, max_out, max_drain));
            prop_assert!(budget.termination_grace_period_seconds <= max_drain);
            prop_assert!(
                budget.engine_shutdown_seconds + budget.pre_stop_delay_seconds + SHUTDOWN_MARGIN_SECONDS
                    <= budget.termination_grace_period_seconds
                    || budget.engine_shutdown_seconds == 0
            );
            if !budget.capped {
                // Uncapped, the engine can finish the longest stream.
                let longest_ms = ttft + tpot * u64::from(max_out);
                prop_assert!(budget.engine_shutdown_seconds * 1000 >= longest_ms);
            }
        }
    }
}
