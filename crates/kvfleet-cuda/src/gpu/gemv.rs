//! Single-token projections (`kernels/gemv.cu`): a step of one token (one stream decoding)
//! streams every weight once, so its projections run as GEMVs that fuse the RMSNorm before them
//! and the residual add or SwiGLU after them. Steps of more tokens keep cuBLAS, which is as fast
//! from 2 tokens and faster from 4 on (bench/RESULTS.md). On sm_90 and later each GEMV is
//! launched with programmatic dependent launch, so its launch overlaps the previous kernel's
//! last blocks; the kernel waits for that kernel's results before touching any activation.

use std::sync::Arc;

use cudarc::driver::sys::{self, CUfunction_attribute};
use cudarc::driver::{CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};

use super::{drv, need, GpuError};

const THREADS: u32 = 256;
/// Blocks per SM the grid is capped at (warps then stride over the matrix).
const BLOCKS_PER_SM: usize = 4;
/// The widest normed input row the GEMV takes (bf16 in dynamic shared memory).
pub const MAX_NORMED_K: usize = 16384;
const MODE_STORE: i32 = 0;
const MODE_ADD: i32 = 1;
const MODE_SWIGLU: i32 = 2;

/// The input row of a GEMV.
pub enum Input<'a> {
    /// A bf16 row `[k]`.
    Bf16(&'a CudaSlice<u16>),
    /// `RMSNorm(x[r]) * w` of an f32 row of `x` (`[., k]`): row 0, or the row `row[0]` names.
    Normed {
        x: &'a CudaSlice<f32>,
        w: &'a CudaSlice<f32>,
        row: Option<&'a CudaSlice<i32>>,
        eps: f32,
    },
}

impl<'a> Input<'a> {
    /// `RMSNorm(x[0]) * w`: the step's one token, normed.
    pub fn normed(x: &'a CudaSlice<f32>, w: &'a CudaSlice<f32>, eps: f32) -> Self {
        Input::Normed { x, w, row: None, eps }
    }
}

