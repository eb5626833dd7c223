//! End-to-end, on the real control plane (../shared/k8s, or any cluster KUBECONFIG points at,
//! with cluster-admin): what a kvfleet worker's token may do. The worker's RBAC
//! (`deploy/rbac/worker.yaml`: get and patch pods, namespace-wide, because RBAC cannot name a
//! pod that does not exist yet) is narrowed by the ValidatingAdmissionPolicy of the same file to
//! one change: the `kvfleet.io/measured-kv-tokens` annotation of the pod its token is bound to.
//!
//! Creates its own namespace, ServiceAccounts, RoleBinding and pods; applies the cluster-wide
//! ClusterRole and policy only when absent and then deletes them again. Fails without
//! KUBECONFIG.

mod e2e_support;

use std::time::Duration;

use e2e_support::{kubectl, kubectl_ok, kubectl_stdin, text, Namespace};

const NS: &str = "kvfleet-e2e-identity";
const ANNOTATION: &str = "kvfleet.io/measured-kv-tokens";

/// A pod that meets the restricted Pod Security Standard (the namespace enforces it). It never
/// runs: it is not bound to a node, and only its identity matters here.
fn pod(name: &str, service_account: &str) -> String {
    format!(
        r#"{{"apiVersion": "v1", "kind": "Pod",
  "metadata": {{"name": "{name}", "namespace": "{NS}", "labels": {{"app": "e2e"}}}},
  "spec": {{"serviceAccountName": "{service_account}",
    "securityContext": {{"runAsNonRoot": true, "runAsUser": 65532, "seccompProfile": {{"type": "RuntimeDefault"}}}},
    "containers": [{{"name": "c", "image": "kvfleet:0",
      "securityContext": {{"allowPrivilegeEscalation": false, "capabilities": {{"drop": ["ALL"]}}}}}}]}}}}"#
    )
}

/// The cluster-wide objects of deploy/rbac/worker.yaml that were absent and applied here.
struct ClusterObjects(Vec<(&'static str, &'static str)>);

impl Drop for ClusterObjects {
    fn drop(&mut self) {
        for (kind, name) in &self.0 {
            let _ = kubectl(&["delete", kind, name, "--ignore-not-found"]);
        }
    }
}

fn patch_as(kubeconfig: &std::path::Path, pod: &str, patch: &str) -> Result<(), String> {
    let out = std::process::Command::new(e2e_support::kubectl_bin())
        .args(["patch", "pod", pod, "-n", NS, "--type=merge", "-p", patch])
        .env("KUBECONFIG", kubeconfig)
        .output()
        .expect("kubectl");
    let (stdout, stderr) = text(&out);
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("{stderr}{stdout}"))
    }
}

