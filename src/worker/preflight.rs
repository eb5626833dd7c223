//! Start-up checks that fail fast: everything knowable before the first request is decided
//! here, with one clear message and a distinct exit code.

use std::process::ExitCode;

use serde::Serialize;

use super::nvml::{GpuInfo, Probe};
use crate::api::Runtime;
use crate::compat::{AttentionBackend, ComputeCapability};
use crate::contract::config::{WorkerConfig, GIB};
use crate::plan::{pool_layout, EngineParams, Geometry};
use kvfleet_engine::engine::capacity::{
    size_pools, CapacityError, KvListError, ModelLayer, PoolParams, PoolPlan,
};
use kvfleet_engine::engine::layout::{BackendConfig, KvDtype, KvScales};
use kvfleet_engine::engine::scheduler::SchedulerConfig;

/// Exit codes of `kvfleet worker` (documented in docs/worker.md).
pub use crate::contract::exit;

pub use crate::contract::config::DEFAULT_MAX_WAITING;

/// Why the worker refuses to start.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PreflightError {
    #[error("invalid config: {0}")]
    Config(String),
    #[error("cannot run here: {0}")]
    Incompatible(String),
    #[error("KV cache does not fit: {0}")]
    NoMemory(String),
}

impl PreflightError {
    pub fn exit_code(&self) -> ExitCode {
        ExitCode::from(match self {
            Self::Config(_) => exit::CONFIG,
            Self::Incompatible(_) => exit::INCOMPATIBLE,
            Self::NoMemory(_) => exit::NO_MEMORY,
        })
    }
}

/// Which attention implementation runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    Cpu,
    Cuda,
}

/// What preflight decided.
#[derive(Clone, Debug, PartialEq)]
pub struct Preflight {
    pub backend: BackendKind,
    pub gpu: Option<GpuInfo>,
    pub dtype: KvDtype,
    pub layers: Vec<ModelLayer>,
    pub params: PoolParams,
    pub memory_bytes: u64,
    pub available_kv_bytes: u64,
    pub pools: PoolPlan,
    pub backend_config: BackendConfig,
    pub scheduler: SchedulerConfig,
    pub warnings: Vec<String>,
}

fn positive(what: &str, v: i64) -> Result<usize, PreflightError> {
    if v < 1 {
        return Err(PreflightError::Config(format!(
            "{what} must be at least 1, got {v}"
        )));
    }
    Ok(v as usize)
}

/// The model's geometry as the planner reads it ([`Geometry::from_spec`]): the source of the
/// per-layer KV list the engine allocates and of the planner's prediction alike.
pub fn model_geometry(cfg: &WorkerConfig) -> Result<Geometry, PreflightError> {
    let Some(g) = cfg.geometry.as_ref() else {
        return Err(PreflightError::Config(
            "no model geometry: the worker checks the loaded model's geometry, and none was given".into(),
        ));
    };
    if g.kv_lora_rank.is_some() {
        return Err(PreflightError::Incompatible(KvListError::Mla.to_string()));
    }
    Geometry::from_spec(g).map_err(|e| PreflightError::Config(e.to_string()))
}

/// The model's layers as the engine runs them: the one per-layer KV list
/// ([`ModelLayer::from_geometry`]).
fn kv_list(geometry: &Geometry) -> Result<Vec<ModelLayer>, PreflightError> {
    ModelLayer::from_geometry(geometry).map_err(|e| match e {
        KvListError::Mla => PreflightError::Incompatible(e.to_string()),
        KvListError::Gqa { .. } => PreflightError::Config(e.to_string()),
    })
}

