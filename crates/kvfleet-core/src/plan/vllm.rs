//! The vLLM (V1 engine) KV-cache model, reproduced exactly.
//!
//! Sources, all in vllm-project/vllm:
//! - page size per layer: `vllm/v1/kv_cache_interface.py` (`AttentionSpec.real_page_size_bytes`
//!   = 2 x block_size x num_kv_heads x head_size x dtype_size; `MLAAttentionSpec` without
//!   the factor 2).
//! - grouping: `vllm/v1/core/kv_cache_utils.py` `get_kv_cache_groups`: one group when all
//!   layers share a spec; one group of per-layer pages when all layers need the same token
//!   slots (`UniformTypeKVCacheSpecs`); otherwise `unify_kv_cache_spec_page_size` (smaller
//!   pages get a larger block_size until pages are equal) and
//!   `_get_kv_cache_groups_uniform_page_size` (group_size = the fewest layers of one spec,
//!   or the most when max < 1.5 x min; layers of a spec split round-robin, `layers[i::n]`).
//! - num_blocks: `get_num_blocks` = available // page_size // group_size.
//! - per-request blocks: `FullAttentionSpec.max_memory_usage_bytes` = cdiv(max_model_len,
//!   block_size) pages; `SlidingWindowSpec` = cdiv(min(window - 1 + max_num_batched_tokens,
//!   max_model_len), block_size) + 1 pages.
//! - max concurrency: `get_max_concurrency_for_kv_cache_config` = num_blocks / sum of the
//!   groups' per-request blocks.
//! - the logged "GPU KV cache size: N tokens": see [`ReportingEra`].

use serde::Serialize;

use super::bytes::{kv_heads_per_rank, page_bytes};
use super::geometry::{Geometry, LayerKind};
use super::{cdiv, PlanError};
use crate::compat::KvCacheDtype;

/// How a vLLM version computes the logged "GPU KV cache size: N tokens".
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReportingEra {
    /// Up to v0.9: num_blocks x block_size (vllm PR #13596 introduced the line).
    UpToV0_9,
    /// v0.10 to v0.20: num_blocks // number of groups x smallest group block_size
    /// (`_report_kv_cache_config`).
    V0_10ToV0_20,
    /// v0.21 on: int(max_concurrency x max_model_len), which counts a hybrid model's
    /// sliding groups at their window-capped size.
    V0_21On,
}

impl ReportingEra {
    /// Era of a version string such as `0.11.2`, `v0.19.1rc1` or `0.21`.
    pub fn for_version(version: &str) -> Result<ReportingEra, PlanError> {
        let v = version.trim().trim_start_matches('v');
        let mut parts = v.split(|c: char| !c.is_ascii_digit());
        let parse = |p: Option<&str>| p.and_then(|s| s.parse::<u32>().ok());
        let (major, minor) = match (parse(parts.next()), parse(parts.next())) {
            (Some(a), Some(b)) => (a, b),
            _ => {
                return Err(PlanError::InvalidInput(format!(
                    "vLLM version {version:?} is not of the form MAJOR.MINOR[.PATCH], e.g. 0.11.2"
                )))
            }
        };
        Ok(match (major, minor) {
            (0, m) if m <= 9 => ReportingEra::UpToV0_9,
            (0, m) if m <= 20 => ReportingEra::V0_10ToV0_20,
            _ => ReportingEra::V0_21On,
        })
    }

    pub fn label(self) -> &'static str {
        match self {
            ReportingEra::UpToV0_9 => "vLLM <= 0.9",
            ReportingEra::V0_10ToV0_20 => "vLLM 0.10 to 0.20",
            ReportingEra::V0_21On => "vLLM >= 0.21",
        }
    }

    pub const ALL: [ReportingEra; 3] = [
        ReportingEra::UpToV0_9,
        ReportingEra::V0_10ToV0_20,
        ReportingEra::V0_21On,
    ];
}

/// What vLLM's engine is configured with, besides the geometry.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct EngineParams {
    pub tp: u32,
    pub dtype: KvCacheDtype,
    pub block_size: u32,
    pub max_model_len: u64,
    pub max_num_batched_tokens: u64,
}

/// Largest block size accepted (vLLM offers 1 to 256; hybrid unification goes beyond).
pub const MAX_BLOCK_SIZE: u32 = 4096;
/// Largest context or batch accepted, in tokens (2^32).
pub const MAX_TOKENS: u64 = 1 << 32;

