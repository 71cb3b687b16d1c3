//! The two ways a platform team installs Slipway — `kubectl apply -k manifests/` and the
//! Helm chart in `charts/slipway/` — rendered to objects, indexed by kind, namespace and
//! name, and compared.
//!
//! Invariant: with its default values and `--namespace slipway-system`, the chart renders
//! the kustomization's objects exactly, apart from two differences, both listed here and
//! nowhere else: Helm's own labels ([`HELM_LABELS`]) and the objects only the
//! kustomization has ([`ONLY_IN_KUSTOMIZATION`]).
//!
//! The operator's Deployment carries the operator's command line, which YAML cannot type:
//! [`Rendered::operator_args`] parses its container's `args` with the operator's own
//! parser ([`OperatorArgs`]), so a flag the operator does not know fails a test here.
//!
//! Helm is the binary `SLIPWAY_HELM` names (the Makefile builds it from its Go module and
//! sets it). When it is unset or not there, [`Helm::from_env`] fails; nothing is skipped.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use slipway_contract::OperatorArgs;

use crate::cluster::{Cluster, KUBECTL_TIMEOUT, run_bounded};
use crate::error::{Error, Result};
use crate::manifests::{load_documents, repo_root};

/// The namespace `manifests/` installs into; the chart is rendered into it to compare.
pub const NAMESPACE: &str = "slipway-system";

/// The release name the tests render the chart with.
pub const RELEASE: &str = "slipway";

/// Labels the chart adds to the `metadata.labels` of every object it templates (not to
/// the CRD, which Helm installs from `crds/` as it is): Helm's recommended labels, which
/// say which release owns an object. The kustomization has no release to name.
pub const HELM_LABELS: [&str; 4] = [
    "app.kubernetes.io/instance",
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/version",
    "helm.sh/chart",
];

/// `(kind, name)` of objects the kustomization renders and the chart does not. The
/// Namespace: Helm installs into the namespace it is given (`--namespace
/// slipway-system --create-namespace`) and keeps its release record there, so a chart
/// that also created it would fail on install; README.md says to label it for the
/// restricted Pod Security Standard, as `manifests/operator/namespace.yaml` does.
pub const ONLY_IN_KUSTOMIZATION: [(&str, &str); 1] = [("Namespace", NAMESPACE)];

/// How long one `helm` invocation may run (lint and template take well under a second).
const HELM_TIMEOUT: Duration = Duration::from_secs(60);

/// `charts/slipway/`.
pub fn chart_dir() -> PathBuf {
    repo_root().join("charts").join("slipway")
}

/// `manifests/`, the kustomization.
pub fn kustomization_dir() -> PathBuf {
    repo_root().join("manifests")
}

/// `manifests/operator/deployment.yaml`: the operator's Deployment in the kustomization.
pub fn operator_deployment_file() -> PathBuf {
    kustomization_dir().join("operator").join("deployment.yaml")
}

/// The operator's Deployment, in the chart and in `manifests/`.
pub const OPERATOR_DEPLOYMENT: &str = "slipway-operator";

/// The operator's container in [`OPERATOR_DEPLOYMENT`].
pub const OPERATOR_CONTAINER: &str = "operator";

/// A rendered YAML stream: the file it was written to (so kubectl can apply it and a
/// person can read it after a failure) and its objects, as JSON.
#[derive(Debug, Clone)]
pub struct Rendered {
    pub file: PathBuf,
    pub objects: Vec<Value>,
}

impl Rendered {
    fn write(file: PathBuf, text: &str) -> Result<Self> {
        if let Some(parent) = file.parent() {
            std::fs::create_dir_all(parent).map_err(|source| Error::Io {
                path: parent.to_owned(),
                source,
            })?;
        }
        std::fs::write(&file, text).map_err(|source| Error::Io {
            path: file.clone(),
            source,
        })?;
        Self::read(file)
    }

    /// The objects of a YAML file as it is checked in (such as
    /// [`operator_deployment_file`]).
    ///
    /// # Errors
    /// When the file cannot be read or is not YAML.
    pub fn read(file: PathBuf) -> Result<Self> {
        let objects = load_documents(&file)?;
        Ok(Self { file, objects })
    }

