//! Gemma 3 on the GPU (`model::gpu::GpuLlama` with `gemma3` set, and the CUDA attention
//! backend's sliding-window layer group) against the CPU engine on the same inputs.
//!
//! Every test needs an NVIDIA GPU: `cargo test --test cuda_gemma3 -- --ignored` on the device
//! (with `LD_LIBRARY_PATH=/usr/local/cuda/lib64` for cuBLAS). The Gemma 3 270M GGUF comes from
//! env `KVFLEET_GEMMA3_GGUF`, else `.tools/models/gemma-3-270m-q4_k_m.gguf`.
//!
//! Bounds:
//! - attention: the same bf16 Q/K/V into both backends; the GPU rounds the softmax
//!   probabilities to bf16 before P·V (relative 2^-9) and sums in another order, so
//!   `max|gpu - cpu| <= 1e-2 * max|cpu| + 1e-3`; a key outside the window moves an output
//!   by the order of the outputs themselves (checked: the local and the global layer differ).
//! - logits: as tests/cuda_model.rs, `max|gpu - cpu| <= 0.05 * max|cpu|` per step (bf16
//!   weights and GEMM inputs on the GPU, f32 on the CPU).

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use kvfleet_cuda::backend::CudaBackend;
use kvfleet_cuda::device::Gpu;
use kvfleet_cuda::gpu::{GpuLlama, GpuOptions};
use kvfleet_engine::engine::capacity::{pool_layout, PoolParams, PoolSize};
use kvfleet_engine::engine::cpu::CpuBackend;
use kvfleet_engine::engine::direct::DirectPlanner;
use kvfleet_engine::engine::{Backend, KvDtype, StepPlan};
use kvfleet_engine::model::forward::{step_direct, CpuForward, Forward};
use kvfleet_engine::model::gguf::Gguf;
use kvfleet_engine::model::llama::{Llama, LlamaConfig, SeqChunk};
use kvfleet_engine::model::sampling::argmax;
use rand::{Rng, SeedableRng};

const REL_BOUND: f32 = 0.05;

fn gpu() -> Arc<Gpu> {
    static G: OnceLock<Arc<Gpu>> = OnceLock::new();
    G.get_or_init(|| match GpuLlama::open_gpu(0) {
        Ok(g) => g,
        Err(e) => panic!("this test needs an NVIDIA GPU: {e}"),
    })
    .clone()
}

