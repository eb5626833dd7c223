//! The per-node implementation of [`super::validate`] as it was before signatures
//! (kept under `cfg(test)` so tests can prove the grouped one gives identical verdicts).
#![allow(clippy::all)]

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::{NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm};

use super::{
    labels, ArchReport, CapacityBasis, ClusterFacts, Denial, NodeFacts, Verdict, GPU_MEMORY_UTILIZATION_WARN,
};
use crate::api::{CapacityStatus, InferenceDeploymentSpec, ResolvedConfig, Runtime};
use crate::compat::rules;
use crate::compat::{products, AttentionBackend, ComputeCapability, KvCacheDtype, ModelFeatures};

/// The label scan as it was.
fn is_gpu_node(node: &NodeFacts) -> bool {
    node.gpus().is_some_and(|g| g > 0) || node.labels.keys().any(|k| k.starts_with("nvidia.com/gpu."))
}

// === impl validate ===

struct Candidate<'a> {
    node: &'a NodeFacts,
    cc: ComputeCapability,
    enough_gpus: bool,
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
fn model_features(spec: &InferenceDeploymentSpec, warnings: &mut Vec<String>) -> ModelFeatures {
    let non_causal = spec.engine.non_causal;
    let quantized = spec.model.quantization.is_quantized();
    match (&spec.model.geometry, &spec.model.config) {
        (Some(g), _) => ModelFeatures::from_geometry(g, non_causal, quantized),
        (None, Some(cfg)) => {
            warnings.push(format!(
                "model.config (ConfigMap {}, key {}) is not read at admission: head-dimension, sliding-window, KV-head and capacity checks were skipped; the worker's preflight checks them, or write model.geometry",
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
    }
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
fn spec_checks(spec: &InferenceDeploymentSpec, denials: &mut Vec<Denial>, warnings: &mut Vec<String>) {
    let engine = &spec.engine;
    let tp = i64::from(engine.tensor_parallel_size);
    if tp < 1 {
        denials.push(denial(
            "spec.engine.tensorParallelSize",
            "InvalidTensorParallelSize",
            format!("tensorParallelSize {tp} must be at least 1; set it to the GPUs one replica shards the model over"),
        ));
    }
    if let Some(count) = spec.gpu.as_ref().and_then(|g| g.count) {
        if i64::from(count) < tp {
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
            format!("gpuMemoryUtilization {util} must be in (0, 1]; 0.85 is a safe default"),
        ));
    } else if util > GPU_MEMORY_UTILIZATION_WARN {
        warnings.push(format!(
            "gpuMemoryUtilization {util} is above {GPU_MEMORY_UTILIZATION_WARN}: at 0.90 the sampler warm-up (maxNumSeqs dummy requests) can run out of memory with ~1.7 GiB left on large models; lower it to {GPU_MEMORY_UTILIZATION_WARN} (or lower maxNumSeqs) if pods fail at start-up"
        ));
    }
}

fn selector_matches(
    spec: &InferenceDeploymentSpec,
    node: &NodeFacts,
    min_cc: Option<ComputeCapability>,
) -> bool {
    if let Some(pod) = &spec.pod {
        if !pod
            .node_selector
            .iter()
            .all(|(k, v)| node.labels.get(k) == Some(v))
        {
            return false;
        }
    }
    let selector = spec.gpu.as_ref().and_then(|g| g.selector.as_ref());
    if let Some(sel) = selector {
        if !sel.products.is_empty() {
            let Some(product) = node.product() else {
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
    if let (Some(min), Some(cc)) = (min_cc, node.compute_capability()) {
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

/// Decides whether `spec` can run on `facts`.
pub(super) fn validate(spec: &InferenceDeploymentSpec, facts: &ClusterFacts) -> Verdict {
    let out_of_bounds = super::bounds::check(spec);
    if !out_of_bounds.is_empty() {
        return Verdict {
            denials: out_of_bounds,
            ..Verdict::default()
        };
    }
    let mut denials = Vec::new();
    let mut warnings = Vec::new();
    let features = model_features(spec, &mut warnings);
    spec_checks(spec, &mut denials, &mut warnings);

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
    let gpus_per_replica = i64::from(spec.gpus_per_replica().max(1));

    // --- which nodes could pods land on
    let gpu_nodes: Vec<&NodeFacts> = facts.nodes.iter().filter(|n| is_gpu_node(n)).collect();
    let matching: Vec<&NodeFacts> = gpu_nodes
        .iter()
        .copied()
        .filter(|n| selector_matches(spec, n, min_cc))
        .collect();
    let cordoned = matching.iter().filter(|n| n.unschedulable).count();
    let selected: Vec<&NodeFacts> = matching.iter().copied().filter(|n| !n.unschedulable).collect();
    if cordoned > 0 {
        warnings.push(format!(
            "{} matching the selectors {} cordoned and not considered",
            plural(cordoned, "node", "nodes"),
            if cordoned == 1 { "is" } else { "are" }
        ));
    }

    let mut unlabeled = Vec::new();
    let mut unknown_products = BTreeSet::new();
    let mut candidates = Vec::new();
    for node in &selected {
        match node.compute_capability() {
            Some(cc) => candidates.push(Candidate {
                node,
                cc,
                enough_gpus: node.gpus().is_some_and(|g| g >= gpus_per_replica),
            }),
            None => match node.product() {
                Some(p) => {
                    unknown_products.insert(p.to_string());
                    unlabeled.push(node.name.as_str());
                }
                None => unlabeled.push(node.name.as_str()),
            },
        }
    }
    if !unlabeled.is_empty() {
        let which = if unknown_products.is_empty() {
            "carry no GPU Feature Discovery labels (nvidia.com/gpu.product, nvidia.com/gpu.compute.major/minor)".to_string()
        } else {
            format!(
                "have no nvidia.com/gpu.compute.major/minor labels and a product kvfleet does not know ({})",
                unknown_products.iter().cloned().collect::<Vec<_>>().join(", ")
            )
        };
        warnings.push(format!(
            "{} ({}) {which}; they are not assumed compatible and the affinity excludes them: deploy GPU Feature Discovery (NVIDIA GPU Operator or k8s-device-plugin with gfd)",
            plural(unlabeled.len(), "selected GPU node", "selected GPU nodes"),
            unlabeled.join(", ")
        ));
    }

    // --- rules, once per compute capability
    let mut archs: Vec<ArchReport> = Vec::new();
    let ccs: BTreeSet<ComputeCapability> = candidates.iter().map(|c| c.cc).collect();
    for cc in ccs.iter().rev() {
        let nodes: Vec<&Candidate> = candidates.iter().filter(|c| c.cc == *cc).collect();
        let products: BTreeSet<String> = nodes
            .iter()
            .filter_map(|c| c.node.product())
            .map(str::to_string)
            .collect();
        let ev = rules::evaluate(
            spec.engine.runtime,
            *cc,
            &features,
            spec.engine.kv_cache_dtype,
            spec.engine.attention_backend,
        );
        for w in &ev.warnings {
            let text = format!("{} [{}; {}]", w.message, w.rule, w.source);
            if !warnings.contains(&text) {
                warnings.push(text);
            }
        }
        archs.push(ArchReport {
            compute_capability: *cc,
            products: products.into_iter().collect(),
            nodes: nodes.len(),
            nodes_with_enough_gpus: nodes.iter().filter(|c| c.enough_gpus).count(),
            resolved: ev.resolved,
            violations: ev.violations,
        });
    }

    let runnable: Vec<&ArchReport> = archs
        .iter()
        .filter(|a| a.resolved.is_some() && a.nodes_with_enough_gpus > 0)
        .collect();

    if selected.is_empty() {
        let cluster = if gpu_nodes.is_empty() {
            format!(
                "the cluster facts hold {} and none has GPUs",
                plural(facts.nodes.len(), "node", "nodes")
            )
        } else {
            let all: BTreeSet<String> = gpu_nodes
                .iter()
                .map(|n| match (n.product(), n.compute_capability()) {
                    (Some(p), Some(cc)) => format!("{p} ({cc})"),
                    (Some(p), None) => p.to_string(),
                    (None, Some(cc)) => cc.to_string(),
                    (None, None) => "unlabeled".to_string(),
                })
                .collect();
            format!(
                "the cluster's {} have {}",
                plural(gpu_nodes.len(), "GPU node", "GPU nodes"),
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
            "NoMatchingNodes",
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
            let most = candidates
                .iter()
                .filter(|c| short.iter().any(|a| a.compute_capability == c.cc))
                .filter_map(|c| c.node.gpus())
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
    if !verdict.denials.is_empty() || runnable.is_empty() {
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
    let compatible: Vec<&Candidate> = match plan_capacity(spec, dtype, &compatible, &mut verdict.warnings) {
        CapacityOutcome::NotPlanned => compatible,
        CapacityOutcome::Denied(d) => {
            verdict.denials.push(d);
            return verdict;
        }
        CapacityOutcome::Planned {
            fitting,
            capacity,
            basis,
        } => {
            restrict_products = fitting.len() < compatible.len();
            verdict.capacity = Some(capacity);
            verdict.capacity_basis = Some(basis);
            compatible
                .into_iter()
                .filter(|c| fitting.contains(&c.node.name.as_str()))
                .collect()
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

    let products: BTreeSet<String> = compatible
        .iter()
        .filter_map(|c| c.node.product())
        .map(str::to_string)
        .collect();
    verdict.resolved = Some(ResolvedConfig {
        kv_cache_dtype: dtype.to_string(),
        attention_backend: backend.to_string(),
        compute_capabilities: chosen_ccs.iter().rev().map(|c| c.to_string()).collect(),
        products: products.into_iter().collect(),
    });
    verdict.node_affinity = Some(node_affinity(spec, &compatible, &chosen_ccs, restrict_products));
    verdict
}

/// Required node affinity: one term per chosen compute capability, by the GFD
/// `compute.major/minor` labels when every compatible node of it carries them, else by
/// product; restricted to products too when the spec selects products, and to exactly
/// the compatible products when some nodes were left out for memory (`restrict_products`).
fn node_affinity(
    spec: &InferenceDeploymentSpec,
    compatible: &[&Candidate],
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
        let nodes: Vec<&&Candidate> = compatible.iter().filter(|c| c.cc == *cc).collect();
        let all_labelled = nodes
            .iter()
            .all(|c| c.node.labelled_compute_capability() == Some(*cc));
        let mut exprs = Vec::new();
        if all_labelled {
            exprs.push(req(labels::COMPUTE_MAJOR, vec![cc.major.to_string()]));
            exprs.push(req(labels::COMPUTE_MINOR, vec![cc.minor.to_string()]));
        }
        if !all_labelled || !selected_products.is_empty() || restrict_products {
            let mut products: BTreeSet<String> = nodes
                .iter()
                .filter_map(|c| c.node.product())
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

enum CapacityOutcome<'a> {
    /// The geometry or GPU memory is unknown here, or the planner declined (warned).
    NotPlanned,
    Denied(Denial),
    Planned {
        fitting: Vec<&'a str>,
        capacity: CapacityStatus,
        basis: CapacityBasis,
    },
}

/// Plans capacity per distinct GPU memory among the compatible nodes.
fn plan_capacity<'a>(
    spec: &InferenceDeploymentSpec,
    dtype: KvCacheDtype,
    compatible: &[&Candidate<'a>],
    warnings: &mut Vec<String>,
) -> CapacityOutcome<'a> {
    let Some(g) = &spec.model.geometry else {
        return CapacityOutcome::NotPlanned;
    };
    let geometry = match crate::plan::Geometry::from_spec(g) {
        Ok(geometry) => geometry,
        Err(e) => return CapacityOutcome::Denied(super::bounds::planner_denial(&e)),
    };
    // (memory, product, nodes)
    let mut groups: Vec<(u64, String, Vec<&'a str>)> = Vec::new();
    let mut unknown: Vec<&'a str> = Vec::new();
    for c in compatible {
        let name = c.node.name.as_str();
        match c.node.gpu_memory_bytes() {
            Some(mem) => match groups.iter_mut().find(|(m, _, _)| *m == mem) {
                Some((_, _, nodes)) => nodes.push(name),
                None => groups.push((
                    mem,
                    c.node.product().unwrap_or("unknown product").to_string(),
                    vec![name],
                )),
            },
            None => unknown.push(name),
        }
    }
    if !unknown.is_empty() {
        warnings.push(format!(
            "KV capacity not checked on {} ({}): no nvidia.com/gpu.memory label and an unknown product",
            plural(unknown.len(), "node", "nodes"),
            unknown.join(", ")
        ));
    }
    groups.sort_by_key(|(m, _, _)| *m);
    let mut fitting: Vec<&'a str> = unknown.clone();
    let mut smallest_fit: Option<(crate::plan::SpecCapacity, String)> = None;
    let mut not_fitting: Vec<(crate::plan::SpecCapacity, String, usize)> = Vec::new();
    for (mem, product, nodes) in &groups {
        match crate::plan::spec_capacity(spec, &geometry, *mem, dtype) {
            Ok(cap) if cap.fits_one_request => {
                fitting.extend(nodes.iter().copied());
                if smallest_fit.is_none() {
                    smallest_fit = Some((cap, product.clone()));
                }
            }
            Ok(cap) => not_fitting.push((cap, product.clone(), nodes.len())),
            Err(e) => return CapacityOutcome::Denied(super::bounds::planner_denial(&e)),
        }
    }
    if let Some((cap, product)) = smallest_fit {
        for (cap, product, n) in &not_fitting {
            warnings.push(format!(
                "{} with {product} cannot hold one request and {} excluded: {}",
                plural(*n, "node", "nodes"),
                if *n == 1 { "is" } else { "are" },
                cap.fix_hint().unwrap_or_default()
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
        // Nothing was judged too small (planner errors or unknown memory): admit, warned.
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
    let hint = largest.fix_hint().unwrap_or_default();
    CapacityOutcome::Denied(denial(
        "spec.engine.maxModelLen",
        "KvCacheTooSmall",
        format!("{hint}; the selected nodes have {}", have.join(", ")),
    ))
}
