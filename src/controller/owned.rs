//! The objects one InferenceDeployment owns, as one set: every object a pass wants is added
//! with its kind, the set is checked for ownership once, applied in one loop, and then every
//! object of a managed kind that carries our labels and owner reference but is no longer in
//! the set is deleted. A spec that switches runtime or shape (kvfleet to vllm, one node to a
//! LeaderWorkerSet, fewer replicas, no `network`) leaves nothing behind.
//!
//! Adding a kind: a field of [`Desired`] and its builder in `desired/`, one line in
//! [`OwnedSet::of`] (apply order) and in [`managed_kinds`] (the sweep), and the `list` and
//! `delete` verbs besides `get`, `create`, `patch` in the chart's ClusterRole and
//! deploy/rbac/controller.yaml.

use k8s_openapi::api::apps::v1::{Deployment, DeploymentStatus};
use k8s_openapi::api::core::v1::{ConfigMap, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, Preconditions,
};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;

use crate::api::InferenceDeployment;

use super::desired::{self, Desired, DesiredError, MonitorKind};
use super::error::{is_conflict, Error};

/// The one field manager of every server-side apply.
pub const FIELD_MANAGER: &str = "kvfleet-controller";
/// Tries of one server-side apply when the API server answers 409.
const CONFLICT_RETRIES: usize = 3;

/// One object of the set: its kind (for the dynamic API) and its body.
#[derive(Clone, Debug)]
pub struct Owned {
    pub resource: ApiResource,
    pub object: DynamicObject,
}

impl Owned {
    pub fn name(&self) -> String {
        self.object.name_any()
    }

    /// "Deployment llama", for messages.
    pub fn describe(&self) -> String {
        format!("{} {}", self.resource.kind, self.name())
    }
}

/// Every object one pass wants for one InferenceDeployment, in apply order.
#[derive(Clone, Debug)]
pub struct OwnedSet {
    namespace: String,
    /// Name of the InferenceDeployment: the value of the instance label of what it owns.
    instance: String,
    owner_uid: String,
    objects: Vec<Owned>,
}

/// What the ownership check found among the objects of the set's names.
#[derive(Debug, Default)]
pub struct Looked {
    /// "Service ml/llama (owned by ...)" per object that exists and is not ours: while any
    /// is, nothing is applied.
    pub foreign: Vec<String>,
    /// The objects of the set's names that exist and are ours, as stored.
    pub ours: Vec<Owned>,
}

// === impl OwnedSet ===

impl OwnedSet {
    /// An empty set for the objects `obj` owns.
    pub fn new(obj: &InferenceDeployment) -> Result<Self, DesiredError> {
        let meta = &obj.metadata;
        Ok(OwnedSet {
            namespace: meta
                .namespace
                .clone()
                .ok_or(DesiredError::MissingMetadata("namespace"))?,
            instance: meta.name.clone().ok_or(DesiredError::MissingMetadata("name"))?,
            owner_uid: meta.uid.clone().ok_or(DesiredError::MissingMetadata("uid"))?,
            objects: Vec::new(),
        })
    }

