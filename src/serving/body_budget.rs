//! One byte budget for the request bodies a server holds at once, so that its memory stays
//! under its container's limit whatever its clients send.
//!
//! A per-request limit alone does not bound memory: 40 clients each sending most of an 8 MiB
//! AdmissionReview took the webhook to 356 MB (issue 62), over the chart's 256Mi. Here a
//! request takes its body's bytes from the budget before buffering them ([`BodyBudget::read`]):
//! the declared length (`Content-Length`, HTTP/1 and HTTP/2 alike) at once, or, for a body of
//! unknown length, each growth of its buffer as it arrives. A request that cannot get its bytes
//! within [`BodyBudget::wait`] is answered 503 with `Retry-After` ([`BodyError::Busy`]) and its
//! body is never buffered (a few are read and thrown away for a moment, [`LINGER`], so that
//! the client gets the answer), so a client that is refused costs a socket, not memory. The bytes go back
//! when the [`BodyPermit`] is dropped: a handler keeps it for as long as it holds the body or
//! what it parsed from it.
//!
//! A reservation is never larger than the buffer it pays for: the buffer of a declared body is
//! allocated at its exact length, and that of an undeclared body grows by at most doubling,
//! reserved before each growth. The queue is first-come first-served (a large body is not
//! starved by small ones), and a body larger than the whole budget is refused at once (413).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::http::StatusCode;
use http_body_util::BodyExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// What a refused client is told to wait before it retries: a trickled body holds its bytes
/// until the server's body timeout, an honest one for milliseconds, so a retry a second later
/// usually finds room.
pub const RETRY_AFTER: Duration = Duration::from_secs(1);

/// What a request waits for room in the budget before it is refused: long enough to ride out a
/// burst of honest bodies (each read in milliseconds), short against a caller's timeout (the
/// API server gives a webhook 10 s; clients of the OpenAI API retry a 503).
pub const DEFAULT_WAIT: Duration = Duration::from_secs(2);

/// How long the rest of a refused body (413, 503) is read and thrown away while the answer goes
/// out. A server that closes a connection with unread bytes in its receive buffer resets it
/// (RFC 9112 section 9.6, "lingering close"): the client, still writing its body, gets a broken
/// pipe instead of the answer, and retries blind. A lingering body is thrown away a chunk at a
/// time, but its connection's read buffer grows while it streams (hyper's, up to some 400 KiB):
/// at most [`LINGERING_MAX`] linger at once, past which a refused body's connection is closed
/// as it is (100 refused clients lingering at once cost the webhook 48 MiB more).
pub const LINGER: Duration = Duration::from_secs(2);

/// Refused bodies read and thrown away at once (see [`LINGER`]): some 3 MiB of read buffers.
pub const LINGERING_MAX: usize = 8;

static LINGERING: Semaphore = Semaphore::const_new(LINGERING_MAX);

/// Reads and drops what is left of `body` for up to [`LINGER`], in the background, when fewer
/// than [`LINGERING_MAX`] do.
fn linger(mut body: axum::body::Body) {
    let Ok(permit) = LINGERING.try_acquire() else {
        return;
    };
    tokio::spawn(async move {
        let drain = async { while let Some(Ok(_)) = body.frame().await {} };
        let _ = tokio::time::timeout(LINGER, drain).await;
        drop(permit);
    });
}

/// Per-request limits a [`BodyBudget::read`] applies besides the budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyLimits {
    /// The largest body; a larger one is refused (413) before a byte of it is buffered when it
    /// is declared, as soon as it passes the limit when it is not.
    pub max_bytes: usize,
    /// The time a client has to send its whole body, counted from when its bytes were granted.
    pub timeout: Duration,
}

/// Why a body was not read.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("the request body is over the limit of {limit} bytes")]
    TooLarge { limit: usize },
    #[error(
        "the server holds as many request bodies as its memory allows ({budget} bytes in flight); retry in {} s",
        retry_after.as_secs()
    )]
    Busy { budget: usize, retry_after: Duration },
    #[error("the request body did not arrive within {} s", timeout.as_secs())]
    TimedOut { timeout: Duration },
    #[error("cannot read the request body: {source}")]
    Read {
        #[source]
        source: axum::Error,
    },
}

