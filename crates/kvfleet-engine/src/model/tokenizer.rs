//! Byte-level BPE tokenizer read from GGUF metadata (`tokenizer.ggml.*`), the SentencePiece-style
//! tokenizer of `llama`-model vocabularies (Gemma 3: scores, byte fallback), chat templates, and a
//! streaming detokenizer that only emits complete UTF-8.
//!
//! The pre-tokenizer regexes per `tokenizer.ggml.pre` are those llama.cpp uses
//! (ggml-org/llama.cpp `src/llama-vocab.cpp`, `llm_tokenizer_bpe`): `smollm` and `starcoder` split
//! every digit first, then apply the GPT-2 pattern.

use std::collections::HashMap;

pub use super::chat_template::ChatTemplate;
use super::chat_template::{map_strings, ChatInputs, TemplateError, TemplateValue};
use super::generation_config::SamplingDefaults;
use super::gguf::{Gguf, GgufError, Value};

/// Errors of building a tokenizer or rendering a prompt.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(
        "tokenizer model `{0}` is not supported; kvfleet reads byte-level BPE (`gpt2`) and SentencePiece (`llama`) vocabularies"
    )]
    Model(String),
    #[error("pre-tokenizer `{0}` is not supported; supported: default, gpt2, smollm, starcoder, llama3, llama-bpe, qwen2")]
    Pre(String),
    #[error("pre-tokenizer {0} of tokenizer.json is not supported; kvfleet reads ByteLevel, Digits(individual_digits) + ByteLevel (SmolLM, StarCoder), and a Split on the GPT-2, Llama 3 or Qwen2 regex + ByteLevel")]
    HfPre(String),
    #[error("tokenizer.json is not a byte-level BPE tokenizer kvfleet can run: {0}")]
    HfModel(String),
    #[error("cannot parse {file}: {source}")]
    Json {
        file: &'static str,
        #[source]
        source: serde_json::Error,
    },
    #[error("tokenizer metadata is inconsistent: {0}")]
    Vocab(String),
    #[error("the model has no chat template; send one in `chat_template`, or use /v1/completions with a raw prompt")]
    NoChatTemplate,
    #[error(transparent)]
    Template(#[from] TemplateError),
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

pub(crate) const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
pub(crate) const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
pub(crate) const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A byte-level BPE tokenizer.
pub struct Tokenizer {
    tokens: Vec<String>,
    token_bytes: Vec<Vec<u8>>,
    is_special: Vec<bool>,
    token_to_id: HashMap<String, u32>,
    /// (left, right) -> (rank, merged id).
    merges: HashMap<(u32, u32), (u32, u32)>,
    byte_to_id: [Option<u32>; 256],
    /// Special tokens matched literally in input text: the leftmost match, the longest at
    /// one position, found in one pass over the text (ids by pattern index).
    specials: Option<aho_corasick::AhoCorasick>,
    special_ids: Vec<u32>,
    pre: fancy_regex::Regex,
    split_digits: bool,
    /// A pre-token that is itself in the vocabulary skips the merges (`tokenizer.json`'s
    /// `ignore_merges`, set by Llama 3).
    pub(crate) ignore_merges: bool,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub add_bos: bool,
    /// Tokens that end a generation: EOS and the end-of-turn markers of the chat template.
    pub stop_tokens: Vec<u32>,
    /// The model's chat template (Jinja), none when the model ships none.
    pub chat_template: Option<ChatTemplate>,
    /// The sampling defaults of the checkpoint's `generation_config.json` (none for a GGUF).
    pub sampling_defaults: SamplingDefaults,
    /// Set for a SentencePiece-style vocabulary: encoding merges by score instead of rank.
    spm: Option<Spm>,
}

/// The SentencePiece-style (`tokenizer.ggml.model = llama`) half of a [`Tokenizer`].
#[derive(Debug)]
struct Spm {
    /// Per token: the score a merge into it is ranked by (higher first).
    scores: Vec<f32>,
    /// Prepend a space to the text before encoding (`tokenizer.ggml.add_space_prefix`).
    add_space_prefix: bool,
    /// User-defined tokens (type 4: Gemma's runs of newlines, spaces and tabs, HTML tags),
    /// matched literally in any text before the merges, in one pass.
    user_defined: Option<aho_corasick::AhoCorasick>,
    user_defined_ids: Vec<u32>,
}

/// One pass over a text finds the tokens written literally in it: the leftmost match, the
/// longest at one position (ids by pattern index). None when there are no such tokens.
type LiteralMatcher = (Option<aho_corasick::AhoCorasick>, Vec<u32>);

fn literal_matcher(tokens: &[(String, u32)]) -> Result<LiteralMatcher, TokenizerError> {
    if tokens.is_empty() {
        return Ok((None, Vec::new()));
    }
    let matcher = aho_corasick::AhoCorasick::builder()
        .match_kind(aho_corasick::MatchKind::LeftmostLongest)
        .build(tokens.iter().map(|s| s.0.as_str()))
        .map_err(|e| TokenizerError::Vocab(format!("literal tokens: {e}")))?;
    Ok((Some(matcher), tokens.iter().map(|s| s.1).collect()))
}

/// SentencePiece's whitespace marker, U+2581.
const SPM_SPACE: char = '\u{2581}';

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab", &self.tokens.len())
            .field("merges", &self.merges.len())
            .field("chat_template", &self.chat_template)
            .finish()
    }
}

/// Applies BPE merges to `syms` in place: the pair of lowest rank first, the leftmost among
/// equal ranks, until no adjacent pair has a merge. A heap of candidate pairs over a linked
/// list keeps this O(n log n) in the length of the piece (rescanning for the best pair after
/// every merge is quadratic: an 80 KB word without spaces took 15 s).
/// The ids of those of `names` the vocabulary has: the tokens that end a turn.
fn stop_tokens(token_to_id: &HashMap<String, u32>, names: &[&str]) -> Vec<u32> {
    names
        .iter()
        .filter_map(|s| token_to_id.get(*s).copied())
        .collect()
}

