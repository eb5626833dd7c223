//! The rule sets as data: for a runtime, a compute capability, model features, a KV dtype
//! and an attention backend, say whether it runs and, if not, why and what to do instead.
//!
//! Each [`Rule`] carries its source. `auto` resolves through [`priority`]: the first backend
//! of the architecture's order that no rule denies. `auto` KV dtype stays the model dtype
//! (float16 where the GPU has no bfloat16).

use serde::Serialize;

use super::cc::Arch;
use super::cc::ComputeCapability;
use super::engine;
use super::features::ModelFeatures;
use super::vllm_versions::{self, VllmVersion};
use super::vocab::{AttentionBackend as B, KvCacheDtype as D, Quantization as Q, Runtime, SpeculativeMethod};

/// Deny stops admission; Warn admits with a caveat.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Severity {
    Deny,
    Warn,
}

/// One combination being judged. `dtype` is concrete (never `auto`); `backend` is concrete.
#[derive(Clone, Copy, Debug)]
pub struct Case<'a> {
    pub runtime: Runtime,
    pub cc: ComputeCapability,
    pub features: &'a ModelFeatures,
    pub dtype: D,
    pub backend: B,
    /// The vLLM release (vLLM runtime); `None`: every release (rules as in COMPAT.md).
    pub vllm: Option<VllmVersion>,
    /// The dtype as the spec asked for it (`auto` reaches vLLM as `auto`).
    pub requested: D,
}

impl<'a> Case<'a> {
    /// The combination as the spec asks for it, with `auto` dtype resolved; an `auto` backend
    /// is resolved per candidate through [`Case::with_backend`].
    fn new(
        runtime: Runtime,
        cc: ComputeCapability,
        features: &'a ModelFeatures,
        requested: D,
        backend: B,
        vllm: Option<VllmVersion>,
    ) -> Self {
        Case {
            runtime,
            cc,
            features,
            dtype: resolve_dtype(cc, features, requested),
            backend,
            vllm,
            requested,
        }
    }

    fn with_backend(self, backend: B) -> Self {
        Case { backend, ..self }
    }

    fn kv(&self) -> D {
        self.dtype.canonical()
    }

    /// The dtype as the user wrote it, with vLLM's alias spelled out.
    fn dtype_name(&self) -> String {
        match self.dtype {
            D::Fp8 => "fp8 (fp8_e4m3)".to_string(),
            d => d.as_str().to_string(),
        }
    }
}

/// A rule: where it applies, what it checks, why, and the fix.
#[derive(Clone, Copy)]
pub struct Rule {
    /// Stable id, e.g. `vllm.nvfp4-kv-needs-sm100`.
    pub id: &'static str,
    pub runtime: Runtime,
    /// Backends the rule applies to; empty: every backend.
    pub backends: &'static [B],
    pub severity: Severity,
    /// The spec field to change, as a JSON path.
    pub field: &'static str,
    /// PascalCase reason for events, conditions and metrics.
    pub reason: &'static str,
    /// One line for `kvfleet check --explain`.
    pub summary: &'static str,
    /// Where the fact comes from (D = documented, I = inferred).
    pub source: &'static str,
    /// True when the combination breaks the rule.
    pub fires: fn(&Case) -> bool,
    /// What is wrong, without node specifics (validation adds what the nodes have).
    pub cause: fn(&Case) -> String,
    /// What to do instead.
    pub fix: fn(&Case) -> String,
}

impl std::fmt::Debug for Rule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rule")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl Rule {
    fn applies_to(&self, backend: B) -> bool {
        self.backends.is_empty() || self.backends.contains(&backend)
    }

    /// Applies to the backend and holds in the case's vLLM release (vllm_versions::RULE_LIFTS).
    fn judges(&self, case: &Case) -> bool {
        self.applies_to(case.backend) && vllm_versions::rule_holds(self.id, case.vllm)
    }

    /// A rule of `severity` that judges the case and fires on it.
    fn breaks(&self, case: &Case, severity: Severity) -> bool {
        self.severity == severity && self.judges(case) && (self.fires)(case)
    }

    fn violation(&self, case: &Case) -> Violation {
        let cause = (self.cause)(case);
        let fix = (self.fix)(case);
        Violation {
            rule: self.id,
            source: self.source,
            reason: self.reason,
            field: self.field,
            message: format!("{cause}; {fix}"),
            cause,
            fix,
        }
    }
}

// === the rule builder ===

/// A vLLM rule, to be completed by the builder methods below (every backend and Deny until
/// [`Rule::on`] or [`Rule::warn`] say otherwise).
const fn vllm(id: &'static str) -> Rule {
    Rule::new(Runtime::Vllm, id)
}

/// A kvfleet rule, as [`vllm`].
const fn kvfleet(id: &'static str) -> Rule {
    Rule::new(Runtime::Kvfleet, id)
}

/// The builder: each table row reads as scope, verdict, text and logic, one line each; the
/// unit tests check that every row says all of them.
impl Rule {
    const fn new(runtime: Runtime, id: &'static str) -> Self {
        Rule {
            id,
            runtime,
            backends: &[],
            severity: Severity::Deny,
            field: "",
            reason: "",
            summary: "",
            source: "",
            fires: |_| false,
            cause: |_| String::new(),
            fix: |_| String::new(),
        }
    }

    const fn on(self, backends: &'static [B]) -> Self {
        Rule { backends, ..self }
    }

    const fn deny(self, field: &'static str, reason: &'static str) -> Self {
        Rule {
            severity: Severity::Deny,
            field,
            reason,
            ..self
        }
    }

    const fn warn(self, field: &'static str, reason: &'static str) -> Self {
        Rule {
            severity: Severity::Warn,
            field,
            reason,
            ..self
        }
    }

    const fn summary(self, summary: &'static str) -> Self {
        Rule { summary, ..self }
    }

    const fn source(self, source: &'static str) -> Self {
        Rule { source, ..self }
    }

    const fn fires(self, fires: fn(&Case) -> bool) -> Self {
        Rule { fires, ..self }
    }

    const fn cause(self, cause: fn(&Case) -> String) -> Self {
        Rule { cause, ..self }
    }

