// Sampling kernels: what a step needs on the device so that it copies token ids to the host
// instead of `[rows, vocab]` f32 logits (131 MB a step for 256 rows of a 128k vocabulary).
// Appended to kernels/model.cu in one NVRTC program (crates/kvfleet-cuda/src/gpu.rs), so it uses that file's
// helpers and typedefs.

namespace {

// The better of two (value, index) candidates: the larger value, the lower index on ties, the
// same order as the host's `sampling::argmax` (the first maximum wins). NaN never wins.
__device__ __forceinline__ void better(float& v, int& i, float ov, int oi) {
    if (ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
    }
}

// The block's best (value, index), returned to every thread. Every thread of the block calls it.
__device__ int block_best(float v, int idx) {
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ int best;
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        better(v, idx, ov, oi);
    }
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    if (lane == 0) {
        sv[warp] = v;
        si[warp] = idx;
    }
    __syncthreads();
    if (warp == 0) {
        const int nw = (blockDim.x + 31) >> 5;
        v = lane < nw ? sv[lane] : __int_as_float(0xff800000);
        idx = lane < nw ? si[lane] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, v, o);
            const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
            better(v, idx, ov, oi);
        }
        if (lane == 0) best = idx;
    }
    __syncthreads();
    const int r = best;
    __syncthreads();
    return r;
}

// Block reductions for the draw's threshold searches: every thread gets the result, and the
// order of the sums is fixed by the block's shape, so a row draws the same token every run.
__device__ unsigned block_max_u32(unsigned v) {
    __shared__ unsigned part[32];
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    if (lane == 0) part[warp] = v;
    __syncthreads();
    unsigned r = 0;
    for (int w = 0; w < (int)((blockDim.x + 31) >> 5); ++w) r = max(r, part[w]);
    __syncthreads();
    return r;
}

