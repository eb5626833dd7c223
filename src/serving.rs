//! What the long-lived modes share: shutdown on SIGTERM, and HTTP serving for the webhook and
//! the worker, where every HTTP/1 connection must send its request headers within a time limit,
//! so that a client that opens connections and trickles bytes (slowloris) cannot hold them, nor
//! the server's file descriptors, for long.

use std::time::Duration;

/// What a client gets to send its request headers.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// HTTP/1 connections of `server` must send their headers within `timeout` (hyper needs a
/// timer for it).
pub fn limit_header_read<A, Acc>(server: &mut axum_server::Server<A, Acc>, timeout: Duration)
where
    A: axum_server::Address,
{
    server
        .http_builder()
        .http1()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(timeout);
}

/// Resolves on SIGTERM (what the kubelet sends) or ctrl-c; shared by every long-lived mode.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}
