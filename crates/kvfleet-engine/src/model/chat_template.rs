//! Chat templates as the model ships them: the Jinja source of `tokenizer_config.json`'s
//! `chat_template` (a string, or a list of named templates), `chat_template.jinja`, or a GGUF's
//! `tokenizer.chat_template`, rendered with transformers' semantics
//! (huggingface/transformers `src/transformers/utils/chat_template_utils.py`,
//! `render_jinja_template` and `_cached_compile_jinja_template`): blocks trimmed and
//! left-stripped, `{% break %}` / `{% continue %}`, `{% generation %}` blocks rendered as
//! their body, the globals `raise_exception` and `strftime_now`, a `tojson` that is Python's
//! `json.dumps` (no HTML escaping; `ensure_ascii`, `indent`, `separators`, `sort_keys`), Python's
//! string and dict methods (`minijinja-contrib`'s pycompat), and the context `messages`, `tools`,
//! `documents`, `add_generation_prompt`, the special tokens and the request's
//! `chat_template_kwargs` (which win over the special tokens, as in transformers).
//!
//! Maps keep their keys in the order given (minijinja's `preserve_order`): a tool schema renders
//! as the client wrote it.

use std::fmt::Write as _;

use indexmap::IndexMap;
use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};

/// A value a template reads (a message, the tools, a keyword).
pub use minijinja::Value as TemplateValue;

/// The instant `strftime_now` reads when a render fixes it.
pub use chrono::NaiveDateTime;

/// The name transformers gives a lone template, and the one it falls back to in a list.
pub const DEFAULT_TEMPLATE: &str = "default";

/// Instructions a template given by a request may run: a model's template over a long chat
/// takes some thousands; this bounds a hostile one's CPU time to well under a second.
const REQUEST_TEMPLATE_FUEL: u64 = 50_000_000;

/// Why a chat could not be rendered.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TemplateError {
    #[error("the chat template `{name}` does not compile: {message}")]
    Compile { name: String, message: String },
    #[error("the chat template failed: {0}")]
    Render(String),
    #[error("{0}")]
    Request(String),
}

/// The model's templates (one, or several by name), compiled once.
pub struct ChatTemplate {
    /// (name, Jinja source), in the order the model lists them.
    sources: Vec<(String, String)>,
    /// The compiled templates, or why one of them does not compile (reported when a chat is
    /// rendered, so that a template minijinja cannot read does not stop completions).
    env: Result<Environment<'static>, TemplateError>,
}

impl PartialEq for ChatTemplate {
    fn eq(&self, other: &Self) -> bool {
        self.sources == other.sources
    }
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.sources.iter().map(|(n, _)| n.as_str()).collect();
        f.debug_struct("ChatTemplate")
            .field("names", &names)
            .field("compiles", &self.env.is_ok())
            .finish()
    }
}

/// What a chat is rendered from, beside the template.
#[derive(Clone, Debug, Default)]
pub struct ChatInputs {
    /// The messages, each a map (`role`, `content`, and whatever else the client sent).
    pub messages: Vec<Value>,
    /// Tool schemas (`{"type": "function", "function": {...}}`); none renders as `none`.
    pub tools: Option<Value>,
    /// Documents for retrieval-augmented templates (a list of maps with `title` and `text`).
    pub documents: Option<Value>,
    pub add_generation_prompt: bool,
    /// End the prompt inside the last message, so that the model continues it.
    pub continue_final_message: bool,
    /// The request's `chat_template_kwargs` (Qwen3's `enable_thinking`), in order.
    pub kwargs: Vec<(String, Value)>,
    /// The request's own template: the name of one of the model's, or Jinja source.
    pub template: Option<String>,
    /// What `strftime_now` reads; none: the local time now (as transformers' `datetime.now()`).
    pub now: Option<chrono::NaiveDateTime>,
}

/// transformers' marker for `continue_final_message`: appended to the last message, found
/// in the output, and cut off with what follows.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

impl ChatTemplate {
    /// A model's single template.
    pub fn new(source: &str) -> Self {
        Self::named(vec![(DEFAULT_TEMPLATE.to_string(), source.to_string())])
    }

