//! Shared by tests/webhook_admission.rs and bench/webhook.rs: GPU nodes, fixtures, a
//! webhook started on loopback with a self-made CA, and a small HTTPS client.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use axum_server::tls_rustls::RustlsConfig;
use axum_server::Handle;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::{Node, NodeSpec, NodeStatus};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::runtime::watcher;
use kvfleet::webhook::cache::{node_cache, NodeCache, NodeCacheWriter};
use kvfleet::webhook::metrics::Metrics;
use kvfleet::webhook::server::{self, AppState};
use kvfleet::webhook::tls::{self, CertificateAuthority, CertifiedKey};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use time::OffsetDateTime;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

/// A node as GPU Feature Discovery labels it.
pub fn gpu_node(name: &str, product: &str, major: u32, minor: u32, gpus: i64) -> Node {
    let labels = BTreeMap::from([
        ("kubernetes.io/hostname".to_string(), name.to_string()),
        ("nvidia.com/gpu.present".to_string(), "true".to_string()),
        ("nvidia.com/gpu.product".to_string(), product.to_string()),
        ("nvidia.com/gpu.compute.major".to_string(), major.to_string()),
        ("nvidia.com/gpu.compute.minor".to_string(), minor.to_string()),
        ("nvidia.com/gpu.count".to_string(), gpus.to_string()),
    ]);
    Node {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            labels: Some(labels),
            resource_version: Some("1".to_string()),
            ..ObjectMeta::default()
        },
        spec: Some(NodeSpec::default()),
        status: Some(NodeStatus {
            allocatable: Some(BTreeMap::from([
                ("cpu".to_string(), Quantity("64".to_string())),
                ("nvidia.com/gpu".to_string(), Quantity(gpus.to_string())),
            ])),
            ..NodeStatus::default()
        }),
    }
}

pub const RTX_PRO_6000: &str = "NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition";
pub const B200: &str = "NVIDIA-B200";
pub const RTX_3090: &str = "NVIDIA-GeForce-RTX-3090";
pub const H100: &str = "NVIDIA-H100-80GB-HBM3";

/// A fleet of `n` GPU nodes of mixed products (the benchmark's cluster).
pub fn fleet(n: usize) -> Vec<Node> {
    let kinds = [
        (H100, 9, 0, 8),
        (B200, 10, 0, 8),
        (RTX_PRO_6000, 12, 0, 4),
        (RTX_3090, 8, 6, 2),
        ("NVIDIA-L4", 8, 9, 4),
    ];
    (0..n)
        .map(|i| {
            let (product, major, minor, gpus) = kinds[i % kinds.len()];
            gpu_node(&format!("gpu-{i:04}"), product, major, minor, gpus)
        })
        .collect()
}

/// A synced cache holding `nodes`.
pub fn synced_cache(nodes: Vec<Node>) -> (Arc<NodeCache>, NodeCacheWriter) {
    let (cache, mut writer) = node_cache();
    writer.apply(&watcher::Event::Init);
    for node in nodes {
        writer.apply(&watcher::Event::InitApply(node));
    }
    writer.apply(&watcher::Event::InitDone);
    (cache, writer)
}

pub fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/admission")
}

/// A fixture's bytes, exactly as stored.
pub fn fixture(name: &str) -> Vec<u8> {
    let path = fixture_dir().join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// Every fixture, by file name.
pub fn fixtures() -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(fixture_dir())
        .expect("fixture dir")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}

/// A CA and a serving certificate for 127.0.0.1 and localhost.
pub fn loopback_pki() -> (CertificateAuthority, CertifiedKey) {
    let now = OffsetDateTime::now_utc();
    let ca = CertificateAuthority::generate("kvfleet-test-ca", std::time::Duration::from_secs(86400), now)
        .unwrap();
    let serving = ca
        .issue(
            &["127.0.0.1".to_string(), "localhost".to_string()],
            std::time::Duration::from_secs(3600),
            now,
        )
        .unwrap();
    (ca, serving)
}

/// A webhook serving on loopback.
pub struct Running {
    pub https: SocketAddr,
    pub health: SocketAddr,
    pub rustls: RustlsConfig,
    pub state: Arc<AppState>,
    pub metrics: Metrics,
    https_handle: Handle<SocketAddr>,
    health_handle: Handle<SocketAddr>,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.https_handle.shutdown();
        self.health_handle.shutdown();
    }
}

/// Starts the admission (HTTPS) and health (HTTP) servers on 127.0.0.1 ephemeral ports.
pub async fn start(cache: Arc<NodeCache>, serving: &CertifiedKey) -> Running {
    let metrics = Metrics::new().unwrap();
    let state = AppState::new(cache, metrics.clone());
    let rustls = RustlsConfig::from_config(
        tls::server_config(serving.cert_pem.as_bytes(), serving.key_pem.as_bytes()).unwrap(),
    );
    let https_listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let health_listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let https = https_listener.local_addr().unwrap();
    let health = health_listener.local_addr().unwrap();
    let https_handle = Handle::new();
    let health_handle = Handle::new();
    tokio::spawn(server::serve_https(
        https_listener,
        state.clone(),
        rustls.clone(),
        https_handle.clone(),
    ));
    tokio::spawn(server::serve_health(
        health_listener,
        state.clone(),
        health_handle.clone(),
    ));
    https_handle.listening().await;
    health_handle.listening().await;
    Running {
        https,
        health,
        rustls,
        state,
        metrics,
        https_handle,
        health_handle,
    }
}

/// A TLS connector that trusts only `ca_pem`.
pub fn connector(ca_pem: &str) -> TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    TlsConnector::from(Arc::new(config))
}

/// An HTTP/1.1 connection over TLS (kept alive for many requests).
pub struct Connection {
    sender: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    /// The server's leaf certificate as presented in the handshake.
    pub peer_certificate: Vec<u8>,
}

impl Connection {
    pub async fn open(connector: &TlsConnector, addr: SocketAddr) -> std::io::Result<Self> {
        let tcp = TcpStream::connect(addr).await?;
        tcp.set_nodelay(true)?;
        let tls = connector
            .connect(ServerName::try_from("127.0.0.1").unwrap().to_owned(), tcp)
            .await?;
        let peer_certificate = tls
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .map(|c| c.to_vec())
            .unwrap_or_default();
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(std::io::Error::other)?;
        tokio::spawn(conn);
        Ok(Connection {
            sender,
            peer_certificate,
        })
    }

    /// POSTs `body` to `/validate`; returns the status and the body.
    pub async fn post(&mut self, body: Vec<u8>) -> std::io::Result<(u16, Vec<u8>)> {
        self.sender.ready().await.map_err(std::io::Error::other)?;
        let request = hyper::Request::post("/validate")
            .header("host", "127.0.0.1")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(std::io::Error::other)?;
        let response = self
            .sender
            .send_request(request)
            .await
            .map_err(std::io::Error::other)?;
        let status = response.status().as_u16();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(std::io::Error::other)?
            .to_bytes();
        Ok((status, body.to_vec()))
    }
}

/// GETs `path` over plain HTTP; returns the status and the body text.
pub async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    let request = hyper::Request::get(path)
        .header("host", "127.0.0.1")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    let status = response.status().as_u16();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}
