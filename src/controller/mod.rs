//! `kvfleet controller`: reconciles InferenceDeployments into the objects that run them and
//! reports compatibility and KV capacity in their status.
//!
//! The pipeline of one pass ([`reconcile::reconcile`]): fetch (watch caches) -> validate
//! ([`crate::validate::validate`], pure) -> desired objects ([`desired`], pure) -> server-side
//! apply with one field manager and owner references -> status and Events ([`status`], pure).
//! No finalizer: everything created lives in the object's namespace and carries an owner
//! reference, so the garbage collector removes it.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Node, NodeStatus, Service};
use k8s_openapi::api::networking::v1::{NetworkPolicy, NetworkPolicyPeer};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, ListParams};
use kube::core::DeserializeGuard;
use kube::runtime::controller::{Config as ControllerConfig, Controller};
use kube::runtime::reflector::{self, store::Writer, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Client, ResourceExt};
use tokio::sync::watch;

use crate::api::InferenceDeployment;
use crate::validate::NodeFacts;

pub mod autoscale;
pub mod desired;
mod discovery;
mod error;
pub mod leader;
pub mod metrics;
pub mod owned;
pub mod placement;
pub mod reconcile;
pub mod status;

pub use error::Error;
pub use owned::FIELD_MANAGER;
pub use reconcile::{error_policy, reconcile, Context};

/// Options of `kvfleet controller`.
#[derive(clap::Args, Debug, Clone)]
pub struct ControllerArgs {
    /// Address of the plain HTTP port serving /metrics, /healthz and /readyz.
    #[arg(long, env = "KVFLEET_HTTP_ADDR", default_value = "0.0.0.0:8080")]
    pub http_addr: SocketAddr,
    /// Image of `kvfleet worker` pods when a spec names none (defaults to this release's image).
    #[arg(long, env = "KVFLEET_WORKER_IMAGE")]
    pub worker_image: Option<String>,
    /// Image of vLLM pods when a spec names none.
    #[arg(long, env = "KVFLEET_VLLM_IMAGE")]
    pub vllm_image: Option<String>,
    /// Elect a leader with a Lease so several replicas can run (`--leader-elect=false` for one).
    #[arg(long, env = "KVFLEET_LEADER_ELECT", default_value_t = true, action = clap::ArgAction::Set)]
    pub leader_elect: bool,
    /// Name of the leader Lease.
    #[arg(long, default_value = "kvfleet-controller")]
    pub lease_name: String,
    /// Namespace of the leader Lease (the controller's own namespace).
    #[arg(long, env = "POD_NAMESPACE", default_value = "kvfleet-system")]
    pub lease_namespace: String,
    /// Identity in the Lease and in Events (the pod name).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// NetworkPolicy peers (a JSON list, as in a rule's `from`) that scrape the workers'
    /// `/metrics`; every worker NetworkPolicy admits them besides the spec's
    /// `network.allowFrom`. The chart passes its `networkPolicy.metricsFrom`.
    #[arg(long, env = "KVFLEET_WORKER_METRICS_FROM", default_value = "[]", value_parser = parse_peers)]
    pub worker_metrics_from: Peers,
    /// InferenceDeployments reconciled at once.
    #[arg(long, default_value_t = 16)]
    pub concurrency: u16,
    /// Seconds between two readings of the autoscaled deployments' workers (the HPA's
    /// sync period is 15 s).
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u64).range(1..=600))]
    pub autoscale_interval_seconds: u64,
    /// Prometheus (base URL) that the KEDA ScaledObjects of `autoscaling.engine: keda` query,
    /// e.g. http://prometheus-operated.monitoring.svc:9090 (the chart's
    /// `autoscaling.keda.prometheusAddress`). Unset: such specs are denied with a condition.
    #[arg(long, env = "KVFLEET_KEDA_PROMETHEUS_ADDRESS", value_parser = parse_prometheus_address)]
    pub keda_prometheus_address: Option<String>,
}

