//! The KV block manager: one pool of page ids per layer group (free list + reference
//! counts) and, per request, one block table per group. Sliding-window groups free the
//! pages that left the window before each step, so a request holds at most
//! `cdiv(window - 1, block_size) + cdiv(chunk, block_size)` pages there when chunks start
//! on block boundaries (vLLM's bound, `cdiv(window - 1 + chunk, block_size) + 1` from
//! vllm-project/vllm PR #40946, adds one page for chunks that start mid-block).

use super::layout::GroupSpec;

/// A block-accounting bug caught at run time (never expected; reported, not panicked).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BlockError {
    #[error("block {0} freed while not allocated (double free)")]
    DoubleFree(u32),
    #[error("block {0} is outside the pool")]
    OutOfRange(u32),
}

/// Page ids of one group: a LIFO free list and a reference count per page.
#[derive(Clone, Debug)]
pub struct BlockPool {
    refcount: Vec<u32>,
    free: Vec<u32>,
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> Self {
        Self {
            refcount: vec![0; num_blocks],
            // Reversed so that pops hand out 0, 1, 2, ... first.
            free: (0..num_blocks as u32).rev().collect(),
        }
    }

    pub fn total(&self) -> usize {
        self.refcount.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn num_used(&self) -> usize {
        self.total() - self.num_free()
    }

    /// Appends `n` fresh pages to `out`, or none when fewer than `n` are free.
    pub fn allocate(&mut self, n: usize, out: &mut Vec<u32>) -> bool {
        if n > self.free.len() {
            return false;
        }
        for _ in 0..n {
            let Some(id) = self.free.pop() else { return false };
            self.refcount[id as usize] = 1;
            out.push(id);
        }
        true
    }

    /// One more holder of `id` (shared prefixes, forks).
    pub fn share(&mut self, id: u32) -> Result<(), BlockError> {
        let rc = self
            .refcount
            .get_mut(id as usize)
            .ok_or(BlockError::OutOfRange(id))?;
        if *rc == 0 {
            return Err(BlockError::DoubleFree(id));
        }
        *rc += 1;
        Ok(())
    }

    /// Drops one holder of `id`; the page returns to the free list at zero.
    pub fn release(&mut self, id: u32) -> Result<(), BlockError> {
        let rc = self
            .refcount
            .get_mut(id as usize)
            .ok_or(BlockError::OutOfRange(id))?;
        match *rc {
            0 => Err(BlockError::DoubleFree(id)),
            1 => {
                *rc = 0;
                self.free.push(id);
                Ok(())
            }
            _ => {
                *rc -= 1;
                Ok(())
            }
        }
    }

    /// Reference count of `id` (tests, metrics).
    pub fn refcount(&self, id: u32) -> u32 {
        self.refcount.get(id as usize).copied().unwrap_or(0)
    }
}

/// One request's pages in one group. `blocks[i]` holds positions
/// `i * block_size .. (i + 1) * block_size`; the first `freed` entries were released by
/// a sliding window and are kept only as place holders.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockTable {
    pub blocks: Vec<u32>,
    pub freed: usize,
}

impl BlockTable {
    /// Pages still held.
    pub fn live(&self) -> &[u32] {
        &self.blocks[self.freed..]
    }
}

/// A layer group's pool and window.
#[derive(Clone, Debug)]
pub struct Group {
    pub window: Option<u32>,
    pub pool: BlockPool,
}

/// Block pools of every layer group.
#[derive(Clone, Debug)]
pub struct KvManager {
    pub block_size: usize,
    pub groups: Vec<Group>,
}

impl KvManager {
    pub fn new(block_size: usize, groups: &[GroupSpec]) -> Self {
        Self {
            block_size,
            groups: groups
                .iter()
                .map(|g| Group {
                    window: g.window,
                    pool: BlockPool::new(g.num_blocks),
                })
                .collect(),
        }
    }

    /// Empty tables for a new request.
    pub fn new_tables(&self) -> Vec<BlockTable> {
        vec![BlockTable::default(); self.groups.len()]
    }

    /// Releases pages that left every future query's window.
    pub fn free_out_of_window(&mut self, tables: &mut [BlockTable], start: usize) -> Result<(), BlockError> {
        for (g, t) in self.groups.iter_mut().zip(tables.iter_mut()) {
            let upto = droppable(self.block_size, g.window, start).min(t.blocks.len());
            while t.freed < upto {
                g.pool.release(t.blocks[t.freed])?;
                t.freed += 1;
            }
        }
        Ok(())
    }

