//! What the long-lived modes share: shutdown on SIGTERM, and HTTP serving for the webhook and
//! the worker, where every HTTP/1 connection must send its request headers within a time limit,
//! so that a client that opens connections and trickles bytes (slowloris) cannot hold them, nor
//! the server's file descriptors, for long.

use std::time::Duration;

pub mod connections;

/// What a client gets to send its request headers.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// What a new connection gets to start its first request (TLS handshake and headers
/// included): the header read timeout, which a client that sends its first byte already had.
pub const FIRST_REQUEST_TIMEOUT: Duration = HEADER_READ_TIMEOUT;

/// What a kept-alive connection may stay idle between requests (HTTP/1 keep-alive, HTTP/2).
/// Longer than the router's pooled connections live idle (60 s, src/router/fleet.rs) plus a
/// header read timeout, so that the pool, not the worker, closes an idle pooled connection and
/// never sends a request on one the worker is closing. Idle connections past the connection
/// limit are closed sooner, longest-idle first.
pub const KEEP_ALIVE_IDLE: Duration = Duration::from_secs(75);

/// The policy of a server's connections: the timeouts above and a connection limit below the
/// process's file limit ([`connections::connection_budget`]).
pub fn connection_policy(first_request: Duration) -> connections::ConnectionPolicy {
    connections::ConnectionPolicy {
        first_request,
        idle: KEEP_ALIVE_IDLE.max(first_request),
        max_connections: connections::connection_budget(),
    }
}

/// Pending connections the kernel queues for `accept` on a listener from [`bind`]: Linux's
/// default cap (`net.core.somaxconn`, 4096 since 5.4; the kernel clamps to it). The standard
/// library's 128 overflows under a burst of connects (a thousand idle sockets opened at once),
/// and a connect whose SYN is dropped waits a second to retry: a probe among them took 1.08 s.
pub const LISTEN_BACKLOG: u32 = 4096;

/// A listening socket on `addr` with [`LISTEN_BACKLOG`] (and `SO_REUSEADDR`, as the standard
/// library sets it). Call within the tokio runtime.
pub fn bind(addr: std::net::SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)?.into_std()
}

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
