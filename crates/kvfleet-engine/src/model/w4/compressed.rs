//! compressed-tensors `pack-quantized` W4A16, as llm-compressor writes it and vLLM serves it
//! (neuralmagic/compressed-tensors
//! `src/compressed_tensors/compressors/quantized_compressors/pack_quantized.py`,
//! `PackedQuantizationCompressor` and `pack_to_int32`; vllm-project/vllm
//! `model_executor/layers/quantization/compressed_tensors/schemes/compressed_tensors_wNa16.py`).
//! A linear layer `<stem>` stores:
//!
//! - `weight_packed`: I32 `[out, ceil(in / 8)]`, eight consecutive input columns a word, low
//!   bits first, each the signed code plus 8 (the row padded with zeros to whole words);
//! - `weight_scale`: `[out, groups]` in the model's float dtype (`groups = 1` for `channel`);
//! - `weight_zero_point` (asymmetric only): I32 `[ceil(out / 8), groups]`, packed along the
//!   output dimension the same way (`pack_to_int32(.., packed_dim=0)`);
//! - `weight_shape`: `[2]`, the unpacked `[out, in]`;
//! - `weight_g_idx` (`actorder: group`): I32 `[in]`, the group of each column.
//!
//! A weight is `(q - zero_point) x scale` with `q` and `zero_point` signed; both are stored
//! plus 8, so in code units it is `(stored q - stored zero) x scale`, and a symmetric
//! layer's zero is the stored 8.

use serde_json::Value;

use super::{cfg_err, need, nibble, tensor_err, RawTensor, W4Config, W4Error, W4Method, W4Weight, QC};
use safetensors::Dtype;

/// The config groups of a compressed-tensors `quantization_config`: `Ok(None)` when their
/// weights are not integers (FP8 `float-quantized` is `super::super::fp8`'s), a
/// [`W4Config`] for 4-bit `pack-quantized` W4A16, else an error naming the field.
pub(super) fn config(q: &Value, base: W4Config) -> Result<Option<W4Config>, W4Error> {
    let Some(groups) = q.get("config_groups").and_then(Value::as_object) else {
        return Ok(None);
    };
    let mut found: Option<W4Config> = None;
    for (name, g) in groups {
        let field = format!("{QC}.config_groups.{name}.weights");
        let Some(w) = g.get("weights") else {
            continue;
        };
        if w.get("type").and_then(Value::as_str) != Some("int") {
            return Ok(None);
        }
        let bits = w.get("num_bits").and_then(Value::as_u64).unwrap_or(0);
        if bits != 4 {
            // Leave 8-bit integers to the FP8 reader, which names what it reads.
            return Ok(None);
        }
        if g.get("input_activations").is_some_and(|a| !a.is_null()) {
            return Err(cfg_err(
                format!("{QC}.config_groups.{name}.input_activations"),
                "quantized activations (W4A8) are not supported; kvfleet reads W4A16 (input_activations: null)",
            ));
        }
        let symmetric = w.get("symmetric").and_then(Value::as_bool).unwrap_or(true);
        let group_size = match w.get("strategy").and_then(Value::as_str) {
            Some("channel") => None,
            Some("group") => match w.get("group_size").and_then(Value::as_i64) {
                Some(s) if s > 0 => Some(s as usize),
                other => {
                    return Err(cfg_err(
                        format!("{field}.group_size"),
                        format!("{other:?} is not a positive group size"),
                    ))
                }
            },
            other => {
                return Err(cfg_err(
                    format!("{field}.strategy"),
                    format!("{other:?} is not supported for 4-bit weights; kvfleet reads group and channel"),
                ))
            }
        };
        let act_order = w.get("actorder").and_then(Value::as_str) == Some("group");
        let c = W4Config {
            method: W4Method::CompressedTensors,
            group_size,
            zero_points: !symmetric,
            act_order,
            zero_minus_one: false,
            ..base.clone()
        };
        if found.as_ref().is_some_and(|f| *f != c) {
            return Err(cfg_err(
                &field,
                "config groups with different 4-bit schemes are not supported",
            ));
        }
        found = Some(c);
    }
    if found.is_some() {
        let format = q
            .get("format")
            .and_then(Value::as_str)
            .unwrap_or("pack-quantized");
        if format != "pack-quantized" {
            return Err(cfg_err(
                format!("{QC}.format"),
                format!("`{format}` is not supported for 4-bit weights; kvfleet reads pack-quantized"),
            ));
        }
    }
    Ok(found)
}

