//! Bringing the control plane up and down, and talking to it.
//!
//! `e2e/cluster/up` does the work (build, `kwokctl create cluster`, fake nodes)
//! and reports what it did as `key=value` lines on stdout; this module parses
//! them into a [`Cluster`] and ties the cluster's lifetime to a
//! [`ClusterGuard`]. Only a guard that actually started the cluster stops it,
//! so a cluster brought up by hand (`e2e/cluster/up`) survives test runs.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kube::config::{KubeConfigOptions, Kubeconfig};

use crate::error::{Error, Result};
use crate::manifests::repo_root;

/// How long a single kubectl invocation may run before it is killed; waits that
/// need longer pass their own `--timeout` and get this much on top.
pub(crate) const KUBECTL_TIMEOUT: Duration = Duration::from_secs(60);

/// A running control plane: where its kubeconfig, binaries and state live.
#[derive(Debug, Clone)]
pub struct Cluster {
    kubeconfig: PathBuf,
    bin_dir: PathBuf,
    workdir: PathBuf,
}

impl Cluster {
    /// The admin kubeconfig (client certificate of `system:masters`).
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// Directory holding the binaries built from source, kubectl included.
    pub fn bin_dir(&self) -> &Path {
        &self.bin_dir
    }

    /// kwokctl's state directory of this cluster (logs/, pids/, pki/, etcd data).
    pub fn workdir(&self) -> &Path {
        &self.workdir
    }

    /// The API server's audit log (JSON lines, one event per request).
    pub fn audit_log(&self) -> PathBuf {
        self.workdir.join("logs").join("audit.log")
    }

    /// The log file of one component, e.g. `kube-apiserver` or `kwok-controller`.
    pub fn component_log(&self, component: &str) -> PathBuf {
        self.workdir.join("logs").join(format!("{component}.log"))
    }

    /// Component name and PID of every process kwokctl started for this
    /// cluster, from the PID files `e2e/cluster/down` also stops them by.
    ///
    /// # Errors
    /// When the PID directory cannot be read or holds something that is not a PID.
    pub fn component_pids(&self) -> Result<Vec<(String, u32)>> {
        let dir = self.workdir.join("pids");
        let io_error = |path: &Path| {
            let path = path.to_owned();
            move |source| Error::Io { path, source }
        };
        let mut pids = Vec::new();
        for entry in std::fs::read_dir(&dir).map_err(io_error(&dir))? {
            let path = entry.map_err(io_error(&dir))?.path();
            let Some(component) = path.file_stem().and_then(|s| s.to_str()) else {
                continue;
            };
            let text = std::fs::read_to_string(&path).map_err(io_error(&path))?;
            let pid = text.trim().parse().map_err(|_| Error::Manifest {
                path: path.clone(),
                reason: format!("{text:?} is not a PID"),
            })?;
            pids.push((component.to_owned(), pid));
        }
        pids.sort();
        Ok(pids)
    }

    /// A client with the admin identity.
    ///
    /// # Errors
    /// When the kubeconfig cannot be read or does not describe a usable client.
    pub async fn client(&self) -> Result<kube::Client> {
        client_from_kubeconfig(&self.kubeconfig).await
    }

    /// Run the cluster's own kubectl as admin and return its stdout.
    ///
    /// # Errors
    /// When kubectl cannot be started, exits non-zero, or runs past `timeout`.
    pub fn kubectl(&self, args: &[&str], timeout: Duration) -> Result<String> {
        self.kubectl_with(&self.kubeconfig, args, timeout)
    }

