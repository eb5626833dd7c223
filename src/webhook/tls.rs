//! Certificates (a small CA and the serving certificate it signs, made with rcgen), the
//! rustls server configuration, and reloading a certificate mounted from files.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum_server::tls_rustls::RustlsConfig;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::ServerConfig;
use time::OffsetDateTime;

use super::metrics::Metrics;

/// Errors of certificate handling.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot generate a certificate")]
    Generate(#[source] rcgen::Error),
    #[error("the CA certificate or key is unusable; delete the Secret to let the webhook make a new CA")]
    BadCa(#[source] rcgen::Error),
    #[error("no PEM certificate found in {0}")]
    NoCertificate(String),
    #[error("cannot read the certificate's validity from {what}: {message}")]
    Parse { what: String, message: String },
    #[error("cannot read the private key in {0}; expected a PEM PKCS#8, PKCS#1 or SEC1 key")]
    Key(String),
    #[error("the certificate and key are not usable together")]
    Rustls(#[source] rustls::Error),
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// A PEM certificate, its PEM private key and when the certificate expires.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CertifiedKey {
    pub cert_pem: String,
    pub key_pem: String,
    pub not_after: OffsetDateTime,
}

/// The webhook's own certificate authority.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CertificateAuthority(pub CertifiedKey);

impl CertificateAuthority {
    /// A new self-signed CA valid from five minutes ago (clock skew) for `validity`.
    pub fn generate(common_name: &str, validity: Duration, now: OffsetDateTime) -> Result<Self, TlsError> {
        let now = whole_seconds(now);
        let key = KeyPair::generate().map_err(TlsError::Generate)?;
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, common_name);
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        params.not_before = now - time::Duration::minutes(5);
        params.not_after = now + validity;
        let cert = params.self_signed(&key).map_err(TlsError::Generate)?;
        Ok(CertificateAuthority(CertifiedKey {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            not_after: params.not_after,
        }))
    }

    /// A CA read back from PEM (as stored in the Secret).
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Self, TlsError> {
        KeyPair::from_pem(key_pem).map_err(TlsError::BadCa)?;
        let not_after = not_after(cert_pem)?;
        Ok(CertificateAuthority(CertifiedKey {
            cert_pem: cert_pem.to_string(),
            key_pem: key_pem.to_string(),
            not_after,
        }))
    }

    /// A serving certificate for `names` (DNS names or IP addresses) signed by this CA,
    /// valid for `validity` but never beyond the CA.
    pub fn issue(
        &self,
        names: &[String],
        validity: Duration,
        now: OffsetDateTime,
    ) -> Result<CertifiedKey, TlsError> {
        let now = whole_seconds(now);
        let ca_key = KeyPair::from_pem(&self.0.key_pem).map_err(TlsError::BadCa)?;
        let issuer = Issuer::from_ca_cert_pem(&self.0.cert_pem, ca_key).map_err(TlsError::BadCa)?;
        let key = KeyPair::generate().map_err(TlsError::Generate)?;
        let mut params = CertificateParams::new(names.to_vec()).map_err(TlsError::Generate)?;
        params.distinguished_name.push(
            DnType::CommonName,
            names.first().map(String::as_str).unwrap_or("kvfleet-webhook"),
        );
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        params.not_before = now - time::Duration::minutes(5);
        params.not_after = (now + validity).min(self.0.not_after);
        let cert = params.signed_by(&key, &issuer).map_err(TlsError::Generate)?;
        Ok(CertifiedKey {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            not_after: params.not_after,
        })
    }
}

/// X.509 times have whole seconds; so do ours, so that a certificate read back equals
/// the one made.
fn whole_seconds(t: OffsetDateTime) -> OffsetDateTime {
    t.replace_nanosecond(0).unwrap_or(t)
}

/// The `notAfter` of the first certificate in `pem`.
pub fn not_after(pem: &str) -> Result<OffsetDateTime, TlsError> {
    let der = CertificateDer::pem_slice_iter(pem.as_bytes())
        .next()
        .ok_or_else(|| TlsError::NoCertificate("the PEM text".into()))?
        .map_err(|e| TlsError::Parse {
            what: "the PEM text".into(),
            message: e.to_string(),
        })?;
    let (_, cert) = x509_parser::parse_x509_certificate(&der).map_err(|e| TlsError::Parse {
        what: "the certificate".into(),
        message: e.to_string(),
    })?;
    OffsetDateTime::from_unix_timestamp(cert.validity().not_after.timestamp()).map_err(|e| TlsError::Parse {
        what: "notAfter".into(),
        message: e.to_string(),
    })
}

/// The DNS names the API server uses to reach a Service: `svc`, `svc.ns`, `svc.ns.svc`
/// and `svc.ns.svc.cluster.local` (the API server itself calls `svc.ns.svc`).
pub fn service_dns_names(service: &str, namespace: &str, cluster_domain: &str) -> Vec<String> {
    vec![
        service.to_string(),
        format!("{service}.{namespace}"),
        format!("{service}.{namespace}.svc"),
        format!("{service}.{namespace}.svc.{cluster_domain}"),
    ]
}

/// A rustls server configuration (aws-lc-rs, TLS 1.2 and 1.3, ALPN h2 and http/1.1)
/// for a PEM certificate chain and key.
pub fn server_config(cert_pem: &[u8], key_pem: &[u8]) -> Result<Arc<ServerConfig>, TlsError> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| TlsError::Parse {
            what: "the certificate chain".into(),
            message: e.to_string(),
        })?;
    if chain.is_empty() {
        return Err(TlsError::NoCertificate("the serving certificate".into()));
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|_| TlsError::Key("the serving key".into()))?;
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Rustls)?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(TlsError::Rustls)?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Installs a certificate into a running server: new connections get it at once,
/// established ones keep theirs.
pub fn install(
    rustls: &RustlsConfig,
    cert_pem: &[u8],
    key_pem: &[u8],
    metrics: &Metrics,
) -> Result<(), TlsError> {
    match server_config(cert_pem, key_pem) {
        Ok(config) => {
            rustls.reload_from_config(config);
            metrics.cert_reloads.with_label_values(&["ok"]).inc();
            if let Ok(expiry) = std::str::from_utf8(cert_pem)
                .map_err(|_| ())
                .and_then(|p| not_after(p).map_err(|_| ()))
            {
                metrics.cert_not_after.set(expiry.unix_timestamp());
            }
            Ok(())
        }
        Err(error) => {
            metrics.cert_reloads.with_label_values(&["error"]).inc();
            Err(error)
        }
    }
}

