//! `cargo bench --bench attention` (or the built binary with `--out DIR`): times kvfleet's CUDA
//! attention on the issue-8 shapes with CUDA events (median of N after warm-up), after checking
//! each output against the f64 CPU reference. Ceilings (copy bandwidth, bf16 GEMM) and peers
//! (PyTorch SDPA, FlashInfer) come from `bench/peers.py` run in the same device call: pass its
//! JSON with `--anchors FILE` and the ratios are printed here.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use cudarc::driver::sys::CUevent_flags;
use kvfleet_cuda::device::{Gpu, Kernels, KvLayer, StepBuffers};
use kvfleet_cuda::plan::plan_step;
use kvfleet_cuda::scenarios::{RequestShape, Scenario};
use kvfleet_cuda::spec::{GroupSize, HeadDim, KernelDtype, KernelSpec, KvDtype, Mask, PageSize};

struct Args {
    iters: usize,
    out: Option<String>,
    anchors: Option<String>,
    only: Option<String>,
    /// Overrides the decode kernel's occupancy when planning (`--ctas-per-sm N`).
    ctas_per_sm: Option<usize>,
}

fn parse_args() -> Args {
    let mut a = Args {
        iters: 30,
        out: None,
        anchors: None,
        only: None,
        ctas_per_sm: None,
    };
    let v: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < v.len() {
        let next = v.get(i + 1).cloned();
        match v[i].as_str() {
            "--iters" => a.iters = next.and_then(|s| s.parse().ok()).unwrap_or(30),
            "--out" => a.out = next,
            "--anchors" => a.anchors = next,
            "--only" => a.only = next,
            "--ctas-per-sm" => a.ctas_per_sm = next.and_then(|s| s.parse().ok()),
            "--bench" => {
                i += 1;
                continue;
            }
            _ => {
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    a
}

/// Median of `iters` CUDA-event timings (ms) of `f` after 5 warm-ups.
fn time_ms(gpu: &Gpu, iters: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..5 {
        f();
    }
    gpu.synchronize().expect("sync");
    let mut ts = Vec::with_capacity(iters);
    for _ in 0..iters {
        let s = gpu
            .stream()
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .expect("event");
        f();
        let e = gpu
            .stream()
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .expect("event");
        e.synchronize().expect("sync");
        ts.push(s.elapsed_ms(&e).expect("elapsed") as f64);
    }
    ts.sort_by(|a, b| a.partial_cmp(b).unwrap());
    ts[ts.len() / 2]
}

fn spec(dtype: KvDtype, group: GroupSize, mask: Mask) -> KernelSpec {
    KernelSpec {
        dtype,
        head_dim: HeadDim::D128,
        page: PageSize::P16,
        group,
        mask,
    }
}

struct Prepared {
    sc: Scenario,
    kv: KvLayer,
    q: cudarc::driver::CudaSlice<u16>,
    o: cudarc::driver::CudaSlice<u16>,
}

fn prepare(gpu: &Gpu, s: KernelSpec, kv_heads: usize, reqs: &[RequestShape], seed: u64) -> Prepared {
    let sc = Scenario::random(s, kv_heads, reqs, 0, seed, Some(97));
    let kv = KvLayer::from_scenario(gpu, &sc).expect("kv upload");
    let q = gpu.upload(&sc.q).expect("q");
    let o = gpu.upload(&vec![0x7fc1u16; sc.q.len()]).expect("o");
    Prepared { sc, kv, q, o }
}

/// Decode CTAs resident at once for `kernels`: the device's occupancy, or `ctas_per_sm` per SM.
fn slots(gpu: &Gpu, kernels: &Kernels, ctas_per_sm: Option<usize>) -> usize {
    ctas_per_sm.map_or_else(|| kernels.decode_slots(gpu.num_sms), |c| gpu.num_sms * c)
}

/// Runs one step, checks requests `check` against the reference, then times the step.
fn run_case(
    gpu: &Gpu,
    p: &mut Prepared,
    ctas_per_sm: Option<usize>,
    check: &[usize],
    iters: usize,
) -> (f64, f64) {
    let s = p.sc.spec;
    let kernels = gpu.kernels(&s).expect("compile");
    let plan = plan_step(
        &p.sc.batch,
        &s,
        gpu.arch,
        p.kv.kv_heads,
        slots(gpu, &kernels, ctas_per_sm),
    );
    let mut step = StepBuffers::upload(gpu, &s, &p.kv, &p.sc.batch, &plan).expect("step upload");
    kernels
        .attention(gpu.stream(), &p.kv, &p.q, &mut p.o, &mut step, p.sc.sm_scale, 0)
        .expect("launch");
    gpu.synchronize().expect("sync");
    let out = gpu.download(&p.o).expect("download");
    let refs = p.sc.references(Some(check), Some(16));
    let cmp =
        p.sc.check(&refs, &out, 1e-3)
            .unwrap_or_else(|e| panic!("WRONG RESULT, not timing: {e}"));
    let ms = time_ms(gpu, iters, || {
        kernels
            .attention(gpu.stream(), &p.kv, &p.q, &mut p.o, &mut step, p.sc.sm_scale, 0)
            .expect("launch");
    });
    (ms, cmp.max_gpu_err)
}

fn main() {
    let args = parse_args();
    let gpu = match Gpu::open(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let seed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1);
    println!(
        "device {} (sm {}.{}, {} SMs), target {}, seed {seed}",
        gpu.name, gpu.capability.0, gpu.capability.1, gpu.num_sms, gpu.arch
    );
    let anchors: BTreeMap<String, serde_json::Value> = args
        .anchors
        .as_ref()
        .and_then(|p| std::fs::read_to_string(p).ok())
        .and_then(|s| serde_json::from_str(&s).ok())
        .unwrap_or_default();
    let anchor = |k: &str| anchors.get(k).and_then(|v| v.as_f64());
    let copy = anchor("copy_GBps");
    let gemm = anchor("gemm_bf16_TFLOPs");
    let want = |name: &str| args.only.as_ref().is_none_or(|o| name.contains(o.as_str()));
    let mut rows: Vec<(String, String)> = Vec::new();
    let mut json = serde_json::Map::new();
    let target = args.ctas_per_sm;

    // --- decode: batch 64, ctx 4096, 32 q / 8 kv heads, d128, page 16 ---------------------------
    let (bs, ctx, kvh) = (64usize, 4096usize, 8usize);
    let mut decode_us = BTreeMap::new();
    for dtype in [KvDtype::Bf16, KvDtype::Fp8E4m3, KvDtype::Fp8E5m2, KvDtype::Nvfp4] {
        let name = format!("decode_{}", dtype.key_name());
        if !want(&name) {
            continue;
        }
        let s = spec(dtype, GroupSize::G4, Mask::Causal);
        let reqs = vec![
            RequestShape {
                q_len: 1,
                n_keys: ctx,
                first_pos: 0
            };
            bs
        ];
        let mut p = prepare(&gpu, s, kvh, &reqs, seed);
        let (ms, err) = run_case(&gpu, &mut p, target, &[0, bs - 1], args.iters);
        let kv_bytes = (bs * ctx * kvh * 2 * (dtype.data_bytes(128) + dtype.scale_bytes(128))) as f64;
        let qo_bytes = (bs * 32 * 128 * 2 * 2) as f64;
        let gbs = (kv_bytes + qo_bytes) / (ms * 1e-3) / 1e9;
        decode_us.insert(dtype.key_name(), ms * 1e3);
        let mut line = format!("{:9.1} us {:7.0} GB/s", ms * 1e3, gbs);
        if let Some(c) = copy {
            line += &format!("  {:5.1}% of copy", 100.0 * gbs / c);
        }
        let peer = match dtype {
            KvDtype::Bf16 => anchor("fi_decode_bf16_us"),
            KvDtype::Fp8E4m3 => anchor("fi_decode_fp8_us"),
            _ => None,
        };
        if let Some(pu) = peer {
            line += &format!("  FlashInfer {pu:.1} us (ours {:.2}x faster)", pu / (ms * 1e3));
        }
        if dtype != KvDtype::Bf16 {
            if let Some(b) = decode_us.get("bf16") {
                line += &format!("  {:.2}x vs bf16", b / (ms * 1e3));
            }
        }
        line += &format!("  max|err| {err:.1e}");
        if let Ok((regs, spill, ctas)) = gpu.kernels(&s).and_then(|k| k.attention_resources(true)) {
            line += &format!("  [{regs} regs, {spill} B spilled, {ctas} CTAs/SM]");
        }
        json.insert(
            name.clone(),
            serde_json::json!({"us": ms * 1e3, "GBps": gbs, "max_err": err}),
        );
        println!("{name:<22} {line}");
        rows.push((name, line));
    }

    // --- prefill: causal, 8 x 4096, 32 q heads, d128 (GQA 32/8 and MHA 32/32) --------------------
    for (group, kvh) in [(GroupSize::G4, 8usize), (GroupSize::G1, 32usize)] {
        let name = format!("prefill_causal_bf16_g{}", group.get());
        if !want(&name) {
            continue;
        }
        let s = spec(KvDtype::Bf16, group, Mask::Causal);
        let reqs = vec![
            RequestShape {
                q_len: 4096,
                n_keys: 4096,
                first_pos: 0
            };
            8
        ];
        let mut p = prepare(&gpu, s, kvh, &reqs, seed ^ 1);
        let (ms, err) = run_case(&gpu, &mut p, target, &[7], args.iters.min(20));
        let flops = 4.0 * 8.0 * 32.0 * 4096.0 * 4096.0 * 128.0 / 2.0;
        let tf = flops / (ms * 1e-3) / 1e12;
        let mut line = format!("{:9.3} ms {:7.1} TFLOP/s", ms, tf);
        if let Some(g) = gemm {
            line += &format!("  {:5.1}% of GEMM", 100.0 * tf / g);
        }
        if let Some(sd) = anchor("sdpa_causal_TFLOPs") {
            line += &format!("  SDPA flash {sd:.0} TFLOP/s (ours {:.2}x)", tf / sd);
        }
        line += &format!("  max|err| {err:.1e}");
        json.insert(
            name.clone(),
            serde_json::json!({"ms": ms, "TFLOPs": tf, "max_err": err}),
        );
        println!("{name:<22} {line}");
        rows.push((name, line));
    }

    // --- mixed step: 256 decodes (ctx 2048) + one 2048-token prefill chunk (ctx 4096) -------------
    if want("mixed") {
        let s = spec(KvDtype::Bf16, GroupSize::G4, Mask::Causal);
        let mut reqs = vec![
            RequestShape {
                q_len: 1,
                n_keys: 2048,
                first_pos: 0
            };
            256
        ];
        reqs.push(RequestShape {
            q_len: 2048,
            n_keys: 4096,
            first_pos: 0,
        });
        let mut p = prepare(&gpu, s, 8, &reqs, seed ^ 2);
        let (mixed_ms, err) = run_case(&gpu, &mut p, target, &[0, 256], args.iters);
        // the two parts alone, same caches: decode-only and prefill-only batches
        let split = |range: std::ops::Range<usize>| {
            let b = &p.sc.batch;
            let mut sub = kvfleet_cuda::plan::CsrBatch {
                qo_indptr: vec![0],
                kv_indptr: vec![0],
                ..Default::default()
            };
            for r in range {
                let (q0, q1) = (b.qo_indptr[r], b.qo_indptr[r + 1]);
                let (k0, k1) = (b.kv_indptr[r] as usize, b.kv_indptr[r + 1] as usize);
                sub.qo_indptr.push(sub.qo_indptr.last().unwrap() + (q1 - q0));
                sub.kv_indices.extend_from_slice(&b.kv_indices[k0..k1]);
                sub.kv_indptr.push(sub.kv_indices.len() as u32);
                sub.kv_last_page_len.push(b.kv_last_page_len[r]);
                sub.kv_first_pos.push(b.kv_first_pos[r]);
            }
            sub
        };
        let kernels = gpu.kernels(&s).expect("compile");
        let target = slots(&gpu, &kernels, args.ctas_per_sm);
        let dec = split(0..256);
        let pre = split(256..257);
        let mut sd = StepBuffers::upload(&gpu, &s, &p.kv, &dec, &plan_step(&dec, &s, gpu.arch, 8, target))
            .expect("upload");
        let mut sp = StepBuffers::upload(&gpu, &s, &p.kv, &pre, &plan_step(&pre, &s, gpu.arch, 8, target))
            .expect("upload");
        // Q rows of the parts are prefixes/suffixes of the mixed Q; timing only needs valid buffers
        let scale = p.sc.sm_scale;
        let dec_ms = time_ms(&gpu, args.iters, || {
            kernels
                .attention(gpu.stream(), &p.kv, &p.q, &mut p.o, &mut sd, scale, 0)
                .expect("launch");
        });
        let pre_ms = time_ms(&gpu, args.iters, || {
            kernels
                .attention(gpu.stream(), &p.kv, &p.q, &mut p.o, &mut sp, scale, 0)
                .expect("launch");
        });
        let line = format!(
            "{:9.1} us mixed vs {:.1} us decode + {:.1} us prefill = {:.1} us separate ({:.2}x)  max|err| {err:.1e}",
            mixed_ms * 1e3,
            dec_ms * 1e3,
            pre_ms * 1e3,
            (dec_ms + pre_ms) * 1e3,
            (dec_ms + pre_ms) / mixed_ms
        );
        json.insert(
            "mixed".into(),
            serde_json::json!({"mixed_us": mixed_ms * 1e3, "decode_us": dec_ms * 1e3, "prefill_us": pre_ms * 1e3, "max_err": err}),
        );
        println!("{:<22} {line}", "mixed_256dec_2048pre");
        rows.push(("mixed_256dec_2048pre".into(), line));
    }

    if let Some(dir) = &args.out {
        let path = format!("{dir}/kvfleet_bench.json");
        let mut j = json;
        j.insert("device".into(), gpu.name.clone().into());
        j.insert(
            "anchors".into(),
            serde_json::to_value(&anchors).unwrap_or_default(),
        );
        let _ = std::fs::write(&path, serde_json::to_string_pretty(&j).unwrap_or_default());
    }
    println!("\n== kvfleet attention on {} ==", gpu.name);
    if let (Some(c), Some(g)) = (copy, gemm) {
        println!("ceilings (same run): copy {c:.0} GB/s, bf16 GEMM {g:.0} TFLOP/s");
    }
    for (n, l) in rows {
        println!("{n:<22} {l}");
    }
}
