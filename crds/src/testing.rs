//! Fixtures the tests of several crates share (feature `testing`; no release build
//! has it): the valid InferenceService every validation case starts from, the table
//! of invalid objects that the offline unit test and the real API server's e2e test
//! both run, the JSON-pointer edit that makes each case, and the JSON comparisons of
//! the operator's fixture tables and the e2e tests (`subset`, `condition`).
//!
//! Plain data over `serde_json::Value`: the tests send objects the Rust types could
//! never produce, which is what validation tests are for.

use kube::Resource as _;
use serde_json::{Value, json};

use crate::{GROUP, InferenceService, VERSION};

/// A valid InferenceService named `name` that sets every field a validation rule
/// looks at, so each invalid case differs from it in one place.
#[must_use]
pub fn valid_inference_service(name: &str) -> Value {
    json!({
        "apiVersion": format!("{GROUP}/{VERSION}"),
        "kind": InferenceService::kind(&()),
        "metadata": { "name": name },
        "spec": {
            "release": {
                "model": {
                    "uri": "file:///models/smollm2-135m-instruct-q4_1.gguf",
                    "sha256": "a".repeat(64),
                },
                "tokenizer": { "uri": "file:///models/tokenizer.json", "sha256": "b".repeat(64) },
                "adapters": [
                    { "name": "support-bot", "uri": "file:///adapters/support.gguf", "sha256": "c".repeat(64) },
                ],
                "kvNamespace": "smollm2-v1",
                "engine": { "image": "ghcr.io/slipway-dev/engine:0.1.0", "device": "CPU", "maxOutputTokens": 512 },
            },
            "parallelism": { "tensor": 2, "pipeline": 1, "gpusPerNode": 8 },
            "capacity": {
                "demand": {"static": 40.0},
                "replicaGoodput": 12.5,
                "demandUnit": "RequestsPerSecond",
                "faultDomain": { "topologyKey": "topology.kubernetes.io/zone", "fLoss": 0.34 },
                "minReplicas": 2,
                "maxReplicas": 12,
            },
            "slo": {
                "ttft": { "threshold": "2s" },
                "tpot": { "threshold": "150ms" },
                "availability": 0.999,
            },
            "rollout": {
                "steps": [
                    { "weight": 10, "pause": "5m" },
                    { "weight": 50, "pause": "10m" },
                    { "weight": 100 },
                ],
                "analysis": {
                    "interval": "30s",
                    "shortWindow": "1m",
                    "longWindow": "5m",
                    "inconclusivePolicy": "RollbackAfter",
                    "inconclusiveTimeout": "15m",
                    "metrics": { "source": "Scrape" },
                },
                "maxSurge": 1,
            },
            "drain": { "preStopDelaySeconds": 10, "maxDrainSeconds": 600 },
        },
    })
}

/// How the API rejects an invalid case, which decides how each test checks it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    /// An `x-kubernetes-validations` rule with this `message`: it is verbatim in the
    /// CRD, the API server's answer carries it, and so does the CEL validator's offline.
    Cel(&'static str),
    /// The OpenAPI schema (a bound, an enum, a pattern, a required field).
    Schema {
        /// Text of the API server's answer (its own words, not in the CRD).
        api_server: &'static str,
        /// A CEL rule's message that the offline validator also reports for it,
        /// where a rule covers the same ground.
        cel: Option<&'static str>,
    },
}

impl Rejection {
    /// What the real API server's message must contain.
    #[must_use]
    pub fn api_server_text(self) -> &'static str {
        match self {
            Self::Cel(text)
            | Self::Schema {
                api_server: text, ..
            } => text,
        }
    }

    /// The CEL rule message the offline validator reports, if any.
    #[must_use]
    pub fn cel_message(self) -> Option<&'static str> {
        match self {
            Self::Cel(text)
            | Self::Schema {
                cel: Some(text), ..
            } => Some(text),
            Self::Schema { cel: None, .. } => None,
        }
    }
}

