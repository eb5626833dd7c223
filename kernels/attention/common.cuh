// kvfleet batched paged attention: decode (split-KV, whole GQA group per CTA), prefill and
// mixed batches on tensor cores (mma.sync m16n8k16, sm_80+; wgmma on sm_90a), a merge of split
// partials and a KV append that quantizes on write.
//
// The files of kernels/attention/ are one NVRTC program, never compiled alone: spec.rs
// (ATTENTION_SOURCE) concatenates them in dependency order, common.cuh, quant.cuh, pipeline.cuh,
// prefill.cu, prefill_wgmma.cu, decode.cu, entry.cu, append.cu, and prepends a generated prelude
// of constexprs (KV_DTYPE, HEAD_DIM, PAGE_SIZE, GROUP, CAUSAL, SLIDING, tile sizes), one program
// per specialisation. Each file may use what the files before it define.
//
// Layout contract (crates/kvfleet-engine/src/engine documents the same):
//   K and V pools per layer: [num_blocks, kv_heads, PAGE_SIZE, HEAD_DIM] (HND in a page).
//   fp8: one f32 scale per (layer, K or V), x = q * scale.
//   nvfp4: e2m1 packed two per byte (low nibble = even index) [.., HEAD_DIM / 2],
//          e4m3 block scales [.., HEAD_DIM / 16], one f32 global scale; x = e2m1 * bs * gs.
//   Batch in CSR: qo_indptr[B+1] into Q/O [total_q, q_heads, HEAD_DIM] (bf16),
//   kv_indptr[B+1] into kv_indices (page ids), kv_last_page_len[B], kv_first_pos[B].
//
// This file: the derived constants and shared-memory budget, the work-item and CSR types, and
// the PTX helpers (cp.async, ldmatrix, movmatrix, mma.sync, the sm_90a wgmma wrappers, fast exp2,
// operand packing). Depends on the prelude only.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

typedef unsigned char u8;
typedef unsigned int u32;

// Programmatic dependent launch (crates/kvfleet-cuda/src/launch.rs): on sm_90 and later the
// step's kernels are launched with PDL, so a block may start while the previous kernel in the
// stream still runs. Every such kernel calls this first: it returns once that kernel has
// completed and its writes are visible. Without PDL (or before sm_90) it returns at once.
__device__ __forceinline__ void kvf_wait_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

constexpr int DT_BF16 = 0;
constexpr int DT_F16 = 1;
constexpr int DT_E4M3 = 2;
constexpr int DT_E5M2 = 3;
constexpr int DT_NVFP4 = 4;

constexpr int NTHREADS = 128;

constexpr int D = HEAD_DIM;
constexpr bool KV16 = (KV_DTYPE == DT_BF16 || KV_DTYPE == DT_F16);
// Tensor-core operand type: bf16 only when the cache is bf16; fp8/nvfp4 dequantize exactly to f16.
constexpr bool MMA_BF16 = (KV_DTYPE == DT_BF16);
// Smem row stride of 16-bit K/V tiles, in elements: +8 keeps ldmatrix rows on distinct banks.
constexpr int LDS = D + 8;
// Bytes of one key's row in the cache, and of its nvfp4 block scales.
constexpr int ROW_BYTES = KV16 ? D * 2 : (KV_DTYPE == DT_NVFP4 ? D / 2 : D);
constexpr int SCALE_BYTES = (KV_DTYPE == DT_NVFP4) ? D / 16 : 0;
constexpr int TILE16_BYTES = TILE_KEYS * LDS * 2;
// Smem row stride of raw (quantized) key rows, in bytes: +16 keeps ldmatrix rows on distinct banks.
constexpr int RAW_LD = ROW_BYTES + 16;
constexpr int RAW_BYTES = TILE_KEYS * (RAW_LD + SCALE_BYTES);
constexpr int STAGE_BYTES = KV16 ? 2 * TILE16_BYTES : 2 * RAW_BYTES;
constexpr int PIPE_BYTES = STAGES * STAGE_BYTES;
// After the key loop each warp dumps (m, l, O) for its rows; this aliases the pipeline.
constexpr int DUMP_LD = D + 4;
constexpr int DUMP_GROUPS = 4 * PREFILL_MT;  // 16-row groups: 4 warps x PREFILL_MT (decode: 4)
constexpr int DUMP_BYTES = DUMP_GROUPS * 16 * DUMP_LD * 4 + 2 * DUMP_GROUPS * 16 * 4;
constexpr int SMEM_BYTES = PIPE_BYTES > DUMP_BYTES ? PIPE_BYTES : DUMP_BYTES;
static_assert(SMEM_BYTES == SMEM_BYTES_HOST, "host and device disagree on shared memory size");
static_assert(D % 32 == 0 && TILE_KEYS % 16 == 0, "tile shape");
static_assert(4 % DECODE_WARPS_KV == 0 && TILE_KEYS / DECODE_WARPS_KV >= 16, "decode warp split");

struct WorkItem {
  int request;    // index into the CSR arrays
  int row_base;   // first packed row (token * GROUP + head-in-group) of this CTA
  int key_begin;  // first held key (index into the request's pages) of this split
  int key_end;    // one past the last held key of this split
  int slot;       // partial slot (split-KV) or -1 when this CTA writes O directly
  int merge;      // the merge job (index into the step's jobs) that combines `slot`, or -1
  int pad1, pad2;
};

struct MergeJob {
  int request;
  int slot_begin;
  int slot_count;
  int pad;
};

