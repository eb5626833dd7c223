//! Unit tests of the CPU model: the KV list, the matrix product, RoPE, FP8 and the forward
//! pass's chunking.

use super::*;
use crate::model::fp8::quantize_rows;
use crate::model::gemma3::GEMMA3_SLIDING_WINDOW_PATTERN;
use crate::model::kv::{ContiguousKv, KvAttention};

#[test]
fn the_kv_list_of_gemma3_reads_its_window_pattern_and_matches_the_planner() {
    let c = LlamaConfig::gemma3(18, 640, 2048, 1000, 512);
    let layers = c.kv_layers(1).unwrap();
    assert_eq!(layers.len(), 18);
    for (i, l) in layers.iter().enumerate() {
        let global = (i + 1) % GEMMA3_SLIDING_WINDOW_PATTERN == 0;
        assert_eq!(l.window, (!global).then_some(512), "layer {i}");
        assert_eq!((l.q_heads, l.kv_heads, l.head_dim), (4, 1, 256));
    }
    // The planner reads the same layers from the same geometry.
    let g = kvfleet_core::plan::Geometry::from_spec(&c.model_geometry()).unwrap();
    let planned: Vec<Option<u32>> = g
        .layers
        .iter()
        .map(|l| match l.kind {
            kvfleet_core::plan::LayerKind::Sliding { window } => Some(window),
            _ => None,
        })
        .collect();
    assert_eq!(planned, layers.iter().map(|l| l.window).collect::<Vec<_>>());
    // Stored heads (the GPU may replicate KV heads) change the list, not the pattern.
    assert!(c.kv_layers(4).unwrap().iter().all(|l| l.kv_heads == 4));
    assert!(c.kv_layers(3).is_err(), "4 query heads over 3 KV heads");
}

#[test]
fn matmul_t_matches_naive_on_odd_shapes() {
    for (t, k, n) in [(3, 5, 131), (1, 37, 70), (9, 21, 200)] {
        matmul_case(t, k, n);
    }
}

fn matmul_case(t: usize, k: usize, n: usize) {
    let x: Vec<f32> = (0..t * k).map(|i| (i as f32 * 0.37).sin()).collect();
    let w: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.11).cos()).collect();
    let mut out = vec![0.0; t * n];
    matmul_t(&x, t, k, &w, n, &mut out);
    for i in 0..t {
        for j in 0..n {
            let want: f32 = (0..k).map(|p| x[i * k + p] * w[j * k + p]).sum();
            assert!((out[i * n + j] - want).abs() < 1e-4);
        }
    }
}

fn tiny() -> Llama {
    let mut cfg = LlamaConfig::llama(2, 32, 64, 4, 2, 50);
    cfg.context_len = 64;
    Llama::dummy(cfg, 7).unwrap()
}

#[test]
fn incremental_decode_matches_full_prefill_logits() {
    let m = tiny();
    let toks = [3u32, 14, 15, 9, 26, 5];
    let geo = m.config.attn_geometry();
    let mut kv = ContiguousKv::new(geo, 1000);
    let full = m
        .forward(
            &mut kv,
            &[SeqChunk {
                seq: 1,
                start_pos: 0,
                tokens: &toks,
                logits: 1,
            }],
        )
        .unwrap();
    let mut kv2 = ContiguousKv::new(geo, 1000);
    let mut last = Vec::new();
    // Chunk of 4, then two single tokens, batched together with an unrelated sequence.
    let plan: [&[u32]; 3] = [&toks[..4], &toks[4..5], &toks[5..]];
    let mut pos = 0;
    for p in plan {
        let other = [7u32];
        let other_pos = kv2.cached_len(2);
        last = m
            .forward(
                &mut kv2,
                &[
                    SeqChunk {
                        seq: 2,
                        start_pos: other_pos,
                        tokens: &other,
                        logits: 1,
                    },
                    SeqChunk {
                        seq: 1,
                        start_pos: pos,
                        tokens: p,
                        logits: 1,
                    },
                ],
            )
            .unwrap();
        pos += p.len();
    }
    let v = m.config.vocab;
    for (a, b) in full.iter().zip(&last[v..]) {
        assert!((a - b).abs() < 1e-4, "{a} vs {b}");
    }
}

#[test]
fn neox_and_pair_rope_rotate_different_dimensions() {
    let mut m = tiny();
    let mut a = vec![1.0f32; 8];
    let mut b = a.clone();
    m.config.head_dim = 8;
    m.config.rope_dims = 8;
    m.inv_freq = inv_freq(&m.config, None);
    m.rope(&mut a, &[3], 1);
    m.config.rope_neox = true;
    m.rope(&mut b, &[3], 1);
    assert_ne!(a, b);
    // Rotations keep each rotated pair's norm.
    let n = |x: &[f32], i: usize, j: usize| x[i] * x[i] + x[j] * x[j];
    assert!((n(&a, 0, 1) - 2.0).abs() < 1e-5);
    assert!((n(&b, 0, 4) - 2.0).abs() < 1e-5);
}

#[test]
fn quantize_fp8_replaces_exactly_the_linear_weights_and_changes_the_logits() {
    let plain = tiny();
    let mut m = plain.clone();
    m.quantize_fp8();
    assert_eq!(m.quantization(), LinearQuantization::Fp8);
    let (d, ff, qw) = (32, 64, 32);
    for (p, q) in plain.layers.iter().zip(&m.layers) {
        for (a, b, cols) in [
            (&p.wq, &q.wq, d),
            (&p.wk, &q.wk, d),
            (&p.wv, &q.wv, d),
            (&p.wo, &q.wo, qw),
            (&p.w_gate, &q.w_gate, d),
            (&p.w_up, &q.w_up, d),
            (&p.w_down, &q.w_down, ff),
        ] {
            let (a, b) = (a.weight(), b.weight());
            assert_eq!(b, quantize_rows(a, a.len() / cols, cols).dequantize());
            assert_ne!(a, b);
        }
        assert_eq!((&p.attn_norm, &p.ffn_norm), (&q.attn_norm, &q.ffn_norm));
    }
    assert_eq!(plain.embed, m.embed);
    assert_eq!(plain.lm_head, m.lm_head);
    assert_eq!(plain.out_norm, m.out_norm);
    let again = {
        let mut a = m.clone();
        a.quantize_fp8();
        a
    };
    assert_eq!(again.layers[0].wq, m.layers[0].wq, "a second call does nothing");
    let logits = |m: &Llama| {
        let mut kv = ContiguousKv::new(m.config.attn_geometry(), 64);
        let chunk = SeqChunk {
            seq: 1,
            start_pos: 0,
            tokens: &[3, 14, 15, 9],
            logits: 1,
        };
        m.forward(&mut kv, &[chunk]).unwrap()
    };
    let (a, b) = (logits(&plain), logits(&m));
    let err = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    let span = a.iter().fold(0f32, |s, v| s.max(v.abs()));
    assert!(
        err > 0.0 && err < 0.1 * span,
        "max error {err} of logits up to {span}"
    );
}

#[test]
fn bad_geometry_and_token_are_errors() {
    let cfg = LlamaConfig::llama(1, 32, 64, 4, 3, 10);
    assert!(matches!(Llama::dummy(cfg, 0), Err(LoadError::Geometry(_))));
    let m = tiny();
    let mut kv = ContiguousKv::new(m.config.attn_geometry(), 10);
    let e = m
        .forward(
            &mut kv,
            &[SeqChunk {
                seq: 1,
                start_pos: 0,
                tokens: &[999],
                logits: 1,
            }],
        )
        .unwrap_err();
    assert!(matches!(e, ForwardError::Token(999)));
}
