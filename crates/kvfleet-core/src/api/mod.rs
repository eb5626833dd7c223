//! The `InferenceDeployment` custom resource (group `kvfleet.io`, version `v1alpha1`).
//!
//! These types are the single source of truth for `crds/` and the chart's CRD: doc
//! comments become the schema's descriptions, and `kvfleet crd` prints the result.

// kube's `printcolumn(...)` repeats the same keys once per column by design.
#![allow(clippy::duplicated_attributes)]

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{EnvVar, ResourceRequirements, Toleration};
use k8s_openapi::api::networking::v1::NetworkPolicyPeer;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube_derive::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub use crate::compat::vocab::{AttentionBackend, KvCacheDtype, Quantization, Runtime, SpeculativeMethod};

mod autoscaling;
pub mod bounded;
mod features;
pub mod limits;
mod routing;
mod speculative;
pub use autoscaling::*;
use limits::*;
pub use routing::*;
pub use speculative::*;

pub const GROUP: &str = "kvfleet.io";
pub const VERSION: &str = "v1alpha1";
pub const KIND: &str = "InferenceDeployment";

/// An LLM inference deployment: a model, the engine that serves it and the GPUs it may
/// run on. kvfleet checks at admission that the configuration can run on the selected
/// nodes and that its KV cache fits, then runs it and reports the KV capacity in status.
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    // The derive names kube-core itself: the core crate does not depend on kube (the client).
    crates(kube_core = "::kube_core"),
    group = "kvfleet.io",
    version = "v1alpha1",
    kind = "InferenceDeployment",
    plural = "inferencedeployments",
    singular = "inferencedeployment",
    shortname = "infdep",
    category = "kvfleet",
    namespaced,
    status = "InferenceDeploymentStatus",
    derive = "PartialEq",
    doc = "An LLM inference deployment checked against the GPUs it can land on and the KV cache it needs.",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.selector"
    ),
    printcolumn(
        name = "Ready",
        type_ = "integer",
        json_path = ".status.readyReplicas",
        description = "Replicas whose worker passed preflight and serves"
    ),
    printcolumn(
        name = "Replicas",
        type_ = "integer",
        json_path = ".spec.replicas",
        description = "Desired replicas"
    ),
    printcolumn(
        name = "KV dtype",
        type_ = "string",
        json_path = ".status.resolved.kvCacheDtype",
        description = "KV-cache dtype after resolving auto"
    ),
    printcolumn(
        name = "Capacity",
        type_ = "integer",
        json_path = ".status.capacity.tokensPerReplica",
        description = "Predicted KV-cache capacity in tokens per replica"
    ),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "!has(self.gpu) || !has(self.gpu.count) || self.gpu.count >= self.engine.tensorParallelSize * self.engine.pipelineParallelSize",
        "message": "gpu.count must be at least engine.tensorParallelSize x engine.pipelineParallelSize: each replica shards the model over that many GPUs",
        "fieldPath": ".gpu.count"
    }
]))]
pub struct InferenceDeploymentSpec {
    /// Desired number of replicas; each replica is one pod serving the whole model.
    #[serde(default = "default_replicas")]
    #[schemars(range(min = 0))]
    pub replicas: i32,

    /// The model to serve.
    pub model: ModelSpec,

    /// The engine that serves the model and its KV-cache configuration.
    #[serde(default)]
    pub engine: EngineSpec,

    /// The GPUs a replica may run on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<GpuSpec>,

    /// Overrides for the pods kvfleet creates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<PodOverrides>,

    /// Requires `Authorization: Bearer <key>` on the OpenAI API of every replica, the key read
    /// from a Secret of the namespace. Off by default: in-cluster clients reach replicas
    /// through the Service, and NetworkPolicy is the usual guard.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key: Option<ApiKeySpec>,

    /// Who may reach the replicas. Absent: no NetworkPolicy, so any pod of the cluster reaches
    /// them (the in-cluster default, as for any Deployment). Present: the controller renders
    /// the NetworkPolicy `<name>-worker`, which admits ingress to the serving port only from
    /// these peers and from the metrics peers the operator was installed with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkSpec>,

    /// How requests reach the replicas. Absent: `mode: service`, the Service `<name>` in front
    /// of the worker pods, connections spread by kube-proxy (docs/routing.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing: Option<RoutingSpec>,

