//! The worker's configuration: a YAML or JSON file (the ConfigMap the controller renders
//! from an InferenceDeployment), or the embedded default, with flags on top.
//!
//! Shape (every key camelCase; `geometry` and `engine` are exactly the InferenceDeployment's
//! `spec.model.geometry` and `spec.engine`):
//! ```yaml
//! modelName: meta-llama/Llama-3.1-8B-Instruct   # the id in the OpenAI API
//! model:                           # what to serve; absent: --model or the embedded SmolLM2
//!   path: /models/llama/           # GGUF file or HF checkpoint directory (on the weights volume)
//!   weights: load                  # load | dummy (random weights of `config`'s geometry)
//!   config: /etc/kvfleet/model/config.json   # geometry for dummy weights
//! geometry: {layers: 32, queryHeads: 32, kvHeads: 8, headDim: 128}   # optional: checked
//!                                  # against the loaded model's real geometry
//! weightBytes: 16060522496         # optional; the planner's prediction only
//! engine: {runtime: kvfleet, kvCacheDtype: auto, attentionBackend: auto,
//!          maxModelLen: 8192, maxNumSeqs: 64, maxNumBatchedTokens: 2048,
//!          blockSize: 16, gpuMemoryUtilization: 0.9, tensorParallelSize: 1}
//! resolved: {kvCacheDtype: fp8_e4m3, attentionBackend: KVFLEET_CUDA}   # optional: the
//!                                  # controller's resolution of `auto`; wins over engine's
//! cpuMemoryBytes: 134217728        # optional; memory the CPU backend gives its KV pools
//! maxKvTokens: 65536               # optional; caps the KV pools
//! maxWaiting: 1024                 # optional; queued requests beyond it get 429
//! seed: 0                          # optional; seed of dummy weights
//! ```

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::model::ModelSource;
use crate::api::{EngineSpec, ModelGeometry};
use crate::compat::{AttentionBackend, KvCacheDtype};

/// Requests queued (not yet running) before the worker answers 429 (`maxWaiting`).
pub const DEFAULT_MAX_WAITING: usize = 1024;

/// GiB in bytes.
pub const GIB: u64 = 1 << 30;

/// What `kvfleet worker` runs.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WorkerConfig {
    /// The id in the OpenAI API; absent: from the model file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<ModelSource>,
    /// The spec's geometry, checked against the loaded model's; absent: the model's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub geometry: Option<ModelGeometry>,
    #[serde(default)]
    pub weight_bytes: u64,
    #[serde(default)]
    pub engine: EngineSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resolved: Option<ResolvedEngine>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activation_reserve_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_memory_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_kv_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_waiting: Option<usize>,
    /// Where KV events are published (`--kv-events-endpoint`); absent: `tcp://*:<port>` of
    /// `engine.kvEvents` when it is enabled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events_endpoint: Option<String>,
    #[serde(default)]
    pub seed: u64,
}

/// The controller's resolution of `auto` for the node's architecture.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ResolvedEngine {
    pub kv_cache_dtype: KvCacheDtype,
    pub attention_backend: AttentionBackend,
}

/// Default CPU "device" memory: 128 MiB.
pub const DEFAULT_CPU_MEMORY_BYTES: u64 = 128 << 20;

/// A configuration that cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read worker config {path}: {source}; pass an existing file to --config")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "worker config {path} is not valid YAML/JSON of the documented shape (docs/worker.md): {source}"
    )]
    Parse {
        path: String,
        #[source]
        source: serde_yaml::Error,
    },
}

