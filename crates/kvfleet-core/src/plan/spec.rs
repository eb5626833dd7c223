//! Capacity of an `InferenceDeployment` spec on one GPU product, for the validator
//! (deny what cannot fit one request) and the controller (status.capacity).

use serde::Serialize;

use super::bytes::check_tensor_parallel;
use super::draft::{DraftKind, DraftShape};
use super::engine_memory::EngineShape;
use super::geometry::Geometry;
use super::kvfleet::pool_layout;
use super::memory::{fmt_gib, parse_quantity_bytes, DEFAULT_ACTIVATION_RESERVE_BYTES};
use super::report::{plan, MemoryInput, Plan, PlanInputs};
use super::vllm::{vllm_plan, EngineParams, ReportingEra};
use super::weights::LinearLayers;
use super::PlanError;
use crate::api::{
    EngineQuantization, InferenceDeploymentSpec, Quantization, Runtime, SpeculativeMethod, WeightsFormat,
};
use crate::compat::KvCacheDtype;

/// What would make a spec that does not fit fit.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct FixHint {
    /// The largest maxModelLen for which one request fits (None: not even 1 token fits).
    pub max_model_len_that_fits: Option<u64>,
    /// Whether an fp8 KV cache would fit one request at the current maxModelLen.
    pub fp8_fits: bool,
    /// The smallest larger tensorParallelSize (dividing the heads) at which it fits.
    pub tensor_parallel_size_that_fits: Option<u32>,
}

/// Predicted KV capacity of one replica of a spec.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SpecCapacity {
    pub runtime: Runtime,
    /// kvfleet's capacity in tokens per replica (requests of maxModelLen).
    pub kvfleet_tokens: u64,
    /// What vLLM would log as "GPU KV cache size" (v0.21+ definition).
    pub vllm_tokens: u64,
    /// Requests of maxModelLen that fit at once in kvfleet's engine.
    pub max_concurrency: f64,
    /// vLLM's logged "Maximum concurrency".
    pub vllm_max_concurrency: f64,
    /// KV memory per GPU.
    pub available_kv_bytes: u64,
    /// Bytes one maxModelLen request needs per GPU in the selected runtime.
    pub bytes_per_request: u64,
    /// Whether one maxModelLen request fits in the selected runtime.
    pub fits_one_request: bool,
    /// Assumptions made (absent weights, the activation reserve).
    pub explanation: Vec<String>,
    /// Present when the spec does not fit.
    pub fix: Option<FixHint>,
    /// Every number behind the estimate.
    pub plan: Plan,
}

impl SpecCapacity {
    /// A denial message naming the fix, or `None` when one request fits.
    pub fn fix_hint(&self) -> Option<String> {
        self.fix_hint_on(None)
    }

    /// [`Self::fix_hint`] for nodes with at most `max_gpus_per_node` GPUs (`None`: any):
    /// a larger tensorParallelSize is suggested only where the nodes have that many GPUs,
    /// and never for runtime kvfleet (one GPU per replica).
    pub fn fix_hint_on(&self, max_gpus_per_node: Option<i64>) -> Option<String> {
        if self.fits_one_request {
            return None;
        }
        let p = &self.plan.inputs.engine;
        let mut fixes = Vec::new();
        let fix = self.fix.clone().unwrap_or_default();
        if let Some(l) = fix.max_model_len_that_fits {
            fixes.push(format!("lower maxModelLen to {l}"));
        }
        if fix.fp8_fits {
            fixes.push("use kvCacheDtype fp8".to_string());
        }
        let tp_fix = fix
            .tensor_parallel_size_that_fits
            .filter(|_| self.runtime == Runtime::Vllm)
            .filter(|tp| max_gpus_per_node.is_none_or(|max| i64::from(*tp) <= max));
        if let Some(tp) = tp_fix {
            fixes.push(format!("raise tensorParallelSize (and gpu.count) to {tp}"));
        }
        if fixes.is_empty() {
            fixes.push("choose GPUs with more memory or a smaller model".to_string());
        }
        Some(format!(
            "maxModelLen {} needs {} GiB of KV cache per GPU for one request, but only {} GiB are available ({} runtime, kvCacheDtype {}, tensorParallelSize {}): {}",
            p.max_model_len,
            fmt_gib(self.bytes_per_request),
            fmt_gib(self.available_kv_bytes),
            self.runtime,
            p.dtype,
            p.tp,
            fixes.join(", or ")
        ))
    }
}

