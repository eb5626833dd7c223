//! Sizing the KV pools: what the free memory holds after weights, activations and the margin,
//! laid out by the engine's one layout (`capacity::pool_layout` of the model's per-layer KV
//! list): one pool of every layer (the Llama family) or one per window group (Gemma 3).

use kvfleet_engine::engine::capacity::{kv_bytes_per_token, pool_layout, PoolParams, PoolSize};
use kvfleet_engine::engine::layout::BackendConfig;
use kvfleet_engine::model::llama::LlamaConfig;

use kvfleet_core::plan::engine_memory::{EngineMemory, CONTEXT_RESERVE_BYTES, MIN_FREE_BYTES};

use super::error::GpuError;
use super::options::{GpuCapacity, GpuOptions, BLOCK_SIZE};
use super::shape::Dims;

/// The device's memory before the KV pools are allocated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Memory {
    pub device: String,
    pub total: usize,
    /// Free bytes, weights and activations allocated.
    pub free: usize,
    pub weights: usize,
    pub activations: usize,
}

/// The KV pools that fit `mem` for `c` (stored with `dims.kv_rep` copies of each KV head), and
/// where the memory went.
///
/// The pools get the KV budget of `plan::engine_memory` (`floor(total x utilisation) - weights
/// - activations - context reserve`, what `kvfleet check` predicts), or what is measured free
/// less 256 MiB when that is less: then the driver holds more than the reserve, and the
/// shortfall is logged and reported. `opts.memory_margin_bytes` replaces the budget by
/// `free - margin` (no prediction).
pub(super) fn size_pools(
    c: &LlamaConfig,
    dims: &Dims,
    opts: &GpuOptions,
    mem: &Memory,
) -> Result<(BackendConfig, GpuCapacity), GpuError> {
    let total = opts.reported_total_bytes.unwrap_or(mem.total);
    let budget = EngineMemory::new(
        total as u64,
        opts.gpu_memory_utilization,
        mem.weights as u64,
        mem.activations as u64,
    );
    let (budget_bytes, kv_bytes) = match opts.memory_margin_bytes {
        Some(margin) => {
            let b = mem.free.saturating_sub(margin);
            (b, b)
        }
        None => (
            budget.kv_budget_bytes as usize,
            budget.kv_bytes(mem.free as u64) as usize,
        ),
    };
    if kv_bytes < budget_bytes {
        tracing::warn!(
            kv_budget_bytes = budget_bytes,
            kv_bytes,
            free_bytes = mem.free,
            context_reserve_bytes = CONTEXT_RESERVE_BYTES,
            "less memory is free than the KV budget leaves: the pools take what is free less {} MiB, \
             {} MiB short of the budget `kvfleet check` predicts (the driver holds more than the \
             context reserve, or another process uses the GPU)",
            MIN_FREE_BYTES >> 20,
            (budget_bytes - kv_bytes) >> 20
        );
    }
    let dt = opts.kv_dtype;
    // The per-layer KV list (K/V heads as the kernels store them, replicated), a drafter's
    // layers after the model's: its weights and buffers come off the budget first; its K/V
    // then follows the model's pages (of every layer, or of the full-attention group beside
    // sliding-window layers).
    let kv_heads_stored = dims.n_kv * dims.kv_rep;
    let mut layers = c.kv_layers(kv_heads_stored).map_err(GpuError::Invalid)?;
    let model_bytes_per_token = kv_bytes_per_token(&layers, dt);
    let draft = opts.drafter.unwrap_or_default();
    let draft_layers = draft.kv_layers();
    layers.extend_from_slice(&draft_layers);
    let page_bytes_per_token = kv_bytes_per_token(&layers, dt);
    let kv_bytes = kv_bytes.saturating_sub(draft.fixed_bytes);
    let bs = opts.block_size;
    if bs != BLOCK_SIZE {
        return Err(GpuError::Unsupported(format!(
            "blockSize {bs} (the attention kernels build pages of {BLOCK_SIZE} tokens)"
        )));
    }
    let mut blocks = kv_bytes / (page_bytes_per_token * bs).max(1);
    if let Some(cap) = opts.max_kv_tokens {
        blocks = blocks.min(cap.div_ceil(bs));
    }
    if blocks == 0 {
        return Err(GpuError::Memory(format!(
            "{} MiB for the KV cache ({} MiB free after {} MiB of weights and {} MiB of activations; \
             budget {} MiB at gpuMemoryUtilization {} with a {} MiB context reserve): no room for \
             one KV page of {} KiB",
            kv_bytes >> 20,
            mem.free >> 20,
            mem.weights >> 20,
            mem.activations >> 20,
            budget_bytes >> 20,
            opts.gpu_memory_utilization,
            CONTEXT_RESERVE_BYTES >> 20,
            (page_bytes_per_token * bs) >> 10
        )));
    }
    // The bytes the layout splits between the layer groups by what one maxModelLen request
    // needs from each (one group of every layer for the Llama family: whole pages of it);
    // `max_kv_tokens` caps them at as many pages of every layer.
    let bytes = match opts.max_kv_tokens {
        Some(_) => kv_bytes.min(blocks * bs * page_bytes_per_token),
        None => kv_bytes,
    };
    let params = PoolParams {
        block_size: bs,
        max_model_len: opts.max_model_len.unwrap_or(c.context_len).max(1),
        max_num_batched_tokens: opts.max_batched_tokens,
        dtype: dt,
        causal: true,
    };
    let pools = pool_layout(
        &layers,
        draft_layers.len(),
        &params,
        PoolSize::Bytes(bytes as u64),
    )
    .map_err(GpuError::Memory)?;
    // The drafter's pool has as many pages as the group it follows.
    let draft_pages = pools.groups.get(pools.draft_group()).map_or(0, |g| g.num_blocks);
    let capacity = GpuCapacity {
        device: mem.device.clone(),
        total_bytes: total,
        weight_bytes: mem.weights,
        activation_bytes: mem.activations,
        free_bytes: mem.free,
        margin_bytes: mem.free.saturating_sub(kv_bytes),
        kv_budget_bytes: budget_bytes,
        kv_bytes,
        kv_bytes_per_token: model_bytes_per_token,
        kv_heads_stored,
        blocks,
        block_size: bs,
        kv_tokens: blocks * bs,
        drafter_bytes: opts
            .drafter
            .map_or(0, |d| d.fixed_bytes + draft_pages * bs * d.kv_bytes_per_token),
    };
    Ok((pools, capacity))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::options::DraftReserve;
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

    /// `plain` with a drafter of `fixed` bytes and `layers` layers of `(query heads, KV heads,
    /// head dim)`, its K/V in bf16.
    fn drafted(plain: &GpuOptions, fixed: usize, layers: usize, heads: (usize, usize, usize)) -> GpuOptions {
        let (q_heads, kv_heads, head_dim) = heads;
        let draft = DraftReserve {
            fixed_bytes: fixed,
            kv_bytes_per_token: layers * 2 * kv_heads * head_dim * 2,
            layers,
            q_heads,
            kv_heads,
            head_dim,
        };
        GpuOptions {
            drafter: Some(draft),
            ..plain.clone()
        }
    }

    /// A drafter's weights and buffers come off the budget first, then every page carries its
    /// K/V beside the model's: the model gets fewer pages, and the two pools and the fixed part
    /// add up to the budget (within a page).
    /// Llama 3 8B's geometry and widths (8 KV heads: none replicated).
    fn llama_8b() -> (LlamaConfig, Dims) {
        let c = LlamaConfig::llama(32, 4096, 14336, 32, 8, 128256);
        let (rep, _) = kv_replication(c.n_heads, c.n_kv_heads).unwrap();
        let dims = Dims::new(&c, rep);
        (c, dims)
    }

    #[test]
    fn a_drafter_is_reserved_before_the_pages_are_counted() {
        let (c, dims) = llama_8b();
        let plain = GpuOptions {
            memory_margin_bytes: Some(1 << 30),
            ..GpuOptions::default()
        };
        // One layer of 8 KV heads of 128 in bf16: 4 KiB a token (the model's 128 KiB / 32).
        let with = drafted(&plain, 900 << 20, 1, (32, 8, 128));
        let mem = memory(10 << 30);
        let (_, a) = size_pools(&c, &dims, &plain, &mem).unwrap();
        let (pools, b) = size_pools(&c, &dims, &with, &mem).unwrap();
        assert_eq!(a.drafter_bytes, 0);
        assert_eq!(b.blocks, ((9 << 30) - (900 << 20)) / ((132 << 10) * 16));
        assert_eq!(pools.groups[0].num_blocks, b.blocks);
        assert_eq!(b.drafter_bytes, (900 << 20) + b.blocks * 16 * (4 << 10));
        let used = b.blocks * 16 * b.kv_bytes_per_token + b.drafter_bytes;
        assert!(used <= 9 << 30 && (9 << 30) - used < (132 << 10) * 16, "{used}");
    }

    /// Bytes of one page of each group of `cfg` (K and V of every layer in it).
    fn group_page_bytes(cfg: &BackendConfig) -> Vec<usize> {
        let mut out = vec![0; cfg.groups.len()];
        for (i, l) in cfg.layers.iter().enumerate() {
            out[l.group] += 2 * cfg.pool_shape(i).unwrap().page_bytes();
        }
        out
    }

    /// Beside Gemma 3 the drafter's layers (2 layers of 4 KV heads of 64, not the model's shape)
    /// join the full-attention group: its pool has that group's pages, the split between the
    /// groups counts them in the full group's page, and the pools, the drafter's pool and its
    /// fixed part add up to the budget within a page of each group.
    #[test]
    fn a_drafter_beside_sliding_window_layers_follows_the_full_groups_pages() {
        let c = gemma_270m();
        let (rep, _) = kv_replication(c.n_heads, c.n_kv_heads).unwrap();
        let dims = Dims::new(&c, rep);
        let plain = GpuOptions {
            memory_margin_bytes: Some(1 << 30),
            max_model_len: Some(4096),
            max_batched_tokens: 256,
            ..GpuOptions::default()
        };
        // bf16: 2 layers x K and V x 4 heads x 64 x 2 bytes = 2 KiB a token.
        let with = drafted(&plain, 300 << 20, 2, (8, 4, 64));
        let mem = memory(5 << 30);
        let budget = 4usize << 30;
        let (alone, a) = size_pools(&c, &dims, &plain, &mem).unwrap();
        let (pools, b) = size_pools(&c, &dims, &with, &mem).unwrap();
        assert_eq!(a.drafter_bytes, 0);
        assert_eq!(
            pools.layers.len(),
            18,
            "the drafter's layers are not in the model's pools"
        );
        assert_eq!(pools.groups.len(), 2);
        let full = pools.draft_group();
        let local = 1 - full;
        assert_eq!(pools.groups[full].window, None);
        assert_eq!(pools.groups[local].window, Some(512));
        assert_ne!(
            full, 0,
            "Gemma 3's first layer slides: the full group is not the first"
        );
        assert_eq!(b.kv_bytes, budget - (300 << 20));
        let (full_pages, local_pages) = (pools.groups[full].num_blocks, pools.groups[local].num_blocks);
        assert_eq!(b.drafter_bytes, (300 << 20) + full_pages * 16 * (2 << 10));
        // Every byte accounted: the model's pools, the drafter's pool and fixed part.
        let pages = group_page_bytes(&pools);
        let drafter_page = 16 * (2 << 10);
        let used = full_pages * pages[full] + local_pages * pages[local] + b.drafter_bytes;
        let slack = budget
            .checked_sub(used)
            .unwrap_or_else(|| panic!("{used} bytes over {budget}"));
        assert!(
            slack < pages[full] + drafter_page + pages[local],
            "{slack} bytes left, more than a page of each group"
        );
        // The split is by what one request of 4096 tokens needs from each group, the drafter's
        // bytes in the full group's page: both groups give up pages, at one concurrency.
        for (g, (x, y)) in alone.groups.iter().zip(&pools.groups).enumerate() {
            assert!(
                y.num_blocks < x.num_blocks,
                "group {g}: {} !< {}",
                y.num_blocks,
                x.num_blocks
            );
        }
        let per_request = |w| kvfleet_engine::engine::capacity::blocks_per_request(w, 4096, 256, 16) as f64;
        let (cf, cl) = (
            full_pages as f64 / per_request(None),
            local_pages as f64 / per_request(Some(512)),
        );
        // One concurrency for both, each group within a page of it.
        let page_of_each = 1.0 / per_request(None) + 1.0 / per_request(Some(512));
        assert!(
            (cf - cl).abs() <= page_of_each,
            "concurrency {cf} (full) vs {cl} (local)"
        );
    }

    #[test]
    fn the_pools_take_the_free_memory_above_the_margin_in_whole_pages() {
        let (c, dims) = llama_8b();
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
        let (rep, _) = kv_replication(c.n_heads, c.n_kv_heads).unwrap();
        let dims = Dims::new(&c, rep);
        let opts = GpuOptions {
            max_model_len: Some(4096),
            max_batched_tokens: 256,
            memory_margin_bytes: Some(1 << 30),
            ..GpuOptions::default()
        };
        // bf16, 1 KV head of 256: 2 x 512 bytes per layer and token; 1024 pages of every layer.
        let per_token = 18 * 2 * 512;
        let bytes = 1024 * 16 * per_token;
        let (pools, cap) = size_pools(&c, &dims, &opts, &memory(bytes + (1 << 30))).unwrap();
        assert_eq!(cap.kv_bytes_per_token, per_token);
        assert_eq!(cap.blocks, 1024, "pages of a full-layer budget of the same bytes");
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
        let (rep, _) = kv_replication(c.n_heads, c.n_kv_heads).unwrap();
        let opts = GpuOptions {
            memory_margin_bytes: Some(1 << 30),
            ..GpuOptions::default()
        };
        let mem = memory((1 << 30) + 16 * 1024);
        let e = size_pools(&c, &Dims::new(&c, rep), &opts, &mem).unwrap_err();
        assert!(matches!(e, GpuError::Memory(_)), "{e}");
    }

    // === The planner's prediction = the worker's pools ===

    use crate::gpu::arena::Acts;
    use kvfleet_core::api::InferenceDeploymentSpec;
    use kvfleet_core::plan::{self, EngineParams, MemoryInput, PlanInputs, ReportingEra};
    use kvfleet_engine::engine::capacity::admitted;
    use kvfleet_engine::engine::layout::KvDtype;

    const H100: &str = "NVIDIA-H100-80GB-HBM3";

    /// What CUDA's total lacks of NVML's (615 MiB on an H200).
    const CUDA_SHORT: usize = 615 << 20;

    /// The worker's pools for `c` on a GPU of `nvml_total` bytes (CUDA reporting
    /// [`CUDA_SHORT`] less) when the driver holds exactly the context reserve: what
    /// `GpuLlama::assemble` gives `size_pools` with the worker's options, less the device.
    fn worker(c: &LlamaConfig, opts: &GpuOptions, nvml_total: u64) -> (BackendConfig, GpuCapacity) {
        let (rep, _) = kv_replication(c.n_heads, c.n_kv_heads).unwrap();
        let dims = Dims::new(c, rep);
        let weights = dims.shape.weight_bytes() as usize;
        let activations = Acts::bytes(&dims, opts.max_batched_tokens, opts.max_num_seqs);
        let total = nvml_total as usize - CUDA_SHORT;
        let free = total - weights - activations - CONTEXT_RESERVE_BYTES as usize;
        let mem = Memory {
            device: H100.into(),
            total,
            free,
            weights,
            activations,
        };
        let opts = GpuOptions {
            reported_total_bytes: Some(nvml_total as usize),
            ..opts.clone()
        };
        size_pools(c, &dims, &opts, &mem).unwrap()
    }

    #[test]
    fn the_budget_is_a_share_of_nvmls_total_when_the_worker_knows_it() {
        let c = LlamaConfig::llama(32, 4096, 14336, 32, 8, 128_256);
        let nvml = plan::gpu_memory_bytes(H100).unwrap();
        let o = opts(KvDtype::Bf16);
        let (_, with_nvml) = worker(&c, &o, nvml);
        assert_eq!(with_nvml.total_bytes, nvml as usize);
        let (rep, _) = kv_replication(c.n_heads, c.n_kv_heads).unwrap();
        let dims = Dims::new(&c, rep);
        let mem = Memory {
            device: H100.into(),
            total: nvml as usize - CUDA_SHORT,
            free: 60 << 30,
            weights: with_nvml.weight_bytes,
            activations: with_nvml.activation_bytes,
        };
        let (_, cuda_only) = size_pools(&c, &dims, &o, &mem).unwrap();
        assert_eq!(cuda_only.total_bytes, nvml as usize - CUDA_SHORT);
        // 0.92 of the 615 MiB CUDA does not report: 565.8 MiB, 282 or 283 whole pages of 2 MiB
        // (the H200's shortfall in tests/cuda_capacity.rs before the worker knew NVML's total).
        let gap = with_nvml.blocks - cuda_only.blocks;
        assert!((282..=283).contains(&gap), "{gap}: {with_nvml:?} {cuda_only:?}");
    }

    fn opts(dtype: KvDtype) -> GpuOptions {
        GpuOptions {
            kv_dtype: dtype,
            max_batched_tokens: 2048,
            max_num_seqs: 256,
            gpu_memory_utilization: 0.92,
            max_model_len: Some(8192),
            ..GpuOptions::default()
        }
    }

    /// Tokens the worker's pools hold for requests of `max_model_len` (the planner's
    /// `capacity_tokens`).
    fn worker_tokens(pools: &BackendConfig, o: &GpuOptions) -> u64 {
        let mml = o.max_model_len.unwrap();
        (admitted(pools, mml, o.max_batched_tokens).max_concurrency * mml as f64) as u64
    }

    /// The spec of dummy Llama 3.1 8B with KV in `kv_dtype` (and `speculative` decoding) that
    /// `kvfleet check` reads.
    fn llama_8b_spec(kv_dtype: &str, speculative: Option<serde_json::Value>) -> InferenceDeploymentSpec {
        let mut spec = serde_json::json!({
            "model": {
                "name": "llama",
                "geometry": {"layers": 32, "queryHeads": 32, "kvHeads": 8, "headDim": 128,
                             "hiddenSize": 4096, "intermediateSize": 14336, "vocabSize": 128256},
                "weights": {"format": "dummy"}
            },
            "engine": {"runtime": "kvfleet", "kvCacheDtype": kv_dtype, "maxModelLen": 8192,
                       "maxNumBatchedTokens": 2048, "maxNumSeqs": 256, "gpuMemoryUtilization": 0.92}
        });
        if let Some(s) = speculative {
            spec["engine"]["speculative"] = s;
        }
        serde_json::from_value(spec).unwrap()
    }

    #[test]
    fn kvfleet_check_predicts_the_pools_the_worker_allocates_for_dummy_llama_3_1_8b() {
        let c = LlamaConfig::llama(32, 4096, 14336, 32, 8, 128_256);
        let total = plan::gpu_memory_bytes(H100).unwrap();
        for (dtype, name) in [(KvDtype::Bf16, "bfloat16"), (KvDtype::Fp8E4m3, "fp8_e4m3")] {
            // What `kvfleet check` reads: the spec, through the planner the webhook runs.
            let spec = llama_8b_spec(name, None);
            let geometry = plan::Geometry::from_spec(spec.model.geometry.as_ref().unwrap()).unwrap();
            let check = plan::spec_capacity(&spec, &geometry, total, dtype.spec()).unwrap();
            let o = opts(dtype);
            let (pools, cap) = worker(&c, &o, total);
            eprintln!(
                "Llama-3.1-8B {name}: check {} tokens ({} pages), worker {} tokens ({} pages)",
                check.kvfleet_tokens, check.plan.kvfleet.groups[0].num_blocks, cap.kv_tokens, cap.blocks
            );
            assert_eq!(
                check.plan.memory.weight_bytes_per_gpu,
                Some(cap.weight_bytes as u64)
            );
            assert_eq!(
                check.plan.memory.activation_bytes,
                Some(cap.activation_bytes as u64)
            );
            assert_eq!(check.available_kv_bytes, cap.kv_budget_bytes as u64, "{name}");
            assert_eq!(cap.kv_bytes, cap.kv_budget_bytes, "{name}: the budget was free");
            assert_eq!(
                check.plan.kvfleet.groups[0].num_blocks, cap.blocks as u64,
                "{name}"
            );
            assert_eq!(check.kvfleet_tokens, cap.kv_tokens as u64, "{name}");
            assert_eq!(check.kvfleet_tokens, worker_tokens(&pools, &o), "{name}");
        }
    }

    /// `kvfleet check` on a spec whose `draftModel.geometry` gives the drafter's config.json
    /// predicts the pools of the worker that loaded that drafter: its reservation (built here
    /// from the published configs' values, not from the spec) and the pages left.
    #[test]
    fn kvfleet_check_with_a_drafter_geometry_predicts_the_pools_of_the_worker_serving_it() {
        use kvfleet_core::plan::draft::EAGLE3_LLAMA_3_1_8B;
        use kvfleet_core::plan::{DraftKind, DraftShape};
        let c = LlamaConfig::llama(32, 4096, 14336, 32, 8, 128_256);
        let total = plan::gpu_memory_bytes(H100).unwrap();
        // EAGLE-3 for Llama-3.1-8B (one layer, draft vocabulary 32000), and a 5-layer DFlash
        // drafter of the same width reading 5 target layers, with its own embeddings.
        let eagle3 = EAGLE3_LLAMA_3_1_8B;
        let dflash = DraftShape {
            kind: DraftKind::Dflash,
            layers: 5,
            feature_layers: 5,
            lm_head_rows: 0,
            embed_rows: 128_256,
            ..eagle3
        };
        let cases = [
            (
                "eagle3",
                eagle3,
                serde_json::json!({"layers": 1, "hiddenSize": 4096, "queryHeads": 32,
                "kvHeads": 8, "headDim": 128, "intermediateSize": 14336, "vocabSize": 32000}),
            ),
            (
                "dflash",
                dflash,
                serde_json::json!({"layers": 5, "hiddenSize": 4096, "queryHeads": 32,
                "kvHeads": 8, "headDim": 128, "intermediateSize": 14336, "featureLayers": 5,
                "ownEmbeddings": true}),
            ),
        ];
        for (dtype, name) in [(KvDtype::Bf16, "bfloat16"), (KvDtype::Fp8E4m3, "fp8_e4m3")] {
            let o = opts(dtype);
            let (_, alone) = worker(&c, &o, total);
            for (method, shape, geometry) in &cases {
                let speculative = serde_json::json!({"method": method, "numSpeculativeTokens": 3,
                    "draftModel": {"pvcName": "d", "path": "x/", "geometry": geometry}});
                let spec = llama_8b_spec(name, Some(speculative));
                let geo = plan::Geometry::from_spec(spec.model.geometry.as_ref().unwrap()).unwrap();
                let check = plan::spec_capacity(&spec, &geo, total, dtype.spec()).unwrap();
                let with = GpuOptions {
                    drafter: Some(DraftReserve::of_shape(
                        shape,
                        dtype,
                        o.max_batched_tokens,
                        o.max_num_seqs,
                    )),
                    ..o.clone()
                };
                let (pools, cap) = worker(&c, &with, total);
                eprintln!(
                    "{method} {name}: check {} tokens, worker {} tokens (alone {}), drafter {} MiB",
                    check.kvfleet_tokens,
                    cap.kv_tokens,
                    alone.kv_tokens,
                    cap.drafter_bytes >> 20
                );
                assert!(cap.blocks < alone.blocks, "{method}: the drafter takes pages");
                assert_eq!(check.available_kv_bytes, cap.kv_bytes as u64, "{method} {name}");
                assert_eq!(
                    check.plan.memory.drafter_bytes,
                    Some(with.drafter.unwrap().fixed_bytes as u64),
                    "{method} {name}"
                );
                assert_eq!(
                    check.plan.kvfleet.groups[0].num_blocks, cap.blocks as u64,
                    "{method} {name}"
                );
                assert_eq!(check.kvfleet_tokens, cap.kv_tokens as u64, "{method} {name}");
                assert_eq!(
                    check.kvfleet_tokens,
                    worker_tokens(&pools, &with),
                    "{method} {name}"
                );
            }
        }
    }

    #[test]
    fn the_planner_predicts_the_pools_the_worker_allocates_for_gemma_3() {
        let total = plan::gpu_memory_bytes(H100).unwrap();
        let models = [
            ("Gemma 3 270M", LlamaConfig::gemma3(18, 640, 2048, 262_144, 512)),
            ("Gemma 3 1B", LlamaConfig::gemma3(26, 1152, 6912, 262_144, 512)),
        ];
        // And each with an EAGLE-3 drafter of its own width (2 query heads over 1 KV head of
        // 256, its layer joining the full group's pages).
        let eagle3 = |c: &LlamaConfig| kvfleet_core::plan::DraftShape {
            kind: kvfleet_core::plan::DraftKind::Eagle3,
            layers: 1,
            d_model: c.d_model as u64,
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 256,
            d_ff: 2048,
            target_hidden: c.d_model as u64,
            feature_layers: 3,
            lm_head_rows: 32_000,
            embed_rows: 0,
        };
        for (model, c) in models {
            for (dtype, drafter) in [KvDtype::Bf16, KvDtype::Fp8E4m3]
                .into_iter()
                .flat_map(|d| [(d, None), (d, Some(eagle3(&c)))])
            {
                let model = format!("{model}{}", if drafter.is_some() { " with EAGLE-3" } else { "" });
                let o = GpuOptions {
                    drafter: drafter.map(|d| DraftReserve::of_shape(&d, dtype, 2048, 256)),
                    ..opts(dtype)
                };
                // The planner on the loaded model's geometry and shape (the worker's own
                // prediction; `kvfleet plan`).
                let geometry = plan::Geometry::from_spec(&c.model_geometry()).unwrap();
                let (rep, _) = kv_replication(c.n_heads, c.n_kv_heads).unwrap();
                let inputs = PlanInputs {
                    engine: EngineParams {
                        tp: 1,
                        dtype: dtype.spec(),
                        block_size: 16,
                        max_model_len: 8192,
                        max_num_batched_tokens: 2048,
                    },
                    era: ReportingEra::V0_21On,
                    memory: MemoryInput::KvfleetEngine {
                        gpu_memory_bytes: total,
                        gpu_memory_utilization: 0.92,
                        shape: c.engine_shape(rep as u64),
                        max_num_seqs: 256,
                        drafter,
                    },
                    request_len: None,
                };
                let planned = plan::plan(&geometry, &inputs).unwrap();
                let (pools, cap) = worker(&c, &o, total);
                let want: Vec<u64> = planned.kvfleet.groups.iter().map(|g| g.num_blocks).collect();
                let got: Vec<u64> = pools.groups.iter().map(|g| g.num_blocks as u64).collect();
                eprintln!(
                    "{model} {dtype:?}: planner pages {want:?}, {} tokens; worker pages {got:?}, {} tokens",
                    planned.kvfleet.capacity_tokens,
                    worker_tokens(&pools, &o)
                );
                assert_eq!(
                    planned.memory.available_kv_bytes, cap.kv_bytes as u64,
                    "{model} {dtype:?}"
                );
                assert_eq!(want, got, "{model} {dtype:?}");
                assert_eq!(
                    planned.kvfleet.capacity_tokens,
                    worker_tokens(&pools, &o),
                    "{model} {dtype:?}"
                );
            }
        }
    }

    #[test]
    fn a_driver_holding_more_than_the_reserve_gets_the_free_memory_and_reports_the_shortfall() {
        let c = LlamaConfig::llama(32, 4096, 14336, 32, 8, 128_256);
        let dims = Dims::new(&c, 1);
        let o = opts(KvDtype::Bf16);
        let mem = Memory {
            device: H100.into(),
            total: 80 << 30,
            free: 20 << 30,
            weights: 16 << 30,
            activations: 1 << 30,
        };
        let (_, cap) = size_pools(&c, &dims, &o, &mem).unwrap();
        assert_eq!(cap.kv_bytes, (20 << 30) - MIN_FREE_BYTES as usize);
        assert!(cap.kv_budget_bytes > cap.kv_bytes, "{cap:?}");
        assert_eq!(cap.blocks, cap.kv_bytes / (2 << 20));
    }
}
