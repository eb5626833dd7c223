//! The MoE block against a naive reference written here (routing edge cases), and the four
//! families' checkpoints against transformers (`tests/fixtures/moe`, written by
//! `generate.py`).

use std::path::{Path, PathBuf};

use rand::{Rng, SeedableRng};

use super::*;
use crate::model::kv::ContiguousKv;
use crate::model::llama::{Llama, LlamaConfig, SeqChunk};

/// SwiGLU, as the MoE families' experts compute it (`silu(gate) * up`).
struct Silu;

impl Block for Silu {
    fn embed(&self, e: &[f32], out: &mut [f32]) {
        out.copy_from_slice(e);
    }

    fn scale_queries(&self, _head_dim: usize, _q: &mut [f32]) {}

    fn glu(&self, gate: &mut [f32], up: &[f32]) {
        for (g, u) in gate.iter_mut().zip(up) {
            *g = *g / (1.0 + (-*g).exp()) * u;
        }
    }
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

fn moe(experts: usize, top_k: usize, rule: RouterRule, shared: bool) -> Moe {
    Moe {
        experts,
        top_k,
        rule,
        expert_ff: 12,
        shared_ff: shared.then_some(20),
        sparse_step: 1,
        dense_layers: Vec::new(),
    }
}

fn random(rng: &mut rand::rngs::StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

fn random_layer(m: &Moe, d: usize, seed: u64) -> (MoeLayer, MoeTensors) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let (e, ff) = (m.experts, m.expert_ff);
    let mut r = |n: usize, scale: f32| random(&mut rng, n, scale);
    let t = MoeTensors {
        router: r(e * d, 1.0),
        gate: r(e * ff * d, 0.5),
        up: r(e * ff * d, 0.5),
        down: r(e * d * ff, 0.5),
        shared: m
            .shared_ff
            .map(|s| [r(s * d, 0.5), r(s * d, 0.5), r(d * s, 0.5), r(d, 0.5)]),
    };
    (MoeLayer::new(m, d, t.clone()), t)
}

/// The MLP output of one token `x` by the definitions, in f64 with plain loops: the router's
/// logits, the k best by repeated argmax (lowest index first among equals), the rule's
/// weights, each chosen expert's SwiGLU MLP, the shared expert's sigmoid-gated output.
fn naive(m: &Moe, t: &MoeTensors, x: &[f32]) -> Vec<f64> {
    let d = x.len();
    let ff = m.expert_ff;
    let dot = |w: &[f32], x: &[f64]| w.iter().zip(x).map(|(a, b)| *a as f64 * b).sum::<f64>();
    let x: Vec<f64> = x.iter().map(|v| *v as f64).collect();
    let logits: Vec<f64> = (0..m.experts)
        .map(|e| dot(&t.router[e * d..(e + 1) * d], &x))
        .collect();
    let mut chosen: Vec<usize> = Vec::new();
    for _ in 0..m.top_k {
        let mut best = None;
        for e in 0..m.experts {
            if chosen.contains(&e) {
                continue;
            }
            if best.is_none_or(|b: usize| logits[e] > logits[b]) {
                best = Some(e);
            }
        }
        chosen.push(best.unwrap());
    }
    let softmax = |ls: &[f64]| {
        let max = ls.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = ls.iter().map(|l| (l - max).exp()).sum();
        ls.iter().map(|l| (l - max).exp() / s).collect::<Vec<f64>>()
    };
    let weights: Vec<f64> = match m.rule {
        RouterRule::SoftmaxTopK { renormalize } => {
            let p = softmax(&logits);
            let w: Vec<f64> = chosen.iter().map(|&e| p[e]).collect();
            let sum: f64 = w.iter().sum();
            w.iter().map(|v| if renormalize { v / sum } else { *v }).collect()
        }
        RouterRule::TopKSoftmax => softmax(&chosen.iter().map(|&e| logits[e]).collect::<Vec<_>>()),
    };
    let mlp = |g: &[f32], u: &[f32], dn: &[f32], ff: usize| -> Vec<f64> {
        let h: Vec<f64> = (0..ff)
            .map(|j| silu(dot(&g[j * d..(j + 1) * d], &x)) * dot(&u[j * d..(j + 1) * d], &x))
            .collect();
        (0..d).map(|i| dot(&dn[i * ff..(i + 1) * ff], &h)).collect()
    };
    let mut out = vec![0f64; d];
    for (&e, w) in chosen.iter().zip(&weights) {
        let (a, b) = (e * ff * d, (e + 1) * ff * d);
        let y = mlp(&t.gate[a..b], &t.up[a..b], &t.down[a..b], ff);
        out.iter_mut().zip(&y).for_each(|(o, y)| *o += w * y);
    }
    if let (Some(s), Some([g, u, dn, gate])) = (m.shared_ff, &t.shared) {
        let y = mlp(g, u, dn, s);
        let w = 1.0 / (1.0 + (-dot(gate, &x)).exp());
        out.iter_mut().zip(&y).for_each(|(o, y)| *o += w * y);
    }
    out
}

fn assert_matches_naive(m: &Moe, layer: &MoeLayer, t: &MoeTensors, x: &[f32], tokens: usize) {
    let d = x.len() / tokens;
    let mut out = vec![f32::NAN; tokens * d];
    layer.forward(m, &Silu, x, tokens, &mut out, &mut Vec::new());
    for (i, row) in out.chunks_exact(d).enumerate() {
        let want = naive(m, t, &x[i * d..(i + 1) * d]);
        for (a, b) in row.iter().zip(&want) {
            assert!(
                (*a as f64 - b).abs() <= 1e-4 * (1.0 + b.abs()),
                "token {i}: {a} vs {b}"
            );
        }
    }
}

#[test]
fn router_ties_go_to_the_lower_expert_index_under_both_rules() {
    // Four equal logits, k = 2: experts 0 and 1, each a quarter of the softmax, or half once
    // renormalised or softmaxed over the two.
    let even = [1.0f32; 4];
    let r = route(RouterRule::SoftmaxTopK { renormalize: false }, &even, 4, 2);
    assert_eq!(r.iter().map(|r| r.expert).collect::<Vec<_>>(), [0, 1]);
    assert!(r.iter().all(|r| (r.weight - 0.25).abs() < 1e-7), "{r:?}");
    for rule in [
        RouterRule::SoftmaxTopK { renormalize: true },
        RouterRule::TopKSoftmax,
    ] {
        let r = route(rule, &even, 4, 2);
        assert_eq!(r.iter().map(|r| r.expert).collect::<Vec<_>>(), [0, 1], "{rule:?}");
        assert!(r.iter().all(|r| (r.weight - 0.5).abs() < 1e-7), "{rule:?}: {r:?}");
    }
    // A tie below a clear winner: the winner, then the lower of the tied.
    let r = route(RouterRule::TopKSoftmax, &[0.0, 2.0, 1.0, 3.0, 1.0, 2.0], 6, 3);
    assert_eq!(r.iter().map(|r| r.expert).collect::<Vec<_>>(), [3, 1, 5]);
    // Two tokens route independently.
    let r = route(RouterRule::TopKSoftmax, &[5.0, 0.0, 0.0, 0.0, 0.0, 5.0], 3, 1);
    assert_eq!(r.iter().map(|r| r.expert).collect::<Vec<_>>(), [0, 2]);
}

#[test]
fn softmax_of_the_top_k_equals_the_renormalised_top_k_of_the_softmax() {
    // Mixtral's rule as vLLM computes it and as transformers does: the same experts and
    // weights.
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let logits = random(&mut rng, 50 * 16, 4.0);
    let a = route(RouterRule::TopKSoftmax, &logits, 16, 4);
    let b = route(RouterRule::SoftmaxTopK { renormalize: true }, &logits, 16, 4);
    for (a, b) in a.iter().zip(&b) {
        assert_eq!(a.expert, b.expert);
        assert!((a.weight - b.weight).abs() < 1e-6, "{a:?} vs {b:?}");
    }
}

#[test]
fn one_token_and_257_tokens_in_a_step_equal_the_naive_reference_under_every_rule() {
    let d = 16;
    for (i, (rule, shared)) in [
        (RouterRule::SoftmaxTopK { renormalize: false }, true),
        (RouterRule::SoftmaxTopK { renormalize: true }, false),
        (RouterRule::TopKSoftmax, false),
    ]
    .into_iter()
    .enumerate()
    {
        let m = moe(8, 2, rule, shared);
        let (layer, t) = random_layer(&m, d, 10 + i as u64);
        let mut rng = rand::rngs::StdRng::seed_from_u64(20 + i as u64);
        for tokens in [1, 257] {
            let x = random(&mut rng, tokens * d, 1.0);
            assert_matches_naive(&m, &layer, &t, &x, tokens);
        }
    }
}

/// A layer whose router sends every token of positive inputs to expert 3 first and, as the
/// other logits tie at 0, to expert 0 second; the six others get no token.
fn one_expert_layer(d: usize) -> (Moe, MoeLayer, MoeTensors, Vec<f32>, usize) {
    let m = moe(8, 2, RouterRule::SoftmaxTopK { renormalize: true }, false);
    let (_, mut t) = random_layer(&m, d, 5);
    t.router = vec![0.0; 8 * d];
    t.router[3 * d..4 * d].fill(0.5);
    let layer = MoeLayer::new(&m, d, t.clone());
    let tokens = 40;
    let mut rng = rand::rngs::StdRng::seed_from_u64(6);
    let x: Vec<f32> = (0..tokens * d).map(|_| rng.random_range(0.01..1.0)).collect();
    (m, layer, t, x, tokens)
}

#[test]
fn all_tokens_on_one_expert_equal_the_naive_reference() {
    let d = 16;
    let (m, layer, t, x, tokens) = one_expert_layer(d);
    let mut logits = vec![0f32; tokens * 8];
    layer.router.project(&x, tokens, &mut logits);
    let routes = route(m.rule, &logits, 8, 2);
    assert!(routes.chunks(2).all(|r| r[0].expert == 3 && r[1].expert == 0));
    assert_matches_naive(&m, &layer, &t, &x, tokens);
}

#[test]
fn experts_with_no_tokens_are_skipped_and_the_result_is_unchanged() {
    let d = 16;
    let (m, layer, t, x, tokens) = one_expert_layer(d);
    let mut logits = vec![0f32; tokens * 8];
    layer.router.project(&x, tokens, &mut logits);
    let groups = group_by_expert(&route(m.rule, &logits, 8, 2), 2, 8);
    let load: Vec<usize> = groups.iter().map(Vec::len).collect();
    assert_eq!(load, [tokens, 0, 0, tokens, 0, 0, 0, 0]);
    // Poisoning the idle experts' weights changes nothing: they are never read.
    let mut poisoned = layer.clone();
    for e in [1, 2, 4, 5, 6, 7] {
        poisoned.experts[e].gate = Linear::new(vec![f32::NAN; 12 * d], d);
    }
    let (mut a, mut b) = (vec![0f32; tokens * d], vec![0f32; tokens * d]);
    let mut load = Vec::new();
    layer.forward(&m, &Silu, &x, tokens, &mut a, &mut load);
    assert_eq!(load, [tokens as u32, 0, 0, tokens as u32, 0, 0, 0, 0]);
    poisoned.forward(&m, &Silu, &x, tokens, &mut b, &mut Vec::new());
    assert_eq!(a, b);
    assert_matches_naive(&m, &layer, &t, &x, tokens);
}

fn tiny_moe_model() -> Llama {
    let mut cfg = LlamaConfig::llama(3, 32, 48, 4, 2, 64);
    cfg.arch = "qwen3moe".into();
    cfg.rope_neox = true;
    cfg.qk_norm = true;
    cfg.context_len = 512;
    cfg.moe = Some(Moe {
        dense_layers: vec![0],
        ..moe(8, 2, RouterRule::SoftmaxTopK { renormalize: true }, false)
    });
    Llama::dummy(cfg, 11).unwrap()
}

#[test]
fn a_prefill_split_inside_the_prompt_equals_one_chunk() {
    let m = tiny_moe_model();
    assert!(m.layers[0].moe.is_none() && m.layers[1].moe.is_some() && m.layers[2].moe.is_some());
    let toks: Vec<u32> = (0..300).map(|i| (i * 7 % 64) as u32).collect();
    let geo = m.config.attn_geometry();
    let run = |splits: &[usize]| {
        let mut kv = ContiguousKv::new(geo, 512);
        let mut logits = Vec::new();
        let mut start = 0;
        for &end in splits.iter().chain([&toks.len()]) {
            let chunk = SeqChunk {
                seq: 1,
                start_pos: start,
                tokens: &toks[start..end],
                logits: end - start,
            };
            logits.extend(m.forward(&mut kv, &[chunk]).unwrap());
            start = end;
        }
        logits
    };
    let one = run(&[]);
    for splits in [&[137][..], &[1, 257]] {
        let split = run(splits);
        assert_eq!(one.len(), split.len());
        let err = one
            .iter()
            .zip(&split)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(err < 1e-4, "{splits:?}: max difference {err}");
    }
}

// === the families against transformers ===

fn fixture(family: &str) -> (PathBuf, serde_json::Value) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/moe")
        .join(family);
    let text = std::fs::read_to_string(dir.join("expected.json")).unwrap();
    (dir, serde_json::from_str(&text).unwrap())
}

fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = row.iter().map(|v| (*v as f64 - max).exp()).sum::<f64>().ln() + max;
    row.iter().map(|v| *v as f64 - lse).collect()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Every prompt of a family's fixture: log-probabilities at every position within `tol` of
/// transformers' (its top 8 per position, the whole last row), the 300-token prompt prefilled
/// in chunks of 128, and the greedy continuation decoded one token a step. The largest
/// difference seen.
fn check_family(family: &str, tol: f64) -> f64 {
    let (dir, want) = fixture(family);
    let m = crate::model::hf::load_model(&dir).unwrap();
    let vocab = m.config.vocab;
    let mut worst = 0f64;
    for (pi, p) in want["prompts"].as_array().unwrap().iter().enumerate() {
        let prompt = ids(&p["ids"]);
        let n = prompt.len();
        let mut kv = ContiguousKv::new(m.config.attn_geometry(), n + 32);
        let mut logits = Vec::new();
        for start in (0..n).step_by(128) {
            let end = (start + 128).min(n);
            let chunk = SeqChunk {
                seq: 1,
                start_pos: start,
                tokens: &prompt[start..end],
                logits: end - start,
            };
            logits.extend(m.forward(&mut kv, &[chunk]).unwrap());
        }
        for (pos, row) in logits.chunks_exact(vocab).enumerate() {
            let lp = log_softmax(row);
            let top_ids = ids(&p["top_ids"][pos]);
            for (j, id) in top_ids.iter().enumerate() {
                let w = p["top_logprobs"][pos][j].as_f64().unwrap();
                worst = worst.max((lp[*id as usize] - w).abs());
            }
            if pos == n - 1 {
                for (a, b) in lp.iter().zip(p["last_logprobs"].as_array().unwrap()) {
                    worst = worst.max((a - b.as_f64().unwrap()).abs());
                }
            }
        }
        assert!(
            worst <= tol,
            "{family} prompt {pi}: log-probabilities differ by {worst}"
        );
        // Greedy: argmax of the last row, then one token per step.
        let argmax = |row: &[f32]| {
            row.iter()
                .enumerate()
                .fold(
                    (0, f32::NEG_INFINITY),
                    |b, (i, v)| if *v > b.1 { (i, *v) } else { b },
                )
                .0 as u32
        };
        let greedy = ids(&p["greedy"]);
        let mut got = vec![argmax(&logits[(n - 1) * vocab..])];
        while got.len() < greedy.len() {
            let pos = n + got.len() - 1;
            let chunk = SeqChunk {
                seq: 1,
                start_pos: pos,
                tokens: &got[got.len() - 1..],
                logits: 1,
            };
            let row = m.forward(&mut kv, &[chunk]).unwrap();
            got.push(argmax(&row));
        }
        assert_eq!(got, greedy, "{family} prompt {pi}: greedy tokens");
    }
    eprintln!("{family}: max |log-prob difference| {worst:.2e}");
    worst
}

