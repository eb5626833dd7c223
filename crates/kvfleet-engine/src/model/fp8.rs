//! FP8 (e4m3fn) checkpoints as published, in the two formats vLLM reads:
//!
//! - vLLM's `fp8` method (`quantization_config: {quant_method: "fp8", activation_scheme:
//!   "static" | "dynamic", ignored_layers?, weight_block_size?}`): each quantized linear
//!   layer stores `weight` in float8_e4m3fn, `weight_scale` (f32, one per tensor; a column of
//!   one per output channel is read too) and, with static activations, `input_scale`
//!   (vllm `model_executor/layers/quantization/fp8.py` `Fp8Config.from_config`,
//!   `Fp8LinearMethod.create_weights`).
//! - compressed-tensors `float-quantized` (`quant_method: "compressed-tensors"`, `format:
//!   "float-quantized"`, `config_groups.<g>.weights: {type: "float", num_bits: 8, strategy:
//!   "channel" | "tensor"}`), as llm-compressor writes its FP8 schemes: the same three tensor
//!   names, `weight_scale` of shape `[out, 1]` for channel and `[1]` for tensor
//!   (vllm `compressed_tensors/schemes/compressed_tensors_w8a8_fp8.py`,
//!   neuralmagic/compressed-tensors `quantization/quant_args.py`).
//!
//! Block-wise scales (`weight_block_size`, strategy `block`/`group`), integer weights and
//! other bit widths are refused with an error naming the field. Layers not quantized
//! (`ignored_layers`, compressed-tensors `ignore`, the LM head and embeddings) are stored in
//! bf16 and load as before.
//!
//! The CPU engine dequantizes at load ([`Fp8Weight::dequantize`]: f32 = e4m3 x scale); the raw
//! bytes and scales stay available as [`Fp8Weight`] for the GPU path to upload as they are.

use rayon::prelude::*;
use serde_json::Value;

/// How a weight's scales are laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8Strategy {
    /// One scale for the whole matrix.
    Tensor,
    /// One scale per output channel (row).
    Channel,
}

/// Whether activations are quantized with a stored scale or per step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActivationScheme {
    /// `input_scale` is stored in the checkpoint.
    Static,
    /// Computed at run time; no `input_scale`.
    Dynamic,
}

/// Which of the two formats a checkpoint uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8Format {
    /// vLLM's `fp8` quant_method.
    Vllm,
    /// compressed-tensors `float-quantized`.
    CompressedTensors,
}

/// A checkpoint's FP8 `quantization_config`, validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fp8Config {
    pub format: Fp8Format,
    /// What the config declares (compressed-tensors); vLLM's format reads it from each
    /// `weight_scale`'s shape, so `None` there.
    pub strategy: Option<Fp8Strategy>,
    pub activation: ActivationScheme,
    /// Layers left unquantized (`ignored_layers` / `ignore`).
    pub ignored: Vec<String>,
}

/// An unusable `quantization_config`: the field and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("config.json field {field}: {message}")]
pub struct Fp8ConfigError {
    pub field: String,
    pub message: String,
}

fn err(field: impl Into<String>, message: impl Into<String>) -> Fp8ConfigError {
    Fp8ConfigError {
        field: field.into(),
        message: message.into(),
    }
}

