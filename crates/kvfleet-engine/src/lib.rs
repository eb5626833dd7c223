//! kvfleet's engine, its pure parts: the paged KV cache and the scheduler ([`engine`]), and the
//! model ([`model`]: GGUF and safetensors loading, tokenizers, the forward pass on the CPU,
//! sampling). No async runtime, no CUDA: the GPU backend (`kvfleet-cuda`) implements this
//! crate's traits, and the worker drives it.

pub mod engine;
pub mod model;
