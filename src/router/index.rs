//! What each worker's prefix cache holds, known from its KV events (vLLM's wire format, as the
//! worker's `model::kv_events` publishes it), and how much of a request's prompt it would
//! serve from there.
//!
//! The router computes a request's block addresses with the engine's own hash chain
//! ([`TokenBlocks`]: the parent's address, the block's token ids, the request's `cache_salt`)
//! from token ids it tokenized as the workers do, so a kvfleet worker's `BlockStored` addresses
//! are looked up directly: salted requests match only blocks stored under the same salt. The
//! index follows the anchor (full-attention) group the worker publishes; for a model with
//! sliding-window layers a hit predicted here is an upper bound, the worker's hybrid rule may
//! take fewer blocks when its window blocks were evicted first.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::time::{Duration, Instant};

use kvfleet_engine::engine::prefix::{CacheKey, TokenBlocks};
use rmpv::Value;

/// One cache change a worker published.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheEvent {
    Stored {
        block_hashes: Vec<u64>,
        block_size: usize,
    },
    Removed {
        block_hashes: Vec<u64>,
    },
    AllCleared,
}

/// Why a KV-event payload could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("not msgpack: {0}")]
    Msgpack(String),
    #[error("a KV-event batch is an array [ts, events, rank]; got {0}")]
    Batch(String),
    #[error("event {index}: {reason}")]
    Event { index: usize, reason: String },
}

/// Decodes one `EventBatch` payload, events as arrays (vLLM up to v0.23) or maps (from
/// vllm-project/vllm#42892 on). Unknown event tags are skipped (a newer publisher may add
/// kinds); block hashes are integers or bytes (the first 8 bytes, big-endian).
pub fn decode_batch(payload: &[u8]) -> Result<Vec<CacheEvent>, DecodeError> {
    let v = rmpv::decode::read_value(&mut &payload[..]).map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    let Value::Array(batch) = v else {
        return Err(DecodeError::Batch(kind(&v).into()));
    };
    let Some(Value::Array(events)) = batch.get(1) else {
        return Err(DecodeError::Batch("no event list in its second field".into()));
    };
    let mut out = Vec::with_capacity(events.len());
    for (index, e) in events.iter().enumerate() {
        let bad = |reason: String| DecodeError::Event { index, reason };
        let (tag, field) = fields(e).map_err(bad)?;
        match tag.as_str() {
            "BlockStored" => {
                let block_hashes = hashes(field("block_hashes", 1)).map_err(bad)?;
                let block_size = field("block_size", 4)
                    .and_then(Value::as_u64)
                    .ok_or_else(|| bad("BlockStored without an integer block_size".into()))?;
                out.push(CacheEvent::Stored {
                    block_hashes,
                    block_size: block_size as usize,
                });
            }
            "BlockRemoved" => out.push(CacheEvent::Removed {
                block_hashes: hashes(field("block_hashes", 1)).map_err(bad)?,
            }),
            "AllBlocksCleared" => out.push(CacheEvent::AllCleared),
            _ => {}
        }
    }
    Ok(out)
}

/// An event's tag and a reader of its fields by name (map form) or position (array form).
#[allow(clippy::type_complexity)]
fn fields<'a>(e: &'a Value) -> Result<(String, Box<dyn Fn(&str, usize) -> Option<&'a Value> + 'a>), String> {
    match e {
        Value::Array(items) => {
            let tag = items
                .first()
                .and_then(Value::as_str)
                .ok_or("an array event without a tag")?;
            Ok((tag.to_string(), Box::new(move |_, i| items.get(i))))
        }
        Value::Map(entries) => {
            let get = move |name: &str| {
                entries
                    .iter()
                    .find(|(k, _)| k.as_str() == Some(name))
                    .map(|(_, v)| v)
            };
            let tag = get("type")
                .and_then(Value::as_str)
                .ok_or("a map event without `type`")?;
            Ok((tag.to_string(), Box::new(move |name, _| get(name))))
        }
        other => Err(format!("an event is an array or a map, not {}", kind(other))),
    }
}

