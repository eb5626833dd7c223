//! InferenceDeployment + verdict -> the objects that run it (pure: no client, no I/O).
//!
//! Every function here is deterministic in its inputs so the reconcile loop can
//! server-side apply the result on every pass and the API server sees no change when
//! nothing changed.

use std::collections::BTreeMap;
use std::path::PathBuf;

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment};
use k8s_openapi::api::core::v1::{
    Affinity, Capabilities, ConfigMap, ConfigMapVolumeSource, Container, ContainerPort, EmptyDirVolumeSource,
    EnvVar, EnvVarSource, HTTPGetAction, HostPathVolumeSource, ImageVolumeSource, KeyToPath, Lifecycle,
    LifecycleHandler, ObjectFieldSelector, PersistentVolumeClaimVolumeSource, PodSecurityContext, PodSpec,
    PodTemplateSpec, Probe, ResourceRequirements, SeccompProfile, SecretKeySelector, SecurityContext,
    Service, ServiceAccount, ServicePort, ServiceSpec, SleepAction, Toleration, Volume, VolumeMount,
};
use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort, NetworkPolicySpec,
};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::api::rbac::v1::{RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{ApiResource, DynamicObject};
use kube::{Resource, ResourceExt};
use serde_json::json;

use crate::api::{
    AttentionBackend, InferenceDeployment, InferenceDeploymentSpec, KvCacheDtype, Runtime, WeightsFormat,
};
use crate::compat::vllm_versions::{self, VllmVersion};
use crate::model::serve::{ModelSource, Weights};
use crate::plan::memory::parse_quantity_bytes;
use crate::validate::{labels as gfd, Verdict};
use crate::worker::config::{ResolvedEngine, WorkerConfig};

/// Label that selects the pods of one InferenceDeployment (the scale selector).
pub const INSTANCE_LABEL: &str = "kvfleet.io/inference-deployment";
/// Pod annotation the kvfleet worker writes with its measured KV capacity in tokens.
pub const MEASURED_TOKENS_ANNOTATION: &str = "kvfleet.io/measured-kv-tokens";
/// Pod-template annotation holding a hash of the worker config, so a config change rolls the pods.
pub const CONFIG_HASH_ANNOTATION: &str = "kvfleet.io/config-hash";
/// Key of the worker configuration in the ConfigMap.
pub const WORKER_CONFIG_KEY: &str = "worker.yaml";
/// ClusterRole (shipped in deploy/rbac) that lets a worker annotate its own pod.
pub const WORKER_CLUSTER_ROLE: &str = "kvfleet-worker";
/// Port of the serving container (kvfleet worker and vLLM both default to 8000).
pub const HTTP_PORT: i32 = 8000;
/// Non-root UID/GID the pods run as.
pub const RUN_AS_USER: i64 = 65532;

const CONFIG_DIR: &str = "/etc/kvfleet";
const MODEL_CONFIG_DIR: &str = "/etc/kvfleet/model";
const WEIGHTS_DIR: &str = "/models";
/// Where a Hugging Face download cache PVC is mounted (`HF_HOME`).
pub const HF_CACHE_DIR: &str = "/cache/huggingface";

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
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            // What `make image` tags and the chart's image.repository/appVersion default to.
            worker_image: format!("kvfleet:{}", env!("CARGO_PKG_VERSION")),
            // A release whose every flag kvfleet renders exists (compat/vllm_versions.rs).
            vllm_image: crate::compat::vllm_versions::default_image(),
            worker_metrics_from: Vec::new(),
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
}

/// The target label the recording rules and dashboards group worker series by.
pub const MONITOR_TARGET_LABEL: &str = "inferencedeployment";

/// Relabelings (Prometheus Operator spelling) of the worker ServiceMonitor / PodMonitor:
/// the pod label [`INSTANCE_LABEL`] becomes the target label `inferencedeployment`
/// (`namespace` and `pod` the operator adds itself).
pub fn monitor_relabelings() -> serde_json::Value {
    // Prometheus' service discovery spells a pod label as
    // __meta_kubernetes_pod_label_<name with every invalid character as _>.
    let meta: String = INSTANCE_LABEL
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    json!([{
        "action": "replace",
        "sourceLabels": [format!("__meta_kubernetes_pod_label_{meta}")],
        "targetLabel": MONITOR_TARGET_LABEL,
    }])
}

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

/// Labels selecting the pods of `name` (immutable once a Deployment exists).
pub fn selector_labels(name: &str) -> BTreeMap<String, String> {
    BTreeMap::from([(INSTANCE_LABEL.to_string(), name.to_string())])
}

/// The selector as a string, for `status.selector` (scale subresource, HPAs).
pub fn selector_string(name: &str) -> String {
    format!("{INSTANCE_LABEL}={name}")
}

fn common_labels(name: &str, runtime: Runtime) -> BTreeMap<String, String> {
    let mut l = selector_labels(name);
    l.insert("app.kubernetes.io/name".into(), runtime.as_str().into());
    l.insert("app.kubernetes.io/instance".into(), name.into());
    l.insert("app.kubernetes.io/component".into(), "inference".into());
    l.insert("app.kubernetes.io/managed-by".into(), "kvfleet".into());
    l
}

/// The resolved dtype and backend strings: the verdict's, else the spec's own values.
pub fn resolved_strings(spec: &InferenceDeploymentSpec, verdict: &Verdict) -> (String, String) {
    match &verdict.resolved {
        Some(r) => (r.kv_cache_dtype.clone(), r.attention_backend.clone()),
        None => (
            spec.engine.kv_cache_dtype.as_str().to_string(),
            spec.engine.attention_backend.as_str().to_string(),
        ),
    }
}

