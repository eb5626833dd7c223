//! The Service in front of the serving pods, on the named `http` port.

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::{selector_labels, Owner, HTTP_PORT, LWS_WORKER_INDEX_LABEL};

/// `multi_node`: the pods belong to a LeaderWorkerSet, of which only the leader of each group
/// serves the API (the workers run `--headless`). `router`: routing mode kvfleet, where the
/// Service is the router's and the workers are behind it.
pub(super) fn service(owner: &Owner, multi_node: bool, router: bool) -> Service {
    let mut selector = selector_labels(&owner.name);
    if multi_node {
        selector.insert(LWS_WORKER_INDEX_LABEL.into(), "0".into());
    }
    if router {
        selector = super::router::router_selector_labels(&owner.name);
    }
    Service {
        metadata: owner.meta(owner.name.clone()),
        spec: Some(ServiceSpec {
            selector: Some(selector),
            ports: Some(vec![ServicePort {
                name: Some("http".into()),
                port: HTTP_PORT,
                target_port: Some(IntOrString::String("http".into())),
                protocol: Some("TCP".into()),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}
