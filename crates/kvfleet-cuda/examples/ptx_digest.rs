//! Prints one line per (kernel specialisation, architecture): the key, the architecture, the
//! PTX length and a digest of the PTX NVRTC makes of the attention program. A change to the
//! kernel sources that claims to be a pure move or a refactor without effect proves it by an
//! identical listing before and after:
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
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use kvfleet_cuda::nvrtc;
use kvfleet_cuda::spec::{Arch, KernelSpec};

fn main() {
    if let Err(e) = nvrtc::toolchain() {
        eprintln!("ptx_digest: {e}");
        std::process::exit(2);
    }
    let jobs: Vec<(KernelSpec, Arch)> = KernelSpec::all()
        .into_iter()
        .flat_map(|s| Arch::ALL.into_iter().map(move |a| (s, a)))
        .collect();
    let next = AtomicUsize::new(0);
    let lines = Mutex::new(Vec::with_capacity(jobs.len()));
    let failed = AtomicUsize::new(0);
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some((spec, arch)) = jobs.get(i) else { break };
                match nvrtc::compile(spec, *arch) {
                    Ok(c) => {
                        // SipHash with fixed keys: the same bytes give the same digest on every run.
                        let mut h = DefaultHasher::new();
                        h.write(c.ptx.as_bytes());
                        let line = format!("{} {} {} {:016x}", spec.key(), arch, c.ptx.len(), h.finish());
                        lines.lock().unwrap().push(line);
                    }
                    Err(e) => {
                        eprintln!("{} {arch}: {e}", spec.key());
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
    });
    let mut lines = lines.into_inner().unwrap();
    lines.sort();
    for l in &lines {
        println!("{l}");
    }
    if failed.load(Ordering::Relaxed) > 0 {
        std::process::exit(1);
    }
}
