//! Checks that need no node: parallelism against the model's heads and the GPUs, the
//! runtime's own limits, the vLLM release and gpuMemoryUtilization.

use super::speculative::speculative_checks;
use super::weights::weights_checks;
use super::{denial, Denial};
use crate::api::{
    EngineQuantization, InferenceDeploymentSpec, Quantization, Runtime, SpeculativeMethod, WeightDtype,
};
use crate::compat::ModelFeatures;

/// Above this gpuMemoryUtilization, warn: at 0.90 the sampler warm-up (maxNumSeqs dummy
/// requests) can OOM with ~1.7 GiB left (seed report, COMPAT.md). It is the CRD's (and
/// vLLM's) default: a value nobody chose must not warn on every apply, so only a value
/// raised above it does.
pub const GPU_MEMORY_UTILIZATION_WARN: f64 = 0.9;

/// What the warning advises instead.
pub const GPU_MEMORY_UTILIZATION_SAFE: f64 = 0.85;

/// The model's features, or a warning when they cannot be known here.
pub(super) fn model_features(spec: &InferenceDeploymentSpec, warnings: &mut Vec<String>) -> ModelFeatures {
    let speculative = spec.engine.speculative.as_ref().map(|s| s.method);
    // A DFlash drafter fills its block with non-causal attention (vLLM picks the drafter's
    // backend like the model's): the non-causal rules judge it.
    let non_causal = spec.engine.non_causal || speculative == Some(SpeculativeMethod::Dflash);
    let quantized = spec.model.quantization.is_quantized();
    let mut f = match (&spec.model.geometry, &spec.model.config) {
        (Some(g), _) => g.features(non_causal, quantized),
        (None, Some(_)) if spec.engine.runtime == Runtime::Kvfleet => {
            // Denied by spec_checks (KvfleetNeedsGeometry): nothing more to warn about.
            ModelFeatures::unknown(non_causal, quantized)
        }
        (None, Some(cfg)) => {
            warnings.push(format!(
                "model.config (ConfigMap {}, key {}) is not read at admission: head-dimension, sliding-window, KV-head and capacity checks were skipped and vLLM finds out at start; write model.geometry to have them checked at kubectl apply",
                cfg.config_map_ref.name, cfg.config_map_ref.key
            ));
            ModelFeatures::unknown(non_causal, quantized)
        }
        (None, None) => {
            warnings.push(
                "model has neither geometry nor config: head-dimension, sliding-window and KV-head checks were skipped".to_string(),
            );
            ModelFeatures::unknown(non_causal, quantized)
        }
    };
    f.quantization = spec.model.quantization;
    f.architecture = spec.model.architecture.clone();
    f.block_size = u32::try_from(spec.engine.block_size).ok();
    f.speculative = speculative;
    f.non_causal_drafter_only = !spec.engine.non_causal && speculative == Some(SpeculativeMethod::Dflash);
    f.fp8_weights = spec.weight_dtype() == WeightDtype::Fp8;
    f.fp8_at_load = spec.engine.quantization == EngineQuantization::Fp8;
    f
}

/// Checks that need no node, in the order their denials are reported.
pub(super) fn spec_checks(
    spec: &InferenceDeploymentSpec,
    denials: &mut Vec<Denial>,
    warnings: &mut Vec<String>,
) {
    kvfleet_checks(spec, denials);
    weights_checks(spec, denials);
    quantization_check(spec, denials);
    speculative_checks(spec, denials, warnings);
    gpu_count_check(spec, denials);
    heads_check(spec, denials);
    gpu_memory_utilization_check(spec, denials, warnings);
}

