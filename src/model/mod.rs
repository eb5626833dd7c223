//! Model runtime: weights (GGUF, safetensors, dummy), tokenizer, the Llama-family forward
//! pass and sampling, served through the worker's OpenAI-compatible API.
