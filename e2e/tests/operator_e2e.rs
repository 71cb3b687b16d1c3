//! The operator on the real control plane (see `e2e/README.md`), running as its own
//! process under the token identity of `manifests/rbac/` — so a permission the
//! operator needs but the role lacks fails the test (its 403s are read from the
//! audit log).
//!
//! Own harness (libtest-mimic), like `tests/e2e/main.rs`: the cluster comes up once;
//! each test gets a namespace, a copy of the operator's ServiceAccount bound to its
//! roles, and operator processes restricted to that namespace (`--namespace`), with
//! their Lease there too, so tests run side by side. Operator processes are killed
//! when their guard drops. Every wait is bounded; nothing sleeps to synchronise.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::pin::Pin;
use std::process::{Command, ExitCode};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event, Node, Pod, Service, ServiceAccount};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{DeleteParams, DynamicObject, ListParams, Patch, PatchParams, WatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::{Api, Client, ResourceExt};
use libtest_mimic::{Arguments, Failed, Trial};
use serde_json::{Value, json};
use slipway_api::testing::condition_status;
use slipway_contract::{EngineCommand, GROUP_PORT, GroupArgs, OperatorArgs};
use slipway_e2e::build::cargo_build;
use slipway_e2e::rbac::OperatorIdentity;
use slipway_e2e::{Cluster, ClusterGuard, TestNamespace, crd, manifests, wait};
use slipway_engine::testing::Supervised;

type TestFuture = Pin<Box<dyn Future<Output = anyhow::Result<()>> + Send>>;
type TestFn = fn(Arc<Env>) -> TestFuture;

/// Bound for a group of KWOK pods to become Ready after an apply.
const CONVERGE: Duration = Duration::from_secs(90);
/// The operators' lease timings in these tests (short, so failover is quick).
const LEASE_SECONDS: u64 = 6;
const RETRY_SECONDS: u64 = 1;

struct Env {
    name: &'static str,
    cluster: Arc<Cluster>,
    operator_bin: PathBuf,
}

macro_rules! tests {
    ($($test:ident),* $(,)?) => {
        vec![$((
            concat!("operator::", stringify!($test)),
            (|env| Box::pin($test(env))) as TestFn,
        )),*]
    };
}

fn all_tests() -> Vec<(&'static str, TestFn)> {
    tests![
        cpu_sample_becomes_ready_spread_over_zones_and_scales,
        multi_pod_groups_are_co_located_and_recreated_whole,
        reapplying_the_same_manifest_changes_nothing,
        only_the_leader_acts_and_a_standby_takes_over,
        a_killed_operator_converges_without_duplicates,
        deleting_the_service_collects_every_child,
        losing_a_zone_is_reported_and_recovered,
        the_router_fronts_the_engines_under_a_read_only_role,
        an_httproute_to_the_router_is_accepted_by_the_gateway_api_crd,
    ]
}

fn main() -> ExitCode {
    let _logs = slipway_e2e::test_logs();
    let arguments = Arguments::from_args();
    let tests = all_tests();
    let selected = tests
        .iter()
        .any(|(name, _)| !arguments.is_filtered_out(&Trial::test(*name, || Ok(()))));
    if arguments.list || !selected {
        let trials = tests
            .into_iter()
            .map(|(name, _)| Trial::test(name, || Ok(())))
            .collect();
        return libtest_mimic::run(&arguments, trials).exit_code();
    }
    let operator_bin = match build_operator() {
        Ok(path) => path,
        Err(error) => {
            eprintln!(
                "error: could not build slipway-operator, so every operator e2e test fails: {error:#}"
            );
            return ExitCode::FAILURE;
        }
    };
    let guard = match ClusterGuard::up() {
        Ok(guard) => guard,
        Err(error) => {
            eprintln!(
                "error: the e2e control plane is not available, so every e2e test fails: {error}"
            );
            return ExitCode::FAILURE;
        }
    };
    let cluster = Arc::new(guard.cluster().clone());
    if let Err(error) = crd::ensure_installed(&cluster) {
        eprintln!("error: could not install the CRD: {error}");
        return ExitCode::FAILURE;
    }
    let trials = tests
        .into_iter()
        .map(|(name, test)| {
            let env = Arc::new(Env {
                name,
                cluster: Arc::clone(&cluster),
                operator_bin: operator_bin.clone(),
            });
            Trial::test(name, move || {
                let runtime = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .map_err(|error| Failed::from(format!("tokio runtime: {error}")))?;
                runtime
                    .block_on(test(env))
                    .map_err(|error| Failed::from(format!("{error:#}")))
            })
        })
        .collect();
    let conclusion = libtest_mimic::run(&arguments, trials);
    drop(guard);
    conclusion.exit_code()
}

/// Builds the operator binary (once per test run) and returns its path.
fn build_operator() -> anyhow::Result<PathBuf> {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    if let Some(path) = BUILT.get() {
        return Ok(path.clone());
    }
    let path = cargo_build("slipway-operator", "slipway-operator")?;
    Ok(BUILT.get_or_init(|| path).clone())
}

/// An operator process, restarted when it exits as its Deployment would restart it
/// (see [`Supervised`]); killed (SIGKILL) and reaped when dropped.
struct Operator {
    process: Supervised,
}

impl Operator {
    fn start(
        env: &Env,
        identity: &OperatorIdentity,
        namespace: &str,
        name: &str,
    ) -> anyhow::Result<Self> {
        let log = env
            .cluster
            .workdir()
            .join("operator-logs")
            .join(format!("{namespace}-{name}.log"));
        let (bin, kubeconfig) = (env.operator_bin.clone(), identity.kubeconfig().to_owned());
        let args = OperatorArgs {
            namespace: Some(namespace.to_owned()),
            lease_namespace: namespace.to_owned(),
            identity: Some(name.to_owned()),
            metrics_addr: (Ipv4Addr::LOCALHOST, 0).into(),
            lease_duration: Duration::from_secs(LEASE_SECONDS),
            lease_retry: Duration::from_secs(RETRY_SECONDS),
            ..OperatorArgs::default()
        }
        .to_args();
        let launch = move || {
            let mut command = Command::new(&bin);
            command
                .env("KUBECONFIG", &kubeconfig)
                .env("RUST_LOG", "info,slipway_operator=debug")
                .args(&args);
            command
        };
        let process = Supervised::start("slipway-operator", Box::new(launch), &log)?;
        Ok(Self { process })
    }

    fn kill(&mut self) {
        self.process.kill();
    }

    fn log_text(&self) -> String {
        self.process.log_text()
    }

    /// Its restarts and last log lines, for a failure message.
    fn describe(&self) -> String {
        self.process.describe(20)
    }
}

/// A test's namespace, identity and admin client.
struct Setup {
    admin: Client,
    namespace: TestNamespace,
    identity: OperatorIdentity,
}

async fn setup(env: &Env) -> anyhow::Result<Setup> {
    let admin = env.cluster.client().await.context("admin client")?;
    let namespace = TestNamespace::create(&env.cluster, &admin, env.name).await?;
    let identity = OperatorIdentity::bind(&env.cluster, &admin, &namespace)
        .await
        .context("binding the operator's ServiceAccount")?;
    Ok(Setup {
        admin,
        namespace,
        identity,
    })
}

impl Setup {
    fn ns(&self) -> &str {
        self.namespace.name()
    }

    fn isvcs(&self) -> Api<DynamicObject> {
        let resource = ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk(crd::GROUP, crd::VERSION, crd::KIND),
            "inferenceservices",
        );
        Api::namespaced_with(self.admin.clone(), self.ns(), &resource)
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.admin.clone(), self.ns())
    }

    /// Applies an InferenceService as a GitOps tool would (its own field manager).
    async fn apply(&self, isvc: &Value) -> anyhow::Result<()> {
        let name = isvc["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        self.isvcs()
            .patch(
                &name,
                &PatchParams::apply("gitops").force(),
                &Patch::Apply(isvc),
            )
            .await
            .with_context(|| format!("applying InferenceService {name}"))?;
        Ok(())
    }

    /// Waits until the InferenceService reports Ready=True for its current generation
    /// with `groups` ready groups, and returns it.
    async fn wait_ready(&self, name: &str, groups: i64) -> anyhow::Result<DynamicObject> {
        Ok(wait::for_object(
            &self.isvcs(),
            name,
            &format!("{name} Ready with {groups} groups"),
            CONVERGE,
            move |o: Option<&DynamicObject>| {
                o.is_some_and(|o| {
                    let status = &o.data["status"];
                    status["observedGeneration"].as_i64() == o.metadata.generation
                        && status["replicas"]["desired"] == groups
                        && status["replicas"]["ready"] == groups
                        && condition_status(status, "Ready") == Some("True")
                })
            },
        )
        .await?)
    }

    /// Waits until exactly `names` engine pods exist (none terminating) and all are
    /// Ready. The router pods (a Deployment's) are not counted.
    async fn wait_pods(&self, names: &BTreeSet<String>) -> anyhow::Result<Vec<Pod>> {
        let pods = self.pods();
        let want = names.clone();
        let last = Arc::new(std::sync::Mutex::new(String::new()));
        let seen = Arc::clone(&last);
        let found = wait::poll(
            &format!("pods {names:?} ready"),
            CONVERGE,
            || {
                let pods = pods.clone();
                let want = want.clone();
                let seen = Arc::clone(&seen);
                async move {
                    let list = pods.list(&ListParams::default().labels(ENGINES)).await?;
                    let have: BTreeSet<String> = list.items.iter().map(|p| p.name_any()).collect();
                    let ready = list
                        .items
                        .iter()
                        .all(|p| p.metadata.deletion_timestamp.is_none() && pod_ready(p));
                    if let Ok(mut text) = seen.lock() {
                        *text = format!("{have:?}, all ready: {ready}");
                    }
                    Ok((have == want && ready).then_some(list.items))
                }
            },
            || last.lock().map(|t| t.clone()).unwrap_or_default(),
        )
        .await?;
        Ok(found)
    }

    /// No request of the operator's identity was refused.
    fn ensure_no_forbidden(&self) -> anyhow::Result<()> {
        let denied = self.identity.forbidden_requests()?;
        ensure!(
            denied.is_empty(),
            "the operator was refused by RBAC: {denied:?}"
        );
        Ok(())
    }
}

