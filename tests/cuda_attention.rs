//! GPU tests of the CUDA attention backend against the f64 CPU reference, with FlashAttention's
//! bound (`max|gpu - ref| <= 2 * max|lowp_naive - ref| + atol`), fresh random inputs each run
//! (the seed is printed) and outputs poisoned with NaN before every launch.
//! Run on a machine with an NVIDIA GPU: `cargo test --test cuda_attention -- --ignored`.

use std::time::{SystemTime, UNIX_EPOCH};

use kvfleet_cuda::device::{Gpu, KvLayer};
use kvfleet_cuda::selftest;
use kvfleet_cuda::spec::{GroupSize, HeadDim, KernelSpec, KvDtype, Mask, PageSize};
use kvfleet_engine::engine::quant;

fn seed() -> u64 {
    let s = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1);
    println!("seed {s}");
    s
}

fn gpu() -> Gpu {
    Gpu::open(0).unwrap_or_else(|e| panic!("this test needs an NVIDIA GPU: {e}"))
}

fn spec(dtype: KvDtype, head_dim: HeadDim, group: GroupSize, mask: Mask) -> KernelSpec {
    KernelSpec {
        dtype,
        head_dim,
        page: PageSize::P16,
        group,
        mask,
    }
}

/// The sweep: every dtype x every mask at head_dim 128 / group 4; head dims 64 and 256 and
/// groups 1, 2, 8 on bf16, fp8 and nvfp4.
fn sweep() -> Vec<KernelSpec> {
    let mut v = Vec::new();
    for dtype in KvDtype::ALL {
        for mask in Mask::ALL {
            v.push(spec(dtype, HeadDim::D128, GroupSize::G4, mask));
        }
    }
    for dtype in [KvDtype::Bf16, KvDtype::Fp8E4m3, KvDtype::Nvfp4] {
        for hd in [HeadDim::D64, HeadDim::D256] {
            v.push(spec(dtype, hd, GroupSize::G4, Mask::Causal));
        }
        for g in [GroupSize::G1, GroupSize::G2, GroupSize::G8] {
            v.push(spec(dtype, HeadDim::D128, g, Mask::CausalSliding));
        }
    }
    v
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_attention_matches_cpu_reference_across_the_sweep() {
    let gpu = gpu();
    let base = seed();
    let mut failures = Vec::new();
    for (i, s) in sweep().iter().enumerate() {
        match selftest::run(&gpu, s, 2, base.wrapping_add(i as u64)) {
            Ok(c) => println!(
                "{:<28} max|gpu-ref| {:.2e}  bound {:.2e}  (lowp {:.2e}, |ref| {:.2})",
                s.key(),
                c.max_gpu_err,
                c.bound,
                c.max_lowp_err,
                c.max_ref
            ),
            Err(e) => {
                println!("{:<28} FAILED: {e}", s.key());
                failures.push(e.to_string());
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} specialisations failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_append_quantizes_bit_exactly_like_the_host_encoder() {
    use rand::{Rng, SeedableRng};
    let gpu = gpu();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed());
    let (kv_heads, page, n_tokens) = (2usize, 16usize, 37usize);
    for dtype in KvDtype::ALL {
        for hd in [HeadDim::D64, HeadDim::D128, HeadDim::D256] {
            let s = spec(dtype, hd, GroupSize::G4, Mask::Causal);
            let d = hd.get();
            let kernels = gpu.kernels(&s).unwrap();
            let num_blocks = 8;
            let mut kv = KvLayer::zeroed(&gpu, dtype, num_blocks, kv_heads, page, d).unwrap();
            kv.k_scale = quant::suggested_scale(dtype, 3.0);
            kv.v_scale = quant::suggested_scale(dtype, 5.0);
            // distinct random slots, plus one padding token (-1)
            let mut all: Vec<i64> = (0..(num_blocks * page) as i64).collect();
            for i in (1..all.len()).rev() {
                all.swap(i, rng.random_range(0..=i));
            }
            let mut slots: Vec<i64> = all[..n_tokens].to_vec();
            slots[5] = -1;
            let vals: Vec<f32> = (0..n_tokens * kv_heads * d * 2)
                .map(|_| half::bf16::from_f32((rng.random::<f32>() - 0.5) * 8.0).to_f32())
                .collect();
            let (kx, vx) = vals.split_at(n_tokens * kv_heads * d);
            let bits = |x: &[f32]| {
                x.iter()
                    .map(|v| half::bf16::from_f32(*v).to_bits())
                    .collect::<Vec<u16>>()
            };
            let nk = gpu.upload(&bits(kx)).unwrap();
            let nv = gpu.upload(&bits(vx)).unwrap();
            let ds = gpu.upload(&slots).unwrap();
            kernels
                .append(gpu.stream(), &mut kv, &nk, &nv, &ds, n_tokens, &slots)
                .unwrap();
            gpu.synchronize().unwrap();
            let k = gpu.download(&kv.k).unwrap();
            let v = gpu.download(&kv.v).unwrap();
            let kbs = gpu.download(&kv.k_block_scales).unwrap();
            let vbs = gpu.download(&kv.v_block_scales).unwrap();
            let (rb, sb) = (dtype.data_bytes(d), dtype.scale_bytes(d));
            let mut mismatches = 0;
            let mut written = vec![false; num_blocks * page];
            for (t, &slot) in slots.iter().enumerate() {
                if slot < 0 {
                    continue;
                }
                written[slot as usize] = true;
                let (p, off) = (slot as usize / page, slot as usize % page);
                for h in 0..kv_heads {
                    let row = (p * kv_heads + h) * page + off;
                    let src = (t * kv_heads + h) * d;
                    for (pool, scales, x, scale) in [
                        (&k, &kbs, &kx[src..src + d], kv.k_scale),
                        (&v, &vbs, &vx[src..src + d], kv.v_scale),
                    ] {
                        let (mut want, mut want_s) = (vec![0u8; rb], vec![0u8; sb]);
                        quant::encode_vector_as_kernels(dtype, x, scale, &mut want, &mut want_s);
                        if pool[row * rb..(row + 1) * rb] != want[..] {
                            mismatches += 1;
                        }
                        if sb > 0 && scales[row * sb..(row + 1) * sb] != want_s[..] {
                            mismatches += 1;
                        }
                    }
                }
            }
            // untouched slots stay zero (the padding token wrote nothing)
            for (slot, w) in written.iter().enumerate() {
                if !w {
                    let (p, off) = (slot / page, slot % page);
                    for h in 0..kv_heads {
                        let row = (p * kv_heads + h) * page + off;
                        assert!(
                            k[row * rb..(row + 1) * rb].iter().all(|b| *b == 0),
                            "{}: slot {slot} written",
                            s.key()
                        );
                    }
                }
            }
            assert_eq!(
                mismatches,
                0,
                "{}: {mismatches} rows differ from the host encoder",
                s.key()
            );
            println!("{} append: {} tokens bit-exact", s.key(), n_tokens - 1);
        }
    }
}
