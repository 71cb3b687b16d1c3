//! Admission control: whether a request may be queued, decided before it reaches the
//! engine, from its cost and the load already admitted.
//!
//! A request's cost is its prompt tokens plus its `max_tokens` (the most it can
//! generate), and the KV blocks those need. In order:
//! 1. a cost over the whole KV budget could never be served: refused as a bad request;
//! 2. the tenant's token bucket (tenant from the API key or `x-tenant`; off unless a
//!    rate is set) must hold the cost (capped at the burst) → else **429**;
//! 3. at most `max_num_seqs + max_queue` requests in flight → else **503**;
//! 4. the worst-case KV of everything admitted, plus this cost, stays within the KV
//!    budget (the pool), so admitted work never needs more KV than exists → else
//!    **503**;
//! 5. the estimated wait before it could start is within `queue_deadline` → else
//!    **503**.
//!
//! Every refusal carries a `Retry-After` estimate of when capacity frees: from an
//! exponentially weighted average of how long admitted requests take (service
//! time) and the `max_num_seqs` of them that run at once, so slots free at about
//! `max_num_seqs / service_time` per second; for a tenant, when its bucket refills.
//!
//! Decisions ([`check`], [`TokenBucket::take`], the estimates) are plain functions of
//! plain data with the time passed in. [`Admission`] is the thin stateful shell the
//! HTTP layer shares: one short mutex section per decision, and a [`Permit`] whose
//! drop returns the request's share.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Per-tenant token rate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TenantRate {
    /// Tokens (prompt + max output) per second, sustained.
    pub tokens_per_s: f64,
    /// Bucket size: tokens a tenant may spend at once.
    pub burst: f64,
}

/// Limits of admission.
#[derive(Clone, Debug, PartialEq)]
pub struct AdmissionConfig {
    /// Requests the engine runs at once (its `max_num_seqs`).
    pub max_num_seqs: usize,
    /// Requests that may wait beyond those.
    pub max_queue: usize,
    /// KV blocks the worst case of admitted work may need (the pool).
    pub kv_budget_blocks: usize,
    /// Positions per KV block.
    pub block_size: usize,
    /// Longest estimated wait before starting that a request accepts.
    pub queue_deadline: Duration,
    /// Per-tenant rate; `None` = no tenant limits.
    pub tenant_rate: Option<TenantRate>,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            max_num_seqs: 64,
            max_queue: 256,
            kv_budget_blocks: 2048,
            block_size: 16,
            queue_deadline: Duration::from_secs(20),
            tenant_rate: None,
        }
    }
}

impl AdmissionConfig {
    /// Checks the values.
    ///
    /// # Errors
    /// The first bad value.
    pub fn validate(&self) -> Result<(), AdmissionConfigError> {
        for (field, value) in [
            ("max_num_seqs", self.max_num_seqs),
            ("block_size", self.block_size),
            ("kv_budget_blocks", self.kv_budget_blocks),
        ] {
            if value == 0 {
                return Err(AdmissionConfigError::Zero(field));
            }
        }
        if let Some(r) = self.tenant_rate
            && !(r.tokens_per_s > 0.0 && r.tokens_per_s.is_finite() && r.burst >= 1.0)
        {
            return Err(AdmissionConfigError::TenantRate(r));
        }
        Ok(())
    }
}

/// A bad [`AdmissionConfig`].
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum AdmissionConfigError {
    /// A limit (the field named) that must be at least 1 is 0.
    #[error("{0} must be at least 1")]
    Zero(&'static str),
    /// A tenant rate that admits nothing, or not even one token at once.
    #[error(
        "tenant rate must be > 0 tokens/s with a burst of at least 1 token, got {} / {}",
        .0.tokens_per_s,
        .0.burst
    )]
    TenantRate(TenantRate),
}

/// What a request costs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cost {
    /// Prompt tokens plus the most it may generate.
    pub tokens: usize,
    /// KV blocks for those tokens.
    pub blocks: usize,
}

/// The cost of a request with this prompt and `max_tokens`.
#[must_use]
pub fn cost(prompt_tokens: usize, max_tokens: usize, block_size: usize) -> Cost {
    let tokens = prompt_tokens + max_tokens;
    Cost {
        tokens,
        blocks: tokens.div_ceil(block_size.max(1)),
    }
}

/// The load already admitted.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Load {
    /// Requests admitted and not yet ended.
    pub in_flight: usize,
    /// Their KV blocks, worst case.
    pub reserved_blocks: usize,
    /// Average time an admitted request takes, once any has finished.
    pub service_time: Option<Duration>,
}