fn pod_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The CPU sample, in `namespace`.
fn cpu_sample(namespace: &str) -> anyhow::Result<Value> {
    let path = manifests::samples_dir().join("smollm2-cpu.yaml");
    let mut sample = manifests::load_documents(&path)?
        .into_iter()
        .next()
        .context("empty sample")?;
    sample["metadata"]["namespace"] = json!(namespace);
    Ok(sample)
}

fn pod_names(prefix: &str, groups: u32, ranks: u32) -> BTreeSet<String> {
    (0..groups)
        .flat_map(|g| (0..ranks).map(move |r| format!("{prefix}-g{g}-r{r}")))
        .collect()
}

async fn node_labels(admin: &Client) -> anyhow::Result<BTreeMap<String, BTreeMap<String, String>>> {
    Ok(Api::<Node>::all(admin.clone())
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .map(|n| (n.name_any(), n.metadata.labels.unwrap_or_default()))
        .collect())
}

const ZONE: &str = "topology.kubernetes.io/zone";
/// The engine pods (the router pods carry the same instance label).
const ENGINES: &str = "app.kubernetes.io/component=engine";
const RACK: &str = "slipway.dev/nvlink-domain";

// -------------------------------------------------------------------------------------

async fn cpu_sample_becomes_ready_spread_over_zones_and_scales(
    env: Arc<Env>,
) -> anyhow::Result<()> {
    let setup = setup(&env).await?;
    let _operator = Operator::start(&env, &setup.identity, setup.ns(), "op-a")?;
    let mut sample = cpu_sample(setup.ns())?;
    setup.apply(&sample).await?;

    // 1.5 / 0.5 = 3 needed; ceil(3 / 0.66) = 5 provisioned.
    let isvc = setup.wait_ready("smollm2", 5).await?;
    ensure!(
        condition_status(&isvc.data["status"], "FaultTolerant") == Some("True"),
        "not fault tolerant: {:#}",
        isvc.data["status"]
    );
    let pods = setup.wait_pods(&pod_names("smollm2", 5, 1)).await?;
    let nodes = node_labels(&setup.admin).await?;
    let mut per_zone: BTreeMap<String, u32> = BTreeMap::new();
    for pod in &pods {
        let node = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default();
        let zone = nodes
            .get(&node)
            .and_then(|l| l.get(ZONE))
            .cloned()
            .unwrap_or_default();
        *per_zone.entry(zone).or_default() += 1;
    }
    ensure!(
        per_zone.len() == 3,
        "groups are not in all 3 zones: {per_zone:?}"
    );
    let (min, max) = (per_zone.values().min(), per_zone.values().max());
    ensure!(
        max.zip(min).is_some_and(|(max, min)| max - min <= 1),
        "skew > 1: {per_zone:?}"
    );

    // More demand adds groups; less removes the highest indices.
    sample["spec"]["capacity"]["demand"] = json!({"static": 3});
    setup.apply(&sample).await?;
    setup.wait_ready("smollm2", 10).await?;
    setup.wait_pods(&pod_names("smollm2", 10, 1)).await?;
    sample["spec"]["capacity"]["demand"] = json!({"static": 0.5});
    setup.apply(&sample).await?;
    setup.wait_ready("smollm2", 2).await?;
    setup.wait_pods(&pod_names("smollm2", 2, 1)).await?;
    setup.ensure_no_forbidden()
}

fn gpu_service(namespace: &str, name: &str, tensor: u32, pipeline: u32) -> anyhow::Result<Value> {
    let mut isvc = cpu_sample(namespace)?;
    isvc["metadata"]["name"] = json!(name);
    isvc["spec"]["release"]["engine"]["device"] = json!("CUDA");
    isvc["spec"]["release"]["engine"]["resources"] = json!({"requests": {"cpu": "1"}});
    isvc["spec"]["parallelism"] = json!({"tensor": tensor, "pipeline": pipeline, "gpusPerNode": 8});
    isvc["spec"]["capacity"] = json!({"demand": {"static": 1}, "replicaGoodput": 1, "faultDomain": {"fLoss": 0}, "minReplicas": 1});
    Ok(isvc)
}

