//! EAGLE-3 drafters on the GPU beside the target ([`super::model::GpuLlama`]), the same math as
//! the CPU's `model::eagle3` on the model's kernels and cuBLAS:
//! - every target step keeps the residual stream entering the feature layers
//!   ([`super::features::AuxCapture`],
//!   f32 copies of the step's rows);
//! - a catch-up gathers the kept rows' features (bf16, `fc`'s column order), fuses them with
//!   `fc`, and runs the drafter's decoder layer over them beside the next tokens' embeddings;
//!   a chain step runs it over each request's own latest output instead;
//! - the layer: `x = features`; `qkv = rmsnorm_in(embed) · W_eᵀ + rmsnorm_hidden(x) · W_hᵀ`
//!   (the concatenation `[embeds, hidden]` as two GEMMs over the two column halves of
//!   Q/K/V); RoPE; its K/V appended to its own pool (one layer, paged by the target's page
//!   table, in pages reserved when the target's pools were sized: `DraftReserve`); attention;
//!   `x += attn · Woᵀ`; the MLP; the pre-norm outputs kept per request for chaining;
//! - each drafting row's token: `argmax(rmsnorm_out(x) · lm_headᵀ)`, mapped through `d2t`.
//!
//! The layer borrows the target's activation buffers (the target is idle between its steps),
//! so a drafter must not be wider than its target ([`GpuEagle3::new`] checks).

use std::any::Any;
use std::collections::HashMap;

use cudarc::driver::CudaSlice;
use kvfleet_engine::engine::layout::KvDtype;
use kvfleet_engine::engine::{Backend, StepPlan};
use kvfleet_engine::model::drafter::Drafter;
use kvfleet_engine::model::eagle3::{Eagle3, Eagle3Config};
use kvfleet_engine::model::forward::Forward;
use kvfleet_engine::model::kv::SeqId;
use kvfleet_engine::model::proposer::{
    CatchUp, ChainRow, DraftPasses, Drafted, Drafting, Eagle3Passes, Proposer,
};

use crate::backend::CudaBackend;
use crate::device::Gpu;

use super::arena::upload_into;
use super::blas::Gemm;
use super::error::{backend_err, drv, GpuError};
use super::features::{AuxCapture, Beside, Target};
use super::kernels::{Glu, Norm};
use super::model::GpuLlama;
use super::options::DraftReserve;
use super::shape::Dims;
use super::weights::to_bf16;

impl DraftReserve {
    /// The reservation of `d` for steps of up to `tokens` tokens and `seqs` requests, K/V in
    /// `dtype`: the planner's terms (`DraftShape`), so `kvfleet check` predicts these pools.
    pub fn of(d: &Drafter, dtype: KvDtype, tokens: usize, seqs: usize) -> Self {
        Self::of_shape(&d.shape(), dtype, tokens, seqs)
    }

    /// The reservation of a drafter of shape `s`.
    pub fn of_shape(s: &kvfleet_core::plan::DraftShape, dtype: KvDtype, tokens: usize, seqs: usize) -> Self {
        let hd = s.head_dim as usize;
        let heads = (s.n_kv_heads * s.kv_rep()) as usize;
        DraftReserve {
            fixed_bytes: s.fixed_bytes(tokens as u64, seqs as u64) as usize,
            kv_bytes_per_token: s.layers as usize
                * 2
                * heads
                * (dtype.data_bytes(hd) + dtype.scale_bytes(hd)),
            layers: s.layers as usize,
            q_heads: s.n_heads as usize,
            kv_heads: heads,
            head_dim: hd,
        }
    }
}

/// The drafter's tensors on the device (bf16 matrices `[out, in]`, f32 norms).
struct DraftW {
    /// `[d, 3 dt]`.
    fc: CudaSlice<u16>,
    input_norm: CudaSlice<f32>,
    hidden_norm: CudaSlice<f32>,
    /// `[qw + 2 kw, d]`: Q/K/V's columns over the embeddings, then over the features.
    wqkv_e: CudaSlice<u16>,
    wqkv_h: CudaSlice<u16>,
    wo: CudaSlice<u16>,
    post_norm: CudaSlice<f32>,
    /// `[2 ff, d]`: gate rows, then up rows.
    wgu: CudaSlice<u16>,
    wdown: CudaSlice<u16>,
    out_norm: CudaSlice<f32>,
    /// `[draft vocab, d]`.
    lm_head: CudaSlice<u16>,
    /// The drafter's own embeddings, else the target's.
    embed: Option<CudaSlice<u16>>,
    inv_freq: CudaSlice<f32>,
}

