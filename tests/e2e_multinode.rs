//! End-to-end: a replica that needs more GPUs than one node has (tensorParallelSize 16 on
//! 8-GPU H100 nodes) runs as a LeaderWorkerSet. Against a real control plane
//! (`../shared/k8s`): without the LeaderWorkerSet CRD the controller denies it (Compatible
//! False, a Warning Event naming the CRD and how to install it); once the CRD is installed
//! (tests/fixtures/lws, a schema of exactly what kvfleet renders, written by us) the API server
//! stores the LeaderWorkerSet the controller applies: 2 pods of 8 GPUs per replica, vLLM's
//! multi-node launch in their arguments, and no Deployment.
//!
//! Run: `eval "$(../shared/k8s/up)"; cargo test --test e2e_multinode -- --ignored --nocapture`

mod e2e_support;

use std::collections::BTreeSet;
use std::process::Command;
use std::time::{Duration, Instant};

use e2e_support::{Namespace, Nodes, H100};
use kube::api::{Api, PostParams};
use kube::Client;
use kvfleet::api::InferenceDeployment;
use serde_json::{json, Value};

const NS: &str = "kvfleet-e2e-multinode";
const NODES: [&str; 2] = ["kvfleet-e2e-mn-h100-0", "kvfleet-e2e-mn-h100-1"];
const NAME: &str = "tp16";
const LWS_CRD: &str = "leaderworkersets.leaderworkerset.x-k8s.io";

fn fixture_path() -> String {
    format!(
        "{}/tests/fixtures/lws/leaderworkersets.yaml",
        env!("CARGO_MANIFEST_DIR")
    )
}

fn tp16_spec() -> Value {
    json!({
        "replicas": 1,
        "model": {"name": "meta-llama/Llama-3.1-70B-Instruct",
                  "geometry": {"layers": 80, "queryHeads": 64, "kvHeads": 8, "headDim": 128},
                  "weights": {"format": "dummy"}},
        "engine": {"runtime": "vllm", "tensorParallelSize": 16, "maxModelLen": 8192},
        "gpu": {"selector": {"products": [H100.product]}}
    })
}

/// Deletes the LeaderWorkerSet CRD on drop when this suite installed it.
struct LwsCrd {
    installed: bool,
}
impl Drop for LwsCrd {
    fn drop(&mut self) {
        if self.installed {
            let _ = e2e_support::kubectl(&["delete", "crd", LWS_CRD, "--ignore-not-found", "--wait=true"]);
        }
    }
}

/// Every key of `value` is a property of `schema` (down to the objects whose unknown fields
/// are preserved), and every required key is there: the fixture accepts exactly this.
fn conforms(path: &str, value: &Value, schema: &Value, errors: &mut Vec<String>) {
    if schema["x-kubernetes-preserve-unknown-fields"] == true {
        for r in schema["required"].as_array().into_iter().flatten() {
            if value.get(r.as_str().unwrap()).is_none() {
                errors.push(format!("{path}.{} is required", r.as_str().unwrap()));
            }
        }
        return;
    }
    let Some(obj) = value.as_object() else {
        return;
    };
    let props = &schema["properties"];
    for r in schema["required"].as_array().into_iter().flatten() {
        if !obj.contains_key(r.as_str().unwrap()) {
            errors.push(format!("{path}.{} is required", r.as_str().unwrap()));
        }
    }
    for (k, v) in obj {
        match props.get(k) {
            Some(s) => conforms(&format!("{path}.{k}"), v, s, errors),
            None => errors.push(format!("{path}.{k} is not in the fixture's schema")),
        }
    }
}

