//! One reconcile pass: fetch -> validate (pure) -> desired objects (pure) -> the owned set
//! (ownership check, server-side apply, orphan sweep) -> status and Events; plus the error
//! policy and what the controller remembers per object.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ContainerStateTerminated, Node, ObjectReference, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams};
use kube::core::error_boundary::InvalidObject;
use kube::core::DeserializeGuard;
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::Store;
use kube::{Client, Resource, ResourceExt};
use serde_json::json;

use crate::api::{AutoscalingEngine, InferenceDeployment, InferenceDeploymentSpec, RoutingMode, Runtime};
use crate::contract::exit;
use crate::validate::{ClusterFacts, NodeFacts, Verdict};

use super::desired::{self, MonitorKind, Settings, MEASURED_TOKENS_ANNOTATION};
use super::error::{is_conflict, Error};
use super::metrics::Metrics;
use super::owned::{self, is_owned_by, OwnedSet, FIELD_MANAGER};
use super::placement::{self, Placement};
use super::status::{self, CapacityPrediction, Observed};

/// How often a settled object is looked at again without any watch event.
pub const RESYNC: Duration = Duration::from_secs(300);
/// How often an object whose workers have not yet reported capacity is looked at again.
pub const CAPACITY_POLL: Duration = Duration::from_secs(30);
const CONFLICT_RETRIES: usize = 3;
/// How often an object blocked by an object kvfleet did not create is looked at again
/// (deleting the blocking object wakes no watch of ours).
pub const OWNERSHIP_RETRY: Duration = Duration::from_secs(60);
/// How often an object waiting for a CRD (LeaderWorkerSet, InferencePool) is looked at again.
pub const CRD_RETRY: Duration = Duration::from_secs(30);
/// Degraded reason (and Event reason) when an object of a name kvfleet would create
/// exists and is not owned by this InferenceDeployment.
pub const OWNERSHIP_CONFLICT: &str = "OwnershipConflict";

/// Spec + cluster facts -> verdict; [`crate::validate::validate`] in production.
pub type ValidateFn = fn(&InferenceDeploymentSpec, &ClusterFacts) -> Verdict;
/// Spec + admitting verdict -> predicted KV capacity; `None` when it cannot be planned.
pub type PredictFn = fn(&InferenceDeploymentSpec, &Verdict) -> Option<CapacityPrediction>;

/// The planner's prediction carried by the verdict (`validate::` calls `plan::`); `None` when
/// it could not plan (status says `PlannerUnavailable`).
pub fn verdict_capacity(_spec: &InferenceDeploymentSpec, verdict: &Verdict) -> Option<CapacityPrediction> {
    let c = verdict.capacity.as_ref()?;
    Some(CapacityPrediction {
        tokens_per_replica: c.tokens_per_replica?,
        max_concurrency: c.max_concurrency.unwrap_or(0.0),
        vllm_tokens_per_replica: c.vllm_tokens_per_replica,
    })
}

/// What the controller remembers about one InferenceDeployment between passes; dropped, with
/// its metric series, when the object goes (see [`Context::forget`]).
#[derive(Debug, Default)]
struct ObjectState {
    /// Consecutive failed passes, for backoff.
    failures: u32,
    /// Worker terminations already counted, so that each is counted once.
    terminations: SeenTerminations,
    /// (pod uid or name, node) of pods on incompatible nodes already told in an Event.
    misplaced_told: BTreeSet<(String, String)>,
}

/// Shared by every reconcile pass.
pub struct Context {
    pub client: Client,
    pub recorder: Recorder,
    /// Nodes as seen by the node watch; read on every pass.
    pub nodes: Store<Node>,
    /// ServiceMonitor or PodMonitor resource when the Prometheus Operator CRDs exist.
    pub monitor: RwLock<Option<MonitorKind>>,
    /// Whether the API server served InferencePools when last asked (at start, every few
    /// minutes, and on each pass of a spec that routes through one): the sweep lists them
    /// only then.
    pub inference_pool: AtomicBool,
    /// Whether the API server serves KEDA's ScaledObjects (the sweep lists them only then).
    pub scaled_object: AtomicBool,
    pub settings: Settings,
    pub metrics: Metrics,
    pub validate: ValidateFn,
    pub predict: PredictFn,
    /// Per InferenceDeployment (`namespace/name`).
    objects: Mutex<HashMap<String, ObjectState>>,
    /// Terminations that finished before this process started are not counted: they were
    /// counted (or missed) by the previous controller, and would alert again after a restart.
    counting_since: Timestamp,
}

