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
    Encoder, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
    TextEncoder,
};

/// Reconcile metrics, registered on one registry.
#[derive(Clone)]
pub struct Metrics {
    pub runs: IntCounter,
    pub failures: IntCounterVec,
    pub duration: HistogramVec,
    pub leader: IntGauge,
    /// Worker containers seen terminated by a failed preflight, per InferenceDeployment.
    pub preflight_failures: IntCounterVec,
    /// The autoscaler's view per InferenceDeployment (`spec.autoscaling`, engine kvfleet):
    /// replicas by kind (desired, recommended, observed) and KV tokens by kind (demand,
    /// capacity).
    pub autoscaling_replicas: IntGaugeVec,
    pub autoscaling_tokens: IntGaugeVec,
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
        let preflight_failures = IntCounterVec::new(
            Opts::new(
                "kvfleet_preflight_failures_total",
                "Worker containers seen terminated by a failed preflight (exit 2, 3 or 4)",
            ),
            &["namespace", "inferencedeployment"],
        )?;
        let autoscaling_replicas = IntGaugeVec::new(
            Opts::new(
                "kvfleet_autoscaling_replicas",
                "Replicas as the KV-demand autoscaler sees them: desired (what it set), recommended (before stabilization and step limits), observed (workers whose gauges it read), min and max (spec.autoscaling bounds)",
            ),
            &["namespace", "inferencedeployment", "kind"],
        )?;
        let autoscaling_tokens = IntGaugeVec::new(
            Opts::new(
                "kvfleet_autoscaling_tokens",
                "KV tokens the autoscaler last read, summed over the workers (and the router's held requests): demand and capacity",
            ),
            &["namespace", "inferencedeployment", "kind"],
        )?;
        registry.register(Box::new(autoscaling_replicas.clone()))?;
        registry.register(Box::new(autoscaling_tokens.clone()))?;
        registry.register(Box::new(runs.clone()))?;
        registry.register(Box::new(failures.clone()))?;
        registry.register(Box::new(duration.clone()))?;
        registry.register(Box::new(leader.clone()))?;
        registry.register(Box::new(preflight_failures.clone()))?;
        Ok(Metrics {
            runs,
            failures,
            duration,
            leader,
            preflight_failures,
            autoscaling_replicas,
            autoscaling_tokens,
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

/// `kvfleet_inferencedeployment_condition{namespace,inferencedeployment,type,status}`: 1 for
/// each condition's current status, 0 for its other statuses. Computed at scrape time from the
/// controller's own cache, so a deleted object leaves no stale series behind.
pub struct ConditionCollector {
    store: kube::runtime::reflector::Store<kube::core::DeserializeGuard<crate::api::InferenceDeployment>>,
    desc: Vec<prometheus::core::Desc>,
}

const CONDITION_METRIC: &str = "kvfleet_inferencedeployment_condition";
const CONDITION_HELP: &str = "Status conditions of each InferenceDeployment (1 = current status)";
const CONDITION_LABELS: [&str; 4] = ["namespace", "inferencedeployment", "type", "status"];

impl ConditionCollector {
    pub fn new(
        store: kube::runtime::reflector::Store<kube::core::DeserializeGuard<crate::api::InferenceDeployment>>,
    ) -> Result<Self, prometheus::Error> {
        let gauge =
            prometheus::IntGaugeVec::new(Opts::new(CONDITION_METRIC, CONDITION_HELP), &CONDITION_LABELS)?;
        let desc = prometheus::core::Collector::desc(&gauge)
            .into_iter()
            .cloned()
            .collect();
        Ok(Self { store, desc })
    }
}

impl prometheus::core::Collector for ConditionCollector {
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        self.desc.iter().collect()
    }

    fn collect(&self) -> Vec<prometheus::proto::MetricFamily> {
        let Ok(gauge) =
            prometheus::IntGaugeVec::new(Opts::new(CONDITION_METRIC, CONDITION_HELP), &CONDITION_LABELS)
        else {
            return Vec::new();
        };
        for guard in self.store.state() {
            // A malformed object has no conditions we could trust.
            let Ok(obj) = guard.0.as_ref() else { continue };
            let ns = obj.metadata.namespace.as_deref().unwrap_or_default();
            let name = obj.metadata.name.as_deref().unwrap_or_default();
            for c in obj.status.iter().flat_map(|s| s.conditions.iter()) {
                for status in ["True", "False", "Unknown"] {
                    gauge
                        .with_label_values(&[ns, name, c.type_.as_str(), status])
                        .set(i64::from(c.status == status));
                }
            }
        }
        prometheus::core::Collector::collect(&gauge)
    }
}

#[cfg(test)]
mod condition_tests {
    use super::*;
    use kube::runtime::{reflector, watcher};

    #[test]
    fn conditions_are_exported_from_the_cache_and_vanish_with_the_object() {
        let (store, mut writer) =
            reflector::store::<kube::core::DeserializeGuard<crate::api::InferenceDeployment>>();
        let obj: crate::api::InferenceDeployment = serde_json::from_value(serde_json::json!({
            "apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": "llama", "namespace": "ml"},
            "spec": {"model": {"name": "m", "geometry": {"layers": 2, "queryHeads": 4, "kvHeads": 1, "headDim": 64}}},
            "status": {"conditions": [{"type": "Compatible", "status": "False", "reason": "NoCompatibleNode",
                "message": "m", "lastTransitionTime": "2026-11-22T00:00:00Z"}]}
        }))
        .unwrap();
        let obj = kube::core::DeserializeGuard(Ok(obj));
        writer.apply_watcher_event(&watcher::Event::Apply(obj.clone()));
        let registry = Registry::new();
        registry
            .register(Box::new(ConditionCollector::new(store).unwrap()))
            .unwrap();
        let text = {
            let mut buf = Vec::new();
            TextEncoder::new().encode(&registry.gather(), &mut buf).unwrap();
            String::from_utf8(buf).unwrap()
        };
        assert!(text.contains(
            r#"kvfleet_inferencedeployment_condition{inferencedeployment="llama",namespace="ml",status="False",type="Compatible"} 1"#
        ), "{text}");
        assert!(text.contains(
            r#"kvfleet_inferencedeployment_condition{inferencedeployment="llama",namespace="ml",status="True",type="Compatible"} 0"#
        ), "{text}");
        writer.apply_watcher_event(&watcher::Event::Delete(obj));
        let families = registry.gather();
        assert!(
            families.iter().all(|f| f.get_metric().is_empty()),
            "stale series after deletion"
        );
    }
}
