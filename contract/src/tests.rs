//! Every field survives `to_args` → the engine's parser, and the operator-facing
//! helpers behave as documented.

use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::time::Duration;

use proptest::prelude::*;

use super::*;

fn parse(args: Vec<String>) -> EngineCommand {
    match EngineCommand::parse_args(&args) {
        Ok(command) => command,
        Err(error) => panic!("{args:?} does not parse: {error}"),
    }
}

fn digest() -> impl Strategy<Value = Sha256Digest> {
    any::<[u8; 32]>().prop_map(Sha256Digest)
}

fn millis() -> impl Strategy<Value = Duration> {
    (0u64..10_000_000).prop_map(Duration::from_millis)
}

fn word() -> impl Strategy<Value = String> {
    // Leading '-' included: `--flag=value` must keep such values values.
    "-?[a-z0-9][a-z0-9.-]{0,20}"
}

fn serve_args() -> impl Strategy<Value = ServeArgs> {
    let identity = (
        "/[a-z]{1,8}/-?[a-z0-9.]{1,12}",
        proptest::option::of(digest()),
        any::<[u8; 4]>(),
        any::<u16>(),
        proptest::option::of(word()),
        word(),
        word(),
    );
    let limits = (
        millis(),
        millis(),
        1u32..=131_072,
        0usize..10_000,
        0usize..10_000,
        millis(),
        1usize..100_000,
    );
    let memory = (
        proptest::option::of(1usize..1 << 20),
        proptest::option::of(1u64..1 << 40),
        proptest::option::of(0.001f64..1e9),
        proptest::option::of(0.001f64..1e9),
        proptest::option::of(2usize..1 << 20),
        millis(),
        proptest::option::of(1u16..512),
        prop_oneof![
            Just(DeviceChoice::Cpu),
            Just(DeviceChoice::Cuda),
            Just(DeviceChoice::Auto)
        ],
        proptest::option::of(0usize..16),
    );
    let bundle = (
        proptest::option::of((
            "/[a-z]{1,8}/[a-z0-9.]{1,12}",
            proptest::option::of(digest()),
        )),
        // Templates are free text: quotes, newlines, leading dashes, '='.
        proptest::option::of("-?[ -~\n]{0,40}"),
        proptest::collection::btree_map(
            "[a-z][a-z0-9.-]{0,6}[a-z0-9]",
            ("/[a-z=]{1,12}", proptest::option::of(digest())),
            0..4,
        ),
    );
    (
        identity,
        limits,
        memory,
        bundle,
        telemetry_args(),
        group_args(),
    )
        .prop_map(
            |(
                (model, model_sha256, ip, port, served_model_name, release, kv_namespace),
                (
                    slo_ttft,
                    slo_tpot,
                    max_output_tokens,
                    max_num_seqs,
                    max_queue,
                    max_queue_wait,
                    max_batched_tokens,
                ),
                (
                    kv_blocks,
                    kv_memory,
                    tenant_rate,
                    tenant_burst,
                    max_model_len,
                    shutdown_timeout,
                    threads,
                    device,
                    gpu,
                ),
                (tokenizer, chat_template, adapters),
                telemetry,
                group,
            )| ServeArgs {
                model: PathBuf::from(model),
                model_sha256,
                tokenizer_sha256: tokenizer.as_ref().and_then(|(_, sha)| *sha),
                tokenizer: tokenizer.map(|(path, _)| PathBuf::from(path)),
                chat_template,
                lora: adapters
                    .iter()
                    .map(|(name, (path, _))| LoraModule {
                        name: name.clone(),
                        path: PathBuf::from(path),
                    })
                    .collect(),
                lora_sha256: adapters
                    .iter()
                    .filter_map(|(name, (_, sha))| {
                        sha.map(|sha256| NamedSha256 {
                            name: name.clone(),
                            sha256,
                        })
                    })
                    .collect(),
                host: IpAddr::from(ip),
                port,
                served_model_name,
                release,
                kv_namespace,
                slo_ttft,
                slo_tpot,
                max_output_tokens,
                max_num_seqs,
                max_queue,
                max_queue_wait,
                max_batched_tokens,
                // The two pool sizes exclude each other; the parser says so.
                kv_blocks: kv_memory.is_none().then_some(kv_blocks).flatten(),
                kv_memory,
                // A burst needs a rate.
                tenant_burst: tenant_rate.and(tenant_burst),
                tenant_rate,
                max_model_len,
                shutdown_timeout,
                threads,
                device,
                gpu,
                telemetry,
                group,
                #[cfg(feature = "fault-injection")]
                faults: FaultArgs {
                    inject_delay: Duration::from_millis(u64::from(port % 300)),
                    inject_error_rate: f64::from(port % 7) / 7.0,
                    inject_seed: u64::from(port),
                },
            },
        )
}

