//! Self-managed TLS: the webhook keeps its CA and serving certificate in a Secret,
//! renews them before they expire, and server-side-applies the CA bundle into its
//! ValidatingWebhookConfiguration. Several replicas share one Secret: writes are
//! optimistic (resourceVersion) and the loser of a race adopts the winner's certificate.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum_server::tls_rustls::RustlsConfig;
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::ByteString;
use kube::api::{ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use time::OffsetDateTime;

use super::metrics::Metrics;
use super::tls::{self, CertificateAuthority, CertifiedKey, TlsError};

/// Secret keys.
pub const CA_CRT: &str = "ca.crt";
pub const CA_KEY: &str = "ca.key";
/// The CA that signed the previous serving certificates, trusted until it expires so
/// that a CA rotation never leaves the API server without a CA for the served cert.
pub const CA_PREVIOUS_CRT: &str = "ca-previous.crt";
pub const TLS_CRT: &str = "tls.crt";
pub const TLS_KEY: &str = "tls.key";
/// Field manager of our server-side applies.
pub const FIELD_MANAGER: &str = "kvfleet-webhook";

/// Errors of self-managed certificates.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("cannot {action} Secret {namespace}/{name}; the webhook needs get, create and update on secrets in its namespace")]
    Secret {
        action: &'static str,
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("cannot {action} ValidatingWebhookConfiguration {name}; the webhook needs get and patch on it (is the chart installed?)")]
    WebhookConfiguration {
        action: &'static str,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("the CA of the new serving certificate could not be published, so the certificate is not served (the API server would not trust it); the previous one stays")]
    CaNotPublished(#[source] Box<CertError>),
    #[error("Secret {namespace}/{name} kept changing under us ({attempts} attempts); is another program writing it?")]
    Contended {
        namespace: String,
        name: String,
        attempts: usize,
    },
}

/// Lifetimes of what we issue; each is renewed when less than a third of it is left.
#[derive(Clone, Debug)]
pub struct Lifetimes {
    pub ca: Duration,
    pub serving: Duration,
}

impl Lifetimes {
    fn renew_ca(&self, ca: &CertifiedKey, now: OffsetDateTime) -> bool {
        ca.not_after - now < self.ca / 3
    }
    fn renew_serving(&self, cert: &CertifiedKey, now: OffsetDateTime) -> bool {
        cert.not_after - now < self.serving / 3
    }
}

/// What the Secret holds, decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Material {
    pub ca: CertificateAuthority,
    pub previous_ca_pem: Option<String>,
    pub serving: CertifiedKey,
}

impl Material {
    /// The CA bundle for the webhook configuration: the current CA, then the previous
    /// one while it is still valid.
    pub fn ca_bundle(&self) -> String {
        let mut bundle = self.ca.0.cert_pem.clone();
        if let Some(previous) = &self.previous_ca_pem {
            bundle.push_str(previous);
        }
        bundle
    }

    /// Secret data.
    pub fn to_data(&self) -> BTreeMap<String, ByteString> {
        let mut data = BTreeMap::new();
        let mut put = |k: &str, v: &str| data.insert(k.to_string(), ByteString(v.as_bytes().to_vec()));
        put(CA_CRT, &self.ca.0.cert_pem);
        put(CA_KEY, &self.ca.0.key_pem);
        put(TLS_CRT, &self.serving.cert_pem);
        put(TLS_KEY, &self.serving.key_pem);
        if let Some(previous) = &self.previous_ca_pem {
            put(CA_PREVIOUS_CRT, previous);
        }
        data
    }
}

/// Decides what the Secret should hold (pure apart from key generation): keeps what is
/// valid, renews what is due or unreadable. Returns the material and whether it changed.
pub fn plan(
    existing: &BTreeMap<String, ByteString>,
    names: &[String],
    lifetimes: &Lifetimes,
    now: OffsetDateTime,
) -> Result<(Material, bool), TlsError> {
    let text = |key: &str| existing.get(key).and_then(|b| std::str::from_utf8(&b.0).ok());
    let old_ca = match (text(CA_CRT), text(CA_KEY)) {
        (Some(cert), Some(key)) => CertificateAuthority::from_pem(cert, key).ok(),
        _ => None,
    };
    let (ca, previous_ca_pem, ca_changed) = match old_ca {
        Some(ca) if !lifetimes.renew_ca(&ca.0, now) => {
            let previous = text(CA_PREVIOUS_CRT)
                .filter(|pem| tls::not_after(pem).is_ok_and(|t| t > now))
                .map(str::to_string);
            (ca, previous, false)
        }
        old => {
            let previous = old.filter(|ca| ca.0.not_after > now).map(|ca| ca.0.cert_pem);
            (
                CertificateAuthority::generate("kvfleet-webhook-ca", lifetimes.ca, now)?,
                previous,
                true,
            )
        }
    };
    let old_serving = match (text(TLS_CRT), text(TLS_KEY)) {
        (Some(cert), Some(key)) if !ca_changed => tls::not_after(cert).ok().map(|not_after| CertifiedKey {
            cert_pem: cert.to_string(),
            key_pem: key.to_string(),
            not_after,
        }),
        _ => None,
    };
    let serving = match old_serving {
        Some(cert)
            if !lifetimes.renew_serving(&cert, now)
                && serving_names(&cert.cert_pem).is_some_and(|have| same_names(&have, names))
                && tls::server_config(cert.cert_pem.as_bytes(), cert.key_pem.as_bytes()).is_ok() =>
        {
            cert
        }
        _ => ca.issue(names, lifetimes.serving, now)?,
    };
    let material = Material {
        ca,
        previous_ca_pem,
        serving,
    };
    let changed = material.to_data() != *existing;
    Ok((material, changed))
}

fn same_names(have: &[String], want: &[String]) -> bool {
    let mut a = have.to_vec();
    let mut b = want.to_vec();
    a.sort();
    b.sort();
    a == b
}

/// DNS and IP subject alternative names of a PEM certificate.
pub fn serving_names(pem: &str) -> Option<Vec<String>> {
    use rustls::pki_types::pem::PemObject;
    let der = rustls::pki_types::CertificateDer::pem_slice_iter(pem.as_bytes())
        .next()?
        .ok()?;
    let (_, cert) = x509_parser::parse_x509_certificate(&der).ok()?;
    let san = cert.subject_alternative_name().ok()??;
    let mut names = Vec::new();
    for name in &san.value.general_names {
        match name {
            x509_parser::extensions::GeneralName::DNSName(dns) => names.push(dns.to_string()),
            x509_parser::extensions::GeneralName::IPAddress(ip) => match ip.len() {
                4 => names.push(std::net::Ipv4Addr::new(ip[0], ip[1], ip[2], ip[3]).to_string()),
                16 => {
                    let mut octets = [0u8; 16];
                    octets.copy_from_slice(ip);
                    names.push(std::net::Ipv6Addr::from(octets).to_string());
                }
                _ => {}
            },
            _ => {}
        }
    }
    Some(names)
}

/// Self-managed certificates of one webhook deployment.
/// The certificate being served and the CAs the API server was last told to trust.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Served {
    pub cert_pem: Option<String>,
    /// CA certificates (PEM) of the last bundle published.
    pub trusted_cas: Vec<String>,
}

