//! The generated CRD: checked in up to date, its samples valid, its CEL rules doing what
//! their messages say.
//!
//! The CEL rules are evaluated here client-side (kube's CEL validator, with the schema's
//! defaults applied first, as the API server does); the e2e suite proves the same table
//! against a real API server.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use slipway_api::InferenceService;

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
    let crd = checked_in_crd();
    match kube::core::cel::Validator::new().validate(openapi_schema(&crd), object, old) {
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
    json!({
        "apiVersion": "slipway.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "t", "namespace": "default"},
        "spec": {
            "release": {
                "model": {"uri": "/models/m.gguf"},
                "kvNamespace": "m-v1",
                "engine": {"image": "slipway/engine:0.1.0"}
            },
            "capacity": {"demand": {"static": 10}, "replicaGoodput": 2}
        }
    })
}

fn with(path: &[&str], value: Value) -> Value {
    let mut object = valid();
    let mut cursor = &mut object;
    for key in &path[..path.len() - 1] {
        cursor = cursor
            .as_object_mut()
            .expect("object on the path")
            .entry(key.to_string())
            .or_insert_with(|| json!({}));
    }
    cursor[path[path.len() - 1]] = value;
    object
}

#[test]
fn the_minimal_object_is_valid() {
    assert_eq!(structural_errors(&valid()), Vec::<String>::new());
    assert_eq!(cel_errors(&valid(), None), Vec::<String>::new());
}

#[test]
fn invalid_objects_are_rejected_with_their_message() {
    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "fLoss = 1",
            with(&["spec", "capacity", "faultDomain", "fLoss"], json!(1.0)),
            "fLoss must be at least 0 and less than 1",
        ),
        (
            "fLoss < 0",
            with(&["spec", "capacity", "faultDomain", "fLoss"], json!(-0.1)),
            "fLoss must be at least 0 and less than 1",
        ),
        (
            "min > max",
            with(&["spec", "capacity", "minReplicas"], json!(200)),
            "minReplicas must not exceed maxReplicas",
        ),
        (
            "demand 0",
            with(&["spec", "capacity", "demand", "static"], json!(0)),
            "demand.static must be positive",
        ),
        (
            "demand with no source",
            with(&["spec", "capacity", "demand"], json!({})),
            "capacity.demand needs static, measured, or both",
        ),
        (
            "rate window longer than the peak window",
            with(
                &["spec", "capacity", "demand"],
                json!({"measured": {"rateWindow": "10m", "peakWindow": "5m"}}),
            ),
            "demand.measured.rateWindow must not be longer than peakWindow",
        ),
        (
            "rate window read too often",
            with(
                &["spec", "capacity", "demand"],
                json!({"measured": {"rateWindow": "2s"}}),
            ),
            "demand.measured.rateWindow must be at least 4s",
        ),
        (
            "goodput < 0",
            with(&["spec", "capacity", "replicaGoodput"], json!(-1.5)),
            "replicaGoodput must be positive",
        ),
        (
            "weights decrease",
            with(
                &["spec", "rollout", "steps"],
                json!([{"weight": 50}, {"weight": 10}]),
            ),
            "canary step weights must be strictly increasing",
        ),
        (
            "weights repeat",
            with(
                &["spec", "rollout", "steps"],
                json!([{"weight": 50}, {"weight": 50}]),
            ),
            "canary step weights must be strictly increasing",
        ),
        (
            "weight 0",
            with(
                &["spec", "rollout", "steps"],
                json!([{"weight": 0}, {"weight": 100}]),
            ),
            "canary step weights must be within (0, 100]",
        ),
        (
            "weight 101",
            with(&["spec", "rollout", "steps"], json!([{"weight": 101}])),
            "canary step weights must be within (0, 100]",
        ),
        (
            "objective 1",
            with(&["spec", "slo", "availability"], json!(1.0)),
            "slo.availability must be between 0 and 1",
        ),
        (
            "objective 0",
            with(&["spec", "slo", "availability"], json!(0)),
            "slo.availability must be between 0 and 1",
        ),
        (
            "zero ttft",
            with(&["spec", "slo", "ttft"], json!({"threshold": "0s"})),
            "latency threshold must be a positive duration",
        ),
        (
            "zero pause",
            with(
                &["spec", "rollout", "steps"],
                json!([{"weight": 100, "pause": "0s"}]),
            ),
            "pause must be a positive duration",
        ),
        (
            "short sha",
            with(&["spec", "release", "model", "sha256"], json!("abc123")),
            "sha256 must be 64 lowercase hex characters",
        ),
        (
            "upper sha",
            with(
                &["spec", "release", "model", "sha256"],
                json!("B179C9523D0E6A0F98A330C7562B682750A6F8C8C15E5BC70EA373728110DB53"),
            ),
            "sha256 must be 64 lowercase hex characters",
        ),
        (
            "kvNamespace not a DNS label",
            with(&["spec", "release", "kvNamespace"], json!("Bad_NS")),
            "kvNamespace must be a DNS label",
        ),
        (
            "servedModelName with a space",
            with(&["spec", "servedModelName"], json!("my model")),
            "servedModelName must start with a letter or digit",
        ),
        (
            "group too large",
            with(
                &["spec", "parallelism"],
                json!({"tensor": 64, "pipeline": 16}),
            ),
            "a group may span at most 512 GPUs",
        ),
        (
            "group not whole nodes",
            with(
                &["spec", "parallelism"],
                json!({"tensor": 4, "pipeline": 3, "gpusPerNode": 8}),
            ),
            "a group larger than one node must fill whole nodes",
        ),
        (
            "short ≥ long window",
            with(
                &["spec", "rollout", "analysis"],
                json!({"shortWindow": "1h", "longWindow": "5m"}),
            ),
            "shortWindow must be shorter than longWindow",
        ),
        (
            "RollbackAfter without timeout",
            with(
                &["spec", "rollout", "analysis"],
                json!({"inconclusivePolicy": "RollbackAfter"}),
            ),
            "inconclusivePolicy RollbackAfter needs inconclusiveTimeout",
        ),
        (
            "Prometheus without url",
            with(
                &["spec", "rollout", "analysis", "metrics"],
                json!({"source": "Prometheus"}),
            ),
            "metrics.source Prometheus needs metrics.prometheus.url",
        ),
        (
            "duplicate adapters",
            with(
                &["spec", "release", "adapters"],
                json!([{"name": "a", "uri": "/a"}, {"name": "a", "uri": "/b"}]),
            ),
            "adapter names must be unique",
        ),
        (
            "adapters on CUDA",
            with(
                &["spec", "release"],
                json!({
                    "model": {"uri": "/m.gguf"},
                    "adapters": [{"name": "a", "uri": "/a.gguf"}],
                    "engine": {"image": "e:1", "device": "CUDA"},
                }),
            ),
            "adapters are served on device CPU only for now",
        ),
        (
            "a Gateway named twice without listeners",
            with(
                &["spec", "router", "httpRoute", "parentRefs"],
                json!([{"name": "public"}, {"name": "public"}]),
            ),
            "parentRefs: each Gateway (and sectionName) may be named only once",
        ),
        (
            "a Gateway named twice, once with a listener",
            with(
                &["spec", "router", "httpRoute", "parentRefs"],
                json!([{"name": "public"}, {"name": "public", "sectionName": "https"}]),
            ),
            "parentRefs: sectionName must be set in every reference to a Gateway named more than once",
        ),
        (
            "a Gateway name with capitals",
            with(
                &["spec", "router", "httpRoute", "parentRefs"],
                json!([{"name": "Public"}]),
            ),
            "parentRefs.name must be a Gateway name",
        ),
        (
            "a Gateway namespace with a dot",
            with(
                &["spec", "router", "httpRoute", "parentRefs"],
                json!([{"name": "public", "namespace": "a.b"}]),
            ),
            "parentRefs.namespace must be a namespace name",
        ),
        (
            "a listener name with an underscore",
            with(
                &["spec", "router", "httpRoute", "parentRefs"],
                json!([{"name": "public", "sectionName": "a_b"}]),
            ),
            "parentRefs.sectionName must be a listener name",
        ),
    ];
    assert!(cases.len() >= 15);
    for (name, object, expected) in cases {
        let errors = cel_errors(&object, None);
        assert!(
            errors.iter().any(|e| e.contains(expected)),
            "{name}: expected {expected:?}, got {errors:?}"
        );
    }
}