    /// Replicas follow the KV demand of the requests (docs/autoscaling.md). Absent: the
    /// replica count is `replicas`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<AutoscalingSpec>,
}

/// KEDA's ScaledObject (crds/vendor/keda), rendered for `spec.autoscaling.engine: keda`.
pub mod scaled_object {
    pub const GROUP: &str = "keda.sh";
    pub const VERSION: &str = "v1alpha1";
    pub const KIND: &str = "ScaledObject";
    pub const PLURAL: &str = "scaledobjects";
    /// Name of its CustomResourceDefinition.
    pub const CRD: &str = "scaledobjects.keda.sh";
    /// The KEDA release whose CRD is vendored (crds/vendor/keda).
    pub const RELEASE: &str = "v2.20.2";
}

/// Ingress to the replicas' serving port (8000: the OpenAI API, probes and `/metrics`).
/// Takes effect where the cluster's network plugin enforces NetworkPolicy.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NetworkSpec {
    /// Peers allowed to reach the serving port, as in a NetworkPolicy rule's `from`: each a
    /// `podSelector` and/or `namespaceSelector`, or an `ipBlock`. A `podSelector` alone means
    /// pods of this namespace. Empty: no client is admitted (only the metrics peers).
    #[serde(default)]
    #[schemars(length(max = ALLOW_FROM_MAX), transform = bound_peers)]
    pub allow_from: Vec<NetworkPolicyPeer>,
}

/// Sets `key` to `value` in the object at `pointer` of `schema`, when there is one.
fn bound_at(schema: &mut schemars::Schema, pointer: &str, key: &str, value: usize) {
    if let Some(object) = schema.pointer_mut(pointer).and_then(|v| v.as_object_mut()) {
        object.insert(key.to_string(), value.into());
    }
}

/// k8s-openapi's NetworkPolicyPeer schema bounds none of its lists, maps and strings: bound
/// them as [`limits`] derives (label selectors and CIDR lists written by hand).
fn bound_peers(schema: &mut schemars::Schema) {
    let peer = "/items/properties";
    for selector in ["podSelector", "namespaceSelector"] {
        let at = format!("{peer}/{selector}/properties");
        bound_at(
            schema,
            &format!("{at}/matchLabels"),
            "maxProperties",
            PEER_TERMS_MAX,
        );
        bound_at(
            schema,
            &format!("{at}/matchLabels/additionalProperties"),
            "maxLength",
            LABEL_VALUE_LEN_MAX,
        );
        bound_at(
            schema,
            &format!("{at}/matchExpressions"),
            "maxItems",
            PEER_TERMS_MAX,
        );
        let expr = format!("{at}/matchExpressions/items/properties");
        bound_at(schema, &format!("{expr}/key"), "maxLength", LABEL_KEY_LEN_MAX);
        bound_at(schema, &format!("{expr}/operator"), "maxLength", OPERATOR_LEN_MAX);
        bound_at(schema, &format!("{expr}/values"), "maxItems", PEER_TERMS_MAX);
        bound_at(
            schema,
            &format!("{expr}/values/items"),
            "maxLength",
            LABEL_VALUE_LEN_MAX,
        );
    }
    let ip = format!("{peer}/ipBlock/properties");
    bound_at(schema, &format!("{ip}/cidr"), "maxLength", CIDR_LEN_MAX);
    bound_at(schema, &format!("{ip}/except"), "maxItems", PEER_TERMS_MAX);
    bound_at(schema, &format!("{ip}/except/items"), "maxLength", CIDR_LEN_MAX);
}

/// k8s-openapi's ResourceRequirements schema bounds neither its maps nor its claims.
fn bound_resources(schema: &mut schemars::Schema) {
    bound_at(schema, "/properties/limits", "maxProperties", RESOURCES_MAX);
    bound_at(schema, "/properties/requests", "maxProperties", RESOURCES_MAX);
    bound_at(schema, "/properties/claims", "maxItems", RESOURCES_MAX);
}

/// Where the API key of the replicas is: a key of a Secret in the InferenceDeployment's
/// namespace (`kvfleet worker` reads it as `KVFLEET_API_KEY`, vLLM as `VLLM_API_KEY`).
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ApiKeySpec {
    /// Name of the Secret.
    #[schemars(length(min = 1, max = 253))]
    pub secret_name: String,
    /// Key in the Secret (default `api-key`).
    #[serde(default = "default_api_key_key")]
    #[schemars(length(min = 1, max = 253))]
    pub key: String,
}

