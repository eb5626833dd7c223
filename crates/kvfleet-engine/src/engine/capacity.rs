//! The engine's model: layers grouped into page tables, and pools sized from the memory
//! left for the KV cache. Grouped as `plan::kvfleet` groups them (by window, KV heads and
//! head_dim; one block of a group holds `block_size` tokens of every layer in it; memory
//! split in proportion to what one `max_model_len` request needs from each group), with the
//! planner's per-request block budgets ([`plan::blocks_per_request`],
//! [`plan::full_layer_concurrency`]).

use kvfleet_core::plan::{self, LayerKind};

use super::layout::{BackendConfig, GroupSpec, KvDtype, KvScales, LayerAttn, LayerSpec, PoolShape};

/// One layer's KV as the engine stores it (vLLM's per-layer `KVCacheSpec`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelLayer {
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub window: Option<u32>,
}

impl ModelLayer {
    /// The per-layer KV list of a model: the one producer the planner's geometry, preflight,
    /// the CPU and GPU placement and the engine's pools share. `geometry` is
    /// [`plan::Geometry::from_spec`] of the CRD's geometry (or of a loaded model's, see
    /// `LlamaConfig::model_geometry`), so the planner and the engine read the same layers.
    pub fn from_geometry(geometry: &plan::Geometry) -> Result<Vec<ModelLayer>, KvListError> {
        let q_heads = geometry.query_heads as usize;
        geometry
            .layers
            .iter()
            .map(|l| {
                let window = match l.kind {
                    LayerKind::Full => None,
                    LayerKind::Sliding { window } => Some(window),
                    LayerKind::Mla => return Err(KvListError::Mla),
                };
                let kv_heads = l.kv_heads as usize;
                if kv_heads == 0 || q_heads % kv_heads != 0 {
                    return Err(KvListError::Gqa { q_heads, kv_heads });
                }
                Ok(ModelLayer {
                    q_heads,
                    kv_heads,
                    head_dim: l.head_dim as usize,
                    window,
                })
            })
            .collect()
    }
}

/// A per-layer KV list the engine cannot build.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KvListError {
    #[error("MLA models (kvLoraRank) are not supported by the kvfleet engine; use engine.runtime vllm")]
    Mla,
    #[error("queryHeads {q_heads} is not a multiple of kvHeads {kv_heads}")]
    Gqa { q_heads: usize, kv_heads: usize },
}

/// How much memory [`pool_layout`] gives the pools.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolSize {
    /// A byte budget, split between the groups by what one maxModelLen request needs from each
    /// (the worker's pools on either device, the CPU engine's).
    Bytes(u64),
    /// The same number of pages in every group: a drafter's own pool, which follows the model's
    /// draft group page for page, and tests that need a known pool.
    Pages(usize),
}

/// The pool layout of `layers`: the one place a per-layer KV list becomes the backend's
/// [`BackendConfig`], for every family on both devices. One group per window and one of the
/// full layers (see [`size_pools`]); layer `i` reads the group that holds it. The last
/// `draft_layers` of `layers` are a speculative drafter's (see [`size_pools_with_draft`]): they
/// take their share of a byte budget and are left out of the returned config (the drafter
/// allocates its own pool of the draft group's pages). An error when a group would get no page.
pub fn pool_layout(
    layers: &[ModelLayer],
    draft_layers: usize,
    p: &PoolParams,
    size: PoolSize,
) -> Result<BackendConfig, String> {
    let sizing = |e: CapacityError| format!("cannot size the KV pools: {e}");
    let plan = match size {
        PoolSize::Bytes(bytes) => size_pools_with_draft(layers, draft_layers, p, bytes).map_err(sizing)?,
        PoolSize::Pages(pages) => {
            let mut plan = size_pools_with_draft(layers, draft_layers, p, 0).map_err(sizing)?;
            for g in &mut plan.groups {
                g.num_blocks = pages as u64;
            }
            plan
        }
    };
    if let Some(g) = plan.groups.iter().find(|g| g.num_blocks == 0) {
        let bytes = match size {
            PoolSize::Bytes(b) => b,
            PoolSize::Pages(_) => 0,
        };
        return Err(format!(
            "{} MiB of KV memory leave no page for the layers of window {:?}",
            bytes >> 20,
            g.window
        ));
    }
    let model = &layers[..layers.len() - draft_layers.min(layers.len())];
    Ok(plan.backend_config(model, p, KvScales::default()))
}

