//! Running as the operator's own RBAC identity.
//!
//! [`OperatorIdentity::bind`] creates the ServiceAccount of `manifests/rbac/`
//! in a test's namespace, binds it to the same roles, mints a token with
//! `kubectl create token` and writes a kubeconfig that uses it. Tests then act
//! as the operator would and read the audit log for what it was denied.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kube::api::{DynamicObject, Patch, PatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::{Api, Client};
use serde_json::{Value, json};

use crate::audit::{self, AuditEvent};
use crate::cluster::{Cluster, KUBECTL_TIMEOUT, client_from_kubeconfig};
use crate::error::{Error, Result};
use crate::manifests;
use crate::namespace::TestNamespace;

/// Field manager for everything the e2e fixture applies.
pub const FIELD_MANAGER: &str = "slipway-e2e";

/// Lifetime of the minted token; longer than any test run.
const TOKEN_DURATION: &str = "2h";

/// The operator's ServiceAccount, bound like `manifests/rbac/` binds it, with a
/// kubeconfig that authenticates as it. Cluster-scoped bindings created for it
/// are deleted when this is dropped (the namespace takes the rest with it).
#[derive(Debug)]
pub struct OperatorIdentity {
    cluster: Cluster,
    username: String,
    kubeconfig: PathBuf,
    cluster_role_bindings: Vec<String>,
}

impl OperatorIdentity {
    /// Create the ServiceAccount of `manifests/rbac/` in `namespace`, apply the
    /// roles as they are, re-point the bindings at this copy of the account,
    /// and mint a token for it.
    ///
    /// ClusterRoleBindings are renamed `<name>-<namespace>` so tests running at
    /// the same time each get their own.
    ///
    /// # Errors
    /// When `manifests/rbac/` does not hold exactly one ServiceAccount, holds a
    /// kind this helper does not know, or the API server rejects an object.
    pub async fn bind(
        cluster: &Cluster,
        admin: &Client,
        namespace: &TestNamespace,
    ) -> Result<Self> {
        let rbac_dir = manifests::rbac_dir();
        let documents = manifests::load_dir(&rbac_dir)?;
        let service_account = single_service_account(&rbac_dir, &documents)?;
        let ns = namespace.name();
        let mut identity = Self {
            cluster: cluster.clone(),
            username: format!("system:serviceaccount:{ns}:{service_account}"),
            kubeconfig: cluster
                .workdir()
                .join("identities")
                .join(format!("{ns}-{service_account}.kubeconfig")),
            cluster_role_bindings: Vec::new(),
        };
        for (path, mut document) in documents {
            let kind = document["kind"].as_str().unwrap_or_default().to_owned();
            let scope = match kind.as_str() {
                "ClusterRole" => None,
                "ServiceAccount" | "Role" => Some(ns),
                "RoleBinding" => {
                    retarget_subjects(&mut document, ns);
                    Some(ns)
                }
                "ClusterRoleBinding" => {
                    retarget_subjects(&mut document, ns);
                    let name = format!(
                        "{}-{ns}",
                        document["metadata"]["name"].as_str().unwrap_or_default()
                    );
                    document["metadata"]["name"] = json!(name);
                    identity.cluster_role_bindings.push(name);
                    None
                }
                other => {
                    return Err(Error::Manifest {
                        path,
                        reason: format!(
                            "kind {other:?} is not one the RBAC fixture knows how to bind"
                        ),
                    });
                }
            };
            apply(admin, &path, document, scope).await?;
        }
        let token = cluster.kubectl(
            &[
                "create",
                "token",
                &service_account,
                "--namespace",
                ns,
                "--duration",
                TOKEN_DURATION,
            ],
            KUBECTL_TIMEOUT,
        )?;
        write_token_kubeconfig(cluster.kubeconfig(), &identity.kubeconfig, token.trim(), ns)?;
        Ok(identity)
    }

    /// The user name the API server (and its audit log) knows this identity by.
    pub fn username(&self) -> &str {
        &self.username
    }

    /// A kubeconfig authenticating with the ServiceAccount's token.
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// A client acting as the operator.
    ///
    /// # Errors
    /// When the kubeconfig written by [`OperatorIdentity::bind`] is unusable.
    pub async fn client(&self) -> Result<Client> {
        client_from_kubeconfig(&self.kubeconfig).await
    }

    /// Requests of this identity that were answered 403 so far.
    ///
    /// # Errors
    /// When the audit log cannot be read.
    pub fn forbidden_requests(&self) -> Result<Vec<AuditEvent>> {
        audit::forbidden_requests(&self.cluster.audit_log(), &self.username)
    }

    /// Wait until the audit log records a 403 for this identity.
    ///
    /// # Errors
    /// [`Error::Timeout`] when none shows up within `timeout`.
    pub async fn wait_for_forbidden(&self, timeout: Duration) -> Result<Vec<AuditEvent>> {
        audit::wait_for_forbidden(&self.cluster.audit_log(), &self.username, timeout).await
    }
}

impl Drop for OperatorIdentity {
    fn drop(&mut self) {
        for binding in &self.cluster_role_bindings {
            let deleted = self.cluster.kubectl(
                &[
                    "delete",
                    "clusterrolebinding",
                    binding,
                    "--ignore-not-found",
                    "--wait=false",
                ],
                KUBECTL_TIMEOUT,
            );
            if let Err(error) = deleted {
                tracing::warn!(%error, %binding, "could not delete test ClusterRoleBinding");
            }
        }
        // The token file must not outlive the test; a missing file is fine.
        let _ = std::fs::remove_file(&self.kubeconfig);
    }
}

