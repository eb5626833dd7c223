//! 4-bit weights as checkpoints publish them, kept packed in memory and dequantized a tile of
//! rows at a time inside the CPU linear op ([`super::linear::Linear`]):
//!
//! - AutoAWQ GEMM (`quant_method: awq`, `version: gemm`): [`awq`];
//! - GPTQ (`quant_method: gptq`, v1 and v2 zero points, `desc_act`): [`gptq`];
//! - compressed-tensors `pack-quantized` W4A16 (`quant_method: compressed-tensors`, integer
//!   weights of 4 bits, group or channel scales): [`compressed`];
//! - MXFP4 (`quant_method: mxfp4`, gpt-oss's experts: e2m1 codes, e8m0 scales per 32):
//!   [`mxfp4`].
//!
//! Each loader repacks once into one layout, [`W4Weight`]: per output row, two codes a byte,
//! one scale and one zero per group of input columns, and GPTQ's `g_idx` when the groups are
//! not contiguous. A weight element is `(value(code) - zero) x scale` in f32, which is exact for
//! every format (a code less a zero is an integer of at most 5 bits, a scale an fp16 or bf16
//! value or a power of two), so the CPU result equals the format's definition bit for bit and is
//! the reference the GPU kernels are held to. The parsing of `quantization_config` is here
//! ([`W4Config::from_config_json`]); the tensors come through [`RawTensor`] so that this module
//! does not know the safetensors reader (`hf.rs` does).

pub mod awq;
pub mod compressed;
pub mod gptq;
pub mod mxfp4;

use kvfleet_gemm::matmul_t;
use rayon::prelude::*;
use safetensors::Dtype;
use serde_json::Value;

/// Which published format a 4-bit weight came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum W4Method {
    Awq,
    Gptq,
    CompressedTensors,
    Mxfp4,
}

impl W4Method {
    /// The `quant_method` of `config.json`.
    pub fn quant_method(self) -> &'static str {
        match self {
            W4Method::Awq => "awq",
            W4Method::Gptq => "gptq",
            W4Method::CompressedTensors => "compressed-tensors",
            W4Method::Mxfp4 => "mxfp4",
        }
    }

    /// The format in words, for messages.
    pub fn describe(self) -> &'static str {
        match self {
            W4Method::Awq => "AWQ 4-bit (quant_method awq)",
            W4Method::Gptq => "GPTQ 4-bit (quant_method gptq)",
            W4Method::CompressedTensors => "compressed-tensors W4A16 (pack-quantized)",
            W4Method::Mxfp4 => "MXFP4 (quant_method mxfp4)",
        }
    }

    /// What each of the 16 codes means before the zero and the scale.
    fn code_values(self) -> &'static [f32; 16] {
        match self {
            W4Method::Mxfp4 => &mxfp4::E2M1,
            _ => &INTEGERS,
        }
    }
}

/// The `quant_method`s whose linear layers kvfleet's CPU engine loads packed (MXFP4 is read
/// for MoE experts through [`mxfp4`]; a dense layer of an MXFP4 checkpoint is bf16).
pub const CPU_QUANT_METHODS: &[&str] = &["awq", "gptq", "compressed-tensors", "mxfp4"];

const INTEGERS: [f32; 16] = [
    0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
];

// === impl W4Weight ===

/// A 4-bit weight `[rows, cols]` (rows = output channels) in the one layout every format is
/// repacked into at load.
#[derive(Clone, Debug, PartialEq)]
pub struct W4Weight {
    pub method: W4Method,
    pub rows: usize,
    pub cols: usize,
    /// `[rows, cols.div_ceil(2)]`: column `2j` in the low nibble of byte `j`, `2j + 1` in the
    /// high one.
    pub codes: Vec<u8>,
    /// Input columns per group (the last group may be shorter).
    pub group_size: usize,
    /// Groups per row.
    pub groups: usize,
    /// `[rows, groups]`, as f32 (exact: the checkpoints store fp16, bf16, f32 or e8m0).
    pub scales: Vec<f32>,
    /// `[rows, groups]` in code units (0..=16: GPTQ v1 stores zero - 1, so its 15 means 16);
    /// empty for a format without zero points (MXFP4).
    pub zeros: Vec<u8>,
    /// `[cols]`: the group of each input column where it is not `column / group_size` (GPTQ
    /// `desc_act`, compressed-tensors `actorder: group`).
    pub g_idx: Option<Vec<u32>>,
}

