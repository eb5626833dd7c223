//! Routing mode `kvfleet`: the router (`kvfleet router`) in front of the workers. Its
//! Deployment and PodDisruptionBudget, its identity (a ServiceAccount and a Role to read the
//! workers' EndpointSlices and pods), the headless Service `<name>-workers` whose
//! EndpointSlices list the workers, and its NetworkPolicy when the spec sets `network`.
//!
//! The router pods never carry the workers' instance label: the workers' Deployment, PDB,
//! NetworkPolicy, Services and the scale selector (`status.selector`) select by it.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    Container, ContainerPort, PodSpec, PodTemplateSpec, ResourceRequirements, Service, ServiceAccount,
    ServicePort, ServiceSpec, TopologySpreadConstraint,
};
use k8s_openapi::api::networking::v1::{NetworkPolicy, NetworkPolicyPeer};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::container::{field_env, http_probe, plain_env, pre_stop_sleep, restricted_container, secret_env};
use super::network_policy::{ingress_policy, KV_EVENTS_PORT_NAME};
use super::pod::{pod_security_context, volumes};
use super::worker::config_path;
use super::{
    router_name, selector_labels, workers_service_name, Owner, Settings, APP_INSTANCE_LABEL, HTTP_PORT,
    MANAGED_BY, MANAGED_BY_LABEL,
};
use crate::api::{InferenceDeploymentSpec, KvEventsSpec, NetworkSpec, RouterSpec, RoutingMode};

/// Label selecting the router pods of an InferenceDeployment (its value: the name).
pub const ROUTER_LABEL: &str = "kvfleet.io/router";
/// Name of the router container.
pub const ROUTER_CONTAINER: &str = "router";
/// Port of the KV-event publisher when the spec names none (vLLM's default endpoint).
const DEFAULT_KV_EVENTS_PORT: i32 = 5557;
/// Readiness (200 once the router knows a ready worker) and liveness paths of the router.
const ROUTER_READY_PATH: &str = "/health";
const ROUTER_LIVE_PATH: &str = "/livez";

/// Everything routing mode `kvfleet` adds.
#[derive(Clone, Debug, PartialEq)]
pub struct Router {
    pub service_account: ServiceAccount,
    /// get, list, watch on EndpointSlices and pods of the namespace.
    pub role: Role,
    pub role_binding: RoleBinding,
    pub deployment: Deployment,
    pub pdb: PodDisruptionBudget,
    /// Headless, selecting the workers: its EndpointSlices are the router's worker list.
    pub workers_service: Service,
    /// Only when the spec sets `network`: the router admits what the workers admitted before.
    pub network_policy: Option<NetworkPolicy>,
}

/// The spec the workers run under `routing`: modes kvfleet and inferencePool need the KV
/// events (the router and llm-d's endpoint picker subscribe to them), on even where
/// `engine.kvEvents` does not ask (port 5557 unless it names another).
pub fn routed_spec(spec: &InferenceDeploymentSpec) -> std::borrow::Cow<'_, InferenceDeploymentSpec> {
    if spec.routing_mode() == RoutingMode::Service
        || spec.engine.kv_events.as_ref().is_some_and(|k| k.enabled)
    {
        return std::borrow::Cow::Borrowed(spec);
    }
    let mut s = spec.clone();
    let (port, topic) = s
        .engine
        .kv_events
        .as_ref()
        .map(|k| (k.port, k.topic.clone()))
        .unwrap_or((DEFAULT_KV_EVENTS_PORT, String::new()));
    s.engine.kv_events = Some(KvEventsSpec {
        enabled: true,
        port,
        topic,
    });
    std::borrow::Cow::Owned(s)
}

/// The port the workers publish KV events on (`routed_spec` turned them on).
fn kv_events_port(spec: &InferenceDeploymentSpec) -> i32 {
    spec.engine
        .kv_events
        .as_ref()
        .map_or(DEFAULT_KV_EVENTS_PORT, |k| k.port)
}

/// Labels of the router pods (and their selector's one label, [`ROUTER_LABEL`]).
pub fn router_selector_labels(name: &str) -> BTreeMap<String, String> {
    BTreeMap::from([(ROUTER_LABEL.to_string(), name.to_string())])
}

