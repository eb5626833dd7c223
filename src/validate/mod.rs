//! Spec + cluster facts -> verdict (pure, no I/O).
//!
//! The single place where kvfleet decides whether an InferenceDeployment can run: the
//! webhook, the controller and `kvfleet check` all call [`validate`].

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, NodeAffinity};
use serde::Serialize;

use crate::api::{InferenceDeploymentSpec, ResolvedConfig};

/// GFD label keys (NVIDIA k8s-device-plugin, docs/gpu-feature-discovery/README.md).
pub mod labels {
    pub const PRODUCT: &str = "nvidia.com/gpu.product";
    pub const COMPUTE_MAJOR: &str = "nvidia.com/gpu.compute.major";
    pub const COMPUTE_MINOR: &str = "nvidia.com/gpu.compute.minor";
    pub const MEMORY_MIB: &str = "nvidia.com/gpu.memory";
    pub const COUNT: &str = "nvidia.com/gpu.count";
    pub const FAMILY: &str = "nvidia.com/gpu.family";
    /// Extended resource name of NVIDIA GPUs.
    pub const GPU_RESOURCE: &str = "nvidia.com/gpu";
}

/// What validation knows about one node: its labels and allocatable GPUs.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct NodeFacts {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    /// Allocatable `nvidia.com/gpu`; `None` when the node does not advertise GPUs.
    pub allocatable_gpus: Option<i64>,
    /// `spec.unschedulable` (cordoned).
    pub unschedulable: bool,
}

impl NodeFacts {
    /// Extracts the facts validation needs from a Node object.
    pub fn from_node(node: &Node) -> Self {
        let allocatable_gpus = node
            .status
            .as_ref()
            .and_then(|s| s.allocatable.as_ref())
            .and_then(|a| a.get(labels::GPU_RESOURCE))
            .and_then(|q| q.0.trim().parse::<i64>().ok());
        NodeFacts {
            name: node.metadata.name.clone().unwrap_or_default(),
            labels: node.metadata.labels.clone().unwrap_or_default(),
            allocatable_gpus,
            unschedulable: node.spec.as_ref().and_then(|s| s.unschedulable).unwrap_or(false),
        }
    }
}

/// The cluster as validation sees it.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ClusterFacts {
    pub nodes: Vec<NodeFacts>,
}

/// One reason to deny, with the field at fault and a message that names the fix.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Denial {
    /// JSON path of the offending field, e.g. `spec.engine.kvCacheDtype`.
    pub field: String,
    /// PascalCase reason for events, conditions and metrics, e.g. `UnsupportedKvDtype`.
    pub reason: String,
    /// What is wrong and what to do instead.
    pub message: String,
}

/// The outcome of validating a spec against the cluster.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Verdict {
    /// Empty when admitted.
    pub denials: Vec<Denial>,
    /// Admitted with caveats (printed by kubectl as warnings).
    pub warnings: Vec<String>,
    /// The configuration after resolving `auto` on the nodes that can run it.
    pub resolved: Option<ResolvedConfig>,
    /// Keeps pods on the nodes that can run the configuration.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node_affinity: Option<NodeAffinity>,
    /// Names of the nodes that can run it.
    pub compatible_nodes: Vec<String>,
}

impl Verdict {
    pub fn allowed(&self) -> bool {
        self.denials.is_empty()
    }
}

/// Decides whether `spec` can run on `facts`.
pub fn validate(_spec: &InferenceDeploymentSpec, _facts: &ClusterFacts) -> Verdict {
    // Replaced by the compat issue's rule engine; until then nothing is admitted.
    Verdict {
        denials: vec![Denial {
            field: "spec".into(),
            reason: "ValidationUnavailable".into(),
            message: "this build has no compatibility rules yet".into(),
        }],
        ..Verdict::default()
    }
}
