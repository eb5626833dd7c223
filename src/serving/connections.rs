//! Connections that hold a file descriptor and ask for nothing are closed, and the number held
//! stays under the process's file limit, so that a client opening idle sockets (plain TCP,
//! TLS and then nothing, an HTTP/2 preface and then nothing, a keep-alive connection left open)
//! can neither exhaust the descriptors nor keep a health probe out.
//!
//! Each accepted connection is registered ([`Connections`]) with the requests it has in flight
//! (counted by wrapping the connection's service, until the response body is dropped) and since
//! when it has had none. A connection with none in flight is closed when:
//! - it has not started a request within [`ConnectionPolicy::first_request`] of its accept
//!   (the TLS handshake included: the timer runs under TLS), or
//! - it has been idle for [`ConnectionPolicy::idle`] since its last response (HTTP/1 keep-alive
//!   and HTTP/2 alike: pings do not count as requests), or
//! - the registry is full and it has asked for the least for the longest (below): a new
//!   connection takes its place, so a probe always gets in while any held connection is idle.
//!
//! A connection whose every request in flight is still receiving its body (the request's body
//! is wrapped to see when it ends) may make room too: a client that trickles bodies on every
//! connection it may hold would otherwise keep probes out until its bodies time out (1,000 such
//! connections failed 93 of 132 `/healthz` probes at a 1,024-file limit, issue 62). The one
//! closed is the one idle, or receiving, for the longest, idle first on a tie; not the longest
//! idle before any receiving one, since a connection just accepted is idle until its request is
//! read, and a probe whose request is on its way must not be the first to go. A request whose
//! body has arrived (one being answered, a stream) is never closed to make room.
//!
//! Closing is done by the stream wrapper ([`Guarded`]): its reads and writes fail once the
//! connection is due, and it keeps a timer armed so that the connection's task wakes up then.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use futures::task::AtomicWaker;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// When a connection is closed for asking nothing, and how many are held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionPolicy {
    /// From accept to the first request (TLS handshake and headers included).
    pub first_request: Duration,
    /// From the end of a response to the next request.
    pub idle: Duration,
    /// Connections held at once (see [`connection_budget`]).
    pub max_connections: usize,
}

/// Descriptors kept free for what a server opens besides connections after it starts: the
/// KV-event publisher's subscribers (one socket each: a fleet's routers and endpoint pickers,
/// a few dozen at most), files the blocking pool opens (the termination log, /proc reads for
/// metrics), NVML's device files, and the accept of a connection that is then refused (one at a
/// time per accept loop). 64 covers them with room; see [`connection_budget`].
pub const RESERVED_DESCRIPTORS: usize = 64;

/// Connections a server may hold: the soft `RLIMIT_NOFILE` less the descriptors open now (model
/// files, logs, the runtime's own, the listeners) and [`RESERVED_DESCRIPTORS`]. At least 1.
pub fn connection_budget() -> usize {
    let limit = open_file_limit().unwrap_or(1024);
    let open = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count());
    let budget = limit.saturating_sub(open).saturating_sub(RESERVED_DESCRIPTORS);
    budget.max(1)
}

fn open_file_limit() -> Option<usize> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit through a valid pointer to a local.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) };
    if rc != 0 {
        return None;
    }
    if r.rlim_cur == libc::RLIM_INFINITY {
        return Some(usize::MAX);
    }
    usize::try_from(r.rlim_cur).ok()
}

// === impl Connections ===

/// The registry of a server's connections (or several servers' that share one file limit).
#[derive(Clone)]
pub struct Connections {
    shared: Arc<Shared>,
}

struct Shared {
    policy: ConnectionPolicy,
    epoch: Instant,
    next_id: AtomicU64,
    conns: Mutex<HashMap<u64, Arc<Conn>>>,
    /// Connections closed for asking nothing, by cause (for logs and tests).
    reaped: AtomicU64,
    evicted: AtomicU64,
    refused: AtomicU64,
    /// Of `evicted`, those closed while receiving a body.
    evicted_receiving: AtomicU64,
}

/// One connection's state, shared by its stream, its service and the registry.
struct Conn {
    in_flight: AtomicUsize,
    /// Milliseconds since the registry's epoch when it last had no request in flight.
    idle_since_ms: AtomicU64,
    /// A request has started on it (the idle limit applies, not the first-request one).
    served: AtomicBool,
    /// Requests in flight whose body has not ended yet, and since when (ms since the epoch)
    /// the connection has had one.
    receiving: AtomicUsize,
    receiving_since_ms: AtomicU64,
    /// Evicted: close at the next read or write.
    close: AtomicBool,
    waker: AtomicWaker,
}

impl Connections {
    pub fn new(policy: ConnectionPolicy) -> Self {
        Connections {
            shared: Arc::new(Shared {
                policy,
                epoch: Instant::now(),
                next_id: AtomicU64::new(0),
                conns: Mutex::new(HashMap::new()),
                reaped: AtomicU64::new(0),
                evicted: AtomicU64::new(0),
                refused: AtomicU64::new(0),
                evicted_receiving: AtomicU64::new(0),
            }),
        }
    }

