//! End-to-end: `spec.autoscaling.engine: keda` (issue 31). One InferenceDeployment scaled by
//! KEDA gets the ScaledObject `<name>` on its workers' Deployment, accepted by the API server
//! against KEDA's real CRD (vendored under crds/vendor/keda, v2.20.2) with the expected
//! bounds, behaviour and Prometheus trigger, and the Deployment's replicas left to KEDA; then
//! switched to `engine: kvfleet`, the ScaledObject is swept and the rest stays.
//!
//! Against a real control plane (`../shared/k8s`): `kvfleet controller` from this build runs on
//! the host under a ServiceAccount bound to a copy of the ClusterRole of
//! deploy/rbac/controller.yaml, so the API server checks that those rules cover ScaledObjects.
//! The ScaledObject CRD is installed when the cluster lacks it (and deleted at the end only
//! then); where it was absent, the spec is first seen denied with the condition naming it.
//! KEDA itself does not run: the object is checked as stored, nothing scales.
//!
//! Run: `eval "$(../shared/k8s/up)"; cargo test --test e2e_keda -- --ignored --nocapture`

mod e2e_support;

use std::time::{Duration, Instant};

use e2e_support::{get_json, kubectl, kubectl_ok, ok, wait_for, Namespace, Nodes, H100};
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams};
use kube::Client;
use kvfleet::api::{scaled_object, InferenceDeployment};
use serde_json::{json, Value};

const NS: &str = "kvfleet-e2e-keda";
const NODE: &str = "kvfleet-e2e-keda-h100-0";
const NAME: &str = "scaled";
const CONTROLLER: &str = "kvfleet-e2e-keda-controller";
const KEDA_CRD_FILE: &str = "crds/vendor/keda/keda.sh_scaledobjects.yaml";
const PROMETHEUS: &str = "http://prometheus-operated.monitoring.svc:9090";
const STEP: Duration = Duration::from_secs(40);

fn spec(engine: &str) -> Value {
    json!({"replicas": 2,
           "model": {"name": "meta-llama/Llama-3.1-8B-Instruct",
                     "geometry": {"layers": 32, "queryHeads": 32, "kvHeads": 8, "headDim": 128},
                     "weights": {"format": "dummy"}},
           "engine": {"runtime": "kvfleet", "maxModelLen": 8192},
           "gpu": {"selector": {"products": [H100.product]}},
           "autoscaling": {"engine": engine, "minReplicas": 1, "maxReplicas": 5, "targetDemandRatio": 0.75,
                           "scaleUp": {"stabilizationWindowSeconds": 30,
                                       "policies": [{"type": "Pods", "value": 2, "periodSeconds": 60}]},
                           "scaleDown": {"stabilizationWindowSeconds": 240, "selectPolicy": "Min",
                                         "policies": [{"type": "Percent", "value": 50, "periodSeconds": 60}]}}})
}

fn keda_crd() -> Value {
    let path = format!("{}/{KEDA_CRD_FILE}", env!("CARGO_MANIFEST_DIR"));
    serde_yaml::from_str(&std::fs::read_to_string(&path).expect(KEDA_CRD_FILE)).expect("YAML")
}

fn rendered(engine: &str) -> Option<Value> {
    let obj: InferenceDeployment = serde_json::from_value(json!({
        "apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": NAME, "namespace": NS, "uid": "00000000-0000-0000-0000-000000000031"},
        "spec": spec(engine)
    }))
    .unwrap();
    let mut facts = kvfleet::validate::synthetic_cluster(&[H100.product]).unwrap();
    facts.scaled_object_served = Some(true);
    let verdict = kvfleet::validate::validate(&obj.spec, &facts);
    assert!(verdict.allowed(), "{engine}: {:#?}", verdict.denials);
    let settings = kvfleet::controller::desired::Settings {
        keda_prometheus_address: Some(PROMETHEUS.into()),
        ..Default::default()
    };
    let d = kvfleet::controller::desired::desired(&obj, &verdict, &settings, None).unwrap();
    d.scaled_object.map(|o| serde_json::to_value(o).unwrap())
}