#[test]
fn qwen3_moe_equals_transformers_with_dense_and_renormalised_sparse_layers() {
    let m = crate::model::hf::load_model(&fixture("qwen3_moe").0).unwrap();
    let moe = m.config.moe.as_ref().unwrap();
    assert_eq!(moe.rule, RouterRule::SoftmaxTopK { renormalize: true });
    assert_eq!(
        (moe.experts, moe.top_k, moe.dense_layers.as_slice()),
        (8, 2, &[0][..])
    );
    assert!(m.layers[0].moe.is_none() && m.layers[1].moe.is_some());
    check_family("qwen3_moe", 1e-3);
}

#[test]
fn qwen2_moe_equals_transformers_with_its_gated_shared_expert_every_other_layer() {
    let m = crate::model::hf::load_model(&fixture("qwen2_moe").0).unwrap();
    let moe = m.config.moe.as_ref().unwrap();
    assert_eq!((moe.sparse_step, moe.shared_ff), (2, Some(48)));
    assert!(m.config.attn_bias);
    let sparse: Vec<bool> = m.layers.iter().map(|l| l.moe.is_some()).collect();
    assert_eq!(sparse, [false, true, false]);
    check_family("qwen2_moe", 1e-3);
}

#[test]
fn olmoe_equals_transformers_with_q_and_k_norms_over_the_whole_projection() {
    let m = crate::model::hf::load_model(&fixture("olmoe").0).unwrap();
    assert!(m.config.qk_norm && m.config.qk_norm_full);
    assert_eq!(m.layers[0].q_norm.as_ref().unwrap().len(), 64);
    check_family("olmoe", 1e-3);
}

