//! The operator binary reads the command line `slipway_contract::OperatorArgs` writes:
//! the real `slipway-operator` is run with `to_args()` of a value that sets every flag,
//! and gets past its parser to the point where it needs a cluster (there is none here,
//! so it stops there with the client's error). A misspelt flag is a usage error.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use slipway_contract::{LogArgs, OperatorArgs, exit, telemetry::LogFormat};

/// The operator with no way to reach a cluster: a kubeconfig that does not exist and no
/// in-cluster environment, so it fails at once after parsing its flags.
fn run_operator(args: &[String]) -> Output {
    let kubeconfig = Path::new(env!("CARGO_TARGET_TMPDIR")).join("no-such-kubeconfig");
    let mut child = Command::new(env!("CARGO_BIN_EXE_slipway-operator"))
        .args(args)
        .env("KUBECONFIG", &kubeconfig)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("KUBERNETES_SERVICE_PORT")
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting slipway-operator");
    // A bound, so a cluster found after all shows as a failure, not a hung test.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match child.try_wait().expect("waiting for slipway-operator") {
            Some(_) => break,
            None if Instant::now() > deadline => {
                let _ = child.kill();
                break;
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    child
        .wait_with_output()
        .expect("reading slipway-operator's output")
}

fn every_flag_set() -> OperatorArgs {
    OperatorArgs {
        metrics_addr: "127.0.0.1:0".parse().expect("an address"),
        lease_namespace: "team-a".to_owned(),
        lease_name: "cli-test".to_owned(),
        identity: Some("cli-test-0".to_owned()),
        namespace: Some("team-a".to_owned()),
        lease_duration: Duration::from_secs(6),
        lease_retry: Duration::from_secs(1),
        logs: LogArgs {
            log_format: Some(LogFormat::Text),
        },
        otlp_endpoint: Some("http://collector:4318".to_owned()),
        router_image: "registry.example/router:1".to_owned(),
    }
}

#[test]
fn the_operator_parses_what_operator_args_renders() {
    let output = run_operator(&every_flag_set().to_args());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        output.status.code(),
        Some(exit::FAILURE),
        "expected the cluster client's failure after parsing:\n{stderr}"
    );
    assert!(
        stderr.contains("building the Kubernetes client"),
        "the operator stopped before it needed a cluster:\n{stderr}"
    );
}

#[test]
fn the_operator_refuses_a_misspelt_flag_as_a_usage_error() {
    let mut args = every_flag_set().to_args();
    args.push("--lease-duration=15".to_owned());
    let output = run_operator(&args);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(exit::USAGE), "{stderr}");
    assert!(stderr.contains("--lease-duration"), "{stderr}");
}

#[test]
fn help_names_every_flag_operator_args_renders() {
    let output = run_operator(&["--help".to_owned()]);
    let help = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{help}");
    for arg in every_flag_set().to_args() {
        let (flag, _) = arg.split_once('=').expect("--flag=value");
        assert!(help.contains(flag), "--help does not name {flag}:\n{help}");
    }
}
