//! The chat and completions handlers: read, check and tokenize a request, then answer it
//! whole or as a stream.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode};
use axum::response::sse::Sse;
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value};

use super::body_budget::{self, BodyError, BodyLimits, BodyPermit};
use super::error::{server_error, timed_out, ApiError};
use super::fields::check_fields;
use super::prompt::encode_chat;
use super::request::{
    check_token_ids, parse_common, parse_object, take_chat, take_prompt, ChatPrompt, Common, Prompt,
};
use super::response::{collect, Meta};
use super::stream::sse_stream;
use super::{
    now_secs, random_id, usable_id, Api, ApiLimits, Kind, RequestId, DEFAULT_CHAT_MAX_TOKENS,
    DEFAULT_COMPLETION_MAX_TOKENS, REQUEST_ID_HEADER,
};
use crate::serving::runtime::ModelRuntime;
use kvfleet_engine::model::sampling::SamplingParams;

/// The request body, under the size and time limits and the budget of bodies in flight; the
/// permit holds the body's bytes in the budget until it is dropped.
pub(super) async fn read_body(
    req: axum::extract::Request,
    api: &Api,
) -> Result<(Bytes, BodyPermit), ApiError> {
    let limits = BodyLimits {
        max_bytes: api.limits.max_body_bytes,
        timeout: api.limits.body_timeout,
    };
    match api.bodies.read(req, limits).await {
        Ok(b) => Ok((b.bytes, b.permit)),
        Err(BodyError::TooLarge { .. }) => Err(ApiError::status(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "request_too_large",
            format!(
                "the request body is over the worker's limit of {} bytes; send a shorter prompt",
                api.limits.max_body_bytes.min(api.bodies.bytes())
            ),
        )),
        Err(e @ BodyError::Busy { .. }) => Err(ApiError::status(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "bodies_in_flight",
            format!(
                "the worker holds as many request bodies as its budget allows ({} bytes, --max-request-bytes-in-flight); retry after {} s",
                api.bodies.bytes(),
                e.retry_after().unwrap_or(body_budget::RETRY_AFTER).as_secs()
            ),
        )),
        Err(BodyError::TimedOut { timeout }) => Err(ApiError::status(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            "request_timeout",
            format!("the request body did not arrive within {} s", timeout.as_secs()),
        )),
        Err(e @ BodyError::Read { .. }) => Err(ApiError::bad(e.to_string(), None)),
    }
}

/// Runs tokenisation on the blocking pool, off the threads that serve other requests and
/// health probes, at most one per core at a time (waiting for a permit costs no memory beyond
/// the request already read).
pub(super) async fn tokenize<T: Send + 'static>(
    api: &Api,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ApiError> {
    let _permit = api
        .tokenizing
        .acquire()
        .await
        .map_err(|e| server_error(format!("tokenisation failed: {e}")))?;
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| server_error(format!("tokenisation failed: {e}")))
}

/// Refuses, before tokenising it, text that cannot fit maxModelLen: `bytes` of text encode to
/// at least `bytes / max_token_bytes` tokens (no token covers more), so when that many reach
/// maxModelLen the prompt is too long whatever the merges do. The tokenizer's work is thus
/// bounded by maxModelLen x max_token_bytes bytes a request.
pub(super) fn check_prompt_bytes(bytes: usize, rt: &ModelRuntime, param: &str) -> Result<(), ApiError> {
    let at_least = bytes.div_ceil(rt.max_token_bytes.max(1));
    if at_least >= rt.max_model_len {
        return Err(ApiError::bad(
            format!(
                "the prompt has {bytes} bytes of text, so at least {at_least} tokens (a token of this model \
                 covers at most {} bytes); maxModelLen is {} (shorten the prompt)",
                rt.max_token_bytes, rt.max_model_len
            ),
            Some(param),
        ));
    }
    Ok(())
}

/// Whether the chat brings its own template (Jinja source rather than the name of one of the
/// model's): refused unless the worker trusts request templates.
fn check_request_template(chat: &ChatPrompt, rt: &ModelRuntime, trusted: bool) -> Result<bool, ApiError> {
    let Some(asked) = chat.template.as_deref() else {
        return Ok(false);
    };
    let model = rt.tokenizer.chat_template.as_ref();
    if model.is_some_and(|t| t.source(asked).is_some()) {
        return Ok(false);
    }
    if !trusted {
        let names: Vec<&str> = model.map(|t| t.names().collect()).unwrap_or_default();
        return Err(ApiError::bad(
            format!(
                "`chat_template` is not one of the model's templates ({names:?}); a template sent in a request is \
                 rendered only by a worker started with --trust-request-chat-template"
            ),
            Some("chat_template"),
        ));
    }
    Ok(true)
}

