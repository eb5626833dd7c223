//! HTTP surfaces: the admission endpoint over HTTPS, and health plus metrics on a
//! separate plain-HTTP port. Handlers only time, delegate to [`review`] and serialise.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use axum_server::tls_rustls::RustlsConfig;
use axum_server::Handle;

use super::cache::NodeCache;
use super::metrics::Metrics;
use super::review::{self, Reviewed};
use crate::serving::body_budget::{BodyBudget, BodyError, BodyLimits, BudgetedBody};

/// Largest AdmissionReview body accepted. The API server takes request bodies of up to
/// 3 MiB, so a review of an UPDATE (object and oldObject, plus the envelope) stays under
/// 7 MiB. The webhook's memory for one review is this body (held once more while it is
/// collected) plus one spec within the schema's bounds (`api::bounded`), so the peak stays
/// under 64 MiB (tests/webhook_memory.rs; docs/webhook.md).
pub const MAX_BODY_BYTES: usize = 8 * 1024 * 1024;

/// Bytes of AdmissionReview bodies held at once, across requests, by default
/// (`--max-body-bytes-in-flight`): 8 reviews of the largest size, or thousands of ordinary ones
/// (a few KiB), at once. The chart's memory limit is 256Mi; the webhook idles at some 20 MiB,
/// and one review's judgement costs a spec within the schema's bounds (well under 64 MiB with
/// its body, tests/webhook_memory.rs), so 64 MiB of bodies leaves over 100 MiB for the node
/// cache of a large cluster, the held connections' buffers and the allocator's slack. Without
/// it, 40 clients each sending most of an 8 MiB review took the webhook to 356 MB (issue 62).
pub const DEFAULT_BODIES_IN_FLIGHT_BYTES: usize = 64 * 1024 * 1024;

/// A client must send a request's headers within this time (slowloris), on both servers.
pub const HEADER_READ_TIMEOUT: Duration = crate::serving::HEADER_READ_TIMEOUT;

/// A client must send a request's body within this time of its headers. The API server gives a
/// webhook call 10 s by default (`timeoutSeconds`, at most 30): a body still arriving after
/// that is not an API server's, and a trickled one would hold the connection and its buffer.
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// What the handlers share.
pub struct AppState {
    pub cache: Arc<NodeCache>,
    pub metrics: Metrics,
    /// Set once a serving certificate is installed.
    pub tls_ready: AtomicBool,
    /// See [`HEADER_READ_TIMEOUT`].
    pub header_read_timeout: Duration,
    /// See [`BODY_READ_TIMEOUT`]; tests lower it with the header read timeout.
    pub body_read_timeout: Duration,
    /// The HTTPS port speaks HTTP/2 (ALPN h2) and the health port h2c: see
    /// [`crate::serving::HTTP2_KEEP_ALIVE`].
    pub http2_keep_alive: crate::serving::Http2KeepAlive,
    /// Both servers' connections, under one file limit: idle ones are closed (a connection
    /// must start a request within the header read timeout of its accept, TLS handshake
    /// included) and the longest idle makes room for a new one (a probe).
    pub connections: crate::serving::connections::Connections,
    /// The bytes of the review bodies in flight ([`DEFAULT_BODIES_IN_FLIGHT_BYTES`]): a review
    /// that finds no room within [`crate::serving::body_budget::DEFAULT_WAIT`] is answered 503
    /// with `Retry-After` (the API server applies the webhook's failure policy, or retries).
    pub bodies: BodyBudget,
}

impl AppState {
    pub fn new(cache: Arc<NodeCache>, metrics: Metrics) -> Arc<Self> {
        Self::with_header_read_timeout(cache, metrics, HEADER_READ_TIMEOUT)
    }

    pub fn with_header_read_timeout(cache: Arc<NodeCache>, metrics: Metrics, timeout: Duration) -> Arc<Self> {
        Self::with_timeouts(cache, metrics, timeout, crate::serving::HTTP2_KEEP_ALIVE)
    }

    /// With a budget of `bytes` for the review bodies in flight (`--max-body-bytes-in-flight`).
    pub fn with_bodies_in_flight(cache: Arc<NodeCache>, metrics: Metrics, bytes: usize) -> Arc<Self> {
        Self::build(
            cache,
            metrics,
            HEADER_READ_TIMEOUT,
            crate::serving::HTTP2_KEEP_ALIVE,
            bytes,
        )
    }

    /// With a header read timeout and an HTTP/2 keep-alive of its own (tests lower both).
    pub fn with_timeouts(
        cache: Arc<NodeCache>,
        metrics: Metrics,
        timeout: Duration,
        http2_keep_alive: crate::serving::Http2KeepAlive,
    ) -> Arc<Self> {
        Self::build(
            cache,
            metrics,
            timeout,
            http2_keep_alive,
            DEFAULT_BODIES_IN_FLIGHT_BYTES,
        )
    }

    fn build(
        cache: Arc<NodeCache>,
        metrics: Metrics,
        timeout: Duration,
        http2_keep_alive: crate::serving::Http2KeepAlive,
        bodies_in_flight: usize,
    ) -> Arc<Self> {
        Arc::new(AppState {
            cache,
            metrics,
            tls_ready: AtomicBool::new(false),
            header_read_timeout: timeout,
            body_read_timeout: timeout.min(BODY_READ_TIMEOUT),
            http2_keep_alive,
            connections: crate::serving::connections::Connections::new(crate::serving::connection_policy(
                timeout,
            )),
            bodies: BodyBudget::new(
                bodies_in_flight.max(MAX_BODY_BYTES),
                crate::serving::body_budget::DEFAULT_WAIT,
            ),
        })
    }

