//! Which releases run: the stable one (and how to render it again after the spec
//! moved on), whether a rollout is pending, and which release each group index runs
//! this time ([`crate::rollout`] decides the counts and [`rollout::assign`] the
//! indices, scale-in taking groups from the most crowded fault domain).

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use slipway_api::bundle::bundle_hash;
use slipway_api::capacity::CapacityPlan;
use slipway_api::drain::{DrainInput, drain_budget};
use slipway_api::spec::InferenceServiceSpec;
use slipway_api::status::InferenceServiceStatus;

use crate::groups::group_shape;
use crate::model::BundleStaging;
use crate::observed::Observed;
use crate::pod::serve_args;
use crate::rollout;
use crate::types::Context;

use super::groups::LiveGroups;

/// The stable release and, when its bundle is known, how to render it.
pub(super) struct Stable<'a, 'b> {
    pub release: &'a str,
    pub ctx: Option<&'a Context<'b>>,
}

/// A rollout is running, or about to start (the spec names `target`, a new, untried
/// bundle): no scale-down meanwhile.
pub(super) fn rollout_pending(previous: &InferenceServiceStatus, target: &str) -> bool {
    previous.canary_release.is_some()
        || previous.stable_release.as_deref().is_some_and(|stable| {
            stable != target && !previous.failed_releases.iter().any(|f| f == target)
        })
}

/// The stable release: status says, else what most live pods run, else `target`.
pub(super) fn stable_release(
    previous: &InferenceServiceStatus,
    observed: &Observed,
    target: &str,
) -> String {
    previous
        .stable_release
        .clone()
        .or_else(|| majority_release(observed))
        .unwrap_or_else(|| target.to_owned())
}

/// The release most live pods run.
fn majority_release(observed: &Observed) -> Option<String> {
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for pod in observed
        .pods
        .iter()
        .filter(|p| !p.terminating && !p.release.is_empty())
    {
        *counts.entry(pod.release.as_str()).or_default() += 1;
    }
    counts
        .into_iter()
        .max_by_key(|(_, n)| *n)
        .map(|(release, _)| release.to_owned())
}

/// The spec with the `stable` release's bundle, when it is not `target`'s: kept on its
/// per-release Service, so its groups can be rendered again after the spec moved on.
/// A bundle whose hash does not match is ignored.
pub(super) fn stable_spec(
    spec: &InferenceServiceSpec,
    observed: &Observed,
    stable: &str,
    target: &str,
) -> Option<InferenceServiceSpec> {
    (stable != target)
        .then(|| observed.release_bundles.get(stable))
        .flatten()
        .filter(|bundle| bundle_hash(bundle).short() == stable)
        .map(|bundle| InferenceServiceSpec {
            release: bundle.clone(),
            ..spec.clone()
        })
}

/// `base` with another release bundle (`spec` differs from base's only in `release`).
pub(super) fn release_context<'a>(
    base: &Context<'a>,
    spec: &'a InferenceServiceSpec,
    release: &'a str,
) -> Option<Context<'a>> {
    let staging = BundleStaging::parse(&spec.release).ok()?;
    // The device is part of the bundle, and a CPU group has a pod per rank.
    let shape = group_shape(&spec.parallelism, spec.release.engine.device).ok()?;
    let kv_namespace = spec
        .release
        .kv_namespace
        .clone()
        .unwrap_or_else(|| format!("release-{release}"));
    // Its own drain budget: maxOutputTokens is part of the bundle.
    let drain = drain_budget(&DrainInput::from_spec(spec).ok()?);
    let serve = serve_args(
        base.name,
        spec,
        release,
        &kv_namespace,
        &staging,
        &drain,
        base.engine_otlp_endpoint,
    )
    .ok()?;
    Some(Context {
        spec,
        release,
        shape,
        kv_namespace,
        drain,
        staging,
        serve,
        ..base.clone()
    })
}

/// The rollout's decision and the release each kept group index runs.
pub(super) struct Releases {
    pub decision: rollout::Decision,
    pub assignment: BTreeMap<u32, String>,
}

/// Steps the rollout from the groups that run now, then assigns group indices to the
/// releases it wants.
pub(super) fn assign_releases(
    ctx: &Context<'_>,
    stable_release: &Stable<'_, '_>,
    capacity: &CapacityPlan,
    previous: &InferenceServiceStatus,
    observed: &Observed,
    live: &LiveGroups,
    now: &Time,
) -> Releases {
    let stable = stable_release.release;
    let world = ctx.shape.pods.len();
    // A bundle of another device has another number of pods per group.
    let stable_world = stable_release
        .ctx
        .map_or(world, |stable_ctx| stable_ctx.shape.pods.len());
    let state = rollout::RolloutState {
        stable_release: previous.stable_release.clone(),
        canary_release: previous.canary_release.clone(),
        rollout_hold: previous.rollout_hold.clone(),
        last_rollback: previous.last_rollback.clone(),
        failed_releases: previous.failed_releases.clone(),
    };
    let decision = rollout::decide(&rollout::Input {
        spec: &ctx.spec.rollout,
        objective: ctx.spec.slo.availability,
        target: ctx.release,
        stable,
        previous: &state,
        desired: capacity.provisioned,
        needed: capacity.healthy_needed,
        stable_groups: live.count(stable, observed, stable_world),
        canary_groups: if ctx.release == stable {
            rollout::GroupCounts::default()
        } else {
            live.count(ctx.release, observed, world)
        },
        metrics: observed.metrics.as_ref(),
        now,
    });
    // After a promotion the canary is the stable release already in this plan.
    let stable_now = decision.state.stable_release.as_deref().unwrap_or(stable);
    let mut wants = vec![(stable_now, decision.stable_target)];
    if let Some(canary) = &decision.canary {
        wants.push((canary.as_str(), decision.canary_target));
    }
    let assignment = rollout::assign(live.releases(), &wants, live.placed());
    Releases {
        decision,
        assignment,
    }
}
