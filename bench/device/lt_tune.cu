// How far cuBLASLt's first heuristic pick is from its best candidate for the FP8 GEMMs of
// dummy Llama-3.1-8B (issue 32: the 256-stream decode step and the 2,048-token prefill). The
// GEMM is the engine's (crates/kvfleet-cuda/src/gpu/lt.rs): D[n x t] = op(A)^T B column-major,
// A the e4m3 weights [n, k] row-major, B the e4m3 input [t, k] row-major, D f32, per-row
// ("outer vector") scales when the library takes them, else unit scales (printed). For each
// shape it asks the heuristic for up to 16 candidates within the engine's workspace, times each
// (CUDA events, median of REPS launches after 3 warm-ups, weights 4x larger than L2 rotated so
// they come from DRAM as in the model) and prints the first pick against the fastest.
// Both with per-row scales and with unit scales (the engine's path where the library has no
// per-row scales: the scales applied by the consumer, kvf_add_rms_norm_fp8 and friends).
// Then it searches the configurations cuBLASLt accepts beyond the heuristic (every algorithm
// id, tile, split-K count and cluster shape that cublasLtMatmulAlgoCheck passes within the
// workspace), each timed briefly, the five fastest again as above, and checks the fastest's
// output against the first pick's.
// KSPLIT=1 instead times each small-token shape with unit scales as one GEMM against the same
// GEMM over K in s parts run as one strided batch of s (the parts' f32 sums side by side, for the
// consumer to add), s = 2 and 4, and checks the parts' sum against the one GEMM's output: the
// down projection at 256 tokens fills 64 of 132 SMs with its tiles (bench/RESULTS.md).
// Build and run on the device:
//   nvcc -O3 -std=c++17 -o /tmp/lt_tune bench/device/lt_tune.cu -lcublasLt && /tmp/lt_tune 20
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)
#define LK(x) do { cublasStatus_t s_ = (x); if (s_ != CUBLAS_STATUS_SUCCESS) { fprintf(stderr, "%s:%d cublasLt status %d\n", __FILE__, __LINE__, (int)s_); exit(1); } } while (0)

// The engine's workspace (kvfleet_core::plan::FP8_GEMM_WORKSPACE_BYTES).
constexpr size_t WORKSPACE = 32u << 20;

__global__ void fill(unsigned char* p, size_t n, unsigned int seed) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned int h = (unsigned int)i * 2654435761u ^ seed;
        h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
        p[i] = (unsigned char)(h & 0xb7u);
    }
}
__global__ void setf(float* p, size_t n, float v) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] = v;
}

struct Cand {
    cublasLtMatmulAlgo_t algo;
    float us;
    int id, tile, splitk, cluster;
};

template <typename T>
static T cfg_get(const cublasLtMatmulAlgo_t& a, cublasLtMatmulAlgoConfigAttributes_t at) {
    T v{};
    size_t w = 0;
    cublasLtMatmulAlgoConfigGetAttribute(&a, at, &v, sizeof v, &w);
    return v;
}

