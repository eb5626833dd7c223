use super::*;

fn config(extra: &str) -> String {
    arch_config("LlamaForCausalLM", extra)
}

fn arch_config(arch: &str, extra: &str) -> String {
    format!(
        r#"{{"architectures": ["{arch}"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 100, "max_position_embeddings": 512, "rope_theta": 500000.0{extra}}}"#
    )
}

#[test]
fn llama_config_maps_to_neox_rope_and_defaults() {
    let c = HfConfig::parse(Path::new("config.json"), &config("")).unwrap();
    let l = &c.llama;
    assert_eq!((l.arch.as_str(), l.head_dim, l.n_kv_heads), ("llama", 16, 2));
    assert!(l.rope_neox && !l.attn_bias && !l.qk_norm && !l.tied_embeddings);
    assert_eq!((l.rms_eps, l.context_len, l.rope_theta), (1e-6, 512, 500000.0));
    assert_eq!(c.rope_freq_factors, None);
}

#[test]
fn qwen_flags_and_explicit_head_dim_are_read() {
    let q2 = arch_config("Qwen2ForCausalLM", "");
    let c = HfConfig::parse(Path::new("c"), &q2).unwrap().llama;
    assert!(c.attn_bias && !c.qk_norm);
    let q3 = arch_config(
        "Qwen3ForCausalLM",
        r#", "head_dim": 32, "tie_word_embeddings": true"#,
    );
    let c = HfConfig::parse(Path::new("c"), &q3).unwrap().llama;
    assert!(!c.attn_bias && c.qk_norm && c.tied_embeddings);
    assert_eq!((c.head_dim, c.rope_dims), (32, 32));
}

#[test]
fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
    let c = config(
        r#", "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}"#,
    );
    let f = HfConfig::parse(Path::new("c"), &c)
        .unwrap()
        .rope_freq_factors
        .unwrap();
    assert_eq!(f.len(), 8);
    assert_eq!(f[0], 1.0, "the highest frequency is kept");
    assert!(
        (f[7] - 8.0).abs() < 1e-4,
        "the lowest is divided by the factor: {f:?}"
    );
    assert!(f.windows(2).all(|w| w[0] <= w[1]), "{f:?}");
}

#[test]
fn the_cpu_serves_every_listed_architecture_and_the_gpu_all_but_the_mixtures_of_experts() {
    for a in [
        "LlamaForCausalLM",
        "Qwen3ForCausalLM",
        "MixtralForCausalLM",
        "Qwen3MoeForCausalLM",
    ] {
        assert!(cpu_serves(a), "{a}");
    }
    assert!(cuda_serves("Qwen2ForCausalLM"));
    for a in MOE_ARCHITECTURES {
        assert!(cpu_serves(a) && !cuda_serves(a), "{a}");
    }
    assert!(!cpu_serves("GptOssForCausalLM") && !cuda_serves("GptOssForCausalLM"));
    let e = HfConfig::parse(Path::new("c"), &arch_config("GptOssForCausalLM", "")).unwrap_err();
    assert!(e.to_string().contains("Qwen3MoeForCausalLM"), "{e}");
}

