//! What must hold of every [`super::validate`] verdict, checked on the specs of
//! deploy/examples and tests/fixtures/admission and crafted ones, on node sets that mix
//! products, unlabelled, cordoned, CPU-only and selector-labelled nodes, and on random
//! specs and node sets.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use k8s_openapi::api::core::v1::{Node, NodeAffinity};
use kube_core::CustomResourceExt;
use proptest::prelude::*;
use serde::Deserialize;

use super::spec::{model_features, spec_checks, vllm_version_check};
use super::*;
use crate::api::{
    GpuSelector, GpuSpec, InferenceDeployment, LayerType, ModelGeometry, PodOverrides, VllmEngineSpec,
};
use crate::compat::rules::{self, Violation};
use crate::compat::{products, AttentionBackend, ComputeCapability, KvCacheDtype, Runtime};

// === inputs ===

/// The workspace root, where `deploy/` and `tests/fixtures/` live.
fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn files(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == ext))
        .collect();
    out.sort();
    out
}

fn yaml_spec(yaml: &str) -> InferenceDeploymentSpec {
    serde_yaml::from_str(yaml).unwrap_or_else(|e| panic!("{e}: {yaml}"))
}

const GEOMETRY: &str =
    "{layers: 32, queryHeads: 32, kvHeads: 8, headDim: 128, hiddenSize: 4096, vocabSize: 128256}";

/// Specs of the repository plus crafted ones that reach every branch of the verdict.
fn specs() -> &'static [(String, InferenceDeploymentSpec)] {
    static SPECS: OnceLock<Vec<(String, InferenceDeploymentSpec)>> = OnceLock::new();
    SPECS.get_or_init(load_specs)
}

fn load_specs() -> Vec<(String, InferenceDeploymentSpec)> {
    let mut out = Vec::new();
    for path in files(&root().join("deploy/examples"), "yaml") {
        let doc: serde_yaml::Value = serde_yaml::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        if doc.get("kind").and_then(|k| k.as_str()) == Some("InferenceDeployment") {
            let spec = serde_yaml::from_value(doc["spec"].clone()).unwrap();
            out.push((path.display().to_string(), spec));
        }
    }
    for path in files(&root().join("tests/fixtures/admission"), "json") {
        let review: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        for which in ["object", "oldObject"] {
            let object = &review["request"][which];
            if object["kind"] == "InferenceDeployment" {
                if let Ok(spec) = serde_json::from_value(object["spec"].clone()) {
                    out.push((format!("{} {which}", path.display()), spec));
                }
            }
        }
    }
    assert!(
        out.len() >= 10,
        "expected the repository's examples and fixtures, got {}",
        out.len()
    );
    let crafted = [
        format!("model: {{name: m, geometry: {GEOMETRY}}}\nengine: {{runtime: vllm}}"),
        format!("model: {{name: m, geometry: {GEOMETRY}}}\nengine: {{runtime: kvfleet}}"),
        format!("model: {{name: m, geometry: {GEOMETRY}}}\nengine: {{runtime: vllm, kvCacheDtype: nvfp4}}"),
        format!("model: {{name: m, geometry: {GEOMETRY}}}\nengine: {{runtime: vllm, kvCacheDtype: fp8_e4m3, tensorParallelSize: 4}}"),
        format!("model: {{name: m, geometry: {GEOMETRY}}}\nengine: {{runtime: vllm, tensorParallelSize: 8}}"),
        format!("model: {{name: m, geometry: {GEOMETRY}}}\nengine: {{runtime: vllm, tensorParallelSize: 3}}"),
        format!("model: {{name: m, geometry: {GEOMETRY}}}\nengine: {{runtime: vllm, maxModelLen: 1048576}}"),
        format!("model: {{name: m, geometry: {GEOMETRY}}}\nengine: {{runtime: vllm, maxModelLen: 400000}}"),
        format!("model: {{name: m, geometry: {GEOMETRY}, weightBytes: 60Gi}}\nengine: {{runtime: vllm, maxModelLen: 131072}}"),
        format!("model: {{name: m, geometry: {GEOMETRY}}}\nengine: {{runtime: vllm}}\ngpu: {{count: 2, selector: {{products: [NVIDIA-H100-80GB-HBM3, NVIDIA-A10]}}}}"),
        format!("model: {{name: m, geometry: {GEOMETRY}}}\nengine: {{runtime: vllm}}\ngpu: {{selector: {{products: [NVIDIA-Made-Up]}}}}"),
        format!("model: {{name: m, geometry: {GEOMETRY}}}\nengine: {{runtime: vllm}}\ngpu: {{selector: {{minComputeCapability: \"9.0\"}}}}"),
        format!("model: {{name: m, geometry: {GEOMETRY}}}\nengine: {{runtime: vllm}}\ngpu: {{selector: {{minComputeCapability: \"nine\"}}}}"),
        format!("model: {{name: m, geometry: {GEOMETRY}}}\nengine: {{runtime: vllm}}\npod: {{nodeSelector: {{pool: a}}}}"),
        format!("model: {{name: m, geometry: {GEOMETRY}}}\nengine: {{runtime: vllm, attentionBackend: FLASHINFER, gpuMemoryUtilization: 0.95}}"),
        "model: {name: m, config: {configMapRef: {name: cm, key: config.json}}}\nengine: {runtime: vllm, kvCacheDtype: fp8}".to_string(),
        "model: {name: m}\nengine: {runtime: kvfleet, kvCacheDtype: fp8_e5m2}".to_string(),
    ];
    for (i, yaml) in crafted.iter().enumerate() {
        out.push((format!("crafted {i}"), yaml_spec(yaml)));
    }
    out
}

/// A node as GFD labels it, with allocatable GPUs (bench/webhook.rs's `gpu_node`).
fn gfd(name: &str, product: &str, major: u32, minor: u32, gpus: i64) -> NodeFacts {
    let labels = [
        ("kubernetes.io/hostname", name.to_string()),
        ("nvidia.com/gpu.present", "true".to_string()),
        (labels::PRODUCT, product.to_string()),
        (labels::COMPUTE_MAJOR, major.to_string()),
        (labels::COMPUTE_MINOR, minor.to_string()),
        (labels::COUNT, gpus.to_string()),
    ];
    NodeFacts {
        name: name.to_string(),
        labels: labels.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
        allocatable_gpus: Some(gpus),
        unschedulable: false,
    }
}

