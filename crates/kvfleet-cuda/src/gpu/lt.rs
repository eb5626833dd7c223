//! cuBLASLt's FP8 GEMM ([`Lt`]): one plan a shape, with per-row ("outer vector") scales or
//! with unit scales for the caller to apply (`super::fp8`'s fused consumers). Whether the
//! library takes per-row scales is asked per shape, with the scale vectors' addresses set (on
//! an H200, cuBLASLt 13.1 refuses them without the addresses: for the 64 x 64 x 64 probe made
//! before and for the model's shapes alike), and where it does, both ways are timed once for
//! each power-of-two bucket of token counts and `(n, k)` ([`bucket`]) and the faster is kept
//! for the bucket ([`ScalePick::Timed`]): there the unit-scale kernels of a
//! 256-token decode step are 9-22% faster, the per-row one of a 2,048-token prefill's down
//! projection 6-11% (bench/RESULTS.md, issue 32, 2026-12-02, `bench/device/lt_tune.cu`).

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
/// does not know it refuses the plan, which [`Lt`] turns into the unit-scale path for that shape.
const SCALE_OUTER_VEC_32F: u32 = 3;

/// How [`Lt`] chooses between per-row and unit scales ([`GpuTuning::fp8_scales`]): both timed
/// once a [`bucket`] of token counts and `(n, k)` where the library takes per-row scales, the
/// faster kept for the bucket (unit scales only when at least [`UNIT_MARGIN`] faster); or one
/// of the two everywhere.
///
/// [`GpuTuning::fp8_scales`]: super::options::GpuTuning::fp8_scales
pub(super) use super::options::Fp8Scales as ScalePick;

/// A unit-scale plan is kept over a per-row one only when its time is at most this share of
/// the per-row time: its consumers apply the scales (and the O and down projections' residual
/// add) in work the GEMM's timing does not see, and a pick that flips on noise would make a
/// shape's rounding depend on the run. At 0.97 a 2,048-token prefill on an H200 took the unit
/// plan of gate/up (0.96 of the per-row time alone) and ran 1.7% slower than per-row plans
/// everywhere; the 256-token decode step's unit plans are 0.78-0.93 (bench/RESULTS.md, issue 32).
const UNIT_MARGIN: f32 = 0.95;

/// Launches a timed candidate gets: this many warm-ups, then this many in each of two timed
/// rounds, the candidates' rounds interleaved.
const TIMING_WARMUPS: usize = 2;
const TIMING_LAUNCHES: usize = 5;

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
    scales: Scales,
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

/// Points a per-row plan's descriptor at the weight's (`a`) and the input's (`b`) scale vectors.
///
/// # Safety
/// `desc` must be live; `a` and `b` are device addresses of f32 vectors that outlive every
/// GEMM queued with it before the next call.
unsafe fn set_scale_ptrs(desc: lt_sys::cublasLtMatmulDesc_t, a: u64, b: u64) -> Result<(), GpuError> {
    use lt_sys::cublasLtMatmulDescAttributes_t as Attr;
    let (a, b) = (a as *const c_void, b as *const c_void);
    // SAFETY: the caller's contract; the scale-pointer attributes take a device address.
    unsafe {
        set_attr(desc, Attr::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a)
            .and_then(|()| set_attr(desc, Attr::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b))
    }
    .map_err(lt_err("the FP8 GEMM's scale vectors"))
}

