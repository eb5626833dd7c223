//! Gemma 3's layers on the GPU, apart from the Llama family's so that the two can change
//! independently. Per layer (the CPU's `Llama::forward` with `gemma3` set, in the same order):
//! `h = rmsnorm(x)`; `qkv = h · Wqkvᵀ`; Q/K norms (the query scale folded into the Q norm's
//! weights, [`super::weights`]) and RoPE with the layer's base (local or global); append K/V to
//! the layer group's pages and attend (the local layers' group masks keys outside the window);
//! `x += rmsnorm(attn · Woᵀ)`; `h = rmsnorm(x)`; `act = gelu_tanh(gate) * up`;
//! `x += rmsnorm(act · Wdownᵀ)`. The embedding is scaled by `sqrt(d)` on the way in; the tied
//! LM head reads the unscaled table. The (1 + w) RMSNorm is the plain kernel: the GGUF norm
//! tensors already hold 1 + w. With a drafter, the residual stream entering its feature layers
//! (the scaled embedding for layer 0) is kept as the CPU's `forward_aux` keeps it.
//!
//! The block runs GEMMs at every step size (no GEMV path) and is profiled as one part.

use cudarc::driver::CudaSlice;

use kvfleet_engine::engine::Backend;

use super::error::{backend_err, GpuError};
use super::kernels::{QkvOut, QkvPost};
use super::linear::Rows;
use super::rows::{Glu, Norm};
use super::step::{part, Family, Step};
use super::weights::LayerW;

/// The Gemma 3 family.
pub(super) struct Gemma3Family;

fn missing(what: &str) -> GpuError {
    GpuError::Invalid(format!("a Gemma 3 model without {what}"))
}

impl Family for Gemma3Family {
    fn layers(&self, st: &mut Step<'_>) -> Result<(), GpuError> {
        let (c, dm, w) = (st.c, st.dm, st.w);
        let local_freq = w
            .inv_freq_local
            .as_ref()
            .ok_or_else(|| missing("local RoPE frequencies"))?;
        let scale = (dm.d as f32).sqrt();
        st.k.embed_scaled(&w.embed, &st.a.tok, st.t, dm.d, scale, &mut st.a.x)?;
        for (li, l) in w.layers.iter().enumerate() {
            let freq = if c.layer_window(li).is_some() {
                local_freq
            } else {
                &w.inv_freq
            };
            st.keep_features(li)?;
            layer(st, li, l, freq)?;
        }
        st.keep_features(w.layers.len())?;
        st.marks.mark(part::EMBED)
    }

    /// One token keeps the GEMMs too: the block has always run them (not measured otherwise).
    fn single_token_gemv(&self) -> bool {
        false
    }
}

/// Layer `li` of the step, with the RoPE frequencies `freq` of its base.
fn layer(st: &mut Step<'_>, li: usize, l: &LayerW, freq: &CudaSlice<f32>) -> Result<(), GpuError> {
    let (c, dm, k, t) = (st.c, st.dm, st.k, st.t);
    let (Some(qk_norm), Some(post_attn), Some(post_ffn)) = (l.qk_norm(), &l.post_attn_norm, &l.post_ffn_norm)
    else {
        return Err(missing("QK norms and post-norms"));
    };
    let ops = st.ops();
    let norm = |w| Norm::new(w, c.rms_eps);
    let a = &mut *st.a;
    k.rms_norm(&a.x, t, dm.d, norm(&l.attn_norm), &mut a.h)?;
    l.wqkv.project(&ops, Rows::Bf16(&a.h), &mut a.qkv, &mut a.fp8)?;
    let post = QkvPost {
        config: c,
        dims: dm,
        qkv: &a.qkv,
        pos: &a.pos,
        bias: None,
        qk_norm: Some(qk_norm),
        inv_freq: freq,
        scales: None,
    };
    let out = QkvOut {
        q: &mut a.q,
        k: &mut a.k,
        v: &mut a.v,
    };
    // Without PDL, as the block has always been launched (not measured with it).
    k.qkv_post(t, &post, out, false)?;
    st.backend.append_kv(li, &a.k, &a.v).map_err(backend_err)?;
    st.backend.attention(li, &a.q, &mut a.attn).map_err(backend_err)?;
    l.wo.project(&ops, Rows::Bf16(&a.attn), &mut a.proj, &mut a.fp8)?;
    k.rms_norm_add(&a.proj, t, dm.d, norm(post_attn), &mut a.x)?;
    k.rms_norm(&a.x, t, dm.d, norm(&l.ffn_norm), &mut a.h)?;
    l.wgu.project(&ops, Rows::Bf16(&a.h), &mut a.gu, &mut a.fp8)?;
    k.glu(Glu::GeluTanh, &a.gu, t, dm.ff, &mut a.act)?;
    l.wdown
        .project(&ops, Rows::Bf16(&a.act), &mut a.proj, &mut a.fp8)?;
    k.rms_norm_add(&a.proj, t, dm.d, norm(post_ffn), &mut a.x)
}