/// The benchmark's fleet: nodes of five products, round robin.
fn fleet(n: usize) -> Vec<NodeFacts> {
    let kinds = [
        ("NVIDIA-H100-80GB-HBM3", 9, 0, 8),
        ("NVIDIA-B200", 10, 0, 8),
        ("NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition", 12, 0, 4),
        ("NVIDIA-GeForce-RTX-3090", 8, 6, 2),
        ("NVIDIA-L4", 8, 9, 4),
    ];
    (0..n)
        .map(|i| {
            let (p, major, minor, gpus) = kinds[i % kinds.len()];
            gfd(&format!("gpu-{i:04}"), p, major, minor, gpus)
        })
        .collect()
}

fn example_nodes(file: &str) -> Vec<NodeFacts> {
    let text = std::fs::read_to_string(root().join("deploy/examples/nodes").join(file)).unwrap();
    let mut nodes = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let v = serde_yaml::Value::deserialize(doc).unwrap();
        let items = match v.get("kind").and_then(|k| k.as_str()) {
            Some("NodeList") => v["items"].as_sequence().unwrap().clone(),
            Some("Node") => vec![v],
            _ => continue,
        };
        for item in items {
            nodes.push(NodeFacts::from_node(
                &serde_yaml::from_value::<Node>(item).unwrap(),
            ));
        }
    }
    assert!(!nodes.is_empty(), "{file} holds no nodes");
    nodes
}

/// Node sets: the examples, a 500-node fleet and mixes with the awkward cases.
fn node_sets() -> Vec<(String, Vec<NodeFacts>)> {
    let mut out: Vec<(String, Vec<NodeFacts>)> = files(&root().join("deploy/examples/nodes"), "yaml")
        .iter()
        .map(|p| {
            let file = p.file_name().unwrap().to_string_lossy().into_owned();
            (file.clone(), example_nodes(&file))
        })
        .collect();
    out.push(("fleet-500".into(), fleet(500)));
    out.push(("empty".into(), vec![]));

    let mut mixed = fleet(60);
    for (i, n) in mixed.iter_mut().enumerate() {
        if i % 7 == 0 {
            n.unschedulable = true;
        }
        n.labels
            .insert("pool".into(), if i % 3 == 0 { "a" } else { "b" }.into());
        if i % 11 == 0 {
            n.labels.insert(labels::MEMORY_MIB.into(), "16384".into());
        }
    }
    let mut unlabelled = NodeFacts {
        name: "bare-gpu".into(),
        allocatable_gpus: Some(8),
        ..NodeFacts::default()
    };
    mixed.push(unlabelled.clone());
    unlabelled.name = "bare-gpu-pool-a".into();
    unlabelled.labels.insert("pool".into(), "a".into());
    mixed.push(unlabelled);
    mixed.push(NodeFacts {
        name: "cpu-0".into(),
        labels: [("pool".to_string(), "a".to_string())].into(),
        ..NodeFacts::default()
    });
    let mut product_only = gfd("product-only", "NVIDIA-A100-SXM4-80GB", 8, 0, 4);
    product_only.labels.remove(labels::COMPUTE_MAJOR);
    product_only.labels.remove(labels::COMPUTE_MINOR);
    mixed.push(product_only);
    let mut unknown = gfd("unknown-product", "NVIDIA-Made-Up", 0, 0, 4);
    unknown.labels.remove(labels::COMPUTE_MAJOR);
    unknown.labels.remove(labels::COMPUTE_MINOR);
    mixed.push(unknown);
    let mut shared = gfd("h100-shared", "NVIDIA-H100-80GB-HBM3-SHARED", 9, 0, 8);
    shared.allocatable_gpus = None;
    mixed.push(shared);
    let mut no_alloc = gfd("zero-alloc", "NVIDIA-H200", 9, 0, 0);
    no_alloc
        .labels
        .insert(labels::MEMORY_MIB.into(), "garbage".into());
    mixed.push(no_alloc);
    out.push(("mixed".into(), mixed));

    let cordoned: Vec<NodeFacts> = fleet(10)
        .into_iter()
        .map(|mut n| {
            n.unschedulable = true;
            n
        })
        .collect();
    out.push(("all-cordoned".into(), cordoned));
    out.push((
        "unlabelled-only".into(),
        (0..5)
            .map(|i| NodeFacts {
                name: format!("bare-{i}"),
                allocatable_gpus: Some(4),
                ..NodeFacts::default()
            })
            .collect(),
    ));
    out
}

/// 0: the spec's own selectors; 1: `pod.nodeSelector` pool=a; 2: three products (with
/// spaces and a sharing suffix); 3: minComputeCapability 8.9.
fn apply_selector(s: &mut InferenceDeploymentSpec, which: u8) {
    match which {
        1 => {
            s.pod.get_or_insert_with(PodOverrides::default).node_selector =
                [("pool".to_string(), "a".to_string())].into();
        }
        2 => {
            s.gpu.get_or_insert_with(GpuSpec::default).selector = Some(GpuSelector {
                products: vec![
                    "NVIDIA-H100-80GB-HBM3".into(),
                    " NVIDIA-L4 ".into(),
                    "NVIDIA-B200-SHARED".into(),
                ],
                min_compute_capability: None,
            })
        }
        3 => {
            s.gpu.get_or_insert_with(GpuSpec::default).selector = Some(GpuSelector {
                products: vec![],
                min_compute_capability: Some("8.9".into()),
            })
        }
        _ => {}
    }
}

const PRODUCTS: &[&str] = &[
    "NVIDIA-H100-80GB-HBM3",
    "NVIDIA-B200",
    "NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition",
    "NVIDIA-GeForce-RTX-3090",
    "NVIDIA-L4",
    "NVIDIA-A10",
    "Tesla-T4",
    "NVIDIA-H200-SHARED",
    "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb",
    "nvidia-a100-sxm4-80gb",
    "GeForce-RTX-2080-Ti",
    "NVIDIA-Made-Up",
    " ",
];

