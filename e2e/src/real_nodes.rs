//! The real nodes of the e2e cluster (`e2e/cluster/real-nodes`): a kubelet and a
//! containerd each, in a network namespace of their own, beside the KWOK nodes.
//!
//! They carry the taint [`TAINT_KEY`] and the label [`KIND_LABEL`]`=`[`KIND_REAL`],
//! so only pods that ask for them land there ([`placement`]); every KWOK test keeps
//! running on KWOK nodes. Pod IPs are routed from the host into each node's
//! namespace, so a test reaches a pod at its IP directly (there is no kube-proxy:
//! Service ClusterIPs route nowhere, EndpointSlices say where to go).
//!
//! The model reaches pods as a user's would: [`ModelClaim`] creates a
//! PersistentVolume (hostPath of the model cache) bound to a claim in the test's
//! namespace, which the operator mounts for `pvc://<claim>/<file>`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, PersistentVolumeClaim};
use kube::api::{ListParams, Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use serde_json::{Value, json};

use crate::cluster::{Cluster, KUBECTL_TIMEOUT, run_bounded};
use crate::error::{Error, Result};
use crate::manifests::repo_root;
use crate::rbac::FIELD_MANAGER;
use crate::wait;

/// Taint every real node registers with (`NoSchedule`).
pub const TAINT_KEY: &str = "slipway.dev/real-node";
/// Label telling real nodes from KWOK ones.
pub const KIND_LABEL: &str = "slipway.dev/node-kind";
/// [`KIND_LABEL`]'s value on real nodes.
pub const KIND_REAL: &str = "real";
/// The claim [`ModelClaim`] creates in a namespace.
pub const MODEL_CLAIM: &str = "models";

/// `nodeSelector` and `tolerations` that put a pod on real nodes only: merge it into
/// a Pod's spec or an InferenceService's `spec.podTemplate`.
pub fn placement() -> Value {
    json!({
        "nodeSelector": { KIND_LABEL: KIND_REAL },
        "tolerations": [{ "key": TAINT_KEY, "operator": "Exists", "effect": "NoSchedule" }],
    })
}

/// One real node: its name and zone as the API shows them, and where its state is.
#[derive(Debug, Clone)]
pub struct RealNode {
    name: String,
    zone: String,
    dir: PathBuf,
    bin_dir: PathBuf,
}

impl Cluster {
    /// The real nodes registered in the cluster, by name.
    ///
    /// # Errors
    /// When the nodes cannot be listed, or there are fewer than two (`up` starts
    /// two, in two zones: a cluster without them cannot prove anything about pods).
    pub async fn real_nodes(&self, client: &Client) -> Result<Vec<RealNode>> {
        let selector = format!("{KIND_LABEL}={KIND_REAL}");
        let nodes = Api::<Node>::all(client.clone())
            .list(&ListParams::default().labels(&selector))
            .await?;
        let mut real: Vec<RealNode> = nodes
            .items
            .iter()
            .map(|node| RealNode {
                name: node.name_any(),
                zone: node
                    .labels()
                    .get("topology.kubernetes.io/zone")
                    .cloned()
                    .unwrap_or_default(),
                dir: self.workdir().join("nodes").join(node.name_any()),
                bin_dir: self.bin_dir().to_owned(),
            })
            .collect();
        real.sort_by(|a, b| a.name.cmp(&b.name));
        if real.len() < 2 {
            return Err(Error::Setup {
                what: "finding the real nodes".to_owned(),
                reason: format!(
                    "{} node(s) labelled {selector}; e2e/cluster/up starts two (see {})",
                    real.len(),
                    self.workdir().join("nodes").display()
                ),
            });
        }
        Ok(real)
    }
}

impl RealNode {
    /// The Node's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its `topology.kubernetes.io/zone`.
    pub fn zone(&self) -> &str {
        &self.zone
    }

    /// The kubelet's log file.
    pub fn kubelet_log(&self) -> PathBuf {
        self.dir.join("logs").join("kubelet.log")
    }

    /// The containerd's log file.
    pub fn containerd_log(&self) -> PathBuf {
        self.dir.join("logs").join("containerd.log")
    }

    /// Where the kubelet writes container logs (`podLogsDir`).
    pub fn pod_logs_dir(&self) -> PathBuf {
        self.dir.join("pod-logs")
    }

    /// Every process this node runs, as `(name, pid)` from its pid files
    /// (`<pid> <exe>`), keeping only those still running the recorded executable.
    ///
    /// # Errors
    /// When the pid directory cannot be read.
    pub fn processes(&self) -> Result<Vec<(String, u32)>> {
        let dir = self.dir.join("pids");
        let entries = std::fs::read_dir(&dir).map_err(|source| Error::Io {
            path: dir.clone(),
            source,
        })?;
        let mut out = Vec::new();
        for entry in entries.flatten() {
            let path = entry.path();
            let Some(name) = path.file_stem().and_then(|s| s.to_str()) else {
                continue;
            };
            let Ok(text) = std::fs::read_to_string(&path) else {
                continue;
            };
            let mut fields = text.split_whitespace();
            let (Some(pid), Some(exe)) = (fields.next(), fields.next()) else {
                continue;
            };
            let Ok(pid) = pid.parse::<u32>() else {
                continue;
            };
            let running =
                std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|e| e == Path::new(exe));
            if running {
                out.push((name.to_owned(), pid));
            }
        }
        out.sort();
        Ok(out)
    }

    /// Run `ctr` against this node's containerd in the CRI's namespace (`k8s.io`).
    ///
    /// # Errors
    /// When ctr cannot start, fails, or runs past `timeout`.
    pub fn ctr(&self, args: &[&str], timeout: Duration) -> Result<String> {
        let mut command = std::process::Command::new(self.bin_dir.join("ctr"));
        command
            .arg("--address")
            .arg(self.dir.join("containerd.sock"))
            .args(["-n", "k8s.io"])
            .args(args);
        run_bounded(command, timeout)
    }

    /// Send `signal` (e.g. `SIGKILL`) to a container's main process through the
    /// node's runtime. `container_id` is a pod status's `containerID`
    /// (`containerd://<id>`) or the bare id.
    ///
    /// # Errors
    /// As [`RealNode::ctr`].
    pub fn signal_container(&self, container_id: &str, signal: &str) -> Result<()> {
        let id = container_id
            .strip_prefix("containerd://")
            .unwrap_or(container_id);
        self.ctr(&["tasks", "kill", "--signal", signal, id], KUBECTL_TIMEOUT)
            .map(drop)
    }

    /// Stop this node's kubelet (by its PID; containers keep running, as when a
    /// machine's kubelet dies). The node goes NotReady once its lease expires.
    ///
    /// # Errors
    /// When `e2e/cluster/real-nodes stop-kubelet` fails.
    pub fn stop_kubelet(&self) -> Result<()> {
        real_nodes_script(&["stop-kubelet", &self.name])
    }

    /// Start this node's kubelet again with its old state.
    ///
    /// # Errors
    /// When `e2e/cluster/real-nodes start-kubelet` fails.
    pub fn start_kubelet(&self) -> Result<()> {
        real_nodes_script(&["start-kubelet", &self.name])
    }

    /// The config (JSON) of `image` as this node's containerd stores it, and the
    /// manifest digest it was imported under.
    ///
    /// # Errors
    /// When the image is not in the node's runtime, or its blobs are not JSON.
    pub fn image_config(&self, image: &str) -> Result<(String, Value)> {
        let filter = format!("name=={image}");
        let listing = self.ctr(&["images", "list", &filter], KUBECTL_TIMEOUT)?;
        // REF  TYPE  DIGEST  SIZE  PLATFORMS  LABELS
        let digest = listing
            .lines()
            .skip(1)
            .find_map(|line| {
                let mut fields = line.split_whitespace();
                (fields.next() == Some(image))
                    .then(|| fields.nth(1))
                    .flatten()
                    .map(str::to_owned)
            })
            .ok_or_else(|| Error::Setup {
                what: format!("finding {image} in {}'s containerd", self.name),
                reason: format!("`ctr images list` shows:\n{listing}"),
            })?;
        let manifest = self.content_json(&digest)?;
        let config_digest = manifest["config"]["digest"]
            .as_str()
            .ok_or_else(|| Error::Setup {
                what: format!("reading the manifest of {image}"),
                reason: format!("no config digest in {manifest}"),
            })?
            .to_owned();
        Ok((digest, self.content_json(&config_digest)?))
    }

    fn content_json(&self, digest: &str) -> Result<Value> {
        let text = self.ctr(&["content", "get", digest], KUBECTL_TIMEOUT)?;
        serde_json::from_str(&text).map_err(|error| Error::Setup {
            what: format!("reading blob {digest} from {}'s containerd", self.name),
            reason: error.to_string(),
        })
    }
}

