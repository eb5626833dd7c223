//! The GPU forward pass's error, and the wrappers that turn driver, cuBLAS and backend errors
//! into it.

use cudarc::cublas::result as blas_result;
use cudarc::driver::CudaSlice;
use kvfleet_engine::model::llama::ForwardError;

use crate::{driver_err, CudaError};

/// Errors of the GPU forward pass. Each message says what to do next.
#[derive(Debug, Clone, thiserror::Error)]
pub enum GpuError {
    #[error(transparent)]
    Cuda(#[from] CudaError),
    #[error(
        "cuBLAS (libcublas.so) is not loadable: put the CUDA toolkit's lib folder (e.g. /usr/local/cuda/lib64, \
         or the `nvidia-cublas-cu12` wheel's nvidia/cublas/lib) on LD_LIBRARY_PATH, or run the model with \
         --attention-backend KVFLEET_CPU"
    )]
    CublasMissing,
    #[error(
        "no CUDA device is visible (check the NVIDIA driver and CUDA_VISIBLE_DEVICES), or run the model with \
         --attention-backend KVFLEET_CPU"
    )]
    NoDevice,
    #[error("cuBLAS failed during {what}: {detail}")]
    Cublas { what: &'static str, detail: String },
    #[error("GPU attention backend: {0}")]
    Backend(String),
    #[error(
        "the model does not fit kvfleet's GPU kernels: {0}; run it with --attention-backend KVFLEET_CPU"
    )]
    Unsupported(String),
    #[error(
        "not enough GPU memory: {0}; use a smaller model, lower maxNumBatchedTokens, or run it with \
         --attention-backend KVFLEET_CPU"
    )]
    Memory(String),
    #[error("the attention kernels failed their self-test on the served geometry and KV dtype: {0}")]
    SelfTest(crate::CudaError),
    #[error("invalid GPU model: {0}")]
    Invalid(String),
}

impl From<GpuError> for ForwardError {
    fn from(e: GpuError) -> Self {
        ForwardError::Device(Box::new(e))
    }
}

pub(super) fn cublas_err(what: &'static str) -> impl FnOnce(blas_result::CublasError) -> GpuError {
    move |e| GpuError::Cublas {
        what,
        detail: format!("{e:?}"),
    }
}

pub(super) fn drv(what: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> GpuError {
    move |e| GpuError::Cuda(driver_err(what)(e))
}

pub(super) fn backend_err(e: kvfleet_engine::engine::BackendError) -> GpuError {
    GpuError::Backend(e.to_string())
}

/// `Ok` when `buf` holds at least the `n` elements a launch will touch.
pub(super) fn need<T>(what: &'static str, buf: &CudaSlice<T>, n: usize) -> Result<(), GpuError> {
    if buf.len() < n {
        return Err(GpuError::Invalid(format!(
            "{what} holds {} elements, the step needs {n}",
            buf.len()
        )));
    }
    Ok(())
}
