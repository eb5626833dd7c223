//! ZMTP 3.0, the ZeroMQ wire protocol, for the two sockets KV events need: a PUB that the
//! worker binds ([`publisher`]) and a SUB that the router connects ([`subscriber`]). Our own
//! framing instead of a ZeroMQ library because every length a peer announces is checked
//! against a stated limit before a byte is allocated for it: the `zeromq` crate reserved the
//! announced length up front, so 73 bytes (a greeting and one frame header announcing 2^62
//! bytes) aborted the process (issue 62).
//!
//! The protocol, as read (not copied) from the specifications, ZMTP 3.0 (rfc.zeromq.org/spec/23)
//! and 3.1 (rfc.zeromq.org/spec/37):
//! - a 64-byte greeting each way: `0xFF`, 8 padding bytes, `0x7F`, the version (3, 0), the
//!   mechanism name padded with zeros to 20 bytes (`NULL` here), the as-server byte and 31
//!   zero bytes;
//! - the NULL mechanism: each side sends a READY command whose properties name its
//!   `Socket-Type` (a property is a 1-byte name length, the name, a 4-byte big-endian value
//!   length and the value; names are case-insensitive);
//! - frames: a flags byte (bit 0 MORE, bit 1 LONG, bit 2 COMMAND, the others reserved), the
//!   body length in 1 byte or, with LONG, 8 big-endian bytes, then the body; a command's body
//!   is its name (1-byte length first) and its data;
//! - subscriptions: in 3.0 a one-frame message whose first byte is 1 (subscribe) or 0 (cancel)
//!   followed by the topic; in 3.1 the SUBSCRIBE and CANCEL commands. Both are accepted; both
//!   sides advertise 3.0, so a libzmq peer (pyzmq, vLLM's publisher) speaks 3.0 to us; the
//!   pyzmq tests (`kv_events`'s unit tests, `tests/kv_events_hostile.rs`) check both directions;
//! - PING (a 2-byte TTL and up to 16 bytes of context) is answered with PONG and the context.
//!
//! Anything else a peer sends that breaks these rules ends its connection with a
//! [`ZmtpError`] whose [`reason`](ZmtpError::reason) the callers count.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

pub mod publisher;
pub mod subscriber;

/// How long a peer has to complete its greeting and READY: a connection that has not by then
/// is closed, so idle or trickling sockets cannot hold descriptors (1,100 of them made a worker
/// unreachable, issue 62). libzmq sends both at once on connect.
pub const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(5);

/// The largest READY command read: `Socket-Type`, an `Identity` (at most 255 bytes in libzmq)
/// and a few application properties fit many times over.
pub const MAX_READY_BYTES: usize = 4096;

/// How long one write to a peer may take before the peer counts as stalled and is dropped.
pub const WRITE_DEADLINE: Duration = Duration::from_secs(10);

const FLAG_MORE: u8 = 0x01;
const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;
const GREETING_LEN: usize = 64;

/// The ZeroMQ socket types KV events use, and what each pairs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SocketType {
    Pub,
    Sub,
}

impl SocketType {
    fn name(self) -> &'static str {
        match self {
            Self::Pub => "PUB",
            Self::Sub => "SUB",
        }
    }

    /// ZMTP's socket-type pairs (RFC 23, "The Socket Type"): PUB with SUB or XSUB, SUB with
    /// PUB or XPUB.
    fn accepts(self, peer: &[u8]) -> bool {
        let ok: &[&[u8]] = match self {
            Self::Pub => &[b"SUB", b"XSUB"],
            Self::Sub => &[b"PUB", b"XPUB"],
        };
        ok.contains(&peer)
    }
}

/// What a connection may send: frame and message sizes are checked against these before any
/// buffer is reserved for them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// The largest frame body, in bytes.
    pub max_frame: usize,
    /// The largest message, all its frames together, in bytes.
    pub max_message: usize,
    /// The most frames in one message.
    pub max_frames: usize,
}