fn real_nodes_script(args: &[&str]) -> Result<()> {
    let mut command =
        std::process::Command::new(repo_root().join("e2e").join("cluster").join("real-nodes"));
    command.args(args);
    run_bounded(command, Duration::from_secs(120)).map(drop)
}

/// `$SLIPWAY_CACHE`, else `~/.cache/slipway` (as the Makefile and the scripts).
pub fn slipway_cache() -> PathBuf {
    std::env::var_os("SLIPWAY_CACHE").map_or_else(
        || {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache")
                .join("slipway")
        },
        PathBuf::from,
    )
}

/// Where `e2e/cluster/build-images` writes the OCI tarballs it imports.
pub fn images_dir() -> PathBuf {
    slipway_cache().join("images")
}

/// The directory the model cache is in: `$SLIPWAY_MODEL`'s directory when set,
/// else `$SLIPWAY_CACHE/models` (where `make model` puts SmolLM2).
pub fn model_dir() -> PathBuf {
    if let Some(model) = std::env::var_os("SLIPWAY_MODEL") {
        let model = PathBuf::from(model);
        if let Some(dir) = model.parent() {
            return dir.to_owned();
        }
    }
    slipway_cache().join("models")
}

/// A read-only claim named [`MODEL_CLAIM`] on the model cache ([`model_dir`]),
/// through a hostPath PersistentVolume bound to it alone. The PV is cluster-scoped,
/// so it is deleted when this is dropped (the namespace takes the claim with it).
#[derive(Debug)]
pub struct ModelClaim {
    cluster: Cluster,
    volume: String,
}

