//! Prometheus metrics of the worker (names carry units; labels stay bounded).
//!
//! The `vllm:*` series carry vLLM's names, bucket boundaries (vllm/v1/metrics/loggers.py) and
//! labels: every one of them is exported with `model_name` (the served model) and `engine`
//! (`"0"`: one engine per worker), added at scrape time, so that readers that filter on them
//! (inference-perf, vLLM's dashboards, the endpoint picker) find the worker's numbers.

use std::sync::{Mutex, OnceLock, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prometheus::proto::LabelPair;
use prometheus::{
    Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Opts, Registry, TextEncoder,
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
    /// The longest new request, in tokens, the free pages of every KV group could hold now,
    /// sliding-window groups counted as holding only their window (the router's room figure;
    /// at most maxModelLen).
    pub free_tokens: usize,
    /// The autoscaling signal (`kvfleet_kv_demand_tokens`, `kvfleet_kv_capacity_tokens`,
    /// `kvfleet_kv_free_tokens`): in tokens of maxModelLen requests, window-aware.
    pub kv_demand_tokens: u64,
    pub kv_capacity_tokens: u64,
    pub kv_free_tokens: u64,
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
    /// Speculative decoding, when it is configured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speculative: Option<SpecStats>,
}

/// Speculative decoding since start (`/v1/capacity`'s `live.speculative`).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SpecStats {
    pub method: &'static str,
    pub num_speculative_tokens: usize,
    /// Proposals verified, the tokens they held, and those accepted.
    pub drafts: u64,
    pub draft_tokens: u64,
    pub accepted_tokens: u64,
    /// `accepted_tokens / draft_tokens` (0 before the first proposal).
    pub acceptance_rate: f64,
    /// Proposals whose token at each position (0-based) was accepted.
    pub accepted_per_position: Vec<u64>,
    /// Steps that verified at least one proposal, and steps run while speculation was off
    /// for the batch size.
    pub speculative_steps: u64,
    pub disabled_steps: u64,
}

/// vLLM's speculative-decoding counters (`vllm/v1/spec_decode/metrics.py`), registered only
/// when speculation is configured, as vLLM does.
pub struct SpecMetrics {
    pub drafts: IntCounter,
    pub draft_tokens: IntCounter,
    pub accepted_tokens: IntCounter,
    pub accepted_per_pos: IntCounterVec,
}

/// Every metric the worker exports.
pub struct Metrics {
    pub registry: Registry,
    pub capacity_tokens: IntGauge,
    pub predicted_capacity_tokens: IntGauge,
    /// The autoscaling signal (engine::demand): demand, capacity and room in tokens of
    /// maxModelLen requests, window-aware.
    pub kv_demand_tokens: IntGauge,
    pub kv_capacity_tokens: IntGauge,
    pub kv_free_tokens: IntGauge,
    pub blocks: IntGaugeVec,
    pub usage_ratio: Gauge,
    pub max_concurrency: Gauge,
    pub full_layer_max_concurrency: Gauge,
    pub requests: IntGaugeVec,
    pub preemptions: IntCounter,
    pub finished: IntCounter,
    pub failed: IntCounter,
    /// Requests whose client went away before their end (not failures: apart from `failed`).
    pub cancelled: IntCounter,
    /// Requests stopped at the request timeout (504, or a stream's error chunk).
    pub timed_out: IntCounter,
    pub tokens: IntCounter,
    /// KV-event connections ended for what their peer sent or refused at the connection
    /// limit, by reason; and messages a full subscriber queue did not take.
    pub kv_events_rejected: IntCounterVec,
    pub kv_events_dropped: IntCounter,
    pub attention_seconds: Histogram,
    pub step_seconds: Histogram,
    /// Mixture of experts: the tokens one expert of one sparse layer took in a step (one
    /// observation per expert and layer a step), the spread of the experts' load.
    pub moe_expert_tokens: Histogram,
    pub gpu_info: GaugeVec,
    pub vllm_usage: Gauge,
    pub vllm_running: IntGauge,
    pub vllm_waiting: IntGauge,
    pub vllm_preemptions: IntCounter,
    pub vllm_prompt_tokens: IntCounter,
    pub vllm_prompt_tokens_cached: IntCounter,
    pub vllm_request_params_n: Histogram,
    pub vllm_generation_tokens: IntCounter,
    pub vllm_ttft: Histogram,
    pub vllm_tpot: Histogram,
    pub vllm_e2e_latency: Histogram,
    pub vllm_cache_config: GaugeVec,
    pub vllm_prefix_queries: IntCounter,
    pub vllm_prefix_hits: IntCounter,
    pub vllm_itl: Histogram,
    pub vllm_request_tpot: Histogram,
    pub vllm_request_success: IntCounterVec,
    pub vllm_queue_time: Histogram,
    pub vllm_prefill_time: Histogram,
    pub vllm_decode_time: Histogram,
    pub vllm_inference_time: Histogram,
    pub vllm_iteration_tokens: Histogram,
    pub vllm_lora_info: GaugeVec,
    /// Per request, bucketed up to maxModelLen (registered once the served model is known).
    vllm_request_prompt_tokens: OnceLock<Histogram>,
    vllm_request_generation_tokens: OnceLock<Histogram>,
    vllm_request_max_generation_tokens: OnceLock<Histogram>,
    vllm_request_params_max_tokens: OnceLock<Histogram>,
    vllm_request_prefill_computed_tokens: OnceLock<Histogram>,
    /// Registered by [`Metrics::set_speculative`].
    spec: OnceLock<SpecMetrics>,
    /// The served model's name, the `model_name` of every `vllm:*` series.
    model_name: RwLock<String>,
    live: Mutex<LiveStats>,
}

