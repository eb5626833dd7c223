// Kernels of the Llama-family forward pass on the GPU: everything except the GEMMs (cuBLAS)
// and attention (kernels/attention/). One NVRTC program, compiled once per architecture by
// crates/kvfleet-cuda/src/gpu.rs. Plain kernels over runtime shapes: they move activations, the GEMMs do
// the work.
//
// Layouts (row-major, T = tokens of the step):
//   residual x      f32  [T, d]
//   normed h        bf16 [T, d]
//   qkv             f32  [T, qw + 2 kw]   (GEMM output: Q heads, then K heads, then V heads)
//   q, attn out     bf16 [T, n_heads, head_dim]
//   k, v            bf16 [T, n_kv_heads * kv_rep, head_dim]  (what the attention backend reads)
//   gate_up         f32  [T, 2 ff]        (gate columns, then up columns)
//   act             bf16 [T, ff]

#include <cuda_bf16.h>

typedef __nv_bfloat16 bf16;

// Programmatic dependent launch (crates/kvfleet-cuda/src/launch.rs): on sm_90 and later the
// step's kernels are launched with PDL, so a block may start while the previous kernel in the
// stream still runs. Every such kernel calls this first: it returns once that kernel has
// completed and its writes are visible. Without PDL (or before sm_90) it returns at once.
__device__ __forceinline__ void kvf_wait_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

namespace {

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the block, returned to every thread. blockDim.x must be a multiple of 32 (<= 1024)
// and every thread of the block must call it.
__device__ float block_sum(float v) {
    __shared__ float part[32];
    __shared__ float total;
    v = warp_sum(v);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    if (lane == 0) part[warp] = v;
    __syncthreads();
    if (warp == 0) {
        const int nw = (blockDim.x + 31) >> 5;
        float s = lane < nw ? part[lane] : 0.f;
        s = warp_sum(s);
        if (lane == 0) total = s;
    }
    __syncthreads();
    const float r = total;
    // part/total may be reused by a later call in the same kernel.
    __syncthreads();
    return r;
}

// out = x * rsqrt(mean(x^2) + eps) * w over one row of d values, by the whole block. Thread t
// owns values t, t + blockDim.x, ...: when the row fits RMS_REGS of them (Llama-3-8B: 4,096 =
// 16 x 256) it is read once, its loads issued together, and kept in registers for the second
// pass (2,048-token prefill steps: norms 2.0 -> 1.3 ms on an H100; the GEMVs that normalise
// their input the same way gained more). The sum runs in the same order either way: the GPU's
// greedy tokens are checked against the CPU's, and a different order of the same sum moved a
// near tie (tests/cuda_model.rs, bench/RESULTS.md).
#define RMS_REGS 16
// rms_row over values the block reads through `load(i)` (x[i], or a value computed and stored on
// the way: kvf_add_rms_norm_fp8's residual add), called once an element in the register path
// (the row fits RMS_REGS values a thread), twice in the other.
// The register path's second half: this thread's values r[j] = row[threadIdx.x + j *
// blockDim.x] (0 past d) already loaded, d <= RMS_REGS * blockDim.x.
__device__ __forceinline__ void rms_row_regs(const float (&r)[RMS_REGS], const float* __restrict__ w, int d,
                                             float eps, bf16* __restrict__ out) {
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < RMS_REGS; ++j) {
        if (threadIdx.x + j * blockDim.x < d) ss += r[j] * r[j];
    }
    ss = block_sum(ss);
    const float inv = 1.f / sqrtf(ss / (float)d + eps);
#pragma unroll
    for (int j = 0; j < RMS_REGS; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < d) out[i] = __float2bfloat16(r[j] * inv * w[i]);
    }
}
template <typename Load>
__device__ __forceinline__ void rms_row_from(Load load, const float* __restrict__ w, int d, float eps,
                                             bf16* __restrict__ out) {
    if (d <= RMS_REGS * (int)blockDim.x) {
        float r[RMS_REGS];
#pragma unroll
        for (int j = 0; j < RMS_REGS; ++j) {
            const int i = threadIdx.x + j * blockDim.x;
            r[j] = i < d ? load(i) : 0.f;
        }
        rms_row_regs(r, w, d, eps, out);
        return;
    }
    float ss = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float v = load(i);
        ss += v * v;
    }
    ss = block_sum(ss);
    const float inv = 1.f / sqrtf(ss / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) out[i] = __float2bfloat16(load(i) * inv * w[i]);
}

