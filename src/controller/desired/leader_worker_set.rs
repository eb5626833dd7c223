//! The LeaderWorkerSet (kubernetes-sigs/lws) of replicas that span nodes: one group of a
//! leader and workers per replica, each pod running vLLM's multi-node launch.

use k8s_openapi::api::core::v1::{Container, PodTemplateSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{ApiResource, DynamicObject};
use serde_json::json;

use super::container::{field_env, set_gpu_count};
use super::Owner;
use crate::api::InferenceDeploymentSpec;
use crate::validate::MultiNode;

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

pub(super) fn leader_worker_set(
    owner: &Owner,
    spec: &InferenceDeploymentSpec,
    template: &PodTemplateSpec,
    layout: &MultiNode,
) -> DynamicObject {
    let mut lws = DynamicObject::new(&owner.name, &leader_worker_set_resource()).within(&owner.namespace);
    lws.metadata = owner.meta(owner.name.clone());
    lws.data = leader_worker_set_spec(spec, template, layout);
    lws
}

/// vLLM's multi-node flags for a pod of a group (vllm#23691; `MULTI_NODE` in
/// compat/vllm_versions.rs says from which release): the leader is node rank 0 and serves the
/// API; the workers take their rank from the LWS label and run `--headless`.
pub fn multi_node_args(layout: &MultiNode, leader: bool) -> Vec<String> {
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
    layout: &MultiNode,
) -> serde_json::Value {
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
                "leaderTemplate": role_template(template, layout, true),
                "workerTemplate": role_template(template, layout, false)
            }
        }
    })
}

/// The pod template of the leader or of the workers: the single-node template with the
/// multi-node flags and the node's share of the GPUs.
fn role_template(template: &PodTemplateSpec, layout: &MultiNode, leader: bool) -> serde_json::Value {
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
                make_headless(c);
            }
            set_gpu_count(
                c.resources.get_or_insert_with(Default::default),
                Quantity(layout.gpus_per_node.to_string()),
            );
        }
    }
    serde_json::to_value(t).unwrap_or_default()
}

/// A worker of a group: no port, probes or preStop sleep (it serves nothing), and its node
/// rank from the LWS label.
fn make_headless(c: &mut Container) {
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

#[cfg(test)]
mod tests {
    use super::super::fixtures::*;
    use super::super::{desired, rendered_vllm_version, vllm_image, Settings};
    use super::*;
    use crate::compat::vllm_versions;

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
