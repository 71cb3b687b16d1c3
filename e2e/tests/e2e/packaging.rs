//! Installing Slipway as a platform team does, judged by the real API server: the
//! kustomization (`kubectl apply -k manifests/`) and the Helm chart (`charts/slipway/`,
//! with default values and with monitoring on) each go through `kubectl apply
//! --dry-run=server`, so admission, the CRD's structural schema, RBAC's escalation
//! check and prometheus-operator's PrometheusRule schema all decide while nothing is
//! stored. Beside that: `helm lint --strict`, the chart's values reaching the operator's
//! Deployment, and the chart rendering the kustomization's objects (see
//! `slipway_e2e::packaging` for the two allowed differences). The operator's `args` in
//! each are parsed by the operator's own parser (`slipway_contract::OperatorArgs`), so a
//! flag the operator does not know fails here, not in a crash-looping pod.
//!
//! Helm comes from `SLIPWAY_HELM` and prometheus-operator's PrometheusRule CRD from
//! `SLIPWAY_PROMETHEUS_RULE_CRD`; `make e2e` provides both (charts/charts.mk), and a
//! test without them fails.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, bail, ensure};
use serde_json::{Value, json};
use slipway_contract::telemetry::LogFormat;
use slipway_e2e::packaging::{self, Helm, ObjectKey, Rendered};
use slipway_e2e::{Cluster, crd, manifests};

use crate::support::TestContext;

const KUBECTL_TIMEOUT: Duration = Duration::from_secs(60);

/// `--set` for the chart's monitoring on.
const MONITORING_ON: &[(&str, &str)] = &[("monitoring.enabled", "true")];

pub async fn chart_passes_helm_lint_strict(_context: TestContext) -> anyhow::Result<()> {
    let helm = Helm::from_env()?;
    for set in [&[][..], MONITORING_ON] {
        let report = helm
            .lint(set)
            .with_context(|| format!("helm lint --strict with {set:?}"))?;
        ensure!(
            report.contains("1 chart(s) linted, 0 chart(s) failed"),
            "helm lint with {set:?} did not report a clean chart:\n{report}"
        );
    }
    Ok(())
}

pub async fn kustomization_is_accepted_by_a_server_side_dry_run(
    context: TestContext,
) -> anyhow::Result<()> {
    let cluster = &context.cluster;
    // The CRD is applied for real by the other tests; installing it first makes this
    // dry run a no-op update of it rather than a race with their create.
    crd::ensure_installed(cluster)?;
    let rendered = packaging::kustomize(cluster, scratch_file(context.name, "kustomization"))?;
    // A dry run creates nothing, so the namespace its objects go into must exist.
    let _namespace = ExistingNamespace::ensure(cluster, packaging::NAMESPACE)?;
    let dir = packaging::kustomization_dir();
    let accepted = server_dry_run(cluster, &["-k", &dir.to_string_lossy()])?;
    same_keys(&rendered, &accepted, "kubectl apply -k manifests/")
}

pub async fn chart_is_accepted_by_a_server_side_dry_run(
    context: TestContext,
) -> anyhow::Result<()> {
    let cluster = &context.cluster;
    crd::ensure_installed(cluster)?;
    install_prometheus_rule_crd(cluster)?;
    let helm = Helm::from_env()?;
    let admin = context.admin().await?;
    // The chart installs into the namespace it is given: here the test's own.
    let namespace = context.namespace(&admin).await?;
    for (label, set) in [("defaults", &[][..]), ("monitoring", MONITORING_ON)] {
        let rendered = helm.template(
            namespace.name(),
            set,
            scratch_file(context.name, &format!("chart-{label}")),
        )?;
        let file = rendered.file.to_string_lossy().into_owned();
        let accepted = server_dry_run(cluster, &["-f", &file])
            .with_context(|| format!("the chart with {label} ({file})"))?;
        same_keys(&rendered, &accepted, &format!("the chart with {label}"))?;
        // Monitoring adds exactly a PrometheusRule and the dashboard's ConfigMap.
        for kind in ["PrometheusRule", "ConfigMap"] {
            let renders = rendered.objects.iter().any(|object| object["kind"] == kind);
            ensure!(
                renders == (label == "monitoring"),
                "the chart with {label} {} a {kind}",
                if renders { "renders" } else { "lacks" }
            );
        }
    }
    Ok(())
}

