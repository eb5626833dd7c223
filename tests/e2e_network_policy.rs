//! End-to-end (issue 22, item 7): the worker NetworkPolicy that `spec.network.allowFrom`
//! asks for, on the real API server (`../shared/k8s`, or any cluster KUBECONFIG points at,
//! with cluster-admin). No network plugin enforces policies there, so this checks what the
//! API server stored: its pod selector (the pods of the Deployment), its peers (the spec's and
//! the controller's metrics peers), the serving port, its owner, and that it goes away when
//! the field is removed and with the InferenceDeployment.
//!
//! Run: `eval "$(../shared/k8s/up)"; cargo test --test e2e_network_policy -- --ignored --nocapture`

mod e2e_support;

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use e2e_support::{Namespace, Nodes, L4};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::Client;
use kvfleet::api::InferenceDeployment;
use serde_json::json;

const NS: &str = "kvfleet-e2e-network-policy";
const NODE: &str = "kvfleet-e2e-network-policy-l4";
const NAME: &str = "guarded";
const POLICY: &str = "guarded-worker";

struct KillOnDrop(Child);
impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Kubernetes cluster (KUBECONFIG): ../shared/k8s/up, as make test does"]
async fn spec_network_becomes_a_worker_network_policy_that_goes_away_with_the_field_and_the_object() {
    e2e_support::require_cluster("e2e_network_policy");
    let bin = env!("CARGO_BIN_EXE_kvfleet");
    let client = Client::try_default().await.expect("client from KUBECONFIG");
    let crd_created = !e2e_support::crd_exists();
    let crd = Command::new(bin).arg("crd").output().expect("kvfleet crd");
    assert!(crd.status.success(), "kvfleet crd failed");
    e2e_support::ok(
        "kubectl apply the CRD",
        e2e_support::kubectl_stdin(
            &["apply", "--server-side", "-f", "-"],
            &String::from_utf8_lossy(&crd.stdout),
        ),
    );
    e2e_support::wait_established("inferencedeployments.kvfleet.io");
    let ns = Namespace::create(NS);
    let mut nodes = Nodes::default();
    nodes.gpu(NODE, L4);

    let metrics =
        json!([{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]);
    let _controller = KillOnDrop(
        Command::new(bin)
            .args([
                "controller",
                "--leader-elect=false",
                "--http-addr",
                &format!("127.0.0.1:{}", e2e_support::free_port()),
                "--worker-metrics-from",
                &metrics.to_string(),
            ])
            .spawn()
            .expect("start kvfleet controller"),
    );

    let allow_from = json!([
        {"podSelector": {"matchLabels": {"app": "gateway"}}},
        {"namespaceSelector": {"matchLabels": {"team": "search"}},
         "podSelector": {"matchExpressions": [{"key": "tier", "operator": "In", "values": ["frontend"]}]}},
        {"ipBlock": {"cidr": "10.8.0.0/16", "except": ["10.8.1.0/24"]}}
    ]);
    let ids: Api<InferenceDeployment> = Api::namespaced(client.clone(), NS);
    let obj: InferenceDeployment = serde_json::from_value(json!({
        "apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": NAME},
        "spec": {"replicas": 1,
                 "model": {"name": "e2e", "geometry": {"layers": 2, "queryHeads": 4, "kvHeads": 2, "headDim": 64}},
                 "engine": {"runtime": "kvfleet", "maxModelLen": 1024, "maxNumSeqs": 4, "maxNumBatchedTokens": 256},
                 "gpu": {"selector": {"products": [L4.product]}},
                 "network": {"allowFrom": allow_from}}
    }))
    .unwrap();
    let created = ids
        .create(&PostParams::default(), &obj)
        .await
        .expect("create InferenceDeployment");
    let uid = created.metadata.uid.clone().unwrap();

    let policies: Api<NetworkPolicy> = Api::namespaced(client.clone(), NS);
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
    let (policy, deployment) = eventually(
        "the worker NetworkPolicy and the Deployment",
        Duration::from_secs(60),
        || async {
            let p = policies.get_opt(POLICY).await.ok()??;
            let d = deployments.get_opt(NAME).await.ok()??;
            Some((p, d))
        },
    )
    .await;
    let owner = &policy.metadata.owner_references.clone().unwrap()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.uid.as_str()),
        ("InferenceDeployment", uid.as_str())
    );
    assert_eq!(owner.controller, Some(true));
    let stored = serde_json::to_value(policy.spec.unwrap()).unwrap();
    // It selects exactly the pods of the Deployment (the labels of its pod template).
    let template_labels = serde_json::to_value(
        deployment
            .spec
            .unwrap()
            .template
            .metadata
            .unwrap()
            .labels
            .unwrap(),
    )
    .unwrap();
    let selected = stored["podSelector"]["matchLabels"].as_object().unwrap();
    assert!(!selected.is_empty());
    for (k, v) in selected {
        assert_eq!(&template_labels[k], v, "pod template lacks {k}={v}");
    }
    assert_eq!(stored["policyTypes"], json!(["Ingress"]));
    let rules = stored["ingress"].as_array().unwrap();
    assert_eq!(rules.len(), 2, "{rules:?}");
    assert_eq!(rules[0]["from"], allow_from, "the spec's peers, as stored");
    assert_eq!(rules[1]["from"], metrics, "the controller's metrics peers");
    for r in rules {
        assert_eq!(r["ports"], json!([{"port": "http", "protocol": "TCP"}]));
    }

    // Without spec.network the controller removes its policy.
    ids.patch(
        NAME,
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"network": null}})),
    )
    .await
    .expect("remove spec.network");
    let asked = Instant::now();
    eventually(
        "the policy removed with spec.network",
        Duration::from_secs(60),
        || async { policies.get_opt(POLICY).await.ok()?.is_none().then_some(()) },
    )
    .await;
    eprintln!(
        "policy removed {:.1} s after spec.network was",
        asked.elapsed().as_secs_f64()
    );

    // An empty list: a policy with no rule for clients (only the metrics peers).
    ids.patch(
        NAME,
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"network": {"allowFrom": []}}})),
    )
    .await
    .expect("set an empty allowFrom");
    let rules = eventually(
        "the policy back, metrics peers only",
        Duration::from_secs(60),
        || async {
            let p = policies.get_opt(POLICY).await.ok()??;
            let spec = serde_json::to_value(p.spec?).ok()?;
            let rules = spec["ingress"].as_array()?.clone();
            (rules.len() == 1).then_some(rules)
        },
    )
    .await;
    assert_eq!(rules[0]["from"], metrics);

    // Garbage collection removes it with the InferenceDeployment.
    ids.delete(NAME, &DeleteParams::foreground())
        .await
        .expect("delete");
    eventually(
        "the policy garbage-collected",
        Duration::from_secs(120),
        || async {
            let p = policies.get_opt(POLICY).await.ok()?;
            let d = deployments.get_opt(NAME).await.ok()?;
            (p.is_none() && d.is_none()).then_some(())
        },
    )
    .await;
    drop(ns);
    drop(nodes);
    e2e_support::delete_crd_if_created(crd_created);
}
