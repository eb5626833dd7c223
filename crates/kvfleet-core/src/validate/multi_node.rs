//! Replicas that need more GPUs than one node has span nodes (vLLM multi-node: a leader
//! and workers, run as a LeaderWorkerSet).

use serde::Serialize;

use super::selectors::{gpu_selector_matches, node_selector_matches};
use super::{denial, ClusterFacts, Denial, Verdict};
use crate::api::{InferenceDeploymentSpec, Runtime};
use crate::compat::{vllm_versions, ComputeCapability};

/// How one replica spreads over nodes (vLLM multi-node: a leader and workers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct MultiNode {
    /// Pods, each on its own node, of one replica: the leader (node rank 0) and workers.
    pub nodes_per_replica: i64,
    /// GPUs of each of those pods (GPUs per replica / nodes per replica).
    pub gpus_per_node: i64,
    /// The most GPUs a selected node has (GFD `nvidia.com/gpu.count`, or allocatable).
    pub most_gpus_on_a_node: i64,
}

/// Reason of the denial when the pool has fewer nodes than multi-node replicas need.
pub const INSUFFICIENT_NODES: &str = "InsufficientNodesForMultiNode";

/// How one replica of `spec` spreads over the nodes of `facts`: `None` when one selected node
/// has the GPUs of a whole replica (or the runtime is kvfleet, or no node is selected: then
/// validation judges it as one node). Otherwise the replica spans the fewest nodes, each with
/// the same share of its GPUs (vLLM needs the world size to divide evenly over nodes), no
/// share above the most GPUs a selected node has.
pub fn multi_node_layout(spec: &InferenceDeploymentSpec, facts: &ClusterFacts) -> Option<MultiNode> {
    if spec.engine.runtime != Runtime::Vllm {
        return None;
    }
    let total = i64::from(spec.gpus_per_replica());
    if total <= 1 {
        return None;
    }
    let selector = spec.gpu.as_ref().and_then(|g| g.selector.as_ref());
    let min_cc = selector
        .and_then(|s| s.min_compute_capability.as_deref())
        .and_then(|s| s.parse::<ComputeCapability>().ok());
    let node_selector = spec.pod.as_ref().map(|p| &p.node_selector);
    let most = facts
        .nodes
        .iter()
        .filter(|n| !n.unschedulable && n.is_gpu_node())
        .filter(|n| {
            let cc = n.compute_capability();
            cc.is_some() && gpu_selector_matches(selector, n.product(), cc, min_cc)
        })
        .filter(|n| node_selector_matches(node_selector, n))
        .filter_map(|n| n.gpus())
        .max()?;
    if most < 1 || total <= most {
        return None;
    }
    let mut nodes = (total + most - 1) / most;
    while total % nodes != 0 {
        nodes += 1;
    }
    Some(MultiNode {
        nodes_per_replica: nodes,
        gpus_per_node: total / nodes,
        most_gpus_on_a_node: most,
    })
}

/// GPUs one pod of `spec` needs on its node: a whole replica, or its share when the replica
/// spans nodes ([`multi_node_layout`]).
pub(super) fn gpus_per_pod(spec: &InferenceDeploymentSpec, facts: &ClusterFacts) -> i64 {
    multi_node_layout(spec, facts)
        .map(|m| m.gpus_per_node)
        .unwrap_or_else(|| i64::from(spec.gpus_per_replica().max(1)))
}

/// The multi-node part of an admitted verdict: the release must have vLLM's multi-node
/// launch, and the compatible nodes must hold every pod of every replica (one pod per node).
pub(super) fn multi_node_checks(
    spec: &InferenceDeploymentSpec,
    facts: &ClusterFacts,
    mut verdict: Verdict,
) -> Verdict {
    let Some(layout) = multi_node_layout(spec, facts) else {
        return verdict;
    };
    let tp = spec.engine.tensor_parallel_size;
    let pp = spec.engine.pipeline_parallel_size;
    let gpus = spec.gpus_per_replica();
    let shape = format!(
        "one replica (tensorParallelSize {tp} x pipelineParallelSize {pp} = {gpus} GPUs) needs more GPUs than a selected node has (at most {}), so it spans {} nodes of {} GPUs each",
        layout.most_gpus_on_a_node, layout.nodes_per_replica, layout.gpus_per_node
    );
    // The release is judged whatever else denied; the nodes only when some can run it.
    let admitted = verdict.allowed();
    let denials: Vec<Denial> = [
        release_without_multi_node(spec, &shape),
        admitted
            .then(|| too_few_nodes(spec, &layout, verdict.compatible_nodes.len(), &shape))
            .flatten(),
    ]
    .into_iter()
    .flatten()
    .collect();
    if denials.is_empty() {
        if admitted {
            verdict.multi_node = Some(layout);
        }
    } else {
        // A denied verdict carries no resolution, affinity or nodes (see [`Verdict`]); its
        // multi-node layout was never set.
        verdict.deny(denials);
    }
    verdict
}

/// The denial when the spec's vLLM release predates the multi-node launch.
fn release_without_multi_node(spec: &InferenceDeploymentSpec, shape: &str) -> Option<Denial> {
    let version = spec.vllm_version().ok()?;
    if vllm_versions::MULTI_NODE.at(version) {
        return None;
    }
    let gpus = spec.gpus_per_replica();
    let since = vllm_versions::MULTI_NODE
        .since
        .map(|s| s.to_string())
        .unwrap_or_else(|| "a newer release".into());
    Some(denial(
        "spec.engine.vllm.version",
        "MultiNodeNeedsNewerVllm",
        format!(
            "{shape}; vLLM's multi-node launch (--nnodes, --node-rank, --master-addr) needs vLLM >= {since}, and this spec runs vLLM {version}; use image {} (or set spec.engine.vllm.version to a release that has it), or select nodes with at least {gpus} GPUs [{}]",
            vllm_versions::default_image(),
            vllm_versions::MULTI_NODE.source
        ),
    ))
}

/// The denial when the `have` compatible nodes cannot hold every pod of every replica.
fn too_few_nodes(
    spec: &InferenceDeploymentSpec,
    layout: &MultiNode,
    have: usize,
    shape: &str,
) -> Option<Denial> {
    let nodes = layout.nodes_per_replica;
    let replicas = i64::from(spec.replicas.max(0));
    let needed = nodes * replicas;
    let have = have as i64;
    if have >= needed {
        return None;
    }
    let fit = have / nodes;
    let lower = if fit >= 1 {
        format!("lower spec.replicas to {fit}, ")
    } else {
        String::new()
    };
    Some(denial(
        "spec.replicas",
        INSUFFICIENT_NODES,
        format!(
            "{shape}; {replicas} {} {needed} such nodes, and the selected pool has {have} that can run it; {lower}add nodes with at least {} GPUs, or lower tensorParallelSize x pipelineParallelSize",
            if replicas == 1 { "replica needs" } else { "replicas need" },
            layout.gpus_per_node
        ),
    ))
}
