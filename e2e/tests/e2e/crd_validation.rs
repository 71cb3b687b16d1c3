//! The InferenceService CRD on the real API server: it installs, its OpenAPI
//! bounds and CEL rules reject what they should with the message a person
//! reads, the samples pass, and the `oldSelf` transition rule guards
//! kvNamespace.

use std::fmt::Write as _;

use anyhow::{Context as _, bail, ensure};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Api;
use kube::api::PostParams;
use kube::runtime::wait::conditions::is_crd_established;
use serde_json::{Value, json};
use slipway_e2e::{crd, manifests, wait};

use crate::support::{
    TestContext, dynamic, inference_services, rejection_message, valid_inference_service,
};

pub async fn crds_apply_server_side_and_become_established(
    context: TestContext,
) -> anyhow::Result<()> {
    crd::ensure_installed(&context.cluster)?;
    let admin = context.admin().await?;
    let crds = Api::<CustomResourceDefinition>::all(admin);
    let established = wait::for_object(
        &crds,
        crd::CRD_NAME,
        "the InferenceService CRD to be Established",
        wait::DEFAULT_TIMEOUT,
        is_crd_established(),
    )
    .await?;
    let served: Vec<&str> = established
        .spec
        .versions
        .iter()
        .filter(|version| version.served)
        .map(|version| version.name.as_str())
        .collect();
    ensure!(
        served.contains(&crd::VERSION),
        "the CRD serves {served:?}, not {}",
        crd::VERSION
    );
    Ok(())
}

/// Where the expected message comes from, which decides how it is checked
/// before the API server is asked.
#[derive(Debug, Clone, Copy)]
enum Expected {
    /// A CEL rule's `message`: must appear verbatim in the checked-in CRD.
    Cel(&'static str),
    /// Text the API server writes for an OpenAPI bound or enum (not in the CRD).
    Schema(&'static str),
}

impl Expected {
    fn text(self) -> &'static str {
        match self {
            Self::Cel(text) | Self::Schema(text) => text,
        }
    }
}

/// One invalid object: the valid one with `edits` applied.
struct InvalidCase {
    rule: &'static str,
    edits: Vec<(&'static str, Value)>,
    expected: Expected,
}

fn case(rule: &'static str, edits: Vec<(&'static str, Value)>, expected: Expected) -> InvalidCase {
    InvalidCase {
        rule,
        edits,
        expected,
    }
}

/// Every rule of the API, each broken once. `Value::Null` removes a field.
fn invalid_cases() -> Vec<InvalidCase> {
    use Expected::{Cel, Schema};
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
            Schema(
                "spec.parallelism.tensor: Invalid value: 0: spec.parallelism.tensor in body should be greater than or equal to 1",
            ),
        ),
        case(
            "pipeline >= 1",
            vec![("/spec/parallelism/pipeline", json!(0))],
            Schema("spec.parallelism.pipeline in body should be greater than or equal to 1"),
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
            "multi-node group fills whole nodes",
            vec![("/spec/parallelism/tensor", json!(12))],
            Cel("a group larger than one node must fill whole nodes"),
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
            Schema("spec.rollout.steps[1].weight in body should be less than or equal to 100"),
        ),
        case(
            "canary weight above 0",
            vec![("/spec/rollout/steps", steps(&[0, 100]))],
            Schema("spec.rollout.steps[0].weight in body should be greater than or equal to 1"),
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
            Schema("spec.release.engine.device: Unsupported value: \"TPU\""),
        ),
        case(
            "release is required",
            vec![("/spec/release", Value::Null)],
            Schema("spec.release: Required value"),
        ),
    ]
}

/// Every `message` of every `x-kubernetes-validations` rule in a schema.
fn collect_rule_messages(schema: &Value, messages: &mut Vec<String>) {
    match schema {
        Value::Object(map) => {
            if let Some(Value::Array(rules)) = map.get("x-kubernetes-validations") {
                messages.extend(
                    rules
                        .iter()
                        .filter_map(|rule| rule["message"].as_str().map(str::to_owned)),
                );
            }
            map.values()
                .for_each(|value| collect_rule_messages(value, messages));
        }
        Value::Array(items) => items
            .iter()
            .for_each(|item| collect_rule_messages(item, messages)),
        _ => {}
    }
}

/// Set (or, with `Value::Null`, remove) the field at a JSON pointer.
fn edit(object: &mut Value, pointer: &str, value: Value) -> anyhow::Result<()> {
    let (parent, key) = pointer.rsplit_once('/').context("pointer without '/'")?;
    let parent = object
        .pointer_mut(parent)
        .with_context(|| format!("{parent} does not exist in the valid object"))?;
    match (parent, value) {
        (Value::Object(map), Value::Null) => {
            map.remove(key);
        }
        (Value::Object(map), value) => {
            map.insert(key.to_owned(), value);
        }
        (Value::Array(items), value) => {
            let index: usize = key
                .parse()
                .with_context(|| format!("{key} is not an index"))?;
            let slot = items
                .get_mut(index)
                .with_context(|| format!("no item {index} at {pointer}"))?;
            *slot = value;
        }
        _ => bail!("{pointer}: parent is neither an object nor an array"),
    }
    Ok(())
}

