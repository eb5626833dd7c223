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
// - `kvf_gemv_fp8`: the single-token projection of kernels/gemv.cu over e4m3 weights, 16 weights
//   a 16-byte load, so one stream reads one byte a weight. The input stays bf16 (weight-only
//   quantization at one token: the step is bandwidth-bound, quantizing the input would only
//   lose accuracy); the row's scale multiplies the f32 dot product.
// - `kvf_fp8_scale`: the epilogue of cuBLASLt's FP8 GEMM, which runs with unit scales into f32
//   (cuBLAS 12.8 takes only one scale per matrix): `y = d * sx[row] * sw[col]`, stored or added
//   to the residual stream.

#include <cuda_fp8.h>

namespace {

constexpr float FP8_E4M3_MAX = 448.f;

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

// Four e4m3 bytes (one 32-bit word) as four floats.
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
// wscale [n_rows]; k a multiple of 16. Block 256 threads, any grid.
extern "C" __global__ void __launch_bounds__(256) kvf_gemv_fp8(const unsigned char* __restrict__ w,
                                                               const float* __restrict__ wscale, int n_rows, int k,
                                                               int half, const bf16* __restrict__ xb,
                                                               const float* __restrict__ x, const int* __restrict__ row,
                                                               const float* __restrict__ norm_w, float eps, int mode,
                                                               float* __restrict__ y, bf16* __restrict__ act) {
    extern __shared__ __align__(16) unsigned char gemv_smem[];
    kvf_wait_prior_grid();
    const bf16* in = xb;
    if (norm_w != nullptr) {
        bf16* sx = reinterpret_cast<bf16*>(gemv_smem);
        rms_row(x + (size_t)(row != nullptr ? *row : 0) * k, norm_w, k, eps, sx);
        __syncthreads();
        in = sx;
    }
    const int units = mode == GEMV_SWIGLU ? half : (n_rows + 1) >> 1;
    const int lane = threadIdx.x & 31;
    const int warps = (int)((gridDim.x * blockDim.x) >> 5);
    const int kc = k >> 4;  // 16-byte chunks a row: 16 weights, 32 bytes of input
    const uint4* xi = reinterpret_cast<const uint4*>(in);
    for (int u = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5); u < units; u += warps) {
        const int r0 = mode == GEMV_SWIGLU ? u : 2 * u;
        const int r1 = mode == GEMV_SWIGLU ? half + u : 2 * u + 1;
        const bool has1 = r1 < n_rows;
        const uint4* w0 = reinterpret_cast<const uint4*>(w + (size_t)r0 * k);
        const uint4* w1 = reinterpret_cast<const uint4*>(w + (size_t)(has1 ? r1 : r0) * k);
        float a0 = 0.f, a1 = 0.f;
        for (int c0 = lane; c0 < kc; c0 += 32 * GEMV_UNROLL) {
            uint4 p0[GEMV_UNROLL], p1[GEMV_UNROLL];
#pragma unroll
            for (int j = 0; j < GEMV_UNROLL; ++j) {
                const int c = c0 + 32 * j;
                p0[j] = c < kc ? ld_stream(w0 + c) : make_uint4(0, 0, 0, 0);
                p1[j] = c < kc ? ld_stream(w1 + c) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int j = 0; j < GEMV_UNROLL; ++j) {
                const int c = c0 + 32 * j;
                if (c < kc) {
                    const uint4 xa = xi[2 * c], xb2 = xi[2 * c + 1];
                    a0 = dot16_fp8(p0[j], xa, xb2, a0);
                    a1 = dot16_fp8(p1[j], xa, xb2, a1);
                }
            }
        }
        const float s0 = warp_sum(a0) * wscale[r0];
        const float s1 = has1 ? warp_sum(a1) * wscale[r1] : warp_sum(a1);
        if (lane == 0) {
            if (mode == GEMV_SWIGLU) {
                act[u] = __float2bfloat16(s0 / (1.f + expf(-s0)) * s1);
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

// y[r, c] = d[r, c] * sx[r] * sw[c] (add = 0) or y[r, c] += it (add = 1), for r < t, c < n,
// row-major; d null: y holds d (in place). Grid-stride, any grid.
extern "C" __global__ void kvf_fp8_scale(const float* d, int t, int n, const float* __restrict__ sx,
                                         const float* __restrict__ sw, int add, float* y) {
    kvf_wait_prior_grid();
    const float* src = d != nullptr ? d : y;
    const long long total = (long long)t * n;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int r = (int)(i / n), c = (int)(i - (long long)r * n);
        const float v = src[i] * sx[r] * sw[c];
        y[i] = add ? y[i] + v : v;
    }
}
