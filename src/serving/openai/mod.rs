//! OpenAI-compatible HTTP API over a [`ModelRuntime`]: `/v1/models` (and `/v1/models/{id}`),
//! `/v1/completions`, `/v1/chat/completions`, streaming (SSE) or not, with usage counts and
//! OpenAI's error shape (`{"error": {"message", "type", "param", "code"}}`) on every 4xx and
//! 5xx, unknown routes and wrong methods included. A client that disconnects drops its event
//! receiver, which cancels the sequence at the next step.
//!
//! Bounded against hostile or broken clients ([`ApiLimits`]): the body is read under a size
//! limit (413), a time limit (408) and a budget of bytes for all bodies in flight (503 with
//! `Retry-After` past it, [`super::body_budget`]), a request that runs past the request timeout is ended
//! (504, or an error chunk on a stream) and its sequence cancelled, tokenisation runs on the
//! blocking pool (never on the threads that answer health probes), and every request field is
//! either implemented or refused with 400 naming it ([`field_rule`]): none is silently ignored.
//!
//! Every request has an id: the client's `x-request-id` (or vLLM's body field `request_id`), else
//! a random one. It is returned in `x-request-id`, carried by the request's log span, and ends
//! the response's `id` (`chatcmpl-<id>`, `cmpl-<id>`, as vLLM names them).

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tracing::Instrument;

use super::body_budget::{self, BodyBudget};
use super::runtime::ModelRuntime;

mod error;
mod fields;
mod handlers;
mod logprobs;
mod prompt;
mod request;
mod response;
mod stream;
#[cfg(test)]
mod tests;

pub use error::{method_not_allowed, not_found, ApiError};
use handlers::{chat_completions, completions};
pub use prompt::RoutingPrompt;
pub use request::MAX_COMPLETION_LOGPROBS;

/// Output tokens of a chat completion that names no `max_tokens`.
pub const DEFAULT_CHAT_MAX_TOKENS: usize = 1024;
/// Output tokens of a completion that names no `max_tokens` (OpenAI's default).
pub const DEFAULT_COMPLETION_MAX_TOKENS: usize = 16;

/// The header that carries a request's id both ways.
pub const REQUEST_ID_HEADER: HeaderName = HeaderName::from_static("x-request-id");

/// Roles a chat message may have (OpenAI's set).
pub const CHAT_ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// The smallest `--max-request-bytes`: a chat request with every implemented parameter at a
/// typical value (model, max_tokens, temperature, top_p, top_k, seed, four stop strings,
/// stream_options, request_id) and a short message is about 400 bytes as the OpenAI SDK writes
/// it; 1 KiB takes that with room for a prompt. Less refuses what every client sends.
pub const MIN_BODY_BYTES: usize = 1 << 10;

/// The largest `--max-request-bytes`: a prompt of 16 Mi token ids written as JSON (at most 11
/// bytes each: ten digits and a comma) is 176 MiB, past every released model's context (10M
/// tokens); above 256 MiB a body buys nothing but memory.
pub const MAX_BODY_BYTES: usize = 256 << 20;

/// `--max-request-bytes` as the worker and the router read it: within
/// [`MIN_BODY_BYTES`]..=[`MAX_BODY_BYTES`].
pub fn body_bytes_parser() -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::<usize>::new().range(MIN_BODY_BYTES as u64..=MAX_BODY_BYTES as u64)
}

/// Request bodies the worker holds at once by default (`--max-request-bytes-in-flight`): the
/// bodies being received and, until they are tokenized, the prompts read from them. The
/// worker's pod has no memory limit of ours (`spec.pod.resources` sets it), so this is sized
/// against the smallest worker: a CPU worker of a small model runs in some 300 MiB, and 64 MiB
/// more holds 16 bodies of the largest default size (4 MiB, about a million tokens) at once or
/// thousands of ordinary ones, while a client that opens a hundred connections and sends most
/// of a body on each can add no more than that (issue 62: 40 such bodies took +160 MB before).
pub const DEFAULT_BODIES_IN_FLIGHT_BYTES: usize = 64 << 20;

