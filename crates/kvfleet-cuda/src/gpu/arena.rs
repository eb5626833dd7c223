//! The activation arena: every buffer a step writes, sized for a number of tokens and logit
//! rows and grown when a step needs more.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use super::error::{drv, need, GpuError};
use super::fp8::Fp8Scratch;
use super::lt::Lt;
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
    /// FP8 weights: the GEMMs' quantized inputs, their scales and added outputs (one-element
    /// buffers otherwise).
    pub fp8: Fp8Scratch,
}

/// Elements of each activation buffer for `t` tokens and `r` rows: what [`Acts::alloc`]
/// allocates, kept apart so that a test holds it to the planner's formula.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Lens {
    /// i32: tokens, positions (`T`), last rows and picks (`R`).
    tokens: usize,
    rows: usize,
    /// f32.
    x: usize,
    qkv: usize,
    gu: usize,
    logits: usize,
    proj: usize,
    /// bf16.
    h: usize,
    q: usize,
    kv: usize,
    act: usize,
    hl: usize,
    /// u32.
    pick_words: usize,
    /// FP8 weights ([`Fp8Scratch`]): u8 quantized inputs, f32 token scales and added outputs,
    /// and the cuBLASLt workspace [`super::blas::Blas`] allocates beside the arena (all 0
    /// without FP8; the one-element stand-ins then are not counted, as for `proj`).
    fp8_x: usize,
    fp8_sx: usize,
    fp8_d: usize,
    fp8_workspace: usize,
}

impl Lens {
    fn new(dm: &Dims, t: usize, r: usize) -> Self {
        Lens {
            tokens: t,
            rows: r,
            x: t * dm.d,
            qkv: t * (dm.qw + 2 * dm.kw),
            gu: t * 2 * dm.ff,
            logits: r * dm.vocab,
            proj: if dm.gemma { t * dm.d } else { 1 },
            h: t * dm.d,
            q: t * dm.qw,
            kv: t * dm.kw_rep,
            act: t * dm.ff,
            hl: r * dm.d,
            pick_words: r * PICK_WORDS,
            fp8_x: if dm.fp8 { t * dm.fp8_k() } else { 0 },
            fp8_sx: if dm.fp8 { t } else { 0 },
            fp8_d: if dm.fp8 { t * dm.d } else { 0 },
            fp8_workspace: if dm.fp8 { Lt::bytes() } else { 0 },
        }
    }

    /// Bytes of the buffers `alloc` makes of these lengths (`q` twice: Q and the attention
    /// output; `kv` twice: K and V).
    #[cfg(test)]
    fn bytes(&self) -> usize {
        let i32s = 2 * self.tokens + 2 * self.rows + self.pick_words;
        let f32s = self.x + self.qkv + self.gu + self.logits + self.proj + self.fp8_sx + self.fp8_d;
        let bf16s = self.h + 2 * self.q + 2 * self.kv + self.act + self.hl;
        4 * i32s + 4 * f32s + 2 * bf16s + self.fp8_x + self.fp8_workspace
    }
}

impl Acts {
    /// Bytes of the buffers for `t` tokens and `r` rows (at least 1 each): the planner's
    /// `EngineShape::activation_bytes`, which the worker's KV budget subtracts.
    pub fn bytes(dm: &Dims, t: usize, r: usize) -> usize {
        dm.shape.activation_bytes(t as u64, r as u64) as usize
    }

    pub fn alloc(s: &Arc<CudaStream>, dm: &Dims, t: usize, r: usize) -> Result<Self, GpuError> {
        let (t, r) = (t.max(1), r.max(1));
        let n = Lens::new(dm, t, r);
        let f = |n: usize| s.alloc_zeros::<f32>(n).map_err(drv("allocating activations"));
        let h = |n: usize| s.alloc_zeros::<u16>(n).map_err(drv("allocating activations"));
        let i = |n: usize| s.alloc_zeros::<i32>(n).map_err(drv("allocating activations"));
        Ok(Acts {
            tokens: t,
            rows: r,
            tok: i(n.tokens)?,
            pos: i(n.tokens)?,
            last: i(n.rows)?,
            x: f(n.x)?,
            h: h(n.h)?,
            qkv: f(n.qkv)?,
            q: h(n.q)?,
            k: h(n.kv)?,
            v: h(n.kv)?,
            attn: h(n.q)?,
            gu: f(n.gu)?,
            act: h(n.act)?,
            hl: h(n.hl)?,
            logits: f(n.logits)?,
            picks: i(n.rows)?,
            pick_words: s
                .alloc_zeros::<u32>(n.pick_words)
                .map_err(drv("allocating activations"))?,
            // Logit adjustments grow with the requests that use them (a few words a row, see
            // ensure_adjust): outside the fixed workspace the planner counts.
            adjust: s.alloc_zeros::<u32>(1).map_err(drv("allocating activations"))?,
            proj: f(n.proj)?,
            fp8: if dm.fp8 {
                Fp8Scratch::alloc(s, n.fp8_sx, n.fp8_x / n.fp8_sx, dm.d)?
            } else {
                Fp8Scratch::none(s)?
            },
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

#[cfg(test)]
mod tests {
    use kvfleet_engine::model::llama::LlamaConfig;

    use super::*;
    use crate::gpu::shape::kv_replication;

    #[test]
    fn the_arena_allocates_exactly_the_planners_activation_bytes() {
        let mut qwen = LlamaConfig::llama(28, 3584, 18944, 28, 4, 152_064);
        qwen.attn_bias = true;
        let geometries = [
            (
                "Llama-3.1-8B",
                LlamaConfig::llama(32, 4096, 14336, 32, 8, 128_256),
            ),
            (
                "SmolLM2-135M (KV heads stored 3 times)",
                LlamaConfig::llama(30, 576, 1536, 9, 3, 49_152),
            ),
            ("Qwen2-7B (group 7)", qwen),
            ("Gemma 3 270M", LlamaConfig::gemma3(18, 640, 2048, 262_144, 512)),
        ];
        for (name, c) in geometries {
            let (rep, _) = kv_replication(c.n_heads, c.n_kv_heads).unwrap();
            for fp8 in [false, true] {
                let dm = Dims::new(&c, rep).with_fp8(fp8);
                for (t, r) in [(1, 1), (2048, 256), (8192, 1), (513, 77)] {
                    assert_eq!(
                        Lens::new(&dm, t, r).bytes(),
                        Acts::bytes(&dm, t, r),
                        "{name}, FP8 {fp8}, {t} tokens, {r} rows"
                    );
                }
            }
        }
    }
}