fn parse_prometheus_address(s: &str) -> Result<String, String> {
    let s = s.trim().trim_end_matches('/');
    match s.parse::<http::Uri>() {
        Ok(u) if matches!(u.scheme_str(), Some("http" | "https")) && u.host().is_some() => Ok(s.to_string()),
        _ => Err(format!(
            "{s:?} is not an http(s) URL; give Prometheus' base URL, e.g. http://prometheus-operated.monitoring.svc:9090"
        )),
    }
}

/// A list of NetworkPolicy peers given on the command line.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Peers(pub Vec<NetworkPolicyPeer>);

fn parse_peers(s: &str) -> Result<Peers, String> {
    let s = s.trim();
    if s.is_empty() {
        return Ok(Peers::default());
    }
    serde_json::from_str(s).map(Peers).map_err(|e| {
        format!(
            "{e}; give a JSON list of NetworkPolicy peers, e.g. [{{\"namespaceSelector\": {{\"matchLabels\": {{\"kubernetes.io/metadata.name\": \"monitoring\"}}}}}}]"
        )
    })
}

/// Runs the controller until SIGTERM/SIGINT (exit 0) or until leadership is lost (error).
pub async fn run(args: ControllerArgs) -> Result<(), Error> {
    let client = Client::try_default().await.map_err(Error::Client)?;
    let registry = prometheus::Registry::new();
    let metrics = metrics::Metrics::new(&registry).map_err(Error::Metrics)?;
    let ready = Arc::new(AtomicBool::new(false));

    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        crate::serving::shutdown_signal().await;
        tracing::info!("shutdown requested");
        let _ = stop_tx.send(true);
    });

    let health = metrics::Health {
        registry: registry.clone(),
        ready: ready.clone(),
    };
    let listener = tokio::net::TcpListener::bind(args.http_addr)
        .await
        .map_err(|source| Error::Http {
            addr: args.http_addr,
            source,
        })?;
    let mut http_stop = stop_rx.clone();
    tokio::spawn(async move {
        let shutdown = async move {
            let _ = http_stop.wait_for(|s| *s).await;
        };
        if let Err(error) = axum::serve(listener, metrics::router(health))
            .with_graceful_shutdown(shutdown)
            .await
        {
            tracing::error!(%error, "HTTP server stopped");
        }
    });

    let ids: Api<DeserializeGuard<InferenceDeployment>> = Api::all(client.clone());
    ids.list(&ListParams::default().limit(1))
        .await
        .map_err(Error::CrdMissing)?;
    ready.store(true, Ordering::Relaxed);

    let identity = args.identity.clone().unwrap_or_else(default_identity);
    let (leading_tx, mut leading_rx) = watch::channel(!args.leader_elect);
    if args.leader_elect {
        let elector = leader::Elector::new(
            Api::<Lease>::namespaced(client.clone(), &args.lease_namespace),
            &args.lease_name,
            &identity,
            leader::Timing::default(),
        );
        tokio::spawn(elector.run(leading_tx, stop_rx.clone()));
        tracing::info!(%identity, lease = %args.lease_name, namespace = %args.lease_namespace, "waiting for leadership");
        let mut stop = stop_rx.clone();
        tokio::select! {
            r = leading_rx.wait_for(|l| *l) => if r.is_err() { return Err(Error::LeadershipLost) },
            _ = stop.wait_for(|s| *s) => return Ok(()),
        }
    }
    metrics.leader.set(1);

    // Nodes: a stripped reflector; a change of what validation reads re-validates everything.
    let writer: Writer<Node> = Writer::default();
    let nodes: Store<Node> = writer.as_reader();
    let (node_tx, node_rx) = futures::channel::mpsc::unbounded::<()>();
    let node_stream = reflector::reflector(
        writer,
        watcher(Api::<Node>::all(client.clone()), watcher::Config::default())
            .backoff(WatchBackoff::default())
            .modify(strip_node),
    );
    tokio::spawn(node_changes(node_stream, node_tx));
    nodes.wait_until_ready().await.map_err(|_| {
        Error::kube(
            "watch Nodes",
            kube::Error::Service("node watch ended before its first list".into()),
        )
    })?;

    let settings = {
        let mut s = desired::Settings::default();
        if let Some(i) = args.worker_image.clone() {
            s.worker_image = i;
        }
        if let Some(i) = args.vllm_image.clone() {
            s.vllm_image = i;
        }
        s.worker_metrics_from = args.worker_metrics_from.0.clone();
        s.keda_prometheus_address = args.keda_prometheus_address.clone();
        s
    };
    let ctx = Arc::new(Context::new(
        client.clone(),
        nodes,
        settings,
        metrics.clone(),
        Some(identity),
    ));
    *ctx.monitor.write().unwrap_or_else(|p| p.into_inner()) = discover_monitor(&client).await;
    discover_inference_pool(&ctx).await;
    discover_scaled_object(&ctx).await;
    tokio::spawn(refresh_monitor(ctx.clone(), stop_rx.clone()));

    let owned =
        watcher::Config::default().labels(&format!("{}={}", desired::MANAGED_BY_LABEL, desired::MANAGED_BY));
    let mut stop = stop_rx.clone();
    let shutdown = async move {
        let _ = stop.wait_for(|s| *s).await;
    };
    // Lost leadership stops every reconcile at once (in-flight ones are dropped, not
    // awaited): a former leader must not act after a standby may have taken over.
    let mut lost = leading_rx.clone();
    let lost = async move {
        let _ = lost.wait_for(|l| !*l).await;
    };
    tracing::info!("reconciling InferenceDeployments");
    let controller =
        Controller::new(ids, watcher::Config::default()).trigger_backoff(WatchBackoff::default());
    let conditions = metrics::ConditionCollector::new(controller.store()).map_err(Error::Metrics)?;
    registry.register(Box::new(conditions)).map_err(Error::Metrics)?;
    tokio::spawn(forget_absent(ctx.clone(), controller.store(), stop_rx.clone()));
    tokio::spawn(autoscale::run(
        ctx.clone(),
        controller.store(),
        Duration::from_secs(args.autoscale_interval_seconds),
        stop_rx.clone(),
    ));
    let forgetting = ctx.clone();
    let run = controller
        .with_config(ControllerConfig::default().concurrency(args.concurrency))
        .owns(Api::<Deployment>::all(client.clone()), owned.clone())
        .owns(Api::<Service>::all(client.clone()), owned.clone())
        .owns(Api::<ConfigMap>::all(client.clone()), owned.clone())
        .owns(Api::<PodDisruptionBudget>::all(client.clone()), owned.clone())
        .owns(Api::<NetworkPolicy>::all(client.clone()), owned)
        .reconcile_all_on(node_rx)
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(move |r| {
            if let Err(error) = &r {
                // A pass scheduled for an object that is gone (its owned objects' deletion
                // triggered it): what the controller remembers of it goes too.
                if let kube::runtime::controller::Error::ObjectNotFound(gone) = error {
                    forgetting.forget(&format!(
                        "{}/{}",
                        gone.namespace.as_deref().unwrap_or_default(),
                        gone.name
                    ));
                }
                tracing::debug!(error = %crate::error_chain(error), "controller stream");
            }
            futures::future::ready(())
        });
    tokio::select! {
        _ = run => {}
        _ = lost, if args.leader_elect => {
            metrics.leader.set(0);
            tracing::error!("lost leadership: reconciles stopped");
            return Err(Error::LeadershipLost);
        }
    }
    metrics.leader.set(0);

    if args.leader_elect && !*stop_rx.borrow() {
        return Err(Error::LeadershipLost);
    }
    tracing::info!("stopped");
    Ok(())
}

