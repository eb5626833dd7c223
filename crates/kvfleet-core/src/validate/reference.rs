//! The per-node implementation of [`super::validate`] as it was before signatures
//! (kept under `cfg(test)` so tests can prove the grouped one gives identical verdicts).
#![allow(clippy::all)]

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::{NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm};

use super::{labels, ArchReport, CapacityBasis, ClusterFacts, Denial, NodeFacts, Verdict};
use crate::api::{CapacityStatus, InferenceDeploymentSpec, ResolvedConfig, Runtime};
use crate::compat::rules;
use crate::compat::{products, AttentionBackend, ComputeCapability, KvCacheDtype};

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

// The spec checks and model features are not part of the grouping: shared.
use super::{model_features, spec_checks};

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
    super::multi_node_checks(
        spec,
        facts,
        super::scale_from_zero(spec, validate_nodes(spec, facts), validate_nodes),
    )
}

fn validate_nodes(spec: &InferenceDeploymentSpec, facts: &ClusterFacts) -> Verdict {
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
    let gpus_per_replica = super::gpus_per_pod(spec, facts);

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
    let compatible: Vec<&Candidate> = match plan_capacity(spec, dtype, &compatible, &mut verdict.warnings) {
        CapacityOutcome::Denied(d) => {
            verdict.denials.push(d);
            return verdict;
        }
        // Spec checks denied and the capacity fits (or was not judged): they stand alone.
        _ if !verdict.denials.is_empty() => return verdict,
        CapacityOutcome::NotPlanned => compatible,
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
        kv_cache_dtype: dtype,
        attention_backend: backend,
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
    // A larger tensorParallelSize is a fix only where the nodes have the GPUs for it.
    let max_gpus = compatible.iter().filter_map(|c| c.node.gpus()).max();
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
    let hint = largest.fix_hint_on(max_gpus).unwrap_or_default();
    CapacityOutcome::Denied(denial(
        "spec.engine.maxModelLen",
        "KvCacheTooSmall",
        format!("{hint}; the selected nodes have {}", have.join(", ")),
    ))
}
