//! kvfleet's pure core: what an InferenceDeployment is ([`api`]), what runs where
//! ([`compat`]), what fits ([`plan`], which also reads Hugging Face `config.json` files for the
//! planner and the model loader), whether a spec can run on a cluster ([`validate`]), and the
//! contract between the controller and the worker ([`contract`]), and how many replicas a
//! deployment needs from its KV demand ([`autoscale`]).
//!
//! No I/O beyond reading a file it is given, no Kubernetes client, no async runtime, no CUDA:
//! the webhook, the controller, the worker and `kvfleet check`/`plan` all call the same code.
//! `tests/architecture.rs` at the workspace root keeps it that way.

pub mod api;
pub mod autoscale;
pub mod compat;
pub mod contract;
pub mod plan;
pub mod validate;

/// An error and its sources on one line (`outer: inner: root`), for logs and messages.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut out = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        out.push_str(": ");
        out.push_str(&cause.to_string());
        source = cause.source();
    }
    out
}
