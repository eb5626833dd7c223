// The sm_90a prefill CTA (prefill_cta_wgmma; 16-bit caches, head_dim <= 128): 64 query rows, warp
// w owning rows 16w .. 16w + 15 of wgmma's m64 slab; 64-key tiles in core-matrix layout. S = Q K^T
// and O += P V run on wgmma with Q and P as register A operands and K, V read from shared memory;
// the online softmax works on the accumulator fragments in between, which per warp have mma.sync's
// m16n8 layout. Prefill items are never split (plan_step), so this CTA always writes O.
// Depends on common.cuh (wgmma wrappers) and pipeline.cuh (load_tile<true>, masking, softmax).
// Compiled to an empty body on every target but compute_90a.

template <int TK>
__device__ __forceinline__ void prefill_cta_wgmma(
    const WorkItem& it, const int kvh, const int kv_heads, char* smem, const __nv_bfloat16* __restrict__ q,
    __nv_bfloat16* __restrict__ o, const u8* __restrict__ k_cache, const u8* __restrict__ v_cache,
    const u8* __restrict__ k_bscale, const u8* __restrict__ v_bscale, const Csr& csr, const float sm_scale,
    const float k_scale, const float v_scale, const int window) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int ROWS = 64;
  constexpr int KS = D / 16;  // k-steps of Q K^T
  constexpr int DT = D / 8;   // 8-column blocks of O
  constexpr int NT = TK / 8;  // 8-key blocks of S
  static_assert(TK == TILE_KEYS && TK == 64 && KV16, "wgmma prefill shape");
  static_assert(STAGE_BYTES % 1024 == 0 && TILE16_BYTES % 1024 == 0, "swizzle atoms 1 KiB-aligned");
  if (smem_addr(smem) % 1024 != 0) __trap();  // the swizzle pattern is anchored at 1 KiB
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g8 = lane >> 2, c4 = lane & 3;
  const ItemView v = item_view<ROWS>(it, csr, window);

  u32 qf[KS][4];
  load_q_frags(qf, warp * 16, it.row_base, v.nrows, v.qo0, kvh, kv_heads, q);
  float acc[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};  // rows g8, g8 + 8
  const float scale_log2 = sm_scale * k_scale * 1.4426950408889634f;

  auto issue = [&](const int t) {
    TilePages pages;
    fetch_pages<true>(pages, v.kb + t * TK, v.ke, v.pg0, csr);
    load_tile<true>(smem + (t % STAGES) * STAGE_BYTES, pages, kvh, kv_heads, k_cache, v_cache, k_bscale, v_bscale);
  };

  const int n_tiles = tile_count(v);
  tile_ring_start<STAGES>(n_tiles, issue);
  for (int t = 0; t < n_tiles; ++t) {
    tile_ring_next<STAGES, true>(t, n_tiles, issue);
    const u32 k_base = smem_addr(smem + (t % STAGES) * STAGE_BYTES);
    const u32 v_base = k_base + TILE16_BYTES;
    const int kstart = v.kb + t * TK;

    // S = Q K^T: K is K-major; a k-step is 32 bytes into the swizzled 128-byte rows of its 64-dim
    // half, 8-key atoms SBO = 1 KiB apart.
    float s[NT][4];
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
      wgmma_s64(s, qf[ks], wgmma_desc(k_base + (ks / 4) * (TK / 8 * 1024) + (ks % 4) * 32, 16, 1024), ks > 0);
    wgmma_commit();
    wgmma_wait_all();
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      fence_reg(s[nt][0]);
      fence_reg(s[nt][1]);
      fence_reg(s[nt][2]);
      fence_reg(s[nt][3]);
    }

    const int jhi = kstart + TK - 1;
    bool need_mask = v.nrows < ROWS || jhi >= v.ke;
    if constexpr (CAUSAL) need_mask = need_mask || v.first_pos + jhi > v.qpos_lo;
    if constexpr (SLIDING) need_mask = need_mask || v.qpos_hi - (v.first_pos + kstart) >= window;
    if (need_mask) mask_rows(s, v, it.row_base, warp * 16, kstart, window);
    softmax_rows(s, m_run, l_run, scale_log2, acc);

    // O += P V: V is N-major; a k-step is two 8-key atoms (2 KiB), 8-key atoms SBO = 1 KiB apart,
    // the 64-dim halves LBO = TK / 8 atoms apart.
    u32 pa[TK / 16][4];
#pragma unroll
    for (int kk = 0; kk < TK / 16; ++kk) p_frag(s, kk, pa[kk]);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < TK / 16; ++kk) wgmma_o<DT>(acc, pa[kk], wgmma_desc(v_base + kk * 2048, TK / 8 * 1024, 1024));
    wgmma_commit();
    wgmma_wait_all();
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      fence_reg(acc[dt][0]);
      fence_reg(acc[dt][1]);
      fence_reg(acc[dt][2]);
      fence_reg(acc[dt][3]);
    }
    __syncthreads();
  }
  cp_async_wait<0>();

  // Each warp holds whole rows: normalise and store straight from the fragments.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = l_run[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int row = warp * 16 + g8 + 8 * h;
    if (row < v.nrows) {
      const float inv = l > 0.f ? v_scale / l : 0.f;
      const int rr = it.row_base + row;
      const int tok = rr / GROUP, g = rr % GROUP;
      __nv_bfloat16* dst = o + (static_cast<size_t>(v.qo0 + tok) * kv_heads * GROUP + kvh * GROUP + g) * D;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt)
        *reinterpret_cast<__nv_bfloat162*>(dst + dt * 8 + 2 * c4) =
            __floats2bfloat162_rn(acc[dt][2 * h] * inv, acc[dt][2 * h + 1] * inv);
    }
  }
#endif
}
