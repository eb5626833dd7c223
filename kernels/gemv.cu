// Single-token projections: the decode step's GEMMs when a step has one token (one stream).
// There a projection is a stream over its weights (16 GB a token for an 8B model) and its cost
// is the weight bytes over the copy bandwidth, so the kernel is built around keeping enough
// 16-byte weight loads in flight, and around doing the small work beside it in the same launch:
//   - the RMSNorm of the input (QKV, gate/up and the LM head): each block normalises the f32
//     residual rows into shared memory with `rms_row`, the same arithmetic and block size as
//     `kvf_rms_norm`, so the GEMV sees the bf16 input the separate kernel would have written;
//   - the row gather of the LM head (the last token of each sequence);
//   - the residual add of the O and down projections (`y += W x`, cuBLAS's beta = 1);
//   - SwiGLU after gate/up: a warp owns gate row j and up row ff + j and writes
//     `silu(gate) * up` as bf16, so the f32 gate/up rows never reach memory.
// Appended to kernels/model.cu and kernels/sampling.cu in one NVRTC program (it uses their
// helpers and typedefs).
//
// Work split: a warp owns a unit of two weight rows (rows 2u and 2u + 1, or gate row u and up
// row half + u), reads both rows in 16-byte chunks, two chunks a row per iteration (four loads
// in flight a lane), and dots them with the input row, accumulating in f32. Warps stride over
// units, so any grid size covers the matrix.
//
// On sm_90 and later the kernel is launched with programmatic dependent launch (PDL): the
// driver may start it while the previous kernel drains (its blocks still exiting), which takes
// the launch latency off the step (1.04x at one stream on an H100). The previous kernel does
// not trigger early: with an early trigger (`griddepcontrol.launch_dependents` at the start)
// the step was slower (0.97x).
//
// Measured on an H100 (bench/RESULTS.md) and not kept: a version for 2 to 8 tokens (at 2 as fast
// as cuBLAS, slower from 4: the ALU work grows with the tokens), a tensor-core variant with the
// tokens as the 8 columns of mma.m16n8k16 (slower at one token, slower than cuBLAS from 4), more
// chunks in flight (4 or 8 a row: slower), and an L2 prefetch of each warp's first rows before
// the norm (no change).

#include <cuda_fp16.h>
#include <cuda_fp8.h>

namespace {

// A 16-byte weight load that bypasses L1: each weight is read once per step.
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
}

// acc + the dot product of 8 bf16 weights with 8 bf16 inputs, in f32.
__device__ __forceinline__ float dot8(const uint4& w, const uint4& x, float acc) {
    const __nv_bfloat162* wp = reinterpret_cast<const __nv_bfloat162*>(&w);
    const __nv_bfloat162* xp = reinterpret_cast<const __nv_bfloat162*>(&x);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 a = __bfloat1622float2(wp[i]);
        const float2 b = __bfloat1622float2(xp[i]);
        acc = fmaf(a.x, b.x, acc);
        acc = fmaf(a.y, b.y, acc);
    }
    return acc;
}

constexpr int GEMV_STORE = 0;   // y[n] = (W x)[n]
constexpr int GEMV_ADD = 1;     // y[n] += (W x)[n]
constexpr int GEMV_SWIGLU = 2;  // act[j] = silu((W x)[j]) * (W x)[half + j]
constexpr int GEMV_QKV = 3;     // bf16 Q/K/V from the fused projection (QkvRope)

// Chunks of a row each lane has in flight per iteration.
constexpr int GEMV_UNROLL = 2;

}  // namespace

