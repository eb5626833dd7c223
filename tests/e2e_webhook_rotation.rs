//! End to end against a real control plane (`../shared/k8s`): the webhook's self-managed
//! certificates rotate while `kubectl apply` keeps calling it, and no admission fails. The
//! lifetimes are shrunk to seconds (serving certificate 6 s, CA 15 s; each renewed when a
//! third is left), so that 40 s of traffic crosses several serving rotations and at least one
//! CA rotation; the refresh loop runs every second, as in production every minute.
//!
//! The webhook runs in this process, reached through an ExternalName Service to 127.0.0.1
//! (../shared/k8s/README.md), as in tests/e2e_webhook.rs.

mod e2e_support;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum_server::tls_rustls::RustlsConfig;
use axum_server::Handle;
use e2e_support::{kubectl, kubectl_ok, kubectl_stdin, Namespace, Nodes, RTX_PRO_6000};
use k8s_openapi::api::core::v1::{Node, Secret};
use kube::{Api, Client};
use kvfleet::webhook::certs::{Lifetimes, SelfManaged, Served};
use kvfleet::webhook::metrics::Metrics;
use kvfleet::webhook::server::{self, AppState};
use kvfleet::webhook::{cache, tls};

const NAMESPACE: &str = "kvfleet-e2e-rotation";
const CONFIGURATION: &str = "kvfleet-e2e-rotation";
const SERVICE: &str = "kvfleet-e2e-rotation";
const SECRET: &str = "kvfleet-e2e-rotation-tls";
const NODE: &str = "kvfleet-e2e-rotation-rtxpro";

/// An InferenceDeployment the webhook denies (nvfp4 KV on sm_120): every answer is the
/// webhook's own, so a TLS failure cannot pass for a denial.
const DENIED: &str = r#"{"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceDeployment",
  "metadata": {"name": "rotation"},
  "spec": {"replicas": 1,
    "model": {"name": "e2e", "geometry": {"layers": 2, "queryHeads": 4, "kvHeads": 2, "headDim": 64},
              "weights": {"format": "dummy"}},
    "engine": {"runtime": "vllm", "kvCacheDtype": "nvfp4", "maxModelLen": 1024, "maxNumSeqs": 4, "maxNumBatchedTokens": 256},
    "gpu": {"selector": {"products": ["NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition"]}}}}"#;

/// What the webhook's denial of [`DENIED`] says (kubectl prints it as the object being invalid).
const WEBHOOK_SAYS: &str = "kvCacheDtype nvfp4 needs compute capability";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Kubernetes cluster (KUBECONFIG): ../shared/k8s/up, as make test does"]
async fn certificates_rotate_under_traffic_without_a_failed_admission() {
    e2e_support::require_cluster("e2e_webhook_rotation");
    let port = e2e_support::free_port();
    let client = Client::try_default().await.expect("a client from KUBECONFIG");

    let crd_created = e2e_support::crd_settled().is_none();
    let crd = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/crds/inferencedeployments.kvfleet.io.yaml"
    );
    kubectl_ok(&[
        "apply",
        "--server-side",
        "--field-manager=kvfleet-e2e-rotation",
        "-f",
        crd,
    ]);
    e2e_support::wait_established("inferencedeployments.kvfleet.io");
    let ns = Namespace::create(NAMESPACE);
    e2e_support::route_webhook_to_host(NAMESPACE, SERVICE, CONFIGURATION, port);
    let mut nodes = Nodes::default();
    nodes.gpu(NODE, RTX_PRO_6000);

    // The webhook as `kvfleet webhook` runs it: the first certificate once its CA is
    // published, then the refresh loop.
    let manager = Arc::new(SelfManaged {
        client: client.clone(),
        namespace: NAMESPACE.into(),
        secret_name: SECRET.into(),
        names: vec![
            SERVICE.to_string(),
            format!("{SERVICE}.{NAMESPACE}"),
            format!("{SERVICE}.{NAMESPACE}.svc"),
        ],
        webhook_configuration: Some(CONFIGURATION.into()),
        lifetimes: Lifetimes {
            ca: Duration::from_secs(15),
            serving: Duration::from_secs(6),
        },
    });
    let material = manager
        .published_material(Duration::from_secs(2))
        .await
        .expect("certificates");
    let metrics = Metrics::new().unwrap();
    let rustls = RustlsConfig::from_config(
        tls::server_config(
            material.serving.cert_pem.as_bytes(),
            material.serving.key_pem.as_bytes(),
        )
        .unwrap(),
    );
    let refresher = tokio::spawn(manager.clone().run(
        rustls.clone(),
        metrics.clone(),
        Duration::from_secs(1),
        Served::published(&material),
    ));
    let (node_cache, writer) = cache::node_cache();
    tokio::spawn(writer.run(
        Api::<Node>::all(client.clone()),
        Some("nvidia.com/gpu.present=true".into()),
    ));
    let state = AppState::new(node_cache.clone(), metrics);
    let listener =
        std::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], port))).expect("webhook port");
    let handle = Handle::new();
    tokio::spawn(server::serve_https(listener, state, rustls, handle.clone()));
    let start = Instant::now();
    while !node_cache.facts().nodes.iter().any(|n| n.name == NODE) {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the node cache did not see {NODE}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The first admission may wait for the API server to read the caBundle.
    e2e_support::wait_for("the first admission", Duration::from_secs(20), || {
        let out = kubectl_stdin(&["apply", "--dry-run=server", "-n", NAMESPACE, "-f", "-"], DENIED);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        if stderr.contains(WEBHOOK_SAYS) {
            Ok(())
        } else {
            Err(stderr)
        }
    });

    // 40 s of admissions, one after the other, while the certificates rotate underneath.
    let secrets = Api::<Secret>::namespaced(client.clone(), NAMESPACE);
    let (mut served, mut cas) = (BTreeSet::new(), BTreeSet::new());
    let (mut admissions, mut failures) = (0, Vec::new());
    let traffic = Instant::now();
    while traffic.elapsed() < Duration::from_secs(40) {
        let out = tokio::task::spawn_blocking(|| {
            kubectl_stdin(&["apply", "--dry-run=server", "-n", NAMESPACE, "-f", "-"], DENIED)
        })
        .await
        .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        admissions += 1;
        if !stderr.contains(WEBHOOK_SAYS) {
            failures.push(format!("{:.1} s: {stderr}", traffic.elapsed().as_secs_f64()));
        }
        if let Ok(s) = secrets.get(SECRET).await {
            let data = s.data.unwrap_or_default();
            if let Some(c) = data.get("tls.crt") {
                served.insert(c.0.clone());
            }
            if let Some(c) = data.get("ca.crt") {
                cas.insert(c.0.clone());
            }
        }
    }
    println!(
        "{admissions} admissions in 40 s, {} failed; {} serving certificates, {} CAs seen",
        failures.len(),
        served.len(),
        cas.len()
    );

    refresher.abort();
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

    assert!(
        failures.is_empty(),
        "admissions failed during rotation:\n{}",
        failures.join("\n")
    );
    assert!(admissions >= 40, "only {admissions} admissions in 40 s");
    assert!(
        served.len() >= 4,
        "{} serving certificates: rotation did not happen",
        served.len()
    );
    assert!(cas.len() >= 2, "{} CAs: the CA did not rotate", cas.len());
}
