//! Scale from zero: while no replica is ready, generation requests wait here, in a bounded
//! queue, and leave in arrival order once one is. What they wait with is the demand signal the
//! controller's autoscaler reads (`/v1/router/state`'s `held`, and the
//! `kvfleet_router_held_*` gauges): how many are held and how much KV they need to finish.
//!
//! A held request leaves the queue in one of four ways: its turn comes while a replica is
//! ready (forwarded), the queue was full when it came (503 `hold_queue_full`), it waited
//! `timeout` (503 `hold_timeout`), or its client went away (its handler future is dropped with
//! its [`Ticket`]).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde_json::Value;
use tokio::sync::watch;
use tokio::time::Instant;

use super::metrics::RouterMetrics;
use crate::serving::openai::{DEFAULT_CHAT_MAX_TOKENS, DEFAULT_COMPLETION_MAX_TOKENS};

/// `Retry-After` of a 503 from the hold: a replica starting from zero takes seconds.
pub const RETRY_AFTER_SECONDS: u64 = 5;

/// The flags' bounds (`--hold-max-requests`, `--hold-timeout-seconds`).
pub const MAX_REQUESTS_RANGE: std::ops::RangeInclusive<u64> = 1..=65_536;
pub const TIMEOUT_SECONDS_RANGE: std::ops::RangeInclusive<u64> = 1..=3_600;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HoldLimits {
    /// Requests held at once; one more is refused.
    pub max_requests: usize,
    /// Longest a request is held.
    pub timeout: Duration,
}

/// What one request needs of a replica's KV.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Demand {
    pub prompt_tokens: usize,
    /// Prompt plus output limit, capped at maxModelLen: the KV it holds when it finishes.
    pub demand_tokens: usize,
}

impl Demand {
    /// The demand of a request `body` whose prompt is `prompt_tokens` long. The output limit is
    /// `max_completion_tokens`, else `max_tokens`, else the worker's default for the endpoint
    /// (as the worker decides it); a field the worker would refuse counts as absent (the worker
    /// answers the error once it is forwarded). `max_model_len` 0: no cap.
    pub fn of(body: &[u8], chat: bool, prompt_tokens: usize, max_model_len: usize) -> Self {
        let fields = serde_json::from_slice::<Value>(body).ok();
        let limit = |name: &str| {
            fields
                .as_ref()
                .and_then(|f| f.get(name))
                .and_then(Value::as_u64)
                .filter(|n| *n >= 1)
                .map(|n| usize::try_from(n).unwrap_or(usize::MAX))
        };
        let output = limit("max_completion_tokens")
            .or_else(|| limit("max_tokens"))
            .unwrap_or(if chat {
                DEFAULT_CHAT_MAX_TOKENS
            } else {
                DEFAULT_COMPLETION_MAX_TOKENS
            });
        let cap = if max_model_len == 0 {
            usize::MAX
        } else {
            max_model_len
        };
        Self {
            prompt_tokens,
            demand_tokens: prompt_tokens.saturating_add(output).min(cap),
        }
    }
}

/// Why a request was answered 503 instead of being forwarded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rejection {
    /// `max_requests` were already held when it came.
    QueueFull { max_requests: usize },
    /// No replica became ready within the timeout.
    Timeout { after: Duration },
}

impl Rejection {
    /// The `reason` label of `kvfleet_router_hold_rejected_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            Rejection::QueueFull { .. } => "queue_full",
            Rejection::Timeout { .. } => "timeout",
        }
    }

    /// The OpenAI error's `code`.
    pub fn code(&self) -> &'static str {
        match self {
            Rejection::QueueFull { .. } => "hold_queue_full",
            Rejection::Timeout { .. } => "hold_timeout",
        }
    }

    pub fn message(&self) -> String {
        match self {
            Rejection::QueueFull { max_requests } => format!(
                "no replica is ready and {max_requests} requests are already held waiting for one \
                 (--hold-max-requests); retry after the Retry-After seconds"
            ),
            Rejection::Timeout { after } => format!(
                "no replica became ready within {} s while this request was held \
                 (--hold-timeout-seconds); the deployment may be scaling from zero: retry after \
                 the Retry-After seconds",
                after.as_secs()
            ),
        }
    }
}

/// The held requests at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Snapshot {
    pub requests: usize,
    pub prompt_tokens: usize,
    pub demand_tokens: usize,
    /// How long the oldest has waited (0 when none).
    pub oldest_seconds: f64,
}

struct Held {
    id: u64,
    since: Instant,
    demand: Demand,
}

