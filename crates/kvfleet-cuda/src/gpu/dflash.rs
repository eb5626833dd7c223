//! DFlash drafters on the GPU beside the target, the same math as the CPU's `model::dflash` on
//! the model's kernels and cuBLAS:
//! - a catch-up gathers the kept rows' target features (bf16, `fc`'s column order), fuses them
//!   with `fc`, norms them (`hidden_norm`) and writes each layer's *context* K/V at the rows'
//!   positions (`k_norm(W_k h)` with RoPE, `W_v h`): no attention, no draft;
//! - a block pass runs each proposing request's newest token and `k` mask tokens through the
//!   layers (Qwen3: Q/K norms), appending the block's K/V and attending over the context and the
//!   whole block without a causal mask (the pool's layers are built non-causal); the outputs at
//!   the mask positions, final-normed, go through the LM head (the drafter's, else the
//!   target's) and the device argmax, mapped through `d2t`.
//!
//! Like the EAGLE-3 drafter ([`super::drafter`]) it borrows the target's step buffers between steps and
//! keeps its pool of `n_layers` layers on the target's pages.

use cudarc::driver::CudaSlice;
use kvfleet_engine::engine::{Backend, StepPlan};
use kvfleet_engine::model::dflash::{Dflash, DflashConfig};
use kvfleet_engine::model::forward::Forward;
use kvfleet_engine::model::proposer::{BlockRow, CatchUp, DflashPasses, DraftPasses, Drafted};

use crate::backend::CudaBackend;

use super::arena::upload_into;
use super::blas::Gemm;
use super::error::{backend_err, drv, GpuError};
use super::features::{Beside, Target};
use super::kernels::{Glu, Norm};
use super::shape::Dims;
use super::weights::to_bf16;

/// One layer's tensors on the device.
struct LayerW {
    input_norm: CudaSlice<f32>,
    /// `[qw + 2 kw, d]`.
    wqkv: CudaSlice<u16>,
    q_norm: CudaSlice<f32>,
    k_norm: CudaSlice<f32>,
    wo: CudaSlice<u16>,
    post_norm: CudaSlice<f32>,
    /// `[2 ff, d]`: gate rows, then up rows.
    wgu: CudaSlice<u16>,
    wdown: CudaSlice<u16>,
}

/// A DFlash drafter on the GPU: weights, its pool, the target's kept features.
pub(super) struct GpuDflash {
    config: DflashConfig,
    dims: Dims,
    fc: CudaSlice<u16>,
    hidden_norm: CudaSlice<f32>,
    layers: Vec<LayerW>,
    out_norm: CudaSlice<f32>,
    /// `[draft vocab, d]`, else the target's LM head.
    lm_head: Option<CudaSlice<u16>>,
    embed: Option<CudaSlice<u16>>,
    inv_freq: CudaSlice<f32>,
    d2t: Vec<u32>,
    backend: CudaBackend,
}

impl GpuDflash {
    /// Uploads `m` beside its target, one layer of its pool per drafter layer.
    pub fn new(m: Dflash, at: &Beside<'_>) -> Result<Self, GpuError> {
        let c = m.config.clone();
        let (dims, backend) = at.layers(&c.layer, c.layer.n_layers, c.causal, c.draft_vocab)?;
        let gpu = at.gpu;
        let up16 =
            |parts: &[&[f32]]| -> Result<CudaSlice<u16>, GpuError> { Ok(gpu.upload(&to_bf16(parts))?) };
        let layers = m
            .layers
            .iter()
            .map(|w| {
                Ok(LayerW {
                    input_norm: gpu.upload(&w.input_norm)?,
                    wqkv: up16(&[&w.wq, &w.wk, &w.wv])?,
                    q_norm: gpu.upload(&w.q_norm)?,
                    k_norm: gpu.upload(&w.k_norm)?,
                    wo: up16(&[&w.wo])?,
                    post_norm: gpu.upload(&w.post_norm)?,
                    wgu: up16(&[&w.w_gate, &w.w_up])?,
                    wdown: up16(&[&w.w_down])?,
                })
            })
            .collect::<Result<Vec<_>, GpuError>>()?;
        Ok(GpuDflash {
            fc: up16(&[&m.fc])?,
            hidden_norm: gpu.upload(&m.hidden_norm)?,
            layers,
            out_norm: gpu.upload(&m.out_norm)?,
            lm_head: m.lm_head.as_ref().map(|h| up16(&[h])).transpose()?,
            embed: m.embed.as_ref().map(|e| up16(&[e])).transpose()?,
            inv_freq: gpu.upload(&m.inv_freq)?,
            d2t: m.d2t.clone(),
            config: c,
            dims,
            backend,
        })
    }

