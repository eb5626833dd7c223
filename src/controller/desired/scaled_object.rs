//! `spec.autoscaling.engine: keda`: a KEDA ScaledObject (keda.sh/v1alpha1; the schema is
//! vendored under crds/vendor/keda) that scales the workers' Deployment on the same signal as
//! the kvfleet engine, read through Prometheus (docs/autoscaling-engines.md).
//!
//! The trigger's query is the replica count the demand asks for, fractional:
//! `sum(demand) / (targetDemandRatio x avg(capacity per replica))`, with metricType
//! `AverageValue` and threshold 1. The HPA KEDA creates computes
//! `ceil(value / threshold)` replicas for an AverageValue external metric, which is the
//! kvfleet engine's `ceil(demand / (targetDemandRatio x capacity per replica))`; the capacity
//! stays measured (window-aware, per GPU) instead of a threshold frozen into the object.

use kube::api::{ApiResource, DynamicObject};
use serde_json::{json, Map, Value};

use super::{Owner, MONITOR_TARGET_LABEL};
use crate::api::{scaled_object, AutoscalingSpec};

/// Name of the Prometheus trigger (KEDA's metric name is derived from it).
pub const TRIGGER_NAME: &str = "kv-demand";

/// The ScaledObject API.
pub fn scaled_object_resource() -> ApiResource {
    ApiResource {
        group: scaled_object::GROUP.into(),
        version: scaled_object::VERSION.into(),
        api_version: format!("{}/{}", scaled_object::GROUP, scaled_object::VERSION),
        kind: scaled_object::KIND.into(),
        plural: scaled_object::PLURAL.into(),
    }
}

