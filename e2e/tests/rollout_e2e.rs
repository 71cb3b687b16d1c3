//! Canary rollouts on the real control plane, with real engines and real load.
//!
//! KWOK pods run no processes, so the releases' engines run here instead: real
//! `slipway-engine serve` processes on 127.0.0.1 (CPU, the SmolLM2 model), each started
//! with `--release` = the bundle hash the operator reports (stable:
//! `status.stableRelease`; canary: `status.canaryRelease.hash`, started once the
//! operator names it). A real Prometheus (the Debian package) scrapes them every
//! second, the InferenceService's analysis reads it through the `Prometheus` metrics
//! source, and `slipway-bench` drives open-loop load at each engine. The pod lifecycle
//! stays Kubernetes' (KWOK); the metrics the operator judges are real.
//!
//! One test runs the scenarios in sequence on one InferenceService (the cluster, the
//! operator and Prometheus are shared, which keeps the run to a few minutes):
//! 1. a bad bundle (canary engine with `--inject-delay-ms`, breaking the TPOT target) is
//!    rolled back within two analysis intervals after its windows fill, with the burn
//!    rates in `status.lastRollback`, `RolledBack=True`, and a `RolledBack` event;
//! 2. re-applying the failed spec, or editing it outside its bundle, does not restart
//!    the rollout (checked once `status.observedGeneration` shows the edit);
//! 3. a healthy bundle (a changed bundle, so a new rollout) passes every step (0, 1, 2
//!    seen in status; two step advances in the events) and is promoted to stable;
//! 4. a canary with too little traffic (two requests, `minRequests` 8) is held as
//!    inconclusive at step 0 under `Hold`, and rolled back once `RollbackAfter`'s
//!    timeout has passed; it is never promoted.
//!
//! Prometheus also scrapes the operator and loads the generated SLO rules
//! (`manifests/monitoring/slo-rules.yaml`). Once the healthy bundle is promoted, with
//! load still running, every query of every panel of the generated dashboard
//! (`manifests/monitoring/dashboard.json`) must return series; the count of each is
//! written to [`PANELS_REPORT`].
//!
//! The operator's event recorder folds exact repeats of an event into one event's
//! series (count), so events are counted by summing counts.
//!
//! Needs: the control plane (`make e2e-build`), Prometheus (`scripts/ensure-debian-packages
//! prometheus=prometheus`, or `SLIPWAY_PROMETHEUS`), the model (`make model`, or
//! `SLIPWAY_MODEL`). A missing one fails the run with instructions; nothing skips.

use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use k8s_openapi::api::core::v1::Event;
use kube::api::{DynamicObject, ListParams, Patch, PatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::{Api, Client};
use libtest_mimic::{Arguments, Failed, Trial};
use serde_json::{Value, json};
use slipway_api::testing::condition;
use slipway_contract::metrics::{OUTCOME_LABEL, Outcome, RELEASE_LABEL, REQUESTS, counter_total};
use slipway_contract::{FaultArgs, OperatorArgs, ServeArgs};
use slipway_e2e::build::{cargo_build, cargo_build_features};
use slipway_e2e::rbac::OperatorIdentity;
use slipway_e2e::{Cluster, ClusterGuard, TestNamespace, crd, manifests};
use slipway_engine::testing::{
    ChildGuard, EngineProcess, MODEL_FILE, Supervised, serve_args_with_model,
};

const MODEL_NAME: &str = "smol";
const ISVC: &str = "smollm2";
/// Analysis interval (seconds) and windows: short so a run takes minutes.
const INTERVAL_S: u64 = 2;
const SHORT_WINDOW: &str = "8s";
const LONG_WINDOW: &str = "16s";
const MIN_REQUESTS: f64 = 8.0;
/// The engines' SLO targets (`--slo-tpot-ms`); the bad canary adds this much per
/// decode step, so every one of its multi-token requests misses TPOT.
const SLO_TPOT_MS: u64 = 250;
const BAD_DELAY_MS: u64 = 600;
/// Open-loop arrival rate at each engine, requests/s.
const RATE: f64 = 3.0;
/// Where the rolled-back status and the event list are written for the report.
const REPORT: &str = "/tmp/rollout-e2e-rolledback.txt";
/// Where each dashboard query and the series it returned are written.
const PANELS_REPORT: &str = "/tmp/rollout-e2e-dashboard-panels.txt";

fn main() -> ExitCode {
    let _logs = slipway_e2e::test_logs();
    let arguments = Arguments::from_args();
    const NAME: &str = "rollout::bad_bundle_rolls_back_reapply_holds_healthy_bundle_promotes";
    let selected = !arguments.is_filtered_out(&Trial::test(NAME, || Ok(())));
    if arguments.list || !selected {
        return libtest_mimic::run(&arguments, vec![Trial::test(NAME, || Ok(()))]).exit_code();
    }
    let tools = match Tools::find() {
        Ok(tools) => tools,
        Err(error) => {
            eprintln!("error: the rollout e2e test cannot run: {error:#}");
            return ExitCode::FAILURE;
        }
    };
    let guard = match ClusterGuard::up() {
        Ok(guard) => guard,
        Err(error) => {
            eprintln!("error: the e2e control plane is not available: {error}");
            return ExitCode::FAILURE;
        }
    };
    let cluster = Arc::new(guard.cluster().clone());
    if let Err(error) = crd::ensure_installed(&cluster) {
        eprintln!("error: could not install the CRD: {error}");
        return ExitCode::FAILURE;
    }
    let trial = Trial::test(NAME, move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|error| Failed::from(format!("tokio runtime: {error}")))?;
        runtime
            .block_on(rollout_scenarios(&cluster, &tools))
            .map_err(|error| Failed::from(format!("{error:#}")))
    });
    let conclusion = libtest_mimic::run(&arguments, vec![trial]);
    drop(guard);
    conclusion.exit_code()
}

