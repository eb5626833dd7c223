//! Upper bounds of every size, count and length of an InferenceDeployment spec.
//!
//! The CRD schema carries them as `maximum` / `maxItems` / `maxLength` / `maxProperties`
//! (schemars attributes in [`super`]), and [`crate::validate`] checks them again before
//! anything is planned, so an object that bypassed the schema (a namespace the webhook
//! skips, `kvfleet check`, a direct AdmissionReview) is denied, never allocated for.
//! Each bound is far above what any published model or engine configuration uses.

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
/// Peers of `network.allowFrom`.
pub const ALLOW_FROM_MAX: usize = 32;
/// Entries of one peer's label selector (matchLabels plus matchExpressions), values of one
/// expression, and `ipBlock.except` entries.
pub const PEER_TERMS_MAX: usize = 32;
/// Pods of the kvfleet router (`routing.router.replicas`).
pub const ROUTER_REPLICAS_MAX: i32 = 64;
/// Replicas of one InferenceDeployment (`autoscaling.minReplicas` / `maxReplicas`); a fleet of
/// one model past a thousand replicas is several deployments.
pub const REPLICAS_MAX: i32 = 1000;
/// Policies per scaling direction (the HPA's field takes a handful in practice).
pub const AUTOSCALING_POLICIES_MAX: usize = 8;
/// Stabilization window in seconds (the HPA's own bound: one hour).
pub const STABILIZATION_WINDOW_MAX: i32 = 3600;
