//! FP8 (e4m3) linear layers, W8A8 as vLLM's dynamic FP8 method runs them: weights with one
//! scale per output channel, activations quantized per token on the fly (`kernels/fp8.cu`).
//!
//! - A step of one token streams the weights through `kvf_gemv_fp8` (one byte a weight, the
//!   input kept bf16; [`super::gemv`]).
//! - Larger steps quantize their input rows (`kvf_quantize_rows_fp8`) and run cuBLASLt's FP8
//!   GEMM into f32 ([`Lt`]). Where cuBLASLt takes a scale per row of each operand ("outer
//!   vector" scaling, cuBLAS 12.9 and later on Hopper and Blackwell) the GEMM applies both
//!   scales and adds to the residual itself (beta 1). Elsewhere (Ada, older cuBLAS) it runs
//!   with unit scales and `kvf_fp8_scale` applies them after, storing or adding the result.
//! - Around the GEMMs the neighbours take over what they can ([`Fusion`]): RMSNorm writes the
//!   e4m3 input rows, the Q/K/V split applies the QKV GEMM's scales as it reads, and one kernel
//!   turns the unscaled gate/up rows into the down projection's e4m3 input (scales, SwiGLU,
//!   quantization), bit-equal to the separate kernels. At a 2,048-token prefill of Llama-3-8B
//!   that took the step from 43.7 to 34.9 ms on an H200 (bench/RESULTS.md, 2026-11-28). On the
//!   unit-scale path the O and down GEMMs' residual add goes into the RMSNorm after them too
//!   (`kvf_add_rms_norm_fp8`): one read of the residual and one launch fewer a projection.
//!
//! The embeddings, the LM head and the norms stay bf16 / f32, as in vLLM's `fp8` method (its
//! `Fp8Config` quantizes `LinearBase` layers only): the LM head is where an error reaches the
//! logits undamped, and at one stream it is 1 GB of the 8 GB an 8B model reads a token.

use std::sync::Arc;

use cudarc::cublaslt::sys as lt_sys;
use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig};

use crate::device::Gpu;
use crate::launch::Launch;
use crate::spec::Arch;

use super::error::{drv, need, GpuError};
use super::options::GpuTuning;
use super::rows::{rows_cfg, Glu, Norm, NORM_THREADS};

/// Whether cuBLASLt can be loaded (cudarc panics on first use otherwise).
pub fn cublaslt_present() -> bool {
    // SAFETY: only tries `dlopen` on libcublasLt candidate names.
    unsafe { lt_sys::is_culib_present() }
}

/// `Ok` when `gpu` can run FP8 weights: compute capability 8.9 or later (FP8 tensor cores and
/// the `cvt` instructions between e4m3 and f16/f32), and cuBLASLt present.
pub fn check_device(gpu: &Gpu) -> Result<(), GpuError> {
    if matches!(gpu.arch, Arch::Sm80 | Arch::Sm86) {
        return Err(GpuError::Invalid(format!(
            "FP8 weights need compute capability 8.9 or later (L4, L40S, H100, H200, B200, RTX 50xx); {} is {}",
            gpu.name, gpu.arch
        )));
    }
    if !cublaslt_present() {
        return Err(GpuError::Invalid(
            "FP8 weights need cuBLASLt (libcublasLt.so.12, from the nvidia-cublas-cu12 wheel)".into(),
        ));
    }
    Ok(())
}

/// The weight of a linear layer, `[n, k]` row-major (rows = output channels).
pub(super) enum Mat {
    Bf16(CudaSlice<u16>),
    /// e4m3 bytes and one f32 scale a row.
    Fp8 {
        q: CudaSlice<u8>,
        scale: CudaSlice<f32>,
    },
}

impl Mat {
    /// Bytes on the device.
    pub fn bytes(&self) -> usize {
        match self {
            Mat::Bf16(w) => 2 * w.len(),
            Mat::Fp8 { q, scale } => q.len() + 4 * scale.len(),
        }
    }
}

