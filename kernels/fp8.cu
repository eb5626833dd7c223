// FP8 (e4m3) linear layers: W8A8 with one scale per weight row (output channel) and one per
// activation row (token), as vLLM's dynamic FP8 method computes them. Compiled only when a model
// runs with FP8 weights, appended to kernels/model.cu in a second NVRTC program (it uses that
// file's helpers), so the bf16 program and its PTX do not change.
//
// - `kvf_quantize_rows_fp8`: bf16 rows to e4m3 rows and a scale a row (`amax / 448`): the
//   activations before each FP8 GEMM (rows = tokens), and the dummy model's weights made on the
//   device (rows = output channels). The same arithmetic as `quantize_rows` in
//   crates/kvfleet-engine/src/model/fp8.rs: `s = amax / 448`, `q = e4m3(x * (1 / s))`, ties to
//   even, saturating.
// - `kvf_gemv_fp8` (and `kvf_gemv_fp8_row`, a row a warp): the single-token projection of
//   kernels/gemv.cu over e4m3 weights, 16 weights a 16-byte load, so one stream reads one byte a weight. The input
//   is not quantized (weight-only quantization at one token: the step is bandwidth-bound,
//   quantizing the input would only lose accuracy); the row's scale multiplies the f32 dot
//   product.
// - `kvf_fp8_scale`: the epilogue of cuBLASLt's FP8 GEMM where it cannot take a scale per row
//   (Ada, cuBLAS before 12.9) and runs with unit scales into f32: `y = d * sx[row] * sw[col]`,
//   stored or added to the residual stream.
// - `kvf_silu_quantize_fp8` / `kvf_gelu_tanh_quantize_fp8`, `kvf_rms_norm_fp8`,
//   `kvf_add_rms_norm_fp8`, `kvf_qkv_post(_wide)_fp8`: the GEMMs' neighbours with that epilogue
//   and the input quantization folded in (the section at the end of this file).

#include <cuda_fp8.h>

namespace {

constexpr float FP8_E4M3_MAX = 448.f;

// The unit-scale epilogue's residual add, x + d * sx * sw: one function for kvf_fp8_scale and
// kvf_add_rms_norm_fp8, so both round (and contract into an FMA) alike.
__device__ __forceinline__ float scale_add(float x, float d, float sx, float sw) {
    return x + d * sx * sw;
}

__device__ float block_max(float v) {
    __shared__ float part[32];
    __shared__ float total;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) part[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float m = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.f;
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (lane == 0) total = m;
    }
    __syncthreads();
    return total;
}

// The GEMV turns the weights into f32 for f32 FMAs with the hardware's cvt.rn.f16x2.e4m3x2
// then f16 to f32, 3 conversions for 2 weights. Conversions issue at a fraction of the FMA rate,
// and they bound the kernel below the copy bandwidth (H200: gate/up at about 2.5 TB/s of 4.2).
// Integer bit moves instead of conversions (333 tok/s against 352 at one stream on an H200),
// f16 products (2-3% slower) and the tensor cores on the input quantized per token (254) lost
// (bench/RESULTS.md); they are in git history before the commit that removed them.
__device__ __forceinline__ void fp8x4_to_float(unsigned int w, float f[4]) {
    const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w & 0xffffu), __NV_E4M3);
    const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w >> 16), __NV_E4M3);
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&lo));
    const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&hi));
    f[0] = a.x;
    f[1] = a.y;
    f[2] = b.x;
    f[3] = b.y;
}

// acc + the dot product of 16 e4m3 weights (one 16-byte chunk) with 16 bf16 inputs (two).
__device__ __forceinline__ float dot16_fp8(const uint4& w, const uint4& x0, const uint4& x1, float acc) {
    const unsigned int ws[4] = {w.x, w.y, w.z, w.w};
    const __nv_bfloat162* xa = reinterpret_cast<const __nv_bfloat162*>(&x0);
    const __nv_bfloat162* xb = reinterpret_cast<const __nv_bfloat162*>(&x1);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float f[4];
        fp8x4_to_float(ws[i], f);
        const __nv_bfloat162* xp = i < 2 ? xa + 2 * i : xb + 2 * (i - 2);
        const float2 p = __bfloat1622float2(xp[0]);
        const float2 q = __bfloat1622float2(xp[1]);
        acc = fmaf(f[0], p.x, acc);
        acc = fmaf(f[1], p.y, acc);
        acc = fmaf(f[2], q.x, acc);
        acc = fmaf(f[3], q.y, acc);
    }
    return acc;
}

}  // namespace

