//! Spec + cluster facts -> verdict (pure, no I/O).
//!
//! The single place where kvfleet decides whether an InferenceDeployment can run: the
//! webhook, the controller and `kvfleet check` all call [`validate`].
//!
//! How it decides:
//! 1. Checks what needs no node: tensorParallelSize against the model's heads and
//!    gpu.count, gpuMemoryUtilization risk.
//! 2. Keeps the nodes the spec's selectors could land on (`gpu.selector.products`,
//!    `gpu.selector.minComputeCapability`, `pod.nodeSelector`; cordoned and GPU-less nodes
//!    are left out) and reads their compute capability from the GFD labels
//!    (`compute.major/minor` first, else the product table). Nodes without GFD labels are
//!    never assumed compatible.
//! 3. Runs the runtime's rules ([`crate::compat::rules`]) once per compute capability and
//!    checks GPUs per node against GPUs per replica.
//! 4. Admits when at least one node can run it. When architectures resolve `auto`
//!    differently, the resolution held by the most nodes wins (ties: the newest
//!    architecture) and the node affinity keeps pods on the architectures that resolve to
//!    it, so every replica runs the same configuration.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::ops::Bound;

use k8s_openapi::api::core::v1::{
    Node, NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm,
};
use serde::Serialize;

use crate::api::{CapacityStatus, GpuSelector, InferenceDeploymentSpec, ResolvedConfig, Runtime};
use crate::compat::rules::{self, Violation};
use crate::compat::{products, AttentionBackend, ComputeCapability, KvCacheDtype, ModelFeatures};

pub mod bounds;
#[cfg(test)]
mod equivalence_tests;
#[cfg(test)]
mod reference;
#[cfg(test)]
mod tests;

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

/// Above this gpuMemoryUtilization, warn: at 0.90 the sampler warm-up (maxNumSeqs dummy
/// requests) can OOM with ~1.7 GiB left (seed report, COMPAT.md). It is the CRD's (and
/// vLLM's) default: a value nobody chose must not warn on every apply, so only a value
/// raised above it does.
pub const GPU_MEMORY_UTILIZATION_WARN: f64 = 0.9;

/// What the warning advises instead.
pub const GPU_MEMORY_UTILIZATION_SAFE: f64 = 0.85;

/// GPUs of a node made up by [`validate_offline`] / `kvfleet check --gpu`.
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

    fn labelled_compute_capability(&self) -> Option<ComputeCapability> {
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

    /// Memory of one GPU in bytes: the GFD `nvidia.com/gpu.memory` label (MiB), else the
    /// planner's or the product table's figure for the product.
    pub fn gpu_memory_bytes(&self) -> Option<u64> {
        const MIB: u64 = 1024 * 1024;
        self.labels
            .get(labels::MEMORY_MIB)
            .and_then(|m| m.trim().parse::<u64>().ok())
            .filter(|m| *m > 0)
            .map(|m| m * MIB)
            .or_else(|| product_memory_mib(self.product()?).map(|m| m * MIB))
    }

    fn has_gfd_labels(&self) -> bool {
        // Keys are sorted: if any starts with the prefix, the first key at or after it does.
        const PREFIX: &str = "nvidia.com/gpu.";
        self.labels
            .range::<str, _>((Bound::Included(PREFIX), Bound::Unbounded))
            .next()
            .is_some_and(|(k, _)| k.starts_with(PREFIX))
    }

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

    fn is_gpu_node(&self) -> bool {
        self.gpus().is_some_and(|g| g > 0) || self.has_gfd_labels()
    }
}

/// The cluster as validation sees it.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
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

/// What one compute capability among the selected nodes can run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ArchReport {
    pub compute_capability: ComputeCapability,
    /// Distinct `nvidia.com/gpu.product` values of these nodes.
    pub products: Vec<String>,
    /// Selected nodes of this compute capability.
    pub nodes: usize,
    /// Of them, nodes with at least the GPUs one replica needs.
    pub nodes_with_enough_gpus: usize,
    /// `(kvCacheDtype, attentionBackend)` after resolving `auto`; absent when nothing runs.
    pub resolved: Option<(KvCacheDtype, AttentionBackend)>,
    /// Rules this architecture breaks.
    pub violations: Vec<Violation>,
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

/// The GPU and memory arithmetic behind [`Verdict::capacity`].
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CapacityBasis {
    /// The product the prediction is for (the compatible GPU with the least memory).
    pub product: String,
    pub gpu_memory_bytes: u64,
    /// Memory left for the KV cache on one GPU.
    pub available_kv_bytes: u64,
    /// KV bytes one maxModelLen request needs per GPU.
    pub bytes_per_request: u64,
    /// kvfleet's capacity in tokens per replica.
    pub kvfleet_tokens: u64,
    /// What vLLM (v0.21+) would log as "GPU KV cache size".
    pub vllm_tokens: u64,
    /// Assumptions (absent weight bytes, the activation reserve).
    pub notes: Vec<String>,
}

impl Verdict {
    pub fn allowed(&self) -> bool {
        self.denials.is_empty()
    }
}

/// Errors of offline validation input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValidateError {
    #[error("unknown GPU product {product:?}; use a GFD nvidia.com/gpu.product value such as {examples}")]
    UnknownProduct { product: String, examples: String },
}

/// Validates against one synthetic node per product (8 GPUs each), as `kvfleet check --gpu`.
pub fn validate_offline(spec: &InferenceDeploymentSpec, products: &[&str]) -> Result<Verdict, ValidateError> {
    Ok(validate(spec, &synthetic_cluster(products)?))
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
    Ok(ClusterFacts { nodes })
}

