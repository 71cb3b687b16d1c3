//! End-to-end tests on a real control plane (see `e2e/README.md`).
//!
//! This binary has its own harness (libtest-mimic, so filters, `--list` and
//! `--test-threads` work as with `cargo test`): `main` brings the cluster up
//! once, runs every selected test against it — each in its own namespace and
//! tokio runtime — and then drops the [`ClusterGuard`], which stops every
//! process it started by PID, whatever the tests did. A cluster that cannot be
//! built or started fails the run; it is never a skip.

mod control_plane;
mod crd_validation;
mod packaging;
mod rbac;
mod scheduling;
mod support;

use std::future::Future;
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::Arc;

use libtest_mimic::{Arguments, Failed, Trial};
use slipway_e2e::{Cluster, ClusterGuard};

type TestFuture = Pin<Box<dyn Future<Output = anyhow::Result<()>> + Send>>;
type TestFn = fn(support::TestContext) -> TestFuture;

macro_rules! tests {
    ($($module:ident :: $test:ident),* $(,)?) => {
        vec![$((
            concat!(stringify!($module), "::", stringify!($test)),
            (|context| Box::pin($module::$test(context))) as TestFn,
        )),*]
    };
}

fn all_tests() -> Vec<(&'static str, TestFn)> {
    tests![
        crd_validation::crds_apply_server_side_and_become_established,
        crd_validation::invalid_objects_are_rejected_with_their_rule_message,
        crd_validation::every_sample_is_accepted,
        crd_validation::changing_the_model_requires_a_new_kv_namespace,
        scheduling::gpu_pod_is_scheduled_on_a_fake_gpu_node_and_becomes_ready,
        scheduling::pod_needing_more_gpus_than_any_node_stays_pending,
        scheduling::fake_nodes_span_three_zones_with_nvlink_domains,
        control_plane::every_component_listens_on_loopback_only,
        rbac::operator_identity_is_denied_outside_its_role_and_audited,
        packaging::chart_passes_helm_lint_strict,
        packaging::kustomization_is_accepted_by_a_server_side_dry_run,
        packaging::chart_is_accepted_by_a_server_side_dry_run,
        packaging::chart_renders_the_kustomizations_objects,
        packaging::chart_values_reach_the_operator_deployment,
        packaging::monitoring_renders_manifests_monitoring,
    ]
}

fn main() -> ExitCode {
    let _logs = slipway_e2e::test_logs();
    let arguments = Arguments::from_args();
    let tests = all_tests();

    let listing_only = arguments.list;
    let selected = tests
        .iter()
        .any(|(name, _)| !arguments.is_filtered_out(&Trial::test(*name, || Ok(()))));
    if listing_only || !selected {
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
                "error: the e2e control plane is not available, so every e2e test fails: {error}"
            );
            return ExitCode::FAILURE;
        }
    };
    let cluster = Arc::new(guard.cluster().clone());
    let trials = tests
        .into_iter()
        .map(|(name, test)| {
            let cluster = Arc::clone(&cluster);
            Trial::test(name, move || run_one(name, test, cluster))
        })
        .collect();
    let conclusion = libtest_mimic::run(&arguments, trials);
    // Explicit so the order is obvious: stop the cluster before reporting.
    drop(guard);
    conclusion.exit_code()
}

fn run_one(name: &'static str, test: TestFn, cluster: Arc<Cluster>) -> Result<(), Failed> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|error| Failed::from(format!("could not build a tokio runtime: {error}")))?;
    let context = support::TestContext::new(name, cluster);
    runtime
        .block_on(test(context))
        // `{:#}`: the whole cause chain on one line, without a backtrace.
        .map_err(|error| Failed::from(format!("{error:#}")))
}
