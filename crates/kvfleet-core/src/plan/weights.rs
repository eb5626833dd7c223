//! Weight bytes by dtype: what `engine.quantization: fp8` leaves of a bf16 checkpoint.
//!
//! vLLM's `fp8` method quantizes the linear layers only (`Fp8Config.get_quant_method` in
//! vllm `model_executor/layers/quantization/fp8.py` returns a method for `LinearBase`,
//! `FusedMoE` and `Attention`; the embedding and the LM head are `VocabParallelEmbedding` /
//! `ParallelLMHead` and stay in the model dtype), and quantized at load each linear weight
//! becomes one e4m3 byte with one f32 scale per tensor (`ops.scaled_fp8_quant(weight,
//! scale=None)` in `process_weights_after_loading`). Norms stay bf16 too.
//!
//! The planner counts the scales as one f32 per output channel, an upper bound that also
//! covers per-channel checkpoints: for Llama-3.1-8B that is 0.9 MiB against 7 GiB of weights.

use serde::Serialize;

use crate::api::ModelGeometry;

/// The linear layers of a Llama-family decoder: weights and output channels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct LinearLayers {
    /// Weights of Q, K, V, O, gate, up and down over all layers.
    pub params: u64,
    /// Output channels of those matrices over all layers (one FP8 scale each, at most).
    pub channels: u64,
}

impl LinearLayers {
    /// From a CRD geometry with `hiddenSize` and `intermediateSize`; `None` without them
    /// (or for MLA, whose projections differ).
    pub fn of(g: &ModelGeometry) -> Option<LinearLayers> {
        if g.kv_lora_rank.is_some() {
            return None;
        }
        let u = |v: i32| u64::try_from(v).ok().filter(|v| *v > 0);
        let (layers, d, ff) = (u(g.layers)?, u(g.hidden_size?)?, u(g.intermediate_size?)?);
        let (q, kv) = (
            u(g.query_heads)? * u(g.head_dim)?,
            u(g.kv_heads)? * u(g.head_dim)?,
        );
        // Q/K/V and O; gate and up (d -> ff) and down (ff -> d).
        let params = (q + 2 * kv) * d + q * d + 3 * ff * d;
        let channels = (q + 2 * kv) + d + 2 * ff + d;
        Some(LinearLayers {
            params: layers * params,
            channels: layers * channels,
        })
    }

    /// The weights of a checkpoint of `bf16_bytes` after its linear layers become FP8:
    /// one byte a weight instead of two, plus an f32 scale per output channel. `None` when
    /// the linear layers alone exceed the checkpoint (weightBytes and geometry disagree).
    pub fn fp8_bytes(&self, bf16_bytes: u64) -> Option<u64> {
        let linear_bf16 = 2 * self.params;
        let rest = bf16_bytes.checked_sub(linear_bf16)?;
        Some(rest + self.params + 4 * self.channels)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama_3_1_8b() -> ModelGeometry {
        serde_json::from_value(serde_json::json!({
            "layers": 32, "queryHeads": 32, "kvHeads": 8, "headDim": 128,
            "hiddenSize": 4096, "intermediateSize": 14336, "vocabSize": 128256
        }))
        .unwrap()
    }

    #[test]
    fn llama_3_1_8b_linear_layers_are_its_parameters_less_embeddings_and_norms() {
        let l = LinearLayers::of(&llama_3_1_8b()).unwrap();
        // 8,030,261,248 parameters in all; the embedding and LM head 2 x 128256 x 4096,
        // the norms 65 x 4096.
        assert_eq!(l.params, 8_030_261_248 - 2 * 128_256 * 4096 - 65 * 4096);
        assert_eq!(l.channels, 32 * (4096 + 2 * 1024 + 4096 + 2 * 14336 + 4096));
    }

    #[test]
    fn fp8_at_load_halves_the_linear_layers_and_keeps_embeddings_bf16() {
        let l = LinearLayers::of(&llama_3_1_8b()).unwrap();
        let bf16 = 2 * 8_030_261_248u64;
        let fp8 = l.fp8_bytes(bf16).unwrap();
        assert_eq!(fp8, bf16 - l.params + 4 * l.channels);
        // 16.06 GB -> 9.08 GB: the 2.1 GB of embeddings and LM head stay bf16.
        assert_eq!(fp8, 9_081_200_640 + 4 * l.channels);
        assert!(fp8 > bf16 / 2 + 2 * 2 * 128_256 * 4096 / 2);
        // A weightBytes smaller than the linear layers is inconsistent, not negative.
        assert_eq!(l.fp8_bytes(l.params), None);
    }

    #[test]
    fn linear_layers_need_hidden_and_intermediate_size() {
        let mut g = llama_3_1_8b();
        g.intermediate_size = None;
        assert_eq!(LinearLayers::of(&g), None);
        let mut g = llama_3_1_8b();
        g.kv_lora_rank = Some(512);
        assert_eq!(LinearLayers::of(&g), None);
    }
}
