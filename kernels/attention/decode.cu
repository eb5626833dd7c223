// The decode CTAs: the transposed CTA for head_dim <= 128 (decode_cta_t) and decode_cta, which
// picks it or the row-major attention_cta (head_dim 256).
// Depends on common.cuh, quant.cuh, pipeline.cuh and prefill.cu (attention_cta).
//
// A decode item has at most 8 query rows (one token's GQA group), so they are the mma's N side
// and keys and head dims its M side: S^T = K Q^T, then O^T = V^T P^T, with P^T turned into B
// fragments by movmatrix. Against the row-major form, whose 16-row M side is mostly padding, this
// halves the mma, the softmax work and the accumulators. The four warps split each key tile; K/V
// fragments come from the same ldmatrix addressing.

// Physical output column of logical row r (0..15) of O^T m-tile md (the V dequantizers permute
// head dims as q_col does).
__device__ __forceinline__ int ot_col(int md, int r) {
  if constexpr (KV16) return md * 16 + r;
  else if constexpr (KV_DTYPE == DT_NVFP4) return (md >> 1) * 32 + 4 * (r & 7) + 2 * (md & 1) + (r >> 3);
  else return md * 16 + 2 * (r & 7) + (r >> 3);
}

template <int TK, int NST>
__device__ __forceinline__ void decode_cta_t(
    const WorkItem& it, const int kvh, const int kv_heads, char* smem, const __nv_bfloat16* __restrict__ q,
    __nv_bfloat16* __restrict__ o, const u8* __restrict__ k_cache, const u8* __restrict__ v_cache,
    const u8* __restrict__ k_bscale, const u8* __restrict__ v_bscale, const Csr& csr,
    float* __restrict__ partial_o, float* __restrict__ partial_lse, const float sm_scale, const float k_scale,
    const float v_scale, const int window) {
  constexpr int WK = 4;                // warps along keys
  constexpr int NKW = TK / WK;         // keys per warp per tile (TK = TILE_KEYS)
  constexpr int KT = NKW / 16;         // 16-key m-tiles of S^T per warp per tile
  constexpr int KS = D / 16;           // k-steps of K Q^T
  constexpr int MD = D / 16;           // 16-dim m-tiles of O^T
  static_assert(TK == TILE_KEYS && NST >= 2 && DECODE_ROWS == 8 && NKW % 16 == 0 && KS % 2 == 0, "transposed decode shape");
  static_assert(TK == 0 || WK * 8 * DUMP_LD * 4 + 2 * WK * 8 * 4 <= SMEM_BYTES, "decode dump fits");
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g8 = lane >> 2, c4 = lane & 3;
  const ItemView v = item_view<DECODE_ROWS>(it, csr, window);

  // Q^T as B fragments: this thread's row is g8, its k pairs those of q_col.
  u32 qb[KS][2];
  {
    const bool valid = g8 < v.nrows;
    const int rr = it.row_base + (valid ? g8 : 0);
    const int tok = rr / GROUP, g = rr % GROUP;
    const u32* src =
        reinterpret_cast<const u32*>(q + (static_cast<size_t>(v.qo0 + tok) * kv_heads * GROUP + kvh * GROUP + g) * D);
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      const int col = q_col(ks, c4);
      qb[ks][0] = valid ? q_pair(src[col / 2]) : 0u;
      qb[ks][1] = valid ? q_pair(src[(col + Q_A2_OFF) / 2]) : 0u;
    }
  }

  // O^T accumulators: acc[md] = (dims g8, g8 + 8 of m-tile md) x (rows 2 c4, 2 c4 + 1).
  float acc[MD][4];
#pragma unroll
  for (int md = 0; md < MD; ++md) acc[md][0] = acc[md][1] = acc[md][2] = acc[md][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};  // rows 2 c4, 2 c4 + 1
  const float scale_log2 = sm_scale * k_scale * 1.4426950408889634f;
  const int n_tiles = tile_count(v);

  // The tile ring of pipeline.cuh with an issue step of its own: `pages` always holds the page ids
  // of the next tile to load, fetched a tile ahead of load_tile. As an `issue` callback of
  // tile_ring_start / tile_ring_next this step compiles to other code (NVVM optimises a lambda
  // apart from its caller), so only the wait is shared here.
  TilePages pages;
  fetch_pages(pages, v.kb, v.ke, v.pg0, csr);
