//! Which worker pods sit on nodes that can no longer run them (pure).
//!
//! Node affinity is `requiredDuringSchedulingIgnoredDuringExecution`: a node relabelled after
//! its pods were bound (GPU Feature Discovery reporting another GPU, a label fixed by hand)
//! keeps them, and nothing in Kubernetes says so. Each pass that lists the worker pods asks
//! `validate::` whether the configuration they run (kvCacheDtype and attentionBackend as
//! resolved) still runs on each pod's node, and names the pods where it does not.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Pod;

use crate::api::{AttentionBackend, InferenceDeploymentSpec, KvCacheDtype};
use crate::validate::{ClusterFacts, NodeFacts, Verdict, INSUFFICIENT_NODES};

/// A bound worker pod whose node cannot run its configuration now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Misplaced {
    pub pod: String,
    pub uid: Option<String>,
    pub node: String,
    /// What the node has now, e.g. `NVIDIA-H100-80GB-HBM3, compute capability 9.0`.
    pub gpu: String,
    /// Why the configuration cannot run there (the rules' own words).
    pub why: String,
}

/// What the placement check found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Placement {
    /// No worker pod is bound to a node.
    NoPods,
    /// The pods run an earlier generation's configuration, which is not known here.
    NotChecked(String),
    Checked {
        /// Bound, running (not finished, not terminating) worker pods.
        bound: usize,
        /// The configuration they were checked against.
        kv_cache_dtype: KvCacheDtype,
        attention_backend: AttentionBackend,
        misplaced: Vec<Misplaced>,
    },
}

/// Checks every bound worker pod of `pods` against its node in `facts`: it is misplaced when
/// the node is gone, or is not among the nodes `validate` finds able to run `spec` with the
/// running configuration pinned. Cordoned nodes count as nodes (a cordon moves no pod).
pub fn check(
    spec: &InferenceDeploymentSpec,
    running: (KvCacheDtype, AttentionBackend),
    pods: &[Pod],
    facts: &ClusterFacts,
    validate: impl Fn(&InferenceDeploymentSpec, &ClusterFacts) -> Verdict,
) -> Placement {
    let bound: Vec<(&Pod, &str)> = pods
        .iter()
        .filter_map(|p| bound_node(p).map(|n| (p, n)))
        .collect();
    if bound.is_empty() {
        return Placement::NoPods;
    }
    let pinned = pinned(spec, running);
    let mut cluster = facts.clone();
    for n in &mut cluster.nodes {
        n.unschedulable = false;
    }
    let verdict = validate(&pinned, &cluster);
    let fits: BTreeSet<&str> = verdict.compatible_nodes.iter().map(String::as_str).collect();
    // One explanation per node, however many pods it holds.
    let mut explained: BTreeMap<&str, (String, String)> = BTreeMap::new();
    let mut misplaced = Vec::new();
    for (pod, node) in &bound {
        if fits.contains(node) {
            continue;
        }
        let (gpu, why) = explained
            .entry(node)
            .or_insert_with(|| {
                explain(
                    &pinned,
                    cluster.nodes.iter().find(|n| n.name == *node),
                    &cluster,
                    &validate,
                )
            })
            .clone();
        misplaced.push(Misplaced {
            pod: pod.metadata.name.clone().unwrap_or_default(),
            uid: pod.metadata.uid.clone(),
            node: node.to_string(),
            gpu,
            why,
        });
    }
    Placement::Checked {
        bound: bound.len(),
        kv_cache_dtype: running.0,
        attention_backend: running.1,
        misplaced,
    }
}

/// The node of a pod that holds it: bound, not finished, not being deleted.
fn bound_node(p: &Pod) -> Option<&str> {
    if p.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
    if matches!(phase, Some("Succeeded" | "Failed")) {
        return None;
    }
    p.spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .filter(|n| !n.is_empty())
}

/// `spec` with the resolution the pods run in place of `auto`.
fn pinned(
    spec: &InferenceDeploymentSpec,
    (dtype, backend): (KvCacheDtype, AttentionBackend),
) -> InferenceDeploymentSpec {
    let mut s = spec.clone();
    s.engine.kv_cache_dtype = dtype;
    s.engine.attention_backend = backend;
    s
}