pub async fn invalid_objects_are_rejected_with_their_rule_message(
    context: TestContext,
) -> anyhow::Result<()> {
    crd::ensure_installed(&context.cluster)?;
    let cases = invalid_cases();
    ensure!(cases.len() >= 15, "the table must cover at least 15 rules");

    // A CEL message that is no longer in the CRD means the table is stale, not
    // that the API server misbehaves; say so before asking it.
    let crd_file = manifests::crds_dir().join("inferenceservice.yaml");
    let mut crd_messages = Vec::new();
    for document in manifests::load_documents(&crd_file)? {
        collect_rule_messages(&document, &mut crd_messages);
    }
    let stale: Vec<&str> = cases
        .iter()
        .filter_map(|case| match case.expected {
            Expected::Cel(expected)
                if !crd_messages
                    .iter()
                    .any(|message| message.contains(expected)) =>
            {
                Some(expected)
            }
            _ => None,
        })
        .collect();
    ensure!(
        stale.is_empty(),
        "these expected messages are in no x-kubernetes-validations rule of {}; update the table: {stale:#?}",
        crd_file.display()
    );

    let admin = context.admin().await?;
    let namespace = context.namespace(&admin).await?;
    let api = inference_services(&admin, namespace.name());
    let post = PostParams::default();

    // The starting point must pass, or every rejection below proves nothing.
    api.create(&post, &dynamic(valid_inference_service("valid"))?)
        .await
        .context("the valid InferenceService the table starts from was rejected")?;

    let mut failures = String::new();
    for (index, case) in cases.iter().enumerate() {
        let mut object = valid_inference_service(&format!("invalid-{index}"));
        for (pointer, value) in &case.edits {
            edit(&mut object, pointer, value.clone())
                .with_context(|| format!("case {:?}", case.rule))?;
        }
        let result = api.create(&post, &dynamic(object)?).await;
        match rejection_message(&result) {
            Some(message)
                if message.contains(case.expected.text()) && message.contains("(422)") => {}
            Some(message) => {
                let _ = writeln!(
                    failures,
                    "- {}: rejected, but the message lacks {:?}:\n    {message}",
                    case.rule,
                    case.expected.text()
                );
            }
            None => {
                let outcome = match result {
                    Ok(_) => "accepted".to_owned(),
                    Err(error) => format!("failed without an API status: {error}"),
                };
                let _ = writeln!(failures, "- {}: {outcome}", case.rule);
            }
        }
    }
    ensure!(
        failures.is_empty(),
        "{} invalid objects were not rejected as expected:\n{failures}",
        failures
            .lines()
            .filter(|line| line.starts_with("- "))
            .count()
    );
    Ok(())
}

pub async fn every_sample_is_accepted(context: TestContext) -> anyhow::Result<()> {
    crd::ensure_installed(&context.cluster)?;
    let admin = context.admin().await?;
    let namespace = context.namespace(&admin).await?;
    let api = inference_services(&admin, namespace.name());
    let samples = manifests::load_dir(&manifests::samples_dir())?;
    let mut accepted = 0;
    let mut failures = String::new();
    for (path, mut sample) in samples {
        if sample["kind"] != crd::KIND {
            continue;
        }
        // Samples may name a namespace of their own; the test's is the one that exists.
        sample["metadata"]["namespace"] = json!(namespace.name());
        match api.create(&PostParams::default(), &dynamic(sample)?).await {
            Ok(_) => accepted += 1,
            Err(error) => {
                let _ = writeln!(failures, "- {}: {error}", path.display());
            }
        }
    }
    ensure!(
        failures.is_empty(),
        "samples rejected by the API server:\n{failures}"
    );
    ensure!(
        accepted > 0,
        "{} holds no InferenceService sample",
        manifests::samples_dir().display()
    );
    Ok(())
}

pub async fn changing_the_model_requires_a_new_kv_namespace(
    context: TestContext,
) -> anyhow::Result<()> {
    crd::ensure_installed(&context.cluster)?;
    let admin = context.admin().await?;
    let namespace = context.namespace(&admin).await?;
    let api = inference_services(&admin, namespace.name());
    let name = "transition";
    api.create(
        &PostParams::default(),
        &dynamic(valid_inference_service(name))?,
    )
    .await
    .context("creating the original release")?;

    let update = |edits: Vec<(&'static str, Value)>| {
        let api = api.clone();
        async move {
            let mut current = serde_json::to_value(api.get(name).await?)?;
            for (pointer, value) in edits {
                edit(&mut current, pointer, value)?;
            }
            anyhow::Ok(
                api.replace(name, &PostParams::default(), &dynamic(current)?)
                    .await,
            )
        }
    };
    let new_model = (
        "/spec/release/model/uri",
        json!("file:///models/smollm2-360m-instruct-q8_0.gguf"),
    );
    let new_sha = ("/spec/release/model/sha256", json!("d".repeat(64)));

    let same_namespace = update(vec![new_model.clone(), new_sha.clone()]).await?;
    let message = rejection_message(&same_namespace).with_context(|| {
        format!("a new model with the old kvNamespace was not rejected: {same_namespace:?}")
    })?;
    ensure!(
        message.contains("when model, tokenizer or adapters change, change kvNamespace too"),
        "rejected for another reason: {message}"
    );

    let new_tokenizer = update(vec![(
        "/spec/release/tokenizer/uri",
        json!("file:///models/other.json"),
    )])
    .await?;
    ensure!(
        rejection_message(&new_tokenizer).is_some(),
        "a new tokenizer with the old kvNamespace was accepted"
    );

    // Changes that leave the KV layout alone need no new namespace.
    update(vec![(
        "/spec/release/engine/image",
        json!("ghcr.io/slipway-dev/engine:0.1.1"),
    )])
    .await?
    .context("changing only the engine image was rejected")?;

    update(vec![
        new_model,
        new_sha,
        ("/spec/release/kvNamespace", json!("smollm2-v2")),
    ])
    .await?
    .context("a new model with a new kvNamespace was rejected")?;
    Ok(())
}
