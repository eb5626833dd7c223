//! Single-token projections (`kernels/gemv.cu`): a step of one token (one stream decoding)
//! streams every weight once, so its projections run as GEMVs that fuse the RMSNorm before them
//! and the residual add or SwiGLU after them. Steps of more tokens keep cuBLAS, which is as fast
//! from 2 tokens and faster from 4 on (bench/RESULTS.md). On sm_90 and later each GEMV is
//! launched with programmatic dependent launch, so its launch overlaps the previous kernel's
//! last blocks; the kernel waits for that kernel's results before touching any activation.
//! FP8 projections whose row pairs do not fill the capped grid (O and down of an 8B model) take
//! a row a warp instead (`kvf_gemv_fp8_row`), for twice the warps an SM.

use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig};

use crate::launch::Launch;

use super::error::{drv, need, GpuError};
use super::fp8::MatRef;
use super::options::GpuTuning;
use crate::backend::AppendTarget;

const THREADS: u32 = 256;
/// The widest normed input row the GEMV takes (bf16 in dynamic shared memory).
pub const MAX_NORMED_K: usize = 16384;
const MODE_STORE: i32 = 0;
const MODE_ADD: i32 = 1;
const MODE_SWIGLU: i32 = 2;
const MODE_QKV: i32 = 3;

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
    /// The fused Q/K/V projection's rows as `kvf_qkv_post` leaves them: bias, RoPE, bf16 Q/K/V.
    Qkv(QkvRope<'a>),
}

/// What `GEMV_QKV` reads and writes (kernels/gemv.cu): the step's one position, the layer's
/// bias and RoPE frequencies, and the bf16 outputs, Q `[n_heads, head_dim]`, K and V
/// `[n_kv * kv_rep, head_dim]`. The rows are `(n_heads + 2 n_kv) * head_dim`.
pub struct QkvRope<'a> {
    pub pos: &'a CudaSlice<i32>,
    pub bias: Option<&'a CudaSlice<f32>>,
    pub inv_freq: &'a CudaSlice<f32>,
    pub n_heads: usize,
    pub n_kv: usize,
    pub kv_rep: usize,
    pub head_dim: usize,
    /// Rotated pairs a head (`rope_dims / 2`).
    pub rope_half: usize,
    pub neox: bool,
    pub pos_scale: f32,
    pub q: &'a mut CudaSlice<u16>,
    pub k: &'a mut CudaSlice<u16>,
    pub v: &'a mut CudaSlice<u16>,
    /// The layer's K/V cache, when the epilogue writes the token's K/V there too (instead of
    /// the append launch; [`CudaBackend::single_token_append`]).
    ///
    /// [`CudaBackend::single_token_append`]: crate::backend::CudaBackend::single_token_append
    pub cache: Option<AppendTarget<'a>>,
}

/// `kvf_gemv` (and the FP8 kernels for FP8 weights), the stream it runs on and its grid.
pub struct Gemv {
    kernel: CudaFunction,
    /// `kvf_gemv_fp8`, when the module is the FP8 program.
    fp8: Option<CudaFunction>,
    /// `kvf_gemv_fp8_row` (a row a warp), for the FP8 projections whose row pairs do not fill
    /// the capped grid, stored or added ([`GpuTuning::fp8_gemv_row`]).
    fp8_row: Option<CudaFunction>,
    stream: Arc<CudaStream>,
    num_sms: usize,
    /// The grid's cap in blocks per SM (0: none).
    blocks_per_sm: usize,
    /// Launch with programmatic stream serialisation (sm_90 and later).
    pdl: bool,
    /// The Q/K/V projection ends with the split (bias, RoPE) in its own launch
    /// ([`Output::Qkv`]; [`GpuTuning::gemv_qkv_split`]).
    pub fused_qkv: bool,
}