prop_compose! {
    /// A node with any mix of GFD labels, GPUs, cordon and pool; names repeat (n0..n39).
    fn arb_node()(
        product in proptest::option::weighted(0.85, proptest::sample::select(PRODUCTS)),
        cc in proptest::option::weighted(0.6, proptest::sample::select(&["9:0", "10:0", "12:0", "8:6", "8:9", "7:5", "8:0", "x:0", "9:"][..])),
        count in proptest::option::weighted(0.6, proptest::sample::select(&["1", "2", "4", "8", "0", "many"][..])),
        memory in proptest::option::weighted(0.3, proptest::sample::select(&["16384", "81559", "24576", "0", "big", "183359"][..])),
        allocatable in proptest::option::weighted(0.7, 0i64..9),
        unschedulable in proptest::bool::weighted(0.15),
        pool in proptest::option::of(proptest::sample::select(&["a", "b"][..])),
        present in proptest::bool::ANY,
        name in 0u8..40,
    ) -> NodeFacts {
        let mut labels = BTreeMap::new();
        if let Some(p) = product {
            labels.insert(labels::PRODUCT.to_string(), p.to_string());
        }
        if let Some(cc) = cc {
            let (major, minor) = cc.split_once(':').unwrap();
            labels.insert(labels::COMPUTE_MAJOR.to_string(), major.to_string());
            labels.insert(labels::COMPUTE_MINOR.to_string(), minor.to_string());
        }
        if let Some(c) = count {
            labels.insert(labels::COUNT.to_string(), c.to_string());
        }
        if let Some(m) = memory {
            labels.insert(labels::MEMORY_MIB.to_string(), m.to_string());
        }
        if let Some(p) = pool {
            labels.insert("pool".to_string(), p.to_string());
        }
        if present {
            labels.insert("nvidia.com/gpu.present".to_string(), "true".to_string());
        }
        NodeFacts { name: format!("n{name}"), labels, allocatable_gpus: allocatable, unschedulable }
    }
}

/// Node sets of a cluster: names are unique (as the API server keeps them).
fn arb_nodes(max: usize) -> impl Strategy<Value = Vec<NodeFacts>> {
    proptest::collection::vec(arb_node(), 0..max).prop_map(|mut nodes| {
        for (i, n) in nodes.iter_mut().enumerate() {
            n.name = format!("node-{i}");
        }
        nodes
    })
}

prop_compose! {
    /// A spec of [`specs`] with its parallelism, KV dtype, context, replicas, vLLM release
    /// and selectors varied.
    fn arb_example_spec()(
        spec_index in 0usize..64,
        tp in proptest::sample::select(&[1, 2, 4, 8, 16][..]),
        selector in 0u8..4,
        dtype in proptest::sample::select(&KvCacheDtype::ALL[..]),
        max_model_len in proptest::sample::select(&[4096i64, 32768, 131072, 1_048_576][..]),
        replicas in 0i32..4,
        version in proptest::option::weighted(0.2, proptest::sample::select(&["0.11.0", "0.21.0", "0.99.0"][..])),
    ) -> InferenceDeploymentSpec {
        let specs = specs();
        let mut s = specs[spec_index % specs.len()].1.clone();
        s.engine.tensor_parallel_size = tp;
        s.engine.kv_cache_dtype = dtype;
        s.engine.max_model_len = max_model_len;
        s.replicas = replicas;
        if let Some(v) = version {
            s.engine.vllm = Some(VllmEngineSpec { version: Some(v.to_string()) });
        }
        apply_selector(&mut s, selector);
        s
    }
}

fn product_label() -> impl Strategy<Value = Option<String>> {
    let known: Vec<String> = products::PRODUCTS.iter().map(|p| p.label.to_string()).collect();
    prop_oneof![
        2 => prop::sample::select(known).prop_map(Some),
        1 => prop::sample::select(vec!["NVIDIA-H100-80GB-HBM3-SHARED", "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb", "Mystery-GPU", ""]).prop_map(|s| Some(s.to_string())),
        1 => Just(None),
    ]
}

prop_compose! {
    fn arb_geometry()(layers in 1i32..6, q in 1i32..65, kv in 0i32..17, head in prop::sample::select(vec![0, 64, 80, 128, 256, 512]),
                      window in prop::option::of(0i32..9000), sliding in prop::collection::vec(any::<bool>(), 0..6),
                      global in prop::option::of(prop::sample::select(vec![128, 512])), global_kv in prop::option::of(0i32..9),
                      mla in any::<bool>()) -> ModelGeometry {
        ModelGeometry {
            layers, query_heads: q, kv_heads: kv, head_dim: head, sliding_window: window,
            layer_types: if sliding.is_empty() { None } else {
                Some(sliding.iter().map(|s| if *s { LayerType::SlidingAttention } else { LayerType::FullAttention }).collect())
            },
            global_head_dim: global, global_kv_heads: global_kv,
            kv_lora_rank: mla.then_some(512), qk_rope_head_dim: mla.then_some(64),
            draft_layers: None, hidden_size: None, vocab_size: None, intermediate_size: None, moe: None,
        }
    }
}

/// `s` with the values [`arb_spec`] draws below their schema minimum raised to it (or, for
/// gpuMemoryUtilization, to a safe value), so that a test of specs within bounds keeps most
/// draws.
fn within_minimums(mut s: InferenceDeploymentSpec) -> InferenceDeploymentSpec {
    let e = &mut s.engine;
    e.tensor_parallel_size = e.tensor_parallel_size.max(1);
    e.pipeline_parallel_size = e.pipeline_parallel_size.max(1);
    if !(e.gpu_memory_utilization > 0.0 && e.gpu_memory_utilization <= 1.0) {
        e.gpu_memory_utilization = 0.85;
    }
    if let Some(g) = s.model.geometry.as_mut() {
        g.kv_heads = g.kv_heads.max(1);
        g.head_dim = g.head_dim.max(8);
        g.sliding_window = g.sliding_window.map(|w| w.max(1));
        g.global_kv_heads = g.global_kv_heads.map(|k| k.max(1));
    }
    s
}