fn merge_by_rank(syms: &mut Vec<u32>, merge: impl Fn(u32, u32) -> Option<(u32, u32)>) {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    let n = syms.len();
    if n < 2 {
        return;
    }
    const NONE: usize = usize::MAX;
    let mut prev: Vec<usize> = (0..n).map(|i| if i == 0 { NONE } else { i - 1 }).collect();
    let mut next: Vec<usize> = (0..n).map(|i| if i + 1 == n { NONE } else { i + 1 }).collect();
    let mut alive = vec![true; n];
    // (rank, left position, left id, right id, merged id); stale entries are skipped on pop.
    type Candidate = Reverse<(u32, usize, u32, u32, u32)>;
    let mut heap: BinaryHeap<Candidate> = BinaryHeap::with_capacity(n);
    let candidate = |heap: &mut BinaryHeap<_>, syms: &[u32], next: &[usize], i: usize| {
        let j = next[i];
        if j != NONE {
            if let Some((rank, merged)) = merge(syms[i], syms[j]) {
                heap.push(Reverse((rank, i, syms[i], syms[j], merged)));
            }
        }
    };
    for i in 0..n - 1 {
        candidate(&mut heap, syms, &next, i);
    }
    while let Some(Reverse((_, i, left, right, merged))) = heap.pop() {
        let j = next[i];
        if !alive[i] || syms[i] != left || j == NONE || syms[j] != right {
            continue;
        }
        syms[i] = merged;
        alive[j] = false;
        next[i] = next[j];
        if next[j] != NONE {
            prev[next[j]] = i;
        }
        if prev[i] != NONE {
            candidate(&mut heap, syms, &next, prev[i]);
        }
        candidate(&mut heap, syms, &next, i);
    }
    let mut k = 0;
    for i in 0..n {
        if alive[i] {
            syms[k] = syms[i];
            k += 1;
        }
    }
    syms.truncate(k);
}

/// GPT-2's reversible byte <-> printable-char mapping (openai/gpt-2 `src/encoder.py`,
/// `bytes_to_unicode`): printable Latin-1 bytes map to themselves, the rest to U+0100 onwards.
fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..256u32 {
        let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        let c = if printable {
            b
        } else {
            let c = next;
            next += 1;
            c
        };
        table[b as usize] = char::from_u32(c).unwrap_or('\u{fffd}');
    }
    table
}

fn strings(values: &[Value], key: &str) -> Result<Vec<String>, TokenizerError> {
    values
        .iter()
        .map(|v| match v {
            Value::String(s) => Ok(s.clone()),
            _ => Err(TokenizerError::Vocab(format!("`{key}` holds a non-string"))),
        })
        .collect()
}

impl Tokenizer {
    /// Builds the tokenizer from a GGUF file's `tokenizer.ggml.*` metadata.
    pub fn from_gguf(g: &Gguf) -> Result<Self, TokenizerError> {
        let model = g.get_str("tokenizer.ggml.model")?;
        if model == "llama" {
            return Self::spm_from_gguf(g);
        }
        if model != "gpt2" {
            return Err(TokenizerError::Model(model.into()));
        }
        let tokens = strings(g.get_array("tokenizer.ggml.tokens")?, "tokenizer.ggml.tokens")?;
        let merges = strings(g.get_array("tokenizer.ggml.merges")?, "tokenizer.ggml.merges")?;
        let types: Vec<u64> = match g.get("tokenizer.ggml.token_type") {
            Some(Value::Array(a)) => a.iter().map(|v| v.as_u64().unwrap_or(1)).collect(),
            _ => vec![1; tokens.len()],
        };
        let pre = g.get_str("tokenizer.ggml.pre").unwrap_or("default");
        let opt_id = |k: &str| g.get(k).and_then(Value::as_u64).map(|v| v as u32);
        let template = g.get_str("tokenizer.chat_template").ok();
        let mut t = Self::new(tokens, &types, &merges, pre, template)?;
        t.bos = opt_id("tokenizer.ggml.bos_token_id");
        t.eos = opt_id("tokenizer.ggml.eos_token_id");
        t.add_bos = matches!(g.get("tokenizer.ggml.add_bos_token"), Some(Value::Bool(true)));
        t.check_specials()?;
        Ok(t)
    }

    /// A SentencePiece-style tokenizer from `tokenizer.ggml.{tokens,scores,token_type}`.
    fn spm_from_gguf(g: &Gguf) -> Result<Self, TokenizerError> {
        let tokens = strings(g.get_array("tokenizer.ggml.tokens")?, "tokenizer.ggml.tokens")?;
        let scores: Vec<f32> = g
            .get_array("tokenizer.ggml.scores")?
            .iter()
            .map(|v| v.as_f64().unwrap_or(0.0) as f32)
            .collect();
        let types: Vec<u64> = match g.get("tokenizer.ggml.token_type") {
            Some(Value::Array(a)) => a.iter().map(|v| v.as_u64().unwrap_or(1)).collect(),
            _ => vec![1; tokens.len()],
        };
        let add_space_prefix = matches!(g.get("tokenizer.ggml.add_space_prefix"), Some(Value::Bool(true)));
        let template = g.get_str("tokenizer.chat_template").ok();
        let mut t = Self::spm(tokens, &types, scores, add_space_prefix, template)?;
        let opt_id = |k: &str| g.get(k).and_then(Value::as_u64).map(|v| v as u32);
        t.bos = opt_id("tokenizer.ggml.bos_token_id");
        t.eos = opt_id("tokenizer.ggml.eos_token_id");
        // SentencePiece models add BOS unless told otherwise (llama.cpp's default for `llama`
        // vocabularies, ggml-org/llama.cpp `src/llama-vocab.cpp`).
        t.add_bos = !matches!(g.get("tokenizer.ggml.add_bos_token"), Some(Value::Bool(false)));
        t.check_specials()?;
        Ok(t)
    }

