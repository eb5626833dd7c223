//! The kernels of the forward pass besides GEMMs and attention (`kernels/model.cu`, with
//! `sampling.cu` and `gemv.cu` in the same NVRTC program): the program, its PTX cache, and one
//! launcher per kernel. The sampling kernels' launchers are in [`super::sampling`] with the
//! words they read, the GEMV's in [`super::gemv`].
//!
//! Every launcher checks the sizes of the buffers it hands the kernel before its `unsafe`
//! launch (with the `// SAFETY:` that says why it holds), on the GPU's one stream.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use kvfleet_engine::model::llama::LlamaConfig;

use crate::device::Gpu;
use crate::launch::{self, Launch};
use crate::spec::Arch;
use crate::{nvrtc, CudaError};

use super::error::{drv, need, GpuError};
use super::fp8::Fp8Kernels;
use super::gemv::Gemv;
use super::options::GpuTuning;
pub(super) use super::rows::{rows_cfg, Glu, Norm, NORM_THREADS};
use super::shape::Dims;

/// The files of the model program, in order: the one list both programs start with.
macro_rules! model_files {
    () => {
        concat!(
            include_str!("../../../../kernels/model.cu"),
            "\n",
            include_str!("../../../../kernels/sampling.cu"),
            "\n",
            include_str!("../../../../kernels/gemv.cu")
        )
    };
}

/// The kernels of the forward pass (everything but GEMMs and attention).
/// `kernels/sampling.cu` and `kernels/gemv.cu` follow `kernels/model.cu` in one program (they use
/// its helpers).
pub const MODEL_SOURCE: &str = model_files!();

/// Entry points of [`MODEL_SOURCE`].
pub const MODEL_KERNELS: [&str; 15] = [
    "kvf_embed",
    "kvf_rms_norm",
    "kvf_rms_norm_rows",
    "kvf_gather_aux",
    "kvf_qkv_post",
    "kvf_qkv_post_wide",
    "kvf_silu_mul",
    "kvf_fill_uniform",
    "kvf_argmax_rows",
    "kvf_pick_rows",
    "kvf_adjust_rows",
    "kvf_embed_scaled",
    "kvf_rms_norm_add",
    "kvf_gelu_tanh_mul",
    "kvf_gemv",
];

/// PTX of [`MODEL_SOURCE`] for `arch`, compiled once per process and architecture.
pub fn model_ptx(arch: Arch) -> Result<Arc<str>, CudaError> {
    cached_ptx("model", MODEL_SOURCE, arch)
}

/// PTX of [`FP8_SOURCE`] for `arch` (models with FP8 weights), compiled once per process and
/// architecture.
pub fn fp8_ptx(arch: Arch) -> Result<Arc<str>, CudaError> {
    cached_ptx("model+fp8", FP8_SOURCE, arch)
}

/// The model program [`MODEL_SOURCE`] with `kernels/fp8.cu` after it: the kernels of a model
/// with FP8 weights. A program of its own so that the bf16 program's PTX does not change.
pub const FP8_SOURCE: &str = concat!(model_files!(), "\n", include_str!("../../../../kernels/fp8.cu"));

/// Entry points `kernels/fp8.cu` adds to [`FP8_SOURCE`].
pub const FP8_KERNELS: [&str; 12] = [
    "kvf_quantize_rows_fp8",
    "kvf_gemv_fp8",
    "kvf_gemv_fp8_row",
    "kvf_fp8_scale",
    "kvf_silu_quantize_fp8",
    "kvf_gelu_tanh_quantize_fp8",
    "kvf_rms_norm_fp8",
    "kvf_add_rms_norm_fp8",
    "kvf_qkv_post_fp8",
    "kvf_qkv_post_wide_fp8",
    "kvf_gemm_fp8_skinny",
    "kvf_gemm_fp8_skinny16",
];

