//! `kvfleet plan`: KV-cache capacity, the vLLM way and the kvfleet way.

use std::path::PathBuf;
use std::process::ExitCode;

use crate::compat::KvCacheDtype;
use crate::plan::memory::{gib_to_bytes, gpu_memory_bytes, gpu_products};
use crate::plan::{
    plan, EngineParams, Geometry, MemoryInput, PlanInputs, ReportingEra, DEFAULT_ACTIVATION_RESERVE_BYTES,
};

/// Plan KV-cache capacity for a model configuration.
///
/// Give either the available KV memory of one GPU (to reproduce a vLLM log line
/// "Available KV cache memory: X GiB") or the GPU and what else it holds (to predict).
/// Exit 0 with the plan, 2 on unusable or inconsistent input.
#[derive(clap::Args, Debug)]
pub struct PlanArgs {
    /// The model's HF config.json (a nested text_config is used for multimodal models).
    #[arg(long)]
    pub model_config: Option<PathBuf>,
    /// Tensor-parallel size: GPUs one replica shards the model over.
    #[arg(long, default_value_t = 1)]
    pub tp: u32,
    /// KV-cache dtype: auto, bfloat16, float16, fp8, fp8_e4m3, fp8_e5m2 or nvfp4.
    #[arg(long, default_value = "auto")]
    pub kv_cache_dtype: String,
    /// Longest context (prompt + output) in tokens.
    #[arg(long)]
    pub max_model_len: Option<u64>,
    /// KV memory of one GPU in GiB, as vLLM logs "Available KV cache memory".
    #[arg(long, conflicts_with_all = ["gpu", "gpu_memory_gib", "weight_gib", "gpu_memory_utilization", "activation_reserve_gib"])]
    pub available_kv_gib: Option<f64>,
    /// GPU product as labelled by GPU Feature Discovery, e.g. NVIDIA-H100-80GB-HBM3.
    #[arg(long, conflicts_with = "gpu_memory_gib")]
    pub gpu: Option<String>,
    /// Memory of one GPU in GiB (instead of --gpu).
    #[arg(long)]
    pub gpu_memory_gib: Option<f64>,
    /// Fraction of GPU memory the engine may use.
    #[arg(long)]
    pub gpu_memory_utilization: Option<f64>,
    /// Weights of the whole model in GiB (all ranks); absent assumes 0.
    #[arg(long)]
    pub weight_gib: Option<f64>,
    /// Per-GPU reserve for activations, CUDA context and graphs in GiB (default 1).
    #[arg(long)]
    pub activation_reserve_gib: Option<f64>,
    /// Tokens per KV-cache block.
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// Most tokens scheduled in one step (the prefill chunk).
    #[arg(long, default_value_t = 8192)]
    pub max_num_batched_tokens: u64,
    /// vLLM version whose "GPU KV cache size" formula to report (e.g. 0.11.2).
    #[arg(long, default_value = "0.21")]
    pub vllm_version: String,
    /// Also report concurrency for requests of this many tokens.
    #[arg(long)]
    pub request_len: Option<u64>,
    /// Layers of a speculative draft model served alongside (their KV counts too).
    #[arg(long, default_value_t = 0)]
    pub draft_layers: u32,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = OutputFormat::Text)]
    pub output: OutputFormat,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    Text,
    Json,
}

pub fn run(args: &PlanArgs) -> ExitCode {
    match run_inner(args) {
        Ok(out) => {
            print!("{out}");
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::from(2)
        }
    }
}

fn gib(name: &str, v: f64) -> Result<u64, String> {
    if !v.is_finite() || v <= 0.0 {
        return Err(format!("--{name} must be a positive number of GiB, got {v}"));
    }
    Ok(gib_to_bytes(v))
}

fn run_inner(a: &PlanArgs) -> Result<String, String> {
    let path = a
        .model_config
        .as_ref()
        .ok_or("--model-config is required: the model's HF config.json")?;
    let max_model_len = a.max_model_len.ok_or("--max-model-len is required")?;
    let dtype: KvCacheDtype = a
        .kv_cache_dtype
        .parse()
        .map_err(|e| format!("--kv-cache-dtype: {e}"))?;
    let era = ReportingEra::for_version(&a.vllm_version).map_err(|e| format!("--vllm-version: {e}"))?;
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let config: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{} is not valid JSON: {e}", path.display()))?;
    let geometry = Geometry::from_hf_config(&config)
        .and_then(|g| g.with_draft_layers(a.draft_layers))
        .map_err(|e| format!("{}: {e}", path.display()))?;

    let memory = if let Some(x) = a.available_kv_gib {
        MemoryInput::AvailableKv {
            bytes: gib("available-kv-gib", x)?,
        }
    } else {
        let gpu_memory_bytes = match (&a.gpu, a.gpu_memory_gib) {
            (Some(product), _) => gpu_memory_bytes(product).ok_or_else(|| {
                let known: Vec<&str> = gpu_products().map(|p| p.label).collect();
                format!("unknown GPU product {product:?}; pass --gpu-memory-gib, or one of: {}", known.join(", "))
            })?,
            (None, Some(g)) => gib("gpu-memory-gib", g)?,
            (None, None) => {
                return Err(
                    "give the KV memory: --available-kv-gib X (from a vLLM log), or --gpu PRODUCT / --gpu-memory-gib G to predict it"
                        .into(),
                )
            }
        };
        let weight_bytes_total = match a.weight_gib {
            Some(0.0) => Some(0),
            Some(w) => Some(gib("weight-gib", w)?),
            None => None,
        };
        let activation_reserve_bytes = match a.activation_reserve_gib {
            Some(0.0) => 0,
            Some(r) => gib("activation-reserve-gib", r)?,
            None => DEFAULT_ACTIVATION_RESERVE_BYTES,
        };
        MemoryInput::Predict {
            gpu_memory_bytes,
            gpu_memory_utilization: a.gpu_memory_utilization.unwrap_or(0.9),
            weight_bytes_total,
            activation_reserve_bytes,
        }
    };
    let inputs = PlanInputs {
        engine: EngineParams {
            tp: a.tp,
            dtype,
            block_size: a.block_size,
            max_model_len,
            max_num_batched_tokens: a.max_num_batched_tokens,
        },
        era,
        memory,
        request_len: a.request_len,
    };
    let plan = plan(&geometry, &inputs).map_err(|e| e.to_string())?;
    match a.output {
        OutputFormat::Text => Ok(plan.explain()),
        OutputFormat::Json => serde_json::to_string_pretty(&plan)
            .map(|s| s + "\n")
            .map_err(|e| format!("cannot encode the plan: {e}")),
    }
}