/// The backend `cfg` runs on the probed machine (the CUDA kernels where the first GPU can run
/// the geometry `cfg` gives, else the CPU, as `attentionBackend` allows), with the warnings of
/// that choice: the first part of [`run`], cheap, for the worker to settle its device first.
pub fn backend(cfg: &WorkerConfig, probe: &Probe) -> Result<(BackendKind, Vec<String>), PreflightError> {
    let e = &cfg.engine;
    let mut warnings = Vec::new();
    if e.runtime != Runtime::Kvfleet {
        return Err(PreflightError::Config(
            "engine.runtime is vllm: vLLM pods run the vLLM image, not `kvfleet worker`".into(),
        ));
    }
    if e.tensor_parallel_size != 1 {
        return Err(PreflightError::Incompatible(format!(
            "the kvfleet engine runs one GPU per replica, but tensorParallelSize is {}; set it to 1 or use runtime vllm",
            e.tensor_parallel_size
        )));
    }
    if !(e.gpu_memory_utilization > 0.0 && e.gpu_memory_utilization <= 1.0) {
        return Err(PreflightError::Config(format!(
            "gpuMemoryUtilization {} must be in (0, 1], e.g. 0.9",
            e.gpu_memory_utilization
        )));
    }
    let gpu = match probe {
        Probe::Gpus(g) => g.first().cloned(),
        Probe::NoGpu { .. } => None,
    };
    let no_gpu_reason = match probe {
        Probe::NoGpu { reason } => reason.clone(),
        Probe::Gpus(_) => String::new(),
    };
    let backend = match cfg.attention_backend() {
        AttentionBackend::KvfleetCpu => BackendKind::Cpu,
        AttentionBackend::KvfleetCuda => {
            let Some(g) = &gpu else {
                return Err(PreflightError::Incompatible(format!(
                    "attentionBackend KVFLEET_CUDA needs an NVIDIA GPU but none was found ({no_gpu_reason}); schedule the pod on a GPU node or use KVFLEET_CPU"
                )));
            };
            compat_check(cfg, g)?;
            BackendKind::Cuda
        }
        AttentionBackend::Auto => match &gpu {
            // A GPU the kvfleet kernels support runs them; otherwise attention stays on the CPU.
            Some(g) => match compat_check(cfg, g) {
                Ok(()) => BackendKind::Cuda,
                Err(e) => {
                    warnings.push(format!(
                        "GPU {} cannot run this config with the CUDA kernels ({e}): running attention on the CPU",
                        g.name
                    ));
                    BackendKind::Cpu
                }
            },
            None => BackendKind::Cpu,
        },
        other => {
            return Err(PreflightError::Config(format!(
                "attentionBackend {other} belongs to vLLM; the kvfleet engine runs KVFLEET_CUDA or KVFLEET_CPU (or auto)"
            )))
        }
    };
    Ok((backend, warnings))
}