/// K and V bytes one token takes in every layer of `layers` stored as `dtype` (block scales
/// included): a page of `block_size` tokens of every layer is `block_size` times this.
pub fn kv_bytes_per_token(layers: &[ModelLayer], dtype: KvDtype) -> usize {
    layers
        .iter()
        .map(|l| 2 * l.kv_heads * (dtype.data_bytes(l.head_dim) + dtype.scale_bytes(l.head_dim)))
        .sum()
}

/// Engine limits that decide pool sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolParams {
    pub block_size: usize,
    pub max_model_len: usize,
    pub max_num_batched_tokens: usize,
    pub dtype: KvDtype,
    pub causal: bool,
}

impl PoolParams {
    /// Causal pools of `dtype` in pages of `block_size` tokens sized by [`PoolSize::Pages`],
    /// where no request length splits the memory (maxModelLen and the chunk are one page).
    pub fn pages(dtype: KvDtype, block_size: usize) -> Self {
        PoolParams {
            block_size,
            max_model_len: block_size,
            max_num_batched_tokens: block_size,
            dtype,
            causal: true,
        }
    }
}

/// One group's pool.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GroupPool {
    pub window: Option<u32>,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub layers: Vec<usize>,
    /// Bytes of one block: K and V pages of every layer in the group.
    pub block_bytes: u64,
    /// Blocks one max_model_len request needs.
    pub blocks_per_request: u64,
    pub num_blocks: u64,
}

impl plan::kvfleet::BlockGroup for GroupPool {
    fn pool_mut(&mut self) -> (u64, u64, &mut u64) {
        (self.block_bytes, self.blocks_per_request, &mut self.num_blocks)
    }
}

/// The sized KV cache.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolPlan {
    pub groups: Vec<GroupPool>,
    pub available_kv_bytes: u64,
    /// Bytes the pools use (<= available).
    pub pool_bytes: u64,
    /// Requests of max_model_len that fit at once (min over groups).
    pub max_concurrency: f64,
    /// floor(max_concurrency x max_model_len).
    pub capacity_tokens: u64,
    /// Requests of max_model_len the same pool bytes admit when every layer is budgeted for
    /// the whole length (see [`Admission`]).
    pub full_layer_max_concurrency: f64,
}

/// Blocks a request of `tokens` holds at most in a group of `window` (see `block::KvManager`):
/// [`plan::blocks_per_request`].
pub fn blocks_per_request(window: Option<u32>, tokens: usize, chunk: usize, block_size: usize) -> u64 {
    let kind = window.map_or(LayerKind::Full, |window| LayerKind::Sliding { window });
    plan::blocks_per_request(kind, tokens as u64, chunk as u64, block_u32(block_size))
}

fn block_u32(block_size: usize) -> u32 {
    u32::try_from(block_size).unwrap_or(u32::MAX)
}

/// What allocated pools admit: requests of `max_model_len` at once with each group budgeted by
/// its window (what the scheduler does), and with every layer budgeted for the whole length
/// in the same bytes (a full-layer budget, as vLLM budgeted sliding layers before
/// vllm-project/vllm#40946), side by side.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Admission {
    /// min over groups of `num_blocks / blocks a max_model_len request holds there`.
    pub max_concurrency: f64,
    /// `pool bytes / (sum over groups of block_bytes x cdiv(max_model_len, block_size))`.
    pub full_layer_max_concurrency: f64,
    /// Per group (in the pools' order): its window and the tokens of blocks one
    /// max_model_len request holds there at most.
    pub tokens_per_request: Vec<GroupTokens>,
}

