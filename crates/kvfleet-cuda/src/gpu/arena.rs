//! The activation arena: every buffer a step writes, sized for a number of tokens and logit
//! rows and grown when a step needs more.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use super::error::{drv, need, GpuError};
use super::sampling::PICK_WORDS;
use super::shape::Dims;

/// Activation buffers for up to `tokens` tokens (`T`) and `rows` logit rows (`R`) per step.
pub(super) struct Acts {
    pub tokens: usize,
    pub rows: usize,
    pub tok: CudaSlice<i32>,
    pub pos: CudaSlice<i32>,
    pub last: CudaSlice<i32>,
    /// f32 `[T, d]`, the residual stream.
    pub x: CudaSlice<f32>,
    /// bf16 `[T, max(d, qw)]`: normed input of the QKV and gate/up GEMMs.
    pub h: CudaSlice<u16>,
    /// f32 `[T, qw + 2 kw]`.
    pub qkv: CudaSlice<f32>,
    /// bf16 `[T, n_heads, hd]`.
    pub q: CudaSlice<u16>,
    /// bf16 `[T, n_kv * kv_rep, hd]`.
    pub k: CudaSlice<u16>,
    pub v: CudaSlice<u16>,
    /// bf16 `[T, n_heads, hd]`.
    pub attn: CudaSlice<u16>,
    /// f32 `[T, 2 ff]`.
    pub gu: CudaSlice<f32>,
    /// bf16 `[T, ff]`.
    pub act: CudaSlice<u16>,
    /// bf16 `[R, d]`: normed last rows.
    pub hl: CudaSlice<u16>,
    /// f32 `[R, vocab]`.
    pub logits: CudaSlice<f32>,
    /// `[R]`: each row's token.
    pub picks: CudaSlice<i32>,
    /// `[R, PICK_WORDS]`: each row's sampling parameters (`kvf_pick_rows`).
    pub pick_words: CudaSlice<u32>,
    /// The rows' logit adjustments (`kvf_adjust_rows`), grown by [`Acts::ensure_adjust`].
    pub adjust: CudaSlice<u32>,
    /// Gemma 3: f32 `[T, d]`, a sublayer's output before its post-norm (one element otherwise).
    pub proj: CudaSlice<f32>,
}

impl Acts {
    /// Bytes of the buffers for `t` tokens and `r` rows.
    pub fn bytes(dm: &Dims, t: usize, r: usize) -> usize {
        let f32s = t * dm.d + t * (dm.qw + 2 * dm.kw) + t * 2 * dm.ff + r * dm.vocab;
        let bf16s = t * dm.d + 2 * t * dm.qw + 2 * t * dm.kw_rep + t * dm.ff + r * dm.d;
        let proj = if dm.gemma { t * dm.d } else { 1 };
        4 * (f32s + proj) + 2 * bf16s + 4 * (2 * t + 2 * r + PICK_WORDS * r)
    }

    pub fn alloc(s: &Arc<CudaStream>, dm: &Dims, t: usize, r: usize) -> Result<Self, GpuError> {
        let (t, r) = (t.max(1), r.max(1));
        let f = |n: usize| s.alloc_zeros::<f32>(n).map_err(drv("allocating activations"));
        let h = |n: usize| s.alloc_zeros::<u16>(n).map_err(drv("allocating activations"));
        let i = |n: usize| s.alloc_zeros::<i32>(n).map_err(drv("allocating activations"));
        Ok(Acts {
            tokens: t,
            rows: r,
            tok: i(t)?,
            pos: i(t)?,
            last: i(r)?,
            x: f(t * dm.d)?,
            h: h(t * dm.d)?,
            qkv: f(t * (dm.qw + 2 * dm.kw))?,
            q: h(t * dm.qw)?,
            k: h(t * dm.kw_rep)?,
            v: h(t * dm.kw_rep)?,
            attn: h(t * dm.qw)?,
            gu: f(t * 2 * dm.ff)?,
            act: h(t * dm.ff)?,
            hl: h(r * dm.d)?,
            logits: f(r * dm.vocab)?,
            picks: i(r)?,
            pick_words: s
                .alloc_zeros::<u32>(r * PICK_WORDS)
                .map_err(drv("allocating activations"))?,
            adjust: s.alloc_zeros::<u32>(1).map_err(drv("allocating activations"))?,
            proj: f(if dm.gemma { t * dm.d } else { 1 })?,
        })
    }

    /// Grows the buffers to hold `tokens` tokens and `rows` rows, when they hold fewer.
    pub fn ensure(
        &mut self,
        s: &Arc<CudaStream>,
        dm: &Dims,
        tokens: usize,
        rows: usize,
    ) -> Result<(), GpuError> {
        if tokens <= self.tokens && rows <= self.rows {
            return Ok(());
        }
        let (t, r) = (tokens.max(self.tokens), rows.max(self.rows));
        tracing::debug!(tokens = t, rows = r, "growing GPU activation buffers");
        // Free the old buffers first so the new ones can reuse their memory.
        *self = Acts::alloc(s, dm, 1, 1)?;
        *self = Acts::alloc(s, dm, t, r).map_err(|e| {
            GpuError::Memory(format!(
                "activations for {t} tokens and {r} logit rows ({} MiB): {e}",
                Acts::bytes(dm, t, r) >> 20
            ))
        })?;
        Ok(())
    }
}

impl Acts {
    /// Grows the adjustment buffer (to a power of two) to hold `words` words.
    pub fn ensure_adjust(&mut self, s: &Arc<CudaStream>, words: usize) -> Result<(), GpuError> {
        if self.adjust.len() < words {
            let n = words.next_power_of_two();
            self.adjust = s
                .alloc_zeros::<u32>(n)
                .map_err(drv("allocating logit adjustments"))?;
        }
        Ok(())
    }
}

/// Copies a step's host indices (tokens, positions, rows) into the front of `dst`.
pub(super) fn upload_into(
    s: &Arc<CudaStream>,
    host: &[i32],
    dst: &mut CudaSlice<i32>,
) -> Result<(), GpuError> {
    if host.is_empty() {
        return Ok(());
    }
    need("index buffer", dst, host.len())?;
    let mut view = dst.slice_mut(..host.len());
    s.memcpy_htod(host, &mut view)
        .map_err(drv("copying step indices to the device"))
}
