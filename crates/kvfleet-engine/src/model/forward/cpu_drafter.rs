//! The drafters' passes on the CPU beside the target ([`super::CpuForward`]): EAGLE-3's
//! ([`CpuEagle3`]) and DFlash's ([`CpuDflash`]), each with its pool on the target's
//! full-attention pages, reading the hidden states the target's last step kept.

use std::collections::HashMap;

use super::proposer::{
    BlockRow, CatchUp, ChainRow, DflashPasses, DraftPasses, Drafted, Drafting, Eagle3Passes, Proposer,
};
use super::{CpuForward, Forward};
use crate::engine::cpu::CpuBackend;
use crate::engine::layout::KvDtype;
use crate::engine::{Backend, StepPlan};
use crate::model::dflash::Dflash;
use crate::model::drafter::{draft_pools, Drafter};
use crate::model::eagle3::Eagle3;
use crate::model::kv::{AttnGeometry, AttnSeq, KvError, SeqId};
use crate::model::llama::{ForwardError, Llama};
use crate::model::paged::{check_rows, Planned};

/// The target rows a CPU drafter reads for a catch-up: the kept hidden states of each row's
/// positions (`k` floats a row), the tokens after them, their positions and sequences.
struct Gathered {
    aux: Vec<f32>,
    tokens: Vec<u32>,
    positions: Vec<usize>,
    seqs: Vec<AttnSeq>,
}

fn backend_err(e: impl std::fmt::Display) -> ForwardError {
    ForwardError::Kv(KvError::Backend(e.to_string()))
}

