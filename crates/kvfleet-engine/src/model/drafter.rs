//! Drafter models for speculative decoding beside the target on the CPU: EAGLE-3
//! ([`super::eagle3`]) and DFlash ([`super::dflash`]). A drafter reads the target's features of
//! every position the target computes and keeps its own K/V in a pool paged by the target's
//! full-attention page table (its layers are more layers of the same pages, so prefix caching,
//! preemption and rollback cover them as they cover the target's).

use std::collections::HashMap;
use std::path::Path;

use serde::Deserialize;

use super::dflash::Dflash;
use super::eagle3::Eagle3;
use super::hf::{self, HfError};
use super::kv::{AttnSeq, KvError, SeqId};
use super::llama::{ForwardError, Llama, LlamaConfig};
use crate::engine::capacity::{pool_layout, PoolParams, PoolSize};
use crate::engine::cpu::CpuBackend;
use crate::engine::layout::{BackendConfig, KvDtype};
use crate::engine::{Backend, StepPlan};

/// The width of `l`'s rows (never 0, to divide by).
fn l_d(l: &LlamaConfig) -> usize {
    l.d_model.max(1)
}

/// A drafter checkpoint, by its architecture.
#[derive(Debug)]
pub enum Drafter {
    Eagle3(Eagle3),
    Dflash(Dflash),
}

#[derive(Deserialize)]
struct Architectures {
    architectures: Option<Vec<String>>,
}

impl Drafter {
    /// Loads the drafter checkpoint in `dir` for a target of geometry `target`; its
    /// `config.json` `architectures` says which kind it is.
    pub fn load(dir: &Path, target: &LlamaConfig) -> Result<Self, HfError> {
        let path = hf::config_path(dir);
        let text = hf::read(&path)?;
        let a: Architectures = hf::parse_json(&path, &text)?;
        let arch = a
            .architectures
            .unwrap_or_default()
            .into_iter()
            .next()
            .unwrap_or_default();
        if arch.starts_with("DFlash") {
            Ok(Drafter::Dflash(Dflash::load(dir, target)?))
        } else {
            Ok(Drafter::Eagle3(Eagle3::load(dir, target)?))
        }
    }

    /// `eagle3` or `dflash` (vLLM's method names).
    pub fn method(&self) -> &'static str {
        match self {
            Drafter::Eagle3(_) => "eagle3",
            Drafter::Dflash(_) => "dflash",
        }
    }

    /// The target layers whose input features the drafter reads (`n_layers` for the output of
    /// the last).
    pub fn aux_layers(&self) -> &[usize] {
        match self {
            Drafter::Eagle3(m) => &m.config.aux_layers,
            Drafter::Dflash(m) => &m.config.aux_layers,
        }
    }

    /// Its shape as the GPU engine lays it out (`kvfleet_core::plan::DraftShape`): what its
    /// weights, buffers and K/V take of the KV budget, as the planner counts it from the spec's
    /// `draftModel.geometry`.
    pub fn shape(&self) -> kvfleet_core::plan::DraftShape {
        use kvfleet_core::plan::{DraftKind, DraftShape};
        let (kind, l, lm_head, embed) = match self {
            Drafter::Eagle3(m) => (
                DraftKind::Eagle3,
                &m.config.layer,
                m.config.draft_vocab,
                m.embed.as_ref().map_or(0, Vec::len),
            ),
            Drafter::Dflash(m) => (
                DraftKind::Dflash,
                &m.config.layer,
                m.lm_head.as_ref().map_or(0, Vec::len) / l_d(&m.config.layer),
                m.embed.as_ref().map_or(0, Vec::len),
            ),
        };
        let u = |v: usize| v as u64;
        DraftShape {
            kind,
            layers: u(l.n_layers),
            d_model: u(l.d_model),
            n_heads: u(l.n_heads),
            n_kv_heads: u(l.n_kv_heads),
            head_dim: u(l.head_dim),
            d_ff: u(l.d_ff),
            target_hidden: u(self.target_hidden()),
            feature_layers: u(self.aux_layers().len()),
            lm_head_rows: u(lm_head),
            embed_rows: u(embed / l_d(l)),
        }
    }

    fn target_hidden(&self) -> usize {
        match self {
            Drafter::Eagle3(m) => m.config.target_hidden,
            Drafter::Dflash(m) => m.config.target_hidden,
        }
    }

    /// The most tokens one pass may draft (DFlash: its trained block less the newest token).
    pub fn max_drafts(&self) -> usize {
        match self {
            Drafter::Eagle3(_) => usize::MAX,
            Drafter::Dflash(m) => m.config.block_size - 1,
        }
    }

    /// The drafter's pool: its layers, `num_blocks` pages of `block_size`, in `dtype`.
    pub fn pools(&self, dtype: KvDtype, block_size: usize, num_blocks: usize) -> Result<BackendConfig, String> {
        let (geo, causal) = match self {
            Drafter::Eagle3(m) => (m.config.attn_geometry(), true),
            Drafter::Dflash(m) => (m.config.attn_geometry(), m.config.causal),
        };
        let p = PoolParams {
            causal,
            ..PoolParams::pages(dtype, block_size)
        };
        pool_layout(&geo.kv_layers(), 0, &p, PoolSize::Pages(num_blocks))
    }
}