impl W4Weight {
    fn row_bytes(&self) -> usize {
        self.cols.div_ceil(2)
    }

    /// Code of column `c` in row `r`.
    pub fn code(&self, r: usize, c: usize) -> u8 {
        (self.codes[r * self.row_bytes() + c / 2] >> ((c & 1) * 4)) & 0x0f
    }

    /// Sets the code of column `c` in row `r` (loaders fill a zeroed buffer).
    fn set_code(codes: &mut [u8], cols: usize, r: usize, c: usize, q: u8) {
        codes[r * cols.div_ceil(2) + c / 2] |= (q & 0x0f) << ((c & 1) * 4);
    }

    /// The group of input column `c`.
    pub fn group_of(&self, c: usize) -> usize {
        match &self.g_idx {
            Some(g) => g[c] as usize,
            None => c / self.group_size,
        }
    }

    /// Row `r` dequantized into `out` (`cols` values): `(value(code) - zero) x scale` of each
    /// column's group, in f32.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let values = self.method.code_values();
        let scales = &self.scales[r * self.groups..(r + 1) * self.groups];
        let zero = |g: usize| -> f32 {
            if self.zeros.is_empty() {
                0.0
            } else {
                f32::from(self.zeros[r * self.groups + g])
            }
        };
        let row = &self.codes[r * self.row_bytes()..(r + 1) * self.row_bytes()];
        let code = |c: usize| usize::from((row[c / 2] >> ((c & 1) * 4)) & 0x0f);
        match &self.g_idx {
            // Contiguous groups: a table of the 16 values per group.
            None => {
                for (g, &s) in scales.iter().enumerate() {
                    let z = zero(g);
                    let lut: [f32; 16] = std::array::from_fn(|q| (values[q] - z) * s);
                    let (start, end) = (g * self.group_size, ((g + 1) * self.group_size).min(self.cols));
                    if start % 2 == 0 {
                        // Two columns a byte (groups start on even columns: sizes are multiples
                        // of 8); a trailing odd column takes its low nibble alone.
                        let pairs = out[start..end].chunks_exact_mut(2);
                        for (pair, b) in pairs.zip(&row[start / 2..]) {
                            pair[0] = lut[usize::from(b & 0x0f)];
                            pair[1] = lut[usize::from(b >> 4)];
                        }
                        if (end - start) % 2 == 1 {
                            out[end - 1] = lut[code(end - 1)];
                        }
                    } else {
                        for (c, o) in out.iter_mut().enumerate().take(end).skip(start) {
                            *o = lut[code(c)];
                        }
                    }
                }
            }
            Some(gi) => {
                for (c, o) in out.iter_mut().enumerate().take(self.cols) {
                    let g = gi[c] as usize;
                    *o = (values[code(c)] - zero(g)) * scales[g];
                }
            }
        }
    }

    /// The whole weight dequantized, `[rows, cols]` (tests and the f32 comparison model; the
    /// engine never holds it).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut w = vec![0f32; self.rows * self.cols];
        w.par_chunks_mut(self.cols.max(1))
            .enumerate()
            .for_each(|(r, row)| self.dequantize_row(r, row));
        w
    }

    /// Bytes held: codes, scales (f32), zeros and `g_idx`.
    pub fn bytes(&self) -> usize {
        self.codes.len()
            + self.scales.len() * 4
            + self.zeros.len()
            + self.g_idx.as_ref().map_or(0, |g| g.len() * 4)
    }

    /// `out = x W^T` for the `t` rows of `x` (`[t, cols]` into `[t, rows]`): tiles of rows are
    /// dequantized and multiplied on rayon threads. Each output element is the same
    /// [`matmul_t`] dot product as with the whole f32 matrix, so the result equals the
    /// dequantized model's bit for bit.
    pub fn project(&self, x: &[f32], t: usize, out: &mut [f32]) {
        // Rows per tile: a tile's f32 weights stay in L2 while the tokens stream past it.
        let tile = (1usize << 15).div_ceil(self.cols.max(1)).clamp(8, 256);
        let (rows, cols) = (self.rows, self.cols);
        let parts: Vec<(usize, Vec<f32>)> = (0..rows.div_ceil(tile))
            .into_par_iter()
            .map(|i| {
                let r0 = i * tile;
                let n = tile.min(rows - r0);
                let mut w = vec![0f32; n * cols];
                for (j, row) in w.chunks_mut(cols.max(1)).enumerate() {
                    self.dequantize_row(r0 + j, row);
                }
                let mut o = vec![0f32; t * n];
                matmul_t(x, t, cols, &w, n, &mut o);
                (r0, o)
            })
            .collect();
        for (r0, o) in parts {
            let n = o.len() / t.max(1);
            for (ti, src) in o.chunks(n.max(1)).enumerate() {
                out[ti * rows + r0..ti * rows + r0 + n].copy_from_slice(src);
            }
        }
    }

    /// Checks the invariants the loaders establish (sizes, group indices, zero range).
    fn checked(self) -> Result<Self, String> {
        let want_codes = self.rows * self.row_bytes();
        if self.codes.len() != want_codes || self.scales.len() != self.rows * self.groups {
            return Err(format!(
                "{} code bytes and {} scales for a {}x{} weight in {} groups",
                self.codes.len(),
                self.scales.len(),
                self.rows,
                self.cols,
                self.groups
            ));
        }
        if !self.zeros.is_empty() && self.zeros.len() != self.scales.len() {
            return Err(format!(
                "{} zero points for {} scales",
                self.zeros.len(),
                self.scales.len()
            ));
        }
        if self.group_size == 0
            || (self.g_idx.is_none() && self.cols.div_ceil(self.group_size) != self.groups)
        {
            return Err(format!(
                "{} groups of {} do not cover {} columns",
                self.groups, self.group_size, self.cols
            ));
        }
        if let Some(g) = &self.g_idx {
            if g.len() != self.cols {
                return Err(format!(
                    "g_idx holds {} entries for {} columns",
                    g.len(),
                    self.cols
                ));
            }
            if let Some(bad) = g.iter().find(|&&v| v as usize >= self.groups) {
                return Err(format!("g_idx names group {bad} of {}", self.groups));
            }
        }
        Ok(self)
    }
}