/// Binaries and files the test needs, all checked before the cluster comes up.
struct Tools {
    operator: PathBuf,
    engine: PathBuf,
    bench: PathBuf,
    prometheus: PathBuf,
    model: PathBuf,
}

impl Tools {
    fn find() -> anyhow::Result<Self> {
        let prometheus = std::env::var_os("SLIPWAY_PROMETHEUS")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/usr/bin/prometheus"));
        ensure!(
            prometheus.is_file(),
            "Prometheus not found at {}: run `scripts/ensure-debian-packages prometheus=prometheus` (or set SLIPWAY_PROMETHEUS)",
            prometheus.display()
        );
        let model = match std::env::var_os("SLIPWAY_MODEL") {
            Some(p) => PathBuf::from(p),
            None => std::env::var_os("SLIPWAY_CACHE")
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/slipway")))
                .context("neither SLIPWAY_CACHE nor HOME is set")?
                .join("models")
                .join(MODEL_FILE),
        };
        ensure!(
            model.is_file(),
            "test model not found at {}: run `make model` (or set SLIPWAY_MODEL)",
            model.display()
        );
        Ok(Self {
            operator: cargo_build("slipway-operator", "slipway-operator")?,
            // A test build: the bad bundle's engines run with `--inject-delay-ms`.
            engine: cargo_build_features("slipway-engine", "slipway-engine", &["fault-injection"])?,
            bench: cargo_build("slipway-bench", "slipway-bench")?,
            prometheus,
            model,
        })
    }
}

/// Spawns `command` with its stdout and stderr in `log`; killed and reaped on drop.
fn spawn_logged(name: &str, command: &mut Command, log: &Path) -> anyhow::Result<ChildGuard> {
    let file = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    Ok(ChildGuard::spawn(
        name,
        command.stdout(file.try_clone()?).stderr(file),
    )?)
}

/// A free TCP port on 127.0.0.1 (bound, then released for the process to take).
fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Starts `slipway-engine serve` for `release` on `port`; returns once it listens.
fn start_engine(
    tools: &Tools,
    logs: &Path,
    release: &str,
    port: u16,
    inject_delay_ms: u64,
) -> anyhow::Result<ChildGuard> {
    let args = ServeArgs {
        port,
        threads: Some(1),
        kv_blocks: Some(256),
        max_model_len: Some(512),
        release: release.to_owned(),
        slo_ttft: Duration::from_millis(3000),
        slo_tpot: Duration::from_millis(SLO_TPOT_MS),
        faults: FaultArgs {
            inject_delay: Duration::from_millis(inject_delay_ms),
            ..FaultArgs::default()
        },
        ..serve_args_with_model(&tools.model, MODEL_NAME)
    };
    let mut command = EngineProcess::command_with_binary(&tools.engine, &args);
    command.stderr(std::fs::File::create(
        logs.join(format!("engine-{release}.log")),
    )?);
    Ok(EngineProcess::start(format!("engine {release}"), command)?.into_process())
}

