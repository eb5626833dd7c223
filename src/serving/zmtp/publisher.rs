//! A bounded PUB socket: the worker's KV-event port.
//!
//! Subscribers only ever send subscriptions and PINGs, so frames past a few hundred bytes are
//! refused; descriptors are bounded by a connection limit (past it a connection is accepted
//! and closed at once, so the HTTP port keeps its descriptors), memory by per-connection
//! subscription limits and a per-subscriber send queue that drops past its bounds, as a
//! libzmq PUB drops at its high-water mark.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus::{IntCounter, IntCounterVec, Opts};
use tokio::io::{AsyncRead, AsyncWrite, BufReader};
use tokio::sync::mpsc;

use super::{
    encode_message, handshake, read_incoming, write_bounded, Incoming, Limits, SocketType, ZmtpError,
};

/// Connections held at once. A worker has a few subscribers (a router's replicas, an endpoint
/// picker's); 1,100 idle connections at a 1,024 descriptor limit made one unreachable.
pub const MAX_CONNECTIONS: usize = 64;

/// Distinct topics one connection may subscribe to; a repeated subscription only counts up,
/// as libzmq's does. Routers subscribe to one prefix.
pub const MAX_SUBSCRIPTIONS: usize = 64;

/// The longest topic prefix a subscription may name (llm-d's `kv@<pod>@<model>` is well under).
pub const MAX_TOPIC_BYTES: usize = 256;

/// What a subscriber may send: one frame, a subscription (a flag byte or a SUBSCRIBE command
/// name before the topic) or a PING.
pub const LIMITS: Limits = Limits {
    max_frame: 1 + "SUBSCRIBE".len() + MAX_TOPIC_BYTES,
    max_message: 1 + "SUBSCRIBE".len() + MAX_TOPIC_BYTES,
    max_frames: 1,
};

/// Messages queued for one subscriber before new ones are dropped: libzmq's default send
/// high-water mark.
pub const SEND_QUEUE_MESSAGES: usize = 1000;

/// Bytes queued for one subscriber before new messages are dropped (a message alone in an
/// empty queue always goes). Messages are shared between subscribers, so this also bounds
/// what the slowest one keeps alive.
pub const SEND_QUEUE_BYTES: usize = 16 << 20;

/// What the publisher counts; the worker registers these in its metrics.
#[derive(Clone)]
pub struct Counters {
    /// Connections ended for what their peer sent, or refused at the connection limit, by
    /// [`ZmtpError::reason`] (and `connection_limit`).
    pub rejected: IntCounterVec,
    /// Messages not queued for a subscriber whose queue was full.
    pub dropped: IntCounter,
}

impl Counters {
    /// Counters registered nowhere (tests, and a publisher without metrics).
    pub fn detached() -> Self {
        Self {
            rejected: IntCounterVec::new(Opts::new("rejected", "rejected"), &["reason"])
                .expect("a valid metric"),
            dropped: IntCounter::new("dropped", "dropped").expect("a valid metric"),
        }
    }

    fn reject(&self, e: &ZmtpError) {
        if let Some(reason) = e.reason() {
            self.rejected.with_label_values(&[reason]).inc();
        }
    }
}

/// The topics one connection subscribed to, each with how many times.
#[derive(Debug, Default)]
pub struct Subscriptions {
    topics: Vec<(Vec<u8>, u64)>,
}

impl Subscriptions {
    pub fn subscribe(&mut self, topic: &[u8]) -> Result<(), ZmtpError> {
        let over = || ZmtpError::Subscriptions(MAX_SUBSCRIPTIONS, MAX_TOPIC_BYTES);
        if topic.len() > MAX_TOPIC_BYTES {
            return Err(over());
        }
        if let Some((_, n)) = self.topics.iter_mut().find(|(t, _)| t == topic) {
            *n = n.saturating_add(1);
            return Ok(());
        }
        if self.topics.len() >= MAX_SUBSCRIPTIONS {
            return Err(over());
        }
        self.topics.push((topic.to_vec(), 1));
        Ok(())
    }

    pub fn cancel(&mut self, topic: &[u8]) {
        if let Some(i) = self.topics.iter().position(|(t, _)| t == topic) {
            self.topics[i].1 -= 1;
            if self.topics[i].1 == 0 {
                self.topics.swap_remove(i);
            }
        }
    }

    /// Whether a message whose first frame is `topic` goes to this connection (ZeroMQ's
    /// prefix match).
    pub fn matches(&self, topic: &[u8]) -> bool {
        self.topics.iter().any(|(t, _)| topic.starts_with(t))
    }

    pub fn len(&self) -> usize {
        self.topics.len()
    }

    pub fn is_empty(&self) -> bool {
        self.topics.is_empty()
    }
}

/// One handshaken subscriber as the sending side sees it.
struct Subscriber {
    id: u64,
    topics: Arc<Mutex<Subscriptions>>,
    queue: mpsc::Sender<Arc<Vec<u8>>>,
    queued_bytes: Arc<AtomicUsize>,
}

impl Subscriber {
    /// Queues `message` unless the queue is at a bound.
    fn offer(&self, message: &Arc<Vec<u8>>) -> bool {
        let len = message.len();
        let before = self.queued_bytes.fetch_add(len, Ordering::Relaxed);
        if (before > 0 && before + len > SEND_QUEUE_BYTES)
            || self.queue.try_send(Arc::clone(message)).is_err()
        {
            self.queued_bytes.fetch_sub(len, Ordering::Relaxed);
            return false;
        }
        true
    }
}

