//! cuBLASLt's FP8 GEMM ([`Lt`]): one plan a shape, per-row ("outer vector") scales where the
//! library and device take them, else unit scales for the caller to apply (`super::fp8`).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::cublaslt::{result as lt, sys as lt_sys};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use super::error::{drv, need, GpuError};

/// cuBLASLt's workspace: what its FP8 kernels on Hopper ask for at most (the planner's
/// `FP8_GEMM_WORKSPACE_BYTES`).
const LT_WORKSPACE: usize = kvfleet_core::plan::FP8_GEMM_WORKSPACE_BYTES as usize;

/// `CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F` (cuBLAS 12.9, `cublasLtMatmulMatrixScale_t`):
/// one f32 scale per row of `op(A)` and per column of `op(B)`. The bindings target 12.8, where
/// the value is not named; the attribute takes it as a plain 32-bit value, and a library that
/// does not know it refuses the plan, which [`Lt::new`] turns into the unit-scale path.
const SCALE_OUTER_VEC_32F: u32 = 3;

/// How a plan's GEMM meets the scales.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scales {
    /// Per weight row and per token, applied by cuBLASLt (and beta 1 adds to the output).
    OuterVec,
    /// None: unit scales, `kvf_fp8_scale` after.
    Unit,
}

/// One GEMM shape's cuBLASLt descriptors and the algorithm its heuristic picked.
struct LtPlan {
    desc: lt_sys::cublasLtMatmulDesc_t,
    a: lt_sys::cublasLtMatrixLayout_t,
    b: lt_sys::cublasLtMatrixLayout_t,
    c: lt_sys::cublasLtMatrixLayout_t,
    algo: lt_sys::cublasLtMatmulAlgo_t,
}

// SAFETY: the descriptors are plain host objects, used only under the plan cache's lock on the
// GPU's one stream.
unsafe impl Send for LtPlan {}