impl WorkerConfig {
    /// Reads a YAML or JSON file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text).map_err(|source| ConfigError::Parse {
            path: path.display().to_string(),
            source,
        })
    }

    pub fn parse(text: &str) -> Result<Self, serde_yaml::Error> {
        serde_yaml::from_str(text)
    }

    /// The embedded default: the embedded SmolLM2 (the model source's default) on the CPU
    /// with limits that step quickly on two cores.
    pub fn embedded_default() -> Self {
        WorkerConfig {
            model_name: None,
            model: None,
            geometry: None,
            weight_bytes: 0,
            engine: EngineSpec {
                max_model_len: 4096,
                max_num_seqs: 32,
                max_num_batched_tokens: 512,
                block_size: 16,
                ..EngineSpec::default()
            },
            resolved: None,
            activation_reserve_bytes: None,
            cpu_memory_bytes: Some(DEFAULT_CPU_MEMORY_BYTES),
            max_kv_tokens: None,
            max_waiting: None,
            kv_events_endpoint: None,
            seed: 0,
        }
    }

    /// The KV-events endpoint and topic, when events are on.
    pub fn kv_events(&self) -> Option<(String, String)> {
        let spec = self.engine.kv_events.as_ref().filter(|k| k.enabled)?;
        let endpoint = self
            .kv_events_endpoint
            .clone()
            .unwrap_or_else(|| format!("tcp://*:{}", spec.port));
        Some((endpoint, spec.topic.clone()))
    }

    /// KV dtype after the controller's resolution.
    pub fn kv_cache_dtype(&self) -> KvCacheDtype {
        self.resolved
            .map(|r| r.kv_cache_dtype)
            .unwrap_or(self.engine.kv_cache_dtype)
    }

    /// Attention backend after the controller's resolution.
    pub fn attention_backend(&self) -> AttentionBackend {
        self.resolved
            .map(|r| r.attention_backend)
            .unwrap_or(self.engine.attention_backend)
    }

    /// Runs the model and attention on the CPU whatever was asked (auto found no usable GPU
    /// path).
    pub fn force_cpu(&mut self) {
        self.engine.attention_backend = AttentionBackend::KvfleetCpu;
        if let Some(r) = &mut self.resolved {
            r.attention_backend = AttentionBackend::KvfleetCpu;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_documented_shape_parses_and_unknown_keys_are_refused() {
        let yaml = r#"
modelName: m
geometry: {layers: 2, queryHeads: 8, kvHeads: 2, headDim: 128}
weightBytes: 1000
engine: {kvCacheDtype: fp8, maxModelLen: 1024, blockSize: 16}
resolved: {kvCacheDtype: fp8_e4m3, attentionBackend: KVFLEET_CPU}
cpuMemoryBytes: 1048576
"#;
        let c = WorkerConfig::parse(yaml).unwrap();
        assert_eq!(c.kv_cache_dtype(), KvCacheDtype::Fp8E4m3);
        assert_eq!(c.attention_backend(), AttentionBackend::KvfleetCpu);
        assert_eq!(c.engine.max_num_seqs, 256, "engine defaults as in the CRD");
        assert!(WorkerConfig::parse(
            "geometry: {layers: 1, queryHeads: 1, kvHeads: 1, headDim: 64}\nbogus: 1"
        )
        .is_err());
        let json = serde_json::to_string(&WorkerConfig::embedded_default()).unwrap();
        assert_eq!(
            WorkerConfig::parse(&json).unwrap(),
            WorkerConfig::embedded_default()
        );
    }

    #[test]
    fn forcing_the_cpu_moves_only_the_backend() {
        let yaml = r#"
geometry: {layers: 2, queryHeads: 8, kvHeads: 2, headDim: 128}
engine: {attentionBackend: KVFLEET_CUDA}
resolved: {kvCacheDtype: bfloat16, attentionBackend: KVFLEET_CUDA}
"#;
        let mut c = WorkerConfig::parse(yaml).unwrap();
        assert_eq!(c.attention_backend(), AttentionBackend::KvfleetCuda);
        c.force_cpu();
        assert_eq!(c.attention_backend(), AttentionBackend::KvfleetCpu);
        assert_eq!(
            c.kv_cache_dtype(),
            KvCacheDtype::Bfloat16,
            "only the backend moves"
        );
    }

    #[test]
    fn the_model_section_names_path_weights_and_config() {
        let c = WorkerConfig::parse(
            "model: {path: /models/m.gguf, weights: load}\nmodelName: m\nengine: {maxModelLen: 1024}",
        )
        .unwrap();
        let m = c.model.unwrap();
        assert_eq!(m.path.as_deref(), Some(std::path::Path::new("/models/m.gguf")));
        assert_eq!(m.weights, crate::contract::model::Weights::Load);
        assert!(WorkerConfig::parse("model: {path: /m, weights: random}").is_err());
    }
}
