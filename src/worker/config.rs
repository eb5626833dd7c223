//! The worker's configuration: a YAML or JSON file (the ConfigMap the controller renders
//! from an InferenceDeployment), or the embedded default, with flags on top.
//!
//! Shape (every key camelCase; `geometry` and `engine` are exactly the InferenceDeployment's
//! `spec.model.geometry` and `spec.engine`):
//! ```yaml
//! modelName: gemma-4-31b-it        # optional, shown in logs and /v1/capacity
//! geometry: {layers: 60, queryHeads: 32, kvHeads: 16, headDim: 256,
//!            slidingWindow: 1024, layerTypes: [...], globalHeadDim: 512}
//! weightBytes: 20401094656         # total over tensor-parallel ranks, bytes (integer)
//! engine: {runtime: kvfleet, kvCacheDtype: auto, attentionBackend: auto,
//!          maxModelLen: 131072, maxNumSeqs: 64, maxNumBatchedTokens: 8192,
//!          blockSize: 16, gpuMemoryUtilization: 0.9, tensorParallelSize: 1, nonCausal: false}
//! resolved: {kvCacheDtype: fp8_e4m3, attentionBackend: KVFLEET_CUDA}   # optional: the
//!                                  # controller's resolution of `auto`; wins over engine's
//! activationReserveBytes: 1073741824  # optional; default 1 GiB on a GPU, 0 on the CPU
//! cpuMemoryBytes: 134217728        # optional; memory the CPU backend treats as its device
//! seed: 0                          # optional; seed of the synthetic Q/K/V
//! ```

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::api::{EngineSpec, LayerType, ModelGeometry};
use crate::compat::{AttentionBackend, KvCacheDtype};

/// GiB in bytes.
pub const GIB: u64 = 1 << 30;

/// What `kvfleet worker` runs.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WorkerConfig {
    #[serde(default = "default_model_name")]
    pub model_name: String,
    pub geometry: ModelGeometry,
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

fn default_model_name() -> String {
    "synthetic".to_string()
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

    /// The embedded default: a small hybrid model (2 sliding + 2 full layers, GQA 4,
    /// head_dim 64) that steps fast on two CPU cores.
    pub fn embedded_default() -> Self {
        WorkerConfig {
            model_name: "kvfleet-tiny-synthetic".into(),
            geometry: ModelGeometry {
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
            },
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
            seed: 0,
        }
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

    /// Runs the attention workload engine on the CPU whatever was asked: a served model holds
    /// the GPU, and two KV caches sized from one gpuMemoryUtilization would not both fit.
    pub fn attention_on_cpu(&mut self) {
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
    fn a_model_on_the_gpu_moves_the_workload_engine_to_the_cpu_even_when_resolved_to_cuda() {
        let yaml = r#"
geometry: {layers: 2, queryHeads: 8, kvHeads: 2, headDim: 128}
engine: {attentionBackend: KVFLEET_CUDA}
resolved: {kvCacheDtype: bfloat16, attentionBackend: KVFLEET_CUDA}
"#;
        let mut c = WorkerConfig::parse(yaml).unwrap();
        assert_eq!(c.attention_backend(), AttentionBackend::KvfleetCuda);
        c.attention_on_cpu();
        assert_eq!(c.attention_backend(), AttentionBackend::KvfleetCpu);
        assert_eq!(
            c.kv_cache_dtype(),
            KvCacheDtype::Bfloat16,
            "only the backend moves"
        );
    }
}
