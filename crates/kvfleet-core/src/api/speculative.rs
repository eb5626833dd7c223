//! Speculative decoding (`spec.engine.speculative`): the method, its settings in vLLM's
//! `--speculative-config` terms, and where a drafter's checkpoint comes from.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::limits::*;
use super::{HuggingFaceSource, SpeculativeMethod};

/// Longest n-gram `ngram` matches when `promptLookupMax` is absent.
pub const DEFAULT_PROMPT_LOOKUP_MAX: i32 = 4;
/// Shortest n-gram `ngram` matches when `promptLookupMin` is absent.
pub const DEFAULT_PROMPT_LOOKUP_MIN: i32 = 1;
/// Running requests from which the kvfleet runtime stops speculating when
/// `disableByBatchSize` is absent. Speculation pays while a decode step is memory-bound (the
/// weights are read once whatever the batch); with enough requests in the batch the step
/// becomes compute-bound and verifying rejected drafts costs throughput. 32 is where that is
/// expected on the GPUs kvfleet targets for 8B-class models; to be measured (bench/).
pub const DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE: i32 = 32;

/// Speculative decoding (`engine.speculative`), in vLLM's `--speculative-config` terms.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "self.method == 'ngram' ? !has(self.draftModel) : has(self.draftModel)",
        "message": "draftModel is required with method eagle3 or dflash (the drafter checkpoint) and not allowed with method ngram (it needs no drafter)",
        "fieldPath": ".draftModel"
    },
    {
        "rule": "self.method == 'ngram' || (!has(self.promptLookupMax) && !has(self.promptLookupMin))",
        "message": "promptLookupMax and promptLookupMin apply to method ngram only; remove them",
        "fieldPath": ".method"
    },
    {
        "rule": "self.method != 'dflash' || !has(self.draftModel) || !has(self.draftModel.geometry) || has(self.draftModel.geometry.featureLayers)",
        "message": "draftModel.geometry.featureLayers is required with method dflash: the length of the drafter's dflash_config.target_layer_ids",
        "fieldPath": ".draftModel.geometry.featureLayers"
    },
    {
        // 4: DEFAULT_PROMPT_LOOKUP_MAX (a test keeps them equal).
        "rule": "!has(self.promptLookupMin) || self.promptLookupMin <= (has(self.promptLookupMax) ? self.promptLookupMax : 4)",
        "message": "promptLookupMin must not exceed promptLookupMax (default 4)",
        "fieldPath": ".promptLookupMin"
    }
]))]
pub struct SpeculativeSpec {
    /// How drafts are proposed: `ngram` (prompt lookup, no drafter; both runtimes), `eagle3`
    /// or `dflash` (a drafter checkpoint in `draftModel`; runtime vllm, dflash from vLLM
    /// 0.20.0).
    pub method: SpeculativeMethod,
    /// Draft tokens proposed per step (vLLM's `num_speculative_tokens`). A DFlash drafter is
    /// trained for a block size: use block size - 1.
    #[schemars(range(min = 1, max = 16))]
    pub num_speculative_tokens: i32,
    /// `ngram` only: longest n-gram matched against the sequence so far (vLLM's
    /// `prompt_lookup_max`). Absent: 4.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 16))]
    pub prompt_lookup_max: Option<i32>,
    /// `ngram` only: shortest n-gram matched, at most `promptLookupMax` (vLLM's
    /// `prompt_lookup_min`). Absent: 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 16))]
    pub prompt_lookup_min: Option<i32>,
    /// Runtime kvfleet: no drafts are proposed in steps that run this many requests or more,
    /// where a decode step stops being memory-bound and verification costs more than it
    /// saves. Absent: 32. vLLM's V1 engine ignores it (vLLM never reads
    /// `disable_by_batch_size` since 0.10), so it is not rendered for runtime vllm.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 2, max = MAX_NUM_SEQS_MAX))]
    pub disable_by_batch_size: Option<i32>,
    /// `eagle3` and `dflash`: where the drafter checkpoint comes from (required for them, not
    /// allowed with `ngram`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draft_model: Option<DraftModel>,
}

impl SpeculativeSpec {
    /// `promptLookupMax`, else [`DEFAULT_PROMPT_LOOKUP_MAX`].
    pub fn prompt_lookup_max(&self) -> i32 {
        self.prompt_lookup_max.unwrap_or(DEFAULT_PROMPT_LOOKUP_MAX)
    }

    /// `promptLookupMin`, else [`DEFAULT_PROMPT_LOOKUP_MIN`].
    pub fn prompt_lookup_min(&self) -> i32 {
        self.prompt_lookup_min.unwrap_or(DEFAULT_PROMPT_LOOKUP_MIN)
    }

    /// `disableByBatchSize`, else [`DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE`].
    pub fn disable_by_batch_size(&self) -> i32 {
        self.disable_by_batch_size
            .unwrap_or(DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE)
    }