fn single_service_account(dir: &Path, documents: &[(PathBuf, Value)]) -> Result<String> {
    let names: Vec<&str> = documents
        .iter()
        .filter(|(_, document)| document["kind"] == "ServiceAccount")
        .filter_map(|(_, document)| document["metadata"]["name"].as_str())
        .collect();
    match names.as_slice() {
        [name] => Ok((*name).to_owned()),
        _ => Err(Error::Manifest {
            path: dir.to_owned(),
            reason: format!("expected exactly one ServiceAccount, found {names:?}"),
        }),
    }
}

/// Point ServiceAccount subjects at `namespace`, where the test's copy lives.
fn retarget_subjects(binding: &mut Value, namespace: &str) {
    if let Some(subjects) = binding["subjects"].as_array_mut() {
        for subject in subjects
            .iter_mut()
            .filter(|subject| subject["kind"] == "ServiceAccount")
        {
            subject["namespace"] = json!(namespace);
        }
    }
}

/// Server-side apply one manifest document, cluster-scoped or into `namespace`.
async fn apply(
    client: &Client,
    path: &Path,
    mut document: Value,
    namespace: Option<&str>,
) -> Result<()> {
    let invalid = |reason: &str| Error::Manifest {
        path: path.to_owned(),
        reason: reason.to_owned(),
    };
    let api_version = document["apiVersion"]
        .as_str()
        .ok_or_else(|| invalid("no apiVersion"))?;
    let kind = document["kind"]
        .as_str()
        .ok_or_else(|| invalid("no kind"))?;
    let name = document["metadata"]["name"]
        .as_str()
        .ok_or_else(|| invalid("no metadata.name"))?
        .to_owned();
    let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
    let resource = ApiResource::from_gvk(&GroupVersionKind::gvk(group, version, kind));
    let api: Api<DynamicObject> = match namespace {
        Some(namespace) => {
            document["metadata"]["namespace"] = json!(namespace);
            Api::namespaced_with(client.clone(), namespace, &resource)
        }
        None => Api::all_with(client.clone(), &resource),
    };
    api.patch(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&document),
    )
    .await?;
    Ok(())
}

/// Write a kubeconfig for `token`, trusting the same CA and talking to the same
/// server as the admin kubeconfig's current context.
fn write_token_kubeconfig(
    admin_kubeconfig: &Path,
    target: &Path,
    token: &str,
    namespace: &str,
) -> Result<()> {
    let admin = manifests::load_documents(admin_kubeconfig)?
        .into_iter()
        .next()
        .unwrap_or(Value::Null);
    let invalid = |reason: String| Error::Manifest {
        path: admin_kubeconfig.to_owned(),
        reason,
    };
    let current = admin["current-context"]
        .as_str()
        .ok_or_else(|| invalid("no current-context".to_owned()))?;
    let cluster_name = find_named(&admin["contexts"], current)
        .and_then(|context| context["context"]["cluster"].as_str())
        .ok_or_else(|| invalid(format!("context {current:?} names no cluster")))?;
    let cluster = find_named(&admin["clusters"], cluster_name)
        .map(|cluster| cluster["cluster"].clone())
        .ok_or_else(|| invalid(format!("cluster {cluster_name:?} is not defined")))?;
    let user = "slipway-operator";
    let kubeconfig = json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{ "name": cluster_name, "cluster": cluster }],
        "users": [{ "name": user, "user": { "token": token } }],
        "contexts": [{
            "name": user,
            "context": { "cluster": cluster_name, "user": user, "namespace": namespace },
        }],
        "current-context": user,
    });
    let io_error = |source| Error::Io {
        path: target.to_owned(),
        source,
    };
    if let Some(dir) = target.parent() {
        std::fs::create_dir_all(dir).map_err(io_error)?;
    }
    // JSON is YAML; kubectl and kube both read it.
    let text =
        serde_json::to_string_pretty(&kubeconfig).map_err(|error| invalid(error.to_string()))?;
    std::fs::write(target, text).map_err(io_error)
}

fn find_named<'a>(list: &'a Value, name: &str) -> Option<&'a Value> {
    list.as_array()?.iter().find(|entry| entry["name"] == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bindings_are_pointed_at_the_test_namespace() {
        let mut binding = json!({
            "kind": "ClusterRoleBinding",
            "subjects": [
                { "kind": "ServiceAccount", "name": "op", "namespace": "slipway-system" },
                { "kind": "User", "name": "someone" },
            ],
        });
        retarget_subjects(&mut binding, "e2e-x");
        assert_eq!(binding["subjects"][0]["namespace"], "e2e-x");
        assert!(binding["subjects"][1].get("namespace").is_none());
    }

    #[test]
    fn the_checked_in_rbac_has_one_service_account() {
        let dir = manifests::rbac_dir();
        let documents = manifests::load_dir(&dir).expect("manifests/rbac is readable YAML");
        assert_eq!(
            single_service_account(&dir, &documents).expect("one ServiceAccount"),
            "slipway-operator"
        );
    }
}
