//! `kvfleet webhook`: the validating admission webhook for InferenceDeployments.
//!
//! The API server sends an AdmissionReview for every CREATE and UPDATE; [`review::review`]
//! (a plain function) answers it from the spec and the GPU nodes in a watch-backed cache
//! ([`cache`]), calling [`crate::validate::validate`] for the decision. The admission
//! endpoint is HTTPS ([`tls`]: a self-managed CA and certificate kept in a Secret by
//! [`certs`], or files mounted by cert-manager, reloaded without restart); `/healthz`,
//! `/readyz` and `/metrics` are plain HTTP on a second port ([`server`]).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum_server::tls_rustls::RustlsConfig;
use axum_server::Handle;
use k8s_openapi::api::core::v1::Node;
use kube::{Api, Client};

pub mod cache;
pub mod certs;
pub mod metrics;
pub mod review;
pub mod server;
pub mod tls;

pub use review::{review, review_detailed, review_with, Outcome, Reviewed};

/// Where the serving certificate comes from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum TlsMode {
    /// The webhook makes its own CA and certificate, keeps them in a Secret, renews
    /// them and writes the CA bundle into its ValidatingWebhookConfiguration.
    #[default]
    SelfManaged,
    /// Certificate and key files (e.g. a cert-manager Certificate's Secret mounted as a
    /// volume), reloaded when they change.
    Files,
}

/// Options of `kvfleet webhook`.
#[derive(clap::Args, Debug, Clone)]
pub struct WebhookArgs {
    /// Address of the HTTPS admission endpoint (POST /validate).
    #[arg(long, env = "KVFLEET_WEBHOOK_LISTEN", default_value = "0.0.0.0:8443")]
    pub listen: SocketAddr,

    /// Address of the plain-HTTP /healthz, /readyz and /metrics endpoints.
    #[arg(long, env = "KVFLEET_WEBHOOK_HEALTH_LISTEN", default_value = "0.0.0.0:8080")]
    pub health_listen: SocketAddr,

    /// TLS options (boxed: they are large and clap subcommands live in one enum).
    #[command(flatten)]
    pub tls: Box<TlsArgs>,

    /// Only cache nodes matching this label selector (e.g. `nvidia.com/gpu.present=true`);
    /// empty caches every node.
    #[arg(long, env = "KVFLEET_WEBHOOK_NODE_SELECTOR", default_value = "")]
    pub node_selector: String,

    /// Bytes of AdmissionReview bodies held at once, across requests; a review that finds no
    /// room within 2 s is answered 503 with Retry-After. At least one review of the largest
    /// size (8 MiB); keep it well under the container's memory limit (docs/webhook.md).
    #[arg(
        long,
        env = "KVFLEET_WEBHOOK_MAX_BODY_BYTES_IN_FLIGHT",
        default_value_t = server::DEFAULT_BODIES_IN_FLIGHT_BYTES,
        value_parser = clap::builder::RangedU64ValueParser::<usize>::new()
            .range(server::MAX_BODY_BYTES as u64..=(1u64 << 40))
    )]
    pub max_body_bytes_in_flight: usize,
}

/// Where the serving certificate comes from and how it is renewed.
#[derive(clap::Args, Debug, Clone)]
pub struct TlsArgs {
    /// Where the serving certificate comes from.
    #[arg(long, env = "KVFLEET_WEBHOOK_TLS_MODE", value_enum, default_value_t = TlsMode::SelfManaged)]
    pub tls_mode: TlsMode,

    /// Serving certificate (PEM chain) in `--tls-mode files`.
    #[arg(long, env = "KVFLEET_WEBHOOK_TLS_CERT_FILE", default_value = "/tls/tls.crt")]
    pub tls_cert_file: PathBuf,

    /// Serving key (PEM) in `--tls-mode files`.
    #[arg(long, env = "KVFLEET_WEBHOOK_TLS_KEY_FILE", default_value = "/tls/tls.key")]
    pub tls_key_file: PathBuf,

