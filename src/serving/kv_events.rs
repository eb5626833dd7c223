//! KV events in vLLM's wire format: a ZeroMQ PUB socket that tells KV-aware routers (llm-d's
//! precise-prefix scorer, Dynamo's KV router) which blocks the prefix cache holds, the way a vLLM
//! engine started with `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
//! "endpoint": "tcp://*:5557", "topic": ...}'` does, so that they subscribe to a worker unchanged.
//!
//! The format, as read (not copied) from vllm-project/vllm:
//! - `vllm/distributed/kv_events.py` at b4e69e0af33f4698e157a262cc787fe61983cd3d (the ZeroMQ
//!   publisher: framing, sequence numbers, PUB socket, replay) and at
//!   0181ea3173e53eea8cf04a86891488e3dc89bb34 (today's fields: `lora_name`, `extra_keys`,
//!   `group_idx`, `kv_cache_spec_*`);
//! - `examples/online_serving/kv_events_subscriber.py` at
//!   0ef0f42653bc5a0c7c44d26ce3a161e692b07a2c, the subscriber routers are modelled on;
//! - vllm-project/vllm#42892 (merged June 2026), which took `array_like=True` off the events,
//!   not off the batch: v0.23.0 still sends arrays, v0.26.0 sends maps.
//!
//! The wire:
//! - one ZeroMQ message per batch, three frames: the topic (UTF-8; vLLM's default is empty,
//!   llm-d uses `kv@<pod>@<model>` and subscribes by prefix), the sequence number as 8
//!   big-endian bytes (0, 1, 2, ... for each publisher), and the msgpack payload;
//! - the payload is vLLM's `EventBatch` (a msgspec struct, `array_like=True`): the array
//!   `[ts, events, data_parallel_rank]`, `ts` a float64 of Unix seconds, the rank 0 on a
//!   single-rank engine (vLLM's publisher writes its own rank into every batch);
//! - each event is a msgspec struct with `tag=True`, its tag the class name: `BlockStored`
//!   (block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, then
//!   fields that have defaults: extra_keys, group_idx, kv_cache_spec_kind,
//!   kv_cache_spec_sliding_window), `BlockRemoved` (block_hashes, medium, then group_idx) and
//!   `AllBlocksCleared` (none). Up to vLLM v0.23 an event is an array, the tag first and the
//!   fields in that order ([`KvEventsFormat::Array`]); from #42892 on it is a map with the tag
//!   under `"type"` and the fields by name, those at their default left out
//!   ([`KvEventsFormat::Map`]). llm-d (llm-d-kv-cache#661) and Dynamo read both, and routers
//!   built before #42892 read only the array, so the array is the default here; a subscriber
//!   that decodes with vLLM's current msgspec types needs the map. The array carries the
//!   fields up to `lora_name`, vLLM v0.15's layout: readers take the later fields, which have
//!   defaults, as optional;
//! - block hashes are vLLM's `ExternalBlockHash` (`bytes | int`); with vLLM's default
//!   `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1` an unsigned 64-bit integer, as here
//!   (`BlockHash::external`). Routers such as llm-d's key their index on the token ids.
//!
//! Where this differs from vLLM's `ZmqEventPublisher`: the endpoint is always bound (vLLM
//! connects out when it has neither `*` nor `::`, for a router that binds); there is no replay
//! socket (vLLM's optional ROUTER on `replay_endpoint` answers an 8-byte big-endian start
//! sequence with `[seq, payload]` replies and an end marker of sequence -1); and a full queue
//! drops a batch instead of blocking the engine, the dropped batch still taking its sequence
//! number so that subscribers see the gap.
//!
//! The socket is our bounded ZMTP 3.0 PUB ([`super::zmtp::publisher`]): connection,
//! subscription, frame and send-queue limits, a handshake deadline, and every rejected input
//! counted in `kvfleet_kv_events_rejected_total{reason}`.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, ToSocketAddrs};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use kvfleet_engine::engine::prefix::KvEvent;
use tokio::sync::mpsc;