prop_compose! {
    /// Any spec, valid or not, values over their bounds included.
    fn arb_spec()(g in prop::option::of(arb_geometry()),
                  runtime in prop::sample::select(vec![Runtime::Kvfleet, Runtime::Vllm]),
                  dtype in prop::sample::select(KvCacheDtype::ALL.to_vec()),
                  backend in prop::sample::select(AttentionBackend::ALL.to_vec()),
                  tp in -1i32..20, pp in prop::sample::select(vec![0, 1, 1, 1, 2, 3]),
                  count in prop::option::of(0i32..20), util in -0.5f64..1.5,
                  products in prop::collection::vec(product_label(), 0..3),
                  min_cc in prop::option::of(prop::sample::select(vec!["8.0", "9.0", "10.0", "12.1", "junk"])),
                  pool in prop::option::of(prop::sample::select(vec!["a", "b"])),
                  version in prop::option::of(prop::sample::select(vec!["0.11.0", "0.14.0", "0.21.0", "0.29.0", "0.99.0", "x"])),
                  weights in prop::sample::select(vec![None, Some("{format: dummy}"), Some("{format: safetensors}"), Some("{format: safetensors, pvcName: p}"), Some("{format: dummy, huggingFace: {}}")]),
                  replicas in 0i32..5, max_model_len in prop::sample::select(vec![4096i64, 131072, 1_048_576]),
                  over in 0u8..12, non_causal in any::<bool>()) -> InferenceDeploymentSpec {
        let mut s: InferenceDeploymentSpec = serde_yaml::from_str("model: {name: m, config: {configMapRef: {name: c}}}").unwrap();
        if g.is_some() { s.model.config = None; }
        s.model.geometry = g;
        s.model.weights = weights.map(|w| serde_yaml::from_str(w).unwrap());
        s.engine.runtime = runtime;
        s.engine.kv_cache_dtype = dtype;
        s.engine.attention_backend = backend;
        s.engine.tensor_parallel_size = tp;
        s.engine.pipeline_parallel_size = pp;
        s.engine.gpu_memory_utilization = util;
        s.engine.non_causal = non_causal;
        s.engine.max_model_len = max_model_len;
        s.replicas = replicas;
        s.engine.vllm = version.map(|v| VllmEngineSpec { version: Some(v.to_string()) });
        s.gpu = Some(GpuSpec {
            count,
            selector: Some(GpuSelector {
                products: products.into_iter().flatten().collect(),
                min_compute_capability: min_cc.map(str::to_string),
            }),
        });
        if let Some(pool) = pool {
            s.pod = Some(PodOverrides { node_selector: [("pool".to_string(), pool.to_string())].into(), ..Default::default() });
        }
        // One value in three over its bound.
        match over {
            0 => s.engine.tensor_parallel_size = 100_000,
            1 => s.engine.max_model_len = i64::MAX / 2,
            2 => s.model.name = "m".repeat(300),
            3 => s.engine.extra_args = vec!["--x".to_string(); 1000],
            _ => {}
        }
        s
    }
}

// === what a verdict says ===

/// What a verdict decides, without the node names and counts it reports.
#[derive(Debug, PartialEq)]
struct Decision {
    denials: Vec<(String, String)>,
    resolved: Option<crate::api::ResolvedConfig>,
    node_affinity: Option<NodeAffinity>,
    architectures: Vec<ArchDecision>,
    capacity: Option<crate::api::CapacityStatus>,
    multi_node: Option<MultiNode>,
    warnings: usize,
}

/// An [`ArchReport`] without its node counts.
type ArchDecision = (
    ComputeCapability,
    Vec<String>,
    Option<(KvCacheDtype, AttentionBackend)>,
    Vec<Violation>,
);

fn decision(v: &Verdict) -> Decision {
    Decision {
        denials: v
            .denials
            .iter()
            .map(|d| (d.field.clone(), d.reason.clone()))
            .collect(),
        resolved: v.resolved.clone(),
        node_affinity: v.node_affinity.clone(),
        architectures: v
            .architectures
            .iter()
            .map(|a| {
                (
                    a.compute_capability,
                    a.products.clone(),
                    a.resolved,
                    a.violations.clone(),
                )
            })
            .collect(),
        capacity: v.capacity.clone(),
        multi_node: v.multi_node,
        warnings: v.warnings.len(),
    }
}

fn json(v: &Verdict) -> serde_json::Value {
    serde_json::to_value(v).unwrap()
}

fn cluster(nodes: &[NodeFacts]) -> ClusterFacts {
    ClusterFacts {
        nodes: nodes.to_vec(),
        ..ClusterFacts::default()
    }
}

/// Whether no node matched and the verdict is on the products the selectors declare.
fn judged_on_declared_products(v: &Verdict) -> bool {
    v.warnings
        .first()
        .is_some_and(|w| w.contains("judged against the products they declare"))
}

/// Whether the verdict counts nodes against replicas (multi-node), or weighs resolutions
/// of `auto` by their nodes: there, node counts decide.
fn counts_decide(v: &Verdict) -> bool {
    let resolutions: BTreeSet<String> = v
        .architectures
        .iter()
        .filter(|a| a.nodes_with_enough_gpus > 0)
        .filter_map(|a| a.resolved)
        .map(|(d, b)| format!("{d}/{b}"))
        .collect();
    resolutions.len() > 1
        || v.multi_node.is_some()
        || v.denials.iter().any(|d| d.reason == INSUFFICIENT_NODES)
}

/// A node with the same labels, GPUs and cordon under another name.
fn twin(n: &NodeFacts) -> NodeFacts {
    NodeFacts {
        name: format!("{}-twin", n.name),
        ..n.clone()
    }
}

