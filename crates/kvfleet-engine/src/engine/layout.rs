//! The layout contract between the engine and every attention backend (CPU, CUDA).
//!
//! Everything a kernel needs to know about memory is written here; the CUDA backend
//! codes against it, so change it only with need and say so in the commit.
//!
//! # KV cache (per layer)
//! Separate K and V pools, each `[num_blocks, kv_heads, block_size, head_dim]`
//! (HND inside a page: one page of one layer holds, per KV head, `block_size`
//! consecutive head vectors). Element encodings, little-endian:
//! - `bf16`, `f16`: 2 bytes per element.
//! - `fp8_e4m3` (OCP "fn": no infinities, max 448) and `fp8_e5m2` (max 57344): 1 byte per
//!   element, with one `f32` scale per (layer, K or V): quantize `q = x / scale`
//!   (round to nearest even, saturate to the largest finite), dequantize `x = q * scale`.
//! - `nvfp4`: e2m1 values packed two per byte, the low nibble holds the even index:
//!   data `[num_blocks, kv_heads, block_size, head_dim / 2]`; plus one fp8-e4m3 block
//!   scale per 16 consecutive values of a head vector in a second array
//!   `[num_blocks, kv_heads, block_size, head_dim / 16]`; plus one `f32` global scale per
//!   (layer, K or V). Dequantize `x = e2m1 * block_scale * global_scale`. On write the
//!   block scale is `e4m3(amax(16 values) / 6 / global_scale)` (6 is e2m1's largest
//!   value) and each value is `e2m1(x / (block_scale * global_scale))`; an all-zero block
//!   stores scale 0 and zeros.
//!
//! Page ids are `u32`; a slot is `page * block_size + offset_in_page` and must fit `u32`
//! ([`PoolShape::new`] checks it).
//!
//! # A step's batch (CSR, FlashInfer-style)
//! For `B` requests in the step (prefill chunks and decodes mixed, any order):
//! - `qo_indptr: [B + 1]` into packed Q and O `[total_q, q_heads, head_dim]` and into the
//!   new K and V `[total_q, kv_heads, head_dim]` (every query token is a new KV token).
//! - Per layer group (layers sharing one page table, e.g. all full-attention layers, or all
//!   sliding layers of one window):
//!   - `kv_indptr: [B + 1]` into `kv_indices` (page ids, in position order);
//!   - `kv_last_page_len: [B]` tokens held in the last listed page (1..=block_size);
//!   - `kv_first_pos: [B]` absolute position of the first token of the first listed page
//!     (a multiple of `block_size`; non-zero when a sliding group freed leading pages);
//!   - `slot_mapping: [total_q]` where to write new token `t`'s K/V
//!     (`page * block_size + offset`).
//!
//!   The pages already include the step's new tokens: request `r` holds
//!   `kv_len = kv_first_pos + (pages - 1) * block_size + kv_last_page_len` positions
//!   (`kv_len` counts from position 0, including freed ones).
//! - Query token `j` of request `r` with `q_len` tokens has absolute position
//!   `kv_len - q_len + j`.
//! - Masks: causal: key visible iff `key_pos <= q_pos`; sliding window `W`: additionally
//!   `q_pos - key_pos < W`; non-causal: every held key is visible (and the window, if
//!   any, still applies as `q_pos - key_pos < W`). Only held keys (`key_pos >= kv_first_pos`)
//!   exist. A query row with no visible key outputs zeros.
//! - GQA: query head `h` reads KV head `h / (q_heads / kv_heads)`.
//! - Softmax scale `1 / sqrt(head_dim)` unless the layer gives one.
//!
//! # Call order per step
//! `Backend::prepare(plan)` once, then for each layer `append_kv` then `attention`
//! (see [`super::backend::Backend`]). Activations are `f32` on the host side of the API;
//! a device backend may keep them in its own buffer type.

use kvfleet_core::compat::KvCacheDtype;

/// KV-cache storage dtype as the engine implements it (resolved: no `auto`, no alias).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KvDtype {
    Bf16,
    F16,
    Fp8E4m3,
    Fp8E5m2,
    Nvfp4,
}

impl KvDtype {
    pub const ALL: [KvDtype; 5] = [Self::Bf16, Self::F16, Self::Fp8E4m3, Self::Fp8E5m2, Self::Nvfp4];

