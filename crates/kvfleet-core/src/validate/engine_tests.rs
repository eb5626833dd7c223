//! What kvfleet's engine serves (`compat::engine`) decides admission for runtime kvfleet:
//! an architecture, MoE layers or a weight format it cannot run is denied at `kubectl apply`,
//! naming what it does run, never admitted to fail at load (issues 55 and 56).

use super::tests::{denial_of, KVFLEET_H100};
use super::*;
use crate::compat::products;

fn spec(yaml: &str) -> InferenceDeploymentSpec {
    serde_yaml::from_str(yaml).unwrap()
}

/// KVFLEET_H100 with `extra` added to its model section.
fn kvfleet_h100(extra: &str) -> InferenceDeploymentSpec {
    spec(&KVFLEET_H100.replace("  weightBytes: 16Gi\n", &format!("  weightBytes: 16Gi\n{extra}")))
}

/// One node of `gpus` GPUs of `product` at compute capability `cc` (the GFD labels).
fn node(product: &str, cc: (u32, u32)) -> ClusterFacts {
    let like = products::lookup("Tesla-T4").unwrap();
    let mut n = NodeFacts::synthetic("n", like, 8);
    n.labels.insert(labels::PRODUCT.into(), product.into());
    n.labels.insert(labels::COMPUTE_MAJOR.into(), cc.0.to_string());
    n.labels.insert(labels::COMPUTE_MINOR.into(), cc.1.to_string());
    n.labels.insert(labels::MEMORY_MIB.into(), "81559".into());
    ClusterFacts {
        nodes: vec![n],
        ..ClusterFacts::default()
    }
}

fn h100() -> ClusterFacts {
    node("NVIDIA-H100-80GB-HBM3", (9, 0))
}

const QWEN3_30B_A3B: &str = "
replicas: 1
model:
  name: Qwen/Qwen3-30B-A3B
  architecture: Qwen3MoeForCausalLM
  geometry:
    layers: 48
    queryHeads: 32
    kvHeads: 4
    headDim: 128
    hiddenSize: 2048
    intermediateSize: 6144
    vocabSize: 151936
    moe: {numExperts: 128, numExpertsPerToken: 8, moeIntermediateSize: 768}
  weights: {format: dummy}
  weightBytes: 61Gi
engine: {runtime: RUNTIME}
gpu: {selector: {products: [NVIDIA-H100-80GB-HBM3]}}
";

#[test]
fn a_moe_model_is_denied_for_the_kvfleet_cuda_engine_and_admitted_for_vllm() {
    let s = spec(&QWEN3_30B_A3B.replace("RUNTIME", "kvfleet"));
    let v = validate(&s, &h100());
    assert!(!v.allowed());
    let d = denial_of(&v, "UnservedModelArchitecture");
    assert_eq!(d.field, "spec.model.architecture");
    assert!(
        d.message
            .contains("kvfleet's CUDA engine does not serve Qwen3MoeForCausalLM yet (its CPU engine does)"),
        "{}",
        d.message
    );
    assert!(d.message.contains("use runtime vllm"), "{}", d.message);
    // Without the architecture, the geometry's experts say it.
    let mut anonymous = s.clone();
    anonymous.model.architecture = None;
    let v = validate(&anonymous, &h100());
    let d = denial_of(&v, "UnservedMixtureOfExperts");
    assert_eq!(d.field, "spec.model.geometry.moe");
    assert!(d.message.contains("mixture-of-experts"), "{}", d.message);

    let mut vllm = spec(&QWEN3_30B_A3B.replace("RUNTIME", "vllm"));
    vllm.model.weights = serde_yaml::from_str("{format: dummy}").unwrap();
    let v = validate(&vllm, &h100());
    assert!(v.allowed(), "{v:#?}");
}

#[test]
fn a_served_architecture_is_admitted_and_an_unknown_one_names_the_served_list() {
    let v = validate(&kvfleet_h100("  architecture: Qwen3ForCausalLM\n"), &h100());
    assert!(v.allowed(), "{v:#?}");
    let v = validate(&kvfleet_h100("  architecture: GPT2LMHeadModel\n"), &h100());
    let d = denial_of(&v, "UnservedModelArchitecture");
    assert!(
        d.message
            .contains("its CUDA engine serves LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"),
        "{}",
        d.message
    );
}

#[test]
fn four_bit_checkpoints_are_denied_for_the_kvfleet_cuda_engine_naming_runtime_vllm() {
    for q in ["awq", "gptq", "w4a16", "mxfp4", "nvfp4"] {
        let v = validate(&kvfleet_h100(&format!("  quantization: {q}\n")), &h100());
        let d = denial_of(&v, "UnsupportedWeightQuantization");
        assert_eq!(d.field, "spec.model.quantization", "{q}");
        assert!(
            d.message.contains(&format!("does not run {q} weights")),
            "{q}: {}",
            d.message
        );
        assert!(d.message.contains("runtime vllm"), "{q}: {}", d.message);
    }
    // What it runs stays admitted.
    for q in ["none", "fp8"] {
        let v = validate(&kvfleet_h100(&format!("  quantization: {q}\n")), &h100());
        assert!(v.allowed(), "{q}: {v:#?}");
    }
}

/// vLLM's minimum compute capability per 4-bit format, judged on one node of each product.
#[test]
fn vllm_four_bit_formats_need_their_minimum_compute_capability() {
    let base = "
replicas: 1
model:
  name: m
  geometry: {layers: 32, queryHeads: 32, kvHeads: 8, headDim: 128}
  weights: {format: dummy}
  weightBytes: 5Gi
  quantization: Q
engine: {runtime: vllm}
";
    // (format, first capability that runs it)
    for (q, min) in [
        ("awq", (7, 5)),
        ("gptq", (6, 0)),
        ("w4a16", (8, 0)),
        ("mxfp4", (8, 0)),
        ("nvfp4", (8, 0)),
    ] {
        let s = spec(&base.replace("Q", q));
        for cc in [(5, 2), (7, 0), (7, 5), (8, 0), (9, 0)] {
            let v = validate(&s, &node("GPU", cc));
            assert_eq!(v.allowed(), cc >= min, "{q} on {cc:?}: {v:#?}");
            if !v.allowed() {
                let d = denial_of(&v, "UnsupportedWeightQuantization");
                assert!(d.message.contains("compute capability"), "{}", d.message);
            }
        }
    }
    // NVFP4 below Blackwell is weight-only through Marlin: admitted with a warning.
    let s = spec(&base.replace("Q", "nvfp4"));
    let v = validate_offline(&s, &["NVIDIA-H100-80GB-HBM3"]).unwrap();
    assert!(v.allowed());
    assert!(
        v.warnings.iter().any(|w| w.contains("Marlin")),
        "{:?}",
        v.warnings
    );
    let v = validate_offline(&s, &["NVIDIA-B200"]).unwrap();
    assert!(v.allowed());
    assert!(
        v.warnings.iter().all(|w| !w.contains("Marlin")),
        "{:?}",
        v.warnings
    );
}
