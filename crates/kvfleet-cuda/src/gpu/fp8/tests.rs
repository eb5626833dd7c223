use half::bf16;
use kvfleet_engine::model::fp8::{e4m3fn_to_f32, quantize_rows, Fp8Weight};

use super::super::blas::{Blas, Gemm};
use super::super::gemv::{Input, Output};
use super::super::kernels::{Glu, ModelKernels, Norm};
use super::super::lt::{Lt, ScalePick};
use super::super::options::GpuTuning;
use super::*;

/// Values of every magnitude an activation or weight row has, as bf16 (what the kernels
/// read), with a few zeros and an outlier a row.
fn bf16_rows(rows: usize, k: usize, seed: u32) -> Vec<u16> {
    (0..rows * k)
        .map(|i| {
            let x = ((i as f32 + seed as f32) * 0.618_034).sin();
            let v = match i % 97 {
                0 => 0.0,
                1 => x * 40.0,
                _ => x * (1.0 + (i % 13) as f32) * 0.01,
            };
            bf16::from_f32(v).to_bits()
        })
        .collect()
}

/// The host's products `xd[r] · wd[c]` (rows of `kk`) at `picks`, and their largest magnitude.
fn dequantized_products(xd: &[f32], wd: &[f32], kk: usize, picks: &[(usize, usize)]) -> (Vec<f32>, f32) {
    let want: Vec<f32> = picks
        .iter()
        .map(|&(r, c)| {
            xd[r * kk..(r + 1) * kk]
                .iter()
                .zip(&wd[c * kk..(c + 1) * kk])
                .map(|(a, b)| a * b)
                .sum()
        })
        .collect();
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    (want, scale)
}

/// An FP8 weight of `n` rows of `kk` from [`bf16_rows`] (`seed`) on the device, its
/// dequantized values on the host, and its host codes.
fn fp8_weight_codes(g: &Gpu, n: usize, kk: usize, seed: u32) -> (Mat, Vec<f32>, Fp8Weight) {
    let wq = quantize_rows(&to_f32(&bf16_rows(n, kk, seed)), n, kk);
    let mat = Mat::Fp8 {
        q: g.upload(&wq.data).unwrap(),
        scale: g.upload(&wq.scale).unwrap(),
    };
    (mat, wq.dequantize(), wq)
}

/// [`fp8_weight_codes`] without the codes.
fn fp8_weight(g: &Gpu, n: usize, kk: usize, seed: u32) -> (Mat, Vec<f32>) {
    let (mat, wd, _) = fp8_weight_codes(g, n, kk, seed);
    (mat, wd)
}

fn to_f32(v: &[u16]) -> Vec<f32> {
    v.iter().map(|b| bf16::from_bits(*b).to_f32()).collect()
}

fn gpu() -> Gpu {
    let g = Gpu::open(0).unwrap_or_else(|e| panic!("no GPU: {e}"));
    check_device(&g).unwrap_or_else(|e| panic!("{e}"));
    g
}

#[test]
#[ignore = "needs an NVIDIA GPU of compute capability 8.9 or later"]
fn gpu_quantize_kernel_matches_the_host_quantizer_byte_for_byte() {
    let g = gpu();
    let k = ModelKernels::load(&g, true, &GpuTuning::default()).unwrap();
    let f = k.fp8.as_ref().unwrap();
    let (rows, cols, ld) = (37, 1000, 1008);
    let x = bf16_rows(rows, ld, 3);
    let dx = g.upload(&x).unwrap();
    let s = g.stream();
    let mut q = s.alloc_zeros::<u8>(rows * cols).unwrap();
    let mut sc = s.alloc_zeros::<f32>(rows).unwrap();
    f.quantize_rows(s, &dx, rows, cols, ld, &mut q, &mut sc).unwrap();
    let (q, sc) = (g.download(&q).unwrap(), g.download(&sc).unwrap());
    let xf = to_f32(&x);
    let dense: Vec<f32> = (0..rows)
        .flat_map(|r| xf[r * ld..r * ld + cols].to_vec())
        .collect();
    let want = quantize_rows(&dense, rows, cols);
    assert_eq!(sc, want.scale, "row scales");
    let diff = q.iter().zip(&want.data).filter(|(a, b)| a != b).count();
    assert_eq!(diff, 0, "{diff} of {} bytes differ", q.len());
}

