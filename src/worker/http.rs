//! The worker's own HTTP endpoints beside the OpenAI API: `GET /v1/capacity`, `/metrics`,
//! `/healthz`, `/readyz`, and vLLM's `/health` and `/version` (benchmark clients such as
//! guidellm check `/health` before they start). Errors are in OpenAI's shape, a wrong method
//! included; unknown paths fall to the OpenAI router's fallback.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::Serialize;
use serde_json::json;

use super::nvml::GpuInfo;
use crate::serving::metrics::Metrics;
use kvfleet_engine::engine::capacity::PoolPlan;

/// What `/v1/capacity` reports besides the live numbers (fixed after preflight).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CapacityInfo {
    /// The served model's id in the OpenAI API.
    pub model_name: String,
    /// What was loaded (file or checkpoint directory; the config for dummy weights).
    pub model_path: String,
    /// Where the model and attention run (`cpu`, `cuda`).
    pub backend: String,
    pub kv_cache_dtype: String,
    pub gpu: Option<GpuInfo>,
    pub block_size: usize,
    pub max_model_len: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub memory_bytes: u64,
    pub available_kv_bytes: u64,
    /// KV pages allocated (all groups) and tokens they hold.
    pub total_blocks: usize,
    pub kv_tokens: u64,
    /// Measured: tokens of maxModelLen requests the allocated pools hold.
    pub capacity_tokens: u64,
    pub max_concurrency: f64,
    /// The planner's prediction for the same inputs.
    pub predicted_capacity_tokens: u64,
    /// Side by side with `maxConcurrency`: what the same pools would admit if every layer,
    /// sliding-window ones included, were budgeted for maxModelLen.
    pub full_layer_max_concurrency: f64,
    pub full_layer_capacity_tokens: u64,
    /// Per layer group: window, layers, blocks, and the block tokens one maxModelLen request
    /// holds there (window-aware and full-layer).
    pub tokens_per_request: Vec<kvfleet_engine::engine::capacity::GroupTokens>,
    pub pools: PoolPlan,
    /// On a GPU: the memory measured around model load (total, weights, activations, free
    /// before the KV pools, margin kept free).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_memory: Option<GpuMemory>,
}

/// The GPU's memory as the worker measured it while loading the served model.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuMemory {
    pub total_bytes: u64,
    pub weight_bytes: u64,
    pub activation_bytes: u64,
    pub free_before_kv_bytes: u64,
    pub margin_bytes: u64,
    /// `floor(total x gpuMemoryUtilization) - weights - activations - context reserve`: what
    /// `kvfleet check` predicts for the KV cache.
    pub kv_budget_bytes: u64,
    /// What the pools were given: the budget, or less when less was free (the prediction was
    /// not met; the worker logs a warning with both numbers).
    pub kv_bytes: u64,
    pub kv_bytes_per_token: u64,
    /// What a speculative drafter took out of the KV budget before the pages were counted:
    /// its weights, buffers and pool (as many pages as the model's). 0 without one.
    pub drafter_bytes: u64,
}

/// Shared by every handler.
pub struct AppState {
    pub ready: AtomicBool,
    pub capacity: RwLock<Option<CapacityInfo>>,
    pub metrics: Arc<Metrics>,
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/capacity", get(capacity))
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        // vLLM's: 200 with an empty body while the server runs.
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/version", get(version))
        .method_not_allowed_fallback(crate::serving::openai::method_not_allowed)
        .with_state(state)
}

async fn version() -> Json<serde_json::Value> {
    Json(json!({ "version": env!("CARGO_PKG_VERSION") }))
}

/// An error in OpenAI's shape, as the API beside these routes answers.
fn error(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    let body = json!({"error": {
        "message": message.into(),
        "type": "server_error",
        "param": null,
        "code": code,
    }});
    (status, Json(body)).into_response()
}

async fn readyz(State(s): State<Arc<AppState>>) -> Response {
    if s.ready.load(Ordering::SeqCst) {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n").into_response()
    }
}

async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        s.metrics.encode(),
    )
        .into_response()
}

/// This process's id among the worker's runs: its pid and the time it first answered.
fn start_id() -> &'static str {
    static ID: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    ID.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        format!("{}-{nanos}", std::process::id())
    })
}

async fn capacity(State(s): State<Arc<AppState>>) -> Response {
    let info = s.capacity.read().ok().and_then(|c| c.clone());
    let Some(info) = info else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "not_ready",
            "preflight has not finished; retry when /readyz is 200",
        );
    };
    let live = s.metrics.live();
    let mut v = serde_json::to_value(&info).unwrap_or_default();
    if let Some(o) = v.as_object_mut() {
        o.insert("live".into(), serde_json::to_value(&live).unwrap_or_default());
        // A router clears its prefix index for this worker when the id changes (a restart).
        o.insert("startId".into(), json!(start_id()));
    }
    Json(v).into_response()
}