/// One request's rows for [`super::forward::Forward::draft_catch_up`]: positions `start_pos..start_pos +
/// next.len()`, computed by the last step at its rows `row..`, and the token after each.
#[derive(Debug, Clone)]
pub struct CatchUp<'a> {
    pub seq: SeqId,
    pub start_pos: usize,
    pub next: &'a [u32],
    /// The step row (token index in the step's batch) of `start_pos`.
    pub row: usize,
    /// Draft the token after the last `next` token.
    pub draft: bool,
}

/// One request's row for [`super::forward::Forward::draft_chain`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChainRow {
    pub seq: SeqId,
    pub pos: usize,
    pub token: u32,
}

/// One request's DFlash block for [`CpuDrafter::blocks`]: the newest token at `pos` and
/// `drafts` mask tokens after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockRow {
    pub seq: SeqId,
    pub pos: usize,
    pub token: u32,
    pub drafts: usize,
}

/// A drafter on the CPU beside the target ([`super::forward::CpuForward`]): its pool, the
/// target features of the last step, and each request's latest EAGLE-3 feature.
pub struct CpuDrafter {
    pub(crate) model: Drafter,
    backend: CpuBackend,
    /// `[step tokens, features x target hidden]` of the last target step.
    pub(crate) aux: Vec<f32>,
    pub(crate) features: HashMap<SeqId, Vec<f32>>,
}

fn backend_err(e: impl std::fmt::Display) -> ForwardError {
    ForwardError::Kv(KvError::Backend(e.to_string()))
}