pub async fn chart_renders_the_kustomizations_objects(context: TestContext) -> anyhow::Result<()> {
    let helm = Helm::from_env()?;
    let chart = helm.template(
        packaging::NAMESPACE,
        &[],
        scratch_file(context.name, "chart"),
    )?;
    let kustomized = packaging::kustomize(
        &context.cluster,
        scratch_file(context.name, "kustomization"),
    )?;
    if let Err(differences) = packaging::compare(&kustomized.objects, &chart.objects) {
        bail!(
            "the chart ({}) and the kustomization ({}) differ beyond Helm's labels and the \
             Namespace:\n  {}",
            chart.file.display(),
            kustomized.file.display(),
            differences.join("\n  ")
        );
    }
    // Equal objects, so one command line; the operator must accept it.
    for rendered in [&chart, &kustomized] {
        rendered.operator_args()?;
    }
    // Not vacuous: the two streams hold the objects an install needs.
    let keys: Vec<String> = chart.keys().iter().map(ToString::to_string).collect();
    for expected in [
        "CustomResourceDefinition inferenceservices.slipway.dev",
        "ClusterRole slipway-operator",
        "ClusterRoleBinding slipway-operator",
        "Deployment slipway-system/slipway-operator",
        "Role slipway-system/slipway-operator-leader-election",
        "RoleBinding slipway-system/slipway-operator-leader-election",
        "Service slipway-system/slipway-operator-metrics",
        "ServiceAccount slipway-system/slipway-operator",
    ] {
        ensure!(
            keys.iter().any(|key| key == expected),
            "the chart lacks {expected}: {keys:#?}"
        );
    }
    Ok(())
}

pub async fn monitoring_renders_manifests_monitoring(context: TestContext) -> anyhow::Result<()> {
    let helm = Helm::from_env()?;
    let chart = helm.template(
        packaging::NAMESPACE,
        MONITORING_ON,
        scratch_file(context.name, "chart-monitoring"),
    )?;
    let dir = manifests::repo_root().join("manifests").join("monitoring");

    // The PrometheusRule is manifests/monitoring's, in the release's namespace.
    let rule_file = dir.join("prometheus-rule.yaml");
    let mut rules = manifests::load_documents(&rule_file)?;
    ensure!(
        rules.len() == 1,
        "{} holds {} objects, not one",
        rule_file.display(),
        rules.len()
    );
    rules[0]["metadata"]["namespace"] = json!(packaging::NAMESPACE);
    let charted: Vec<Value> = chart
        .objects
        .iter()
        .filter(|object| object["kind"] == "PrometheusRule")
        .cloned()
        .collect();
    if let Err(differences) = packaging::compare(&rules, &charted) {
        bail!(
            "the chart's PrometheusRule ({}) is not {}:\n  {}",
            chart.file.display(),
            rule_file.display(),
            differences.join("\n  ")
        );
    }

    // The dashboard, byte for byte, where Grafana's sidecar finds it.
    let dashboard_file = dir.join("dashboard.json");
    let dashboard = std::fs::read_to_string(&dashboard_file)
        .with_context(|| format!("reading {}", dashboard_file.display()))?;
    let config_map = chart
        .find("ConfigMap", "slipway-dashboard")
        .context("the chart with monitoring on has no ConfigMap slipway-dashboard")?;
    ensure!(
        config_map["data"]["slipway.json"].as_str() == Some(dashboard.as_str()),
        "ConfigMap slipway-dashboard's slipway.json is not {} byte for byte",
        dashboard_file.display()
    );
    ensure!(
        config_map["metadata"]["labels"]["grafana_dashboard"] == "1",
        "the dashboard ConfigMap lacks the label Grafana's sidecar looks for: {}",
        config_map["metadata"]
    );
    Ok(())
}