/// A request that produced its last token: what vLLM's per-request series observe.
#[derive(Debug, Clone, Copy)]
pub struct Finished<'a> {
    /// OpenAI's `finish_reason` (`stop`, `length`).
    pub reason: &'a str,
    /// Arrival to the last token.
    pub e2e: Duration,
    /// Arrival to first scheduled (waiting).
    pub queue: Duration,
    /// First scheduled to the first token.
    pub prefill: Duration,
    /// First token to the last.
    pub decode: Duration,
    pub prompt_tokens: usize,
    pub generation_tokens: usize,
    /// Its `max_tokens` (given, or the default).
    pub max_tokens: usize,
    /// Prompt tokens the prefix cache held when it started.
    pub cached_tokens: usize,
}

/// The labels vLLM puts on its series, in its order; `vllm:lora_requests_info` has its own.
const ENGINE: &str = "0";
const LORA_INFO: &str = "vllm:lora_requests_info";
/// vLLM's finish reasons, present from the first scrape.
const FINISH_REASONS: [&str; 3] = ["stop", "length", "abort"];

impl Metrics {
    /// Sets the autoscaling gauges; returns demand, capacity and free tokens as exported.
    pub fn set_kv_demand(&self, d: &kvfleet_engine::engine::demand::KvDemand) -> (u64, u64, u64) {
        let out = (
            d.demand_tokens.round() as u64,
            d.capacity_tokens.floor() as u64,
            d.free_tokens.floor() as u64,
        );
        self.kv_demand_tokens.set(out.0 as i64);
        self.kv_capacity_tokens.set(out.1 as i64);
        self.kv_free_tokens.set(out.2 as i64);
        out
    }

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
            kv_demand_tokens: IntGauge::new(
                "kvfleet_kv_demand_tokens",
                "KV the running and waiting requests need to finish (prompt plus output budget), as the share of the most loaded layer group times kvfleet_kv_capacity_tokens: window-aware, in tokens of maxModelLen requests, so replicas add up",
            )?,
            kv_capacity_tokens: IntGauge::new(
                "kvfleet_kv_capacity_tokens",
                "KV the pool holds, in tokens of maxModelLen requests (the smallest layer group's pages over one request's pages, times maxModelLen)",
            )?,
            kv_free_tokens: IntGauge::new(
                "kvfleet_kv_free_tokens",
                "KV the free pages hold (cached ones included: evicted on demand), in the unit of kvfleet_kv_capacity_tokens",
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
                "Requests that ended without finishing for the server's reasons (a failed step, the end of a shutdown drain); client disconnects are in kvfleet_requests_cancelled_total, request timeouts in kvfleet_requests_timed_out_total",
            )?,
            cancelled: IntCounter::new(
                "kvfleet_requests_cancelled_total",
                "Requests whose client disconnected before their end (not counted as failed or timed out)",
            )?,
            timed_out: IntCounter::new(
                "kvfleet_requests_timed_out_total",
                "Requests the worker stopped at its request timeout (--request-timeout-seconds: a 504, or a stream's request_timeout error), not counted as cancelled or failed",
            )?,
            tokens: IntCounter::new("kvfleet_tokens_total", "Tokens computed (prefill and decode)")?,
            kv_events_rejected: IntCounterVec::new(
                Opts::new(
                    "kvfleet_kv_events_rejected_total",
                    "KV-event port connections ended for what the peer sent, or refused at the connection limit, by reason",
                ),
                &["reason"],
            )?,
            kv_events_dropped: IntCounter::new(
                "kvfleet_kv_events_dropped_total",
                "KV-event messages a subscriber missed because its send queue was full",
            )?,
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
            moe_expert_tokens: Histogram::with_opts(
                HistogramOpts::new(
                    "kvfleet_moe_expert_tokens",
                    "Tokens one expert of one sparse layer took in one engine step (mixture-of-experts \
                     models; an observation per expert and layer a step)",
                )
                .buckets(
                    std::iter::once(0.0)
                        .chain(prometheus::exponential_buckets(1.0, 2.0, 16)?)
                        .collect(),
                ),
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
            vllm_prompt_tokens_cached: IntCounter::new(
                "vllm:prompt_tokens_cached_total",
                "Prompt tokens of requests that produced their first token which the prefix cache held, not computed (vLLM's name)",
            )?,
            // vLLM's buckets for `n`; the worker refuses n > 1, so every request observes 1.
            vllm_request_params_n: Histogram::with_opts(
                HistogramOpts::new(
                    "vllm:request_params_n",
                    "Per finished request: its n parameter (vLLM's name)",
                )
                .buckets(vec![1.0, 2.0, 5.0, 10.0, 20.0]),
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
                .buckets(TTFT_BUCKETS.to_vec()),
            )?,
            vllm_tpot: Histogram::with_opts(
                HistogramOpts::new(
                    "vllm:time_per_output_token_seconds",
                    "Time between consecutive output tokens of a request (vLLM's deprecated name of vllm:inter_token_latency_seconds)",
                )
                .buckets(TOKEN_LATENCY_BUCKETS.to_vec()),
            )?,
            vllm_e2e_latency: Histogram::with_opts(
                HistogramOpts::new(
                    "vllm:e2e_request_latency_seconds",
                    "Time from a request's arrival to its end (vLLM's name)",
                )
                .buckets(REQUEST_LATENCY_BUCKETS.to_vec()),
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
            vllm_itl: Histogram::with_opts(
                HistogramOpts::new(
                    "vllm:inter_token_latency_seconds",
                    "Time between consecutive output tokens of a request (vLLM's name)",
                )
                .buckets(TOKEN_LATENCY_BUCKETS.to_vec()),
            )?,
            vllm_request_tpot: Histogram::with_opts(
                HistogramOpts::new(
                    "vllm:request_time_per_output_token_seconds",
                    "Per finished request: its decode time over its output tokens after the first (vLLM's name)",
                )
                .buckets(TOKEN_LATENCY_BUCKETS.to_vec()),
            )?,
            vllm_request_success: IntCounterVec::new(
                Opts::new(
                    "vllm:request_success_total",
                    "Requests that ended, by finish reason: stop, length, abort (cancelled, timed out, failed or cut by shutdown) (vLLM's name)",
                ),
                &["finished_reason"],
            )?,
            vllm_queue_time: request_latency(
                "vllm:request_queue_time_seconds",
                "Per finished request: time from arrival to first scheduled, waiting (vLLM's name)",
            )?,
            vllm_prefill_time: request_latency(
                "vllm:request_prefill_time_seconds",
                "Per finished request: time from first scheduled to its first token (vLLM's name)",
            )?,
            vllm_decode_time: request_latency(
                "vllm:request_decode_time_seconds",
                "Per finished request: time from its first token to its last (vLLM's name)",
            )?,
            vllm_inference_time: request_latency(
                "vllm:request_inference_time_seconds",
                "Per finished request: time from first scheduled to its last token, prefill and decode (vLLM's name)",
            )?,
            vllm_iteration_tokens: Histogram::with_opts(
                HistogramOpts::new(
                    "vllm:iteration_tokens_total",
                    "Tokens computed by one engine step, prefill and decode (vLLM's name)",
                )
                .buckets(vec![
                    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
                ]),
            )?,
            vllm_lora_info: GaugeVec::new(
                Opts::new(
                    LORA_INFO,
                    "LoRA adapters: the most that can run, and those running and waiting (none: this worker serves none); the value is the time of the scrape, as vLLM sets it (vLLM's name)",
                ),
                &["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            )?,
            vllm_request_prompt_tokens: OnceLock::new(),
            vllm_request_generation_tokens: OnceLock::new(),
            vllm_request_max_generation_tokens: OnceLock::new(),
            vllm_request_params_max_tokens: OnceLock::new(),
            vllm_request_prefill_computed_tokens: OnceLock::new(),
            spec: OnceLock::new(),
            model_name: RwLock::new(String::new()),
            live: Mutex::new(LiveStats::default()),
            registry,
        };
        let r = &m.registry;
        r.register(Box::new(m.capacity_tokens.clone()))?;
        r.register(Box::new(m.predicted_capacity_tokens.clone()))?;
        r.register(Box::new(m.kv_demand_tokens.clone()))?;
        r.register(Box::new(m.kv_capacity_tokens.clone()))?;
        r.register(Box::new(m.kv_free_tokens.clone()))?;
        r.register(Box::new(m.blocks.clone()))?;
        r.register(Box::new(m.usage_ratio.clone()))?;
        r.register(Box::new(m.max_concurrency.clone()))?;
        r.register(Box::new(m.full_layer_max_concurrency.clone()))?;
        r.register(Box::new(m.requests.clone()))?;
        r.register(Box::new(m.preemptions.clone()))?;
        r.register(Box::new(m.finished.clone()))?;
        r.register(Box::new(m.failed.clone()))?;
        r.register(Box::new(m.cancelled.clone()))?;
        r.register(Box::new(m.timed_out.clone()))?;
        r.register(Box::new(m.tokens.clone()))?;
        r.register(Box::new(m.kv_events_rejected.clone()))?;
        r.register(Box::new(m.kv_events_dropped.clone()))?;
        for reason in super::zmtp::ZmtpError::REASONS {
            m.kv_events_rejected.with_label_values(&[reason]);
        }
        r.register(Box::new(m.attention_seconds.clone()))?;
        r.register(Box::new(m.moe_expert_tokens.clone()))?;
        r.register(Box::new(m.gpu_info.clone()))?;
        r.register(Box::new(m.vllm_usage.clone()))?;
        r.register(Box::new(m.vllm_running.clone()))?;
        r.register(Box::new(m.vllm_waiting.clone()))?;
        r.register(Box::new(m.step_seconds.clone()))?;
        r.register(Box::new(m.vllm_preemptions.clone()))?;
        r.register(Box::new(m.vllm_prompt_tokens.clone()))?;
        r.register(Box::new(m.vllm_prompt_tokens_cached.clone()))?;
        r.register(Box::new(m.vllm_request_params_n.clone()))?;
        r.register(Box::new(m.vllm_generation_tokens.clone()))?;
        r.register(Box::new(m.vllm_ttft.clone()))?;
        r.register(Box::new(m.vllm_tpot.clone()))?;
        r.register(Box::new(m.vllm_e2e_latency.clone()))?;
        r.register(Box::new(m.vllm_cache_config.clone()))?;
        r.register(Box::new(m.vllm_prefix_queries.clone()))?;
        r.register(Box::new(m.vllm_prefix_hits.clone()))?;
        r.register(Box::new(m.vllm_itl.clone()))?;
        r.register(Box::new(m.vllm_request_tpot.clone()))?;
        r.register(Box::new(m.vllm_request_success.clone()))?;
        r.register(Box::new(m.vllm_queue_time.clone()))?;
        r.register(Box::new(m.vllm_prefill_time.clone()))?;
        r.register(Box::new(m.vllm_decode_time.clone()))?;
        r.register(Box::new(m.vllm_inference_time.clone()))?;
        r.register(Box::new(m.vllm_iteration_tokens.clone()))?;
        r.register(Box::new(m.vllm_lora_info.clone()))?;
        for reason in FINISH_REASONS {
            m.vllm_request_success.with_label_values(&[reason]).inc_by(0);
        }
        // Present from the first scrape, before the engine runs.
        for s in ["free", "used", "cached"] {
            m.blocks.with_label_values(&[s]).set(0);
        }
        for s in ["running", "waiting"] {
            m.requests.with_label_values(&[s]).set(0);
        }
        Ok(m)
    }

    /// Names the served model (the `model_name` of the `vllm:*` series) and registers the
    /// per-request token histograms, bucketed 1-2-5 up to its maxModelLen as vLLM does. Later
    /// calls rename; the buckets stay those of the first.
    pub fn set_served(&self, model_name: &str, max_model_len: usize) {
        if let Ok(mut n) = self.model_name.write() {
            *n = model_name.to_owned();
        }
        let tokens = |name: &str, help: &str, cell: &OnceLock<Histogram>| {
            let buckets = buckets_1_2_5(max_model_len.max(1));
            let Ok(h) = Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets)) else {
                return;
            };
            if cell.set(h.clone()).is_ok() {
                if let Err(error) = self.registry.register(Box::new(h)) {
                    tracing::warn!(%error, name, "cannot register a metric");
                }
            }
        };
        tokens(
            "vllm:request_prompt_tokens",
            "Per finished request: its prompt tokens (vLLM's name)",
            &self.vllm_request_prompt_tokens,
        );
        tokens(
            "vllm:request_generation_tokens",
            "Per finished request: its output tokens (vLLM's name)",
            &self.vllm_request_generation_tokens,
        );
        tokens(
            "vllm:request_max_num_generation_tokens",
            "Per finished request: the most output tokens of its sequences, its output tokens with n = 1 (vLLM's name)",
            &self.vllm_request_max_generation_tokens,
        );
        tokens(
            "vllm:request_params_max_tokens",
            "Per finished request: its max_tokens parameter, or the default it got (vLLM's name)",
            &self.vllm_request_params_max_tokens,
        );
        tokens(
            "vllm:request_prefill_kv_computed_tokens",
            "Per finished request: prompt tokens its prefill computed, those the prefix cache held left out (vLLM's name)",
            &self.vllm_request_prefill_computed_tokens,
        );
    }