/// Builds every object `obj` should own, given an admitting verdict.
pub fn desired(
    obj: &InferenceDeployment,
    verdict: &Verdict,
    settings: &Settings,
    monitor: Option<&MonitorKind>,
) -> Result<Desired, DesiredError> {
    let name = obj
        .metadata
        .name
        .clone()
        .ok_or(DesiredError::MissingMetadata("name"))?;
    let ns = obj
        .metadata
        .namespace
        .clone()
        .ok_or(DesiredError::MissingMetadata("namespace"))?;
    let owner = obj
        .controller_owner_ref(&())
        .ok_or(DesiredError::MissingMetadata("uid"))?;
    let spec = &obj.spec;
    let runtime = spec.engine.runtime;
    let labels = common_labels(&name, runtime);
    let meta = |object_name: String| ObjectMeta {
        name: Some(object_name),
        namespace: Some(ns.clone()),
        labels: Some(labels.clone()),
        owner_references: Some(vec![owner.clone()]),
        ..ObjectMeta::default()
    };

    // Both runtimes annotate their own pod with the measured capacity: the kvfleet worker
    // itself, vLLM through the capacity sidecar.
    let (config_map, service_account, role_binding, config_hash) = match runtime {
        Runtime::Kvfleet | Runtime::Vllm => {
            let (cm, hash) = match runtime {
                Runtime::Kvfleet => {
                    let yaml = worker_config_yaml(spec, verdict)?;
                    let hash = format!("{:016x}", fnv1a64(yaml.as_bytes()));
                    let cm = ConfigMap {
                        metadata: meta(config_map_name(&name)),
                        data: Some(BTreeMap::from([(WORKER_CONFIG_KEY.to_string(), yaml)])),
                        ..ConfigMap::default()
                    };
                    (Some(cm), Some(hash))
                }
                Runtime::Vllm => (None, None),
            };
            let sa = ServiceAccount {
                metadata: meta(worker_service_account_name(&name)),
                automount_service_account_token: Some(true),
                ..ServiceAccount::default()
            };
            let rb = RoleBinding {
                metadata: meta(worker_service_account_name(&name)),
                role_ref: RoleRef {
                    api_group: "rbac.authorization.k8s.io".into(),
                    kind: "ClusterRole".into(),
                    name: WORKER_CLUSTER_ROLE.into(),
                },
                subjects: Some(vec![Subject {
                    kind: "ServiceAccount".into(),
                    name: worker_service_account_name(&name),
                    namespace: Some(ns.clone()),
                    ..Subject::default()
                }]),
            };
            (cm, Some(sa), Some(rb), hash)
        }
    };

    let template = pod_template(&name, spec, verdict, settings, &labels, config_hash);
    let (deployment, leader_worker_set) = match verdict.multi_node.filter(|_| runtime == Runtime::Vllm) {
        None => (
            Some(Deployment {
                metadata: meta(name.clone()),
                spec: Some(DeploymentSpec {
                    replicas: Some(spec.replicas),
                    selector: LabelSelector {
                        match_labels: Some(selector_labels(&name)),
                        ..LabelSelector::default()
                    },
                    strategy: Some(rollout(spec.replicas)),
                    template,
                    ..DeploymentSpec::default()
                }),
                ..Deployment::default()
            }),
            None,
        ),
        Some(layout) => {
            let mut lws = DynamicObject::new(&name, &leader_worker_set_resource()).within(&ns);
            lws.metadata = meta(name.clone());
            lws.data = leader_worker_set_spec(spec, &template, &layout);
            (None, Some(lws))
        }
    };
    // Only the leader of a multi-node replica serves the API (workers run --headless).
    let mut service_selector = selector_labels(&name);
    if leader_worker_set.is_some() {
        service_selector.insert(LWS_WORKER_INDEX_LABEL.into(), "0".into());
    }

    let service = Service {
        metadata: meta(name.clone()),
        spec: Some(ServiceSpec {
            selector: Some(service_selector),
            ports: Some(vec![ServicePort {
                name: Some("http".into()),
                port: HTTP_PORT,
                target_port: Some(IntOrString::String("http".into())),
                protocol: Some("TCP".into()),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    };

    let pdb = (spec.replicas > 1).then(|| PodDisruptionBudget {
        metadata: meta(name.clone()),
        spec: Some(PodDisruptionBudgetSpec {
            max_unavailable: Some(IntOrString::Int(1)),
            selector: Some(LabelSelector {
                match_labels: Some(selector_labels(&name)),
                ..LabelSelector::default()
            }),
            ..PodDisruptionBudgetSpec::default()
        }),
        ..PodDisruptionBudget::default()
    });

    let monitor = monitor.map(|m| {
        let mut o = DynamicObject::new(&name, &m.resource).within(&ns);
        o.metadata = meta(name.clone());
        let selector = json!({ "matchLabels": selector_labels(&name) });
        let endpoint = json!({ "port": "http", "path": "/metrics", "relabelings": monitor_relabelings() });
        o.data = if m.kind == "PodMonitor" {
            json!({ "spec": { "selector": selector, "podMetricsEndpoints": [endpoint] } })
        } else {
            json!({ "spec": { "selector": selector, "endpoints": [endpoint] } })
        };
        o
    });

    let network_policy = spec.network.as_ref().map(|net| NetworkPolicy {
        metadata: meta(worker_network_policy_name(&name)),
        spec: Some(worker_network_policy(
            &name,
            &net.allow_from,
            &settings.worker_metrics_from,
        )),
    });

    Ok(Desired {
        config_map,
        service_account,
        role_binding,
        deployment,
        leader_worker_set,
        service,
        pdb,
        monitor,
        network_policy,
    })
}

// === impl multi-node ===

/// API group, version and kind of the LeaderWorkerSet (kubernetes-sigs/lws).
pub const LWS_GROUP: &str = "leaderworkerset.x-k8s.io";
pub const LWS_VERSION: &str = "v1";
pub const LWS_KIND: &str = "LeaderWorkerSet";
pub const LWS_PLURAL: &str = "leaderworkersets";
/// Label LWS puts on each pod of a group: 0 for the leader, 1.. for the workers.
pub const LWS_WORKER_INDEX_LABEL: &str = "leaderworkerset.sigs.k8s.io/worker-index";
/// Environment variable LWS injects into every container of a group: the leader's address
/// (`<name>-<group>.<name>.<namespace>`, through the headless Service LWS creates).
pub const LWS_LEADER_ADDRESS_ENV: &str = "LWS_LEADER_ADDRESS";
/// Our own copy of the node rank, read from [`LWS_WORKER_INDEX_LABEL`] by the downward API.
pub const NODE_RANK_ENV: &str = "KVFLEET_NODE_RANK";

/// The LeaderWorkerSet resource, for dynamic API calls.
pub fn leader_worker_set_resource() -> ApiResource {
    ApiResource {
        group: LWS_GROUP.into(),
        version: LWS_VERSION.into(),
        api_version: format!("{LWS_GROUP}/{LWS_VERSION}"),
        kind: LWS_KIND.into(),
        plural: LWS_PLURAL.into(),
    }
}

/// vLLM's multi-node flags for a pod of a group (vllm#23691; `MULTI_NODE` in
/// compat/vllm_versions.rs says from which release): the leader is node rank 0 and serves the
/// API; the workers take their rank from the LWS label and run `--headless`.
pub fn multi_node_args(layout: &crate::validate::MultiNode, leader: bool) -> Vec<String> {
    let mut args = vec![
        "--nnodes".to_string(),
        layout.nodes_per_replica.to_string(),
        "--node-rank".to_string(),
        if leader {
            "0".to_string()
        } else {
            format!("$({NODE_RANK_ENV})")
        },
        "--master-addr".to_string(),
        format!("$({LWS_LEADER_ADDRESS_ENV})"),
    ];
    if !leader {
        args.push("--headless".into());
    }
    args
}

/// `spec` of the LeaderWorkerSet: one group of `nodes_per_replica` pods per replica, each pod
/// with `gpus_per_node` GPUs; a failed pod restarts its whole group (vLLM's ranks cannot
/// rejoin a running group).
fn leader_worker_set_spec(
    spec: &InferenceDeploymentSpec,
    template: &PodTemplateSpec,
    layout: &crate::validate::MultiNode,
) -> serde_json::Value {
    let role = |leader: bool| {
        let mut t = template.clone();
        if let Some(pod) = t.spec.as_mut() {
            if !leader {
                // Workers serve no API: no capacity sidecar, no HTTP probes.
                pod.containers.truncate(1);
            }
            if let Some(c) = pod.containers.first_mut() {
                c.args
                    .get_or_insert_with(Vec::new)
                    .extend(multi_node_args(layout, leader));
                if !leader {
                    c.readiness_probe = None;
                    c.liveness_probe = None;
                    c.startup_probe = None;
                    c.ports = None;
                    c.lifecycle = None;
                    c.env.get_or_insert_with(Vec::new).insert(
                        0,
                        field_env(
                            NODE_RANK_ENV,
                            &format!("metadata.labels['{LWS_WORKER_INDEX_LABEL}']"),
                        ),
                    );
                }
                let gpus = Quantity(layout.gpus_per_node.to_string());
                let r = c.resources.get_or_insert_with(ResourceRequirements::default);
                r.limits
                    .get_or_insert_with(BTreeMap::new)
                    .insert(gfd::GPU_RESOURCE.into(), gpus.clone());
                if let Some(req) = r.requests.as_mut() {
                    req.insert(gfd::GPU_RESOURCE.into(), gpus);
                }
            }
        }
        serde_json::to_value(t).unwrap_or_default()
    };
    json!({
        "spec": {
            "replicas": spec.replicas,
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0}
            },
            "leaderWorkerTemplate": {
                "size": layout.nodes_per_replica,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": role(true),
                "workerTemplate": role(false)
            }
        }
    })
}

/// Ingress to the pods of `name` (worker or vLLM) on the serving port only, from `allow_from`
/// and from `metrics_from`. The port serves the API, the probes and `/metrics` alike, so a
/// metrics peer reaches the API too (`spec.apiKey` guards that). An empty list adds no rule:
/// a rule with no `from` would admit every source. Both empty: no ingress at all. Kubelet
/// probes come from the node and the capacity sidecar over loopback; the usual plugins do
/// not filter either.
pub fn worker_network_policy(
    name: &str,
    allow_from: &[NetworkPolicyPeer],
    metrics_from: &[NetworkPolicyPeer],
) -> NetworkPolicySpec {
    let rule = |from: &[NetworkPolicyPeer]| NetworkPolicyIngressRule {
        from: Some(from.to_vec()),
        ports: Some(vec![NetworkPolicyPort {
            port: Some(IntOrString::String("http".into())),
            protocol: Some("TCP".into()),
            ..NetworkPolicyPort::default()
        }]),
    };
    let ingress = [allow_from, metrics_from]
        .into_iter()
        .filter(|peers| !peers.is_empty())
        .map(rule)
        .collect();
    NetworkPolicySpec {
        pod_selector: Some(LabelSelector {
            match_labels: Some(selector_labels(name)),
            ..LabelSelector::default()
        }),
        policy_types: Some(vec!["Ingress".into()]),
        ingress: Some(ingress),
        egress: None,
    }
}

fn pod_template(
    name: &str,
    spec: &InferenceDeploymentSpec,
    verdict: &Verdict,
    settings: &Settings,
    labels: &BTreeMap<String, String>,
    config_hash: Option<String>,
) -> PodTemplateSpec {
    let runtime = spec.engine.runtime;
    let overrides = spec.pod.clone().unwrap_or_default();
    let (_, backend) = resolved_strings(spec, verdict);
    let cpu_only = backend == AttentionBackend::KvfleetCpu.as_str();

    let mut annotations = overrides.annotations.clone();
    if let Some(h) = config_hash {
        annotations.insert(CONFIG_HASH_ANNOTATION.into(), h);
    }

    let mut volumes = vec![
        Volume {
            name: "tmp".into(),
            empty_dir: Some(EmptyDirVolumeSource::default()),
            ..Volume::default()
        },
        // NCCL and PyTorch use /dev/shm between tensor-parallel ranks; the default 64 MiB is too small.
        Volume {
            name: "dshm".into(),
            empty_dir: Some(EmptyDirVolumeSource {
                medium: Some("Memory".into()),
                ..EmptyDirVolumeSource::default()
            }),
            ..Volume::default()
        },
    ];
    let mut mounts = vec![
        VolumeMount {
            name: "tmp".into(),
            mount_path: "/tmp".into(),
            ..VolumeMount::default()
        },
        VolumeMount {
            name: "dshm".into(),
            mount_path: "/dev/shm".into(),
            ..VolumeMount::default()
        },
    ];
    if runtime == Runtime::Kvfleet {
        volumes.push(Volume {
            name: "config".into(),
            config_map: Some(ConfigMapVolumeSource {
                name: config_map_name(name),
                ..ConfigMapVolumeSource::default()
            }),
            ..Volume::default()
        });
        mounts.push(VolumeMount {
            name: "config".into(),
            mount_path: CONFIG_DIR.into(),
            read_only: Some(true),
            ..VolumeMount::default()
        });
        if let Some(src) = &spec.model.config {
            volumes.push(Volume {
                name: "model-config".into(),
                config_map: Some(ConfigMapVolumeSource {
                    name: src.config_map_ref.name.clone(),
                    items: Some(vec![KeyToPath {
                        key: src.config_map_ref.key.clone(),
                        path: "config.json".into(),
                        ..KeyToPath::default()
                    }]),
                    ..ConfigMapVolumeSource::default()
                }),
                ..Volume::default()
            });
            mounts.push(VolumeMount {
                name: "model-config".into(),
                mount_path: MODEL_CONFIG_DIR.into(),
                read_only: Some(true),
                ..VolumeMount::default()
            });
        }
    }
    let weights = spec.model.weights.as_ref();
    let weights_volume = match (
        weights.and_then(|w| w.pvc_name.clone()),
        weights.and_then(|w| w.host_path.clone()),
    ) {
        (Some(pvc), _) => Some(Volume {
            name: "weights".into(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: pvc,
                read_only: Some(true),
            }),
            ..Volume::default()
        }),
        (None, Some(path)) => Some(Volume {
            name: "weights".into(),
            host_path: Some(HostPathVolumeSource {
                path,
                type_: Some("Directory".into()),
            }),
            ..Volume::default()
        }),
        (None, None) => weights.and_then(|w| w.image.clone()).map(|reference| Volume {
            name: "weights".into(),
            image: Some(ImageVolumeSource {
                reference: Some(reference),
                pull_policy: Some("IfNotPresent".into()),
            }),
            ..Volume::default()
        }),
    };
    if let Some(v) = weights_volume {
        volumes.push(v);
        mounts.push(VolumeMount {
            name: "weights".into(),
            mount_path: WEIGHTS_DIR.into(),
            read_only: Some(true),
            ..VolumeMount::default()
        });
    }

    let mut env = vec![
        field_env("POD_NAME", "metadata.name"),
        field_env("POD_NAMESPACE", "metadata.namespace"),
        plain_env("HOME", "/tmp"),
    ];
    if let Some(key) = &spec.api_key {
        // Each server's own variable for the key of its OpenAI API.
        let var = match runtime {
            Runtime::Kvfleet => "KVFLEET_API_KEY",
            Runtime::Vllm => "VLLM_API_KEY",
        };
        env.push(secret_env(var, &key.secret_name, &key.key));
    }
    let (image, command, args, probe_paths) = match runtime {
        Runtime::Kvfleet => {
            let mut args = worker_args(spec, verdict);
            args.extend(spec.engine.extra_args.iter().cloned());
            (
                spec.engine
                    .image
                    .clone()
                    .unwrap_or_else(|| settings.worker_image.clone()),
                vec!["kvfleet".to_string()],
                args,
                ("/readyz", "/healthz"),
            )
        }
        Runtime::Vllm => {
            // vLLM writes caches under $HOME / XDG paths; the root filesystem is read-only.
            env.push(plain_env("XDG_CACHE_HOME", "/tmp/.cache"));
            let hf = weights.and_then(|w| w.hugging_face.as_ref());
            match hf.and_then(|h| h.cache_pvc_name.clone()) {
                Some(pvc) => {
                    // The Hub download cache outlives the pod: a restart reads it, not the network.
                    volumes.push(Volume {
                        name: "hf-cache".into(),
                        persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                            claim_name: pvc,
                            read_only: Some(false),
                        }),
                        ..Volume::default()
                    });
                    mounts.push(VolumeMount {
                        name: "hf-cache".into(),
                        mount_path: HF_CACHE_DIR.into(),
                        ..VolumeMount::default()
                    });
                    env.push(plain_env("HF_HOME", HF_CACHE_DIR));
                }
                None => env.push(plain_env("HF_HOME", "/tmp/.cache/huggingface")),
            }
            if let Some(secret) = hf.and_then(|h| h.token_secret_ref.as_ref()) {
                env.push(secret_env("HF_TOKEN", &secret.name, &secret.key));
            }
            env.push(plain_env("VLLM_CACHE_ROOT", "/tmp/.cache/vllm"));
            env.push(plain_env("TRITON_CACHE_DIR", "/tmp/.cache/triton"));
            let image = vllm_image(spec, settings);
            let version = rendered_vllm_version(spec, &image);
            env.extend(vllm_env(spec, verdict, version));
            (
                image,
                vec![
                    "python3".to_string(),
                    "-m".to_string(),
                    "vllm.entrypoints.openai.api_server".to_string(),
                ],
                vllm_args_at(spec, verdict, version),
                // vLLM's server answers /health once the engine is up.
                ("/health", "/health"),
            )
        }
    };
    env.extend(overrides.env.iter().cloned());

    let mut resources = overrides.resources.clone().unwrap_or_default();
    if !cpu_only {
        let gpus = Quantity(spec.gpus_per_replica().to_string());
        resources
            .limits
            .get_or_insert_with(BTreeMap::new)
            .insert(gfd::GPU_RESOURCE.into(), gpus.clone());
        // Extended resources need request == limit; set both so overrides cannot disagree.
        if let Some(req) = resources.requests.as_mut() {
            req.insert(gfd::GPU_RESOURCE.into(), gpus);
        }
    }

    let http_probe = |path: &str, period: i32, failures: i32| Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.into()),
            port: IntOrString::String("http".into()),
            ..HTTPGetAction::default()
        }),
        period_seconds: Some(period),
        failure_threshold: Some(failures),
        timeout_seconds: Some(5),
        ..Probe::default()
    };

    let sidecar = (runtime == Runtime::Vllm).then(|| capacity_sidecar(settings));
    let container = Container {
        name: runtime.as_str().into(),
        image: Some(image),
        command: Some(command),
        args: Some(args),
        ports: Some(vec![ContainerPort {
            name: Some("http".into()),
            container_port: HTTP_PORT,
            protocol: Some("TCP".into()),
            ..ContainerPort::default()
        }]),
        env: Some(env),
        resources: Some(ResourceRequirements { ..resources }),
        volume_mounts: Some(mounts),
        readiness_probe: Some(http_probe(probe_paths.0, 10, 3)),
        liveness_probe: Some(http_probe(probe_paths.1, 10, 3)),
        // Loading weights and sizing the KV pool can take many minutes; a Hub download of a
        // large checkpoint longer still (see startup_probe_failures).
        startup_probe: Some(http_probe(
            probe_paths.1,
            STARTUP_PROBE_PERIOD_S,
            startup_probe_failures(spec),
        )),
        lifecycle: Some(Lifecycle {
            pre_stop: Some(LifecycleHandler {
                sleep: Some(SleepAction {
                    seconds: PRE_STOP_SECONDS,
                }),
                ..LifecycleHandler::default()
            }),
            ..Lifecycle::default()
        }),
        security_context: Some(restricted_container()),
        ..Container::default()
    };

    let mut tolerations = Vec::new();
    if !cpu_only {
        // GPU nodes are commonly tainted nvidia.com/gpu:NoSchedule (GPU Operator, cloud node pools).
        tolerations.push(Toleration {
            key: Some(gfd::GPU_RESOURCE.into()),
            operator: Some("Exists".into()),
            effect: Some("NoSchedule".into()),
            ..Toleration::default()
        });
    }
    tolerations.extend(overrides.tolerations.iter().cloned());

    PodTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: Some(labels.clone()),
            annotations: (!annotations.is_empty()).then_some(annotations),
            ..ObjectMeta::default()
        }),
        spec: Some(PodSpec {
            containers: std::iter::once(container).chain(sidecar).collect(),
            service_account_name: Some(worker_service_account_name(name)),
            automount_service_account_token: Some(true),
            affinity: verdict.node_affinity.clone().map(|na| Affinity {
                node_affinity: Some(na),
                ..Affinity::default()
            }),
            node_selector: (!overrides.node_selector.is_empty()).then(|| overrides.node_selector.clone()),
            tolerations: (!tolerations.is_empty()).then_some(tolerations),
            volumes: Some(volumes),
            security_context: Some(PodSecurityContext {
                run_as_non_root: Some(true),
                run_as_user: Some(RUN_AS_USER),
                run_as_group: Some(RUN_AS_USER),
                fs_group: Some(RUN_AS_USER),
                seccomp_profile: Some(SeccompProfile {
                    type_: "RuntimeDefault".into(),
                    ..SeccompProfile::default()
                }),
                ..PodSecurityContext::default()
            }),
            termination_grace_period_seconds: Some(TERMINATION_GRACE_SECONDS),
            ..PodSpec::default()
        }),
    }
}

