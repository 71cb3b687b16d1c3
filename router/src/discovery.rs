//! Where the live view's releases and endpoints come from.
//!
//! - [`from_args`]: the command line (`--stable`, `--canary`, `--canary-weight`): for a
//!   router without Kubernetes, the tests and the benchmark. The releases are named
//!   `stable` and `canary`.
//! - [`watch_kubernetes`]: the InferenceService (its `status.stableRelease`, the
//!   canary's hash and request weight in `status.canaryRelease`, the SLO in
//!   `spec.slo`) and the EndpointSlices of its per-release Services, whose endpoints
//!   are the ready leaders of that release (the Services select rank 0 only).
//!
//! The pure part, [`split_of`] and [`endpoints_of`], turns the objects into the view's
//! plain values; the watch only feeds them.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use futures::StreamExt as _;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::reflector::Store;
use kube::runtime::{WatchStreamExt as _, reflector, watcher};
use kube::{Api, Client};
use slipway_api::InferenceService;
use slipway_contract::RouterArgs;
use slipway_contract::labels::{ENDPOINT_SLICE_SERVICE, release_service};
use slipway_contract::metrics::SloTargets;

use crate::endpoints::{Discovered, Live};
use crate::proxy::App;
use crate::split::{Canary, Split};

/// Release name of `--stable` endpoints.
pub const STATIC_STABLE: &str = "stable";
/// Release name of `--canary` endpoints.
pub const STATIC_CANARY: &str = "canary";

/// The view the command line describes.
pub fn from_args(live: &Live, args: &RouterArgs) {
    let canary = (!args.canary.is_empty()).then(|| Canary {
        release: STATIC_CANARY.to_owned(),
        weight_percent: args.canary_weight,
    });
    live.set_split(
        Split {
            stable: STATIC_STABLE.to_owned(),
            canary,
        },
        SloTargets {
            ttft: args.slo_ttft,
            tpot: args.slo_tpot,
        },
    );
    let found = |urls: &[String], release: &str| {
        urls.iter()
            .map(|url| Discovered {
                url: url.trim_end_matches('/').to_owned(),
                release: release.to_owned(),
                ready: true,
                terminating: false,
            })
            .collect::<Vec<_>>()
    };
    let mut all = found(&args.stable, STATIC_STABLE);
    all.extend(found(&args.canary, STATIC_CANARY));
    live.set_endpoints(all);
}

/// The split and SLO an InferenceService's status and spec give; `None` until the
/// operator has recorded a stable release.
#[must_use]
pub fn split_of(service: &InferenceService) -> Option<(Split, SloTargets)> {
    let status = service.status.as_ref()?;
    let stable = status.stable_release.clone()?;
    let canary = status.canary_release.as_ref().map(|c| Canary {
        release: c.hash.clone(),
        weight_percent: u8::try_from(c.weight.clamp(0, 100)).unwrap_or(0),
    });
    let slo = &service.spec.slo;
    let parse = |s: &str| slipway_api::duration::parse(s).ok();
    let defaults = SloTargets::default();
    let slo = SloTargets {
        ttft: parse(&slo.ttft.threshold).unwrap_or(defaults.ttft),
        tpot: parse(&slo.tpot.threshold).unwrap_or(defaults.tpot),
    };
    Some((Split { stable, canary }, slo))
}

/// The endpoints of `releases` among `slices` (EndpointSlices of the namespace).
#[must_use]
pub fn endpoints_of(
    instance: &str,
    releases: &[&str],
    slices: &[Arc<EndpointSlice>],
) -> Vec<Discovered> {
    let mut out = Vec::new();
    for release in releases {
        let service = release_service(instance, release);
        for slice in slices {
            let of_service = slice
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(ENDPOINT_SLICE_SERVICE))
                .is_some_and(|s| *s == service);
            if !of_service {
                continue;
            }
            let Some(port) = slice.ports.iter().flatten().find_map(|p| {
                (p.name.as_deref() == Some("http"))
                    .then_some(p.port)
                    .flatten()
            }) else {
                continue;
            };
            for endpoint in slice.endpoints.iter().flatten() {
                let Some(address) = endpoint.addresses.first() else {
                    continue;
                };
                let host = if address.contains(':') {
                    format!("[{address}]")
                } else {
                    address.clone()
                };
                let conditions = endpoint.conditions.as_ref();
                out.push(Discovered {
                    url: format!("http://{host}:{port}"),
                    release: (*release).to_owned(),
                    // Kubernetes: an unset `ready` is to be read as true.
                    ready: conditions.and_then(|c| c.ready).unwrap_or(true),
                    terminating: conditions.and_then(|c| c.terminating).unwrap_or(false),
                });
            }
        }
    }
    out.sort_by(|a, b| a.url.cmp(&b.url));
    out.dedup_by(|a, b| a.url == b.url);
    out
}

/// Keeps the live view in step with the InferenceService `name` and its
/// EndpointSlices; the router turns ready once both have been listed. Returns only
/// when the watches end (never, in practice: they retry with backoff).
pub async fn watch_kubernetes(app: Arc<App>, client: Client, namespace: String, name: String) {
    let services: Api<InferenceService> = Api::namespaced(client.clone(), &namespace);
    let slices: Api<EndpointSlice> = Api::namespaced(client, &namespace);
    let (service_store, service_writer) = reflector::store();
    let (slice_store, slice_writer) = reflector::store();
    let service_events = reflector(
        service_writer,
        watcher(
            services,
            watcher::Config::default().fields(&format!("metadata.name={name}")),
        )
        .default_backoff(),
    )
    .map(|r| r.map(|_| ()).map_err(|e| e.to_string()));
    let slice_events = reflector(
        slice_writer,
        watcher(slices, watcher::Config::default()).default_backoff(),
    )
    .map(|r| r.map(|_| ()).map_err(|e| e.to_string()));
    let mut events = std::pin::pin!(futures::stream::select(service_events, slice_events));
    {
        // Ready once both lists are in, even if the InferenceService does not exist
        // yet: the router then answers 503 with Retry-After rather than refusing
        // connections.
        let (app, services, slices) =
            (Arc::clone(&app), service_store.clone(), slice_store.clone());
        let (name, namespace) = (name.clone(), namespace.clone());
        tokio::spawn(async move {
            if services.wait_until_ready().await.is_ok() && slices.wait_until_ready().await.is_ok()
            {
                refresh(&app.live, &name, &services, &slices);
                app.ready.store(true, Ordering::Relaxed);
                tracing::info!(inference_service = %name, %namespace, "view synced; ready");
            }
        });
    }
    while let Some(event) = events.next().await {
        if let Err(error) = event {
            tracing::warn!(%error, "watch error (retrying)");
            continue;
        }
        refresh(&app.live, &name, &service_store, &slice_store);
    }
}

fn refresh(
    live: &Live,
    name: &str,
    services: &Store<InferenceService>,
    slices: &Store<EndpointSlice>,
) {
    let Some(service) = services
        .state()
        .into_iter()
        .find(|s| s.metadata.name.as_deref() == Some(name))
    else {
        return;
    };
    let Some((split, slo)) = split_of(&service) else {
        return;
    };
    let mut releases = vec![split.stable.as_str()];
    if let Some(c) = &split.canary {
        releases.push(c.release.as_str());
    }
    let found = endpoints_of(name, &releases, &slices.state());
    if live.split().as_ref() != Some(&split) {
        tracing::info!(stable = %split.stable, canary = ?split.canary, "release split changed");
    }
    live.set_endpoints(found);
    live.set_split(split, slo);
}
