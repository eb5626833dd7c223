//! FP8 weights (issue 32) on the CPU: the model with FP8 W8A8 linear layers
//! ([`Llama::quantize_fp8`]: per-channel weight scales, per-token activation scales) against the
//! same model as loaded. The GGUF files are Q4 checkpoints, so "as loaded" means their weights
//! dequantized to f32; FP8 is applied on top of those.
//!
//! `fp8_smollm2_logits_stay_close_and_greedy_tokens_agree` runs in CI (debug build, SmolLM2).
//! `fp8_accuracy_figures` measures what docs/model.md records, for SmolLM2 and Gemma 3:
//! `cargo test --test model_fp8 -- --ignored --nocapture fp8_accuracy_figures` (about 15 min
//! in a debug build on two cores, most of it Gemma 3's greedy steps; `--release` is faster).
//! Model files: env `KVFLEET_SMOLLM2_GGUF` / `KVFLEET_GEMMA3_GGUF`, else `.tools/models/`
//! (installed by .ci/install-tools).

use std::path::PathBuf;
use std::sync::Arc;

use kvfleet_engine::engine::capacity::{pool_layout, PoolParams, PoolSize};
use kvfleet_engine::engine::cpu::CpuBackend;
use kvfleet_engine::engine::direct::DirectPlanner;
use kvfleet_engine::engine::{KvDtype, StepPlan};
use kvfleet_engine::model::forward::{step_direct, CpuForward, Forward};
use kvfleet_engine::model::gguf::Gguf;
use kvfleet_engine::model::linear::LinearQuantization;
use kvfleet_engine::model::llama::{Llama, SeqChunk};
use kvfleet_engine::model::sampling::argmax;
use kvfleet_engine::model::tokenizer::{ChatMessage, Tokenizer};

fn model_path(env: &str, file: &str) -> PathBuf {
    if let Some(p) = std::env::var_os(env) {
        return PathBuf::from(p);
    }
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join(".tools/models")
        .join(file);
    assert!(
        p.exists(),
        "{file} not found at {} and {env} is unset; install it with .ci/install-tools",
        p.display()
    );
    p
}

/// The model as loaded, the same model with FP8 linear layers, and the tokenizer.
fn load_pair(env: &str, file: &str) -> (Arc<Llama>, Arc<Llama>, Tokenizer) {
    let g = Gguf::open(&model_path(env, file)).expect("open the GGUF");
    let plain = Llama::from_gguf(&g).expect("load the weights");
    let mut fp8 = plain.clone();
    fp8.quantize_fp8();
    assert_eq!(fp8.quantization(), LinearQuantization::Fp8);
    assert_eq!(plain.quantization(), LinearQuantization::None);
    let tok = Tokenizer::from_gguf(&g).expect("tokenizer from GGUF");
    (Arc::new(plain), Arc::new(fp8), tok)
}

fn smollm2() -> (Arc<Llama>, Arc<Llama>, Tokenizer) {
    load_pair("KVFLEET_SMOLLM2_GGUF", "SmolLM2-135M-Instruct.Q4_1.gguf")
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

/// Log-probabilities of a logit row, in f64.
fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v)) as f64;
    let lse = row.iter().map(|v| (*v as f64 - max).exp()).sum::<f64>().ln() + max;
    row.iter().map(|v| *v as f64 - lse).collect()
}

/// How far the FP8 model's next-token distributions are from the plain model's over every
/// position of a text.
#[derive(Debug)]
struct Divergence {
    positions: usize,
    /// Mean over positions of KL(p_plain || p_fp8), in nats.
    mean_kl: f64,
    max_kl: f64,
    /// Largest |logit_plain - logit_fp8| over every position and vocabulary entry.
    max_abs_logit: f32,
    /// Largest logit magnitude of the plain model (the scale the error is read against).
    max_logit: f32,
    /// Positions where both models rank the same token first.
    top1_agree: usize,
}

fn divergence(plain: &Llama, fp8: &Llama, tokens: &[u32]) -> Divergence {
    let rows = |m: &Llama| m.prompt_logits(tokens, |_, row| row.to_vec()).unwrap();
    let (a, b) = (rows(plain), rows(fp8));
    let mut d = Divergence {
        positions: a.len(),
        mean_kl: 0.0,
        max_kl: 0.0,
        max_abs_logit: 0.0,
        max_logit: 0.0,
        top1_agree: 0,
    };
    for (p, q) in a.iter().zip(&b) {
        let (lp, lq) = (log_softmax(p), log_softmax(q));
        let kl: f64 = lp.iter().zip(&lq).map(|(x, y)| x.exp() * (x - y)).sum();
        d.mean_kl += kl / a.len() as f64;
        d.max_kl = d.max_kl.max(kl);
        for (x, y) in p.iter().zip(q) {
            d.max_abs_logit = d.max_abs_logit.max((x - y).abs());
            d.max_logit = d.max_logit.max(x.abs());
        }
        d.top1_agree += usize::from(argmax(p) == argmax(q));
    }
    d
}