    /// Resolves a spec dtype; `auto` becomes `model_dtype` (bf16 unless the model says f16).
    pub fn resolve(spec: KvCacheDtype, model_dtype: KvDtype) -> KvDtype {
        match spec.canonical() {
            KvCacheDtype::Auto => model_dtype,
            KvCacheDtype::Bfloat16 => Self::Bf16,
            KvCacheDtype::Float16 => Self::F16,
            KvCacheDtype::Fp8 | KvCacheDtype::Fp8E4m3 => Self::Fp8E4m3,
            KvCacheDtype::Fp8E5m2 => Self::Fp8E5m2,
            KvCacheDtype::Nvfp4 => Self::Nvfp4,
        }
    }

    /// The spec string of this dtype.
    pub fn spec(self) -> KvCacheDtype {
        match self {
            Self::Bf16 => KvCacheDtype::Bfloat16,
            Self::F16 => KvCacheDtype::Float16,
            Self::Fp8E4m3 => KvCacheDtype::Fp8E4m3,
            Self::Fp8E5m2 => KvCacheDtype::Fp8E5m2,
            Self::Nvfp4 => KvCacheDtype::Nvfp4,
        }
    }

    pub fn as_str(self) -> &'static str {
        self.spec().as_str()
    }

    /// Data bytes of one head vector of `head_dim` elements ([`KvCacheDtype::data_bytes`]).
    pub fn data_bytes(self, head_dim: usize) -> usize {
        self.spec().data_bytes(head_dim)
    }

    /// Block-scale bytes of one head vector (nvfp4 only: one e4m3 byte per 16 values).
    pub fn scale_bytes(self, head_dim: usize) -> usize {
        self.spec().scale_bytes(head_dim)
    }

    /// Whether `head_dim` can be stored in this dtype.
    pub fn supports_head_dim(self, head_dim: usize) -> bool {
        head_dim > 0 && self.spec().fits_head_dim(head_dim)
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A layout that cannot be built.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error(
        "head_dim {head_dim} cannot be stored as {dtype}: nvfp4 needs a multiple of 16; use fp8 or bfloat16"
    )]
    HeadDim { dtype: KvDtype, head_dim: usize },
    #[error("{num_blocks} blocks of {block_size} tokens exceed 2^32 slots; lower gpuMemoryUtilization or raise blockSize")]
    TooManySlots { num_blocks: usize, block_size: usize },
    #[error("{what} must be at least 1")]
    Zero { what: &'static str },
    #[error("queryHeads {q_heads} is not a multiple of kvHeads {kv_heads}")]
    Gqa { q_heads: usize, kv_heads: usize },
}

/// Shape of one layer's K (or V) pool: `[num_blocks, kv_heads, block_size, head_dim]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolShape {
    pub num_blocks: usize,
    pub kv_heads: usize,
    pub block_size: usize,
    pub head_dim: usize,
    pub dtype: KvDtype,
}

impl PoolShape {
    pub fn new(
        num_blocks: usize,
        kv_heads: usize,
        block_size: usize,
        head_dim: usize,
        dtype: KvDtype,
    ) -> Result<Self, LayoutError> {
        for (what, v) in [
            ("kv_heads", kv_heads),
            ("block_size", block_size),
            ("head_dim", head_dim),
        ] {
            if v == 0 {
                return Err(LayoutError::Zero { what });
            }
        }
        if !dtype.supports_head_dim(head_dim) {
            return Err(LayoutError::HeadDim { dtype, head_dim });
        }
        if (num_blocks as u64) * (block_size as u64) > u32::MAX as u64 {
            return Err(LayoutError::TooManySlots {
                num_blocks,
                block_size,
            });
        }
        Ok(Self {
            num_blocks,
            kv_heads,
            block_size,
            head_dim,
            dtype,
        })
    }

    /// Bytes of the data array.
    pub fn data_len(&self) -> usize {
        self.num_blocks * self.kv_heads * self.block_size * self.dtype.data_bytes(self.head_dim)
    }

    /// Bytes of the block-scale array (nvfp4; 0 otherwise).
    pub fn scale_len(&self) -> usize {
        self.num_blocks * self.kv_heads * self.block_size * self.dtype.scale_bytes(self.head_dim)
    }

