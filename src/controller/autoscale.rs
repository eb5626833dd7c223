//! The KV-demand autoscaler (`spec.autoscaling`, engine `kvfleet`; docs/autoscaling.md).
//!
//! Every interval, for each autoscaled InferenceDeployment: read each ready worker's
//! `/v1/capacity` (`live.kvDemandTokens`, `live.kvCapacityTokens`: window-aware, in tokens
//! of maxModelLen requests, so replicas add up) and, behind a kvfleet router, the demand of
//! the requests the router holds while no replica is ready (`/v1/router/state`,
//! `held.demandTokens`); ask [`kvfleet_core::autoscale`] (the HorizontalPodAutoscaler's
//! algorithm on demand over capacity) for a count; write `status.autoscaling` first, then the
//! workers' Deployment through its scale subresource, under the field manager
//! [`FIELD_MANAGER`]. Once the autoscaler has decided, the reconciler leaves
//! `spec.replicas` of the Deployment out of its apply ([`super::desired::applied_replicas`]),
//! so the count has one writer; `kubectl scale` is overridden at the next decision, as with
//! an HPA.
//!
//! No Prometheus is needed: the controller reads the pods itself, over the pod network,
//! with a timeout per pod (a worker that does not answer is left out of the reading).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use http_body_util::BodyExt;
use hyper_util::client::legacy::{connect::HttpConnector, Client as HttpClient};
use hyper_util::rt::TokioExecutor;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, Patch, PatchParams};
use kube::core::DeserializeGuard;
use kube::runtime::reflector::Store;
use kube::{Resource, ResourceExt};
use kvfleet_core::autoscale::{self as policy, Autoscaler, Decision, Observation, Sample};
use serde_json::{json, Value};
use tokio::sync::watch;

use super::desired::{self, HTTP_PORT};
use super::reconcile::Context;
use super::status::Notice;
use crate::api::{
    AutoscalingEngine, AutoscalingSpec, AutoscalingStatus, InferenceDeployment, RoutingMode,
    ScalingPolicyType, ScalingRules, SelectPolicy,
};

/// The `kind` label values of `kvfleet_autoscaling_replicas`.
const REPLICA_KINDS: [&str; 5] = ["desired", "recommended", "observed", "min", "max"];

/// Field manager of the autoscaler's writes (the Deployment's scale, `status.autoscaling`).
pub const FIELD_MANAGER: &str = "kvfleet-autoscaler";
/// How long one pod may take to answer a reading.
const READ_TIMEOUT: Duration = Duration::from_secs(2);

type Http = HttpClient<HttpConnector, http_body_util::Empty<axum::body::Bytes>>;

/// The HPA behaviour of `spec.autoscaling` as the policy takes it.
pub fn policy_of(a: &AutoscalingSpec) -> policy::Policy {
    let mut p = policy::Policy::with_bounds(a.min_replicas.max(0) as u32, a.max_replicas.max(1) as u32);
    p.target_demand_ratio = a.target_demand_ratio;
    p.scale_up = rules_of(a.scale_up.as_ref(), policy::Rules::default_up());
    p.scale_down = rules_of(a.scale_down.as_ref(), policy::Rules::default_down());
    p
}

/// A direction's rules: what the spec gives, the HPA's defaults for what it leaves out.
fn rules_of(r: Option<&ScalingRules>, default: policy::Rules) -> policy::Rules {
    let Some(r) = r else { return default };
    policy::Rules {
        stabilization_window_seconds: r
            .stabilization_window_seconds
            .map_or(default.stabilization_window_seconds, |w| w.max(0) as u32),
        select: match r.select_policy {
            None => default.select,
            Some(SelectPolicy::Max) => policy::Select::Max,
            Some(SelectPolicy::Min) => policy::Select::Min,
            Some(SelectPolicy::Disabled) => policy::Select::Disabled,
        },
        steps: if r.policies.is_empty() {
            default.steps
        } else {
            r.policies
                .iter()
                .map(|p| policy::Step {
                    kind: match p.type_ {
                        ScalingPolicyType::Pods => policy::StepKind::Pods,
                        ScalingPolicyType::Percent => policy::StepKind::Percent,
                    },
                    value: p.value.max(1) as u32,
                    period_seconds: p.period_seconds.max(1) as u32,
                })
                .collect()
        },
    }
}