/// One invalid object: [`valid_inference_service`] with `edits` applied.
#[derive(Debug, Clone)]
pub struct InvalidCase {
    /// The rule broken, for failure messages.
    pub rule: &'static str,
    /// `(JSON pointer, value)` pairs; `Value::Null` removes the field ([`edit`]).
    pub edits: Vec<(&'static str, Value)>,
    pub expected: Rejection,
}

impl InvalidCase {
    /// The invalid object, named `name`.
    ///
    /// # Errors
    /// An edit whose pointer does not fit the valid object (a stale table).
    pub fn object(&self, name: &str) -> Result<Value, EditError> {
        edited(name, &self.edits)
    }
}

fn case(rule: &'static str, edits: Vec<(&'static str, Value)>, expected: Rejection) -> InvalidCase {
    InvalidCase {
        rule,
        edits,
        expected,
    }
}

fn schema(api_server: &'static str) -> Rejection {
    Rejection::Schema {
        api_server,
        cel: None,
    }
}

fn schema_and_cel(api_server: &'static str, cel: &'static str) -> Rejection {
    Rejection::Schema {
        api_server,
        cel: Some(cel),
    }
}

/// Every rule of the API, each broken at least once: the one table the offline unit
/// test (`crds/tests/crd.rs`) and the real API server's e2e test both run.
#[must_use]
pub fn invalid_cases() -> Vec<InvalidCase> {
    use Rejection::Cel;
    /// The canary weights' CEL rule, which also catches a weight the schema bounds.
    const WEIGHT_RULE: &str = "canary step weights must be within (0, 100]";
    let steps = |weights: &[i64]| {
        json!(
            weights
                .iter()
                .map(|w| json!({ "weight": w }))
                .collect::<Vec<_>>()
        )
    };
    vec![
        case(
            "tensor >= 1",
            vec![("/spec/parallelism/tensor", json!(0))],
            schema(
                "spec.parallelism.tensor: Invalid value: 0: spec.parallelism.tensor in body should be greater than or equal to 1",
            ),
        ),
        case(
            "pipeline >= 1",
            vec![("/spec/parallelism/pipeline", json!(0))],
            schema("spec.parallelism.pipeline in body should be greater than or equal to 1"),
        ),
        case(
            "group at most 512 GPUs",
            vec![
                ("/spec/parallelism/tensor", json!(64)),
                ("/spec/parallelism/pipeline", json!(16)),
            ],
            Cel("a group may span at most 512 GPUs (tensor × pipeline)"),
        ),
        case(
            "a multi-node CUDA group fills whole nodes",
            vec![
                ("/spec/release/engine/device", json!("CUDA")),
                // The CPU-only adapters would break another rule.
                ("/spec/release/adapters", Value::Null),
                ("/spec/parallelism/tensor", json!(12)),
            ],
            Cel("a CUDA group larger than one node must fill whole nodes"),
        ),
        case(
            "fLoss < 1",
            vec![("/spec/capacity/faultDomain/fLoss", json!(1.0))],
            Cel("fLoss must be at least 0 and less than 1"),
        ),
        case(
            "fLoss >= 0",
            vec![("/spec/capacity/faultDomain/fLoss", json!(-0.1))],
            Cel("fLoss must be at least 0 and less than 1"),
        ),
        case(
            "minReplicas <= maxReplicas",
            vec![
                ("/spec/capacity/minReplicas", json!(5)),
                ("/spec/capacity/maxReplicas", json!(2)),
            ],
            Cel("minReplicas must not exceed maxReplicas"),
        ),
        case(
            "demand.static positive",
            vec![("/spec/capacity/demand/static", json!(0.0))],
            Cel("demand.static must be positive"),
        ),
        case(
            "demand needs a source",
            vec![("/spec/capacity/demand", json!({}))],
            Cel("capacity.demand needs static, measured, or both"),
        ),
        case(
            "measured rateWindow within peakWindow",
            vec![(
                "/spec/capacity/demand",
                json!({"measured": {"rateWindow": "10m", "peakWindow": "5m"}}),
            )],
            Cel("demand.measured.rateWindow must not be longer than peakWindow"),
        ),
        case(
            "measured rateWindow at least 4s",
            vec![(
                "/spec/capacity/demand",
                json!({"measured": {"rateWindow": "2s"}}),
            )],
            Cel("demand.measured.rateWindow must be at least 4s"),
        ),
        case(
            "replicaGoodput positive",
            vec![("/spec/capacity/replicaGoodput", json!(-1.0))],
            Cel("replicaGoodput must be positive"),
        ),
        case(
            "canary weights strictly increasing (decreasing)",
            vec![("/spec/rollout/steps", steps(&[50, 10, 100]))],
            Cel("canary step weights must be strictly increasing"),
        ),
        case(
            "canary weights strictly increasing (repeated)",
            vec![("/spec/rollout/steps", steps(&[50, 50, 100]))],
            Cel("canary step weights must be strictly increasing"),
        ),
        case(
            "canary weight at most 100",
            vec![("/spec/rollout/steps", steps(&[10, 150]))],
            schema_and_cel(
                "spec.rollout.steps[1].weight in body should be less than or equal to 100",
                WEIGHT_RULE,
            ),
        ),
        case(
            "canary weight above 0",
            vec![("/spec/rollout/steps", steps(&[0, 100]))],
            schema_and_cel(
                "spec.rollout.steps[0].weight in body should be greater than or equal to 1",
                WEIGHT_RULE,
            ),
        ),
        case(
            "TTFT threshold positive",
            vec![("/spec/slo/ttft/threshold", json!("0s"))],
            Cel("latency threshold must be a positive duration"),
        ),
        case(
            "canary pause positive",
            vec![("/spec/rollout/steps/0/pause", json!("0s"))],
            Cel("pause must be a positive duration"),
        ),
        case(
            "availability < 1",
            vec![("/spec/slo/availability", json!(1.0))],
            Cel("slo.availability must be between 0 and 1, exclusive"),
        ),
        case(
            "availability > 0",
            vec![("/spec/slo/availability", json!(0.0))],
            Cel("slo.availability must be between 0 and 1, exclusive"),
        ),
        case(
            "model sha256 is 64 hex characters",
            vec![("/spec/release/model/sha256", json!("abc123"))],
            Cel("sha256 must be 64 lowercase hex characters"),
        ),
        case(
            "adapter sha256 is lowercase hex",
            vec![("/spec/release/adapters/0/sha256", json!("A".repeat(64)))],
            Cel("sha256 must be 64 lowercase hex characters"),
        ),
        case(
            "kvNamespace is a DNS label",
            vec![("/spec/release/kvNamespace", json!("Not_A_Label"))],
            Cel("kvNamespace must be a DNS label"),
        ),
        case(
            "servedModelName is one token clients can send",
            vec![("/spec/servedModelName", json!("-starts with a dash"))],
            Cel("servedModelName must start with a letter or digit"),
        ),
        case(
            "adapter names unique",
            vec![(
                "/spec/release/adapters",
                json!([
                    { "name": "same", "uri": "file:///a.gguf" },
                    { "name": "same", "uri": "file:///b.gguf" },
                ]),
            )],
            Cel("adapter names must be unique"),
        ),
        case(
            "adapters need the CPU backend",
            vec![
                (
                    "/spec/release/adapters",
                    json!([{ "name": "a", "uri": "file:///a.gguf" }]),
                ),
                ("/spec/release/engine/device", json!("CUDA")),
            ],
            Cel("adapters are served on device CPU only for now"),
        ),
        case(
            "adapter name format",
            vec![("/spec/release/adapters/0/name", json!("-bad-"))],
            Cel("adapter name must be lowercase letters, digits, '-' or '.'"),
        ),
        case(
            "shortWindow < longWindow",
            vec![("/spec/rollout/analysis/shortWindow", json!("10m"))],
            Cel("shortWindow must be shorter than longWindow"),
        ),
        case(
            "RollbackAfter needs a timeout",
            vec![("/spec/rollout/analysis/inconclusiveTimeout", Value::Null)],
            Cel("inconclusivePolicy RollbackAfter needs inconclusiveTimeout"),
        ),
        case(
            "Prometheus source needs a URL",
            vec![("/spec/rollout/analysis/metrics/source", json!("Prometheus"))],
            Cel("metrics.source Prometheus needs metrics.prometheus.url"),
        ),
        case(
            "Prometheus URL is http(s)",
            vec![
                ("/spec/rollout/analysis/metrics/source", json!("Prometheus")),
                (
                    "/spec/rollout/analysis/metrics/prometheus",
                    json!({ "url": "ftp://prometheus:9090" }),
                ),
            ],
            Cel("prometheus.url must start with http:// or https://"),
        ),
        case(
            "preStop delay shorter than the drain",
            vec![("/spec/drain/preStopDelaySeconds", json!(600))],
            Cel("preStopDelaySeconds must be less than maxDrainSeconds"),
        ),
        case(
            "a Gateway named once per listener",
            vec![(
                "/spec/router",
                json!({"httpRoute": {"parentRefs": [{"name": "public"}, {"name": "public"}]}}),
            )],
            Cel("parentRefs: each Gateway (and sectionName) may be named only once"),
        ),
        case(
            "sectionName in every reference to a Gateway named twice",
            vec![(
                "/spec/router",
                json!({"httpRoute": {"parentRefs": [
                    {"name": "public", "namespace": "gw"},
                    {"name": "public", "namespace": "gw", "sectionName": "https"},
                ]}}),
            )],
            Cel(
                "parentRefs: sectionName must be set in every reference to a Gateway named more than once",
            ),
        ),
        case(
            "Gateway namespace is a DNS label",
            vec![(
                "/spec/router",
                json!({"httpRoute": {"parentRefs": [{"name": "public", "namespace": "Gate_ways"}]}}),
            )],
            Cel("parentRefs.namespace must be a namespace name (a DNS label)"),
        ),
        case(
            "device is an enum",
            vec![("/spec/release/engine/device", json!("TPU"))],
            schema("spec.release.engine.device: Unsupported value: \"TPU\""),
        ),
        case(
            "release is required",
            vec![("/spec/release", Value::Null)],
            schema("spec.release: Required value"),
        ),
        case(
            "model sha256 is lowercase",
            vec![(
                "/spec/release/model/sha256",
                json!("B179C9523D0E6A0F98A330C7562B682750A6F8C8C15E5BC70EA373728110DB53"),
            )],
            Cel("sha256 must be 64 lowercase hex characters"),
        ),
        case(
            "servedModelName has no space",
            vec![("/spec/servedModelName", json!("my model"))],
            Cel("servedModelName must start with a letter or digit"),
        ),
        case(
            "Gateway name is a Gateway name",
            vec![(
                "/spec/router",
                json!({"httpRoute": {"parentRefs": [{"name": "Public"}]}}),
            )],
            Cel("parentRefs.name must be a Gateway name"),
        ),
        case(
            "Gateway namespace has no dot",
            vec![(
                "/spec/router",
                json!({"httpRoute": {"parentRefs": [{"name": "public", "namespace": "a.b"}]}}),
            )],
            Cel("parentRefs.namespace must be a namespace name (a DNS label)"),
        ),
        case(
            "sectionName is a listener name",
            vec![(
                "/spec/router",
                json!({"httpRoute": {"parentRefs": [{"name": "public", "sectionName": "a_b"}]}}),
            )],
            Cel("parentRefs.sectionName must be a listener name"),
        ),
        case(
            "a duration has a unit",
            vec![("/spec/slo/ttft/threshold", json!("30"))],
            schema("spec.slo.ttft.threshold in body should match"),
        ),
        case(
            "at most 20 canary steps",
            vec![("/spec/rollout/steps", steps(&(1..=21).collect::<Vec<_>>()))],
            schema("spec.rollout.steps: Too many"),
        ),
        case(
            "the model is required",
            vec![("/spec/release/model", Value::Null)],
            schema("spec.release.model: Required value"),
        ),
    ]
}