#[test]
fn distinct_gateway_references_are_accepted() {
    // The same Gateway through two listeners, one in another namespace, one plain.
    let object = with(
        &["spec", "router", "httpRoute", "parentRefs"],
        json!([
            {"name": "public", "sectionName": "http"},
            {"name": "public", "sectionName": "https"},
            {"name": "public", "namespace": "gateways"},
            {"name": "internal.example"},
        ]),
    );
    assert_eq!(structural_errors(&object), Vec::<String>::new());
    assert_eq!(cel_errors(&object, None), Vec::<String>::new());
}

#[test]
fn openapi_bounds_reject_what_cel_does_not_cover() {
    let cases: Vec<(&str, Value)> = vec![
        (
            "tensor 0",
            with(&["spec", "parallelism"], json!({"tensor": 0})),
        ),
        (
            "pipeline 0",
            with(&["spec", "parallelism"], json!({"pipeline": 0})),
        ),
        (
            "unknown device",
            with(&["spec", "release", "engine", "device"], json!("TPU")),
        ),
        (
            "duration without unit",
            with(&["spec", "slo", "ttft"], json!({"threshold": "30"})),
        ),
        (
            "missing model",
            with(&["spec", "release"], json!({"engine": {"image": "e"}})),
        ),
        (
            "too many steps",
            with(
                &["spec", "rollout", "steps"],
                json!((1..=21).map(|w| json!({"weight": w})).collect::<Vec<_>>()),
            ),
        ),
    ];
    for (name, object) in cases {
        assert!(!structural_errors(&object).is_empty(), "{name}: accepted");
    }
}

#[test]
fn changing_the_model_needs_a_new_kv_namespace() {
    let old = valid();
    let new_model = with(
        &["spec", "release", "model", "uri"],
        json!("/models/m2.gguf"),
    );
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
    let new_image = with(
        &["spec", "release", "engine", "image"],
        json!("slipway/engine:0.2.0"),
    );
    assert_eq!(cel_errors(&new_image, Some(&old)), Vec::<String>::new());

    let new_adapter = with(
        &["spec", "release", "adapters"],
        json!([{"name": "a", "uri": "/a"}]),
    );
    assert!(!cel_errors(&new_adapter, Some(&old)).is_empty());
}