/// Runs the autoscaler every `every` until `stop` (the controller runs it while it leads).
pub async fn run(
    ctx: Arc<Context>,
    store: Store<DeserializeGuard<InferenceDeployment>>,
    every: Duration,
    mut stop: watch::Receiver<bool>,
) {
    // The store fills with the controller's first list; until then a tick reads nothing.
    tracing::info!(every = ?every, "KV-demand autoscaler running");
    let http: Http = HttpClient::builder(TokioExecutor::new()).build_http();
    let started = Instant::now();
    let mut scalers: HashMap<String, Autoscaler> = HashMap::new();
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let now = started.elapsed().as_secs_f64();
        let objects: Vec<Arc<InferenceDeployment>> = store
            .state()
            .into_iter()
            .filter_map(|g| g.0.as_ref().ok().map(|o| Arc::new(o.clone())))
            .collect();
        let mut seen = Vec::new();
        for obj in objects {
            let key = format!("{}/{}", obj.namespace().unwrap_or_default(), obj.name_any());
            let scaled = obj
                .spec
                .autoscaling
                .as_ref()
                .is_some_and(|a| a.engine == AutoscalingEngine::Kvfleet);
            if !scaled {
                if obj.status.as_ref().is_some_and(|s| s.autoscaling.is_some()) {
                    clear_status(&ctx, &obj).await;
                }
                continue;
            }
            seen.push(key.clone());
            let scaler = scalers.entry(key.clone()).or_default();
            if let Err(error) = step(&ctx, &http, &obj, scaler, now).await {
                tracing::warn!(object = %key, %error, "autoscaling step failed");
            }
        }
        scalers.retain(|k, _| seen.contains(k));
        forget_series(&ctx, &seen);
    }
}

/// One reading and decision for `obj`.
async fn step(
    ctx: &Context,
    http: &Http,
    obj: &InferenceDeployment,
    scaler: &mut Autoscaler,
    now: f64,
) -> Result<(), String> {
    let (ns, name) = (obj.namespace().unwrap_or_default(), obj.name_any());
    let a = obj.spec.autoscaling.as_ref().ok_or("no spec.autoscaling")?;
    let deployments = Api::<Deployment>::namespaced(ctx.client.clone(), &ns);
    let Some(deployment) = deployments.get_opt(&name).await.map_err(|e| e.to_string())? else {
        return Ok(()); // the reconciler has not created it yet
    };
    let current = deployment
        .spec
        .as_ref()
        .and_then(|s| s.replicas)
        .unwrap_or(1)
        .max(0) as u32;
    let pods = Api::<Pod>::namespaced(ctx.client.clone(), &ns);
    let workers = ready_ips(&pods, &desired::selector_string(&name)).await?;
    let ready: Vec<Sample> = join_all(workers.iter().map(|ip| read_worker(http, ip)))
        .await
        .into_iter()
        .flatten()
        .collect();
    let pending = if obj.spec.routing_mode() == RoutingMode::Kvfleet {
        let routers = ready_ips(&pods, &router_selector(&name)).await?;
        join_all(routers.iter().map(|ip| read_router_held(http, ip)))
            .await
            .into_iter()
            .flatten()
            .sum()
    } else {
        0
    };
    let status = obj.status.as_ref();
    let hint = status.and_then(|s| s.capacity.as_ref()).and_then(|c| {
        c.measured_tokens_per_replica
            .or(c.tokens_per_replica)
            .map(|t| t.max(0) as u64)
    });
    let observation = Observation {
        now_seconds: now,
        current_replicas: current,
        ready: ready.clone(),
        pending_demand_tokens: pending,
        capacity_hint_tokens: hint,
    };
    let decision = scaler.decide(&policy_of(a), &observation);
    tracing::debug!(object = %name, current, ready = ready.len(), pending, ?decision, "autoscaling decision");
    let old = status.and_then(|s| s.autoscaling.clone()).unwrap_or_default();
    let first = old.desired_replicas.is_none();
    let changed = decision.desired != current;
    let demand: u64 = ready.iter().map(|s| s.demand_tokens).sum::<u64>() + pending;
    let capacity: u64 = ready.iter().map(|s| s.capacity_tokens).sum();
    let new = AutoscalingStatus {
        desired_replicas: Some(decision.desired as i32),
        recommended_replicas: Some(decision.recommendation as i32),
        observed_replicas: Some(ready.len() as i32),
        demand_tokens: Some(demand as i64),
        capacity_tokens: Some(capacity as i64),
        demand_ratio: decision.demand_ratio.map(|r| format!("{r:.3}")),
        reason: Some(decision.reason.as_str().to_string()),
        message: Some(decision.message.clone()),
        last_scale_time: if changed {
            Some(k8s_openapi::jiff::Timestamp::now().to_string())
        } else {
            old.last_scale_time.clone()
        },
    };
    record(ctx, &ns, &name, &new, a);
    // Status first: a reconcile woken by it leaves the count to us from then on.
    if new != old {
        write_status(ctx, &ns, &name, &new).await?;
    }
    if changed || first {
        apply_scale(&deployments, &ns, &name, decision.desired).await?;
    }
    if changed || old.reason.as_deref() != Some(decision.reason.as_str()) {
        publish(ctx, obj, &decision, current).await;
    }
    Ok(())
}