/// Columns `from..from + n` of a row-major `[rows, cols]` matrix.
fn columns(m: &[f32], cols: usize, from: usize, n: usize) -> Vec<f32> {
    m.chunks_exact(cols)
        .flat_map(|r| r[from..from + n].iter().copied())
        .collect()
}

impl DraftW {
    fn upload(gpu: &Gpu, m: &Eagle3) -> Result<Self, GpuError> {
        let d = m.config.layer.d_model;
        let up16 =
            |parts: &[&[f32]]| -> Result<CudaSlice<u16>, GpuError> { Ok(gpu.upload(&to_bf16(parts))?) };
        let half = |from: usize| {
            let (q, k, v) = (
                columns(&m.wq, 2 * d, from, d),
                columns(&m.wk, 2 * d, from, d),
                columns(&m.wv, 2 * d, from, d),
            );
            up16(&[&q, &k, &v])
        };
        Ok(DraftW {
            fc: up16(&[&m.fc])?,
            input_norm: gpu.upload(&m.input_norm)?,
            hidden_norm: gpu.upload(&m.hidden_norm)?,
            wqkv_e: half(0)?,
            wqkv_h: half(d)?,
            wo: up16(&[&m.wo])?,
            post_norm: gpu.upload(&m.post_norm)?,
            wgu: up16(&[&m.w_gate, &m.w_up])?,
            wdown: up16(&[&m.w_down])?,
            out_norm: gpu.upload(&m.out_norm)?,
            lm_head: up16(&[&m.lm_head])?,
            embed: m.embed.as_ref().map(|e| up16(&[e])).transpose()?,
            inv_freq: gpu.upload(&m.inv_freq)?,
        })
    }
}

/// An EAGLE-3 drafter on the GPU: weights, its one-layer pool, the target's kept features and
/// each request's latest output.
pub(super) struct GpuEagle3 {
    config: Eagle3Config,
    dims: Dims,
    w: DraftW,
    d2t: Vec<u32>,
    backend: CudaBackend,
    /// f32 `[slots, d]`: each request's latest pre-norm output.
    feat: CudaSlice<f32>,
    slots: HashMap<SeqId, usize>,
    free: Vec<usize>,
}

impl GpuLlama {
    /// Puts `drafter` beside the model: its weights, and its pool of as many pages as the
    /// model's draft group (the full-attention pages, which its K/V follow; reserved when the
    /// pools were sized with `GpuOptions::drafter`); from then on every step keeps the hidden
    /// states it reads.
    pub fn attach(&mut self, drafter: Drafter) -> Result<(), GpuError> {
        self.gpu
            .context()
            .bind_to_thread()
            .map_err(drv("binding the context"))?;
        let cfg = kvfleet_engine::engine::Backend::config(&self.backend);
        let blocks = cfg.groups.get(cfg.draft_group()).map_or(0, |g| g.num_blocks);
        let dtype = cfg.layers.first().map_or(KvDtype::Bf16, |l| l.dtype);
        let s = self.gpu.stream().clone();
        let hidden = AuxCapture::new(
            &s,
            drafter.aux_layers(),
            self.acts.tokens,
            drafter.target_hidden(),
        )?;
        let site = Beside {
            gpu: &self.gpu,
            target: &self.dims,
            dtype,
            block_size: cfg.block_size,
            num_blocks: blocks,
            seqs: self.acts.rows,
        };
        let p = proposer(drafter, &site)?;
        self.gpu.synchronize()?;
        self.hidden = Some(hidden);
        self.proposer = Some(p);
        Ok(())
    }
}

impl<'a> Target<'a> {
    /// The parts of `target`, a model on the GPU with a drafter attached, bound to this thread.
    pub fn of(target: &'a mut dyn Forward) -> Result<Self, GpuError> {
        let device = target.device();
        let m = (target as &mut dyn Any)
            .downcast_mut::<GpuLlama>()
            .ok_or_else(|| {
                GpuError::Invalid(format!(
                    "a GPU drafter beside a {device} model; attach the drafter to the model it drafts for"
                ))
            })?;
        m.gpu
            .context()
            .bind_to_thread()
            .map_err(drv("binding the context"))?;
        let hidden = m
            .hidden
            .as_mut()
            .ok_or_else(|| GpuError::Invalid("no drafter is attached".into()))?;
        Ok(Target {
            dims: &m.dims,
            k: &m.kernels,
            blas: &m.blas,
            a: &mut m.acts,
            embed: &m.weights.embed,
            head: m.weights.lm_head.as_ref().unwrap_or(&m.weights.embed),
            hidden,
        })
    }
}