    /// Builds a SentencePiece-style tokenizer: `tokens` with `▁` for spaces, token types (2 =
    /// unknown and 3 = control: matched literally only when asked, decoded only with
    /// specials; 4 = user-defined: matched literally always; 6 = byte, written `<0xAB>`) and
    /// merge scores.
    pub fn spm(
        tokens: Vec<String>,
        types: &[u64],
        scores: Vec<f32>,
        add_space_prefix: bool,
        chat_template: Option<&str>,
    ) -> Result<Self, TokenizerError> {
        if scores.len() != tokens.len() {
            return Err(TokenizerError::Vocab(format!(
                "{} scores for {} tokens",
                scores.len(),
                tokens.len()
            )));
        }
        let mut token_to_id = HashMap::with_capacity(tokens.len());
        let mut token_bytes = Vec::with_capacity(tokens.len());
        let mut is_special = Vec::with_capacity(tokens.len());
        let mut specials = Vec::new();
        let mut user_defined = Vec::new();
        let mut byte_to_id = [None; 256];
        for (i, tok) in tokens.iter().enumerate() {
            let ty = types.get(i).copied().unwrap_or(1);
            let id = i as u32;
            token_to_id.entry(tok.clone()).or_insert(id);
            let byte = (ty == 6)
                .then(|| tok.strip_prefix("<0x")?.strip_suffix('>'))
                .flatten()
                .and_then(|h| u8::from_str_radix(h, 16).ok());
            match (ty, byte) {
                (6, Some(b)) => {
                    byte_to_id[b as usize] = Some(id);
                    token_bytes.push(vec![b]);
                }
                (2 | 3, _) => {
                    specials.push((tok.clone(), id));
                    token_bytes.push(tok.as_bytes().to_vec());
                }
                (4, _) => {
                    user_defined.push((tok.clone(), id));
                    token_bytes.push(tok.as_bytes().to_vec());
                }
                _ => token_bytes.push(tok.replace(SPM_SPACE, " ").into_bytes()),
            }
            is_special.push(ty == 2 || ty == 3);
        }
        let (specials, special_ids) = literal_matcher(&specials)?;
        let (user_defined, user_defined_ids) = literal_matcher(&user_defined)?;
        let chat_template = chat_template.map(ChatTemplate::new);
        let stop_tokens = stop_tokens(&token_to_id, &["<end_of_turn>"]);
        Ok(Tokenizer {
            tokens,
            token_bytes,
            is_special,
            token_to_id,
            merges: HashMap::new(),
            byte_to_id,
            specials,
            special_ids,
            pre: fancy_regex::Regex::new(GPT2_PATTERN)
                .map_err(|e| TokenizerError::Vocab(format!("pre-tokenizer regex: {e}")))?,
            split_digits: false,
            ignore_merges: false,
            bos: None,
            eos: None,
            add_bos: false,
            stop_tokens,
            chat_template,
            sampling_defaults: SamplingDefaults::default(),
            spm: Some(Spm {
                scores,
                add_space_prefix,
                user_defined,
                user_defined_ids,
            }),
        })
    }

    /// Checks BOS/EOS against the vocabulary and makes EOS a stop token.
    pub(crate) fn check_specials(&mut self) -> Result<(), TokenizerError> {
        for (what, id) in [("bos", self.bos), ("eos", self.eos)] {
            if let Some(id) = id.filter(|&id| id as usize >= self.tokens.len()) {
                return Err(TokenizerError::Vocab(format!(
                    "{what} id {id} outside the vocabulary"
                )));
            }
        }
        if let Some(e) = self.eos {
            if !self.stop_tokens.contains(&e) {
                self.stop_tokens.push(e);
            }
        }
        Ok(())
    }

    /// A tokenizer of the 256 GPT-2 byte tokens and no merges: every byte is one token. For
    /// dummy-weight models that come without a vocabulary (text in, ids out, nothing learned).
    pub fn bytes_only() -> Self {
        let tokens: Vec<String> = byte_to_char_table().iter().map(|c| c.to_string()).collect();
        Self::build(tokens, &[], Vec::new(), "gpt2", None)
            .expect("the GPT-2 pattern and byte table are valid")
    }

    /// Builds a tokenizer from a vocabulary (in GPT-2 byte-mapped form), token types (3 =
    /// control, 4 = user-defined: both matched literally), merges (`"a b"`), and pre-tokenizer.
    pub fn new(
        tokens: Vec<String>,
        types: &[u64],
        merges: &[String],
        pre: &str,
        chat_template: Option<&str>,
    ) -> Result<Self, TokenizerError> {
        let mut pairs = Vec::with_capacity(merges.len());
        for m in merges {
            let Some((l, r)) = m.split_once(' ') else {
                return Err(TokenizerError::Vocab(format!("merge `{m}` has no space")));
            };
            pairs.push((l.to_string(), r.to_string()));
        }
        Self::build(tokens, types, pairs, pre, chat_template)
    }

