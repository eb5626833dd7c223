//! Spec + cluster facts -> verdict (pure, no I/O).
//!
//! The single place where kvfleet decides whether an InferenceDeployment can run: the
//! webhook, the controller and `kvfleet check` all call [`validate`].
//!
//! How it decides:
//! 1. Checks what needs no node: tensorParallelSize against the model's heads and
//!    gpu.count, gpuMemoryUtilization risk, speculative decoding's settings (`spec.rs`,
//!    `weights.rs`, `speculative.rs`); which speculative method a runtime and vLLM release
//!    run is a compat rule (step 3).
//! 2. Keeps the nodes the spec's selectors could land on (`gpu.selector.products`,
//!    `gpu.selector.minComputeCapability`, `pod.nodeSelector`; cordoned and GPU-less nodes
//!    are left out) and reads their compute capability from the GFD labels
//!    (`compute.major/minor` first, else the product table). Nodes without GFD labels are
//!    never assumed compatible (`nodes.rs`, grouped by `signatures.rs`, the selectors as
//!    predicates in `selectors.rs`).
//! 3. Runs the runtime's rules ([`crate::compat::rules`]) once per compute capability and
//!    checks GPUs per node against GPUs per replica (`arch.rs`).
//! 4. Admits when at least one node can run it. When architectures resolve `auto`
//!    differently, the resolution held by the most nodes wins (ties: the newest
//!    architecture) and the node affinity keeps pods on the architectures that resolve to
//!    it, so every replica runs the same configuration (`admit.rs`, `capacity.rs`).
//! 5. Judges the declared products when no node matches (`scale_from_zero.rs`), and a
//!    replica that needs more GPUs than a node has as spanning nodes (`multi_node.rs`).
//! 6. Checks what the routing mode needs: the kvfleet runtime behind a kvfleet router, the
//!    InferencePool CRD behind an InferencePool (`routing.rs`).
//! 7. Checks what autoscaling needs: bounds that hold together, a router behind
//!    `minReplicas: 0`, workers that export the demand gauges, KEDA's ScaledObject CRD behind
//!    `engine: keda` (`autoscaling.rs`).
//!
//! # Order of denials
//!
//! A denied verdict lists every problem found, in one answer, most important first: a fix
//! to an earlier problem can change what a later one says (another KV dtype changes the
//! capacity, other nodes change both), never the reverse.
//! 1. Values outside the CRD schema's bounds (`ValueOutOfBounds`) and NetworkPolicy peers
//!    the API server would refuse (`InvalidNetworkPeer`): reported alone, since every other
//!    check assumes them (the API server refuses such an object before the webhook sees it).
//! 2. The spec on its own: the runtime's limits, weights, gpu.count, heads against
//!    tensorParallelSize, gpuMemoryUtilization, the vLLM release, minComputeCapability.
//! 3. Where it can run: no node matching the selectors, each rule an architecture breaks
//!    (KV dtype, attention backend, model features), GPUs per node.
//! 4. Whether it fits: a maxModelLen that no selected GPU holds (`KvCacheTooSmall`), judged
//!    with the requested kvCacheDtype even where (3) denied it.
//! 5. How it spreads and is reached: multi-node replicas, then routing.
//! 6. How it scales: `spec.autoscaling` (`autoscaling.rs`).

use k8s_openapi::api::core::v1::NodeAffinity;
use serde::Serialize;

use crate::api::{CapacityStatus, InferenceDeploymentSpec, ResolvedConfig};

mod admit;
mod arch;
mod autoscaling;
pub mod bounds;
mod capacity;
mod facts;
mod multi_node;
mod nodes;
mod routing;
mod scale_from_zero;
mod selectors;
mod signatures;
mod spec;
mod speculative;
mod weights;

#[cfg(test)]
mod engine_tests;
#[cfg(test)]
mod properties;
#[cfg(test)]
mod tests;

pub use arch::ArchReport;
pub use autoscaling::{
    scaled_object_missing, AUTOSCALING_NEEDS_KVFLEET_RUNTIME, INVALID_AUTOSCALING, SCALED_OBJECT_MISSING,
    SCALE_TO_ZERO_NEEDS_ROUTER,
};
pub use capacity::CapacityBasis;
pub use facts::{
    labels, product_memory_mib, synthetic_cluster, ClusterFacts, NodeFacts, ValidateError,
    GPU_MEMORY_MIB_MAX, SYNTHETIC_NODE_GPUS,
};
pub use multi_node::{multi_node_layout, MultiNode, INSUFFICIENT_NODES};
pub use routing::{inference_pool_missing, INFERENCE_POOL_MISSING, ROUTER_NEEDS_KVFLEET_RUNTIME};
pub use scale_from_zero::{declared_products, NO_MATCHING_NODES};
pub use spec::{GPU_MEMORY_UTILIZATION_SAFE, GPU_MEMORY_UTILIZATION_WARN};

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
///
/// `resolved`, `node_affinity` and `compatible_nodes` are set only when admitted.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
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
    /// Per compute capability of the selected nodes: what runs there and why not.
    pub architectures: Vec<ArchReport>,
    /// KV capacity of one replica predicted by the planner, on the compatible GPU with the
    /// least memory (pods may land on any compatible node). Absent when denied or when the
    /// geometry is not known here (model.config).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub capacity: Option<CapacityStatus>,
    /// What the capacity prediction is based on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub capacity_basis: Option<CapacityBasis>,
    /// Set when one replica needs more GPUs than one node of the pool has: it spans nodes
    /// and runs as a LeaderWorkerSet.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub multi_node: Option<MultiNode>,
}