/// What a GEMV does with `W · in`.
pub enum Output<'a> {
    /// f32 `[n]`, overwritten.
    Store(&'a mut CudaSlice<f32>),
    /// f32 `[n]`, added to (the residual stream).
    Add(&'a mut CudaSlice<f32>),
    /// bf16 `[n / 2]`: `silu(gate) * up` of the two halves of the rows.
    SwiGlu(&'a mut CudaSlice<u16>),
}

/// `kvf_gemv` and the grid it runs on.
pub struct Gemv {
    kernel: CudaFunction,
    num_sms: usize,
    /// Launch with programmatic stream serialisation (sm_90 and later).
    pdl: bool,
}

impl Gemv {
    /// `pdl`: the device is sm_90 or later (programmatic dependent launch).
    pub fn load(module: &Arc<CudaModule>, num_sms: usize, pdl: bool) -> Result<Self, GpuError> {
        let kernel = module
            .load_function("kvf_gemv")
            .map_err(drv("finding kvf_gemv"))?;
        kernel
            .set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                (MAX_NORMED_K * 2) as i32,
            )
            .map_err(drv("raising the GEMV shared-memory limit"))?;
        Ok(Gemv { kernel, num_sms, pdl })
    }

    /// Whether a model of width `d` (normed inputs) and projections of inner sizes `ks` can
    /// take the GEMV path: rows of whole 16-byte chunks and a normed input within the limit.
    pub fn fits(d: usize, ks: &[usize]) -> bool {
        d <= MAX_NORMED_K && ks.iter().chain([&d]).all(|k| k % 8 == 0 && *k > 0)
    }

    /// `out <- W · in` for one token, `w` bf16 `[n, k]`.
    pub fn run(
        &self,
        s: &Arc<CudaStream>,
        w: &CudaSlice<u16>,
        n: usize,
        k: usize,
        input: Input<'_>,
        output: Output<'_>,
    ) -> Result<(), GpuError> {
        if k % 8 != 0 || n == 0 {
            return Err(GpuError::Invalid(format!(
                "GEMV over a {n}x{k} weight (rows must be a multiple of 8 long)"
            )));
        }
        need("GEMV weight", w, n * k)?;
        let [Ok(n_i), Ok(k_i), Ok(half)] = [n, k, n / 2].map(i32::try_from) else {
            return Err(GpuError::Invalid(format!(
                "GEMV {n}x{k} exceeds 32-bit dimensions"
            )));
        };
        // Device addresses of the pointer arguments (0: absent); the guards keep the buffers'
        // stream bookkeeping until the launch is queued.
        let mut guards: Vec<SyncOnDrop<'_>> = Vec::with_capacity(5);
        macro_rules! ptr {
            ($p:expr) => {{
                let (p, g) = $p;
                guards.push(g);
                p
            }};
        }
        let wp = ptr!(w.device_ptr(s));
        let (xbp, xp, rowp, nwp, eps, smem) = match input {
            Input::Bf16(x) => {
                need("GEMV input", x, k)?;
                (ptr!(x.device_ptr(s)), 0, 0, 0, 0f32, 0)
            }
            Input::Normed { x, w: nw, row, eps } => {
                if k > MAX_NORMED_K {
                    return Err(GpuError::Invalid(format!(
                        "a normed GEMV input of width {k} (at most {MAX_NORMED_K})"
                    )));
                }
                need("norm weight", nw, k)?;
                need("GEMV input", x, k)?;
                // The row index is a row of this step, checked on the host.
                let rp = match row {
                    Some(r) => {
                        need("row index buffer", r, 1)?;
                        ptr!(r.device_ptr(s))
                    }
                    None => 0,
                };
                (0, ptr!(x.device_ptr(s)), rp, ptr!(nw.device_ptr(s)), eps, k * 2)
            }
        };
        let (mode, units, yp, ap) = match output {
            Output::Store(y) | Output::Add(y) if y.len() < n => {
                return Err(GpuError::Invalid(format!(
                    "GEMV output holds {} elements, the step needs {n}",
                    y.len()
                )))
            }
            Output::Store(y) => (MODE_STORE, n.div_ceil(2), ptr!(y.device_ptr_mut(s)), 0),
            Output::Add(y) => (MODE_ADD, n.div_ceil(2), ptr!(y.device_ptr_mut(s)), 0),
            Output::SwiGlu(a) => {
                if n % 2 != 0 {
                    return Err(GpuError::Invalid(format!("SwiGLU over an odd row count {n}")));
                }
                need("GEMV activation", a, n / 2)?;
                (MODE_SWIGLU, n / 2, 0, ptr!(a.device_ptr_mut(s)))
            }
        };
        let warps_per_block = (THREADS / 32) as usize;
        let blocks = units
            .div_ceil(warps_per_block)
            .clamp(1, self.num_sms.max(1) * BLOCKS_PER_SM);
        // The raw launch below does not bind the context as cudarc's launches do.
        s.context().bind_to_thread().map_err(drv("binding the context"))?;
        let mut args: [*mut std::ffi::c_void; 12] = [
            &wp as *const u64 as *mut _,
            &n_i as *const i32 as *mut _,
            &k_i as *const i32 as *mut _,
            &half as *const i32 as *mut _,
            &xbp as *const u64 as *mut _,
            &xp as *const u64 as *mut _,
            &rowp as *const u64 as *mut _,
            &nwp as *const u64 as *mut _,
            &eps as *const f32 as *mut _,
            &mode as *const i32 as *mut _,
            &yp as *const u64 as *mut _,
            &ap as *const u64 as *mut _,
        ];
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue {
                programmaticStreamSerializationAllowed: 1,
            },
        };
        let cfg = sys::CUlaunchConfig {
            gridDimX: blocks as u32,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: THREADS,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem as u32,
            hStream: s.cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(self.pdl),
        };
        // SAFETY: `args` points at one local per parameter of `kvf_gemv` in kernels/gemv.cu, in
        // order and type (pointer, 3 ints, 4 pointers, float, int, 2 pointers; pointers as the
        // u64 device addresses of buffers borrowed for this call), each outliving the call (the
        // driver copies the values at launch); `attr` outlives it too. Absent pointers are 0 and
        // the kernel reads them only under the mode and flags that say they are present. Sizes
        // were checked above: `w` holds `n * k`, the input `k` (or the f32 rows and a row index
        // of this step), the output `n` (`n / 2` for SwiGLU); the dynamic shared memory (`k`
        // bf16, `k <= MAX_NORMED_K`) is within the limit raised at load; k is a multiple of 8, so
        // every row starts 16-byte aligned (cudarc allocations are 256-byte aligned). Under PDL
        // the kernel reads and writes memory only after `griddepcontrol.wait`, so the previous
        // kernel's results are complete and visible.
        let r = unsafe {
            sys::cuLaunchKernelEx(
                &cfg,
                self.kernel.cu_function(),
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        drop(guards);
        r.result().map_err(drv("launching kvf_gemv"))
    }
}