impl BodyError {
    /// The HTTP status a server answers with: 413, 503, 408, 400.
    pub fn status(&self) -> StatusCode {
        match self {
            BodyError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            BodyError::Busy { .. } => StatusCode::SERVICE_UNAVAILABLE,
            BodyError::TimedOut { .. } => StatusCode::REQUEST_TIMEOUT,
            BodyError::Read { .. } => StatusCode::BAD_REQUEST,
        }
    }

    /// The `Retry-After` to send with a 503.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            BodyError::Busy { retry_after, .. } => Some(*retry_after),
            _ => None,
        }
    }
}

// === impl BodyBudget ===

/// The budget of a server (shared by its handlers; cloning shares it).
#[derive(Clone, Debug)]
pub struct BodyBudget {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    bytes: usize,
    wait: Duration,
    semaphore: Arc<Semaphore>,
    refused: AtomicU64,
}

/// The bytes a request holds; given back when dropped.
#[derive(Debug)]
pub struct BodyPermit {
    permits: Vec<OwnedSemaphorePermit>,
}

impl BodyPermit {
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.permits.iter().map(|p| p.num_permits()).sum()
    }
}

/// A body read under the budget, and the bytes it holds there.
#[derive(Debug)]
pub struct BudgetedBody {
    pub bytes: Bytes,
    pub permit: BodyPermit,
}

impl BodyBudget {
    /// A budget of `bytes` (at least 1) for which a request waits up to `wait`.
    pub fn new(bytes: usize, wait: Duration) -> Self {
        let bytes = bytes.clamp(1, Semaphore::MAX_PERMITS);
        BodyBudget {
            shared: Arc::new(Shared {
                bytes,
                wait,
                semaphore: Arc::new(Semaphore::new(bytes)),
                refused: AtomicU64::new(0),
            }),
        }
    }

    /// The budget, in bytes.
    pub fn bytes(&self) -> usize {
        self.shared.bytes
    }

    /// What a request waits for room before it is refused.
    pub fn wait(&self) -> Duration {
        self.shared.wait
    }

    /// Bytes not held by any request now.
    pub fn available(&self) -> usize {
        self.shared.semaphore.available_permits()
    }

    /// Requests refused for lack of room so far.
    pub fn refused(&self) -> u64 {
        self.shared.refused.load(Ordering::Relaxed)
    }

    /// Takes `bytes` from the budget, waiting up to [`Self::wait`]; `None` when there was no
    /// room in time (counted as refused). For a caller that buffers something other than an
    /// HTTP body under the same budget.
    pub async fn reserve(&self, bytes: usize) -> Option<BodyPermit> {
        let mut permit = BodyPermit { permits: Vec::new() };
        self.grow(&mut permit, bytes).await.ok()?;
        Some(permit)
    }

    /// Adds `bytes` to `permit`, waiting up to [`Self::wait`].
    async fn grow(&self, permit: &mut BodyPermit, bytes: usize) -> Result<(), BodyError> {
        if bytes == 0 {
            return Ok(());
        }
        let s = &self.shared;
        let busy = || {
            s.refused.fetch_add(1, Ordering::Relaxed);
            BodyError::Busy {
                budget: s.bytes,
                retry_after: RETRY_AFTER,
            }
        };
        // More than the whole budget can never be granted: waiting would not help (a server
        // whose per-request limit is over its budget is misconfigured; its flags say so).
        let n = match u32::try_from(bytes) {
            Ok(n) if bytes.saturating_add(permit.bytes()) <= s.bytes => n,
            _ => return Err(BodyError::TooLarge { limit: s.bytes }),
        };
        let acquire = s.semaphore.clone().acquire_many_owned(n);
        match tokio::time::timeout(s.wait, acquire).await {
            Ok(Ok(p)) => {
                permit.permits.push(p);
                Ok(())
            }
            // Timed out, or the semaphore closed (never: nothing closes it).
            _ => Err(busy()),
        }
    }