// The KSPLIT=1 run: one GEMM against K in s parts as a strided batch of s (unit scales).
static int ksplit(cublasLtHandle_t h, void* ws, int reps) {
    const int T[] = {64, 128, 256, 512};
    const int NK[][2] = {{6144, 4096}, {4096, 4096}, {28672, 4096}, {4096, 14336}};
    const char* name[] = {"Q/K/V", "O", "gate/up", "down"};
    const size_t wbytes_max = 28672ull * 4096;
    const int rot = 8;  // 8 weight copies of the largest: 940 MB, well past L2
    unsigned char *w, *x;
    float* y;
    CK(cudaMalloc(&w, wbytes_max * rot));
    CK(cudaMalloc(&x, 512ull * 14336));
    CK(cudaMalloc(&y, 4 * 512ull * 28672 * 4));
    fill<<<4096, 256>>>(w, wbytes_max * rot, 7u);
    fill<<<1024, 256>>>(x, 512ull * 14336, 8u);
    CK(cudaDeviceSynchronize());
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int t : T) {
        for (int sh = 0; sh < 4; ++sh) {
            const int n = NK[sh][0], k = NK[sh][1];
            const size_t wbytes = (size_t)n * k;
            const int nrot = (int)std::min<size_t>(rot * (wbytes_max / wbytes), 64);
            float us[3] = {-1, -1, -1};
            std::vector<float> out[3];
            const int parts[3] = {1, 2, 4};
            for (int pi = 0; pi < 3; ++pi) {
                const int s = parts[pi];
                if ((k / s) % 16 != 0) continue;
                cublasLtMatmulDesc_t desc;
                LK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
                const cublasOperation_t tr = CUBLAS_OP_T;
                LK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &tr, sizeof tr));
                cublasLtMatrixLayout_t la, lb, lc;
                LK(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, k / s, n, k));
                LK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, k / s, t, k));
                LK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, n, t, n));
                if (s > 1) {
                    const int32_t bc = s;
                    const int64_t oa = k / s, ob = k / s, oc = (int64_t)n * t;
                    for (auto l : {la, lb, lc}) LK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc, sizeof bc));
                    LK(cublasLtMatrixLayoutSetAttribute(la, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &oa, sizeof oa));
                    LK(cublasLtMatrixLayoutSetAttribute(lb, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &ob, sizeof ob));
                    LK(cublasLtMatrixLayoutSetAttribute(lc, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &oc, sizeof oc));
                }
                cublasLtMatmulPreference_t pref;
                LK(cublasLtMatmulPreferenceCreate(&pref));
                const uint64_t wsb = WORKSPACE;
                LK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb));
                cublasLtMatmulHeuristicResult_t r;
                int got = 0;
                if (cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, lc, lc, pref, 1, &r, &got) == CUBLAS_STATUS_SUCCESS && got > 0) {
                    const float alpha = 1.f, beta = 0.f;
                    std::vector<float> ts;
                    bool ok = true;
                    for (int i = 0; i < reps + 3 && ok; ++i) {
                        const unsigned char* wp = w + (size_t)(i % nrot) * wbytes;
                        CK(cudaEventRecord(e0));
                        ok = cublasLtMatmul(h, desc, &alpha, wp, la, x, lb, &beta, y, lc, y, lc, &r.algo, ws, WORKSPACE, 0) == CUBLAS_STATUS_SUCCESS;
                        CK(cudaEventRecord(e1));
                        CK(cudaEventSynchronize(e1));
                        float ms;
                        CK(cudaEventElapsedTime(&ms, e0, e1));
                        if (i >= 3) ts.push_back(ms * 1e3f);
                    }
                    if (ok) {
                        std::sort(ts.begin(), ts.end());
                        us[pi] = ts[ts.size() / 2];
                        // The output of weight copy 0, parts summed.
                        CK(cudaMemset(y, 0, (size_t)s * n * t * 4));
                        LK(cublasLtMatmul(h, desc, &alpha, w, la, x, lb, &beta, y, lc, y, lc, &r.algo, ws, WORKSPACE, 0));
                        std::vector<float> all((size_t)s * n * t);
                        CK(cudaMemcpy(all.data(), y, all.size() * 4, cudaMemcpyDeviceToHost));
                        out[pi].assign((size_t)n * t, 0.f);
                        for (int q = 0; q < s; ++q)
                            for (size_t i = 0; i < (size_t)n * t; ++i) out[pi][i] += all[(size_t)q * n * t + i];
                    }
                }
                cublasLtMatmulPreferenceDestroy(pref);
                cublasLtMatrixLayoutDestroy(la);
                cublasLtMatrixLayoutDestroy(lb);
                cublasLtMatrixLayoutDestroy(lc);
                cublasLtMatmulDescDestroy(desc);
            }
            const double fl = 2.0 * t * n * k;
            printf("%-8s t=%4d n=%5d k=%5d unit scales: one GEMM %6.1f us (%4.0f TFLOP/s)", name[sh], t, n, k, us[0], fl / (us[0] * 1e-6) / 1e12);
            for (int pi = 1; pi < 3; ++pi) {
                if (us[pi] < 0 || out[0].empty()) { printf("; %d parts: none", parts[pi]); continue; }
                double d = 0, mx = 0;
                for (size_t i = 0; i < out[0].size(); ++i) { d = std::max(d, (double)fabsf(out[0][i] - out[pi][i])); mx = std::max(mx, (double)fabsf(out[0][i])); }
                printf("; %d parts %6.1f us (%.3fx, max |diff| / max |y| %.1e)", parts[pi], us[pi], us[0] / us[pi], d / mx);
            }
            printf("\n");
        }
    }
    return 0;
}

