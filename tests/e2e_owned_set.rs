//! End-to-end: one InferenceDeployment switches runtime and shape, and after each switch
//! every object labelled as kvfleet's for it is one the current spec wants: kvfleet -> vllm ->
//! kvfleet (the worker ConfigMap goes and comes back; the worker identity stays, vLLM's
//! capacity sidecar needs it), then one node -> a LeaderWorkerSet -> one node (the Deployment
//! and the LeaderWorkerSet replace each other), with a PodDisruptionBudget and a NetworkPolicy
//! that go when replicas drop to 1 and `network` is removed. An object with our labels that
//! kvfleet did not create survives every switch. At the end the object is deleted and the
//! controller's per-object metric series goes with it.
//!
//! Against a real control plane (`../shared/k8s`): `kvfleet controller` from this build runs on
//! the host under a ServiceAccount bound to a copy of the ClusterRole of
//! deploy/rbac/controller.yaml, so those verbs are what it gets. The LeaderWorkerSet CRD (the
//! schema fixture of tests/e2e_multinode.rs) is installed only before the LeaderWorkerSet step,
//! so the passes before it list a kind whose API is not served.
//!
//! Run: `eval "$(../shared/k8s/up)"; cargo test --test e2e_owned_set -- --ignored --nocapture`

mod e2e_support;

use std::collections::BTreeSet;
use std::process::Command;
use std::time::{Duration, Instant};

use e2e_support::{kubectl, kubectl_ok, kubectl_stdin, ok, wait_for, Namespace, Nodes, H100};
use kube::api::{Api, ApiResource, DeleteParams, Patch, PatchParams};
use kube::Client;
use kvfleet::api::InferenceDeployment;
use serde_json::{json, Value};

const NS: &str = "kvfleet-e2e-owned-set";
const NODES: [&str; 2] = ["kvfleet-e2e-owned-h100-0", "kvfleet-e2e-owned-h100-1"];
const NAME: &str = "switch";
/// The controller's ServiceAccount (in NS) and its cluster-scoped ClusterRole and binding.
const CONTROLLER: &str = "kvfleet-e2e-owned-set-controller";
const LWS_CRD: &str = "leaderworkersets.leaderworkerset.x-k8s.io";
/// A ConfigMap with kvfleet's labels for NAME that kvfleet did not create.
const DECOY: &str = "switch-notes";
const SELECTOR: &str = "app.kubernetes.io/managed-by=kvfleet,app.kubernetes.io/instance=switch";
const SWITCH: Duration = Duration::from_secs(60);

// === the steps ===

fn llama_8b() -> Value {
    json!({"name": "meta-llama/Llama-3.1-8B-Instruct",
           "geometry": {"layers": 32, "queryHeads": 32, "kvHeads": 8, "headDim": 128},
           "weights": {"format": "dummy"}})
}

fn llama_70b() -> Value {
    json!({"name": "meta-llama/Llama-3.1-70B-Instruct",
           "geometry": {"layers": 80, "queryHeads": 64, "kvHeads": 8, "headDim": 128},
           "weights": {"format": "dummy"}})
}

/// One spec of the sequence and the objects ("Kind name") it wants.
struct Step {
    what: &'static str,
    spec: Value,
    wants: &'static [&'static str],
}

fn spec(replicas: i32, model: Value, engine: Value) -> Value {
    json!({"replicas": replicas, "model": model, "engine": engine,
           "gpu": {"selector": {"products": [H100.product]}}})
}

fn steps() -> Vec<Step> {
    let mut first = spec(2, llama_8b(), json!({"runtime": "kvfleet", "maxModelLen": 8192}));
    first["network"] = json!({"allowFrom": [{"podSelector": {"matchLabels": {"app": "gateway"}}}]});
    vec![
        Step {
            what: "kvfleet, 2 replicas, network",
            spec: first,
            wants: &[
                "ConfigMap switch-config",
                "ServiceAccount switch-worker",
                "RoleBinding switch-worker",
                "NetworkPolicy switch-worker",
                "Deployment switch",
                "Service switch",
                "PodDisruptionBudget switch",
            ],
        },
        Step {
            what: "vllm, 1 replica, no network",
            spec: spec(1, llama_8b(), json!({"runtime": "vllm", "maxModelLen": 8192})),
            wants: &[
                "ServiceAccount switch-worker",
                "RoleBinding switch-worker",
                "Deployment switch",
                "Service switch",
            ],
        },
        Step {
            what: "kvfleet again",
            spec: spec(1, llama_8b(), json!({"runtime": "kvfleet", "maxModelLen": 8192})),
            wants: &[
                "ConfigMap switch-config",
                "ServiceAccount switch-worker",
                "RoleBinding switch-worker",
                "Deployment switch",
                "Service switch",
            ],
        },
        Step {
            what: "vllm, tensorParallelSize 16: a LeaderWorkerSet over two nodes",
            spec: spec(
                1,
                llama_70b(),
                json!({"runtime": "vllm", "tensorParallelSize": 16, "maxModelLen": 8192}),
            ),
            wants: &[
                "ServiceAccount switch-worker",
                "RoleBinding switch-worker",
                "LeaderWorkerSet switch",
                "Service switch",
            ],
        },
        Step {
            what: "vllm, tensorParallelSize 8: one node again",
            spec: spec(
                1,
                llama_70b(),
                json!({"runtime": "vllm", "tensorParallelSize": 8, "maxModelLen": 8192}),
            ),
            wants: &[
                "ServiceAccount switch-worker",
                "RoleBinding switch-worker",
                "Deployment switch",
                "Service switch",
            ],
        },
    ]
}

