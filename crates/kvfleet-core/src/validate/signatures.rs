//! Fleets have few distinct GPU configurations, so validation derives what it needs
//! (compute capability, product, GPUs, memory, whether gpu.selector takes it) once per
//! distinct configuration and fans it out to the nodes; only the name, `unschedulable`
//! and the `pod.nodeSelector` match (arbitrary labels) are looked at per node.

use std::collections::HashMap;

use super::facts::labels;
use super::selectors::gpu_selector_matches;
use super::{ClusterFacts, NodeFacts};
use crate::api::GpuSelector;
use crate::compat::ComputeCapability;

/// The raw facts of a node that [`NodeFacts::product`], [`NodeFacts::compute_capability`],
/// [`NodeFacts::gpus`], [`NodeFacts::gpu_memory_bytes`] and [`NodeFacts::is_gpu_node`]
/// read: nodes with equal keys have equal derived facts.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct SignatureKey<'a> {
    allocatable_gpus: Option<i64>,
    has_gfd_labels: bool,
    product: Option<&'a str>,
    major: Option<&'a str>,
    minor: Option<&'a str>,
    count: Option<&'a str>,
    memory: Option<&'a str>,
}

impl NodeFacts {
    /// The raw facts every derived fact but the name, schedulability and
    /// `pod.nodeSelector` match is computed from (see [`Signature`]).
    fn signature_key(&self) -> SignatureKey<'_> {
        let label = |k: &str| self.labels.get(k).map(String::as_str);
        SignatureKey {
            allocatable_gpus: self.allocatable_gpus,
            has_gfd_labels: self.has_gfd_labels(),
            product: label(labels::PRODUCT),
            major: label(labels::COMPUTE_MAJOR),
            minor: label(labels::COMPUTE_MINOR),
            count: label(labels::COUNT),
            memory: label(labels::MEMORY_MIB),
        }
    }
}

/// What validation derives from one signature, read from its first node.
pub(super) struct Signature<'a> {
    /// The first node with this signature.
    pub node: &'a NodeFacts,
    pub gpu_node: bool,
    pub product: Option<&'a str>,
    pub cc: Option<ComputeCapability>,
    pub gpus: Option<i64>,
    /// Passes `gpu.selector` (products, minComputeCapability).
    pub gpu_selected: bool,
    pub enough_gpus: bool,
}

impl<'a> Signature<'a> {
    pub fn new(
        node: &'a NodeFacts,
        selector: Option<&GpuSelector>,
        min_cc: Option<ComputeCapability>,
        gpus_per_replica: i64,
    ) -> Self {
        let product = node.product();
        let cc = node.compute_capability();
        let gpus = node.gpus();
        Signature {
            node,
            gpu_node: node.is_gpu_node(),
            product,
            cc,
            gpus,
            gpu_selected: gpu_selector_matches(selector, product, cc, min_cc),
            enough_gpus: gpus.is_some_and(|g| g >= gpus_per_replica),
        }
    }
}

/// The distinct signatures of a cluster's nodes.
pub(super) struct Signatures<'a> {
    pub sigs: Vec<Signature<'a>>,
    /// Per node of [`ClusterFacts::nodes`], its signature.
    pub of_node: Vec<usize>,
}

/// Up to this many signatures, a linear search beats hashing the key.
const LINEAR_SIGNATURES: usize = 16;

impl<'a> Signatures<'a> {
    /// Groups the nodes by [`SignatureKey`], deriving each group's [`Signature`] with `new`
    /// from its first node.
    pub fn build(facts: &'a ClusterFacts, new: impl Fn(&'a NodeFacts) -> Signature<'a>) -> Self {
        let mut keys: Vec<SignatureKey<'a>> = Vec::new();
        let mut index: HashMap<SignatureKey<'a>, usize> = HashMap::new();
        let mut sigs = Vec::new();
        let mut of_node = Vec::with_capacity(facts.nodes.len());
        for node in &facts.nodes {
            let key = node.signature_key();
            let found = if keys.len() <= LINEAR_SIGNATURES {
                keys.iter().position(|k| *k == key)
            } else {
                index.get(&key).copied()
            };
            let s = match found {
                Some(s) => s,
                None => {
                    keys.push(key);
                    if keys.len() > LINEAR_SIGNATURES {
                        if index.is_empty() {
                            index.extend(keys.iter().copied().enumerate().map(|(i, k)| (k, i)));
                        } else {
                            index.insert(key, keys.len() - 1);
                        }
                    }
                    sigs.push(new(node));
                    sigs.len() - 1
                }
            };
            of_node.push(s);
        }
        Signatures { sigs, of_node }
    }
}