/// Positive scales spread over two orders of magnitude, as weight and token scales are.
fn scales(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| 1e-3 * (1.0 + 99.0 * (((i as f32 + seed as f32) * 0.754_877).sin() * 0.5 + 0.5)))
        .collect()
}

/// The fused gate/up epilogue, SwiGLU and quantization write the same bytes and scales as
/// the unfused path (`kvf_fp8_scale`, `kvf_silu_mul`, `kvf_quantize_rows_fp8`), on unscaled
/// rows with the weight's scales and on rows already scaled; and what they write is the
/// host's quantization of the activation within e4m3 and bf16 rounding.
#[test]
#[ignore = "needs an NVIDIA GPU of compute capability 8.9 or later"]
fn gpu_fused_glu_quantize_equals_the_unfused_path_bit_for_bit() {
    let g = gpu();
    let k = ModelKernels::load(&g, true, &GpuTuning::default()).unwrap();
    let f = k.fp8.as_ref().unwrap();
    let s = g.stream();
    // 1,024: the 16-byte path; 1,000 and 1,002: rows of other alignments take the scalar one.
    for (glu, ff) in [
        (Glu::Silu, 1024),
        (Glu::Silu, 1000),
        (Glu::Silu, 1002),
        (Glu::GeluTanh, 1024),
    ] {
        let t = 9;
        // Unscaled GEMM outputs: large values, as e4m3 products summed over k are.
        let gu: Vec<f32> = to_f32(&bf16_rows(t, 2 * ff, 7 + ff as u32))
            .iter()
            .map(|v| v * 3000.0)
            .collect();
        let (sx, sw) = (scales(t, 1), scales(2 * ff, 2));
        let dgu = g.upload(&gu).unwrap();
        let (dsx, dsw) = (g.upload(&sx).unwrap(), g.upload(&sw).unwrap());
        // Unfused: scale in place, SwiGLU to bf16, quantize.
        let mut scaled = g.upload(&gu).unwrap();
        f.scale(s, None, t, 2 * ff, &dsx, &dsw, false, &mut scaled)
            .unwrap();
        let mut act = s.alloc_zeros::<u16>(t * ff).unwrap();
        k.glu(glu, &scaled, t, ff, &mut act).unwrap();
        let mut want = Fp8Scratch::alloc(s, t, ff, 1).unwrap();
        f.quantize_rows(s, &act, t, ff, ff, &mut want.xq, &mut want.sx)
            .unwrap();
        let (wq, ws) = (g.download(&want.xq).unwrap(), g.download(&want.sx).unwrap());
        // Fused, from the unscaled rows (the token scales in the scratch, as the gate/up
        // GEMM leaves them) and from the scaled ones.
        for unscaled in [true, false] {
            let mut got = Fp8Scratch::alloc(s, t, ff, 1).unwrap();
            got.xq = g.upload(&vec![0x5au8; t * ff]).unwrap();
            got.sx = g.upload(&sx).unwrap();
            let (rows, sw) = if unscaled {
                (&dgu, Some(&dsw))
            } else {
                (&scaled, None)
            };
            f.glu_quantize(s, glu, rows, t, ff, sw, &mut got).unwrap();
            let (q, sc) = (g.download(&got.xq).unwrap(), g.download(&got.sx).unwrap());
            assert_eq!(sc, ws, "{glu:?} ff {ff}, unscaled {unscaled}: row scales");
            let diff = q.iter().zip(&wq).filter(|(a, b)| a != b).count();
            assert_eq!(
                diff,
                0,
                "{glu:?} ff {ff}, unscaled {unscaled}: {diff} of {} bytes differ",
                q.len()
            );
        }
        // Against the host: f(gate) * up from the scaled rows, in f32.
        let act_of = |x: f32| match glu {
            Glu::Silu => x / (1.0 + (-x).exp()),
            Glu::GeluTanh => 0.5 * x * (1.0 + (0.797_884_6 * (x + 0.044_715 * x * x * x)).tanh()),
        };
        let sc = g.download(&scaled).unwrap();
        for r in 0..t {
            let row = &sc[r * 2 * ff..(r + 1) * 2 * ff];
            let a: Vec<f32> = (0..ff).map(|i| act_of(row[i]) * row[ff + i]).collect();
            let amax = a.iter().fold(0f32, |m, v| m.max(v.abs()));
            // The row scale comes from the bf16-rounded activations: within 2^-8 of amax / 448.
            assert!(
                (ws[r] - amax / 448.0).abs() <= ws[r] / 256.0,
                "row {r}: scale {} vs {}",
                ws[r],
                amax / 448.0
            );
            for (i, v) in a.iter().enumerate() {
                let deq = e4m3fn_to_f32(wq[r * ff + i]) * ws[r];
                // e4m3: half a step is 2^-4 of the value (normals), 2^-10 of the scale
                // (subnormals); bf16 first: 2^-8 more.
                let bound = v.abs() * (1.0 / 16.0 + 1.0 / 256.0) + ws[r] / 1024.0 + 1e-12;
                assert!(
                    (deq - v).abs() <= bound,
                    "{glu:?} ff {ff} row {r}[{i}]: {deq} vs {v}"
                );
            }
        }
    }
}

