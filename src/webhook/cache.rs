//! The webhook's view of the cluster: a reflector store of Nodes fed by a watch, whether the
//! API server serves InferencePools and KEDA ScaledObjects (asked by discovery every
//! [`API_PROBE_INTERVAL`]), and
//! the [`ClusterFacts`] derived from both. No API call happens on the request path: a request
//! reads an `Arc` snapshot that is rebuilt only after a node's GPU facts or a served API
//! changed.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Node;
use kube::api::ListParams;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::Api;

use crate::validate::{ClusterFacts, NodeFacts};

/// The cache is stale (readiness fails) when the API server has not answered the watch
/// or a probe for this long: 3 missed [`PROBE_INTERVAL`]s.
pub const STALE_AFTER: Duration = Duration::from_secs(90);
/// How often the API server is asked for one node, so a quiet watch is told from a dead one.
pub const PROBE_INTERVAL: Duration = Duration::from_secs(30);
/// How often discovery is asked whether InferencePools and ScaledObjects are served: an
/// InferenceDeployment of `routing.mode: inferencePool` or `autoscaling.engine: keda` is
/// admitted at most this long after the CRD is installed.
pub const API_PROBE_INTERVAL: Duration = Duration::from_secs(10);

/// Read side of the node cache, shared by the request handlers.
pub struct NodeCache {
    store: Store<Node>,
    /// Bumped after every change that can alter [`ClusterFacts`].
    generation: AtomicU64,
    synced: AtomicBool,
    snapshot: Mutex<(u64, Arc<ClusterFacts>)>,
    /// When the API server last answered (a watch event or a probe), as ms after `epoch`.
    last_ok_ms: AtomicU64,
    epoch: Instant,
    stale_after: Duration,
    /// InferencePools served: 0 not known yet, 1 no, 2 yes.
    inference_pool: AtomicU8,
    /// KEDA ScaledObjects served, as [`NodeCache::inference_pool`].
    scaled_object: AtomicU8,
}

/// Records whether one API is served (a setter of [`NodeCache`]).
type SetServed = fn(&NodeCache, bool);

/// Write side: applies watch events to the store and tells readers what changed.
pub struct NodeCacheWriter {
    writer: reflector::store::Writer<Node>,
    cache: Arc<NodeCache>,
}

/// A new, empty, not yet synced cache and its writer.
pub fn node_cache() -> (Arc<NodeCache>, NodeCacheWriter) {
    node_cache_stale_after(STALE_AFTER)
}

/// [`node_cache`] that turns stale after `stale_after` without an answer from the API server.
pub fn node_cache_stale_after(stale_after: Duration) -> (Arc<NodeCache>, NodeCacheWriter) {
    let (store, writer) = reflector::store::<Node>();
    let cache = Arc::new(NodeCache {
        store,
        generation: AtomicU64::new(1),
        synced: AtomicBool::new(false),
        snapshot: Mutex::new((0, Arc::new(ClusterFacts::default()))),
        last_ok_ms: AtomicU64::new(0),
        epoch: Instant::now(),
        stale_after,
        inference_pool: AtomicU8::new(0),
        scaled_object: AtomicU8::new(0),
    });
    (cache.clone(), NodeCacheWriter { writer, cache })
}

impl NodeCache {
    /// True once the first full list of nodes has been applied.
    pub fn synced(&self) -> bool {
        self.synced.load(Ordering::Acquire)
    }

    /// Records that the API server answered just now.
    pub fn mark_fresh(&self) {
        let ms = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ok_ms.fetch_max(ms, Ordering::AcqRel);
    }

    /// Time since the API server last answered (a watch event or a probe).
    pub fn age(&self) -> Duration {
        let last = Duration::from_millis(self.last_ok_ms.load(Ordering::Acquire));
        self.epoch.elapsed().saturating_sub(last)
    }

    /// True when the API server has not answered for longer than the staleness bound: the
    /// cache may no longer describe the cluster.
    pub fn stale(&self) -> bool {
        self.age() > self.stale_after
    }