impl Context {
    pub fn new(
        client: Client,
        nodes: Store<Node>,
        settings: Settings,
        metrics: Metrics,
        instance: Option<String>,
    ) -> Self {
        let reporter = Reporter {
            controller: FIELD_MANAGER.into(),
            instance,
        };
        Context {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            nodes,
            monitor: RwLock::new(None),
            inference_pool: AtomicBool::new(false),
            scaled_object: AtomicBool::new(false),
            settings,
            metrics,
            validate: crate::validate::validate,
            predict: verdict_capacity,
            objects: Mutex::new(HashMap::new()),
            counting_since: Timestamp::now(),
        }
    }

    /// The cluster as validation sees it, from the node watch.
    pub fn cluster_facts(&self) -> ClusterFacts {
        let mut nodes: Vec<NodeFacts> = self
            .nodes
            .state()
            .iter()
            .map(|n| NodeFacts::from_node(n))
            .collect();
        nodes.sort_by(|a, b| a.name.cmp(&b.name));
        ClusterFacts {
            nodes,
            ..ClusterFacts::default()
        }
    }

    fn monitor_kind(&self) -> Option<MonitorKind> {
        self.monitor
            .read()
            .map(|m| m.clone())
            .unwrap_or_else(|p| p.into_inner().clone())
    }

    fn objects(&self) -> std::sync::MutexGuard<'_, HashMap<String, ObjectState>> {
        self.objects.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether anything is remembered about the object `key` (`namespace/name`).
    pub fn remembers(&self, key: &str) -> bool {
        self.objects().contains_key(key)
    }

    /// Drops what is remembered about the object `key` (`namespace/name`) and its metric
    /// series: called whichever way the object goes (a deletion timestamp seen, a reconcile
    /// that finds it gone, or [`Context::forget_absent`]).
    pub fn forget(&self, key: &str) {
        self.objects().remove(key);
        let (ns, name) = key.split_once('/').unwrap_or(("", key));
        let _ = self.metrics.preflight_failures.remove_label_values(&[ns, name]);
    }

    /// Forgets every remembered object for which `exists` (asked with `namespace/name`) is
    /// false: a deletion that triggered no reconcile is caught here.
    pub fn forget_absent(&self, exists: impl Fn(&str) -> bool) {
        let gone: Vec<String> = self.objects().keys().filter(|k| !exists(k)).cloned().collect();
        for key in gone {
            self.forget(&key);
        }
    }

    /// Of `misplaced`, the pods not told in an Event before for the object `key`; forgets
    /// those no longer misplaced, so that a pod that drifts again is told again.
    fn misplaced_untold<'m>(
        &self,
        key: &str,
        misplaced: &'m [placement::Misplaced],
    ) -> Vec<&'m placement::Misplaced> {
        let mut objects = self.objects();
        let state = objects.entry(key.to_string()).or_default();
        let id = |m: &placement::Misplaced| (m.uid.clone().unwrap_or_else(|| m.pod.clone()), m.node.clone());
        let untold = misplaced
            .iter()
            .filter(|m| !state.misplaced_told.contains(&id(m)))
            .collect();
        state.misplaced_told = misplaced.iter().map(id).collect();
        untold
    }

    /// Preflight failures among `pods` not counted before for the object `key`.
    fn new_preflight_failures(&self, key: &str, pods: &[Pod]) -> u64 {
        let mut objects = self.objects();
        let state = objects.entry(key.to_string()).or_default();
        let (n, next) = count_preflight_failures(pods, &state.terminations, self.counting_since);
        state.terminations = next;
        n
    }

    pub(crate) async fn publish(&self, regarding: &ObjectReference, n: &status::Notice) {
        self.publish_related(regarding, None, n).await
    }

    /// Publishes `n` about `regarding`, naming `related` (a pod) as the object it concerns.
    async fn publish_related(
        &self,
        regarding: &ObjectReference,
        related: Option<ObjectReference>,
        n: &status::Notice,
    ) {
        let ev = Event {
            type_: if n.warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: n.reason.clone(),
            note: Some(truncate(&n.note, 1000)),
            action: "Reconcile".into(),
            secondary: related,
        };
        // Events are best effort: a lost Event must not fail the pass that caused it.
        if let Err(error) = self.recorder.publish(&ev, regarding).await {
            tracing::warn!(%error, reason = %n.reason, "cannot publish Event");
        }
    }
}

fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

/// Reconciles one InferenceDeployment (or reports one that cannot be read).
#[tracing::instrument(skip_all, fields(object = %key(&obj)))]
pub async fn reconcile(
    obj: Arc<DeserializeGuard<InferenceDeployment>>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let timer = ctx.metrics.start();
    let result = match &obj.0 {
        Ok(id) => reconcile_valid(id, &ctx).await,
        Err(invalid) => {
            report_malformed(invalid, &ctx).await;
            Ok(Action::await_change())
        }
    };
    match &result {
        Ok(_) => {
            if let Some(s) = ctx.objects().get_mut(&key(&obj)) {
                s.failures = 0;
            }
            timer.finish("success");
        }
        Err(_) => timer.finish("failure"),
    }
    result
}

fn key(obj: &DeserializeGuard<InferenceDeployment>) -> String {
    let meta = match &obj.0 {
        Ok(o) => &o.metadata,
        Err(e) => &e.metadata,
    };
    format!(
        "{}/{}",
        meta.namespace.as_deref().unwrap_or_default(),
        meta.name.as_deref().unwrap_or_default()
    )
}

/// Backoff on failure: conflicts retry at once-ish, other errors back off exponentially
/// (5 s doubling, at most 5 minutes) and are counted by category.
pub fn error_policy(
    obj: Arc<DeserializeGuard<InferenceDeployment>>,
    error: &Error,
    ctx: Arc<Context>,
) -> Action {
    let category = error.metric_label();
    ctx.metrics.failures.with_label_values(&[category]).inc();
    let k = key(&obj);
    let n = {
        let mut objects = ctx.objects();
        let s = objects.entry(k.clone()).or_default();
        s.failures = s.failures.saturating_add(1);
        s.failures
    };
    let delay = backoff(error, n);
    tracing::warn!(object = %k, %category, attempt = n, retry_in_s = delay.as_secs_f64(),
        error = %crate::error_chain(error), "reconcile failed");
    Action::requeue(delay)
}

/// Delay before the `attempt`-th retry (1-based).
pub fn backoff(error: &Error, attempt: u32) -> Duration {
    if error.is_conflict() {
        return Duration::from_millis(500);
    }
    let exp = attempt.saturating_sub(1).min(6);
    Duration::from_secs((5u64 << exp).min(300))
}

async fn report_malformed(invalid: &InvalidObject, ctx: &Context) {
    tracing::warn!(error = %invalid.error, "InferenceDeployment does not match the schema; waiting for a change");
    let m = &invalid.metadata;
    let regarding = ObjectReference {
        api_version: Some(InferenceDeployment::api_version(&()).into_owned()),
        kind: Some(InferenceDeployment::kind(&()).into_owned()),
        name: m.name.clone(),
        namespace: m.namespace.clone(),
        uid: m.uid.clone(),
        resource_version: m.resource_version.clone(),
        ..ObjectReference::default()
    };
    ctx.publish(
        &regarding,
        &status::Notice {
            warning: true,
            reason: "MalformedObject".into(),
            note: format!(
                "cannot read the spec: {}; fix it (kubectl edit) to continue",
                invalid.error
            ),
        },
    )
    .await;
}