use super::zmtp::publisher::{Counters, Publisher};

/// vLLM's `medium` for blocks in GPU memory.
pub const MEDIUM_GPU: &str = "GPU";
/// vLLM's `medium` for blocks offloaded to host memory.
pub const MEDIUM_CPU: &str = "CPU";

/// Batches waiting for the sender thread (vLLM's `max_queue_size` default); past this,
/// [`KvEventPublisher::publish`] drops.
const QUEUE_BATCHES: usize = 100_000;

/// How each event of a batch is laid out; the batch itself is an array either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvEventsFormat {
    /// vLLM up to v0.23 (`array_like=True`): `["BlockStored", block_hashes, ...]`.
    #[default]
    Array,
    /// vLLM from #42892 on (v0.26 does): `{"type": "BlockStored", "block_hashes": ..., ...}`.
    Map,
}

impl FromStr for KvEventsFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "array" => Ok(Self::Array),
            "map" => Ok(Self::Map),
            _ => Err(format!(
                "unknown KV events format {s:?}: use \"array\" (vLLM up to v0.23, read by most routers) \
                 or \"map\" (vLLM from #42892 on, e.g. v0.26)"
            )),
        }
    }
}

impl std::fmt::Display for KvEventsFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Array => "array",
            Self::Map => "map",
        })
    }
}

/// Why the publisher could not start.
#[derive(Debug, thiserror::Error)]
pub enum KvEventsError {
    #[error(
        "the KV events endpoint {endpoint:?} is not usable: {reason}; give one such as tcp://*:5557 \
         (the syntax of vLLM's --kv-events-config) with --kv-events-endpoint"
    )]
    Endpoint { endpoint: String, reason: String },
    #[error(
        "cannot bind the KV events endpoint {endpoint}: address in use; choose another port with \
         --kv-events-endpoint"
    )]
    AddressInUse { endpoint: String },
    #[error(
        "cannot bind the KV events endpoint {endpoint}: {source}; the worker binds this address \
         and never connects out (vLLM connects when the host is neither * nor ::): give a local \
         address such as tcp://*:5557 with --kv-events-endpoint and let the router subscribe to it"
    )]
    Bind {
        endpoint: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start the KV events publisher: {0}")]
    Start(String),
}

/// Publishes the prefix cache's [`KvEvent`]s on a ZeroMQ PUB socket in vLLM's format.
///
/// A thread of its own, with a single-threaded tokio runtime, owns the socket; [`publish`]
/// only queues. Dropping the publisher ends the thread and closes the socket.
///
/// [`publish`]: KvEventPublisher::publish
pub struct KvEventPublisher {
    queue: mpsc::Sender<(f64, Vec<KvEvent>)>,
    /// Batches dropped and not yet accounted for in the sequence numbers; the sender skips them.
    gap: Arc<AtomicU64>,
    dropped: AtomicU64,
    local_addr: String,
}

impl KvEventPublisher {
    /// Binds `endpoint` (e.g. "tcp://*:5557") and starts the sender (a thread or tokio task).
    pub fn start(endpoint: &str, topic: String, medium: &'static str) -> Result<Self, KvEventsError> {
        Self::start_with_format(endpoint, topic, medium, KvEventsFormat::default())
    }

    /// [`start`](Self::start), with the events laid out as `format`.
    pub fn start_with_format(
        endpoint: &str,
        topic: String,
        medium: &'static str,
        format: KvEventsFormat,
    ) -> Result<Self, KvEventsError> {
        Self::start_counted(endpoint, topic, medium, format, Counters::detached())
    }

