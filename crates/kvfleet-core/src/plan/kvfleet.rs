//! kvfleet's own KV-cache model: sliding-window layers hold the window plus one
//! prefill chunk, full layers the whole context.
//!
//! Layout the worker engine implements with these numbers:
//! - layers are grouped by identical spec (kind, window, KV heads per rank, head_dim);
//!   each group has its own block pool, and one block of a group holds `block_size`
//!   tokens of every layer in the group (no padding layers, no page unification: a
//!   group's block is `layers x page_bytes`).
//! - the available memory is split between the groups in proportion to what one
//!   max_model_len request needs from each ([`pool_layout`]); concurrency is the
//!   smallest `num_blocks / blocks_per_request` over the groups.
//! - prefill chunks start on block boundaries (every chunk but a prompt's last is a
//!   multiple of `block_size`). A chunk starting at position c then needs the window's
//!   `window - 1` earlier tokens, which end on a block boundary (`cdiv(window - 1, block)`
//!   blocks), plus the chunk (`cdiv(chunk, block)` blocks); a decode step needs at most
//!   `cdiv(window - 1, block) + 1`. Blocks behind the window are freed every step.
//!   vLLM's bound adds one block because its chunks may start mid-block
//!   (`SlidingWindowSpec.max_memory_usage_bytes`, vllm/v1/kv_cache_interface.py), and
//!   before vllm PR #40946 its admission gate budgeted every token of the prompt.

use serde::Serialize;

use super::bytes::{kv_heads_per_rank, page_bytes};
use super::geometry::{Geometry, LayerKind};
use super::vllm::EngineParams;
use super::{cdiv, PlanError};

/// Blocks a request of `tokens` tokens holds at most in a layer group of `kind` under
/// kvfleet's engine, with prefill chunks of at most `chunk` tokens.
///
/// Full and MLA layers: `cdiv(tokens, block)`. Sliding layers:
/// `min(cdiv(tokens, block), cdiv(window - 1, block) + cdiv(chunk, block))`.
pub fn blocks_per_request(kind: LayerKind, tokens: u64, chunk: u64, block_size: u32) -> u64 {
    let b = u64::from(block_size.max(1));
    let all = cdiv(tokens, b);
    match kind {
        LayerKind::Full | LayerKind::Mla => all,
        LayerKind::Sliding { window } => {
            all.min(cdiv(u64::from(window).saturating_sub(1), b) + cdiv(chunk.max(1), b))
        }
    }
}

/// Requests of `max_model_len` tokens that pools of `pool_bytes` admit when every layer is
/// budgeted for the whole length, for groups with blocks of `block_bytes`:
/// `pool_bytes / (sum of block_bytes x cdiv(max_model_len, block_size))`.
pub fn full_layer_concurrency(
    pool_bytes: u64,
    block_bytes: impl IntoIterator<Item = u64>,
    max_model_len: u64,
    block_size: u32,
) -> f64 {
    let blocks = cdiv(max_model_len, u64::from(block_size.max(1)));
    let per_request = block_bytes
        .into_iter()
        .map(|b| b.saturating_mul(blocks))
        .fold(0u64, u64::saturating_add);
    pool_bytes as f64 / per_request.max(1) as f64
}

/// One kvfleet layer group and its block pool.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct KvfleetGroup {
    #[serde(flatten)]
    pub kind: LayerKind,
    /// Model layer indices in this group.
    pub layers: Vec<usize>,
    pub kv_heads_per_rank: u32,
    pub head_dim: u32,
    pub block_size: u32,
    /// Bytes of one page (block_size tokens) of one layer on one rank.
    pub page_bytes: u64,
    /// Bytes of one block of the group: layers x page_bytes.
    pub block_bytes: u64,
    /// Blocks one max_model_len request needs.
    pub blocks_per_request: u64,
    /// Blocks in this group's pool.
    pub num_blocks: u64,
}