// q[r, :] = e4m3(x[r, :] / s[r]), s[r] = amax(|x[r, :]|) / 448 (1 for a zero row). x bf16
// [rows, k] with row stride ld_in; q [rows, k] dense. Grid (rows), block 256.
extern "C" __global__ void __launch_bounds__(256) kvf_quantize_rows_fp8(const bf16* __restrict__ x, int k, int ld_in,
                                                                       unsigned char* __restrict__ q,
                                                                       float* __restrict__ scale) {
    kvf_wait_prior_grid();
    const bf16* row = x + (size_t)blockIdx.x * ld_in;
    float amax = 0.f;
    for (int i = threadIdx.x; i < k; i += blockDim.x) amax = fmaxf(amax, fabsf(__bfloat162float(row[i])));
    amax = block_max(amax);
    const float s = amax > 0.f ? amax / FP8_E4M3_MAX : 1.f;
    const float inv = 1.f / s;
    unsigned char* out = q + (size_t)blockIdx.x * k;
    for (int i = threadIdx.x; i < k; i += blockDim.x) {
        out[i] = (unsigned char)__nv_cvt_float_to_fp8(__bfloat162float(row[i]) * inv, __NV_SATFINITE, __NV_E4M3);
    }
    if (threadIdx.x == 0) scale[blockIdx.x] = s;
}

// kvf_gemv's contract (kernels/gemv.cu) over e4m3 weights w [n_rows, k] with f32 scales
// wscale [n_rows]; k a multiple of 16 (GEMV_QKV as there). Block 256 threads, any grid.
#define KVF_GEMV_FP8_PARAMS                                                                                     \
    const unsigned char *__restrict__ w, const float *__restrict__ wscale, int n_rows, int k, int half,          \
        const bf16 *__restrict__ xb, const float *__restrict__ x, const int *__restrict__ row,                   \
        const float *__restrict__ norm_w, float eps, int mode, float *__restrict__ y, bf16 *__restrict__ act,  \
        KVF_GEMV_QKV_PARAMS
#define KVF_GEMV_FP8_ARGS w, wscale, n_rows, k, half, xb, x, row, norm_w, eps, mode, y, act, KVF_GEMV_QKV_ARGS

// The input row of an FP8 GEMV, bf16: RMSNorm(x[row or 0]) * norm_w written into the block's
// shared memory (norm_w set), or xb as given. Every thread of the block calls it.
__device__ __forceinline__ const bf16* gemv_input(const bf16* __restrict__ xb, const float* __restrict__ x,
                                                  const int* __restrict__ row, const float* __restrict__ norm_w,
                                                  float eps, int k, unsigned char* smem) {
    if (norm_w == nullptr) return xb;
    bf16* sx = reinterpret_cast<bf16*>(smem);
    rms_row(x + (size_t)(row != nullptr ? *row : 0) * k, norm_w, k, eps, sx);
    __syncthreads();
    return sx;
}