fn bf16_round(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

/// `(max |a - b|, max |b|)`.
fn diff(a: &[f32], b: &[f32]) -> (f32, f32) {
    assert_eq!(a.len(), b.len(), "lengths differ");
    let d = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
    let s = b.iter().map(|x| x.abs()).fold(0.0, f32::max);
    (d, s)
}

/// Steps of two sequences over a window of 40 tokens (pages of 16): prefills longer than the
/// window, a chunk crossing it next to a decode, then decodes until the local group has freed
/// leading pages of both.
fn window_steps() -> Vec<Vec<(u64, usize, usize)>> {
    let mut steps = vec![vec![(1, 0, 70), (2, 0, 30)], vec![(1, 70, 1), (2, 30, 25)]];
    for i in 0..24 {
        steps.push(vec![(2, 55 + i, 1), (1, 71 + i, 1)]);
    }
    steps
}

#[test]
#[ignore = "needs an NVIDIA GPU (run through the device tool)"]
fn gpu_windowed_attention_on_its_own_page_table_matches_the_cpu_backend() {
    // Gemma 3's attention (4 query heads over 1 KV head of 256), 5 local layers of window 40
    // and 1 global layer: two page tables, the local one dropping pages that left the window.
    let cfg = LlamaConfig::gemma3(6, 256, 512, 300, 40);
    let pools = pool_layout(
        &cfg.kv_layers(cfg.n_kv_heads).unwrap(),
        0,
        &PoolParams::pages(KvDtype::Bf16, 16),
        PoolSize::Pages(64),
    )
    .unwrap();
    assert_eq!(pools.groups.len(), 2);
    let mut cpu = CpuBackend::new(pools.clone()).expect("CPU pools");
    let mut cuda = CudaBackend::new(gpu(), pools.clone()).expect("CUDA pools");
    let mut planner = DirectPlanner::new(16, &pools.groups);
    let mut plan = StepPlan::default();
    let local_group = pools.groups.iter().position(|g| g.window == Some(40)).unwrap();
    let local_layer = pools.layers.iter().position(|l| l.group == local_group).unwrap();
    let global_layer = pools.layers.iter().position(|l| l.group != local_group).unwrap();
    let (qw, kw) = (4 * 256, 256);
    let mut rng = rand::rngs::StdRng::seed_from_u64(20);
    let mut freed_seen = false;
    let (mut worst, mut window_effect) = (0f32, 0f32);
    for (si, step) in window_steps().iter().enumerate() {
        planner.plan(step, &mut plan).expect("plan");
        freed_seen |= plan.groups[local_group].kv_first_pos.iter().any(|&p| p > 0);
        let t: usize = step.iter().map(|s| s.2).sum();
        let mut rand = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| bf16_round(rng.random_range(-2.0f32..2.0)))
                .collect()
        };
        let (q, k, v) = (rand(t * qw), rand(t * kw), rand(t * kw));
        cpu.prepare(&plan).unwrap();
        cuda.prepare(&plan).unwrap();
        let mut qb = cuda.alloc(t * qw).unwrap();
        let mut kb = cuda.alloc(t * kw).unwrap();
        let mut vb = cuda.alloc(t * kw).unwrap();
        let mut ob = cuda.alloc(t * qw).unwrap();
        cuda.upload(&q, &mut qb).unwrap();
        cuda.upload(&k, &mut kb).unwrap();
        cuda.upload(&v, &mut vb).unwrap();
        let mut outs = Vec::new();
        for layer in 0..pools.layers.len() {
            let mut want = vec![0f32; t * qw];
            cpu.append_kv(layer, &k, &v).unwrap();
            cpu.attention(layer, &q, &mut want).unwrap();
            cuda.append_kv(layer, &kb, &vb).unwrap();
            cuda.attention(layer, &qb, &mut ob).unwrap();
            let mut got = vec![0f32; t * qw];
            cuda.download(&ob, &mut got).unwrap();
            assert!(
                got.iter().all(|x| x.is_finite()),
                "step {si} layer {layer}: not finite"
            );
            let (d, s) = diff(&got, &want);
            worst = worst.max(d / s.max(1e-12));
            assert!(
                d <= 1e-2 * s + 1e-3,
                "step {si} layer {layer} (window {:?}): max|gpu - cpu| = {d} (max|cpu| {s})",
                pools.layers[layer].attn.window
            );
            outs.push(want);
        }
        let (d, s) = diff(&outs[local_layer], &outs[global_layer]);
        window_effect = window_effect.max(d / s.max(1e-12));
    }
    eprintln!(
        "windowed attention: max|gpu - cpu| / max|cpu| = {worst:.2e}; local vs global layer on the same \
         inputs differ by up to {window_effect:.3} of max|out|"
    );
    assert!(
        freed_seen,
        "the local group never dropped a page: the window was not exercised"
    );
    assert!(
        window_effect > 0.1,
        "local and global layers agree ({window_effect}): the window masked nothing"
    );
    // Every page comes back.
    planner.release(1);
    planner.release(2);
    assert_eq!(planner.kv().used_blocks(), 0);
}

fn chunk(seq: u64, start_pos: usize, tokens: &[u32], want_logits: bool) -> SeqChunk<'_> {
    SeqChunk {
        seq,
        start_pos,
        tokens,
        logits: usize::from(want_logits),
    }
}

