//! GPTQ checkpoints (`quant_method: gptq`, 4 bits). A linear layer `<stem>` stores
//! (AutoGPTQ/AutoGPTQ `auto_gptq/nn_modules/qlinear/qlinear_cuda.py`, `QuantLinear.pack` and
//! its torch dequantization; vllm-project/vllm `model_executor/layers/quantization/gptq.py`,
//! `GPTQLinearMethod.create_weights`):
//!
//! - `qweight`: I32 `[in / 8, out]`, eight consecutive input rows a word, low bits first;
//! - `qzeros`: I32 `[groups, out / 8]`, eight consecutive output columns a word;
//! - `scales`: F16 `[groups, out]`, `groups = ceil(in / group_size)` (one with -1);
//! - `g_idx`: I32 `[in]`, the group of each input row (`i / group_size` unless `desc_act`
//!   reordered the columns when quantizing; the weights stay in the original order).
//!
//! A weight is `(q - zero) x scale` of its row's group. Checkpoint format v1 (`gptq`, the
//! default) stores `zero - 1` (`pack` subtracts one; every reader adds it back, so a stored 15
//! is a zero of 16); `gptq_v2` (GPTQModel) stores the zero itself.

use super::{need, nibble, tensor_err, RawTensor, W4Config, W4Error, W4Method, W4Weight};

/// Repacks layer `stem` (`[rows = out, cols = in]`); `Ok(None)` when it has no `qweight`.
pub(super) fn load<'a>(
    cfg: &W4Config,
    stem: &str,
    rows: usize,
    cols: usize,
    get: &impl Fn(&str) -> Option<RawTensor<'a>>,
) -> Result<Option<W4Weight>, W4Error> {
    let qweight_name = format!("{stem}.qweight");
    let Some(qweight) = get(&qweight_name) else {
        return Ok(None);
    };
    if rows % 8 != 0 || cols % 8 != 0 {
        return Err(tensor_err(
            &qweight_name,
            format!("a {rows}x{cols} layer does not pack into GPTQ words of 8 inputs and 8 outputs"),
        ));
    }
    let group = cfg.group_size.unwrap_or(cols);
    let groups = cols.div_ceil(group);
    qweight.expect_shape(&qweight_name, &[cols / 8, rows])?;
    let (zeros_name, scales_name, g_name) = (
        format!("{stem}.qzeros"),
        format!("{stem}.scales"),
        format!("{stem}.g_idx"),
    );
    let qzeros = need(get, &zeros_name)?;
    qzeros.expect_shape(&zeros_name, &[groups, rows / 8])?;
    let scales = need(get, &scales_name)?;
    scales.expect_shape(&scales_name, &[groups, rows])?;
    let g_idx = match get(&g_name) {
        Some(t) => {
            t.expect_shape(&g_name, &[cols])?;
            let g = t.i32s(&g_name)?;
            if let Some(bad) = g.iter().find(|&&v| v < 0 || v as usize >= groups) {
                return Err(tensor_err(&g_name, format!("names group {bad} of {groups}")));
            }
            Some(g.into_iter().map(|v| v as u32).collect::<Vec<u32>>())
        }
        None if cfg.act_order => {
            return Err(tensor_err(
                &g_name,
                "missing, and desc_act is true: the column order needs it",
            ))
        }
        None => None,
    };
    let (qweight, qzeros, scales) = (
        qweight.i32s(&qweight_name)?,
        qzeros.i32s(&zeros_name)?,
        scales.floats(&scales_name)?,
    );
    Ok(Some(repack(
        &qweight,
        &qzeros,
        &scales,
        g_idx,
        rows,
        cols,
        group,
        cfg.zero_minus_one,
    )))
}

/// GPTQ's packed words into [`W4Weight`]; a `g_idx` equal to `i / group` is dropped (the
/// contiguous groups then take the faster path).
#[allow(clippy::too_many_arguments)]
pub fn repack(
    qweight: &[i32],
    qzeros: &[i32],
    scales: &[f32],
    g_idx: Option<Vec<u32>>,
    rows: usize,
    cols: usize,
    group: usize,
    zero_minus_one: bool,
) -> W4Weight {
    let groups = cols.div_ceil(group);
    let mut codes = vec![0u8; rows * cols.div_ceil(2)];
    for w in 0..cols / 8 {
        for o in 0..rows {
            let word = qweight[w * rows + o];
            for k in 0..8 {
                W4Weight::set_code(&mut codes, cols, o, 8 * w + k, nibble(word, k));
            }
        }
    }
    let words = rows / 8;
    let mut zeros = vec![0u8; rows * groups];
    let mut out_scales = vec![0f32; rows * groups];
    for g in 0..groups {
        for j in 0..words {
            for k in 0..8 {
                let z = nibble(qzeros[g * words + j], k);
                zeros[(8 * j + k) * groups + g] = z + u8::from(zero_minus_one);
            }
        }
        for r in 0..rows {
            out_scales[r * groups + g] = scales[g * rows + r];
        }
    }
    let g_idx = g_idx.filter(|g| g.iter().enumerate().any(|(i, &v)| v as usize != i / group));
    W4Weight {
        method: W4Method::Gptq,
        rows,
        cols,
        codes,
        group_size: group,
        groups,
        scales: out_scales,
        zeros,
        g_idx,
    }
}
