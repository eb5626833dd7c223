//! Element encodings of the KV cache (see [`super::layout`]): bf16, f16, fp8 e4m3/e5m2,
//! e2m1 and the nvfp4 head-vector format. Written from the formats' definitions (OCP
//! 8-bit floating point spec v1.0; OCP microscaling spec v1.0 for e2m1): round to
//! nearest even, saturate to the largest finite value, NaN stored as 0 would hide bugs so
//! NaN inputs are stored as NaN where the format has one.
//!
//! The element codecs serve every backend. The head-vector codecs come in two flavours, because
//! the CPU backend and the GPU kernels (kernels/attention/quant.cuh) round three corners differently
//! and each side's pools are checked bit for bit:
//! - fp8 scaling: the CPU backend multiplies by `1 / scale`, `kvf_append` divides
//!   (`__fdiv_rn`); the quotients differ by an f32 ulp now and then, which can cross an fp8
//!   rounding midpoint.
//! - e2m1 of NaN: the CPU backend writes 0; the kernel's threshold ladder writes 6.
//! - nvfp4 reads: the CPU backend multiplies by `block_scale * global_scale`; the kernels
//!   multiply the exact `e2m1 * block_scale` (an f16) by the global scale.
//!
//! [`encode_vector`] / [`decode_vector`] are the CPU backend's;
//! [`encode_vector_as_kernels`] / [`decode_vector_as_kernels`] the kernels'.

use half::{bf16, f16};

use super::layout::KvDtype;

/// A small float format: sign bit, `exp_bits`, `man_bits`, `bias`, largest finite value.
#[derive(Clone, Copy, Debug)]
struct MiniFloat {
    man_bits: u32,
    bias: i32,
    max: f64,
    nan: Option<u8>,
    sign_shift: u32,
}

const E4M3: MiniFloat = MiniFloat {
    man_bits: 3,
    bias: 7,
    max: 448.0,
    nan: Some(0x7f),
    sign_shift: 7,
};
const E5M2: MiniFloat = MiniFloat {
    man_bits: 2,
    bias: 15,
    max: 57344.0,
    nan: Some(0x7f),
    sign_shift: 7,
};
const E2M1: MiniFloat = MiniFloat {
    man_bits: 1,
    bias: 1,
    max: 6.0,
    nan: None,
    sign_shift: 3,
};

impl MiniFloat {
    fn encode(self, x: f32) -> u8 {
        if x.is_nan() {
            return self.nan.unwrap_or(0);
        }
        let sign = if x.is_sign_negative() {
            1u8 << self.sign_shift
        } else {
            0
        };
        let a = (x as f64).abs().min(self.max);
        let min_normal_exp = 1 - self.bias;
        // Exponent of the binade holding `a` (subnormals share the smallest one).
        let e = if a == 0.0 {
            min_normal_exp
        } else {
            (a.log2().floor() as i32).max(min_normal_exp)
        };
        let quantum = (2f64).powi(e - self.man_bits as i32);
        let q = ((a / quantum).round_ties_even() * quantum).min(self.max);
        // `q` is now exactly representable; find its code.
        let code = if q < (2f64).powi(min_normal_exp) {
            (q / (2f64).powi(min_normal_exp - self.man_bits as i32)) as u8
        } else {
            let e = q.log2().floor() as i32;
            let m = ((q / (2f64).powi(e) - 1.0) * (1u32 << self.man_bits) as f64) as u8;
            (((e + self.bias) as u8) << self.man_bits) | m
        };
        sign | code
    }

    fn decode(self, code: u8) -> f32 {
        if Some(code & !(1 << self.sign_shift)) == self.nan && self.nan.is_some() {
            return f32::NAN;
        }
        let sign = if code >> self.sign_shift & 1 == 1 {
            -1.0
        } else {
            1.0
        };
        let mag = code & ((1u8 << self.sign_shift) - 1);
        let e = (mag >> self.man_bits) as i32;
        let m = (mag & ((1u8 << self.man_bits) - 1)) as f64;
        let scale = (1u32 << self.man_bits) as f64;
        let v = if e == 0 {
            m / scale * (2f64).powi(1 - self.bias)
        } else {
            (1.0 + m / scale) * (2f64).powi(e - self.bias)
        };
        (sign * v) as f32
    }
}

