//! The GEMMs of the forward pass on cuBLAS: bf16 weights and activations, f32 output and
//! accumulation; FP8 weights through cuBLASLt ([`super::fp8`]).

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::{result as blas_result, sys as blas_sys, CudaBlas};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use super::error::{cublas_err, need, GpuError};
use super::fp8::{Fp8Kernels, Fp8Scratch, Mat};
use super::kernels::ModelKernels;
use super::lt::{Done, Lt};
use super::options::GpuTuning;

/// Whether cuBLAS can be loaded (cudarc panics on first use otherwise).
pub fn cublas_present() -> bool {
    // SAFETY: only tries `dlopen` on libcublas candidate names.
    unsafe { cudarc::cublas::sys::is_culib_present() }
}

/// The shape of `y[t, n] = x[t, k] · w[n, k]ᵀ`, and whether `y` is added to (`+=`, the residual
/// stream) or overwritten.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Gemm {
    pub t: usize,
    pub n: usize,
    pub k: usize,
    pub accumulate: bool,
}

impl Gemm {
    /// `y = x · wᵀ`.
    pub fn store(t: usize, n: usize, k: usize) -> Self {
        Gemm {
            t,
            n,
            k,
            accumulate: false,
        }
    }

    /// `y += x · wᵀ`.
    pub fn add(t: usize, n: usize, k: usize) -> Self {
        Gemm {
            t,
            n,
            k,
            accumulate: true,
        }
    }
}

/// The input of an FP8 projection.
#[derive(Clone, Copy)]
pub(super) enum Fp8In<'a> {
    /// bf16 rows `[t, k]`, quantized per token by the projection.
    Bf16(&'a CudaSlice<u16>),
    /// Already quantized in the scratch's `xq` and `sx` (a fused producer wrote them).
    Quantized,
}

/// A cuBLAS handle on the GPU's stream, and a cuBLASLt one for FP8 weights.
pub(super) struct Blas {
    handle: CudaBlas,
    stream: Arc<CudaStream>,
    lt: Option<Lt>,
}

impl Blas {
    /// `fp8`: the model has FP8 weights (a cuBLASLt handle and its workspace too, on the
    /// scale path `tuning` picks).
    pub fn new(stream: Arc<CudaStream>, fp8: bool, tuning: &GpuTuning) -> Result<Self, GpuError> {
        let handle = CudaBlas::new(stream.clone()).map_err(cublas_err("creating the cuBLAS handle"))?;
        let lt = if fp8 {
            Some(Lt::new(stream.clone(), tuning.fp8_scales)?)
        } else {
            None
        };
        Ok(Blas { handle, stream, lt })
    }

    /// With a given cuBLASLt handle (tests of either scale path).
    #[cfg(test)]
    pub fn with_lt(stream: Arc<CudaStream>, lt: Lt) -> Result<Self, GpuError> {
        let handle = CudaBlas::new(stream.clone()).map_err(cublas_err("creating the cuBLAS handle"))?;
        Ok(Blas {
            handle,
            stream,
            lt: Some(lt),
        })
    }

    /// Whether cuBLASLt's plan of this FP8 GEMM shape has per-row scales (`None`: not planned).
    #[cfg(test)]
    pub fn lt_planned_per_row(&self, dims: (usize, usize, usize)) -> Option<bool> {
        self.lt.as_ref().and_then(|l| l.planned_per_row(dims))
    }

    /// How many FP8 scale choices cuBLASLt's plans have timed (one a bucket of token counts).
    #[cfg(test)]
    pub fn lt_timed_choices(&self) -> usize {
        self.lt.as_ref().map_or(0, |l| l.timed_choices())
    }

    /// Row-major `y[t, n] = x[t, k] · w[n, k]ᵀ` (`+=` when `g.accumulate`) for a weight of
    /// either dtype, bf16 `x`: [`Blas::gemm`] for bf16; for FP8, `x` quantized per token into
    /// `s`, cuBLASLt's FP8 GEMM into f32 (into `s.d` when accumulating) and the two scales
    /// applied by `kvf_fp8_scale`. The model's projections go through `super::linear`.
    #[cfg(test)]
    pub fn project(
        &self,
        k: &ModelKernels,
        w: &Mat,
        x: &CudaSlice<u16>,
        y: &mut CudaSlice<f32>,
        g: Gemm,
        s: &mut Fp8Scratch,
    ) -> Result<(), GpuError> {
        self.project_in(k, w, Fp8In::Bf16(x), y, g, s)
    }