impl EngineParams {
    pub fn check(&self) -> Result<(), PlanError> {
        if self.block_size == 0 {
            return Err(PlanError::InvalidInput(
                "block size must be at least 1 token".into(),
            ));
        }
        if self.max_model_len == 0 {
            return Err(PlanError::InvalidInput(
                "max model length must be at least 1 token".into(),
            ));
        }
        if self.max_num_batched_tokens == 0 {
            return Err(PlanError::InvalidInput(
                "max_num_batched_tokens must be at least 1".into(),
            ));
        }
        if self.block_size > MAX_BLOCK_SIZE {
            return Err(PlanError::InvalidInput(format!(
                "block size {} is larger than {MAX_BLOCK_SIZE} tokens; vLLM uses 16 to 128",
                self.block_size
            )));
        }
        if self.max_model_len > MAX_TOKENS || self.max_num_batched_tokens > MAX_TOKENS {
            return Err(PlanError::InvalidInput(format!(
                "max model length and max_num_batched_tokens must be at most {MAX_TOKENS} tokens"
            )));
        }
        if self.tp == 0 || self.tp > 1024 {
            return Err(PlanError::InvalidInput(format!(
                "tensor parallel size {} must be in 1..=1024",
                self.tp
            )));
        }
        Ok(())
    }
}

/// How the layers were put into KV-cache groups.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Layout {
    /// Every layer has the same spec: one group, one block table.
    UniformSpec,
    /// Same token slots per layer but different page sizes: one group whose block holds
    /// every layer's page (`UniformTypeKVCacheSpecs`).
    UniformType,
    /// Several attention types with equal (unified) page sizes, in groups of group_size layers.
    Hybrid,
}

/// One vLLM KV-cache group.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct VllmGroup {
    #[serde(flatten)]
    pub kind: LayerKind,
    /// Model layer indices in this group.
    pub layers: Vec<usize>,
    /// Empty slots padded to reach group_size (wasted memory).
    pub padding_layers: u32,
    pub kv_heads_per_rank: u32,
    pub head_dim: u32,
    /// Tokens per block of this group (larger than the configured block size when the
    /// page was unified).
    pub block_size: u32,
    /// Bytes of one page of one layer (equal across groups for the hybrid layout; for the
    /// uniform-type layout the sum over the group's layers).
    pub page_bytes: u64,
    /// Blocks one request of max_model_len needs in this group.
    pub blocks_per_request: u64,
}

/// vLLM's KV cache for one configuration and amount of available memory.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct VllmPlan {
    pub layout: Layout,
    pub groups: Vec<VllmGroup>,
    /// Layers that share one block id (one tensor per slot).
    pub group_size: u32,
    /// Bytes behind one block id: page_bytes x group_size.
    pub bytes_per_block: u64,
    pub available_kv_bytes: u64,
    pub num_blocks: u64,
    /// Sum over groups of blocks_per_request.
    pub blocks_per_request: u64,
    pub max_concurrency: f64,
    /// The logged "GPU KV cache size" in the selected era.
    pub era: ReportingEra,
    pub kv_cache_size_tokens: u64,
    /// The same pool as each era would log it.
    pub tokens_by_era: Vec<(ReportingEra, u64)>,
    /// vLLM refuses to start when one max_model_len request does not fit
    /// (`_check_enough_kv_cache_memory`).
    pub fits_one_request: bool,
}

/// Blocks vLLM budgets per request for a group of `kind` (the startup sizing bound;
/// since vllm PR #40946 runtime admission uses the same bound).
pub fn group_blocks_per_request(kind: LayerKind, group_block_size: u32, p: &EngineParams) -> u64 {
    let b = u64::from(group_block_size);
    match kind {
        LayerKind::Full | LayerKind::Mla => cdiv(p.max_model_len, b),
        LayerKind::Sliding { window } => {
            let tokens =
                (u64::from(window).saturating_sub(1) + p.max_num_batched_tokens).min(p.max_model_len);
            cdiv(tokens, b) + 1
        }
    }
}