async fn reconcile_valid(obj: &InferenceDeployment, ctx: &Context) -> Result<Action, Error> {
    let object_key = desired::object_key(obj);
    if obj.metadata.deletion_timestamp.is_some() {
        // Everything we create carries an owner reference: the garbage collector removes it.
        ctx.forget(&object_key);
        return Ok(Action::await_change());
    }
    let ns = obj
        .namespace()
        .ok_or(Error::Desired(desired::DesiredError::MissingMetadata(
            "namespace",
        )))?;
    let name = obj.name_any();
    ctx.objects().entry(object_key.clone()).or_default();
    // Exported from the first pass on, so that `increase()` sees the first failure.
    let preflight_failures = ctx.metrics.preflight_failures.with_label_values(&[&ns, &name]);
    // validate:: denies what the worker cannot run (runtime kvfleet without model.geometry,
    // or with tensor parallelism), as the webhook does: nothing admitted is stranded here.
    let mut facts = ctx.cluster_facts();
    if obj.spec.routing_mode() == RoutingMode::InferencePool {
        // Asked on each such pass, so installing the CRD later lifts the denial on the next.
        let served = inference_pool_served(&ctx.client).await?;
        ctx.inference_pool.store(served, Ordering::Relaxed);
        facts.inference_pool_served = Some(served);
    }
    let keda = obj
        .spec
        .autoscaling
        .as_ref()
        .is_some_and(|a| a.engine == AutoscalingEngine::Keda);
    if keda {
        let served = scaled_object_served(&ctx.client).await?;
        ctx.scaled_object.store(served, Ordering::Relaxed);
        facts.scaled_object_served = Some(served);
    }
    let mut verdict = (ctx.validate)(&obj.spec, &facts);
    // Replicas that span nodes run as a LeaderWorkerSet: without its CRD, deny with the fix.
    if verdict.allowed() && verdict.multi_node.is_some() && !leader_worker_set_installed(&ctx.client).await? {
        deny_without_leader_worker_set(&obj.spec, &mut verdict);
    }
    // KEDA's trigger needs the Prometheus to query, an operator-wide setting.
    if keda && ctx.settings.keda_prometheus_address.is_none() {
        verdict.denials.push(keda_prometheus_address_missing());
    }

    let (prediction, outcome) = if verdict.allowed() {
        (
            (ctx.predict)(&obj.spec, &verdict),
            apply_owned(obj, &verdict, ctx).await?,
        )
    } else {
        // Leave what runs alone; just report on it (only a Deployment this object owns).
        let running = Api::<Deployment>::namespaced(ctx.client.clone(), &ns)
            .get_opt(&name)
            .await
            .map_err(|source| Error::kube("read Deployment", source))?
            .filter(|d| is_owned_by(d, obj.uid().as_deref().unwrap_or_default()));
        (
            None,
            Outcome {
                workload: running,
                foreign: Vec::new(),
            },
        )
    };
    let deployment = outcome.workload;
    let foreign = outcome.foreign;

    let pods = observe_pods(obj, ctx, deployment.as_ref(), &verdict, &preflight_failures).await?;

    let seen = Observed {
        verdict: Some(&verdict),
        prediction: prediction.as_ref(),
        deployment: deployment.as_ref(),
        measured_tokens: pods.measured,
        preflight_failure: pods.preflight.as_deref(),
        placement: pods.placement.as_ref(),
    };
    let mut new_status = status::compute(obj, &seen, Timestamp::now());
    if !foreign.is_empty() {
        mark_ownership_conflict(obj, &mut new_status, &foreign);
    }
    if obj.status.as_ref().map(status::owned_part) != Some(new_status.clone()) {
        patch_status(ctx, &ns, &name, &new_status).await?;
    }
    let regarding = obj.object_ref(&());
    for n in status::notices(obj.status.as_ref(), &new_status, Some(&verdict)) {
        if !foreign.is_empty() && n.reason == "SpecApplied" {
            continue; // nothing was applied
        }
        ctx.publish(&regarding, &n).await;
    }
    tell_misplaced(obj, ctx, &regarding, pods.placement.as_ref()).await;
    let measured = pods.measured;

    Ok(if !foreign.is_empty() {
        Action::requeue(OWNERSHIP_RETRY)
    } else if verdict.denials.iter().any(|d| {
        d.reason == LEADER_WORKER_SET_MISSING
            || d.reason == crate::validate::INFERENCE_POOL_MISSING
            || d.reason == crate::validate::SCALED_OBJECT_MISSING
    }) {
        // Installing a CRD wakes no watch of ours: look again for it.
        Action::requeue(CRD_RETRY)
    } else if !verdict.allowed() {
        // Invalid spec or no compatible node: a spec change or a node change wakes us.
        Action::await_change()
    } else if new_status.ready_replicas.unwrap_or(0) > 0 && measured.is_none() {
        // Pod annotations are not watched: look again until the workers (or vLLM's capacity
        // sidecar) report capacity.
        Action::requeue(CAPACITY_POLL)
    } else {
        Action::requeue(RESYNC)
    })
}

