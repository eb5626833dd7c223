//! A request's body read into typed fields: the prompt or the messages, the sampling
//! parameters and the output options, each refusal naming its field.

use axum::body::Bytes;
use serde::Deserialize;
use serde_json::{Map, Value};

use super::error::ApiError;
use super::fields::is_empty;
use super::stream::StreamUsage;
use super::{Kind, CHAT_ROLES};
use crate::serving::runtime::ModelRuntime;
use kvfleet_engine::engine::prefix::CacheKey;
use kvfleet_engine::model::chat_template::{from_json, ChatInputs};
use kvfleet_engine::model::generation_config::SamplingDefaults;
use kvfleet_engine::model::sampling::{SamplingParams, MAX_TOP_LOGPROBS};
use kvfleet_engine::model::tokenizer::ChatMessage;

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct StreamOptions {
    pub(super) include_usage: Option<bool>,
    pub(super) continuous_usage_stats: Option<bool>,
    /// OpenAI's random padding of stream chunks against length side channels; loopback and
    /// in-cluster traffic here, so asking for it or not changes nothing.
    #[allow(dead_code)]
    pub(super) include_obfuscation: Option<bool>,
}

/// The implemented fields shared by both endpoints (the others were checked by
/// [`check_fields`]); numbers are read wide and range-checked with messages that name them.
#[derive(Deserialize, Default)]
pub(super) struct Common {
    pub(super) model: Option<String>,
    pub(super) max_tokens: Option<i64>,
    pub(super) max_completion_tokens: Option<i64>,
    pub(super) temperature: Option<f32>,
    pub(super) top_p: Option<f32>,
    pub(super) top_k: Option<i64>,
    pub(super) seed: Option<serde_json::Number>,
    pub(super) stop: Option<Value>,
    pub(super) stream: Option<bool>,
    /// Choices to sample for the prompt (OpenAI's `n`).
    pub(super) n: Option<i64>,
    pub(super) stream_options: Option<StreamOptions>,
    pub(super) ignore_eos: Option<bool>,
    /// vLLM's prefix-cache partition: requests share cached KV blocks only with requests of
    /// the same salt (docs/security.md).
    pub(super) cache_salt: Option<String>,
    /// vLLM's request id in the body; the `x-request-id` header wins over it.
    pub(super) request_id: Option<String>,
    pub(super) min_tokens: Option<i64>,
    pub(super) stop_token_ids: Option<Vec<i64>>,
    pub(super) include_stop_str_in_output: Option<bool>,
    pub(super) skip_special_tokens: Option<bool>,
    pub(super) repetition_penalty: Option<f32>,
    pub(super) presence_penalty: Option<f32>,
    pub(super) frequency_penalty: Option<f32>,
    pub(super) min_p: Option<f32>,
    /// Token id (a decimal string) -> bias.
    pub(super) logit_bias: Option<std::collections::BTreeMap<String, f32>>,
    /// Chat: a bool; completions: the count of alternatives (0 to 5).
    pub(super) logprobs: Option<Value>,
    pub(super) top_logprobs: Option<i64>,
    pub(super) echo: Option<bool>,
}

/// The request body as a JSON object.
pub(super) fn parse_object(body: &Bytes) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::bad(
            "invalid request body: expected a JSON object of request fields",
            None,
        )),
        Err(e) => Err(ApiError::bad(format!("invalid request body: {e}"), None)),
    }
}

/// The implemented fields, typed; a type error names its field.
pub(super) fn parse_common(fields: Map<String, Value>) -> Result<Common, ApiError> {
    serde_path_to_error::deserialize(Value::Object(fields)).map_err(|e| {
        let path = e.path().to_string();
        let param = (path != ".").then_some(path.as_str());
        ApiError::bad(format!("invalid `{path}`: {}", e.inner()), param)
    })
}

/// A completions prompt: text, a list of one text, or token ids (as OpenAI and vLLM accept;
/// benchmarks use ids for exact prompt lengths).
pub(super) enum Prompt {
    Tokens(Vec<u32>),
    Text(String),
}