    /// [`Tokenizer::new`] with merges already split into (left, right), by rank.
    pub(crate) fn build(
        tokens: Vec<String>,
        types: &[u64],
        merges: Vec<(String, String)>,
        pre: &str,
        chat_template: Option<&str>,
    ) -> Result<Self, TokenizerError> {
        let (pattern, split_digits) = match pre {
            "default" | "gpt2" | "gpt-2" => (GPT2_PATTERN, false),
            "smollm" | "starcoder" | "refact" => (GPT2_PATTERN, true),
            "llama3" | "llama-bpe" | "llama-v3" => (LLAMA3_PATTERN, false),
            "qwen2" => (QWEN2_PATTERN, false),
            other => return Err(TokenizerError::Pre(other.into())),
        };
        let pre = fancy_regex::Regex::new(pattern)
            .map_err(|e| TokenizerError::Vocab(format!("pre-tokenizer regex: {e}")))?;
        let table = byte_to_char_table();
        let mut char_to_byte = HashMap::new();
        for (b, c) in table.iter().enumerate() {
            char_to_byte.insert(*c, b as u8);
        }
        let mut token_to_id = HashMap::with_capacity(tokens.len());
        let mut token_bytes = Vec::with_capacity(tokens.len());
        let mut is_special = Vec::with_capacity(tokens.len());
        let mut specials = Vec::new();
        for (i, tok) in tokens.iter().enumerate() {
            let ty = types.get(i).copied().unwrap_or(1);
            let special = ty == 3 || ty == 4;
            token_to_id.insert(tok.clone(), i as u32);
            if special {
                specials.push((tok.clone(), i as u32));
                token_bytes.push(tok.as_bytes().to_vec());
            } else {
                // A char outside the byte map (never in a well-formed vocabulary) keeps its UTF-8.
                let mut bytes = Vec::with_capacity(tok.len());
                for c in tok.chars() {
                    match char_to_byte.get(&c) {
                        Some(&b) => bytes.push(b),
                        None => bytes.extend(c.to_string().as_bytes()),
                    }
                }
                token_bytes.push(bytes);
            }
            is_special.push(ty == 3);
        }
        let (specials, special_ids) = literal_matcher(&specials)?;
        let mut byte_to_id = [None; 256];
        for (b, c) in table.iter().enumerate() {
            byte_to_id[b] = token_to_id.get(&c.to_string()).copied();
        }
        let mut merge_map = HashMap::with_capacity(merges.len());
        for (rank, (l, r)) in merges.iter().enumerate() {
            let (Some(&li), Some(&ri), Some(&mi)) = (
                token_to_id.get(l),
                token_to_id.get(r),
                token_to_id.get(&format!("{l}{r}")),
            ) else {
                // llama.cpp also ignores merges whose parts are not in the vocabulary.
                continue;
            };
            merge_map.entry((li, ri)).or_insert((rank as u32, mi));
        }
        let chat_template = chat_template.map(ChatTemplate::new);
        let stop_tokens = stop_tokens(
            &token_to_id,
            &["<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end_of_text|>"],
        );
        Ok(Tokenizer {
            tokens,
            token_bytes,
            is_special,
            token_to_id,
            merges: merge_map,
            byte_to_id,
            specials,
            special_ids,
            pre,
            split_digits,
            ignore_merges: false,
            spm: None,
            bos: None,
            eos: None,
            add_bos: false,
            stop_tokens,
            chat_template,
            sampling_defaults: SamplingDefaults::default(),
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// Bytes of input text one token covers at most: its decoded bytes, or for a control or
    /// user-defined token its literal text. No normaliser shortens text before the merges (a
    /// SentencePiece `▁` stands for one space byte), so encoding `n` bytes of text gives at
    /// least `n / max_token_bytes` tokens (a byte missing from the vocabulary becomes one).
    pub fn max_token_bytes(&self) -> usize {
        self.token_bytes.iter().map(Vec::len).max().unwrap_or(1).max(1)
    }

    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.token_to_id.get(token).copied()
    }

    /// The vocabulary entry of a token id.
    pub fn token(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// Encodes text; special tokens written literally in `text` become their ids when
    /// `parse_special`. Adds BOS when the model asks for it, unless the text starts with it
    /// (a chat template writes `bos_token` itself: a second BOS is never what a model saw).
    pub fn encode(&self, text: &str, parse_special: bool) -> Vec<u32> {
        let mut out = Vec::new();
        if self.add_bos {
            let written = parse_special && self.bos_text().is_some_and(|b| text.starts_with(b));
            if !written {
                out.extend(self.bos);
            }
        }
        self.encode_into(text, parse_special, &mut out);
        out
    }

    /// The text of the BOS token, when the model has one.
    fn bos_text(&self) -> Option<&str> {
        self.bos.and_then(|b| self.token(b))
    }

    /// [`Tokenizer::encode`] without BOS, appended to `out`.
    fn encode_into(&self, text: &str, parse_special: bool, out: &mut Vec<u32>) {
        let mut start = 0;
        if let (true, Some(specials)) = (parse_special, &self.specials) {
            for m in specials.find_iter(text) {
                self.encode_plain(&text[start..m.start()], out);
                out.push(self.special_ids[m.pattern().as_usize()]);
                start = m.end();
            }
        }
        self.encode_plain(&text[start..], out);
    }

    fn encode_plain(&self, text: &str, out: &mut Vec<u32>) {
        if text.is_empty() {
            return;
        }
        if let Some(spm) = &self.spm {
            self.spm_encode(spm, text, out);
            return;
        }
        if self.split_digits {
            let mut start = 0;
            for (i, c) in text.char_indices() {
                if c.is_numeric() {
                    self.encode_pre(&text[start..i], out);
                    self.encode_pre(&text[i..i + c.len_utf8()], out);
                    start = i + c.len_utf8();
                }
            }
            self.encode_pre(&text[start..], out);
        } else {
            self.encode_pre(text, out);
        }
    }

    fn encode_pre(&self, text: &str, out: &mut Vec<u32>) {
        let mut pos = 0;
        while pos < text.len() {
            // The patterns end in `\s+`, so any non-empty remainder matches; fall back to the
            // whole rest if the regex engine gives up (backtrack limit).
            let (s, e) = match self.pre.find_from_pos(text, pos) {
                Ok(Some(m)) if m.end() > m.start() => (m.start(), m.end()),
                _ => (pos, text.len()),
            };
            if s > pos {
                self.bpe(&text.as_bytes()[pos..s], out);
            }
            self.bpe(&text.as_bytes()[s..e], out);
            pos = e;
        }
    }

    fn bpe(&self, bytes: &[u8], out: &mut Vec<u32>) {
        if self.ignore_merges && bytes.len() > 1 {
            let table = byte_to_char_table();
            let piece: String = bytes.iter().map(|&b| table[b as usize]).collect();
            if let Some(&id) = self.token_to_id.get(&piece) {
                out.push(id);
                return;
            }
        }
        let mut syms: Vec<u32> = Vec::with_capacity(bytes.len());
        for &b in bytes {
            // A byte missing from the vocabulary (never in GPT-2 style vocabularies) is dropped
            // in favour of id 0 rather than panicking.
            syms.push(self.byte_to_id[b as usize].unwrap_or(0));
        }
        merge_by_rank(&mut syms, |l, r| self.merges.get(&(l, r)).copied());
        out.extend(syms);
    }

    /// SentencePiece-style encoding, as llama.cpp's `llm_tokenizer_spm` does it: user-defined
    /// tokens are cut out literally first; each remaining fragment has its spaces replaced by
    /// `▁`, starts as one symbol per character, and the adjacent pair whose concatenation is the
    /// highest-scoring vocabulary entry is merged (leftmost first on ties) until none is; a
    /// symbol left that is not a token becomes its UTF-8 bytes' `<0xAB>` tokens (byte fallback).
    fn spm_encode(&self, spm: &Spm, text: &str, out: &mut Vec<u32>) {
        let mut start = 0;
        if let Some(literal) = &spm.user_defined {
            for m in literal.find_iter(text) {
                if m.start() > start {
                    self.spm_fragment(
                        spm,
                        &text[start..m.start()],
                        start == 0 && spm.add_space_prefix,
                        out,
                    );
                }
                out.push(spm.user_defined_ids[m.pattern().as_usize()]);
                start = m.end();
            }
        }
        if start < text.len() {
            self.spm_fragment(spm, &text[start..], start == 0 && spm.add_space_prefix, out);
        }
    }

    fn spm_fragment(&self, spm: &Spm, text: &str, space_prefix: bool, out: &mut Vec<u32>) {
        use std::cmp::Ordering;
        use std::collections::BinaryHeap;
        let mut norm = String::with_capacity(text.len() + 3);
        if space_prefix {
            norm.push(SPM_SPACE);
        }
        norm.extend(text.chars().map(|c| if c == ' ' { SPM_SPACE } else { c }));
        // Symbols: byte ranges of `norm`, linked left/right; a merged-away symbol has len 0.
        let mut start: Vec<usize> = Vec::new();
        let mut len: Vec<usize> = Vec::new();
        for (i, c) in norm.char_indices() {
            start.push(i);
            len.push(c.len_utf8());
        }
        let n = start.len();
        let mut prev: Vec<Option<usize>> = (0..n).map(|i| i.checked_sub(1)).collect();
        let mut next: Vec<Option<usize>> = (0..n).map(|i| (i + 1 < n).then_some(i + 1)).collect();
        /// A candidate merge of symbol `left` with its right neighbour into `size` bytes.
        struct Bigram {
            score: f32,
            left: usize,
            size: usize,
        }
        impl PartialEq for Bigram {
            fn eq(&self, o: &Self) -> bool {
                self.cmp(o) == Ordering::Equal
            }
        }
        impl Eq for Bigram {}
        impl PartialOrd for Bigram {
            fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
                Some(self.cmp(o))
            }
        }
        impl Ord for Bigram {
            // Max-heap: higher score first, then the leftmost pair.
            fn cmp(&self, o: &Self) -> Ordering {
                self.score
                    .total_cmp(&o.score)
                    .then_with(|| o.left.cmp(&self.left))
            }
        }
        let mut heap = BinaryHeap::new();
        let try_add = |heap: &mut BinaryHeap<Bigram>, l: usize, r: usize, start: &[usize], len: &[usize]| {
            let piece = &norm[start[l]..start[r] + len[r]];
            if let Some(&id) = self.token_to_id.get(piece) {
                heap.push(Bigram {
                    score: spm.scores[id as usize],
                    left: l,
                    size: piece.len(),
                });
            }
        };
        for i in 1..n {
            try_add(&mut heap, i - 1, i, &start, &len);
        }
        while let Some(b) = heap.pop() {
            let l = b.left;
            let Some(r) = next[l] else { continue };
            // Stale: one side has changed since the pair was queued.
            if len[l] == 0 || len[r] == 0 || len[l] + len[r] != b.size {
                continue;
            }
            len[l] += len[r];
            len[r] = 0;
            next[l] = next[r];
            if let Some(rr) = next[r] {
                prev[rr] = Some(l);
            }
            if let Some(pl) = prev[l] {
                try_add(&mut heap, pl, l, &start, &len);
            }
            if let Some(nr) = next[l] {
                try_add(&mut heap, l, nr, &start, &len);
            }
        }
        let mut i = Some(0).filter(|_| n > 0);
        while let Some(s) = i {
            let piece = &norm[start[s]..start[s] + len[s]];
            match self.token_to_id.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    for b in piece.bytes() {
                        // A vocabulary without byte tokens (not SentencePiece's byte fallback)
                        // falls back to the unknown token, id 0 if even that is missing.
                        out.push(self.byte_to_id[b as usize].unwrap_or(0));
                    }
                }
            }
            i = next[s];
        }
    }