/// [`spec_capacity_with`] with the default activation reserve and vLLM >= 0.21 reporting.
pub fn spec_capacity(
    spec: &InferenceDeploymentSpec,
    geometry: &Geometry,
    gpu_memory_bytes: u64,
    resolved_dtype: KvCacheDtype,
) -> Result<SpecCapacity, PlanError> {
    // vLLM's capacity arithmetic follows the spec's release (e.g. Gemma 4 between 0.20 and
    // 0.21, vllm#43308); an unknown release (denied elsewhere) plans as the newest.
    let era = match spec.engine.runtime {
        Runtime::Vllm => spec
            .vllm_version()
            .ok()
            .and_then(|v| ReportingEra::for_version(&v.to_string()).ok())
            .unwrap_or(ReportingEra::V0_21On),
        Runtime::Kvfleet => ReportingEra::V0_21On,
    };
    spec_capacity_with(
        spec,
        geometry,
        gpu_memory_bytes,
        resolved_dtype,
        DEFAULT_ACTIVATION_RESERVE_BYTES,
        era,
    )
}

fn engine_params(spec: &InferenceDeploymentSpec, dtype: KvCacheDtype) -> Result<EngineParams, PlanError> {
    let e = &spec.engine;
    let pos = |name: &str, v: i64| -> Result<u64, PlanError> {
        u64::try_from(v)
            .ok()
            .filter(|v| *v > 0)
            .ok_or_else(|| PlanError::InvalidInput(format!("spec.engine.{name} must be at least 1, got {v}")))
    };
    Ok(EngineParams {
        tp: pos("tensorParallelSize", i64::from(e.tensor_parallel_size))? as u32,
        dtype,
        block_size: pos("blockSize", i64::from(e.block_size))? as u32,
        max_model_len: pos("maxModelLen", e.max_model_len)?,
        max_num_batched_tokens: pos("maxNumBatchedTokens", i64::from(e.max_num_batched_tokens))?,
    })
}

