//! Serving a model, and what the long-lived modes share.
//!
//! The model: the serving loop over the engine ([`runtime`]), the OpenAI-compatible API
//! ([`openai`]), the worker's metrics ([`metrics`]), KV events ([`kv_events`]) and putting a
//! loaded model on its device ([`serve`]). The pure parts (weights, tokenizers, the CPU forward
//! pass, sampling) are `kvfleet_engine::model`'s; the GPU model is `kvfleet_cuda::gpu`'s.
//!
//! Shared by the webhook, the worker and the router: shutdown on SIGTERM, and HTTP serving
//! where every HTTP/1 connection must send its request headers within a time limit
//! and every HTTP/2 connection must answer keep-alive PINGs, so that neither a client that
//! opens connections and trickles bytes (slowloris) nor a peer that vanished can hold them, nor
//! the server's file descriptors, for long.

use std::time::Duration;

pub mod body_budget;
pub mod connections;
pub mod kv_events;
pub mod metrics;
pub mod openai;
pub mod runtime;
pub mod serve;
pub mod zmtp;

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

/// HTTP/2 keep-alive: the server PINGs a connection from which it has read nothing for
/// `interval`, and closes it when the PING is not acknowledged within `timeout` (hyper's
/// `http2::Builder::keep_alive_interval` / `keep_alive_timeout`; a server pings idle
/// connections too). This closes what the idle policy cannot see: a connection with a request
/// in flight whose peer vanished without a FIN (a dead node, a dropped NAT or load-balancer
/// mapping), which TCP alone would hold until its retransmissions give up (about 15 minutes),
/// or, with nothing to send, forever. A connection without a stream is closed by the idle
/// policy ([`connection_policy`]) whether or not it answers PINGs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Http2KeepAlive {
    pub interval: Duration,
    pub timeout: Duration,
}

/// Both servers' HTTP/2 keep-alive: a dead peer is closed within 40 s of its last frame.
/// - Interval 20 s: below the shortest idle timeout of the load balancers and NAT gateways a
///   client may sit behind (AWS ALB 60 s, Azure LB 4 min, AWS NAT gateway and NLB 350 s), so a live
///   but quiet connection keeps its mapping; a PING is 17 bytes each way.
/// - Timeout 20 s: hyper's default and gRPC's keep-alive timeout; a live peer answers a PING
///   in a round trip, so 20 s covers a congested link or a paused client without closing it.
///
/// Kubelet probes use HTTP/1.1 (no PINGs); the router's pooled connections are HTTP/1.1 too.
pub const HTTP2_KEEP_ALIVE: Http2KeepAlive = Http2KeepAlive {
    interval: Duration::from_secs(20),
    timeout: Duration::from_secs(20),
};

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

/// The timeouts hyper enforces on `server`'s connections: HTTP/1 connections must send their
/// headers within `header_read`, HTTP/2 connections answer keep-alive PINGs ([`Http2KeepAlive`]).
/// Both need hyper's timer.
pub fn limit_connection_time<A, Acc>(
    server: &mut axum_server::Server<A, Acc>,
    header_read: Duration,
    keep_alive: Http2KeepAlive,
) where
    A: axum_server::Address,
{
    let builder = server.http_builder();
    builder
        .http1()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(header_read);
    builder
        .http2()
        .timer(hyper_util::rt::TokioTimer::new())
        .keep_alive_interval(keep_alive.interval)
        .keep_alive_timeout(keep_alive.timeout);
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