    /// [`start_with_format`](Self::start_with_format), counting rejected connections and
    /// dropped messages in `counters` (the worker's metrics).
    pub fn start_counted(
        endpoint: &str,
        topic: String,
        medium: &'static str,
        format: KvEventsFormat,
        counters: Counters,
    ) -> Result<Self, KvEventsError> {
        let listener = bind(endpoint)?;
        let addr = listener.local_addr().map_err(|source| KvEventsError::Bind {
            endpoint: endpoint.to_string(),
            source,
        })?;
        let (queue, batches) = mpsc::channel(QUEUE_BATCHES);
        let gap = Arc::new(AtomicU64::new(0));
        let sender = Sender {
            topic: topic.into_bytes(),
            medium,
            format,
            gap: Arc::clone(&gap),
            counters,
        };
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
        std::thread::Builder::new()
            .name("kv-events".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = ready_tx.send(Err(format!("cannot build its tokio runtime: {e}")));
                        return;
                    }
                };
                runtime.block_on(sender.run(listener, batches, ready_tx));
            })
            .map_err(|e| KvEventsError::Start(format!("cannot spawn its thread: {e}")))?;
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(KvEventsError::Start(e)),
            Err(_) => {
                return Err(KvEventsError::Start(
                    "its thread ended before the socket was ready".into(),
                ))
            }
        }
        tracing::info!(endpoint, %addr, %format, "publishing KV events in vLLM's format");
        Ok(Self {
            queue,
            gap,
            dropped: AtomicU64::new(0),
            local_addr: format!("tcp://{addr}"),
        })
    }

    /// Queues one batch (never blocks the serving loop; drops and counts on a full queue).
    pub fn publish(&self, events: Vec<KvEvent>) {
        if events.is_empty() {
            return;
        }
        if self.queue.try_send((unix_now(), events)).is_err() {
            self.gap.fetch_add(1, Ordering::Relaxed);
            let dropped = self.dropped.fetch_add(1, Ordering::Relaxed) + 1;
            if dropped.is_power_of_two() {
                tracing::warn!(
                    dropped,
                    "KV events queue full (or its thread gone): dropped a batch; routers see a \
                     gap in the sequence numbers and their view of this worker's cache is stale"
                );
            }
        }
    }

    /// The bound address (the real port when 0 was asked), for tests.
    pub fn local_addr(&self) -> String {
        self.local_addr.clone()
    }

    /// Batches [`publish`](Self::publish) has dropped so far.
    pub fn dropped_batches(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

/// The sender thread's half.
struct Sender {
    topic: Vec<u8>,
    medium: &'static str,
    format: KvEventsFormat,
    gap: Arc<AtomicU64>,
    counters: Counters,
}

impl Sender {
    async fn run(
        self,
        listener: TcpListener,
        mut batches: mpsc::Receiver<(f64, Vec<KvEvent>)>,
        ready: std::sync::mpsc::SyncSender<Result<(), String>>,
    ) {
        // The connections are tasks of the runtime this runs in: this thread's.
        let listener = match listener
            .set_nonblocking(true)
            .and_then(|()| tokio::net::TcpListener::from_std(listener))
        {
            Ok(l) => l,
            Err(e) => {
                let _ = ready.send(Err(format!("cannot accept on the bound address: {e}")));
                return;
            }
        };
        let socket = Publisher::new(self.counters.clone());
        let accepting = tokio::spawn(Arc::clone(&socket).serve(listener));
        let _ = ready.send(Ok(()));
        let mut seq: u64 = 0;
        while let Some((ts, events)) = batches.recv().await {
            seq += self.gap.swap(0, Ordering::Relaxed);
            let payload = encode_batch_as(ts, &events, self.medium, self.format);
            // A PUB socket drops what no subscriber takes, and what a slow one has no room for.
            socket.send(&[&self.topic, &seq.to_be_bytes(), &payload]);
            seq += 1;
        }
        accepting.abort();
    }
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// The addresses `endpoint` (`tcp://HOST:PORT`, HOST `*` for every IPv4 interface, an IP
/// address, `[IPv6]` or a name) stands for.
fn bind_addrs(endpoint: &str) -> Result<Vec<SocketAddr>, KvEventsError> {
    let bad = |reason: String| KvEventsError::Endpoint {
        endpoint: endpoint.to_string(),
        reason,
    };
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| bad("only tcp:// endpoints are supported".into()))?;
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| bad("it has no :PORT".into()))?;
    let port: u16 = port
        .parse()
        .map_err(|_| bad(format!("{port:?} is not a port number")))?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if host.is_empty() {
        return Err(bad("it has no host: use * for every interface".into()));
    }
    if host == "*" {
        return Ok(vec![SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port)]);
    }
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| bad(format!("cannot resolve {host:?}: {e}")))?
        .collect();
    if addrs.is_empty() {
        return Err(bad(format!("{host:?} resolves to no address")));
    }
    Ok(addrs)
}