/// Repacks layer `stem` (`[rows = out, cols = in]`); `Ok(None)` when it has no
/// `weight_packed`.
pub(super) fn load<'a>(
    cfg: &W4Config,
    stem: &str,
    rows: usize,
    cols: usize,
    get: &impl Fn(&str) -> Option<RawTensor<'a>>,
) -> Result<Option<W4Weight>, W4Error> {
    let packed_name = format!("{stem}.weight_packed");
    let Some(packed) = get(&packed_name) else {
        return Ok(None);
    };
    let group = cfg.group_size.unwrap_or(cols);
    let groups = cols.div_ceil(group);
    packed.expect_shape(&packed_name, &[rows, cols.div_ceil(8)])?;
    let shape_name = format!("{stem}.weight_shape");
    if let Some(s) = get(&shape_name) {
        let s = s.i32s(&shape_name)?;
        if s != [rows as i32, cols as i32] {
            return Err(tensor_err(
                &shape_name,
                format!("{s:?}, the layer is [{rows}, {cols}]"),
            ));
        }
    }
    let scale_name = format!("{stem}.weight_scale");
    let scale = need(get, &scale_name)?;
    scale.expect_shape(&scale_name, &[rows, groups])?;
    let scales = scale.floats(&scale_name)?;
    let zp_name = format!("{stem}.weight_zero_point");
    let zeros = match (cfg.zero_points, get(&zp_name)) {
        (false, _) => vec![8u8; rows * groups],
        (true, None) => return Err(tensor_err(&zp_name, "missing, and the scheme is asymmetric")),
        // Older compressed-tensors wrote the zero points unpacked, signed bytes [out, groups].
        (true, Some(t)) if t.dtype == Dtype::I8 => {
            t.expect_shape(&zp_name, &[rows, groups])?;
            t.data.iter().map(|&b| (b as i8 + 8).clamp(0, 15) as u8).collect()
        }
        (true, Some(t)) => {
            t.expect_shape(&zp_name, &[rows.div_ceil(8), groups])?;
            let words = t.i32s(&zp_name)?;
            let mut z = vec![0u8; rows * groups];
            for (p, row) in words.chunks(groups).enumerate() {
                for (g, &word) in row.iter().enumerate() {
                    for k in 0..8 {
                        if 8 * p + k < rows {
                            z[(8 * p + k) * groups + g] = nibble(word, k);
                        }
                    }
                }
            }
            z
        }
    };
    let g_name = format!("{stem}.weight_g_idx");
    let g_idx = match get(&g_name) {
        Some(t) => {
            t.expect_shape(&g_name, &[cols])?;
            let g = t.i32s(&g_name)?;
            if let Some(bad) = g.iter().find(|&&v| v < 0 || v as usize >= groups) {
                return Err(tensor_err(&g_name, format!("names group {bad} of {groups}")));
            }
            let g: Vec<u32> = g.into_iter().map(|v| v as u32).collect();
            Some(g).filter(|g| g.iter().enumerate().any(|(i, &v)| v as usize != i / group))
        }
        None => None,
    };
    let words = packed.i32s(&packed_name)?;
    let per_row = cols.div_ceil(8);
    let mut codes = vec![0u8; rows * cols.div_ceil(2)];
    for r in 0..rows {
        for c in 0..cols {
            W4Weight::set_code(&mut codes, cols, r, c, nibble(words[r * per_row + c / 8], c % 8));
        }
    }
    Ok(Some(W4Weight {
        method: W4Method::CompressedTensors,
        rows,
        cols,
        codes,
        group_size: group,
        groups,
        scales,
        zeros,
        g_idx,
    }))
}
