//! The nodes pods could land on: GPU nodes that pass `gpu.selector` and `pod.nodeSelector`,
//! are not cordoned and have a known compute capability (the candidates).

use std::collections::BTreeSet;

use super::selectors::node_selector_matches;
use super::signatures::{Signature, Signatures};
use super::{denial, plural, ClusterFacts, Denial, NodeFacts, NO_MATCHING_NODES};
use crate::api::{GpuSelector, InferenceDeploymentSpec};
use crate::compat::{products, ComputeCapability};

/// A selected node with a known compute capability.
pub(super) struct Candidate<'a> {
    pub node: &'a NodeFacts,
    /// The node's signature, an index into [`Signatures::sigs`].
    pub sig: usize,
    pub cc: ComputeCapability,
    pub enough_gpus: bool,
}

/// The cluster's nodes as validation judges them, grouped by signature.
pub(super) struct Pool<'a> {
    pub sigs: Signatures<'a>,
    /// GPU nodes of the cluster, selected or not, cordoned or not.
    pub gpu_nodes: usize,
    /// Schedulable GPU nodes that pass both selectors.
    pub selected: usize,
    /// The selected nodes with a known compute capability, in cluster order.
    pub candidates: Vec<Candidate<'a>>,
    /// Per signature, its candidates.
    pub candidates_of_sig: Vec<usize>,
}

impl<'a> Pool<'a> {
    /// Groups the nodes of `facts`, keeps those `spec` selects and, of them, those with a
    /// compute capability; warns about cordoned and unlabelled nodes the selectors match.
    pub fn gather(
        spec: &InferenceDeploymentSpec,
        facts: &'a ClusterFacts,
        min_cc: Option<ComputeCapability>,
        gpus_per_pod: i64,
        warnings: &mut Vec<String>,
    ) -> Self {
        let selector = gpu_selector(spec);
        let sigs = Signatures::build(facts, |node| Signature::new(node, selector, min_cc, gpus_per_pod));
        let (gpu_nodes, selected) = select(spec, facts, &sigs, warnings);
        let (candidates, candidates_of_sig) = candidates(&selected, &sigs, warnings);
        Pool {
            sigs,
            gpu_nodes,
            selected: selected.len(),
            candidates,
            candidates_of_sig,
        }
    }

    /// The signatures with candidates, and how many.
    pub fn candidate_sigs(&self) -> impl Iterator<Item = (&Signature<'a>, usize)> {
        self.sigs
            .sigs
            .iter()
            .zip(&self.candidates_of_sig)
            .filter(|(_, n)| **n > 0)
            .map(|(sig, n)| (sig, *n))
    }
}

fn gpu_selector(spec: &InferenceDeploymentSpec) -> Option<&GpuSelector> {
    spec.gpu.as_ref().and_then(|g| g.selector.as_ref())
}

/// `gpu.selector.minComputeCapability`, parsed; a value that does not parse is denied.
pub(super) fn min_compute_capability(
    spec: &InferenceDeploymentSpec,
    denials: &mut Vec<Denial>,
) -> Option<ComputeCapability> {
    let s = gpu_selector(spec)?.min_compute_capability.as_deref()?;
    match s.parse::<ComputeCapability>() {
        Ok(cc) => Some(cc),
        Err(e) => {
            denials.push(denial(
                "spec.gpu.selector.minComputeCapability",
                "InvalidComputeCapability",
                e.to_string(),
            ));
            None
        }
    }
}