    /// Whether a request with no pages could start a step of `n` tokens at position 0.
    pub fn fits_fresh(&self, n: usize) -> bool {
        let need = n.div_ceil(self.block_size);
        self.groups.iter().all(|g| g.pool.num_free() >= need)
    }

    /// Extends `tables` to cover positions `0..new_len`, in every group or in none.
    pub fn allocate(&mut self, tables: &mut [BlockTable], new_len: usize) -> bool {
        let need = new_len.div_ceil(self.block_size);
        if self
            .groups
            .iter()
            .zip(tables.iter())
            .any(|(g, t)| g.pool.num_free() < need.saturating_sub(t.blocks.len()))
        {
            return false;
        }
        for (g, t) in self.groups.iter_mut().zip(tables.iter_mut()) {
            let missing = need.saturating_sub(t.blocks.len());
            // Cannot fail: checked above.
            let ok = g.pool.allocate(missing, &mut t.blocks);
            debug_assert!(ok);
        }
        true
    }

    /// Releases every page of `tables` and empties them.
    pub fn free_all(&mut self, tables: &mut [BlockTable]) -> Result<(), BlockError> {
        for (g, t) in self.groups.iter_mut().zip(tables.iter_mut()) {
            for &id in &t.blocks[t.freed..] {
                g.pool.release(id)?;
            }
            t.blocks.clear();
            t.freed = 0;
        }
        Ok(())
    }

    /// Most pages one request of `tokens` positions holds in a group when prefill chunks
    /// of at most `chunk` tokens start on block boundaries: full `cdiv(tokens, block)`,
    /// sliding `min(that, cdiv(window - 1, block) + cdiv(chunk, block))` (the model of
    /// `plan::kvfleet::blocks_per_request`).
    pub fn max_pages_per_request(&self, window: Option<u32>, tokens: usize, chunk: usize) -> usize {
        let b = self.block_size;
        let full = tokens.div_ceil(b);
        match window {
            Some(w) => full.min((w as usize).saturating_sub(1).div_ceil(b) + chunk.max(1).div_ceil(b)),
            None => full,
        }
    }

    pub fn used_blocks(&self) -> usize {
        self.groups.iter().map(|g| g.pool.num_used()).sum()
    }

    pub fn total_blocks(&self) -> usize {
        self.groups.iter().map(|g| g.pool.total()).sum()
    }

    /// Fraction of pages in use over all groups.
    pub fn usage(&self) -> f64 {
        let total = self.total_blocks();
        if total == 0 {
            0.0
        } else {
            self.used_blocks() as f64 / total as f64
        }
    }
}

/// Leading pages a sliding group may drop before computing from position `start`: the
/// earliest key any query at or after `start` sees is `start + 1 - window`.
fn droppable(block_size: usize, window: Option<u32>, start: usize) -> usize {
    match window {
        Some(w) => (start + 1).saturating_sub(w as usize) / block_size,
        None => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn double_free_is_reported_not_panicked() {
        let mut p = BlockPool::new(2);
        let mut out = Vec::new();
        assert!(p.allocate(2, &mut out));
        assert!(!p.allocate(1, &mut out), "pool is empty");
        p.release(out[0]).unwrap();
        assert_eq!(p.release(out[0]), Err(BlockError::DoubleFree(out[0])));
        assert_eq!(p.release(7), Err(BlockError::OutOfRange(7)));
        p.share(out[1]).unwrap();
        p.release(out[1]).unwrap();
        assert_eq!(p.num_free(), 1, "shared page still held once");
        p.release(out[1]).unwrap();
        assert_eq!(p.num_free(), 2);
    }

    #[test]
    fn sliding_group_frees_pages_that_left_the_window() {
        let groups = [
            GroupSpec {
                window: None,
                num_blocks: 64,
            },
            GroupSpec {
                window: Some(8),
                num_blocks: 64,
            },
        ];
        let mut kv = KvManager::new(4, &groups);
        let mut t = kv.new_tables();
        assert!(kv.allocate(&mut t, 20));
        assert_eq!(t[0].blocks.len(), 5);
        // Next query at 20 sees keys from 13: pages 0..3 (positions 0..12) go.
        kv.free_out_of_window(&mut t, 20).unwrap();
        assert_eq!(t[1].freed, 3);
        assert_eq!(t[0].freed, 0);
        assert_eq!(kv.groups[1].pool.num_used(), 2);
        kv.free_all(&mut t).unwrap();
        assert_eq!(kv.used_blocks(), 0);
    }
}
