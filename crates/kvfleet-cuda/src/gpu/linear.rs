//! [`Linear`]: a projection's weight in whatever format it is stored, and the op that runs it,
//! in the spirit of vLLM's `LinearMethodBase` (vllm/model_executor/layers/linear.py and
//! `quantization/`) and mistral.rs's `QuantMethod` (mistralrs-quant): the format owns its
//! kernels, a family file says "project x through W" (or "norm x, then project through W").
//!
//! Which kernel runs is picked here from the weight's format and the step's shape:
//! - a step of one token with the GEMV path on: one fused GEMV ([`super::gemv`]) that norms its
//!   input, and adds to the residual, applies SwiGLU or splits Q/K/V in its epilogue;
//! - bf16 at more tokens: cuBLAS ([`super::blas`]);
//! - FP8 (W8A8) at 2 to 8 tokens the skinny GEMM, above that cuBLASLt ([`super::fp8`],
//!   [`super::lt`]), with the neighbours that [`Fusion`] lets take over: the norm writes the
//!   quantized input ([`Linear::norm_input`]), the Q/K/V split or the activation applies the
//!   GEMM's scales, and on cuBLASLt's unit-scale path the residual add of O and down waits for
//!   the norm after them ([`Ops`] carries it).
//!
//! A new weight format is a [`Mat`] variant and its arms here.

use cudarc::driver::CudaSlice;

use super::blas::{Blas, Fp8In, Gemm};
use super::error::GpuError;
use super::fp8::{Fp8Kernels, Fp8Scratch, Fusion};
use super::gemv::{Input, Output};
use super::kernels::ModelKernels;
use super::rows::{Glu, Norm};

pub(super) use super::fp8::Mat;
/// What the one-token Q/K/V projection's split writes ([`Linear::project_split`]).
pub(super) use super::gemv::QkvRope;

/// A linear layer: `y[t, n] = x[t, k] · Wᵀ`, `W` `[n, k]` row-major in its format.
pub(super) struct Linear {
    w: Mat,
    n: usize,
    k: usize,
}

/// The input rows of a projection, as [`Linear::norm_input`] left them or as the model has them.
pub(super) enum Rows<'a> {
    /// bf16 `[t, k]`.
    Bf16(&'a CudaSlice<u16>),
    /// `RMSNorm(x[0])` of the step's one token, normed inside the GEMV.
    Normed { x: &'a CudaSlice<f32>, norm: Norm<'a> },
    /// Quantized already, in the FP8 scratch (a fused norm or activation wrote them).
    Quantized,
}

impl<'a> Rows<'a> {
    /// The GEMM's view.
    fn gemm(self) -> Result<Fp8In<'a>, GpuError> {
        match self {
            Rows::Bf16(x) => Ok(Fp8In::Bf16(x)),
            Rows::Quantized => Ok(Fp8In::Quantized),
            Rows::Normed { .. } => Err(GpuError::Invalid("a normed GEMV input to a GEMM".into())),
        }
    }

    /// The GEMV's view.
    fn gemv(self) -> Result<Input<'a>, GpuError> {
        match self {
            Rows::Bf16(x) => Ok(Input::Bf16(x)),
            Rows::Normed { x, norm } => Ok(Input::normed(x, norm.w, norm.eps)),
            Rows::Quantized => Err(GpuError::Invalid("a quantized input to a GEMV".into())),
        }
    }
}

/// The weight's row scales a GEMM left for its consumer to apply (FP8 on cuBLASLt's unit-scale
/// path), with the token scales in the FP8 scratch.
#[derive(Clone, Copy)]
pub(super) struct Unscaled<'w>(&'w CudaSlice<f32>);

impl<'w> Unscaled<'w> {
    /// The token scales and the weight's row scales, as `kvf_qkv_post(_wide)_fp8` reads them.
    pub fn with<'s>(self, s: &'s Fp8Scratch) -> (&'s CudaSlice<f32>, &'w CudaSlice<f32>) {
        (&s.sx, self.0)
    }
}

/// What the gate/up projection left for the activation ([`Linear::activate`]).
pub(super) enum GateUp<'w> {
    /// The gate/up rows in `gu`, unscaled when the scales are given.
    Rows(Option<Unscaled<'w>>),
    /// The one-token GEMV wrote `silu(gate) * up` already.
    Activated,
}

/// What a step's projections run with: the kernels and GEMM handles, the step's size, whether
/// one token takes the fused GEMVs, and the residual add an FP8 projection left to the next
/// norm.
pub(super) struct Ops<'a> {
    k: &'a ModelKernels,
    blas: &'a Blas,
    t: usize,
    /// A step of one token with the GEMV path on.
    one_token: bool,
    /// FP8 residual adds on the unit-scale path may wait for the next norm: the norm and add
    /// fusions on, and no layer's residual stream kept for a drafter (it must be complete).
    defer: bool,
    /// The weight's row scales of such an add, its unscaled product in the scratch's `d`.
    pending: Option<&'a CudaSlice<f32>>,
    /// The next residual add is done at once: a down projection after the unfused activation
    /// adds as it always has ([`Linear::activate`]).
    add_now: bool,
}