// === impl config ===

/// A checkpoint's 4-bit `quantization_config`, validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct W4Config {
    pub method: W4Method,
    /// Input columns per group; `None` for one group per row (GPTQ `group_size: -1`,
    /// compressed-tensors `strategy: channel`).
    pub group_size: Option<usize>,
    /// Zero points are stored (AWQ always; GPTQ always, `sym` or not; compressed-tensors
    /// when `symmetric` is false).
    pub zero_points: bool,
    /// GPTQ `desc_act` / compressed-tensors `actorder: group`: columns carry a `g_idx`.
    pub act_order: bool,
    /// GPTQ `checkpoint_format` v1 (`gptq`, the default): the stored zero is the zero less one.
    pub zero_minus_one: bool,
    /// Modules left unquantized (`modules_to_not_convert`, compressed-tensors `ignore`).
    pub ignored: Vec<String>,
}

/// Errors of reading a 4-bit checkpoint: a config field or a tensor, and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum W4Error {
    #[error("config.json field {field}: {message}")]
    Config { field: String, message: String },
    #[error("tensor `{tensor}`: {message}")]
    Tensor { tensor: String, message: String },
}

fn cfg_err(field: impl Into<String>, message: impl Into<String>) -> W4Error {
    W4Error::Config {
        field: field.into(),
        message: message.into(),
    }
}

