//! The replicas behind the router: who they are (EndpointSlices, or a static list), what their
//! prefix caches hold (a KV-event subscription each) and how loaded they are (a `/v1/capacity`
//! scrape each at a short interval).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use futures::StreamExt;
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde_json::Value;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::index::PodIndex;
use super::metrics::RouterMetrics;
use super::HttpClient;

/// Where one replica answers.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Endpoint {
    /// Pod name (its URL outside Kubernetes).
    pub name: String,
    /// Base URL of its API, e.g. `http://10.0.0.7:8000`.
    pub url: String,
    /// Its KV-event publisher, e.g. `tcp://10.0.0.7:5557` (`None`: route on load only).
    pub kv_events: Option<String>,
}

/// What the last scrape of a replica's `/v1/capacity` said.
#[derive(Clone, Debug, Default)]
pub struct Load {
    pub running: usize,
    pub waiting: usize,
    pub free_tokens: usize,
    pub max_num_seqs: usize,
    pub block_size: usize,
    /// KV pages of its pools (all groups): its prefix cache holds no more blocks.
    pub total_blocks: usize,
    /// Its maxModelLen.
    pub max_model_len: usize,
    /// Differs from one process to the next: a change means it restarted with an empty cache.
    pub start_id: Option<String>,
    pub at: Option<Instant>,
}

/// What a `/v1/capacity` answer may take, body included: a replica that accepts and then
/// stalls, or trickles its body, counts as not answering after this.
pub const SCRAPE_TIMEOUT: Duration = Duration::from_secs(2);

/// The largest `/v1/capacity` body read (a worker's is a few KiB).
const MAX_SCRAPE_BYTES: usize = 1 << 20;

/// One replica and what the router knows of it.
pub struct Upstream {
    pub endpoint: Endpoint,
    pub index: Mutex<PodIndex>,
    pub load: Mutex<Load>,
    /// Requests sent and not finished.
    pub inflight: AtomicUsize,
    /// Prompt tokens sent since the last scrape (taken off its free tokens until the next).
    pub sent_tokens: AtomicUsize,
    /// Requests of this router that finished there since the last scrape (taken off the
    /// running and waiting it reported until the next: a request answered right after a scrape
    /// would otherwise count as busy for a whole interval).
    pub finished: AtomicUsize,
    pub subscribed: AtomicBool,
    /// Its last `/v1/capacity` scrape succeeded: it is ready (held requests wait for one).
    pub answering: AtomicBool,
    /// Bumped each time it is marked down (its scrape failed for the down-after time): the
    /// requests in flight on it watch this and fail over or end.
    pub down: watch::Sender<u64>,
    /// Marked down and not answering since.
    pub is_down: AtomicBool,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

impl Drop for Upstream {
    fn drop(&mut self) {
        if let Ok(tasks) = self.tasks.get_mut() {
            for t in tasks.drain(..) {
                t.abort();
            }
        }
    }
}

impl super::events::Replica for Upstream {
    fn name(&self) -> &str {
        &self.endpoint.name
    }

    fn index(&self) -> &Mutex<PodIndex> {
        &self.index
    }

    fn set_subscribed(&self, subscribed: bool) {
        self.subscribed.store(subscribed, Ordering::Relaxed);
    }
}

/// Every replica the router may send to, by name.
pub struct Fleet {
    replicas: RwLock<BTreeMap<String, Arc<Upstream>>>,
    client: HttpClient,
    metrics: Arc<RouterMetrics>,
    scrape_every: Duration,
    down_after: Duration,
    /// Bumped whenever the set of replicas or one's readiness changes (wakes held requests).
    changes: watch::Sender<u64>,
}

impl Fleet {
    /// A replica whose scrape fails for `down_after` on end is marked down.
    pub fn new(
        client: HttpClient,
        metrics: Arc<RouterMetrics>,
        scrape_every: Duration,
        down_after: Duration,
    ) -> Arc<Self> {
        Arc::new(Self {
            replicas: RwLock::new(BTreeMap::new()),
            client,
            metrics,
            scrape_every,
            down_after,
            changes: watch::Sender::new(0),
        })
    }