#[derive(Default)]
struct Queue {
    next_id: u64,
    /// Arrival order: the front goes first.
    held: VecDeque<Held>,
}

pub struct Hold {
    limits: HoldLimits,
    queue: Mutex<Queue>,
    /// Bumped whenever a request leaves the queue: the next one may be at the front now.
    turn: watch::Sender<u64>,
    metrics: Arc<RouterMetrics>,
}

/// A place in the queue; leaving it (drop) takes the request's demand out of the figures and
/// lets the next one go.
pub struct Ticket {
    hold: Arc<Hold>,
    id: u64,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut q = self.hold.lock();
        if let Some(i) = q.held.iter().position(|h| h.id == self.id) {
            q.held.remove(i);
        }
        self.hold.publish(&q);
        drop(q);
        self.hold.turn.send_modify(|t| *t = t.wrapping_add(1));
    }
}

impl Hold {
    pub fn new(limits: HoldLimits, metrics: Arc<RouterMetrics>) -> Arc<Self> {
        Arc::new(Self {
            limits,
            queue: Mutex::new(Queue::default()),
            turn: watch::Sender::new(0),
            metrics,
        })
    }

    pub fn limits(&self) -> HoldLimits {
        self.limits
    }

    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether no request is held (a new one may pass the queue only then: arrival order).
    pub fn is_empty(&self) -> bool {
        self.lock().held.is_empty()
    }

    pub fn snapshot(&self) -> Snapshot {
        let q = self.lock();
        Snapshot {
            requests: q.held.len(),
            prompt_tokens: q.held.iter().map(|h| h.demand.prompt_tokens).sum(),
            demand_tokens: q.held.iter().map(|h| h.demand.demand_tokens).sum(),
            oldest_seconds: q.held.front().map_or(0.0, |h| h.since.elapsed().as_secs_f64()),
        }
    }

    fn publish(&self, q: &Queue) {
        let demand: usize = q.held.iter().map(|h| h.demand.demand_tokens).sum();
        self.metrics.held_requests.set(q.held.len() as i64);
        self.metrics
            .held_demand_tokens
            .set(i64::try_from(demand).unwrap_or(i64::MAX));
    }

