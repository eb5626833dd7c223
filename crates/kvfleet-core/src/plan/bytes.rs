//! Bytes of KV cache per token, per layer, per tensor-parallel rank.

use super::geometry::{Geometry, LayerKind, LayerSpec};
use super::PlanError;
use crate::compat::KvCacheDtype;

/// Bytes one head vector of `head_dim` values occupies in `dtype` (data and block scales, see
/// [`KvCacheDtype::data_bytes`]); an error where the dtype has no layout for `head_dim`.
pub fn head_vector_bytes(head_dim: u32, dtype: KvCacheDtype) -> Result<u64, PlanError> {
    let d = head_dim as usize;
    if !dtype.fits_head_dim(d) {
        return Err(PlanError::UnsupportedDtype {
            dtype,
            reason: format!(
                "nvfp4 packs 16 values per scale; head_dim {head_dim} is not a multiple of 16; use fp8"
            ),
        });
    }
    Ok((dtype.data_bytes(d) + dtype.scale_bytes(d)) as u64)
}

/// KV heads one rank holds: `max(1, kv_heads / tp)` (KV heads are replicated when
/// tp exceeds them); MLA latents are replicated on every rank (1 "head").
pub fn kv_heads_per_rank(layer: &LayerSpec, tp: u32) -> u32 {
    match layer.kind {
        LayerKind::Mla => 1,
        _ => (layer.kv_heads / tp.max(1)).max(1),
    }
}

/// Bytes of KV cache one token needs in `layer` on one of `tp` ranks:
/// 2 (K and V) x kv_heads_per_rank x head_vector_bytes; MLA stores one latent, no V.
pub fn kv_bytes_per_token(layer: &LayerSpec, dtype: KvCacheDtype, tp: u32) -> Result<u64, PlanError> {
    let heads = u64::from(kv_heads_per_rank(layer, tp));
    match layer.kind {
        LayerKind::Mla => {
            if dtype == KvCacheDtype::Nvfp4 {
                return Err(PlanError::UnsupportedDtype {
                    dtype,
                    reason: "MLA latents have no nvfp4 layout in vLLM; use fp8 or auto".into(),
                });
            }
            Ok(heads * head_vector_bytes(layer.head_dim, dtype)?)
        }
        _ => Ok(2 * heads * head_vector_bytes(layer.head_dim, dtype)?),
    }
}

/// Bytes of one page (`block_size` tokens) of one layer on one rank.
pub fn page_bytes(
    layer: &LayerSpec,
    dtype: KvCacheDtype,
    tp: u32,
    block_size: u32,
) -> Result<u64, PlanError> {
    Ok(u64::from(block_size) * kv_bytes_per_token(layer, dtype, tp)?)
}

/// Checks that `tp` can shard the model the way vLLM requires: query heads divisible
/// by tp, and KV heads divisible by tp (or tp divisible by KV heads, which replicates).
pub fn check_tensor_parallel(geometry: &Geometry, tp: u32) -> Result<(), PlanError> {
    if tp == 0 {
        return Err(PlanError::InvalidInput(
            "tensor parallel size must be at least 1".into(),
        ));
    }
    if geometry.query_heads % tp != 0 {
        return Err(PlanError::TensorParallel {
            tp,
            message: format!(
                "num_attention_heads {} is not divisible by tensor parallel size {tp}; use a tp that divides it",
                geometry.query_heads
            ),
        });
    }
    for (spec, _) in geometry.distinct_specs() {
        if spec.kind == LayerKind::Mla {
            continue;
        }
        let k = spec.kv_heads;
        let ok = if k >= tp { k % tp == 0 } else { tp % k == 0 };
        if !ok {
            return Err(PlanError::TensorParallel {
                tp,
                message: format!(
                    "{k} KV heads ({} layers) cannot be split over tensor parallel size {tp}: tp must divide the KV heads or be a multiple of them",
                    spec.kind.label()
                ),
            });
        }
    }
    Ok(())
}

/// 2-byte, 1-byte or packed-4-bit: what one value costs, for explanations.
pub fn dtype_label(dtype: KvCacheDtype) -> &'static str {
    match dtype {
        KvCacheDtype::Auto => "auto (model dtype, 2 bytes)",
        KvCacheDtype::Bfloat16 => "bfloat16 (2 bytes)",
        KvCacheDtype::Float16 => "float16 (2 bytes)",
        KvCacheDtype::Fp8 | KvCacheDtype::Fp8E4m3 | KvCacheDtype::Fp8E5m2 => "fp8 (1 byte)",
        KvCacheDtype::Nvfp4 => "nvfp4 (head_dim/2 + head_dim/16 bytes per head vector)",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full(kv: u32, d: u32) -> LayerSpec {
        LayerSpec {
            kind: LayerKind::Full,
            kv_heads: kv,
            head_dim: d,
        }
    }

    #[test]
    fn nvfp4_head_vector_is_half_plus_a_sixteenth() {
        assert_eq!(head_vector_bytes(128, KvCacheDtype::Nvfp4).unwrap(), 64 + 8);
        assert_eq!(head_vector_bytes(512, KvCacheDtype::Nvfp4).unwrap(), 256 + 32);
        assert!(head_vector_bytes(72, KvCacheDtype::Nvfp4).is_err());
    }

    #[test]
    fn bytes_per_token_shrink_with_tp_until_one_head_per_rank() {
        let l = full(8, 128);
        assert_eq!(
            kv_bytes_per_token(&l, KvCacheDtype::Bfloat16, 1).unwrap(),
            2 * 8 * 256
        );
        assert_eq!(kv_bytes_per_token(&l, KvCacheDtype::Fp8, 4).unwrap(), 2 * 2 * 128);
        // 16 ranks for 8 heads: each rank keeps one (replicated) head.
        assert_eq!(
            kv_bytes_per_token(&l, KvCacheDtype::Float16, 16).unwrap(),
            2 * 256
        );
    }

    #[test]
    fn mla_stores_one_latent_replicated_on_every_rank() {
        let l = LayerSpec {
            kind: LayerKind::Mla,
            kv_heads: 1,
            head_dim: 576,
        };
        assert_eq!(kv_bytes_per_token(&l, KvCacheDtype::Auto, 8).unwrap(), 1152);
        assert!(kv_bytes_per_token(&l, KvCacheDtype::Nvfp4, 1).is_err());
    }
}