/// The PromQL query of the trigger for the InferenceDeployment `name` in `namespace`: the
/// replicas its KV demand asks for. Series are the workers' gauges as the controller's
/// ServiceMonitor/PodMonitor labels them (`namespace`, `inferencedeployment`). A worker that
/// has not sized its KV pool yet (capacity 0) is left out of the average, as the kvfleet
/// engine leaves it out of its reading.
pub fn demand_query(namespace: &str, name: &str, target_demand_ratio: f64) -> String {
    let sel = format!(r#"{{namespace="{namespace}",{MONITOR_TARGET_LABEL}="{name}"}}"#);
    format!(
        "sum(kvfleet_kv_demand_tokens{sel}) / ({target_demand_ratio} * avg(kvfleet_kv_capacity_tokens{sel} > 0))"
    )
}

/// The ScaledObject `<name>` targeting the workers' Deployment `<name>`.
pub(super) fn scaled_object(owner: &Owner, a: &AutoscalingSpec, prometheus: &str) -> DynamicObject {
    let mut o = DynamicObject::new(&owner.name, &scaled_object_resource()).within(&owner.namespace);
    o.metadata = owner.meta(owner.name.clone());
    let mut spec = Map::new();
    spec.insert(
        "scaleTargetRef".into(),
        json!({"apiVersion": "apps/v1", "kind": "Deployment", "name": owner.name}),
    );
    spec.insert("minReplicaCount".into(), json!(a.min_replicas));
    spec.insert("maxReplicaCount".into(), json!(a.max_replicas));
    // KEDA takes the last replica away (minReplicaCount 0) after cooldownPeriod, not through
    // the HPA's behaviour: the same scale-down window.
    let window = a
        .scale_down
        .as_ref()
        .and_then(|r| r.stabilization_window_seconds)
        .unwrap_or(300);
    spec.insert("cooldownPeriod".into(), json!(window));
    let mut behavior = Map::new();
    for (key, rules) in [("scaleUp", &a.scale_up), ("scaleDown", &a.scale_down)] {
        if let Some(r) = rules {
            // Same field names as autoscaling/v2 HPAScalingRules.
            behavior.insert(key.into(), serde_json::to_value(r).unwrap_or(Value::Null));
        }
    }
    if !behavior.is_empty() {
        spec.insert(
            "advanced".into(),
            json!({"horizontalPodAutoscalerConfig": {"behavior": behavior}}),
        );
    }
    spec.insert(
        "triggers".into(),
        json!([{
            "type": "prometheus",
            "name": TRIGGER_NAME,
            "metricType": "AverageValue",
            "metadata": {
                "serverAddress": prometheus,
                "query": demand_query(&owner.namespace, &owner.name, a.target_demand_ratio),
                "threshold": "1",
                // Any demand wakes a deployment scaled to zero.
                "activationThreshold": "0",
            },
        }]),
    );
    o.data = json!({ "spec": spec });
    o
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::*;
    use super::super::{desired, Settings};
    use super::*;

    const KEDA: &str = llama_8b!(
        r#"
    weightBytes: 16Gi
  replicas: 2
  engine: {runtime: kvfleet}
  gpu: {selector: {products: [NVIDIA-GeForce-RTX-3090]}}
  autoscaling:
    engine: keda
    minReplicas: 0
    maxReplicas: 6
    targetDemandRatio: 0.7
    scaleUp:
      policies: [{type: Pods, value: 2, periodSeconds: 30}]
    scaleDown:
      stabilizationWindowSeconds: 120
      selectPolicy: Min
      policies: [{type: Percent, value: 50, periodSeconds: 60}]
"#
    );

    const PROMETHEUS: &str = "http://prometheus-operated.monitoring.svc:9090";

    fn settings() -> Settings {
        Settings {
            keda_prometheus_address: Some(PROMETHEUS.into()),
            ..Settings::default()
        }
    }

    fn v() -> crate::validate::Verdict {
        verdict("bfloat16", "KVFLEET_CUDA", "8.6", "NVIDIA-GeForce-RTX-3090")
    }

    #[test]
    fn engine_keda_renders_a_scaled_object_on_the_workers_deployment_with_the_spec_bounds_and_behaviour() {
        let obj = fixture(KEDA);
        let d = desired(&obj, &v(), &settings(), None).unwrap();
        let so = serde_json::to_value(d.scaled_object.as_ref().expect("a ScaledObject")).unwrap();
        assert_eq!(so["apiVersion"], "keda.sh/v1alpha1");
        assert_eq!(so["kind"], "ScaledObject");
        assert_eq!(so["metadata"]["name"], "llama");
        assert_eq!(so["metadata"]["namespace"], "ml");
        assert_eq!(
            so["metadata"]["ownerReferences"][0]["kind"],
            "InferenceDeployment"
        );
        let spec = &so["spec"];
        assert_eq!(
            spec["scaleTargetRef"],
            json!({"apiVersion": "apps/v1", "kind": "Deployment", "name": "llama"})
        );
        assert_eq!(
            d.deployment.as_ref().unwrap().metadata.name.as_deref(),
            Some("llama"),
            "the target is the workers' Deployment"
        );
        assert_eq!(
            (spec["minReplicaCount"].clone(), spec["maxReplicaCount"].clone()),
            (json!(0), json!(6))
        );
        assert_eq!(spec["cooldownPeriod"], 120);
        assert_eq!(
            spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"],
            json!({
                "scaleUp": {"policies": [{"type": "Pods", "value": 2, "periodSeconds": 30}]},
                "scaleDown": {"stabilizationWindowSeconds": 120, "selectPolicy": "Min",
                              "policies": [{"type": "Percent", "value": 50, "periodSeconds": 60}]}
            })
        );
        let trigger = &spec["triggers"][0];
        assert_eq!(spec["triggers"].as_array().unwrap().len(), 1);
        assert_eq!(trigger["type"], "prometheus");
        assert_eq!(trigger["metricType"], "AverageValue");
        assert_eq!(trigger["metadata"]["serverAddress"], PROMETHEUS);
        assert_eq!(trigger["metadata"]["threshold"], "1");
        assert_eq!(
            trigger["metadata"]["query"],
            r#"sum(kvfleet_kv_demand_tokens{namespace="ml",inferencedeployment="llama"}) / (0.7 * avg(kvfleet_kv_capacity_tokens{namespace="ml",inferencedeployment="llama"} > 0))"#
        );
        // KEDA's HPA owns the count: the reconciler leaves the Deployment's replicas out.
        assert_eq!(d.deployment.unwrap().spec.unwrap().replicas, None);
    }

    #[test]
    fn without_behaviour_the_hpa_defaults_stay_and_the_cooldown_is_the_default_scale_down_window() {
        let yaml = KEDA.replace(
            "    scaleUp:\n      policies: [{type: Pods, value: 2, periodSeconds: 30}]\n    scaleDown:\n      stabilizationWindowSeconds: 120\n      selectPolicy: Min\n      policies: [{type: Percent, value: 50, periodSeconds: 60}]\n",
            "",
        );
        let d = desired(&fixture(&yaml), &v(), &settings(), None).unwrap();
        let so = serde_json::to_value(d.scaled_object.unwrap()).unwrap();
        assert!(so["spec"].get("advanced").is_none(), "{so:#}");
        assert_eq!(so["spec"]["cooldownPeriod"], 300);
    }

    #[test]
    fn no_scaled_object_for_the_kvfleet_engine_without_autoscaling_or_without_a_prometheus_address() {
        let kvfleet = KEDA.replace("engine: keda", "engine: kvfleet");
        let d = desired(&fixture(&kvfleet), &v(), &settings(), None).unwrap();
        assert!(d.scaled_object.is_none());
        let d = desired(&fixture(KVFLEET_RTX3090_TP2), &v(), &settings(), None).unwrap();
        assert!(d.scaled_object.is_none());
        // The reconciler denies engine keda without an address before rendering.
        let d = desired(&fixture(KEDA), &v(), &Settings::default(), None).unwrap();
        assert!(d.scaled_object.is_none());
    }

    /// What KEDA's HPA computes from the query (`ceil(value / threshold)` for an AverageValue
    /// external metric) is what the kvfleet engine recommends on the same readings.
    #[test]
    fn the_query_asks_for_the_replicas_the_kvfleet_engine_recommends() {
        use kvfleet_core::autoscale::{Autoscaler, Observation, Sample};
        let q = demand_query("ns", "d", 0.7);
        assert!(q.starts_with("sum(kvfleet_kv_demand_tokens{"), "{q}");
        assert!(q.contains(") / (0.7 * avg(kvfleet_kv_capacity_tokens{"), "{q}");
        let a: AutoscalingSpec =
            serde_json::from_value(json!({"maxReplicas": 12, "targetDemandRatio": 0.7})).unwrap();
        let policy = crate::controller::autoscale::policy_of(&a);
        for (demands, capacities) in [
            ([9_000_u64, 11_000, 10_000], [8_000_u64, 10_000, 12_000]),
            ([1_000, 0, 500], [10_000, 10_000, 10_000]),
            ([40_000, 35_000, 20_000], [16_000, 16_000, 20_000]),
        ] {
            let sum: u64 = demands.iter().sum();
            let avg = capacities.iter().sum::<u64>() as f64 / capacities.len() as f64;
            let value = sum as f64 / (0.7 * avg);
            let hpa = (value / 1.0).ceil() as u32;
            let obs = Observation {
                now_seconds: 0.0,
                current_replicas: 3,
                ready: demands
                    .iter()
                    .zip(capacities)
                    .map(|(d, c)| Sample {
                        demand_tokens: *d,
                        capacity_tokens: c,
                    })
                    .collect(),
                pending_demand_tokens: 0,
                capacity_hint_tokens: None,
            };
            let decision = Autoscaler::default().decide(&policy, &obs);
            assert_eq!(
                decision.recommendation,
                hpa.clamp(1, 12),
                "{demands:?} / {capacities:?}"
            );
        }
    }
}
