// The one-token step's FP8 projections of dummy Llama-3.1-8B alone, to see where a layer's time
// goes (issue 32, bench/RESULTS.md "where a layer's time goes, the projections alone"). 32 layers of Q/K/V
// 6144 x 4096, O 4096 x 4096, gate/up 2 x 14336 x 4096 and down 4096 x 14336, e4m3 with a scale
// a row (218 MB a layer, 6.98 GB a step, so nothing stays in L2), attention left out (O reads the
// first 4096 Q/K/V outputs). What it times, each a whole step of 32 layers:
// - `read`: every weight byte once, one sequential-read launch a layer, then one a projection;
// - `rows`: the projections' bytes read as the GEMVs read them (a warp a row, or the row pairs
//   of Q/K/V and gate/up), no arithmetic;
// - `sep`: a GEMV a projection as kernels/fp8.cu's kvf_gemv_fp8 computes it (RMSNorm of the
//   residual into shared memory, FP8_CVT products, the epilogues), launched with programmatic
//   dependent launch like the engine, and variants: the first loads issued before the input is
//   staged or before the wait, the norm without its sum, no input staged, the loads pipelined
//   across a warp's units, other dot products (e4m3 to f16 by integer moves or by cvt with f16x2
//   FMAs; no conversion; no conversion and no input loads), the input split in halves;
// - `persist` (PERSIST=1): one cooperative kernel for the step, grid-wide barriers between the
//   projections, a warp's first chunks of the next projection loaded before the barrier;
// - `tma` (TMA=1): the weights through the bulk-copy engine (cp.async.bulk) into shared memory
//   in stages, a block an SM (or two), 8-32 warps, the next kernel launched early.
// - `tc`, `tc2`, `stc` (TC=1; ONLY_TC=1 stops after them): the products on the tensor cores.
//   `tc` and `tc2`: a block a unit of 16 rows, its warps splitting k, mma.m16n8k32 on e4m3
//   operands (W8A8) or mma.m16n8k16 on f16 ones; `stc`: sep's own loads (a warp a row or row
//   pair), A's rows the lane quads' chunks, the dot products on D's diagonal, f16 or e4m3
//   operands (the f16 form in the engine as FP8_TC on branch exp/tc-gemv, not kept:
//   bench/RESULTS.md, "the products on the tensor cores").
// - OPRE=1 (ONLY_OPRE=1 stops after it): with the attention stand-in, O's rows loaded into
//   registers before its wait, the stand-in letting O launch early or not.
// - GRAPH=1 (ONLY_GRAPH=1 stops after it): the floor, the four reads and `sep` launched on a
//   stream and replayed as a CUDA graph of the same launches.
// Variants that compute the same sums are compared bit for bit with `sep`, the others within
// a tolerance or not at all (timing-only variants say so). Timing: CUDA events around a step,
// median of REPS (argument 1, default 20) after 3 warm-up steps.
// Build and run on an sm_90 device (the device image's nvcc):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/gemv_lab bench/device/gemv_lab.cu && /tmp/gemv_lab 20
// Here, NVRTC checks the device code (__CUDACC_RTC__ leaves out the host code).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#ifndef __CUDACC_RTC__
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <utility>
#include <vector>
#endif

typedef __nv_bfloat16 bf16;
#ifndef __CUDACC_RTC__
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)
#endif

constexpr int H = 4096, NQKV = 6144, FF = 14336, LAYERS = 32, U = 2;
constexpr int MODE_QKV = 0, MODE_O = 1, MODE_GU = 2, MODE_DOWN = 3;

struct Layer {
    const unsigned char *w[4];
    const float *s[4];
};
struct Step {
    Layer layer[LAYERS];
    const float *n1, *n2;
    float *resid;
    bf16 *qkv, *act;
    unsigned int *bar;
    int layers;
    // The L2-prefetch variants (V11, V12, k_attn): bytes of the next kernel's weights a GEMV
    // prefetches, by the issuing projection; what the attention stand-in prefetches of O's
    // weights (and on into gate/up's, which follow them); evict-last policy for the prefetches
    // (pf_hint) and evict-first for the GEMVs' own loads (ef, V13); the stand-in's chain length.
    size_t pf[4], pf_attn;
    int pf_hint, attn_chain;
    int attn_early;  // the stand-in lets the next kernel launch right after its wait (OPRE)
    const unsigned int* kv;
    float* sink;
};

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
// A 16-byte weight load as ld_stream with an L2 eviction policy (createpolicy).
__device__ __forceinline__ uint4 ld_stream_pol(const uint4* p, unsigned long long pol) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p), "l"(pol));
    return r;
}
__device__ __forceinline__ unsigned long long policy_evict_first() {
    unsigned long long pol;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    return pol;
}
__device__ __forceinline__ unsigned long long policy_evict_last() {
    unsigned long long pol;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
    return pol;
}
// Part `part` of `parts` of bytes [0, bytes) of p into L2 by the bulk-copy engine
// (cp.async.bulk.prefetch, sm_90), in requests of 32 KiB, one a thread of the block; the
// warps do not wait for it. hint: with an evict-last policy.
__device__ __forceinline__ void l2_prefetch(const unsigned char* p, size_t bytes, int part, int parts, int hint) {
    if (p == nullptr || bytes == 0) return;
    const size_t lo = (bytes * part / parts) & ~(size_t)15;
    const size_t hi = part + 1 == parts ? (bytes & ~(size_t)15) : ((bytes * (part + 1) / parts) & ~(size_t)15);
    constexpr size_t CH = 32768;
    const unsigned long long pol = hint ? policy_evict_last() : 0ull;
    for (size_t o = lo + threadIdx.x * CH; o < hi; o += (size_t)blockDim.x * CH) {
        const unsigned int n = (unsigned int)(hi - o < CH ? hi - o : CH);
        if (hint)
            asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" :: "l"(p + o), "r"(n), "l"(pol) : "memory");
        else
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p + o), "r"(n) : "memory");
    }
}
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ float block_sum(float v) {
    __shared__ float part[32];
    __shared__ float total;
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        float s = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0.f;
        s = warp_sum(s);
        if (threadIdx.x == 0) total = s;
    }
    __syncthreads();
    const float r = total;
    __syncthreads();
    return r;
}
__device__ __forceinline__ float dot16(const uint4& w, const uint4& x0, const uint4& x1, float acc) {
    const unsigned int ws[4] = {w.x, w.y, w.z, w.w};
    const __nv_bfloat162* xa = reinterpret_cast<const __nv_bfloat162*>(&x0);
    const __nv_bfloat162* xb = reinterpret_cast<const __nv_bfloat162*>(&x1);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(ws[i] & 0xffffu), __NV_E4M3);
        const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(ws[i] >> 16), __NV_E4M3);
        const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&lo));
        const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&hi));
        const __nv_bfloat162* xp = i < 2 ? xa + 2 * i : xb + 2 * (i - 2);
        const float2 p = __bfloat1622float2(xp[0]);
        const float2 q = __bfloat1622float2(xp[1]);
        acc = fmaf(a.x, p.x, acc);
        acc = fmaf(a.y, p.y, acc);
        acc = fmaf(b.x, q.x, acc);
        acc = fmaf(b.y, q.y, acc);
    }
    return acc;
}


// Timing variants of the 16-weight dot product (the lab's V6-V8; x's bits are read as f16 for
// 6 and 8, so those values are wrong: timing only):
// 6: e4m3 pairs to f16x2 by integer moves (f16 bits = sign << 8 | rest << 7: the value times
//    2^-8, exactly), f16x2 FMAs into a half2 sum, one conversion to f32;
// 7: no conversion at all (the weight words' bits as f32);
// 8: cvt.rn.f16x2.e4m3x2, f16x2 FMAs (the engine's h2 kernel's inner loop).
template <int DOT>
__device__ __forceinline__ float dot16_v(const uint4& w, const uint4& x0, const uint4& x1, float acc) {
    const unsigned int ws[4] = {w.x, w.y, w.z, w.w};
    if constexpr (DOT == 0 || DOT == 10) {
        return dot16(w, x0, x1, acc);
    } else if constexpr (DOT == 9) {
        const float xc = __uint_as_float(x0.x);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            acc = fmaf(__uint_as_float(ws[i]), xc, acc);
            acc = fmaf(__uint_as_float(ws[i] ^ 0x1000u), xc, acc);
            acc = fmaf(__uint_as_float(ws[i] ^ 0x2000u), xc, acc);
            acc = fmaf(__uint_as_float(ws[i] ^ 0x4000u), xc, acc);
        }
        return acc;
    } else if constexpr (DOT == 7) {
        const float* xf = reinterpret_cast<const float*>(&x0);
        const float* yf = reinterpret_cast<const float*>(&x1);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            acc = fmaf(__uint_as_float(ws[i]), xf[i], acc);
            acc = fmaf(__uint_as_float(ws[i] ^ 0x1000u), yf[i], acc);
            acc = fmaf(__uint_as_float(ws[i] ^ 0x2000u), xf[i], acc);
            acc = fmaf(__uint_as_float(ws[i] ^ 0x4000u), yf[i], acc);
        }
        return acc;
    } else {
        const __half2* xa = reinterpret_cast<const __half2*>(&x0);
        const __half2* xb = reinterpret_cast<const __half2*>(&x1);
        __half2 s = __half2(__half2_raw{0, 0});
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            unsigned int lo, hi;
            if constexpr (DOT == 6) {
                const unsigned int t0 = __byte_perm(ws[i], 0u, 0x1404u);  // b0 -> byte 1, b1 -> byte 3
                const unsigned int t1 = __byte_perm(ws[i], 0u, 0x3424u);  // b2 -> byte 1, b3 -> byte 3
                lo = (t0 & 0x80008000u) | ((t0 >> 1) & 0x3f803f80u);
                hi = (t1 & 0x80008000u) | ((t1 >> 1) & 0x3f803f80u);
            } else {
                const __half2_raw a = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(ws[i] & 0xffffu), __NV_E4M3);
                const __half2_raw b = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(ws[i] >> 16), __NV_E4M3);
                lo = *reinterpret_cast<const unsigned int*>(&a);
                hi = *reinterpret_cast<const unsigned int*>(&b);
            }
            const __half2* xp = i < 2 ? xa + 2 * i : xb + 2 * (i - 2);
            s = __hfma2(*reinterpret_cast<const __half2*>(&lo), xp[0], s);
            s = __hfma2(*reinterpret_cast<const __half2*>(&hi), xp[1], s);
        }
        const float2 f = __half22float2(s);
        return acc + (f.x + f.y);
    }
}

__host__ __device__ constexpr int phase_k(int m) { return m == MODE_DOWN ? FF : H; }
__host__ __device__ constexpr int phase_units(int m) {
    return m == MODE_QKV ? NQKV / 2 : m == MODE_O ? H : m == MODE_GU ? FF : H;
}
// The rows of unit u: a row pair (Q/K/V), a gate/up pair (gate/up), one row (O, down: r1 = -1).
__device__ __forceinline__ void unit_rows(int m, int u, int& r0, int& r1) {
    if (m == MODE_QKV) { r0 = 2 * u; r1 = 2 * u + 1; }
    else if (m == MODE_GU) { r0 = u; r1 = FF + u; }
    else { r0 = u; r1 = -1; }
}

