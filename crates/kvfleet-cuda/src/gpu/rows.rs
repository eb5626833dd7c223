//! What the row kernels of both programs (the model's, `kernels/model.cu`, and the FP8 one,
//! `kernels/fp8.cu`) are launched with: a block per row of [`NORM_THREADS`], an RMSNorm's
//! weight ([`Norm`]) and the gated activation of the gate/up rows ([`Glu`]).

use cudarc::driver::{CudaSlice, LaunchConfig};

/// Threads of a row kernel's block (norms, gathers, the fused FP8 activations).
pub(super) const NORM_THREADS: u32 = 256;

/// A block of `threads` per row.
pub(super) fn rows_cfg(rows: usize, threads: u32, smem: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem as u32,
    }
}

/// An RMSNorm's weight (`[d]`, f32) and epsilon.
#[derive(Clone, Copy)]
pub(super) struct Norm<'a> {
    pub w: &'a CudaSlice<f32>,
    pub eps: f32,
}

impl<'a> Norm<'a> {
    pub fn new(w: &'a CudaSlice<f32>, eps: f32) -> Self {
        Norm { w, eps }
    }
}

/// A gated activation of the gate/up GEMM's `[t, 2 ff]` rows: `act = f(gate) * up`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Glu {
    /// SwiGLU (`kvf_silu_mul`), the Llama family's.
    Silu,
    /// GeGLU with the tanh approximation (`kvf_gelu_tanh_mul`), Gemma 3's.
    GeluTanh,
}
