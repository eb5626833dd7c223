//! Model runtime: weights (GGUF, Hugging Face safetensors, dummy), tokenizer, the Llama-family forward pass and
//! sampling, served through an OpenAI-compatible API (see `docs/model.md`).

pub mod forward;
pub mod gguf;
pub mod gpu;
pub mod hf;
pub mod hf_tokenizer;
pub mod kv;
pub mod llama;
pub mod openai;
pub mod profile;
pub mod runtime;
pub mod sampling;
pub mod serve;
pub mod tokenizer;