// The first iteration's chunks of warp gw's first unit of projection m, loaded into p0/p1.
template <int D>
__device__ __forceinline__ void issue_first(int m, const unsigned char* w, int gw, uint4 (&p0)[D * U], uint4 (&p1)[D * U]) {
    const int lane = threadIdx.x & 31, k = phase_k(m), kc = k >> 4;
    if (gw >= phase_units(m)) return;
    int r0, r1;
    unit_rows(m, gw, r0, r1);
    const uint4* w0 = reinterpret_cast<const uint4*>(w + (size_t)r0 * k);
    const uint4* w1 = reinterpret_cast<const uint4*>(w + (size_t)(r1 >= 0 ? r1 : r0) * k);
#pragma unroll
    for (int j = 0; j < D * U; ++j) {
        const int c = lane + 32 * j;
        p0[j] = c < kc ? ld_stream(w0 + c) : make_uint4(0, 0, 0, 0);
        if (r1 >= 0) p1[j] = c < kc ? ld_stream(w1 + c) : make_uint4(0, 0, 0, 0);
    }
}

// split (V10): the row split in halves, the first 8 values of every 16-value chunk c at 16-byte
// word c and the last 8 at word k / 16 + c, so that a warp's loads of a chunk's input (lane
// stride 16 bytes instead of 32) touch each shared-memory bank once a wavefront.
__device__ __forceinline__ int split_pos(int i, int k) { return ((i & 15) >> 3) * (k >> 1) + ((i >> 4) << 3) + (i & 7); }

// The 256-thread norm's first half (stage_input, tc2_stage): this thread's 16 residual values
// (threadIdx.x + 256 j), loaded at once, into r; returns 1 / RMS (1 without the sum).
__device__ __forceinline__ float norm_regs(const Step& st, float (&r)[16], bool reduce = true) {
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        r[j] = __ldcg(st.resid + threadIdx.x + j * 256);
        ss += r[j] * r[j];
    }
    return reduce ? 1.f / sqrtf(block_sum(ss) / (float)H + 1e-5f) : 1.f;
}

// The block's input row for projection m into shared memory: RMSNorm(resid) * nw (Q/K/V,
// gate/up) or the bf16 vector the previous projection wrote, read through L2 (.cg: other SMs
// wrote it in this kernel). reduce = false: the norm's scale is 1 (V3); split: as split_pos (the
// 256-thread norm and the copy; V10).
__device__ void stage_input(int m, const Step& st, int layer, bf16* sx, bool reduce = true, bool split = false) {
    if ((m == MODE_QKV || m == MODE_GU) && blockDim.x == 256) {
        // 16 values a thread, loaded at once and kept in registers (the engine's rms_row).
        const float* nw = m == MODE_QKV ? st.n1 : st.n2;
        float r[16];
        const float inv = norm_regs(st, r, reduce);
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const int i = threadIdx.x + j * 256;
            sx[split ? split_pos(i, H) : i] = __float2bfloat16(r[j] * inv * nw[i]);
        }
    } else if (m == MODE_QKV || m == MODE_GU) {
        const float* nw = m == MODE_QKV ? st.n1 : st.n2;
        float ss = 0.f;
        for (int i = threadIdx.x; i < H; i += blockDim.x) {
            const float v = __ldcg(st.resid + i);
            ss += v * v;
        }
        ss = block_sum(ss);
        const float inv = 1.f / sqrtf(ss / (float)H + 1e-5f);
        for (int i = threadIdx.x; i < H; i += blockDim.x) sx[i] = __float2bfloat16(__ldcg(st.resid + i) * inv * nw[i]);
    } else {
        const uint4* src = reinterpret_cast<const uint4*>(m == MODE_O ? st.qkv : st.act);
        uint4* dst = reinterpret_cast<uint4*>(sx);
        const int n = phase_k(m) >> 3, kc = phase_k(m) >> 4;
        for (int q = threadIdx.x; q < n; q += blockDim.x) dst[split ? (q & 1) * kc + (q >> 1) : q] = __ldcg(src + q);
    }
    __syncthreads();
}



// A unit's epilogue (lane 0 writes): Q/K/V rows stored as bf16, gate/up as silu(gate) * up,
// O and down added to the residual.
__device__ __forceinline__ void unit_out(int m, const Step& st, int u, int r0, int r1, float s0, float s1, int lane) {
    if (lane != 0) return;
    if (m == MODE_QKV) {
        st.qkv[r0] = __float2bfloat16(s0);
        st.qkv[r1] = __float2bfloat16(s1);
    } else if (m == MODE_GU) {
        st.act[u] = __float2bfloat16(s0 / (1.f + expf(-s0)) * s1);
    } else {
        st.resid[r0] += s0;
    }
}

// Projection m by every warp of the grid, units strided by the grid's warps. PRE: the warp's
// first unit's first D iterations are already in p0/p1.
template <int D, bool PRE, int DOT = 0, bool EF = false>
__device__ void run_phase(int m, const Step& st, int layer, const bf16* sx, uint4 (&p0)[D * U], uint4 (&p1)[D * U]) {
    const unsigned char* w = st.layer[layer].w[m];
    const float* ws = st.layer[layer].s[m];
    const int lane = threadIdx.x & 31, k = phase_k(m), kc = k >> 4, units = phase_units(m);
    const int nw = (int)((gridDim.x * blockDim.x) >> 5);
    const uint4* xi = reinterpret_cast<const uint4*>(sx);
    const unsigned long long pol = EF ? policy_evict_first() : 0ull;
    bool first = PRE;
    for (int u = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5); u < units; u += nw) {
        int r0, r1;
        unit_rows(m, u, r0, r1);
        const bool two = r1 >= 0;
        const uint4* w0 = reinterpret_cast<const uint4*>(w + (size_t)r0 * k);
        const uint4* w1 = reinterpret_cast<const uint4*>(w + (size_t)(two ? r1 : r0) * k);
        float a0 = 0.f, a1 = 0.f;
        int c0 = lane;
        if (first) {
            first = false;
#pragma unroll
            for (int j = 0; j < D * U; ++j) {
                const int c = c0 + 32 * j;
                if (c < kc) {
                    const uint4 xa = DOT == 9 ? make_uint4(0x3f800000u, 0, 0, 0) : DOT == 10 ? xi[c] : xi[2 * c], xb = DOT == 9 ? xa : DOT == 10 ? xi[kc + c] : xi[2 * c + 1];
                    a0 = dot16_v<DOT>(p0[j], xa, xb, a0);
                    if (two) a1 = dot16_v<DOT>(p1[j], xa, xb, a1);
                }
            }
            c0 += 32 * D * U;
        }
        for (; c0 < kc; c0 += 32 * U) {
            uint4 q0[U], q1[U];
#pragma unroll
            for (int j = 0; j < U; ++j) {
                const int c = c0 + 32 * j;
                q0[j] = c < kc ? (EF ? ld_stream_pol(w0 + c, pol) : ld_stream(w0 + c)) : make_uint4(0, 0, 0, 0);
                if (two) q1[j] = c < kc ? (EF ? ld_stream_pol(w1 + c, pol) : ld_stream(w1 + c)) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int j = 0; j < U; ++j) {
                const int c = c0 + 32 * j;
                if (c < kc) {
                    const uint4 xa = DOT == 9 ? make_uint4(0x3f800000u, 0, 0, 0) : DOT == 10 ? xi[c] : xi[2 * c], xb = DOT == 9 ? xa : DOT == 10 ? xi[kc + c] : xi[2 * c + 1];
                    a0 = dot16_v<DOT>(q0[j], xa, xb, a0);
                    if (two) a1 = dot16_v<DOT>(q1[j], xa, xb, a1);
                }
            }
        }
        unit_out(m, st, u, r0, r1, warp_sum(a0) * ws[r0], two ? warp_sum(a1) * ws[r1] : 0.f, lane);
    }
}


// run_phase with the loads software-pipelined across the warp's whole sequence of (unit,
// iteration) pairs: the next iteration's chunks (the next unit's first, at a unit's end) are
// issued before this iteration's arithmetic, so a warp always has a load batch in flight.
__device__ void run_phase_db(int m, const Step& st, int layer, const bf16* sx) {
    const unsigned char* w = st.layer[layer].w[m];
    const float* ws = st.layer[layer].s[m];
    const int lane = threadIdx.x & 31, k = phase_k(m), kc = k >> 4, units = phase_units(m);
    const int nw = (int)((gridDim.x * blockDim.x) >> 5);
    const int iters = (kc + 32 * U - 1) / (32 * U);
    const uint4* xi = reinterpret_cast<const uint4*>(sx);
    int u = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    if (u >= units) return;
    auto load = [&](int uu, int it, uint4 (&a)[U], uint4 (&b)[U]) {
        int r0, r1;
        unit_rows(m, uu, r0, r1);
        const uint4* w0 = reinterpret_cast<const uint4*>(w + (size_t)r0 * k);
        const uint4* w1 = reinterpret_cast<const uint4*>(w + (size_t)(r1 >= 0 ? r1 : r0) * k);
#pragma unroll
        for (int j = 0; j < U; ++j) {
            const int c = lane + 32 * (it * U + j);
            a[j] = c < kc ? ld_stream(w0 + c) : make_uint4(0, 0, 0, 0);
            if (r1 >= 0) b[j] = c < kc ? ld_stream(w1 + c) : make_uint4(0, 0, 0, 0);
        }
    };
    uint4 c0[U], c1[U];
    load(u, 0, c0, c1);
    int it = 0;
    float a0 = 0.f, a1 = 0.f;
    while (true) {
        // The next (unit, iteration).
        int nu = u, nit = it + 1;
        if (nit == iters) { nu = u + nw; nit = 0; }
        uint4 n0[U], n1[U];
        if (nu < units) load(nu, nit, n0, n1);
        int r0, r1;
        unit_rows(m, u, r0, r1);
        const bool two = r1 >= 0;
#pragma unroll
        for (int j = 0; j < U; ++j) {
            const int c = lane + 32 * (it * U + j);
            if (c < kc) {
                const uint4 xa = xi[2 * c], xb = xi[2 * c + 1];
                a0 = dot16(c0[j], xa, xb, a0);
                if (two) a1 = dot16(c1[j], xa, xb, a1);
            }
        }
        if (it + 1 == iters) {
            unit_out(m, st, u, r0, r1, warp_sum(a0) * ws[r0], two ? warp_sum(a1) * ws[r1] : 0.f, lane);
            a0 = a1 = 0.f;
        }
        if (nu >= units) break;
        u = nu;
        it = nit;
#pragma unroll
        for (int j = 0; j < U; ++j) { c0[j] = n0[j]; c1[j] = n1[j]; }
    }
}