/// Pod IPs of the ready, not terminating pods matching `selector`.
async fn ready_ips(pods: &Api<Pod>, selector: &str) -> Result<Vec<String>, String> {
    let list = pods
        .list(&ListParams::default().labels(selector))
        .await
        .map_err(|e| format!("list pods: {e}"))?;
    Ok(list
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter_map(|p| {
            let s = p.status?;
            let ready = s
                .conditions
                .as_ref()?
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True");
            ready.then_some(s.pod_ip).flatten()
        })
        .collect())
}

fn router_selector(name: &str) -> String {
    desired::router_selector_labels(name)
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// GETs `http://ip:8000/path` as JSON within [`READ_TIMEOUT`].
async fn get_json(http: &Http, ip: &str, path: &str) -> Result<Value, String> {
    let host = if ip.contains(':') {
        format!("[{ip}]")
    } else {
        ip.to_string()
    };
    let uri: hyper::Uri = format!("http://{host}:{HTTP_PORT}{path}")
        .parse()
        .map_err(|e| format!("{e}"))?;
    let resp = tokio::time::timeout(READ_TIMEOUT, http.get(uri))
        .await
        .map_err(|_| "timed out".to_string())?
        .map_err(|e| e.to_string())?;
    if !resp.status().is_success() {
        return Err(format!("status {}", resp.status()));
    }
    let body = tokio::time::timeout(READ_TIMEOUT, resp.into_body().collect())
        .await
        .map_err(|_| "body timed out".to_string())?
        .map_err(|e| e.to_string())?
        .to_bytes();
    serde_json::from_slice(&body).map_err(|e| e.to_string())
}

/// One worker's demand and capacity; `None` when it does not answer or exports no signal.
async fn read_worker(http: &Http, ip: &str) -> Option<Sample> {
    match get_json(http, ip, "/v1/capacity").await {
        Ok(v) => sample_of(&v),
        Err(error) => {
            tracing::debug!(%ip, %error, "worker reading failed");
            None
        }
    }
}

/// The autoscaling signal in a worker's `/v1/capacity`.
pub fn sample_of(capacity: &Value) -> Option<Sample> {
    let live = capacity.get("live")?;
    Some(Sample {
        demand_tokens: live.get("kvDemandTokens")?.as_u64()?,
        capacity_tokens: live.get("kvCapacityTokens")?.as_u64().filter(|c| *c > 0)?,
    })
}

/// Demand of the requests one router holds (0 when it answers nothing).
async fn read_router_held(http: &Http, ip: &str) -> Option<u64> {
    match get_json(http, ip, "/v1/router/state").await {
        Ok(v) => v.pointer("/held/demandTokens").and_then(Value::as_u64),
        Err(error) => {
            tracing::debug!(%ip, %error, "router reading failed");
            None
        }
    }
}

fn merge_params() -> PatchParams {
    PatchParams {
        field_manager: Some(FIELD_MANAGER.to_string()),
        ..PatchParams::default()
    }
}

fn status_api(ctx: &Context, ns: &str) -> Api<DynamicObject> {
    let resource = ApiResource::erase::<InferenceDeployment>(&());
    Api::namespaced_with(ctx.client.clone(), ns, &resource)
}

async fn write_status(ctx: &Context, ns: &str, name: &str, st: &AutoscalingStatus) -> Result<(), String> {
    status_api(ctx, ns)
        .patch_status(
            name,
            &merge_params(),
            &Patch::Merge(json!({"status": {"autoscaling": st}})),
        )
        .await
        .map(|_| ())
        .map_err(|e| format!("update status.autoscaling: {e}"))
}

async fn clear_status(ctx: &Context, obj: &InferenceDeployment) {
    let (ns, name) = (obj.namespace().unwrap_or_default(), obj.name_any());
    let r = status_api(ctx, &ns)
        .patch_status(
            &name,
            &merge_params(),
            &Patch::Merge(json!({"status": {"autoscaling": null}})),
        )
        .await;
    if let Err(error) = r {
        tracing::warn!(object = %name, %error, "cannot clear status.autoscaling");
    }
}

/// Sets the Deployment's replicas through its scale subresource, taking the field over
/// from whoever set it before (the reconciler's first apply, `kubectl scale`).
async fn apply_scale(
    deployments: &Api<Deployment>,
    ns: &str,
    name: &str,
    replicas: u32,
) -> Result<(), String> {
    let scale = json!({
        "apiVersion": "autoscaling/v1",
        "kind": "Scale",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"replicas": replicas},
    });
    deployments
        .patch_scale(
            name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&scale),
        )
        .await
        .map(|_| ())
        .map_err(|e| format!("scale Deployment {ns}/{name}: {e}"))
}

