//! KV capacity of one replica on the compatible nodes: nodes whose GPUs
//! cannot hold one maxModelLen request are left out; none left is a denial naming the fix.
//! The planner runs once per distinct GPU memory, not per node.

use std::collections::HashSet;

use serde::Serialize;

use super::facts::GPU_MEMORY_MIB_MAX;
use super::nodes::{Candidate, Pool};
use super::signatures::Signature;
use super::{bounds, denial, labels, plural, Denial, Verdict};
use crate::api::{CapacityStatus, InferenceDeploymentSpec, Runtime};
use crate::compat::KvCacheDtype;
use crate::plan::{Geometry, SpecCapacity};

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

/// Keeps the `compatible` nodes whose GPUs hold one request, recording the capacity and
/// its basis in `verdict`. `None` when `verdict` is final: capacity denied it, or spec
/// checks did (they stand alone when the capacity fits). Else the nodes kept, and whether
/// some were left out (the affinity then names exactly the products kept).
pub(super) fn fit<'c, 'a>(
    spec: &InferenceDeploymentSpec,
    dtype: KvCacheDtype,
    compatible: Vec<&'c Candidate<'a>>,
    sigs: &[Signature<'a>],
    verdict: &mut Verdict,
) -> Option<(Vec<&'c Candidate<'a>>, bool)> {
    match plan(spec, dtype, &compatible, sigs, &mut verdict.warnings) {
        Outcome::Denied(d) => {
            verdict.denials.push(d);
            None
        }
        _ if !verdict.denials.is_empty() => None,
        Outcome::NotPlanned => Some((compatible, false)),
        Outcome::Planned {
            fits,
            fitting,
            capacity,
            basis,
        } => {
            let restrict_products = fitting < compatible.len();
            verdict.capacity = Some(capacity);
            verdict.capacity_basis = Some(basis);
            if !restrict_products {
                return Some((compatible, false));
            }
            // A node stays when a node that fits has its name (names are unique in a
            // cluster; by name, as the per-node check always did).
            let names: HashSet<&str> = compatible
                .iter()
                .zip(&fits)
                .filter(|(_, fits)| **fits)
                .map(|(c, _)| c.node.name.as_str())
                .collect();
            let kept = compatible
                .into_iter()
                .filter(|c| names.contains(c.node.name.as_str()))
                .collect();
            Some((kept, true))
        }
    }
}

enum Outcome {
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

/// The compatible nodes grouped by the memory of one GPU.
struct MemoryGroups<'a> {
    /// (memory, product of its first node, nodes), by first appearance.
    groups: Vec<(u64, &'a str, usize)>,
    /// Per compatible node, its group; `None`: memory unknown.
    group_of_node: Vec<Option<usize>>,
    /// Names of the nodes whose memory is unknown.
    unknown: Vec<&'a str>,
}

/// Groups the `compatible` nodes by GPU memory, computed once per signature.
fn memory_groups<'a>(compatible: &[&Candidate<'a>], sigs: &[Signature<'a>]) -> MemoryGroups<'a> {
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
    MemoryGroups {
        groups,
        group_of_node,
        unknown,
    }
}

/// Plans capacity per distinct GPU memory among the compatible nodes.
fn plan<'a>(
    spec: &InferenceDeploymentSpec,
    dtype: KvCacheDtype,
    compatible: &[&Candidate<'a>],
    sigs: &[Signature<'a>],
    warnings: &mut Vec<String>,
) -> Outcome {
    let Some(g) = &spec.model.geometry else {
        return Outcome::NotPlanned;
    };
    let geometry = match Geometry::from_spec(g) {
        Ok(geometry) => geometry,
        Err(e) => return Outcome::Denied(bounds::planner_denial(&e)),
    };
    // A larger tensorParallelSize is a fix only where the nodes have the GPUs for it.
    let max_gpus = compatible.iter().filter_map(|c| c.node.gpus()).max();
    let MemoryGroups {
        groups,
        group_of_node,
        unknown,
    } = memory_groups(compatible, sigs);
    mislabelled_memory_warning(compatible, warnings);
    if !unknown.is_empty() {
        warnings.push(format!(
            "KV capacity not checked on {} ({}): no nvidia.com/gpu.memory label and an unknown product",
            plural(unknown.len(), "node", "nodes"),
            unknown.join(", ")
        ));
    }
    // Smallest memory first: the first group that fits is the capacity every pod has.
    let mut by_memory: Vec<usize> = (0..groups.len()).collect();
    by_memory.sort_by_key(|g| groups[*g].0);
    let mut group_fits = vec![true; groups.len()];
    let mut fitting = unknown.len();
    let mut smallest_fit: Option<(SpecCapacity, String)> = None;
    let mut not_fitting: Vec<(SpecCapacity, String, usize)> = Vec::new();
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
            Err(e) => return Outcome::Denied(bounds::planner_denial(&e)),
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
        let (capacity, basis) = capacity(spec, cap, product);
        return Outcome::Planned {
            fits: group_of_node
                .iter()
                .map(|g| g.is_none_or(|g| group_fits[g]))
                .collect(),
            fitting,
            capacity,
            basis,
        };
    }
    if !unknown.is_empty() || not_fitting.is_empty() {
        // Nothing was judged too small (unknown memory): admit, warned.
        return Outcome::NotPlanned;
    }
    Outcome::Denied(too_small(&not_fitting, max_gpus))
}

/// Where no architecture runs the spec: the denial when not one selected GPU holds one
/// request of maxModelLen even with the requested kvCacheDtype (a dtype a rule's fix names
/// instead may need more), so that it comes in the same answer as the rules' denials.
pub(super) fn too_small_anywhere(spec: &InferenceDeploymentSpec, pool: &Pool) -> Option<Denial> {
    let candidates: Vec<&Candidate> = pool.candidates.iter().collect();
    if candidates.is_empty() {
        return None;
    }
    let dtype = spec.engine.kv_cache_dtype;
    match plan(spec, dtype, &candidates, &pool.sigs.sigs, &mut Vec::new()) {
        Outcome::Denied(mut d) if d.reason == TOO_SMALL => {
            d.message.push_str(&format!(
                " (judged with kvCacheDtype {dtype} as requested; a KV dtype of more bytes needs more)"
            ));
            Some(d)
        }
        _ => None,
    }
}

/// Reason of a maxModelLen that no compatible GPU holds.
const TOO_SMALL: &str = "KvCacheTooSmall";

/// One warning naming every compatible node whose `nvidia.com/gpu.memory` label is not a
/// GPU memory in MiB, and the label's value: it is ignored (the product's memory is used).
fn mislabelled_memory_warning(compatible: &[&Candidate], warnings: &mut Vec<String>) {
    let bad: Vec<String> = compatible
        .iter()
        .filter_map(|c| {
            let value = c.node.unreadable_gpu_memory()?;
            Some(format!("{} ({:?})", c.node.name, bounds_truncated(value)))
        })
        .collect();
    if bad.is_empty() {
        return;
    }
    warnings.push(format!(
        "label {} of {}: not a GPU memory in MiB (1 to {GPU_MEMORY_MIB_MAX}), so it is ignored and the product's memory is used; fix the label (GPU Feature Discovery writes it) or remove it",
        labels::MEMORY_MIB,
        plural_list(&bad)
    ));
}

fn bounds_truncated(s: &str) -> &str {
    let mut end = s.len().min(32);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn plural_list(items: &[String]) -> String {
    if items.len() == 1 {
        format!("node {}", items[0])
    } else {
        format!("nodes {}", items.join(", "))
    }
}

/// The capacity of one replica on the smallest GPU that fits (`product`), in the runtime's
/// own count, and its arithmetic.
fn capacity(
    spec: &InferenceDeploymentSpec,
    cap: SpecCapacity,
    product: String,
) -> (CapacityStatus, CapacityBasis) {
    let (tokens, concurrency) = match spec.engine.runtime {
        Runtime::Kvfleet => (cap.kvfleet_tokens, cap.max_concurrency),
        Runtime::Vllm => (cap.vllm_tokens, cap.vllm_max_concurrency),
    };
    let capacity = CapacityStatus {
        tokens_per_replica: i64::try_from(tokens).ok(),
        max_concurrency: Some(concurrency),
        measured_tokens_per_replica: None,
        vllm_tokens_per_replica: i64::try_from(cap.vllm_tokens).ok(),
    };
    let basis = CapacityBasis {
        product,
        gpu_memory_bytes: cap.plan.memory.gpu_memory_bytes.unwrap_or_default(),
        available_kv_bytes: cap.available_kv_bytes,
        bytes_per_request: cap.bytes_per_request,
        kvfleet_tokens: cap.kvfleet_tokens,
        vllm_tokens: cap.vllm_tokens,
        notes: cap.explanation,
    };
    (capacity, basis)
}

/// The denial when no GPU holds one request: the fix for the largest GPU (the last of
/// `not_fitting`, which is sorted by memory), and what the nodes have.
fn too_small(not_fitting: &[(SpecCapacity, String, usize)], max_gpus: Option<i64>) -> Denial {
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
    denial(
        "spec.engine.maxModelLen",
        TOO_SMALL,
        format!("{hint}; the selected nodes have {}", have.join(", ")),
    )
}
