//! A group's place reaches each engine process as the contract's group flags, read
//! back here with the engine's own parser ([`EngineCommand::parse_args`]): a CPU
//! group is one pod per rank, numbered `stage × tensor + tensor_rank`, each told the
//! group's shape, its rank and its leader's stable DNS name under the group's
//! headless Service; a CUDA pod holding several GPUs is told nothing (one process
//! cannot drive several ranks before the NCCL transport); and the user's
//! `release.engine.args` may not set any of the flags that place a pod.

mod common;

use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::{Value, json};
use slipway_api::InferenceService;
use slipway_contract::group::DEFAULT_RENDEZVOUS_TIMEOUT;
use slipway_contract::{EngineCommand, GROUP_PORT, GROUP_PORT_NAME, GroupArgs, ServeArgs};
use slipway_operator::observed::Observed;
use slipway_operator::plan::{Child, Plan, plan};

use common::{check_engine_contract, merge, sample_json};

fn now() -> Time {
    serde_json::from_value(json!("2026-01-01T00:00:00Z")).expect("a timestamp")
}

/// The CPU sample with `patch` merged into its spec, planned on an empty cluster
/// with one group.
fn plan_cpu(patch: &Value) -> (InferenceService, Plan) {
    let mut isvc = sample_json("smollm2-cpu").unwrap_or_else(|e| panic!("{e}"));
    merge(
        &mut isvc,
        &json!({"spec": {"capacity": {"demand": {"static": 0.5}, "minReplicas": 1, "faultDomain": {"fLoss": 0}}}}),
    );
    merge(&mut isvc, &json!({ "spec": patch }));
    let isvc: InferenceService = serde_json::from_value(isvc).expect("an InferenceService");
    let plan = plan(&isvc, &Observed::default(), &now());
    (isvc, plan)
}

fn pods(plan: &Plan) -> Vec<&Pod> {
    plan.apply
        .iter()
        .filter_map(|child| match child {
            Child::Pod(pod) => Some(pod.as_ref()),
            _ => None,
        })
        .collect()
}

/// The pod's engine command line as the engine reads it.
fn serve_of(pod: &Pod) -> ServeArgs {
    let args = pod
        .spec
        .as_ref()
        .and_then(|s| s.containers.first())
        .and_then(|c| c.args.clone())
        .unwrap_or_default();
    match EngineCommand::parse_args(&args) {
        Ok(EngineCommand::Serve(serve)) => serve,
        other => panic!("{args:?} is not serve: {other:?}"),
    }
}

fn name(pod: &Pod) -> &str {
    pod.metadata.name.as_deref().unwrap_or_default()
}

/// (pod name, the group flags its engine reads) of every pod of group 0.
fn groups(patch: &Value) -> Vec<(String, GroupArgs)> {
    let (isvc, plan) = plan_cpu(patch);
    assert_eq!(plan.invalid, None);
    pods(&plan)
        .into_iter()
        .map(|pod| {
            if let Err(e) = check_engine_contract(pod, &isvc.spec) {
                panic!("{e}");
            }
            let group = serve_of(pod).group;
            assert_eq!(group.validate(), Ok(()), "{}", name(pod));
            (name(pod).to_owned(), group)
        })
        .collect()
}

fn leader(tensor: u32, pipeline: u32, rank: u32) -> GroupArgs {
    GroupArgs {
        tensor_parallel: tensor,
        pipeline_parallel: pipeline,
        rank,
        leader_address: format!("smollm2-g0-r0.smollm2-g0.ml.svc:{GROUP_PORT}")
            .parse()
            .ok(),
        ..GroupArgs::default()
    }
}

#[test]
fn a_single_process_cpu_group_is_told_nothing() {
    let pods = groups(&json!({}));
    assert_eq!(
        pods,
        vec![("smollm2-g0-r0".to_owned(), GroupArgs::default())]
    );
}

#[test]
fn cpu_pipeline_2_is_two_pods_one_rank_each() {
    let pods = groups(&json!({"parallelism": {"pipeline": 2}}));
    assert_eq!(
        pods,
        vec![
            ("smollm2-g0-r0".to_owned(), leader(1, 2, 0)),
            ("smollm2-g0-r1".to_owned(), leader(1, 2, 1)),
        ]
    );
}

#[test]
fn cpu_tensor_3_is_three_pods_one_rank_each() {
    let pods = groups(&json!({"parallelism": {"tensor": 3}}));
    let want: Vec<_> = (0..3)
        .map(|r| (format!("smollm2-g0-r{r}"), leader(3, 1, r)))
        .collect();
    assert_eq!(pods, want);
}

#[test]
fn cpu_tensor_3_by_pipeline_2_is_six_pods_ranked_stage_times_tensor_plus_tensor_rank() {
    let pods = groups(&json!({"parallelism": {"tensor": 3, "pipeline": 2}}));
    assert_eq!(pods.len(), 6);
    for stage in 0..2 {
        for tensor_rank in 0..3 {
            let rank = stage * 3 + tensor_rank;
            assert_eq!(
                pods[rank as usize],
                (format!("smollm2-g0-r{rank}"), leader(3, 2, rank))
            );
        }
    }
}