impl Drop for LtPlan {
    fn drop(&mut self) {
        // SAFETY: each was created once by `LtPlan::new` and is destroyed once here.
        unsafe {
            let _ = lt::destroy_matrix_layout(self.a);
            let _ = lt::destroy_matrix_layout(self.b);
            let _ = lt::destroy_matrix_layout(self.c);
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

fn lt_err(what: &'static str) -> impl FnOnce(cudarc::cublaslt::result::CublasError) -> GpuError {
    move |e| GpuError::Cublas {
        what,
        detail: format!("{e:?}"),
    }
}

/// Sets one matmul-descriptor attribute to the bytes of `v`.
///
/// # Safety
/// `desc` must be live and `T` the type cuBLASLt documents for `attr`.
unsafe fn set_attr<T>(
    desc: lt_sys::cublasLtMatmulDesc_t,
    attr: lt_sys::cublasLtMatmulDescAttributes_t,
    v: &T,
) -> Result<(), cudarc::cublaslt::result::CublasError> {
    // SAFETY: the caller's contract; `v` is read for its size only during the call.
    unsafe {
        lt::set_matmul_desc_attribute(
            desc,
            attr,
            v as *const T as *const c_void,
            std::mem::size_of::<T>(),
        )
    }
}

impl LtPlan {
    /// `D[n x t] = op(A) · B` column-major with `A` the e4m3 weight buffer (`[n, k]` row-major =
    /// `k x n` column-major, transposed: cuBLASLt's FP8 "TN" layout), `B` the e4m3 input
    /// (`[t, k]` row-major = `k x t`) and `C` = `D` f32 (`[t, n]` row-major = `n x t`, ld n).
    /// `None` when cuBLASLt has no algorithm for it (or does not know the scale mode).
    fn new(
        handle: lt_sys::cublasLtHandle_t,
        (t, n, k): (usize, usize, usize),
        scales: Scales,
    ) -> Result<Option<Self>, GpuError> {
        use lt_sys::cublasLtMatmulDescAttributes_t as Attr;
        use lt_sys::cudaDataType::{CUDA_R_32F, CUDA_R_8F_E4M3};
        let e = |what| lt_err(what);
        let desc = lt::create_matmul_desc(lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, CUDA_R_32F)
            .map_err(e("creating an FP8 matmul descriptor"))?;
        let (t64, n64, k64) = (t as u64, n as u64, k as u64);
        let a = lt::create_matrix_layout(CUDA_R_8F_E4M3, k64, n64, k as i64).map_err(e("an FP8 layout"))?;
        let b = lt::create_matrix_layout(CUDA_R_8F_E4M3, k64, t64, k as i64).map_err(e("an FP8 layout"))?;
        let c = lt::create_matrix_layout(CUDA_R_32F, n64, t64, n as i64).map_err(e("an FP8 layout"))?;
        // From here the plan owns the descriptors (dropped with it on any return).
        // SAFETY: cublasLtMatmulAlgo_t is plain data; it is set by the heuristic before use.
        let mut plan = LtPlan {
            desc,
            a,
            b,
            c,
            algo: unsafe { std::mem::zeroed() },
        };
        let trans = cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T;
        // SAFETY: `desc` is live; TRANSA takes a `cublasOperation_t`, the scale modes a u32.
        unsafe { set_attr(desc, Attr::CUBLASLT_MATMUL_DESC_TRANSA, &trans) }
            .map_err(e("the FP8 GEMM's transpose"))?;
        if scales == Scales::OuterVec {
            for attr in [
                Attr::CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                Attr::CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
            ] {
                // SAFETY: as above.
                if unsafe { set_attr(desc, attr, &SCALE_OUTER_VEC_32F) }.is_err() {
                    return Ok(None);
                }
            }
        }
        let pref = lt::create_matmul_pref().map_err(e("an FP8 GEMM preference"))?;
        let ws = LT_WORKSPACE as u64;
        // SAFETY: all descriptors are live; the workspace attribute takes a u64; `pref` is
        // destroyed once after the heuristic.
        let heuristic = unsafe {
            let set = lt::set_matmul_pref_attribute(
                pref,
                lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const u64 as *const c_void,
                8,
            );
            let h = set.and_then(|()| lt::get_matmul_algo_heuristic(handle, desc, a, b, c, c, pref));
            let _ = lt::destroy_matmul_pref(pref);
            h
        };
        match heuristic {
            Ok(h) => {
                plan.algo = h.algo;
                Ok(Some(plan))
            }
            Err(_) => Ok(None),
        }
    }
}

/// A cuBLASLt handle, its workspace and a plan a GEMM shape, on the GPU's stream.
pub(super) struct Lt {
    handle: lt_sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    plans: Mutex<HashMap<(usize, usize, usize), LtPlan>>,
    /// How this library and device take the scales (probed once).
    scales: Scales,
    stream: Arc<CudaStream>,
}

// SAFETY: the handle is used on the GPU's one stream, from one thread at a time (the model is
// stepped by one thread; the plan cache is behind a lock).
unsafe impl Send for Lt {}
unsafe impl Sync for Lt {}

impl Drop for Lt {
    fn drop(&mut self) {
        if let Ok(p) = self.plans.get_mut() {
            p.clear();
        }
        // SAFETY: created once in `Lt::new`, destroyed once here after its plans.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

/// What [`Lt::gemm`] left to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Done {
    /// The output holds the scaled result (added to it when accumulating).
    Scaled,
    /// The output holds the unit-scale product: the scales are still to apply.
    Unscaled,
}

impl Lt {
    /// A handle and its workspace; probes once whether cuBLASLt takes per-row scales here.
    /// `unit_scales`: do not (the path of GPUs and libraries without them, to test and time
    /// it anywhere; `KVFLEET_FP8_UNIT_SCALES=1` in the worker and benchmarks).
    pub fn new(stream: Arc<CudaStream>, unit_scales: bool) -> Result<Self, GpuError> {
        let handle = lt::create_handle().map_err(lt_err("creating the cuBLASLt handle"))?;
        let workspace = stream
            .alloc_zeros::<u8>(LT_WORKSPACE)
            .map_err(drv("allocating the cuBLASLt workspace"))?;
        let outer = !unit_scales && LtPlan::new(handle, (64, 64, 64), Scales::OuterVec)?.is_some();
        let scales = if outer { Scales::OuterVec } else { Scales::Unit };
        tracing::info!(
            version = unsafe { lt_sys::cublasLtGetVersion() },
            per_row_scales = outer,
            "cuBLASLt for the FP8 GEMMs"
        );
        Ok(Lt {
            handle,
            workspace,
            plans: Mutex::new(HashMap::new()),
            scales,
            stream,
        })
    }

    /// Bytes it holds on the device.
    pub fn bytes() -> usize {
        LT_WORKSPACE
    }

    /// Whether [`Lt::gemm`] applies the scales itself (and can add to its output).
    pub fn scales_rows(&self) -> bool {
        self.scales == Scales::OuterVec
    }

    /// Row-major `y[t, n] (+)= (sx[t] sw[n]) (xq[t, k] · wq[n, k]ᵀ)` in f32 from e4m3 inputs;
    /// without per-row scales ([`Lt::scales_rows`] false) `y = xq · wqᵀ` and the caller applies
    /// the scales (and must not ask to accumulate).
    #[allow(clippy::too_many_arguments)] // two operands with their scales, the output, shape, mode
    pub fn gemm(
        &self,
        (wq, sw): (&CudaSlice<u8>, &CudaSlice<f32>),
        (xq, sx): (&CudaSlice<u8>, &CudaSlice<f32>),
        y: &mut CudaSlice<f32>,
        (t, n, k): (usize, usize, usize),
        accumulate: bool,
    ) -> Result<Done, GpuError> {
        if accumulate && !self.scales_rows() {
            return Err(GpuError::Invalid("an unscaled FP8 GEMM cannot accumulate".into()));
        }
        need("FP8 GEMM weight", wq, n * k)?;
        need("FP8 weight scales", sw, n)?;
        need("FP8 GEMM input", xq, t * k)?;
        need("FP8 token scales", sx, t)?;
        need("FP8 GEMM output", y, t * n)?;
        let mut plans = self
            .plans
            .lock()
            .map_err(|_| GpuError::Invalid("FP8 plan cache poisoned".into()))?;
        let plan = match plans.entry((t, n, k)) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(LtPlan::new(self.handle, (t, n, k), self.scales)?.ok_or_else(|| {
                    GpuError::Invalid(format!(
                        "cuBLASLt has no FP8 GEMM for {t} x {n} x {k} (FP8 needs inner sizes that are multiples of 16)"
                    ))
                })?)
            }
        };
        let s = &self.stream;
        let (wp, _rw) = wq.device_ptr(s);
        let (xp, _rx) = xq.device_ptr(s);
        let (swp, _rsw) = sw.device_ptr(s);
        let (sxp, _rsx) = sx.device_ptr(s);
        let (yp, _ry) = y.device_ptr_mut(s);
        let (ws, _rws) = self.workspace.device_ptr(s);
        if self.scales_rows() {
            use lt_sys::cublasLtMatmulDescAttributes_t as Attr;
            let (a, b) = (swp as *const c_void, sxp as *const c_void);
            // SAFETY: the plan's descriptor is live; the scale pointers take device addresses
            // of `n` and `t` f32 (checked above), alive until the GEMM is queued.
            unsafe {
                set_attr(plan.desc, Attr::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a)
                    .and_then(|()| set_attr(plan.desc, Attr::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b))
            }
            .map_err(lt_err("the FP8 GEMM's scale vectors"))?;
        }
        let (alpha, beta) = (1f32, if accumulate { 1f32 } else { 0f32 });
        // SAFETY: the plan's layouts describe exactly these buffers (sizes checked above), C is
        // D (read only with beta 1), alpha/beta are host f32 (the default pointer mode, scale
        // type 32F), the workspace holds LT_WORKSPACE bytes, the plan's limit; everything runs
        // on stream `s`, the stream of every buffer here.
        unsafe {
            lt::matmul(
                self.handle,
                plan.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                wp as *const c_void,
                plan.a,
                xp as *const c_void,
                plan.b,
                yp as *const c_void,
                plan.c,
                yp as *mut c_void,
                plan.c,
                &plan.algo,
                ws as *mut c_void,
                LT_WORKSPACE,
                s.cu_stream() as lt_sys::cudaStream_t,
            )
        }
        .map_err(lt_err("an FP8 GEMM"))?;
        Ok(if self.scales_rows() {
            Done::Scaled
        } else {
            Done::Unscaled
        })
    }
}
