//! Publishes the measured KV capacity as an annotation on the serving pod (the kvfleet worker,
//! or the capacity sidecar beside vLLM), where the controller reads it into
//! `status.capacity.measuredTokensPerReplica` (docs/controller.md).
//! Best effort: outside a pod (no `POD_NAME`/`POD_NAMESPACE`) it does nothing, and an API
//! error is logged, never fatal; `/metrics` and `/v1/capacity` carry the same figure.

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams};

use crate::contract::MEASURED_TOKENS_ANNOTATION;

/// The merge patch that records `tokens` on the pod.
pub fn annotation_patch(tokens: u64) -> serde_json::Value {
    serde_json::json!({"metadata": {"annotations": {MEASURED_TOKENS_ANNOTATION: tokens.to_string()}}})
}

/// Where the pod is, from the downward-API env the controller sets.
pub fn pod_identity(env: impl Fn(&str) -> Option<String>) -> Option<(String, String)> {
    let name = env("POD_NAME").filter(|s| !s.is_empty())?;
    let namespace = env("POD_NAMESPACE").filter(|s| !s.is_empty())?;
    Some((namespace, name))
}

/// Patches the annotation; returns without error when not running in a pod.
pub async fn publish_measured_capacity(tokens: u64) {
    let Some((namespace, name)) = pod_identity(|k| std::env::var(k).ok()) else {
        tracing::debug!("not in a pod (POD_NAME/POD_NAMESPACE unset): measured capacity not published");
        return;
    };
    let client = match kube::Client::try_default().await {
        Ok(c) => c,
        Err(error) => {
            tracing::warn!(%error, "cannot reach the API server: measured capacity not published");
            return;
        }
    };
    let pods: Api<Pod> = Api::namespaced(client, &namespace);
    let params = PatchParams::default();
    match pods
        .patch(&name, &params, &Patch::Merge(annotation_patch(tokens)))
        .await
    {
        Ok(_) => tracing::info!(tokens, pod = %name, "published measured KV capacity"),
        Err(error) => tracing::warn!(%error, pod = %name, "cannot annotate own pod with measured capacity"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patch_carries_the_annotation_the_controller_reads() {
        let p = annotation_patch(62_413_632);
        assert_eq!(
            p["metadata"]["annotations"]["kvfleet.io/measured-kv-tokens"],
            "62413632"
        );
    }

    #[test]
    fn identity_needs_both_downward_api_variables() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        };
        assert_eq!(
            pod_identity(env(&[("POD_NAME", "w-0"), ("POD_NAMESPACE", "ml")])),
            Some(("ml".into(), "w-0".into()))
        );
        assert_eq!(pod_identity(env(&[("POD_NAME", "w-0")])), None);
        assert_eq!(
            pod_identity(env(&[("POD_NAME", ""), ("POD_NAMESPACE", "ml")])),
            None
        );
    }
}