/// The group flags the pod's engine reads from its rendered command line (parsed by
/// the engine's own parser), or why they cannot be read.
fn group_of(pod: &Pod) -> anyhow::Result<GroupArgs> {
    let args = pod
        .spec
        .as_ref()
        .and_then(|s| s.containers.first()?.args.clone())
        .unwrap_or_default();
    match EngineCommand::parse_args(&args)? {
        EngineCommand::Serve(serve) => Ok(serve.group),
        other => anyhow::bail!("{}: not serve: {other:?}", pod.name_any()),
    }
}

fn env_of(pod: &Pod) -> BTreeMap<String, String> {
    pod.spec
        .as_ref()
        .and_then(|s| s.containers.first()?.env.clone())
        .unwrap_or_default()
        .into_iter()
        .filter_map(|e| Some((e.name, e.value?)))
        .collect()
}

async fn multi_pod_groups_are_co_located_and_recreated_whole(env: Arc<Env>) -> anyhow::Result<()> {
    let setup = setup(&env).await?;
    let operator = Operator::start(&env, &setup.identity, setup.ns(), "op-a")?;
    setup.apply(&gpu_service(setup.ns(), "big", 8, 2)?).await?;
    setup.apply(&gpu_service(setup.ns(), "mid", 4, 2)?).await?;
    // On CPU a group is one pod per rank: tensor 3 × pipeline 2 is six pods.
    let mut cpu = gpu_service(setup.ns(), "cpu", 3, 2)?;
    cpu["spec"]["release"]["engine"]["device"] = json!("CPU");
    setup.apply(&cpu).await?;
    setup.wait_ready("big", 1).await?;
    setup.wait_ready("mid", 1).await?;
    setup.wait_ready("cpu", 1).await?;
    let mut want = pod_names("big", 1, 2);
    want.insert("mid-g0-r0".to_owned());
    want.extend(pod_names("cpu", 1, 6));
    let pods = setup.wait_pods(&want).await?;
    let nodes = node_labels(&setup.admin).await?;
    let find = |name: &str| {
        pods.iter()
            .find(|p| p.name_any() == name)
            .context(format!("{name} missing"))
    };
    let gpus = |pod: &Pod| {
        pod.spec.as_ref().and_then(|s| {
            s.containers
                .first()?
                .resources
                .as_ref()?
                .limits
                .as_ref()?
                .get("nvidia.com/gpu")
                .map(|q| q.0.clone())
        })
    };
    let rack = |pod: &Pod| {
        pod.spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .and_then(|n| nodes.get(&n)?.get(RACK).cloned())
    };
    let (leader, worker, mid) = (find("big-g0-r0")?, find("big-g0-r1")?, find("mid-g0-r0")?);
    ensure!(
        gpus(leader).as_deref() == Some("8") && gpus(worker).as_deref() == Some("8"),
        "big pods do not request 8 GPUs each"
    );
    ensure!(
        gpus(mid).as_deref() == Some("8"),
        "tensor 4 × pipeline 2 is not one 8-GPU pod"
    );
    ensure!(
        rack(leader).is_some() && rack(leader) == rack(worker),
        "group spans racks: {:?} vs {:?}",
        rack(leader),
        rack(worker)
    );
    // Ranks are labels and DNS names (hostname.subdomain under the group's headless
    // Service). A CUDA pod of 8 GPUs would need one process driving 8 ranks (the NCCL
    // work), so it is told nothing of its group: no group flags, no env.
    for (pod, rank) in [(leader, "0"), (worker, "1")] {
        let spec = pod.spec.as_ref().context("pod spec")?;
        ensure!(
            pod.labels().get("slipway.dev/rank").map(String::as_str) == Some(rank),
            "{}: rank label {:?}",
            pod.name_any(),
            pod.labels().get("slipway.dev/rank")
        );
        ensure!(
            spec.hostname.as_deref() == Some(pod.name_any().as_str())
                && spec.subdomain.as_deref() == Some("big-g0"),
            "{}: DNS name {:?}.{:?}",
            pod.name_any(),
            spec.hostname,
            spec.subdomain
        );
        ensure!(
            env_of(pod).is_empty(),
            "{}: the operator set env {:?}",
            pod.name_any(),
            env_of(pod)
        );
        let group = group_of(pod)?;
        ensure!(
            group.is_single_process() && group.leader_address.is_none(),
            "{}: a pod of 8 GPUs was given group flags {group:?}",
            pod.name_any()
        );
    }
    // Each CPU pod is one rank, told its place and its leader's stable DNS name.
    for rank in 0..6 {
        let pod = find(&format!("cpu-g0-r{rank}"))?;
        let group = group_of(pod)?;
        let leader = format!("cpu-g0-r0.cpu-g0.{}.svc:{GROUP_PORT}", setup.ns());
        ensure!(
            (group.tensor_parallel, group.pipeline_parallel, group.rank) == (3, 2, rank)
                && group.leader_address.as_ref().map(ToString::to_string) == Some(leader)
                && group.validate().is_ok(),
            "{}: group flags {group:?}",
            pod.name_any()
        );
    }

    // Deleting one rank recreates both.
    let old: BTreeSet<String> = [leader, worker]
        .iter()
        .filter_map(|p| p.metadata.uid.clone())
        .collect();
    setup
        .pods()
        .delete("big-g0-r1", &DeleteParams::default())
        .await?;
    let pods_api = setup.pods();
    let seen = Arc::new(std::sync::Mutex::new(String::from("nothing listed yet")));
    let last_seen = Arc::clone(&seen);
    wait::poll(
        "both ranks of big-g0 recreated and ready",
        CONVERGE,
        || {
            let (pods_api, old, seen) = (pods_api.clone(), old.clone(), Arc::clone(&seen));
            async move {
                let list = pods_api
                    .list(
                        &ListParams::default()
                            .labels(&format!("app.kubernetes.io/instance=big,{ENGINES}")),
                    )
                    .await?;
                let is_new = |p: &Pod| p.metadata.uid.as_ref().is_some_and(|u| !old.contains(u));
                let fresh = list.items.len() == 2
                    && list.items.iter().all(|p| {
                        p.metadata.deletion_timestamp.is_none() && pod_ready(p) && is_new(p)
                    });
                let summary: Vec<String> = list
                    .items
                    .iter()
                    .map(|p| {
                        format!(
                            "{} ({}, {}, ready {}, phase {:?}, node {:?})",
                            p.name_any(),
                            if is_new(p) { "new" } else { "old" },
                            if p.metadata.deletion_timestamp.is_some() {
                                "terminating"
                            } else {
                                "live"
                            },
                            pod_ready(p),
                            p.status.as_ref().and_then(|s| s.phase.clone()),
                            p.spec.as_ref().and_then(|s| s.node_name.clone()),
                        )
                    })
                    .collect();
                *seen
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) =
                    format!("pods [{}]", summary.join("; "));
                Ok(fresh.then_some(()))
            }
        },
        || {
            format!(
                "{}\n{}",
                last_seen
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner),
                operator.describe()
            )
        },
    )
    .await?;
    setup.ensure_no_forbidden()
}