impl<'a> Ops<'a> {
    pub fn new(k: &'a ModelKernels, blas: &'a Blas, t: usize, one_token: bool, keeps_features: bool) -> Self {
        let defer = fusion(k).is_some_and(|f| f.add && f.norm) && !keeps_features;
        Ops {
            k,
            blas,
            t,
            one_token,
            defer,
            pending: None,
            add_now: false,
        }
    }

    /// Whether this step's Q/K/V projection can also split, rotate and append
    /// ([`Linear::project_split`]): one token on the GEMV path with its Q/K/V epilogue.
    pub fn splits_in_projection(&self) -> bool {
        self.one_token && self.k.gemv.fused_qkv
    }

    /// Does the residual add a projection left, into `x` (`[t, n]`).
    pub fn settle(&mut self, x: &mut CudaSlice<f32>, n: usize, s: &Fp8Scratch) -> Result<(), GpuError> {
        match self.pending.take() {
            Some(sw) => self.blas.finish_add(self.k, sw, x, (self.t, n), s),
            None => Ok(()),
        }
    }
}

/// The FP8 kernels' fusions, when the model has FP8 kernels.
fn fusion(k: &ModelKernels) -> Option<Fusion> {
    k.fp8.as_ref().map(|f| f.fusion)
}

fn fp8_kernels(k: &ModelKernels) -> Result<&Fp8Kernels, GpuError> {
    k.fp8
        .as_ref()
        .ok_or_else(|| GpuError::Invalid("FP8 weights on a model built without FP8 kernels".into()))
}

impl Linear {
    /// A weight of `n` rows of `k`.
    pub fn new(w: Mat, n: usize, k: usize) -> Self {
        Linear { w, n, k }
    }

    /// Bytes on the device.
    pub fn bytes(&self) -> usize {
        self.w.bytes()
    }

    fn is_fp8(&self) -> bool {
        matches!(self.w, Mat::Fp8 { .. })
    }

    /// Whether the format's fused neighbours are on for this weight (FP8 with any fusion).
    fn fused(&self, ops: &Ops<'_>) -> Option<Fusion> {
        fusion(ops.k).filter(|f| self.is_fp8() && *f != Fusion::NONE)
    }

    fn gemm(&self, t: usize, accumulate: bool) -> Gemm {
        Gemm {
            t,
            n: self.n,
            k: self.k,
            accumulate,
        }
    }

