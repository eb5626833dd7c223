//! [`KvAttention`] on the engine's paged KV cache: any [`Backend`] with host buffers (the
//! CPU backend) holds K/V in pages laid out by `worker::engine::layout`, in the KV dtype the
//! engine resolves (bf16 by default). Pages come from the engine's [`BlockPool`]; each
//! forward pass builds one CSR [`StepPlan`] (at layer 0) for all layers.

use std::collections::HashMap;

use crate::worker::engine::block::BlockPool;
use crate::worker::engine::layout::{
    BackendConfig, GroupSpec, KvDtype, KvScales, LayerAttn, LayerSpec, StepPlan,
};
use crate::worker::engine::Backend;

use super::kv::{AttnGeometry, AttnSeq, KvAttention, KvError, SeqId};

/// A backend config for a full-attention Llama geometry: one group, `num_blocks` pages.
pub fn backend_config(
    geo: AttnGeometry,
    dtype: KvDtype,
    block_size: usize,
    num_blocks: usize,
) -> BackendConfig {
    let layer = LayerSpec {
        group: 0,
        attn: LayerAttn {
            q_heads: geo.n_heads,
            kv_heads: geo.n_kv_heads,
            head_dim: geo.head_dim,
            causal: true,
            window: None,
            sm_scale: None,
        },
        dtype,
        scales: KvScales::default(),
    };
    BackendConfig {
        block_size,
        groups: vec![GroupSpec {
            window: None,
            num_blocks,
        }],
        layers: vec![layer; geo.n_layers],
    }
}

/// Sequences' pages in a one-group paged cache: pages come from the engine's [`BlockPool`]
/// and each forward pass becomes one CSR [`StepPlan`] for all layers. Shared by [`PagedKv`]
/// (host backends) and the GPU forward pass (`model::gpu`).
#[derive(Debug)]
pub struct PageTable {
    pool: BlockPool,
    block_size: usize,
    /// seq -> (pages, tokens held).
    seqs: HashMap<SeqId, (Vec<u32>, usize)>,
}

impl PageTable {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        PageTable {
            pool: BlockPool::new(num_blocks),
            block_size,
            seqs: HashMap::new(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn free_blocks(&self) -> usize {
        self.pool.num_free()
    }

    pub fn total_blocks(&self) -> usize {
        self.pool.total()
    }

    /// Grows every sequence of `seqs` by its new tokens (allocating pages) and writes the
    /// step's plan into `plan`: `qo_indptr` over the batch and one group table holding each
    /// sequence's pages, last-page fill and the slots of its new tokens.
    pub fn plan_step(&mut self, seqs: &[AttnSeq], plan: &mut StepPlan) -> Result<(), KvError> {
        let bs = self.block_size;
        for s in seqs {
            let (pages, held) = self.seqs.entry(s.seq).or_default();
            if *held != s.start_pos {
                return Err(KvError::Position {
                    seq: s.seq,
                    layer: 0,
                    cached: *held,
                    start: s.start_pos,
                });
            }
            let need = (s.start_pos + s.len).div_ceil(bs);
            if need > pages.len() && !self.pool.allocate(need - pages.len(), pages) {
                return Err(KvError::Full {
                    capacity: self.pool.total() * bs,
                });
            }
        }
        let p = plan;
        p.qo_indptr.clear();
        p.qo_indptr.push(0);
        p.groups.resize_with(1, Default::default);
        let g = &mut p.groups[0];
        g.clear();
        g.kv_indptr.push(0);
        let mut total = 0u32;
        for s in seqs {
            let (pages, held) = self.seqs.get_mut(&s.seq).ok_or(KvError::Layer(0))?;
            let new_len = s.start_pos + s.len;
            total += s.len as u32;
            p.qo_indptr.push(total);
            let used = new_len.div_ceil(bs);
            g.kv_indices.extend_from_slice(&pages[..used]);
            g.kv_indptr.push(g.kv_indices.len() as u32);
            g.kv_last_page_len.push((new_len - (used - 1) * bs) as u32);
            g.kv_first_pos.push(0);
            for pos in s.start_pos..new_len {
                g.slot_mapping
                    .push(pages[pos / bs] * bs as u32 + (pos % bs) as u32);
            }
            *held = new_len;
        }
        Ok(())
    }

    /// Tokens held for `seq`, 0 when unknown.
    pub fn cached_len(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.1)
    }

    /// Returns `seq`'s pages to the pool.
    pub fn release(&mut self, seq: SeqId) {
        if let Some((pages, _)) = self.seqs.remove(&seq) {
            for p in pages {
                // A page id we allocated is always known to the pool.
                let _ = self.pool.release(p);
            }
        }
    }
}

/// The model's attention through an engine backend.
pub struct PagedKv<B: Backend<Buf = Vec<f32>>> {
    backend: B,
    pages: PageTable,
    plan: StepPlan,
    /// The batch the current plan was built for.
    planned: Vec<AttnSeq>,
    kbuf: Vec<f32>,
    vbuf: Vec<f32>,
    qbuf: Vec<f32>,
    obuf: Vec<f32>,
}

impl<B: Backend<Buf = Vec<f32>>> PagedKv<B> {
    /// Wraps a backend built from [`backend_config`] (one full-attention group).
    pub fn new(backend: B) -> Self {
        let cfg = backend.config();
        let pages = PageTable::new(cfg.groups.first().map_or(0, |g| g.num_blocks), cfg.block_size);
        PagedKv {
            backend,
            pages,
            plan: StepPlan::default(),
            planned: Vec::new(),
            kbuf: Vec::new(),
            vbuf: Vec::new(),
            qbuf: Vec::new(),
            obuf: Vec::new(),
        }
    }