    /// A model's named templates (`tokenizer_config.json`'s list form: `default`, `tool_use`,
    /// `rag`, ...).
    pub fn named(sources: Vec<(String, String)>) -> Self {
        let mut env = environment();
        let mut failed = None;
        for (name, source) in &sources {
            if let Err(e) = env.add_template_owned(name.clone(), with_generation_blocks(source)) {
                failed = Some(TemplateError::Compile {
                    name: name.clone(),
                    message: detail(&e),
                });
                break;
            }
        }
        ChatTemplate {
            env: failed.map_or(Ok(env), Err),
            sources,
        }
    }

    /// The template names, in the model's order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.sources.iter().map(|(n, _)| n.as_str())
    }

    /// The Jinja source of template `name`.
    pub fn source(&self, name: &str) -> Option<&str> {
        self.sources
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, s)| s.as_str())
    }

    /// Whether the templates compile (a chat through them can render).
    pub fn check(&self) -> Result<(), TemplateError> {
        self.env.as_ref().map(|_| ()).map_err(Clone::clone)
    }

    /// The template transformers picks: the one a request names, else `tool_use` when tools
    /// are given and the model has it, else `default` (or the only one).
    fn pick(&self, inputs: &ChatInputs) -> Result<&str, TemplateError> {
        if let Some(asked) = inputs.template.as_deref() {
            if let Some((name, _)) = self.sources.iter().find(|(n, _)| n == asked) {
                return Ok(name);
            }
        }
        if let [(only, _)] = self.sources.as_slice() {
            return Ok(only);
        }
        if inputs.tools.as_ref().is_some_and(|t| !t.is_none()) && self.source("tool_use").is_some() {
            return Ok("tool_use");
        }
        if self.source(DEFAULT_TEMPLATE).is_some() {
            return Ok(DEFAULT_TEMPLATE);
        }
        let names: Vec<&str> = self.names().collect();
        Err(TemplateError::Request(format!(
            "the model's chat templates are named {names:?} and none is `default`; name one in `chat_template`"
        )))
    }

    /// Renders a chat; `specials` are the special tokens' names and text (`bos_token`,
    /// `eos_token`), which the request's keywords may override.
    pub fn render(&self, inputs: &ChatInputs, specials: &[(&str, String)]) -> Result<String, TemplateError> {
        // A request's template that is not one of the model's names is its own source.
        let own = inputs.template.as_deref().filter(|t| self.source(t).is_none());
        match own {
            Some(source) => render_source(source, inputs, specials),
            None => {
                let env = self.env.as_ref().map_err(Clone::clone)?;
                let name = self.pick(inputs)?;
                render_with(env, name, inputs, specials)
            }
        }
    }
}

/// Renders a chat through Jinja `source` given by a request (vLLM's `chat_template` field),
/// under a bound on the instructions it may run.
pub fn render_source(
    source: &str,
    inputs: &ChatInputs,
    specials: &[(&str, String)],
) -> Result<String, TemplateError> {
    let mut env = environment();
    env.set_fuel(Some(REQUEST_TEMPLATE_FUEL));
    env.add_template_owned("request", with_generation_blocks(source))
        .map_err(|e| TemplateError::Compile {
            name: "chat_template (the request's)".into(),
            message: detail(&e),
        })?;
    render_with(&env, "request", inputs, specials)
}

