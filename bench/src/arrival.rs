//! Arrival schedules for open-loop load.
//!
//! An open-loop generator decides *when* requests arrive before it sends any of them,
//! so a slow server cannot slow the arrivals down (that feedback is "coordinated
//! omission", and it hides exactly the overload a capacity test is looking for).
//! This module turns an [`ArrivalProcess`] and a seed into a list of arrival offsets.
//!
//! Invariants: offsets are non-decreasing, start at or after zero, and the same
//! process, seed and horizon always give the same list.

use rand::SeedableRng;
use rand::rngs::StdRng;
use rand_distr::{Distribution, Exp, Gamma};
use serde::{Deserialize, Serialize};

use crate::BenchError;

/// How inter-arrival gaps are drawn.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "camelCase")]
pub enum ArrivalProcess {
    /// Exponential gaps: a memoryless stream of independent users.
    Poisson {
        /// Mean arrivals per second.
        rate: f64,
    },
    /// Gamma gaps with shape `burstiness` and mean `1/rate`. `burstiness = 1` is
    /// Poisson; below 1 arrivals clump (coefficient of variation `1/sqrt(burstiness)`),
    /// above 1 they are more regular. Same convention as vLLM's benchmark.
    Gamma {
        /// Mean arrivals per second.
        rate: f64,
        /// Gamma shape parameter (> 0).
        burstiness: f64,
    },
    /// Evenly spaced arrivals; useful for tests and for isolating queueing effects.
    Constant {
        /// Arrivals per second.
        rate: f64,
    },
}

impl ArrivalProcess {
    /// The mean arrival rate in requests per second.
    #[must_use]
    pub fn rate(&self) -> f64 {
        match *self {
            Self::Poisson { rate } | Self::Gamma { rate, .. } | Self::Constant { rate } => rate,
        }
    }

    /// The same process at another mean rate (what a sweep varies).
    #[must_use]
    pub fn with_rate(&self, rate: f64) -> Self {
        match *self {
            Self::Poisson { .. } => Self::Poisson { rate },
            Self::Gamma { burstiness, .. } => Self::Gamma { rate, burstiness },
            Self::Constant { .. } => Self::Constant { rate },
        }
    }

    /// Checks the parameters.
    ///
    /// # Errors
    /// [`BenchError::InvalidSpec`] when the rate or burstiness is not a positive finite number.
    pub fn validate(&self) -> Result<(), BenchError> {
        let rate = self.rate();
        if !(rate.is_finite() && rate > 0.0) {
            return Err(BenchError::InvalidSpec(format!(
                "arrival rate must be a positive number, got {rate}"
            )));
        }
        if let Self::Gamma { burstiness, .. } = *self
            && !(burstiness.is_finite() && burstiness > 0.0)
        {
            return Err(BenchError::InvalidSpec(format!(
                "burstiness must be a positive number, got {burstiness}"
            )));
        }
        Ok(())
    }
}

/// Arrival offsets (seconds from the start of the run) of every request that arrives
/// before `horizon_s`, capped at `max_requests`.
///
/// The first request arrives after one gap, not at zero, so that the measured rate
/// over `[0, horizon)` is unbiased.
///
/// # Errors
/// [`BenchError::InvalidSpec`] when the process parameters are invalid.
pub fn schedule(
    process: &ArrivalProcess,
    horizon_s: f64,
    max_requests: usize,
    seed: u64,
) -> Result<Vec<f64>, BenchError> {
    process.validate()?;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut gaps: Box<dyn FnMut(&mut StdRng) -> f64> = match *process {
        ArrivalProcess::Poisson { rate } => {
            let exp = Exp::new(rate).map_err(|e| BenchError::InvalidSpec(e.to_string()))?;
            Box::new(move |rng| exp.sample(rng))
        }
        ArrivalProcess::Gamma { rate, burstiness } => {
            // Shape k and scale θ with mean kθ = 1/rate.
            let gamma = Gamma::new(burstiness, 1.0 / (rate * burstiness))
                .map_err(|e| BenchError::InvalidSpec(e.to_string()))?;
            Box::new(move |rng| gamma.sample(rng))
        }
        ArrivalProcess::Constant { rate } => Box::new(move |_| 1.0 / rate),
    };
    let mut out = Vec::new();
    let mut t = 0.0;
    while out.len() < max_requests {
        t += gaps(&mut rng);
        if t >= horizon_s {
            break;
        }
        out.push(t);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gaps(offsets: &[f64]) -> Vec<f64> {
        let mut prev = 0.0;
        offsets
            .iter()
            .map(|&t| {
                let g = t - prev;
                prev = t;
                g
            })
            .collect()
    }

    fn cv(xs: &[f64]) -> f64 {
        let n = xs.len() as f64;
        let mean = xs.iter().sum::<f64>() / n;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
        var.sqrt() / mean
    }

    #[test]
    fn poisson_mean_rate_and_cv_match_theory() {
        // 20 000 arrivals: the sample mean of exponential gaps has relative standard
        // error 1/sqrt(n) ≈ 0.7%, so 5% bounds are > 7 sigma.
        let p = ArrivalProcess::Poisson { rate: 10.0 };
        let s = schedule(&p, f64::INFINITY, 20_000, 7).unwrap();
        let observed_rate = s.len() as f64 / s[s.len() - 1];
        assert!(
            (observed_rate - 10.0).abs() / 10.0 < 0.05,
            "{observed_rate}"
        );
        let c = cv(&gaps(&s));
        assert!((c - 1.0).abs() < 0.05, "cv {c}");
    }

    #[test]
    fn gamma_burstiness_controls_clumping() {
        let bursty = ArrivalProcess::Gamma {
            rate: 5.0,
            burstiness: 0.25,
        };
        let s = schedule(&bursty, f64::INFINITY, 20_000, 1).unwrap();
        let observed_rate = s.len() as f64 / s[s.len() - 1];
        assert!((observed_rate - 5.0).abs() / 5.0 < 0.05, "{observed_rate}");
        // CV of gamma gaps = 1/sqrt(shape) = 2.
        let c = cv(&gaps(&s));
        assert!((c - 2.0).abs() < 0.2, "cv {c}");
    }

    #[test]
    fn same_seed_same_schedule_and_different_seed_differs() {
        let p = ArrivalProcess::Poisson { rate: 3.0 };
        let a = schedule(&p, 100.0, usize::MAX, 42).unwrap();
        let b = schedule(&p, 100.0, usize::MAX, 42).unwrap();
        let c = schedule(&p, 100.0, usize::MAX, 43).unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn horizon_and_count_caps_hold_and_offsets_are_sorted() {
        let p = ArrivalProcess::Constant { rate: 4.0 };
        let s = schedule(&p, 2.0, usize::MAX, 0).unwrap();
        // 0.25, 0.5, ..., 1.75: the arrival at exactly 2.0 is outside [0, 2).
        assert_eq!(s.len(), 7);
        assert!(s.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(schedule(&p, 100.0, 3, 0).unwrap().len(), 3);
    }

    #[test]
    fn invalid_parameters_are_rejected() {
        assert!(schedule(&ArrivalProcess::Poisson { rate: 0.0 }, 1.0, 10, 0).is_err());
        assert!(schedule(&ArrivalProcess::Poisson { rate: f64::NAN }, 1.0, 10, 0).is_err());
        let g = ArrivalProcess::Gamma {
            rate: 1.0,
            burstiness: -1.0,
        };
        assert!(schedule(&g, 1.0, 10, 0).is_err());
    }
}