pub(super) fn take_prompt(fields: &mut Map<String, Value>) -> Result<Prompt, ApiError> {
    let shape = "`prompt` must be a string, a list of one string, or a list of token ids";
    let bad = |m: &str| ApiError::bad(m, Some("prompt"));
    match fields.remove("prompt") {
        None | Some(Value::Null) => Err(bad("`prompt` is required")),
        Some(Value::String(s)) => Ok(Prompt::Text(s)),
        Some(Value::Array(items)) if items.iter().all(Value::is_string) && !items.is_empty() => {
            let mut items = items;
            match (items.pop(), items.is_empty()) {
                (Some(Value::String(s)), true) => Ok(Prompt::Text(s)),
                _ => Err(bad(
                    "exactly one prompt string is supported; send one request per prompt",
                )),
            }
        }
        Some(Value::Array(items)) if items.iter().any(Value::is_array) => Err(bad(
            "a list of prompts (batched token id lists) is not supported; send one request per prompt",
        )),
        Some(Value::Array(items)) => items
            .iter()
            .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect::<Option<Vec<u32>>>()
            .map(Prompt::Tokens)
            .ok_or_else(|| bad("token ids in `prompt` must be integers from 0 to the vocabulary size - 1")),
        Some(_) => Err(bad(shape)),
    }
}

/// A chat request's prompt: its messages and how the template renders them.
#[derive(Clone, Debug, Default)]
pub(super) struct ChatPrompt {
    pub(super) messages: Vec<ChatMessage>,
    /// `add_generation_prompt` (default true).
    pub(super) add_generation_prompt: bool,
    pub(super) continue_final_message: bool,
    /// `chat_template`: a name of the model's templates or Jinja source.
    pub(super) template: Option<String>,
    /// `chat_template_kwargs`, each a variable of the template.
    pub(super) kwargs: Vec<(String, Value)>,
    pub(super) documents: Option<Value>,
}

impl ChatPrompt {
    /// Messages rendered as the model's template renders a chat by default.
    #[cfg(test)]
    pub(super) fn plain(messages: Vec<ChatMessage>) -> Self {
        ChatPrompt {
            messages,
            add_generation_prompt: true,
            ..ChatPrompt::default()
        }
    }

    pub(super) fn inputs(&self) -> ChatInputs {
        ChatInputs {
            messages: self.messages.iter().map(ChatMessage::to_value).collect(),
            tools: None,
            documents: self.documents.as_ref().map(from_json),
            add_generation_prompt: self.add_generation_prompt,
            continue_final_message: self.continue_final_message,
            kwargs: self
                .kwargs
                .iter()
                .map(|(k, v)| (k.clone(), from_json(v)))
                .collect(),
            template: self.template.clone(),
            now: None,
        }
    }

    /// Bytes of the request's text as [`super::prompt::encode_chat`] tokenizes it (the template's own markup
    /// aside, which only adds tokens).
    pub(super) fn text_bytes(&self) -> usize {
        self.messages.iter().map(|m| m.content.len()).sum::<usize>()
            + self.documents.as_ref().map_or(0, |d| d.to_string().len())
    }
}

