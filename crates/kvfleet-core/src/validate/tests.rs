use super::*;
use crate::api::Runtime;
use crate::compat::{products, AttentionBackend, ComputeCapability};

/// A spec; vllm specs without weights get dummy weights (these tests are about everything
/// else; `a_vllm_spec_needs_weights_or_dummy_said_out_loud` tests the weights).
fn spec(yaml: &str) -> InferenceDeploymentSpec {
    let mut s: InferenceDeploymentSpec = serde_yaml::from_str(yaml).unwrap();
    if s.engine.runtime == Runtime::Vllm && s.model.weights.is_none() {
        s.model.weights = serde_yaml::from_str("{format: dummy}").unwrap();
    }
    s
}

/// One replica of a Llama-8B-shaped model on the kvfleet runtime and H100s; tests append
/// the fields they are about.
pub(super) const KVFLEET_H100: &str = "
replicas: 1
model:
  name: m
  geometry: {layers: 32, queryHeads: 32, kvHeads: 8, headDim: 128}
  weights: {format: dummy}
  weightBytes: 16Gi
engine: {runtime: kvfleet}
gpu: {selector: {products: [NVIDIA-H100-80GB-HBM3]}}
";

/// The denial of `reason` in `v`; panics with the verdict when there is none.
pub(super) fn denial_of<'a>(v: &'a Verdict, reason: &str) -> &'a Denial {
    v.denials
        .iter()
        .find(|d| d.reason == reason)
        .unwrap_or_else(|| panic!("no {reason} denial in {v:#?}"))
}

#[test]
fn a_vllm_spec_needs_weights_or_dummy_said_out_loud() {
    let nodes = cluster(vec![node("h100-0", "NVIDIA-H100-80GB-HBM3", 8)]);
    let bare: InferenceDeploymentSpec =
        serde_yaml::from_str(&format!("{LLAMA}engine: {{runtime: vllm}}\n")).unwrap();
    let v = validate(&bare, &nodes);
    let d = denial_of(&v, "WeightsMissing");
    assert_eq!(d.field, "spec.model.weights");
    assert!(
        d.message.contains("format: dummy") && d.message.contains("huggingFace"),
        "{}",
        d.message
    );
    assert!(validate(&spec(&format!("{LLAMA}engine: {{runtime: vllm}}\n")), &nodes).allowed());
    // The kvfleet worker refuses to start without weights; admission leaves that to it.
    let kvfleet: InferenceDeploymentSpec =
        serde_yaml::from_str(&format!("{LLAMA}engine: {{runtime: kvfleet}}\n")).unwrap();
    assert!(validate(&kvfleet, &nodes)
        .denials
        .iter()
        .all(|d| d.reason != "WeightsMissing"));
    // Hub weights are read by vLLM only.
    let hub: InferenceDeploymentSpec = serde_yaml::from_str(&format!(
        "{LLAMA}  weights: {{format: safetensors, huggingFace: {{}}}}\nengine: {{runtime: kvfleet}}\n"
    ))
    .unwrap();
    let v = validate(&hub, &nodes);
    assert!(
        v.denials.iter().any(|d| d.reason == "WeightsSourceNeedsVllm"),
        "{v:#?}"
    );
}

fn node(name: &str, product: &str, gpus: i64) -> NodeFacts {
    let p = products::lookup(product).unwrap();
    let mut n = NodeFacts::synthetic(name, p, gpus);
    n.labels.insert(labels::PRODUCT.into(), product.into());
    n
}

fn cluster(nodes: Vec<NodeFacts>) -> ClusterFacts {
    ClusterFacts {
        nodes,
        ..ClusterFacts::default()
    }
}

const LLAMA: &str = "
model:
  name: llama
  geometry: {layers: 32, queryHeads: 32, kvHeads: 8, headDim: 128}
";

fn llama(engine: &str) -> InferenceDeploymentSpec {
    spec(&format!("{LLAMA}engine: {engine}\n"))
}

fn messages(v: &Verdict) -> String {
    v.denials
        .iter()
        .map(|d| d.message.as_str())
        .collect::<Vec<_>>()
        .join("\n")
}

fn affinity_terms(v: &Verdict) -> Vec<Vec<(String, Vec<String>)>> {
    let a = v.node_affinity.as_ref().unwrap();
    a.required_during_scheduling_ignored_during_execution
        .as_ref()
        .unwrap()
        .node_selector_terms
        .iter()
        .map(|t| {
            t.match_expressions
                .clone()
                .unwrap_or_default()
                .into_iter()
                .map(|e| (e.key, e.values.unwrap_or_default()))
                .collect()
        })
        .collect()
}

#[test]
fn nvfp4_kv_on_rtx_pro_6000_is_denied_with_fp8_hint() {
    let s = llama("{runtime: vllm, kvCacheDtype: nvfp4}");
    let v = validate(&s, &cluster(vec![node("a", "NVIDIA-RTX-PRO-6000-Blackwell", 8)]));
    assert!(!v.allowed());
    assert_eq!(v.denials.len(), 1, "{v:#?}");
    let d = &v.denials[0];
    assert_eq!(d.field, "spec.engine.kvCacheDtype");
    assert_eq!(d.reason, "UnsupportedKvCacheDtype");
    assert!(
        d.message.starts_with(
            "kvCacheDtype nvfp4 needs compute capability 10.0 or 10.3 (B200/B300); the selected node has 12.0 (NVIDIA-RTX-PRO-6000-Blackwell); use fp8"
        ),
        "{}",
        d.message
    );
    assert!(d.message.contains("vllm#43562"), "{}", d.message);
    assert!(v.resolved.is_none() && v.node_affinity.is_none() && v.compatible_nodes.is_empty());
}

#[test]
fn nvfp4_kv_on_b200_is_admitted_with_flashinfer_and_affinity_to_10_0() {
    let s = llama("{runtime: vllm, kvCacheDtype: nvfp4}");
    let v = validate(
        &s,
        &cluster(vec![node("b1", "NVIDIA-B200", 8), node("b2", "NVIDIA-B200", 8)]),
    );
    assert!(v.allowed(), "{v:#?}");
    let r = v.resolved.as_ref().unwrap();
    assert_eq!(
        (r.kv_cache_dtype.as_str(), r.attention_backend.as_str()),
        ("nvfp4", "FLASHINFER")
    );
    assert_eq!(r.compute_capabilities, vec!["10.0"]);
    assert_eq!(r.products, vec!["NVIDIA-B200"]);
    assert_eq!(v.compatible_nodes, vec!["b1", "b2"]);
    assert_eq!(
        affinity_terms(&v),
        vec![vec![
            (labels::COMPUTE_MAJOR.to_string(), vec!["10".to_string()]),
            (labels::COMPUTE_MINOR.to_string(), vec!["0".to_string()]),
        ]]
    );
    assert!(
        v.warnings.iter().any(|w| w.contains("flashinfer-cubin")),
        "{:?}",
        v.warnings
    );
}

#[test]
fn fp8_e4m3_with_vllm_on_rtx_3090_is_denied_with_e5m2_hint() {
    let s = llama("{runtime: vllm, kvCacheDtype: fp8_e4m3}");
    let v = validate(
        &s,
        &cluster(vec![
            node("a", "NVIDIA-GeForce-RTX-3090", 2),
            node("b", "NVIDIA-GeForce-RTX-3090", 2),
        ]),
    );
    assert!(!v.allowed());
    let m = messages(&v);
    assert!(
        m.contains("fp8_e4m3 KV cache is not supported by vLLM's Triton kernels"),
        "{m}"
    );
    assert!(
        m.contains("the selected nodes have 8.6 (NVIDIA-GeForce-RTX-3090); use fp8_e5m2"),
        "{m}"
    );
}

