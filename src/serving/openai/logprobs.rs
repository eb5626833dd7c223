//! Log-probabilities in the shapes of chat (`logprobs.content`) and completions.

use serde_json::{json, Map, Value};

use kvfleet_engine::model::sampling::TokenLogprobs;
use kvfleet_engine::model::tokenizer::Tokenizer;

/// A token's text as log-probabilities show it (control tokens included; bytes that are not
/// UTF-8 on their own as U+FFFD, the exact bytes in chat's `bytes`).
pub(super) fn token_text(tok: &Tokenizer, id: u32) -> String {
    String::from_utf8_lossy(tok.token_bytes(id, true)).into_owned()
}

/// Chat's `logprobs.content`: one entry a generated token, OpenAI's shape.
pub(super) fn chat_logprobs(tok: &Tokenizer, lps: &[TokenLogprobs], top: usize) -> Vec<Value> {
    let entry = |id: u32, lp: f32| {
        json!({
            "token": token_text(tok, id),
            "logprob": finite(lp),
            "bytes": tok.token_bytes(id, true),
        })
    };
    lps.iter()
        .map(|lp| {
            let mut e = entry(lp.token, lp.logprob);
            e["top_logprobs"] = lp.top.iter().take(top).map(|&(t, l)| entry(t, l)).collect();
            e
        })
        .collect()
}

/// Completions' `logprobs` (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) of
/// `entries` (a token and its log-probabilities; none for the prompt's first token), the
/// offsets counted in characters from `offset`, which is advanced past them. Each
/// `top_logprobs` map holds the `top` most likely tokens and the chosen one (as vLLM's).
pub(super) fn completion_logprobs(
    tok: &Tokenizer,
    entries: &[(u32, Option<&TokenLogprobs>)],
    top: usize,
    offset: &mut usize,
) -> Value {
    let (mut tokens, mut token_lps, mut tops, mut offsets) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for &(id, lp) in entries {
        let text = token_text(tok, id);
        offsets.push(json!(*offset));
        *offset += text.chars().count();
        tokens.push(json!(text));
        match lp {
            None => {
                token_lps.push(Value::Null);
                tops.push(Value::Null);
            }
            Some(lp) => {
                token_lps.push(finite(lp.logprob));
                let mut m = Map::new();
                for &(t, l) in lp.top.iter().take(top) {
                    m.entry(token_text(tok, t)).or_insert(finite(l));
                }
                m.entry(token_text(tok, id)).or_insert(finite(lp.logprob));
                tops.push(Value::Object(m));
            }
        }
    }
    json!({"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets})
}

/// A log-probability as JSON: -inf (a banned or impossible token) as vLLM writes it, -9999.0.
pub(super) fn finite(lp: f32) -> Value {
    json!(if lp.is_finite() { lp } else { -9999.0 })
}