pub async fn chart_values_reach_the_operator_deployment(
    context: TestContext,
) -> anyhow::Result<()> {
    let helm = Helm::from_env()?;
    let defaults = helm.template(
        packaging::NAMESPACE,
        &[],
        scratch_file(context.name, "defaults"),
    )?;
    let operator = defaults.operator_container()?;
    let args = defaults.operator_args()?;
    ensure!(
        args.logs.log_format == Some(LogFormat::Json)
            && args.router_image == "ghcr.io/slipway-dev/slipway-router:0.1.0"
            && args.otlp_endpoint.is_none(),
        "by default the operator logs JSON, renders the chart's router image and gets no --otlp-endpoint: {args:?}"
    );
    ensure!(
        operator.get("imagePullPolicy").is_none(),
        "an empty pullPolicy leaves Kubernetes' default: {operator}"
    );

    let set = [
        ("image.repository", "registry.example/slipway/operator"),
        ("image.tag", "1.2.3"),
        ("image.pullPolicy", "Always"),
        ("routerImage.repository", "registry.example/slipway/router"),
        ("routerImage.tag", "1.2.4"),
        ("replicas", "3"),
        ("resources.requests.cpu", "250m"),
        ("resources.limits.memory", "1Gi"),
        ("logFormat", "text"),
        ("otlpEndpoint", "http://otel-collector.observability:4318"),
    ];
    let custom = helm.template(
        packaging::NAMESPACE,
        &set,
        scratch_file(context.name, "custom"),
    )?;
    let deployment = custom
        .find("Deployment", "slipway-operator")
        .context("the chart renders the operator's Deployment")?;
    ensure!(
        deployment["spec"]["replicas"] == 3,
        "replicas: {}",
        deployment["spec"]
    );
    let operator = custom.operator_container()?;
    ensure!(
        operator["image"] == "registry.example/slipway/operator:1.2.3",
        "image: {operator}"
    );
    ensure!(
        operator["imagePullPolicy"] == "Always",
        "imagePullPolicy: {operator}"
    );
    ensure!(
        operator["resources"]["requests"]["cpu"] == "250m",
        "resources: {operator}"
    );
    ensure!(
        operator["resources"]["limits"]["memory"] == "1Gi",
        "resources: {operator}"
    );
    // Parsed as the operator parses them: `--log-format` twice would be refused.
    let args = custom.operator_args()?;
    ensure!(
        args.logs.log_format == Some(LogFormat::Text)
            && args.otlp_endpoint.as_deref() == Some("http://otel-collector.observability:4318")
            && args.router_image == "registry.example/slipway/router:1.2.4",
        "args: {args:?}"
    );

    // The values' schema refuses what the operator would refuse at start.
    for (key, value) in [("logFormat", "yaml"), ("otlpEndpoint", "collector:4318")] {
        let refused = helm.template(
            packaging::NAMESPACE,
            &[(key, value)],
            scratch_file(context.name, &format!("refused-{key}")),
        );
        match refused {
            Err(error) if error.to_string().contains(key) => {}
            Err(error) => bail!("{key}={value} was refused, but without naming {key}: {error}"),
            Ok(_) => bail!("{key}={value} was accepted"),
        }
    }
    Ok(())
}

/// Where a test writes what it rendered (kept for reading after a failure).
fn scratch_file(test: &str, what: &str) -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("packaging")
        .join(test.replace("::", "-"))
        .join(format!("{what}.yaml"))
}