/// `drafter` on the GPU beside its target, as its method's proposer.
fn proposer(drafter: Drafter, at: &Beside<'_>) -> Result<Box<dyn Proposer>, GpuError> {
    Ok(match drafter {
        Drafter::Eagle3(m) => Box::new(Drafting::eagle3(GpuEagle3::new(m, at)?)),
        Drafter::Dflash(m) => Box::new(Drafting::dflash(super::dflash::GpuDflash::new(m, at)?)),
    })
}

impl GpuEagle3 {
    fn new(m: Eagle3, at: &Beside<'_>) -> Result<Self, GpuError> {
        let c = m.config.clone();
        if c.norm_before_residual {
            return Err(GpuError::Unsupported(
                "EAGLE-3 drafters with norm_before_residual on the GPU".into(),
            ));
        }
        let (dims, backend) = at.layers(&c.layer, 1, true, c.draft_vocab)?;
        if c.aux_layers.len() != 3 {
            return Err(GpuError::Invalid(format!(
                "an EAGLE-3 drafter fuses 3 target features, this one names {}",
                c.aux_layers.len()
            )));
        }
        let s = at.gpu.stream().clone();
        let w = DraftW::upload(at.gpu, &m)?;
        Ok(GpuEagle3 {
            config: c,
            dims,
            w,
            d2t: m.d2t.clone(),
            backend,
            feat: s
                .alloc_zeros::<f32>(at.seqs.max(1) * dims.d)
                .map_err(drv("allocating the drafter's outputs"))?,
            slots: HashMap::new(),
            free: (0..at.seqs.max(1)).rev().collect(),
        })
    }

