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