__device__ void rms_row(const float* __restrict__ x, const float* __restrict__ w, int d, float eps,
                        bf16* __restrict__ out) {
    rms_row_from([x](int i) { return x[i]; }, w, d, eps, out);
}

__device__ __forceinline__ unsigned long long splitmix64(unsigned long long x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

}  // namespace

// x[t, :] = table[tokens[t], :] widened to f32. Grid (T), any block size.
extern "C" __global__ void kvf_embed(const bf16* __restrict__ table, const int* __restrict__ tokens, int d,
                                     float* __restrict__ x) {
    kvf_wait_prior_grid();
    const size_t t = blockIdx.x;
    const bf16* row = table + (size_t)tokens[t] * d;
    float* out = x + t * d;
    if ((d & 7) == 0) {
        // Rows of whole 16-byte words (d a multiple of 8: every row and output row aligned): a
        // word of 8 values a load, a thread's loads in flight together. One block copies the
        // one-token step's row: 8.4 us with scalar loads on an H200, 3.5 us so (bench/RESULTS.md).
        const uint4* r8 = reinterpret_cast<const uint4*>(row);
        float4* o4 = reinterpret_cast<float4*>(out);
#pragma unroll 4
        for (int c = threadIdx.x; c < (d >> 3); c += blockDim.x) {
            const uint4 w = r8[c];
            const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&w);
            const float2 a = __bfloat1622float2(p[0]), b = __bfloat1622float2(p[1]);
            const float2 e = __bfloat1622float2(p[2]), f = __bfloat1622float2(p[3]);
            o4[2 * c] = make_float4(a.x, a.y, b.x, b.y);
            o4[2 * c + 1] = make_float4(e.x, e.y, f.x, f.y);
        }
        return;
    }
    for (int i = threadIdx.x; i < d; i += blockDim.x) out[i] = __bfloat162float(row[i]);
}

// RMSNorm of every row: out[r] = norm(x[r]) * w. Grid (rows), block a multiple of 32.
extern "C" __global__ void kvf_rms_norm(const float* __restrict__ x, const float* __restrict__ w, int d,
                                        float eps, bf16* __restrict__ out) {
    kvf_wait_prior_grid();
    const size_t r = blockIdx.x;
    rms_row(x + r * d, w, d, eps, out + r * d);
}

// RMSNorm of gathered rows: out[r] = norm(x[rows[r]]) * w (the last token of each sequence
// before the LM head). Grid (n rows), block a multiple of 32.
extern "C" __global__ void kvf_rms_norm_rows(const float* __restrict__ x, const int* __restrict__ rows,
                                             const float* __restrict__ w, int d, float eps,
                                             bf16* __restrict__ out) {
    kvf_wait_prior_grid();
    rms_row(x + (size_t)rows[blockIdx.x] * d, w, d, eps, out + (size_t)blockIdx.x * d);
}

// A drafter's fc input, one target feature at a time: out[i, col..col + d] = bf16(src[rows[i]]),
// src f32 [T, d] (a feature kept from the step), out bf16 rows of ld_out (the features side by
// side in fc's column order). Grid (n), block 256.
extern "C" __global__ void kvf_gather_aux(const float* __restrict__ src, const int* __restrict__ rows, int d,
                                          int ld_out, int col, bf16* __restrict__ out) {
    kvf_wait_prior_grid();
    const float* s = src + (size_t)rows[blockIdx.x] * d;
    bf16* o = out + (size_t)blockIdx.x * ld_out + col;
    for (int i = threadIdx.x; i < d; i += blockDim.x) o[i] = __float2bfloat16(s[i]);
}

