//! The closed vocabularies shared by the API, the rules and the engine: KV-cache dtypes,
//! attention backends, runtimes and speculative-decoding methods. Strings are exactly what users write in a spec
//! (and, for the vLLM runtime, what vLLM's CLI accepts).

use std::fmt;
use std::str::FromStr;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Which engine serves the model.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Runtime {
    /// kvfleet's own batched paged-attention engine (`kvfleet worker`).
    #[default]
    Kvfleet,
    /// The vLLM OpenAI-compatible server.
    Vllm,
}

/// Weight quantization of the checkpoint (`model.quantization`), as its config.json declares
/// it. Which GPUs and runtimes run each is a compat rule (docs/compat.md, "Weights").
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Quantization {
    /// Unquantized bf16/fp16 weights.
    #[default]
    None,
    /// FP8 e4m3 (`quant_method: fp8`, or compressed-tensors `float-quantized`).
    Fp8,
    /// AutoAWQ GEMM, 4-bit (`quant_method: awq`).
    Awq,
    /// GPTQ, 4-bit (`quant_method: gptq`).
    Gptq,
    /// compressed-tensors `pack-quantized` 4-bit integer weights, 16-bit activations
    /// (llm-compressor's W4A16 schemes).
    W4a16,
    /// OCP microscaling FP4 (`quant_method: mxfp4`; gpt-oss's experts).
    Mxfp4,
    /// INT8 weights (W8A8 or W8A16).
    Int8,
    /// NVIDIA FP4 with FP8 block scales (ModelOpt `NVFP4`, compressed-tensors `nvfp4`).
    Nvfp4,
    /// A GGUF file's own block formats.
    Gguf,
}

impl Quantization {
    pub fn is_quantized(self) -> bool {
        self != Quantization::None
    }

    /// As written in a spec.
    pub fn as_str(self) -> &'static str {
        match self {
            Quantization::None => "none",
            Quantization::Fp8 => "fp8",
            Quantization::Awq => "awq",
            Quantization::Gptq => "gptq",
            Quantization::W4a16 => "w4a16",
            Quantization::Mxfp4 => "mxfp4",
            Quantization::Int8 => "int8",
            Quantization::Nvfp4 => "nvfp4",
            Quantization::Gguf => "gguf",
        }
    }

    /// 4-bit weights (integer or FP4).
    pub fn is_four_bit(self) -> bool {
        matches!(
            self,
            Quantization::Awq
                | Quantization::Gptq
                | Quantization::W4a16
                | Quantization::Mxfp4
                | Quantization::Nvfp4
        )
    }
}

impl fmt::Display for Quantization {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// KV-cache storage dtype. `auto` keeps the model's dtype.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
pub enum KvCacheDtype {
    /// The model's own dtype (bfloat16 or float16).
    #[default]
    #[serde(rename = "auto")]
    Auto,
    /// 16-bit brain float, 2 bytes per element.
    #[serde(rename = "bfloat16")]
    Bfloat16,
    /// IEEE half precision, 2 bytes per element.
    #[serde(rename = "float16")]
    Float16,
    /// 8-bit float; vLLM treats it as fp8_e4m3.
    #[serde(rename = "fp8")]
    Fp8,
    /// 8-bit float with 4 exponent and 3 mantissa bits, per-tensor scale.
    #[serde(rename = "fp8_e4m3")]
    Fp8E4m3,
    /// 8-bit float with 5 exponent and 2 mantissa bits.
    #[serde(rename = "fp8_e5m2")]
    Fp8E5m2,
    /// 4-bit e2m1 with an fp8 e4m3 scale per 16 values and a global scale.
    #[serde(rename = "nvfp4")]
    Nvfp4,
}

impl KvCacheDtype {
    pub const ALL: [KvCacheDtype; 7] = [
        Self::Auto,
        Self::Bfloat16,
        Self::Float16,
        Self::Fp8,
        Self::Fp8E4m3,
        Self::Fp8E5m2,
        Self::Nvfp4,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Bfloat16 => "bfloat16",
            Self::Float16 => "float16",
            Self::Fp8 => "fp8",
            Self::Fp8E4m3 => "fp8_e4m3",
            Self::Fp8E5m2 => "fp8_e5m2",
            Self::Nvfp4 => "nvfp4",
        }
    }

    /// `fp8` is an alias of `fp8_e4m3` (vllm/config/cache.py).
    pub fn canonical(self) -> Self {
        match self {
            Self::Fp8 => Self::Fp8E4m3,
            other => other,
        }
    }

