//! Model features that constrain which attention backends and KV dtypes can run.

use serde::Serialize;

use super::vocab::{KvCacheDtype, Quantization, SpeculativeMethod};

/// What a model's attention looks like, as far as kernels care.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ModelFeatures {
    /// Distinct attention head dimensions (e.g. `[256, 512]` for Gemma 4: sliding and
    /// global heads). For MLA models the latent width `kv_lora_rank + qk_rope_head_dim`.
    /// Empty when unknown (model given by a ConfigMap that admission cannot read).
    pub head_dims: Vec<u32>,
    /// Distinct sliding-window sizes in tokens across layers (empty: no sliding layers).
    pub sliding_windows: Vec<u32>,
    /// Layers differ in their window (some sliding, some full, or several windows), as in
    /// Gemma 2/3/4 and gpt-oss. FlashInfer needs one window for all layers.
    pub per_layer_windows: bool,
    /// Attention without a causal mask (drafter blocks, encoders; a DFlash drafter).
    pub non_causal: bool,
    /// The only non-causal attention is a DFlash drafter's (its own full-attention layers): the
    /// model's layers keep the causal mask, and their windows with it.
    pub non_causal_drafter_only: bool,
    /// The speculative-decoding method the engine runs (`engine.speculative.method`).
    pub speculative: Option<SpeculativeMethod>,
    /// The checkpoint's weights are quantized (fp8, AWQ, GPTQ, ...).
    pub quantized_checkpoint: bool,
    /// How (`model.quantization`).
    pub quantization: Quantization,
    /// Some decoder layers are mixture-of-experts (geometry `numExperts`).
    pub moe: bool,
    /// The checkpoint's architecture (`model.architecture`: HF `architectures[0]`), when
    /// the spec names it.
    pub architecture: Option<String>,
    /// The linear-layer weights are FP8 e4m3 in GPU memory: an FP8 checkpoint
    /// (`model.quantization: fp8`) or quantized at load (`engine.quantization: fp8`).
    pub fp8_weights: bool,
    /// The FP8 weights are made at load from an unquantized checkpoint
    /// (`engine.quantization: fp8`).
    pub fp8_at_load: bool,
    /// Multi-head latent attention (DeepSeek-style `kv_lora_rank`).
    pub mla: bool,
    /// The model's activation dtype: `bfloat16` or `float16`; what `auto` KV resolves to.
    pub model_dtype: KvCacheDtype,
    /// Distinct GQA group sizes (query heads per KV head) across layers; empty when unknown.
    pub gqa_groups: Vec<u32>,
    /// The engine's KV page size in tokens (`spec.engine.blockSize`), when the caller knows it.
    pub block_size: Option<u32>,
}

impl Default for ModelFeatures {
    fn default() -> Self {
        Self {
            head_dims: Vec::new(),
            sliding_windows: Vec::new(),
            per_layer_windows: false,
            non_causal: false,
            non_causal_drafter_only: false,
            speculative: None,
            quantized_checkpoint: false,
            quantization: Quantization::None,
            moe: false,
            architecture: None,
            fp8_weights: false,
            fp8_at_load: false,
            mla: false,
            model_dtype: KvCacheDtype::Bfloat16,
            gqa_groups: Vec::new(),
            block_size: None,
        }
    }
}

impl ModelFeatures {
    /// Features of a model whose geometry is unknown (only the engine flags are known).
    pub fn unknown(non_causal: bool, quantized: bool) -> Self {
        Self {
            non_causal,
            quantized_checkpoint: quantized,
            ..Self::default()
        }
    }
}
