//! The Llama-family forward pass on an NVIDIA GPU, the same math as the CPU's `Llama::forward`:
//! GEMMs on cuBLAS (bf16 weights and activations, f32 accumulation), attention through the
//! engine's [`CudaBackend`](crate::backend::CudaBackend) on a paged KV cache, and the rest in
//! the small NVRTC kernels of `kernels/model.cu`. A step of one token (one stream decoding)
//! runs each projection as one fused GEMV instead (`kernels/gemv.cu`).
//!
//! GQA groups the attention kernels do not specialise for (SmolLM2's 9 query heads over 3
//! KV heads) store each KV head `kv_rep` times, turning the group into one they do (3 -> 1).
//!
//! The rooms, plumbing below the model:
//! - `error`: [`GpuError`] and the wrappers of driver, cuBLAS and backend errors;
//! - `linear`: [`Linear`](linear::Linear), a projection's weight in its format and the op that
//!   picks its kernel (family files name no kernel);
//! - `kernels`: the model program, its PTX, one launcher per kernel; `gemv`: the single-token
//!   projections; `blas`: the GEMMs; `fp8`: FP8 weights (W8A8: the quantizing and fused
//!   kernels), `lt`: their GEMM through cuBLASLt; `rows`: what the row kernels of both programs
//!   are launched with; `sampling`: the picks on the device;
//! - `shape`: the geometries the kernels cover; `options`: [`GpuOptions`], [`GpuCapacity`];
//!   `tuning`: [`GpuTuning`], the lab knobs, and the one place the environment is read;
//!   `weights`: upload and random weights; `arena`: the activation buffers; `pools`: KV pool
//!   sizing;
//! - `step`: what a family's layers run with and the [`Family`](step::Family) trait, one file
//!   per family (`llama`, `gemma3`); `model`: [`GpuLlama`] and how it is built; `forward`: its
//!   step and the engine's `Forward`; `drafter`: speculative drafters beside the model (EAGLE-3
//!   there, DFlash in `dflash`, what both run with in `features`).

mod arena;
mod blas;
mod dflash;
mod drafter;
mod error;
mod features;
mod forward;
mod fp8;
mod gemma3;
mod gemv;
mod kernels;
mod linear;
mod llama;
mod lt;
mod model;
mod options;
mod pools;
mod rows;
mod sampling;
mod shape;
mod step;
mod tuning;
mod weights;

pub use blas::cublas_present;
pub use error::GpuError;
pub use fp8::{check_device as check_fp8_device, cublaslt_present};
pub use kernels::{fp8_ptx, model_ptx, FP8_KERNELS, FP8_SOURCE, MODEL_KERNELS, MODEL_SOURCE};
pub use model::{check_available, GpuLlama};
pub use options::{DraftReserve, GpuCapacity, GpuOptions, BLOCK_SIZE};
pub use options::{Fp8Fusion, Fp8Scales, GpuTuning};
pub use sampling::{pick_rows_on_device, sample_rows_on_device};
pub use shape::kv_replication;