/// Without a cluster: the LeaderWorkerSet the controller renders for the spec of the e2e test
/// has exactly the fields the fixture's schema declares (the API server would prune others).
#[test]
fn the_rendered_leader_worker_set_has_exactly_the_fields_of_the_fixture_schema() {
    let crd: Value = serde_yaml::from_str(&std::fs::read_to_string(fixture_path()).unwrap()).unwrap();
    let schema = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
    let obj: InferenceDeployment = serde_json::from_value(json!({
        "apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": NAME, "namespace": NS, "uid": "00000000-0000-0000-0000-000000000018"},
        "spec": tp16_spec()
    }))
    .unwrap();
    let facts = kvfleet::validate::synthetic_cluster(&[H100.product, H100.product]).unwrap();
    let verdict = kvfleet::validate::validate(&obj.spec, &facts);
    assert!(verdict.allowed(), "{verdict:#?}");
    let d = kvfleet::controller::desired::desired(
        &obj,
        &verdict,
        &kvfleet::controller::desired::Settings::default(),
        None,
    )
    .unwrap();
    let lws = serde_json::to_value(d.leader_worker_set.expect("a LeaderWorkerSet")).unwrap();
    let mut errors = Vec::new();
    let mut body = lws.clone();
    // metadata is the API server's own object, never pruned by a CRD schema.
    body.as_object_mut().unwrap().remove("status");
    body.as_object_mut().unwrap().remove("metadata");
    conforms("", &body, schema, &mut errors);
    assert!(errors.is_empty(), "{errors:#?}\n{lws:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Kubernetes cluster (KUBECONFIG): ../shared/k8s/up, as make test does"]