fn hashes(v: Option<&Value>) -> Result<Vec<u64>, String> {
    let Some(Value::Array(items)) = v else {
        return Err("block_hashes is not a list".into());
    };
    items
        .iter()
        .map(|h| match h {
            Value::Integer(i) => i
                .as_u64()
                .or_else(|| i.as_i64().map(|v| v as u64))
                .ok_or_else(|| "a block hash out of range".to_string()),
            Value::Binary(b) => {
                let mut w = [0u8; 8];
                let n = b.len().min(8);
                w[..n].copy_from_slice(&b[..n]);
                Ok(u64::from_be_bytes(w))
            }
            other => Err(format!(
                "a block hash is an integer or bytes, not {}",
                kind(other)
            )),
        })
        .collect()
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Nil => "nil",
        Value::Boolean(_) => "a boolean",
        Value::Integer(_) => "an integer",
        Value::F32(_) | Value::F64(_) => "a float",
        Value::String(_) => "a string",
        Value::Binary(_) => "bytes",
        Value::Array(_) => "an array",
        Value::Map(_) => "a map",
        Value::Ext(..) => "an extension",
    }
}

/// How long a block the router sent a request for counts as held before the worker's event
/// says so (its prefill may take a few seconds under load).
pub const PENDING_FOR: Duration = Duration::from_secs(10);

/// The cached blocks of one worker, by the address its events name.
/// Hashes a block address by itself: addresses are already sha256 (or the publisher's own
/// hash) bits, and SipHash over each of a 4,000-token prompt's 250 blocks, per replica, was
/// a large part of a pick.
#[derive(Default)]
pub struct AddressHasher(u64);