/// Teacher-forced greedy agreement: `want` is the plain model's greedy continuation of
/// `prompt`; `m` runs `prompt + want` in one pass and, at each generated position, either
/// ranks the same token first or not. Its greedy output equals `want` up to the first position
/// where it does not, so the number of leading matches is exactly how many greedy tokens the
/// two share. Also returns `m`'s top-two margin per position.
fn choices(m: &Llama, prompt: &[u32], want: &[u32]) -> (Vec<bool>, Vec<f32>) {
    let all: Vec<u32> = prompt.iter().chain(want).copied().collect();
    let rows = m
        .prompt_logits(&all, |i, row| {
            (i + 1 >= prompt.len()).then(|| (argmax(row), margin(row)))
        })
        .unwrap();
    rows.into_iter()
        .flatten()
        .zip(want)
        .map(|((top, m), w)| (top == *w, m))
        .unzip()
}

/// The gap between the two largest logits.
fn margin(row: &[f32]) -> f32 {
    let (mut first, mut second) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &v in row {
        if v > first {
            second = first;
            first = v;
        } else if v > second {
            second = v;
        }
    }
    first - second
}

/// How many leading tokens two generations share.
fn agreement(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
/// A prompt of the SmolLM2 suite and the plain model's greedy continuation, recorded with
/// the f32 cache (tests/fixtures/model/smollm2-greedy.json, written by tests/model_smollm2.rs).
struct Recorded {
    prompt: String,
    output_ids: Vec<u32>,
}

fn smollm2_greedy() -> Vec<Recorded> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/model/smollm2-greedy.json");
    let rows: Vec<serde_json::Value> = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    rows.iter()
        .map(|r| Recorded {
            prompt: r["prompt"].as_str().unwrap().to_string(),
            output_ids: serde_json::from_value(r["output_ids"].clone()).unwrap(),
        })
        .collect()
}

/// The CI case: a fixture prompt and how many of its greedy tokens must agree.
const CI_CASE: usize = 0;
const CI_STEPS: usize = 7;

/// Bounds on the CI sequence (prompt and 7 greedy tokens, 43 scored positions): the largest
/// `|logit_plain - logit_fp8|` over every position and vocabulary entry, and the mean
/// KL(p_plain || p_fp8). Measured 9.53 and 0.098 (the logits reach 37.6). FP8 rounding is
/// discontinuous: another summation order (FMA or not, SIMD width) flips some e4m3 roundings and
/// moves both figures, so the bounds leave 1.5x and 2x; a broken quantization (a lost scale, a
/// skipped dequantization) moves the logits by tens or hundreds.
const MAX_LOGIT_ERROR: f32 = 15.0;
const MAX_MEAN_KL: f64 = 0.2;

#[test]
fn fp8_smollm2_logits_stay_close_and_greedy_tokens_agree() {
    let (plain, fp8, tok) = smollm2();
    let case = &smollm2_greedy()[CI_CASE];
    let prompt = chat_ids(&tok, &case.prompt);
    let want = &case.output_ids[..CI_STEPS];
    let all: Vec<u32> = prompt.iter().chain(want).copied().collect();
    let d = divergence(&plain, &fp8, &all);
    eprintln!("SmolLM2, {} tokens: {d:?}", all.len());
    assert_eq!(d.positions, all.len() - 1);
    assert!(
        d.max_abs_logit > 0.0,
        "FP8 changed no logit: the quantization is a no-op"
    );
    assert!(
        d.max_abs_logit <= MAX_LOGIT_ERROR,
        "FP8 moves a logit by {} (bound {MAX_LOGIT_ERROR})",
        d.max_abs_logit
    );
    assert!(
        d.mean_kl <= MAX_MEAN_KL,
        "mean KL {} (bound {MAX_MEAN_KL})",
        d.mean_kl
    );
    let (plain_same, _) = choices(&plain, &prompt, want);
    assert!(
        plain_same.iter().all(|s| *s),
        "the fixture is the plain model's greedy output: {plain_same:?}"
    );
    let (same, margins) = choices(&fp8, &prompt, want);
    eprintln!(
        "FP8 on {:?}: {same:?}, margins {margins:?}",
        tok.decode(want, false)
    );
    assert!(
        same.iter().all(|s| *s),
        "FP8 greedy departs from the plain model within {CI_STEPS} tokens: {same:?}"
    );
}

