//! What validation knows of the cluster: nodes by their GFD labels and allocatable GPUs,
//! and the synthetic nodes `kvfleet check --gpu` and scale-from-zero judge against.

use std::collections::BTreeMap;
use std::ops::Bound;

use k8s_openapi::api::core::v1::Node;
use serde::Serialize;

use crate::compat::{products, ComputeCapability};

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

/// The most memory one GPU can have in MiB, as GFD's `nvidia.com/gpu.memory` label gives
/// it: 4 TiB, fourteen times the largest GPU sold (B300, 288 GB). A larger value is a
/// mislabel, and its bytes could overflow (17592186044416 MiB is 2^64 bytes).
pub const GPU_MEMORY_MIB_MAX: u64 = 4 << 20;

/// GPUs of a node made up by [`super::validate_offline`] / `kvfleet check --gpu`.
pub const SYNTHETIC_NODE_GPUS: i64 = 8;

/// Memory of one GPU of a product in MiB, the one figure `kvfleet check --gpu`, nodes
/// without a `nvidia.com/gpu.memory` label and scale-from-zero admission all use: what GFD
/// labels such a node with (the planner's table of reported totals, e.g. 23034 for an L4),
/// else the product's nominal size.
pub fn product_memory_mib(label: &str) -> Option<u64> {
    const MIB: u64 = 1024 * 1024;
    crate::plan::gpu_memory_bytes(products::base_label(label))
        .map(|b| b / MIB)
        .or_else(|| products::lookup(label).map(|p| p.memory_mib))
}

/// What validation knows about one node: its labels and allocatable GPUs.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
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

    /// A node of one GPU product with the labels GFD would give it and `gpus` GPUs.
    pub fn synthetic(name: impl Into<String>, product: &products::Product, gpus: i64) -> Self {
        let labels = [
            (labels::PRODUCT, product.label.to_string()),
            (labels::COMPUTE_MAJOR, product.cc.major.to_string()),
            (labels::COMPUTE_MINOR, product.cc.minor.to_string()),
            (
                labels::MEMORY_MIB,
                product_memory_mib(product.label)
                    .unwrap_or(product.memory_mib)
                    .to_string(),
            ),
            (labels::COUNT, gpus.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        NodeFacts {
            name: name.into(),
            labels,
            allocatable_gpus: Some(gpus),
            unschedulable: false,
        }
    }

    /// The raw `nvidia.com/gpu.product` value.
    pub fn product(&self) -> Option<&str> {
        self.labels
            .get(labels::PRODUCT)
            .map(|s| s.as_str())
            .filter(|s| !s.trim().is_empty())
    }

    /// The compute capability from `compute.major/minor`, else from the product table.
    pub fn compute_capability(&self) -> Option<ComputeCapability> {
        self.labelled_compute_capability()
            .or_else(|| self.product().and_then(products::lookup).map(|p| p.cc))
    }

    /// The compute capability of the `compute.major/minor` labels alone.
    pub(super) fn labelled_compute_capability(&self) -> Option<ComputeCapability> {
        let major = self.labels.get(labels::COMPUTE_MAJOR)?;
        let minor = self.labels.get(labels::COMPUTE_MINOR)?;
        ComputeCapability::from_labels(major, minor).ok()
    }

    /// GPUs the scheduler can hand out: allocatable, else the GFD count label.
    pub fn gpus(&self) -> Option<i64> {
        self.allocatable_gpus.or_else(|| {
            self.labels
                .get(labels::COUNT)
                .and_then(|c| c.trim().parse::<i64>().ok())
        })
    }

    /// Memory of one GPU in bytes: the GFD `nvidia.com/gpu.memory` label (MiB), else (the
    /// label absent or not a memory, see [`Self::unreadable_gpu_memory`]) the planner's or the
    /// product table's figure for the product.
    pub fn gpu_memory_bytes(&self) -> Option<u64> {
        const MIB: u64 = 1024 * 1024;
        self.labelled_gpu_memory_mib()
            .or_else(|| product_memory_mib(self.product()?))
            .and_then(|m| m.checked_mul(MIB))
    }

    /// The `nvidia.com/gpu.memory` label as MiB of one GPU, when it is one (1 to
    /// [`GPU_MEMORY_MIB_MAX`]).
    fn labelled_gpu_memory_mib(&self) -> Option<u64> {
        self.labels
            .get(labels::MEMORY_MIB)
            .and_then(|m| m.trim().parse::<u64>().ok())
            .filter(|m| (1..=GPU_MEMORY_MIB_MAX).contains(m))
    }

    /// The `nvidia.com/gpu.memory` value, when the node has one that is not a GPU memory in
    /// MiB (it is then ignored).
    pub fn unreadable_gpu_memory(&self) -> Option<&str> {
        let value = self.labels.get(labels::MEMORY_MIB)?;
        self.labelled_gpu_memory_mib().is_none().then_some(value.as_str())
    }

    /// Whether any `nvidia.com/gpu.*` label is set.
    pub(super) fn has_gfd_labels(&self) -> bool {
        // Keys are sorted: if any starts with the prefix, the first key at or after it does.
        const PREFIX: &str = "nvidia.com/gpu.";
        self.labels
            .range::<str, _>((Bound::Included(PREFIX), Bound::Unbounded))
            .next()
            .is_some_and(|(k, _)| k.starts_with(PREFIX))
    }

    /// A node validation looks at: it advertises GPUs or carries GFD labels.
    pub(super) fn is_gpu_node(&self) -> bool {
        self.gpus().is_some_and(|g| g > 0) || self.has_gfd_labels()
    }
}

/// The cluster as validation sees it.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterFacts {
    pub nodes: Vec<NodeFacts>,
    /// Whether the API server serves InferencePools (inference.networking.k8s.io/v1, the
    /// Gateway API Inference Extension CRD). `None`: not known (`kvfleet check`, or not asked
    /// because the spec does not route through one), and then not judged.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inference_pool_served: Option<bool>,
    /// Whether the API server serves KEDA's ScaledObjects (keda.sh/v1alpha1). `None`: not
    /// known (or not asked because the spec does not scale through KEDA), and then not judged.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scaled_object_served: Option<bool>,
}

/// Errors of offline validation input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValidateError {
    #[error("unknown GPU product {product:?}; use a GFD nvidia.com/gpu.product value such as {examples}")]
    UnknownProduct { product: String, examples: String },
}

/// One synthetic node per product label (see [`NodeFacts::synthetic`]).
pub fn synthetic_cluster(labels: &[&str]) -> Result<ClusterFacts, ValidateError> {
    let mut nodes = Vec::new();
    for (i, label) in labels.iter().enumerate() {
        let product = products::lookup(label).ok_or_else(|| ValidateError::UnknownProduct {
            product: label.to_string(),
            examples:
                "NVIDIA-H100-80GB-HBM3, NVIDIA-B200, NVIDIA-GeForce-RTX-3090, Tesla-T4 (see docs/compat.md)"
                    .to_string(),
        })?;
        let mut node = NodeFacts::synthetic(
            format!("gpu-{i}-{}", product.label.to_ascii_lowercase()),
            product,
            SYNTHETIC_NODE_GPUS,
        );
        // Keep the spelling the user gave (e.g. a -SHARED suffix), as GFD would.
        node.labels
            .insert(labels::PRODUCT.to_string(), label.trim().to_string());
        nodes.push(node);
    }
    Ok(ClusterFacts {
        nodes,
        ..ClusterFacts::default()
    })
}