/// Backoff of the controller's watches after an error: 250 ms doubling to at most 4 s (plus up to
/// 50% jitter), back to 250 ms after the next event. kube-runtime's default (client-go's: 0.8 s
/// doubling to 30 s, reset only after 120 s without errors) grew to 20-50 s waits while an API
/// server restarted, so a change made right after it came back was reconciled only minutes later
/// (tests/e2e_faults.rs). Our watches are label-filtered and cheap to re-list.
#[derive(Debug, Clone)]
pub struct WatchBackoff {
    next: std::time::Duration,
}

impl WatchBackoff {
    const FIRST: std::time::Duration = std::time::Duration::from_millis(250);
    const MAX: std::time::Duration = std::time::Duration::from_secs(4);
}

impl Default for WatchBackoff {
    fn default() -> Self {
        WatchBackoff { next: Self::FIRST }
    }
}

impl Iterator for WatchBackoff {
    type Item = std::time::Duration;
    fn next(&mut self) -> Option<std::time::Duration> {
        let base = self.next;
        self.next = (self.next * 2).min(Self::MAX);
        Some(base.mul_f64(1.0 + rand::random::<f64>() * 0.5))
    }
}

impl kube::runtime::utils::Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.next = Self::FIRST;
    }
}

/// Keeps only what validation reads (labels, allocatable, unschedulable): node objects carry
/// image lists and conditions that would dominate the cache.
fn strip_node(n: &mut Node) {
    n.managed_fields_mut().clear();
    n.annotations_mut().clear();
    if let Some(s) = n.status.as_mut() {
        *s = NodeStatus {
            allocatable: s.allocatable.take(),
            ..NodeStatus::default()
        };
    }
}