    /// The set of everything in `want`, in the order it is applied: the worker's config and
    /// identity, the NetworkPolicy before any pod can run unguarded, the workload, then what
    /// points at it.
    pub fn of(
        obj: &InferenceDeployment,
        want: &Desired,
        monitor: Option<&MonitorKind>,
    ) -> Result<Self, DesiredError> {
        // Destructured so that a new field of Desired does not compile until it is added here.
        let Desired {
            config_map,
            service_account,
            role_binding,
            deployment,
            leader_worker_set,
            service,
            pdb,
            monitor: monitor_object,
            network_policy,
            router,
            inference_pool,
            scaled_object,
        } = want;
        let mut set = OwnedSet::new(obj)?;
        if let Some(o) = config_map {
            set.add(o)?;
        }
        if let Some(o) = service_account {
            set.add(o)?;
        }
        if let Some(o) = role_binding {
            set.add(o)?;
        }
        if let Some(r) = router {
            set.add(&r.service_account)?;
            set.add(&r.role)?;
            set.add(&r.role_binding)?;
        }
        if let Some(o) = network_policy {
            set.add(o)?;
        }
        if let Some(o) = router.as_ref().and_then(|r| r.network_policy.as_ref()) {
            set.add(o)?;
        }
        if let Some(o) = deployment {
            set.add(o)?;
        }
        if let Some(o) = leader_worker_set {
            set.add_dynamic(desired::leader_worker_set_resource(), o.clone());
        }
        // The router after the workers and the Service that lists them for it.
        if let Some(r) = router {
            set.add(&r.workers_service)?;
            set.add(&r.deployment)?;
        }
        set.add(service)?;
        if let Some(o) = pdb {
            set.add(o)?;
        }
        if let Some(r) = router {
            set.add(&r.pdb)?;
        }
        if let Some(o) = inference_pool {
            set.add_dynamic(desired::inference_pool_resource(), o.clone());
        }
        // After the Deployment it scales.
        if let Some(o) = scaled_object {
            set.add_dynamic(desired::scaled_object_resource(), o.clone());
        }
        if let (Some(o), Some(kind)) = (monitor_object, monitor) {
            set.add_dynamic(kind.resource.clone(), o.clone());
        }
        Ok(set)
    }

    /// Adds a typed object (its kind from its type).
    pub fn add<K>(&mut self, obj: &K) -> Result<(), DesiredError>
    where
        K: Resource<DynamicType = ()> + Serialize,
    {
        let resource = ApiResource::erase::<K>(&());
        let what = format!(
            "{} {}",
            resource.kind,
            obj.meta().name.as_deref().unwrap_or_default()
        );
        let object = serde_json::to_value(obj)
            .and_then(serde_json::from_value)
            .map_err(|e| DesiredError::Encode(what, e))?;
        self.add_dynamic(resource, object);
        Ok(())
    }

    /// Adds an object of a kind known only at run time (a CRD's).
    pub fn add_dynamic(&mut self, resource: ApiResource, object: DynamicObject) {
        self.objects.push(Owned { resource, object });
    }

    pub fn objects(&self) -> &[Owned] {
        &self.objects
    }

    /// Whether the set holds an object of `kind` named `name`.
    pub fn contains(&self, resource: &ApiResource, name: &str) -> bool {
        self.objects
            .iter()
            .any(|o| same_kind(&o.resource, resource) && o.name() == name)
    }

    fn api(&self, client: &Client, resource: &ApiResource) -> Api<DynamicObject> {
        Api::namespaced_with(client.clone(), &self.namespace, resource)
    }

    /// The ownership check, once for the whole set: reads each object of the set's names.
    /// A forced apply over an object someone else created would take it over (and garbage
    /// collection would later delete it), so the caller applies nothing while any is foreign.
    pub async fn look(&self, client: &Client) -> Result<Looked, Error> {
        let mut looked = Looked::default();
        for o in &self.objects {
            let name = o.name();
            let existing = self
                .api(client, &o.resource)
                .get_opt(&name)
                .await
                .map_err(|source| Error::kube(format!("read {}", o.describe()), source))?;
            match existing {
                Some(e) if is_owned_by(&e, &self.owner_uid) => looked.ours.push(Owned {
                    resource: o.resource.clone(),
                    object: e,
                }),
                Some(e) => looked.foreign.push(format!(
                    "{} {}/{name} ({})",
                    o.resource.kind,
                    self.namespace,
                    describe_owners(&e)
                )),
                None => {}
            }
        }
        Ok(looked)
    }

    /// Server-side applies every object, in order, with the controller's field manager;
    /// returns them as the API server stored them.
    pub async fn apply(&self, client: &Client) -> Result<Vec<Owned>, Error> {
        let pp = PatchParams::apply(FIELD_MANAGER).force();
        let mut applied = Vec::with_capacity(self.objects.len());
        for o in &self.objects {
            let api = self.api(client, &o.resource);
            let name = o.name();
            let mut attempt = 0;
            let stored = loop {
                match api.patch(&name, &pp, &Patch::Apply(&o.object)).await {
                    Ok(s) => break s,
                    Err(e) if is_conflict(&e) && attempt + 1 < CONFLICT_RETRIES => attempt += 1,
                    Err(source) => return Err(Error::kube(format!("apply {}", o.describe()), source)),
                }
            };
            applied.push(Owned {
                resource: o.resource.clone(),
                object: stored,
            });
        }
        Ok(applied)
    }