    /// [`Blas::project`] from either input: with [`Fp8In::Quantized`] (FP8 weights only) the
    /// quantize step is skipped, its rows already in `s`.
    pub fn project_in(
        &self,
        k: &ModelKernels,
        w: &Mat,
        x: Fp8In<'_>,
        y: &mut CudaSlice<f32>,
        g: Gemm,
        s: &mut Fp8Scratch,
    ) -> Result<(), GpuError> {
        let Gemm {
            t,
            n,
            k: kk,
            accumulate,
        } = g;
        if accumulate {
            return match self.project_add_deferred(k, w, x, y, (t, n, kk), s)? {
                Some(sw) => self.finish_add(k, sw, y, (t, n), s),
                None => Ok(()),
            };
        }
        match (w, x) {
            (Mat::Bf16(w), Fp8In::Bf16(x)) => return self.gemm(w, x, y, g),
            (Mat::Bf16(_), Fp8In::Quantized) => {
                return Err(GpuError::Invalid("a quantized input to a bf16 weight".into()))
            }
            (Mat::Fp8 { .. }, _) => {}
        }
        if t == 0 || n == 0 {
            return Ok(());
        }
        match self.gemm_fp8(k, w, x, y, (t, n, kk), s)? {
            Some(sw) => self
                .fp8_kernels(k)?
                .scale(&self.stream, None, t, n, &s.sx, sw, false, y),
            None => Ok(()),
        }
    }