/// A chat's messages and its template options (`add_generation_prompt`,
/// `continue_final_message`, `chat_template`, `chat_template_kwargs`, `documents`), taken out
/// of the fields.
pub(super) fn take_chat(fields: &mut Map<String, Value>) -> Result<ChatPrompt, ApiError> {
    let messages = take_messages(fields)?;
    let flag = |fields: &mut Map<String, Value>, name: &str, default: bool| match fields.remove(name) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(b),
        Some(v) => Err(ApiError::bad(
            format!("`{name}` is {v}; it is true or false"),
            Some(name),
        )),
    };
    let add_generation_prompt = flag(fields, "add_generation_prompt", true)?;
    let continue_final_message = flag(fields, "continue_final_message", false)?;
    if add_generation_prompt && continue_final_message {
        return Err(ApiError::bad(
            "`continue_final_message` continues the last message, `add_generation_prompt` opens a new turn: send \
             `add_generation_prompt: false` with it",
            Some("continue_final_message"),
        ));
    }
    let template = match fields.remove("chat_template") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s),
        Some(_) => {
            return Err(ApiError::bad(
                "`chat_template` is a string: the name of one of the model's templates, or Jinja source",
                Some("chat_template"),
            ))
        }
    };
    let kwargs = match fields.remove("chat_template_kwargs") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Object(m)) => m.into_iter().collect(),
        Some(_) => return Err(ApiError::bad(
            "`chat_template_kwargs` is an object of template variables (e.g. {\"enable_thinking\": false})",
            Some("chat_template_kwargs"),
        )),
    };
    let documents = match fields.remove("documents") {
        None | Some(Value::Null) => None,
        Some(Value::Array(d)) if d.is_empty() => None,
        Some(Value::Array(d)) if d.iter().all(Value::is_object) => Some(Value::Array(d)),
        Some(_) => {
            return Err(ApiError::bad(
                "`documents` is a list of objects (each with `title` and `text`)",
                Some("documents"),
            ))
        }
    };
    Ok(ChatPrompt {
        messages,
        add_generation_prompt,
        continue_final_message,
        template,
        kwargs,
        documents,
    })
}

/// The chat messages: roles from OpenAI's set, text content only.
pub(super) fn take_messages(fields: &mut Map<String, Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let items = match fields.remove("messages") {
        None | Some(Value::Null) => return Err(ApiError::bad("`messages` is required", Some("messages"))),
        Some(Value::Array(items)) => items,
        Some(_) => {
            return Err(ApiError::bad(
                "`messages` must be a list of {role, content} objects",
                Some("messages"),
            ))
        }
    };
    if items.is_empty() {
        return Err(ApiError::bad("messages must not be empty", Some("messages")));
    }
    let mut messages = Vec::with_capacity(items.len());
    for (i, m) in items.into_iter().enumerate() {
        let at = |field: &str| format!("messages[{i}]{field}");
        let Value::Object(m) = m else {
            return Err(ApiError::bad(
                format!("`{}` must be an object with `role` and `content`", at("")),
                Some(at("").as_str()),
            ));
        };
        for (k, v) in &m {
            let accepted = match k.as_str() {
                "role" | "content" => true,
                // The served templates have no place for a participant's name; vLLM drops it
                // for the same templates. A tool result's id matters only with tool calls.
                "name" | "tool_call_id" => v.is_null() || v.is_string(),
                // Earlier tool calls, refusals and reasoning of an assistant turn: nothing here
                // renders them, so only their empty values pass.
                "tool_calls" | "function_call" | "refusal" | "reasoning_content" | "reasoning" | "audio" => {
                    is_empty(v)
                }
                _ => {
                    return Err(ApiError::bad(
                        format!("Unrecognized message field `{}`; remove it", at(&format!(".{k}"))),
                        Some(at(&format!(".{k}")).as_str()),
                    ))
                }
            };
            if !accepted {
                let p = at(&format!(".{k}"));
                return Err(ApiError::bad(
                    format!("`{p}` is not supported by this server (text chat only); omit it"),
                    Some(p.as_str()),
                ));
            }
        }
        let role = match m.get("role") {
            Some(Value::String(r)) if CHAT_ROLES.contains(&r.as_str()) => r.clone(),
            other => {
                let p = at(".role");
                let got = other.map_or("missing".to_string(), |v| format!("`{v}`"));
                return Err(ApiError::bad(
                    format!("`{p}` is {got}; a role is one of {}", CHAT_ROLES.join(", ")),
                    Some(p.as_str()),
                ));
            }
        };
        let content = match m.get("content") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(t)) => t.clone(),
            Some(Value::Array(parts)) => {
                let mut s = String::new();
                for (j, part) in parts.iter().enumerate() {
                    let p = at(&format!(".content[{j}]"));
                    match (part.get("type").and_then(Value::as_str), part.get("text")) {
                        (Some("text"), Some(Value::String(t))) => s.push_str(t),
                        (Some("text"), _) => {
                            return Err(ApiError::bad(
                                format!("`{p}` has no `text` string"),
                                Some(p.as_str()),
                            ))
                        }
                        (Some(kind), _) => {
                            return Err(ApiError::bad(
                                format!("content part type `{kind}` is not supported (text only)"),
                                Some(p.as_str()),
                            ))
                        }
                        (None, _) => {
                            return Err(ApiError::bad(
                                format!("`{p}` must be an object with `type` and `text`"),
                                Some(p.as_str()),
                            ))
                        }
                    }
                }
                s
            }
            Some(_) => {
                let p = at(".content");
                return Err(ApiError::bad(
                    format!("`{p}` must be a string or a list of text parts"),
                    Some(p.as_str()),
                ));
            }
        };
        messages.push(ChatMessage { role, content });
    }
    Ok(messages)
}