async fn child_versions(setup: &Setup, instance: &str) -> anyhow::Result<BTreeMap<String, String>> {
    let selector = ListParams::default().labels(&format!("app.kubernetes.io/instance={instance}"));
    let mut versions = BTreeMap::new();
    for pod in setup.pods().list(&selector).await?.items {
        versions.insert(
            format!("Pod/{}", pod.name_any()),
            pod.resource_version().unwrap_or_default(),
        );
    }
    for svc in Api::<Service>::namespaced(setup.admin.clone(), setup.ns())
        .list(&selector)
        .await?
        .items
    {
        versions.insert(
            format!("Service/{}", svc.name_any()),
            svc.resource_version().unwrap_or_default(),
        );
    }
    for pdb in Api::<PodDisruptionBudget>::namespaced(setup.admin.clone(), setup.ns())
        .list(&selector)
        .await?
        .items
    {
        versions.insert(
            format!("PDB/{}", pdb.name_any()),
            pdb.resource_version().unwrap_or_default(),
        );
    }
    let ns = setup.ns();
    let admin = &setup.admin;
    for (kind, list) in [
        (
            "Deployment",
            versions_of(Api::<Deployment>::namespaced(admin.clone(), ns), &selector).await?,
        ),
        (
            "ServiceAccount",
            versions_of(
                Api::<ServiceAccount>::namespaced(admin.clone(), ns),
                &selector,
            )
            .await?,
        ),
        (
            "Role",
            versions_of(Api::<Role>::namespaced(admin.clone(), ns), &selector).await?,
        ),
        (
            "RoleBinding",
            versions_of(Api::<RoleBinding>::namespaced(admin.clone(), ns), &selector).await?,
        ),
    ] {
        for (name, version) in list {
            versions.insert(format!("{kind}/{name}"), version);
        }
    }
    Ok(versions)
}

/// Names and resourceVersions of what `api` lists with `selector`.
async fn versions_of<K>(api: Api<K>, selector: &ListParams) -> anyhow::Result<Vec<(String, String)>>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    Ok(api
        .list_metadata(selector)
        .await?
        .items
        .into_iter()
        .map(|o| (o.name_any(), o.resource_version().unwrap_or_default()))
        .collect())
}

async fn reapplying_the_same_manifest_changes_nothing(env: Arc<Env>) -> anyhow::Result<()> {
    let setup = setup(&env).await?;
    let _operator = Operator::start(&env, &setup.identity, setup.ns(), "op-a")?;
    let sample = cpu_sample(setup.ns())?;
    setup.apply(&sample).await?;
    setup.wait_ready("smollm2", 5).await?;
    setup.wait_pods(&pod_names("smollm2", 5, 1)).await?;
    // Let the last status write land before taking the baseline: FaultTolerant and
    // serving follow readiness (and the EndpointSlices) by one reconcile or more.
    let isvc = wait::for_object(
        &setup.isvcs(),
        "smollm2",
        "smollm2 fault tolerant",
        CONVERGE,
        |o: Option<&DynamicObject>| {
            o.is_some_and(|o| {
                condition_status(&o.data["status"], "FaultTolerant") == Some("True")
                    && condition_status(&o.data["status"], "Progressing") == Some("False")
                    && o.data["status"]["replicas"]["serving"] == 5
            })
        },
    )
    .await?;
    // The router's Deployment settles too (its status moves as its pods come up).
    wait_router(&setup, "smollm2").await?;
    let before = child_versions(&setup, "smollm2").await?;
    let isvc_version = isvc.resource_version();

    setup.apply(&sample).await?;
    // Watch the children and the InferenceService for 30 s from the baseline's
    // resourceVersions: any event at all is a write, i.e. a hot loop.
    let selector = "app.kubernetes.io/instance=smollm2";
    let params = WatchParams::default().labels(selector).timeout(30);
    let pod_list = setup
        .pods()
        .list(&ListParams::default().labels(selector))
        .await?;
    let svc_api = Api::<Service>::namespaced(setup.admin.clone(), setup.ns());
    let svc_list = svc_api
        .list(&ListParams::default().labels(selector))
        .await?;
    let mut changes = futures::stream::select_all(vec![
        setup
            .pods()
            .watch(
                &params,
                &pod_list.metadata.resource_version.unwrap_or_default(),
            )
            .await?
            .map(|e| e.map(|e| format!("pod {e:?}")))
            .boxed(),
        svc_api
            .watch(
                &params,
                &svc_list.metadata.resource_version.unwrap_or_default(),
            )
            .await?
            .map(|e| e.map(|e| format!("service {e:?}")))
            .boxed(),
        setup
            .isvcs()
            .watch(
                &WatchParams::default().timeout(30),
                // From the baseline itself, so a write between it and the re-apply is
                // caught and shown too.
                isvc_version.as_deref().unwrap_or_default(),
            )
            .await?
            .map(|e| e.map(|e| format!("inferenceservice {e:?}")))
            .boxed(),
    ]);
    // The server ends each watch after 30 s; the stream ends when all have.
    while let Some(event) = changes.next().await {
        let event = event?;
        // Bookmarks carry no change.
        ensure!(
            event.contains("Bookmark"),
            "a write after an unchanged re-apply: {event}"
        );
    }
    let after = child_versions(&setup, "smollm2").await?;
    ensure!(
        after == before,
        "children changed after an unchanged re-apply:\nbefore {before:?}\nafter  {after:?}"
    );
    ensure!(
        setup.isvcs().get("smollm2").await?.resource_version() == isvc_version,
        "the InferenceService was written"
    );
    let managed = setup
        .isvcs()
        .get("smollm2")
        .await?
        .metadata
        .managed_fields
        .unwrap_or_default();
    for entry in managed
        .iter()
        .filter(|m| m.manager.as_deref() == Some("slipway-operator"))
    {
        ensure!(
            entry.subresource.as_deref() == Some("status"),
            "the operator manages fields outside status: {entry:?}"
        );
    }
    ensure!(
        managed
            .iter()
            .any(|m| m.manager.as_deref() == Some("slipway-operator")),
        "no status written by slipway-operator"
    );
    setup.ensure_no_forbidden()
}

async fn lease_holder(setup: &Setup) -> anyhow::Result<Option<String>> {
    let lease = Api::<Lease>::namespaced(setup.admin.clone(), setup.ns())
        .get_opt("slipway-operator")
        .await?;
    Ok(lease.and_then(|l| l.spec?.holder_identity))
}