impl Served {
    /// Serving `material`, whose bundle was just published.
    pub fn published(material: &Material) -> Self {
        Served {
            cert_pem: Some(material.serving.cert_pem.clone()),
            trusted_cas: bundle_cas(material),
        }
    }
}

fn bundle_cas(material: &Material) -> Vec<String> {
    let mut cas = vec![material.ca.0.cert_pem.clone()];
    cas.extend(material.previous_ca_pem.clone());
    cas
}

#[derive(Clone)]
pub struct SelfManaged {
    pub client: Client,
    pub namespace: String,
    pub secret_name: String,
    /// Names the serving certificate must carry (see [`tls::service_dns_names`]).
    pub names: Vec<String>,
    /// The ValidatingWebhookConfiguration whose caBundle we keep current; `None` leaves
    /// it alone (someone else injects the CA).
    pub webhook_configuration: Option<String>,
    pub lifetimes: Lifetimes,
}

impl SelfManaged {
    /// Makes sure the Secret holds a valid CA and serving certificate and returns them.
    pub async fn ensure(&self, now: OffsetDateTime) -> Result<Material, CertError> {
        let api: Api<Secret> = Api::namespaced(self.client.clone(), &self.namespace);
        const ATTEMPTS: usize = 4;
        for _ in 0..ATTEMPTS {
            let existing = api
                .get_opt(&self.secret_name)
                .await
                .map_err(|source| self.secret_error("read", source))?;
            let data = existing.as_ref().and_then(|s| s.data.clone()).unwrap_or_default();
            let (material, changed) = plan(&data, &self.names, &self.lifetimes, now)?;
            if !changed {
                return Ok(material);
            }
            let secret = Secret {
                metadata: ObjectMeta {
                    name: Some(self.secret_name.clone()),
                    namespace: Some(self.namespace.clone()),
                    resource_version: existing
                        .as_ref()
                        .and_then(|s| s.metadata.resource_version.clone()),
                    managed_fields: None,
                    // A Secret the chart made keeps its labels (managed-by: Helm): a
                    // rewritten label makes the next `helm upgrade` conflict with us.
                    labels: Some({
                        let mut labels = existing
                            .as_ref()
                            .and_then(|s| s.metadata.labels.clone())
                            .unwrap_or_default();
                        labels
                            .entry("app.kubernetes.io/managed-by".to_string())
                            .or_insert_with(|| "kvfleet-webhook".to_string());
                        labels
                    }),
                    ..existing.as_ref().map(|s| s.metadata.clone()).unwrap_or_default()
                },
                type_: Some("kubernetes.io/tls".to_string()),
                data: Some(material.to_data()),
                ..Secret::default()
            };
            let written = if existing.is_some() {
                api.replace(&self.secret_name, &PostParams::default(), &secret)
                    .await
            } else {
                api.create(&PostParams::default(), &secret).await
            };
            match written {
                Ok(_) => {
                    tracing::info!(secret = %self.secret_name, not_after = %material.serving.not_after, "wrote webhook certificates");
                    return Ok(material);
                }
                // Another replica wrote first: read again and adopt its certificates.
                Err(kube::Error::Api(status)) if status.code == 409 => continue,
                Err(source) => return Err(self.secret_error("write", source)),
            }
        }
        Err(CertError::Contended {
            namespace: self.namespace.clone(),
            name: self.secret_name.clone(),
            attempts: ATTEMPTS,
        })
    }