fn render_with(
    env: &Environment<'static>,
    name: &str,
    inputs: &ChatInputs,
    specials: &[(&str, String)],
) -> Result<String, TemplateError> {
    if inputs.continue_final_message && inputs.add_generation_prompt {
        return Err(TemplateError::Request(
            "`continue_final_message` and `add_generation_prompt` exclude each other: a prompt either opens the \
             assistant's next turn or continues the last message; send `add_generation_prompt: false`"
                .into(),
        ));
    }
    let mut messages = inputs.messages.clone();
    if inputs.continue_final_message {
        let last = messages.pop().ok_or_else(|| {
            TemplateError::Request("`continue_final_message` needs at least one message to continue".into())
        })?;
        messages.push(with_continue_tag(&last)?);
    }
    let mut ctx: IndexMap<Value, Value> = IndexMap::new();
    ctx.insert(Value::from("messages"), Value::from(messages));
    ctx.insert(
        Value::from("tools"),
        inputs.tools.clone().unwrap_or(Value::from(())),
    );
    ctx.insert(
        Value::from("documents"),
        inputs.documents.clone().unwrap_or(Value::from(())),
    );
    ctx.insert(
        Value::from("add_generation_prompt"),
        Value::from(inputs.add_generation_prompt),
    );
    for (k, v) in specials {
        ctx.insert(Value::from(*k), Value::from(v.as_str()));
    }
    if let Some(now) = inputs.now {
        ctx.insert(
            Value::from("strftime_now"),
            Value::from_function(move |fmt: String| strftime(&now, &fmt)),
        );
    }
    for (k, v) in &inputs.kwargs {
        ctx.insert(Value::from(k.as_str()), v.clone());
    }
    let template = env
        .get_template(name)
        .map_err(|e| TemplateError::Render(detail(&e)))?;
    let mut out = template
        .render(Value::from(ctx))
        .map_err(|e| TemplateError::Render(detail(&e)))?;
    if inputs.continue_final_message {
        let tag = CONTINUE_TAG.trim_end();
        let Some(at) = out.rfind(tag) else {
            return Err(TemplateError::Request(
                "`continue_final_message` is set but the template does not render the final message's content; \
                 send `continue_final_message: false`"
                    .into(),
            ));
        };
        if out[at..].starts_with(CONTINUE_TAG) {
            out.truncate(at);
        } else {
            // The template trimmed the message's trailing space, and the tag's with it.
            out.truncate(at);
            out.truncate(out.trim_end().len());
        }
    }
    Ok(out)
}

/// The last message with transformers' tag after its text content.
fn with_continue_tag(message: &Value) -> Result<Value, TemplateError> {
    let mut fields = map_entries(message).ok_or_else(|| {
        TemplateError::Request("`continue_final_message`: the last message is not an object".into())
    })?;
    let content = fields.iter_mut().find(|(k, _)| k.as_str() == Some("content"));
    match content {
        Some((_, v)) if v.kind() == ValueKind::String => {
            *v = Value::from(format!("{}{CONTINUE_TAG}", v.as_str().unwrap_or_default()));
        }
        _ => {
            return Err(TemplateError::Request(
                "`continue_final_message` is set but the last message has no text content to continue".into(),
            ))
        }
    }
    Ok(Value::from(
        fields.into_iter().collect::<IndexMap<Value, Value>>(),
    ))
}

/// A JSON value as a template reads it (maps in the JSON value's key order).
pub fn from_json(v: &serde_json::Value) -> Value {
    Value::from(minijinja::value::Serde(v))
}

/// A map's entries in order; none for a value that is not a map.
pub fn map_entries(v: &Value) -> Option<Vec<(Value, Value)>> {
    if v.kind() != ValueKind::Map {
        return None;
    }
    let keys = v.try_iter().ok()?;
    Some(
        keys.map(|k| {
            let item = v.get_item(&k).unwrap_or(Value::UNDEFINED);
            (k, item)
        })
        .collect(),
    )
}

/// `value` with every string (map keys included) passed through `f`, maps in their order.
pub fn map_strings(v: &Value, f: &mut dyn FnMut(&str) -> String) -> Value {
    match v.kind() {
        ValueKind::String => Value::from(f(v.as_str().unwrap_or_default())),
        ValueKind::Seq => {
            let items: Vec<Value> = v
                .try_iter()
                .map(|it| it.map(|x| map_strings(&x, f)).collect())
                .unwrap_or_default();
            Value::from(items)
        }
        ValueKind::Map => {
            let entries = map_entries(v).unwrap_or_default();
            Value::from(
                entries
                    .into_iter()
                    .map(|(k, x)| (map_strings(&k, f), map_strings(&x, f)))
                    .collect::<IndexMap<Value, Value>>(),
            )
        }
        _ => v.clone(),
    }
}

