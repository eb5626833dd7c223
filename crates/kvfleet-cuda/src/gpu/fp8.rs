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

/// The most tokens `kvf_gemm_fp8_skinny` takes: B's 8 columns of `mma.m16n8k32`.
pub(crate) const SKINNY_MAX: usize = 8;
/// Blocks an SM of `kvf_gemm_fp8_skinny`'s grid at most (its blocks then take several units).
const SKINNY_BLOCKS_PER_SM: usize = 4;

/// `KVFLEET_FP8_SKINNY`: the most tokens a step may have for its FP8 GEMMs to run on
/// `kvf_gemm_fp8_skinny` (0 or `off`: never; above [`SKINNY_MAX`]: that); unset: [`SKINNY_MAX`].
fn skinny_max_from_env() -> usize {
    parse_skinny(std::env::var("KVFLEET_FP8_SKINNY").ok().as_deref())
}

fn parse_skinny(v: Option<&str>) -> usize {
    match v.map(str::trim) {
        None | Some("") => SKINNY_MAX,
        Some("off") => 0,
        Some(w) => match w.parse::<usize>() {
            Ok(n) => n.min(SKINNY_MAX),
            Err(_) => {
                tracing::warn!(
                    value = w,
                    "KVFLEET_FP8_SKINNY: not a token count or `off`; the default kept"
                );
                SKINNY_MAX
            }
        },
    }
}

/// Which neighbours of the FP8 GEMMs take over the input quantization and the unit-scale
/// epilogue at steps of more than one token (bench/RESULTS.md, 2026-11-28, measures each).
/// `KVFLEET_FP8_FUSE`: `all` (the default), `none`, or a comma-separated list of `norm`, `glu`,
/// `qkv`, `add`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Fusion {
    /// RMSNorm writes the QKV and gate/up GEMMs' e4m3 rows and scales (`kvf_rms_norm_fp8`).
    pub norm: bool,
    /// The gate/up rows' scales, SwiGLU and the down projection's quantization in one kernel
    /// (`kvf_silu_quantize_fp8`).
    pub glu: bool,
    /// The Q/K/V split applies the QKV GEMM's scales as it reads (`kvf_qkv_post(_wide)_fp8`).
    pub qkv: bool,
    /// The O and down projections' unit-scale residual add is done by the RMSNorm after them
    /// (`kvf_add_rms_norm_fp8`; with `norm` only, and where no layer's features are kept).
    pub add: bool,
}

impl Fusion {
    pub const ALL: Fusion = Fusion {
        norm: true,
        glu: true,
        qkv: true,
        add: true,
    };
    pub const NONE: Fusion = Fusion {
        norm: false,
        glu: false,
        qkv: false,
        add: false,
    };

    /// From `KVFLEET_FP8_FUSE`; an unknown word is ignored with a warning.
    pub fn from_env() -> Self {
        match std::env::var("KVFLEET_FP8_FUSE") {
            Ok(v) => Self::parse(&v),
            Err(_) => Self::ALL,
        }
    }

    fn parse(v: &str) -> Self {
        match v.trim() {
            "" | "all" => return Self::ALL,
            "none" => return Self::NONE,
            _ => {}
        }
        let mut f = Self::NONE;
        for w in v.split(',').map(str::trim) {
            match w {
                "norm" => f.norm = true,
                "glu" => f.glu = true,
                "qkv" => f.qkv = true,
                "add" => f.add = true,
                other => tracing::warn!(
                    word = other,
                    "KVFLEET_FP8_FUSE: not norm, glu, qkv or add; ignored"
                ),
            }
        }
        f
    }
}

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
    /// cuBLASLt (0: never): `KVFLEET_FP8_SKINNY`, at most and by default [`SKINNY_MAX`].
    skinny_max: usize,
    /// The device's SMs (the skinny GEMM's grid cap).
    num_sms: usize,
    /// Units of 16 rows (`kvf_gemm_fp8_skinny16`) where units of 32 leave under two blocks an
    /// SM; `KVFLEET_FP8_SKINNY_UNIT=32` keeps 32 everywhere (to time it).
    skinny_unit16: bool,
    /// Launch the fused kernels with programmatic dependent launch (sm_90 and later).
    pdl: bool,
}

