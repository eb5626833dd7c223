//! What a model family's layers run with: the model's parts borrowed for one step ([`Step`]),
//! the profile marks between the parts of a step, and the [`Family`] trait each family's file
//! implements.

use cudarc::driver::CudaStream;
use kvfleet_engine::model::llama::LlamaConfig;

use crate::backend::CudaBackend;
use crate::profile::GpuSteps;

use super::arena::Acts;
use super::blas::Blas;
use super::error::{drv, GpuError};
use super::features::AuxCapture;
use super::kernels::ModelKernels;
use super::linear::Ops;
use super::shape::Dims;
use super::weights::Weights;

/// The parts of a step [`GpuSteps`] times, in the order they run.
pub(super) const PROFILE_PARTS: &[&str] = &[
    "prepare",
    "embed",
    "norm",
    "qkv_gemm",
    "qkv_post",
    "kv_append",
    "attention",
    "o_gemm",
    "ffn_gemm",
    "act",
    "down_gemm",
    "lm_head",
    "sample",
    "to_host",
];

/// Indices into [`PROFILE_PARTS`].
pub(super) mod part {
    pub const PREPARE: usize = 0;
    pub const EMBED: usize = 1;
    pub const NORM: usize = 2;
    pub const QKV_GEMM: usize = 3;
    pub const QKV_POST: usize = 4;
    pub const KV_APPEND: usize = 5;
    pub const ATTENTION: usize = 6;
    pub const O_GEMM: usize = 7;
    pub const FFN_GEMM: usize = 8;
    pub const ACT: usize = 9;
    pub const DOWN_GEMM: usize = 10;
    pub const LM_HEAD: usize = 11;
    pub const SAMPLE: usize = 12;
    pub const TO_HOST: usize = 13;
}

/// The profile of a step, when `KVFLEET_PROFILE=1`: an event on the stream after each part.
pub(super) struct Marks<'a> {
    profile: Option<&'a mut GpuSteps>,
    stream: &'a CudaStream,
}

impl<'a> Marks<'a> {
    pub fn new(profile: Option<&'a mut GpuSteps>, stream: &'a CudaStream) -> Self {
        Marks { profile, stream }
    }

    /// The part [`part`] names ended here.
    pub fn mark(&mut self, part: usize) -> Result<(), GpuError> {
        match self.profile.as_mut() {
            Some(p) => p
                .mark(self.stream, part)
                .map_err(drv("recording a profile event")),
            None => Ok(()),
        }
    }

    /// Reads the step's events (the stream has been synchronised) into the profile.
    pub fn finish(&mut self, tokens: usize, rows: usize) -> Result<(), GpuError> {
        match self.profile.as_mut() {
            Some(p) => p.finish(tokens, rows).map_err(drv("reading profile events")),
            None => Ok(()),
        }
    }
}

/// The model's parts for one step of `t` tokens, all on the stream of the GPU.
pub(super) struct Step<'a> {
    pub c: &'a LlamaConfig,
    pub dm: &'a Dims,
    pub blas: &'a Blas,
    pub k: &'a ModelKernels,
    pub w: &'a Weights,
    pub a: &'a mut Acts,
    pub backend: &'a mut CudaBackend,
    pub marks: Marks<'a>,
    pub t: usize,
    /// A step of one token with the GEMV path on: each projection is one fused GEMV.
    pub fused: bool,
    /// On that path the Q/K/V GEMV also writes the token's K/V into the cache where the
    /// backend lets it ([`CudaBackend::single_token_append`]).
    pub fused_append: bool,
    /// With a drafter: where the step keeps the features it reads.
    pub aux: Option<&'a mut AuxCapture>,
}

impl<'a> Step<'a> {
    /// Whether this step keeps layers' residual streams for a drafter ([`Step::keep_features`]).
    pub fn keeps_features(&self) -> bool {
        self.aux.is_some()
    }

    /// What the step's projections run with ([`super::linear::Linear`]).
    pub fn ops(&self) -> Ops<'a> {
        Ops::new(self.k, self.blas, self.t, self.fused, self.keeps_features())
    }

    /// Before layer `li` (`li == layers`: after the last), keeps the residual stream when the
    /// drafter reads it.
    pub fn keep_features(&mut self, li: usize) -> Result<(), GpuError> {
        match self.aux.as_mut() {
            Some(aux) => aux.keep(self.k.stream(), li, &self.a.x, self.t, self.dm.d),
            None => Ok(()),
        }
    }
}

/// A model family's layers on the GPU, in the spirit of mistral.rs's `models/`: a file per
/// family behind one trait. The embedding, the layers and their order are the family's; the
/// step around them (uploads, the LM head, sampling, the copy back) is shared.
pub(super) trait Family: Sync {
    /// From the token ids in `a.tok` to the residual stream `a.x` after the last layer.
    fn layers(&self, step: &mut Step<'_>) -> Result<(), GpuError>;

    /// Whether a step of one token may run the projections as fused GEMVs
    /// (`GpuOptions::single_token_gemv`).
    fn single_token_gemv(&self) -> bool {
        true
    }
}
