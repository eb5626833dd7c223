//! The router's subscription to each replica's KV events: a bounded ZMTP SUB connection
//! ([`crate::serving::zmtp::subscriber`]), reconnected with backoff, whose batches feed the
//! replica's prefix index. Whatever a publisher sends, a bad frame ends the connection and a bad
//! batch is dropped, each counted in `kvfleet_router_kv_events_rejected_total{reason}`; neither
//! ends the router.

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use crate::serving::zmtp::subscriber::Subscription;
use crate::serving::zmtp::ZmtpError;

use super::index::{decode_batch, PodIndex};
use super::metrics::RouterMetrics;

/// The first wait before reconnecting, doubled after each failure up to [`BACKOFF_MAX`] and
/// reset by a completed handshake.
pub const BACKOFF_MIN: Duration = Duration::from_millis(200);
pub const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// How deep a batch's msgpack may nest: a batch is `[ts, [event, ...], rank]`, an event an
/// array or map of scalars and lists (4 levels); anything deeper is not vLLM's.
pub const MAX_BATCH_DEPTH: usize = 8;

/// The most msgpack values a batch may hold: a decoded value takes some 40 bytes, so this
/// bounds what one batch can become in memory (about 40 MiB) whatever its bytes claim. A
/// step's batch holds a value per token id and block hash it stores, at most a few hundred
/// thousand.
pub const MAX_BATCH_VALUES: usize = 1 << 20;

/// Why a message was dropped: its shape, before its events are read.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum BatchError {
    #[error("a KV-event message has 3 frames (topic, sequence, payload); this one has {0}")]
    Frames(usize),
    #[error("the sequence frame is 8 bytes; this one is {0}")]
    Sequence(usize),
    #[error("the payload is not a bounded msgpack value: {0}")]
    Msgpack(&'static str),
    #[error("{0}")]
    Decode(String),
}

impl BatchError {
    fn reason(&self) -> &'static str {
        match self {
            Self::Frames(_) => "frames",
            Self::Sequence(_) => "sequence",
            Self::Msgpack(_) => "msgpack",
            Self::Decode(_) => "batch",
        }
    }

    /// Every `reason` label this module counts, ZMTP's included.
    pub fn reasons() -> impl Iterator<Item = &'static str> {
        ["frames", "sequence", "msgpack", "batch"]
            .into_iter()
            .chain(ZmtpError::REASONS)
    }
}

/// What a subscription feeds: one replica's prefix index, and whether its events arrive.
pub trait Replica: Send + Sync + 'static {
    fn name(&self) -> &str;
    fn index(&self) -> &Mutex<PodIndex>;
    fn set_subscribed(&self, subscribed: bool);
}

/// Follows one replica's KV events until the replica goes; a lost subscription clears its
/// index (the worker may have restarted empty) and reconnects.
pub async fn subscribe<R: Replica>(u: Weak<R>, endpoint: String, metrics: Arc<RouterMetrics>) {
    // Every reason exists at zero from the first scrape.
    for reason in BatchError::reasons() {
        metrics.kv_events_rejected.with_label_values(&[reason]);
    }
    let mut backoff = BACKOFF_MIN;
    loop {
        if u.strong_count() == 0 {
            return;
        }
        let mut subscription = match Subscription::connect(&endpoint, b"").await {
            Ok(s) => s,
            Err(error) => {
                count(&metrics, &error);
                tracing::debug!(%endpoint, %error, "KV events: cannot subscribe yet");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(BACKOFF_MAX);
                continue;
            }
        };
        backoff = BACKOFF_MIN;
        match u.upgrade() {
            Some(u) => u.set_subscribed(true),
            None => return,
        }
        let mut dropped = 0u64;
        let error = loop {
            let frames = match subscription.recv().await {
                Ok(f) => f,
                Err(error) => break error,
            };
            let Some(u) = u.upgrade() else { return };
            if let Err(error) = apply_message(&*u, &frames, &metrics) {
                metrics
                    .kv_events_rejected
                    .with_label_values(&[error.reason()])
                    .inc();
                dropped += 1;
                if dropped.is_power_of_two() {
                    tracing::warn!(replica = %u.name(), %error, dropped, "KV events: dropped a batch");
                }
            }
        };
        count(&metrics, &error);
        tracing::info!(%endpoint, %error, "KV events: subscription lost; reconnecting");
        if let Some(u) = u.upgrade() {
            u.set_subscribed(false);
            if let Ok(mut idx) = u.index().lock() {
                idx.clear();
            }
        }
        tokio::time::sleep(backoff).await;
    }
}

fn count(metrics: &RouterMetrics, error: &ZmtpError) {
    if let Some(reason) = error.reason() {
        metrics.kv_events_rejected.with_label_values(&[reason]).inc();
    }
}

/// Applies one message (`[topic, sequence, payload]`) to the replica's index.
pub fn apply_message<R: Replica>(
    u: &R,
    frames: &[Vec<u8>],
    metrics: &RouterMetrics,
) -> Result<(), BatchError> {
    let [_, seq, payload] = frames else {
        return Err(BatchError::Frames(frames.len()));
    };
    let seq = <[u8; 8]>::try_from(seq.as_slice())
        .map(u64::from_be_bytes)
        .map_err(|_| BatchError::Sequence(seq.len()))?;
    check_msgpack(payload).map_err(BatchError::Msgpack)?;
    let events = decode_batch(payload).map_err(|e| BatchError::Decode(e.to_string()))?;
    if let Ok(mut idx) = u.index().lock() {
        let before = idx.gaps;
        idx.apply(seq, events);
        metrics.kv_event_gaps.inc_by(idx.gaps.saturating_sub(before));
    }
    metrics.kv_event_batches.inc();
    Ok(())
}