fn bind(endpoint: &str) -> Result<TcpListener, KvEventsError> {
    let mut last = None;
    for addr in bind_addrs(endpoint)? {
        match TcpListener::bind(addr) {
            Ok(listener) => return Ok(listener),
            Err(e) => last = Some(e),
        }
    }
    let source = last.expect("bind_addrs returns at least one address");
    Err(if source.kind() == std::io::ErrorKind::AddrInUse {
        KvEventsError::AddressInUse {
            endpoint: endpoint.to_string(),
        }
    } else {
        KvEventsError::Bind {
            endpoint: endpoint.to_string(),
            source,
        }
    })
}

/// One batch as vLLM's msgpack payload, its events laid out as vLLM up to v0.23 lays them out
/// ([`KvEventsFormat::Array`]): `[ts, [event, ...], 0]`.
pub fn encode_batch(ts: f64, events: &[KvEvent], medium: &str) -> Vec<u8> {
    encode_batch_as(ts, events, medium, KvEventsFormat::Array)
}

/// [`encode_batch`] with the events laid out as `format`.
pub fn encode_batch_as(ts: f64, events: &[KvEvent], medium: &str, format: KvEventsFormat) -> Vec<u8> {
    let mut w = Vec::with_capacity(32 + events.len() * 64);
    array_len(&mut w, 3);
    rmp::encode::write_f64(&mut w, ts).expect("writing to a Vec");
    array_len(&mut w, events.len());
    for event in events {
        encode_event(&mut w, event, medium, format);
    }
    // data_parallel_rank: vLLM's publisher fills in its rank, 0 with one rank.
    uint(&mut w, 0);
    w
}

fn encode_event(w: &mut Vec<u8>, event: &KvEvent, medium: &str, format: KvEventsFormat) {
    match event {
        KvEvent::Stored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
        } => {
            let mut e = Event::begin(w, format, "BlockStored", 7);
            e.field("block_hashes");
            uints(e.w, block_hashes.iter().copied());
            e.field("parent_block_hash");
            match parent_block_hash {
                Some(h) => uint(e.w, *h),
                None => nil(e.w),
            }
            e.field("token_ids");
            uints(e.w, token_ids.iter().map(|&t| u64::from(t)));
            e.field("block_size");
            uint(e.w, *block_size as u64);
            e.field("lora_id");
            nil(e.w);
            e.field("medium");
            string(e.w, medium);
            e.field("lora_name");
            nil(e.w);
        }
        KvEvent::Removed { block_hashes } => {
            let mut e = Event::begin(w, format, "BlockRemoved", 2);
            e.field("block_hashes");
            uints(e.w, block_hashes.iter().copied());
            e.field("medium");
            string(e.w, medium);
        }
        KvEvent::AllCleared => {
            Event::begin(w, format, "AllBlocksCleared", 0);
        }
    }
}

/// A tagged msgspec struct being written: an array that starts with the tag, or a map that
/// starts with `"type": tag`, its fields named.
struct Event<'a> {
    w: &'a mut Vec<u8>,
    named: bool,
}

impl<'a> Event<'a> {
    fn begin(w: &'a mut Vec<u8>, format: KvEventsFormat, tag: &str, fields: u32) -> Self {
        let named = format == KvEventsFormat::Map;
        if named {
            rmp::encode::write_map_len(w, fields + 1).expect("writing to a Vec");
            string(w, "type");
        } else {
            rmp::encode::write_array_len(w, fields + 1).expect("writing to a Vec");
        }
        string(w, tag);
        Self { w, named }
    }