impl Fp8Kernels {
    pub fn load(
        module: &Arc<CudaModule>,
        num_sms: usize,
        pdl: bool,
        fusion: Fusion,
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
            skinny_unit16: std::env::var("KVFLEET_FP8_SKINNY_UNIT").map_or(true, |v| v.trim() != "32"),
            fusion,
            skinny_max: skinny_max_from_env(),
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
        if rows == 0 {
            return Ok(());
        }
        Self::check_fits("norm", d)?;
        need("norm input", x, rows * d)?;
        need("norm weight", norm.w, d)?;
        need("FP8 quantize output", &s.xq, rows * d)?;
        need("FP8 row scales", &s.sx, rows)?;
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
        if rows == 0 {
            return Ok(());
        }
        Self::check_fits("norm", d)?;
        need("FP8 GEMM result", &s.d, rows * d)?;
        need("FP8 weight scales", sw, d)?;
        need("norm input", x, rows * d)?;
        need("norm weight", norm.w, d)?;
        need("FP8 quantize output", &s.xq, rows * d)?;
        need("FP8 row scales", &s.sx, rows)?;
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
mod tests {
    use half::bf16;
    use kvfleet_engine::model::fp8::{e4m3fn_to_f32, quantize_rows};

    use super::super::blas::{Blas, Gemm};
    use super::super::gemv::{Fp8Gemv, Input, Output};
    use super::super::kernels::{Glu, ModelKernels, Norm};
    use super::super::lt::{Lt, ScalePick};
    use super::*;

    /// Values of every magnitude an activation or weight row has, as bf16 (what the kernels
    /// read), with a few zeros and an outlier a row.
    fn bf16_rows(rows: usize, k: usize, seed: u32) -> Vec<u16> {
        (0..rows * k)
            .map(|i| {
                let x = ((i as f32 + seed as f32) * 0.618_034).sin();
                let v = match i % 97 {
                    0 => 0.0,
                    1 => x * 40.0,
                    _ => x * (1.0 + (i % 13) as f32) * 0.01,
                };
                bf16::from_f32(v).to_bits()
            })
            .collect()
    }

    /// The host's products `xd[r] · wd[c]` (rows of `kk`) at `picks`, and their largest magnitude.
    fn dequantized_products(xd: &[f32], wd: &[f32], kk: usize, picks: &[(usize, usize)]) -> (Vec<f32>, f32) {
        let want: Vec<f32> = picks
            .iter()
            .map(|&(r, c)| {
                xd[r * kk..(r + 1) * kk]
                    .iter()
                    .zip(&wd[c * kk..(c + 1) * kk])
                    .map(|(a, b)| a * b)
                    .sum()
            })
            .collect();
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        (want, scale)
    }

    fn to_f32(v: &[u16]) -> Vec<f32> {
        v.iter().map(|b| bf16::from_bits(*b).to_f32()).collect()
    }

    fn gpu() -> Gpu {
        let g = Gpu::open(0).unwrap_or_else(|e| panic!("no GPU: {e}"));
        check_device(&g).unwrap_or_else(|e| panic!("{e}"));
        g
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU of compute capability 8.9 or later"]
    fn gpu_quantize_kernel_matches_the_host_quantizer_byte_for_byte() {
        let g = gpu();
        let k = ModelKernels::load(&g, true).unwrap();
        let f = k.fp8.as_ref().unwrap();
        let (rows, cols, ld) = (37, 1000, 1008);
        let x = bf16_rows(rows, ld, 3);
        let dx = g.upload(&x).unwrap();
        let s = g.stream();
        let mut q = s.alloc_zeros::<u8>(rows * cols).unwrap();
        let mut sc = s.alloc_zeros::<f32>(rows).unwrap();
        f.quantize_rows(s, &dx, rows, cols, ld, &mut q, &mut sc).unwrap();
        let (q, sc) = (g.download(&q).unwrap(), g.download(&sc).unwrap());
        let xf = to_f32(&x);
        let dense: Vec<f32> = (0..rows)
            .flat_map(|r| xf[r * ld..r * ld + cols].to_vec())
            .collect();
        let want = quantize_rows(&dense, rows, cols);
        assert_eq!(sc, want.scale, "row scales");
        let diff = q.iter().zip(&want.data).filter(|(a, b)| a != b).count();
        assert_eq!(diff, 0, "{diff} of {} bytes differ", q.len());
    }

    #[test]
    fn the_fusion_switch_reads_all_none_and_lists_of_names() {
        assert_eq!(Fusion::parse(""), Fusion::ALL);
        assert_eq!(Fusion::parse("all"), Fusion::ALL);
        assert_eq!(Fusion::parse("none"), Fusion::NONE);
        let only = |norm, glu, qkv, add| Fusion { norm, glu, qkv, add };
        assert_eq!(Fusion::parse("glu, qkv"), only(false, true, true, false));
        assert_eq!(Fusion::parse("norm,add"), only(true, false, false, true));
        // An unknown word is ignored, not taken for `all`.
        assert_eq!(Fusion::parse("norm,bogus"), only(true, false, false, false));
    }

    /// Positive scales spread over two orders of magnitude, as weight and token scales are.
    fn scales(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| 1e-3 * (1.0 + 99.0 * (((i as f32 + seed as f32) * 0.754_877).sin() * 0.5 + 0.5)))
            .collect()
    }

    /// The fused gate/up epilogue, SwiGLU and quantization write the same bytes and scales as
    /// the unfused path (`kvf_fp8_scale`, `kvf_silu_mul`, `kvf_quantize_rows_fp8`), on unscaled
    /// rows with the weight's scales and on rows already scaled; and what they write is the
    /// host's quantization of the activation within e4m3 and bf16 rounding.
    #[test]
    #[ignore = "needs an NVIDIA GPU of compute capability 8.9 or later"]
    fn gpu_fused_glu_quantize_equals_the_unfused_path_bit_for_bit() {
        let g = gpu();
        let k = ModelKernels::load(&g, true).unwrap();
        let f = k.fp8.as_ref().unwrap();
        let s = g.stream();
        // 1,024: the 16-byte path; 1,000 and 1,002: rows of other alignments take the scalar one.
        for (glu, ff) in [
            (Glu::Silu, 1024),
            (Glu::Silu, 1000),
            (Glu::Silu, 1002),
            (Glu::GeluTanh, 1024),
        ] {
            let t = 9;
            // Unscaled GEMM outputs: large values, as e4m3 products summed over k are.
            let gu: Vec<f32> = to_f32(&bf16_rows(t, 2 * ff, 7 + ff as u32))
                .iter()
                .map(|v| v * 3000.0)
                .collect();
            let (sx, sw) = (scales(t, 1), scales(2 * ff, 2));
            let dgu = g.upload(&gu).unwrap();
            let (dsx, dsw) = (g.upload(&sx).unwrap(), g.upload(&sw).unwrap());
            // Unfused: scale in place, SwiGLU to bf16, quantize.
            let mut scaled = g.upload(&gu).unwrap();
            f.scale(s, None, t, 2 * ff, &dsx, &dsw, false, &mut scaled)
                .unwrap();
            let mut act = s.alloc_zeros::<u16>(t * ff).unwrap();
            k.glu(glu, &scaled, t, ff, &mut act).unwrap();
            let mut want = Fp8Scratch::alloc(s, t, ff, 1).unwrap();
            f.quantize_rows(s, &act, t, ff, ff, &mut want.xq, &mut want.sx)
                .unwrap();
            let (wq, ws) = (g.download(&want.xq).unwrap(), g.download(&want.sx).unwrap());
            // Fused, from the unscaled rows (the token scales in the scratch, as the gate/up
            // GEMM leaves them) and from the scaled ones.
            for unscaled in [true, false] {
                let mut got = Fp8Scratch::alloc(s, t, ff, 1).unwrap();
                got.xq = g.upload(&vec![0x5au8; t * ff]).unwrap();
                got.sx = g.upload(&sx).unwrap();
                let (rows, sw) = if unscaled {
                    (&dgu, Some(&dsw))
                } else {
                    (&scaled, None)
                };
                f.glu_quantize(s, glu, rows, t, ff, sw, &mut got).unwrap();
                let (q, sc) = (g.download(&got.xq).unwrap(), g.download(&got.sx).unwrap());
                assert_eq!(sc, ws, "{glu:?} ff {ff}, unscaled {unscaled}: row scales");
                let diff = q.iter().zip(&wq).filter(|(a, b)| a != b).count();
                assert_eq!(
                    diff,
                    0,
                    "{glu:?} ff {ff}, unscaled {unscaled}: {diff} of {} bytes differ",
                    q.len()
                );
            }
            // Against the host: f(gate) * up from the scaled rows, in f32.
            let act_of = |x: f32| match glu {
                Glu::Silu => x / (1.0 + (-x).exp()),
                Glu::GeluTanh => 0.5 * x * (1.0 + (0.797_884_6 * (x + 0.044_715 * x * x * x)).tanh()),
            };
            let sc = g.download(&scaled).unwrap();
            for r in 0..t {
                let row = &sc[r * 2 * ff..(r + 1) * 2 * ff];
                let a: Vec<f32> = (0..ff).map(|i| act_of(row[i]) * row[ff + i]).collect();
                let amax = a.iter().fold(0f32, |m, v| m.max(v.abs()));
                // The row scale comes from the bf16-rounded activations: within 2^-8 of amax / 448.
                assert!(
                    (ws[r] - amax / 448.0).abs() <= ws[r] / 256.0,
                    "row {r}: scale {} vs {}",
                    ws[r],
                    amax / 448.0
                );
                for (i, v) in a.iter().enumerate() {
                    let deq = e4m3fn_to_f32(wq[r * ff + i]) * ws[r];
                    // e4m3: half a step is 2^-4 of the value (normals), 2^-10 of the scale
                    // (subnormals); bf16 first: 2^-8 more.
                    let bound = v.abs() * (1.0 / 16.0 + 1.0 / 256.0) + ws[r] / 1024.0 + 1e-12;
                    assert!(
                        (deq - v).abs() <= bound,
                        "{glu:?} ff {ff} row {r}[{i}]: {deq} vs {v}"
                    );
                }
            }
        }
    }

    /// RMSNorm straight into e4m3 rows writes what `kvf_rms_norm` then `kvf_quantize_rows_fp8`
    /// write, for rows that fit the norm's registers (4,096) and rows that do not (5,008).
    #[test]
    #[ignore = "needs an NVIDIA GPU of compute capability 8.9 or later"]
    fn gpu_fused_norm_quantize_equals_norm_then_quantize() {
        let g = gpu();
        let k = ModelKernels::load(&g, true).unwrap();
        let f = k.fp8.as_ref().unwrap();
        let s = g.stream();
        for d in [4096, 5008] {
            let t = 6;
            let x: Vec<f32> = to_f32(&bf16_rows(t, d, 13)).iter().map(|v| v * 5.0).collect();
            let w: Vec<f32> = (0..d).map(|i| 0.5 + (i % 11) as f32 * 0.1).collect();
            let (dx, dw) = (g.upload(&x).unwrap(), g.upload(&w).unwrap());
            let norm = Norm::new(&dw, 1e-5);
            let mut h = s.alloc_zeros::<u16>(t * d).unwrap();
            k.rms_norm(&dx, t, d, norm, &mut h).unwrap();
            let mut want = Fp8Scratch::alloc(s, t, d, 1).unwrap();
            f.quantize_rows(s, &h, t, d, d, &mut want.xq, &mut want.sx)
                .unwrap();
            let mut got = Fp8Scratch::alloc(s, t, d, 1).unwrap();
            f.rms_norm_quantize(s, &dx, t, d, norm, &mut got).unwrap();
            assert_eq!(
                g.download(&got.sx).unwrap(),
                g.download(&want.sx).unwrap(),
                "d {d}: scales"
            );
            let (q, wq) = (g.download(&got.xq).unwrap(), g.download(&want.xq).unwrap());
            let diff = q.iter().zip(&wq).filter(|(a, b)| a != b).count();
            assert_eq!(diff, 0, "d {d}: {diff} of {} bytes differ", q.len());
            // And that is the host's quantization of the bf16 norm.
            let hq = quantize_rows(&to_f32(&g.download(&h).unwrap()), t, d);
            assert_eq!(q, hq.data, "d {d}: against the host quantizer");
        }
    }

    /// The unit-scale GEMM's residual add folded into the next norm writes the residual, the
    /// bytes and the scales that `kvf_fp8_scale` (adding) then `kvf_rms_norm_fp8` write: rows
    /// in registers (d 4,096) and not (5,008).
    #[test]
    #[ignore = "needs an NVIDIA GPU of compute capability 8.9 or later"]
    fn gpu_fused_add_norm_quantize_equals_scale_add_then_norm() {
        let g = gpu();
        let k = ModelKernels::load(&g, true).unwrap();
        let f = k.fp8.as_ref().unwrap();
        let s = g.stream();
        for d in [4096, 5008] {
            let t = 6;
            let x: Vec<f32> = to_f32(&bf16_rows(t, d, 13)).iter().map(|v| v * 5.0).collect();
            // An unscaled GEMM result: integers of e4m3 products' size.
            let prod: Vec<f32> = to_f32(&bf16_rows(t, d, 17)).iter().map(|v| v * 3.0e4).collect();
            let w: Vec<f32> = (0..d).map(|i| 0.5 + (i % 11) as f32 * 0.1).collect();
            let (sx, sw) = (scales(t, 3), scales(d, 7));
            let (dw, dsw) = (g.upload(&w).unwrap(), g.upload(&sw).unwrap());
            let norm = Norm::new(&dw, 1e-5);
            let scratch = |xs: &[f32]| {
                let mut sc = Fp8Scratch::alloc(s, t, d, d).unwrap();
                sc.d = g.upload(&prod).unwrap();
                sc.sx = g.upload(xs).unwrap();
                sc
            };
            let mut want_x = g.upload(&x).unwrap();
            let mut want = scratch(&sx);
            f.scale(s, Some(&want.d), t, d, &want.sx, &dsw, true, &mut want_x)
                .unwrap();
            f.rms_norm_quantize(s, &want_x, t, d, norm, &mut want).unwrap();
            let mut got_x = g.upload(&x).unwrap();
            let mut got = scratch(&sx);
            f.add_rms_norm_quantize(s, &dsw, &mut got_x, t, d, norm, &mut got)
                .unwrap();
            let (xg, xw) = (g.download(&got_x).unwrap(), g.download(&want_x).unwrap());
            let xdiff = xg
                .iter()
                .zip(&xw)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            assert_eq!(xdiff, 0, "d {d}: {xdiff} of {} residual values differ", xw.len());
            assert!(
                xg.iter().zip(&x).any(|(a, b)| a != b),
                "d {d}: the residual did not change"
            );
            assert_eq!(
                g.download(&got.sx).unwrap(),
                g.download(&want.sx).unwrap(),
                "d {d}: scales"
            );
            let (q, wq) = (g.download(&got.xq).unwrap(), g.download(&want.xq).unwrap());
            let diff = q.iter().zip(&wq).filter(|(a, b)| a != b).count();
            assert_eq!(diff, 0, "d {d}: {diff} of {} bytes differ", q.len());
        }
    }

    /// The FP8 GEMM (W8A8: store and accumulate) and the FP8 GEMV (weight-only) against the
    /// same products computed on the host from the dequantized values.
    #[test]
    #[ignore = "needs an NVIDIA GPU of compute capability 8.9 or later"]
    fn gpu_fp8_gemm_and_gemv_equal_the_dequantized_products() {
        for pick in [ScalePick::PerRow, ScalePick::Unit, ScalePick::Timed] {
            fp8_products(pick);
        }
    }

    /// The FP8 GEMM at a width of Llama-3.1-8B (256 tokens x 4096 x 4096, where cuBLASLt 13.1
    /// on an H200 takes per-row scales, unlike the small shapes of the test above) against the
    /// host's products of the dequantized operands, stored and accumulated, with either pick;
    /// 4,096 outputs sampled.
    #[test]
    #[ignore = "needs an NVIDIA GPU of compute capability 8.9 or later"]
    fn gpu_fp8_gemm_at_a_model_width_equals_the_dequantized_products() {
        let g = gpu();
        let k = ModelKernels::load(&g, true).unwrap();
        let (t, n, kk) = (256, 4096, 4096);
        let w = to_f32(&bf16_rows(n, kk, 3));
        let wq = quantize_rows(&w, n, kk);
        let wd = wq.dequantize();
        let mat = Mat::Fp8 {
            q: g.upload(&wq.data).unwrap(),
            scale: g.upload(&wq.scale).unwrap(),
        };
        let x = bf16_rows(t, kk, 9);
        let xd = quantize_rows(&to_f32(&x), t, kk).dequantize();
        let dx = g.upload(&x).unwrap();
        let s = g.stream();
        let picks: Vec<(usize, usize)> = (0..4096usize).map(|i| ((i * 37) % t, (i * 7919) % n)).collect();
        let (want, scale) = dequantized_products(&xd, &wd, kk, &picks);
        for pick in [ScalePick::PerRow, ScalePick::Unit, ScalePick::Timed] {
            let blas = Blas::with_lt(s.clone(), Lt::new(s.clone(), pick).unwrap()).unwrap();
            let mut scratch = Fp8Scratch::alloc(s, t, kk, n).unwrap();
            let mut y = s.alloc_zeros::<f32>(t * n).unwrap();
            blas.project(&k, &mat, &dx, &mut y, Gemm::store(t, n, kk), &mut scratch)
                .unwrap();
            eprintln!(
                "{pick:?}: per-row scales in cuBLASLt: {:?}",
                blas.lt_planned_per_row((t, n, kk))
            );
            let once = g.download(&y).unwrap();
            blas.project(&k, &mat, &dx, &mut y, Gemm::add(t, n, kk), &mut scratch)
                .unwrap();
            let twice = g.download(&y).unwrap();
            for (i, &(r, c)) in picks.iter().enumerate() {
                let (a, b) = (once[r * n + c], twice[r * n + c]);
                // As the test above: 1e-3 of the largest value.
                assert!(
                    (a - want[i]).abs() <= 1e-3 * scale,
                    "{pick:?} store [{r}, {c}]: {a} vs {}",
                    want[i]
                );
                assert!(
                    (b - 2.0 * want[i]).abs() <= 2e-3 * scale,
                    "{pick:?} add [{r}, {c}]: {b} vs {}",
                    2.0 * want[i]
                );
            }
            if pick == ScalePick::Timed {
                // Token counts of one power-of-two bucket share the timed choice: 200 and 129
                // rows plan their own shapes and follow the 256 rows' choice without timing.
                assert_eq!(blas.lt_timed_choices(), 1);
                for tt in [200, 129] {
                    blas.project(&k, &mat, &dx, &mut y, Gemm::store(tt, n, kk), &mut scratch)
                        .unwrap();
                    assert_eq!(
                        blas.lt_planned_per_row((tt, n, kk)),
                        blas.lt_planned_per_row((t, n, kk)),
                        "{tt} rows"
                    );
                    let got = g.download(&y).unwrap();
                    for (i, &(r, c)) in picks.iter().enumerate().filter(|(_, p)| p.0 < tt) {
                        assert!(
                            (got[r * n + c] - want[i]).abs() <= 1e-3 * scale,
                            "{tt} rows [{r}, {c}]: {} vs {}",
                            got[r * n + c],
                            want[i]
                        );
                    }
                }
                assert_eq!(blas.lt_timed_choices(), 1, "one choice for 129..=256 rows");
                // 257 rows are the next bucket: timed anew.
                let x2 = bf16_rows(512, kk, 9);
                let dx2 = g.upload(&x2).unwrap();
                let mut scratch2 = Fp8Scratch::alloc(s, 512, kk, n).unwrap();
                let mut y2 = s.alloc_zeros::<f32>(512 * n).unwrap();
                blas.project(&k, &mat, &dx2, &mut y2, Gemm::store(257, n, kk), &mut scratch2)
                    .unwrap();
                assert_eq!(
                    blas.lt_timed_choices(),
                    2,
                    "257 rows are timed in their own bucket"
                );
            }
        }
    }

    /// `kvf_gemm_fp8_skinny`, the FP8 GEMM of steps of 2 to 8 tokens, against the host's
    /// products of the dequantized operands, stored and accumulated, through the projections
    /// that choose it: every token count from 1 (the kernel called directly) to 8, rows that do
    /// not fill the last unit (113) and k tiles that the 8 warps do not divide (320 = 5 x 64),
    /// then a down projection of Llama-3.1-8B (8 x 4096 x 14336) and gate/up's rows over a short
    /// k (28672 x 128), 4,096 outputs sampled: units of 16 rows in the first two, of 32 in the
    /// last (enough of them for two blocks an SM).
    #[test]
    #[ignore = "needs an NVIDIA GPU of compute capability 8.9 or later"]
    fn gpu_fp8_skinny_gemm_equals_the_dequantized_products() {
        let g = gpu();
        let k = ModelKernels::load(&g, true).unwrap();
        let f = k.fp8.as_ref().unwrap();
        let s = g.stream();
        let blas = Blas::with_lt(s.clone(), Lt::new(s.clone(), ScalePick::Timed).unwrap()).unwrap();
        for (n, kk, sampled) in [
            (113usize, 320usize, false),
            (4096, 14336, true),
            (28672, 128, true),
        ] {
            let w = to_f32(&bf16_rows(n, kk, 13));
            let wq = quantize_rows(&w, n, kk);
            let wd = wq.dequantize();
            let mat = Mat::Fp8 {
                q: g.upload(&wq.data).unwrap(),
                scale: g.upload(&wq.scale).unwrap(),
            };
            let Mat::Fp8 { q, scale: sw } = &mat else {
                unreachable!("an FP8 matrix")
            };
            let tmax = SKINNY_MAX;
            let x = bf16_rows(tmax, kk, 21);
            let xd = quantize_rows(&to_f32(&x), tmax, kk).dequantize();
            let dx = g.upload(&x).unwrap();
            let picks: Vec<(usize, usize)> = if sampled {
                (0..4096usize).map(|i| ((i * 5) % tmax, (i * 7919) % n)).collect()
            } else {
                (0..tmax).flat_map(|r| (0..n).map(move |c| (r, c))).collect()
            };
            let (want, scale) = dequantized_products(&xd, &wd, kk, &picks);
            let mut scratch = Fp8Scratch::alloc(s, tmax, kk, n).unwrap();
            for t in 1..=tmax {
                assert_eq!(f.takes_skinny(t, kk), t >= 2, "{t} tokens");
                let mut y = s.alloc_zeros::<f32>(t * n).unwrap();
                if t == 1 {
                    f.quantize_rows(s, &dx, 1, kk, kk, &mut scratch.xq, &mut scratch.sx)
                        .unwrap();
                    let xs = (&scratch.xq, &scratch.sx);
                    f.gemm_skinny(s, (q, sw), xs, &mut y, (1, n, kk), false).unwrap();
                } else {
                    blas.project(&k, &mat, &dx, &mut y, Gemm::store(t, n, kk), &mut scratch)
                        .unwrap();
                }
                let once = g.download(&y).unwrap();
                if t == 1 {
                    let xs = (&scratch.xq, &scratch.sx);
                    f.gemm_skinny(s, (q, sw), xs, &mut y, (1, n, kk), true).unwrap();
                } else {
                    blas.project(&k, &mat, &dx, &mut y, Gemm::add(t, n, kk), &mut scratch)
                        .unwrap();
                }
                let twice = g.download(&y).unwrap();
                // None of them went to cuBLASLt.
                assert_eq!(blas.lt_planned_per_row((t, n, kk)), None, "{t} tokens");
                for (i, &(r, c)) in picks.iter().enumerate().filter(|(_, p)| p.0 < t) {
                    let (a, b) = (once[r * n + c], twice[r * n + c]);
                    assert!(
                        (a - want[i]).abs() <= 1e-3 * scale,
                        "{t} x {n} x {kk} store [{r}, {c}]: {a} vs {}",
                        want[i]
                    );
                    assert!(
                        (b - 2.0 * want[i]).abs() <= 2e-3 * scale,
                        "{t} x {n} x {kk} add [{r}, {c}]: {b} vs {}",
                        2.0 * want[i]
                    );
                }
            }
        }
        // Shapes it does not take are refused with their reason, and the switch reads its values.
        let x = s.alloc_zeros::<u8>(9 * 64).unwrap();
        let sx = s.alloc_zeros::<f32>(9).unwrap();
        let w = s.alloc_zeros::<u8>(32 * 64).unwrap();
        let sw = s.alloc_zeros::<f32>(32).unwrap();
        let mut y = s.alloc_zeros::<f32>(9 * 32).unwrap();
        let e = f
            .gemm_skinny(s, (&w, &sw), (&x, &sx), &mut y, (9, 32, 64), false)
            .unwrap_err();
        assert!(e.to_string().contains("9 tokens"), "{e}");
        assert!(f
            .gemm_skinny(s, (&w, &sw), (&x, &sx), &mut y, (2, 32, 48), false)
            .is_err());
    }

    #[test]
    fn the_skinny_switch_reads_token_counts_and_off() {
        assert_eq!(parse_skinny(None), SKINNY_MAX);
        assert_eq!(parse_skinny(Some("off")), 0);
        assert_eq!(parse_skinny(Some("0")), 0);
        assert_eq!(parse_skinny(Some(" 4 ")), 4);
        assert_eq!(parse_skinny(Some("64")), SKINNY_MAX);
        assert_eq!(parse_skinny(Some("many")), SKINNY_MAX);
    }

    fn fp8_products(pick: ScalePick) {
        let g = gpu();
        let k = ModelKernels::load(&g, true).unwrap();
        let blas = Blas::with_lt(g.stream().clone(), Lt::new(g.stream().clone(), pick).unwrap()).unwrap();
        // 12 tokens: past the skinny GEMM's 8, so the GEMMs here are cuBLASLt's.
        let (t, n, kk) = (12, 96, 256);
        let w = to_f32(&bf16_rows(n, kk, 11));
        let wq = quantize_rows(&w, n, kk);
        let mat = Mat::Fp8 {
            q: g.upload(&wq.data).unwrap(),
            scale: g.upload(&wq.scale).unwrap(),
        };
        let wd = wq.dequantize();
        let x = bf16_rows(t, kk, 5);
        let xf = to_f32(&x);
        let xd = quantize_rows(&xf, t, kk).dequantize();
        let dx = g.upload(&x).unwrap();
        let s = g.stream();
        let mut scratch = Fp8Scratch::alloc(s, t, kk, n).unwrap();
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(p, q)| p * q).sum::<f32>();
        // Hopper's FP8 tensor cores accumulate with fewer than f32's 24 bits (about 1.6e-4 of
        // the largest value measured on an H200): 1e-3 of it.
        const TOL: f32 = 1e-3;
        // The f16 GEMV rounds each of the 8 partial sums of a half2 lane over a 16-weight chunk
        // to f16 (2^-11 of the partial, about 4.9e-4; the products and the staged input are
        // exact); an emulation of its arithmetic on these rows erred by 6e-5 of the largest
        // value at most: 2e-3 of it.
        const TOL_H2: f32 = 2e-3;
        let close = |got: &[f32], want: &[f32], tol: f32, what: &str| {
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (i, (a, b)) in got.iter().zip(want).enumerate() {
                assert!((a - b).abs() <= tol * scale + 1e-6, "{what}[{i}]: {a} vs {b}");
            }
        };
        // W8A8 GEMM, stored.
        let mut y = s.alloc_zeros::<f32>(t * n).unwrap();
        blas.project(&k, &mat, &dx, &mut y, Gemm::store(t, n, kk), &mut scratch)
            .unwrap();
        let want: Vec<f32> = (0..t)
            .flat_map(|r| (0..n).map(move |c| (r, c)))
            .map(|(r, c)| dot(&xd[r * kk..(r + 1) * kk], &wd[c * kk..(c + 1) * kk]))
            .collect();
        eprintln!(
            "{pick:?}: per-row scales in cuBLASLt: {:?}",
            blas.lt_planned_per_row((t, n, kk))
        );
        close(&g.download(&y).unwrap(), &want, TOL, "GEMM store");
        // Accumulated onto what is there.
        blas.project(&k, &mat, &dx, &mut y, Gemm::add(t, n, kk), &mut scratch)
            .unwrap();
        let twice: Vec<f32> = want.iter().map(|v| 2.0 * v).collect();
        close(&g.download(&y).unwrap(), &twice, TOL, "GEMM add");
        // The one-token GEMVs: on CUDA cores the bf16 input unquantized (f16 for `H2`, exact for
        // these values); on the tensor cores quantized per token (the first row of `xd`),
        // stored, added and through SwiGLU.
        let x0 = g.upload(&x[..kk]).unwrap();
        // And through the fused RMSNorm of an f32 row: the reference input is what
        // `kvf_rms_norm` writes (the GEMVs normalise with the same code and block size).
        let (xr, eps) = (g.upload(&xf[..kk]).unwrap(), 1e-5);
        let nw = g
            .upload(&(0..kk).map(|i| 0.5 + (i % 7) as f32 * 0.25).collect::<Vec<f32>>())
            .unwrap();
        let mut normed = s.alloc_zeros::<u16>(kk).unwrap();
        k.rms_norm(&xr, 1, kk, Norm::new(&nw, eps), &mut normed).unwrap();
        let xn = to_f32(&g.download(&normed).unwrap());
        let xnq = quantize_rows(&xn, 1, kk).dequantize();
        for v in [Fp8Gemv::Cvt, Fp8Gemv::Int, Fp8Gemv::H2, Fp8Gemv::Mma] {
            let tol = if v == Fp8Gemv::H2 { TOL_H2 } else { TOL };
            let kv = ModelKernels::load_with(&g, Some(v)).unwrap();
            let x_ref = if v == Fp8Gemv::Mma { &xd[..kk] } else { &xf[..kk] };
            let want1: Vec<f32> = (0..n).map(|c| dot(x_ref, &wd[c * kk..(c + 1) * kk])).collect();
            let mut y1 = s.alloc_zeros::<f32>(n).unwrap();
            kv.gemv
                .run(&mat, n, kk, Input::Bf16(&x0), Output::Store(&mut y1))
                .unwrap();
            close(&g.download(&y1).unwrap(), &want1, tol, &format!("GEMV {v:?}"));
            kv.gemv
                .run(&mat, n, kk, Input::Bf16(&x0), Output::Add(&mut y1))
                .unwrap();
            let twice: Vec<f32> = want1.iter().map(|v| 2.0 * v).collect();
            close(&g.download(&y1).unwrap(), &twice, tol, &format!("GEMV {v:?} add"));
            // Inputs past f16's range at 2^16 times the values: `H2` stages them scaled, `Cvt`
            // and `Int` take them as they are (`Mma` quantizes its input, so scale drops out).
            if v != Fp8Gemv::Mma {
                let x_big: Vec<u16> = xf[..kk]
                    .iter()
                    .map(|v| bf16::from_f32(v * 65536.0).to_bits())
                    .collect();
                let xb_big = g.upload(&x_big).unwrap();
                kv.gemv
                    .run(&mat, n, kk, Input::Bf16(&xb_big), Output::Store(&mut y1))
                    .unwrap();
                let big: Vec<f32> = want1.iter().map(|v| 65536.0 * v).collect();
                close(
                    &g.download(&y1).unwrap(),
                    &big,
                    tol,
                    &format!("GEMV {v:?} past f16"),
                );
            }
            let xn_ref = if v == Fp8Gemv::Mma { &xnq } else { &xn };
            let want_n: Vec<f32> = (0..n).map(|c| dot(xn_ref, &wd[c * kk..(c + 1) * kk])).collect();
            let mut yn = s.alloc_zeros::<f32>(n).unwrap();
            kv.gemv
                .run(&mat, n, kk, Input::normed(&xr, &nw, eps), Output::Store(&mut yn))
                .unwrap();
            close(
                &g.download(&yn).unwrap(),
                &want_n,
                tol,
                &format!("GEMV {v:?} normed"),
            );
            let mut act = s.alloc_zeros::<u16>(n / 2).unwrap();
            kv.gemv
                .run(&mat, n, kk, Input::Bf16(&x0), Output::SwiGlu(&mut act))
                .unwrap();
            let got: Vec<f32> = to_f32(&g.download(&act).unwrap());
            let want: Vec<f32> = (0..n / 2)
                .map(|j| {
                    let (a, b) = (want1[j], want1[n / 2 + j]);
                    a / (1.0 + (-a).exp()) * b
                })
                .collect();
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                // bf16 output: 2^-8 of the value.
                assert!(
                    (a - b).abs() <= 4e-3 * b.abs() + tol * scale,
                    "GEMV {v:?} SwiGLU[{i}]: {a} vs {b}"
                );
            }
        }
        // Every code the quantizer produced decodes to a finite value (no NaN code written).
        assert!(wq.data.iter().all(|b| e4m3fn_to_f32(*b).is_finite()));
    }
}
