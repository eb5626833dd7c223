//! The controller's one error type: what failed, with its cause, and a bounded category for
//! the failure metric.

use std::net::SocketAddr;

use super::desired;

/// Errors of the controller.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot build a Kubernetes client; set KUBECONFIG or run in a pod with a service account")]
    Client(#[source] kube::Error),
    #[error("cannot list InferenceDeployments; install the CRD (`kvfleet crd | kubectl apply -f -`) and grant the RBAC in deploy/rbac")]
    CrdMissing(#[source] kube::Error),
    #[error("cannot serve HTTP on {addr}; pick a free port with --http-addr")]
    Http {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot register metrics")]
    Metrics(#[source] prometheus::Error),
    #[error("lost the leader Lease; exiting so the pod restarts and campaigns again")]
    LeadershipLost,
    #[error("{action} failed")]
    Kube {
        action: String,
        #[source]
        source: kube::Error,
    },
    #[error("cannot build the desired objects")]
    Desired(#[from] desired::DesiredError),
}

impl Error {
    pub(crate) fn kube(action: impl Into<String>, source: kube::Error) -> Self {
        Error::Kube {
            action: action.into(),
            source,
        }
    }

    /// True for HTTP 409 from the API server.
    pub fn is_conflict(&self) -> bool {
        matches!(self, Error::Kube { source, .. } if is_conflict(source))
    }

    /// Bounded category for the failure metric.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube { source, .. } => match source {
                kube::Error::Api(s) if s.code == 409 => "conflict",
                kube::Error::Api(s) if s.code == 401 || s.code == 403 => "forbidden",
                kube::Error::Api(s) if s.code == 422 || s.code == 400 => "rejected",
                kube::Error::Api(_) => "api",
                _ => "transport",
            },
            Error::Desired(_) => "desired",
            Error::Client(_) | Error::CrdMissing(_) | Error::Http { .. } | Error::Metrics(_) => "startup",
            Error::LeadershipLost => "leadership",
        }
    }
}

/// True for HTTP 409 (a conflict) from the API server.
pub(crate) fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}
