//! Bounds of every size, count and length of an InferenceDeployment spec.
//!
//! The CRD schema carries them as `minimum` / `maximum` / `maxItems` / `maxLength` /
//! `maxProperties` (schemars attributes in [`super`]); that schema is the one source of
//! truth: the webhook reads reviews within it ([`super::bounded`]) and [`crate::validate`]
//! checks every spec against it before anything is planned, so an object that bypassed the
//! API server's own schema check (a namespace the webhook skips, `kvfleet check`, an
//! AdmissionReview sent directly) is denied, never allocated for. Each upper bound is far
//! above what any published model or engine configuration uses; each list a person writes
//! by hand is bounded well above what a person maintains.

/// Decoder layers (the largest published models have fewer than 200).
pub const LAYERS_MAX: i32 = 1024;
/// Query or KV heads per layer.
pub const HEADS_MAX: i32 = 1024;
/// Head dimension.
pub const HEAD_DIM_MAX: i32 = 1024;
/// Layers of a speculative draft model (real drafters have 1 to a few dozen).
pub const DRAFT_LAYERS_MAX: i32 = 1024;
/// MLA latent rank (DeepSeek V3: 512).
pub const KV_LORA_RANK_MAX: i32 = 8192;
/// MLA rotary head dimension (DeepSeek V3: 64).
pub const QK_ROPE_HEAD_DIM_MAX: i32 = 1024;
/// Routed experts per MoE layer (DeepSeek V3 and Qwen3-235B: 256 and 128).
pub const EXPERTS_MAX: i32 = 4096;
/// Hidden size (Llama 3.1 405B: 16384).
pub const HIDDEN_SIZE_MAX: i32 = 131_072;
/// Vocabulary size (Gemma: 262144).
pub const VOCAB_SIZE_MAX: i32 = 4_194_304;
/// Context length in tokens (2^25; Llama 4 Scout advertises 10M). Also bounds
/// slidingWindow and maxNumBatchedTokens.
pub const MAX_MODEL_LEN_MAX: i64 = 33_554_432;
/// Sliding window in tokens.
pub const SLIDING_WINDOW_MAX: i32 = MAX_MODEL_LEN_MAX as i32;
/// Tokens scheduled in one step.
pub const MAX_NUM_BATCHED_TOKENS_MAX: i32 = MAX_MODEL_LEN_MAX as i32;
/// Sequences running at once.
pub const MAX_NUM_SEQS_MAX: i32 = 65_536;
/// GPUs one replica shards over (tensorParallelSize, gpu.count, and
/// tensorParallelSize x pipelineParallelSize).
pub const GPUS_PER_REPLICA_MAX: i32 = 64;
/// Pipeline stages of one replica (pipelineParallelSize).
pub const PIPELINE_STAGES_MAX: i32 = 64;
/// Entries of `engine.extraArgs`, and bytes of each.
pub const EXTRA_ARGS_MAX: usize = 256;
pub const EXTRA_ARG_LEN_MAX: usize = 4096;
/// Bytes of an image reference.
pub const IMAGE_LEN_MAX: usize = 1024;
/// Entries of `gpu.selector.products`.
pub const PRODUCTS_MAX: usize = 64;
/// Bytes of a Kubernetes name or label value we copy (DNS subdomain).
pub const NAME_LEN_MAX: usize = 253;
/// Bytes of a path inside a volume.
pub const PATH_LEN_MAX: usize = 4096;
/// Entries of `pod.nodeSelector`, `pod.tolerations`.
pub const NODE_SELECTOR_MAX: usize = 64;
pub const TOLERATIONS_MAX: usize = 64;
/// Entries of `pod.env`, `pod.annotations`.
pub const ENV_MAX: usize = 256;
pub const ANNOTATIONS_MAX: usize = 256;
/// Peers of `network.allowFrom`: a NetworkPolicy rule's `from` list that a person maintains
/// by hand (a gateway, a namespace or two, a few CIDRs); 32 is several times what such
/// lists hold, and keeps the NetworkPolicy the controller renders small.
pub const ALLOW_FROM_MAX: usize = 32;
/// Entries of one peer's label selector (`matchLabels`, `matchExpressions`, and the two
/// together), values of one expression, and `ipBlock.except` entries: label selectors
/// written by hand name a few labels and values.
pub const PEER_TERMS_MAX: usize = 32;
/// A label key (`prefix/name`: a DNS subdomain of 253, `/`, a name of 63) and a label value
/// (63), as the API server validates them.
pub const LABEL_KEY_LEN_MAX: usize = 317;
pub const LABEL_VALUE_LEN_MAX: usize = 63;
/// A label selector operator (`DoesNotExist` is the longest).
pub const OPERATOR_LEN_MAX: usize = 12;
/// A CIDR (`ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff/128`).
pub const CIDR_LEN_MAX: usize = 43;
/// Resource names of a container's `limits` or `requests` (cpu, memory,
/// ephemeral-storage, nvidia.com/gpu, a few hugepages and devices) and its DRA `claims`.
pub const RESOURCES_MAX: usize = 16;
/// A short free-form value (a vLLM release, a KV-events topic).
pub const SHORT_STRING_LEN_MAX: usize = 253;
/// Pods of the kvfleet router (`routing.router.replicas`).
pub const ROUTER_REPLICAS_MAX: i32 = 64;
/// Replicas of one InferenceDeployment (`autoscaling.minReplicas` / `maxReplicas`); a fleet of
/// one model past a thousand replicas is several deployments.
pub const REPLICAS_MAX: i32 = 1000;
/// Policies per scaling direction (the HPA's field takes a handful in practice).
pub const AUTOSCALING_POLICIES_MAX: usize = 8;
/// Stabilization window in seconds (the HPA's own bound: one hour).
pub const STABILIZATION_WINDOW_MAX: i32 = 3600;
