//! The generated CRD: checked in up to date, its samples valid, its CEL rules doing what
//! their messages say.
//!
//! The CEL rules are evaluated here client-side (kube's CEL validator, with the schema's
//! defaults applied first, as the API server does); the e2e suite proves the same table
//! against a real API server.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use slipway_api::InferenceService;
use slipway_api::spec::{Device, Parallelism, WHOLE_NODES_MESSAGE};
use slipway_api::testing::{
    Rejection, edit, edited, invalid_cases, valid_inference_service, valid_variants,
};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn checked_in_crd() -> Value {
    let path = repo_root().join(slipway_api::CRD_PATH);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{} is missing ({e}); run `make generate`", path.display()));
    serde_yaml::from_str(&text).expect("the checked-in CRD is YAML")
}

fn openapi_schema(crd: &Value) -> &Value {
    &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
}

#[test]
fn checked_in_crd_is_up_to_date() {
    let path = repo_root().join(slipway_api::CRD_PATH);
    let current = std::fs::read_to_string(&path).unwrap_or_default();
    let generated = slipway_api::crd_yaml().expect("CRD serializes");
    assert!(
        current == generated,
        "{} is stale; run `make generate`",
        slipway_api::CRD_PATH
    );
}

#[test]
fn crd_carries_the_validation_rules_people_read() {
    let text = serde_json::to_string(&checked_in_crd()).unwrap();
    for message in [
        "a new model must not share KV/prefix-cache entries with the old one",
        "fLoss must be at least 0 and less than 1",
        "minReplicas must not exceed maxReplicas",
        "canary step weights must be strictly increasing",
        "sha256 must be 64 lowercase hex characters",
        "kvNamespace must be a DNS label",
        "servedModelName must start with a letter or digit",
        "demand.static must be positive",
        "capacity.demand needs static, measured, or both",
        "replicaGoodput must be positive",
        "slo.availability must be between 0 and 1",
        "parentRefs: each Gateway (and sectionName) may be named only once",
    ] {
        assert!(text.contains(message), "CRD lacks the rule {message:?}");
    }
    assert!(
        text.contains("oldSelf"),
        "CRD lacks the kvNamespace transition rule"
    );
}

fn samples() -> Vec<(PathBuf, Value)> {
    let dir = repo_root().join("manifests/samples");
    let mut samples = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("manifests/samples exists") {
        let path = entry.expect("readable directory entry").path();
        if path.extension().is_some_and(|ext| ext == "yaml") {
            let text = std::fs::read_to_string(&path).expect("readable sample");
            let value: Value = serde_yaml::from_str(&text)
                .unwrap_or_else(|e| panic!("{}: not YAML: {e}", path.display()));
            samples.push((path, value));
        }
    }
    assert!(
        samples.len() >= 3,
        "expected the three samples, found {}",
        samples.len()
    );
    samples
}

/// Everything the API server checks that is not CEL: types, bounds, patterns, lengths,
/// enums, required fields. The CRD's schema is OpenAPI v3, a JSON Schema dialect; the
/// Kubernetes extensions (`x-kubernetes-*`) are ignored here and covered by CEL below
/// and the e2e suite.
fn structural_errors(object: &Value) -> Vec<String> {
    let crd = checked_in_crd();
    let schema = openapi_schema(&crd);
    let validator = jsonschema::draft4::new(schema).expect("the CRD schema compiles");
    validator
        .iter_errors(object)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect()
}

fn cel_errors(object: &Value, old: Option<&Value>) -> Vec<String> {
    cel_errors_in(&checked_in_crd(), object, old)
}

fn cel_errors_in(crd: &Value, object: &Value, old: Option<&Value>) -> Vec<String> {
    match kube::core::cel::Validator::new().validate(openapi_schema(crd), object, old) {
        Ok(()) => Vec::new(),
        Err(errors) => errors.into_vec().into_iter().map(|e| e.message).collect(),
    }
}

#[test]
fn every_sample_deserializes_and_passes_the_schema() {
    for (path, value) in samples() {
        let typed: InferenceService = serde_json::from_value(value.clone())
            .unwrap_or_else(|e| panic!("{}: does not deserialize: {e}", path.display()));
        assert!(typed.metadata.name.is_some(), "{}: unnamed", path.display());
        let structural = structural_errors(&value);
        assert!(structural.is_empty(), "{}: {structural:?}", path.display());
        let cel = cel_errors(&value, None);
        assert!(cel.is_empty(), "{}: {cel:?}", path.display());
    }
}

fn valid() -> Value {
    valid_inference_service("t")
}

/// The valid object with one field set (or, with `Value::Null`, removed).
fn with(pointer: &str, value: Value) -> Value {
    let mut object = valid();
    edit(&mut object, pointer, value).unwrap_or_else(|e| panic!("{e}"));
    object
}

#[test]
fn the_valid_object_is_valid() {
    assert_eq!(structural_errors(&valid()), Vec::<String>::new());
    assert_eq!(cel_errors(&valid(), None), Vec::<String>::new());
}