/// Seconds a terminating pod keeps serving before SIGTERM (its preStop sleep), so that the
/// endpoint controllers and proxies stop routing to it first.
pub const PRE_STOP_SECONDS: i64 = 5;
/// Seconds from the preStop hook to SIGKILL: the preStop sleep, the worker's drain (20 s by
/// default: running requests finish, the rest end with an error) and closing the server.
pub const TERMINATION_GRACE_SECONDS: i64 = 60;

/// Never dark during a rollout. One replica: the new pod comes up beside the old one
/// (`maxSurge: 1, maxUnavailable: 0`); on a full pool it waits Pending for a GPU while the old
/// pod keeps serving. Several replicas: one at a time is replaced in place
/// (`maxSurge: 0, maxUnavailable: 1`), which needs no spare GPU, while the others serve.
pub fn rollout(replicas: i32) -> DeploymentStrategy {
    let (surge, unavailable) = if replicas <= 1 { (1, 0) } else { (0, 1) };
    DeploymentStrategy {
        type_: Some("RollingUpdate".into()),
        rolling_update: Some(RollingUpdateDeployment {
            max_surge: Some(IntOrString::Int(surge)),
            max_unavailable: Some(IntOrString::Int(unavailable)),
        }),
    }
}

/// What the restricted Pod Security Standard asks of every container we render: no privilege
/// escalation, no capabilities, non-root, and a read-only root filesystem.
fn restricted_container() -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        read_only_root_filesystem: Some(true),
        run_as_non_root: Some(true),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".into()]),
            ..Capabilities::default()
        }),
        ..SecurityContext::default()
    }
}

