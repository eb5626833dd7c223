//! End-to-end: one InferenceDeployment switches routing mode, and after each switch every
//! object labelled as kvfleet's for it is one the current mode wants (issue 30):
//! `kvfleet` (the router's Deployment, PodDisruptionBudget, ServiceAccount, Role, RoleBinding
//! and NetworkPolicy, the headless Service `<name>-workers` whose EndpointSlices list the
//! workers on ports `http` and `kv-events`, and the Service `<name>` selecting the router) ->
//! `inferencePool` (the InferencePool selecting the workers; every router object gone) ->
//! `service` (neither left) -> deleted (nothing of ours left).
//!
//! Against a real control plane (`../shared/k8s`): `kvfleet controller` from this build runs on
//! the host under a ServiceAccount bound to a copy of the ClusterRole of
//! deploy/rbac/controller.yaml, so the API server checks that those rules let it create the
//! router's Role. The Gateway API Inference Extension CRD (vendored under
//! crds/vendor/gateway-api-inference-extension) is installed before the inferencePool step
//! when the cluster lacks it, and deleted at the end only then; where it was absent, the
//! inferencePool spec is first seen denied with the condition that names the missing CRD.
//!
//! Run: `eval "$(../shared/k8s/up)"; cargo test --test e2e_routing -- --ignored --nocapture`

mod e2e_support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use e2e_support::{get_json, kubectl, kubectl_ok, ok, wait_for, Namespace, Nodes, H100};
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, Patch, PatchParams};
use kube::Client;
use kvfleet::api::InferenceDeployment;
use serde_json::{json, Value};

const NS: &str = "kvfleet-e2e-routing";
const NODE: &str = "kvfleet-e2e-routing-h100-0";
const NAME: &str = "routed";
/// The controller's ServiceAccount (in NS) and its cluster-scoped ClusterRole and binding.
const CONTROLLER: &str = "kvfleet-e2e-routing-controller";
const POOL_CRD: &str = "inferencepools.inference.networking.k8s.io";
const POOL_CRD_FILE: &str =
    "crds/vendor/gateway-api-inference-extension/inference.networking.k8s.io_inferencepools.yaml";
const SELECTOR: &str = "app.kubernetes.io/managed-by=kvfleet,app.kubernetes.io/instance=routed";
const SWITCH: Duration = Duration::from_secs(60);

// === the steps ===

fn spec(routing: Value) -> Value {
    json!({"replicas": 2,
           "model": {"name": "meta-llama/Llama-3.1-8B-Instruct",
                     "geometry": {"layers": 32, "queryHeads": 32, "kvHeads": 8, "headDim": 128},
                     "weights": {"format": "dummy"}},
           "engine": {"runtime": "kvfleet", "maxModelLen": 8192},
           "gpu": {"selector": {"products": [H100.product]}},
           "network": {"allowFrom": [{"podSelector": {"matchLabels": {"app": "gateway"}}}]},
           "routing": routing})
}

fn kvfleet_routing() -> Value {
    spec(json!({"mode": "kvfleet"}))
}

fn pool_routing() -> Value {
    spec(json!({"mode": "inferencePool", "endpointPicker": {"name": "routed-epp", "port": 9002}}))
}

fn service_routing() -> Value {
    spec(json!({"mode": "service"}))
}

/// What every mode wants: the workers, their config, identity, policy, PDB and Service.
const WORKERS: [&str; 7] = [
    "ConfigMap routed-config",
    "ServiceAccount routed-worker",
    "RoleBinding routed-worker",
    "NetworkPolicy routed-worker",
    "Deployment routed",
    "Service routed",
    "PodDisruptionBudget routed",
];

const ROUTER: [&str; 8] = [
    "ServiceAccount routed-router",
    "Role routed-router",
    "RoleBinding routed-router",
    "NetworkPolicy routed-router",
    "Deployment routed-router",
    "PodDisruptionBudget routed-router",
    "Service routed-workers",
    "Service routed",
];

fn wants(mode: &str) -> BTreeSet<String> {
    let mut w: BTreeSet<String> = WORKERS.iter().map(|s| s.to_string()).collect();
    match mode {
        "kvfleet" => w.extend(ROUTER.iter().map(|s| s.to_string())),
        "inferencePool" => {
            w.insert("InferencePool routed".into());
        }
        _ => {}
    }
    w
}

fn object(spec: &Value) -> InferenceDeployment {
    serde_json::from_value(json!({
        "apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": NAME, "namespace": NS, "uid": "00000000-0000-0000-0000-000000000030"},
        "spec": spec
    }))
    .expect("an InferenceDeployment")
}

