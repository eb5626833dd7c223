//! OpenAI-compatible HTTP API over a [`ModelRuntime`]: `/v1/models`, `/v1/completions`,
//! `/v1/chat/completions`, streaming (SSE) or not, with usage counts and OpenAI's error shape
//! (`{"error": {"message", "type", "param", "code"}}`). A client that disconnects drops its
//! event receiver, which cancels the sequence at the next step.
//!
//! Bounded against hostile or broken clients ([`ApiLimits`]): the body is read under a size
//! limit (413) and a time limit (408), a request that runs past the request timeout is ended
//! (504, or an error chunk on a stream) and its sequence cancelled, tokenisation runs on the
//! blocking pool (never on the threads that answer health probes), and parameters the server
//! does not implement are refused with 400 naming them instead of being ignored.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::{Stream, StreamExt};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use super::runtime::{FinishReason, GenEvent, ModelRuntime, RuntimeError};
use super::sampling::SamplingParams;
use super::tokenizer::ChatMessage;
use kvfleet_engine::engine::prefix::CacheKey;

/// Output tokens of a chat completion that names no `max_tokens`.
pub const DEFAULT_CHAT_MAX_TOKENS: usize = 1024;
/// Output tokens of a completion that names no `max_tokens` (OpenAI's default).
pub const DEFAULT_COMPLETION_MAX_TOKENS: usize = 16;

/// Limits on what one request may cost the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApiLimits {
    /// Largest request body; more is answered 413 before it is parsed.
    pub max_body_bytes: usize,
    /// Time a client has to send its whole body (a slow sender is answered 408).
    pub body_timeout: Duration,
    /// Time from arrival to the last token; past it the request ends (504 or an error chunk)
    /// and its sequence is cancelled at the next step.
    pub request_timeout: Duration,
}

impl Default for ApiLimits {
    fn default() -> Self {
        ApiLimits {
            // 4 MiB: about a million tokens of text, far over any context this server takes.
            max_body_bytes: 4 << 20,
            body_timeout: Duration::from_secs(30),
            request_timeout: Duration::from_secs(600),
        }
    }
}

#[derive(Clone)]
struct Api {
    rt: Arc<ModelRuntime>,
    limits: ApiLimits,
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

/// The API's routes with the given limits; with a key, every route asks for it (401).
pub fn router_with(rt: Arc<ModelRuntime>, limits: ApiLimits, key: Option<ApiKey>) -> Router {
    let routes = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .with_state(Api { rt, limits });
    match key {
        Some(key) => routes.layer(axum::middleware::from_fn_with_state(key, require_key)),
        None => routes,
    }
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

/// An error in OpenAI's shape.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    kind: &'static str,
    param: Option<&'static str>,
    code: Option<&'static str>,
}

impl ApiError {
    fn bad(message: impl Into<String>, param: Option<&'static str>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param,
            code: None,
        }
    }

    fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.body())).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            r.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static("1"),
            );
        }
        r
    }
}

impl ApiError {
    fn status(status: StatusCode, kind: &'static str, code: &'static str, message: String) -> Self {
        ApiError {
            status,
            message,
            kind,
            param: None,
            code: Some(code),
        }
    }