/// Objects the API must accept, each [`valid_inference_service`] with `edits`
/// applied, next to the invalid cases they border: the offline unit test and the
/// real API server's e2e test both create them.
#[must_use]
pub fn valid_variants() -> Vec<(&'static str, Vec<(&'static str, Value)>)> {
    vec![
        (
            "a CPU group of 12 ranks with gpusPerNode 8 (each rank is its own pod)",
            vec![
                ("/spec/parallelism/tensor", json!(12)),
                ("/spec/parallelism/gpusPerNode", json!(8)),
            ],
        ),
        (
            "a CUDA group filling two 8-GPU nodes (tensor 8 × pipeline 2)",
            vec![
                ("/spec/release/engine/device", json!("CUDA")),
                ("/spec/release/adapters", Value::Null),
                ("/spec/parallelism/tensor", json!(8)),
                ("/spec/parallelism/pipeline", json!(2)),
            ],
        ),
        (
            "a CUDA group within one 8-GPU node (tensor 3 × pipeline 2)",
            vec![
                ("/spec/release/engine/device", json!("CUDA")),
                ("/spec/release/adapters", Value::Null),
                ("/spec/parallelism/tensor", json!(3)),
                ("/spec/parallelism/pipeline", json!(2)),
            ],
        ),
    ]
}

