//! The router's HTTP side. `POST /v1/chat/completions` and `/v1/completions` are tokenized
//! once, exactly as the workers tokenize them ([`crate::serving::openai::RoutingPrompt`]),
//! ranked ([`super::score`]) and forwarded to the best replica with the body unchanged; its
//! response (streamed or not) passes through chunk by chunk with two headers added:
//! `x-kvfleet-replica` and `x-kvfleet-predicted-cached-tokens`. A replica that refuses the
//! connection or answers 503 before any byte is skipped for the next one; a non-streamed request
//! whose replica fails after it was sent (a reset, no answer within the timeout, the replica
//! marked down) is sent once more elsewhere; once a response has started it is the client's,
//! never retried, and watched ([`super::stream`]). A body over the router's limit is answered
//! 413, as a worker answers it, and one over the workers' is passed back as their 413. Every
//! other path (`/v1/models`, `/tokenize`,
//! ...) goes to the least busy replica. `/health` and `/livez` are 200 while the router runs,
//! `/metrics` has the router's own series, `/v1/router/state` what it knows of each replica.
//!
//! While no replica is ready (none discovered, or none answering its capacity scrape), the
//! router answers `/v1/models` itself and holds generation requests ([`super::hold`]) until one
//! is: scale from zero.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::State as Extract;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt;
use http_body_util::BodyExt;
use serde_json::json;

use super::body::BodyLimits;
use super::fleet::{Fleet, Upstream};
use super::hold::{Demand, Hold, Rejection, RETRY_AFTER_SECONDS};
use super::index::PromptBlocks;
use super::metrics::RouterMetrics;
use super::score::{rank, Candidate};
use super::stream::{marked_down, watched, Cut, Watch};
use super::HttpClient;
use crate::serving::body_budget::{BodyError, BodyPermit};
use crate::serving::openai::RoutingPrompt;
use kvfleet_engine::model::tokenizer::Tokenizer;

/// Header a client sets to keep a conversation on one replica when nothing else decides.
pub const SESSION_HEADER: &str = "x-session-id";
/// Response header naming the replica that answered.
pub const REPLICA_HEADER: &str = "x-kvfleet-replica";
/// Response header with the prompt tokens the router expected that replica to serve from cache.
pub const PREDICTED_HEADER: &str = "x-kvfleet-predicted-cached-tokens";

/// Prompts with more text than this are tokenized on a blocking thread.
const INLINE_TOKENIZE_BYTES: usize = 16 * 1024;

/// The model the workers serve, as the router answers for it while none is ready.
pub struct ServedModel {
    /// The id in the OpenAI API (the workers').
    pub name: String,
    /// The workers' maxModelLen (0: unknown).
    pub max_model_len: usize,
}

pub struct State {
    pub fleet: Arc<Fleet>,
    pub hold: Arc<Hold>,
    pub model: ServedModel,
    pub client: HttpClient,
    pub tokenizer: Arc<Tokenizer>,
    /// The workers' block size (their events and scrapes say it too; this is the default).
    pub block_size: usize,
    pub metrics: Arc<RouterMetrics>,
    /// Each body's size and time limits, and the budget of those in flight.
    pub bodies: BodyLimits,
    pub timeouts: UpstreamTimeouts,
    /// Tokenizations at once (one per core: more add no throughput, only working sets).
    pub tokenizing: Arc<tokio::sync::Semaphore>,
    /// Bytes of text one token of the model covers at most (see [`too_long`]).
    pub max_token_bytes: usize,
    /// Rotates exact ties.
    pub turn: AtomicUsize,
    /// The score's weights and imbalance guard.
    pub weights: super::score::Weights,
}

/// How long the router waits on a worker.
#[derive(Clone, Copy, Debug)]
pub struct UpstreamTimeouts {
    /// From sending a streamed request to its response head (a worker sends it when it admits
    /// the request; its queue is bounded, past it the answer is a 429).
    pub first_byte: Duration,
    /// From sending a non-streamed request to its response head, which a worker sends with the
    /// whole answer: above the workers' request timeout (600 s by default), which ends it first.
    pub response: Duration,
    /// Between two chunks of a started response (the first token of a stream included: a long
    /// prefill must fit).
    pub chunk: Duration,
}

