//! The Llama-family forward pass on an NVIDIA GPU, the same math as [`Llama::forward`]:
//! GEMMs on cuBLAS (bf16 weights and activations, f32 accumulation), attention through the
//! engine's [`CudaBackend`] on a paged KV cache, and the rest in the small NVRTC kernels of
//! `kernels/model.cu`.
//!
//! Per step, all on the one stream of [`Gpu`] with no host synchronisation until the logits
//! are copied back:
//! 1. plan pages ([`PageTable`], the engine's `BlockPool`) and `prepare` the backend;
//! 2. `x = embed[tokens]` (f32 residual stream);
//! 3. per layer: `h = rmsnorm(x)` (bf16); `qkv = h · Wqkvᵀ` (one GEMM, f32 out); split with
//!    bias, Q/K norm and RoPE into bf16 Q/K/V; append K/V and attend; `x += attn · Woᵀ` (the
//!    GEMM accumulates into the f32 residual, beta = 1); `h = rmsnorm(x)`;
//!    `gu = h · Wguᵀ` (gate and up in one GEMM); `act = silu(gate) * up`; `x += act · Wdownᵀ`;
//! 4. the last row of every chunk that wants logits: `rmsnorm`, `logits = h · headᵀ` (f32).
//!
//! A step of one token (one stream decoding) runs each projection as one fused GEMV instead
//! ([`gemv`], `kernels/gemv.cu`): the norm inside the QKV, gate/up and LM-head launches, SwiGLU
//! inside gate/up, the residual add inside O and down; four launches a layer fewer.
//!
//! GQA groups the attention kernels do not specialise for (SmolLM2's 9 query heads over 3
//! KV heads) store each KV head `kv_rep` times, turning the group into one they do (3 -> 1).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublas::{result as blas_result, sys as blas_sys, CudaBlas};
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use half::bf16;
use rayon::prelude::*;

use crate::backend::CudaBackend;
use crate::device::{driver_present, Gpu};
use crate::launch::{self, Launch};
use crate::profile::{self, GpuSteps};
use crate::spec::{Arch, GroupSize, HeadDim};
use crate::{driver_err, nvrtc, CudaError};

mod gemv;
use kvfleet_engine::engine::layout::{BackendConfig, KvDtype, StepPlan};
use kvfleet_engine::engine::Backend;
use kvfleet_engine::model::forward::{check_plan, llama_backend_config, Forward};
use kvfleet_engine::model::kv::AttnGeometry;
use kvfleet_engine::model::llama::{inv_freq, ForwardError, Llama, LlamaConfig, SeqChunk};
use kvfleet_engine::model::sampling::RowPick;

/// The kernels of the forward pass (everything but GEMMs and attention).
/// `kernels/sampling.cu` and `kernels/gemv.cu` follow `kernels/model.cu` in one program (they use
/// its helpers).
pub const MODEL_SOURCE: &str = concat!(
    include_str!("../../../kernels/model.cu"),
    "\n",
    include_str!("../../../kernels/sampling.cu"),
    "\n",
    include_str!("../../../kernels/gemv.cu")
);

/// Entry points of [`MODEL_SOURCE`].
pub const MODEL_KERNELS: [&str; 13] = [
    "kvf_embed",
    "kvf_rms_norm",
    "kvf_rms_norm_rows",
    "kvf_qkv_post",
    "kvf_qkv_post_wide",
    "kvf_silu_mul",
    "kvf_fill_uniform",
    "kvf_argmax_rows",
    "kvf_pick_rows",
    "kvf_embed_scaled",
    "kvf_rms_norm_add",
    "kvf_gelu_tanh_mul",
    "kvf_gemv",
];

/// The parts of a step [`profile::GpuSteps`] times, in the order they run.
const PROFILE_PARTS: &[&str] = &[
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
mod part {
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

/// Words of one row's pick in `kvf_pick_rows`' input.
const PICK_WORDS: usize = 6;

/// The kernel's words for each pick: temperature (0 for the argmax), top-k clamped to `i32`,
/// top-p, the key's low and high halves, and an unused word.
fn pick_words(picks: &[RowPick]) -> Vec<u32> {
    picks
        .iter()
        .flat_map(|p| match p {
            RowPick::Greedy => [0; PICK_WORDS],
            RowPick::Draw(d) => [
                d.temperature.to_bits(),
                d.top_k.min(i32::MAX as u32),
                d.top_p.to_bits(),
                d.key as u32,
                (d.key >> 32) as u32,
                0,
            ],
        })
        .collect()
}

/// Tokens per KV page (the only page size the attention kernels build).
pub const BLOCK_SIZE: usize = 16;

const NORM_THREADS: u32 = 256;
/// Threads of a `kvf_qkv_post` block (`QKV_POST_THREADS` in kernels/model.cu).
const QKV_POST_THREADS: u32 = 128;
/// Heads per block of `kvf_qkv_post_wide`: a warp each.
const QKV_POST_WIDE_HEADS: u32 = 4;
/// Tokens from which a step splits Q/K/V with a warp per head (`kvf_qkv_post_wide`) instead of
/// a block per head (`kvf_qkv_post`). On an H100 (dummy Llama-3-8B, bench/RESULTS.md) a block
/// per head took 0.19 ms a step at 2-16 tokens against 0.22 for a warp, and a warp per head
/// 0.28 ms at ~144 tokens against 0.35 and 2.0 ms at 2,048 against 3.4.
const QKV_POST_WIDE_FROM: usize = 32;
const ELEMWISE_THREADS: u32 = 256;
const ELEMWISE_MAX_BLOCKS: usize = 8192;

/// Errors of the GPU forward pass. Each message says what to do next.
#[derive(Debug, Clone, thiserror::Error)]
pub enum GpuError {
    #[error(transparent)]
    Cuda(#[from] CudaError),
    #[error(
        "cuBLAS (libcublas.so) is not loadable: put the CUDA toolkit's lib folder (e.g. /usr/local/cuda/lib64, \
         or the `nvidia-cublas-cu12` wheel's nvidia/cublas/lib) on LD_LIBRARY_PATH, or run the model with \
         --attention-backend KVFLEET_CPU"
    )]
    CublasMissing,
    #[error(
        "no CUDA device is visible (check the NVIDIA driver and CUDA_VISIBLE_DEVICES), or run the model with \
         --attention-backend KVFLEET_CPU"
    )]
    NoDevice,
    #[error("cuBLAS failed during {what}: {detail}")]
    Cublas { what: &'static str, detail: String },
    #[error("GPU attention backend: {0}")]
    Backend(String),
    #[error(
        "the model does not fit kvfleet's GPU kernels: {0}; run it with --attention-backend KVFLEET_CPU"
    )]
    Unsupported(String),
    #[error(
        "not enough GPU memory: {0}; use a smaller model, lower maxNumBatchedTokens, or run it with \
         --attention-backend KVFLEET_CPU"
    )]
    Memory(String),
    #[error("the attention kernels failed their self-test on the served geometry and KV dtype: {0}")]
    SelfTest(crate::CudaError),
    #[error("invalid GPU model: {0}")]
    Invalid(String),
}

impl From<GpuError> for ForwardError {
    fn from(e: GpuError) -> Self {
        ForwardError::Device(Box::new(e))
    }
}

fn cublas_err(what: &'static str) -> impl FnOnce(blas_result::CublasError) -> GpuError {
    move |e| GpuError::Cublas {
        what,
        detail: format!("{e:?}"),
    }
}

