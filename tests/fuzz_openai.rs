//! Property/fuzz test over the OpenAI request bodies the worker accepts from anyone who can
//! reach its port (issue 22): hostile JSON for `/v1/completions` and `/v1/chat/completions`
//! (every field of the wrong type, huge and negative numbers, long strings, nested arrays),
//! the same bodies with bytes flipped or cut, and raw bytes. Each case goes through the real
//! router and serving loop over loopback HTTP, on a small dummy model on the CPU with a
//! 64-token context, so that the requests that are valid generate too.
//!
//! Property: every answer is a 2xx or a 4xx with an OpenAI error body, within a few seconds;
//! never a 5xx, a dropped connection or a panic; afterwards the server still answers a valid
//! request. Cases: `KVFLEET_FUZZ_CASES` (default 500, a few seconds in a debug build; the
//! recorded run uses 100,000 in a release build, bench/RESULTS.md). `KVFLEET_FUZZ_TRACE=1` prints
//! each answer's status and the start of its body, to see which checks the cases reach.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use kvfleet::serving::metrics::Metrics;
use kvfleet::serving::openai;
use kvfleet::serving::serve::{loaded, start_cpu, CpuLimits};
use kvfleet_engine::model::llama::{Llama, LlamaConfig};
use kvfleet_engine::model::tokenizer::Tokenizer;
use proptest::prelude::*;
use serde_json::{json, Map, Value};

/// An answer slower than this is a failure: a 64-token context on a tiny model takes
/// milliseconds; generous for a debug build on a loaded 2-core machine.
const SLOW: Duration = Duration::from_secs(10);

fn cases() -> u32 {
    std::env::var("KVFLEET_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(500)
}

/// The 256 byte tokens (GPT-2's byte-to-character mapping: printable Latin-1 as itself, the
/// rest shifted past 255) and ChatML's three control tokens, so that chat requests render.
fn chatml_bytes() -> Tokenizer {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut shifted = 0;
    let mut tokens: Vec<String> = (0..256u32)
        .map(|b| {
            let c = if printable(b) {
                b
            } else {
                shifted += 1;
                255 + shifted
            };
            char::from_u32(c).expect("a valid char").to_string()
        })
        .collect();
    let mut types = vec![1u64; 256];
    for special in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] {
        tokens.push(special.into());
        types.push(3);
    }
    Tokenizer::new(
        tokens,
        &types,
        &[],
        "gpt2",
        Some("<|im_start|>system\nfuzz<|im_end|>"),
    )
    .expect("tokenizer")
}

/// The worker's router on a dummy 2-layer model (the byte tokens and ChatML's), served on a
/// port of its own runtime for the whole test binary; or, with `KVFLEET_FUZZ_PORT` set, a
/// `kvfleet worker` already listening on that loopback port (the GPU run in
/// `bench/RESULTS.md`: start it with `--served-model-name fuzz`, or every case is a 404).
fn port() -> u16 {
    static PORT: OnceLock<u16> = OnceLock::new();
    *PORT.get_or_init(|| {
        if let Some(p) = std::env::var("KVFLEET_FUZZ_PORT")
            .ok()
            .and_then(|p| p.parse().ok())
        {
            return p;
        }
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("tokio runtime");
            rt.block_on(async move {
                let mut cfg = LlamaConfig::llama(2, 64, 128, 4, 2, 259);
                cfg.context_len = 64;
                let model = Arc::new(Llama::dummy(cfg, 7).expect("dummy model"));
                let limits = CpuLimits {
                    max_num_seqs: 4,
                    max_num_batched_tokens: 64,
                    max_model_len: Some(64),
                    kv_tokens: 1024,
                    ..CpuLimits::default()
                };
                let metrics = Arc::new(Metrics::new().expect("metrics"));
                let served =
                    start_cpu(loaded(model, chatml_bytes(), "fuzz"), limits, metrics).expect("serving loop");
                let app = openai::router(Arc::new(served));
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
                tx.send(listener.local_addr().expect("addr").port())
                    .expect("send port");
                axum::serve(listener, app).await.expect("serve");
            })
        });
        rx.recv().expect("the server thread started")
    })
}