/// Emits `()` when the facts validation reads change (not on heartbeats).
async fn node_changes<S>(stream: S, tx: futures::channel::mpsc::UnboundedSender<()>)
where
    S: futures::Stream<Item = Result<watcher::Event<Node>, watcher::Error>>,
{
    let mut known: std::collections::BTreeMap<String, NodeFacts> = Default::default();
    let mut initial: Option<std::collections::BTreeMap<String, NodeFacts>> = None;
    let mut stream = std::pin::pin!(stream);
    while let Some(ev) = stream.next().await {
        let changed = match ev {
            Ok(watcher::Event::Apply(n)) => {
                let f = NodeFacts::from_node(&n);
                known.insert(f.name.clone(), f.clone()) != Some(f)
            }
            Ok(watcher::Event::Delete(n)) => known.remove(&n.name_any()).is_some(),
            Ok(watcher::Event::Init) => {
                initial = Some(Default::default());
                false
            }
            Ok(watcher::Event::InitApply(n)) => {
                let f = NodeFacts::from_node(&n);
                if let Some(i) = initial.as_mut() {
                    i.insert(f.name.clone(), f);
                }
                false
            }
            Ok(watcher::Event::InitDone) => match initial.take() {
                Some(i) if i != known => {
                    known = i;
                    true
                }
                _ => false,
            },
            Err(error) => {
                tracing::warn!(%error, "node watch error; retrying");
                false
            }
        };
        if changed && tx.unbounded_send(()).is_err() {
            return;
        }
    }
}

/// ServiceMonitor (preferred) or PodMonitor when the Prometheus Operator CRDs are installed.
pub async fn discover_monitor(client: &Client) -> Option<desired::MonitorKind> {
    let group = match kube::discovery::group(client, "monitoring.coreos.com").await {
        Ok(g) => g,
        Err(error) => {
            tracing::debug!(%error, "no monitoring.coreos.com API group: no ServiceMonitor/PodMonitor");
            return None;
        }
    };
    ["ServiceMonitor", "PodMonitor"].into_iter().find_map(|kind| {
        group
            .recommended_kind(kind)
            .map(|(resource, _)| desired::MonitorKind {
                resource,
                kind: kind.to_string(),
            })
    })
}

async fn refresh_monitor(ctx: Arc<Context>, mut stop: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(300)) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let found = discover_monitor(&ctx.client).await;
        {
            let mut m = ctx.monitor.write().unwrap_or_else(|p| p.into_inner());
            if *m != found {
                tracing::info!(monitor = ?found.as_ref().map(|f| &f.kind), "Prometheus Operator CRDs changed");
                *m = found;
            }
        }
        discover_inference_pool(&ctx).await;
        discover_scaled_object(&ctx).await;
    }
}

