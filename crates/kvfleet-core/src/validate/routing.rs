//! `spec.routing`: what each mode needs of the runtime and of the cluster.

use super::{denial, ClusterFacts, Denial};
use crate::api::{inference_pool, InferenceDeploymentSpec, RoutingMode, Runtime};

/// Reason of a kvfleet router in front of vLLM workers.
pub const ROUTER_NEEDS_KVFLEET_RUNTIME: &str = "RouterNeedsKvfleetRuntime";
/// Reason of `mode: inferencePool` where the API server serves no InferencePool.
pub const INFERENCE_POOL_MISSING: &str = "InferencePoolCrdMissing";

/// The routing denials: what the routing mode needs of the runtime and of the API server.
pub(super) fn denials(spec: &InferenceDeploymentSpec, facts: &ClusterFacts) -> Vec<Denial> {
    [router_runtime(spec), inference_pool_served(spec, facts)]
        .into_iter()
        .flatten()
        .collect()
}

/// The router loads the model's tokenizer from the kvfleet worker's config, which vLLM
/// workers do not have.
fn router_runtime(spec: &InferenceDeploymentSpec) -> Option<Denial> {
    (spec.routing_mode() == RoutingMode::Kvfleet && spec.engine.runtime == Runtime::Vllm).then(|| {
        denial(
            "spec.routing.mode",
            ROUTER_NEEDS_KVFLEET_RUNTIME,
            "routing mode kvfleet runs kvfleet's router, which tokenizes each prompt with the model's tokenizer read from the kvfleet worker's configuration, and runtime vllm has none; for vLLM workers use routing mode inferencePool with llm-d's endpoint picker (routing.endpointPicker), or set engine.runtime to kvfleet".to_string(),
        )
    })
}

/// `mode: inferencePool` needs the Gateway API Inference Extension CRD.
fn inference_pool_served(spec: &InferenceDeploymentSpec, facts: &ClusterFacts) -> Option<Denial> {
    (spec.routing_mode() == RoutingMode::InferencePool && facts.inference_pool_served == Some(false))
        .then(inference_pool_missing)
}

/// The denial of `mode: inferencePool` on an API server that serves no InferencePool.
pub fn inference_pool_missing() -> Denial {
    use inference_pool::{CRD, GROUP, KIND, RELEASE, VERSION};
    denial(
        "spec.routing.mode",
        INFERENCE_POOL_MISSING,
        format!("routing mode inferencePool renders an {KIND} ({GROUP}/{VERSION}), but the API server does not serve {GROUP}/{VERSION}: the Gateway API Inference Extension CRD {CRD} is not installed; install it (kubectl apply --server-side -f https://github.com/kubernetes-sigs/gateway-api-inference-extension/releases/download/{RELEASE}/manifests.yaml) with a gateway that implements it, or use routing mode service or kvfleet"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::tests::{denial_of, KVFLEET_H100};
    use crate::validate::{synthetic_cluster, validate};

    fn spec(yaml: &str) -> InferenceDeploymentSpec {
        serde_yaml::from_str(yaml).unwrap()
    }

    fn h100() -> ClusterFacts {
        synthetic_cluster(&["NVIDIA-H100-80GB-HBM3"]).unwrap()
    }

    #[test]
    fn a_kvfleet_router_in_front_of_vllm_is_denied_with_both_fixes() {
        let s = spec(&format!(
            "{}routing: {{mode: kvfleet}}\n",
            KVFLEET_H100.replace("runtime: kvfleet", "runtime: vllm")
        ));
        let v = validate(&s, &h100());
        let d = denial_of(&v, ROUTER_NEEDS_KVFLEET_RUNTIME);
        assert_eq!(d.field, "spec.routing.mode");
        assert!(
            d.message.contains("inferencePool") && d.message.contains("runtime to kvfleet"),
            "{}",
            d.message
        );
        assert!(v.resolved.is_none() && v.node_affinity.is_none());
        let ok = spec(&format!("{KVFLEET_H100}routing: {{mode: kvfleet}}\n"));
        assert!(validate(&ok, &h100()).allowed());
    }

    #[test]
    fn an_inference_pool_is_denied_only_where_the_api_server_is_known_not_to_serve_it() {
        let s = spec(&format!(
            "{KVFLEET_H100}routing: {{mode: inferencePool, endpointPicker: {{name: epp, port: 9002}}}}\n"
        ));
        let mut facts = h100();
        assert!(validate(&s, &facts).allowed(), "not known: not judged");
        facts.inference_pool_served = Some(true);
        assert!(validate(&s, &facts).allowed());
        facts.inference_pool_served = Some(false);
        let v = validate(&s, &facts);
        assert_eq!(v.denials.len(), 1, "{v:#?}");
        let d = denial_of(&v, INFERENCE_POOL_MISSING);
        assert!(
            d.message.contains("inferencepools.inference.networking.k8s.io"),
            "{}",
            d.message
        );
        // The service mode never asks for the CRD.
        let plain = spec(KVFLEET_H100);
        assert!(validate(&plain, &facts).allowed());
    }
}