/// The request's id: the middleware's (the client's header, or made), unless the client sent
/// none in the header and one in the body (vLLM's `request_id`).
pub(super) fn final_request_id(rid: Option<RequestId>, common: &Common) -> Result<Arc<str>, ApiError> {
    let rid = rid.unwrap_or_else(|| RequestId {
        id: random_id().into(),
        from_header: false,
    });
    match &common.request_id {
        Some(body) if !rid.from_header => {
            if usable_id(body) {
                Ok(body.as_str().into())
            } else {
                Err(ApiError::bad(
                    "`request_id` must be 1 to 128 visible ASCII characters",
                    Some("request_id"),
                ))
            }
        }
        _ => Ok(rid.id),
    }
}

/// The longest stop string that could ever match: a request's output is at most maxModelLen
/// tokens of at most [`Tokenizer::max_token_bytes`] bytes each. A longer one costs memory and
/// matching work on the serving loop for nothing; it is refused (their count, at most 4 as
/// OpenAI allows, is checked with the other sampling parameters).
pub(super) fn check_stop_lengths(params: &SamplingParams, rt: &ModelRuntime) -> Result<(), ApiError> {
    let limit = rt.max_model_len.saturating_mul(rt.max_token_bytes);
    match params.stop.iter().position(|s| s.len() > limit) {
        Some(i) => Err(ApiError::bad(
            format!(
                "stop string {i} is {} bytes; the longest text this model generates for one request is {limit} \
                 bytes (maxModelLen {} tokens of at most {} bytes), so it could never match: shorten it",
                params.stop[i].len(),
                rt.max_model_len,
                rt.max_token_bytes
            ),
            Some("stop"),
        )),
        None => Ok(()),
    }
}

/// A request parsed and tokenised, ready to generate.
pub(super) struct Prepared {
    pub(super) ids: Vec<u32>,
    pub(super) params: SamplingParams,
    pub(super) common: Common,
    pub(super) request_id: Arc<str>,
    /// The prompt's text, when the response starts with it (completions' `echo`).
    pub(super) echo: Option<String>,
}

/// What chat and completions read alike from a request beside its prompt.
pub(super) struct Options {
    pub(super) common: Common,
    pub(super) params: SamplingParams,
    pub(super) request_id: Arc<str>,
    /// Whether the response starts with the prompt (completions' `echo`).
    pub(super) echo: bool,
}

impl Options {
    /// The request ready to generate once its prompt is tokenised as `ids`.
    pub(super) fn prepared(self, ids: Vec<u32>, echo: Option<String>) -> Prepared {
        Prepared {
            ids,
            params: self.params,
            common: self.common,
            request_id: self.request_id,
            echo,
        }
    }
}

/// Reads the body of a `kind` request, takes its prompt out with `take`, and checks and reads
/// the other fields into [`Options`], in the order that decides which error a request with
/// several problems gets.
pub(super) async fn read_request<P>(
    req: axum::extract::Request,
    api: &Api,
    kind: Kind,
    take: fn(&mut Map<String, Value>) -> Result<P, ApiError>,
) -> Result<(P, Options, BodyPermit), ApiError> {
    let rt = &api.rt;
    let rid = req.extensions().get::<RequestId>().cloned();
    let (body, held) = read_body(req, api).await?;
    let mut fields = parse_object(&body)?;
    let prompt = take(&mut fields)?;
    check_fields(&fields, kind)?;
    let common = parse_common(fields)?;
    common.check_model(rt)?;
    let default_max = match kind {
        Kind::Chat => DEFAULT_CHAT_MAX_TOKENS,
        Kind::Completion => DEFAULT_COMPLETION_MAX_TOKENS,
    };
    let mut params = common.params(default_max, &rt.tokenizer.sampling_defaults)?;
    common.check_choices()?;
    let echo = common.output_options(kind, &mut params, rt.scores_prompts)?;
    check_token_ids(&params, rt.vocab_size)?;
    check_stop_lengths(&params, rt)?;
    let request_id = final_request_id(rid, &common)?;
    let options = Options {
        common,
        params,
        request_id,
        echo,
    };
    Ok((prompt, options, held))
}

pub(super) async fn chat_completions(State(api): State<Api>, req: axum::extract::Request) -> Response {
    let arrived = tokio::time::Instant::now();
    let rt = api.rt.clone();
    let run = async {
        // The body's bytes stay held until its prompt is tokenized (the prompt is as large).
        let (chat, options, _held) = read_request(req, &api, Kind::Chat, take_chat).await?;
        check_prompt_bytes(chat.text_bytes(), &rt, "messages")?;
        let own_template = check_request_template(&chat, &rt, api.limits.trust_request_chat_template)?;
        let tokenizer = rt.tokenizer.clone();
        let ids = tokenize(&api, move || encode_chat(&tokenizer, &chat))
            .await?
            .map_err(|e| {
                let param = if own_template { "chat_template" } else { "messages" };
                ApiError::bad(e.to_string(), Some(param))
            })?;
        Ok(options.prepared(ids, None))
    };
    let prepared = run.await;
    answer(rt, Kind::Chat, prepared, arrived, &api.limits).await
}

