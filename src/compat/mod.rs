//! What runs where (pure, no I/O): compute capabilities, GPU products, KV dtypes,
//! attention backends and the rule sets of each runtime, each rule with its source.

pub mod vocab;

pub use vocab::{AttentionBackend, KvCacheDtype, Runtime, UnknownValue};