/// What the worker pods said in one pass.
#[derive(Default)]
struct PodsSeen {
    measured: Option<i64>,
    preflight: Option<String>,
    /// `None` when no pods were listed.
    placement: Option<Placement>,
}

/// What the worker pods say: the smallest measured capacity over ready pods (both runtimes;
/// vLLM's through the capacity sidecar's annotation), whether their nodes can still run them,
/// and, for the kvfleet worker, why pods exit at start, each new failure counted once on
/// `failures`. One LIST serves all three; vLLM exit codes mean something else, and without
/// pods there is nothing to read.
async fn observe_pods(
    obj: &InferenceDeployment,
    ctx: &Context,
    workload: Option<&Deployment>,
    verdict: &Verdict,
    failures: &prometheus::IntCounter,
) -> Result<PodsSeen, Error> {
    let allowed = verdict.allowed();
    let st = workload.and_then(|d| d.status.as_ref());
    if st.and_then(|s| s.replicas).unwrap_or(0) == 0 {
        return Ok(PodsSeen::default());
    }
    let pods = list_pods(ctx, &obj.namespace().unwrap_or_default(), &obj.name_any()).await?;
    let measured = if allowed && st.and_then(|s| s.ready_replicas).unwrap_or(0) > 0 {
        min_measured_tokens(&pods)
    } else {
        None
    };
    let placement = Some(check_placement(obj, ctx, verdict, &pods));
    if obj.spec.engine.runtime != Runtime::Kvfleet {
        return Ok(PodsSeen {
            measured,
            preflight: None,
            placement,
        });
    }
    let failed = ctx.new_preflight_failures(&desired::object_key(obj), &pods);
    if failed > 0 {
        failures.inc_by(failed);
        tracing::warn!(
            failed,
            "worker pods failed preflight; their logs and termination messages say what to change"
        );
    }
    Ok(PodsSeen {
        measured,
        preflight: preflight_failure(&pods),
        placement,
    })
}

/// The placement of `pods` against the nodes now, for the configuration they run: this
/// verdict's resolution when admitted; when denied, the last one admitted for this
/// generation (the nodes changed, not the spec); not checked when an earlier generation's
/// pods run and this one is denied (its configuration is not known here).
fn check_placement(obj: &InferenceDeployment, ctx: &Context, verdict: &Verdict, pods: &[Pod]) -> Placement {
    let running = if verdict.allowed() {
        Some(desired::resolved(&obj.spec, verdict))
    } else {
        let old = obj.status.clone().unwrap_or_default();
        status::generation_was_admitted(obj, &old)
            .then(|| old.resolved.map(|r| (r.kv_cache_dtype, r.attention_backend)))
            .flatten()
    };
    match running {
        Some(running) => placement::check(&obj.spec, running, pods, &ctx.cluster_facts(), ctx.validate),
        None => Placement::NotChecked(
            "the pods run an earlier generation's configuration; they are checked against the nodes once a compatible spec is applied".into(),
        ),
    }
}

/// A Warning Event for each pod newly found on a node that can no longer run it, naming the
/// pod (as the related object) and the fix; once per pod and node.
async fn tell_misplaced(
    obj: &InferenceDeployment,
    ctx: &Context,
    regarding: &ObjectReference,
    placement: Option<&Placement>,
) {
    let Some(Placement::Checked {
        kv_cache_dtype,
        attention_backend,
        misplaced,
        ..
    }) = placement
    else {
        ctx.misplaced_untold(&desired::object_key(obj), &[]);
        return;
    };
    let ns = obj.namespace().unwrap_or_default();
    for m in ctx.misplaced_untold(&desired::object_key(obj), misplaced) {
        tracing::warn!(pod = %m.pod, node = %m.node, why = %m.why, "worker pod on a node that can no longer run it");
        let pod = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            name: Some(m.pod.clone()),
            namespace: Some(ns.clone()),
            uid: m.uid.clone(),
            ..ObjectReference::default()
        };
        let notice = status::Notice {
            warning: true,
            reason: status::POD_ON_INCOMPATIBLE_NODE.into(),
            note: m.note(&ns, *kv_cache_dtype, *attention_backend),
        };
        ctx.publish_related(regarding, Some(pod), &notice).await;
    }
}

