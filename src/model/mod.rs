//! Model runtime: the serving loop over the engine ([`runtime`]), the OpenAI-compatible API
//! ([`openai`]) and putting a model on its device ([`serve`]). The pure parts (weights,
//! tokenizers, the CPU forward pass, sampling) are `kvfleet-engine`'s; the GPU forward pass is
//! `kvfleet-cuda`'s. They are re-exported here under their old paths.

pub use kvfleet_cuda::{gpu, profile};
pub use kvfleet_engine::model::{forward, gguf, hf, hf_tokenizer, kv, llama, sampling, tokenizer};

pub mod kv_events;
pub mod metrics;
pub mod openai;
pub mod runtime;
pub mod serve;