/// How vLLM's scheduler budgets a sliding-window group when admitting a request of
/// `tokens` tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SlidingAdmission {
    /// Before vllm PR #40946: every token of the request, cdiv(tokens, block).
    Uncapped,
    /// vllm PR #39866 (proposed): cdiv(min(tokens, window + max_num_batched_tokens), block).
    WindowPlusChunk,
    /// vllm PR #40946 (merged): the startup bound, cdiv(min(window - 1 +
    /// max_num_batched_tokens, max_model_len), block) + 1, capped by the uncapped count.
    StartupBound,
}

/// Blocks vLLM's admission gate asks of a sliding-window group for a `tokens`-long request.
pub fn sliding_admission_blocks(
    rule: SlidingAdmission,
    window: u32,
    tokens: u64,
    max_num_batched_tokens: u64,
    max_model_len: u64,
    block_size: u32,
) -> u64 {
    let b = u64::from(block_size);
    let w = u64::from(window);
    let uncapped = cdiv(tokens, b);
    match rule {
        SlidingAdmission::Uncapped => uncapped,
        SlidingAdmission::WindowPlusChunk => cdiv(tokens.min(w + max_num_batched_tokens), b),
        SlidingAdmission::StartupBound => uncapped.min(
            cdiv(
                (w.saturating_sub(1) + max_num_batched_tokens).min(max_model_len),
                b,
            ) + 1,
        ),
    }
}

/// The vLLM KV-cache configuration for `available_kv_bytes` on one rank.
pub fn vllm_plan(
    geometry: &Geometry,
    p: &EngineParams,
    available_kv_bytes: u64,
    era: ReportingEra,
) -> Result<VllmPlan, PlanError> {
    p.check()?;
    geometry.check_limits()?;
    // Per-layer spec as vLLM sees it on one rank.
    #[derive(Clone, Copy, PartialEq, Eq)]
    struct RankSpec {
        kind: LayerKind,
        heads: u32,
        head_dim: u32,
        block: u32,
        page: u64,
    }
    let mut specs = Vec::with_capacity(geometry.layers.len());
    for l in &geometry.layers {
        specs.push(RankSpec {
            kind: l.kind,
            heads: kv_heads_per_rank(l, p.tp),
            head_dim: l.head_dim,
            block: p.block_size,
            page: page_bytes(l, p.dtype, p.tp, p.block_size)?,
        });
    }
    let same = |a: &RankSpec, b: &RankSpec| a == b;
    let uniform_spec = specs.iter().all(|s| same(s, &specs[0]));
    let is_sliding = |k: LayerKind| matches!(k, LayerKind::Sliding { .. });
    // UniformTypeKVCacheSpecs: all layers full-attention-like, or all sliding with one window.
    let uniform_type = !uniform_spec
        && (specs.iter().all(|s| !is_sliding(s.kind)) || specs.iter().all(|s| s.kind == specs[0].kind));

    let (layout, groups, group_size, bytes_per_block) = if uniform_spec || uniform_type {
        let layers: Vec<usize> = (0..specs.len()).collect();
        let s = specs[0];
        let total_page: u64 = specs.iter().map(|s| s.page).sum();
        let (layout, group_size, page, bpb) = if uniform_spec {
            (
                Layout::UniformSpec,
                specs.len() as u32,
                s.page,
                s.page * specs.len() as u64,
            )
        } else {
            (Layout::UniformType, 1, total_page, total_page)
        };
        let group = VllmGroup {
            kind: s.kind,
            layers,
            padding_layers: 0,
            kv_heads_per_rank: s.heads,
            head_dim: s.head_dim,
            block_size: s.block,
            page_bytes: page,
            blocks_per_request: group_blocks_per_request(s.kind, s.block, p),
        };
        (layout, vec![group], group_size, bpb)
    } else {
        // unify_kv_cache_spec_page_size: raise block_size of smaller pages.
        let max_page = specs.iter().map(|s| s.page).max().unwrap_or(0);
        for s in &mut specs {
            if s.page != max_page {
                if max_page % s.page != 0 {
                    return Err(PlanError::PageSizesNotUnifiable {
                        message: format!(
                            "vLLM cannot unify page sizes {} and {max_page} bytes (not a multiple); this layout needs --disable-hybrid-kv-cache-manager, which kvfleet does not model",
                            s.page
                        ),
                    });
                }
                let ratio = max_page / s.page;
                s.block = u32::try_from(u64::from(s.block) * ratio)
                    .map_err(|_| PlanError::InvalidInput("unified block size overflows".into()))?;
                s.page = max_page;
            }
        }
        // same_type_layers, in first-seen order.
        let mut by_spec: Vec<(RankSpec, Vec<usize>)> = Vec::new();
        for (i, s) in specs.iter().enumerate() {
            match by_spec.iter_mut().find(|(t, _)| same(t, s)) {
                Some((_, v)) => v.push(i),
                None => by_spec.push((*s, vec![i])),
            }
        }
        let min = by_spec.iter().map(|(_, v)| v.len()).min().unwrap_or(1);
        let max = by_spec.iter().map(|(_, v)| v.len()).max().unwrap_or(1);
        // `max_num_layers < min_num_layers * 1.5`, in integers.
        let group_size = if 2 * max < 3 * min { max } else { min };
        let mut groups = Vec::new();
        for (s, layers) in &by_spec {
            let n = layers.len().div_ceil(group_size);
            for i in 0..n {
                let members: Vec<usize> = layers.iter().copied().skip(i).step_by(n).collect();
                groups.push(VllmGroup {
                    kind: s.kind,
                    padding_layers: (group_size - members.len()) as u32,
                    layers: members,
                    kv_heads_per_rank: s.heads,
                    head_dim: s.head_dim,
                    block_size: s.block,
                    page_bytes: s.page,
                    blocks_per_request: group_blocks_per_request(s.kind, s.block, p),
                });
            }
        }
        (
            Layout::Hybrid,
            groups,
            group_size as u32,
            max_page * group_size as u64,
        )
    };

    let num_blocks = available_kv_bytes / bytes_per_block;
    let blocks_per_request: u64 = groups.iter().map(|g| g.blocks_per_request).sum();
    let max_concurrency = num_blocks as f64 / blocks_per_request as f64;
    let min_block = groups.iter().map(|g| u64::from(g.block_size)).min().unwrap_or(1);
    let tokens_for = |e: ReportingEra| match e {
        ReportingEra::UpToV0_9 => num_blocks.saturating_mul(u64::from(p.block_size)),
        ReportingEra::V0_10ToV0_20 => num_blocks / groups.len() as u64 * min_block,
        ReportingEra::V0_21On => (max_concurrency * p.max_model_len as f64) as u64,
    };
    let tokens_by_era = ReportingEra::ALL.iter().map(|e| (*e, tokens_for(*e))).collect();
    Ok(VllmPlan {
        layout,
        group_size,
        bytes_per_block,
        available_kv_bytes,
        num_blocks,
        blocks_per_request,
        max_concurrency,
        era,
        kv_cache_size_tokens: tokens_for(era),
        tokens_by_era,
        fits_one_request: blocks_per_request.saturating_mul(bytes_per_block) <= available_kv_bytes,
        groups,
    })
}