/// Counts the GPU nodes and keeps the schedulable ones both selectors take, with their
/// signature; warns about the cordoned ones the selectors take.
fn select<'a>(
    spec: &InferenceDeploymentSpec,
    facts: &'a ClusterFacts,
    sigs: &Signatures<'a>,
    warnings: &mut Vec<String>,
) -> (usize, Vec<(&'a NodeFacts, usize)>) {
    let node_selector = spec.pod.as_ref().map(|p| &p.node_selector);
    let mut gpu_nodes = 0usize;
    let mut cordoned = 0usize;
    let mut selected = Vec::new();
    for (node, &s) in facts.nodes.iter().zip(&sigs.of_node) {
        let sig = &sigs.sigs[s];
        if !sig.gpu_node {
            continue;
        }
        gpu_nodes += 1;
        if !sig.gpu_selected || !node_selector_matches(node_selector, node) {
            continue;
        }
        if node.unschedulable {
            cordoned += 1;
        } else {
            selected.push((node, s));
        }
    }
    if cordoned > 0 {
        warnings.push(format!(
            "{} matching the selectors {} cordoned and not considered",
            plural(cordoned, "node", "nodes"),
            if cordoned == 1 { "is" } else { "are" }
        ));
    }
    (gpu_nodes, selected)
}

/// The selected nodes with a compute capability, and their count per signature; the
/// others are warned about (never assumed compatible).
fn candidates<'a>(
    selected: &[(&'a NodeFacts, usize)],
    sigs: &Signatures<'a>,
    warnings: &mut Vec<String>,
) -> (Vec<Candidate<'a>>, Vec<usize>) {
    let mut unlabeled = Vec::new();
    let mut unknown_products: BTreeSet<&str> = BTreeSet::new();
    let mut candidates = Vec::with_capacity(selected.len());
    let mut candidates_of_sig = vec![0usize; sigs.sigs.len()];
    for &(node, s) in selected {
        let sig = &sigs.sigs[s];
        match sig.cc {
            Some(cc) => {
                candidates.push(Candidate {
                    node,
                    sig: s,
                    cc,
                    enough_gpus: sig.enough_gpus,
                });
                candidates_of_sig[s] += 1;
            }
            None => {
                if let Some(p) = sig.product {
                    unknown_products.insert(p);
                }
                unlabeled.push(node.name.as_str());
            }
        }
    }
    if !unlabeled.is_empty() {
        let which = if unknown_products.is_empty() {
            "carry no GPU Feature Discovery labels (nvidia.com/gpu.product, nvidia.com/gpu.compute.major/minor)".to_string()
        } else {
            format!(
                "have no nvidia.com/gpu.compute.major/minor labels and a product kvfleet does not know ({})",
                unknown_products.iter().copied().collect::<Vec<_>>().join(", ")
            )
        };
        warnings.push(format!(
            "{} ({}) {which}; they are not assumed compatible and the affinity excludes them: deploy GPU Feature Discovery (NVIDIA GPU Operator or k8s-device-plugin with gfd)",
            plural(unlabeled.len(), "selected GPU node", "selected GPU nodes"),
            unlabeled.join(", ")
        ));
    }
    (candidates, candidates_of_sig)
}

/// The selectors of `spec` in words, for messages.
pub(super) fn describe_selectors(spec: &InferenceDeploymentSpec) -> String {
    let mut parts = Vec::new();
    if let Some(sel) = gpu_selector(spec) {
        if !sel.products.is_empty() {
            parts.push(format!("gpu.selector.products [{}]", sel.products.join(", ")));
        }
        if let Some(min) = &sel.min_compute_capability {
            parts.push(format!("gpu.selector.minComputeCapability {min}"));
        }
    }
    if let Some(pod) = &spec.pod {
        if !pod.node_selector.is_empty() {
            let kv: Vec<String> = pod
                .node_selector
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            parts.push(format!("pod.nodeSelector {{{}}}", kv.join(", ")));
        }
    }
    if parts.is_empty() {
        "any GPU node".to_string()
    } else {
        parts.join(", ")
    }
}

/// The denial when no schedulable GPU node passes the selectors, naming what the cluster
/// has and selector products kvfleet does not know.
pub(super) fn no_matching_nodes(spec: &InferenceDeploymentSpec, facts: &ClusterFacts, pool: &Pool) -> Denial {
    let cluster = if pool.gpu_nodes == 0 {
        format!(
            "the cluster facts hold {} and none has GPUs",
            plural(facts.nodes.len(), "node", "nodes")
        )
    } else {
        let all: BTreeSet<String> = pool
            .sigs
            .sigs
            .iter()
            .filter(|sig| sig.gpu_node)
            .map(|sig| match (sig.product, sig.cc) {
                (Some(p), Some(cc)) => format!("{p} ({cc})"),
                (Some(p), None) => p.to_string(),
                (None, Some(cc)) => cc.to_string(),
                (None, None) => "unlabeled".to_string(),
            })
            .collect();
        format!(
            "the cluster's {} have {}",
            plural(pool.gpu_nodes, "GPU node", "GPU nodes"),
            all.into_iter().collect::<Vec<_>>().join(", ")
        )
    };
    let unknown: Vec<&str> = gpu_selector(spec)
        .map(|s| {
            s.products
                .iter()
                .map(|p| p.as_str())
                .filter(|p| products::lookup(p).is_none())
                .collect()
        })
        .unwrap_or_default();
    let hint = if unknown.is_empty() {
        String::new()
    } else {
        format!(
            " ({} not a GFD product value kvfleet knows, e.g. NVIDIA-H100-80GB-HBM3)",
            unknown.join(", ")
        )
    };
    denial(
        "spec.gpu.selector",
        NO_MATCHING_NODES,
        format!(
            "no schedulable GPU node matches the selectors ({}){hint}; {cluster}; change gpu.selector or pod.nodeSelector to match GPU nodes, or add such nodes",
            describe_selectors(spec)
        ),
    )
}
