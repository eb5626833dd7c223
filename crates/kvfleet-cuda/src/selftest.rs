//! The worker's preflight self-test: compile the kernels for the real device, run a small mixed
//! batch (split decode, multi-token decode, prefill chunk) and compare with the CPU reference.

use super::device::{Gpu, KvLayer, StepBuffers};
use super::plan::plan_step;
use super::scenarios::{Comparison, RequestShape, Scenario};
use super::spec::KernelSpec;
use super::{driver_err, CudaError};

/// The shapes of the self-test: decode requests whose keys are not page multiples (one long
/// enough to be split), a 3-token decode, a 70-token prefill chunk after 130 held keys and a
/// request whose leading pages were freed (first_pos > 0).
pub fn shapes() -> Vec<RequestShape> {
    vec![
        RequestShape {
            q_len: 1,
            n_keys: 1,
            first_pos: 0,
        },
        RequestShape {
            q_len: 1,
            n_keys: 17,
            first_pos: 0,
        },
        RequestShape {
            q_len: 1,
            n_keys: 1000,
            first_pos: 0,
        },
        RequestShape {
            q_len: 3,
            n_keys: 301,
            first_pos: 0,
        },
        RequestShape {
            q_len: 70,
            n_keys: 200,
            first_pos: 0,
        },
        RequestShape {
            q_len: 129,
            n_keys: 129,
            first_pos: 0,
        },
        RequestShape {
            q_len: 1,
            n_keys: 90,
            first_pos: 64,
        },
    ]
}

/// Runs `spec` on a random scenario with a poisoned output and checks FlashAttention's bound.
pub fn run(gpu: &Gpu, spec: &KernelSpec, kv_heads: usize, seed: u64) -> Result<Comparison, CudaError> {
    let window = 48;
    let sc = Scenario::random(*spec, kv_heads, &shapes(), window, seed, None);
    let kernels = gpu.kernels(spec)?;
    let kv = KvLayer::from_scenario(gpu, &sc)?;
    // few target CTAs so the 1000-key request is split and merged
    let plan = plan_step(&sc.batch, spec, gpu.arch, kv_heads, 8);
    let mut step = StepBuffers::upload(gpu, spec, &kv, &sc.batch, &plan)?;
    let q = gpu.upload(&sc.q)?;
    // poison: bf16 NaN everywhere, so an unwritten element fails the check
    let mut o = gpu.upload(&vec![0x7fc1u16; sc.q.len()])?;
    kernels.attention(gpu.stream(), &kv, &q, &mut o, &mut step, sc.sm_scale, window)?;
    gpu.synchronize()?;
    let out = gpu
        .stream()
        .clone_dtoh(&o)
        .map_err(driver_err("copying the output back"))?;
    let refs = sc.references(None, None);
    sc.check(&refs, &out, 1e-3).map_err(CudaError::SelfTest)
}