    pub fn free_blocks(&self) -> usize {
        self.pages.free_blocks()
    }

    fn build_plan(&mut self, seqs: &[AttnSeq]) -> Result<(), KvError> {
        self.pages.plan_step(seqs, &mut self.plan)?;
        self.planned = seqs.to_vec();
        Ok(())
    }
}

fn fill(buf: &mut Vec<f32>, src: &[f32]) {
    buf.clear();
    buf.extend_from_slice(src);
}

impl<B: Backend<Buf = Vec<f32>> + Send> KvAttention for PagedKv<B> {
    fn attend(
        &mut self,
        layer: usize,
        seqs: &[AttnSeq],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &mut [f32],
    ) -> Result<(), KvError> {
        let device = |e: crate::worker::engine::BackendError| KvError::Backend(e.to_string());
        if layer == 0 {
            self.build_plan(seqs)?;
            self.backend.prepare(&self.plan).map_err(device)?;
        } else if seqs != self.planned.as_slice() {
            return Err(KvError::Backend(
                "every layer of a forward pass must see the same batch".into(),
            ));
        }
        fill(&mut self.kbuf, k);
        fill(&mut self.vbuf, v);
        fill(&mut self.qbuf, q);
        self.obuf.resize(out.len(), 0.0);
        self.backend
            .append_kv(layer, &self.kbuf, &self.vbuf)
            .map_err(device)?;
        self.backend
            .attention(layer, &self.qbuf, &mut self.obuf)
            .map_err(device)?;
        out.copy_from_slice(&self.obuf[..out.len()]);
        Ok(())
    }

    fn cached_len(&self, seq: SeqId) -> usize {
        self.pages.cached_len(seq)
    }

    fn release(&mut self, seq: SeqId) {
        self.pages.release(seq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::kv::ContiguousKv;
    use crate::model::llama::{Llama, LlamaConfig, SeqChunk};
    use crate::worker::engine::cpu::CpuBackend;

    #[test]
    fn paged_cpu_backend_matches_contiguous_cache_logits() {
        let mut cfg = LlamaConfig::llama(2, 64, 96, 4, 2, 40);
        cfg.context_len = 128;
        let m = Llama::dummy(cfg, 11).unwrap();
        let geo = m.config.attn_geometry();
        let backend = CpuBackend::new(backend_config(geo, KvDtype::F16, 4, 32)).unwrap();
        let mut paged = PagedKv::new(backend);
        let mut flat = ContiguousKv::new(geo, 1000);
        let a: Vec<u32> = (0..9).map(|i| (i * 7 % 40) as u32).collect();
        let b: Vec<u32> = (0..5).map(|i| (i * 3 % 40) as u32).collect();
        // Step 1: prefill a (9 tokens, not a page multiple) and b; step 2: decode both.
        let steps: [Vec<SeqChunk<'_>>; 2] = [
            vec![
                SeqChunk {
                    seq: 1,
                    start_pos: 0,
                    tokens: &a,
                    want_logits: true,
                },
                SeqChunk {
                    seq: 2,
                    start_pos: 0,
                    tokens: &b,
                    want_logits: true,
                },
            ],
            vec![
                SeqChunk {
                    seq: 2,
                    start_pos: 5,
                    tokens: &[1],
                    want_logits: true,
                },
                SeqChunk {
                    seq: 1,
                    start_pos: 9,
                    tokens: &[2],
                    want_logits: true,
                },
            ],
        ];
        for step in &steps {
            let lp = m.forward(&mut paged, step).unwrap();
            let lf = m.forward(&mut flat, step).unwrap();
            let err = lp.iter().zip(&lf).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
            let scale = lf.iter().map(|x| x.abs()).fold(0.0, f32::max);
            assert!(
                err <= 0.02 * scale + 1e-3,
                "max |paged - contiguous| = {err} (scale {scale})"
            );
        }
        assert_eq!(paged.cached_len(1), 10);
        let free = paged.free_blocks();
        paged.release(1);
        assert_eq!(paged.free_blocks(), free + 3, "10 tokens in pages of 4");
    }

    #[test]
    fn paged_cache_out_of_pages_is_an_error() {
        let cfg = LlamaConfig::llama(1, 32, 32, 2, 1, 10);
        let m = Llama::dummy(cfg, 1).unwrap();
        let geo = m.config.attn_geometry();
        let mut paged = PagedKv::new(CpuBackend::new(backend_config(geo, KvDtype::Bf16, 4, 2)).unwrap());
        let toks = [1u32; 9];
        let e = m
            .forward(
                &mut paged,
                &[SeqChunk {
                    seq: 1,
                    start_pos: 0,
                    tokens: &toks,
                    want_logits: true,
                }],
            )
            .unwrap_err();
        assert!(e.to_string().contains("KV cache is full"), "{e}");
    }
}
