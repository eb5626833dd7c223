// The tile pipeline every attention CTA shares: what a CTA reads of its work item (ItemView), page
// fetch and cp.async loading of K/V tiles, the stage ring every key loop runs (tile_ring_*),
// Q fragments, the output store (O or a split-KV partial), masking, the online softmax over mma /
// wgmma C fragments and their repacking into P operands.
// Depends on common.cuh (types, PTX helpers) and quant.cuh (q_col).

struct ItemView {
  int qo0;        // first query token of the request in Q/O
  int pg0;        // first page index of the request in kv_indices
  int first_pos;  // absolute position of the request's first held key
  int q_pos0;     // absolute position of query token 0
  int nrows;      // rows of this item (at most ROWS)
  int qpos_lo;    // position of the item's first query token
  int qpos_hi;    // position of the item's last query token
  int kb, ke;     // keys [kb, ke) of the request this item visits (mask-trimmed)
};

template <int ROWS>
__device__ __forceinline__ ItemView item_view(const WorkItem& it, const Csr& csr, const int window) {
  ItemView v;
  const int r = it.request;
  v.qo0 = csr.qo_indptr[r];
  const int q_len = csr.qo_indptr[r + 1] - v.qo0;
  v.pg0 = csr.kv_indptr[r];
  const int npages = csr.kv_indptr[r + 1] - v.pg0;
  const int n_keys = npages > 0 ? (npages - 1) * PAGE_SIZE + csr.kv_last_page_len[r] : 0;
  v.first_pos = csr.kv_first_pos[r];
  v.q_pos0 = v.first_pos + n_keys - q_len;
  v.nrows = min(ROWS, q_len * GROUP - it.row_base);
  // A (sub-)tile that every row sees whole skips the per-element mask.
  v.qpos_lo = v.q_pos0 + it.row_base / GROUP;
  v.qpos_hi = v.q_pos0 + (it.row_base + v.nrows - 1) / GROUP;
  v.kb = it.key_begin;
  v.ke = min(it.key_end, n_keys);
  if constexpr (CAUSAL) v.ke = min(v.ke, v.qpos_hi - v.first_pos + 1);
  // The window's first key, rounded down to a page (the mask drops the extra keys) so every
  // tile starts on a page boundary; key_begin is one already (whole tiles per split).
  if constexpr (SLIDING) v.kb = max(v.kb, (v.qpos_lo - window + 1 - v.first_pos) / PAGE_SIZE * PAGE_SIZE);
  return v;
}

// A tile is loaded in 16-byte chunks, TILE_CHUNKS per thread; which key and part a thread's chunk i
// is depends on the thread and i only, so every offset but the page folds to a constant.
constexpr int CPK = ROW_BYTES / 16;  // 16-byte chunks per key row
constexpr int TILE_CHUNKS = TILE_KEYS * CPK / NTHREADS;
static_assert(NTHREADS % CPK == 0 && TILE_KEYS * CPK % NTHREADS == 0 && TILE_KEYS % PAGE_SIZE == 0, "tile loader");

// The page ids of this thread's chunks of the tile whose first key is `kstart` (a multiple of
// PAGE_SIZE: item_view aligns kb), -1 at or past `ke`. Decode fetches them a tile ahead of
// load_tile, which keeps the dependent global load off the start of each iteration.
struct TilePages {
  int id[TILE_CHUNKS];
};

// The key of chunk i of this thread: consecutive parts of one key by default; with CORE (the
// wgmma tile layout) eight consecutive keys of one part, so each warp's 16-byte writes fill whole
// 128-byte core matrices.
template <bool CORE>
__device__ __forceinline__ int chunk_key(const int i) {
  const u32 tid = threadIdx.x;  // unsigned: the divisions are shifts
  if constexpr (CORE) return static_cast<int>((tid / (8 * CPK) + i * (NTHREADS / (8 * CPK))) * 8 + tid % 8);
  else return static_cast<int>(tid / CPK + i * (NTHREADS / CPK));
}
template <bool CORE>
__device__ __forceinline__ int chunk_part(const int i) {
  if constexpr (CORE) return static_cast<int>(threadIdx.x / 8 % CPK);
  else return static_cast<int>(threadIdx.x % CPK);
}

