//! The grouped [`super::validate`] against the per-node implementation it replaced
//! ([`super::reference`]): every verdict must serialize identically, for the specs of
//! deploy/examples and tests/fixtures/admission and crafted ones, on node sets that mix
//! products, unlabelled, cordoned, CPU-only and selector-labelled nodes, and on random
//! node sets (proptest).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use k8s_openapi::api::core::v1::Node;
use proptest::prelude::*;
use serde::Deserialize;

use super::*;
use crate::api::{GpuSelector, GpuSpec, PodOverrides};

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

/// The benchmark's fleet: 500 nodes of five products, round robin.
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

/// Node sets: the examples, the 500-node fleet and mixes with the awkward cases.
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
    out.push(("mixed".into(), mixed.clone()));

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

fn assert_same(spec_name: &str, nodes_name: &str, spec: &InferenceDeploymentSpec, facts: &ClusterFacts) {
    let new = validate(spec, facts);
    let old = reference::validate(spec, facts);
    let (new_json, old_json) = (
        serde_json::to_string_pretty(&new).unwrap(),
        serde_json::to_string_pretty(&old).unwrap(),
    );
    assert_eq!(new_json, old_json, "spec {spec_name} on nodes {nodes_name}");
    assert_eq!(new, old, "spec {spec_name} on nodes {nodes_name}");
}

#[test]
fn grouped_validate_matches_per_node_reference_on_examples_and_node_mixes() {
    let specs = specs();
    let sets = node_sets();
    let mut admitted = 0;
    let mut denied = 0;
    for (nodes_name, nodes) in &sets {
        let facts = ClusterFacts { nodes: nodes.clone() };
        for (spec_name, spec) in specs {
            assert_same(spec_name, nodes_name, spec, &facts);
            if validate(spec, &facts).allowed() {
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
fn grouped_validate_matches_reference_with_selectors_and_gpu_counts() {
    let sets = node_sets();
    let base = specs();
    for (nodes_name, nodes) in &sets {
        let facts = ClusterFacts { nodes: nodes.clone() };
        for (spec_name, spec) in base.iter().step_by(3) {
            for tp in [1, 2, 4, 8] {
                for selector in 0..4 {
                    let mut s = spec.clone();
                    s.engine.tensor_parallel_size = tp;
                    apply_selector(&mut s, selector);
                    assert_same(
                        &format!("{spec_name} tp {tp} selector {selector}"),
                        nodes_name,
                        &s,
                        &facts,
                    );
                }
            }
        }
    }
}

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

// --- random node sets

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

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    // Names are drawn from 40 so some node sets repeat a name (the reference filters by name).
    #[test]
    fn grouped_validate_matches_reference_on_random_node_sets(
        nodes in proptest::collection::vec(arb_node(), 0..60),
        spec_index in 0usize..64,
        tp in proptest::sample::select(&[1, 2, 4, 8][..]),
        selector in 0u8..4,
        dtype in proptest::sample::select(&crate::compat::KvCacheDtype::ALL[..]),
        max_model_len in proptest::sample::select(&[4096i64, 32768, 131072, 1_048_576][..]),
    ) {
        let specs = specs();
        let mut s = specs[spec_index % specs.len()].1.clone();
        s.engine.tensor_parallel_size = tp;
        s.engine.kv_cache_dtype = dtype;
        s.engine.max_model_len = max_model_len;
        apply_selector(&mut s, selector);
        let facts = ClusterFacts { nodes };
        let new = validate(&s, &facts);
        let old = reference::validate(&s, &facts);
        prop_assert_eq!(serde_json::to_string(&new).unwrap(), serde_json::to_string(&old).unwrap());
        prop_assert_eq!(new, old);
    }
}