impl ModelClaim {
    /// Create the volume and the claim in `namespace` and wait until they are bound.
    ///
    /// # Errors
    /// When `file` is not in [`model_dir`] (run `make model`), the API refuses an
    /// object, or the claim does not bind in time.
    pub async fn create(
        cluster: &Cluster,
        client: &Client,
        namespace: &str,
        file: &str,
    ) -> Result<Self> {
        let dir = model_dir();
        let path = dir.join(file);
        if !path.is_file() {
            return Err(Error::Setup {
                what: "finding the model for the real nodes".to_owned(),
                reason: format!("{} is not a file: run `make model`", path.display()),
            });
        }
        let volume = format!("slipway-models-{namespace}");
        let claim = ModelClaim {
            cluster: cluster.clone(),
            volume: volume.clone(),
        };
        let pv = json!({
            "apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": { "name": volume, "labels": { "slipway.dev/e2e-model": "true" } },
            "spec": {
                "capacity": { "storage": "1Gi" },
                "accessModes": ["ReadOnlyMany"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "hostPath": { "path": dir_str(&dir)?, "type": "Directory" },
                "claimRef": { "namespace": namespace, "name": MODEL_CLAIM },
            },
        });
        let pvc = json!({
            "apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": { "name": MODEL_CLAIM, "namespace": namespace },
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "volumeName": volume,
                "resources": { "requests": { "storage": "1Gi" } },
            },
        });
        let params = PatchParams::apply(FIELD_MANAGER).force();
        Api::<k8s_openapi::api::core::v1::PersistentVolume>::all(client.clone())
            .patch(&volume, &params, &Patch::Apply(&pv))
            .await?;
        let claims = Api::<PersistentVolumeClaim>::namespaced(client.clone(), namespace);
        claims
            .patch(MODEL_CLAIM, &params, &Patch::Apply(&pvc))
            .await?;
        wait::for_object(
            &claims,
            MODEL_CLAIM,
            "the model claim to be Bound",
            Duration::from_secs(60),
            |claim: Option<&PersistentVolumeClaim>| {
                claim
                    .and_then(|c| c.status.as_ref())
                    .and_then(|s| s.phase.as_deref())
                    == Some("Bound")
            },
        )
        .await?;
        Ok(claim)
    }
}

impl Drop for ModelClaim {
    fn drop(&mut self) {
        let deleted = self.cluster.kubectl(
            &[
                "delete",
                "persistentvolume",
                &self.volume,
                "--wait=false",
                "--ignore-not-found",
            ],
            KUBECTL_TIMEOUT,
        );
        if let Err(error) = deleted {
            tracing::warn!(%error, volume = %self.volume, "could not delete the model volume");
        }
    }
}

fn dir_str(dir: &Path) -> Result<&str> {
    dir.to_str().ok_or_else(|| Error::Setup {
        what: "naming the model directory".to_owned(),
        reason: format!("{} is not UTF-8", dir.display()),
    })
}