/// Name of the container that publishes vLLM's measured KV capacity.
pub const CAPACITY_SIDECAR: &str = "kv-capacity";

/// `kvfleet capacity-sidecar` beside vLLM: reads `localhost:8000/metrics` and annotates the pod
/// (the kvfleet image, a few MiB of memory, no GPU).
fn capacity_sidecar(settings: &Settings) -> Container {
    Container {
        name: CAPACITY_SIDECAR.into(),
        image: Some(settings.worker_image.clone()),
        command: Some(vec!["kvfleet".into()]),
        args: Some(vec![
            "capacity-sidecar".into(),
            "--metrics".into(),
            format!("127.0.0.1:{HTTP_PORT}/metrics"),
        ]),
        env: Some(vec![
            field_env("POD_NAME", "metadata.name"),
            field_env("POD_NAMESPACE", "metadata.namespace"),
        ]),
        resources: Some(ResourceRequirements {
            requests: Some(BTreeMap::from([
                ("cpu".to_string(), Quantity("10m".into())),
                ("memory".to_string(), Quantity("32Mi".into())),
            ])),
            limits: Some(BTreeMap::from([("memory".to_string(), Quantity("64Mi".into()))])),
            ..ResourceRequirements::default()
        }),
        security_context: Some(restricted_container()),
        ..Container::default()
    }
}

/// Period of the startup probe in seconds.
pub const STARTUP_PROBE_PERIOD_S: i32 = 10;

/// Startup-probe failures allowed: 10 minutes for engine start and KV sizing, plus time for
/// the weights at 1 GiB per 4 s from a volume (NVMe or a network filesystem) and 1 GiB per
/// 10 s from the Hugging Face Hub; capped at 3 hours. Without weightBytes, 64 GiB is assumed.
pub fn startup_probe_failures(spec: &InferenceDeploymentSpec) -> i32 {
    const GIB: u64 = 1 << 30;
    let bytes = spec
        .model
        .weight_bytes
        .as_ref()
        .and_then(|q| parse_quantity_bytes(&q.0).ok())
        .unwrap_or(64 * GIB);
    let w = spec.model.weights.as_ref();
    let per_gib_s = match w {
        Some(w) if w.hugging_face.is_some() => 10,
        Some(w) if w.has_source() => 4,
        _ => 0,
    };
    let seconds = 600 + bytes.div_ceil(GIB) * per_gib_s;
    let failures = seconds
        .div_ceil(STARTUP_PROBE_PERIOD_S as u64)
        .min(3 * 3600 / STARTUP_PROBE_PERIOD_S as u64);
    failures as i32
}

fn plain_env(name: &str, value: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: Some(value.into()),
        ..EnvVar::default()
    }
}

/// A variable read from `key` of Secret `secret` (required: the pod waits for it), so that
/// the value never appears in the pod spec.
fn secret_env(name: &str, secret: &str, key: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: secret.into(),
                key: key.into(),
                optional: Some(false),
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    }
}

fn field_env(name: &str, path: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: path.into(),
                ..ObjectFieldSelector::default()
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    }
}

/// The vLLM image of a spec: its own, else the official image of `engine.vllm.version`, else
/// the controller's default (`--vllm-image`).
pub fn vllm_image(spec: &InferenceDeploymentSpec, settings: &Settings) -> String {
    let field = spec.engine.vllm.as_ref().and_then(|v| v.version.as_deref());
    match (&spec.engine.image, field.and_then(VllmVersion::parse)) {
        (Some(i), _) => i.clone(),
        (None, Some(v)) => v.image(),
        (None, None) => settings.vllm_image.clone(),
    }
}

/// The vLLM release the pod runs: `engine.vllm.version`, else the tag of the image rendered
/// (the controller's `--vllm-image` when the spec names none), else kvfleet's default.
pub fn rendered_vllm_version(spec: &InferenceDeploymentSpec, image: &str) -> VllmVersion {
    vllm_versions::resolve(
        Some(image),
        spec.engine.vllm.as_ref().and_then(|v| v.version.as_deref()),
    )
    .map(|(v, _)| v)
    .unwrap_or(vllm_versions::DEFAULT_VERSION)
}

/// The KV dtype and backend strings vLLM gets: `auto` stays `auto` (vLLM keeps the model
/// dtype, which is what the verdict resolved it to, and `auto` exists in every release while
/// `bfloat16`/`float16` do not).
fn vllm_dtype_backend(spec: &InferenceDeploymentSpec, verdict: &Verdict) -> (String, String) {
    let (dtype, backend) = resolved_strings(spec, verdict);
    let dtype = if spec.engine.kv_cache_dtype == KvCacheDtype::Auto {
        KvCacheDtype::Auto.as_str().to_string()
    } else {
        dtype
    };
    (dtype, backend)
}

/// Environment of the vLLM container that depends on the release: before 0.12 the attention
/// backend is chosen by `VLLM_ATTENTION_BACKEND` (vllm#26315 made it a flag).
pub fn vllm_env(spec: &InferenceDeploymentSpec, verdict: &Verdict, version: VllmVersion) -> Vec<EnvVar> {
    let (_, backend) = vllm_dtype_backend(spec, verdict);
    if backend != AttentionBackend::Auto.as_str()
        && vllm_versions::backend_choice(version) == vllm_versions::BackendChoice::Env
    {
        vec![plain_env(vllm_versions::ATTENTION_BACKEND_ENV, &backend)]
    } else {
        Vec::new()
    }
}

/// [`vllm_args_at`] for the spec's own release (or kvfleet's default image's).
pub fn vllm_args(spec: &InferenceDeploymentSpec, verdict: &Verdict) -> Vec<String> {
    let version = spec.vllm_version().unwrap_or(vllm_versions::DEFAULT_VERSION);
    vllm_args_at(spec, verdict, version)
}

/// Command-line flags of the vLLM OpenAI server of release `version`, from the resolved
/// configuration, so the server runs exactly what admission checked.
pub fn vllm_args_at(spec: &InferenceDeploymentSpec, verdict: &Verdict, version: VllmVersion) -> Vec<String> {
    let e = &spec.engine;
    let (dtype, backend) = vllm_dtype_backend(spec, verdict);
    let w = spec.model.weights.as_ref();
    let hf = w.and_then(|w| w.hugging_face.as_ref());
    let model = match (w, hf) {
        (_, Some(h)) => h.repo.clone().unwrap_or_else(|| spec.model.name.clone()),
        (Some(w), None) if w.has_source() => match w.path.as_deref().map(|p| p.trim_matches('/')) {
            Some(p) if !p.is_empty() => format!("{WEIGHTS_DIR}/{p}"),
            _ => WEIGHTS_DIR.to_string(),
        },
        // Dummy weights: vLLM reads the model's config.json by its name.
        _ => spec.model.name.clone(),
    };
    let mut args = vec![
        "--model".to_string(),
        model,
        "--served-model-name".to_string(),
        spec.model.name.clone(),
        "--host".to_string(),
        "0.0.0.0".to_string(),
        "--port".to_string(),
        HTTP_PORT.to_string(),
        "--kv-cache-dtype".to_string(),
        dtype,
    ];
    if backend != AttentionBackend::Auto.as_str()
        && vllm_versions::backend_choice(version) == vllm_versions::BackendChoice::Flag
    {
        args.push("--attention-backend".into());
        args.push(backend);
    }
    let numeric: [(&str, String); 6] = [
        ("--max-model-len", e.max_model_len.to_string()),
        ("--max-num-seqs", e.max_num_seqs.to_string()),
        ("--max-num-batched-tokens", e.max_num_batched_tokens.to_string()),
        ("--block-size", e.block_size.to_string()),
        ("--gpu-memory-utilization", e.gpu_memory_utilization.to_string()),
        ("--tensor-parallel-size", e.tensor_parallel_size.to_string()),
    ];
    for (flag, value) in numeric {
        args.push(flag.into());
        args.push(value);
    }
    if e.pipeline_parallel_size > 1 {
        args.push("--pipeline-parallel-size".into());
        args.push(e.pipeline_parallel_size.to_string());
    }
    if let Some(rev) = hf.and_then(|h| h.revision.clone()) {
        args.push("--revision".into());
        args.push(rev);
    }
    // Random weights only when the spec says so (admission denies a vllm spec without weights).
    if w.is_some_and(|w| w.format == WeightsFormat::Dummy && !w.has_source()) {
        args.push("--load-format".into());
        args.push("dummy".into());
    }
    args.extend(e.extra_args.iter().cloned());
    args
}

/// `kvfleet worker` arguments: the rendered config, and on top of it the values a reader of
/// `kubectl describe pod` looks for (they equal the config's): the model path on the weights
/// volume, the served name, the resolved KV dtype and the engine limits.
pub fn worker_args(spec: &InferenceDeploymentSpec, verdict: &Verdict) -> Vec<String> {
    let (dtype, _) = resolved_strings(spec, verdict);
    let e = &spec.engine;
    let mut args = vec![
        "worker".to_string(),
        "--config".to_string(),
        format!("{CONFIG_DIR}/{WORKER_CONFIG_KEY}"),
    ];
    let source = worker_model_source(spec);
    if let Some(p) = &source.path {
        args.extend(["--model".to_string(), p.display().to_string()]);
    }
    if source.weights == Weights::Dummy {
        args.extend(["--model-weights".to_string(), "dummy".to_string()]);
    }
    for (flag, value) in [
        ("--served-model-name", spec.model.name.clone()),
        ("--kv-cache-dtype", dtype),
        ("--max-model-len", e.max_model_len.to_string()),
        ("--max-num-seqs", e.max_num_seqs.to_string()),
        ("--max-num-batched-tokens", e.max_num_batched_tokens.to_string()),
        ("--block-size", e.block_size.to_string()),
        ("--gpu-memory-utilization", e.gpu_memory_utilization.to_string()),
    ] {
        args.extend([flag.to_string(), value]);
    }
    args
}

