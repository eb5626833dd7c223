//! What an admitted verdict carries: the resolution every replica runs, the nodes that
//! run it (after the capacity check), warnings about the nodes left out, the resolved
//! configuration and the node affinity that keeps pods on those nodes.

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::{NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm};

use super::arch::{self, ArchReport};
use super::nodes::{Candidate, Pool};
use super::signatures::Signature;
use super::{capacity, labels, Verdict};
use crate::api::{InferenceDeploymentSpec, ResolvedConfig};
use crate::compat::{products, ComputeCapability};

/// Completes `verdict` on the `runnable` architectures (at least one): picks the
/// resolution, keeps the nodes that run it and whose GPUs hold one request, warns about
/// the others and builds the resolved configuration and node affinity. Spec checks that
/// denied are reported together with a capacity denial.
pub(super) fn admit(
    spec: &InferenceDeploymentSpec,
    mut verdict: Verdict,
    archs: &[ArchReport],
    runnable: &[&ArchReport],
    pool: &Pool,
    gpus_per_pod: i64,
) -> Verdict {
    let Some((dtype, backend)) = arch::choose_resolution(runnable) else {
        return verdict;
    };
    let chosen_ccs: BTreeSet<ComputeCapability> = runnable
        .iter()
        .filter(|a| a.resolved == Some((dtype, backend)))
        .map(|a| a.compute_capability)
        .collect();
    let compatible: Vec<&Candidate> = pool
        .candidates
        .iter()
        .filter(|c| chosen_ccs.contains(&c.cc) && c.enough_gpus)
        .collect();
    let Some((compatible, restrict_products)) =
        capacity::fit(spec, dtype, compatible, &pool.sigs.sigs, &mut verdict)
    else {
        return verdict;
    };
    verdict.compatible_nodes = compatible.iter().map(|c| c.node.name.clone()).collect();

    if compatible.len() < pool.selected {
        verdict.warnings.insert(
            0,
            format!(
                "{} of {} selected GPU nodes can run this; the affinity excludes the others",
                compatible.len(),
                pool.selected
            ),
        );
    }
    arch::exclusion_warnings(archs, (dtype, backend), gpus_per_pod, &mut verdict.warnings);

    let compatible_sigs = signatures_of(&compatible, &pool.sigs.sigs);
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

/// The signatures of the `compatible` nodes, in signature order.
fn signatures_of<'s, 'a>(compatible: &[&Candidate<'a>], sigs: &'s [Signature<'a>]) -> Vec<&'s Signature<'a>> {
    let mut used = vec![false; sigs.len()];
    for c in compatible {
        used[c.sig] = true;
    }
    sigs.iter()
        .zip(used)
        .filter(|(_, used)| *used)
        .map(|(sig, _)| sig)
        .collect()
}

/// Required node affinity: one term per chosen compute capability, by the GFD
/// `compute.major/minor` labels when every compatible node of it carries them, else by
/// product, plus terms by the compute labels for compatible nodes without a product label (or
/// with a blank one); restricted to products too when the spec selects products, and to exactly the
/// compatible products when some nodes were left out for memory (`restrict_products`).
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
        let by_labels = || {
            vec![
                req(labels::COMPUTE_MAJOR, vec![cc.major.to_string()]),
                req(labels::COMPUTE_MINOR, vec![cc.minor.to_string()]),
            ]
        };
        let term = |exprs| NodeSelectorTerm {
            match_expressions: Some(exprs),
            match_fields: None,
        };
        if all_labelled && selected_products.is_empty() && !restrict_products {
            terms.push(term(by_labels()));
            continue;
        }
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
        if !products.is_empty() {
            let mut exprs = if all_labelled { by_labels() } else { Vec::new() };
            exprs.push(req(labels::PRODUCT, products.into_iter().collect()));
            terms.push(term(exprs));
        }
        // Compatible nodes known by their compute labels alone (a product label absent or
        // blank): a term by product cannot admit them, so they get terms by those labels,
        // for nodes whose product label is absent, or blank as theirs is.
        let unnamed: BTreeSet<Option<&String>> = sigs
            .iter()
            .filter(|sig| sig.product.is_none())
            .map(|sig| sig.node.labels.get(labels::PRODUCT))
            .collect();
        if unnamed.contains(&None) {
            let mut exprs = by_labels();
            exprs.push(NodeSelectorRequirement {
                key: labels::PRODUCT.to_string(),
                operator: "DoesNotExist".to_string(),
                values: None,
            });
            terms.push(term(exprs));
        }
        let blank: Vec<String> = unnamed.into_iter().flatten().cloned().collect();
        if !blank.is_empty() {
            let mut exprs = by_labels();
            exprs.push(req(labels::PRODUCT, blank));
            terms.push(term(exprs));
        }
    }
    NodeAffinity {
        required_during_scheduling_ignored_during_execution: Some(NodeSelector {
            node_selector_terms: terms,
        }),
        preferred_during_scheduling_ignored_during_execution: None,
    }
}
