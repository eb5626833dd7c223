//! What a model's geometry means for kernels: the features the compat rules take.

use super::{LayerType, ModelGeometry};
use crate::compat::{KvCacheDtype, ModelFeatures};

impl ModelGeometry {
    /// Derives the features from the CRD's geometry. Values the schema would reject
    /// (negative numbers) are ignored rather than trusted.
    pub fn features(&self, non_causal: bool, quantized: bool) -> ModelFeatures {
        let g = self;
        let pos = |v: i32| u32::try_from(v).ok().filter(|v| *v > 0);
        let mut head_dims = Vec::new();
        let mla = g.kv_lora_rank.is_some();
        if mla {
            let latent =
                g.kv_lora_rank.and_then(pos).unwrap_or(0) + g.qk_rope_head_dim.and_then(pos).unwrap_or(0);
            if latent > 0 {
                head_dims.push(latent);
            }
        } else {
            head_dims.extend(pos(g.head_dim));
        }

        let layers = usize::try_from(g.layers).unwrap_or(0);
        let window = g.sliding_window.and_then(pos);
        // Absent layerTypes: all full, or all sliding when only slidingWindow is set
        // (Mistral 7B v0.1), as the CRD documents.
        let types: Vec<LayerType> = match &g.layer_types {
            Some(t) if !t.is_empty() => t.clone(),
            _ if window.is_some() => vec![LayerType::SlidingAttention; layers.max(1)],
            _ => vec![LayerType::FullAttention; layers.max(1)],
        };
        let has_sliding = types.contains(&LayerType::SlidingAttention);
        let has_full = types.contains(&LayerType::FullAttention);
        if has_full && !mla {
            if let Some(global) = g.global_head_dim.and_then(pos) {
                head_dims.push(global);
            }
        }
        head_dims.sort_unstable();
        head_dims.dedup();

        let sliding_windows: Vec<u32> = if has_sliding {
            window.into_iter().collect()
        } else {
            Vec::new()
        };
        let mut gqa_groups = Vec::new();
        if !mla {
            if let Some(q) = pos(g.query_heads) {
                let mut kvs: Vec<u32> = pos(g.kv_heads).into_iter().collect();
                if has_full {
                    kvs.extend(g.global_kv_heads.and_then(pos));
                }
                gqa_groups.extend(kvs.into_iter().filter(|k| q % k == 0).map(|k| q / k));
            }
        }
        gqa_groups.sort_unstable();
        gqa_groups.dedup();
        ModelFeatures {
            head_dims,
            gqa_groups,
            block_size: None,
            per_layer_windows: has_sliding && has_full,
            sliding_windows,
            non_causal,
            non_causal_drafter_only: false,
            speculative: None,
            quantized_checkpoint: quantized,
            quantization: crate::compat::vocab::Quantization::None,
            moe: g.moe.is_some(),
            architecture: None,
            fp8_weights: false,
            fp8_at_load: false,
            mla,
            model_dtype: KvCacheDtype::Bfloat16,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry(json: serde_json::Value) -> ModelGeometry {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn llama_has_one_head_dim_and_no_windows() {
        let g = geometry(serde_json::json!({"layers": 32, "queryHeads": 32, "kvHeads": 8, "headDim": 128}));
        let f = g.features(false, false);
        assert_eq!(f.head_dims, vec![128]);
        assert!(f.sliding_windows.is_empty());
        assert!(!f.per_layer_windows && !f.mla);
        assert_eq!(f.model_dtype, KvCacheDtype::Bfloat16);
    }

    #[test]
    fn gemma4_style_geometry_has_per_layer_windows_and_two_head_dims() {
        let mut types = vec!["sliding_attention"; 5];
        types.push("full_attention");
        let g = geometry(serde_json::json!({
            "layers": 6, "queryHeads": 32, "kvHeads": 16, "headDim": 256,
            "slidingWindow": 1024, "layerTypes": types, "globalHeadDim": 512, "globalKvHeads": 4
        }));
        let f = g.features(false, true);
        assert_eq!(f.head_dims, vec![256, 512]);
        assert_eq!(f.sliding_windows, vec![1024]);
        assert!(f.per_layer_windows);
        assert!(f.quantized_checkpoint);
    }

    #[test]
    fn mistral_v01_all_sliding_has_one_global_window() {
        let g = geometry(serde_json::json!({
            "layers": 32, "queryHeads": 32, "kvHeads": 8, "headDim": 128, "slidingWindow": 4096
        }));
        let f = g.features(false, false);
        assert_eq!(f.sliding_windows, vec![4096]);
        assert!(!f.per_layer_windows);
    }

    #[test]
    fn mla_uses_latent_width() {
        let g = geometry(serde_json::json!({
            "layers": 61, "queryHeads": 128, "kvHeads": 128, "headDim": 192,
            "kvLoraRank": 512, "qkRopeHeadDim": 64
        }));
        let f = g.features(false, false);
        assert!(f.mla);
        assert_eq!(f.head_dims, vec![576]);
    }
}