impl VllmPlan {
    /// Bytes vLLM budgets for one max_model_len request.
    pub fn bytes_per_request(&self) -> u64 {
        self.blocks_per_request.saturating_mul(self.bytes_per_block)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_map_to_reporting_eras() {
        assert_eq!(
            ReportingEra::for_version("0.9.2").unwrap(),
            ReportingEra::UpToV0_9
        );
        assert_eq!(
            ReportingEra::for_version("v0.11.2").unwrap(),
            ReportingEra::V0_10ToV0_20
        );
        assert_eq!(
            ReportingEra::for_version("0.20.1rc1").unwrap(),
            ReportingEra::V0_10ToV0_20
        );
        assert_eq!(ReportingEra::for_version("0.21").unwrap(), ReportingEra::V0_21On);
        assert_eq!(ReportingEra::for_version("1.0.0").unwrap(), ReportingEra::V0_21On);
        assert!(ReportingEra::for_version("latest").is_err());
    }

    #[test]
    fn sliding_admission_of_16001_tokens_gemma4_window() {
        // 16,001-token prompt, window 1024, block 16, max_num_batched_tokens 8192.
        let f = |r| sliding_admission_blocks(r, 1024, 16_001, 8192, 131_072, 16);
        assert_eq!(f(SlidingAdmission::Uncapped), 1001);
        assert_eq!(f(SlidingAdmission::WindowPlusChunk), 576);
        assert_eq!(f(SlidingAdmission::StartupBound), 577);
    }
}
