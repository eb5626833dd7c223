//! The Llama family's layers on the GPU (Llama, Qwen2, SmolLM2: biases and Q/K norms where the
//! model has them), the same math as the CPU's `Llama::forward`. Per layer:
//! `h = rmsnorm(x)` (bf16); `qkv = h · Wqkvᵀ` (one GEMM, f32 out); split with bias, Q/K norm and
//! RoPE into bf16 Q/K/V; append K/V and attend; `x += attn · Woᵀ` (the GEMM accumulates into the
//! f32 residual, beta = 1); `h = rmsnorm(x)`; `gu = h · Wguᵀ` (gate and up in one GEMM);
//! `act = silu(gate) * up`; `x += act · Wdownᵀ`.
//!
//! Which kernel runs each projection (the one-token GEMVs with the norm, SwiGLU, residual add
//! or Q/K/V split fused in; the FP8 GEMMs' fused neighbours) is the weight's op's choice
//! ([`super::linear`]); this file says what is projected through what.

use kvfleet_engine::engine::Backend;

use super::error::{backend_err, GpuError};
use super::kernels::{QkvOut, QkvPost};
use super::linear::{Ops, QkvRope, Rows};
use super::rows::{Glu, Norm};
use super::step::{part, Family, Step};
use super::weights::LayerW;

/// The Llama family.
pub(super) struct LlamaFamily;

impl Family for LlamaFamily {
    fn layers(&self, st: &mut Step<'_>) -> Result<(), GpuError> {
        let (w, dm) = (st.w, st.dm);
        st.k.embed(&w.embed, &st.a.tok, st.t, dm.d, &mut st.a.x)?;
        st.marks.mark(part::EMBED)?;
        let mut ops = st.ops();
        for (li, l) in w.layers.iter().enumerate() {
            st.keep_features(li)?;
            if !qkv(st, &mut ops, li, l)? {
                st.backend.append_kv(li, &st.a.k, &st.a.v).map_err(backend_err)?;
            }
            st.marks.mark(part::KV_APPEND)?;
            st.backend
                .attention(li, &st.a.q, &mut st.a.attn)
                .map_err(backend_err)?;
            st.marks.mark(part::ATTENTION)?;
            mlp(st, &mut ops, l)?;
            st.marks.mark(part::DOWN_GEMM)?;
        }
        ops.settle(&mut st.a.x, dm.d, &st.a.fp8)?;
        st.keep_features(w.layers.len())
    }
}

/// The normed input through the fused Q/K/V projection, then bias, Q/K norms and RoPE.
/// Returns whether layer `li`'s K/V are in its cache already (the projection wrote them).
fn qkv<'w>(st: &mut Step<'w>, ops: &mut Ops<'w>, li: usize, l: &'w LayerW) -> Result<bool, GpuError> {
    let (c, dm) = (st.c, st.dm);
    let a = &mut *st.a;
    let norm = Norm::new(&l.attn_norm, c.rms_eps);
    let input = l.wqkv.norm_input(ops, &mut a.x, norm, &mut a.h, &mut a.fp8)?;
    st.marks.mark(part::NORM)?;
    if ops.splits_in_projection() && l.qk_norm().is_none() {
        // The split in the projection's own launch: bias and RoPE (no Q/K norms here: they
        // need the whole head), and K/V into the cache where the backend lets it.
        let cache = if st.fused_append {
            st.backend.single_token_append(li).map_err(backend_err)?
        } else {
            None
        };
        let appended = cache.is_some();
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
        l.wqkv.project_split(ops, input, rope)?;
        st.marks.mark(part::QKV_GEMM)?;
        st.marks.mark(part::QKV_POST)?;
        return Ok(appended);
    }
    let unscaled = l.wqkv.project_for_split(ops, input, &mut a.qkv, &mut a.fp8)?;
    st.marks.mark(part::QKV_GEMM)?;
    let post = QkvPost {
        config: c,
        dims: dm,
        qkv: &a.qkv,
        pos: &a.pos,
        bias: l.bqkv.as_ref(),
        qk_norm: l.qk_norm(),
        inv_freq: &st.w.inv_freq,
        scales: unscaled.map(|u| u.with(&a.fp8)),
    };
    let out = QkvOut {
        q: &mut a.q,
        k: &mut a.k,
        v: &mut a.v,
    };
    st.k.qkv_post(st.t, &post, out, st.k.pdl)?;
    st.marks.mark(part::QKV_POST)?;
    Ok(false)
}

/// `x += attn · Woᵀ`; `h = rmsnorm(x)`; `act = silu(h · Wgateᵀ) * (h · Wupᵀ)`;
/// `x += act · Wdownᵀ`.
fn mlp<'w>(st: &mut Step<'w>, ops: &mut Ops<'w>, l: &'w LayerW) -> Result<(), GpuError> {
    let a = &mut *st.a;
    l.wo.project_add(ops, Rows::Bf16(&a.attn), &mut a.x, &mut a.fp8)?;
    st.marks.mark(part::O_GEMM)?;
    let norm = Norm::new(&l.ffn_norm, st.c.rms_eps);
    let input = l.wgu.norm_input(ops, &mut a.x, norm, &mut a.h, &mut a.fp8)?;
    st.marks.mark(part::NORM)?;
    let gu = l
        .wgu
        .project_gate_up(ops, input, Glu::Silu, &l.wdown, &mut a.gu, &mut a.act, &mut a.fp8)?;
    st.marks.mark(part::FFN_GEMM)?;
    let act = l
        .wdown
        .activate(ops, Glu::Silu, gu, &a.gu, &mut a.act, &mut a.fp8)?;
    st.marks.mark(part::ACT)?;
    l.wdown.project_add(ops, act, &mut a.x, &mut a.fp8)
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
