//! `slipway-operator`: runs the InferenceService controller under leader election,
//! serves `/metrics` and `/healthz`, and shuts down gracefully on SIGTERM/SIGINT
//! (finishing in-flight reconciles and releasing the Lease).

use std::sync::Arc;

use anyhow::Context as _;
use clap::Parser;
use slipway_contract::OperatorArgs;
use slipway_operator::leader::{Elector, LeaseConfig};
use slipway_operator::metrics::{self, Metrics};
use slipway_operator::reconcile::{self, Context};
use slipway_telemetry::Telemetry;
use tokio::sync::watch;
use tracing::{error, info};

/// Reconciles InferenceService objects into fault-tolerant groups of engine pods.
#[derive(Debug, Parser)]
#[command(name = "slipway-operator", version)]
struct Cli {
    #[command(flatten)]
    args: OperatorArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let Cli { args } = Cli::parse();
    let _telemetry = Telemetry::init("slipway-operator", args.logs.log_format, "info", None)?;
    let identity = args.identity.clone().unwrap_or_else(|| {
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "operator".to_owned());
        format!("{host}-{}", std::process::id())
    });
    let client = kube::Client::try_default()
        .await
        .context("building the Kubernetes client")?;
    let metrics = Arc::new(Metrics::default());

    let listener = tokio::net::TcpListener::bind(args.metrics_addr)
        .await
        .with_context(|| format!("binding {}", args.metrics_addr))?;
    info!(addr = %args.metrics_addr, "serving /metrics and /healthz");
    let router = metrics::router(metrics.clone());
    tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, router).await {
            error!(%error, "metrics server stopped");
        }
    });

    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        slipway_telemetry::stop_signal().await;
        let _ = stop_tx.send(true);
    });

    let config = LeaseConfig {
        duration: args.lease_duration,
        retry: args.lease_retry,
    };
    let mut elector = Elector::new(
        client.clone(),
        &args.lease_namespace,
        &args.lease_name,
        &identity,
        config,
    );
    info!(%identity, lease = %args.lease_name, "waiting for leadership");
    let mut stopping = stop_rx.clone();
    tokio::select! {
        acquired = elector.acquire() => acquired?,
        _ = stopping.wait_for(|stop| *stop) => {
            info!("stopped before becoming leader");
            return Ok(());
        }
    }
    metrics.set_leader(true);

    let ctx = Context {
        engine_otlp_endpoint: args.otlp_endpoint.clone(),
        router_image: Some(args.router_image.clone()),
        ..Context::new(client, elector.identity(), metrics.clone())
    };
    let mut controller_stop = stop_rx.clone();
    let (lost_tx, mut lost_rx) = watch::channel(false);
    let controller = tokio::spawn(reconcile::run(ctx, args.namespace.clone(), async move {
        tokio::select! {
            _ = controller_stop.wait_for(|stop| *stop) => {}
            _ = lost_rx.wait_for(|lost| *lost) => {}
        }
    }));

    // Renew every retry period until asked to stop or until the Lease can no longer be
    // trusted; a failed renewal is retried as the election's retry policy says.
    let mut stopping = stop_rx.clone();
    let retry = config.retry_policy();
    let mut failures = 0u32;
    let lost = loop {
        let wait = match failures {
            0 => config.retry,
            n => retry.delay(n),
        };
        tokio::select! {
            _ = stopping.wait_for(|stop| *stop) => break false,
            () = tokio::time::sleep(wait) => {}
        }
        match elector.try_acquire_or_renew().await {
            Ok(true) => failures = 0,
            Ok(false) => break true,
            Err(error) if elector.still_leading() => {
                failures = failures.saturating_add(1);
                error!(%error, "renewing the lease failed; retrying")
            }
            Err(error) => {
                error!(%error, "renewing the lease failed past its deadline");
                break true;
            }
        }
    };
    let _ = lost_tx.send(true);
    metrics.set_leader(false);
    if let Err(error) = controller.await {
        error!(%error, "controller task failed");
    }
    if lost {
        // Another replica may act from now on; exit so we are restarted as a candidate.
        anyhow::bail!("lost leadership of lease {}", args.lease_name);
    }
    elector.release().await;
    info!("shut down");
    Ok(())
}