async fn only_the_leader_acts_and_a_standby_takes_over(env: Arc<Env>) -> anyhow::Result<()> {
    let setup = setup(&env).await?;
    let mut a = Operator::start(&env, &setup.identity, setup.ns(), "op-a")?;
    let leases = Api::<Lease>::namespaced(setup.admin.clone(), setup.ns());
    let lease = wait::for_object(
        &leases,
        "slipway-operator",
        "a lease holder",
        CONVERGE,
        |l: Option<&Lease>| {
            l.and_then(|l| l.spec.as_ref()?.holder_identity.clone())
                .is_some()
        },
    )
    .await?;
    ensure!(
        lease.spec.and_then(|s| s.holder_identity).as_deref() == Some("op-a"),
        "op-a did not take the free lease"
    );
    let mut b = Operator::start(&env, &setup.identity, setup.ns(), "op-b")?;
    let mut sample = cpu_sample(setup.ns())?;
    setup.apply(&sample).await?;
    setup.wait_ready("smollm2", 5).await?;
    ensure!(
        lease_holder(&setup).await?.as_deref() == Some("op-a"),
        "leadership moved without a failure"
    );
    ensure!(
        !b.log_text().contains("\"reconciled\""),
        "the standby reconciled:\n{}",
        b.log_text()
    );

    a.kill();
    let killed = Instant::now();
    wait::for_object(
        &leases,
        "slipway-operator",
        "op-b holds the lease",
        Duration::from_secs(LEASE_SECONDS * 3),
        |l: Option<&Lease>| {
            l.and_then(|l| l.spec.as_ref()?.holder_identity.clone())
                .as_deref()
                == Some("op-b")
        },
    )
    .await?;
    let took = killed.elapsed();
    ensure!(
        took <= Duration::from_secs(LEASE_SECONDS + 2 * RETRY_SECONDS + 1),
        "failover took {took:?}, more than the lease duration ({LEASE_SECONDS}s) plus two retries"
    );
    // The new leader acts.
    sample["spec"]["capacity"]["demand"] = json!({"static": 0.5});
    setup.apply(&sample).await?;
    setup.wait_ready("smollm2", 2).await?;
    ensure!(
        b.log_text().contains("acquired leadership"),
        "op-b never logged leadership"
    );
    b.kill();
    drop((a, b));
    setup.ensure_no_forbidden()
}

async fn a_killed_operator_converges_without_duplicates(env: Arc<Env>) -> anyhow::Result<()> {
    let setup = setup(&env).await?;
    let mut first = Operator::start(&env, &setup.identity, setup.ns(), "op-a")?;
    let mut sample = cpu_sample(setup.ns())?;
    sample["spec"]["capacity"]["demand"] = json!({"static": 3});
    setup.apply(&sample).await?;
    // Kill it as soon as it has started creating pods (mid-reconcile for 10 groups).
    let pods = setup.pods();
    wait::poll(
        "the first pod",
        CONVERGE,
        || {
            let pods = pods.clone();
            async move { Ok((!pods.list(&ListParams::default()).await?.items.is_empty()).then_some(())) }
        },
        || "no pods".to_owned(),
    )
    .await?;
    first.kill();
    // A new process with another identity must wait out the dead one's lease, then finish.
    let _second = Operator::start(&env, &setup.identity, setup.ns(), "op-b")?;
    setup.wait_ready("smollm2", 10).await?;
    let pods = setup.wait_pods(&pod_names("smollm2", 10, 1)).await?;
    ensure!(pods.len() == 10, "expected 10 pods, found {}", pods.len());
    let services = Api::<Service>::namespaced(setup.admin.clone(), setup.ns())
        .list(&ListParams::default().labels("app.kubernetes.io/instance=smollm2"))
        .await?;
    // 10 group Services + the client Service + the release Service.
    ensure!(
        services.items.len() == 12,
        "services: {:?}",
        services
            .items
            .iter()
            .map(|s| s.name_any())
            .collect::<Vec<_>>()
    );
    setup.ensure_no_forbidden()
}

async fn deleting_the_service_collects_every_child(env: Arc<Env>) -> anyhow::Result<()> {
    let setup = setup(&env).await?;
    let _operator = Operator::start(&env, &setup.identity, setup.ns(), "op-a")?;
    setup.apply(&cpu_sample(setup.ns())?).await?;
    setup.wait_ready("smollm2", 5).await?;
    ensure!(
        !child_versions(&setup, "smollm2").await?.is_empty(),
        "no children"
    );
    setup
        .isvcs()
        .delete("smollm2", &DeleteParams::foreground())
        .await?;
    let setup_ref = &setup;
    wait::poll(
        "every child garbage-collected",
        CONVERGE,
        move || async move {
            Ok(child_versions(setup_ref, "smollm2")
                .await
                .ok()
                .filter(BTreeMap::is_empty)
                .map(|_| ()))
        },
        || "children remain".to_owned(),
    )
    .await?;
    setup.ensure_no_forbidden()
}

/// The fault-domain key of the zone-loss test's private nodes. No other test's
/// InferenceService uses it, and those nodes are tainted, so nothing else lands there.
const PRIVATE_ZONE: &str = "e2e.slipway.dev/zone";
const PRIVATE_POOL: &str = "e2e.slipway.dev/pool";

/// KWOK nodes private to one test: one 8-GPU node per zone under [`PRIVATE_ZONE`],
/// labelled and tainted with the test's pool, so only pods that select and tolerate
/// the pool run there and deleting them disturbs no other test. Deleted on drop.
struct PrivateNodes {
    cluster: Arc<Cluster>,
    pool: String,
    names: Vec<String>,
}

impl PrivateNodes {
    fn new(env: &Env, namespace: &str, zones: u32) -> Self {
        // The namespace's unique suffix (pid and counter) keeps names short: a node
        // name is also its `kubernetes.io/hostname` label value (≤ 63 characters).
        let tag = namespace.rsplit('-').next().unwrap_or(namespace);
        let pool = format!("zone-loss-{tag}");
        let names = (1..=zones).map(|z| format!("{pool}-z{z}")).collect();
        Self {
            cluster: Arc::clone(&env.cluster),
            pool,
            names,
        }
    }

    fn zone(&self, node: &str) -> String {
        format!("{node}-zone")
    }

    /// Creates (or re-creates) one node, as `e2e/cluster/fake-nodes` writes them.
    async fn create(&self, admin: &Client, name: &str) -> anyhow::Result<()> {
        let node = json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                "labels": {
                    "type": "kwok",
                    "kubernetes.io/arch": "amd64",
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/hostname": name,
                    PRIVATE_ZONE: self.zone(name),
                    PRIVATE_POOL: self.pool,
                    RACK: format!("{name}-rack"),
                    "nvidia.com/gpu.present": "true",
                    "nvidia.com/gpu.count": "8",
                },
            },
            "spec": {"taints": [{"key": PRIVATE_POOL, "value": self.pool, "effect": "NoSchedule"}]},
            "status": {
                "capacity": {"cpu": "64", "memory": "512Gi", "ephemeral-storage": "1Ti", "pods": "110", "nvidia.com/gpu": "8"},
                "allocatable": {"cpu": "64", "memory": "512Gi", "ephemeral-storage": "1Ti", "pods": "110", "nvidia.com/gpu": "8"},
                "nodeInfo": {"architecture": "amd64", "operatingSystem": "linux", "kubeletVersion": "fake"},
            },
        });
        let nodes = Api::<Node>::all(admin.clone());
        nodes
            .patch(
                name,
                &PatchParams::apply("slipway-e2e").force(),
                &Patch::Apply(&node),
            )
            .await
            .with_context(|| format!("creating node {name}"))?;
        wait::for_object(
            &nodes,
            name,
            &format!("node {name} Ready"),
            CONVERGE,
            |n: Option<&Node>| {
                n.and_then(|n| n.status.as_ref()?.conditions.clone())
                    .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
            },
        )
        .await?;
        Ok(())
    }

    /// The pod template fields that confine an InferenceService to these nodes.
    fn pod_template(&self) -> Value {
        json!({
            "nodeSelector": {PRIVATE_POOL: self.pool},
            "tolerations": [{"key": PRIVATE_POOL, "operator": "Equal", "value": self.pool, "effect": "NoSchedule"}],
        })
    }
}