impl LtPlan {
    /// `D[n x t] = op(A) · B` column-major with `A` the e4m3 weight buffer (`[n, k]` row-major =
    /// `k x n` column-major, transposed: cuBLASLt's FP8 "TN" layout), `B` the e4m3 input
    /// (`[t, k]` row-major = `k x t`) and `C` = `D` f32 (`[t, n]` row-major = `n x t`, ld n).
    /// `None` when cuBLASLt has no algorithm for it (or does not know the scale mode).
    /// `ptrs`: the device addresses of the weight's and the input's scale vectors, set before
    /// the heuristic (per-row scales; [`Lt::launch`] sets them again for each GEMM).
    fn new(
        handle: lt_sys::cublasLtHandle_t,
        (t, n, k): (usize, usize, usize),
        scales: Scales,
        ptrs: (u64, u64),
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
            scales,
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
            // SAFETY: `desc` is live; `ptrs` are the scale vectors' device addresses (the
            // heuristic only reads the descriptor).
            unsafe { set_scale_ptrs(desc, ptrs.0, ptrs.1) }?;
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

/// The plans by shape `(t, n, k)`, and the timed scale choices by [`bucket`] of `t`, `n`, `k`.
#[derive(Default)]
struct Plans {
    by_shape: HashMap<(usize, usize, usize), LtPlan>,
    chosen: HashMap<(usize, usize, usize), Scales>,
}

/// The token counts one timed choice answers for: `t` rounded up to a power of two. A serving
/// step's token count changes from step to step (decode batches, prefill chunks); timing every
/// new count made the first pass over them slower (a 256-stream load through HTTP on an H200:
/// 23,049 tok/s in its first round against 24,912 in its second, 2026-12-02), while the choice
/// changes with the count's size, not its exact value (unit plans are faster at 256 tokens,
/// per-row ones at 2,048: bench/RESULTS.md, issue 32). Each exact shape still gets its own plan
/// (the library's heuristic is asked per shape); only the timing is shared.
fn bucket(t: usize) -> usize {
    t.max(1).next_power_of_two()
}

/// A cuBLASLt handle, its workspace and a plan a GEMM shape, on the GPU's stream.
pub(super) struct Lt {
    handle: lt_sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    plans: Mutex<Plans>,
    pick: ScalePick,
    stream: Arc<CudaStream>,
}

// SAFETY: the handle is used on the GPU's one stream, from one thread at a time (the model is
// stepped by one thread; the plan cache is behind a lock).
unsafe impl Send for Lt {}
unsafe impl Sync for Lt {}

impl Drop for Lt {
    fn drop(&mut self) {
        if let Ok(p) = self.plans.get_mut() {
            p.by_shape.clear();
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
    /// A handle and its workspace. `pick`: whether per-row scales may be used
    /// ([`ScalePick`]).
    pub fn new(stream: Arc<CudaStream>, pick: ScalePick) -> Result<Self, GpuError> {
        let handle = lt::create_handle().map_err(lt_err("creating the cuBLASLt handle"))?;
        let workspace = stream
            .alloc_zeros::<u8>(LT_WORKSPACE)
            .map_err(drv("allocating the cuBLASLt workspace"))?;
        // Whether the library takes per-row scales is asked per shape, of the shape itself: a
        // probe of one small shape does not answer for the model's (see the module's note).
        tracing::info!(
            version = unsafe { lt_sys::cublasLtGetVersion() },
            ?pick,
            "cuBLASLt for the FP8 GEMMs"
        );
        Ok(Lt {
            handle,
            workspace,
            plans: Mutex::new(Plans::default()),
            pick,
            stream,
        })
    }

    /// Bytes it holds on the device.
    pub fn bytes() -> usize {
        LT_WORKSPACE
    }

    /// Whether [`Lt::gemm`] of this shape applies the scales itself (and can add to its
    /// output). Plans the shape when it is new: with [`ScalePick::Timed`], both ways are
    /// timed on these operands into `out` (`[t, n]` f32 that the caller is about to
    /// overwrite; its contents are left undefined).
    pub fn scales_rows_for(
        &self,
        w: (&CudaSlice<u8>, &CudaSlice<f32>),
        x: (&CudaSlice<u8>, &CudaSlice<f32>),
        out: &mut CudaSlice<f32>,
        dims: (usize, usize, usize),
    ) -> Result<bool, GpuError> {
        let mut plans = self.lock()?;
        Ok(self.plan(&mut plans, w, x, Some(out), dims)?.scales == Scales::OuterVec)
    }

    /// Whether the plan of `dims` has per-row scales (`None`: not planned yet).
    #[cfg(test)]
    pub fn planned_per_row(&self, dims: (usize, usize, usize)) -> Option<bool> {
        let plans = self.plans.lock().ok()?;
        plans.by_shape.get(&dims).map(|p| p.scales == Scales::OuterVec)
    }

    /// How many scale choices were timed so far (one a bucket of token counts and `(n, k)`).
    #[cfg(test)]
    pub fn timed_choices(&self) -> usize {
        self.plans.lock().map(|p| p.chosen.len()).unwrap_or(0)
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Plans>, GpuError> {
        self.plans
            .lock()
            .map_err(|_| GpuError::Invalid("FP8 plan cache poisoned".into()))
    }

    /// The plan of `dims`, made when new. `out`: where candidates may be timed (`None`: no
    /// timing, per-row scales where taken).
    fn plan<'p>(
        &self,
        plans: &'p mut Plans,
        w: (&CudaSlice<u8>, &CudaSlice<f32>),
        x: (&CudaSlice<u8>, &CudaSlice<f32>),
        out: Option<&mut CudaSlice<f32>>,
        (t, n, k): (usize, usize, usize),
    ) -> Result<&'p mut LtPlan, GpuError> {
        if plans.by_shape.contains_key(&(t, n, k)) {
            return Ok(plans.by_shape.get_mut(&(t, n, k)).expect("the plan just found"));
        }
        let none = || {
            GpuError::Invalid(format!(
                "cuBLASLt has no FP8 GEMM for {t} x {n} x {k} (FP8 needs inner sizes that are multiples of 16)"
            ))
        };
        let s = &self.stream;
        let ptrs = {
            let (swp, _rsw) = w.1.device_ptr(s);
            let (sxp, _rsx) = x.1.device_ptr(s);
            (swp, sxp)
        };
        let unit = || LtPlan::new(self.handle, (t, n, k), Scales::Unit, ptrs);
        let key = (bucket(t), n, k);
        // A choice timed for this bucket is followed without timing again; where the library
        // refuses per-row scales for this exact shape, unit scales it is.
        let chosen = match (self.pick, plans.chosen.get(&key)) {
            (ScalePick::Timed, Some(c)) => Some(*c),
            (ScalePick::Timed, None) => None,
            (ScalePick::PerRow, _) => Some(Scales::OuterVec),
            (ScalePick::Unit, _) => Some(Scales::Unit),
        };
        let plan = match chosen {
            Some(Scales::Unit) => unit()?.ok_or_else(none)?,
            Some(Scales::OuterVec) => match LtPlan::new(self.handle, (t, n, k), Scales::OuterVec, ptrs)? {
                Some(p) => p,
                None => unit()?.ok_or_else(none)?,
            },
            None => {
                let per_row = LtPlan::new(self.handle, (t, n, k), Scales::OuterVec, ptrs)?;
                match (per_row, out) {
                    (Some(p), Some(out)) => match unit()? {
                        Some(u) => {
                            need("FP8 GEMM timing output", out, t * n)?;
                            let (tp, tu) = self.time_pair(&p, &u, w, x, out, (t, n, k))?;
                            let keep_unit = tu <= UNIT_MARGIN * tp;
                            tracing::debug!(
                                t,
                                n,
                                k,
                                bucket = key.0,
                                per_row_us = tp,
                                unit_us = tu,
                                unit = keep_unit,
                                "FP8 GEMM scales timed"
                            );
                            let (kept, scales) = if keep_unit {
                                (u, Scales::Unit)
                            } else {
                                (p, Scales::OuterVec)
                            };
                            plans.chosen.insert(key, scales);
                            kept
                        }
                        None => p,
                    },
                    // Not timed (no output to time into): per-row for now, the bucket's
                    // choice left to a shape that can be timed.
                    (Some(p), None) => p,
                    (None, _) => unit()?.ok_or_else(none)?,
                }
            }
        };
        tracing::debug!(
            t,
            n,
            k,
            per_row = plan.scales == Scales::OuterVec,
            "FP8 GEMM planned"
        );
        Ok(plans.by_shape.entry((t, n, k)).or_insert(plan))
    }

    /// The time of one launch of each plan in microseconds, into `out` with beta 0: warm-ups,
    /// then two rounds of each, interleaved.
    fn time_pair(
        &self,
        a: &LtPlan,
        b: &LtPlan,
        w: (&CudaSlice<u8>, &CudaSlice<f32>),
        x: (&CudaSlice<u8>, &CudaSlice<f32>),
        out: &mut CudaSlice<f32>,
        dims: (usize, usize, usize),
    ) -> Result<(f32, f32), GpuError> {
        let ctx = self.stream.context();
        let ev = || {
            ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(drv("an event to time FP8 GEMMs"))
        };
        let (e0, e1) = (ev()?, ev()?);
        for _ in 0..TIMING_WARMUPS {
            self.launch(a, w, x, out, dims, false)?;
            self.launch(b, w, x, out, dims, false)?;
        }
        let mut us = [0f32; 2];
        for _ in 0..2 {
            for (i, p) in [a, b].into_iter().enumerate() {
                e0.record(&self.stream).map_err(drv("recording an event"))?;
                for _ in 0..TIMING_LAUNCHES {
                    self.launch(p, w, x, out, dims, false)?;
                }
                e1.record(&self.stream).map_err(drv("recording an event"))?;
                us[i] += e0.elapsed_ms(&e1).map_err(drv("timing FP8 GEMMs"))? * 1e3;
            }
        }
        let per = (2 * TIMING_LAUNCHES) as f32;
        Ok((us[0] / per, us[1] / per))
    }

    /// Row-major `y[t, n] (+)= (sx[t] sw[n]) (xq[t, k] · wq[n, k]ᵀ)` in f32 from e4m3 inputs;
    /// where this shape's plan has unit scales ([`Lt::scales_rows_for`] false) `y = xq · wqᵀ`
    /// and the caller applies the scales (and must not ask to accumulate). A new shape is
    /// planned here, timed into `y` when not accumulating.
    pub fn gemm(
        &self,
        (wq, sw): (&CudaSlice<u8>, &CudaSlice<f32>),
        (xq, sx): (&CudaSlice<u8>, &CudaSlice<f32>),
        y: &mut CudaSlice<f32>,
        (t, n, k): (usize, usize, usize),
        accumulate: bool,
    ) -> Result<Done, GpuError> {
        need("FP8 GEMM weight", wq, n * k)?;
        need("FP8 weight scales", sw, n)?;
        need("FP8 GEMM input", xq, t * k)?;
        need("FP8 token scales", sx, t)?;
        need("FP8 GEMM output", y, t * n)?;
        let mut plans = self.lock()?;
        // A new shape is timed into `y` only when `y` is about to be overwritten.
        let out = (!accumulate).then_some(&mut *y);
        let plan = self.plan(&mut plans, (wq, sw), (xq, sx), out, (t, n, k))?;
        if accumulate && plan.scales != Scales::OuterVec {
            return Err(GpuError::Invalid("an unscaled FP8 GEMM cannot accumulate".into()));
        }
        self.launch(plan, (wq, sw), (xq, sx), y, (t, n, k), accumulate)?;
        Ok(if plan.scales == Scales::OuterVec {
            Done::Scaled
        } else {
            Done::Unscaled
        })
    }

    /// Queues one GEMM of `plan` (shapes checked by the caller).
    fn launch(
        &self,
        plan: &LtPlan,
        (wq, sw): (&CudaSlice<u8>, &CudaSlice<f32>),
        (xq, sx): (&CudaSlice<u8>, &CudaSlice<f32>),
        y: &mut CudaSlice<f32>,
        (t, n, _k): (usize, usize, usize),
        accumulate: bool,
    ) -> Result<(), GpuError> {
        debug_assert!(y.len() >= t * n);
        let s = &self.stream;
        let (wp, _rw) = wq.device_ptr(s);
        let (xp, _rx) = xq.device_ptr(s);
        let (swp, _rsw) = sw.device_ptr(s);
        let (sxp, _rsx) = sx.device_ptr(s);
        let (yp, _ry) = y.device_ptr_mut(s);
        let (ws, _rws) = self.workspace.device_ptr(s);
        if plan.scales == Scales::OuterVec {
            // SAFETY: the plan's descriptor is live; the scale pointers are device addresses
            // of `n` and `t` f32 (checked by the caller), alive until the GEMM is queued.
            unsafe { set_scale_ptrs(plan.desc, swp, sxp) }?;
        }
        let (alpha, beta) = (1f32, if accumulate { 1f32 } else { 0f32 });
        // SAFETY: the plan's layouts describe exactly these buffers (sizes checked by the
        // caller), C is D (read only with beta 1), alpha/beta are host f32 (the default pointer
        // mode, scale type 32F), the workspace holds LT_WORKSPACE bytes, the plan's limit;
        // everything runs on stream `s`, the stream of every buffer here.
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
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_counts_share_a_timed_choice_up_to_the_next_power_of_two() {
        assert_eq!(bucket(0), 1);
        assert_eq!(bucket(1), 1);
        assert_eq!(bucket(3), 4);
        assert_eq!(bucket(129), 256);
        assert_eq!(bucket(256), 256);
        assert_eq!(bucket(257), 512);
        assert_eq!(bucket(2048), 2048);
    }
}