template <bool CORE = false>
__device__ __forceinline__ void fetch_pages(TilePages& p, const int kstart, const int ke, const int pg0,
                                            const Csr& csr) {
#pragma unroll
  for (int i = 0; i < TILE_CHUNKS; ++i) {
    const int j = kstart + chunk_key<CORE>(i);
    p.id[i] = j < ke ? __ldg(csr.kv_indices + pg0 + j / PAGE_SIZE) : -1;
  }
}

// One pipeline stage: K and V (and nvfp4 block scales) of the tile `p` names into `st` with
// cp.async; chunks of keys past the end are zero-filled. 16-bit tiles are stored with padded rows
// for ldmatrix, or with CORE in wgmma's 128-byte-swizzled layout, [dim / 64][key / 8][key % 8][64 dims]
// (K-major for K, N-major for V: one layout serves both). CORE stages must start 1 KiB-aligned.
template <bool CORE = false>
__device__ __forceinline__ void load_tile(char* st, const TilePages& p, const int kvh, const int kv_heads,
                                          const u8* __restrict__ k_cache, const u8* __restrict__ v_cache,
                                          const u8* __restrict__ k_bscale, const u8* __restrict__ v_bscale) {
  static_assert(!CORE || (KV16 && NTHREADS % (8 * CPK) == 0), "core-matrix tiles: 16-bit, head_dim <= 128");
  const u32 page_bytes = static_cast<u32>(kv_heads) * PAGE_SIZE * ROW_BYTES;
#pragma unroll
  for (int i = 0; i < TILE_CHUNKS; ++i) {
    const int key = chunk_key<CORE>(i), part = chunk_part<CORE>(i);
    const bool valid = p.id[i] >= 0;
    const u32 page = valid ? static_cast<u32>(p.id[i]) : 0u;
    const int slot = kvh * PAGE_SIZE + key % PAGE_SIZE;  // row of this head and key in the page
    const size_t off = static_cast<size_t>(page) * page_bytes + slot * ROW_BYTES + part * 16;
    if constexpr (CORE) {
      // 1 KiB atoms of 8 keys x 64 dims (128-byte rows), 16-byte chunks XOR-swizzled by key % 8;
      // atoms of one 64-dim half are consecutive, the halves TILE_KEYS / 8 atoms apart.
      const int dst = (part / 8) * (TILE_KEYS / 8 * 1024) + (key / 8) * 1024 + (key % 8) * 128 +
                      ((part % 8) ^ (key % 8)) * 16;
      cp_async16(smem_addr(st + dst), k_cache + off, valid);
      cp_async16(smem_addr(st + TILE16_BYTES + dst), v_cache + off, valid);
    } else if constexpr (KV16) {
      cp_async16(smem_addr(st + key * LDS * 2 + part * 16), k_cache + off, valid);
      cp_async16(smem_addr(st + TILE16_BYTES + key * LDS * 2 + part * 16), v_cache + off, valid);
    } else {
      cp_async16(smem_addr(st + key * RAW_LD + part * 16), k_cache + off, valid);
      cp_async16(smem_addr(st + RAW_BYTES + key * RAW_LD + part * 16), v_cache + off, valid);
      if constexpr (SCALE_BYTES > 0) {
        if (part == 0) {
          const size_t soff = static_cast<size_t>(page) * (static_cast<u32>(kv_heads) * PAGE_SIZE * SCALE_BYTES) +
                              slot * SCALE_BYTES;
          char* sk = st + TILE_KEYS * RAW_LD + key * SCALE_BYTES;
          char* sv = st + RAW_BYTES + TILE_KEYS * RAW_LD + key * SCALE_BYTES;
          if constexpr (SCALE_BYTES == 16) {
            cp_async16(smem_addr(sk), k_bscale + soff, valid);
            cp_async16(smem_addr(sv), v_bscale + soff, valid);
          } else {
            cp_async_small<SCALE_BYTES>(smem_addr(sk), k_bscale + soff, valid);
            cp_async_small<SCALE_BYTES>(smem_addr(sv), v_bscale + soff, valid);
          }
        }
      }
    }
  }
}