/// RMSNorm straight into e4m3 rows writes what `kvf_rms_norm` then `kvf_quantize_rows_fp8`
/// write, for rows that fit the norm's registers (4,096) and rows that do not (5,008).
#[test]
#[ignore = "needs an NVIDIA GPU of compute capability 8.9 or later"]
fn gpu_fused_norm_quantize_equals_norm_then_quantize() {
    let g = gpu();
    let k = ModelKernels::load(&g, true, &GpuTuning::default()).unwrap();
    let f = k.fp8.as_ref().unwrap();
    let s = g.stream();
    for d in [4096, 5008] {
        let t = 6;
        let x: Vec<f32> = to_f32(&bf16_rows(t, d, 13)).iter().map(|v| v * 5.0).collect();
        let w: Vec<f32> = (0..d).map(|i| 0.5 + (i % 11) as f32 * 0.1).collect();
        let (dx, dw) = (g.upload(&x).unwrap(), g.upload(&w).unwrap());
        let norm = Norm::new(&dw, 1e-5);
        let mut h = s.alloc_zeros::<u16>(t * d).unwrap();
        k.rms_norm(&dx, t, d, norm, &mut h).unwrap();
        let mut want = Fp8Scratch::alloc(s, t, d, 1).unwrap();
        f.quantize_rows(s, &h, t, d, d, &mut want.xq, &mut want.sx)
            .unwrap();
        let mut got = Fp8Scratch::alloc(s, t, d, 1).unwrap();
        f.rms_norm_quantize(s, &dx, t, d, norm, &mut got).unwrap();
        assert_eq!(
            g.download(&got.sx).unwrap(),
            g.download(&want.sx).unwrap(),
            "d {d}: scales"
        );
        let (q, wq) = (g.download(&got.xq).unwrap(), g.download(&want.xq).unwrap());
        let diff = q.iter().zip(&wq).filter(|(a, b)| a != b).count();
        assert_eq!(diff, 0, "d {d}: {diff} of {} bytes differ", q.len());
        // And that is the host's quantization of the bf16 norm.
        let hq = quantize_rows(&to_f32(&g.download(&h).unwrap()), t, d);
        assert_eq!(q, hq.data, "d {d}: against the host quantizer");
    }
}

