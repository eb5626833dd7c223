//! KV-capacity planning (pure, no I/O).
//!
//! - [`geometry`]: which layers hold a KV cache, from an HF `config.json` or the CRD.
//! - [`bytes`]: KV bytes per token per layer, dtype and tensor-parallel rank.
//! - [`memory`]: how much of a GPU is left for the KV cache.
//! - [`engine_memory`]: the same for kvfleet's own engine, term by term (weights, activation
//!   workspace, context reserve), as its GPU worker sizes its pools.
//! - [`draft`]: what a speculative drafter beside the model takes of that engine's KV budget.
//! - [`vllm`]: vLLM's exact model (pages, hybrid groups, blocks, logged tokens, concurrency).
//! - [`kvfleet`]: kvfleet's sliding-window-aware model and the pool layout of its engine.
//! - [`report`]: a [`Plan`] with every number derivable, printed step by step.
//! - [`weights`]: weight bytes by dtype (`engine.quantization: fp8`).
//! - [`spec`]: capacity of an `InferenceDeployment` spec, for the validator and controller.

pub mod bytes;
pub mod draft;
pub mod engine_memory;
pub mod geometry;
pub mod hf_config;
pub mod kvfleet;
pub mod memory;
pub mod report;
pub mod spec;
pub mod vllm;
pub mod weights;

pub use bytes::{
    check_tensor_parallel, head_vector_bytes, kv_bytes_per_token, kv_heads_per_rank, page_bytes,
};
pub use draft::{DraftKind, DraftShape};
pub use engine_memory::{EngineMemory, EngineShape, CONTEXT_RESERVE_BYTES, FP8_GEMM_WORKSPACE_BYTES};
pub use geometry::{Geometry, LayerGeometry, LayerKind};
pub use kvfleet::{blocks_per_request, full_layer_concurrency, pool_layout, KvfleetGroup, KvfleetPlan};
pub use memory::{
    gpu_memory_bytes, parse_quantity_bytes, MemoryBudget, DEFAULT_ACTIVATION_RESERVE_BYTES, GIB,
};
pub use report::{plan, MemoryInput, Plan, PlanInputs};
pub use spec::{spec_capacity, spec_capacity_with, SpecCapacity};
pub use vllm::{vllm_plan, EngineParams, ReportingEra, SlidingAdmission, VllmGroup, VllmPlan};

pub use crate::compat::KvCacheDtype;

/// Why a plan cannot be made. Every message says what to change.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    #[error("cannot read the geometry of architecture {architecture:?}: missing config keys {keys:?}; add them to config.json or write model.geometry inline")]
    MissingKeys { architecture: String, keys: Vec<String> },
    #[error("config key {key}: {message}")]
    InvalidConfig { key: String, message: String },
    #[error("tensor parallel size {tp}: {message}")]
    TensorParallel { tp: u32, message: String },
    #[error("KV cache dtype {dtype}: {reason}")]
    UnsupportedDtype { dtype: KvCacheDtype, reason: String },
    #[error("{message}")]
    PageSizesNotUnifiable { message: String },
    #[error("quantity {value:?}: {message}")]
    InvalidQuantity { value: String, message: String },
    #[error("{0}")]
    InvalidInput(String),
}

/// Ceiling division, as vLLM's `cdiv`.
pub fn cdiv(a: u64, b: u64) -> u64 {
    a.div_ceil(b.max(1))
}
