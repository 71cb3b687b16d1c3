//! Reads every endpoint's load report (`GET /load`, [`LoadReport`]) at a short
//! interval into the live view. A poll that cannot connect marks the endpoint not
//! ready until one succeeds; one that answers badly leaves the last report to go
//! stale, and the choice then falls back to least-in-flight. A bad answer is logged as
//! a warning when an endpoint starts answering badly (an engine of another version
//! whose report does not parse, say), and once when it recovers: not at every poll.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use slipway_contract::{LoadReport, paths};

use crate::endpoints::Live;

/// Polls forever (the caller aborts the task at shutdown); `after_first_round` runs
/// once every endpoint has been asked once, so a router that turns ready then already
/// knows which models its endpoints serve.
pub async fn poll(
    live: Arc<Live>,
    client: reqwest::Client,
    interval: Duration,
    after_first_round: impl FnOnce() + Send,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut after_first_round = Some(after_first_round);
    let mut answering_badly: HashSet<String> = HashSet::new();
    loop {
        ticker.tick().await;
        let urls = live.urls();
        // The report describes the engine as of about when it was asked: requests the
        // router sends after this instant are not in it (they count as pending).
        let asked = Instant::now();
        let polls = urls.iter().map(|url| poll_one(&client, url, interval));
        for (url, result) in urls.iter().zip(join_all(polls).await) {
            match result {
                Poll::Report(report) => {
                    if answering_badly.remove(url) {
                        tracing::info!(%url, "load reports readable again");
                    }
                    live.record_load(url, Some(report), asked);
                }
                Poll::Unreachable(why) => {
                    tracing::debug!(%url, %why, "load poll could not connect");
                    live.record_load(url, None, asked);
                }
                Poll::Bad(why) => {
                    if answering_badly.insert(url.clone()) {
                        tracing::warn!(%url, %why, "load report unreadable: the cost policy falls back to least-in-flight while it stays so");
                    } else {
                        tracing::debug!(%url, %why, "load poll failed");
                    }
                }
            }
        }
        answering_badly.retain(|url| urls.contains(url));
        if let Some(first) = after_first_round.take() {
            first();
        }
    }
}

enum Poll {
    Report(LoadReport),
    Unreachable(reqwest::Error),
    Bad(String),
}

async fn poll_one(client: &reqwest::Client, url: &str, interval: Duration) -> Poll {
    // A poll may take at most a few intervals: a slow engine goes stale, never
    // blocks the others' polls for long.
    let timeout = (interval * 4).max(Duration::from_millis(500));
    let response = match client
        .get(format!("{url}{}", paths::LOAD))
        .timeout(timeout)
        .send()
        .await
    {
        Ok(r) => r,
        Err(e) if e.is_connect() => return Poll::Unreachable(e),
        Err(e) => return Poll::Bad(e.to_string()),
    };
    if !response.status().is_success() {
        return Poll::Bad(format!("status {}", response.status()));
    }
    match response.json::<LoadReport>().await {
        Ok(report) => Poll::Report(report),
        Err(e) => Poll::Bad(e.to_string()),
    }
}