/// The unit-scale GEMM's residual add folded into the next norm writes the residual, the
/// bytes and the scales that `kvf_fp8_scale` (adding) then `kvf_rms_norm_fp8` write: rows
/// in registers (d 4,096) and not (5,008).
#[test]
#[ignore = "needs an NVIDIA GPU of compute capability 8.9 or later"]
fn gpu_fused_add_norm_quantize_equals_scale_add_then_norm() {
    let g = gpu();
    let k = ModelKernels::load(&g, true, &GpuTuning::default()).unwrap();
    let f = k.fp8.as_ref().unwrap();
    let s = g.stream();
    for d in [4096, 5008] {
        let t = 6;
        let x: Vec<f32> = to_f32(&bf16_rows(t, d, 13)).iter().map(|v| v * 5.0).collect();
        // An unscaled GEMM result: integers of e4m3 products' size.
        let prod: Vec<f32> = to_f32(&bf16_rows(t, d, 17)).iter().map(|v| v * 3.0e4).collect();
        let w: Vec<f32> = (0..d).map(|i| 0.5 + (i % 11) as f32 * 0.1).collect();
        let (sx, sw) = (scales(t, 3), scales(d, 7));
        let (dw, dsw) = (g.upload(&w).unwrap(), g.upload(&sw).unwrap());
        let norm = Norm::new(&dw, 1e-5);
        let scratch = |xs: &[f32]| {
            let mut sc = Fp8Scratch::alloc(s, t, d, d).unwrap();
            sc.d = g.upload(&prod).unwrap();
            sc.sx = g.upload(xs).unwrap();
            sc
        };
        let mut want_x = g.upload(&x).unwrap();
        let mut want = scratch(&sx);
        f.scale(s, Some(&want.d), t, d, &want.sx, &dsw, true, &mut want_x)
            .unwrap();
        f.rms_norm_quantize(s, &want_x, t, d, norm, &mut want).unwrap();
        let mut got_x = g.upload(&x).unwrap();
        let mut got = scratch(&sx);
        f.add_rms_norm_quantize(s, &dsw, &mut got_x, t, d, norm, &mut got)
            .unwrap();
        let (xg, xw) = (g.download(&got_x).unwrap(), g.download(&want_x).unwrap());
        let xdiff = xg
            .iter()
            .zip(&xw)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(xdiff, 0, "d {d}: {xdiff} of {} residual values differ", xw.len());
        assert!(
            xg.iter().zip(&x).any(|(a, b)| a != b),
            "d {d}: the residual did not change"
        );
        assert_eq!(
            g.download(&got.sx).unwrap(),
            g.download(&want.sx).unwrap(),
            "d {d}: scales"
        );
        let (q, wq) = (g.download(&got.xq).unwrap(), g.download(&want.xq).unwrap());
        let diff = q.iter().zip(&wq).filter(|(a, b)| a != b).count();
        assert_eq!(diff, 0, "d {d}: {diff} of {} bytes differ", q.len());
    }
}

/// The FP8 GEMM (W8A8: store and accumulate) and the FP8 GEMV (weight-only) against the
/// same products computed on the host from the dequantized values.
#[test]
#[ignore = "needs an NVIDIA GPU of compute capability 8.9 or later"]
fn gpu_fp8_gemm_and_gemv_equal_the_dequantized_products() {
    for pick in [ScalePick::PerRow, ScalePick::Unit, ScalePick::Timed] {
        fp8_products(pick);
    }
}