/// Without a cluster: on one 8-GPU H100 node every step is admitted (the pool where the CRD
/// is served), and the objects the controller renders for it are the ones the e2e expects.
#[test]
fn every_step_is_admitted_and_wants_what_the_e2e_expects() {
    let mut facts = kvfleet::validate::synthetic_cluster(&[H100.product]).unwrap();
    facts.inference_pool_served = Some(true);
    for (mode, spec) in [
        ("kvfleet", kvfleet_routing()),
        ("inferencePool", pool_routing()),
        ("service", service_routing()),
    ] {
        let obj = object(&spec);
        let verdict = kvfleet::validate::validate(&obj.spec, &facts);
        assert!(verdict.allowed(), "{mode}: {:#?}", verdict.denials);
        let d = kvfleet::controller::desired::desired(
            &obj,
            &verdict,
            &kvfleet::controller::desired::Settings::default(),
            None,
        )
        .unwrap();
        let set = kvfleet::controller::owned::OwnedSet::of(&obj, &d, None).unwrap();
        let rendered: BTreeSet<String> = set.objects().iter().map(|o| o.describe()).collect();
        assert_eq!(rendered, wants(mode), "{mode}");
    }
}

// === the InferencePool against the vendored schema ===

fn pool_crd() -> Value {
    let path = format!("{}/{POOL_CRD_FILE}", env!("CARGO_MANIFEST_DIR"));
    serde_yaml::from_str(&std::fs::read_to_string(&path).expect(POOL_CRD_FILE)).expect("YAML")
}

