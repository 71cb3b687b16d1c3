//! `plan` as tables: every file in `tests/fixtures/` states an InferenceService (a
//! sample from `manifests/samples/` plus a merge patch), what the cluster shows, the
//! time, and what the plan must contain. See `tests/fixtures/README.md` for the format.
//!
//! Fixture pods leave `templateHash` and `release` out to mean "as the plan renders
//! them now"; the runner fills them in from a plan of an empty cluster.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde::Deserialize;
use serde_json::Value;
use slipway_api::InferenceService;
use slipway_api::testing::subset;
use slipway_operator::observed::{Observed, ObservedNode};
use slipway_operator::plan::{Child, Plan};
use slipway_operator::{labels, plan};

use common::{check_engine_contract, check_router_contract, merge, sample_json};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Fixture {
    /// What the case shows, for failure messages.
    about: String,
    /// A file in manifests/samples/ (without .yaml).
    base: String,
    /// JSON merge patch onto the sample (metadata, spec, status).
    #[serde(default)]
    patch: Value,
    #[serde(default)]
    observed: Observed,
    /// Shorthand for Ready nodes: zone → node names. Each node gets the zone label and
    /// `slipway.dev/nvlink-domain = <zone>-rack<i / 2>`.
    #[serde(default)]
    zones: BTreeMap<String, Vec<String>>,
    /// Nodes from `zones` that are NotReady.
    #[serde(default)]
    not_ready_nodes: Vec<String>,
    now: Time,
    expect: Expect,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Expect {
    invalid: Option<String>,
    replicas: Option<Value>,
    /// Exactly these pods are applied, in this order.
    apply_pods: Option<Vec<String>>,
    /// Exactly these deletions, as "Kind/name".
    deletes: Option<Vec<String>>,
    /// Exactly these pods force-deleted (no grace period: their node is NotReady).
    force_deletes: Option<Vec<String>>,
    #[serde(default)]
    conditions: Vec<ExpectCondition>,
    /// Exactly these event reasons, in order.
    events: Option<Vec<String>>,
    requeue_after_seconds: Option<u64>,
    /// Checks on applied pods, by name: each value is a JSON subset of the pod.
    #[serde(default)]
    pods: BTreeMap<String, Value>,
    /// Checks on applied objects of any kind, by "Kind/name": JSON subsets.
    #[serde(default)]
    objects: BTreeMap<String, Value>,
    /// Objects that must not be applied, as "Kind/name".
    #[serde(default)]
    not_applied: Vec<String>,
    /// Env of an applied pod's engine container, by pod name: name → value.
    #[serde(default)]
    env: BTreeMap<String, BTreeMap<String, String>>,
    /// Arguments that must appear in order in a pod's engine args, by pod name.
    #[serde(default)]
    args: BTreeMap<String, Vec<String>>,
    /// The status must equal the one in the isvc (a no-op reconcile).
    #[serde(default)]
    status_unchanged: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ExpectCondition {
    #[serde(rename = "type")]
    type_: String,
    status: String,
    reason: Option<String>,
    message_contains: Option<String>,
    last_transition_time: Option<String>,
}

fn load(path: &Path) -> Result<(Fixture, InferenceService, Observed), String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let fixture: Fixture = serde_yaml::from_str(&text).map_err(|e| format!("fixture: {e}"))?;
    let mut isvc = sample_json(&fixture.base)?;
    if !fixture.patch.is_null() {
        merge(&mut isvc, &fixture.patch);
    }
    let isvc: InferenceService = serde_json::from_value(isvc).map_err(|e| format!("isvc: {e}"))?;

    let mut observed = fixture.observed.clone();
    for (zone, nodes) in &fixture.zones {
        for (i, node) in nodes.iter().enumerate() {
            observed.nodes.insert(
                node.clone(),
                ObservedNode {
                    labels: BTreeMap::from([
                        ("topology.kubernetes.io/zone".to_owned(), zone.clone()),
                        (
                            "slipway.dev/nvlink-domain".to_owned(),
                            format!("{zone}-rack{}", i / 2),
                        ),
                    ]),
                    ready: !fixture.not_ready_nodes.contains(node),
                    ..ObservedNode::default()
                },
            );
        }
    }
    // "As rendered now": hashes and release from a plan of an empty cluster, asked
    // for at least as many groups as the fixture's pods name (group counts do not
    // change a pod's template).
    let groups = observed.pods.iter().map(|p| p.group + 1).max().unwrap_or(0);
    let mut wide = isvc.clone();
    let groups = i32::try_from(groups).unwrap_or(i32::MAX);
    wide.spec.capacity.min_replicas = wide.spec.capacity.min_replicas.max(groups);
    wide.spec.capacity.max_replicas = wide.spec.capacity.max_replicas.max(groups);
    let fresh = plan(&wide, &Observed::default(), &fixture.now);
    let rendered: BTreeMap<String, &Pod> = fresh
        .apply
        .iter()
        .filter_map(|child| match child {
            Child::Pod(pod) => Some((pod.metadata.name.clone().unwrap_or_default(), pod.as_ref())),
            _ => None,
        })
        .collect();
    for pod in &mut observed.pods {
        let current = rendered.get(&pod.name);
        if pod.template_hash.is_none() {
            pod.template_hash = current
                .and_then(|p| {
                    p.metadata
                        .annotations
                        .as_ref()?
                        .get(labels::TEMPLATE_HASH)
                        .cloned()
                })
                .or_else(|| Some("beyond-desired".to_owned()));
        }
        if pod.release.is_empty() {
            pod.release = slipway_api::bundle::bundle_hash(&isvc.spec.release)
                .short()
                .to_owned();
        }
    }
    Ok((fixture, isvc, observed))
}

fn check(fixture: &Fixture, isvc: &InferenceService, plan: &Plan) -> Result<(), String> {
    let expect = &fixture.expect;
    let mut errors = Vec::new();
    let mut fail = |message: String| errors.push(message);

    match (&expect.invalid, &plan.invalid) {
        (Some(want), Some(got)) if got.to_string().contains(want.as_str()) => {}
        (None, None) => {}
        (want, got) => fail(format!("invalid: expected {want:?}, got {got:?}")),
    }
    if let Some(replicas) = &expect.replicas {
        let got = serde_json::to_value(&plan.status.replicas).unwrap_or_default();
        if let Err(e) = subset(replicas, &got, "replicas") {
            fail(e);
        }
    }
    let pods: Vec<&Pod> = plan
        .apply
        .iter()
        .filter_map(|c| match c {
            Child::Pod(p) => Some(p.as_ref()),
            _ => None,
        })
        .collect();
    // Whatever the case checks, every pod it renders must be one the engine runs.
    for pod in &pods {
        if let Err(e) = check_engine_contract(pod, &isvc.spec) {
            fail(e);
        }
    }
    let pod_names: Vec<String> = pods
        .iter()
        .map(|p| p.metadata.name.clone().unwrap_or_default())
        .collect();
    if let Some(want) = &expect.apply_pods
        && *want != pod_names
    {
        fail(format!(
            "applied pods: expected {want:?}, got {pod_names:?}"
        ));
    }
    let deletes: Vec<String> = plan
        .delete
        .iter()
        .map(|d| format!("{}/{}", d.kind.as_str(), d.name))
        .collect();
    if let Some(want) = &expect.deletes {
        let mut want = want.clone();
        want.sort();
        let mut got = deletes.clone();
        got.sort();
        if want != got {
            fail(format!("deletes: expected {want:?}, got {got:?}"));
        }
    }
    if let Some(want) = &expect.force_deletes {
        let mut want = want.clone();
        want.sort();
        let mut got = plan.force_delete_pods.clone();
        got.sort();
        if want != got {
            fail(format!("force deletes: expected {want:?}, got {got:?}"));
        }
    }
    for want in &expect.conditions {
        let Some(got) = plan
            .status
            .conditions
            .iter()
            .find(|c| c.type_ == want.type_)
        else {
            fail(format!("condition {} missing", want.type_));
            continue;
        };
        let ok = got.status == want.status
            && want.reason.as_ref().is_none_or(|r| *r == got.reason)
            && want
                .message_contains
                .as_ref()
                .is_none_or(|m| got.message.contains(m.as_str()))
            && want.last_transition_time.as_ref().is_none_or(|t| {
                *t == serde_json::to_value(&got.last_transition_time).unwrap_or_default()
            });
        if !ok {
            fail(format!(
                "condition {}: expected {want:?}, got {got:?}",
                want.type_
            ));
        }
        if got.observed_generation != isvc.metadata.generation {
            fail(format!("condition {} lacks observedGeneration", want.type_));
        }
    }
    if plan.status.observed_generation != isvc.metadata.generation {
        fail("status.observedGeneration not set".to_owned());
    }
    let events: Vec<&str> = plan.events.iter().map(|e| e.reason).collect();
    if let Some(want) = &expect.events
        && *want != events
    {
        fail(format!(
            "events: expected {want:?}, got {:?} ({:?})",
            events, plan.events
        ));
    }
    if let Some(seconds) = expect.requeue_after_seconds
        && plan.requeue_after.map(|d| d.as_secs()) != Some(seconds)
    {
        fail(format!(
            "requeue: expected {seconds}s, got {:?}",
            plan.requeue_after
        ));
    }
    for (name, want) in &expect.pods {
        match pods
            .iter()
            .find(|p| p.metadata.name.as_deref() == Some(name.as_str()))
        {
            None => fail(format!("pod {name} not applied")),
            Some(pod) => {
                let got = serde_json::to_value(pod).unwrap_or_default();
                if let Err(e) = subset(want, &got, name) {
                    fail(e);
                }
            }
        }
    }
    for (name, want) in &expect.env {
        let env: BTreeMap<String, String> = pods
            .iter()
            .find(|p| p.metadata.name.as_deref() == Some(name.as_str()))
            .and_then(|p| p.spec.as_ref()?.containers.first()?.env.clone())
            .unwrap_or_default()
            .into_iter()
            .filter_map(|v| Some((v.name, v.value?)))
            .collect();
        for (key, value) in want {
            if env.get(key) != Some(value) {
                fail(format!(
                    "pod {name} env {key}: expected {value:?}, got {:?}",
                    env.get(key)
                ));
            }
        }
    }
    for (name, want) in &expect.args {
        let args = pods
            .iter()
            .find(|p| p.metadata.name.as_deref() == Some(name.as_str()))
            .and_then(|p| p.spec.as_ref()?.containers.first()?.args.clone())
            .unwrap_or_default();
        // In this order, other arguments between them allowed.
        let mut rest = args.iter();
        if !want.iter().all(|w| rest.any(|a| a == w)) {
            fail(format!("pod {name} args {args:?} lack {want:?}"));
        }
    }
    let applied: BTreeMap<String, &Child> = plan
        .apply
        .iter()
        .map(|c| {
            let reference = c.reference();
            (format!("{}/{}", reference.kind.as_str(), reference.name), c)
        })
        .collect();
    for key in &expect.not_applied {
        if applied.contains_key(key) {
            fail(format!("{key} applied, expected not"));
        }
    }
    // Whatever the case checks, the router runs arguments its own parser accepts.
    for child in applied.values() {
        if let Child::Deployment(deployment) = child
            && let Err(e) = check_router_contract(deployment, isvc)
        {
            fail(e);
        }
    }
    for (key, want) in &expect.objects {
        let found = applied.get(key).and_then(|c| child_json(c));
        match found {
            None => {
                // Name the ones of that kind that were, for a fixture being written.
                let kind = key.split('/').next().unwrap_or_default();
                let same_kind: Vec<&String> = applied
                    .keys()
                    .filter(|k| k.split('/').next() == Some(kind))
                    .collect();
                fail(format!("{key} not applied (applied: {same_kind:?})"));
            }
            Some(got) => {
                if let Err(e) = subset(want, &got, key) {
                    fail(e);
                }
            }
        }
    }
    if expect.status_unchanged && isvc.status.as_ref() != Some(&plan.status) {
        fail(format!(
            "status changed on a no-op reconcile:\nwas {}\nnow {}",
            serde_yaml::to_string(&isvc.status).unwrap_or_default(),
            serde_yaml::to_string(&plan.status).unwrap_or_default()
        ));
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("\n  "))
    }
}

