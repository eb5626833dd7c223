//! `spec.autoscaling`: what scaling on KV demand needs of the spec.

use super::{denial, ClusterFacts, Denial};
use crate::api::limits::{REPLICAS_MAX, STABILIZATION_WINDOW_MAX};
use crate::api::{
    scaled_object, AutoscalingEngine, InferenceDeploymentSpec, RoutingMode, Runtime, ScalingRules,
};

/// Reason of `minReplicas: 0` without a kvfleet router to hold requests.
pub const SCALE_TO_ZERO_NEEDS_ROUTER: &str = "ScaleToZeroNeedsRouter";
/// Reason of kvfleet-engine autoscaling over vLLM workers, which export no demand gauge.
pub const AUTOSCALING_NEEDS_KVFLEET_RUNTIME: &str = "AutoscalingNeedsKvfleetRuntime";
/// Reason of autoscaling bounds that cannot hold together.
pub const INVALID_AUTOSCALING: &str = "InvalidAutoscaling";
/// Reason of `engine: keda` where the API server serves no ScaledObject.
pub const SCALED_OBJECT_MISSING: &str = "KedaScaledObjectCrdMissing";

/// The autoscaling denials: bounds that cannot hold together, what scaling needs of the
/// runtime and routing, and KEDA's CRD where `engine: keda`.
pub(super) fn denials(spec: &InferenceDeploymentSpec, facts: &ClusterFacts) -> Vec<Denial> {
    let mut denials = spec_denials(spec);
    let keda = spec
        .autoscaling
        .as_ref()
        .is_some_and(|a| a.engine == AutoscalingEngine::Keda);
    if keda && facts.scaled_object_served == Some(false) {
        denials.push(scaled_object_missing());
    }
    denials
}

/// The denial of `engine: keda` on an API server that serves no ScaledObject.
pub fn scaled_object_missing() -> Denial {
    use scaled_object::{CRD, GROUP, KIND, RELEASE, VERSION};
    denial(
        "spec.autoscaling.engine",
        SCALED_OBJECT_MISSING,
        format!("autoscaling engine keda renders a KEDA {KIND} ({GROUP}/{VERSION}), but the API server does not serve {GROUP}/{VERSION}: the CRD {CRD} is not installed; install KEDA (helm install keda kedacore/keda --namespace keda --create-namespace, {RELEASE} or later), or set spec.autoscaling.engine to kvfleet (the controller scales on the same gauges itself, no KEDA or Prometheus needed)"),
    )
}

fn spec_denials(spec: &InferenceDeploymentSpec) -> Vec<Denial> {
    let Some(a) = &spec.autoscaling else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let bad = |field: &str, message: String| denial(field, INVALID_AUTOSCALING, message);
    if !(0..=REPLICAS_MAX).contains(&a.min_replicas) {
        out.push(bad(
            "spec.autoscaling.minReplicas",
            format!("minReplicas {} is outside 0..={REPLICAS_MAX}", a.min_replicas),
        ));
    }
    if !(1..=REPLICAS_MAX).contains(&a.max_replicas) {
        out.push(bad(
            "spec.autoscaling.maxReplicas",
            format!("maxReplicas {} is outside 1..={REPLICAS_MAX}", a.max_replicas),
        ));
    }
    if a.min_replicas > a.max_replicas {
        out.push(bad(
            "spec.autoscaling.minReplicas",
            format!(
                "minReplicas {} exceeds maxReplicas {}: set minReplicas at most maxReplicas",
                a.min_replicas, a.max_replicas
            ),
        ));
    }
    if !(a.target_demand_ratio.is_finite() && (0.05..=1.0).contains(&a.target_demand_ratio)) {
        out.push(bad(
            "spec.autoscaling.targetDemandRatio",
            format!(
                "targetDemandRatio {} is outside 0.05..=1.0: it is the fraction of the fleet's KV capacity the requests should need (0.8 leaves a fifth for bursts while a replica starts)",
                a.target_demand_ratio
            ),
        ));
    }
    for (name, rules) in [("scaleUp", &a.scale_up), ("scaleDown", &a.scale_down)] {
        if let Some(r) = rules {
            out.extend(rules_denials(name, r));
        }
    }
    if a.min_replicas == 0
        && spec.routing_mode() != RoutingMode::Kvfleet
        && a.engine == AutoscalingEngine::Kvfleet
    {
        out.push(denial(
            "spec.autoscaling.minReplicas",
            SCALE_TO_ZERO_NEEDS_ROUTER,
            format!(
                "minReplicas 0 scales an idle deployment to no replica, and with routing mode {} nothing would hold a request until one is back (clients would get connection errors); set routing.mode to kvfleet (its router holds requests and brings a replica back) or minReplicas to at least 1",
                spec.routing_mode().as_str()
            ),
        ));
    }
    if spec.engine.runtime == Runtime::Vllm {
        out.push(denial(
            "spec.autoscaling",
            AUTOSCALING_NEEDS_KVFLEET_RUNTIME,
            "autoscaling reads kvfleet_kv_demand_tokens and kvfleet_kv_capacity_tokens from each worker, and vLLM workers export neither (vLLM's kv_cache_usage_perc counts sliding-window layers as full ones); set engine.runtime to kvfleet, or drop spec.autoscaling and scale vLLM with your own HPA or KEDA object".to_string(),
        ));
    }
    out
}

