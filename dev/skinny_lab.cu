/* dev/skinny_lab.cu -- kernel lab: y = W x for 16 tokens through a bf16 matrix at the DFlash drafter's shapes
 * (make dev/skinny_lab && ./dev/skinny_lab).
 *
 * The drafter's block forward (XS-2.1-DFlash, 16 tokens) is ~75% GEMMs of 16 rows, which cuBLAS runs at 2.2-2.9 TB/s
 * and gemm_few (laguna.cu: a warp owns 16 weight rows, 4 chunks of 1 KB in flight a warp, ~64 KB an SM) at ~2.1.
 * Here: gemm_few's warp layout and mma order, but each warp's weight chunks stream through a ring of S stages in
 * shared memory filled by cp.async (registers no longer bound how much is in flight: S KB a warp), the token rows
 * either read at use (__ldg, from L1 / L2) or brought in the same ring. Every variant at every split of the rows'
 * chunks over the block's warps (KS 1..8), against gemm_few and cuBLAS; matrices are timed over rotating copies so
 * L2 does not serve them; each variant's output must be within 1e-3 of gemm_few's (the same products; a split other
 * than gemm_few_launch's sums them in another order; gemm_few itself is checked against a CPU reference by
 * dev/few_lab). The epilogue (the KS partial sums through shared memory, the stores) is gemm_few's, so that only the
 * loads differ. Exit code 1 if one is off.
 *
 * Measured (H200, 2026-12-03, dev/gpu_notes.md round 32): no ring variant beats cuBLAS on any matrix above 8 MB
 * (q/k/v/g 15.0 us for cuBLAS, 16.5 at best here; gate/up 20.6 against 22.9; down 15.3 against 15.7; lm_head 106.1
 * against 117.1); x read at use is the worst for rows of 8192 (x no longer stays in L1). Not taken into laguna.cu. */
#include "../laguna.cu"
#include "lab_graph.h"

#include <algorithm>
#include <vector>

static uint64_t rng = 88172645463325252ull;
static float urand() { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return (float)((rng >> 11) * (1.0 / 9007199254740992.0)) * 2 - 1; }

/* y[t, r] = W[r, :] . x[t, :] for n <= 16 tokens, W bf16 [out, in] (in % 8 == 0), x bf16 [n, in]. Warp and tile as
 * gemm_few: 8 / KS tiles of 16 rows a block, KS warps on a tile's chunks of 32 columns (ks, ks + KS, ...). A warp's
 * chunk j lands in ring slot j % S: lane (g, t) copies its 16 bytes of rows g and g + 8 (and with XR, of tokens g
 * and g + 8) and reads back only what it copied, so no barrier is needed between the warp's lanes. */
template <int S, int KS, bool XR>
__global__ void __launch_bounds__(256) skinny(float *y, int ldy, const bf16 *w, int out, int in, const bf16 *x, int n) {
    extern __shared__ uint4 ring[];                            /* [warp][S][P][32 lanes] */
    __shared__ float part[8][8][32];
    constexpr int P = XR ? 4 : 2;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int r0 = (blockIdx.x * (8 / KS) + warp / KS) * 16, ks = warp % KS;
    uint4 *my = ring + (size_t)warp * S * P * 32 + lane;
    float acc[2][4] = {};
    if (r0 < out) {
        const bf16 *w0 = w + (size_t)min(r0 + g, out - 1) * in, *w1 = w + (size_t)min(r0 + g + 8, out - 1) * in;
        const bf16 *x0 = x + (size_t)min(g, n - 1) * in, *x1 = x + (size_t)min(g + 8, n - 1) * in;
        const int nch = (in + 31) / 32, m = (nch - ks + KS - 1) / KS, kl = 8 * t;
        auto issue = [&](int j) {
            const int k = (ks + j * KS) * 32 + kl, kk = min(k, in - 8);
            uint4 *s = my + (j % S) * P * 32;
            cp_async16(s, w0 + kk, true);
            cp_async16(s + 32, w1 + kk, true);
            if (XR) { cp_async16(s + 64, x0 + kk, k < in); cp_async16(s + 96, x1 + kk, k < in); }
        };
#pragma unroll 1
        for (int j = 0; j < S; j++) {
            if (j < m) issue(j);
            asm volatile("cp.async.commit_group;" ::: "memory");
        }
#pragma unroll 1
        for (int j = 0; j < m; j++) {
            const int k = (ks + j * KS) * 32 + kl;
            uint4 xa, xb;
            if (!XR) {                                         /* the token rows from L1 / L2, before the wait */
                const int kk = min(k, in - 8);
                xa = __ldg((const uint4 *)(x0 + kk));
                xb = __ldg((const uint4 *)(x1 + kk));
                if (k >= in) xa = xb = make_uint4(0, 0, 0, 0);
            }
            asm volatile("cp.async.wait_group %0;" ::"n"(S - 1) : "memory");    /* chunk j has landed */
            const uint4 *s = my + (j % S) * P * 32;
            const uint4 wa = s[0], wb = s[32];
            if (XR) { xa = s[64]; xb = s[96]; }
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const uint4 xv = h ? xb : xa;
#pragma unroll
                for (int q = 0; q < 2; q++) {
                    const uint32_t a[4] = {q ? wa.z : wa.x, q ? wb.z : wb.x, q ? wa.w : wa.y, q ? wb.w : wb.y};
                    mma_bf16(acc[h], a, q ? xv.z : xv.x, q ? xv.w : xv.y);
                }
            }
            if (j + S < m) issue(j + S);                       /* into the slot just read (its values are used) */
            asm volatile("cp.async.commit_group;" ::: "memory");
        }
        asm volatile("cp.async.wait_group 0;" ::: "memory");
    }
    if (KS > 1) {
        if (ks)
#pragma unroll
            for (int i = 0; i < 8; i++) part[warp][i][lane] = acc[i / 4][i % 4];
        __syncthreads();
        if (ks) return;
        for (int j = 1; j < KS; j++)
#pragma unroll
            for (int i = 0; i < 8; i++) acc[i / 4][i % 4] += part[warp + j][i][lane];
    }
    if (r0 >= out) return;
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int r = r0 + g + (i & 2 ? 8 : 0), tok = 8 * h + 2 * t + (i & 1);
            if (r < out && tok < n) y[(size_t)tok * ldy + r] = acc[h][i];
        }
}

