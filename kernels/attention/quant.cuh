// Dequantization of fp8 (e4m3, e5m2) and nvfp4 (e2m1 values, e4m3 block scales) K/V fragments to
// f16 pairs, exact: every e4m3, e5m2 and e2m1 * e4m3 value is an f16. Also the head-dimension
// permutation the quantized paths imply (q_col, o_col).
// Depends on common.cuh (types, constants).

__device__ __forceinline__ u32 e4m3x2_to_f16x2(unsigned short v) {
  __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v), __NV_E4M3);
  return static_cast<u32>(h.x) | (static_cast<u32>(h.y) << 16);
}

// Four e4m3 in a word into two f16x2 words.
__device__ __forceinline__ void e4m3x4_to_f16(u32 w, u32& lo, u32& hi) {
  lo = e4m3x2_to_f16x2(static_cast<unsigned short>(w & 0xffff));
  hi = e4m3x2_to_f16x2(static_cast<unsigned short>(w >> 16));
}

// e5m2 is the upper byte of an f16.
__device__ __forceinline__ void e5m2x4_to_f16(u32 w, u32& lo, u32& hi) {
  lo = __byte_perm(w, 0u, 0x1404);
  hi = __byte_perm(w, 0u, 0x3424);
}

// Eight e2m1 nibbles (one word, low nibble first) into four f16x2 words. Every e2m1 value is an
// f16 whose low byte is zero, so a byte permute through an 8-entry table of high bytes does the
// magnitudes of four nibbles at once and a second permute ORs in their signs.
__device__ __forceinline__ void e2m1x8_to_f16(u32 w, u32* out) {
  constexpr u32 LUT_LO = 0x3E3C3800u;  // 0, 0.5, 1, 1.5
  constexpr u32 LUT_HI = 0x46444240u;  // 2, 3, 4, 6
  const u32 mag = w & 0x77777777u;
  const u32 sgn = (w >> 3) & 0x11111111u;
  const u32 hb_lo = __byte_perm(LUT_LO, LUT_HI, mag) | __byte_perm(0x8000u, 0u, sgn);
  const u32 hb_hi = __byte_perm(LUT_LO, LUT_HI, mag >> 16) | __byte_perm(0x8000u, 0u, sgn >> 16);
  out[0] = __byte_perm(hb_lo, 0u, 0x1404);
  out[1] = __byte_perm(hb_lo, 0u, 0x3424);
  out[2] = __byte_perm(hb_hi, 0u, 0x1404);
  out[3] = __byte_perm(hb_hi, 0u, 0x3424);
}

// Byte pairs (0, 2) and (1, 3) of a word as two f16x2 words (fp8 V fragments after ldmatrix.trans).
__device__ __forceinline__ void fp8_pairs_to_f16(u32 w, u32& even, u32& odd) {
  if constexpr (KV_DTYPE == DT_E4M3) {
    even = e4m3x2_to_f16x2(static_cast<unsigned short>(__byte_perm(w, 0u, 0x0020)));
    odd = e4m3x2_to_f16x2(static_cast<unsigned short>(__byte_perm(w, 0u, 0x0031)));
  } else {
    even = __byte_perm(w, 0u, 0x2404);
    odd = __byte_perm(w, 0u, 0x3414);
  }
}

// Four fp8 in a word (bytes 0..3) into two f16x2 words: (0, 1) and (2, 3).
__device__ __forceinline__ void fp8x4_to_f16(u32 w, u32& lo, u32& hi) {
  if constexpr (KV_DTYPE == DT_E4M3) {
    e4m3x4_to_f16(w, lo, hi);
  } else {
    e5m2x4_to_f16(w, lo, hi);
  }
}

// prmt.b32 in its default mode, where a selector nibble with bit 3 set replicates the sign bit of
// the byte it picks (so it picks 0x00 from any byte below 0x80).
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