// Key tiles of the item: [kb, ke) in TILE_KEYS steps, the last one partial.
__device__ __forceinline__ int tile_count(const ItemView& v) {
  return v.ke > v.kb ? (v.ke - v.kb + TILE_KEYS - 1) / TILE_KEYS : 0;
}

// The cp.async ring every key loop runs: NST stages, NST - 1 tiles in flight ahead of the one
// consumed, one commit group per tile (an empty one stands in for each tile past the end, so the
// wait count is a constant). `issue(t)` starts the copies of tile t into stage t % NST.
//
//   tile_ring_start<NST>(n_tiles, issue);
//   for (int t = 0; t < n_tiles; ++t) {
//     tile_ring_next<NST>(t, n_tiles, issue);  // issues tile t + NST - 1; tile t is visible to all
//     ... read stage t % NST ...
//     __syncthreads();                         // before its stage is refilled
//   }
//   cp_async_wait<0>();
//
// The loop body, and the stage addresses, stay in the CTA: NVVM optimises a helper apart from its
// caller before inlining it, and a callback or an address helper here changes the code it emits.
template <int NST, typename Issue>
__device__ __forceinline__ void tile_ring_start(const int n_tiles, Issue&& issue) {
  static_assert(NST >= 2 && NST * STAGE_BYTES <= SMEM_BYTES, "tile ring");
#pragma unroll
  for (int t = 0; t < NST - 1; ++t) {
    if (t < n_tiles) issue(t);
    cp_async_commit();
  }
}

// Closes the group of the tile just issued (an empty one past the end), waits for the oldest tile
// in flight (NST - 1 groups stay pending) and makes it visible to every thread; with ASYNC_PROXY
// also to the async proxy, through which wgmma reads shared memory.
template <int NST, bool ASYNC_PROXY = false>
__device__ __forceinline__ void tile_ring_wait() {
  cp_async_commit();
  cp_async_wait<NST - 1>();
  if constexpr (ASYNC_PROXY) fence_proxy_async();
  __syncthreads();
}

// The ring's step before tile t is read: issue tile t + NST - 1, then wait for tile t.
template <int NST, bool ASYNC_PROXY = false, typename Issue>
__device__ __forceinline__ void tile_ring_next(const int t, const int n_tiles, Issue&& issue) {
  if (t + NST - 1 < n_tiles) issue(t + NST - 1);
  tile_ring_wait<NST, ASYNC_PROXY>();
}

// The A fragments of Q for 16 rows from item row `row16` (zero past `nrows`): thread rows
// lane / 4 and + 8, k pairs as q_col permutes them.
__device__ __forceinline__ void load_q_frags(u32 (&qf)[D / 16][4], const int row16, const int row0, const int nrows,
                                             const int qo0, const int kvh, const int kv_heads,
                                             const __nv_bfloat16* __restrict__ q) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int my_row = row16 + (lane >> 2) + 8 * h;
    const int rr = row0 + my_row;
    const bool valid = my_row < nrows;
    const int tok = rr / GROUP, g = rr % GROUP;
    const u32* src = reinterpret_cast<const u32*>(
        q + (static_cast<size_t>(qo0 + (valid ? tok : 0)) * kv_heads * GROUP + kvh * GROUP + g) * D);
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      const int col = q_col(ks, lane & 3);
      qf[ks][h] = valid ? q_pair(src[col / 2]) : 0u;
      qf[ks][h + 2] = valid ? q_pair(src[(col + Q_A2_OFF) / 2]) : 0u;
    }
  }
}