pub(crate) fn tensor_err(tensor: &str, message: impl Into<String>) -> W4Error {
    W4Error::Tensor {
        tensor: tensor.into(),
        message: message.into(),
    }
}

const QC: &str = "quantization_config";

impl W4Config {
    /// Reads `quantization_config` of a config.json: `Ok(None)` when there is none or it is
    /// not a 4-bit method (FP8 is `super::fp8`'s); an error naming the field for a 4-bit
    /// method in a variant kvfleet does not read (other bit widths, AWQ GEMV, W4A8, ...).
    pub fn from_config_json(config: &Value) -> Result<Option<W4Config>, W4Error> {
        let Some(q) = config.get("quantization_config") else {
            return Ok(None);
        };
        let strings = |v: Option<&Value>| -> Vec<String> {
            v.and_then(Value::as_array)
                .map(|a| a.iter().filter_map(|s| s.as_str().map(str::to_string)).collect())
                .unwrap_or_default()
        };
        let int = |k: &str| q.get(k).and_then(Value::as_i64);
        let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("");
        let base = W4Config {
            method: W4Method::Awq,
            group_size: None,
            zero_points: true,
            act_order: false,
            zero_minus_one: false,
            ignored: Vec::new(),
        };
        let four_bits = |keys: &[&str]| -> Result<(), W4Error> {
            for k in keys {
                if let Some(b) = int(k) {
                    if b != 4 {
                        return Err(cfg_err(
                            format!("{QC}.{k}"),
                            format!(
                                "{b}-bit weights are not supported; kvfleet reads 4-bit {method} checkpoints"
                            ),
                        ));
                    }
                }
            }
            Ok(())
        };
        let group = |keys: &[&str], allow_all: bool| -> Result<Option<usize>, W4Error> {
            let Some((k, g)) = keys.iter().find_map(|k| int(k).map(|g| (*k, g))) else {
                return Err(cfg_err(format!("{QC}.{}", keys[0]), "missing"));
            };
            match g {
                -1 if allow_all => Ok(None),
                g if g > 0 && g % 8 == 0 => Ok(Some(g as usize)),
                g => Err(cfg_err(
                    format!("{QC}.{k}"),
                    format!(
                        "{g} is not a positive multiple of 8{}",
                        if allow_all { " or -1" } else { "" }
                    ),
                )),
            }
        };
        match method {
            "awq" => {
                four_bits(&["bits", "w_bit"])?;
                let version = q.get("version").and_then(Value::as_str).unwrap_or("gemm");
                if !version.eq_ignore_ascii_case("gemm") {
                    return Err(cfg_err(
                        format!("{QC}.version"),
                        format!("AWQ `{version}` packing is not supported; kvfleet reads AutoAWQ GEMM checkpoints (version gemm)"),
                    ));
                }
                if q.get("zero_point").and_then(Value::as_bool) == Some(false) {
                    return Err(cfg_err(
                        format!("{QC}.zero_point"),
                        "AWQ without zero points is not supported; kvfleet reads zero_point: true",
                    ));
                }
                Ok(Some(W4Config {
                    method: W4Method::Awq,
                    group_size: group(&["group_size", "q_group_size"], false)?,
                    ignored: strings(q.get("modules_to_not_convert")),
                    ..base
                }))
            }
            "gptq" => {
                four_bits(&["bits"])?;
                let format = q
                    .get("checkpoint_format")
                    .and_then(Value::as_str)
                    .unwrap_or("gptq");
                let zero_minus_one = match format {
                    "gptq" => true,
                    "gptq_v2" => false,
                    other => {
                        return Err(cfg_err(
                            format!("{QC}.checkpoint_format"),
                            format!("`{other}` is not supported; kvfleet reads gptq (v1) and gptq_v2"),
                        ))
                    }
                };
                if q.get("lm_head").and_then(Value::as_bool) == Some(true) {
                    return Err(cfg_err(
                        format!("{QC}.lm_head"),
                        "a quantized LM head is not supported; quantize with lm_head: false",
                    ));
                }
                Ok(Some(W4Config {
                    method: W4Method::Gptq,
                    group_size: group(&["group_size"], true)?,
                    act_order: q.get("desc_act").and_then(Value::as_bool).unwrap_or(false),
                    zero_minus_one,
                    ignored: strings(q.get("modules_to_not_convert")),
                    ..base
                }))
            }
            "compressed-tensors" => compressed::config(q, base).map(|c| {
                c.map(|c| W4Config {
                    ignored: strings(q.get("ignore")),
                    ..c
                })
            }),
            "mxfp4" => Ok(Some(W4Config {
                method: W4Method::Mxfp4,
                group_size: Some(mxfp4::BLOCK),
                zero_points: false,
                ignored: strings(q.get("modules_to_not_convert")),
                ..base
            })),
            _ => Ok(None),
        }
    }