struct Csr {
  const int* qo_indptr;
  const int* kv_indptr;
  const int* kv_indices;
  const int* kv_last_page_len;
  const int* kv_first_pos;
};

// ---------------------------------------------------------------------------------------------
// PTX helpers

__device__ __forceinline__ u32 smem_addr(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
  int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}

template <int N>
__device__ __forceinline__ void cp_async_small(u32 dst, const void* src, bool valid) {
  int n = valid ? N : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(src), "n"(N), "r"(n));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x2(u32 addr, u32& r0, u32& r1) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// Transposes an 8x8 matrix of 16-bit cells held one fragment row pair per thread (sm_75+).
__device__ __forceinline__ u32 movmatrix_trans(u32 x) {
  u32 y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// ---------------------------------------------------------------------------------------------
// sm_90a warpgroup MMA (wgmma): the 128 threads of a CTA are one warpgroup. Only compiled for
// compute_90a; every other target keeps mma.sync.

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr bool SM90A = true;
#else
constexpr bool SM90A = false;
#endif
// The prefill CTA of 16-bit caches up to head_dim 128 runs on wgmma where it can: 64 rows, one
// m64 slab per instruction (the host plans 64-row prefill items for it, KernelSpec::prefill_rows_on).
constexpr bool WGMMA_PREFILL = SM90A && KV16 && D <= 128;

// cp.async writes are generic-proxy; wgmma reads shared memory through the async proxy. Declared
// for every target so the shared tile ring (pipeline.cuh) can name it; only the wgmma CTA emits it.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// A shared-memory matrix descriptor, 128-byte swizzle (atoms 1 KiB-aligned, base offset 0).
__device__ __forceinline__ unsigned long long wgmma_desc(u32 addr, u32 lbo, u32 sbo) {
  return static_cast<unsigned long long>((addr & 0x3FFFF) >> 4) |
         (static_cast<unsigned long long>(lbo >> 4) << 16) | (static_cast<unsigned long long>(sbo >> 4) << 32) |
         (1ull << 62);
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Pins a register the async MMA wrote so no read of it moves above the wait.
__device__ __forceinline__ void fence_reg(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// D[64 x 64] (+)= A[64 x 16] (registers) B[16 x 64] (K-major in shared memory): S = Q K^T.
__device__ __forceinline__ void wgmma_s64(float (&d)[8][4], const u32 (&a)[4], unsigned long long b, int accumulate) {
  if constexpr (MMA_BF16) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %36, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,"
        "%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %37, p, 1, 1, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
          "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
          "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
          "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(accumulate), "l"(b));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %36, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,"
        "%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %37, p, 1, 1, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
          "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
          "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
          "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(accumulate), "l"(b));
  }
}

// D[64 x 8n] += A[64 x 16] (registers) B[16 x 8n] (N-major in shared memory), n = 8 or 16 (head_dim
// 64 or 128): O += P V.
#define KVF_ACC16(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
template <int NDT>
__device__ __forceinline__ void wgmma_o(float (&d)[NDT][4], const u32 (&a)[4], unsigned long long b) {
  static_assert(NDT == 8 || NDT == 16, "P V wgmma width");
  if constexpr (NDT == 16) {
    if constexpr (MMA_BF16) {
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
          "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,"
          "%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,"
          "%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
          : KVF_ACC16(0), KVF_ACC16(1), KVF_ACC16(2), KVF_ACC16(3), KVF_ACC16(4), KVF_ACC16(5), KVF_ACC16(6),
            KVF_ACC16(7), KVF_ACC16(8), KVF_ACC16(9), KVF_ACC16(10), KVF_ACC16(11), KVF_ACC16(12), KVF_ACC16(13),
            KVF_ACC16(14), KVF_ACC16(15)
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
    } else {
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
          "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,"
          "%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,"
          "%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
          : KVF_ACC16(0), KVF_ACC16(1), KVF_ACC16(2), KVF_ACC16(3), KVF_ACC16(4), KVF_ACC16(5), KVF_ACC16(6),
            KVF_ACC16(7), KVF_ACC16(8), KVF_ACC16(9), KVF_ACC16(10), KVF_ACC16(11), KVF_ACC16(12), KVF_ACC16(13),
            KVF_ACC16(14), KVF_ACC16(15)
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
    }
  } else {
    if constexpr (MMA_BF16) {
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
          "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,"
          "%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n"
          : KVF_ACC16(0), KVF_ACC16(1), KVF_ACC16(2), KVF_ACC16(3), KVF_ACC16(4), KVF_ACC16(5), KVF_ACC16(6),
            KVF_ACC16(7)
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
    } else {
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
          "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,"
          "%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n"
          : KVF_ACC16(0), KVF_ACC16(1), KVF_ACC16(2), KVF_ACC16(3), KVF_ACC16(4), KVF_ACC16(5), KVF_ACC16(6),
            KVF_ACC16(7)
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
    }
  }
}
#undef KVF_ACC16
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// 2^x, flushing subnormal results to zero (softmax weights that small are noise); 2^-inf = 0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1) {
  if constexpr (MMA_BF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two f32 into one operand register of the MMA type (low half = first).
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  if constexpr (MMA_BF16) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<u32*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<u32*>(&v);
  }
}

// A pair of bf16 from Q (global) as an operand register of the MMA type.
__device__ __forceinline__ u32 q_pair(u32 bits) {
  if constexpr (MMA_BF16) {
    return bits;
  } else {
    __nv_bfloat162 b = *reinterpret_cast<__nv_bfloat162*>(&bits);
    float2 f = __bfloat1622float2(b);
    return pack2(f.x, f.y);
  }
}