/// What the node has, and why `pinned` cannot run there: the rules' denials on that node
/// alone (without the spec's node selection), else its selection.
fn explain(
    pinned: &InferenceDeploymentSpec,
    node: Option<&NodeFacts>,
    cluster: &ClusterFacts,
    validate: &impl Fn(&InferenceDeploymentSpec, &ClusterFacts) -> Verdict,
) -> (String, String) {
    let Some(node) = node else {
        return ("gone".into(), "the node no longer exists".into());
    };
    let gpu = match (node.product(), node.compute_capability()) {
        (Some(p), Some(cc)) => format!("{p}, compute capability {cc}"),
        (None, Some(cc)) => format!("compute capability {cc}"),
        (Some(p), None) => p.to_string(),
        (None, None) => "no GPU Feature Discovery labels".into(),
    };
    let mut unselected = pinned.clone();
    if let Some(g) = unselected.gpu.as_mut() {
        g.selector = None;
    }
    if let Some(p) = unselected.pod.as_mut() {
        p.node_selector.clear();
    }
    let alone = ClusterFacts {
        nodes: vec![node.clone()],
        ..cluster.clone()
    };
    let denials: Vec<String> = validate(&unselected, &alone)
        .denials
        .iter()
        // One node never holds a replica that spans nodes: not this node's fault.
        .filter(|d| d.reason != INSUFFICIENT_NODES)
        .map(|d| format!("{}: {}", d.field, d.message))
        .collect();
    let why = if denials.is_empty() {
        "it no longer matches the spec's node selection (spec.gpu.selector, spec.pod.nodeSelector)"
            .to_string()
    } else {
        denials.join("; ")
    };
    (gpu, why)
}

