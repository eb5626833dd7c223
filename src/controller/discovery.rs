//! What the API server serves of the optional CRDs kvfleet renders (LeaderWorkerSet,
//! InferencePool, KEDA's ScaledObject), asked through discovery, and the denial of KEDA's
//! ScaledObject without a Prometheus to query.

use kube::Client;

use super::desired;
use super::error::Error;
use crate::api::{inference_pool, scaled_object};

/// Whether the API server serves leaderworkersets (leaderworkerset.x-k8s.io/v1), asked on
/// each pass that needs it, so installing the CRD later lifts the denial on the next pass.
pub async fn leader_worker_set_installed(client: &Client) -> Result<bool, Error> {
    served(
        client,
        desired::LWS_GROUP,
        desired::LWS_VERSION,
        desired::LWS_PLURAL,
    )
    .await
}

/// Whether the API server serves inferencepools (inference.networking.k8s.io/v1).
pub async fn inference_pool_served(client: &Client) -> Result<bool, Error> {
    served(
        client,
        inference_pool::GROUP,
        inference_pool::VERSION,
        inference_pool::PLURAL,
    )
    .await
}

/// Whether the API server serves scaledobjects (keda.sh/v1alpha1).
pub async fn scaled_object_served(client: &Client) -> Result<bool, Error> {
    served(
        client,
        scaled_object::GROUP,
        scaled_object::VERSION,
        scaled_object::PLURAL,
    )
    .await
}

/// Reason (Compatible=False, Warning Event) of `autoscaling.engine: keda` while the
/// controller was started without `--keda-prometheus-address`.
pub const KEDA_PROMETHEUS_ADDRESS_MISSING: &str = "KedaPrometheusAddressMissing";

/// The denial of `engine: keda` by a controller that knows no Prometheus for KEDA to query.
pub fn keda_prometheus_address_missing() -> crate::validate::Denial {
    crate::validate::Denial {
        field: "spec.autoscaling.engine".into(),
        reason: KEDA_PROMETHEUS_ADDRESS_MISSING.into(),
        message: "autoscaling engine keda renders a KEDA ScaledObject whose Prometheus trigger queries the workers' kvfleet_kv_demand_tokens and kvfleet_kv_capacity_tokens, but the controller was started without a Prometheus address; set the chart's autoscaling.keda.prometheusAddress (the controller's --keda-prometheus-address, e.g. http://prometheus-operated.monitoring.svc:9090), or set spec.autoscaling.engine to kvfleet (no Prometheus needed)".into(),
    }
}

/// Whether discovery lists `plural` in `group/version` (a 404: the group version is not served).
async fn served(client: &Client, group: &str, version: &str, plural: &str) -> Result<bool, Error> {
    let gv = format!("{group}/{version}");
    match client.list_api_group_resources(&gv).await {
        Ok(list) => Ok(list.resources.iter().any(|r| r.name == plural)),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(false),
        Err(source) => Err(Error::kube(format!("discover {gv}"), source)),
    }
}