fn drv(what: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> GpuError {
    move |e| GpuError::Cuda(driver_err(what)(e))
}

fn backend_err(e: kvfleet_engine::engine::BackendError) -> GpuError {
    GpuError::Backend(e.to_string())
}

/// Whether cuBLAS can be loaded (cudarc panics on first use otherwise).
pub fn cublas_present() -> bool {
    // SAFETY: only tries `dlopen` on libcublas candidate names.
    unsafe { cudarc::cublas::sys::is_culib_present() }
}

/// `Ok` when the GPU path can run here: the CUDA driver, NVRTC with the CUDA headers, cuBLAS
/// and at least one device; otherwise the first thing missing.
pub fn check_available() -> Result<(), GpuError> {
    if !driver_present() {
        return Err(CudaError::DriverMissing.into());
    }
    nvrtc::toolchain()?;
    if !cublas_present() {
        return Err(GpuError::CublasMissing);
    }
    match cudarc::driver::CudaContext::device_count() {
        Ok(n) if n > 0 => Ok(()),
        _ => Err(GpuError::NoDevice),
    }
}

/// PTX of [`MODEL_SOURCE`] for `arch`, compiled once per process and architecture.
pub fn model_ptx(arch: Arch) -> Result<Arc<str>, CudaError> {
    static CACHE: OnceLock<Mutex<HashMap<Arch, Arc<str>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(p) = cache.lock().map_err(|_| CudaError::Poisoned)?.get(&arch) {
        return Ok(p.clone());
    }
    let (ptx, took) = nvrtc::compile_source("model", MODEL_SOURCE, arch)?;
    tracing::debug!(%arch, seconds = took.as_secs_f64(), "compiled kernels/model.cu");
    cache
        .lock()
        .map_err(|_| CudaError::Poisoned)?
        .insert(arch, ptx.clone());
    Ok(ptx)
}

/// Picks a token from each row of `logits` (`[picks.len(), vocab]` f32) with `kvf_pick_rows`, as
/// a step does after its LM head: for tests that hold the device to the host's
/// [`RowPick::pick`], and for timing the kernel alone. Runs it `1 + reps` times and returns the
/// tokens and the mean time of the last `reps` launches (the first loads the module).
pub fn pick_rows_on_device(
    gpu: &Gpu,
    logits: &[f32],
    vocab: usize,
    picks: &[RowPick],
    reps: usize,
) -> Result<(Vec<u32>, std::time::Duration), GpuError> {
    let rows = picks.len();
    if vocab == 0 || logits.len() != rows * vocab {
        return Err(GpuError::Invalid(format!(
            "{} logits for {rows} rows of {vocab}",
            logits.len()
        )));
    }
    let k = ModelKernels::load(gpu)?;
    let s = gpu.stream().clone();
    let d_logits = s
        .clone_htod(logits)
        .map_err(drv("copying logits to the device"))?;
    let mut words = s
        .alloc_zeros::<u32>(rows * PICK_WORDS)
        .map_err(drv("allocating pick words"))?;
    let mut out = s.alloc_zeros::<i32>(rows).map_err(drv("allocating picks"))?;
    k.pick_rows(&s, &d_logits, vocab, picks, &mut words, &mut out)?;
    gpu.synchronize()?;
    let start = std::time::Instant::now();
    for _ in 0..reps {
        k.pick_rows(&s, &d_logits, vocab, picks, &mut words, &mut out)?;
    }
    gpu.synchronize()?;
    let each = start.elapsed() / reps.max(1) as u32;
    let ids = s.clone_dtoh(&out).map_err(drv("copying picks to the host"))?;
    Ok((ids.into_iter().map(|i| i as u32).collect(), each))
}

/// How many times each KV head is stored so that the attention kernels' GQA group sizes
/// (1, 2, 4, 8) cover the model: returns `(kv_rep, stored group)`.
pub fn kv_replication(n_heads: usize, n_kv_heads: usize) -> Result<(usize, usize), GpuError> {
    if n_kv_heads == 0 || n_heads % n_kv_heads != 0 {
        return Err(GpuError::Unsupported(format!(
            "{n_heads} query heads over {n_kv_heads} KV heads"
        )));
    }
    let group = n_heads / n_kv_heads;
    let stored = GroupSize::ALL
        .iter()
        .map(|g| g.get())
        .filter(|g| group % g == 0)
        .max()
        .unwrap_or(1);
    Ok((group / stored, stored))
}

/// Options of the GPU model.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuOptions {
    /// CUDA device ordinal.
    pub ordinal: usize,
    /// KV-cache dtype (any the attention kernels build: bf16, f16, fp8, nvfp4).
    pub kv_dtype: KvDtype,
    /// Tokens per forward pass the activation buffers are sized for (larger batches grow them).
    pub max_batched_tokens: usize,
    /// Logit rows per forward pass the buffers are sized for.
    pub max_num_seqs: usize,
    /// Cap on KV tokens; `None`: all free memory after weights, activations and the margin.
    pub max_kv_tokens: Option<usize>,
    /// Tokens per KV page.
    pub block_size: usize,
    /// Fraction of the device's memory kvfleet may use (vLLM's `gpu_memory_utilization`):
    /// `(1 - it) x total` stays free after weights, activations and KV pools.
    pub gpu_memory_utilization: f64,
    /// Bytes left free after the KV pools; `None`: `(1 - gpu_memory_utilization) x total`,
    /// at least 256 MiB (cuBLAS workspace, per-step plans).
    pub memory_margin_bytes: Option<usize>,
    /// Run the attention kernels' self-test on the served geometry and dtype before
    /// allocating the pools (the worker's preflight).
    pub self_test: bool,
    /// Tokens of one request at most (the engine's maxModelLen): a model with sliding-window
    /// layers splits the KV memory between its layer groups by what one such request needs
    /// from each. `None`: the model's context length.
    pub max_model_len: Option<usize>,
    /// Steps of one token run their projections as fused GEMVs (`kernels/gemv.cu`) rather
    /// than cuBLAS GEMMs with separate norm and SwiGLU kernels. Off only to compare the two.
    pub single_token_gemv: bool,
}

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions {
            ordinal: 0,
            kv_dtype: KvDtype::Bf16,
            max_batched_tokens: 1024,
            max_num_seqs: 256,
            max_kv_tokens: None,
            block_size: BLOCK_SIZE,
            gpu_memory_utilization: 0.9,
            memory_margin_bytes: None,
            self_test: false,
            max_model_len: None,
            single_token_gemv: true,
        }
    }
}

/// Where the GPU's memory went; the KV capacity in tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuCapacity {
    pub device: String,
    pub total_bytes: usize,
    pub weight_bytes: usize,
    pub activation_bytes: usize,
    /// Free bytes after weights and activations, before the KV pools.
    pub free_bytes: usize,
    pub margin_bytes: usize,
    /// KV bytes per token over all layers (K and V, replicated heads included).
    pub kv_bytes_per_token: usize,
    /// KV heads stored per layer (`n_kv_heads * kv_rep`).
    pub kv_heads_stored: usize,
    /// Pages of every layer the KV memory holds. A model with sliding-window layers (Gemma 3)
    /// gets the same bytes split between its layer groups ([`GpuLlama`]'s `kv_config` has each
    /// group's pages), so these are the pages of a full-layer budget of the same memory.
    pub blocks: usize,
    pub block_size: usize,
    /// `blocks * block_size`.
    pub kv_tokens: usize,
}

impl GpuCapacity {
    /// Tokens the generation loop may reserve: every running sequence may waste up to a
    /// page minus one token in its last page.
    pub fn admission_tokens(&self, max_num_seqs: usize) -> usize {
        self.kv_tokens
            .saturating_sub(max_num_seqs * (self.block_size - 1))
            .max(self.block_size.min(self.kv_tokens))
    }
}

#[derive(Debug, Clone, Copy)]
struct Dims {
    layers: usize,
    d: usize,
    hd: usize,
    n_heads: usize,
    n_kv: usize,
    kv_rep: usize,
    qw: usize,
    kw: usize,
    /// K/V width as stored (replicated heads).
    kw_rep: usize,
    ff: usize,
    vocab: usize,
    /// Gemma 3's block (post-norms, GeGLU, scaled embedding, local RoPE).
    gemma: bool,
}

impl Dims {
    fn new(c: &LlamaConfig, kv_rep: usize) -> Self {
        let (qw, kw) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        Dims {
            layers: c.n_layers,
            d: c.d_model,
            hd: c.head_dim,
            n_heads: c.n_heads,
            n_kv: c.n_kv_heads,
            kv_rep,
            qw,
            kw,
            kw_rep: kw * kv_rep,
            ff: c.d_ff,
            vocab: c.vocab,
            gemma: c.gemma3.is_some(),
        }
    }
}

struct ModelKernels {
    embed: CudaFunction,
    rms_norm: CudaFunction,
    rms_norm_rows: CudaFunction,
    qkv_post: CudaFunction,
    qkv_post_wide: CudaFunction,
    silu_mul: CudaFunction,
    fill_uniform: CudaFunction,
    argmax_rows: CudaFunction,
    pick_rows: CudaFunction,
    gemma: GemmaKernels,
    gemv: gemv::Gemv,
    /// Launch the decode step's kernels with programmatic dependent launch (sm_90 and later):
    /// the GEMVs, embedding, Q/K/V post-processing and argmax ([`crate::launch`]).
    pdl: bool,
}

/// The Gemma 3 section of `kernels/model.cu`.
struct GemmaKernels {
    embed_scaled: CudaFunction,
    rms_norm_add: CudaFunction,
    gelu_tanh_mul: CudaFunction,
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

fn rows_cfg(rows: usize, threads: u32, smem: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem as u32,
    }
}

/// A gated activation (`kvf_silu_mul`, `kvf_gelu_tanh_mul`): `act[t, i] = f(gate) * up` from
/// the gate/up GEMM's `[t, 2 ff]` rows; each thread writes four columns of a row.
#[allow(clippy::too_many_arguments)]
fn glu(
    s: &Arc<CudaStream>,
    f: &CudaFunction,
    pdl: bool,
    gu: &CudaSlice<f32>,
    t: usize,
    ff: usize,
    act: &mut CudaSlice<u16>,
    what: &'static str,
) -> Result<(), GpuError> {
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
    let mut l = Launch::new(s);
    l.ptr(gu).i32(ff_i).i32(t_i).ptr_mut(act);
    // SAFETY: matches `kvf_silu_mul` / `kvf_gelu_tanh_mul(const float*, int, int, bf16*)`;
    // `gu` holds `t * 2 ff` f32 and `act` `t * ff` bf16 (checked above); threads past `ff`
    // return and rows stride by the grid's y; it waits for the previous kernel first (PDL).
    unsafe { l.launch(f, cfg, pdl) }.map_err(drv(what))?;
    Ok(())
}

fn need<T>(what: &'static str, buf: &CudaSlice<T>, n: usize) -> Result<(), GpuError> {
    if buf.len() < n {
        return Err(GpuError::Invalid(format!(
            "{what} holds {} elements, the step needs {n}",
            buf.len()
        )));
    }
    Ok(())
}