fn log_args() -> impl Strategy<Value = LogArgs> {
    proptest::option::of(prop_oneof![Just(LogFormat::Text), Just(LogFormat::Json)])
        .prop_map(|log_format| LogArgs { log_format })
}

fn group_args() -> impl Strategy<Value = GroupArgs> {
    // Any values the parser takes, valid groups or not: `validate` is a separate step.
    (
        1u32..64,
        1u32..64,
        0u32..4096,
        proptest::option::of(prop_oneof![
            ("[a-z][a-z0-9.-]{0,20}", 1u16..).prop_map(|(h, p)| format!("{h}:{p}")),
            (any::<[u8; 4]>(), 1u16..).prop_map(|(ip, p)| format!("{}:{p}", Ipv4Addr::from(ip))),
            (any::<[u8; 16]>(), 1u16..)
                .prop_map(|(ip, p)| format!("[{}]:{p}", std::net::Ipv6Addr::from(ip))),
        ]),
        millis(),
        millis(),
    )
        .prop_map(
            |(
                tensor_parallel,
                pipeline_parallel,
                rank,
                leader,
                rendezvous_timeout,
                step_timeout,
            )| {
                GroupArgs {
                    tensor_parallel,
                    pipeline_parallel,
                    rank,
                    leader_address: leader.map(|a| match a.parse() {
                        Ok(address) => address,
                        Err(error) => panic!("the strategy made a bad address {a}: {error}"),
                    }),
                    rendezvous_timeout,
                    step_timeout,
                }
            },
        )
}

fn telemetry_args() -> impl Strategy<Value = TelemetryArgs> {
    (
        log_args(),
        proptest::option::of("https?://[a-z0-9.-]{1,20}(:[0-9]{1,5})?(/[a-z]{0,8})?"),
        0.0f64..=1.0,
    )
        .prop_map(|(logs, otlp_endpoint, trace_sample_ratio)| TelemetryArgs {
            logs,
            otlp_endpoint,
            trace_sample_ratio,
        })
}

proptest! {
    #[test]
    fn serve_args_round_trip_every_field(args in serve_args()) {
        let command = EngineCommand::Serve(args);
        prop_assert_eq!(parse(command.to_args()), command);
    }

    #[test]
    fn fetch_args_round_trip_every_field(
        sha256 in digest(),
        dest in "/[a-z]{1,8}/-?[a-z0-9.]{1,12}",
        timeout in millis(),
        stall_timeout in millis(),
        retries in any::<u32>(),
        backoff in millis(),
        logs in log_args(),
    ) {
        let command = EngineCommand::Fetch(FetchArgs {
            url: "https://models.example/m.gguf?sig=-x".to_owned(),
            sha256,
            dest: PathBuf::from(dest),
            timeout,
            stall_timeout,
            retries,
            backoff,
            logs,
        });
        prop_assert_eq!(parse(command.to_args()), command);
    }
}

#[test]
fn for_model_gives_the_parsers_defaults() {
    let args = ServeArgs::for_model("/models/m.gguf").expect("defaults");
    assert_eq!(args.model, PathBuf::from("/models/m.gguf"));
    assert_eq!(args.host, IpAddr::V4(Ipv4Addr::LOCALHOST));
    assert_eq!(args.port, ENGINE_PORT);
    assert_eq!(args.device, DeviceChoice::Auto);
    assert_eq!(args.shutdown_timeout, Duration::from_secs(30));
    assert_eq!(args.max_output_tokens, 1024);
    assert_eq!(args.served_model_name, None);
    // A path that looks like a flag is still the path.
    let odd = ServeArgs::for_model("-m.gguf").expect("a dash path");
    assert_eq!(odd.model, PathBuf::from("-m.gguf"));
}

#[test]
fn cuda_renders_device_cuda() {
    let args = ServeArgs {
        device: DeviceChoice::Cuda,
        ..ServeArgs::for_model("/m.gguf").expect("defaults")
    };
    assert!(args.to_args().contains(&"--device=cuda".to_owned()));
}

