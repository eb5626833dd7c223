//! Per compute capability of the candidates: what the runtime's rules
//! ([`crate::compat::rules`]) say runs there, why nothing runs, and which resolution of
//! `auto` the admitted verdict picks.

use std::collections::BTreeSet;

use serde::Serialize;

use super::nodes::Pool;
use super::{denial, plural, Denial};
use crate::api::InferenceDeploymentSpec;
use crate::compat::rules::{self, Violation};
use crate::compat::{AttentionBackend, ComputeCapability, KvCacheDtype, ModelFeatures, VllmVersion};

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

/// Runs the rules once per compute capability of the candidates, newest first; each rule
/// warning joins `warnings` once.
pub(super) fn evaluate(
    spec: &InferenceDeploymentSpec,
    features: &ModelFeatures,
    vllm_version: Option<VllmVersion>,
    pool: &Pool,
    warnings: &mut Vec<String>,
) -> Vec<ArchReport> {
    let mut archs: Vec<ArchReport> = Vec::new();
    let ccs: BTreeSet<ComputeCapability> = pool.candidate_sigs().filter_map(|(sig, _)| sig.cc).collect();
    for cc in ccs.iter().rev() {
        let mut products: BTreeSet<&str> = BTreeSet::new();
        let mut nodes = 0;
        let mut nodes_with_enough_gpus = 0;
        for (sig, n) in pool.candidate_sigs().filter(|(sig, _)| sig.cc == Some(*cc)) {
            nodes += n;
            if sig.enough_gpus {
                nodes_with_enough_gpus += n;
            }
            products.extend(sig.product);
        }
        let ev = rules::evaluate_at(
            spec.engine.runtime,
            *cc,
            features,
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
    archs
}

/// The architectures that run the spec on a node with the GPUs one pod needs.
pub(super) fn runnable(archs: &[ArchReport]) -> Vec<&ArchReport> {
    archs
        .iter()
        .filter(|a| a.resolved.is_some() && a.nodes_with_enough_gpus > 0)
        .collect()
}

/// Why no selected node runs the spec: one denial per broken rule, one for architectures
/// that run it but lack GPUs per node, one when no node has a known compute capability.
pub(super) fn unrunnable_denials(archs: &[ArchReport], pool: &Pool, gpus_per_pod: i64) -> Vec<Denial> {
    let mut denials = rule_denials(archs);
    denials.extend(insufficient_gpus_per_node(archs, pool, gpus_per_pod));
    if archs.is_empty() {
        denials.push(denial(
            "spec.gpu.selector",
            "NoGpuFeatureDiscoveryLabels",
            format!(
                "none of the {} selected GPU nodes has a known compute capability (no GFD labels), so kvfleet cannot tell whether they run this; deploy GPU Feature Discovery or label the nodes with nvidia.com/gpu.product and nvidia.com/gpu.compute.major/minor",
                pool.selected
            ),
        ));
    }
    denials
}

/// One denial per broken rule, in the order rules first fire, naming the architectures
/// where it fired.
fn rule_denials(archs: &[ArchReport]) -> Vec<Denial> {
    let mut denials = Vec::new();
    let mut seen: Vec<&'static str> = Vec::new();
    for arch in archs {
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
    denials
}

/// The denial for architectures that would run the spec but whose nodes all have fewer
/// GPUs than one pod needs.
fn insufficient_gpus_per_node(archs: &[ArchReport], pool: &Pool, gpus_per_pod: i64) -> Option<Denial> {
    let short: Vec<&ArchReport> = archs
        .iter()
        .filter(|a| a.resolved.is_some() && a.nodes_with_enough_gpus == 0)
        .collect();
    if short.is_empty() {
        return None;
    }
    let most = pool
        .candidate_sigs()
        .filter(|(sig, _)| short.iter().any(|a| Some(a.compute_capability) == sig.cc))
        .filter_map(|(sig, _)| sig.gpus)
        .max()
        .unwrap_or(0);
    Some(denial(
        "spec.engine.tensorParallelSize",
        "InsufficientGpusPerNode",
        format!(
            "one replica needs {gpus_per_pod} GPUs on one node (tensorParallelSize/gpu.count); the selected nodes that can run it ({}) have at most {most}; lower tensorParallelSize or select nodes with at least {gpus_per_pod} GPUs",
            describe_archs(short.iter().copied())
        ),
    ))
}

/// The resolution of `auto` every replica runs: the one held by the most nodes with enough
/// GPUs; ties go to the newest architecture (`runnable` is sorted newest first).
pub(super) fn choose_resolution(runnable: &[&ArchReport]) -> Option<(KvCacheDtype, AttentionBackend)> {
    let mut by_resolution: Vec<((KvCacheDtype, AttentionBackend), usize)> = Vec::new();
    for a in runnable {
        let r = a.resolved.unwrap_or_default();
        match by_resolution.iter_mut().find(|(k, _)| *k == r) {
            Some((_, n)) => *n += a.nodes_with_enough_gpus,
            None => by_resolution.push((r, a.nodes_with_enough_gpus)),
        }
    }
    // `max_by_key` keeps the last maximum: reversed, that is the newest architecture.
    by_resolution
        .iter()
        .rev()
        .max_by_key(|(_, n)| *n)
        .map(|(r, _)| *r)
}

/// Per architecture, what the `chosen` resolution leaves out: architectures that resolve
/// otherwise, nodes short of GPUs, architectures where nothing runs.
pub(super) fn exclusion_warnings(
    archs: &[ArchReport],
    chosen: (KvCacheDtype, AttentionBackend),
    gpus_per_pod: i64,
    warnings: &mut Vec<String>,
) {
    let (dtype, backend) = chosen;
    for a in archs {
        let label = describe_archs([a]);
        if let Some(r) = a.resolved {
            if r != chosen {
                warnings.push(format!(
                    "nodes with {label} would resolve to kvCacheDtype {} / attentionBackend {}; excluded so every replica runs {dtype} / {backend}",
                    r.0, r.1
                ));
            } else if a.nodes_with_enough_gpus < a.nodes {
                warnings.push(format!(
                    "{} with {label} {} fewer than the {gpus_per_pod} GPUs one replica needs",
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
            warnings.push(format!("nodes with {label} excluded: {}", why.join("; ")));
        }
    }
}

/// "12.0 (NVIDIA-RTX-PRO-6000-Blackwell), 8.6 (NVIDIA-GeForce-RTX-3090)".
pub(super) fn describe_archs<'a>(archs: impl IntoIterator<Item = &'a ArchReport>) -> String {
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