/// One node per distinct (labels, allocatable GPUs, cordon).
fn distinct(nodes: &[NodeFacts]) -> Vec<NodeFacts> {
    let mut seen = BTreeSet::new();
    nodes
        .iter()
        .filter(|n| seen.insert((n.labels.clone(), n.allocatable_gpus, n.unschedulable)))
        .cloned()
        .collect()
}

/// Whether a required node affinity lets the scheduler place a pod on `node`.
fn affinity_admits(a: &NodeAffinity, node: &NodeFacts) -> bool {
    let Some(required) = &a.required_during_scheduling_ignored_during_execution else {
        return true;
    };
    required.node_selector_terms.iter().any(|term| {
        term.match_expressions.iter().flatten().all(|e| {
            let value = node.labels.get(&e.key);
            match e.operator.as_str() {
                "In" => value.is_some_and(|v| e.values.iter().flatten().any(|x| x == v)),
                "DoesNotExist" => value.is_none(),
                other => panic!("the validator writes no {other} requirement"),
            }
        })
    })
}

/// The CRD's openAPIV3Schema of InferenceDeployment.
fn schema() -> &'static serde_json::Value {
    static SCHEMA: OnceLock<serde_json::Value> = OnceLock::new();
    SCHEMA.get_or_init(|| {
        let crd = serde_json::to_value(InferenceDeployment::crd()).unwrap();
        crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"].clone()
    })
}

/// Whether `field` (`spec.engine.extraArgs[3]`) is a path of the schema.
fn in_schema(field: &str) -> bool {
    let mut at = schema();
    for part in field.split('.') {
        let (name, indexed) = match part.split_once('[') {
            Some((name, _)) => (name, true),
            None => (part, false),
        };
        at = &at["properties"][name];
        if indexed {
            at = &at["items"];
        }
        if at.is_null() {
            return false;
        }
    }
    true
}

// === the properties, each a function of a spec and nodes ===

/// Admitted exactly when nothing denies; denied verdicts carry no resolution, affinity,
/// nodes, capacity or layout; admitted ones carry a resolution and an affinity that admits
/// every compatible node, each schedulable, with a resolved compute capability and
/// product and the GPUs one pod needs.
fn check_consistent(s: &InferenceDeploymentSpec, nodes: &[NodeFacts]) -> Result<(), TestCaseError> {
    let v = validate(s, &cluster(nodes));
    prop_assert_eq!(v.allowed(), v.denials.is_empty());
    if !v.allowed() {
        prop_assert!(v.resolved.is_none() && v.node_affinity.is_none(), "{:#?}", v);
        prop_assert!(v.compatible_nodes.is_empty() && v.capacity.is_none() && v.capacity_basis.is_none());
        prop_assert!(v.multi_node.is_none());
        return Ok(());
    }
    let r = v
        .resolved
        .as_ref()
        .expect("admitted verdicts carry the resolution");
    let affinity = v
        .node_affinity
        .as_ref()
        .expect("admitted verdicts carry an affinity");
    prop_assert!(
        !v.compatible_nodes.is_empty() || judged_on_declared_products(&v),
        "{:?}",
        v.warnings
    );
    let per_pod = v
        .multi_node
        .map(|m| m.gpus_per_node)
        .unwrap_or_else(|| i64::from(s.gpus_per_replica().max(1)));
    for name in &v.compatible_nodes {
        let n = nodes
            .iter()
            .find(|n| &n.name == name)
            .expect("compatible nodes are input nodes");
        prop_assert!(!n.unschedulable);
        let cc = n
            .compute_capability()
            .expect("compatible nodes have a known capability");
        prop_assert!(r.compute_capabilities.contains(&cc.to_string()));
        if let Some(p) = n.product() {
            prop_assert!(
                r.products.iter().any(|rp| rp == p),
                "{} not in {:?}",
                p,
                r.products
            );
        }
        prop_assert!(
            n.gpus().is_some_and(|g| g >= per_pod),
            "{} lacks {} GPUs",
            name,
            per_pod
        );
        prop_assert!(
            affinity_admits(affinity, n),
            "the affinity excludes compatible node {:?}",
            n
        );
    }
    Ok(())
}

/// Every denial names a field of the CRD's schema, a PascalCase reason and a message.
fn check_denials_name_fields(s: &InferenceDeploymentSpec, nodes: &[NodeFacts]) -> Result<(), TestCaseError> {
    for d in validate(s, &cluster(nodes)).denials {
        prop_assert!(
            in_schema(&d.field),
            "{} is not a field of the schema ({})",
            d.field,
            d.reason
        );
        prop_assert!(
            d.reason.starts_with(|c: char| c.is_ascii_uppercase())
                && d.reason.chars().all(|c| c.is_ascii_alphanumeric()),
            "reason {:?}",
            d.reason
        );
        prop_assert!(!d.message.trim().is_empty(), "{} has no message", d.reason);
    }
    Ok(())
}

/// Node order changes no decision, not which nodes are compatible and not the capacity
/// arithmetic. It may change the order of node names in messages, and which product a
/// capacity (or a GPU memory size in a message) is named after when compatible products
/// share a memory size: the first node's.
fn check_order_free(
    s: &InferenceDeploymentSpec,
    nodes: &[NodeFacts],
    shuffled: &[NodeFacts],
) -> Result<(), TestCaseError> {
    let (a, b) = (validate(s, &cluster(nodes)), validate(s, &cluster(shuffled)));
    prop_assert_eq!(decision(&a), decision(&b));
    let sorted = |v: &Verdict| {
        let mut names = v.compatible_nodes.clone();
        names.sort();
        names
    };
    prop_assert_eq!(sorted(&a), sorted(&b));
    let unnamed = |v: &Verdict| {
        v.capacity_basis.clone().map(|mut c| {
            c.product.clear();
            c
        })
    };
    prop_assert_eq!(unnamed(&a), unnamed(&b));
    Ok(())
}