    /// Waits until the CRDs `target` names (`["crd/NAME"]` or `["-f", PATH]`) are
    /// Established.
    ///
    /// Right after a CRD is created it has no `.status.conditions` at all, and
    /// `kubectl wait --for=condition=...` then fails at once ("accessor error: <nil>")
    /// instead of waiting, so that answer is retried until `timeout`.
    ///
    /// # Errors
    /// As [`Cluster::kubectl`]; [`Error::Timeout`] when still not Established.
    pub fn wait_established(&self, target: &[&str], timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let wait_for = format!("--timeout={}s", timeout.as_secs().max(1));
        let mut args = vec!["wait", "--for=condition=Established", wait_for.as_str()];
        args.extend_from_slice(target);
        loop {
            match self.kubectl(&args, timeout + KUBECTL_TIMEOUT) {
                Ok(_) => return Ok(()),
                Err(Error::CommandFailed { stderr, .. })
                    if stderr.contains(".status.conditions accessor error")
                        && Instant::now() < deadline =>
                {
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(Error::CommandFailed { stderr, .. })
                    if stderr.contains(".status.conditions accessor error") =>
                {
                    return Err(Error::Timeout {
                        what: format!("{} to be Established", target.join(" ")),
                        timeout,
                        last_seen: stderr.trim().to_owned(),
                    });
                }
                Err(other) => return Err(other),
            }
        }
    }

    /// Run kubectl with another identity's kubeconfig and return its stdout.
    ///
    /// # Errors
    /// As [`Cluster::kubectl`].
    pub fn kubectl_with(
        &self,
        kubeconfig: &Path,
        args: &[&str],
        timeout: Duration,
    ) -> Result<String> {
        let mut command = Command::new(self.bin_dir.join("kubectl"));
        command.arg("--kubeconfig").arg(kubeconfig).args(args);
        run_bounded(command, timeout)
    }
}

/// Build a client from a kubeconfig file, honouring its current context.
pub(crate) async fn client_from_kubeconfig(path: &Path) -> Result<kube::Client> {
    let kubeconfig = Kubeconfig::read_from(path).map_err(|source| Error::Kubeconfig {
        path: path.to_owned(),
        source,
    })?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(|source| Error::Kubeconfig {
            path: path.to_owned(),
            source,
        })?;
    Ok(kube::Client::try_from(config)?)
}

/// Owns the cluster for one test run.
///
/// Dropping the guard runs `e2e/cluster/down`, which stops each process by the
/// PID kwokctl recorded and removes the state — unless the cluster was already
/// running before (then it belongs to whoever started it) or
/// `SLIPWAY_E2E_KEEP_CLUSTER=1` asks to keep it for debugging.
#[derive(Debug)]
pub struct ClusterGuard {
    cluster: Cluster,
    started_here: bool,
}

impl ClusterGuard {
    /// Build the control plane if the cache is cold, bring it up (or reuse a
    /// running one) and wait until it and its fake nodes are ready.
    ///
    /// The build and `up` write their progress to this process's stderr.
    ///
    /// # Errors
    /// When the build fails, a binary is missing, or a component does not
    /// become ready in time; the error carries the script's explanation.
    pub fn up() -> Result<Self> {
        let script = cluster_script("up");
        let command_line = script.display().to_string();
        tracing::info!(script = %command_line, "bringing the e2e cluster up");
        // `up` builds the images' binaries with cargo.
        let output = crate::build::without_package_env(&mut Command::new(&script))
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .output()
            .map_err(|source| Error::Spawn {
                command: command_line.clone(),
                source,
            })?;
        if !output.status.success() {
            return Err(Error::CommandFailed {
                command: command_line,
                status: output.status,
                stderr: "(printed above)".to_owned(),
            });
        }
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        let field = |key: &'static str| {
            stdout
                .lines()
                .find_map(|line| line.strip_prefix(key)?.strip_prefix('='))
                .map(str::to_owned)
                .ok_or_else(|| Error::MissingOutput {
                    command: command_line.clone(),
                    key,
                    stdout: stdout.clone(),
                })
        };
        let cluster = Cluster {
            kubeconfig: field("kubeconfig")?.into(),
            bin_dir: field("bin")?.into(),
            workdir: field("workdir")?.into(),
        };
        let started_here = field("started")? == "true";
        tracing::info!(kubeconfig = %cluster.kubeconfig.display(), started_here, "e2e cluster is up");
        Ok(Self {
            cluster,
            started_here,
        })
    }

    /// The cluster this guard keeps alive.
    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }
}

impl Drop for ClusterGuard {
    fn drop(&mut self) {
        if !self.started_here {
            tracing::info!("leaving the reused e2e cluster running");
            return;
        }
        if std::env::var_os("SLIPWAY_E2E_KEEP_CLUSTER").is_some_and(|v| v == "1") {
            eprintln!(
                "SLIPWAY_E2E_KEEP_CLUSTER=1: cluster left running; KUBECONFIG={}; stop it with e2e/cluster/down",
                self.cluster.kubeconfig.display()
            );
            return;
        }
        let down = Command::new(cluster_script("down"));
        // `down` bounds its own waits (SIGTERM, then SIGKILL after a grace period).
        match run_bounded(down, Duration::from_secs(120)) {
            Ok(_) => tracing::info!("e2e cluster stopped"),
            // Drop cannot return an error; say it loudly so CI logs show leaked processes.
            Err(error) => eprintln!("error: stopping the e2e cluster failed: {error}"),
        }
    }
}

fn cluster_script(name: &str) -> PathBuf {
    repo_root().join("e2e").join("cluster").join(name)
}

/// Run a command to completion, capturing stdout and stderr, killing it (by its
/// own PID, through `Child::kill`) if it outlives `timeout`.
pub(crate) fn run_bounded(mut command: Command, timeout: Duration) -> Result<String> {
    let command_line = describe(&command);
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| Error::Spawn {
            command: command_line.clone(),
            source,
        })?;
    // Drain both pipes on threads so a chatty child never blocks on a full pipe
    // while we wait for it to exit.
    let stdout = child.stdout.take().map(drain);
    let stderr = child.stderr.take().map(drain);
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) => {
                // Best effort: the child may exit between try_wait and kill.
                let _ = child.kill();
                let _ = child.wait();
                return Err(Error::Timeout {
                    what: format!("`{command_line}` to finish"),
                    timeout,
                    last_seen: "still running; killed".to_owned(),
                });
            }
            Err(source) => {
                return Err(Error::Spawn {
                    command: command_line,
                    source,
                });
            }
        }
    };
    let stdout = stdout.map(join_drain).unwrap_or_default();
    let stderr = stderr.map(join_drain).unwrap_or_default();
    if status.success() {
        Ok(stdout)
    } else {
        Err(Error::CommandFailed {
            command: command_line,
            status,
            stderr,
        })
    }
}

fn drain(mut pipe: impl Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        // A read error only truncates diagnostics; the exit status still decides.
        let _ = pipe.read_to_end(&mut bytes);
        String::from_utf8_lossy(&bytes).into_owned()
    })
}

fn join_drain(handle: std::thread::JoinHandle<String>) -> String {
    handle
        .join()
        .unwrap_or_else(|_| "(output reader panicked)".to_owned())
}

fn describe(command: &Command) -> String {
    std::iter::once(command.get_program())
        .chain(command.get_args())
        .map(|part| part.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ")
}