/// [`valid_inference_service`] named `name` with `edits` applied.
///
/// # Errors
/// An edit whose pointer does not fit the valid object (a stale table).
pub fn edited(name: &str, edits: &[(&'static str, Value)]) -> Result<Value, EditError> {
    let mut object = valid_inference_service(name);
    for (pointer, value) in edits {
        edit(&mut object, pointer, value.clone())?;
    }
    Ok(object)
}

/// A JSON-pointer edit that does not fit the object.
#[derive(Debug, thiserror::Error)]
pub enum EditError {
    #[error("{0}: a pointer needs a '/'")]
    NoSlash(String),
    #[error("{0} does not exist in the object")]
    NoParent(String),
    #[error("{pointer}: {key} is not an index")]
    NotAnIndex { pointer: String, key: String },
    #[error("{0}: no such item")]
    NoItem(String),
    #[error("{0}: the parent is neither an object nor an array")]
    NotAContainer(String),
}

/// Sets (or, with `Value::Null`, removes) the field at a JSON `pointer`.
///
/// # Errors
/// Where the pointer's parent does not exist, or names no item of an array.
pub fn edit(object: &mut Value, pointer: &str, value: Value) -> Result<(), EditError> {
    let (parent, key) = pointer
        .rsplit_once('/')
        .ok_or_else(|| EditError::NoSlash(pointer.to_owned()))?;
    let parent = object
        .pointer_mut(parent)
        .ok_or_else(|| EditError::NoParent(parent.to_owned()))?;
    match (parent, value) {
        (Value::Object(map), Value::Null) => {
            map.remove(key);
        }
        (Value::Object(map), value) => {
            map.insert(key.to_owned(), value);
        }
        (Value::Array(items), value) => {
            let index: usize = key.parse().map_err(|_| EditError::NotAnIndex {
                pointer: pointer.to_owned(),
                key: key.to_owned(),
            })?;
            let slot = items
                .get_mut(index)
                .ok_or_else(|| EditError::NoItem(pointer.to_owned()))?;
            *slot = value;
        }
        _ => return Err(EditError::NotAContainer(pointer.to_owned())),
    }
    Ok(())
}

/// Whether `expected` is a subset of `actual` (`at` names the place in errors):
/// objects key by key, arrays element-wise at the same length, numbers within 0.01,
/// the string `none` for an absent or null value, and the keys `reasonContains` and
/// `messageContains` for a `reason` or `message` holding that text. The comparison
/// of the operator's plan and rollout fixture tables.
///
/// # Errors
/// The first difference, with its place.
pub fn subset(expected: &Value, actual: &Value, at: &str) -> Result<(), String> {
    match (expected, actual) {
        (Value::Object(e), Value::Object(a)) => e.iter().try_for_each(|(key, value)| {
            if let Some(field) = contains_field(key) {
                let got = a.get(field).and_then(Value::as_str).unwrap_or_default();
                let want = value.as_str().unwrap_or_default();
                return if got.contains(want) {
                    Ok(())
                } else {
                    Err(format!("{at}.{field}: {got:?} does not contain {want:?}"))
                };
            }
            subset(
                value,
                a.get(key).unwrap_or(&Value::Null),
                &format!("{at}.{key}"),
            )
        }),
        (Value::Array(e), Value::Array(a)) if e.len() == a.len() => e
            .iter()
            .zip(a)
            .enumerate()
            .try_for_each(|(i, (e, a))| subset(e, a, &format!("{at}[{i}]"))),
        (Value::String(e), a) if e == "none" => {
            if a.is_null() {
                Ok(())
            } else {
                Err(format!("{at}: expected none, got {a}"))
            }
        }
        (e, a) if e == a => Ok(()),
        (Value::Number(e), Value::Number(a))
            if (e.as_f64().unwrap_or(f64::NAN) - a.as_f64().unwrap_or(f64::NAN)).abs() < 0.01 =>
        {
            Ok(())
        }
        (e, a) => Err(format!("{at}: expected {e}, got {a}")),
    }
}

/// The field a `...Contains` key of [`subset`] reads.
fn contains_field(key: &str) -> Option<&'static str> {
    match key {
        "reasonContains" => Some("reason"),
        "messageContains" => Some("message"),
        _ => None,
    }
}

/// The condition of type `type_` in an object's `status` (`status.conditions`).
#[must_use]
pub fn condition<'a>(status: &'a Value, type_: &str) -> Option<&'a Value> {
    status["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
}