/// The kvfleet worker's configuration ([`WorkerConfig`], read by `kvfleet worker --config`):
/// the spec's geometry and engine with the verdict's resolution of `auto`. `None` when the spec
/// has no inline geometry (the worker needs it; see docs/controller.md).
pub fn worker_config(spec: &InferenceDeploymentSpec, verdict: &Verdict) -> Option<WorkerConfig> {
    let geometry = spec.model.geometry.clone()?;
    let (dtype, backend) = resolved_strings(spec, verdict);
    let resolved = match (dtype.parse::<KvCacheDtype>(), backend.parse::<AttentionBackend>()) {
        (Ok(kv_cache_dtype), Ok(attention_backend)) => Some(ResolvedEngine {
            kv_cache_dtype,
            attention_backend,
        }),
        _ => None,
    };
    Some(WorkerConfig {
        model_name: Some(spec.model.name.clone()),
        model: Some(worker_model_source(spec)),
        geometry: Some(geometry),
        weight_bytes: spec
            .model
            .weight_bytes
            .as_ref()
            .and_then(|q| parse_quantity_bytes(&q.0).ok())
            .unwrap_or(0),
        engine: spec.engine.clone(),
        resolved,
        activation_reserve_bytes: None,
        cpu_memory_bytes: None,
        max_kv_tokens: None,
        max_waiting: None,
        seed: 0,
    })
}

/// Where the worker reads the model: `/models/<weights.path>` on the weights volume, or
/// dummy weights (of the `model.config` ConfigMap's geometry when there is one, else of the
/// inline geometry). No weights at all renders a source without a path, which the worker
/// refuses at start with the fix (never the embedded model, never random weights).
pub fn worker_model_source(spec: &InferenceDeploymentSpec) -> ModelSource {
    let w = spec.model.weights.as_ref();
    match w.map(|w| w.format) {
        Some(WeightsFormat::Dummy) => ModelSource {
            path: None,
            weights: Weights::Dummy,
            config: spec
                .model
                .config
                .as_ref()
                .map(|_| PathBuf::from(format!("{MODEL_CONFIG_DIR}/config.json"))),
        },
        Some(_) => ModelSource {
            path: w.map(|w| {
                let rel = w.path.as_deref().unwrap_or("").trim_matches('/');
                PathBuf::from(WEIGHTS_DIR).join(rel)
            }),
            weights: Weights::Load,
            config: None,
        },
        None => ModelSource::default(),
    }
}

/// `worker.yaml`: [`worker_config`] as YAML.
pub fn worker_config_yaml(spec: &InferenceDeploymentSpec, verdict: &Verdict) -> Result<String, DesiredError> {
    let cfg = worker_config(spec, verdict).ok_or(DesiredError::GeometryRequired)?;
    serde_yaml::to_string(&cfg).map_err(DesiredError::WorkerConfig)
}

/// FNV-1a, 64 bit: a hash that stays the same across Rust releases (unlike `DefaultHasher`),
/// so upgrading the controller does not roll every pod.
fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Owner reference of `obj` (for tests and callers that build objects by hand).
pub fn owner_reference(obj: &InferenceDeployment) -> Option<OwnerReference> {
    obj.controller_owner_ref(&())
}

/// `namespace/name` for logs and keys.
pub fn object_key(obj: &impl ResourceExt) -> String {
    format!("{}/{}", obj.namespace().unwrap_or_default(), obj.name_any())
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm};

    use super::*;
    use crate::api::ResolvedConfig;

    fn fixture(yaml: &str) -> InferenceDeployment {
        let mut o: InferenceDeployment = serde_yaml::from_str(yaml).expect("fixture parses");
        o.metadata.namespace = Some("ml".into());
        o.metadata.uid = Some("0b7c6c1e-7f7e-4a38-9d43-2f9c1d3f7a10".into());
        o.metadata.generation = Some(1);
        o
    }

    const KVFLEET_RTX3090_TP2: &str = r#"
apiVersion: kvfleet.io/v1alpha1
kind: InferenceDeployment
metadata: {name: llama}
spec:
  replicas: 2
  model:
    name: meta-llama/Llama-3.1-8B-Instruct
    geometry: {layers: 32, queryHeads: 32, kvHeads: 8, headDim: 128}
    weightBytes: 16Gi
  engine:
    runtime: kvfleet
    kvCacheDtype: auto
    tensorParallelSize: 2
  gpu:
    selector: {products: [NVIDIA-GeForce-RTX-3090]}
"#;

    const VLLM_RTX5090: &str = r#"
apiVersion: kvfleet.io/v1alpha1
kind: InferenceDeployment
metadata: {name: gemma}
spec:
  replicas: 1
  model:
    name: google/gemma-3-12b-it
    geometry: {layers: 48, queryHeads: 16, kvHeads: 8, headDim: 256, slidingWindow: 1024}
    weights: {format: dummy}
  engine:
    runtime: vllm
    kvCacheDtype: fp8
    attentionBackend: auto
    maxModelLen: 32768
    maxNumSeqs: 32
    maxNumBatchedTokens: 4096
    blockSize: 32
    gpuMemoryUtilization: 0.85
    tensorParallelSize: 1
"#;

    fn verdict(dtype: &str, backend: &str, cc: &str, product: &str) -> Verdict {
        Verdict {
            resolved: Some(ResolvedConfig {
                kv_cache_dtype: dtype.into(),
                attention_backend: backend.into(),
                compute_capabilities: vec![cc.into()],
                products: vec![product.into()],
            }),
            node_affinity: Some(NodeAffinity {
                required_during_scheduling_ignored_during_execution: Some(NodeSelector {
                    node_selector_terms: vec![NodeSelectorTerm {
                        match_expressions: Some(vec![NodeSelectorRequirement {
                            key: gfd::PRODUCT.into(),
                            operator: "In".into(),
                            values: Some(vec![product.into()]),
                        }]),
                        ..NodeSelectorTerm::default()
                    }],
                }),
                ..NodeAffinity::default()
            }),
            compatible_nodes: vec!["gpu-1".into()],
            ..Verdict::default()
        }
    }

    fn container(d: &Desired) -> Container {
        d.deployment
            .as_ref()
            .unwrap()
            .spec
            .as_ref()
            .unwrap()
            .template
            .spec
            .as_ref()
            .unwrap()
            .containers[0]
            .clone()
    }
    fn pod(d: &Desired) -> PodSpec {
        d.deployment
            .as_ref()
            .unwrap()
            .spec
            .as_ref()
            .unwrap()
            .template
            .spec
            .clone()
            .unwrap()
    }

    fn arg_after(args: &[String], flag: &str) -> Option<String> {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1).cloned())
    }

    #[test]
    fn kvfleet_pods_get_gpu_limits_equal_to_tensor_parallel_size_and_the_verdicts_affinity() {
        let obj = fixture(KVFLEET_RTX3090_TP2);
        let v = verdict("bfloat16", "KVFLEET_CUDA", "8.6", "NVIDIA-GeForce-RTX-3090");
        let d = desired(&obj, &v, &Settings::default(), None).unwrap();
        let c = container(&d);
        let limits = c.resources.unwrap().limits.unwrap();
        assert_eq!(limits.get("nvidia.com/gpu"), Some(&Quantity("2".into())));
        let p = pod(&d);
        assert_eq!(p.affinity.unwrap().node_affinity, v.node_affinity);
        assert_eq!(p.service_account_name.as_deref(), Some("llama-worker"));
        let tol = p.tolerations.unwrap();
        assert!(tol.iter().any(|t| t.key.as_deref() == Some("nvidia.com/gpu")));
        assert_eq!(
            d.deployment.as_ref().unwrap().spec.as_ref().unwrap().replicas,
            Some(2)
        );
    }

    const KVFLEET_H100_PVC: &str = r#"
apiVersion: kvfleet.io/v1alpha1
kind: InferenceDeployment
metadata: {name: llama}
spec:
  model:
    name: meta-llama/Llama-3.1-8B-Instruct
    geometry: {layers: 32, queryHeads: 32, kvHeads: 8, headDim: 128}
    weights: {format: safetensors, pvcName: llama-weights, path: /llama-3.1-8b-instruct/}
  engine:
    runtime: kvfleet
    kvCacheDtype: fp8
    maxModelLen: 32768
    maxNumSeqs: 48
    maxNumBatchedTokens: 4096
    gpuMemoryUtilization: 0.92
  gpu:
    selector: {products: [NVIDIA-H100-80GB-HBM3]}