// Splits the QKV GEMM output into the attention inputs, per (token, head): adds the bias
// (Qwen2), RMSNorm of each Q/K head (Qwen3), RoPE on Q/K (adjacent pairs, or the two halves of
// the rotated dimensions when neox), then writes bf16 Q, and K/V repeated kv_rep times (so a
// GQA group the attention kernels do not specialise for becomes one they do).
// A group of QKV_POST_THREADS / HPB threads per head, HPB heads a block: with HPB 1 (a few
// tokens: decode) every head gets a whole block and its four warps; with HPB 4 (prefill chunks:
// 2,048 tokens of Llama-3-8B are ~98k heads, and a block each spent the time starting blocks) a
// head gets one warp and syncs only that warp. Heads load with 16-byte loads when head_dim allows.
// Grid (T, ceil((n_heads + 2 n_kv_heads) / HPB)), block QKV_POST_THREADS, dynamic shared
// HPB * head_dim floats.
#define QKV_POST_THREADS 128
namespace {

// SCALED (FP8 weights, kernels/fp8.cu): qkv holds an unscaled FP8 GEMM output, and each value
// read is first multiplied by sx[t] * sw[col], in kvf_fp8_scale's order.
template <int HPB, bool SCALED = false>
__device__ __forceinline__ void qkv_post(const float* __restrict__ qkv, const int* __restrict__ pos,
                                         const float* __restrict__ bias, const float* __restrict__ q_norm,
                                         const float* __restrict__ k_norm, const float* __restrict__ inv_freq,
                                         int n_heads, int n_kv_heads, int kv_rep, int head_dim, int rope_half,
                                         int neox, int has_bias, int has_qk_norm, float pos_scale, float eps,
                                         bf16* __restrict__ q, bf16* __restrict__ k, bf16* __restrict__ v,
                                         const float* __restrict__ sx = nullptr,
                                         const float* __restrict__ sw = nullptr) {
    constexpr int G = QKV_POST_THREADS / HPB;  // threads per head: 128 (a block) or 32 (a warp)
    static_assert(G == QKV_POST_THREADS || G == 32, "a head takes the block or one warp");
    extern __shared__ float smem[];
    const int gl = threadIdx.x % G;
    const int t = blockIdx.x;
    const int h = blockIdx.y * HPB + threadIdx.x / G;
    // With HPB > 1 whole warps leave together and nothing below syncs more than a warp; with
    // HPB 1 the grid has exactly one block per head, so every thread stays.
    if (h >= n_heads + 2 * n_kv_heads) return;
    float* s = smem + (threadIdx.x / G) * head_dim;
    const int qw = n_heads * head_dim;
    const int kw = n_kv_heads * head_dim;
    // kind 0: a Q head, 1: a K head, 2: a V head; j its index among its kind.
    const int kind = h < n_heads ? 0 : (h < n_heads + n_kv_heads ? 1 : 2);
    const int j = kind == 0 ? h : (kind == 1 ? h - n_heads : h - n_heads - n_kv_heads);
    const int col = (kind == 0 ? 0 : (kind == 1 ? qw : qw + kw)) + j * head_dim;
    const float* src = qkv + (size_t)t * (qw + 2 * kw) + col;
    if ((head_dim & 3) == 0) {
        // Rows are (n_heads + 2 n_kv_heads) * head_dim floats: every head starts 16-byte aligned.
        for (int i = 4 * gl; i < head_dim; i += 4 * G) {
            float4 x = *reinterpret_cast<const float4*>(src + i);
            if (SCALED) {
                const float st = sx[t];
                const float4 w4 = *reinterpret_cast<const float4*>(sw + col + i);
                x = make_float4(x.x * st * w4.x, x.y * st * w4.y, x.z * st * w4.z, x.w * st * w4.w);
            }
            if (has_bias) {
                x.x += bias[col + i];
                x.y += bias[col + i + 1];
                x.z += bias[col + i + 2];
                x.w += bias[col + i + 3];
            }
            s[i] = x.x;
            s[i + 1] = x.y;
            s[i + 2] = x.z;
            s[i + 3] = x.w;
        }
    } else {
        for (int i = gl; i < head_dim; i += G) {
            const float x = SCALED ? src[i] * sx[t] * sw[col + i] : src[i];
            s[i] = x + (has_bias ? bias[col + i] : 0.f);
        }
    }
    if (G == 32) __syncwarp(); else __syncthreads();
    // kind and has_qk_norm are uniform over the group, so its sum is reached by all its threads.
    if (kind < 2 && has_qk_norm) {
        float ss = 0.f;
        for (int i = gl; i < head_dim; i += G) ss += s[i] * s[i];
        ss = G == 32 ? warp_sum(ss) : block_sum(ss);
        const float inv = 1.f / sqrtf(ss / (float)head_dim + eps);
        const float* w = kind == 0 ? q_norm : k_norm;
        for (int i = gl; i < head_dim; i += G) s[i] = s[i] * inv * w[i];
        if (G == 32) __syncwarp(); else __syncthreads();
    }
    // Writes element i of this head: Q, or K/V repeated kv_rep times.
    auto put = [&](int i, float o) {
        const bf16 ob = __float2bfloat16(o);
        if (kind == 0) {
            q[(size_t)t * qw + (size_t)j * head_dim + i] = ob;
        } else {
            bf16* dst = kind == 1 ? k : v;
            const size_t base = ((size_t)t * n_kv_heads * kv_rep + (size_t)j * kv_rep) * head_dim + i;
            for (int r = 0; r < kv_rep; ++r) dst[base + (size_t)r * head_dim] = ob;
        }
    };
    // RoPE on Q and K: frequency f rotates the pair (a, b), adjacent or the two halves of the
    // rotated dimensions (neox). The thread owning f writes both, so each angle's sincos is
    // computed once a head; the rest of the head (and every V head) is copied.
    const int rotated = kind < 2 ? 2 * rope_half : 0;
    const float p = (float)pos[t] / pos_scale;
    for (int f = gl; f < rotated / 2; f += G) {
        const int a = neox ? f : 2 * f;
        const int b = neox ? f + rope_half : 2 * f + 1;
        float sn, cs;
        sincosf(p * inv_freq[f], &sn, &cs);
        put(a, s[a] * cs - s[b] * sn);
        put(b, s[a] * sn + s[b] * cs);
    }
    for (int i = rotated + gl; i < head_dim; i += G) put(i, s[i]);
}

}  // namespace