impl Drop for PrivateNodes {
    fn drop(&mut self) {
        let mut args = vec!["delete", "node", "--ignore-not-found", "--wait=false"];
        args.extend(self.names.iter().map(String::as_str));
        if let Err(error) = self.cluster.kubectl(&args, Duration::from_secs(60)) {
            tracing::warn!(%error, nodes = ?self.names, "could not delete the test's private nodes");
        }
    }
}

/// kwok manages only nodes annotated `kwok.x-k8s.io/node=fake` (e2e/cluster/up) and
/// resets any non-Ready node it manages to Ready. Removing the annotation takes the
/// node out of its hands first; then Ready=False, written through the status
/// subresource as a kubelet would, stays.
async fn take_from_kwok(nodes: &Api<Node>, name: &str) -> anyhow::Result<()> {
    nodes
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {KWOK_NODE: null}}})),
        )
        .await
        .with_context(|| format!("removing {KWOK_NODE} from node {name}"))?;
    let now = k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string();
    nodes
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Strategic(json!({"status": {"conditions": [{
                "type": "Ready", "status": "False", "reason": "ZoneLost",
                "message": "e2e: the node's zone is lost",
                "lastHeartbeatTime": now, "lastTransitionTime": now,
            }]}})),
        )
        .await
        .with_context(|| format!("making node {name} NotReady"))?;
    Ok(())
}

/// Hands a node back to kwok and waits until it is Ready (kwok's node-initialize
/// stage resets it; the status patch makes that immediate).
async fn give_back_to_kwok(nodes: &Api<Node>, name: &str) -> anyhow::Result<()> {
    nodes
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {KWOK_NODE: "fake"}}})),
        )
        .await
        .with_context(|| format!("restoring {KWOK_NODE} on node {name}"))?;
    let now = k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string();
    nodes
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Strategic(json!({"status": {"conditions": [{
                "type": "Ready", "status": "True", "reason": "KubeletReady",
                "message": "e2e: the node's zone is back",
                "lastHeartbeatTime": now, "lastTransitionTime": now,
            }]}})),
        )
        .await
        .with_context(|| format!("making node {name} Ready"))?;
    wait::for_object(
        nodes,
        name,
        &format!("node {name} Ready again"),
        CONVERGE,
        |n: Option<&Node>| n.is_some_and(node_ready),
    )
    .await?;
    Ok(())
}

fn node_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The annotation kwok selects the nodes it manages by.
const KWOK_NODE: &str = "kwok.x-k8s.io/node";

/// The `FaultTolerant` condition's (status, reason, message).
fn fault_tolerant(o: &DynamicObject) -> Option<(String, String, String)> {
    let c = o.data["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "FaultTolerant")?;
    let text = |k: &str| c[k].as_str().unwrap_or_default().to_owned();
    Some((text("status"), text("reason"), text("message")))
}

/// Waits until the namespace holds `count` events with `reason` (the recorder writes
/// them after the status that caused them).
async fn wait_events(setup: &Setup, reason: &str, count: usize) -> anyhow::Result<()> {
    let events = Api::<Event>::namespaced(setup.admin.clone(), setup.ns());
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let last = Arc::clone(&seen);
    wait::poll(
        &format!("{count} {reason} event(s)"),
        CONVERGE,
        || {
            let (events, seen) = (events.clone(), Arc::clone(&seen));
            async move {
                // A repeated event is one object with a series count (kube's
                // Recorder), so occurrences are counted, not objects.
                let reasons: Vec<(String, i32)> = events
                    .list(&ListParams::default())
                    .await?
                    .items
                    .into_iter()
                    .filter_map(|e| {
                        let times = e.series.and_then(|s| s.count).or(e.count).unwrap_or(1);
                        Some((e.reason?, times))
                    })
                    .collect();
                let times: i32 = reasons
                    .iter()
                    .filter(|(r, _)| r == reason)
                    .map(|(_, n)| n)
                    .sum();
                let found = usize::try_from(times).is_ok_and(|n| n >= count);
                if let Ok(mut text) = seen.lock() {
                    *text = reasons;
                }
                Ok(found.then_some(()))
            }
        },
        || {
            format!(
                "event reasons: {:?}",
                last.lock().map(|t| t.clone()).unwrap_or_default()
            )
        },
    )
    .await?;
    Ok(())
}

async fn losing_a_zone_is_reported_and_recovered(env: Arc<Env>) -> anyhow::Result<()> {
    let setup = setup(&env).await?;
    let nodes = PrivateNodes::new(&env, setup.ns(), 3);
    for name in &nodes.names {
        nodes.create(&setup.admin, name).await?;
    }
    let _operator = Operator::start(&env, &setup.identity, setup.ns(), "op-a")?;
    // One 8-GPU group per node, so each zone holds exactly one group and a group
    // displaced by a lost zone has nowhere else to go.
    let mut isvc = gpu_service(setup.ns(), "zl", 8, 1)?;
    // N_healthy = ceil(2 / 1) = 2; N_provisioned = ceil(2 / (1 − 0.3)) = 3.
    isvc["spec"]["capacity"] = json!({
        "demand": {"static": 2}, "replicaGoodput": 1, "minReplicas": 1,
        "faultDomain": {"topologyKey": PRIVATE_ZONE, "fLoss": 0.3},
    });
    isvc["spec"]["podTemplate"] = nodes.pod_template();
    setup.apply(&isvc).await?;
    setup.wait_ready("zl", 3).await?;
    let tolerant = |o: Option<&DynamicObject>| {
        o.and_then(fault_tolerant)
            .is_some_and(|(status, _, _)| status == "True")
    };
    wait::for_object(&setup.isvcs(), "zl", "zl FaultTolerant", CONVERGE, tolerant).await?;
    let pods = setup.wait_pods(&pod_names("zl", 3, 1)).await?;
    let placed: BTreeSet<String> = pods
        .iter()
        .filter_map(|p| p.spec.as_ref()?.node_name.clone())
        .collect();
    ensure!(
        placed == nodes.names.iter().cloned().collect(),
        "groups are not one per private node: {placed:?}"
    );

    // Lose the first zone: its only node goes NotReady (and stays so, see
    // `take_from_kwok`), so the operator still sees the zone, with no Ready node.
    let lost = nodes.names[0].clone();
    let node_api = Api::<Node>::all(setup.admin.clone());
    take_from_kwok(&node_api, &lost).await?;
    let survivors: Vec<String> = nodes.names[1..].iter().map(|n| nodes.zone(n)).collect();
    let lost_zone = nodes.zone(&lost);
    let isvc = wait::for_object(
        &setup.isvcs(),
        "zl",
        "zl not FaultTolerant after losing a zone",
        CONVERGE,
        |o: Option<&DynamicObject>| {
            o.and_then(fault_tolerant)
                .is_some_and(|(status, _, _)| status == "False")
        },
    )
    .await?;
    let (_, reason, message) = fault_tolerant(&isvc).context("no FaultTolerant condition")?;
    // The lost zone is named as lost; of the two groups left, one per surviving zone,
    // losing either leaves 1 of the 2 needed.
    let named = survivors
        .iter()
        .find(|zone| message.contains(&format!("losing {PRIVATE_ZONE}={zone} ")));
    ensure!(
        reason == "WorstDomainLossTooLarge"
            && message.starts_with(&format!("{PRIVATE_ZONE}={lost_zone} has no Ready node; "))
            && named.is_some()
            && message.contains("(1 of 2 ready groups) leaves 1, 2 needed: 1 short"),
        "FaultTolerant does not name the lost zone, then the worst surviving zone with the counts left: {reason}: {message}"
    );
    // Still NotReady: kwok did not reset it behind the test's back.
    let node = node_api.get(&lost).await?;
    ensure!(
        !node_ready(&node),
        "node {lost} became Ready again while out of kwok's hands"
    );
    wait_events(&setup, "DomainLossNotSurvivable", 1).await?;

    // Capacity comes back: the node is handed back to kwok and made Ready.
    give_back_to_kwok(&node_api, &lost).await?;
    let isvc = wait::for_object(
        &setup.isvcs(),
        "zl",
        "zl FaultTolerant again",
        CONVERGE,
        tolerant,
    )
    .await?;
    let (_, reason, message) = fault_tolerant(&isvc).context("no FaultTolerant condition")?;
    ensure!(
        reason == "SurvivesWorstDomainLoss"
            && !message.contains("no Ready node")
            && message.contains("(1 of 3 ready groups) leaves 2, 2 needed"),
        "FaultTolerant after recovery: {reason}: {message}"
    );
    setup.wait_ready("zl", 3).await?;
    // Once when the groups first became ready, once now.
    wait_events(&setup, "DomainLossSurvivable", 2).await?;
    setup.ensure_no_forbidden()
}

// -------------------------------------------------------------------------------------
// The router (issue 22)

/// Waits until `instance`'s router Deployment has its 2 pods updated and available,
/// and returns it.
async fn wait_router(setup: &Setup, instance: &str) -> anyhow::Result<Deployment> {
    let name = format!("{instance}-router");
    Ok(wait::for_object(
        &Api::<Deployment>::namespaced(setup.admin.clone(), setup.ns()),
        &name,
        &format!("{name} with 2 available pods"),
        CONVERGE,
        |d: Option<&Deployment>| {
            d.and_then(|d| d.status.as_ref()).is_some_and(|s| {
                s.available_replicas == Some(2)
                    && s.updated_replicas == Some(2)
                    && s.replicas == Some(2)
            })
        },
    )
    .await?)
}

/// The pod names of the ready endpoints of Service `service`.
async fn ready_endpoint_pods(
    setup: &Setup,
    service: &str,
) -> Result<BTreeSet<String>, kube::Error> {
    Ok(
        Api::<EndpointSlice>::namespaced(setup.admin.clone(), setup.ns())
            .list(&ListParams::default().labels(&format!("kubernetes.io/service-name={service}")))
            .await?
            .items
            .into_iter()
            .flat_map(|slice| slice.endpoints.into_iter().flatten())
            .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true))
            .filter_map(|e| e.target_ref?.name)
            .collect(),
    )
}