pub fn app(state: Arc<State>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/health", get(health))
        .route("/livez", get(|| async { "ok" }))
        .route("/metrics", get(metrics))
        .route("/v1/router/state", get(state_of))
        // A wrong method on a route of its own answers as a worker does (OpenAI's error shape).
        .method_not_allowed_fallback(crate::serving::openai::method_not_allowed)
        .fallback(pass_through)
        .with_state(state)
}

async fn chat(Extract(s): Extract<Arc<State>>, req: Request<Body>) -> Response {
    routed(s, req, true).await
}

async fn completions(Extract(s): Extract<Arc<State>>, req: Request<Body>) -> Response {
    routed(s, req, false).await
}

/// 200 while the router runs, with no replica ready too: it is what holds requests then.
async fn health(Extract(s): Extract<Arc<State>>) -> Response {
    let body = json!({ "replicas": s.fleet.ready().len(), "readyReplicas": s.fleet.answering() });
    (StatusCode::OK, Json(body)).into_response()
}

async fn metrics(Extract(s): Extract<Arc<State>>) -> Response {
    s.fleet.observe();
    (
        [(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.encode(),
    )
        .into_response()
}

async fn state_of(Extract(s): Extract<Arc<State>>) -> Response {
    let replicas: Vec<_> = s
        .fleet
        .ready()
        .iter()
        .map(|u| {
            let load = u.load.lock().map(|l| l.clone()).unwrap_or_default();
            let (blocks, gaps, max_blocks, evicted) = u
                .index
                .lock()
                .map(|i| (i.len(), i.gaps, i.max_blocks(), i.evicted))
                .unwrap_or_default();
            json!({
                "name": u.endpoint.name,
                "url": u.endpoint.url,
                "kvEvents": u.endpoint.kv_events,
                "subscribed": u.subscribed.load(Ordering::Relaxed),
                "cachedBlocks": blocks,
                "eventGaps": gaps,
                "maxBlocks": max_blocks,
                "evictedBlocks": evicted,
                "startId": load.start_id,
                "inflight": u.inflight.load(Ordering::Relaxed),
                "scraped": load.at.is_some(),
                "answering": u.answering.load(Ordering::Relaxed),
                "running": load.running,
                "waiting": load.waiting,
                "freeTokens": load.free_tokens,
            })
        })
        .collect();
    let held = s.hold.snapshot();
    Json(json!({
        "replicas": replicas,
        "readyReplicas": s.fleet.answering(),
        "bodyBytesInFlight": s.bodies.in_flight(),
        "held": {
            "requests": held.requests,
            "promptTokens": held.prompt_tokens,
            "demandTokens": held.demand_tokens,
            "oldestSeconds": held.oldest_seconds,
        },
    }))
    .into_response()
}

/// The served model as a worker describes it (`GET /v1/models`).
fn model_card(m: &ServedModel) -> serde_json::Value {
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    json!({
        "id": m.name,
        "object": "model",
        "created": created,
        "owned_by": "kvfleet",
        "root": m.name,
        "parent": null,
        "max_model_len": m.max_model_len,
    })
}

/// A 503 that tells the client when to come back.
fn unavailable(code: &str, message: impl Into<String>) -> Response {
    let body = json!({"error": {
        "message": message.into(),
        "type": "service_unavailable",
        "param": null,
        "code": code,
    }});
    let mut r = (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response();
    r.headers_mut().insert(
        axum::http::header::RETRY_AFTER,
        HeaderValue::from(RETRY_AFTER_SECONDS),
    );
    r
}

fn rejected(r: Rejection) -> Response {
    unavailable(r.code(), r.message())
}

/// An OpenAI-shaped error.
fn error(status: StatusCode, kind: &str, message: impl Into<String>) -> Response {
    let body =
        json!({"error": {"message": message.into(), "type": kind, "param": null, "code": status.as_u16()}});
    (status, Json(body)).into_response()
}

/// An OpenAI-shaped error with the code a worker gives the same case.
fn error_coded(status: StatusCode, kind: &str, code: &str, message: impl Into<String>) -> Response {
    let body = json!({"error": {"message": message.into(), "type": kind, "param": null, "code": code}});
    (status, Json(body)).into_response()
}

/// Reads a request's body under the router's limits; the refusal a client gets otherwise
/// (the worker's statuses and codes: 413, 408, 503 with Retry-After, 400).
async fn read_body(s: &State, body: Body) -> Result<(Bytes, BodyPermit), Response> {
    s.bodies.read(body).await.map_err(|e| {
        s.metrics
            .refused
            .with_label_values(&[super::body::metric_label(&e)])
            .inc();
        let (status, code) = (
            e.status(),
            match &e {
                BodyError::TooLarge { .. } => "request_too_large",
                BodyError::TimedOut { .. } => "request_timeout",
                BodyError::Busy { .. } => "body_budget",
                BodyError::Read { .. } => "invalid_request",
            },
        );
        let message = match &e {
            BodyError::TooLarge { limit } => {
                format!("the request body is over the router's limit of {limit} bytes; send a shorter prompt")
            }
            other => other.to_string(),
        };
        let kind = if status.is_server_error() {
            "service_unavailable"
        } else {
            "invalid_request_error"
        };
        let mut r = error_coded(status, kind, code, message);
        if let Some(after) = e.retry_after() {
            r.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                HeaderValue::from(after.as_secs().max(1)),
            );
        }
        r
    })
}

/// Text that cannot fit maxModelLen, refused before it is tokenized as a worker refuses it:
/// `bytes` of text encode to at least `bytes / max_token_bytes` tokens (no token covers more),
/// so the tokenizer never runs on more than maxModelLen x max_token_bytes bytes. The workers'
/// maxModelLen is the largest their scrapes report, else the router's.
fn too_long(s: &State, text_bytes: usize) -> Option<Response> {
    let reported = s
        .fleet
        .ready()
        .iter()
        .filter_map(|u| u.load.lock().ok().map(|l| l.max_model_len))
        .max()
        .unwrap_or(0);
    let max_model_len = if reported > 0 {
        reported
    } else {
        s.model.max_model_len
    };
    let at_least = text_bytes.div_ceil(s.max_token_bytes.max(1));
    if max_model_len == 0 || at_least < max_model_len {
        return None;
    }
    s.metrics.refused.with_label_values(&["prompt_too_long"]).inc();
    let message = format!(
        "the prompt has {text_bytes} bytes of text, so at least {at_least} tokens (a token of this model \
         covers at most {} bytes); maxModelLen is {max_model_len} (shorten the prompt)",
        s.max_token_bytes
    );
    Some(error_coded(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        "context_length_exceeded",
        message,
    ))
}

/// Whether a request asks for a stream (`"stream": true`).
fn streamed(body: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Stream {
        #[serde(default)]
        stream: Option<bool>,
    }
    serde_json::from_slice::<Stream>(body).is_ok_and(|s| s.stream == Some(true))
}

/// What became of a request sent to one replica, before its response head.
enum Sent {
    Head(axum::http::Response<hyper::body::Incoming>),
    /// No connection: nothing reached the replica.
    Connect(String),
    /// Sent, and the connection closed before an answer.
    Reset(String),
    TimedOut(Duration),
    Down,
}

impl Sent {
    fn metric_label(&self) -> &'static str {
        match self {
            Sent::Head(_) => "none",
            Sent::Connect(_) => "connect",
            Sent::Reset(_) => "reset",
            Sent::TimedOut(_) => "first_byte_timeout",
            Sent::Down => "replica_down",
        }
    }
}

/// Sends `req` to `u`, waiting for its head at most `limit`, or until `u` is marked down.
async fn send(s: &State, u: &Upstream, req: Request<Body>, limit: Duration) -> Sent {
    let mut down = u.down.subscribe();
    tokio::select! {
        r = tokio::time::timeout(limit, s.client.request(req)) => match r {
            Ok(Ok(resp)) => Sent::Head(resp),
            Ok(Err(e)) if e.is_connect() => Sent::Connect(e.to_string()),
            Ok(Err(e)) => Sent::Reset(format!("{e}: {}", std::error::Error::source(&e).map(ToString::to_string).unwrap_or_default())),
            Err(_) => Sent::TimedOut(limit),
        },
        () = marked_down(&mut down) => Sent::Down,
    }
}

/// A generation request: tokenize, rank, forward.
async fn routed(s: Arc<State>, req: Request<Body>, chat: bool) -> Response {
    let arrived = Instant::now();
    let (parts, body) = req.into_parts();
    // Reserved in the bodies' budget until the request is answered.
    let (body, _reserved) = match read_body(&s, body).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    // The router's own latency starts once the client has sent the whole body.
    let mut read = Instant::now();
    // JSON and token-id prompts inline (a 4,000-token prompt parses and hashes in well under a
    // millisecond); long texts are tokenized on a blocking thread, one per core at a time.
    let ids = match RoutingPrompt::parse(chat, &body) {
        Some(p) if p.text_bytes() > INLINE_TOKENIZE_BYTES => {
            if let Some(r) = too_long(&s, p.text_bytes()) {
                return r;
            }
            let Ok(_permit) = s.tokenizing.acquire().await else {
                return error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "server_error",
                    "tokenizer closed",
                );
            };
            let tok = s.tokenizer.clone();
            tokio::task::spawn_blocking(move || p.into_ids(&tok))
                .await
                .ok()
                .flatten()
        }
        Some(p) => p.into_ids(&s.tokenizer),
        None => None,
    };
    let stream = streamed(&body);
    let prompt_tokens = ids.as_ref().map_or(0, |(ids, _)| ids.len());
    // Held while no replica is ready, and behind the requests already held (arrival order).
    let mut ticket = None;
    if s.fleet.answering() == 0 || !s.hold.is_empty() {
        let demand = Demand::of(&body, chat, prompt_tokens, s.model.max_model_len);
        let fleet = s.fleet.clone();
        let held = Instant::now();
        match s
            .hold
            .wait(demand, s.fleet.subscribe(), move || fleet.answering() > 0)
            .await
        {
            Ok(t) => ticket = Some(t),
            Err(r) => return rejected(r),
        }
        // The router's pick latency leaves the wait out (kvfleet_router_hold_seconds has it).
        read += held.elapsed();
    }
    let replicas = s.fleet.routable();
    if replicas.is_empty() {
        return unavailable("no_replica", "no ready replica to route to; retry");
    }
    // One hashing per block size in use (normally one).
    let mut prompts: Vec<PromptBlocks> = Vec::new();
    let mut candidates = Vec::with_capacity(replicas.len());
    for u in &replicas {
        let load = u.load.lock().map(|l| l.clone()).unwrap_or_default();
        // The prompt's blocks are hashed outside the replica's lock: a 4,200-token prompt is
        // some 260 sha256 blocks, and the KV-event subscriber and other requests' lookups wait
        // on that lock.
        let (index_bs, held) = u
            .index
            .lock()
            .map(|i| (i.block_size(), i.held()))
            .unwrap_or_default();
        let cached = match &ids {
            Some((ids, key)) => {
                let bs = index_bs
                    .or((load.block_size > 0).then_some(load.block_size))
                    .unwrap_or(s.block_size);
                let p = match prompts.iter().position(|p| p.block_size == bs) {
                    Some(i) => &prompts[i],
                    None => {
                        prompts.push(PromptBlocks::new(ids, key.clone(), bs));
                        prompts.last().expect("just pushed")
                    }
                };
                u.index.lock().map_or(0, |idx| p.cached_tokens(&idx))
            }
            None => 0,
        };
        let sent = u.sent_tokens.load(Ordering::Relaxed);
        candidates.push(Candidate {
            name: u.endpoint.name.clone(),
            cached_tokens: cached,
            inflight: u.inflight.load(Ordering::Relaxed),
            reported_busy: load
                .at
                .map(|_| (load.running + load.waiting).saturating_sub(u.finished.load(Ordering::Relaxed))),
            free_tokens: load.at.map(|_| load.free_tokens.saturating_sub(sent)),
            max_num_seqs: load.max_num_seqs,
            held_blocks: held,
        });
    }
    let session = parts.headers.get(SESSION_HEADER).and_then(|v| v.to_str().ok());
    let turn = s.turn.fetch_add(1, Ordering::Relaxed);
    let (order, reason) = rank(prompt_tokens, &candidates, session, turn, &s.weights);
    // Placed: the next held request may go.
    drop(ticket);
    let mut first_try = true;
    let mut last_error = String::new();
    let mut retries_left = usize::from(!stream);
    let mut failed_after_send: Option<Sent> = None;
    for i in order {
        let (u, c) = (&replicas[i], &candidates[i]);
        let flight = Flight::start(u.clone(), s.metrics.clone(), c.cached_tokens, arrived);
        u.sent_tokens
            .fetch_add(prompt_tokens.saturating_sub(c.cached_tokens), Ordering::Relaxed);
        let upstream = match upstream_request(&parts, &u.endpoint.url, body.clone()) {
            Ok(r) => r,
            Err(e) => return error(StatusCode::BAD_REQUEST, "invalid_request_error", e),
        };
        if first_try {
            s.metrics.pick_seconds.observe(read.elapsed().as_secs_f64());
        }
        let limit = if stream {
            s.timeouts.first_byte
        } else {
            s.timeouts.response
        };
        let sent = send(&s, u, upstream, limit).await;
        let failure = match sent {
            Sent::Head(resp) if resp.status() == StatusCode::SERVICE_UNAVAILABLE => {
                s.metrics
                    .upstream_errors
                    .with_label_values(&[&u.endpoint.name, "unavailable"])
                    .inc();
                last_error = format!("{} answered 503", u.endpoint.name);
                first_try = false;
                continue;
            }
            Sent::Head(resp) => {
                // Later requests of this prefix follow it while its blocks are computed here.
                if let (Some(p), Ok(mut idx)) = (prompts.first(), u.index.lock()) {
                    idx.expect(p.cacheable(), Instant::now());
                }
                let why = if first_try { reason.as_str() } else { "fallback" };
                s.metrics
                    .requests
                    .with_label_values(&[&u.endpoint.name, why])
                    .inc();
                s.metrics.predicted_cached_tokens.inc_by(c.cached_tokens as u64);
                return respond(resp, flight, &s);
            }
            failure => failure,
        };
        s.metrics
            .upstream_errors
            .with_label_values(&[&u.endpoint.name, failure.metric_label()])
            .inc();
        tracing::info!(replica = %u.endpoint.name, kind = failure.metric_label(), "upstream failed before its answer");
        first_try = false;
        last_error = format!("{}: {}", u.endpoint.name, failure.metric_label());
        match failure {
            // Nothing reached it: the next replica.
            Sent::Connect(e) => last_error = format!("{}: {e}", u.endpoint.name),
            // It may have started there: sent once more elsewhere, a stream never (its client
            // may count on one generation), else answered now.
            failure if retries_left > 0 => {
                retries_left -= 1;
                s.metrics.retries.inc();
                failed_after_send = Some(failure);
            }
            failure => {
                failed_after_send = Some(failure);
                break;
            }
        }
    }
    match failed_after_send {
        Some(Sent::TimedOut(limit)) => error_coded(
            StatusCode::GATEWAY_TIMEOUT,
            "server_error",
            "upstream_timeout",
            format!("the replica did not answer within {} s; retry", limit.as_secs()),
        ),
        Some(Sent::Down) => error_coded(
            StatusCode::BAD_GATEWAY,
            "server_error",
            "replica_down",
            "the replica stopped answering before it answered this request; retry",
        ),
        Some(Sent::Reset(e)) => error_coded(
            StatusCode::BAD_GATEWAY,
            "server_error",
            "upstream_error",
            format!(
                "the replica closed the connection before answering ({e}); retry. If the body is large, \
                 the workers' --max-request-bytes may be below the router's ({} bytes): set them equal",
                s.bodies.max_bytes
            ),
        ),
        _ => error(
            StatusCode::BAD_GATEWAY,
            "upstream_error",
            format!("no replica answered ({last_error}); retry"),
        ),
    }
}