#define KVF_QKV_POST_PARAMS                                                                            \
    const float *__restrict__ qkv, const int *__restrict__ pos, const float *__restrict__ bias,         \
        const float *__restrict__ q_norm, const float *__restrict__ k_norm,                             \
        const float *__restrict__ inv_freq, int n_heads, int n_kv_heads, int kv_rep, int head_dim,       \
        int rope_half, int neox, int has_bias, int has_qk_norm, float pos_scale, float eps,             \
        bf16 *__restrict__ q, bf16 *__restrict__ k, bf16 *__restrict__ v
#define KVF_QKV_POST_ARGS                                                                              \
    qkv, pos, bias, q_norm, k_norm, inv_freq, n_heads, n_kv_heads, kv_rep, head_dim, rope_half, neox, \
        has_bias, has_qk_norm, pos_scale, eps, q, k, v

// A block per head (steps of a few tokens).
extern "C" __global__ void kvf_qkv_post(KVF_QKV_POST_PARAMS) {
    kvf_wait_prior_grid();
    qkv_post<1>(KVF_QKV_POST_ARGS);
}

// A warp per head, four heads a block (prefill chunks).
extern "C" __global__ void kvf_qkv_post_wide(KVF_QKV_POST_PARAMS) {
    kvf_wait_prior_grid();
    qkv_post<4>(KVF_QKV_POST_ARGS);
}

