//! The KV block manager: one pool of page ids per layer group (free list + reference
//! counts) and, per request, one block table per group. Sliding-window groups free the
//! pages that left the window before each step, so a request holds at most
//! `cdiv(window - 1, block_size) + cdiv(chunk, block_size)` pages there when chunks start
//! on block boundaries (vLLM's bound, `cdiv(window - 1 + chunk, block_size) + 1` from
//! vllm-project/vllm PR #40946, adds one page for chunks that start mid-block).

use std::collections::HashMap;

use super::layout::GroupSpec;
use super::prefix::{BlockHash, KvEvent};

/// A block-accounting bug caught at run time (never expected; reported, not panicked).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BlockError {
    #[error("block {0} freed while not allocated (double free)")]
    DoubleFree(u32),
    #[error("block {0} is outside the pool")]
    OutOfRange(u32),
}

const NIL: u32 = u32::MAX;

/// Page ids of one group: a reference count per page, the prefix cache's content addresses,
/// and one free queue of every page nobody holds.
///
/// The free queue is `[never cached or dropped ...][cached, least recently released first ...]`:
/// a released page without an address goes to the front (it is handed out next, LIFO, as
/// before caching existed), a released cached page to the back. Allocation pops the front, so
/// it uses plain free pages first and then evicts the least recently used cached page; cached
/// pages count as free (vLLM counts them so too). A prefix hit takes a cached page out of the
/// queue wherever it is ([`BlockPool::touch`]).
#[derive(Clone, Debug)]
pub struct BlockPool {
    refcount: Vec<u32>,
    /// Content address of each page that holds a cached full block.
    hash: Vec<Option<BlockHash>>,
    cached: HashMap<BlockHash, u32>,
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    num_free: usize,
    /// Free pages that hold a cached block (evictable).
    num_evictable: usize,
    /// Addresses evicted since the last [`BlockPool::take_evicted`].
    evicted: Vec<BlockHash>,
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> Self {
        let n = num_blocks as u32;
        Self {
            refcount: vec![0; num_blocks],
            hash: vec![None; num_blocks],
            cached: HashMap::new(),
            // The queue starts 0, 1, 2, ...: pops hand out 0 first.
            prev: (0..n).map(|i| if i == 0 { NIL } else { i - 1 }).collect(),
            next: (0..n).map(|i| if i + 1 == n { NIL } else { i + 1 }).collect(),
            head: if n == 0 { NIL } else { 0 },
            tail: if n == 0 { NIL } else { n - 1 },
            num_free: num_blocks,
            num_evictable: 0,
            evicted: Vec::new(),
        }
    }

    pub fn total(&self) -> usize {
        self.refcount.len()
    }

    /// Pages nobody holds, cached ones included (they are evicted on demand).
    pub fn num_free(&self) -> usize {
        self.num_free
    }

    /// Free pages that still hold a cached block.
    pub fn num_cached(&self) -> usize {
        self.num_evictable
    }

    pub fn num_used(&self) -> usize {
        self.total() - self.num_free()
    }