    fn field(&mut self, name: &str) {
        if self.named {
            string(self.w, name);
        }
    }
}

fn array_len(w: &mut Vec<u8>, len: usize) {
    let len = u32::try_from(len).expect("a msgpack array holds at most 2^32-1 items");
    rmp::encode::write_array_len(w, len).expect("writing to a Vec");
}

fn uints(w: &mut Vec<u8>, values: impl ExactSizeIterator<Item = u64>) {
    array_len(w, values.len());
    for v in values {
        uint(w, v);
    }
}

fn uint(w: &mut Vec<u8>, v: u64) {
    rmp::encode::write_uint(w, v).expect("writing to a Vec");
}

fn nil(w: &mut Vec<u8>) {
    rmp::encode::write_nil(w).expect("writing to a Vec");
}

fn string(w: &mut Vec<u8>, s: &str) {
    rmp::encode::write_str(w, s).expect("writing to a Vec");
}

#[cfg(test)]
mod tests {
    use super::*;
    use rmpv::Value;
    use std::path::PathBuf;
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    /// 15760518052499183552 needs all 64 bits (msgpack uint64); the tokens span every msgpack
    /// integer width a vocabulary reaches.
    const H: u64 = 15_760_518_052_499_183_552;

    fn sample() -> Vec<KvEvent> {
        vec![
            KvEvent::Stored {
                block_hashes: vec![H, 7],
                parent_block_hash: None,
                token_ids: vec![128_000, 9125, 0, 127, 128, 255, 256, 65_536],
                block_size: 4,
            },
            KvEvent::Stored {
                block_hashes: vec![42],
                parent_block_hash: Some(7),
                token_ids: vec![1, 2, 3, 4],
                block_size: 4,
            },
            KvEvent::Removed {
                block_hashes: vec![H, 42],
            },
            KvEvent::AllCleared,
        ]
    }

    /// What msgspec 0.22 writes for `sample()` at ts 1757500000.25, rank 0, medium "GPU", with
    /// vLLM's structs: v0.15's (`array_like=True`, `BlockStored` up to `lora_name`) and, for
    /// the map, today's (all fields, `omit_defaults=True`), encoded by
    /// `msgspec.msgpack.encode(EventBatch(ts=..., events=[...], data_parallel_rank=0))`.
    const MSGSPEC_ARRAY: &str = "93cb41da3054981000009498ab426c6f636b53746f72656492cfdab89baa7b5857c007c098ce0001f400cd23a5007fcc80ccffcd0100ce0001000004c0a3475055c098ab426c6f636b53746f726564912a07940102030404c0a3475055c093ac426c6f636b52656d6f76656492cfdab89baa7b5857c02aa347505591b0416c6c426c6f636b73436c656172656400";
    const MSGSPEC_MAP: &str = "93cb41da3054981000009488a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cfdab89baa7b5857c007b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647398ce0001f400cd23a5007fcc80ccffcd0100ce00010000aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c088a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573912ab1706172656e745f626c6f636b5f6861736807a9746f6b656e5f6964739401020304aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c083a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657392cfdab89baa7b5857c02aa66d656469756da347505581a474797065b0416c6c426c6f636b73436c656172656400";

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn decode(bytes: &[u8]) -> Value {
        let mut r = bytes;
        let v = rmpv::decode::read_value(&mut r).expect("valid msgpack");
        assert!(r.is_empty(), "{} bytes after the batch", r.len());
        v
    }

    fn u(v: u64) -> Value {
        Value::from(v)
    }

    fn s(v: &str) -> Value {
        Value::from(v)
    }

    fn arr(v: Vec<Value>) -> Value {
        Value::Array(v)
    }