// The gated activations: act[t, i] = f(gate[t, i]) * up[t, i] from gate_up [T, 2 ff] (gate
// columns, then up columns of each row). At a prefill chunk these rows are the largest
// activation a step writes and reads (2,048 tokens of Llama-3-8B: 235 MB of f32 a layer), so
// each thread moves four columns with 16-byte loads and 8-byte stores, and a row's index comes
// from the grid, not from a division per element.
// Grid (ceil(ff / 4 / blockDim.x), min(T, 65535)), any block size; rows stride by gridDim.y.
namespace {

__device__ __forceinline__ float silu(float g) { return g / (1.f + expf(-g)); }

__device__ __forceinline__ float gelu_tanh(float g) {
    const float c = 0.7978845608f;  // sqrt(2 / pi)
    return 0.5f * g * (1.f + tanhf(c * (g + 0.044715f * g * g * g)));
}

template <bool GELU>
__device__ __forceinline__ float glu(float g, float u) {
    return (GELU ? gelu_tanh(g) : silu(g)) * u;
}

template <bool GELU>
__device__ void glu_rows(const float* __restrict__ gate_up, int ff, int t, bf16* __restrict__ act) {
    const int i = 4 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (i >= ff) return;
    // Vector accesses need every row to start 16-byte aligned in gate_up, 8-byte in act.
    const bool vec = (ff & 3) == 0;
    for (int r = blockIdx.y; r < t; r += gridDim.y) {
        const float* g = gate_up + (size_t)r * 2 * ff;
        const float* u = g + ff;
        bf16* o = act + (size_t)r * ff;
        if (vec) {
            const float4 gv = *reinterpret_cast<const float4*>(g + i);
            const float4 uv = *reinterpret_cast<const float4*>(u + i);
            __nv_bfloat162 lo = __floats2bfloat162_rn(glu<GELU>(gv.x, uv.x), glu<GELU>(gv.y, uv.y));
            __nv_bfloat162 hi = __floats2bfloat162_rn(glu<GELU>(gv.z, uv.z), glu<GELU>(gv.w, uv.w));
            uint2 packed;
            packed.x = *reinterpret_cast<unsigned int*>(&lo);
            packed.y = *reinterpret_cast<unsigned int*>(&hi);
            *reinterpret_cast<uint2*>(o + i) = packed;
        } else {
            for (int j = i; j < i + 4 && j < ff; ++j) o[j] = __float2bfloat16(glu<GELU>(g[j], u[j]));
        }
    }
}

}  // namespace

// SwiGLU: act = silu(gate) * up.
extern "C" __global__ void kvf_silu_mul(const float* __restrict__ gate_up, int ff, int t, bf16* __restrict__ act) {
    kvf_wait_prior_grid();
    glu_rows<false>(gate_up, ff, t, act);
}

// out[i] = uniform(-a, a) from a hash of (seed, i): dummy weights made on the device.
extern "C" __global__ void kvf_fill_uniform(bf16* __restrict__ out, long long n, unsigned long long seed,
                                            float a) {
    const unsigned long long base = splitmix64(seed);
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (long long)gridDim.x * blockDim.x) {
        const unsigned long long r = splitmix64(base + (unsigned long long)idx);
        const float u = (float)(r >> 40) * (1.f / 16777216.f);  // [0, 1)
        out[idx] = __float2bfloat16((2.f * u - 1.f) * a);
    }
}

// === Gemma 3 ===
// The parts of Gemma 3's block the Llama-family kernels above do not cover (crates/kvfleet-cuda/src/gpu.rs,
// `gemma_layers`). Its (1 + w) RMSNorm needs no kernel of its own: the GGUF norm tensors
// already hold 1 + w (see `Gemma3` in crates/kvfleet-engine/src/model/llama.rs).

// x[t, :] = table[tokens[t], :] * scale (Gemma 3 scales the embedding by sqrt(hidden); the tied
// LM head reads the same table unscaled). Grid (T), any block size.
extern "C" __global__ void kvf_embed_scaled(const bf16* __restrict__ table, const int* __restrict__ tokens, int d,
                                            float scale, float* __restrict__ x) {
    kvf_wait_prior_grid();
    const size_t t = blockIdx.x;
    const bf16* row = table + (size_t)tokens[t] * d;
    float* out = x + t * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) out[i] = __bfloat162float(row[i]) * scale;
}

// x[r] += norm(y[r]) * w: the post-norm of a sublayer's output added to the residual, in f32.
// Grid (rows), block a multiple of 32.
extern "C" __global__ void kvf_rms_norm_add(const float* __restrict__ y, const float* __restrict__ w, int d,
                                            float eps, float* __restrict__ x) {
    kvf_wait_prior_grid();
    const size_t r = blockIdx.x;
    const float* yr = y + r * d;
    float* xr = x + r * d;
    float ss = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float v = yr[i];
        ss += v * v;
    }
    ss = block_sum(ss);
    const float inv = 1.f / sqrtf(ss / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) xr[i] += yr[i] * inv * w[i];
}

// GeGLU with the tanh GELU: act = gelu_tanh(gate) * up. Same grid as kvf_silu_mul.
extern "C" __global__ void kvf_gelu_tanh_mul(const float* __restrict__ gate_up, int ff, int t,
                                             bf16* __restrict__ act) {
    kvf_wait_prior_grid();
    glu_rows<true>(gate_up, ff, t, act);
}
