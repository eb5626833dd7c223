// KV append (kvf_append): new K/V [n_tokens, kv_heads, D] bf16 -> cache slots (slot = page *
// PAGE_SIZE + offset), quantizing on write, and the e2m1 encoder it uses. One thread per 16
// consecutive values of one (token, head, K or V).
// grid = ceil(n_tokens * kv_heads * 2 * D / 16 / 128), block = 128.
// Depends on common.cuh only (types, constants).

__device__ __forceinline__ u8 e2m1_code(float x) {
  const float a = fabsf(x);
  u32 c;
  if (a <= 0.25f) c = 0;
  else if (a < 0.75f) c = 1;
  else if (a <= 1.25f) c = 2;
  else if (a < 1.75f) c = 3;
  else if (a <= 2.5f) c = 4;
  else if (a < 3.5f) c = 5;
  else if (a <= 5.0f) c = 6;
  else c = 7;
  return static_cast<u8>(c | (x < 0.f && c != 0 ? 8u : 0u));
}

extern "C" __global__ void __launch_bounds__(NTHREADS) kvf_append(
    const __nv_bfloat16* __restrict__ new_k, const __nv_bfloat16* __restrict__ new_v,
    const long long* __restrict__ slots, const int n_tokens, const int kv_heads, u8* __restrict__ k_cache,
    u8* __restrict__ v_cache, u8* __restrict__ k_bscale, u8* __restrict__ v_bscale, const float k_scale,
    const float v_scale) {
  kvf_wait_prior_grid();
  constexpr int GPR = D / 16;  // 16-value groups per row
  const long long gid = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const long long total = static_cast<long long>(n_tokens) * kv_heads * 2 * GPR;
  if (gid >= total) return;
  const int grp = static_cast<int>(gid % GPR);
  long long rest = gid / GPR;
  const int head = static_cast<int>(rest % kv_heads);
  rest /= kv_heads;
  const int is_v = static_cast<int>(rest % 2);
  const int tok = static_cast<int>(rest / 2);
  const long long slot = slots[tok];
  if (slot < 0) return;  // padding token
  const long long page = slot / PAGE_SIZE, off = slot % PAGE_SIZE;
  const size_t row = (static_cast<size_t>(page) * kv_heads + head) * PAGE_SIZE + off;
  const __nv_bfloat16* src = (is_v ? new_v : new_k) + (static_cast<size_t>(tok) * kv_heads + head) * D + grp * 16;
  u8* cache = is_v ? v_cache : k_cache;
  const float scale = is_v ? v_scale : k_scale;
  float x[16];
  {
    const uint4* s4 = reinterpret_cast<const uint4*>(src);
    const uint4 w0 = s4[0], w1 = s4[1];
    const u32 ws[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      u32 wi = ws[i];
      float2 f = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&wi));
      x[2 * i] = f.x;
      x[2 * i + 1] = f.y;
    }
  }
  if constexpr (KV_DTYPE == DT_BF16) {
    uint4* dst = reinterpret_cast<uint4*>(cache + row * ROW_BYTES + grp * 32);
    const uint4* s4 = reinterpret_cast<const uint4*>(src);
    dst[0] = s4[0];
    dst[1] = s4[1];
  } else if constexpr (KV_DTYPE == DT_F16) {
    u32 h[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      __half2 v = __floats2half2_rn(x[2 * i], x[2 * i + 1]);
      h[i] = *reinterpret_cast<u32*>(&v);
    }
    uint4* dst = reinterpret_cast<uint4*>(cache + row * ROW_BYTES + grp * 32);
    dst[0] = make_uint4(h[0], h[1], h[2], h[3]);
    dst[1] = make_uint4(h[4], h[5], h[6], h[7]);
  } else if constexpr (KV_DTYPE == DT_E4M3 || KV_DTYPE == DT_E5M2) {
    u8 b[16];
#pragma unroll
    for (int i = 0; i < 16; ++i)
      b[i] = __nv_cvt_float_to_fp8(__fdiv_rn(x[i], scale), __NV_SATFINITE,
                                   KV_DTYPE == DT_E4M3 ? __NV_E4M3 : __NV_E5M2);
    *reinterpret_cast<uint4*>(cache + row * ROW_BYTES + grp * 16) = *reinterpret_cast<uint4*>(b);
  } else {
    // nvfp4: block scale = amax / 6 / global, stored as e4m3; values = x / (bs * global) as e2m1.
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(x[i]));
    const u8 bs = __nv_cvt_float_to_fp8(__fdiv_rn(__fdiv_rn(amax, 6.0f), scale), __NV_SATFINITE, __NV_E4M3);
    __half_raw bsh = __nv_cvt_fp8_to_halfraw(bs, __NV_E4M3);
    const float bsf = __half2float(*reinterpret_cast<__half*>(&bsh));
    const float denom = __fmul_rn(bsf, scale);
    u8 packed[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const u8 lo = denom > 0.f ? e2m1_code(__fdiv_rn(x[2 * i], denom)) : 0;
      const u8 hi = denom > 0.f ? e2m1_code(__fdiv_rn(x[2 * i + 1], denom)) : 0;
      packed[i] = static_cast<u8>(lo | (hi << 4));
    }
    *reinterpret_cast<uint2*>(cache + row * ROW_BYTES + grp * 8) = *reinterpret_cast<uint2*>(packed);
    (is_v ? v_bscale : k_bscale)[row * SCALE_BYTES + grp] = bs;
  }
}