#[test]
fn gpus_per_node_places_no_cpu_group_but_refuses_a_cuda_group_that_does_not_fill_its_nodes() {
    // Tensor 12 on "8-GPU nodes": twelve CPU pods of one rank each.
    let shape = json!({"tensor": 12, "pipeline": 1, "gpusPerNode": 8});
    let cpu = groups(&json!({ "parallelism": shape }));
    let want: Vec<_> = (0..12)
        .map(|r| (format!("smollm2-g0-r{r}"), leader(12, 1, r)))
        .collect();
    assert_eq!(cpu, want);
    // On CUDA the same shape would leave a node part-filled: refused, as the CRD does.
    let (_, plan) = plan_cpu(&json!({
        "parallelism": shape,
        "release": {"engine": {"device": "CUDA"}},
    }));
    let invalid = plan.invalid.as_ref().map(|e| (e.reason(), e.to_string()));
    assert!(
        invalid.as_ref().is_some_and(|(reason, message)| {
            *reason == "ParallelismDoesNotFitNode"
                && message.contains("must be a multiple of gpusPerNode")
        }),
        "{invalid:?}"
    );
    assert!(pods(&plan).is_empty());
}

#[test]
fn the_leader_declares_its_group_port_and_the_group_service_publishes_unready_pods() {
    let (_, plan) = plan_cpu(&json!({"parallelism": {"pipeline": 2}}));
    let ports = |pod: &Pod| -> Vec<(String, i32)> {
        pod.spec
            .as_ref()
            .and_then(|s| s.containers.first()?.ports.clone())
            .unwrap_or_default()
            .into_iter()
            .map(|p| (p.name.unwrap_or_default(), p.container_port))
            .collect()
    };
    let pods = pods(&plan);
    assert_eq!(
        ports(pods[0]),
        vec![
            ("http".to_owned(), 8000),
            (GROUP_PORT_NAME.to_owned(), i32::from(GROUP_PORT))
        ]
    );
    assert_eq!(ports(pods[1]), vec![("http".to_owned(), 8000)]);
    for pod in pods {
        let spec = pod.spec.as_ref().expect("a spec");
        assert_eq!(spec.hostname.as_deref(), Some(name(pod)));
        assert_eq!(spec.subdomain.as_deref(), Some("smollm2-g0"));
    }
    let service: &Service = plan
        .apply
        .iter()
        .find_map(|child| match child {
            Child::Service(s) if s.metadata.name.as_deref() == Some("smollm2-g0") => Some(&**s),
            _ => None,
        })
        .expect("the group's headless Service");
    let spec = service.spec.as_ref().expect("a spec");
    assert_eq!(spec.cluster_ip.as_deref(), Some("None"));
    // Workers resolve the leader before it is ready: it is ready only once they joined.
    assert_eq!(spec.publish_not_ready_addresses, Some(true));
}

#[test]
fn the_users_timeouts_reach_every_rank() {
    let pods = groups(&json!({
        "parallelism": {"pipeline": 2},
        "release": {"engine": {"args": ["--rendezvous-timeout-ms=600000"]}},
    }));
    for (pod, group) in &pods {
        assert_eq!(group.rendezvous_timeout.as_secs(), 600, "{pod}");
        assert_ne!(group.rendezvous_timeout, DEFAULT_RENDEZVOUS_TIMEOUT);
    }
    assert_eq!(pods[1].1.rank, 1);
}

#[test]
fn cuda_pods_of_several_gpus_get_no_group_flags_and_one_gpu_pods_do() {
    let cuda = |parallelism: Value| {
        let (isvc, plan) = plan_cpu(&json!({
            "parallelism": parallelism,
            "release": {"engine": {"device": "CUDA"}},
        }));
        assert_eq!(plan.invalid, None);
        pods(&plan)
            .into_iter()
            .map(|pod| {
                if let Err(e) = check_engine_contract(pod, &isvc.spec) {
                    panic!("{e}");
                }
                serve_of(pod).group
            })
            .collect::<Vec<_>>()
    };
    // Two pods of 8 GPUs (tp8 × pp2) and one pod of 8 (tp4 × pp2): unchanged.
    assert_eq!(
        cuda(json!({"tensor": 8, "pipeline": 2, "gpusPerNode": 8})),
        vec![GroupArgs::default(), GroupArgs::default()]
    );
    assert_eq!(
        cuda(json!({"tensor": 4, "pipeline": 2, "gpusPerNode": 8})),
        vec![GroupArgs::default()]
    );
    // One GPU per node: each pod's process is one rank.
    assert_eq!(
        cuda(json!({"tensor": 1, "pipeline": 2, "gpusPerNode": 1})),
        vec![leader(1, 2, 0), leader(1, 2, 1)]
    );
}

#[test]
fn the_users_group_flags_are_refused_whatever_their_value() {
    for (args, flags) in [
        (vec!["--tensor-parallel=2"], "--tensor-parallel"),
        // The operator's own value, still refused: it is set per pod after the merge.
        (vec!["--pipeline-parallel", "2"], "--pipeline-parallel"),
        (vec!["--rank=0"], "--rank"),
        (
            vec!["--leader-address=x:1", "--max-num-seqs=8"],
            "--leader-address",
        ),
        (
            vec!["--rank=1", "--port=1", "--tensor-parallel=1"],
            "--port, --tensor-parallel, --rank",
        ),
    ] {
        let (_, plan) = plan_cpu(&json!({
            "parallelism": {"pipeline": 2},
            "release": {"engine": {"args": args}},
        }));
        let error = plan
            .invalid
            .clone()
            .unwrap_or_else(|| panic!("{args:?} accepted"));
        assert_eq!(error.reason(), "EngineArgsOverrideOperator", "{args:?}");
        assert!(
            error
                .to_string()
                .starts_with(&format!("release.engine.args must not set {flags}:")),
            "{args:?}: {error}"
        );
        assert!(pods(&plan).is_empty());
    }
    let (_, plan) = plan_cpu(&json!({"release": {"engine": {"args": ["--rank=x"]}}}));
    let error = plan.invalid.expect("a bad value");
    assert_eq!(error.reason(), "EngineArgsRejected");
}