impl Misplaced {
    /// One sentence for an Event about this pod, with the fix.
    pub fn note(&self, namespace: &str, dtype: KvCacheDtype, backend: AttentionBackend) -> String {
        format!(
            "pod {} runs on node {} ({}), which can no longer run kvCacheDtype {dtype} with attentionBackend {backend}: {}. Delete the pod so that it is rescheduled on a compatible node (kubectl delete pod {} -n {namespace}), or correct the node's labels if they are wrong",
            self.pod, self.node, self.gpu, self.why, self.pod
        )
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::compat::products;

    fn spec(yaml: &str) -> InferenceDeploymentSpec {
        serde_yaml::from_str(yaml).unwrap()
    }

    /// nvfp4 on vLLM, selecting B200s: what runs only on compute capability 10.x.
    fn nvfp4_on_b200() -> InferenceDeploymentSpec {
        spec(
            "model: {name: m, geometry: {layers: 2, queryHeads: 8, kvHeads: 8, headDim: 128}, weights: {format: dummy}}\n\
             engine: {runtime: vllm, kvCacheDtype: nvfp4, maxModelLen: 4096}\n\
             gpu: {selector: {products: [NVIDIA-B200]}}\n",
        )
    }

    fn node(name: &str, product: &str) -> NodeFacts {
        NodeFacts::synthetic(name, products::lookup(product).unwrap(), 8)
    }

    fn pod(name: &str, node: Option<&str>, phase: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "uid": format!("uid-{name}")},
            "spec": {"containers": [], "nodeName": node},
            "status": {"phase": phase}
        }))
        .unwrap()
    }

    fn facts(nodes: Vec<NodeFacts>) -> ClusterFacts {
        ClusterFacts {
            nodes,
            ..ClusterFacts::default()
        }
    }

    fn running(s: &InferenceDeploymentSpec, f: &ClusterFacts) -> (KvCacheDtype, AttentionBackend) {
        let v = crate::validate::validate(s, f);
        assert!(v.allowed(), "{v:#?}");
        let r = v.resolved.unwrap();
        (r.kv_cache_dtype, r.attention_backend)
    }

    #[test]
    fn a_pod_on_a_b200_relabelled_as_an_h100_is_named_with_the_rules_reason() {
        let s = nvfp4_on_b200();
        let before = facts(vec![node("gpu-a", "NVIDIA-B200"), node("gpu-b", "NVIDIA-B200")]);
        let config = running(&s, &before);
        assert_eq!(config.0, KvCacheDtype::Nvfp4);
        let pods = [
            pod("m-1", Some("gpu-a"), "Running"),
            pod("m-2", Some("gpu-b"), "Running"),
        ];
        let ok = check(&s, config, &pods, &before, crate::validate::validate);
        assert!(
            matches!(&ok, Placement::Checked { bound: 2, misplaced, .. } if misplaced.is_empty()),
            "{ok:?}"
        );

        let after = facts(vec![
            node("gpu-a", "NVIDIA-H100-80GB-HBM3"),
            node("gpu-b", "NVIDIA-B200"),
        ]);
        let Placement::Checked { bound, misplaced, .. } =
            check(&s, config, &pods, &after, crate::validate::validate)
        else {
            panic!("checked")
        };
        assert_eq!(bound, 2);
        assert_eq!(misplaced.len(), 1, "{misplaced:?}");
        let m = &misplaced[0];
        assert_eq!((m.pod.as_str(), m.node.as_str()), ("m-1", "gpu-a"));
        assert_eq!(m.gpu, "NVIDIA-H100-80GB-HBM3, compute capability 9.0");
        assert!(
            m.why.contains("spec.engine.kvCacheDtype") && m.why.contains("nvfp4"),
            "{}",
            m.why
        );
        let note = m.note("ml", config.0, config.1);
        assert!(
            note.starts_with("pod m-1 runs on node gpu-a (NVIDIA-H100-80GB-HBM3, compute capability 9.0), which can no longer run kvCacheDtype nvfp4")
                && note.contains("kubectl delete pod m-1 -n ml"),
            "{note}"
        );
    }

    #[test]
    fn with_every_node_relabelled_the_pods_are_misplaced_though_the_spec_is_admitted_on_its_declared_products(
    ) {
        let s = nvfp4_on_b200();
        let config = running(&s, &facts(vec![node("gpu-a", "NVIDIA-B200")]));
        let after = facts(vec![node("gpu-a", "NVIDIA-H100-80GB-HBM3")]);
        // Scale from zero: no node matches, the declared B200 admits it.
        let v = crate::validate::validate(&s, &after);
        assert!(v.allowed() && v.compatible_nodes.is_empty(), "{v:#?}");
        let p = check(
            &s,
            config,
            &[pod("m-1", Some("gpu-a"), "Running")],
            &after,
            crate::validate::validate,
        );
        let Placement::Checked { misplaced, .. } = p else {
            panic!("{p:?}")
        };
        assert_eq!(misplaced.len(), 1);
    }

    #[test]
    fn unbound_finished_and_terminating_pods_are_not_checked_and_a_cordon_moves_nothing() {
        let s = nvfp4_on_b200();
        let mut b200 = node("gpu-a", "NVIDIA-B200");
        let config = running(&s, &facts(vec![b200.clone()]));
        b200.unschedulable = true;
        let mut terminating = pod("m-3", Some("gpu-x"), "Running");
        terminating.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
        ));
        let pods = [
            pod("m-1", None, "Pending"),
            pod("m-2", Some("gpu-x"), "Failed"),
            terminating,
        ];
        let f = facts(vec![b200]);
        assert_eq!(
            check(&s, config, &pods, &f, crate::validate::validate),
            Placement::NoPods
        );
        let p = check(
            &s,
            config,
            &[pod("m-4", Some("gpu-a"), "Running")],
            &f,
            crate::validate::validate,
        );
        assert!(
            matches!(&p, Placement::Checked { misplaced, .. } if misplaced.is_empty()),
            "{p:?}"
        );
    }

    #[test]
    fn a_pod_whose_node_is_gone_is_named() {
        let s = nvfp4_on_b200();
        let f = facts(vec![node("gpu-a", "NVIDIA-B200")]);
        let config = running(&s, &f);
        let p = check(
            &s,
            config,
            &[pod("m-1", Some("gpu-old"), "Running")],
            &f,
            crate::validate::validate,
        );
        let Placement::Checked { misplaced, .. } = p else {
            panic!("{p:?}")
        };
        assert_eq!(misplaced[0].why, "the node no longer exists");
    }

    #[test]
    fn a_node_that_runs_the_config_but_left_the_selection_is_named_for_its_selection() {
        // fp8 on vLLM runs on both; the spec selects B200 only.
        let s = spec(
            "model: {name: m, geometry: {layers: 2, queryHeads: 8, kvHeads: 8, headDim: 128}, weights: {format: dummy}}\n\
             engine: {runtime: vllm, kvCacheDtype: fp8, maxModelLen: 4096}\n\
             gpu: {selector: {products: [NVIDIA-B200]}}\n",
        );
        let f = facts(vec![
            node("gpu-a", "NVIDIA-B200"),
            node("gpu-b", "NVIDIA-H100-80GB-HBM3"),
        ]);
        let config = running(&s, &f);
        let p = check(
            &s,
            config,
            &[pod("m-1", Some("gpu-b"), "Running")],
            &f,
            crate::validate::validate,
        );
        let Placement::Checked { misplaced, .. } = p else {
            panic!("{p:?}")
        };
        assert!(misplaced[0].why.contains("node selection"), "{:?}", misplaced[0]);
    }
}