/// Why a peer's connection was ended.
#[derive(Debug, thiserror::Error)]
pub enum ZmtpError {
    #[error("not a ZMTP 3 greeting with the NULL mechanism: {0}")]
    Greeting(&'static str),
    #[error(
        "the peer is a {0:?} socket: a PUB pairs with SUB or XSUB and a SUB with PUB or XPUB; \
         point a SUB socket at the worker's kv-events port"
    )]
    SocketType(String),
    #[error("malformed command: {0}")]
    Command(&'static str),
    #[error("a frame's flags {0:#04x} set reserved bits")]
    Flags(u8),
    #[error("a frame of {len} bytes is over the limit of {limit}")]
    FrameTooLarge { len: u64, limit: usize },
    #[error("a message is over the limit of {0} bytes")]
    MessageTooLarge(usize),
    #[error("a message is over the limit of {0} frames")]
    TooManyFrames(usize),
    #[error("over the limit of {0} subscriptions of at most {1} bytes each")]
    Subscriptions(usize, usize),
    #[error("the connection ended inside a frame or the handshake")]
    Truncated,
    #[error("no greeting and READY within {0:?}")]
    HandshakeTimeout(Duration),
    #[error("the peer sent ERROR: {0}")]
    Peer(String),
    #[error("the peer has taken nothing for {0:?}")]
    Stalled(Duration),
    #[error("connection closed")]
    Closed,
    #[error(transparent)]
    Io(std::io::Error),
}

impl From<std::io::Error> for ZmtpError {
    fn from(e: std::io::Error) -> Self {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            Self::Truncated
        } else {
            Self::Io(e)
        }
    }
}

impl ZmtpError {
    /// The `reason` label of the rejected-input counters; `None` for an ordinary end (a close
    /// between messages, a network error, our own deadline on a slow reader).
    pub fn reason(&self) -> Option<&'static str> {
        Some(match self {
            Self::Greeting(_) => "greeting",
            Self::SocketType(_) => "socket_type",
            Self::Command(_) => "command",
            Self::Flags(_) => "flags",
            Self::FrameTooLarge { .. } => "frame_too_large",
            Self::MessageTooLarge(_) => "message_too_large",
            Self::TooManyFrames(_) => "too_many_frames",
            Self::Subscriptions(..) => "subscriptions",
            Self::Truncated => "truncated",
            Self::HandshakeTimeout(_) => "handshake_timeout",
            Self::Peer(_) | Self::Stalled(_) | Self::Closed | Self::Io(_) => return None,
        })
    }

    /// Every `reason` label, so that the counters exist at zero from the first scrape.
    pub const REASONS: [&'static str; 11] = [
        "greeting",
        "socket_type",
        "command",
        "flags",
        "frame_too_large",
        "message_too_large",
        "too_many_frames",
        "subscriptions",
        "truncated",
        "handshake_timeout",
        "connection_limit",
    ];
}

/// Our greeting: ZMTP 3.0, NULL, not as-server (NULL ignores it).
fn greeting() -> [u8; GREETING_LEN] {
    let mut g = [0u8; GREETING_LEN];
    g[0] = 0xFF;
    g[9] = 0x7F;
    g[10] = 3;
    g[11] = 0;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// Appends one frame.
pub fn put_frame(out: &mut Vec<u8>, body: &[u8], more: bool, command: bool) {
    let mut flags = if more { FLAG_MORE } else { 0 } | if command { FLAG_COMMAND } else { 0 };
    if body.len() > 255 {
        flags |= FLAG_LONG;
        out.push(flags);
        out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    } else {
        out.push(flags);
        out.push(body.len() as u8);
    }
    out.extend_from_slice(body);
}

/// Appends a command frame `name` with `data`.
fn put_command(out: &mut Vec<u8>, name: &str, data: &[u8]) {
    let mut body = Vec::with_capacity(1 + name.len() + data.len());
    body.push(name.len() as u8);
    body.extend_from_slice(name.as_bytes());
    body.extend_from_slice(data);
    put_frame(out, &body, false, true);
}

/// A multipart message as bytes on the wire.
pub fn encode_message(frames: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::with_capacity(frames.iter().map(|f| f.len() + 9).sum());
    for (i, f) in frames.iter().enumerate() {
        put_frame(&mut out, f, i + 1 < frames.len(), false);
    }
    out
}

/// A PONG answering a PING's `body` (its command data: a 2-byte TTL and the context).
fn pong(ping: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    put_command(&mut out, "PONG", ping.get(2..).unwrap_or_default());
    out
}

/// What the peer told us in its handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    pub minor: u8,
}

