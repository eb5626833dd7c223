//! The Llama family's layers on the GPU (Llama, Qwen2, SmolLM2: biases and Q/K norms where the
//! model has them), the same math as the CPU's `Llama::forward`. Per layer:
//! `h = rmsnorm(x)` (bf16); `qkv = h · Wqkvᵀ` (one GEMM, f32 out); split with bias, Q/K norm and
//! RoPE into bf16 Q/K/V; append K/V and attend; `x += attn · Woᵀ` (the GEMM accumulates into the
//! f32 residual, beta = 1); `h = rmsnorm(x)`; `gu = h · Wguᵀ` (gate and up in one GEMM);
//! `act = silu(gate) * up`; `x += act · Wdownᵀ`.
//!
//! A step of one token runs each projection as one fused GEMV instead ([`super::gemv`]): the
//! norm inside the QKV and gate/up launches, the split (bias, RoPE) inside QKV where the model
//! has no Q/K norms, SwiGLU inside gate/up, the residual add inside O and down; five launches a
//! layer fewer. With FP8 weights on cuBLASLt's unit-scale path, the
//! O and down GEMMs' residual add is left to the RMSNorm after them ([`Pending`]).

use kvfleet_engine::engine::Backend;

use cudarc::driver::CudaSlice;

use super::blas::{Fp8In, Gemm};
use super::error::{backend_err, GpuError};
use super::fp8::{Fp8Kernels, Fp8Scratch, Fusion, Mat};
use super::gemv::{Input, Output, QkvRope};
use super::kernels::{Glu, ModelKernels, Norm, QkvOut, QkvPost};
use super::step::{part, Family, Step};
use super::weights::LayerW;

/// The Llama family.
pub(super) struct LlamaFamily;

impl Family for LlamaFamily {
    fn layers(&self, st: &mut Step<'_>) -> Result<(), GpuError> {
        let (w, dm) = (st.w, st.dm);
        st.k.embed(&w.embed, &st.a.tok, st.t, dm.d, &mut st.a.x)?;
        st.marks.mark(part::EMBED)?;
        let mut pending = None;
        for (li, l) in w.layers.iter().enumerate() {
            st.keep_features(li)?;
            if !qkv(st, li, l, pending.take())? {
                st.backend.append_kv(li, &st.a.k, &st.a.v).map_err(backend_err)?;
            }
            st.marks.mark(part::KV_APPEND)?;
            st.backend
                .attention(li, &st.a.q, &mut st.a.attn)
                .map_err(backend_err)?;
            st.marks.mark(part::ATTENTION)?;
            if st.fused {
                mlp_gemv(st, l)?;
            } else {
                pending = mlp_gemm(st, l)?;
            }
            st.marks.mark(part::DOWN_GEMM)?;
        }
        finish(st, pending)?;
        st.keep_features(w.layers.len())
    }
}

/// The residual add an FP8 O or down GEMM left to the norm after it: the weight's row scales,
/// the unscaled product in `a.fp8.d` (cuBLASLt with unit scales; [`Blas::project_add_deferred`]).
///
/// [`Blas::project_add_deferred`]: super::blas::Blas::project_add_deferred
type Pending<'w> = Option<&'w CudaSlice<f32>>;

/// Whether this step's FP8 O and down GEMMs leave their residual add to the next norm: both
/// fusions on, and no layer's residual stream kept for a drafter (it must be complete then).
fn defers_add(st: &Step<'_>) -> bool {
    st.k.fp8.as_ref().is_some_and(|f| f.fusion.add && f.fusion.norm) && !st.keeps_features()
}

/// Does the add `pending` left, where no fused norm takes it.
fn finish(st: &mut Step<'_>, pending: Pending<'_>) -> Result<(), GpuError> {
    match pending {
        Some(sw) => st
            .blas
            .finish_add(st.k, sw, &mut st.a.x, (st.t, st.dm.d), &st.a.fp8),
        None => Ok(()),
    }
}