/// Runtime kvfleet runs one GPU per replica and sizes its cache from model.geometry: the
/// worker refuses anything else at start (preflight exit 3 / 2), so deny it here.
fn kvfleet_checks(spec: &InferenceDeploymentSpec, denials: &mut Vec<Denial>) {
    let engine = &spec.engine;
    if engine.runtime != Runtime::Kvfleet {
        return;
    }
    let tp = i64::from(engine.tensor_parallel_size);
    let pp = i64::from(engine.pipeline_parallel_size);
    if pp > 1 {
        denials.push(denial(
            "spec.engine.pipelineParallelSize",
            "KvfleetSingleGpu",
            format!("runtime kvfleet runs one GPU per replica (its engine has no pipeline parallelism), but pipelineParallelSize is {pp}; set pipelineParallelSize to 1, or use runtime vllm"),
        ));
    }
    if tp > 1 {
        denials.push(denial(
            "spec.engine.tensorParallelSize",
            "KvfleetSingleGpu",
            format!("runtime kvfleet runs one GPU per replica (its engine has no tensor parallelism), but tensorParallelSize is {tp}; set tensorParallelSize to 1 and scale with replicas, or use runtime vllm to shard the model over {tp} GPUs"),
        ));
    }
    if spec.model.geometry.is_none() {
        let source = match &spec.model.config {
            Some(cfg) => format!(
                "model.config (ConfigMap {}, key {}) is read only by the vllm runtime",
                cfg.config_map_ref.name, cfg.config_map_ref.key
            ),
            None => "the model has neither geometry nor config".to_string(),
        };
        denials.push(denial(
            "spec.model.geometry",
            "KvfleetNeedsGeometry",
            format!("runtime kvfleet sizes its KV cache from model.geometry, and {source}; write model.geometry (layers, queryHeads, kvHeads, headDim from the model's config.json: num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim), or use runtime vllm"),
        ));
    }
}

/// `engine.quantization` quantizes an unquantized checkpoint at load. vLLM refuses a
/// `--quantization` that differs from the method the checkpoint's config.json declares
/// (vllm `config/model.py` `_verify_quantization`: "Quantization method specified in the
/// model config (X) does not match the quantization method specified in the `quantization`
/// argument (Y)", vllm#19050), and an FP8 checkpoint in compressed-tensors format declares
/// `compressed-tensors`, so any quantized checkpoint with `engine.quantization` is denied.
fn quantization_check(spec: &InferenceDeploymentSpec, denials: &mut Vec<Denial>) {
    let q = spec.model.quantization;
    if spec.engine.quantization == EngineQuantization::None || q == Quantization::None {
        return;
    }
    let name = serde_json::to_value(q)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default();
    let fix = if q == Quantization::Fp8 {
        "remove engine.quantization: the FP8 checkpoint is served as FP8 from its quantization_config"
    } else {
        "remove engine.quantization, or serve the unquantized checkpoint"
    };
    denials.push(denial(
        "spec.engine.quantization",
        "QuantizationConflict",
        format!("engine.quantization fp8 quantizes an unquantized checkpoint at load, but model.quantization says the checkpoint is already {name}-quantized (vLLM refuses a --quantization that differs from the checkpoint's quantization_config); {fix}"),
    ));
}

/// gpu.count, when given, holds the GPUs one replica shards the model over.
fn gpu_count_check(spec: &InferenceDeploymentSpec, denials: &mut Vec<Denial>) {
    let Some(count) = spec.gpu.as_ref().and_then(|g| g.count) else {
        return;
    };
    let tp = i64::from(spec.engine.tensor_parallel_size);
    let pp = i64::from(spec.engine.pipeline_parallel_size);
    if pp > 1 && i64::from(count) < tp * pp {
        let gpus = tp * pp;
        denials.push(denial(
            "spec.gpu.count",
            "InsufficientGpuCount",
            format!("gpu.count {count} is less than tensorParallelSize {tp} x pipelineParallelSize {pp}: each replica shards the model over {gpus} GPUs; set gpu.count to at least {gpus} (or leave it out) or lower the parallelism"),
        ));
    } else if i64::from(count) < tp {
        denials.push(denial(
            "spec.gpu.count",
            "InsufficientGpuCount",
            format!("gpu.count {count} is less than tensorParallelSize {tp}: each replica shards the model over {tp} GPUs; set gpu.count to at least {tp} or lower tensorParallelSize"),
        ));
    }
}

/// model.geometry has heads, and tensorParallelSize splits them as vLLM requires.
fn heads_check(spec: &InferenceDeploymentSpec, denials: &mut Vec<Denial>) {
    let Some(g) = &spec.model.geometry else {
        return;
    };
    let tp = i64::from(spec.engine.tensor_parallel_size);
    let q = i64::from(g.query_heads);
    let mut kvs = vec![i64::from(g.kv_heads)];
    kvs.extend(g.global_kv_heads.map(i64::from));
    if q < 1 || kvs.iter().any(|kv| *kv < 1) {
        denials.push(denial(
            "spec.model.geometry",
            "InvalidGeometry",
            "model.geometry queryHeads and kvHeads must be at least 1; copy num_attention_heads and num_key_value_heads from the model's config.json".to_string(),
        ));
    } else if tp >= 1 {
        // MLA caches one latent per token: its KV heads need not split.
        let kv_check: &[i64] = if g.kv_lora_rank.is_some() { &[] } else { &kvs };
        if valid_tp(q, kv_check, tp).last() != Some(&tp) {
            denials.push(tensor_parallel_mismatch(tp, q, &kvs, kv_check));
        }
    }
}