fn router_pod_labels(name: &str) -> BTreeMap<String, String> {
    let mut l = router_selector_labels(name);
    l.insert("app.kubernetes.io/name".into(), "kvfleet-router".into());
    l.insert(APP_INSTANCE_LABEL.into(), name.into());
    l.insert("app.kubernetes.io/component".into(), "router".into());
    l.insert(MANAGED_BY_LABEL.into(), MANAGED_BY.into());
    l
}

/// The peer of the router pods, as a worker NetworkPolicy admits them.
pub(super) fn router_peer(name: &str) -> NetworkPolicyPeer {
    NetworkPolicyPeer {
        pod_selector: Some(LabelSelector {
            match_labels: Some(router_selector_labels(name)),
            ..LabelSelector::default()
        }),
        ..NetworkPolicyPeer::default()
    }
}

/// The workers admit only the router (on `http` and `kv-events`) besides the metrics peers.
pub(super) fn workers_network(name: &str) -> NetworkSpec {
    NetworkSpec {
        allow_from: vec![router_peer(name)],
    }
}

/// `spec` is the routed spec ([`routed_spec`]); `config_hash` that of the workers' ConfigMap,
/// which the router reads too (a new model rolls the router).
pub(super) fn router(
    owner: &Owner,
    spec: &InferenceDeploymentSpec,
    settings: &Settings,
    config_hash: Option<String>,
) -> Router {
    let r = spec
        .routing
        .as_ref()
        .and_then(|r| r.router.clone())
        .unwrap_or_default();
    let name = router_name(&owner.name);
    Router {
        service_account: ServiceAccount {
            metadata: owner.meta(name.clone()),
            automount_service_account_token: Some(true),
            ..ServiceAccount::default()
        },
        role: Role {
            metadata: owner.meta(name.clone()),
            rules: Some(vec![
                read_rule("discovery.k8s.io", "endpointslices"),
                read_rule("", "pods"),
            ]),
        },
        role_binding: RoleBinding {
            metadata: owner.meta(name.clone()),
            role_ref: RoleRef {
                api_group: "rbac.authorization.k8s.io".into(),
                kind: "Role".into(),
                name: name.clone(),
            },
            subjects: Some(vec![Subject {
                kind: "ServiceAccount".into(),
                name: name.clone(),
                namespace: Some(owner.namespace.clone()),
                ..Subject::default()
            }]),
        },
        deployment: deployment(owner, spec, settings, &r, config_hash),
        pdb: PodDisruptionBudget {
            metadata: owner.meta(name.clone()),
            spec: Some(PodDisruptionBudgetSpec {
                max_unavailable: Some(IntOrString::Int(1)),
                selector: Some(LabelSelector {
                    match_labels: Some(router_selector_labels(&owner.name)),
                    ..LabelSelector::default()
                }),
                ..PodDisruptionBudgetSpec::default()
            }),
            ..PodDisruptionBudget::default()
        },
        workers_service: workers_service(owner, spec),
        network_policy: spec.network.as_ref().map(|net| NetworkPolicy {
            metadata: owner.meta(name.clone()),
            spec: Some(ingress_policy(
                router_selector_labels(&owner.name),
                &net.allow_from,
                &settings.worker_metrics_from,
            )),
        }),
    }
}

fn read_rule(group: &str, resource: &str) -> PolicyRule {
    PolicyRule {
        api_groups: Some(vec![group.into()]),
        resources: Some(vec![resource.into()]),
        verbs: vec!["get".into(), "list".into(), "watch".into()],
        ..PolicyRule::default()
    }
}