/// Greedy ids of `prompt` on the engine's CPU backend (paged f16 KV, the local layers'
/// window), prefill in chunks of 256, then `n` steps: what the Gemma 3 suite runs.
fn engine_greedy(m: Arc<Llama>, prompt: &[u32], n: usize) -> Vec<u32> {
    let pools = pool_layout(
        &m.config.kv_layers(m.config.n_kv_heads).unwrap(),
        0,
        &PoolParams::pages(KvDtype::F16, 16),
        PoolSize::Pages(128),
    )
    .unwrap();
    let mut f = CpuForward::new(m, CpuBackend::new(pools).unwrap()).unwrap();
    let mut planner = DirectPlanner::new(16, &f.kv_config().groups);
    let mut plan = StepPlan::default();
    let mut toks = prompt.to_vec();
    let mut logits = Vec::new();
    for start in (0..prompt.len()).step_by(256) {
        let end = (start + 256).min(prompt.len());
        let c = [SeqChunk {
            seq: 1,
            start_pos: start,
            tokens: &prompt[start..end],
            logits: usize::from(end == prompt.len()),
        }];
        logits = step_direct(&mut f, &mut planner, &c, &mut plan).unwrap();
    }
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
    toks.split_off(prompt.len())
}

/// Prints the figures of docs/model.md "FP8 weights (W8A8)".
#[test]
#[ignore = "measures the FP8 accuracy figures of docs/model.md; run by hand"]
fn fp8_accuracy_figures() {
    let text = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/model/english.txt"),
    )
    .unwrap();

    let (plain, fp8, tok) = smollm2();
    println!("== SmolLM2-135M-Instruct (Q4_1 GGUF)");
    let mut total = (0, 0);
    for r in smollm2_greedy() {
        let ids = chat_ids(&tok, &r.prompt);
        let (plain_same, plain_margins) = choices(&plain, &ids, &r.output_ids);
        let (same, margins) = choices(&fp8, &ids, &r.output_ids);
        let k = same.iter().take_while(|s| **s).count();
        total = (total.0 + k, total.1 + same.len());
        let lead = |m: &[f32]| m.iter().take(k + 1).fold(f32::INFINITY, |a, b| a.min(*b));
        let count = |v: &[bool]| v.iter().filter(|s| **s).count();
        println!(
            "greedy {:?}: {k} of {} agree; teacher-forced top-1 {} of {}; plain reproduces {} of {}; \
             smallest top-2 margin up to there: plain {:.3}, fp8 {:.3}",
            r.prompt,
            same.len(),
            count(&same),
            same.len(),
            count(&plain_same),
            plain_same.len(),
            lead(&plain_margins),
            lead(&margins),
        );
    }
    println!("greedy total: {} of {} tokens", total.0, total.1);
    let ids = tok.encode(&text, true);
    println!("text, {} tokens: {:?}", ids.len(), divergence(&plain, &fp8, &ids));
    drop((plain, fp8));

    let (plain, fp8, tok) = load_pair("KVFLEET_GEMMA3_GGUF", "gemma-3-270m-q4_k_m.gguf");
    println!("== Gemma 3 270M (Q4_K_M GGUF)");
    let ids = tok.encode(&text, true);
    println!("text, {} tokens: {:?}", ids.len(), divergence(&plain, &fp8, &ids));
    let reference: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gemma3_270m_reference.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let mut total = (0, 0);
    for c in reference["cases"].as_array().unwrap() {
        let ids: Vec<u32> = serde_json::from_value(c["ids"].clone()).unwrap();
        let n = c["greedy"].as_array().unwrap().len();
        let want = engine_greedy(plain.clone(), &ids, n);
        let got = engine_greedy(fp8.clone(), &ids, n);
        let k = agreement(&want, &got);
        total = (total.0 + k, total.1 + n);
        let prompt: String = c["prompt"].as_str().unwrap().chars().take(40).collect();
        println!(
            "greedy {prompt:?} ({} prompt tokens): {k} of {n} agree",
            ids.len()
        );
    }
    println!("greedy total: {} of {} tokens", total.0, total.1);
}
