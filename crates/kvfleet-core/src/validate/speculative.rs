//! `engine.speculative` on its own: the schema's CEL rules again (for what did not pass the
//! API server: `kvfleet check`, a namespace the webhook skips), what vLLM ignores, and the
//! drafter's Hub token. Which vLLM release runs which method is a compat rule
//! (`vllm.speculative-method-needs-release`); the kvfleet runtime runs every method on both
//! engines.

use super::{denial, Denial};
use crate::api::{InferenceDeploymentSpec, Runtime, SpeculativeMethod, SpeculativeSpec};

const FIELD: &str = "spec.engine.speculative";
const REASON: &str = "InvalidSpeculativeConfig";

/// The checks of `engine.speculative`, when it is set.
pub(super) fn speculative_checks(
    spec: &InferenceDeploymentSpec,
    denials: &mut Vec<Denial>,
    warnings: &mut Vec<String>,
) {
    let Some(s) = &spec.engine.speculative else {
        return;
    };
    shape_checks(s, denials);
    length_check(spec, s, denials);
    draft_token_check(spec, s, denials);
    draft_geometry_checks(spec, s, denials, warnings);
    if spec.engine.runtime == Runtime::Vllm && s.disable_by_batch_size.is_some() {
        warnings.push(format!(
            "{FIELD}.disableByBatchSize is not honoured by vLLM's V1 engine (never read since vLLM 0.10, removed by vllm#35060) and is not rendered; vLLM speculates at every batch size. Remove it, or use runtime kvfleet"
        ));
    }
}

/// What the CRD's CEL rules of SpeculativeSpec and DraftModel say.
fn shape_checks(s: &SpeculativeSpec, denials: &mut Vec<Denial>) {
    let m = s.method;
    match (m.needs_draft_model(), &s.draft_model) {
        (true, None) => denials.push(denial(
            &format!("{FIELD}.draftModel"),
            REASON,
            format!("method {m} proposes with a drafter checkpoint, and draftModel is not set; set draftModel (pvcName, hostPath or image with path, or huggingFace.repo), or use method ngram"),
        )),
        (false, Some(_)) => denials.push(denial(
            &format!("{FIELD}.draftModel"),
            REASON,
            "method ngram proposes from the sequence itself and reads no drafter; remove draftModel, or use method eagle3 or dflash with it".to_string(),
        )),
        (true, Some(d)) => {
            let sources = [d.pvc_name.is_some(), d.host_path.is_some(), d.image.is_some(), d.hugging_face.is_some()];
            let hub_repo = d.hugging_face.as_ref().map(|h| h.repo.is_some() && h.cache_pvc_name.is_none());
            if sources.iter().filter(|x| **x).count() != 1 {
                denials.push(denial(
                    &format!("{FIELD}.draftModel"),
                    REASON,
                    "draftModel must name exactly one source; set one of pvcName, hostPath, image (each with path) and huggingFace".to_string(),
                ));
            } else if hub_repo == Some(false) {
                denials.push(denial(
                    &format!("{FIELD}.draftModel.huggingFace"),
                    REASON,
                    "draftModel.huggingFace needs repo (the drafter's repository) and takes no cachePvcName (the download cache is the model's, model.weights.huggingFace.cachePvcName); set repo and remove cachePvcName".to_string(),
                ));
            }
        }
        (false, None) => {}
    }
    if m.needs_draft_model() && (s.prompt_lookup_max.is_some() || s.prompt_lookup_min.is_some()) {
        denials.push(denial(
            &format!("{FIELD}.method"),
            REASON,
            format!("promptLookupMax and promptLookupMin configure the n-gram proposer, and method is {m}; remove them, or use method ngram"),
        ));
    }
    let (min, max) = (s.prompt_lookup_min(), s.prompt_lookup_max());
    if s.prompt_lookup_min.is_some() && min > max {
        denials.push(denial(
            &format!("{FIELD}.promptLookupMin"),
            REASON,
            format!("promptLookupMin {min} exceeds promptLookupMax {max}: no n-gram length is left to match; lower promptLookupMin or raise promptLookupMax"),
        ));
    }
}

/// A step verifies numSpeculativeTokens + 1 positions: they must fit in the context.
fn length_check(spec: &InferenceDeploymentSpec, s: &SpeculativeSpec, denials: &mut Vec<Denial>) {
    let n = i64::from(s.num_speculative_tokens);
    let len = spec.engine.max_model_len;
    if n >= len {
        denials.push(denial(
            &format!("{FIELD}.numSpeculativeTokens"),
            REASON,
            format!("numSpeculativeTokens {n} must be below maxModelLen {len} (a step verifies the drafts plus one token within the context); lower numSpeculativeTokens"),
        ));
    }
}

/// One `HF_TOKEN` per pod: a drafter downloaded with another token than the model's cannot.
fn draft_token_check(spec: &InferenceDeploymentSpec, s: &SpeculativeSpec, denials: &mut Vec<Denial>) {
    let draft = s
        .draft_model
        .as_ref()
        .and_then(|d| d.hugging_face.as_ref())
        .and_then(|h| h.token_secret_ref.as_ref());
    let model = spec
        .model
        .weights
        .as_ref()
        .and_then(|w| w.hugging_face.as_ref())
        .and_then(|h| h.token_secret_ref.as_ref());
    if let (Some(d), Some(m)) = (draft, model) {
        if d != m {
            denials.push(denial(
                &format!("{FIELD}.draftModel.huggingFace.tokenSecretRef"),
                REASON,
                format!("vLLM downloads the model and the drafter with one Hub token (HF_TOKEN), and draftModel.huggingFace.tokenSecretRef ({}/{}) differs from model.weights.huggingFace.tokenSecretRef ({}/{}); remove the drafter's (the model's token is used) or use one token that reads both repositories", d.name, d.key, m.name, m.key),
            ));
        }
    }
}

/// `draftModel.geometry`: what the kvfleet runtime's memory plan needs of a drafter, and a
/// warning where the plan cannot count it.
fn draft_geometry_checks(
    spec: &InferenceDeploymentSpec,
    s: &SpeculativeSpec,
    denials: &mut Vec<Denial>,
    warnings: &mut Vec<String>,
) {
    let Some(d) = &s.draft_model else {
        return;
    };
    let kvfleet = spec.engine.runtime == Runtime::Kvfleet;
    let field = format!("{FIELD}.draftModel.geometry");
    match &d.geometry {
        Some(g) => {
            if s.method == SpeculativeMethod::Dflash && g.feature_layers.is_none() {
                denials.push(denial(
                    &format!("{field}.featureLayers"),
                    REASON,
                    "a DFlash drafter reads as many target layers as its dflash_config.target_layer_ids lists, and featureLayers is not set; set featureLayers to that list's length".to_string(),
                ));
            }
            if kvfleet && s.method == SpeculativeMethod::Eagle3 && g.layers != 1 {
                denials.push(denial(
                    &format!("{field}.layers"),
                    REASON,
                    format!("runtime kvfleet runs EAGLE-3 drafters of one decoder layer, and layers is {}; use a one-layer EAGLE-3 drafter (num_hidden_layers 1), or runtime vllm", g.layers),
                ));
            }
        }
        None if kvfleet && spec.model.geometry.is_some() => warnings.push(format!(
            "{field} is not set: the KV capacity predicted here does not count the {} drafter's weights, buffers and K/V, which the worker reserves first (its measured capacity in status is lower, by a few percent for an 8B model); write draftModel.geometry from the drafter's config.json",
            s.method
        )),
        None => {}
    }
}
