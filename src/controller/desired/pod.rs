//! The pod template of the serving pods, shared by the Deployment and the LeaderWorkerSet:
//! its metadata, volumes, scheduling (GPU affinity, node selector, tolerations) and pod
//! security context. The containers come from `container.rs`.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, EmptyDirVolumeSource, HostPathVolumeSource, ImageVolumeSource,
    PersistentVolumeClaimVolumeSource, PodSecurityContext, PodSpec, PodTemplateSpec, SeccompProfile,
    Toleration, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::container::{capacity_sidecar, mount, serving_container, DRAFT_WEIGHTS_DIR, WEIGHTS_DIR};
use super::{vllm, worker, worker_service_account_name, Owner, Settings, CONFIG_HASH_ANNOTATION};
use crate::api::{AttentionBackend, InferenceDeploymentSpec, PodOverrides, Runtime};
use crate::validate::{labels as gfd, Verdict};

/// Non-root UID/GID the pods run as.
pub const RUN_AS_USER: i64 = 65532;
/// Seconds from the preStop hook to SIGKILL: the preStop sleep, the worker's drain (20 s by
/// default: running requests finish, the rest end with an error) and closing the server.
pub const TERMINATION_GRACE_SECONDS: i64 = 60;

/// The serving pod: the serving container (and vLLM's capacity sidecar) on the volumes of
/// [`volumes`], scheduled onto the nodes the verdict admitted. `config_hash` becomes the
/// [`CONFIG_HASH_ANNOTATION`].
pub(super) fn pod_template(
    owner: &Owner,
    spec: &InferenceDeploymentSpec,
    verdict: &Verdict,
    settings: &Settings,
    config_hash: Option<String>,
) -> PodTemplateSpec {
    let runtime = spec.engine.runtime;
    let overrides = spec.pod.clone().unwrap_or_default();
    let cpu_only = runs_on_cpu(spec, verdict);
    let (volumes, mounts): (Vec<Volume>, Vec<VolumeMount>) = volumes(&owner.name, spec).into_iter().unzip();
    let process = match runtime {
        Runtime::Kvfleet => worker::serving_process(spec, verdict, settings),
        Runtime::Vllm => vllm::serving_process(spec, verdict, settings),
    };
    let serving = serving_container(spec, &overrides, process, mounts, cpu_only);
    let sidecar = (runtime == Runtime::Vllm).then(|| capacity_sidecar(settings));

    PodTemplateSpec {
        metadata: Some(pod_metadata(&owner.labels, &overrides, config_hash)),
        spec: Some(PodSpec {
            containers: std::iter::once(serving).chain(sidecar).collect(),
            service_account_name: Some(worker_service_account_name(&owner.name)),
            automount_service_account_token: Some(true),
            affinity: gpu_affinity(verdict),
            node_selector: (!overrides.node_selector.is_empty()).then(|| overrides.node_selector.clone()),
            tolerations: tolerations(&overrides, cpu_only),
            volumes: Some(volumes),
            security_context: Some(pod_security_context()),
            termination_grace_period_seconds: Some(TERMINATION_GRACE_SECONDS),
            ..PodSpec::default()
        }),
    }
}

/// Whether the resolved backend runs on CPU: then the pod asks for no GPU and tolerates no
/// GPU taint.
fn runs_on_cpu(spec: &InferenceDeploymentSpec, verdict: &Verdict) -> bool {
    let (_, backend) = super::resolved(spec, verdict);
    backend == AttentionBackend::KvfleetCpu
}

/// Our labels, and the spec's annotations with the worker config's hash.
fn pod_metadata(
    labels: &BTreeMap<String, String>,
    overrides: &PodOverrides,
    config_hash: Option<String>,
) -> ObjectMeta {
    let mut annotations = overrides.annotations.clone();
    if let Some(h) = config_hash {
        annotations.insert(CONFIG_HASH_ANNOTATION.into(), h);
    }
    ObjectMeta {
        labels: Some(labels.clone()),
        annotations: (!annotations.is_empty()).then_some(annotations),
        ..ObjectMeta::default()
    }
}

// === volumes ===

