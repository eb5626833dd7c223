//! InferenceDeployment + verdict -> the objects that run it (pure: no client, no I/O).
//!
//! Every function here is deterministic in its inputs so the reconcile loop can
//! server-side apply the result on every pass and the API server sees no change when
//! nothing changed.
//!
//! This file holds what every object shares (names, labels, owner metadata) and
//! [`desired`], which composes one builder per object:
//!
//! | object                           | file                       |
//! |----------------------------------|----------------------------|
//! | ConfigMap (worker config)        | `config_map.rs`            |
//! | ServiceAccount, RoleBinding      | `rbac.rs`                  |
//! | pod template                     | `pod.rs`, `container.rs`   |
//! | serving process per runtime      | `worker.rs`, `vllm.rs`     |
//! | Deployment                       | `deployment.rs`            |
//! | LeaderWorkerSet (multi-node)     | `leader_worker_set.rs`     |
//! | Service                          | `service.rs`               |
//! | PodDisruptionBudget              | `pod_disruption_budget.rs` |
//! | ServiceMonitor / PodMonitor      | `monitor.rs`               |
//! | NetworkPolicy                    | `network_policy.rs`        |
//! | the kvfleet router (routing)     | `router.rs`                |
//! | InferencePool (routing)          | `inference_pool.rs`        |
//! | KEDA ScaledObject (autoscaling)  | `scaled_object.rs`         |

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::{NetworkPolicy, NetworkPolicyPeer};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::RoleBinding;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{ApiResource, DynamicObject};
use kube::{Resource, ResourceExt};

use crate::api::{
    AttentionBackend, InferenceDeployment, InferenceDeploymentSpec, KvCacheDtype, RoutingMode, Runtime,
};
use crate::validate::Verdict;

mod config_map;
mod container;
mod deployment;
mod inference_pool;
mod leader_worker_set;
mod monitor;
mod network_policy;
mod pod;
mod pod_disruption_budget;
mod rbac;
mod router;
mod scaled_object;
mod service;
mod vllm;
mod worker;

#[cfg(test)]
pub(crate) mod fixtures;

pub use config_map::{CONFIG_HASH_ANNOTATION, WORKER_CONFIG_KEY};
pub use container::PRE_STOP_SECONDS;
pub use container::{startup_probe_failures, CAPACITY_SIDECAR, STARTUP_PROBE_PERIOD_S};
pub use deployment::rollout;
pub use inference_pool::inference_pool_resource;
pub use leader_worker_set::{
    leader_worker_set_resource, multi_node_args, LWS_GROUP, LWS_KIND, LWS_LEADER_ADDRESS_ENV, LWS_PLURAL,
    LWS_VERSION, LWS_WORKER_INDEX_LABEL, NODE_RANK_ENV,
};
pub use monitor::{monitor_relabelings, MONITOR_TARGET_LABEL};
pub use network_policy::worker_network_policy;
pub use pod::{RUN_AS_USER, TERMINATION_GRACE_SECONDS};
pub use rbac::WORKER_CLUSTER_ROLE;
pub use router::{routed_spec, router_args, router_selector_labels, Router, ROUTER_CONTAINER, ROUTER_LABEL};
pub use scaled_object::{demand_query, scaled_object_resource, TRIGGER_NAME};
pub use vllm::{rendered_vllm_version, vllm_args, vllm_args_at, vllm_env, vllm_image, HF_CACHE_DIR};
pub use worker::{worker_args, worker_config, worker_config_yaml, worker_model_source};

pub use crate::contract::{HTTP_PORT, INSTANCE_LABEL, MEASURED_TOKENS_ANNOTATION};

/// Images and other operator-wide choices (from the controller's flags).
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    /// Image of `kvfleet worker` when the spec names none.
    pub worker_image: String,
    /// Image of the vLLM OpenAI server when the spec names none.
    pub vllm_image: String,
    /// Peers that scrape `/metrics` (the chart's `networkPolicy.metricsFrom`): admitted by every
    /// worker NetworkPolicy besides the spec's `network.allowFrom`. Empty: none besides those.
    pub worker_metrics_from: Vec<NetworkPolicyPeer>,
    /// Prometheus that KEDA's trigger queries for `autoscaling.engine: keda` (the chart's
    /// `autoscaling.keda.prometheusAddress`). `None`: such a spec is denied by the controller.
    pub keda_prometheus_address: Option<String>,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            // What `make image` tags and the chart's image.repository/appVersion default to.
            worker_image: format!("kvfleet:{}", env!("CARGO_PKG_VERSION")),
            // A release whose every flag kvfleet renders exists (compat/vllm_versions.rs).
            vllm_image: crate::compat::vllm_versions::default_image(),
            worker_metrics_from: Vec::new(),
            keda_prometheus_address: None,
        }
    }
}