// One projection, one kernel (sep): waits for the previous kernel (PDL), then as run_phase.
// V: 0 as the engine; 1 the warp's first chunks loaded after the wait, before the input is
// staged; 2 loaded before the wait; 3 the norm without its sum (scale 1); 4 no input staged (x
// read from a bf16 buffer in global memory: timing only, the values are wrong).
template <int M, int V>
__global__ void __launch_bounds__(256) k_sep(Step st, int layer) {
    __shared__ __align__(16) bf16 sx[FF];
    uint4 p0[U], p1[U];
    const int gw = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    if (V == 2) issue_first<1>(M, st.layer[layer].w[M], gw, p0, p1);
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (V == 1) issue_first<1>(M, st.layer[layer].w[M], gw, p0, p1);
    if (V == 4) {
        run_phase<1, false>(M, st, layer, st.act, p0, p1);
        return;
    }
    if (V == 10) {
        stage_input(M, st, layer, sx, true, true);
        run_phase<1, false, 10>(M, st, layer, sx, p0, p1);
        return;
    }
    if (V >= 11) {
        // The next kernel's weights (attention comes between Q/K/V and O; the next layer's
        // Q/K/V after down), st.pf[M] bytes of them, this block's share, into L2: at the start
        // (12) or as the block exits (11, 13); 13 also loads its own weights evict-first.
        const int nl = M == MODE_DOWN ? layer + 1 : layer, nm = M == MODE_DOWN ? 0 : M + 1;
        const unsigned char* nw = nl < st.layers ? st.layer[nl].w[nm] : nullptr;
        if (V == 12) l2_prefetch(nw, st.pf[M], blockIdx.x, gridDim.x, st.pf_hint);
        stage_input(M, st, layer, sx);
        if (V == 13) run_phase<1, false, 0, true>(M, st, layer, sx, p0, p1);
        else run_phase<1, false>(M, st, layer, sx, p0, p1);
        if (V != 12) l2_prefetch(nw, st.pf[M], blockIdx.x, gridDim.x, st.pf_hint);
        return;
    }
    stage_input(M, st, layer, sx, V != 3);
    if (V == 5) run_phase_db(M, st, layer, sx);
    else if (V >= 6) run_phase<1, false, V>(M, st, layer, sx, p0, p1);
    else if (V == 1 || V == 2) run_phase<1, true>(M, st, layer, sx, p0, p1);
    else run_phase<1, false>(M, st, layer, sx, p0, p1);
}

// Grid-wide barrier number n (1, 2, ...) of this launch: every block's writes before it are
// visible to every block after it. *bar counts arrivals and starts at 0.
__device__ __forceinline__ void grid_barrier(unsigned int* bar, unsigned int n) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(bar, 1u);
        const unsigned int target = n * gridDim.x;
        unsigned int v;
        do {
            asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(v) : "l"(bar) : "memory");
        } while (v < target);
        __threadfence();
    }
    __syncthreads();
}

template <int D, bool PRE>
__global__ void __launch_bounds__(256) k_persist(Step st) {
    __shared__ __align__(16) bf16 sx[FF];
    const int gw = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    uint4 p0[D * U], p1[D * U];
    unsigned int n = 0;
    if (PRE) issue_first<D>(MODE_QKV, st.layer[0].w[MODE_QKV], gw, p0, p1);
    for (int l = 0; l < st.layers; ++l) {
        for (int m = 0; m < 4; ++m) {
            stage_input(m, st, l, sx);
            run_phase<D, PRE>(m, st, l, sx, p0, p1);
            const int nm = m == 3 ? 0 : m + 1, nl = m == 3 ? l + 1 : l;
            if (PRE && nl < st.layers) issue_first<D>(nm, st.layer[nl].w[nm], gw, p0, p1);
            grid_barrier(st.bar, ++n);
        }
    }
}

// Reads every weight byte of a layer (all four projections) once: the layer's bytes at the
// copy rate, one launch a layer with PDL, as a floor.
__global__ void __launch_bounds__(256) k_read(const uint4* w, size_t n16, float* sink) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    unsigned int acc = 0;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        const uint4 a = ld_stream(w + i), b = ld_stream(w + i + stride), c = ld_stream(w + i + 2 * stride),
                    d = ld_stream(w + i + 3 * stride);
        acc ^= a.x ^ b.y ^ c.z ^ d.w;
    }
    for (; i < n16; i += stride) acc ^= ld_stream(w + i).x;
    if (acc == 0x12345678u) sink[0] = 1.f;
}


// The attention stand-in between Q/K/V and O (what kvf_decode costs at a short context: a
// kernel of 16 CTAs that is all latency): each warp follows a chain of st.attn_chain dependent
// loads through the 0.5 MB st.kv (a permutation), the block syncs between links. Its blocks
// first prefetch st.pf_attn bytes from O's weights on (into gate/up's, which follow them) into
// L2, each block its share. It writes only st.sink.
__global__ void __launch_bounds__(128) k_attn(Step st, int layer) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (st.attn_early) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    l2_prefetch(st.layer[layer].w[MODE_O], st.pf_attn, blockIdx.x, gridDim.x, st.pf_hint);
    unsigned int i = (blockIdx.x * 128u + threadIdx.x) * 61u & ((1u << 17) - 1);
    for (int c = 0; c < st.attn_chain; ++c) {
        i = __ldcg(st.kv + i);
        __syncthreads();
    }
    if (i == 0xffffffffu) st.sink[0] = 1.f;
}

// O (OPRE): a warp a row as `sep`, the warp's whole first row (8 chunks a lane) loaded into
// registers before the wait (PRE) or after it. With the attention stand-in launching it early
// (st.attn_early), those loads run while attention does, and after the wait only the input and
// the arithmetic are left. The same sums in the same order as `sep`'s O: bit-equal.
template <bool PRE>
__global__ void __launch_bounds__(256) k_o_pre(Step st, int layer) {
    __shared__ __align__(16) bf16 sx[H];
    constexpr int C = H / 16 / 32;
    const int lane = threadIdx.x & 31;
    const unsigned char* w = st.layer[layer].w[MODE_O];
    const float* ws = st.layer[layer].s[MODE_O];
    const int nw = (int)((gridDim.x * blockDim.x) >> 5);
    int u = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    uint4 p[C];
    auto load = [&](int row) {
        const uint4* w0 = reinterpret_cast<const uint4*>(w + (size_t)row * H);
#pragma unroll
        for (int j = 0; j < C; ++j) p[j] = ld_stream(w0 + lane + 32 * j);
    };
    if (PRE && u < H) load(u);
    asm volatile("griddepcontrol.wait;" ::: "memory");
    stage_input(MODE_O, st, layer, sx);
    const uint4* xi = reinterpret_cast<const uint4*>(sx);
    for (bool first = PRE; u < H; u += nw, first = false) {
        if (!first) load(u);
        float a = 0.f;
#pragma unroll
        for (int j = 0; j < C; ++j) {
            const int c = lane + 32 * j;
            a = dot16(p[j], xi[2 * c], xi[2 * c + 1], a);
        }
        unit_out(MODE_O, st, u, u, -1, warp_sum(a) * ws[u], 0.f, lane);
    }
}

// A projection through the bulk-copy engine (sm_90): each block owns an equal share of the
// units (rows; gate/up row pairs), streamed into shared memory in stages of `su` units by
// cp.async.bulk, S stages in flight. The first S stages are issued before griddepcontrol.wait
// (the weights depend on no kernel), and the block lets the next kernel launch at once
// (EARLY): its blocks, resident beside this one (under 114 KB of shared memory each), start
// their own copies while this one computes. A stage's units are shared by the block's 8 warps:
// 8 / su warps a unit, each a slice of k, summed in shared memory in a fixed order.
__device__ __forceinline__ unsigned int smem_u32(const void* p) { return (unsigned int)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, unsigned int bytes, unsigned long long* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_expect(unsigned long long* bar, unsigned int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned int parity) {
    asm volatile(
        "{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}\n"
        :: "r"(smem_u32(bar)), "r"(parity) : "memory");
}


template <int M, int S, bool EARLY, int NW>
__global__ void __launch_bounds__(1024) k_tma(Step st, int layer, int su) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned long long* bar = reinterpret_cast<unsigned long long*>(smem);
    float* red = reinterpret_cast<float*>(smem + 64);            // NW partial sums x 2
    bf16* sx = reinterpret_cast<bf16*>(smem + 320);               // the input row, k bf16
    constexpr int k = phase_k(M), units = M == MODE_QKV ? NQKV : phase_units(M);
    constexpr bool pair = M == MODE_GU;
    constexpr unsigned int ub = k;                                 // bytes a row
    unsigned char* stage0 = smem + 320 + 2 * k;
    const unsigned int stage_bytes = (pair ? 2 : 1) * su * ub;
    const unsigned char* w = st.layer[layer].w[M];
    const float* ws = st.layer[layer].s[M];
    const int u0 = (int)((long long)units * blockIdx.x / gridDim.x);
    const int u1 = (int)((long long)units * (blockIdx.x + 1) / gridDim.x);
    const int nst = (u1 - u0 + su - 1) / su;
    auto issue = [&](int t) {
        const int a = u0 + t * su, n = min(su, u1 - a);
        unsigned char* dst = stage0 + (size_t)(t % S) * stage_bytes;
        mbar_expect(&bar[t % S], (pair ? 2 : 1) * n * ub);
        bulk_g2s(dst, w + (size_t)a * ub, n * ub, &bar[t % S]);
        if (pair) bulk_g2s(dst + su * ub, w + (size_t)(FF + a) * ub, n * ub, &bar[t % S]);
    };
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; ++s)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_u32(&bar[s])) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        for (int t = 0; t < min(S, nst); ++t) issue(t);
    }
    if (EARLY) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    stage_input(M, st, layer, sx);  // ends with __syncthreads: the barriers' init is visible
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wpu = NW / su;                      // warps a unit
    const int kc = k >> 4;                        // 16-byte chunks a row
    const uint4* xi = reinterpret_cast<const uint4*>(sx);
    for (int t = 0; t < nst; ++t) {
        mbar_wait(&bar[t % S], (t / S) & 1);
        const unsigned char* sw = stage0 + (size_t)(t % S) * stage_bytes;
        const int a = u0 + t * su, n = min(su, u1 - a);
        const int j = warp / wpu, part = warp % wpu;  // unit j of the stage, slice part
        const int c_lo = part * kc / wpu, c_hi = (part + 1) * kc / wpu;
        float a0 = 0.f, a1 = 0.f;
        if (j < n) {
            const uint4* w0 = reinterpret_cast<const uint4*>(sw + (size_t)j * ub);
            const uint4* w1 = reinterpret_cast<const uint4*>(sw + (size_t)(su + j) * ub);
            for (int c = c_lo + lane; c < c_hi; c += 32) {
                const uint4 xa = xi[2 * c], xb = xi[2 * c + 1];
                a0 = dot16(w0[c], xa, xb, a0);
                if (pair) a1 = dot16(w1[c], xa, xb, a1);
            }
            a0 = warp_sum(a0);
            if (pair) a1 = warp_sum(a1);
            if (lane == 0) { red[warp] = a0; red[NW + warp] = a1; }
        }
        __syncthreads();  // every warp is done with the stage and its partials are in red
        if (threadIdx.x == 0 && t + S < nst) issue(t + S);
        if (part == 0 && lane == 0 && j < n) {
            float s0 = 0.f, s1 = 0.f;
            for (int p = 0; p < wpu; ++p) { s0 += red[warp + p]; s1 += red[NW + warp + p]; }
            const int u = a + j;
            if (M == MODE_QKV) st.qkv[u] = __float2bfloat16(s0 * ws[u]);
            else if (M == MODE_GU) {
                const float g = s0 * ws[u], up = s1 * ws[FF + u];
                st.act[u] = __float2bfloat16(g / (1.f + expf(-g)) * up);
            } else st.resid[u] += s0 * ws[u];
        }
        __syncthreads();  // red is read before the next stage writes it
    }
}


