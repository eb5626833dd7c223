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
        let attention = ((q + 2 * kv) * d + q * d, (q + 2 * kv) + d);
        let mlp = |ff: u64| (3 * ff * d, 2 * ff + d);
        let Some(moe) = &g.moe else {
            let (p, c) = (attention.0 + mlp(ff).0, attention.1 + mlp(ff).1);
            return Some(LinearLayers {
                params: layers * p,
                channels: layers * c,
            });
        };
        // Mixture of experts: every expert of every MoE layer is in memory (vLLM's FusedMoE
        // quantizes them all; the router stays in the model dtype, counted with the rest).
        // Dense layers keep the geometry's intermediateSize.
        let experts = u(moe.num_experts)?;
        let expert = mlp(u(moe.moe_intermediate_size)?);
        let shared = moe
            .shared_expert_intermediate_size
            .and_then(u)
            .map_or((0, 0), mlp);
        let dense = moe
            .dense_layers
            .iter()
            .filter(|l| u64::try_from(**l).is_ok_and(|l| l < layers))
            .count() as u64;
        let sparse = layers - dense;
        let sparse_layer = (experts * expert.0 + shared.0, experts * expert.1 + shared.1);
        Some(LinearLayers {
            params: layers * attention.0 + dense * mlp(ff).0 + sparse * sparse_layer.0,
            channels: layers * attention.1 + dense * mlp(ff).1 + sparse * sparse_layer.1,
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

    /// Qwen3-30B-A3B (config.json): 48 layers, hidden 2048, 32 query and 4 KV heads of 128,
    /// 128 experts of width 768, vocabulary 151,936, untied: 30.5 B parameters (model card).
    #[test]
    fn qwen3_30b_a3b_linear_layers_count_every_expert() {
        let g: ModelGeometry = serde_json::from_value(serde_json::json!({
            "layers": 48, "queryHeads": 32, "kvHeads": 4, "headDim": 128,
            "hiddenSize": 2048, "intermediateSize": 6144, "vocabSize": 151936,
            "moe": {"numExperts": 128, "numExpertsPerToken": 8, "moeIntermediateSize": 768}
        }))
        .unwrap();
        let l = LinearLayers::of(&g).unwrap();
        // Less the embedding and head (2 x 151936 x 2048), the routers (48 x 2048 x 128) and
        // the norms (48 x (2 x 2048 + 2 x 128) + 2048).
        let rest = 2 * 151_936 * 2048 + 48 * 2048 * 128 + 48 * (2 * 2048 + 2 * 128) + 2048;
        let total = (l.params + rest) as f64;
        assert!((total / 30.5e9 - 1.0).abs() < 0.002, "{total}");
        // The active parameters a token reads: 3.3 B on the card; 8 of 128 experts.
        let active = total - (48 * 120 * 3 * 768 * 2048_u64) as f64;
        assert!((active / 3.3e9 - 1.0).abs() < 0.02, "{active}");
        // A dense layer instead of a sparse one: 128 experts out, one MLP of 6144 in.
        let mut dense = g.clone();
        dense.moe.as_mut().unwrap().dense_layers = vec![0, 9999];
        let d = LinearLayers::of(&dense).unwrap();
        assert_eq!(l.params - d.params, 128 * 3 * 768 * 2048 - 3 * 6144 * 2048);
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