impl ModelKernels {
    fn load(gpu: &Gpu) -> Result<Self, GpuError> {
        let ptx = model_ptx(gpu.arch)?;
        let module = gpu
            .context()
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx.to_string()))
            .map_err(drv("loading kernels/model.cu"))?;
        let f = |name: &'static str| module.load_function(name).map_err(drv("finding a model kernel"));
        Ok(ModelKernels {
            embed: f("kvf_embed")?,
            rms_norm: f("kvf_rms_norm")?,
            rms_norm_rows: f("kvf_rms_norm_rows")?,
            qkv_post: f("kvf_qkv_post")?,
            qkv_post_wide: f("kvf_qkv_post_wide")?,
            silu_mul: f("kvf_silu_mul")?,
            fill_uniform: f("kvf_fill_uniform")?,
            argmax_rows: f("kvf_argmax_rows")?,
            pick_rows: f("kvf_pick_rows")?,
            gemma: GemmaKernels {
                embed_scaled: f("kvf_embed_scaled")?,
                rms_norm_add: f("kvf_rms_norm_add")?,
                gelu_tanh_mul: f("kvf_gelu_tanh_mul")?,
            },
            gemv: gemv::Gemv::load(&module, gpu.num_sms, launch::pdl(gpu.arch))?,
            pdl: launch::pdl(gpu.arch),
        })
    }

    /// The Q/K/V split for a step of `t` tokens and its launch: a block per (token, head), or
    /// from [`QKV_POST_WIDE_FROM`] tokens a warp per head and [`QKV_POST_WIDE_HEADS`] heads a
    /// block; dynamic shared memory holds each head in f32.
    fn qkv_post_launch(&self, t: usize, heads: u32, head_dim: usize) -> (&CudaFunction, LaunchConfig) {
        let (f, per_block) = if t >= QKV_POST_WIDE_FROM {
            (&self.qkv_post_wide, QKV_POST_WIDE_HEADS)
        } else {
            (&self.qkv_post, 1)
        };
        let cfg = LaunchConfig {
            grid_dim: (t as u32, heads.div_ceil(per_block), 1),
            block_dim: (QKV_POST_THREADS, 1, 1),
            shared_mem_bytes: (per_block as usize * head_dim * 4) as u32,
        };
        (f, cfg)
    }

    fn embed(
        &self,
        s: &Arc<CudaStream>,
        table: &CudaSlice<u16>,
        tokens: &CudaSlice<i32>,
        t: usize,
        d: usize,
        x: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        need("token buffer", tokens, t)?;
        need("residual", x, t * d)?;
        let d_i = d as i32;
        let mut l = Launch::new(s);
        l.ptr(table).ptr(tokens).i32(d_i).ptr_mut(x);
        // SAFETY: matches `kvf_embed(const bf16*, const int*, int, float*)`; token ids were
        // checked against the vocabulary on the host (the table is `[vocab, d]`), `x` holds
        // `t * d` values (checked above); it waits for the previous kernel first (PDL).
        unsafe { l.launch(&self.embed, rows_cfg(t, NORM_THREADS, 0), self.pdl) }
            .map_err(drv("launching kvf_embed"))?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn rms_norm(
        &self,
        s: &Arc<CudaStream>,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        rows: usize,
        d: usize,
        eps: f32,
        out: &mut CudaSlice<u16>,
    ) -> Result<(), GpuError> {
        need("norm input", x, rows * d)?;
        need("norm weight", w, d)?;
        need("norm output", out, rows * d)?;
        let d_i = d as i32;
        let mut l = Launch::new(s);
        l.ptr(x).ptr(w).i32(d_i).f32(eps).ptr_mut(out);
        // SAFETY: matches `kvf_rms_norm(const float*, const float*, int, float, bf16*)`; sizes
        // checked above; one block of NORM_THREADS (a multiple of 32) per row; it waits for
        // the previous kernel first (PDL).
        unsafe { l.launch(&self.rms_norm, rows_cfg(rows, NORM_THREADS, 0), self.pdl) }
            .map_err(drv("launching kvf_rms_norm"))?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn rms_norm_rows(
        &self,
        s: &Arc<CudaStream>,
        x: &CudaSlice<f32>,
        rows: &CudaSlice<i32>,
        n: usize,
        w: &CudaSlice<f32>,
        d: usize,
        eps: f32,
        out: &mut CudaSlice<u16>,
    ) -> Result<(), GpuError> {
        need("row index buffer", rows, n)?;
        need("norm output", out, n * d)?;
        let d_i = d as i32;
        let mut l = Launch::new(s);
        l.ptr(x).ptr(rows).ptr(w).i32(d_i).f32(eps).ptr_mut(out);
        // SAFETY: matches `kvf_rms_norm_rows(const float*, const int*, const float*, int,
        // float, bf16*)`; row indices are rows of this step (built on the host, < tokens); it
        // waits for the previous kernel first (PDL).
        unsafe { l.launch(&self.rms_norm_rows, rows_cfg(n, NORM_THREADS, 0), self.pdl) }
            .map_err(drv("launching kvf_rms_norm_rows"))?;
        Ok(())
    }

    /// `out[r] = argmax(logits[r, :vocab])` for `rows` rows.
    fn argmax_rows(
        &self,
        s: &Arc<CudaStream>,
        logits: &CudaSlice<f32>,
        rows: usize,
        vocab: usize,
        out: &mut CudaSlice<i32>,
    ) -> Result<(), GpuError> {
        need("logits", logits, rows * vocab)?;
        need("argmax output", out, rows)?;
        let v = vocab as i32;
        let mut l = Launch::new(s);
        l.ptr(logits).i32(v).ptr_mut(out);
        // SAFETY: matches `kvf_argmax_rows` in kernels/sampling.cu (pointer, int, pointer);
        // `logits` holds `rows * vocab` f32 and `out` `rows` ints (checked above); one block of
        // 1024 threads (a multiple of 32) per row, static shared memory only; it waits for the
        // previous kernel first (PDL).
        unsafe { l.launch(&self.argmax_rows, rows_cfg(rows, 1024, 0), self.pdl) }
            .map_err(drv("launching kvf_argmax_rows"))?;
        Ok(())
    }

    /// `out[r]` = the token `picks[r]` chooses from `logits[r, :vocab]` (`kvf_pick_rows`), with
    /// the picks uploaded into `words` (6 a row).
    #[allow(clippy::too_many_arguments)]
    fn pick_rows(
        &self,
        s: &Arc<CudaStream>,
        logits: &CudaSlice<f32>,
        vocab: usize,
        picks: &[RowPick],
        words: &mut CudaSlice<u32>,
        out: &mut CudaSlice<i32>,
    ) -> Result<(), GpuError> {
        let rows = picks.len();
        need("logits", logits, rows * vocab)?;
        need("pick output", out, rows)?;
        need("pick words", words, rows * PICK_WORDS)?;
        let host = pick_words(picks);
        let mut view = words.slice_mut(..host.len());
        s.memcpy_htod(&host, &mut view)
            .map_err(drv("copying sampling parameters to the device"))?;
        let v = vocab as i32;
        let mut l = Launch::new(s);
        l.ptr(logits).i32(v).ptr(words).ptr_mut(out);
        // SAFETY: matches `kvf_pick_rows` in kernels/sampling.cu (pointer, int, pointer,
        // pointer); `logits` holds `rows * vocab` f32, `words` 6 words a row, `out` `rows` ints
        // (checked above); one block of 1024 threads (a multiple of 32) per row, static shared
        // memory only; it waits for the previous kernel first (PDL).
        unsafe { l.launch(&self.pick_rows, rows_cfg(rows, 1024, 0), self.pdl) }
            .map_err(drv("launching kvf_pick_rows"))?;
        Ok(())
    }

    fn silu_mul(
        &self,
        s: &Arc<CudaStream>,
        gu: &CudaSlice<f32>,
        t: usize,
        ff: usize,
        act: &mut CudaSlice<u16>,
    ) -> Result<(), GpuError> {
        glu(
            s,
            &self.silu_mul,
            self.pdl,
            gu,
            t,
            ff,
            act,
            "launching kvf_silu_mul",
        )
    }

    fn fill_uniform(
        &self,
        s: &Arc<CudaStream>,
        out: &mut CudaSlice<u16>,
        seed: u64,
        a: f32,
    ) -> Result<(), GpuError> {
        let n = out.len();
        let n_i = n as i64;
        let mut b = s.launch_builder(&self.fill_uniform);
        b.arg(&mut *out).arg(&n_i).arg(&seed).arg(&a);
        // SAFETY: matches `kvf_fill_uniform(bf16*, long long, unsigned long long, float)`;
        // writes exactly `out.len()` elements.
        unsafe { b.launch(elemwise_cfg(n)) }.map_err(drv("launching kvf_fill_uniform"))?;
        Ok(())
    }
}

/// Row-major `y[t, n] = x[t, k] · w[n, k]ᵀ` (`+= ` when `accumulate`): bf16 `x` and `w`, f32
/// `y`, f32 accumulation.
///
/// cuBLAS is column-major: a row-major `[r, c]` buffer is the column-major `c × r` matrix (its
/// transpose) with leading dimension `c`. So `y` is column-major `yᵀ` (n × t, ld n), `w` is
/// `wᵀ` (k × n, ld k) and `x` is `xᵀ` (k × t, ld k). We want `yᵀ = w · xᵀ = (wᵀ)ᵀ · xᵀ`:
/// `C = op(A) · op(B)` with `A` = the `w` buffer, `op(A) = Aᵀ` (transa T, lda k), `B` = the
/// `x` buffer (transb N, ldb k), `C` = the `y` buffer (ldc n), and m = n, n = t, k = k.
#[allow(clippy::too_many_arguments)]
fn gemm(
    blas: &CudaBlas,
    s: &Arc<CudaStream>,
    w: &CudaSlice<u16>,
    x: &CudaSlice<u16>,
    y: &mut CudaSlice<f32>,
    t: usize,
    n: usize,
    k: usize,
    accumulate: bool,
) -> Result<(), GpuError> {
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
    let (wp, _rw) = w.device_ptr(s);
    let (xp, _rx) = x.device_ptr(s);
    let (yp, _ry) = y.device_ptr_mut(s);
    // SAFETY: the handle runs on stream `s` (the stream of every buffer here); the buffer
    // sizes were checked above against the shapes described in this function's comment;
    // alpha/beta are host f32 (pointer mode host, compute type 32F); A/B are bf16, C is f32,
    // a combination cublasGemmEx supports.
    unsafe {
        blas_result::gemm_ex(
            *blas.handle(),
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

struct LayerW {
    attn_norm: CudaSlice<f32>,
    /// `[qw + 2 kw, d]`: Q rows, then K rows, then V rows.
    wqkv: CudaSlice<u16>,
    /// `[qw + 2 kw]` (zeros where the model has no bias for a projection).
    bqkv: Option<CudaSlice<f32>>,
    q_norm: Option<CudaSlice<f32>>,
    k_norm: Option<CudaSlice<f32>>,
    /// `[d, qw]`.
    wo: CudaSlice<u16>,
    ffn_norm: CudaSlice<f32>,
    /// `[2 ff, d]`: gate rows, then up rows.
    wgu: CudaSlice<u16>,
    /// `[d, ff]`.
    wdown: CudaSlice<u16>,
    /// Gemma 3: RMSNorm weights of the attention and MLP outputs.
    post_attn_norm: Option<CudaSlice<f32>>,
    post_ffn_norm: Option<CudaSlice<f32>>,
}

struct Weights {
    /// `[vocab, d]`.
    embed: CudaSlice<u16>,
    layers: Vec<LayerW>,
    out_norm: CudaSlice<f32>,
    /// `[vocab, d]`; `None` when tied to `embed`.
    lm_head: Option<CudaSlice<u16>>,
    /// `[rope_dims / 2]`.
    inv_freq: CudaSlice<f32>,
    /// Gemma 3: `[rope_dims / 2]` of the local layers (their own RoPE base).
    inv_freq_local: Option<CudaSlice<f32>>,
    bytes: usize,
}

fn to_bf16(parts: &[&[f32]]) -> Vec<u16> {
    let mut out = Vec::with_capacity(parts.iter().map(|p| p.len()).sum());
    for p in parts {
        let start = out.len();
        out.resize(start + p.len(), 0);
        out[start..]
            .par_iter_mut()
            .zip(p.par_iter())
            .for_each(|(o, x)| *o = bf16::from_f32(*x).to_bits());
    }
    out
}

fn upload_f32(gpu: &Gpu, v: &[f32]) -> Result<CudaSlice<f32>, GpuError> {
    Ok(gpu.upload(v)?)
}

impl Weights {
    /// Converts the CPU model's f32 weights to bf16 (norms, biases and RoPE frequencies stay
    /// f32) and uploads them, fusing Q/K/V and gate/up.
    fn upload(gpu: &Gpu, m: &Llama) -> Result<Self, GpuError> {
        let c = &m.config;
        let t = m.tensors();
        let (qw, kw) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        let mut bytes = 0usize;
        let mut up16 = |parts: &[&[f32]]| -> Result<CudaSlice<u16>, GpuError> {
            let host = to_bf16(parts);
            bytes += host.len() * 2;
            Ok(gpu.upload(&host)?)
        };
        let embed = up16(&[t.embed])?;
        let lm_head = t.lm_head.map(|h| up16(&[h])).transpose()?;
        let mut layers = Vec::with_capacity(t.layers.len());
        for l in &t.layers {
            let bqkv = if l.bq.is_some() || l.bk.is_some() || l.bv.is_some() {
                let mut b = vec![0f32; qw + 2 * kw];
                for (src, off) in [(l.bq, 0), (l.bk, qw), (l.bv, qw + kw)] {
                    if let Some(src) = src {
                        b[off..off + src.len()].copy_from_slice(src);
                    }
                }
                Some(upload_f32(gpu, &b)?)
            } else {
                None
            };
            let q_scale = gemma_q_scale(c);
            layers.push(LayerW {
                attn_norm: upload_f32(gpu, l.attn_norm)?,
                wqkv: up16(&[l.wq, l.wk, l.wv])?,
                bqkv,
                q_norm: l
                    .q_norm
                    .map(|n| upload_f32(gpu, &n.iter().map(|w| w * q_scale).collect::<Vec<_>>()))
                    .transpose()?,
                k_norm: l.k_norm.map(|n| upload_f32(gpu, n)).transpose()?,
                wo: up16(&[l.wo])?,
                ffn_norm: upload_f32(gpu, l.ffn_norm)?,
                wgu: up16(&[l.w_gate, l.w_up])?,
                wdown: up16(&[l.w_down])?,
                post_attn_norm: l.post_attn_norm.map(|n| upload_f32(gpu, n)).transpose()?,
                post_ffn_norm: l.post_ffn_norm.map(|n| upload_f32(gpu, n)).transpose()?,
            });
        }
        Ok(Weights {
            embed,
            layers,
            out_norm: upload_f32(gpu, t.out_norm)?,
            lm_head,
            inv_freq: upload_f32(gpu, t.inv_freq)?,
            inv_freq_local: gemma_inv_freq_local(c).map(|f| upload_f32(gpu, &f)).transpose()?,
            bytes,
        })
    }

    /// Random weights made on the device (uniform in ±1/sqrt(fan-in), like [`Llama::dummy`]
    /// but a different stream of numbers): for capacity and throughput of large geometries
    /// without building them on the host.
    fn random(gpu: &Gpu, k: &ModelKernels, c: &LlamaConfig, seed: u64) -> Result<Self, GpuError> {
        let s = gpu.stream();
        let (d, ff) = (c.d_model, c.d_ff);
        let (qw, kw) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        let mut bytes = 0usize;
        let mut tensor = 0u64;
        let mut rand = |rows: usize, cols: usize| -> Result<CudaSlice<u16>, GpuError> {
            let mut buf = s
                .alloc_zeros::<u16>(rows * cols)
                .map_err(drv("allocating dummy weights"))?;
            tensor += 1;
            let a = 1.0 / (cols as f32).sqrt();
            k.fill_uniform(
                s,
                &mut buf,
                seed.wrapping_mul(0x1000_0001).wrapping_add(tensor),
                a,
            )?;
            bytes += rows * cols * 2;
            Ok(buf)
        };
        let embed = rand(c.vocab, d)?;
        let lm_head = if c.tied_embeddings {
            None
        } else {
            Some(rand(c.vocab, d)?)
        };
        let mut layers = Vec::with_capacity(c.n_layers);
        for _ in 0..c.n_layers {
            layers.push(LayerW {
                attn_norm: upload_f32(gpu, &vec![1.0; d])?,
                wqkv: rand(qw + 2 * kw, d)?,
                bqkv: if c.attn_bias {
                    Some(upload_f32(gpu, &vec![0.0; qw + 2 * kw])?)
                } else {
                    None
                },
                q_norm: c
                    .qk_norm
                    .then(|| upload_f32(gpu, &vec![1.0; c.head_dim]))
                    .transpose()?,
                k_norm: c
                    .qk_norm
                    .then(|| upload_f32(gpu, &vec![1.0; c.head_dim]))
                    .transpose()?,
                wo: rand(d, qw)?,
                ffn_norm: upload_f32(gpu, &vec![1.0; d])?,
                wgu: rand(2 * ff, d)?,
                wdown: rand(d, ff)?,
                post_attn_norm: c
                    .gemma3
                    .as_ref()
                    .map(|_| upload_f32(gpu, &vec![1.0; d]))
                    .transpose()?,
                post_ffn_norm: c
                    .gemma3
                    .as_ref()
                    .map(|_| upload_f32(gpu, &vec![1.0; d]))
                    .transpose()?,
            });
        }
        Ok(Weights {
            embed,
            layers,
            out_norm: upload_f32(gpu, &vec![1.0; d])?,
            lm_head,
            inv_freq: upload_f32(gpu, &inv_freq(c, None))?,
            inv_freq_local: gemma_inv_freq_local(c).map(|f| upload_f32(gpu, &f)).transpose()?,
            bytes,
        })
    }
}

/// Activation buffers for up to `tokens` tokens and `rows` logit rows per step.
struct Acts {
    tokens: usize,
    rows: usize,
    tok: CudaSlice<i32>,
    pos: CudaSlice<i32>,
    last: CudaSlice<i32>,
    /// f32 `[T, d]`, the residual stream.
    x: CudaSlice<f32>,
    /// bf16 `[T, max(d, qw)]`: normed input of the QKV and gate/up GEMMs.
    h: CudaSlice<u16>,
    /// f32 `[T, qw + 2 kw]`.
    qkv: CudaSlice<f32>,
    /// bf16 `[T, n_heads, hd]`.
    q: CudaSlice<u16>,
    /// bf16 `[T, n_kv * kv_rep, hd]`.
    k: CudaSlice<u16>,
    v: CudaSlice<u16>,
    /// bf16 `[T, n_heads, hd]`.
    attn: CudaSlice<u16>,
    /// f32 `[T, 2 ff]`.
    gu: CudaSlice<f32>,
    /// bf16 `[T, ff]`.
    act: CudaSlice<u16>,
    /// bf16 `[R, d]`: normed last rows.
    hl: CudaSlice<u16>,
    /// f32 `[R, vocab]`.
    logits: CudaSlice<f32>,
    /// `[R]`: each row's token.
    picks: CudaSlice<i32>,
    /// `[R, PICK_WORDS]`: each row's sampling parameters (`kvf_pick_rows`).
    pick_words: CudaSlice<u32>,
    /// Gemma 3: f32 `[T, d]`, a sublayer's output before its post-norm (one element otherwise).
    proj: CudaSlice<f32>,
}

impl Acts {
    fn bytes(dm: &Dims, t: usize, r: usize) -> usize {
        let f32s = t * dm.d + t * (dm.qw + 2 * dm.kw) + t * 2 * dm.ff + r * dm.vocab;
        let bf16s = t * dm.d + 2 * t * dm.qw + 2 * t * dm.kw_rep + t * dm.ff + r * dm.d;
        let proj = if dm.gemma { t * dm.d } else { 1 };
        4 * (f32s + proj) + 2 * bf16s + 4 * (2 * t + 2 * r + PICK_WORDS * r)
    }

    fn alloc(s: &Arc<CudaStream>, dm: &Dims, t: usize, r: usize) -> Result<Self, GpuError> {
        let (t, r) = (t.max(1), r.max(1));
        let f = |n: usize| s.alloc_zeros::<f32>(n).map_err(drv("allocating activations"));
        let h = |n: usize| s.alloc_zeros::<u16>(n).map_err(drv("allocating activations"));
        let i = |n: usize| s.alloc_zeros::<i32>(n).map_err(drv("allocating activations"));
        Ok(Acts {
            tokens: t,
            rows: r,
            tok: i(t)?,
            pos: i(t)?,
            last: i(r)?,
            x: f(t * dm.d)?,
            h: h(t * dm.d)?,
            qkv: f(t * (dm.qw + 2 * dm.kw))?,
            q: h(t * dm.qw)?,
            k: h(t * dm.kw_rep)?,
            v: h(t * dm.kw_rep)?,
            attn: h(t * dm.qw)?,
            gu: f(t * 2 * dm.ff)?,
            act: h(t * dm.ff)?,
            hl: h(r * dm.d)?,
            logits: f(r * dm.vocab)?,
            picks: i(r)?,
            pick_words: s
                .alloc_zeros::<u32>(r * PICK_WORDS)
                .map_err(drv("allocating activations"))?,
            proj: f(if dm.gemma { t * dm.d } else { 1 })?,
        })
    }
}

fn upload_into(s: &Arc<CudaStream>, host: &[i32], dst: &mut CudaSlice<i32>) -> Result<(), GpuError> {
    if host.is_empty() {
        return Ok(());
    }
    need("index buffer", dst, host.len())?;
    let mut view = dst.slice_mut(..host.len());
    s.memcpy_htod(host, &mut view)
        .map_err(drv("copying step indices to the device"))
}

/// What a step brings back to the host, and where.
enum StepOut<'a> {
    /// `[rows, vocab]` f32.
    Logits(&'a mut Vec<f32>),
    /// A token a row, picked on the device as each row's pick says.
    Tokens(&'a [RowPick], &'a mut Vec<u32>),
}

/// A Llama-family model on one GPU with its paged KV cache.
pub struct GpuLlama {
    config: LlamaConfig,
    dims: Dims,
    gpu: Arc<Gpu>,
    blas: CudaBlas,
    kernels: ModelKernels,
    weights: Weights,
    acts: Acts,
    backend: CudaBackend,
    capacity: GpuCapacity,
    /// CUDA-event timing of each part of a step, when `KVFLEET_PROFILE=1`.
    profile: Option<GpuSteps>,
    /// Steps of one token take the fused GEMV path.
    single_token_gemv: bool,
}

impl std::fmt::Debug for GpuLlama {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuLlama")
            .field("config", &self.config)
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl GpuLlama {
    /// Opens GPU `ordinal` after checking that everything the GPU path needs is there.
    pub fn open_gpu(ordinal: usize) -> Result<Arc<Gpu>, GpuError> {
        check_available()?;
        Ok(Arc::new(Gpu::open(ordinal)?))
    }

    /// Uploads a CPU model's weights (bf16; norms, biases and RoPE frequencies f32) and
    /// allocates the KV cache in the free memory left.
    pub fn from_llama(gpu: Arc<Gpu>, model: &Llama, opts: &GpuOptions) -> Result<Self, GpuError> {
        Self::check_shapes(&model.config)?;
        let kernels = ModelKernels::load(&gpu)?;
        let weights = Weights::upload(&gpu, model)?;
        Self::assemble(gpu, kernels, weights, model.config.clone(), opts)
    }

    /// Random weights of any geometry made on the device (vLLM's dummy load format), for
    /// capacity and throughput.
    pub fn dummy(gpu: Arc<Gpu>, config: LlamaConfig, seed: u64, opts: &GpuOptions) -> Result<Self, GpuError> {
        config.check().map_err(|e| GpuError::Invalid(e.to_string()))?;
        Self::check_shapes(&config)?;
        let kernels = ModelKernels::load(&gpu)?;
        let weights = Weights::random(&gpu, &kernels, &config, seed)?;
        Self::assemble(gpu, kernels, weights, config, opts)
    }

    /// Whether the GPU kernels cover `c` (head_dim 64/128/256; any GQA group, by replication).
    pub fn check_shapes(c: &LlamaConfig) -> Result<(), GpuError> {
        if c.gemma3.is_some() && !c.qk_norm {
            return Err(GpuError::Unsupported(
                "a Gemma 3 geometry without QK norms (the query scale is folded into the Q norm)".into(),
            ));
        }
        if HeadDim::from_usize(c.head_dim).is_none() {
            return Err(GpuError::Unsupported(format!(
                "head_dim {} (the attention kernels build 64, 128, 256)",
                c.head_dim
            )));
        }
        kv_replication(c.n_heads, c.n_kv_heads)?;
        Ok(())
    }

    fn assemble(
        gpu: Arc<Gpu>,
        kernels: ModelKernels,
        weights: Weights,
        config: LlamaConfig,
        opts: &GpuOptions,
    ) -> Result<Self, GpuError> {
        let (kv_rep, _) = kv_replication(config.n_heads, config.n_kv_heads)?;
        let dims = Dims::new(&config, kv_rep);
        let s = gpu.stream().clone();
        let acts = Acts::alloc(&s, &dims, opts.max_batched_tokens, opts.max_num_seqs)?;
        let activation_bytes = Acts::bytes(&dims, acts.tokens, acts.rows);
        let blas = CudaBlas::new(s.clone()).map_err(cublas_err("creating the cuBLAS handle"))?;
        gpu.synchronize()?;
        gpu.context()
            .bind_to_thread()
            .map_err(drv("binding the context"))?;
        let (free, total) = cudarc::driver::result::mem_get_info().map_err(drv("reading free memory"))?;
        let util = opts.gpu_memory_utilization.clamp(0.0, 1.0);
        let margin = opts
            .memory_margin_bytes
            .unwrap_or_else(|| (((1.0 - util) * total as f64) as usize).max(256 << 20));
        let geo = AttnGeometry {
            n_layers: dims.layers,
            n_heads: dims.n_heads,
            n_kv_heads: dims.n_kv * kv_rep,
            head_dim: dims.hd,
        };
        let dt = opts.kv_dtype;
        let kv_bytes_per_token =
            dims.layers * 2 * geo.n_kv_heads * (dt.data_bytes(dims.hd) + dt.scale_bytes(dims.hd));
        let bs = opts.block_size;
        if bs != BLOCK_SIZE {
            return Err(GpuError::Unsupported(format!(
                "blockSize {bs} (the attention kernels build pages of {BLOCK_SIZE} tokens)"
            )));
        }
        let mut blocks = free.saturating_sub(margin) / (kv_bytes_per_token * bs).max(1);
        if let Some(cap) = opts.max_kv_tokens {
            blocks = blocks.min(cap.div_ceil(bs));
        }
        if blocks == 0 {
            return Err(GpuError::Memory(format!(
                "{} MiB free after {} MiB of weights and {} MiB of activations, {} MiB margin: no room for one \
                 KV page of {} KiB",
                free >> 20,
                weights.bytes >> 20,
                activation_bytes >> 20,
                margin >> 20,
                (kv_bytes_per_token * bs) >> 10
            )));
        }
        let pools = if config.gemma3.is_some() {
            windowed_pools(&config, geo, opts, blocks * bs * kv_bytes_per_token)?
        } else {
            llama_backend_config(geo, dt, bs, blocks)
        };
        if opts.self_test {
            for line in crate::backend::self_test(&gpu, &pools, 0).map_err(GpuError::SelfTest)? {
                tracing::info!("CUDA kernels {line}");
            }
        }
        let backend = CudaBackend::new(gpu.clone(), pools).map_err(backend_err)?;
        let capacity = GpuCapacity {
            device: gpu.name.clone(),
            total_bytes: total,
            weight_bytes: weights.bytes,
            activation_bytes,
            free_bytes: free,
            margin_bytes: margin,
            kv_bytes_per_token,
            kv_heads_stored: geo.n_kv_heads,
            blocks,
            block_size: bs,
            kv_tokens: blocks * bs,
        };
        tracing::info!(
            device = %capacity.device,
            weights_mib = capacity.weight_bytes >> 20,
            activations_mib = capacity.activation_bytes >> 20,
            kv_dtype = dt.as_str(),
            kv_rep,
            kv_blocks = blocks,
            kv_tokens = capacity.kv_tokens,
            kv_gib = (blocks * bs * kv_bytes_per_token) as f64 / (1u64 << 30) as f64,
            "GPU model ready"
        );
        let gpu_ctx = gpu.context().clone();
        Ok(GpuLlama {
            config,
            dims,
            gpu,
            blas,
            kernels,
            weights,
            acts,
            backend,
            capacity,
            single_token_gemv: opts.single_token_gemv && gemv::Gemv::fits(dims.d, &[dims.qw, dims.ff]),
            profile: profile::enabled().then(|| GpuSteps::new(gpu_ctx, PROFILE_PARTS)),
        })
    }

    pub fn capacity(&self) -> &GpuCapacity {
        &self.capacity
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    fn ensure_acts(&mut self, tokens: usize, rows: usize) -> Result<(), GpuError> {
        if tokens <= self.acts.tokens && rows <= self.acts.rows {
            return Ok(());
        }
        let (t, r) = (tokens.max(self.acts.tokens), rows.max(self.acts.rows));
        tracing::debug!(tokens = t, rows = r, "growing GPU activation buffers");
        // Free the old buffers first so the new ones can reuse their memory.
        let s = self.gpu.stream().clone();
        self.acts = Acts::alloc(&s, &self.dims, 1, 1)?;
        self.acts = Acts::alloc(&s, &self.dims, t, r).map_err(|e| {
            GpuError::Memory(format!(
                "activations for {t} tokens and {r} logit rows ({} MiB): {e}",
                Acts::bytes(&self.dims, t, r) >> 20
            ))
        })?;
        Ok(())
    }

    /// The step on the device; host-side checks were done by the caller. Writes every row's
    /// logits, or with picks only each row's token, into `out`.
    fn run(&mut self, t: usize, last: &[i32], out: StepOut<'_>) -> Result<(), GpuError> {
        let GpuLlama {
            config: c,
            dims: dm,
            gpu,
            blas,
            kernels: k,
            weights: w,
            acts: a,
            backend,
            profile,
            single_token_gemv,
            ..
        } = self;
        let s = gpu.stream().clone();
        macro_rules! mark {
            ($part:expr) => {
                if let Some(p) = profile.as_mut() {
                    p.mark(&s, $part)
                        .map_err(drv("recording a profile event"))?;
                }
            };
        }
        // Gemma 3 runs its own block ([`gemma_layers`]); the loop below is the Llama family's.
        let llama_layers: &[LayerW] = if dm.gemma {
            gemma_layers(c, dm, blas, k, w, a, backend, &s, t)?;
            &[]
        } else {
            k.embed(&s, &w.embed, &a.tok, t, dm.d, &mut a.x)?;
            &w.layers
        };
        mark!(part::EMBED);
        let heads = (dm.n_heads + 2 * dm.n_kv) as u32;
        let rope_half = (c.rope_dims / 2) as i32;
        // One token: each projection is one fused GEMV (norm before, residual add or SwiGLU
        // after); otherwise cuBLAS GEMMs with the norm and SwiGLU kernels around them.
        let fused = *single_token_gemv && t == 1;
        let eps = c.rms_eps;
        for (li, l) in llama_layers.iter().enumerate() {
            if fused {
                let input = gemv::Input::normed(&a.x, &l.attn_norm, eps);
                let out = gemv::Output::Store(&mut a.qkv);
                k.gemv.run(&s, &l.wqkv, dm.qw + 2 * dm.kw, dm.d, input, out)?;
            } else {
                k.rms_norm(&s, &a.x, &l.attn_norm, t, dm.d, eps, &mut a.h)?;
                mark!(part::NORM);
                let n = dm.qw + 2 * dm.kw;
                gemm(blas, &s, &l.wqkv, &a.h, &mut a.qkv, t, n, dm.d, false)?;
            }
            mark!(part::QKV_GEMM);
            {
                need("q", &a.q, t * dm.qw)?;
                need("k", &a.k, t * dm.kw_rep)?;
                need("v", &a.v, t * dm.kw_rep)?;
                // Flags say which optional tensors the kernel reads; absent ones get a valid
                // pointer it never dereferences.
                let bias = l.bqkv.as_ref().unwrap_or(&w.inv_freq);
                let qn = l.q_norm.as_ref().unwrap_or(&w.inv_freq);
                let kn = l.k_norm.as_ref().unwrap_or(&w.inv_freq);
                let has_bias = l.bqkv.is_some() as i32;
                let has_qk_norm = (l.q_norm.is_some() && l.k_norm.is_some()) as i32;
                let (nh, nkv, rep, hd) = (dm.n_heads as i32, dm.n_kv as i32, dm.kv_rep as i32, dm.hd as i32);
                let neox = c.rope_neox as i32;
                let (qkv_post, cfg) = k.qkv_post_launch(t, heads, dm.hd);
                let mut l = Launch::new(&s);
                l.ptr(&a.qkv)
                    .ptr(&a.pos)
                    .ptr(bias)
                    .ptr(qn)
                    .ptr(kn)
                    .ptr(&w.inv_freq)
                    .i32(nh)
                    .i32(nkv)
                    .i32(rep)
                    .i32(hd)
                    .i32(rope_half)
                    .i32(neox)
                    .i32(has_bias)
                    .i32(has_qk_norm)
                    .f32(c.rope_linear_scale)
                    .f32(c.rms_eps)
                    .ptr_mut(&mut a.q)
                    .ptr_mut(&mut a.k)
                    .ptr_mut(&mut a.v);
                // SAFETY: matches `kvf_qkv_post(_wide)` in kernels/model.cu (6 pointers, 8 ints, 2
                // floats, 3 pointers in order). qkv holds `t * (qw + 2 kw)` f32 (written by
                // the GEMM above), pos `t` positions, bias `qw + 2 kw` and the norms
                // `head_dim` values when their flags are set, inv_freq `rope_dims / 2`; the
                // outputs were checked above; `qkv_post_launch` sizes the dynamic shared memory
                // for its heads a block. It waits for the previous kernel first (PDL).
                unsafe { l.launch(qkv_post, cfg, k.pdl) }.map_err(drv("launching kvf_qkv_post"))?;
            }
            mark!(part::QKV_POST);
            backend.append_kv(li, &a.k, &a.v).map_err(backend_err)?;
            mark!(part::KV_APPEND);
            backend.attention(li, &a.q, &mut a.attn).map_err(backend_err)?;
            mark!(part::ATTENTION);
            if fused {
                let out = gemv::Output::Add(&mut a.x);
                k.gemv
                    .run(&s, &l.wo, dm.d, dm.qw, gemv::Input::Bf16(&a.attn), out)?;
                mark!(part::O_GEMM);
                let input = gemv::Input::normed(&a.x, &l.ffn_norm, eps);
                let out = gemv::Output::SwiGlu(&mut a.act);
                k.gemv.run(&s, &l.wgu, 2 * dm.ff, dm.d, input, out)?;
                mark!(part::FFN_GEMM);
                let out = gemv::Output::Add(&mut a.x);
                k.gemv
                    .run(&s, &l.wdown, dm.d, dm.ff, gemv::Input::Bf16(&a.act), out)?;
            } else {
                gemm(blas, &s, &l.wo, &a.attn, &mut a.x, t, dm.d, dm.qw, true)?;
                mark!(part::O_GEMM);
                k.rms_norm(&s, &a.x, &l.ffn_norm, t, dm.d, eps, &mut a.h)?;
                mark!(part::NORM);
                gemm(blas, &s, &l.wgu, &a.h, &mut a.gu, t, 2 * dm.ff, dm.d, false)?;
                mark!(part::FFN_GEMM);
                k.silu_mul(&s, &a.gu, t, dm.ff, &mut a.act)?;
                mark!(part::ACT);
                gemm(blas, &s, &l.wdown, &a.act, &mut a.x, t, dm.d, dm.ff, true)?;
            }
            mark!(part::DOWN_GEMM);
        }
        let n = last.len();
        if n == 0 {
            gpu.synchronize()?;
            return Ok(());
        }
        let head = w.lm_head.as_ref().unwrap_or(&w.embed);
        if *single_token_gemv && n == 1 {
            let input = gemv::Input::Normed {
                x: &a.x,
                w: &w.out_norm,
                row: Some(&a.last),
                eps: c.rms_eps,
            };
            let out = gemv::Output::Store(&mut a.logits);
            k.gemv.run(&s, head, dm.vocab, dm.d, input, out)?;
        } else {
            k.rms_norm_rows(&s, &a.x, &a.last, n, &w.out_norm, dm.d, c.rms_eps, &mut a.hl)?;
            gemm(blas, &s, head, &a.hl, &mut a.logits, n, dm.vocab, dm.d, false)?;
        }
        mark!(part::LM_HEAD);
        let vocab = dm.vocab;
        match out {
            StepOut::Tokens(picks, tokens) => {
                // A step of greedy rows only skips the parameters' upload.
                if picks.iter().all(|p| *p == RowPick::Greedy) {
                    k.argmax_rows(&s, &a.logits, n, vocab, &mut a.picks)?;
                } else {
                    k.pick_rows(&s, &a.logits, vocab, picks, &mut a.pick_words, &mut a.picks)?;
                }
                mark!(part::SAMPLE);
                let mut ids = vec![0i32; n];
                s.memcpy_dtoh(&a.picks.slice(..n), &mut ids)
                    .map_err(drv("copying sampled tokens to the host"))?;
                tokens.clear();
                tokens.extend(ids.into_iter().map(|id| id as u32));
            }
            StepOut::Logits(host) => {
                host.resize(n * vocab, 0.0);
                s.memcpy_dtoh(&a.logits.slice(..n * vocab), host.as_mut_slice())
                    .map_err(drv("copying logits to the host"))?;
            }
        }
        gpu.synchronize()?;
        mark!(part::TO_HOST);
        if let Some(p) = profile.as_mut() {
            p.finish(t, n).map_err(drv("reading profile events"))?;
        }
        Ok(())
    }

    /// Host checks, uploads and the backend's plan for a step; returns the step's tokens and
    /// the rows wanting logits.
    fn begin(&mut self, batch: &[SeqChunk<'_>], plan: &StepPlan) -> Result<(usize, Vec<i32>), ForwardError> {
        check_plan(batch, plan)?;
        let c = &self.config;
        let t: usize = batch.iter().map(|s| s.tokens.len()).sum();
        let mut tokens = Vec::with_capacity(t);
        let mut positions = Vec::with_capacity(t);
        let mut last = Vec::new();
        for s in batch {
            for (i, &tok) in s.tokens.iter().enumerate() {
                if tok as usize >= c.vocab {
                    return Err(ForwardError::Token(tok));
                }
                let pos = s.start_pos + i;
                if pos >= c.context_len {
                    return Err(ForwardError::Context {
                        pos,
                        ctx: c.context_len,
                    });
                }
                tokens.push(tok as i32);
                positions.push(pos as i32);
            }
            if s.want_logits && !s.tokens.is_empty() {
                last.push(tokens.len() as i32 - 1);
            }
        }
        if t == 0 {
            return Ok((0, last));
        }
        self.gpu
            .context()
            .bind_to_thread()
            .map_err(drv("binding the context"))?;
        self.ensure_acts(t, last.len())?;
        let s = self.gpu.stream().clone();
        if let Some(p) = self.profile.as_mut() {
            p.start(&s).map_err(drv("recording a profile event"))?;
        }
        self.backend.prepare(plan).map_err(backend_err)?;
        upload_into(&s, &tokens, &mut self.acts.tok)?;
        upload_into(&s, &positions, &mut self.acts.pos)?;
        upload_into(&s, &last, &mut self.acts.last)?;
        if let Some(p) = self.profile.as_mut() {
            p.mark(&s, part::PREPARE)
                .map_err(drv("recording a profile event"))?;
        }
        Ok((t, last))
    }
}

// === Gemma 3 ===
//
// Gemma 3's block on the GPU, apart from the Llama family's step so that the two can change
// independently. Per layer (the CPU's `Llama::forward` with `gemma3` set, in the same order):
// `h = rmsnorm(x)`; `qkv = h · Wqkvᵀ`; Q/K norms (the query scale folded into the Q norm's
// weights) and RoPE with the layer's base (local or global); append K/V to the layer group's
// pages and attend (the local layers' group masks keys outside the window);
// `x += rmsnorm(attn · Woᵀ)`; `h = rmsnorm(x)`; `act = gelu_tanh(gate) * up`;
// `x += rmsnorm(act · Wdownᵀ)`. The embedding is scaled by `sqrt(d)` on the way in; the tied
// LM head reads the unscaled table. The (1 + w) RMSNorm is the plain kernel: the GGUF norm
// tensors already hold 1 + w.

/// The factor folded into the Q norm's weights so that the attention kernels' `1 / sqrt(head_dim)`
/// becomes Gemma's `query_pre_attn_scalar ** -0.5` (1 when the two agree, as for 270M). RoPE is
/// linear, so scaling Q before it equals scaling it after.
fn gemma_q_scale(c: &LlamaConfig) -> f32 {
    c.gemma3
        .as_ref()
        .map_or(1.0, |g| g.query_scale * (c.head_dim as f32).sqrt())
}

/// The local layers' inverse frequencies (Gemma 3's own RoPE base), `None` for other models.
fn gemma_inv_freq_local(c: &LlamaConfig) -> Option<Vec<f32>> {
    c.gemma3.as_ref().map(|g| {
        let mut local = c.clone();
        local.rope_theta = g.rope_theta_local;
        inv_freq(&local, None)
    })
}

/// The KV pools of a model with sliding-window layers in `bytes`: one group per window (and
/// one of the full layers), memory split by what one maxModelLen request needs from each
/// (`capacity::pools_in_bytes`, as the CPU engine and preflight size them).
fn windowed_pools(
    c: &LlamaConfig,
    geo: AttnGeometry,
    opts: &GpuOptions,
    bytes: usize,
) -> Result<BackendConfig, GpuError> {
    use kvfleet_engine::engine::capacity::{pools_in_bytes, PoolParams};
    let layers = c.kv_layers(geo.n_kv_heads).map_err(GpuError::Invalid)?;
    let params = PoolParams {
        block_size: opts.block_size,
        max_model_len: opts.max_model_len.unwrap_or(c.context_len).max(1),
        max_num_batched_tokens: opts.max_batched_tokens,
        dtype: opts.kv_dtype,
        causal: true,
    };
    pools_in_bytes(&layers, &params, bytes as u64).map_err(GpuError::Memory)
}

impl GemmaKernels {
    #[allow(clippy::too_many_arguments)]
    fn embed_scaled(
        &self,
        s: &Arc<CudaStream>,
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
        let mut b = s.launch_builder(&self.embed_scaled);
        b.arg(table).arg(tokens).arg(&d_i).arg(&scale).arg(x);
        // SAFETY: matches `kvf_embed_scaled(const bf16*, const int*, int, float, float*)`; token
        // ids were checked against the vocabulary on the host (the table is `[vocab, d]`), `x`
        // holds `t * d` values (checked above).
        unsafe { b.launch(rows_cfg(t, NORM_THREADS, 0)) }.map_err(drv("launching kvf_embed_scaled"))?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn rms_norm_add(
        &self,
        s: &Arc<CudaStream>,
        y: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        rows: usize,
        d: usize,
        eps: f32,
        x: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        need("post-norm input", y, rows * d)?;
        need("post-norm weight", w, d)?;
        need("residual", x, rows * d)?;
        let d_i = d as i32;
        let mut b = s.launch_builder(&self.rms_norm_add);
        b.arg(y).arg(w).arg(&d_i).arg(&eps).arg(x);
        // SAFETY: matches `kvf_rms_norm_add(const float*, const float*, int, float, float*)`;
        // sizes checked above; one block of NORM_THREADS (a multiple of 32) per row.
        unsafe { b.launch(rows_cfg(rows, NORM_THREADS, 0)) }.map_err(drv("launching kvf_rms_norm_add"))?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn gelu_tanh_mul(
        &self,
        s: &Arc<CudaStream>,
        gu: &CudaSlice<f32>,
        t: usize,
        ff: usize,
        act: &mut CudaSlice<u16>,
        pdl: bool,
    ) -> Result<(), GpuError> {
        glu(
            s,
            &self.gelu_tanh_mul,
            pdl,
            gu,
            t,
            ff,
            act,
            "launching kvf_gelu_tanh_mul",
        )
    }
}

/// Gemma 3's layers for the step's `t` tokens (see the section comment): from the token ids
/// in `a.tok` to the residual stream `a.x` after the last layer.
#[allow(clippy::too_many_arguments)]
fn gemma_layers(
    c: &LlamaConfig,
    dm: &Dims,
    blas: &CudaBlas,
    k: &ModelKernels,
    w: &Weights,
    a: &mut Acts,
    backend: &mut CudaBackend,
    s: &Arc<CudaStream>,
    t: usize,
) -> Result<(), GpuError> {
    let missing = |what: &str| GpuError::Invalid(format!("a Gemma 3 model without {what}"));
    let local_freq = w
        .inv_freq_local
        .as_ref()
        .ok_or_else(|| missing("local RoPE frequencies"))?;
    k.gemma
        .embed_scaled(s, &w.embed, &a.tok, t, dm.d, (dm.d as f32).sqrt(), &mut a.x)?;
    need("q", &a.q, t * dm.qw)?;
    need("k", &a.k, t * dm.kw_rep)?;
    need("v", &a.v, t * dm.kw_rep)?;
    let heads = (dm.n_heads + 2 * dm.n_kv) as u32;
    let (nh, nkv, rep, hd) = (dm.n_heads as i32, dm.n_kv as i32, dm.kv_rep as i32, dm.hd as i32);
    let rope_half = (c.rope_dims / 2) as i32;
    let (neox, has_bias, has_qk_norm) = (c.rope_neox as i32, 0i32, 1i32);
    for (li, l) in w.layers.iter().enumerate() {
        let (Some(qn), Some(kn), Some(post_attn), Some(post_ffn)) =
            (&l.q_norm, &l.k_norm, &l.post_attn_norm, &l.post_ffn_norm)
        else {
            return Err(missing("QK norms and post-norms"));
        };
        let freq = if c.layer_window(li).is_some() {
            local_freq
        } else {
            &w.inv_freq
        };
        k.rms_norm(s, &a.x, &l.attn_norm, t, dm.d, c.rms_eps, &mut a.h)?;
        gemm(
            blas,
            s,
            &l.wqkv,
            &a.h,
            &mut a.qkv,
            t,
            dm.qw + 2 * dm.kw,
            dm.d,
            false,
        )?;
        let (qkv_post, cfg) = k.qkv_post_launch(t, heads, dm.hd);
        let mut b = s.launch_builder(qkv_post);
        // No bias: `freq` stands in for the pointer the kernel never reads.
        b.arg(&a.qkv)
            .arg(&a.pos)
            .arg(freq)
            .arg(qn)
            .arg(kn)
            .arg(freq)
            .arg(&nh)
            .arg(&nkv)
            .arg(&rep)
            .arg(&hd)
            .arg(&rope_half)
            .arg(&neox)
            .arg(&has_bias)
            .arg(&has_qk_norm)
            .arg(&c.rope_linear_scale)
            .arg(&c.rms_eps)
            .arg(&mut a.q)
            .arg(&mut a.k)
            .arg(&mut a.v);
        // SAFETY: matches `kvf_qkv_post(_wide)` in kernels/model.cu (6 pointers, 8 ints, 2 floats, 3
        // pointers in order). qkv holds `t * (qw + 2 kw)` f32 (the GEMM above), pos `t`
        // positions, the norms `head_dim` values, `freq` `rope_dims / 2`; with has_bias 0 the
        // bias pointer is never read; outputs checked above; `qkv_post_launch` sizes the
        // dynamic shared memory.
        unsafe { b.launch(cfg) }.map_err(drv("launching kvf_qkv_post"))?;
        backend.append_kv(li, &a.k, &a.v).map_err(backend_err)?;
        backend.attention(li, &a.q, &mut a.attn).map_err(backend_err)?;
        gemm(blas, s, &l.wo, &a.attn, &mut a.proj, t, dm.d, dm.qw, false)?;
        k.gemma
            .rms_norm_add(s, &a.proj, post_attn, t, dm.d, c.rms_eps, &mut a.x)?;
        k.rms_norm(s, &a.x, &l.ffn_norm, t, dm.d, c.rms_eps, &mut a.h)?;
        gemm(blas, s, &l.wgu, &a.h, &mut a.gu, t, 2 * dm.ff, dm.d, false)?;
        k.gemma.gelu_tanh_mul(s, &a.gu, t, dm.ff, &mut a.act, k.pdl)?;
        gemm(blas, s, &l.wdown, &a.act, &mut a.proj, t, dm.d, dm.ff, false)?;
        k.gemma
            .rms_norm_add(s, &a.proj, post_ffn, t, dm.d, c.rms_eps, &mut a.x)?;
    }
    Ok(())
}

impl Forward for GpuLlama {
    fn config(&self) -> &LlamaConfig {
        &self.config
    }

    fn kv_config(&self) -> &BackendConfig {
        self.backend.config()
    }

    fn forward(&mut self, batch: &[SeqChunk<'_>], plan: &StepPlan) -> Result<Vec<f32>, ForwardError> {
        let (t, last) = self.begin(batch, plan)?;
        if t == 0 {
            return Ok(Vec::new());
        }
        let mut logits = Vec::new();
        self.run(t, &last, StepOut::Logits(&mut logits))?;
        Ok(logits)
    }

    fn forward_rows(
        &mut self,
        batch: &[SeqChunk<'_>],
        plan: &StepPlan,
        picks: &[RowPick],
    ) -> Result<Vec<u32>, ForwardError> {
        let (t, last) = self.begin(batch, plan)?;
        if t == 0 {
            return Ok(Vec::new());
        }
        if picks.len() != last.len() {
            return Err(GpuError::Invalid(format!(
                "{} picks for {} rows wanting logits",
                picks.len(),
                last.len()
            ))
            .into());
        }
        let mut tokens = Vec::with_capacity(picks.len());
        self.run(t, &last, StepOut::Tokens(picks, &mut tokens))?;
        Ok(tokens)
    }

    fn device(&self) -> &'static str {
        "cuda"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gqa_groups_outside_the_kernels_store_replicated_kv_heads() {
        assert_eq!(kv_replication(9, 3).unwrap(), (3, 1), "SmolLM2-135M");
        assert_eq!(kv_replication(32, 8).unwrap(), (1, 4), "Llama 3 8B");
        assert_eq!(kv_replication(28, 4).unwrap(), (7, 1), "Qwen2 7B: group 7");
        assert_eq!(kv_replication(48, 4).unwrap(), (3, 4), "group 12");
        assert_eq!(kv_replication(64, 4).unwrap(), (2, 8), "group 16");
        assert!(kv_replication(10, 4).is_err());
    }

    #[test]
    fn head_dims_outside_the_attention_kernels_are_named_errors() {
        let ok = LlamaConfig::llama(2, 4096, 14336, 32, 8, 128256);
        GpuLlama::check_shapes(&ok).unwrap();
        let bad = LlamaConfig::llama(2, 96 * 4, 512, 4, 2, 100);
        let e = GpuLlama::check_shapes(&bad).unwrap_err().to_string();
        assert!(
            e.contains("head_dim 96") && e.contains("--attention-backend KVFLEET_CPU"),
            "{e}"
        );
    }

    fn gemma_270m() -> LlamaConfig {
        LlamaConfig::gemma3(18, 640, 2048, 262_144, 512)
    }

    #[test]
    fn gemma_pools_split_the_gpu_bytes_by_window_and_admit_more_than_a_full_layer_budget() {
        let c = gemma_270m();
        GpuLlama::check_shapes(&c).unwrap();
        let geo = c.attn_geometry();
        let opts = GpuOptions {
            max_model_len: Some(4096),
            max_batched_tokens: 256,
            ..GpuOptions::default()
        };
        // bf16, 1 KV head of 256: 2 x 512 bytes per layer and token; 1024 pages of every layer.
        let per_token = 18 * 2 * 512;
        let bytes = 1024 * 16 * per_token;
        let pools = windowed_pools(&c, geo, &opts, bytes).unwrap();
        assert_eq!(pools.groups.len(), 2);
        for (i, l) in pools.layers.iter().enumerate() {
            let want = c.layer_window(i).map(|w| w as u32);
            assert_eq!(l.attn.window, want, "layer {i}");
            assert_eq!(
                pools.groups[l.group].window, want,
                "layer {i} reads its window's page table"
            );
        }
        let used: usize = pools
            .groups
            .iter()
            .map(|g| {
                let layers = pools
                    .layers
                    .iter()
                    .filter(|l| pools.groups[l.group] == *g)
                    .count();
                g.num_blocks * layers * 16 * 2 * 512
            })
            .sum();
        assert!(
            used <= bytes && used > bytes * 99 / 100,
            "{used} of {bytes} bytes"
        );
        let a = kvfleet_engine::engine::capacity::admitted(&pools, 4096, 256);
        // Full-layer: 18 x 256 pages per request; window-aware: 3 x 256 + 15 x 48.
        assert!((a.full_layer_max_concurrency - 4.0).abs() < 0.01, "{a:?}");
        let ratio = a.max_concurrency / a.full_layer_max_concurrency;
        assert!((3.0..3.2).contains(&ratio), "{ratio}");
    }

    #[test]
    fn gemma_pools_without_room_for_every_group_are_a_memory_error() {
        let c = gemma_270m();
        let e = windowed_pools(&c, c.attn_geometry(), &GpuOptions::default(), 16 * 1024).unwrap_err();
        assert!(matches!(e, GpuError::Memory(_)), "{e}");
    }

    #[test]
    fn gemma_query_scale_is_folded_only_where_it_differs_from_the_kernels() {
        let mut c = gemma_270m();
        assert_eq!(gemma_q_scale(&c), 1.0, "270M: query_pre_attn_scalar = head_dim");
        c.gemma3.as_mut().unwrap().query_scale = 1.0 / 144f32.sqrt();
        assert!((gemma_q_scale(&c) - 16.0 / 12.0).abs() < 1e-6);
        assert_eq!(gemma_q_scale(&LlamaConfig::llama(2, 64, 96, 4, 2, 40)), 1.0);
        let local = gemma_inv_freq_local(&c).unwrap();
        assert!((local[1] - 10_000f32.powf(-2.0 / 256.0)).abs() < 1e-9);
        assert!(gemma_inv_freq_local(&LlamaConfig::llama(2, 64, 96, 4, 2, 40)).is_none());
    }

    #[test]
    fn admission_leaves_one_partial_page_per_sequence() {
        let cap = GpuCapacity {
            device: "x".into(),
            total_bytes: 0,
            weight_bytes: 0,
            activation_bytes: 0,
            free_bytes: 0,
            margin_bytes: 0,
            kv_bytes_per_token: 1,
            kv_heads_stored: 1,
            blocks: 100,
            block_size: 16,
            kv_tokens: 1600,
        };
        assert_eq!(cap.admission_tokens(10), 1600 - 150);
        assert_eq!(cap.admission_tokens(1000), 16, "never below one page");
    }
}
