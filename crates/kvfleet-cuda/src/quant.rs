//! Host-side KV encodings, bit-exact with `kvf_append`: fp8 e4m3 / e5m2 (round to nearest even,
//! saturating to the largest finite value, x = q * scale) and nvfp4 (e2m1 with an e4m3 scale per
//! 16 values and an f32 global scale). Used to build caches for tests and benchmarks and to
//! dequantize for references. Pure.

use super::spec::KvDtype;

fn encode_fp8(x: f32, man_bits: i32, bias: i32, max: f64) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = (x.abs() as f64).min(max);
    let min_normal = 2f64.powi(1 - bias);
    let code: u32 = if a < min_normal {
        (a / 2f64.powi(1 - bias - man_bits)).round_ties_even() as u32
    } else {
        let mut e = a.log2().floor() as i32;
        // guard against log2 rounding at exact powers of two
        if 2f64.powi(e) > a {
            e -= 1;
        } else if 2f64.powi(e + 1) <= a {
            e += 1;
        }
        let mut q = (a / 2f64.powi(e - man_bits)).round_ties_even() as u32;
        if q == 1 << (man_bits + 1) {
            e += 1;
            q = 1 << man_bits;
        }
        (((e + bias) as u32) << man_bits) | (q - (1 << man_bits))
    };
    sign | code as u8
}

fn decode_fp8(b: u8, man_bits: i32, exp_bits: i32, bias: i32) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((b as i32) >> man_bits) & ((1 << exp_bits) - 1);
    let m = (b as i32) & ((1 << man_bits) - 1);
    let v = if e == 0 {
        m as f64 * 2f64.powi(1 - bias - man_bits)
    } else {
        (1.0 + m as f64 / (1 << man_bits) as f64) * 2f64.powi(e - bias)
    };
    (sign * v) as f32
}

/// f32 -> fp8 e4m3 (RNE, saturating to 448).
pub fn f32_to_e4m3(x: f32) -> u8 {
    encode_fp8(x, 3, 7, 448.0)
}

/// fp8 e4m3 -> f32 (0x7f / 0xff are NaN).
pub fn e4m3_to_f32(b: u8) -> f32 {
    if b & 0x7f == 0x7f {
        return f32::NAN;
    }
    decode_fp8(b, 3, 4, 7)
}

/// f32 -> fp8 e5m2 (RNE, saturating to 57344).
pub fn f32_to_e5m2(x: f32) -> u8 {
    encode_fp8(x, 2, 15, 57344.0)
}

/// fp8 e5m2 -> f32.
pub fn e5m2_to_f32(b: u8) -> f32 {
    if (b >> 2) & 0x1f == 0x1f {
        return if b & 3 == 0 {
            if b & 0x80 != 0 {
                f32::NEG_INFINITY
            } else {
                f32::INFINITY
            }
        } else {
            f32::NAN
        };
    }
    decode_fp8(b, 2, 5, 15)
}

const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// f32 -> e2m1 nibble, round to nearest even, saturating to 6.
pub fn f32_to_e2m1(x: f32) -> u8 {
    let a = x.abs();
    let c = if a <= 0.25 {
        0
    } else if a < 0.75 {
        1
    } else if a <= 1.25 {
        2
    } else if a < 1.75 {
        3
    } else if a <= 2.5 {
        4
    } else if a < 3.5 {
        5
    } else if a <= 5.0 {
        6
    } else {
        7
    };
    if x < 0.0 && c != 0 {
        c | 8
    } else {
        c
    }
}

/// e2m1 nibble -> f32.
pub fn e2m1_to_f32(n: u8) -> f32 {
    let v = E2M1[(n & 7) as usize];
    if n & 8 != 0 {
        -v
    } else {
        v
    }
}

/// One row (`x.len()` = head_dim values) encoded as the cache stores it: (row bytes, block scales).
/// `scale` is the fp8 per-tensor scale or the nvfp4 global scale; ignored for 16-bit dtypes.
/// `x` must already be bf16-representable (the append kernel reads bf16).
pub fn encode_row(dtype: KvDtype, x: &[f32], scale: f32) -> (Vec<u8>, Vec<u8>) {
    match dtype {
        KvDtype::Bf16 => (
            x.iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect(),
            vec![],
        ),
        KvDtype::F16 => (
            x.iter()
                .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                .collect(),
            vec![],
        ),
        KvDtype::Fp8E4m3 => (x.iter().map(|v| f32_to_e4m3(*v / scale)).collect(), vec![]),
        KvDtype::Fp8E5m2 => (x.iter().map(|v| f32_to_e5m2(*v / scale)).collect(), vec![]),
        KvDtype::Nvfp4 => {
            let mut bytes = vec![0u8; x.len() / 2];
            let mut scales = vec![0u8; x.len() / 16];
            for (b, blk) in x.chunks(16).enumerate() {
                let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
                let bs = f32_to_e4m3((amax / 6.0) / scale);
                scales[b] = bs;
                let denom = e4m3_to_f32(bs) * scale;
                for (i, v) in blk.iter().enumerate() {
                    let code = if denom > 0.0 { f32_to_e2m1(*v / denom) } else { 0 };
                    let idx = b * 16 + i;
                    bytes[idx / 2] |= if idx % 2 == 0 { code } else { code << 4 };
                }
            }
            (bytes, scales)
        }
    }
}