    const fn fix(self, fix: fn(&Case) -> String) -> Self {
        Rule { fix, ..self }
    }
}

/// A broken rule, with its citation and a message that names the fix.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Violation {
    /// The rule id.
    pub rule: &'static str,
    /// The rule's citation.
    pub source: &'static str,
    /// PascalCase reason.
    pub reason: &'static str,
    /// The spec field to change, e.g. `spec.engine.kvCacheDtype`.
    pub field: &'static str,
    /// `cause; fix`.
    pub message: String,
    /// What is wrong.
    pub cause: String,
    /// What to do instead.
    pub fix: String,
}

/// The outcome for one architecture.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Evaluation {
    /// The combination that runs, with `auto` resolved; `None` when nothing runs.
    pub resolved: Option<(D, B)>,
    /// Why nothing runs (empty when `resolved` is set).
    pub violations: Vec<Violation>,
    /// Caveats of the resolved combination.
    pub warnings: Vec<Violation>,
}

impl Evaluation {
    pub fn runs(&self) -> bool {
        self.resolved.is_some()
    }
}

const KV: &str = "spec.engine.kvCacheDtype";
const BACKEND: &str = "spec.engine.attentionBackend";
const GEOMETRY: &str = "spec.model.geometry";
const RUNTIME: &str = "spec.engine.runtime";
const MIN_CC: &str = "spec.gpu.selector.minComputeCapability";
const SPEC_METHOD: &str = "spec.engine.speculative.method";

/// GPUs with FP8 tensor cores (W8A8 FP8), for fixes.
const FP8_GPUS: &str = "L4, L40S, RTX 4090 (8.9), H100, H200 (9.0), B200, B300 (10.x), RTX PRO 6000 Blackwell, RTX 5090 (12.0); gpu.selector.minComputeCapability \"8.9\"";

/// W8A8 FP8 GEMMs (FP8 tensor cores) from 8.9: vLLM's `cutlass_fp8_supported` and the
/// Marlin switch in its `fp8` method test the same capability.
fn fp8_tensor_cores(cc: ComputeCapability) -> bool {
    cc >= ComputeCapability::new(8, 9)
}

/// Where the FP8 weights come from, for messages.
fn fp8_weights_name(c: &Case) -> &'static str {
    if c.features.fp8_at_load {
        "FP8 weights (engine.quantization fp8)"
    } else {
        "an FP8 checkpoint (model.quantization fp8)"
    }
}

/// The speculative method of the case, for messages (rules fire only when there is one).
fn spec_method(c: &Case) -> &'static str {
    c.features.speculative.map_or("", SpeculativeMethod::as_str)
}

/// Source tag of kvfleet's own rules: our kernels decide them.
pub const KVFLEET_SOURCE: &str = "kvfleet kernels/attention/";