"#;

    #[test]
    fn kvfleet_pod_args_name_the_model_on_the_mounted_weights_volume_with_dtype_and_limits() {
        let obj = fixture(KVFLEET_H100_PVC);
        let v = verdict("fp8_e4m3", "KVFLEET_CUDA", "9.0", "NVIDIA-H100-80GB-HBM3");
        let d = desired(&obj, &v, &Settings::default(), None).unwrap();
        let c = container(&d);
        let args = c.args.clone().unwrap();
        let model = arg_after(&args, "--model").expect("--model");
        assert_eq!(model, "/models/llama-3.1-8b-instruct");
        for (flag, want) in [
            ("--served-model-name", "meta-llama/Llama-3.1-8B-Instruct"),
            ("--kv-cache-dtype", "fp8_e4m3"),
            ("--max-model-len", "32768"),
            ("--max-num-seqs", "48"),
            ("--max-num-batched-tokens", "4096"),
            ("--block-size", "16"),
            ("--gpu-memory-utilization", "0.92"),
        ] {
            assert_eq!(
                arg_after(&args, flag).as_deref(),
                Some(want),
                "{flag} in {args:?}"
            );
        }
        assert_eq!(arg_after(&args, "--model-weights"), None, "real weights");
        // The volume holding the weights is mounted, read-only, at the directory --model is in.
        let mount = c
            .volume_mounts
            .unwrap()
            .into_iter()
            .find(|m| model.starts_with(&format!("{}/", m.mount_path)))
            .expect("a mount under --model");
        assert_eq!(mount.read_only, Some(true));
        let vol = pod(&d)
            .volumes
            .unwrap()
            .into_iter()
            .find(|v| v.name == mount.name)
            .unwrap();
        let pvc = vol.persistent_volume_claim.unwrap();
        assert_eq!(pvc.claim_name, "llama-weights");
        // The config file says the same.
        let yaml = &d.config_map.as_ref().unwrap().data.as_ref().unwrap()[WORKER_CONFIG_KEY];
        let cfg = WorkerConfig::parse(yaml).unwrap();
        let src = cfg.model.unwrap();
        assert_eq!(src.path.unwrap().display().to_string(), model);
        assert_eq!(src.weights, Weights::Load);

        // hostPath weights: a Directory volume at the same place.
        let host = KVFLEET_H100_PVC.replace("pvcName: llama-weights", "hostPath: /mnt/nvme/models");
        let d = desired(&fixture(&host), &v, &Settings::default(), None).unwrap();
        let vol = pod(&d)
            .volumes
            .unwrap()
            .into_iter()
            .find(|v| v.name == "weights")
            .unwrap();
        let hp = vol.host_path.unwrap();
        assert_eq!(
            (hp.path.as_str(), hp.type_.as_deref()),
            ("/mnt/nvme/models", Some("Directory"))
        );

        // Dummy weights only when asked, with no model path.
        let dummy = KVFLEET_H100_PVC.replace(
            "weights: {format: safetensors, pvcName: llama-weights, path: /llama-3.1-8b-instruct/}",
            "weights: {format: dummy}",
        );
        let d = desired(&fixture(&dummy), &v, &Settings::default(), None).unwrap();
        let args = container(&d).args.unwrap();
        assert_eq!(arg_after(&args, "--model-weights").as_deref(), Some("dummy"));
        assert_eq!(arg_after(&args, "--model"), None);
    }

    #[test]
    fn kvfleet_worker_reads_the_resolved_config_from_the_config_map() {
        let obj = fixture(KVFLEET_RTX3090_TP2);
        let v = verdict("bfloat16", "KVFLEET_CUDA", "8.6", "NVIDIA-GeForce-RTX-3090");
        let d = desired(&obj, &v, &Settings::default(), None).unwrap();
        let cm = d.config_map.as_ref().unwrap();
        assert_eq!(cm.metadata.name.as_deref(), Some("llama-config"));
        let yaml = &cm.data.as_ref().unwrap()[WORKER_CONFIG_KEY];
        let cfg = WorkerConfig::parse(yaml).expect("the worker accepts what the controller renders");
        let r = cfg.resolved.unwrap();
        assert_eq!(
            r.kv_cache_dtype,
            KvCacheDtype::Bfloat16,
            "auto resolved by the verdict"
        );
        assert_eq!(r.attention_backend, AttentionBackend::KvfleetCuda);
        assert_eq!(cfg.engine.tensor_parallel_size, 2);
        assert_eq!(cfg.geometry.as_ref().unwrap().kv_heads, 8);
        assert_eq!(cfg.weight_bytes, 16 << 30);
        assert_eq!(
            cfg.model_name.as_deref(),
            Some("meta-llama/Llama-3.1-8B-Instruct")
        );
        let c = container(&d);
        assert_eq!(c.command.unwrap(), vec!["kvfleet"]);
        let args = c.args.unwrap();
        assert_eq!(args[..3], ["worker", "--config", "/etc/kvfleet/worker.yaml"]);
        assert_eq!(
            arg_after(&args, "--model"),
            None,
            "no weights: no model path, never a default model"
        );
        assert_eq!(
            cfg.model,
            Some(ModelSource::default()),
            "the worker refuses to start without weights"
        );
        assert!(c
            .volume_mounts
            .unwrap()
            .iter()
            .any(|m| m.mount_path == "/etc/kvfleet"));
        let ann = d
            .deployment
            .as_ref()
            .unwrap()
            .spec
            .as_ref()
            .unwrap()
            .template
            .metadata
            .clone()
            .unwrap()
            .annotations
            .unwrap();
        assert!(ann.contains_key(CONFIG_HASH_ANNOTATION));
        let rb = d.role_binding.unwrap();
        assert_eq!(rb.role_ref.name, WORKER_CLUSTER_ROLE);
    }

    #[test]
    fn config_hash_is_stable_and_follows_the_resolved_config() {
        let obj = fixture(KVFLEET_RTX3090_TP2);
        let hash = |v: &Verdict| {
            let d = desired(&obj, v, &Settings::default(), None).unwrap();
            d.deployment
                .unwrap()
                .spec
                .unwrap()
                .template
                .metadata
                .unwrap()
                .annotations
                .unwrap()[CONFIG_HASH_ANNOTATION]
                .clone()
        };
        let a = verdict("bfloat16", "KVFLEET_CUDA", "8.6", "NVIDIA-GeForce-RTX-3090");
        let b = verdict("fp8_e5m2", "KVFLEET_CUDA", "8.6", "NVIDIA-GeForce-RTX-3090");
        assert_eq!(hash(&a), hash(&a));
        assert_ne!(hash(&a), hash(&b));
    }

    #[test]
    fn both_runtimes_probe_their_health_endpoints_on_the_named_port() {
        for (yaml, ready, live) in [
            (KVFLEET_RTX3090_TP2, "/readyz", "/healthz"),
            (VLLM_RTX5090, "/health", "/health"),
        ] {
            let obj = fixture(yaml);
            let v = verdict("fp8", "TRITON_ATTN", "12.0", "NVIDIA-GeForce-RTX-5090");
            let c = container(&desired(&obj, &v, &Settings::default(), None).unwrap());
            let get = |p: Option<Probe>| p.unwrap().http_get.unwrap();
            let r = get(c.readiness_probe.clone());
            assert_eq!(r.path.as_deref(), Some(ready));
            assert_eq!(r.port, IntOrString::String("http".into()));
            assert_eq!(get(c.liveness_probe.clone()).path.as_deref(), Some(live));
            assert!(
                c.startup_probe.unwrap().failure_threshold.unwrap() >= 30,
                "model loading needs time"
            );
            assert_eq!(c.ports.unwrap()[0].container_port, HTTP_PORT);
        }
    }

    #[test]
    fn pods_run_non_root_read_only_without_capabilities_under_runtime_default_seccomp() {
        for yaml in [KVFLEET_RTX3090_TP2, VLLM_RTX5090] {
            let obj = fixture(yaml);
            let v = verdict("fp8", "TRITON_ATTN", "12.0", "NVIDIA-GeForce-RTX-5090");
            let d = desired(&obj, &v, &Settings::default(), None).unwrap();
            let psc = pod(&d).security_context.unwrap();
            assert_eq!(psc.run_as_non_root, Some(true));
            assert_eq!(psc.seccomp_profile.unwrap().type_, "RuntimeDefault");
            let sc = container(&d).security_context.unwrap();
            assert_eq!(sc.read_only_root_filesystem, Some(true));
            assert_eq!(sc.allow_privilege_escalation, Some(false));
            assert_eq!(sc.capabilities.unwrap().drop, Some(vec!["ALL".to_string()]));
            let mounts = container(&d).volume_mounts.unwrap();
            assert!(
                mounts.iter().any(|m| m.mount_path == "/tmp"),
                "writable /tmp on a read-only root"
            );
        }
    }

    #[test]
    fn vllm_on_sm120_runs_triton_attn_with_every_flag_from_the_resolved_config() {
        let obj = fixture(VLLM_RTX5090);
        let v = verdict("fp8", "TRITON_ATTN", "12.0", "NVIDIA-GeForce-RTX-5090");
        let d = desired(&obj, &v, &Settings::default(), None).unwrap();
        let c = container(&d);
        let args = c.args.clone().unwrap();
        for (flag, value) in [
            ("--kv-cache-dtype", "fp8"),
            ("--attention-backend", "TRITON_ATTN"),
            ("--max-model-len", "32768"),
            ("--max-num-seqs", "32"),
            ("--max-num-batched-tokens", "4096"),
            ("--block-size", "32"),
            ("--gpu-memory-utilization", "0.85"),
            ("--tensor-parallel-size", "1"),
            ("--port", "8000"),
            ("--served-model-name", "google/gemma-3-12b-it"),
            ("--load-format", "dummy"),
        ] {
            assert_eq!(
                arg_after(&args, flag).as_deref(),
                Some(value),
                "{flag} in {args:?}"
            );
        }
        assert_eq!(c.image.as_deref(), Some(Settings::default().vllm_image.as_str()));
        assert_eq!(
            c.resources.unwrap().limits.unwrap().get("nvidia.com/gpu"),
            Some(&Quantity("1".into()))
        );
        assert!(d.config_map.is_none());
        // The capacity sidecar annotates the pod: the pod's identity may do so.
        assert_eq!(d.role_binding.clone().unwrap().role_ref.name, WORKER_CLUSTER_ROLE);
        let p = pod(&d);
        assert_eq!(p.automount_service_account_token, Some(true));
        assert_eq!(p.service_account_name.as_deref(), Some("gemma-worker"));
        let sidecar = p
            .containers
            .iter()
            .find(|c| c.name == CAPACITY_SIDECAR)
            .expect("sidecar");
        assert_eq!(
            sidecar.args.as_ref().unwrap()[..3],
            ["capacity-sidecar", "--metrics", "127.0.0.1:8000/metrics"]
        );
        assert_eq!(sidecar.image, Some(Settings::default().worker_image));
        assert!(sidecar
            .resources
            .as_ref()
            .unwrap()
            .limits
            .as_ref()
            .unwrap()
            .get("nvidia.com/gpu")
            .is_none());
    }

    #[test]
    fn vllm_without_a_resolved_backend_leaves_the_choice_to_vllm() {
        let obj = fixture(VLLM_RTX5090);
        let v = Verdict {
            resolved: None,
            ..Verdict::default()
        };
        let args = vllm_args(&obj.spec, &v);
        assert!(!args.contains(&"--attention-backend".to_string()), "{args:?}");
        assert_eq!(arg_after(&args, "--kv-cache-dtype").as_deref(), Some("fp8"));
    }

    #[test]
    fn rollouts_never_go_dark_and_termination_drains_behind_a_pre_stop_sleep() {
        let v = verdict("bfloat16", "KVFLEET_CUDA", "8.6", "NVIDIA-GeForce-RTX-3090");
        let strategy = |d: &Desired| {
            let r = d
                .deployment
                .as_ref()
                .unwrap()
                .spec
                .clone()
                .unwrap()
                .strategy
                .unwrap()
                .rolling_update
                .unwrap();
            (r.max_surge.unwrap(), r.max_unavailable.unwrap())
        };
        // One replica: the replacement starts beside it (never zero serving pods).
        let one = desired(&fixture(VLLM_RTX5090), &v, &Settings::default(), None).unwrap();
        assert_eq!(strategy(&one), (IntOrString::Int(1), IntOrString::Int(0)));
        // Several: one at a time in place, needing no spare GPU.
        let two = desired(&fixture(KVFLEET_RTX3090_TP2), &v, &Settings::default(), None).unwrap();
        assert_eq!(strategy(&two), (IntOrString::Int(0), IntOrString::Int(1)));
        for d in [&one, &two] {
            let p = pod(d);
            let c = &p.containers[0];
            let sleep = c.lifecycle.clone().unwrap().pre_stop.unwrap().sleep.unwrap();
            assert_eq!(sleep.seconds, PRE_STOP_SECONDS);
            // preStop + the worker's default drain + closing the server fit in the grace period.
            assert!(PRE_STOP_SECONDS + 20 + 10 < p.termination_grace_period_seconds.unwrap());
        }
    }

    #[test]
    fn an_api_key_secret_reaches_each_server_as_its_own_variable() {
        let v = verdict("bfloat16", "KVFLEET_CUDA", "8.6", "NVIDIA-GeForce-RTX-3090");
        for (fixture_yaml, var) in [
            (KVFLEET_RTX3090_TP2, "KVFLEET_API_KEY"),
            (VLLM_RTX5090, "VLLM_API_KEY"),
        ] {
            let mut spec = fixture(fixture_yaml);
            let plain = desired(&spec, &v, &Settings::default(), None).unwrap();
            let env = |d: &Desired| pod(d).containers[0].env.clone().unwrap_or_default();
            assert!(
                !env(&plain).iter().any(|e| e.name.ends_with("API_KEY")),
                "off by default"
            );
            spec.spec.api_key = Some(crate::api::ApiKeySpec {
                secret_name: "llm-key".into(),
                key: "api-key".into(),
            });
            let keyed = desired(&spec, &v, &Settings::default(), None).unwrap();
            let e = env(&keyed).into_iter().find(|e| e.name == var).expect(var);
            assert!(e.value.is_none(), "the key never appears in the pod spec");
            let r = e.value_from.unwrap().secret_key_ref.unwrap();
            assert_eq!((r.name.as_str(), r.key.as_str()), ("llm-key", "api-key"));
        }
    }

    #[test]
    fn a_pdb_exists_only_with_more_than_one_replica() {
        let v = verdict("bfloat16", "KVFLEET_CUDA", "8.6", "NVIDIA-GeForce-RTX-3090");
        let two = desired(&fixture(KVFLEET_RTX3090_TP2), &v, &Settings::default(), None).unwrap();
        let pdb = two.pdb.unwrap();
        assert_eq!(pdb.spec.unwrap().max_unavailable, Some(IntOrString::Int(1)));
        let one = desired(&fixture(VLLM_RTX5090), &v, &Settings::default(), None).unwrap();
        assert!(one.pdb.is_none());
    }

    impl Desired {
        /// (name, port) of the serving container's ports.
        fn deployment_container_ports(&self) -> Vec<(String, i32)> {
            let pod = self
                .deployment
                .as_ref()
                .unwrap()
                .spec
                .as_ref()
                .unwrap()
                .template
                .spec
                .as_ref()
                .unwrap();
            pod.containers[0]
                .ports
                .iter()
                .flatten()
                .map(|p| (p.name.clone().unwrap_or_default(), p.container_port))
                .collect()
        }
    }

    fn peers(json: serde_json::Value) -> Vec<NetworkPolicyPeer> {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn without_spec_network_no_network_policy_is_rendered() {
        let v = verdict("bfloat16", "KVFLEET_CUDA", "8.6", "NVIDIA-GeForce-RTX-3090");
        let d = desired(&fixture(KVFLEET_RTX3090_TP2), &v, &Settings::default(), None).unwrap();
        assert_eq!(d.network_policy, None);
    }

    #[test]
    fn spec_network_renders_a_policy_admitting_its_peers_and_the_metrics_peers_to_the_serving_port() {
        let mut obj = fixture(VLLM_RTX5090);
        obj.spec.network = Some(crate::api::NetworkSpec {
            allow_from: peers(json!([
                {"podSelector": {"matchLabels": {"app": "gateway"}}},
                {"ipBlock": {"cidr": "10.8.0.0/16", "except": ["10.8.1.0/24"]}}
            ])),
        });
        let settings = Settings {
            worker_metrics_from: peers(json!([
                {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
            ])),
            ..Settings::default()
        };
        let v = verdict("fp8", "TRITON_ATTN", "12.0", "NVIDIA-GeForce-RTX-5090");
        let d = desired(&obj, &v, &settings, None).unwrap();
        let np = d.network_policy.clone().expect("a NetworkPolicy");
        assert_eq!(np.metadata.name.as_deref(), Some("gemma-worker"));
        assert_eq!(np.metadata.namespace.as_deref(), Some("ml"));
        let owner = &np.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.controller),
            ("InferenceDeployment", Some(true))
        );
        let spec = serde_json::to_value(np.spec.unwrap()).unwrap();
        // The pods of this deployment, exactly as its Deployment and Service select them.
        assert_eq!(
            spec["podSelector"],
            json!({"matchLabels": {INSTANCE_LABEL: "gemma"}})
        );
        let template = &d.deployment.as_ref().unwrap().spec.as_ref().unwrap().template;
        assert_eq!(
            template.metadata.as_ref().unwrap().labels.as_ref().unwrap()[INSTANCE_LABEL],
            "gemma"
        );
        assert_eq!(spec["policyTypes"], json!(["Ingress"]));
        let port = json!([{"port": "http", "protocol": "TCP"}]);
        assert_eq!(
            spec["ingress"],
            json!([
                {"from": [{"podSelector": {"matchLabels": {"app": "gateway"}}},
                          {"ipBlock": {"cidr": "10.8.0.0/16", "except": ["10.8.1.0/24"]}}],
                 "ports": port},
                {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
                 "ports": port}
            ])
        );
        // The named port is the serving container's.
        let c = &d.deployment_container_ports();
        assert!(c.contains(&("http".to_string(), HTTP_PORT)), "{c:?}");
    }

    #[test]
    fn an_empty_peer_list_never_becomes_a_rule_that_admits_everyone() {
        let none = worker_network_policy("m", &[], &[]);
        // No rule at all: no ingress. (A rule without `from` would admit every source.)
        assert_eq!(none.ingress, Some(vec![]));
        assert_eq!(none.policy_types, Some(vec!["Ingress".to_string()]));
        let metrics = peers(json!([{"podSelector": {"matchLabels": {"app": "prometheus"}}}]));
        let only_metrics = worker_network_policy("m", &[], &metrics);
        let rules = only_metrics.ingress.unwrap();
        assert_eq!(rules.len(), 1);
        assert_eq!(rules[0].from.as_deref(), Some(&metrics[..]));
        let clients = peers(json!([{"namespaceSelector": {}}]));
        let rules = worker_network_policy("m", &clients, &[]).ingress.unwrap();
        assert_eq!(rules.len(), 1);
        assert_eq!(rules[0].from.as_deref(), Some(&clients[..]));
    }

    #[test]
    fn every_object_is_owned_by_the_inference_deployment_and_selected_by_its_label() {
        let obj = fixture(KVFLEET_RTX3090_TP2);
        let v = verdict("bfloat16", "KVFLEET_CUDA", "8.6", "NVIDIA-GeForce-RTX-3090");
        let m = MonitorKind {
            resource: ApiResource {
                group: "monitoring.coreos.com".into(),
                version: "v1".into(),
                api_version: "monitoring.coreos.com/v1".into(),
                kind: "ServiceMonitor".into(),
                plural: "servicemonitors".into(),
            },
            kind: "ServiceMonitor".into(),
        };
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
    fn user_resources_cannot_change_the_gpu_count() {
        let mut obj = fixture(VLLM_RTX5090);
        obj.spec.pod = Some(
            serde_json::from_value(serde_json::json!({
                "resources": {"limits": {"nvidia.com/gpu": "4", "memory": "64Gi"},
                              "requests": {"nvidia.com/gpu": "4", "cpu": "8"}}
            }))
            .unwrap(),
        );
        let v = verdict("fp8", "TRITON_ATTN", "12.0", "NVIDIA-GeForce-RTX-5090");
        let r = container(&desired(&obj, &v, &Settings::default(), None).unwrap())
            .resources
            .unwrap();
        assert_eq!(r.limits.as_ref().unwrap()["nvidia.com/gpu"], Quantity("1".into()));
        assert_eq!(r.limits.unwrap()["memory"], Quantity("64Gi".into()));
        assert_eq!(r.requests.unwrap()["nvidia.com/gpu"], Quantity("1".into()));
    }

    fn env_value(c: &Container, name: &str) -> Option<EnvVar> {
        c.env
            .clone()
            .unwrap_or_default()
            .into_iter()
            .find(|e| e.name == name)
    }

    #[test]
    fn vllm_downloads_hub_weights_with_the_token_secret_into_the_cache_pvc() {
        let yaml = VLLM_RTX5090.replace(
            "weights: {format: dummy}",
            "weights: {format: safetensors, huggingFace: {revision: v1, tokenSecretRef: {name: hf-token}, cachePvcName: hf-cache}}\n    weightBytes: 24Gi",
        );
        let v = verdict("fp8", "TRITON_ATTN", "12.0", "NVIDIA-GeForce-RTX-5090");
        let d = desired(&fixture(&yaml), &v, &Settings::default(), None).unwrap();
        let c = container(&d);
        let args = c.args.clone().unwrap();
        assert_eq!(
            arg_after(&args, "--model").as_deref(),
            Some("google/gemma-3-12b-it")
        );
        assert_eq!(arg_after(&args, "--revision").as_deref(), Some("v1"));
        assert_eq!(arg_after(&args, "--load-format"), None, "real weights: no dummy");
        let token = env_value(&c, "HF_TOKEN").expect("HF_TOKEN");
        let sel = token.value_from.unwrap().secret_key_ref.unwrap();
        assert_eq!((sel.name.as_str(), sel.key.as_str()), ("hf-token", "token"));
        assert_eq!(
            env_value(&c, "HF_HOME").unwrap().value.as_deref(),
            Some(HF_CACHE_DIR)
        );
        let mount = c
            .volume_mounts
            .clone()
            .unwrap()
            .into_iter()
            .find(|m| m.mount_path == HF_CACHE_DIR)
            .unwrap();
        assert_ne!(mount.read_only, Some(true), "the cache is written");
        let vol = pod(&d)
            .volumes
            .unwrap()
            .into_iter()
            .find(|v| v.name == mount.name)
            .unwrap();
        assert_eq!(vol.persistent_volume_claim.unwrap().claim_name, "hf-cache");
        // A Hub download of 24 GiB gets more than the 10 minutes of a dummy start.
        let probe = c.startup_probe.unwrap();
        assert_eq!(probe.http_get.unwrap().path.as_deref(), Some("/health"));
        let seconds = probe.failure_threshold.unwrap() * probe.period_seconds.unwrap();
        assert!(seconds >= 600 + 24 * 10, "{seconds}");
        assert_eq!(
            c.readiness_probe.unwrap().http_get.unwrap().path.as_deref(),
            Some("/health")
        );
    }

    #[test]
    fn vllm_loads_local_weights_from_a_pvc_host_path_or_image_volume_at_models() {
        let v = verdict("fp8", "TRITON_ATTN", "12.0", "NVIDIA-GeForce-RTX-5090");
        for (source, check) in [
            ("pvcName: w", "pvc"),
            ("hostPath: /mnt/nvme", "hostPath"),
            ("image: registry.example/weights/gemma:1", "image"),
        ] {
            let yaml = VLLM_RTX5090.replace(
                "weights: {format: dummy}",
                &format!("weights: {{format: safetensors, {source}, path: /gemma-3-12b/}}"),
            );
            let d = desired(&fixture(&yaml), &v, &Settings::default(), None).unwrap();
            let c = container(&d);
            let args = c.args.clone().unwrap();
            assert_eq!(
                arg_after(&args, "--model").as_deref(),
                Some("/models/gemma-3-12b"),
                "{source}"
            );
            assert_eq!(arg_after(&args, "--load-format"), None, "{source}");
            let vol = pod(&d)
                .volumes
                .unwrap()
                .into_iter()
                .find(|v| v.name == "weights")
                .unwrap();
            match check {
                "pvc" => assert_eq!(vol.persistent_volume_claim.unwrap().claim_name, "w"),
                "hostPath" => assert_eq!(vol.host_path.unwrap().path, "/mnt/nvme"),
                _ => assert_eq!(
                    vol.image.unwrap().reference.as_deref(),
                    Some("registry.example/weights/gemma:1")
                ),
            }
            assert!(env_value(&c, "HF_TOKEN").is_none());
        }
    }

    #[test]
    fn an_object_without_uid_cannot_own_anything() {
        let mut obj = fixture(VLLM_RTX5090);
        obj.metadata.uid = None;
        let err = desired(&obj, &Verdict::default(), &Settings::default(), None).unwrap_err();
        assert!(err.to_string().contains("uid"), "{err}");
    }

    #[test]
    fn a_replica_spanning_nodes_renders_a_leader_worker_set_with_vllms_multi_node_launch() {
        let mut obj = fixture(VLLM_RTX5090);
        obj.spec.replicas = 3;
        obj.spec.engine.tensor_parallel_size = 8;
        obj.spec.engine.pipeline_parallel_size = 2;
        let mut v = verdict("fp8", "FLASH_ATTN", "9.0", "NVIDIA-H100-80GB-HBM3");
        v.multi_node = Some(crate::validate::MultiNode {
            nodes_per_replica: 2,
            gpus_per_node: 8,
            most_gpus_on_a_node: 8,
        });
        let d = desired(&obj, &v, &Settings::default(), None).unwrap();
        assert!(d.deployment.is_none(), "no Deployment beside the LeaderWorkerSet");
        let lws = d.leader_worker_set.as_ref().expect("a LeaderWorkerSet");
        let value = serde_json::to_value(lws).unwrap();
        assert_eq!(value["apiVersion"], "leaderworkerset.x-k8s.io/v1");
        assert_eq!(value["kind"], "LeaderWorkerSet");
        assert_eq!(
            value["metadata"]["ownerReferences"][0]["kind"],
            "InferenceDeployment"
        );
        let spec = &value["spec"];
        assert_eq!(spec["replicas"], 3);
        let lwt = &spec["leaderWorkerTemplate"];
        assert_eq!(lwt["size"], 2);
        let args = |role: &str| -> Vec<String> {
            serde_json::from_value(lwt[role]["spec"]["containers"][0]["args"].clone()).unwrap()
        };
        let (leader, worker) = (args("leaderTemplate"), args("workerTemplate"));
        for a in [&leader, &worker] {
            assert_eq!(arg_after(a, "--tensor-parallel-size").as_deref(), Some("8"));
            assert_eq!(arg_after(a, "--pipeline-parallel-size").as_deref(), Some("2"));
            assert_eq!(arg_after(a, "--nnodes").as_deref(), Some("2"));
            assert_eq!(
                arg_after(a, "--master-addr").as_deref(),
                Some("$(LWS_LEADER_ADDRESS)")
            );
        }
        assert_eq!(arg_after(&leader, "--node-rank").as_deref(), Some("0"));
        assert!(!leader.contains(&"--headless".to_string()));
        assert_eq!(
            arg_after(&worker, "--node-rank").as_deref(),
            Some("$(KVFLEET_NODE_RANK)")
        );
        assert!(worker.contains(&"--headless".to_string()));
        // Every flag exists in the release rendered.
        let version = rendered_vllm_version(&obj.spec, &vllm_image(&obj.spec, &Settings::default()));
        for a in leader.iter().chain(&worker).filter(|a| a.starts_with("--")) {
            assert_ne!(
                vllm_versions::flag_at(a, version),
                Some(false),
                "{a} on {version}"
            );
        }
        // Each pod holds its node's share of the GPUs; only the leader serves and is probed.
        let pod = |role: &str| lwt[role]["spec"].clone();
        for role in ["leaderTemplate", "workerTemplate"] {
            assert_eq!(
                pod(role)["containers"][0]["resources"]["limits"]["nvidia.com/gpu"],
                "8"
            );
        }
        assert_eq!(pod("leaderTemplate")["containers"].as_array().unwrap().len(), 2);
        assert!(pod("leaderTemplate")["containers"][0]["readinessProbe"].is_object());
        assert_eq!(pod("workerTemplate")["containers"].as_array().unwrap().len(), 1);
        assert!(pod("workerTemplate")["containers"][0]["readinessProbe"].is_null());
        let env = pod("workerTemplate")["containers"][0]["env"].clone();
        assert!(
            env.as_array()
                .unwrap()
                .iter()
                .any(|e| e["name"] == "KVFLEET_NODE_RANK"
                    && e["valueFrom"]["fieldRef"]["fieldPath"]
                        == "metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']"),
            "{env}"
        );
        let sel = d.service.spec.as_ref().unwrap().selector.as_ref().unwrap();
        assert_eq!(sel.get(LWS_WORKER_INDEX_LABEL).map(String::as_str), Some("0"));
        // The same spec on one node is a Deployment, with no multi-node flag.
        v.multi_node = None;
        let d = desired(&obj, &v, &Settings::default(), None).unwrap();
        assert!(d.leader_worker_set.is_none());
        let c = container(&d);
        assert!(!c.args.unwrap().contains(&"--nnodes".to_string()));
    }
}
