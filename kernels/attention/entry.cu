// The attention entry points: kvf_attention (one launch for a mixed step), kvf_decode (steps
// without prefill items, which can merge split-KV partials itself) and kvf_merge (split-KV
// partials into O), with their shared-memory checks and the merge body kvf_decode and kvf_merge
// share. The launch contract of each is in its comment; crates/kvfleet-cuda/src/device.rs
// mirrors the signatures.
// Depends on common.cuh, pipeline.cuh, prefill.cu, prefill_wgmma.cu and decode.cu.

template <int BYTES>
__device__ __forceinline__ void check_smem() {
  u32 dyn;
  asm volatile("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(dyn));
  if (dyn < static_cast<u32>(BYTES)) __trap();
}

// The decode-only kernel's footprint: its own pipeline depth, the dump of four warps x 8 rows.
constexpr int DECODE_SMEM_BYTES =
    D <= 128 ? (DECODE_STAGES * STAGE_BYTES > 4 * 8 * DUMP_LD * 4 + 2 * 4 * 8 * 4 ? DECODE_STAGES * STAGE_BYTES
                                                                                   : 4 * 8 * DUMP_LD * 4 + 2 * 4 * 8 * 4)
             : SMEM_BYTES;
static_assert(DECODE_SMEM_BYTES == DECODE_SMEM_BYTES_HOST, "host and device disagree on decode shared memory");

// One launch for a whole step: blocks [0, n_prefill) run prefill items (64 * PREFILL_MT rows, 4
// warps along rows; 64 rows on wgmma where WGMMA_PREFILL), the rest run decode items (DECODE_ROWS
// rows, warps split the key tile).
// grid = (n_prefill + n_decode, kv_heads), block = 128, dynamic smem = SMEM_BYTES.
extern "C" __global__ void __launch_bounds__(NTHREADS) kvf_attention(
    const WorkItem* __restrict__ items, const int n_prefill, const __nv_bfloat16* __restrict__ q,
    __nv_bfloat16* __restrict__ o, const u8* __restrict__ k_cache, const u8* __restrict__ v_cache,
    const u8* __restrict__ k_bscale, const u8* __restrict__ v_bscale, const int* __restrict__ qo_indptr,
    const int* __restrict__ kv_indptr, const int* __restrict__ kv_indices,
    const int* __restrict__ kv_last_page_len, const int* __restrict__ kv_first_pos,
    float* __restrict__ partial_o, float* __restrict__ partial_lse, const float sm_scale, const float k_scale,
    const float v_scale, const int window) {
  kvf_wait_prior_grid();
  extern __shared__ __align__(1024) char smem[];
  check_smem<SMEM_BYTES>();
  const WorkItem it = items[blockIdx.x];
  const Csr csr{qo_indptr, kv_indptr, kv_indices, kv_last_page_len, kv_first_pos};
  if (static_cast<int>(blockIdx.x) < n_prefill) {
    if constexpr (WGMMA_PREFILL) {
      prefill_cta_wgmma<TILE_KEYS>(it, blockIdx.y, gridDim.y, smem, q, o, k_cache, v_cache, k_bscale, v_bscale, csr,
                                   sm_scale, k_scale, v_scale, window);
    } else {
      attention_cta<4, 1, PREFILL_MT>(it, blockIdx.y, gridDim.y, smem, q, o, k_cache, v_cache, k_bscale, v_bscale,
                                      csr, partial_o, partial_lse, sm_scale, k_scale, v_scale, window);
    }
  } else {
    decode_cta<TILE_KEYS, STAGES>(it, blockIdx.y, gridDim.y, smem, q, o, k_cache, v_cache, k_bscale, v_bscale, csr, partial_o,
               partial_lse, sm_scale, k_scale, v_scale, window);
  }
}

// Combines the split-KV partials of one merge job for KV head kvh into O, log-sum-exp weighted,
// 8 columns of a row per thread. kvf_merge runs it as a launch of its own and kvf_decode in the
// last CTA of the job to finish, so both paths do the same arithmetic and write the same bits.
// The partials are read through L2 (ld.global.cg): in kvf_decode other CTAs of the same launch
// wrote them, on other SMs, and L1 is not coherent, so a line cached there could be stale.
__device__ __forceinline__ void merge_job(const MergeJob& job, const int kvh, const int kv_heads,
                                          const int* __restrict__ qo_indptr, const float* partial_o,
                                          const float* partial_lse, __nv_bfloat16* __restrict__ o) {
  const int q_heads = kv_heads * GROUP;
  const int qo0 = qo_indptr[job.request];
  const int nrows = (qo_indptr[job.request + 1] - qo0) * GROUP;
  for (int c = threadIdx.x; c < nrows * (D / 8); c += NTHREADS) {
    const int row = c / (D / 8), col = (c % (D / 8)) * 8;
    float mx = -INFINITY;
    // NVVM does not unroll a loop around __ldcg's inline asm by itself; four ways is what it
    // did with plain loads, and it keeps the order of the sums.
#pragma unroll 4
    for (int s = 0; s < job.slot_count; ++s)
      mx = fmaxf(mx, __ldcg(partial_lse + (static_cast<size_t>(job.slot_begin + s) * kv_heads + kvh) * DECODE_ROWS + row));
    const float m_use = mx == -INFINITY ? 0.f : mx;
    float out[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    float wsum = 0.f;
#pragma unroll 4
    for (int s = 0; s < job.slot_count; ++s) {
      const size_t base = (static_cast<size_t>(job.slot_begin + s) * kv_heads + kvh) * DECODE_ROWS + row;
      const float w = exp2f(__ldcg(partial_lse + base) - m_use);
      wsum += w;
      const float4* po = reinterpret_cast<const float4*>(partial_o + base * D + col);
      const float4 x0 = __ldcg(po), x1 = __ldcg(po + 1);
      out[0] += w * x0.x; out[1] += w * x0.y; out[2] += w * x0.z; out[3] += w * x0.w;
      out[4] += w * x1.x; out[5] += w * x1.y; out[6] += w * x1.z; out[7] += w * x1.w;
    }
    const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
    const int tok = row / GROUP, g = row % GROUP;
    __nv_bfloat162 packed[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) packed[e] = __floats2bfloat162_rn(out[2 * e] * inv, out[2 * e + 1] * inv);
    *reinterpret_cast<uint4*>(o + (static_cast<size_t>(qo0 + tok) * q_heads + kvh * GROUP + g) * D + col) =
        *reinterpret_cast<uint4*>(packed);
  }
}

// Steps without prefill items: every block runs a decode item. Built apart from kvf_attention so
// its register allocation is not the prefill path's, which lets more CTAs share an SM.
//
// With merge_counters (null: kvf_merge runs after it) a split item's CTA also counts itself done
// with its job, and the last CTA of a (job, KV head) to store its partial merges the job: the
// merge launch, a launch latency a layer, leaves decode steps. merge_counters[job * kv_heads +
// kvh] counts the CTAs that have stored; the last one puts it back to 0, so the counters are
// zero between launches without a memset. A launch that traps half-way leaves some non-zero,
// but a trap also leaves the context unusable, so they are never read again.
// grid = (n_decode, kv_heads), block = 128, dynamic smem = DECODE_SMEM_BYTES.
extern "C" __global__ void __launch_bounds__(NTHREADS, DECODE_MIN_CTAS) kvf_decode(
    const WorkItem* __restrict__ items, const int n_prefill, const __nv_bfloat16* __restrict__ q,
    __nv_bfloat16* __restrict__ o, const u8* __restrict__ k_cache, const u8* __restrict__ v_cache,
    const u8* __restrict__ k_bscale, const u8* __restrict__ v_bscale, const int* __restrict__ qo_indptr,
    const int* __restrict__ kv_indptr, const int* __restrict__ kv_indices,
    const int* __restrict__ kv_last_page_len, const int* __restrict__ kv_first_pos,
    float* __restrict__ partial_o, float* __restrict__ partial_lse, const float sm_scale, const float k_scale,
    const float v_scale, const int window, const MergeJob* __restrict__ jobs, int* __restrict__ merge_counters) {
  kvf_wait_prior_grid();
  extern __shared__ __align__(1024) char smem[];
  check_smem<DECODE_SMEM_BYTES>();
  const WorkItem it = items[blockIdx.x];
  const Csr csr{qo_indptr, kv_indptr, kv_indices, kv_last_page_len, kv_first_pos};
  decode_cta<TILE_KEYS, DECODE_STAGES>(it, blockIdx.y, gridDim.y, smem, q, o, k_cache, v_cache, k_bscale, v_bscale, csr, partial_o,
             partial_lse, sm_scale, k_scale, v_scale, window);
  if (merge_counters == nullptr || it.slot < 0) return;  // the same for the whole CTA
  // The barrier puts every thread's partial stores before thread 0's fence and count (the
  // release); a last count's fence puts the other CTAs' stores before this CTA's merge reads
  // (the acquire), and __syncthreads_or hands thread 0's verdict to the CTA.
  __syncthreads();
  int last = 0;
  if (threadIdx.x == 0) {
    int* counter = merge_counters + static_cast<size_t>(it.merge) * gridDim.y + blockIdx.y;
    __threadfence();
    last = atomicAdd(counter, 1) == jobs[it.merge].slot_count - 1;
    if (last) {
      atomicExch(counter, 0);  // every CTA of the job has counted: none reads it again this launch
      __threadfence();
    }
  }
  if (__syncthreads_or(last)) {
    const MergeJob job = jobs[it.merge];
    merge_job(job, blockIdx.y, gridDim.y, qo_indptr, partial_o, partial_lse, o);
  }
}

// Combines split-KV partials (log-sum-exp weighted) for steps whose kvf_attention / kvf_decode
// launch did not merge them. grid = (n_jobs, kv_heads), block = 128.
extern "C" __global__ void __launch_bounds__(NTHREADS) kvf_merge(
    const MergeJob* __restrict__ jobs, const int* __restrict__ qo_indptr, const float* __restrict__ partial_o,
    const float* __restrict__ partial_lse, __nv_bfloat16* __restrict__ o) {
  kvf_wait_prior_grid();
  const MergeJob job = jobs[blockIdx.x];
  merge_job(job, blockIdx.y, gridDim.y, qo_indptr, partial_o, partial_lse, o);
}