/// One group's budget per request.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GroupTokens {
    pub window: Option<u32>,
    pub layers: usize,
    pub num_blocks: usize,
    /// Block tokens one request holds at most in this group.
    pub tokens: usize,
    /// The same under a full-layer budget.
    pub full_layer_tokens: usize,
}

/// What the pools of `cfg` admit for requests of `max_model_len` with prefill chunks of
/// `chunk` tokens (see [`Admission`]).
pub fn admitted(cfg: &BackendConfig, max_model_len: usize, chunk: usize) -> Admission {
    let bs = cfg.block_size.max(1);
    let mut block_bytes = vec![0u64; cfg.groups.len()];
    let mut layers = vec![0usize; cfg.groups.len()];
    for l in &cfg.layers {
        let page = PoolShape::new(0, l.attn.kv_heads, bs, l.attn.head_dim, l.dtype)
            .map(|s| 2 * s.page_bytes() as u64)
            .unwrap_or(0);
        if let Some(b) = block_bytes.get_mut(l.group) {
            *b += page;
            layers[l.group] += 1;
        }
    }
    let full = max_model_len.div_ceil(bs);
    let tokens_per_request: Vec<GroupTokens> = cfg
        .groups
        .iter()
        .zip(&layers)
        .map(|(g, &n)| GroupTokens {
            window: g.window,
            layers: n,
            num_blocks: g.num_blocks,
            tokens: blocks_per_request(g.window, max_model_len, chunk, bs) as usize * bs,
            full_layer_tokens: full * bs,
        })
        .collect();
    let max_concurrency = tokens_per_request
        .iter()
        .map(|g| g.num_blocks as f64 / (g.tokens / bs).max(1) as f64)
        .fold(f64::INFINITY, f64::min);
    let pool_bytes: u64 = cfg
        .groups
        .iter()
        .zip(&block_bytes)
        .map(|(g, b)| g.num_blocks as u64 * b)
        .sum();
    Admission {
        max_concurrency: if max_concurrency.is_finite() {
            max_concurrency
        } else {
            0.0
        },
        full_layer_max_concurrency: plan::full_layer_concurrency(
            pool_bytes,
            block_bytes,
            max_model_len as u64,
            block_u32(bs),
        ),
        tokens_per_request,
    }
}

/// Why pools cannot be sized.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum CapacityError {
    #[error("the model has no attention layers")]
    NoLayers,
    #[error(transparent)]
    Layout(#[from] super::layout::LayoutError),
}

/// Groups `layers` and sizes one pool per group for `available_kv_bytes`.
pub fn size_pools(
    layers: &[ModelLayer],
    p: &PoolParams,
    available_kv_bytes: u64,
) -> Result<PoolPlan, CapacityError> {
    size_pools_with_draft(layers, 0, p, available_kv_bytes)
}