/// A request's `cache_salt` as the prefix cache keys it: a non-empty string, else none.
impl Common {
    pub(super) fn check_model(&self, rt: &ModelRuntime) -> Result<(), ApiError> {
        match &self.model {
            Some(m) if m != &rt.name => Err(ApiError::model_not_found(m, &rt.name)),
            _ => Ok(()),
        }
    }

    pub(super) fn cache_key(&self) -> Result<CacheKey, ApiError> {
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

    /// The number of choices (`n`, checked by [`Common::check_choices`]).
    pub(super) fn choices(&self) -> usize {
        self.n.map_or(1, |n| n.clamp(1, MAX_CHOICES as i64) as usize)
    }

    /// `n` is 1 to [`MAX_CHOICES`]; more than one only without `stream` (each choice is
    /// sampled on its own; a stream of several is not implemented).
    pub(super) fn check_choices(&self) -> Result<(), ApiError> {
        match self.n {
            None | Some(1) => Ok(()),
            Some(n) if !(1..=MAX_CHOICES as i64).contains(&n) => Err(ApiError::bad(
                format!("`n` is {n}; it must be 1 to {MAX_CHOICES}"),
                Some("n"),
            )),
            Some(_) if self.stream == Some(true) => Err(ApiError::bad(
                "`n` over 1 is implemented for non-streamed requests; send `stream: false` or `n: 1`",
                Some("n"),
            )),
            Some(_) => Ok(()),
        }
    }

    /// What usage a stream carries: `include_usage` puts it in a last chunk of its own, and
    /// with `continuous_usage_stats` too (as vLLM reads the pair) every chunk carries it.
    pub(super) fn stream_usage(&self) -> StreamUsage {
        let o = self.stream_options.as_ref();
        StreamUsage {
            last: o.and_then(|o| o.include_usage).unwrap_or(false),
            every: o.is_some_and(|o| o.include_usage == Some(true) && o.continuous_usage_stats == Some(true)),
        }
    }

    /// The sampling parameters; what the request omits comes from the model's `defaults`
    /// (its generation_config.json), else OpenAI's defaults.
    pub(super) fn params(
        &self,
        default_max: usize,
        defaults: &SamplingDefaults,
    ) -> Result<SamplingParams, ApiError> {
        self.cache_key()?;
        let top_k = match self.top_k.or(defaults.top_k) {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
            Some(k) => {
                return Err(ApiError::bad(
                    format!("top_k {k} must be -1, 0 or positive"),
                    Some("top_k"),
                ))
            }
        };
        let (field, max_tokens) = match (self.max_completion_tokens, self.max_tokens) {
            (Some(n), _) => ("max_completion_tokens", Some(n)),
            (None, n) => ("max_tokens", n),
        };
        let max_tokens = match max_tokens {
            None => default_max,
            // Only with `echo` and `logprobs`: [`Common::output_options`] decides.
            Some(0) => 1,
            Some(n) if n >= 1 => usize::try_from(n).unwrap_or(usize::MAX),
            Some(n) => {
                return Err(ApiError::bad(
                    format!("`{field}` is {n}; it must be at least 1"),
                    Some(field),
                ))
            }
        };
        // OpenAI and vLLM take a signed seed; -1 asks for none (vLLM's convention). Any other
        // value seeds the request (negative ones by their two's complement).
        let seed = match &self.seed {
            None => None,
            Some(n) => match (n.as_i64(), n.as_u64()) {
                (Some(-1), _) => None,
                (Some(s), _) => Some(s as u64),
                (None, Some(s)) => Some(s),
                _ => {
                    return Err(ApiError::bad(
                        format!("`seed` is {n}; it must be an integer"),
                        Some("seed"),
                    ))
                }
            },
        };
        let stop = match &self.stop {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(items)) => items
                .iter()
                .map(|s| s.as_str().map(str::to_owned))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| ApiError::bad("`stop` must be a string or a list of strings", Some("stop")))?,
            Some(_) => {
                return Err(ApiError::bad(
                    "`stop` must be a string or a list of strings",
                    Some("stop"),
                ))
            }
        };
        let min_tokens = match self.min_tokens {
            None => 0,
            Some(n) if n >= 0 => usize::try_from(n).unwrap_or(usize::MAX),
            Some(n) => {
                return Err(ApiError::bad(
                    format!("`min_tokens` is {n}; it must be 0 or more"),
                    Some("min_tokens"),
                ))
            }
        };
        let ids = |v: &Option<Vec<i64>>| -> Result<Vec<u32>, ApiError> {
            v.iter()
                .flatten()
                .map(|&t| {
                    u32::try_from(t).map_err(|_| {
                        ApiError::bad(
                            format!("`stop_token_ids` holds {t}; token ids are 0 to the vocabulary size - 1"),
                            Some("stop_token_ids"),
                        )
                    })
                })
                .collect()
        };
        let mut logit_bias = Vec::new();
        for (k, &b) in self.logit_bias.iter().flatten() {
            let id = k.trim().parse::<u32>().map_err(|_| {
                ApiError::bad(
                    format!("`logit_bias` key {k:?} is not a token id (a decimal integer string)"),
                    Some("logit_bias"),
                )
            })?;
            logit_bias.push((id, b));
        }
        logit_bias.sort_unstable_by_key(|&(id, _)| id);
        if logit_bias.windows(2).any(|w| w[0].0 == w[1].0) {
            return Err(ApiError::bad(
                "`logit_bias` names a token id twice",
                Some("logit_bias"),
            ));
        }
        let p = SamplingParams {
            temperature: self.temperature.or(defaults.temperature).unwrap_or(1.0),
            top_p: self.top_p.or(defaults.top_p).unwrap_or(1.0),
            top_k,
            seed,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            max_tokens,
            stop,
            min_tokens,
            stop_token_ids: ids(&self.stop_token_ids)?,
            include_stop_str_in_output: self.include_stop_str_in_output.unwrap_or(false),
            skip_special_tokens: self.skip_special_tokens.unwrap_or(true),
            repetition_penalty: self
                .repetition_penalty
                .or(defaults.repetition_penalty)
                .unwrap_or(1.0),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            min_p: self.min_p.or(defaults.min_p).unwrap_or(0.0),
            logit_bias,
            logprobs: None,
            prompt_logprobs: None,
        };
        check_params(&p)?;
        Ok(p)
    }

    /// The request's log-probability options into `p`: chat's `logprobs` (bool) with
    /// `top_logprobs` (0 to 20), completions' `logprobs` (0 to 5 alternatives) and `echo` (the
    /// prompt's log-probabilities too, which needs a model that scores prompts; `max_tokens: 0`
    /// then only scores). Returns whether the prompt is echoed.
    pub(super) fn output_options(
        &self,
        kind: Kind,
        p: &mut SamplingParams,
        scores_prompts: bool,
    ) -> Result<bool, ApiError> {
        let echo = self.echo.unwrap_or(false);
        match kind {
            Kind::Chat => {
                let on = match &self.logprobs {
                    None | Some(Value::Null) => false,
                    Some(Value::Bool(b)) => *b,
                    Some(v) => {
                        return Err(ApiError::bad(
                            format!("`logprobs` is {v}; on chat completions it is true or false"),
                            Some("logprobs"),
                        ))
                    }
                };
                let top = match self.top_logprobs {
                    None => 0,
                    Some(n) if (0..=MAX_TOP_LOGPROBS as i64).contains(&n) => n as usize,
                    Some(n) => {
                        return Err(ApiError::bad(
                            format!("`top_logprobs` is {n}; it must be 0 to {MAX_TOP_LOGPROBS}"),
                            Some("top_logprobs"),
                        ))
                    }
                };
                if top > 0 && !on {
                    return Err(ApiError::bad(
                        "`top_logprobs` needs `logprobs: true`",
                        Some("top_logprobs"),
                    ));
                }
                p.logprobs = on.then_some(top);
            }
            Kind::Completion => {
                let n = match &self.logprobs {
                    None | Some(Value::Null) => None,
                    Some(v) => match v.as_i64() {
                        Some(n) if (0..=MAX_COMPLETION_LOGPROBS as i64).contains(&n) => Some(n as usize),
                        _ => {
                            return Err(ApiError::bad(
                                format!(
                                    "`logprobs` is {v}; on completions it is the count of alternatives, 0 to \
                                     {MAX_COMPLETION_LOGPROBS}"
                                ),
                                Some("logprobs"),
                            ))
                        }
                    },
                };
                p.logprobs = n;
                if echo && n.is_some() {
                    if !scores_prompts {
                        return Err(ApiError::bad(
                            "`echo` with `logprobs` (prompt log-probabilities) is implemented on the CPU worker \
                             only for models without sliding-window layers; send `echo: false`",
                            Some("echo"),
                        ));
                    }
                    p.prompt_logprobs = n;
                }
            }
        }
        if self.stream == Some(true) && echo {
            return Err(ApiError::bad(
                "`echo` is implemented for non-streamed completions; send `stream: false` or `echo: false`",
                Some("echo"),
            ));
        }
        // max_tokens 0: vLLM's way to score a prompt without generating.
        if matches!(self.max_completion_tokens.or(self.max_tokens), Some(0)) {
            if p.prompt_logprobs.is_none() {
                let field = if self.max_completion_tokens.is_some() {
                    "max_completion_tokens"
                } else {
                    "max_tokens"
                };
                return Err(ApiError::bad(
                    format!("`{field}` is 0; it must be at least 1 (0 only with `echo` and `logprobs`)"),
                    Some(field),
                ));
            }
            p.max_tokens = 0;
        }
        check_params(p)?;
        Ok(echo)
    }
}

