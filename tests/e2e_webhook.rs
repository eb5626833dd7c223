//! End to end against a real cluster: applies the CRD and a ValidatingWebhookConfiguration
//! pointing at a webhook run by this test (self-managed certificates: it writes its
//! Secret and server-side-applies the caBundle itself), labels a node as an RTX PRO 6000
//! Blackwell (compute capability 12.0) with 4 GPUs, `kubectl apply`s the nvfp4 example
//! and checks kubectl's error message.
//!
//! Needs: KUBECONFIG (cluster-admin), kubectl on PATH (or KUBECTL), and
//! KVFLEET_E2E_WEBHOOK_HOST: an address of this machine the API server can reach (kind
//! on Linux: the gateway of the `kind` docker network, e.g. 172.18.0.1). Optional:
//! KVFLEET_E2E_WEBHOOK_PORT (default 9443), KVFLEET_E2E_NODE (default: the first node).
//! Run: `cargo test --test e2e_webhook -- --ignored --nocapture`.

use std::net::SocketAddr;
use std::process::{Command, Output};
use std::time::Duration;

use axum_server::tls_rustls::RustlsConfig;
use axum_server::Handle;
use k8s_openapi::api::core::v1::Node;
use kube::{Api, Client};
use kvfleet::webhook::certs::{Lifetimes, SelfManaged};
use kvfleet::webhook::metrics::Metrics;
use kvfleet::webhook::server::{self, AppState};
use kvfleet::webhook::{cache, tls};

const NAMESPACE: &str = "kvfleet-e2e";
const CONFIGURATION: &str = "kvfleet-e2e-webhook";

fn kubectl(args: &[&str]) -> Output {
    let bin = std::env::var("KUBECTL").unwrap_or_else(|_| "kubectl".into());
    Command::new(&bin)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {bin}: {e}; install kubectl or set KUBECTL"))
}