    fn unlink(&mut self, id: u32) {
        let (p, n) = (self.prev[id as usize], self.next[id as usize]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[id as usize] = NIL;
        self.next[id as usize] = NIL;
        self.num_free -= 1;
        if self.hash[id as usize].is_some() {
            self.num_evictable -= 1;
        }
    }

    fn push_front(&mut self, id: u32) {
        self.prev[id as usize] = NIL;
        self.next[id as usize] = self.head;
        match self.head {
            NIL => self.tail = id,
            h => self.prev[h as usize] = id,
        }
        self.head = id;
        self.num_free += 1;
    }

    fn push_back(&mut self, id: u32) {
        self.next[id as usize] = NIL;
        self.prev[id as usize] = self.tail;
        match self.tail {
            NIL => self.head = id,
            t => self.next[t as usize] = id,
        }
        self.tail = id;
        self.num_free += 1;
        self.num_evictable += 1;
    }

    /// Appends `n` pages to `out`, evicting the least recently used cached pages when no plain
    /// free page is left, or appends none when fewer than `n` are free.
    pub fn allocate(&mut self, n: usize, out: &mut Vec<u32>) -> bool {
        if n > self.num_free {
            return false;
        }
        for _ in 0..n {
            let id = self.head;
            self.unlink(id);
            if let Some(h) = self.hash[id as usize].take() {
                self.cached.remove(&h);
                self.evicted.push(h);
            }
            self.refcount[id as usize] = 1;
            out.push(id);
        }
        true
    }

    /// One more holder of a held page (forks).
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

    /// One more holder of the cached page `id` (a prefix hit): out of the free queue when
    /// nobody held it.
    pub fn touch(&mut self, id: u32) -> Result<(), BlockError> {
        let rc = *self.refcount.get(id as usize).ok_or(BlockError::OutOfRange(id))?;
        if rc == 0 {
            self.unlink(id);
        }
        self.refcount[id as usize] = rc + 1;
        Ok(())
    }

    /// Drops one holder of `id`; at zero the page joins the free queue: at the back (evicted
    /// last) when it holds a cached block, at the front otherwise.
    pub fn release(&mut self, id: u32) -> Result<(), BlockError> {
        let rc = self
            .refcount
            .get_mut(id as usize)
            .ok_or(BlockError::OutOfRange(id))?;
        match *rc {
            0 => Err(BlockError::DoubleFree(id)),
            1 => {
                *rc = 0;
                if self.hash[id as usize].is_some() {
                    self.push_back(id);
                } else {
                    self.push_front(id);
                }
                Ok(())
            }
            _ => {
                *rc -= 1;
                Ok(())
            }
        }
    }

    /// Gives the held page `id`, now full and computed, the address `hash`. `false` when
    /// another page already holds that block (two requests computed it at once: the first
    /// stays cached, this page is freed plainly later) or `id` is already addressed.
    pub fn register(&mut self, id: u32, hash: BlockHash) -> bool {
        let i = id as usize;
        if i >= self.total() || self.refcount[i] == 0 || self.hash[i].is_some() {
            return false;
        }
        if self.cached.contains_key(&hash) {
            return false;
        }
        self.cached.insert(hash, id);
        self.hash[i] = Some(hash);
        true
    }

    /// The page holding the cached block `hash`.
    pub fn lookup(&self, hash: BlockHash) -> Option<u32> {
        self.cached.get(&hash).copied()
    }

    /// The address of the block page `id` holds, if cached.
    pub fn hash_of(&self, id: u32) -> Option<BlockHash> {
        self.hash.get(id as usize).copied().flatten()
    }

    /// Addresses evicted since the last call.
    pub fn take_evicted(&mut self) -> Vec<BlockHash> {
        std::mem::take(&mut self.evicted)
    }

    /// Forgets every cached block; free cached pages become plain free pages (their queue
    /// order is kept). Returns how many addresses were dropped.
    pub fn clear_cache(&mut self) -> usize {
        let n = self.cached.len();
        self.cached.clear();
        for h in self.hash.iter_mut() {
            *h = None;
        }
        self.num_evictable = 0;
        self.evicted.clear();
        n
    }

    /// Reference count of `id` (tests, metrics).
    pub fn refcount(&self, id: u32) -> u32 {
        self.refcount.get(id as usize).copied().unwrap_or(0)
    }

    /// The free queue, front first (tests).
    pub fn free_queue(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.num_free);
        let mut id = self.head;
        while id != NIL {
            out.push(id);
            id = self.next[id as usize];
        }
        out
    }

