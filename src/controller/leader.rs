//! Leader election with a `coordination.k8s.io/v1` Lease, so two controller replicas can run
//! and only one reconciles.
//!
//! The algorithm follows client-go's leaderelection: a follower takes the Lease over only
//! after it has seen the record unchanged for a whole `leaseDurationSeconds` measured on its
//! own clock (so clock skew between nodes does not matter); every write carries the
//! resourceVersion it read, so two candidates cannot both win; a leader that cannot renew
//! within the renew deadline steps down. Every Lease call is bounded by a timeout shorter
//! than the renew deadline (issue 22): a hung call ends as a failed attempt, so a leader
//! whose API server stalls steps down before a standby can take over (no split brain).

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use tokio::sync::watch;

use super::error::is_conflict;

/// Timing of the election (client-go's defaults).
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// How long a Lease stays valid after its last renewal.
    pub lease_duration: Duration,
    /// A leader that has not renewed for this long steps down.
    pub renew_deadline: Duration,
    /// Pause between attempts.
    pub retry_period: Duration,
    /// Longest one attempt (a read and a write of the Lease) may take; held below the
    /// renew deadline, and a leader's attempt also ends at its renew deadline.
    pub call_timeout: Duration,
}

impl Timing {
    /// The call timeout actually used: at most half the renew deadline.
    pub fn bounded_call_timeout(&self) -> Duration {
        self.call_timeout.min(self.renew_deadline / 2)
    }
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
            call_timeout: Duration::from_secs(4),
        }
    }
}

/// What to do with the Lease as last read.
#[derive(Debug, PartialEq, Eq)]
pub enum Decision {
    /// We hold it: write a new renewTime.
    Renew,
    /// Free or expired: write ourselves as holder.
    Acquire,
    /// Someone else holds a live Lease.
    Follow { holder: String },
}

/// Pure decision on a Lease spec. `unchanged_for` is how long this candidate has seen the
/// same (holder, renewTime) record on its own clock.
pub fn decide(
    spec: Option<&LeaseSpec>,
    me: &str,
    unchanged_for: Duration,
    lease_duration: Duration,
) -> Decision {
    let holder = spec
        .and_then(|s| s.holder_identity.clone())
        .filter(|h| !h.is_empty());
    match holder {
        None => Decision::Acquire,
        Some(h) if h == me => Decision::Renew,
        Some(_) if unchanged_for >= lease_duration => Decision::Acquire,
        Some(holder) => Decision::Follow { holder },
    }
}

/// One candidate for the Lease `name` in the Api's namespace.
pub struct Elector {
    api: Api<Lease>,
    name: String,
    identity: String,
    timing: Timing,
    /// (holder, renewTime) last seen and when it was first seen.
    observed: Option<(Option<String>, Option<MicroTime>, Instant)>,
}

impl Elector {
    pub fn new(
        api: Api<Lease>,
        name: impl Into<String>,
        identity: impl Into<String>,
        timing: Timing,
    ) -> Self {
        Elector {
            api,
            name: name.into(),
            identity: identity.into(),
            timing,
            observed: None,
        }
    }

    pub fn identity(&self) -> &str {
        &self.identity
    }

    fn lease_seconds(&self) -> i32 {
        i32::try_from(self.timing.lease_duration.as_secs()).unwrap_or(i32::MAX)
    }