/// Every volume of the pod of `name`, each with the serving container's mount of it: scratch
/// space, the worker's configuration (kvfleet), the weights, the speculative drafter and the
/// Hub cache (vLLM).
pub(super) fn volumes(name: &str, spec: &InferenceDeploymentSpec) -> Vec<(Volume, VolumeMount)> {
    let runtime = spec.engine.runtime;
    let mut volumes = scratch_volumes();
    if runtime == Runtime::Kvfleet {
        volumes.extend(worker::config_volumes(name, spec));
    }
    volumes.extend(weights_volume(spec));
    volumes.extend(draft_weights_volume(spec));
    if runtime == Runtime::Vllm {
        volumes.extend(vllm::hf_cache_volume(spec));
    }
    volumes
}

/// A writable `/tmp` (the root filesystem is read-only) and a larger `/dev/shm`.
fn scratch_volumes() -> Vec<(Volume, VolumeMount)> {
    vec![
        (
            Volume {
                name: "tmp".into(),
                empty_dir: Some(EmptyDirVolumeSource::default()),
                ..Volume::default()
            },
            mount("tmp", "/tmp", None),
        ),
        // NCCL and PyTorch use /dev/shm between tensor-parallel ranks; the default 64 MiB is too small.
        (
            Volume {
                name: "dshm".into(),
                empty_dir: Some(EmptyDirVolumeSource {
                    medium: Some("Memory".into()),
                    ..EmptyDirVolumeSource::default()
                }),
                ..Volume::default()
            },
            mount("dshm", "/dev/shm", None),
        ),
    ]
}

/// The weights, read-only at [`WEIGHTS_DIR`], from the first source set of a PVC, a host path
/// and an image; `None` without any (dummy weights or a Hub download).
fn weights_volume(spec: &InferenceDeploymentSpec) -> Option<(Volume, VolumeMount)> {
    let w = spec.model.weights.as_ref()?;
    source_volume("weights", WEIGHTS_DIR, (&w.pvc_name, &w.host_path, &w.image))
}

/// The speculative drafter's checkpoint, read-only at [`DRAFT_WEIGHTS_DIR`], as the weights
/// (both runtimes: vLLM and the kvfleet worker read the drafter there).
fn draft_weights_volume(spec: &InferenceDeploymentSpec) -> Option<(Volume, VolumeMount)> {
    let d = spec.engine.speculative.as_ref()?.draft_model.as_ref()?;
    source_volume(
        "draft-weights",
        DRAFT_WEIGHTS_DIR,
        (&d.pvc_name, &d.host_path, &d.image),
    )
}

/// The `(pvcName, hostPath, image)` fields the weights and the drafter both have.
type VolumeSources<'a> = (&'a Option<String>, &'a Option<String>, &'a Option<String>);

/// A read-only volume `name` at `dir` from the first of a PVC, a host path and an image.
fn source_volume(
    name: &str,
    dir: &str,
    (pvc, host_path, image): VolumeSources<'_>,
) -> Option<(Volume, VolumeMount)> {
    let volume = match (pvc.clone(), host_path.clone()) {
        (Some(pvc), _) => Volume {
            name: name.into(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: pvc,
                read_only: Some(true),
            }),
            ..Volume::default()
        },
        (None, Some(path)) => Volume {
            name: name.into(),
            host_path: Some(HostPathVolumeSource {
                path,
                type_: Some("Directory".into()),
            }),
            ..Volume::default()
        },
        (None, None) => Volume {
            name: name.into(),
            image: Some(ImageVolumeSource {
                reference: Some(image.clone()?),
                pull_policy: Some("IfNotPresent".into()),
            }),
            ..Volume::default()
        },
    };
    Some((volume, mount(name, dir, Some(true))))
}

// === scheduling and security ===

/// The verdict's node affinity: the nodes whose GPUs admitted the spec.
fn gpu_affinity(verdict: &Verdict) -> Option<Affinity> {
    verdict.node_affinity.clone().map(|na| Affinity {
        node_affinity: Some(na),
        ..Affinity::default()
    })
}

fn tolerations(overrides: &PodOverrides, cpu_only: bool) -> Option<Vec<Toleration>> {
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
    (!tolerations.is_empty()).then_some(tolerations)
}

/// Non-root as [`RUN_AS_USER`] under the RuntimeDefault seccomp profile (the restricted Pod
/// Security Standard).
pub(super) fn pod_security_context() -> PodSecurityContext {
    PodSecurityContext {
        run_as_non_root: Some(true),
        run_as_user: Some(RUN_AS_USER),
        run_as_group: Some(RUN_AS_USER),
        fs_group: Some(RUN_AS_USER),
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".into(),
            ..SeccompProfile::default()
        }),
        ..PodSecurityContext::default()
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    use super::super::desired;
    use super::super::fixtures::*;
    use super::*;

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
}