/// Anything else: to the least busy replica, unchanged.
async fn pass_through(Extract(s): Extract<Arc<State>>, req: Request<Body>) -> Response {
    let (parts, body) = req.into_parts();
    let (body, _reserved) = match read_body(&s, body).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    if s.fleet.answering() == 0 {
        return answer_while_cold(&s.model, &parts)
            .unwrap_or_else(|| unavailable("no_replica", "no replica is ready yet; retry"));
    }
    let mut replicas = s.fleet.routable();
    replicas.sort_by_key(|u| u.inflight.load(Ordering::Relaxed));
    let mut last_error = "no ready replica".to_string();
    for u in replicas {
        let Ok(upstream) = upstream_request(&parts, &u.endpoint.url, body.clone()) else {
            break;
        };
        let flight = Flight::start(u.clone(), s.metrics.clone(), 0, Instant::now());
        match send(&s, &u, upstream, s.timeouts.first_byte).await {
            Sent::Head(resp) => return respond(resp, flight, &s),
            Sent::Connect(e) => last_error = format!("{}: {e}", u.endpoint.name),
            // Sent: maybe not idempotent, not sent again.
            failure => {
                s.metrics
                    .upstream_errors
                    .with_label_values(&[&u.endpoint.name, failure.metric_label()])
                    .inc();
                last_error = format!("{}: {}", u.endpoint.name, failure.metric_label());
                break;
            }
        }
    }
    error(
        StatusCode::BAD_GATEWAY,
        "upstream_error",
        format!("no replica answered ({last_error}); retry"),
    )
}

