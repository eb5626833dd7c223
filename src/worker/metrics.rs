//! Prometheus metrics of the worker (names carry units; labels stay bounded).

use prometheus::{
    Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, IntCounter, IntGauge, IntGaugeVec, Opts, Registry,
    TextEncoder,
};

/// Every metric the worker exports.
pub struct Metrics {
    pub registry: Registry,
    pub capacity_tokens: IntGauge,
    pub predicted_capacity_tokens: IntGauge,
    pub blocks: IntGaugeVec,
    pub usage_ratio: Gauge,
    pub max_concurrency: Gauge,
    pub requests: IntGaugeVec,
    pub preemptions: IntCounter,
    pub finished: IntCounter,
    pub failed: IntCounter,
    pub tokens: IntCounter,
    pub attention_seconds: Histogram,
    pub gpu_info: GaugeVec,
    pub vllm_usage: Gauge,
    pub vllm_running: IntGauge,
    pub vllm_waiting: IntGauge,
}

impl Metrics {
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let m = Metrics {
            capacity_tokens: IntGauge::new(
                "kvfleet_kv_cache_capacity_tokens",
                "Tokens of context the KV pool holds at maxModelLen (measured after sizing the pool)",
            )?,
            predicted_capacity_tokens: IntGauge::new(
                "kvfleet_kv_cache_predicted_capacity_tokens",
                "Tokens the planner predicts for this configuration and memory",
            )?,
            blocks: IntGaugeVec::new(
                Opts::new(
                    "kvfleet_kv_cache_blocks",
                    "KV-cache blocks by state, over all layer groups",
                ),
                &["state"],
            )?,
            usage_ratio: Gauge::new(
                "kvfleet_kv_cache_usage_ratio",
                "Fraction of KV-cache blocks in use",
            )?,
            max_concurrency: Gauge::new(
                "kvfleet_kv_cache_max_concurrency",
                "Requests of maxModelLen tokens the KV pool holds at once",
            )?,
            requests: IntGaugeVec::new(Opts::new("kvfleet_requests", "Requests by state"), &["state"])?,
            preemptions: IntCounter::new(
                "kvfleet_preemptions_total",
                "Requests preempted (recompute) for lack of KV blocks",
            )?,
            finished: IntCounter::new(
                "kvfleet_requests_finished_total",
                "Requests that produced all their output tokens",
            )?,
            failed: IntCounter::new(
                "kvfleet_requests_failed_total",
                "Requests that ended without finishing",
            )?,
            tokens: IntCounter::new("kvfleet_tokens_total", "Tokens computed (prefill and decode)")?,
            attention_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    "kvfleet_attention_seconds",
                    "Time of one step's attention over all layers (append and attention calls)",
                )
                .buckets(prometheus::exponential_buckets(1e-5, 2.5, 16)?),
            )?,
            gpu_info: GaugeVec::new(
                Opts::new(
                    "kvfleet_gpu_info",
                    "The device the engine runs on (1); product cpu when none",
                ),
                &["product", "compute_capability"],
            )?,
            vllm_usage: Gauge::new(
                "vllm:kv_cache_usage_perc",
                "KV-cache usage, 1 = 100% (vLLM's name)",
            )?,
            vllm_running: IntGauge::new("vllm:num_requests_running", "Requests running (vLLM's name)")?,
            vllm_waiting: IntGauge::new("vllm:num_requests_waiting", "Requests waiting (vLLM's name)")?,
            registry,
        };
        let r = &m.registry;
        r.register(Box::new(m.capacity_tokens.clone()))?;
        r.register(Box::new(m.predicted_capacity_tokens.clone()))?;
        r.register(Box::new(m.blocks.clone()))?;
        r.register(Box::new(m.usage_ratio.clone()))?;
        r.register(Box::new(m.max_concurrency.clone()))?;
        r.register(Box::new(m.requests.clone()))?;
        r.register(Box::new(m.preemptions.clone()))?;
        r.register(Box::new(m.finished.clone()))?;
        r.register(Box::new(m.failed.clone()))?;
        r.register(Box::new(m.tokens.clone()))?;
        r.register(Box::new(m.attention_seconds.clone()))?;
        r.register(Box::new(m.gpu_info.clone()))?;
        r.register(Box::new(m.vllm_usage.clone()))?;
        r.register(Box::new(m.vllm_running.clone()))?;
        r.register(Box::new(m.vllm_waiting.clone()))?;
        // Present from the first scrape, before the engine runs.
        for s in ["free", "used"] {
            m.blocks.with_label_values(&[s]).set(0);
        }
        for s in ["running", "waiting"] {
            m.requests.with_label_values(&[s]).set(0);
        }
        Ok(m)
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut buf = Vec::new();
        let enc = TextEncoder::new();
        if let Err(error) = enc.encode(&self.registry.gather(), &mut buf) {
            tracing::warn!(%error, "cannot encode metrics");
        }
        String::from_utf8(buf).unwrap_or_default()
    }
}