/// [`size_pools`] where the last `draft_layers` of `layers` belong to a speculative drafter
/// (full attention, of the drafter's own heads and head dim). Its K/V are paged by the model's
/// draft group (`BackendConfig::draft_group`: the first full-attention group), so each of its
/// layers joins that group whatever its shape: a block of the group holds the drafter's pages
/// too, and the split between the groups counts them.
pub fn size_pools_with_draft(
    layers: &[ModelLayer],
    draft_layers: usize,
    p: &PoolParams,
    available_kv_bytes: u64,
) -> Result<PoolPlan, CapacityError> {
    let model = layers.len().saturating_sub(draft_layers);
    if model == 0 {
        return Err(CapacityError::NoLayers);
    }
    let mut groups: Vec<GroupPool> = Vec::new();
    for (i, l) in layers.iter().enumerate() {
        let shape = PoolShape::new(0, l.kv_heads, p.block_size, l.head_dim, p.dtype)?;
        let page = 2 * shape.page_bytes() as u64; // K and V
        if i >= model {
            let g = groups.iter().position(|g| g.window.is_none()).unwrap_or(0);
            groups[g].layers.push(i);
            groups[g].block_bytes += page;
            continue;
        }
        match groups
            .iter_mut()
            .find(|g| g.window == l.window && g.kv_heads == l.kv_heads && g.head_dim == l.head_dim)
        {
            Some(g) => {
                g.layers.push(i);
                g.block_bytes += page;
            }
            None => groups.push(GroupPool {
                window: l.window,
                kv_heads: l.kv_heads,
                head_dim: l.head_dim,
                layers: vec![i],
                block_bytes: page,
                blocks_per_request: blocks_per_request(
                    l.window,
                    p.max_model_len,
                    p.max_num_batched_tokens,
                    p.block_size,
                ),
                num_blocks: 0,
            }),
        }
    }
    // The planner's split, so that its prediction is these pools.
    let max_concurrency = plan::kvfleet::fill_pools(&mut groups, available_kv_bytes);
    let pool_bytes = groups.iter().map(|g| g.num_blocks * g.block_bytes).sum();
    Ok(PoolPlan {
        pool_bytes,
        available_kv_bytes,
        max_concurrency,
        capacity_tokens: (max_concurrency * p.max_model_len as f64) as u64,
        full_layer_max_concurrency: plan::full_layer_concurrency(
            pool_bytes,
            groups.iter().map(|g| g.block_bytes),
            p.max_model_len as u64,
            block_u32(p.block_size),
        ),
        groups,
    })
}

