//! A request's output on its way to its client: a sampled token to text, stop tokens and
//! strings, the length limit, and the end with its metrics. One text event per output token;
//! text held back to the end rides on the finish.

use std::time::Instant;

use super::{FinishReason, GenEvent, Live};
use crate::serving::metrics::{Finished, Metrics};
use kvfleet_engine::model::sampling::TokenLogprobs;
use kvfleet_engine::model::tokenizer::Tokenizer;

/// Appends a sampled token: text out, stop tokens and strings, the length limit. Returns the
/// finish reason when the request ends with it. Before `min_tokens` tokens were generated no
/// stop token or stop string ends it (vLLM).
pub(super) fn push_token(
    tok: &Tokenizer,
    l: &mut Live,
    next: u32,
    logprobs: Option<TokenLogprobs>,
    metrics: &Metrics,
) -> Option<FinishReason> {
    let p = l.sampler.params();
    let (with_special, include_stop) = (!p.skip_special_tokens, p.include_stop_str_in_output);
    let armed = l.output_len() >= p.min_tokens;
    let stop_token = (!p.ignore_eos && tok.stop_tokens.contains(&next)) || p.stop_token_ids.contains(&next);
    if stop_token && armed {
        // The stop token's text stays with include_stop_str_in_output (a control token's only
        // with skip_special_tokens off); it is no output token, as an end-of-sequence token
        // never is, so it goes with the finish.
        let head = if include_stop {
            let piece = l.decoder.push_with(tok, next, with_special);
            l.stops.push(&piece).0
        } else {
            String::new()
        };
        flush_after(l, head, FinishReason::Stop, metrics);
        return Some(FinishReason::Stop);
    }
    l.tokens.push(next);
    l.sampler.accept(next);
    let piece = l.decoder.push_with(tok, next, with_special);
    // Stop strings are looked for from the min_tokens-th token on.
    let (text, hit) = if l.output_len() >= l.sampler.params().min_tokens {
        l.stops.push(&piece)
    } else {
        (piece, false)
    };
    if let Some(lp) = logprobs {
        let _ = l.events.send(GenEvent::Logprobs(lp));
    }
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

/// Ends the request with the text still held back (unless it completes a stop string).
pub(super) fn flush(l: &mut Live, reason: FinishReason, metrics: &Metrics) {
    flush_after(l, String::new(), reason, metrics);
}

/// [`flush`], the finish carrying `head` before the held-back text.
fn flush_after(l: &mut Live, mut head: String, reason: FinishReason, metrics: &Metrics) {
    let tail = l.decoder.finish();
    let (text, hit) = l.stops.push(&tail);
    head.push_str(&text);
    if !hit {
        head.push_str(&l.stops.finish());
    }
    done_with(l, reason, metrics, head);
}

/// Ends a request for its client. The end-to-end latency is observed before the client can
/// see the end, so a client that reads `/metrics` after its answer always finds it counted.
fn done(l: &mut Live, reason: FinishReason, metrics: &Metrics) {
    done_with(l, reason, metrics, String::new());
}

/// [`done`], the finish carrying `text` (held back until the end).
fn done_with(l: &mut Live, reason: FinishReason, metrics: &Metrics, text: String) {
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
        max_tokens: l.sampler.params().max_tokens,
        cached_tokens: l.cached,
    });
    let _ = l.events.send(GenEvent::Done {
        reason,
        text,
        prompt_tokens: l.prompt_len,
        completion_tokens: l.output_len(),
        cached_tokens: l.cached,
    });
    l.ended = Some(reason);
}