template <int S, int KS, bool XR> static size_t ring_bytes() { return (size_t)8 * S * (XR ? 4 : 2) * 32 * 16; }
template <int S, int KS, bool XR>
static void launch_skinny(float *y, const bf16 *w, int out, int in, const bf16 *x, int n) {
    const int tiles = (out + 15) / 16;
    skinny<S, KS, XR><<<(tiles * KS + 7) / 8, 256, ring_bytes<S, KS, XR>()>>>(y, out, w, out, in, x, n);
}


static int fails = 0;
struct Shape { const char *name; int out, in; };

/* one variant (S stages, XR) at every KS: its best time, and whether every KS gave gemm_few's bits */
template <int S, bool XR>
static void variant(const Shape &sh, int n, const bf16 *dw, size_t mb, int copies, const bf16 *dx, float *dy,
                    const std::vector<float> &ref, float *best_us, int *best_ks) {
    *best_us = 1e30f;
    auto run = [&](int ks, const bf16 *w) {
        switch (ks) {
        case 1: launch_skinny<S, 1, XR>(dy, w, sh.out, sh.in, dx, n); break;
        case 2: launch_skinny<S, 2, XR>(dy, w, sh.out, sh.in, dx, n); break;
        case 4: launch_skinny<S, 4, XR>(dy, w, sh.out, sh.in, dx, n); break;
        default: launch_skinny<S, 8, XR>(dy, w, sh.out, sh.in, dx, n);
        }
    };
    for (int ks = 1; ks <= 8; ks *= 2) {
        CUDA_CHECK(cudaMemset(dy, 0, (size_t)n * sh.out * 4));
        run(ks, dw);
        LAUNCH_CHECK();
        CUDA_CHECK(cudaDeviceSynchronize());
        std::vector<float> got((size_t)n * sh.out);
        CUDA_CHECK(cudaMemcpy(got.data(), dy, got.size() * 4, cudaMemcpyDeviceToHost));
        double d = 0;
        for (size_t i = 0; i < got.size(); i++) d = std::max(d, (double)fabsf(got[i] - ref[i]));
        if (d > 1e-3) { printf("    S %d %s KS %d: max |diff| from gemm_few %.3g  FAIL\n", S, XR ? "x ring" : "x ldg", ks, d); fails++; }
        const float us = 1e3f * time_ms([&](int i) { run(ks, (const bf16 *)((const char *)dw + mb * (i % copies))); }, 40);
        if (us < *best_us) { *best_us = us; *best_ks = ks; }
    }
}

int main() {
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    GpuModel g = lab_few_model(prop);
    cublasHandle_t blas;
    CUBLAS_CHECK(cublasCreate(&blas));
#define ALLOW1(S, KS, XR) CUDA_CHECK(cudaFuncSetAttribute(skinny<S, KS, XR>, cudaFuncAttributeMaxDynamicSharedMemorySize, \
                                                        (int)ring_bytes<S, KS, XR>()))
