//! Rollouts and capacity as tables: every file in `tests/fixtures/rollout/` and
//! `tests/fixtures/capacity/` is a sequence of
//! reconciles ("ticks") of one InferenceService with `now` advanced explicitly. The
//! runner plays the cluster: it applies each plan (pods it creates appear not ready,
//! become ready at the next tick unless the tick says otherwise; pods it deletes are
//! gone), keeps the per-release Services (and the bundles on them), and feeds the
//! plan's status back as the previous status — which is all a restarted operator has,
//! so every tick is also a restart.
//!
//! Releases are named in the file (`releases: {stable: <release patch>, v2: ...}`) and
//! shown by name in expectations. Checked at every tick, whatever the file expects:
//! ready groups never drop below N_healthy (when they were not already below), and
//! live groups never exceed N + maxSurge.
//!
//! Format (all keys but `now` optional per tick):
//! `spec` (release name the spec names), `notReady` (group indices whose pods are not
//! ready), `metrics` (`{canary: {short: [good, eligible], long: [...]}, stable: ...,
//! error: "..."}`), `expect`: `groups` (release name → live groups after the plan),
//! `canary` (`{release, step, weight}` or `none`), `hold` (`{gate, reasonContains,
//! since}` or `none`), `events` (exact reasons, in order), `stable`, `failed`,
//! `lastRollback` (`{release, reasonContains, shortBurnRate, longBurnRate}`),
//! `conditions` (`{type, status, reason, messageContains}`).
//!
//! Measured demand (`capacity.demand.measured`): `requests` (group index → the
//! cumulative request count its leader's counter shows; a lower number is a counter
//! reset) feeds the operator's own sample store and rate history, as a scrape would,
//! and the reading reaches `plan`; a tick without `requests` reuses the last reading,
//! as the reader does within its interval. `demandMissing` is a scrape that failed.
//! Expectations: `healthy` (N_healthy), `desired`, `capacity` (subset of
//! `status.capacity`), `capacityEvents` (exact reasons among Scaled,
//! ScaleDownPending, DemandUnknown, in order). Zones: pods land round-robin over
//! `zones` (default one zone), in the order the plan creates them.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde::Deserialize;
use serde_json::Value;
use slipway_api::InferenceService;
use slipway_api::bundle::bundle_hash;
use slipway_api::status::InferenceServiceStatus;
use slipway_api::testing::{condition, subset};
use slipway_operator::demand::{self, DemandReading, RateHistory};
use slipway_operator::observed::{Observed, ObservedNode, ObservedPod, Phase};
use slipway_operator::plan::{Child, ChildKind, Plan};
use slipway_operator::rollout::analysis::{MetricsReading, ReleaseWindows, WindowCounts};
use slipway_operator::rollout::source::{Counters, SampleStore};
use slipway_operator::{labels, plan};