    /// Reads the body of `req` under `limits`, its bytes taken from the budget before they are
    /// buffered. The body is read only once its declared length is granted; a body of unknown
    /// length is granted as its buffer grows.
    pub async fn read(
        &self,
        req: axum::extract::Request,
        limits: BodyLimits,
    ) -> Result<BudgetedBody, BodyError> {
        self.read_body(req.into_body(), limits).await
    }

    /// [`Self::read`] of a body alone.
    pub async fn read_body(
        &self,
        mut body: axum::body::Body,
        limits: BodyLimits,
    ) -> Result<BudgetedBody, BodyError> {
        let too_large = BodyError::TooLarge {
            limit: limits.max_bytes,
        };
        let declared = http_body::Body::size_hint(&body).exact();
        let mut permit = BodyPermit { permits: Vec::new() };
        let mut buf: Vec<u8> = Vec::new();
        if let Some(n) = declared {
            let n = usize::try_from(n).unwrap_or(usize::MAX);
            if n > limits.max_bytes {
                linger(body);
                return Err(too_large);
            }
            if let Err(e) = self.grow(&mut permit, n).await {
                linger(body);
                return Err(e);
            }
            buf = Vec::with_capacity(n);
        }
        let read = async {
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|source| BodyError::Read { source })?;
                let Ok(chunk) = frame.into_data() else {
                    continue; // trailers
                };
                let needed = buf.len() + chunk.len();
                if needed > limits.max_bytes {
                    return Err(BodyError::TooLarge {
                        limit: limits.max_bytes,
                    });
                }
                if needed > buf.capacity() {
                    // Undeclared (or a peer that sends more than it declared, which hyper
                    // refuses first): grow by doubling, within the limit, paid for first.
                    let cap = needed
                        .max(buf.capacity() * 2)
                        .max(16 * 1024)
                        .min(limits.max_bytes);
                    self.grow(&mut permit, cap - buf.capacity()).await?;
                    buf.reserve_exact(cap - buf.len());
                }
                buf.extend_from_slice(&chunk);
            }
            Ok(())
        };
        match tokio::time::timeout(limits.timeout, read).await {
            Ok(Ok(())) => Ok(BudgetedBody {
                bytes: Bytes::from(buf),
                permit,
            }),
            Ok(Err(e)) => {
                if matches!(e, BodyError::TooLarge { .. } | BodyError::Busy { .. }) {
                    drop(buf);
                    drop(permit);
                    linger(body);
                }
                Err(e)
            }
            Err(_) => Err(BodyError::TimedOut {
                timeout: limits.timeout,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;

    fn limits(max_bytes: usize) -> BodyLimits {
        BodyLimits {
            max_bytes,
            timeout: Duration::from_secs(5),
        }
    }

    /// A body of unknown length, sent in `chunks` pieces of `size` bytes.
    fn chunked(chunks: usize, size: usize) -> Body {
        let parts = (0..chunks).map(move |_| Ok::<_, std::io::Error>(Bytes::from(vec![b'x'; size])));
        Body::from_stream(futures::stream::iter(parts))
    }

    #[tokio::test]
    async fn a_declared_body_holds_its_length_until_the_permit_is_dropped() {
        let budget = BodyBudget::new(1000, Duration::from_millis(50));
        let read = budget
            .read_body(Body::from(vec![b'x'; 600]), limits(1000))
            .await
            .unwrap();
        assert_eq!(read.bytes.len(), 600);
        assert_eq!(read.permit.bytes(), 600);
        assert_eq!(budget.available(), 400);
        drop(read);
        assert_eq!(budget.available(), 1000);
    }

    #[tokio::test]
    async fn a_body_that_does_not_fit_beside_those_held_is_refused_busy_after_the_wait() {
        let budget = BodyBudget::new(1000, Duration::from_millis(50));
        let held = budget
            .read_body(Body::from(vec![b'x'; 600]), limits(1000))
            .await
            .unwrap();
        let t0 = tokio::time::Instant::now();
        let e = budget
            .read_body(Body::from(vec![b'x'; 600]), limits(1000))
            .await
            .unwrap_err();
        assert!(matches!(e, BodyError::Busy { budget: 1000, .. }), "{e}");
        assert_eq!(e.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(e.retry_after(), Some(RETRY_AFTER));
        assert!(t0.elapsed() >= Duration::from_millis(50));
        assert_eq!(budget.refused(), 1);
        drop(held);
        // Room again.
        budget
            .read_body(Body::from(vec![b'x'; 600]), limits(1000))
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn a_waiting_body_gets_the_bytes_a_finished_one_gives_back() {
        let budget = BodyBudget::new(1000, Duration::from_secs(5));
        let held = budget
            .read_body(Body::from(vec![b'x'; 600]), limits(1000))
            .await
            .unwrap();
        let waiting = {
            let budget = budget.clone();
            tokio::spawn(async move { budget.read_body(Body::from(vec![b'x'; 600]), limits(1000)).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(held);
        assert_eq!(waiting.await.unwrap().unwrap().bytes.len(), 600);
    }

    #[tokio::test]
    async fn a_declared_body_over_the_limit_is_refused_before_it_takes_any_budget() {
        let budget = BodyBudget::new(10_000, Duration::from_millis(50));
        let e = budget
            .read_body(Body::from(vec![b'x'; 2000]), limits(1000))
            .await
            .unwrap_err();
        assert!(matches!(e, BodyError::TooLarge { limit: 1000 }), "{e}");
        assert_eq!(budget.available(), 10_000);
    }

    #[tokio::test]
    async fn a_body_larger_than_the_whole_budget_is_refused_at_once_as_too_large() {
        let budget = BodyBudget::new(1000, Duration::from_secs(5));
        let t0 = tokio::time::Instant::now();
        let e = budget
            .read_body(Body::from(vec![b'x'; 2000]), limits(4000))
            .await
            .unwrap_err();
        assert!(matches!(e, BodyError::TooLarge { limit: 1000 }), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(1));
    }

    #[tokio::test]
    async fn an_undeclared_body_pays_for_its_buffer_as_it_grows_and_stops_at_the_limit() {
        let budget = BodyBudget::new(1 << 20, Duration::from_millis(50));
        let read = budget
            .read_body(chunked(10, 10_000), limits(200_000))
            .await
            .unwrap();
        assert_eq!(read.bytes.len(), 100_000);
        // Doubling: the buffer (and what it holds of the budget) is under twice the body.
        assert!(
            read.permit.bytes() >= 100_000 && read.permit.bytes() < 200_000,
            "{}",
            read.permit.bytes()
        );
        assert_eq!(budget.available(), (1 << 20) - read.permit.bytes());
        let e = budget
            .read_body(chunked(30, 10_000), limits(200_000))
            .await
            .unwrap_err();
        assert!(matches!(e, BodyError::TooLarge { limit: 200_000 }), "{e}");
    }

    #[tokio::test]
    async fn an_undeclared_body_that_outgrows_the_room_left_is_refused_busy() {
        let budget = BodyBudget::new(100_000, Duration::from_millis(50));
        let _held = budget.reserve(60_000).await.unwrap();
        let e = budget
            .read_body(chunked(10, 10_000), limits(1 << 20))
            .await
            .unwrap_err();
        assert!(matches!(e, BodyError::Busy { .. }), "{e}");
        // What the refused body held is back.
        assert_eq!(budget.available(), 40_000);
    }

    #[tokio::test]
    async fn a_body_that_stops_arriving_times_out() {
        let budget = BodyBudget::new(1000, Duration::from_millis(50));
        let stalled = Body::from_stream(futures::stream::pending::<Result<Bytes, std::io::Error>>());
        let e = budget
            .read_body(
                stalled,
                BodyLimits {
                    max_bytes: 1000,
                    timeout: Duration::from_millis(50),
                },
            )
            .await
            .unwrap_err();
        assert!(matches!(e, BodyError::TimedOut { .. }), "{e}");
        assert_eq!(e.status(), StatusCode::REQUEST_TIMEOUT);
        assert_eq!(budget.available(), 1000);
    }
}