// Reads of a projection's bytes without arithmetic, to separate the access pattern from the
// GEMV's work: a warp a row (rows strided by the grid's warps), U 16-byte chunks a lane in
// flight, as the GEMVs read.
template <int U_, bool PAIR = false>
__global__ void __launch_bounds__(256) k_rows(const unsigned char* w, int rows, int k, float* sink) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    const int lane = threadIdx.x & 31, kc = k >> 4, nw = (int)((gridDim.x * blockDim.x) >> 5);
    const int units = PAIR ? rows / 2 : rows;
    unsigned int acc = 0;
    for (int r = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5); r < units; r += nw) {
        const uint4* p = reinterpret_cast<const uint4*>(w + (size_t)r * k);
        const uint4* p1 = reinterpret_cast<const uint4*>(w + (size_t)(r + units) * k);
        for (int c0 = lane; c0 < kc; c0 += 32 * U_) {
            uint4 q[U_], q1[U_];
#pragma unroll
            for (int j = 0; j < U_; ++j) {
                q[j] = c0 + 32 * j < kc ? ld_stream(p + c0 + 32 * j) : make_uint4(0, 0, 0, 0);
                if (PAIR) q1[j] = c0 + 32 * j < kc ? ld_stream(p1 + c0 + 32 * j) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int j = 0; j < U_; ++j) acc ^= q[j].x ^ q[j].w ^ (PAIR ? q1[j].y : 0u);
        }
    }
    if (acc == 0x12345678u) sink[0] = 1.f;
}

// Tensor-core GEMV (TC=1; W8A8 like vLLM's dynamic FP8 method): the input row quantized per
// token to e4m3 in shared memory, the weights as A of mma.m16n8k32 (e4m3, f32 accumulation),
// the input as column 0 of B. A block owns a unit of 16 rows (gate/up: 8 gate rows as A's rows
// 0..7 and their 8 up rows as 8..15, so a lane holds both sums of its row); its 8 warps split k
// in eighths, each lane loading 16 bytes of rows g and g + 8 at 64 j + 16 t of its eighth
// (4 lanes cover 64 contiguous bytes of a row a tile, a warp 16 rows x 512 bytes a batch of 8
// tiles), then the eighths are summed through shared memory in a fixed order. No conversion is
// spent on a weight. V: 0 wait, stage, load; 1 the first batch loaded after the wait, before
// the input is staged; 2 loaded before the wait. Grid: one unit a block, or fewer blocks that
// loop over the units (the input staged once a block).
constexpr int TC_TILES = 8;
__device__ __forceinline__ void mma_e4m3(float c[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                         unsigned b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}
__device__ float block_max(float v) {
    __shared__ float part[32];
    __shared__ float total;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        float s = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0.f;
        for (int o = 16; o > 0; o >>= 1) s = fmaxf(s, __shfl_xor_sync(0xffffffffu, s, o));
        if (threadIdx.x == 0) total = s;
    }
    __syncthreads();
    const float r = total;
    __syncthreads();
    return r;
}
// The block's input of projection m as stage_input gives it (bf16 in sx), then quantized per
// token into xq (e4m3, k bytes); returns the scale, amax / 448.
__device__ float tc_stage(int m, const Step& st, int layer, bf16* sx, unsigned char* xq) {
    stage_input(m, st, layer, sx);
    const int k = phase_k(m);
    float amax = 0.f;
    for (int i = threadIdx.x; i < k; i += blockDim.x) amax = fmaxf(amax, fabsf(__bfloat162float(sx[i])));
    amax = block_max(amax);
    const float s = amax > 0.f ? amax / 448.f : 1.f, inv = 1.f / s;
    for (int i = threadIdx.x; i < k; i += blockDim.x)
        xq[i] = (unsigned char)__nv_cvt_float_to_fp8(__bfloat162float(sx[i]) * inv, __NV_SATFINITE, __NV_E4M3);
    __syncthreads();
    return s;
}
__host__ __device__ constexpr int tc_units(int m) { return m == MODE_QKV ? NQKV / 16 : m == MODE_GU ? FF / 8 : H / 16; }

// Tiles j0 .. j0 + T - 1 of unit u for this lane (k_tc, k_tc2): lane (g, t) of warp `warp`
// loads rows g and 8 + g of the unit's 16 (gate/up: gate row 8 u + g and its up row), 16 bytes
// each at 64 j + 16 t of the warp's eighth of k.
template <int M, int T>
__device__ __forceinline__ void tc_load(const unsigned char* w, int u, int j0, uint4 (&pa)[T], uint4 (&pb)[T]) {
    constexpr int k = phase_k(M), kw = k / 8, tiles = kw / 64;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int ra = M == MODE_GU ? 8 * u + g : 16 * u + g;
    const int rb = M == MODE_GU ? FF + 8 * u + g : 16 * u + 8 + g;
    const uint4* wa = reinterpret_cast<const uint4*>(w + (size_t)ra * k + warp * kw) + t;
    const uint4* wb = reinterpret_cast<const uint4*>(w + (size_t)rb * k + warp * kw) + t;
#pragma unroll
    for (int j = 0; j < T; ++j) {
        if (j0 + j < tiles) {
            pa[j] = ld_stream(wa + 4 * (j0 + j));
            pb[j] = ld_stream(wb + 4 * (j0 + j));
        }
    }
}

// k_tc's and k_tc2's end of a unit: the warps' partial sums of its 16 rows (c[0] row g, c[2]
// row 8 + g, in the lanes with t = 0) summed in a fixed order, scaled and written as sep's
// epilogues write them. Every thread of the block calls it.
template <int M>
__device__ __forceinline__ void tc_unit_out(const Step& st, const float* ws, int u, float xs, const float c[4],
                                            float (&part)[8][16]) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    if (t == 0) {
        part[warp][g] = c[0];
        part[warp][g + 8] = c[2];
    }
    __syncthreads();
    if (threadIdx.x < (M == MODE_GU ? 8 : 16)) {
        const int i = threadIdx.x;
        float s0 = 0.f, s1 = 0.f;
#pragma unroll
        for (int q = 0; q < 8; ++q) { s0 += part[q][i]; if (M == MODE_GU) s1 += part[q][i + 8]; }
        if (M == MODE_GU) {
            const float gt = s0 * xs * ws[8 * u + i], up = s1 * xs * ws[FF + 8 * u + i];
            st.act[8 * u + i] = __float2bfloat16(gt / (1.f + expf(-gt)) * up);
        } else if (M == MODE_QKV) {
            st.qkv[16 * u + i] = __float2bfloat16(s0 * xs * ws[16 * u + i]);
        } else {
            st.resid[16 * u + i] += s0 * xs * ws[16 * u + i];
        }
    }
    __syncthreads();
}

template <int M, int V>
__global__ void __launch_bounds__(256, 2) k_tc(Step st, int layer) {
    __shared__ __align__(16) bf16 sx[FF];
    __shared__ __align__(16) unsigned char xq[FF];
    __shared__ float part[8][16];
    const unsigned char* w = st.layer[layer].w[M];
    const float* ws = st.layer[layer].s[M];
    constexpr int k = phase_k(M), kw = k / 8, tiles = kw / 64, units = tc_units(M);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    if (V == 0) asm volatile("griddepcontrol.wait;" ::: "memory");
    float xs = 1.f;
    bool staged = false;
    if (V == 0) { xs = tc_stage(M, st, layer, sx, xq); staged = true; }
    for (int u = blockIdx.x; u < units; u += gridDim.x) {
        const uint4* xv = reinterpret_cast<const uint4*>(xq + warp * kw) + t;
        float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 1
        for (int j0 = 0; j0 < tiles; j0 += TC_TILES) {
            uint4 pa[TC_TILES], pb[TC_TILES];
            tc_load<M, TC_TILES>(w, u, j0, pa, pb);
            if (!staged) {
                if (V == 2) asm volatile("griddepcontrol.wait;" ::: "memory");
                if (V == 1) asm volatile("griddepcontrol.wait;" ::: "memory");
                xs = tc_stage(M, st, layer, sx, xq);
                staged = true;
            }
#pragma unroll
            for (int j = 0; j < TC_TILES; ++j) {
                if (j0 + j < tiles) {
                    const uint4 bx = g == 0 ? xv[4 * (j0 + j)] : make_uint4(0, 0, 0, 0);
                    mma_e4m3(c, pa[j].x, pb[j].x, pa[j].y, pb[j].y, bx.x, bx.y);
                    mma_e4m3(c, pa[j].z, pb[j].z, pa[j].w, pb[j].w, bx.z, bx.w);
                }
            }
        }
        tc_unit_out<M>(st, ws, u, xs, c, part);
    }
}

// k_tc2 (TC=1): k_tc with a lighter prologue and more blocks an SM. KIND 0: e4m3 operands as
// k_tc, the norm, the amax and the quantization in one pass over registers (Q/K/V, gate/up);
// KIND 1: f16 operands, mma.m16n8k16, each weight pair converted by cvt.rn.f16x2.e4m3x2 and
// the input staged as f16 (weight-only like sep; no range scaling: timing lab). T tiles a
// batch, MINB blocks an SM; dynamic shared memory k bytes (KIND 0) or 2 k (KIND 1).
__device__ __forceinline__ void mma_f16(float c[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                        unsigned b1) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ unsigned cvt2(unsigned v) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(v & 0xffffu), __NV_E4M3);
    return *reinterpret_cast<const unsigned*>(&h);
}
// The input of projection m into smem: e4m3 (KIND 0, returns the scale) or f16 (KIND 1).
template <int KIND>
__device__ float tc2_stage(int m, const Step& st, unsigned char* smem) {
    const int k = phase_k(m);
    float s = 1.f;
    if (m == MODE_QKV || m == MODE_GU) {
        const float* nw = m == MODE_QKV ? st.n1 : st.n2;
        float r[16];
        const float inv = norm_regs(st, r);
        float amax = 0.f;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const int i = threadIdx.x + j * 256;
            r[j] = __bfloat162float(__float2bfloat16(r[j] * inv * nw[i]));
            amax = fmaxf(amax, fabsf(r[j]));
        }
        if (KIND == 0) {
            amax = block_max(amax);
            s = amax > 0.f ? amax / 448.f : 1.f;
            const float qi = 1.f / s;
#pragma unroll
            for (int j = 0; j < 16; ++j)
                smem[threadIdx.x + j * 256] = (unsigned char)__nv_cvt_float_to_fp8(r[j] * qi, __NV_SATFINITE, __NV_E4M3);
        } else {
            __half* xh = reinterpret_cast<__half*>(smem);
#pragma unroll
            for (int j = 0; j < 16; ++j) xh[threadIdx.x + j * 256] = __float2half(r[j]);
        }
    } else {
        const bf16* src = m == MODE_O ? st.qkv : st.act;
        if (KIND == 0) {
            // k / 8 16-byte words, at most 7 a thread (k = 14336), kept in registers.
            const uint4* sv = reinterpret_cast<const uint4*>(src);
            uint4 v[7];
            float amax = 0.f;
#pragma unroll
            for (int j = 0; j < 7; ++j) {
                const int q = threadIdx.x + 256 * j;
                v[j] = q < k / 8 ? __ldcg(sv + q) : make_uint4(0, 0, 0, 0);
                const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v[j]);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float2 f = __bfloat1622float2(p[i]);
                    amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
                }
            }
            amax = block_max(amax);
            s = amax > 0.f ? amax / 448.f : 1.f;
            const float qi = 1.f / s;
