//! The KV pools the GPU worker allocates against what the planner predicts for them
//! (`plan::engine_memory`, docs/plan.md "Memory prediction"): dummy Llama-3.1-8B and Gemma 3
//! at bf16 and fp8_e4m3, utilisation 0.92, 2,048 batched tokens, 256 rows, maxModelLen 8,192.
//! The planner gets the GPU's memory from the product table when it knows the device (what
//! `kvfleet check` uses), else the total NVML reports; the worker's budget is a share of NVML's
//! total, as `kvfleet worker` sets it. The tests take the GPU one at a time: a model another
//! test is loading would hold memory this one measures as free.
//!
//! Every test needs an NVIDIA GPU: `cargo test --test cuda_capacity -- --ignored --nocapture`
//! on the device (with `LD_LIBRARY_PATH=/usr/local/cuda/lib64` for cuBLAS and NVRTC).

use kvfleet_core::api::InferenceDeploymentSpec;
use kvfleet_core::plan::{self, EngineParams, MemoryInput, PlanInputs, ReportingEra};
use kvfleet_cuda::gpu::{kv_replication, GpuLlama, GpuOptions};
use kvfleet_engine::engine::capacity::admitted;
use kvfleet_engine::engine::layout::KvDtype;
use kvfleet_engine::model::forward::Forward;
use kvfleet_engine::model::llama::LlamaConfig;
use std::sync::Mutex;

use kvfleet::worker::nvml::Probe;

const MAX_MODEL_LEN: usize = 8192;

/// One test on the GPU at a time.
static GPU: Mutex<()> = Mutex::new(());

/// Device 0's total memory as NVML reports it (what the worker passes the GPU model).
fn nvml_total() -> usize {
    match kvfleet::worker::nvml::probe() {
        Probe::Gpus(g) => g[0].memory_total_bytes as usize,
        Probe::NoGpu { reason } => panic!("NVML: {reason}"),
    }
}

fn opts(dtype: KvDtype) -> GpuOptions {
    GpuOptions {
        reported_total_bytes: Some(nvml_total()),
        kv_dtype: dtype,
        max_batched_tokens: 2048,
        max_num_seqs: 256,
        gpu_memory_utilization: 0.92,
        max_model_len: Some(MAX_MODEL_LEN),
        ..GpuOptions::default()
    }
}

/// The worker's pools for `c` at `dtype`: pages per group, tokens held for maxModelLen
/// requests, the device's name and total memory.
fn allocated(c: &LlamaConfig, dtype: KvDtype, fp8_weights: bool) -> (Vec<u64>, u64, String, u64) {
    let _one = GPU.lock().unwrap_or_else(|p| p.into_inner());
    let gpu = GpuLlama::open_gpu(0).expect("an NVIDIA GPU with cuBLAS and NVRTC");
    let o = GpuOptions {
        fp8_weights,
        ..opts(dtype)
    };
    let m = GpuLlama::dummy(gpu, c.clone(), 1, &o).expect("dummy model on the GPU");
    let cap = m.capacity().clone();
    eprintln!("{cap:?}");
    assert_eq!(
        cap.kv_bytes,
        cap.kv_budget_bytes,
        "the driver holds more than the context reserve: {} MiB free short of the budget",
        (cap.kv_budget_bytes - cap.kv_bytes) >> 20
    );
    let pools = m.kv_config();
    let pages = pools.groups.iter().map(|g| g.num_blocks as u64).collect();
    let a = admitted(pools, MAX_MODEL_LEN, o.max_batched_tokens);
    let tokens = (a.max_concurrency * MAX_MODEL_LEN as f64) as u64;
    (pages, tokens, cap.device, cap.total_bytes as u64)
}

/// The GPU's memory as `kvfleet check` knows it: the product table, else what NVML says. A
/// product whose table entry is not NVML's total is a table error, not a prediction error.
fn planner_memory(device: &str, measured: u64) -> u64 {
    let table = plan::gpu_memory_bytes(device);
    eprintln!("{device}: NVML total {measured} bytes, product table {table:?}");
    if let Some(t) = table {
        assert_eq!(
            t, measured,
            "{device}: the product table's memory is not NVML's total"
        );
    }
    table.unwrap_or(measured)
}

fn within_one_page(what: &str, planned: &[u64], got: &[u64]) {
    assert_eq!(planned.len(), got.len(), "{what}: groups");
    for (p, g) in planned.iter().zip(got) {
        assert!(
            p.abs_diff(*g) <= 1,
            "{what}: planned pages {planned:?}, allocated {got:?}"
        );
    }
}