/// Decides backend, dtype and pool sizes for `cfg` on the probed machine.
pub fn run(cfg: &WorkerConfig, probe: &Probe) -> Result<Preflight, PreflightError> {
    let e = &cfg.engine;
    let (backend, mut warnings) = backend(cfg, probe)?;
    let gpu = match probe {
        Probe::Gpus(g) => g.first().cloned(),
        Probe::NoGpu { .. } => None,
    };
    let dtype = KvDtype::resolve(cfg.kv_cache_dtype(), KvDtype::Bf16);
    let geometry = model_geometry(cfg)?;
    let layers = kv_list(&geometry)?;
    for l in &layers {
        if !dtype.supports_head_dim(l.head_dim) {
            return Err(PreflightError::Incompatible(format!(
                "kvCacheDtype {dtype} needs head_dim to be a multiple of 16, the model has {}; use fp8 or bfloat16",
                l.head_dim
            )));
        }
    }
    let scheduler = SchedulerConfig {
        block_size: positive("engine.blockSize", e.block_size.into())?,
        max_num_seqs: positive("engine.maxNumSeqs", e.max_num_seqs.into())?,
        max_num_batched_tokens: positive("engine.maxNumBatchedTokens", e.max_num_batched_tokens.into())?,
        max_model_len: positive("engine.maxModelLen", e.max_model_len)?,
        max_waiting: cfg.max_waiting.unwrap_or(DEFAULT_MAX_WAITING),
        prefix_caching: e.prefix_caching,
    };
    scheduler.check().map_err(PreflightError::Config)?;
    let params = PoolParams {
        block_size: scheduler.block_size,
        max_model_len: scheduler.max_model_len,
        max_num_batched_tokens: scheduler.max_num_batched_tokens,
        dtype,
        causal: !e.non_causal,
    };
    // Memory: the GPU's total on a GPU backend, the configured host budget on the CPU.
    let (memory_bytes, reserve) = match backend {
        BackendKind::Cuda => (
            gpu.as_ref().map_or(0, |g| g.memory_total_bytes),
            cfg.activation_reserve_bytes.unwrap_or(GIB),
        ),
        BackendKind::Cpu => (
            cfg.cpu_memory_bytes
                .unwrap_or(crate::contract::config::DEFAULT_CPU_MEMORY_BYTES),
            cfg.activation_reserve_bytes.unwrap_or(0),
        ),
    };
    let budget = (memory_bytes as f64 * e.gpu_memory_utilization).floor() as u64;
    let available = budget.saturating_sub(cfg.weight_bytes).saturating_sub(reserve);
    if let (BackendKind::Cuda, Some(g)) = (backend, &gpu) {
        let in_use = g.memory_total_bytes.saturating_sub(g.memory_free_bytes);
        if g.memory_free_bytes < budget {
            return Err(PreflightError::NoMemory(format!(
                "gpuMemoryUtilization {} asks for {:.2} GiB but only {:.2} GiB of {} are free ({:.2} GiB used by other processes); lower gpuMemoryUtilization",
                e.gpu_memory_utilization,
                budget as f64 / GIB as f64,
                g.memory_free_bytes as f64 / GIB as f64,
                g.name,
                in_use as f64 / GIB as f64
            )));
        }
    }
    let pools = size_pools(&layers, &params, available).map_err(|err| match err {
        CapacityError::NoLayers => PreflightError::Config(err.to_string()),
        CapacityError::Layout(l) => PreflightError::Incompatible(l.to_string()),
    })?;
    let pools = planner_sized(&geometry, &params, available, pools, &mut warnings);
    if pools.max_concurrency < 1.0 {
        return Err(PreflightError::NoMemory(format!(
            "{:.3} GiB left for the KV cache ({:.3} GiB x {} - {:.3} GiB weights - {:.3} GiB reserve) hold {} tokens, less than one maxModelLen {} request; lower maxModelLen, use kvCacheDtype fp8, or raise gpuMemoryUtilization",
            available as f64 / GIB as f64,
            memory_bytes as f64 / GIB as f64,
            e.gpu_memory_utilization,
            cfg.weight_bytes as f64 / GIB as f64,
            reserve as f64 / GIB as f64,
            pools.capacity_tokens,
            scheduler.max_model_len
        )));
    }
    let backend_config = pools.backend_config(&layers, &params, KvScales::default());
    backend_config
        .check()
        .map_err(|e| PreflightError::Incompatible(e.to_string()))?;
    Ok(Preflight {
        backend,
        gpu,
        dtype,
        layers,
        params,
        memory_bytes,
        available_kv_bytes: available,
        pools,
        backend_config,
        scheduler,
        warnings,
    })
}

