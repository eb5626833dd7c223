//! KV demand, capacity and room of a worker in one unit that adds up across replicas
//! (issue 31, docs/autoscaling.md).
//!
//! The unit is the token of a maxModelLen request: a group's capacity is its pages over the
//! pages one maxModelLen request holds in it (window-capped for sliding groups, see
//! [`KvManager::max_pages_per_request`]), times maxModelLen; the pool's capacity is the
//! smallest group's. That is `kvfleet_kv_cache_capacity_tokens`, the planner's
//! `maxConcurrency x maxModelLen`. Demand is what the running and waiting requests need to
//! finish (prompt plus output budget), counted page by page in every group; its share of
//! the most loaded group, times the capacity, is the demand in the same tokens. So
//! demand / capacity is the fraction of the binding group the requests need, and two
//! replicas of one deployment on different GPUs add up: a token means the same KV on both.
//!
//! Counting every layer as a full-attention layer (`num_gpu_blocks x block_size`, as
//! vLLM reports it) would measure a Gemma-class model's short requests against a budget
//! its sliding layers never spend; the page counts here are the scheduler's own.

use super::block::KvManager;

/// One worker's KV figures in tokens of maxModelLen requests.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct KvDemand {
    /// What the listed requests need to finish, in the binding group's share.
    pub demand_tokens: f64,
    /// What the pool holds.
    pub capacity_tokens: f64,
    /// What the free pages (cached ones included: they are evicted on demand) hold.
    pub free_tokens: f64,
}

impl KvDemand {
    /// Demand over capacity (0 for an empty pool).
    pub fn ratio(&self) -> f64 {
        if self.capacity_tokens > 0.0 {
            self.demand_tokens / self.capacity_tokens
        } else {
            0.0
        }
    }
}

impl KvManager {
    /// The figures of [`KvDemand`] for requests that will hold `lengths` positions each when
    /// they finish (each capped at `max_model_len`), prefill chunks of at most `chunk` tokens.
    pub fn demand(
        &self,
        lengths: impl Iterator<Item = usize> + Clone,
        max_model_len: usize,
        chunk: usize,
    ) -> KvDemand {
        let len = max_model_len as f64;
        let mut out = KvDemand {
            capacity_tokens: f64::INFINITY,
            free_tokens: f64::INFINITY,
            ..KvDemand::default()
        };
        let mut ratio: f64 = 0.0;
        for g in &self.groups {
            let per = self.max_pages_per_request(g.window, max_model_len, chunk).max(1) as f64;
            let total = g.pool.total() as f64;
            out.capacity_tokens = out.capacity_tokens.min(total / per * len);
            out.free_tokens = out.free_tokens.min(g.pool.num_free() as f64 / per * len);
            let need: usize = lengths
                .clone()
                .map(|l| self.max_pages_per_request(g.window, l.min(max_model_len), chunk))
                .sum();
            if total > 0.0 {
                ratio = ratio.max(need as f64 / total);
            }
        }
        if self.groups.is_empty() {
            return KvDemand::default();
        }
        out.demand_tokens = ratio * out.capacity_tokens;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::layout::GroupSpec;

    fn spec(window: Option<u32>, num_blocks: usize) -> GroupSpec {
        GroupSpec { window, num_blocks }
    }

    #[test]
    fn a_full_attention_pool_counts_pages_of_the_whole_length() {
        // 16-token pages, 100 of them, maxModelLen 320 (20 pages): 5 requests of 320 fit.
        let kv = KvManager::new(16, &[spec(None, 100)]);
        let d = kv.demand([320usize, 160].into_iter(), 320, 64);
        assert_eq!(d.capacity_tokens, 1600.0);
        assert_eq!(d.free_tokens, 1600.0);
        // 20 + 10 pages of 100.
        assert!((d.demand_tokens - 480.0).abs() < 1e-9, "{d:?}");
        assert!((d.ratio() - 0.3).abs() < 1e-12);
    }

    #[test]
    fn a_sliding_group_is_charged_its_window_only() {
        // Gemma-like: a global group of 100 pages and a 128-token-window group sized by what
        // one maxModelLen (1600) request needs of each: 100 pages global, 8 + 4 = 12 local.
        let kv = KvManager::new(16, &[spec(None, 100), spec(Some(128), 12)]);
        let d = kv.demand([1600usize].into_iter(), 1600, 64);
        assert_eq!(d.capacity_tokens, 1600.0);
        assert!((d.ratio() - 1.0).abs() < 1e-12, "{d:?}");
        // Eight 200-token requests: 13 pages each global (104 > 100: over capacity), and
        // 12 each local (96 of 12 pages: the local group binds, 8x over).
        let d = kv.demand(std::iter::repeat_n(200usize, 8), 1600, 64);
        assert!((d.ratio() - 8.0).abs() < 1e-12, "{d:?}");
        // Budgeted as full layers, the same 8 x 200 tokens read as one maxModelLen request
        // of 1,600: a ratio of 1.0, eight times too low (docs/autoscaling.md).
    }

    #[test]
    fn free_pages_count_in_the_smallest_group() {
        let mut kv = KvManager::new(16, &[spec(None, 100), spec(Some(128), 12)]);
        let mut tables = kv.new_tables();
        assert!(kv.allocate(&mut tables, 16 * 6));
        // Global: 94 of 100 free; local: 6 of 12 free -> half a request's worth.
        let d = kv.demand(std::iter::empty::<usize>(), 1600, 64);
        assert!((d.free_tokens - 800.0).abs() < 1e-9, "{d:?}");
        assert_eq!(d.demand_tokens, 0.0);
    }
}
