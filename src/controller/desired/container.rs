//! The containers of a serving pod: the serving container (the kvfleet worker or vLLM, whose
//! differences come from `worker.rs` and `vllm.rs`) with its port, environment, resources,
//! probes and preStop sleep; vLLM's capacity sidecar; and the small builders they share.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, EnvVar, EnvVarSource, HTTPGetAction, Lifecycle, LifecycleHandler,
    ObjectFieldSelector, Probe, ResourceRequirements, SecretKeySelector, SecurityContext, SleepAction,
    VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::{Settings, HTTP_PORT};
use crate::api::{InferenceDeploymentSpec, PodOverrides, Runtime};
use crate::plan::memory::parse_quantity_bytes;
use crate::validate::labels as gfd;

/// Seconds a terminating pod keeps serving before SIGTERM (its preStop sleep), so that the
/// endpoint controllers and proxies stop routing to it first.
pub const PRE_STOP_SECONDS: i64 = 5;

/// Where the weights volume is mounted.
pub(super) const WEIGHTS_DIR: &str = "/models";
/// Where the speculative drafter's volume is mounted (`engine.speculative.draftModel`).
pub(super) const DRAFT_WEIGHTS_DIR: &str = "/draft-models";

/// A volume mount of the serving pod.
pub(super) fn mount(name: &str, path: &str, read_only: Option<bool>) -> VolumeMount {
    VolumeMount {
        name: name.into(),
        mount_path: path.into(),
        read_only,
        ..VolumeMount::default()
    }
}

/// Name of the container that publishes vLLM's measured KV capacity.
pub const CAPACITY_SIDECAR: &str = "kv-capacity";
/// Period of the startup probe in seconds.
pub const STARTUP_PROBE_PERIOD_S: i32 = 10;

/// What differs between the runtimes' serving containers.
pub(super) struct ServingProcess {
    pub image: String,
    pub command: Vec<String>,
    pub args: Vec<String>,
    /// Variables after the common ones (the pod's identity, `HOME`, the API key).
    pub env: Vec<EnvVar>,
    /// Path of the readiness probe.
    pub ready_path: &'static str,
    /// Path of the liveness and startup probes.
    pub live_path: &'static str,
}

/// The API port, and the KV-event publisher's when `engine.kvEvents` is on.
fn serving_ports(spec: &InferenceDeploymentSpec) -> Vec<ContainerPort> {
    let mut ports = vec![ContainerPort {
        name: Some("http".into()),
        container_port: HTTP_PORT,
        protocol: Some("TCP".into()),
        ..ContainerPort::default()
    }];
    if let Some(k) = spec.engine.kv_events.as_ref().filter(|k| k.enabled) {
        ports.push(ContainerPort {
            name: Some(super::network_policy::KV_EVENTS_PORT_NAME.into()),
            container_port: k.port,
            protocol: Some("TCP".into()),
            ..ContainerPort::default()
        });
    }
    ports
}

/// The container that serves the API, mounting `mounts`; with `cpu_only` it asks for no GPU.
pub(super) fn serving_container(
    spec: &InferenceDeploymentSpec,
    overrides: &PodOverrides,
    process: ServingProcess,
    mounts: Vec<VolumeMount>,
    cpu_only: bool,
) -> Container {
    Container {
        name: spec.engine.runtime.as_str().into(),
        image: Some(process.image),
        command: Some(process.command),
        args: Some(process.args),
        ports: Some(serving_ports(spec)),
        env: Some(serving_env(spec, process.env, overrides)),
        resources: Some(serving_resources(spec, overrides, cpu_only)),
        volume_mounts: Some(mounts),
        readiness_probe: Some(http_probe(process.ready_path, 10, 3)),
        liveness_probe: Some(http_probe(process.live_path, 10, 3)),
        // Loading weights and sizing the KV pool can take many minutes; a Hub download of a
        // large checkpoint longer still (see startup_probe_failures).
        startup_probe: Some(http_probe(
            process.live_path,
            STARTUP_PROBE_PERIOD_S,
            startup_probe_failures(spec),
        )),
        lifecycle: Some(pre_stop_sleep()),
        security_context: Some(restricted_container()),
        ..Container::default()
    }
}

