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
/// Readiness (200 while the router runs, ready workers or not: at zero replicas it holds requests
/// and must stay in the Service, see docs/routing.md) and liveness paths of the router.
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
        args: Some(router_args(&owner.name, r)),
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

/// `kvfleet router` arguments (its contract: docs/routing.md); the score's settings only
/// where the spec sets them, so the router's defaults stay the defaults.
pub fn router_args(name: &str, r: &RouterSpec) -> Vec<String> {
    let mut args: Vec<String> = [
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
    .collect();
    if let Some(score) = &r.score {
        let mut flag = |name: &str, value: Option<String>| {
            if let Some(v) = value {
                args.extend([format!("--{name}"), v]);
            }
        };
        flag("prefix-weight", score.prefix_weight.map(|v| v.to_string()));
        flag("load-weight", score.load_weight.map(|v| v.to_string()));
        flag(
            "imbalance-requests",
            score.imbalance_requests.map(|v| v.to_string()),
        );
        flag("imbalance-ratio", score.imbalance_ratio.map(|v| v.to_string()));
    }
    args
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

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::Container;
    use serde_json::json;

    use super::super::fixtures::*;
    use super::super::{desired, Desired, INSTANCE_LABEL};
    use super::*;
    use crate::contract::config::WorkerConfig;

    /// A kvfleet deployment of Llama 3.1 8B on a PVC, two workers.
    const ROUTED: &str = llama_8b!(
        r#"
    weights: {format: safetensors, pvcName: llama-weights, path: llama-3.1-8b/}
    weightBytes: 16Gi
  replicas: 2
  engine: {runtime: kvfleet}
  gpu: {selector: {products: [NVIDIA-H100-80GB-HBM3]}}
  routing: {mode: kvfleet}
"#
    );

    fn h100() -> crate::validate::Verdict {
        verdict("fp8_e4m3", "KVFLEET_CUDA", "9.0", "NVIDIA-H100-80GB-HBM3")
    }

    fn routed(yaml: &str) -> Desired {
        desired(&fixture(yaml), &h100(), &Settings::default(), None).unwrap()
    }

    fn router_of(d: &Desired) -> &Router {
        d.router.as_ref().expect("routing mode kvfleet renders a router")
    }

    fn router_template(d: &Desired) -> &PodTemplateSpec {
        &router_of(d).deployment.spec.as_ref().unwrap().template
    }

    fn router_container(d: &Desired) -> Container {
        router_pod(d).containers[0].clone()
    }

    fn router_pod(d: &Desired) -> PodSpec {
        router_template(d).spec.clone().unwrap()
    }

    /// The router pods' labels and annotations.
    fn router_pod_meta(d: &Desired) -> &ObjectMeta {
        router_template(d).metadata.as_ref().unwrap()
    }

    #[test]
    fn mode_kvfleet_renders_a_router_of_two_replicas_in_the_workers_image_with_its_own_identity() {
        let d = routed(ROUTED);
        let r = router_of(&d);
        for name in [
            r.deployment.metadata.name.as_deref(),
            r.pdb.metadata.name.as_deref(),
            r.service_account.metadata.name.as_deref(),
            r.role.metadata.name.as_deref(),
            r.role_binding.metadata.name.as_deref(),
        ] {
            assert_eq!(name, Some("llama-router"));
        }
        let spec = r.deployment.spec.as_ref().unwrap();
        assert_eq!(spec.replicas, Some(2), "the default");
        assert_eq!(
            spec.selector.match_labels.as_ref().unwrap(),
            &router_selector_labels("llama")
        );
        let c = router_container(&d);
        assert_eq!(c.image, container(&d).image, "the workers' kvfleet image");
        assert_eq!(c.command, Some(vec!["kvfleet".to_string()]));
        assert_eq!(
            c.args.clone().unwrap(),
            [
                "router",
                "--listen",
                "0.0.0.0:8000",
                "--config",
                "/etc/kvfleet/worker.yaml",
                "--workers-service",
                "llama-workers",
                "--namespace",
                "$(POD_NAMESPACE)"
            ]
        );
        let ns = c
            .env
            .iter()
            .flatten()
            .find(|e| e.name == "POD_NAMESPACE")
            .unwrap();
        assert_eq!(
            ns.value_from
                .as_ref()
                .unwrap()
                .field_ref
                .as_ref()
                .unwrap()
                .field_path,
            "metadata.namespace"
        );
        let p = router_pod(&d);
        assert_eq!(p.service_account_name.as_deref(), Some("llama-router"));
        // The Role: read EndpointSlices and pods, nothing else.
        let rules = serde_json::to_value(r.role.rules.as_ref().unwrap()).unwrap();
        assert_eq!(
            rules,
            json!([{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
                   {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}])
        );
        assert_eq!(
            (
                r.role_binding.role_ref.kind.as_str(),
                r.role_binding.role_ref.name.as_str()
            ),
            ("Role", "llama-router")
        );
        let subject = &r.role_binding.subjects.as_ref().unwrap()[0];
        assert_eq!(
            (subject.name.as_str(), subject.namespace.as_deref()),
            ("llama-router", Some("ml"))
        );
        let pdb = r.pdb.spec.as_ref().unwrap();
        assert_eq!(pdb.max_unavailable, Some(IntOrString::Int(1)));
        assert_eq!(
            pdb.selector.as_ref().unwrap().match_labels.as_ref().unwrap(),
            &router_selector_labels("llama")
        );
        // Replicas and resources from the spec.
        let tuned = ROUTED.replace(
            "routing: {mode: kvfleet}",
            "routing: {mode: kvfleet, router: {replicas: 3, resources: {limits: {memory: 1Gi}}}}",
        );
        let d = routed(&tuned);
        assert_eq!(router_of(&d).deployment.spec.as_ref().unwrap().replicas, Some(3));
        let res = router_container(&d).resources.unwrap();
        assert_eq!(res.limits.unwrap()["memory"], Quantity("1Gi".into()));
        // The score's settings become flags, only those set.
        let scored = ROUTED.replace(
            "routing: {mode: kvfleet}",
            "routing: {mode: kvfleet, router: {score: {loadWeight: 2.5, imbalanceRequests: 8}}}",
        );
        let args = router_container(&routed(&scored)).args.unwrap();
        assert_eq!(
            args[args.len() - 4..],
            ["--load-weight", "2.5", "--imbalance-requests", "8"]
        );
        assert!(!args.iter().any(|a| a == "--prefix-weight"));
    }

    #[test]
    fn the_router_runs_restricted_without_a_gpu_and_probes_health_and_livez() {
        let d = routed(ROUTED);
        let c = router_container(&d);
        let sc = c.security_context.clone().unwrap();
        assert_eq!(sc.run_as_non_root, Some(true));
        assert_eq!(sc.read_only_root_filesystem, Some(true));
        assert_eq!(sc.allow_privilege_escalation, Some(false));
        assert_eq!(sc.capabilities.unwrap().drop, Some(vec!["ALL".to_string()]));
        let p = router_pod(&d);
        let psc = p.security_context.clone().unwrap();
        assert_eq!(psc.run_as_non_root, Some(true));
        assert_eq!(psc.seccomp_profile.unwrap().type_, "RuntimeDefault");
        let res = c.resources.clone().unwrap();
        assert!(
            !serde_json::to_string(&res).unwrap().contains("nvidia.com/gpu"),
            "{res:?}"
        );
        assert!(res.requests.is_some(), "default requests");
        assert_eq!(p.affinity, None, "no GPU affinity");
        assert_eq!(p.tolerations, None, "no GPU toleration");
        assert_eq!(p.node_selector, None);
        let path = |probe: Option<k8s_openapi::api::core::v1::Probe>| {
            let g = probe.unwrap().http_get.unwrap();
            (g.path.unwrap(), g.port)
        };
        let http = IntOrString::String("http".into());
        assert_eq!(path(c.readiness_probe.clone()), ("/health".into(), http.clone()));
        assert_eq!(path(c.liveness_probe.clone()), ("/livez".into(), http.clone()));
        assert_eq!(path(c.startup_probe.clone()), ("/livez".into(), http));
        let ports = c.ports.unwrap();
        assert_eq!(
            (ports[0].name.as_deref(), ports[0].container_port),
            (Some("http"), HTTP_PORT)
        );
        // The router's pods are not the workers': nothing that selects workers selects them.
        let labels = router_pod_meta(&d).labels.clone().unwrap();
        assert!(!labels.contains_key(INSTANCE_LABEL), "{labels:?}");
        assert_eq!(labels[ROUTER_LABEL], "llama");
    }

    #[test]
    fn the_router_mounts_the_worker_config_and_the_weights_read_only_where_the_worker_does() {
        let d = routed(ROUTED);
        let worker = container(&d).volume_mounts.unwrap();
        let router = router_container(&d).volume_mounts.unwrap();
        for path in ["/etc/kvfleet", "/models"] {
            let w = worker.iter().find(|m| m.mount_path == path).expect(path);
            let r = router.iter().find(|m| m.mount_path == path).expect(path);
            assert_eq!(r, w, "{path}");
            assert_eq!(r.read_only, Some(true), "{path}");
        }
        assert!(router.iter().any(|m| m.mount_path == "/tmp"), "writable /tmp");
        assert!(!router.iter().any(|m| m.mount_path == "/dev/shm"));
        let vols = router_pod(&d).volumes.unwrap();
        let weights = vols.iter().find(|v| v.name == "weights").unwrap();
        assert_eq!(
            weights.persistent_volume_claim.as_ref().unwrap().claim_name,
            "llama-weights"
        );
        let config = vols.iter().find(|v| v.name == "config").unwrap();
        assert_eq!(config.config_map.as_ref().unwrap().name, "llama-config");
        // A new worker config (another model) rolls the router too.
        let hash = |d: &Desired| {
            router_pod_meta(d).annotations.clone().unwrap()[super::super::CONFIG_HASH_ANNOTATION].clone()
        };
        let other = routed(&ROUTED.replace("llama-3.1-8b/", "llama-3.1-8b-v2/"));
        assert_ne!(hash(&d), hash(&other));
        assert_eq!(
            hash(&d),
            template(&d)
                .metadata
                .as_ref()
                .unwrap()
                .annotations
                .as_ref()
                .unwrap()[super::super::CONFIG_HASH_ANNOTATION]
        );
    }

    #[test]
    fn an_api_key_reaches_the_router_from_the_workers_secret() {
        let d = routed(&format!("{ROUTED}  apiKey: {{secretName: llm-key}}\n"));
        let env = router_container(&d).env.unwrap();
        let key = env.iter().find(|e| e.name == "KVFLEET_API_KEY").expect("the key");
        assert!(key.value.is_none());
        let r = key.value_from.as_ref().unwrap().secret_key_ref.as_ref().unwrap();
        assert_eq!((r.name.as_str(), r.key.as_str()), ("llm-key", "api-key"));
    }

    #[test]
    fn the_service_selects_the_router_and_a_headless_service_lists_the_workers_http_and_kv_events() {
        let d = routed(ROUTED);
        let svc = d.service.spec.as_ref().unwrap();
        assert_eq!(svc.selector.as_ref().unwrap(), &router_selector_labels("llama"));
        assert_eq!(d.service.metadata.name.as_deref(), Some("llama"));
        let w = &router_of(&d).workers_service;
        assert_eq!(w.metadata.name.as_deref(), Some("llama-workers"));
        let spec = serde_json::to_value(w.spec.as_ref().unwrap()).unwrap();
        assert_eq!(
            spec,
            json!({"clusterIP": "None", "selector": {INSTANCE_LABEL: "llama"},
                   "ports": [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"},
                             {"name": "kv-events", "port": 5557, "targetPort": "kv-events", "protocol": "TCP"}]})
        );
        // The workers publish KV events on that port though the spec did not ask.
        let ports = container(&d).ports.unwrap();
        assert!(ports
            .iter()
            .any(|p| p.name.as_deref() == Some("kv-events") && p.container_port == 5557));
        let yaml = &d.config_map.as_ref().unwrap().data.as_ref().unwrap()[super::super::WORKER_CONFIG_KEY];
        let cfg = WorkerConfig::parse(yaml).unwrap();
        assert_eq!(cfg.kv_events(), Some(("tcp://*:5557".to_string(), String::new())));
        // A port the spec names is kept, even where the spec turned the events off.
        let own = ROUTED.replace(
            "engine: {runtime: kvfleet}",
            "engine: {runtime: kvfleet, kvEvents: {enabled: false, port: 5600, topic: kv}}",
        );
        let d = routed(&own);
        let ports = router_of(&d).workers_service.spec.clone().unwrap().ports.unwrap();
        assert_eq!(ports[1].port, 5600);
        let yaml = &d.config_map.as_ref().unwrap().data.as_ref().unwrap()[super::super::WORKER_CONFIG_KEY];
        assert_eq!(
            WorkerConfig::parse(yaml).unwrap().kv_events(),
            Some(("tcp://*:5600".to_string(), "kv".to_string()))
        );
    }

    #[test]
    fn behind_the_router_the_workers_admit_the_router_and_the_router_admits_the_specs_peers() {
        let with_net = format!(
            "{ROUTED}  network: {{allowFrom: [{{podSelector: {{matchLabels: {{app: gateway}}}}}}]}}\n"
        );
        let settings = Settings {
            worker_metrics_from: serde_json::from_value(
                json!([{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]),
            )
            .unwrap(),
            ..Settings::default()
        };
        let d = desired(&fixture(&with_net), &h100(), &settings, None).unwrap();
        let worker = serde_json::to_value(d.network_policy.as_ref().unwrap().spec.as_ref().unwrap()).unwrap();
        let http = json!({"port": "http", "protocol": "TCP"});
        let kv = json!({"port": "kv-events", "protocol": "TCP"});
        let metrics = json!([{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]);
        assert_eq!(
            worker["podSelector"],
            json!({"matchLabels": {INSTANCE_LABEL: "llama"}})
        );
        assert_eq!(
            worker["ingress"],
            json!([{"from": [{"podSelector": {"matchLabels": {ROUTER_LABEL: "llama"}}}], "ports": [http, kv]},
                   {"from": metrics, "ports": [http]}])
        );
        let r = router_of(&d)
            .network_policy
            .as_ref()
            .expect("the router's policy");
        assert_eq!(r.metadata.name.as_deref(), Some("llama-router"));
        let router = serde_json::to_value(r.spec.as_ref().unwrap()).unwrap();
        assert_eq!(
            router["podSelector"],
            json!({"matchLabels": {ROUTER_LABEL: "llama"}})
        );
        assert_eq!(
            router["ingress"],
            json!([{"from": [{"podSelector": {"matchLabels": {"app": "gateway"}}}], "ports": [http]},
                   {"from": metrics, "ports": [http]}])
        );
        // Without `network`: the workers' `kv-events` port admits only the router (issue 62),
        // their serving port every source; the router has no policy.
        let d = routed(ROUTED);
        let worker = serde_json::to_value(d.network_policy.as_ref().unwrap().spec.as_ref().unwrap()).unwrap();
        assert_eq!(
            worker["ingress"],
            json!([{"ports": [http]},
                   {"from": [{"podSelector": {"matchLabels": {ROUTER_LABEL: "llama"}}}], "ports": [kv]}])
        );
        assert!(router_of(&d).network_policy.is_none());
    }

    /// Every spec the builders' tests and deploy/examples render.
    fn existing_fixtures() -> Vec<String> {
        let mut all = vec![KVFLEET_RTX3090_TP2.to_string(), VLLM_RTX5090.to_string()];
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/examples");
        for e in std::fs::read_dir(dir).unwrap() {
            let path = e.unwrap().path();
            if path.extension().is_some_and(|x| x == "yaml") {
                all.push(std::fs::read_to_string(path).unwrap());
            }
        }
        assert!(all.len() > 5);
        all
    }

    #[test]
    fn mode_service_and_no_routing_render_byte_identical_objects_for_every_existing_fixture() {
        for yaml in existing_fixtures() {
            let plain = fixture(&yaml);
            assert_eq!(plain.spec.routing, None);
            let mut service = plain.clone();
            service.spec.routing = Some(crate::api::RoutingSpec::default());
            let v = h100();
            let a = desired(&plain, &v, &Settings::default(), None).unwrap();
            let b = desired(&service, &v, &Settings::default(), None).unwrap();
            assert_eq!(format!("{a:?}"), format!("{b:?}"));
            assert!(a.router.is_none() && a.inference_pool.is_none());
            // Nothing routed: the workers publish KV events only where the spec asks.
            assert_eq!(
                a.deployment.as_ref().map(|_| container(&a).ports.unwrap().len()),
                a.deployment
                    .as_ref()
                    .map(|_| 1 + usize::from(plain.spec.engine.kv_events.is_some())),
            );
        }
    }
}