fn kubectl_ok(args: &[&str]) -> String {
    let out = kubectl(args);
    assert!(
        out.status.success(),
        "kubectl {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn kubectl_stdin(args: &[&str], input: &str) -> Output {
    use std::io::Write;
    let bin = std::env::var("KUBECTL").unwrap_or_else(|_| "kubectl".into());
    let mut child = Command::new(&bin)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("kubectl");
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    child.wait_with_output().unwrap()
}

/// The nvfp4-on-sm_120 example: `deploy/examples/*nvfp4*` when one exists, else the
/// object of our admission fixture.
fn nvfp4_example() -> String {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    if let Ok(entries) = std::fs::read_dir(root.join("deploy/examples")) {
        let mut found: Vec<_> = entries
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| {
                let name = p.file_name().unwrap().to_string_lossy().to_lowercase();
                name.contains("nvfp4") && !name.contains("b200")
            })
            .collect();
        found.sort();
        if let Some(path) = found.first() {
            // The test applies into its own namespace: drop the example's.
            let mut doc: serde_yaml::Value =
                serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
            if let Some(meta) = doc
                .get_mut("metadata")
                .and_then(serde_yaml::Value::as_mapping_mut)
            {
                meta.remove("namespace");
            }
            return serde_yaml::to_string(&doc).unwrap();
        }
    }
    let fixture: serde_json::Value = serde_json::from_slice(
        &std::fs::read(root.join("tests/fixtures/admission/create-nvfp4-vllm.json")).unwrap(),
    )
    .unwrap();
    let object = &fixture["request"]["object"];
    serde_json::to_string_pretty(&serde_json::json!({
        "apiVersion": object["apiVersion"], "kind": object["kind"],
        "metadata": {"name": object["metadata"]["name"]},
        "spec": object["spec"],
    }))
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Kubernetes cluster (KUBECONFIG) and KVFLEET_E2E_WEBHOOK_HOST"]
async fn kubectl_apply_of_nvfp4_on_an_rtx_pro_6000_node_is_rejected_with_the_fix() {
    if std::env::var_os("KUBECONFIG").is_none() {
        println!("skipped: KUBECONFIG not set");
        return;
    }
    let host = std::env::var("KVFLEET_E2E_WEBHOOK_HOST").expect(
        "KVFLEET_E2E_WEBHOOK_HOST: an address of this machine the API server can reach \
         (kind on Linux: `docker network inspect kind -f '{{(index .IPAM.Config 0).Gateway}}'`)",
    );
    let port: u16 = std::env::var("KVFLEET_E2E_WEBHOOK_PORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(9443);
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    let client = Client::try_default().await.expect("a client from KUBECONFIG");

    // The CRD, the namespace and the webhook configuration.
    let crd = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/crds/inferencedeployments.kvfleet.io.yaml"
    );
    kubectl_ok(&["apply", "--server-side", "-f", crd]);
    kubectl_ok(&[
        "wait",
        "--for=condition=Established",
        "crd/inferencedeployments.kvfleet.io",
        "--timeout=60s",
    ]);
    let _ = kubectl(&["create", "namespace", NAMESPACE]);
    let configuration = format!(
        r#"{{"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
  "metadata": {{"name": "{CONFIGURATION}"}},
  "webhooks": [{{"name": "validate.inferencedeployments.kvfleet.io",
    "admissionReviewVersions": ["v1"], "sideEffects": "None", "failurePolicy": "Fail",
    "matchPolicy": "Equivalent", "timeoutSeconds": 10,
    "clientConfig": {{"url": "https://{host}:{port}/validate"}},
    "namespaceSelector": {{"matchLabels": {{"kubernetes.io/metadata.name": "{NAMESPACE}"}}}},
    "rules": [{{"apiGroups": ["kvfleet.io"], "apiVersions": ["v1alpha1"],
      "operations": ["CREATE", "UPDATE"], "resources": ["inferencedeployments"], "scope": "Namespaced"}}]}}]}}"#
    );
    let out = kubectl_stdin(&["apply", "-f", "-"], &configuration);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    // Label a node as an RTX PRO 6000 Blackwell with 4 GPUs.
    let node = match std::env::var("KVFLEET_E2E_NODE") {
        Ok(node) => node,
        Err(_) => kubectl_ok(&["get", "nodes", "-o", "jsonpath={.items[0].metadata.name}"]),
    };
    kubectl_ok(&[
        "label",
        "node",
        &node,
        "--overwrite",
        "nvidia.com/gpu.present=true",
        "nvidia.com/gpu.product=NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition",
        "nvidia.com/gpu.compute.major=12",
        "nvidia.com/gpu.compute.minor=0",
        "nvidia.com/gpu.count=4",
        "nvidia.com/gpu.memory=97887",
    ]);
    kubectl_ok(&[
        "patch",
        "node",
        &node,
        "--subresource=status",
        "--type=json",
        "-p",
        r#"[{"op":"add","path":"/status/capacity/nvidia.com~1gpu","value":"4"},
            {"op":"add","path":"/status/allocatable/nvidia.com~1gpu","value":"4"}]"#,
    ]);

    // The webhook, in this process: self-managed certificate for `host`, node cache
    // from the cluster.
    let manager = SelfManaged {
        client: client.clone(),
        namespace: NAMESPACE.into(),
        secret_name: "kvfleet-e2e-webhook-tls".into(),
        names: vec![host.clone()],
        webhook_configuration: Some(CONFIGURATION.into()),
        lifetimes: Lifetimes {
            ca: Duration::from_secs(86400),
            serving: Duration::from_secs(3600),
        },
    };
    let material = manager
        .ensure(time::OffsetDateTime::now_utc())
        .await
        .expect("certificates");
    assert!(manager.apply_ca_bundle(&material.ca_bundle()).await.is_ok());
    let (node_cache, writer) = cache::node_cache();
    tokio::spawn(writer.run(
        Api::<Node>::all(client.clone()),
        Some("nvidia.com/gpu.present=true".into()),
    ));
    let state = AppState::new(node_cache.clone(), Metrics::new().unwrap());
    let rustls = RustlsConfig::from_config(
        tls::server_config(
            material.serving.cert_pem.as_bytes(),
            material.serving.key_pem.as_bytes(),
        )
        .unwrap(),
    );
    let listener = std::net::TcpListener::bind(SocketAddr::from(([0, 0, 0, 0], port))).expect("webhook port");
    let handle = Handle::new();
    tokio::spawn(server::serve_https(listener, state, rustls, handle.clone()));
    for _ in 0..100 {
        let facts = node_cache.facts();
        if node_cache.synced()
            && facts
                .nodes
                .iter()
                .any(|n| n.name == node && n.allocatable_gpus == Some(4))
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(node_cache.synced(), "the node cache did not sync in 10 s");

    // The API server reads the caBundle within a moment; kubectl must be refused.
    let example = nvfp4_example();
    let mut stderr = String::new();
    for _ in 0..20 {
        let out = kubectl_stdin(&["apply", "-n", NAMESPACE, "-f", "-"], &example);
        stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(
            !out.status.success(),
            "kubectl apply was admitted: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        if stderr.contains("denied the request") {
            break;
        }
        // "failed calling webhook" while the caBundle propagates.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    println!("kubectl said: {stderr}");

    // Clean up before asserting, so a failure leaves the cluster as it was.
    handle.shutdown();
    let _ = kubectl(&[
        "delete",
        "validatingwebhookconfiguration",
        CONFIGURATION,
        "--ignore-not-found",
    ]);
    let _ = kubectl(&[
        "delete",
        "namespace",
        NAMESPACE,
        "--ignore-not-found",
        "--wait=false",
    ]);
    let _ = kubectl(&[
        "label",
        "node",
        &node,
        "nvidia.com/gpu.present-",
        "nvidia.com/gpu.product-",
        "nvidia.com/gpu.compute.major-",
        "nvidia.com/gpu.compute.minor-",
        "nvidia.com/gpu.count-",
        "nvidia.com/gpu.memory-",
    ]);
    let _ = kubectl(&[
        "patch",
        "node",
        &node,
        "--subresource=status",
        "--type=json",
        "-p",
        r#"[{"op":"remove","path":"/status/capacity/nvidia.com~1gpu"},
            {"op":"remove","path":"/status/allocatable/nvidia.com~1gpu"}]"#,
    ]);

    assert!(
        stderr.contains(r#"admission webhook "validate.inferencedeployments.kvfleet.io" denied the request"#),
        "{stderr}"
    );
    assert!(stderr.contains("spec.engine.kvCacheDtype"), "{stderr}");
    assert!(stderr.contains("nvfp4") && stderr.contains("fp8"), "{stderr}");
}