/// One request with `Connection: close`; returns the status and the body (chunked bodies
/// joined), or what went wrong at the transport level.
fn post(path: &str, body: &[u8]) -> Result<(u16, String), String> {
    let mut s = TcpStream::connect(("127.0.0.1", port())).map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(SLOW * 2)).map_err(|e| e.to_string())?;
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).map_err(|e| format!("write: {e}"))?;
    s.write_all(body).map_err(|e| format!("write: {e}"))?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).map_err(|e| format!("read: {e}"))?;
    let text = String::from_utf8_lossy(&raw).to_string();
    let (head, rest) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("no HTTP head in {} bytes", raw.len()))?;
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("no status in `{head}`"))?;
    Ok((status, rest.to_string()))
}

/// A JSON value of any type, sized to stay well under the body limit.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        prop_oneof![
            Just(-1e300),
            Just(1e300),
            Just(-0.0),
            Just(1e-300),
            -10.0f64..10.0
        ]
        .prop_map(|f| json!(f)),
        ".{0,40}".prop_map(Value::String),
        prop::collection::vec(any::<char>(), 0..300).prop_map(|c| Value::String(c.into_iter().collect())),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(".{0,8}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect::<Map<String, Value>>())),
        ]
    })
}

fn prompt() -> impl Strategy<Value = Value> {
    prop_oneof![
        6 => ".{0,60}".prop_map(Value::String),
        2 => prop::collection::vec(prop_oneof![20 => 0i64..256, 1 => Just(-1), 1 => Just(i64::MAX), 1 => Just(1 << 32)], 0..80)
            .prop_map(|v| json!(v)),
        1 => prop::collection::vec(".{0,10}", 0..4).prop_map(|v| json!(v)),
        1 => any_json(),
    ]
}

fn messages() -> impl Strategy<Value = Value> {
    let role = prop_oneof![
        4 => Just(json!("user")),
        2 => Just(json!("system")),
        2 => Just(json!("assistant")),
        1 => Just(json!("tool")),
        1 => ".{0,8}".prop_map(Value::String),
    ];
    let content = prop_oneof![
        8 => ".{0,60}".prop_map(Value::String),
        2 => prop::collection::vec((Just("text"), ".{0,20}").prop_map(|(t, s)| json!({"type": t, "text": s})), 0..3)
            .prop_map(Value::Array),
        1 => any_json(),
    ];
    prop_oneof![
        9 => prop::collection::vec((role, content).prop_map(|(r, c)| json!({"role": r, "content": c})), 0..4)
            .prop_map(Value::Array),
        1 => any_json(),
    ]
}