// GEMV_QKV: the one-token step's Q/K/V projection writes what kvf_qkv_post would make of its
// rows (bias, RoPE, bf16 Q/K/V with each KV head stored kv_rep times; kernels/model.cu), which
// takes that kernel's launch off the step. A warp's unit is the two rows one RoPE rotation
// mixes: (f, f + rope_half) of a Q or K head (neox) or (2f, 2f + 1); the head's unrotated rows
// and every V head in adjacent pairs. Models with Q/K norms (a sum over the whole head) keep
// the separate kernel. Rows n_heads + 2 n_kv heads of head_dim (even).
//
// With k_cache set, the epilogue also writes the token's K/V into the paged cache as kvf_append
// would (kernels/attention/append.cu, the same encodings): at slot kv_slot[0]
// (-1: none), row (page * n_kv_heads * kv_rep + head) * kv_page + offset of head_dim values in
// the encoding kv_code (KV_BF16, KV_F16, KV_E4M3, KV_E5M2: the attention kernels' DT_* codes;
// fp8 divided by k_scale / v_scale), which takes the append launch off the step. nvfp4 caches
// keep kvf_append (their block scales span 16 values of a head).
#define KVF_GEMV_QKV_PARAMS                                                                                \
    const int *__restrict__ pos, const float *__restrict__ bias, const float *__restrict__ inv_freq,       \
        int n_heads, int n_kv_heads, int kv_rep, int head_dim, int rope_half, int neox, float pos_scale,   \
        bf16 *__restrict__ q_out, bf16 *__restrict__ k_out, bf16 *__restrict__ v_out,                      \
        const long long *__restrict__ kv_slot, unsigned char *__restrict__ k_cache,                        \
        unsigned char *__restrict__ v_cache, int kv_code, int kv_page, float k_scale, float v_scale
#define KVF_GEMV_QKV_ARGS                                                                                    \
    pos, bias, inv_freq, n_heads, n_kv_heads, kv_rep, head_dim, rope_half, neox, pos_scale, q_out, k_out, v_out, \
        kv_slot, k_cache, v_cache, kv_code, kv_page, k_scale, v_scale

namespace {

// The rows of unit u under GEMV_QKV, and the RoPE frequency index that rotates them (-1: none).
__device__ __forceinline__ void qkv_unit_rows(int u, int n_heads, int n_kv_heads, int head_dim, int rope_half,
                                              int neox, int& r0, int& r1, int& f) {
    const int pairs = head_dim >> 1;
    const int h = u / pairs, j = u - h * pairs;
    const int base = h * head_dim;
    const bool qk = h < n_heads + n_kv_heads;
    if (qk && j < rope_half) {
        f = j;
        r0 = base + (neox ? j : 2 * j);
        r1 = base + (neox ? j + rope_half : 2 * j + 1);
    } else {
        f = -1;
        const int rotated = qk ? 2 * rope_half : 0;
        r0 = base + rotated + 2 * (j - rotated / 2);
        r1 = r0 + 1;
    }
}

// The K/V cache encodings GEMV_QKV writes (the attention kernels' DT_BF16 .. DT_E5M2).
constexpr int KV_BF16 = 0;
constexpr int KV_F16 = 1;
constexpr int KV_E4M3 = 2;
constexpr int KV_E5M2 = 3;

// Value i of cache row `row` (head_dim values) from the bf16 K/V value v, as kvf_append encodes
// the bf16 it reads: its bits, f16 rounded to nearest, or e4m3 / e5m2 of v / scale, saturated.
__device__ __forceinline__ void kv_put(unsigned char* cache, size_t row, int head_dim, int i, bf16 v, int code,
                                       float scale) {
    const size_t e = row * head_dim + i;
    if (code == KV_BF16) {
        reinterpret_cast<bf16*>(cache)[e] = v;
    } else if (code == KV_F16) {
        reinterpret_cast<__half*>(cache)[e] = __float2half_rn(__bfloat162float(v));
    } else {
        cache[e] = (unsigned char)__nv_cvt_float_to_fp8(__fdiv_rn(__bfloat162float(v), scale), __NV_SATFINITE,
                                                        code == KV_E4M3 ? __NV_E4M3 : __NV_E5M2);
    }
}

// Writes rows r0 and r1 (sums s0, s1) as kvf_qkv_post does: plus the bias, rotated by the
// position's angle for frequency f (f >= 0), bf16 into Q or K/V (kv_rep copies), and K/V into
// the cache when k_cache is set.
__device__ __forceinline__ void qkv_put(KVF_GEMV_QKV_PARAMS, int r0, int r1, int f, float s0, float s1) {
    float a = s0 + (bias != nullptr ? bias[r0] : 0.f);
    float b = s1 + (bias != nullptr ? bias[r1] : 0.f);
    if (f >= 0) {
        const float p = (float)pos[0] / pos_scale;
        float sn, cs;
        sincosf(p * inv_freq[f], &sn, &cs);
        const float ra = a * cs - b * sn;
        const float rb = a * sn + b * cs;
        a = ra;
        b = rb;
    }
    const int h = r0 / head_dim;
    const int i0 = r0 - h * head_dim, i1 = r1 - h * head_dim;
    const bf16 o0 = __float2bfloat16(a), o1 = __float2bfloat16(b);
    if (h < n_heads) {
        q_out[(size_t)h * head_dim + i0] = o0;
        q_out[(size_t)h * head_dim + i1] = o1;
        return;
    }
    const bool is_k = h < n_heads + n_kv_heads;
    const int j = is_k ? h - n_heads : h - n_heads - n_kv_heads;
    bf16* dst = (is_k ? k_out : v_out) + (size_t)j * kv_rep * head_dim;
    for (int r = 0; r < kv_rep; ++r) {
        dst[(size_t)r * head_dim + i0] = o0;
        dst[(size_t)r * head_dim + i1] = o1;
    }
    if (k_cache == nullptr) return;
    const long long slot = kv_slot[0];
    if (slot < 0) return;  // padding
    unsigned char* cache = is_k ? k_cache : v_cache;
    const float scale = is_k ? k_scale : v_scale;
    const long long page = slot / kv_page, off = slot % kv_page;
    for (int r = 0; r < kv_rep; ++r) {
        const size_t crow = ((size_t)page * n_kv_heads * kv_rep + (size_t)j * kv_rep + r) * kv_page + off;
        kv_put(cache, crow, head_dim, i0, o0, kv_code, scale);
        kv_put(cache, crow, head_dim, i1, o1, kv_code, scale);
    }
}

}  // namespace

