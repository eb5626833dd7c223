//! OpenAI-compatible HTTP API over a [`ModelRuntime`]: `/v1/models`, `/v1/completions`,
//! `/v1/chat/completions`, streaming (SSE) or not, with usage counts and OpenAI's error shape
//! (`{"error": {"message", "type", "param", "code"}}`). A client that disconnects drops its
//! event receiver, which cancels the sequence at the next step.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

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

/// Output tokens of a chat completion that names no `max_tokens`.
pub const DEFAULT_CHAT_MAX_TOKENS: usize = 1024;
/// Output tokens of a completion that names no `max_tokens` (OpenAI's default).
pub const DEFAULT_COMPLETION_MAX_TOKENS: usize = 16;

/// The API's routes, to be merged into the worker's router.
pub fn router(rt: Arc<ModelRuntime>) -> Router {
    Router::new()
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .with_state(rt)
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

    fn params(&self, default_max: usize) -> Result<SamplingParams, ApiError> {
        if self.n.is_some_and(|n| n != 1) {
            return Err(ApiError::bad("only n = 1 is supported", Some("n")));
        }
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

async fn models(State(rt): State<Arc<ModelRuntime>>) -> Json<Value> {
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

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Chat,
    Completion,
}

async fn chat_completions(State(rt): State<Arc<ModelRuntime>>, body: Bytes) -> Response {
    let run = async {
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
        let prompt = rt
            .tokenizer
            .apply_chat_template(&messages)
            .map_err(|e| ApiError::bad(e.to_string(), Some("messages")))?;
        let params = req.common.params(DEFAULT_CHAT_MAX_TOKENS)?;
        let ids = rt.tokenizer.encode(&prompt, true);
        Ok((ids, params, req.common))
    };
    match run.await {
        Ok((ids, params, common)) => respond(rt, Kind::Chat, ids, params, common).await,
        Err(e) => e.into_response(),
    }
}

async fn completions(State(rt): State<Arc<ModelRuntime>>, body: Bytes) -> Response {
    let run = async {
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
                rt.tokenizer.encode(&prompt, true)
            }
        };
        Ok((ids, params, req.common))
    };
    match run.await {
        Ok((ids, params, common)) => respond(rt, Kind::Completion, ids, params, common).await,
        Err(e) => e.into_response(),
    }
}

async fn respond(
    rt: Arc<ModelRuntime>,
    kind: Kind,
    ids: Vec<u32>,
    params: SamplingParams,
    common: Common,
) -> Response {
    let param = match kind {
        Kind::Chat => "messages",
        Kind::Completion => "prompt",
    };
    let rx = match rt.generate(ids, params) {
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
    };
    if common.stream {
        let include_usage = common.stream_options.unwrap_or_default().include_usage;
        Sse::new(sse_stream(meta, rx, include_usage)).into_response()
    } else {
        collect(meta, rx).await
    }
}

struct Meta {
    id: String,
    created: u64,
    model: String,
    kind: Kind,
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
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
                    "usage": usage(prompt_tokens, completion_tokens),
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
        let events: Vec<Event> = match st {
            St::Done => return None,
            St::Start if meta.kind == Kind::Chat => {
                let ev = data(chunk(&meta, Some(""), true, None));
                return Some((vec![ev], (rx, St::Running, meta)));
            }
            _ => match rx.recv().await {
                Some(GenEvent::Text(t)) => vec![data(chunk(&meta, Some(&t), false, None))],
                Some(GenEvent::Done {
                    reason,
                    prompt_tokens,
                    completion_tokens,
                }) => {
                    let mut v = vec![data(chunk(&meta, None, false, Some(reason)))];
                    if include_usage {
                        let mut u = chunk(&meta, None, false, None);
                        u["choices"] = json!([]);
                        u["usage"] = usage(prompt_tokens, completion_tokens);
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
        };
        Some((events, (rx, St::Running, meta)))
    })
    .flat_map(|evs| futures::stream::iter(evs.into_iter().map(Ok)))
}