    /// Index of the head vector (`page`, `kv_head`, `offset` in page) in head-vector units;
    /// multiply by `data_bytes` / `scale_bytes` for byte offsets.
    pub fn vector_index(&self, page: usize, kv_head: usize, offset: usize) -> usize {
        (page * self.kv_heads + kv_head) * self.block_size + offset
    }

    /// Bytes of one page of this pool (data + scales).
    pub fn page_bytes(&self) -> usize {
        self.kv_heads
            * self.block_size
            * (self.dtype.data_bytes(self.head_dim) + self.dtype.scale_bytes(self.head_dim))
    }
}

/// Attention parameters of one layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerAttn {
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Causal mask (false: drafter blocks, encoders).
    pub causal: bool,
    /// Sliding window in tokens (`q_pos - key_pos < window`); `None`: full attention.
    pub window: Option<u32>,
    /// Softmax scale; `None`: `1 / sqrt(head_dim)`.
    pub sm_scale: Option<f32>,
}

impl LayerAttn {
    pub fn scale(&self) -> f32 {
        self.sm_scale
            .unwrap_or_else(|| 1.0 / (self.head_dim as f32).sqrt())
    }

    /// Query heads per KV head.
    pub fn group_size(&self) -> usize {
        self.q_heads / self.kv_heads
    }

    /// Whether key `key_pos` is visible from query `q_pos` (held keys only).
    pub fn visible(&self, q_pos: u32, key_pos: u32) -> bool {
        if self.causal && key_pos > q_pos {
            return false;
        }
        match self.window {
            Some(w) => (q_pos as i64) - (key_pos as i64) < w as i64,
            None => true,
        }
    }
}

/// Per (layer, K or V) `f32` scale: the fp8 scale, or the nvfp4 global scale; unused
/// for bf16/f16.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvScales {
    pub k: f32,
    pub v: f32,
}

impl Default for KvScales {
    fn default() -> Self {
        Self { k: 1.0, v: 1.0 }
    }
}

/// One layer as a backend sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerSpec {
    /// Index into [`BackendConfig::groups`]: the page table this layer reads.
    pub group: usize,
    pub attn: LayerAttn,
    pub dtype: KvDtype,
    pub scales: KvScales,
}

/// One layer group: layers sharing a page table and a block pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupSpec {
    /// Sliding window of every layer in the group; `None`: full attention.
    pub window: Option<u32>,
    /// Pages in each of the group's layer pools.
    pub num_blocks: usize,
}

/// What a backend allocates at start-up.
#[derive(Clone, Debug, PartialEq)]
pub struct BackendConfig {
    pub block_size: usize,
    pub groups: Vec<GroupSpec>,
    pub layers: Vec<LayerSpec>,
}

impl BackendConfig {
    /// The K (and V) pool shape of `layer`.
    pub fn pool_shape(&self, layer: usize) -> Result<PoolShape, LayoutError> {
        let l = &self.layers[layer];
        if l.attn.kv_heads == 0 || l.attn.q_heads % l.attn.kv_heads != 0 {
            return Err(LayoutError::Gqa {
                q_heads: l.attn.q_heads,
                kv_heads: l.attn.kv_heads,
            });
        }
        PoolShape::new(
            self.groups[l.group].num_blocks,
            l.attn.kv_heads,
            self.block_size,
            l.attn.head_dim,
            l.dtype,
        )
    }

    /// The group whose page table a speculative drafter's K/V follow: the first full-attention
    /// group (a drafter attends the whole context, so its pages must outlive any window), or
    /// the first group when every layer slides.
    pub fn draft_group(&self) -> usize {
        self.groups.iter().position(|g| g.window.is_none()).unwrap_or(0)
    }

    /// Checks every layer's shape once.
    pub fn check(&self) -> Result<(), LayoutError> {
        if self.block_size == 0 {
            return Err(LayoutError::Zero { what: "block_size" });
        }
        for layer in 0..self.layers.len() {
            self.pool_shape(layer)?;
        }
        Ok(())
    }
}