/// A twin of every node (same labels, other name) keeps every decision; only counts
/// double and the twins join the compatible nodes. A multi-node replica can only gain
/// nodes: an InsufficientNodesForMultiNode denial may lift, nothing else changes.
fn check_twins_of_all(s: &InferenceDeploymentSpec, nodes: &[NodeFacts]) -> Result<(), TestCaseError> {
    let doubled: Vec<NodeFacts> = nodes.iter().cloned().chain(nodes.iter().map(twin)).collect();
    let (a, b) = (validate(s, &cluster(nodes)), validate(s, &cluster(&doubled)));
    if a.denials.iter().any(|d| d.reason == INSUFFICIENT_NODES) {
        let before: BTreeSet<_> = decision(&a).denials.into_iter().collect();
        prop_assert!(
            decision(&b).denials.iter().all(|d| before.contains(d)),
            "{:?} -> {:?}",
            a.denials,
            b.denials
        );
        return Ok(());
    }
    prop_assert_eq!(decision(&a), decision(&b));
    if judged_on_declared_products(&b) {
        // Both judged one made-up node per declared product: nothing to double.
        return Ok(());
    }
    for (x, y) in a.architectures.iter().zip(&b.architectures) {
        prop_assert_eq!(
            (2 * x.nodes, 2 * x.nodes_with_enough_gpus),
            (y.nodes, y.nodes_with_enough_gpus)
        );
    }
    let mut expected: Vec<String> = a
        .compatible_nodes
        .iter()
        .flat_map(|n| [n.clone(), format!("{n}-twin")])
        .collect();
    let mut got = b.compatible_nodes.clone();
    expected.sort();
    got.sort();
    prop_assert_eq!(expected, got);
    Ok(())
}

/// A twin of one node keeps what each architecture runs and why not; unless node counts
/// decide (a vote between resolutions of `auto`, or a multi-node replica), it keeps every
/// decision of the verdict.
fn check_twin_of_one(
    s: &InferenceDeploymentSpec,
    nodes: &[NodeFacts],
    which: usize,
) -> Result<(), TestCaseError> {
    if nodes.is_empty() {
        return Ok(());
    }
    let mut more = nodes.to_vec();
    more.push(twin(&nodes[which % nodes.len()]));
    let (a, b) = (validate(s, &cluster(nodes)), validate(s, &cluster(&more)));
    prop_assert_eq!(decision(&a).architectures, decision(&b).architectures);
    if !counts_decide(&a) && !counts_decide(&b) {
        prop_assert_eq!(decision(&a), decision(&b));
    }
    Ok(())
}

/// The verdict on a node set and on one node per distinct node (labels, GPUs, cordon)
/// decide alike, unless node counts decide.
fn check_distinct_nodes_decide(
    s: &InferenceDeploymentSpec,
    nodes: &[NodeFacts],
) -> Result<(), TestCaseError> {
    let (a, b) = (
        validate(s, &cluster(nodes)),
        validate(s, &cluster(&distinct(nodes))),
    );
    prop_assert_eq!(decision(&a).architectures, decision(&b).architectures);
    if !counts_decide(&a) && !counts_decide(&b) {
        prop_assert_eq!(decision(&a), decision(&b));
    }
    Ok(())
}

/// Nodes without GPUs, and GPU nodes the selectors reject (`extra`), change nothing but
/// the description of the cluster in a NoMatchingNodes denial.
fn check_unselectable_change_nothing(
    s: &InferenceDeploymentSpec,
    nodes: &[NodeFacts],
    extra: &[NodeFacts],
) -> Result<(), TestCaseError> {
    let blank = |mut v: Verdict| {
        for d in &mut v.denials {
            if d.reason == NO_MATCHING_NODES {
                d.message.clear();
            }
        }
        json(&v)
    };
    let more: Vec<NodeFacts> = nodes.iter().chain(extra).cloned().collect();
    prop_assert_eq!(
        blank(validate(s, &cluster(nodes))),
        blank(validate(s, &cluster(&more)))
    );
    Ok(())
}

/// Nodes `s` (after [`apply_selector`] `selector`) cannot select: without GPUs, or
/// rejected by the selector that variant sets.
fn unselectable(selector: u8, nodes: Vec<NodeFacts>, cpu: Vec<NodeFacts>) -> Vec<NodeFacts> {
    let rejected = nodes.into_iter().filter_map(|mut n| {
        match selector {
            1 => {
                n.labels.insert("pool".into(), "z".into());
            }
            2 => {
                let p = n.product().unwrap_or_default();
                let base = products::base_label(p);
                if ["NVIDIA-H100-80GB-HBM3", "NVIDIA-L4", "NVIDIA-B200"].contains(&base) {
                    n.labels.insert(labels::PRODUCT.into(), "Tesla-T4".into());
                }
            }
            3 => {
                n.labels.insert(labels::COMPUTE_MAJOR.into(), "8".into());
                n.labels.insert(labels::COMPUTE_MINOR.into(), "6".into());
            }
            _ => return None,
        }
        Some(n)
    });
    let cpu = cpu.into_iter().map(|mut n| {
        n.labels.retain(|k, _| !k.starts_with("nvidia.com/gpu."));
        n.allocatable_gpus = n.allocatable_gpus.map(|_| 0);
        n
    });
    rejected
        .chain(cpu)
        .enumerate()
        .map(|(i, mut n)| {
            n.name = format!("extra-{i}");
            n
        })
        .collect()
}