    /// The operator's container: [`OPERATOR_CONTAINER`] of `Deployment`
    /// [`OPERATOR_DEPLOYMENT`].
    ///
    /// # Errors
    /// [`Error::Manifest`] when this stream has no such Deployment or container.
    pub fn operator_container(&self) -> Result<&Value> {
        self.find("Deployment", OPERATOR_DEPLOYMENT)
            .and_then(|deployment| {
                deployment["spec"]["template"]["spec"]["containers"]
                    .as_array()?
                    .iter()
                    .find(|container| container["name"] == OPERATOR_CONTAINER)
            })
            .ok_or_else(|| Error::Manifest {
                path: self.file.clone(),
                reason: format!(
                    "no container {OPERATOR_CONTAINER} in a Deployment {OPERATOR_DEPLOYMENT}"
                ),
            })
    }

    /// The operator's command line: its container's `args`, parsed as
    /// `slipway-operator` parses them ([`OperatorArgs::parse_args`]). The flags the
    /// Deployment leaves to environment variables (`POD_NAME`, `POD_NAMESPACE`) take
    /// this process's values, or their defaults.
    ///
    /// # Errors
    /// [`Error::Manifest`] when there is no operator container, its `args` are not a
    /// list of strings, or the operator would refuse them (an unknown flag, a bad value),
    /// with clap's message.
    pub fn operator_args(&self) -> Result<OperatorArgs> {
        let container = self.operator_container()?;
        let invalid = |reason: String| Error::Manifest {
            path: self.file.clone(),
            reason,
        };
        let args: Vec<&str> = match &container["args"] {
            Value::Null => Vec::new(),
            Value::Array(args) => args
                .iter()
                .map(|arg| {
                    arg.as_str()
                        .ok_or_else(|| invalid(format!("the operator's arg {arg} is not a string")))
                })
                .collect::<Result<_>>()?,
            other => {
                return Err(invalid(format!(
                    "the operator's args {other} are not a list"
                )));
            }
        };
        OperatorArgs::parse_args(args.iter().copied()).map_err(|error| {
            invalid(format!(
                "the operator would refuse its args {args:?}: {}",
                error.render()
            ))
        })
    }

    /// The object of this kind and name, in any namespace.
    pub fn find(&self, kind: &str, name: &str) -> Option<&Value> {
        self.objects
            .iter()
            .find(|object| object["kind"] == kind && object["metadata"]["name"] == name)
    }

    /// Every object's key, sorted.
    pub fn keys(&self) -> Vec<ObjectKey> {
        let mut keys: Vec<_> = self.objects.iter().map(ObjectKey::of).collect();
        keys.sort();
        keys
    }
}

/// The helm binary the tests run.
#[derive(Debug, Clone)]
pub struct Helm {
    binary: PathBuf,
}

impl Helm {
    /// Helm from `SLIPWAY_HELM`.
    ///
    /// # Errors
    /// [`Error::Setup`] when the variable is unset or does not name a file.
    pub fn from_env() -> Result<Self> {
        let missing = |reason: String| Error::Setup {
            what: "finding helm".to_owned(),
            reason,
        };
        let binary = std::env::var_os("SLIPWAY_HELM")
            .map(PathBuf::from)
            .ok_or_else(|| {
                missing(
                "SLIPWAY_HELM is not set; run the e2e tests through `make e2e` (which builds helm \
                 from its Go module and sets it) or point it at a helm binary"
                    .to_owned(),
            )
            })?;
        if !binary.is_file() {
            return Err(missing(format!(
                "SLIPWAY_HELM={} is not a file; `make helm` builds it",
                binary.display()
            )));
        }
        Ok(Self { binary })
    }

    /// `helm lint --strict charts/slipway` with these `--set` values (typed as helm
    /// types them: `3` is a number, `true` a boolean); its report.
    ///
    /// # Errors
    /// When helm cannot run or reports an error or (being strict) a warning.
    pub fn lint(&self, set: &[(&str, &str)]) -> Result<String> {
        let mut command = self.command();
        command.arg("lint").arg("--strict").arg(chart_dir());
        add_values(&mut command, set);
        run_bounded(command, HELM_TIMEOUT)
    }

    /// `helm template slipway charts/slipway --include-crds --namespace <namespace>`
    /// with these `--set` values, written to `file`.
    ///
    /// # Errors
    /// When helm fails (a value the chart's schema refuses, a template error) or its
    /// output is not YAML.
    pub fn template(
        &self,
        namespace: &str,
        set: &[(&str, &str)],
        file: PathBuf,
    ) -> Result<Rendered> {
        let mut command = self.command();
        command.arg("template").arg(RELEASE).arg(chart_dir()).args([
            "--include-crds",
            "--namespace",
            namespace,
        ]);
        add_values(&mut command, set);
        let text = run_bounded(command, HELM_TIMEOUT)?;
        Rendered::write(file, &text)
    }