/// Certificate and key files (e.g. a cert-manager Secret mounted as a volume).
#[derive(Clone, Debug)]
pub struct CertFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl CertFiles {
    /// Reads both files.
    pub fn read(&self) -> Result<(Vec<u8>, Vec<u8>), TlsError> {
        Ok((read(&self.cert)?, read(&self.key)?))
    }

    /// Polls the files every `interval` and installs them when their content changed.
    /// Content, not mtime, is compared: kubelet swaps Secret volumes through symlinks.
    /// A half-written or mismatched pair is logged and retried; the old cert stays.
    pub async fn watch(
        self,
        rustls: RustlsConfig,
        metrics: Metrics,
        interval: Duration,
        mut current: (Vec<u8>, Vec<u8>),
    ) {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            let next = match self.read() {
                Ok(next) => next,
                Err(error) => {
                    tracing::warn!(error = %crate::error_chain(&error), "cannot read the serving certificate files");
                    continue;
                }
            };
            if next == current {
                continue;
            }
            match install(&rustls, &next.0, &next.1, &metrics) {
                Ok(()) => {
                    tracing::info!(cert = %self.cert.display(), "serving certificate reloaded");
                    current = next;
                }
                Err(error) => {
                    tracing::warn!(error = %crate::error_chain(&error), "new certificate files are not usable yet; keeping the old certificate")
                }
            }
        }
    }
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    })
}