    /// The packed weight of module `stem` (`[rows, cols]`), read through `get` (a tensor by
    /// name); `Ok(None)` when the module is stored unquantized (no packed tensors: ignored
    /// modules, the LM head), so the caller reads `<stem>.weight` as usual.
    pub fn load_linear<'a>(
        &self,
        stem: &str,
        rows: usize,
        cols: usize,
        get: impl Fn(&str) -> Option<RawTensor<'a>>,
    ) -> Result<Option<W4Weight>, W4Error> {
        let w = match self.method {
            W4Method::Awq => awq::load(self, stem, rows, cols, &get)?,
            W4Method::Gptq => gptq::load(self, stem, rows, cols, &get)?,
            W4Method::CompressedTensors => compressed::load(self, stem, rows, cols, &get)?,
            // gpt-oss's dense layers are bf16; its experts are the MoE loader's.
            W4Method::Mxfp4 => None,
        };
        w.map(|w| w.checked().map_err(|m| tensor_err(stem, m)))
            .transpose()
    }
}

// === raw tensors ===

/// A tensor as stored: shape, dtype and little-endian bytes.
#[derive(Clone, Copy, Debug)]
pub struct RawTensor<'a> {
    pub shape: &'a [usize],
    pub dtype: Dtype,
    pub data: &'a [u8],
}

impl RawTensor<'_> {
    fn expect_shape(&self, name: &str, want: &[usize]) -> Result<(), W4Error> {
        if self.shape != want {
            return Err(tensor_err(
                name,
                format!("shape {:?}, the layer's geometry implies {want:?}", self.shape),
            ));
        }
        Ok(())
    }

    /// I32 elements (the packed words).
    fn i32s(&self, name: &str) -> Result<Vec<i32>, W4Error> {
        match self.dtype {
            Dtype::I32 => Ok(self
                .data
                .chunks_exact(4)
                .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()),
            Dtype::I64 => Ok(self
                .data
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().unwrap_or([0; 8])) as i32)
                .collect()),
            other => Err(tensor_err(name, format!("dtype {other}, expected I32"))),
        }
    }

    /// Floating-point elements as f32 (F16, BF16 and F32 widen exactly).
    fn floats(&self, name: &str) -> Result<Vec<f32>, W4Error> {
        match self.dtype {
            Dtype::F32 => Ok(self
                .data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()),
            Dtype::F16 => Ok(self
                .data
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect()),
            Dtype::BF16 => Ok(self
                .data
                .chunks_exact(2)
                .map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16))
                .collect()),
            other => Err(tensor_err(
                name,
                format!("dtype {other}, expected F16, BF16 or F32"),
            )),
        }
    }
}

/// Tensor `name`, or an error saying it is missing.
fn need<'a>(get: &impl Fn(&str) -> Option<RawTensor<'a>>, name: &str) -> Result<RawTensor<'a>, W4Error> {
    get(name).ok_or_else(|| {
        tensor_err(
            name,
            "missing from the checkpoint (is config.json's quantization_config from the same model?)",
        )
    })
}

/// The 4-bit nibble `k` (0..8) of a packed word, low bits first.
fn nibble(word: i32, k: usize) -> u8 {
    ((word as u32 >> (4 * k)) & 0x0f) as u8
}

#[cfg(test)]
mod tests;