fn default_api_key_key() -> String {
    "api-key".into()
}

fn default_replicas() -> i32 {
    1
}

/// The model: its name, its attention geometry (inline or from an HF `config.json`) and
/// the bytes its weights occupy on each GPU.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "has(self.geometry) != has(self.config)",
        "message": "set exactly one of model.geometry and model.config"
    }
]))]
pub struct ModelSpec {
    /// Model name served by the API (e.g. `meta-llama/Llama-3.1-8B-Instruct`).
    #[schemars(length(min = 1, max = 253))]
    pub name: String,

    /// Attention geometry written inline. Set this or `config`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub geometry: Option<ModelGeometry>,

    /// The model's HF `config.json`, read from a ConfigMap. Set this or `geometry`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<ModelConfigSource>,

    /// Bytes the weights occupy in total (all tensor-parallel ranks together), e.g. `16Gi`.
    /// Used to predict how much GPU memory is left for the KV cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("maxLength" = 64))]
    pub weight_bytes: Option<Quantity>,

    /// The checkpoint's weight quantization, as its config.json declares it
    /// (`quantization_config`). `fp8` is an FP8 (e4m3) checkpoint in either format vLLM reads:
    /// its own `fp8` method (`quant_method: fp8`) or compressed-tensors `float-quantized`
    /// with 8-bit float weights (llm-compressor's FP8 schemes). It decides which GPUs can run
    /// the model (docs/compat.md, "FP8 weights") and how `weightBytes` is read. Some KV dtypes
    /// are refused with quantized checkpoints (vLLM: fp8_e5m2 KV with any quantized
    /// checkpoint). To quantize an unquantized checkpoint at load, use
    /// `engine.quantization` instead.
    #[serde(default)]
    pub quantization: Quantization,

    /// The checkpoint's architecture, as `architectures[0]` of its config.json names it
    /// (e.g. `Qwen3MoeForCausalLM`). Optional; with runtime kvfleet, admission denies an
    /// architecture the engine does not load on the selected devices, naming those it does
    /// (docs/compat.md, "Model architectures").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 128))]
    pub architecture: Option<String>,

    /// Where the worker loads weights from. Required to serve text: a kvfleet worker without
    /// weights refuses to start; random weights (capacity and throughput runs, like vLLM's
    /// dummy load format) only with `format: dummy`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<WeightsSource>,
}

/// Quantization applied by the engine at load time (`engine.quantization`).
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum EngineQuantization {
    /// The weights stay as the checkpoint stores them.
    #[default]
    None,
    /// Linear-layer weights quantized to FP8 e4m3 at load (vLLM `--quantization fp8`).
    Fp8,
}

impl EngineQuantization {
    pub fn is_none(&self) -> bool {
        *self == EngineQuantization::None
    }

    pub fn as_str(self) -> &'static str {
        match self {
            EngineQuantization::None => "none",
            EngineQuantization::Fp8 => "fp8",
        }
    }
}

/// The dtype the linear-layer weights have in GPU memory: what decides which GPUs can run
/// them and how many bytes they take.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightDtype {
    /// bf16/fp16 (an unquantized checkpoint, not quantized at load).
    Bf16,
    /// FP8 e4m3: an FP8 checkpoint, or quantized at load with `engine.quantization: fp8`.
    Fp8,
    /// Another quantization (AWQ, GPTQ, INT8, NVFP4, GGUF): `weightBytes` is taken as is.
    Other,
}

/// Per-layer attention type, as in HF `layer_types`.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum LayerType {
    /// Attends to the whole context.
    FullAttention,
    /// Attends to the last `slidingWindow` tokens.
    SlidingAttention,
}

