//! What every drafter on the GPU runs with ([`super::drafter`], [`super::dflash`]): the target
//! features its steps keep ([`AuxCapture`]), where a drafter is put ([`Beside`]), the target's
//! parts a drafter pass borrows ([`Target`]), and the check that a drafter fits the target's
//! step buffers ([`fits`]).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use kvfleet_engine::engine::capacity::{pool_layout, PoolParams, PoolSize};
use kvfleet_engine::engine::layout::KvDtype;
use kvfleet_engine::model::kv::{AttnGeometry, SeqId};
use kvfleet_engine::model::llama::LlamaConfig;

use crate::backend::CudaBackend;

use super::arena::{upload_into, Acts};
use super::blas::Blas;
use super::error::{backend_err, drv, GpuError};
use super::kernels::{ModelKernels, QkvOut, QkvPost};
use super::shape::{check_shapes, kv_replication, Dims};

/// Where a drafter goes: beside a target of widths `target` on `gpu`, whose step buffers hold
/// `seqs` rows; its pool `num_blocks` pages of `block_size` in `dtype`.
pub(super) struct Beside<'a> {
    pub gpu: &'a Arc<crate::device::Gpu>,
    pub target: &'a Dims,
    pub dtype: KvDtype,
    pub block_size: usize,
    pub num_blocks: usize,
    pub seqs: usize,
}

/// The residual stream entering each feature layer of the last target step (index
/// `n_layers`: the last layer's output), f32 `[tokens, d]` each.
pub(super) struct AuxCapture {
    pub layers: Vec<usize>,
    pub bufs: Vec<CudaSlice<f32>>,
    pub tokens: usize,
    /// Rows of the last step.
    pub kept: usize,
    /// bf16 `[rows, features x d]`: the gathered rows, `fc`'s input.
    fcin: CudaSlice<u16>,
    /// The step rows a catch-up gathers.
    idx: CudaSlice<i32>,
}

impl AuxCapture {
    pub fn new(s: &Arc<CudaStream>, layers: &[usize], tokens: usize, d: usize) -> Result<Self, GpuError> {
        let bufs = layers
            .iter()
            .map(|_| s.alloc_zeros::<f32>(tokens.max(1) * d))
            .collect::<Result<Vec<_>, _>>()
            .map_err(drv("allocating the drafter's feature copies"))?;
        Ok(AuxCapture {
            layers: layers.to_vec(),
            bufs,
            tokens: tokens.max(1),
            kept: 0,
            fcin: s
                .alloc_zeros::<u16>(tokens.max(1) * layers.len() * d)
                .map_err(drv("allocating the drafter's input"))?,
            idx: s
                .alloc_zeros::<i32>(tokens.max(1))
                .map_err(drv("allocating the drafter's row indices"))?,
        })
    }

    /// The kept features of the step rows `rows`, side by side in `fc`'s column order (bf16
    /// `[rows, features x d]`): the drafter's `fc` input.
    pub fn gather(&mut self, k: &ModelKernels, rows: &[i32], d: usize) -> Result<&CudaSlice<u16>, GpuError> {
        let (s, n) = (k.stream(), rows.len());
        let width = self.bufs.len() * d;
        if self.fcin.len() < n * width {
            self.fcin = s
                .alloc_zeros::<u16>(n * width)
                .map_err(drv("growing the drafter's input"))?;
        }
        if self.idx.len() < n {
            self.idx = s
                .alloc_zeros::<i32>(n)
                .map_err(drv("growing the drafter's row indices"))?;
        }
        upload_into(s, rows, &mut self.idx)?;
        k.gather_aux(&self.bufs, &self.idx, n, d, &mut self.fcin)?;
        Ok(&self.fcin)
    }

    /// Room for a step of `t` tokens.
    pub fn ensure(&mut self, s: &Arc<CudaStream>, t: usize, d: usize) -> Result<(), GpuError> {
        if t > self.tokens {
            for b in &mut self.bufs {
                *b = s
                    .alloc_zeros::<f32>(t * d)
                    .map_err(drv("growing the drafter's feature copies"))?;
            }
            self.tokens = t;
        }
        Ok(())
    }

    /// Checks that a catch-up of request `seq` reads rows of the last step.
    pub fn check_rows(&self, seq: SeqId, row: usize, len: usize) -> Result<(), GpuError> {
        if row + len > self.kept {
            return Err(GpuError::Invalid(format!(
                "drafter catch-up of request {seq} reads rows {row}..{} of a step of {}",
                row + len,
                self.kept
            )));
        }
        Ok(())
    }

