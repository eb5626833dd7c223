//! The Llama family's layers on the GPU (Llama, Qwen2, SmolLM2: biases and Q/K norms where the
//! model has them), the same math as the CPU's `Llama::forward`. Per layer:
//! `h = rmsnorm(x)` (bf16); `qkv = h · Wqkvᵀ` (one GEMM, f32 out); split with bias, Q/K norm and
//! RoPE into bf16 Q/K/V; append K/V and attend; `x += attn · Woᵀ` (the GEMM accumulates into the
//! f32 residual, beta = 1); `h = rmsnorm(x)`; `gu = h · Wguᵀ` (gate and up in one GEMM);
//! `act = silu(gate) * up`; `x += act · Wdownᵀ`.
//!
//! A step of one token runs each projection as one fused GEMV instead ([`super::gemv`]): the
//! norm inside the QKV and gate/up launches, SwiGLU inside gate/up, the residual add inside O
//! and down; four launches a layer fewer.

use kvfleet_engine::engine::Backend;

use super::blas::Gemm;
use super::error::{backend_err, GpuError};
use super::gemv::{Input, Output};
use super::kernels::{Glu, Norm, QkvOut, QkvPost};
use super::step::{part, Family, Step};
use super::weights::LayerW;

/// The Llama family.
pub(super) struct LlamaFamily;

impl Family for LlamaFamily {
    fn layers(&self, st: &mut Step<'_>) -> Result<(), GpuError> {
        let (w, dm) = (st.w, st.dm);
        st.k.embed(&w.embed, &st.a.tok, st.t, dm.d, &mut st.a.x)?;
        st.marks.mark(part::EMBED)?;
        for (li, l) in w.layers.iter().enumerate() {
            st.keep_features(li)?;
            qkv(st, l)?;
            st.backend.append_kv(li, &st.a.k, &st.a.v).map_err(backend_err)?;
            st.marks.mark(part::KV_APPEND)?;
            st.backend
                .attention(li, &st.a.q, &mut st.a.attn)
                .map_err(backend_err)?;
            st.marks.mark(part::ATTENTION)?;
            if st.fused {
                mlp_gemv(st, l)?;
            } else {
                mlp_gemm(st, l)?;
            }
            st.marks.mark(part::DOWN_GEMM)?;
        }
        st.keep_features(w.layers.len())
    }
}

/// The normed input through the fused Q/K/V projection, then bias, Q/K norms and RoPE.
fn qkv(st: &mut Step<'_>, l: &LayerW) -> Result<(), GpuError> {
    let (c, dm, k, t) = (st.c, st.dm, st.k, st.t);
    let a = &mut *st.a;
    let norm = Norm::new(&l.attn_norm, c.rms_eps);
    if st.fused {
        let input = Input::normed(&a.x, norm.w, norm.eps);
        k.gemv
            .run(&l.wqkv, dm.qkv(), dm.d, input, Output::Store(&mut a.qkv))?;
    } else {
        k.rms_norm(&a.x, t, dm.d, norm, &mut a.h)?;
        st.marks.mark(part::NORM)?;
        let g = Gemm::store(t, dm.qkv(), dm.d);
        st.blas.project(k, &l.wqkv, &a.h, &mut a.qkv, g, &mut a.fp8)?;
    }
    st.marks.mark(part::QKV_GEMM)?;
    let post = QkvPost {
        config: c,
        dims: dm,
        qkv: &a.qkv,
        pos: &a.pos,
        bias: l.bqkv.as_ref(),
        qk_norm: l.qk_norm(),
        inv_freq: &st.w.inv_freq,
    };
    let out = QkvOut {
        q: &mut a.q,
        k: &mut a.k,
        v: &mut a.v,
    };
    k.qkv_post(t, &post, out, k.pdl)?;
    st.marks.mark(part::QKV_POST)
}

/// O, gate/up and down as fused GEMVs (a step of one token).
fn mlp_gemv(st: &mut Step<'_>, l: &LayerW) -> Result<(), GpuError> {
    let (dm, g, eps) = (st.dm, &st.k.gemv, st.c.rms_eps);
    let a = &mut *st.a;
    g.run(&l.wo, dm.d, dm.qw, Input::Bf16(&a.attn), Output::Add(&mut a.x))?;
    st.marks.mark(part::O_GEMM)?;
    let input = Input::normed(&a.x, &l.ffn_norm, eps);
    g.run(&l.wgu, 2 * dm.ff, dm.d, input, Output::SwiGlu(&mut a.act))?;
    st.marks.mark(part::FFN_GEMM)?;
    g.run(&l.wdown, dm.d, dm.ff, Input::Bf16(&a.act), Output::Add(&mut a.x))
}

/// O, gate/up and down as cuBLAS GEMMs with the norm and SwiGLU kernels between them.
fn mlp_gemm(st: &mut Step<'_>, l: &LayerW) -> Result<(), GpuError> {
    let (dm, t, k, blas) = (st.dm, st.t, st.k, st.blas);
    let a = &mut *st.a;
    blas.project(k, &l.wo, &a.attn, &mut a.x, Gemm::add(t, dm.d, dm.qw), &mut a.fp8)?;
    st.marks.mark(part::O_GEMM)?;
    k.rms_norm(&a.x, t, dm.d, Norm::new(&l.ffn_norm, st.c.rms_eps), &mut a.h)?;
    st.marks.mark(part::NORM)?;
    let g = Gemm::store(t, 2 * dm.ff, dm.d);
    blas.project(k, &l.wgu, &a.h, &mut a.gu, g, &mut a.fp8)?;
    st.marks.mark(part::FFN_GEMM)?;
    k.glu(Glu::Silu, &a.gu, t, dm.ff, &mut a.act)?;
    st.marks.mark(part::ACT)?;
    let g = Gemm::add(t, dm.d, dm.ff);
    blas.project(k, &l.wdown, &a.act, &mut a.x, g, &mut a.fp8)
}