    /// A runtime refusal; `param` names the request field a prompt error is about.
    fn from_runtime(e: RuntimeError, param: &'static str) -> Self {
        match e {
            RuntimeError::PromptTooLong { .. }
            | RuntimeError::PromptOverCapacity { .. }
            | RuntimeError::EmptyPrompt => ApiError::bad(e.to_string(), Some(param)),
            RuntimeError::QueueFull { .. } => ApiError {
                status: StatusCode::TOO_MANY_REQUESTS,
                message: e.to_string(),
                kind: "rate_limit_error",
                param: None,
                code: Some("queue_full"),
            },
            other => ApiError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                message: other.to_string(),
                kind: "server_error",
                param: None,
                code: None,
            },
        }
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

/// A completions prompt: text, a list of one text, or token ids (as OpenAI and vLLM accept;
/// benchmarks use ids for exact prompt lengths).
#[derive(Deserialize)]
#[serde(untagged)]
enum Prompt {
    Tokens(Vec<u32>),
    Text(OneOrMany),
}

impl OneOrMany {
    fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

#[derive(Deserialize)]
struct MessageIn {
    role: String,
    content: Option<Content>,
}

#[derive(Deserialize, Default)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// Fields shared by both endpoints; unknown fields are ignored.
#[derive(Deserialize, Default)]
struct Common {
    model: Option<String>,
    max_tokens: Option<usize>,
    max_completion_tokens: Option<usize>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    seed: Option<u64>,
    stop: Option<OneOrMany>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    n: Option<usize>,
    #[serde(default)]
    ignore_eos: bool,
    /// vLLM's prefix-cache partition: requests share cached KV blocks only with requests of
    /// the same salt (docs/security.md).
    cache_salt: Option<String>,
    // Parameters clients send that this server does not implement: refused when they ask
    // for something (a default value is accepted), never silently ignored.
    logprobs: Option<Value>,
    top_logprobs: Option<Value>,
    echo: Option<bool>,
    best_of: Option<usize>,
    suffix: Option<String>,
    logit_bias: Option<Value>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    response_format: Option<Value>,
    tools: Option<Value>,
}

/// Whether a JSON value asks for something: not null, false, 0, "", [] or {}.
fn asks(v: &Option<Value>) -> bool {
    match v {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Number(n)) => n.as_f64() != Some(0.0),
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
        Some(Value::Bool(true)) => true,
    }
}

#[derive(Deserialize)]
struct ChatRequest {
    messages: Vec<MessageIn>,
    #[serde(flatten)]
    common: Common,
}

#[derive(Deserialize)]
struct CompletionRequest {
    prompt: Prompt,
    #[serde(flatten)]
    common: Common,
}

fn parse<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::bad(format!("invalid request body: {e}"), None))
}

impl Common {
    fn check_model(&self, rt: &ModelRuntime) -> Result<(), ApiError> {
        match &self.model {
            Some(m) if m != &rt.name => Err(ApiError {
                status: StatusCode::NOT_FOUND,
                message: format!("The model `{m}` does not exist; this server serves `{}`", rt.name),
                kind: "invalid_request_error",
                param: Some("model"),
                code: Some("model_not_found"),
            }),
            _ => Ok(()),
        }
    }

    /// Refuses, naming it, the first parameter that asks for something not implemented.
    fn check_supported(&self) -> Result<(), ApiError> {
        let text_format = self
            .response_format
            .as_ref()
            .is_none_or(|f| f.is_null() || f.get("type").and_then(Value::as_str) == Some("text"));
        let unsupported: [(&'static str, bool); 10] = [
            ("n", self.n.is_some_and(|n| n != 1)),
            ("logprobs", asks(&self.logprobs)),
            ("top_logprobs", asks(&self.top_logprobs)),
            ("echo", self.echo == Some(true)),
            ("best_of", self.best_of.is_some_and(|b| b > 1)),
            ("suffix", self.suffix.as_deref().is_some_and(|s| !s.is_empty())),
            ("logit_bias", asks(&self.logit_bias)),
            (
                "presence_penalty",
                self.presence_penalty.is_some_and(|p| p != 0.0),
            ),
            (
                "frequency_penalty",
                self.frequency_penalty.is_some_and(|p| p != 0.0),
            ),
            ("response_format", !text_format),
        ];
        if let Some((param, _)) = unsupported.iter().find(|(_, asked)| *asked) {
            let what = match *param {
                "n" | "best_of" => "only one choice per request is generated (n = 1)",
                "response_format" => "only free text is generated (type `text`)",
                _ => "this server does not compute it",
            };
            return Err(ApiError::bad(
                format!(
                    "`{param}` is not supported by the kvfleet worker: {what}; remove it from the request"
                ),
                Some(param),
            ));
        }
        if asks(&self.tools) {
            return Err(ApiError::bad(
                "`tools` is not supported by the kvfleet worker (no tool calling); remove it from the request",
                Some("tools"),
            ));
        }
        Ok(())
    }

    /// The prefix-cache partition of the request (`cache_salt`).
    fn cache_key(&self) -> Result<CacheKey, ApiError> {
        match &self.cache_salt {
            Some(s) if s.is_empty() => Err(ApiError::bad(
                "`cache_salt` must be a non-empty string when given; omit it to share the cache with other unsalted requests",
                Some("cache_salt"),
            )),
            salt => Ok(CacheKey {
                salt: salt.clone(),
                adapter: None,
            }),
        }
    }

    fn params(&self, default_max: usize) -> Result<SamplingParams, ApiError> {
        self.cache_key()?;
        self.check_supported()?;
        let top_k = match self.top_k {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => k as usize,
            Some(k) => {
                return Err(ApiError::bad(
                    format!("top_k {k} must be -1, 0 or positive"),
                    Some("top_k"),
                ))
            }
        };
        let p = SamplingParams {
            temperature: self.temperature.unwrap_or(1.0),
            top_p: self.top_p.unwrap_or(1.0),
            top_k,
            seed: self.seed,
            ignore_eos: self.ignore_eos,
            max_tokens: self
                .max_completion_tokens
                .or(self.max_tokens)
                .unwrap_or(default_max),
            stop: self
                .stop
                .as_ref()
                .map(|s| match s {
                    OneOrMany::One(s) => vec![s.clone()],
                    OneOrMany::Many(v) => v.clone(),
                })
                .unwrap_or_default(),
        };
        p.check().map_err(|m| {
            let field = ["temperature", "top_p", "max_tokens", "stop"]
                .into_iter()
                .find(|f| m.contains(f));
            ApiError::bad(m, field)
        })?;
        Ok(p)
    }
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn models(State(Api { rt, .. }): State<Api>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": rt.name,
            "object": "model",
            "created": now_secs(),
            "owned_by": "kvfleet",
            "max_model_len": rt.max_model_len,
        }],
    }))
}

