//! Step plans for callers that choose their own batches (tests, benchmarks, the preflight
//! self-test), over the same page tables ([`KvManager`], [`BlockTable`]) and the same plan
//! writer as the [`Scheduler`](super::scheduler::Scheduler).

use std::collections::HashMap;

use super::block::{BlockTable, KvManager};
use super::layout::{GroupSpec, StepPlan};

/// Why a direct plan could not be made.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DirectError {
    #[error("sequence {id} holds {held} positions but the step starts it at {start}; positions must be contiguous")]
    Position { id: u64, held: usize, start: usize },
    #[error(
        "KV cache is full ({blocks} blocks of {block_size} tokens); release sequences or use a larger pool"
    )]
    Full { blocks: usize, block_size: usize },
}

/// Page tables of sequences stepped by hand.
pub struct DirectPlanner {
    kv: KvManager,
    /// id -> (tables, positions held).
    seqs: HashMap<u64, (Vec<BlockTable>, usize)>,
}

impl DirectPlanner {
    pub fn new(block_size: usize, groups: &[GroupSpec]) -> Self {
        DirectPlanner {
            kv: KvManager::new(block_size, groups),
            seqs: HashMap::new(),
        }
    }

    pub fn kv(&self) -> &KvManager {
        &self.kv
    }

    /// Positions held for `id` (0 when unknown).
    pub fn held(&self, id: u64) -> usize {
        self.seqs.get(&id).map_or(0, |s| s.1)
    }

    /// Grows each `(id, start, len)` by `len` positions (allocating pages, dropping pages out
    /// of a sliding window) and writes the step's plan.
    pub fn plan(&mut self, batch: &[(u64, usize, usize)], plan: &mut StepPlan) -> Result<(), DirectError> {
        for &(id, start, len) in batch {
            let held = self.held(id);
            if held != start {
                return Err(DirectError::Position { id, held, start });
            }
            let new_tables = self.kv.new_tables();
            let (tables, _) = self.seqs.entry(id).or_insert((new_tables, 0));
            // An accounting error here would be a bug in the block manager; report it as full.
            let full = DirectError::Full {
                blocks: self.kv.total_blocks(),
                block_size: self.kv.block_size,
            };
            self.kv
                .free_out_of_window(tables, start)
                .map_err(|_| full.clone())?;
            if !self.kv.allocate(tables, start + len) {
                return Err(full);
            }
        }
        let rows: Vec<(&[BlockTable], usize, usize)> = batch
            .iter()
            .map(|&(id, start, len)| (self.seqs[&id].0.as_slice(), start, len))
            .collect();
        super::scheduler::write_plan(plan, self.kv.block_size, self.kv.groups.len(), rows);
        for &(id, start, len) in batch {
            if let Some(s) = self.seqs.get_mut(&id) {
                s.1 = start + len;
            }
        }
        Ok(())
    }

    /// Frees every page of `id`.
    pub fn release(&mut self, id: u64) {
        if let Some((mut tables, _)) = self.seqs.remove(&id) {
            let _ = self.kv.free_all(&mut tables);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn direct_plans_use_the_schedulers_layout_and_free_everything() {
        let mut p = DirectPlanner::new(
            4,
            &[GroupSpec {
                window: None,
                num_blocks: 8,
            }],
        );
        let mut plan = StepPlan::default();
        p.plan(&[(1, 0, 9), (2, 0, 3)], &mut plan).unwrap();
        assert_eq!(plan.qo_indptr, vec![0, 9, 12]);
        let g = &plan.groups[0];
        assert_eq!(g.kv_indptr, vec![0, 3, 4]);
        assert_eq!(g.kv_last_page_len, vec![1, 3]);
        assert_eq!(g.slot_mapping.len(), 12);
        p.plan(&[(1, 9, 1)], &mut plan).unwrap();
        assert_eq!(plan.groups[0].kv_last_page_len, vec![2]);
        assert!(matches!(
            p.plan(&[(2, 5, 1)], &mut plan),
            Err(DirectError::Position { .. })
        ));
        assert!(matches!(
            p.plan(&[(3, 0, 100)], &mut plan),
            Err(DirectError::Full { .. })
        ));
        p.release(1);
        p.release(2);
        p.release(3);
        assert_eq!(p.kv().used_blocks(), 0);
    }
}