/// The `status` (`True`, `False`, `Unknown`) of the condition of type `type_`.
#[must_use]
pub fn condition_status<'a>(status: &'a Value, type_: &str) -> Option<&'a str> {
    condition(status, type_)?["status"].as_str()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subset_reads_objects_arrays_none_and_contains() {
        let actual = json!({"a": 1, "b": [{"c": 2, "d": 3}], "reason": "Scaled up", "n": 0.501});
        assert_eq!(subset(&json!({"b": [{"c": 2}]}), &actual, "x"), Ok(()));
        assert_eq!(
            subset(&json!({"z": "none", "n": 0.5}), &actual, "x"),
            Ok(())
        );
        assert_eq!(
            subset(&json!({"reasonContains": "Scaled"}), &actual, "x"),
            Ok(())
        );
        assert!(subset(&json!({"b": []}), &actual, "x").is_err());
        assert!(subset(&json!({"a": "none"}), &actual, "x").is_err());
        assert_eq!(
            subset(&json!({"a": 2}), &actual, "x"),
            Err("x.a: expected 2, got 1".to_owned())
        );
    }

    #[test]
    fn every_case_edits_the_valid_object() {
        for case in invalid_cases() {
            let object = case
                .object("t")
                .unwrap_or_else(|e| panic!("{}: {e}", case.rule));
            assert_ne!(object, valid_inference_service("t"), "{}", case.rule);
        }
        for (about, edits) in valid_variants() {
            let object = edited("t", &edits).unwrap_or_else(|e| panic!("{about}: {e}"));
            assert_ne!(object, valid_inference_service("t"), "{about}");
        }
    }

    #[test]
    fn edits_remove_set_and_index() {
        let mut object = json!({"a": {"b": 1, "c": [1, 2]}});
        edit(&mut object, "/a/b", Value::Null).expect("remove");
        edit(&mut object, "/a/c/1", json!(3)).expect("index");
        edit(&mut object, "/a/d", json!(4)).expect("set");
        assert_eq!(object, json!({"a": {"c": [1, 3], "d": 4}}));
        assert!(edit(&mut object, "/x/y", json!(1)).is_err());
        assert!(edit(&mut object, "/a/c/9", json!(1)).is_err());
    }
}