#[test]
fn extra_args_override_and_unknown_flags_are_refused() {
    let base = ServeArgs::for_model("/m.gguf").expect("defaults");
    let merged = base
        .with_extra_args(&["--max-num-seqs", "128", "--port=9000"])
        .expect("known flags");
    assert_eq!(merged.max_num_seqs, 128);
    assert_eq!(merged.port, 9000);
    assert_eq!(merged.model, base.model);
    let error = base
        .with_extra_args(&["--max-output-token", "5"])
        .expect_err("a misspelt flag");
    assert!(error.to_string().contains("--max-output-token"), "{error}");
    let error = base
        .with_extra_args(&["--shutdown-timeout-ms", "1m"])
        .expect_err("a CRD-style duration");
    assert!(error.to_string().contains("milliseconds"), "{error}");
}

#[test]
fn group_flags_default_to_one_process_and_parse_a_worker_rank() {
    let base = ServeArgs::for_model("/m.gguf").expect("defaults");
    assert_eq!(base.group, GroupArgs::default());
    assert!(
        !base
            .to_args()
            .iter()
            .any(|a| a.contains("parallel") || a.contains("rank"))
    );
    let worker = base
        .with_extra_args(&[
            "--tensor-parallel=3",
            "--pipeline-parallel=2",
            "--rank=4",
            "--leader-address=m-g0-r0.m-g0.ns.svc:29500",
            "--step-timeout-ms=5000",
        ])
        .expect("group flags");
    assert_eq!(worker.group.world_size(), 6);
    assert_eq!(worker.group.rank, 4);
    assert_eq!(worker.group.step_timeout, Duration::from_secs(5));
    assert_eq!(worker.group.validate(), Ok(()));
    let error = base
        .with_extra_args(&["--tensor-parallel=0"])
        .expect_err("zero ranks");
    assert!(error.to_string().contains("tensor-parallel"), "{error}");
    let error = base
        .with_extra_args(&["--leader-address=leader"])
        .expect_err("no port");
    assert!(error.to_string().contains("host:port"), "{error}");
}

#[test]
fn flags_in_names_what_a_fragment_sets_even_at_its_default() {
    let given = ServeArgs::flags_in(&["--rank=0", "--max-num-seqs", "8", "--tensor-parallel=1"])
        .expect("valid flags");
    assert_eq!(given, ["max-num-seqs", "rank", "tensor-parallel"]);
    assert_eq!(
        ServeArgs::flags_in::<&str>(&[]).expect("nothing"),
        Vec::<String>::new()
    );
    let given = ServeArgs::flags_in(&["--model=/x", "--leader-address=l:1"]).expect("valid");
    assert_eq!(given, ["leader-address", "model"]);
    let error = ServeArgs::flags_in(&["--rank=x"]).expect_err("not a number");
    assert!(error.to_string().contains("--rank"), "{error}");
}

#[test]
fn help_explains_the_group_flags() {
    let help = <ServeArgs as clap::Args>::augment_args(clap::Command::new("serve"))
        .render_long_help()
        .to_string();
    for needle in [
        "--tensor-parallel",
        "--pipeline-parallel",
        "--rank",
        "--leader-address",
        "--rendezvous-timeout-ms",
        "--step-timeout-ms",
        "stage × tensor + tensor_rank",
    ] {
        assert!(help.contains(needle), "--help lacks {needle}:\n{help}");
    }
}

#[cfg(not(feature = "fault-injection"))]
#[test]
fn fault_flags_do_not_exist_without_the_feature() {
    let base = ServeArgs::for_model("/m.gguf").expect("defaults");
    assert!(base.with_extra_args(&["--inject-delay-ms", "5"]).is_err());
}

#[cfg(feature = "fault-injection")]
#[test]
fn fault_flags_appear_only_when_on() {
    let base = ServeArgs::for_model("/m.gguf").expect("defaults");
    assert!(!base.to_args().iter().any(|a| a.starts_with("--inject")));
    let slow = base
        .with_extra_args(&["--inject-delay-ms", "150"])
        .expect("a test build knows the flag");
    assert_eq!(slow.faults.inject_delay, Duration::from_millis(150));
    assert!(slow.to_args().contains(&"--inject-delay-ms=150".to_owned()));
}