/// Greedy decoding of `n` tokens after `prompt` (prefilled in chunks of `chunk_len`) through
/// `f` with its own page tables; returns tokens and the logits each was chosen from.
fn greedy(
    f: &mut dyn Forward,
    seq: u64,
    prompt: &[u32],
    n: usize,
    chunk_len: usize,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut planner = DirectPlanner::new(f.kv_config().block_size, &f.kv_config().groups);
    let mut plan = StepPlan::default();
    let mut pos = 0;
    let mut logits = Vec::new();
    while pos < prompt.len() {
        let end = (pos + chunk_len).min(prompt.len());
        let c = [chunk(seq, pos, &prompt[pos..end], end == prompt.len())];
        logits = step_direct(f, &mut planner, &c, &mut plan).expect("prefill");
        pos = end;
    }
    let mut toks = prompt.to_vec();
    let (mut out, mut seen) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let next = argmax(&logits);
        seen.push(logits.clone());
        out.push(next);
        toks.push(next);
        let c = [chunk(seq, toks.len() - 1, &toks[toks.len() - 1..], true)];
        logits = step_direct(f, &mut planner, &c, &mut plan).expect("decode");
    }
    planner.release(seq);
    assert_eq!(planner.kv().used_blocks(), 0, "every page returned");
    (out, seen)
}

fn top2(l: &[f32]) -> (u32, f32, f32) {
    let best = argmax(l);
    let second = l
        .iter()
        .enumerate()
        .filter(|(i, _)| *i as u32 != best)
        .map(|(_, v)| *v)
        .fold(f32::NEG_INFINITY, f32::max);
    (best, l[best as usize], second)
}

fn gpu_opts() -> GpuOptions {
    GpuOptions {
        kv_dtype: KvDtype::Bf16,
        max_kv_tokens: Some(16384),
        max_batched_tokens: 512,
        max_num_seqs: 16,
        max_model_len: Some(4096),
        ..GpuOptions::default()
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU (run through the device tool)"]
fn gpu_dummy_gemma3_geometry_matches_the_cpu_engine_past_the_window() {
    // Random weights of Gemma 3's block: 6 layers (5 local of window 24, 1 global), d 256.
    let cfg = LlamaConfig::gemma3(6, 256, 512, 300, 24);
    let m = Arc::new(Llama::dummy(cfg, 9).expect("dummy Gemma 3"));
    let pools = pool_layout(
        &m.config.kv_layers(m.config.n_kv_heads).unwrap(),
        0,
        &PoolParams::pages(KvDtype::Bf16, 16),
        PoolSize::Pages(64),
    )
    .unwrap();
    let mut cpu = CpuForward::new(m.clone(), CpuBackend::new(pools).unwrap()).unwrap();
    let mut g = GpuLlama::from_llama(gpu(), &m, &gpu_opts()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        g.kv_config().groups.len(),
        2,
        "full and local page tables on the GPU"
    );
    let prompt: Vec<u32> = (0..50).map(|i| (i * 13 + 1) % 300).collect();
    let (ct, cl) = greedy(&mut cpu, 1, &prompt, 12, 20);
    let (gt, gl) = greedy(&mut g, 1, &prompt, 12, 20);
    for (i, (a, b)) in gl.iter().zip(&cl).enumerate() {
        let (d, s) = diff(a, b);
        eprintln!("dummy step {i}: max|gpu - cpu| = {d:.3e} (max|cpu| {s:.3})");
        assert!(d <= REL_BOUND * s + 1e-4, "step {i}: {d} > {REL_BOUND} x {s}");
        if ct[i] != gt[i] {
            break;
        }
    }
}

fn gemma_path() -> PathBuf {
    if let Some(p) = std::env::var_os("KVFLEET_GEMMA3_GGUF") {
        return PathBuf::from(p);
    }
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".tools/models/gemma-3-270m-q4_k_m.gguf");
    assert!(
        p.exists(),
        "Gemma 3 GGUF not found at {} and KVFLEET_GEMMA3_GGUF is unset (install it with .ci/install-tools)",
        p.display()
    );
    p
}

/// The fixture's prompts (token ids) and transformers' greedy tokens (tests/model_gemma3.rs).
fn fixture() -> Vec<(Vec<u32>, Vec<u32>)> {
    let v: serde_json::Value =
        serde_json::from_str(include_str!("fixtures/gemma3_270m_reference.json")).expect("fixture");
    v["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| {
            (
                serde_json::from_value(c["ids"].clone()).unwrap(),
                serde_json::from_value(c["greedy"].clone()).unwrap(),
            )
        })
        .collect()
}