/// A borrowed [`Mat`], or a bf16 matrix held elsewhere (the LM head).
#[derive(Clone, Copy)]
pub(super) enum MatRef<'a> {
    Bf16(&'a CudaSlice<u16>),
    Fp8 {
        q: &'a CudaSlice<u8>,
        scale: &'a CudaSlice<f32>,
    },
}

impl<'a> From<&'a Mat> for MatRef<'a> {
    fn from(m: &'a Mat) -> Self {
        match m {
            Mat::Bf16(w) => MatRef::Bf16(w),
            Mat::Fp8 { q, scale } => MatRef::Fp8 { q, scale },
        }
    }
}

impl<'a> From<&'a CudaSlice<u16>> for MatRef<'a> {
    fn from(w: &'a CudaSlice<u16>) -> Self {
        MatRef::Bf16(w)
    }
}

const THREADS: u32 = 256;
/// Blocks over one row's columns in `kvf_fp8_scale`.
const SCALE_ROW_BLOCKS: usize = 64;
/// Dynamic shared memory the fused kernels may take (a bf16 row: 2 bytes an element); within
/// the opt-in limit of every FP8 device (99 KiB on sm_89 and sm_120).
const FUSED_SMEM_MAX: usize = 96 * 1024;

pub(crate) use super::options::SKINNY_MAX;
/// Blocks an SM of `kvf_gemm_fp8_skinny`'s grid at most (its blocks then take several units).
const SKINNY_BLOCKS_PER_SM: usize = 4;

/// Which neighbours of the FP8 GEMMs take over the input quantization and the unit-scale
/// epilogue ([`GpuTuning::fp8_fusion`]).
///
/// [`GpuTuning::fp8_fusion`]: super::options::GpuTuning::fp8_fusion
pub(crate) use super::options::Fp8Fusion as Fusion;

/// The FP8 kernels besides the GEMV: quantizing rows, the GEMM epilogue and the GEMMs'
/// neighbours with them fused in, launched on the stream their caller runs on.
pub(crate) struct Fp8Kernels {
    quantize: CudaFunction,
    scale: CudaFunction,
    silu_quantize: CudaFunction,
    gelu_tanh_quantize: CudaFunction,
    norm_quantize: CudaFunction,
    add_norm_quantize: CudaFunction,
    qkv_post: CudaFunction,
    qkv_post_wide: CudaFunction,
    skinny: CudaFunction,
    skinny16: CudaFunction,
    /// What the model's steps fuse.
    pub fusion: Fusion,
    /// Steps of 2 to this many tokens run their FP8 GEMMs on `kvf_gemm_fp8_skinny` instead of
    /// cuBLASLt (0: never; [`GpuTuning::fp8_skinny_max`]).
    ///
    /// [`GpuTuning::fp8_skinny_max`]: super::options::GpuTuning::fp8_skinny_max
    skinny_max: usize,
    /// The device's SMs (the skinny GEMM's grid cap).
    num_sms: usize,
    /// Units of 16 rows (`kvf_gemm_fp8_skinny16`) where units of 32 leave under two blocks an
    /// SM; off keeps 32 everywhere (to time it).
    skinny_unit16: bool,
    /// Launch the fused kernels with programmatic dependent launch (sm_90 and later).
    pdl: bool,
}

