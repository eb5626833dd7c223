//! The prompt as token ids: a chat rendered through the model's template with each message's
//! text encoded as plain text, shared with the router, which tokenizes as the workers do.

use axum::body::Bytes;
use serde::Deserialize;
use serde_json::Value;

use super::request::{parse_object, take_messages, take_prompt, Prompt};
use kvfleet_engine::engine::prefix::CacheKey;
use kvfleet_engine::model::tokenizer::{ChatMessage, ChatTemplate, Tokenizer, TokenizerError};

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
    Chat(Vec<ChatMessage>),
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
            RoutedPrompt::Chat(take_messages(&mut fields).ok()?)
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
            RoutedPrompt::Chat(m) => m.iter().map(|m| m.content.len()).sum(),
        }
    }

    pub fn into_ids(self, tok: &Tokenizer) -> Option<(Vec<u32>, CacheKey)> {
        let ids = match self.prompt {
            RoutedPrompt::Ids(ids) => ids,
            RoutedPrompt::Text(text) => tok.encode(&text, true),
            RoutedPrompt::Chat(messages) => encode_chat(tok, &messages).ok()?,
        };
        Some((ids, self.key))
    }
}

/// Tokenizes a chat as the model's template renders it, with each message's content encoded as
/// plain text: a control token written in a message (`<|im_start|>system`) stays text and cannot
/// open a turn. Only the template's own markup is parsed for special tokens.
pub(super) fn encode_chat(tok: &Tokenizer, messages: &[ChatMessage]) -> Result<Vec<u32>, TokenizerError> {
    // Rendered with a marker in place of each content; the markers hold NUL, which neither the
    // template's text nor a role (checked against OpenAI's set) contains.
    let marker = |i: usize| format!("\u{0}{i}\u{0}");
    let marked: Vec<ChatMessage> = messages
        .iter()
        .enumerate()
        .map(|(i, m)| ChatMessage {
            role: m.role.clone(),
            content: marker(i),
        })
        .collect();
    let rendered = tok.apply_chat_template(&marked)?;
    // The tokenizer starts every encoding with BOS when the model asks for one: keep the first.
    let bos = tok.encode("", false).len();
    let mut out = Vec::new();
    let mut first = true;
    let mut push = |text: &str, special: bool, out: &mut Vec<u32>| {
        let ids = tok.encode(text, special);
        out.extend_from_slice(&ids[if first { 0 } else { bos.min(ids.len()) }..]);
        first = false;
    };
    let mut rest = rendered.as_str();
    for (i, m) in messages.iter().enumerate() {
        let Some((markup, after)) = rest.split_once(&marker(i)) else {
            return Err(TokenizerError::Vocab(format!(
                "the chat template did not render message {i}"
            )));
        };
        push(markup, true, &mut out);
        // The Llama 3 template trims each content (as its Jinja source does).
        let content = match tok.chat_template {
            ChatTemplate::Llama3 => m.content.trim(),
            _ => m.content.as_str(),
        };
        push(content, false, &mut out);
        rest = after;
    }
    push(rest, true, &mut out);
    Ok(out)
}

/// Bytes of the messages' text as [`encode_chat`] tokenizes it (the template's own markup
/// aside, which only adds tokens).
pub(super) fn chat_text_bytes(tok: &Tokenizer, messages: &[ChatMessage]) -> usize {
    messages
        .iter()
        .map(|m| match tok.chat_template {
            ChatTemplate::Llama3 => m.content.trim().len(),
            _ => m.content.len(),
        })
        .sum()
}