/// The request body, under the size and time limits.
async fn read_body(req: axum::extract::Request, limits: &ApiLimits) -> Result<Bytes, ApiError> {
    let too_large = || {
        ApiError::status(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "request_too_large",
            format!(
                "the request body is over the worker's limit of {} bytes; send a shorter prompt",
                limits.max_body_bytes
            ),
        )
    };
    let declared = req
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limits.max_body_bytes as u64) {
        return Err(too_large());
    }
    let read = axum::body::to_bytes(req.into_body(), limits.max_body_bytes);
    match tokio::time::timeout(limits.body_timeout, read).await {
        Ok(Ok(body)) => Ok(body),
        Ok(Err(e)) if format!("{e:?}").contains("LengthLimit") => Err(too_large()),
        Ok(Err(e)) => Err(ApiError::bad(format!("cannot read the request body: {e}"), None)),
        Err(_) => Err(ApiError::status(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            "request_timeout",
            format!(
                "the request body did not arrive within {} s",
                limits.body_timeout.as_secs()
            ),
        )),
    }
}

/// Runs tokenisation (or any CPU work on the request) on the blocking pool, off the threads
/// that serve other requests and health probes.
async fn off_async<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| server_error(format!("tokenisation failed: {e}")))
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Chat,
    Completion,
}

async fn chat_completions(State(api): State<Api>, req: axum::extract::Request) -> Response {
    let arrived = tokio::time::Instant::now();
    let rt = api.rt.clone();
    let run = async {
        let body = read_body(req, &api.limits).await?;
        let req: ChatRequest = parse(&body)?;
        req.common.check_model(&rt)?;
        if req.messages.is_empty() {
            return Err(ApiError::bad("messages must not be empty", Some("messages")));
        }
        let mut messages = Vec::with_capacity(req.messages.len());
        for m in req.messages {
            let content = match m.content {
                None => String::new(),
                Some(Content::Text(t)) => t,
                Some(Content::Parts(parts)) => {
                    let mut s = String::new();
                    for p in parts {
                        if p.kind != "text" {
                            return Err(ApiError::bad(
                                format!("content part type `{}` is not supported (text only)", p.kind),
                                Some("messages"),
                            ));
                        }
                        s.push_str(p.text.as_deref().unwrap_or(""));
                    }
                    s
                }
            };
            messages.push(ChatMessage {
                role: m.role,
                content,
            });
        }
        let params = req.common.params(DEFAULT_CHAT_MAX_TOKENS)?;
        let tokenizer = rt.tokenizer.clone();
        let ids = off_async(move || {
            tokenizer
                .apply_chat_template(&messages)
                .map(|prompt| tokenizer.encode(&prompt, true))
        })
        .await?
        .map_err(|e| ApiError::bad(e.to_string(), Some("messages")))?;
        Ok((ids, params, req.common))
    };
    let prepared = run.await;
    answer(rt, Kind::Chat, prepared, arrived, &api.limits).await
}

