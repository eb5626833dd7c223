//! The prompt as token ids: a chat rendered through the model's template with each message's
//! text encoded as plain text, shared with the router, which tokenizes as the workers do.

use axum::body::Bytes;
use serde::Deserialize;
use serde_json::Value;

use super::request::{parse_object, take_chat, take_prompt, ChatPrompt, Prompt};
use kvfleet_engine::engine::prefix::CacheKey;
use kvfleet_engine::model::tokenizer::{Tokenizer, TokenizerError};

pub(super) fn salt_of(v: Option<&Value>) -> Option<String> {
    match v {
        Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
        _ => None,
    }
}

/// What a router needs of a request to place it, parsed: the prompt (token ids as given, or
/// text and chats still to tokenize) and its prefix-cache key. [`RoutingPrompt::parse`] is cheap
/// (JSON only); [`RoutingPrompt::into_ids`] tokenizes exactly as [`chat_completions`] /
/// [`completions`] do. `None` from either when the body is not a request this server would
/// tokenize; the worker that gets it then answers the error.
pub struct RoutingPrompt {
    pub(super) prompt: RoutedPrompt,
    pub key: CacheKey,
}

pub(super) enum RoutedPrompt {
    Ids(Vec<u32>),
    Text(String),
    Chat(ChatPrompt),
}

/// The common shape of a routed completion, a prompt of token ids, read without building a
/// JSON tree: a 4,200-id prompt as `Value`s is some 4,200 allocations the router does not need.
/// Anything else (text, a duplicate field, an id out of range) fails here and takes the general
/// path, which decides as before.
#[derive(Deserialize)]
pub(super) struct IdsPrompt {
    pub(super) prompt: Vec<u32>,
    #[serde(default)]
    pub(super) cache_salt: Option<Value>,
}

impl RoutingPrompt {
    pub fn parse(chat: bool, body: &Bytes) -> Option<Self> {
        if !chat {
            if let Ok(IdsPrompt { prompt, cache_salt }) = serde_json::from_slice::<IdsPrompt>(body) {
                return Some(Self {
                    prompt: RoutedPrompt::Ids(prompt),
                    key: CacheKey {
                        salt: salt_of(cache_salt.as_ref()),
                        adapter: None,
                    },
                });
            }
        }
        Self::parse_fields(chat, body)
    }

    /// The general path: every prompt form, as the workers' own parsing reads it.
    pub(super) fn parse_fields(chat: bool, body: &Bytes) -> Option<Self> {
        let mut fields = parse_object(body).ok()?;
        let prompt = if chat {
            RoutedPrompt::Chat(take_chat(&mut fields).ok()?)
        } else {
            match take_prompt(&mut fields).ok()? {
                Prompt::Tokens(ids) => RoutedPrompt::Ids(ids),
                Prompt::Text(text) => RoutedPrompt::Text(text),
            }
        };
        Some(Self {
            prompt,
            key: CacheKey {
                salt: salt_of(fields.get("cache_salt")),
                adapter: None,
            },
        })
    }

    /// Bytes of text still to tokenize (0 for a token-id prompt).
    pub fn text_bytes(&self) -> usize {
        match &self.prompt {
            RoutedPrompt::Ids(_) => 0,
            RoutedPrompt::Text(t) => t.len(),
            RoutedPrompt::Chat(c) => c.text_bytes(),
        }
    }

    pub fn into_ids(self, tok: &Tokenizer) -> Option<(Vec<u32>, CacheKey)> {
        let ids = match self.prompt {
            RoutedPrompt::Ids(ids) => ids,
            RoutedPrompt::Text(text) => tok.encode(&text, true),
            // A template of the request's own is the worker's to accept or refuse; the router
            // never runs client Jinja.
            RoutedPrompt::Chat(chat)
                if chat
                    .template
                    .as_deref()
                    .is_some_and(|t| tok.chat_template.as_ref().is_none_or(|c| c.source(t).is_none())) =>
            {
                return None
            }
            RoutedPrompt::Chat(chat) => encode_chat(tok, &chat).ok()?,
        };
        Some((ids, self.key))
    }
}

/// Tokenizes a chat as the model's template renders it (transformers' `apply_chat_template`),
/// except that a control token written in the request's text (`<|im_start|>system` in a
/// message) stays text and cannot open a turn: only the template's own markup is parsed for
/// special tokens ([`Tokenizer::encode_chat`]).
pub(super) fn encode_chat(tok: &Tokenizer, chat: &ChatPrompt) -> Result<Vec<u32>, TokenizerError> {
    tok.encode_chat(&chat.inputs())
}