    /// The catch-up after a target step: each layer's context K/V at the positions `rows` name.
    fn catch_up_on(
        &mut self,
        mut t: Target<'_>,
        rows: &[CatchUp<'_>],
        plan: &StepPlan,
    ) -> Result<(), GpuError> {
        let (mut positions, mut src) = (Vec::new(), Vec::new());
        for r in rows {
            t.hidden.check_rows(r.seq, r.row, r.next.len())?;
            positions.extend((r.start_pos..r.start_pos + r.next.len()).map(|p| p as i32));
            src.extend((r.row..r.row + r.next.len()).map(|i| i as i32));
        }
        let n = positions.len();
        if n == 0 {
            return Ok(());
        }
        let (dm, c) = (self.dims, &self.config.layer);
        let (dt, n_aux) = (self.config.target_hidden, self.config.aux_layers.len());
        let s = t.k.stream().clone();
        t.a.ensure(&s, t.dims, n, 1)?;
        upload_into(&s, &positions, &mut t.a.pos)?;
        let fcin = t.hidden.gather(t.k, &src, dt)?;
        let a = &mut *t.a;
        t.blas
            .gemm(&self.fc, fcin, &mut a.x, Gemm::store(n, dm.d, n_aux * dt))?;
        t.k.rms_norm(&a.x, n, dm.d, Norm::new(&self.hidden_norm, c.rms_eps), &mut a.h)?;
        self.backend.prepare(plan).map_err(backend_err)?;
        for li in 0..self.layers.len() {
            self.kv_into_pool(&mut t, li, n)?;
        }
        Ok(())
    }

    /// Each row's block (its newest token, then `drafts` mask tokens) through the layers in one
    /// pass; returns every row's drafts, in row order.
    fn blocks_on(
        &mut self,
        mut t: Target<'_>,
        rows: &[BlockRow],
        plan: &StepPlan,
    ) -> Result<Vec<u32>, GpuError> {
        let (mut tokens, mut positions, mut masks) = (Vec::new(), Vec::new(), Vec::new());
        for r in rows {
            masks.extend((tokens.len() + 1..=tokens.len() + r.drafts).map(|i| i as i32));
            tokens.push(r.token as i32);
            tokens.extend(std::iter::repeat_n(self.config.mask_token as i32, r.drafts));
            positions.extend((r.pos..=r.pos + r.drafts).map(|p| p as i32));
        }
        let n = tokens.len();
        if masks.is_empty() {
            return Ok(Vec::new());
        }
        let dm = self.dims;
        let eps = self.config.layer.rms_eps;
        let s = t.k.stream().clone();
        t.a.ensure(&s, t.dims, n, 1)?;
        upload_into(&s, &tokens, &mut t.a.tok)?;
        upload_into(&s, &positions, &mut t.a.pos)?;
        t.k.embed(
            self.embed.as_ref().unwrap_or(t.embed),
            &t.a.tok,
            n,
            dm.d,
            &mut t.a.x,
        )?;
        self.backend.prepare(plan).map_err(backend_err)?;
        for li in 0..self.layers.len() {
            let l = &self.layers[li];
            t.k.rms_norm(&t.a.x, n, dm.d, Norm::new(&l.input_norm, eps), &mut t.a.h)?;
            self.kv_into_pool(&mut t, li, n)?;
            let (l, a) = (&self.layers[li], &mut *t.a);
            self.backend
                .attention(li, &a.q, &mut a.attn)
                .map_err(backend_err)?;
            t.blas.gemm(&l.wo, &a.attn, &mut a.x, Gemm::add(n, dm.d, dm.qw))?;
            t.k.rms_norm(&a.x, n, dm.d, Norm::new(&l.post_norm, eps), &mut a.h)?;
            t.blas
                .gemm(&l.wgu, &a.h, &mut a.gu, Gemm::store(n, 2 * dm.ff, dm.d))?;
            t.k.glu(Glu::Silu, &a.gu, n, dm.ff, &mut a.act)?;
            t.blas
                .gemm(&l.wdown, &a.act, &mut a.x, Gemm::add(n, dm.d, dm.ff))?;
        }
        let a = &mut *t.a;
        // The mask rows through the final norm and the LM head, as many at a time as the
        // logits buffer holds rows.
        let (head, dv) = match &self.lm_head {
            Some(h) => (h, self.config.draft_vocab),
            None => (t.head, t.dims.vocab),
        };
        let mut out = Vec::with_capacity(masks.len());
        for chunk in masks.chunks(a.rows.max(1)) {
            let m = chunk.len();
            upload_into(&s, chunk, &mut a.last)?;
            t.k.rms_norm_rows(&a.x, &a.last, m, dm.d, Norm::new(&self.out_norm, eps), &mut a.hl)?;
            t.blas
                .gemm(head, &a.hl, &mut a.logits, Gemm::store(m, dv, dm.d))?;
            t.k.argmax_rows(&a.logits, m, dv, &mut a.picks)?;
            let mut ids = vec![0i32; m];
            s.memcpy_dtoh(&a.picks.slice(..m), &mut ids)
                .map_err(drv("copying drafted tokens to the host"))?;
            s.synchronize().map_err(drv("drafting"))?;
            for i in ids {
                out.push(self.d2t.get(i as usize).copied().ok_or_else(|| {
                    GpuError::Invalid(format!("draft token {i} outside the draft vocabulary"))
                })?);
            }
        }
        Ok(out)
    }

    /// Layer `li`'s Q/K/V of the `n` normed rows in `a.h` (Q/K norms, RoPE at `a.pos`), its K/V
    /// appended to the pool (the plan is prepared).
    fn kv_into_pool(&mut self, t: &mut Target<'_>, li: usize, n: usize) -> Result<(), GpuError> {
        let (dm, c, l) = (&self.dims, &self.config.layer, &self.layers[li]);
        let a = &mut *t.a;
        t.blas
            .gemm(&l.wqkv, &a.h, &mut a.qkv, Gemm::store(n, dm.qw + 2 * dm.kw, dm.d))?;
        t.rope_qkv(c, dm, n, Some((&l.q_norm, &l.k_norm)), &self.inv_freq)?;
        let a = &*t.a;
        self.backend.append_kv(li, &a.k, &a.v).map_err(backend_err)
    }
}

impl DraftPasses for GpuDflash {
    fn catch_up(&mut self, target: &mut dyn Forward, rows: &[CatchUp<'_>], plan: &StepPlan) -> Drafted {
        self.catch_up_on(Target::of(target)?, rows, plan)?;
        Ok(Vec::new())
    }
}

impl DflashPasses for GpuDflash {
    fn blocks(&mut self, target: &mut dyn Forward, rows: &[BlockRow], plan: &StepPlan) -> Drafted {
        Ok(self.blocks_on(Target::of(target)?, rows, plan)?)
    }
}