    /// Keeps `x[..t]` when layer `li`'s input is a feature (`li == n_layers`: the output).
    pub fn keep(
        &mut self,
        s: &Arc<CudaStream>,
        li: usize,
        x: &CudaSlice<f32>,
        t: usize,
        d: usize,
    ) -> Result<(), GpuError> {
        for (l, b) in self.layers.iter().zip(&mut self.bufs) {
            if *l == li {
                s.memcpy_dtod(&x.slice(..t * d), &mut b.slice_mut(..t * d))
                    .map_err(drv("keeping a drafter feature"))?;
            }
        }
        self.kept = t;
        Ok(())
    }
}

impl Beside<'_> {
    /// A drafter of `n_layers` layers of geometry `l` (its LM head `draft_vocab` rows) checked
    /// against the target's step buffers: its widths, and its pool, `causal` or not.
    pub fn layers(
        &self,
        l: &LlamaConfig,
        n_layers: usize,
        causal: bool,
        draft_vocab: usize,
    ) -> Result<(Dims, CudaBackend), GpuError> {
        check_shapes(l)?;
        let (rep, _) = kv_replication(l.n_heads, l.n_kv_heads)?;
        let dims = Dims::new(l, rep);
        fits(&dims, draft_vocab, self.target, dims.d)?;
        let geo = AttnGeometry {
            n_layers,
            n_heads: l.n_heads,
            n_kv_heads: l.n_kv_heads * rep,
            head_dim: l.head_dim,
        };
        let p = PoolParams {
            causal,
            ..PoolParams::pages(self.dtype, self.block_size)
        };
        let pools = pool_layout(&geo.kv_layers(), 0, &p, PoolSize::Pages(self.num_blocks))
            .map_err(GpuError::Invalid)?;
        let backend = CudaBackend::new(self.gpu.clone(), pools).map_err(backend_err)?;
        Ok((dims, backend))
    }
}

/// The target's parts a drafter pass runs with.
pub(super) struct Target<'a> {
    pub dims: &'a Dims,
    pub k: &'a ModelKernels,
    pub blas: &'a Blas,
    pub a: &'a mut Acts,
    pub embed: &'a CudaSlice<u16>,
    /// The target's LM head (its embeddings when tied).
    pub head: &'a CudaSlice<u16>,
    /// The hidden states its last step kept.
    pub hidden: &'a mut AuxCapture,
}

impl Target<'_> {
    /// The `n` rows of Q/K/V in `a.qkv` of a drafter layer of `config` and `dims` into Q, K and
    /// V: its Q/K norms when it has them, RoPE of `inv_freq` at the positions in `a.pos`.
    pub fn rope_qkv(
        &mut self,
        config: &LlamaConfig,
        dims: &Dims,
        n: usize,
        qk_norm: Option<(&CudaSlice<f32>, &CudaSlice<f32>)>,
        inv_freq: &CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let (k, a) = (self.k, &mut *self.a);
        let (qkv, pos) = (&a.qkv, &a.pos);
        let post = QkvPost {
            config,
            dims,
            qkv,
            pos,
            bias: None,
            qk_norm,
            inv_freq,
            scales: None,
        };
        let (q, kk, v) = (&mut a.q, &mut a.k, &mut a.v);
        k.qkv_post(n, &post, QkvOut { q, k: kk, v }, k.pdl)
    }
}

/// Checks that a drafter of widths `dims` (its Q/K/V projection reading rows of `qkv_in`, its
/// LM head `draft_vocab` rows) runs in the target's step buffers.
pub(super) fn fits(dims: &Dims, draft_vocab: usize, target: &Dims, qkv_in: usize) -> Result<(), GpuError> {
    let fits = [
        ("hidden size", dims.d, target.d),
        ("query width", dims.qw.max(dims.d), target.qw.max(target.d)),
        ("Q/K/V width", dims.qw + 2 * dims.kw, target.qw + 2 * target.kw),
        ("K/V width", dims.kw_rep, target.kw_rep),
        ("MLP width", dims.ff, target.ff),
        ("Q/K/V input", qkv_in, target.qw.max(target.d)),
        ("vocabulary", draft_vocab, target.vocab),
    ];
    match fits.iter().find(|(_, a, b)| a > b) {
        Some((what, ours, theirs)) => Err(GpuError::Unsupported(format!(
            "a drafter wider than its target on the GPU ({what} {ours} > {theirs})"
        ))),
        None => Ok(()),
    }
}