#define ALLOW(S, XR) do { ALLOW1(S, 1, XR); ALLOW1(S, 2, XR); ALLOW1(S, 4, XR); ALLOW1(S, 8, XR); } while (0)
    ALLOW(4, false); ALLOW(8, false); ALLOW(12, false); ALLOW(4, true); ALLOW(6, true);
#undef ALLOW
#undef ALLOW1
    const Shape shapes[] = {{"q/k/v/g", 10304, 2048}, {"gate/up", 16384, 2048}, {"down", 2048, 8192},
                            {"o_proj", 2048, 8192}, {"fc (context)", 2048, 10240}, {"k/v (context)", 2048, 2048},
                            {"lm_head", 100352, 2048}};
    const int n = 16;
    printf("%s, %d SMs; y = W x, 16 tokens, bf16 W; us (GB/s of the matrix); ring variants at their best KS\n\n", prop.name, g.nsm);
    printf("| matrix | MB | cuBLAS | gemm_few | S4 x ldg | S8 x ldg | S12 x ldg | S4 x ring | S6 x ring |\n|---|---|---|---|---|---|---|---|---|\n");
    for (const Shape &sh : shapes) {
        const size_t elems = (size_t)sh.out * sh.in, mb = elems * 2;
        const int copies = (int)std::min<size_t>(64, std::max<size_t>(1, (512ull << 20) / mb + 1));
        std::vector<bf16> hw(elems), hx((size_t)n * sh.in);
        for (auto &v : hw) v = __float2bfloat16(0.05f * urand());
        for (auto &v : hx) v = __float2bfloat16(urand());
        bf16 *dw, *dx;
        float *dy;
        CUDA_CHECK(cudaMalloc(&dw, mb * copies));
        for (int c = 0; c < copies; c++) CUDA_CHECK(cudaMemcpy((char *)dw + mb * c, hw.data(), mb, cudaMemcpyHostToDevice));
        CUDA_CHECK(cudaMalloc(&dx, hx.size() * 2));
        CUDA_CHECK(cudaMemcpy(dx, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
        CUDA_CHECK(cudaMalloc(&dy, (size_t)n * sh.out * 4));
        gemm_few_launch(&g, dy, sh.out, DT_BF16, dw, sh.out, sh.in, dx, 1, n, 0.0f);
        CUDA_CHECK(cudaDeviceSynchronize());
        std::vector<float> ref((size_t)n * sh.out);
        CUDA_CHECK(cudaMemcpy(ref.data(), dy, ref.size() * 4, cudaMemcpyDeviceToHost));
        const float one = 1.0f, zero = 0.0f;
        const float t_blas = 1e3f * time_ms([&](int i) {
            CUBLAS_CHECK(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, sh.out, n, sh.in, &one, (const char *)dw + mb * (i % copies),
                                      CUDA_R_16BF, sh.in, dx, CUDA_R_16BF, sh.in, &zero, dy, CUDA_R_32F, sh.out,
                                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        }, 40);
        const float t_few = 1e3f * time_ms([&](int i) {
            gemm_few_launch(&g, dy, sh.out, DT_BF16, (const char *)dw + mb * (i % copies), sh.out, sh.in, dx, 1, n, 0.0f);
        }, 40);
        float t[5];
        int k[5];
        variant<4, false>(sh, n, dw, mb, copies, dx, dy, ref, &t[0], &k[0]);
        variant<8, false>(sh, n, dw, mb, copies, dx, dy, ref, &t[1], &k[1]);
        variant<12, false>(sh, n, dw, mb, copies, dx, dy, ref, &t[2], &k[2]);
        variant<4, true>(sh, n, dw, mb, copies, dx, dy, ref, &t[3], &k[3]);
        variant<6, true>(sh, n, dw, mb, copies, dx, dy, ref, &t[4], &k[4]);
        printf("| %s %d x %d | %.1f | %.1f (%.0f) | %.1f (%.0f) |", sh.name, sh.out, sh.in, mb / 1e6, t_blas,
               mb / (1e3 * t_blas), t_few, mb / (1e3 * t_few));
        for (int i = 0; i < 5; i++) printf(" %.1f (%.0f) KS %d |", t[i], mb / (1e3 * t[i]), k[i]);
        printf("\n");
        fflush(stdout);
        CUDA_CHECK(cudaFree(dw)); CUDA_CHECK(cudaFree(dx)); CUDA_CHECK(cudaFree(dy));
    }
    CUBLAS_CHECK(cublasDestroy(blas));
    printf("\n%s\n", fails ? "FAILED" : "every variant within 1e-3 of gemm_few at every split");
    return fails != 0;
}