/// The PUB socket's shared state: its subscribers and counters.
pub struct Publisher {
    subscribers: Mutex<Vec<Subscriber>>,
    connections: AtomicUsize,
    next_id: AtomicU64,
    counters: Counters,
}

impl Publisher {
    pub fn new(counters: Counters) -> Arc<Self> {
        Arc::new(Self {
            subscribers: Mutex::new(Vec::new()),
            connections: AtomicUsize::new(0),
            next_id: AtomicU64::new(0),
            counters,
        })
    }

    /// Sends a multipart message to every subscriber whose subscriptions match its first
    /// frame; a subscriber whose queue is full misses it (counted).
    pub fn send(&self, frames: &[&[u8]]) {
        let topic = frames.first().copied().unwrap_or_default();
        let Ok(subscribers) = self.subscribers.lock() else {
            return;
        };
        let mut message = None;
        for s in subscribers.iter() {
            if !s.topics.lock().is_ok_and(|t| t.matches(topic)) {
                continue;
            }
            let message = message.get_or_insert_with(|| Arc::new(encode_message(frames)));
            if !s.offer(message) {
                self.counters.dropped.inc();
            }
        }
    }

    /// Connections held now (handshaking or subscribed).
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::Relaxed)
    }

    /// Accepts connections until the listener fails for good; each is served on a task of
    /// its own.
    pub async fn serve(self: Arc<Self>, listener: tokio::net::TcpListener) {
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(error) => {
                    // Out of descriptors (EMFILE) or the like: wait rather than spin; the
                    // connection stays in the backlog.
                    tracing::warn!(%error, "KV events: cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            if self.connections.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTIONS {
                self.connections.fetch_sub(1, Ordering::AcqRel);
                self.counters
                    .rejected
                    .with_label_values(&["connection_limit"])
                    .inc();
                drop(stream);
                continue;
            }
            let _ = stream.set_nodelay(true);
            let this = Arc::clone(&self);
            tokio::spawn(async move {
                let result = this.serve_connection(stream).await;
                this.connections.fetch_sub(1, Ordering::AcqRel);
                if let Err(error) = result {
                    tracing::debug!(%error, "KV events: subscriber connection ended");
                }
            });
        }
    }

    /// Serves one connection: handshake, then its subscriptions and the messages for it,
    /// until it closes or breaks a rule (counted).
    pub async fn serve_connection<S>(&self, mut stream: S) -> Result<(), ZmtpError>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let result = self.serve_inner(&mut stream).await;
        if let Err(e) = &result {
            self.counters.reject(e);
        }
        result
    }

    async fn serve_inner<S>(&self, stream: &mut S) -> Result<(), ZmtpError>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        match tokio::time::timeout(super::HANDSHAKE_DEADLINE, handshake(stream, SocketType::Pub)).await {
            Ok(peer) => peer?,
            Err(_) => return Err(ZmtpError::HandshakeTimeout(super::HANDSHAKE_DEADLINE)),
        };
        let (reader, mut writer) = tokio::io::split(stream);
        let mut reader = BufReader::with_capacity(1024, reader);
        let (queue, mut outgoing) = mpsc::channel::<Arc<Vec<u8>>>(SEND_QUEUE_MESSAGES);
        let me = Subscriber {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            topics: Arc::new(Mutex::new(Subscriptions::default())),
            queue,
            queued_bytes: Arc::new(AtomicUsize::new(0)),
        };
        let (id, topics, queued_bytes, pongs) = (
            me.id,
            Arc::clone(&me.topics),
            Arc::clone(&me.queued_bytes),
            me.queue.clone(),
        );
        if let Ok(mut s) = self.subscribers.lock() {
            s.push(me);
        }
        let reading = async {
            loop {
                let topic_change = match read_incoming(&mut reader, &LIMITS).await? {
                    // ZMTP 3.0: a message whose first byte is 1 subscribes, 0 cancels; any
                    // other message from a subscriber means nothing to a PUB.
                    Incoming::Message(frames) => match frames[0].split_first() {
                        Some((1, topic)) => Some((true, topic.to_vec())),
                        Some((0, topic)) => Some((false, topic.to_vec())),
                        _ => None,
                    },
                    Incoming::Subscribe(topic) => Some((true, topic)),
                    Incoming::Cancel(topic) => Some((false, topic)),
                    Incoming::Pong(bytes) => {
                        // Dropped like any message when the queue is full.
                        let pong = Arc::new(bytes);
                        queued_bytes.fetch_add(pong.len(), Ordering::Relaxed);
                        if pongs.try_send(Arc::clone(&pong)).is_err() {
                            queued_bytes.fetch_sub(pong.len(), Ordering::Relaxed);
                        }
                        None
                    }
                };
                if let Some((subscribe, topic)) = topic_change {
                    let mut t = topics.lock().map_err(|_| ZmtpError::Closed)?;
                    if subscribe {
                        t.subscribe(&topic)?;
                    } else {
                        t.cancel(&topic);
                    }
                }
            }
        };
        let writing = async {
            while let Some(message) = outgoing.recv().await {
                write_bounded(&mut writer, &message).await?;
                queued_bytes.fetch_sub(message.len(), Ordering::Relaxed);
            }
            Ok::<(), ZmtpError>(())
        };
        let result = tokio::select! {
            r = reading => r,
            w = writing => w,
        };
        if let Ok(mut s) = self.subscribers.lock() {
            s.retain(|s| s.id != id);
        }
        match result {
            Err(ZmtpError::Closed) => Ok(()),
            other => other,
        }
    }
}