    /// Asks the API server for one node every `interval`, for ever; each answer marks the
    /// cache fresh. A failed or hung probe (bounded by `interval`) leaves it to go stale.
    pub async fn probe(self: Arc<Self>, api: Api<Node>, interval: Duration) {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            match tokio::time::timeout(interval, api.list_metadata(&ListParams::default().limit(1))).await {
                Ok(Ok(_)) => self.mark_fresh(),
                Ok(Err(error)) => tracing::warn!(%error, "the API server did not answer the node probe"),
                Err(_) => tracing::warn!(timeout_s = interval.as_secs_f64(), "the node probe timed out"),
            }
        }
    }

    /// Records whether the API server serves InferencePools; a change rebuilds the facts.
    pub fn set_inference_pool_served(&self, served: bool) {
        self.set_served(&self.inference_pool, served);
    }

    /// Whether the API server serves InferencePools; `None` until discovery first answered.
    pub fn inference_pool_served(&self) -> Option<bool> {
        Self::served(&self.inference_pool)
    }

    /// Records whether the API server serves KEDA ScaledObjects; a change rebuilds the facts.
    pub fn set_scaled_object_served(&self, served: bool) {
        self.set_served(&self.scaled_object, served);
    }

    /// Whether the API server serves KEDA ScaledObjects; `None` until discovery first answered.
    pub fn scaled_object_served(&self) -> Option<bool> {
        Self::served(&self.scaled_object)
    }

    fn set_served(&self, flag: &AtomicU8, served: bool) {
        let v = if served { 2 } else { 1 };
        if flag.swap(v, Ordering::AcqRel) != v {
            self.generation.fetch_add(1, Ordering::AcqRel);
        }
    }

    fn served(flag: &AtomicU8) -> Option<bool> {
        match flag.load(Ordering::Acquire) {
            0 => None,
            v => Some(v == 2),
        }
    }

    /// Asks discovery every `interval`, for ever, whether InferencePools
    /// (inference.networking.k8s.io/v1) and ScaledObjects (keda.sh/v1alpha1) are served. A
    /// failed answer keeps what was known.
    pub async fn probe_apis(self: Arc<Self>, client: kube::Client, interval: Duration) {
        use crate::api::{inference_pool, scaled_object};
        let apis: [(String, &str, SetServed); 2] = [
            (
                format!("{}/{}", inference_pool::GROUP, inference_pool::VERSION),
                inference_pool::PLURAL,
                Self::set_inference_pool_served,
            ),
            (
                format!("{}/{}", scaled_object::GROUP, scaled_object::VERSION),
                scaled_object::PLURAL,
                Self::set_scaled_object_served,
            ),
        ];
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            for (gv, plural, set) in &apis {
                match tokio::time::timeout(interval, client.list_api_group_resources(gv)).await {
                    Ok(Ok(list)) => set(&self, list.resources.iter().any(|r| r.name == *plural)),
                    Ok(Err(kube::Error::Api(s))) if s.code == 404 => set(&self, false),
                    Ok(Err(error)) => {
                        tracing::warn!(%error, "discovery of {gv} failed; keeping what was known")
                    }
                    Err(_) => {
                        tracing::warn!(timeout_s = interval.as_secs_f64(), "discovery of {gv} timed out")
                    }
                }
            }
        }
    }

    /// Nodes in the cache.
    pub fn len(&self) -> usize {
        self.store.len()
    }

    pub fn is_empty(&self) -> bool {
        self.store.is_empty()
    }

    /// The facts validation needs, as of the last applied event. Cheap when nothing
    /// changed (an `Arc` clone); rebuilt from the store otherwise.
    pub fn facts(&self) -> Arc<ClusterFacts> {
        let generation = self.generation.load(Ordering::Acquire);
        let mut snapshot = self
            .snapshot
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if snapshot.0 != generation {
            let mut nodes: Vec<NodeFacts> = self
                .store
                .state()
                .iter()
                .map(|n| NodeFacts::from_node(n))
                .collect();
            nodes.sort_by(|a, b| a.name.cmp(&b.name));
            let facts = ClusterFacts {
                nodes,
                inference_pool_served: self.inference_pool_served(),
                scaled_object_served: self.scaled_object_served(),
            };
            *snapshot = (generation, Arc::new(facts));
        }
        snapshot.1.clone()
    }
}

impl NodeCacheWriter {
    /// Applies one watch event. Node updates that leave the GPU facts as they were
    /// (heartbeats, conditions, images) do not invalidate the snapshot.
    pub fn apply(&mut self, event: &watcher::Event<Node>) {
        let changed = match event {
            watcher::Event::Apply(node) => {
                let before = self.cache.store.get(&ObjectRef::from_obj(node));
                before.map(|b| NodeFacts::from_node(&b)) != Some(NodeFacts::from_node(node))
            }
            watcher::Event::Delete(_) | watcher::Event::InitDone => true,
            watcher::Event::Init | watcher::Event::InitApply(_) => false,
        };
        self.writer.apply_watcher_event(event);
        self.cache.mark_fresh();
        if changed {
            self.cache.generation.fetch_add(1, Ordering::AcqRel);
        }
        if matches!(event, watcher::Event::InitDone) {
            self.cache.synced.store(true, Ordering::Release);
        }
    }

    /// Watches Nodes (optionally filtered by a label selector) for ever, with kube's
    /// default backoff on errors; the cache stays synced with its last state meanwhile.
    pub async fn run(mut self, api: Api<Node>, label_selector: Option<String>) {
        let mut config = watcher::Config::default();
        if let Some(selector) = label_selector {
            config = config.labels(&selector);
        }
        let stream = watcher(api, config)
            .default_backoff()
            .map_ok(|event| event.modify(strip))
            .boxed();
        let mut stream = stream;
        while let Some(event) = stream.next().await {
            match event {
                Ok(event) => self.apply(&event),
                Err(error) => tracing::warn!(%error, "node watch failed; retrying with backoff"),
            }
        }
    }
}

/// Drops what validation never reads, to keep 5,000 nodes small in memory.
fn strip(node: &mut Node) {
    node.metadata.managed_fields = None;
    node.metadata.annotations = None;
    if let Some(status) = node.status.as_mut() {
        status.images = None;
        status.conditions = None;
        status.volumes_attached = None;
        status.volumes_in_use = None;
    }
}