#[test]
fn mixtral_bf16_equals_transformers_with_the_softmax_over_its_top_k() {
    let m = crate::model::hf::load_model(&fixture("mixtral").0).unwrap();
    assert_eq!(m.config.moe.as_ref().unwrap().rule, RouterRule::TopKSoftmax);
    check_family("mixtral", 1e-3);
}

#[test]
fn moe_config_values_kvfleet_cannot_run_are_refused_naming_the_key() {
    use serde_json::json;
    let base = json!({"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16});
    let mut c = base.clone();
    c["num_experts_per_tok"] = json!(9);
    assert!(Moe::from_config_json("qwen3moe", &c)
        .unwrap_err()
        .contains("num_experts_per_tok"));
    let e = Moe::from_config_json("qwen2moe", &base).unwrap_err();
    assert!(e.contains("shared_expert_intermediate_size"), "{e}");
    let e = Moe::from_config_json("olmoe", &json!({"clip_qkv": 8.0})).unwrap_err();
    assert!(e.contains("clip_qkv"), "{e}");
    let mut c = base.clone();
    c["num_experts"] = json!(0);
    assert_eq!(
        Moe::from_config_json("qwen3moe", &c),
        Ok(None),
        "no experts: dense"
    );
    assert_eq!(Moe::from_config_json("llama", &base), Ok(None));
}

#[test]
fn fp8_quantizes_the_experts_and_keeps_the_router_and_the_shared_gate_as_loaded() {
    let m = moe(4, 2, RouterRule::SoftmaxTopK { renormalize: false }, true);
    let (plain, _) = random_layer(&m, 16, 8);
    let mut q = plain.clone();
    q.quantize_fp8();
    assert_eq!(q.router, plain.router);
    let (qs, ps) = (q.shared.as_ref().unwrap(), plain.shared.as_ref().unwrap());
    assert_eq!(qs.1, ps.1, "the shared expert's gate");
    for (a, b) in [(&qs.0.down, &ps.0.down), (&q.experts[3].up, &plain.experts[3].up)] {
        assert_eq!(a.format(), crate::model::linear::LinearQuantization::Fp8);
        assert_ne!(a.weight(), b.weight());
    }
}

#[test]
fn dummy_weights_of_a_moe_config_and_qwen2_moe_biases_follow_the_config() {
    let (dir, _) = fixture("qwen2_moe");
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let (cfg, _) = crate::model::hf::load_dummy_config(&dir.join("config.json")).unwrap();
    let m = Llama::dummy(cfg, 1).unwrap();
    let sparse: Vec<bool> = m.layers.iter().map(|l| l.moe.is_some()).collect();
    assert_eq!(sparse, [false, true, false]);
    assert_eq!(m.layers[1].moe.as_ref().unwrap().experts.len(), 8);
    assert!(
        m.layers[1].w_gate.weight().is_empty(),
        "no dense MLP in a sparse layer"
    );
    let mut kv = ContiguousKv::new(m.config.attn_geometry(), 16);
    let chunk = SeqChunk {
        seq: 1,
        start_pos: 0,
        tokens: &[1, 2, 3],
        logits: 1,
    };
    assert!(m
        .forward(&mut kv, &[chunk])
        .unwrap()
        .iter()
        .all(|v| v.is_finite()));
    let no_bias = text.replace(r#""qkv_bias": true"#, r#""qkv_bias": false"#);
    assert_ne!(no_bias, text);
    let c = crate::model::hf::HfConfig::parse(Path::new("config.json"), &no_bias).unwrap();
    assert!(!c.llama.attn_bias);
}