/// Limits on what one request may cost the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApiLimits {
    /// Largest request body; more is answered 413 before it is parsed.
    pub max_body_bytes: usize,
    /// Bytes of request bodies held at once, across requests (see
    /// [`DEFAULT_BODIES_IN_FLIGHT_BYTES`]); a request that finds no room within
    /// [`super::body_budget::DEFAULT_WAIT`] is answered 503 with `Retry-After`.
    pub max_bodies_in_flight_bytes: usize,
    /// Time a client has to send its whole body (a slow sender is answered 408).
    pub body_timeout: Duration,
    /// Time from arrival to the last token; past it the request ends (504 or an error chunk)
    /// and its sequence is cancelled at the next step.
    pub request_timeout: Duration,
    /// Render a `chat_template` sent in a request (vLLM's `--trust-request-chat-template`):
    /// Jinja from a client runs in a sandbox under a bound on its instructions, not on the
    /// memory it builds. Off, a request may only name one of the model's own templates.
    pub trust_request_chat_template: bool,
}

impl Default for ApiLimits {
    fn default() -> Self {
        ApiLimits {
            // 4 MiB: about a million tokens of text, far over any context this server takes.
            max_body_bytes: 4 << 20,
            max_bodies_in_flight_bytes: DEFAULT_BODIES_IN_FLIGHT_BYTES,
            body_timeout: Duration::from_secs(30),
            request_timeout: Duration::from_secs(600),
            trust_request_chat_template: false,
        }
    }
}

#[derive(Clone)]
struct Api {
    rt: Arc<ModelRuntime>,
    limits: ApiLimits,
    /// Tokenisations running at once. Tokenising is CPU work on the blocking pool: more at once
    /// than there are cores adds no throughput, only the working set of each (the merges keep
    /// some 100 bytes per byte of a long word), so there is one permit per core.
    tokenizing: Arc<tokio::sync::Semaphore>,
    /// The bytes of the bodies in flight ([`ApiLimits::max_bodies_in_flight_bytes`]).
    bodies: BodyBudget,
}

/// The key clients must present as `Authorization: Bearer <key>`. Its `Debug` never shows
/// it, so that it cannot reach a log through the worker's options.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(Arc<str>);

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

impl std::str::FromStr for ApiKey {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s.is_empty() {
            return Err("the API key is empty; unset it to serve without one".into());
        }
        Ok(ApiKey(s.into()))
    }
}

impl ApiKey {
    /// Compares in time independent of where the first difference is.
    fn matches(&self, presented: &[u8]) -> bool {
        let key = self.0.as_bytes();
        presented.len() == key.len() && presented.iter().zip(key).fold(0u8, |d, (a, b)| d | (a ^ b)) == 0
    }
}

/// The API's routes with the default [`ApiLimits`], to be merged into the worker's router.
pub fn router(rt: Arc<ModelRuntime>) -> Router {
    router_with(rt, ApiLimits::default(), None)
}

/// The API's routes with the given limits; with a key, every route asks for it (401). The
/// router carries the fallback (404 in OpenAI's shape) of whatever it is merged with.
pub fn router_with(rt: Arc<ModelRuntime>, limits: ApiLimits, key: Option<ApiKey>) -> Router {
    let routes = Router::new()
        .route("/v1/models", get(models))
        // Served model names may hold slashes (`org/model`).
        .route("/v1/models/{*id}", get(model))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(Api {
            rt,
            bodies: BodyBudget::new(limits.max_bodies_in_flight_bytes, body_budget::DEFAULT_WAIT),
            limits,
            tokenizing: Arc::new(tokio::sync::Semaphore::new(
                std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get),
            )),
        });
    let routes = match key {
        Some(key) => routes.layer(axum::middleware::from_fn_with_state(key, require_key)),
        None => routes,
    };
    routes
        .fallback(not_found)
        .layer(axum::middleware::from_fn(request_identity))
}