fn object(spec: &Value) -> InferenceDeployment {
    serde_json::from_value(json!({
        "apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": NAME, "namespace": NS, "uid": "00000000-0000-0000-0000-000000000033"},
        "spec": spec
    }))
    .expect("an InferenceDeployment")
}

/// Without a cluster: on two 8-GPU H100 nodes every step is admitted, and the objects the
/// controller renders for it are the ones the e2e expects.
#[test]
fn every_step_is_admitted_and_wants_what_the_e2e_expects() {
    let facts = kvfleet::validate::synthetic_cluster(&[H100.product, H100.product]).unwrap();
    for step in steps() {
        let obj = object(&step.spec);
        let verdict = kvfleet::validate::validate(&obj.spec, &facts);
        assert!(verdict.allowed(), "{}: {:#?}", step.what, verdict.denials);
        let d = kvfleet::controller::desired::desired(
            &obj,
            &verdict,
            &kvfleet::controller::desired::Settings::default(),
            None,
        )
        .unwrap();
        let set = kvfleet::controller::owned::OwnedSet::of(&obj, &d, None).unwrap();
        let rendered: BTreeSet<String> = set.objects().iter().map(|o| o.describe()).collect();
        let expected: BTreeSet<String> = step.wants.iter().map(|s| s.to_string()).collect();
        assert_eq!(rendered, expected, "{}", step.what);
    }
}

// === the cluster ===

/// Every kind the controller creates (monitors aside: no monitoring API here).
fn managed_kinds() -> Vec<ApiResource> {
    kvfleet::controller::owned::managed_kinds(None, Default::default())
}

/// Every object of a managed kind in NS labelled for NAME, with whether `uid` owns it.
async fn labelled(client: &Client, uid: &str) -> Result<BTreeSet<(String, bool)>, String> {
    e2e_support::labelled(client, NS, &managed_kinds(), SELECTOR, uid).await
}

/// Deletes the LeaderWorkerSet CRD on drop when this suite installed it.
struct LwsCrd {
    installed: bool,
}

impl Drop for LwsCrd {
    fn drop(&mut self) {
        if self.installed {
            let _ = kubectl(&["delete", "crd", LWS_CRD, "--ignore-not-found", "--wait=true"]);
        }
    }
}