    /// How often the certificate files are checked for a new certificate (files mode),
    /// or the Secret for renewal and for another replica's rotation (self-managed).
    #[arg(long, env = "KVFLEET_WEBHOOK_TLS_RELOAD_SECONDS", default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub tls_reload_seconds: u64,

    /// Namespace of the webhook's Secret and Service; defaults to the pod's namespace
    /// (service-account mount), then to the kubeconfig's namespace.
    #[arg(long, env = "KVFLEET_NAMESPACE")]
    pub namespace: Option<String>,

    /// Service the API server calls; its DNS names go into the serving certificate.
    #[arg(long, env = "KVFLEET_WEBHOOK_SERVICE", default_value = "kvfleet-webhook")]
    pub service_name: String,

    /// Cluster DNS domain, for the `svc.ns.svc.<domain>` name in the certificate.
    #[arg(long, env = "KVFLEET_CLUSTER_DOMAIN", default_value = "cluster.local")]
    pub cluster_domain: String,

    /// Secret holding the self-managed CA and serving certificate.
    #[arg(
        long,
        env = "KVFLEET_WEBHOOK_TLS_SECRET",
        default_value = "kvfleet-webhook-tls"
    )]
    pub tls_secret_name: String,

    /// ValidatingWebhookConfiguration whose caBundle the webhook keeps current
    /// (self-managed mode); an empty value leaves the caBundle to someone else.
    #[arg(
        long,
        env = "KVFLEET_WEBHOOK_CONFIGURATION",
        default_value = "kvfleet-webhook"
    )]
    pub webhook_configuration: String,

    /// Lifetime of the self-managed CA in hours (renewed with a third left).
    #[arg(long, env = "KVFLEET_WEBHOOK_CA_VALIDITY_HOURS", default_value_t = 24 * 365 * 5, value_parser = clap::value_parser!(u64).range(1..))]
    pub ca_validity_hours: u64,

    /// Lifetime of the self-managed serving certificate in hours (renewed with a third left).
    #[arg(long, env = "KVFLEET_WEBHOOK_CERT_VALIDITY_HOURS", default_value_t = 24 * 90, value_parser = clap::value_parser!(u64).range(1..))]
    pub cert_validity_hours: u64,
}

