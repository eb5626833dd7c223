//! The model: weights (GGUF, Hugging Face safetensors, dummy), tokenizers, the Llama-family
//! and Gemma 3 forward pass on the CPU, and sampling (see `docs/model.md`).

pub mod chat_template;
pub mod dflash;
pub mod drafter;
pub mod eagle3;
pub mod family;
pub mod forward;
pub mod fp8;
pub mod gemma3;
pub mod generation_config;
pub mod gguf;
pub mod hf;
pub mod hf_tokenizer;
pub mod kv;
pub mod linear;
pub mod llama;
pub mod moe;
pub mod paged;
pub mod sampling;
pub mod tokenizer;
pub mod w4;
pub mod weights;

pub use forward::proposer;