    /// Registers vLLM's speculative-decoding counters, each position of a proposal of up to
    /// `k` tokens present at 0 from the first scrape.
    pub fn set_speculative(&self, k: usize) -> Result<(), prometheus::Error> {
        let m = SpecMetrics {
            drafts: IntCounter::new(
                "vllm:spec_decode_num_drafts_total",
                "Proposals verified by speculative decoding (vLLM's name)",
            )?,
            draft_tokens: IntCounter::new(
                "vllm:spec_decode_num_draft_tokens_total",
                "Proposed tokens verified by speculative decoding (vLLM's name)",
            )?,
            accepted_tokens: IntCounter::new(
                "vllm:spec_decode_num_accepted_tokens_total",
                "Proposed tokens accepted by verification (vLLM's name)",
            )?,
            accepted_per_pos: IntCounterVec::new(
                Opts::new(
                    "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                    "Proposals whose token at this position was accepted (vLLM's name)",
                ),
                &["position"],
            )?,
        };
        for p in 0..k {
            m.accepted_per_pos.with_label_values(&[&p.to_string()]).inc_by(0);
        }
        self.registry.register(Box::new(m.drafts.clone()))?;
        self.registry.register(Box::new(m.draft_tokens.clone()))?;
        self.registry.register(Box::new(m.accepted_tokens.clone()))?;
        self.registry.register(Box::new(m.accepted_per_pos.clone()))?;
        let _ = self.spec.set(m);
        Ok(())
    }

    /// One verified proposal of `proposed` tokens of which the first `accepted` were taken.
    pub fn observe_proposal(&self, proposed: usize, accepted: usize) {
        let Some(m) = self.spec.get() else { return };
        m.drafts.inc();
        m.draft_tokens.inc_by(proposed as u64);
        m.accepted_tokens.inc_by(accepted as u64);
        for p in 0..accepted {
            m.accepted_per_pos.with_label_values(&[&p.to_string()]).inc();
        }
    }

    /// The gap between two consecutive output tokens of a request.
    pub fn observe_inter_token(&self, seconds: f64) {
        self.vllm_itl.observe(seconds);
        self.vllm_tpot.observe(seconds);
    }

    /// A request that produced its last token.
    pub fn observe_finished(&self, r: &Finished<'_>) {
        self.vllm_e2e_latency.observe(r.e2e.as_secs_f64());
        self.vllm_request_success.with_label_values(&[r.reason]).inc();
        self.vllm_queue_time.observe(r.queue.as_secs_f64());
        self.vllm_prefill_time.observe(r.prefill.as_secs_f64());
        self.vllm_decode_time.observe(r.decode.as_secs_f64());
        self.vllm_inference_time
            .observe((r.prefill + r.decode).as_secs_f64());
        let per_token = match r.generation_tokens {
            0 | 1 => 0.0,
            n => r.decode.as_secs_f64() / (n - 1) as f64,
        };
        self.vllm_request_tpot.observe(per_token);
        if let Some(h) = self.vllm_request_prompt_tokens.get() {
            h.observe(r.prompt_tokens as f64);
        }
        if let Some(h) = self.vllm_request_generation_tokens.get() {
            h.observe(r.generation_tokens as f64);
        }
        if let Some(h) = self.vllm_request_max_generation_tokens.get() {
            h.observe(r.generation_tokens as f64);
        }
        if let Some(h) = self.vllm_request_params_max_tokens.get() {
            h.observe(r.max_tokens as f64);
        }
        if let Some(h) = self.vllm_request_prefill_computed_tokens.get() {
            h.observe(r.prompt_tokens.saturating_sub(r.cached_tokens) as f64);
        }
        self.vllm_request_params_n.observe(1.0);
    }

    /// A request that ended without its last token (cancelled, timed out, failed, cut by
    /// shutdown): vLLM's `abort`, which vLLM counts for a request its caller stopped.
    pub fn observe_aborted(&self) {
        self.vllm_request_success.with_label_values(&["abort"]).inc();
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

    /// The text exposition format, with vLLM's labels on the `vllm:*` series.
    pub fn encode(&self) -> String {
        // No LoRA adapters here; vLLM sets the value to the time of its last update.
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        self.vllm_lora_info.with_label_values(&["0", "", ""]).set(now);
        let mut families = self.registry.gather();
        let model = self.model_name.read().map(|n| n.clone()).unwrap_or_default();
        let pair = |name: &str, value: &str| {
            let mut p = LabelPair::default();
            p.set_name(name.to_owned());
            p.set_value(value.to_owned());
            p
        };
        for family in &mut families {
            if !family.name().starts_with("vllm:") || family.name() == LORA_INFO {
                continue;
            }
            for metric in family.mut_metric() {
                let mut labels = vec![pair("model_name", &model), pair("engine", ENGINE)];
                labels.extend(metric.take_label());
                metric.set_label(labels);
            }
        }
        let mut buf = Vec::new();
        let enc = TextEncoder::new();
        if let Err(error) = enc.encode(&families, &mut buf) {
            tracing::warn!(%error, "cannot encode metrics");
        }
        String::from_utf8(buf).unwrap_or_default()
    }
}

/// vLLM's bucket boundaries (seconds). Time to first token: 1 ms to 2,560 s.
const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
];

/// Between tokens (inter-token latency, time per output token): 10 ms to 80 s.
const TOKEN_LATENCY_BUCKETS: [f64; 19] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
];