/// The FP8 GEMM at a width of Llama-3.1-8B (256 tokens x 4096 x 4096, where cuBLASLt 13.1
/// on an H200 takes per-row scales, unlike the small shapes of the test above) against the
/// host's products of the dequantized operands, stored and accumulated, with either pick;
/// 4,096 outputs sampled.
#[test]
#[ignore = "needs an NVIDIA GPU of compute capability 8.9 or later"]
fn gpu_fp8_gemm_at_a_model_width_equals_the_dequantized_products() {
    let g = gpu();
    let k = ModelKernels::load(&g, true, &GpuTuning::default()).unwrap();
    let (t, n, kk) = (256, 4096, 4096);
    let (mat, wd) = fp8_weight(&g, n, kk, 3);
    let x = bf16_rows(t, kk, 9);
    let xd = quantize_rows(&to_f32(&x), t, kk).dequantize();
    let dx = g.upload(&x).unwrap();
    let s = g.stream();
    let picks: Vec<(usize, usize)> = (0..4096usize).map(|i| ((i * 37) % t, (i * 7919) % n)).collect();
    let (want, scale) = dequantized_products(&xd, &wd, kk, &picks);
    for pick in [ScalePick::PerRow, ScalePick::Unit, ScalePick::Timed] {
        let blas = Blas::with_lt(s.clone(), Lt::new(s.clone(), pick).unwrap()).unwrap();
        let mut scratch = Fp8Scratch::alloc(s, t, kk, n).unwrap();
        let mut y = s.alloc_zeros::<f32>(t * n).unwrap();
        blas.project(&k, &mat, &dx, &mut y, Gemm::store(t, n, kk), &mut scratch)
            .unwrap();
        eprintln!(
            "{pick:?}: per-row scales in cuBLASLt: {:?}",
            blas.lt_planned_per_row((t, n, kk))
        );
        let once = g.download(&y).unwrap();
        blas.project(&k, &mat, &dx, &mut y, Gemm::add(t, n, kk), &mut scratch)
            .unwrap();
        let twice = g.download(&y).unwrap();
        for (i, &(r, c)) in picks.iter().enumerate() {
            let (a, b) = (once[r * n + c], twice[r * n + c]);
            // As the test above: 1e-3 of the largest value.
            assert!(
                (a - want[i]).abs() <= 1e-3 * scale,
                "{pick:?} store [{r}, {c}]: {a} vs {}",
                want[i]
            );
            assert!(
                (b - 2.0 * want[i]).abs() <= 2e-3 * scale,
                "{pick:?} add [{r}, {c}]: {b} vs {}",
                2.0 * want[i]
            );
        }
        if pick == ScalePick::Timed {
            // Token counts of one power-of-two bucket share the timed choice: 200 and 129
            // rows plan their own shapes and follow the 256 rows' choice without timing.
            assert_eq!(blas.lt_timed_choices(), 1);
            for tt in [200, 129] {
                blas.project(&k, &mat, &dx, &mut y, Gemm::store(tt, n, kk), &mut scratch)
                    .unwrap();
                assert_eq!(
                    blas.lt_planned_per_row((tt, n, kk)),
                    blas.lt_planned_per_row((t, n, kk)),
                    "{tt} rows"
                );
                let got = g.download(&y).unwrap();
                for (i, &(r, c)) in picks.iter().enumerate().filter(|(_, p)| p.0 < tt) {
                    assert!(
                        (got[r * n + c] - want[i]).abs() <= 1e-3 * scale,
                        "{tt} rows [{r}, {c}]: {} vs {}",
                        got[r * n + c],
                        want[i]
                    );
                }
            }
            assert_eq!(blas.lt_timed_choices(), 1, "one choice for 129..=256 rows");
            // 257 rows are the next bucket: timed anew.
            let x2 = bf16_rows(512, kk, 9);
            let dx2 = g.upload(&x2).unwrap();
            let mut scratch2 = Fp8Scratch::alloc(s, 512, kk, n).unwrap();
            let mut y2 = s.alloc_zeros::<f32>(512 * n).unwrap();
            blas.project(&k, &mat, &dx2, &mut y2, Gemm::store(257, n, kk), &mut scratch2)
                .unwrap();
            assert_eq!(
                blas.lt_timed_choices(),
                2,
                "257 rows are timed in their own bucket"
            );
        }
    }
}

