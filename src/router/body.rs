//! Request bodies as the router reads them: each under a size and a time limit, all of them in
//! flight under one byte budget ([`crate::serving::body_budget`], the worker's and the
//! webhook's), so that clients that send part of a large body and stop can neither hold a
//! connection's memory for long nor add up past the pod's memory limit. A body refused for the
//! budget is answered 503 with Retry-After: another router replica, or this one a moment later,
//! takes it. A body's bytes stay reserved until its request is answered (its upstream request
//! holds a copy until the worker has read it).

use std::time::Duration;

use axum::body::{Body, Bytes};

use crate::serving::body_budget::{BodyBudget, BodyError, BodyPermit};

/// The default budget for request bodies in flight: with the default 4 MiB body limit, 16
/// whole largest bodies at once, or thousands of ordinary ones (a 4,000-token chat is ~20 KiB);
/// with the router's own working set (the tokenizer ~10 MiB, the prefix indexes) it stays well
/// under a 256 MiB memory limit.
pub const DEFAULT_BUDGET_BYTES: usize = 64 << 20;

/// What a client gets to send its whole body (as the worker: `ApiLimits::body_timeout`).
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(30);

/// The limits every body is read under.
#[derive(Clone)]
pub struct BodyLimits {
    pub max_bytes: usize,
    pub timeout: Duration,
    budget: BodyBudget,
}

/// The label of `kvfleet_router_refused_requests_total` for a refused body.
pub fn metric_label(e: &BodyError) -> &'static str {
    match e {
        BodyError::TooLarge { .. } => "body_too_large",
        BodyError::TimedOut { .. } => "body_timeout",
        BodyError::Busy { .. } => "body_budget",
        BodyError::Read { .. } => "body_read",
    }
}

impl BodyLimits {
    pub fn new(max_bytes: usize, timeout: Duration, budget_bytes: usize) -> Self {
        BodyLimits {
            max_bytes,
            timeout,
            budget: BodyBudget::new(budget_bytes, crate::serving::body_budget::DEFAULT_WAIT),
        }
    }

    /// Bytes of bodies in flight now.
    pub fn in_flight(&self) -> usize {
        self.budget.bytes().saturating_sub(self.budget.available())
    }

    /// Reads `body` under the limits; its bytes stay reserved while the permit lives.
    pub async fn read(&self, body: Body) -> Result<(Bytes, BodyPermit), BodyError> {
        let limits = crate::serving::body_budget::BodyLimits {
            max_bytes: self.max_bytes,
            timeout: self.timeout,
        };
        let b = self.budget.read_body(body, limits).await?;
        Ok((b.bytes, b.permit))
    }
}