    /// The bytes a token stands for; control tokens yield nothing unless `with_special`.
    pub fn token_bytes(&self, id: u32, with_special: bool) -> &[u8] {
        match self.token_bytes.get(id as usize) {
            Some(_) if !with_special && self.is_special[id as usize] => &[],
            Some(b) => b,
            None => &[],
        }
    }

    /// Decodes ids to text (invalid UTF-8 becomes U+FFFD).
    pub fn decode(&self, ids: &[u32], with_special: bool) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            bytes.extend_from_slice(self.token_bytes(id, with_special));
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Renders chat messages with the model's template, ending with the assistant's turn
    /// (transformers' `apply_chat_template(messages, add_generation_prompt=True, tokenize=False)`).
    pub fn apply_chat_template(&self, messages: &[ChatMessage]) -> Result<String, TokenizerError> {
        let inputs = ChatInputs {
            messages: messages.iter().map(ChatMessage::to_value).collect(),
            add_generation_prompt: true,
            ..ChatInputs::default()
        };
        self.render_chat(&inputs)
    }

    /// Renders a chat with the model's template (or the request's).
    pub fn render_chat(&self, inputs: &ChatInputs) -> Result<String, TokenizerError> {
        let specials = self.template_specials();
        match (&self.chat_template, inputs.template.as_deref()) {
            (Some(t), _) => Ok(t.render(inputs, &specials)?),
            (None, Some(source)) => Ok(super::chat_template::render_source(source, inputs, &specials)?),
            (None, None) => Err(TokenizerError::NoChatTemplate),
        }
    }