impl Gemv {
    /// `pdl`: the device is sm_90 or later (programmatic dependent launch); `fp8`: the module
    /// is the FP8 program.
    pub fn load(
        module: &Arc<CudaModule>,
        stream: Arc<CudaStream>,
        num_sms: usize,
        pdl: bool,
        fp8: bool,
        tuning: &GpuTuning,
    ) -> Result<Self, GpuError> {
        let load = |name: &str| -> Result<CudaFunction, GpuError> {
            let kernel = module.load_function(name).map_err(drv("finding a GEMV kernel"))?;
            kernel
                .set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    (MAX_NORMED_K * 2) as i32,
                )
                .map_err(drv("raising the GEMV shared-memory limit"))?;
            Ok(kernel)
        };
        Ok(Gemv {
            kernel: load("kvf_gemv")?,
            fp8: fp8.then(|| load("kvf_gemv_fp8")).transpose()?,
            fp8_row: (fp8 && tuning.fp8_gemv_row)
                .then(|| load("kvf_gemv_fp8_row"))
                .transpose()?,
            stream,
            num_sms,
            blocks_per_sm: tuning.gemv_blocks_per_sm,
            pdl,
            fused_qkv: tuning.gemv_qkv_split,
        })
    }

    /// Whether a model of width `d` (normed inputs) and projections of inner sizes `ks` can
    /// take the GEMV path: rows of whole 16-byte chunks (8 bf16 weights, or 16 FP8 ones) and a
    /// normed input within the limit.
    pub fn fits(d: usize, ks: &[usize], fp8: bool) -> bool {
        let chunk = if fp8 { 16 } else { 8 };
        d <= MAX_NORMED_K && ks.iter().chain([&d]).all(|k| k % chunk == 0 && *k > 0)
    }

    /// `out <- W · in` for one token, `w` `[n, k]` bf16 or FP8 (a scale a row).
    pub fn run<'w>(
        &self,
        w: impl Into<MatRef<'w>>,
        n: usize,
        k: usize,
        input: Input<'_>,
        output: Output<'_>,
    ) -> Result<(), GpuError> {
        let w = w.into();
        let chunk = if matches!(w, MatRef::Fp8 { .. }) { 16 } else { 8 };
        if k % chunk != 0 || n == 0 {
            return Err(GpuError::Invalid(format!(
                "GEMV over a {n}x{k} weight (rows must be a multiple of {chunk} long)"
            )));
        }
        let [Ok(n_i), Ok(k_i), Ok(half)] = [n, k, n / 2].map(i32::try_from) else {
            return Err(GpuError::Invalid(format!(
                "GEMV {n}x{k} exceeds 32-bit dimensions"
            )));
        };
        // Parameters in order: w, [wscale,] n, k, half, x_bf16, x_f32, row, norm_w, eps, mode,
        // y, act (absent pointers are 0).
        let mut l = Launch::new(&self.stream);
        let output_mode = match &output {
            Output::Store(_) => MODE_STORE,
            Output::Add(_) => MODE_ADD,
            Output::SwiGlu(_) => MODE_SWIGLU,
            Output::Qkv(_) => MODE_QKV,
        };
        let kernel = match w {
            MatRef::Bf16(w) => {
                need("GEMV weight", w, n * k)?;
                l.ptr(w);
                &self.kernel
            }
            MatRef::Fp8 { q, scale } => {
                need("GEMV weight", q, n * k)?;
                need("GEMV weight scales", scale, n)?;
                l.ptr(q).ptr(scale);
                self.fp8.as_ref().ok_or_else(|| {
                    GpuError::Invalid("FP8 weights on a model built without FP8 kernels".into())
                })?
            }
        };
        l.i32(n_i).i32(k_i).i32(half);
        let smem = push_input(&mut l, input, k)?;
        let units = push_output(&mut l, output, n)?;
        let warps_per_block = (THREADS / 32) as usize;
        let mut blocks = units.div_ceil(warps_per_block);
        let cap = match self.blocks_per_sm {
            0 => usize::MAX,
            b => self.num_sms.max(1) * b,
        };
        // A stored or added FP8 projection whose row pairs do not fill the capped grid: a row a
        // warp, twice the warps.
        let by_row = matches!(output_mode, MODE_STORE | MODE_ADD) && blocks < cap;
        let kernel = match &self.fp8_row {
            Some(f) if by_row && matches!(w, MatRef::Fp8 { .. }) => {
                blocks = n.div_ceil(warps_per_block);
                f
            }
            _ => kernel,
        };
        let blocks = blocks.clamp(1, cap);
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // SAFETY: the arguments follow `kvf_gemv`'s parameters in kernels/gemv.cu in order and
        // type (pointer, 3 ints, 4 pointers, float, int, 2 pointers, then `KVF_GEMV_QKV_PARAMS`:
        // 3 pointers, 6 ints, a float, 6 pointers, 2 ints, 2 floats), or the FP8 kernels' in
        // kernels/fp8.cu (the same with the scale pointer after the weight).
        // Absent pointers are 0 and the kernel reads them only under the mode and flags that
        // say they are present.
        // Sizes were checked above: `w` holds `n * k` (and `n` scales), the input `k` (or the f32
        // rows and a row index of this step), the output `n` (`n / 2` for SwiGLU; for Q/K/V the
        // heads, position, bias, frequencies and outputs `push_qkv` checked, and a cache it
        // writes holds the heads and head size it writes, at a slot the backend checked against
        // its pool: `single_token_append`); the dynamic
        // shared memory (`k` bf16, `k <= MAX_NORMED_K`) is within the limit raised at load; k is
        // a multiple of 8 (bf16) or 16 (FP8), so every row starts 16-byte aligned (cudarc
        // allocations are 256-byte aligned). The kernel calls `kvf_wait_prior_grid()` before
        // touching memory (the PDL contract).
        unsafe { l.launch(kernel, cfg, self.pdl) }.map_err(drv("launching kvf_gemv"))
    }
}

