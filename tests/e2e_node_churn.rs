//! End-to-end: node churn under a running pod, against a real control plane
//! (`../shared/k8s`). A B200 node (as GPU Feature Discovery labels one) runs the pod of an
//! nvfp4 deployment (vLLM, which needs compute capability 10.x for nvfp4): the real scheduler
//! binds it, the stand-in kubelet marks it Running. Then GFD relabels the node as an H100
//! (9.0). Within 60 s the status must not claim compatible nodes that are not there
//! (Compatible says `DeclaredProductsNoNodes`, not `CompatibleNodesFound` with "0 node(s)"),
//! and the pod on the mismatched node is named, with the fix, in the `PodsOnIncompatibleNodes`
//! condition, in `Degraded` (reason `PodsOnIncompatibleNodes`) and in a `PodOnIncompatibleNode`
//! Warning Event. Labelled a B200 again, the node runs the pod and `Degraded` is False again.
//!
//! Run: `eval "$(../shared/k8s/up)"; cargo test --test e2e_node_churn -- --ignored --nocapture`

mod e2e_support;

use std::process::Command;
use std::time::{Duration, Instant};

use e2e_support::{Namespace, Nodes, B200, H100};
use kube::api::{Api, DeleteParams, PostParams};
use kube::Client;
use kvfleet::api::InferenceDeployment;
use serde_json::{json, Value};

const NS: &str = "kvfleet-e2e-node-churn";
const NODE: &str = "kvfleet-e2e-churn-b200";
const NAME: &str = "nvfp4";

