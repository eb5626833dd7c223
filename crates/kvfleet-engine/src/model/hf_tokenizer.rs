//! The tokenizer of a Hugging Face checkpoint: `tokenizer.json` (a byte-level BPE model, its
//! added tokens and pre-tokenizer) and `tokenizer_config.json` (BOS/EOS, chat template), built
//! into the same [`Tokenizer`] the GGUF path uses.
//!
//! Field names follow the `tokenizers` serialisation (huggingface/tokenizers
//! `tokenizers/src/models/bpe/serialization.rs`: merges as `"a b"` strings or, since 0.20,
//! `["a", "b"]` pairs; `tokenizers/src/pre_tokenizers/`).

use serde_json::Value;

use super::tokenizer::{Tokenizer, TokenizerError, GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN};

fn parse(text: &str, file: &'static str) -> Result<Value, TokenizerError> {
    serde_json::from_str(text).map_err(|source| TokenizerError::Json { file, source })
}

/// A special token in `tokenizer_config.json`: a string or `{"content": ...}`.
fn token_text(v: Option<&Value>) -> Option<&str> {
    match v? {
        Value::String(s) => Some(s),
        Value::Object(o) => o.get("content")?.as_str(),
        _ => None,
    }
}

/// The pre-tokenizer name [`Tokenizer::new`] understands for a `pre_tokenizer` value.
fn pre_name(pre: &Value) -> Result<&'static str, TokenizerError> {
    let unsupported = || TokenizerError::HfPre(pre.to_string().chars().take(300).collect());
    let ty = |v: &Value| v.get("type").and_then(Value::as_str).unwrap_or("").to_string();
    let byte_level = |v: &Value, regex: bool| {
        ty(v) == "ByteLevel"
            && v.get("use_regex").and_then(Value::as_bool).unwrap_or(true) == regex
            && !v
                .get("add_prefix_space")
                .and_then(Value::as_bool)
                .unwrap_or(false)
    };
    if byte_level(pre, true) {
        return Ok("gpt2");
    }
    if ty(pre) != "Sequence" {
        return Err(unsupported());
    }
    let parts: &[Value] = pre
        .get("pretokenizers")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    match parts {
        [digits, bl]
            if ty(digits) == "Digits"
                && digits.get("individual_digits").and_then(Value::as_bool) == Some(true)
                && byte_level(bl, true) =>
        {
            Ok("smollm")
        }
        [split, bl] if ty(split) == "Split" && byte_level(bl, false) => {
            let pattern = split.pointer("/pattern/Regex").and_then(Value::as_str);
            let isolated = split.get("behavior").and_then(Value::as_str) == Some("Isolated");
            match pattern {
                Some(p) if isolated && p == LLAMA3_PATTERN => Ok("llama3"),
                Some(p) if isolated && p == QWEN2_PATTERN => Ok("qwen2"),
                Some(p) if isolated && p == GPT2_PATTERN => Ok("gpt2"),
                _ => Err(unsupported()),
            }
        }
        _ => Err(unsupported()),
    }
}

/// The special token a `TemplateProcessing` post-processor puts before a single sequence
/// (Llama 3's `<|begin_of_text|>`), looked for at the top level or inside a `Sequence`.
fn template_prefix(post: &Value) -> Option<&str> {
    let ty = post.get("type").and_then(Value::as_str)?;
    match ty {
        "TemplateProcessing" => post.pointer("/single/0/SpecialToken/id")?.as_str(),
        "Sequence" => post
            .get("processors")?
            .as_array()?
            .iter()
            .find_map(template_prefix),
        _ => None,
    }
}