/// On a single node of one product (no selectors, the GPUs one replica needs), the
/// verdict is what the spec checks and the product's compat rules say: the checks' denials
/// first; then, where the rules run nothing, one denial per broken rule naming the node's
/// architecture (and maybe the capacity denial); where they run it, the resolution they name (or a capacity denial).
fn check_single_node(s: &InferenceDeploymentSpec, product: &products::Product) -> Result<(), TestCaseError> {
    let node = NodeFacts::synthetic("only", product, SYNTHETIC_NODE_GPUS);
    let v = validate(s, &cluster(std::slice::from_ref(&node)));
    let mut expected = Vec::new();
    let mut warnings = Vec::new();
    let features = model_features(s, &mut warnings);
    spec_checks(s, &mut expected, &mut warnings);
    let version = vllm_version_check(s, &mut expected, &mut warnings);
    let ev = rules::evaluate_at(
        s.engine.runtime,
        product.cc,
        &features,
        s.engine.kv_cache_dtype,
        s.engine.attention_backend,
        version,
    );
    prop_assert_eq!(
        &v.architectures,
        &vec![ArchReport {
            compute_capability: product.cc,
            products: vec![product.label.to_string()],
            nodes: 1,
            nodes_with_enough_gpus: 1,
            resolved: ev.resolved,
            violations: ev.violations.clone(),
        }]
    );
    for w in &ev.warnings {
        let text = format!("{} [{}; {}]", w.message, w.rule, w.source);
        prop_assert!(v.warnings.contains(&text), "rule warning {} missing", text);
    }
    prop_assert!(v.denials.len() >= expected.len());
    prop_assert_eq!(&v.denials[..expected.len()], &expected[..]);
    let rest = &v.denials[expected.len()..];
    match ev.resolved {
        None => {
            let mut rules_broken: Vec<Denial> = Vec::new();
            let mut seen = BTreeSet::new();
            for x in &ev.violations {
                if seen.insert(x.rule) {
                    rules_broken.push(Denial {
                        field: x.field.to_string(),
                        reason: x.reason.to_string(),
                        message: format!(
                            "{}; the selected node has {} ({}); {} [{}; {}]",
                            x.cause, product.cc, product.label, x.fix, x.rule, x.source
                        ),
                    });
                }
            }
            prop_assert!(!v.allowed());
            // Then, where nothing runs, a maxModelLen the node cannot hold even so.
            let (rules_denied, too_small) = rest.split_at(rest.len().min(rules_broken.len()));
            prop_assert_eq!(rules_denied, &rules_broken[..]);
            prop_assert!(
                too_small.len() <= 1 && too_small.iter().all(|d| d.reason == "KvCacheTooSmall"),
                "{:?}",
                too_small
            );
        }
        Some((dtype, backend)) => {
            let capacity = [bounds::PLANNER_REASON, "KvCacheTooSmall"];
            prop_assert!(
                rest.len() <= 1 && rest.iter().all(|d| capacity.contains(&d.reason.as_str())),
                "{:?}",
                rest
            );
            if v.allowed() {
                let r = v.resolved.as_ref().unwrap();
                prop_assert_eq!((r.kv_cache_dtype, r.attention_backend), (dtype, backend));
                prop_assert_eq!(&r.compute_capabilities, &vec![product.cc.to_string()]);
                prop_assert_eq!(&r.products, &vec![product.label.to_string()]);
                prop_assert_eq!(&v.compatible_nodes, &vec!["only".to_string()]);
            }
        }
    }
    Ok(())
}

// === on the examples ===

#[test]
fn properties_hold_for_the_examples_on_every_node_mix() {
    let mut admitted = 0;
    let mut denied = 0;
    for (nodes_name, nodes) in node_sets() {
        let reversed: Vec<NodeFacts> = nodes.iter().rev().cloned().collect();
        let cpu = vec![NodeFacts {
            name: "cpu-extra".into(),
            labels: [("pool".to_string(), "a".to_string())].into(),
            ..NodeFacts::default()
        }];
        for (spec_name, spec) in specs() {
            let at = || format!("spec {spec_name} on nodes {nodes_name}");
            let run = || -> Result<(), TestCaseError> {
                check_consistent(spec, &nodes)?;
                check_denials_name_fields(spec, &nodes)?;
                check_order_free(spec, &nodes, &reversed)?;
                check_twins_of_all(spec, &nodes)?;
                check_twin_of_one(spec, &nodes, 0)?;
                check_distinct_nodes_decide(spec, &nodes)?;
                check_unselectable_change_nothing(spec, &nodes, &cpu)
            };
            if let Err(e) = run() {
                panic!("{}: {e}", at());
            }
            if validate(spec, &cluster(&nodes)).allowed() {
                admitted += 1;
            } else {
                denied += 1;
            }
        }
    }
    // The matrix exercises both outcomes, not one branch only.
    assert!(
        admitted > 20 && denied > 20,
        "admitted {admitted}, denied {denied}"
    );
}

#[test]
fn a_single_node_of_each_product_gets_what_its_rules_say_for_each_example() {
    for (spec_name, spec) in specs() {
        let mut s = spec.clone();
        s.gpu.get_or_insert_with(GpuSpec::default).selector = None;
        if let Some(pod) = s.pod.as_mut() {
            pod.node_selector.clear();
        }
        if s.gpus_per_replica() > SYNTHETIC_NODE_GPUS as i32 || !bounds::check(&s).is_empty() {
            continue;
        }
        for product in products::PRODUCTS {
            if let Err(e) = check_single_node(&s, product) {
                panic!("spec {spec_name} on {}: {e}", product.label);
            }
        }
    }
}

/// Node counts decide where the design says they do: the most nodes win the vote between
/// resolutions of `auto` (ties: the newest architecture), so a twin can tip it.
/// Once found by a generator now retired: a vLLM spec read from a ConfigMap, a small memory
/// share, a minimum capability and a node selector, on a cluster with no node at all (judged
/// against what the selector declares).
#[test]
fn a_spec_on_an_empty_cluster_is_judged_consistently() {
    let mut s = yaml_spec(
        "model: {name: m, config: {configMapRef: {name: c}}}\n\
         engine: {runtime: vllm, gpuMemoryUtilization: 0.27215512266005015}\n\
         gpu: {selector: {minComputeCapability: \"8.0\"}}\n\
         pod: {nodeSelector: {pool: b}}\n",
    );
    s.model.weights = None;
    check_consistent(&s, &[]).unwrap();
    check_denials_name_fields(&s, &[]).unwrap();
}

