// The row-major attention CTA on mma.sync (attention_cta): prefill items on every target but
// sm_90a's wgmma path, and decode items at head_dim 256.
// Depends on common.cuh, quant.cuh (dequantization, o_col) and pipeline.cuh.
//
// WQ warps along query rows, WK warps along keys (split-KV inside the CTA), MT m-tiles (16 rows
// each) per warp. With MT = 2 every K/V fragment read from shared memory feeds two mma
// (prefill); the key tile is then consumed in sub-tiles of SUBK keys so S, the Q fragments and
// the accumulators fit the register file.

template <int WQ, int WK, int MT>
__device__ __forceinline__ void attention_cta(
    const WorkItem& it, const int kvh, const int kv_heads, char* smem, const __nv_bfloat16* __restrict__ q,
    __nv_bfloat16* __restrict__ o, const u8* __restrict__ k_cache, const u8* __restrict__ v_cache,
    const u8* __restrict__ k_bscale, const u8* __restrict__ v_bscale, const Csr& csr,
    float* __restrict__ partial_o, float* __restrict__ partial_lse, const float sm_scale, const float k_scale,
    const float v_scale, const int window) {
  constexpr int ROWS = WQ * 16 * MT;
  constexpr int NKW = TILE_KEYS / WK;             // keys per warp per tile
  constexpr int SUBK = MT > 1 ? 32 : NKW;         // keys per inner pass
  constexpr int NSUB = NKW / SUBK;
  constexpr int NT = SUBK / 8;                    // S n-tiles per pass
  constexpr int KS = D / 16;                      // k-steps of Q K^T
  constexpr int DT = D / 8;                       // O n-tiles
  static_assert(NKW % SUBK == 0 && SUBK % 16 == 0, "sub-tile shape");
  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int wq = warp / WK, wk = warp % WK;

  const ItemView v = item_view<ROWS>(it, csr, window);
  const int qo0 = v.qo0, first_pos = v.first_pos, nrows = v.nrows;
  const int qpos_lo = v.qpos_lo, qpos_hi = v.qpos_hi, kb = v.kb, ke = v.ke;
  const int row0 = it.row_base;

  // Q fragments straight from global memory into registers (A operand, row-major).
  u32 qf[MT][KS][4];
#pragma unroll
  for (int m = 0; m < MT; ++m) load_q_frags(qf[m], (wq * MT + m) * 16, row0, nrows, qo0, kvh, kv_heads, q);

  float acc[MT][DT][4];
  float m_run[MT][2], l_run[MT][2];
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int i = 0; i < DT; ++i) acc[m][i][0] = acc[m][i][1] = acc[m][i][2] = acc[m][i][3] = 0.f;
    m_run[m][0] = m_run[m][1] = -INFINITY;
    l_run[m][0] = l_run[m][1] = 0.f;
  }
  const float scale_log2 = sm_scale * k_scale * 1.4426950408889634f;

  auto issue = [&](const int t) {
    TilePages pages;
    fetch_pages(pages, kb + t * TILE_KEYS, ke, v.pg0, csr);
    load_tile(smem + (t % STAGES) * STAGE_BYTES, pages, kvh, kv_heads, k_cache, v_cache, k_bscale, v_bscale);
  };

  const int n_tiles = tile_count(v);
  tile_ring_start<STAGES>(n_tiles, issue);
  for (int t = 0; t < n_tiles; ++t) {
    tile_ring_next<STAGES>(t, n_tiles, issue);
    const char* st = smem + (t % STAGES) * STAGE_BYTES;
    const char* kt = st;
    const char* vt = st + (KV16 ? TILE16_BYTES : RAW_BYTES);
    const int kstart = kb + t * TILE_KEYS;

#pragma unroll 1
    for (int sub = 0; sub < NSUB; ++sub) {
      const int key0 = wk * NKW + sub * SUBK;

      // S = Q K^T for this warp's rows and SUBK keys.
      float s[MT][NT][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int m = 0; m < MT; ++m) s[m][nt][0] = s[m][nt][1] = s[m][nt][2] = s[m][nt][3] = 0.f;
        const int key = key0 + nt * 8 + (lane & 7);  // the row this lane addresses
        if constexpr (KV16) {
#pragma unroll
          for (int kk = 0; kk < KS / 2; ++kk) {
            u32 b0, b1, b2, b3;
            const int col = kk * 32 + (lane >> 3) * 8;
            ldmatrix_x4(smem_addr(kt + (key * LDS + col) * 2), b0, b1, b2, b3);
#pragma unroll
            for (int m = 0; m < MT; ++m) {
              mma16816(s[m][nt], qf[m][2 * kk], b0, b1);
              mma16816(s[m][nt], qf[m][2 * kk + 1], b2, b3);
            }
          }
        } else if constexpr (KV_DTYPE == DT_NVFP4) {
          // One 8x16-byte matrix = 8 keys x 32 values = two k-steps; this thread's key is lane / 4.
          const u8* ksc = reinterpret_cast<const u8*>(kt + TILE_KEYS * RAW_LD) +
                          (key0 + nt * 8 + (lane >> 2)) * SCALE_BYTES + ((lane & 3) >> 1);
#pragma unroll
          for (int kk = 0; kk < D / 128; ++kk) {
            u32 r[4];
            ldmatrix_x4(smem_addr(kt + key * RAW_LD + (kk * 4 + (lane >> 3)) * 16), r[0], r[1], r[2], r[3]);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int j = kk * 4 + i;
              const u8 sb = ksc[2 * j];
              const __half2 s2 = scale_pair(sb, sb);
              u32 w[4];
              e2m1x8_to_f16(r[i], w);
#pragma unroll
              for (int e = 0; e < 4; ++e) w[e] = hmul2_u32(w[e], s2);
#pragma unroll
              for (int m = 0; m < MT; ++m) {
                mma16816(s[m][nt], qf[m][2 * j], w[0], w[1]);
                mma16816(s[m][nt], qf[m][2 * j + 1], w[2], w[3]);
              }
            }
          }
          if constexpr (D % 128 != 0) {  // head_dim 64: two matrices
            u32 r0, r1;
            ldmatrix_x2(smem_addr(kt + key * RAW_LD + ((D / 128) * 4 + ((lane >> 3) & 1)) * 16), r0, r1);
            const u32 rr[2] = {r0, r1};
#pragma unroll
            for (int i = 0; i < 2; ++i) {
              const int j = (D / 128) * 4 + i;
              const u8 sb = ksc[2 * j];
              const __half2 s2 = scale_pair(sb, sb);
              u32 w[4];
              e2m1x8_to_f16(rr[i], w);
#pragma unroll
              for (int e = 0; e < 4; ++e) w[e] = hmul2_u32(w[e], s2);
#pragma unroll
              for (int m = 0; m < MT; ++m) {
                mma16816(s[m][nt], qf[m][2 * j], w[0], w[1]);
                mma16816(s[m][nt], qf[m][2 * j + 1], w[2], w[3]);
              }
            }
          }
        } else {
          // fp8: one 8x16-byte matrix = 8 keys x 16 values = one k-step.
#pragma unroll
          for (int kk = 0; kk < KS / 4; ++kk) {
            u32 r[4];
            ldmatrix_x4(smem_addr(kt + key * RAW_LD + (kk * 4 + (lane >> 3)) * 16), r[0], r[1], r[2], r[3]);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              u32 b0, b1;
              fp8x4_to_f16(r[i], b0, b1);
#pragma unroll
              for (int m = 0; m < MT; ++m) mma16816(s[m][nt], qf[m][kk * 4 + i], b0, b1);
            }
          }
        }
      }

      // Mask (only where some row may not see some key of the pass), then the online softmax in
      // log2 units: scores stay raw until one FFMA folds scale and max into the exponent.
      const int jlo = kstart + key0 - wk * NKW;  // first key of this pass over all warps
      const int jhi = kstart + (WK - 1) * NKW + key0 - wk * NKW + SUBK - 1;
      bool need_mask = nrows < ROWS || jhi >= ke;
      if constexpr (CAUSAL) need_mask = need_mask || first_pos + jhi > qpos_lo;
      if constexpr (SLIDING) need_mask = need_mask || qpos_hi - (first_pos + jlo) >= window;
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        if (need_mask) mask_rows(s[m], v, row0, (wq * MT + m) * 16, kstart + key0, window);
        softmax_rows(s[m], m_run[m], l_run[m], scale_log2, acc[m]);
      }

      // O += P V.
