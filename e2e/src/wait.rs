//! Bounded waits. Every wait names what it waits for and, on timeout, says what
//! the cluster showed instead — tests never sleep to synchronise.

use std::fmt::Debug;
use std::future::Future;
use std::time::Duration;

use kube::runtime::wait::{Condition, await_condition};
use kube::{Api, Resource};
use serde::de::DeserializeOwned;

use crate::error::{Error, Result};

/// Default bound for a condition a healthy cluster reaches in seconds.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// Watch `name` until `condition` holds, for at most `timeout`.
///
/// Returns the object as it was when the condition held.
///
/// # Errors
/// [`Error::Timeout`] with the object's last state (as YAML) when the
/// condition does not hold in time or the object is deleted; [`Error::Watch`]
/// when the watch itself fails.
pub async fn for_object<K>(
    api: &Api<K>,
    name: &str,
    what: &str,
    timeout: Duration,
    condition: impl Condition<K>,
) -> Result<K>
where
    K: Resource + Clone + Debug + DeserializeOwned + serde::Serialize + Send + 'static,
{
    match tokio::time::timeout(timeout, await_condition(api.clone(), name, condition)).await {
        Ok(Ok(Some(object))) => Ok(object),
        Ok(Ok(None)) => Err(Error::Timeout {
            what: what.to_owned(),
            timeout,
            last_seen: format!("{name} was deleted"),
        }),
        Ok(Err(kube::runtime::wait::Error::ProbeFailed(source))) => Err(Error::Watch {
            what: what.to_owned(),
            source,
        }),
        Err(_elapsed) => {
            let last_seen = match api.get_opt(name).await {
                Ok(Some(object)) => {
                    serde_yaml::to_string(&object).unwrap_or_else(|e| format!("{object:?} ({e})"))
                }
                Ok(None) => format!("{name} does not exist"),
                Err(error) => format!("{name} could not be read: {error}"),
            };
            Err(Error::Timeout {
                what: what.to_owned(),
                timeout,
                last_seen,
            })
        }
    }
}

/// Poll `probe` until it yields `Some`, for at most `timeout`.
///
/// For state that cannot be watched (files such as the audit log). `describe`
/// is called once on timeout to say what was seen instead.
///
/// # Errors
/// [`Error::Timeout`] when `probe` never yields; the first error `probe` returns.
pub async fn poll<T, F, Fut>(
    what: &str,
    timeout: Duration,
    mut probe: F,
    describe: impl FnOnce() -> String,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>>>,
{
    const INTERVAL: Duration = Duration::from_millis(200);
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(found) = probe().await? {
            return Ok(found);
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(Error::Timeout {
                what: what.to_owned(),
                timeout,
                last_seen: describe(),
            });
        }
        tokio::time::sleep(INTERVAL).await;
    }
}