fn head_dims(c: &Case) -> String {
    c.features
        .head_dims
        .iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The first dtype of `candidates` that runs with the case's runtime on its arch (backend
/// auto), for fixes like "use fp8".
fn first_running_dtype(c: &Case, candidates: &[D]) -> Option<D> {
    candidates.iter().copied().find(|d| {
        *d != c.dtype
            && resolve(&Case::new(c.runtime, c.cc, c.features, *d, B::Auto, c.vllm))
                .0
                .is_some()
    })
}

fn use_dtype(c: &Case, candidates: &[D]) -> String {
    match first_running_dtype(c, candidates) {
        Some(d) => format!("use {d}"),
        None => format!(
            "no KV dtype runs this model with the {} runtime on compute capability {}; select other GPUs",
            c.runtime, c.cc
        ),
    }
}

fn model_dtype(c: &Case) -> D {
    if c.features.model_dtype == D::Bfloat16 && c.cc < ComputeCapability::new(8, 0) {
        D::Float16
    } else {
        c.features.model_dtype
    }
}

// === vLLM rules ===

/// The vLLM runtime's rules (COMPAT.md, "vLLM runtime: rules worth rejecting at admission").
pub static VLLM_RULES: &[Rule] = &[
    vllm("vllm.kv-dtype-needs-release")
        .deny(KV, "UnsupportedByVllmVersion")
        .summary("the KV dtype must exist in the vLLM release of the image (--kv-cache-dtype choices per release)")
        .source("compat/vllm_versions.rs kv_dtype_availability (vllm#37199, vllm#40177, docs CacheDType per release)")
        .fires(|c| c.vllm.is_some_and(|v| !vllm_versions::kv_dtype_availability(c.requested).at(v)))
        .cause(|c| format!(
            "kvCacheDtype {} needs vLLM >= {}, and this spec runs vLLM {}",
            c.dtype,
            vllm_versions::kv_dtype_availability(c.dtype).since.map_or("(no release yet)".to_string(), |s| s.to_string()),
            c.vllm.map_or(String::new(), |v| v.to_string())
        ))
        .fix(|c| {
            let image = vllm_versions::first_release_with(&vllm_versions::kv_dtype_availability(c.dtype))
                .map(|_| vllm_versions::default_image());
            let other = use_dtype(c, &[D::Fp8, D::Fp8E5m2, D::Auto]);
            match image {
                Some(i) => format!("use image {i} (or set spec.engine.vllm.version to a release that has it), or {other}"),
                None => other,
            }
        }),
    vllm("vllm.speculative-method-needs-release")
        .deny(SPEC_METHOD, "UnsupportedByVllmVersion")
        .summary("the speculative method must exist in the vLLM release of the image (--speculative-config method per release: dflash from 0.20.0)")
        .source("compat/vllm_versions.rs speculative_method_availability (vllm#16937, vllm#36847, NVIDIA-NeMo/Automodel#2913)")
        .fires(|c| {
            let m = c.features.speculative;
            m.zip(c.vllm).is_some_and(|(m, v)| !vllm_versions::speculative_method_availability(m).at(v))
        })
        .cause(|c| {
            let a = c.features.speculative.map(vllm_versions::speculative_method_availability);
            format!(
                "speculative method {} needs vLLM >= {}, and this spec runs vLLM {}",
                spec_method(c),
                a.and_then(|a| a.since).map_or("(no release yet)".to_string(), |s| s.to_string()),
                c.vllm.map_or(String::new(), |v| v.to_string())
            )
        })
        .fix(|c| {
            let first = c
                .features
                .speculative
                .map(vllm_versions::speculative_method_availability)
                .and_then(|a| vllm_versions::first_release_with(&a));
            match first {
                Some(v) => format!(
                    "use image {} or newer (or set spec.engine.vllm.version to a release that has it; kvfleet's default is {}), or method ngram",
                    v.image(),
                    vllm_versions::default_image()
                ),
                None => "use method ngram or eagle3".to_string(),
            }
        }),
    vllm("vllm.nvfp4-kv-needs-sm100")
        .deny(KV, "UnsupportedKvCacheDtype")
        .summary("nvfp4 KV cache only on family 100 (sm_100/sm_103); elsewhere vLLM starts, then dies on the first request")
        .source("vllm#43562, vllm#43669 (D)")
        .fires(|c| c.kv() == D::Nvfp4 && c.cc.family() != 100)
        .cause(|_| "kvCacheDtype nvfp4 needs compute capability 10.0 or 10.3 (B200/B300)".to_string())
        .fix(|c| use_dtype(c, &[D::Fp8, D::Fp8E5m2, model_dtype(c)])),
    vllm("vllm.fp8-e4m3-needs-sm89-in-triton")
        .deny(KV, "UnsupportedKvCacheDtype")
        .summary("fp8_e4m3 KV with TRITON_ATTN / Inductor below 8.9 (sm_75/80/86/87): \"type fp8e4nv not supported in this architecture\"; only fp8_e5m2 exists there")
        .source("vllm#26431, vllm#7714, vllm#39133 (D); sm_75 inferred from the same Triton check")
        .fires(|c| c.kv() == D::Fp8E4m3 && c.cc < ComputeCapability::new(8, 9))
        .cause(|c| format!(
            "{} KV cache is not supported by vLLM's Triton kernels (TRITON_ATTN and Inductor-compiled code) below compute capability 8.9: Triton has no fp8e4nv there",
            c.dtype_name()
        ))
        .fix(|c| use_dtype(c, &[D::Fp8E5m2, model_dtype(c)])),
    vllm("vllm.fp8-e5m2-with-quantized-checkpoint")
        .deny(KV, "UnsupportedKvCacheDtype")
        .summary("fp8_e5m2 KV cache with any quantized checkpoint (fp8, INT4 AWQ, ...): \"fp8_e5m2 kv-cache is not supported with fp8 checkpoints\"")
        .source("vllm#39133 (D)")
        .fires(|c| c.kv() == D::Fp8E5m2 && c.features.quantized_checkpoint)
        .cause(|_| "kvCacheDtype fp8_e5m2 is refused by vLLM with a quantized checkpoint (\"fp8_e5m2 kv-cache is not supported with fp8 checkpoints\"; the gate fires for any quantization)".to_string())
        .fix(|c| use_dtype(c, &[D::Fp8, model_dtype(c)])),
    vllm("vllm.bfloat16-needs-sm80")
        .deny(KV, "UnsupportedKvCacheDtype")
        .summary("bfloat16 needs compute capability 8.0; below it vLLM supports float16 only (auto falls back to float16)")
        .source("vllm vllm/platforms/cuda.py supported_dtypes (D)")
        .fires(|c| c.kv() == D::Bfloat16 && c.cc < ComputeCapability::new(8, 0))
        .cause(|_| "kvCacheDtype bfloat16 needs compute capability 8.0 or newer".to_string())
        .fix(|_| "use float16 (or auto)".to_string()),
    vllm("vllm.flash-attn-fp8-needs-fa3")
        .on(&[B::FlashAttn])
        .deny(BACKEND, "UnsupportedAttentionBackend")
        .summary("fp8 KV with FLASH_ATTN needs FA3, i.e. family 90 (\"Cannot use FlashAttention backend for FP8 KV cache\")")
        .source("vllm#24577 (D); vllm v1/attention/backends/fa_utils.py flash_attn_supports_fp8")
        .fires(|c| c.kv().is_fp8() && c.cc.family() != 90)
        .cause(|c| format!(
            "attentionBackend FLASH_ATTN with kvCacheDtype {} needs FlashAttention 3, i.e. compute capability 9.x (Hopper)",
            c.dtype_name()
        ))
        .fix(|_| "use attentionBackend auto, FLASHINFER or TRITON_ATTN".to_string()),
    vllm("vllm.flash-attn-needs-sm80")
        .on(&[B::FlashAttn])
        .deny(BACKEND, "UnsupportedAttentionBackend")
        .summary("FLASH_ATTN (FA2) needs compute capability 8.0")
        .source("Dao-AILab/flash-attention README (D)")
        .fires(|c| c.cc < ComputeCapability::new(8, 0))
        .cause(|_| "attentionBackend FLASH_ATTN (FlashAttention 2) needs compute capability 8.0 or newer".to_string())
        .fix(|_| "use attentionBackend auto or TRITON_ATTN".to_string()),
    vllm("vllm.flash-attn-head-dims")
        .on(&[B::FlashAttn])
        .deny(BACKEND, "UnsupportedHeadDim")
        .summary("FLASH_ATTN supports head dimensions up to 256 (multiples of 8)")
        .source("Dao-AILab/flash-attention README \"all head dimensions up to 256\" (D)")
        .fires(|c| c.features.head_dims.iter().any(|d| *d > 256 || d % 8 != 0))
        .cause(|c| format!(
            "attentionBackend FLASH_ATTN supports head dimensions up to 256; this model has {}",
            head_dims(c)
        ))
        .fix(|_| "use attentionBackend auto or TRITON_ATTN".to_string()),
    vllm("vllm.flashinfer-needs-sm80")
        .on(&[B::FlashInfer])
        .deny(BACKEND, "UnsupportedAttentionBackend")
        .summary("FLASHINFER floor raised to 8.0 (sm_75 prefill fails)")
        .source("vllm#47549 (D)")
        .fires(|c| c.cc < ComputeCapability::new(8, 0))
        .cause(|_| "attentionBackend FLASHINFER needs compute capability 8.0 or newer (prefill fails on 7.5)".to_string())
        .fix(|_| "use attentionBackend auto or TRITON_ATTN".to_string()),
    vllm("vllm.flashinfer-sm120-prefill-crash")
        .on(&[B::FlashInfer])
        .deny(BACKEND, "UnsupportedAttentionBackend")
        .summary("FLASHINFER on family 120 crashed in prefill_wrapper.plan() (vLLM 0.15): use TRITON_ATTN")
        .source("seed report \"vLLM SM120 NVFP4 working state\", vllm#40153, vllm#40677 (D)")
        .fires(|c| c.cc.family() == 120)
        .cause(|_| "attentionBackend FLASHINFER crashes in prefill_wrapper.plan() on compute capability 12.x".to_string())
        .fix(|_| "use attentionBackend TRITON_ATTN (or auto)".to_string()),
    vllm("vllm.flashinfer-one-window-for-all-layers")
        .on(&[B::FlashInfer])
        .deny(BACKEND, "PerLayerSlidingWindow")
        .summary("FLASHINFER needs one sliding window, soft-cap and scale for all layers; per-layer windows (Gemma 2/3/4, gpt-oss) need FLASH_ATTN or TRITON_ATTN")
        .source("vllm v1/attention/backends/utils.py infer_global_hyperparameters, vllm#39995 (D)")
        .fires(|c| c.features.per_layer_windows)
        .cause(|c| format!(
            "attentionBackend FLASHINFER needs the same sliding window in every layer (\"Window left is not the same for all layers\"); this model mixes sliding-window ({}) and full-attention layers",
            c.features.sliding_windows.iter().map(|w| w.to_string()).collect::<Vec<_>>().join(", ")
        ))
        .fix(|_| "use attentionBackend FLASH_ATTN or TRITON_ATTN (or auto)".to_string()),
    vllm("vllm.flashinfer-non-causal")
        .on(&[B::FlashInfer])
        .deny(BACKEND, "NonCausalAttention")
        .summary("non-causal attention (DFlash drafters, encoders): not supported by TRTLLM kernels; FLASHINFER non-causal is opt-in")
        .source("vllm#39995, fi#3335 (D)")
        .fires(|c| c.features.non_causal)
        .cause(|_| "attentionBackend FLASHINFER does not run non-causal attention by default (TRTLLM kernels lack it; FlashInfer's non-causal path is opt-in)".to_string())
        .fix(|_| "use attentionBackend FLASH_ATTN or TRITON_ATTN (or auto)".to_string()),
    vllm("vllm.flashinfer-head-dims")
        .on(&[B::FlashInfer])
        .deny(BACKEND, "UnsupportedHeadDim")
        .summary("FLASHINFER head sizes 64/128/256 only (Gemma 4 global head 512 rejected)")
        .source("vllm#40677 (D)")
        .fires(|c| c.features.head_dims.iter().any(|d| ![64, 128, 256].contains(d)))
        .cause(|c| format!(
            "attentionBackend FLASHINFER supports head dimensions 64, 128 and 256 only; this model has {}",
            head_dims(c)
        ))
        .fix(|_| "use attentionBackend TRITON_ATTN (or auto)".to_string()),
    vllm("vllm.mla-model-needs-mla-backend")
        .on(&[B::FlashAttn, B::FlashInfer, B::TritonAttn, B::FlexAttention, B::TreeAttn])
        .deny(BACKEND, "MlaModel")
        .summary("MLA models (kv_lora_rank) run on MLA backends only")
        .source("vllm docs/design/attention_backends.md (D)")
        .fires(|c| c.features.mla)
        .cause(|c| format!("this model uses multi-head latent attention; attentionBackend {} is not an MLA backend", c.backend))
        .fix(|_| "use attentionBackend auto or TRITON_MLA".to_string()),
    vllm("vllm.mla-backend-needs-mla-model")
        .on(&[B::FlashMla, B::CutlassMla, B::FlashInferMla, B::TritonMla])
        .deny(BACKEND, "NotAnMlaModel")
        .summary("MLA backends need an MLA model (kvLoraRank set)")
        .source("vllm docs/design/attention_backends.md (D)")
        .fires(|c| !c.features.mla)
        .cause(|c| format!("attentionBackend {} is for multi-head latent attention models; this model has none (no kvLoraRank)", c.backend))
        .fix(|_| "use attentionBackend auto".to_string()),
    vllm("vllm.flashmla-needs-sm90-or-sm100")
        .on(&[B::FlashMla])
        .deny(BACKEND, "UnsupportedAttentionBackend")
        .summary("FLASHMLA runs on families 90 and 100")
        .source("vllm docs/design/attention_backends.md (I)")
        .fires(|c| !matches!(c.cc.family(), 90 | 100))
        .cause(|_| "attentionBackend FLASHMLA needs compute capability 9.x or 10.x".to_string())
        .fix(|_| "use attentionBackend TRITON_MLA (or auto)".to_string()),
    vllm("vllm.sm100-mla-backends")
        .on(&[B::CutlassMla, B::FlashInferMla])
        .deny(BACKEND, "UnsupportedAttentionBackend")
        .summary("CUTLASS_MLA and FLASHINFER_MLA run on family 100 only")
        .source("vllm docs/design/attention_backends.md (I)")
        .fires(|c| c.cc.family() != 100)
        .cause(|c| format!("attentionBackend {} needs compute capability 10.0 or 10.3", c.backend))
        .fix(|_| "use attentionBackend TRITON_MLA (or auto)".to_string()),
    vllm("vllm.kvfleet-backend-needs-kvfleet-runtime")
        .on(&[B::KvfleetCuda, B::KvfleetCpu])
        .deny(BACKEND, "BackendRuntimeMismatch")
        .summary("KVFLEET_* backends belong to the kvfleet runtime")
        .source("kvfleet api (EngineSpec)")
        .fires(|_| true)
        .cause(|c| format!("attentionBackend {} is kvfleet's own engine, not a vLLM backend", c.backend))
        .fix(|_| "use attentionBackend auto, FLASH_ATTN, FLASHINFER or TRITON_ATTN, or runtime kvfleet".to_string()),
    vllm("vllm.fp8-weights-need-sm80")
        .deny(MIN_CC, "UnsupportedWeightQuantization")
        .summary("FP8 weights (fp8 checkpoints, compressed-tensors float8, --quantization fp8) need compute capability 8.0 (\"Minimum capability: 80\")")
        .source("vllm model_executor/layers/quantization/fp8.py Fp8Config.get_min_capability; compressed_tensors/schemes/compressed_tensors_w8a16_fp8.py get_min_capability (D)")
        .fires(|c| c.features.fp8_weights && c.cc < ComputeCapability::new(8, 0))
        .cause(|c| format!("{} needs compute capability 8.0 or newer in vLLM (its FP8 kernels: Marlin weight-only from 8.0, W8A8 from 8.9)", fp8_weights_name(c)))
        .fix(|_| format!("select GPUs of compute capability 8.0 or newer; for W8A8 FP8: {FP8_GPUS}")),
    vllm("vllm.fp8-weights-marlin-below-sm89")
        .warn(MIN_CC, "SlowerWeightQuantization")
        .summary("FP8 weights on 8.0/8.6/8.7 run weight-only through Marlin (W8A16: FP8 weights dequantized in the GEMM, bf16 activations); W8A8 FP8 needs 8.9")
        .source("vllm fp8.py Fp8LinearMethod use_marlin = not has_device_capability(89); compressed_tensors.py _get_scheme_from_parts (W8A8Fp8 else W8A16Fp8); utils/w8a8_utils.py cutlass_fp8_supported; docs/features/quantization/supported_hardware.md (D)")
        .fires(|c| c.features.fp8_weights && c.cc >= ComputeCapability::new(8, 0) && !fp8_tensor_cores(c.cc))
        .cause(|c| format!(
            "{} on compute capability {} runs in vLLM as weight-only FP8 through the Marlin kernels (W8A16: weights dequantized to bf16 inside the GEMM, activations not quantized): the memory saving holds, but GEMMs are slower than W8A8 FP8 on FP8 tensor cores",
            fp8_weights_name(c),
            c.cc
        ))
        .fix(|_| format!("for W8A8 FP8 select GPUs with FP8 tensor cores: {FP8_GPUS}")),
    vllm("vllm.awq-needs-sm75")
        .deny(MIN_CC, "UnsupportedWeightQuantization")
        .summary("AWQ checkpoints need compute capability 7.5 (\"The AWQ kernel only supports Turing or newer GPUs\"); AWQ-Marlin from 8.0")
        .source("vllm model_executor/layers/quantization/awq.py AWQConfig.get_min_capability (75); awq_marlin.py (80) (D)")
        .fires(|c| c.features.quantization == Q::Awq && c.cc < ComputeCapability::new(7, 5))
        .cause(|c| format!("AWQ weights need compute capability 7.5 or newer in vLLM; this GPU is {}", c.cc))
        .fix(|_| "select GPUs of compute capability 7.5 or newer (8.0 or newer for the faster AWQ-Marlin kernels)".to_string()),
    vllm("vllm.gptq-needs-sm60")
        .deny(MIN_CC, "UnsupportedWeightQuantization")
        .summary("GPTQ checkpoints need compute capability 6.0; GPTQ-Marlin from 8.0")
        .source("vllm model_executor/layers/quantization/gptq.py GPTQConfig.get_min_capability (60); gptq_marlin.py (80) (D)")
        .fires(|c| c.features.quantization == Q::Gptq && c.cc < ComputeCapability::new(6, 0))
        .cause(|c| format!("GPTQ weights need compute capability 6.0 or newer in vLLM; this GPU is {}", c.cc))
        .fix(|_| "select GPUs of compute capability 6.0 or newer (8.0 or newer for the GPTQ-Marlin kernels)".to_string()),
    vllm("vllm.w4a16-needs-sm80")
        .deny(MIN_CC, "UnsupportedWeightQuantization")
        .summary("compressed-tensors W4A16 (pack-quantized) runs through Marlin-class kernels: compute capability 8.0 (\"ampere and up\")")
        .source("vllm compressed_tensors/schemes/compressed_tensors_wNa16.py CompressedTensorsWNA16.get_min_capability (80) (D)")
        .fires(|c| c.features.quantization == Q::W4a16 && c.cc < ComputeCapability::new(8, 0))
        .cause(|c| format!("compressed-tensors W4A16 weights need compute capability 8.0 or newer in vLLM; this GPU is {}", c.cc))
        .fix(|_| "select GPUs of compute capability 8.0 or newer".to_string()),
    vllm("vllm.mxfp4-needs-sm80")
        .deny(MIN_CC, "UnsupportedWeightQuantization")
        .summary("MXFP4 experts (gpt-oss) need compute capability 8.0: Marlin from 8.0, Triton or FlashInfer kernels on 9.0 and 10.x")
        .source("vllm model_executor/layers/quantization/mxfp4.py Mxfp4Config.get_min_capability (80), get_mxfp4_backend (D)")
        .fires(|c| c.features.quantization == Q::Mxfp4 && c.cc < ComputeCapability::new(8, 0))
        .cause(|c| format!("MXFP4 weights need compute capability 8.0 or newer in vLLM; this GPU is {}", c.cc))
        .fix(|_| "select GPUs of compute capability 8.0 or newer".to_string()),
    vllm("vllm.nvfp4-weights-need-sm80")
        .deny(MIN_CC, "UnsupportedWeightQuantization")
        .summary("NVFP4 weights need compute capability 8.0 (Marlin FP4, weight-only) and run W4A4 on FP4 tensor cores from 10.0")
        .source("vllm quantization/utils/marlin_utils_fp4.py is_fp4_marlin_supported; utils/quant_utils.py cutlass_fp4_supported; modelopt.py ModelOptNvFp4Config (D)")
        .fires(|c| c.features.quantization == Q::Nvfp4 && c.cc < ComputeCapability::new(8, 0))
        .cause(|c| format!("NVFP4 weights need compute capability 8.0 or newer in vLLM; this GPU is {}", c.cc))
        .fix(|_| "select Blackwell GPUs (compute capability 10.0 or 12.0) for FP4 tensor cores".to_string()),
    vllm("vllm.nvfp4-weights-marlin-below-sm100")
        .warn(MIN_CC, "SlowerWeightQuantization")
        .summary("NVFP4 weights below compute capability 10.0 run weight-only through Marlin (FP4 dequantized in the GEMM, bf16 activations); W4A4 needs FP4 tensor cores")
        .source("vllm quantization/utils/marlin_utils_fp4.py; utils/quant_utils.py cutlass_fp4_supported (D)")
        .fires(|c| c.features.quantization == Q::Nvfp4 && c.cc >= ComputeCapability::new(8, 0) && c.cc < ComputeCapability::new(10, 0))
        .cause(|c| format!("NVFP4 weights on compute capability {} have no FP4 tensor cores: vLLM runs them weight-only through Marlin (the memory saving holds, GEMMs are slower than W4A4)", c.cc))
        .fix(|_| "for W4A4 FP4 select Blackwell GPUs (compute capability 10.0 or 12.0)".to_string()),
    vllm("vllm.flashinfer-cubins-air-gapped")
        .on(&[B::FlashInfer])
        .warn(BACKEND, "RuntimeDownload")
        .summary("TRTLLM/XQA cubins are downloaded at run time unless flashinfer-cubin is installed: in air-gapped pods those paths silently vanish")
        .source("vllm utils/flashinfer.py (D)")
        .fires(|c| c.cc.family() == 100)
        .cause(|_| "FLASHINFER on compute capability 10.x downloads TRTLLM/XQA kernels at run time unless flashinfer-cubin is installed; in air-gapped pods those fast paths silently vanish".to_string())
        .fix(|_| "use an image with flashinfer-cubin, or allow egress to fetch the cubins".to_string()),
];

// === kvfleet rules ===

const KVFLEET_HEAD_DIMS: [u32; 3] = [64, 128, 256];

/// kvfleet's own engine: what our kernels implement (keep in step with `kernels/`).
pub static KVFLEET_RULES: &[Rule] = &[
    kvfleet("kvfleet.backend-is-ours")
        .on(&[B::FlashAttn, B::FlashInfer, B::TritonAttn, B::FlexAttention, B::TreeAttn, B::FlashMla, B::CutlassMla, B::FlashInferMla, B::TritonMla])
        .deny(BACKEND, "BackendRuntimeMismatch")
        .summary("the kvfleet runtime runs its own kernels: KVFLEET_CUDA (GPU) or KVFLEET_CPU")
        .source(KVFLEET_SOURCE)
        .fires(|_| true)
        .cause(|c| format!("attentionBackend {} is a vLLM backend; the kvfleet runtime runs its own kernels", c.backend))
        .fix(|_| "use attentionBackend auto or KVFLEET_CUDA, or runtime vllm".to_string()),
    kvfleet("kvfleet.cuda-needs-sm80")
        .on(&[B::KvfleetCuda])
        .deny(MIN_CC, "UnsupportedArchitecture")
        .summary("KVFLEET_CUDA kernels are built for sm_80, sm_86/87, sm_89, sm_90a, sm_100a/103 and sm_120a/121 (bf16 mma.sync needs sm_80); every KV dtype (bfloat16, float16, fp8_e4m3, fp8_e5m2, nvfp4) runs on each")
        .source(KVFLEET_SOURCE)
        .fires(|c| Arch::for_capability(c.cc.major as i32, c.cc.minor as i32).is_none())
        .cause(|c| format!(
            "kvfleet's CUDA kernels are built for compute capability 8.0, 8.6, 8.7, 8.9, 9.0, 10.0, 10.3, 12.0 and 12.1, not {}",
            c.cc
        ))
        .fix(|_| "select GPUs of a supported compute capability (e.g. minComputeCapability \"8.0\"), or use attentionBackend KVFLEET_CPU or runtime vllm".to_string()),
    kvfleet("kvfleet.cuda-block-size-16")
        .on(&[B::KvfleetCuda])
        .deny("spec.engine.blockSize", "UnsupportedBlockSize")
        .summary("KVFLEET_CUDA kernels are specialised for pages of 16 tokens")
        .source(KVFLEET_SOURCE)
        .fires(|c| c.features.block_size.is_some_and(|b| b != 16))
        .cause(|c| format!(
            "kvfleet's CUDA kernels use pages of 16 tokens; blockSize is {}",
            c.features.block_size.unwrap_or(0)
        ))
        .fix(|_| "set engine.blockSize to 16".to_string()),
    kvfleet("kvfleet.cuda-gqa-groups")
        .on(&[B::KvfleetCuda])
        .deny(GEOMETRY, "UnsupportedGqaGroup")
        .summary("KVFLEET_CUDA kernels are specialised for GQA groups of 1, 2, 4 and 8 query heads per KV head")
        .source(KVFLEET_SOURCE)
        .fires(|c| c.features.gqa_groups.iter().any(|g| ![1, 2, 4, 8].contains(g)))
        .cause(|c| format!(
            "kvfleet's CUDA kernels support 1, 2, 4 or 8 query heads per KV head; this model has {:?}",
            c.features.gqa_groups
        ))
        .fix(|_| "use attentionBackend KVFLEET_CPU or runtime vllm for this model".to_string()),
    kvfleet("kvfleet.cuda-masks")
        .on(&[B::KvfleetCuda])
        .deny("spec.engine.nonCausal", "UnsupportedMask")
        .summary("KVFLEET_CUDA masks: full (non-causal), causal, causal with a sliding window; not a sliding window without the causal mask")
        .source(KVFLEET_SOURCE)
        // A DFlash drafter's non-causal blocks run on its own full-attention layers.
        .fires(|c| {
            c.features.non_causal && !c.features.non_causal_drafter_only && !c.features.sliding_windows.is_empty()
        })
        .cause(|_| "kvfleet's CUDA kernels apply a sliding window only together with the causal mask".to_string())
        .fix(|_| "drop nonCausal for this sliding-window model, or use attentionBackend KVFLEET_CPU".to_string()),
    kvfleet("kvfleet.head-dims")
        .on(&[B::KvfleetCuda, B::KvfleetCpu])
        .deny(GEOMETRY, "UnsupportedHeadDim")
        .summary("kvfleet kernels are specialised for head dimensions 64, 128 and 256")
        .source(KVFLEET_SOURCE)
        .fires(|c| c.features.head_dims.iter().any(|d| !KVFLEET_HEAD_DIMS.contains(d)))
        .cause(|c| format!(
            "kvfleet's kernels support head dimensions 64, 128 and 256; this model has {}",
            head_dims(c)
        ))
        .fix(|_| "use runtime vllm for this model".to_string()),
    kvfleet("kvfleet.no-mla")
        .on(&[B::KvfleetCuda, B::KvfleetCpu])
        .deny(RUNTIME, "MlaModel")
        .summary("multi-head latent attention (MLA) is not implemented yet")
        .source(KVFLEET_SOURCE)
        .fires(|c| c.features.mla)
        .cause(|_| "kvfleet's engine does not implement multi-head latent attention (MLA) yet".to_string())
        .fix(|_| "use runtime vllm for this model".to_string()),
    kvfleet("kvfleet.fp8-weights-need-sm89")
        .on(&[B::KvfleetCuda])
        .deny(MIN_CC, "UnsupportedWeightQuantization")
        .summary("FP8 weights on the GPU need FP8 tensor cores (8.9, 9.0, 10.x, 12.x): the kvfleet engine runs them W8A8 (cuBLASLt FP8 GEMMs, e4m3 GEMVs) and has no weight-only fallback like vLLM's Marlin on 8.0/8.6")
        .source(KVFLEET_SOURCE)
        .fires(|c| c.features.fp8_weights && !fp8_tensor_cores(c.cc))
        .cause(|c| format!(
            "{} in the kvfleet runtime needs FP8 tensor cores (compute capability 8.9 or newer); {} has none and kvfleet has no weight-only FP8 path",
            fp8_weights_name(c),
            c.cc
        ))
        .fix(|_| format!("select GPUs that can: {FP8_GPUS}; or use runtime vllm (weight-only FP8 through Marlin on this GPU)")),
    kvfleet("kvfleet.architecture-served")
        .on(&[B::KvfleetCuda, B::KvfleetCpu])
        .deny("spec.model.architecture", "UnservedModelArchitecture")
        .summary("the engine loads the architectures of compat::engine::ARCHITECTURES, each on the devices listed there")
        .source(KVFLEET_SOURCE)
        .fires(|c| {
            c.features.architecture.as_deref().is_some_and(|a| {
                engine::architecture(a)
                    .is_none_or(|s| if c.backend == B::KvfleetCuda { !s.devices.cuda } else { !s.devices.cpu })
            })
        })
        .cause(|c| {
            let a = c.features.architecture.as_deref().unwrap_or_default();
            let cuda = c.backend == B::KvfleetCuda;
            let on = if cuda { "CUDA engine" } else { "CPU engine" };
            match engine::architecture(a) {
                Some(s) if cuda && s.devices.cpu => {
                    format!("kvfleet's {on} does not serve {a} yet (its CPU engine does)")
                }
                Some(_) => format!("kvfleet's {on} does not serve {a} yet"),
                None => format!("kvfleet's engine does not load {a}; its {on} serves {}", engine::architectures_on(cuda)),
            }
        })
        .fix(|_| "use runtime vllm for this model".to_string()),
    kvfleet("kvfleet.moe-served")
        .on(&[B::KvfleetCuda, B::KvfleetCpu])
        .deny("spec.model.geometry.moe", "UnservedMixtureOfExperts")
        .summary("mixture-of-experts layers run where compat::engine::MOE says")
        .source(KVFLEET_SOURCE)
        .fires(|c| c.features.moe && if c.backend == B::KvfleetCuda { !engine::MOE.cuda } else { !engine::MOE.cpu })
        .cause(|c| {
            let on = if c.backend == B::KvfleetCuda { "CUDA engine" } else { "CPU engine" };
            format!("kvfleet's {on} does not run mixture-of-experts layers yet")
        })
        .fix(|_| "use runtime vllm for this model".to_string()),
    kvfleet("kvfleet.weight-quantization-served")
        .on(&[B::KvfleetCuda, B::KvfleetCpu])
        .deny("spec.model.quantization", "UnsupportedWeightQuantization")
        .summary("the engine runs the weight formats compat::engine::quantization lists, per device")
        .source(KVFLEET_SOURCE)
        .fires(|c| {
            let d = engine::quantization(c.features.quantization);
            if c.backend == B::KvfleetCuda { !d.cuda } else { !d.cpu }
        })
        .cause(|c| {
            let cuda = c.backend == B::KvfleetCuda;
            let on = if cuda { "CUDA engine" } else { "CPU engine" };
            format!(
                "kvfleet's {on} does not run {} weights yet (it runs: {})",
                c.features.quantization,
                engine::quantizations_on(cuda)
            )
        })
        .fix(|c| match c.features.quantization {
            Q::Nvfp4 => "use runtime vllm (NVFP4 W4A4 on Blackwell GPUs, compute capability 10.0 or 12.0; weight-only through Marlin from 8.0)".to_string(),
            _ => "use runtime vllm, or an unquantized or FP8 checkpoint".to_string(),
        }),
];

/// The rule set of a runtime.
pub fn rules(runtime: Runtime) -> &'static [Rule] {
    match runtime {
        Runtime::Vllm => VLLM_RULES,
        Runtime::Kvfleet => KVFLEET_RULES,
    }
}

