//! Upper bounds of a spec's sizes, counts and lengths ([`crate::api::limits`]), checked
//! before anything is planned or allocated, and the denial for a planner that cannot
//! compute a capacity.
//!
//! The CRD schema holds the same bounds; these checks are for what did not pass through
//! it (a namespace the webhook skips, `kvfleet check`, an AdmissionReview sent directly).

use super::{denial, Denial};
use crate::api::limits::*;
use crate::api::InferenceDeploymentSpec;
use crate::plan::PlanError;

/// Reason of every bound denial (events, conditions, metrics).
pub const REASON: &str = "ValueOutOfBounds";
/// Reason of a capacity the planner cannot compute.
pub const PLANNER_REASON: &str = "CapacityNotComputable";

/// Bytes of a `weightBytes` quantity string (`16Gi`, `17179869184`, `1.5e10`).
const QUANTITY_LEN_MAX: usize = 64;
/// Bytes of `model.name` (the CRD's maxLength).
const MODEL_NAME_LEN_MAX: usize = 253;

struct Bounds {
    denials: Vec<Denial>,
}

impl Bounds {
    fn int(&mut self, field: &str, value: Option<i64>, max: i64, hint: &str) {
        if let Some(v) = value.filter(|v| *v > max) {
            self.denials.push(denial(
                field,
                REASON,
                format!("{field} {v} is above the maximum {max}; {hint}"),
            ));
        }
    }

    fn count(&mut self, field: &str, n: usize, max: usize, what: &str) {
        if n > max {
            self.denials.push(denial(
                field,
                REASON,
                format!("{field} has {n} {what}, more than the maximum {max}; remove some"),
            ));
        }
    }

    fn len(&mut self, field: &str, s: Option<&str>, max: usize) {
        if let Some(n) = s.map(str::len).filter(|n| *n > max) {
            self.denials.push(denial(
                field,
                REASON,
                format!("{field} is {n} bytes long, more than the maximum {max}; shorten it"),
            ));
        }
    }
}