/// The attention geometry that decides KV-cache size and which kernels can run.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "!has(self.layerTypes) || size(self.layerTypes) == self.layers",
        "message": "layerTypes must list one entry per layer",
        "fieldPath": ".layerTypes"
    },
    {
        "rule": "self.queryHeads % self.kvHeads == 0",
        "message": "queryHeads must be a multiple of kvHeads (grouped-query attention)",
        "fieldPath": ".kvHeads"
    },
    {
        "rule": "!has(self.layerTypes) || !self.layerTypes.exists(t, t == 'sliding_attention') || has(self.slidingWindow)",
        "message": "sliding_attention layers need slidingWindow",
        "fieldPath": ".slidingWindow"
    }
]))]
pub struct ModelGeometry {
    /// Number of decoder layers that hold a KV cache.
    #[schemars(range(min = 1, max = LAYERS_MAX))]
    pub layers: i32,
    /// Attention (query) heads per layer.
    #[schemars(range(min = 1, max = HEADS_MAX))]
    pub query_heads: i32,
    /// Key/value heads per layer (grouped-query attention when fewer than queryHeads).
    #[schemars(range(min = 1, max = HEADS_MAX))]
    pub kv_heads: i32,
    /// Dimension of one attention head.
    #[schemars(range(min = 8, max = HEAD_DIM_MAX))]
    pub head_dim: i32,
    /// Window of sliding-attention layers in tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = SLIDING_WINDOW_MAX))]
    pub sliding_window: Option<i32>,
    /// Attention type of each layer; absent means all layers are full attention
    /// (or all sliding when only slidingWindow is set, as in Mistral 7B v0.1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = LAYERS_MAX))]
    pub layer_types: Option<Vec<LayerType>>,
    /// Head dimension of full-attention layers when it differs from headDim (Gemma 4).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 8, max = HEAD_DIM_MAX))]
    pub global_head_dim: Option<i32>,
    /// KV heads of full-attention layers when they differ from kvHeads (Gemma 4).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = HEADS_MAX))]
    pub global_kv_heads: Option<i32>,
    /// MLA latent rank (DeepSeek-style `kv_lora_rank`); set with qkRopeHeadDim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = KV_LORA_RANK_MAX))]
    pub kv_lora_rank: Option<i32>,
    /// MLA rotary head dimension (`qk_rope_head_dim`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = QK_ROPE_HEAD_DIM_MAX))]
    pub qk_rope_head_dim: Option<i32>,
    /// Extra layers of a speculative draft model served with it (their KV cache counts too).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = DRAFT_LAYERS_MAX))]
    pub draft_layers: Option<i32>,
    /// Hidden size (needed to serve real weights; optional for capacity planning).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = HIDDEN_SIZE_MAX))]
    pub hidden_size: Option<i32>,
    /// Vocabulary size (needed to serve real weights; optional for capacity planning).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = VOCAB_SIZE_MAX))]
    pub vocab_size: Option<i32>,
    /// MLP width (`intermediate_size`). Optional: with hiddenSize and vocabSize it makes the
    /// kvfleet runtime's memory prediction exact; without it dummy weights take 8/3 x
    /// hiddenSize rounded up to 256.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = HIDDEN_SIZE_MAX))]
    pub intermediate_size: Option<i32>,
    /// Mixture-of-experts layers (Qwen3-MoE, Mixtral, gpt-oss...): absent for a dense model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeGeometry>,
}

/// The mixture-of-experts terms of a model's `config.json`: what decides the weights every
/// GPU holds (every expert, not only those a token uses) and which engines can run it.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "self.numExpertsPerToken <= self.numExperts",
        "message": "numExpertsPerToken cannot exceed numExperts",
        "fieldPath": ".numExpertsPerToken"
    }
]))]
pub struct MoeGeometry {
    /// Routed experts per MoE layer (`num_experts`, `num_local_experts`).
    #[schemars(range(min = 1, max = EXPERTS_MAX))]
    pub num_experts: i32,
    /// Experts each token is routed to (`num_experts_per_tok`).
    #[schemars(range(min = 1, max = EXPERTS_MAX))]
    pub num_experts_per_token: i32,
    /// Width of one expert's MLP (`moe_intermediate_size`; Mixtral and gpt-oss:
    /// `intermediate_size`).
    #[schemars(range(min = 1, max = HIDDEN_SIZE_MAX))]
    pub moe_intermediate_size: i32,
    /// Width of the shared expert every token also runs (`shared_expert_intermediate_size`,
    /// Qwen2-MoE); absent or 0 for none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = HIDDEN_SIZE_MAX))]
    pub shared_expert_intermediate_size: Option<i32>,
    /// Indices of the layers whose MLP is dense (`mlp_only_layers`, or the layers that
    /// `decoder_sparse_step` skips); their width is the geometry's intermediateSize.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = LAYERS_MAX), inner(range(min = 0, max = LAYERS_MAX)))]
    pub dense_layers: Vec<i32>,
}

