//! The Prometheus Operator ServiceMonitor or PodMonitor (whichever discovery found) that
//! scrapes the serving pods' `/metrics`.

use kube::api::DynamicObject;
use serde_json::json;

use super::{selector_labels, MonitorKind, Owner, INSTANCE_LABEL};

/// The target label the recording rules and dashboards group worker series by.
pub const MONITOR_TARGET_LABEL: &str = "inferencedeployment";

/// Relabelings (Prometheus Operator spelling) of the worker ServiceMonitor / PodMonitor:
/// the pod label [`INSTANCE_LABEL`] becomes the target label `inferencedeployment`
/// (`namespace` and `pod` the operator adds itself).
pub fn monitor_relabelings() -> serde_json::Value {
    // Prometheus' service discovery spells a pod label as
    // __meta_kubernetes_pod_label_<name with every invalid character as _>.
    let meta: String = INSTANCE_LABEL
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    json!([{
        "action": "replace",
        "sourceLabels": [format!("__meta_kubernetes_pod_label_{meta}")],
        "targetLabel": MONITOR_TARGET_LABEL,
    }])
}

pub(super) fn monitor(owner: &Owner, kind: &MonitorKind) -> DynamicObject {
    let mut o = DynamicObject::new(&owner.name, &kind.resource).within(&owner.namespace);
    o.metadata = owner.meta(owner.name.clone());
    let selector = json!({ "matchLabels": selector_labels(&owner.name) });
    let endpoint = json!({ "port": "http", "path": "/metrics", "relabelings": monitor_relabelings() });
    o.data = if kind.kind == "PodMonitor" {
        json!({ "spec": { "selector": selector, "podMetricsEndpoints": [endpoint] } })
    } else {
        json!({ "spec": { "selector": selector, "endpoints": [endpoint] } })
    };
    o
}
