//! Sizing the KV pools: what the free memory holds after weights, activations and the margin,
//! as one pool of every layer (the Llama family) or one per window group (Gemma 3).

use kvfleet_engine::engine::capacity::{pools_in_bytes, PoolParams};
use kvfleet_engine::engine::layout::BackendConfig;
use kvfleet_engine::model::forward::llama_backend_config;
use kvfleet_engine::model::kv::AttnGeometry;
use kvfleet_engine::model::llama::LlamaConfig;

use super::error::GpuError;
use super::options::{GpuCapacity, GpuOptions, BLOCK_SIZE};
use super::shape::Dims;

/// The device's memory before the KV pools are allocated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Memory {
    pub device: String,
    pub total: usize,
    /// Free bytes, weights and activations allocated.
    pub free: usize,
    pub weights: usize,
    pub activations: usize,
}

/// The KV pools that fit `mem` for `c` (stored with `dims.kv_rep` copies of each KV head), and
/// where the memory went.
pub(super) fn size_pools(
    c: &LlamaConfig,
    dims: &Dims,
    opts: &GpuOptions,
    mem: &Memory,
) -> Result<(BackendConfig, GpuCapacity), GpuError> {
    let util = opts.gpu_memory_utilization.clamp(0.0, 1.0);
    let margin = opts
        .memory_margin_bytes
        .unwrap_or_else(|| (((1.0 - util) * mem.total as f64) as usize).max(256 << 20));
    let geo = AttnGeometry {
        n_layers: dims.layers,
        n_heads: dims.n_heads,
        n_kv_heads: dims.n_kv * dims.kv_rep,
        head_dim: dims.hd,
    };
    let dt = opts.kv_dtype;
    let kv_bytes_per_token =
        dims.layers * 2 * geo.n_kv_heads * (dt.data_bytes(dims.hd) + dt.scale_bytes(dims.hd));
    let bs = opts.block_size;
    if bs != BLOCK_SIZE {
        return Err(GpuError::Unsupported(format!(
            "blockSize {bs} (the attention kernels build pages of {BLOCK_SIZE} tokens)"
        )));
    }
    let mut blocks = mem.free.saturating_sub(margin) / (kv_bytes_per_token * bs).max(1);
    if let Some(cap) = opts.max_kv_tokens {
        blocks = blocks.min(cap.div_ceil(bs));
    }
    if blocks == 0 {
        return Err(GpuError::Memory(format!(
            "{} MiB free after {} MiB of weights and {} MiB of activations, {} MiB margin: no room for one \
             KV page of {} KiB",
            mem.free >> 20,
            mem.weights >> 20,
            mem.activations >> 20,
            margin >> 20,
            (kv_bytes_per_token * bs) >> 10
        )));
    }
    let pools = if c.gemma3.is_some() {
        windowed_pools(c, geo, opts, blocks * bs * kv_bytes_per_token)?
    } else {
        llama_backend_config(geo, dt, bs, blocks)
    };
    let capacity = GpuCapacity {
        device: mem.device.clone(),
        total_bytes: mem.total,
        weight_bytes: mem.weights,
        activation_bytes: mem.activations,
        free_bytes: mem.free,
        margin_bytes: margin,
        kv_bytes_per_token,
        kv_heads_stored: geo.n_kv_heads,
        blocks,
        block_size: bs,
        kv_tokens: blocks * bs,
    };
    Ok((pools, capacity))
}

