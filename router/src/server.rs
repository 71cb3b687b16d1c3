//! The router's HTTP surface: the OpenAI routes it forwards, `/v1/models` from the
//! engines' load reports, the probes, `/metrics`, and the drain on SIGTERM.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;
use slipway_contract::paths;

use crate::proxy::{self, App};

/// The largest request body forwarded (an engine refuses more than 1 MiB anyway).
const MAX_BODY_BYTES: usize = 2 << 20;

/// The routes.
pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(proxy::forward))
        .route("/v1/completions", post(proxy::forward))
        .route("/v1/models", get(models))
        .route(paths::HEALTH, get(|| async { "ok" }))
        .route(paths::READY, get(ready))
        .route(paths::METRICS, get(metrics))
        .fallback(|uri: axum::http::Uri| async move {
            let message = format!("no route {}", uri.path());
            (
                StatusCode::NOT_FOUND,
                Json(json!({"error": {"message": message, "type": "invalid_request_error", "param": null, "code": 404}})),
            )
        })
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(app)
}

async fn models(State(app): State<Arc<App>>) -> Json<serde_json::Value> {
    let data: Vec<_> = app
        .live
        .models()
        .into_iter()
        .map(|id| json!({"id": id, "object": "model", "created": 0, "owned_by": "slipway"}))
        .collect();
    Json(json!({"object": "list", "data": data}))
}

async fn ready(State(app): State<Arc<App>>) -> Response {
    if app.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ready").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            [(header::RETRY_AFTER, "1")],
            "not ready: syncing or draining",
        )
            .into_response()
    }
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    app.metrics.clear_endpoints();
    for ((release, state), count) in app.live.census() {
        app.metrics.set_endpoints(&release, state, count);
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        app.metrics.render(),
    )
        .into_response()
}

/// Serves on `listener` until SIGTERM (or Ctrl-C), then drains: `/ready` turns 503
/// at once, requests in flight get up to `shutdown_timeout` to finish, and what is
/// left then is cut.
///
/// # Errors
/// The server failed.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Arc<App>,
    shutdown_timeout: Duration,
) -> std::io::Result<()> {
    let (drained_tx, drained_rx) = tokio::sync::oneshot::channel::<()>();
    let signal = {
        let app = Arc::clone(&app);
        async move {
            slipway_telemetry::stop_signal().await;
            app.ready.store(false, Ordering::Relaxed);
            tracing::info!(
                ?shutdown_timeout,
                active = app.active.load(Ordering::Relaxed),
                "draining: letting requests in flight finish"
            );
            let idle = async {
                let mut tick = tokio::time::interval(Duration::from_millis(50));
                loop {
                    tick.tick().await;
                    if app.active.load(Ordering::Relaxed) == 0 {
                        break;
                    }
                }
            };
            if tokio::time::timeout(shutdown_timeout, idle).await.is_err() {
                tracing::warn!(
                    left = app.active.load(Ordering::Relaxed),
                    "shutdown timeout reached; cutting the requests still in flight"
                );
                let _ = drained_tx.send(());
            }
        }
    };
    let server = axum::serve(listener, router(app)).with_graceful_shutdown(signal);
    tokio::select! {
        r = server => r,
        // After the timeout, open streams are cut rather than waited for.
        Ok(()) = drained_rx => Ok(()),
    }
}

/// The bound address, as the readiness line ([`slipway_contract::listening`]) that
/// scripts and tests wait for.
pub fn announce(local: SocketAddr) {
    println!("{}", slipway_contract::listening::line(local));
}