/// Open-loop load at one engine until dropped: short prompts, 4 output tokens.
fn start_load(tools: &Tools, logs: &Path, name: &str, port: u16) -> anyhow::Result<ChildGuard> {
    let workload = logs.join("workload.yaml");
    std::fs::write(
        &workload,
        "promptTokens: {kind: uniform, min: 16, max: 48}\noutputTokens: {kind: uniform, min: 4, max: 4}\napi: completions\n",
    )?;
    spawn_logged(
        &format!("slipway-bench at {name}"),
        Command::new(&tools.bench)
            .args(["run", "--url", &format!("http://127.0.0.1:{port}")])
            .args(["--model", MODEL_NAME, "--workload"])
            .arg(&workload)
            .args(["--rate", &RATE.to_string(), "--arrival", "poisson"])
            .args([
                "--duration",
                "900",
                "--drain",
                "1",
                "--warmup",
                "0",
                "--quiet",
            ])
            .args(["--seed", &port.to_string(), "--out"])
            .arg(logs.join(format!("bench-{name}"))),
        &logs.join(format!("bench-{name}.log")),
    )
}

/// The generated monitoring manifests (SLO rules, dashboard).
fn monitoring_dir() -> PathBuf {
    manifests::repo_root().join("manifests").join("monitoring")
}

/// Prometheus on 127.0.0.1:`port`, scraping the engine ports and the operator's
/// metrics port every second and evaluating the generated SLO rules.
fn start_prometheus(
    tools: &Tools,
    logs: &Path,
    port: u16,
    targets: &[u16],
    operator_port: u16,
) -> anyhow::Result<ChildGuard> {
    let dir = logs.join("prometheus");
    std::fs::create_dir_all(&dir)?;
    let targets: Vec<String> = targets.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let rules = monitoring_dir().join("slo-rules.yaml");
    ensure!(
        rules.is_file(),
        "{} is missing: run `make generate`",
        rules.display()
    );
    let config = json!({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [rules],
        "scrape_configs": [{
            "job_name": "slipway-engine",
            "scrape_interval": "1s",
            "scrape_timeout": "900ms",
            "static_configs": [{"targets": targets}],
        }, {
            "job_name": "slipway-operator",
            "scrape_interval": "1s",
            "scrape_timeout": "900ms",
            // The operator's per-service series carry `namespace`: keep it.
            "honor_labels": true,
            "static_configs": [{"targets": [format!("127.0.0.1:{operator_port}")]}],
        }],
    });
    let config_path = dir.join("prometheus.yml");
    std::fs::write(&config_path, serde_yaml::to_string(&config)?)?;
    spawn_logged(
        "prometheus",
        Command::new(&tools.prometheus)
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}")),
        &dir.join("prometheus.log"),
    )
}

/// The scalar of an instant PromQL query (sum of the samples; none → 0).
async fn promql(http: &reqwest::Client, url: &str, query: &str) -> anyhow::Result<f64> {
    let body: Value = http
        .get(format!("{url}/api/v1/query"))
        .query(&[("query", query)])
        .send()
        .await?
        .json()
        .await?;
    ensure!(body["status"] == "success", "query {query} failed: {body}");
    Ok(body["data"]["result"]
        .as_array()
        .map(|r| {
            r.iter()
                .filter_map(|s| s["value"][1].as_str()?.parse::<f64>().ok())
                .sum()
        })
        .unwrap_or(0.0))
}