/// Where to read an HF `config.json`.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ModelConfigSource {
    /// A key of a ConfigMap in the deployment's namespace.
    pub config_map_ref: ConfigMapKeyRef,
}

/// A key of a ConfigMap in the same namespace.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ConfigMapKeyRef {
    /// ConfigMap name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// Key holding the JSON; defaults to `config.json`.
    #[serde(default = "default_config_key")]
    #[schemars(length(min = 1, max = NAME_LEN_MAX))]
    pub key: String,
}

fn default_config_key() -> String {
    "config.json".to_string()
}

/// Where the worker reads weights from. The volume (a PersistentVolumeClaim or a directory of
/// the node) is mounted read-only at `/models`; `path` names the GGUF file or the Hugging Face
/// checkpoint directory (config.json, safetensors, tokenizer.json) inside it. `format: dummy`
/// serves random weights of the geometry instead (capacity and throughput runs only).
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "[has(self.pvcName), has(self.hostPath), has(self.image), has(self.huggingFace)].filter(x, x).size() <= 1",
        "message": "set at most one of weights.pvcName, weights.hostPath, weights.image and weights.huggingFace",
    },
]))]
pub struct WeightsSource {
    /// File format of the weights: `gguf` (one file), `safetensors` (a checkpoint
    /// directory), or `dummy` (random weights, no volume).
    #[serde(default)]
    pub format: WeightsFormat,
    /// A PersistentVolumeClaim holding the weights, mounted read-only at `/models`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = NAME_LEN_MAX))]
    pub pvc_name: Option<String>,
    /// A directory on the node holding the weights (e.g. a local NVMe cache), mounted
    /// read-only at `/models`. Set this or `pvcName`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 4096))]
    pub host_path: Option<String>,
    /// Path of the weights file or checkpoint directory inside the volume, relative to its
    /// root (e.g. `llama-3.1-8b/` or `smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = PATH_LEN_MAX))]
    pub path: Option<String>,
    /// An OCI image (artifact) holding the weights, mounted read-only at `/models` as a
    /// Kubernetes image volume (runtime vllm; needs Kubernetes 1.33+ with ImageVolume).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = IMAGE_LEN_MAX))]
    pub image: Option<String>,
    /// Download the weights from the Hugging Face Hub at start (runtime vllm).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hugging_face: Option<HuggingFaceSource>,
}

/// A Hugging Face Hub repository vLLM downloads at start.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HuggingFaceSource {
    /// Repository id (e.g. `Qwen/Qwen3-32B`); defaults to `model.name`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub repo: Option<String>,
    /// Branch, tag or commit to download; defaults to the repository's main branch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub revision: Option<String>,
    /// A Secret key holding the access token (`HF_TOKEN`), for gated or private repositories.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_secret_ref: Option<SecretKeyRef>,
    /// A PersistentVolumeClaim (ReadWriteMany when replicas share it) for the download cache
    /// (`HF_HOME`), so a restarted pod does not download the checkpoint again. Without it the
    /// cache lives in the pod's `/tmp` and is lost with the pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = NAME_LEN_MAX))]
    pub cache_pvc_name: Option<String>,
}

/// A key of a Secret in the same namespace.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SecretKeyRef {
    /// Secret name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// Key of the token; defaults to `token`.
    #[serde(default = "default_token_key")]
    #[schemars(length(min = 1, max = NAME_LEN_MAX))]
    pub key: String,
}

fn default_token_key() -> String {
    "token".to_string()
}

impl WeightsSource {
    /// Whether the weights come from somewhere (a volume, an image or the Hub).
    pub fn has_source(&self) -> bool {
        self.pvc_name.is_some()
            || self.host_path.is_some()
            || self.image.is_some()
            || self.hugging_face.is_some()
    }
}

/// Weight file format.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum WeightsFormat {
    /// Random weights of the geometry.
    #[default]
    Dummy,
    Gguf,
    Safetensors,
}

