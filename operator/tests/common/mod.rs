//! Helpers shared by the operator's fixture-table and contract tests (`mod common;`
//! in each).

// Each test crate includes this module and uses part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use serde_json::Value;

/// The repository root (fixtures name samples by their path from it).
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// JSON merge patch (RFC 7386): objects merge by key, `null` removes, anything else
/// replaces. Fixtures describe an object as a sample plus such a patch.
pub fn merge(target: &mut Value, patch: &Value) {
    match (target, patch) {
        (Value::Object(target), Value::Object(patch)) => {
            for (key, value) in patch {
                if value.is_null() {
                    target.remove(key);
                } else {
                    merge(target.entry(key.clone()).or_insert(Value::Null), value);
                }
            }
        }
        (target, patch) => *target = patch.clone(),
    }
}

/// A sample from `manifests/samples/` as the fixtures and the contract test see it:
/// in namespace `ml`, with a uid and generation 1 (what `plan` needs of a stored
/// object).
///
/// # Errors
/// The sample cannot be read or is not JSON-able YAML.
pub fn sample_json(stem: &str) -> Result<Value, String> {
    let path = root()
        .join("manifests/samples")
        .join(format!("{stem}.yaml"));
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut isvc: Value =
        serde_yaml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    merge(
        &mut isvc,
        &serde_json::json!({"metadata": {"namespace": "ml", "uid": "7b0c1f4e-uid", "generation": 1}}),
    );
    Ok(isvc)
}

/// The stems of every sample in `manifests/samples/`.
pub fn sample_stems() -> Vec<String> {
    let mut stems: Vec<String> = std::fs::read_dir(root().join("manifests/samples"))
        .map(|dir| {
            dir.flatten()
                .filter_map(|entry| {
                    let path = entry.path();
                    (path.extension()? == "yaml")
                        .then(|| path.file_stem()?.to_str().map(str::to_owned))
                        .flatten()
                })
                .collect()
        })
        .unwrap_or_default();
    stems.sort();
    stems
}

/// What crosses into the engine from a rendered pod, checked from the engine's side:
/// every container (init containers included) runs the image's entrypoint with
/// arguments the engine's own parser accepts, in their canonical form (each flag
/// once, as [`slipway_contract::EngineCommand::to_args`] writes it), and the only
/// environment variables are the user's own (`release.engine.env`,
/// `podTemplate.env`): the operator sets none the engine would ignore.
///
/// # Errors
/// Every violation, one per line.
pub fn check_engine_contract(
    pod: &k8s_openapi::api::core::v1::Pod,
    spec: &slipway_api::spec::InferenceServiceSpec,
) -> Result<(), String> {
    use slipway_contract::EngineCommand;
    let name = pod.metadata.name.clone().unwrap_or_default();
    let Some(pod_spec) = &pod.spec else {
        return Err(format!("{name}: no spec"));
    };
    let user_env: Vec<_> = spec
        .release
        .engine
        .env
        .iter()
        .chain(spec.pod_template.iter().flat_map(|t| t.env.iter()))
        .collect();
    let mut errors = Vec::new();
    for container in pod_spec
        .init_containers
        .iter()
        .flatten()
        .chain(&pod_spec.containers)
    {
        let at = format!("{name}/{}", container.name);
        if container.command.is_some() {
            errors.push(format!(
                "{at}: overrides the image's entrypoint with {:?}",
                container.command
            ));
        }
        let args = container.args.clone().unwrap_or_default();
        match EngineCommand::parse_args(&args) {
            Ok(command) if command.to_args() == args => {}
            Ok(command) => errors.push(format!(
                "{at}: args {args:?} are not canonical; the engine reads them as {:?}",
                command.to_args()
            )),
            Err(error) => errors.push(format!("{at}: the engine rejects {args:?}: {error}")),
        }
        for var in container.env.iter().flatten() {
            if !user_env.contains(&var) {
                errors.push(format!(
                    "{at}: env {} is set by the operator, and the engine reads no such variable",
                    var.name
                ));
            }
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("\n"))
    }
}

/// What crosses into the router from its rendered Deployment, checked from the
/// router's side: one container, the image's entrypoint, arguments the router's own
/// parser accepts in canonical form, naming this InferenceService; its namespace comes
/// from `POD_NAMESPACE` (the downward API), never from a flag.
///
/// # Errors
/// Every violation, one per line.
pub fn check_router_contract(
    deployment: &k8s_openapi::api::apps::v1::Deployment,
    isvc: &slipway_api::InferenceService,
) -> Result<(), String> {
    use clap::{Args as _, FromArgMatches as _};
    use slipway_contract::RouterArgs;
    let name = deployment.metadata.name.clone().unwrap_or_default();
    let containers = deployment
        .spec
        .template
        .spec
        .as_ref()
        .map(|s| s.containers.clone())
        .unwrap_or_default();
    let [container] = containers.as_slice() else {
        return Err(format!(
            "{name}: expected one container, got {}",
            containers.len()
        ));
    };
    let mut errors = Vec::new();
    if container.command.is_some() {
        errors.push(format!("{name}: overrides the image's entrypoint"));
    }
    let args = container.args.clone().unwrap_or_default();
    if args.iter().any(|a| a.starts_with("--namespace")) {
        errors.push(format!(
            "{name}: renders --namespace; POD_NAMESPACE says it"
        ));
    }
    let namespace_from_pod = container.env.iter().flatten().any(|v| {
        v.name == "POD_NAMESPACE"
            && v.value_from
                .as_ref()
                .and_then(|f| f.field_ref.as_ref())
                .is_some_and(|f| f.field_path == "metadata.namespace")
    });
    if !namespace_from_pod {
        errors.push(format!("{name}: POD_NAMESPACE is not the pod's namespace"));
    }
    let mut command = RouterArgs::augment_args(clap::Command::new("slipway-router"));
    match command
        .try_get_matches_from_mut(std::iter::once("slipway-router".to_owned()).chain(args.clone()))
        .and_then(|m| RouterArgs::from_arg_matches(&m))
    {
        Ok(parsed) => {
            if parsed.to_args() != args {
                errors.push(format!(
                    "{name}: args {args:?} are not canonical; the router reads them as {:?}",
                    parsed.to_args()
                ));
            }
            if parsed.inference_service.as_deref() != isvc.metadata.name.as_deref() {
                errors.push(format!(
                    "{name}: routes for {:?}, not {:?}",
                    parsed.inference_service, isvc.metadata.name
                ));
            }
        }
        Err(error) => errors.push(format!("{name}: the router rejects {args:?}: {error}")),
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("\n"))
    }
}
