//! kvfleet: a Kubernetes operator for LLM inference fleets on NVIDIA GPUs.
//!
//! This crate is the edge: the modes that talk to Kubernetes, serve HTTP or drive a GPU
//! ([`controller`], [`webhook`], [`worker`], [`sidecar`], [`cli`]). The pure parts are crates
//! of their own, re-exported here under their old paths: `kvfleet-core` ([`api`], [`compat`],
//! [`plan`], [`validate`], [`contract`]) and `kvfleet-engine` (the engine and the model's pure
//! parts, under [`worker::engine`] and [`model`]); `kvfleet-cuda` holds the GPU backend
//! ([`worker::cuda`]). docs/architecture.md draws the crates and where each concept lives.

pub use kvfleet_core::{api, compat, contract, error_chain, plan, validate};

pub mod cli;
pub mod controller;
pub mod model;
pub mod publish;
pub mod router;
pub mod serving;
pub mod sidecar;
pub mod telemetry;
pub mod webhook;
pub mod worker;
