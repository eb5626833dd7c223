//! The router's own metrics: where requests went and why, how good its prefix predictions were
//! against what the workers reported, how long a pick takes, what failed upstream.

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

/// Upper bounds of `kvfleet_router_pick_seconds`.
pub const PICK_BUCKETS: [f64; 22] = [
    0.000025, 0.00005, 0.000075, 0.0001, 0.00015, 0.0002, 0.00025, 0.0003, 0.0004, 0.0005, 0.0006, 0.00075,
    0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1,
];

pub struct RouterMetrics {
    pub registry: Registry,
    /// Requests by the replica chosen and why (`prefix`, `load`, `affinity`, `only`,
    /// `all_full`, `fallback`).
    pub requests: IntCounterVec,
    /// Prompt tokens the router predicted each worker would serve from its cache.
    pub predicted_cached_tokens: IntCounter,
    /// `usage.prompt_tokens_details.cached_tokens` the workers reported for the same requests.
    pub reported_cached_tokens: IntCounter,
    /// Requests whose report was seen, by whether the prediction was `exact`, `over` or `under`.
    pub predictions: IntCounterVec,
    /// From the request's body read to its upstream request being sent: parsing, tokenizing,
    /// hashing, scoring (the latency the router adds before the worker starts; the body's
    /// arrival depends on the client and is read by a worker as well).
    pub pick_seconds: Histogram,
    /// Upstream failures by replica and kind (`connect`: no connection, the request went to
    /// the next replica; `unavailable`: a 503 before any byte, likewise; `reset`: the connection
    /// closed after the request was sent and before an answer; `first_byte_timeout`: no answer
    /// within the first-byte timeout; `replica_down`: its replica was marked down while it
    /// waited or streamed; `chunk_timeout`: a started response stalled past the inter-chunk
    /// timeout; `stream`: a started response broke off). After a response started the client
    /// gets an error event and `[DONE]` on a stream, a cut body otherwise.
    pub upstream_errors: IntCounterVec,
    /// Non-streamed requests sent again to another replica after the first failed before any
    /// byte of its answer (a reset, a timeout, its replica marked down).
    pub retries: IntCounter,
    /// Replicas marked down (their scrape failed for the down-after time): their requests in
    /// flight were failed over or ended.
    pub replicas_down: IntCounterVec,
    /// Requests the router answered itself before any replica saw them, by reason
    /// (`body_too_large` 413, `body_timeout` 408, `body_budget` 503: the bodies in flight are at
    /// their budget, `prompt_too_long` 400: more text than maxModelLen tokens can hold).
    pub refused: IntCounterVec,
    /// Prefix-index blocks dropped because a replica announced more than its pool holds, and
    /// indexes cleared because their replica restarted (`restart`) or cleared its cache.
    pub index_evicted_blocks: IntCounter,
    pub index_cleared: IntCounterVec,
    /// Replicas known, by state (`ready`, `subscribed`: its KV events arrive, `scraped`).
    pub replicas: IntGaugeVec,
    /// KV-event batches applied, and batches known lost (sequence gaps).
    pub kv_event_batches: IntCounter,
    pub kv_event_gaps: IntCounter,
    /// KV-event input refused, by reason: a subscription ended for what its publisher sent
    /// (ZMTP framing, limits, handshake) or a batch dropped for its shape.
    pub kv_events_rejected: IntCounterVec,
    /// Time from the request's arrival to the first response byte, by whether the prediction hit.
    pub ttfb_seconds: HistogramVec,
    /// Generation requests held while no replica is ready (scale from zero), and the KV tokens
    /// they need to finish (prompt + output limit, each capped at maxModelLen).
    pub held_requests: IntGauge,
    pub held_demand_tokens: IntGauge,
    /// How long each held request waited before it was forwarded.
    pub hold_seconds: Histogram,
    /// Held requests answered 503, by reason (`timeout`, `queue_full`).
    pub hold_rejected: IntCounterVec,
}