/// An error with its cause and the template line it is at.
fn detail(e: &Error) -> String {
    let mut s = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        let _ = write!(s, ": {cause}");
        source = cause.source();
    }
    s
}

/// The environment transformers compiles templates in.
fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_syntax(
        SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .expect("the default delimiters are valid"),
    );
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_filter("tojson", tojson);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", |fmt: String| {
        strftime(&chrono::Local::now().naive_local(), &fmt)
    });
    env
}

/// `{% generation %}` blocks (transformers' AssistantTracker, which marks the assistant's
/// tokens for training) render their body: as an always-true `if`, whitespace control kept.
fn with_generation_blocks(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let body = inner.trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        let replaced = match body {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replaced {
            Some(r) => {
                let lead = &inner[..inner.find(body).unwrap_or(0)];
                let trail = &inner[inner.find(body).map_or(inner.len(), |i| i + body.len())..];
                let _ = write!(out, "{{%{lead}{r}{trail}%}}");
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// Python's `datetime.strftime` for the directives chrono shares with it.
fn strftime(now: &chrono::NaiveDateTime, fmt: &str) -> Result<String, Error> {
    let mut s = String::new();
    write!(s, "{}", now.format(fmt)).map_err(|_| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: `{fmt}` is not a format this server reads"),
        )
    })?;
    Ok(s)
}

/// transformers' `tojson`: Python's `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<String, Error> {
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let indent = match kwargs.get::<Option<Value>>("indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or_default().to_string()),
        Some(v) => {
            let n = i64::try_from(v)?;
            Some(" ".repeat(n.max(0) as usize))
        }
    };
    let (item_sep, key_sep) = match kwargs.get::<Option<Value>>("separators")? {
        Some(v) if !v.is_none() => {
            let parts: Vec<String> = v
                .try_iter()?
                .map(|p| p.as_str().map(str::to_owned))
                .collect::<Option<_>>()
                .ok_or_else(|| {
                    Error::new(ErrorKind::InvalidOperation, "tojson: separators are two strings")
                })?;
            match <[String; 2]>::try_from(parts) {
                Ok([a, b]) => (a, b),
                Err(_) => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators are two strings",
                    ))
                }
            }
        }
        // Python's defaults: a space after the comma only without an indent.
        _ if indent.is_some() => (",".into(), ": ".into()),
        _ => (", ".into(), ": ".into()),
    };
    kwargs.assert_all_used()?;
    let mut w = PyJson {
        out: String::new(),
        ensure_ascii,
        sort_keys,
        indent,
        item_sep,
        key_sep,
    };
    w.value(value, 0)?;
    Ok(w.out)
}

/// A writer of Python's `json.dumps` output.
struct PyJson {
    out: String,
    ensure_ascii: bool,
    sort_keys: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
}

impl PyJson {
    fn newline(&mut self, depth: usize) {
        if let Some(ind) = &self.indent {
            self.out.push('\n');
            for _ in 0..depth {
                self.out.push_str(ind);
            }
        }
    }