/// `<name>-workers`: headless (the router talks to each worker, never to a virtual IP),
/// with the ports the router reads by name from its EndpointSlices.
fn workers_service(owner: &Owner, spec: &InferenceDeploymentSpec) -> Service {
    let port = |name: &str, number: i32| ServicePort {
        name: Some(name.into()),
        port: number,
        target_port: Some(IntOrString::String(name.into())),
        protocol: Some("TCP".into()),
        ..ServicePort::default()
    };
    Service {
        metadata: owner.meta(workers_service_name(&owner.name)),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            selector: Some(selector_labels(&owner.name)),
            ports: Some(vec![
                port("http", HTTP_PORT),
                port(KV_EVENTS_PORT_NAME, kv_events_port(spec)),
            ]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}

fn deployment(
    owner: &Owner,
    spec: &InferenceDeploymentSpec,
    settings: &Settings,
    r: &RouterSpec,
    config_hash: Option<String>,
) -> Deployment {
    // The router reads the worker config and the tokenizer on the weights volume at the
    // worker's own mount paths; it needs no /dev/shm.
    let (vols, mounts): (Vec<_>, Vec<_>) = volumes(&owner.name, spec)
        .into_iter()
        .filter(|(v, _)| v.name != "dshm")
        .unzip();
    let mut env = vec![
        field_env("POD_NAME", "metadata.name"),
        field_env("POD_NAMESPACE", "metadata.namespace"),
        plain_env("HOME", "/tmp"),
    ];
    if let Some(key) = &spec.api_key {
        env.push(secret_env("KVFLEET_API_KEY", &key.secret_name, &key.key));
    }
    let container = Container {
        name: ROUTER_CONTAINER.into(),
        image: Some(
            spec.engine
                .image
                .clone()
                .unwrap_or_else(|| settings.worker_image.clone()),
        ),
        command: Some(vec!["kvfleet".into()]),
        args: Some(router_args(&owner.name)),
        ports: Some(vec![ContainerPort {
            name: Some("http".into()),
            container_port: HTTP_PORT,
            protocol: Some("TCP".into()),
            ..ContainerPort::default()
        }]),
        env: Some(env),
        resources: Some(r.resources.clone().unwrap_or_else(default_resources)),
        volume_mounts: Some(mounts),
        readiness_probe: Some(http_probe(ROUTER_READY_PATH, 5, 3)),
        liveness_probe: Some(http_probe(ROUTER_LIVE_PATH, 10, 3)),
        // Loading the tokenizer from the weights volume before it listens.
        startup_probe: Some(http_probe(ROUTER_LIVE_PATH, 5, 60)),
        lifecycle: Some(pre_stop_sleep()),
        security_context: Some(restricted_container()),
        ..Container::default()
    };
    let mut annotations = BTreeMap::new();
    if let Some(h) = config_hash {
        annotations.insert(super::CONFIG_HASH_ANNOTATION.to_string(), h);
    }
    let labels = router_pod_labels(&owner.name);
    Deployment {
        metadata: owner.meta(router_name(&owner.name)),
        spec: Some(DeploymentSpec {
            replicas: Some(r.replicas),
            selector: LabelSelector {
                match_labels: Some(router_selector_labels(&owner.name)),
                ..LabelSelector::default()
            },
            // Never dark: a new router pod is ready before an old one goes.
            strategy: Some(super::rollout(1)),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels),
                    annotations: (!annotations.is_empty()).then_some(annotations),
                    ..ObjectMeta::default()
                }),
                spec: Some(PodSpec {
                    containers: vec![container],
                    service_account_name: Some(router_name(&owner.name)),
                    automount_service_account_token: Some(true),
                    volumes: Some(vols),
                    security_context: Some(pod_security_context()),
                    // Router pods on different nodes where the cluster allows.
                    topology_spread_constraints: Some(vec![TopologySpreadConstraint {
                        max_skew: 1,
                        topology_key: "kubernetes.io/hostname".into(),
                        when_unsatisfiable: "ScheduleAnyway".into(),
                        label_selector: Some(LabelSelector {
                            match_labels: Some(router_selector_labels(&owner.name)),
                            ..LabelSelector::default()
                        }),
                        ..TopologySpreadConstraint::default()
                    }]),
                    ..PodSpec::default()
                }),
            },
            ..DeploymentSpec::default()
        }),
        ..Deployment::default()
    }
}

/// `kvfleet router` arguments (its contract: docs/routing.md).
pub fn router_args(name: &str) -> Vec<String> {
    [
        "router",
        "--listen",
        &format!("0.0.0.0:{HTTP_PORT}"),
        "--config",
        &config_path(),
        "--workers-service",
        &workers_service_name(name),
        "--namespace",
        "$(POD_NAMESPACE)",
    ]
    .into_iter()
    .map(String::from)
    .collect()
}

/// Requests only: the router tokenizes and forwards, and a limit would only risk an OOM kill
/// on a large tokenizer.
fn default_resources() -> ResourceRequirements {
    ResourceRequirements {
        requests: Some(BTreeMap::from([
            ("cpu".to_string(), Quantity("100m".into())),
            ("memory".to_string(), Quantity("256Mi".into())),
        ])),
        ..ResourceRequirements::default()
    }
}