impl Hasher for AddressHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Not reached for u64 keys; a fold keeps any other key usable.
        for b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(*b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

type Addresses<V> = HashMap<u64, V, BuildHasherDefault<AddressHasher>>;

/// Blocks an index holds before the replica's capacity scrape says how large its pool is.
pub const DEFAULT_MAX_BLOCKS: usize = 1 << 18;

/// Blocks an index holds at most whatever a replica reports: 2 Mi blocks (32 Mi tokens at 16 a
/// block; the largest pool a 141 GB GPU gives a 135M-parameter model is under 1 Mi) cost the
/// router some 100 MB, so a replica that reports a larger pool, or a publisher that is not a
/// worker, cannot grow the router past its memory limit.
pub const MAX_BLOCKS: usize = 1 << 21;

/// Blocks kept beyond a replica's pool: its events of a batch may name a block stored before the
/// removal of another one is announced, and a pool of a few blocks needs room to turn over.
pub fn max_blocks_for(pool_blocks: usize) -> usize {
    pool_blocks
        .saturating_add(pool_blocks / 8)
        .saturating_add(1024)
        .min(MAX_BLOCKS)
}

#[derive(Debug)]
pub struct PodIndex {
    /// Each held address with the stamp of its last store (the oldest go first when full).
    blocks: Addresses<u64>,
    /// Addresses in the order they were stored, with their stamps; an entry whose stamp no longer
    /// matches `blocks` (removed, or stored again since) is skipped.
    order: VecDeque<(u64, u64)>,
    stamp: u64,
    /// A replica holds no more blocks than its pool: the index keeps at most this many.
    max_blocks: usize,
    /// Blocks dropped because the index was full (the publisher announced more than its pool).
    pub evicted: u64,
    /// Blocks of prompts the router just sent here, until the worker announces them (or
    /// [`PENDING_FOR`] passes): the requests of a cold prefix that arrive while its first
    /// request is still in prefill follow it instead of splitting the prefix over replicas.
    pending: Addresses<Instant>,
    /// Tokens per block, from the worker's `BlockStored` events.
    block_size: Option<usize>,
    /// Sequence number of the last batch applied.
    last_seq: Option<u64>,
    /// Batches known lost (a sequence gap): the index may miss or keep blocks since.
    pub gaps: u64,
}

impl Default for PodIndex {
    fn default() -> Self {
        PodIndex {
            blocks: Addresses::default(),
            order: VecDeque::new(),
            stamp: 0,
            max_blocks: DEFAULT_MAX_BLOCKS,
            evicted: 0,
            pending: Addresses::default(),
            block_size: None,
            last_seq: None,
            gaps: 0,
        }
    }
}

impl PodIndex {
    /// Holds at most `max` blocks from now on (the oldest go first).
    pub fn set_max_blocks(&mut self, max: usize) {
        self.max_blocks = max.clamp(1, MAX_BLOCKS);
        self.evict();
    }

    pub fn max_blocks(&self) -> usize {
        self.max_blocks
    }

    fn store(&mut self, h: u64) {
        self.stamp += 1;
        self.blocks.insert(h, self.stamp);
        self.order.push_back((h, self.stamp));
        self.evict();
    }

    /// Drops the oldest blocks past the bound, and the order's stale entries once they are most
    /// of it (so that a publisher storing and removing the same blocks forever keeps it small).
    fn evict(&mut self) {
        while self.blocks.len() > self.max_blocks {
            let Some((h, stamp)) = self.order.pop_front() else {
                break;
            };
            if self.blocks.get(&h) == Some(&stamp) {
                self.blocks.remove(&h);
                self.evicted += 1;
            }
        }
        if self.order.len() > 2 * self.blocks.len() + 1024 {
            let blocks = &self.blocks;
            self.order.retain(|(h, stamp)| blocks.get(h) == Some(stamp));
        }
    }

    /// Applies one batch with sequence number `seq` (vLLM numbers each publisher's batches 0,
    /// 1, 2, ...). A gap is counted; the index stays a hint either way, the worker's own
    /// lookup decides what it serves.
    pub fn apply(&mut self, seq: u64, events: Vec<CacheEvent>) {
        if let Some(last) = self.last_seq {
            if seq > last.saturating_add(1) {
                self.gaps += seq - last - 1;
            }
        }
        self.last_seq = Some(seq);
        for e in events {
            match e {
                CacheEvent::Stored {
                    block_hashes,
                    block_size,
                } => {
                    self.block_size = Some(block_size);
                    for h in block_hashes {
                        self.pending.remove(&h);
                        self.store(h);
                    }
                }
                CacheEvent::Removed { block_hashes } => {
                    for h in block_hashes {
                        self.blocks.remove(&h);
                        self.pending.remove(&h);
                    }
                    self.evict();
                }
                CacheEvent::AllCleared => {
                    self.blocks.clear();
                    self.order.clear();
                    self.pending.clear();
                }
            }
        }
    }

    /// Forgets everything (the subscription was lost: the worker may have restarted empty).
    pub fn clear(&mut self) {
        self.blocks.clear();
        self.order.clear();
        self.pending.clear();
        self.last_seq = None;
    }

    /// Records that a prompt with these block addresses was just sent here.
    pub fn expect(&mut self, addresses: &[u64], now: Instant) {
        if self.pending.len() > 65_536 {
            self.pending.retain(|_, at| now.duration_since(*at) < PENDING_FOR);
        }
        for h in addresses {
            if !self.blocks.contains_key(h) {
                self.pending.insert(*h, now);
            }
        }
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Blocks it holds or is computing for requests just sent: how much of the fleet's prefix
    /// cache it carries (a new prefix goes to the replica carrying least, other things equal).
    pub fn held(&self) -> usize {
        self.blocks.len() + self.pending.len()
    }

    pub fn block_size(&self) -> Option<usize> {
        self.block_size
    }

    /// Leading blocks of `addresses` this worker holds or is computing for a request the
    /// router sent it less than [`PENDING_FOR`] ago.
    pub fn leading_hits(&self, addresses: &[u64]) -> usize {
        let now = Instant::now();
        addresses
            .iter()
            .take_while(|h| {
                self.blocks.contains_key(h)
                    || self
                        .pending
                        .get(h)
                        .is_some_and(|at| now.duration_since(*at) < PENDING_FOR)
            })
            .count()
    }
}

/// A request's prompt as the index sees it: its block addresses at one block size.
#[derive(Clone, Debug)]
pub struct PromptBlocks {
    pub prompt_tokens: usize,
    pub block_size: usize,
    pub addresses: Vec<u64>,
}

impl PromptBlocks {
    pub fn new(ids: &[u32], key: CacheKey, block_size: usize) -> Self {
        let blocks = TokenBlocks::new(key, ids, block_size);
        Self {
            prompt_tokens: ids.len(),
            block_size,
            addresses: blocks.hashes.iter().map(|h| h.external()).collect(),
        }
    }

    /// The blocks a worker could serve from cache: whole blocks short of the last prompt token
    /// (whose logits must be computed), as its scheduler counts them.
    pub fn cacheable(&self) -> &[u64] {
        let max_blocks = self.prompt_tokens.saturating_sub(1) / self.block_size;
        &self.addresses[..max_blocks.min(self.addresses.len())]
    }

    /// The prompt tokens a worker holding `index` would take from its cache.
    pub fn cached_tokens(&self, index: &PodIndex) -> usize {
        if index.block_size.is_some_and(|b| b != self.block_size) {
            return 0;
        }
        index.leading_hits(self.cacheable()) * self.block_size
    }
}

#[cfg(test)]
mod tests {
    use kvfleet_engine::engine::prefix::KvEvent;

    use super::*;
    use crate::serving::kv_events::{encode_batch_as, KvEventsFormat, MEDIUM_GPU};

    fn stored(ids: &[u32], bs: usize, key: CacheKey) -> KvEvent {
        let tb = TokenBlocks::new(key, ids, bs);
        KvEvent::Stored {
            block_hashes: tb.hashes.iter().map(|h| h.external()).collect(),
            parent_block_hash: None,
            token_ids: ids[..tb.hashes.len() * bs].to_vec(),
            block_size: bs,
        }
    }

    #[test]
    fn the_workers_own_encoding_decodes_in_both_layouts() {
        let ids: Vec<u32> = (0..40).collect();
        let events = vec![
            stored(&ids, 16, CacheKey::default()),
            KvEvent::Removed {
                block_hashes: vec![7, u64::MAX],
            },
            KvEvent::AllCleared,
        ];
        for format in [KvEventsFormat::Array, KvEventsFormat::Map] {
            let got = decode_batch(&encode_batch_as(1.5, &events, MEDIUM_GPU, format)).unwrap();
            assert_eq!(got.len(), 3, "{format:?}");
            let CacheEvent::Stored {
                block_hashes,
                block_size,
            } = &got[0]
            else {
                panic!("{got:?}")
            };
            assert_eq!((block_hashes.len(), *block_size), (2, 16));
            assert_eq!(
                got[1],
                CacheEvent::Removed {
                    block_hashes: vec![7, u64::MAX]
                }
            );
            assert_eq!(got[2], CacheEvent::AllCleared);
        }
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(
            matches!(decode_batch(b"\x93\x01"), Err(DecodeError::Msgpack(_))),
            "a truncated array"
        );
        let mut buf = Vec::new();
        rmpv::encode::write_value(&mut buf, &Value::from(3)).unwrap();
        assert!(matches!(decode_batch(&buf), Err(DecodeError::Batch(_))));
        let mut buf = Vec::new();
        let ev = Value::Array(vec![Value::from("BlockStored"), Value::from("x")]);
        rmpv::encode::write_value(
            &mut buf,
            &Value::Array(vec![Value::from(0.0), Value::Array(vec![ev])]),
        )
        .unwrap();
        assert!(matches!(
            decode_batch(&buf),
            Err(DecodeError::Event { index: 0, .. })
        ));
    }

    #[test]
    fn a_prompt_hits_the_leading_stored_blocks_short_of_its_last_token() {
        let bs = 4;
        let ids: Vec<u32> = (100..120).collect(); // 5 blocks
        let mut idx = PodIndex::default();
        let KvEvent::Stored { block_hashes, .. } = stored(&ids[..12], bs, CacheKey::default()) else {
            unreachable!()
        };
        idx.apply(
            0,
            vec![CacheEvent::Stored {
                block_hashes: block_hashes.clone(),
                block_size: bs,
            }],
        );
        let p = PromptBlocks::new(&ids, CacheKey::default(), bs);
        assert_eq!(p.cached_tokens(&idx), 12);
        // A prompt of exactly the stored 12 tokens computes its last block: 8 cached.
        let exact = PromptBlocks::new(&ids[..12], CacheKey::default(), bs);
        assert_eq!(exact.cached_tokens(&idx), 8);
        // Another salt never matches; neither does another block size.
        let salted = CacheKey {
            salt: Some("t1".into()),
            adapter: None,
        };
        assert_eq!(PromptBlocks::new(&ids, salted, bs).cached_tokens(&idx), 0);
        assert_eq!(
            PromptBlocks::new(&ids, CacheKey::default(), 2).cached_tokens(&idx),
            0
        );
        // The middle block removed: only the first block leads.
        idx.apply(
            1,
            vec![CacheEvent::Removed {
                block_hashes: vec![block_hashes[1]],
            }],
        );
        assert_eq!(p.cached_tokens(&idx), 4);
        idx.apply(5, vec![CacheEvent::AllCleared]);
        assert_eq!((p.cached_tokens(&idx), idx.gaps), (0, 3));
    }

    #[test]
    fn a_prompt_just_sent_counts_as_held_until_announced_or_stale() {
        let bs = 4;
        let ids: Vec<u32> = (0..20).collect();
        let p = PromptBlocks::new(&ids, CacheKey::default(), bs);
        let mut idx = PodIndex::default();
        let now = Instant::now();
        idx.expect(p.cacheable(), now);
        assert_eq!(p.cached_tokens(&idx), 16, "its 4 cacheable blocks are pending");
        // The worker announces two and evicts one of them: the evicted one breaks the run.
        idx.apply(
            0,
            vec![CacheEvent::Stored {
                block_hashes: p.addresses[..2].to_vec(),
                block_size: bs,
            }],
        );
        idx.apply(
            1,
            vec![CacheEvent::Removed {
                block_hashes: vec![p.addresses[1]],
            }],
        );
        assert_eq!(p.cached_tokens(&idx), 4);
        // Pending blocks expire.
        let mut old = PodIndex::default();
        old.expect(p.cacheable(), now - PENDING_FOR - Duration::from_millis(1));
        assert_eq!(p.cached_tokens(&old), 0);
    }

    #[test]
    fn the_index_keeps_at_most_its_bound_and_drops_the_oldest_blocks_first() {
        let mut idx = PodIndex::default();
        idx.set_max_blocks(100);
        let stored = |from: u64, n: u64| CacheEvent::Stored {
            block_hashes: (from..from + n).collect(),
            block_size: 16,
        };
        // A publisher announcing far more blocks than the pool holds.
        for b in 0..1_000u64 {
            idx.apply(b, vec![stored(b * 50, 50)]);
        }
        assert_eq!(idx.len(), 100);
        assert_eq!(idx.evicted, 49_900);
        assert_eq!(idx.leading_hits(&[49_900, 49_901]), 2, "the newest stay");
        assert_eq!(idx.leading_hits(&[0]), 0, "the oldest went");
        assert!(idx.order.len() <= 2 * idx.len() + 1024, "{}", idx.order.len());
        // A block stored again is young again.
        idx.apply(1_000, vec![stored(49_900, 1), stored(60_000, 99)]);
        assert_eq!(idx.leading_hits(&[49_900]), 1);
        assert_eq!(idx.leading_hits(&[49_901]), 0);
        // Stored and removed over and over: the order does not grow.
        for seq in 1_001..3_000u64 {
            idx.apply(
                seq,
                vec![
                    stored(1 << 40, 10),
                    CacheEvent::Removed {
                        block_hashes: ((1u64 << 40)..(1 << 40) + 10).collect(),
                    },
                ],
            );
        }
        assert!(idx.order.len() <= 2 * idx.len() + 1024, "{}", idx.order.len());
        // A smaller pool reported later shrinks it at once.
        idx.set_max_blocks(10);
        assert_eq!(idx.len(), 10);
    }
}