/// A value of the field `name`: mostly of its own type with hostile ranges (so that the
/// checks past parsing run), one time in ten of any type.
fn field(name: &'static str) -> BoxedStrategy<Value> {
    let typed: BoxedStrategy<Value> = match name {
        "max_tokens" | "max_completion_tokens" | "n" | "best_of" | "top_logprobs" | "top_k" => prop_oneof![
            6 => -2i64..80,
            1 => prop_oneof![Just(i64::MIN), Just(i64::MAX), Just(1i64 << 40), Just(u32::MAX as i64)],
        ]
        .prop_map(|n| json!(n))
        .boxed(),
        "seed" => prop_oneof![
            any::<u64>().prop_map(|n| json!(n)),
            any::<i64>().prop_map(|n| json!(n))
        ]
        .boxed(),
        "temperature" | "top_p" | "presence_penalty" | "frequency_penalty" => prop_oneof![
            6 => -0.5f64..2.5,
            1 => prop_oneof![Just(0.0), Just(1.0), Just(1e300), Just(-1e300), Just(1e-300)],
        ]
        .prop_map(|f| json!(f))
        .boxed(),
        "stream" | "echo" | "ignore_eos" => any::<bool>().prop_map(Value::Bool).boxed(),
        "logprobs" => prop_oneof![
            any::<bool>().prop_map(Value::Bool),
            (0i64..30).prop_map(|n| json!(n))
        ]
        .boxed(),
        "stream_options" => any::<bool>().prop_map(|b| json!({"include_usage": b})).boxed(),
        "stop" => prop_oneof![
            ".{0,6}".prop_map(Value::String),
            prop::collection::vec(".{0,6}", 0..7).prop_map(|v| json!(v)),
        ]
        .boxed(),
        "logit_bias" => prop_oneof![
            Just(json!({})),
            (0u32..300, -100i64..100).prop_map(|(t, b)| json!({t.to_string(): b}))
        ]
        .boxed(),
        "response_format" => prop_oneof![
            Just(json!({"type": "text"})),
            Just(json!({"type": "json_object"})),
            Just(Value::Null)
        ]
        .boxed(),
        "tools" => prop_oneof![
            Just(json!([])),
            Just(json!([{"type": "function", "function": {"name": "f"}}]))
        ]
        .boxed(),
        "model" => prop_oneof![3 => Just(json!("fuzz")), 1 => ".{0,12}".prop_map(Value::String)].boxed(),
        _ => ".{0,20}".prop_map(Value::String).boxed(),
    };
    prop_oneof![9 => typed, 1 => any_json()].boxed()
}

/// A request body for `chat`: the fields the OpenAI API defines, each present or not.
fn body(chat: bool) -> impl Strategy<Value = Value> {
    const FIELDS: [&str; 23] = [
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "n",
        "best_of",
        "top_logprobs",
        "presence_penalty",
        "frequency_penalty",
        "stream",
        "stream_options",
        "stop",
        "logprobs",
        "echo",
        "ignore_eos",
        "logit_bias",
        "response_format",
        "tools",
        "suffix",
        "model",
        "user",
    ];
    let first = if chat {
        messages().boxed()
    } else {
        prompt().boxed()
    };
    // The parameters the worker refuses by name are rarer, so that most bodies get past them.
    let refused = [
        "n",
        "best_of",
        "top_logprobs",
        "presence_penalty",
        "frequency_penalty",
        "logprobs",
        "echo",
        "logit_bias",
        "response_format",
        "tools",
        "suffix",
    ];
    let fields: Vec<_> = FIELDS
        .iter()
        .map(|f| prop::option::weighted(if refused.contains(f) { 0.03 } else { 0.2 }, field(f)))
        .collect();
    (prop::option::weighted(0.97, first), fields).prop_map(move |(first, values)| {
        let mut o = Map::new();
        if let Some(v) = first {
            o.insert(if chat { "messages" } else { "prompt" }.into(), v);
        }
        for (k, v) in FIELDS.iter().zip(values) {
            if let Some(v) = v {
                o.insert((*k).into(), v);
            }
        }
        Value::Object(o)
    })
}

/// What a case sends: a body, the same with bytes flipped or cut, or raw bytes.
fn request() -> impl Strategy<Value = (bool, Vec<u8>)> {
    let flips = prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6);
    prop_oneof![
        6 => (any::<bool>(), any::<bool>()).prop_flat_map(|(chat, _)| body(chat).prop_map(move |b| (chat, b.to_string().into_bytes()))),
        2 => (any::<bool>()).prop_flat_map(move |chat| (Just(chat), body(chat), flips.clone(), any::<prop::sample::Index>()))
            .prop_map(|(chat, b, flips, cut)| {
                let mut bytes = b.to_string().into_bytes();
                for (i, v) in flips {
                    let n = bytes.len();
                    bytes[i.index(n)] = v;
                }
                let keep = cut.index(bytes.len() + 1);
                bytes.truncate(keep.max(bytes.len() / 2));
                (chat, bytes)
            }),
        1 => (any::<bool>(), prop::collection::vec(any::<u8>(), 0..200)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(),
        failure_persistence: None,
        max_shrink_iters: 500,
        ..ProptestConfig::default()
    })]

    #[test]
    fn hostile_openai_bodies_get_a_2xx_or_a_named_4xx_and_never_a_5xx((chat, body) in request()) {
        let path = if chat { "/v1/chat/completions" } else { "/v1/completions" };
        let t = Instant::now();
        let (status, text) = post(path, &body).map_err(|e| TestCaseError::fail(format!(
            "{path}: {e} for body {}", String::from_utf8_lossy(&body))))?;
        let took = t.elapsed();
        if std::env::var_os("KVFLEET_FUZZ_TRACE").is_some() { eprintln!("STATUS {status} {}", text.chars().take(90).collect::<String>().replace("\n", " ")); }
        prop_assert!(took < SLOW, "{path} took {took:?} for {}", String::from_utf8_lossy(&body));
        prop_assert!(
            (200..300).contains(&status) || (400..500).contains(&status),
            "{path} answered {status} `{text}` to {}", String::from_utf8_lossy(&body)
        );
        if (400..500).contains(&status) {
            let v: Value = serde_json::from_str(&text).map_err(|e| TestCaseError::fail(format!(
                "{status} body is not JSON ({e}): {text}")))?;
            prop_assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{text}");
        }
    }
}