#pragma unroll
  for (int t = 0; t < NST - 1; ++t) {
    if (t < n_tiles) {
      load_tile(smem + t * STAGE_BYTES, pages, kvh, kv_heads, k_cache, v_cache, k_bscale, v_bscale);
      fetch_pages(pages, v.kb + (t + 1) * TK, v.ke, v.pg0, csr);
    }
    cp_async_commit();
  }

  for (int t = 0; t < n_tiles; ++t) {
    if (t + NST - 1 < n_tiles) {
      load_tile(smem + ((t + NST - 1) % NST) * STAGE_BYTES, pages, kvh, kv_heads, k_cache, v_cache, k_bscale,
                v_bscale);
      if (t + NST < n_tiles) fetch_pages(pages, v.kb + (t + NST) * TK, v.ke, v.pg0, csr);
    }
    tile_ring_wait<NST>();
    const char* kt_s = smem + (t % NST) * STAGE_BYTES;
    const char* vt_s = kt_s + (KV16 ? TILE16_BYTES : RAW_BYTES);
    const int key0 = warp * NKW;  // this warp's first key in the tile
    // The row each lane addresses for ldmatrix: matrices 0/2 keys 0-7, 1/3 keys 8-15 of a 16-key tile.
    const int lrow = (lane & 7) + ((lane >> 3) & 1) * 8;

    // S^T = K Q^T: two accumulator chains (even and odd k-steps) halve the dependent-mma latency.
    float s[KT][4];
#pragma unroll
    for (int kt = 0; kt < KT; ++kt) {
      float sa[4] = {0.f, 0.f, 0.f, 0.f}, sb[4] = {0.f, 0.f, 0.f, 0.f};
      const int key = key0 + kt * 16 + lrow;
      if constexpr (KV16) {
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
          u32 r[4];
          ldmatrix_x4(smem_addr(kt_s + (key * LDS + ks * 16 + (lane >> 4) * 8) * 2), r[0], r[1], r[2], r[3]);
          const u32 a[4] = {r[0], r[1], r[2], r[3]};
          mma16816((ks & 1) ? sb : sa, a, qb[ks][0], qb[ks][1]);
        }
      } else if constexpr (KV_DTYPE == DT_NVFP4) {
        // A 16-byte chunk is 32 dims (k-steps 2j, 2j + 1); this thread holds dims 8 c4 .. 8 c4 + 7
        // of keys g8 and g8 + 8, each with its own e4m3 block scale.
        const u8* sk = reinterpret_cast<const u8*>(kt_s + TILE_KEYS * RAW_LD) +
                       (key0 + kt * 16 + g8) * SCALE_BYTES + (c4 >> 1);
#pragma unroll
        for (int i = 0; i < D / 32; i += 2) {
          u32 r[4];
          ldmatrix_x4(smem_addr(kt_s + key * RAW_LD + (i + (lane >> 4)) * 16), r[0], r[1], r[2], r[3]);
#pragma unroll
          for (int jj = 0; jj < 2; ++jj) {
            const int j = i + jj;
            const __half2 s0 = scale_pair(sk[2 * j], sk[2 * j]);
            const __half2 s1 = scale_pair(sk[8 * SCALE_BYTES + 2 * j], sk[8 * SCALE_BYTES + 2 * j]);
            u32 w0[4], w1[4];
            e2m1x8_to_f16(r[2 * jj], w0);
            e2m1x8_to_f16(r[2 * jj + 1], w1);
            const u32 a0[4] = {hmul2_u32(w0[0], s0), hmul2_u32(w1[0], s1), hmul2_u32(w0[1], s0), hmul2_u32(w1[1], s1)};
            mma16816(sa, a0, qb[2 * j][0], qb[2 * j][1]);
            const u32 a1[4] = {hmul2_u32(w0[2], s0), hmul2_u32(w1[2], s1), hmul2_u32(w0[3], s0), hmul2_u32(w1[3], s1)};
            mma16816(sb, a1, qb[2 * j + 1][0], qb[2 * j + 1][1]);
          }
        }
      } else {
        // fp8: a 16-byte chunk is one k-step; dims 4 c4 .. 4 c4 + 3 of keys g8 and g8 + 8.
#pragma unroll
        for (int i = 0; i < KS; i += 2) {
          u32 r[4];
          ldmatrix_x4(smem_addr(kt_s + key * RAW_LD + (i + (lane >> 4)) * 16), r[0], r[1], r[2], r[3]);
#pragma unroll
          for (int jj = 0; jj < 2; ++jj) {
            u32 lo0, hi0, lo1, hi1;
            fp8x4_to_f16(r[2 * jj], lo0, hi0);
            fp8x4_to_f16(r[2 * jj + 1], lo1, hi1);
            const u32 a[4] = {lo0, lo1, hi0, hi1};
            mma16816(jj ? sb : sa, a, qb[i + jj][0], qb[i + jj][1]);
          }
        }
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) s[kt][e] = sa[e] + sb[e];
    }

    // Mask only where this warp's keys run past the item's end or cross a causal/window edge;
    // rows past nrows have Q = 0 and are never written, so they need no mask.
    const int wj0 = v.kb + t * TILE_KEYS + key0;  // first key of this warp's slice
    bool need_mask = wj0 + NKW > v.ke;
    if constexpr (CAUSAL) need_mask = need_mask || v.first_pos + wj0 + NKW - 1 > v.qpos_lo;
    if constexpr (SLIDING) need_mask = need_mask || v.qpos_hi - (v.first_pos + wj0) >= window;
    if (need_mask) {
#pragma unroll
      for (int kt = 0; kt < KT; ++kt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = wj0 + kt * 16 + g8 + 8 * (e >> 1);
          const int qpos = v.q_pos0 + (it.row_base + 2 * c4 + (e & 1)) / GROUP;
          const int kpos = v.first_pos + j;
          bool ok = j < v.ke;
          if constexpr (CAUSAL) ok = ok && kpos <= qpos;
          if constexpr (SLIDING) ok = ok && qpos - kpos < window;
          if (!ok) s[kt][e] = -INFINITY;
        }
      }
    }

    // Online softmax per row (the column of S^T): the max runs over this thread's keys, then
    // over the eight lanes that share c4. softmax_rows transposed; inline because a shared
    // template changes this kernel's register allocation.
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = -INFINITY;
#pragma unroll
      for (int kt = 0; kt < KT; ++kt) mx = fmaxf(mx, fmaxf(s[kt][h], s[kt][h + 2]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
      const float m_new = fmaxf(m_run[h], mx * scale_log2);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      alpha[h] = fast_exp2(m_run[h] - m_use);
      m_run[h] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int kt = 0; kt < KT; ++kt) {
        s[kt][h] = fast_exp2(fmaf(s[kt][h], scale_log2, -m_use));
        s[kt][h + 2] = fast_exp2(fmaf(s[kt][h + 2], scale_log2, -m_use));
        sum += s[kt][h] + s[kt][h + 2];
      }
      l_run[h] = l_run[h] * alpha[h] + sum;
    }
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int md = 0; md < MD; ++md) {
        acc[md][0] *= alpha[0];
        acc[md][1] *= alpha[1];
        acc[md][2] *= alpha[0];
        acc[md][3] *= alpha[1];
      }
    }

    // O^T += V^T P^T.