// === impl validate ===

struct Candidate<'a> {
    node: &'a NodeFacts,
    /// The node's signature, an index into [`Signatures::sigs`].
    sig: usize,
    cc: ComputeCapability,
    enough_gpus: bool,
}

// === impl signatures ===
//
// Fleets have few distinct GPU configurations, so validation derives what it needs
// (compute capability, product, GPUs, memory, whether gpu.selector takes it) once per
// distinct configuration and fans it out to the nodes; only the name, `unschedulable`
// and the `pod.nodeSelector` match (arbitrary labels) are looked at per node.

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

/// What validation derives from one signature, read from its first node.
struct Signature<'a> {
    /// The first node with this signature.
    node: &'a NodeFacts,
    gpu_node: bool,
    product: Option<&'a str>,
    cc: Option<ComputeCapability>,
    gpus: Option<i64>,
    /// Passes `gpu.selector` (products, minComputeCapability).
    gpu_selected: bool,
    enough_gpus: bool,
}

impl<'a> Signature<'a> {
    fn new(
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
struct Signatures<'a> {
    sigs: Vec<Signature<'a>>,
    /// Per node of [`ClusterFacts::nodes`], its signature.
    of_node: Vec<usize>,
}

/// Up to this many signatures, a linear search beats hashing the key.
const LINEAR_SIGNATURES: usize = 16;

impl<'a> Signatures<'a> {
    fn build(facts: &'a ClusterFacts, new: impl Fn(&'a NodeFacts) -> Signature<'a>) -> Self {
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

/// "12.0 (NVIDIA-RTX-PRO-6000-Blackwell), 8.6 (NVIDIA-GeForce-RTX-3090)".
fn describe_archs<'a>(archs: impl IntoIterator<Item = &'a ArchReport>) -> String {
    archs
        .into_iter()
        .map(|a| {
            if a.products.is_empty() {
                a.compute_capability.to_string()
            } else {
                format!("{} ({})", a.compute_capability, a.products.join(", "))
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The model's features, or a warning when they cannot be known here.
pub(super) fn model_features(spec: &InferenceDeploymentSpec, warnings: &mut Vec<String>) -> ModelFeatures {
    let non_causal = spec.engine.non_causal;
    let quantized = spec.model.quantization.is_quantized();
    let mut f = match (&spec.model.geometry, &spec.model.config) {
        (Some(g), _) => g.features(non_causal, quantized),
        (None, Some(_)) if spec.engine.runtime == Runtime::Kvfleet => {
            // Denied by spec_checks (KvfleetNeedsGeometry): nothing more to warn about.
            ModelFeatures::unknown(non_causal, quantized)
        }
        (None, Some(cfg)) => {
            warnings.push(format!(
                "model.config (ConfigMap {}, key {}) is not read at admission: head-dimension, sliding-window, KV-head and capacity checks were skipped and vLLM finds out at start; write model.geometry to have them checked at kubectl apply",
                cfg.config_map_ref.name, cfg.config_map_ref.key
            ));
            ModelFeatures::unknown(non_causal, quantized)
        }
        (None, None) => {
            warnings.push(
                "model has neither geometry nor config: head-dimension, sliding-window and KV-head checks were skipped".to_string(),
            );
            ModelFeatures::unknown(non_causal, quantized)
        }
    };
    f.block_size = u32::try_from(spec.engine.block_size).ok();
    f
}

/// Valid tensorParallelSize values up to `limit` for these head counts.
fn valid_tp(query_heads: i64, kv_heads: &[i64], limit: i64) -> Vec<i64> {
    (1..=limit)
        .filter(|tp| {
            query_heads % tp == 0
                && kv_heads
                    .iter()
                    .all(|kv| if *tp <= *kv { kv % tp == 0 } else { tp % kv == 0 })
        })
        .collect()
}

/// Checks that need no node: parallelism against heads and GPUs, memory utilisation.
pub(super) fn spec_checks(
    spec: &InferenceDeploymentSpec,
    denials: &mut Vec<Denial>,
    warnings: &mut Vec<String>,
) {
    let engine = &spec.engine;
    let tp = i64::from(engine.tensor_parallel_size);
    if tp < 1 {
        denials.push(denial(
            "spec.engine.tensorParallelSize",
            "InvalidTensorParallelSize",
            format!("tensorParallelSize {tp} must be at least 1; set it to the GPUs one replica shards the model over"),
        ));
    }
    let pp = i64::from(engine.pipeline_parallel_size);
    if pp < 1 {
        denials.push(denial(
            "spec.engine.pipelineParallelSize",
            "InvalidPipelineParallelSize",
            format!("pipelineParallelSize {pp} must be at least 1; set it to the pipeline stages of one replica (1 for none)"),
        ));
    }
    if engine.runtime == Runtime::Kvfleet && pp > 1 {
        denials.push(denial(
            "spec.engine.pipelineParallelSize",
            "KvfleetSingleGpu",
            format!("runtime kvfleet runs one GPU per replica (its engine has no pipeline parallelism), but pipelineParallelSize is {pp}; set pipelineParallelSize to 1, or use runtime vllm"),
        ));
    }
    if engine.runtime == Runtime::Kvfleet {
        // The worker refuses both at start (preflight exit 3 / 2): deny what it cannot run.
        if tp > 1 {
            denials.push(denial(
                "spec.engine.tensorParallelSize",
                "KvfleetSingleGpu",
                format!("runtime kvfleet runs one GPU per replica (its engine has no tensor parallelism), but tensorParallelSize is {tp}; set tensorParallelSize to 1 and scale with replicas, or use runtime vllm to shard the model over {tp} GPUs"),
            ));
        }
        if spec.model.geometry.is_none() {
            let source = match &spec.model.config {
                Some(cfg) => format!(
                    "model.config (ConfigMap {}, key {}) is read only by the vllm runtime",
                    cfg.config_map_ref.name, cfg.config_map_ref.key
                ),
                None => "the model has neither geometry nor config".to_string(),
            };
            denials.push(denial(
                "spec.model.geometry",
                "KvfleetNeedsGeometry",
                format!("runtime kvfleet sizes its KV cache from model.geometry, and {source}; write model.geometry (layers, queryHeads, kvHeads, headDim from the model's config.json: num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim), or use runtime vllm"),
            ));
        }
    }
    weights_checks(spec, denials);
    if let Some(count) = spec.gpu.as_ref().and_then(|g| g.count) {
        if pp > 1 && i64::from(count) < tp * pp {
            let gpus = tp * pp;
            denials.push(denial(
                "spec.gpu.count",
                "InsufficientGpuCount",
                format!("gpu.count {count} is less than tensorParallelSize {tp} x pipelineParallelSize {pp}: each replica shards the model over {gpus} GPUs; set gpu.count to at least {gpus} (or leave it out) or lower the parallelism"),
            ));
        } else if i64::from(count) < tp {
            denials.push(denial(
                "spec.gpu.count",
                "InsufficientGpuCount",
                format!("gpu.count {count} is less than tensorParallelSize {tp}: each replica shards the model over {tp} GPUs; set gpu.count to at least {tp} or lower tensorParallelSize"),
            ));
        }
    }
    if let Some(g) = &spec.model.geometry {
        let q = i64::from(g.query_heads);
        let mut kvs = vec![i64::from(g.kv_heads)];
        kvs.extend(g.global_kv_heads.map(i64::from));
        if q < 1 || kvs.iter().any(|kv| *kv < 1) {
            denials.push(denial(
                "spec.model.geometry",
                "InvalidGeometry",
                "model.geometry queryHeads and kvHeads must be at least 1; copy num_attention_heads and num_key_value_heads from the model's config.json".to_string(),
            ));
        } else if tp >= 1 {
            let mla = g.kv_lora_rank.is_some();
            let kv_check: &[i64] = if mla { &[] } else { &kvs };
            if valid_tp(q, kv_check, tp).last() != Some(&tp) {
                let options = valid_tp(q, kv_check, 64.min(q.max(kvs[0])).max(1));
                let options: Vec<String> = options.iter().take(8).map(|t| t.to_string()).collect();
                let heads = if q % tp != 0 {
                    format!("does not divide the model's {q} query heads")
                } else {
                    let kv = kvs
                        .iter()
                        .find(|kv| {
                            if tp <= **kv {
                                **kv % tp != 0
                            } else {
                                tp % **kv != 0
                            }
                        })
                        .copied()
                        .unwrap_or(kvs[0]);
                    format!("and the model's {kv} KV heads do not split evenly (KV heads must be a multiple of tensorParallelSize, or tensorParallelSize a multiple of KV heads)")
                };
                denials.push(denial(
                    "spec.engine.tensorParallelSize",
                    "TensorParallelSizeMismatch",
                    format!(
                        "tensorParallelSize {tp} {heads} (vllm config/model.py verify_with_parallel_config, QKVParallelLinear); use one of {}",
                        options.join(", ")
                    ),
                ));
            }
        }
    }
    let util = engine.gpu_memory_utilization;
    if !(util > 0.0 && util <= 1.0) {
        denials.push(denial(
            "spec.engine.gpuMemoryUtilization",
            "InvalidGpuMemoryUtilization",
            format!("gpuMemoryUtilization {util} must be in (0, 1]; {GPU_MEMORY_UTILIZATION_SAFE} is a safe value"),
        ));
    } else if let Some(w) = gpu_memory_utilization_warning(util) {
        warnings.push(w);
    }
}

/// Where the weights come from: a vLLM pod without weights would serve random ones without a
/// word, so runtime vllm needs a source, or `format: dummy` said out loud.
fn weights_checks(spec: &InferenceDeploymentSpec, denials: &mut Vec<Denial>) {
    use crate::api::WeightsFormat;
    let w = spec.model.weights.as_ref();
    let name = &spec.model.name;
    match (spec.engine.runtime, w) {
        (Runtime::Vllm, None) => denials.push(denial(
            "spec.model.weights",
            "WeightsMissing",
            format!("runtime vllm needs weights, or it would serve random ones: set model.weights.huggingFace (vLLM downloads {name}; tokenSecretRef for gated repositories, cachePvcName to keep the download across restarts), or pvcName, hostPath or image with the checkpoint's path, or model.weights.format: dummy for random weights (capacity and throughput runs only)"),
        )),
        (Runtime::Vllm, Some(w)) => {
            if w.format == WeightsFormat::Dummy && w.has_source() {
                denials.push(denial(
                    "spec.model.weights.format",
                    "DummyWeightsWithSource",
                    "model.weights names a source but its format is dummy (the default), which loads random weights; set model.weights.format: safetensors (or gguf)".to_string(),
                ));
            }
            if w.format != WeightsFormat::Dummy && !w.has_source() {
                denials.push(denial(
                    "spec.model.weights",
                    "WeightsMissing",
                    format!("model.weights.format is {} but names no source; set huggingFace, pvcName, hostPath or image", match w.format { WeightsFormat::Gguf => "gguf", _ => "safetensors" }),
                ));
            }
        }
        (Runtime::Kvfleet, Some(w)) if w.image.is_some() || w.hugging_face.is_some() => denials.push(denial(
            "spec.model.weights",
            "WeightsSourceNeedsVllm",
            "model.weights.image and model.weights.huggingFace are read by runtime vllm only; the kvfleet worker loads weights from pvcName or hostPath (with path)".to_string(),
        )),
        _ => {}
    }
}

/// The vLLM release of a vllm spec (`None` for runtime kvfleet, or when it is unknown: then
/// a denial names the fix). A release newer than kvfleet's table is judged as the newest
/// release in it, with a warning.
pub(super) fn vllm_version_check(
    spec: &InferenceDeploymentSpec,
    denials: &mut Vec<Denial>,
    warnings: &mut Vec<String>,
) -> Option<crate::compat::VllmVersion> {
    use crate::compat::vllm_versions;
    if spec.engine.runtime != Runtime::Vllm {
        if spec.engine.vllm.is_some() {
            warnings.push(
                "spec.engine.vllm is read only by runtime vllm; it is ignored for runtime kvfleet"
                    .to_string(),
            );
        }
        return None;
    }
    match spec.vllm_version() {
        Ok(v) => {
            if v > vllm_versions::newest() {
                warnings.push(format!(
                    "vLLM {v} is newer than {}, the newest release kvfleet's table describes; its flags and rules are assumed to be those of {}",
                    vllm_versions::newest(),
                    vllm_versions::newest()
                ));
            }
            Some(v)
        }
        Err(e) => {
            denials.push(denial(
                "spec.engine.vllm.version",
                "UnknownVllmVersion",
                e.to_string(),
            ));
            None
        }
    }
}

/// The warning for a gpuMemoryUtilization raised above the default, if it is.
pub(crate) fn gpu_memory_utilization_warning(util: f64) -> Option<String> {
    (util > GPU_MEMORY_UTILIZATION_WARN).then(|| format!(
        "gpuMemoryUtilization {util} is above the default {GPU_MEMORY_UTILIZATION_WARN}: already at 0.90 the sampler warm-up (maxNumSeqs dummy requests) can run out of memory with ~1.7 GiB left on large models; lower it to {GPU_MEMORY_UTILIZATION_SAFE} (or lower maxNumSeqs) if pods fail at start-up"
    ))
}

/// `pod.nodeSelector`: exact label matches, looked at per node.
fn node_selector_matches(node_selector: Option<&BTreeMap<String, String>>, node: &NodeFacts) -> bool {
    node_selector.is_none_or(|sel| sel.iter().all(|(k, v)| node.labels.get(k) == Some(v)))
}

/// `gpu.selector`: products and minimum compute capability.
fn gpu_selector_matches(
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

fn describe_selectors(spec: &InferenceDeploymentSpec) -> String {
    let mut parts = Vec::new();
    if let Some(sel) = spec.gpu.as_ref().and_then(|g| g.selector.as_ref()) {
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

/// The multi-node part of a verdict: the release must have vLLM's multi-node launch, and the
/// compatible nodes must hold every pod of every replica (one pod per node).
pub(super) fn multi_node_checks(
    spec: &InferenceDeploymentSpec,
    facts: &ClusterFacts,
    mut verdict: Verdict,
) -> Verdict {
    let Some(layout) = multi_node_layout(spec, facts) else {
        return verdict;
    };
    if !verdict.allowed() {
        return verdict;
    }
    let tp = spec.engine.tensor_parallel_size;
    let pp = spec.engine.pipeline_parallel_size;
    let gpus = spec.gpus_per_replica();
    let nodes = layout.nodes_per_replica;
    let shape = format!(
        "one replica (tensorParallelSize {tp} x pipelineParallelSize {pp} = {gpus} GPUs) needs more GPUs than a selected node has (at most {}), so it spans {nodes} nodes of {} GPUs each",
        layout.most_gpus_on_a_node, layout.gpus_per_node
    );
    let mut denials = Vec::new();
    if let Ok(version) = spec.vllm_version() {
        let since = crate::compat::vllm_versions::MULTI_NODE.since;
        if !crate::compat::vllm_versions::MULTI_NODE.at(version) {
            let since = since
                .map(|s| s.to_string())
                .unwrap_or_else(|| "a newer release".into());
            denials.push(denial(
                "spec.engine.vllm.version",
                "MultiNodeNeedsNewerVllm",
                format!(
                    "{shape}; vLLM's multi-node launch (--nnodes, --node-rank, --master-addr) needs vLLM >= {since}, and this spec runs vLLM {version}; use image {} (or set spec.engine.vllm.version to a release that has it), or select nodes with at least {gpus} GPUs [{}]",
                    crate::compat::vllm_versions::default_image(),
                    crate::compat::vllm_versions::MULTI_NODE.source
                ),
            ));
        }
    }
    let replicas = i64::from(spec.replicas.max(0));
    let needed = nodes * replicas;
    let have = verdict.compatible_nodes.len() as i64;
    if have < needed {
        let fit = have / nodes;
        let lower = if fit >= 1 {
            format!("lower spec.replicas to {fit}, ")
        } else {
            String::new()
        };
        denials.push(denial(
            "spec.replicas",
            INSUFFICIENT_NODES,
            format!(
                "{shape}; {replicas} {} {needed} such nodes, and the selected pool has {have} that can run it; {lower}add nodes with at least {} GPUs, or lower tensorParallelSize x pipelineParallelSize",
                if replicas == 1 { "replica needs" } else { "replicas need" },
                layout.gpus_per_node
            ),
        ));
    }
    if denials.is_empty() {
        verdict.multi_node = Some(layout);
    } else {
        // A denied verdict carries no resolution, affinity or nodes (see [`Verdict`]).
        verdict.denials.extend(denials);
        verdict.resolved = None;
        verdict.node_affinity = None;
        verdict.compatible_nodes.clear();
        verdict.capacity = None;
        verdict.capacity_basis = None;
    }
    verdict
}

/// Decides whether `spec` can run on `facts`.
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
    multi_node_checks(
        spec,
        facts,
        scale_from_zero(spec, validate_nodes(spec, facts), validate_nodes),
    )
}

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

/// See [`validate`]: `verdict` is what the nodes say; `inner` judges the declared products.
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
    };
    // The declared nodes carry only GFD labels: pod.nodeSelector still applies to the pods.
    let mut declared_spec = spec.clone();
    if let Some(pod) = declared_spec.pod.as_mut() {
        pod.node_selector.clear();
    }
    let mut judged = inner(&declared_spec, &facts);
    let names: Vec<&str> = declared.iter().map(|p| p.label).collect();
    let (names, more) = if names.len() > 6 {
        (&names[..6], format!(" and {} more", names.len() - 6))
    } else {
        (&names[..], String::new())
    };
    let basis = format!(
        "no schedulable GPU node matches the selectors ({}) right now, so this was judged against the products they declare ({}{more})",
        describe_selectors(spec),
        names.join(", ")
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

/// [`validate`] against the nodes only.
fn validate_nodes(spec: &InferenceDeploymentSpec, facts: &ClusterFacts) -> Verdict {
    let mut denials = Vec::new();
    let mut warnings = Vec::new();
    let features = model_features(spec, &mut warnings);
    spec_checks(spec, &mut denials, &mut warnings);
    let vllm_version = vllm_version_check(spec, &mut denials, &mut warnings);

    let selector = spec.gpu.as_ref().and_then(|g| g.selector.as_ref());
    let min_cc = match selector.and_then(|s| s.min_compute_capability.as_deref()) {
        Some(s) => match s.parse::<ComputeCapability>() {
            Ok(cc) => Some(cc),
            Err(e) => {
                denials.push(denial(
                    "spec.gpu.selector.minComputeCapability",
                    "InvalidComputeCapability",
                    e.to_string(),
                ));
                None
            }
        },
        None => None,
    };
    // GPUs one pod needs: the replica's, or its share on each node when it spans nodes.
    let gpus_per_replica = gpus_per_pod(spec, facts);

    // --- which nodes could pods land on
    let sigs = Signatures::build(facts, |node| {
        Signature::new(node, selector, min_cc, gpus_per_replica)
    });
    let node_selector = spec.pod.as_ref().map(|p| &p.node_selector);
    let mut gpu_nodes = 0usize;
    let mut cordoned = 0usize;
    let mut selected: Vec<(&NodeFacts, usize)> = Vec::new();
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

    let mut unlabeled = Vec::new();
    let mut unknown_products: BTreeSet<&str> = BTreeSet::new();
    let mut candidates = Vec::with_capacity(selected.len());
    // Selected nodes with a compute capability (the candidates), per signature.
    let mut candidates_of_sig = vec![0usize; sigs.sigs.len()];
    for &(node, s) in &selected {
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
    // Signatures with candidates.
    let candidate_sigs: Vec<(&Signature, usize)> = sigs
        .sigs
        .iter()
        .zip(&candidates_of_sig)
        .filter(|(_, n)| **n > 0)
        .map(|(sig, n)| (sig, *n))
        .collect();

    // --- rules, once per compute capability
    let mut archs: Vec<ArchReport> = Vec::new();
    let ccs: BTreeSet<ComputeCapability> = candidate_sigs.iter().filter_map(|(sig, _)| sig.cc).collect();
    for cc in ccs.iter().rev() {
        let mut products: BTreeSet<&str> = BTreeSet::new();
        let mut nodes = 0;
        let mut nodes_with_enough_gpus = 0;
        for (sig, n) in candidate_sigs.iter().filter(|(sig, _)| sig.cc == Some(*cc)) {
            nodes += n;
            if sig.enough_gpus {
                nodes_with_enough_gpus += n;
            }
            products.extend(sig.product);
        }
        let ev = rules::evaluate_at(
            spec.engine.runtime,
            *cc,
            &features,
            spec.engine.kv_cache_dtype,
            spec.engine.attention_backend,
            vllm_version,
        );
        for w in &ev.warnings {
            let text = format!("{} [{}; {}]", w.message, w.rule, w.source);
            if !warnings.contains(&text) {
                warnings.push(text);
            }
        }
        archs.push(ArchReport {
            compute_capability: *cc,
            products: products.into_iter().map(str::to_string).collect(),
            nodes,
            nodes_with_enough_gpus,
            resolved: ev.resolved,
            violations: ev.violations,
        });
    }

    let runnable: Vec<&ArchReport> = archs
        .iter()
        .filter(|a| a.resolved.is_some() && a.nodes_with_enough_gpus > 0)
        .collect();

    if selected.is_empty() {
        let cluster = if gpu_nodes == 0 {
            format!(
                "the cluster facts hold {} and none has GPUs",
                plural(facts.nodes.len(), "node", "nodes")
            )
        } else {
            let all: BTreeSet<String> = sigs
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
                plural(gpu_nodes, "GPU node", "GPU nodes"),
                all.into_iter().collect::<Vec<_>>().join(", ")
            )
        };
        let unknown: Vec<&str> = selector
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
        denials.push(denial(
            "spec.gpu.selector",
            NO_MATCHING_NODES,
            format!(
                "no schedulable GPU node matches the selectors ({}){hint}; {cluster}; change gpu.selector or pod.nodeSelector to match GPU nodes, or add such nodes",
                describe_selectors(spec)
            ),
        ));
    } else if runnable.is_empty() {
        // Rule violations, one denial per rule, naming the architectures where it fired.
        let mut seen: Vec<&'static str> = Vec::new();
        for arch in &archs {
            for v in &arch.violations {
                if seen.contains(&v.rule) {
                    continue;
                }
                seen.push(v.rule);
                let fired: Vec<&ArchReport> = archs
                    .iter()
                    .filter(|a| a.violations.iter().any(|w| w.rule == v.rule))
                    .collect();
                let n: usize = fired.iter().map(|a| a.nodes).sum();
                let have = if n == 1 {
                    "the selected node has"
                } else {
                    "the selected nodes have"
                };
                denials.push(denial(
                    v.field,
                    v.reason,
                    format!(
                        "{}; {have} {}; {} [{}; {}]",
                        v.cause,
                        describe_archs(fired.iter().copied()),
                        v.fix,
                        v.rule,
                        v.source
                    ),
                ));
            }
        }
        // Architectures that would run but lack GPUs per node.
        let short: Vec<&ArchReport> = archs
            .iter()
            .filter(|a| a.resolved.is_some() && a.nodes_with_enough_gpus == 0)
            .collect();
        if !short.is_empty() {
            let most = candidate_sigs
                .iter()
                .filter(|(sig, _)| short.iter().any(|a| Some(a.compute_capability) == sig.cc))
                .filter_map(|(sig, _)| sig.gpus)
                .max()
                .unwrap_or(0);
            denials.push(denial(
                "spec.engine.tensorParallelSize",
                "InsufficientGpusPerNode",
                format!(
                    "one replica needs {gpus_per_replica} GPUs on one node (tensorParallelSize/gpu.count); the selected nodes that can run it ({}) have at most {most}; lower tensorParallelSize or select nodes with at least {gpus_per_replica} GPUs",
                    describe_archs(short.iter().copied())
                ),
            ));
        }
        if archs.is_empty() {
            denials.push(denial(
                "spec.gpu.selector",
                "NoGpuFeatureDiscoveryLabels",
                format!(
                    "none of the {} selected GPU nodes has a known compute capability (no GFD labels), so kvfleet cannot tell whether they run this; deploy GPU Feature Discovery or label the nodes with nvidia.com/gpu.product and nvidia.com/gpu.compute.major/minor",
                    selected.len()
                ),
            ));
        }
    }

    // --- admitted (unless spec checks denied): pick the resolution, build the affinity
    let mut verdict = Verdict {
        denials,
        warnings,
        architectures: archs.clone(),
        ..Verdict::default()
    };
    // Spec checks that denied do not stop the capacity check: a spec with two problems
    // gets one denial naming both.
    if runnable.is_empty() {
        return verdict;
    }

    // Most nodes win; ties go to the newest architecture (archs are sorted newest first).
    let mut by_resolution: Vec<((KvCacheDtype, AttentionBackend), usize)> = Vec::new();
    for a in &runnable {
        let r = a.resolved.unwrap_or_default();
        match by_resolution.iter_mut().find(|(k, _)| *k == r) {
            Some((_, n)) => *n += a.nodes_with_enough_gpus,
            None => by_resolution.push((r, a.nodes_with_enough_gpus)),
        }
    }
    // `max_by_key` keeps the last maximum: reversed, that is the newest architecture.
    let best = by_resolution
        .iter()
        .rev()
        .max_by_key(|(_, n)| *n)
        .map(|(r, _)| *r);
    let Some((dtype, backend)) = best else {
        return verdict;
    };
    let chosen: Vec<&ArchReport> = runnable
        .iter()
        .copied()
        .filter(|a| a.resolved == Some((dtype, backend)))
        .collect();
    let chosen_ccs: BTreeSet<ComputeCapability> = chosen.iter().map(|a| a.compute_capability).collect();
    let compatible: Vec<&Candidate> = candidates
        .iter()
        .filter(|c| chosen_ccs.contains(&c.cc) && c.enough_gpus)
        .collect();
    // KV capacity (issue 4 item 6): nodes whose GPUs cannot hold one maxModelLen request
    // are left out; none left is a denial naming the fix.
    let mut restrict_products = false;
    let compatible: Vec<&Candidate> =
        match plan_capacity(spec, dtype, &compatible, &sigs.sigs, &mut verdict.warnings) {
            CapacityOutcome::Denied(d) => {
                verdict.denials.push(d);
                return verdict;
            }
            // Spec checks denied and the capacity fits (or was not judged): they stand alone.
            _ if !verdict.denials.is_empty() => return verdict,
            CapacityOutcome::NotPlanned => compatible,
            CapacityOutcome::Planned {
                fits,
                fitting,
                capacity,
                basis,
            } => {
                restrict_products = fitting < compatible.len();
                verdict.capacity = Some(capacity);
                verdict.capacity_basis = Some(basis);
                if restrict_products {
                    // A node stays when a node that fits has its name (names are unique in a
                    // cluster; by name, as the per-node check always did).
                    let names: HashSet<&str> = compatible
                        .iter()
                        .zip(&fits)
                        .filter(|(_, fits)| **fits)
                        .map(|(c, _)| c.node.name.as_str())
                        .collect();
                    compatible
                        .into_iter()
                        .filter(|c| names.contains(c.node.name.as_str()))
                        .collect()
                } else {
                    compatible
                }
            }
        };
    verdict.compatible_nodes = compatible.iter().map(|c| c.node.name.clone()).collect();

    // Warnings about what the affinity leaves out.
    let total = selected.len();
    if compatible.len() < total {
        verdict.warnings.insert(
            0,
            format!(
                "{} of {} selected GPU nodes can run this; the affinity excludes the others",
                compatible.len(),
                total
            ),
        );
    }
    for a in &archs {
        let label = describe_archs([a]);
        if let Some(r) = a.resolved {
            if r != (dtype, backend) {
                verdict.warnings.push(format!(
                    "nodes with {label} would resolve to kvCacheDtype {} / attentionBackend {}; excluded so every replica runs {dtype} / {backend}",
                    r.0, r.1
                ));
            } else if a.nodes_with_enough_gpus < a.nodes {
                verdict.warnings.push(format!(
                    "{} with {label} {} fewer than the {gpus_per_replica} GPUs one replica needs",
                    plural(a.nodes - a.nodes_with_enough_gpus, "node", "nodes"),
                    if a.nodes - a.nodes_with_enough_gpus == 1 {
                        "has"
                    } else {
                        "have"
                    }
                ));
            }
        } else {
            let why: Vec<String> = a.violations.iter().map(|v| v.message.clone()).collect();
            verdict
                .warnings
                .push(format!("nodes with {label} excluded: {}", why.join("; ")));
        }
    }

    // Signatures of the compatible nodes.
    let mut compatible_sigs = vec![false; sigs.sigs.len()];
    for c in &compatible {
        compatible_sigs[c.sig] = true;
    }
    let compatible_sigs: Vec<&Signature> = sigs
        .sigs
        .iter()
        .zip(compatible_sigs)
        .filter(|(_, used)| *used)
        .map(|(sig, _)| sig)
        .collect();
    let products: BTreeSet<&str> = compatible_sigs.iter().filter_map(|sig| sig.product).collect();
    verdict.resolved = Some(ResolvedConfig {
        kv_cache_dtype: dtype,
        attention_backend: backend,
        compute_capabilities: chosen_ccs.iter().rev().map(|c| c.to_string()).collect(),
        products: products.into_iter().map(str::to_string).collect(),
    });
    verdict.node_affinity = Some(node_affinity(
        spec,
        &compatible_sigs,
        &chosen_ccs,
        restrict_products,
    ));
    verdict
}

/// Required node affinity: one term per chosen compute capability, by the GFD
/// `compute.major/minor` labels when every compatible node of it carries them, else by
/// product; restricted to products too when the spec selects products, and to exactly
/// the compatible products when some nodes were left out for memory (`restrict_products`).
fn node_affinity(
    spec: &InferenceDeploymentSpec,
    compatible: &[&Signature],
    ccs: &BTreeSet<ComputeCapability>,
    restrict_products: bool,
) -> NodeAffinity {
    let selected_products: &[String] = spec
        .gpu
        .as_ref()
        .and_then(|g| g.selector.as_ref())
        .map(|s| s.products.as_slice())
        .unwrap_or(&[]);
    let req = |key: &str, values: Vec<String>| NodeSelectorRequirement {
        key: key.to_string(),
        operator: "In".to_string(),
        values: Some(values),
    };
    let mut terms = Vec::new();
    for cc in ccs.iter().rev() {
        let sigs: Vec<&&Signature> = compatible.iter().filter(|sig| sig.cc == Some(*cc)).collect();
        let all_labelled = sigs
            .iter()
            .all(|sig| sig.node.labelled_compute_capability() == Some(*cc));
        let mut exprs = Vec::new();
        if all_labelled {
            exprs.push(req(labels::COMPUTE_MAJOR, vec![cc.major.to_string()]));
            exprs.push(req(labels::COMPUTE_MINOR, vec![cc.minor.to_string()]));
        }
        if !all_labelled || !selected_products.is_empty() || restrict_products {
            let mut products: BTreeSet<String> = sigs
                .iter()
                .filter_map(|sig| sig.product)
                .map(str::to_string)
                .collect();
            products.extend(
                selected_products
                    .iter()
                    .filter(|_| !restrict_products)
                    .filter(|p| products::lookup(p).is_some_and(|prod| prod.cc == *cc))
                    .map(|p| p.trim().to_string()),
            );
            exprs.push(req(labels::PRODUCT, products.into_iter().collect()));
        }
        terms.push(NodeSelectorTerm {
            match_expressions: Some(exprs),
            match_fields: None,
        });
    }
    NodeAffinity {
        required_during_scheduling_ignored_during_execution: Some(NodeSelector {
            node_selector_terms: terms,
        }),
        preferred_during_scheduling_ignored_during_execution: None,
    }
}

// === impl capacity ===

enum CapacityOutcome {
    /// The geometry or GPU memory is unknown here (warned).
    NotPlanned,
    Denied(Denial),
    Planned {
        /// Per compatible node (in order): whether its GPUs hold one request (or could not
        /// be judged).
        fits: Vec<bool>,
        /// How many of them do.
        fitting: usize,
        capacity: CapacityStatus,
        basis: CapacityBasis,
    },
}

/// Plans capacity per distinct GPU memory among the compatible nodes.
fn plan_capacity<'a>(
    spec: &InferenceDeploymentSpec,
    dtype: KvCacheDtype,
    compatible: &[&Candidate<'a>],
    sigs: &[Signature<'a>],
    warnings: &mut Vec<String>,
) -> CapacityOutcome {
    let Some(g) = &spec.model.geometry else {
        return CapacityOutcome::NotPlanned;
    };
    let geometry = match crate::plan::Geometry::from_spec(g) {
        Ok(geometry) => geometry,
        Err(e) => return CapacityOutcome::Denied(bounds::planner_denial(&e)),
    };
    // A larger tensorParallelSize is a fix only where the nodes have the GPUs for it.
    let max_gpus = compatible.iter().filter_map(|c| c.node.gpus()).max();
    // (memory, product of its first node, nodes), by first appearance; per signature, its
    // group (`None`: memory unknown), computed once.
    let mut groups: Vec<(u64, &'a str, usize)> = Vec::new();
    let mut group_of_sig: Vec<Option<Option<usize>>> = vec![None; sigs.len()];
    let mut group_of_node: Vec<Option<usize>> = Vec::with_capacity(compatible.len());
    let mut unknown: Vec<&'a str> = Vec::new();
    for c in compatible {
        let group = *group_of_sig[c.sig].get_or_insert_with(|| {
            let mem = sigs[c.sig].node.gpu_memory_bytes()?;
            Some(match groups.iter().position(|(m, _, _)| *m == mem) {
                Some(g) => g,
                None => {
                    groups.push((mem, c.node.product().unwrap_or("unknown product"), 0));
                    groups.len() - 1
                }
            })
        });
        match group {
            Some(g) => groups[g].2 += 1,
            None => unknown.push(c.node.name.as_str()),
        }
        group_of_node.push(group);
    }
    if !unknown.is_empty() {
        warnings.push(format!(
            "KV capacity not checked on {} ({}): no nvidia.com/gpu.memory label and an unknown product",
            plural(unknown.len(), "node", "nodes"),
            unknown.join(", ")
        ));
    }
    let mut by_memory: Vec<usize> = (0..groups.len()).collect();
    by_memory.sort_by_key(|g| groups[*g].0);
    let mut group_fits = vec![true; groups.len()];
    let mut fitting = unknown.len();
    let mut smallest_fit: Option<(crate::plan::SpecCapacity, String)> = None;
    let mut not_fitting: Vec<(crate::plan::SpecCapacity, String, usize)> = Vec::new();
    for g in by_memory {
        let (mem, product, nodes) = groups[g];
        match crate::plan::spec_capacity(spec, &geometry, mem, dtype) {
            Ok(cap) if cap.fits_one_request => {
                fitting += nodes;
                if smallest_fit.is_none() {
                    smallest_fit = Some((cap, product.to_string()));
                }
            }
            Ok(cap) => {
                group_fits[g] = false;
                not_fitting.push((cap, product.to_string(), nodes));
            }
            Err(e) => return CapacityOutcome::Denied(bounds::planner_denial(&e)),
        }
    }
    if let Some((cap, product)) = smallest_fit {
        for (cap, product, n) in &not_fitting {
            warnings.push(format!(
                "{} with {product} cannot hold one request and {} excluded: {}",
                plural(*n, "node", "nodes"),
                if *n == 1 { "is" } else { "are" },
                cap.fix_hint_on(max_gpus).unwrap_or_default()
            ));
        }
        let (tokens, concurrency) = match spec.engine.runtime {
            Runtime::Kvfleet => (cap.kvfleet_tokens, cap.max_concurrency),
            Runtime::Vllm => (cap.vllm_tokens, cap.vllm_max_concurrency),
        };
        let basis = CapacityBasis {
            product,
            gpu_memory_bytes: cap.plan.memory.gpu_memory_bytes.unwrap_or_default(),
            available_kv_bytes: cap.available_kv_bytes,
            bytes_per_request: cap.bytes_per_request,
            kvfleet_tokens: cap.kvfleet_tokens,
            vllm_tokens: cap.vllm_tokens,
            notes: cap.explanation.clone(),
        };
        return CapacityOutcome::Planned {
            fits: group_of_node
                .iter()
                .map(|g| g.is_none_or(|g| group_fits[g]))
                .collect(),
            fitting,
            capacity: CapacityStatus {
                tokens_per_replica: i64::try_from(tokens).ok(),
                max_concurrency: Some(concurrency),
                measured_tokens_per_replica: None,
                vllm_tokens_per_replica: i64::try_from(cap.vllm_tokens).ok(),
            },
            basis,
        };
    }
    if !unknown.is_empty() || not_fitting.is_empty() {
        // Nothing was judged too small (unknown memory): admit, warned.
        return CapacityOutcome::NotPlanned;
    }
    // Nothing fits: name the fix for the largest GPU (the last group).
    let have: Vec<String> = not_fitting
        .iter()
        .map(|(c, p, _)| {
            format!(
                "{p} ({} GiB)",
                crate::plan::memory::fmt_gib(c.plan.memory.gpu_memory_bytes.unwrap_or_default())
            )
        })
        .collect();
    let (largest, _, _) = &not_fitting[not_fitting.len() - 1];
    let hint = largest.fix_hint_on(max_gpus).unwrap_or_default();
    CapacityOutcome::Denied(denial(
        "spec.engine.maxModelLen",
        "KvCacheTooSmall",
        format!("{hint}; the selected nodes have {}", have.join(", ")),
    ))
}
