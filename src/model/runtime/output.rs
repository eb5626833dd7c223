//! A request's output on its way to its client: a sampled token to text, stop tokens and
//! strings, the length limit, and the end with its metrics.

use std::time::Instant;

use super::{FinishReason, GenEvent, Live};
use crate::model::metrics::{Finished, Metrics};
use crate::model::tokenizer::Tokenizer;

/// Appends a sampled token: text out, stop tokens and strings, the length limit. Returns the
/// finish reason when the request ends with it.
pub(super) fn push_token(
    tok: &Tokenizer,
    l: &mut Live,
    next: u32,
    metrics: &Metrics,
) -> Option<FinishReason> {
    if !l.sampler.params().ignore_eos && tok.stop_tokens.contains(&next) {
        flush(l, FinishReason::Stop, metrics);
        return Some(FinishReason::Stop);
    }
    l.tokens.push(next);
    let piece = l.decoder.push(tok, next);
    let (text, hit) = l.stops.push(&piece);
    // One event per token even when its text is held back or empty (a partial UTF-8
    // sequence, a byte-less dummy token): streams show every token's arrival.
    let _ = l.events.send(GenEvent::Text(text));
    if hit {
        done(l, FinishReason::Stop, metrics);
        return Some(FinishReason::Stop);
    }
    if l.output_len() >= l.sampler.params().max_tokens {
        flush(l, FinishReason::Length, metrics);
        return Some(FinishReason::Length);
    }
    None
}

/// Sends held-back text (unless it completes a stop string) and the end of the request.
pub(super) fn flush(l: &mut Live, reason: FinishReason, metrics: &Metrics) {
    let tail = l.decoder.finish();
    let (mut text, hit) = l.stops.push(&tail);
    if !hit {
        text.push_str(&l.stops.finish());
    }
    if !text.is_empty() {
        let _ = l.events.send(GenEvent::Text(text));
    }
    done(l, reason, metrics);
}

/// Ends a request for its client. The end-to-end latency is observed before the client can
/// see the end, so a client that reads `/metrics` after its answer always finds it counted.
fn done(l: &mut Live, reason: FinishReason, metrics: &Metrics) {
    let now = Instant::now();
    let started = l.started_at.unwrap_or(now);
    let first = l.first_token_at.unwrap_or(now);
    let last = l.last_token_at.unwrap_or(now);
    metrics.observe_finished(&Finished {
        reason: reason.as_str(),
        e2e: now.saturating_duration_since(l.arrived),
        queue: started.saturating_duration_since(l.arrived),
        prefill: first.saturating_duration_since(started),
        decode: last.saturating_duration_since(first),
        prompt_tokens: l.prompt_len,
        generation_tokens: l.output_len(),
    });
    let _ = l.events.send(GenEvent::Done {
        reason,
        prompt_tokens: l.prompt_len,
        completion_tokens: l.output_len(),
        cached_tokens: l.cached,
    });
    l.ended = Some(reason);
}
