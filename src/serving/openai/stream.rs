//! A response as server-sent events: one chunk per token, usage as asked, an error chunk and
//! the end when the request times out or fails.

use std::convert::Infallible;

use axum::response::sse::Event;
use futures::{Stream, StreamExt};
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use super::error::{server_error, timed_out, unavailable};
use super::logprobs::{chat_logprobs, completion_logprobs};
use super::response::{running_usage, usage, Meta};
use super::Kind;
use crate::serving::runtime::{FinishReason, GenEvent};
use kvfleet_engine::model::sampling::TokenLogprobs;

pub(super) fn chunk(meta: &Meta, text: Option<&str>, first: bool, finish: Option<FinishReason>) -> Value {
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

/// The usage a stream carries.
#[derive(Clone, Copy, Default)]
pub(super) struct StreamUsage {
    /// In a last chunk with no choices (`include_usage`).
    pub(super) last: bool,
    /// In every chunk, as counted so far (`continuous_usage_stats`).
    pub(super) every: bool,
}

pub(super) fn sse_stream(
    meta: Meta,
    rx: UnboundedReceiver<GenEvent>,
    want: StreamUsage,
) -> impl Stream<Item = Result<Event, Infallible>> {
    #[derive(PartialEq)]
    enum St {
        Start,
        Running,
        Done,
    }
    /// The stream between events: the output tokens seen so far.
    struct Cursor {
        rx: UnboundedReceiver<GenEvent>,
        st: St,
        meta: Meta,
        tokens: usize,
        /// The log-probabilities of the token whose text comes next.
        lp: Option<TokenLogprobs>,
        /// Characters streamed so far (completions' `text_offset`).
        offset: usize,
    }
    let data = |v: Value| Event::default().data(v.to_string());
    let start = Cursor {
        rx,
        st: St::Start,
        meta,
        tokens: 0,
        lp: None,
        offset: 0,
    };
    futures::stream::unfold(start, move |mut c| async move {
        if c.st == St::Done {
            return None;
        }
        // A chat stream's `role` goes with its first token, as vLLM sends it: clients that stamp
        // the time to first token on the first chunk (vllm bench serve) measure the prefill.
        let first = c.st == St::Start && c.meta.kind == Kind::Chat;
        let next = match tokio::time::timeout_at(c.meta.deadline, c.rx.recv()).await {
            Ok(next) => next,
            Err(_) => {
                // Past the deadline: an explicit error chunk, then the end; dropping the
                // receiver cancels the sequence.
                let v = vec![
                    data(timed_out(c.meta.timeout).body()),
                    Event::default().data("[DONE]"),
                ];
                c.st = St::Done;
                return Some((v, c));
            }
        };
        let events = match next {
            Some(GenEvent::Logprobs(lp)) => {
                c.lp = Some(lp);
                return Some((Vec::new(), c));
            }
            Some(GenEvent::PromptLogprobs(_)) => return Some((Vec::new(), c)),
            Some(GenEvent::Text(t)) => {
                let mut v = chunk(&c.meta, Some(&t), first, None);
                if let (Some(top), Some(lp)) = (c.meta.logprobs, c.lp.take()) {
                    v["choices"][0]["logprobs"] = match c.meta.kind {
                        Kind::Chat => json!({"content": chat_logprobs(&c.meta.tok, &[lp], top)}),
                        Kind::Completion => {
                            completion_logprobs(&c.meta.tok, &[(lp.token, Some(&lp))], top, &mut c.offset)
                        }
                    };
                }
                if want.every {
                    // One text event per token (text held back to the end rides on the finish).
                    c.tokens += 1;
                    v["usage"] = running_usage(c.meta.prompt_tokens, c.tokens);
                }
                vec![data(v)]
            }
            Some(GenEvent::Done {
                reason,
                text,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            }) => {
                let mut v = Vec::new();
                let total = usage(prompt_tokens, completion_tokens, cached_tokens);
                if first {
                    let mut role = chunk(&c.meta, Some(""), true, None);
                    if want.every {
                        role["usage"] = running_usage(prompt_tokens, 0);
                    }
                    v.push(data(role));
                }
                // The held-back tail, if any, goes with the finish: one chunk per token.
                let tail = (!text.is_empty()).then_some(text.as_str());
                let mut end = chunk(&c.meta, tail, false, Some(reason));
                if want.every {
                    end["usage"] = total.clone();
                }
                v.push(data(end));
                if want.last {
                    let mut u = chunk(&c.meta, None, false, None);
                    u["choices"] = json!([]);
                    u["usage"] = total;
                    v.push(data(u));
                }
                v.push(Event::default().data("[DONE]"));
                c.st = St::Done;
                return Some((v, c));
            }
            Some(GenEvent::Error(m)) => {
                let v = vec![data(server_error(m).body()), Event::default().data("[DONE]")];
                c.st = St::Done;
                return Some((v, c));
            }
            Some(GenEvent::Unavailable(m)) => {
                let v = vec![data(unavailable(m).body()), Event::default().data("[DONE]")];
                c.st = St::Done;
                return Some((v, c));
            }
            None => return None,
        };
        c.st = St::Running;
        Some((events, c))
    })
    .flat_map(|evs| futures::stream::iter(evs.into_iter().map(Ok)))
}