    /// Lists each of `kinds` by the labels kvfleet puts on what it creates for this
    /// InferenceDeployment and deletes every object that the set no longer holds and that
    /// carries an owner reference to it: never an object kvfleet did not create. A kind whose
    /// API the server does not serve (a CRD not installed) has nothing of ours: skipped.
    /// Returns what was deleted ("LeaderWorkerSet llama").
    pub async fn delete_orphans(&self, client: &Client, kinds: &[ApiResource]) -> Result<Vec<String>, Error> {
        let selector = desired::owned_selector(&self.instance);
        let mut deleted = Vec::new();
        for kind in kinds {
            let api = self.api(client, kind);
            let found = match api.list(&ListParams::default().labels(&selector)).await {
                Ok(list) => list.items,
                Err(kube::Error::Api(s)) if s.code == 404 => continue,
                Err(source) => return Err(Error::kube(format!("list {}s", kind.kind), source)),
            };
            for o in found {
                let name = o.name_any();
                if self.contains(kind, &name) || !is_owned_by(&o, &self.owner_uid) {
                    continue;
                }
                // The uid precondition: an object of that name made since the list is not ours
                // to delete.
                let dp = DeleteParams {
                    preconditions: Some(Preconditions {
                        uid: o.uid(),
                        resource_version: None,
                    }),
                    ..DeleteParams::background()
                };
                match api.delete(&name, &dp).await {
                    Ok(_) => {}
                    // Gone already, or replaced by another object of that name.
                    Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => continue,
                    Err(source) => return Err(Error::kube(format!("delete {} {name}", kind.kind), source)),
                }
                tracing::info!(kind = %kind.kind, %name, "deleted an object the spec no longer wants");
                deleted.push(format!("{} {name}", kind.kind));
            }
        }
        Ok(deleted)
    }
}

/// The optional CRDs the API server serves, as discovery last found them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Served {
    /// InferencePools (inference.networking.k8s.io/v1).
    pub inference_pool: bool,
    /// KEDA's ScaledObjects (keda.sh/v1alpha1).
    pub scaled_object: bool,
}

impl Served {
    /// Every optional CRD served.
    pub fn all() -> Self {
        Served {
            inference_pool: true,
            scaled_object: true,
        }
    }
}

/// Every kind the controller creates, in the order the orphan sweep lists them. The monitors
/// only where discovery found the monitoring API, and InferencePools and ScaledObjects only
/// where the API server serves them (`served`): otherwise the set holds none even where ours
/// might exist (discovery failed for a moment), and the sweep would delete them.
pub fn managed_kinds(monitor: Option<&MonitorKind>, served: Served) -> Vec<ApiResource> {
    let mut kinds = vec![
        ApiResource::erase::<ConfigMap>(&()),
        ApiResource::erase::<ServiceAccount>(&()),
        ApiResource::erase::<Role>(&()),
        ApiResource::erase::<RoleBinding>(&()),
        ApiResource::erase::<NetworkPolicy>(&()),
        ApiResource::erase::<Deployment>(&()),
        desired::leader_worker_set_resource(),
        ApiResource::erase::<Service>(&()),
        ApiResource::erase::<PodDisruptionBudget>(&()),
    ];
    if served.inference_pool {
        kinds.push(desired::inference_pool_resource());
    }
    if served.scaled_object {
        kinds.push(desired::scaled_object_resource());
    }
    if let Some(m) = monitor {
        for (kind, plural) in [
            ("ServiceMonitor", "servicemonitors"),
            ("PodMonitor", "podmonitors"),
        ] {
            kinds.push(ApiResource {
                kind: kind.into(),
                plural: plural.into(),
                ..m.resource.clone()
            });
        }
    }
    kinds
}