/// `kvf_gemm_fp8_skinny`, the FP8 GEMM of steps of 2 to 8 tokens, against the host's
/// products of the dequantized operands, stored and accumulated, through the projections
/// that choose it: every token count from 1 (the kernel called directly) to 8, rows that do
/// not fill the last unit (113) and k tiles that the 8 warps do not divide (320 = 5 x 64),
/// then a down projection of Llama-3.1-8B (8 x 4096 x 14336) and gate/up's rows over a short
/// k (28672 x 128), 4,096 outputs sampled: units of 16 rows in the first two, of 32 in the
/// last (enough of them for two blocks an SM).
#[test]
#[ignore = "needs an NVIDIA GPU of compute capability 8.9 or later"]
fn gpu_fp8_skinny_gemm_equals_the_dequantized_products() {
    let g = gpu();
    let k = ModelKernels::load(&g, true, &GpuTuning::default()).unwrap();
    let f = k.fp8.as_ref().unwrap();
    let s = g.stream();
    let blas = Blas::with_lt(s.clone(), Lt::new(s.clone(), ScalePick::Timed).unwrap()).unwrap();
    for (n, kk, sampled) in [
        (113usize, 320usize, false),
        (4096, 14336, true),
        (28672, 128, true),
    ] {
        let (mat, wd) = fp8_weight(&g, n, kk, 13);
        let Mat::Fp8 { q, scale: sw } = &mat else {
            unreachable!("an FP8 matrix")
        };
        let tmax = SKINNY_MAX;
        let x = bf16_rows(tmax, kk, 21);
        let xd = quantize_rows(&to_f32(&x), tmax, kk).dequantize();
        let dx = g.upload(&x).unwrap();
        let picks: Vec<(usize, usize)> = if sampled {
            (0..4096usize).map(|i| ((i * 5) % tmax, (i * 7919) % n)).collect()
        } else {
            (0..tmax).flat_map(|r| (0..n).map(move |c| (r, c))).collect()
        };
        let (want, scale) = dequantized_products(&xd, &wd, kk, &picks);
        let mut scratch = Fp8Scratch::alloc(s, tmax, kk, n).unwrap();
        for t in 1..=tmax {
            assert_eq!(f.takes_skinny(t, kk), t >= 2, "{t} tokens");
            let mut y = s.alloc_zeros::<f32>(t * n).unwrap();
            if t == 1 {
                f.quantize_rows(s, &dx, 1, kk, kk, &mut scratch.xq, &mut scratch.sx)
                    .unwrap();
                let xs = (&scratch.xq, &scratch.sx);
                f.gemm_skinny(s, (q, sw), xs, &mut y, (1, n, kk), false).unwrap();
            } else {
                blas.project(&k, &mat, &dx, &mut y, Gemm::store(t, n, kk), &mut scratch)
                    .unwrap();
            }
            let once = g.download(&y).unwrap();
            if t == 1 {
                let xs = (&scratch.xq, &scratch.sx);
                f.gemm_skinny(s, (q, sw), xs, &mut y, (1, n, kk), true).unwrap();
            } else {
                blas.project(&k, &mat, &dx, &mut y, Gemm::add(t, n, kk), &mut scratch)
                    .unwrap();
            }
            let twice = g.download(&y).unwrap();
            // None of them went to cuBLASLt.
            assert_eq!(blas.lt_planned_per_row((t, n, kk)), None, "{t} tokens");
            for (i, &(r, c)) in picks.iter().enumerate().filter(|(_, p)| p.0 < t) {
                let (a, b) = (once[r * n + c], twice[r * n + c]);
                assert!(
                    (a - want[i]).abs() <= 1e-3 * scale,
                    "{t} x {n} x {kk} store [{r}, {c}]: {a} vs {}",
                    want[i]
                );
                assert!(
                    (b - 2.0 * want[i]).abs() <= 2e-3 * scale,
                    "{t} x {n} x {kk} add [{r}, {c}]: {b} vs {}",
                    2.0 * want[i]
                );
            }
        }
    }
    // Shapes it does not take are refused with their reason, and the switch reads its values.
    let x = s.alloc_zeros::<u8>(9 * 64).unwrap();
    let sx = s.alloc_zeros::<f32>(9).unwrap();
    let w = s.alloc_zeros::<u8>(32 * 64).unwrap();
    let sw = s.alloc_zeros::<f32>(32).unwrap();
    let mut y = s.alloc_zeros::<f32>(9 * 32).unwrap();
    let e = f
        .gemm_skinny(s, (&w, &sw), (&x, &sx), &mut y, (9, 32, 64), false)
        .unwrap_err();
    assert!(e.to_string().contains("9 tokens"), "{e}");
    assert!(f
        .gemm_skinny(s, (&w, &sw), (&x, &sx), &mut y, (2, 32, 48), false)
        .is_err());
}