/// The operator creates the router's Deployment, ServiceAccount, Role, RoleBinding and
/// PDB under its own identity: no 403, so the ClusterRole needs neither `escalate` nor
/// `bind` to grant the router its reads. The router pods are spread over zones; the
/// client Service's endpoints are the router pods and only they, the release Service's
/// the engine leaders; the Role reads, in this namespace, only this InferenceService
/// and EndpointSlices.
async fn the_router_fronts_the_engines_under_a_read_only_role(env: Arc<Env>) -> anyhow::Result<()> {
    let setup = setup(&env).await?;
    let _operator = Operator::start(&env, &setup.identity, setup.ns(), "op-a")?;
    setup.apply(&cpu_sample(setup.ns())?).await?;
    let isvc = setup.wait_ready("smollm2", 5).await?;
    let engines = setup.wait_pods(&pod_names("smollm2", 5, 1)).await?;
    let deployment = wait_router(&setup, "smollm2").await?;
    let template = deployment
        .spec
        .template
        .spec
        .context("the router Deployment has a pod template")?;
    ensure!(
        template.service_account_name.as_deref() == Some("smollm2-router"),
        "router pods run as {:?}",
        template.service_account_name
    );

    // Router pods: two, in two zones, Ready (KWOK's), and all the client Service has.
    let routers = setup
        .pods()
        .list(
            &ListParams::default()
                .labels("app.kubernetes.io/instance=smollm2,app.kubernetes.io/component=router"),
        )
        .await?
        .items;
    let nodes = node_labels(&setup.admin).await?;
    let zones: BTreeSet<String> = routers
        .iter()
        .filter_map(|p| {
            nodes
                .get(p.spec.as_ref()?.node_name.as_ref()?)?
                .get(ZONE)
                .cloned()
        })
        .collect();
    ensure!(
        routers.len() == 2 && zones.len() == 2,
        "router pods {:?} in zones {zones:?}",
        routers
            .iter()
            .map(ResourceExt::name_any)
            .collect::<Vec<_>>()
    );
    let router_names: BTreeSet<String> = routers.iter().map(ResourceExt::name_any).collect();
    let admin = setup.admin.clone();
    let ns = setup.ns().to_owned();
    let want = router_names.clone();
    let setup_ref = &setup;
    wait::poll(
        "the client Service's ready endpoints are the router pods",
        CONVERGE,
        move || {
            let want = want.clone();
            async move {
                Ok((ready_endpoint_pods(setup_ref, "smollm2").await? == want).then_some(()))
            }
        },
        || "other endpoints".to_owned(),
    )
    .await?;
    let stable = isvc.data["status"]["stableRelease"]
        .as_str()
        .context("status.stableRelease")?
        .to_owned();
    let leaders: BTreeSet<String> = engines.iter().map(ResourceExt::name_any).collect();
    let release_service = format!("smollm2-{stable}");
    let want = leaders.clone();
    wait::poll(
        "the release Service's ready endpoints are the engine leaders",
        CONVERGE,
        move || {
            let want = want.clone();
            let release_service = release_service.clone();
            async move {
                Ok((ready_endpoint_pods(setup_ref, &release_service).await? == want).then_some(()))
            }
        },
        || "other endpoints".to_owned(),
    )
    .await?;

    // The Role: reads only, of this InferenceService by name and of EndpointSlices.
    let role = Api::<Role>::namespaced(admin.clone(), &ns)
        .get("smollm2-router")
        .await?;
    let rules = role.rules.unwrap_or_default();
    ensure!(rules.len() == 2, "rules: {rules:?}");
    for rule in &rules {
        ensure!(
            rule.verbs
                .iter()
                .all(|v| ["get", "list", "watch"].contains(&v.as_str())),
            "the router's Role writes: {rule:?}"
        );
    }
    ensure!(
        rules.iter().any(
            |r| r.resources.as_deref() == Some(&["inferenceservices".to_owned()][..])
                && r.resource_names.as_deref() == Some(&["smollm2".to_owned()][..])
        ),
        "the Role does not name this InferenceService alone: {rules:?}"
    );
    let binding = Api::<RoleBinding>::namespaced(admin.clone(), &ns)
        .get("smollm2-router")
        .await?;
    ensure!(
        binding.role_ref.kind == "Role"
            && binding
                .subjects
                .unwrap_or_default()
                .iter()
                .all(|s| s.kind == "ServiceAccount"
                    && s.name == "smollm2-router"
                    && s.namespace.as_deref() == Some(ns.as_str())),
        "the RoleBinding binds something else"
    );
    let pdb = Api::<PodDisruptionBudget>::namespaced(admin, &ns)
        .get("smollm2-router")
        .await?;
    ensure!(
        pdb.spec.and_then(|s| s.min_available)
            == Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(1)),
        "the router PDB keeps not one pod"
    );
    setup.ensure_no_forbidden()
}

