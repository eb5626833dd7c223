//! The spec's selectors as predicates on one node's facts: `pod.nodeSelector` (labels, per
//! node) and `gpu.selector` (products and minimum compute capability, per signature). Below
//! `nodes.rs`, `signatures.rs` and `multi_node.rs`, which all ask them.

use std::collections::BTreeMap;

use super::NodeFacts;
use crate::api::GpuSelector;
use crate::compat::{products, ComputeCapability};

/// `pod.nodeSelector`: exact label matches, looked at per node.
pub(super) fn node_selector_matches(
    node_selector: Option<&BTreeMap<String, String>>,
    node: &NodeFacts,
) -> bool {
    node_selector.is_none_or(|sel| sel.iter().all(|(k, v)| node.labels.get(k) == Some(v)))
}

/// `gpu.selector`: products and minimum compute capability.
pub(super) fn gpu_selector_matches(
    selector: Option<&GpuSelector>,
    product: Option<&str>,
    cc: Option<ComputeCapability>,
    min_cc: Option<ComputeCapability>,
) -> bool {
    if let Some(sel) = selector {
        if !sel.products.is_empty() {
            let Some(product) = product else {
                return false;
            };
            let base = products::base_label(product);
            let wanted = sel.products.iter().any(|p| {
                let p = p.trim();
                p == product || products::base_label(p) == base
            });
            if !wanted {
                return false;
            }
        }
    }
    if let (Some(min), Some(cc)) = (min_cc, cc) {
        if cc < min {
            return false;
        }
    }
    true
}
