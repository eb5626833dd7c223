//! End to end against a real control plane (`../shared/k8s`, or any cluster KUBECONFIG points
//! at, with cluster-admin): applies the CRD and a ValidatingWebhookConfiguration pointing at a
//! webhook run by this test on the host (self-managed certificates: it writes its Secret and
//! server-side-applies the caBundle itself), reached through an ExternalName Service to
//! 127.0.0.1 as ../shared/k8s/README.md explains; creates its own GPU node (an RTX PRO 6000
//! Blackwell, compute capability 12.0, 4 GPUs), `kubectl apply`s the nvfp4 example and
//! checks kubectl's error message.
//!
//! Run: `eval "$(../shared/k8s/up)"; cargo test --test e2e_webhook -- --ignored --nocapture`.

mod e2e_support;

use std::net::SocketAddr;
use std::time::Duration;

use axum_server::tls_rustls::RustlsConfig;
use axum_server::Handle;
use e2e_support::{kubectl, kubectl_ok, kubectl_stdin, Namespace, Nodes, RTX_PRO_6000};
use k8s_openapi::api::core::v1::Node;
use kube::{Api, Client};
use kvfleet::webhook::certs::{Lifetimes, SelfManaged};
use kvfleet::webhook::metrics::Metrics;
use kvfleet::webhook::server::{self, AppState};
use kvfleet::webhook::{cache, tls};

const NAMESPACE: &str = "kvfleet-e2e-webhook";
const CONFIGURATION: &str = "kvfleet-e2e-webhook";
const SERVICE: &str = "kvfleet-e2e-webhook";
const NODE: &str = "kvfleet-e2e-webhook-rtxpro";

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
#[ignore = "needs a Kubernetes cluster (KUBECONFIG): ../shared/k8s/up, as make test does"]
async fn kubectl_apply_of_nvfp4_on_an_rtx_pro_6000_node_is_rejected_with_the_fix() {
    e2e_support::require_cluster("e2e_webhook");
    let port = e2e_support::free_port();
    let client = Client::try_default().await.expect("a client from KUBECONFIG");

    // The CRD, the namespace, the ExternalName Service and the webhook configuration.
    let crd_created = !e2e_support::crd_exists();
    let crd = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/crds/inferencedeployments.kvfleet.io.yaml"
    );
    kubectl_ok(&["apply", "--server-side", "-f", crd]);
    e2e_support::wait_established("inferencedeployments.kvfleet.io");
    let ns = Namespace::create(NAMESPACE);
    e2e_support::route_webhook_to_host(NAMESPACE, SERVICE, CONFIGURATION, port);

    // Our own RTX PRO 6000 Blackwell node with 4 GPUs.
    let mut nodes = Nodes::default();
    nodes.gpu(NODE, RTX_PRO_6000);

    // The webhook, in this process: self-managed certificate for the Service's DNS name
    // (the API server dials 127.0.0.1 with that TLS server name), node cache from the cluster.
    let manager = SelfManaged {
        client: client.clone(),
        namespace: NAMESPACE.into(),
        secret_name: "kvfleet-e2e-webhook-tls".into(),
        names: vec![
            SERVICE.to_string(),
            format!("{SERVICE}.{NAMESPACE}"),
            format!("{SERVICE}.{NAMESPACE}.svc"),
        ],
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
    let listener =
        std::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], port))).expect("webhook port");
    let handle = Handle::new();
    tokio::spawn(server::serve_https(listener, state, rustls, handle.clone()));
    for _ in 0..100 {
        let facts = node_cache.facts();
        if node_cache.synced()
            && facts
                .nodes
                .iter()
                .any(|n| n.name == NODE && n.allocatable_gpus == Some(4))
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
        if !stderr.contains("failed calling webhook") {
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
    drop(ns);
    drop(nodes);
    e2e_support::delete_crd_if_created(crd_created);

    // kubectl names the object, the field, the reason and the fix.
    assert!(
        stderr.contains(r#"The InferenceDeployment "qwen3-32b-nvfp4-rtxpro" is invalid"#),
        "{stderr}"
    );
    assert!(stderr.contains("spec.engine.kvCacheDtype"), "{stderr}");
    assert!(
        stderr.contains("kvCacheDtype nvfp4 needs compute capability 10.0 or 10.3")
            && stderr.contains("use fp8"),
        "{stderr}"
    );
}