/// Without a cluster: what the controller renders for the e2e's spec fits the vendored schema
/// (the checker catches what the schema forbids), and the CRD is the one the code names.
#[test]
fn the_rendered_scaled_object_fits_the_vendored_keda_schema() {
    let crd = keda_crd();
    assert_eq!(crd["metadata"]["name"], scaled_object::CRD);
    assert_eq!(crd["spec"]["group"], scaled_object::GROUP);
    assert_eq!(crd["spec"]["names"]["kind"], scaled_object::KIND);
    assert_eq!(crd["spec"]["names"]["plural"], scaled_object::PLURAL);
    let version = crd["spec"]["versions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == scaled_object::VERSION)
        .expect("v1alpha1 in the CRD");
    assert_eq!(version["served"], true);
    let schema = &version["schema"]["openAPIV3Schema"]["properties"]["spec"];
    let so = rendered("keda").expect("a ScaledObject for engine keda");
    assert_eq!(
        so["apiVersion"],
        format!("{}/{}", scaled_object::GROUP, scaled_object::VERSION)
    );
    let problems = e2e_support::schema_problems(&so["spec"], schema, "spec");
    assert!(problems.is_empty(), "{problems:#?}\n{so:#}");
    assert!(rendered("kvfleet").is_none());
    let mut bad = so["spec"].clone();
    bad["minReplicaCount"] = json!(-1);
    bad["triggers"][0]["metadata"]["threshold"] = json!(1);
    bad["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleUp"]["policies"][0]
        .as_object_mut()
        .unwrap()
        .remove("periodSeconds");
    assert_eq!(
        e2e_support::schema_problems(&bad, schema, "spec").len(),
        3,
        "{:#?}",
        e2e_support::schema_problems(&bad, schema, "spec")
    );
}

// === the cluster ===

/// Deletes the ScaledObject CRD on drop when this suite installed it.
struct KedaCrd {
    installed: bool,
}

impl KedaCrd {
    fn install(&mut self) {
        ok(
            "install the vendored ScaledObject CRD",
            kubectl(&[
                "apply",
                "--server-side",
                "-f",
                &format!("{}/{KEDA_CRD_FILE}", env!("CARGO_MANIFEST_DIR")),
            ]),
        );
        self.installed = true;
        e2e_support::wait_established(scaled_object::CRD);
    }
}

impl Drop for KedaCrd {
    fn drop(&mut self) {
        if self.installed {
            let _ = kubectl(&[
                "delete",
                "crd",
                scaled_object::CRD,
                "--ignore-not-found",
                "--wait=true",
            ]);
        }
    }
}

/// The Compatible condition's `(status, reason, message)` once status describes `generation`.
fn compatible(o: &InferenceDeployment, generation: Option<i64>) -> Option<(String, String, String)> {
    let st = o.status.as_ref()?;
    if st.observed_generation != generation {
        return None;
    }
    st.conditions
        .iter()
        .find(|c| c.type_ == "Compatible")
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

async fn apply(ids: &Api<InferenceDeployment>, engine: &str) -> Option<i64> {
    let body = json!({"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceDeployment",
                      "metadata": {"name": NAME}, "spec": spec(engine)});
    ids.patch(
        NAME,
        &PatchParams::apply("e2e-keda").force(),
        &Patch::Apply(&body),
    )
    .await
    .unwrap_or_else(|e| panic!("apply engine {engine}: {e}"))
    .metadata
    .generation
}

/// Polls `f` every 250 ms until it returns `Some`, failing after [`STEP`] with `log`.
async fn poll<T, F, Fut>(what: &str, log: &dyn Fn() -> String, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let started = Instant::now();
    loop {
        let last = match f().await {
            Ok(v) => {
                eprintln!("{what}: {:.2} s", started.elapsed().as_secs_f64());
                return v;
            }
            Err(e) => e,
        };
        assert!(
            started.elapsed() < STEP,
            "{what}: not after {STEP:?}: {last}\ncontroller log:\n{}",
            log()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Kubernetes control plane (KUBECONFIG): ../shared/k8s/up, as make test does"]
async fn e2e_keda_renders_a_scaled_object_the_api_server_accepts_and_sweeps_it_on_engine_kvfleet() {
    e2e_support::require_cluster("e2e_keda");
    let bin = env!("CARGO_BIN_EXE_kvfleet");
    let client = Client::try_default().await.expect("client from KUBECONFIG");
    let keda_present = get_json(&["crd", scaled_object::CRD]).is_some();
    let mut keda_crd = KedaCrd { installed: false };

    let crd_created = e2e_support::install_crd(bin);

    let ns = Namespace::create(NS);
    let mut nodes = Nodes::default();
    nodes.gpu(NODE, H100);
    let identity = e2e_support::ControllerIdentity::create(CONTROLLER, NS);
    let scratch = std::env::temp_dir().join(format!("kvfleet-e2e-keda-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).expect("scratch dir");
    let controller =
        identity.spawn_controller(bin, &scratch, "info", &["--keda-prometheus-address", PROMETHEUS]);
    let log = || controller.log_tail();
    let ids: Api<InferenceDeployment> = Api::namespaced(client.clone(), NS);
    let scaled: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        NS,
        &kvfleet::controller::desired::scaled_object_resource(),
    );

    // 1. Where the CRD is missing: denied with the condition that names it; then installed.
    if !keda_present {
        let generation = apply(&ids, "keda").await;
        let (status, reason, message) = poll("the missing-CRD condition", &log, || async {
            let o = ids.get(NAME).await.map_err(|e| e.to_string())?;
            compatible(&o, generation).ok_or_else(|| format!("{:?}", o.status))
        })
        .await;
        assert_eq!(
            (status.as_str(), reason.as_str()),
            ("False", "KedaScaledObjectCrdMissing"),
            "{message}"
        );
        assert!(message.contains(scaled_object::CRD), "{message}");
        eprintln!("engine keda without its CRD: Compatible=False {reason}: {message}");
        keda_crd.install();
        // Installing a CRD wakes no watch of the controller; a change of the object does.
        kubectl_ok(&[
            "annotate",
            "inferencedeployment",
            NAME,
            "-n",
            NS,
            "e2e.kvfleet.io/crd-installed=true",
        ]);
    }

    // 2. engine keda: the ScaledObject, as the API server stored it, owned by the
    //    InferenceDeployment and aimed at the workers' Deployment.
    let generation = apply(&ids, "keda").await;
    let so = poll("the ScaledObject", &log, || async {
        let o = ids.get(NAME).await.map_err(|e| e.to_string())?;
        match compatible(&o, generation) {
            Some((s, reason, message)) if s != "True" => {
                if reason == "KedaScaledObjectCrdMissing" {
                    return Err("the controller has not looked for the CRD again yet".into());
                }
                panic!("engine keda: Compatible={s} {reason}: {message}");
            }
            None => return Err("status not at this generation yet".into()),
            Some(_) => {}
        }
        scaled
            .get_opt(NAME)
            .await
            .map_err(|e| e.to_string())?
            .ok_or_else(|| "no ScaledObject yet".to_string())
    })
    .await;
    let uid = ids.get(NAME).await.unwrap().metadata.uid.expect("uid");
    let owner = &so.metadata.owner_references.as_ref().expect("owner references")[0];
    assert_eq!(
        (owner.kind.as_str(), owner.uid.as_str(), owner.controller),
        ("InferenceDeployment", uid.as_str(), Some(true))
    );
    let s = &so.data["spec"];
    assert_eq!(
        s["scaleTargetRef"],
        json!({"apiVersion": "apps/v1", "kind": "Deployment", "name": NAME})
    );
    assert_eq!(
        (s["minReplicaCount"].as_i64(), s["maxReplicaCount"].as_i64()),
        (Some(1), Some(5))
    );
    assert_eq!(s["cooldownPeriod"], 240);
    assert_eq!(
        s["advanced"]["horizontalPodAutoscalerConfig"]["behavior"],
        json!({"scaleUp": {"stabilizationWindowSeconds": 30,
                           "policies": [{"type": "Pods", "value": 2, "periodSeconds": 60}]},
               "scaleDown": {"stabilizationWindowSeconds": 240, "selectPolicy": "Min",
                             "policies": [{"type": "Percent", "value": 50, "periodSeconds": 60}]}})
    );
    let triggers = s["triggers"].as_array().expect("triggers");
    assert_eq!(triggers.len(), 1, "{triggers:?}");
    assert_eq!(triggers[0]["type"], "prometheus");
    assert_eq!(triggers[0]["metricType"], "AverageValue");
    assert_eq!(
        triggers[0]["metadata"],
        json!({"serverAddress": PROMETHEUS,
               "query": format!(r#"sum(kvfleet_kv_demand_tokens{{namespace="{NS}",inferencedeployment="{NAME}"}}) / (0.75 * avg(kvfleet_kv_capacity_tokens{{namespace="{NS}",inferencedeployment="{NAME}"}} > 0))"#),
               "threshold": "1", "activationThreshold": "0"})
    );
    // KEDA's HPA owns the count: the controller's apply does not hold spec.replicas.
    let dep =
        get_json(&["deployment", NAME, "-n", NS, "--show-managed-fields"]).expect("the workers' Deployment");
    let managed = dep["metadata"]["managedFields"]
        .as_array()
        .expect("managedFields");
    let ours = managed
        .iter()
        .find(|m| m["manager"] == kvfleet::controller::FIELD_MANAGER)
        .expect("the controller's apply");
    assert!(
        ours["fieldsV1"]["f:spec"].get("f:replicas").is_none(),
        "{}",
        ours["fieldsV1"]["f:spec"]
    );

    // 3. engine kvfleet: the sweep deletes the ScaledObject; the workers stay.
    let generation = apply(&ids, "kvfleet").await;
    poll("the ScaledObject swept", &log, || async {
        let o = ids.get(NAME).await.map_err(|e| e.to_string())?;
        if compatible(&o, generation).is_none() {
            return Err("status not at this generation yet".into());
        }
        match scaled.get_opt(NAME).await.map_err(|e| e.to_string())? {
            None => Ok(()),
            Some(so) if so.metadata.deletion_timestamp.is_some() => Ok(()),
            Some(_) => Err("the ScaledObject is still there".into()),
        }
    })
    .await;
    assert!(
        get_json(&["deployment", NAME, "-n", NS]).is_some(),
        "the workers' Deployment stays"
    );

    ids.delete(NAME, &DeleteParams::background())
        .await
        .expect("delete the InferenceDeployment");
    let rt = tokio::runtime::Handle::current();
    wait_for(
        "the InferenceDeployment gone",
        STEP,
        || match tokio::task::block_in_place(|| rt.block_on(ids.get_opt(NAME))) {
            Ok(None) => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );

    drop(controller);
    drop(identity);
    drop(ns);
    drop(nodes);
    drop(keda_crd);
    e2e_support::delete_crd_if_created(crd_created);
    let _ = std::fs::remove_dir_all(&scratch);
}