/// kvfleet's KV cache for one configuration and amount of available memory.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct KvfleetPlan {
    pub groups: Vec<KvfleetGroup>,
    pub available_kv_bytes: u64,
    /// Bytes one max_model_len request needs over all groups.
    pub bytes_per_request: u64,
    /// Requests of max_model_len that fit at once: min over groups of num_blocks / blocks_per_request.
    pub max_concurrency: f64,
    /// Tokens of context held at once when every request is max_model_len long:
    /// floor(max_concurrency x max_model_len) (the definition vLLM >= 0.21 logs).
    pub capacity_tokens: u64,
    pub max_model_len: u64,
    pub chunk: u64,
    pub fits_one_request: bool,
    /// Requests of max_model_len the same pools would admit if every layer were budgeted for
    /// the whole length: pool bytes / (sum of block_bytes x cdiv(max_model_len, block)). The
    /// worker reports the same figure (`/v1/capacity`, `kvfleet_kv_cache_full_layer_max_concurrency`).
    pub full_layer_max_concurrency: f64,
}

/// Groups layers by spec and sizes one pool per group for `available_kv_bytes`.
pub fn pool_layout(
    geometry: &Geometry,
    p: &EngineParams,
    available_kv_bytes: u64,
) -> Result<KvfleetPlan, PlanError> {
    p.check()?;
    geometry.check_limits()?;
    let mut groups: Vec<KvfleetGroup> = Vec::new();
    for (i, l) in geometry.layers.iter().enumerate() {
        let heads = kv_heads_per_rank(l, p.tp);
        let page = page_bytes(l, p.dtype, p.tp, p.block_size)?;
        match groups
            .iter_mut()
            .find(|g| g.kind == l.kind && g.kv_heads_per_rank == heads && g.head_dim == l.head_dim)
        {
            Some(g) => {
                g.layers.push(i);
                g.block_bytes += page;
            }
            None => groups.push(KvfleetGroup {
                kind: l.kind,
                layers: vec![i],
                kv_heads_per_rank: heads,
                head_dim: l.head_dim,
                block_size: p.block_size,
                page_bytes: page,
                block_bytes: page,
                blocks_per_request: blocks_per_request(
                    l.kind,
                    p.max_model_len,
                    p.max_num_batched_tokens,
                    p.block_size,
                ),
                num_blocks: 0,
            }),
        }
    }
    let bytes_per_request: u64 = groups
        .iter()
        .map(|g| g.blocks_per_request.saturating_mul(g.block_bytes))
        .fold(0u64, u64::saturating_add);
    let max_concurrency = fill_pools(&mut groups, available_kv_bytes);
    let pool_bytes: u64 = groups
        .iter()
        .map(|g| g.num_blocks.saturating_mul(g.block_bytes))
        .fold(0u64, u64::saturating_add);
    Ok(KvfleetPlan {
        full_layer_max_concurrency: full_layer_concurrency(
            pool_bytes,
            groups.iter().map(|g| g.block_bytes),
            p.max_model_len,
            p.block_size,
        ),
        available_kv_bytes,
        bytes_per_request,
        max_concurrency,
        capacity_tokens: (max_concurrency * p.max_model_len as f64) as u64,
        max_model_len: p.max_model_len,
        chunk: p.max_num_batched_tokens,
        fits_one_request: bytes_per_request <= available_kv_bytes,
        groups,
    })
}

/// A group of layers with a pool of its own, as [`fill_pools`] sizes it: the planner's
/// [`KvfleetGroup`] and the engine's pools (`kvfleet-engine` `capacity::GroupPool`).
pub trait BlockGroup {
    /// `(block_bytes, blocks_per_request)`, and the `num_blocks` to set.
    fn pool_mut(&mut self) -> (u64, u64, &mut u64);
}

impl BlockGroup for KvfleetGroup {
    fn pool_mut(&mut self) -> (u64, u64, &mut u64) {
        (self.block_bytes, self.blocks_per_request, &mut self.num_blocks)
    }
}