impl RouterMetrics {
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let m = Self {
            requests: IntCounterVec::new(
                Opts::new(
                    "kvfleet_router_requests_total",
                    "Requests routed, by replica and reason",
                ),
                &["pod", "reason"],
            )?,
            predicted_cached_tokens: IntCounter::new(
                "kvfleet_router_predicted_cached_tokens_total",
                "Prompt tokens the router predicted the chosen worker would serve from its prefix cache",
            )?,
            reported_cached_tokens: IntCounter::new(
                "kvfleet_router_reported_cached_tokens_total",
                "cached_tokens the workers reported for routed requests whose usage the router saw",
            )?,
            predictions: IntCounterVec::new(
                Opts::new(
                    "kvfleet_router_prefix_predictions_total",
                    "Routed requests with a reported cached_tokens, by prediction outcome",
                ),
                &["outcome"],
            )?,
            pick_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    "kvfleet_router_pick_seconds",
                    "Body read to upstream send: parsing, tokenization, hashing and scoring",
                )
                // Fine from 25 us to 10 ms, so p50 and p99 read off a scrape within ~25% around the
                // 1 ms target.
                .buckets(PICK_BUCKETS.to_vec()),
            )?,
            upstream_errors: IntCounterVec::new(
                Opts::new(
                    "kvfleet_router_upstream_errors_total",
                    "Upstream failures by replica and kind",
                ),
                &["pod", "kind"],
            )?,
            retries: IntCounter::new(
                "kvfleet_router_retries_total",
                "Non-streamed requests sent to another replica after the first failed before answering",
            )?,
            replicas_down: IntCounterVec::new(
                Opts::new(
                    "kvfleet_router_replicas_marked_down_total",
                    "Replicas marked down after their capacity scrape failed for the down-after time",
                ),
                &["pod"],
            )?,
            refused: IntCounterVec::new(
                Opts::new(
                    "kvfleet_router_refused_requests_total",
                    "Requests the router answered itself before forwarding, by reason",
                ),
                &["reason"],
            )?,
            index_evicted_blocks: IntCounter::new(
                "kvfleet_router_index_evicted_blocks_total",
                "Prefix-index blocks dropped because a replica announced more blocks than its pool holds",
            )?,
            index_cleared: IntCounterVec::new(
                Opts::new(
                    "kvfleet_router_index_cleared_total",
                    "Prefix indexes cleared, by reason (restart: the replica's start id changed)",
                ),
                &["reason"],
            )?,
            replicas: IntGaugeVec::new(
                Opts::new(
                    "kvfleet_router_replicas",
                    "Replicas known to the router, by state",
                ),
                &["state"],
            )?,
            kv_event_batches: IntCounter::new(
                "kvfleet_router_kv_event_batches_total",
                "KV-event batches applied",
            )?,
            kv_event_gaps: IntCounter::new(
                "kvfleet_router_kv_event_gaps_total",
                "KV-event batches lost (sequence gaps); the prefix index may be stale since",
            )?,
            kv_events_rejected: IntCounterVec::new(
                Opts::new(
                    "kvfleet_router_kv_events_rejected_total",
                    "KV-event subscriptions ended and batches dropped for what a publisher sent, by reason",
                ),
                &["reason"],
            )?,
            ttfb_seconds: HistogramVec::new(
                HistogramOpts::new(
                    "kvfleet_router_time_to_first_byte_seconds",
                    "Arrival at the router to the first response byte from the worker",
                )
                .buckets(vec![
                    0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
                ]),
                &["predicted"],
            )?,
            held_requests: IntGauge::new(
                "kvfleet_router_held_requests",
                "Generation requests held until a replica is ready (scale from zero)",
            )?,
            held_demand_tokens: IntGauge::new(
                "kvfleet_router_held_demand_tokens",
                "KV tokens the held requests need to finish: prompt + output limit, each capped at maxModelLen",
            )?,
            hold_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    "kvfleet_router_hold_seconds",
                    "Time a held request waited for a ready replica before it was forwarded",
                )
                .buckets(vec![
                    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
                ]),
            )?,
            hold_rejected: IntCounterVec::new(
                Opts::new(
                    "kvfleet_router_hold_rejected_total",
                    "Requests answered 503 instead of held or after holding, by reason (timeout, queue_full)",
                ),
                &["reason"],
            )?,
            registry,
        };
        m.registry.register(Box::new(m.requests.clone()))?;
        m.registry.register(Box::new(m.predicted_cached_tokens.clone()))?;
        m.registry.register(Box::new(m.reported_cached_tokens.clone()))?;
        m.registry.register(Box::new(m.predictions.clone()))?;
        m.registry.register(Box::new(m.pick_seconds.clone()))?;
        m.registry.register(Box::new(m.upstream_errors.clone()))?;
        m.registry.register(Box::new(m.replicas.clone()))?;
        m.registry.register(Box::new(m.retries.clone()))?;
        m.registry.register(Box::new(m.replicas_down.clone()))?;
        m.registry.register(Box::new(m.refused.clone()))?;
        m.registry.register(Box::new(m.index_evicted_blocks.clone()))?;
        m.registry.register(Box::new(m.index_cleared.clone()))?;
        m.registry.register(Box::new(m.kv_event_batches.clone()))?;
        m.registry.register(Box::new(m.kv_event_gaps.clone()))?;
        m.registry.register(Box::new(m.kv_events_rejected.clone()))?;
        m.registry.register(Box::new(m.ttfb_seconds.clone()))?;
        m.registry.register(Box::new(m.held_requests.clone()))?;
        m.registry.register(Box::new(m.held_demand_tokens.clone()))?;
        m.registry.register(Box::new(m.hold_seconds.clone()))?;
        m.registry.register(Box::new(m.hold_rejected.clone()))?;
        // Both reasons exist from the start, so a rate() over them is defined at zero.
        for reason in ["timeout", "queue_full"] {
            m.hold_rejected.with_label_values(&[reason]);
        }
        for reason in ["body_too_large", "body_timeout", "body_budget", "prompt_too_long"] {
            m.refused.with_label_values(&[reason]);
        }
        Ok(m)
    }

    /// A worker reported `reported` cached tokens where the router predicted `predicted`.
    pub fn observe_report(&self, predicted: usize, reported: usize) {
        self.reported_cached_tokens.inc_by(reported as u64);
        let outcome = match predicted.cmp(&reported) {
            std::cmp::Ordering::Equal => "exact",
            std::cmp::Ordering::Greater => "over",
            std::cmp::Ordering::Less => "under",
        };
        self.predictions.with_label_values(&[outcome]).inc();
    }

    pub fn encode(&self) -> String {
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}
