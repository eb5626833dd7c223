//! The Deployment of a replica that fits one node, and its rollout strategy.

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment};
use k8s_openapi::api::core::v1::PodTemplateSpec;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::{selector_labels, Owner};
use crate::api::InferenceDeploymentSpec;

pub(super) fn deployment(
    owner: &Owner,
    spec: &InferenceDeploymentSpec,
    replicas: Option<i32>,
    template: PodTemplateSpec,
) -> Deployment {
    Deployment {
        metadata: owner.meta(owner.name.clone()),
        spec: Some(DeploymentSpec {
            // None: an autoscaler owns the count (super::applied_replicas).
            replicas,
            selector: LabelSelector {
                match_labels: Some(selector_labels(&owner.name)),
                ..LabelSelector::default()
            },
            strategy: Some(rollout(replicas.unwrap_or(spec.replicas))),
            template,
            ..DeploymentSpec::default()
        }),
        ..Deployment::default()
    }
}

/// Never dark during a rollout. One replica: the new pod comes up beside the old one
/// (`maxSurge: 1, maxUnavailable: 0`); on a full pool it waits Pending for a GPU while the old
/// pod keeps serving. Several replicas: one at a time is replaced in place
/// (`maxSurge: 0, maxUnavailable: 1`), which needs no spare GPU, while the others serve.
pub fn rollout(replicas: i32) -> DeploymentStrategy {
    let (surge, unavailable) = if replicas <= 1 { (1, 0) } else { (0, 1) };
    DeploymentStrategy {
        type_: Some("RollingUpdate".into()),
        rolling_update: Some(RollingUpdateDeployment {
            max_surge: Some(IntOrString::Int(surge)),
            max_unavailable: Some(IntOrString::Int(unavailable)),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::*;
    use super::super::{desired, Desired, Settings, PRE_STOP_SECONDS};
    use super::*;

    #[test]
    fn rollouts_never_go_dark_and_termination_drains_behind_a_pre_stop_sleep() {
        let v = verdict("bfloat16", "KVFLEET_CUDA", "8.6", "NVIDIA-GeForce-RTX-3090");
        let strategy = |d: &Desired| {
            let r = d
                .deployment
                .as_ref()
                .unwrap()
                .spec
                .clone()
                .unwrap()
                .strategy
                .unwrap()
                .rolling_update
                .unwrap();
            (r.max_surge.unwrap(), r.max_unavailable.unwrap())
        };
        // One replica: the replacement starts beside it (never zero serving pods).
        let one = desired(&fixture(VLLM_RTX5090), &v, &Settings::default(), None).unwrap();
        assert_eq!(strategy(&one), (IntOrString::Int(1), IntOrString::Int(0)));
        // Several: one at a time in place, needing no spare GPU.
        let two = desired(&fixture(KVFLEET_RTX3090_TP2), &v, &Settings::default(), None).unwrap();
        assert_eq!(strategy(&two), (IntOrString::Int(0), IntOrString::Int(1)));
        for d in [&one, &two] {
            let p = pod(d);
            let c = &p.containers[0];
            let sleep = c.lifecycle.clone().unwrap().pre_stop.unwrap().sleep.unwrap();
            assert_eq!(sleep.seconds, PRE_STOP_SECONDS);
            // preStop + the worker's default drain + closing the server fit in the grace period.
            assert!(PRE_STOP_SECONDS + 20 + 10 < p.termination_grace_period_seconds.unwrap());
        }
    }
}