/// What the router answers itself while no replica is ready: the model list and card, so
/// clients that look the model up first reach the hold.
fn answer_while_cold(m: &ServedModel, parts: &axum::http::request::Parts) -> Option<Response> {
    if parts.method != axum::http::Method::GET {
        return None;
    }
    let path = parts.uri.path();
    if path == "/v1/models" {
        return Some(Json(json!({"object": "list", "data": [model_card(m)]})).into_response());
    }
    let id = path.strip_prefix("/v1/models/")?;
    Some(if id == m.name {
        Json(model_card(m)).into_response()
    } else {
        let body = json!({"error": {
            "message": format!("the model `{id}` does not exist; this deployment serves `{}`", m.name),
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }});
        (StatusCode::NOT_FOUND, Json(body)).into_response()
    })
}

/// Hop-by-hop headers (RFC 9110 section 7.6.1) a proxy does not forward.
fn hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "host"
    )
}

fn upstream_request(
    parts: &axum::http::request::Parts,
    base: &str,
    body: Bytes,
) -> Result<Request<Body>, String> {
    let pq = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let mut req = Request::builder()
        .method(parts.method.clone())
        .uri(format!("{base}{pq}"))
        .body(Body::from(body))
        .map_err(|e| format!("cannot forward: {e}"))?;
    copy_headers(&parts.headers, req.headers_mut());
    Ok(req)
}

