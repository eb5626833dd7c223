//! A bounded SUB socket: the router's subscription to a worker's (or any vLLM-format
//! publisher's) KV events. One connection, no reconnection of its own: the caller reconnects
//! with backoff and decides what a lost subscription means.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, BufReader, ReadHalf, WriteHalf};
use tokio::net::TcpStream;

use super::{
    encode_message, handshake, read_incoming, write_bounded, Incoming, Limits, SocketType, ZmtpError,
};

/// The largest message (and frame) a publisher may send: one KV-event batch. vLLM publishes a
/// batch per engine step, bounded by the tokens a step schedules (`max_num_batched_tokens`,
/// 131,072 at most in practice: about 0.7 MB of token ids and their block hashes) or by one
/// eviction sweep of the pool; 16 MiB is twenty times that, and a length over it is refused
/// before anything is reserved for it.
pub const MAX_MESSAGE_BYTES: usize = 16 << 20;

/// What a publisher may send: KV-event messages have three frames (topic, sequence, payload).
pub const LIMITS: Limits = Limits {
    max_frame: MAX_MESSAGE_BYTES,
    max_message: MAX_MESSAGE_BYTES,
    max_frames: 8,
};

/// How long a TCP connect may take.
pub const CONNECT_DEADLINE: Duration = Duration::from_secs(2);

/// A live subscription: its handshake is done and its subscription sent.
pub struct Subscription<S> {
    reader: BufReader<ReadHalf<S>>,
    writer: WriteHalf<S>,
}

impl Subscription<TcpStream> {
    /// Connects to `endpoint` (`tcp://HOST:PORT`) and subscribes to messages whose topic
    /// starts with `topic` (empty: all).
    pub async fn connect(endpoint: &str, topic: &[u8]) -> Result<Self, ZmtpError> {
        let addr = endpoint.strip_prefix("tcp://").ok_or_else(|| {
            ZmtpError::Io(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{endpoint:?}: only tcp:// endpoints are supported"),
            ))
        })?;
        let stream = match tokio::time::timeout(CONNECT_DEADLINE, TcpStream::connect(addr)).await {
            Ok(s) => s?,
            Err(_) => {
                return Err(ZmtpError::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no TCP connection within {CONNECT_DEADLINE:?}"),
                )))
            }
        };
        let _ = stream.set_nodelay(true);
        Self::start(stream, topic).await
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> Subscription<S> {
    /// Runs the handshake on `stream` (within [`super::HANDSHAKE_DEADLINE`]) and subscribes.
    pub async fn start(mut stream: S, topic: &[u8]) -> Result<Self, ZmtpError> {
        let deadline = super::HANDSHAKE_DEADLINE;
        match tokio::time::timeout(deadline, handshake(&mut stream, SocketType::Sub)).await {
            Ok(peer) => peer?,
            Err(_) => return Err(ZmtpError::HandshakeTimeout(deadline)),
        };
        let (reader, mut writer) = tokio::io::split(stream);
        // ZMTP 3.0's form, which both sides speak since both advertise 3.0.
        let mut subscribe = Vec::with_capacity(1 + topic.len());
        subscribe.push(1);
        subscribe.extend_from_slice(topic);
        write_bounded(&mut writer, &encode_message(&[&subscribe])).await?;
        Ok(Self {
            reader: BufReader::with_capacity(64 * 1024, reader),
            writer,
        })
    }

    /// The next message's frames; answers PINGs on the way. An error ends the subscription.
    pub async fn recv(&mut self) -> Result<Vec<Vec<u8>>, ZmtpError> {
        loop {
            match read_incoming(&mut self.reader, &LIMITS).await? {
                Incoming::Message(frames) => return Ok(frames),
                Incoming::Pong(bytes) => write_bounded(&mut self.writer, &bytes).await?,
                // Subscriptions mean nothing coming from a publisher.
                Incoming::Subscribe(_) | Incoming::Cancel(_) => {}
            }
        }
    }
}