/// What applying the owned set left to report on.
struct Outcome {
    /// The Deployment (or the LeaderWorkerSet in its shape) as the API server has it.
    workload: Option<Deployment>,
    /// Objects of our names that this InferenceDeployment does not own: nothing was applied.
    foreign: Vec<String>,
}

/// The owned set of an admitted spec: ownership checked once, applied in one loop, then the
/// objects the spec no longer wants deleted (only ours).
async fn apply_owned(obj: &InferenceDeployment, verdict: &Verdict, ctx: &Context) -> Result<Outcome, Error> {
    let monitor = ctx.monitor_kind();
    let want = desired::desired(obj, verdict, &ctx.settings, monitor.as_ref())?;
    let set = OwnedSet::of(obj, &want, monitor.as_ref())?;
    let looked = set.look(&ctx.client).await?;
    if !looked.foreign.is_empty() {
        tracing::warn!(objects = %looked.foreign.join("; "), "not applying: objects of kvfleet's names exist that this InferenceDeployment does not own");
        return Ok(Outcome {
            workload: owned::workload(&looked.ours)?,
            foreign: looked.foreign,
        });
    }
    let applied = set.apply(&ctx.client).await?;
    let served = owned::Served {
        inference_pool: ctx.inference_pool.load(Ordering::Relaxed),
        scaled_object: ctx.scaled_object.load(Ordering::Relaxed),
    };
    set.delete_orphans(&ctx.client, &owned::managed_kinds(monitor.as_ref(), served))
        .await?;
    Ok(Outcome {
        workload: owned::workload(&applied)?,
        foreign: Vec::new(),
    })
}

// === impl multi-node ===

/// Reason (Compatible=False, Warning Event) when replicas span nodes and the LeaderWorkerSet
/// CRD is not installed.
pub const LEADER_WORKER_SET_MISSING: &str = "LeaderWorkerSetCrdMissing";

pub use super::discovery::{
    inference_pool_served, keda_prometheus_address_missing, leader_worker_set_installed,
    scaled_object_served, KEDA_PROMETHEUS_ADDRESS_MISSING,
};

/// Turns an admitting multi-node verdict into a denial naming the CRD and how to install it.
pub fn deny_without_leader_worker_set(spec: &InferenceDeploymentSpec, verdict: &mut Verdict) {
    let Some(layout) = verdict.multi_node.take() else {
        return;
    };
    verdict.denials.push(crate::validate::Denial {
        field: "spec.engine.tensorParallelSize".into(),
        reason: LEADER_WORKER_SET_MISSING.into(),
        message: format!(
            "one replica needs {} GPUs (tensorParallelSize {} x pipelineParallelSize {}) and the selected nodes have at most {}, so it spans {} nodes and runs as a LeaderWorkerSet, but the API server does not serve leaderworkersets.{}/{}; install LeaderWorkerSet (kubernetes-sigs/lws: kubectl apply --server-side -f https://github.com/kubernetes-sigs/lws/releases/latest/download/manifests.yaml), or select nodes with at least {} GPUs, or lower the parallelism",
            spec.gpus_per_replica(),
            spec.engine.tensor_parallel_size,
            spec.engine.pipeline_parallel_size,
            layout.most_gpus_on_a_node,
            layout.nodes_per_replica,
            desired::LWS_GROUP,
            desired::LWS_VERSION,
            spec.gpus_per_replica()
        ),
    });
    verdict.resolved = None;
    verdict.node_affinity = None;
    verdict.compatible_nodes.clear();
    verdict.capacity = None;
    verdict.capacity_basis = None;
}

// === impl ownership ===

