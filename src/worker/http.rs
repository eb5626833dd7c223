//! The worker's HTTP API: `POST /v1/load`, `GET /v1/capacity`, `/metrics`, `/healthz`,
//! `/readyz`.

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, RwLock};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::sync::{mpsc, oneshot};

use super::engine::capacity::PoolPlan;
use super::metrics::Metrics;
use super::nvml::GpuInfo;
use super::runner::{Command, LiveStats, LoadError, LoadRequest, Progress};

/// Most requests one `POST /v1/load` may submit.
pub const MAX_LOAD_REQUESTS: usize = 10_000;

/// What `/v1/capacity` reports besides the live numbers (fixed after preflight).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CapacityInfo {
    pub model_name: String,
    pub backend: String,
    pub kv_cache_dtype: String,
    pub gpu: Option<GpuInfo>,
    pub block_size: usize,
    pub max_model_len: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub memory_bytes: u64,
    pub available_kv_bytes: u64,
    /// Measured: tokens of maxModelLen requests the allocated pools hold.
    pub capacity_tokens: u64,
    pub max_concurrency: f64,
    /// The planner's prediction for the same inputs.
    pub predicted_capacity_tokens: u64,
    pub pools: PoolPlan,
}

/// Shared by every handler.
pub struct AppState {
    pub ready: AtomicBool,
    pub commands: Mutex<Option<Sender<Command>>>,
    pub capacity: RwLock<Option<CapacityInfo>>,
    pub live: Arc<Mutex<LiveStats>>,
    pub metrics: Arc<Metrics>,
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/load", post(load))
        .route("/v1/capacity", get(capacity))
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(state)
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(json!({ "error": message.into() }))).into_response()
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

async fn capacity(State(s): State<Arc<AppState>>) -> Response {
    let info = s.capacity.read().ok().and_then(|c| c.clone());
    let Some(info) = info else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "preflight has not finished; retry when /readyz is 200",
        );
    };
    let live = s.live.lock().map(|l| l.clone()).unwrap_or_default();
    let mut v = serde_json::to_value(&info).unwrap_or_default();
    if let Some(o) = v.as_object_mut() {
        o.insert("live".into(), serde_json::to_value(&live).unwrap_or_default());
    }
    Json(v).into_response()
}

/// Body of `POST /v1/load`.
#[derive(Deserialize, Debug)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LoadBody {
    pub requests: Vec<LoadItem>,
    /// Stream per-request progress as NDJSON (default); false answers 202 at once.
    #[serde(default = "yes")]
    pub stream: bool,
}

fn yes() -> bool {
    true
}

/// `count` requests of the same lengths.
#[derive(Deserialize, Debug)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LoadItem {
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    #[serde(default = "one")]
    pub count: usize,
}

fn one() -> usize {
    1
}

async fn load(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    if !s.ready.load(Ordering::SeqCst) {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the worker is not ready (preflight running or shutting down)",
        );
    }
    let body: LoadBody = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("malformed load: {e}; expected {{\"requests\": [{{\"promptTokens\": N, \"outputTokens\": M, \"count\": K}}], \"stream\": true}}"),
            )
        }
    };
    let total: usize = body
        .requests
        .iter()
        .map(|r| r.count)
        .fold(0, usize::saturating_add);
    if total == 0 {
        return error(
            StatusCode::BAD_REQUEST,
            "the load has no requests (empty list or count 0)",
        );
    }
    if total > MAX_LOAD_REQUESTS {
        return error(
            StatusCode::BAD_REQUEST,
            format!("the load has {total} requests; at most {MAX_LOAD_REQUESTS} per call"),
        );
    }
    let requests: Vec<LoadRequest> = body
        .requests
        .iter()
        .flat_map(|r| {
            std::iter::repeat_n(
                LoadRequest {
                    prompt: r.prompt_tokens,
                    output: r.output_tokens,
                },
                r.count,
            )
        })
        .collect();
    let (ptx, prx) = if body.stream {
        let (t, r) = mpsc::unbounded_channel();
        (Some(t), Some(r))
    } else {
        (None, None)
    };
    let (reply, answer) = oneshot::channel();
    let sent = s.commands.lock().ok().and_then(|c| {
        c.as_ref().map(|tx| {
            tx.send(Command::Load {
                requests,
                progress: ptx,
                reply,
            })
        })
    });
    if !matches!(sent, Some(Ok(()))) {
        return error(StatusCode::SERVICE_UNAVAILABLE, "the engine is not running");
    }
    let ids = match answer.await {
        Ok(Ok(ids)) => ids,
        Ok(Err(e @ LoadError::Invalid { .. })) => return error(StatusCode::BAD_REQUEST, e.to_string()),
        Ok(Err(e @ LoadError::QueueFull { .. })) => {
            return error(StatusCode::TOO_MANY_REQUESTS, e.to_string())
        }
        Ok(Err(e @ LoadError::ShuttingDown)) => return error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        Err(_) => return error(StatusCode::SERVICE_UNAVAILABLE, "the engine stopped"),
    };
    let Some(rx) = prx else {
        return (StatusCode::ACCEPTED, Json(json!({ "accepted": ids }))).into_response();
    };
    let first = line(&json!({ "event": "accepted", "ids": ids }));
    let state = StreamState {
        rx,
        remaining: ids.len(),
        finished: 0,
        failed: 0,
        first: Some(first),
        done: false,
    };
    let stream = futures::stream::unfold(state, next_line);
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/x-ndjson")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "cannot build the stream"))
}

struct StreamState {
    rx: mpsc::UnboundedReceiver<Progress>,
    remaining: usize,
    finished: usize,
    failed: usize,
    first: Option<Bytes>,
    done: bool,
}

fn line<T: Serialize>(v: &T) -> Bytes {
    let mut s = serde_json::to_vec(v).unwrap_or_default();
    s.push(b'\n');
    Bytes::from(s)
}

async fn next_line(mut st: StreamState) -> Option<(Result<Bytes, Infallible>, StreamState)> {
    if let Some(first) = st.first.take() {
        return Some((Ok(first), st));
    }
    if st.done {
        return None;
    }
    if st.remaining > 0 {
        if let Some(p) = st.rx.recv().await {
            match &p {
                Progress::Finished { .. } => {
                    st.finished += 1;
                    st.remaining -= 1;
                }
                Progress::Failed { .. } => {
                    st.failed += 1;
                    st.remaining -= 1;
                }
                _ => {}
            }
            return Some((Ok(line(&p)), st));
        }
        // The engine went away without ending them: say so rather than hang.
        st.failed += st.remaining;
        st.remaining = 0;
    }
    st.done = true;
    let done = line(&json!({ "event": "done", "finished": st.finished, "failed": st.failed }));
    Some((Ok(done), st))
}