/// Compiled programs by name and architecture.
type PtxCache = Mutex<HashMap<(&'static str, Arch), Arc<str>>>;

/// PTX of one program for `arch`, compiled once per process, program and architecture.
fn cached_ptx(name: &'static str, source: &'static str, arch: Arch) -> Result<Arc<str>, CudaError> {
    static CACHE: OnceLock<PtxCache> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(p) = cache.lock().map_err(|_| CudaError::Poisoned)?.get(&(name, arch)) {
        return Ok(p.clone());
    }
    let (ptx, took) = nvrtc::compile_source(name, source, arch)?;
    tracing::debug!(%arch, program = name, seconds = took.as_secs_f64(), "compiled kernels");
    cache
        .lock()
        .map_err(|_| CudaError::Poisoned)?
        .insert((name, arch), ptx.clone());
    Ok(ptx)
}

/// Threads of a `kvf_qkv_post` block (`QKV_POST_THREADS` in kernels/model.cu).
const QKV_POST_THREADS: u32 = 128;
/// Heads per block of `kvf_qkv_post_wide`: a warp each.
const QKV_POST_WIDE_HEADS: u32 = 4;
/// Tokens from which a step splits Q/K/V with a warp per head (`kvf_qkv_post_wide`) instead of
/// a block per head (`kvf_qkv_post`): a block per head is faster for a few tokens, a warp per
/// head from a few dozen on (bench/RESULTS.md).
const QKV_POST_WIDE_FROM: usize = 32;
const ELEMWISE_THREADS: u32 = 256;
const ELEMWISE_MAX_BLOCKS: usize = 8192;

/// The model program's functions, launched on the GPU's stream.
pub(super) struct ModelKernels {
    stream: Arc<CudaStream>,
    embed: CudaFunction,
    rms_norm: CudaFunction,
    rms_norm_rows: CudaFunction,
    gather_aux: CudaFunction,
    qkv_post: CudaFunction,
    qkv_post_wide: CudaFunction,
    silu_mul: CudaFunction,
    fill_uniform: CudaFunction,
    pub(super) argmax_rows: CudaFunction,
    pub(super) pick_rows: CudaFunction,
    pub(super) adjust_rows: CudaFunction,
    gemma: GemmaKernels,
    pub gemv: Gemv,
    /// The FP8 kernels (`kernels/fp8.cu`), when the model's weights are FP8.
    pub fp8: Option<Fp8Kernels>,
    /// Launch the decode step's kernels with programmatic dependent launch (sm_90 and later):
    /// the GEMVs, embedding, Q/K/V post-processing and argmax ([`crate::launch`]).
    pub pdl: bool,
}

/// The Gemma 3 section of `kernels/model.cu`.
struct GemmaKernels {
    embed_scaled: CudaFunction,
    rms_norm_add: CudaFunction,
    gelu_tanh_mul: CudaFunction,
}

/// What `kvf_qkv_post(_wide)` reads for a step: the fused projection's rows, their positions
/// and the layer's optional tensors. The kernel adds the bias, applies the Q/K norms and RoPE,
/// and writes bf16 Q/K/V with each KV head stored `kv_rep` times.
pub(super) struct QkvPost<'a> {
    pub config: &'a LlamaConfig,
    pub dims: &'a Dims,
    /// f32 `[t, qw + 2 kw]`.
    pub qkv: &'a CudaSlice<f32>,
    /// `[t]` positions.
    pub pos: &'a CudaSlice<i32>,
    /// `[qw + 2 kw]`, when the model has Q/K/V biases.
    pub bias: Option<&'a CudaSlice<f32>>,
    /// The Q and K norms (`[head_dim]` each), when the model has them.
    pub qk_norm: Option<(&'a CudaSlice<f32>, &'a CudaSlice<f32>)>,
    /// `[rope_dims / 2]`: the RoPE frequencies of the layer's base.
    pub inv_freq: &'a CudaSlice<f32>,
    /// FP8 weights through a unit-scale GEMM: `qkv` is unscaled, and these are its token scales
    /// `[t]` and the weight's row scales `[qw + 2 kw]` (`kvf_qkv_post(_wide)_fp8` applies them).
    pub scales: Option<(&'a CudaSlice<f32>, &'a CudaSlice<f32>)>,
}

/// Where `kvf_qkv_post(_wide)` writes: bf16 Q `[t, n_heads, hd]`, K and V
/// `[t, n_kv * kv_rep, hd]`.
pub(super) struct QkvOut<'a> {
    pub q: &'a mut CudaSlice<u16>,
    pub k: &'a mut CudaSlice<u16>,
    pub v: &'a mut CudaSlice<u16>,
}