int main(int argc, char** argv) {
    const int reps = argc > 1 ? atoi(argv[1]) : 20;
    cublasLtHandle_t h;
    LK(cublasLtCreate(&h));
    printf("cuBLASLt %zu\n", cublasLtGetVersion());
    int l2 = 0;
    CK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0));
    void* ws;
    CK(cudaMalloc(&ws, WORKSPACE));
    if (getenv("KSPLIT") && atoi(getenv("KSPLIT")) == 1) return ksplit(h, ws, reps);
    const int T[] = {256, 2048};
    const int NK[][2] = {{6144, 4096}, {4096, 4096}, {28672, 4096}, {4096, 14336}};
    const char* name[] = {"Q/K/V", "O", "gate/up", "down"};
    const size_t wmax = 28672ull * 4096;
    // Enough weight copies that a rotation reads from DRAM: at least 4x L2.
    const int copies = std::max(2, (int)((4ull * l2 + wmax - 1) / wmax));
    unsigned char *w, *x;
    float *sw, *sx, *y;
    CK(cudaMalloc(&w, wmax * copies));
    CK(cudaMalloc(&x, 2048ull * 14336));
    CK(cudaMalloc(&sw, 28672 * 4));
    CK(cudaMalloc(&sx, 2048 * 4));
    CK(cudaMalloc(&y, 2048ull * 28672 * 4));
    fill<<<4096, 256>>>(w, wmax * copies, 1u);
    fill<<<4096, 256>>>(x, 2048ull * 14336, 2u);
    setf<<<64, 256>>>(sw, 28672, 1.f / 64.f);
    setf<<<8, 256>>>(sx, 2048, 1.f / 32.f);
    CK(cudaDeviceSynchronize());
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    double total_first = 0, total_best = 0, total_search = 0;
    // Times one algorithm: median of `n` launches after one (or 3) warm-ups, in us; < 0 if it fails.
    auto time_algo = [&](cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t la, cublasLtMatrixLayout_t lb, cublasLtMatrixLayout_t lc,
                         const cublasLtMatmulAlgo_t& algo, size_t wbytes, int rot, int n, int warm) -> float {
        const float alpha = 1.f, beta = 0.f;
        std::vector<float> ts;
        for (int r = 0; r < n + warm; ++r) {
            const unsigned char* wp = w + (size_t)(r % rot) * wbytes;
            CK(cudaEventRecord(e0));
            if (cublasLtMatmul(h, desc, &alpha, wp, la, x, lb, &beta, y, lc, y, lc, &algo, ws, WORKSPACE, 0) != CUBLAS_STATUS_SUCCESS) {
                cudaGetLastError();
                return -1.f;
            }
            CK(cudaEventRecord(e1));
            CK(cudaEventSynchronize(e1));
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            if (r >= warm) ts.push_back(ms * 1e3f);
        }
        std::sort(ts.begin(), ts.end());
        return ts[ts.size() / 2];
    };
    // What a probe of one small shape answers (the engine's check before 2026-12-02): per-row
    // scales for 64 x 64 x 64.
    {
        cublasLtMatmulDesc_t desc;
        LK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        const cublasOperation_t tr = CUBLAS_OP_T;
        LK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &tr, sizeof tr));
        const unsigned int outer = 3;
        const bool modes = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &outer, sizeof outer) == CUBLAS_STATUS_SUCCESS &&
                           cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &outer, sizeof outer) == CUBLAS_STATUS_SUCCESS;
        cublasLtMatrixLayout_t la, lb, lc;
        LK(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, 64, 64, 64));
        LK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, 64, 64, 64));
        LK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, 64, 64, 64));
        cublasLtMatmulPreference_t pref;
        LK(cublasLtMatmulPreferenceCreate(&pref));
        const uint64_t wsb = WORKSPACE;
        LK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb));
        cublasLtMatmulHeuristicResult_t r;
        int got = 0;
        const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, lc, lc, pref, 1, &r, &got);
        printf("probe 64 x 64 x 64, per-row scales: modes set %d, heuristic status %d, %d algorithms\n", (int)modes, (int)st, got);
    }
    for (int mode = 0; mode < 2; ++mode) {
    total_first = total_best = total_search = 0;
    for (int t : T) {
        for (int s = 0; s < 4; ++s) {
            const int n = NK[s][0], k = NK[s][1];
            cublasLtMatmulDesc_t desc;
            LK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
            const cublasOperation_t tr = CUBLAS_OP_T;
            LK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &tr, sizeof tr));
            const unsigned int outer = 3;  // CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F
            bool per_row = mode == 0 && cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &outer, sizeof outer) == CUBLAS_STATUS_SUCCESS &&
                           cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &outer, sizeof outer) == CUBLAS_STATUS_SUCCESS;
            if (per_row) {
                const void* a = sw;
                const void* b = sx;
                LK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a, sizeof a));
                LK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b, sizeof b));
            }
            cublasLtMatrixLayout_t la, lb, lc;
            LK(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, k, n, k));
            LK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, k, t, k));
            LK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, n, t, n));
            cublasLtMatmulPreference_t pref;
            LK(cublasLtMatmulPreferenceCreate(&pref));
            const uint64_t wsb = WORKSPACE;
            LK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb));
            cublasLtMatmulHeuristicResult_t res[16];
            int got = 0;
            cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, lc, lc, pref, 16, res, &got);
            if (hs != CUBLAS_STATUS_SUCCESS && per_row) {
                printf("%-8s t=%d: no per-row scales here (status %d)\n", name[s], t, (int)hs);
            }
            if (hs != CUBLAS_STATUS_SUCCESS || got == 0) { printf("%-8s t=%d: no algorithm\n", name[s], t); continue; }
            const float alpha = 1.f, beta = 0.f;
            const size_t wbytes = (size_t)n * k;
            const int rot = (int)std::min<size_t>(copies * (wmax / wbytes), 64);
            std::vector<float> med(got, 1e30f);
            for (int c = 0; c < got; ++c) {
                std::vector<float> ts;
                bool ok = true;
                for (int r = 0; r < reps + 3 && ok; ++r) {
                    const unsigned char* wp = w + (size_t)(r % rot) * wbytes;
                    CK(cudaEventRecord(e0));
                    ok = cublasLtMatmul(h, desc, &alpha, wp, la, x, lb, &beta, y, lc, y, lc, &res[c].algo, ws, WORKSPACE, 0) == CUBLAS_STATUS_SUCCESS;
                    CK(cudaEventRecord(e1));
                    CK(cudaEventSynchronize(e1));
                    float ms;
                    CK(cudaEventElapsedTime(&ms, e0, e1));
                    if (r >= 3) ts.push_back(ms);
                }
                if (!ok) continue;
                std::sort(ts.begin(), ts.end());
                med[c] = ts[ts.size() / 2];
            }
            const int best = (int)(std::min_element(med.begin(), med.end()) - med.begin());
            const double fl = 2.0 * t * n * k;
            printf("%-8s t=%4d n=%5d k=%5d per-row %d: %2d candidates; first %7.1f us %5.0f TFLOP/s; best #%d %7.1f us %5.0f TFLOP/s (%.3fx); all:",
                   name[s], t, n, k, (int)per_row, got, med[0] * 1e3, fl / (med[0] * 1e-3) / 1e12, best, med[best] * 1e3,
                   fl / (med[best] * 1e-3) / 1e12, med[0] / med[best]);
            for (int c = 0; c < got; ++c) printf(" %.1f", med[c] * 1e3);
            printf("\n");
            total_first += med[0];
            total_best += med[best];
            printf("    first pick: algo %d tile %d split-K %d cluster %d\n", cfg_get<int>(res[0].algo, CUBLASLT_ALGO_CONFIG_ID),
                   (int)cfg_get<uint32_t>(res[0].algo, CUBLASLT_ALGO_CONFIG_TILE_ID), (int)cfg_get<uint32_t>(res[0].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
                   (int)cfg_get<uint16_t>(res[0].algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID));
            // The search.
            int ids[64], nids = 0;
            LK(cublasLtMatmulAlgoGetIds(h, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, CUDA_R_32F, CUDA_R_32F, 64, ids, &nids));
            std::vector<Cand> cands;
            int tried = 0, configs = 0;
            for (int ii = 0; ii < nids; ++ii) {
                cublasLtMatmulAlgo_t algo;
                if (cublasLtMatmulAlgoInit(h, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, CUDA_R_32F, CUDA_R_32F, ids[ii], &algo) != CUBLAS_STATUS_SUCCESS) continue;
                size_t sz = 0;
                cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_TILE_IDS, nullptr, 0, &sz);
                std::vector<uint32_t> tiles(std::max<size_t>(1, sz / 4), 0);
                if (sz) cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_TILE_IDS, tiles.data(), sz, &sz);
                int splitk_ok = 0;
                uint32_t red_mask = 0;
                cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT, &splitk_ok, sizeof splitk_ok, &sz);
                cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK, &red_mask, sizeof red_mask, &sz);
                std::vector<uint32_t> splits = {1};
                if (splitk_ok) for (uint32_t sk : {2u, 3u, 4u, 6u, 8u}) if (t < 2048 || sk <= 2) splits.push_back(sk);
                for (uint32_t tile : tiles) {
                    for (uint32_t sk : splits) {
                        for (uint16_t cl : {(uint16_t)0, (uint16_t)2, (uint16_t)3, (uint16_t)5}) {
                            cublasLtMatmulAlgo_t a = algo;
                            cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile);
                            cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &sk, sizeof sk);
                            if (sk > 1) {
                                uint32_t scheme = (red_mask & CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE) ? CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE
                                                  : (red_mask & CUBLASLT_REDUCTION_SCHEME_INPLACE) ? CUBLASLT_REDUCTION_SCHEME_INPLACE
                                                                                                    : CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE;
                                cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme, sizeof scheme);
                            }
                            if (cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cl, sizeof cl) != CUBLAS_STATUS_SUCCESS) continue;
                            ++configs;
                            cublasLtMatmulHeuristicResult_t chk;
                            if (cublasLtMatmulAlgoCheck(h, desc, la, lb, lc, lc, &a, &chk) != CUBLAS_STATUS_SUCCESS) continue;
                            if (chk.workspaceSize > WORKSPACE) continue;
                            ++tried;
                            const float us = time_algo(desc, la, lb, lc, a, wbytes, rot, 5, 1);
                            if (us > 0) cands.push_back({a, us, ids[ii], (int)tile, (int)sk, (int)cl});
                        }
                    }
                }
            }
            std::sort(cands.begin(), cands.end(), [](const Cand& a, const Cand& b) { return a.us < b.us; });
            if (cands.size() > 5) cands.resize(5);
            for (auto& c : cands) c.us = time_algo(desc, la, lb, lc, c.algo, wbytes, rot, reps, 3);
            std::sort(cands.begin(), cands.end(), [](const Cand& a, const Cand& b) { return a.us < b.us; });
            const float first_us = time_algo(desc, la, lb, lc, res[0].algo, wbytes, rot, reps, 3);
            if (!cands.empty()) {
                const Cand& b = cands[0];
                // The output of the fastest against the first pick's.
                std::vector<float> y0((size_t)t * n), y1((size_t)t * n);
                time_algo(desc, la, lb, lc, res[0].algo, wbytes, 1, 1, 0);
                CK(cudaMemcpy(y0.data(), y, y0.size() * 4, cudaMemcpyDeviceToHost));
                time_algo(desc, la, lb, lc, b.algo, wbytes, 1, 1, 0);
                CK(cudaMemcpy(y1.data(), y, y1.size() * 4, cudaMemcpyDeviceToHost));
                double d = 0, mx = 0;
                for (size_t i = 0; i < y0.size(); ++i) { d = std::max(d, (double)fabsf(y0[i] - y1[i])); mx = std::max(mx, (double)fabsf(y0[i])); }
                printf("    search: %d configurations run; fastest algo %d tile %d split-K %d cluster %d: %.1f us %5.0f TFLOP/s against the first pick's %.1f (%.3fx); max |diff| / max |y| %.1e\n",
                       tried, b.id, b.tile, b.splitk, b.cluster, b.us, fl / (b.us * 1e-6) / 1e12, first_us, first_us / b.us, d / mx);
                total_search += std::min(b.us, first_us) * 1e-3;
            } else {
                printf("    search: %d of %d configurations (%d algorithm ids) passed the check, none ran\n", tried, configs, nids);
                total_search += first_us * 1e-3;
            }
            cublasLtMatmulPreferenceDestroy(pref);
            cublasLtMatrixLayoutDestroy(la);
            cublasLtMatrixLayoutDestroy(lb);
            cublasLtMatrixLayoutDestroy(lc);
            cublasLtMatmulDescDestroy(desc);
        }
    }
    printf("sum over the shapes: first picks %.1f us, best of the heuristic %.1f us (%.3fx), best of the search %.1f us (%.3fx)\n",
           total_first * 1e3, total_best * 1e3, total_first / total_best, total_search * 1e3, total_first / total_search);
    }
    return 0;
}