#[test]
fn per_layer_sliding_windows_with_flashinfer_are_denied() {
    let s = spec(
        "
model:
  name: gemma
  geometry: {layers: 2, queryHeads: 8, kvHeads: 4, headDim: 256, slidingWindow: 4096,
             layerTypes: [sliding_attention, full_attention]}
engine: {runtime: vllm, attentionBackend: FLASHINFER}
",
    );
    let v = validate(&s, &cluster(vec![node("h", "NVIDIA-H100-80GB-HBM3", 8)]));
    assert!(!v.allowed());
    assert_eq!(v.denials[0].reason, "PerLayerSlidingWindow");
    assert!(
        messages(&v).contains("use attentionBackend FLASH_ATTN or TRITON_ATTN"),
        "{}",
        messages(&v)
    );
}

#[test]
fn mixed_pool_admits_on_sm90_only_with_counts() {
    let s = llama("{runtime: vllm, kvCacheDtype: fp8_e4m3, gpuMemoryUtilization: 0.8}");
    let mut nodes: Vec<NodeFacts> = (0..3)
        .map(|i| node(&format!("a10-{i}"), "NVIDIA-A10", 4))
        .collect();
    nodes.push(node("h100-0", "NVIDIA-H100-80GB-HBM3", 8));
    nodes.push(node("h100-1", "NVIDIA-H100-80GB-HBM3", 8));
    nodes.push(NodeFacts {
        name: "cpu-0".into(),
        ..NodeFacts::default()
    });
    let v = validate(&s, &cluster(nodes));
    assert!(v.allowed(), "{v:#?}");
    assert_eq!(v.compatible_nodes, vec!["h100-0", "h100-1"]);
    assert_eq!(v.resolved.as_ref().unwrap().compute_capabilities, vec!["9.0"]);
    assert_eq!(
        v.resolved.as_ref().unwrap().attention_backend,
        AttentionBackend::FlashAttn
    );
    assert_eq!(
        v.warnings[0],
        "2 of 5 selected GPU nodes can run this; the affinity excludes the others"
    );
    assert!(
        v.warnings
            .iter()
            .any(|w| w.starts_with("nodes with 8.6 (NVIDIA-A10) excluded: fp8_e4m3")),
        "{:?}",
        v.warnings
    );
    let terms = affinity_terms(&v);
    assert_eq!(terms.len(), 1);
    assert_eq!(terms[0][0].1, vec!["9"]);
    assert_eq!(v.architectures.len(), 2);
}

#[test]
fn no_nodes_at_all_is_denied_as_no_matching_node() {
    let v = validate(&llama("{}"), &ClusterFacts::default());
    assert!(!v.allowed());
    let d = &v.denials[0];
    assert_eq!(d.reason, "NoMatchingNodes");
    assert!(
        d.message
            .starts_with("no schedulable GPU node matches the selectors (any GPU node)"),
        "{}",
        d.message
    );
}

#[test]
fn selectors_filter_nodes_and_name_what_the_cluster_has() {
    // A product kvfleet does not know cannot be judged without such a node: denied, naming
    // what the cluster has. (A known one is judged as declared: scale from zero.)
    let s = spec(&format!(
        "{LLAMA}gpu: {{selector: {{products: [NVIDIA-H999]}}}}\n"
    ));
    let v = validate(&s, &cluster(vec![node("l4", "NVIDIA-L4", 1)]));
    assert!(!v.allowed());
    let m = messages(&v);
    assert!(
        m.contains("gpu.selector.products [NVIDIA-H999]") && m.contains("NVIDIA-L4 (8.9)"),
        "{m}"
    );
    let s = spec(&format!(
        "{LLAMA}gpu: {{selector: {{products: [NVIDIA-H200]}}}}\n"
    ));
    let v = validate(&s, &cluster(vec![node("l4", "NVIDIA-L4", 1)]));
    assert!(v.allowed() && v.compatible_nodes.is_empty(), "{v:#?}");
    assert!(
        v.warnings[0].contains("gpu.selector.products [NVIDIA-H200]"),
        "{:?}",
        v.warnings
    );

    let s = spec(&format!("{LLAMA}pod: {{nodeSelector: {{pool: gpu-a}}}}\n"));
    let mut a = node("a", "NVIDIA-L4", 1);
    a.labels.insert("pool".into(), "gpu-a".into());
    let b = node("b", "NVIDIA-H100-80GB-HBM3", 8);
    let v = validate(&s, &cluster(vec![a, b]));
    assert!(v.allowed());
    assert_eq!(v.compatible_nodes, vec!["a"]);
}

#[test]
fn min_compute_capability_compares_numbers_not_strings() {
    let s = spec(&format!("{LLAMA}engine: {{gpuMemoryUtilization: 0.8}}\ngpu: {{selector: {{minComputeCapability: \"10.0\"}}}}\n"));
    let v = validate(
        &s,
        &cluster(vec![
            node("h", "NVIDIA-H100-80GB-HBM3", 8),
            node("r", "NVIDIA-GeForce-RTX-5090", 1),
        ]),
    );
    assert!(v.allowed(), "{v:#?}");
    assert_eq!(v.compatible_nodes, vec!["r"]);
    assert!(
        v.warnings.is_empty(),
        "the 9.0 node is not selected at all: {:?}",
        v.warnings
    );
}

#[test]
fn nodes_without_gfd_labels_are_warned_about_and_never_compatible() {
    let bare = NodeFacts {
        name: "bare".into(),
        allocatable_gpus: Some(4),
        ..NodeFacts::default()
    };
    let v = validate(&llama("{}"), &cluster(vec![bare.clone()]));
    assert!(!v.allowed());
    assert!(
        v.denials
            .iter()
            .any(|d| d.reason == "NoGpuFeatureDiscoveryLabels"),
        "{v:#?}"
    );
    assert!(v.warnings.iter().any(|w| w.contains("GPU Feature Discovery")));

    let v = validate(
        &llama("{}"),
        &cluster(vec![bare, node("h", "NVIDIA-H100-80GB-HBM3", 8)]),
    );
    assert!(v.allowed());
    assert_eq!(v.compatible_nodes, vec!["h"]);
    assert!(
        v.warnings
            .iter()
            .any(|w| w.contains("1 selected GPU node (bare)")),
        "{:?}",
        v.warnings
    );
}

#[test]
fn product_label_alone_gives_the_capability_and_a_product_affinity() {
    let mut n = node("t4", "Tesla-T4", 1);
    n.labels.remove(labels::COMPUTE_MAJOR);
    n.labels.remove(labels::COMPUTE_MINOR);
    n.labels.insert(labels::PRODUCT.into(), "Tesla-T4-SHARED".into());
    let v = validate(&llama("{runtime: vllm}"), &cluster(vec![n]));
    assert!(v.allowed(), "{v:#?}");
    let r = v.resolved.as_ref().unwrap();
    assert_eq!(
        (r.kv_cache_dtype.as_str(), r.attention_backend.as_str()),
        ("float16", "TRITON_ATTN")
    );
    assert_eq!(
        affinity_terms(&v),
        vec![vec![(
            labels::PRODUCT.to_string(),
            vec!["Tesla-T4-SHARED".to_string()]
        )]]
    );
}

#[test]
fn mig_products_match_a_selector_of_the_base_product() {
    let s = spec(&format!(
        "{LLAMA}gpu: {{selector: {{products: [NVIDIA-A100-SXM4-40GB]}}}}\n"
    ));
    let v = validate(
        &s,
        &cluster(vec![node("m", "NVIDIA-A100-SXM4-40GB-MIG-3g.20gb", 7)]),
    );
    assert!(v.allowed(), "{v:#?}");
    let terms = affinity_terms(&v);
    assert_eq!(terms[0][2].0, labels::PRODUCT);
    assert_eq!(
        terms[0][2].1,
        vec!["NVIDIA-A100-SXM4-40GB", "NVIDIA-A100-SXM4-40GB-MIG-3g.20gb"]
    );
}