// === auto resolution ===

/// The order `auto` tries backends in, for one runtime and group of architectures.
#[derive(Clone, Copy, Debug)]
pub struct Priority {
    pub runtime: Runtime,
    /// Which architectures: a family, or every other one (`None`).
    pub family: Option<u32>,
    /// For MLA models only.
    pub mla: bool,
    pub order: &'static [B],
    pub source: &'static str,
}

/// `auto` orders; the first matching row wins (`family: None` rows are the fallback).
pub static PRIORITIES: &[Priority] = &[
    Priority {
        runtime: Runtime::Vllm,
        family: None,
        mla: true,
        order: &[B::TritonMla],
        source: "kvfleet choice: TRITON_MLA runs on every architecture; pick FLASHMLA/CUTLASS_MLA explicitly",
    },
    Priority {
        runtime: Runtime::Vllm,
        family: Some(100),
        mla: false,
        order: &[B::FlashInfer, B::FlashAttn, B::TritonAttn],
        source: "vllm platforms/cuda.py backend priorities; docs/design/attention_backends.md (D)",
    },
    Priority {
        runtime: Runtime::Vllm,
        family: Some(120),
        mla: false,
        order: &[B::TritonAttn, B::FlashAttn, B::FlashInfer],
        source: "kvfleet choice: TRITON_ATTN is the verified working state on sm_120 (seed report \"vLLM SM120 NVFP4 working state\"); vLLM itself tries FLASH_ATTN first there",
    },
    Priority {
        runtime: Runtime::Vllm,
        family: None,
        mla: false,
        order: &[B::FlashAttn, B::FlashInfer, B::TritonAttn],
        source: "vllm platforms/cuda.py backend priorities; docs/design/attention_backends.md (D)",
    },
    Priority {
        runtime: Runtime::Kvfleet,
        family: None,
        mla: false,
        order: &[B::KvfleetCuda],
        source: "kvfleet: a GPU node runs KVFLEET_CUDA; KVFLEET_CPU is never chosen for a GPU",
    },
    Priority {
        runtime: Runtime::Kvfleet,
        family: None,
        mla: true,
        order: &[B::KvfleetCuda],
        source: "kvfleet: a GPU node runs KVFLEET_CUDA; KVFLEET_CPU is never chosen for a GPU",
    },
];