impl Gathered {
    /// `rows` of the last target step, whose hidden states are `hidden` (`k` floats a row).
    fn of(hidden: &[f32], k: usize, rows: &[CatchUp<'_>], plan: &StepPlan) -> Result<Self, ForwardError> {
        let mut g = Gathered {
            aux: Vec::new(),
            tokens: Vec::new(),
            positions: Vec::new(),
            seqs: Vec::new(),
        };
        for r in rows {
            let src = hidden.get(r.row * k..(r.row + r.next.len()) * k).ok_or_else(|| {
                backend_err(format!(
                    "drafter catch-up of request {} reads rows {}..{} of a step of {}",
                    r.seq,
                    r.row,
                    r.row + r.next.len(),
                    hidden.len() / k.max(1)
                ))
            })?;
            g.aux.extend_from_slice(src);
            g.tokens.extend_from_slice(r.next);
            g.positions.extend(r.start_pos..r.start_pos + r.next.len());
            g.seqs.push(AttnSeq {
                seq: r.seq,
                start_pos: r.start_pos,
                len: r.next.len(),
            });
        }
        check_rows(&g.seqs, plan)?;
        Ok(g)
    }
}

/// A drafter's pool on the CPU (see [`draft_pools`]).
fn cpu_pool(
    geo: AttnGeometry,
    causal: bool,
    dtype: KvDtype,
    block_size: usize,
    num_blocks: usize,
) -> Result<CpuBackend, ForwardError> {
    let pools = draft_pools(geo, causal, dtype, block_size, num_blocks).map_err(backend_err)?;
    CpuBackend::new(pools).map_err(|e| backend_err(format!("cannot allocate the drafter's KV pool: {e}")))
}

impl Drafter {
    /// The drafter on the CPU beside its target ([`super::forward::CpuForward`]), as its
    /// method's proposer; its pool as [`Drafter::pools`] lays it out.
    pub fn cpu_proposer(
        self,
        dtype: KvDtype,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<Box<dyn Proposer>, ForwardError> {
        Ok(match self {
            Drafter::Eagle3(m) => Box::new(Drafting::eagle3(CpuEagle3::new(
                m, dtype, block_size, num_blocks,
            )?)),
            Drafter::Dflash(m) => Box::new(Drafting::dflash(CpuDflash::new(
                m, dtype, block_size, num_blocks,
            )?)),
        })
    }
}

/// An EAGLE-3 drafter on the CPU: its pool and each request's latest feature.
pub struct CpuEagle3 {
    model: Eagle3,
    /// Floats of hidden states a target row: its feature layers' widths.
    width: usize,
    backend: CpuBackend,
    features: HashMap<SeqId, Vec<f32>>,
}

impl CpuEagle3 {
    /// The drafter `model` with its pool (see [`Drafter::pools`]).
    pub fn new(
        model: Eagle3,
        dtype: KvDtype,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<Self, ForwardError> {
        let backend = cpu_pool(model.config.attn_geometry(), true, dtype, block_size, num_blocks)?;
        Ok(CpuEagle3 {
            width: model.config.aux_layers.len() * model.config.target_hidden,
            model,
            backend,
            features: HashMap::new(),
        })
    }

    /// [`Eagle3Passes::catch_up`] over `target`'s last step, whose hidden states are `hidden`.
    pub fn catch_up_on(
        &mut self,
        target: &Llama,
        hidden: &[f32],
        rows: &[CatchUp<'_>],
        plan: &StepPlan,
    ) -> Result<Vec<u32>, ForwardError> {
        let m = &self.model;
        let g = Gathered::of(hidden, self.width, rows, plan)?;
        let d = m.config.layer.d_model;
        let features = m.fuse(&g.aux);
        let embeds = m.embeddings(target, &g.tokens)?;
        let mut planned = Planned::new(&mut self.backend, plan);
        let out = m.layer(&mut planned, &g.seqs, &g.positions, &embeds, &features)?;
        let mut last = Vec::new();
        let mut row = 0;
        for r in rows {
            row += r.next.len();
            if r.draft && !r.next.is_empty() {
                let f = out[(row - 1) * d..row * d].to_vec();
                last.extend_from_slice(&f);
                self.features.insert(r.seq, f);
            }
        }
        Ok(m.tokens(&last))
    }

    /// [`Eagle3Passes::chain`] with `target`'s embeddings.
    pub fn chain_on(
        &mut self,
        target: &Llama,
        rows: &[ChainRow],
        plan: &StepPlan,
    ) -> Result<Vec<u32>, ForwardError> {
        let m = &self.model;
        let d = m.config.layer.d_model;
        let mut features = Vec::with_capacity(rows.len() * d);
        for r in rows {
            let f = self.features.get(&r.seq).ok_or_else(|| {
                backend_err(format!(
                    "request {} chains drafts without a drafter feature (no catch-up ran for it)",
                    r.seq
                ))
            })?;
            features.extend_from_slice(f);
        }
        let tokens: Vec<u32> = rows.iter().map(|r| r.token).collect();
        let positions: Vec<usize> = rows.iter().map(|r| r.pos).collect();
        let seqs: Vec<AttnSeq> = rows
            .iter()
            .map(|r| AttnSeq {
                seq: r.seq,
                start_pos: r.pos,
                len: 1,
            })
            .collect();
        check_rows(&seqs, plan)?;
        let embeds = m.embeddings(target, &tokens)?;
        let mut planned = Planned::new(&mut self.backend, plan);
        let out = m.layer(&mut planned, &seqs, &positions, &embeds, &features)?;
        for (r, f) in rows.iter().zip(out.chunks_exact(d)) {
            self.features.insert(r.seq, f.to_vec());
        }
        Ok(m.tokens(&out))
    }

    /// The latest feature kept for `seq`.
    pub fn feature(&self, seq: SeqId) -> Option<&[f32]> {
        self.features.get(&seq).map(Vec::as_slice)
    }
}

impl DraftPasses for CpuEagle3 {
    fn catch_up(&mut self, target: &mut dyn Forward, rows: &[CatchUp<'_>], plan: &StepPlan) -> Drafted {
        let t = CpuForward::of(target)?;
        self.catch_up_on(t.model(), t.hidden(), rows, plan)
    }

    fn forget(&mut self, seq: SeqId) {
        self.features.remove(&seq);
    }
}

impl Eagle3Passes for CpuEagle3 {
    fn chain(&mut self, target: &mut dyn Forward, rows: &[ChainRow], plan: &StepPlan) -> Drafted {
        self.chain_on(CpuForward::of(target)?.model(), rows, plan)
    }
}

/// A DFlash drafter on the CPU and its pool.
pub struct CpuDflash {
    pub(crate) model: Dflash,
    /// Floats of hidden states a target row: its feature layers' widths.
    width: usize,
    pub(crate) backend: CpuBackend,
}

impl CpuDflash {
    /// The drafter `model` with its pool (see [`Drafter::pools`]).
    pub fn new(
        model: Dflash,
        dtype: KvDtype,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<Self, ForwardError> {
        let causal = model.config.causal;
        let backend = cpu_pool(
            model.config.attn_geometry(),
            causal,
            dtype,
            block_size,
            num_blocks,
        )?;
        let width = model.config.aux_layers.len() * model.config.target_hidden;
        Ok(CpuDflash {
            model,
            width,
            backend,
        })
    }

    /// [`DflashPasses::catch_up`] over a target step whose hidden states are `hidden`.
    pub fn catch_up_on(
        &mut self,
        hidden: &[f32],
        rows: &[CatchUp<'_>],
        plan: &StepPlan,
    ) -> Result<(), ForwardError> {
        let g = Gathered::of(hidden, self.width, rows, plan)?;
        let m = &self.model;
        let kv = m.context_kv(&g.aux, &g.positions);
        self.backend.prepare(plan).map_err(backend_err)?;
        for (li, (k, v)) in kv.iter().enumerate() {
            self.backend.append_kv(li, k, v).map_err(backend_err)?;
        }
        Ok(())
    }

    /// [`DflashPasses::blocks`] with `target`'s embeddings (and LM head, when the drafter has
    /// none).
    pub fn blocks_on(
        &mut self,
        target: &Llama,
        rows: &[BlockRow],
        plan: &StepPlan,
    ) -> Result<Vec<u32>, ForwardError> {
        let m = &self.model;
        let (mut tokens, mut positions, mut seqs) = (Vec::new(), Vec::new(), Vec::new());
        for r in rows {
            tokens.push(r.token);
            tokens.extend(std::iter::repeat_n(m.config.mask_token, r.drafts));
            positions.extend(r.pos..=r.pos + r.drafts);
            seqs.push(AttnSeq {
                seq: r.seq,
                start_pos: r.pos,
                len: 1 + r.drafts,
            });
        }
        check_rows(&seqs, plan)?;
        let embeds = m.embeddings(target, &tokens)?;
        let mut planned = Planned::new(&mut self.backend, plan);
        let out = m.blocks(&mut planned, &seqs, &positions, &embeds)?;
        let d = m.config.layer.d_model;
        // The outputs at the mask positions: each block's rows 1..=drafts.
        let mut masks = Vec::new();
        let mut row = 0;
        for r in rows {
            masks.extend_from_slice(&out[(row + 1) * d..(row + 1 + r.drafts) * d]);
            row += 1 + r.drafts;
        }
        Ok(m.tokens(target, &masks))
    }
}

impl DraftPasses for CpuDflash {
    fn catch_up(&mut self, target: &mut dyn Forward, rows: &[CatchUp<'_>], plan: &StepPlan) -> Drafted {
        self.catch_up_on(CpuForward::of(target)?.hidden(), rows, plan)?;
        Ok(Vec::new())
    }
}

impl DflashPasses for CpuDflash {
    fn blocks(&mut self, target: &mut dyn Forward, rows: &[BlockRow], plan: &StepPlan) -> Drafted {
        self.blocks_on(CpuForward::of(target)?.model(), rows, plan)
    }
}