    /// Changes whenever a replica comes, goes, or starts or stops answering its scrape.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// Replicas whose last capacity scrape succeeded.
    pub fn answering(&self) -> usize {
        self.replicas
            .read()
            .map(|r| r.values().filter(|u| u.answering.load(Ordering::Relaxed)).count())
            .unwrap_or(0)
    }

    /// The ready replicas now.
    pub fn ready(&self) -> Vec<Arc<Upstream>> {
        self.replicas
            .read()
            .map(|r| r.values().cloned().collect())
            .unwrap_or_default()
    }

    /// The replicas not marked down (all of them when every one is: a request then tries
    /// them rather than fail at once). A replica marked down gets no new request until its
    /// scrape answers again; one whose scrape just failed still does (a killed worker refuses
    /// the connection and the request goes to the next one; a stalled one is marked down
    /// within the down-after time, and the requests on it fail over then).
    pub fn routable(&self) -> Vec<Arc<Upstream>> {
        let all = self.ready();
        let up: Vec<_> = all
            .iter()
            .filter(|u| !u.is_down.load(Ordering::Relaxed))
            .cloned()
            .collect();
        if up.is_empty() {
            all
        } else {
            up
        }
    }

    /// Makes the set of replicas `wanted`: new ones get a subscription and a scraper, gone ones
    /// lose theirs (their in-flight requests finish on their own connections).
    pub fn sync(self: &Arc<Self>, wanted: Vec<Endpoint>) {
        let Ok(mut replicas) = self.replicas.write() else {
            return;
        };
        let keep: BTreeMap<String, Endpoint> = wanted.into_iter().map(|e| (e.name.clone(), e)).collect();
        replicas.retain(|name, u| keep.get(name).is_some_and(|e| e == &u.endpoint));
        for (name, endpoint) in keep {
            if replicas.contains_key(&name) {
                continue;
            }
            tracing::info!(replica = %name, url = %endpoint.url, kv_events = ?endpoint.kv_events, "replica added");
            let u = Arc::new(Upstream {
                endpoint: endpoint.clone(),
                index: Mutex::new(PodIndex::default()),
                load: Mutex::new(Load::default()),
                inflight: AtomicUsize::new(0),
                sent_tokens: AtomicUsize::new(0),
                finished: AtomicUsize::new(0),
                subscribed: AtomicBool::new(false),
                answering: AtomicBool::new(false),
                down: watch::Sender::new(0),
                is_down: AtomicBool::new(false),
                tasks: Mutex::new(Vec::new()),
            });
            let weak = Arc::downgrade(&u);
            let mut tasks = vec![tokio::spawn(scrape(
                weak.clone(),
                self.client.clone(),
                Scraping {
                    every: self.scrape_every,
                    down_after: self.down_after,
                    changes: self.changes.clone(),
                    metrics: self.metrics.clone(),
                },
            ))];
            if let Some(ep) = endpoint.kv_events {
                tasks.push(tokio::spawn(super::events::subscribe(
                    weak,
                    ep,
                    self.metrics.clone(),
                )));
            }
            if let Ok(mut t) = u.tasks.lock() {
                *t = tasks;
            }
            replicas.insert(name, u);
        }
        self.metrics
            .replicas
            .with_label_values(&["ready"])
            .set(replicas.len() as i64);
        drop(replicas);
        self.changes.send_modify(|c| *c = c.wrapping_add(1));
    }

