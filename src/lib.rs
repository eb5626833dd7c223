//! kvfleet: a Kubernetes operator for LLM inference fleets on NVIDIA GPUs.
//!
//! Pure modules (no I/O, no kube client, no CUDA): [`api`], [`compat`], [`plan`],
//! [`validate`]. I/O modules: [`controller`], [`webhook`], [`worker`], [`cli`].

pub mod api;
pub mod cli;
pub mod compat;
pub mod controller;
pub mod model;
pub mod plan;
pub mod serving;
pub mod sidecar;
pub mod telemetry;
pub mod validate;
pub mod webhook;
pub mod worker;