#[test]
fn tensor_parallel_size_needs_gpus_on_one_node() {
    let s = llama("{runtime: vllm, tensorParallelSize: 4}");
    let v = validate(
        &s,
        &cluster(vec![node("a", "NVIDIA-L4", 2), node("b", "NVIDIA-L4", 1)]),
    );
    // vLLM spreads the replica over 2 nodes of 2 GPUs; only one such node exists.
    assert!(!v.allowed());
    assert_eq!(v.denials[0].reason, INSUFFICIENT_NODES);
    assert!(
        v.denials[0].message.contains("spans 2 nodes of 2 GPUs")
            && v.denials[0].message.contains("at most 2")
            && v.denials[0].message.contains("the selected pool has 1"),
        "{}",
        v.denials[0].message
    );

    let v = validate(
        &s,
        &cluster(vec![node("a", "NVIDIA-L4", 2), node("c", "NVIDIA-L4", 4)]),
    );
    assert!(v.allowed());
    assert_eq!(v.compatible_nodes, vec!["c"]);
    assert!(
        v.warnings
            .iter()
            .any(|w| w.contains("1 node with 8.9 (NVIDIA-L4) has fewer than the 4 GPUs")),
        "{:?}",
        v.warnings
    );
}

#[test]
fn tensor_parallel_size_must_split_the_heads() {
    let v = validate(
        &llama("{runtime: vllm, tensorParallelSize: 3}"),
        &cluster(vec![node("h", "NVIDIA-H100-80GB-HBM3", 8)]),
    );
    assert!(!v.allowed());
    let d = denial_of(&v, "TensorParallelSizeMismatch");
    assert!(
        d.message.contains("does not divide the model's 32 query heads")
            && d.message.contains("use one of 1, 2, 4, 8"),
        "{}",
        d.message
    );
    // tp 16 > 8 KV heads is fine (replicated KV heads: 16 % 8 == 0).
    assert!(validate(
        &llama("{runtime: vllm, tensorParallelSize: 16}"),
        &cluster(vec![node("h", "NVIDIA-H100-80GB-HBM3", 16)])
    )
    .allowed());
    // 12 KV heads over tp 8: neither divides the other.
    let s = spec("model: {name: x, geometry: {layers: 1, queryHeads: 96, kvHeads: 12, headDim: 128}}\nengine: {runtime: vllm, tensorParallelSize: 8}\n");
    let v = validate(&s, &cluster(vec![node("h", "NVIDIA-H100-80GB-HBM3", 8)]));
    assert!(
        v.denials.iter().any(|d| d.message.contains("12 KV heads")),
        "{v:#?}"
    );
}

#[test]
fn gpu_count_below_tensor_parallel_size_is_denied() {
    let s = spec(&format!(
        "{LLAMA}engine: {{runtime: vllm, tensorParallelSize: 2}}\ngpu: {{count: 1}}\n"
    ));
    let v = validate(&s, &cluster(vec![node("h", "NVIDIA-H100-80GB-HBM3", 8)]));
    assert!(v.denials.iter().any(|d| d.field == "spec.gpu.count"), "{v:#?}");
}

#[test]
fn gpu_memory_utilization_raised_above_the_default_warns_and_the_default_does_not() {
    let v = validate(
        &llama("{runtime: vllm, gpuMemoryUtilization: 0.95}"),
        &cluster(vec![node("h", "NVIDIA-H100-80GB-HBM3", 8)]),
    );
    assert!(v.allowed());
    assert!(
        v.warnings.iter().any(
            |w| w.contains("gpuMemoryUtilization 0.95 is above the default 0.9")
                && w.contains("lower it to 0.85")
        ),
        "{:?}",
        v.warnings
    );
    // The CRD's default (what a spec that leaves it unset carries) must not warn.
    let unset = llama("{runtime: vllm}");
    assert_eq!(unset.engine.gpu_memory_utilization, 0.9);
    let v = validate(&unset, &cluster(vec![node("h", "NVIDIA-H100-80GB-HBM3", 8)]));
    assert!(v.allowed());
    assert!(
        !v.warnings.iter().any(|w| w.contains("gpuMemoryUtilization")),
        "{:?}",
        v.warnings
    );
    let v = validate(
        &llama("{gpuMemoryUtilization: 0.85}"),
        &cluster(vec![node("h", "NVIDIA-H100-80GB-HBM3", 8)]),
    );
    assert!(
        !v.warnings.iter().any(|w| w.contains("gpuMemoryUtilization")),
        "{:?}",
        v.warnings
    );
}

#[test]
fn config_map_models_are_validated_with_what_is_known_and_warned() {
    let s =
        spec("model: {name: x, config: {configMapRef: {name: cfg}}}\nengine: {runtime: vllm, gpuMemoryUtilization: 0.8}\n");
    let v = validate(&s, &cluster(vec![node("h", "NVIDIA-H100-80GB-HBM3", 8)]));
    assert!(v.allowed());
    assert!(
        v.warnings
            .iter()
            .any(|w| w.contains("ConfigMap cfg, key config.json")),
        "{:?}",
        v.warnings
    );
}

#[test]
fn nodes_the_kvfleet_kernels_do_not_support_are_excluded_by_the_affinity() {
    // kvfleet auto: the CUDA kernels need sm_80+, so the T4 (7.5) is excluded, the H100s run.
    let nodes = vec![
        node("t4", "Tesla-T4", 1),
        node("h1", "NVIDIA-H100-80GB-HBM3", 8),
        node("h2", "NVIDIA-H100-80GB-HBM3", 8),
    ];
    let v = validate(&llama("{gpuMemoryUtilization: 0.8}"), &cluster(nodes));
    assert!(v.allowed());
    let r = v.resolved.as_ref().unwrap();
    assert_eq!(
        (r.kv_cache_dtype.as_str(), r.attention_backend.as_str()),
        ("bfloat16", "KVFLEET_CUDA")
    );
    assert_eq!(v.compatible_nodes, vec!["h1", "h2"]);
    assert!(
        v.warnings
            .iter()
            .any(|w| w.contains("nodes with 7.5 (Tesla-T4) excluded") && w.contains("not 7.5")),
        "{:?}",
        v.warnings
    );
}

#[test]
fn cordoned_nodes_are_not_considered() {
    let mut h = node("h", "NVIDIA-H100-80GB-HBM3", 8);
    h.unschedulable = true;
    let v = validate(&llama("{}"), &cluster(vec![h]));
    assert!(!v.allowed());
    assert!(v.warnings.iter().any(|w| w.contains("cordoned")));
}

#[test]
fn validate_offline_synthesizes_product_nodes() {
    let v = validate_offline(&llama("{runtime: vllm, kvCacheDtype: nvfp4}"), &["NVIDIA-B200"]).unwrap();
    assert!(v.allowed());
    assert_eq!(v.compatible_nodes.len(), 1);
    let err = validate_offline(&llama("{}"), &["NVIDIA-Imaginary"]).unwrap_err();
    assert!(err.to_string().contains("NVIDIA-Imaginary"));
}

mod capacity {
    use super::*;

    fn llama_8b(engine: &str) -> InferenceDeploymentSpec {
        spec(&format!(
            "model:\n  name: llama\n  geometry: {{layers: 32, queryHeads: 32, kvHeads: 8, headDim: 128}}\n  weightBytes: 16Gi\nengine: {engine}\n"
        ))
    }