/// Whole requests and their phases: 0.3 s to 7,680 s, past the 600 s request timeout.
const REQUEST_LATENCY_BUCKETS: [f64; 21] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
];

fn request_latency(name: &str, help: &str) -> Result<Histogram, prometheus::Error> {
    Histogram::with_opts(HistogramOpts::new(name, help).buckets(REQUEST_LATENCY_BUCKETS.to_vec()))
}

/// 1, 2, 5, 10, 20, 50, ... up to `max` (vLLM's buckets for token counts).
fn buckets_1_2_5(max: usize) -> Vec<f64> {
    let mut out = Vec::new();
    let mut scale = 1usize;
    loop {
        for m in [1usize, 2, 5] {
            match m.checked_mul(scale) {
                Some(v) if v <= max => out.push(v as f64),
                _ => return out,
            }
        }
        scale = match scale.checked_mul(10) {
            Some(s) => s,
            None => return out,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_buckets_are_vllms_1_2_5_up_to_max_model_len() {
        assert_eq!(buckets_1_2_5(100), [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0]);
        assert_eq!(buckets_1_2_5(2048).last(), Some(&2000.0));
        assert_eq!(buckets_1_2_5(1), [1.0]);
    }

    #[test]
    fn speculative_counters_have_vllms_names_and_labels_and_exist_only_when_configured() {
        let m = Metrics::new().unwrap();
        m.set_served("org/model", 2048);
        m.observe_proposal(4, 2);
        assert!(
            !m.encode().contains("spec_decode"),
            "registered without speculation"
        );
        m.set_speculative(4).unwrap();
        m.observe_proposal(4, 2);
        m.observe_proposal(3, 0);
        let text = m.encode();
        let labels = r#"{model_name="org/model",engine="0""#;
        for line in [
            format!("vllm:spec_decode_num_drafts_total{labels}}} 2"),
            format!("vllm:spec_decode_num_draft_tokens_total{labels}}} 7"),
            format!("vllm:spec_decode_num_accepted_tokens_total{labels}}} 2"),
            format!(r#"vllm:spec_decode_num_accepted_tokens_per_pos_total{labels},position="0"}} 1"#),
            format!(r#"vllm:spec_decode_num_accepted_tokens_per_pos_total{labels},position="1"}} 1"#),
            format!(r#"vllm:spec_decode_num_accepted_tokens_per_pos_total{labels},position="3"}} 0"#),
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in\n{text}");
        }
    }

    #[test]
    fn every_vllm_series_carries_the_served_model_and_engine() {
        let m = Metrics::new().unwrap();
        m.set_served("org/model", 2048);
        m.vllm_running.set(3);
        m.observe_finished(&Finished {
            reason: "length",
            e2e: Duration::from_secs(2),
            queue: Duration::from_millis(100),
            prefill: Duration::from_millis(400),
            decode: Duration::from_secs(1),
            prompt_tokens: 30,
            generation_tokens: 11,
            max_tokens: 16,
            cached_tokens: 16,
        });
        let text = m.encode();
        let labels = r#"{model_name="org/model",engine="0""#;
        assert!(
            text.contains(&format!("vllm:num_requests_running{labels}}} 3")),
            "{text}"
        );
        assert!(
            text.contains(&format!(
                r#"vllm:request_success_total{labels},finished_reason="length"}} 1"#
            )),
            "{text}"
        );
        assert!(text.contains(&format!(
            r#"vllm:request_success_total{labels},finished_reason="abort"}} 0"#
        )));
        assert!(text.contains(&format!(
            "vllm:request_time_per_output_token_seconds_sum{labels}}} 0.1"
        )));
        assert!(text.contains(&format!("vllm:request_inference_time_seconds_sum{labels}}} 1.4")));
        assert!(text.contains(&format!(
            r#"vllm:request_prompt_tokens_bucket{labels},le="50"}} 1"#
        )));
        assert!(text.contains(&format!(
            r#"vllm:e2e_request_latency_seconds_bucket{labels},le="7680"}} 1"#
        )));
        // 30 prompt tokens, 16 of them cached: 14 computed; max_tokens 16; n 1.
        for (series, want) in [
            ("vllm:request_prefill_kv_computed_tokens_sum", "14"),
            ("vllm:request_params_max_tokens_sum", "16"),
            ("vllm:request_max_num_generation_tokens_sum", "11"),
            ("vllm:request_params_n_sum", "1"),
        ] {
            assert!(
                text.contains(&format!("{series}{labels}}} {want}")),
                "{series}: {text}"
            );
        }
        assert!(
            text.contains(
                r#"vllm:lora_requests_info{max_lora="0",running_lora_adapters="",waiting_lora_adapters=""}"#
            ),
            "{text}"
        );
        // Every vllm sample but the LoRA gauge carries both labels; kvfleet's carry neither.
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            if line.starts_with("vllm:") && !line.starts_with(LORA_INFO) {
                assert!(line.contains(labels), "{line}");
            }
            if line.starts_with("kvfleet_") {
                assert!(!line.contains("model_name"), "{line}");
            }
        }
    }
}