/// The backends `auto` tries, best first.
pub fn priority(runtime: Runtime, cc: ComputeCapability, features: &ModelFeatures) -> &'static [B] {
    PRIORITIES
        .iter()
        .find(|p| p.runtime == runtime && p.mla == features.mla && p.family.is_none_or(|f| f == cc.family()))
        .map(|p| p.order)
        .unwrap_or(&[])
}

/// What `auto` KV dtype means on an architecture: the model dtype, float16 where the GPU
/// has no bfloat16 (vLLM casts the same way: vllm/platforms/cuda.py supported_dtypes).
pub fn resolve_dtype(cc: ComputeCapability, features: &ModelFeatures, dtype: D) -> D {
    match dtype {
        D::Auto => {
            let model = match features.model_dtype {
                D::Float16 => D::Float16,
                _ => D::Bfloat16,
            };
            if model == D::Bfloat16 && cc < ComputeCapability::new(8, 0) {
                D::Float16
            } else {
                model
            }
        }
        d => d,
    }
}

/// The rules of `severity` the case breaks.
fn violations(case: &Case, severity: Severity) -> Vec<Violation> {
    rules(case.runtime)
        .iter()
        .filter(|r| r.breaks(case, severity))
        .map(|r| r.violation(case))
        .collect()
}