    fn command(&self) -> Command {
        let mut command = Command::new(&self.binary);
        // Nothing from the user's helm configuration (repositories, plugins) may change
        // what the chart renders.
        let isolated =
            std::env::temp_dir().join(format!("slipway-e2e-helm-{}", std::process::id()));
        for (variable, dir) in [
            ("HELM_CONFIG_HOME", "config"),
            ("HELM_CACHE_HOME", "cache"),
            ("HELM_DATA_HOME", "data"),
        ] {
            command.env(variable, isolated.join(dir));
        }
        command
    }
}

fn add_values(command: &mut Command, set: &[(&str, &str)]) {
    for (key, value) in set {
        command.arg("--set").arg(format!("{key}={value}"));
    }
}

/// `kubectl kustomize manifests/`, written to `file`.
///
/// # Errors
/// When kubectl fails or its output is not YAML.
pub fn kustomize(cluster: &Cluster, file: PathBuf) -> Result<Rendered> {
    let dir = kustomization_dir();
    let text = cluster.kubectl(&["kustomize", &dir.to_string_lossy()], KUBECTL_TIMEOUT)?;
    Rendered::write(file, &text)
}

/// Where an object lives: kind, namespace (empty for cluster-scoped objects) and name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjectKey {
    pub kind: String,
    pub namespace: String,
    pub name: String,
}

impl ObjectKey {
    /// The key of a Kubernetes object given as JSON.
    pub fn of(object: &Value) -> Self {
        let text = |value: &Value| value.as_str().unwrap_or_default().to_owned();
        Self {
            kind: text(&object["kind"]),
            namespace: text(&object["metadata"]["namespace"]),
            name: text(&object["metadata"]["name"]),
        }
    }
}

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.namespace.is_empty() {
            write!(f, "{} {}", self.kind, self.name)
        } else {
            write!(f, "{} {}/{}", self.kind, self.namespace, self.name)
        }
    }
}

/// Index objects by key.
///
/// # Errors
/// The keys that occur more than once (two objects of one stream with one name).
pub fn index(objects: &[Value]) -> std::result::Result<BTreeMap<ObjectKey, Value>, Vec<String>> {
    let mut indexed = BTreeMap::new();
    let mut duplicates = Vec::new();
    for object in objects {
        let key = ObjectKey::of(object);
        if indexed.insert(key.clone(), object.clone()).is_some() {
            duplicates.push(format!("{key} occurs more than once"));
        }
    }
    if duplicates.is_empty() {
        Ok(indexed)
    } else {
        Err(duplicates)
    }
}

/// Compare objects of `manifests/` (the kustomization's, or one file's) with the chart's,
/// allowing only [`HELM_LABELS`] on the chart's side and [`ONLY_IN_KUSTOMIZATION`].
///
/// # Errors
/// Every difference, one line each, naming the object and the field path: an object
/// one side lacks, a field whose values differ, or a Helm label on the manifests
/// side.
pub fn compare(manifests: &[Value], charted: &[Value]) -> std::result::Result<(), Vec<String>> {
    let mut differences = Vec::new();
    let (in_manifests, charted) = match (index(manifests), index(charted)) {
        (Ok(in_manifests), Ok(charted)) => (in_manifests, charted),
        (in_manifests, charted) => {
            differences.extend(
                in_manifests
                    .err()
                    .into_iter()
                    .flatten()
                    .map(|d| format!("manifests/: {d}")),
            );
            differences.extend(
                charted
                    .err()
                    .into_iter()
                    .flatten()
                    .map(|d| format!("chart: {d}")),
            );
            return Err(differences);
        }
    };
    let keys: BTreeSet<&ObjectKey> = in_manifests.keys().chain(charted.keys()).collect();
    for key in keys {
        match (in_manifests.get(key), charted.get(key)) {
            (Some(_), None) if only_in_kustomization(key) => {}
            (Some(_), None) => differences.push(format!("{key}: only in manifests/")),
            (None, Some(_)) => differences.push(format!("{key}: only in the chart")),
            (Some(from_manifests), Some(from_chart)) => {
                for label in HELM_LABELS {
                    if !from_manifests["metadata"]["labels"][label].is_null() {
                        differences.push(format!("{key}: manifests/ sets Helm's label {label}"));
                    }
                }
                // Reported above when manifests/ has them; compared without them.
                let (from_manifests, from_chart) = (
                    without_helm_labels(from_manifests),
                    without_helm_labels(from_chart),
                );
                diff_values(
                    &key.to_string(),
                    "",
                    &from_manifests,
                    &from_chart,
                    &mut differences,
                );
            }
            (None, None) => unreachable!("every key comes from one of the two maps"),
        }
    }
    if differences.is_empty() {
        Ok(())
    } else {
        Err(differences)
    }
}