    #[test]
    fn max_model_len_that_cannot_fit_one_request_is_denied_with_the_fix() {
        let s = llama_8b("{runtime: vllm, maxModelLen: 1000000, gpuMemoryUtilization: 0.85}");
        let v = validate(&s, &cluster(vec![node("a", "NVIDIA-GeForce-RTX-3090", 2)]));
        assert!(!v.allowed());
        let d = denial_of(&v, "KvCacheTooSmall");
        assert_eq!(d.field, "spec.engine.maxModelLen");
        assert!(
            d.message.starts_with("maxModelLen 1000000 needs"),
            "{}",
            d.message
        );
        assert!(d.message.contains("lower maxModelLen to"), "{}", d.message);
        assert!(
            d.message
                .contains("the selected nodes have NVIDIA-GeForce-RTX-3090 (24.00 GiB)"),
            "{}",
            d.message
        );
        assert!(v.capacity.is_none() && v.resolved.is_none());
    }

    #[test]
    fn admitted_verdicts_carry_predicted_capacity() {
        let s = llama_8b("{maxModelLen: 32768, gpuMemoryUtilization: 0.85}");
        let v = validate(&s, &cluster(vec![node("h", "NVIDIA-H100-80GB-HBM3", 8)]));
        assert!(v.allowed(), "{v:#?}");
        let c = v.capacity.as_ref().unwrap();
        let tokens = c.tokens_per_replica.unwrap();
        // 128 KiB per token in bf16; roughly (80 GiB x 0.85 - 16 GiB - reserve) / 128 KiB.
        assert!(tokens > 300_000 && tokens < 430_000, "{tokens}");
        assert!(c.max_concurrency.unwrap() > 9.0, "{c:?}");
        assert!(c.vllm_tokens_per_replica.unwrap() > 0);
        assert_eq!(
            v.capacity_basis.as_ref().unwrap().product,
            "NVIDIA-H100-80GB-HBM3"
        );
    }

    #[test]
    fn gpus_too_small_for_one_request_are_excluded_by_product() {
        // 131072 tokens x 128 KiB = 16 GiB of KV: fits an L40S (48 GB), not an L4 (24 GB).
        let s = llama_8b("{maxModelLen: 131072, gpuMemoryUtilization: 0.85}");
        let v = validate(
            &s,
            &cluster(vec![node("l4", "NVIDIA-L4", 1), node("l40s", "NVIDIA-L40S", 4)]),
        );
        assert!(v.allowed(), "{v:#?}");
        assert_eq!(v.compatible_nodes, vec!["l40s"]);
        let terms = affinity_terms(&v);
        assert_eq!(
            terms[0].last().unwrap(),
            &(labels::PRODUCT.to_string(), vec!["NVIDIA-L40S".to_string()])
        );
        assert!(
            v.warnings
                .iter()
                .any(|w| w.starts_with("1 node with NVIDIA-L4 cannot hold one request")),
            "{:?}",
            v.warnings
        );
        assert_eq!(
            v.warnings[0],
            "1 of 2 selected GPU nodes can run this; the affinity excludes the others"
        );
    }
}

// === denials that name the fix, offline and in the cluster ===

#[test]
fn kvfleet_runtime_with_tensor_parallelism_is_denied_naming_the_fix() {
    let v = validate(
        &llama("{runtime: kvfleet, tensorParallelSize: 4}"),
        &cluster(vec![node("h", "NVIDIA-H100-80GB-HBM3", 8)]),
    );
    assert!(!v.allowed());
    let d = denial_of(&v, "KvfleetSingleGpu");
    assert_eq!(d.field, "spec.engine.tensorParallelSize");
    assert!(
        d.message.contains("runs one GPU per replica")
            && d.message.contains("tensorParallelSize is 4")
            && d.message.contains("set tensorParallelSize to 1")
            && d.message.contains("runtime vllm"),
        "{}",
        d.message
    );
    // The same spec with the vllm runtime runs on 4 of the 8 GPUs.
    assert!(validate(
        &llama("{runtime: vllm, tensorParallelSize: 4}"),
        &cluster(vec![node("h", "NVIDIA-H100-80GB-HBM3", 8)])
    )
    .allowed());
}

#[test]
fn kvfleet_runtime_with_a_config_map_model_is_denied_with_the_geometry_fix() {
    let s = spec("model: {name: x, config: {configMapRef: {name: cfg}}}\nengine: {runtime: kvfleet}\n");
    let v = validate(&s, &cluster(vec![node("h", "NVIDIA-H100-80GB-HBM3", 8)]));
    assert!(!v.allowed(), "{v:#?}");
    assert_eq!(v.denials.len(), 1, "{v:#?}");
    let d = &v.denials[0];
    assert_eq!(
        (d.field.as_str(), d.reason.as_str()),
        ("spec.model.geometry", "KvfleetNeedsGeometry")
    );
    assert!(
        d.message.contains("ConfigMap cfg, key config.json")
            && d.message.contains("write model.geometry")
            && d.message.contains("num_key_value_heads"),
        "{}",
        d.message
    );
    // No promise that the worker's preflight checks it.
    assert!(
        !v.warnings.iter().any(|w| w.contains("preflight")),
        "{:?}",
        v.warnings
    );
}

#[test]
fn two_problems_in_one_spec_are_reported_in_one_denial() {
    // Tensor parallelism on the kvfleet runtime and a maxModelLen no L4 can hold.
    let v = validate(
        &llama("{runtime: kvfleet, tensorParallelSize: 2, maxModelLen: 1000000}"),
        &cluster(vec![node("l4", "NVIDIA-L4", 2)]),
    );
    let reasons: Vec<&str> = v.denials.iter().map(|d| d.reason.as_str()).collect();
    assert!(
        reasons.contains(&"KvfleetSingleGpu") && reasons.contains(&"KvCacheTooSmall"),
        "{v:#?}"
    );
    assert!(v.resolved.is_none() && v.node_affinity.is_none() && v.capacity.is_none());
}

#[test]
fn offline_check_and_the_cluster_use_the_memory_gfd_labels_the_product_with() {
    // GFD labels an L4 with 23034 MiB (not 24 GiB): kvfleet check --gpu must judge the
    // same maxModelLen as admission against a real L4 node does.
    let facts = synthetic_cluster(&["NVIDIA-L4"]).unwrap();
    assert_eq!(facts.nodes[0].labels[labels::MEMORY_MIB], "23034");
    let mut real = node("l4", "NVIDIA-L4", 1);
    real.labels.insert(labels::MEMORY_MIB.into(), "23034".into());
    let mut unlabelled = node("l4-bare", "NVIDIA-L4", 1);
    unlabelled.labels.remove(labels::MEMORY_MIB);
    assert_eq!(unlabelled.gpu_memory_bytes(), Some(23034 * 1024 * 1024));
    for len in [17360u32, 17376, 20000, 27840] {
        let s = llama(&format!("{{runtime: kvfleet, maxModelLen: {len}}}"));
        let offline = validate(&s, &facts);
        let cluster_v = validate(&s, &cluster(vec![real.clone()]));
        assert_eq!(offline.allowed(), cluster_v.allowed(), "maxModelLen {len}");
        assert_eq!(offline.capacity, cluster_v.capacity, "maxModelLen {len}");
    }
}