impl Tokenizer {
    /// Builds the tokenizer from the text of `tokenizer.json` and, when the checkpoint has
    /// one, `tokenizer_config.json`. A chat template that is neither ChatML nor Llama 3 leaves
    /// the model without chat rendering, as on the GGUF path.
    pub fn from_hf_json(tokenizer_json: &str, config_json: Option<&str>) -> Result<Self, TokenizerError> {
        let tj = parse(tokenizer_json, "tokenizer.json")?;
        let cfg = config_json
            .map(|c| parse(c, "tokenizer_config.json"))
            .transpose()?
            .unwrap_or(Value::Null);
        let model = tj.get("model").unwrap_or(&Value::Null);
        let model_type = model.get("type").and_then(Value::as_str).unwrap_or("BPE");
        if model_type != "BPE" {
            return Err(TokenizerError::Model(model_type.into()));
        }
        if model.get("byte_fallback").and_then(Value::as_bool) == Some(true) {
            return Err(TokenizerError::HfModel(
                "BPE with byte_fallback is SentencePiece-style (Llama 2, Mistral v0.1), not byte-level; \
                 serve the model's GGUF conversion instead"
                    .into(),
            ));
        }
        // NFC (Qwen2) changes only text that is not already composed; like llama.cpp, kvfleet
        // does not normalise input.
        match tj.get("normalizer") {
            None | Some(Value::Null) => {}
            Some(n) if n.get("type").and_then(Value::as_str) == Some("NFC") => {}
            Some(n) => {
                return Err(TokenizerError::HfModel(format!(
                    "normalizer {} is not supported (only none or NFC)",
                    n.get("type").and_then(Value::as_str).unwrap_or("?")
                )))
            }
        }
        let pre = pre_name(tj.get("pre_tokenizer").unwrap_or(&Value::Null))?;

        let vocab = model
            .get("vocab")
            .and_then(Value::as_object)
            .ok_or_else(|| TokenizerError::HfModel("model.vocab is missing or not an object".into()))?;
        let mut entries: Vec<(u32, String, u64)> = Vec::with_capacity(vocab.len() + 64);
        for (tok, id) in vocab {
            let id = id
                .as_u64()
                .filter(|&i| i < u32::MAX as u64)
                .ok_or_else(|| TokenizerError::Vocab(format!("token `{tok}` has id {id}")))?;
            entries.push((id as u32, tok.clone(), 1));
        }
        // Added tokens: special ones are control tokens (hidden when decoding), the others are
        // user-defined (matched literally, decoded as written).
        for t in tj
            .get("added_tokens")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let (Some(id), Some(content)) = (
                t.get("id")
                    .and_then(Value::as_u64)
                    .filter(|&i| i < u32::MAX as u64),
                t.get("content").and_then(Value::as_str),
            ) else {
                return Err(TokenizerError::Vocab(format!(
                    "added token {t} lacks content or a 32-bit id"
                )));
            };
            let special = t.get("special").and_then(Value::as_bool).unwrap_or(false);
            entries.push((id as u32, content.to_string(), if special { 3 } else { 4 }));
        }
        let n = entries.iter().map(|e| e.0 as usize + 1).max().unwrap_or(0);
        // Ids are dense in practice; a stray huge id must not allocate gigabytes of gaps.
        if n > 4 * entries.len() + 1024 {
            return Err(TokenizerError::Vocab(format!(
                "token id {} is far beyond the {} tokens defined",
                n - 1,
                entries.len()
            )));
        }
        // Ids nobody names (reserved gaps) get a placeholder no text can produce.
        let mut tokens: Vec<Option<String>> = vec![None; n];
        let mut types = vec![1u64; n];
        for (id, tok, ty) in entries {
            let i = id as usize;
            if let Some(old) = &tokens[i] {
                if *old != tok {
                    return Err(TokenizerError::Vocab(format!(
                        "id {id} is both `{old}` and `{tok}`"
                    )));
                }
            }
            tokens[i] = Some(tok);
            if ty != 1 {
                types[i] = ty;
            }
        }
        let tokens: Vec<String> = tokens
            .into_iter()
            .enumerate()
            .map(|(i, t)| t.unwrap_or_else(|| format!("<kvfleet:unused:{i}>")))
            .collect();

        let mut merges = Vec::new();
        for m in model
            .get("merges")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let pair = match m {
                Value::String(s) => s.split_once(' ').map(|(l, r)| (l.to_string(), r.to_string())),
                Value::Array(a) => match a.as_slice() {
                    [Value::String(l), Value::String(r)] => Some((l.clone(), r.clone())),
                    _ => None,
                },
                _ => None,
            };
            merges.push(pair.ok_or_else(|| {
                TokenizerError::Vocab(format!("merge {m} is neither \"a b\" nor [\"a\", \"b\"]"))
            })?);
        }

        let template = match cfg.get("chat_template") {
            Some(Value::String(s)) => Some(s.as_str()),
            _ => None,
        };
        let mut t = Self::build(tokens, &types, merges, pre, template)?;
        // A list of named templates (`default`, `tool_use`, `rag`, ...): transformers picks one
        // per chat.
        if let Some(Value::Array(list)) = cfg.get("chat_template") {
            let named: Vec<(String, String)> = list
                .iter()
                .filter_map(|t| {
                    Some((
                        t.get("name")?.as_str()?.to_string(),
                        t.get("template")?.as_str()?.to_string(),
                    ))
                })
                .collect();
            if !named.is_empty() {
                t.chat_template = Some(super::chat_template::ChatTemplate::named(named));
            }
        }
        t.ignore_merges = model.get("ignore_merges").and_then(Value::as_bool) == Some(true);
        let id_of = |what: &str, text: Option<&str>| -> Result<Option<u32>, TokenizerError> {
            match text {
                None => Ok(None),
                Some(s) => t
                    .token_id(s)
                    .map(Some)
                    .ok_or_else(|| TokenizerError::Vocab(format!("{what} `{s}` is not in the vocabulary"))),
            }
        };
        let prefix = tj.get("post_processor").and_then(template_prefix);
        let bos_text = token_text(cfg.get("bos_token")).or(prefix);
        let bos = id_of("bos_token", bos_text)?;
        let eos = id_of("eos_token", token_text(cfg.get("eos_token")))?;
        (t.bos, t.eos) = (bos, eos);
        t.add_bos = match cfg.get("add_bos_token").and_then(Value::as_bool) {
            Some(b) => b && t.bos.is_some(),
            None => prefix.is_some() && prefix == bos_text,
        };
        t.check_specials()?;
        Ok(t)
    }
}