fn rules_denials(name: &str, r: &ScalingRules) -> Vec<Denial> {
    let mut out = Vec::new();
    if let Some(w) = r.stabilization_window_seconds {
        if !(0..=STABILIZATION_WINDOW_MAX).contains(&w) {
            out.push(denial(
                &format!("spec.autoscaling.{name}.stabilizationWindowSeconds"),
                INVALID_AUTOSCALING,
                format!("stabilizationWindowSeconds {w} is outside 0..={STABILIZATION_WINDOW_MAX} (the HPA's bound)"),
            ));
        }
    }
    for (i, p) in r.policies.iter().enumerate() {
        if p.value < 1 || !(1..=1800).contains(&p.period_seconds) {
            out.push(denial(
                &format!("spec.autoscaling.{name}.policies[{i}]"),
                INVALID_AUTOSCALING,
                format!(
                    "a scaling policy needs value >= 1 and periodSeconds in 1..=1800 (the HPA's bounds); got value {} and periodSeconds {}",
                    p.value, p.period_seconds
                ),
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::tests::KVFLEET_H100;
    use crate::validate::{synthetic_cluster, validate, Verdict};

    fn verdict(extra: &str) -> Verdict {
        let spec: InferenceDeploymentSpec = serde_yaml::from_str(&format!("{KVFLEET_H100}{extra}")).unwrap();
        validate(&spec, &synthetic_cluster(&["NVIDIA-H100-80GB-HBM3"]).unwrap())
    }

    fn reasons(v: &Verdict) -> Vec<&str> {
        v.denials.iter().map(|d| d.reason.as_str()).collect()
    }

    #[test]
    fn scale_to_zero_needs_the_router_to_hold_requests() {
        let v = verdict("autoscaling: {minReplicas: 0, maxReplicas: 4}\n");
        assert_eq!(reasons(&v), [SCALE_TO_ZERO_NEEDS_ROUTER]);
        assert!(
            v.denials[0].message.contains("routing.mode to kvfleet"),
            "{:?}",
            v.denials
        );
        let v = verdict("autoscaling: {minReplicas: 0, maxReplicas: 4}\nrouting: {mode: kvfleet}\n");
        assert!(v.allowed(), "{:?}", v.denials);
        assert!(v.resolved.is_some());
    }

    #[test]
    fn bounds_that_cannot_hold_together_are_denied_each_by_field() {
        let v = verdict("autoscaling: {minReplicas: 5, maxReplicas: 2}\n");
        assert_eq!(reasons(&v), [INVALID_AUTOSCALING]);
        assert_eq!(v.denials[0].field, "spec.autoscaling.minReplicas");
        assert!(
            v.denials[0].message.contains("exceeds maxReplicas 2"),
            "{:?}",
            v.denials
        );
        // Outside the schema's range: denied naming the field, by the bounds or by this check.
        for (yaml, field) in [
            (
                "autoscaling: {maxReplicas: 2, targetDemandRatio: 1.5}\n",
                "spec.autoscaling.targetDemandRatio",
            ),
            (
                "autoscaling: {maxReplicas: 2, scaleDown: {stabilizationWindowSeconds: 7200}}\n",
                "spec.autoscaling.scaleDown.stabilizationWindowSeconds",
            ),
        ] {
            let v = verdict(yaml);
            assert!(
                v.denials.iter().any(|d| d.field == field),
                "{yaml}: {:?}",
                v.denials
            );
        }
    }

    #[test]
    fn vllm_workers_export_no_demand_gauge() {
        let spec = KVFLEET_H100.replace("runtime: kvfleet", "runtime: vllm");
        let spec: InferenceDeploymentSpec =
            serde_yaml::from_str(&format!("{spec}autoscaling: {{maxReplicas: 3}}\n")).unwrap();
        let v = validate(&spec, &synthetic_cluster(&["NVIDIA-H100-80GB-HBM3"]).unwrap());
        assert!(
            reasons(&v).contains(&AUTOSCALING_NEEDS_KVFLEET_RUNTIME),
            "{:?}",
            v.denials
        );
    }

    #[test]
    fn defaults_are_the_documented_ones() {
        let spec: InferenceDeploymentSpec =
            serde_yaml::from_str(&format!("{KVFLEET_H100}autoscaling: {{maxReplicas: 3}}\n")).unwrap();
        let a = spec.autoscaling.unwrap();
        assert_eq!((a.min_replicas, a.max_replicas), (1, 3));
        assert_eq!(a.target_demand_ratio, 0.8);
        assert_eq!(a.engine, AutoscalingEngine::Kvfleet);
    }

    #[test]
    fn keda_is_denied_naming_the_crd_only_where_the_api_server_is_known_not_to_serve_it() {
        let spec: InferenceDeploymentSpec = serde_yaml::from_str(&format!(
            "{KVFLEET_H100}autoscaling: {{engine: keda, maxReplicas: 3}}\n"
        ))
        .unwrap();
        let mut facts = synthetic_cluster(&["NVIDIA-H100-80GB-HBM3"]).unwrap();
        assert!(validate(&spec, &facts).allowed(), "not known: not judged");
        facts.scaled_object_served = Some(true);
        assert!(validate(&spec, &facts).allowed());
        facts.scaled_object_served = Some(false);
        let v = validate(&spec, &facts);
        assert_eq!(reasons(&v), [SCALED_OBJECT_MISSING]);
        assert_eq!(v.denials[0].field, "spec.autoscaling.engine");
        assert!(
            v.denials[0].message.contains("scaledobjects.keda.sh")
                && v.denials[0].message.contains("engine to kvfleet"),
            "{}",
            v.denials[0].message
        );
        // The kvfleet engine never asks for the CRD.
        let own: InferenceDeploymentSpec =
            serde_yaml::from_str(&format!("{KVFLEET_H100}autoscaling: {{maxReplicas: 3}}\n")).unwrap();
        assert!(validate(&own, &facts).allowed());
    }
}
