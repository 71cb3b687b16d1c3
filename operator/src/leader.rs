//! Leader election on a `coordination.k8s.io/v1` Lease, so that of several operator
//! replicas exactly one reconciles at a time.
//!
//! The protocol is client-go's: the holder renews `renewTime` every retry period; a
//! candidate takes the Lease over only when its record has not changed for a whole
//! lease duration *as measured by the candidate's own clock* (so clock skew between
//! replicas does not matter); every write is an update guarded by `resourceVersion`,
//! so two candidates racing for an expired Lease cannot both win.
//!
//! Invariant: a replica that cannot renew before its lease would expire for others
//! stops acting (the binary exits and is restarted), so two replicas never act at once.

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, PostParams};
use slipway_contract::Backoff;
use tracing::{info, warn};

use crate::error::Error;

/// Timings of the election.
#[derive(Debug, Clone, Copy)]
pub struct LeaseConfig {
    /// How long a Lease stays valid without renewal.
    pub duration: Duration,
    /// How often the holder renews and candidates retry.
    pub retry: Duration,
}

impl LeaseConfig {
    /// The wait after a failed or lost attempt at the Lease: the retry period every
    /// time, as client-go's elector waits. Constant, not growing: a holder's renewal
    /// deadline ([`Elector::still_leading`]) leaves room for one attempt per period,
    /// and a candidate that backed off further would take over later than the lease
    /// allows.
    #[must_use]
    pub fn retry_policy(&self) -> Backoff {
        Backoff::constant(self.retry)
    }
}

/// One replica's view of the Lease.
pub struct Elector {
    api: Api<Lease>,
    name: String,
    identity: String,
    config: LeaseConfig,
    /// The last record seen from another holder and when (our clock) it last changed.
    seen: Option<(Option<String>, Option<MicroTime>, Instant)>,
    /// When we last renewed successfully.
    renewed: Option<Instant>,
}

impl Elector {
    pub fn new(
        client: Client,
        namespace: &str,
        name: &str,
        identity: &str,
        config: LeaseConfig,
    ) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            name: name.to_owned(),
            identity: identity.to_owned(),
            config,
            seen: None,
            renewed: None,
        }
    }

    /// The identity this replica holds the Lease as.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// Whether our last successful renewal is still within the lease duration (minus a
    /// retry period of margin: others may take over at exactly `duration`).
    pub fn still_leading(&self) -> bool {
        self.renewed
            .is_some_and(|at| at.elapsed() + self.config.retry < self.config.duration)
    }

    /// Tries once to acquire or renew. `Ok(true)` when we hold the Lease now.
    ///
    /// # Errors
    /// [`Error::Lease`] when the API cannot be reached; a lost race is `Ok(false)`.
    pub async fn try_acquire_or_renew(&mut self) -> Result<bool, Error> {
        let now = MicroTime(Timestamp::now());
        let duration_seconds = i32::try_from(self.config.duration.as_secs()).unwrap_or(i32::MAX);
        let Some(mut lease) = self.api.get_opt(&self.name).await.map_err(Error::Lease)? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.name.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(self.identity.clone()),
                    lease_duration_seconds: Some(duration_seconds),
                    acquire_time: Some(now.clone()),
                    renew_time: Some(now),
                    lease_transitions: Some(0),
                    ..LeaseSpec::default()
                }),
            };
            return self.write(self.api.create(&PostParams::default(), &lease).await, true);
        };
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        if holder.as_deref() == Some(self.identity.as_str()) {
            spec.renew_time = Some(now);
            spec.lease_duration_seconds = Some(duration_seconds);
            return self.write(
                self.api
                    .replace(&self.name, &PostParams::default(), &lease)
                    .await,
                false,
            );
        }
        // Someone else's (or nobody's) record: has it stood still for a lease duration?
        let record = (holder.clone(), spec.renew_time.clone());
        let changed_at = match &self.seen {
            Some((seen_holder, seen_renew, at))
                if (seen_holder, seen_renew) == (&record.0, &record.1) =>
            {
                *at
            }
            _ => Instant::now(),
        };
        self.seen = Some((record.0, record.1, changed_at));
        self.renewed = None;
        let held_for = Duration::from_secs(
            u64::try_from(spec.lease_duration_seconds.unwrap_or(0)).unwrap_or(0),
        );
        if holder.is_some() && changed_at.elapsed() < held_for {
            return Ok(false);
        }
        spec.holder_identity = Some(self.identity.clone());
        spec.lease_duration_seconds = Some(duration_seconds);
        spec.acquire_time = Some(now.clone());
        spec.renew_time = Some(now);
        spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        self.write(
            self.api
                .replace(&self.name, &PostParams::default(), &lease)
                .await,
            true,
        )
    }

    fn write(
        &mut self,
        result: Result<Lease, kube::Error>,
        acquiring: bool,
    ) -> Result<bool, Error> {
        match result {
            Ok(_) => {
                if acquiring || self.renewed.is_none() {
                    info!(identity = %self.identity, lease = %self.name, "acquired leadership");
                }
                self.renewed = Some(Instant::now());
                Ok(true)
            }
            // Someone wrote first (409 on update, or 409 on create): not ours this round.
            Err(kube::Error::Api(status)) if status.code == 409 => {
                self.renewed = None;
                Ok(false)
            }
            Err(error) => Err(Error::Lease(error)),
        }
    }

    /// Gives the Lease up on shutdown so a standby takes over at once. Best effort.
    pub async fn release(&mut self) {
        let Ok(Some(mut lease)) = self.api.get_opt(&self.name).await else {
            return;
        };
        let Some(spec) = lease.spec.as_mut() else {
            return;
        };
        if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
            return;
        }
        spec.holder_identity = None;
        if let Err(error) = self
            .api
            .replace(&self.name, &PostParams::default(), &lease)
            .await
        {
            warn!(%error, "could not release the lease");
        }
        self.renewed = None;
    }

    /// Waits until this replica leads.
    ///
    /// # Errors
    /// Never returns an error for API failures (they are logged and retried); the
    /// `Result` is kept for callers that add deadlines.
    pub async fn acquire(&mut self) -> Result<(), Error> {
        let policy = self.config.retry_policy();
        let mut attempts = 0u32;
        loop {
            match self.try_acquire_or_renew().await {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(error) => warn!(%error, "leader election attempt failed"),
            }
            attempts = attempts.saturating_add(1);
            tokio::time::sleep(policy.delay(attempts)).await;
        }
    }
}