    fn secret_error(&self, action: &'static str, source: kube::Error) -> CertError {
        CertError::Secret {
            action,
            namespace: self.namespace.clone(),
            name: self.secret_name.clone(),
            source,
        }
    }

    /// Server-side-applies `bundle` as the caBundle of every webhook in the
    /// configuration (only the caBundle fields are owned by us). Returns false when
    /// nothing needed changing.
    pub async fn apply_ca_bundle(&self, bundle: &str) -> Result<bool, CertError> {
        let Some(name) = self.webhook_configuration.as_deref() else {
            return Ok(false);
        };
        let error = |action, source| CertError::WebhookConfiguration {
            action,
            name: name.to_string(),
            source,
        };
        let api: Api<ValidatingWebhookConfiguration> = Api::all(self.client.clone());
        let current = api.get(name).await.map_err(|e| error("read", e))?;
        let webhooks = current.webhooks.unwrap_or_default();
        let want = ByteString(bundle.as_bytes().to_vec());
        if !webhooks.is_empty()
            && webhooks
                .iter()
                .all(|w| w.client_config.ca_bundle.as_ref() == Some(&want))
        {
            return Ok(false);
        }
        let entries: Vec<serde_json::Value> = webhooks
            .iter()
            .map(|w| json!({"name": w.name, "clientConfig": {"caBundle": want}}))
            .collect();
        let patch = json!({
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": name},
            "webhooks": entries,
        });
        api.patch(
            name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await
        .map_err(|e| error("patch", e))?;
        tracing::info!(configuration = %name, "applied the CA bundle");
        Ok(true)
    }

    /// The first certificate to serve: the Secret's material once its CA bundle is
    /// published, retried (1 s doubling to `max_delay`) while publishing fails, e.g. while
    /// the chart's ValidatingWebhookConfiguration does not exist yet.
    pub async fn published_material(&self, max_delay: Duration) -> Result<Material, CertError> {
        let mut delay = Duration::from_secs(1);
        loop {
            let material = self.ensure(OffsetDateTime::now_utc()).await?;
            match self.apply_ca_bundle(&material.ca_bundle()).await {
                Ok(_) => return Ok(material),
                Err(error) => {
                    tracing::warn!(error = %crate::error_chain(&error), retry_s = delay.as_secs(),
                    "cannot publish the CA bundle; not serving until it is published")
                }
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(max_delay.max(Duration::from_secs(1)));
        }
    }

    /// One round: ensure the Secret, publish the CA bundle, then serve the certificate
    /// if it differs from the served one (the bundle goes first so the API server already
    /// trusts the CA of the certificate we switch to). When publishing fails, a new
    /// certificate is served only if its CA is one already published.
    pub async fn refresh(
        &self,
        rustls: &RustlsConfig,
        metrics: &Metrics,
        served: &mut Served,
    ) -> Result<(), CertError> {
        let material = self.ensure(OffsetDateTime::now_utc()).await?;
        let published = self.apply_ca_bundle(&material.ca_bundle()).await;
        if served.cert_pem.as_deref() != Some(material.serving.cert_pem.as_str()) {
            let ca_pem = material.ca.0.cert_pem.as_str();
            let bundle_published = match published {
                Ok(_) => true,
                Err(error) if !served.trusted_cas.iter().any(|c| c == ca_pem) => {
                    return Err(CertError::CaNotPublished(Box::new(error)));
                }
                Err(error) => {
                    tracing::warn!(error = %crate::error_chain(&error), "cannot publish the CA bundle; serving the new certificate, whose CA was published before");
                    false
                }
            };
            tls::install(
                rustls,
                material.serving.cert_pem.as_bytes(),
                material.serving.key_pem.as_bytes(),
                metrics,
            )?;
            served.cert_pem = Some(material.serving.cert_pem.clone());
            if !bundle_published {
                return Ok(());
            }
            tracing::info!(not_after = %material.serving.not_after, "serving certificate installed");
        } else if let Err(error) = published {
            // Keep serving the current certificate; the next round retries.
            tracing::warn!(error = %crate::error_chain(&error), "cannot publish the CA bundle; retrying next round");
            return Ok(());
        }
        served.trusted_cas = bundle_cas(&material);
        Ok(())
    }

    /// Runs [`Self::refresh`] every `interval` for ever, logging failures.
    pub async fn run(
        self: Arc<Self>,
        rustls: RustlsConfig,
        metrics: Metrics,
        interval: Duration,
        mut served: Served,
    ) {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticker.tick().await;
        loop {
            ticker.tick().await;
            if let Err(error) = self.refresh(&rustls, &metrics, &mut served).await {
                tracing::warn!(error = %crate::error_chain(&error), "certificate refresh failed; retrying next round");
            }
        }
    }
}