/// The serving engine and its KV-cache configuration.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "self.runtime == 'vllm' || self.attentionBackend in ['auto', 'KVFLEET_CUDA', 'KVFLEET_CPU']",
        "message": "the kvfleet runtime runs its own kernels: attentionBackend must be auto, KVFLEET_CUDA or KVFLEET_CPU",
        "fieldPath": ".attentionBackend"
    },
    {
        "rule": "self.runtime == 'kvfleet' || !(self.attentionBackend in ['KVFLEET_CUDA', 'KVFLEET_CPU'])",
        "message": "KVFLEET_* backends need runtime kvfleet; for vLLM use auto, FLASH_ATTN, FLASHINFER or TRITON_ATTN",
        "fieldPath": ".attentionBackend"
    },
    {
        "rule": "self.tensorParallelSize * self.pipelineParallelSize <= 64",
        "message": "tensorParallelSize x pipelineParallelSize (the GPUs of one replica) must be at most 64",
        "fieldPath": ".pipelineParallelSize"
    },
    {
        "rule": "self.maxNumBatchedTokens >= self.maxNumSeqs",
        "message": "maxNumBatchedTokens must be at least maxNumSeqs so every running sequence can decode in one step",
        "fieldPath": ".maxNumBatchedTokens"
    }
]))]
pub struct EngineSpec {
    /// `kvfleet` (our engine) or `vllm`.
    #[serde(default)]
    pub runtime: Runtime,
    /// Container image; defaults to the operator's own image for kvfleet and to
    /// `vllm/vllm-openai` for vllm.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = IMAGE_LEN_MAX))]
    pub image: Option<String>,
    /// KV-cache dtype; `auto` keeps the model dtype.
    #[serde(default)]
    pub kv_cache_dtype: KvCacheDtype,
    /// Quantize the weights when loading them (vLLM's `--quantization`). `fp8`: an unquantized
    /// bf16/fp16 checkpoint's linear layers become FP8 e4m3 with a per-tensor scale (vLLM's
    /// `fp8` method); embeddings and the LM head stay bf16. Halves most of the weights' memory,
    /// which goes to the KV cache. Only for unquantized checkpoints (`model.quantization:
    /// none`); an FP8 checkpoint needs nothing here. Absent: `none`.
    #[serde(default, skip_serializing_if = "EngineQuantization::is_none")]
    pub quantization: EngineQuantization,
    /// Attention backend; `auto` picks the best that runs on each selected architecture.
    #[serde(default)]
    pub attention_backend: AttentionBackend,
    /// Longest context (prompt + output) in tokens.
    #[serde(default = "default_max_model_len")]
    #[schemars(range(min = 1, max = MAX_MODEL_LEN_MAX))]
    pub max_model_len: i64,
    /// Most sequences running at once.
    #[serde(default = "default_max_num_seqs")]
    #[schemars(range(min = 1, max = MAX_NUM_SEQS_MAX))]
    pub max_num_seqs: i32,
    /// Most tokens scheduled in one step (prefill chunk + decodes).
    #[serde(default = "default_max_num_batched_tokens")]
    #[schemars(range(min = 1, max = MAX_NUM_BATCHED_TOKENS_MAX))]
    pub max_num_batched_tokens: i32,
    /// Tokens per KV-cache block (page).
    #[serde(default = "default_block_size")]
    #[schemars(extend("enum" = [1, 8, 16, 32, 64, 128]))]
    pub block_size: i32,
    /// Fraction of GPU memory the engine may use (weights, activations and KV cache).
    #[serde(default = "default_gpu_memory_utilization")]
    #[schemars(extend("minimum" = 0, "exclusiveMinimum" = true, "maximum" = 1))]
    pub gpu_memory_utilization: f64,
    /// GPUs one replica shards the model over.
    #[serde(default = "default_tensor_parallel_size")]
    #[schemars(range(min = 1, max = GPUS_PER_REPLICA_MAX))]
    pub tensor_parallel_size: i32,
    /// Pipeline stages one replica splits the model's layers into (runtime vllm). A replica
    /// uses tensorParallelSize x pipelineParallelSize GPUs; when that is more than one node of
    /// the selected pool has (GFD `nvidia.com/gpu.count`), the replica spans several nodes and
    /// kvfleet runs it as a LeaderWorkerSet (the LeaderWorkerSet CRD must be installed).
    #[serde(default = "default_pipeline_parallel_size")]
    #[schemars(range(min = 1, max = PIPELINE_STAGES_MAX))]
    pub pipeline_parallel_size: i32,
    /// Attention without a causal mask (drafter blocks, encoders).
    #[serde(default)]
    pub non_causal: bool,
    /// Automatic prefix caching: a request reuses the KV blocks of earlier requests that shared
    /// its prefix (vLLM's `--enable-prefix-caching`). On by default; set false to give every
    /// request a cold cache (docs/security.md: the timing side channel between tenants).
    #[serde(default = "default_true", skip_serializing_if = "is_true")]
    pub prefix_caching: bool,
    /// Publish KV-cache events (blocks stored and removed, vLLM's ZMQ wire format) for
    /// KV-aware routers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<KvEventsSpec>,
    /// Speculative decoding: propose several tokens per step and verify them in one forward
    /// pass of the model (vLLM's `--speculative-config`). The output is the same as without
    /// it; decode steps emit more than one token when drafts are accepted. Runtime kvfleet:
    /// `ngram` only. Absent: off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speculative: Option<SpeculativeSpec>,
    /// Extra command-line arguments appended to the engine's command.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = EXTRA_ARGS_MAX), inner(length(max = EXTRA_ARG_LEN_MAX)))]
    pub extra_args: Vec<String>,
    /// Settings of the vllm runtime only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vllm: Option<VllmEngineSpec>,
}

