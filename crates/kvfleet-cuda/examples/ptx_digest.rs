//! Prints one line per (kernel specialisation, architecture): the key, the architecture, the
//! PTX length and a digest of the PTX NVRTC makes of the attention program; then one line per
//! architecture for the model program (`gpu::MODEL_SOURCE`, key `model`). A change to the
//! kernel sources, or to the Rust that assembles them, that claims to be a pure move or a
//! refactor without effect proves it by an identical listing before and after:
//!
//! ```text
//! cargo run --release -p kvfleet-cuda --example ptx_digest > before.txt
//! # ... edit kernels/attention/ ...
//! cargo run --release -p kvfleet-cuda --example ptx_digest > after.txt
//! diff before.txt after.txt
//! ```
//!
//! Needs NVRTC and the CUDA headers (`.ci/install-tools`), no GPU.

use std::collections::hash_map::DefaultHasher;
use std::hash::Hasher;

use kvfleet_cuda::gpu::MODEL_SOURCE;
use kvfleet_cuda::nvrtc;
use kvfleet_cuda::spec::Arch;

/// SipHash with fixed keys: the same bytes give the same digest on every run.
fn digest(ptx: &str) -> u64 {
    let mut h = DefaultHasher::new();
    h.write(ptx.as_bytes());
    h.finish()
}

fn main() {
    if let Err(e) = nvrtc::toolchain() {
        eprintln!("ptx_digest: {e}");
        std::process::exit(2);
    }
    let mut lines = Vec::new();
    let mut failed = 0;
    for (spec, arch, compiled) in nvrtc::compile_all() {
        match compiled {
            Ok(c) => {
                lines.push(format!(
                    "{} {} {} {:016x}",
                    spec.key(),
                    arch,
                    c.ptx.len(),
                    digest(&c.ptx)
                ));
            }
            Err(e) => {
                eprintln!("{} {arch}: {e}", spec.key());
                failed += 1;
            }
        }
    }
    lines.sort();
    for arch in Arch::ALL {
        match nvrtc::compile_source("model", MODEL_SOURCE, arch) {
            Ok((ptx, _)) => lines.push(format!("model {arch} {} {:016x}", ptx.len(), digest(&ptx))),
            Err(e) => {
                eprintln!("model {arch}: {e}");
                failed += 1;
            }
        }
    }
    for l in &lines {
        println!("{l}");
    }
    if failed > 0 {
        std::process::exit(1);
    }
}
