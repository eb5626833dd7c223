//! Prometheus metrics of the worker (names carry units; labels stay bounded).

use std::sync::Mutex;

use prometheus::{
    Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, IntCounter, IntGauge, IntGaugeVec, Opts, Registry,
    TextEncoder,
};
use serde::Serialize;

/// Live numbers of the serving loop, for `/v1/capacity`.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LiveStats {
    pub used_blocks: usize,
    /// Free blocks, cached ones included (they are evicted on demand).
    pub free_blocks: usize,
    /// Free blocks that still hold a cached prefix (a later request may start from them).
    pub cached_blocks: usize,
    pub usage_ratio: f64,
    pub prefix_caching: bool,
    /// Prompt tokens looked up in the prefix cache and found there since start, and their
    /// ratio (0 before the first lookup).
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub prefix_cache_hit_rate: f64,
    pub running: usize,
    pub waiting: usize,
    pub preemptions: u64,
    pub finished: u64,
    pub failed: u64,
    pub steps: u64,
    pub tokens: u64,
}

/// Every metric the worker exports.
pub struct Metrics {
    pub registry: Registry,
    pub capacity_tokens: IntGauge,
    pub predicted_capacity_tokens: IntGauge,
    pub blocks: IntGaugeVec,
    pub usage_ratio: Gauge,
    pub max_concurrency: Gauge,
    pub full_layer_max_concurrency: Gauge,
    pub requests: IntGaugeVec,
    pub preemptions: IntCounter,
    pub finished: IntCounter,
    pub failed: IntCounter,
    pub tokens: IntCounter,
    pub attention_seconds: Histogram,
    pub step_seconds: Histogram,
    pub gpu_info: GaugeVec,
    pub vllm_usage: Gauge,
    pub vllm_running: IntGauge,
    pub vllm_waiting: IntGauge,
    pub vllm_preemptions: IntCounter,
    pub vllm_prompt_tokens: IntCounter,
    pub vllm_generation_tokens: IntCounter,
    pub vllm_ttft: Histogram,
    pub vllm_tpot: Histogram,
    pub vllm_e2e_latency: Histogram,
    pub vllm_cache_config: GaugeVec,
    pub vllm_prefix_queries: IntCounter,
    pub vllm_prefix_hits: IntCounter,
    live: Mutex<LiveStats>,
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
                    "KV-cache blocks by state, over all layer groups: used (held by requests), free (cached included), cached (free blocks holding a cached prefix)",
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
            full_layer_max_concurrency: Gauge::new(
                "kvfleet_kv_cache_full_layer_max_concurrency",
                "Requests of maxModelLen tokens the same KV pool bytes would hold at once if every layer, sliding-window ones included, were budgeted for maxModelLen",
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
            step_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    "kvfleet_step_seconds",
                    "Time of one engine step of the served model (forward pass, attention and sampling input)",
                )
                .buckets(prometheus::exponential_buckets(1e-4, 2.0, 18)?),
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
            vllm_preemptions: IntCounter::new(
                "vllm:num_preemptions_total",
                "Requests preempted for lack of KV blocks (vLLM's name)",
            )?,
            vllm_prompt_tokens: IntCounter::new(
                "vllm:prompt_tokens_total",
                "Prompt tokens of requests that produced their first token (vLLM's name)",
            )?,
            vllm_generation_tokens: IntCounter::new(
                "vllm:generation_tokens_total",
                "Output tokens sampled (vLLM's name)",
            )?,
            vllm_ttft: Histogram::with_opts(
                HistogramOpts::new(
                    "vllm:time_to_first_token_seconds",
                    "Time from a request's arrival to its first output token (vLLM's name)",
                )
                .buckets(latency_buckets()),
            )?,
            vllm_tpot: Histogram::with_opts(
                HistogramOpts::new(
                    "vllm:time_per_output_token_seconds",
                    "Time between consecutive output tokens of a request (vLLM's name)",
                )
                .buckets(latency_buckets()),
            )?,
            vllm_e2e_latency: Histogram::with_opts(
                HistogramOpts::new(
                    "vllm:e2e_request_latency_seconds",
                    "Time from a request's arrival to its end (vLLM's name)",
                )
                .buckets(latency_buckets()),
            )?,
            vllm_cache_config: GaugeVec::new(
                Opts::new(
                    "vllm:cache_config_info",
                    "The served model's KV cache as allocated (vLLM's name; the value is 1)",
                ),
                &["block_size", "num_gpu_blocks", "cache_dtype"],
            )?,
            vllm_prefix_queries: IntCounter::new(
                "vllm:prefix_cache_queries_total",
                "Prompt tokens looked up in the prefix cache when requests were scheduled (vLLM's name)",
            )?,
            vllm_prefix_hits: IntCounter::new(
                "vllm:prefix_cache_hits_total",
                "Prompt tokens found in the prefix cache when requests were scheduled (vLLM's name)",
            )?,
            live: Mutex::new(LiveStats::default()),
            registry,
        };
        let r = &m.registry;
        r.register(Box::new(m.capacity_tokens.clone()))?;
        r.register(Box::new(m.predicted_capacity_tokens.clone()))?;
        r.register(Box::new(m.blocks.clone()))?;
        r.register(Box::new(m.usage_ratio.clone()))?;
        r.register(Box::new(m.max_concurrency.clone()))?;
        r.register(Box::new(m.full_layer_max_concurrency.clone()))?;
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
        r.register(Box::new(m.step_seconds.clone()))?;
        r.register(Box::new(m.vllm_preemptions.clone()))?;
        r.register(Box::new(m.vllm_prompt_tokens.clone()))?;
        r.register(Box::new(m.vllm_generation_tokens.clone()))?;
        r.register(Box::new(m.vllm_ttft.clone()))?;
        r.register(Box::new(m.vllm_tpot.clone()))?;
        r.register(Box::new(m.vllm_e2e_latency.clone()))?;
        r.register(Box::new(m.vllm_cache_config.clone()))?;
        r.register(Box::new(m.vllm_prefix_queries.clone()))?;
        r.register(Box::new(m.vllm_prefix_hits.clone()))?;
        // Present from the first scrape, before the engine runs.
        for s in ["free", "used", "cached"] {
            m.blocks.with_label_values(&[s]).set(0);
        }
        for s in ["running", "waiting"] {
            m.requests.with_label_values(&[s]).set(0);
        }
        Ok(m)
    }

    /// Labels `vllm:cache_config_info` with the pools the served model allocated.
    pub fn set_cache_config(&self, block_size: usize, blocks: usize, dtype: &str) {
        self.vllm_cache_config.reset();
        self.vllm_cache_config
            .with_label_values(&[
                block_size.to_string().as_str(),
                blocks.to_string().as_str(),
                dtype,
            ])
            .set(1.0);
    }

    pub fn set_live(&self, live: LiveStats) {
        if let Ok(mut l) = self.live.lock() {
            *l = live;
        }
    }

    pub fn live(&self) -> LiveStats {
        self.live.lock().map(|l| l.clone()).unwrap_or_default()
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

/// Request latency buckets (seconds): 5 ms to 2 minutes.
fn latency_buckets() -> Vec<f64> {
    vec![
        0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
        80.0, 120.0,
    ]
}
