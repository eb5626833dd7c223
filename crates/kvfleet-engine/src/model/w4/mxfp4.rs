//! MXFP4: the OCP Microscaling Formats (MX) Specification v1.0's MXFP4, as gpt-oss stores its
//! experts (huggingface/transformers `src/transformers/integrations/mxfp4.py`,
//! `convert_moe_packed_tensors`): a block of 32 elements along the input is 32 FP4 (E2M1)
//! codes and one shared E8M0 scale.
//!
//! - `<name>_blocks`: U8 `[..., rows, cols / 32, 16]`, two codes a byte: element `2b` of a
//!   block in the low nibble of byte `b`, element `2b + 1` in the high one;
//! - `<name>_scales`: U8 `[..., rows, cols / 32]`, E8M0: `2^(e - 127)`, 0xFF NaN (spec 5.4).
//!
//! E2M1 (spec 5.3.3): 1 sign, 2 exponent bits (bias 1), 1 mantissa bit, no infinity or NaN:
//! +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}. An element is `e2m1 x 2^(e - 127)`, exact in f32 (a power of
//! two times a 2-bit mantissa) unless it leaves f32's range (6 x 2^127 is infinite, as
//! transformers' `ldexp` gives). transformers' rows are output channels; it transposes them
//! after dequantizing, for `x @ W`; kvfleet keeps `[out, in]`.

use super::{W4Method, W4Weight};

/// Elements per block (one E8M0 scale).
pub const BLOCK: usize = 32;

/// The 16 E2M1 codes' values (sign in bit 3).
pub const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// An E8M0 scale byte as f32: `2^(e - 127)` exactly (0 gives 2^-127, a subnormal f32), NaN for
/// 0xFF.
pub fn e8m0_to_f32(e: u8) -> f32 {
    match e {
        0xff => f32::NAN,
        0 => f32::from_bits(1 << 22),
        e => f32::from_bits(u32::from(e) << 23),
    }
}

/// One row of an MXFP4 tensor dequantized: `blocks` holds its `cols / 2` bytes (16 a block),
/// `scales` its `cols / 32` E8M0 bytes; `out` gets the `cols` values. This is the reference of
/// every MXFP4 path (the MoE experts dequantize through it).
///
/// # Panics
/// When the three lengths do not match (16 bytes and one scale per 32 outputs).
pub fn dequantize_mxfp4_row(blocks: &[u8], scales: &[u8], out: &mut [f32]) {
    assert!(
        blocks.len() == scales.len() * BLOCK / 2 && out.len() == scales.len() * BLOCK,
        "an MXFP4 row of {} scales needs {} block bytes and {} outputs (got {} and {})",
        scales.len(),
        scales.len() * BLOCK / 2,
        scales.len() * BLOCK,
        blocks.len(),
        out.len()
    );
    for ((block, &e), out) in blocks
        .chunks_exact(BLOCK / 2)
        .zip(scales)
        .zip(out.chunks_exact_mut(BLOCK))
    {
        let s = e8m0_to_f32(e);
        for (b, pair) in block.iter().zip(out.chunks_exact_mut(2)) {
            pair[0] = E2M1[usize::from(b & 0x0f)] * s;
            pair[1] = E2M1[usize::from(b >> 4)] * s;
        }
    }
}

/// An MXFP4 matrix `[rows, cols]` (the `_blocks` and `_scales` of one expert, flattened) as a
/// [`W4Weight`], for the linear op; `None` when the lengths do not match.
pub fn from_blocks(blocks: &[u8], scales: &[u8], rows: usize, cols: usize) -> Option<W4Weight> {
    if cols % BLOCK != 0 || blocks.len() != rows * cols / 2 || scales.len() != rows * cols / BLOCK {
        return None;
    }
    // Codes are already two a byte, low nibble first, row after row: the layout as is.
    Some(W4Weight {
        method: W4Method::Mxfp4,
        rows,
        cols,
        codes: blocks.to_vec(),
        group_size: BLOCK,
        groups: cols / BLOCK,
        scales: scales.iter().map(|&e| e8m0_to_f32(e)).collect(),
        zeros: Vec::new(),
        g_idx: None,
    })
}
