//! When no node matches the selectors right now (a GPU pool scaled to zero by Karpenter or
//! the cluster-autoscaler), the spec is judged against the products its selector declares.

use super::nodes::describe_selectors;
use super::{ClusterFacts, NodeFacts, Verdict};
use crate::api::InferenceDeploymentSpec;
use crate::compat::{products, ComputeCapability};

/// Reason of the denial for selectors that match no node.
pub const NO_MATCHING_NODES: &str = "NoMatchingNodes";

/// The products a GPU selector declares: its known products (at or above
/// `minComputeCapability` when both are given), else every known product at or above
/// `minComputeCapability`. Empty when it declares neither.
pub fn declared_products(spec: &InferenceDeploymentSpec) -> Vec<&'static products::Product> {
    let Some(sel) = spec.gpu.as_ref().and_then(|g| g.selector.as_ref()) else {
        return Vec::new();
    };
    let min_cc = sel
        .min_compute_capability
        .as_deref()
        .and_then(|s| s.parse::<ComputeCapability>().ok());
    let at_least = |p: &&products::Product| min_cc.is_none_or(|min| p.cc >= min);
    let mut out: Vec<&'static products::Product> = Vec::new();
    if !sel.products.is_empty() {
        for p in sel.products.iter().filter_map(|p| products::lookup(p)) {
            if at_least(&p) && !out.iter().any(|o| o.label == p.label) {
                out.push(p);
            }
        }
    } else if min_cc.is_some() {
        out.extend(products::PRODUCTS.iter().filter(at_least));
    }
    out
}

/// See [`super::validate`]: `verdict` is what the nodes say; when they match no node,
/// `inner` judges one node of each declared product instead, with a warning that says so.
pub(super) fn scale_from_zero(
    spec: &InferenceDeploymentSpec,
    verdict: Verdict,
    inner: impl Fn(&InferenceDeploymentSpec, &ClusterFacts) -> Verdict,
) -> Verdict {
    if !verdict.denials.iter().any(|d| d.reason == NO_MATCHING_NODES) {
        return verdict;
    }
    let declared = declared_products(spec);
    if declared.is_empty() {
        return verdict;
    }
    let gpus = i64::from(spec.gpus_per_replica().max(1));
    let facts = ClusterFacts {
        nodes: declared
            .iter()
            .enumerate()
            .map(|(i, p)| NodeFacts::synthetic(format!("declared-{i}"), p, gpus))
            .collect(),
        ..ClusterFacts::default()
    };
    // The declared nodes carry only GFD labels: pod.nodeSelector still applies to the pods.
    let mut declared_spec = spec.clone();
    if let Some(pod) = declared_spec.pod.as_mut() {
        pod.node_selector.clear();
    }
    let mut judged = inner(&declared_spec, &facts);
    let basis = format!(
        "no schedulable GPU node matches the selectors ({}) right now, so this was judged against the products they declare ({})",
        describe_selectors(spec),
        product_list(&declared)
    );
    judged.compatible_nodes.clear();
    if judged.allowed() {
        // The warnings about declared nodes being left out name made-up nodes: drop them.
        judged
            .warnings
            .retain(|w| !w.contains("selected GPU nodes can run this"));
        judged.warnings.insert(
            0,
            format!("{basis}: pods stay Pending until such a node joins (a GPU pool scaled to zero by Karpenter or the cluster-autoscaler); kvfleet re-validates when it does"),
        );
    } else {
        judged
            .warnings
            .insert(0, format!("{basis}; on those it cannot run"));
    }
    judged
}

/// The first six labels of `declared`, and how many more.
fn product_list(declared: &[&products::Product]) -> String {
    let names: Vec<&str> = declared.iter().map(|p| p.label).collect();
    if names.len() > 6 {
        format!("{} and {} more", names[..6].join(", "), names.len() - 6)
    } else {
        names.join(", ")
    }
}