/// Denials for every value of `spec` above its bound (empty when all are within).
pub fn check(spec: &InferenceDeploymentSpec) -> Vec<Denial> {
    let mut b = Bounds { denials: Vec::new() };
    let copy = "copy it from the model's config.json";
    b.len("spec.model.name", Some(&spec.model.name), MODEL_NAME_LEN_MAX);
    if let Some(g) = &spec.model.geometry {
        let f = |name: &str| format!("spec.model.geometry.{name}");
        let i = |v: i32| Some(i64::from(v));
        let o = |v: Option<i32>| v.map(i64::from);
        b.int(&f("layers"), i(g.layers), LAYERS_MAX.into(), copy);
        b.int(&f("queryHeads"), i(g.query_heads), HEADS_MAX.into(), copy);
        b.int(&f("kvHeads"), i(g.kv_heads), HEADS_MAX.into(), copy);
        b.int(&f("headDim"), i(g.head_dim), HEAD_DIM_MAX.into(), copy);
        b.int(
            &f("slidingWindow"),
            o(g.sliding_window),
            SLIDING_WINDOW_MAX.into(),
            copy,
        );
        b.int(
            &f("globalHeadDim"),
            o(g.global_head_dim),
            HEAD_DIM_MAX.into(),
            copy,
        );
        b.int(&f("globalKvHeads"), o(g.global_kv_heads), HEADS_MAX.into(), copy);
        b.int(&f("kvLoraRank"), o(g.kv_lora_rank), KV_LORA_RANK_MAX.into(), copy);
        b.int(
            &f("qkRopeHeadDim"),
            o(g.qk_rope_head_dim),
            QK_ROPE_HEAD_DIM_MAX.into(),
            copy,
        );
        b.int(
            &f("draftLayers"),
            o(g.draft_layers),
            DRAFT_LAYERS_MAX.into(),
            "set it to the draft model's num_hidden_layers",
        );
        b.int(&f("hiddenSize"), o(g.hidden_size), HIDDEN_SIZE_MAX.into(), copy);
        b.int(&f("vocabSize"), o(g.vocab_size), VOCAB_SIZE_MAX.into(), copy);
        if let Some(types) = &g.layer_types {
            b.count(&f("layerTypes"), types.len(), LAYERS_MAX as usize, "entries");
        }
    }
    if let Some(cfg) = &spec.model.config {
        b.len(
            "spec.model.config.configMapRef.name",
            Some(&cfg.config_map_ref.name),
            NAME_LEN_MAX,
        );
        b.len(
            "spec.model.config.configMapRef.key",
            Some(&cfg.config_map_ref.key),
            NAME_LEN_MAX,
        );
    }
    b.len(
        "spec.model.weightBytes",
        spec.model.weight_bytes.as_ref().map(|q| q.0.as_str()),
        QUANTITY_LEN_MAX,
    );
    if let Some(w) = &spec.model.weights {
        b.len("spec.model.weights.pvcName", w.pvc_name.as_deref(), NAME_LEN_MAX);
        b.len("spec.model.weights.path", w.path.as_deref(), PATH_LEN_MAX);
    }
    let e = &spec.engine;
    b.len("spec.engine.image", e.image.as_deref(), IMAGE_LEN_MAX);
    b.int(
        "spec.engine.maxModelLen",
        Some(e.max_model_len),
        MAX_MODEL_LEN_MAX,
        "lower it to the context length the model supports",
    );
    b.int(
        "spec.engine.maxNumSeqs",
        Some(e.max_num_seqs.into()),
        MAX_NUM_SEQS_MAX.into(),
        "lower it (vLLM's default is 256)",
    );
    b.int(
        "spec.engine.maxNumBatchedTokens",
        Some(e.max_num_batched_tokens.into()),
        MAX_NUM_BATCHED_TOKENS_MAX.into(),
        "lower it (8192 is the default)",
    );
    b.int(
        "spec.engine.tensorParallelSize",
        Some(e.tensor_parallel_size.into()),
        GPUS_PER_REPLICA_MAX.into(),
        "set it to the GPUs one replica shards the model over",
    );
    b.int(
        "spec.engine.pipelineParallelSize",
        Some(e.pipeline_parallel_size.into()),
        PIPELINE_STAGES_MAX.into(),
        "set it to the pipeline stages of one replica (often its nodes)",
    );
    let gpus = i64::from(e.tensor_parallel_size) * i64::from(e.pipeline_parallel_size);
    if b.denials.is_empty() && gpus > i64::from(GPUS_PER_REPLICA_MAX) {
        b.denials.push(denial(
            "spec.engine.pipelineParallelSize",
            REASON,
            format!(
                "tensorParallelSize {} x pipelineParallelSize {} is {gpus} GPUs per replica, above the maximum {GPUS_PER_REPLICA_MAX}; lower one of them",
                e.tensor_parallel_size, e.pipeline_parallel_size
            ),
        ));
    }
    b.count(
        "spec.engine.extraArgs",
        e.extra_args.len(),
        EXTRA_ARGS_MAX,
        "entries",
    );
    if let Some((i, a)) = e
        .extra_args
        .iter()
        .enumerate()
        .find(|(_, a)| a.len() > EXTRA_ARG_LEN_MAX)
    {
        b.len(&format!("spec.engine.extraArgs[{i}]"), Some(a), EXTRA_ARG_LEN_MAX);
    }
    if let Some(gpu) = &spec.gpu {
        b.int(
            "spec.gpu.count",
            gpu.count.map(i64::from),
            GPUS_PER_REPLICA_MAX.into(),
            "set it to the GPUs of one replica",
        );
        if let Some(sel) = &gpu.selector {
            b.count(
                "spec.gpu.selector.products",
                sel.products.len(),
                PRODUCTS_MAX,
                "entries",
            );
            if let Some((i, p)) = sel
                .products
                .iter()
                .enumerate()
                .find(|(_, p)| p.len() > NAME_LEN_MAX)
            {
                b.len(&format!("spec.gpu.selector.products[{i}]"), Some(p), NAME_LEN_MAX);
            }
            b.len(
                "spec.gpu.selector.minComputeCapability",
                sel.min_compute_capability.as_deref(),
                5,
            );
        }
    }
    if let Some(pod) = &spec.pod {
        b.count(
            "spec.pod.nodeSelector",
            pod.node_selector.len(),
            NODE_SELECTOR_MAX,
            "entries",
        );
        b.count(
            "spec.pod.tolerations",
            pod.tolerations.len(),
            TOLERATIONS_MAX,
            "entries",
        );
        b.count("spec.pod.env", pod.env.len(), ENV_MAX, "entries");
        b.count(
            "spec.pod.annotations",
            pod.annotations.len(),
            ANNOTATIONS_MAX,
            "entries",
        );
    }
    b.denials
}