/// Settings of the vllm runtime.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VllmEngineSpec {
    /// The vLLM release the image holds (e.g. `0.21.1`), for images whose tag is not a
    /// release (a digest, `latest`, a private build). Flags, compat rules and capacity
    /// arithmetic follow it; without it they follow the image tag, or kvfleet's default
    /// image when no image is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(max = SHORT_STRING_LEN_MAX),
        regex(pattern = r"^v?[0-9]{1,3}\.[0-9]{1,3}(\.[0-9]{1,3})?([a-z0-9.+-]*)$")
    )]
    pub version: Option<String>,
}

fn default_max_model_len() -> i64 {
    8192
}
fn default_max_num_seqs() -> i32 {
    256
}
fn default_max_num_batched_tokens() -> i32 {
    8192
}
fn default_block_size() -> i32 {
    16
}
fn default_gpu_memory_utilization() -> f64 {
    0.9
}
fn default_tensor_parallel_size() -> i32 {
    1
}
fn default_pipeline_parallel_size() -> i32 {
    1
}

impl Default for EngineSpec {
    fn default() -> Self {
        Self {
            runtime: Runtime::default(),
            image: None,
            kv_cache_dtype: KvCacheDtype::default(),
            quantization: EngineQuantization::None,
            attention_backend: AttentionBackend::default(),
            max_model_len: default_max_model_len(),
            max_num_seqs: default_max_num_seqs(),
            max_num_batched_tokens: default_max_num_batched_tokens(),
            block_size: default_block_size(),
            gpu_memory_utilization: default_gpu_memory_utilization(),
            tensor_parallel_size: default_tensor_parallel_size(),
            pipeline_parallel_size: default_pipeline_parallel_size(),
            non_causal: false,
            prefix_caching: true,
            kv_events: None,
            speculative: None,
            extra_args: Vec::new(),
            vllm: None,
        }
    }
}

fn default_true() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
}

/// KV-cache events: a ZMQ PUB socket in each replica publishes vLLM's `KVEventBatch`
/// (msgpack: `BlockStored`, `BlockRemoved`, `AllBlocksCleared`) for routers to subscribe to.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KvEventsSpec {
    /// Publish the events (the container gets a port named `kv-events`).
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// Port of the PUB socket (vLLM's default endpoint is `tcp://*:5557`).
    #[serde(default = "default_kv_events_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,
    /// Topic of every message (vLLM's default: empty).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(length(max = SHORT_STRING_LEN_MAX))]
    pub topic: String,
}

fn default_kv_events_port() -> i32 {
    5557
}

/// Which GPUs a replica may use.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuSpec {
    /// Restricts the nodes considered, by GPU Feature Discovery labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<GpuSelector>,
    /// GPUs per replica; defaults to engine.tensorParallelSize x engine.pipelineParallelSize.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = GPUS_PER_REPLICA_MAX))]
    pub count: Option<i32>,
}

/// A filter on GPU Feature Discovery labels.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuSelector {
    /// Allowed `nvidia.com/gpu.product` values (e.g. `NVIDIA-H100-80GB-HBM3`); empty allows all.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = PRODUCTS_MAX), inner(length(max = NAME_LEN_MAX)))]
    pub products: Vec<String>,
    /// Lowest compute capability allowed, as `major.minor` (e.g. `8.0`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 5), regex(pattern = r"^[0-9]{1,2}\.[0-9]{1,2}$"))]
    pub min_compute_capability: Option<String>,
}