/// The normed input through the fused Q/K/V projection, then bias, Q/K norms and RoPE;
/// `pending`: the previous layer's down projection left its residual add to this norm.
/// Returns whether layer `li`'s K/V are in its cache already (the one-token GEMV wrote them).
fn qkv(st: &mut Step<'_>, li: usize, l: &LayerW, pending: Pending<'_>) -> Result<bool, GpuError> {
    let (c, dm, k, t) = (st.c, st.dm, st.k, st.t);
    let fused_norm = fp8_fusion(k, &l.wqkv).is_some_and(|(_, fz)| fz.norm) && !st.fused;
    if !fused_norm {
        finish(st, pending)?;
    }
    let a = &mut *st.a;
    let norm = Norm::new(&l.attn_norm, c.rms_eps);
    // The QKV GEMM's weight scales, when the split applies them (FP8, unit-scale GEMM).
    let mut unscaled = None;
    if st.fused && k.gemv.fused_qkv && l.qk_norm().is_none() {
        // One launch for the projection and the split: the GEMV's epilogue adds the bias and
        // rotates each pair (no Q/K norms here: they need the whole head), and writes K/V into
        // the cache where the backend lets it.
        let cache = if st.fused_append {
            st.backend.single_token_append(li).map_err(backend_err)?
        } else {
            None
        };
        let appended = cache.is_some();
        let input = Input::normed(&a.x, norm.w, norm.eps);
        let rope = QkvRope {
            pos: &a.pos,
            bias: l.bqkv.as_ref(),
            inv_freq: &st.w.inv_freq,
            n_heads: dm.n_heads,
            n_kv: dm.n_kv,
            kv_rep: dm.kv_rep,
            head_dim: dm.hd,
            rope_half: c.rope_dims / 2,
            neox: c.rope_neox,
            pos_scale: c.rope_linear_scale,
            q: &mut a.q,
            k: &mut a.k,
            v: &mut a.v,
            cache,
        };
        k.gemv.run(&l.wqkv, dm.qkv(), dm.d, input, Output::Qkv(rope))?;
        st.marks.mark(part::QKV_GEMM)?;
        st.marks.mark(part::QKV_POST)?;
        return Ok(appended);
    } else if st.fused {
        let input = Input::normed(&a.x, norm.w, norm.eps);
        k.gemv
            .run(&l.wqkv, dm.qkv(), dm.d, input, Output::Store(&mut a.qkv))?;
    } else if let Some((f8, fz)) = fp8_fusion(k, &l.wqkv) {
        let pending = pending.filter(|_| fused_norm);
        let input = norm_fp8(f8, fz, k, &mut a.x, t, dm.d, norm, pending, &mut a.h, &mut a.fp8)?;
        st.marks.mark(part::NORM)?;
        let dims = (t, dm.qkv(), dm.d);
        if fz.qkv {
            unscaled = st
                .blas
                .gemm_fp8(k, &l.wqkv, input, &mut a.qkv, dims, &mut a.fp8)?;
        } else {
            let g = Gemm::store(t, dm.qkv(), dm.d);
            st.blas.project_in(k, &l.wqkv, input, &mut a.qkv, g, &mut a.fp8)?;
        }
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
        scales: unscaled.map(|sw| (&a.fp8.sx, sw)),
    };
    let out = QkvOut {
        q: &mut a.q,
        k: &mut a.k,
        v: &mut a.v,
    };
    k.qkv_post(t, &post, out, k.pdl)?;
    st.marks.mark(part::QKV_POST)?;
    Ok(false)
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

/// The FP8 kernels and what they fuse, when `w` is an FP8 weight and anything is fused.
fn fp8_fusion<'k>(k: &'k ModelKernels, w: &Mat) -> Option<(&'k Fp8Kernels, Fusion)> {
    let f8 = k.fp8.as_ref().filter(|f| f.fusion != Fusion::NONE)?;
    matches!(w, Mat::Fp8 { .. }).then_some((f8, f8.fusion))
}