/// The instant vector of `query`: how many series it returned and how many of them
/// hold a number (a ratio of zero rates is NaN, still a series).
async fn promql_series(
    http: &reqwest::Client,
    url: &str,
    query: &str,
) -> anyhow::Result<(usize, usize)> {
    let body: Value = http
        .get(format!("{url}/api/v1/query"))
        .query(&[("query", query)])
        .send()
        .await?
        .json()
        .await?;
    ensure!(body["status"] == "success", "query {query} failed: {body}");
    let result = body["data"]["result"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let numbers = result
        .iter()
        .filter(|s| {
            s["value"][1]
                .as_str()
                .and_then(|v| v.parse::<f64>().ok())
                .is_some_and(f64::is_finite)
        })
        .count();
    Ok((result.len(), numbers))
}

/// Every query of every panel of the generated dashboard, with its template
/// variables as the dashboard's "All" (`.*`) and its intervals as fixed windows, runs
/// against Prometheus until it returns series (at most 60 s for all of them: the rules'
/// windows and the scrapes fill within seconds once load runs). Writes
/// [`PANELS_REPORT`] and fails naming every query that returned nothing.
async fn dashboard_panels_return_series(http: &reqwest::Client, url: &str) -> anyhow::Result<()> {
    let path = monitoring_dir().join("dashboard.json");
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?,
    )
    .with_context(|| format!("parsing {}", path.display()))?;
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().context("dashboard panels")? {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().context("a target without expr")?;
            let title = panel["title"].as_str().unwrap_or_default();
            let legend = target["legendFormat"].as_str().unwrap_or_default();
            let query = expr
                .replace("$__rate_interval", "30s")
                .replace("$__range", "1h")
                .replace("$release", ".*")
                .replace("$namespace", ".*")
                .replace("$inferenceservice", ".*");
            queries.push((format!("{title} [{legend}]"), query));
        }
    }
    ensure!(!queries.is_empty(), "{} has no queries", path.display());
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut results = vec![(0, 0); queries.len()];
    loop {
        for ((_, query), result) in queries.iter().zip(results.iter_mut()) {
            if result.0 == 0 {
                *result = promql_series(http, url, query).await?;
            }
        }
        if results.iter().all(|r| r.0 > 0) || Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let mut text = format!(
        "# dashboard panel queries against the e2e Prometheus ({url}): series returned (with a number), panel [legend], query\n"
    );
    for ((name, query), (series, numbers)) in queries.iter().zip(&results) {
        text.push_str(&format!("{series}\t({numbers})\t{name}\t{query}\n"));
    }
    std::fs::write(PANELS_REPORT, &text).with_context(|| format!("writing {PANELS_REPORT}"))?;
    eprintln!("{text}");
    let empty: Vec<&str> = queries
        .iter()
        .zip(&results)
        .filter(|(_, r)| r.0 == 0)
        .map(|((name, _), _)| name.as_str())
        .collect();
    ensure!(
        empty.is_empty(),
        "dashboard queries returned no series after 60 s: {empty:?}; see {PANELS_REPORT}"
    );
    Ok(())
}

/// Eligible requests of `release` in the short window, as the operator's query counts them.
fn eligible_query(release: &str) -> String {
    format!(
        "sum(increase({}{{{RELEASE_LABEL}=\"{release}\",{OUTCOME_LABEL}=~\"{}\"}}[{SHORT_WINDOW}]))",
        counter_total(REQUESTS),
        Outcome::regex(Outcome::is_slo_eligible)
    )
}

/// The CPU sample with a rollout analysed through Prometheus at `prometheus_url`, and
/// the bundle made distinct by `kv_namespace`.
fn isvc(namespace: &str, prometheus_url: &str, kv_namespace: &str) -> anyhow::Result<Value> {
    let path = manifests::samples_dir().join("smollm2-cpu.yaml");
    let mut sample = manifests::load_documents(&path)?
        .into_iter()
        .next()
        .context("empty sample")?;
    sample["metadata"]["namespace"] = json!(namespace);
    sample["spec"]["release"]["kvNamespace"] = json!(kv_namespace);
    // Objective 0.9: a canary whose every request misses the SLO burns 10x; the
    // thresholds of 5 abort above 50% bad in both windows.
    sample["spec"]["slo"]["availability"] = json!(0.9);
    sample["spec"]["slo"]["tpot"]["threshold"] = json!(format!("{SLO_TPOT_MS}ms"));
    sample["spec"]["rollout"] = json!({
        "steps": [{"weight": 34}, {"weight": 67}, {"weight": 100}],
        "maxSurge": 1,
        "analysis": {
            "interval": format!("{INTERVAL_S}s"),
            "shortWindow": SHORT_WINDOW,
            "longWindow": LONG_WINDOW,
            "shortBurnRateThreshold": 5,
            "longBurnRateThreshold": 5,
            "minRequests": MIN_REQUESTS as i64,
            "inconclusivePolicy": "Hold",
            "metrics": {"source": "Prometheus", "prometheus": {"url": prometheus_url}},
        },
    });
    Ok(sample)
}

struct Ctx {
    isvcs: Api<DynamicObject>,
    events: Api<Event>,
}

impl Ctx {
    async fn apply(&self, isvc: &Value) -> anyhow::Result<()> {
        self.isvcs
            .patch(
                ISVC,
                &PatchParams::apply("gitops").force(),
                &Patch::Apply(isvc),
            )
            .await
            .context("applying the InferenceService")?;
        Ok(())
    }