/// Runs after (or beside) the fuzz cases in the same binary: the server still serves.
#[test]
fn a_valid_request_is_served_after_hostile_ones() {
    for garbage in [&b"{"[..], b"\xff\xfe", b"{\"prompt\": [-1]}", b"[]"] {
        let (status, _) = post("/v1/completions", garbage).expect("transport");
        assert!((400..500).contains(&status), "{status} for {garbage:?}");
    }
    let body = json!({"prompt": "hello", "max_tokens": 4, "temperature": 0}).to_string();
    let (status, text) = post("/v1/completions", body.as_bytes()).expect("transport");
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 4, "{text}");
}

/// A stream carries one chunk per generated token: text held back to the end (here the bytes
/// of a character the last token left split, which the byte tokens of this dummy model make
/// common) goes with the finish chunk, not in a chunk of its own that clients would count as
/// one more token (`bench/overload.py` on a GPU worker saw 33 chunks for 32 tokens). The
/// streamed text still equals the text of the same request unstreamed.
#[test]
fn a_stream_has_one_text_chunk_per_token_and_the_held_back_tail_rides_on_the_finish() {
    const MAX: usize = 12;
    let mut tails = 0;
    for i in 0..40u32 {
        let prompt: Vec<u32> = (0..6).map(|k| (i * 37 + k * 11) % 256).collect();
        let req = |stream: bool| {
            json!({"model": "fuzz", "prompt": prompt, "max_tokens": MAX, "temperature": 0,
                   "ignore_eos": true, "stream": stream})
            .to_string()
        };
        let (status, body) = post("/v1/completions", req(true).as_bytes()).expect("transport");
        assert_eq!(status, 200, "{body}");
        let chunks: Vec<Value> = body
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| d.starts_with('{'))
            .map(|d| serde_json::from_str(d).expect("a JSON chunk"))
            .collect();
        let text_chunks = chunks
            .iter()
            .filter(|c| c["choices"][0]["finish_reason"].is_null() && c["choices"][0]["text"].is_string())
            .count();
        assert_eq!(text_chunks, MAX, "prompt {prompt:?}: {body}");
        let last = chunks.last().expect("a finish chunk");
        assert_eq!(last["choices"][0]["finish_reason"], "length", "{body}");
        if last["choices"][0]["text"].as_str().is_some_and(|t| !t.is_empty()) {
            tails += 1;
        }
        let streamed: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["text"].as_str())
            .collect();
        let (status, whole) = post("/v1/completions", req(false).as_bytes()).expect("transport");
        assert_eq!(status, 200, "{whole}");
        let whole: Value = serde_json::from_str(&whole).unwrap();
        assert_eq!(
            whole["choices"][0]["text"],
            streamed.as_str(),
            "prompt {prompt:?}"
        );
    }
    assert!(
        tails > 0,
        "no stream ended with held-back text: the case is not exercised"
    );
}