/// The denial for a capacity the planner cannot compute: the spec cannot be served as
/// written, so it is denied (a warning would admit what the worker then fails on).
pub fn planner_denial(e: &PlanError) -> Denial {
    let field = match e {
        PlanError::InvalidQuantity { .. } => "spec.model.weightBytes",
        PlanError::TensorParallel { .. } => "spec.engine.tensorParallelSize",
        PlanError::UnsupportedDtype { .. } => "spec.engine.kvCacheDtype",
        _ => "spec.model.geometry",
    };
    denial(
        field,
        PLANNER_REASON,
        format!("the KV capacity cannot be computed: {e}; fix {field} so that it describes a model and engine that can run"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(yaml: &str) -> InferenceDeploymentSpec {
        serde_yaml::from_str(yaml).unwrap()
    }

    const GEOMETRY: &str = "{layers: 32, queryHeads: 32, kvHeads: 8, headDim: 128";

    #[test]
    fn a_spec_within_every_bound_has_no_bound_denial() {
        let s = spec(&format!(
            "model: {{name: m, geometry: {GEOMETRY}, draftLayers: 1024}}}}\nengine: {{maxModelLen: 33554432, tensorParallelSize: 64}}"
        ));
        assert_eq!(check(&s), vec![]);
    }

    #[test]
    fn each_value_over_its_bound_is_denied_naming_field_and_bound() {
        let cases = [
            ("model: {name: m, geometry: {layers: 1025, queryHeads: 32, kvHeads: 8, headDim: 128}}", "spec.model.geometry.layers", "1024"),
            ("model: {name: m, geometry: {layers: 32, queryHeads: 32, kvHeads: 8, headDim: 128, draftLayers: 2147483647}}", "spec.model.geometry.draftLayers", "1024"),
            ("model: {name: m, geometry: {layers: 32, queryHeads: 32, kvHeads: 8, headDim: 128, slidingWindow: 2147483647}}", "spec.model.geometry.slidingWindow", "33554432"),
            ("model: {name: m, geometry: {layers: 32, queryHeads: 32, kvHeads: 8, headDim: 128, kvLoraRank: 2147483647, qkRopeHeadDim: 64}}", "spec.model.geometry.kvLoraRank", "8192"),
            ("model: {name: m, geometry: {layers: 32, queryHeads: 32, kvHeads: 8, headDim: 128, vocabSize: 2147483647}}", "spec.model.geometry.vocabSize", "4194304"),
            ("model: {name: m, geometry: {layers: 32, queryHeads: 32, kvHeads: 8, headDim: 128}}\nengine: {tensorParallelSize: 2147483647}", "spec.engine.tensorParallelSize", "64"),
            ("model: {name: m, geometry: {layers: 32, queryHeads: 32, kvHeads: 8, headDim: 128}}\nengine: {maxModelLen: 9223372036854775807}", "spec.engine.maxModelLen", "33554432"),
            ("model: {name: m, geometry: {layers: 32, queryHeads: 32, kvHeads: 8, headDim: 128}}\nengine: {maxNumSeqs: 2147483647}", "spec.engine.maxNumSeqs", "65536"),
            ("model: {name: m, geometry: {layers: 32, queryHeads: 32, kvHeads: 8, headDim: 128}}\ngpu: {count: 100000}", "spec.gpu.count", "64"),
        ];
        for (yaml, field, bound) in cases {
            let d = check(&spec(yaml));
            assert_eq!(d.len(), 1, "{yaml}: {d:?}");
            assert_eq!(d[0].field, field);
            assert_eq!(d[0].reason, REASON);
            assert!(
                d[0].message.contains(field) && d[0].message.contains(bound),
                "{}",
                d[0].message
            );
        }
    }

    #[test]
    fn long_lists_and_strings_are_denied() {
        let mut s = spec("model: {name: m, geometry: {layers: 2, queryHeads: 2, kvHeads: 2, headDim: 64}}");
        s.engine.extra_args = vec!["--x".into(); EXTRA_ARGS_MAX + 1];
        s.engine.image = Some("i".repeat(IMAGE_LEN_MAX + 1));
        s.model.name = "n".repeat(254);
        let fields: Vec<String> = check(&s).into_iter().map(|d| d.field).collect();
        assert_eq!(
            fields,
            ["spec.model.name", "spec.engine.image", "spec.engine.extraArgs"]
        );
    }
}