const HTTP_ROUTE_CRD: &str = "httproutes.gateway.networking.k8s.io";

/// The upstream Gateway API CRD (`sigs.k8s.io/gateway-api`'s standard channel, from
/// `make e2e`) judges the operator's HTTPRoute. Without the CRD the rest of the
/// InferenceService reconciles and `HTTPRouteReady=False` (GatewayAPIMissing) with a
/// Warning event says why; once it is installed, the operator's server-side apply of
/// the route is accepted (its parentRefs pass the CRD's own CEL rules), it points at
/// the router Service on port 80 and the condition turns True. The CRD is removed
/// first, so a reused cluster starts from the same state.
async fn an_httproute_to_the_router_is_accepted_by_the_gateway_api_crd(
    env: Arc<Env>,
) -> anyhow::Result<()> {
    let crd = std::env::var("SLIPWAY_GATEWAY_API_HTTPROUTE_CRD").context(
        "SLIPWAY_GATEWAY_API_HTTPROUTE_CRD is not set; run the e2e tests through `make e2e`, \
         which takes it from the sigs.k8s.io/gateway-api module (make gateway-api-crd)",
    )?;
    ensure!(
        std::path::Path::new(&crd).is_file(),
        "SLIPWAY_GATEWAY_API_HTTPROUTE_CRD={crd} is not a file"
    );
    let setup = setup(&env).await?;
    let kubectl_timeout = Duration::from_secs(120);
    env.cluster.kubectl(
        &[
            "delete",
            "crd",
            HTTP_ROUTE_CRD,
            "--ignore-not-found",
            "--wait=true",
            "--timeout=90s",
        ],
        kubectl_timeout,
    )?;
    let _operator = Operator::start(&env, &setup.identity, setup.ns(), "op-a")?;
    let mut sample = cpu_sample(setup.ns())?;
    // One Gateway through two listeners, one in another namespace: the CRD's CEL rules
    // on parentRefs are exercised, not just its types.
    sample["spec"]["router"] = json!({"httpRoute": {"parentRefs": [
        {"name": "public", "sectionName": "http"},
        {"name": "public", "sectionName": "https"},
        {"name": "internal", "namespace": "gateways"},
    ]}});
    setup.apply(&sample).await?;
    setup.wait_ready("smollm2", 5).await?;
    wait_router(&setup, "smollm2").await?;
    wait_route_condition(&setup, "False", "GatewayAPIMissing").await?;
    wait_events(&setup, "GatewayAPIMissing", 1).await?;

    env.cluster.kubectl(
        &[
            "apply",
            "--server-side",
            "--force-conflicts",
            "--field-manager",
            slipway_e2e::rbac::FIELD_MANAGER,
            "-f",
            &crd,
        ],
        kubectl_timeout,
    )?;
    env.cluster
        .wait_established(&[&format!("crd/{HTTP_ROUTE_CRD}")], Duration::from_secs(60))?;
    // The operator watches no HTTPRoutes (a cluster without the CRD would fail the
    // watch): a change to the InferenceService makes it look again, as a resync would.
    setup
        .isvcs()
        .patch(
            "smollm2",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"metadata": {"annotations": {"e2e.slipway.dev/nudge": "crd-installed"}}}),
            ),
        )
        .await?;
    wait_route_condition(&setup, "True", "Applied").await?;

    let routes = Api::<DynamicObject>::namespaced_with(
        setup.admin.clone(),
        setup.ns(),
        &ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("gateway.networking.k8s.io", "v1", "HTTPRoute"),
            "httproutes",
        ),
    );
    let route = routes.get("smollm2").await?;
    let spec = &route.data["spec"];
    ensure!(
        spec["parentRefs"].as_array().map(Vec::len) == Some(3)
            && spec["rules"][0]["backendRefs"][0]["name"] == "smollm2"
            && spec["rules"][0]["backendRefs"][0]["port"] == 80,
        "the HTTPRoute is not the router's: {spec:#}"
    );
    ensure!(
        route
            .metadata
            .owner_references
            .unwrap_or_default()
            .iter()
            .any(|o| o.kind == "InferenceService" && o.name == "smollm2"),
        "the HTTPRoute is not owned by the InferenceService"
    );

    // Asked no more, the route is deleted by label.
    sample["spec"]["router"] = json!({});
    setup.apply(&sample).await?;
    wait_route_condition(&setup, "False", "NotRequested").await?;
    let gone = routes.clone();
    wait::poll(
        "the HTTPRoute deleted",
        CONVERGE,
        move || {
            let gone = gone.clone();
            async move { Ok(gone.get_opt("smollm2").await?.is_none().then_some(())) }
        },
        || "the HTTPRoute remains".to_owned(),
    )
    .await?;
    setup.ensure_no_forbidden()
}

/// Waits until `HTTPRouteReady` has `status` and `reason`.
async fn wait_route_condition(setup: &Setup, status: &str, reason: &str) -> anyhow::Result<()> {
    let (want_status, want_reason) = (status.to_owned(), reason.to_owned());
    wait::for_object(
        &setup.isvcs(),
        "smollm2",
        &format!("HTTPRouteReady={status} ({reason})"),
        CONVERGE,
        move |o: Option<&DynamicObject>| {
            o.is_some_and(|o| {
                o.data["status"]["conditions"].as_array().is_some_and(|c| {
                    c.iter().any(|c| {
                        c["type"] == "HTTPRouteReady"
                            && c["status"] == want_status.as_str()
                            && c["reason"] == want_reason.as_str()
                    })
                })
            })
        },
    )
    .await?;
    Ok(())
}