/// The compat rules of the kvfleet runtime for the real device (`compat::rules`).
pub fn compat_check(cfg: &WorkerConfig, gpu: &GpuInfo) -> Result<(), PreflightError> {
    let cc = ComputeCapability::new(gpu.compute_capability.0, gpu.compute_capability.1);
    let Some(geometry) = cfg.geometry.as_ref() else {
        return Err(PreflightError::Config("no model geometry to check".into()));
    };
    let mut features = geometry.features(cfg.engine.non_causal, false);
    features.block_size = u32::try_from(cfg.engine.block_size).ok();
    let eval = crate::compat::evaluate(
        Runtime::Kvfleet,
        cc,
        &features,
        cfg.kv_cache_dtype(),
        AttentionBackend::KvfleetCuda,
    );
    match eval.violations.first() {
        Some(v) if !eval.runs() => Err(PreflightError::Incompatible(format!(
            "{} (GPU {} is sm_{}; rule {}, {})",
            v.message,
            gpu.name,
            cc.sm_number(),
            v.rule,
            v.source
        ))),
        _ => Ok(()),
    }
}

/// Pool sizes from the planner (`plan::pool_layout`), so that the measured capacity is the
/// predicted one; the local sizing stays when the planner groups layers differently.
fn planner_sized(
    geometry: &Geometry,
    params: &PoolParams,
    available: u64,
    mut pools: PoolPlan,
    warnings: &mut Vec<String>,
) -> PoolPlan {
    let planned = pool_layout(
        geometry,
        &EngineParams {
            tp: 1,
            dtype: params.dtype.spec(),
            block_size: params.block_size as u32,
            max_model_len: params.max_model_len as u64,
            max_num_batched_tokens: params.max_num_batched_tokens as u64,
        },
        available,
    );
    match planned {
        Ok(p)
            if p.groups.len() == pools.groups.len()
                && p.groups.iter().zip(&pools.groups).all(|(a, b)| {
                    a.layers == b.layers
                        && a.block_bytes == b.block_bytes
                        && a.blocks_per_request == b.blocks_per_request
                }) =>
        {
            for (a, b) in p.groups.iter().zip(pools.groups.iter_mut()) {
                b.num_blocks = a.num_blocks;
            }
            pools.pool_bytes = pools.groups.iter().map(|g| g.num_blocks * g.block_bytes).sum();
            pools.max_concurrency = p.max_concurrency;
            pools.capacity_tokens = p.capacity_tokens;
            pools.full_layer_max_concurrency = p.full_layer_max_concurrency;
        }
        Ok(_) => warnings
            .push("the planner groups this model's layers differently; pools sized by the worker".into()),
        Err(e) => warnings.push(format!(
            "the planner cannot size this model ({e}); pools sized by the worker"
        )),
    }
    pools
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::LayerType;
    use crate::compat::KvCacheDtype;

    /// A small hybrid geometry (2 sliding + 2 full layers, GQA 4, head_dim 64) with the
    /// embedded default's engine limits.
    fn hybrid() -> WorkerConfig {
        let mut c = WorkerConfig::embedded_default();
        c.geometry = Some(crate::api::ModelGeometry {
            layers: 4,
            query_heads: 8,
            kv_heads: 2,
            head_dim: 64,
            sliding_window: Some(256),
            layer_types: Some(vec![
                LayerType::SlidingAttention,
                LayerType::FullAttention,
                LayerType::SlidingAttention,
                LayerType::FullAttention,
            ]),
            global_head_dim: None,
            global_kv_heads: None,
            kv_lora_rank: None,
            qk_rope_head_dim: None,
            draft_layers: None,
            hidden_size: None,
            vocab_size: None,
            intermediate_size: None,
            moe: None,
        });
        c
    }

    #[test]
    fn a_config_without_geometry_is_a_config_error() {
        let e = run(&WorkerConfig::embedded_default(), &no_gpu()).unwrap_err();
        assert_eq!(e.exit_code(), ExitCode::from(exit::CONFIG), "{e}");
    }

    fn no_gpu() -> Probe {
        Probe::NoGpu {
            reason: "test".into(),
        }
    }

    #[test]
    fn a_hybrid_model_passes_on_a_machine_without_gpu() {
        let p = run(&hybrid(), &no_gpu()).unwrap();
        assert_eq!(p.backend, BackendKind::Cpu);
        assert_eq!(p.pools.groups.len(), 2);
        assert!(p.pools.max_concurrency >= 1.0);
        assert!(
            p.warnings.is_empty(),
            "the planner sized the pools: {:?}",
            p.warnings
        );
    }

    #[test]
    fn bf16_kv_on_an_h100_passes_the_kvfleet_compat_rules() {
        let mut c = hybrid();
        c.engine.kv_cache_dtype = KvCacheDtype::Bfloat16;
        assert_eq!(compat_check(&c, &h100()), Ok(()));
    }

    fn h100() -> GpuInfo {
        GpuInfo {
            index: 0,
            name: "NVIDIA H100 80GB HBM3".into(),
            product: "NVIDIA-H100-80GB-HBM3".into(),
            compute_capability: (9, 0),
            memory_total_bytes: 80 << 30,
            memory_free_bytes: 79 << 30,
            driver_version: "580".into(),
        }
    }

    #[test]
    fn auto_on_a_supported_gpu_picks_the_cuda_backend_and_sizes_gpu_memory() {
        let p = run(&hybrid(), &Probe::Gpus(vec![h100()])).unwrap();
        assert_eq!(p.backend, BackendKind::Cuda);
        assert_eq!(p.memory_bytes, 80 << 30);
        let mut c = hybrid();
        c.engine.attention_backend = AttentionBackend::KvfleetCuda;
        assert_eq!(
            run(&c, &Probe::Gpus(vec![h100()])).unwrap().backend,
            BackendKind::Cuda
        );
    }

    #[test]
    fn auto_on_a_pre_ampere_gpu_falls_back_to_the_cpu_and_explicit_cuda_is_refused() {
        let mut t4 = h100();
        t4.name = "Tesla T4".into();
        t4.compute_capability = (7, 5);
        let p = run(&hybrid(), &Probe::Gpus(vec![t4.clone()])).unwrap();
        assert_eq!(p.backend, BackendKind::Cpu);
        assert!(
            p.warnings.iter().any(|w| w.contains("Tesla T4")),
            "{:?}",
            p.warnings
        );
        let mut c = hybrid();
        c.engine.attention_backend = AttentionBackend::KvfleetCuda;
        let err = run(&c, &Probe::Gpus(vec![t4])).unwrap_err();
        assert_eq!(err.exit_code(), ExitCode::from(exit::INCOMPATIBLE));
    }

    #[test]
    fn cuda_without_a_gpu_fails_with_the_incompatible_exit_code() {
        let mut c = hybrid();
        c.engine.attention_backend = AttentionBackend::KvfleetCuda;
        let err = run(&c, &no_gpu()).unwrap_err();
        assert!(err.to_string().contains("needs an NVIDIA GPU"), "{err}");
        assert_eq!(err.exit_code(), ExitCode::from(exit::INCOMPATIBLE));
    }

    #[test]
    fn a_cache_smaller_than_one_request_fails_with_the_memory_exit_code() {
        let mut c = hybrid();
        c.cpu_memory_bytes = Some(1 << 20);
        let err = run(&c, &no_gpu()).unwrap_err();
        assert_eq!(err.exit_code(), ExitCode::from(exit::NO_MEMORY));
        assert!(err.to_string().contains("lower maxModelLen"), "{err}");
    }

    #[test]
    fn nvfp4_with_an_odd_head_dim_and_vllm_backends_are_refused() {
        let mut c = hybrid();
        c.engine.kv_cache_dtype = KvCacheDtype::Nvfp4;
        c.geometry.as_mut().unwrap().head_dim = 72;
        assert!(matches!(run(&c, &no_gpu()), Err(PreflightError::Incompatible(_))));
        let mut c = hybrid();
        c.engine.attention_backend = AttentionBackend::FlashInfer;
        assert!(matches!(run(&c, &no_gpu()), Err(PreflightError::Config(_))));
    }
}