#[test]
fn a_capacity_denial_suggests_tensor_parallelism_only_where_nodes_have_the_gpus() {
    let big = "{runtime: vllm, maxModelLen: 400000}";
    let on_one = validate(&llama(big), &cluster(vec![node("l4", "NVIDIA-L4", 1)]));
    let d = denial_of(&on_one, "KvCacheTooSmall");
    assert!(!d.message.contains("raise tensorParallelSize"), "{}", d.message);
    assert!(d.message.contains("lower maxModelLen to"), "{}", d.message);
    let on_eight = validate(&llama(big), &cluster(vec![node("l4", "NVIDIA-L4", 8)]));
    let d = denial_of(&on_eight, "KvCacheTooSmall");
    assert!(d.message.contains("raise tensorParallelSize"), "{}", d.message);
    // kvfleet runs one GPU per replica: never suggested.
    let kvfleet = validate(
        &llama("{runtime: kvfleet, maxModelLen: 400000}"),
        &cluster(vec![node("l4", "NVIDIA-L4", 8)]),
    );
    let d = denial_of(&kvfleet, "KvCacheTooSmall");
    assert!(!d.message.contains("raise tensorParallelSize"), "{}", d.message);
}

#[test]
fn with_no_matching_node_the_declared_products_are_judged_and_admitted_with_a_warning() {
    // A B200 pool scaled to zero: only H100 nodes exist right now.
    let h100 = cluster(vec![node("h", "NVIDIA-H100-80GB-HBM3", 8)]);
    let s = spec(&format!(
        "{LLAMA}engine: {{runtime: vllm, kvCacheDtype: nvfp4}}\ngpu: {{selector: {{products: [NVIDIA-B200]}}}}\n"
    ));
    let v = validate(&s, &h100);
    assert!(v.allowed(), "{v:#?}");
    assert!(v.compatible_nodes.is_empty());
    assert!(
        v.warnings[0].contains("judged against the products they declare (NVIDIA-B200)")
            && v.warnings[0].contains("pods stay Pending until such a node joins"),
        "{:?}",
        v.warnings
    );
    let r = v.resolved.as_ref().unwrap();
    assert_eq!(r.compute_capabilities, vec!["10.0"]);
    let terms = affinity_terms(&v);
    assert!(
        terms[0].contains(&(labels::PRODUCT.to_string(), vec!["NVIDIA-B200".to_string()])),
        "{terms:?}"
    );
    // What the declared product cannot run is still denied, naming it.
    let s = spec(&format!(
        "{LLAMA}engine: {{runtime: vllm, kvCacheDtype: nvfp4}}\ngpu: {{selector: {{products: [NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition]}}}}\n"
    ));
    let v = validate(&s, &h100);
    assert!(!v.allowed());
    assert_eq!(v.denials[0].field, "spec.engine.kvCacheDtype");
    assert!(
        v.denials[0].message.contains("use fp8"),
        "{}",
        v.denials[0].message
    );
    // Only a minimum compute capability: every known product at or above it.
    let s = spec(&format!(
        "{LLAMA}engine: {{runtime: vllm}}\ngpu: {{selector: {{minComputeCapability: \"10.0\"}}}}\n"
    ));
    let v = validate(&s, &h100);
    assert!(v.allowed(), "{v:#?}");
    let ten: ComputeCapability = "10.0".parse().unwrap();
    assert!(v
        .resolved
        .as_ref()
        .unwrap()
        .compute_capabilities
        .iter()
        .all(|c| c.parse::<ComputeCapability>().unwrap() >= ten));
    // Nothing declared: nothing to judge against.
    let none = validate(&llama("{runtime: vllm}"), &cluster(vec![]));
    assert_eq!(none.denials[0].reason, NO_MATCHING_NODES);
}

// === multi-node replicas ===

fn h100s(n: usize) -> ClusterFacts {
    cluster(
        (0..n)
            .map(|i| node(&format!("h100-{i}"), "NVIDIA-H100-80GB-HBM3", 8))
            .collect(),
    )
}

#[test]
fn tensor_parallel_16_on_8_gpu_nodes_spans_two_nodes_of_8() {
    let v = validate(&llama("{runtime: vllm, tensorParallelSize: 16}"), &h100s(2));
    assert!(v.allowed(), "{v:#?}");
    assert_eq!(
        v.multi_node,
        Some(MultiNode {
            nodes_per_replica: 2,
            gpus_per_node: 8,
            most_gpus_on_a_node: 8
        })
    );
    assert_eq!(v.compatible_nodes, vec!["h100-0", "h100-1"]);
    // On a 16-GPU node it is one pod again.
    let one = validate(
        &llama("{runtime: vllm, tensorParallelSize: 16}"),
        &cluster(vec![node("big", "NVIDIA-H100-80GB-HBM3", 16)]),
    );
    assert!(one.allowed() && one.multi_node.is_none(), "{one:#?}");
}

#[test]
fn parallel_sizes_under_one_are_denied_each_with_its_field_and_meaning() {
    let v = validate(
        &llama("{runtime: vllm, tensorParallelSize: 0, pipelineParallelSize: 0}"),
        &h100s(1),
    );
    let of = |field: &str| {
        v.denials
            .iter()
            .find(|d| d.field == field)
            .unwrap_or_else(|| panic!("no denial of {field}: {v:#?}"))
    };
    // The schema's minimum, checked as the API server would.
    let tp = of("spec.engine.tensorParallelSize");
    assert_eq!(tp.reason, "ValueOutOfBounds");
    assert_eq!(
        tp.message,
        "spec.engine.tensorParallelSize 0 is below the minimum 1; set it to the GPUs one replica shards the model over"
    );
    let pp = of("spec.engine.pipelineParallelSize");
    assert_eq!(pp.reason, "ValueOutOfBounds");
    assert_eq!(
        pp.message,
        "spec.engine.pipelineParallelSize 0 is below the minimum 1; set it to the pipeline stages of one replica (1 for none; often its nodes)"
    );
}

#[test]
fn pipeline_stages_multiply_the_gpus_of_a_replica() {
    let s = llama("{runtime: vllm, tensorParallelSize: 8, pipelineParallelSize: 2}");
    assert_eq!(s.gpus_per_replica(), 16);
    let v = validate(&s, &h100s(2));
    assert_eq!(v.multi_node.map(|m| m.nodes_per_replica), Some(2), "{v:#?}");
    // 12 GPUs over nodes of at most 8: 2 nodes of 6 each.
    let s = llama("{runtime: vllm, tensorParallelSize: 4, pipelineParallelSize: 3}");
    let v = validate(&s, &h100s(2));
    assert_eq!(
        v.multi_node.map(|m| (m.nodes_per_replica, m.gpus_per_node)),
        Some((2, 6)),
        "{v:#?}"
    );
}

#[test]
fn a_pool_with_fewer_nodes_than_replicas_need_is_denied_naming_field_reason_and_fix() {
    let s = spec(&format!(
        "{LLAMA}replicas: 2\nengine: {{runtime: vllm, tensorParallelSize: 16}}\n"
    ));
    let v = validate(&s, &h100s(3));
    assert!(!v.allowed());
    let d = denial_of(&v, INSUFFICIENT_NODES);
    assert_eq!(d.field, "spec.replicas");
    assert!(
        d.message.contains("2 replicas need 4 such nodes")
            && d.message.contains("the selected pool has 3")
            && d.message.contains("lower spec.replicas to 1")
            && d.message.contains("add nodes with at least 8 GPUs"),
        "{}",
        d.message
    );
    assert!(v.resolved.is_none() && v.node_affinity.is_none() && v.multi_node.is_none());
    assert!(validate(&s, &h100s(4)).allowed());
}

#[test]
fn multi_node_on_a_release_without_the_multi_node_launch_is_denied_with_the_release() {
    let s = llama("{runtime: vllm, tensorParallelSize: 16, vllm: {version: 0.14.0}}");
    let v = validate(&s, &h100s(2));
    let d = denial_of(&v, "MultiNodeNeedsNewerVllm");
    assert!(
        d.message.contains("needs vLLM >= 0.15.0") && d.message.contains("runs vLLM 0.14.0"),
        "{}",
        d.message
    );
    // One node holding the replica needs no multi-node launch.
    assert!(validate(&s, &cluster(vec![node("big", "NVIDIA-H100-80GB-HBM3", 16)])).allowed());
}