async fn completions(State(api): State<Api>, req: axum::extract::Request) -> Response {
    let arrived = tokio::time::Instant::now();
    let rt = api.rt.clone();
    let run = async {
        let body = read_body(req, &api.limits).await?;
        let req: CompletionRequest = parse(&body)?;
        req.common.check_model(&rt)?;
        let params = req.common.params(DEFAULT_COMPLETION_MAX_TOKENS)?;
        let ids = match req.prompt {
            Prompt::Tokens(ids) => {
                let vocab = rt.vocab_size;
                if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
                    return Err(ApiError::bad(
                        format!("token id {bad} is outside the vocabulary of {vocab}"),
                        Some("prompt"),
                    ));
                }
                ids
            }
            Prompt::Text(text) => {
                let mut prompts = text.into_vec();
                if prompts.len() != 1 {
                    return Err(ApiError::bad(
                        "exactly one prompt string is supported",
                        Some("prompt"),
                    ));
                }
                let prompt = prompts.pop().unwrap_or_default();
                let tokenizer = rt.tokenizer.clone();
                off_async(move || tokenizer.encode(&prompt, true)).await?
            }
        };
        Ok((ids, params, req.common))
    };
    let prepared = run.await;
    answer(rt, Kind::Completion, prepared, arrived, &api.limits).await
}

/// The response to a request that was parsed and tokenised (`Ok`), or the error that stopped it.
async fn answer(
    rt: Arc<ModelRuntime>,
    kind: Kind,
    prepared: Result<(Vec<u32>, SamplingParams, Common), ApiError>,
    arrived: tokio::time::Instant,
    limits: &ApiLimits,
) -> Response {
    match prepared {
        Ok((ids, params, common)) => {
            let deadline = arrived + limits.request_timeout;
            respond(rt, kind, ids, params, common, deadline, limits.request_timeout).await
        }
        Err(e) => e.into_response(),
    }
}

async fn respond(
    rt: Arc<ModelRuntime>,
    kind: Kind,
    ids: Vec<u32>,
    params: SamplingParams,
    common: Common,
    deadline: tokio::time::Instant,
    timeout: Duration,
) -> Response {
    let param = match kind {
        Kind::Chat => "messages",
        Kind::Completion => "prompt",
    };
    let key = common.cache_key().unwrap_or_default();
    let rx = match rt.generate_with(ids, params, key) {
        Ok(rx) => rx,
        Err(e) => return ApiError::from_runtime(e, param).into_response(),
    };
    let n = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let meta = Meta {
        id: match kind {
            Kind::Chat => format!("chatcmpl-kvfleet-{n}"),
            Kind::Completion => format!("cmpl-kvfleet-{n}"),
        },
        created: now_secs(),
        model: rt.name.clone(),
        kind,
        deadline,
        timeout,
    };
    if common.stream {
        let include_usage = common.stream_options.unwrap_or_default().include_usage;
        Sse::new(sse_stream(meta, rx, include_usage)).into_response()
    } else {
        let timeout = meta.timeout;
        match tokio::time::timeout_at(deadline, collect(meta, rx)).await {
            Ok(response) => response,
            // Dropping the receiver cancels the sequence at the loop's next step.
            Err(_) => timed_out(timeout).into_response(),
        }
    }
}

struct Meta {
    id: String,
    created: u64,
    model: String,
    kind: Kind,
    /// When the request must have ended (arrival + the request timeout).
    deadline: tokio::time::Instant,
    timeout: Duration,
}

fn timed_out(timeout: Duration) -> ApiError {
    ApiError::status(
        StatusCode::GATEWAY_TIMEOUT,
        "timeout_error",
        "request_timeout",
        format!(
            "the request ran past the worker's request timeout of {} s and was stopped; ask for fewer tokens or raise --request-timeout-seconds",
            timeout.as_secs()
        ),
    )
}