#[test]
fn a_twin_can_tip_the_vote_between_architectures() {
    let spec = yaml_spec(&format!(
        "model: {{name: m, geometry: {GEOMETRY}, weights: {{format: dummy}}}}\nengine: {{runtime: vllm}}"
    ));
    let resolved = |nodes: &[NodeFacts]| {
        validate(&spec, &cluster(nodes))
            .resolved
            .map(|r| (r.kv_cache_dtype, r.attention_backend))
    };
    let node = |i: usize, p: &products::Product| NodeFacts::synthetic(format!("n{i}"), p, 8);
    let mut tipped = 0;
    for older in products::PRODUCTS {
        for newer in products::PRODUCTS.iter().filter(|n| n.cc > older.cc) {
            let (a, b) = (resolved(&[node(0, older)]), resolved(&[node(0, newer)]));
            if a.is_none() || b.is_none() || a == b {
                continue;
            }
            // One node each: a tie, won by the newer architecture.
            assert_eq!(resolved(&[node(0, older), node(1, newer)]), b);
            // A twin of the older node: two votes to one.
            assert_eq!(resolved(&[node(0, older), node(2, older), node(1, newer)]), a);
            tipped += 1;
        }
    }
    assert!(tipped > 0, "no two products resolve auto differently");
}

/// A replica that spans nodes needs that many compatible nodes: a twin can complete it.
#[test]
fn a_twin_can_complete_a_multi_node_replica() {
    let spec = yaml_spec(&format!(
        "model: {{name: m, geometry: {GEOMETRY}, weights: {{format: dummy}}}}\nengine: {{runtime: vllm, tensorParallelSize: 16}}"
    ));
    let one = vec![gfd("h100-0", "NVIDIA-H100-80GB-HBM3", 9, 0, 8)];
    let v = validate(&spec, &cluster(&one));
    assert!(v.denials.iter().any(|d| d.reason == INSUFFICIENT_NODES), "{v:#?}");
    let two = vec![one[0].clone(), twin(&one[0])];
    let v = validate(&spec, &cluster(&two));
    assert!(v.allowed(), "{v:#?}");
    assert_eq!(v.multi_node.map(|m| m.nodes_per_replica), Some(2));
}

/// A compatible node is one pods can land on: node-1 carries the compute-capability labels
/// but no product label, node-0 only a product label of the same architecture. The
/// architecture's term goes by product (node-0 has no compute labels), so node-1 gets a term
/// by its compute labels and the absence of a product label; before, the affinity left it
/// out though the verdict listed it as compatible (and a multi-node replica counted it).
#[test]
fn the_affinity_admits_a_compatible_node_without_a_product_label() {
    let spec = yaml_spec(&format!(
        "model: {{name: m, geometry: {GEOMETRY}, weights: {{format: dummy}}}}\nengine: {{runtime: vllm}}"
    ));
    let mut by_product = gfd("node-0", "NVIDIA-GeForce-RTX-3090", 8, 6, 1);
    by_product.labels.remove(labels::COMPUTE_MAJOR);
    by_product.labels.remove(labels::COMPUTE_MINOR);
    let mut by_capability = gfd("node-1", "NVIDIA-GeForce-RTX-3090", 8, 6, 1);
    by_capability.labels.remove(labels::PRODUCT);
    let v = validate(&spec, &cluster(&[by_product, by_capability.clone()]));
    assert!(v.compatible_nodes.contains(&"node-1".to_string()), "{v:#?}");
    assert!(
        affinity_admits(v.node_affinity.as_ref().unwrap(), &by_capability),
        "{v:#?}"
    );
}

// === on random specs and nodes ===

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn verdicts_are_consistent(s in arb_spec(), nodes in arb_nodes(12)) {
        check_consistent(&s, &nodes)?;
    }

    #[test]
    fn example_verdicts_are_consistent(s in arb_example_spec(), nodes in arb_nodes(40)) {
        check_consistent(&s, &nodes)?;
    }

    #[test]
    fn every_denial_names_a_field_of_the_schema_and_why(s in arb_spec(), nodes in arb_nodes(12)) {
        check_denials_name_fields(&s, &nodes)?;
    }

    #[test]
    fn node_order_does_not_change_the_verdict(
        s in arb_example_spec(),
        (nodes, shuffled) in arb_nodes(40).prop_flat_map(|n| (Just(n.clone()), Just(n).prop_shuffle())),
    ) {
        check_order_free(&s, &nodes, &shuffled)?;
    }

    #[test]
    fn a_twin_of_every_node_changes_only_counts(s in arb_example_spec(), nodes in arb_nodes(30)) {
        check_twins_of_all(&s, &nodes)?;
    }

    #[test]
    fn a_twin_of_one_node_changes_only_counts_unless_counts_decide(
        s in arb_example_spec(), nodes in arb_nodes(30), which in 0usize..30,
    ) {
        check_twin_of_one(&s, &nodes, which)?;
    }

    #[test]
    fn one_node_per_distinct_node_decides_alike(
        s in arb_example_spec(),
        nodes in proptest::collection::vec(proptest::sample::select(vec![0usize, 1, 2, 3]), 0..40)
            .prop_flat_map(|picks| (arb_nodes(5), Just(picks))),
    ) {
        // Few distinct nodes, many copies of each.
        let (distinct_nodes, picks) = nodes;
        let nodes: Vec<NodeFacts> = picks
            .iter()
            .filter(|i| **i < distinct_nodes.len())
            .enumerate()
            .map(|(k, i)| NodeFacts { name: format!("copy-{k}"), ..distinct_nodes[*i].clone() })
            .collect();
        check_distinct_nodes_decide(&s, &nodes)?;
    }

    #[test]
    fn nodes_the_spec_cannot_select_change_nothing(
        s in arb_example_spec(),
        selector in 0u8..4,
        nodes in arb_nodes(30),
        rejected in arb_nodes(10),
        cpu in arb_nodes(4),
    ) {
        let mut s = s;
        apply_selector(&mut s, selector);
        check_unselectable_change_nothing(&s, &nodes, &unselectable(selector, rejected, cpu))?;
    }

    #[test]
    fn a_single_node_gets_what_its_products_rules_say(
        s in arb_spec(),
        product in proptest::sample::select(products::PRODUCTS),
    ) {
        let mut s = within_minimums(s);
        s.gpu = None;
        s.pod = None;
        prop_assume!(s.gpus_per_replica() <= SYNTHETIC_NODE_GPUS as i32 && bounds::check(&s).is_empty());
        check_single_node(&s, &product)?;
    }
}