/// Which Prometheus Operator resource to create, as found by discovery.
#[derive(Clone, Debug, PartialEq)]
pub struct MonitorKind {
    pub resource: ApiResource,
    /// `ServiceMonitor` or `PodMonitor`.
    pub kind: String,
}

/// Everything one InferenceDeployment should own.
#[derive(Clone, Debug, PartialEq)]
pub struct Desired {
    /// Worker configuration (kvfleet runtime only).
    pub config_map: Option<ConfigMap>,
    /// Identity of the worker pods (kvfleet runtime only: they annotate their own pod).
    pub service_account: Option<ServiceAccount>,
    /// Binds the service account to the `kvfleet-worker` ClusterRole.
    pub role_binding: Option<RoleBinding>,
    /// The pods of a replica that fits one node; `None` when replicas span nodes.
    pub deployment: Option<Deployment>,
    /// The pods of replicas that span nodes (`verdict.multi_node`): a LeaderWorkerSet
    /// (leaderworkerset.x-k8s.io/v1), one group of a leader and workers per replica.
    pub leader_worker_set: Option<DynamicObject>,
    pub service: Service,
    /// Only when replicas > 1; otherwise an existing one is removed.
    pub pdb: Option<PodDisruptionBudget>,
    /// Only when the Prometheus Operator CRDs exist.
    pub monitor: Option<DynamicObject>,
    /// Only when the spec sets `network`; otherwise an existing one of ours is removed.
    pub network_policy: Option<NetworkPolicy>,
    /// Routing mode kvfleet: the router and what it needs.
    pub router: Option<Router>,
    /// Routing mode inferencePool: the InferencePool `<name>` (the controller applies it only
    /// where the API server serves InferencePools; elsewhere the spec is denied).
    pub inference_pool: Option<DynamicObject>,
    /// `autoscaling.engine: keda`: the KEDA ScaledObject `<name>` on the workers' Deployment
    /// (applied only where the API server serves ScaledObjects; elsewhere the spec is denied).
    pub scaled_object: Option<DynamicObject>,
}