    /// Ready to admit: nodes listed and fresh (the API server answered recently), and a
    /// certificate to serve.
    pub fn ready(&self) -> bool {
        self.cache.synced() && !self.cache.stale() && self.tls_ready.load(Ordering::Acquire)
    }
}

/// The admission router: `POST /validate` (and `/` for configurations written by hand).
pub fn admission_router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/validate", post(admit))
        .route("/", post(admit))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// The probe and metrics router: `/healthz`, `/readyz`, `/metrics`.
pub fn health_router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(state)
}

/// The request body, within [`MAX_BODY_BYTES`], the body read timeout and the budget of bodies
/// in flight; the permit holds the body's bytes in the budget until it is dropped.
async fn read_body(state: &AppState, req: axum::extract::Request) -> Result<BudgetedBody, Response> {
    let limits = BodyLimits {
        max_bytes: MAX_BODY_BYTES,
        timeout: state.body_read_timeout,
    };
    let error = match state.bodies.read(req, limits).await {
        Ok(body) => return Ok(body),
        Err(error) => error,
    };
    let status = error.status();
    let message = match &error {
        BodyError::TooLarge { .. } => {
            format!("the AdmissionReview is over the webhook's limit of {MAX_BODY_BYTES} bytes\n")
        }
        BodyError::Busy { budget, retry_after } => format!(
            "the webhook holds as many AdmissionReview bodies as its memory allows ({budget} bytes, --max-body-bytes-in-flight); retry in {} s\n",
            retry_after.as_secs()
        ),
        BodyError::TimedOut { timeout } => {
            format!("the request body did not arrive within {timeout:?} of its headers\n")
        }
        BodyError::Read { .. } => format!("{error}\n"),
    };
    let mut response = (status, message).into_response();
    if let Some(after) = error.retry_after() {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, after.as_secs().max(1).into());
    }
    Err(response)
}

async fn admit(State(state): State<Arc<AppState>>, req: axum::extract::Request) -> Response {
    let start = Instant::now();
    // The permit holds the body's bytes in the budget until the answer is built.
    let BudgetedBody {
        bytes: body,
        permit: _held,
    } = match read_body(&state, req).await {
        Ok(body) => body,
        Err(response) => {
            tracing::warn!(
                status = response.status().as_u16(),
                "an admission request's body could not be read"
            );
            return response;
        }
    };
    let Reviewed {
        review,
        operation,
        outcome,
    } = if state.cache.synced() {
        review::review_detailed(&body, &state.cache.facts())
    } else {
        review::not_ready(&body)
    };
    let warnings = review
        .response
        .as_ref()
        .and_then(|r| r.warnings.as_ref())
        .map_or(0, Vec::len);
    let response = match serde_json::to_vec(&review) {
        Ok(json) => ([(header::CONTENT_TYPE, "application/json")], json).into_response(),
        // Serialising our own response types cannot fail; answer 400 rather than 500.
        Err(error) => (
            StatusCode::BAD_REQUEST,
            format!("cannot encode the AdmissionReview: {error}\n"),
        )
            .into_response(),
    };
    state
        .metrics
        .observe(operation, outcome.as_str(), warnings, start.elapsed());
    tracing::debug!(operation, result = outcome.as_str(), "admission request answered");
    response
}

async fn readyz(State(state): State<Arc<AppState>>) -> Response {
    if state.ready() {
        (StatusCode::OK, "ready\n").into_response()
    } else if !state.cache.synced() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: the node cache has not synced yet\n",
        )
            .into_response()
    } else if state.cache.stale() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "not ready: the node cache is stale (the API server last answered {} s ago); check the API server and the webhook's network path to it\n",
                state.cache.age().as_secs()
            ),
        )
            .into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: no serving certificate yet\n",
        )
            .into_response()
    }
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    // Gauges of the cache are computed at scrape time.
    state.metrics.nodes.set(state.cache.len() as i64);
    state.metrics.cache_synced.set(i64::from(state.cache.synced()));
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        state.metrics.render(),
    )
        .into_response()
}

/// Serves the admission router over TLS on `listener` until `handle` shuts it down.
pub async fn serve_https(
    listener: std::net::TcpListener,
    state: Arc<AppState>,
    tls: RustlsConfig,
    handle: Handle<SocketAddr>,
) -> std::io::Result<()> {
    listener.set_nonblocking(true)?;
    state.tls_ready.store(true, Ordering::Release);
    let acceptor = axum_server::tls_rustls::RustlsAcceptor::new(tls).acceptor(
        state
            .connections
            .acceptor(axum_server::accept::DefaultAcceptor::new()),
    );
    let mut server = axum_server::from_tcp(listener)?.acceptor(acceptor);
    crate::serving::limit_connection_time(&mut server, state.header_read_timeout, state.http2_keep_alive);
    server
        .handle(handle)
        .serve(admission_router(state).into_make_service())
        .await
}

/// Serves the health router over plain HTTP on `listener` until `handle` shuts it down.
pub async fn serve_health(
    listener: std::net::TcpListener,
    state: Arc<AppState>,
    handle: Handle<SocketAddr>,
) -> std::io::Result<()> {
    listener.set_nonblocking(true)?;
    let mut server = axum_server::from_tcp(listener)?.acceptor(
        state
            .connections
            .acceptor(axum_server::accept::DefaultAcceptor::new()),
    );
    crate::serving::limit_connection_time(&mut server, state.header_read_timeout, state.http2_keep_alive);
    server
        .handle(handle)
        .serve(health_router(state).into_make_service())
        .await
}