fn condition(o: &Value, type_: &str) -> Option<Value> {
    o["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
        .cloned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Kubernetes control plane (KUBECONFIG): ../shared/k8s/up, as make test does"]
async fn e2e_node_churn_a_b200_relabelled_as_an_h100_under_an_nvfp4_pod_is_reported_honestly() {
    e2e_support::require_cluster("e2e_node_churn");
    let bin = env!("CARGO_BIN_EXE_kvfleet");
    let client = Client::try_default().await.expect("client from KUBECONFIG");

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
    nodes.gpu(NODE, B200);
    let mut controller = e2e_support::Proc::spawn(
        "kvfleet controller",
        Command::new(bin).args([
            "controller",
            "--leader-elect=false",
            "--http-addr",
            &format!("127.0.0.1:{}", e2e_support::free_port()),
        ]),
        std::env::temp_dir().join("kvfleet-e2e-node-churn-controller.log"),
    );

    let ids: Api<InferenceDeployment> = Api::namespaced(client.clone(), NS);
    let obj: InferenceDeployment = serde_json::from_value(json!({
        "apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": NAME},
        "spec": {
            "replicas": 1,
            "model": {"name": "Qwen/Qwen3-8B",
                      "geometry": {"layers": 36, "queryHeads": 32, "kvHeads": 8, "headDim": 128},
                      "weights": {"format": "dummy"}},
            "engine": {"runtime": "vllm", "kvCacheDtype": "nvfp4", "maxModelLen": 8192},
            "gpu": {"selector": {"products": [B200.product]}}
        }
    }))
    .unwrap();
    ids.create(&PostParams::default(), &obj)
        .await
        .expect("create InferenceDeployment");

    // 1. On the B200: admitted on the node, and its pod bound there and Running.
    let admitted = e2e_support::wait_for(
        "Compatible=True on the B200 node",
        Duration::from_secs(60),
        || {
            let o = e2e_support::get_json(&["inferencedeployment", NAME, "-n", NS]).ok_or("absent")?;
            let c = condition(&o, "Compatible").ok_or_else(|| o["status"].to_string())?;
            if c["status"] == "True" && c["reason"] == "CompatibleNodesFound" {
                Ok(c)
            } else {
                Err(c.to_string())
            }
        },
    );
    assert!(
        admitted["message"]
            .as_str()
            .unwrap_or_default()
            .starts_with("1 node(s) can run it with kvCacheDtype nvfp4"),
        "{admitted}"
    );
    let pod = e2e_support::wait_for(
        "the worker pod Running on the B200 node",
        Duration::from_secs(60),
        || {
            let pods = e2e_support::get_json(&[
                "pods",
                "-n",
                NS,
                "-l",
                &format!("kvfleet.io/inference-deployment={NAME}"),
            ])
            .ok_or("no pods")?;
            pods["items"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|p| p["spec"]["nodeName"] == NODE && p["status"]["phase"] == "Running")
                .and_then(|p| p["metadata"]["name"].as_str().map(str::to_string))
                .ok_or_else(|| pods["items"].to_string())
        },
    );

    // 2. GFD relabels the node as an H100 under the running pod.
    nodes.gpu(NODE, H100);
    let relabelled = Instant::now();
    let status = e2e_support::wait_for(
        "status naming the pod on the relabelled node",
        Duration::from_secs(60),
        || {
            let o = e2e_support::get_json(&["inferencedeployment", NAME, "-n", NS]).ok_or("absent")?;
            let drift = condition(&o, "PodsOnIncompatibleNodes").ok_or_else(|| o["status"].to_string())?;
            if drift["status"] == "True" {
                Ok(o["status"].clone())
            } else {
                Err(drift.to_string())
            }
        },
    );
    eprintln!(
        "pod named {:.1} s after the relabel",
        relabelled.elapsed().as_secs_f64()
    );
    let conds = status["conditions"].as_array().unwrap();
    // No condition claims compatible nodes that are not there.
    for c in conds {
        let m = c["message"].as_str().unwrap_or_default();
        assert!(
            !(c["reason"] == "CompatibleNodesFound" || m.contains("0 node(s)")),
            "{c}\n{}",
            controller.log_tail()
        );
    }
    let compat = conds.iter().find(|c| c["type"] == "Compatible").unwrap();
    assert_eq!(compat["reason"], "DeclaredProductsNoNodes", "{compat}");
    assert!(
        compat["message"]
            .as_str()
            .unwrap()
            .starts_with("no node in the cluster can run it now; it is admitted on the GPU products its selector declares (NVIDIA-B200)"),
        "{compat}"
    );
    let drift = conds
        .iter()
        .find(|c| c["type"] == "PodsOnIncompatibleNodes")
        .unwrap();
    let msg = drift["message"].as_str().unwrap();
    assert_eq!(drift["reason"], "NodeNoLongerCompatible");
    assert!(
        msg.contains(&format!(
            "pod {pod} on node {NODE} (NVIDIA-H100-80GB-HBM3, compute capability 9.0)"
        )) && msg.contains("nvfp4")
            && msg.contains(&format!("kubectl delete pod {pod} -n {NS}")),
        "{msg}"
    );
    // The deployment is Degraded for it, with the same pod, node and fix (it was AsExpected).
    let degraded = conds.iter().find(|c| c["type"] == "Degraded").unwrap();
    assert_eq!(
        (&degraded["status"], &degraded["reason"]),
        (&json!("True"), &json!("PodsOnIncompatibleNodes")),
        "{degraded}"
    );
    assert_eq!(degraded["message"], drift["message"], "{degraded}");
    let event = e2e_support::wait_for("the PodOnIncompatibleNode Event", Duration::from_secs(30), || {
        let evs = e2e_support::get_json(&["events.events.k8s.io", "-n", NS]).ok_or("no events")?;
        evs["items"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|e| e["reason"] == "PodOnIncompatibleNode")
            .cloned()
            .ok_or_else(|| "no PodOnIncompatibleNode event yet".to_string())
    });
    assert_eq!(event["type"], "Warning", "{event}");
    assert_eq!(event["regarding"]["name"], NAME, "{event}");
    assert_eq!(event["related"]["kind"], "Pod", "{event}");
    assert_eq!(event["related"]["name"], pod.as_str(), "{event}");
    assert!(
        event["note"]
            .as_str()
            .unwrap_or_default()
            .starts_with(&format!("pod {pod} runs on node {NODE} (NVIDIA-H100-80GB-HBM3, compute capability 9.0), which can no longer run kvCacheDtype nvfp4")),
        "{event}"
    );

    // 3. GFD labels it a B200 again: the pod runs where it can, Degraded is False again.
    nodes.gpu(NODE, B200);
    let resolved = e2e_support::wait_for(
        "Degraded=False after the node is a B200 again",
        Duration::from_secs(60),
        || {
            let o = e2e_support::get_json(&["inferencedeployment", NAME, "-n", NS]).ok_or("absent")?;
            let d = condition(&o, "Degraded").ok_or_else(|| o["status"].to_string())?;
            let drift = condition(&o, "PodsOnIncompatibleNodes").ok_or_else(|| o["status"].to_string())?;
            if d["status"] == "False" && drift["status"] == "False" {
                Ok(d)
            } else {
                Err(format!("{d} {drift}"))
            }
        },
    );
    assert_ne!(resolved["reason"], "PodsOnIncompatibleNodes", "{resolved}");

    ids.delete(NAME, &DeleteParams::foreground())
        .await
        .expect("delete");
    controller.kill();
    drop(ns);
    drop(nodes);
    e2e_support::delete_crd_if_created(crd_created);
}