    pub fn is_fp8(self) -> bool {
        matches!(self, Self::Fp8 | Self::Fp8E4m3 | Self::Fp8E5m2)
    }

    /// Data bytes of one head vector of `head_dim` values: 2 per value for the 16-bit dtypes
    /// (`auto` keeps the model's), 1 for fp8, packed e2m1 (`head_dim / 2`) for nvfp4. With
    /// [`Self::scale_bytes`], the layout of vLLM's `FullAttentionSpec.real_page_size_bytes`
    /// (vllm/v1/kv_cache_interface.py, `nvfp4_kv_cache_full_dim`), of the engine's pools and of
    /// the kernels' caches.
    pub fn data_bytes(self, head_dim: usize) -> usize {
        match self {
            Self::Auto | Self::Bfloat16 | Self::Float16 => 2 * head_dim,
            Self::Fp8 | Self::Fp8E4m3 | Self::Fp8E5m2 => head_dim,
            Self::Nvfp4 => head_dim / 2,
        }
    }

    /// Block-scale bytes of one head vector: nvfp4 keeps one fp8 e4m3 scale per
    /// [`NVFP4_BLOCK`] values; the other dtypes none.
    pub fn scale_bytes(self, head_dim: usize) -> usize {
        match self {
            Self::Nvfp4 => head_dim / NVFP4_BLOCK,
            _ => 0,
        }
    }

    /// Whether a head vector of `head_dim` values has a layout in this dtype (nvfp4 needs
    /// whole blocks of [`NVFP4_BLOCK`]).
    pub fn fits_head_dim(self, head_dim: usize) -> bool {
        match self {
            Self::Nvfp4 => head_dim % NVFP4_BLOCK == 0,
            _ => true,
        }
    }
}

/// Values per nvfp4 block scale.
pub const NVFP4_BLOCK: usize = 16;

/// Attention backend. Upper-case names are vLLM's `--attention-backend` values;
/// `KVFLEET_CUDA` and `KVFLEET_CPU` are kvfleet's own engine.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
pub enum AttentionBackend {
    /// Pick the best backend that runs on each selected architecture.
    #[default]
    #[serde(rename = "auto")]
    Auto,
    #[serde(rename = "FLASH_ATTN")]
    FlashAttn,
    #[serde(rename = "FLASHINFER")]
    FlashInfer,
    #[serde(rename = "TRITON_ATTN")]
    TritonAttn,
    #[serde(rename = "FLEX_ATTENTION")]
    FlexAttention,
    #[serde(rename = "TREE_ATTN")]
    TreeAttn,
    #[serde(rename = "FLASHMLA")]
    FlashMla,
    #[serde(rename = "CUTLASS_MLA")]
    CutlassMla,
    #[serde(rename = "FLASHINFER_MLA")]
    FlashInferMla,
    #[serde(rename = "TRITON_MLA")]
    TritonMla,
    /// kvfleet's NVRTC-compiled CUDA kernels.
    #[serde(rename = "KVFLEET_CUDA")]
    KvfleetCuda,
    /// kvfleet's CPU engine (no GPU).
    #[serde(rename = "KVFLEET_CPU")]
    KvfleetCpu,
}

impl AttentionBackend {
    pub const ALL: [AttentionBackend; 12] = [
        Self::Auto,
        Self::FlashAttn,
        Self::FlashInfer,
        Self::TritonAttn,
        Self::FlexAttention,
        Self::TreeAttn,
        Self::FlashMla,
        Self::CutlassMla,
        Self::FlashInferMla,
        Self::TritonMla,
        Self::KvfleetCuda,
        Self::KvfleetCpu,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::FlashAttn => "FLASH_ATTN",
            Self::FlashInfer => "FLASHINFER",
            Self::TritonAttn => "TRITON_ATTN",
            Self::FlexAttention => "FLEX_ATTENTION",
            Self::TreeAttn => "TREE_ATTN",
            Self::FlashMla => "FLASHMLA",
            Self::CutlassMla => "CUTLASS_MLA",
            Self::FlashInferMla => "FLASHINFER_MLA",
            Self::TritonMla => "TRITON_MLA",
            Self::KvfleetCuda => "KVFLEET_CUDA",
            Self::KvfleetCpu => "KVFLEET_CPU",
        }
    }

    /// The runtime that implements this backend; `None` for `auto`.
    pub fn runtime(self) -> Option<Runtime> {
        match self {
            Self::Auto => None,
            Self::KvfleetCuda | Self::KvfleetCpu => Some(Runtime::Kvfleet),
            _ => Some(Runtime::Vllm),
        }
    }

    pub fn is_mla(self) -> bool {
        matches!(
            self,
            Self::FlashMla | Self::CutlassMla | Self::FlashInferMla | Self::TritonMla
        )
    }
}