    fn value(&mut self, v: &Value, depth: usize) -> Result<(), Error> {
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => self.out.push_str("null"),
            ValueKind::Bool => self.out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number if v.is_integer() => {
                let _ = write!(self.out, "{v}");
            }
            ValueKind::Number => {
                let f = f64::try_from(v.clone())?;
                self.out.push_str(&py_float(f));
            }
            ValueKind::String => self.string(v.as_str().unwrap_or_default()),
            ValueKind::Map => {
                let mut entries = map_entries(v).unwrap_or_default();
                if entries.is_empty() {
                    self.out.push_str("{}");
                    return Ok(());
                }
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(&b.0));
                }
                self.out.push('{');
                for (i, (k, x)) in entries.iter().enumerate() {
                    if i > 0 {
                        let sep = self.item_sep.clone();
                        self.out.push_str(&sep);
                    }
                    self.newline(depth + 1);
                    match k.as_str() {
                        Some(s) => self.string(s),
                        // Python writes other keys as their JSON text in a string.
                        None => {
                            let mut inner = PyJson {
                                out: String::new(),
                                ensure_ascii: self.ensure_ascii,
                                sort_keys: false,
                                indent: None,
                                item_sep: String::new(),
                                key_sep: String::new(),
                            };
                            inner.value(k, 0)?;
                            self.string(&inner.out);
                        }
                    }
                    let sep = self.key_sep.clone();
                    self.out.push_str(&sep);
                    self.value(x, depth + 1)?;
                }
                self.newline(depth);
                self.out.push('}');
            }
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                if items.is_empty() {
                    self.out.push_str("[]");
                    return Ok(());
                }
                self.out.push('[');
                for (i, x) in items.iter().enumerate() {
                    if i > 0 {
                        let sep = self.item_sep.clone();
                        self.out.push_str(&sep);
                    }
                    self.newline(depth + 1);
                    self.value(x, depth + 1)?;
                }
                self.newline(depth);
                self.out.push(']');
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: a {} is not JSON serializable", v.kind()),
                ))
            }
        }
        Ok(())
    }

    fn string(&mut self, s: &str) {
        self.out.push('"');
        for c in s.chars() {
            match c {
                '"' => self.out.push_str("\\\""),
                '\\' => self.out.push_str("\\\\"),
                '\n' => self.out.push_str("\\n"),
                '\r' => self.out.push_str("\\r"),
                '\t' => self.out.push_str("\\t"),
                '\u{8}' => self.out.push_str("\\b"),
                '\u{c}' => self.out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && (c as u32) > 0x7e) => {
                    let mut units = [0u16; 2];
                    for u in c.encode_utf16(&mut units) {
                        let _ = write!(self.out, "\\u{u:04x}");
                    }
                }
                c => self.out.push(c),
            }
        }
        self.out.push('"');
    }
}