#[test]
fn linear_scaling_sets_the_position_divisor() {
    let c = config(r#", "rope_scaling": {"type": "linear", "factor": 4.0}"#);
    assert_eq!(
        HfConfig::parse(Path::new("c"), &c)
            .unwrap()
            .llama
            .rope_linear_scale,
        4.0
    );
}

#[test]
fn mistral_sliding_window_bounds_the_context() {
    let c = arch_config("MistralForCausalLM", r#", "sliding_window": 128"#);
    assert_eq!(
        HfConfig::parse(Path::new("c"), &c).unwrap().llama.context_len,
        128
    );
}

#[test]
fn tensor_names_map_to_hugging_face() {
    assert_eq!(
        hf_tensor_name("blk.3.attn_q.bias"),
        "model.layers.3.self_attn.q_proj.bias"
    );
    assert_eq!(
        hf_tensor_name("blk.0.attn_k_norm.weight"),
        "model.layers.0.self_attn.k_norm.weight"
    );
    assert_eq!(
        hf_tensor_name("blk.12.ffn_norm.weight"),
        "model.layers.12.post_attention_layernorm.weight"
    );
    assert_eq!(hf_tensor_name("output.weight"), "lm_head.weight");
}

// === FP8 checkpoints (tests/fixtures/fp8, written by generate.py) ===

fn fp8_fixture(name: &str) -> (PathBuf, serde_json::Value) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/fp8")
        .join(name);
    let expected =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    (dir, expected)
}

fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

#[test]
fn fp8_checkpoints_of_both_formats_load_dequantized_with_their_scales() {
    use super::super::fp8::{ActivationScheme, Fp8Format, Fp8Strategy};
    for (name, format, strategy, activation) in [
        (
            "vllm-fp8",
            Fp8Format::Vllm,
            Fp8Strategy::Tensor,
            ActivationScheme::Static,
        ),
        (
            "ct-channel",
            Fp8Format::CompressedTensors,
            Fp8Strategy::Channel,
            ActivationScheme::Dynamic,
        ),
        (
            "ct-tensor",
            Fp8Format::CompressedTensors,
            Fp8Strategy::Tensor,
            ActivationScheme::Dynamic,
        ),
    ] {
        let (dir, want) = fp8_fixture(name);
        let q = quantization(&dir).unwrap().unwrap();
        assert_eq!((q.format, q.activation), (format, activation), "{name}");
        assert_eq!(q.ignored, ["lm_head"], "{name}");
        let st = Safetensors::open(&dir).unwrap();
        let tensor = want["tensor"].as_str().unwrap();
        let (rows, cols) = (
            want["rows"].as_u64().unwrap() as usize,
            want["cols"].as_u64().unwrap() as usize,
        );
        let w = st.fp8_weight(tensor).unwrap();
        assert_eq!((w.strategy, w.rows, w.cols), (strategy, rows, cols), "{name}");
        assert_eq!(w.scale, floats(&want["scales"]), "{name}");
        let codes: Vec<u8> = want["codes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_u64().unwrap() as u8)
            .collect();
        assert_eq!(w.data, codes, "{name}: raw bytes kept for the GPU path");
        assert_eq!(
            w.input_scale,
            want["input_scale"].as_f64().map(|s| s as f32),
            "{name}"
        );
        // The f32 path (what the CPU engine loads) equals the generator's dequantization
        // exactly, and the originals within e4m3's rounding: half a unit in the last place
        // (2^-4 relative for normals; 2^-10 x scale absolute in the subnormal range).
        let got = st.tensor_f32(tensor, &[rows, cols]).unwrap();
        assert_eq!(got, floats(&want["dequantized"]), "{name}");
        let scales = floats(&want["scales"]);
        for (i, (g, o)) in got.iter().zip(floats(&want["original"])).enumerate() {
            let s = if strategy == Fp8Strategy::Channel {
                scales[i / cols]
            } else {
                scales[0]
            };
            let bound = (o.abs() / 16.0).max(s * 2f32.powi(-10)) * 1.0001;
            assert!((g - o).abs() <= bound, "{name}[{i}]: {g} vs {o} (bound {bound})");
        }
        // Some values land in e4m3's subnormal range (row 1 is scaled down by 1e-3 in
        // tensor scale fixtures), so the subnormal decode is exercised.
        if strategy == Fp8Strategy::Tensor {
            assert!(
                w.data.iter().any(|b| b & 0x78 == 0 && b & 0x07 != 0),
                "{name}: no subnormal code"
            );
        }
        // The bf16 LM head loads as before.
        assert_eq!(st.tensor_f32("lm_head.weight", &[2, cols]).unwrap()[3], 1.5);
    }
}

#[test]
fn unsupported_quantization_configs_are_refused_naming_the_field() {
    let tmp = std::env::temp_dir().join(format!("kvfleet-fp8-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    for (qc, field) in [
        (
            r#"{"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}"#,
            "quantization_config.weight_block_size",
        ),
        (
            r#"{"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"type": "int", "num_bits": 8, "strategy": "channel"}}}}"#,
            "quantization_config.config_groups.g.weights.type",
        ),
        (
            r#"{"quant_method": "bitsandbytes"}"#,
            "quantization_config.quant_method",
        ),
        (
            r#"{"quant_method": "gptq", "bits": 8, "group_size": 128}"#,
            "quantization_config.bits",
        ),
    ] {
        std::fs::write(
            tmp.join("config.json"),
            format!(r#"{{"architectures": ["LlamaForCausalLM"], "quantization_config": {qc}}}"#),
        )
        .unwrap();
        let e = quantization(&tmp).unwrap_err().to_string();
        assert!(e.contains(field), "{e}");
    }
    std::fs::remove_dir_all(&tmp).unwrap();
}

/// Admission (`kvfleet_core::compat::engine`) admits exactly what these loaders read: an
/// architecture added here without a row there would be denied at `kubectl apply`, one
/// there without a loader here admitted to fail at load.
#[test]
fn served_architectures_agree_with_the_admission_table() {
    use kvfleet_core::compat::engine;
    for (hf, _) in ARCHITECTURES {
        let served = engine::architecture(hf).unwrap_or_else(|| panic!("{hf} has no row in compat::engine"));
        assert!(served.safetensors && served.devices.cpu, "{hf}: {served:?}");
        assert_eq!(served.devices.cuda, cuda_serves(hf), "{hf}");
    }
    // The MoE rule (a geometry with experts) says what the MoE families' rows say.
    for a in MOE_ARCHITECTURES {
        assert_eq!(
            engine::architecture(a).map(|s| s.devices),
            Some(engine::MOE),
            "{a}"
        );
    }
    // The weight formats: the CPU engine runs a quantization whose quant_method its
    // loader reads; the CUDA engine refuses them all at load.
    use kvfleet_core::compat::Quantization as Q;
    for (q, method) in [
        (Q::Awq, "awq"),
        (Q::Gptq, "gptq"),
        (Q::W4a16, "compressed-tensors"),
    ] {
        assert!(super::super::w4::CPU_QUANT_METHODS.contains(&method), "{method}");
        assert!(
            engine::quantization(q).cpu && !engine::quantization(q).cuda,
            "{q}"
        );
    }
    for served in engine::ARCHITECTURES.iter().filter(|a| a.safetensors) {
        assert!(
            ARCHITECTURES.iter().any(|(hf, _)| *hf == served.name),
            "compat::engine admits {} from safetensors, which no loader reads",
            served.name
        );
    }
}
