//! HTTP serving shared by the webhook and the worker: every HTTP/1 connection must send its
//! request headers within a time limit, so that a client that opens connections and trickles
//! bytes (slowloris) cannot hold them, nor the server's file descriptors, for long.

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