    #[test]
    fn array_layout_is_vllms_tagged_arrays_in_field_order() {
        let batch = decode(&encode_batch(1_757_500_000.25, &sample(), "GPU"));
        let want = arr(vec![
            Value::F64(1_757_500_000.25),
            arr(vec![
                arr(vec![
                    s("BlockStored"),
                    arr(vec![u(H), u(7)]),
                    Value::Nil,
                    arr([128_000, 9125, 0, 127, 128, 255, 256, 65_536].map(u).to_vec()),
                    u(4),
                    Value::Nil,
                    s("GPU"),
                    Value::Nil,
                ]),
                arr(vec![
                    s("BlockStored"),
                    arr(vec![u(42)]),
                    u(7),
                    arr([1, 2, 3, 4].map(u).to_vec()),
                    u(4),
                    Value::Nil,
                    s("GPU"),
                    Value::Nil,
                ]),
                arr(vec![s("BlockRemoved"), arr(vec![u(H), u(42)]), s("GPU")]),
                arr(vec![s("AllBlocksCleared")]),
            ]),
            u(0),
        ]);
        assert_eq!(batch, want);
    }

    #[test]
    fn map_layout_names_the_fields_with_the_tag_under_type() {
        let bytes = encode_batch_as(2.5, &sample(), "CPU", KvEventsFormat::Map);
        let batch = decode(&bytes);
        let Value::Array(parts) = &batch else {
            panic!("batch is not an array: {batch}")
        };
        assert_eq!(parts.len(), 3);
        assert_eq!(parts[0], Value::F64(2.5));
        assert_eq!(parts[2], u(0));
        let Value::Array(events) = &parts[1] else {
            panic!("events are not an array: {batch}")
        };
        let keys = |e: &Value| -> Vec<String> {
            e.as_map()
                .expect("a map")
                .iter()
                .map(|(k, _)| k.as_str().expect("string keys").to_string())
                .collect()
        };
        assert_eq!(
            keys(&events[0]),
            [
                "type",
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
                "lora_name"
            ]
        );
        assert_eq!(keys(&events[2]), ["type", "block_hashes", "medium"]);
        assert_eq!(keys(&events[3]), ["type"]);
        let get = |e: &Value, k: &str| -> Value {
            e.as_map()
                .unwrap()
                .iter()
                .find(|(key, _)| key.as_str() == Some(k))
                .map(|(_, v)| v.clone())
                .unwrap()
        };
        assert_eq!(get(&events[0], "type"), s("BlockStored"));
        assert_eq!(get(&events[1], "parent_block_hash"), u(7));
        assert_eq!(get(&events[2], "type"), s("BlockRemoved"));
        assert_eq!(get(&events[2], "medium"), s("CPU"));
        assert_eq!(get(&events[3], "type"), s("AllBlocksCleared"));
    }

    #[test]
    fn bytes_equal_what_msgspec_writes_for_vllms_structs() {
        let ts = 1_757_500_000.25;
        assert_eq!(hex(&encode_batch(ts, &sample(), "GPU")), MSGSPEC_ARRAY);
        assert_eq!(
            hex(&encode_batch_as(ts, &sample(), "GPU", KvEventsFormat::Map)),
            MSGSPEC_MAP
        );
    }

    #[test]
    fn an_empty_batch_is_still_a_batch() {
        assert_eq!(
            decode(&encode_batch(1.0, &[], "GPU")),
            arr(vec![Value::F64(1.0), arr(vec![]), u(0)])
        );
    }

    #[test]
    fn endpoints_take_vllms_syntax() {
        let v4 = |a: [u8; 4], p| vec![SocketAddr::from((a, p))];
        assert_eq!(bind_addrs("tcp://*:5557").unwrap(), v4([0, 0, 0, 0], 5557));
        assert_eq!(bind_addrs("tcp://127.0.0.1:0").unwrap(), v4([127, 0, 0, 1], 0));
        assert_eq!(
            bind_addrs("tcp://[::]:5557").unwrap(),
            vec!["[::]:5557".parse::<SocketAddr>().unwrap()]
        );
        for (bad, why) in [
            ("ipc:///tmp/kv", "only tcp://"),
            ("tcp://*", "no :PORT"),
            ("tcp://*:port", "not a port number"),
            ("tcp://*:70000", "not a port number"),
            ("tcp://:5557", "no host"),
        ] {
            let e = bind_addrs(bad).unwrap_err();
            let msg = e.to_string();
            assert!(matches!(e, KvEventsError::Endpoint { .. }), "{bad}: {msg}");
            assert!(
                msg.contains(why) && msg.contains("--kv-events-endpoint"),
                "{bad}: {msg}"
            );
        }
    }

