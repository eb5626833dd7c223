//! `spec.autoscaling` and `status.autoscaling` (docs/autoscaling.md): the replica count
//! follows the replicas' KV demand over their KV capacity, both window-aware, with the
//! HorizontalPodAutoscaler's behaviour fields (same names, same meaning).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::limits::{AUTOSCALING_POLICIES_MAX, REPLICAS_MAX, STABILIZATION_WINDOW_MAX};

/// Replicas follow KV demand (docs/autoscaling.md). Present: `spec.replicas` is only the
/// starting count; the controller (or KEDA, `engine: keda`) owns the Deployment's replicas
/// and overrides `kubectl scale`, as a HorizontalPodAutoscaler does.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "self.minReplicas <= self.maxReplicas",
        "message": "autoscaling.minReplicas must not exceed autoscaling.maxReplicas",
        "fieldPath": ".minReplicas"
    }
]))]
pub struct AutoscalingSpec {
    /// Who scales: `kvfleet` (default: the controller reads every worker's KV gauges itself,
    /// no Prometheus needed) or `keda` (the controller renders a KEDA ScaledObject with a
    /// Prometheus trigger on the same gauges; KEDA's CRDs must be served).
    #[serde(default)]
    pub engine: AutoscalingEngine,
    /// Fewest replicas. 0 lets an idle deployment scale to zero after its scale-down
    /// window; that needs `routing.mode: kvfleet`, whose router holds requests while no
    /// replica is ready and brings one back.
    #[serde(default = "default_min_replicas")]
    #[schemars(range(min = 0, max = REPLICAS_MAX))]
    pub min_replicas: i32,
    /// Most replicas.
    #[schemars(range(min = 1, max = REPLICAS_MAX))]
    pub max_replicas: i32,
    /// Fraction of the fleet's KV capacity the running and waiting requests should need:
    /// replicas = ceil(demand / (targetDemandRatio x capacity per replica)). Below 1 leaves
    /// room for bursts while a new replica starts.
    #[serde(default = "default_target_demand_ratio")]
    #[schemars(range(min = 0.05, max = 1.0))]
    pub target_demand_ratio: f64,
    /// Scaling up (the HPA's `behavior.scaleUp`); absent: the HPA's defaults (no
    /// stabilization; +100% or +4 pods per 15 s, whichever is more).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_up: Option<ScalingRules>,
    /// Scaling down (the HPA's `behavior.scaleDown`); absent: the HPA's defaults (a 300 s
    /// window; -100% per 15 s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_down: Option<ScalingRules>,
}

fn default_min_replicas() -> i32 {
    1
}

fn default_target_demand_ratio() -> f64 {
    0.8
}

/// Who acts on the demand signal.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum AutoscalingEngine {
    /// The kvfleet controller scales the workers' Deployment through its scale subresource.
    #[default]
    Kvfleet,
    /// A KEDA ScaledObject `<name>` scales it on the gauges, through Prometheus.
    Keda,
}

impl AutoscalingEngine {
    pub fn as_str(self) -> &'static str {
        match self {
            AutoscalingEngine::Kvfleet => "kvfleet",
            AutoscalingEngine::Keda => "keda",
        }
    }
}

/// One direction's behaviour (autoscaling/v2 `HPAScalingRules`).
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ScalingRules {
    /// Seconds of past recommendations considered: scaling down takes the highest of the
    /// window, scaling up the lowest, so a short dip or spike moves nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = STABILIZATION_WINDOW_MAX))]
    pub stabilization_window_seconds: Option<i32>,
    /// Which policy limits the change when several apply: `Max` (default), `Min`, or
    /// `Disabled` (no scaling in this direction).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub select_policy: Option<SelectPolicy>,
    /// Most change per period.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = AUTOSCALING_POLICIES_MAX))]
    pub policies: Vec<ScalingPolicy>,
}

/// The HPA's `selectPolicy`.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum SelectPolicy {
    Max,
    Min,
    Disabled,
}

/// The HPA's `HPAScalingPolicy`: at most `value` pods (or percent of the current count)
/// added or removed per `periodSeconds`.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ScalingPolicy {
    /// `Pods` (a number of pods) or `Percent` (a share of the current count).
    #[serde(rename = "type")]
    pub type_: ScalingPolicyType,
    /// Most pods, or percent of the current count, added or removed per period.
    #[schemars(range(min = 1, max = 100_000))]
    pub value: i32,
    /// Length of the period the change is counted over, in seconds (at most 1800, as the HPA).
    #[schemars(range(min = 1, max = 1800))]
    pub period_seconds: i32,
}

/// The HPA's policy types.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum ScalingPolicyType {
    Pods,
    Percent,
}

/// What the autoscaler saw and decided last.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AutoscalingStatus {
    /// Replicas the autoscaler set the workload to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub desired_replicas: Option<i32>,
    /// Replicas the policy recommends before stabilization and step limits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recommended_replicas: Option<i32>,
    /// Replicas whose gauges were read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_replicas: Option<i32>,
    /// KV the running, waiting and router-held requests need to finish, summed over the
    /// replicas (kvfleet_kv_demand_tokens).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub demand_tokens: Option<i64>,
    /// KV capacity of the replicas read (kvfleet_kv_capacity_tokens, summed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity_tokens: Option<i64>,
    /// Demand over capacity, as a decimal string (e.g. "0.42").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub demand_ratio: Option<String>,
    /// The last decision: ScaleUp, ScaleDown, Stable, ScaleFromZero, ScaleToZero,
    /// LimitedByStep, HeldByStabilization, AtMaxReplicas, AtMinReplicas or NoSignal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The last decision in words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// When the autoscaler last changed the replica count (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_scale_time: Option<String>,
}
