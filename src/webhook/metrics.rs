//! Prometheus metrics of the webhook, in a registry of its own (no globals, so several
//! webhooks can run in one test process).

use std::time::Duration;

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, Opts, Registry, TextEncoder,
};

/// The webhook's metrics.
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    requests: IntCounterVec,
    duration: HistogramVec,
    warnings: IntCounterVec,
    pub nodes: IntGauge,
    pub cache_synced: IntGauge,
    pub cert_not_after: IntGauge,
    pub cert_reloads: IntCounterVec,
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new(
                "kvfleet_webhook_admission_requests_total",
                "Admission requests answered, by operation (CREATE, UPDATE, ...) and result \
                 (allowed, denied, invalid, not_ready, skipped)",
            ),
            &["operation", "result"],
        )?;
        let duration = HistogramVec::new(
            HistogramOpts::new(
                "kvfleet_webhook_admission_duration_seconds",
                "Time from receiving an admission request body to having its answer serialised",
            )
            .buckets(vec![
                0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                1.0,
            ]),
            &["operation"],
        )?;
        let warnings = IntCounterVec::new(
            Opts::new(
                "kvfleet_webhook_admission_warnings_total",
                "Warnings returned to clients with admitted or denied requests, by operation",
            ),
            &["operation"],
        )?;
        let nodes = IntGauge::new("kvfleet_webhook_nodes", "Nodes in the webhook's node cache")?;
        let cache_synced = IntGauge::new(
            "kvfleet_webhook_node_cache_synced",
            "1 once the node cache has listed all nodes, 0 before (the webhook is not ready)",
        )?;
        let cert_not_after = IntGauge::new(
            "kvfleet_webhook_serving_certificate_expiry_timestamp_seconds",
            "Unix time at which the serving certificate in use expires",
        )?;
        let cert_reloads = IntCounterVec::new(
            Opts::new(
                "kvfleet_webhook_certificate_reloads_total",
                "Serving-certificate reloads, by result (ok, error)",
            ),
            &["result"],
        )?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(duration.clone()))?;
        registry.register(Box::new(warnings.clone()))?;
        registry.register(Box::new(nodes.clone()))?;
        registry.register(Box::new(cache_synced.clone()))?;
        registry.register(Box::new(cert_not_after.clone()))?;
        registry.register(Box::new(cert_reloads.clone()))?;
        Ok(Metrics {
            registry,
            requests,
            duration,
            warnings,
            nodes,
            cache_synced,
            cert_not_after,
            cert_reloads,
        })
    }

    /// Records one answered request.
    pub fn observe(&self, operation: &str, result: &str, warnings: usize, elapsed: Duration) {
        self.requests.with_label_values(&[operation, result]).inc();
        self.duration
            .with_label_values(&[operation])
            .observe(elapsed.as_secs_f64());
        if warnings > 0 {
            self.warnings
                .with_label_values(&[operation])
                .inc_by(warnings as u64);
        }
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        // Encoding into a Vec only fails on metric families that break the format,
        // which our fixed set does not.
        if let Err(error) = TextEncoder::new().encode(&self.registry.gather(), &mut out) {
            tracing::warn!(%error, "cannot encode metrics");
        }
        String::from_utf8_lossy(&out).into_owned()
    }
}
