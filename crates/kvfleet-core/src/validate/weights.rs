//! Where the weights come from: a vLLM pod without weights would serve random ones without
//! a word, so runtime vllm needs a source, or `format: dummy` said out loud.

use super::{denial, Denial};
use crate::api::{InferenceDeploymentSpec, Runtime, WeightsFormat};

/// model.weights names a source the runtime reads, in a format that matches it.
pub(super) fn weights_checks(spec: &InferenceDeploymentSpec, denials: &mut Vec<Denial>) {
    let w = spec.model.weights.as_ref();
    let name = &spec.model.name;
    match (spec.engine.runtime, w) {
        (Runtime::Vllm, None) => denials.push(denial(
            "spec.model.weights",
            "WeightsMissing",
            format!("runtime vllm needs weights, or it would serve random ones: set model.weights.huggingFace (vLLM downloads {name}; tokenSecretRef for gated repositories, cachePvcName to keep the download across restarts), or pvcName, hostPath or image with the checkpoint's path, or model.weights.format: dummy for random weights (capacity and throughput runs only)"),
        )),
        (Runtime::Vllm, Some(w)) => {
            if w.format == WeightsFormat::Dummy && w.has_source() {
                denials.push(denial(
                    "spec.model.weights.format",
                    "DummyWeightsWithSource",
                    "model.weights names a source but its format is dummy (the default), which loads random weights; set model.weights.format: safetensors (or gguf)".to_string(),
                ));
            }
            if w.format != WeightsFormat::Dummy && !w.has_source() {
                denials.push(denial(
                    "spec.model.weights",
                    "WeightsMissing",
                    format!("model.weights.format is {} but names no source; set huggingFace, pvcName, hostPath or image", match w.format { WeightsFormat::Gguf => "gguf", _ => "safetensors" }),
                ));
            }
        }
        (Runtime::Kvfleet, Some(w)) if w.image.is_some() || w.hugging_face.is_some() => denials.push(denial(
            "spec.model.weights",
            "WeightsSourceNeedsVllm",
            "model.weights.image and model.weights.huggingFace are read by runtime vllm only; the kvfleet worker loads weights from pvcName or hostPath (with path)".to_string(),
        )),
        _ => {}
    }
}