impl PoolPlan {
    /// The backend allocation for this plan: layer `i` reads the group that holds it.
    pub fn backend_config(&self, layers: &[ModelLayer], p: &PoolParams, scales: KvScales) -> BackendConfig {
        let group_of = |i: usize| {
            self.groups
                .iter()
                .position(|g| g.layers.contains(&i))
                .unwrap_or(0)
        };
        BackendConfig {
            block_size: p.block_size,
            groups: self
                .groups
                .iter()
                .map(|g| GroupSpec {
                    window: g.window,
                    num_blocks: g.num_blocks as usize,
                })
                .collect(),
            layers: layers
                .iter()
                .enumerate()
                .map(|(i, l)| LayerSpec {
                    group: group_of(i),
                    attn: LayerAttn {
                        q_heads: l.q_heads,
                        kv_heads: l.kv_heads,
                        head_dim: l.head_dim,
                        causal: p.causal,
                        window: l.window,
                        sm_scale: None,
                    },
                    dtype: p.dtype,
                    scales,
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pools_split_memory_by_what_one_request_needs() {
        let l = |window| ModelLayer {
            q_heads: 8,
            kv_heads: 2,
            head_dim: 64,
            window,
        };
        let layers = [l(None), l(Some(128)), l(None), l(Some(128))];
        let p = PoolParams {
            block_size: 16,
            max_model_len: 2048,
            max_num_batched_tokens: 256,
            dtype: KvDtype::Bf16,
            causal: true,
        };
        let plan = size_pools(&layers, &p, 64 << 20).unwrap();
        assert_eq!(plan.groups.len(), 2);
        // bf16: 2 (K,V) x 2 heads x 16 tokens x 64 x 2 bytes = 8 KiB per layer page, 2 layers.
        assert_eq!(plan.groups[0].block_bytes, 16384);
        assert_eq!(plan.groups[0].blocks_per_request, 128);
        assert_eq!(plan.groups[1].blocks_per_request, 8 + 16);
        assert!(plan.pool_bytes <= 64 << 20);
        assert!(
            (64u64 << 20) - plan.pool_bytes < 16384,
            "remainder is less than a block"
        );
        let c = plan.max_concurrency;
        assert!((26.0..27.0).contains(&c), "{c}");
        assert_eq!(plan.capacity_tokens, (c * 2048.0) as u64);
        // Full-layer: 64 MiB over 2 groups x 16 KiB x 128 blocks = 16 requests.
        assert!(
            (plan.full_layer_max_concurrency - 16.0).abs() < 0.01,
            "{}",
            plan.full_layer_max_concurrency
        );
    }

    /// Pools of pages of 16 tokens in bf16 for requests of 4096 tokens, chunks of 256.
    fn gemma3_params() -> PoolParams {
        PoolParams {
            block_size: 16,
            max_model_len: 4096,
            max_num_batched_tokens: 256,
            dtype: KvDtype::Bf16,
            causal: true,
        }
    }

    /// Gemma 3 270M's layers: 15 local (window 512) and 3 global, 1 KV head of 256.
    fn gemma3_layers() -> Vec<ModelLayer> {
        (0..18)
            .map(|i| ModelLayer {
                q_heads: 4,
                kv_heads: 1,
                head_dim: 256,
                window: ((i + 1) % 6 != 0).then_some(512),
            })
            .collect()
    }

    /// A drafter's 2 layers (4 KV heads of 64: not the model's shape) appended to Gemma 3's
    /// list join the full-attention group, which is not the first (layer 0 slides): that
    /// group's block holds their pages, the split counts them, the backend config leaves them
    /// out, and the drafter's group is the one `draft_group` names.
    #[test]
    fn a_drafters_layers_join_the_full_group_of_a_sliding_window_model() {
        let p = gemma3_params();
        let model = gemma3_layers();
        let draft = ModelLayer {
            q_heads: 8,
            kv_heads: 4,
            head_dim: 64,
            window: None,
        };
        let mut layers = model.clone();
        layers.extend([draft, draft]);
        let bytes = 1u64 << 30;
        let alone = size_pools(&model, &p, bytes).unwrap();
        let with = size_pools_with_draft(&layers, 2, &p, bytes).unwrap();
        assert_eq!(with.groups.len(), 2, "no group of the drafter's own");
        let full = with.groups.iter().position(|g| g.window.is_none()).unwrap();
        assert_eq!(full, 1);
        // bf16 pages of 16 tokens: the model's 3 full layers 2 x 16 x 256 x 2 = 16 KiB each,
        // the drafter's 2 layers 2 x 4 x 16 x 64 x 2 = 16 KiB each.
        assert_eq!(alone.groups[full].block_bytes, 3 * 16384);
        assert_eq!(with.groups[full].block_bytes, 5 * 16384);
        assert_eq!(with.groups[full].layers, vec![5, 11, 17, 18, 19]);
        assert_eq!(with.groups[0].block_bytes, alone.groups[0].block_bytes);
        assert!(with.pool_bytes <= bytes);
        let block_sum: u64 = with.groups.iter().map(|g| g.block_bytes).sum();
        assert!(
            bytes - with.pool_bytes < block_sum,
            "{} bytes unused",
            bytes - with.pool_bytes
        );
        for (a, w) in alone.groups.iter().zip(&with.groups) {
            assert!(w.num_blocks < a.num_blocks, "{a:?} {w:?}");
        }
        let cfg = pool_layout(&layers, 2, &p, PoolSize::Bytes(bytes)).unwrap();
        assert_eq!(cfg.layers.len(), 18);
        assert_eq!(cfg.draft_group(), full);
        let counts: Vec<usize> = cfg.groups.iter().map(|g| g.num_blocks).collect();
        let planned: Vec<usize> = with.groups.iter().map(|g| g.num_blocks as usize).collect();
        assert_eq!(counts, planned);
        // A model whose every layer slides pages its drafter by its first group.
        let sliding: Vec<ModelLayer> = model
            .iter()
            .map(|l| ModelLayer {
                window: Some(512),
                ..*l
            })
            .collect();
        let mut layers = sliding.clone();
        layers.push(draft);
        let plan = size_pools_with_draft(&layers, 1, &p, bytes).unwrap();
        assert_eq!(plan.groups.len(), 1);
        assert_eq!(plan.groups[0].layers.len(), 19);
        assert!(
            size_pools_with_draft(&[draft], 1, &p, bytes).is_err(),
            "a drafter alone is no model"
        );
    }

    /// Pools of a known page count (tests, a drafter's own pool) come from the same layout as
    /// a byte budget's: a Llama's every layer in one group, each layer as the backend runs it;
    /// Gemma 3's layers in their window's group, every group `pages` pages.
    #[test]
    fn a_page_count_lays_out_the_groups_a_byte_budget_does() {
        let llama = vec![
            ModelLayer {
                q_heads: 4,
                kv_heads: 2,
                head_dim: 64,
                window: None,
            };
            3
        ];
        let p = PoolParams::pages(KvDtype::F16, 16);
        let cfg = pool_layout(&llama, 0, &p, PoolSize::Pages(64)).unwrap();
        let layer = LayerSpec {
            group: 0,
            attn: LayerAttn {
                q_heads: 4,
                kv_heads: 2,
                head_dim: 64,
                causal: true,
                window: None,
                sm_scale: None,
            },
            dtype: KvDtype::F16,
            scales: KvScales::default(),
        };
        let want = BackendConfig {
            block_size: 16,
            groups: vec![GroupSpec {
                window: None,
                num_blocks: 64,
            }],
            layers: vec![layer; 3],
        };
        assert_eq!(cfg, want);
        let layers = gemma3_layers();
        let cfg = pool_layout(&layers, 0, &p, PoolSize::Pages(32)).unwrap();
        let bytes = pool_layout(
            &layers,
            0,
            &PoolParams {
                max_model_len: 4096,
                max_num_batched_tokens: 256,
                ..p
            },
            PoolSize::Bytes(1 << 30),
        )
        .unwrap();
        assert_eq!(cfg.layers, bytes.layers);
        let windows = |c: &BackendConfig| c.groups.iter().map(|g| g.window).collect::<Vec<_>>();
        assert_eq!(windows(&cfg), windows(&bytes));
        assert!(cfg.groups.iter().all(|g| g.num_blocks == 32));
        for (l, spec) in layers.iter().zip(&cfg.layers) {
            assert_eq!(spec.attn.window, l.window);
            assert_eq!(cfg.groups[spec.group].window, l.window);
        }
        assert!(pool_layout(&layers, 0, &p, PoolSize::Pages(0)).is_err());
    }

    #[test]
    fn kv_bytes_per_token_counts_k_and_v_of_every_layer_with_block_scales() {
        let layers = gemma3_layers();
        // 18 layers x K and V x 1 head x 256 x 2 bytes.
        assert_eq!(kv_bytes_per_token(&layers, KvDtype::Bf16), 18 * 2 * 512);
        // nvfp4: 128 data bytes and 16 scale bytes a head vector of 256.
        assert_eq!(kv_bytes_per_token(&layers, KvDtype::Nvfp4), 18 * 2 * (128 + 16));
        let p = PoolParams::pages(KvDtype::Nvfp4, 16);
        let plan = size_pools(&layers, &p, 1 << 20).unwrap();
        let block: u64 = plan.groups.iter().map(|g| g.block_bytes).sum();
        assert_eq!(block, 16 * kv_bytes_per_token(&layers, KvDtype::Nvfp4) as u64);
    }

    #[test]
    fn allocated_gemma3_pools_admit_more_than_a_full_layer_budget() {
        let p = gemma3_params();
        let layers = gemma3_layers();
        let plan = size_pools(&layers, &p, 1 << 30).unwrap();
        assert_eq!(plan.groups.len(), 2);
        let cfg = plan.backend_config(&layers, &p, KvScales::default());
        let a = admitted(&cfg, p.max_model_len, p.max_num_batched_tokens);
        assert!((a.max_concurrency - plan.max_concurrency).abs() < 1e-9);
        assert!((a.full_layer_max_concurrency - plan.full_layer_max_concurrency).abs() < 1e-9);
        // Local: cdiv(511, 16) + cdiv(256, 16) = 48 blocks = 768 tokens; global: 4096.
        let local = a
            .tokens_per_request
            .iter()
            .find(|g| g.window == Some(512))
            .unwrap();
        assert_eq!(
            (local.layers, local.tokens, local.full_layer_tokens),
            (15, 768, 4096)
        );
        let global = a.tokens_per_request.iter().find(|g| g.window.is_none()).unwrap();
        assert_eq!((global.layers, global.tokens), (3, 4096));
        // bf16, 1 head of 256: 16 KiB per layer block. Full-layer: 18 x 256 blocks per request;
        // window-aware: 3 x 256 + 15 x 48 = 1488 blocks, 3.1 times as many requests.
        let ratio = a.max_concurrency / a.full_layer_max_concurrency;
        assert!((3.0..3.2).contains(&ratio), "{ratio}");
    }
    /// The planner's geometry of `layers` (one GPU).
    fn planner_geometry(layers: &[ModelLayer]) -> plan::Geometry {
        plan::Geometry {
            architecture: "test".into(),
            query_heads: layers[0].q_heads as u32,
            layers: layers
                .iter()
                .map(|l| plan::LayerGeometry {
                    kind: l
                        .window
                        .map_or(LayerKind::Full, |window| LayerKind::Sliding { window }),
                    kv_heads: l.kv_heads as u32,
                    head_dim: l.head_dim as u32,
                })
                .collect(),
            draft_layers: 0,
            hidden_size: None,
            notes: Vec::new(),
        }
    }

    #[test]
    fn live_capacity_equals_the_planners_for_llama_gemma3_and_mistral() {
        let layer = |q_heads, kv_heads, head_dim, window| ModelLayer {
            q_heads,
            kv_heads,
            head_dim,
            window,
        };
        let models: [(&str, Vec<ModelLayer>); 3] = [
            // Llama 3 8B: 32 full layers, GQA 32/8, head_dim 128.
            ("llama", vec![layer(32, 8, 128, None); 32]),
            // Gemma 3 1B: 26 layers, every 6th full, the rest slide over 512 tokens.
            (
                "gemma3",
                (0..26)
                    .map(|i| layer(4, 1, 256, ((i + 1) % 6 != 0).then_some(512)))
                    .collect(),
            ),
            // Mistral 7B v0.1: every layer slides over 4096 tokens.
            ("mistral", vec![layer(32, 8, 128, Some(4096)); 32]),
        ];
        for (name, layers) in models {
            for (max_model_len, chunk, available) in [(8192, 512, 4u64 << 30), (32_768, 2048, 20 << 30)] {
                let p = PoolParams {
                    block_size: 16,
                    max_model_len,
                    max_num_batched_tokens: chunk,
                    dtype: KvDtype::Bf16,
                    causal: true,
                };
                let planned = plan::pool_layout(
                    &planner_geometry(&layers),
                    &plan::EngineParams {
                        tp: 1,
                        dtype: p.dtype.spec(),
                        block_size: p.block_size as u32,
                        max_model_len: max_model_len as u64,
                        max_num_batched_tokens: chunk as u64,
                    },
                    available,
                )
                .unwrap();
                let mut pools = size_pools(&layers, &p, available).unwrap();
                let case = format!("{name} at {max_model_len} tokens");
                assert_eq!(pools.groups.len(), planned.groups.len(), "{case}");
                for (e, g) in pools.groups.iter_mut().zip(&planned.groups) {
                    assert_eq!(e.layers, g.layers, "{case}");
                    assert_eq!(e.block_bytes, g.block_bytes, "{case}");
                    assert_eq!(e.blocks_per_request, g.blocks_per_request, "{case}");
                    // The worker allocates the planner's pools (preflight).
                    e.num_blocks = g.num_blocks;
                }
                let cfg = pools.backend_config(&layers, &p, KvScales::default());
                let live = admitted(&cfg, max_model_len, chunk);
                assert_eq!(live.max_concurrency, planned.max_concurrency, "{case}");
                assert_eq!(
                    live.full_layer_max_concurrency, planned.full_layer_max_concurrency,
                    "{case}"
                );
                assert_eq!(
                    (live.max_concurrency * max_model_len as f64) as u64,
                    planned.capacity_tokens,
                    "{case}"
                );
            }
        }
    }
}