fn elemwise_cfg(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            n.div_ceil(ELEMWISE_THREADS as usize)
                .clamp(1, ELEMWISE_MAX_BLOCKS) as u32,
            1,
            1,
        ),
        block_dim: (ELEMWISE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The Q/K/V split for a step of `t` tokens: a block per (token, head), or from
/// [`QKV_POST_WIDE_FROM`] tokens a warp per head and [`QKV_POST_WIDE_HEADS`] heads a block;
/// dynamic shared memory holds each head in f32. Returns whether it is the wide kernel.
fn qkv_post_cfg(t: usize, heads: u32, head_dim: usize) -> (bool, LaunchConfig) {
    let wide = t >= QKV_POST_WIDE_FROM;
    let per_block = if wide { QKV_POST_WIDE_HEADS } else { 1 };
    let cfg = LaunchConfig {
        grid_dim: (t as u32, heads.div_ceil(per_block), 1),
        block_dim: (QKV_POST_THREADS, 1, 1),
        shared_mem_bytes: (per_block as usize * head_dim * 4) as u32,
    };
    (wide, cfg)
}

impl ModelKernels {
    /// The model program's kernels; with `fp8`, from the program with `kernels/fp8.cu` too
    /// (the caller has checked that the device has FP8: [`super::fp8::check_device`]).
    /// `tuning`: the GEMVs' and the FP8 kernels' lab knobs.
    pub fn load(gpu: &Gpu, fp8: bool, tuning: &GpuTuning) -> Result<Self, GpuError> {
        let ptx = if fp8 {
            fp8_ptx(gpu.arch)?
        } else {
            model_ptx(gpu.arch)?
        };
        let module = gpu
            .context()
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx.to_string()))
            .map_err(drv("loading kernels/model.cu"))?;
        let f = |name: &'static str| module.load_function(name).map_err(drv("finding a model kernel"));
        let pdl = launch::pdl(gpu.arch);
        Ok(ModelKernels {
            stream: gpu.stream().clone(),
            embed: f("kvf_embed")?,
            rms_norm: f("kvf_rms_norm")?,
            rms_norm_rows: f("kvf_rms_norm_rows")?,
            gather_aux: f("kvf_gather_aux")?,
            qkv_post: f("kvf_qkv_post")?,
            qkv_post_wide: f("kvf_qkv_post_wide")?,
            silu_mul: f("kvf_silu_mul")?,
            fill_uniform: f("kvf_fill_uniform")?,
            argmax_rows: f("kvf_argmax_rows")?,
            pick_rows: f("kvf_pick_rows")?,
            adjust_rows: f("kvf_adjust_rows")?,
            gemma: GemmaKernels {
                embed_scaled: f("kvf_embed_scaled")?,
                rms_norm_add: f("kvf_rms_norm_add")?,
                gelu_tanh_mul: f("kvf_gelu_tanh_mul")?,
            },
            gemv: Gemv::load(&module, gpu.stream().clone(), gpu.num_sms, pdl, fp8, tuning)?,
            fp8: fp8
                .then(|| Fp8Kernels::load(&module, gpu.num_sms, pdl, tuning))
                .transpose()?,
            pdl,
        })
    }

    /// The stream every launch of these kernels goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// `x[i] = embed[tokens[i]]` (f32) for the step's `t` tokens.
    pub fn embed(
        &self,
        table: &CudaSlice<u16>,
        tokens: &CudaSlice<i32>,
        t: usize,
        d: usize,
        x: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        need("token buffer", tokens, t)?;
        need("residual", x, t * d)?;
        let d_i = d as i32;
        let mut l = Launch::new(&self.stream);
        l.ptr(table).ptr(tokens).i32(d_i).ptr_mut(x);
        // SAFETY: matches `kvf_embed(const bf16*, const int*, int, float*)`; token ids were
        // checked against the vocabulary on the host (the table is `[vocab, d]`), `x` holds
        // `t * d` values (checked above); it waits for the previous kernel first (PDL).
        unsafe { l.launch(&self.embed, rows_cfg(t, NORM_THREADS, 0), self.pdl) }
            .map_err(drv("launching kvf_embed"))?;
        Ok(())
    }

    /// `out[r] = norm(x[r])` (bf16) for `rows` rows of width `d`.
    pub fn rms_norm(
        &self,
        x: &CudaSlice<f32>,
        rows: usize,
        d: usize,
        norm: Norm<'_>,
        out: &mut CudaSlice<u16>,
    ) -> Result<(), GpuError> {
        need("norm input", x, rows * d)?;
        need("norm weight", norm.w, d)?;
        need("norm output", out, rows * d)?;
        let d_i = d as i32;
        let mut l = Launch::new(&self.stream);
        l.ptr(x).ptr(norm.w).i32(d_i).f32(norm.eps).ptr_mut(out);
        // SAFETY: matches `kvf_rms_norm(const float*, const float*, int, float, bf16*)`; sizes
        // checked above; one block of NORM_THREADS (a multiple of 32) per row; it waits for
        // the previous kernel first (PDL).
        unsafe { l.launch(&self.rms_norm, rows_cfg(rows, NORM_THREADS, 0), self.pdl) }
            .map_err(drv("launching kvf_rms_norm"))?;
        Ok(())
    }

    /// `out[i] = norm(x[rows[i]])` (bf16) for the `n` rows `rows` names.
    pub fn rms_norm_rows(
        &self,
        x: &CudaSlice<f32>,
        rows: &CudaSlice<i32>,
        n: usize,
        d: usize,
        norm: Norm<'_>,
        out: &mut CudaSlice<u16>,
    ) -> Result<(), GpuError> {
        need("row index buffer", rows, n)?;
        need("norm output", out, n * d)?;
        let d_i = d as i32;
        let mut l = Launch::new(&self.stream);
        l.ptr(x).ptr(rows).ptr(norm.w).i32(d_i).f32(norm.eps).ptr_mut(out);
        // SAFETY: matches `kvf_rms_norm_rows(const float*, const int*, const float*, int,
        // float, bf16*)`; row indices are rows of this step (built on the host, < tokens); it
        // waits for the previous kernel first (PDL).
        unsafe { l.launch(&self.rms_norm_rows, rows_cfg(n, NORM_THREADS, 0), self.pdl) }
            .map_err(drv("launching kvf_rms_norm_rows"))?;
        Ok(())
    }

    /// A drafter's `fc` input from the kept target features `a` (`[T, d]` each, f32):
    /// `out[i] = bf16(a[0][rows[i]] ++ a[1][rows[i]] ++ ...)`, `[n, a.len() x d]`, one launch a
    /// feature.
    pub fn gather_aux(
        &self,
        a: &[CudaSlice<f32>],
        rows: &CudaSlice<i32>,
        n: usize,
        d: usize,
        out: &mut CudaSlice<u16>,
    ) -> Result<(), GpuError> {
        let ld = a.len() * d;
        need("row index buffer", rows, n)?;
        need("drafter input", out, n * ld)?;
        for (j, src) in a.iter().enumerate() {
            let (d_i, ld_i, col) = (d as i32, ld as i32, (j * d) as i32);
            let mut l = Launch::new(&self.stream);
            l.ptr(src).ptr(rows).i32(d_i).i32(ld_i).i32(col).ptr_mut(out);
            // SAFETY: matches `kvf_gather_aux(const float*, const int*, int, int, int, bf16*)`;
            // the row indices are rows of the step the features were kept from (checked on the
            // host against their count, `src` holds them); `out` holds n rows of `ld` (checked
            // above) and `col + d <= ld`; it waits for the previous kernel first (PDL).
            unsafe { l.launch(&self.gather_aux, rows_cfg(n, NORM_THREADS, 0), self.pdl) }
                .map_err(drv("launching kvf_gather_aux"))?;
        }
        Ok(())
    }

    /// Q/K/V of the step's `t` tokens from the fused projection (`kvf_qkv_post`, or
    /// `kvf_qkv_post_wide` from [`QKV_POST_WIDE_FROM`] tokens), with programmatic dependent
    /// launch when `pdl`.
    pub fn qkv_post(&self, t: usize, p: &QkvPost<'_>, out: QkvOut<'_>, pdl: bool) -> Result<(), GpuError> {
        let (c, dm) = (p.config, p.dims);
        need("q", out.q, t * dm.qw)?;
        need("k", out.k, t * dm.kw_rep)?;
        need("v", out.v, t * dm.kw_rep)?;
        // Flags say which optional tensors the kernel reads; absent ones get a valid pointer
        // (the frequencies) it never dereferences.
        let bias = p.bias.unwrap_or(p.inv_freq);
        let (qn, kn) = p.qk_norm.unwrap_or((p.inv_freq, p.inv_freq));
        let heads = (dm.n_heads + 2 * dm.n_kv) as u32;
        let (wide, cfg) = qkv_post_cfg(t, heads, dm.hd);
        let f = match (p.scales, self.fp8.as_ref()) {
            (None, _) if wide => &self.qkv_post_wide,
            (None, _) => &self.qkv_post,
            (Some(_), Some(f8)) => f8.qkv_post(wide),
            (Some(_), None) => {
                return Err(GpuError::Invalid(
                    "scaled Q/K/V on a model built without FP8 kernels".into(),
                ))
            }
        };
        if let Some((sx, sw)) = p.scales {
            need("FP8 token scales", sx, t)?;
            need("FP8 Q/K/V weight scales", sw, dm.qkv())?;
        }
        let mut l = Launch::new(&self.stream);
        l.ptr(p.qkv)
            .ptr(p.pos)
            .ptr(bias)
            .ptr(qn)
            .ptr(kn)
            .ptr(p.inv_freq)
            .i32(dm.n_heads as i32)
            .i32(dm.n_kv as i32)
            .i32(dm.kv_rep as i32)
            .i32(dm.hd as i32)
            .i32((c.rope_dims / 2) as i32)
            .i32(c.rope_neox as i32)
            .i32(p.bias.is_some() as i32)
            .i32(p.qk_norm.is_some() as i32)
            .f32(c.rope_linear_scale)
            .f32(c.rms_eps)
            .ptr_mut(out.q)
            .ptr_mut(out.k)
            .ptr_mut(out.v);
        if let Some((sx, sw)) = p.scales {
            l.ptr(sx).ptr(sw);
        }
        // SAFETY: matches `kvf_qkv_post(_wide)` in kernels/model.cu (6 pointers, 8 ints, 2
        // floats, 3 pointers in order). qkv holds `t * (qw + 2 kw)` f32 (the GEMM or GEMV before
        // it), pos `t` positions, bias `qw + 2 kw` and the norms `head_dim` values when their
        // flags are set (absent ones are never read), inv_freq `rope_dims / 2`; the outputs were
        // checked above; `qkv_post_cfg` sizes the dynamic shared memory for its heads a block;
        // with scales, `kvf_qkv_post(_wide)_fp8` takes the two scale vectors after those (sizes
        // checked above). With `pdl` it waits for the previous kernel first.
        unsafe { l.launch(f, cfg, pdl) }.map_err(drv("launching kvf_qkv_post"))?;
        Ok(())
    }

    /// `act[t, i] = f(gate) * up` from the gate/up GEMM's `[t, 2 ff]` rows; each thread writes
    /// four columns of a row.
    pub fn glu(
        &self,
        kind: Glu,
        gu: &CudaSlice<f32>,
        t: usize,
        ff: usize,
        act: &mut CudaSlice<u16>,
    ) -> Result<(), GpuError> {
        let (f, what) = match kind {
            Glu::Silu => (&self.silu_mul, "launching kvf_silu_mul"),
            Glu::GeluTanh => (&self.gemma.gelu_tanh_mul, "launching kvf_gelu_tanh_mul"),
        };
        need("gate/up", gu, t * 2 * ff)?;
        need("activation", act, t * ff)?;
        if t == 0 || ff == 0 {
            return Ok(());
        }
        let (ff_i, t_i) = (ff as i32, t as i32);
        let cfg = LaunchConfig {
            grid_dim: (
                ff.div_ceil(4 * ELEMWISE_THREADS as usize) as u32,
                t.min(u16::MAX as usize) as u32,
                1,
            ),
            block_dim: (ELEMWISE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut l = Launch::new(&self.stream);
        l.ptr(gu).i32(ff_i).i32(t_i).ptr_mut(act);
        // SAFETY: matches `kvf_silu_mul` / `kvf_gelu_tanh_mul(const float*, int, int, bf16*)`;
        // `gu` holds `t * 2 ff` f32 and `act` `t * ff` bf16 (checked above); threads past `ff`
        // return and rows stride by the grid's y; it waits for the previous kernel first (PDL).
        unsafe { l.launch(f, cfg, self.pdl) }.map_err(drv(what))?;
        Ok(())
    }

    /// Fills `out` with bf16 values uniform in `±a` from `seed` (random weights).
    pub fn fill_uniform(&self, out: &mut CudaSlice<u16>, seed: u64, a: f32) -> Result<(), GpuError> {
        let n = out.len();
        let n_i = n as i64;
        let mut b = self.stream.launch_builder(&self.fill_uniform);
        b.arg(&mut *out).arg(&n_i).arg(&seed).arg(&a);
        // SAFETY: matches `kvf_fill_uniform(bf16*, long long, unsigned long long, float)`;
        // writes exactly `out.len()` elements.
        unsafe { b.launch(elemwise_cfg(n)) }.map_err(drv("launching kvf_fill_uniform"))?;
        Ok(())
    }

    /// Gemma 3: `x[i] = embed[tokens[i]] * scale` (f32) for the step's `t` tokens.
    pub fn embed_scaled(
        &self,
        table: &CudaSlice<u16>,
        tokens: &CudaSlice<i32>,
        t: usize,
        d: usize,
        scale: f32,
        x: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        need("token buffer", tokens, t)?;
        need("residual", x, t * d)?;
        let d_i = d as i32;
        let mut b = self.stream.launch_builder(&self.gemma.embed_scaled);
        b.arg(table).arg(tokens).arg(&d_i).arg(&scale).arg(x);
        // SAFETY: matches `kvf_embed_scaled(const bf16*, const int*, int, float, float*)`; token
        // ids were checked against the vocabulary on the host (the table is `[vocab, d]`), `x`
        // holds `t * d` values (checked above).
        unsafe { b.launch(rows_cfg(t, NORM_THREADS, 0)) }.map_err(drv("launching kvf_embed_scaled"))?;
        Ok(())
    }

    /// Gemma 3's post-norm: `x[r] += norm(y[r])` for `rows` rows of width `d`.
    pub fn rms_norm_add(
        &self,
        y: &CudaSlice<f32>,
        rows: usize,
        d: usize,
        norm: Norm<'_>,
        x: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        need("post-norm input", y, rows * d)?;
        need("post-norm weight", norm.w, d)?;
        need("residual", x, rows * d)?;
        let d_i = d as i32;
        let mut b = self.stream.launch_builder(&self.gemma.rms_norm_add);
        b.arg(y).arg(norm.w).arg(&d_i).arg(&norm.eps).arg(x);
        // SAFETY: matches `kvf_rms_norm_add(const float*, const float*, int, float, float*)`;
        // sizes checked above; one block of NORM_THREADS (a multiple of 32) per row.
        unsafe { b.launch(rows_cfg(rows, NORM_THREADS, 0)) }.map_err(drv("launching kvf_rms_norm_add"))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qkv_post_takes_a_warp_per_head_from_a_few_dozen_tokens() {
        let (wide, cfg) = qkv_post_cfg(QKV_POST_WIDE_FROM - 1, 48, 128);
        assert!(!wide);
        assert_eq!(cfg.grid_dim, (31, 48, 1));
        assert_eq!(cfg.shared_mem_bytes, 128 * 4);
        let (wide, cfg) = qkv_post_cfg(QKV_POST_WIDE_FROM, 48, 128);
        assert!(wide);
        assert_eq!(cfg.grid_dim, (32, 12, 1));
        assert_eq!(cfg.shared_mem_bytes, 4 * 128 * 4);
    }

    #[test]
    fn the_kernel_list_names_every_entry_point_of_the_source() {
        let entries: Vec<&str> = MODEL_SOURCE
            .split("extern \"C\" __global__ void ")
            .skip(1)
            .map(|rest| match rest.strip_prefix("__launch_bounds__(") {
                Some(bounded) => bounded.split_once(") ").map_or(bounded, |(_, r)| r),
                None => rest,
            })
            .filter_map(|decl| decl.split('(').next())
            .collect();
        let mut listed = MODEL_KERNELS.to_vec();
        let mut found = entries.clone();
        listed.sort_unstable();
        found.sort_unstable();
        assert_eq!(listed, found, "MODEL_KERNELS against the kernels of the program");
    }
}
