//! The KV-capacity planner against published vLLM logs, every architecture fixture, and
//! the `kvfleet plan` command line.

use std::path::PathBuf;
use std::process::Command;

use kvfleet::plan::memory::GIB;
use kvfleet::plan::{
    blocks_per_request, plan, spec_capacity, EngineParams, Geometry, KvCacheDtype, LayerKind, MemoryInput,
    PlanInputs, ReportingEra,
};
use serde_json::Value;

fn fixture_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/plan")
        .join(name)
}

fn fixture(name: &str) -> Value {
    let text = std::fs::read_to_string(fixture_path(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    serde_json::from_str(&text).unwrap()
}

fn geometry(name: &str) -> Geometry {
    Geometry::from_hf_config(&fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn params(tp: u32, max_model_len: u64, mnbt: u64) -> EngineParams {
    EngineParams {
        tp,
        dtype: KvCacheDtype::Auto,
        block_size: 16,
        max_model_len,
        max_num_batched_tokens: mnbt,
    }
}

fn plan_with(g: &Geometry, p: EngineParams, era: ReportingEra, avail: u64) -> kvfleet::plan::Plan {
    let inputs = PlanInputs {
        engine: p,
        era,
        memory: MemoryInput::AvailableKv { bytes: avail },
        request_len: None,
    };
    plan(g, &inputs).unwrap()
}

fn count(g: &Geometry, f: impl Fn(LayerKind) -> bool) -> usize {
    g.layers.iter().filter(|l| f(l.kind)).count()
}

// === published cases ===

/// The fixture config behind each case of kv_capacity_public.json, and the
/// max_num_batched_tokens the logging server ran with where the case states it.
fn case_setup(id: &str) -> (&'static str, u64) {
    match id {
        "lmcache-1739-qwen3-14b-tp1" => ("qwen3-14b.json", 8192),
        "lmcache-1769-llama31-70b-tp4" => ("llama-3.1-70b.json", 8192),
        "arm-learning-paths-mistral7b-gptq-dgxspark" => ("mistral-7b-instruct-v0.2.json", 8192),
        // The case notes: API server on < 70 GiB GPUs defaults to 2048.
        "internal-gemma4-31b-awq-tp2-2x24gb" => ("gemma-4-31b-it.json", 2048),
        // "Chunked prefill ... max_num_batched_tokens=2048" in the quoted log.
        "blog-huikang-gpt-oss-120b-tp1" => ("gpt-oss-120b.json", 2048),
        other => panic!("no fixture for case {other}: add one"),
    }
}

#[test]
fn every_public_case_is_reproduced_within_the_rounding_of_the_logged_gib() {
    let cases: Vec<Value> = serde_json::from_value(fixture("kv_capacity_public.json")).unwrap();
    assert!(cases.len() >= 5);
    for case in &cases {
        let id = case["id"].as_str().unwrap();
        let (config, mnbt) = case_setup(id);
        let g = geometry(config);
        // The fixture geometry is the one the case was computed with.
        let c = &case["config"];
        assert_eq!(
            g.layers.len() as u64,
            c["num_hidden_layers"].as_u64().unwrap(),
            "{id}"
        );
        assert!(
            g.layers
                .iter()
                .any(|l| u64::from(l.kv_heads) == c["num_key_value_heads"].as_u64().unwrap()),
            "{id}"
        );
        assert!(
            g.layers
                .iter()
                .any(|l| u64::from(l.head_dim) == c["head_dim"].as_u64().unwrap()),
            "{id}"
        );

        let p = EngineParams {
            tp: case["tp"].as_u64().unwrap() as u32,
            dtype: KvCacheDtype::Auto,
            block_size: case["block_size"].as_u64().unwrap() as u32,
            max_model_len: case["max_model_len"].as_u64().unwrap(),
            max_num_batched_tokens: mnbt,
        };
        let gib = case["available_kv_gib"].as_f64().unwrap();
        // vLLM logs "%.2f GiB": the true value lies in [gib - 0.005, gib + 0.005).
        let lo = ((gib - 0.005) * GIB as f64).ceil() as u64;
        let hi = ((gib + 0.005) * GIB as f64).floor() as u64 - 1;
        let era = ReportingEra::V0_10ToV0_20;
        let (plo, phi) = (plan_with(&g, p, era, lo), plan_with(&g, p, era, hi));
        let reported = case["reported_tokens"].as_u64().unwrap();
        assert!(
            plo.vllm.kv_cache_size_tokens <= reported && reported <= phi.vllm.kv_cache_size_tokens,
            "{id}: reported {reported} outside [{}, {}]",
            plo.vllm.kv_cache_size_tokens,
            phi.vllm.kv_cache_size_tokens
        );
        if let Some(conc) = case["reported_max_concurrency"].as_f64() {
            let (a, b) = (plo.vllm.max_concurrency, phi.vllm.max_concurrency);
            assert!(
                (a - 0.005..b + 0.005).contains(&conc),
                "{id}: reported {conc}x outside [{a:.4}, {b:.4}]"
            );
        }
    }
}

#[test]
fn gemma4_31b_on_two_24gb_gpus_logs_25200_tokens_and_1_87x() {
    let g = geometry("gemma-4-31b-it.json");
    assert_eq!(
        count(&g, |k| matches!(k, LayerKind::Sliding { window: 1024 })),
        50
    );
    assert_eq!(count(&g, |k| k == LayerKind::Full), 10);
    let full = g.layers.iter().find(|l| l.kind == LayerKind::Full).unwrap();
    assert_eq!((full.kv_heads, full.head_dim), (4, 512));
    let p = params(2, 131_072, 2048);
    let plan = plan_with(
        &g,
        p,
        ReportingEra::V0_10ToV0_20,
        kvfleet::plan::memory::gib_to_bytes(11.54),
    );
    let v = &plan.vllm;
    assert_eq!(v.groups.len(), 6, "5 sliding groups + 1 full group of 10 layers");
    assert!(v
        .groups
        .iter()
        .all(|g| g.layers.len() == 10 && g.page_bytes == 131_072));
    let fullg = v.groups.iter().find(|g| g.kind == LayerKind::Full).unwrap();
    assert_eq!(
        fullg.block_size, 32,
        "the full layers' 65,536-byte page is unified by doubling block_size"
    );
    assert_eq!(fullg.blocks_per_request, 4096);
    assert!(v
        .groups
        .iter()
        .filter(|g| g.kind != LayerKind::Full)
        .all(|g| g.blocks_per_request == 193));
    assert_eq!(v.num_blocks, 9453);
    assert_eq!(v.blocks_per_request, 5061);
    assert_eq!(v.kv_cache_size_tokens, 25_200);
    assert_eq!(format!("{:.2}", v.max_concurrency), "1.87");
    // The same pool as vLLM >= 0.21 logs it.
    let c = v
        .tokens_by_era
        .iter()
        .find(|(e, _)| *e == ReportingEra::V0_21On)
        .unwrap()
        .1;
    assert_eq!(c, (9453.0 / 5061.0 * 131_072.0) as u64);
    // With max_num_batched_tokens 8192 the sliding groups need 577 blocks: 1.35x.
    let p8 = plan_with(
        &g,
        params(2, 131_072, 8192),
        ReportingEra::V0_10ToV0_20,
        v.available_kv_bytes,
    );
    assert_eq!(format!("{:.2}", p8.vllm.max_concurrency), "1.35");
}

#[test]
fn sliding_window_budget_of_16001_tokens_is_1001_blocks_uncapped_and_576_capped() {
    use kvfleet::plan::vllm::{sliding_admission_blocks, SlidingAdmission};
    let w = LayerKind::Sliding { window: 1024 };
    assert_eq!(
        sliding_admission_blocks(SlidingAdmission::Uncapped, 1024, 16_001, 8192, 131_072, 16),
        1001
    );
    assert_eq!(
        sliding_admission_blocks(SlidingAdmission::WindowPlusChunk, 1024, 16_001, 8192, 131_072, 16),
        576
    );
    assert_eq!(blocks_per_request(w, 16_001, 8192, 16), 576);
    // vLLM's bound since PR #40946 adds a block for chunks that start mid-block.
    assert_eq!(
        sliding_admission_blocks(SlidingAdmission::StartupBound, 1024, 16_001, 8192, 131_072, 16),
        577
    );
}

#[test]
fn kvfleet_never_needs_more_than_vllm_and_saves_on_sliding_models() {
    let g = geometry("gemma-4-31b-it.json");
    let avail = 11 * GIB;
    let p = plan_with(&g, params(2, 131_072, 8192), ReportingEra::V0_21On, avail);
    assert!(p.kvfleet.bytes_per_request < p.vllm.bytes_per_request());
    assert!(p.kvfleet.max_concurrency >= p.vllm.max_concurrency);
    // Pools never exceed the memory.
    let used: u64 = p
        .kvfleet
        .groups
        .iter()
        .map(|g| g.num_blocks * g.block_bytes)
        .sum();
    assert!(used <= avail);
    // A full-attention model: both models agree to the block.
    let l = geometry("llama-3.1-70b.json");
    let q = plan_with(&l, params(4, 131_072, 8192), ReportingEra::V0_21On, 32 * GIB);
    assert_eq!(q.kvfleet.groups[0].num_blocks, q.vllm.num_blocks);
    assert_eq!(q.kvfleet.capacity_tokens, q.vllm.kv_cache_size_tokens);
}

// === every architecture family ===

#[test]
fn llama_derives_head_dim_from_hidden_size() {
    let g = geometry("llama-3.1-70b.json");
    assert_eq!(g.layers.len(), 80);
    assert!(g
        .layers
        .iter()
        .all(|l| l.kind == LayerKind::Full && l.kv_heads == 8 && l.head_dim == 128));
}

#[test]
fn mistral_v02_is_full_attention_and_v01_slides_everywhere() {
    let g = geometry("mistral-7b-instruct-v0.2.json");
    assert_eq!(count(&g, |k| k == LayerKind::Full), 32);
    let g = geometry("mistral-7b-v0.1.json");
    assert_eq!(count(&g, |k| k == LayerKind::Sliding { window: 4096 }), 32);
    // All layers share one spec: a single vLLM group with window-capped requests.
    let p = plan_with(&g, params(1, 32_768, 8192), ReportingEra::V0_21On, 8 * GIB);
    assert_eq!(p.vllm.groups.len(), 1);
    assert_eq!(p.vllm.blocks_per_request, (4095u64 + 8192).div_ceil(16) + 1);
}

#[test]
fn qwen2_and_qwen3_ignore_a_disabled_sliding_window() {
    let g = geometry("qwen2.5-7b-instruct.json");
    assert_eq!(count(&g, |k| k == LayerKind::Full), 28);
    assert!(g.layers.iter().all(|l| l.kv_heads == 4 && l.head_dim == 128));
    let g = geometry("qwen3-14b.json");
    assert_eq!(count(&g, |k| k == LayerKind::Full), 40);
}

#[test]
fn qwen3_moe_attention_is_what_counts() {
    let g = geometry("qwen3-30b-a3b.json");
    assert_eq!(g.layers.len(), 48);
    assert!(g.layers.iter().all(|l| l.kv_heads == 4 && l.head_dim == 128));
}

#[test]
fn gemma2_alternates_sliding_and_full_layers() {
    let g = geometry("gemma-2-9b-it.json");
    assert_eq!(g.layers[0].kind, LayerKind::Sliding { window: 4096 });
    assert_eq!(g.layers[1].kind, LayerKind::Full);
    assert_eq!(count(&g, |k| k == LayerKind::Full), 21);
    // 21 + 21 layers of equal pages: 2 groups of 21.
    let p = plan_with(&g, params(1, 8192, 8192), ReportingEra::V0_10ToV0_20, 4 * GIB);
    assert_eq!(p.vllm.groups.len(), 2);
    assert_eq!(p.vllm.group_size, 21);
}

#[test]
fn gemma3_multimodal_reads_text_config_and_its_pattern() {
    let g = geometry("gemma-3-12b-it.json");
    assert_eq!(g.layers.len(), 48);
    assert_eq!(count(&g, |k| k == LayerKind::Full), 8);
    assert_eq!(g.layers[5].kind, LayerKind::Full);
    assert_eq!(g.layers[4].kind, LayerKind::Sliding { window: 1024 });
    assert!(g.notes.iter().any(|n| n.contains("text_config")));
}

#[test]
fn gpt_oss_alternates_128_token_windows() {
    let g = geometry("gpt-oss-120b.json");
    assert_eq!(count(&g, |k| k == LayerKind::Sliding { window: 128 }), 18);
    assert_eq!(count(&g, |k| k == LayerKind::Full), 18);
}

#[test]
fn glm_chatglm_keys_give_multi_query_groups() {
    let g = geometry("glm-4-9b-chat.json");
    assert_eq!(g.layers.len(), 40);
    assert!(g.layers.iter().all(|l| l.kv_heads == 2 && l.head_dim == 128));
    // tp 4 over 2 KV heads replicates: one head per rank.
    let p = plan_with(&g, params(4, 8192, 8192), ReportingEra::V0_21On, GIB);
    assert_eq!(p.layer_bytes[0].kv_heads_per_rank, 1);
}

#[test]
fn granite_is_llama_shaped() {
    let g = geometry("granite-3.1-8b-instruct.json");
    assert_eq!(g.layers.len(), 40);
    assert!(g.layers.iter().all(|l| l.kv_heads == 8 && l.head_dim == 128));
}

#[test]
fn deepseek_mla_caches_one_576_value_latent_per_layer() {
    let g = geometry("deepseek-v3.json");
    assert_eq!(g.layers.len(), 61);
    assert!(g
        .layers
        .iter()
        .all(|l| l.kind == LayerKind::Mla && l.head_dim == 576));
    // bf16 at tp 8: 576 x 2 bytes per layer per token, replicated on every rank.
    let p = plan_with(&g, params(8, 16_384, 8192), ReportingEra::V0_21On, 10 * GIB);
    assert_eq!(p.layer_bytes[0].bytes_per_token, 1152);
    assert_eq!(p.vllm.bytes_per_block, 1152 * 16 * 61);
}

#[test]
fn gemma4_text_config_and_draft_layers() {
    let g = geometry("gemma-4-31b-it.json").with_draft_layers(2).unwrap();
    assert_eq!(g.layers.len(), 62);
    assert_eq!(g.draft_layers, 2);
    assert_eq!(g.layers[61].kind, LayerKind::Full);
}

#[test]
fn unknown_architecture_names_the_missing_keys() {
    let cfg = serde_json::json!({"architectures": ["MysteryLM"], "hidden_size": 1024});
    let err = Geometry::from_hf_config(&cfg).unwrap_err().to_string();
    assert!(
        err.contains("MysteryLM") && err.contains("num_hidden_layers") && err.contains("num_attention_heads"),
        "{err}"
    );
}

#[test]
fn geometry_from_the_crd_matches_the_config() {
    let spec: kvfleet::api::ModelGeometry = serde_json::from_value(serde_json::json!({
        "layers": 6, "queryHeads": 32, "kvHeads": 16, "headDim": 256, "slidingWindow": 1024,
        "globalHeadDim": 512, "globalKvHeads": 4,
        "layerTypes": ["sliding_attention", "sliding_attention", "sliding_attention",
                       "sliding_attention", "sliding_attention", "full_attention"]
    }))
    .unwrap();
    let g = Geometry::from_spec(&spec).unwrap();
    let hf = geometry("gemma-4-31b-it.json");
    assert_eq!(g.layers[..], hf.layers[..6]);
}

// === spec capacity (validator / controller API) ===

fn spec(max_model_len: i64, tp: i32, weights: &str, runtime: &str) -> kvfleet::api::InferenceDeploymentSpec {
    serde_json::from_value(serde_json::json!({
        "model": {"name": "gemma-4-31b-it", "weightBytes": weights,
                  "geometry": {"layers": 60, "queryHeads": 32, "kvHeads": 16, "headDim": 256}},
        "engine": {"runtime": runtime, "maxModelLen": max_model_len, "tensorParallelSize": tp,
                   "maxNumBatchedTokens": 8192, "maxNumSeqs": 64}
    }))
    .unwrap()
}

#[test]
fn spec_capacity_fits_and_reports_both_models() {
    let g = geometry("gemma-4-31b-it.json");
    let s = spec(131_072, 2, "19Gi", "kvfleet");
    let c = spec_capacity(&s, &g, 24 * GIB, KvCacheDtype::Auto).unwrap();
    assert!(c.fits_one_request, "{:?}", c.fix_hint());
    assert!(c.fix_hint().is_none());
    assert!(c.max_concurrency >= c.vllm_max_concurrency);
    assert!(c.kvfleet_tokens > 131_072);
    assert_eq!(
        c.available_kv_bytes,
        (24.0 * 0.9 * GIB as f64) as u64 - 19 * GIB / 2 - GIB
    );
}

#[test]
fn spec_that_cannot_fit_one_request_names_the_fixes() {
    let g = geometry("llama-3.1-70b.json");
    let s = spec(131_072, 2, "120Gi", "vllm");
    let c = spec_capacity(&s, &g, 80 * GIB, KvCacheDtype::Auto).unwrap();
    assert!(!c.fits_one_request);
    let fix = c.fix.clone().unwrap();
    let hint = c.fix_hint().unwrap();
    let l = fix.max_model_len_that_fits.unwrap();
    assert!(l < 131_072 && l > 1000, "{l}");
    assert!(hint.contains(&format!("lower maxModelLen to {l}")), "{hint}");
    assert!(fix.fp8_fits && hint.contains("fp8"), "{hint}");
    assert_eq!(fix.tensor_parallel_size_that_fits, Some(4));
    assert!(hint.contains("tensorParallelSize"), "{hint}");
}

#[test]
fn spec_without_weights_says_it_assumed_zero() {
    let g = geometry("qwen3-14b.json");
    let mut s = spec(32_768, 1, "1", "kvfleet");
    s.model.weight_bytes = None;
    let c = spec_capacity(&s, &g, 80 * GIB, KvCacheDtype::Fp8).unwrap();
    assert!(
        c.explanation.iter().any(|e| e.contains("assumed 0")),
        "{:?}",
        c.explanation
    );
}

// === the command line ===

fn kvfleet(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvfleet"))
        .arg("plan")
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn cli_json_carries_vllm_and_kvfleet_numbers_and_per_group_detail() {
    let cfg = fixture_path("gemma-4-31b-it.json");
    let (code, out, err) = kvfleet(&[
        "--model-config",
        cfg.to_str().unwrap(),
        "--tp",
        "2",
        "--kv-cache-dtype",
        "auto",
        "--max-model-len",
        "131072",
        "--available-kv-gib",
        "11.54",
        "--max-num-batched-tokens",
        "2048",
        "--vllm-version",
        "0.19.1",
        "--request-len",
        "16001",
        "--output",
        "json",
    ]);
    assert_eq!(code, 0, "{err}");
    let j: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(j["vllm"]["num_blocks"], 9453);
    assert_eq!(j["vllm"]["kv_cache_size_tokens"], 25_200);
    assert_eq!(
        format!("{:.2}", j["vllm"]["max_concurrency"].as_f64().unwrap()),
        "1.87"
    );
    assert!(j["kvfleet"]["capacity_tokens"].as_u64().unwrap() > 0);
    assert!(j["kvfleet"]["max_concurrency"].as_f64().unwrap() > 1.8);
    for side in ["vllm", "kvfleet"] {
        let groups = j[side]["groups"].as_array().unwrap();
        assert!(!groups.is_empty());
        for g in groups {
            assert!(g["layers"].as_array().is_some_and(|l| !l.is_empty()), "{g}");
            assert!(g["page_bytes"].as_u64().is_some_and(|b| b > 0), "{g}");
            assert!(g["blocks_per_request"].as_u64().is_some_and(|b| b > 0), "{g}");
        }
    }
}

#[test]
fn cli_text_explains_the_arithmetic_line_by_line() {
    let cfg = fixture_path("gemma-4-31b-it.json");
    let (code, out, err) = kvfleet(&[
        "--model-config",
        cfg.to_str().unwrap(),
        "--tp",
        "2",
        "--max-model-len",
        "131072",
        "--available-kv-gib",
        "11.54",
        "--max-num-batched-tokens",
        "2048",
        "--vllm-version",
        "0.19",
    ]);
    assert_eq!(code, 0, "{err}");
    for needle in [
        "max(1, 16 / 2) = 8 KV heads per rank",
        "block_size 16 x 2 = 32 tokens",
        "num_blocks = 12,390,980,649 // 1,310,720 = 9,453",
        "cdiv(min(1024 - 1 + 2048, 131072), 16) + 1 = 193",
        "cdiv(131072, 32) = 4,096",
        "9,453 / 5,061 = 1.8678 -> \"1.87x\"",
        "9,453 // 6 x 16 = 25,200   <- selected",
    ] {
        assert!(out.contains(needle), "missing {needle:?} in:\n{out}");
    }
}

#[test]
fn cli_predicts_from_a_gpu_product() {
    let cfg = fixture_path("llama-3.1-70b.json");
    let (code, out, err) = kvfleet(&[
        "--model-config",
        cfg.to_str().unwrap(),
        "--tp",
        "4",
        "--max-model-len",
        "131072",
        "--gpu",
        "NVIDIA-H100-80GB-HBM3",
        "--gpu-memory-utilization",
        "0.9",
        "--weight-gib",
        "131.4",
        "--output",
        "json",
    ]);
    assert_eq!(code, 0, "{err}");
    let j: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(j["memory"]["source"], "predicted");
    assert!(j["vllm"]["num_blocks"].as_u64().unwrap() > 30_000);
}

#[test]
fn cli_rejects_inconsistent_input_with_exit_2_and_a_clear_message() {
    let cfg = fixture_path("llama-3.1-70b.json");
    let c = cfg.to_str().unwrap();
    let cases: &[(&[&str], &str)] = &[
        (
            &["--tp", "3", "--max-model-len", "8192", "--available-kv-gib", "10"],
            "not divisible by tensor parallel size 3",
        ),
        (
            &["--max-model-len", "8192", "--available-kv-gib", "0"],
            "positive number of GiB",
        ),
        (
            &["--max-model-len", "8192", "--gpu-memory-gib", "0"],
            "positive number of GiB",
        ),
        (
            &[
                "--kv-cache-dtype",
                "int3",
                "--max-model-len",
                "8192",
                "--available-kv-gib",
                "10",
            ],
            "fp8_e4m3",
        ),
        (
            &["--max-model-len", "0", "--available-kv-gib", "10"],
            "at least 1 token",
        ),
        (&["--max-model-len", "8192"], "--available-kv-gib"),
        (
            &["--max-model-len", "8192", "--gpu", "NVIDIA-Imaginary"],
            "unknown GPU product",
        ),
        (
            &[
                "--max-model-len",
                "8192",
                "--available-kv-gib",
                "10",
                "--gpu",
                "Tesla-T4",
            ],
            "cannot be used with",
        ),
        (
            &[
                "--max-model-len",
                "8192",
                "--available-kv-gib",
                "10",
                "--vllm-version",
                "next",
            ],
            "MAJOR.MINOR",
        ),
        (
            &[
                "--max-model-len",
                "8192",
                "--gpu-memory-gib",
                "80",
                "--gpu-memory-utilization",
                "1.5",
            ],
            "(0, 1]",
        ),
    ];
    for (args, needle) in cases {
        let mut all = vec!["--model-config", c];
        all.extend_from_slice(args);
        let (code, _, err) = kvfleet(&all);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: expected {needle:?} in {err}");
    }
    let (code, _, err) = kvfleet(&[
        "--model-config",
        "/nonexistent/config.json",
        "--max-model-len",
        "8",
        "--available-kv-gib",
        "1",
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("cannot read"), "{err}");
}

#[test]
fn cli_rejects_nvfp4_for_head_dims_it_cannot_pack() {
    let dir = std::env::temp_dir().join(format!("kvfleet-plan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("config.json");
    std::fs::write(
        &cfg,
        r#"{"architectures":["LlamaForCausalLM"],"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":4,"head_dim":72}"#,
    )
    .unwrap();
    let (code, _, err) = kvfleet(&[
        "--model-config",
        cfg.to_str().unwrap(),
        "--kv-cache-dtype",
        "nvfp4",
        "--max-model-len",
        "8192",
        "--available-kv-gib",
        "1",
    ]);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(code, 2);
    assert!(
        err.contains("not a multiple of 16") && err.contains("use fp8"),
        "{err}"
    );
}

// === invariants over random geometries ===

mod random {
    use super::*;
    use kvfleet::plan::LayerGeometry;
    use proptest::prelude::*;

    fn layer() -> impl Strategy<Value = LayerGeometry> {
        let kind = prop_oneof![
            Just(LayerKind::Full),
            Just(LayerKind::Mla),
            prop::sample::select(vec![1u32, 128, 512, 1024, 4096])
                .prop_map(|w| LayerKind::Sliding { window: w }),
        ];
        (
            kind,
            prop::sample::select(vec![1u32, 2, 4, 8, 16]),
            prop::sample::select(vec![64u32, 128, 256, 512]),
        )
            .prop_map(|(kind, kv_heads, head_dim)| match kind {
                LayerKind::Mla => LayerGeometry {
                    kind,
                    kv_heads: 1,
                    head_dim: 576,
                },
                _ => LayerGeometry {
                    kind,
                    kv_heads,
                    head_dim,
                },
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        #[test]
        fn pools_fit_memory_and_kvfleet_never_budgets_more_than_vllm(
            pattern in prop::collection::vec(layer(), 1..4),
            repeats in 1usize..20,
            tp in prop::sample::select(vec![1u32, 2, 4, 8]),
            dtype in prop::sample::select(KvCacheDtype::ALL.to_vec()),
            block_size in prop::sample::select(vec![1u32, 16, 32, 128]),
            max_model_len in 1u64..300_000,
            mnbt in 1u64..20_000,
            avail in 0u64..(96 * GIB),
        ) {
            let layers: Vec<LayerGeometry> = pattern.iter().cycle().take(pattern.len() * repeats).copied().collect();
            let g = Geometry {
                architecture: "random".into(),
                query_heads: 64,
                layers,
                draft_layers: 0,
                hidden_size: None,
                notes: vec![],
            };
            let inputs = PlanInputs {
                engine: EngineParams { tp, dtype, block_size, max_model_len, max_num_batched_tokens: mnbt },
                era: ReportingEra::V0_21On,
                memory: MemoryInput::AvailableKv { bytes: avail },
                request_len: Some(max_model_len / 2 + 1),
            };
            // Never panics; errors are for inputs vLLM rejects too (page sizes, nvfp4, zero memory).
            if let Ok(p) = plan(&g, &inputs) {
                prop_assert!(p.vllm.num_blocks * p.vllm.bytes_per_block <= avail);
                let used: u64 = p.kvfleet.groups.iter().map(|g| g.num_blocks * g.block_bytes).sum();
                prop_assert!(used <= avail, "kvfleet pools {used} > {avail}");
                prop_assert!(p.kvfleet.bytes_per_request <= p.vllm.bytes_per_request(),
                    "kvfleet {} > vllm {}", p.kvfleet.bytes_per_request, p.vllm.bytes_per_request());
                prop_assert_eq!(p.vllm.fits_one_request, p.vllm.bytes_per_request() <= avail);
                prop_assert_eq!(p.kvfleet.fits_one_request, p.kvfleet.bytes_per_request <= avail);
            }
        }
    }
}
