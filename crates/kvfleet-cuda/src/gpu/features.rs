//! What every drafter on the GPU runs with ([`super::drafter`], [`super::dflash`]): the target
//! features its steps keep ([`AuxCapture`]), the target's parts a drafter pass borrows
//! ([`Target`]), and the check that a drafter fits the target's step buffers ([`fits`]).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use kvfleet_engine::model::kv::SeqId;

use super::arena::{upload_into, Acts};
use super::blas::Blas;
use super::error::{drv, GpuError};
use super::kernels::ModelKernels;
use super::shape::Dims;

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

/// The target's parts a drafter pass runs with.
pub(super) struct Target<'a> {
    pub dims: &'a Dims,
    pub k: &'a ModelKernels,
    pub blas: &'a Blas,
    pub a: &'a mut Acts,
    pub embed: &'a CudaSlice<u16>,
    /// The target's LM head (its embeddings when tied).
    pub head: &'a CudaSlice<u16>,
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