fn preflight_series(port: u16) -> Result<bool, String> {
    let (code, body) = e2e_support::http_get(port, "/metrics").ok_or("no answer on /metrics")?;
    if code != 200 {
        return Err(format!("/metrics answered {code}"));
    }
    Ok(body.lines().any(|l| {
        l.starts_with("kvfleet_preflight_failures_total{")
            && l.contains(&format!("inferencedeployment=\"{NAME}\""))
            && l.contains(&format!("namespace=\"{NS}\""))
    }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Kubernetes cluster (KUBECONFIG): ../shared/k8s/up, as make test does"]
async fn e2e_owned_set_leaves_nothing_behind_across_runtime_and_shape_switches() {
    e2e_support::require_cluster("e2e_owned_set");
    let bin = env!("CARGO_BIN_EXE_kvfleet");
    let client = Client::try_default().await.expect("client from KUBECONFIG");
    let lws_present = !kubectl_ok(&["get", "crd", LWS_CRD, "--ignore-not-found", "-o", "name"])
        .trim()
        .is_empty();
    let mut lws_crd = LwsCrd { installed: false };

    let crd_created = e2e_support::install_crd(bin);

    let ns = Namespace::create(NS);
    let mut nodes = Nodes::default();
    for n in NODES {
        nodes.gpu(n, H100);
    }
    let identity = e2e_support::ControllerIdentity::create(CONTROLLER, NS);
    let scratch = std::env::temp_dir().join(format!("kvfleet-e2e-owned-set-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).expect("scratch dir");
    let port = e2e_support::free_port();
    let mut controller = e2e_support::Proc::spawn(
        "kvfleet controller",
        Command::new(bin)
            .env("KUBECONFIG", identity.kubeconfig(&scratch))
            .env("RUST_LOG", "info")
            .args([
                "controller",
                "--leader-elect=false",
                "--http-addr",
                &format!("127.0.0.1:{port}"),
            ]),
        scratch.join("controller.log"),
    );

    // Someone's notes, labelled as kvfleet's for this object: kvfleet did not create them.
    let decoy = json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": DECOY, "namespace": NS, "labels": {
            "app.kubernetes.io/managed-by": "kvfleet", "app.kubernetes.io/instance": NAME}},
        "data": {"note": "made by hand"}});
    ok(
        "the decoy ConfigMap",
        kubectl_stdin(&["apply", "-f", "-"], &decoy.to_string()),
    );

    let ids: Api<InferenceDeployment> = Api::namespaced(client.clone(), NS);
    let pp = PatchParams::apply("e2e-owned-set").force();
    let mut uid = String::new();
    for (i, step) in steps().into_iter().enumerate() {
        if step.wants.iter().any(|w| w.starts_with("LeaderWorkerSet")) && !lws_present {
            ok(
                "install the LeaderWorkerSet CRD fixture",
                kubectl(&[
                    "apply",
                    "--server-side",
                    "-f",
                    &format!(
                        "{}/tests/fixtures/lws/leaderworkersets.yaml",
                        env!("CARGO_MANIFEST_DIR")
                    ),
                ]),
            );
            lws_crd.installed = true;
            e2e_support::wait_established(LWS_CRD);
        }
        let body = json!({"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceDeployment",
                          "metadata": {"name": NAME}, "spec": step.spec});
        let applied = ids
            .patch(NAME, &pp, &Patch::Apply(&body))
            .await
            .unwrap_or_else(|e| panic!("step {i} ({}): apply: {e}", step.what));
        uid = applied.metadata.uid.clone().expect("uid");
        let generation = applied.metadata.generation;
        let started = Instant::now();
        let mut expected: BTreeSet<(String, bool)> =
            step.wants.iter().map(|w| (w.to_string(), true)).collect();
        expected.insert((format!("ConfigMap {DECOY}"), false));
        let mut last = BTreeSet::new();
        let deadline = Instant::now() + SWITCH;
        loop {
            let o = ids.get(NAME).await.expect("read the InferenceDeployment");
            let observed = o.status.as_ref().and_then(|s| s.observed_generation);
            let compatible = o.status.as_ref().and_then(|s| {
                s.conditions
                    .iter()
                    .find(|c| c.type_ == "Compatible")
                    .map(|c| (c.status.clone(), c.message.clone()))
            });
            if observed == generation {
                if let Some((status, message)) = &compatible {
                    assert_eq!(status, "True", "step {i} ({}): {message}", step.what);
                }
                last = labelled(&client, &uid).await.unwrap_or_else(|e| panic!("{e}"));
                if last == expected {
                    break;
                }
            }
            assert!(
                Instant::now() < deadline,
                "step {i} ({}): after {SWITCH:?} the objects labelled for {NAME} are\n{last:#?}\nnot\n{expected:#?}\n(observed generation {observed:?} of {generation:?})\ncontroller log:\n{}",
                step.what,
                controller.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        eprintln!(
            "step {i} ({}): nothing left behind {:.2} s after the apply: {:?}",
            step.what,
            started.elapsed().as_secs_f64(),
            step.wants
        );
    }

    // The object goes (no finalizer: at once): the controller's series for it goes too.
    assert!(
        preflight_series(port).unwrap_or(false),
        "the series is exported while the object exists"
    );
    ids.delete(NAME, &DeleteParams::background())
        .await
        .expect("delete the InferenceDeployment");
    let gone = Instant::now();
    wait_for(
        "the object's metric series to go",
        Duration::from_secs(90),
        || match preflight_series(port) {
            Ok(false) => Ok(()),
            Ok(true) => Err("still exported".into()),
            Err(e) => Err(e),
        },
    );
    eprintln!(
        "metric series gone {:.2} s after the delete",
        gone.elapsed().as_secs_f64()
    );
    // Garbage collection takes what was ours; the decoy stays.
    let left = wait_for(
        "garbage collection of the owned objects",
        Duration::from_secs(60),
        || {
            let rt = tokio::runtime::Handle::current();
            let left = tokio::task::block_in_place(|| rt.block_on(labelled(&client, &uid)))?;
            if left.iter().all(|(_, ours)| !ours) {
                Ok(left)
            } else {
                Err(format!("{left:?}"))
            }
        },
    );
    assert_eq!(left, BTreeSet::from([(format!("ConfigMap {DECOY}"), false)]));

    controller.kill();
    drop(identity);
    drop(ns);
    drop(nodes);
    drop(lws_crd);
    e2e_support::delete_crd_if_created(crd_created);
    let _ = std::fs::remove_dir_all(&scratch);
}