#[test]
#[ignore = "needs a Kubernetes cluster (KUBECONFIG): ../shared/k8s/up, as make test does"]
fn a_worker_token_changes_only_its_own_pods_capacity_annotation() {
    e2e_support::require_cluster("e2e_worker_identity");
    let dir = std::env::temp_dir().join(format!("kvfleet-e2e-identity-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();

    // The ClusterRole, the policy and its binding, as the chart and deploy/rbac install them.
    let objects = [
        ("clusterrole", "kvfleet-worker"),
        ("validatingadmissionpolicy", "kvfleet-worker-own-pod"),
        ("validatingadmissionpolicybinding", "kvfleet-worker-own-pod"),
    ];
    let absent: Vec<_> = objects
        .iter()
        .copied()
        .filter(|(kind, name)| e2e_support::get_json(&[kind, name]).is_none())
        .collect();
    let _cluster = ClusterObjects(absent.clone());
    let file =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/rbac/worker.yaml")).unwrap();
    for doc in serde_yaml::Deserializer::from_str(&file) {
        use serde::Deserialize;
        let doc = serde_json::to_value(serde_yaml::Value::deserialize(doc).unwrap()).unwrap();
        let kind = doc["kind"].as_str().unwrap().to_ascii_lowercase();
        let name = doc["metadata"]["name"].as_str().unwrap();
        if absent.iter().any(|(k, n)| *k == kind && *n == name) {
            e2e_support::ok(
                &format!("apply {kind}/{name}"),
                kubectl_stdin(
                    &[
                        "apply",
                        "--server-side",
                        "--field-manager=kvfleet-e2e-identity",
                        "-f",
                        "-",
                    ],
                    &doc.to_string(),
                ),
            );
        }
    }

    let ns = Namespace::create(NS);
    kubectl_ok(&[
        "label",
        "namespace",
        NS,
        "pod-security.kubernetes.io/enforce=restricted",
        "pod-security.kubernetes.io/enforce-version=latest",
    ]);
    for sa in ["llm-worker", "other"] {
        kubectl_ok(&["create", "serviceaccount", sa, "-n", NS]);
    }
    // What the controller renders for a kvfleet InferenceDeployment: a RoleBinding of its
    // worker account to the kvfleet-worker ClusterRole.
    kubectl_ok(&[
        "create",
        "rolebinding",
        "llm-worker",
        "-n",
        NS,
        "--clusterrole=kvfleet-worker",
        "--serviceaccount",
        &format!("{NS}:llm-worker"),
    ]);
    for (name, sa) in [
        ("llm-0", "llm-worker"),
        ("llm-1", "llm-worker"),
        ("bystander", "other"),
    ] {
        e2e_support::ok(
            &format!("create pod {name}"),
            kubectl_stdin(&["create", "-f", "-"], &pod(name, sa)),
        );
    }
    let uid = kubectl_ok(&["get", "pod", "llm-0", "-n", NS, "-o", "jsonpath={.metadata.uid}"]);
    // The token a kubelet gives pod llm-0: bound to it, carrying its name.
    let token = kubectl_ok(&[
        "create",
        "token",
        "llm-worker",
        "-n",
        NS,
        "--bound-object-kind=Pod",
        "--bound-object-name=llm-0",
        &format!("--bound-object-uid={uid}"),
        "--duration=1h",
    ]);
    let worker = e2e_support::token_kubeconfig("llm-worker", token.trim(), &dir);

    // Policies take effect once the API server has loaded them (it watches them).
    let own = format!(r#"{{"metadata": {{"annotations": {{"{ANNOTATION}": "921888"}}}}}}"#);
    let other_pod = e2e_support::wait_for("the policy in force", Duration::from_secs(60), || {
        match patch_as(&worker, "bystander", &own) {
            Err(e) if e.contains("kvfleet-worker-own-pod") => Ok(e),
            Err(e) => Err(format!("refused, but not by the policy: {e}")),
            Ok(()) => {
                // Allowed before the policy was loaded: undo and retry.
                let _ = kubectl(&[
                    "annotate",
                    "pod",
                    "bystander",
                    "-n",
                    NS,
                    &format!("{ANNOTATION}-"),
                ]);
                Err("the worker annotated another pod".into())
            }
        }
    });
    assert!(
        other_pod.contains("may change only its own pod (llm-0), not bystander"),
        "{other_pod}"
    );

    // Its own pod's annotation: allowed, and what the controller reads.
    patch_as(&worker, "llm-0", &own).expect("a worker annotates its own pod");
    let seen = kubectl_ok(&[
        "get",
        "pod",
        "llm-0",
        "-n",
        NS,
        "-o",
        "jsonpath={.metadata.annotations.kvfleet\\.io/measured-kv-tokens}",
    ]);
    assert_eq!(seen, "921888");

    // A sibling replica of the same deployment and account: refused too.
    let sibling = patch_as(&worker, "llm-1", &own).expect_err("a worker annotated its sibling");
    assert!(sibling.contains("not llm-1"), "{sibling}");
    // Anything else on its own pod: a label, another annotation.
    let label = patch_as(&worker, "llm-0", r#"{"metadata": {"labels": {"app": "mine"}}}"#)
        .expect_err("a worker relabelled its pod (it could leave its Service)");
    assert!(
        label.contains("only the kvfleet.io/measured-kv-tokens annotation"),
        "{label}"
    );
    let annotation = patch_as(
        &worker,
        "llm-0",
        r#"{"metadata": {"annotations": {"prometheus.io/scrape": "false"}}}"#,
    )
    .expect_err("a worker set another annotation");
    assert!(
        annotation.contains("only the kvfleet.io/measured-kv-tokens annotation"),
        "{annotation}"
    );
    // RBAC still bounds the rest: no deleting, no reading Secrets.
    let delete = std::process::Command::new(e2e_support::kubectl_bin())
        .args(["delete", "pod", "llm-1", "-n", NS, "--wait=false"])
        .env("KUBECONFIG", &worker)
        .output()
        .unwrap();
    assert!(!delete.status.success(), "a worker deleted a pod");
    // The administrator (no pod-bound token) is not affected by the policy.
    kubectl_ok(&["label", "pod", "llm-0", "-n", NS, "app=relabelled", "--overwrite"]);

    drop(ns);
    let _ = std::fs::remove_dir_all(&dir);
}