    /// Every cached block and its page (tests, events).
    pub fn cached_blocks(&self) -> impl Iterator<Item = (BlockHash, u32)> + '_ {
        self.cached.iter().map(|(h, id)| (*h, *id))
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

/// Block pools of every layer group, and the prefix cache over them.
#[derive(Clone, Debug)]
pub struct KvManager {
    pub block_size: usize,
    pub groups: Vec<Group>,
    /// Automatic prefix caching: full computed blocks stay cached when released.
    caching: bool,
    /// Whether cache changes are recorded as [`KvEvent`]s.
    recording: bool,
    events: Vec<KvEvent>,
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
            caching: false,
            recording: false,
            events: Vec::new(),
        }
    }

    /// Turns automatic prefix caching on or off (off forgets every cached block).
    pub fn set_caching(&mut self, on: bool) {
        self.caching = on;
        if !on {
            self.clear_cache();
        }
    }

    pub fn caching(&self) -> bool {
        self.caching
    }

    /// Records cache changes as [`KvEvent`]s for [`KvManager::take_events`].
    pub fn record_events(&mut self, on: bool) {
        self.recording = on;
        if !on {
            self.events.clear();
        }
    }

    /// The group whose cache KV events describe: the first full-attention group (a prefix hit
    /// needs all of its blocks), else the first.
    pub fn anchor_group(&self) -> usize {
        self.groups.iter().position(|g| g.window.is_none()).unwrap_or(0)
    }

    /// Cache changes since the last call (evictions included), oldest first.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.collect_evictions();
        std::mem::take(&mut self.events)
    }

    fn collect_evictions(&mut self) {
        let anchor = self.anchor_group();
        for (g, group) in self.groups.iter_mut().enumerate() {
            let gone = group.pool.take_evicted();
            if self.recording && g == anchor && !gone.is_empty() {
                self.events.push(KvEvent::Removed {
                    block_hashes: gone.iter().map(|h| h.external()).collect(),
                });
            }
        }
    }

    /// Forgets every cached block in every group.
    pub fn clear_cache(&mut self) {
        self.collect_evictions();
        let mut dropped = 0;
        for g in &mut self.groups {
            dropped += g.pool.clear_cache();
        }
        if self.recording && dropped > 0 {
            self.events.push(KvEvent::AllCleared);
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

    /// Gives back the pages past position `new_len` (speculative tokens that were rejected);
    /// none of them can be cached: a page is cached only once all its positions are computed.
    pub fn truncate(&mut self, tables: &mut [BlockTable], new_len: usize) -> Result<(), BlockError> {
        let keep = new_len.div_ceil(self.block_size);
        for (g, t) in self.groups.iter_mut().zip(tables.iter_mut()) {
            while t.blocks.len() > keep.max(t.freed) {
                if let Some(id) = t.blocks.pop() {
                    g.pool.release(id)?;
                }
            }
        }
        Ok(())
    }

    /// Releases every page of `tables` and empties them. Pages go back last first, so that
    /// of a cached prefix the tail is evicted before the head it depends on.
    pub fn free_all(&mut self, tables: &mut [BlockTable]) -> Result<(), BlockError> {
        for (g, t) in self.groups.iter_mut().zip(tables.iter_mut()) {
            for &id in t.blocks[t.freed..].iter().rev() {
                g.pool.release(id)?;
            }
            t.blocks.clear();
            t.freed = 0;
        }
        Ok(())
    }

    /// Blocks of a cached prefix a request with block addresses `hashes` can start from: the
    /// largest `k <= max_blocks` for which every group holds what computing from position
    /// `k * block_size` needs: a full-attention group all of blocks `0..k`, a sliding group
    /// the blocks still inside the window of that position (vLLM's hybrid rule: each group
    /// says how much of the prefix it can serve and the request takes the shortest).
    pub fn cached_prefix(&self, hashes: &[BlockHash], max_blocks: usize) -> usize {
        if !self.caching {
            return 0;
        }
        let limit = max_blocks.min(hashes.len());
        // Full groups: the leading run of cached blocks.
        let mut k = limit;
        for g in self.groups.iter().filter(|g| g.window.is_none()) {
            let run = hashes[..k]
                .iter()
                .take_while(|h| g.pool.lookup(**h).is_some())
                .count();
            k = k.min(run);
        }
        let sliding: Vec<(&Group, Vec<usize>)> = self
            .groups
            .iter()
            .filter(|g| g.window.is_some())
            .map(|g| {
                // run[i]: cached blocks ending just before block i.
                let mut run = vec![0usize; k + 1];
                for i in 0..k {
                    run[i + 1] = if g.pool.lookup(hashes[i]).is_some() {
                        run[i] + 1
                    } else {
                        0
                    };
                }
                (g, run)
            })
            .collect();
        while k > 0 {
            let ok = sliding.iter().all(|(g, run)| {
                let first = droppable(self.block_size, g.window, k * self.block_size).min(k);
                k - run[k] <= first
            });
            if ok {
                return k;
            }
            k -= 1;
        }
        0
    }

    /// Takes a reference on the cached blocks a request starts from (`hashes` are the first
    /// `k` addresses, `k` from [`KvManager::cached_prefix`]); a sliding group takes only the
    /// blocks inside the window of position `k * block_size`. `tables` must be empty.
    pub fn take_prefix(&mut self, tables: &mut [BlockTable], hashes: &[BlockHash]) -> Result<(), BlockError> {
        let k = hashes.len();
        let bs = self.block_size;
        for (g, t) in self.groups.iter_mut().zip(tables.iter_mut()) {
            debug_assert!(t.blocks.is_empty());
            let first = droppable(bs, g.window, k * bs).min(k);
            t.blocks.clear();
            t.blocks.resize(first, 0);
            t.freed = first;
            for h in &hashes[first..] {
                // cached_prefix checked every one; a miss is an accounting bug.
                let id = g.pool.lookup(*h).ok_or(BlockError::OutOfRange(NIL))?;
                g.pool.touch(id)?;
                t.blocks.push(id);
            }
        }
        Ok(())
    }

    /// Caches the request's full computed blocks `*registered..upto` (`hashes[i]` addresses
    /// block `i`) in every group that still holds them, and records them as stored.
    pub fn register(
        &mut self,
        tables: &[BlockTable],
        hashes: &[BlockHash],
        tokens: &[u32],
        upto: usize,
        registered: &mut usize,
    ) {
        let upto = upto.min(hashes.len());
        if !self.caching || *registered >= upto {
            *registered = (*registered).max(upto);
            return;
        }
        // Evictions first: an address evicted earlier this step may be stored again now.
        self.collect_evictions();
        let anchor = self.anchor_group();
        let bs = self.block_size;
        let mut stored: Vec<usize> = Vec::new();
        for (g, (group, t)) in self.groups.iter_mut().zip(tables).enumerate() {
            for (i, h) in hashes.iter().enumerate().take(upto).skip(*registered) {
                if i < t.freed || i >= t.blocks.len() {
                    continue;
                }
                let fresh = group.pool.register(t.blocks[i], *h);
                if fresh && g == anchor {
                    stored.push(i);
                }
            }
        }
        if self.recording && !stored.is_empty() {
            // One event per run of consecutive blocks (a run's parent is the block before it).
            let mut start = 0;
            while start < stored.len() {
                let mut end = start + 1;
                while end < stored.len() && stored[end] == stored[end - 1] + 1 {
                    end += 1;
                }
                let (a, b) = (stored[start], stored[end - 1] + 1);
                self.events.push(KvEvent::Stored {
                    block_hashes: hashes[a..b].iter().map(|h| h.external()).collect(),
                    parent_block_hash: a.checked_sub(1).map(|p| hashes[p].external()),
                    token_ids: tokens[a * bs..b * bs].to_vec(),
                    block_size: bs,
                });
                start = end;
            }
        }
        *registered = upto;
    }

    /// Most pages one request of `tokens` positions holds in a group when prefill chunks
    /// of at most `chunk` tokens start on block boundaries: full `cdiv(tokens, block)`,
    /// sliding `min(that, cdiv(window - 1, block) + cdiv(chunk, block))`: the planner's
    /// [`super::capacity::blocks_per_request`], so admission and the prediction agree.
    pub fn max_pages_per_request(&self, window: Option<u32>, tokens: usize, chunk: usize) -> usize {
        super::capacity::blocks_per_request(window, tokens, chunk, self.block_size) as usize
    }

    /// The longest new request, in tokens, that the free pages (cached ones included) of every
    /// group could hold now, window-aware: a full-attention group holds a page per
    /// `block_size` tokens of the request, a sliding group never more than
    /// [`KvManager::max_pages_per_request`] with prefill chunks of `chunk` tokens, so a sliding
    /// group with that many free pages limits nothing (`None` when no group limits the length).
    /// This is the figure a router compares a request against; counting every layer as full
    /// attention would understate it by the sliding layers' share.
    pub fn free_tokens(&self, chunk: usize) -> Option<usize> {
        let b = self.block_size;
        self.groups
            .iter()
            .filter_map(|g| {
                let free = g.pool.num_free();
                match g.window {
                    Some(w) if free >= self.max_pages_per_request(Some(w), usize::MAX / 2, chunk) => None,
                    _ => Some(free * b),
                }
            })
            .min()
    }

    /// Pages held by some request (cached free pages are not used).
    pub fn used_blocks(&self) -> usize {
        self.groups.iter().map(|g| g.pool.num_used()).sum()
    }

    /// Free pages that still hold a cached block (evictable).
    pub fn cached_blocks(&self) -> usize {
        self.groups.iter().map(|g| g.pool.num_cached()).sum()
    }

    pub fn total_blocks(&self) -> usize {
        self.groups.iter().map(|g| g.pool.total()).sum()
    }

    /// Fraction of pages in use over all groups (cached free pages count as free).
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
    fn free_tokens_count_a_sliding_group_only_while_it_is_short_of_a_window() {
        let spec = |window, blocks| GroupSpec {
            window,
            num_blocks: blocks,
        };
        // 16-token pages, a global group of 100 pages and a 128-token-window group of 20.
        let mut kv = KvManager::new(16, &[spec(None, 100), spec(Some(128), 20)]);
        // A window of 128 with 64-token chunks needs at most 8 + 4 = 12 pages: 20 free limit nothing.
        assert_eq!(kv.free_tokens(64), Some(1600));
        let mut tables = kv.new_tables();
        assert!(kv.allocate(&mut tables, 16 * 10));
        // 90 global pages left; the sliding group has 10 < 12 free and limits the length.
        assert_eq!(kv.free_tokens(64), Some(160));
        // Only sliding groups with room: no limit from the pool.
        let only_local = KvManager::new(16, &[spec(Some(128), 20)]);
        assert_eq!(only_local.free_tokens(64), None);
    }

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
