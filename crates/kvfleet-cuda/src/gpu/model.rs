//! [`GpuLlama`]: a model on one GPU with its paged KV cache; how it is built (weights uploaded
//! or made on the device, activations, the KV pools in the memory left) and which family's
//! layers it runs.

use std::sync::Arc;

use kvfleet_engine::model::linear::LinearQuantization;
use kvfleet_engine::model::llama::{Llama, LlamaConfig};
use kvfleet_engine::model::proposer::Proposer;

use crate::backend::CudaBackend;
use crate::device::{driver_present, Gpu};
use crate::profile::GpuSteps;
use crate::{nvrtc, CudaError};

use super::arena::Acts;
use super::blas::{cublas_present, Blas};
use super::error::{backend_err, drv, GpuError};
use super::features::AuxCapture;
use super::gemma3::Gemma3Family;
use super::gemv::Gemv;
use super::kernels::ModelKernels;
use super::llama::LlamaFamily;
use super::options::{GpuCapacity, GpuOptions};
use super::pools::{size_pools, Memory};
use super::shape::{check_shapes, kv_replication, Dims};
use super::step::{Family, PROFILE_PARTS};
use super::weights::Weights;

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

/// A Llama-family model on one GPU with its paged KV cache.
pub struct GpuLlama {
    pub(super) config: LlamaConfig,
    pub(super) dims: Dims,
    pub(super) gpu: Arc<Gpu>,
    pub(super) blas: Blas,
    pub(super) kernels: ModelKernels,
    pub(super) weights: Weights,
    pub(super) acts: Acts,
    pub(super) backend: CudaBackend,
    pub(super) capacity: GpuCapacity,
    /// The layers of the model's family.
    pub(super) family: &'static dyn Family,
    /// CUDA-event timing of each part of a step, when `GpuTuning::profile`.
    pub(super) profile: Option<GpuSteps>,
    /// Steps of one token take the fused GEMV path.
    pub(super) single_token_gemv: bool,
    /// On that path the Q/K/V GEMV writes the token's K/V into the cache
    /// (`GpuOptions::single_token_append`).
    pub(super) single_token_append: bool,
    /// The hidden states a speculative drafter reads, kept by every step once one is attached.
    pub(super) hidden: Option<AuxCapture>,
    /// The attached drafter, until the serving loop takes it.
    pub(super) proposer: Option<Box<dyn Proposer>>,
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
        // 4-bit checkpoints load packed for the CPU engine; no kernel here reads them yet, so
        // refuse before any upload rather than fail on the packed layers later.
        if let LinearQuantization::W4A16(method) = model.quantization() {
            return Err(GpuError::Unsupported(format!(
                "its linear layers are {} weights, which kvfleet's CUDA engine does not run yet (the CPU engine does; or serve the checkpoint with runtime: vllm)",
                method.describe()
            )));
        }
        Self::check_shapes(&model.config)?;
        Self::check_fp8(&gpu, &model.config, opts)?;
        let kernels = ModelKernels::load(&gpu, opts.fp8_weights, &opts.tuning)?;
        let weights = Weights::upload(&gpu, model, opts.fp8_weights)?;
        Self::assemble(gpu, kernels, weights, model.config.clone(), opts)
    }

    /// Random weights of any geometry made on the device (vLLM's dummy load format), for
    /// capacity and throughput.
    pub fn dummy(gpu: Arc<Gpu>, config: LlamaConfig, seed: u64, opts: &GpuOptions) -> Result<Self, GpuError> {
        config.check().map_err(|e| GpuError::Invalid(e.to_string()))?;
        Self::check_shapes(&config)?;
        Self::check_fp8(&gpu, &config, opts)?;
        let kernels = ModelKernels::load(&gpu, opts.fp8_weights, &opts.tuning)?;
        let weights = Weights::random(&gpu, &kernels, &config, seed, opts.fp8_weights)?;
        Self::assemble(gpu, kernels, weights, config, opts)
    }

    /// With FP8 weights: a device that has FP8, and inner sizes cuBLASLt's FP8 GEMMs take
    /// (multiples of 16).
    fn check_fp8(gpu: &Gpu, c: &LlamaConfig, opts: &GpuOptions) -> Result<(), GpuError> {
        if !opts.fp8_weights {
            return Ok(());
        }
        super::fp8::check_device(gpu)?;
        let (qw, d, ff) = (c.n_heads * c.head_dim, c.d_model, c.d_ff);
        if let Some(k) = [d, qw, ff].into_iter().find(|k| k % 16 != 0) {
            return Err(GpuError::Invalid(format!(
                "FP8 weights need layer widths that are multiples of 16; this model has one of {k}"
            )));
        }
        Ok(())
    }

    /// Whether the GPU kernels cover `c` (head_dim 64/128/256; any GQA group, by replication).
    pub fn check_shapes(c: &LlamaConfig) -> Result<(), GpuError> {
        check_shapes(c)
    }

    /// Activations, cuBLAS and the KV pools in the memory left after them and the weights.
    fn assemble(
        gpu: Arc<Gpu>,
        kernels: ModelKernels,
        weights: Weights,
        config: LlamaConfig,
        opts: &GpuOptions,
    ) -> Result<Self, GpuError> {
        let (kv_rep, _) = kv_replication(config.n_heads, config.n_kv_heads)?;
        let dims = Dims::new(&config, kv_rep).with_fp8(opts.fp8_weights);
        let s = gpu.stream().clone();
        let acts = Acts::alloc(&s, &dims, opts.max_batched_tokens, opts.max_num_seqs)?;
        let blas = Blas::new(s, opts.fp8_weights, &opts.tuning)?;
        gpu.set_fused_merge(opts.tuning.fused_merge)?;
        gpu.synchronize()?;
        gpu.context()
            .bind_to_thread()
            .map_err(drv("binding the context"))?;
        let (free, total) = cudarc::driver::result::mem_get_info().map_err(drv("reading free memory"))?;
        let memory = Memory {
            device: gpu.name.clone(),
            total,
            free,
            weights: weights.bytes,
            activations: Acts::bytes(&dims, acts.tokens, acts.rows),
        };
        let (pools, capacity) = size_pools(&config, &dims, opts, &memory)?;
        if opts.self_test {
            for line in crate::backend::self_test(&gpu, &pools, 0).map_err(GpuError::SelfTest)? {
                tracing::info!("CUDA kernels {line}");
            }
        }
        let backend = CudaBackend::new(gpu.clone(), pools).map_err(backend_err)?;
        tracing::info!(
            device = %capacity.device,
            weights_mib = capacity.weight_bytes >> 20,
            activations_mib = capacity.activation_bytes >> 20,
            kv_dtype = opts.kv_dtype.as_str(),
            kv_rep,
            kv_blocks = capacity.blocks,
            kv_tokens = capacity.kv_tokens,
            kv_gib = (capacity.kv_tokens * capacity.kv_bytes_per_token) as f64 / (1u64 << 30) as f64,
            "GPU model ready"
        );
        let family: &'static dyn Family = if dims.gemma { &Gemma3Family } else { &LlamaFamily };
        let profile = opts
            .tuning
            .profile
            .then(|| GpuSteps::new(gpu.context().clone(), PROFILE_PARTS));
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
            family,
            single_token_gemv: opts.single_token_gemv && Gemv::fits(dims.d, &[dims.qw, dims.ff], dims.fp8),
            single_token_append: opts.single_token_append,
            profile,
            hidden: None,
            proposer: None,
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
}
