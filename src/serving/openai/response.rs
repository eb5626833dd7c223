//! A whole (non-streamed) response, and what it and a stream share.

use std::sync::Arc;
use std::time::Duration;

use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use super::error::{server_error, unavailable};
use super::logprobs::{chat_logprobs, completion_logprobs};
use super::Kind;
use crate::serving::runtime::GenEvent;
use kvfleet_engine::model::sampling::TokenLogprobs;
use kvfleet_engine::model::tokenizer::Tokenizer;

pub(super) struct Meta {
    pub(super) id: String,
    pub(super) prompt_tokens: usize,
    pub(super) tok: Arc<Tokenizer>,
    /// Alternatives a generated token lists, when the request asked for log-probabilities.
    pub(super) logprobs: Option<usize>,
    /// The prompt's ids when its log-probabilities come back (`echo` with `logprobs`).
    pub(super) prompt_ids: Vec<u32>,
    /// The prompt's text that starts the response (`echo`).
    pub(super) echo: Option<String>,
    pub(super) created: u64,
    pub(super) model: String,
    pub(super) kind: Kind,
    /// When the request must have ended (arrival + the request timeout).
    pub(super) deadline: tokio::time::Instant,
    pub(super) timeout: Duration,
}

pub(super) fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

/// The usage of a stream so far (`continuous_usage_stats`); the cached prompt tokens come with
/// the end.
pub(super) fn running_usage(prompt: usize, completion: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    })
}

/// The worker is shutting down: the request did not run, or was cut; retry it elsewhere.
/// One choice, whole: its JSON and its (prompt, completion, cached) token counts.
struct Choice {
    json: Value,
    prompt_tokens: usize,
    completion_tokens: usize,
    cached_tokens: usize,
}

/// Reads choice `index` to its end; the error response when its generation fails.
async fn collect_choice(
    meta: &Meta,
    index: usize,
    first: Option<GenEvent>,
    rx: &mut UnboundedReceiver<GenEvent>,
) -> Result<Choice, Response> {
    let mut text = meta.echo.clone().unwrap_or_default();
    let mut prompt_lps: Option<Vec<TokenLogprobs>> = None;
    let mut lps: Vec<TokenLogprobs> = Vec::new();
    let mut first = first;
    loop {
        let ev = match first.take() {
            Some(ev) => ev,
            None => match rx.recv().await {
                Some(ev) => ev,
                None => {
                    return Err(server_error(
                        "the generation loop stopped before the request finished".into(),
                    )
                    .into_response())
                }
            },
        };
        match ev {
            GenEvent::Text(t) => text.push_str(&t),
            GenEvent::Logprobs(lp) => lps.push(lp),
            GenEvent::PromptLogprobs(v) => prompt_lps = Some(v),
            GenEvent::Error(m) => return Err(server_error(m).into_response()),
            GenEvent::Unavailable(m) => return Err(unavailable(m).into_response()),
            GenEvent::Done {
                reason,
                text: tail,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            } => {
                text.push_str(&tail);
                let logprobs = match (meta.logprobs, meta.kind) {
                    (None, _) => Value::Null,
                    (Some(top), Kind::Chat) => json!({"content": chat_logprobs(&meta.tok, &lps, top)}),
                    (Some(top), Kind::Completion) => {
                        let mut entries: Vec<(u32, Option<&TokenLogprobs>)> = Vec::new();
                        if let Some(prompt) = &prompt_lps {
                            if let Some(&first) = meta.prompt_ids.first() {
                                entries.push((first, None));
                            }
                            entries.extend(prompt.iter().map(|lp| (lp.token, Some(lp))));
                        }
                        entries.extend(lps.iter().map(|lp| (lp.token, Some(lp))));
                        completion_logprobs(&meta.tok, &entries, top, &mut 0)
                    }
                };
                let json = match meta.kind {
                    Kind::Chat => json!({
                        "index": index,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": logprobs,
                        "finish_reason": reason.as_str(),
                    }),
                    Kind::Completion => json!({
                        "index": index,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": reason.as_str(),
                    }),
                };
                return Ok(Choice {
                    json,
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens,
                });
            }
        }
    }
}

/// The whole response of a request's choices (`n` of them, in index order), each read from
/// its receiver; `first` is an event already taken from the first. The prompt counts once in
/// the usage (as OpenAI and vLLM count it), the completions of every choice add up.
pub(super) async fn collect(
    meta: Meta,
    mut rxs: Vec<UnboundedReceiver<GenEvent>>,
    first: Option<GenEvent>,
) -> Response {
    let mut choices = Vec::with_capacity(rxs.len());
    let mut first = first;
    for (index, rx) in rxs.iter_mut().enumerate() {
        match collect_choice(&meta, index, first.take(), rx).await {
            Ok(c) => choices.push(c),
            Err(r) => return r,
        }
    }
    let (prompt, cached) = choices
        .first()
        .map_or((meta.prompt_tokens, 0), |c| (c.prompt_tokens, c.cached_tokens));
    let completion = choices.iter().map(|c| c.completion_tokens).sum();
    Json(json!({
        "id": meta.id,
        "object": if meta.kind == Kind::Chat { "chat.completion" } else { "text_completion" },
        "created": meta.created,
        "model": meta.model,
        "choices": choices.into_iter().map(|c| c.json).collect::<Vec<_>>(),
        "usage": usage(prompt, completion, cached),
    }))
    .into_response()
}