fn copy_headers(from: &HeaderMap, to: &mut HeaderMap) {
    for (k, v) in from {
        if !hop_by_hop(k) {
            to.append(k.clone(), v.clone());
        }
    }
}

fn respond(resp: axum::http::Response<hyper::body::Incoming>, mut flight: Flight, s: &State) -> Response {
    let (parts, body) = resp.into_parts();
    let mut out = Response::builder().status(parts.status);
    if let Some(h) = out.headers_mut() {
        copy_headers(&parts.headers, h);
        if let Ok(v) = HeaderValue::from_str(&flight.upstream.endpoint.name) {
            h.insert(REPLICA_HEADER, v);
        }
        h.insert(PREDICTED_HEADER, HeaderValue::from(flight.predicted));
    }
    let events = parts
        .headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let upstream = flight.upstream.clone();
    let watch = Watch {
        replica: upstream.endpoint.name.clone(),
        chunk_timeout: s.timeouts.chunk,
        down: upstream.down.subscribe(),
        events,
    };
    let metrics = s.metrics.clone();
    let on_cut = Box::new(move |cut: Cut| {
        tracing::info!(replica = %upstream.endpoint.name, kind = cut.metric_label(), "response ended by the router");
        metrics
            .upstream_errors
            .with_label_values(&[&upstream.endpoint.name, cut.metric_label()])
            .inc();
    });
    let body = watched(
        body.into_data_stream()
            .map(|c| c.map_err(axum::Error::new))
            .boxed(),
        watch,
        move |bytes| flight.saw(bytes),
        on_cut,
    );
    out.body(body)
        .unwrap_or_else(|e| error(StatusCode::BAD_GATEWAY, "upstream_error", e.to_string()))
}