/// Resolution without messages: (resolved, candidates tried). `query.backend` may be `auto`.
fn resolve(query: &Case) -> (Option<(D, B)>, Vec<B>) {
    let candidates: Vec<B> = if query.backend == B::Auto {
        priority(query.runtime, query.cc, query.features).to_vec()
    } else {
        vec![query.backend]
    };
    let resolved = candidates.iter().copied().find(|b| {
        let case = query.with_backend(*b);
        !rules(query.runtime)
            .iter()
            .any(|r| r.breaks(&case, Severity::Deny))
    });
    (resolved.map(|b| (query.dtype, b)), candidates)
}

/// Judges one combination on one architecture, resolving `auto` dtype and backend.
///
/// When nothing runs, the violations are the rules every candidate backend breaks (the root
/// cause, e.g. the KV dtype) when there are such, else each candidate's own.
pub fn evaluate(
    runtime: Runtime,
    cc: ComputeCapability,
    features: &ModelFeatures,
    dtype: D,
    backend: B,
) -> Evaluation {
    evaluate_at(runtime, cc, features, dtype, backend, None)
}

/// [`evaluate`] for one vLLM release: a dtype or backend the release lacks is denied with
/// the release that has it, and rules a release lifted no longer apply.
pub fn evaluate_at(
    runtime: Runtime,
    cc: ComputeCapability,
    features: &ModelFeatures,
    dtype: D,
    backend: B,
    vllm: Option<VllmVersion>,
) -> Evaluation {
    let vllm = vllm.filter(|_| runtime == Runtime::Vllm);
    let query = Case::new(runtime, cc, features, dtype, backend, vllm);
    let (resolved, candidates) = resolve(&query);
    if let Some((_, b)) = resolved {
        return Evaluation {
            resolved,
            violations: Vec::new(),
            warnings: violations(&query.with_backend(b), Severity::Warn),
        };
    }
    let per_candidate: Vec<Vec<Violation>> = candidates
        .iter()
        .map(|b| violations(&query.with_backend(*b), Severity::Deny))
        .collect();
    let common: Vec<Violation> = per_candidate
        .first()
        .map(|first| {
            first
                .iter()
                .filter(|v| per_candidate.iter().all(|vs| vs.iter().any(|w| w.rule == v.rule)))
                .cloned()
                .collect()
        })
        .unwrap_or_default();
    let mut violations = if common.is_empty() {
        let mut all: Vec<Violation> = Vec::new();
        for v in per_candidate.into_iter().flatten() {
            if !all.iter().any(|w| w.rule == v.rule) {
                all.push(v);
            }
        }
        all
    } else {
        common
    };
    if violations.is_empty() {
        // No candidate at all (a runtime/arch pair without a priority row).
        violations.push(Violation {
            rule: "no-backend",
            source: "kvfleet",
            reason: "NoAttentionBackend",
            field: BACKEND,
            cause: format!("no attention backend of the {runtime} runtime is known for compute capability {cc}"),
            fix: "select other GPUs".to_string(),
            message: format!(
                "no attention backend of the {runtime} runtime is known for compute capability {cc}; select other GPUs"
            ),
        });
    }
    Evaluation {
        resolved: None,
        violations,
        warnings: Vec::new(),
    }
}