#pragma unroll
      for (int kk = 0; kk < SUBK / 16; ++kk) {
        u32 a[MT][4];
#pragma unroll
        for (int m = 0; m < MT; ++m) p_frag(s[m], kk, a[m]);
        const int key = key0 + kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;  // the row this lane addresses
        if constexpr (KV16) {
#pragma unroll
          for (int dt = 0; dt < DT; dt += 2) {
            u32 b0, b1, b2, b3;
            const int col = dt * 8 + (lane >> 4) * 8;
            ldmatrix_x4_trans(smem_addr(vt + (key * LDS + col) * 2), b0, b1, b2, b3);
#pragma unroll
            for (int m = 0; m < MT; ++m) {
              mma16816(acc[m][dt], a[m], b0, b1);
              mma16816(acc[m][dt + 1], a[m], b2, b3);
            }
          }
        } else if constexpr (KV_DTYPE == DT_NVFP4) {
          // Transposed 8x8 of 16-bit cells = 4 values each: this thread gets keys (2c, 2c+1) x
          // values 4n..4n+3 of a 32-value chunk (n = lane / 4), i.e. four n-tiles' B fragments.
          const u8* vsc = reinterpret_cast<const u8*>(vt + TILE_KEYS * RAW_LD);
          const int kb2 = key0 + kk * 16 + (lane & 3) * 2;
#pragma unroll
          for (int j = 0; j < D / 32; j += 2) {
            u32 r[4];
            ldmatrix_x4_trans(smem_addr(vt + key * RAW_LD + (j + (lane >> 4)) * 16), r[0], r[1], r[2], r[3]);
#pragma unroll
            for (int jj = 0; jj < 2; ++jj) {
              u32 lo[4], hi[4];
              nvfp4_v_chunk(r[2 * jj], r[2 * jj + 1], vsc, kb2, j + jj, lane >> 2, lo, hi);
#pragma unroll
              for (int e = 0; e < 4; ++e) {
#pragma unroll
                for (int m = 0; m < MT; ++m) mma16816(acc[m][(j + jj) * 4 + e], a[m], lo[e], hi[e]);
              }
            }
          }
        } else {
          // Transposed 8x8 of 16-bit cells = 2 values each: keys (2c, 2c+1) x values (2n, 2n+1)
          // of a 16-value chunk, i.e. the B fragments of two n-tiles (even and odd values).
#pragma unroll
          for (int j = 0; j < D / 16; j += 2) {
            u32 r[4];
            ldmatrix_x4_trans(smem_addr(vt + key * RAW_LD + (j + (lane >> 4)) * 16), r[0], r[1], r[2], r[3]);
#pragma unroll
            for (int jj = 0; jj < 2; ++jj) {
              u32 f[4];
              fp8_v_chunk(r[2 * jj], r[2 * jj + 1], f);
#pragma unroll
              for (int m = 0; m < MT; ++m) {
                mma16816(acc[m][(j + jj) * 2], a[m], f[0], f[2]);
                mma16816(acc[m][(j + jj) * 2 + 1], a[m], f[1], f[3]);
              }
            }
          }
        }
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();
  __syncthreads();

  // Each warp dumps its partial (m, l, O) per 16-row group; then the CTA combines the WK
  // key-splits. Group index of (warp, m-tile): ((wq * MT + m) * WK + wk).
  constexpr int GROUPS16 = WQ * MT * WK;
  float* dump_o = reinterpret_cast<float*>(smem);
  float* dump_m = dump_o + GROUPS16 * 16 * DUMP_LD;
  float* dump_l = dump_m + GROUPS16 * 16;
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    const int grp = (wq * MT + m) * WK + wk;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = l_run[m][h];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const int rr = (lane >> 2) + 8 * h;
      if ((lane & 3) == 0) {
        dump_m[grp * 16 + rr] = m_run[m][h];
        dump_l[grp * 16 + rr] = l;
      }
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        dump_o[(grp * 16 + rr) * DUMP_LD + o_col(dt, (lane & 3) * 2)] = acc[m][dt][2 * h];
        dump_o[(grp * 16 + rr) * DUMP_LD + o_col(dt, (lane & 3) * 2 + 1)] = acc[m][dt][2 * h + 1];
      }
    }
  }
  __syncthreads();

  for (int c = tid; c < ROWS * (D / 8); c += NTHREADS) {
    const int row = c / (D / 8);
    const int col = (c % (D / 8)) * 8;
    if (row >= nrows) continue;
    const int rq = row / 16, r16 = row % 16;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < WK; ++w) mx = fmaxf(mx, dump_m[(rq * WK + w) * 16 + r16]);
    const float m_use = mx == -INFINITY ? 0.f : mx;
    float l = 0.f;
    float out[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int w = 0; w < WK; ++w) {
      const int idx = (rq * WK + w) * 16 + r16;
      const float f = exp2f(dump_m[idx] - m_use);
      l += dump_l[idx] * f;
#pragma unroll
      for (int e = 0; e < 8; ++e) out[e] += dump_o[idx * DUMP_LD + col + e] * f;
    }
    store_row(it, v, kvh, kv_heads, row, col, out, l, mx, v_scale, o, partial_o, partial_lse);
  }
}