pub fn e4m3_encode(x: f32) -> u8 {
    E4M3.encode(x)
}
pub fn e4m3_decode(b: u8) -> f32 {
    E4M3.decode(b)
}
pub fn e5m2_encode(x: f32) -> u8 {
    // e5m2 has infinities (0x7c); we saturate instead, like `__nv_cvt_float_to_fp8(.., __NV_SATFINITE, ..)`.
    E5M2.encode(x)
}
pub fn e5m2_decode(b: u8) -> f32 {
    if b & 0x7f == 0x7c {
        return if b & 0x80 != 0 {
            f32::NEG_INFINITY
        } else {
            f32::INFINITY
        };
    }
    if b & 0x7f > 0x7c {
        return f32::NAN;
    }
    E5M2.decode(b)
}
/// e2m1 code in the low nibble. A value that rounds to zero is +0 (code 0) whatever its sign,
/// as the GPU append kernel writes it, so both backends hold byte-identical pools.
pub fn e2m1_encode(x: f32) -> u8 {
    let c = E2M1.encode(x);
    if c & 0x7 == 0 {
        0
    } else {
        c
    }
}
pub fn e2m1_decode(nibble: u8) -> f32 {
    E2M1.decode(nibble & 0xf)
}

/// Values per nvfp4 block scale.
pub use kvfleet_core::compat::vocab::NVFP4_BLOCK;

/// Whose arithmetic a head-vector codec reproduces (module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mirror {
    CpuBackend,
    Kernels,
}

/// Writes one head vector `x` (len `head_dim`) in `dtype` to `data` (`data_bytes` long)
/// and, for nvfp4, `scales` (`head_dim / 16` bytes). `scale` is the per-(layer, K|V)
/// fp8 scale or nvfp4 global scale. The CPU backend's rounding.
pub fn encode_vector(dtype: KvDtype, x: &[f32], scale: f32, data: &mut [u8], scales: &mut [u8]) {
    encode(Mirror::CpuBackend, dtype, x, scale, data, scales)
}

/// [`encode_vector`] as `kvf_append` writes it, bit for bit. `x` must already be
/// bf16-representable (the append kernel reads bf16).
pub fn encode_vector_as_kernels(dtype: KvDtype, x: &[f32], scale: f32, data: &mut [u8], scales: &mut [u8]) {
    encode(Mirror::Kernels, dtype, x, scale, data, scales)
}

fn encode(mirror: Mirror, dtype: KvDtype, x: &[f32], scale: f32, data: &mut [u8], scales: &mut [u8]) {
    match dtype {
        KvDtype::Bf16 => {
            for (c, &v) in data.chunks_exact_mut(2).zip(x) {
                c.copy_from_slice(&bf16::from_f32(v).to_le_bytes());
            }
        }
        KvDtype::F16 => {
            for (c, &v) in data.chunks_exact_mut(2).zip(x) {
                c.copy_from_slice(&f16::from_f32(v).to_le_bytes());
            }
        }
        KvDtype::Fp8E4m3 | KvDtype::Fp8E5m2 => {
            let code: fn(f32) -> u8 = if dtype == KvDtype::Fp8E4m3 {
                e4m3_encode
            } else {
                e5m2_encode
            };
            let inv = 1.0 / scale;
            for (d, &v) in data.iter_mut().zip(x) {
                *d = code(match mirror {
                    Mirror::CpuBackend => v * inv,
                    Mirror::Kernels => v / scale,
                });
            }
        }
        KvDtype::Nvfp4 => {
            for ((blk, d), s) in x
                .chunks_exact(NVFP4_BLOCK)
                .zip(data.chunks_exact_mut(NVFP4_BLOCK / 2))
                .zip(scales.iter_mut())
            {
                let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
                let bs = e4m3_encode(amax / 6.0 / scale);
                *s = bs;
                let eff = e4m3_decode(bs) * scale;
                // Divide (not multiply by the reciprocal), as the GPU append does, so both
                // round identically.
                let q = |v: f32| match mirror {
                    Mirror::CpuBackend if eff > 0.0 && eff.is_finite() => e2m1_encode(v / eff),
                    // The kernel's ladder (`e2m1_code`) fails every comparison for NaN and
                    // lands on its largest code.
                    Mirror::Kernels if eff > 0.0 => match v / eff {
                        n if n.is_nan() => 0x7,
                        n => e2m1_encode(n),
                    },
                    _ => 0,
                };
                for (pair, out) in blk.chunks_exact(2).zip(d.iter_mut()) {
                    *out = q(pair[0]) | (q(pair[1]) << 4);
                }
            }
        }
    }
}