/// An applied child as the API server would receive it.
fn child_json(child: &Child) -> Option<Value> {
    match child {
        Child::Pod(o) => serde_json::to_value(o),
        Child::Service(o) => serde_json::to_value(o),
        Child::PodDisruptionBudget(o) => serde_json::to_value(o),
        Child::Deployment(o) => serde_json::to_value(o),
        Child::ServiceAccount(o) => serde_json::to_value(o),
        Child::Role(o) => serde_json::to_value(o),
        Child::RoleBinding(o) => serde_json::to_value(o),
        Child::HttpRoute(o) => serde_json::to_value(o),
    }
    .ok()
}

#[test]
fn plan_fixtures() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.extension().is_some_and(|e| e == "yaml"))
        .collect();
    paths.sort();
    assert!(
        paths.len() >= 10,
        "expected the fixture table, found {} files",
        paths.len()
    );
    let mut failures = Vec::new();
    for path in &paths {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let result = load(path).and_then(|(fixture, isvc, observed)| {
            let planned = plan(&isvc, &observed, &fixture.now);
            check(&fixture, &isvc, &planned).map_err(|e| format!("{} — {e}", fixture.about))
        });
        if let Err(error) = result {
            failures.push(format!("{name}: {error}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} fixtures failed:\n{}",
        failures.len(),
        paths.len(),
        failures.join("\n")
    );
}

/// Planning twice from the same inputs gives the same plan (no hidden clock or
/// randomness), and feeding a plan's status back in gives the same status.
#[test]
fn plan_is_deterministic_and_a_fixed_point() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let path = dir.join("05-all-ready-fault-tolerant.yaml");
    let (fixture, mut isvc, observed) = load(&path).unwrap_or_else(|e| panic!("{e}"));
    let first = plan(&isvc, &observed, &fixture.now);
    assert_eq!(first, plan(&isvc, &observed, &fixture.now));
    isvc.status = Some(first.status.clone());
    let second = plan(&isvc, &observed, &fixture.now);
    assert_eq!(second.status, first.status);
    assert!(second.events.is_empty(), "{:?}", second.events);
}