impl Fp8Kernels {
    pub fn load(
        module: &Arc<CudaModule>,
        num_sms: usize,
        pdl: bool,
        tuning: &GpuTuning,
    ) -> Result<Self, GpuError> {
        let f = |name: &str| module.load_function(name).map_err(drv("finding an FP8 kernel"));
        let wide = |name: &str| -> Result<CudaFunction, GpuError> {
            let k = f(name)?;
            k.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                FUSED_SMEM_MAX as i32,
            )
            .map_err(drv("raising an FP8 kernel's shared-memory limit"))?;
            Ok(k)
        };
        Ok(Fp8Kernels {
            quantize: f("kvf_quantize_rows_fp8")?,
            scale: f("kvf_fp8_scale")?,
            silu_quantize: wide("kvf_silu_quantize_fp8")?,
            gelu_tanh_quantize: wide("kvf_gelu_tanh_quantize_fp8")?,
            norm_quantize: wide("kvf_rms_norm_fp8")?,
            add_norm_quantize: wide("kvf_add_rms_norm_fp8")?,
            qkv_post: f("kvf_qkv_post_fp8")?,
            qkv_post_wide: f("kvf_qkv_post_wide_fp8")?,
            skinny: f("kvf_gemm_fp8_skinny")?,
            skinny16: f("kvf_gemm_fp8_skinny16")?,
            skinny_unit16: tuning.fp8_skinny_unit16,
            fusion: tuning.fp8_fusion,
            skinny_max: tuning.fp8_skinny_max.min(SKINNY_MAX),
            num_sms: num_sms.max(1),
            pdl,
        })
    }

    /// Whether the fused kernels take rows of `width` elements (a bf16 row in shared memory).
    pub fn fits(width: usize) -> bool {
        2 * width <= FUSED_SMEM_MAX
    }

    /// [`Fp8Kernels::fits`] as an error naming the fused `what`.
    fn check_fits(what: &str, width: usize) -> Result<(), GpuError> {
        if Self::fits(width) {
            return Ok(());
        }
        Err(GpuError::Invalid(format!(
            "a fused FP8 {what} of {width} columns (at most {})",
            FUSED_SMEM_MAX / 2
        )))
    }

    /// Whether a step of `t` tokens runs the FP8 GEMM of a `[n, k]` weight on
    /// [`Fp8Kernels::gemm_skinny`].
    pub fn takes_skinny(&self, t: usize, k: usize) -> bool {
        (2..=self.skinny_max).contains(&t) && k % 64 == 0 && k > 0
    }

    /// `y[t, n] (+)= (sx[t] sw[n]) (xq[t, k] · wq[n, k]ᵀ)` in f32 for 2 to [`SKINNY_MAX`]
    /// tokens, streaming the weights once (`kvf_gemm_fp8_skinny`); `k` a multiple of 64.
    pub fn gemm_skinny(
        &self,
        stream: &CudaStream,
        (wq, sw): (&CudaSlice<u8>, &CudaSlice<f32>),
        (xq, sx): (&CudaSlice<u8>, &CudaSlice<f32>),
        y: &mut CudaSlice<f32>,
        (t, n, k): (usize, usize, usize),
        accumulate: bool,
    ) -> Result<(), GpuError> {
        if !(1..=SKINNY_MAX).contains(&t) || k % 64 != 0 || k == 0 {
            return Err(GpuError::Invalid(format!(
                "a skinny FP8 GEMM of {t} tokens over k = {k} (1 to {SKINNY_MAX} tokens, k a multiple of 64)"
            )));
        }
        if n == 0 {
            return Ok(());
        }
        need("FP8 GEMM weight", wq, n * k)?;
        need("FP8 weight scales", sw, n)?;
        need("FP8 GEMM input", xq, t * k)?;
        need("FP8 token scales", sx, t)?;
        need("FP8 GEMM output", y, t * n)?;
        let [Ok(n_i), Ok(k_i)] = [n, k].map(i32::try_from) else {
            return Err(GpuError::Invalid(format!(
                "an FP8 GEMM of {n} x {k} exceeds 32 bits"
            )));
        };
        let unit16 = self.skinny_unit16 && n.div_ceil(32) < 2 * self.num_sms;
        let (f, rows) = if unit16 {
            (&self.skinny16, 16)
        } else {
            (&self.skinny, 32)
        };
        let blocks = n.div_ceil(rows).min(SKINNY_BLOCKS_PER_SM * self.num_sms);
        let mut l = Launch::new(stream);
        l.ptr(wq)
            .ptr(sw)
            .i32(n_i)
            .i32(k_i)
            .ptr(xq)
            .ptr(sx)
            .i32(t as i32)
            .i32(i32::from(accumulate))
            .ptr_mut(y);
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches `kvf_gemm_fp8_skinny(16)(const uchar*, const float*, int, int, const
        // uchar*, const float*, int, int, float*)` in kernels/fp8.cu; it reads `n * k` weight
        // bytes, `n` scales, `t * k` input bytes and `t` scales, and reads or writes `t * n`
        // outputs (all checked above), with k a multiple of 64 and 1 <= t <= 8 (checked).
        // Launched without PDL.
        unsafe { l.launch(f, cfg, false) }.map_err(drv("launching kvf_gemm_fp8_skinny"))
    }

    /// `kvf_qkv_post_fp8`, or `kvf_qkv_post_wide_fp8` when `wide`.
    pub fn qkv_post(&self, wide: bool) -> &CudaFunction {
        if wide {
            &self.qkv_post_wide
        } else {
            &self.qkv_post
        }
    }

    /// The down projection's FP8 input from the gate/up GEMM's `[t, 2 ff]` rows: `s.xq` and
    /// `s.sx` become what [`Fp8Kernels::quantize_rows`] makes of `glu`'s bf16 activations.
    /// `sw` (the gate/up weight's row scales): the rows are the unit-scale GEMM's, and `s.sx`
    /// holds that GEMM's token scales; `None`: the rows are scaled.
    #[allow(clippy::too_many_arguments)] // the activation, the input and its shape, the scales
    pub(super) fn glu_quantize(
        &self,
        stream: &CudaStream,
        glu: Glu,
        gu: &CudaSlice<f32>,
        t: usize,
        ff: usize,
        sw: Option<&CudaSlice<f32>>,
        s: &mut Fp8Scratch,
    ) -> Result<(), GpuError> {
        if t == 0 || ff == 0 {
            return Ok(());
        }
        Self::check_fits("activation", ff)?;
        need("gate/up", gu, t * 2 * ff)?;
        need("FP8 quantize output", &s.xq, t * ff)?;
        need("FP8 row scales", &s.sx, t)?;
        let f = match glu {
            Glu::Silu => &self.silu_quantize,
            Glu::GeluTanh => &self.gelu_tanh_quantize,
        };
        let mut l = Launch::new(stream);
        l.ptr(gu).i32(ff as i32);
        match sw {
            Some(sw) => {
                need("FP8 gate/up weight scales", sw, 2 * ff)?;
                l.ptr(sw)
            }
            None => l.addr(0),
        };
        l.ptr_mut(&mut s.xq).ptr_mut(&mut s.sx);
        // SAFETY: matches `kvf_silu_quantize_fp8` / `kvf_gelu_tanh_quantize_fp8(const float*,
        // int, const float*, uchar*, float*)`; block r reads row r of `gu` (2 ff f32), `2 ff`
        // of `sw` when given and `sx[r]`, and writes `ff` bytes at `r * ff` and `sx[r]` (sizes
        // checked above); its 2 ff bytes of shared memory are within the limit `load` raised.
        // It waits for the previous kernel first (PDL).
        unsafe { l.launch(f, rows_cfg(t, THREADS, 2 * ff), self.pdl) }
            .map_err(drv("launching kvf_silu_quantize_fp8"))
    }

    /// The fused norms' checks of their rows, weight and outputs; `false`: no rows, nothing
    /// to launch.
    fn norm_rows(
        x: &CudaSlice<f32>,
        rows: usize,
        d: usize,
        norm: Norm<'_>,
        s: &Fp8Scratch,
    ) -> Result<bool, GpuError> {
        if rows == 0 {
            return Ok(false);
        }
        Self::check_fits("norm", d)?;
        need("norm input", x, rows * d)?;
        need("norm weight", norm.w, d)?;
        need("FP8 quantize output", &s.xq, rows * d)?;
        need("FP8 row scales", &s.sx, rows)?;
        Ok(true)
    }

    /// RMSNorm of `rows` f32 rows of width `d` straight into an FP8 GEMM's input: `s.xq` and
    /// `s.sx` become what [`Fp8Kernels::quantize_rows`] makes of `kvf_rms_norm`'s bf16 rows.
    pub(super) fn rms_norm_quantize(
        &self,
        stream: &CudaStream,
        x: &CudaSlice<f32>,
        rows: usize,
        d: usize,
        norm: Norm<'_>,
        s: &mut Fp8Scratch,
    ) -> Result<(), GpuError> {
        if !Self::norm_rows(x, rows, d, norm, s)? {
            return Ok(());
        }
        let mut l = Launch::new(stream);
        l.ptr(x)
            .ptr(norm.w)
            .i32(d as i32)
            .f32(norm.eps)
            .ptr_mut(&mut s.xq)
            .ptr_mut(&mut s.sx);
        // SAFETY: matches `kvf_rms_norm_fp8(const float*, const float*, int, float, uchar*,
        // float*)`; block r reads row r of `x` and `d` weights, writes `d` bytes at `r * d` and
        // one scale (sizes checked above); NORM_THREADS is a multiple of 32, and its `2 d` bytes
        // of shared memory are within the limit `load` raised. It waits for the previous kernel
        // first (PDL).
        unsafe { l.launch(&self.norm_quantize, rows_cfg(rows, NORM_THREADS, 2 * d), self.pdl) }
            .map_err(drv("launching kvf_rms_norm_fp8"))
    }

    /// The residual add of a unit-scale FP8 GEMM (`s.d`, `[rows, d]`, unscaled, its token
    /// scales in `s.sx` and the weight's row scales `sw`) into `x`, then
    /// [`Fp8Kernels::rms_norm_quantize`] of the new rows: bit-equal to [`Fp8Kernels::scale`]
    /// adding `s.d` to `x` followed by that norm.
    #[allow(clippy::too_many_arguments)] // the residual and its shape, the scales, the norm
    pub(super) fn add_rms_norm_quantize(
        &self,
        stream: &CudaStream,
        sw: &CudaSlice<f32>,
        x: &mut CudaSlice<f32>,
        rows: usize,
        d: usize,
        norm: Norm<'_>,
        s: &mut Fp8Scratch,
    ) -> Result<(), GpuError> {
        if !Self::norm_rows(x, rows, d, norm, s)? {
            return Ok(());
        }
        need("FP8 GEMM result", &s.d, rows * d)?;
        need("FP8 weight scales", sw, d)?;
        let mut l = Launch::new(stream);
        l.ptr(&s.d)
            .ptr(sw)
            .ptr_mut(x)
            .ptr(norm.w)
            .i32(d as i32)
            .f32(norm.eps)
            .ptr_mut(&mut s.xq)
            .ptr_mut(&mut s.sx);
        // SAFETY: matches `kvf_add_rms_norm_fp8(const float*, const float*, float*, const
        // float*, int, float, uchar*, float*)`; block r reads row r of `s.d`, `d` row scales and
        // `d` norm weights, reads and writes row r of `x`, reads then writes `s.sx[r]` and
        // writes `d` bytes at `r * d` of `s.xq` (sizes checked above; `s.d`, `x` and `s.xq` are
        // distinct buffers); NORM_THREADS is a multiple of 32, and its `2 d` bytes of shared
        // memory are within the limit `load` raised. It waits for the previous kernel first
        // (PDL).
        unsafe {
            l.launch(
                &self.add_norm_quantize,
                rows_cfg(rows, NORM_THREADS, 2 * d),
                self.pdl,
            )
        }
        .map_err(drv("launching kvf_add_rms_norm_fp8"))
    }

    /// `q[r] = e4m3(x[r] / s[r])`, `s[r] = amax(x[r]) / 448` for `rows` bf16 rows of `k`
    /// elements, `ld` apart in `x`; `q` dense `[rows, k]`.
    #[allow(clippy::too_many_arguments)] // the stream, the input and its shape, two outputs
    pub fn quantize_rows(
        &self,
        stream: &CudaStream,
        x: &CudaSlice<u16>,
        rows: usize,
        k: usize,
        ld: usize,
        q: &mut CudaSlice<u8>,
        s: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        if rows == 0 {
            return Ok(());
        }
        if ld < k {
            return Err(GpuError::Invalid(format!("rows of {k} elements {ld} apart")));
        }
        need("FP8 quantize input", x, (rows - 1) * ld + k)?;
        need("FP8 quantize output", q, rows * k)?;
        need("FP8 row scales", s, rows)?;
        let [Ok(k_i), Ok(ld_i)] = [k, ld].map(i32::try_from) else {
            return Err(GpuError::Invalid(format!(
                "FP8 rows of {k} elements exceed 32 bits"
            )));
        };
        let mut l = Launch::new(stream);
        l.ptr(x).i32(k_i).i32(ld_i).ptr_mut(q).ptr_mut(s);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches `kvf_quantize_rows_fp8(const bf16*, int, int, uchar*, float*)` in
        // kernels/fp8.cu; one block a row reads `k` elements at `r * ld` (within `x`, checked)
        // and writes `k` bytes at `r * k` and one scale (checked). Launched without PDL.
        unsafe { l.launch(&self.quantize, cfg, false) }.map_err(drv("launching kvf_quantize_rows_fp8"))
    }

    /// `y = d * sx[r] * sw[c]` (or `+=` when `add`) over `[t, n]`; `d` `None`: `y` holds `d`.
    #[allow(clippy::too_many_arguments)] // the stream and the kernel's seven parameters
    pub fn scale(
        &self,
        stream: &CudaStream,
        d: Option<&CudaSlice<f32>>,
        t: usize,
        n: usize,
        sx: &CudaSlice<f32>,
        sw: &CudaSlice<f32>,
        add: bool,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        need("FP8 token scales", sx, t)?;
        need("FP8 weight scales", sw, n)?;
        need("FP8 GEMM output", y, t * n)?;
        if t == 0 || n == 0 {
            return Ok(());
        }
        if t > 65_535 {
            return Err(GpuError::Invalid(format!(
                "an FP8 epilogue over {t} rows (at most 65,535)"
            )));
        }
        let mut l = Launch::new(stream);
        match d {
            Some(d) => {
                need("FP8 GEMM result", d, t * n)?;
                l.ptr(d)
            }
            None => l.addr(0),
        };
        l.i32(t as i32)
            .i32(n as i32)
            .ptr(sx)
            .ptr(sw)
            .i32(i32::from(add))
            .ptr_mut(y);
        let cfg = LaunchConfig {
            grid_dim: (
                n.div_ceil(THREADS as usize).clamp(1, SCALE_ROW_BLOCKS) as u32,
                t as u32,
                1,
            ),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches `kvf_fp8_scale(const float*, int, int, const float*, const float*,
        // int, float*)`; block row `r < t` touches the `n` elements of row `r` of `d` (or `y`)
        // and `y`, `sx[r]` and `n` of `sw`, all checked above (t < 65,536 grid rows and n < 2^31:
        // a step's checked shapes). Launched without PDL.
        unsafe { l.launch(&self.scale, cfg, false) }.map_err(drv("launching kvf_fp8_scale"))
    }
}

/// The FP8 GEMM's buffers: the input rows quantized, their scales, and the f32 result of a GEMM
/// whose output is added to the residual (its scales must be applied before the add).
pub(super) struct Fp8Scratch {
    pub xq: CudaSlice<u8>,
    pub sx: CudaSlice<f32>,
    pub d: CudaSlice<f32>,
}

impl Fp8Scratch {
    pub fn alloc(s: &Arc<CudaStream>, t: usize, k: usize, n: usize) -> Result<Self, GpuError> {
        let what = "allocating FP8 activations";
        let (t, k, n) = (t.max(1), k.max(1), n.max(1));
        Ok(Fp8Scratch {
            xq: s.alloc_zeros::<u8>(t * k).map_err(drv(what))?,
            sx: s.alloc_zeros::<f32>(t).map_err(drv(what))?,
            d: s.alloc_zeros::<f32>(t * n).map_err(drv(what))?,
        })
    }

    /// One-element buffers: a model without FP8 weights.
    pub fn none(s: &Arc<CudaStream>) -> Result<Self, GpuError> {
        Self::alloc(s, 1, 1, 1)
    }
}

#[cfg(test)]
mod tests;
