//! One reconcile pass: fetch -> validate (pure) -> desired objects (pure) -> server-side
//! apply -> status and Events; plus the error policy.

use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Node, ObjectReference, Pod, Service, ServiceAccount};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::RoleBinding;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use kube::core::error_boundary::InvalidObject;
use kube::core::DeserializeGuard;
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::Store;
use kube::{Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::json;

use crate::api::{InferenceDeployment, InferenceDeploymentSpec, Runtime};
use crate::validate::{ClusterFacts, Denial, NodeFacts, Verdict};

use super::desired::{self, MonitorKind, Settings, MEASURED_TOKENS_ANNOTATION};
use super::metrics::Metrics;
use super::status::{self, CapacityPrediction, Observed};
use super::Error;

/// The one field manager of every server-side apply.
pub const FIELD_MANAGER: &str = "kvfleet-controller";
/// How often a settled object is looked at again without any watch event.
pub const RESYNC: Duration = Duration::from_secs(300);
/// How often an object whose workers have not yet reported capacity is looked at again.
pub const CAPACITY_POLL: Duration = Duration::from_secs(30);
const CONFLICT_RETRIES: usize = 3;

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

/// Shared by every reconcile pass.
pub struct Context {
    pub client: Client,
    pub recorder: Recorder,
    /// Nodes as seen by the node watch; read on every pass.
    pub nodes: Store<Node>,
    /// ServiceMonitor or PodMonitor resource when the Prometheus Operator CRDs exist.
    pub monitor: RwLock<Option<MonitorKind>>,
    pub settings: Settings,
    pub metrics: Metrics,
    pub validate: ValidateFn,
    pub predict: PredictFn,
    /// Consecutive failures per object, for backoff.
    failures: Mutex<HashMap<String, u32>>,
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
            settings,
            metrics,
            validate: crate::validate::validate,
            predict: verdict_capacity,
            failures: Mutex::new(HashMap::new()),
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
        ClusterFacts { nodes }
    }

    fn monitor_kind(&self) -> Option<MonitorKind> {
        self.monitor
            .read()
            .map(|m| m.clone())
            .unwrap_or_else(|p| p.into_inner().clone())
    }

    fn failures(&self) -> std::sync::MutexGuard<'_, HashMap<String, u32>> {
        self.failures.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn publish(&self, regarding: &ObjectReference, n: &status::Notice) {
        let ev = Event {
            type_: if n.warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: n.reason.clone(),
            note: Some(truncate(&n.note, 1000)),
            action: "Reconcile".into(),
            secondary: None,
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
            ctx.failures().remove(&key(&obj));
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
        let mut f = ctx.failures();
        let n = f.entry(k.clone()).or_insert(0);
        *n = n.saturating_add(1);
        *n
    };
    let delay = backoff(error, n);
    tracing::warn!(object = %k, %category, attempt = n, retry_in_s = delay.as_secs_f64(),
        error = %crate::cli::error_chain(error), "reconcile failed");
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
    if obj.metadata.deletion_timestamp.is_some() {
        // Everything we create carries an owner reference: the garbage collector removes it.
        return Ok(Action::await_change());
    }
    let ns = obj
        .namespace()
        .ok_or(Error::Desired(desired::DesiredError::MissingMetadata(
            "namespace",
        )))?;
    let name = obj.name_any();
    let facts = ctx.cluster_facts();
    let mut verdict = (ctx.validate)(&obj.spec, &facts);
    if verdict.allowed() && obj.spec.engine.runtime == Runtime::Kvfleet && obj.spec.model.geometry.is_none() {
        verdict.denials.push(Denial {
            field: "spec.model.geometry".into(),
            reason: "GeometryRequired".into(),
            message: desired::DesiredError::GeometryRequired.to_string(),
        });
    }

    let mut prediction = None;
    let mut measured = None;
    let deployment = if verdict.allowed() {
        prediction = (ctx.predict)(&obj.spec, &verdict);
        let monitor = ctx.monitor_kind();
        let want = desired::desired(obj, &verdict, &ctx.settings, monitor.as_ref())?;
        let c = &ctx.client;
        if let Some(cm) = &want.config_map {
            apply(&Api::<ConfigMap>::namespaced(c.clone(), &ns), cm).await?;
        }
        if let Some(sa) = &want.service_account {
            apply(&Api::<ServiceAccount>::namespaced(c.clone(), &ns), sa).await?;
        }
        if let Some(rb) = &want.role_binding {
            apply(&Api::<RoleBinding>::namespaced(c.clone(), &ns), rb).await?;
        }
        let dep = apply(&Api::<Deployment>::namespaced(c.clone(), &ns), &want.deployment).await?;
        apply(&Api::<Service>::namespaced(c.clone(), &ns), &want.service).await?;
        let pdbs = Api::<PodDisruptionBudget>::namespaced(c.clone(), &ns);
        match &want.pdb {
            Some(pdb) => {
                apply(&pdbs, pdb).await?;
            }
            // One replica with a PDB would block every node drain: remove it when scaling down.
            None => delete_if_present(&pdbs, &name).await?,
        }
        if let (Some(mon), Some(kind)) = (&want.monitor, &monitor) {
            let api = Api::<DynamicObject>::namespaced_with(c.clone(), &ns, &kind.resource);
            apply(&api, mon).await?;
        }
        if obj.spec.engine.runtime == Runtime::Kvfleet
            && dep.status.as_ref().and_then(|s| s.ready_replicas).unwrap_or(0) > 0
        {
            measured = measured_tokens(ctx, &ns, &name).await?;
        }
        Some(dep)
    } else {
        // Leave what runs alone; just report on it.
        Api::<Deployment>::namespaced(ctx.client.clone(), &ns)
            .get_opt(&name)
            .await
            .map_err(|source| Error::kube("read Deployment", source))?
    };

    let seen = Observed {
        verdict: Some(&verdict),
        prediction: prediction.as_ref(),
        deployment: deployment.as_ref(),
        measured_tokens: measured,
    };
    let new_status = status::compute(obj, &seen, Timestamp::now());
    if obj.status.as_ref() != Some(&new_status) {
        patch_status(ctx, &ns, &name, &new_status).await?;
    }
    let regarding = obj.object_ref(&());
    for n in status::notices(obj.status.as_ref(), &new_status, Some(&verdict)) {
        ctx.publish(&regarding, &n).await;
    }

    Ok(if !verdict.allowed() {
        // Invalid spec or no compatible node: a spec change or a node change wakes us.
        Action::await_change()
    } else if obj.spec.engine.runtime == Runtime::Kvfleet
        && new_status.ready_replicas.unwrap_or(0) > 0
        && measured.is_none()
    {
        // Pod annotations are not watched: look again until the workers report capacity.
        Action::requeue(CAPACITY_POLL)
    } else {
        Action::requeue(RESYNC)
    })
}

/// Server-side apply with the controller's field manager, retried on conflicts.
pub async fn apply<K>(api: &Api<K>, obj: &K) -> Result<K, Error>
where
    K: Resource + Serialize + DeserializeOwned + Clone + Debug,
{
    let name = obj.meta().name.clone().unwrap_or_default();
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    let mut attempt = 0;
    loop {
        match api.patch(&name, &pp, &Patch::Apply(obj)).await {
            Ok(o) => return Ok(o),
            Err(e) if is_conflict(&e) && attempt + 1 < CONFLICT_RETRIES => attempt += 1,
            Err(source) => return Err(Error::kube(format!("apply {} {name}", kind_of(obj)), source)),
        }
    }
}

fn kind_of<K: Resource + Serialize>(obj: &K) -> String {
    serde_json::to_value(obj)
        .ok()
        .and_then(|v| v.get("kind").and_then(|k| k.as_str()).map(str::to_string))
        .unwrap_or_else(|| "object".into())
}

async fn delete_if_present<K>(api: &Api<K>, name: &str) -> Result<(), Error>
where
    K: Resource + DeserializeOwned + Clone + Debug,
{
    match api.delete(name, &DeleteParams::background()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(source) => Err(Error::kube(format!("delete {name}"), source)),
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

/// Smallest measured capacity over ready pods that report one.
async fn measured_tokens(ctx: &Context, ns: &str, name: &str) -> Result<Option<i64>, Error> {
    let pods = Api::<Pod>::namespaced(ctx.client.clone(), ns)
        .list(&ListParams::default().labels(&desired::selector_string(name)))
        .await
        .map_err(|source| Error::kube("list pods", source))?;
    Ok(min_measured_tokens(&pods.items))
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

pub(crate) fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(ready: bool, tokens: Option<&str>) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p", "annotations": tokens.map(|t| json!({MEASURED_TOKENS_ANNOTATION: t})).unwrap_or(json!({}))},
            "status": {"conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]}
        }))
        .unwrap()
    }

    #[test]
    fn measured_capacity_is_the_smallest_over_ready_pods_and_ignores_garbage() {
        let pods = [
            pod(true, Some("25200")),
            pod(true, Some(" 24000 ")),
            pod(false, Some("100")),
            pod(true, Some("lots")),
            pod(true, Some("-5")),
            pod(true, None),
        ];
        assert_eq!(min_measured_tokens(&pods), Some(24000));
        assert_eq!(min_measured_tokens(&[pod(false, Some("1"))]), None);
    }
}
