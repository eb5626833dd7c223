//! Controller metrics and the plain HTTP endpoints `/metrics`, `/healthz`, `/readyz`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry, TextEncoder,
};

/// Reconcile metrics, registered on one registry.
#[derive(Clone)]
pub struct Metrics {
    pub runs: IntCounter,
    pub failures: IntCounterVec,
    pub duration: HistogramVec,
    pub leader: IntGauge,
}

impl Metrics {
    /// Creates the metrics and registers them on `registry`.
    pub fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let runs = IntCounter::with_opts(Opts::new(
            "kvfleet_controller_reconcile_runs_total",
            "Reconcile passes started",
        ))?;
        let failures = IntCounterVec::new(
            Opts::new(
                "kvfleet_controller_reconcile_failures_total",
                "Reconcile passes that failed, by error category",
            ),
            &["category"],
        )?;
        let duration = HistogramVec::new(
            HistogramOpts::new(
                "kvfleet_controller_reconcile_duration_seconds",
                "Wall time of one reconcile pass",
            )
            .buckets(vec![
                0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            ]),
            &["outcome"],
        )?;
        let leader = IntGauge::with_opts(Opts::new(
            "kvfleet_controller_leader",
            "1 while this replica holds the leader Lease",
        ))?;
        registry.register(Box::new(runs.clone()))?;
        registry.register(Box::new(failures.clone()))?;
        registry.register(Box::new(duration.clone()))?;
        registry.register(Box::new(leader.clone()))?;
        Ok(Metrics {
            runs,
            failures,
            duration,
            leader,
        })
    }

    /// Counts a run and returns a timer that records its duration when finished.
    pub fn start(&self) -> ReconcileTimer {
        self.runs.inc();
        ReconcileTimer {
            started: Instant::now(),
            duration: self.duration.clone(),
        }
    }
}

/// Measures one reconcile pass.
pub struct ReconcileTimer {
    started: Instant,
    duration: HistogramVec,
}

impl ReconcileTimer {
    pub fn finish(self, outcome: &str) {
        self.duration
            .with_label_values(&[outcome])
            .observe(self.started.elapsed().as_secs_f64());
    }
}

/// What the HTTP endpoints report.
#[derive(Clone)]
pub struct Health {
    pub registry: Registry,
    /// Set once the API server answered and the CRD is installed.
    pub ready: Arc<AtomicBool>,
}

async fn metrics(State(h): State<Health>) -> impl IntoResponse {
    let mut buf = Vec::new();
    match TextEncoder::new().encode(&h.registry.gather(), &mut buf) {
        Ok(()) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
            buf,
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

async fn readyz(State(h): State<Health>) -> impl IntoResponse {
    if h.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ok")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "waiting for the API server")
    }
}

/// The router of the controller's HTTP port.
pub fn router(health: Health) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .with_state(health)
}

/// Serves the router on `addr` until `shutdown` resolves.
pub async fn serve(
    addr: SocketAddr,
    health: Health,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    axum::serve(listener, router(health))
        .with_graceful_shutdown(shutdown)
        .await
}