/// Valid tensorParallelSize values up to `limit` for these head counts.
fn valid_tp(query_heads: i64, kv_heads: &[i64], limit: i64) -> Vec<i64> {
    (1..=limit)
        .filter(|tp| {
            query_heads % tp == 0
                && kv_heads
                    .iter()
                    .all(|kv| if *tp <= *kv { kv % tp == 0 } else { tp % kv == 0 })
        })
        .collect()
}

/// The denial of a tensorParallelSize that does not split `q` query heads and `kvs` KV
/// heads, naming the heads at fault and the sizes that would.
fn tensor_parallel_mismatch(tp: i64, q: i64, kvs: &[i64], kv_check: &[i64]) -> Denial {
    let options = valid_tp(q, kv_check, 64.min(q.max(kvs[0])).max(1));
    let options: Vec<String> = options.iter().take(8).map(|t| t.to_string()).collect();
    let heads = if q % tp != 0 {
        format!("does not divide the model's {q} query heads")
    } else {
        let kv = kvs
            .iter()
            .find(|kv| {
                if tp <= **kv {
                    **kv % tp != 0
                } else {
                    tp % **kv != 0
                }
            })
            .copied()
            .unwrap_or(kvs[0]);
        format!("and the model's {kv} KV heads do not split evenly (KV heads must be a multiple of tensorParallelSize, or tensorParallelSize a multiple of KV heads)")
    };
    denial(
        "spec.engine.tensorParallelSize",
        "TensorParallelSizeMismatch",
        format!(
            "tensorParallelSize {tp} {heads} (vllm config/model.py verify_with_parallel_config, QKVParallelLinear); use one of {}",
            options.join(", ")
        ),
    )
}

/// gpuMemoryUtilization is in (0, 1], warned about above the default.
fn gpu_memory_utilization_check(
    spec: &InferenceDeploymentSpec,
    denials: &mut Vec<Denial>,
    warnings: &mut Vec<String>,
) {
    let util = spec.engine.gpu_memory_utilization;
    if !(util > 0.0 && util <= 1.0) {
        denials.push(denial(
            "spec.engine.gpuMemoryUtilization",
            "InvalidGpuMemoryUtilization",
            format!("gpuMemoryUtilization {util} must be in (0, 1]; {GPU_MEMORY_UTILIZATION_SAFE} is a safe value"),
        ));
    } else if let Some(w) = gpu_memory_utilization_warning(util) {
        warnings.push(w);
    }
}

/// The warning for a gpuMemoryUtilization raised above the default, if it is.
fn gpu_memory_utilization_warning(util: f64) -> Option<String> {
    (util > GPU_MEMORY_UTILIZATION_WARN).then(|| format!(
        "gpuMemoryUtilization {util} is above the default {GPU_MEMORY_UTILIZATION_WARN}: already at 0.90 the sampler warm-up (maxNumSeqs dummy requests) can run out of memory with ~1.7 GiB left on large models; lower it to {GPU_MEMORY_UTILIZATION_SAFE} (or lower maxNumSeqs) if pods fail at start-up"
    ))
}

/// The vLLM release of a vllm spec (`None` for runtime kvfleet, or when it is unknown: then
/// a denial names the fix). A release newer than kvfleet's table is judged as the newest
/// release in it, with a warning.
pub(super) fn vllm_version_check(
    spec: &InferenceDeploymentSpec,
    denials: &mut Vec<Denial>,
    warnings: &mut Vec<String>,
) -> Option<crate::compat::VllmVersion> {
    use crate::compat::vllm_versions;
    if spec.engine.runtime != Runtime::Vllm {
        if spec.engine.vllm.is_some() {
            warnings.push(
                "spec.engine.vllm is read only by runtime vllm; it is ignored for runtime kvfleet"
                    .to_string(),
            );
        }
        return None;
    }
    match spec.vllm_version() {
        Ok(v) => {
            if v > vllm_versions::newest() {
                warnings.push(format!(
                    "vLLM {v} is newer than {}, the newest release kvfleet's table describes; its flags and rules are assumed to be those of {}",
                    vllm_versions::newest(),
                    vllm_versions::newest()
                ));
            }
            Some(v)
        }
        Err(e) => {
            denials.push(denial(
                "spec.engine.vllm.version",
                "UnknownVllmVersion",
                e.to_string(),
            ));
            None
        }
    }
}