/// Walks one msgpack value without building it: refuses nesting deeper than
/// [`MAX_BATCH_DEPTH`], more than [`MAX_BATCH_VALUES`] values and lengths past the end, so that
/// decoding what passes takes bounded stack and memory.
pub fn check_msgpack(bytes: &[u8]) -> Result<(), &'static str> {
    let mut at = 0usize;
    // Values still to read at each open level.
    let mut open: Vec<u64> = vec![1];
    let mut values = 0usize;
    let take = |at: &mut usize, n: usize| -> Result<u64, &'static str> {
        let end = at
            .checked_add(n)
            .filter(|&e| e <= bytes.len())
            .ok_or("truncated")?;
        let v = bytes[*at..end].iter().fold(0u64, |v, &b| (v << 8) | u64::from(b));
        *at = end;
        Ok(v)
    };
    while let Some(left) = open.last_mut() {
        if *left == 0 {
            open.pop();
            continue;
        }
        *left -= 1;
        values += 1;
        if values > MAX_BATCH_VALUES {
            return Err("too many values");
        }
        let marker = take(&mut at, 1)? as u8;
        // (bytes of the length, bytes of data besides it, items it opens per length unit)
        let (skip, items): (u64, u64) = match marker {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => (0, 0),
            0x80..=0x8f => (0, 2 * u64::from(marker & 0x0f)),
            0x90..=0x9f => (0, u64::from(marker & 0x0f)),
            0xa0..=0xbf => (u64::from(marker & 0x1f), 0),
            0xc4 | 0xd9 => (take(&mut at, 1)?, 0),
            0xc5 | 0xda => (take(&mut at, 2)?, 0),
            0xc6 | 0xdb => (take(&mut at, 4)?, 0),
            0xc7 => (take(&mut at, 1)? + 1, 0),
            0xc8 => (take(&mut at, 2)? + 1, 0),
            0xc9 => (take(&mut at, 4)? + 1, 0),
            0xca => (4, 0),
            0xcb => (8, 0),
            0xcc | 0xd0 => (1, 0),
            0xcd | 0xd1 => (2, 0),
            0xce | 0xd2 => (4, 0),
            0xcf | 0xd3 => (8, 0),
            0xd4 => (2, 0),
            0xd5 => (3, 0),
            0xd6 => (5, 0),
            0xd7 => (9, 0),
            0xd8 => (17, 0),
            0xdc => (0, take(&mut at, 2)?),
            0xdd => (0, take(&mut at, 4)?),
            0xde => (0, 2 * take(&mut at, 2)?),
            0xdf => (0, 2 * take(&mut at, 4)?),
            0xc1 => return Err("the never-used marker 0xc1"),
        };
        take(&mut at, usize::try_from(skip).map_err(|_| "truncated")?)?;
        if items > 0 {
            // Each value takes at least a byte: a count past the bytes left is a lie.
            if items > (bytes.len() - at) as u64 {
                return Err("truncated");
            }
            if open.len() >= MAX_BATCH_DEPTH {
                return Err("nested too deep");
            }
            open.push(items);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_of_vllms_shape_passes_the_walk() {
        let events = vec![kvfleet_engine::engine::prefix::KvEvent::Removed {
            block_hashes: vec![1, u64::MAX],
        }];
        for format in [
            crate::serving::kv_events::KvEventsFormat::Array,
            crate::serving::kv_events::KvEventsFormat::Map,
        ] {
            let b = crate::serving::kv_events::encode_batch_as(1.5, &events, "GPU", format);
            assert_eq!(check_msgpack(&b), Ok(()));
        }
    }

    #[test]
    fn nesting_lies_and_floods_are_refused_before_decoding() {
        // 10,000 nested one-element arrays: rmpv would recurse 1,024 deep before refusing.
        let mut deep = vec![0x91u8; 10_000];
        deep.push(0xc0);
        assert_eq!(check_msgpack(&deep), Err("nested too deep"));
        // An array announcing 2^32-1 items in five bytes.
        assert_eq!(check_msgpack(&[0xdd, 0xff, 0xff, 0xff, 0xff]), Err("truncated"));
        // A string announcing 4 GiB.
        assert_eq!(
            check_msgpack(&[0xdb, 0xff, 0xff, 0xff, 0xff, b'a']),
            Err("truncated")
        );
        // 2 M nils in one array: 80 MB as decoded values.
        let mut flood = vec![0xdd, 0x00, 0x20, 0x00, 0x00];
        flood.extend(std::iter::repeat_n(0xc0, 2 << 20));
        assert_eq!(check_msgpack(&flood), Err("too many values"));
        assert_eq!(check_msgpack(&[0xc1]), Err("the never-used marker 0xc1"));
        assert_eq!(check_msgpack(&[]), Err("truncated"));
    }
}