/// The object lacks metadata the owned objects need.
#[derive(Debug, thiserror::Error)]
pub enum DesiredError {
    #[error("InferenceDeployment has no {0}; it must come from the API server (namespace, name and uid are set there)")]
    MissingMetadata(&'static str),
    #[error("cannot render the worker config as YAML")]
    WorkerConfig(#[source] serde_yaml::Error),
    #[error("runtime kvfleet needs spec.model.geometry inline; spec.model.config is read only by the vllm runtime")]
    GeometryRequired,
    #[error("cannot encode {0} as JSON for server-side apply")]
    Encode(String, #[source] serde_json::Error),
}

// === names and labels ===

/// Names of the owned objects.
pub fn config_map_name(name: &str) -> String {
    format!("{name}-config")
}
pub fn worker_service_account_name(name: &str) -> String {
    format!("{name}-worker")
}
pub fn worker_network_policy_name(name: &str) -> String {
    format!("{name}-worker")
}
/// The router's Deployment, PodDisruptionBudget, ServiceAccount, Role, RoleBinding and
/// NetworkPolicy (routing mode kvfleet).
pub fn router_name(name: &str) -> String {
    format!("{name}-router")
}
/// The headless Service whose EndpointSlices list the workers for the router.
pub fn workers_service_name(name: &str) -> String {
    format!("{name}-workers")
}

/// Labels selecting the pods of `name` (immutable once a Deployment exists).
pub fn selector_labels(name: &str) -> BTreeMap<String, String> {
    BTreeMap::from([(INSTANCE_LABEL.to_string(), name.to_string())])
}

/// The selector as a string, for `status.selector` (scale subresource, HPAs).
pub fn selector_string(name: &str) -> String {
    format!("{INSTANCE_LABEL}={name}")
}

/// Label on every object kvfleet creates, with [`MANAGED_BY`] as its value.
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
pub const MANAGED_BY: &str = "kvfleet";
/// Label naming the InferenceDeployment an object was created for.
pub const APP_INSTANCE_LABEL: &str = "app.kubernetes.io/instance";

/// Selects every object kvfleet created for the InferenceDeployment `name` (the orphan sweep's
/// list; ownership is still checked on each object found).
pub fn owned_selector(name: &str) -> String {
    format!("{MANAGED_BY_LABEL}={MANAGED_BY},{APP_INSTANCE_LABEL}={name}")
}

fn common_labels(name: &str, runtime: Runtime) -> BTreeMap<String, String> {
    let mut l = selector_labels(name);
    l.insert("app.kubernetes.io/name".into(), runtime.as_str().into());
    l.insert(APP_INSTANCE_LABEL.into(), name.into());
    l.insert("app.kubernetes.io/component".into(), "inference".into());
    l.insert(MANAGED_BY_LABEL.into(), MANAGED_BY.into());
    l
}

/// The resolved dtype and backend: the verdict's, else the spec's own values.
pub fn resolved(spec: &InferenceDeploymentSpec, verdict: &Verdict) -> (KvCacheDtype, AttentionBackend) {
    match &verdict.resolved {
        Some(r) => (r.kv_cache_dtype, r.attention_backend),
        None => (spec.engine.kv_cache_dtype, spec.engine.attention_backend),
    }
}

/// `namespace/name` for logs and keys.
pub fn object_key(obj: &impl ResourceExt) -> String {
    format!("{}/{}", obj.namespace().unwrap_or_default(), obj.name_any())
}

// === impl Owner ===

/// The InferenceDeployment as the owner of the objects built here: what their metadata shares.
struct Owner {
    /// Name of the InferenceDeployment (and of most objects it owns).
    name: String,
    namespace: String,
    labels: BTreeMap<String, String>,
    reference: OwnerReference,
}

impl Owner {
    /// Fails on an object that did not come from the API server (no namespace or uid).
    fn of(obj: &InferenceDeployment) -> Result<Owner, DesiredError> {
        let name = obj
            .metadata
            .name
            .clone()
            .ok_or(DesiredError::MissingMetadata("name"))?;
        let namespace = obj
            .metadata
            .namespace
            .clone()
            .ok_or(DesiredError::MissingMetadata("namespace"))?;
        let reference = obj
            .controller_owner_ref(&())
            .ok_or(DesiredError::MissingMetadata("uid"))?;
        Ok(Owner {
            labels: common_labels(&name, obj.spec.engine.runtime),
            name,
            namespace,
            reference,
        })
    }

    /// Metadata of the owned object `object_name`: our namespace, labels and owner reference.
    fn meta(&self, object_name: String) -> ObjectMeta {
        ObjectMeta {
            name: Some(object_name),
            namespace: Some(self.namespace.clone()),
            labels: Some(self.labels.clone()),
            owner_references: Some(vec![self.reference.clone()]),
            ..ObjectMeta::default()
        }
    }
}

// === impl desired ===

/// Replicas the workers' Deployment is applied with. `None` once an autoscaler owns the count
/// (`spec.autoscaling`): the kvfleet autoscaler after its first decision (it applies the
/// scale subresource under its own field manager, so leaving the field out of this apply
/// keeps its value), KEDA's HorizontalPodAutoscaler always. Before that, `spec.replicas`
/// clamped to the autoscaling bounds.
pub fn applied_replicas(obj: &InferenceDeployment) -> Option<i32> {
    let Some(a) = &obj.spec.autoscaling else {
        return Some(obj.spec.replicas);
    };
    let decided = obj
        .status
        .as_ref()
        .and_then(|s| s.autoscaling.as_ref())
        .and_then(|s| s.desired_replicas)
        .is_some();
    match a.engine {
        crate::api::AutoscalingEngine::Keda => None,
        crate::api::AutoscalingEngine::Kvfleet if decided => None,
        crate::api::AutoscalingEngine::Kvfleet => Some(
            obj.spec
                .replicas
                .clamp(a.min_replicas, a.max_replicas.max(a.min_replicas)),
        ),
    }
}

/// The replica count as the autoscaler last set it, else `spec.replicas`.
fn current_replicas(obj: &InferenceDeployment) -> i32 {
    obj.status
        .as_ref()
        .and_then(|s| s.autoscaling.as_ref())
        .and_then(|s| s.desired_replicas)
        .unwrap_or(obj.spec.replicas)
}

/// Builds every object `obj` should own, given an admitting verdict.
pub fn desired(
    obj: &InferenceDeployment,
    verdict: &Verdict,
    settings: &Settings,
    monitor: Option<&MonitorKind>,
) -> Result<Desired, DesiredError> {
    let owner = Owner::of(obj)?;
    // Routed workers publish KV events whatever engine.kvEvents says.
    let spec = &*router::routed_spec(&obj.spec);
    let runtime = spec.engine.runtime;
    let mode = spec.routing_mode();

    let (config_map, config_hash) = match runtime {
        Runtime::Kvfleet => {
            let (cm, hash) = config_map::worker_config_map(&owner, spec, verdict)?;
            (Some(cm), Some(hash))
        }
        Runtime::Vllm => (None, None),
    };
    let router =
        (mode == RoutingMode::Kvfleet).then(|| router::router(&owner, spec, settings, config_hash.clone()));
    let template = pod::pod_template(&owner, spec, verdict, settings, config_hash);
    let replicas = applied_replicas(obj);
    let (deployment, leader_worker_set) = match verdict.multi_node.filter(|_| runtime == Runtime::Vllm) {
        None => (
            Some(deployment::deployment(&owner, spec, replicas, template)),
            None,
        ),
        Some(layout) => (
            None,
            Some(leader_worker_set::leader_worker_set(
                &owner, spec, &template, &layout,
            )),
        ),
    };
    let service = service::service(&owner, leader_worker_set.is_some(), router.is_some());
    let inference_pool = match (
        mode,
        spec.routing.as_ref().and_then(|r| r.endpoint_picker.as_ref()),
    ) {
        (RoutingMode::InferencePool, Some(picker)) => Some(inference_pool::inference_pool(
            &owner,
            picker,
            leader_worker_set.is_some(),
        )),
        _ => None,
    };
    let scaled_object = match (
        spec.autoscaling.as_ref(),
        settings.keda_prometheus_address.as_deref(),
    ) {
        (Some(a), Some(prometheus))
            if a.engine == crate::api::AutoscalingEngine::Keda && deployment.is_some() =>
        {
            Some(scaled_object::scaled_object(&owner, a, prometheus))
        }
        _ => None,
    };

    Ok(Desired {
        config_map,
        // Both runtimes annotate their own pod with the measured capacity: the kvfleet worker
        // itself, vLLM through the capacity sidecar.
        service_account: Some(rbac::worker_service_account(&owner)),
        role_binding: Some(rbac::worker_role_binding(&owner)),
        deployment,
        leader_worker_set,
        service,
        pdb: pod_disruption_budget::pod_disruption_budget(
            &owner,
            replicas.unwrap_or_else(|| current_replicas(obj)),
        ),
        monitor: monitor.map(|m| monitor::monitor(&owner, m)),
        network_policy: match &spec.network {
            Some(net) => {
                let kv_events = spec.engine.kv_events.as_ref().is_some_and(|k| k.enabled);
                // Behind the router, the workers admit the router; the spec's peers reach the router.
                let behind_router = router::workers_network(&owner.name);
                let net = if router.is_some() { &behind_router } else { net };
                Some(network_policy::network_policy(&owner, net, settings, kv_events))
            }
            None => router
                .is_some()
                .then(|| network_policy::kv_events_from_router(&owner, router::router_peer(&owner.name))),
        },
        router,
        inference_pool,
        scaled_object,
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::fixtures::*;
    use super::*;

    #[test]
    fn every_object_is_owned_by_the_inference_deployment_and_selected_by_its_label() {
        let obj = fixture(KVFLEET_RTX3090_TP2);
        let v = verdict("bfloat16", "KVFLEET_CUDA", "8.6", "NVIDIA-GeForce-RTX-3090");
        let m = service_monitor();
        let d = desired(&obj, &v, &Settings::default(), Some(&m)).unwrap();
        let metas = [
            &d.config_map.as_ref().unwrap().metadata,
            &d.deployment.as_ref().unwrap().metadata,
            &d.service.metadata,
            &d.pdb.as_ref().unwrap().metadata,
            &d.monitor.as_ref().unwrap().metadata,
        ];
        for meta in metas {
            let owners = meta.owner_references.clone().unwrap();
            assert_eq!(owners.len(), 1);
            assert_eq!(owners[0].kind, "InferenceDeployment");
            assert_eq!(owners[0].controller, Some(true));
            assert_eq!(meta.namespace.as_deref(), Some("ml"));
            assert_eq!(meta.labels.as_ref().unwrap()[INSTANCE_LABEL], "llama");
        }
        let mon = serde_json::to_value(d.monitor.unwrap()).unwrap();
        assert_eq!(mon["kind"], "ServiceMonitor");
        assert_eq!(mon["spec"]["endpoints"][0]["port"], "http");
        // The label the rules and dashboards group by comes from the pod's instance label.
        assert_eq!(
            mon["spec"]["endpoints"][0]["relabelings"],
            json!([{"action": "replace",
                    "sourceLabels": ["__meta_kubernetes_pod_label_kvfleet_io_inference_deployment"],
                    "targetLabel": "inferencedeployment"}])
        );
        assert_eq!(mon["spec"]["selector"]["matchLabels"][INSTANCE_LABEL], "llama");
        assert_eq!(
            d.service.spec.unwrap().selector.unwrap(),
            selector_labels("llama")
        );
    }

    #[test]
    fn an_object_without_uid_cannot_own_anything() {
        let mut obj = fixture(VLLM_RTX5090);
        obj.metadata.uid = None;
        let err = desired(&obj, &Verdict::default(), &Settings::default(), None).unwrap_err();
        assert!(err.to_string().contains("uid"), "{err}");
    }
}