/// One forwarded request: counted in flight on its replica until its response body ends or is
/// dropped; reads the worker's `cached_tokens` as the body passes.
struct Flight {
    upstream: Arc<Upstream>,
    metrics: Arc<RouterMetrics>,
    predicted: usize,
    arrived: Instant,
    first_byte: bool,
    reported: Option<usize>,
    /// The end of the previous chunk, for a key split across chunks.
    tail: Vec<u8>,
}

const CACHED_KEY: &[u8] = b"\"cached_tokens\":";

impl Flight {
    fn start(
        upstream: Arc<Upstream>,
        metrics: Arc<RouterMetrics>,
        predicted: usize,
        arrived: Instant,
    ) -> Self {
        upstream.inflight.fetch_add(1, Ordering::Relaxed);
        Self {
            upstream,
            metrics,
            predicted,
            arrived,
            first_byte: false,
            reported: None,
            tail: Vec::new(),
        }
    }

    fn saw(&mut self, bytes: &[u8]) {
        if !self.first_byte {
            self.first_byte = true;
            let label = if self.predicted > 0 { "hit" } else { "miss" };
            self.metrics
                .ttfb_seconds
                .with_label_values(&[label])
                .observe(self.arrived.elapsed().as_secs_f64());
        }
        let mut window = std::mem::take(&mut self.tail);
        window.extend_from_slice(bytes);
        if let Some(v) = last_cached_tokens(&window) {
            self.reported = Some(v);
        }
        let keep = window.len().saturating_sub(CACHED_KEY.len() + 24);
        self.tail = window.split_off(keep);
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        self.upstream.inflight.fetch_sub(1, Ordering::Relaxed);
        self.upstream.finished.fetch_add(1, Ordering::Relaxed);
        if let Some(r) = self.reported {
            self.metrics.observe_report(self.predicted, r);
        }
    }
}