impl Verdict {
    pub fn allowed(&self) -> bool {
        self.denials.is_empty()
    }

    /// Adds `denials` and drops what only an admitted verdict carries: resolution, affinity,
    /// nodes, capacity and the multi-node layout.
    fn deny(&mut self, denials: Vec<Denial>) {
        self.denials.extend(denials);
        self.resolved = None;
        self.node_affinity = None;
        self.compatible_nodes.clear();
        self.capacity = None;
        self.capacity_basis = None;
        self.multi_node = None;
    }
}

/// Validates against one synthetic node per product (8 GPUs each), as `kvfleet check --gpu`.
pub fn validate_offline(spec: &InferenceDeploymentSpec, products: &[&str]) -> Result<Verdict, ValidateError> {
    Ok(validate(spec, &synthetic_cluster(products)?))
}

/// Decides whether `spec` can run on `facts`, with every problem found (see the module's
/// "Order of denials").
///
/// When no node matches the selectors right now (a GPU pool scaled to zero by Karpenter or
/// the cluster-autoscaler), the spec is judged against what its selector declares: one
/// node of each selected product (or, with only `minComputeCapability`, of each known
/// product at or above it), admitted with a warning that pods stay Pending until such a
/// node joins; the controller re-validates when one does.
pub fn validate(spec: &InferenceDeploymentSpec, facts: &ClusterFacts) -> Verdict {
    // Bounds first: nothing below may loop or allocate on a value over its bound.
    let out_of_bounds = bounds::check(spec);
    if !out_of_bounds.is_empty() {
        return Verdict {
            denials: out_of_bounds,
            ..Verdict::default()
        };
    }
    let on_nodes = validate_nodes(spec, facts);
    let judged = scale_from_zero::scale_from_zero(spec, on_nodes, validate_nodes);
    let mut judged = multi_node::multi_node_checks(spec, facts, judged);
    // A routing denial leaves nothing to render; an autoscaling one keeps what was resolved
    // (those problems are about scaling, not about whether a replica runs).
    let routing = routing::denials(spec, facts);
    if !routing.is_empty() {
        judged.deny(routing);
    }
    judged.denials.extend(autoscaling::denials(spec, facts));
    judged
}

/// [`validate`] against the nodes only.
fn validate_nodes(spec: &InferenceDeploymentSpec, facts: &ClusterFacts) -> Verdict {
    let mut denials = Vec::new();
    let mut warnings = Vec::new();
    let features = spec::model_features(spec, &mut warnings);
    spec::spec_checks(spec, &mut denials, &mut warnings);
    let vllm_version = spec::vllm_version_check(spec, &mut denials, &mut warnings);
    let min_cc = nodes::min_compute_capability(spec, &mut denials);
    // GPUs one pod needs: the replica's, or its share on each node when it spans nodes.
    let gpus_per_pod = multi_node::gpus_per_pod(spec, facts);

    let pool = nodes::Pool::gather(spec, facts, min_cc, gpus_per_pod, &mut warnings);
    let archs = arch::evaluate(spec, &features, vllm_version, &pool, &mut warnings);
    let runnable = arch::runnable(&archs);
    if pool.selected == 0 {
        denials.push(nodes::no_matching_nodes(spec, facts, &pool));
    } else if runnable.is_empty() {
        denials.extend(arch::unrunnable_denials(&archs, &pool, gpus_per_pod));
    }

    let verdict = Verdict {
        denials,
        warnings,
        architectures: archs.clone(),
        ..Verdict::default()
    };
    // Spec checks that denied do not stop the capacity check: a spec with two problems
    // gets one denial naming both. Where nothing runs, a maxModelLen that no selected GPU
    // holds is still a problem of its own.
    if runnable.is_empty() {
        let mut verdict = verdict;
        verdict.denials.extend(capacity::too_small_anywhere(spec, &pool));
        return verdict;
    }
    admit::admit(spec, verdict, &archs, &runnable, &pool, gpus_per_pod)
}

fn denial(field: &str, reason: &str, message: String) -> Denial {
    Denial {
        field: field.to_string(),
        reason: reason.to_string(),
        message,
    }
}

fn plural(n: usize, one: &str, many: &str) -> String {
    if n == 1 {
        format!("{n} {one}")
    } else {
        format!("{n} {many}")
    }
}