impl Fp8Config {
    /// Reads `quantization_config` of a config.json; `Ok(None)` when there is none.
    pub fn from_config_json(config: &Value) -> Result<Option<Fp8Config>, Fp8ConfigError> {
        let Some(q) = config.get("quantization_config") else {
            return Ok(None);
        };
        const QC: &str = "quantization_config";
        let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("");
        let strings = |v: Option<&Value>| -> Vec<String> {
            v.and_then(Value::as_array)
                .map(|a| a.iter().filter_map(|s| s.as_str().map(str::to_string)).collect())
                .unwrap_or_default()
        };
        match method {
            "fp8" => {
                if q.get("weight_block_size").is_some_and(|v| !v.is_null()) {
                    return Err(err(
                        format!("{QC}.weight_block_size"),
                        "block-wise FP8 scales are not supported by kvfleet's loader; use a per-tensor or per-channel FP8 checkpoint",
                    ));
                }
                let activation = match q.get("activation_scheme").and_then(Value::as_str) {
                    Some("static") => ActivationScheme::Static,
                    Some("dynamic") | None => ActivationScheme::Dynamic,
                    Some(o) => {
                        return Err(err(
                            format!("{QC}.activation_scheme"),
                            format!("`{o}` is neither static nor dynamic"),
                        ))
                    }
                };
                Ok(Some(Fp8Config {
                    format: Fp8Format::Vllm,
                    strategy: None,
                    activation,
                    ignored: strings(q.get("ignored_layers")),
                }))
            }
            "compressed-tensors" => {
                let groups = q
                    .get("config_groups")
                    .and_then(Value::as_object)
                    .filter(|g| !g.is_empty())
                    .ok_or_else(|| err(format!("{QC}.config_groups"), "missing or empty"))?;
                let mut strategy = None;
                let mut activation = ActivationScheme::Dynamic;
                for (name, g) in groups {
                    let field = format!("{QC}.config_groups.{name}.weights");
                    let w = g.get("weights").ok_or_else(|| err(&field, "missing"))?;
                    let ty = w.get("type").and_then(Value::as_str).unwrap_or("");
                    if ty != "float" {
                        return Err(err(
                            format!("{field}.type"),
                            format!("`{ty}` weights are not supported; kvfleet reads FP8 (type float, num_bits 8)"),
                        ));
                    }
                    let bits = w.get("num_bits").and_then(Value::as_u64).unwrap_or(0);
                    if bits != 8 {
                        return Err(err(
                            format!("{field}.num_bits"),
                            format!("{bits}-bit float weights are not supported; kvfleet reads 8-bit (e4m3)"),
                        ));
                    }
                    let s = match w.get("strategy").and_then(Value::as_str) {
                        Some("channel") => Fp8Strategy::Channel,
                        Some("tensor") => Fp8Strategy::Tensor,
                        o => {
                            return Err(err(
                                format!("{field}.strategy"),
                                format!("{o:?} is not supported; kvfleet reads channel and tensor scales"),
                            ))
                        }
                    };
                    if strategy.is_some_and(|prev| prev != s) {
                        return Err(err(format!("{field}.strategy"), "groups with different strategies"));
                    }
                    strategy = Some(s);
                    let dynamic = g
                        .get("input_activations")
                        .and_then(|a| a.get("dynamic"))
                        .and_then(Value::as_bool);
                    if dynamic == Some(false) {
                        activation = ActivationScheme::Static;
                    }
                }
                if let Some(f) = q.get("format").and_then(Value::as_str) {
                    if f != "float-quantized" && f != "naive-quantized" {
                        return Err(err(
                            format!("{QC}.format"),
                            format!("`{f}` is not supported; kvfleet reads float-quantized"),
                        ));
                    }
                }
                Ok(Some(Fp8Config {
                    format: Fp8Format::CompressedTensors,
                    strategy,
                    activation,
                    ignored: strings(q.get("ignore")),
                }))
            }
            other => Err(err(
                format!("{QC}.quant_method"),
                format!("`{other}` is not supported by kvfleet's safetensors loader; it reads fp8, compressed-tensors (FP8 and W4A16 pack-quantized), awq, gptq and mxfp4 (for other quantizations serve a GGUF file)"),
            )),
        }
    }
}

/// One e4m3fn byte as f32, exactly: 1 sign, 4 exponent (bias 7), 3 mantissa bits;
/// exponent 0 is subnormal (m/8 x 2^-6); `S.1111.111` is NaN; there is no infinity
/// (the "fn" variant, max 448).
pub fn e4m3fn_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = i32::from((b >> 3) & 0x0f);
    let man = f32::from(b & 0x07);
    if exp == 0x0f && b & 0x07 == 0x07 {
        return f32::NAN;
    }
    let magnitude = if exp == 0 {
        man / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    };
    sign * magnitude
}

