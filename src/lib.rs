//! kvfleet: a Kubernetes operator for LLM inference fleets on NVIDIA GPUs.
//!
//! This crate is the edge: the modes that talk to Kubernetes, serve HTTP or drive a GPU
//! ([`controller`], [`webhook`], [`worker`], [`router`], [`sidecar`], [`cli`]) and serving a
//! model ([`serving`]). The pure parts are crates of their own: `kvfleet-core` (the CRD, the
//! compatibility rules, the planner, validation; its modules [`api`], [`compat`], [`plan`],
//! [`validate`] and [`contract`] are re-exported here, the library's public face for the CRD
//! types), `kvfleet-engine` (the engine and the model's pure parts) and `kvfleet-cuda` (the
//! GPU backend and the model on the GPU), used under their own paths. docs/architecture.md
//! draws the crates and where each concept lives.

pub use kvfleet_core::{api, compat, contract, error_chain, plan, validate};

pub mod cli;
pub mod controller;
pub mod publish;
pub mod router;
pub mod serving;
pub mod sidecar;
pub mod telemetry;
pub mod webhook;
pub mod worker;
