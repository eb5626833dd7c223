//! Which request fields are implemented, accepted at any value, or accepted only at their
//! default: none is silently ignored.

use serde_json::{Map, Value};

use super::error::ApiError;
use super::Kind;

// === request fields ===

/// What the API does with a request field.
#[derive(Clone, Copy)]
pub(super) enum Rule {
    /// Read and honoured.
    Implemented,
    /// Accepted at any value: it asks nothing of the generation (client bookkeeping, or an
    /// option of a feature that is itself refused).
    Inert,
    /// Not implemented: accepted at its default (`what` says which; null always), refused
    /// with 400 naming it otherwise.
    Default {
        accepts: fn(&Value) -> bool,
        what: &'static str,
    },
}

pub(super) fn is_false(v: &Value) -> bool {
    matches!(v, Value::Null | Value::Bool(false))
}

pub(super) fn is_true(v: &Value) -> bool {
    matches!(v, Value::Null | Value::Bool(true))
}

pub(super) fn is_number(v: &Value, n: f64) -> bool {
    v.is_null() || v.as_f64() == Some(n)
}

pub(super) fn is_zero(v: &Value) -> bool {
    is_number(v, 0.0)
}

pub(super) fn is_one(v: &Value) -> bool {
    is_number(v, 1.0)
}

/// Null, "", [] or {}.
pub(super) fn is_empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        _ => false,
    }
}

pub(super) fn is_text_format(v: &Value) -> bool {
    v.is_null()
        || (v.get("type").and_then(Value::as_str) == Some("text")
            && v.as_object().is_some_and(|o| o.len() == 1))
}

pub(super) fn is_none_choice(v: &Value) -> bool {
    v.is_null() || v.as_str() == Some("none")
}

pub(super) fn is_default_tier(v: &Value) -> bool {
    v.is_null() || matches!(v.as_str(), Some("auto" | "default"))
}

pub(super) fn is_text_modality(v: &Value) -> bool {
    v.is_null()
        || v.as_array()
            .is_some_and(|a| a.len() == 1 && a[0].as_str() == Some("text"))
}

pub(super) fn is_null(v: &Value) -> bool {
    v.is_null()
}

/// The rule for a top-level field of a completions or chat request (the fields of OpenAI's and
/// vLLM's request bodies); `None` for a field neither defines, which is refused. `prompt` and
/// `messages` are taken out before, by their endpoint. docs/worker.md lists the decisions.
pub(super) fn field_rule(name: &str, kind: Kind) -> Option<Rule> {
    let only = |accepts: fn(&Value) -> bool, what: &'static str| Some(Rule::Default { accepts, what });
    match name {
        "model"
        | "max_tokens"
        | "max_completion_tokens"
        | "temperature"
        | "top_p"
        | "top_k"
        | "seed"
        | "stop"
        | "stream"
        | "stream_options"
        | "ignore_eos"
        | "cache_salt"
        | "request_id"
        | "min_tokens"
        | "stop_token_ids"
        | "include_stop_str_in_output"
        | "skip_special_tokens"
        | "repetition_penalty"
        | "presence_penalty"
        | "frequency_penalty"
        | "min_p"
        | "logit_bias"
        | "n"
        | "logprobs" => Some(Rule::Implemented),
        // Chat's alternatives per token; completions name them in `logprobs`. Echo of the
        // prompt: completions only.
        "top_logprobs" => match kind {
            Kind::Chat => Some(Rule::Implemented),
            Kind::Completion => only(is_zero, "0 or null (completions take the count in `logprobs`)"),
        },
        "echo" => match kind {
            Kind::Completion => Some(Rule::Implemented),
            Kind::Chat => only(is_false, "false"),
        },
        // Bookkeeping for the client or a provider, and options of features refused on their own
        // (tools, guided decoding): they change nothing here.
        // Prompt-cache hints (the prefix cache here is automatic and changes no output) too.
        "user"
        | "metadata"
        | "safety_identifier"
        | "prompt_cache_key"
        | "prompt_cache_options"
        | "prompt_cache_retention"
        | "parallel_tool_calls"
        | "include_reasoning"
        | "guided_decoding_backend"
        | "guided_whitespace_pattern" => Some(Rule::Inert),
        // Sampling and output options not implemented.
        "best_of" => only(is_one, "1"),
        "suffix" => only(is_empty, "empty"),
        "priority" => only(is_zero, "0"),
        "length_penalty" => only(is_one, "1"),
        "bad_words" | "allowed_token_ids" | "logits_processors" => only(is_empty, "[]"),
        "use_beam_search"
        | "return_tokens_as_token_ids"
        | "return_token_ids"
        | "continue_final_message"
        | "store" => only(is_false, "false"),
        "spaces_between_special_tokens" | "add_generation_prompt" => only(is_true, "true"),
        "add_special_tokens" => match kind {
            Kind::Completion => only(is_true, "true"),
            Kind::Chat => only(is_false, "false"),
        },
        "truncate_prompt_tokens"
        | "prompt_logprobs"
        | "prompt_embeds"
        | "reasoning_effort"
        | "verbosity"
        | "audio"
        | "prediction"
        | "web_search_options"
        | "chat_template"
        | "moderation" => only(is_null, "null"),
        // Structured output and tools.
        "response_format" => only(is_text_format, r#"{"type": "text"}"#),
        "guided_json" | "guided_regex" | "guided_choice" | "guided_grammar" | "structural_tag"
        | "structured_outputs" | "tools" | "functions" => only(is_empty, "null or empty"),
        "tool_choice" | "function_call" => only(is_none_choice, r#""none""#),
        "service_tier" => only(is_default_tier, r#""auto" or "default""#),
        "modalities" => only(is_text_modality, r#"["text"]"#),
        "documents"
        | "chat_template_kwargs"
        | "mm_processor_kwargs"
        | "media_io_kwargs"
        | "kv_transfer_params"
        | "vllm_xargs" => only(is_empty, "null or empty"),
        _ => None,
    }
}

/// Refuses, naming it, the first field (in name order) that is unknown or asks for something
/// not implemented.
pub(super) fn check_fields(fields: &Map<String, Value>, kind: Kind) -> Result<(), ApiError> {
    for (name, value) in fields {
        match field_rule(name, kind) {
            Some(Rule::Implemented | Rule::Inert) => {}
            Some(Rule::Default { accepts, what }) => {
                if !accepts(value) {
                    return Err(ApiError::bad(
                        format!(
                            "`{name}` is not supported by this server (kvfleet implements a subset of vLLM's \
                             parameters, docs/worker.md); omit it or send its default ({what})"
                        ),
                        Some(name.as_str()),
                    ));
                }
            }
            None => {
                return Err(ApiError::bad(
                    format!(
                    "Unrecognized request argument supplied: `{name}` is not a parameter of this endpoint \
                         in OpenAI's or vLLM's API; remove it"
                ),
                    Some(name.as_str()),
                ))
            }
        }
    }
    Ok(())
}