/// `kubectl apply --dry-run=server -o json <args>`: the keys of the objects the API
/// server accepted (kubectl exits non-zero when it refuses any).
fn server_dry_run(cluster: &Cluster, args: &[&str]) -> anyhow::Result<BTreeSet<ObjectKey>> {
    let mut full = vec!["apply", "--dry-run=server", "-o", "json"];
    full.extend_from_slice(args);
    let output = cluster.kubectl(&full, KUBECTL_TIMEOUT)?;
    let value: Value =
        serde_json::from_str(&output).context("kubectl apply -o json printed no JSON")?;
    let objects = if value["kind"] == "List" {
        value["items"].as_array().cloned().unwrap_or_default()
    } else {
        vec![value]
    };
    Ok(objects.iter().map(ObjectKey::of).collect())
}

fn same_keys(
    rendered: &Rendered,
    accepted: &BTreeSet<ObjectKey>,
    what: &str,
) -> anyhow::Result<()> {
    let rendered_keys: BTreeSet<ObjectKey> = rendered.keys().into_iter().collect();
    ensure!(!rendered_keys.is_empty(), "{what} rendered nothing");
    ensure!(
        &rendered_keys == accepted,
        "the API server's dry run of {what} returned other objects than were sent:\n  sent {:?}\n  \
         returned {:?}",
        rendered_keys
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>(),
        accepted.iter().map(ToString::to_string).collect::<Vec<_>>()
    );
    Ok(())
}

/// prometheus-operator's PrometheusRule CRD (from its Go module, by `make e2e`), applied
/// for real so the chart's PrometheusRule is checked against its schema. It stays
/// installed: cluster-scoped, and no other test looks at it.
fn install_prometheus_rule_crd(cluster: &Cluster) -> anyhow::Result<()> {
    let path = std::env::var("SLIPWAY_PROMETHEUS_RULE_CRD").context(
        "SLIPWAY_PROMETHEUS_RULE_CRD is not set; run the e2e tests through `make e2e`, which \
         fetches prometheus-operator's PrometheusRule CRD and sets it",
    )?;
    ensure!(
        Path::new(&path).is_file(),
        "SLIPWAY_PROMETHEUS_RULE_CRD={path} is not a file"
    );
    cluster.kubectl(
        &[
            "apply",
            "--server-side",
            "--force-conflicts",
            "--field-manager",
            "slipway-e2e",
            "-f",
            &path,
        ],
        KUBECTL_TIMEOUT,
    )?;
    cluster.wait_established(&["-f", &path], Duration::from_secs(60))?;
    Ok(())
}

/// A namespace that exists for as long as this lives: found, or created and deleted
/// again on drop (a cluster reused from `make demo` keeps its own). Only the
/// kustomization's test uses `slipway-system`, so no other test races this.
struct ExistingNamespace<'a> {
    cluster: &'a Cluster,
    name: &'static str,
    created: bool,
}

impl<'a> ExistingNamespace<'a> {
    fn ensure(cluster: &'a Cluster, name: &'static str) -> anyhow::Result<Self> {
        let found = cluster.kubectl(
            &["get", "namespace", name, "--ignore-not-found", "-o", "name"],
            KUBECTL_TIMEOUT,
        )?;
        let created = found.trim().is_empty();
        if created {
            cluster.kubectl(&["create", "namespace", name], KUBECTL_TIMEOUT)?;
        }
        Ok(Self {
            cluster,
            name,
            created,
        })
    }
}

impl Drop for ExistingNamespace<'_> {
    fn drop(&mut self) {
        if self.created {
            // Waiting (an empty namespace goes in about a second): a run right after this
            // one must not find it Terminating, where a dry run is refused.
            let deleted = self.cluster.kubectl(
                &[
                    "delete",
                    "namespace",
                    self.name,
                    "--wait=true",
                    "--timeout=60s",
                    "--ignore-not-found",
                ],
                KUBECTL_TIMEOUT + Duration::from_secs(60),
            );
            if let Err(error) = deleted {
                eprintln!("error: deleting namespace {}: {error}", self.name);
            }
        }
    }
}