/// Sends our greeting and READY, reads and checks the peer's. The caller bounds it in time
/// ([`HANDSHAKE_DEADLINE`]).
pub async fn handshake<S>(stream: &mut S, ours: SocketType) -> Result<Peer, ZmtpError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut out = greeting().to_vec();
    let mut props = Vec::new();
    props.push(11u8);
    props.extend_from_slice(b"Socket-Type");
    props.extend_from_slice(&(ours.name().len() as u32).to_be_bytes());
    props.extend_from_slice(ours.name().as_bytes());
    put_command(&mut out, "READY", &props);
    stream.write_all(&out).await?;
    stream.flush().await?;

    // The first 12 bytes decide whether the rest is worth waiting for: a ZMTP 1.0 or 2.0 peer
    // would wait for us after its short greeting.
    let mut g = [0u8; GREETING_LEN];
    stream.read_exact(&mut g[..12]).await?;
    if g[0] != 0xFF || g[9] & 0x01 == 0 {
        return Err(ZmtpError::Greeting("no ZMTP signature"));
    }
    if g[10] < 3 {
        return Err(ZmtpError::Greeting("a ZMTP version before 3.0"));
    }
    stream.read_exact(&mut g[12..]).await?;
    let mechanism = &g[12..32];
    let name_len = mechanism.iter().position(|&b| b == 0).unwrap_or(20);
    if &mechanism[..name_len] != b"NULL" || mechanism[name_len..].iter().any(|&b| b != 0) {
        return Err(ZmtpError::Greeting("a security mechanism other than NULL"));
    }
    let limits = Limits {
        max_frame: MAX_READY_BYTES,
        max_message: MAX_READY_BYTES,
        max_frames: 1,
    };
    let (flags, body) = read_frame(stream, &limits, MAX_READY_BYTES)
        .await?
        .ok_or(ZmtpError::Truncated)?;
    if flags & FLAG_COMMAND == 0 {
        return Err(ZmtpError::Command("a message before READY"));
    }
    let (name, data) = split_command(&body)?;
    match name {
        b"READY" => {}
        b"ERROR" => return Err(ZmtpError::Peer(error_reason(data))),
        _ => return Err(ZmtpError::Command("a command other than READY in the handshake")),
    }
    let socket_type =
        property(data, b"Socket-Type")?.ok_or(ZmtpError::Command("READY without Socket-Type"))?;
    if !ours.accepts(socket_type) {
        return Err(ZmtpError::SocketType(
            String::from_utf8_lossy(socket_type).into_owned(),
        ));
    }
    Ok(Peer { minor: g[11] })
}

/// A command's name and data.
fn split_command(body: &[u8]) -> Result<(&[u8], &[u8]), ZmtpError> {
    let (&len, rest) = body.split_first().ok_or(ZmtpError::Command("an empty command"))?;
    let len = usize::from(len);
    if len == 0 || rest.len() < len {
        return Err(ZmtpError::Command("a command name longer than its frame"));
    }
    Ok(rest.split_at(len))
}

fn error_reason(data: &[u8]) -> String {
    let n = data.first().map_or(0, |&n| usize::from(n));
    String::from_utf8_lossy(data.get(1..1 + n).unwrap_or_default()).into_owned()
}

/// The value of the READY property `wanted` (case-insensitive); every property is checked to
/// lie inside the command.
fn property<'a>(mut data: &'a [u8], wanted: &[u8]) -> Result<Option<&'a [u8]>, ZmtpError> {
    let bad = || ZmtpError::Command("a READY property longer than its command");
    let mut found = None;
    while let Some((&n, rest)) = data.split_first() {
        let n = usize::from(n);
        if n == 0 || rest.len() < n + 4 {
            return Err(bad());
        }
        let (name, rest) = rest.split_at(n);
        let (len, rest) = rest.split_at(4);
        let len = u32::from_be_bytes(len.try_into().expect("4 bytes")) as usize;
        if rest.len() < len {
            return Err(bad());
        }
        let (value, rest) = rest.split_at(len);
        if name.eq_ignore_ascii_case(wanted) {
            found = Some(value);
        }
        data = rest;
    }
    Ok(found)
}