#pragma unroll
            for (int j = 0; j < 7; ++j) {
                const int q = threadIdx.x + 256 * j;
                if (q < k / 8) {
                    const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v[j]);
                    unsigned char o[8];
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const float2 f = __bfloat1622float2(p[i]);
                        o[2 * i] = (unsigned char)__nv_cvt_float_to_fp8(f.x * qi, __NV_SATFINITE, __NV_E4M3);
                        o[2 * i + 1] = (unsigned char)__nv_cvt_float_to_fp8(f.y * qi, __NV_SATFINITE, __NV_E4M3);
                    }
                    *reinterpret_cast<uint2*>(smem + 8 * q) = *reinterpret_cast<const uint2*>(o);
                }
            }
        } else {
            const uint4* sv = reinterpret_cast<const uint4*>(src);
            uint4* dv = reinterpret_cast<uint4*>(smem);
            for (int q = threadIdx.x; q < k / 8; q += blockDim.x) {
                const uint4 v = __ldcg(sv + q);
                const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
                uint4 o;
                __half2* h = reinterpret_cast<__half2*>(&o);
#pragma unroll
                for (int i = 0; i < 4; ++i) h[i] = __float22half2_rn(__bfloat1622float2(p[i]));
                dv[q] = o;
            }
        }
    }
    __syncthreads();
    return s;
}

template <int M, int KIND, int T, int MINB>
__global__ void __launch_bounds__(256, MINB) k_tc2(Step st, int layer) {
    extern __shared__ __align__(16) unsigned char tsm[];
    __shared__ float part[8][16];
    const unsigned char* w = st.layer[layer].w[M];
    const float* ws = st.layer[layer].s[M];
    constexpr int k = phase_k(M), kw = k / 8, tiles = kw / 64, units = tc_units(M);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    asm volatile("griddepcontrol.wait;" ::: "memory");
    const float xs = tc2_stage<KIND>(M, st, tsm);
    for (int u = blockIdx.x; u < units; u += gridDim.x) {
        float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 1
        for (int j0 = 0; j0 < tiles; j0 += T) {
            uint4 pa[T], pb[T];
            tc_load<M, T>(w, u, j0, pa, pb);
#pragma unroll
            for (int j = 0; j < T; ++j) {
                if (j0 + j < tiles) {
                    const int p = warp * kw + 64 * (j0 + j) + 16 * t;  // this lane's k offset
                    if (KIND == 0) {
                        const uint4 bx = g == 0 ? *reinterpret_cast<const uint4*>(tsm + p) : make_uint4(0, 0, 0, 0);
                        mma_e4m3(c, pa[j].x, pb[j].x, pa[j].y, pb[j].y, bx.x, bx.y);
                        mma_e4m3(c, pa[j].z, pb[j].z, pa[j].w, pb[j].w, bx.z, bx.w);
                    } else {
                        const uint4* xv = reinterpret_cast<const uint4*>(tsm + 2 * p);
                        const uint4 u0 = g == 0 ? xv[0] : make_uint4(0, 0, 0, 0);
                        const uint4 u1 = g == 0 ? xv[1] : make_uint4(0, 0, 0, 0);
                        const unsigned wa4[4] = {pa[j].x, pa[j].y, pa[j].z, pa[j].w};
                        const unsigned wb4[4] = {pb[j].x, pb[j].y, pb[j].z, pb[j].w};
                        const unsigned xb[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
#pragma unroll
                        for (int i = 0; i < 4; ++i)
                            mma_f16(c, cvt2(wa4[i]), cvt2(wb4[i]), cvt2(wa4[i] >> 16), cvt2(wb4[i] >> 16), xb[2 * i], xb[2 * i + 1]);
                    }
                }
            }
        }
        tc_unit_out<M>(st, ws, u, xs, c, part);
    }
}

// k_stc (TC=1): sep's kernel, a warp a row or row pair with lane L reading 16 bytes at 16 L of
// every 512 (so the loads are sep's), the dot products on the tensor cores. The trick: A's 16
// rows are not 16 weight rows but the 8 lane quads' bytes of the two rows (rows 0..7: row r0's
// 64-byte pieces, one a quad; rows 8..15: r1's at the same k), and B's column n holds the input
// at quad n's k, so D[n][n] (and D[8 + n][n]) is quad n's partial dot product; the other 56
// entries of each 8 are not used. The tensor cores are far from busy at one stream, so the
// waste is free; what is saved is sep's conversions and FMAs. KIND 0: e4m3 operands (W8A8, the
// input quantized per token), 2 mma a 16-byte chunk; KIND 1: f16 operands (weight-only like
// sep), the weights by cvt.rn.f16x2.e4m3x2, 4 mma a chunk. O and down (one row a warp) put
// zeros in rows 8..15.
template <int KIND>
__device__ __forceinline__ void stc_dot(const uint4& pa, const uint4& pb, bool two, const uint4& x0, const uint4& x1, float c[4]) {
    if (KIND == 0) {
        if (two) {
            mma_e4m3(c, pa.x, pb.x, pa.y, pb.y, x0.x, x0.y);
            mma_e4m3(c, pa.z, pb.z, pa.w, pb.w, x0.z, x0.w);
        } else {
            mma_e4m3(c, pa.x, 0u, pa.y, 0u, x0.x, x0.y);
            mma_e4m3(c, pa.z, 0u, pa.w, 0u, x0.z, x0.w);
        }
    } else {
        const unsigned wa4[4] = {pa.x, pa.y, pa.z, pa.w};
        const unsigned wb4[4] = {pb.x, pb.y, pb.z, pb.w};
        const unsigned xb[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if (two) mma_f16(c, cvt2(wa4[i]), cvt2(wb4[i]), cvt2(wa4[i] >> 16), cvt2(wb4[i] >> 16), xb[2 * i], xb[2 * i + 1]);
            else mma_f16(c, cvt2(wa4[i]), 0u, cvt2(wa4[i] >> 16), 0u, xb[2 * i], xb[2 * i + 1]);
        }
    }
}
template <int M, int KIND, int UU>
__global__ void __launch_bounds__(256) k_stc(Step st, int layer) {
    extern __shared__ __align__(16) unsigned char tsm[];
    asm volatile("griddepcontrol.wait;" ::: "memory");
    const float xs = tc2_stage<KIND>(M, st, tsm);
    const unsigned char* w = st.layer[layer].w[M];
    const float* ws = st.layer[layer].s[M];
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    constexpr int k = phase_k(M), kc = k >> 4, units = phase_units(M);
    const int nw = (int)((gridDim.x * blockDim.x) >> 5);
    const uint4* xi = reinterpret_cast<const uint4*>(tsm);
    const bool diag0 = g == 2 * t, diag1 = g == 2 * t + 1;
    for (int u = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5); u < units; u += nw) {
        int r0, r1;
        unit_rows(M, u, r0, r1);
        const bool two = r1 >= 0;
        const uint4* w0 = reinterpret_cast<const uint4*>(w + (size_t)r0 * k);
        const uint4* w1 = reinterpret_cast<const uint4*>(w + (size_t)(two ? r1 : r0) * k);
        float c[UU][4] = {};
        for (int c0 = lane; c0 < kc; c0 += 32 * UU) {
            uint4 q0[UU], q1[UU];
#pragma unroll
            for (int j = 0; j < UU; ++j) {
                const int cc = c0 + 32 * j;
                q0[j] = cc < kc ? ld_stream(w0 + cc) : make_uint4(0, 0, 0, 0);
                if (two) q1[j] = cc < kc ? ld_stream(w1 + cc) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int j = 0; j < UU; ++j) {
                const int cc = c0 + 32 * j;
                if (cc < kc) {
                    const uint4 x0 = KIND == 0 ? xi[cc] : xi[2 * cc];
                    const uint4 x1 = KIND == 0 ? x0 : xi[2 * cc + 1];
                    stc_dot<KIND>(q0[j], q1[j], two, x0, x1, c[j]);
                }
            }
        }
        float da = 0.f, db = 0.f;
#pragma unroll
        for (int j = 0; j < UU; ++j) {
            da += diag0 ? c[j][0] : diag1 ? c[j][1] : 0.f;
            db += diag0 ? c[j][2] : diag1 ? c[j][3] : 0.f;
        }
        unit_out(M, st, u, r0, r1, warp_sum(da) * xs * ws[r0], two ? warp_sum(db) * xs * ws[r1] : 0.f, lane);
    }
}

__global__ void k_fill(unsigned char* p, size_t n, unsigned int seed) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned int h = (unsigned int)i * 2654435761u ^ seed;
        h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
        p[i] = (unsigned char)(h & 0xb7u);  // exponent <= 6: no NaN, |w| < 1
    }
}
__global__ void k_setf(float* p, int n, float v) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] = v;
}

#ifndef __CUDACC_RTC__
// kernel<<<grid, threads, smem>>>(args...) with programmatic stream serialisation (PDL).
// The stream the launch helpers launch on: the legacy default stream, but for the GRAPH
// section's own stream, which it captures.
static cudaStream_t g_stream = 0;

template <typename K, typename... A>
static void launch_pdl_smem(int threads, int smem, K kernel, int grid, A... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.stream = g_stream;
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    CK(cudaLaunchKernelEx(&cfg, kernel, args...));
}
template <typename K, typename... A>
static void launch_pdl_t(int threads, K kernel, int grid, A... args) {
    launch_pdl_smem(threads, 0, kernel, grid, args...);
}
template <typename K, typename... A>
static void launch_pdl(K kernel, int grid, A... args) {
    launch_pdl_t(256, kernel, grid, args...);
}