#[test]
fn log_format_defaults_to_json_off_a_terminal() {
    assert_eq!(LogFormat::resolve(None, false), LogFormat::Json);
    assert_eq!(LogFormat::resolve(None, true), LogFormat::Text);
    assert_eq!(
        LogFormat::resolve(Some(LogFormat::Text), false),
        LogFormat::Text
    );
    assert_eq!(
        LogFormat::resolve(Some(LogFormat::Json), true),
        LogFormat::Json
    );
}

#[test]
fn otlp_endpoint_must_be_an_http_url() {
    for bad in ["collector:4318", "ftp://x", "http://", "https:///v1"] {
        let mut argv = vec!["serve".to_owned(), "--model=/m.gguf".to_owned()];
        argv.push(format!("--otlp-endpoint={bad}"));
        assert!(
            EngineCommand::parse_args(argv).is_err(),
            "{bad} was accepted"
        );
    }
    let args = ServeArgs::for_model("/m.gguf")
        .expect("defaults")
        .with_extra_args(&[
            "--otlp-endpoint=http://jaeger:4318",
            "--trace-sample-ratio=0.25",
        ])
        .expect("valid");
    assert_eq!(
        args.telemetry.otlp_endpoint.as_deref(),
        Some("http://jaeger:4318")
    );
    assert!((args.telemetry.trace_sample_ratio - 0.25).abs() < f64::EPSILON);
}

fn url() -> impl Strategy<Value = String> {
    ("https?", "[a-z][a-z0-9.-]{0,12}", 1u16..).prop_map(|(s, h, p)| format!("{s}://{h}:{p}"))
}

fn router_args() -> impl Strategy<Value = RouterArgs> {
    let endpoints = prop_oneof![
        (word(), proptest::option::of(word())).prop_map(|(name, ns)| (
            Some(name),
            ns,
            vec![],
            vec![],
            0u8
        )),
        (
            proptest::collection::vec(url(), 1..4),
            proptest::collection::vec(url(), 0..3),
            0u8..=100,
        )
            .prop_map(|(stable, canary, weight)| {
                let weight = if canary.is_empty() { 0 } else { weight };
                (None, None, stable, canary, weight)
            }),
    ];
    let choice = (
        prop_oneof![
            Just(RoutePolicy::Cost),
            Just(RoutePolicy::LeastInFlight),
            Just(RoutePolicy::RoundRobin),
        ],
        0.0f64..100.0,
        any::<usize>(),
        1u32..,
        "[a-z][a-z0-9-]{0,20}",
    );
    let timing = (
        millis(),
        millis(),
        any::<u32>(),
        millis(),
        millis(),
        millis(),
        millis(),
    );
    (any::<[u8; 4]>(), any::<u16>(), endpoints, choice, timing, telemetry_args()).prop_map(
        |(ip, port, endpoints, choice, timing, telemetry)| {
            let (inference_service, namespace, stable, canary, canary_weight) = endpoints;
            let (policy, prefill_load_scale, saturation_waiting, prefix_block_chars, session_header) =
                choice;
            let (slo, load_interval, max_retries, load_stale, retry_budget, shutdown_timeout, tpot) =
                timing;
            // The SLO flags exist only without Kubernetes; with it they keep the defaults.
            let static_mode = inference_service.is_none();
            RouterArgs {
                host: IpAddr::V4(Ipv4Addr::from(ip)),
                port,
                inference_service,
                namespace,
                stable,
                canary,
                canary_weight,
                slo_ttft: if static_mode { slo } else { Duration::from_secs(2) },
                slo_tpot: if static_mode { tpot } else { Duration::from_millis(150) },
                policy,
                prefill_load_scale,
                saturation_waiting,
                prefix_block_chars,
                session_header,
                load_interval,
                load_stale,
                max_retries,
                retry_budget,
                shutdown_timeout,
                telemetry,
            }
        },
    )
}

proptest! {
    #[test]
    fn router_args_round_trip_every_field(args in router_args()) {
        let parsed = RouterArgs::parse_from(args.to_args());
        prop_assert_eq!(parsed.map_err(|e| e.to_string()), Ok(args));
    }
}