/// Reads one frame whose body may be at most `budget` bytes (and `limits.max_frame`); `None`
/// on a close before its first byte. The body buffer grows with the bytes that arrive, never
/// to an announced length that has not.
async fn read_frame<R>(r: &mut R, limits: &Limits, budget: usize) -> Result<Option<(u8, Vec<u8>)>, ZmtpError>
where
    R: AsyncRead + Unpin,
{
    let mut flags = [0u8; 1];
    if r.read(&mut flags).await? == 0 {
        return Ok(None);
    }
    let flags = flags[0];
    if flags & !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND) != 0 {
        return Err(ZmtpError::Flags(flags));
    }
    if flags & FLAG_COMMAND != 0 && flags & FLAG_MORE != 0 {
        return Err(ZmtpError::Command("a command frame with MORE set"));
    }
    let len = if flags & FLAG_LONG != 0 {
        let mut b = [0u8; 8];
        r.read_exact(&mut b).await?;
        u64::from_be_bytes(b)
    } else {
        let mut b = [0u8; 1];
        r.read_exact(&mut b).await?;
        u64::from(b[0])
    };
    if len > limits.max_frame as u64 {
        return Err(ZmtpError::FrameTooLarge {
            len,
            limit: limits.max_frame,
        });
    }
    if len > budget as u64 {
        return Err(ZmtpError::MessageTooLarge(limits.max_message));
    }
    let mut body = Vec::with_capacity((len as usize).min(64 * 1024));
    let got = (&mut *r).take(len).read_to_end(&mut body).await?;
    if got as u64 != len {
        return Err(ZmtpError::Truncated);
    }
    Ok(Some((flags, body)))
}

/// What a connection carries once its handshake is done.
#[derive(Debug, PartialEq, Eq)]
pub enum Incoming {
    /// A message's frames.
    Message(Vec<Vec<u8>>),
    /// A 3.1 SUBSCRIBE command's topic.
    Subscribe(Vec<u8>),
    /// A 3.1 CANCEL command's topic.
    Cancel(Vec<u8>),
    /// A PONG to send back.
    Pong(Vec<u8>),
}

/// Reads the next message or command that matters; `Err(Closed)` on a close between two.
pub async fn read_incoming<R>(r: &mut R, limits: &Limits) -> Result<Incoming, ZmtpError>
where
    R: AsyncRead + Unpin,
{
    let mut frames: Vec<Vec<u8>> = Vec::new();
    let mut total = 0usize;
    loop {
        let budget = limits.max_message - total;
        let Some((flags, body)) = read_frame(r, limits, budget).await? else {
            return Err(if frames.is_empty() {
                ZmtpError::Closed
            } else {
                ZmtpError::Truncated
            });
        };
        if flags & FLAG_COMMAND != 0 {
            if !frames.is_empty() {
                return Err(ZmtpError::Command("a command inside a multipart message"));
            }
            let (name, data) = split_command(&body)?;
            match name {
                b"SUBSCRIBE" => return Ok(Incoming::Subscribe(data.to_vec())),
                b"CANCEL" => return Ok(Incoming::Cancel(data.to_vec())),
                b"PING" => {
                    if data.len() < 2 || data.len() > 2 + 16 {
                        return Err(ZmtpError::Command(
                            "a PING without its TTL or with over 16 bytes of context",
                        ));
                    }
                    return Ok(Incoming::Pong(pong(data)));
                }
                b"ERROR" => return Err(ZmtpError::Peer(error_reason(data))),
                b"READY" => return Err(ZmtpError::Command("READY after the handshake")),
                // PONG, and commands of later versions: nothing to do.
                _ => continue,
            }
        }
        total += body.len();
        frames.push(body);
        if flags & FLAG_MORE == 0 {
            return Ok(Incoming::Message(frames));
        }
        if frames.len() >= limits.max_frames {
            return Err(ZmtpError::TooManyFrames(limits.max_frames));
        }
    }
}

/// Writes `bytes`, or gives up on a peer that takes nothing for [`WRITE_DEADLINE`].
pub async fn write_bounded<W>(w: &mut W, bytes: &[u8]) -> Result<(), ZmtpError>
where
    W: AsyncWrite + Unpin,
{
    match tokio::time::timeout(WRITE_DEADLINE, w.write_all(bytes)).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(ZmtpError::Stalled(WRITE_DEADLINE)),
    }
}

#[cfg(test)]
mod tests;