/// RMSNorm of the residual into an FP8 GEMM's input: straight into `s`'s quantized rows when
/// fused, else into bf16 `h` for the projection to quantize. `pending`: the residual add a
/// GEMM left ([`Pending`]), done first (inside the fused norm when it runs).
#[allow(clippy::too_many_arguments)] // the kernels, the rows and their norm, the add, both outputs
fn norm_fp8<'h>(
    f8: &Fp8Kernels,
    fz: Fusion,
    k: &ModelKernels,
    x: &mut CudaSlice<f32>,
    t: usize,
    d: usize,
    norm: Norm<'_>,
    pending: Pending<'_>,
    h: &'h mut CudaSlice<u16>,
    s: &mut Fp8Scratch,
) -> Result<Fp8In<'h>, GpuError> {
    if fz.norm && Fp8Kernels::fits(d) {
        match pending {
            Some(sw) => f8.add_rms_norm_quantize(k.stream(), sw, x, t, d, norm, s)?,
            None => f8.rms_norm_quantize(k.stream(), x, t, d, norm, s)?,
        }
        return Ok(Fp8In::Quantized);
    }
    if let Some(sw) = pending {
        f8.scale(k.stream(), Some(&s.d), t, d, &s.sx, sw, true, x)?;
    }
    k.rms_norm(x, t, d, norm, h)?;
    Ok(Fp8In::Bf16(h))
}

/// O, gate/up and down as cuBLAS GEMMs with the norm and SwiGLU kernels between them. Returns
/// the down projection's residual add when it is left to the next norm ([`Pending`]).
fn mlp_gemm<'w>(st: &mut Step<'_>, l: &'w LayerW) -> Result<Pending<'w>, GpuError> {
    let (dm, t, k, blas) = (st.dm, st.t, st.k, st.blas);
    let defer = defers_add(st) && fp8_fusion(k, &l.wgu).is_some();
    let a = &mut *st.a;
    let o_dims = (t, dm.d, dm.qw);
    let o_pending = if defer {
        blas.project_add_deferred(k, &l.wo, Fp8In::Bf16(&a.attn), &mut a.x, o_dims, &mut a.fp8)?
    } else {
        blas.project(k, &l.wo, &a.attn, &mut a.x, Gemm::add(t, dm.d, dm.qw), &mut a.fp8)?;
        None
    };
    st.marks.mark(part::O_GEMM)?;
    if let Some((f8, fz)) = fp8_fusion(k, &l.wgu) {
        let norm = Norm::new(&l.ffn_norm, st.c.rms_eps);
        let input = norm_fp8(
            f8, fz, k, &mut a.x, t, dm.d, norm, o_pending, &mut a.h, &mut a.fp8,
        )?;
        st.marks.mark(part::NORM)?;
        if fz.glu && Fp8Kernels::fits(dm.ff) {
            let dims = (t, 2 * dm.ff, dm.d);
            let sw = blas.gemm_fp8(k, &l.wgu, input, &mut a.gu, dims, &mut a.fp8)?;
            st.marks.mark(part::FFN_GEMM)?;
            f8.glu_quantize(k.stream(), Glu::Silu, &a.gu, t, dm.ff, sw, &mut a.fp8)?;
            st.marks.mark(part::ACT)?;
            let dims = (t, dm.d, dm.ff);
            if defer {
                return blas.project_add_deferred(k, &l.wdown, Fp8In::Quantized, &mut a.x, dims, &mut a.fp8);
            }
            let g = Gemm::add(t, dm.d, dm.ff);
            blas.project_in(k, &l.wdown, Fp8In::Quantized, &mut a.x, g, &mut a.fp8)?;
            return Ok(None);
        }
        let g = Gemm::store(t, 2 * dm.ff, dm.d);
        blas.project_in(k, &l.wgu, input, &mut a.gu, g, &mut a.fp8)?;
        st.marks.mark(part::FFN_GEMM)?;
        k.glu(Glu::Silu, &a.gu, t, dm.ff, &mut a.act)?;
        st.marks.mark(part::ACT)?;
        let g = Gemm::add(t, dm.d, dm.ff);
        blas.project(k, &l.wdown, &a.act, &mut a.x, g, &mut a.fp8)?;
        return Ok(None);
    }
    k.rms_norm(&a.x, t, dm.d, Norm::new(&l.ffn_norm, st.c.rms_eps), &mut a.h)?;
    st.marks.mark(part::NORM)?;
    let g = Gemm::store(t, 2 * dm.ff, dm.d);
    blas.project(k, &l.wgu, &a.h, &mut a.gu, g, &mut a.fp8)?;
    st.marks.mark(part::FFN_GEMM)?;
    k.glu(Glu::Silu, &a.gu, t, dm.ff, &mut a.act)?;
    st.marks.mark(part::ACT)?;
    let g = Gemm::add(t, dm.d, dm.ff);
    blas.project(k, &l.wdown, &a.act, &mut a.x, g, &mut a.fp8)?;
    Ok(None)
}