#[test]
#[ignore = "needs an NVIDIA GPU (run through the device tool)"]
fn gpu_gemma3_270m_greedy_tokens_equal_the_cpu_engine_with_bf16_kv() {
    let g = Gguf::open(&gemma_path()).expect("open the Gemma 3 GGUF");
    let m = Arc::new(Llama::from_gguf(&g).expect("load Gemma 3"));
    let pools = pool_layout(
        &m.config.kv_layers(m.config.n_kv_heads).unwrap(),
        0,
        &PoolParams::pages(KvDtype::Bf16, 16),
        PoolSize::Pages(256),
    )
    .unwrap();
    let mut cpu = CpuForward::new(m.clone(), CpuBackend::new(pools).unwrap()).unwrap();
    let mut gm = GpuLlama::from_llama(gpu(), &m, &gpu_opts()).unwrap_or_else(|e| panic!("{e}"));
    let cap = gm.capacity().clone();
    eprintln!(
        "Gemma 3 270M on {}: groups {:?}",
        cap.device,
        gm.kv_config().groups
    );
    let cases = fixture();
    assert!(
        cases.iter().any(|c| c.0.len() > 512),
        "a prompt longer than the window"
    );
    let (mut exact, mut worst, mut same_as_hf) = (0, 0f32, 0);
    for (i, (ids, hf)) in cases.iter().enumerate() {
        let n = hf.len();
        // Chunks of 256: the long prompt's local-layer pages leave the window during prefill.
        let (ct, cl) = greedy(&mut cpu, i as u64, ids, n, 256);
        let (gt, gl) = greedy(&mut gm, i as u64, ids, n, 256);
        same_as_hf += (gt == *hf) as usize;
        let first = ct.iter().zip(&gt).position(|(a, b)| a != b);
        for (s, (a, b)) in gl.iter().zip(&cl).enumerate().take(first.map_or(n, |f| f + 1)) {
            let (d, sc) = diff(a, b);
            worst = worst.max(d / sc);
            assert!(
                d <= REL_BOUND * sc + 1e-4,
                "prompt {i} step {s}: max|gpu - cpu| = {d} exceeds {REL_BOUND} x max|cpu| {sc}"
            );
        }
        match first {
            None => exact += 1,
            Some(s) => {
                let (c1, cv, c2) = top2(&cl[s]);
                let (d, _) = diff(&gl[s], &cl[s]);
                eprintln!(
                    "prompt {i} ({} tokens): departs at step {s}: CPU {c1} (margin {:.4}) vs GPU {}; max|gpu - cpu| \
                     there {d:.4}",
                    ids.len(),
                    cv - c2,
                    gt[s]
                );
                // Only a near tie that the measured bf16 error can flip is accepted.
                assert!(
                    cv - c2 <= 2.0 * d,
                    "prompt {i}: GPU departs from the CPU at step {s} where the CPU's top two are {} apart, more \
                     than twice the logit error {d}\nCPU {ct:?}\nGPU {gt:?}",
                    cv - c2
                );
            }
        }
        eprintln!("prompt {i} ({} tokens): CPU {ct:?}\n    GPU {gt:?}", ids.len());
    }
    eprintln!(
        "Gemma 3 270M, bf16 KV: {exact} of {} prompts give the CPU engine's {} greedy tokens exactly; \
         max|gpu - cpu| / max|cpu| {worst:.4}; {same_as_hf} equal transformers' exactly",
        cases.len(),
        cases[0].1.len()
    );
    assert!(
        exact * 2 > cases.len(),
        "only {exact} of {} prompts equal",
        cases.len()
    );
}