/// The values a cached row stands for (what the attention kernels must compute with).
pub fn decode_row(dtype: KvDtype, bytes: &[u8], scales: &[u8], scale: f32, head_dim: usize) -> Vec<f32> {
    match dtype {
        KvDtype::Bf16 => bytes
            .chunks(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        KvDtype::F16 => bytes
            .chunks(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        KvDtype::Fp8E4m3 => bytes.iter().map(|b| e4m3_to_f32(*b) * scale).collect(),
        KvDtype::Fp8E5m2 => bytes.iter().map(|b| e5m2_to_f32(*b) * scale).collect(),
        KvDtype::Nvfp4 => (0..head_dim)
            .map(|i| {
                let n = if i % 2 == 0 {
                    bytes[i / 2] & 0xf
                } else {
                    bytes[i / 2] >> 4
                };
                e2m1_to_f32(n) * e4m3_to_f32(scales[i / 16]) * scale
            })
            .collect(),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_round_trips_every_finite_code() {
        for b in 0u8..=255 {
            if b & 0x7f == 0x7f {
                continue;
            }
            let x = e4m3_to_f32(b);
            let back = f32_to_e4m3(x);
            // +0 and -0 both decode to 0
            if x == 0.0 {
                assert_eq!(back & 0x7f, 0);
            } else {
                assert_eq!(back, b, "code {b:#x} value {x}");
            }
        }
    }

    #[test]
    fn e5m2_round_trips_every_finite_code() {
        for b in 0u8..=255 {
            let x = e5m2_to_f32(b);
            if !x.is_finite() || x == 0.0 {
                continue;
            }
            assert_eq!(f32_to_e5m2(x), b, "code {b:#x} value {x}");
        }
    }

    #[test]
    fn fp8_saturates_and_rounds_to_even() {
        assert_eq!(e4m3_to_f32(f32_to_e4m3(1e6)), 448.0);
        assert_eq!(e5m2_to_f32(f32_to_e5m2(-1e9)), -57344.0);
        // 1.0625 is halfway between 1.0 and 1.125 in e4m3: ties to even (1.0)
        assert_eq!(e4m3_to_f32(f32_to_e4m3(1.0625)), 1.0);
        assert_eq!(e4m3_to_f32(f32_to_e4m3(1.1875)), 1.25);
    }

    #[test]
    fn e2m1_rounds_to_nearest_even() {
        let cases = [
            (0.25, 0.0),
            (0.3, 0.5),
            (0.75, 1.0),
            (1.25, 1.0),
            (1.75, 2.0),
            (2.5, 2.0),
            (3.5, 4.0),
            (5.0, 4.0),
            (9.0, 6.0),
        ];
        for (x, want) in cases {
            assert_eq!(e2m1_to_f32(f32_to_e2m1(x)), want, "{x}");
            assert_eq!(e2m1_to_f32(f32_to_e2m1(-x)), -want, "-{x}");
        }
    }

    #[test]
    fn nvfp4_row_decodes_close_to_input() {
        let x: Vec<f32> = (0..128).map(|i| ((i * 37 % 29) as f32 - 14.0) / 7.0).collect();
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let gs = suggested_scale(KvDtype::Nvfp4, amax);
        let (b, s) = encode_row(KvDtype::Nvfp4, &x, gs);
        let y = decode_row(KvDtype::Nvfp4, &b, &s, gs, 128);
        for (a, c) in x.iter().zip(&y) {
            // e2m1 keeps about one bit: error below a quarter of the block max.
            assert!((a - c).abs() <= 0.26 * amax, "{a} vs {c}");
        }
    }
}

/// The engine's codecs against this module's, before this module goes: every fp8 code, a sweep
/// of floats, and rows of every dtype; then digests of what this module produces, which the
/// engine's tests pin once this module is gone.
#[cfg(test)]
mod against_the_engine {
    use super::*;
    use kvfleet_engine::engine::quant as eq;

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
                                    half::bf16::from_f32((u * 2.0 - 1.0) * amax).to_f32()
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
    fn fp8_and_e2m1_decoders_agree_on_every_code() {
        for b in 0u8..=255 {
            assert_eq!(
                e4m3_to_f32(b).to_bits(),
                eq::e4m3_decode(b).to_bits(),
                "e4m3 {b:#x}"
            );
            assert_eq!(
                e5m2_to_f32(b).to_bits(),
                eq::e5m2_decode(b).to_bits(),
                "e5m2 {b:#x}"
            );
        }
        for n in 0u8..16 {
            assert_eq!(
                e2m1_to_f32(n).to_bits(),
                eq::e2m1_decode(n).to_bits(),
                "e2m1 {n:#x}"
            );
        }
    }

    #[test]
    fn encoders_agree_on_the_sweep_but_for_e2m1_of_nan() {
        for x in sweep() {
            assert_eq!(
                f32_to_e4m3(x),
                eq::e4m3_encode(x),
                "e4m3 {x:e} ({:#x})",
                x.to_bits()
            );
            assert_eq!(
                f32_to_e5m2(x),
                eq::e5m2_encode(x),
                "e5m2 {x:e} ({:#x})",
                x.to_bits()
            );
            if x.is_nan() {
                assert_eq!(
                    (f32_to_e2m1(x), eq::e2m1_encode(x)),
                    (0x7, 0),
                    "{:#x}",
                    x.to_bits()
                );
            } else {
                assert_eq!(
                    f32_to_e2m1(x),
                    eq::e2m1_encode(x),
                    "e2m1 {x:e} ({:#x})",
                    x.to_bits()
                );
            }
        }
    }

    #[test]
    fn the_engine_mirror_of_the_kernels_writes_and_reads_rows_as_this_module() {
        for (dtype, x, scale) in rows() {
            let d = x.len();
            let (want, want_s) = encode_row(dtype, &x, scale);
            let mut got = vec![0u8; dtype.data_bytes(d)];
            let mut got_s = vec![0u8; dtype.scale_bytes(d)];
            eq::encode_vector_as_kernels(dtype, &x, scale, &mut got, &mut got_s);
            assert_eq!((&got, &got_s), (&want, &want_s), "{dtype} scale {scale:e}: {x:?}");
            let back = decode_row(dtype, &want, &want_s, scale, d);
            let mut got_back = vec![0f32; d];
            eq::decode_vector_as_kernels(dtype, &want, &want_s, scale, &mut got_back);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got_back), bits(&back), "{dtype} scale {scale:e}");
        }
        for dtype in KvDtype::ALL {
            for amax in [0.0f32, -1.0, 1e-30, 0.7, 4.5, 3e38] {
                assert_eq!(
                    suggested_scale(dtype, amax).to_bits(),
                    eq::suggested_scale(dtype, amax).to_bits()
                );
            }
        }
    }

    #[test]
    fn the_cpu_backend_rounds_fp8_scaling_and_reads_nvfp4_differently() {
        // x / scale (the append kernel) and x * (1 / scale) (the CPU backend) fall on either
        // side of an e4m3 midpoint here.
        let (x, scale) = (f32::from_bits(0x3eca_0000), f32::from_bits(0x3e2a_1af3));
        let (row, _) = encode_row(KvDtype::Fp8E4m3, &[x], scale);
        let (mut cpu, mut kern) = ([0u8], [0u8]);
        eq::encode_vector(KvDtype::Fp8E4m3, &[x], scale, &mut cpu, &mut []);
        eq::encode_vector_as_kernels(KvDtype::Fp8E4m3, &[x], scale, &mut kern, &mut []);
        assert_eq!((row[0], kern[0], cpu[0]), (0x42, 0x42, 0x41));
        // nvfp4: (1.5 * bs) * gs is one rounding, 1.5 * (bs * gs) two.
        let gs = f32::from_bits(0x3000_1eef);
        let (data, scales) = ([0x03u8; 8], [0x03u8]);
        let row = decode_row(KvDtype::Nvfp4, &data, &scales, gs, 16);
        let (mut cpu, mut kern) = ([0f32; 16], [0f32; 16]);
        eq::decode_vector(KvDtype::Nvfp4, &data, &scales, gs, &mut cpu);
        eq::decode_vector_as_kernels(KvDtype::Nvfp4, &data, &scales, gs, &mut kern);
        assert_eq!(row[0].to_bits(), kern[0].to_bits());
        assert_ne!(row[0].to_bits(), cpu[0].to_bits());
    }

    #[test]
    fn digests_of_this_module() {
        let mut dec = 0xcbf2_9ce4_8422_2325u64;
        for b in 0u8..=255 {
            fnv(&mut dec, &e4m3_to_f32(b).to_bits().to_le_bytes());
            fnv(&mut dec, &e5m2_to_f32(b).to_bits().to_le_bytes());
        }
        for n in 0u8..16 {
            fnv(&mut dec, &e2m1_to_f32(n).to_bits().to_le_bytes());
        }
        let mut enc = 0xcbf2_9ce4_8422_2325u64;
        for x in sweep() {
            let e2m1 = if x.is_nan() { 0xff } else { f32_to_e2m1(x) };
            fnv(&mut enc, &[f32_to_e4m3(x), f32_to_e5m2(x), e2m1]);
        }
        let mut row = 0xcbf2_9ce4_8422_2325u64;
        for (dtype, x, scale) in rows() {
            let (b, s) = encode_row(dtype, &x, scale);
            fnv(&mut row, &b);
            fnv(&mut row, &s);
            for v in decode_row(dtype, &b, &s, scale, x.len()) {
                fnv(&mut row, &v.to_bits().to_le_bytes());
            }
        }
        println!("DIGESTS decode {dec:#018x} encode {enc:#018x} rows {row:#018x}");
    }
}