#[test]
fn the_rendered_inference_pool_fits_the_vendored_v1_schema() {
    use kvfleet::api::inference_pool;
    let crd = pool_crd();
    assert_eq!(crd["metadata"]["name"], inference_pool::CRD);
    assert_eq!(
        crd["metadata"]["annotations"]["inference.networking.k8s.io/bundle-version"],
        inference_pool::RELEASE
    );
    assert_eq!(crd["spec"]["group"], inference_pool::GROUP);
    assert_eq!(crd["spec"]["names"]["kind"], inference_pool::KIND);
    assert_eq!(crd["spec"]["names"]["plural"], inference_pool::PLURAL);
    let version = crd["spec"]["versions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == inference_pool::VERSION)
        .expect("v1 in the CRD");
    assert_eq!(version["served"], true);
    let schema = &version["schema"]["openAPIV3Schema"]["properties"]["spec"];

    let mut facts = kvfleet::validate::synthetic_cluster(&[H100.product]).unwrap();
    facts.inference_pool_served = Some(true);
    let mut specs = vec![pool_routing()];
    let mut full = pool_routing();
    full["routing"]["endpointPicker"] =
        json!({"name": "epp", "port": 9002, "kind": "Service", "group": "", "failureMode": "FailOpen"});
    specs.push(full);
    for s in specs {
        let obj = object(&s);
        let verdict = kvfleet::validate::validate(&obj.spec, &facts);
        let d = kvfleet::controller::desired::desired(
            &obj,
            &verdict,
            &kvfleet::controller::desired::Settings::default(),
            None,
        )
        .unwrap();
        let pool = serde_json::to_value(d.inference_pool.expect("an InferencePool")).unwrap();
        assert_eq!(
            pool["apiVersion"],
            format!("{}/{}", inference_pool::GROUP, inference_pool::VERSION)
        );
        let problems = e2e_support::schema_problems(&pool["spec"], schema, "spec");
        assert!(problems.is_empty(), "{problems:#?}\n{pool:#}");
    }
    // The checker does catch what the schema forbids.
    let bad = json!({"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 0}],
                     "endpointPickerRef": {"name": "e", "failureMode": "Sometimes", "extra": 1}});
    assert_eq!(e2e_support::schema_problems(&bad, schema, "spec").len(), 3);
}

// === the cluster ===

/// Every object of a managed kind in NS labelled for NAME, with whether `uid` owns it.
async fn labelled(client: &Client, uid: &str) -> Result<BTreeSet<(String, bool)>, String> {
    e2e_support::labelled(
        client,
        NS,
        &kvfleet::controller::owned::managed_kinds(
            None,
            kvfleet::controller::owned::Served {
                inference_pool: true,
                ..Default::default()
            },
        ),
        SELECTOR,
        uid,
    )
    .await
}

/// Deletes the InferencePool CRD on drop when this suite installed it.
struct PoolCrd {
    installed: bool,
}

impl PoolCrd {
    fn install(&mut self) {
        ok(
            "install the vendored InferencePool CRD",
            kubectl(&[
                "apply",
                "--server-side",
                "-f",
                &format!("{}/{POOL_CRD_FILE}", env!("CARGO_MANIFEST_DIR")),
            ]),
        );
        self.installed = true;
        e2e_support::wait_established(POOL_CRD);
    }
}

impl Drop for PoolCrd {
    fn drop(&mut self) {
        if self.installed {
            let _ = kubectl(&["delete", "crd", POOL_CRD, "--ignore-not-found", "--wait=true"]);
        }
    }
}

/// The `(status, reason, message)` of the condition `type_` once status describes `generation`.
fn condition(
    o: &InferenceDeployment,
    type_: &str,
    generation: Option<i64>,
) -> Option<(String, String, String)> {
    let st = o.status.as_ref()?;
    if st.observed_generation != generation {
        return None;
    }
    st.conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

/// Applies `spec` and waits until the objects labelled for NAME are exactly `want`, all ours.
async fn switch(
    client: &Client,
    ids: &Api<InferenceDeployment>,
    what: &str,
    spec: Value,
    want: &BTreeSet<String>,
    log: &dyn Fn() -> String,
) -> String {
    let body = json!({"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceDeployment",
                      "metadata": {"name": NAME}, "spec": spec});
    let applied = ids
        .patch(
            NAME,
            &PatchParams::apply("e2e-routing").force(),
            &Patch::Apply(&body),
        )
        .await
        .unwrap_or_else(|e| panic!("{what}: apply: {e}"));
    let uid = applied.metadata.uid.clone().expect("uid");
    let generation = applied.metadata.generation;
    let expected: BTreeSet<(String, bool)> = want.iter().map(|w| (w.clone(), true)).collect();
    let started = Instant::now();
    let mut last = BTreeSet::new();
    loop {
        let o = ids.get(NAME).await.expect("read the InferenceDeployment");
        match condition(&o, "Compatible", generation) {
            // Just installed: the controller has not looked for the CRD again yet.
            Some((status, reason, _)) if status == "False" && reason == "InferencePoolCrdMissing" => {}
            Some((status, _, message)) => {
                assert_eq!(status, "True", "{what}: {message}");
                last = labelled(client, &uid).await.unwrap_or_else(|e| panic!("{e}"));
                if last == expected {
                    break;
                }
            }
            None => {}
        }
        assert!(
            started.elapsed() < SWITCH,
            "{what}: after {SWITCH:?} the objects labelled for {NAME} are\n{last:#?}\nnot\n{expected:#?}\ncontroller log:\n{}",
            log()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    eprintln!(
        "{what}: exactly the wanted objects {:.2} s after the apply",
        started.elapsed().as_secs_f64()
    );
    uid
}

fn selector_of(service: &str) -> Value {
    get_json(&["service", service, "-n", NS]).expect(service)["spec"]["selector"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Kubernetes cluster (KUBECONFIG): ../shared/k8s/up, as make test does"]
async fn e2e_routing_switches_kvfleet_inference_pool_service_and_leaves_nothing_behind() {
    e2e_support::require_cluster("e2e_routing");
    let bin = env!("CARGO_BIN_EXE_kvfleet");
    let client = Client::try_default().await.expect("client from KUBECONFIG");
    let pool_present = !kubectl_ok(&["get", "crd", POOL_CRD, "--ignore-not-found", "-o", "name"])
        .trim()
        .is_empty();
    let mut pool_crd = PoolCrd { installed: false };

    let crd_created = e2e_support::install_crd(bin);

    let ns = Namespace::create(NS);
    let mut nodes = Nodes::default();
    nodes.gpu(NODE, H100);
    let identity = e2e_support::ControllerIdentity::create(CONTROLLER, NS);
    let scratch = std::env::temp_dir().join(format!("kvfleet-e2e-routing-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).expect("scratch dir");
    let controller = identity.spawn_controller(bin, &scratch, "info", &[]);
    let log = || controller.log_tail();
    let ids: Api<InferenceDeployment> = Api::namespaced(client.clone(), NS);

    // 1. kvfleet: the router and everything it needs, accepted by the API server under the
    //    controller's own RBAC (its Role is one the controller may grant).
    switch(
        &client,
        &ids,
        "mode kvfleet",
        kvfleet_routing(),
        &wants("kvfleet"),
        &log,
    )
    .await;
    assert_eq!(selector_of(NAME), json!({"kvfleet.io/router": NAME}));
    let workers = get_json(&["service", "routed-workers", "-n", NS]).unwrap();
    assert_eq!(workers["spec"]["clusterIP"], "None");
    assert_eq!(
        workers["spec"]["selector"],
        json!({"kvfleet.io/inference-deployment": NAME})
    );
    let role = get_json(&["role", "routed-router", "-n", NS]).unwrap();
    assert_eq!(
        role["rules"],
        json!([{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
               {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}])
    );
    // The router's pods run (on the stand-in) and the workers' EndpointSlices carry what the
    // router reads: two ready workers on the ports named http and kv-events.
    let slices = wait_for("the workers' EndpointSlices", SWITCH, || {
        let router = get_json(&["deployment", "routed-router", "-n", NS]).ok_or("no router")?;
        if router["status"]["readyReplicas"] != 2 {
            return Err(format!("router status {}", router["status"]));
        }
        let list = get_json(&[
            "endpointslices",
            "-n",
            NS,
            "-l",
            "kubernetes.io/service-name=routed-workers",
        ])
        .ok_or("no list")?;
        let items = list["items"].as_array().cloned().unwrap_or_default();
        let ready = items
            .iter()
            .flat_map(|s| s["endpoints"].as_array().cloned().unwrap_or_default())
            .filter(|e| e["conditions"]["ready"] == true)
            .count();
        if ready == 2 {
            Ok(items)
        } else {
            Err(format!("{ready} ready endpoints in {items:?}"))
        }
    });
    let mut ports: Vec<(String, i64)> = slices[0]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap().to_string(),
                p["port"].as_i64().unwrap(),
            )
        })
        .collect();
    ports.sort();
    assert_eq!(
        ports,
        [("http".to_string(), 8000), ("kv-events".to_string(), 5557)]
    );

    // 2. inferencePool: where the CRD is missing, denied with the condition that names it and
    //    nothing touched; then installed, the pool replaces the router.
    if !pool_present {
        let body = json!({"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceDeployment",
                          "metadata": {"name": NAME}, "spec": pool_routing()});
        let applied = ids
            .patch(
                NAME,
                &PatchParams::apply("e2e-routing").force(),
                &Patch::Apply(&body),
            )
            .await
            .expect("apply mode inferencePool");
        let generation = applied.metadata.generation;
        let rt = tokio::runtime::Handle::current();
        let (_, reason, message) = wait_for("the missing-CRD condition", SWITCH, || {
            let o = tokio::task::block_in_place(|| rt.block_on(ids.get(NAME))).map_err(|e| e.to_string())?;
            condition(&o, "Compatible", generation).ok_or_else(|| format!("{:?}", o.status))
        });
        assert_eq!(reason, "InferencePoolCrdMissing", "{message}\n{}", log());
        assert!(message.contains(POOL_CRD), "{message}");
        eprintln!("mode inferencePool without its CRD: Compatible=False {reason}: {message}");
        pool_crd.install();
        // Installing a CRD wakes no watch of the controller, which looks again every 30 s;
        // a change of the object wakes it now.
        kubectl_ok(&[
            "annotate",
            "inferencedeployment",
            NAME,
            "-n",
            NS,
            "e2e.kvfleet.io/crd-installed=true",
        ]);
    }
    switch(
        &client,
        &ids,
        "mode inferencePool",
        pool_routing(),
        &wants("inferencePool"),
        &log,
    )
    .await;
    let pool_api: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        NS,
        &kvfleet::controller::desired::inference_pool_resource(),
    );
    let pool = pool_api.get(NAME).await.expect("the InferencePool");
    assert_eq!(
        pool.data["spec"]["selector"]["matchLabels"],
        json!({"kvfleet.io/inference-deployment": NAME})
    );
    assert_eq!(pool.data["spec"]["targetPorts"], json!([{"number": 8000}]));
    assert_eq!(pool.data["spec"]["endpointPickerRef"]["name"], "routed-epp");
    assert_eq!(
        pool.data["spec"]["endpointPickerRef"]["port"],
        json!({"number": 9002})
    );
    assert_eq!(
        selector_of(NAME),
        json!({"kvfleet.io/inference-deployment": NAME})
    );

    // 3. service: neither the router nor the pool is left.
    let uid = switch(
        &client,
        &ids,
        "mode service",
        service_routing(),
        &wants("service"),
        &log,
    )
    .await;

    // 4. delete: garbage collection takes everything of ours.
    ids.delete(NAME, &DeleteParams::background())
        .await
        .expect("delete the InferenceDeployment");
    let rt = tokio::runtime::Handle::current();
    wait_for("garbage collection of the owned objects", SWITCH, || {
        let left = tokio::task::block_in_place(|| rt.block_on(labelled(&client, &uid)))?;
        if left.is_empty() {
            Ok(())
        } else {
            Err(format!("{left:?}"))
        }
    });
    let kinds: Vec<ApiResource> = kvfleet::controller::owned::managed_kinds(
        None,
        kvfleet::controller::owned::Served {
            inference_pool: true,
            ..Default::default()
        },
    );
    eprintln!(
        "deleted: none of {} kinds holds an object labelled for {NAME}",
        kinds.len()
    );

    drop(controller);
    drop(identity);
    drop(ns);
    drop(nodes);
    drop(pool_crd);
    e2e_support::delete_crd_if_created(crd_created);
    let _ = std::fs::remove_dir_all(&scratch);
}
