//! kvfleet on the GPU: the CUDA attention backend (kernels from `kernels/` compiled with NVRTC
//! per specialisation, cached by key, and launched on paged KV caches) and the model's forward
//! pass on the GPU ([`gpu`], with its per-step profile in [`profile`]). The `unsafe` of the GPU
//! path (kernel launches, device memory) lives in this crate; elsewhere kvfleet's `unsafe` is
//! limited to mapping weight files and one pointer split in the CPU forward pass
//! (`tests/architecture.rs` keeps the list).
//!
//! - [`spec`]: the closed set of specialisations, their keys and generated preludes (pure).
//! - [`nvrtc`]: finding NVRTC and the headers, PTX compile cache.
//! - [`plan`]: turning a CSR batch into work items and merge jobs for one step (pure).
//! - [`scenarios`]: random scenarios, the f64 CPU reference and the acceptance bound (pure).
//! - [`device`]: device buffers and launches; [`selftest`]: the preflight check on the real GPU.

pub mod backend;
pub mod device;
pub mod gpu;
pub mod launch;
pub mod nvrtc;
pub mod plan;
pub mod profile;
pub mod scenarios;
pub mod selftest;
pub mod spec;

use std::path::PathBuf;

/// Errors of the CUDA backend. Each message says what to do next.
#[derive(Clone, Debug, thiserror::Error)]
pub enum CudaError {
    #[error(
        "NVRTC (libnvrtc.so) not found in {searched:?} or on LD_LIBRARY_PATH: install the CUDA toolkit, or \
         `pip install nvidia-cuda-nvrtc-cu12` and set KVFLEET_NVRTC_LIB to its nvidia/cuda_nvrtc/lib folder"
    )]
    NvrtcMissing { searched: Vec<PathBuf> },
    #[error(
        "CUDA headers (cuda_fp8.h, cuda_bf16.h) not found in {searched:?}: install the CUDA toolkit, or \
         `pip install nvidia-cuda-runtime-cu12` and set KVFLEET_CUDA_INCLUDE to its nvidia/cuda_runtime/include folder"
    )]
    HeadersMissing { searched: Vec<PathBuf> },
    #[error(
        "the CUDA driver (libcuda.so.1) is not loadable: this node has no NVIDIA driver; use the CPU engine"
    )]
    DriverMissing,
    #[error("NVRTC failed to compile {key} for {arch}; compiler log:\n{log}")]
    Compile {
        key: String,
        arch: &'static str,
        log: String,
    },
    #[error("NVRTC error: {0}")]
    Nvrtc(String),
    #[error("CUDA driver error during {what}: {detail}")]
    Driver { what: &'static str, detail: String },
    #[error(
        "GPU of compute capability {major}.{minor} is not supported by kvfleet's kernels (sm_80 or newer); \
         use the CPU engine or the vLLM runtime"
    )]
    UnsupportedDevice { major: i32, minor: i32 },
    #[error("no kernel specialisation for {what}; supported: {supported}")]
    UnsupportedShape { what: String, supported: &'static str },
    #[error("GPU self-test failed, the kernels disagree with the CPU reference: {0}")]
    SelfTest(String),
    /// A specialisation that failed to compile or to pass its self-test, and where.
    #[error("{key} on {gpu} ({arch}): {error}")]
    SpecFailed {
        key: String,
        gpu: String,
        arch: String,
        error: Box<CudaError>,
    },
    #[error("invalid batch: {0}")]
    InvalidBatch(String),
    #[error("internal lock poisoned by an earlier panic; restart the worker")]
    Poisoned,
}

/// Wraps a cudarc driver error with what we were doing.
pub(crate) fn driver_err(what: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> CudaError {
    move |e| CudaError::Driver {
        what,
        detail: format!("{e:?}"),
    }
}