impl Runtime {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Kvfleet => "kvfleet",
            Self::Vllm => "vllm",
        }
    }
}

/// How draft tokens are proposed for speculative decoding (`engine.speculative.method`); the
/// names are vLLM's `--speculative-config` `method` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum SpeculativeMethod {
    /// Prompt lookup: the tokens that followed the latest earlier occurrence of the last
    /// n-gram of the sequence (prompt and output so far). No draft model.
    Ngram,
    /// EAGLE-3: a small drafter fed with hidden states of several of the target's layers.
    Eagle3,
    /// DFlash: a block-diffusion drafter that fills a block of draft tokens in one
    /// non-causal forward pass.
    Dflash,
}

impl SpeculativeMethod {
    pub const ALL: [SpeculativeMethod; 3] = [Self::Ngram, Self::Eagle3, Self::Dflash];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ngram => "ngram",
            Self::Eagle3 => "eagle3",
            Self::Dflash => "dflash",
        }
    }

    /// Whether the method proposes with a drafter checkpoint (`draftModel`).
    pub fn needs_draft_model(self) -> bool {
        self != Self::Ngram
    }
}

macro_rules! display_and_parse {
    ($ty:ty, $what:literal, $all:expr) => {
        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $ty {
            type Err = UnknownValue;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                $all.iter()
                    .copied()
                    .find(|v| v.as_str() == s)
                    .ok_or_else(|| UnknownValue {
                        what: $what,
                        value: s.to_string(),
                        expected: $all
                            .iter()
                            .map(|v| v.as_str())
                            .collect::<Vec<_>>()
                            .join(", "),
                    })
            }
        }
    };
}

display_and_parse!(KvCacheDtype, "kvCacheDtype", KvCacheDtype::ALL);
display_and_parse!(AttentionBackend, "attentionBackend", AttentionBackend::ALL);
display_and_parse!(Runtime, "runtime", [Runtime::Kvfleet, Runtime::Vllm]);
display_and_parse!(SpeculativeMethod, "speculative.method", SpeculativeMethod::ALL);

/// A string that is not one of a closed vocabulary's values.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} {value:?}; expected one of: {expected}")]
pub struct UnknownValue {
    pub what: &'static str,
    pub value: String,
    pub expected: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dtype_round_trips_through_its_spec_string() {
        for d in KvCacheDtype::ALL {
            assert_eq!(d.as_str().parse::<KvCacheDtype>().unwrap(), d);
            assert_eq!(serde_json::to_value(d).unwrap(), serde_json::json!(d.as_str()));
        }
    }

    #[test]
    fn head_vector_bytes_follow_the_element_size_and_nvfp4_blocks() {
        let bytes = |d: KvCacheDtype| (d.data_bytes(128), d.scale_bytes(128));
        assert_eq!(bytes(KvCacheDtype::Auto), (256, 0));
        assert_eq!(bytes(KvCacheDtype::Bfloat16), (256, 0));
        assert_eq!(bytes(KvCacheDtype::Fp8), (128, 0));
        assert_eq!(bytes(KvCacheDtype::Fp8E5m2), (128, 0));
        assert_eq!(bytes(KvCacheDtype::Nvfp4), (64, 8));
        assert!(KvCacheDtype::Nvfp4.fits_head_dim(64));
        assert!(!KvCacheDtype::Nvfp4.fits_head_dim(72));
        assert!(KvCacheDtype::Fp8.fits_head_dim(72));
    }

    #[test]
    fn speculative_methods_round_trip_through_vllms_method_names() {
        for m in SpeculativeMethod::ALL {
            assert_eq!(m.as_str().parse::<SpeculativeMethod>().unwrap(), m);
            assert_eq!(serde_json::to_value(m).unwrap(), serde_json::json!(m.as_str()));
        }
        assert!(!SpeculativeMethod::Ngram.needs_draft_model());
        assert!(SpeculativeMethod::Dflash.needs_draft_model());
    }

    #[test]
    fn backend_names_are_upper_case_as_vllm_expects() {
        for b in AttentionBackend::ALL {
            assert_eq!(b.as_str().parse::<AttentionBackend>().unwrap(), b);
        }
        let err = "triton".parse::<AttentionBackend>().unwrap_err();
        assert!(err.to_string().contains("TRITON_ATTN"), "{err}");
    }
}