/// Errors of the webhook.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot connect to the Kubernetes API (in-cluster service account or KUBECONFIG)")]
    Client(#[source] kube::Error),
    #[error("cannot create the metrics registry")]
    Metrics(#[source] prometheus::Error),
    #[error("cannot listen on {addr}; is the port taken? (--listen / --health-listen)")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("serving certificate")]
    Tls(#[from] tls::TlsError),
    #[error("self-managed certificates")]
    Certs(#[from] Box<certs::CertError>),
    #[error("the {0} server stopped")]
    Server(&'static str, #[source] std::io::Error),
}

/// Runs the webhook until a server fails or the process gets SIGTERM/SIGINT.
pub async fn run(args: WebhookArgs) -> Result<(), Error> {
    let tls_args = args.tls.clone();
    run_with(args, *tls_args).await
}

async fn run_with(args: WebhookArgs, tls_args: TlsArgs) -> Result<(), Error> {
    // Both aws-lc-rs and ring can be linked; pin the provider our configs also use.
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    let client = Client::try_default().await.map_err(Error::Client)?;
    let metrics = metrics::Metrics::new().map_err(Error::Metrics)?;
    let (cache, writer) = cache::node_cache();
    let state =
        server::AppState::with_bodies_in_flight(cache, metrics.clone(), args.max_body_bytes_in_flight);

    let bind = |addr: SocketAddr| crate::serving::bind(addr).map_err(|source| Error::Listen { addr, source });
    let health_listener = bind(args.health_listen)?;
    let https_listener = bind(args.listen)?;
    let health_handle = Handle::new();
    let https_handle = Handle::new();
    let mut health = tokio::spawn(server::serve_health(
        health_listener,
        state.clone(),
        health_handle.clone(),
    ));

    let selector = (!args.node_selector.is_empty()).then(|| args.node_selector.clone());
    tokio::spawn(writer.run(Api::<Node>::all(client.clone()), selector));
    tokio::spawn(
        state
            .cache
            .clone()
            .probe(Api::<Node>::all(client.clone()), cache::PROBE_INTERVAL),
    );
    tokio::spawn(
        state
            .cache
            .clone()
            .probe_apis(client.clone(), cache::API_PROBE_INTERVAL),
    );

    let interval = Duration::from_secs(tls_args.tls_reload_seconds);
    let rustls = match tls_args.tls_mode {
        TlsMode::Files => {
            let files = tls::CertFiles {
                cert: tls_args.tls_cert_file.clone(),
                key: tls_args.tls_key_file.clone(),
            };
            let pair = files.read()?;
            let rustls = RustlsConfig::from_config(tls::server_config(&pair.0, &pair.1)?);
            if let Ok(expiry) = std::str::from_utf8(&pair.0)
                .map_err(|_| ())
                .and_then(|p| tls::not_after(p).map_err(|_| ()))
            {
                metrics.cert_not_after.set(expiry.unix_timestamp());
            }
            tokio::spawn(files.watch(rustls.clone(), metrics.clone(), interval, pair));
            rustls
        }
        TlsMode::SelfManaged => {
            let namespace = match tls_args.namespace.clone() {
                Some(ns) => ns,
                None => std::fs::read_to_string("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
                    .map(|s| s.trim().to_string())
                    .unwrap_or_else(|_| client.default_namespace().to_string()),
            };
            let manager = Arc::new(certs::SelfManaged {
                client: client.clone(),
                names: tls::service_dns_names(&tls_args.service_name, &namespace, &tls_args.cluster_domain),
                namespace,
                secret_name: tls_args.tls_secret_name.clone(),
                webhook_configuration: (!tls_args.webhook_configuration.is_empty())
                    .then(|| tls_args.webhook_configuration.clone()),
                lifetimes: certs::Lifetimes {
                    ca: Duration::from_secs(tls_args.ca_validity_hours * 3600),
                    serving: Duration::from_secs(tls_args.cert_validity_hours * 3600),
                },
            });
            // Nothing is served (and /readyz fails) until the API server trusts the CA of
            // the certificate: a certificate whose CA failed to publish fails every admission.
            let material = tokio::select! {
                m = manager.published_material(interval) => m.map_err(Box::new)?,
                () = crate::serving::shutdown_signal() => return Ok(()),
            };
            let rustls = RustlsConfig::from_config(tls::server_config(
                material.serving.cert_pem.as_bytes(),
                material.serving.key_pem.as_bytes(),
            )?);
            metrics
                .cert_not_after
                .set(material.serving.not_after.unix_timestamp());
            tokio::spawn(manager.run(
                rustls.clone(),
                metrics.clone(),
                interval,
                certs::Served::published(&material),
            ));
            rustls
        }
    };

    let mut https = tokio::spawn(server::serve_https(
        https_listener,
        state.clone(),
        rustls,
        https_handle.clone(),
    ));
    tracing::info!(listen = %args.listen, health = %args.health_listen, "webhook serving");

    let result = tokio::select! {
        r = &mut https => r.map_err(|e| Error::Server("admission", std::io::Error::other(e))).and_then(|r| r.map_err(|e| Error::Server("admission", e))),
        r = &mut health => r.map_err(|e| Error::Server("health", std::io::Error::other(e))).and_then(|r| r.map_err(|e| Error::Server("health", e))),
        () = crate::serving::shutdown_signal() => Ok(()),
    };
    // Let in-flight reviews finish; the API server retries on its own timeout anyway.
    https_handle.graceful_shutdown(Some(Duration::from_secs(5)));
    health_handle.graceful_shutdown(Some(Duration::from_secs(5)));
    result
}