    /// The catch-up after a target step: `rows` name positions the step computed (its rows
    /// `r.row..`), each paired with the token after it. Returns a drafted token for each row
    /// with `draft`.
    fn catch_up_on(
        &mut self,
        mut t: Target<'_>,
        rows: &[CatchUp<'_>],
        plan: &StepPlan,
    ) -> Result<Vec<u32>, GpuError> {
        let (mut tokens, mut positions, mut src) = (Vec::new(), Vec::new(), Vec::new());
        let mut last = Vec::new();
        for r in rows {
            t.hidden.check_rows(r.seq, r.row, r.next.len())?;
            tokens.extend(r.next.iter().map(|&x| x as i32));
            positions.extend((r.start_pos..r.start_pos + r.next.len()).map(|p| p as i32));
            src.extend((r.row..r.row + r.next.len()).map(|i| i as i32));
            if r.draft && !r.next.is_empty() {
                last.push((r.seq, tokens.len() - 1));
            }
        }
        let n = tokens.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        let s = t.k.stream().clone();
        t.a.ensure(&s, t.dims, n, last.len().max(1))?;
        let dt = self.config.target_hidden;
        self.embed_in(&mut t, &tokens, &positions)?;
        // The features of the rows, gathered and fused by `fc` into the residual `x`.
        let fcin = t.hidden.gather(t.k, &src, dt)?;
        let g = Gemm::store(n, self.dims.d, 3 * dt);
        t.blas.gemm(&self.w.fc, fcin, &mut t.a.x, g)?;
        self.layer(&mut t, n, plan)?;
        self.keep_and_draft(&mut t, &last)
    }

    /// One chain step: each row's drafted token at its position, with the request's latest
    /// output as the feature. Returns each row's next drafted token.
    fn chain_on(
        &mut self,
        mut t: Target<'_>,
        rows: &[ChainRow],
        plan: &StepPlan,
    ) -> Result<Vec<u32>, GpuError> {
        let n = rows.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        let s = t.k.stream().clone();
        t.a.ensure(&s, t.dims, n, n)?;
        let tokens: Vec<i32> = rows.iter().map(|r| r.token as i32).collect();
        let positions: Vec<i32> = rows.iter().map(|r| r.pos as i32).collect();
        self.embed_in(&mut t, &tokens, &positions)?;
        let d = self.dims.d;
        for (i, r) in rows.iter().enumerate() {
            let slot = *self.slots.get(&r.seq).ok_or_else(|| {
                GpuError::Invalid(format!(
                    "request {} chains drafts without a drafter feature (no catch-up ran for it)",
                    r.seq
                ))
            })?;
            s.memcpy_dtod(
                &self.feat.slice(slot * d..(slot + 1) * d),
                &mut t.a.x.slice_mut(i * d..(i + 1) * d),
            )
            .map_err(drv("reading a drafter feature"))?;
        }
        self.layer(&mut t, n, plan)?;
        let last: Vec<(SeqId, usize)> = rows.iter().enumerate().map(|(i, r)| (r.seq, i)).collect();
        self.keep_and_draft(&mut t, &last)
    }

    /// Uploads the pass's tokens and positions and writes the normed embeddings into `a.h`
    /// (through `a.x`, which the features then overwrite).
    fn embed_in(&self, t: &mut Target<'_>, tokens: &[i32], positions: &[i32]) -> Result<(), GpuError> {
        let (n, d) = (tokens.len(), self.dims.d);
        let s = t.k.stream();
        upload_into(s, tokens, &mut t.a.tok)?;
        upload_into(s, positions, &mut t.a.pos)?;
        let table = self.w.embed.as_ref().unwrap_or(t.embed);
        t.k.embed(table, &t.a.tok, n, d, &mut t.a.x)?;
        let eps = self.config.layer.rms_eps;
        t.k.rms_norm(&t.a.x, n, d, Norm::new(&self.w.input_norm, eps), &mut t.a.h)
    }

    /// The decoder layer over `n` rows: normed embeddings in `a.h`, features in `a.x` (the
    /// residual); leaves the pre-norm outputs in `a.x`.
    fn layer(&mut self, t: &mut Target<'_>, n: usize, plan: &StepPlan) -> Result<(), GpuError> {
        let (dm, c) = (&self.dims, &self.config.layer);
        let (k, blas) = (t.k, t.blas);
        let a = &mut *t.a;
        // The normed features go where the attention output goes later (free until then).
        k.rms_norm(
            &a.x,
            n,
            dm.d,
            Norm::new(&self.w.hidden_norm, c.rms_eps),
            &mut a.attn,
        )?;
        let qkv = dm.qw + 2 * dm.kw;
        blas.gemm(&self.w.wqkv_e, &a.h, &mut a.qkv, Gemm::store(n, qkv, dm.d))?;
        blas.gemm(&self.w.wqkv_h, &a.attn, &mut a.qkv, Gemm::add(n, qkv, dm.d))?;
        t.rope_qkv(c, dm, n, None, &self.w.inv_freq)?;
        let a = &mut *t.a;
        self.backend.prepare(plan).map_err(backend_err)?;
        self.backend.append_kv(0, &a.k, &a.v).map_err(backend_err)?;
        self.backend
            .attention(0, &a.q, &mut a.attn)
            .map_err(backend_err)?;
        blas.gemm(&self.w.wo, &a.attn, &mut a.x, Gemm::add(n, dm.d, dm.qw))?;
        k.rms_norm(&a.x, n, dm.d, Norm::new(&self.w.post_norm, c.rms_eps), &mut a.h)?;
        blas.gemm(&self.w.wgu, &a.h, &mut a.gu, Gemm::store(n, 2 * dm.ff, dm.d))?;
        k.glu(Glu::Silu, &a.gu, n, dm.ff, &mut a.act)?;
        blas.gemm(&self.w.wdown, &a.act, &mut a.x, Gemm::add(n, dm.d, dm.ff))
    }

    /// Keeps the output row of each `(request, row)` of `last` as the request's feature and
    /// returns the token each drafts next.
    fn keep_and_draft(&mut self, t: &mut Target<'_>, last: &[(SeqId, usize)]) -> Result<Vec<u32>, GpuError> {
        if last.is_empty() {
            return Ok(Vec::new());
        }
        let (d, dv) = (self.dims.d, self.config.draft_vocab);
        let s = t.k.stream().clone();
        let a = &mut *t.a;
        for &(seq, row) in last {
            let slot = match self.slots.get(&seq) {
                Some(&slot) => slot,
                None => {
                    let slot = match self.free.pop() {
                        Some(slot) => slot,
                        None => {
                            // More requests draft at once than the buffer has rows: grow it.
                            let old = self.feat.len() / d;
                            let mut grown = s
                                .alloc_zeros::<f32>(2 * old * d)
                                .map_err(drv("growing the drafter's outputs"))?;
                            s.memcpy_dtod(&self.feat, &mut grown.slice_mut(..old * d))
                                .map_err(drv("growing the drafter's outputs"))?;
                            self.feat = grown;
                            self.free.extend((old + 1..2 * old).rev());
                            old
                        }
                    };
                    self.slots.insert(seq, slot);
                    slot
                }
            };
            s.memcpy_dtod(
                &a.x.slice(row * d..(row + 1) * d),
                &mut self.feat.slice_mut(slot * d..(slot + 1) * d),
            )
            .map_err(drv("keeping a drafter feature"))?;
        }
        let rows: Vec<i32> = last.iter().map(|&(_, r)| r as i32).collect();
        let nd = rows.len();
        upload_into(&s, &rows, &mut a.last)?;
        let eps = self.config.layer.rms_eps;
        t.k.rms_norm_rows(&a.x, &a.last, nd, d, Norm::new(&self.w.out_norm, eps), &mut a.hl)?;
        t.blas
            .gemm(&self.w.lm_head, &a.hl, &mut a.logits, Gemm::store(nd, dv, d))?;
        t.k.argmax_rows(&a.logits, nd, dv, &mut a.picks)?;
        let mut ids = vec![0i32; nd];
        s.memcpy_dtoh(&a.picks.slice(..nd), &mut ids)
            .map_err(drv("copying drafted tokens to the host"))?;
        s.synchronize().map_err(drv("drafting"))?;
        ids.into_iter()
            .map(|i| {
                self.d2t
                    .get(i as usize)
                    .copied()
                    .ok_or_else(|| GpuError::Invalid(format!("draft token {i} outside the draft vocabulary")))
            })
            .collect()
    }
}

impl DraftPasses for GpuEagle3 {
    fn catch_up(&mut self, target: &mut dyn Forward, rows: &[CatchUp<'_>], plan: &StepPlan) -> Drafted {
        Ok(self.catch_up_on(Target::of(target)?, rows, plan)?)
    }

    fn forget(&mut self, seq: SeqId) {
        if let Some(slot) = self.slots.remove(&seq) {
            self.free.push(slot);
        }
    }
}

impl Eagle3Passes for GpuEagle3 {
    fn chain(&mut self, target: &mut dyn Forward, rows: &[ChainRow], plan: &StepPlan) -> Drafted {
        Ok(self.chain_on(Target::of(target)?, rows, plan)?)
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use kvfleet_engine::model::llama::{Llama, LlamaConfig};

    use super::super::shape::kv_replication;
    use super::*;

    /// The tiny EAGLE-3 fixture (hidden 8, 2 heads over 1 KV head of 4, MLP 16, 6 draft
    /// tokens, its own embeddings of 16 x 8): its reservation counts every tensor in bf16, the
    /// kept features and inputs for 32 tokens, the outputs of 4 requests, and one layer of K/V.
    #[test]
    fn an_eagle3_reservation_counts_its_weights_buffers_and_one_layer_of_kv() {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/eagle3/tiny");
        let target = Llama::dummy(LlamaConfig::llama(4, 8, 16, 2, 1, 16), 1).unwrap();
        let d = Drafter::load(&dir, &target.config).unwrap();
        let r = DraftReserve::of(&d, KvDtype::Bf16, 32, 4);
        let weights = 8 * 24 + (8 + 2 * 4) * 16 + 8 * 8 + 3 * 16 * 8 + 6 * 8 + 16 * 8;
        let fixed = 2 * weights + 4 * 5 * 8 + 4 * 3 * 32 * 8 + 2 * 32 * 24 + 4 * 4 * 8;
        // K and V of the one KV head (as many copies as the kernels store for 2 query heads), 4
        // dims, bf16.
        let (rep, _) = kv_replication(2, 1).unwrap();
        assert_eq!(
            r,
            DraftReserve {
                fixed_bytes: fixed,
                kv_bytes_per_token: 2 * rep * 4 * 2,
                layers: 1,
                q_heads: 2,
                kv_heads: rep,
                head_dim: 4,
            }
        );
        // Its entries of the per-layer KV list store what it reserves a token.
        let page: usize = r
            .kv_layers()
            .iter()
            .map(|l| {
                let s = kvfleet_engine::engine::layout::PoolShape::new(
                    1,
                    l.kv_heads,
                    16,
                    l.head_dim,
                    KvDtype::Bf16,
                );
                2 * s.unwrap().page_bytes()
            })
            .sum();
        assert_eq!(page, 16 * r.kv_bytes_per_token);
        assert!(r.kv_layers().iter().all(|l| l.window.is_none()));
    }
}