// ONE: a warp owns one row (GEMV_STORE and GEMV_ADD only), for twice the warps on a projection
// whose row pairs do not fill the capped grid.
template <int U = GEMV_UNROLL, bool ONE = false>
__device__ __forceinline__ void gemv_fp8(KVF_GEMV_FP8_PARAMS) {
    extern __shared__ __align__(16) unsigned char gemv_smem[];
    kvf_wait_prior_grid();
    const uint4* xi = reinterpret_cast<const uint4*>(gemv_input(xb, x, row, norm_w, eps, k, gemv_smem));
    const int units = ONE ? n_rows : mode == GEMV_SWIGLU ? half : (n_rows + 1) >> 1;
    const int lane = threadIdx.x & 31;
    const int warps = (int)((gridDim.x * blockDim.x) >> 5);
    const int kc = k >> 4;  // 16-byte chunks a row: 16 weights, 32 bytes of input
    for (int u = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5); u < units; u += warps) {
        int r0 = ONE ? u : mode == GEMV_SWIGLU ? u : 2 * u;
        int r1 = ONE ? n_rows : mode == GEMV_SWIGLU ? half + u : 2 * u + 1;
        int f = -1;
        if (!ONE && mode == GEMV_QKV) qkv_unit_rows(u, n_heads, n_kv_heads, head_dim, rope_half, neox, r0, r1, f);
        const bool has1 = r1 < n_rows;
        const uint4* w0 = reinterpret_cast<const uint4*>(w + (size_t)r0 * k);
        const uint4* w1 = reinterpret_cast<const uint4*>(w + (size_t)(has1 ? r1 : r0) * k);
        float a0 = 0.f, a1 = 0.f;
        for (int c0 = lane; c0 < kc; c0 += 32 * U) {
            uint4 p0[U], p1[U];
#pragma unroll
            for (int j = 0; j < U; ++j) {
                const int c = c0 + 32 * j;
                p0[j] = c < kc ? ld_stream(w0 + c) : make_uint4(0, 0, 0, 0);
                if constexpr (!ONE) p1[j] = c < kc ? ld_stream(w1 + c) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int j = 0; j < U; ++j) {
                const int c = c0 + 32 * j;
                if (c < kc) {
                    const uint4 xa = xi[2 * c], xb2 = xi[2 * c + 1];
                    a0 = dot16_fp8(p0[j], xa, xb2, a0);
                    if constexpr (!ONE) a1 = dot16_fp8(p1[j], xa, xb2, a1);
                }
            }
        }
        const float s0 = warp_sum(a0) * wscale[r0];
        const float s1 = ONE ? 0.f : warp_sum(a1) * wscale[has1 ? r1 : r0];
        if (lane == 0) {
            if (mode == GEMV_SWIGLU) {
                act[u] = __float2bfloat16(s0 / (1.f + expf(-s0)) * s1);
            } else if (!ONE && mode == GEMV_QKV) {
                qkv_put(KVF_GEMV_QKV_ARGS, r0, r1, f, s0, s1);
            } else if (mode == GEMV_ADD) {
                y[r0] += s0;
                if (has1) y[r1] += s1;
            } else {
                y[r0] = s0;
                if (has1) y[r1] = s1;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) kvf_gemv_fp8(KVF_GEMV_FP8_PARAMS) {
    gemv_fp8<>(KVF_GEMV_FP8_ARGS);
}

// kvf_gemv_fp8 with a row a warp (GEMV_STORE and GEMV_ADD), for the projections whose row pairs
// do not fill the capped grid (O and down of an 8B model: 256 blocks of 8 warps, about two an
// SM): twice the warps an SM. On an H200 one stream ran 0.6-1.0% faster so; 4 chunks a lane in
// flight instead of 2 (with a row or a pair a warp) and 8 were slower (bench/RESULTS.md).
extern "C" __global__ void __launch_bounds__(256) kvf_gemv_fp8_row(KVF_GEMV_FP8_PARAMS) {
    gemv_fp8<GEMV_UNROLL, true>(KVF_GEMV_FP8_ARGS);
}

// The tensor cores' e4m3 product, mma.m16n8k32 with f32 sums, for the skinny GEMM below: 8
// warps a block.
constexpr int MMA_WARPS = 8;

__device__ __forceinline__ void mma_e4m3(float c[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                         unsigned b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// y[r, c] = d[r, c] * sx[r] * sw[c] (add = 0) or y[r, c] += it (add = 1), for r < t, c < n,
// row-major; d null: y holds d (in place). Grid (any, t): blockIdx.y is the row, blocks stride
// over its columns.
extern "C" __global__ void kvf_fp8_scale(const float* d, int t, int n, const float* __restrict__ sx,
                                         const float* __restrict__ sw, int add, float* y) {
    kvf_wait_prior_grid();
    const size_t r = blockIdx.y;
    const float* src = (d != nullptr ? d : y) + r * n;
    float* out = y + r * n;
    const float s = sx[r];
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < n; c += gridDim.x * blockDim.x) {
        out[c] = add ? scale_add(out[c], src[c], s, sw[c]) : src[c] * s * sw[c];
    }
}

// === The FP8 GEMMs' consumers with the epilogue folded in ===
// Where cuBLASLt runs with unit scales, the GEMM's f32 output is d = xq · wqᵀ and each consumer
// applies sx[row] * sw[col] as it reads it, instead of a kvf_fp8_scale pass over the whole output
// (at a 2,048-token prefill of Llama-3-8B, gate/up alone is 235 MB of f32 a layer). sw null: the
// output is already scaled (cuBLASLt took the per-row scales). The arithmetic is the unfused
// path's, operation for operation, so the results are bit-equal to it: (d * sx) * sw as
// kvf_fp8_scale rounds it, the activation rounded to bf16 as kvf_silu_mul stores it, then
// kvf_quantize_rows_fp8's scale and conversion.

namespace {

// The down projection's FP8 input from the gate/up GEMM's rows: act = f(gate) * up rounded to
// bf16, then quantized as kvf_quantize_rows_fp8 quantizes a bf16 row. One block a row; the
// row's bf16 activations wait in dynamic shared memory (2 ff bytes) between the pass that finds
// their largest magnitude and the pass that converts them.
template <bool GELU>
__device__ void glu_quantize_row(const float* __restrict__ gate_up, int ff, const float* __restrict__ sw,
                                 unsigned char* __restrict__ q, float* scale) {
    extern __shared__ __align__(16) unsigned char glu_smem[];
    bf16* a = reinterpret_cast<bf16*>(glu_smem);
    const size_t r = blockIdx.x;
    // Read before block_max's barrier; the row's new scale is written over it after.
    const float sx = sw != nullptr ? scale[r] : 1.f;
    const float* g = gate_up + r * 2 * ff;
    const float* u = g + ff;
    float amax = 0.f;
    if ((ff & 3) == 0) {
        // Rows of 2 ff floats start 16-byte aligned; sw's gate and up halves too. GLU_BATCH of
        // a thread's float4 columns are loaded before any is used, so their loads are in flight
        // together: 15.7-16.5 -> 13.9-14.9 us at 256 rows of Llama-3-8B's 14,336 on an H200
        // (bench/RESULTS.md, issue 32). The same values and operations as one at a time: bit-equal.
        constexpr int GLU_BATCH = 4;
        const int n4 = ff >> 2, step = (int)blockDim.x;
        const float4 one = make_float4(1.f, 1.f, 1.f, 1.f);
        for (int c0 = threadIdx.x; c0 < n4; c0 += GLU_BATCH * step) {
            float4 gv[GLU_BATCH], uv[GLU_BATCH], wg[GLU_BATCH], wu[GLU_BATCH];
#pragma unroll
            for (int j = 0; j < GLU_BATCH; ++j) {
                const int c = c0 + j * step;
                const bool in = c < n4;
                gv[j] = in ? reinterpret_cast<const float4*>(g)[c] : one;
                uv[j] = in ? reinterpret_cast<const float4*>(u)[c] : one;
                wg[j] = in && sw != nullptr ? reinterpret_cast<const float4*>(sw)[c] : one;
                wu[j] = in && sw != nullptr ? reinterpret_cast<const float4*>(sw + ff)[c] : one;
            }
#pragma unroll
            for (int j = 0; j < GLU_BATCH; ++j) {
                const int c = c0 + j * step;
                if (c >= n4) break;
                float4 gj = gv[j], uj = uv[j];
                if (sw != nullptr) {
                    const float4 a4 = wg[j], b4 = wu[j];
                    gj = make_float4(gj.x * sx * a4.x, gj.y * sx * a4.y, gj.z * sx * a4.z, gj.w * sx * a4.w);
                    uj = make_float4(uj.x * sx * b4.x, uj.y * sx * b4.y, uj.z * sx * b4.z, uj.w * sx * b4.w);
                }
                const __nv_bfloat162 lo = __floats2bfloat162_rn(glu<GELU>(gj.x, uj.x), glu<GELU>(gj.y, uj.y));
                const __nv_bfloat162 hi = __floats2bfloat162_rn(glu<GELU>(gj.z, uj.z), glu<GELU>(gj.w, uj.w));
                reinterpret_cast<__nv_bfloat162*>(a)[2 * c] = lo;
                reinterpret_cast<__nv_bfloat162*>(a)[2 * c + 1] = hi;
                const float2 fl = __bfloat1622float2(lo), fh = __bfloat1622float2(hi);
                amax = fmaxf(amax, fmaxf(fmaxf(fabsf(fl.x), fabsf(fl.y)), fmaxf(fabsf(fh.x), fabsf(fh.y))));
            }
        }
    } else {
        for (int i = threadIdx.x; i < ff; i += blockDim.x) {
            float gi = g[i], ui = u[i];
            if (sw != nullptr) {
                gi = gi * sx * sw[i];
                ui = ui * sx * sw[ff + i];
            }
            a[i] = __float2bfloat16(glu<GELU>(gi, ui));
            amax = fmaxf(amax, fabsf(__bfloat162float(a[i])));
        }
    }
    // block_max's barriers also order the shared writes above before the reads below.
    amax = block_max(amax);
    const float s = amax > 0.f ? amax / FP8_E4M3_MAX : 1.f;
    const float inv = 1.f / s;
    unsigned char* out = q + r * ff;
    if ((ff & 3) == 0) {
        for (int c = threadIdx.x; c < (ff >> 2); c += blockDim.x) {
            const float2 lo = __bfloat1622float2(reinterpret_cast<const __nv_bfloat162*>(a)[2 * c]);
            const float2 hi = __bfloat1622float2(reinterpret_cast<const __nv_bfloat162*>(a)[2 * c + 1]);
            const unsigned int b0 = __nv_cvt_float_to_fp8(lo.x * inv, __NV_SATFINITE, __NV_E4M3);
            const unsigned int b1 = __nv_cvt_float_to_fp8(lo.y * inv, __NV_SATFINITE, __NV_E4M3);
            const unsigned int b2 = __nv_cvt_float_to_fp8(hi.x * inv, __NV_SATFINITE, __NV_E4M3);
            const unsigned int b3 = __nv_cvt_float_to_fp8(hi.y * inv, __NV_SATFINITE, __NV_E4M3);
            reinterpret_cast<unsigned int*>(out)[c] = b0 | b1 << 8 | b2 << 16 | b3 << 24;
        }
    } else {
        for (int i = threadIdx.x; i < ff; i += blockDim.x) {
            out[i] = (unsigned char)__nv_cvt_float_to_fp8(__bfloat162float(a[i]) * inv, __NV_SATFINITE, __NV_E4M3);
        }
    }
    if (threadIdx.x == 0) scale[r] = s;
}

}  // namespace

// q[r, :] and scale[r] = what kvf_quantize_rows_fp8 makes of act[r, :] = bf16(silu(gate) * up),
// gate/up the f32 rows [T, 2 ff] of the gate/up GEMM. sw non-null: those rows are unscaled, and
// gate[r, i] * scale[r] * sw[i], up[r, i] * scale[r] * sw[ff + i] are the values (scale holds
// the GEMM's token scales on entry and the new ones on exit: the GEMM's input and the down
// projection's share the buffer). q dense [T, ff]. Grid (T), block 256, dynamic shared 2 ff bytes.
extern "C" __global__ void __launch_bounds__(256) kvf_silu_quantize_fp8(const float* __restrict__ gate_up, int ff,
                                                                       const float* __restrict__ sw,
                                                                       unsigned char* __restrict__ q, float* scale) {
    kvf_wait_prior_grid();
    glu_quantize_row<false>(gate_up, ff, sw, q, scale);
}

// The same with the tanh GELU (Gemma 3's GeGLU, kvf_gelu_tanh_mul).
extern "C" __global__ void __launch_bounds__(256) kvf_gelu_tanh_quantize_fp8(const float* __restrict__ gate_up,
                                                                            int ff, const float* __restrict__ sw,
                                                                            unsigned char* __restrict__ q,
                                                                            float* scale) {
    kvf_wait_prior_grid();
    glu_quantize_row<true>(gate_up, ff, sw, q, scale);
}

namespace {
// A normed bf16 row of d values (the block's shared memory, each thread's own elements written
// by it) into e4m3 bytes and their scale, as kvf_quantize_rows_fp8 quantizes a bf16 row.
__device__ __forceinline__ void quantize_normed_row(const bf16* h, int d, unsigned char* __restrict__ out,
                                                    float* scale) {
    float amax = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) amax = fmaxf(amax, fabsf(__bfloat162float(h[i])));
    amax = block_max(amax);
    const float s = amax > 0.f ? amax / FP8_E4M3_MAX : 1.f;
    const float inv = 1.f / s;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        out[i] = (unsigned char)__nv_cvt_float_to_fp8(__bfloat162float(h[i]) * inv, __NV_SATFINITE, __NV_E4M3);
    }
    if (threadIdx.x == 0) *scale = s;
}
}  // namespace
// RMSNorm into an FP8 GEMM's input: q[r, :] and scale[r] = what kvf_quantize_rows_fp8 makes of
// kvf_rms_norm's bf16 row norm(x[r]) * w. x f32 [T, d]; q dense [T, d]. Grid (T), block a
// multiple of 32 (the norm's), dynamic shared 2 d bytes (the bf16 row).
extern "C" __global__ void kvf_rms_norm_fp8(const float* __restrict__ x, const float* __restrict__ w, int d,
                                            float eps, unsigned char* __restrict__ q, float* __restrict__ scale) {
    extern __shared__ __align__(16) unsigned char norm_smem[];
    kvf_wait_prior_grid();
    bf16* h = reinterpret_cast<bf16*>(norm_smem);
    const size_t r = blockIdx.x;
    rms_row(x + r * d, w, d, eps, h);
    // Each thread reads back only what it wrote (rms_row's element order): no barrier needed
    // before quantize_normed_row, whose block_max orders the reads of its second pass.
    quantize_normed_row(h, d, q + r * d, scale + r);
}

// The residual add of an O or down projection's unit-scale FP8 GEMM and the RMSNorm after it, in
// one pass over the row: x[r, :] += d[r, :] * scale[r] * sw[:] (kvf_fp8_scale's add), then q[r, :]
// and scale[r] = what kvf_rms_norm_fp8 makes of the new x[r, :]. Bit-equal to those two kernels,
// with one read of the residual fewer and one launch fewer a projection. scale holds the GEMM's
// token scales on entry and the norm's on exit (the GEMM's input and the next GEMM's share the
// buffer). d f32 [T, dm]; x f32 [T, dm]; q dense [T, dm]. Grid (T), block a multiple of 32,
// dynamic shared 2 dm bytes.
extern "C" __global__ void kvf_add_rms_norm_fp8(const float* __restrict__ dd, const float* __restrict__ sw,
                                                float* __restrict__ x, const float* __restrict__ w, int d,
                                                float eps, unsigned char* __restrict__ q, float* scale) {
    extern __shared__ __align__(16) unsigned char norm_smem[];
    kvf_wait_prior_grid();
    bf16* h = reinterpret_cast<bf16*>(norm_smem);
    const size_t r = blockIdx.x;
    // Read before block_sum's barriers; the row's new scale is written over it at the end.
    const float s = scale[r];
    float* xr = x + r * d;
    const float* dr = dd + r * d;
    if (d <= RMS_REGS * (int)blockDim.x) {
        // rms_row's register path, each element read once. All of the thread's loads are issued
        // before the first store: a store to x between them keeps the next element's loads
        // behind it (x may alias as far as the compiler knows). 12.5 -> 10.6 us at 256 rows of
        // 4,096 on an H200 (bench/RESULTS.md, issue 32).
        float v[RMS_REGS], dv[RMS_REGS], wv[RMS_REGS];
#pragma unroll
        for (int j = 0; j < RMS_REGS; ++j) {
            const int i = threadIdx.x + j * blockDim.x;
            v[j] = i < d ? xr[i] : 0.f;
            dv[j] = i < d ? dr[i] : 0.f;
            wv[j] = i < d ? sw[i] : 0.f;
        }
#pragma unroll
        for (int j = 0; j < RMS_REGS; ++j) {
            const int i = threadIdx.x + j * blockDim.x;
            if (i < d) {
                v[j] = scale_add(v[j], dv[j], s, wv[j]);
                xr[i] = v[j];
            }
        }
        rms_row_regs(v, w, d, eps, h);
    } else {
        for (int i = threadIdx.x; i < d; i += blockDim.x) xr[i] = scale_add(xr[i], dr[i], s, sw[i]);
        // rms_row reads in this loop's element order: each thread reads back only its own writes.
        rms_row(xr, w, d, eps, h);
    }
    quantize_normed_row(h, d, q + r * d, scale + r);
}
// kvf_qkv_post(_wide) over the unit-scale FP8 GEMM's Q/K/V rows: each value times sx[t] *
// sw[col] as it is read (sx the token scales [T], sw the weight's row scales [qw + 2 kw]).
extern "C" __global__ void kvf_qkv_post_fp8(KVF_QKV_POST_PARAMS, const float* __restrict__ sx,
                                            const float* __restrict__ sw) {
    kvf_wait_prior_grid();
    qkv_post<1, true>(KVF_QKV_POST_ARGS, sx, sw);
}

extern "C" __global__ void kvf_qkv_post_wide_fp8(KVF_QKV_POST_PARAMS, const float* __restrict__ sx,
                                                 const float* __restrict__ sw) {
    kvf_wait_prior_grid();
    qkv_post<4, true>(KVF_QKV_POST_ARGS, sx, sw);
}

// The FP8 GEMM of a step of 2..8 tokens (kvf_gemm_fp8_skinny): y[j, r] (+)= sx[j] * wscale[r] *
// sum_i xq[j, i] w[r, i] for tokens j < t <= 8, rows r < n_rows; xq e4m3 [t, k] (the rows the
// quantize kernels and the fused norms write), w e4m3 [n_rows, k], y f32 [t, n_rows] row-major.
// cuBLASLt's FP8 kernels read the weights at 1-2.7 TB/s at these token counts on an H200
// (bench/RESULTS.md, issue 32), where a step should stream its weights once at the copy rate
// as the one-token GEMV does. mma.m16n8k32 with B's 8 columns the tokens: a block a
// unit of 32 rows (two 16-row blocks), its 8 warps splitting k in 64-byte tiles, lane (g, q)
// loading 16 bytes of rows g, g + 8 of each block at 64 c + 16 q (four mmas' A registers) and
// token g's 16 input bytes at the same offset (zero for g >= t) as B. D's c[0], c[1] are row g,
// tokens 2 q and 2 q + 1; c[2], c[3] row g + 8. The warps' sums meet in shared memory. k a
// multiple of 64. Block 256 threads, any grid, no dynamic shared memory. Not PDL-launched.
constexpr int SKINNY_T = 8;
constexpr int SKINNY_UNROLL = 4;

// R: the unit's rows, 32 (two 16-row blocks) or 16 (kvf_gemm_fp8_skinny16: one, for projections
// whose 32-row units leave under two blocks an SM, O and down of an 8B model).
template <int R>
__device__ __forceinline__ void gemm_fp8_skinny(const unsigned char* __restrict__ w, const float* __restrict__ wscale,
                                                int n_rows, int k, const unsigned char* __restrict__ xq,
                                                const float* __restrict__ sx, int t, int add, float* __restrict__ y) {
    constexpr int NR = R / 8;                         // rows a lane loads
    __shared__ float part[MMA_WARPS][R][SKINNY_T];  // a warp's sums: unit row, token
    const int units = (n_rows + R - 1) / R;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int kt = k >> 6;
    // This lane's token row of the input (its B column); lanes past t give zeros.
    const uint4* xr = reinterpret_cast<const uint4*>(xq + (size_t)min(g, t - 1) * k);
    for (int u = blockIdx.x; u < units; u += gridDim.x) {
        const int r0 = R * u;
        // Rows g, g + 8 (and 16 + g, 24 + g) of the unit, clamped inside the matrix (their sums
        // are not written).
        const uint4* wr[NR];
#pragma unroll
        for (int i = 0; i < NR; ++i) wr[i] = reinterpret_cast<const uint4*>(w + (size_t)min(r0 + g + 8 * i, n_rows - 1) * k);
        float ca[4] = {0.f, 0.f, 0.f, 0.f}, cb[4] = {0.f, 0.f, 0.f, 0.f};
        for (int c0 = warp; c0 < kt; c0 += MMA_WARPS * SKINNY_UNROLL) {
            uint4 p[SKINNY_UNROLL][NR], bx[SKINNY_UNROLL];
#pragma unroll
            for (int j = 0; j < SKINNY_UNROLL; ++j) {
                const int c = c0 + MMA_WARPS * j;
#pragma unroll
                for (int i = 0; i < NR; ++i) p[j][i] = c < kt ? ld_stream(wr[i] + 4 * c + q) : make_uint4(0, 0, 0, 0);
                bx[j] = c < kt && g < t ? __ldg(xr + 4 * c + q) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int j = 0; j < SKINNY_UNROLL; ++j) {
                if (c0 + MMA_WARPS * j < kt) {
                    mma_e4m3(ca, p[j][0].x, p[j][1].x, p[j][0].y, p[j][1].y, bx[j].x, bx[j].y);
                    mma_e4m3(ca, p[j][0].z, p[j][1].z, p[j][0].w, p[j][1].w, bx[j].z, bx[j].w);
                    if constexpr (R == 32) {
                        mma_e4m3(cb, p[j][2].x, p[j][3].x, p[j][2].y, p[j][3].y, bx[j].x, bx[j].y);
                        mma_e4m3(cb, p[j][2].z, p[j][3].z, p[j][2].w, p[j][3].w, bx[j].z, bx[j].w);
                    }
                }
            }
        }
        part[warp][g][2 * q] = ca[0];
        part[warp][g][2 * q + 1] = ca[1];
        part[warp][g + 8][2 * q] = ca[2];
        part[warp][g + 8][2 * q + 1] = ca[3];
        if constexpr (R == 32) {
            part[warp][g + 16][2 * q] = cb[0];
            part[warp][g + 16][2 * q + 1] = cb[1];
            part[warp][g + 24][2 * q] = cb[2];
            part[warp][g + 24][2 * q + 1] = cb[3];
        }
        __syncthreads();
        // Thread (j, i): token j, unit row i, summed over the warps in a fixed order.
        {
            const int j = threadIdx.x / R, i = threadIdx.x % R, r = r0 + i;
            if (j < t && r < n_rows) {
                float s = 0.f;
#pragma unroll
                for (int wi = 0; wi < MMA_WARPS; ++wi) s += part[wi][i][j];
                const float v = s * sx[j] * wscale[r];
                float* out = y + (size_t)j * n_rows + r;
                *out = add ? *out + v : v;
            }
        }
        __syncthreads();
    }
}

extern "C" __global__ void __launch_bounds__(256) kvf_gemm_fp8_skinny(const unsigned char* __restrict__ w,
                                                                     const float* __restrict__ wscale, int n_rows,
                                                                     int k, const unsigned char* __restrict__ xq,
                                                                     const float* __restrict__ sx, int t, int add,
                                                                     float* __restrict__ y) {
    gemm_fp8_skinny<32>(w, wscale, n_rows, k, xq, sx, t, add, y);
}

extern "C" __global__ void __launch_bounds__(256) kvf_gemm_fp8_skinny16(const unsigned char* __restrict__ w,
                                                                       const float* __restrict__ wscale, int n_rows,
                                                                       int k, const unsigned char* __restrict__ xq,
                                                                       const float* __restrict__ sx, int t, int add,
                                                                       float* __restrict__ y) {
    gemm_fp8_skinny<16>(w, wscale, n_rows, k, xq, sx, t, add, y);
}