#[test]
fn router_needs_endpoints_and_refuses_mixing_kubernetes_with_static_ones() {
    assert!(RouterArgs::parse_from(Vec::<String>::new()).is_err());
    let mixed = RouterArgs::for_inference_service("chat")
        .and_then(|a| a.with_extra_args(&["--stable=http://127.0.0.1:8000"]));
    assert!(
        mixed.is_err(),
        "--inference-service with --stable must be refused"
    );
    let weight = RouterArgs::parse_from([
        "--stable=http://a:1".to_owned(),
        "--canary-weight=5".to_owned(),
    ]);
    assert!(
        weight.is_err(),
        "--canary-weight without --canary must be refused"
    );
    let over = RouterArgs::parse_from(
        [
            "--stable=http://a:1",
            "--canary=http://b:1",
            "--canary-weight=101",
        ]
        .map(str::to_owned),
    );
    assert!(over.is_err(), "a weight over 100 must be refused");
}

#[test]
fn load_report_is_json_both_ways() {
    let report = LoadReport {
        release: "abc123".into(),
        models: vec!["smollm2".into()],
        running: 3,
        waiting: 1,
        context_blocks: 64,
        kv_blocks_total: 2048,
        kv_block_size: 16,
        draining: false,
    };
    let json = serde_json::to_string(&report).unwrap_or_default();
    assert!(json.contains("\"context_blocks\":64"), "{json}");
    let back: LoadReport = serde_json::from_str(&json).unwrap_or_else(|e| panic!("{e}: {json}"));
    assert_eq!(back, report);
}

#[test]
fn the_readiness_line_carries_the_base_url() {
    let address: std::net::SocketAddr = "127.0.0.1:40123".parse().expect("an address");
    let line = crate::listening::line(address);
    assert_eq!(line, "listening on http://127.0.0.1:40123");
    assert_eq!(crate::listening::url(&line), Some("http://127.0.0.1:40123"));
    assert_eq!(crate::listening::url("serving on http://127.0.0.1:1"), None);
}

#[test]
fn the_slo_needs_ttft_and_tpot_within_target() {
    use crate::metrics::SloTargets;
    let ms = Duration::from_millis;
    let slo = SloTargets {
        ttft: ms(100),
        tpot: ms(10),
    };
    // 11 tokens, 100 ms after the first: TPOT 10 ms.
    assert!(slo.met(Some(ms(100)), ms(200), 11));
    assert!(!slo.met(Some(ms(101)), ms(200), 11));
    assert!(!slo.met(Some(ms(100)), ms(201), 11));
    // One token: TPOT is met trivially, TTFT still counts.
    assert!(slo.met(Some(ms(50)), ms(5000), 1));
    assert!(!slo.met(Some(ms(150)), ms(150), 1));
    // No first token: no TTFT, not met.
    assert!(!slo.met(None, ms(1), 0));
}

#[test]
fn tpot_is_the_gap_after_the_first_token() {
    use crate::metrics::time_per_output_token;
    assert_eq!(time_per_output_token(0.25, 1.25, 5), Some(0.25));
    assert_eq!(time_per_output_token(0.1, 0.5, 1), None);
    assert_eq!(time_per_output_token(0.1, 0.5, 0), None);
    // A clock that went backwards is no negative gap.
    assert_eq!(time_per_output_token(0.5, 0.1, 3), Some(0.0));
}

#[test]
fn outcome_regexes_list_the_label_values_in_order() {
    use crate::metrics::Outcome;
    assert_eq!(
        Outcome::regex(Outcome::is_slo_eligible),
        "ok|rejected_503|error"
    );
    assert_eq!(
        Outcome::regex(Outcome::is_rejection),
        "rejected_429|rejected_503"
    );
}

fn operator_args() -> impl Strategy<Value = OperatorArgs> {
    let seconds = || (0u64..1_000_000).prop_map(Duration::from_secs);
    (
        (any::<[u8; 4]>(), any::<u16>()),
        (
            word(),
            word(),
            proptest::option::of(word()),
            proptest::option::of(word()),
        ),
        (seconds(), seconds()),
        log_args(),
        proptest::option::of(url()),
        "-?[a-z0-9./-]{1,30}(:[a-z0-9.]{1,8})?",
    )
        .prop_map(
            |(
                (ip, port),
                (lease_namespace, lease_name, identity, namespace),
                (lease_duration, lease_retry),
                logs,
                otlp_endpoint,
                router_image,
            )| OperatorArgs {
                metrics_addr: std::net::SocketAddr::from((ip, port)),
                lease_namespace,
                lease_name,
                identity,
                namespace,
                lease_duration,
                lease_retry,
                logs,
                otlp_endpoint,
                router_image,
            },
        )
}

