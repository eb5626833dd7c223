//! Every kernel specialisation we claim compiles to PTX for every architecture we claim, with
//! NVRTC and the CUDA headers (no GPU needed). NVRTC is a CI requirement: without it this test
//! FAILS with the install hint (`.ci/install-tools` provides it from PyPI wheels).

use kvfleet_cuda::nvrtc;
use kvfleet_cuda::spec::Arch;

#[test]
fn every_specialisation_compiles_to_ptx_for_every_claimed_arch() {
    if let Err(e) = nvrtc::toolchain() {
        panic!(
            "{e}\nhint: run `.ci/install-tools` and eval its output (it exports KVFLEET_NVRTC_LIB, \
             KVFLEET_CUDA_INCLUDE and LD_LIBRARY_PATH), or `pip install nvidia-cuda-nvrtc-cu12 \
             nvidia-cuda-runtime-cu12` and point those variables at the wheel's folders"
        );
    }
    let results = nvrtc::compile_all();
    let mut failures = Vec::new();
    for (spec, arch, compiled) in &results {
        let (spec, arch) = (*spec, *arch);
        match compiled {
            Ok(c) => {
                let ptx = &c.ptx;
                let mut missing = Vec::new();
                for entry in ["kvf_attention", "kvf_decode", "kvf_merge", "kvf_append"] {
                    if !ptx.contains(&format!(".entry {entry}")) {
                        missing.push(entry);
                    }
                }
                // tensor cores and async copies must be there, in the operand type we meant
                let mma = if spec.dtype == kvfleet_cuda::spec::KvDtype::Bf16 {
                    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
                } else {
                    "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
                };
                for want in [mma, "cp.async", "ldmatrix.sync.aligned.m8n8.x4.trans"] {
                    if !ptx.contains(want) {
                        missing.push(want);
                    }
                }
                // the wgmma prefill CTA exactly where the planner expects its 64-row items
                let wgmma = if spec.dtype == kvfleet_cuda::spec::KvDtype::Bf16 {
                    "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16"
                } else {
                    "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16"
                };
                if spec.wgmma_prefill(arch) != ptx.contains(wgmma) {
                    missing.push(if spec.wgmma_prefill(arch) {
                        "wgmma (the planner expects it)"
                    } else {
                        "no wgmma (the planner does not expect it)"
                    });
                }
                if !missing.is_empty() {
                    failures.push(format!("{} {}: PTX check failed: {missing:?}", spec.key(), arch));
                }
            }
            Err(e) => failures.push(e.to_string()),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} compiles failed:\n{}",
        failures.len(),
        results.len(),
        failures.join("\n")
    );
}

#[test]
fn model_kernels_compile_to_ptx_for_every_claimed_arch() {
    use kvfleet_cuda::gpu::{MODEL_KERNELS, MODEL_SOURCE};
    if let Err(e) = nvrtc::toolchain() {
        panic!("{e}\nhint: run `.ci/install-tools` and eval its output (see the test above)");
    }
    let mut failures = Vec::new();
    for arch in Arch::ALL {
        match nvrtc::compile_source("model", MODEL_SOURCE, arch) {
            Ok((ptx, _)) => {
                let missing: Vec<&str> = MODEL_KERNELS
                    .iter()
                    .copied()
                    .filter(|k| !ptx.contains(&format!(".entry {k}")))
                    .collect();
                if !missing.is_empty() {
                    failures.push(format!("model {arch}: PTX lacks {missing:?}"));
                }
            }
            Err(e) => failures.push(e.to_string()),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The FP8 program (`kernels/fp8.cu` after the model program) for the architectures with FP8:
/// every model kernel and the three FP8 ones, the e4m3 conversions as the hardware's `cvt`
/// (not the header's software path).
#[test]
fn fp8_kernels_compile_to_ptx_for_every_arch_with_fp8() {
    use kvfleet_cuda::gpu::{FP8_KERNELS, FP8_SOURCE, MODEL_KERNELS};
    if let Err(e) = nvrtc::toolchain() {
        panic!("{e}\nhint: run `.ci/install-tools` and eval its output (see the test above)");
    }
    let mut failures = Vec::new();
    for arch in Arch::ALL.into_iter().filter(|a| *a >= Arch::Sm89) {
        match nvrtc::compile_source("model+fp8", FP8_SOURCE, arch) {
            Ok((ptx, _)) => {
                let missing: Vec<&str> = MODEL_KERNELS
                    .iter()
                    .chain(&FP8_KERNELS)
                    .copied()
                    .filter(|k| !ptx.contains(&format!(".entry {k}")))
                    .collect();
                if !missing.is_empty() {
                    failures.push(format!("model+fp8 {arch}: PTX lacks {missing:?}"));
                }
                for cvt in ["cvt.rn.f16x2.e4m3x2", "cvt.rn.satfinite.e4m3x2.f32"] {
                    if !ptx.contains(cvt) {
                        failures.push(format!("model+fp8 {arch}: no {cvt} in the PTX"));
                    }
                }
            }
            Err(e) => failures.push(e.to_string()),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