    async fn status(&self) -> anyhow::Result<Value> {
        Ok(self.isvcs.get(ISVC).await?.data["status"].clone())
    }

    /// `metadata.generation`: bumped by every change of the spec.
    async fn generation(&self) -> anyhow::Result<i64> {
        self.isvcs
            .get(ISVC)
            .await?
            .metadata
            .generation
            .context("the InferenceService has no metadata.generation")
    }

    /// Polls the status every 250 ms until `found` yields, for at most `timeout`.
    /// Between polls `tick` runs (checks the processes are alive).
    async fn until<T>(
        &self,
        what: &str,
        timeout: Duration,
        mut tick: impl FnMut() -> anyhow::Result<()>,
        mut found: impl FnMut(&Value) -> Option<T>,
    ) -> anyhow::Result<T> {
        let deadline = Instant::now() + timeout;
        loop {
            let status = self.status().await?;
            if let Some(t) = found(&status) {
                return Ok(t);
            }
            if Instant::now() >= deadline {
                bail!(
                    "timed out after {timeout:?} waiting for {what}; status:\n{}",
                    serde_yaml::to_string(&status).unwrap_or_default()
                );
            }
            tick()?;
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// The InferenceService's events, oldest first. The operator's event recorder
    /// folds exact repeats into one event's series (`count`), so counts matter.
    async fn event_list(&self) -> anyhow::Result<Vec<EventRow>> {
        let mut events: Vec<Event> = self
            .events
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .filter(|e| e.involved_object.name.as_deref() == Some(ISVC))
            .collect();
        events.sort_by_key(|e| {
            e.event_time
                .as_ref()
                .map(|t| t.0)
                .or_else(|| e.first_timestamp.as_ref().map(|t| t.0))
        });
        Ok(events
            .into_iter()
            .map(|e| EventRow {
                count: e
                    .series
                    .as_ref()
                    .and_then(|s| s.count)
                    .or(e.count)
                    .unwrap_or(1),
                type_: e.type_.unwrap_or_default(),
                reason: e.reason.unwrap_or_default(),
                note: e.message.unwrap_or_default(),
            })
            .collect())
    }
}

/// One event as listed: type, reason, note, and how often it was observed.
#[derive(Debug)]
struct EventRow {
    type_: String,
    reason: String,
    note: String,
    count: i32,
}

async fn rollout_scenarios(cluster: &Cluster, tools: &Tools) -> anyhow::Result<()> {
    let admin: Client = cluster.client().await.context("admin client")?;
    let namespace = TestNamespace::create(cluster, &admin, "rollout-e2e").await?;
    let ns = namespace.name().to_owned();
    let identity = OperatorIdentity::bind(cluster, &admin, &namespace)
        .await
        .context("binding the operator's ServiceAccount")?;
    let logs = cluster.workdir().join("rollout-e2e").join(&ns);
    std::fs::create_dir_all(&logs)?;
    eprintln!("rollout e2e: logs under {}", logs.display());

    // Ports first, so Prometheus's static targets name every engine up front (a
    // canary's target is simply down until its engine starts).
    let (stable_port, bad_port, good_port, quiet_port, prom_port, operator_port) = (
        free_port()?,
        free_port()?,
        free_port()?,
        free_port()?,
        free_port()?,
        free_port()?,
    );
    let mut prometheus = start_prometheus(
        tools,
        &logs,
        prom_port,
        &[stable_port, bad_port, good_port, quiet_port],
        operator_port,
    )?;
    let prom_url = format!("http://127.0.0.1:{prom_port}");

    // Restarted when it exits, as its Deployment would be: with a 6 s lease a stalled
    // API server makes it exit on purpose (see `slipway_engine::testing::Supervised`).
    let (operator_bin, kubeconfig) = (tools.operator.clone(), identity.kubeconfig().to_owned());
    let operator_args = OperatorArgs {
        namespace: Some(ns.clone()),
        lease_namespace: ns.clone(),
        identity: Some("rollout-e2e".to_owned()),
        metrics_addr: (Ipv4Addr::LOCALHOST, operator_port).into(),
        lease_duration: Duration::from_secs(6),
        lease_retry: Duration::from_secs(1),
        ..OperatorArgs::default()
    }
    .to_args();
    let launch = move || {
        let mut command = Command::new(&operator_bin);
        command
            .env("KUBECONFIG", &kubeconfig)
            .env("RUST_LOG", "info,slipway_operator=debug")
            .args(&operator_args);
        command
    };
    let _operator = Supervised::start(
        "slipway-operator",
        Box::new(launch),
        &logs.join("operator.log"),
    )?;
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(crd::GROUP, crd::VERSION, crd::KIND),
        "inferenceservices",
    );
    let ctx = Ctx {
        isvcs: Api::namespaced_with(admin.clone(), &ns, &resource),
        events: Api::namespaced(admin.clone(), &ns),
    };
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()?;

    // The first bundle becomes stable without a rollout.
    ctx.apply(&isvc(&ns, &prom_url, "v1")?).await?;
    let h1: String = ctx
        .until(
            "a stable release, Ready",
            Duration::from_secs(120),
            || Ok(()),
            |s| {
                (condition(s, "Ready").is_some_and(|c| c["status"] == "True"))
                    .then(|| s["stableRelease"].as_str().map(str::to_owned))
                    .flatten()
            },
        )
        .await?;
    let mut stable_engine = start_engine(tools, &logs, &h1, stable_port, 0)?;
    let mut stable_load = start_load(tools, &logs, "stable", stable_port)?;

    // --- A bad bundle: rolled back on its burn rate. ---
    let bad_spec = isvc(&ns, &prom_url, "v2-slow")?;
    ctx.apply(&bad_spec).await?;
    let h2: String = ctx
        .until(
            "the bad bundle's canary",
            Duration::from_secs(60),
            || Ok(()),
            |s| {
                s["canaryRelease"]["hash"]
                    .as_str()
                    .filter(|h| *h != h1)
                    .map(str::to_owned)
            },
        )
        .await?;
    let bad_engine = start_engine(tools, &logs, &h2, bad_port, BAD_DELAY_MS)?;
    let bad_load = start_load(tools, &logs, "bad-canary", bad_port)?;
    let mut processes = vec![bad_engine, bad_load];

    // The windows fill when Prometheus holds minRequests eligible canary requests in
    // the short window (the long one holds at least as many).
    let fill_deadline = Instant::now() + Duration::from_secs(120);
    let filled_at = loop {
        let rolled_back = ctx.status().await?["lastRollback"]["release"] == h2.as_str();
        ensure!(
            !rolled_back,
            "the canary was rolled back before its windows held {MIN_REQUESTS} requests"
        );
        let n = promql(&http, &prom_url, &eligible_query(&h2)).await?;
        if n >= MIN_REQUESTS {
            break Instant::now();
        }
        ensure!(
            Instant::now() < fill_deadline,
            "the bad canary's short window never held {MIN_REQUESTS} requests (have {n}); see {}",
            logs.display()
        );
        for p in processes.iter_mut() {
            p.ensure_running()?;
        }
        prometheus.ensure_running()?;
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let rolled_back = ctx
        .until(
            "the bad canary rolled back",
            Duration::from_secs(60),
            || Ok(()),
            |s| (s["lastRollback"]["release"] == h2.as_str()).then(|| s.clone()),
        )
        .await?;
    let after_fill = filled_at.elapsed();
    drop(processes);
    eprintln!("rollout e2e: {h2} rolled back {after_fill:?} after its windows filled");
    let last = &rolled_back["lastRollback"];
    let short_burn = last["shortBurnRate"]
        .as_f64()
        .context("lastRollback.shortBurnRate")?;
    let long_burn = last["longBurnRate"]
        .as_f64()
        .context("lastRollback.longBurnRate")?;
    ensure!(
        short_burn > 5.0 && long_burn > 5.0,
        "burn rates {short_burn}/{long_burn} do not exceed the thresholds of 5"
    );
    ensure!(
        after_fill <= Duration::from_secs(2 * INTERVAL_S + 1),
        "rolled back {after_fill:?} after the windows filled; the bound is two analysis intervals ({}s) plus 1 s of observation",
        2 * INTERVAL_S
    );
    ensure!(
        rolled_back["stableRelease"] == h1.as_str(),
        "stable must stay {h1}: {rolled_back}"
    );
    ensure!(
        rolled_back["failedReleases"]
            .as_array()
            .is_some_and(|f| f.iter().any(|x| x == h2.as_str())),
        "{h2} not in failedReleases: {rolled_back}"
    );
    ensure!(
        condition(&rolled_back, "RolledBack").is_some_and(|c| c["status"] == "True"),
        "RolledBack condition not True: {rolled_back}"
    );
    let events = ctx.event_list().await?;
    let rolled_back_events = |events: &[EventRow]| -> i32 {
        events
            .iter()
            .filter(|e| e.reason == "RolledBack")
            .map(|e| e.count)
            .sum()
    };
    let mut text = format!(
        "# status of InferenceService {ns}/{ISVC} after the bad bundle {h2} was rolled back ({after_fill:?} after its windows filled)\n{}\n# events of {ns}/{ISVC} (type, reason, count, note), oldest first\n",
        serde_yaml::to_string(&rolled_back)?
    );
    for e in &events {
        text.push_str(&format!(
            "{}\t{}\tx{}\t{}\n",
            e.type_, e.reason, e.count, e.note
        ));
    }
    std::fs::write(REPORT, &text).with_context(|| format!("writing {REPORT}"))?;
    ensure!(
        rolled_back_events(&events) == 1
            && events
                .iter()
                .any(|e| e.reason == "RolledBack" && e.note.contains(&h2)),
        "expected one RolledBack event naming {h2}: {events:?}"
    );

    // --- Re-applying the failed spec (GitOps) does not restart the rollout, nor does an
    // edit outside the bundle. The annotation alone leaves the generation as it is, so
    // the edit (a longer progressDeadline, which matters only during a rollout) bumps
    // it: once `status.observedGeneration` reaches it, the operator has reconciled the
    // re-applied object, with no sleeping. ---
    let mut reapplied = bad_spec.clone();
    reapplied["metadata"]["annotations"] = json!({"e2e.slipway.dev/reapplied": "1"});
    ctx.apply(&reapplied).await?;
    reapplied["spec"]["rollout"]["progressDeadline"] = json!("11m");
    ctx.apply(&reapplied).await?;
    let generation = ctx.generation().await?;
    let status = ctx
        .until(
            "the operator to observe the re-applied spec",
            Duration::from_secs(60),
            || Ok(()),
            |s| (s["observedGeneration"].as_i64() >= Some(generation)).then(|| s.clone()),
        )
        .await?;
    ensure!(
        status["canaryRelease"].is_null() && status["stableRelease"] == h1.as_str(),
        "re-applying the failed spec restarted the rollout: {status}"
    );
    ensure!(
        rolled_back_events(&ctx.event_list().await?) == 1,
        "re-applying the failed spec produced another RolledBack event"
    );

    // --- A changed (healthy) bundle starts a new rollout, which promotes. ---
    ctx.apply(&isvc(&ns, &prom_url, "v3-healthy")?).await?;
    let h3: String = ctx
        .until(
            "the healthy bundle's canary",
            Duration::from_secs(60),
            || Ok(()),
            |s| {
                s["canaryRelease"]["hash"]
                    .as_str()
                    .filter(|h| *h != h1 && *h != h2)
                    .map(str::to_owned)
            },
        )
        .await?;
    let mut good_engine = start_engine(tools, &logs, &h3, good_port, 0)?;
    let mut good_load = start_load(tools, &logs, "good-canary", good_port)?;
    // Every step must be seen in status (each lasts at least one analysis interval;
    // status is polled every 250 ms).
    let mut steps_seen: Vec<i64> = Vec::new();
    let promoted = ctx
        .until(
            "the healthy canary promoted to stable",
            Duration::from_secs(180),
            || {
                for p in [
                    &mut good_engine,
                    &mut good_load,
                    &mut stable_engine,
                    &mut stable_load,
                    &mut prometheus,
                ] {
                    p.ensure_running()?;
                }
                Ok(())
            },
            |s| {
                if s["canaryRelease"]["hash"] == h3.as_str()
                    && let Some(step) = s["canaryRelease"]["step"].as_i64()
                    && steps_seen.last() != Some(&step)
                {
                    steps_seen.push(step);
                }
                if s["lastRollback"]["release"] == h3.as_str() {
                    return Some(Err(format!("the healthy canary {h3} was rolled back: {s}")));
                }
                (s["stableRelease"] == h3.as_str() && s["canaryRelease"].is_null())
                    .then(|| Ok(s.clone()))
            },
        )
        .await;
    let events = ctx.event_list().await?;
    let promoted = promoted
        .and_then(|r| r.map_err(anyhow::Error::msg))
        .with_context(|| format!("events: {events:?}"))?;
    ensure!(
        promoted["lastRollback"]["release"] == h2.as_str(),
        "the healthy canary must not have been rolled back: {promoted}"
    );
    ensure!(
        steps_seen == [0, 1, 2],
        "the healthy canary must pass through steps 0, 1, 2 in order; status showed {steps_seen:?}"
    );
    let advanced: i32 = events
        .iter()
        .filter(|e| e.reason == "StepAdvanced")
        .map(|e| e.count)
        .sum();
    ensure!(
        advanced == 2,
        "expected two step advances of the healthy canary (steps 1 and 2 of 3), got {advanced}: {events:?}"
    );
    ensure!(
        events
            .iter()
            .any(|e| e.reason == "Promoted" && e.note.contains(&h3)),
        "no Promoted event for {h3}: {events:?}"
    );
    // Every dashboard panel has data while load runs: engines, rules and operator.
    dashboard_panels_return_series(&http, &prom_url).await?;
    drop((good_load, stable_load));

    // --- Too little traffic: Hold holds, RollbackAfter rolls back; never promotes. ---
    let mut quiet_spec = isvc(&ns, &prom_url, "v4-quiet")?;
    ctx.apply(&quiet_spec).await?;
    let h4: String = ctx
        .until(
            "the quiet bundle's canary",
            Duration::from_secs(60),
            || Ok(()),
            |s| {
                s["canaryRelease"]["hash"]
                    .as_str()
                    .filter(|h| ![&h1, &h2, &h3].contains(&&h.to_string()))
                    .map(str::to_owned)
            },
        )
        .await?;
    let mut quiet_engine = start_engine(tools, &logs, &h4, quiet_port, 0)?;
    // A trickle: fewer requests than minRequests in any window.
    for _ in 0..2 {
        let response = http
            .post(format!("http://127.0.0.1:{quiet_port}/v1/completions"))
            .json(&json!({"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 4, "ignore_eos": true}))
            .send()
            .await?;
        ensure!(
            response.status().is_success(),
            "trickle request: {}",
            response.status()
        );
    }
    // Hold: for five analysis intervals the canary stays at step 0, held as
    // inconclusive once its groups are ready, and is neither promoted nor rolled back.
    let hold_until = Instant::now() + Duration::from_secs(5 * INTERVAL_S);
    let mut held = None;
    while Instant::now() < hold_until {
        let s = ctx.status().await?;
        ensure!(
            s["canaryRelease"]["hash"] == h4.as_str()
                && s["canaryRelease"]["step"] == 0
                && s["stableRelease"] == h3.as_str()
                && s["lastRollback"]["release"] != h4.as_str(),
            "a canary with too little traffic under Hold must stay at step 0: {s}"
        );
        if s["rolloutHold"]["gate"] == "Inconclusive" {
            held = Some(s["rolloutHold"].clone());
        }
        quiet_engine.ensure_running()?;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let held = held.context("the quiet canary was never held as Inconclusive")?;
    let reason = held["reason"].as_str().unwrap_or_default();
    ensure!(
        reason.contains("waiting for 8 requests"),
        "the hold should say how many requests it waits for: {held}"
    );
    // RollbackAfter: the same bundle (the policy is outside it), rolled back once it
    // has been inconclusive for the timeout.
    quiet_spec["spec"]["rollout"]["analysis"]["inconclusivePolicy"] = json!("RollbackAfter");
    quiet_spec["spec"]["rollout"]["analysis"]["inconclusiveTimeout"] = json!("6s");
    ctx.apply(&quiet_spec).await?;
    let quiet_rolled_back = ctx
        .until(
            "the quiet canary rolled back after 6s inconclusive",
            Duration::from_secs(30),
            || Ok(()),
            |s| canary_gone(s, &h3).then(|| s.clone()),
        )
        .await;
    let quiet_rolled_back = quiet_rolled_back?;
    ensure!(
        quiet_rolled_back["lastRollback"]["release"] == h4.as_str()
            && quiet_rolled_back["stableRelease"] == h3.as_str()
            && quiet_rolled_back["lastRollback"]["reason"]
                .as_str()
                .is_some_and(|r| r.contains("inconclusive")),
        "expected {h4} rolled back as inconclusive, {h3} stable: {quiet_rolled_back}"
    );
    drop(quiet_engine);

    let denied = identity.forbidden_requests()?;
    ensure!(
        denied.is_empty(),
        "the operator was refused by RBAC: {denied:?}"
    );
    Ok(())
}

/// True once the canary is gone from status (rolled back or promoted) or the stable
/// release changed; the caller tells these apart.
fn canary_gone(status: &Value, stable: &str) -> bool {
    status["canaryRelease"].is_null() || status["stableRelease"] != stable
}
