//! 4-bit checkpoints on the GPU (issue 56): kvfleet's CUDA engine has no 4-bit kernel yet, so a
//! model whose linear layers loaded packed (`tests/fixtures/int4/`) is refused when it is put
//! on the GPU, before any upload, with an error naming the format and where it does run.
//! Needs an NVIDIA GPU: `cargo test --test cuda_w4 -- --ignored` on the device.

use std::path::PathBuf;

use kvfleet_cuda::gpu::{GpuLlama, GpuOptions};
use kvfleet_engine::model::hf;

#[test]
#[ignore = "needs an NVIDIA GPU (run through the device tool)"]
fn a_4bit_checkpoint_is_refused_on_the_gpu_naming_its_format_and_the_cpu_engine() {
    let gpu = GpuLlama::open_gpu(0).unwrap_or_else(|e| panic!("cannot open the GPU: {e}"));
    for (name, format) in [
        ("awq-g32", "AWQ 4-bit"),
        ("gptq-g64-asym-act", "GPTQ 4-bit"),
        ("ct-group-asym", "compressed-tensors W4A16"),
    ] {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/int4")
            .join(name);
        let m = hf::load_model(&dir).unwrap();
        let opts = GpuOptions::default();
        let e = match GpuLlama::from_llama(gpu.clone(), &m, &opts) {
            Ok(_) => panic!("{name}: a 4-bit model was put on the GPU"),
            Err(e) => e.to_string(),
        };
        assert!(
            e.contains(format) && e.contains("CUDA engine does not run") && e.contains("runtime: vllm"),
            "{name}: {e}"
        );
    }
}
