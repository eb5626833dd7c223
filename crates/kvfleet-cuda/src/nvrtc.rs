//! Finding NVRTC and the CUDA headers, and compiling specialisations to PTX, cached by key.
//!
//! Search order for both: `KVFLEET_NVRTC_LIB` / `KVFLEET_CUDA_INCLUDE` (set by `.ci/install-tools`
//! from the PyPI wheels `nvidia-cuda-nvrtc-cu12` and `nvidia-cuda-runtime-cu12`), then
//! `/usr/local/cuda`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::spec::{Arch, KernelSpec};
use super::CudaError;

/// Where NVRTC and the headers were found.
#[derive(Clone, Debug)]
pub struct Toolchain {
    /// Folder holding the loaded `libnvrtc.so*`, when we loaded it by path.
    pub lib_dir: Option<PathBuf>,
    /// Folder with `cuda_bf16.h`, `cuda_fp16.h`, `cuda_fp8.h`.
    pub include_dir: PathBuf,
    /// NVRTC's own version (major, minor).
    pub version: (i32, i32),
}

const LIB_NAMES: [&str; 4] = [
    "libnvrtc.so",
    "libnvrtc.so.13",
    "libnvrtc.so.12",
    "libnvrtc.so.12.9",
];

fn candidate_lib_dirs() -> Vec<PathBuf> {
    let mut v = Vec::new();
    if let Some(d) = std::env::var_os("KVFLEET_NVRTC_LIB") {
        v.push(PathBuf::from(d));
    }
    v.push(PathBuf::from("/usr/local/cuda/lib64"));
    v
}

fn candidate_include_dirs() -> Vec<PathBuf> {
    let mut v = Vec::new();
    if let Some(d) = std::env::var_os("KVFLEET_CUDA_INCLUDE") {
        v.push(PathBuf::from(d));
    }
    v.push(PathBuf::from("/usr/local/cuda/include"));
    v
}

/// Libraries we opened by full path stay loaded for the life of the process, so cudarc's
/// later `dlopen` by soname finds the already-loaded object.
static PRELOADED: OnceLock<Vec<libloading::Library>> = OnceLock::new();

fn preload_nvrtc() -> Option<PathBuf> {
    let mut found = None;
    let mut libs = Vec::new();
    'dirs: for dir in candidate_lib_dirs() {
        for name in LIB_NAMES {
            let p = dir.join(name);
            if p.exists() {
                // SAFETY: loading NVRTC runs only its ELF initialisers, which have no
                // preconditions; we never call through this handle directly.
                if let Ok(lib) = unsafe { libloading::Library::new(&p) } {
                    libs.push(lib);
                    found = Some(dir.clone());
                    break 'dirs;
                }
            }
        }
    }
    let _ = PRELOADED.set(libs);
    found
}

fn find_include_dir() -> Option<PathBuf> {
    candidate_include_dirs()
        .into_iter()
        .find(|d| d.join("cuda_fp8.h").exists() && d.join("cuda_bf16.h").exists())
}

static TOOLCHAIN: OnceLock<Result<Toolchain, CudaError>> = OnceLock::new();

/// Locates (once per process) NVRTC and the headers. Never panics: cudarc would panic on a
/// missing library, so presence is checked with `is_culib_present()` first.
pub fn toolchain() -> Result<Toolchain, CudaError> {
    TOOLCHAIN
        .get_or_init(|| {
            let lib_dir = preload_nvrtc();
            // SAFETY: `is_culib_present` only tries `dlopen` on candidate names.
            if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
                return Err(CudaError::NvrtcMissing {
                    searched: candidate_lib_dirs(),
                });
            }
            let include_dir = find_include_dir().ok_or(CudaError::HeadersMissing {
                searched: candidate_include_dirs(),
            })?;
            let (mut major, mut minor) = (0, 0);
            // SAFETY: nvrtcVersion writes two ints through valid pointers; the library is loaded.
            unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }
                .result()
                .map_err(|e| CudaError::Nvrtc(format!("{e:?}")))?;
            let version = (major, minor);
            Ok(Toolchain {
                lib_dir,
                include_dir,
                version,
            })
        })
        .clone()
}

/// PTX text for one specialisation and target, with how long NVRTC took.
#[derive(Clone, Debug)]
pub struct CompiledPtx {
    pub spec: KernelSpec,
    pub arch: Arch,
    pub ptx: Arc<str>,
    pub compile_time: Duration,
}