/// Degraded=True with [`OWNERSHIP_CONFLICT`], naming the objects (the Event follows from it).
fn mark_ownership_conflict(
    obj: &InferenceDeployment,
    st: &mut crate::api::InferenceDeploymentStatus,
    foreign: &[String],
) {
    let message = format!(
        "not applied: kvfleet never takes over objects it did not create, and {} already {}: delete or rename {}, or give this InferenceDeployment another name",
        foreign.join("; "),
        if foreign.len() == 1 { "exists" } else { "exist" },
        if foreign.len() == 1 { "it" } else { "them" },
    );
    let old = obj
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == status::DEGRADED));
    let last_transition_time = match old {
        Some(c) if c.status == "True" => c.last_transition_time.clone(),
        _ => k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Timestamp::now()),
    };
    let cond = k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
        type_: status::DEGRADED.into(),
        status: "True".into(),
        reason: OWNERSHIP_CONFLICT.into(),
        message,
        observed_generation: obj.metadata.generation,
        last_transition_time,
    };
    match st.conditions.iter_mut().find(|c| c.type_ == status::DEGRADED) {
        Some(c) => *c = cond,
        None => st.conditions.push(cond),
    }
}

async fn patch_status(
    ctx: &Context,
    ns: &str,
    name: &str,
    st: &crate::api::InferenceDeploymentStatus,
) -> Result<(), Error> {
    // The response is read as a DynamicObject: a stored object this build cannot parse must
    // not turn a successful status write into a failed pass.
    let resource = kube::api::ApiResource::erase::<InferenceDeployment>(&());
    let api = Api::<DynamicObject>::namespaced_with(ctx.client.clone(), ns, &resource);
    let body = json!({
        "apiVersion": InferenceDeployment::api_version(&()),
        "kind": InferenceDeployment::kind(&()),
        "metadata": { "name": name, "namespace": ns },
        "status": st,
    });
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    let mut attempt = 0;
    loop {
        match api.patch_status(name, &pp, &Patch::Apply(&body)).await {
            Ok(_) => return Ok(()),
            Err(e) if is_conflict(&e) && attempt + 1 < CONFLICT_RETRIES => attempt += 1,
            Err(source) => return Err(Error::kube("update status", source)),
        }
    }
}

/// The pods of the InferenceDeployment `name` (every ReplicaSet of its Deployment).
async fn list_pods(ctx: &Context, ns: &str, name: &str) -> Result<Vec<Pod>, Error> {
    let pods = Api::<Pod>::namespaced(ctx.client.clone(), ns)
        .list(&ListParams::default().labels(&desired::selector_string(name)))
        .await
        .map_err(|source| Error::kube("list pods", source))?;
    Ok(pods.items)
}

/// Smallest `kvfleet.io/measured-kv-tokens` over ready pods (a malformed value is ignored).
pub fn min_measured_tokens(pods: &[Pod]) -> Option<i64> {
    pods.iter()
        .filter(|p| {
            p.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        })
        .filter_map(|p| p.annotations().get(MEASURED_TOKENS_ANNOTATION))
        .filter_map(|v| v.trim().parse::<i64>().ok())
        .filter(|v| *v >= 0)
        .min()
}

/// Exit codes with which `kvfleet worker` refuses to start ([`crate::contract::exit`],
/// each after one `preflight failed` log line): the config is invalid, cannot run on this
/// machine (GPU, kernels' self-test), or its KV cache does not fit. Not `RUNTIME` (a failure
/// after start), 0, nor 128 + signal (137: OOM kill or SIGKILL).
pub const PREFLIGHT_EXIT_CODES: [i32; 3] = [
    exit::CONFIG as i32,
    exit::INCOMPATIBLE as i32,
    exit::NO_MEMORY as i32,
];