/// Reads one head vector back to `f32` (the inverse of [`encode_vector`]): what the CPU
/// backend computes with.
pub fn decode_vector(dtype: KvDtype, data: &[u8], scales: &[u8], scale: f32, out: &mut [f32]) {
    decode(Mirror::CpuBackend, dtype, data, scales, scale, out)
}

/// [`decode_vector`] with the kernels' nvfp4 product: what the attention kernels compute with.
pub fn decode_vector_as_kernels(dtype: KvDtype, data: &[u8], scales: &[u8], scale: f32, out: &mut [f32]) {
    decode(Mirror::Kernels, dtype, data, scales, scale, out)
}

fn decode(mirror: Mirror, dtype: KvDtype, data: &[u8], scales: &[u8], scale: f32, out: &mut [f32]) {
    match dtype {
        KvDtype::Bf16 => {
            for (o, c) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        KvDtype::F16 => {
            for (o, c) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        KvDtype::Fp8E4m3 => {
            for (o, &b) in out.iter_mut().zip(data) {
                *o = e4m3_decode(b) * scale;
            }
        }
        KvDtype::Fp8E5m2 => {
            for (o, &b) in out.iter_mut().zip(data) {
                *o = e5m2_decode(b) * scale;
            }
        }
        KvDtype::Nvfp4 => {
            for ((o, d), &s) in out
                .chunks_exact_mut(NVFP4_BLOCK)
                .zip(data.chunks_exact(NVFP4_BLOCK / 2))
                .zip(scales)
            {
                let bs = e4m3_decode(s);
                let eff = bs * scale;
                let value = |nibble: u8| match mirror {
                    Mirror::CpuBackend => e2m1_decode(nibble) * eff,
                    Mirror::Kernels => e2m1_decode(nibble) * bs * scale,
                };
                for (pair, &b) in o.chunks_exact_mut(2).zip(d) {
                    pair[0] = value(b & 0xf);
                    pair[1] = value(b >> 4);
                }
            }
        }
    }
}

/// Quantize then dequantize `x` in place: what the cache returns for what was written.
pub fn round_trip(dtype: KvDtype, x: &mut [f32], scale: f32) {
    let mut data = vec![0u8; dtype.data_bytes(x.len())];
    let mut scales = vec![0u8; dtype.scale_bytes(x.len())];
    encode_vector(dtype, x, scale, &mut data, &mut scales);
    decode_vector(dtype, &data, &scales, scale, x);
}

/// A reasonable per-tensor scale for values of magnitude up to `amax`: fp8 maps amax to the
/// largest finite value; nvfp4 lets block scales span e4m3's range (amax / (448 * 6)).
pub fn suggested_scale(dtype: KvDtype, amax: f32) -> f32 {
    let amax = if amax > 0.0 { amax } else { 1.0 };
    match dtype {
        KvDtype::Bf16 | KvDtype::F16 => 1.0,
        KvDtype::Fp8E4m3 => amax / 448.0,
        KvDtype::Fp8E5m2 => amax / 57344.0,
        KvDtype::Nvfp4 => amax / (448.0 * 6.0),
    }
}

/// Unit round-off of the dtype's element encoding: `|x - q(x)| <= u * |x|` for values in
/// the normal range (bf16 8 significant bits, f16 11, e4m3 4, e5m2 3, e2m1 2).
pub fn unit_roundoff(dtype: KvDtype) -> f64 {
    match dtype {
        KvDtype::Bf16 => 2f64.powi(-8),
        KvDtype::F16 => 2f64.powi(-11),
        KvDtype::Fp8E4m3 => 2f64.powi(-4),
        KvDtype::Fp8E5m2 => 2f64.powi(-3),
        KvDtype::Nvfp4 => 2f64.powi(-2),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_codes_round_trip_and_match_known_values() {
        for code in 0u8..=255 {
            let v = e4m3_decode(code);
            if v.is_nan() {
                assert_eq!(code & 0x7f, 0x7f);
                continue;
            }
            // -0 and +0 both encode to a zero code.
            if v == 0.0 {
                continue;
            }
            assert_eq!(e4m3_encode(v), code, "code {code:#x} value {v}");
        }
        assert_eq!(e4m3_decode(0x7e), 448.0);
        assert_eq!(e4m3_decode(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_decode(0x38), 1.0);
        assert_eq!(e4m3_encode(1000.0), 0x7e, "saturates");
        assert_eq!(e4m3_encode(-1000.0), 0xfe);
        // 1.0625 is halfway between 1.0 (even mantissa) and 1.125: ties to even.
        assert_eq!(e4m3_decode(e4m3_encode(1.0625)), 1.0);
        assert_eq!(e4m3_decode(e4m3_encode(1.1875)), 1.25);
    }

    #[test]
    fn e5m2_codes_round_trip_and_saturate() {
        for code in 0u8..=255 {
            let v = e5m2_decode(code);
            if !v.is_finite() || v == 0.0 {
                continue;
            }
            assert_eq!(e5m2_encode(v), code, "code {code:#x} value {v}");
        }
        assert_eq!(e5m2_decode(0x7b), 57344.0);
        assert_eq!(e5m2_encode(1e9), 0x7b);
        assert_eq!(e5m2_decode(0x3c), 1.0);
    }

    #[test]
    fn e2m1_has_the_eight_magnitudes_of_the_spec() {
        let mags: Vec<f32> = (0u8..8).map(e2m1_decode).collect();
        assert_eq!(mags, [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]);
        for code in 0u8..16 {
            let v = e2m1_decode(code);
            if v != 0.0 {
                assert_eq!(e2m1_encode(v), code);
            }
        }
        assert_eq!(e2m1_decode(e2m1_encode(5.0)), 4.0, "tie to even mantissa");
        assert_eq!(e2m1_decode(e2m1_encode(100.0)), 6.0);
        assert_eq!(e2m1_decode(e2m1_encode(-2.6)), -3.0);
    }

    #[test]
    fn round_trip_error_is_within_the_unit_roundoff_for_every_dtype() {
        let x: Vec<f32> = (0..64).map(|i| ((i as f32) * 0.37).sin() * 3.0 + 0.01).collect();
        for dtype in KvDtype::ALL {
            let mut y = x.clone();
            round_trip(dtype, &mut y, 1.0);
            let u = unit_roundoff(dtype);
            for (blk_x, blk_y) in x.chunks(16).zip(y.chunks(16)) {
                let amax = blk_x.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
                for (&a, &b) in blk_x.iter().zip(blk_y) {
                    let err = (a as f64 - b as f64).abs();
                    let bound = match dtype {
                        // e2m1's widest gap (4 -> 6) is 2, so the error is at most one
                        // scale unit, amax / 6, grown by the e4m3 block scale's rounding.
                        KvDtype::Nvfp4 => amax / 6.0 * (1.0 + 2f64.powi(-4)) + 1e-6,
                        _ => u * (a as f64).abs() + 1e-6,
                    };
                    assert!(err <= bound, "{dtype}: {a} -> {b} (err {err}, bound {bound})");
                }
            }
        }
    }

    #[test]
    fn e2m1_writes_values_that_round_to_zero_as_positive_zero() {
        for x in [-0.0f32, -0.1, -0.25, 0.0, 0.2] {
            assert_eq!(e2m1_encode(x), 0, "{x}");
        }
        assert_eq!(e2m1_encode(-0.3), 0x9);
    }

    #[test]
    fn nvfp4_packs_the_even_index_in_the_low_nibble() {
        let mut x = [0f32; 16];
        x[0] = 6.0;
        x[1] = 1.0;
        let mut data = [0u8; 8];
        let mut sc = [0u8; 1];
        encode_vector(KvDtype::Nvfp4, &x, 1.0, &mut data, &mut sc);
        assert_eq!(e4m3_decode(sc[0]), 1.0);
        assert_eq!(data[0] & 0xf, e2m1_encode(6.0));
        assert_eq!(data[0] >> 4, e2m1_encode(1.0));
    }

    // === impl the kernels' codec ===
    // The CUDA crate used to carry its own host codec, bit-exact with `kvf_append`
    // (crates/kvfleet-cuda/src/quant.rs, removed when the codecs got one home). The digests
    // below are of what it produced; the engine's element codecs and its `_as_kernels`
    // head-vector codecs reproduce them.

    /// Every bf16 value, every 4099th f32 bit pattern, and e2m1's range in steps of 1/1024.
    fn sweep() -> Vec<f32> {
        let mut v: Vec<f32> = (0u32..=0xffff).map(|h| f32::from_bits(h << 16)).collect();
        v.extend((0..=u32::MAX).step_by(4099).map(f32::from_bits));
        v.extend((-8192i32..=8192).map(|k| k as f32 / 1024.0));
        v
    }

    fn fnv(h: &mut u64, bytes: &[u8]) {
        for b in bytes {
            *h ^= u64::from(*b);
            *h = h.wrapping_mul(0x100_0000_01b3);
        }
    }

    const FNV_BASIS: u64 = 0xcbf2_9ce4_8422_2325;

    /// Rows for the head-vector codecs: bf16 values of several magnitudes with the scale
    /// [`suggested_scale`] gives and a few off it, plus rows with zeros, infinities and NaN.
    fn rows() -> Vec<(KvDtype, Vec<f32>, f32)> {
        let mut st = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            st ^= st << 13;
            st ^= st >> 7;
            st ^= st << 17;
            st
        };
        let mut out = Vec::new();
        for dtype in KvDtype::ALL {
            for d in [64usize, 128] {
                for amax in [1e-3f32, 0.7, 4.5, 300.0, 6e4] {
                    for off in [1.0f32, 0.37, 3.1] {
                        for _ in 0..8 {
                            let x: Vec<f32> = (0..d)
                                .map(|_| {
                                    let u = (next() >> 40) as f32 / (1u64 << 24) as f32;
                                    bf16::from_f32((u * 2.0 - 1.0) * amax).to_f32()
                                })
                                .collect();
                            out.push((dtype, x, suggested_scale(dtype, amax) * off));
                        }
                    }
                }
                let mut special = vec![0f32; d];
                special[1] = -0.0;
                special[2] = f32::INFINITY;
                special[5] = f32::NEG_INFINITY;
                special[17] = f32::NAN;
                special[18] = 1.5;
                special[33] = -2.5;
                out.push((dtype, special.clone(), 1.0));
                out.push((dtype, special, 0.01));
                out.push((dtype, vec![0f32; d], 1.0));
            }
        }
        out
    }

    #[test]
    fn element_codecs_reproduce_the_retired_cuda_host_codec() {
        let mut dec = FNV_BASIS;
        for b in 0u8..=255 {
            fnv(&mut dec, &e4m3_decode(b).to_bits().to_le_bytes());
            fnv(&mut dec, &e5m2_decode(b).to_bits().to_le_bytes());
        }
        for n in 0u8..16 {
            fnv(&mut dec, &e2m1_decode(n).to_bits().to_le_bytes());
        }
        assert_eq!(dec, 0xa99c_e5eb_00fc_1805, "fp8 / e2m1 decoding changed");
        let mut enc = FNV_BASIS;
        for x in sweep() {
            // e2m1 of NaN is the one element difference, pinned below
            let e2m1 = if x.is_nan() { 0xff } else { e2m1_encode(x) };
            fnv(&mut enc, &[e4m3_encode(x), e5m2_encode(x), e2m1]);
        }
        assert_eq!(enc, 0x68f6_7177_f9bb_edc6, "fp8 / e2m1 encoding changed");
    }

    #[test]
    fn kernel_head_vector_codec_reproduces_the_retired_cuda_host_codec() {
        let mut row = FNV_BASIS;
        for (dtype, x, scale) in rows() {
            let d = x.len();
            let mut data = vec![0u8; dtype.data_bytes(d)];
            let mut scales = vec![0u8; dtype.scale_bytes(d)];
            encode_vector_as_kernels(dtype, &x, scale, &mut data, &mut scales);
            fnv(&mut row, &data);
            fnv(&mut row, &scales);
            let mut back = vec![0f32; d];
            decode_vector_as_kernels(dtype, &data, &scales, scale, &mut back);
            for v in back {
                fnv(&mut row, &v.to_bits().to_le_bytes());
            }
        }
        assert_eq!(
            row, 0x46bb_ae3f_a046_fcaf,
            "the kernels' head-vector codec changed"
        );
    }

    #[test]
    fn the_cpu_backend_and_the_kernels_round_three_corners_differently() {
        // fp8: x / scale (the append kernel) and x * (1 / scale) (the CPU backend) fall on
        // either side of an e4m3 midpoint here.
        let (x, scale) = (f32::from_bits(0x3eca_0000), f32::from_bits(0x3e2a_1af3));
        let (mut cpu, mut kern) = ([0u8], [0u8]);
        encode_vector(KvDtype::Fp8E4m3, &[x], scale, &mut cpu, &mut []);
        encode_vector_as_kernels(KvDtype::Fp8E4m3, &[x], scale, &mut kern, &mut []);
        assert_eq!((kern[0], cpu[0]), (0x42, 0x41));
        // e2m1 of NaN: 0 on the CPU, the ladder's top code (6) in the kernel.
        let mut x = [1f32; 16];
        x[3] = f32::NAN;
        let (mut cpu, mut kern, mut sc) = ([0u8; 8], [0u8; 8], [0u8]);
        encode_vector(KvDtype::Nvfp4, &x, 1.0, &mut cpu, &mut sc);
        encode_vector_as_kernels(KvDtype::Nvfp4, &x, 1.0, &mut kern, &mut sc);
        assert_eq!((kern[1] >> 4, cpu[1] >> 4), (0x7, 0x0));
        kern[1] &= 0xf;
        cpu[1] &= 0xf;
        assert_eq!(kern, cpu, "the other values agree");
        // nvfp4 reads: (1.5 * bs) * gs rounds once, 1.5 * (bs * gs) twice.
        let gs = f32::from_bits(0x3000_1eef);
        let (data, scales) = ([0x03u8; 8], [0x03u8]);
        let (mut cpu, mut kern) = ([0f32; 16], [0f32; 16]);
        decode_vector(KvDtype::Nvfp4, &data, &scales, gs, &mut cpu);
        decode_vector_as_kernels(KvDtype::Nvfp4, &data, &scales, gs, &mut kern);
        assert_ne!(cpu[0].to_bits(), kern[0].to_bits());
        assert!((cpu[0] - kern[0]).abs() <= f32::EPSILON * kern[0].abs());
    }
}