    #[test]
    fn a_port_in_use_says_to_choose_another() {
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("tcp://127.0.0.1:{}", taken.local_addr().unwrap().port());
        let Err(e) = KvEventPublisher::start(&endpoint, String::new(), MEDIUM_GPU) else {
            panic!("bound a port in use")
        };
        assert!(matches!(e, KvEventsError::AddressInUse { .. }), "{e}");
        assert_eq!(
            e.to_string(),
            format!(
                "cannot bind the KV events endpoint {endpoint}: address in use; choose another port \
                 with --kv-events-endpoint"
            )
        );
    }

    #[test]
    fn formats_parse_from_their_names() {
        assert_eq!("array".parse::<KvEventsFormat>(), Ok(KvEventsFormat::Array));
        assert_eq!("map".parse::<KvEventsFormat>(), Ok(KvEventsFormat::Map));
        assert_eq!(KvEventsFormat::Map.to_string(), "map");
        assert!("msgpack"
            .parse::<KvEventsFormat>()
            .unwrap_err()
            .contains("\"array\""));
    }

    #[tokio::test]
    async fn starts_inside_a_tokio_runtime_and_reports_the_real_port() {
        let publisher = KvEventPublisher::start("tcp://127.0.0.1:0", "t".into(), MEDIUM_GPU).unwrap();
        let addr = publisher.local_addr();
        let port: u16 = addr.strip_prefix("tcp://127.0.0.1:").unwrap().parse().unwrap();
        assert_ne!(port, 0);
        // Nobody subscribes: batches go nowhere, and nothing blocks.
        for _ in 0..1000 {
            publisher.publish(sample());
        }
        publisher.publish(Vec::new());
        assert_eq!(publisher.dropped_batches(), 0);
    }

    // --- A real client: pyzmq SUB and msgpack, as vLLM's example subscriber -------------------

