//! 4-bit checkpoints (issue 56) on the CPU: SmolLM2-135M-Instruct written in each format by
//! `tests/fixtures/int4/smollm2.py` (round-to-nearest), loaded by the engine's loader with its
//! weights packed, against the model as the GGUF holds it (its weights dequantized to f32).
//!
//! `w4_smollm2_accuracy_figures` prints what docs/model.md records ("4-bit checkpoints"):
//!
//! ```text
//! /work/torchenv/bin/python tests/fixtures/int4/smollm2.py --out /tmp/smollm2-w4
//! KVFLEET_W4_SMOLLM2_DIR=/tmp/smollm2-w4 cargo test --test model_w4 -- --ignored --nocapture
//! ```

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use kvfleet_engine::engine::capacity::{pool_layout, PoolParams, PoolSize};
use kvfleet_engine::engine::cpu::CpuBackend;
use kvfleet_engine::engine::direct::DirectPlanner;
use kvfleet_engine::engine::{KvDtype, StepPlan};
use kvfleet_engine::model::forward::{step_direct, CpuForward, Forward};
use kvfleet_engine::model::llama::SeqChunk;

use kvfleet_engine::model::gguf::Gguf;
use kvfleet_engine::model::hf;
use kvfleet_engine::model::linear::LinearQuantization;
use kvfleet_engine::model::llama::Llama;
use kvfleet_engine::model::sampling::argmax;
use kvfleet_engine::model::tokenizer::{ChatMessage, Tokenizer};

mod worker_support;

const FORMATS: &[&str] = &["awq-g64", "gptq-g64-sym", "ct-g64-sym", "ct-channel-sym"];

fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v)) as f64;
    let lse = row.iter().map(|v| (*v as f64 - max).exp()).sum::<f64>().ln() + max;
    row.iter().map(|v| *v as f64 - lse).collect()
}

/// Mean and largest KL(p_a || p_b) over the positions of `tokens`, the largest |logit
/// difference|, and how many positions rank the same token first.
fn divergence(a: &Llama, b: &Llama, tokens: &[u32]) -> (usize, f64, f64, f32, usize) {
    let rows = |m: &Llama| m.prompt_logits(tokens, |_, row| row.to_vec()).unwrap();
    let (ra, rb) = (rows(a), rows(b));
    let (mut mean, mut max_kl, mut max_logit, mut top1) = (0f64, 0f64, 0f32, 0);
    for (p, q) in ra.iter().zip(&rb) {
        let (lp, lq) = (log_softmax(p), log_softmax(q));
        let kl: f64 = lp.iter().zip(&lq).map(|(x, y)| x.exp() * (x - y)).sum();
        mean += kl / ra.len() as f64;
        max_kl = max_kl.max(kl);
        for (x, y) in p.iter().zip(q) {
            max_logit = max_logit.max((x - y).abs());
        }
        top1 += usize::from(argmax(p) == argmax(q));
    }
    (ra.len(), mean, max_kl, max_logit, top1)
}

/// Teacher-forced greedy agreement: how many of `want` (the reference's greedy continuation of
/// `prompt`) `m` ranks first before its first departure (= the greedy tokens the two share).
fn shared_greedy(m: &Llama, prompt: &[u32], want: &[u32]) -> usize {
    let all: Vec<u32> = prompt.iter().chain(want).copied().collect();
    m.prompt_logits(&all, |i, row| (i + 1 >= prompt.len()).then(|| argmax(row)))
        .unwrap()
        .into_iter()
        .flatten()
        .zip(want)
        .take_while(|(top, w)| top == *w)
        .count()
}

/// Seconds per decode step (one token) on the engine's CPU backend (paged f16 KV) after a
/// prefill of `prompt`, over `n` greedy steps.
fn decode_seconds(m: Arc<Llama>, prompt: &[u32], n: usize) -> f64 {
    let pools = pool_layout(
        &m.config.kv_layers(m.config.n_kv_heads).unwrap(),
        0,
        &PoolParams::pages(KvDtype::F16, 16),
        PoolSize::Pages(64),
    )
    .unwrap();
    let mut f = CpuForward::new(m, CpuBackend::new(pools).unwrap()).unwrap();
    let mut planner = DirectPlanner::new(16, &f.kv_config().groups);
    let mut plan = StepPlan::default();
    let c = [SeqChunk {
        seq: 1,
        start_pos: 0,
        tokens: prompt,
        logits: 1,
    }];
    let mut logits = step_direct(&mut f, &mut planner, &c, &mut plan).unwrap();
    let mut toks = prompt.to_vec();
    let t0 = Instant::now();
    for _ in 0..n {
        toks.push(argmax(&logits));
        let c = [SeqChunk {
            seq: 1,
            start_pos: toks.len() - 1,
            tokens: &toks[toks.len() - 1..],
            logits: 1,
        }];
        logits = step_direct(&mut f, &mut planner, &c, &mut plan).unwrap();
    }
    t0.elapsed().as_secs_f64() / n as f64
}