/// Overrides merged into the pods kvfleet creates.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PodOverrides {
    /// Container resources; `nvidia.com/gpu` is always set to the GPUs per replica.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = bound_resources)]
    pub resources: Option<ResourceRequirements>,
    /// Tolerations, e.g. for tainted GPU nodes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = TOLERATIONS_MAX))]
    pub tolerations: Vec<Toleration>,
    /// Node labels a pod's node must carry, in addition to kvfleet's GPU affinity.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = NODE_SELECTOR_MAX))]
    pub node_selector: BTreeMap<String, String>,
    /// Extra environment variables of the serving container.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = ENV_MAX))]
    pub env: Vec<EnvVar>,
    /// Extra pod annotations.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = ANNOTATIONS_MAX))]
    pub annotations: BTreeMap<String, String>,
}

/// What kvfleet observed and decided.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InferenceDeploymentStatus {
    /// The spec generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Compatible, CapacityPlanned, Available, Progressing and Degraded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// The configuration after resolving `auto` for the selected architectures.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resolved: Option<ResolvedConfig>,
    /// KV-cache capacity, predicted and measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<CapacityStatus>,
    /// Pods created for this deployment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<i32>,
    /// Pods ready to serve.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_replicas: Option<i32>,
    /// Pods running the current spec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_replicas: Option<i32>,
    /// Label selector of the pods, for the scale subresource and HPAs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    /// The autoscaler's last reading and decision (`spec.autoscaling`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<AutoscalingStatus>,
}

/// The configuration after resolving `auto`.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResolvedConfig {
    /// KV-cache dtype that runs (the same on every allowed architecture).
    pub kv_cache_dtype: KvCacheDtype,
    /// Attention backend that runs (the same on every allowed architecture).
    pub attention_backend: AttentionBackend,
    /// Compute capabilities of the nodes pods may land on, e.g. `["9.0"]`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub compute_capabilities: Vec<String>,
    /// GPU products of the nodes pods may land on.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub products: Vec<String>,
}

/// KV-cache capacity of one replica.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CapacityStatus {
    /// Tokens the KV cache holds per replica, as predicted by the planner.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_replica: Option<i64>,
    /// Requests of maxModelLen tokens that fit at once, predicted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrency: Option<f64>,
    /// Tokens the workers measured after sizing their KV pool (smallest over ready pods).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured_tokens_per_replica: Option<i64>,
    /// What vLLM would report for the same configuration ("GPU KV cache size").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vllm_tokens_per_replica: Option<i64>,
}

impl InferenceDeploymentSpec {
    /// The vLLM release this spec runs (runtime vllm): `engine.vllm.version`, else the image
    /// tag, else kvfleet's default image.
    pub fn vllm_version(
        &self,
    ) -> Result<crate::compat::VllmVersion, crate::compat::vllm_versions::VersionError> {
        crate::compat::vllm_versions::resolve(
            self.engine.image.as_deref(),
            self.engine.vllm.as_ref().and_then(|v| v.version.as_deref()),
        )
        .map(|(v, _)| v)
    }

    /// The routing mode: `routing.mode`, `service` when `routing` is absent.
    pub fn routing_mode(&self) -> RoutingMode {
        self.routing.as_ref().map(|r| r.mode).unwrap_or_default()
    }

    /// The dtype of the linear-layer weights in GPU memory: FP8 for an FP8 checkpoint or
    /// `engine.quantization: fp8`.
    pub fn weight_dtype(&self) -> WeightDtype {
        match (self.model.quantization, self.engine.quantization) {
            (Quantization::Fp8, _) | (Quantization::None, EngineQuantization::Fp8) => WeightDtype::Fp8,
            (Quantization::None, EngineQuantization::None) => WeightDtype::Bf16,
            _ => WeightDtype::Other,
        }
    }

    /// GPUs per replica: gpu.count, else tensorParallelSize x pipelineParallelSize.
    pub fn gpus_per_replica(&self) -> i32 {
        self.gpu
            .as_ref()
            .and_then(|g| g.count)
            .unwrap_or_else(|| self.parallel_gpus())
    }

    /// tensorParallelSize x pipelineParallelSize (saturating: bounds are checked elsewhere).
    pub fn parallel_gpus(&self) -> i32 {
        self.engine
            .tensor_parallel_size
            .saturating_mul(self.engine.pipeline_parallel_size.max(1))
    }
}
