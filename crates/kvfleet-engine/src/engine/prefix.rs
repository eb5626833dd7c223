//! Automatic prefix caching: the content address of a full KV block, and the events the cache
//! publishes when blocks enter and leave it.
//!
//! A full block's address is a hash chain: sha256 over the parent block's address, the
//! request's cache key (first block only: the chain carries it on) and the block's token ids.
//! Two requests share a block only when every token before and in it is equal and their keys
//! are equal, so a `cache_salt` partitions the cache (docs/security.md).

use sha2::{Digest, Sha256};

/// Content address of a full KV block (the first 16 bytes of its sha256).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u128);

impl BlockHash {
    /// The 64-bit integer KV events carry (vLLM's events carry integers or bytes; routers that
    /// read them, such as llm-d's precise-prefix scorer, key on the token ids instead).
    pub fn external(self) -> u64 {
        (self.0 >> 64) as u64
    }
}

/// What partitions the cache beside the tokens: requests share blocks only when these are equal.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct CacheKey {
    /// vLLM's `cache_salt` (per tenant, set by a gateway).
    pub salt: Option<String>,
    /// Room for a LoRA adapter's name; none are served yet.
    pub adapter: Option<String>,
}

/// The address of the block holding `tokens` after the block addressed `parent` (`None`: the
/// first block, which also takes `key`).
pub fn hash_block(parent: Option<BlockHash>, key: &CacheKey, tokens: &[u32]) -> BlockHash {
    let mut h = Sha256::new();
    h.update(b"kvfleet-block-v1");
    match parent {
        Some(p) => {
            h.update([1u8]);
            h.update(p.0.to_le_bytes());
        }
        None => {
            h.update([0u8]);
            for part in [&key.salt, &key.adapter] {
                match part {
                    Some(s) => {
                        h.update([1u8]);
                        h.update((s.len() as u64).to_le_bytes());
                        h.update(s.as_bytes());
                    }
                    None => h.update([0u8]),
                }
            }
        }
    }
    h.update((tokens.len() as u64).to_le_bytes());
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    let d = h.finalize();
    let mut b = [0u8; 16];
    b.copy_from_slice(&d[..16]);
    BlockHash(u128::from_le_bytes(b))
}

/// A request's token ids and the addresses of its full blocks, extended as tokens arrive.
#[derive(Clone, Debug, Default)]
pub struct TokenBlocks {
    pub key: CacheKey,
    pub tokens: Vec<u32>,
    pub hashes: Vec<BlockHash>,
}

impl TokenBlocks {
    pub fn new(key: CacheKey, tokens: &[u32], block_size: usize) -> Self {
        let mut t = Self {
            key,
            tokens: Vec::with_capacity(tokens.len() + 16),
            hashes: Vec::new(),
        };
        t.extend(tokens, block_size);
        t
    }

    /// Appends tokens and addresses every block they complete.
    pub fn extend(&mut self, tokens: &[u32], block_size: usize) {
        self.tokens.extend_from_slice(tokens);
        while (self.hashes.len() + 1) * block_size <= self.tokens.len() {
            let i = self.hashes.len();
            let parent = i.checked_sub(1).map(|p| self.hashes[p]);
            let h = hash_block(
                parent,
                &self.key,
                &self.tokens[i * block_size..(i + 1) * block_size],
            );
            self.hashes.push(h);
        }
    }
}

/// A change to the set of cached blocks, in the terms of vLLM's KV events
/// (`vllm/distributed/kv_events.py`): what a router subscribes to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// Consecutive blocks of one request entered the cache.
    Stored {
        /// Addresses, in position order.
        block_hashes: Vec<u64>,
        /// Address of the block before the first one (`None`: the first block of a prompt).
        parent_block_hash: Option<u64>,
        /// `block_hashes.len() * block_size` token ids.
        token_ids: Vec<u32>,
        block_size: usize,
    },
    /// Blocks left the cache (evicted to make room).
    Removed { block_hashes: Vec<u64> },
    /// Every cached block left the cache.
    AllCleared,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_prefixes_share_addresses_and_a_salt_or_one_token_splits_them() {
        let a: Vec<u32> = (0..64).collect();
        let mut b = a.clone();
        b[40] = 999;
        let plain = CacheKey::default();
        let ta = TokenBlocks::new(plain.clone(), &a, 16);
        let tb = TokenBlocks::new(plain.clone(), &b, 16);
        assert_eq!(ta.hashes.len(), 4);
        assert_eq!(ta.hashes[..2], tb.hashes[..2]);
        assert_ne!(ta.hashes[2], tb.hashes[2]);
        assert_ne!(ta.hashes[3], tb.hashes[3], "the chain carries the difference on");
        let salted = CacheKey {
            salt: Some("tenant-a".into()),
            adapter: None,
        };
        let ts = TokenBlocks::new(salted, &a, 16);
        assert!(ts.hashes.iter().zip(&ta.hashes).all(|(x, y)| x != y));
    }

    #[test]
    fn extending_token_by_token_gives_the_addresses_of_one_call() {
        let toks: Vec<u32> = (0..50).map(|i| i * 7 % 13).collect();
        let whole = TokenBlocks::new(CacheKey::default(), &toks, 8);
        let mut inc = TokenBlocks::new(CacheKey::default(), &toks[..3], 8);
        for t in &toks[3..] {
            inc.extend(&[*t], 8);
        }
        assert_eq!(whole.hashes, inc.hashes);
        assert_eq!(whole.hashes.len(), 6);
    }
}