/// Sizes every group's pool in `available` bytes ([`split_blocks`]) and returns the requests
/// of max_model_len that fit at once: the smallest `num_blocks / blocks_per_request`.
pub fn fill_pools<G: BlockGroup>(groups: &mut [G], available: u64) -> f64 {
    let sizes: Vec<(u64, u64)> = groups
        .iter_mut()
        .map(|g| {
            let (block_bytes, blocks_per_request, _) = g.pool_mut();
            (block_bytes, blocks_per_request)
        })
        .collect();
    let mut max_concurrency = f64::INFINITY;
    for ((g, n), (_, blocks_per_request)) in
        groups.iter_mut().zip(split_blocks(&sizes, available)).zip(&sizes)
    {
        *g.pool_mut().2 = n;
        max_concurrency = max_concurrency.min(n as f64 / *blocks_per_request as f64);
    }
    max_concurrency
}

/// Blocks of each group, given as `(block_bytes, blocks_per_request)`, in `available` bytes:
/// the largest concurrency `c` with `sum(ceil(c x blocks_per_request) x block_bytes) <=
/// available` (bisection; `c x bytes_per_request <= available` bounds it), then the remainder
/// block by block to the group that limits concurrency. The planner and the engine's pools
/// (`kvfleet-engine` `capacity::size_pools`) both split this way.
pub fn split_blocks(groups: &[(u64, u64)], available: u64) -> Vec<u64> {
    let bytes_per_request: u64 = groups
        .iter()
        .map(|(bytes, blocks)| blocks.saturating_mul(*bytes))
        .fold(0u64, u64::saturating_add);
    let need = |c: f64| -> u128 {
        groups
            .iter()
            .map(|(bytes, blocks)| u128::from((c * *blocks as f64).ceil() as u64) * u128::from(*bytes))
            .sum()
    };
    let (mut lo, mut hi) = (0.0f64, available as f64 / bytes_per_request.max(1) as f64 + 1.0);
    for _ in 0..200 {
        let mid = (lo + hi) / 2.0;
        if need(mid) <= u128::from(available) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let mut num: Vec<u64> = groups
        .iter()
        .map(|(_, blocks)| (lo * *blocks as f64).ceil() as u64)
        .collect();
    let mut left = available.saturating_sub(
        groups
            .iter()
            .zip(&num)
            .map(|((bytes, _), n)| n.saturating_mul(*bytes))
            .fold(0u64, u64::saturating_add),
    );
    loop {
        let ratio = |i: usize| num[i] as f64 / groups[i].1 as f64;
        let next = (0..groups.len())
            .filter(|i| groups[*i].0 <= left)
            .min_by(|a, b| ratio(*a).total_cmp(&ratio(*b)));
        match next {
            Some(i) => {
                num[i] += 1;
                left -= groups[i].0;
            }
            None => break,
        }
    }
    num
}

impl KvfleetPlan {
    /// Requests of `tokens` tokens that fit at once in the pools sized for max_model_len.
    pub fn concurrency_at(&self, tokens: u64) -> f64 {
        self.groups
            .iter()
            .map(|g| {
                g.num_blocks as f64
                    / blocks_per_request(g.kind, tokens, self.chunk, g.block_size).max(1) as f64
            })
            .fold(f64::INFINITY, f64::min)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sliding_budget_is_window_plus_chunk_capped_by_the_request() {
        let sw = LayerKind::Sliding { window: 1024 };
        assert_eq!(blocks_per_request(sw, 16_001, 8192, 16), 576);
        assert_eq!(blocks_per_request(LayerKind::Full, 16_001, 8192, 16), 1001);
        // Short requests never hold more than their own tokens.
        assert_eq!(blocks_per_request(sw, 100, 8192, 16), 7);
        // Decode-only budget with a tiny chunk: window blocks + 1.
        assert_eq!(blocks_per_request(sw, 100_000, 1, 16), 65);
    }
}
