//! Tests on the real nodes (see `e2e/README.md`, "Real nodes"): the engine image built
//! without Docker, run by a real kubelet and containerd, probed on `/ready`, drained
//! through preStop and SIGTERM; then the operator's own pods on those nodes.
//!
//! Own harness (libtest-mimic), like `tests/e2e/main.rs`: the cluster comes up once
//! (real nodes included), each test gets a namespace labelled
//! `pod-security.kubernetes.io/enforce=restricted` (so the real PodSecurity admission
//! checks every pod) with a claim on the model. Tests run one at a time: they share two
//! small nodes, and one of them stops a kubelet. Every wait is bounded; nothing
//! sleeps to synchronise.

mod dns;
mod groups;
mod images;
mod network;
mod operator;
mod pods;
mod support;

use std::future::Future;
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::Arc;

use libtest_mimic::{Arguments, Failed, Trial};
use slipway_e2e::{ClusterGuard, crd};

use crate::support::Env;

type TestFuture = Pin<Box<dyn Future<Output = anyhow::Result<()>> + Send>>;
type TestFn = fn(Arc<Env>) -> TestFuture;

macro_rules! tests {
    ($($module:ident :: $test:ident),* $(,)?) => {
        vec![$((
            concat!(stringify!($module), "::", stringify!($test)),
            (|env| Box::pin($module::$test(env))) as TestFn,
        )),*]
    };
}

fn all_tests() -> Vec<(&'static str, TestFn)> {
    tests![
        images::imported_images_match_the_dockerfile,
        network::node_processes_listen_only_inside_their_namespace,
        dns::a_pod_on_each_node_resolves_cluster_names_only,
        pods::a_hand_written_engine_pod_is_probed_ready_and_drains_on_each_real_node,
        operator::cpu_sample_is_ready_on_real_nodes_and_answers,
        operator::drain_under_load_finishes_every_stream,
        operator::a_slow_canary_is_rolled_back_then_a_good_bundle_is_promoted,
        operator::the_router_sends_a_ten_percent_canary_ten_percent_of_requests,
        operator::a_killed_engine_recreates_its_group,
        groups::a_pipeline_group_spans_two_nodes_and_is_recreated_whole,
        operator::a_stopped_kubelet_loses_its_zone_and_recovers,
        operator::measured_demand_follows_a_ramp,
    ]
}

fn main() -> ExitCode {
    let _logs = slipway_e2e::test_logs();
    let mut arguments = Arguments::from_args();
    // The tests share two small nodes and one stops a kubelet: one at a time.
    arguments.test_threads = Some(1);
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
    let guard = match ClusterGuard::up() {
        Ok(guard) => guard,
        Err(error) => {
            eprintln!(
                "error: the e2e cluster with its real nodes is not available, so every real-node test fails: {error}"
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