    pub fn policy(&self) -> ConnectionPolicy {
        self.shared.policy
    }

    /// An acceptor that registers every connection `inner` accepts.
    pub fn acceptor<A>(&self, inner: A) -> GuardAcceptor<A> {
        GuardAcceptor {
            inner,
            shared: self.shared.clone(),
        }
    }

    /// Connections held now.
    pub fn held(&self) -> usize {
        self.shared.conns.lock().map_or(0, |c| c.len())
    }

    /// (closed for a timeout, closed to make room, refused for lack of room) so far.
    pub fn closed(&self) -> (u64, u64, u64) {
        let s = &self.shared;
        (
            s.reaped.load(Ordering::Relaxed),
            s.evicted.load(Ordering::Relaxed),
            s.refused.load(Ordering::Relaxed),
        )
    }

    /// Of the connections closed to make room, those that were receiving a request body.
    pub fn evicted_receiving(&self) -> u64 {
        self.shared.evicted_receiving.load(Ordering::Relaxed)
    }
}

impl Shared {
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Registers a new connection; when the registry is full, the connection idle or receiving
    /// a body for the longest is told to close to make room. `None` when
    /// every held connection has a request in flight past its body.
    fn admit(self: &Arc<Self>) -> Option<Registration> {
        let mut conns = self.conns.lock().ok()?;
        // Connections told to close keep their descriptor until their task notices; they may
        // use half the reserve, past which new connections are refused until they are gone.
        if conns.len() >= self.policy.max_connections + RESERVED_DESCRIPTORS / 2 {
            self.refused.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let open = conns
            .values()
            .filter(|c| !c.close.load(Ordering::Acquire))
            .count();
        if open >= self.policy.max_connections {
            // The connection that has asked for the least for the longest: idle (nothing in
            // flight) since when, or receiving bodies (all it has in flight) since when. Never
            // one that is being answered. A connection just accepted is idle until its first
            // request is read, so ranking idle ones first would close a probe whose request is
            // still on its way whenever it is the only idle one (issue 62's trickling test
            // failed one probe in 468 on a 2-core machine that way).
            let now = self.now_ms();
            let victim = conns
                .values()
                .filter(|c| !c.close.load(Ordering::Acquire))
                .filter_map(|c| {
                    let in_flight = c.in_flight.load(Ordering::Acquire);
                    let receiving = c.receiving.load(Ordering::Acquire);
                    if in_flight == 0 {
                        let since = c.idle_since_ms.load(Ordering::Acquire);
                        Some((c, false, now.saturating_sub(since)))
                    } else if receiving >= in_flight {
                        let since = c.receiving_since_ms.load(Ordering::Acquire);
                        Some((c, true, now.saturating_sub(since)))
                    } else {
                        None
                    }
                })
                .max_by_key(|&(_, receiving, wasted)| (wasted, !receiving))
                .map(|(c, receiving, _)| (c, receiving));
            match victim {
                Some((c, receiving)) => {
                    c.close.store(true, Ordering::Release);
                    c.waker.wake();
                    self.evicted.fetch_add(1, Ordering::Relaxed);
                    if receiving {
                        self.evicted_receiving.fetch_add(1, Ordering::Relaxed);
                    }
                }
                None => {
                    self.refused.fetch_add(1, Ordering::Relaxed);
                    return None;
                }
            }
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let conn = Arc::new(Conn {
            in_flight: AtomicUsize::new(0),
            idle_since_ms: AtomicU64::new(self.now_ms()),
            served: AtomicBool::new(false),
            receiving: AtomicUsize::new(0),
            receiving_since_ms: AtomicU64::new(0),
            close: AtomicBool::new(false),
            waker: AtomicWaker::new(),
        });
        conns.insert(id, conn.clone());
        Some(Registration {
            id,
            conn,
            shared: self.clone(),
        })
    }
}

/// A connection's place in the registry, given back when its stream is dropped.
struct Registration {
    id: u64,
    conn: Arc<Conn>,
    shared: Arc<Shared>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Ok(mut conns) = self.shared.conns.lock() {
            conns.remove(&self.id);
        }
    }
}

// === impl GuardAcceptor ===

/// Wraps an acceptor (TCP_NODELAY, or the inner half of TLS) so that its streams and services
/// are registered and tracked.
#[derive(Clone)]
pub struct GuardAcceptor<A> {
    inner: A,
    shared: Arc<Shared>,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<A, I, S> axum_server::accept::Accept<I, S> for GuardAcceptor<A>
where
    A: axum_server::accept::Accept<I, S>,
    A::Future: Send + 'static,
    A::Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    A::Service: Send + 'static,
{
    type Stream = Guarded<A::Stream>;
    type Service = Tracked<A::Service>;
    type Future = BoxFuture<io::Result<(Self::Stream, Self::Service)>>;

    fn accept(&self, stream: I, service: S) -> Self::Future {
        let registration = self.shared.admit();
        let accepted = self.inner.accept(stream, service);
        let policy = self.shared.policy;
        Box::pin(async move {
            // Refused: dropping the inner future closes the socket at once.
            let Some(registration) = registration else {
                return Err(io::Error::other(
                    "every connection the server may hold has a request in flight",
                ));
            };
            let (stream, service) = accepted.await?;
            let conn = registration.conn.clone();
            let shared = registration.shared.clone();
            Ok((
                Guarded {
                    io: stream,
                    registration,
                    timer: Box::pin(tokio::time::sleep(policy.first_request)),
                },
                Tracked {
                    inner: service,
                    conn,
                    shared,
                },
            ))
        })
    }
}

// === impl Guarded ===

/// A connection's stream: reads and writes fail once the connection is due to close.
pub struct Guarded<T> {
    io: T,
    registration: Registration,
    timer: Pin<Box<Sleep>>,
}

impl<T> Guarded<T> {
    /// The error that closes the connection, when it is due; otherwise arms the timer for
    /// when it will be (the task is woken then, or by an eviction).
    fn due(&mut self, cx: &mut Context<'_>) -> Option<io::Error> {
        let Registration { conn, shared, .. } = &self.registration;
        conn.waker.register(cx.waker());
        if conn.close.load(Ordering::Acquire) {
            return Some(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "closed to make room for a new connection (the server holds as many as its file limit allows)",
            ));
        }
        if conn.in_flight.load(Ordering::Acquire) > 0 {
            return None;
        }
        let limit = if conn.served.load(Ordering::Acquire) {
            shared.policy.idle
        } else {
            shared.policy.first_request
        };
        let since = Duration::from_millis(conn.idle_since_ms.load(Ordering::Acquire));
        let deadline = shared.epoch + since + limit;
        if self.timer.deadline() != deadline {
            self.timer.as_mut().reset(deadline);
        }
        if Instant::now() >= deadline || self.timer.as_mut().poll(cx).is_ready() {
            conn.close.store(true, Ordering::Release);
            shared.reaped.fetch_add(1, Ordering::Relaxed);
            return Some(io::Error::new(
                io::ErrorKind::TimedOut,
                "closed: no request within the connection's idle time",
            ));
        }
        None
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Guarded<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if let Some(e) = self.due(cx) {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Guarded<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        if let Some(e) = self.due(cx) {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if let Some(e) = self.due(cx) {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

// === impl Tracked ===

/// A connection's service: counts its requests in flight until their response bodies end.
#[derive(Clone)]
pub struct Tracked<S> {
    inner: S,
    conn: Arc<Conn>,
    shared: Arc<Shared>,
}

/// One request in flight; dropped with its response body (sent, or the client gone).
struct InFlight {
    conn: Arc<Conn>,
    shared: Arc<Shared>,
}

impl InFlight {
    fn start(conn: Arc<Conn>, shared: Arc<Shared>) -> Self {
        conn.served.store(true, Ordering::Release);
        conn.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight { conn, shared }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.conn
            .idle_since_ms
            .store(self.shared.now_ms(), Ordering::Release);
        if self.conn.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            // Idle now: the stream re-arms its timer at its next poll.
            self.conn.waker.wake();
        }
    }
}

impl<S, B> tower_service::Service<http::Request<B>> for Tracked<S>
where
    S: tower_service::Service<http::Request<Body>, Response = http::Response<Body>>,
    S::Future: Send + 'static,
    B: http_body::Body<Data = axum::body::Bytes> + Unpin + Send + 'static,
    B::Error: Into<axum::BoxError>,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let guard = InFlight::start(self.conn.clone(), self.shared.clone());
        let req = req.map(|body| {
            let receiving =
                (!body.is_end_stream()).then(|| Receiving::start(self.conn.clone(), &self.shared));
            Body::new(ReceivingBody {
                inner: body,
                receiving,
            })
        });
        let response = self.inner.call(req);
        Box::pin(async move {
            let r = response.await?;
            Ok(r.map(|body| {
                Body::new(TrackedBody {
                    inner: body,
                    _guard: guard,
                })
            }))
        })
    }
}

/// A request whose body has not ended; dropped when it ends, fails, or is dropped unread.
struct Receiving {
    conn: Arc<Conn>,
}

impl Receiving {
    fn start(conn: Arc<Conn>, shared: &Shared) -> Self {
        if conn.receiving.fetch_add(1, Ordering::AcqRel) == 0 {
            conn.receiving_since_ms.store(shared.now_ms(), Ordering::Release);
        }
        Receiving { conn }
    }
}

impl Drop for Receiving {
    fn drop(&mut self) {
        self.conn.receiving.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A request body that counts its request as receiving until it ends.
struct ReceivingBody<B> {
    inner: B,
    receiving: Option<Receiving>,
}

impl<B> http_body::Body for ReceivingBody<B>
where
    B: http_body::Body<Data = axum::body::Bytes> + Unpin,
{
    type Data = axum::body::Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None | Some(Err(_)))) || self.inner.is_end_stream() {
            self.receiving = None;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// A response body that keeps its request counted in flight until it is dropped.
struct TrackedBody {
    inner: Body,
    _guard: InFlight,
}

impl http_body::Body for TrackedBody {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}
