//! The NetworkPolicy of the serving pods: when the spec sets `network`, and behind the kvfleet
//! router, where the `kv-events` port admits only the router's pods.

use std::collections::BTreeMap;

use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort, NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::{selector_labels, worker_network_policy_name, Owner, Settings};
use crate::api::NetworkSpec;

pub(super) fn network_policy(
    owner: &Owner,
    net: &NetworkSpec,
    settings: &Settings,
    kv_events: bool,
) -> NetworkPolicy {
    let mut spec = worker_network_policy(&owner.name, &net.allow_from, &settings.worker_metrics_from);
    // KV-event subscribers (routers) are API clients: they reach the `kv-events` port too.
    if kv_events && !net.allow_from.is_empty() {
        if let Some(rule) = spec.ingress.as_mut().and_then(|r| r.first_mut()) {
            rule.ports.get_or_insert_with(Vec::new).push(NetworkPolicyPort {
                port: Some(IntOrString::String(KV_EVENTS_PORT_NAME.into())),
                protocol: Some("TCP".into()),
                ..NetworkPolicyPort::default()
            });
        }
    }
    NetworkPolicy {
        metadata: owner.meta(worker_network_policy_name(&owner.name)),
        spec: Some(spec),
    }
}

/// The serving container's port of the KV-event publisher (`spec.engine.kvEvents`).
pub const KV_EVENTS_PORT_NAME: &str = "kv-events";

/// Behind the kvfleet router without `spec.network`: the `kv-events` port admits only the
/// router's pods, the one subscriber this spec knows of (a KV-event port reachable from any pod
/// is a port any pod can feed hostile frames, issue 62); the serving port stays open to every
/// source, as without a policy. A rule without `from` admits every source on its ports.
pub(super) fn kv_events_from_router(owner: &Owner, router: NetworkPolicyPeer) -> NetworkPolicy {
    let port = |name: &str| NetworkPolicyPort {
        port: Some(IntOrString::String(name.into())),
        protocol: Some("TCP".into()),
        ..NetworkPolicyPort::default()
    };
    NetworkPolicy {
        metadata: owner.meta(worker_network_policy_name(&owner.name)),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(LabelSelector {
                match_labels: Some(selector_labels(&owner.name)),
                ..LabelSelector::default()
            }),
            policy_types: Some(vec!["Ingress".into()]),
            ingress: Some(vec![
                NetworkPolicyIngressRule {
                    from: None,
                    ports: Some(vec![port("http")]),
                },
                NetworkPolicyIngressRule {
                    from: Some(vec![router]),
                    ports: Some(vec![port(KV_EVENTS_PORT_NAME)]),
                },
            ]),
            egress: None,
        }),
    }
}

/// Ingress to the pods of `name` (worker or vLLM) on the serving port only, from `allow_from`
/// and from `metrics_from`. The port serves the API, the probes and `/metrics` alike, so a
/// metrics peer reaches the API too (`spec.apiKey` guards that). An empty list adds no rule:
/// a rule with no `from` would admit every source. Both empty: no ingress at all. Kubelet
/// probes come from the node and the capacity sidecar over loopback; the usual plugins do
/// not filter either.
pub fn worker_network_policy(
    name: &str,
    allow_from: &[NetworkPolicyPeer],
    metrics_from: &[NetworkPolicyPeer],
) -> NetworkPolicySpec {
    ingress_policy(selector_labels(name), allow_from, metrics_from)
}