/// The most choices a request may ask for (`n`).
pub const MAX_CHOICES: usize = 16;

/// The most alternatives a completions token lists (OpenAI's limit for `logprobs`).
pub const MAX_COMPLETION_LOGPROBS: usize = 5;

/// [`SamplingParams::check`], its message naming the field as a 400's `param`.
pub(super) fn check_params(p: &SamplingParams) -> Result<(), ApiError> {
    p.check().map_err(|m| {
        let field = [
            "temperature",
            "top_p",
            "min_tokens",
            "max_tokens",
            "stop",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
            "min_p",
            "logit_bias",
            "logprobs",
        ]
        .into_iter()
        .find(|f| m.contains(f));
        ApiError::bad(m, field)
    })
}

/// Token ids in `stop_token_ids` and `logit_bias` must be in the vocabulary.
pub(super) fn check_token_ids(p: &SamplingParams, vocab: usize) -> Result<(), ApiError> {
    if let Some(t) = p.stop_token_ids.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::bad(
            format!("`stop_token_ids` holds {t}, outside the vocabulary of {vocab}"),
            Some("stop_token_ids"),
        ));
    }
    if let Some((t, _)) = p.logit_bias.iter().find(|(t, _)| *t as usize >= vocab) {
        return Err(ApiError::bad(
            format!("`logit_bias` names token {t}, outside the vocabulary of {vocab}"),
            Some("logit_bias"),
        ));
    }
    Ok(())
}
