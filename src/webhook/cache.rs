//! The webhook's view of the cluster: a reflector store of Nodes fed by a watch, and the
//! [`ClusterFacts`] derived from it. No API call happens on the request path: a request
//! reads an `Arc` snapshot that is rebuilt only after a node's GPU facts changed.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Node;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::Api;

use crate::validate::{ClusterFacts, NodeFacts};

/// Read side of the node cache, shared by the request handlers.
pub struct NodeCache {
    store: Store<Node>,
    /// Bumped after every change that can alter [`ClusterFacts`].
    generation: AtomicU64,
    synced: AtomicBool,
    snapshot: Mutex<(u64, Arc<ClusterFacts>)>,
}

/// Write side: applies watch events to the store and tells readers what changed.
pub struct NodeCacheWriter {
    writer: reflector::store::Writer<Node>,
    cache: Arc<NodeCache>,
}

/// A new, empty, not yet synced cache and its writer.
pub fn node_cache() -> (Arc<NodeCache>, NodeCacheWriter) {
    let (store, writer) = reflector::store::<Node>();
    let cache = Arc::new(NodeCache {
        store,
        generation: AtomicU64::new(1),
        synced: AtomicBool::new(false),
        snapshot: Mutex::new((0, Arc::new(ClusterFacts::default()))),
    });
    (cache.clone(), NodeCacheWriter { writer, cache })
}

impl NodeCache {
    /// True once the first full list of nodes has been applied.
    pub fn synced(&self) -> bool {
        self.synced.load(Ordering::Acquire)
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
            *snapshot = (generation, Arc::new(ClusterFacts { nodes }));
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