    /// One attempt: true when we hold the Lease afterwards.
    pub async fn try_acquire_or_renew(&mut self) -> Result<bool, kube::Error> {
        let now = MicroTime(Timestamp::now());
        let Some(mut lease) = self.api.get_opt(&self.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.name.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(self.identity.clone()),
                    lease_duration_seconds: Some(self.lease_seconds()),
                    acquire_time: Some(now.clone()),
                    renew_time: Some(now),
                    lease_transitions: Some(0),
                    ..LeaseSpec::default()
                }),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(e) if is_conflict(&e) => Ok(false),
                Err(e) => Err(e),
            };
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let record = (spec.holder_identity.clone(), spec.renew_time.clone());
        let unchanged_for = match &self.observed {
            Some((h, r, since)) if (h, r) == (&record.0, &record.1) => since.elapsed(),
            _ => {
                self.observed = Some((record.0, record.1, Instant::now()));
                Duration::ZERO
            }
        };
        let mut new_spec = spec.clone();
        match decide(
            Some(&spec),
            &self.identity,
            unchanged_for,
            self.timing.lease_duration,
        ) {
            Decision::Follow { .. } => return Ok(false),
            Decision::Renew => {
                new_spec.renew_time = Some(now);
            }
            Decision::Acquire => {
                new_spec.holder_identity = Some(self.identity.clone());
                new_spec.acquire_time = Some(now.clone());
                new_spec.renew_time = Some(now);
                new_spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
            }
        }
        new_spec.lease_duration_seconds = Some(self.lease_seconds());
        lease.spec = Some(new_spec);
        // replace carries metadata.resourceVersion: a concurrent writer makes this a 409.
        match self.api.replace(&self.name, &PostParams::default(), &lease).await {
            Ok(_) => Ok(true),
            Err(e) if is_conflict(&e) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// [`Self::try_acquire_or_renew`] bounded by `budget`; a timeout is a failed attempt.
    async fn attempt(&mut self, budget: Duration) -> bool {
        match tokio::time::timeout(budget, self.try_acquire_or_renew()).await {
            Ok(Ok(held)) => held,
            Ok(Err(error)) => {
                tracing::warn!(%error, lease = %self.name, "cannot read or write the leader Lease");
                false
            }
            Err(_) => {
                tracing::warn!(lease = %self.name, timeout_s = budget.as_secs_f64(),
                    "the leader Lease call did not answer in time; the API server may be stalled");
                false
            }
        }
    }

    /// Gives the Lease up on shutdown so a standby takes over at once.
    pub async fn release(&mut self) -> Result<(), kube::Error> {
        let budget = self.timing.bounded_call_timeout();
        match tokio::time::timeout(budget, self.release_unbounded()).await {
            Ok(r) => r,
            Err(_) => Err(kube::Error::Service(
                format!("releasing the Lease took more than {budget:?}").into(),
            )),
        }
    }

    async fn release_unbounded(&mut self) -> Result<(), kube::Error> {
        let Some(mut lease) = self.api.get_opt(&self.name).await? else {
            return Ok(());
        };
        let mut spec = lease.spec.clone().unwrap_or_default();
        if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
            return Ok(());
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(MicroTime(Timestamp::now()));
        lease.spec = Some(spec);
        match self.api.replace(&self.name, &PostParams::default(), &lease).await {
            Ok(_) => Ok(()),
            Err(e) if is_conflict(&e) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Campaigns until `stop` is set, publishing leadership on `leading`. Once leadership is
    /// lost the loop ends (the caller exits so a fresh process campaigns again).
    pub async fn run(mut self, leading: watch::Sender<bool>, mut stop: watch::Receiver<bool>) {
        let mut last_renewed: Option<Instant> = None;
        let call_timeout = self.timing.bounded_call_timeout();
        loop {
            let was_leading = *leading.borrow();
            // A leader's attempt never runs past its renew deadline.
            let budget = match last_renewed.filter(|_| was_leading) {
                Some(t) => call_timeout.min(self.timing.renew_deadline.saturating_sub(t.elapsed())),
                None => call_timeout,
            };
            let held = if budget.is_zero() {
                false
            } else {
                self.attempt(budget).await
            };
            if held {
                last_renewed = Some(Instant::now());
                if !was_leading {
                    tracing::info!(identity = %self.identity, lease = %self.name, "became leader");
                    let _ = leading.send(true);
                }
            } else if was_leading && last_renewed.is_none_or(|t| t.elapsed() >= self.timing.renew_deadline) {
                tracing::error!(identity = %self.identity, "lost the leader Lease; stepping down");
                let _ = leading.send(false);
                return;
            }
            let pause = if *leading.borrow() {
                self.timing.retry_period.min(self.timing.renew_deadline / 3)
            } else {
                self.timing.retry_period
            };
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = stop.changed() => {
                    if *leading.borrow() {
                        if let Err(error) = self.release().await {
                            tracing::warn!(%error, "cannot release the leader Lease; the standby waits for it to expire");
                        }
                        let _ = leading.send(false);
                    }
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held_by(h: &str) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(h.into()),
            lease_duration_seconds: Some(15),
            ..LeaseSpec::default()
        }
    }
    const D: Duration = Duration::from_secs(15);

    // === a hung API server ===

    use http::{Request, Response};
    use kube::client::Body;
    use tower_test::mock;

    fn fast() -> Timing {
        Timing {
            lease_duration: Duration::from_millis(1500),
            renew_deadline: Duration::from_millis(1000),
            retry_period: Duration::from_millis(100),
            call_timeout: Duration::from_millis(300),
        }
    }

    fn lease_json(holder: &str) -> serde_json::Value {
        serde_json::json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": "kvfleet-controller", "namespace": "kvfleet", "resourceVersion": "1"},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": 1,
                     "renewTime": "2026-01-01T00:00:00.000000Z"}})
    }

    fn reply(code: u16, body: serde_json::Value) -> Response<Body> {
        Response::builder()
            .status(code)
            .body(Body::from(serde_json::to_vec(&body).unwrap()))
            .unwrap()
    }

    #[tokio::test]
    async fn a_leader_whose_lease_calls_hang_steps_down_within_the_renew_deadline() {
        let (service, mut handle) = mock::pair::<Request<Body>, Response<Body>>();
        let client = kube::Client::new(service, "kvfleet");
        let timing = fast();
        let elector = Elector::new(
            Api::<Lease>::namespaced(client, "kvfleet"),
            "kvfleet-controller",
            "a",
            timing,
        );
        let (leading_tx, mut leading_rx) = watch::channel(false);
        let (_stop_tx, stop_rx) = watch::channel(false);
        let task = tokio::spawn(elector.run(leading_tx, stop_rx));

        // No Lease yet: GET 404, then the create wins.
        let (req, send) = handle.next_request().await.unwrap();
        assert_eq!(req.method(), "GET");
        send.send_response(reply(
            404,
            serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404, "reason": "NotFound", "metadata": {}}),
        ));
        let (req, send) = handle.next_request().await.unwrap();
        assert_eq!(req.method(), "POST");
        send.send_response(reply(201, lease_json("a")));
        leading_rx.wait_for(|l| *l).await.unwrap();
        let renewed = Instant::now();

        // From now on the API server accepts requests and never answers them.
        let mut hung = Vec::new();
        let server = tokio::spawn(async move {
            while let Some((_req, send)) = handle.next_request().await {
                hung.push(send); // kept, so the call hangs instead of failing
            }
        });
        tokio::time::timeout(Duration::from_secs(5), leading_rx.wait_for(|l| !*l))
            .await
            .expect("the leader stepped down although every Lease call hangs")
            .ok();
        let stepped_down_after = renewed.elapsed();
        assert!(
            stepped_down_after < timing.lease_duration,
            "stepped down {stepped_down_after:?} after the last renewal: a standby may take over after {:?}, so two leaders acted",
            timing.lease_duration
        );
        assert!(
            stepped_down_after >= timing.renew_deadline - Duration::from_millis(50),
            "stepped down at {stepped_down_after:?}, before the renew deadline"
        );
        tokio::time::timeout(Duration::from_secs(1), task)
            .await
            .expect("the election loop ends after stepping down")
            .unwrap();
        server.abort();
    }

    #[tokio::test]
    async fn a_hung_release_returns_after_the_call_timeout() {
        let (service, mut handle) = mock::pair::<Request<Body>, Response<Body>>();
        let client = kube::Client::new(service, "kvfleet");
        let mut elector = Elector::new(
            Api::<Lease>::namespaced(client, "kvfleet"),
            "kvfleet-controller",
            "a",
            fast(),
        );
        let server = tokio::spawn(async move {
            let mut hung = Vec::new();
            while let Some((_req, send)) = handle.next_request().await {
                hung.push(send);
            }
        });
        let t = Instant::now();
        let err = elector.release().await.unwrap_err();
        assert!(t.elapsed() < Duration::from_millis(600), "{:?}", t.elapsed());
        assert!(err.to_string().contains("releasing the Lease"), "{err}");
        server.abort();
    }

    #[test]
    fn the_call_timeout_stays_below_the_renew_deadline() {
        let t = Timing {
            call_timeout: Duration::from_secs(60),
            ..Timing::default()
        };
        assert_eq!(t.bounded_call_timeout(), Duration::from_secs(5));
        assert!(Timing::default().bounded_call_timeout() < Timing::default().renew_deadline);
    }

    #[test]
    fn a_missing_or_empty_lease_is_acquired() {
        assert_eq!(decide(None, "a", Duration::ZERO, D), Decision::Acquire);
        assert_eq!(
            decide(Some(&held_by("")), "a", Duration::ZERO, D),
            Decision::Acquire
        );
    }

    #[test]
    fn our_own_lease_is_renewed() {
        assert_eq!(
            decide(Some(&held_by("a")), "a", Duration::from_secs(100), D),
            Decision::Renew
        );
    }

    #[test]
    fn a_live_lease_of_another_holder_is_followed_until_it_expires_on_our_clock() {
        assert_eq!(
            decide(Some(&held_by("b")), "a", Duration::from_secs(14), D),
            Decision::Follow { holder: "b".into() }
        );
        assert_eq!(
            decide(Some(&held_by("b")), "a", Duration::from_secs(15), D),
            Decision::Acquire
        );
    }
}
