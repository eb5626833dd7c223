//! AutoAWQ GEMM checkpoints (`quant_method: awq`, `version: gemm`). A linear layer `<stem>`
//! stores (casper-hansen/AutoAWQ `awq/modules/linear/gemm.py`, `WQLinear_GEMM.from_linear`;
//! vllm-project/vllm `model_executor/layers/quantization/awq.py`, `AWQLinearMethod`):
//!
//! - `qweight`: I32 `[in, out / 8]`, eight output columns a word;
//! - `qzeros`: I32 `[in / group, out / 8]`, packed the same way;
//! - `scales`: F16 `[in / group, out]`.
//!
//! The eight nibbles of a word (low bits first) hold the output columns `8j + ORDER[k]`, with
//! `ORDER = [0, 2, 4, 6, 1, 3, 5, 7]` (`AWQ_ORDER`; `awq/utils/packing_utils.py` reads them
//! back with its inverse `AWQ_REVERSE_ORDER`). A weight is `(q - zero) x scale`
//! (`dequantize_gemm` there); AWQ's groups run along the input, so `in` is a multiple of the
//! group size (`WQLinear_GEMM` asserts it).

use super::{need, nibble, tensor_err, RawTensor, W4Config, W4Error, W4Method, W4Weight};

/// The output column (within its word's eight) of each nibble.
pub const AWQ_ORDER: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];

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
    let group = cfg.group_size.unwrap_or(cols);
    if rows % 8 != 0 || cols % group != 0 {
        return Err(tensor_err(
            &qweight_name,
            format!("a {rows}x{cols} layer does not pack into AWQ words of 8 outputs and groups of {group} inputs"),
        ));
    }
    let groups = cols / group;
    qweight.expect_shape(&qweight_name, &[cols, rows / 8])?;
    let (zeros_name, scales_name) = (format!("{stem}.qzeros"), format!("{stem}.scales"));
    let qzeros = need(get, &zeros_name)?;
    qzeros.expect_shape(&zeros_name, &[groups, rows / 8])?;
    let scales = need(get, &scales_name)?;
    scales.expect_shape(&scales_name, &[groups, rows])?;
    let (qweight, qzeros, scales) = (
        qweight.i32s(&qweight_name)?,
        qzeros.i32s(&zeros_name)?,
        scales.floats(&scales_name)?,
    );
    Ok(Some(repack(&qweight, &qzeros, &scales, rows, cols, group)))
}

/// AutoAWQ's packed words (`qweight [cols, rows / 8]`, `qzeros [groups, rows / 8]`, `scales
/// [groups, rows]`) into [`W4Weight`].
pub fn repack(
    qweight: &[i32],
    qzeros: &[i32],
    scales: &[f32],
    rows: usize,
    cols: usize,
    group: usize,
) -> W4Weight {
    let (words, groups) = (rows / 8, cols / group);
    let mut codes = vec![0u8; rows * cols.div_ceil(2)];
    for i in 0..cols {
        for j in 0..words {
            let word = qweight[i * words + j];
            for (k, &o) in AWQ_ORDER.iter().enumerate() {
                W4Weight::set_code(&mut codes, cols, 8 * j + o, i, nibble(word, k));
            }
        }
    }
    let mut zeros = vec![0u8; rows * groups];
    let mut out_scales = vec![0f32; rows * groups];
    for g in 0..groups {
        for j in 0..words {
            for (k, &o) in AWQ_ORDER.iter().enumerate() {
                zeros[(8 * j + o) * groups + g] = nibble(qzeros[g * words + j], k);
            }
        }
        for r in 0..rows {
            out_scales[r * groups + g] = scales[g * rows + r];
        }
    }
    W4Weight {
        method: W4Method::Awq,
        rows,
        cols,
        codes,
        group_size: group,
        groups,
        scales: out_scales,
        zeros,
        g_idx: None,
    }
}