/// An FP8 weight matrix as the checkpoint stores it, for the GPU path to upload unchanged.
#[derive(Clone, Debug, PartialEq)]
pub struct Fp8Weight {
    /// e4m3fn bytes, row-major `[rows, cols]` (rows = output channels).
    pub data: Vec<u8>,
    /// One scale ([`Fp8Strategy::Tensor`]) or one per row ([`Fp8Strategy::Channel`]).
    pub scale: Vec<f32>,
    pub strategy: Fp8Strategy,
    pub rows: usize,
    pub cols: usize,
    /// Static activation scale (`input_scale`), when stored.
    pub input_scale: Option<f32>,
}

impl Fp8Weight {
    /// f32 = e4m3 x scale of its row (the CPU path's weights).
    pub fn dequantize(&self) -> Vec<f32> {
        let lut: Vec<f32> = (0..=255u8).map(e4m3fn_to_f32).collect();
        self.data
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let s = match self.strategy {
                    Fp8Strategy::Tensor => self.scale[0],
                    Fp8Strategy::Channel => self.scale[i / self.cols.max(1)],
                };
                lut[usize::from(*b)] * s
            })
            .collect()
    }
}

/// The largest finite e4m3fn value.
pub const E4M3_MAX: f32 = 448.0;

/// f32 to the nearest e4m3fn byte, ties to even, saturating to +-448 (CUDA's
/// `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)`, which the GPU's quantize kernel uses;
/// the two agree on every input the GPU test draws). NaN becomes `0x7f`.
pub fn f32_to_e4m3fn(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    if a >= E4M3_MAX {
        return sign | 0x7e;
    }
    // Subnormals and the smallest normal: multiples of 2^-9 (a code of 8 is 2^-6, the first
    // normal, so the carry lands on the right code).
    if a < 2f32.powi(-6) {
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    let e = (a.to_bits() >> 23) as i32 - 127; // a >= 2^-6: a normal f32
    let mut m = ((a / 2f32.powi(e) - 1.0) * 8.0).round_ties_even() as i32;
    let mut e = e;
    if m == 8 {
        m = 0;
        e += 1;
    }
    let code = ((e + 7) << 3 | m) as u8;
    sign | code.min(0x7e)
}

/// Quantizes a row-major f32 matrix `[rows, cols]` to e4m3fn with one scale per row (output
/// channel): `scale = amax / 448`, `q = e4m3(w / scale)` (vLLM's dynamic per-channel FP8, and
/// the per-token activation quantization with rows = tokens). An all-zero row gets scale 1.
pub fn quantize_rows(w: &[f32], rows: usize, cols: usize) -> Fp8Weight {
    assert_eq!(w.len(), rows * cols, "a {rows}x{cols} matrix");
    let mut data = vec![0u8; w.len()];
    let mut scale = vec![1f32; rows];
    for ((row, out), s) in w
        .chunks(cols.max(1))
        .zip(data.chunks_mut(cols.max(1)))
        .zip(&mut scale)
    {
        *s = row_scale(row);
        let inv = 1.0 / *s;
        for (o, v) in out.iter_mut().zip(row) {
            *o = f32_to_e4m3fn(v * inv);
        }
    }
    Fp8Weight {
        data,
        scale,
        strategy: Fp8Strategy::Channel,
        rows,
        cols,
        input_scale: None,
    }
}

/// The scale [`quantize_rows`] gives a row: its amax over 448, 1 for an all-zero row.
fn row_scale(row: &[f32]) -> f32 {
    let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
    if amax > 0.0 {
        amax / E4M3_MAX
    } else {
        1.0
    }
}

/// Each row of `x` (rows of `cols`) through [`quantize_rows`] and back to f32, in place:
/// `e4m3(v / scale) x scale`, the value an FP8 GEMM sees. With rows = tokens this is
/// the dynamic per-token activation quantization of W8A8; with rows = output channels,
/// the per-channel weight quantization. Rows run in parallel.
pub fn fake_quantize_rows(x: &mut [f32], cols: usize) {
    let lut = e4m3_table();
    x.par_chunks_mut(cols.max(1)).for_each(|row| {
        let s = row_scale(row);
        let inv = 1.0 / s;
        for v in row {
            *v = lut[usize::from(f32_to_e4m3fn(*v * inv))] * s;
        }
    });
}

/// Every e4m3fn code's value.
fn e4m3_table() -> [f32; 256] {
    std::array::from_fn(|b| e4m3fn_to_f32(b as u8))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3fn_encoding_round_trips_every_code_rounds_ties_to_even_and_saturates() {
        for b in 0..=255u8 {
            let v = e4m3fn_to_f32(b);
            if v.is_nan() {
                assert_eq!(f32_to_e4m3fn(v) & 0x7f, 0x7f);
            } else {
                assert_eq!(f32_to_e4m3fn(v), b, "code {b:#04x} = {v}");
            }
        }
        // Halfway between 1.0 (0x38) and 1.125 (0x39): to the even mantissa, 0x38; between
        // 1.125 and 1.25 (0x3a): 0x3a.
        assert_eq!(f32_to_e4m3fn(1.0625), 0x38);
        assert_eq!(f32_to_e4m3fn(1.1875), 0x3a);
        // Subnormal ties: 1.5 x 2^-9 goes to 2 x 2^-9; 0.5 x 2^-9 to 0.
        assert_eq!(f32_to_e4m3fn(1.5 * 2f32.powi(-9)), 0x02);
        assert_eq!(f32_to_e4m3fn(0.5 * 2f32.powi(-9)), 0x00);
        // The largest subnormal rounds up into the first normal.
        assert_eq!(f32_to_e4m3fn(7.75 * 2f32.powi(-9)), 0x08);
        assert_eq!(f32_to_e4m3fn(1e9), 0x7e);
        assert_eq!(f32_to_e4m3fn(-460.0), 0xfe);
        assert_eq!(f32_to_e4m3fn(f32::INFINITY), 0x7e);
        // Every value is within half a step (relative 1/16) of its code.
        for i in 0..10_000 {
            let x = (i as f32 * 0.7311).sin() * 400.0;
            let y = e4m3fn_to_f32(f32_to_e4m3fn(x));
            assert!((x - y).abs() <= x.abs() / 16.0 + 2f32.powi(-10), "{x} -> {y}");
        }
    }

    #[test]
    fn per_row_quantization_maps_each_rows_amax_to_448() {
        let w = [0.5f32, -2.0, 1.0, 0.0, 0.0, 0.0, 3.0, 1.5, -0.75];
        let q = quantize_rows(&w, 3, 3);
        assert_eq!(q.scale, vec![2.0 / 448.0, 1.0, 3.0 / 448.0]);
        assert_eq!(q.data[1], 0xfe, "the row's amax is -448");
        assert_eq!(q.data[6], 0x7e);
        assert_eq!(&q.data[3..6], &[0, 0, 0]);
        let back = q.dequantize();
        for (a, b) in w.iter().zip(&back) {
            assert!((a - b).abs() <= a.abs() / 16.0, "{a} -> {b}");
        }
    }
    #[test]
    fn fake_quantized_rows_equal_quantize_rows_dequantized_bit_for_bit() {
        let (rows, cols) = (5, 37);
        let mut x: Vec<f32> = (0..rows * cols)
            .map(|i| (i as f32 * 0.913).sin() * (1.0 + (i / cols) as f32 * 30.0))
            .collect();
        x[cols..2 * cols].fill(0.0); // an all-zero row keeps scale 1 and stays zero
        let want = quantize_rows(&x, rows, cols).dequantize();
        fake_quantize_rows(&mut x, cols);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&x), bits(&want));
        assert!(x[cols..2 * cols].iter().all(|v| *v == 0.0));
    }

    use serde_json::json;

    #[test]
    fn e4m3fn_decodes_normals_subnormals_zero_max_and_nan() {
        assert_eq!(e4m3fn_to_f32(0x00), 0.0);
        assert!(e4m3fn_to_f32(0x80).is_sign_negative() && e4m3fn_to_f32(0x80) == 0.0);
        assert_eq!(e4m3fn_to_f32(0x38), 1.0); // exponent 7 = bias
        assert_eq!(e4m3fn_to_f32(0x01), 2f32.powi(-9)); // smallest subnormal
        assert_eq!(e4m3fn_to_f32(0x07), 7.0 / 8.0 * 2f32.powi(-6)); // largest subnormal
        assert_eq!(e4m3fn_to_f32(0x08), 2f32.powi(-6)); // smallest normal
        assert_eq!(e4m3fn_to_f32(0x7e), 448.0); // max
        assert_eq!(e4m3fn_to_f32(0xfe), -448.0);
        assert_eq!(e4m3fn_to_f32(0x78), 256.0); // S.1111.000 is a number in fn
        assert!(e4m3fn_to_f32(0x7f).is_nan() && e4m3fn_to_f32(0xff).is_nan());
        // Every non-NaN code is distinct and ordered within a sign.
        let pos: Vec<f32> = (0..0x7fu8).map(e4m3fn_to_f32).collect();
        assert!(pos.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn channel_scales_apply_per_row() {
        let w = Fp8Weight {
            data: vec![0x38, 0x40, 0x38, 0x40],
            scale: vec![0.5, 2.0],
            strategy: Fp8Strategy::Channel,
            rows: 2,
            cols: 2,
            input_scale: None,
        };
        assert_eq!(w.dequantize(), [0.5, 1.0, 2.0, 4.0]);
    }

    #[test]
    fn both_formats_parse_and_unsupported_ones_name_the_field() {
        let v = Fp8Config::from_config_json(&json!({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}})).unwrap().unwrap();
        assert_eq!(
            (v.format, v.activation, v.ignored.as_slice()),
            (
                Fp8Format::Vllm,
                ActivationScheme::Static,
                &["lm_head".to_string()][..]
            )
        );
        let ct = |strategy: &str, ty: &str, bits: u64| {
            json!({"quantization_config": {
            "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"],
                "weights": {"type": ty, "num_bits": bits, "strategy": strategy, "symmetric": true},
                "input_activations": {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": true}}}}})
        };
        let c = Fp8Config::from_config_json(&ct("channel", "float", 8))
            .unwrap()
            .unwrap();
        assert_eq!(
            (c.format, c.strategy, c.activation),
            (
                Fp8Format::CompressedTensors,
                Some(Fp8Strategy::Channel),
                ActivationScheme::Dynamic
            )
        );
        assert_eq!(
            Fp8Config::from_config_json(&ct("tensor", "float", 8))
                .unwrap()
                .unwrap()
                .strategy,
            Some(Fp8Strategy::Tensor)
        );
        for (cfg, field) in [
            (
                ct("block", "float", 8),
                "quantization_config.config_groups.group_0.weights.strategy",
            ),
            (
                ct("channel", "int", 8),
                "quantization_config.config_groups.group_0.weights.type",
            ),
            (
                ct("channel", "float", 4),
                "quantization_config.config_groups.group_0.weights.num_bits",
            ),
            (
                json!({"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}),
                "quantization_config.weight_block_size",
            ),
            (
                json!({"quantization_config": {"quant_method": "awq"}}),
                "quantization_config.quant_method",
            ),
        ] {
            let e = Fp8Config::from_config_json(&cfg).unwrap_err();
            assert_eq!(e.field, field, "{e}");
            assert!(e.to_string().contains(field), "{e}");
        }
        assert_eq!(Fp8Config::from_config_json(&json!({})).unwrap(), None);
    }
}