pub(super) async fn completions(State(api): State<Api>, req: axum::extract::Request) -> Response {
    let arrived = tokio::time::Instant::now();
    let rt = api.rt.clone();
    let run = async {
        let (prompt, options, _held) = read_request(req, &api, Kind::Completion, take_prompt).await?;
        let echo = options.echo;
        let (echo, ids) = match prompt {
            Prompt::Tokens(ids) => {
                let vocab = rt.vocab_size;
                if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
                    return Err(ApiError::bad(
                        format!("token id {bad} is outside the vocabulary of {vocab}"),
                        Some("prompt"),
                    ));
                }
                (echo.then(|| rt.tokenizer.decode(&ids, true)), ids)
            }
            Prompt::Text(prompt) => {
                check_prompt_bytes(prompt.len(), &rt, "prompt")?;
                let tokenizer = rt.tokenizer.clone();
                let text = echo.then(|| prompt.clone());
                (
                    text,
                    tokenize(&api, move || tokenizer.encode(&prompt, true)).await?,
                )
            }
        };
        Ok(options.prepared(ids, echo))
    };
    let prepared = run.await;
    answer(rt, Kind::Completion, prepared, arrived, &api.limits).await
}

/// The response to a request that was parsed and tokenised (`Ok`), or the error that stopped it.
pub(super) async fn answer(
    rt: Arc<ModelRuntime>,
    kind: Kind,
    prepared: Result<Prepared, ApiError>,
    arrived: tokio::time::Instant,
    limits: &ApiLimits,
) -> Response {
    match prepared {
        Ok(p) => {
            let deadline = arrived + limits.request_timeout;
            let id = p.request_id.clone();
            let mut r = respond(rt, kind, p, deadline, limits.request_timeout).await;
            if let Ok(v) = HeaderValue::from_str(&id) {
                r.headers_mut().insert(REQUEST_ID_HEADER, v);
            }
            r
        }
        Err(e) => e.into_response(),
    }
}

pub(super) async fn respond(
    rt: Arc<ModelRuntime>,
    kind: Kind,
    p: Prepared,
    deadline: tokio::time::Instant,
    timeout: Duration,
) -> Response {
    let param = match kind {
        Kind::Chat => "messages",
        Kind::Completion => "prompt",
    };
    let key = p.common.cache_key().unwrap_or_default();
    let prompt_tokens = p.ids.len();
    let prompt_ids = if p.params.prompt_logprobs.is_some() {
        p.ids.clone()
    } else {
        Vec::new()
    };
    let logprobs = p.params.logprobs;
    let n = p.common.choices();
    let seed = p.params.seed;
    // Choice i of a seeded request is seeded `seed + i` (as vLLM seeds parallel samples), so
    // that the choices differ and each is reproducible.
    let params_of = |i: usize| {
        let mut q = p.params.clone();
        q.seed = seed.map(|s| s.wrapping_add(i as u64));
        q
    };
    let rx = match rt.generate_with(
        p.ids.clone(),
        params_of(0),
        key.clone(),
        Some(deadline.into_std()),
    ) {
        Ok(rx) => rx,
        Err(e) => return ApiError::from_runtime(e, param).into_response(),
    };
    let meta = Meta {
        prompt_tokens,
        tok: rt.tokenizer.clone(),
        logprobs,
        prompt_ids,
        echo: p.echo,
        id: match kind {
            Kind::Chat => format!("chatcmpl-{}", p.request_id),
            Kind::Completion => format!("cmpl-{}", p.request_id),
        },
        created: now_secs(),
        model: rt.name.clone(),
        kind,
        deadline,
        timeout,
    };
    if p.common.stream.unwrap_or(false) {
        return Sse::new(sse_stream(meta, rx, p.common.stream_usage())).into_response();
    }
    let timeout = meta.timeout;
    let all = async {
        let mut rxs = vec![rx];
        let mut first = None;
        if n > 1 {
            // The other choices start once the first has a token: its prefill is done, so
            // they find the prompt's blocks in the prefix cache instead of computing them again.
            first = rxs[0].recv().await;
            for i in 1..n {
                match rt.generate_with(
                    p.ids.clone(),
                    params_of(i),
                    key.clone(),
                    Some(deadline.into_std()),
                ) {
                    Ok(rx) => rxs.push(rx),
                    // Dropping the receivers cancels the choices already running.
                    Err(e) => return ApiError::from_runtime(e, param).into_response(),
                }
            }
        }
        collect(meta, rxs, first).await
    };
    match tokio::time::timeout_at(deadline, all).await {
        Ok(response) => response,
        // Dropping the receivers cancels the sequences at the loop's next step.
        Err(_) => timed_out(timeout).into_response(),
    }
}