/// The workload among `objects` in the shape status reads: the workers' Deployment (never the
/// router's), else the LeaderWorkerSet's groups as replicas.
pub fn workload(objects: &[Owned]) -> Result<Option<Deployment>, Error> {
    let deployment = ApiResource::erase::<Deployment>(&());
    let lws = desired::leader_worker_set_resource();
    let workers = |o: &&Owned| {
        o.object.data["spec"]["selector"]["matchLabels"]
            .get(desired::ROUTER_LABEL)
            .is_none()
    };
    if let Some(o) = objects
        .iter()
        .filter(|o| same_kind(&o.resource, &deployment))
        .find(workers)
    {
        let d = serde_json::to_value(&o.object)
            .and_then(serde_json::from_value)
            .map_err(|e| Error::kube(format!("read {}", o.describe()), kube::Error::SerdeError(e)))?;
        return Ok(Some(d));
    }
    Ok(objects
        .iter()
        .find(|o| same_kind(&o.resource, &lws))
        .map(|o| leader_worker_set_as_deployment(&o.object)))
}

/// A LeaderWorkerSet's progress in the shape status reads from a Deployment: its replicas are
/// groups, ready when every pod of the group is. LWS status has no observedGeneration, so the
/// object's own generation stands in for it.
pub fn leader_worker_set_as_deployment(lws: &DynamicObject) -> Deployment {
    let st = &lws.data["status"];
    let int = |k: &str| {
        st.get(k)
            .and_then(|v| v.as_i64())
            .and_then(|v| i32::try_from(v).ok())
    };
    Deployment {
        metadata: ObjectMeta {
            name: lws.metadata.name.clone(),
            generation: lws.metadata.generation,
            ..ObjectMeta::default()
        },
        spec: None,
        status: Some(DeploymentStatus {
            replicas: int("replicas"),
            ready_replicas: int("readyReplicas"),
            updated_replicas: int("updatedReplicas"),
            observed_generation: lws.metadata.generation,
            ..DeploymentStatus::default()
        }),
    }
}

fn same_kind(a: &ApiResource, b: &ApiResource) -> bool {
    a.group == b.group && a.kind == b.kind
}

// === impl ownership ===

/// True when `obj` carries an owner reference to the object of `uid`.
pub fn is_owned_by<K: Resource>(obj: &K, uid: &str) -> bool {
    !uid.is_empty() && obj.owner_references().iter().any(|r| r.uid == uid)
}