#pragma unroll
    for (int kt = 0; kt < KT; ++kt) {
      // P^T's C fragment (keys g8 / g8 + 8 x rows 2 c4, 2 c4 + 1) transposed into the B fragment
      // (keys 2 c4, 2 c4 + 1 / + 8 x row g8).
      const u32 b0 = movmatrix_trans(pack2(s[kt][0], s[kt][1]));
      const u32 b1 = movmatrix_trans(pack2(s[kt][2], s[kt][3]));
      const int key = key0 + kt * 16 + lrow;
      if constexpr (KV16) {
#pragma unroll
        for (int md = 0; md < MD; ++md) {
          u32 r[4];
          ldmatrix_x4_trans(smem_addr(vt_s + (key * LDS + md * 16 + (lane >> 4) * 8) * 2), r[0], r[1], r[2], r[3]);
          const u32 a[4] = {r[0], r[2], r[1], r[3]};
          mma16816(acc[md], a, b0, b1);
        }
      } else if constexpr (KV_DTYPE == DT_NVFP4) {
        // Keys (2 c4, 2 c4 + 1) x values 4 g8 .. 4 g8 + 3 of a 32-value chunk: value pairs
        // (4 g8 + 2p, + 1) make the two halves of m-tile 2 chunk + p.
        const u8* vsc = reinterpret_cast<const u8*>(vt_s + TILE_KEYS * RAW_LD);
        const int kb2 = key0 + kt * 16 + 2 * c4;
#pragma unroll
        for (int j = 0; j < D / 32; j += 2) {
          u32 r[4];
          ldmatrix_x4_trans(smem_addr(vt_s + key * RAW_LD + (j + (lane >> 4)) * 16), r[0], r[1], r[2], r[3]);
#pragma unroll
          for (int jj = 0; jj < 2; ++jj) {
            u32 lo[4], hi[4];
            nvfp4_v_chunk(r[2 * jj], r[2 * jj + 1], vsc, kb2, j + jj, g8, lo, hi);
#pragma unroll
            for (int p = 0; p < 2; ++p) {
              const u32 a[4] = {lo[2 * p], lo[2 * p + 1], hi[2 * p], hi[2 * p + 1]};
              mma16816(acc[(j + jj) * 2 + p], a, b0, b1);
            }
          }
        }
      } else {
        // Keys (2 c4, 2 c4 + 1) x values (2 g8, 2 g8 + 1) of a 16-value chunk: even values are
        // rows 0-7 of the chunk's m-tile, odd values rows 8-15.
#pragma unroll
        for (int j = 0; j < D / 16; j += 2) {
          u32 r[4];
          ldmatrix_x4_trans(smem_addr(vt_s + key * RAW_LD + (j + (lane >> 4)) * 16), r[0], r[1], r[2], r[3]);
#pragma unroll
          for (int jj = 0; jj < 2; ++jj) {
            u32 a[4];
            fp8_v_chunk(r[2 * jj], r[2 * jj + 1], a);
            mma16816(acc[j + jj], a, b0, b1);
          }
        }
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();
  __syncthreads();

  // Each warp dumps (m, l, O) for the 8 rows; then the CTA combines the four key slices.
  float* dump_o = reinterpret_cast<float*>(smem);
  float* dump_m = dump_o + WK * 8 * DUMP_LD;
  float* dump_l = dump_m + WK * 8;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = l_run[h];
    l += __shfl_xor_sync(0xffffffffu, l, 4);
    l += __shfl_xor_sync(0xffffffffu, l, 8);
    l += __shfl_xor_sync(0xffffffffu, l, 16);
    if (g8 == 0) {
      dump_m[warp * 8 + 2 * c4 + h] = m_run[h];
      dump_l[warp * 8 + 2 * c4 + h] = l;
    }
  }
#pragma unroll
  for (int md = 0; md < MD; ++md) {
#pragma unroll
    for (int e = 0; e < 4; ++e)
      dump_o[(warp * 8 + 2 * c4 + (e & 1)) * DUMP_LD + ot_col(md, g8 + 8 * (e >> 1))] = acc[md][e];
  }
  __syncthreads();

  for (int c = threadIdx.x; c < v.nrows * (D / 8); c += NTHREADS) {
    const int row = c / (D / 8), col = (c % (D / 8)) * 8;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < WK; ++w) mx = fmaxf(mx, dump_m[w * 8 + row]);
    const float m_use = mx == -INFINITY ? 0.f : mx;
    float l = 0.f;
    float out[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int w = 0; w < WK; ++w) {
      const float f = exp2f(dump_m[w * 8 + row] - m_use);
      l += dump_l[w * 8 + row] * f;
#pragma unroll
      for (int e = 0; e < 8; ++e) out[e] += dump_o[(w * 8 + row) * DUMP_LD + col + e] * f;
    }
    store_row(it, v, kvh, kv_heads, row, col, out, l, mx, v_scale, o, partial_o, partial_lse);
  }
}

// The decode CTA of this specialisation: transposed for head_dim <= 128, row-major above.
template <int TK, int NST>
__device__ __forceinline__ void decode_cta(
    const WorkItem& it, const int kvh, const int kv_heads, char* smem, const __nv_bfloat16* __restrict__ q,
    __nv_bfloat16* __restrict__ o, const u8* __restrict__ k_cache, const u8* __restrict__ v_cache,
    const u8* __restrict__ k_bscale, const u8* __restrict__ v_bscale, const Csr& csr,
    float* __restrict__ partial_o, float* __restrict__ partial_lse, const float sm_scale, const float k_scale,
    const float v_scale, const int window) {
  if constexpr (D <= 128) {
    decode_cta_t<TK, NST>(it, kvh, kv_heads, smem, q, o, k_cache, v_cache, k_bscale, v_bscale, csr, partial_o, partial_lse,
                 sm_scale, k_scale, v_scale, window);
  } else {
    attention_cta<4 / DECODE_WARPS_KV, DECODE_WARPS_KV, 1>(it, kvh, kv_heads, smem, q, o, k_cache, v_cache,
                                                        k_bscale, v_bscale, csr, partial_o, partial_lse, sm_scale,
                                                        k_scale, v_scale, window);
  }
}