proptest! {
    #[test]
    fn operator_args_round_trip_every_field(args in operator_args()) {
        let parsed = OperatorArgs::parse_args(args.to_args());
        prop_assert_eq!(parsed.map_err(|e| e.to_string()), Ok(args));
    }
}

#[test]
fn operator_defaults_are_the_parsers_and_the_deployments_flags_keep_their_names() {
    // The Deployment's flags, as manifests/ and the chart have always written them.
    let parsed = OperatorArgs::parse_args([
        "--metrics-addr=0.0.0.0:8080",
        "--lease-duration-seconds=15",
        "--lease-retry-seconds=2",
        "--log-format=json",
        "--router-image=ghcr.io/slipway-dev/slipway-router:0.1.0",
        "--lease-namespace",
        "slipway-system",
        "--identity",
        "slipway-operator-0",
    ])
    .expect("the Deployment's flags");
    assert_eq!(
        parsed,
        OperatorArgs {
            metrics_addr: "0.0.0.0:8080".parse().expect("an address"),
            identity: Some("slipway-operator-0".to_owned()),
            logs: LogArgs {
                log_format: Some(LogFormat::Json),
            },
            ..OperatorArgs::default()
        }
    );
    // Without flags, the flags that no environment variable can set take the same
    // defaults as `Default` (the others depend on the test's environment).
    let bare = OperatorArgs::parse_args(Vec::<String>::new()).expect("no flags");
    let defaults = OperatorArgs::default();
    assert_eq!(bare.lease_name, defaults.lease_name);
    assert_eq!(bare.lease_duration, Duration::from_secs(15));
    assert_eq!(bare.lease_retry, Duration::from_secs(2));
    assert_eq!(bare.otlp_endpoint, None);
    for (variable, from_env, default) in [
        (
            "SLIPWAY_METRICS_ADDR",
            bare.metrics_addr.to_string(),
            "127.0.0.1:8080".to_owned(),
        ),
        (
            "POD_NAMESPACE",
            bare.lease_namespace.clone(),
            "slipway-system".to_owned(),
        ),
        (
            "SLIPWAY_ROUTER_IMAGE",
            bare.router_image.clone(),
            defaults.router_image.clone(),
        ),
    ] {
        if std::env::var_os(variable).is_none() {
            assert_eq!(from_env, default, "{variable} is unset");
        }
    }
    assert_eq!(
        defaults.to_args(),
        [
            "--metrics-addr=127.0.0.1:8080",
            "--lease-namespace=slipway-system",
            "--lease-name=slipway-operator",
            "--lease-duration-seconds=15",
            "--lease-retry-seconds=2",
            "--router-image=ghcr.io/slipway-dev/slipway-router:0.1.0",
        ]
    );
}

#[test]
fn operator_refuses_unknown_flags_bad_values_and_repeats() {
    for bad in [
        &["--lease-duration=15"][..],
        &["--lease-duration-seconds=15s"],
        &["--lease-retry-seconds=-1"],
        &["--metrics-addr=localhost"],
        &["--otlp-endpoint=collector:4318"],
        &["--log-format=yaml"],
        &["--lease-name=a", "--lease-name=b"],
    ] {
        let error = OperatorArgs::parse_args(bad).expect_err("refused");
        assert_ne!(
            error.kind(),
            clap::error::ErrorKind::DisplayHelp,
            "{bad:?}: {error}"
        );
    }
    let error = OperatorArgs::parse_args(["--lease-duration=15"]).expect_err("misspelt");
    assert_eq!(error.kind(), clap::error::ErrorKind::UnknownArgument);
    assert_eq!(error.exit_code(), exit::USAGE);
}

#[test]
fn operator_help_explains_leader_election_and_its_environment() {
    let mut cmd =
        <OperatorArgs as clap::Args>::augment_args(clap::Command::new("slipway-operator"));
    let help = cmd.render_long_help().to_string();
    for needle in [
        "--lease-duration-seconds <SECONDS>",
        "[env: POD_NAME=",
        "[env: POD_NAMESPACE=",
        "[default: 127.0.0.1:8080]",
        "Leader election:",
        "SIGTERM",
    ] {
        assert!(help.contains(needle), "--help lacks {needle:?}:\n{help}");
    }
}