    /// [`Blas::project_in`] adding to `y` (the residual stream), except where cuBLASLt runs
    /// with unit scales: there the unscaled product is left in `s.d` and the weight's row scales
    /// are returned, for the consumer to add (`Fp8Kernels::add_rms_norm_quantize`, or
    /// [`Blas::finish_add`]). `None`: `y` holds the sum.
    pub fn project_add_deferred<'w>(
        &self,
        k: &ModelKernels,
        w: &'w Mat,
        x: Fp8In<'_>,
        y: &mut CudaSlice<f32>,
        (t, n, kk): (usize, usize, usize),
        s: &mut Fp8Scratch,
    ) -> Result<Option<&'w CudaSlice<f32>>, GpuError> {
        let (q, scale) = match (w, x) {
            (Mat::Bf16(w), Fp8In::Bf16(x)) => {
                self.gemm(w, x, y, Gemm::add(t, n, kk))?;
                return Ok(None);
            }
            (Mat::Bf16(_), Fp8In::Quantized) => {
                return Err(GpuError::Invalid("a quantized input to a bf16 weight".into()))
            }
            (Mat::Fp8 { q, scale }, _) => (q, scale),
        };
        if t == 0 || n == 0 {
            return Ok(None);
        }
        let lt = self.lt()?;
        let (w, dims) = ((q, scale), (t, n, kk));
        if self.quantize_then_skinny(self.fp8_kernels(k)?, w, x, y, dims, true, s)? {
            return Ok(None);
        }
        let xs = (&s.xq, &s.sx);
        // A new shape is timed into `s.d`, which the unit-scale path overwrites anyway.
        if lt.scales_rows_for(w, xs, &mut s.d, dims)? {
            lt.gemm(w, xs, y, dims, true)?;
            return Ok(None);
        }
        lt.gemm(w, xs, &mut s.d, dims, false)?;
        Ok(Some(scale))
    }

    /// The add [`Blas::project_add_deferred`] left: `y += s.d * s.sx[t] * sw[n]`.
    pub fn finish_add(
        &self,
        k: &ModelKernels,
        sw: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
        (t, n): (usize, usize),
        s: &Fp8Scratch,
    ) -> Result<(), GpuError> {
        self.fp8_kernels(k)?
            .scale(&self.stream, Some(&s.d), t, n, &s.sx, sw, true, y)
    }

    /// An FP8 weight's GEMM stored into `y` (`[t, n]`, f32), its input quantized into `s` first
    /// unless [`Fp8In::Quantized`]. Returns the weight's row scales when `y` is left unscaled
    /// (cuBLASLt without per-row scales): the caller applies `s.sx[t] * sw[n]`; `None` when
    /// `y` is scaled.
    pub fn gemm_fp8<'w>(
        &self,
        k: &ModelKernels,
        w: &'w Mat,
        x: Fp8In<'_>,
        y: &mut CudaSlice<f32>,
        (t, n, kk): (usize, usize, usize),
        s: &mut Fp8Scratch,
    ) -> Result<Option<&'w CudaSlice<f32>>, GpuError> {
        let Mat::Fp8 { q, scale } = w else {
            return Err(GpuError::Invalid("an FP8 GEMM of a bf16 weight".into()));
        };
        let (lt, f) = (self.lt()?, self.fp8_kernels(k)?);
        if t == 0 || n == 0 {
            return Ok(None);
        }
        if self.quantize_then_skinny(f, (q, scale), x, y, (t, n, kk), false, s)? {
            return Ok(None);
        }
        Ok(match lt.gemm((q, scale), (&s.xq, &s.sx), y, (t, n, kk), false)? {
            Done::Scaled => None,
            Done::Unscaled => Some(scale),
        })
    }

    /// Quantizes a bf16 input into `s` (a quantized one is there already), then runs the
    /// skinny FP8 GEMM (`+=` when `accumulate`) where the step's shape takes it: returns
    /// whether it ran.
    #[allow(clippy::too_many_arguments)] // the kernels, the weight, both operands, the shape
    fn quantize_then_skinny(
        &self,
        f: &Fp8Kernels,
        w: (&CudaSlice<u8>, &CudaSlice<f32>),
        x: Fp8In<'_>,
        y: &mut CudaSlice<f32>,
        (t, n, kk): (usize, usize, usize),
        accumulate: bool,
        s: &mut Fp8Scratch,
    ) -> Result<bool, GpuError> {
        if let Fp8In::Bf16(x) = x {
            f.quantize_rows(&self.stream, x, t, kk, kk, &mut s.xq, &mut s.sx)?;
        }
        if !f.takes_skinny(t, kk) {
            return Ok(false);
        }
        f.gemm_skinny(&self.stream, w, (&s.xq, &s.sx), y, (t, n, kk), accumulate)?;
        Ok(true)
    }

    fn lt(&self) -> Result<&Lt, GpuError> {
        self.lt
            .as_ref()
            .ok_or_else(|| GpuError::Invalid("FP8 weights on a model built without cuBLASLt".into()))
    }

    fn fp8_kernels<'k>(&self, k: &'k ModelKernels) -> Result<&'k Fp8Kernels, GpuError> {
        k.fp8
            .as_ref()
            .ok_or_else(|| GpuError::Invalid("FP8 weights on a model built without FP8 kernels".into()))
    }

    /// Row-major `y[t, n] = x[t, k] · w[n, k]ᵀ` (`+=` when `g.accumulate`): bf16 `x` and `w`,
    /// f32 `y`, f32 accumulation.
    ///
    /// cuBLAS is column-major: a row-major `[r, c]` buffer is the column-major `c × r` matrix
    /// (its transpose) with leading dimension `c`. So `y` is column-major `yᵀ` (n × t, ld n),
    /// `w` is `wᵀ` (k × n, ld k) and `x` is `xᵀ` (k × t, ld k). We want
    /// `yᵀ = w · xᵀ = (wᵀ)ᵀ · xᵀ`: `C = op(A) · op(B)` with `A` = the `w` buffer, `op(A) = Aᵀ`
    /// (transa T, lda k), `B` = the `x` buffer (transb N, ldb k), `C` = the `y` buffer (ldc n),
    /// and m = n, n = t, k = k.
    pub fn gemm(
        &self,
        w: &CudaSlice<u16>,
        x: &CudaSlice<u16>,
        y: &mut CudaSlice<f32>,
        g: Gemm,
    ) -> Result<(), GpuError> {
        let Gemm { t, n, k, accumulate } = g;
        if t == 0 || n == 0 {
            return Ok(());
        }
        need("GEMM weight", w, n * k)?;
        need("GEMM input", x, t * k)?;
        need("GEMM output", y, t * n)?;
        let dims = [t, n, k].map(i32::try_from);
        let [Ok(ti), Ok(ni), Ok(ki)] = dims else {
            return Err(GpuError::Invalid(format!(
                "GEMM {t}x{n}x{k} exceeds 32-bit dimensions"
            )));
        };
        let alpha = 1f32;
        let beta = if accumulate { 1f32 } else { 0f32 };
        let s = &self.stream;
        let (wp, _rw) = w.device_ptr(s);
        let (xp, _rx) = x.device_ptr(s);
        let (yp, _ry) = y.device_ptr_mut(s);
        // SAFETY: the handle runs on stream `s` (the stream of every buffer here); the buffer
        // sizes were checked above against the shapes described in this function's comment;
        // alpha/beta are host f32 (pointer mode host, compute type 32F); A/B are bf16, C is f32,
        // a combination cublasGemmEx supports.
        unsafe {
            blas_result::gemm_ex(
                *self.handle.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                ni,
                ti,
                ki,
                &alpha as *const f32 as *const c_void,
                wp as *const c_void,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                ki,
                xp as *const c_void,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                ki,
                &beta as *const f32 as *const c_void,
                yp as *mut c_void,
                blas_sys::cudaDataType_t::CUDA_R_32F,
                ni,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(cublas_err("a GEMM"))
    }
}