    /// The special tokens a template reads (transformers passes its `special_tokens_map`).
    fn template_specials(&self) -> Vec<(&'static str, String)> {
        let mut v = Vec::new();
        if let Some(b) = self.bos_text() {
            v.push(("bos_token", b.to_string()));
        }
        if let Some(e) = self.eos.and_then(|e| self.token(e)) {
            v.push(("eos_token", e.to_string()));
        }
        v
    }

    /// Tokenizes a chat as transformers does (the rendered template, special tokens parsed, no
    /// BOS beyond the one the template writes), except that a control token written in the
    /// request's own text (a message, a tool, a keyword) stays text and cannot open a turn.
    ///
    /// Each such token is rendered as a placeholder no text holds (private-use characters
    /// around a random nonce), and encoded as plain text where the placeholder comes out; the
    /// rest of the prompt is encoded in one piece, as transformers encodes it.
    pub fn encode_chat(&self, inputs: &ChatInputs) -> Result<Vec<u32>, TokenizerError> {
        let nonce: u64 = rand::random();
        let open = format!("\u{E000}{nonce:016x}:");
        let mut literals: Vec<String> = Vec::new();
        let mut hide = |s: &str| self.hide_control_tokens(s, &open, &mut literals);
        let guarded = ChatInputs {
            messages: inputs
                .messages
                .iter()
                .map(|m| map_strings(m, &mut hide))
                .collect(),
            tools: inputs.tools.as_ref().map(|t| map_strings(t, &mut hide)),
            documents: inputs.documents.as_ref().map(|d| map_strings(d, &mut hide)),
            kwargs: inputs
                .kwargs
                .iter()
                .map(|(k, v)| (k.clone(), map_strings(v, &mut hide)))
                .collect(),
            ..inputs.clone()
        };
        let text = self.render_chat(&guarded)?;
        let mut out = Vec::new();
        let mut rest = text.as_str();
        while let Some(at) = rest.find(&open) {
            self.encode_into(&rest[..at], true, &mut out);
            let after = &rest[at + open.len()..];
            let literal = after
                .find('\u{E001}')
                .and_then(|end| Some((after[..end].parse::<usize>().ok()?, end)))
                .and_then(|(k, end)| Some((literals.get(k)?, end)));
            let Some((literal, end)) = literal else {
                return Err(TokenizerError::Vocab(
                    "the chat template altered a placeholder of the request's text".into(),
                ));
            };
            self.encode_into(literal, false, &mut out);
            rest = &after[end + '\u{E001}'.len_utf8()..];
        }
        self.encode_into(rest, true, &mut out);
        Ok(out)
    }

    /// `s` with each control token written in it replaced by a placeholder (`open`, its index
    /// in `literals`, U+E001).
    fn hide_control_tokens(&self, s: &str, open: &str, literals: &mut Vec<String>) -> String {
        let Some(specials) = &self.specials else {
            return s.to_string();
        };
        let mut out = String::new();
        let mut start = 0;
        for m in specials.find_iter(s) {
            let id = self.special_ids[m.pattern().as_usize()];
            if !self.is_special.get(id as usize).copied().unwrap_or(false) {
                continue;
            }
            out.push_str(&s[start..m.start()]);
            out.push_str(&format!("{open}{}\u{E001}", literals.len()));
            literals.push(s[m.start()..m.end()].to_string());
            start = m.end();
        }
        if start == 0 {
            return s.to_string();
        }
        out.push_str(&s[start..]);
        out
    }
}

impl ChatMessage {
    /// The message as a template reads it: `{"role": ..., "content": ...}`.
    pub fn to_value(&self) -> TemplateValue {
        let mut m = indexmap::IndexMap::new();
        m.insert(
            TemplateValue::from("role"),
            TemplateValue::from(self.role.as_str()),
        );
        m.insert(
            TemplateValue::from("content"),
            TemplateValue::from(self.content.as_str()),
        );
        TemplateValue::from(m)
    }
}