/// The table the e2e suite also runs on a real API server: a CEL rule must report its
/// message here too; an OpenAPI bound must fail the schema (the API server's words for
/// it are the e2e's to check), and the CEL rule that covers the same ground, if any,
/// must report its message.
#[test]
fn invalid_objects_are_rejected_with_their_message() {
    let cases = invalid_cases();
    assert!(cases.len() >= 15);
    let crd = serde_json::to_string(&checked_in_crd()).unwrap();
    for case in cases {
        let object = case
            .object("t")
            .unwrap_or_else(|e| panic!("{}: {e}", case.rule));
        if let Rejection::Schema { .. } = case.expected {
            assert!(
                !structural_errors(&object).is_empty(),
                "{}: the schema accepts it",
                case.rule
            );
        }
        if let Some(expected) = case.expected.cel_message() {
            assert!(
                crd.contains(expected),
                "{}: CRD lacks {expected:?}",
                case.rule
            );
            let errors = cel_errors(&object, None);
            assert!(
                errors.iter().any(|e| e.contains(expected)),
                "{}: expected {expected:?}, got {errors:?}",
                case.rule
            );
        }
    }
}

/// The objects the e2e suite also creates on a real API server, each bordering an
/// invalid case.
#[test]
fn valid_variants_are_accepted() {
    for (about, edits) in valid_variants() {
        let object = edited("t", &edits).unwrap_or_else(|e| panic!("{about}: {e}"));
        assert_eq!(structural_errors(&object), Vec::<String>::new(), "{about}");
        assert_eq!(cel_errors(&object, None), Vec::<String>::new(), "{about}");
    }
}

/// The whole-nodes rule is written twice, as CEL for the API server and as
/// `Parallelism::fills_whole_nodes` for the operator; they must refuse the same shapes.
#[test]
fn the_whole_nodes_rule_and_the_operators_check_agree_on_every_shape() {
    let crd = checked_in_crd();
    let mut refused = 0;
    for device in [Device::Cpu, Device::Cuda] {
        for gpus_per_node in [1, 2, 3, 4, 6, 8, 16] {
            for tensor in 1..=20 {
                for pipeline in [1, 2, 3] {
                    let mut object = valid();
                    object["spec"]["release"]["engine"]["device"] = json!(device);
                    // Adapters are CPU-only: another rule, not this one's business.
                    edit(&mut object, "/spec/release/adapters", Value::Null)
                        .unwrap_or_else(|e| panic!("{e}"));
                    object["spec"]["parallelism"] = json!({
                        "tensor": tensor, "pipeline": pipeline, "gpusPerNode": gpus_per_node,
                    });
                    let cel_accepts = !cel_errors_in(&crd, &object, None)
                        .iter()
                        .any(|e| e.contains(WHOLE_NODES_MESSAGE));
                    let parallelism = Parallelism {
                        tensor,
                        pipeline,
                        gpus_per_node,
                        ..Parallelism::default()
                    };
                    assert_eq!(
                        cel_accepts,
                        parallelism.fills_whole_nodes(device),
                        "{device:?} tensor {tensor} × pipeline {pipeline} on {gpus_per_node}-GPU nodes"
                    );
                    refused += usize::from(!cel_accepts);
                }
            }
        }
    }
    // Both verdicts occur, so the comparison compares something.
    assert!(refused > 0);
}

#[test]
fn distinct_gateway_references_are_accepted() {
    // The same Gateway through two listeners, one in another namespace, one plain.
    let object = with(
        "/spec/router",
        json!({"httpRoute": {"parentRefs": [
            {"name": "public", "sectionName": "http"},
            {"name": "public", "sectionName": "https"},
            {"name": "public", "namespace": "gateways"},
            {"name": "internal.example"},
        ]}}),
    );
    assert_eq!(structural_errors(&object), Vec::<String>::new());
    assert_eq!(cel_errors(&object, None), Vec::<String>::new());
}

#[test]
fn changing_the_model_needs_a_new_kv_namespace() {
    let old = valid();
    let new_model = with("/spec/release/model/uri", json!("/models/m2.gguf"));
    let errors = cel_errors(&new_model, Some(&old));
    assert!(
        errors
            .iter()
            .any(|e| e.contains("must not share KV/prefix-cache entries")),
        "got {errors:?}"
    );

    let mut new_model_new_ns = new_model.clone();
    new_model_new_ns["spec"]["release"]["kvNamespace"] = json!("m-v2");
    assert_eq!(
        cel_errors(&new_model_new_ns, Some(&old)),
        Vec::<String>::new()
    );

    let mut new_model_no_ns = new_model.clone();
    new_model_no_ns["spec"]["release"]
        .as_object_mut()
        .unwrap()
        .remove("kvNamespace");
    assert_eq!(
        cel_errors(&new_model_no_ns, Some(&old)),
        Vec::<String>::new()
    );

    // Changing something that is not the model (the engine image) keeps the namespace.
    let new_image = with("/spec/release/engine/image", json!("slipway/engine:0.2.0"));
    assert_eq!(cel_errors(&new_image, Some(&old)), Vec::<String>::new());

    let new_adapter = with(
        "/spec/release/adapters",
        json!([{"name": "a", "uri": "/a"}]),
    );
    assert!(!cel_errors(&new_adapter, Some(&old)).is_empty());
}
