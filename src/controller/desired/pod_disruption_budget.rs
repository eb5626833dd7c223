//! The PodDisruptionBudget that lets a drain take one replica at a time (only with several).

use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::{selector_labels, Owner};

/// `None` with a single replica (the reconcile loop then removes an existing one).
pub(super) fn pod_disruption_budget(owner: &Owner, replicas: i32) -> Option<PodDisruptionBudget> {
    (replicas > 1).then(|| PodDisruptionBudget {
        metadata: owner.meta(owner.name.clone()),
        spec: Some(PodDisruptionBudgetSpec {
            max_unavailable: Some(IntOrString::Int(1)),
            selector: Some(LabelSelector {
                match_labels: Some(selector_labels(&owner.name)),
                ..LabelSelector::default()
            }),
            ..PodDisruptionBudgetSpec::default()
        }),
        ..PodDisruptionBudget::default()
    })
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

    use super::super::desired;
    use super::super::fixtures::*;
    use super::super::Settings;

    #[test]
    fn a_pdb_exists_only_with_more_than_one_replica() {
        let v = verdict("bfloat16", "KVFLEET_CUDA", "8.6", "NVIDIA-GeForce-RTX-3090");
        let two = desired(&fixture(KVFLEET_RTX3090_TP2), &v, &Settings::default(), None).unwrap();
        let pdb = two.pdb.unwrap();
        assert_eq!(pdb.spec.unwrap().max_unavailable, Some(IntOrString::Int(1)));
        let one = desired(&fixture(VLLM_RTX5090), &v, &Settings::default(), None).unwrap();
        assert!(one.pdb.is_none());
    }
}