/// The pod's identity, `HOME` on the writable `/tmp`, the API key, then the runtime's own
/// variables and last the spec's `pod.env`.
fn serving_env(
    spec: &InferenceDeploymentSpec,
    runtime_env: Vec<EnvVar>,
    overrides: &PodOverrides,
) -> Vec<EnvVar> {
    let mut env = vec![
        field_env("POD_NAME", "metadata.name"),
        field_env("POD_NAMESPACE", "metadata.namespace"),
        plain_env("HOME", "/tmp"),
    ];
    if let Some(key) = &spec.api_key {
        // Each server's own variable for the key of its OpenAI API.
        let var = match spec.engine.runtime {
            Runtime::Kvfleet => "KVFLEET_API_KEY",
            Runtime::Vllm => "VLLM_API_KEY",
        };
        env.push(secret_env(var, &key.secret_name, &key.key));
    }
    env.extend(runtime_env);
    env.extend(overrides.env.iter().cloned());
    env
}

/// The spec's `pod.resources` with the GPUs of a replica, which they cannot change.
fn serving_resources(
    spec: &InferenceDeploymentSpec,
    overrides: &PodOverrides,
    cpu_only: bool,
) -> ResourceRequirements {
    let mut resources = overrides.resources.clone().unwrap_or_default();
    if !cpu_only {
        set_gpu_count(&mut resources, Quantity(spec.gpus_per_replica().to_string()));
    }
    resources
}

/// Sets the `nvidia.com/gpu` limit, and the request when there are requests.
pub(super) fn set_gpu_count(resources: &mut ResourceRequirements, gpus: Quantity) {
    resources
        .limits
        .get_or_insert_with(BTreeMap::new)
        .insert(gfd::GPU_RESOURCE.into(), gpus.clone());
    // Extended resources need request == limit; set both so overrides cannot disagree.
    if let Some(req) = resources.requests.as_mut() {
        req.insert(gfd::GPU_RESOURCE.into(), gpus);
    }
}

pub(super) fn http_probe(path: &str, period: i32, failures: i32) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.into()),
            port: IntOrString::String("http".into()),
            ..HTTPGetAction::default()
        }),
        period_seconds: Some(period),
        failure_threshold: Some(failures),
        timeout_seconds: Some(5),
        ..Probe::default()
    }
}

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

pub(super) fn pre_stop_sleep() -> Lifecycle {
    Lifecycle {
        pre_stop: Some(LifecycleHandler {
            sleep: Some(SleepAction {
                seconds: PRE_STOP_SECONDS,
            }),
            ..LifecycleHandler::default()
        }),
        ..Lifecycle::default()
    }
}

/// What the restricted Pod Security Standard asks of every container we render: no privilege
/// escalation, no capabilities, non-root, and a read-only root filesystem.
pub(super) fn restricted_container() -> SecurityContext {
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

/// `kvfleet capacity-sidecar` beside vLLM: reads `localhost:8000/metrics` and annotates the pod
/// (the kvfleet image, a few MiB of memory, no GPU).
pub(super) fn capacity_sidecar(settings: &Settings) -> Container {
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

// === environment variables ===

pub(super) fn plain_env(name: &str, value: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: Some(value.into()),
        ..EnvVar::default()
    }
}

/// A variable read from `key` of Secret `secret` (required: the pod waits for it), so that
/// the value never appears in the pod spec.
pub(super) fn secret_env(name: &str, secret: &str, key: &str) -> EnvVar {
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

/// A variable read from the pod's own `path` (downward API).
pub(super) fn field_env(name: &str, path: &str) -> EnvVar {
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

#[cfg(test)]
mod tests {
    use super::super::fixtures::*;
    use super::super::{desired, Desired};
    use super::*;

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
}
