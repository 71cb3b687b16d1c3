//! The signal that stops a Slipway process.

/// Resolves when the process is asked to stop: SIGTERM (what the kubelet sends after
/// the preStop hook, and what starts a server's drain) or Ctrl-C. Logs which one. If
/// SIGTERM cannot be watched, only Ctrl-C stops the wait, and a warning says so.
pub async fn stop_signal() {
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(error) => {
                tracing::warn!(%error, "cannot watch SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = term => tracing::info!("SIGTERM"),
        r = tokio::signal::ctrl_c() => if r.is_ok() { tracing::info!("Ctrl-C") },
    }
}