use common::{merge, sample_json};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Fixture {
    about: String,
    /// A sample in manifests/samples/.
    base: String,
    /// Merge patch onto the sample (rollout settings, capacity...).
    #[serde(default)]
    patch: Value,
    /// Release name → merge patch onto `spec.release`.
    releases: BTreeMap<String, Value>,
    /// The release the spec names at first (the cluster starts empty).
    initial: String,
    /// YAML anchors shared by ticks (e.g. good metrics); not read otherwise.
    #[serde(default, rename = "x-good")]
    _anchors: Value,
    /// Fault domains pods are placed in, round-robin (default: one zone "a").
    #[serde(default)]
    zones: Vec<String>,
    ticks: Vec<Tick>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Tick {
    now: Time,
    #[serde(default)]
    spec: Option<String>,
    #[serde(default)]
    not_ready: Vec<u32>,
    #[serde(default)]
    metrics: Option<Metrics>,
    /// Group index → cumulative requests its leader has counted.
    #[serde(default)]
    requests: Option<BTreeMap<u32, f64>>,
    /// The demand scrape failed with this reason.
    #[serde(default)]
    demand_missing: Option<String>,
    #[serde(default)]
    expect: Expect,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Metrics {
    #[serde(default)]
    canary: Option<Windows>,
    #[serde(default)]
    stable: Option<Windows>,
    #[serde(default)]
    error: Option<String>,
    /// The windows were only partly seen (the scrape store restarted inside them).
    #[serde(default)]
    partial: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Windows {
    short: [f64; 2],
    long: [f64; 2],
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Expect {
    groups: Option<BTreeMap<String, u32>>,
    canary: Option<Value>,
    hold: Option<Value>,
    events: Option<Vec<String>>,
    stable: Option<String>,
    failed: Option<Vec<String>>,
    last_rollback: Option<Value>,
    #[serde(default)]
    conditions: Vec<Value>,
    healthy: Option<i32>,
    desired: Option<i32>,
    capacity: Option<Value>,
    capacity_events: Option<Vec<String>>,
}

const CAPACITY_EVENTS: [&str; 3] = ["Scaled", "ScaleDownPending", "DemandUnknown"];

const ROLLOUT_EVENTS: [&str; 6] = [
    "RolloutStarted",
    "StepAdvanced",
    "Promoted",
    "RolledBack",
    "RolloutReverted",
    "RolloutPaused",
];

struct Sim {
    isvc: Value,
    pods: Vec<ObservedPod>,
    observed_extra: Observed,
    names: BTreeMap<String, String>, // short hash → release name
    zones: Vec<String>,
    placed: usize,
    now: Time,
}

fn run(path: &Path) -> Result<(), String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let fixture: Fixture = serde_yaml::from_str(&text).map_err(|e| format!("fixture: {e}"))?;
    let mut base = sample_json(&fixture.base)?;
    merge(&mut base, &fixture.patch);
    let release_of = |name: &str| -> Result<Value, String> {
        let mut release = base["spec"]["release"].clone();
        merge(
            &mut release,
            fixture
                .releases
                .get(name)
                .ok_or(format!("no release {name:?}"))?,
        );
        Ok(release)
    };
    let mut names = BTreeMap::new();
    for name in fixture.releases.keys() {
        let bundle =
            serde_json::from_value(release_of(name)?).map_err(|e| format!("{name}: {e}"))?;
        names.insert(bundle_hash(&bundle).short().to_owned(), name.clone());
    }
    let zones = if fixture.zones.is_empty() {
        vec!["a".to_owned()]
    } else {
        fixture.zones.clone()
    };
    let mut sim = Sim {
        isvc: base.clone(),
        pods: Vec::new(),
        observed_extra: Observed::default(),
        names,
        zones,
        placed: 0,
        now: fixture
            .ticks
            .first()
            .map(|t| t.now.clone())
            .ok_or("no ticks")?,
    };
    let started = sim.now.clone();
    let mut store = SampleStore::new(0.0);
    let mut history = RateHistory::default();
    let mut reading: Option<DemandReading> = None;
    sim.isvc["spec"]["release"] = release_of(&fixture.initial)?;
    let mut status = InferenceServiceStatus::default();
    let mut errors = Vec::new();
    for (i, tick) in fixture.ticks.iter().enumerate() {
        if let Some(spec) = &tick.spec {
            sim.isvc["spec"]["release"] = release_of(spec)?;
        }
        sim.isvc["status"] = serde_json::to_value(&status).map_err(|e| e.to_string())?;
        let isvc: InferenceService =
            serde_json::from_value(sim.isvc.clone()).map_err(|e| format!("isvc: {e}"))?;
        for pod in &mut sim.pods {
            let ready = !tick.not_ready.contains(&pod.group);
            if ready && !pod.ready {
                pod.ready_since = Some(tick.now.clone());
            }
            pod.ready = ready;
            pod.phase = Phase::Running;
        }
        sim.now = tick.now.clone();
        let mut observed = sim.observed_extra.clone();
        observed.pods = sim.pods.clone();
        observed.nodes = sim
            .zones
            .iter()
            .map(|zone| {
                (
                    format!("n-{zone}"),
                    ObservedNode {
                        labels: BTreeMap::from([(
                            "topology.kubernetes.io/zone".to_owned(),
                            zone.clone(),
                        )]),
                        ready: true,
                        ..ObservedNode::default()
                    },
                )
            })
            .collect();
        if let Some(measured) = &isvc.spec.capacity.demand.measured {
            let t = tick.now.0.duration_since(started.0).as_secs_f64();
            if let Some(why) = &tick.demand_missing {
                reading = Some(DemandReading {
                    missing: Some(why.clone()),
                    at: Some(tick.now.clone()),
                    ..DemandReading::default()
                });
            } else if let Some(requests) = &tick.requests {
                for (group, count) in requests {
                    let leader = sim
                        .pods
                        .iter()
                        .find(|p| p.group == *group && p.rank == 0)
                        .ok_or(format!(
                            "tick {i}: no pod of group {group} to count requests"
                        ))?;
                    let counters = Counters {
                        requests: *count,
                        ..Counters::default()
                    };
                    let uid = leader.uid.clone().unwrap_or_default();
                    store.record(t, &uid, &leader.release, counters);
                }
                let releases: Vec<String> = sim.pods.iter().map(|p| p.release.clone()).collect();
                reading = Some(DemandReading {
                    at: Some(tick.now.clone()),
                    ..demand::scrape_reading(
                        &store,
                        &mut history,
                        t,
                        &demand::Windows::of(measured),
                        isvc.spec.capacity.demand_unit,
                        &releases,
                    )
                });
            }
            observed.demand = reading.clone();
        }
        observed.serving_pods = sim
            .pods
            .iter()
            .filter(|p| p.ready)
            .map(|p| p.name.clone())
            .collect();
        let target = bundle_hash(&isvc.spec.release).short().to_owned();
        observed.metrics = tick.metrics.as_ref().map(|m| {
            let windows = |w: &Windows| ReleaseWindows {
                short: WindowCounts {
                    good: w.short[0],
                    eligible: w.short[1],
                    partial: m.partial,
                },
                long: WindowCounts {
                    good: w.long[0],
                    eligible: w.long[1],
                    partial: m.partial,
                },
            };
            MetricsReading {
                canary_release: target.clone(),
                canary: m.canary.as_ref().map(windows),
                stable: m.stable.as_ref().map(windows),
                error: m.error.clone(),
            }
        });
        let plan = plan(&isvc, &observed, &tick.now);
        if let Some(invalid) = &plan.invalid {
            return Err(format!("tick {i}: invalid spec: {invalid}"));
        }
        let ready_before = sim.pods.iter().filter(|p| p.ready).count();
        apply(&mut sim, &plan);
        let ready_after = sim.pods.iter().filter(|p| p.ready).count();
        let needed = usize::try_from(plan.status.replicas.healthy_needed).unwrap_or(0);
        if ready_after < needed.min(ready_before) {
            errors.push(format!(
                "tick {i}: ready groups {ready_before} → {ready_after}, below N_healthy {needed}"
            ));
        }
        let surge = usize::try_from(isvc.spec.rollout.max_surge).unwrap_or(1);
        let live_groups: std::collections::BTreeSet<u32> =
            sim.pods.iter().map(|p| p.group).collect();
        let desired_n =
            usize::try_from(status_desired_without_surge(&plan.status, &isvc)).unwrap_or(0);
        if live_groups.len() > desired_n + surge {
            errors.push(format!(
                "tick {i}: {} live groups exceed N {desired_n} + maxSurge {surge}",
                live_groups.len()
            ));
        }
        let name = |hash: &str| {
            sim.names
                .get(hash)
                .cloned()
                .unwrap_or_else(|| hash.to_owned())
        };
        let mut actual = serde_json::to_value(&plan.status).map_err(|e| e.to_string())?;
        // Show releases by name.
        if let Some(c) = actual.get_mut("canaryRelease").filter(|c| !c.is_null()) {
            c["release"] = Value::String(name(c["hash"].as_str().unwrap_or_default()));
        }
        if let Some(r) = actual.get_mut("lastRollback").filter(|c| !c.is_null()) {
            r["release"] = Value::String(name(r["release"].as_str().unwrap_or_default()));
        }
        let expect = &tick.expect;
        let mut fail = |m: String| errors.push(format!("tick {i} ({}): {m}", tick.now.0));
        for (what, want, got) in [
            (
                "healthy",
                expect.healthy,
                plan.status.replicas.healthy_needed,
            ),
            ("desired", expect.desired, plan.status.replicas.desired),
        ] {
            if let Some(want) = want
                && want != got
            {
                fail(format!(
                    "{what}: expected {want}, got {got} ({})",
                    plan.events
                        .iter()
                        .map(|e| format!("{}: {}", e.reason, e.note))
                        .collect::<Vec<_>>()
                        .join("; ")
                ));
            }
        }
        if let Some(want) = &expect.capacity
            && let Err(e) = subset(
                want,
                actual.get("capacity").unwrap_or(&Value::Null),
                "capacity",
            )
        {
            fail(e);
        }
        if let Some(want) = &expect.capacity_events {
            let got: Vec<String> = plan
                .events
                .iter()
                .filter(|e| CAPACITY_EVENTS.contains(&e.reason))
                .map(|e| format!("{}: {}", e.reason, e.note))
                .collect();
            let reasons: Vec<&str> = got
                .iter()
                .map(|e| e.split(':').next().unwrap_or_default())
                .collect();
            if *want != reasons {
                fail(format!("capacity events: expected {want:?}, got {got:?}"));
            }
        }
        if let Some(want) = &expect.groups {
            let mut got: BTreeMap<String, u32> = BTreeMap::new();
            for group in &live_groups {
                if let Some(pod) = sim.pods.iter().find(|p| p.group == *group) {
                    *got.entry(name(&pod.release)).or_default() += 1;
                }
            }
            if *want != got {
                fail(format!("groups: expected {want:?}, got {got:?}"));
            }
        }
        for (key, want) in [
            ("canaryRelease", &expect.canary),
            ("rolloutHold", &expect.hold),
            ("lastRollback", &expect.last_rollback),
        ] {
            if let Some(want) = want
                && let Err(e) = subset(want, actual.get(key).unwrap_or(&Value::Null), key)
            {
                fail(e);
            }
        }
        if let Some(want) = &expect.events {
            // Rollout events only; condition events have their own fixtures.
            let plan_events: Vec<_> = plan
                .events
                .iter()
                .filter(|e| ROLLOUT_EVENTS.contains(&e.reason))
                .collect();
            let got: Vec<&str> = plan_events.iter().map(|e| e.reason).collect();
            if *want != got {
                fail(format!(
                    "events: expected {want:?}, got {:?}",
                    plan_events
                        .iter()
                        .map(|e| format!("{}: {}", e.reason, e.note))
                        .collect::<Vec<_>>()
                ));
            }
        }
        if let Some(want) = &expect.stable {
            let got = plan.status.stable_release.as_deref().map(name);
            if got.as_deref() != Some(want.as_str()) {
                fail(format!("stable: expected {want}, got {got:?}"));
            }
        }
        if let Some(want) = &expect.failed {
            let got: Vec<String> = plan
                .status
                .failed_releases
                .iter()
                .map(|h| name(h))
                .collect();
            if *want != got {
                fail(format!("failed: expected {want:?}, got {got:?}"));
            }
        }
        for want in &expect.conditions {
            let ty = want["type"].as_str().unwrap_or_default();
            let got = condition(&actual, ty).cloned().unwrap_or(Value::Null);
            if let Err(e) = subset(want, &got, &format!("condition {ty}")) {
                fail(e);
            }
        }
        status = plan.status.clone();
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(format!("{}\n  {}", fixture.about, errors.join("\n  ")))
    }
}

/// N (provisioned groups) for the status's N_healthy: status reports desired with
/// surge, so recompute it.
fn status_desired_without_surge(status: &InferenceServiceStatus, isvc: &InferenceService) -> u32 {
    let healthy = f64::from(status.replicas.healthy_needed);
    slipway_api::capacity::plan_capacity(&slipway_api::capacity::CapacityInput::new(
        &isvc.spec.capacity,
        healthy * isvc.spec.capacity.replica_goodput,
    ))
    .map(|c| c.provisioned)
    .unwrap_or(0)
}

/// Plays the plan onto the simulated cluster.
fn apply(sim: &mut Sim, plan: &Plan) {
    sim.pods
        .retain(|p| !plan.force_delete_pods.contains(&p.name));
    for child in &plan.delete {
        match child.kind {
            ChildKind::Pod => sim.pods.retain(|p| p.name != child.name),
            ChildKind::Service => {
                sim.observed_extra.release_services.remove(&child.name);
            }
            // The router's objects and the PDBs change nothing the rollout reads.
            ChildKind::PodDisruptionBudget
            | ChildKind::Deployment
            | ChildKind::ServiceAccount
            | ChildKind::Role
            | ChildKind::RoleBinding
            | ChildKind::HttpRoute => {}
        }
    }
    for child in &plan.apply {
        match child {
            Child::Pod(pod) => {
                // As the API server would show it just created: the operator's own
                // conversion, then what the server and scheduler fill in.
                let Some(mut created) = slipway_operator::observed::pod_from(pod) else {
                    continue;
                };
                sim.pods.retain(|p| p.name != created.name);
                let zone = sim.zones[sim.placed % sim.zones.len()].clone();
                sim.placed += 1;
                created.uid = Some(format!("{}-{}", created.name, sim.placed));
                created.node = Some(format!("n-{zone}"));
                created.created = Some(sim.now.clone());
                sim.pods.push(created);
            }
            Child::Service(service) => {
                let labels_of = service.metadata.labels.clone().unwrap_or_default();
                if let Some(release) = labels_of.get(labels::RELEASE) {
                    let name = service.metadata.name.clone().unwrap_or_default();
                    sim.observed_extra.release_services.insert(name);
                    if let Some(bundle) = service
                        .metadata
                        .annotations
                        .as_ref()
                        .and_then(|a| a.get(labels::BUNDLE))
                        .and_then(|json| serde_json::from_str(json).ok())
                    {
                        sim.observed_extra
                            .release_bundles
                            .insert(release.clone(), bundle);
                    }
                }
            }
            Child::PodDisruptionBudget(_)
            | Child::Deployment(_)
            | Child::ServiceAccount(_)
            | Child::Role(_)
            | Child::RoleBinding(_)
            | Child::HttpRoute(_) => {}
        }
    }
}

#[test]
fn rollout_fixtures() {
    run_dir("rollout", 10);
}

#[test]
fn capacity_fixtures() {
    run_dir("capacity", 6);
}

fn run_dir(name: &str, at_least: usize) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map(|entries| entries.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    paths.retain(|p| p.extension().is_some_and(|e| e == "yaml"));
    paths.sort();
    assert!(
        paths.len() >= at_least,
        "expected the {name} fixtures in {}",
        dir.display()
    );
    let failures: Vec<String> = paths
        .iter()
        .filter_map(|p| {
            run(p).err().map(|e| {
                format!(
                    "{}: {e}",
                    p.file_name().unwrap_or_default().to_string_lossy()
                )
            })
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} {name} fixtures failed:\n{}",
        failures.len(),
        paths.len(),
        failures.join("\n")
    );
}