/// Capacity of `spec` with `geometry` on GPUs of `gpu_memory_bytes` each.
pub fn spec_capacity_with(
    spec: &InferenceDeploymentSpec,
    geometry: &Geometry,
    gpu_memory_bytes: u64,
    resolved_dtype: KvCacheDtype,
    activation_reserve_bytes: u64,
    era: ReportingEra,
) -> Result<SpecCapacity, PlanError> {
    let engine = engine_params(spec, resolved_dtype)?;
    // Pipeline stages split the layers (and the weights): each GPU holds the KV of its stage's
    // layers for every token, so the replica's tokens are those of its largest stage.
    let stages = u64::try_from(spec.engine.pipeline_parallel_size)
        .unwrap_or(1)
        .max(1);
    let stage;
    let geometry = if stages > 1 {
        stage = pipeline_stage(geometry, stages);
        &stage
    } else {
        geometry
    };
    let weights = spec
        .model
        .weight_bytes
        .as_ref()
        .map(|q| parse_quantity_bytes(&q.0))
        .transpose()?
        .map(|w| w.div_ceil(stages));
    let mut weight_notes = Vec::new();
    let weights = weights.map(|w| fp8_at_load(spec, w, stages, &mut weight_notes));
    let util = spec.engine.gpu_memory_utilization;
    let shape = match spec.engine.runtime {
        Runtime::Kvfleet if stages == 1 && engine.tp == 1 => kvfleet_shape(spec),
        _ => None,
    };
    let memory = match shape {
        Some(shape) => MemoryInput::KvfleetEngine {
            gpu_memory_bytes,
            gpu_memory_utilization: util,
            shape,
            max_num_seqs: u64::try_from(spec.engine.max_num_seqs).unwrap_or(1).max(1),
            drafter: draft_shape(spec, &shape),
        },
        None => MemoryInput::Predict {
            gpu_memory_bytes,
            gpu_memory_utilization: util,
            weight_bytes_total: weights,
            activation_reserve_bytes,
        },
    };
    let inputs = PlanInputs {
        engine,
        era,
        memory: memory.clone(),
        request_len: None,
    };
    let plan = plan(geometry, &inputs)?;
    let runtime = spec.engine.runtime;
    let mut explanation = plan.memory.notes.clone();
    explanation.extend(weight_notes);
    let m = &plan.memory;
    match (m.weight_bytes_per_gpu, m.activation_bytes, m.context_reserve_bytes) {
        (Some(w), Some(a), Some(c)) => explanation.push(format!(
            "kvfleet engine: weights {} GiB (bf16, from the geometry), activation workspace {} GiB (maxNumBatchedTokens x maxNumSeqs), context reserve {} GiB: the KV pools the worker allocates",
            fmt_gib(w),
            fmt_gib(a),
            fmt_gib(c)
        )),
        _ if runtime == Runtime::Kvfleet => explanation.push(format!(
            "activation and context reserve {} GiB per GPU (an estimate: give model.geometry hiddenSize, intermediateSize and vocabSize, or dummy weights, for the kvfleet engine's exact terms)",
            fmt_gib(activation_reserve_bytes)
        )),
        _ => explanation.push(format!(
            "activation and non-torch reserve {} GiB per GPU (kvfleet default; vLLM profiles it at startup)",
            fmt_gib(activation_reserve_bytes)
        )),
    }
    match (m.drafter_bytes, &memory) {
        (Some(d), MemoryInput::KvfleetEngine { drafter: Some(shape), .. }) => explanation.push(format!(
            "{} drafter: weights and buffers {} GiB off the budget, and {} layer(s) of K/V on every full-attention page",
            spec.engine.speculative.as_ref().map_or("speculative", |s| s.method.as_str()),
            fmt_gib(d),
            shape.layers
        )),
        (None, MemoryInput::Predict { .. }) if runtime == Runtime::Kvfleet && has_draft_geometry(spec) => {
            explanation.push("draftModel.geometry is not counted: the kvfleet engine's exact terms need model.geometry hiddenSize, intermediateSize and vocabSize (or dummy weights); the drafter's weights, buffers and K/V come out of this estimate".to_string())
        }
        _ => {}
    }
    let avail = plan.memory.available_kv_bytes;
    // The layers kvfleet's pools hold (replicated KV heads, a drafter's layers).
    let kv_geometry = super::report::kvfleet_geometry(geometry, &memory)?;
    let kv_geometry = kv_geometry.as_ref().unwrap_or(geometry);
    let fits_at = |p: &EngineParams, avail: u64| -> bool {
        match runtime {
            Runtime::Kvfleet => pool_layout(kv_geometry, p, avail)
                .map(|k| k.fits_one_request)
                .unwrap_or(false),
            Runtime::Vllm => vllm_plan(geometry, p, avail, era)
                .map(|v| v.fits_one_request)
                .unwrap_or(false),
        }
    };
    let (fits, bytes_per_request) = match runtime {
        Runtime::Kvfleet => (plan.kvfleet.fits_one_request, plan.kvfleet.bytes_per_request),
        Runtime::Vllm => (plan.vllm.fits_one_request, plan.vllm.bytes_per_request()),
    };
    let fix = if fits {
        None
    } else {
        // Largest maxModelLen that fits, by bisection (fits is monotone in the length).
        let mut lo = 0u64;
        let mut hi = engine.max_model_len;
        while lo + 1 < hi {
            let mid = lo + (hi - lo) / 2;
            if fits_at(
                &EngineParams {
                    max_model_len: mid,
                    ..engine
                },
                avail,
            ) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        let fp8_fits = !resolved_dtype.is_fp8()
            && resolved_dtype != KvCacheDtype::Nvfp4
            && fits_at(
                &EngineParams {
                    dtype: KvCacheDtype::Fp8,
                    ..engine
                },
                avail,
            );
        let mut tp_fix = None;
        let mut tp = engine.tp * 2;
        while tp <= 64 {
            if check_tensor_parallel(geometry, tp).is_ok() {
                let m = plan_memory(memory.clone(), tp)?;
                if fits_at(&EngineParams { tp, ..engine }, m) {
                    tp_fix = Some(tp);
                    break;
                }
            }
            tp *= 2;
        }
        Some(FixHint {
            max_model_len_that_fits: (lo > 0).then_some(lo),
            fp8_fits,
            tensor_parallel_size_that_fits: tp_fix,
        })
    };
    Ok(SpecCapacity {
        runtime,
        kvfleet_tokens: plan.kvfleet.capacity_tokens,
        vllm_tokens: plan
            .vllm
            .tokens_by_era
            .iter()
            .find(|(e, _)| *e == ReportingEra::V0_21On)
            .map_or(0, |(_, t)| *t),
        max_concurrency: plan.kvfleet.max_concurrency,
        vllm_max_concurrency: plan.vllm.max_concurrency,
        available_kv_bytes: avail,
        bytes_per_request,
        fits_one_request: fits,
        explanation,
        fix,
        plan,
    })
}

/// The weights in memory of one pipeline stage whose checkpoint holds `stage_bytes`: with
/// `engine.quantization: fp8` on an unquantized checkpoint, its linear layers take one byte a
/// weight plus scales (vLLM's fp8 method; [`LinearLayers`]); the geometry must give
/// hiddenSize and intermediateSize, else the bf16 size is kept (safe: less KV predicted) and
/// a note says so. An FP8 checkpoint's `weightBytes` is already its FP8 size.
fn fp8_at_load(
    spec: &InferenceDeploymentSpec,
    stage_bytes: u64,
    stages: u64,
    notes: &mut Vec<String>,
) -> u64 {
    if spec.engine.quantization != EngineQuantization::Fp8 || spec.model.quantization != Quantization::None {
        return stage_bytes;
    }
    let linear = spec.model.geometry.as_ref().and_then(LinearLayers::of);
    let Some(linear) = linear else {
        notes.push("engine.quantization fp8: weights counted at their bf16 size (model.geometry needs hiddenSize and intermediateSize to count the FP8 linear layers)".to_string());
        return stage_bytes;
    };
    let per_stage = LinearLayers {
        params: linear.params.div_ceil(stages),
        channels: linear.channels.div_ceil(stages),
    };
    match per_stage.fp8_bytes(stage_bytes) {
        Some(fp8) => {
            notes.push(format!(
                "engine.quantization fp8: weights {} GiB in bf16 become {} GiB (linear layers 1 byte a weight plus f32 scales; embeddings, LM head and norms stay bf16, as in vLLM's fp8 method)",
                fmt_gib(stage_bytes),
                fmt_gib(fp8)
            ));
            fp8
        }
        None => {
            notes.push(format!(
                "engine.quantization fp8: weightBytes ({} GiB) is less than the bf16 linear layers of the geometry; weights counted as given",
                fmt_gib(stage_bytes)
            ));
            stage_bytes
        }
    }
}

/// What kvfleet's engine allocates for the spec's model, when the spec says it all: dummy
/// weights of the geometry (the worker makes them from it), or a geometry with hiddenSize,
/// intermediateSize and vocabSize. `None` otherwise (the planner then uses a reserve).
fn kvfleet_shape(spec: &InferenceDeploymentSpec) -> Option<EngineShape> {
    let g = spec.model.geometry.as_ref()?;
    let dummy = spec
        .model
        .weights
        .as_ref()
        .is_some_and(|w| w.format == WeightsFormat::Dummy && !w.has_source());
    let sized = g.hidden_size.is_some() && g.intermediate_size.is_some() && g.vocab_size.is_some();
    if !(dummy || sized) {
        return None;
    }
    // FP8 at load or an FP8 checkpoint: the GPU keeps the linear layers in FP8.
    let fp8_linear =
        spec.engine.quantization == EngineQuantization::Fp8 || spec.model.quantization == Quantization::Fp8;
    EngineShape::for_spec(g).map(|s| EngineShape { fp8_linear, ..s })
}

fn has_draft_geometry(spec: &InferenceDeploymentSpec) -> bool {
    spec.engine
        .speculative
        .as_ref()
        .and_then(|s| s.draft_model.as_ref())
        .is_some_and(|d| d.geometry.is_some())
}

/// The drafter of `engine.speculative` as the kvfleet engine lays it out beside `model`, when
/// `draftModel.geometry` says it (validation denies a DFlash geometry without featureLayers).
fn draft_shape(spec: &InferenceDeploymentSpec, model: &EngineShape) -> Option<DraftShape> {
    let s = spec.engine.speculative.as_ref()?;
    let kind = match s.method {
        SpeculativeMethod::Eagle3 => DraftKind::Eagle3,
        SpeculativeMethod::Dflash => DraftKind::Dflash,
        SpeculativeMethod::Ngram => return None,
    };
    let g = s.draft_model.as_ref()?.geometry.as_ref()?;
    DraftShape::declared(kind, g, model.d_model, model.vocab)
}

/// The largest stage of `geometry` split into `stages` pipeline stages: the first
/// `ceil(main layers / stages)` layers (vLLM splits layers evenly; the remainder makes some
/// stages one layer longer), plus the draft layers, counted on it to stay on the safe side.
pub fn pipeline_stage(geometry: &Geometry, stages: u64) -> Geometry {
    let draft = (geometry.draft_layers as usize).min(geometry.layers.len());
    let main = geometry.layers.len() - draft;
    let per_stage = main.div_ceil(stages.max(1) as usize);
    let mut g = geometry.clone();
    g.layers = geometry.layers[..per_stage]
        .iter()
        .chain(&geometry.layers[main..])
        .cloned()
        .collect();
    g.notes.push(format!(
        "pipelineParallelSize {stages}: the largest stage holds {per_stage} of {main} layers (and the {draft} draft layers); weights are divided over the stages"
    ));
    g
}

fn plan_memory(m: MemoryInput, tp: u32) -> Result<u64, PlanError> {
    match m {
        MemoryInput::AvailableKv { bytes } => Ok(bytes),
        // One GPU a replica: a larger tp is never the fix.
        MemoryInput::KvfleetEngine { .. } => Ok(0),
        MemoryInput::Predict {
            gpu_memory_bytes,
            gpu_memory_utilization,
            weight_bytes_total,
            activation_reserve_bytes,
        } => Ok(super::memory::MemoryBudget::predict(
            gpu_memory_bytes,
            gpu_memory_utilization,
            weight_bytes_total,
            tp,
            activation_reserve_bytes,
        )?
        .available_kv_bytes),
    }
}