fn chat_ids(t: &Tokenizer, prompt: &str) -> Vec<u32> {
    let text = t
        .apply_chat_template(&[ChatMessage {
            role: "user".into(),
            content: prompt.into(),
        }])
        .unwrap();
    t.encode(&text, true)
}

/// Prints the figures of docs/model.md "4-bit checkpoints".
#[test]
#[ignore = "measures the 4-bit accuracy figures of docs/model.md; needs smollm2.py's checkpoints"]
fn w4_smollm2_accuracy_figures() {
    let dir = PathBuf::from(
        std::env::var_os("KVFLEET_W4_SMOLLM2_DIR").expect("set KVFLEET_W4_SMOLLM2_DIR to smollm2.py's --out"),
    );
    let g = Gguf::open(&worker_support::smollm2()).unwrap();
    let plain = Llama::from_gguf(&g).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("tests/fixtures/model/english.txt")).unwrap();
    let text_ids = tok.encode(&text, true);
    let suite: Vec<serde_json::Value> = serde_json::from_str(
        &std::fs::read_to_string(root.join("tests/fixtures/model/smollm2-greedy.json")).unwrap(),
    )
    .unwrap();

    // The conversion itself: the f32 checkpoint is the GGUF's model in Hugging Face's layout.
    let f32_model = hf::load_model(&dir.join("f32")).unwrap();
    let (n, mean, _, max_logit, top1) = divergence(&plain, &f32_model, &text_ids);
    println!("f32 checkpoint vs GGUF: {n} positions, mean KL {mean:.2e}, max |logit| diff {max_logit:.2e}, top-1 {top1}/{n}");
    drop(f32_model);

    println!("| format | linear weights held | mean KL | largest KL | largest \\|logit\\| error | same top-1 | greedy tokens shared |");
    println!("|---|---|---|---|---|---|---|");
    for name in FORMATS {
        let m = hf::load_model(&dir.join(name)).unwrap();
        assert!(matches!(m.quantization(), LinearQuantization::W4A16(_)), "{name}");
        let (n, mean, max_kl, max_logit, top1) = divergence(&plain, &m, &text_ids);
        let (mut shared, mut total) = (0, 0);
        for r in &suite {
            let ids = chat_ids(&tok, r["prompt"].as_str().unwrap());
            let want: Vec<u32> = serde_json::from_value(r["output_ids"].clone()).unwrap();
            shared += shared_greedy(&m, &ids, &want);
            total += want.len();
        }
        let dense_model = m.dequantized();
        let (packed, dense) = (m.linear_weight_bytes(), dense_model.linear_weight_bytes());
        // Prefill time of the text, packed against f32 weights (the best of three each).
        let time = |m: &Llama| {
            (0..3)
                .map(|_| {
                    let t0 = Instant::now();
                    m.prompt_logits(&text_ids, |_, _| ()).unwrap();
                    t0.elapsed().as_secs_f64()
                })
                .fold(f64::INFINITY, f64::min)
        };
        let (tp, tf) = (time(&m), time(&dense_model));
        let prompt = chat_ids(&tok, "Write a haiku about the sea.");
        let dp = decode_seconds(Arc::new(m.clone()), &prompt, 16);
        let df = decode_seconds(Arc::new(dense_model), &prompt, 16);
        eprintln!(
            "{name}: prefill of {} tokens {tp:.2} s packed, {tf:.2} s with f32 weights; decode {:.1} ms a token packed, {:.1} ms with f32 weights",
            text_ids.len(),
            dp * 1e3,
            df * 1e3
        );
        println!(
            "| {name} | {:.1} MB ({:.1}% of f32) | {mean:.3} nats | {max_kl:.2} | {max_logit:.2} | {top1} of {n} ({:.0}%) | {shared} of {total} |",
            packed as f64 / 1e6,
            100.0 * packed as f64 / dense as f64,
            100.0 * top1 as f64 / n as f64,
        );
    }
}
