//! Routing mode `inferencePool`: an InferencePool (Gateway API Inference Extension,
//! inference.networking.k8s.io/v1; the schema is vendored under
//! crds/vendor/gateway-api-inference-extension) selecting the worker pods, for a gateway
//! that asks the endpoint picker it names which pod serves each request.

use kube::api::{ApiResource, DynamicObject};
use serde_json::{json, Map, Value};

use super::{selector_labels, Owner, HTTP_PORT, LWS_WORKER_INDEX_LABEL};
use crate::api::{inference_pool, EndpointPickerRef};

/// The InferencePool API.
pub fn inference_pool_resource() -> ApiResource {
    ApiResource {
        group: inference_pool::GROUP.into(),
        version: inference_pool::VERSION.into(),
        api_version: format!("{}/{}", inference_pool::GROUP, inference_pool::VERSION),
        kind: inference_pool::KIND.into(),
        plural: inference_pool::PLURAL.into(),
    }
}

/// The InferencePool `<name>`: the worker pods on the serving port. `multi_node`: only the
/// leader of each LeaderWorkerSet group serves the API, as for the Service.
pub(super) fn inference_pool(owner: &Owner, picker: &EndpointPickerRef, multi_node: bool) -> DynamicObject {
    let mut o = DynamicObject::new(&owner.name, &inference_pool_resource()).within(&owner.namespace);
    o.metadata = owner.meta(owner.name.clone());
    let mut selector = selector_labels(&owner.name);
    if multi_node {
        selector.insert(LWS_WORKER_INDEX_LABEL.into(), "0".into());
    }
    o.data = json!({"spec": {
        "selector": {"matchLabels": selector},
        "targetPorts": [{"number": HTTP_PORT}],
        "endpointPickerRef": endpoint_picker_ref(picker),
    }});
    o
}

/// `spec.endpointPickerRef`: what the spec sets; the rest is the InferencePool's defaults.
fn endpoint_picker_ref(p: &EndpointPickerRef) -> Value {
    let mut r = Map::new();
    r.insert("name".into(), json!(p.name));
    if let Some(port) = p.port {
        r.insert("port".into(), json!({"number": port}));
    }
    if let Some(kind) = &p.kind {
        r.insert("kind".into(), json!(kind));
    }
    if let Some(group) = &p.group {
        r.insert("group".into(), json!(group));
    }
    if let Some(mode) = p.failure_mode {
        r.insert(
            "failureMode".into(),
            serde_json::to_value(mode).unwrap_or(Value::Null),
        );
    }
    Value::Object(r)
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::*;
    use super::super::{desired, Settings, INSTANCE_LABEL};
    use super::*;
    use crate::validate::MultiNode;

    const POOLED: &str = gemma_12b!(
        r#"
  replicas: 3
  engine: {runtime: vllm}
  routing:
    mode: inferencePool
    endpointPicker: {name: gemma-epp, port: 9002}
"#
    );

    fn v() -> crate::validate::Verdict {
        verdict("fp8", "FLASH_ATTN", "9.0", "NVIDIA-H100-80GB-HBM3")
    }

    #[test]
    fn mode_inference_pool_renders_a_pool_of_the_worker_pods_on_the_serving_port_and_no_router() {
        let d = desired(&fixture(POOLED), &v(), &Settings::default(), None).unwrap();
        assert!(d.router.is_none());
        let pool = d.inference_pool.as_ref().expect("an InferencePool");
        let body = serde_json::to_value(pool).unwrap();
        assert_eq!(body["apiVersion"], "inference.networking.k8s.io/v1");
        assert_eq!(body["kind"], "InferencePool");
        assert_eq!(body["metadata"]["name"], "gemma");
        assert_eq!(
            body["metadata"]["ownerReferences"][0]["kind"],
            "InferenceDeployment"
        );
        assert_eq!(
            body["spec"],
            json!({"selector": {"matchLabels": {INSTANCE_LABEL: "gemma"}},
                   "targetPorts": [{"number": 8000}],
                   "endpointPickerRef": {"name": "gemma-epp", "port": {"number": 9002}}})
        );
        // The pool selects exactly what the workers' Deployment selects.
        let selector = d
            .deployment
            .as_ref()
            .unwrap()
            .spec
            .as_ref()
            .unwrap()
            .selector
            .clone();
        assert_eq!(
            serde_json::to_value(selector.match_labels).unwrap(),
            body["spec"]["selector"]["matchLabels"]
        );
        // The Service stays the workers'; they publish KV events for the picker (vLLM's flag).
        assert_eq!(
            d.service.spec.as_ref().unwrap().selector.as_ref().unwrap()[INSTANCE_LABEL],
            "gemma"
        );
        let args = container(&d).args.unwrap();
        assert!(args.iter().any(|a| a == "--kv-events-config"), "{args:?}");
        assert!(container(&d)
            .ports
            .unwrap()
            .iter()
            .any(|p| p.name.as_deref() == Some("kv-events") && p.container_port == 5557));
    }

    #[test]
    fn the_endpoint_picker_reference_carries_what_the_spec_sets() {
        let yaml = POOLED.replace(
            "endpointPicker: {name: gemma-epp, port: 9002}",
            "endpointPicker: {name: epp, kind: Gateway, group: example.com, failureMode: FailOpen}",
        );
        let d = desired(&fixture(&yaml), &v(), &Settings::default(), None).unwrap();
        let body = serde_json::to_value(d.inference_pool.unwrap()).unwrap();
        assert_eq!(
            body["spec"]["endpointPickerRef"],
            json!({"name": "epp", "kind": "Gateway", "group": "example.com", "failureMode": "FailOpen"})
        );
    }

    #[test]
    fn a_pool_of_replicas_that_span_nodes_selects_only_their_leaders() {
        let mut obj = fixture(POOLED);
        obj.spec.engine.tensor_parallel_size = 16;
        let mut verdict = v();
        verdict.multi_node = Some(MultiNode {
            nodes_per_replica: 2,
            gpus_per_node: 8,
            most_gpus_on_a_node: 8,
        });
        let d = desired(&obj, &verdict, &Settings::default(), None).unwrap();
        let body = serde_json::to_value(d.inference_pool.unwrap()).unwrap();
        assert_eq!(
            body["spec"]["selector"]["matchLabels"][super::super::LWS_WORKER_INDEX_LABEL],
            "0"
        );
    }
}