#[test]
fn kvfleet_runtime_with_pipeline_stages_is_denied_naming_the_fix() {
    let v = validate(&llama("{runtime: kvfleet, pipelineParallelSize: 2}"), &h100s(1));
    let d = v
        .denials
        .iter()
        .find(|d| d.field == "spec.engine.pipelineParallelSize")
        .unwrap_or_else(|| panic!("{v:#?}"));
    assert!(
        d.message.contains("set pipelineParallelSize to 1"),
        "{}",
        d.message
    );
}

#[test]
fn parallelism_above_the_gpus_per_replica_bound_is_denied_in_code() {
    let v = validate(
        &llama("{runtime: vllm, tensorParallelSize: 16, pipelineParallelSize: 8}"),
        &h100s(1),
    );
    let d = &v.denials[0];
    assert_eq!(d.field, "spec.engine.pipelineParallelSize");
    assert!(
        d.message
            .contains("is 128 GPUs per replica, above the maximum 64"),
        "{}",
        d.message
    );
    let v = validate(&llama("{runtime: vllm, pipelineParallelSize: 65}"), &h100s(1));
    assert_eq!(v.denials[0].field, "spec.engine.pipelineParallelSize");
}

#[test]
fn pipeline_stages_split_the_layers_so_a_replica_holds_about_twice_the_tokens() {
    let one = validate(
        &llama("{runtime: vllm, tensorParallelSize: 8, maxModelLen: 8192}"),
        &h100s(1),
    );
    let two = validate(
        &llama("{runtime: vllm, tensorParallelSize: 8, pipelineParallelSize: 2, maxModelLen: 8192}"),
        &h100s(2),
    );
    let tokens = |v: &Verdict| {
        v.capacity
            .as_ref()
            .and_then(|c| c.tokens_per_replica)
            .unwrap_or_else(|| panic!("{v:#?}"))
    };
    let (a, b) = (tokens(&one), tokens(&two));
    // 16 of 32 layers per GPU: twice the tokens, less the pages lost to rounding.
    assert!(b > a * 19 / 10 && b <= a * 2 + 64, "pp1 {a}, pp2 {b}");
}

#[test]
fn a_gpu_memory_label_that_would_overflow_is_ignored_with_a_warning_naming_node_and_label() {
    // 17592186044416 MiB is 2^64 bytes: unchecked, it wrapped to a GPU of 0 bytes.
    let mut bad = node("h100-bad", "NVIDIA-H100-80GB-HBM3", 8);
    bad.labels
        .insert(labels::MEMORY_MIB.into(), "17592186044416".into());
    assert_eq!(bad.unreadable_gpu_memory(), Some("17592186044416"));
    let good = node("h100-good", "NVIDIA-H100-80GB-HBM3", 8);
    assert_eq!(bad.gpu_memory_bytes(), good.gpu_memory_bytes());
    let s = llama("{runtime: vllm}");
    let v = validate(&s, &cluster(vec![bad]));
    assert!(v.allowed(), "{v:#?}");
    assert_eq!(v.capacity, validate(&s, &cluster(vec![good])).capacity);
    let warning = v
        .warnings
        .iter()
        .find(|w| w.contains(labels::MEMORY_MIB))
        .unwrap_or_else(|| panic!("{:#?}", v.warnings));
    assert!(
        warning.contains("h100-bad (\"17592186044416\")") && warning.contains("fix the label"),
        "{warning}"
    );
    // The largest memory a label may give is read, without overflow.
    let mut big = node("big", "NVIDIA-H100-80GB-HBM3", 8);
    big.labels
        .insert(labels::MEMORY_MIB.into(), GPU_MEMORY_MIB_MAX.to_string());
    assert_eq!(big.gpu_memory_bytes(), Some(GPU_MEMORY_MIB_MAX << 20));
}

#[test]
fn every_problem_of_a_spec_is_denied_at_once_most_important_first() {
    // nvfp4 KV on sm_120 and a maxModelLen no RTX PRO 6000 holds (issue 35: the second was
    // reported only once the first was fixed).
    let pro = || {
        cluster(vec![node(
            "pro-0",
            "NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition",
            4,
        )])
    };
    let two = llama("{runtime: vllm, kvCacheDtype: nvfp4, maxModelLen: 33554432}");
    let v = validate(&two, &pro());
    let fields: Vec<(&str, &str)> = v
        .denials
        .iter()
        .map(|d| (d.field.as_str(), d.reason.as_str()))
        .collect();
    assert_eq!(
        fields,
        [
            ("spec.engine.kvCacheDtype", "UnsupportedKvCacheDtype"),
            ("spec.engine.maxModelLen", "KvCacheTooSmall"),
        ],
        "{v:#?}"
    );
    assert!(
        v.denials[1]
            .message
            .contains("judged with kvCacheDtype nvfp4 as requested"),
        "{}",
        v.denials[1].message
    );
    // A spec problem comes before where it runs: kvfleet's single GPU first.
    let three = llama("{runtime: kvfleet, tensorParallelSize: 2, kvCacheDtype: fp8_e4m3, attentionBackend: FLASHINFER, maxModelLen: 33554432}");
    let v = validate(&three, &pro());
    let reasons: Vec<&str> = v.denials.iter().map(|d| d.reason.as_str()).collect();
    assert_eq!(reasons.first(), Some(&"KvfleetSingleGpu"), "{v:#?}");
    assert_eq!(reasons.last(), Some(&"KvCacheTooSmall"), "{v:#?}");
    // A maxModelLen that fits is not denied where nothing runs.
    let one = llama("{runtime: vllm, kvCacheDtype: nvfp4}");
    let v = validate(&one, &pro());
    assert_eq!(v.denials.len(), 1, "{v:#?}");
}

// === FP8 weights (issue 32) ===

const LLAMA_8B_FP8: &str = "
model:
  name: llama-fp8
  geometry: {layers: 32, queryHeads: 32, kvHeads: 8, headDim: 128, hiddenSize: 4096, intermediateSize: 14336, vocabSize: 128256}
  weightBytes: 16Gi
";

fn fp8_spec(model_extra: &str, engine: &str) -> InferenceDeploymentSpec {
    spec(&format!("{LLAMA_8B_FP8}{model_extra}engine: {engine}\n"))
}

#[test]
fn fp8_checkpoints_on_l4_and_h100_are_admitted_for_vllm_without_a_marlin_warning() {
    for product in ["NVIDIA-L4", "NVIDIA-H100-80GB-HBM3"] {
        let s = fp8_spec("  quantization: fp8\n", "{runtime: vllm}");
        let v = validate(&s, &cluster(vec![node("a", product, 1)]));
        assert!(v.allowed(), "{product}: {v:#?}");
        assert!(
            v.warnings.iter().all(|w| !w.contains("Marlin")),
            "{product}: {:?}",
            v.warnings
        );
    }
}

#[test]
fn fp8_weights_on_an_a10_are_admitted_for_vllm_with_the_marlin_warning() {
    for model_extra in ["  quantization: fp8\n", ""] {
        let engine = if model_extra.is_empty() {
            "{runtime: vllm, quantization: fp8}"
        } else {
            "{runtime: vllm}"
        };
        let s = fp8_spec(model_extra, engine);
        let v = validate(&s, &cluster(vec![node("a", "NVIDIA-A10", 1)]));
        assert!(v.allowed(), "{v:#?}");
        let w = v
            .warnings
            .iter()
            .find(|w| w.contains("vllm.fp8-weights-marlin-below-sm89"))
            .unwrap_or_else(|| panic!("{:?}", v.warnings));
        assert!(w.contains("weight-only FP8 through the Marlin kernels"), "{w}");
        assert!(w.contains("L4, L40S"), "{w}");
    }
}