    fn python() -> (String, String) {
        let py = std::env::var("KVFLEET_PYTHON").unwrap_or_else(|_| "python3".into());
        let mut paths = vec![PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".tools/py")];
        if let Some(p) = std::env::var_os("PYTHONPATH") {
            paths.extend(std::env::split_paths(&p));
        }
        let path = std::env::join_paths(paths).unwrap().into_string().unwrap();
        let check = Command::new(&py)
            .args(["-c", "import zmq, msgpack"])
            .env("PYTHONPATH", &path)
            .output();
        let why = match &check {
            Ok(o) if o.status.success() => None,
            Ok(o) => Some(String::from_utf8_lossy(&o.stderr).trim().to_string()),
            Err(e) => Some(e.to_string()),
        };
        if let Some(why) = why {
            panic!(
                "{py} cannot import zmq and msgpack (pyzmq and msgpack, the KV events subscriber's \
                 packages): run .ci/install-tools, which installs them into .tools/py, or point \
                 KVFLEET_PYTHON at a Python that has them ({why})"
            );
        }
        (py, path)
    }

    fn json_to_event(line: &serde_json::Value) -> KvEvent {
        let hashes = |v: &serde_json::Value| -> Vec<u64> {
            v.as_array()
                .unwrap_or_else(|| panic!("block_hashes: {line}"))
                .iter()
                .map(|h| h.as_u64().unwrap_or_else(|| panic!("hash: {line}")))
                .collect()
        };
        match line["type"].as_str() {
            Some("BlockStored") => KvEvent::Stored {
                block_hashes: hashes(&line["block_hashes"]),
                parent_block_hash: line["parent_block_hash"].as_u64(),
                token_ids: line["token_ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|t| u32::try_from(t.as_u64().unwrap()).unwrap())
                    .collect(),
                block_size: line["block_size"].as_u64().unwrap() as usize,
            },
            Some("BlockRemoved") => KvEvent::Removed {
                block_hashes: hashes(&line["block_hashes"]),
            },
            Some("AllBlocksCleared") => KvEvent::AllCleared,
            _ => panic!("unknown event: {line}"),
        }
    }

    /// Publishes `sample()` until a Python subscriber has received two batches, then checks
    /// what it decoded.
    fn python_subscriber_receives(publisher: &KvEventPublisher, format: KvEventsFormat, medium: &str) {
        let (py, pythonpath) = python();
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/tools_support/kv_events_subscriber.py"
        );
        let mut child = Command::new(&py)
            .arg(script)
            .args(["--endpoint", &publisher.local_addr(), "--topic", "kv@"])
            .args(["--batches", "2", "--timeout", "60"])
            .env("PYTHONPATH", &pythonpath)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn the Python subscriber");
        // PUB/SUB: whatever is sent before the subscription reaches the publisher is lost, so
        // keep publishing until the subscriber has what it waits for.
        let started = Instant::now();
        while child.try_wait().unwrap().is_none() {
            if started.elapsed() > Duration::from_secs(90) {
                let _ = child.kill();
                break;
            }
            publisher.publish(sample());
            std::thread::sleep(Duration::from_millis(50));
        }
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "the subscriber failed ({}): {stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let lines: Vec<serde_json::Value> = stdout
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect();
        assert_eq!(lines.len(), 2 * sample().len(), "{stdout}");
        let now = unix_now();
        let mut seqs = Vec::new();
        for batch in lines.chunks(sample().len()) {
            let seq = batch[0]["seq"].as_u64().unwrap();
            let decoded: Vec<KvEvent> = batch.iter().map(json_to_event).collect();
            assert_eq!(decoded, sample(), "{stdout}");
            for line in batch {
                assert_eq!(line["seq"], seq, "one batch, one sequence number: {stdout}");
                assert_eq!(line["topic"], "kv@test@model");
                assert_eq!(line["data_parallel_rank"], 0);
                assert_eq!(line["encoding"], format.to_string());
                let ts = line["ts"].as_f64().expect("ts is a float");
                assert!((now - ts).abs() < 120.0, "ts {ts}, now {now}");
                if line["type"] == "BlockStored" {
                    assert_eq!(line["lora_id"], serde_json::Value::Null);
                    assert_eq!(line["lora_name"], serde_json::Value::Null);
                }
                if line["type"] != "AllBlocksCleared" {
                    assert_eq!(line["medium"], medium);
                }
                let fields = match line["type"].as_str().unwrap() {
                    "BlockStored" => 7,
                    "BlockRemoved" => 2,
                    _ => 0,
                };
                assert_eq!(line["n_fields"], fields, "{line}");
            }
            seqs.push(seq);
        }
        assert!(seqs[0] < seqs[1], "sequence numbers {seqs:?}");
    }

    #[test]
    fn a_pyzmq_subscriber_decodes_vllm_array_events() {
        let publisher = KvEventPublisher::start("tcp://127.0.0.1:0", "kv@test@model".into(), MEDIUM_GPU)
            .expect("start the publisher");
        python_subscriber_receives(&publisher, KvEventsFormat::Array, MEDIUM_GPU);
        assert_eq!(publisher.dropped_batches(), 0);
    }

    #[test]
    fn a_pyzmq_subscriber_decodes_vllm_map_events_from_a_publisher_started_in_a_runtime() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let publisher = runtime.block_on(async {
            KvEventPublisher::start_with_format(
                "tcp://127.0.0.1:0",
                "kv@test@model".into(),
                MEDIUM_CPU,
                KvEventsFormat::Map,
            )
            .expect("start the publisher")
        });
        python_subscriber_receives(&publisher, KvEventsFormat::Map, MEDIUM_CPU);
    }
}
