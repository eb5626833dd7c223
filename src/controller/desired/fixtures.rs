//! Test fixtures shared by the builders' tests: InferenceDeployments as the API server would
//! return them, verdicts, and accessors into the rendered Deployment.

use k8s_openapi::api::core::v1::{
    Container, NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, PodSpec,
    PodTemplateSpec, Volume,
};

use kube::api::ApiResource;

use super::{desired, Desired, MonitorKind, Settings};
use crate::api::{InferenceDeployment, ResolvedConfig};
use crate::validate::{labels as gfd, Verdict};

/// An InferenceDeployment `llama` serving Llama 3.1 8B, as a `&'static str`: the spec goes
/// on from `model.geometry` with the YAML lines given (the rest of `model`, then the other
/// fields). A macro (`concat!`) so that the fixtures built with it stay `const`s.
macro_rules! llama_8b {
    ($rest:literal) => {
        concat!(
            "\napiVersion: kvfleet.io/v1alpha1\nkind: InferenceDeployment\nmetadata: {name: llama}\nspec:\n",
            "  model:\n    name: meta-llama/Llama-3.1-8B-Instruct\n",
            "    geometry: {layers: 32, queryHeads: 32, kvHeads: 8, headDim: 128}",
            $rest
        )
    };
}
pub(crate) use llama_8b;

/// An InferenceDeployment `gemma` serving Gemma 3 12B on dummy weights, as [`llama_8b`] does.
macro_rules! gemma_12b {
    ($rest:literal) => {
        concat!(
            "\napiVersion: kvfleet.io/v1alpha1\nkind: InferenceDeployment\nmetadata: {name: gemma}\nspec:\n",
            "  model:\n    name: google/gemma-3-12b-it\n",
            "    geometry: {layers: 48, queryHeads: 16, kvHeads: 8, headDim: 256, slidingWindow: 1024}\n",
            "    weights: {format: dummy}",
            $rest
        )
    };
}
pub(crate) use gemma_12b;

pub fn fixture(yaml: &str) -> InferenceDeployment {
    let mut o: InferenceDeployment = serde_yaml::from_str(yaml).expect("fixture parses");
    o.metadata.namespace = Some("ml".into());
    o.metadata.uid = Some("0b7c6c1e-7f7e-4a38-9d43-2f9c1d3f7a10".into());
    o.metadata.generation = Some(1);
    o
}

pub const KVFLEET_RTX3090_TP2: &str = llama_8b!(
    r#"
    weightBytes: 16Gi
  replicas: 2
  engine:
    runtime: kvfleet
    kvCacheDtype: auto
    tensorParallelSize: 2
  gpu:
    selector: {products: [NVIDIA-GeForce-RTX-3090]}
"#
);

pub const VLLM_RTX5090: &str = gemma_12b!(
    r#"
  replicas: 1
  engine:
    runtime: vllm
    kvCacheDtype: fp8
    attentionBackend: auto
    maxModelLen: 32768
    maxNumSeqs: 32
    maxNumBatchedTokens: 4096
    blockSize: 32
    gpuMemoryUtilization: 0.85
    tensorParallelSize: 1
"#
);

/// The Prometheus operator's ServiceMonitor, as discovery finds it.
pub fn service_monitor() -> MonitorKind {
    MonitorKind {
        resource: ApiResource {
            group: "monitoring.coreos.com".into(),
            version: "v1".into(),
            api_version: "monitoring.coreos.com/v1".into(),
            kind: "ServiceMonitor".into(),
            plural: "servicemonitors".into(),
        },
        kind: "ServiceMonitor".into(),
    }
}

pub fn verdict(dtype: &str, backend: &str, cc: &str, product: &str) -> Verdict {
    Verdict {
        resolved: Some(ResolvedConfig {
            kv_cache_dtype: dtype.parse().expect("a KV cache dtype"),
            attention_backend: backend.parse().expect("an attention backend"),
            compute_capabilities: vec![cc.into()],
            products: vec![product.into()],
        }),
        node_affinity: Some(NodeAffinity {
            required_during_scheduling_ignored_during_execution: Some(NodeSelector {
                node_selector_terms: vec![NodeSelectorTerm {
                    match_expressions: Some(vec![NodeSelectorRequirement {
                        key: gfd::PRODUCT.into(),
                        operator: "In".into(),
                        values: Some(vec![product.into()]),
                    }]),
                    ..NodeSelectorTerm::default()
                }],
            }),
            ..NodeAffinity::default()
        }),
        compatible_nodes: vec!["gpu-1".into()],
        ..Verdict::default()
    }
}

/// `yaml` rendered for `v` with the default settings.
pub fn render(yaml: &str, v: &Verdict) -> Desired {
    desired(&fixture(yaml), v, &Settings::default(), None).unwrap()
}

/// The volume `name` of the rendered pod.
pub fn volume(d: &Desired, name: &str) -> Volume {
    pod(d)
        .volumes
        .unwrap()
        .into_iter()
        .find(|v| v.name == name)
        .unwrap_or_else(|| panic!("no volume {name}"))
}

/// The pod template of the rendered Deployment.
pub fn template(d: &Desired) -> &PodTemplateSpec {
    &d.deployment.as_ref().unwrap().spec.as_ref().unwrap().template
}

pub fn container(d: &Desired) -> Container {
    pod(d).containers[0].clone()
}
pub fn pod(d: &Desired) -> PodSpec {
    template(d).spec.clone().unwrap()
}

/// Asserts that each flag is followed by its value in `args`.
pub fn assert_flags(args: &[String], want: &[(&str, &str)]) {
    for (flag, value) in want {
        assert_eq!(
            arg_after(args, flag).as_deref(),
            Some(*value),
            "{flag} in {args:?}"
        );
    }
}

pub fn arg_after(args: &[String], flag: &str) -> Option<String> {
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1).cloned())
}