/// The KV pools of a model with sliding-window layers in `bytes`: one group per window (and
/// one of the full layers), memory split by what one maxModelLen request needs from each
/// (`capacity::pools_in_bytes`, as the CPU engine and preflight size them).
fn windowed_pools(
    c: &LlamaConfig,
    geo: AttnGeometry,
    opts: &GpuOptions,
    bytes: usize,
) -> Result<BackendConfig, GpuError> {
    let layers = c.kv_layers(geo.n_kv_heads).map_err(GpuError::Invalid)?;
    let params = PoolParams {
        block_size: opts.block_size,
        max_model_len: opts.max_model_len.unwrap_or(c.context_len).max(1),
        max_num_batched_tokens: opts.max_batched_tokens,
        dtype: opts.kv_dtype,
        causal: true,
    };
    pools_in_bytes(&layers, &params, bytes as u64).map_err(GpuError::Memory)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::shape::{check_shapes, kv_replication};

    fn gemma_270m() -> LlamaConfig {
        LlamaConfig::gemma3(18, 640, 2048, 262_144, 512)
    }

    fn memory(free: usize) -> Memory {
        Memory {
            device: "test".into(),
            total: 80 << 30,
            free,
            weights: 16 << 30,
            activations: 1 << 30,
        }
    }

    #[test]
    fn the_pools_take_the_free_memory_above_the_margin_in_whole_pages() {
        let c = LlamaConfig::llama(32, 4096, 14336, 32, 8, 128256);
        let (rep, _) = kv_replication(c.n_heads, c.n_kv_heads).unwrap();
        let dims = Dims::new(&c, rep);
        let opts = GpuOptions {
            memory_margin_bytes: Some(1 << 30),
            ..GpuOptions::default()
        };
        // bf16: 32 layers x K and V x 8 heads x 128 x 2 bytes = 128 KiB a token, 2 MiB a page.
        let (pools, cap) = size_pools(&c, &dims, &opts, &memory((10 << 30) + (1 << 20))).unwrap();
        assert_eq!(cap.kv_bytes_per_token, 128 << 10);
        assert_eq!(
            cap.blocks,
            (9 << 30) / (2 << 20),
            "the odd MiB is less than a page"
        );
        assert_eq!(cap.kv_tokens, cap.blocks * 16);
        assert_eq!(pools.groups.len(), 1);
        assert_eq!(pools.groups[0].num_blocks, cap.blocks);
        let capped = GpuOptions {
            max_kv_tokens: Some(1000),
            ..opts.clone()
        };
        let (_, cap) = size_pools(&c, &dims, &capped, &memory(10 << 30)).unwrap();
        assert_eq!(cap.blocks, 63, "1000 tokens in pages of 16");
        let e = size_pools(&c, &dims, &opts, &memory(1 << 30)).unwrap_err();
        assert!(matches!(e, GpuError::Memory(_)), "{e}");
        let other_pages = GpuOptions {
            block_size: 32,
            ..opts
        };
        let e = size_pools(&c, &dims, &other_pages, &memory(10 << 30)).unwrap_err();
        assert!(matches!(e, GpuError::Unsupported(_)), "{e}");
    }

    #[test]
    fn gemma_pools_split_the_gpu_bytes_by_window_and_admit_more_than_a_full_layer_budget() {
        let c = gemma_270m();
        check_shapes(&c).unwrap();
        let geo = c.attn_geometry();
        let opts = GpuOptions {
            max_model_len: Some(4096),
            max_batched_tokens: 256,
            ..GpuOptions::default()
        };
        // bf16, 1 KV head of 256: 2 x 512 bytes per layer and token; 1024 pages of every layer.
        let per_token = 18 * 2 * 512;
        let bytes = 1024 * 16 * per_token;
        let pools = windowed_pools(&c, geo, &opts, bytes).unwrap();
        assert_eq!(pools.groups.len(), 2);
        for (i, l) in pools.layers.iter().enumerate() {
            let want = c.layer_window(i).map(|w| w as u32);
            assert_eq!(l.attn.window, want, "layer {i}");
            assert_eq!(
                pools.groups[l.group].window, want,
                "layer {i} reads its window's page table"
            );
        }
        let used: usize = pools
            .groups
            .iter()
            .map(|g| {
                let layers = pools
                    .layers
                    .iter()
                    .filter(|l| pools.groups[l.group] == *g)
                    .count();
                g.num_blocks * layers * 16 * 2 * 512
            })
            .sum();
        assert!(
            used <= bytes && used > bytes * 99 / 100,
            "{used} of {bytes} bytes"
        );
        let a = kvfleet_engine::engine::capacity::admitted(&pools, 4096, 256);
        // Full-layer: 18 x 256 pages per request; window-aware: 3 x 256 + 15 x 48.
        assert!((a.full_layer_max_concurrency - 4.0).abs() < 0.01, "{a:?}");
        let ratio = a.max_concurrency / a.full_layer_max_concurrency;
        assert!((3.0..3.2).contains(&ratio), "{ratio}");
    }

    #[test]
    fn gemma_pools_without_room_for_every_group_are_a_memory_error() {
        let c = gemma_270m();
        let e = windowed_pools(&c, c.attn_geometry(), &GpuOptions::default(), 16 * 1024).unwrap_err();
        assert!(matches!(e, GpuError::Memory(_)), "{e}");
    }
}