/// Pushes the input's arguments (x_bf16, x_f32, row, norm_w, eps); returns the dynamic shared
/// memory the kernel needs for it.
fn push_input<'a>(l: &mut Launch<'a>, input: Input<'a>, k: usize) -> Result<usize, GpuError> {
    match input {
        Input::Bf16(x) => {
            need("GEMV input", x, k)?;
            l.ptr(x).addr(0).addr(0).addr(0).f32(0.0);
            Ok(0)
        }
        Input::Normed { x, w: nw, row, eps } => {
            if k > MAX_NORMED_K {
                return Err(GpuError::Invalid(format!(
                    "a normed GEMV input of width {k} (at most {MAX_NORMED_K})"
                )));
            }
            need("norm weight", nw, k)?;
            need("GEMV input", x, k)?;
            l.addr(0).ptr(x);
            // The row index is a row of this step, checked on the host.
            match row {
                Some(r) => {
                    need("row index buffer", r, 1)?;
                    l.ptr(r)
                }
                None => l.addr(0),
            };
            l.ptr(nw).f32(eps);
            Ok(k * 2)
        }
    }
}

/// Pushes the output's arguments (mode, y, act, then `KVF_GEMV_QKV_PARAMS`); returns the units
/// of work (row pairs, gate/up pairs for SwiGLU, rotation pairs for Q/K/V) the grid covers.
fn push_output<'a>(l: &mut Launch<'a>, output: Output<'a>, n: usize) -> Result<usize, GpuError> {
    if let Output::Qkv(r) = output {
        return push_qkv(l, r, n);
    }
    let units = push_mode(l, output, n)?;
    // No Q/K/V output: its pointers 0, its sizes 0 (the kernel reads them under GEMV_QKV only).
    l.addr(0).addr(0).addr(0);
    for _ in 0..6 {
        l.i32(0);
    }
    l.f32(1.0).addr(0).addr(0).addr(0);
    push_no_cache(l);
    Ok(units)
}

/// The cache arguments of `KVF_GEMV_QKV_PARAMS` without a cache (k_cache null: nothing written).
fn push_no_cache(l: &mut Launch<'_>) {
    l.addr(0).addr(0).addr(0).i32(0).i32(0).f32(1.0).f32(1.0);
}