static float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main(int argc, char** argv) {
    const int reps = argc > 1 ? atoi(argv[1]) : 20;
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const int sms = prop.multiProcessorCount;
    printf("device %s, %d SMs, L2 %d MB\n", prop.name, sms, prop.l2CacheSize >> 20);
    const size_t rows[4] = {NQKV, H, 2 * (size_t)FF, H}, ks[4] = {H, H, H, FF};
    size_t layer_bytes = 0;
    for (int m = 0; m < 4; ++m) layer_bytes += rows[m] * ks[m];
    Step st = {};
    st.layers = LAYERS;
    unsigned char* wall;
    CK(cudaMalloc(&wall, layer_bytes * LAYERS));
    k_fill<<<4096, 256>>>(wall, layer_bytes * LAYERS, 12345u);
    float* sall;
    const size_t srows = NQKV + H + 2 * FF + H;
    CK(cudaMalloc(&sall, srows * LAYERS * sizeof(float)));
    k_setf<<<1024, 256>>>(sall, (int)(srows * LAYERS), 1.f / 64.f);
    for (int l = 0; l < LAYERS; ++l) {
        size_t off = l * layer_bytes, soff = l * srows;
        for (int m = 0; m < 4; ++m) {
            st.layer[l].w[m] = wall + off;
            st.layer[l].s[m] = sall + soff;
            off += rows[m] * ks[m];
            soff += rows[m];
        }
    }
    float *n1, *n2, *resid, *sink;
    CK(cudaMalloc(&n1, H * 4)); CK(cudaMalloc(&n2, H * 4)); CK(cudaMalloc(&resid, H * 4)); CK(cudaMalloc(&sink, 4));
    k_setf<<<16, 256>>>(n1, H, 1.f);
    k_setf<<<16, 256>>>(n2, H, 0.5f);
    CK(cudaMalloc(&st.qkv, NQKV * 2));
    CK(cudaMalloc(&st.act, FF * 2));
    CK(cudaMalloc(&st.bar, 4));
    st.n1 = n1; st.n2 = n2; st.resid = resid;
    CK(cudaDeviceSynchronize());
    std::vector<float> init(H);
    for (int i = 0; i < H; ++i) init[i] = (float)((i * 37) % 101 - 50) / 50.f;
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    auto reset = [&]() {
        CK(cudaMemcpy(resid, init.data(), H * 4, cudaMemcpyHostToDevice));
        CK(cudaMemset(st.bar, 0, 4));
        CK(cudaDeviceSynchronize());  // a stream of its own (GRAPH) is not ordered after these
    };
    const int grid_sep = 4 * sms;
    auto step_sep_v = [&](auto q, auto o, auto g, auto d) {
        for (int l = 0; l < LAYERS; ++l) {
            launch_pdl(q, std::min(grid_sep, (phase_units(MODE_QKV) + 7) / 8), st, l);
            launch_pdl(o, std::min(grid_sep, (phase_units(MODE_O) + 7) / 8), st, l);
            launch_pdl(g, std::min(grid_sep, (phase_units(MODE_GU) + 7) / 8), st, l);
            launch_pdl(d, std::min(grid_sep, (phase_units(MODE_DOWN) + 7) / 8), st, l);
        }
    };
#define SEP(V) [&]() { step_sep_v(k_sep<0, V>, k_sep<1, V>, k_sep<2, V>, k_sep<3, V>); }
    auto step_sep = SEP(0);
    auto time_it = [&](const char* name, auto&& fn, std::vector<float>* out) {
        std::vector<float> ts;
        for (int r = 0; r < reps + 3; ++r) {
            reset();
            CK(cudaEventRecord(e0, g_stream));
            fn();
            CK(cudaEventRecord(e1, g_stream));
            CK(cudaEventSynchronize(e1));
            CK(cudaGetLastError());
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            if (r >= 3) ts.push_back(ms);
        }
        const float t = median(ts);
        printf("%-22s step %8.1f us  layer %6.2f us  %6.0f GB/s  (min %.1f max %.1f)\n", name, t * 1e3f,
               t * 1e3f / LAYERS, (double)layer_bytes * LAYERS / (t * 1e-3) / 1e9, *std::min_element(ts.begin(), ts.end()) * 1e3f,
               *std::max_element(ts.begin(), ts.end()) * 1e3f);
        if (out) {
            out->resize(H);
            CK(cudaMemcpy(out->data(), resid, H * 4, cudaMemcpyDeviceToHost));
        }
    };
    std::vector<float> ref, got;
    printf("weights %.1f MB a layer, %.2f GB a step\n", layer_bytes / 1e6, layer_bytes * LAYERS / 1e9);
    time_it("read (floor)", [&]() {
        for (int l = 0; l < LAYERS; ++l)
            launch_pdl(k_read, 8 * sms, reinterpret_cast<const uint4*>(st.layer[l].w[0]), layer_bytes / 16, sink);
    }, nullptr);

    // The four projections' bytes a layer, four launches: sequential reads, then a warp a row.
    {
        const size_t prow[4] = {NQKV, H, 2 * (size_t)FF, H}, pk[4] = {H, H, H, FF};
        auto four = [&](const char* name, auto&& one) {
            time_it(name, [&]() {
                for (int l = 0; l < LAYERS; ++l)
                    for (int m = 0; m < 4; ++m) one(st.layer[l].w[m], (int)prow[m], (int)pk[m]);
            }, nullptr);
        };
        four("read, 4 launches", [&](const unsigned char* w, int r, int k) {
            launch_pdl(k_read, 8 * sms, reinterpret_cast<const uint4*>(w), (size_t)r * k / 16, sink);
        });
        for (int b : {4, 8}) {
            char name[64];
            snprintf(name, sizeof name, "rows U2, %d/SM", b);
            four(name, [&](const unsigned char* w, int r, int k) { launch_pdl(k_rows<2>, std::min(b * sms, r / 8), w, r, k, sink); });
            snprintf(name, sizeof name, "rows U4, %d/SM", b);
            four(name, [&](const unsigned char* w, int r, int k) { launch_pdl(k_rows<4>, std::min(b * sms, r / 8), w, r, k, sink); });
            snprintf(name, sizeof name, "rows U8, %d/SM", b);
            four(name, [&](const unsigned char* w, int r, int k) { launch_pdl(k_rows<8>, std::min(b * sms, r / 8), w, r, k, sink); });
        }
        four("rows U2 as sep: pairs for Q/K/V, gate/up", [&](const unsigned char* w, int r, int k) {
            if (r == NQKV || r == 2 * FF) launch_pdl(k_rows<2, true>, std::min(4 * sms, r / 16), w, r, k, sink);
            else launch_pdl(k_rows<2>, std::min(4 * sms, r / 8), w, r, k, sink);
        });
        four("rows U4, all rows a warp", [&](const unsigned char* w, int r, int k) { launch_pdl(k_rows<4>, r / 8, w, r, k, sink); });
    }
    time_it("sep (PDL)", step_sep, &ref);
    if (getenv("GRAPH")) {
        // What the launches cost beyond the kernels, as the engine issues them (one stream, a
        // launch each) against a CUDA graph of the same launches, captured with their
        // programmatic dependencies and replayed; both on a stream of their own, in this process.
        CK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
        auto graph_of = [&](const char* name, auto&& fn, bool compare) {
            char label[80];
            snprintf(label, sizeof label, "%s, stream", name);
            time_it(label, fn, &got);
            if (compare) printf("    bit-equal to sep: %s\n", memcmp(ref.data(), got.data(), H * 4) == 0 ? "yes" : "NO");
            cudaGraph_t g;
            cudaGraphExec_t ge;
            CK(cudaStreamBeginCapture(g_stream, cudaStreamCaptureModeThreadLocal));
            fn();
            CK(cudaStreamEndCapture(g_stream, &g));
            CK(cudaGraphInstantiate(&ge, g, 0));
            CK(cudaGraphUpload(ge, g_stream));
            snprintf(label, sizeof label, "%s, graph", name);
            time_it(label, [&]() { CK(cudaGraphLaunch(ge, g_stream)); }, &got);
            if (compare) printf("    bit-equal to sep: %s\n", memcmp(ref.data(), got.data(), H * 4) == 0 ? "yes" : "NO");
            CK(cudaGraphExecDestroy(ge));
            CK(cudaGraphDestroy(g));
        };
        auto read4 = [&]() {
            for (int l = 0; l < LAYERS; ++l)
                for (int m = 0; m < 4; ++m)
                    launch_pdl(k_read, 8 * sms, reinterpret_cast<const uint4*>(st.layer[l].w[m]), rows[m] * ks[m] / 16, sink);
        };
        auto read1 = [&]() {
            for (int l = 0; l < LAYERS; ++l)
                launch_pdl(k_read, 8 * sms, reinterpret_cast<const uint4*>(st.layer[l].w[0]), layer_bytes / 16, sink);
        };
        for (int rep = 0; rep < 2; ++rep) {
            graph_of("read (floor)", read1, false);
            graph_of("read, 4 launches", read4, false);
            graph_of("sep (PDL)", step_sep, true);
        }
        g_stream = 0;
        if (getenv("ONLY_GRAPH")) return 0;
    }
    if (getenv("TC")) {
        // The tensor-core GEMV against sep: relative error of the residual (W8A8 against
        // weight-only, so not bit-equal), for grids of one unit a block and 1 / 2 blocks an SM.
        auto tc_err = [&]() {
            double d = 0, r = 0;
            for (int i = 0; i < H; ++i) { d = std::max(d, (double)fabsf(got[i] - ref[i])); r = std::max(r, (double)fabsf(ref[i])); }
            printf("    max |tc - sep| / max |sep| = %.2e\n", d / r);
        };
        auto step_tc = [&](auto q, auto o, auto g, auto d, int cap) {
            for (int l = 0; l < LAYERS; ++l) {
                launch_pdl(q, std::min(cap, tc_units(MODE_QKV)), st, l);
                launch_pdl(o, std::min(cap, tc_units(MODE_O)), st, l);
                launch_pdl(g, std::min(cap, tc_units(MODE_GU)), st, l);
                launch_pdl(d, std::min(cap, tc_units(MODE_DOWN)), st, l);
            }
        };
#define TCV(V, CAP) [&]() { step_tc(k_tc<0, V>, k_tc<1, V>, k_tc<2, V>, k_tc<3, V>, CAP); }
        // The four projections of a layer with dynamic shared memory smem[m] and grid
        // grid_of(m), each launched with PDL, timed and compared with sep.
        auto four_smem = [&](auto q, auto o, auto g, auto d, const int (&smem)[4], auto grid_of, const char* label) {
            CK(cudaFuncSetAttribute(q, cudaFuncAttributeMaxDynamicSharedMemorySize, smem[0]));
            CK(cudaFuncSetAttribute(o, cudaFuncAttributeMaxDynamicSharedMemorySize, smem[1]));
            CK(cudaFuncSetAttribute(g, cudaFuncAttributeMaxDynamicSharedMemorySize, smem[2]));
            CK(cudaFuncSetAttribute(d, cudaFuncAttributeMaxDynamicSharedMemorySize, smem[3]));
            time_it(label, [&]() {
                for (int l = 0; l < LAYERS; ++l) {
                    launch_pdl_smem(256, smem[0], q, grid_of(0), st, l);
                    launch_pdl_smem(256, smem[1], o, grid_of(1), st, l);
                    launch_pdl_smem(256, smem[2], g, grid_of(2), st, l);
                    launch_pdl_smem(256, smem[3], d, grid_of(3), st, l);
                }
            }, &got);
            tc_err();
        };
        // The staged input: k bytes (e4m3, kind 0) or 2 k (f16, kind 1).
        auto tc_smem = [](int kind, int (&smem)[4]) {
            for (int m = 0; m < 4; ++m) smem[m] = (1 + kind) * phase_k(m);
        };
        // k_stc: sep's grid (4 / 6 / 8 blocks an SM).
        auto stc = [&](auto q, auto o, auto g, auto d, int kind, const char* name) {
            int smem[4];
            tc_smem(kind, smem);
            for (int per : {4, 6, 8}) {
                char label[80];
                snprintf(label, sizeof label, "%s grid %d/SM", name, per);
                four_smem(q, o, g, d, smem, [&](int m) { return std::min(per * sms, (phase_units(m) + 7) / 8); }, label);
            }
        };
        // k_tc2: KIND, T, MINB; grid MINB blocks an SM (looping) or one unit a block.
        auto tc2 = [&](auto q, auto o, auto g, auto d, int kind, int minb, const char* name) {
            int smem[4];
            tc_smem(kind, smem);
            for (int cap : {minb * sms, 1 << 30}) {
                char label[80];
                snprintf(label, sizeof label, "%s grid %s", name, cap == minb * sms ? "MINB/SM" : "units");
                four_smem(q, o, g, d, smem, [&](int m) { return std::min(cap, tc_units(m)); }, label);
            }
        };
#define TC2(KIND, T, MINB) tc2(k_tc2<0, KIND, T, MINB>, k_tc2<1, KIND, T, MINB>, k_tc2<2, KIND, T, MINB>, k_tc2<3, KIND, T, MINB>, KIND, MINB, "tc2 k" #KIND " T" #T " B" #MINB)
        for (int rep = 0; rep < 2; ++rep) {
            stc(k_stc<0, 1, 2>, k_stc<1, 1, 2>, k_stc<2, 1, 2>, k_stc<3, 1, 2>, 1, "stc f16 U2");
            stc(k_stc<0, 1, 4>, k_stc<1, 1, 4>, k_stc<2, 1, 4>, k_stc<3, 1, 4>, 1, "stc f16 U4");
            stc(k_stc<0, 0, 2>, k_stc<1, 0, 2>, k_stc<2, 0, 2>, k_stc<3, 0, 2>, 0, "stc e4m3 U2");
            stc(k_stc<0, 0, 4>, k_stc<1, 0, 4>, k_stc<2, 0, 4>, k_stc<3, 0, 4>, 0, "stc e4m3 U4");
            time_it("sep (PDL) again", step_sep, nullptr);
        }
        TC2(0, 4, 4); TC2(0, 8, 2); TC2(0, 4, 3); TC2(0, 2, 6);
        TC2(1, 4, 4); TC2(1, 8, 2); TC2(1, 4, 3); TC2(1, 2, 6);
        time_it("sep (PDL) again", step_sep, nullptr);
        for (int cap : {1 << 30, 2 * sms, sms}) {
            const char* grid = cap == sms ? "1/SM" : cap == 2 * sms ? "2/SM" : "units";
            char name[64];
            snprintf(name, sizeof name, "tc V0 grid %s", grid);
            time_it(name, TCV(0, cap), &got);
            tc_err();
            snprintf(name, sizeof name, "tc V1 grid %s", grid);
            time_it(name, TCV(1, cap), &got);
            tc_err();
            snprintf(name, sizeof name, "tc V2 grid %s", grid);
            time_it(name, TCV(2, cap), &got);
            tc_err();
        }
        time_it("sep (PDL) again", step_sep, nullptr);
        if (getenv("ONLY_TC")) return 0;
    }
    time_it("sep, dot: int to f16, hfma2", SEP(6), nullptr);
    time_it("sep, dot: no conversion", SEP(7), nullptr);
    time_it("sep, dot: cvt to f16, hfma2", SEP(8), nullptr);
    time_it("sep, dot: no conversion, no x", SEP(9), nullptr);
    time_it("sep, input split in halves", SEP(10), &got);
    printf("    bit-equal to sep: %s\n", memcmp(ref.data(), got.data(), H * 4) == 0 ? "yes" : "NO");
    time_it("sep, pipelined loads", SEP(5), &got);
    printf("    bit-equal to sep: %s\n", memcmp(ref.data(), got.data(), H * 4) == 0 ? "yes" : "NO");
    time_it("sep, loads after wait", SEP(1), &got);
    printf("    bit-equal to sep: %s\n", memcmp(ref.data(), got.data(), H * 4) == 0 ? "yes" : "NO");
    time_it("sep, loads before wait", SEP(2), &got);
    printf("    bit-equal to sep: %s\n", memcmp(ref.data(), got.data(), H * 4) == 0 ? "yes" : "NO");
    time_it("sep, norm without sum", SEP(3), nullptr);
    time_it("sep, no input staged", SEP(4), nullptr);
    time_it("sep (PDL) again", step_sep, nullptr);

    // L2 prefetch across the kernel boundaries, the attention stand-in in the step (q, attn, o,
    // gate/up, down a layer). Bit-equality against `sep`: the stand-in writes nothing the step reads.
    {
        const unsigned int mask = (1u << 17) - 1;
        std::vector<unsigned int> perm(mask + 1);
        for (unsigned int i = 0; i <= mask; ++i) perm[i] = (i * 5u + 12345u) & mask;
        unsigned int* kv;
        CK(cudaMalloc(&kv, perm.size() * 4));
        CK(cudaMemcpy(kv, perm.data(), perm.size() * 4, cudaMemcpyHostToDevice));
        st.kv = kv;
        st.sink = sink;
        auto clear = [&]() { for (auto& b : st.pf) b = 0; st.pf_attn = 0; st.pf_hint = 0; };
        clear();
        // Calibrate the chain so the stand-in alone costs about 6 us a layer in the step
        // (kvf_decode at a 128-token context, ncu: 6.1-7.8 us).
        st.attn_chain = 32;
        std::vector<float> ts;
        for (int r = 0; r < 13; ++r) {
            CK(cudaEventRecord(e0));
            for (int l = 0; l < LAYERS; ++l) launch_pdl_t(128, k_attn, 16, st, l);
            CK(cudaEventRecord(e1));
            CK(cudaEventSynchronize(e1));
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            if (r >= 3) ts.push_back(ms);
        }
        const float per_link = median(ts) * 1e3f / LAYERS / 32.f;
        st.attn_chain = std::max(1, (int)lrintf(6.f / per_link));
        printf("attention stand-in: %.3f us a link, chain %d\n", per_link, st.attn_chain);
        time_it("attn alone (x32, bytes: none)", [&]() {
            for (int l = 0; l < LAYERS; ++l) launch_pdl_t(128, k_attn, 16, st, l);
        }, nullptr);
        auto step_attn_v = [&](auto q, auto o, auto g, auto d) {
            for (int l = 0; l < LAYERS; ++l) {
                launch_pdl(q, std::min(grid_sep, (phase_units(MODE_QKV) + 7) / 8), st, l);
                launch_pdl_t(128, k_attn, 16, st, l);
                launch_pdl(o, std::min(grid_sep, (phase_units(MODE_O) + 7) / 8), st, l);
                launch_pdl(g, std::min(grid_sep, (phase_units(MODE_GU) + 7) / 8), st, l);
                launch_pdl(d, std::min(grid_sep, (phase_units(MODE_DOWN) + 7) / 8), st, l);
            }
        };
#define ATT(V) [&]() { step_attn_v(k_sep<0, V>, k_sep<1, V>, k_sep<2, V>, k_sep<3, V>); }
        auto check = [&]() { printf("    bit-equal to sep: %s\n", memcmp(ref.data(), got.data(), H * 4) == 0 ? "yes" : "NO"); };
        const size_t MB = 1u << 20, o_bytes = (size_t)H * H;
        // The next kernel's size, by the issuing projection: O, gate/up, down, Q/K/V.
        const size_t next_size[4] = {o_bytes, 2 * (size_t)FF * H, (size_t)H * FF, (size_t)NQKV * H};
        auto set_pf = [&](size_t x, bool qkv_too) {
            for (int m = 0; m < 4; ++m) st.pf[m] = std::min(x, next_size[m]);
            if (!qkv_too) st.pf[MODE_QKV] = 0;
        };
        time_it("sep + attn", ATT(0), &got);
        check();
        if (getenv("OPRE")) {
            // O's rows fetched into registers while attention runs, against sep's O.
            for (int rep = 0; rep < 2; ++rep) {
                for (int early = 0; early < 2; ++early) {
                    st.attn_early = early;
                    const char* e = early ? ", attn triggers early" : "";
                    char name[96];
                    snprintf(name, sizeof name, "sep + attn%s", e);
                    time_it(name, ATT(0), &got);
                    check();
                    snprintf(name, sizeof name, "O in registers before wait%s", e);
                    time_it(name, [&]() { step_attn_v(k_sep<0, 0>, k_o_pre<true>, k_sep<2, 0>, k_sep<3, 0>); }, &got);
                    check();
                    snprintf(name, sizeof name, "O in registers after wait%s", e);
                    time_it(name, [&]() { step_attn_v(k_sep<0, 0>, k_o_pre<false>, k_sep<2, 0>, k_sep<3, 0>); }, &got);
                    check();
                }
            }
            st.attn_early = 0;
            if (getenv("ONLY_OPRE")) return 0;
        }
        for (int hint = 0; hint < 2; ++hint) {
            st.pf_hint = hint;
            char name[96];
            for (size_t a : {o_bytes, o_bytes + 8 * MB, o_bytes + 16 * MB}) {
                st.pf_attn = a;
                snprintf(name, sizeof name, "attn prefetches %zu MB%s", a / MB, hint ? " (evict-last)" : "");
                time_it(name, ATT(0), &got);
                check();
            }
            st.pf_attn = 0;
            for (size_t x : {4 * MB, 8 * MB, 16 * MB, 24 * MB}) {
                set_pf(x, true);
                snprintf(name, sizeof name, "exit prefetch %zu MB%s", x / MB, hint ? " (evict-last)" : "");
                time_it(name, ATT(11), &got);
                check();
            }
            st.pf_attn = o_bytes;
            for (size_t x : {8 * MB, 16 * MB}) {
                set_pf(x, false);
                snprintf(name, sizeof name, "attn O + exit %zu MB%s", x / MB, hint ? " (evict-last)" : "");
                time_it(name, ATT(11), &got);
                check();
            }
            st.pf_attn = 0;
            for (size_t x : {8 * MB, 16 * MB}) {
                set_pf(x, true);
                snprintf(name, sizeof name, "start prefetch %zu MB%s", x / MB, hint ? " (evict-last)" : "");
                time_it(name, ATT(12), &got);
                check();
            }
            for (size_t x : {8 * MB, 16 * MB, 24 * MB}) {
                set_pf(x, true);
                snprintf(name, sizeof name, "exit %zu MB, own loads evict-first%s", x / MB, hint ? " (evict-last)" : "");
                time_it(name, ATT(13), &got);
                check();
            }
        }
        clear();
        time_it("sep + attn again", ATT(0), &got);
        check();
    }
    auto persist = [&](auto kernel, const char* name) {
        int per_sm = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 256, 0));
        for (int b = 1; b <= std::min(per_sm, 4); ++b) {
            char label[64];
            snprintf(label, sizeof label, "%s x%d/SM", name, b);
            const int grid = b * sms;
            time_it(label, [&]() {
                void* args[] = {&st};
                CK(cudaLaunchCooperativeKernel((void*)kernel, dim3(grid), dim3(256), args, 0, 0));
            }, &got);
            printf("    bit-equal to sep: %s\n", memcmp(ref.data(), got.data(), H * 4) == 0 ? "yes" : "NO");
        }
    };
    if (getenv("PERSIST")) {
        persist(k_persist<1, false>, "persist");
        persist(k_persist<1, true>, "persist pre1");
    }

    // The bulk-copy projections: stage units su a projection (su * k bytes, 8 / su warps a unit).
    auto tma_run = [&](auto kq, auto ko, auto kg, auto kd, int per_sm, int nw, const char* name) {
        const int su_of[4] = {8, 8, 4, 2};
        const int S = kq.second;
        auto set = [&](auto kernel, int m) {
            const int smem = 320 + 2 * phase_k(m) + S * (m == MODE_GU ? 2 : 1) * su_of[m] * phase_k(m);
            CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
            return smem;
        };
        const int sq = set(kq.first, 0), so = set(ko.first, 1), sg = set(kg.first, 2), sd = set(kd.first, 3);
        auto launch = [&](auto kernel, int smem, int l, int su) {
            launch_pdl_smem(32 * nw, smem, kernel, per_sm * sms, st, l, su);
        };
        char label[64];
        snprintf(label, sizeof label, "%s %dw x%d/SM", name, nw, per_sm);
        time_it(label, [&]() {
            for (int l = 0; l < LAYERS; ++l) {
                launch(kq.first, sq, l, su_of[0]);
                launch(ko.first, so, l, su_of[1]);
                launch(kg.first, sg, l, su_of[2]);
                launch(kd.first, sd, l, su_of[3]);
            }
        }, &got);
        double d = 0, r = 0;
        for (int i = 0; i < H; ++i) { d = std::max(d, (double)fabsf(got[i] - ref[i])); r = std::max(r, (double)fabsf(ref[i])); }
        printf("    max |tma - sep| / max |sep| = %.2e (smem %d %d %d %d)\n", d / r, sq, so, sg, sd);
    };