/// [`worker_network_policy`] of the pods `selector` selects (the router's too).
pub(super) fn ingress_policy(
    selector: BTreeMap<String, String>,
    allow_from: &[NetworkPolicyPeer],
    metrics_from: &[NetworkPolicyPeer],
) -> NetworkPolicySpec {
    let rule = |from: &[NetworkPolicyPeer]| NetworkPolicyIngressRule {
        from: Some(from.to_vec()),
        ports: Some(vec![NetworkPolicyPort {
            port: Some(IntOrString::String("http".into())),
            protocol: Some("TCP".into()),
            ..NetworkPolicyPort::default()
        }]),
    };
    let ingress = [allow_from, metrics_from]
        .into_iter()
        .filter(|peers| !peers.is_empty())
        .map(rule)
        .collect();
    NetworkPolicySpec {
        pod_selector: Some(LabelSelector {
            match_labels: Some(selector),
            ..LabelSelector::default()
        }),
        policy_types: Some(vec!["Ingress".into()]),
        ingress: Some(ingress),
        egress: None,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::super::fixtures::*;
    use super::super::{desired, Desired, HTTP_PORT, INSTANCE_LABEL};
    use super::*;

    impl Desired {
        /// (name, port) of the serving container's ports.
        fn deployment_container_ports(&self) -> Vec<(String, i32)> {
            container(self)
                .ports
                .into_iter()
                .flatten()
                .map(|p| (p.name.unwrap_or_default(), p.container_port))
                .collect()
        }
    }

    fn peers(json: serde_json::Value) -> Vec<NetworkPolicyPeer> {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn without_spec_network_no_network_policy_is_rendered() {
        let v = verdict("bfloat16", "KVFLEET_CUDA", "8.6", "NVIDIA-GeForce-RTX-3090");
        let d = desired(&fixture(KVFLEET_RTX3090_TP2), &v, &Settings::default(), None).unwrap();
        assert_eq!(d.network_policy, None);
    }

    #[test]
    fn spec_network_renders_a_policy_admitting_its_peers_and_the_metrics_peers_to_the_serving_port() {
        let mut obj = fixture(VLLM_RTX5090);
        obj.spec.network = Some(crate::api::NetworkSpec {
            allow_from: peers(json!([
                {"podSelector": {"matchLabels": {"app": "gateway"}}},
                {"ipBlock": {"cidr": "10.8.0.0/16", "except": ["10.8.1.0/24"]}}
            ])),
        });
        let settings = Settings {
            worker_metrics_from: peers(json!([
                {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
            ])),
            ..Settings::default()
        };
        let v = verdict("fp8", "TRITON_ATTN", "12.0", "NVIDIA-GeForce-RTX-5090");
        let d = desired(&obj, &v, &settings, None).unwrap();
        let np = d.network_policy.clone().expect("a NetworkPolicy");
        assert_eq!(np.metadata.name.as_deref(), Some("gemma-worker"));
        assert_eq!(np.metadata.namespace.as_deref(), Some("ml"));
        let owner = &np.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.controller),
            ("InferenceDeployment", Some(true))
        );
        let spec = serde_json::to_value(np.spec.unwrap()).unwrap();
        // The pods of this deployment, exactly as its Deployment and Service select them.
        assert_eq!(
            spec["podSelector"],
            json!({"matchLabels": {INSTANCE_LABEL: "gemma"}})
        );
        let template = &d.deployment.as_ref().unwrap().spec.as_ref().unwrap().template;
        assert_eq!(
            template.metadata.as_ref().unwrap().labels.as_ref().unwrap()[INSTANCE_LABEL],
            "gemma"
        );
        assert_eq!(spec["policyTypes"], json!(["Ingress"]));
        let port = json!([{"port": "http", "protocol": "TCP"}]);
        assert_eq!(
            spec["ingress"],
            json!([
                {"from": [{"podSelector": {"matchLabels": {"app": "gateway"}}},
                          {"ipBlock": {"cidr": "10.8.0.0/16", "except": ["10.8.1.0/24"]}}],
                 "ports": port},
                {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
                 "ports": port}
            ])
        );
        // The named port is the serving container's.
        let c = &d.deployment_container_ports();
        assert!(c.contains(&("http".to_string(), HTTP_PORT)), "{c:?}");
    }

    /// Issue 62: without `spec.network` the KV-event port was open to every pod. Behind the
    /// kvfleet router it admits the router's pods only; the serving port stays open, and those
    /// two are every port the worker container has (a port left out would be closed).
    #[test]
    fn behind_the_router_without_spec_network_only_the_router_reaches_the_kv_event_port() {
        let mut obj = fixture(KVFLEET_RTX3090_TP2);
        obj.spec.routing = Some(serde_json::from_value(json!({"mode": "kvfleet"})).unwrap());
        let v = verdict("bfloat16", "KVFLEET_CUDA", "8.6", "NVIDIA-GeForce-RTX-3090");
        let d = desired(&obj, &v, &Settings::default(), None).unwrap();
        let np = d
            .network_policy
            .clone()
            .expect("a NetworkPolicy for the kv-events port");
        assert_eq!(np.metadata.name.as_deref(), Some("llama-worker"));
        let spec = serde_json::to_value(np.spec.unwrap()).unwrap();
        assert_eq!(
            spec["podSelector"],
            json!({"matchLabels": {INSTANCE_LABEL: "llama"}})
        );
        assert_eq!(spec["policyTypes"], json!(["Ingress"]));
        assert_eq!(
            spec["ingress"],
            json!([
                {"ports": [{"port": "http", "protocol": "TCP"}]},
                {"from": [{"podSelector": {"matchLabels": {"kvfleet.io/router": "llama"}}}],
                 "ports": [{"port": KV_EVENTS_PORT_NAME, "protocol": "TCP"}]}
            ])
        );
        let mut ports: Vec<String> = d.deployment_container_ports().into_iter().map(|p| p.0).collect();
        ports.sort();
        assert_eq!(ports, ["http", KV_EVENTS_PORT_NAME]);
        // Routing mode service, KV events or not: no policy, as before.
        let mut obj = fixture(KVFLEET_RTX3090_TP2);
        obj.spec.engine.kv_events = Some(crate::api::KvEventsSpec {
            enabled: true,
            port: 5557,
            topic: String::new(),
        });
        assert_eq!(
            desired(&obj, &v, &Settings::default(), None)
                .unwrap()
                .network_policy,
            None
        );
    }

    #[test]
    fn an_empty_peer_list_never_becomes_a_rule_that_admits_everyone() {
        let none = worker_network_policy("m", &[], &[]);
        // No rule at all: no ingress. (A rule without `from` would admit every source.)
        assert_eq!(none.ingress, Some(vec![]));
        assert_eq!(none.policy_types, Some(vec!["Ingress".to_string()]));
        let metrics = peers(json!([{"podSelector": {"matchLabels": {"app": "prometheus"}}}]));
        let only_metrics = worker_network_policy("m", &[], &metrics);
        let rules = only_metrics.ingress.unwrap();
        assert_eq!(rules.len(), 1);
        assert_eq!(rules[0].from.as_deref(), Some(&metrics[..]));
        let clients = peers(json!([{"namespaceSelector": {}}]));
        let rules = worker_network_policy("m", &clients, &[]).ingress.unwrap();
        assert_eq!(rules.len(), 1);
        assert_eq!(rules[0].from.as_deref(), Some(&clients[..]));
    }
}