/// Whether the API server serves KEDA's ScaledObjects, into the context (the sweep lists them
/// only then); a failed discovery keeps what was known.
async fn discover_scaled_object(ctx: &Context) {
    match reconcile::scaled_object_served(&ctx.client).await {
        Ok(served) => {
            if ctx.scaled_object.swap(served, Ordering::Relaxed) != served {
                tracing::info!(served, "KEDA ScaledObject API (keda.sh/v1alpha1) changed");
            }
        }
        Err(error) => tracing::debug!(error = %crate::error_chain(&error), "ScaledObject discovery failed"),
    }
}

/// Whether the API server serves InferencePools, into the context (the sweep lists them only
/// then); a failed discovery keeps what was known.
async fn discover_inference_pool(ctx: &Context) {
    match reconcile::inference_pool_served(&ctx.client).await {
        Ok(served) => {
            if ctx.inference_pool.swap(served, Ordering::Relaxed) != served {
                tracing::info!(
                    served,
                    "InferencePool API (inference.networking.k8s.io/v1) changed"
                );
            }
        }
        Err(error) => tracing::debug!(error = %crate::error_chain(&error), "InferencePool discovery failed"),
    }
}

/// How often what the controller remembers is compared with the InferenceDeployments that
/// exist.
const FORGET_INTERVAL: Duration = Duration::from_secs(60);

/// Forgets, every [`FORGET_INTERVAL`], the objects the watch no longer holds: a deletion that
/// no reconcile saw (no owned object to trigger one) still drops its state and metric series.
async fn forget_absent(
    ctx: Arc<Context>,
    store: Store<DeserializeGuard<InferenceDeployment>>,
    mut stop: watch::Receiver<bool>,
) {
    if store.wait_until_ready().await.is_err() {
        return;
    }
    loop {
        tokio::select! {
            _ = tokio::time::sleep(FORGET_INTERVAL) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        ctx.forget_absent(|key| {
            let (ns, name) = key.split_once('/').unwrap_or(("", key));
            store.get(&reflector::ObjectRef::new(name).within(ns)).is_some()
        });
    }
}

fn default_identity() -> String {
    let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "kvfleet-controller".into());
    format!("{host}-{:08x}", rand::random::<u32>())
}

#[cfg(test)]
mod tests {
    use super::{parse_peers, WatchBackoff};
    use kube::runtime::utils::Backoff;

    #[test]
    fn worker_metrics_peers_parse_from_json_and_a_bad_value_says_what_to_give() {
        assert!(parse_peers("[]").unwrap().0.is_empty());
        assert!(parse_peers("").unwrap().0.is_empty());
        let peers = parse_peers(
            r#"[{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]"#,
        )
        .unwrap();
        let labels = peers.0[0]
            .namespace_selector
            .as_ref()
            .and_then(|s| s.match_labels.as_ref())
            .unwrap();
        assert_eq!(labels["kubernetes.io/metadata.name"], "monitoring");
        let err = parse_peers("{monitoring}").unwrap_err();
        assert!(err.contains("give a JSON list of NetworkPolicy peers"), "{err}");
    }

    #[test]
    fn watch_backoff_doubles_to_its_cap_with_jitter_and_resets() {
        let mut b = WatchBackoff::default();
        let waits: Vec<_> = (&mut b).take(8).collect();
        assert!(waits[0] >= WatchBackoff::FIRST && waits[0] <= WatchBackoff::FIRST.mul_f64(1.5));
        for w in &waits[5..] {
            assert!(
                *w >= WatchBackoff::MAX && *w <= WatchBackoff::MAX.mul_f64(1.5),
                "{waits:?}"
            );
        }
        b.reset();
        assert!(b.next().unwrap() <= WatchBackoff::FIRST.mul_f64(1.5));
    }
}