/// An Event for a change of count or of reason (AtMaxReplicas is a warning: demand the
/// fleet cannot hold).
async fn publish(ctx: &Context, obj: &InferenceDeployment, d: &Decision, from: u32) {
    let note = if d.desired != from {
        format!("replicas {from} -> {}: {}", d.desired, d.message)
    } else {
        d.message.clone()
    };
    let n = Notice {
        warning: d.reason == policy::Reason::AtMaxReplicas,
        reason: d.reason.as_str().to_string(),
        note,
    };
    ctx.publish(&obj.object_ref(&()), &n).await;
}

/// The bounds go out too (kind `min`, `max`), so that a rule can tell a fleet held at
/// maxReplicas (KvfleetDemandAboveCapacityAtMaxReplicas).
fn record(ctx: &Context, ns: &str, name: &str, st: &AutoscalingStatus, a: &AutoscalingSpec) {
    let m = &ctx.metrics;
    for (kind, v) in [
        ("desired", st.desired_replicas),
        ("recommended", st.recommended_replicas),
        ("observed", st.observed_replicas),
        ("min", Some(a.min_replicas)),
        ("max", Some(a.max_replicas)),
    ] {
        m.autoscaling_replicas
            .with_label_values(&[ns, name, kind])
            .set(i64::from(v.unwrap_or(0)));
    }
    for (kind, v) in [("demand", st.demand_tokens), ("capacity", st.capacity_tokens)] {
        m.autoscaling_tokens
            .with_label_values(&[ns, name, kind])
            .set(v.unwrap_or(0));
    }
}

/// Drops the series of objects no longer autoscaled.
fn forget_series(ctx: &Context, keep: &[String]) {
    let m = &ctx.metrics;
    let mut gone = Vec::new();
    for family in prometheus::core::Collector::collect(&m.autoscaling_replicas) {
        for metric in family.get_metric() {
            let labels: HashMap<&str, &str> =
                metric.get_label().iter().map(|l| (l.name(), l.value())).collect();
            let (ns, name) = (
                labels.get("namespace").copied(),
                labels.get("inferencedeployment").copied(),
            );
            if let (Some(ns), Some(name)) = (ns, name) {
                if !keep.contains(&format!("{ns}/{name}")) {
                    gone.push((ns.to_string(), name.to_string()));
                }
            }
        }
    }
    gone.dedup();
    for (ns, name) in gone {
        for kind in REPLICA_KINDS {
            let _ = m.autoscaling_replicas.remove_label_values(&[&ns, &name, kind]);
        }
        for kind in ["demand", "capacity"] {
            let _ = m.autoscaling_tokens.remove_label_values(&[&ns, &name, kind]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spec_maps_onto_the_policy_with_the_hpa_defaults_for_what_it_leaves_out() {
        let a: AutoscalingSpec = serde_json::from_value(json!({
            "minReplicas": 0, "maxReplicas": 6, "targetDemandRatio": 0.7,
            "scaleDown": {"stabilizationWindowSeconds": 60, "policies": [{"type": "Pods", "value": 1, "periodSeconds": 30}]}
        }))
        .unwrap();
        let p = policy_of(&a);
        assert_eq!((p.min_replicas, p.max_replicas), (0, 6));
        assert_eq!(p.target_demand_ratio, 0.7);
        assert_eq!(p.scale_up, policy::Rules::default_up());
        assert_eq!(p.scale_down.stabilization_window_seconds, 60);
        assert_eq!(p.scale_down.steps.len(), 1);
        assert_eq!(p.scale_down.steps[0].value, 1);
        assert_eq!(p.scale_down.steps[0].period_seconds, 30);
        assert!(p.check().is_ok());
    }

    #[test]
    fn a_worker_reading_needs_both_gauges_and_a_non_empty_pool() {
        let v = json!({"live": {"kvDemandTokens": 120, "kvCapacityTokens": 4096}});
        assert_eq!(
            sample_of(&v),
            Some(Sample {
                demand_tokens: 120,
                capacity_tokens: 4096
            })
        );
        assert_eq!(
            sample_of(&json!({"live": {"kvDemandTokens": 1}})),
            None,
            "an older worker"
        );
        assert_eq!(
            sample_of(&json!({"live": {"kvDemandTokens": 1, "kvCapacityTokens": 0}})),
            None
        );
    }
}