#[test]
fn fp8_weights_on_an_a10_are_denied_for_kvfleet_naming_the_gpus_that_can() {
    let s = fp8_spec("  quantization: fp8\n", "{runtime: kvfleet}");
    let v = validate(&s, &cluster(vec![node("a", "NVIDIA-A10", 1)]));
    assert!(!v.allowed());
    let d = denial_of(&v, "UnsupportedWeightQuantization");
    assert_eq!(d.field, "spec.gpu.selector.minComputeCapability");
    assert!(
        d.message.contains("the selected node has 8.6 (NVIDIA-A10)"),
        "{}",
        d.message
    );
    assert!(
        d.message
            .contains("select GPUs that can: L4, L40S, RTX 4090 (8.9), H100"),
        "{}",
        d.message
    );
    // With FP8 tensor cores the kvfleet runtime serves them (W8A8 on the GPU).
    for gpu in ["NVIDIA-L4", "NVIDIA-H100-80GB-HBM3"] {
        let v = validate(&s, &cluster(vec![node("a", gpu, 1)]));
        assert!(v.allowed(), "{gpu}: {}", messages(&v));
        assert!(!messages(&v).contains("FP8"), "{gpu}: {}", messages(&v));
    }
}

#[test]
fn engine_quantization_fp8_on_a_quantized_checkpoint_is_denied() {
    for (q, text) in [
        ("awq", "already awq-quantized"),
        ("fp8", "remove engine.quantization: the FP8 checkpoint"),
    ] {
        let s = fp8_spec(
            &format!("  quantization: {q}\n"),
            "{runtime: vllm, quantization: fp8}",
        );
        let v = validate(&s, &cluster(vec![node("a", "NVIDIA-H100-80GB-HBM3", 1)]));
        let d = v
            .denials
            .iter()
            .find(|d| d.reason == "QuantizationConflict")
            .unwrap_or_else(|| panic!("{q}: {v:#?}"));
        assert_eq!(d.field, "spec.engine.quantization");
        assert!(d.message.contains(text), "{}", d.message);
    }
}

#[test]
fn fp8_at_load_frees_weight_memory_for_kv_in_the_fit_check() {
    let nodes = cluster(vec![node("a", "NVIDIA-L4", 1)]);
    let bf16 = validate(&fp8_spec("", "{runtime: vllm}"), &nodes);
    let fp8 = validate(&fp8_spec("", "{runtime: vllm, quantization: fp8}"), &nodes);
    let tokens = |v: &Verdict| v.capacity.as_ref().and_then(|c| c.tokens_per_replica).unwrap();
    let (t16, t8) = (tokens(&bf16), tokens(&fp8));
    // 16 GiB of weights: about 7 GiB of linear layers less in FP8. A Llama-3.1-8B bf16 token
    // takes 128 KiB of KV (32 layers x 2 x 8 heads x 128 x 2 bytes).
    let freed = 16 * (1u64 << 30)
        - crate::plan::weights::LinearLayers::of(fp8_spec("", "{}").model.geometry.as_ref().unwrap())
            .unwrap()
            .fp8_bytes(16 << 30)
            .unwrap();
    let expected = (freed / (128 << 10)) as i64;
    assert!(
        (t8 - t16 - expected).abs() <= 16 * 2,
        "{t16} -> {t8}, expected +{expected}"
    );
    assert!(fp8.capacity_basis.is_some());
    // Without hiddenSize/intermediateSize the bf16 size is kept: never over-predicted.
    let bare = spec(
        "model:\n  name: l\n  geometry: {layers: 32, queryHeads: 32, kvHeads: 8, headDim: 128}\n  weightBytes: 16Gi\nengine: {runtime: vllm, quantization: fp8}\n",
    );
    let plain = spec(
        "model:\n  name: l\n  geometry: {layers: 32, queryHeads: 32, kvHeads: 8, headDim: 128}\n  weightBytes: 16Gi\nengine: {runtime: vllm}\n",
    );
    assert_eq!(
        tokens(&validate(&bare, &nodes)),
        tokens(&validate(&plain, &nodes))
    );
}

// === speculative decoding (engine.speculative) ===

fn speculative(engine: &str) -> InferenceDeploymentSpec {
    llama(engine)
}

fn h100() -> ClusterFacts {
    cluster(vec![node("h100-0", "NVIDIA-H100-80GB-HBM3", 8)])
}

#[test]
fn ngram_speculation_is_admitted_on_both_runtimes() {
    for runtime in ["kvfleet", "vllm"] {
        let s = speculative(&format!(
            "{{runtime: {runtime}, speculative: {{method: ngram, numSpeculativeTokens: 4, promptLookupMax: 3, promptLookupMin: 2}}}}"
        ));
        let v = validate(&s, &h100());
        assert!(v.allowed(), "{runtime}: {v:#?}");
    }
}

#[test]
fn eagle3_and_dflash_on_the_kvfleet_gpu_engine_are_admitted() {
    for method in ["eagle3", "dflash"] {
        let s = speculative(&format!(
            "{{runtime: kvfleet, speculative: {{method: {method}, numSpeculativeTokens: 3, draftModel: {{pvcName: drafts, path: d/}}}}}}"
        ));
        let v = validate(&s, &h100());
        assert!(
            v.allowed(),
            "{method} runs on the GPU engine beside Llama: {v:#?}"
        );
    }
}

#[test]
fn dflash_on_vllm_needs_0_20_and_keeps_auto_off_flashinfer() {
    let draft = "draftModel: {huggingFace: {repo: z-lab/Llama-DFlash}}";
    let old = speculative(&format!(
        "{{runtime: vllm, vllm: {{version: 0.19.0}}, speculative: {{method: dflash, numSpeculativeTokens: 15, {draft}}}}}"
    ));
    let v = validate(&old, &h100());
    let d = denial_of(&v, "UnsupportedByVllmVersion");
    assert_eq!(d.field, "spec.engine.speculative.method");
    for text in [
        "needs vLLM >= 0.20.0",
        "runs vLLM 0.19.0",
        "vllm/vllm-openai:v0.20.0",
    ] {
        assert!(d.message.contains(text), "{text:?} not in {}", d.message);
    }
    // From 0.20.0 it runs; on B200 auto would pick FLASHINFER, which runs no non-causal
    // drafter by default: FLASH_ATTN instead.
    let b200 = cluster(vec![node("b200-0", "NVIDIA-B200", 8)]);
    let new = speculative(&format!(
        "{{runtime: vllm, vllm: {{version: 0.20.0}}, speculative: {{method: dflash, numSpeculativeTokens: 15, {draft}}}}}"
    ));
    let v = validate(&new, &b200);
    assert!(v.allowed(), "{v:#?}");
    assert_eq!(v.resolved.unwrap().attention_backend, AttentionBackend::FlashAttn);
    let eagle = speculative(&format!(
        "{{runtime: vllm, vllm: {{version: 0.11.0}}, speculative: {{method: eagle3, numSpeculativeTokens: 3, {draft}}}}}"
    ));
    assert!(validate(&eagle, &h100()).allowed());
}

