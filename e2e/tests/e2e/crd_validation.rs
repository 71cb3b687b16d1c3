//! The InferenceService CRD on the real API server: it installs, its OpenAPI
//! bounds and CEL rules reject what they should with the message a person
//! reads, the samples pass, and the `oldSelf` transition rule guards
//! kvNamespace.

use std::fmt::Write as _;

use anyhow::{Context as _, ensure};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Api;
use kube::api::PostParams;
use kube::runtime::wait::conditions::is_crd_established;
use serde_json::{Value, json};
use slipway_api::testing::{edit, edited, invalid_cases, valid_inference_service, valid_variants};
use slipway_e2e::{crd, manifests, wait};

use crate::support::{TestContext, dynamic, inference_services, rejection_message};

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
        .filter_map(|case| case.expected.cel_message())
        .filter(|expected| {
            !crd_messages
                .iter()
                .any(|message| message.contains(expected))
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
    // Objects bordering the invalid cases (a CPU group that gpusPerNode does not
    // constrain, CUDA groups that fill their nodes) pass too.
    for (index, (about, edits)) in valid_variants().iter().enumerate() {
        let object = edited(&format!("valid-{index}"), edits).with_context(|| about.to_string())?;
        api.create(&post, &dynamic(object)?)
            .await
            .with_context(|| format!("{about} was rejected"))?;
    }

    let mut failures = String::new();
    for (index, case) in cases.iter().enumerate() {
        let object = case
            .object(&format!("invalid-{index}"))
            .with_context(|| format!("case {:?}", case.rule))?;
        let result = api.create(&post, &dynamic(object)?).await;
        let expected = case.expected.api_server_text();
        match rejection_message(&result) {
            Some(message) if message.contains(expected) && message.contains("(422)") => {}
            Some(message) => {
                let _ = writeln!(
                    failures,
                    "- {}: rejected, but the message lacks {expected:?}:\n    {message}",
                    case.rule,
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