    /// Refreshes the per-state replica gauges.
    pub fn observe(&self) {
        let all = self.ready();
        let subscribed = all
            .iter()
            .filter(|u| u.subscribed.load(Ordering::Relaxed))
            .count();
        let scraped = all
            .iter()
            .filter(|u| u.load.lock().is_ok_and(|l| l.at.is_some()))
            .count();
        let answering = all.iter().filter(|u| u.answering.load(Ordering::Relaxed)).count();
        self.metrics
            .replicas
            .with_label_values(&["ready"])
            .set(all.len() as i64);
        self.metrics
            .replicas
            .with_label_values(&["subscribed"])
            .set(subscribed as i64);
        self.metrics
            .replicas
            .with_label_values(&["scraped"])
            .set(scraped as i64);
        self.metrics
            .replicas
            .with_label_values(&["answering"])
            .set(answering as i64);
    }
}

/// How a replica's scraper runs.
struct Scraping {
    every: Duration,
    down_after: Duration,
    /// Hears when a replica starts or stops answering.
    changes: watch::Sender<u64>,
    metrics: Arc<RouterMetrics>,
}

/// Reads one replica's `/v1/capacity` every `every` until the replica goes. A failed scrape
/// takes it out of new requests' way at once; failing for `down_after` on end marks it down:
/// its requests in flight fail over or end (a stalled or killed worker frees its clients
/// within seconds instead of at their own timeouts). A new start id clears its prefix index.
async fn scrape(u: std::sync::Weak<Upstream>, client: HttpClient, how: Scraping) {
    let flip = |u: &Upstream, now: bool| {
        if u.answering.swap(now, Ordering::Relaxed) != now {
            tracing::info!(replica = %u.endpoint.name, answering = now, "capacity scrape");
            how.changes.send_modify(|c| *c = c.wrapping_add(1));
        }
    };
    let mut tick = tokio::time::interval(how.every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing_since: Option<Instant> = None;
    let mut marked_down = false;
    let mut evicted_seen = 0;
    loop {
        tick.tick().await;
        let Some(url) = u.upgrade().map(|u| format!("{}/v1/capacity", u.endpoint.url)) else {
            return;
        };
        let started = Instant::now();
        let scraped = tokio::time::timeout(SCRAPE_TIMEOUT, fetch_load(&client, &url))
            .await
            .unwrap_or_else(|_| Err(format!("no whole answer within {SCRAPE_TIMEOUT:?}")));
        let load = match scraped {
            Ok(l) => l,
            Err(error) => {
                tracing::debug!(%url, %error, "capacity scrape failed");
                let Some(u) = u.upgrade() else { return };
                flip(&u, false);
                // Failing since the start of the first failed scrape: a replica that stalls is
                // down after two timed-out scrapes with the default 3 s, not three.
                let since = *failing_since.get_or_insert(started);
                if !marked_down && since.elapsed() >= how.down_after {
                    marked_down = true;
                    tracing::warn!(replica = %u.endpoint.name, %error, down_after_ms = how.down_after.as_millis() as u64,
                        "replica marked down: its requests in flight fail over or end");
                    how.metrics
                        .replicas_down
                        .with_label_values(&[&u.endpoint.name])
                        .inc();
                    u.is_down.store(true, Ordering::Relaxed);
                    u.down.send_modify(|d| *d = d.wrapping_add(1));
                }
                continue;
            }
        };
        failing_since = None;
        marked_down = false;
        let Some(u) = u.upgrade() else { return };
        u.is_down.store(false, Ordering::Relaxed);
        u.sent_tokens.store(0, Ordering::Relaxed);
        u.finished.store(0, Ordering::Relaxed);
        let restarted = {
            let mut l = u.load.lock().unwrap_or_else(|e| e.into_inner());
            let restarted = l.start_id.is_some() && load.start_id.is_some() && l.start_id != load.start_id;
            *l = load.clone();
            restarted
        };
        if let Ok(mut idx) = u.index.lock() {
            if restarted {
                tracing::info!(replica = %u.endpoint.name, "replica restarted: its prefix index is cleared");
                idx.clear();
                how.metrics.index_cleared.with_label_values(&["restart"]).inc();
            }
            if load.total_blocks > 0 {
                let max = super::index::max_blocks_for(load.total_blocks);
                if idx.max_blocks() != max {
                    idx.set_max_blocks(max);
                }
            }
            // Evictions happen as events arrive; counted here, off the subscriber's path.
            how.metrics
                .index_evicted_blocks
                .inc_by(idx.evicted.saturating_sub(evicted_seen));
            evicted_seen = idx.evicted;
        }
        flip(&u, true);
    }
}

async fn fetch_load(client: &HttpClient, url: &str) -> Result<Load, String> {
    let req = http::Request::get(url)
        .body(axum::body::Body::empty())
        .map_err(|e| e.to_string())?;
    let resp = client.request(req).await.map_err(|e| e.to_string())?;
    if !resp.status().is_success() {
        return Err(format!("status {}", resp.status()));
    }
    let body = http_body_util::Limited::new(resp.into_body(), MAX_SCRAPE_BYTES)
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    let v: Value = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
    let n = |v: Option<&Value>| v.and_then(Value::as_u64).unwrap_or(0) as usize;
    let live = v.get("live");
    Ok(Load {
        running: n(live.and_then(|l| l.get("running"))),
        waiting: n(live.and_then(|l| l.get("waiting"))),
        free_tokens: n(live.and_then(|l| l.get("freeTokens"))),
        max_num_seqs: n(v.get("maxNumSeqs")),
        block_size: n(v.get("blockSize")),
        total_blocks: n(v.get("totalBlocks")),
        max_model_len: n(v.get("maxModelLen")),
        start_id: v.get("startId").and_then(Value::as_str).map(str::to_string),
        at: Some(Instant::now()),
    })
}

/// The ready endpoints of a Service's EndpointSlices: each ready endpoint's first address, the
/// slice's port named `http` (else its first) and `kv-events`, its pod's name.
pub fn endpoints_of(slices: &[Arc<EndpointSlice>]) -> Vec<Endpoint> {
    let mut out = Vec::new();
    for s in slices {
        let ports = s.ports.as_deref().unwrap_or_default();
        let port_named = |n: &str| {
            ports
                .iter()
                .find(|p| p.name.as_deref() == Some(n))
                .and_then(|p| p.port)
        };
        let Some(http_port) = port_named("http").or_else(|| ports.first().and_then(|p| p.port)) else {
            continue;
        };
        let kv_port = port_named("kv-events");
        let v6 = s.address_type == "IPv6";
        for e in &s.endpoints {
            // The API reads an absent `ready` as ready.
            if e.conditions.as_ref().and_then(|c| c.ready) == Some(false) {
                continue;
            }
            let Some(addr) = e.addresses.first() else { continue };
            let host = if v6 { format!("[{addr}]") } else { addr.clone() };
            let name = e
                .target_ref
                .as_ref()
                .and_then(|r| r.name.clone())
                .unwrap_or_else(|| addr.clone());
            out.push(Endpoint {
                name,
                url: format!("http://{host}:{http_port}"),
                kv_events: kv_port.map(|p| format!("tcp://{host}:{p}")),
            });
        }
    }
    out.sort();
    out.dedup_by(|a, b| a.name == b.name);
    out
}

/// Keeps `fleet` equal to the ready endpoints of Service `service` in `namespace`.
pub async fn watch_endpoint_slices(
    fleet: Arc<Fleet>,
    client: kube::Client,
    namespace: String,
    service: String,
) {
    use kube::runtime::{reflector, watcher, WatchStreamExt};
    let api: kube::Api<EndpointSlice> = kube::Api::namespaced(client, &namespace);
    let cfg = watcher::Config::default().labels(&format!("kubernetes.io/service-name={service}"));
    let (reader, writer) = reflector::store();
    let mut stream = reflector(writer, watcher(api, cfg)).default_backoff().boxed();
    while let Some(event) = stream.next().await {
        match event {
            Ok(_) => fleet.sync(endpoints_of(&reader.state())),
            Err(error) => tracing::warn!(%error, %service, "EndpointSlice watch error; retrying"),
        }
    }
}

/// A client for upstream HTTP/1.1 with pooled connections.
pub fn http_client() -> HttpClient {
    let mut connector = hyper_util::client::legacy::connect::HttpConnector::new();
    connector.set_connect_timeout(Some(Duration::from_secs(2)));
    connector.set_nodelay(true);
    Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(60))
        .pool_max_idle_per_host(1024)
        .build(connector)
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::ObjectReference;
    use k8s_openapi::api::discovery::v1::{Endpoint as SliceEndpoint, EndpointConditions, EndpointPort};

    use super::*;

    fn endpoint(addr: &str, pod: &str, ready: Option<bool>) -> SliceEndpoint {
        SliceEndpoint {
            addresses: vec![addr.into()],
            conditions: Some(EndpointConditions {
                ready,
                ..Default::default()
            }),
            target_ref: Some(ObjectReference {
                name: Some(pod.into()),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn a_replica_that_goes_mid_request_leaves_the_set_and_its_request_finishes_on_it() {
        let metrics = Arc::new(RouterMetrics::new().unwrap());
        let fleet = Fleet::new(
            http_client(),
            metrics,
            Duration::from_secs(3600),
            Duration::from_secs(3),
        );
        let ep = |n: &str| Endpoint {
            name: n.into(),
            url: format!("http://127.0.0.1:9/{n}"),
            kv_events: None,
        };
        fleet.sync(vec![ep("a"), ep("b")]);
        let a = fleet
            .ready()
            .into_iter()
            .find(|u| u.endpoint.name == "a")
            .unwrap();
        a.inflight.fetch_add(1, Ordering::Relaxed); // a request in flight on `a`
        a.index.lock().unwrap().expect(&[1, 2, 3], Instant::now());
        fleet.sync(vec![ep("b")]);
        let names: Vec<String> = fleet.ready().iter().map(|u| u.endpoint.name.clone()).collect();
        assert_eq!(names, ["b"], "new requests no longer see `a`");
        // The request still holds `a` and ends on it; nothing else refers to it.
        assert_eq!(a.index.lock().unwrap().leading_hits(&[1, 2, 3]), 3);
        a.inflight.fetch_sub(1, Ordering::Relaxed);
        assert_eq!(Arc::strong_count(&a), 1);
        // A replica that comes back is a new one: its index starts empty.
        fleet.sync(vec![ep("a"), ep("b")]);
        let again = fleet
            .ready()
            .into_iter()
            .find(|u| u.endpoint.name == "a")
            .unwrap();
        assert!(!Arc::ptr_eq(&a, &again));
        assert!(again.index.lock().unwrap().is_empty());
        // Its address changed: replaced, not kept.
        let mut moved = ep("b");
        moved.url = "http://127.0.0.1:10/b".into();
        let b = fleet
            .ready()
            .into_iter()
            .find(|u| u.endpoint.name == "b")
            .unwrap();
        fleet.sync(vec![ep("a"), moved]);
        let b2 = fleet
            .ready()
            .into_iter()
            .find(|u| u.endpoint.name == "b")
            .unwrap();
        assert!(!Arc::ptr_eq(&b, &b2));
        assert_eq!(b2.endpoint.url, "http://127.0.0.1:10/b");
    }

    #[test]
    fn ready_endpoints_with_their_named_ports() {
        let port = |name: &str, p: i32| EndpointPort {
            name: Some(name.into()),
            port: Some(p),
            ..Default::default()
        };
        let slice = EndpointSlice {
            address_type: "IPv4".into(),
            endpoints: vec![
                endpoint("10.0.0.2", "w-1", Some(true)),
                endpoint("10.0.0.3", "w-2", Some(false)),
                endpoint("10.0.0.1", "w-0", None),
            ],
            ports: Some(vec![port("kv-events", 5557), port("http", 8000)]),
            ..Default::default()
        };
        let got = endpoints_of(&[Arc::new(slice)]);
        let names: Vec<&str> = got.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["w-0", "w-1"], "the not-ready endpoint is left out");
        assert_eq!(got[1].url, "http://10.0.0.2:8000");
        assert_eq!(got[1].kv_events.as_deref(), Some("tcp://10.0.0.2:5557"));
        // No kv-events port: routed on load only; IPv6 addresses bracketed.
        let slice = EndpointSlice {
            address_type: "IPv6".into(),
            endpoints: vec![endpoint("fd00::5", "w-5", Some(true))],
            ports: Some(vec![port("api", 9000)]),
            ..Default::default()
        };
        let got = endpoints_of(&[Arc::new(slice)]);
        assert_eq!(got[0].url, "http://[fd00::5]:9000");
        assert_eq!(got[0].kv_events, None);
    }
}