#[cfg(test)]
mod tests {
    use kvfleet_engine::engine::direct::DirectPlanner;
    use kvfleet_engine::engine::StepPlan;
    use kvfleet_engine::model::forward::{step_direct, Forward};
    use kvfleet_engine::model::llama::{LlamaConfig, SeqChunk};

    use super::super::fp8::Fusion;
    use super::super::{GpuLlama, GpuOptions};

    /// Every fusion of the FP8 GEMMs' neighbours computes what the unfused kernels compute,
    /// operation for operation, so a prefill step's logits stay bit-equal with each fusion alone
    /// and with all of them (the unfused step twice first: the step itself is deterministic).
    #[test]
    #[ignore = "needs an NVIDIA GPU of compute capability 8.9 or later"]
    fn gpu_fp8_fusions_leave_prefill_logits_bit_equal() {
        // head_dim 128, GQA 2, widths that are multiples of 16.
        let c = LlamaConfig::llama(2, 512, 1536, 4, 2, 1000);
        let o = GpuOptions {
            max_kv_tokens: Some(4096),
            max_batched_tokens: 256,
            max_num_seqs: 8,
            fp8_weights: true,
            ..GpuOptions::default()
        };
        let gpu = GpuLlama::open_gpu(0).unwrap_or_else(|e| panic!("no GPU: {e}"));
        let mut m = GpuLlama::dummy(gpu, c, 3, &o).unwrap_or_else(|e| panic!("dummy model: {e}"));
        let mut planner = DirectPlanner::new(m.kv_config().block_size, &m.kv_config().groups);
        let mut plan = StepPlan::default();
        let prompt: Vec<u32> = (0..200u32).map(|i| (i * 7919 + 11) % 1000).collect();
        let only = |norm, glu, qkv, add| Fusion { norm, glu, qkv, add };
        let variants = [
            ("none", Fusion::NONE),
            ("none again", Fusion::NONE),
            ("norm", only(true, false, false, false)),
            ("glu", only(false, true, false, false)),
            ("qkv", only(false, false, true, false)),
            ("norm,add", only(true, false, false, true)),
            ("all", Fusion::ALL),
        ];
        let mut want: Option<Vec<f32>> = None;
        for (i, (name, fz)) in variants.into_iter().enumerate() {
            m.kernels.fp8.as_mut().expect("FP8 kernels").fusion = fz;
            // A new sequence each time, the same prompt from position 0: the same computation.
            let batch = [SeqChunk {
                seq: i as u64 + 1,
                start_pos: 0,
                tokens: &prompt,
                logits: 1,
            }];
            let got = step_direct(&mut m, &mut planner, &batch, &mut plan)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(got.iter().all(|v| v.is_finite()), "{name}: non-finite logits");
            match &want {
                None => {
                    let spread = got.iter().fold(0f32, |a, v| a.max(v.abs()));
                    assert!(spread > 0.0, "all-zero logits");
                    want = Some(got);
                }
                Some(w) => {
                    let diff = got
                        .iter()
                        .zip(w)
                        .filter(|(a, b)| a.to_bits() != b.to_bits())
                        .count();
                    assert_eq!(
                        diff,
                        0,
                        "{name}: {diff} of {} logits differ from the unfused step",
                        w.len()
                    );
                }
            }
        }
    }
}
