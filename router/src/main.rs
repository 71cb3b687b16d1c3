//! `slipway-router`: see the crate documentation and `--help`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::time::Duration;

use anyhow::Context as _;
use axum::http::HeaderName;
use clap::Parser;
use slipway_contract::RouterArgs;
use slipway_contract::metrics::SloTargets;
use slipway_router::choose::Params;
use slipway_router::discovery;
use slipway_router::endpoints::Live;
use slipway_router::metrics::RouterMetrics;
use slipway_router::proxy::App;
use slipway_router::retry::RetryPolicy;
use slipway_router::{load, server};
use slipway_telemetry::{Telemetry, TraceExport};

#[derive(Debug, Parser)]
#[command(
    name = "slipway-router",
    version,
    about = "Slipway's OpenAI-compatible router: splits requests between a release and its canary by weight, picks the engine by prefix overlap and load, retries only before the first byte, and measures the SLO at the gateway"
)]
struct Cli {
    #[command(flatten)]
    args: RouterArgs,
}

fn main() -> anyhow::Result<()> {
    let Cli { args } = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(run(args))
}

async fn run(args: RouterArgs) -> anyhow::Result<()> {
    let _telemetry = Telemetry::init(
        "slipway-router",
        args.telemetry.logs.log_format,
        "info",
        TraceExport::from_args(&args.telemetry).as_ref(),
    )?;
    let session_header = HeaderName::try_from(args.session_header.as_str()).with_context(|| {
        format!(
            "--session-header {:?} is not a header name",
            args.session_header
        )
    })?;
    let client = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(2))
        // A stream with no byte for this long is as good as broken.
        .read_timeout(Duration::from_secs(60))
        .tcp_nodelay(true)
        .build()
        .context("building the HTTP client")?;
    let live = Arc::new(Live::new(SloTargets {
        ttft: args.slo_ttft,
        tpot: args.slo_tpot,
    }));
    let app = Arc::new(App {
        live: Arc::clone(&live),
        metrics: RouterMetrics::new(),
        client: client.clone(),
        params: Params::from_args(&args),
        retry: RetryPolicy::from_args(&args),
        block_chars: usize::try_from(args.prefix_block_chars).unwrap_or(64),
        session_header,
        ready: AtomicBool::new(false),
        active: AtomicUsize::new(0),
    });
    let watch = match &args.inference_service {
        Some(name) => {
            let kube = kube::Client::try_default()
                .await
                .context("connecting to the Kubernetes API server")?;
            let namespace = args
                .namespace
                .clone()
                .unwrap_or_else(|| kube.default_namespace().to_owned());
            tracing::info!(inference_service = %name, %namespace, "watching the InferenceService and its EndpointSlices");
            Some(tokio::spawn(discovery::watch_kubernetes(
                Arc::clone(&app),
                kube,
                namespace,
                name.clone(),
            )))
        }
        None => {
            discovery::from_args(&live, &args);
            None
        }
    };
    let poller = {
        // Without Kubernetes the view is complete once each endpoint was asked for its
        // load (and its models); with it, discovery turns the router ready.
        let (app, static_mode) = (Arc::clone(&app), watch.is_none());
        tokio::spawn(load::poll(
            Arc::clone(&live),
            client,
            args.load_interval,
            move || {
                if static_mode {
                    app.ready.store(true, std::sync::atomic::Ordering::Relaxed);
                }
            },
        ))
    };
    let addr = SocketAddr::new(args.host, args.port);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    let local = listener.local_addr()?;
    tracing::info!(%local, policy = %args.policy, "routing");
    server::announce(local);
    let served = server::serve(listener, app, args.shutdown_timeout).await;
    poller.abort();
    if let Some(watch) = watch {
        watch.abort();
    }
    served.context("serving")?;
    tracing::info!("drained; exiting");
    Ok(())
}