#define TMA(S, E, NW, B, NAME) tma_run(std::make_pair(k_tma<0, S, E, NW>, S), std::make_pair(k_tma<1, S, E, NW>, S), \
                                       std::make_pair(k_tma<2, S, E, NW>, S), std::make_pair(k_tma<3, S, E, NW>, S), B, NW, NAME)
    if (getenv("TMA")) {
    TMA(3, true, 8, 1, "tma S3 early");
    TMA(3, true, 16, 1, "tma S3 early");
    TMA(3, true, 32, 1, "tma S3 early");
    TMA(3, false, 32, 1, "tma S3 late");
    TMA(2, true, 16, 2, "tma S2 early");
    TMA(2, false, 16, 2, "tma S2 late");
    }
    time_it("sep (PDL) again", step_sep, nullptr);
    printf("resid[0..3] %g %g %g %g\n", ref[0], ref[1], ref[2], ref[3]);
    return 0;
}
#else
template __global__ void k_sep<0, 5>(Step, int);
template __global__ void k_sep<1, 5>(Step, int);
template __global__ void k_sep<2, 5>(Step, int);
template __global__ void k_sep<3, 5>(Step, int);
template __global__ void k_sep<0, 6>(Step, int);
template __global__ void k_sep<0, 7>(Step, int);
template __global__ void k_sep<0, 8>(Step, int);
template __global__ void k_sep<1, 6>(Step, int);
template __global__ void k_sep<1, 7>(Step, int);
template __global__ void k_sep<1, 8>(Step, int);
template __global__ void k_sep<2, 6>(Step, int);
template __global__ void k_sep<2, 7>(Step, int);
template __global__ void k_sep<2, 8>(Step, int);
template __global__ void k_sep<3, 6>(Step, int);
template __global__ void k_sep<3, 7>(Step, int);
template __global__ void k_sep<3, 8>(Step, int);
template __global__ void k_sep<0, 9>(Step, int);
template __global__ void k_sep<1, 9>(Step, int);
template __global__ void k_sep<2, 9>(Step, int);
template __global__ void k_sep<3, 9>(Step, int);
template __global__ void k_sep<0, 10>(Step, int);
template __global__ void k_sep<1, 10>(Step, int);
template __global__ void k_sep<2, 10>(Step, int);
template __global__ void k_sep<3, 10>(Step, int);
template __global__ void k_sep<0, 0>(Step, int);
template __global__ void k_sep<0, 1>(Step, int);
template __global__ void k_sep<0, 2>(Step, int);
template __global__ void k_sep<0, 3>(Step, int);
template __global__ void k_sep<0, 4>(Step, int);
template __global__ void k_sep<1, 0>(Step, int);
template __global__ void k_sep<1, 1>(Step, int);
template __global__ void k_sep<1, 2>(Step, int);
template __global__ void k_sep<1, 3>(Step, int);
template __global__ void k_sep<1, 4>(Step, int);
template __global__ void k_sep<2, 0>(Step, int);
template __global__ void k_sep<2, 1>(Step, int);
template __global__ void k_sep<2, 2>(Step, int);
template __global__ void k_sep<2, 3>(Step, int);
template __global__ void k_sep<2, 4>(Step, int);
template __global__ void k_sep<3, 0>(Step, int);
template __global__ void k_sep<3, 1>(Step, int);
template __global__ void k_sep<3, 2>(Step, int);
template __global__ void k_sep<3, 3>(Step, int);
template __global__ void k_sep<3, 4>(Step, int);
template __global__ void k_tma<0, 2, true, 8>(Step, int, int);
template __global__ void k_tma<0, 2, true, 16>(Step, int, int);
template __global__ void k_tma<0, 2, true, 32>(Step, int, int);
template __global__ void k_tma<0, 2, false, 8>(Step, int, int);
template __global__ void k_tma<0, 2, false, 16>(Step, int, int);
template __global__ void k_tma<0, 2, false, 32>(Step, int, int);
template __global__ void k_tma<0, 3, true, 8>(Step, int, int);
template __global__ void k_tma<0, 3, true, 16>(Step, int, int);
template __global__ void k_tma<0, 3, true, 32>(Step, int, int);
template __global__ void k_tma<0, 3, false, 8>(Step, int, int);
template __global__ void k_tma<0, 3, false, 16>(Step, int, int);
template __global__ void k_tma<0, 3, false, 32>(Step, int, int);
template __global__ void k_tma<1, 2, true, 8>(Step, int, int);
template __global__ void k_tma<1, 2, true, 16>(Step, int, int);
template __global__ void k_tma<1, 2, true, 32>(Step, int, int);
template __global__ void k_tma<1, 2, false, 8>(Step, int, int);
template __global__ void k_tma<1, 2, false, 16>(Step, int, int);
template __global__ void k_tma<1, 2, false, 32>(Step, int, int);
template __global__ void k_tma<1, 3, true, 8>(Step, int, int);
template __global__ void k_tma<1, 3, true, 16>(Step, int, int);
template __global__ void k_tma<1, 3, true, 32>(Step, int, int);
template __global__ void k_tma<1, 3, false, 8>(Step, int, int);
template __global__ void k_tma<1, 3, false, 16>(Step, int, int);
template __global__ void k_tma<1, 3, false, 32>(Step, int, int);
template __global__ void k_tma<2, 2, true, 8>(Step, int, int);
template __global__ void k_tma<2, 2, true, 16>(Step, int, int);
template __global__ void k_tma<2, 2, true, 32>(Step, int, int);
template __global__ void k_tma<2, 2, false, 8>(Step, int, int);
template __global__ void k_tma<2, 2, false, 16>(Step, int, int);
template __global__ void k_tma<2, 2, false, 32>(Step, int, int);
template __global__ void k_tma<2, 3, true, 8>(Step, int, int);
template __global__ void k_tma<2, 3, true, 16>(Step, int, int);
template __global__ void k_tma<2, 3, true, 32>(Step, int, int);
template __global__ void k_tma<2, 3, false, 8>(Step, int, int);
template __global__ void k_tma<2, 3, false, 16>(Step, int, int);
template __global__ void k_tma<2, 3, false, 32>(Step, int, int);
template __global__ void k_tma<3, 2, true, 8>(Step, int, int);
template __global__ void k_tma<3, 2, true, 16>(Step, int, int);
template __global__ void k_tma<3, 2, true, 32>(Step, int, int);
template __global__ void k_tma<3, 2, false, 8>(Step, int, int);
template __global__ void k_tma<3, 2, false, 16>(Step, int, int);
template __global__ void k_tma<3, 2, false, 32>(Step, int, int);
template __global__ void k_tma<3, 3, true, 8>(Step, int, int);
template __global__ void k_tma<3, 3, true, 16>(Step, int, int);
template __global__ void k_tma<3, 3, true, 32>(Step, int, int);
template __global__ void k_tma<3, 3, false, 8>(Step, int, int);
template __global__ void k_tma<3, 3, false, 16>(Step, int, int);
template __global__ void k_tma<3, 3, false, 32>(Step, int, int);
template __global__ void k_rows<2>(const unsigned char*, int, int, float*);
template __global__ void k_rows<4>(const unsigned char*, int, int, float*);
template __global__ void k_sep<0, 11>(Step, int);
template __global__ void k_sep<2, 12>(Step, int);
template __global__ void k_sep<3, 13>(Step, int);
template __global__ void k_persist<1, false>(Step);
template __global__ void k_persist<1, true>(Step);
template __global__ void k_stc<0, 0, 2>(Step, int);
template __global__ void k_stc<0, 0, 4>(Step, int);
template __global__ void k_stc<0, 1, 2>(Step, int);
template __global__ void k_stc<0, 1, 4>(Step, int);
template __global__ void k_stc<1, 0, 2>(Step, int);
template __global__ void k_stc<1, 0, 4>(Step, int);
template __global__ void k_stc<1, 1, 2>(Step, int);
template __global__ void k_stc<1, 1, 4>(Step, int);
template __global__ void k_stc<2, 0, 2>(Step, int);
template __global__ void k_stc<2, 0, 4>(Step, int);
template __global__ void k_stc<2, 1, 2>(Step, int);
template __global__ void k_stc<2, 1, 4>(Step, int);
template __global__ void k_stc<3, 0, 2>(Step, int);
template __global__ void k_stc<3, 0, 4>(Step, int);
template __global__ void k_stc<3, 1, 2>(Step, int);
template __global__ void k_stc<3, 1, 4>(Step, int);
template __global__ void k_tc2<0, 0, 4, 4>(Step, int);
template __global__ void k_tc2<0, 0, 8, 2>(Step, int);
template __global__ void k_tc2<0, 0, 4, 3>(Step, int);
template __global__ void k_tc2<0, 0, 2, 6>(Step, int);
template __global__ void k_tc2<0, 1, 4, 4>(Step, int);
template __global__ void k_tc2<0, 1, 8, 2>(Step, int);
template __global__ void k_tc2<0, 1, 4, 3>(Step, int);
template __global__ void k_tc2<0, 1, 2, 6>(Step, int);
template __global__ void k_tc2<1, 0, 4, 4>(Step, int);
template __global__ void k_tc2<1, 0, 8, 2>(Step, int);
template __global__ void k_tc2<1, 0, 4, 3>(Step, int);
template __global__ void k_tc2<1, 0, 2, 6>(Step, int);
template __global__ void k_tc2<1, 1, 4, 4>(Step, int);
template __global__ void k_tc2<1, 1, 8, 2>(Step, int);
template __global__ void k_tc2<1, 1, 4, 3>(Step, int);
template __global__ void k_tc2<1, 1, 2, 6>(Step, int);
template __global__ void k_tc2<2, 0, 4, 4>(Step, int);
template __global__ void k_tc2<2, 0, 8, 2>(Step, int);
template __global__ void k_tc2<2, 0, 4, 3>(Step, int);
template __global__ void k_tc2<2, 0, 2, 6>(Step, int);
template __global__ void k_tc2<2, 1, 4, 4>(Step, int);
template __global__ void k_tc2<2, 1, 8, 2>(Step, int);
template __global__ void k_tc2<2, 1, 4, 3>(Step, int);
template __global__ void k_tc2<2, 1, 2, 6>(Step, int);
template __global__ void k_tc2<3, 0, 4, 4>(Step, int);
template __global__ void k_tc2<3, 0, 8, 2>(Step, int);
template __global__ void k_tc2<3, 0, 4, 3>(Step, int);
template __global__ void k_tc2<3, 0, 2, 6>(Step, int);
template __global__ void k_tc2<3, 1, 4, 4>(Step, int);
template __global__ void k_tc2<3, 1, 8, 2>(Step, int);
template __global__ void k_tc2<3, 1, 4, 3>(Step, int);
template __global__ void k_tc2<3, 1, 2, 6>(Step, int);
template __global__ void k_tc<0, 0>(Step, int);
template __global__ void k_tc<0, 1>(Step, int);
template __global__ void k_tc<0, 2>(Step, int);
template __global__ void k_tc<1, 0>(Step, int);
template __global__ void k_tc<1, 1>(Step, int);
template __global__ void k_tc<1, 2>(Step, int);
template __global__ void k_tc<2, 0>(Step, int);
template __global__ void k_tc<2, 1>(Step, int);
template __global__ void k_tc<2, 2>(Step, int);
template __global__ void k_tc<3, 0>(Step, int);
template __global__ void k_tc<3, 1>(Step, int);
template __global__ void k_tc<3, 2>(Step, int);
#endif