/// The page table of one layer group for one step (CSR, see the module docs).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupTable {
    /// `[B + 1]` into `kv_indices`.
    pub kv_indptr: Vec<u32>,
    /// Page ids in position order.
    pub kv_indices: Vec<u32>,
    /// `[B]` tokens in the last listed page, `1..=block_size`.
    pub kv_last_page_len: Vec<u32>,
    /// `[B]` absolute position of the first token of the first listed page.
    pub kv_first_pos: Vec<u32>,
    /// `[total_q]` `page * block_size + offset` for each new token.
    pub slot_mapping: Vec<u32>,
}

impl GroupTable {
    pub fn clear(&mut self) {
        self.kv_indptr.clear();
        self.kv_indices.clear();
        self.kv_last_page_len.clear();
        self.kv_first_pos.clear();
        self.slot_mapping.clear();
    }

    /// Positions held by request `r`, counted from 0 (`kv_len` in the module docs).
    pub fn kv_len(&self, r: usize, block_size: usize) -> usize {
        let pages = (self.kv_indptr[r + 1] - self.kv_indptr[r]) as usize;
        if pages == 0 {
            return self.kv_first_pos[r] as usize;
        }
        self.kv_first_pos[r] as usize + (pages - 1) * block_size + self.kv_last_page_len[r] as usize
    }
}

/// The host-side plan of one step: what every backend call of the step reads.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepPlan {
    /// `[B + 1]` into packed Q/O and new K/V.
    pub qo_indptr: Vec<u32>,
    /// One table per [`GroupSpec`], same order.
    pub groups: Vec<GroupTable>,
}

impl StepPlan {
    pub fn num_requests(&self) -> usize {
        self.qo_indptr.len().saturating_sub(1)
    }

    pub fn total_q(&self) -> usize {
        self.qo_indptr.last().copied().unwrap_or(0) as usize
    }

    /// Checks the CSR invariants against `cfg` (cheap; backends call it in debug builds and
    /// tests call it always).
    pub fn check(&self, cfg: &BackendConfig) -> Result<(), String> {
        let b = self.num_requests();
        if self.groups.len() != cfg.groups.len() {
            return Err(format!(
                "{} group tables for {} groups",
                self.groups.len(),
                cfg.groups.len()
            ));
        }
        if self.qo_indptr.first().copied().unwrap_or(0) != 0 || self.qo_indptr.windows(2).any(|w| w[1] < w[0])
        {
            return Err("qo_indptr must start at 0 and not decrease".into());
        }
        let total_q = self.total_q();
        let bs = cfg.block_size;
        for (g, (t, spec)) in self.groups.iter().zip(&cfg.groups).enumerate() {
            if t.kv_indptr.len() != b + 1 || t.kv_last_page_len.len() != b || t.kv_first_pos.len() != b {
                return Err(format!("group {g}: CSR arrays do not match {b} requests"));
            }
            if t.slot_mapping.len() != total_q {
                return Err(format!(
                    "group {g}: slot_mapping has {} entries for {total_q} tokens",
                    t.slot_mapping.len()
                ));
            }
            if t.kv_indptr[0] != 0 || t.kv_indptr.windows(2).any(|w| w[1] < w[0]) {
                return Err(format!("group {g}: kv_indptr must start at 0 and not decrease"));
            }
            if t.kv_indptr[b] as usize != t.kv_indices.len() {
                return Err(format!("group {g}: kv_indptr ends past kv_indices"));
            }
            if let Some(&p) = t.kv_indices.iter().find(|&&p| p as usize >= spec.num_blocks) {
                return Err(format!(
                    "group {g}: page {p} outside the pool of {}",
                    spec.num_blocks
                ));
            }
            for r in 0..b {
                let q_len = (self.qo_indptr[r + 1] - self.qo_indptr[r]) as usize;
                let pages = (t.kv_indptr[r + 1] - t.kv_indptr[r]) as usize;
                let last = t.kv_last_page_len[r] as usize;
                if pages == 0 || last == 0 || last > bs || t.kv_first_pos[r] as usize % bs != 0 {
                    return Err(format!(
                        "group {g} request {r}: bad pages/last_page_len/first_pos"
                    ));
                }
                if t.kv_len(r, bs) < q_len + t.kv_first_pos[r] as usize {
                    return Err(format!(
                        "group {g} request {r}: new tokens not inside the held pages"
                    ));
                }
            }
        }
        Ok(())
    }
}