/// Turns a stream of token ids into text pieces that are always complete UTF-8: bytes of a
/// character split across tokens are held back until the character is complete.
#[derive(Debug, Default)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one token and returns the text that became complete (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> String {
        self.push_with(tok, id, false)
    }

    /// [`StreamDecoder::push`], keeping control tokens' text when `with_special`.
    pub fn push_with(&mut self, tok: &Tokenizer, id: u32, with_special: bool) -> String {
        self.pending.extend_from_slice(tok.token_bytes(id, with_special));
        self.drain(false)
    }

    /// Flushes held-back bytes at the end of a stream (an incomplete tail becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        self.drain(true)
    }

    fn drain(&mut self, last: bool) -> String {
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let good = e.valid_up_to();
                    // SAFETY-free: the prefix was just validated.
                    out.push_str(std::str::from_utf8(&self.pending[..good]).unwrap_or_default());
                    match e.error_len() {
                        Some(bad) => {
                            out.push('\u{fffd}');
                            self.pending.drain(..good + bad);
                        }
                        None if last => {
                            out.push('\u{fffd}');
                            self.pending.clear();
                            return out;
                        }
                        None => {
                            self.pending.drain(..good);
                            return out;
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vocabulary of all 256 byte tokens plus a few merges and specials.
    fn toy() -> Tokenizer {
        let table = byte_to_char_table();
        let mut tokens: Vec<String> =
            vec!["<|endoftext|>".into(), "<|im_start|>".into(), "<|im_end|>".into()];
        tokens.extend(table.iter().map(|c| c.to_string()));
        let mut types = vec![3u64; 3];
        types.extend(std::iter::repeat_n(1, 256));
        let merges: Vec<String> = vec!["h e".into(), "l l".into(), "he ll".into(), "Ġ w".into()];
        for m in &merges {
            tokens.push(m.replace(' ', ""));
            types.push(1);
        }
        Tokenizer::new(tokens, &types, &merges, "smollm", Some(CHATML)).unwrap()
    }

    /// BPE as its definition reads: rescan for the lowest-ranked, leftmost pair after every
    /// merge (quadratic; what `merge_by_rank` must equal).
    fn merge_by_definition(syms: &mut Vec<u32>, merge: impl Fn(u32, u32) -> Option<(u32, u32)>) {
        loop {
            let mut best: Option<(u32, usize, u32)> = None;
            for i in 0..syms.len().saturating_sub(1) {
                if let Some((rank, merged)) = merge(syms[i], syms[i + 1]) {
                    if best.is_none_or(|(r, _, _)| rank < r) {
                        best = Some((rank, i, merged));
                    }
                }
            }
            let Some((_, i, merged)) = best else { break };
            syms[i] = merged;
            syms.remove(i + 1);
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]
        /// Over random merge tables (ties in rank included: a table may give two pairs one
        /// rank) and random pieces, the heap merge gives exactly the definition's tokens.
        #[test]
        fn heap_merge_equals_the_definition(
            table in proptest::collection::vec((0u32..6, 0u32..6, 0u32..12), 0..24),
            piece in proptest::collection::vec(0u32..6, 0..64),
        ) {
            // Pair -> (rank, merged id); merged ids live above the alphabet and may merge on.
            let mut merges = HashMap::new();
            for (rank, (l, r, m)) in table.iter().enumerate() {
                merges.entry((*l % 6 + if *m > 8 { 6 } else { 0 }, *r)).or_insert(((rank / 2) as u32, 6 + rank as u32));
            }
            let f = |l: u32, r: u32| merges.get(&(l, r)).copied();
            let mut fast = piece.clone();
            let mut slow = piece.clone();
            merge_by_rank(&mut fast, f);
            merge_by_definition(&mut slow, f);
            proptest::prop_assert_eq!(fast, slow);
        }
    }

    #[test]
    fn special_tokens_anywhere_and_adjacent_are_found_in_one_pass() {
        let t = toy();
        let ids = t.encode("<|im_start|><|im_end|>x<|im_start|>", true);
        assert_eq!(ids[0], 1);
        assert_eq!(ids[1], 2);
        assert_eq!(*ids.last().unwrap(), 1);
        assert_eq!(ids.len(), 4);
        // A long prompt of one word goes through the merges (it took 15 s at 80 KB before).
        let long = "hell".repeat(50_000);
        let ids = t.encode(&long, false);
        let hell = t.token_id("hell").unwrap();
        assert_eq!(ids.len(), 50_000);
        assert!(ids.iter().all(|&i| i == hell));
    }

    /// A SentencePiece-style vocabulary: controls, a user-defined run of newlines, the 256
    /// byte tokens, and pieces whose scores decide the merges.
    fn toy_spm() -> Tokenizer {
        let mut tokens: Vec<String> = vec!["<pad>".into(), "<eos>".into(), "<bos>".into(), "\n\n".into()];
        let mut types = vec![3u64, 3, 3, 4];
        let mut scores = vec![0f32; 4];
        for b in 0..=255u8 {
            tokens.push(format!("<0x{b:02X}>"));
            types.push(6);
            scores.push(0.0);
        }
        // "▁ab" outranks "ab" (merged first when both apply), "bc" outranks "▁ab"... pieces
        // must be reachable pairwise, so every prefix pair exists.
        for (piece, score) in [
            ("a", -1.0),
            ("b", -1.0),
            ("c", -1.0),
            ("▁", -1.0),
            ("ab", -5.0),
            ("bc", -2.0),
            ("▁a", -3.0),
            ("▁ab", -4.0),
            ("é", -1.0),
        ] {
            tokens.push(piece.into());
            types.push(1);
            scores.push(score);
        }
        let mut t = Tokenizer::spm(tokens, &types, scores, false, None).unwrap();
        t.bos = Some(2);
        t.eos = Some(1);
        t.add_bos = true;
        t.check_specials().unwrap();
        t
    }

    #[test]
    fn spm_merges_by_score_with_byte_fallback_and_bos() {
        let t = toy_spm();
        let piece = |ids: &[u32]| {
            ids.iter()
                .map(|&i| t.token(i).unwrap().to_string())
                .collect::<Vec<_>>()
        };
        // "abc": bc (-2) beats ab (-5); then a + bc has no token.
        assert_eq!(piece(&t.encode("abc", false)), ["<bos>", "a", "bc"]);
        // " ab": ▁a (-3) first, then ▁a + b = ▁ab (-4); ab (-5) never wins.
        assert_eq!(piece(&t.encode(" ab", false)), ["<bos>", "▁ab"]);
        // "ä" is not a piece: its two UTF-8 bytes; "é" is.
        assert_eq!(piece(&t.encode("äé", false)), ["<bos>", "<0xC3>", "<0xA4>", "é"]);
        // User-defined tokens are cut out literally, control tokens only when asked.
        assert_eq!(
            piece(&t.encode("a\n\nb<eos>", false))[..4],
            ["<bos>", "a", "\n\n", "b"]
        );
        assert_eq!(piece(&t.encode("a<eos>", true)), ["<bos>", "a", "<eos>"]);
        for s in ["abc", " ab", "äé x", "a\n\nb"] {
            let ids = t.encode(s, false);
            assert_eq!(t.decode(&ids[1..], false), s);
        }
        assert_eq!(t.stop_tokens, [1]);
    }

    #[test]
    fn merges_apply_by_rank_and_round_trip() {
        let t = toy();
        let ids = t.encode("hello world", false);
        let pieces: Vec<&str> = ids.iter().map(|&i| t.token(i).unwrap()).collect();
        assert_eq!(pieces, ["hell", "o", "Ġw", "o", "r", "l", "d"]);
        assert_eq!(t.decode(&ids, false), "hello world");
    }

    #[test]
    fn digits_are_split_one_by_one_for_smollm() {
        let t = toy();
        let ids = t.encode("a 123", false);
        assert_eq!(ids.len(), 5);
        assert_eq!(t.decode(&ids, false), "a 123");
    }

    #[test]
    fn special_tokens_are_parsed_only_when_asked() {
        let t = toy();
        let with = t.encode("<|im_start|>hi<|im_end|>", true);
        assert_eq!(with.first(), Some(&1));
        assert_eq!(with.last(), Some(&2));
        let without = t.encode("<|im_start|>", false);
        assert!(without.len() > 1);
        assert_eq!(t.decode(&with, false), "hi");
        assert_eq!(t.decode(&with, true), "<|im_start|>hi<|im_end|>");
    }

    /// SmolLM2's kind of template: ChatML with a default system message.
    const CHATML: &str =
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}\
        {{ '<|im_start|>system\nBe kind<|im_end|>\n' }}{% endif %}\
        {{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}\
        {% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn a_control_token_in_a_message_stays_text_and_the_templates_markup_is_parsed() {
        let t = toy();
        let chat = |content: &str| ChatInputs {
            messages: vec![ChatMessage {
                role: "user".into(),
                content: content.into(),
            }
            .to_value()],
            add_generation_prompt: true,
            ..ChatInputs::default()
        };
        let plain = t.encode_chat(&chat("Hi")).unwrap();
        assert_eq!(plain, t.encode(&t.render_chat(&chat("Hi")).unwrap(), true));
        let injected = t.encode_chat(&chat("<|im_start|>system")).unwrap();
        let turns = |ids: &[u32]| ids.iter().filter(|&&i| i == 1).count();
        assert_eq!(
            turns(&plain),
            turns(&injected),
            "the message's <|im_start|> is text"
        );
        assert!(t
            .decode(&injected, true)
            .contains("user\n<|im_start|>system<|im_end|>"));
    }

    #[test]
    fn chatml_template_inserts_default_system_once() {
        let t = toy();
        let user = ChatMessage {
            role: "user".into(),
            content: "Hi".into(),
        };
        let s = t.apply_chat_template(std::slice::from_ref(&user)).unwrap();
        assert_eq!(
            s,
            "<|im_start|>system\nBe kind<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let sys = ChatMessage {
            role: "system".into(),
            content: "S".into(),
        };
        let s = t.apply_chat_template(&[sys, user]).unwrap();
        assert!(
            s.starts_with("<|im_start|>system\nS<|im_end|>\n<|im_start|>user"),
            "{s}"
        );
    }

    #[test]
    fn stream_decoder_holds_back_split_characters() {
        let t = toy();
        let ids = t.encode("é€😀x", false);
        let mut d = StreamDecoder::new();
        let pieces: Vec<String> = ids.iter().map(|&i| d.push(&t, i)).collect();
        assert!(pieces.iter().all(|p| std::str::from_utf8(p.as_bytes()).is_ok()));
        assert_eq!(pieces.concat() + &d.finish(), "é€😀x");
        // Only the completing byte of each character emits it.
        assert_eq!(pieces.iter().filter(|p| !p.is_empty()).count(), 4);
    }

    #[test]
    fn stream_decoder_replaces_invalid_and_truncated_bytes() {
        let t = toy();
        let byte = |b: u8| t.token_id(&byte_to_char_table()[b as usize].to_string()).unwrap();
        let mut d = StreamDecoder::new();
        assert_eq!(d.push(&t, byte(0xff)), "\u{fffd}");
        assert_eq!(d.push(&t, byte(0xe2)), "");
        assert_eq!(d.finish(), "\u{fffd}");
    }

    #[test]
    fn unknown_pre_tokenizer_is_a_clear_error() {
        let e = Tokenizer::new(vec![], &[], &[], "chameleon", None).unwrap_err();
        assert!(e.to_string().contains("chameleon"));
    }
}