    /// `RMSNorm(x)` as this projection reads it: inside the GEMV at one token; into the FP8
    /// scratch's quantized rows where the format fuses the norm (taking the residual add a
    /// projection left); else into bf16 `h` (after that add).
    pub fn norm_input<'h>(
        &self,
        ops: &mut Ops<'_>,
        x: &'h mut CudaSlice<f32>,
        norm: Norm<'h>,
        h: &'h mut CudaSlice<u16>,
        s: &mut Fp8Scratch,
    ) -> Result<Rows<'h>, GpuError> {
        let (t, d) = (ops.t, self.k);
        if ops.one_token {
            ops.settle(x, d, s)?;
            return Ok(Rows::Normed { x, norm });
        }
        if self.fused(ops).is_some_and(|f| f.norm) && Fp8Kernels::fits(d) {
            let f8 = fp8_kernels(ops.k)?;
            match ops.pending.take() {
                Some(sw) => f8.add_rms_norm_quantize(ops.k.stream(), sw, x, t, d, norm, s)?,
                None => f8.rms_norm_quantize(ops.k.stream(), x, t, d, norm, s)?,
            }
            return Ok(Rows::Quantized);
        }
        ops.settle(x, d, s)?;
        ops.k.rms_norm(x, t, d, norm, h)?;
        Ok(Rows::Bf16(h))
    }

    /// `y = x · Wᵀ` (f32 `[t, n]`, overwritten).
    pub fn project(
        &self,
        ops: &Ops<'_>,
        x: Rows<'_>,
        y: &mut CudaSlice<f32>,
        s: &mut Fp8Scratch,
    ) -> Result<(), GpuError> {
        if ops.one_token {
            return ops
                .k
                .gemv
                .run(&self.w, self.n, self.k, x.gemv()?, Output::Store(y));
        }
        ops.blas
            .project_in(ops.k, &self.w, x.gemm()?, y, self.gemm(ops.t, false), s)
    }

    /// `y = x · Wᵀ` for the Q/K/V split after it, which applies the GEMM's scales itself where
    /// the format leaves them ([`Fusion::qkv`]): then they are returned.
    pub fn project_for_split<'w>(
        &'w self,
        ops: &Ops<'_>,
        x: Rows<'_>,
        y: &mut CudaSlice<f32>,
        s: &mut Fp8Scratch,
    ) -> Result<Option<Unscaled<'w>>, GpuError> {
        if !ops.one_token && self.fused(ops).is_some_and(|f| f.qkv) {
            let dims = (ops.t, self.n, self.k);
            return Ok(ops
                .blas
                .gemm_fp8(ops.k, &self.w, x.gemm()?, y, dims, s)?
                .map(Unscaled));
        }
        self.project(ops, x, y, s).map(|()| None)
    }

    /// The Q/K/V projection of the step's one token with the split in its epilogue (bias,
    /// RoPE, bf16 Q/K/V, K/V into the cache where `rope.cache` says): only where
    /// [`Ops::splits_in_projection`].
    pub fn project_split(&self, ops: &Ops<'_>, x: Rows<'_>, rope: QkvRope<'_>) -> Result<(), GpuError> {
        if !ops.splits_in_projection() {
            return Err(GpuError::Invalid(
                "a Q/K/V split in a projection that has none".into(),
            ));
        }
        ops.k
            .gemv
            .run(&self.w, self.n, self.k, x.gemv()?, Output::Qkv(rope))
    }

    /// `x += in · Wᵀ` into the residual stream `x`; where the format's unit-scale GEMM leaves
    /// the add to the next norm ([`Ops`]), it is left.
    pub fn project_add<'w>(
        &'w self,
        ops: &mut Ops<'w>,
        input: Rows<'_>,
        x: &mut CudaSlice<f32>,
        s: &mut Fp8Scratch,
    ) -> Result<(), GpuError> {
        if ops.one_token {
            return ops
                .k
                .gemv
                .run(&self.w, self.n, self.k, input.gemv()?, Output::Add(x));
        }
        let input = input.gemm()?;
        if ops.defer && !std::mem::take(&mut ops.add_now) && self.fused(ops).is_some() {
            ops.settle(x, self.n, s)?;
            let dims = (ops.t, self.n, self.k);
            ops.pending = ops.blas.project_add_deferred(ops.k, &self.w, input, x, dims, s)?;
            return Ok(());
        }
        ops.blas
            .project_in(ops.k, &self.w, input, x, self.gemm(ops.t, true), s)
    }

    /// The gate/up projection (`[t, 2 ff]`, gate rows then up rows) for the activation before
    /// `down`: at one token the GEMV applies SwiGLU into `act`; where `down` quantizes the
    /// activation itself ([`Linear::activate`]) its scales are left to it.
    #[allow(clippy::too_many_arguments)] // the input, the activation and its reader, both outputs
    pub fn project_gate_up<'w>(
        &'w self,
        ops: &Ops<'_>,
        x: Rows<'_>,
        glu: Glu,
        down: &Linear,
        gu: &mut CudaSlice<f32>,
        act: &mut CudaSlice<u16>,
        s: &mut Fp8Scratch,
    ) -> Result<GateUp<'w>, GpuError> {
        if ops.one_token {
            if glu != Glu::Silu {
                return Err(GpuError::Invalid(format!(
                    "a one-token gate/up GEMV with {glu:?}"
                )));
            }
            ops.k
                .gemv
                .run(&self.w, self.n, self.k, x.gemv()?, Output::SwiGlu(act))?;
            return Ok(GateUp::Activated);
        }
        if self.fused(ops).is_some() && down.quantizes_activation(ops) {
            let dims = (ops.t, self.n, self.k);
            let sw = ops.blas.gemm_fp8(ops.k, &self.w, x.gemm()?, gu, dims, s)?;
            return Ok(GateUp::Rows(sw.map(Unscaled)));
        }
        self.project(ops, x, gu, s)?;
        Ok(GateUp::Rows(None))
    }

    /// Whether this projection's input is the gated activation quantized by one kernel.
    fn quantizes_activation(&self, ops: &Ops<'_>) -> bool {
        self.fused(ops).is_some_and(|f| f.glu) && Fp8Kernels::fits(self.k)
    }

    /// `act = glu(gate) * up` of what [`Linear::project_gate_up`] left, as this projection
    /// (down, `k = ff`) reads it: quantized in one kernel with the gate/up scales applied where
    /// the format fuses it, else bf16 in `act`.
    pub fn activate<'h>(
        &self,
        ops: &mut Ops<'_>,
        glu: Glu,
        gate_up: GateUp<'_>,
        gu: &CudaSlice<f32>,
        act: &'h mut CudaSlice<u16>,
        s: &mut Fp8Scratch,
    ) -> Result<Rows<'h>, GpuError> {
        let ff = self.k;
        let sw = match gate_up {
            GateUp::Activated => return Ok(Rows::Bf16(act)),
            GateUp::Rows(sw) => sw,
        };
        if self.quantizes_activation(ops) {
            let f8 = fp8_kernels(ops.k)?;
            f8.glu_quantize(ops.k.stream(), glu, gu, ops.t, ff, sw.map(|u| u.0), s)?;
            return Ok(Rows::Quantized);
        }
        if sw.is_some() {
            return Err(GpuError::Invalid(
                "unscaled gate/up rows for a bf16 activation".into(),
            ));
        }
        ops.k.glu(glu, gu, ops.t, ff, act)?;
        ops.add_now = true;
        Ok(Rows::Bf16(act))
    }
}