/// Why a request is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Rejection {
    /// More than the KV budget even alone: a bad request, not a retry.
    #[error(
        "the request needs {need} KV blocks (prompt + max_tokens), more than the {budget} this server has; lower max_tokens or shorten the prompt"
    )]
    NeverFits {
        /// Blocks it needs.
        need: usize,
        /// The budget.
        budget: usize,
    },
    /// The tenant is over its token rate (429).
    #[error("tenant over its token rate; retry in {}s", retry_secs(*retry_after))]
    TenantRate {
        /// When its bucket holds enough again.
        retry_after: Duration,
    },
    /// The queue is full (503).
    #[error("the server is at capacity ({in_flight} requests in flight); retry in {}s", retry_secs(*retry_after))]
    QueueFull {
        /// Requests in flight.
        in_flight: usize,
        /// Estimate of when a place frees.
        retry_after: Duration,
    },
    /// Admitted work already claims the KV budget (503).
    #[error("the KV cache is fully committed; retry in {}s", retry_secs(*retry_after))]
    KvBudget {
        /// Estimate of when enough blocks free.
        retry_after: Duration,
    },
    /// It could not start before its deadline (503).
    #[error("estimated wait {:.1}s exceeds the queue deadline of {:.1}s; retry in {}s", wait.as_secs_f64(), deadline.as_secs_f64(), retry_secs(*retry_after))]
    Deadline {
        /// Estimated wait.
        wait: Duration,
        /// The deadline.
        deadline: Duration,
        /// When the wait would be within the deadline.
        retry_after: Duration,
    },
}

impl Rejection {
    /// The `Retry-After` for the response, if the request may be retried as is.
    #[must_use]
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::NeverFits { .. } => None,
            Self::TenantRate { retry_after }
            | Self::QueueFull { retry_after, .. }
            | Self::KvBudget { retry_after }
            | Self::Deadline { retry_after, .. } => Some(*retry_after),
        }
    }
}

/// Whole seconds for a `Retry-After` header: rounded up, at least 1.
#[must_use]
pub fn retry_secs(d: Duration) -> u64 {
    d.as_secs_f64().ceil().max(1.0) as u64
}

/// Before any request finished, the service time is unknown; retries are advised
/// after this much.
const UNKNOWN_WAIT: Duration = Duration::from_secs(1);

/// Time for `n` running requests to finish, when `max_num_seqs` run at once and
/// each takes `service` (slots free at `max_num_seqs / service` per second).
fn time_for(n: usize, max_num_seqs: usize, service: Option<Duration>) -> Duration {
    match service {
        None => UNKNOWN_WAIT,
        Some(s) => s.mul_f64(n as f64 / max_num_seqs.max(1) as f64),
    }
}

/// Estimated wait before a request admitted now could start: zero while a running
/// place is free; else the time for the requests queued ahead of it (and itself) to
/// get places. `None` while the service time is unknown.
#[must_use]
pub fn estimated_wait(config: &AdmissionConfig, load: &Load) -> Option<Duration> {
    let service = load.service_time?;
    if load.in_flight < config.max_num_seqs {
        return Some(Duration::ZERO);
    }
    let ahead = load.in_flight + 1 - config.max_num_seqs;
    Some(time_for(ahead, config.max_num_seqs, Some(service)))
}

/// The capacity checks (3–5 of the module docs) for a request of `cost`.
///
/// # Errors
/// The [`Rejection`] with its retry estimate.
pub fn check(config: &AdmissionConfig, load: &Load, cost: Cost) -> Result<(), Rejection> {
    if cost.blocks > config.kv_budget_blocks {
        return Err(Rejection::NeverFits {
            need: cost.blocks,
            budget: config.kv_budget_blocks,
        });
    }
    let limit = config.max_num_seqs + config.max_queue;
    if load.in_flight >= limit {
        return Err(Rejection::QueueFull {
            in_flight: load.in_flight,
            retry_after: time_for(
                load.in_flight + 1 - limit,
                config.max_num_seqs,
                load.service_time,
            ),
        });
    }
    let want = load.reserved_blocks + cost.blocks;
    if want > config.kv_budget_blocks {
        // Finishing requests free, on average, reserved/in_flight blocks each.
        let per_request = load.reserved_blocks.div_ceil(load.in_flight.max(1)).max(1);
        let requests = (want - config.kv_budget_blocks).div_ceil(per_request);
        return Err(Rejection::KvBudget {
            retry_after: time_for(requests, config.max_num_seqs, load.service_time),
        });
    }
    if let Some(wait) = estimated_wait(config, load)
        && wait > config.queue_deadline
    {
        return Err(Rejection::Deadline {
            wait,
            deadline: config.queue_deadline,
            retry_after: wait - config.queue_deadline,
        });
    }
    Ok(())
}

/// A token bucket (time in seconds, passed in).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TokenBucket {
    /// Tokens available.
    pub tokens: f64,
    /// When `tokens` was last brought up to date.
    pub at: f64,
}

impl TokenBucket {
    /// A full bucket.
    #[must_use]
    pub fn full(rate: &TenantRate, now: f64) -> Self {
        Self {
            tokens: rate.burst,
            at: now,
        }
    }

