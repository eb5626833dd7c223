//! Drafter checkpoints for speculative decoding ([`Drafter`]: EAGLE-3, [`super::eagle3`], and
//! DFlash, [`super::dflash`]); their passes on the CPU are `forward::cpu_drafter`'s, driven by
//! their method's proposer ([`super::proposer`]). A drafter reads the target's features of
//! every position the target computes and keeps its own K/V in a pool paged by the target's
//! full-attention page table (its layers are more layers of the same pages, so prefix caching,
//! preemption and rollback cover them as they cover the target's).

use std::path::Path;

use serde::Deserialize;

use super::dflash::Dflash;
use super::eagle3::Eagle3;
use super::hf::{self, HfError};
use super::kv::AttnGeometry;
use super::llama::LlamaConfig;
use crate::engine::capacity::{pool_layout, PoolParams, PoolSize};
use crate::engine::layout::{BackendConfig, KvDtype};

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

    /// The width of the target's hidden states it reads.
    pub fn target_hidden(&self) -> usize {
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
    pub fn pools(
        &self,
        dtype: KvDtype,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<BackendConfig, String> {
        let (geo, causal) = match self {
            Drafter::Eagle3(m) => (m.config.attn_geometry(), true),
            Drafter::Dflash(m) => (m.config.attn_geometry(), m.config.causal),
        };
        draft_pools(geo, causal, dtype, block_size, num_blocks)
    }
}

/// The pool of a drafter of `geo`'s layers: `num_blocks` pages of `block_size` in `dtype`.
pub(crate) fn draft_pools(
    geo: AttnGeometry,
    causal: bool,
    dtype: KvDtype,
    block_size: usize,
    num_blocks: usize,
) -> Result<BackendConfig, String> {
    let p = PoolParams {
        causal,
        ..PoolParams::pages(dtype, block_size)
    };
    pool_layout(&geo.kv_layers(), 0, &p, PoolSize::Pages(num_blocks))
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::engine::block::BlockTable;
    use crate::engine::scheduler::write_plan;
    use crate::engine::StepPlan;
    use crate::model::forward::CpuDflash;
    use crate::model::kv::AttnSeq;
    use crate::model::llama::Llama;
    use crate::model::proposer::{BlockRow, CatchUp};

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
        let Drafter::Dflash(m) = drafter else {
            unreachable!()
        };
        let mut d = CpuDflash::new(m, KvDtype::F16, 4, 4).unwrap();
        for (a, b) in [(0, 3), (3, 5)] {
            let aux = e.aux[a..b].concat();
            let next = vec![0u32; b - a];
            let rows = [CatchUp {
                seq: 1,
                start_pos: a,
                next: &next,
                row: 0,
                draft: b == 5,
            }];
            d.catch_up_on(&aux, &rows, &plan(a, b - a)).unwrap();
        }
        let rows = [BlockRow {
            seq: 1,
            pos: 5,
            token: e.block[0],
            drafts: 3,
        }];
        assert_eq!(d.blocks_on(&target, &rows, &plan(5, 4)).unwrap(), e.drafted);
        // The outputs themselves, through the same pool.
        let m = &d.model;
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