/// How NVRTC optimises device code. The worker loads [`Opt::Full`] PTX; [`Opt::Check`] (NVRTC's
/// `-G`: no device optimisation, with debug information) makes the same front end, the same
/// `static_assert`s and the same inline PTX (`mma`, `cp.async`, `ldmatrix`, `wgmma`) in about a
/// third of the time, for sweeps that ask only whether every source compiles and what its PTX
/// contains (`tests/nvrtc_ptx.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Opt {
    Full,
    Check,
}

/// Compiles `spec` for `arch` with NVRTC (no GPU needed), fully optimised.
pub fn compile(spec: &KernelSpec, arch: Arch) -> Result<CompiledPtx, CudaError> {
    compile_with(spec, arch, Opt::Full)
}

/// [`compile`] at the optimisation `opt`.
pub fn compile_with(spec: &KernelSpec, arch: Arch, opt: Opt) -> Result<CompiledPtx, CudaError> {
    let key = spec.key();
    let (ptx, compile_time) = compile_source_with(&key, &spec.source(), arch, opt)?;
    Ok(CompiledPtx {
        spec: *spec,
        arch,
        ptx,
        compile_time,
    })
}

/// Compiles every specialisation we claim ([`KernelSpec::all`]) for every architecture we claim
/// ([`Arch::ALL`]), fully optimised, in parallel on the rayon pool: one entry per pair, in that
/// order. For listings of their PTX (`examples/ptx_digest.rs`); the worker compiles only what its
/// model needs ([`PtxCache`]).
pub fn compile_all() -> Vec<(KernelSpec, Arch, Result<CompiledPtx, CudaError>)> {
    compile_pairs(
        KernelSpec::all()
            .into_iter()
            .flat_map(|s| Arch::ALL.into_iter().map(move |a| (s, a)))
            .collect(),
        Opt::Full,
    )
}

/// Compiles each `(spec, arch)` pair of `jobs` at `opt`, in parallel on the rayon pool, in order.
pub fn compile_pairs(
    jobs: Vec<(KernelSpec, Arch)>,
    opt: Opt,
) -> Vec<(KernelSpec, Arch, Result<CompiledPtx, CudaError>)> {
    use rayon::prelude::*;
    jobs.into_par_iter()
        .map(|(spec, arch)| (spec, arch, compile_with(&spec, arch, opt)))
        .collect()
}

/// Compiles a complete CUDA source (e.g. `kernels/model.cu`) for `arch` with NVRTC and the
/// same options as the attention kernels, fully optimised; `key` names it in errors. Returns
/// PTX and how long NVRTC took.
pub fn compile_source(key: &str, source: &str, arch: Arch) -> Result<(Arc<str>, Duration), CudaError> {
    compile_source_with(key, source, arch, Opt::Full)
}

/// [`compile_source`] at the optimisation `opt`.
pub fn compile_source_with(
    key: &str,
    source: &str,
    arch: Arch,
    opt: Opt,
) -> Result<(Arc<str>, Duration), CudaError> {
    let tc = toolchain()?;
    let start = Instant::now();
    let mut options = vec!["--std=c++17".to_string(), "-default-device".to_string()];
    if opt == Opt::Check {
        options.push("--device-debug".into());
    }
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some(arch.nvrtc_arch()),
        include_paths: vec![path_str(&tc.include_dir)],
        options,
        name: Some(format!("{}.cu", key.replace('/', "_"))),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(source, opts).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => CudaError::Compile {
            key: key.to_string(),
            arch: arch.as_str(),
            log: log.to_string_lossy().into_owned(),
        },
        other => CudaError::Nvrtc(format!("{other:?}")),
    })?;
    Ok((Arc::from(ptx.to_src()), start.elapsed()))
}

fn path_str(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// Compiled PTX by (key, arch): compile once per specialisation at start-up, never on the
/// request path.
#[derive(Default)]
pub struct PtxCache {
    map: Mutex<HashMap<(KernelSpec, Arch), CompiledPtx>>,
}

impl PtxCache {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn get_or_compile(&self, spec: &KernelSpec, arch: Arch) -> Result<CompiledPtx, CudaError> {
        if let Some(hit) = self
            .map
            .lock()
            .map_err(|_| CudaError::Poisoned)?
            .get(&(*spec, arch))
        {
            return Ok(hit.clone());
        }
        let compiled = compile(spec, arch)?;
        self.map
            .lock()
            .map_err(|_| CudaError::Poisoned)?
            .insert((*spec, arch), compiled.clone());
        Ok(compiled)
    }

    pub fn len(&self) -> usize {
        self.map.lock().map(|m| m.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