/// The value of the last complete `"cached_tokens":N` in `text`.
fn last_cached_tokens(text: &[u8]) -> Option<usize> {
    let mut found = None;
    let mut at = 0;
    while let Some(p) = find(&text[at..], CACHED_KEY) {
        let start = at + p + CACHED_KEY.len();
        let rest = &text[start..];
        let rest = &rest[rest.iter().take_while(|b| **b == b' ').count()..];
        let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
        // Complete only when something follows the number.
        if digits > 0 && digits < rest.len() {
            found = std::str::from_utf8(&rest[..digits])
                .ok()
                .and_then(|d| d.parse().ok());
        }
        at = start;
    }
    found
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_tokens_are_read_from_a_body_in_any_chunking() {
        let body = br#"{"id":"x","usage":{"prompt_tokens":40,"prompt_tokens_details":{"cached_tokens":32},"total_tokens":41}}"#;
        assert_eq!(last_cached_tokens(body), Some(32));
        assert_eq!(last_cached_tokens(br#"{"cached_tokens": 7}"#), Some(7));
        assert_eq!(
            last_cached_tokens(br#"{"cached_tokens":12"#),
            None,
            "the number may go on"
        );
        assert_eq!(last_cached_tokens(b"data: {}"), None);
        // Split anywhere, fed to a Flight-like scanner with a tail.
        for cut in 1..body.len() {
            let mut tail: Vec<u8> = Vec::new();
            let mut seen = None;
            for part in [&body[..cut], &body[cut..]] {
                let mut w = std::mem::take(&mut tail);
                w.extend_from_slice(part);
                if let Some(v) = last_cached_tokens(&w) {
                    seen = Some(v);
                }
                let keep = w.len().saturating_sub(CACHED_KEY.len() + 24);
                tail = w.split_off(keep);
            }
            assert_eq!(seen, Some(32), "cut at {cut}");
        }
    }

    #[test]
    fn hop_by_hop_headers_stay_behind() {
        let mut from = HeaderMap::new();
        from.insert("connection", HeaderValue::from_static("keep-alive"));
        from.insert("host", HeaderValue::from_static("router:8000"));
        from.insert("authorization", HeaderValue::from_static("Bearer k"));
        from.insert("x-request-id", HeaderValue::from_static("r1"));
        let mut to = HeaderMap::new();
        copy_headers(&from, &mut to);
        let mut names: Vec<&str> = to.keys().map(|k| k.as_str()).collect();
        names.sort();
        assert_eq!(names, ["authorization", "x-request-id"]);
    }
}