/// Who owns `obj`, for messages: "owned by Deployment other" or "no owner reference: ...".
fn describe_owners<K: Resource>(obj: &K) -> String {
    let refs = obj.owner_references();
    if refs.is_empty() {
        return "no owner reference: created outside kvfleet".into();
    }
    let owners: Vec<String> = refs.iter().map(|r| format!("{} {}", r.kind, r.name)).collect();
    format!("owned by {}", owners.join(", "))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::super::desired::fixtures::*;
    use super::super::desired::{desired, Settings};
    use super::*;
    use crate::validate::MultiNode;

    /// A kvfleet spec that wants every kind a single-node replica can own.
    fn everything() -> (InferenceDeployment, Desired) {
        let mut obj = fixture(KVFLEET_RTX3090_TP2);
        obj.spec.network = Some(serde_json::from_value(json!({"allowFrom": [{"podSelector": {}}]})).unwrap());
        let v = verdict("bfloat16", "KVFLEET_CUDA", "8.6", "NVIDIA-GeForce-RTX-3090");
        let d = desired(&obj, &v, &Settings::default(), Some(&service_monitor())).unwrap();
        (obj, d)
    }

    /// A vLLM spec whose replicas span two nodes: a LeaderWorkerSet.
    fn multi_node() -> (InferenceDeployment, Desired) {
        let mut obj = fixture(VLLM_RTX5090);
        obj.spec.engine.tensor_parallel_size = 16;
        let mut v = verdict("fp8", "FLASH_ATTN", "9.0", "NVIDIA-H100-80GB-HBM3");
        v.multi_node = Some(MultiNode {
            nodes_per_replica: 2,
            gpus_per_node: 8,
            most_gpus_on_a_node: 8,
        });
        let d = desired(&obj, &v, &Settings::default(), None).unwrap();
        (obj, d)
    }

    fn kinds(set: &OwnedSet) -> Vec<String> {
        set.objects().iter().map(|o| o.resource.kind.clone()).collect()
    }

    #[test]
    fn the_set_applies_config_and_identity_then_the_policy_then_the_workload_then_what_points_at_it() {
        let (obj, d) = everything();
        let set = OwnedSet::of(&obj, &d, Some(&service_monitor())).unwrap();
        assert_eq!(
            kinds(&set),
            [
                "ConfigMap",
                "ServiceAccount",
                "RoleBinding",
                "NetworkPolicy",
                "Deployment",
                "Service",
                "PodDisruptionBudget",
                "ServiceMonitor"
            ]
        );
        let names: Vec<String> = set.objects().iter().map(Owned::name).collect();
        assert_eq!(
            names,
            [
                "llama-config",
                "llama-worker",
                "llama-worker",
                "llama-worker",
                "llama",
                "llama",
                "llama",
                "llama"
            ]
        );
    }

    #[test]
    fn the_set_applies_exactly_the_rendered_objects() {
        let (obj, d) = everything();
        let set = OwnedSet::of(&obj, &d, Some(&service_monitor())).unwrap();
        let rendered = [
            serde_json::to_value(d.config_map.as_ref().unwrap()).unwrap(),
            serde_json::to_value(d.service_account.as_ref().unwrap()).unwrap(),
            serde_json::to_value(d.role_binding.as_ref().unwrap()).unwrap(),
            serde_json::to_value(d.network_policy.as_ref().unwrap()).unwrap(),
            serde_json::to_value(d.deployment.as_ref().unwrap()).unwrap(),
            serde_json::to_value(&d.service).unwrap(),
            serde_json::to_value(d.pdb.as_ref().unwrap()).unwrap(),
            serde_json::to_value(d.monitor.as_ref().unwrap()).unwrap(),
        ];
        for (o, want) in set.objects().iter().zip(rendered) {
            assert_eq!(serde_json::to_value(&o.object).unwrap(), want, "{}", o.describe());
        }
    }

    /// The kvfleet spec of [`everything`] behind kvfleet's router.
    fn routed() -> (InferenceDeployment, Desired) {
        let (mut obj, _) = everything();
        obj.spec.routing = Some(serde_json::from_value(json!({"mode": "kvfleet"})).unwrap());
        let v = verdict("bfloat16", "KVFLEET_CUDA", "8.6", "NVIDIA-GeForce-RTX-3090");
        let d = desired(&obj, &v, &Settings::default(), Some(&service_monitor())).unwrap();
        (obj, d)
    }

    /// A vLLM spec in an InferencePool.
    fn pooled() -> (InferenceDeployment, Desired) {
        let mut obj = fixture(VLLM_RTX5090);
        obj.spec.routing = Some(
            serde_json::from_value(json!({"mode": "inferencePool",
                                          "endpointPicker": {"name": "epp", "port": 9002}}))
            .unwrap(),
        );
        let v = verdict("fp8", "FLASH_ATTN", "12.0", "NVIDIA-GeForce-RTX-5090");
        let d = desired(&obj, &v, &Settings::default(), None).unwrap();
        (obj, d)
    }

    /// The kvfleet spec of [`everything`] scaled by KEDA.
    fn keda_scaled() -> (InferenceDeployment, Desired) {
        let (mut obj, _) = everything();
        obj.spec.autoscaling = Some(
            serde_json::from_value(json!({"engine": "keda", "minReplicas": 1, "maxReplicas": 4})).unwrap(),
        );
        let v = verdict("bfloat16", "KVFLEET_CUDA", "8.6", "NVIDIA-GeForce-RTX-3090");
        let settings = Settings {
            keda_prometheus_address: Some("http://prometheus:9090".into()),
            ..Settings::default()
        };
        let d = desired(&obj, &v, &settings, Some(&service_monitor())).unwrap();
        (obj, d)
    }

    #[test]
    fn a_keda_set_applies_the_scaled_object_after_the_deployment_it_scales() {
        let (obj, d) = keda_scaled();
        let set = OwnedSet::of(&obj, &d, Some(&service_monitor())).unwrap();
        let k = kinds(&set);
        let at = |kind: &str| {
            k.iter()
                .position(|x| x == kind)
                .unwrap_or_else(|| panic!("{kind} in {k:?}"))
        };
        assert!(at("Deployment") < at("ScaledObject"), "{k:?}");
        assert!(set.contains(&desired::scaled_object_resource(), "llama"));
        let (obj, d) = everything();
        let set = OwnedSet::of(&obj, &d, Some(&service_monitor())).unwrap();
        assert!(!set.contains(&desired::scaled_object_resource(), "llama"));
    }

    #[test]
    fn scaled_objects_are_swept_only_where_the_api_server_serves_them() {
        let kinds = |scaled_object| -> Vec<String> {
            managed_kinds(
                None,
                Served {
                    inference_pool: false,
                    scaled_object,
                },
            )
            .into_iter()
            .map(|k| k.kind)
            .collect()
        };
        assert!(!kinds(false).contains(&"ScaledObject".to_string()));
        assert!(kinds(true).contains(&"ScaledObject".to_string()));
        assert!(!kinds(true).contains(&"InferencePool".to_string()));
    }

    #[test]
    fn a_routed_set_adds_the_routers_identity_first_and_its_workload_after_the_workers() {
        let (obj, d) = routed();
        let set = OwnedSet::of(&obj, &d, Some(&service_monitor())).unwrap();
        let described: Vec<String> = set.objects().iter().map(Owned::describe).collect();
        assert_eq!(
            described,
            [
                "ConfigMap llama-config",
                "ServiceAccount llama-worker",
                "RoleBinding llama-worker",
                "ServiceAccount llama-router",
                "Role llama-router",
                "RoleBinding llama-router",
                "NetworkPolicy llama-worker",
                "NetworkPolicy llama-router",
                "Deployment llama",
                "Service llama-workers",
                "Deployment llama-router",
                "Service llama",
                "PodDisruptionBudget llama",
                "PodDisruptionBudget llama-router",
                "ServiceMonitor llama",
            ]
        );
        // Status reads the workers' Deployment, not the router's.
        let mut objects = set.objects().to_vec();
        objects.swap(8, 10);
        let w = workload(&objects).unwrap().unwrap();
        assert_eq!(w.metadata.name.as_deref(), Some("llama"));
        let (obj, d) = pooled();
        let set = OwnedSet::of(&obj, &d, None).unwrap();
        assert_eq!(
            kinds(&set),
            [
                "ServiceAccount",
                "RoleBinding",
                "Deployment",
                "Service",
                "InferencePool"
            ]
        );
    }

    #[test]
    fn every_kind_a_set_can_hold_is_one_the_sweep_lists() {
        let monitor = service_monitor();
        let swept = managed_kinds(Some(&monitor), Served::all());
        let (a, da) = everything();
        let (b, db) = multi_node();
        let (c, dc) = routed();
        let (e, de) = pooled();
        let (f, df) = keda_scaled();
        let sets = [
            OwnedSet::of(&f, &df, Some(&monitor)).unwrap(),
            OwnedSet::of(&a, &da, Some(&monitor)).unwrap(),
            OwnedSet::of(&b, &db, None).unwrap(),
            OwnedSet::of(&c, &dc, Some(&monitor)).unwrap(),
            OwnedSet::of(&e, &de, None).unwrap(),
        ];
        for o in sets.iter().flat_map(|s| s.objects()) {
            assert!(
                swept.iter().any(|k| same_kind(k, &o.resource)
                    && k.plural == o.resource.plural
                    && k.version == o.resource.version),
                "{} is never swept",
                o.describe()
            );
        }
        // Both monitor kinds: ours may be of either, whichever discovery found when made.
        let kinds: Vec<&str> = swept.iter().map(|k| k.kind.as_str()).collect();
        assert!(
            kinds.contains(&"PodMonitor") && kinds.contains(&"LeaderWorkerSet"),
            "{kinds:?}"
        );
    }

    #[test]
    fn without_the_monitoring_api_discovered_no_monitor_is_swept() {
        // Discovery may fail for a moment while ours exist: the set would hold none of them.
        let kinds: Vec<String> = managed_kinds(None, Served::default())
            .into_iter()
            .map(|k| k.kind)
            .collect();
        assert!(!kinds.iter().any(|k| k.ends_with("Monitor")), "{kinds:?}");
    }

    #[test]
    fn inference_pools_are_swept_only_where_the_api_server_serves_them() {
        let kinds = |served| -> Vec<String> {
            managed_kinds(
                None,
                Served {
                    inference_pool: served,
                    scaled_object: false,
                },
            )
            .into_iter()
            .map(|k| k.kind)
            .collect()
        };
        assert!(!kinds(false).contains(&"InferencePool".to_string()));
        assert!(kinds(true).contains(&"InferencePool".to_string()));
        assert!(
            kinds(false).contains(&"Role".to_string()),
            "the router's Role always"
        );
    }

    #[test]
    fn a_vllm_set_keeps_the_worker_identity_for_the_capacity_sidecar_and_has_no_config_map() {
        let obj = fixture(VLLM_RTX5090);
        let v = verdict("fp8", "FLASH_ATTN", "12.0", "NVIDIA-GeForce-RTX-5090");
        let d = desired(&obj, &v, &Settings::default(), None).unwrap();
        let set = OwnedSet::of(&obj, &d, None).unwrap();
        assert_eq!(
            kinds(&set),
            ["ServiceAccount", "RoleBinding", "Deployment", "Service"]
        );
        let config = ApiResource::erase::<ConfigMap>(&());
        assert!(!set.contains(&config, "gemma-config"));
    }

    #[test]
    fn a_multi_node_set_holds_the_leader_worker_set_and_no_deployment() {
        let (obj, d) = multi_node();
        let set = OwnedSet::of(&obj, &d, None).unwrap();
        assert_eq!(
            kinds(&set),
            ["ServiceAccount", "RoleBinding", "LeaderWorkerSet", "Service"]
        );
        assert!(set.contains(&desired::leader_worker_set_resource(), "gemma"));
        assert!(!set.contains(&ApiResource::erase::<Deployment>(&()), "gemma"));
    }

    #[test]
    fn status_reads_the_deployment_else_the_leader_worker_sets_groups() {
        let (obj, d) = multi_node();
        let set = OwnedSet::of(&obj, &d, None).unwrap();
        let mut objects = set.objects().to_vec();
        for o in &mut objects {
            o.object.data["status"] = json!({"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1});
        }
        let w = workload(&objects)
            .unwrap()
            .expect("the LeaderWorkerSet as a workload");
        let st = w.status.unwrap();
        assert_eq!((st.replicas, st.ready_replicas), (Some(1), Some(1)));
        let (obj, d) = everything();
        let set = OwnedSet::of(&obj, &d, None).unwrap();
        let w = workload(set.objects()).unwrap().expect("the Deployment");
        assert_eq!(w.spec.unwrap().replicas, Some(2));
        assert!(workload(&[]).unwrap().is_none());
    }

    #[test]
    fn ownership_is_a_reference_to_this_uid() {
        let (obj, d) = everything();
        let cm = d.config_map.unwrap();
        assert!(is_owned_by(&cm, obj.metadata.uid.as_deref().unwrap()));
        assert!(!is_owned_by(&cm, "another-uid"));
        assert!(!is_owned_by(&cm, ""), "an empty uid owns nothing");
        assert_eq!(
            describe_owners(&ConfigMap::default()),
            "no owner reference: created outside kvfleet"
        );
    }
}