    /// Holds a request until it is at the front of the queue while `ready()` says a replica is
    /// ready; `replicas` changes whenever that may have become true. The ticket it returns keeps
    /// the request at the front until dropped, so the caller drops it once the request is
    /// placed on a replica and the next one goes after it.
    pub async fn wait(
        self: &Arc<Self>,
        demand: Demand,
        mut replicas: watch::Receiver<u64>,
        ready: impl Fn() -> bool,
    ) -> Result<Ticket, Rejection> {
        let since = Instant::now();
        let ticket = {
            let mut q = self.lock();
            if q.held.len() >= self.limits.max_requests {
                drop(q);
                return Err(self.reject(Rejection::QueueFull {
                    max_requests: self.limits.max_requests,
                }));
            }
            let id = q.next_id;
            q.next_id += 1;
            q.held.push_back(Held { id, since, demand });
            self.publish(&q);
            Ticket {
                hold: self.clone(),
                id,
            }
        };
        let deadline = since + self.limits.timeout;
        let mut turns = self.turn.subscribe();
        loop {
            // Seen before the check: a change after it wakes the select below.
            replicas.borrow_and_update();
            turns.borrow_and_update();
            let first = self.lock().held.front().map(|h| h.id) == Some(ticket.id);
            if first && ready() {
                self.metrics.hold_seconds.observe(since.elapsed().as_secs_f64());
                return Ok(ticket);
            }
            tokio::select! {
                changed = replicas.changed() => {
                    if changed.is_err() {
                        // No one signals replicas any more: look now and then.
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
                _ = turns.changed() => {}
                _ = tokio::time::sleep_until(deadline) => {
                    drop(ticket);
                    return Err(self.reject(Rejection::Timeout { after: self.limits.timeout }));
                }
            }
        }
    }

    fn reject(&self, r: Rejection) -> Rejection {
        self.metrics.hold_rejected.with_label_values(&[r.reason()]).inc();
        r
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    fn hold(max_requests: usize, timeout: Duration) -> Arc<Hold> {
        Hold::new(
            HoldLimits {
                max_requests,
                timeout,
            },
            Arc::new(RouterMetrics::new().unwrap()),
        )
    }

    fn demand(n: usize) -> Demand {
        Demand {
            prompt_tokens: n,
            demand_tokens: 2 * n,
        }
    }

    #[test]
    fn demand_is_prompt_plus_the_output_limit_capped_at_max_model_len() {
        let d =
            |body: &str, chat: bool, cap: usize| Demand::of(body.as_bytes(), chat, 100, cap).demand_tokens;
        assert_eq!(d(r#"{"max_tokens": 20}"#, false, 4096), 120);
        assert_eq!(
            d(r#"{"max_tokens": 20, "max_completion_tokens": 30}"#, true, 4096),
            130,
            "max_completion_tokens wins, as in the worker"
        );
        assert_eq!(d(r#"{}"#, false, 4096), 100 + DEFAULT_COMPLETION_MAX_TOKENS);
        assert_eq!(d(r#"{}"#, true, 4096), 100 + DEFAULT_CHAT_MAX_TOKENS);
        assert_eq!(
            d(r#"{"max_tokens": 0}"#, true, 4096),
            100 + DEFAULT_CHAT_MAX_TOKENS,
            "refused by the worker"
        );
        assert_eq!(d(r#"{"max_tokens": 100000}"#, false, 4096), 4096);
        assert_eq!(d(r#"{}"#, true, 512), 512);
        assert_eq!(d("not json", false, 0), 100 + DEFAULT_COMPLETION_MAX_TOKENS);
        assert_eq!(Demand::of(b"{}", false, 7, 4096).prompt_tokens, 7);
    }

    #[tokio::test(start_paused = true)]
    async fn held_requests_leave_in_arrival_order_once_a_replica_is_ready() {
        let h = hold(8, Duration::from_secs(60));
        let (tx, rx) = watch::channel(0u64);
        let ready = Arc::new(AtomicBool::new(false));
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for i in 0..4usize {
            let (h2, rx, ready, order) = (h.clone(), rx.clone(), ready.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let t = h2
                    .wait(demand(10 + i), rx, move || ready.load(Ordering::SeqCst))
                    .await
                    .unwrap();
                // Placed on a replica a while later: the next must not overtake it.
                tokio::time::sleep(Duration::from_millis(5)).await;
                order.lock().unwrap().push(i);
                drop(t);
            }));
            // Each one queued before the next arrives.
            while h.snapshot().requests <= i {
                tokio::task::yield_now().await;
            }
        }
        let s = h.snapshot();
        assert_eq!((s.requests, s.prompt_tokens, s.demand_tokens), (4, 46, 92));
        assert_eq!(h.metrics.held_demand_tokens.get(), 92);
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(h.snapshot().oldest_seconds >= 3.0);
        assert!(
            order.lock().unwrap().is_empty(),
            "nothing leaves while no replica is ready"
        );
        ready.store(true, Ordering::SeqCst);
        tx.send_modify(|v| *v += 1);
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), [0, 1, 2, 3]);
        assert_eq!(h.snapshot(), Snapshot::default());
        assert_eq!(h.metrics.held_requests.get(), 0);
        assert_eq!(h.metrics.hold_seconds.get_sample_count(), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_queue_refuses_and_a_late_replica_times_out_and_a_dropped_wait_leaves() {
        let h = hold(2, Duration::from_secs(10));
        let (_tx, rx) = watch::channel(0u64);
        let first = tokio::spawn({
            let (h, rx) = (h.clone(), rx.clone());
            async move { h.wait(demand(5), rx, || false).await.map(|_| ()) }
        });
        let second = tokio::spawn({
            let (h, rx) = (h.clone(), rx.clone());
            async move { h.wait(demand(7), rx, || false).await.map(|_| ()) }
        });
        while h.snapshot().requests < 2 {
            tokio::task::yield_now().await;
        }
        let full = h.wait(demand(1), rx.clone(), || true).await.err();
        assert_eq!(full, Some(Rejection::QueueFull { max_requests: 2 }));
        assert_eq!(h.snapshot().demand_tokens, 24, "the refused one is not counted");
        // A client that goes away: its wait is dropped, and with it its demand.
        second.abort();
        assert!(second.await.unwrap_err().is_cancelled());
        assert_eq!(h.snapshot().demand_tokens, 10);
        assert_eq!(
            first.await.unwrap(),
            Err(Rejection::Timeout {
                after: Duration::from_secs(10)
            })
        );
        assert_eq!(h.snapshot(), Snapshot::default());
        let rejected = |r: &str| h.metrics.hold_rejected.with_label_values(&[r]).get();
        assert_eq!((rejected("queue_full"), rejected("timeout")), (1, 1));
        assert_eq!(h.metrics.hold_seconds.get_sample_count(), 0);
    }
}