// y or act from one token: w bf16 [n_rows, k], k a multiple of 8. Input: the bf16 row xb [k],
// or (norm_w set) RMSNorm(x[row ? *row : 0]) * norm_w of an f32 row of x, normalised into k
// bf16 of dynamic shared memory. mode: GEMV_STORE / GEMV_ADD into f32 y [n_rows], or
// GEMV_SWIGLU into bf16 act [half] with n_rows = 2 half, or GEMV_QKV into Q/K/V (the
// KVF_GEMV_QKV_PARAMS, read only then). Block 256 threads (rms_row's block size in kvf_rms_norm),
// any grid.
extern "C" __global__ void __launch_bounds__(256) kvf_gemv(const bf16* __restrict__ w, int n_rows, int k, int half,
                                                           const bf16* __restrict__ xb, const float* __restrict__ x,
                                                           const int* __restrict__ row,
                                                           const float* __restrict__ norm_w, float eps, int mode,
                                                           float* __restrict__ y, bf16* __restrict__ act,
                                                           KVF_GEMV_QKV_PARAMS) {
    extern __shared__ __align__(16) unsigned char gemv_smem[];
    // Launched with PDL on sm_90 and later: wait for the previous kernel's results first.
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
    const int kc = k >> 3;  // 16-byte chunks a row
    const uint4* xi = reinterpret_cast<const uint4*>(in);
    for (int u = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5); u < units; u += warps) {
        int r0 = mode == GEMV_SWIGLU ? u : 2 * u;
        int r1 = mode == GEMV_SWIGLU ? half + u : 2 * u + 1;
        int f = -1;
        if (mode == GEMV_QKV) qkv_unit_rows(u, n_heads, n_kv_heads, head_dim, rope_half, neox, r0, r1, f);
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
                    const uint4 xa = xi[c];
                    a0 = dot8(p0[j], xa, a0);
                    a1 = dot8(p1[j], xa, a1);
                }
            }
        }
        const float s0 = warp_sum(a0);
        const float s1 = warp_sum(a1);
        if (lane == 0) {
            if (mode == GEMV_SWIGLU) {
                act[u] = __float2bfloat16(s0 / (1.f + expf(-s0)) * s1);
            } else if (mode == GEMV_QKV) {
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
