//! What runs where (pure, no I/O): compute capabilities, GPU products, KV dtypes,
//! attention backends and the rule sets of each runtime, each rule with its source.

pub mod cc;
pub mod engine;
pub mod features;
pub mod products;
pub mod rules;
pub mod vllm_versions;
pub mod vocab;

#[cfg(test)]
mod tests;

pub use cc::{ComputeCapability, ParseComputeCapabilityError};
pub use features::ModelFeatures;
pub use products::Product;
pub use rules::{evaluate, evaluate_at, Evaluation, Rule, Severity, Violation};
pub use vllm_versions::VllmVersion;
pub use vocab::{AttentionBackend, KvCacheDtype, Quantization, Runtime, SpeculativeMethod, UnknownValue};