// The order-preserving key of a scaled logit (NaN as -inf) and back: `order_key` and
// `key_value` in crates/kvfleet-engine/src/model/sampling.rs.
__device__ __forceinline__ unsigned order_key(float s) {
    if (s != s) s = __int_as_float(0xff800000);
    const unsigned b = __float_as_uint(s);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float key_value(unsigned k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// The Gumbel noise of token i under a row's key (`gumbel` in sampling.rs): u in (0, 1) from 23
// bits of splitmix64(key + i * golden), exact in f32; -log(-log(u)) with the accurate logf.
__device__ __forceinline__ float gumbel(unsigned long long key, int i) {
    const unsigned long long z = splitmix64(key + (unsigned long long)i * 0x9E3779B97F4A7C15ull);
    const float u = ((float)(z >> 41) + 0.5f) * (1.f / 8388608.f);
    return -logf(-logf(u));
}

// Calls f(i, row[i]) for this thread's share of the row: four consecutive values a 16-byte
// load when every row starts 16-byte aligned (vocab a multiple of 4, as Llama 3's 128,256), one
// at a time otherwise. A pass over a row is a few hundred loads a thread, so at one row a step
// (one stream) the wide loads are what keep the pick kernel short.
template <typename F>
__device__ __forceinline__ void for_row(const float* __restrict__ row, int vocab, F f) {
    if ((vocab & 3) == 0) {
        const float4* r4 = reinterpret_cast<const float4*>(row);
        for (int i = threadIdx.x; i < vocab / 4; i += blockDim.x) {
            const float4 x = r4[i];
            f(4 * i, x.x);
            f(4 * i + 1, x.y);
            f(4 * i + 2, x.z);
            f(4 * i + 3, x.w);
        }
    } else {
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) f(i, row[i]);
    }
}

// The largest key t in [lo, hi] whose weight (the tokens with keys in [t, hi], plus `above`
// for those above hi) reaches the target: `goal`, or with `relative` `goal` times the weight
// of [lo, hi] (the first pass measures it). A token weighs 1 (top-k: counts) or, with MASS,
// its softmax mass exp(s - m) (top-p). Requires the weight at lo to reach the target. Each pass
// splits [lo, hi] into PICK_BUCKETS buckets of 2^shift keys and keeps the one holding t, so
// 32-bit keys take at most 8 passes over the row (bisection took 32). Sums run in a fixed order
// (per thread, then per warp, then warps in order), so a row gives the same key every run.
#define PICK_BUCKETS 16
template <bool MASS>
__device__ unsigned largest_key_reaching(const float* __restrict__ row, int vocab, float t, float m,
                                         unsigned lo, unsigned hi, float goal, bool relative) {
    __shared__ float part[32][PICK_BUCKETS];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nw = (blockDim.x + 31) >> 5;
    float above = 0.f;
    float target = goal;
    while (lo < hi) {
        const unsigned long long span = (unsigned long long)hi - lo;
        int shift = 0;
        while ((span >> shift) >= PICK_BUCKETS) ++shift;
        float w[PICK_BUCKETS];
#pragma unroll
        for (int j = 0; j < PICK_BUCKETS; ++j) w[j] = 0.f;
        for_row(row, vocab, [&](int, float l) {
            const float s = l / t;
            const unsigned k = order_key(s);
            if (k >= lo && k <= hi) {
                const unsigned b = (k - lo) >> shift;
                const float x = MASS ? expf(s - m) : 1.f;
#pragma unroll
                for (int j = 0; j < PICK_BUCKETS; ++j) w[j] += b == (unsigned)j ? x : 0.f;
            }
        });
#pragma unroll
        for (int j = 0; j < PICK_BUCKETS; ++j) {
            w[j] = warp_sum(w[j]);
            if (lane == 0) part[warp][j] = w[j];
        }
        __syncthreads();
#pragma unroll
        for (int j = 0; j < PICK_BUCKETS; ++j) {
            float sum = 0.f;
            for (int q = 0; q < nw; ++q) sum += part[q][j];
            w[j] = sum;
        }
        __syncthreads();
        if (relative) {
            float z = 0.f;
            for (int j = PICK_BUCKETS - 1; j >= 0; --j) z += w[j];
            target = goal * z;
            relative = false;
        }
        // The highest bucket whose weight with everything above it reaches the target.
        int b = 0;
        float acc = above;
        for (int j = PICK_BUCKETS - 1; j > 0; --j) {
            if (acc + w[j] >= target) {
                b = j;
                break;
            }
            acc += w[j];
        }
        above = acc;
        const unsigned long long start = (unsigned long long)lo + ((unsigned long long)b << shift);
        const unsigned long long end = start + (1ull << shift) - 1;
        lo = (unsigned)start;
        hi = end < hi ? (unsigned)end : hi;
    }
    return lo;
}

}  // namespace

// out[r] = argmax over logits[r, :vocab] (first maximum). Grid (rows), block a multiple of 32
// (<= 1024). One block reads a whole row (513 KB for a 128k vocabulary), so it reads 16 bytes a
// load, four loads in flight a thread, when every row starts 16-byte aligned (vocab a multiple
// of 4): 31 us a 128k row on an H200 with scalar loads, 11.5 us so (bench/RESULTS.md, issue 32).
extern "C" __global__ void kvf_argmax_rows(const float* __restrict__ logits, int vocab, int* __restrict__ out) {
    kvf_wait_prior_grid();
    const float* row = logits + (size_t)blockIdx.x * vocab;
    float v = __int_as_float(0xff800000);
    int idx = 0x7fffffff;
    const int v4 = (vocab & 3) == 0 ? vocab >> 2 : 0;
    const float4* row4 = reinterpret_cast<const float4*>(row);
#pragma unroll 4
    for (int c = threadIdx.x; c < v4; c += blockDim.x) {
        const float4 x = row4[c];
        better(v, idx, x.x, 4 * c);
        better(v, idx, x.y, 4 * c + 1);
        better(v, idx, x.z, 4 * c + 2);
        better(v, idx, x.w, 4 * c + 3);
    }
    for (int i = 4 * v4 + threadIdx.x; i < vocab; i += blockDim.x) better(v, idx, row[i], i);
    idx = block_best(v, idx);
    // A row of NaN or -inf only: token 0, as the host's argmax answers.
    if (threadIdx.x == 0) out[blockIdx.x] = idx < vocab ? idx : 0;
}