/// Python's `repr` of a float (as `json.dumps` writes it): the shortest digits that read back,
/// positional from 1e-4 to 1e16, else `d.ddde+XX`.
fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    if f == 0.0 {
        return if f.is_sign_negative() {
            "-0.0".into()
        } else {
            "0.0".into()
        };
    }
    let sci = format!("{:e}", f.abs());
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let sign = if f < 0.0 { "-" } else { "" };
    if (-4..16).contains(&exp) {
        if exp >= 0 {
            let int_len = exp as usize + 1;
            let mut d = digits.clone();
            while d.len() < int_len {
                d.push('0');
            }
            let (int, frac) = d.split_at(int_len);
            let frac = if frac.is_empty() { "0" } else { frac };
            format!("{sign}{int}.{frac}")
        } else {
            format!("{sign}0.{}{digits}", "0".repeat((-exp - 1) as usize))
        }
    } else {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{first}{frac}e{esign}{:02}", exp.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, ctx: Value) -> String {
        let t = ChatTemplate::new(source);
        let env = t.env.as_ref().unwrap();
        env.get_template(DEFAULT_TEMPLATE).unwrap().render(ctx).unwrap()
    }

    #[test]
    fn tojson_writes_what_pythons_json_dumps_writes() {
        let v: Value = serde_json::from_str(
            r#"{"b": "<a & 'b'> é 😀", "a": [1, 2.5, 1e20, 0.0001, 1e-05, true, null], "c": {}}"#,
        )
        .unwrap();
        let out = render("{{ v | tojson }}", minijinja::context! { v => v.clone() });
        assert_eq!(
            out,
            r#"{"b": "<a & 'b'> é 😀", "a": [1, 2.5, 1e+20, 0.0001, 1e-05, true, null], "c": {}}"#
        );
        let out = render(
            "{{ v | tojson(indent=2, sort_keys=true, ensure_ascii=true) }}",
            minijinja::context! { v => v.clone() },
        );
        assert_eq!(
            out,
            "{\n  \"a\": [\n    1,\n    2.5,\n    1e+20,\n    0.0001,\n    1e-05,\n    true,\n    null\n  ],\n  \"b\": \"<a & 'b'> \\u00e9 \\ud83d\\ude00\",\n  \"c\": {}\n}"
        );
        let out = render(
            "{{ v | tojson(separators=(',', ':')) }}",
            minijinja::context! { v => serde_json::from_str::<Value>(r#"{"x": [1, 2]}"#).unwrap() },
        );
        assert_eq!(out, r#"{"x":[1,2]}"#);
    }

    #[test]
    fn generation_blocks_render_their_body_and_keep_whitespace_control() {
        assert_eq!(
            with_generation_blocks("a {%- generation %}b{% endgeneration -%} c {% if x %}"),
            "a {%- if true %}b{% endif -%} c {% if x %}"
        );
        assert_eq!(
            render("a {% generation %}b{% endgeneration %}", Value::from(())),
            "a b"
        );
    }

    #[test]
    fn raise_exception_fails_the_render_with_the_templates_message() {
        let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}");
        let e = t.render(&ChatInputs::default(), &[]).unwrap_err();
        assert!(e.to_string().contains("roles must alternate"), "{e}");
    }

    #[test]
    fn continue_final_message_ends_the_prompt_inside_the_last_message() {
        let t = ChatTemplate::new(
            "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>{% endfor %}",
        );
        let msg = |r: &str, c: &str| {
            serde_json::from_str::<Value>(&format!(r#"{{"role": "{r}", "content": "{c}"}}"#)).unwrap()
        };
        let inputs = ChatInputs {
            messages: vec![msg("user", "hi"), msg("assistant", "The answer is ")],
            continue_final_message: true,
            ..ChatInputs::default()
        };
        assert_eq!(
            t.render(&inputs, &[]).unwrap(),
            "<user>hi</user><assistant>The answer is"
        );
        let both = ChatInputs {
            add_generation_prompt: true,
            ..inputs
        };
        assert!(matches!(t.render(&both, &[]), Err(TemplateError::Request(_))));
    }

    #[test]
    fn a_named_list_picks_tool_use_with_tools_and_default_without() {
        let t = ChatTemplate::named(vec![
            ("default".into(), "D".into()),
            (
                "tool_use".into(),
                "T{% if tools %}{{ tools | length }}{% endif %}".into(),
            ),
        ]);
        assert_eq!(t.render(&ChatInputs::default(), &[]).unwrap(), "D");
        let tools = ChatInputs {
            tools: Some(Value::from(vec![Value::from(1)])),
            ..ChatInputs::default()
        };
        assert_eq!(t.render(&tools, &[]).unwrap(), "T1");
        let named = ChatInputs {
            template: Some("tool_use".into()),
            ..ChatInputs::default()
        };
        assert_eq!(t.render(&named, &[]).unwrap(), "T");
    }

    #[test]
    fn keywords_and_special_tokens_reach_the_template_and_keywords_win() {
        let t = ChatTemplate::new(
            "{{ bos_token }}{% if enable_thinking is defined and not enable_thinking %}no-think{% endif %}",
        );
        let specials = [("bos_token", "<s>".to_string())];
        let inputs = ChatInputs {
            kwargs: vec![("enable_thinking".into(), Value::from(false))],
            ..ChatInputs::default()
        };
        assert_eq!(t.render(&inputs, &specials).unwrap(), "<s>no-think");
        let inputs = ChatInputs {
            kwargs: vec![("bos_token".into(), Value::from("[B]"))],
            ..ChatInputs::default()
        };
        assert_eq!(t.render(&inputs, &specials).unwrap(), "[B]");
    }

    #[test]
    fn strftime_now_reads_the_given_time() {
        let t = ChatTemplate::new("{{ strftime_now('%d %b %Y') }}");
        let inputs = ChatInputs {
            now: chrono::NaiveDate::from_ymd_opt(2026, 7, 26).and_then(|d| d.and_hms_opt(0, 0, 0)),
            ..ChatInputs::default()
        };
        assert_eq!(t.render(&inputs, &[]).unwrap(), "26 Jul 2026");
    }

    #[test]
    fn a_template_that_does_not_compile_is_an_error_when_rendering_not_when_loading() {
        let t = ChatTemplate::new("{% if %}");
        assert!(matches!(t.check(), Err(TemplateError::Compile { .. })));
        assert!(t.render(&ChatInputs::default(), &[]).is_err());
    }
}