/// OpenAI's usage object; `prompt_tokens_details.cached_tokens` are the prompt tokens whose KV
/// came from the prefix cache (as OpenAI and vLLM report them).
fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

fn server_error(message: String) -> ApiError {
    ApiError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        message,
        kind: "server_error",
        param: None,
        code: None,
    }
}

async fn collect(meta: Meta, mut rx: UnboundedReceiver<GenEvent>) -> Response {
    let mut text = String::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            GenEvent::Text(t) => text.push_str(&t),
            GenEvent::Error(m) => return server_error(m).into_response(),
            GenEvent::Done {
                reason,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            } => {
                let choice = match meta.kind {
                    Kind::Chat => json!({
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": null,
                        "finish_reason": reason.as_str(),
                    }),
                    Kind::Completion => json!({
                        "index": 0,
                        "text": text,
                        "logprobs": null,
                        "finish_reason": reason.as_str(),
                    }),
                };
                return Json(json!({
                    "id": meta.id,
                    "object": if meta.kind == Kind::Chat { "chat.completion" } else { "text_completion" },
                    "created": meta.created,
                    "model": meta.model,
                    "choices": [choice],
                    "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
                }))
                .into_response();
            }
        }
    }
    server_error("the generation loop stopped before the request finished".into()).into_response()
}

fn chunk(meta: &Meta, text: Option<&str>, first: bool, finish: Option<FinishReason>) -> Value {
    let finish = finish.map(FinishReason::as_str);
    let (object, choice) = match meta.kind {
        Kind::Chat => {
            let mut delta = serde_json::Map::new();
            if first {
                delta.insert("role".into(), json!("assistant"));
            }
            if let Some(t) = text {
                delta.insert("content".into(), json!(t));
            }
            (
                "chat.completion.chunk",
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}),
            )
        }
        Kind::Completion => (
            "text_completion",
            json!({"index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish}),
        ),
    };
    json!({
        "id": meta.id,
        "object": object,
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
    })
}

fn sse_stream(
    meta: Meta,
    rx: UnboundedReceiver<GenEvent>,
    include_usage: bool,
) -> impl Stream<Item = Result<Event, Infallible>> {
    enum St {
        Start,
        Running,
        Done,
    }
    let data = |v: Value| Event::default().data(v.to_string());
    futures::stream::unfold((rx, St::Start, meta), move |(mut rx, st, meta)| async move {
        // A chat stream's `role` goes with its first token, as vLLM sends it: clients that stamp
        // the time to first token on the first chunk (vllm bench serve) measure the prefill.
        let first = matches!(st, St::Start) && meta.kind == Kind::Chat;
        let events: Vec<Event> = match st {
            St::Done => return None,
            _ => match tokio::time::timeout_at(meta.deadline, rx.recv()).await {
                Err(_) => {
                    // Past the deadline: an explicit error chunk, then the end; dropping the
                    // receiver cancels the sequence.
                    let v = vec![
                        data(timed_out(meta.timeout).body()),
                        Event::default().data("[DONE]"),
                    ];
                    return Some((v, (rx, St::Done, meta)));
                }
                Ok(next) => match next {
                    Some(GenEvent::Text(t)) => vec![data(chunk(&meta, Some(&t), first, None))],
                    Some(GenEvent::Done {
                        reason,
                        prompt_tokens,
                        completion_tokens,
                        cached_tokens,
                    }) => {
                        let mut v = Vec::new();
                        if first {
                            v.push(data(chunk(&meta, Some(""), true, None)));
                        }
                        v.push(data(chunk(&meta, None, false, Some(reason))));
                        if include_usage {
                            let mut u = chunk(&meta, None, false, None);
                            u["choices"] = json!([]);
                            u["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens);
                            v.push(data(u));
                        }
                        v.push(Event::default().data("[DONE]"));
                        return Some((v, (rx, St::Done, meta)));
                    }
                    Some(GenEvent::Error(m)) => {
                        let v = vec![data(server_error(m).body()), Event::default().data("[DONE]")];
                        return Some((v, (rx, St::Done, meta)));
                    }
                    None => return None,
                },
            },
        };
        Some((events, (rx, St::Running, meta)))
    })
    .flat_map(|evs| futures::stream::iter(evs.into_iter().map(Ok)))
}