impl CpuDrafter {
    /// The drafter and its pool: `num_blocks` pages of `block_size` (the target's
    /// full-attention group), in the target's KV dtype.
    pub fn new(
        model: Drafter,
        dtype: KvDtype,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<Self, ForwardError> {
        let pools = model.pools(dtype, block_size, num_blocks).map_err(backend_err)?;
        let backend = CpuBackend::new(pools)
            .map_err(|e| backend_err(format!("cannot allocate the drafter's KV pool: {e}")))?;
        Ok(CpuDrafter {
            model,
            backend,
            aux: Vec::new(),
            features: HashMap::new(),
        })
    }

    /// See [`super::forward::Forward::draft_catch_up`]. EAGLE-3 returns a drafted token for
    /// each row with `draft`; DFlash stores the rows' context K/V and returns none.
    pub fn catch_up(
        &mut self,
        target: &Llama,
        rows: &[CatchUp<'_>],
        plan: &StepPlan,
    ) -> Result<Vec<u32>, ForwardError> {
        let k = self.model.aux_layers().len() * self.model.target_hidden();
        let mut aux = Vec::new();
        let (mut tokens, mut positions, mut seqs) = (Vec::new(), Vec::new(), Vec::new());
        for r in rows {
            let src = self
                .aux
                .get(r.row * k..(r.row + r.next.len()) * k)
                .ok_or_else(|| {
                    backend_err(format!(
                        "drafter catch-up of request {} reads rows {}..{} of a step of {}",
                        r.seq,
                        r.row,
                        r.row + r.next.len(),
                        self.aux.len() / k.max(1)
                    ))
                })?;
            aux.extend_from_slice(src);
            tokens.extend_from_slice(r.next);
            positions.extend(r.start_pos..r.start_pos + r.next.len());
            seqs.push(AttnSeq {
                seq: r.seq,
                start_pos: r.start_pos,
                len: r.next.len(),
            });
        }
        super::paged::check_rows(&seqs, plan)?;
        match &self.model {
            Drafter::Dflash(m) => {
                let kv = m.context_kv(&aux, &positions);
                self.backend.prepare(plan).map_err(backend_err)?;
                for (li, (k, v)) in kv.iter().enumerate() {
                    self.backend.append_kv(li, k, v).map_err(backend_err)?;
                }
                Ok(Vec::new())
            }
            Drafter::Eagle3(m) => {
                let d = m.config.layer.d_model;
                let features = m.fuse(&aux);
                let embeds = m.embeddings(target, &tokens)?;
                let mut planned = super::paged::Planned::new(&mut self.backend, plan);
                let out = m.layer(&mut planned, &seqs, &positions, &embeds, &features)?;
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
        }
    }

    /// See [`super::forward::Forward::draft_chain`] (EAGLE-3).
    pub fn chain(
        &mut self,
        target: &Llama,
        rows: &[ChainRow],
        plan: &StepPlan,
    ) -> Result<Vec<u32>, ForwardError> {
        let Drafter::Eagle3(m) = &self.model else {
            return Err(backend_err("only EAGLE-3 drafters chain"));
        };
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
        super::paged::check_rows(&seqs, plan)?;
        let embeds = m.embeddings(target, &tokens)?;
        let mut planned = super::paged::Planned::new(&mut self.backend, plan);
        let out = m.layer(&mut planned, &seqs, &positions, &embeds, &features)?;
        for (r, f) in rows.iter().zip(out.chunks_exact(d)) {
            self.features.insert(r.seq, f.to_vec());
        }
        Ok(m.tokens(&out))
    }

    /// See [`super::forward::Forward::draft_blocks`] (DFlash): each row's `drafts` tokens, in
    /// row order.
    pub fn blocks(
        &mut self,
        target: &Llama,
        rows: &[BlockRow],
        plan: &StepPlan,
    ) -> Result<Vec<u32>, ForwardError> {
        let Drafter::Dflash(m) = &self.model else {
            return Err(backend_err("only DFlash drafters draft blocks"));
        };
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
        super::paged::check_rows(&seqs, plan)?;
        let embeds = m.embeddings(target, &tokens)?;
        let mut planned = super::paged::Planned::new(&mut self.backend, plan);
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

    /// Drops what is kept for `seq`.
    pub fn forget(&mut self, seq: SeqId) {
        self.features.remove(&seq);
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::engine::block::BlockTable;
    use crate::engine::scheduler::write_plan;

    #[derive(Deserialize)]
    struct Expected {
        aux: Vec<Vec<f32>>,
        block: Vec<u32>,
        drafted: Vec<u32>,
        normed: Vec<Vec<f64>>,
    }

    fn plan(start: usize, len: usize) -> StepPlan {
        let mut p = StepPlan::default();
        let t = [BlockTable {
            blocks: vec![3, 1, 2],
            freed: 0,
        }];
        write_plan(&mut p, 4, 1, [(&t[..], start, len)]);
        p
    }

    /// The tiny DFlash drafter of `tests/fixtures/eagle3/generate.py --tiny --kind dflash`:
    /// context K/V stored from 5 positions of target features (in two catch-ups, across a page
    /// boundary), then a block of the newest token and 3 masks attending over the context and
    /// itself without a causal mask: outputs and drafts equal the float64 reference.
    #[test]
    fn the_tiny_dflash_drafter_matches_its_float64_reference() {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/eagle3/tiny-dflash");
        let e: Expected =
            serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
        let target = Llama::dummy(LlamaConfig::llama(4, 8, 16, 2, 1, 16), 1).unwrap();
        let drafter = Drafter::load(&dir, &target.config).unwrap();
        assert_eq!(drafter.method(), "dflash");
        assert_eq!(drafter.aux_layers(), &[1, 3, 4], "target_layer_ids [0, 2, 3] + 1");
        assert_eq!(drafter.max_drafts(), 15);
        let mut d = CpuDrafter::new(drafter, KvDtype::F16, 4, 4).unwrap();
        for (a, b) in [(0, 3), (3, 5)] {
            d.aux = e.aux[a..b].concat();
            let next = vec![0u32; b - a];
            let rows = [CatchUp {
                seq: 1,
                start_pos: a,
                next: &next,
                row: 0,
                draft: b == 5,
            }];
            assert!(d.catch_up(&target, &rows, &plan(a, b - a)).unwrap().is_empty());
        }
        let rows = [BlockRow {
            seq: 1,
            pos: 5,
            token: e.block[0],
            drafts: 3,
        }];
        assert_eq!(d.blocks(&target, &rows, &plan(5, 4)).unwrap(), e.drafted);
        // The outputs themselves, through the same pool.
        let Drafter::Dflash(m) = &d.model else {
            unreachable!()
        };
        let embeds = m.embeddings(&target, &e.block).unwrap();
        let seqs = [AttnSeq {
            seq: 1,
            start_pos: 5,
            len: 4,
        }];
        let p = plan(5, 4);
        let mut planned = super::super::paged::Planned::new(&mut d.backend, &p);
        let out = m.blocks(&mut planned, &seqs, &[5, 6, 7, 8], &embeds).unwrap();
        for (got, want) in out.chunks_exact(8).skip(1).zip(&e.normed) {
            for (g, w) in got.iter().zip(want) {
                assert!((*g as f64 - w).abs() < 1e-2, "{got:?} vs {want:?}");
            }
        }
    }
}