    fn refill(&mut self, rate: &TenantRate, now: f64) {
        let dt = (now - self.at).max(0.0);
        self.tokens = (self.tokens + dt * rate.tokens_per_s).min(rate.burst);
        self.at = now.max(self.at);
    }

    /// Takes `n` tokens (capped at the burst, so any request can pass a full bucket).
    ///
    /// # Errors
    /// When it does not hold enough: how long until it will.
    pub fn take(&mut self, rate: &TenantRate, n: usize, now: f64) -> Result<(), Duration> {
        self.refill(rate, now);
        let n = (n as f64).min(rate.burst);
        if self.tokens >= n {
            self.tokens -= n;
            Ok(())
        } else {
            Err(Duration::from_secs_f64(
                (n - self.tokens) / rate.tokens_per_s,
            ))
        }
    }

    /// Whether it is full (and so need not be remembered).
    #[must_use]
    pub fn is_full(&self, rate: &TenantRate, now: f64) -> bool {
        let mut b = *self;
        b.refill(rate, now);
        b.tokens >= rate.burst
    }
}

/// Tenants remembered at most; full buckets are forgotten first.
const MAX_TENANTS: usize = 10_000;
/// Weight of the newest sample in the service-time average.
const EWMA_WEIGHT: f64 = 0.2;

#[derive(Debug)]
struct State {
    load: Load,
    buckets: HashMap<String, TokenBucket>,
}

/// The shared admission state.
#[derive(Debug)]
pub struct Admission {
    config: AdmissionConfig,
    epoch: Instant,
    state: Mutex<State>,
}

/// An admitted request's share of the load; dropping it returns the share.
#[derive(Debug)]
pub struct Permit {
    admission: Arc<Admission>,
    blocks: usize,
}

impl Permit {
    /// Records how long the request took (feeds the service-time estimate); call
    /// once, when it completed normally.
    pub fn completed(&self, took: Duration) {
        let mut st = self.admission.lock();
        st.load.service_time = Some(match st.load.service_time {
            None => took,
            Some(avg) => avg.mul_f64(1.0 - EWMA_WEIGHT) + took.mul_f64(EWMA_WEIGHT),
        });
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut st = self.admission.lock();
        st.load.in_flight = st.load.in_flight.saturating_sub(1);
        st.load.reserved_blocks = st.load.reserved_blocks.saturating_sub(self.blocks);
    }
}

impl Admission {
    /// Admission with these limits.
    ///
    /// # Errors
    /// An invalid config.
    pub fn new(config: AdmissionConfig) -> Result<Arc<Self>, AdmissionConfigError> {
        config.validate()?;
        Ok(Arc::new(Self {
            config,
            epoch: Instant::now(),
            state: Mutex::new(State {
                load: Load::default(),
                buckets: HashMap::new(),
            }),
        }))
    }

    /// The limits.
    #[must_use]
    pub fn config(&self) -> &AdmissionConfig {
        &self.config
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // The state stays consistent even if a holder panicked (plain counters).
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The load now.
    #[must_use]
    pub fn load(&self) -> Load {
        self.lock().load
    }

    /// Admits a request of `cost` for `tenant`, or says why not. Capacity is checked
    /// before the tenant's bucket is charged, so a 503 costs the tenant nothing.
    ///
    /// # Errors
    /// The [`Rejection`].
    pub fn try_admit(
        self: &Arc<Self>,
        tenant: Option<&str>,
        cost: Cost,
        now: Instant,
    ) -> Result<Permit, Rejection> {
        let t = now.saturating_duration_since(self.epoch).as_secs_f64();
        let mut st = self.lock();
        if cost.blocks > self.config.kv_budget_blocks {
            return Err(Rejection::NeverFits {
                need: cost.blocks,
                budget: self.config.kv_budget_blocks,
            });
        }
        if let (Some(rate), Some(tenant)) = (self.config.tenant_rate, tenant) {
            // Only a check here; the charge follows the capacity checks.
            let mut probe = st
                .buckets
                .get(tenant)
                .copied()
                .unwrap_or_else(|| TokenBucket::full(&rate, t));
            probe
                .take(&rate, cost.tokens, t)
                .map_err(|retry_after| Rejection::TenantRate { retry_after })?;
        }
        check(&self.config, &st.load, cost)?;
        if let (Some(rate), Some(tenant)) = (self.config.tenant_rate, tenant) {
            if st.buckets.len() >= MAX_TENANTS {
                st.buckets.retain(|_, b| !b.is_full(&rate, t));
            }
            let b = st
                .buckets
                .entry(tenant.to_owned())
                .or_insert_with(|| TokenBucket::full(&rate, t));
            let _ = b.take(&rate, cost.tokens, t);
        }
        st.load.in_flight += 1;
        st.load.reserved_blocks += cost.blocks;
        Ok(Permit {
            admission: Arc::clone(self),
            blocks: cost.blocks,
        })
    }
}

#[cfg(test)]
#[path = "admission_tests.rs"]
mod tests;