/// The spec `kvfleet check` reads for the dummy Llama-3.1-8B these tests serve: KV in `kv_dtype`
/// (its CRD name), the engine settings of [`opts`], and `engine` merged into its `engine`.
fn dummy_llama_3_1_8b_spec(kv_dtype: &str, engine: serde_json::Value) -> InferenceDeploymentSpec {
    let mut spec = serde_json::json!({
        "model": {
            "name": "llama",
            "geometry": {"layers": 32, "queryHeads": 32, "kvHeads": 8, "headDim": 128,
                         "hiddenSize": 4096, "intermediateSize": 14336, "vocabSize": 128256},
            "weights": {"format": "dummy"}
        },
        "engine": {"runtime": "kvfleet", "kvCacheDtype": kv_dtype, "maxModelLen": MAX_MODEL_LEN,
                   "maxNumBatchedTokens": 2048, "maxNumSeqs": 256, "gpuMemoryUtilization": 0.92}
    });
    if let (Some(e), serde_json::Value::Object(extra)) = (spec["engine"].as_object_mut(), engine) {
        e.extend(extra);
    }
    serde_json::from_value(spec).unwrap()
}

#[test]
#[ignore = "needs an NVIDIA GPU (run through the device tool)"]
fn gpu_dummy_llama_3_1_8b_allocates_the_pages_kvfleet_check_predicts() {
    let c = LlamaConfig::llama(32, 4096, 14336, 32, 8, 128_256);
    let cases = [
        (KvDtype::Bf16, "bfloat16", "none"),
        (KvDtype::Fp8E4m3, "fp8_e4m3", "none"),
        // FP8 weights (issue 32): the linear layers at a byte a weight, the FP8 GEMM buffers.
        (KvDtype::Bf16, "bfloat16", "fp8"),
        (KvDtype::Fp8E4m3, "fp8_e4m3", "fp8"),
    ];
    for (dtype, name, quantization) in cases {
        let (pages, tokens, device, total) = allocated(&c, dtype, quantization == "fp8");
        let spec = dummy_llama_3_1_8b_spec(name, serde_json::json!({"quantization": quantization}));
        let geometry = plan::Geometry::from_spec(spec.model.geometry.as_ref().unwrap()).unwrap();
        let check =
            plan::spec_capacity(&spec, &geometry, planner_memory(&device, total), dtype.spec()).unwrap();
        let planned: Vec<u64> = check.plan.kvfleet.groups.iter().map(|g| g.num_blocks).collect();
        eprintln!(
            "Llama-3.1-8B {name} KV, weights {quantization}: check {} tokens {planned:?} pages; worker {tokens} tokens {pages:?} pages",
            check.kvfleet_tokens
        );
        within_one_page(
            &format!("Llama-3.1-8B {name}, weights {quantization}"),
            &planned,
            &pages,
        );
        assert!(
            check.kvfleet_tokens.abs_diff(tokens) <= 16,
            "{name} {quantization}"
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU (run through the device tool)"]
fn gpu_dummy_gemma_3_allocates_the_pages_the_planner_predicts() {
    let models = [
        ("Gemma 3 270M", LlamaConfig::gemma3(18, 640, 2048, 262_144, 512)),
        ("Gemma 3 1B", LlamaConfig::gemma3(26, 1152, 6912, 262_144, 512)),
    ];
    for (model, c) in models {
        for dtype in [KvDtype::Bf16, KvDtype::Fp8E4m3] {
            let (pages, tokens, device, total) = allocated(&c, dtype, false);
            let (rep, _) = kv_replication(c.n_heads, c.n_kv_heads).unwrap();
            let inputs = PlanInputs {
                engine: EngineParams {
                    tp: 1,
                    dtype: dtype.spec(),
                    block_size: 16,
                    max_model_len: MAX_MODEL_LEN as u64,
                    max_num_batched_tokens: 2048,
                },
                era: ReportingEra::V0_21On,
                memory: MemoryInput::KvfleetEngine {
                    gpu_memory_bytes: planner_memory(&device, total),
                    gpu_memory_utilization: 0.92,
                    shape: c.engine_shape(rep as u64),
                    max_num_seqs: 256,
                    drafter: None,
                },
                request_len: None,
            };
            let geometry = plan::Geometry::from_spec(&c.model_geometry()).unwrap();
            let planned = plan::plan(&geometry, &inputs).unwrap();
            let want: Vec<u64> = planned.kvfleet.groups.iter().map(|g| g.num_blocks).collect();
            eprintln!(
                "{model} {dtype:?}: planner {} tokens {want:?} pages; worker {tokens} tokens {pages:?} pages",
                planned.kvfleet.capacity_tokens
            );
            within_one_page(&format!("{model} {dtype:?}"), &want, &pages);
        }
    }
}

/// An EAGLE-3 checkpoint of Llama-3.1-8B's drafter geometry (one layer, hidden 4096, 32/8
/// heads of 128, MLP 14336, draft vocabulary 32000) in `dir`, bf16 zeros: the memory a drafter
/// takes depends on its shapes alone.
fn write_eagle3_8b(dir: &std::path::Path) {
    use safetensors::tensor::{Dtype, TensorView};
    std::fs::create_dir_all(dir).unwrap();
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 1, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": 131072, "vocab_size": 128256,
        "draft_vocab_size": 32000, "tie_word_embeddings": false
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let (d, ff, qw, kw, dv) = (4096usize, 14336usize, 4096usize, 1024usize, 32000usize);
    let shapes: Vec<(&str, Vec<usize>)> = vec![
        ("fc.weight", vec![d, 3 * d]),
        ("midlayer.input_layernorm.weight", vec![d]),
        ("midlayer.hidden_norm.weight", vec![d]),
        ("midlayer.self_attn.q_proj.weight", vec![qw, 2 * d]),
        ("midlayer.self_attn.k_proj.weight", vec![kw, 2 * d]),
        ("midlayer.self_attn.v_proj.weight", vec![kw, 2 * d]),
        ("midlayer.self_attn.o_proj.weight", vec![d, qw]),
        ("midlayer.post_attention_layernorm.weight", vec![d]),
        ("midlayer.mlp.gate_proj.weight", vec![ff, d]),
        ("midlayer.mlp.up_proj.weight", vec![ff, d]),
        ("midlayer.mlp.down_proj.weight", vec![d, ff]),
        ("norm.weight", vec![d]),
        ("lm_head.weight", vec![dv, d]),
    ];
    let zeros = vec![0u8; 2 * 3 * d * d.max(ff) * 2];
    let d2t = vec![0u8; 8 * dv];
    let mut views: Vec<(String, TensorView<'_>)> = shapes
        .iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            (
                name.to_string(),
                TensorView::new(Dtype::BF16, shape.clone(), &zeros[..2 * n]).unwrap(),
            )
        })
        .collect();
    views.push(("d2t".into(), TensorView::new(Dtype::I64, vec![dv], &d2t).unwrap()));
    safetensors::tensor::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU (run through the device tool)"]
fn gpu_dummy_llama_3_1_8b_with_an_eagle3_drafter_allocates_the_pages_kvfleet_check_predicts() {
    use kvfleet::serving::serve::{on_gpu_with, LoadedWeights};
    use kvfleet_engine::engine::speculative::{SpecConfig, SpecMethod};
    let dir = std::env::temp_dir().join(format!("kvfleet-eagle3-8b-{}", std::process::id()));
    write_eagle3_8b(&dir);
    let c = LlamaConfig::llama(32, 4096, 14336, 32, 8, 128_256);
    for (dtype, name) in [(KvDtype::Bf16, "bfloat16"), (KvDtype::Fp8E4m3, "fp8_e4m3")] {
        let _one = GPU.lock().unwrap_or_else(|p| p.into_inner());
        let o = opts(dtype);
        let spec_config = SpecConfig {
            method: SpecMethod::Eagle3,
            model: Some(dir.to_string_lossy().into_owned()),
            ..SpecConfig::ngram(3)
        };
        // What the worker serves: the drafter loaded and reserved before the pools, attached.
        let (m, cap) = on_gpu_with(LoadedWeights::Dummy(c.clone()), &o, 1, Some(&spec_config))
            .expect("dummy Llama-3.1-8B with the drafter on the GPU");
        let pools = m.kv_config();
        let pages: Vec<u64> = pools.groups.iter().map(|g| g.num_blocks as u64).collect();
        drop(m);
        let spec = dummy_llama_3_1_8b_spec(
            name,
            serde_json::json!({"speculative": {"method": "eagle3", "numSpeculativeTokens": 3, "draftModel": {
                "pvcName": "d", "path": "x/",
                "geometry": {"layers": 1, "hiddenSize": 4096, "queryHeads": 32, "kvHeads": 8,
                             "headDim": 128, "intermediateSize": 14336, "vocabSize": 32000}}}}),
        );
        let geometry = plan::Geometry::from_spec(spec.model.geometry.as_ref().unwrap()).unwrap();
        let total = planner_memory(&cap.device, cap.total_bytes as u64);
        let check = plan::spec_capacity(&spec, &geometry, total, dtype.spec()).unwrap();
        let planned: Vec<u64> = check.plan.kvfleet.groups.iter().map(|g| g.num_blocks).collect();
        eprintln!(
            "Llama-3.1-8B {name} KV with EAGLE-3: check {} tokens {planned:?} pages, drafter {:?} bytes off the budget; worker {} tokens {pages:?} pages, drafterBytes {}",
            check.kvfleet_tokens, check.plan.memory.drafter_bytes, cap.kv_tokens, cap.drafter_bytes
        );
        assert!(cap.drafter_bytes > 0, "the drafter was reserved");
        within_one_page(&format!("Llama-3.1-8B {name} with EAGLE-3"), &planned, &pages);
        assert!(
            check.kvfleet_tokens.abs_diff(cap.kv_tokens as u64) <= 16,
            "{name}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