// Nibbles a0..a3 (low half: one key) and b0..b3 (high half: the next key) of a word into four
// f16x2 words (a_e, b_e): the V fragments of four n-tiles after ldmatrix.trans. The magnitudes'
// high bytes come from the 8-entry table; the pairing permute fills the low bytes with zeros by
// sign replication of a magnitude byte (all below 0x80); the signs are shifted into bits 15 and 31.
__device__ __forceinline__ void e2m1x8_pairs_to_f16(u32 w, u32* out) {
  constexpr u32 LUT_LO = 0x3E3C3800u;  // 0, 0.5, 1, 1.5
  constexpr u32 LUT_HI = 0x46444240u;  // 2, 3, 4, 6
  const u32 mag = w & 0x77777777u;
  const u32 ha = __byte_perm(LUT_LO, LUT_HI, mag);
  const u32 hb = __byte_perm(LUT_LO, LUT_HI, mag >> 16);
  const u32 s = w & 0x88888888u;
  out[0] = prmt(ha, hb, 0x4808u) | ((s << 12) & 0x80008000u);
  out[1] = prmt(ha, hb, 0x5818u) | ((s << 8) & 0x80008000u);
  out[2] = prmt(ha, hb, 0x6828u) | ((s << 4) & 0x80008000u);
  out[3] = prmt(ha, hb, 0x7838u) | (s & 0x80008000u);
}

// Two e4m3 block scales as one f16x2 (exact).
__device__ __forceinline__ __half2 scale_pair(u8 lo, u8 hi) {
  __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(
      static_cast<__nv_fp8x2_storage_t>(static_cast<unsigned short>(lo) | (static_cast<unsigned short>(hi) << 8)),
      __NV_E4M3);
  return *reinterpret_cast<__half2*>(&r);
}

__device__ __forceinline__ u32 hmul2_u32(u32 a, __half2 s) {
  __half2 v = __hmul2(*reinterpret_cast<__half2*>(&a), s);
  return *reinterpret_cast<u32*>(&v);
}

// V fragments of one 16-key chunk after ldmatrix.trans, shared by the row-major and the transposed
// CTAs. `r_lo` holds keys (2c, 2c + 1) and `r_hi` keys (2c + 8, 2c + 9), c = lane % 4.
// fp8, a 16-value chunk: f = {even value of r_lo, odd of r_lo, even of r_hi, odd of r_hi}, values
// (2n, 2n + 1), n = lane / 4.
__device__ __forceinline__ void fp8_v_chunk(u32 r_lo, u32 r_hi, u32 (&f)[4]) {
  fp8_pairs_to_f16(r_lo, f[0], f[1]);
  fp8_pairs_to_f16(r_hi, f[2], f[3]);
}

// nvfp4, a 32-value chunk: lo[e] / hi[e] = value 4n + e of r_lo's / r_hi's keys, times their e4m3
// block scales (block 2 chunk + n / 4 of each key's row in `vsc`; the first key is kb2).
__device__ __forceinline__ void nvfp4_v_chunk(u32 r_lo, u32 r_hi, const u8* vsc, int kb2, int chunk, int n,
                                              u32 (&lo)[4], u32 (&hi)[4]) {
  const int blk = 2 * chunk + (n >> 2);
  const __half2 slo = scale_pair(vsc[kb2 * SCALE_BYTES + blk], vsc[(kb2 + 1) * SCALE_BYTES + blk]);
  const __half2 shi = scale_pair(vsc[(kb2 + 8) * SCALE_BYTES + blk], vsc[(kb2 + 9) * SCALE_BYTES + blk]);
  e2m1x8_pairs_to_f16(r_lo, lo);
  e2m1x8_pairs_to_f16(r_hi, hi);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    lo[e] = hmul2_u32(lo[e], slo);
    hi[e] = hmul2_u32(hi[e], shi);
  }
}

// Quantized caches are dequantized in registers, straight from the raw tile, with the head
// dimension permuted so each thread's ldmatrix fragment is its mma operand (a dot product and
// the output are invariant under a permutation applied to Q, K and V alike; the output columns are
// put back in place when they are written).
// Q K^T: the first element of A fragment pair (k-step ks, column pair c) lives at physical column
// q_col(ks, c); its partner (logical k + 8) at q_col + Q_A2_OFF.
__device__ __forceinline__ int q_col(int ks, int c) {
  if constexpr (KV16) return ks * 16 + c * 2;
  else if constexpr (KV_DTYPE == DT_NVFP4) return (ks >> 1) * 32 + c * 8 + (ks & 1) * 4;
  else return ks * 16 + c * 4;
}
constexpr int Q_A2_OFF = KV16 ? 8 : 2;
// P V: the physical output column of logical n-tile dt, column n.
__device__ __forceinline__ int o_col(int dt, int n) {
  if constexpr (KV16) return dt * 8 + n;
  else if constexpr (KV_DTYPE == DT_NVFP4) return (dt >> 2) * 32 + n * 4 + (dt & 3);
  else return (dt >> 1) * 16 + n * 2 + (dt & 1);
}
