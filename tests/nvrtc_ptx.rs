//! Every kernel specialisation we claim compiles to PTX for every architecture we claim, with
//! NVRTC and the CUDA headers (no GPU needed). NVRTC is a CI requirement: without it this test
//! FAILS with the install hint (`.ci/install-tools` provides it from PyPI wheels).

use kvfleet_cuda::nvrtc::{self, Opt};
use kvfleet_cuda::spec::{Arch, GroupSize, HeadDim, KernelSpec, KvDtype, Mask, PageSize};

/// What the PTX of `spec` on `arch` must hold: the four entries, the tensor-core `mma` in the
/// operand type we meant, async copies, `ldmatrix`, and `wgmma` exactly where the planner
/// expects its 64-row prefill items. Returns what is missing.
fn ptx_lacks(spec: &KernelSpec, arch: Arch, ptx: &str) -> Vec<&'static str> {
    let mut missing = Vec::new();
    for entry in ["kvf_attention", "kvf_decode", "kvf_merge", "kvf_append"] {
        if !ptx.contains(&format!(".entry {entry}")) {
            missing.push(entry);
        }
    }
    let bf16 = spec.dtype == KvDtype::Bf16;
    let mma = if bf16 {
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
    } else {
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
    };
    for want in [mma, "cp.async", "ldmatrix.sync.aligned.m8n8.x4.trans"] {
        if !ptx.contains(want) {
            missing.push(want);
        }
    }
    let wgmma = if bf16 {
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
    missing
}

/// Compiles `jobs` at `opt` and fails with every compile error and every PTX lack at once.
fn assert_all_compile(jobs: Vec<(KernelSpec, Arch)>, opt: Opt) {
    if let Err(e) = nvrtc::toolchain() {
        panic!(
            "{e}\nhint: run `.ci/install-tools` and eval its output (it exports KVFLEET_NVRTC_LIB, \
             KVFLEET_CUDA_INCLUDE and LD_LIBRARY_PATH), or `pip install nvidia-cuda-nvrtc-cu12 \
             nvidia-cuda-runtime-cu12` and point those variables at the wheel's folders"
        );
    }
    let results = nvrtc::compile_pairs(jobs, opt);
    let mut failures = Vec::new();
    for (spec, arch, compiled) in &results {
        match compiled {
            Ok(c) => {
                let missing = ptx_lacks(spec, *arch, &c.ptx);
                if !missing.is_empty() {
                    failures.push(format!(
                        "{} {arch} ({opt:?}): PTX check failed: {missing:?}",
                        spec.key()
                    ));
                }
            }
            Err(e) => failures.push(format!("({opt:?}) {e}")),
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

/// All 1,080 pairs, without device optimisation (`Opt::Check`, NVRTC's `-G`): the same front
/// end, static_asserts and inline PTX as the worker's compile, at a third of its cost (the fully
/// optimised sweep took 20 minutes of a CI run on two cores).
#[test]
fn every_specialisation_compiles_to_ptx_for_every_claimed_arch() {
    let jobs = KernelSpec::all()
        .into_iter()
        .flat_map(|s| Arch::ALL.into_iter().map(move |a| (s, a)))
        .collect();
    assert_all_compile(jobs, Opt::Check);
}

/// Fully optimised, as the worker loads them: every KV dtype and head dim on every
/// architecture, the GQA group and mask rotating so that each of theirs is optimised on every
/// architecture too (90 of the 1,080 pairs).
#[test]
fn every_dtype_and_head_dim_compiles_optimised_for_every_claimed_arch() {
    let mut jobs = Vec::new();
    let mut groups = std::collections::HashSet::new();
    for (i, (dtype, head_dim)) in KvDtype::ALL
        .into_iter()
        .flat_map(|d| HeadDim::ALL.into_iter().map(move |h| (d, h)))
        .enumerate()
    {
        for (j, arch) in Arch::ALL.into_iter().enumerate() {
            // 15 (dtype, head dim) pairs run through the 12 (group, mask) pairs on each arch
            let n = (i + j) % (GroupSize::ALL.len() * Mask::ALL.len());
            let group = GroupSize::ALL[n % GroupSize::ALL.len()];
            let mask = Mask::ALL[n / GroupSize::ALL.len()];
            groups.insert((arch, group, mask));
            let spec = KernelSpec {
                dtype,
                head_dim,
                page: PageSize::P16,
                group,
                mask,
            };
            jobs.push((spec, arch));
        }
    }
    // the rotation reaches every (group, mask) pair on every architecture
    assert_eq!(
        groups.len(),
        Arch::ALL.len() * GroupSize::ALL.len() * Mask::ALL.len()
    );
    assert_all_compile(jobs, Opt::Full);
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