/// The Q/K/V output's arguments (see [`push_output`]), checked against the rows `n`.
fn push_qkv<'a>(l: &mut Launch<'a>, r: QkvRope<'a>, n: usize) -> Result<usize, GpuError> {
    let hd = r.head_dim;
    let heads = r.n_heads + 2 * r.n_kv;
    if hd % 2 != 0 || heads * hd != n || 2 * r.rope_half > hd {
        return Err(GpuError::Invalid(format!(
            "a Q/K/V GEMV of {n} rows for {heads} heads of {hd} (rotating {} pairs)",
            r.rope_half
        )));
    }
    need("Q/K/V position", r.pos, 1)?;
    need("RoPE frequencies", r.inv_freq, r.rope_half)?;
    if let Some(b) = r.bias {
        need("Q/K/V bias", b, n)?;
    }
    need("q", r.q, r.n_heads * hd)?;
    need("k", r.k, r.n_kv * r.kv_rep * hd)?;
    need("v", r.v, r.n_kv * r.kv_rep * hd)?;
    let dims = [r.n_heads, r.n_kv, r.kv_rep, hd, r.rope_half].map(i32::try_from);
    let [Ok(nh), Ok(nkv), Ok(rep), Ok(hd_i), Ok(half)] = dims else {
        return Err(GpuError::Invalid("Q/K/V GEMV dimensions exceed 32 bits".into()));
    };
    l.i32(MODE_QKV).addr(0).addr(0).ptr(r.pos);
    match r.bias {
        Some(b) => l.ptr(b),
        None => l.addr(0),
    };
    l.ptr(r.inv_freq)
        .i32(nh)
        .i32(nkv)
        .i32(rep)
        .i32(hd_i)
        .i32(half)
        .i32(r.neox as i32)
        .f32(r.pos_scale)
        .ptr_mut(r.q)
        .ptr_mut(r.k)
        .ptr_mut(r.v);
    match r.cache {
        Some(c) => {
            // The epilogue writes rows of `head_dim` values for every stored head at the slot.
            if c.kv_heads != r.n_kv * r.kv_rep || c.head_dim != hd || c.page == 0 {
                return Err(GpuError::Invalid(format!(
                    "a Q/K/V GEMV of {} KV heads of {hd} writing a cache of {} heads of {} (pages of {})",
                    r.n_kv * r.kv_rep,
                    c.kv_heads,
                    c.head_dim,
                    c.page
                )));
            }
            // The backend checked the slot against the pool's pages.
            need("K cache", c.k, c.pool_bytes)?;
            need("V cache", c.v, c.pool_bytes)?;
            need("K/V slot", c.slot, 1)?;
            let [Ok(page)] = [c.page].map(i32::try_from) else {
                return Err(GpuError::Invalid("KV page size exceeds 32 bits".into()));
            };
            l.ptr(c.slot)
                .ptr_mut(c.k)
                .ptr_mut(c.v)
                .i32(c.dtype_code)
                .i32(page)
                .f32(c.k_scale)
                .f32(c.v_scale);
        }
        None => push_no_cache(l),
    }
    Ok(n / 2)
}

/// Pushes mode, y and act for the f32 and SwiGLU outputs; returns their units of work.
fn push_mode<'a>(l: &mut Launch<'a>, output: Output<'a>, n: usize) -> Result<usize, GpuError> {
    match output {
        Output::Store(y) | Output::Add(y) if y.len() < n => Err(GpuError::Invalid(format!(
            "GEMV output holds {} elements, the step needs {n}",
            y.len()
        ))),
        Output::Store(y) => {
            l.i32(MODE_STORE).ptr_mut(y).addr(0);
            Ok(n.div_ceil(2))
        }
        Output::Add(y) => {
            l.i32(MODE_ADD).ptr_mut(y).addr(0);
            Ok(n.div_ceil(2))
        }
        Output::SwiGlu(a) => {
            if n % 2 != 0 {
                return Err(GpuError::Invalid(format!("SwiGLU over an odd row count {n}")));
            }
            need("GEMV activation", a, n / 2)?;
            l.i32(MODE_SWIGLU).addr(0).ptr_mut(a);
            Ok(n / 2)
        }
        Output::Qkv(_) => unreachable!("push_output takes the Q/K/V output"),
    }
}