fn fp8_products(pick: ScalePick) {
    let g = gpu();
    let k = ModelKernels::load(&g, true, &GpuTuning::default()).unwrap();
    let blas = Blas::with_lt(g.stream().clone(), Lt::new(g.stream().clone(), pick).unwrap()).unwrap();
    // 12 tokens: past the skinny GEMM's 8, so the GEMMs here are cuBLASLt's.
    let (t, n, kk) = (12, 96, 256);
    let (mat, wd, wq) = fp8_weight_codes(&g, n, kk, 11);
    let x = bf16_rows(t, kk, 5);
    let xf = to_f32(&x);
    let xd = quantize_rows(&xf, t, kk).dequantize();
    let dx = g.upload(&x).unwrap();
    let s = g.stream();
    let mut scratch = Fp8Scratch::alloc(s, t, kk, n).unwrap();
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(p, q)| p * q).sum::<f32>();
    // Hopper's FP8 tensor cores accumulate with fewer than f32's 24 bits (about 1.6e-4 of
    // the largest value measured on an H200): 1e-3 of it.
    const TOL: f32 = 1e-3;
    let close = |got: &[f32], want: &[f32], tol: f32, what: &str| {
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (i, (a, b)) in got.iter().zip(want).enumerate() {
            assert!((a - b).abs() <= tol * scale + 1e-6, "{what}[{i}]: {a} vs {b}");
        }
    };
    // W8A8 GEMM, stored.
    let mut y = s.alloc_zeros::<f32>(t * n).unwrap();
    blas.project(&k, &mat, &dx, &mut y, Gemm::store(t, n, kk), &mut scratch)
        .unwrap();
    let want: Vec<f32> = (0..t)
        .flat_map(|r| (0..n).map(move |c| (r, c)))
        .map(|(r, c)| dot(&xd[r * kk..(r + 1) * kk], &wd[c * kk..(c + 1) * kk]))
        .collect();
    eprintln!(
        "{pick:?}: per-row scales in cuBLASLt: {:?}",
        blas.lt_planned_per_row((t, n, kk))
    );
    close(&g.download(&y).unwrap(), &want, TOL, "GEMM store");
    // Accumulated onto what is there.
    blas.project(&k, &mat, &dx, &mut y, Gemm::add(t, n, kk), &mut scratch)
        .unwrap();
    let twice: Vec<f32> = want.iter().map(|v| 2.0 * v).collect();
    close(&g.download(&y).unwrap(), &twice, TOL, "GEMM add");
    // The one-token GEMVs: on CUDA cores the bf16 input unquantized, stored, added and
    // through SwiGLU.
    let x0 = g.upload(&x[..kk]).unwrap();
    // And through the fused RMSNorm of an f32 row: the reference input is what
    // `kvf_rms_norm` writes (the GEMVs normalise with the same code and block size).
    let (xr, eps) = (g.upload(&xf[..kk]).unwrap(), 1e-5);
    let nw = g
        .upload(&(0..kk).map(|i| 0.5 + (i % 7) as f32 * 0.25).collect::<Vec<f32>>())
        .unwrap();
    let mut normed = s.alloc_zeros::<u16>(kk).unwrap();
    k.rms_norm(&xr, 1, kk, Norm::new(&nw, eps), &mut normed).unwrap();
    let xn = to_f32(&g.download(&normed).unwrap());
    // With the row-a-warp kernel for stored and added rows, and without it.
    for row in [true, false] {
        let (v, tol) = (if row { "row" } else { "pair" }, TOL);
        let tuning = GpuTuning {
            fp8_gemv_row: row,
            ..GpuTuning::default()
        };
        let kv = ModelKernels::load(&g, true, &tuning).unwrap();
        let x_ref = &xf[..kk];
        let want1: Vec<f32> = (0..n).map(|c| dot(x_ref, &wd[c * kk..(c + 1) * kk])).collect();
        let mut y1 = s.alloc_zeros::<f32>(n).unwrap();
        kv.gemv
            .run(&mat, n, kk, Input::Bf16(&x0), Output::Store(&mut y1))
            .unwrap();
        close(&g.download(&y1).unwrap(), &want1, tol, &format!("GEMV {v}"));
        kv.gemv
            .run(&mat, n, kk, Input::Bf16(&x0), Output::Add(&mut y1))
            .unwrap();
        let twice: Vec<f32> = want1.iter().map(|v| 2.0 * v).collect();
        close(&g.download(&y1).unwrap(), &twice, tol, &format!("GEMV {v} add"));
        // Inputs past f16's range at 2^16 times the values, taken as they are.
        {
            let x_big: Vec<u16> = xf[..kk]
                .iter()
                .map(|v| bf16::from_f32(v * 65536.0).to_bits())
                .collect();
            let xb_big = g.upload(&x_big).unwrap();
            kv.gemv
                .run(&mat, n, kk, Input::Bf16(&xb_big), Output::Store(&mut y1))
                .unwrap();
            let big: Vec<f32> = want1.iter().map(|v| 65536.0 * v).collect();
            close(
                &g.download(&y1).unwrap(),
                &big,
                tol,
                &format!("GEMV {v} past f16"),
            );
        }
        let xn_ref = &xn;
        let want_n: Vec<f32> = (0..n).map(|c| dot(xn_ref, &wd[c * kk..(c + 1) * kk])).collect();
        let mut yn = s.alloc_zeros::<f32>(n).unwrap();
        kv.gemv
            .run(&mat, n, kk, Input::normed(&xr, &nw, eps), Output::Store(&mut yn))
            .unwrap();
        close(
            &g.download(&yn).unwrap(),
            &want_n,
            tol,
            &format!("GEMV {v} normed"),
        );
        let mut act = s.alloc_zeros::<u16>(n / 2).unwrap();
        kv.gemv
            .run(&mat, n, kk, Input::Bf16(&x0), Output::SwiGlu(&mut act))
            .unwrap();
        let got: Vec<f32> = to_f32(&g.download(&act).unwrap());
        let want: Vec<f32> = (0..n / 2)
            .map(|j| {
                let (a, b) = (want1[j], want1[n / 2 + j]);
                a / (1.0 + (-a).exp()) * b
            })
            .collect();
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            // bf16 output: 2^-8 of the value.
            assert!(
                (a - b).abs() <= 4e-3 * b.abs() + tol * scale,
                "GEMV {v} SwiGLU[{i}]: {a} vs {b}"
            );
        }
    }
    // Every code the quantizer produced decodes to a finite value (no NaN code written).
    assert!(wq.data.iter().all(|b| e4m3fn_to_f32(*b).is_finite()));
}