// Writes 8 output columns from `col` of item row `row`: to O (bf16) when the item covers all its
// keys, else to its split-KV partial slot with the row's log2-sum-exp. `out` is unnormalised, `l`
// its softmax sum and `mx` the log2-domain max.
__device__ __forceinline__ void store_row(const WorkItem& it, const ItemView& v, const int kvh, const int kv_heads,
                                          const int row, const int col, const float* out, const float l,
                                          const float mx, const float v_scale, __nv_bfloat16* __restrict__ o,
                                          float* __restrict__ partial_o, float* __restrict__ partial_lse) {
  const float inv = l > 0.f ? v_scale / l : 0.f;
  const int rr = it.row_base + row;
  if (it.slot < 0) {
    const int tok = rr / GROUP, g = rr % GROUP;
    __nv_bfloat162 packed[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) packed[e] = __floats2bfloat162_rn(out[2 * e] * inv, out[2 * e + 1] * inv);
    *reinterpret_cast<uint4*>(o + (static_cast<size_t>(v.qo0 + tok) * kv_heads * GROUP + kvh * GROUP + g) * D + col) =
        *reinterpret_cast<uint4*>(packed);
  } else {
    const size_t base = (static_cast<size_t>(it.slot) * kv_heads + kvh) * DECODE_ROWS + row;
    float4* po = reinterpret_cast<float4*>(partial_o + base * D + col);
    po[0] = make_float4(out[0] * inv, out[1] * inv, out[2] * inv, out[3] * inv);
    po[1] = make_float4(out[4] * inv, out[5] * inv, out[6] * inv, out[7] * inv);
    if (col == 0) partial_lse[base] = l > 0.f ? mx + log2f(l) : -INFINITY;
  }
}

// Masks the scores of an mma / wgmma C fragment (NT 8-key blocks from key `key_base`, rows from
// item row `row16`: this thread's lane / 4 and + 8) that their row may not see: rows past the
// item, keys past its end, the causal future, keys out of the window.
template <int NT>
__device__ __forceinline__ void mask_rows(float (&s)[NT][4], const ItemView& v, const int row_base, const int row16,
                                          const int key_base, const int window) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int my_row = row16 + (lane >> 2) + 8 * (i >> 1);
      const int qpos = v.q_pos0 + (row_base + my_row) / GROUP;
      const int j = key_base + nt * 8 + (lane & 3) * 2 + (i & 1);
      const int kpos = v.first_pos + j;
      bool ok = my_row < v.nrows && j < v.ke;
      if constexpr (CAUSAL) ok = ok && kpos <= qpos;
      if constexpr (SLIDING) ok = ok && qpos - kpos < window;
      if (!ok) s[nt][i] = -INFINITY;
    }
  }
}

// Online softmax over the rows of an mma / wgmma C fragment (NT 8-key blocks; this thread's rows
// lane / 4 and + 8 are h = 0 and 1), in log2 units: raw scores stay raw until one FFMA folds scale
// and max into the exponent. Turns s into P, updates the running max and sum, and rescales the
// row's accumulators `acc` (skipped once the max settles: no row of the warp moved).
template <int NT, int NACC>
__device__ __forceinline__ void softmax_rows(float (&s)[NT][4], float (&m_run)[2], float (&l_run)[2],
                                             const float scale_log2, float (&acc)[NACC][4]) {
  float alpha[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m_run[h], mx * scale_log2);
    const float m_use = m_new == -INFINITY ? 0.f : m_new;
    alpha[h] = fast_exp2(m_run[h] - m_use);
    m_run[h] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      s[nt][2 * h] = fast_exp2(fmaf(s[nt][2 * h], scale_log2, -m_use));
      s[nt][2 * h + 1] = fast_exp2(fmaf(s[nt][2 * h + 1], scale_log2, -m_use));
      sum += s[nt][2 * h] + s[nt][2 * h + 1];
    }
    l_run[h] = l_run[h] * alpha[h] + sum;
  }
  if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
    for (int i = 0; i < NACC; ++i) {
      acc[i][0] *= alpha[0];
      acc[i][1] *= alpha[0];
      acc[i][2] *= alpha[1];
      acc[i][3] *= alpha[1];
    }
  }
}

// The A fragment of P for keys 16 kk .. 16 kk + 15 from the C fragments of S (two m16n8 C
// fragments side by side are an m16k16 A fragment).
template <int NT>
__device__ __forceinline__ void p_frag(const float (&s)[NT][4], const int kk, u32 (&a)[4]) {
  a[0] = pack2(s[2 * kk][0], s[2 * kk][1]);
  a[1] = pack2(s[2 * kk][2], s[2 * kk][3]);
  a[2] = pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
  a[3] = pack2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}