fn without_helm_labels(object: &Value) -> Value {
    let mut object = object.clone();
    // get_mut, not IndexMut: indexing would insert the keys it does not find.
    let labels = object
        .get_mut("metadata")
        .and_then(|metadata| metadata.get_mut("labels"))
        .and_then(Value::as_object_mut);
    if let Some(labels) = labels {
        for label in HELM_LABELS {
            labels.remove(label);
        }
    }
    object
}

fn only_in_kustomization(key: &ObjectKey) -> bool {
    ONLY_IN_KUSTOMIZATION
        .iter()
        .any(|(kind, name)| key.kind == *kind && key.name == *name)
}

/// Field-by-field difference of two JSON values, as `object: .path: manifests/ X,
/// chart Y` lines.
fn diff_values(object: &str, path: &str, left: &Value, right: &Value, out: &mut Vec<String>) {
    match (left, right) {
        (Value::Object(left), Value::Object(right)) => {
            let keys: BTreeSet<&String> = left.keys().chain(right.keys()).collect();
            for key in keys {
                let path = format!("{path}.{key}");
                match (left.get(key), right.get(key)) {
                    (Some(l), Some(r)) => diff_values(object, &path, l, r, out),
                    (Some(l), None) => {
                        out.push(format!("{object}: {path}: manifests/ {l}, chart (absent)"))
                    }
                    (None, Some(r)) => {
                        out.push(format!("{object}: {path}: manifests/ (absent), chart {r}"))
                    }
                    (None, None) => {}
                }
            }
        }
        (Value::Array(l), Value::Array(r)) if l.len() == r.len() => {
            for (i, (l, r)) in l.iter().zip(r).enumerate() {
                diff_values(object, &format!("{path}[{i}]"), l, r, out);
            }
        }
        // One JSON number however it is written: kustomize prints the CRD's `1.0` as `1`.
        (Value::Number(l), Value::Number(r)) if l.as_f64() == r.as_f64() => {}
        (l, r) if l != r => out.push(format!("{object}: {path}: manifests/ {l}, chart {r}")),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn deployment(args: &[&str], extra_labels: Value) -> Value {
        let mut labels = json!({"app.kubernetes.io/name": "slipway-operator"});
        if let (Some(labels), Some(extra)) = (labels.as_object_mut(), extra_labels.as_object()) {
            labels.extend(extra.clone());
        }
        json!({
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "slipway-operator", "namespace": NAMESPACE, "labels": labels},
            "spec": {"template": {"spec": {"containers": [{"name": "operator", "args": args}]}}},
        })
    }

    fn helm_labels() -> Value {
        json!({
            "app.kubernetes.io/instance": RELEASE,
            "app.kubernetes.io/managed-by": "Helm",
            "app.kubernetes.io/version": "0.1.0",
            "helm.sh/chart": "slipway-0.1.0",
        })
    }

    fn namespace() -> Value {
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    }

    #[test]
    fn helm_labels_and_the_namespace_are_the_only_allowed_differences() {
        let kustomized = [namespace(), deployment(&["--log-format=json"], json!({}))];
        let charted = [deployment(&["--log-format=json"], helm_labels())];
        assert_eq!(compare(&kustomized, &charted), Ok(()));
    }

    #[test]
    fn a_differing_field_is_named_by_its_path() {
        let kustomized = [deployment(&["--log-format=json"], json!({}))];
        let charted = [deployment(&["--log-format=text"], helm_labels())];
        assert_eq!(
            compare(&kustomized, &charted),
            Err(vec![
                "Deployment slipway-system/slipway-operator: .spec.template.spec.containers[0].args[0]: \
                 manifests/ \"--log-format=json\", chart \"--log-format=text\""
                    .to_owned()
            ])
        );
    }

    #[test]
    fn another_label_or_a_missing_object_is_a_difference() {
        let kustomized = [deployment(&[], json!({}))];
        let mut labels = helm_labels();
        labels["team"] = json!("ml");
        let charted = [deployment(&[], labels), namespace()];
        let differences = compare(&kustomized, &charted).expect_err("two differences");
        assert_eq!(differences.len(), 2, "{differences:#?}");
        assert!(
            differences[0]
                .contains("Deployment slipway-system/slipway-operator: .metadata.labels.team")
        );
        assert_eq!(
            differences[1],
            "Namespace slipway-system: only in the chart"
        );

        let charted = [deployment(&[], helm_labels())];
        let only_kustomized = [
            deployment(&[], json!({})),
            json!({"kind": "Service", "metadata": {"name": "x", "namespace": NAMESPACE}}),
        ];
        assert_eq!(
            compare(&only_kustomized, &charted),
            Err(vec![
                "Service slipway-system/x: only in manifests/".to_owned()
            ])
        );
    }

    #[test]
    fn numbers_compare_by_value_not_by_how_they_are_written() {
        let crd = |minimum: Value| json!({"kind": "CustomResourceDefinition", "metadata": {"name": "x"}, "spec": {"minimum": minimum}});
        assert_eq!(compare(&[crd(json!(1))], &[crd(json!(1.0))]), Ok(()));
        assert_eq!(
            compare(&[crd(json!(1))], &[crd(json!(1.5))]),
            Err(vec![
                "CustomResourceDefinition x: .spec.minimum: manifests/ 1, chart 1.5".to_owned()
            ])
        );
    }

    fn rendered(objects: Vec<Value>) -> Rendered {
        Rendered {
            file: PathBuf::from("test.yaml"),
            objects,
        }
    }

    #[test]
    fn manifests_operator_args_are_the_operators_command_line() {
        // The error names the file.
        let args = Rendered::read(operator_deployment_file())
            .and_then(|deployment| deployment.operator_args())
            .unwrap_or_else(|error| panic!("{error}"));
        assert_eq!(args.metrics_addr.to_string(), "0.0.0.0:8080");
        assert_eq!(args.lease_duration, Duration::from_secs(15));
        assert_eq!(args.lease_retry, Duration::from_secs(2));
        assert_eq!(
            args.logs.log_format,
            Some(slipway_contract::telemetry::LogFormat::Json)
        );
        assert_eq!(
            args.router_image,
            "ghcr.io/slipway-dev/slipway-router:0.1.0"
        );
        assert_eq!(args.otlp_endpoint, None);
    }

    #[test]
    fn an_operator_flag_the_operator_would_refuse_is_an_error() {
        let misspelt = rendered(vec![deployment(&["--lease-duration=15"], json!({}))]);
        let error = misspelt.operator_args().expect_err("an unknown flag");
        assert!(error.to_string().contains("'--lease-duration'"), "{error}");

        let bad_value = rendered(vec![deployment(&["--lease-retry-seconds=2s"], json!({}))]);
        let error = bad_value.operator_args().expect_err("a bad value");
        assert!(error.to_string().contains("2s"), "{error}");

        let mut number = deployment(&[], json!({}));
        number["spec"]["template"]["spec"]["containers"][0]["args"] = json!([15]);
        let error = rendered(vec![number])
            .operator_args()
            .expect_err("a number");
        assert!(error.to_string().contains("not a string"), "{error}");

        let none = rendered(vec![namespace()]);
        let error = none.operator_args().expect_err("no Deployment");
        assert!(
            error.to_string().contains("no container operator"),
            "{error}"
        );

        // No args at all is the operator's defaults.
        let bare = rendered(vec![deployment(&[], json!({}))]);
        assert!(bare.operator_args().is_ok());
    }

    #[test]
    fn helm_labels_in_the_kustomization_and_duplicates_are_reported() {
        let kustomized = [deployment(&[], helm_labels())];
        let charted = [deployment(&[], helm_labels())];
        let differences = compare(&kustomized, &charted).expect_err("four labels");
        assert_eq!(differences.len(), HELM_LABELS.len(), "{differences:#?}");

        let twice = [deployment(&[], json!({})), deployment(&[], json!({}))];
        assert_eq!(
            compare(&twice, &charted),
            Err(vec![
                "manifests/: Deployment slipway-system/slipway-operator occurs more than once"
                    .to_owned()
            ])
        );
    }
}
