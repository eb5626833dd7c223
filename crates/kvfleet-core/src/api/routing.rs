//! `spec.routing` (docs/routing.md): how requests reach the replicas, the kvfleet router's
//! Deployment, and the Gateway API Inference Extension's InferencePool it can render.

use k8s_openapi::api::core::v1::ResourceRequirements;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::bound_resources;
use super::limits::*;

/// How requests reach the replicas (docs/routing.md).
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "self.mode != 'inferencePool' || has(self.endpointPicker)",
        "message": "routing.endpointPicker is required when routing.mode is inferencePool: name the Service of the endpoint picker (e.g. llm-d's) that the InferencePool points the gateway at",
        "fieldPath": ".endpointPicker"
    }
]))]
pub struct RoutingSpec {
    /// `service` (default): the Service `<name>` selects the worker pods. `kvfleet`: the
    /// Service `<name>` selects the pods of a kvfleet router (Deployment `<name>-router`),
    /// which sends each request to the worker holding most of its prefix in KV cache (runtime
    /// kvfleet only). `inferencePool`: an InferencePool `<name>` (Gateway API Inference
    /// Extension, inference.networking.k8s.io/v1) selects the worker pods for a gateway and
    /// its endpoint picker; the Service `<name>` stays as in `service`. Both `kvfleet` and
    /// `inferencePool` turn the workers' KV events on (port `kv-events`, 5557 unless
    /// `engine.kvEvents.port` says otherwise).
    #[serde(default)]
    pub mode: RoutingMode,
    /// The kvfleet router (mode `kvfleet`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router: Option<RouterSpec>,
    /// The endpoint picker the InferencePool names (mode `inferencePool`, required there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint_picker: Option<EndpointPickerRef>,
}

/// Which way requests reach the replicas.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum RoutingMode {
    /// The Service `<name>` in front of the worker pods.
    #[default]
    Service,
    /// kvfleet's router in front of the worker pods.
    Kvfleet,
    /// An InferencePool for a Gateway API Inference Extension gateway and endpoint picker.
    InferencePool,
}

impl RoutingMode {
    pub fn as_str(self) -> &'static str {
        match self {
            RoutingMode::Service => "service",
            RoutingMode::Kvfleet => "kvfleet",
            RoutingMode::InferencePool => "inferencePool",
        }
    }
}

/// The kvfleet router's pods (`kvfleet router`, the operator's image, no GPU).
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RouterSpec {
    /// Router pods (a PodDisruptionBudget keeps all but one through a drain).
    #[serde(default = "default_router_replicas")]
    #[schemars(range(min = 1, max = ROUTER_REPLICAS_MAX))]
    pub replicas: i32,
    /// Resources of the router container; absent: requests of 100m CPU and 256Mi memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = bound_resources)]
    pub resources: Option<ResourceRequirements>,
    /// How the router weighs a replica's cached prefix against its load (docs/routing.md,
    /// "Which replica"); absent: the defaults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub score: Option<RouterScore>,
}

impl Default for RouterSpec {
    fn default() -> Self {
        RouterSpec {
            replicas: default_router_replicas(),
            resources: None,
            score: None,
        }
    }
}

/// The router's score: `prefixWeight x cached/prompt - loadWeight x relative load`, and a
/// guard that sends a request to the least busy replica when the best-scored one has at least
/// `imbalanceRequests` more requests in flight and more than `imbalanceRatio` times as many.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RouterScore {
    /// Weight of the fraction of the prompt a replica's prefix cache serves (default 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1000.0))]
    pub prefix_weight: Option<f64>,
    /// Weight of a replica's load relative to the other replicas': 0 for the least busy, all
    /// of it for the busiest (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1000.0))]
    pub load_weight: Option<f64>,
    /// The imbalance guard's absolute threshold in requests in flight (default 32).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65536))]
    pub imbalance_requests: Option<i32>,
    /// The imbalance guard's relative threshold (default 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1.0, max = 1000.0))]
    pub imbalance_ratio: Option<f64>,
}

fn default_router_replicas() -> i32 {
    2
}

/// The endpoint picker an InferencePool names (its `spec.endpointPickerRef`): the extension
/// the gateway asks which worker pod serves each request.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "(has(self.kind) && self.kind != 'Service') || has(self.port)",
        "message": "endpointPicker.port is required when its kind is Service (the default): the Service port of the endpoint picker, e.g. 9002",
        "fieldPath": ".port"
    }
]))]
pub struct EndpointPickerRef {
    /// Name of the endpoint picker's object (a Service by default) in this namespace.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// Port of the endpoint picker (the Service port, not the target port); required when
    /// the kind is Service.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: Option<i32>,
    /// Kind of the referent; the InferencePool's default is `Service`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$")
    )]
    pub kind: Option<String>,
    /// API group of the referent; the InferencePool's default is the core group (`""`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub group: Option<String>,
    /// What the gateway does when the endpoint picker does not answer: `FailClose` (the
    /// InferencePool's default: the request fails) or `FailOpen` (any ready worker serves it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_mode: Option<FailureMode>,
}

/// The InferencePool's `endpointPickerRef.failureMode`.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum FailureMode {
    FailOpen,
    FailClose,
}

/// The Gateway API Inference Extension's InferencePool (crds/vendor/gateway-api-inference-extension).
pub mod inference_pool {
    pub const GROUP: &str = "inference.networking.k8s.io";
    pub const VERSION: &str = "v1";
    pub const KIND: &str = "InferencePool";
    pub const PLURAL: &str = "inferencepools";
    /// Name of its CustomResourceDefinition.
    pub const CRD: &str = "inferencepools.inference.networking.k8s.io";
    /// The release whose CRD is vendored (crds/vendor/gateway-api-inference-extension).
    pub const RELEASE: &str = "v1.6.0";
}