#[test]
fn speculative_settings_that_contradict_the_method_are_denied_with_the_field() {
    let cases = [
        (
            "{method: ngram, numSpeculativeTokens: 4, draftModel: {pvcName: d}}",
            "spec.engine.speculative.draftModel",
            "remove draftModel",
        ),
        (
            "{method: eagle3, numSpeculativeTokens: 4}",
            "spec.engine.speculative.draftModel",
            "set draftModel",
        ),
        (
            "{method: eagle3, numSpeculativeTokens: 4, promptLookupMax: 3, draftModel: {pvcName: d}}",
            "spec.engine.speculative.method",
            "use method ngram",
        ),
        (
            "{method: ngram, numSpeculativeTokens: 4, promptLookupMin: 5}",
            "spec.engine.speculative.promptLookupMin",
            "promptLookupMin 5 exceeds promptLookupMax 4",
        ),
        (
            "{method: dflash, numSpeculativeTokens: 4, draftModel: {pvcName: d, hostPath: /x}}",
            "spec.engine.speculative.draftModel",
            "exactly one source",
        ),
        (
            "{method: dflash, numSpeculativeTokens: 4, draftModel: {huggingFace: {}}}",
            "spec.engine.speculative.draftModel.huggingFace",
            "needs repo",
        ),
    ];
    for (speculative_yaml, field, text) in cases {
        let s = speculative(&format!("{{runtime: vllm, speculative: {speculative_yaml}}}"));
        let v = validate(&s, &h100());
        let d = v
            .denials
            .iter()
            .find(|d| d.reason == "InvalidSpeculativeConfig")
            .unwrap_or_else(|| panic!("{speculative_yaml}: {v:#?}"));
        assert_eq!(d.field, field, "{speculative_yaml}");
        assert!(d.message.contains(text), "{speculative_yaml}: {}", d.message);
    }
    let long = speculative("{runtime: kvfleet, maxModelLen: 8, maxNumBatchedTokens: 256, speculative: {method: ngram, numSpeculativeTokens: 8}}");
    let d = denial_of(&validate(&long, &h100()), "InvalidSpeculativeConfig").clone();
    assert_eq!(d.field, "spec.engine.speculative.numSpeculativeTokens");
}

#[test]
fn disable_by_batch_size_is_a_warning_on_vllm_and_silent_on_kvfleet() {
    let on = |runtime: &str| {
        validate(
            &speculative(&format!(
                "{{runtime: {runtime}, speculative: {{method: ngram, numSpeculativeTokens: 4, disableByBatchSize: 16}}}}"
            )),
            &h100(),
        )
    };
    let v = on("vllm");
    assert!(v.allowed(), "{v:#?}");
    assert!(
        v.warnings
            .iter()
            .any(|w| w.contains("disableByBatchSize is not honoured by vLLM") && w.contains("vllm#35060")),
        "{:?}",
        v.warnings
    );
    let k = on("kvfleet");
    assert!(k.allowed(), "{k:#?}");
    assert!(!k.warnings.iter().any(|w| w.contains("disableByBatchSize")));
}

#[test]
fn a_drafter_downloaded_with_another_token_than_the_models_is_denied() {
    let s = spec(&format!(
        "{LLAMA}  weights: {{format: safetensors, huggingFace: {{tokenSecretRef: {{name: a}}}}}}\nengine: {{runtime: vllm, speculative: {{method: eagle3, numSpeculativeTokens: 3, draftModel: {{huggingFace: {{repo: r, tokenSecretRef: {{name: b}}}}}}}}}}\n"
    ));
    let v = validate(&s, &h100());
    let d = denial_of(&v, "InvalidSpeculativeConfig");
    assert_eq!(
        d.field,
        "spec.engine.speculative.draftModel.huggingFace.tokenSecretRef"
    );
}

#[test]
fn the_crds_prompt_lookup_rule_uses_the_default_maximum() {
    use kube_core::CustomResourceExt;
    let crd = serde_json::to_string(&crate::api::InferenceDeployment::crd()).unwrap();
    let default = crate::api::DEFAULT_PROMPT_LOOKUP_MAX;
    assert!(
        crd.contains(&format!("self.promptLookupMax : {default})")),
        "the CEL rule of promptLookupMin must use DEFAULT_PROMPT_LOOKUP_MAX"
    );
    assert!(crd.contains(&format!("(default {default})")));
}

/// Llama-3.1-8B with dummy weights on runtime kvfleet (the planner knows its engine's every
/// term) and a drafter whose `draftModel` is `draft`.
fn llama_8b_with_drafter(method: &str, draft: &str) -> InferenceDeploymentSpec {
    spec(&format!(
        "model:\n  name: llama\n  geometry: {{layers: 32, queryHeads: 32, kvHeads: 8, headDim: 128, hiddenSize: 4096, intermediateSize: 14336, vocabSize: 128256}}\n  weights: {{format: dummy}}\nengine: {{runtime: kvfleet, maxModelLen: 8192, speculative: {{method: {method}, numSpeculativeTokens: 3, draftModel: {{pvcName: d, path: x/{draft}}}}}}}\n"
    ))
}

const EAGLE3_8B: &str = ", geometry: {layers: 1, hiddenSize: 4096, queryHeads: 32, kvHeads: 8, headDim: 128, intermediateSize: 14336, vocabSize: 32000}";

#[test]
fn a_drafter_geometry_takes_its_share_of_the_capacity_in_the_verdict() {
    let tokens = |s: &InferenceDeploymentSpec| {
        let v = validate(s, &h100());
        assert!(v.allowed(), "{v:#?}");
        (v.capacity.unwrap().tokens_per_replica.unwrap(), v.warnings)
    };
    let (alone, warned) = tokens(&llama_8b_with_drafter("eagle3", ""));
    assert!(
        warned.iter().any(|w| w.contains("draftModel.geometry is not set")
            && w.contains("eagle3")
            && w.contains("config.json")),
        "{warned:#?}"
    );
    let (with, quiet) = tokens(&llama_8b_with_drafter("eagle3", EAGLE3_8B));
    assert!(
        !quiet.iter().any(|w| w.contains("draftModel.geometry")),
        "{quiet:#?}"
    );
    // One layer of 32 on every page and about 1 GB of weights and buffers: 4-6% fewer tokens.
    let share = 1.0 - with as f64 / alone as f64;
    assert!((0.04..0.06).contains(&share), "{with} of {alone}: {share}");
}

#[test]
fn a_dflash_geometry_needs_its_feature_layers_and_kvfleet_runs_one_layer_eagle3() {
    let geometry = "geometry: {layers: 2, hiddenSize: 4096, queryHeads: 32, kvHeads: 8, headDim: 128, intermediateSize: 14336}";
    let v = validate(
        &llama_8b_with_drafter("dflash", &format!(", {geometry}")),
        &h100(),
    );
    let d = denial_of(&v, "InvalidSpeculativeConfig");
    assert_eq!(
        d.field,
        "spec.engine.speculative.draftModel.geometry.featureLayers"
    );
    assert!(d.message.contains("target_layer_ids"), "{}", d.message);
    let v = validate(
        &llama_8b_with_drafter("eagle3", &format!(", {geometry}")),
        &h100(),
    );
    let d = denial_of(&v, "InvalidSpeculativeConfig");
    assert_eq!(d.field, "spec.engine.speculative.draftModel.geometry.layers");
    assert!(d.message.contains("layers is 2"), "{}", d.message);
    // The same two-layer DFlash drafter with its feature layers is admitted.
    let ok = geometry.replace(
        "intermediateSize: 14336",
        "intermediateSize: 14336, featureLayers: 5",
    );
    let v = validate(&llama_8b_with_drafter("dflash", &format!(", {ok}")), &h100());
    assert!(v.allowed(), "{v:#?}");
}

#[test]
fn the_crds_rule_requires_feature_layers_for_dflash() {
    use kube_core::CustomResourceExt;
    let crd = serde_json::to_string(&crate::api::InferenceDeployment::crd()).unwrap();
    assert!(
        crd.contains("has(self.draftModel.geometry.featureLayers)"),
        "no featureLayers rule"
    );
    assert!(crd.contains("ownEmbeddings"));
}