async fn require_key(
    State(key): State<ApiKey>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let presented = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "));
    if presented.is_some_and(|p| key.matches(p)) {
        return next.run(req).await;
    }
    let mut r = ApiError {
        status: StatusCode::UNAUTHORIZED,
        message: "a valid API key is required: send `Authorization: Bearer <key>` (the key is in \
                  the Secret that the InferenceDeployment's spec.apiKey names)"
            .into(),
        kind: "invalid_request_error",
        param: None,
        code: Some("invalid_api_key"),
    }
    .into_response();
    r.headers_mut().insert(
        axum::http::header::WWW_AUTHENTICATE,
        axum::http::HeaderValue::from_static("Bearer"),
    );
    r
}

// === request identity ===

/// A request's id, from the client or made here.
#[derive(Clone, Debug)]
struct RequestId {
    id: Arc<str>,
    /// The client sent it in `x-request-id`.
    from_header: bool,
}

/// 128 random bits in hex (as vLLM's `random_uuid`): unique across requests and restarts.
fn random_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// An id a client may choose: 1 to 128 visible ASCII characters, so that it is safe in a
/// header, a log line and a response id.
fn usable_id(id: &str) -> bool {
    (1..=128).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_graphic())
}

/// Gives every request an id (the client's `x-request-id` when usable, else a random one),
/// runs it in a span that carries the id, logs its answer and returns the id in the response.
async fn request_identity(mut req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let given = req
        .headers()
        .get(&REQUEST_ID_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|s| usable_id(s));
    let rid = RequestId {
        from_header: given.is_some(),
        id: given.map_or_else(|| random_id().into(), Arc::from),
    };
    let (method, path) = (req.method().clone(), req.uri().path().to_owned());
    let span = tracing::info_span!("request", request_id = %rid.id);
    let id = rid.id.clone();
    req.extensions_mut().insert(rid);
    let t0 = Instant::now();
    let mut resp = next.run(req).instrument(span.clone()).await;
    // A handler that took the id from the body (vLLM's `request_id`) has set the header: the
    // answer's log line carries that one.
    match resp
        .headers()
        .get(&REQUEST_ID_HEADER)
        .and_then(|v| v.to_str().ok())
    {
        Some(final_id) if final_id != &*id => {
            span.record("request_id", final_id);
        }
        Some(_) => {}
        None => {
            if let Ok(v) = HeaderValue::from_str(&id) {
                resp.headers_mut().insert(REQUEST_ID_HEADER, v);
            }
        }
    }
    span.in_scope(|| {
        tracing::info!(
            %method,
            path,
            status = resp.status().as_u16(),
            ms = t0.elapsed().as_millis() as u64,
            "answered"
        )
    });
    resp
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The served model as OpenAI (and vLLM) describe a model.
fn model_card(rt: &ModelRuntime) -> Value {
    json!({
        "id": rt.name,
        "object": "model",
        "created": now_secs(),
        "owned_by": "kvfleet",
        "root": rt.name,
        "parent": null,
        "max_model_len": rt.max_model_len,
    })
}

async fn models(State(Api { rt, .. }): State<Api>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_card(&rt)]}))
}

async fn model(State(Api { rt, .. }): State<Api>, id: Result<Path<String>, PathRejection>) -> Response {
    match id {
        Ok(Path(id)) if id == rt.name => Json(model_card(&rt)).into_response(),
        Ok(Path(id)) => ApiError::model_not_found(&id, &rt.name).into_response(),
        Err(e) => ApiError::bad(format!("invalid model id in the path: {e}"), Some("model")).into_response(),
    }
}

/// Which endpoint a request came to: the two read most fields alike.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Chat,
    Completion,
}