async fn e2e_multinode_tp16_on_8_gpu_nodes_is_denied_without_the_lws_crd_then_runs_as_a_leader_worker_set() {
    e2e_support::require_cluster("e2e_multinode");
    let bin = env!("CARGO_BIN_EXE_kvfleet");
    let client = Client::try_default().await.expect("client from KUBECONFIG");
    // The denial needs a cluster without LeaderWorkerSet; one this suite did not install is
    // never removed, so there the suite cannot show it and fails saying why.
    let present = e2e_support::kubectl(&["get", "crd", LWS_CRD, "--ignore-not-found", "-o", "name"]);
    assert!(
        String::from_utf8_lossy(&present.stdout).trim().is_empty(),
        "{LWS_CRD} is installed in this cluster and was not made by this suite: the denial without it cannot be shown here; run against ../shared/k8s"
    );
    let mut lws_crd = LwsCrd { installed: false };

    let crd_created = !e2e_support::crd_exists();
    let crd = Command::new(bin).arg("crd").output().expect("kvfleet crd");
    assert!(crd.status.success(), "kvfleet crd failed");
    e2e_support::ok(
        "apply CRD",
        e2e_support::kubectl_stdin(
            &["apply", "--server-side", "-f", "-"],
            &String::from_utf8_lossy(&crd.stdout),
        ),
    );
    e2e_support::wait_established("inferencedeployments.kvfleet.io");

    let ns = Namespace::create(NS);
    let mut nodes = Nodes::default();
    for n in NODES {
        nodes.gpu(n, H100);
    }
    let controller_log = std::env::temp_dir().join("kvfleet-e2e-multinode-controller.log");
    let mut controller = e2e_support::Proc::spawn(
        "kvfleet controller",
        Command::new(bin).args([
            "controller",
            "--leader-elect=false",
            "--http-addr",
            &format!("127.0.0.1:{}", e2e_support::free_port()),
        ]),
        controller_log,
    );

    let ids: Api<InferenceDeployment> = Api::namespaced(client.clone(), NS);
    let obj: InferenceDeployment = serde_json::from_value(json!({
        "apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": NAME}, "spec": tp16_spec()
    }))
    .unwrap();
    ids.create(&PostParams::default(), &obj)
        .await
        .expect("create InferenceDeployment");

    // 1. No LeaderWorkerSet CRD: denied, with the CRD and its install named.
    let started = Instant::now();
    let denied = e2e_support::wait_for(
        "Compatible=False for the missing CRD",
        Duration::from_secs(60),
        || {
            let o = e2e_support::get_json(&["inferencedeployment", NAME, "-n", NS]).ok_or("absent")?;
            let c = o["status"]["conditions"]
                .as_array()
                .and_then(|cs| cs.iter().find(|c| c["type"] == "Compatible").cloned())
                .ok_or_else(|| o["status"].to_string())?;
            if c["status"] == "False" && c["reason"] == "LeaderWorkerSetCrdMissing" {
                Ok(c)
            } else {
                Err(c.to_string())
            }
        },
    );
    let msg = denied["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("leaderworkersets.leaderworkerset.x-k8s.io/v1")
            && msg.contains("kubernetes-sigs/lws")
            && msg.contains("spans 2 nodes"),
        "{msg}\n{}",
        controller.log_tail()
    );
    eprintln!(
        "denied {:.1} s after create: {msg}",
        started.elapsed().as_secs_f64()
    );
    e2e_support::wait_for("the Warning Event", Duration::from_secs(30), || {
        let evs = e2e_support::get_json(&["events.events.k8s.io", "-n", NS]).ok_or("no events")?;
        evs["items"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|e| e["reason"] == "LeaderWorkerSetCrdMissing" && e["type"] == "Warning")
            .map(|_| ())
            .ok_or_else(|| "no LeaderWorkerSetCrdMissing event yet".to_string())
    });
    assert!(
        e2e_support::get_json(&["deployment", NAME, "-n", NS]).is_none(),
        "nothing is rendered for a denied spec"
    );

    // 2. The CRD arrives: the next pass (within 30 s) applies the LeaderWorkerSet.
    e2e_support::ok(
        "install the LeaderWorkerSet CRD fixture",
        e2e_support::kubectl(&["apply", "--server-side", "-f", &fixture_path()]),
    );
    lws_crd.installed = true;
    e2e_support::wait_established(LWS_CRD);
    let installed = Instant::now();
    let lws = e2e_support::wait_for("the LeaderWorkerSet", Duration::from_secs(90), || {
        e2e_support::get_json(&["leaderworkersets.leaderworkerset.x-k8s.io", NAME, "-n", NS])
            .ok_or_else(|| "not yet".to_string())
    });
    eprintln!(
        "LeaderWorkerSet stored {:.1} s after the CRD was installed",
        installed.elapsed().as_secs_f64()
    );
    let spec = &lws["spec"];
    assert_eq!(spec["replicas"], 1, "{lws:#}");
    assert_eq!(spec["leaderWorkerTemplate"]["size"], 2, "{lws:#}");
    assert_eq!(
        spec["leaderWorkerTemplate"]["restartPolicy"],
        "RecreateGroupOnPodRestart"
    );
    assert_eq!(
        lws["metadata"]["ownerReferences"][0]["kind"],
        "InferenceDeployment"
    );
    let args = |role: &str| -> Vec<String> {
        serde_json::from_value(spec["leaderWorkerTemplate"][role]["spec"]["containers"][0]["args"].clone())
            .unwrap()
    };
    let after = |a: &[String], flag: &str| a.iter().position(|x| x == flag).map(|i| a[i + 1].clone());
    let (leader, worker) = (args("leaderTemplate"), args("workerTemplate"));
    assert_eq!(after(&leader, "--tensor-parallel-size").as_deref(), Some("16"));
    assert_eq!(after(&leader, "--nnodes").as_deref(), Some("2"));
    assert_eq!(after(&leader, "--node-rank").as_deref(), Some("0"));
    assert!(worker.iter().any(|a| a == "--headless"), "{worker:?}");
    for role in ["leaderTemplate", "workerTemplate"] {
        assert_eq!(
            spec["leaderWorkerTemplate"][role]["spec"]["containers"][0]["resources"]["limits"]
                ["nvidia.com/gpu"],
            "8",
            "{role}"
        );
    }
    assert!(
        e2e_support::get_json(&["deployment", NAME, "-n", NS]).is_none(),
        "a replica that spans nodes has no Deployment"
    );
    let status = e2e_support::wait_for("Compatible=True", Duration::from_secs(30), || {
        let o = e2e_support::get_json(&["inferencedeployment", NAME, "-n", NS]).ok_or("absent")?;
        let ok = o["status"]["conditions"].as_array().is_some_and(|cs| {
            cs.iter()
                .any(|c| c["type"] == "Compatible" && c["status"] == "True")
        });
        if ok {
            Ok(o["status"].clone())
        } else {
            Err(o["status"].to_string())
        }
    });
    let resolved: BTreeSet<String> = status["resolved"]["products"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p.as_str().map(str::to_string))
        .collect();
    assert!(resolved.contains(H100.product), "{status:#}");

    // Clean up what this suite made: the object (its LeaderWorkerSet goes with it), the
    // namespace, the nodes, the fixture CRD and, if made here, kvfleet's CRD.
    kube::api::Api::<InferenceDeployment>::namespaced(client.clone(), NS)
        .delete(NAME, &kube::api::DeleteParams::foreground())
        .await
        .expect("delete");
    controller.kill();
    drop(ns);
    drop(nodes);
    drop(lws_crd);
    e2e_support::delete_crd_if_created(crd_created);
}