// Applies each row's sparse logit adjustments in place, before the pick (`Adjust` in
// crates/kvfleet-engine/src/model/sampling.rs): adj holds rows + 1 offsets (in entries), then
// the entries, 4 words each: token, bias, factor, add (f32 bits); a row's entries name distinct
// tokens. l' = r(l + bias) + add with r(x) = x / factor for x > 0, else x * factor, each
// operation rounded on its own (no FMA contraction), as the host computes it. Grid (rows),
// block any size.
extern "C" __global__ void kvf_adjust_rows(float* __restrict__ logits, int vocab, const unsigned* __restrict__ adj) {
    kvf_wait_prior_grid();
    float* row = logits + (size_t)blockIdx.x * vocab;
    const unsigned* e = adj + gridDim.x + 1;
    for (unsigned j = adj[blockIdx.x] + threadIdx.x; j < adj[blockIdx.x + 1]; j += blockDim.x) {
        const unsigned tok = e[4 * j];
        if (tok >= (unsigned)vocab) continue;
        const float bias = __uint_as_float(e[4 * j + 1]);
        const float factor = __uint_as_float(e[4 * j + 2]);
        const float add = __uint_as_float(e[4 * j + 3]);
        float x = __fadd_rn(row[tok], bias);
        x = x > 0.f ? __fdiv_rn(x, factor) : __fmul_rn(x, factor);
        row[tok] = __fadd_rn(x, add);
    }
}

// out[r] = the token row r's pick chooses (`RowPick` in crates/kvfleet-engine/src/model/
// sampling.rs, which defines it and picks the same on the host). picks[r] is 6 words:
// temperature (f32 bits; <= 0: the argmax), top_k (0: all), top_p (f32 bits; 1: all), the key's
// low and high words, min_p (f32 bits; 0: all). Min-p is a floor at m + logf(min_p); top-k and
// top-p each find their smallest kept key in at most 8 passes over the row
// (`largest_key_reaching`); a draw with neither is two passes. Grid (rows), block a multiple of
// 32 (<= 1024).
extern "C" __global__ void kvf_pick_rows(const float* __restrict__ logits, int vocab,
                                         const unsigned* __restrict__ picks, int* __restrict__ out) {
    kvf_wait_prior_grid();
    const float* row = logits + (size_t)blockIdx.x * vocab;
    const unsigned* p = picks + 6 * (size_t)blockIdx.x;
    const float t = __uint_as_float(p[0]);
    const int top_k = (int)p[1];
    const float top_p = __uint_as_float(p[2]);
    const unsigned long long key = (unsigned long long)p[3] | ((unsigned long long)p[4] << 32);
    const float min_p = __uint_as_float(p[5]);
    float v = __int_as_float(0xff800000);
    int idx = 0x7fffffff;
    if (!(t > 0.f) || top_k == 1) {
        for_row(row, vocab, [&](int i, float l) { better(v, idx, l, i); });
    } else {
        unsigned kmax = 0;
        for_row(row, vocab, [&](int, float l) { kmax = max(kmax, order_key(l / t)); });
        kmax = block_max_u32(kmax);
        // Keys at or above `floor` stay. Each search keeps the largest key where its predicate
        // (monotone: true at `floor`) holds.
        unsigned floor = 0;
        const float m = key_value(kmax);
        if (min_p > 0.f && isfinite(m)) floor = order_key(__fadd_rn(m, logf(min_p)));
        if (top_k > 1 && top_k < vocab)
            floor = max(floor, largest_key_reaching<false>(row, vocab, t, m, 0, kmax, (float)top_k, false));
        if (top_p < 1.f && isfinite(m)) floor = largest_key_reaching<true>(row, vocab, t, m, floor, kmax, top_p, true);
        for_row(row, vocab, [&](int i, float l) {
            const unsigned k = order_key(l / t);
            if (k >= floor) better(v, idx, key_value(k) + gumbel(key, i), i);
        });
    }
    idx = block_best(v, idx);
    // Nothing above -inf: token 0, as the host answers.
    if (threadIdx.x == 0) out[blockIdx.x] = idx < vocab ? idx : 0;
}
