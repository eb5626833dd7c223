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

}  // namespace

// out[r] = argmax over logits[r, :vocab] (first maximum). Grid (rows), block a multiple of 32
// (<= 1024).
extern "C" __global__ void kvf_argmax_rows(const float* __restrict__ logits, int vocab, int* __restrict__ out) {
    kvf_wait_prior_grid();
    __shared__ float sv[32];
    __shared__ int si[32];
    const float* row = logits + (size_t)blockIdx.x * vocab;
    float v = __int_as_float(0xff800000);
    int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) better(v, idx, row[i], i);
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
        // A row of NaN or -inf only: token 0, as the host's argmax answers.
        if (lane == 0) out[blockIdx.x] = idx < vocab ? idx : 0;
    }
}