    /// The keys of vLLM's `--speculative-config` both runtimes take alike: `method`,
    /// `num_speculative_tokens`, and for `ngram` both prompt lookups with their effective
    /// values (vLLM's defaults differ from kvfleet's, so they are always written).
    pub fn common_config(&self) -> serde_json::Value {
        let mut c = serde_json::json!({
            "method": self.method.as_str(),
            "num_speculative_tokens": self.num_speculative_tokens,
        });
        if self.method == SpeculativeMethod::Ngram {
            c["prompt_lookup_max"] = self.prompt_lookup_max().into();
            c["prompt_lookup_min"] = self.prompt_lookup_min().into();
        }
        c
    }
}

/// Where a drafter checkpoint (a Hugging Face directory: config.json and safetensors) comes
/// from, as `model.weights` says it for the model: a volume mounted read-only at
/// `/draft-models` with `path` inside it, or a Hub repository vLLM downloads at start (with
/// the pod's Hub token and cache: `model.weights.huggingFace`, else this one's token).
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "[has(self.pvcName), has(self.hostPath), has(self.image), has(self.huggingFace)].filter(x, x).size() == 1",
        "message": "set exactly one of draftModel.pvcName, draftModel.hostPath, draftModel.image and draftModel.huggingFace"
    },
    {
        "rule": "!has(self.huggingFace) || (has(self.huggingFace.repo) && !has(self.huggingFace.cachePvcName))",
        "message": "draftModel.huggingFace needs repo (the drafter's repository); its download cache is the model's (model.weights.huggingFace.cachePvcName), not a cachePvcName of its own",
        "fieldPath": ".huggingFace"
    }
]))]
pub struct DraftModel {
    /// A PersistentVolumeClaim holding the drafter, mounted read-only at `/draft-models`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = NAME_LEN_MAX))]
    pub pvc_name: Option<String>,
    /// A directory on the node holding the drafter, mounted read-only at `/draft-models`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 4096))]
    pub host_path: Option<String>,
    /// An OCI image (artifact) holding the drafter, mounted read-only at `/draft-models` as a
    /// Kubernetes image volume (needs Kubernetes 1.33+ with ImageVolume).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = IMAGE_LEN_MAX))]
    pub image: Option<String>,
    /// Path of the drafter's checkpoint directory inside the volume, relative to its root
    /// (e.g. `eagle3-llama-3.1-8b/`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = PATH_LEN_MAX))]
    pub path: Option<String>,
    /// Download the drafter from the Hugging Face Hub at start: `repo` (required) and
    /// `revision` (vLLM's `revision` of the speculative config); `tokenSecretRef` when the
    /// model's weights name none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hugging_face: Option<HuggingFaceSource>,
    /// The drafter's shape, from its `config.json`: runtime kvfleet reserves its weights,
    /// buffers and K/V out of the KV budget, and with it the capacity predicted at admission
    /// and in status counts them. Without it, that prediction is high by the drafter's share
    /// (a few percent for an 8B model) and admission warns.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub geometry: Option<DraftGeometry>,
}

/// A drafter's shape in its `config.json` terms (the keys each field names).
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DraftGeometry {
    /// Decoder layers (`num_hidden_layers`; an EAGLE-3 drafter has 1).
    #[schemars(range(min = 1, max = DRAFT_LAYERS_MAX))]
    pub layers: i32,
    /// `hidden_size`.
    #[schemars(range(min = 1, max = HIDDEN_SIZE_MAX))]
    pub hidden_size: i32,
    /// `num_attention_heads`.
    #[schemars(range(min = 1, max = HEADS_MAX))]
    pub query_heads: i32,
    /// `num_key_value_heads`.
    #[schemars(range(min = 1, max = HEADS_MAX))]
    pub kv_heads: i32,
    /// `head_dim` (`hidden_size / num_attention_heads` for a config without it).
    #[schemars(range(min = 8, max = HEAD_DIM_MAX))]
    pub head_dim: i32,
    /// `intermediate_size`.
    #[schemars(range(min = 1, max = HIDDEN_SIZE_MAX))]
    pub intermediate_size: i32,
    /// Rows of the drafter's LM head: `draft_vocab_size` (else its `vocab_size`). A DFlash
    /// drafter without `lm_head.weight` uses the model's head: leave it out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = VOCAB_SIZE_MAX))]
    pub vocab_size: Option<i32>,
    /// Target layers whose hidden states the drafter reads: EAGLE-3 3
    /// (`eagle_aux_hidden_state_layer_ids`), DFlash the length of
    /// `dflash_config.target_layer_ids` (required for dflash).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = LAYERS_MAX))]
    pub feature_layers: Option<i32>,
    /// The checkpoint holds its own `embed_tokens.weight` (else it embeds with the model's).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub own_embeddings: bool,
}

impl DraftModel {
    /// Whether the drafter is read from a volume (mounted at `/draft-models`).
    pub fn has_volume(&self) -> bool {
        self.pvc_name.is_some() || self.host_path.is_some() || self.image.is_some()
    }
}