/// Why the worker pods will not start, when their `kvfleet` container's latest
/// termination is a preflight exit and it is not running again: the exit code's meaning, the
/// worker's termination message, how many pods, and where to look. `None` when no pod is
/// stuck in preflight.
pub fn preflight_failure(pods: &[Pod]) -> Option<String> {
    let worker = Runtime::Kvfleet.as_str();
    let mut stuck: Vec<(&str, &ContainerStateTerminated)> = Vec::new();
    for pod in pods {
        let statuses = pod
            .status
            .iter()
            .flat_map(|s| s.container_statuses.iter().flatten());
        for cs in statuses.filter(|cs| cs.name == worker) {
            let state = cs.state.as_ref();
            if state.is_some_and(|s| s.running.is_some()) {
                continue;
            }
            let latest = state
                .and_then(|s| s.terminated.as_ref())
                .or_else(|| cs.last_state.as_ref().and_then(|s| s.terminated.as_ref()));
            if let Some(t) = latest.filter(|t| PREFLIGHT_EXIT_CODES.contains(&t.exit_code)) {
                stuck.push((pod.metadata.name.as_deref().unwrap_or("?"), t));
            }
        }
    }
    let (first, t) = stuck.first()?;
    let meaning = match u8::try_from(t.exit_code).ok() {
        Some(exit::CONFIG) => "its configuration is invalid",
        Some(exit::INCOMPATIBLE) => "the configuration cannot run on this GPU",
        Some(exit::NO_MEMORY) => "the KV cache does not fit in the GPU memory left",
        _ => "preflight failed",
    };
    let said = t
        .message
        .as_deref()
        .map(str::trim)
        .filter(|m| !m.is_empty())
        .map(|m| format!(": {}", m.lines().next().unwrap_or(m)))
        .unwrap_or_default();
    Some(format!(
        "{} exit{} with code {} at start ({meaning}){said}; change the spec accordingly (kubectl logs {first} -c {} --previous shows the worker's reason)",
        if stuck.len() == 1 {
            format!("worker pod {first}")
        } else {
            format!("{} worker pods (e.g. {first})", stuck.len())
        },
        if stuck.len() == 1 { "s" } else { "" },
        t.exit_code,
        Runtime::Kvfleet.as_str()
    ))
}

/// Terminations of worker containers visible at the last look, per pod uid. Only the current
/// and the last termination of a container are ever visible, so this holds at most two per
/// pod, and pods that are gone are dropped on the next look.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SeenTerminations {
    pods: HashMap<String, Vec<String>>,
}

/// Pods + what the last look saw -> preflight failures not counted before + what this look
/// saw. A termination is counted once, whether it is seen as `state.terminated`, later as
/// `lastState.terminated`, or both; one that finished before `since` is only remembered.
/// Only the `kvfleet` container counts: a vLLM pod's exit codes mean something else.
pub fn count_preflight_failures(
    pods: &[Pod],
    previous: &SeenTerminations,
    since: Timestamp,
) -> (u64, SeenTerminations) {
    let worker = Runtime::Kvfleet.as_str();
    let mut count = 0;
    let mut next = SeenTerminations::default();
    for pod in pods {
        // Without a uid a termination cannot be told from the same one seen again.
        let Some(uid) = pod.metadata.uid.as_deref().filter(|u| !u.is_empty()) else {
            continue;
        };
        let before = previous.pods.get(uid);
        let statuses = pod
            .status
            .iter()
            .flat_map(|s| s.container_statuses.iter().flatten());
        let mut ids = Vec::new();
        for cs in statuses.filter(|cs| cs.name == worker) {
            let current = cs.state.as_ref().and_then(|s| s.terminated.as_ref());
            let last = cs.last_state.as_ref().and_then(|s| s.terminated.as_ref());
            for (t, which) in [(current, "current"), (last, "last")] {
                let Some(t) = t else { continue };
                let id = termination_id(t, cs.restart_count, which);
                if ids.contains(&id) {
                    continue;
                }
                let fresh = !before.is_some_and(|b| b.contains(&id));
                let recent = t.finished_at.as_ref().is_none_or(|f| f.0 >= since);
                if fresh && recent && PREFLIGHT_EXIT_CODES.contains(&t.exit_code) {
                    count += 1;
                }
                ids.push(id);
            }
        }
        if !ids.is_empty() {
            next.pods.insert(uid.to_string(), ids);
        }
    }
    (count, next)
}

/// What identifies one termination in both `state` and `lastState`: the container id, else
/// the finish time; the restart count (which differs between the two) only as a last resort.
fn termination_id(t: &ContainerStateTerminated, restart_count: i32, which: &str) -> String {
    if let Some(id) = t.container_id.as_deref().filter(|id| !id.is_empty()) {
        return id.to_string();
    }
    if let Some(f) = &t.finished_at {
        return format!("finished:{}", f.0);
    }
    format!("restart:{restart_count}:{which}")
}

#[cfg(test)]
mod tests;
