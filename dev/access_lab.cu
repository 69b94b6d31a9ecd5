/* dev/access_lab.cu -- does the few-token expert kernels' access shape cost bandwidth? (make dev/access_lab &&
 * ./dev/access_lab)
 *
 * moe_gate_up_few streams ~3.1-3.2 TB/s at 16 tokens (dev/few_lab) whatever its occupancy (dev/gpu_notes.md, round 34),
 * against 4.3 for a plain copy. Its loads have an unusual shape: lane (g, t) of a warp reads 16 bytes of row g at
 * k = 32 c + 8 t, so one load instruction covers 8 rows 64 bytes each, and the lane also loads 16 bytes of a token for
 * every 16 bytes of weight (from L1 / L2). This lab reads the same bytes, with the same grid as the kernel (99 experts'
 * gate/up of XS-2.1, 4 MB each; a block 64 units = 128 rows of 4 KB; a warp 8 units = 16 rows), without the math:
 *   few      the kernel's shape: per chunk a lane loads rows g and g + 8 at 8 t (U chunks in flight)
 *   few+x    the same, plus the two token loads (16 tokens: x0 / x1 of a 64 KB buffer) the kernel makes per chunk
 *   row512   lanes along K: one instruction is 512 contiguous bytes of one row (2 U instructions in flight, the
 *            same bytes in flight as `few`)
 *   row128   8 lanes a row: one instruction is 4 rows 128 bytes each
 *   flat     the same 396 MB read linearly by the same grid (a block's 512 KB contiguous, 16 bytes a lane a load)
 * each at 2, 3, 4 and 8 blocks an SM (a grid of that many blocks an SM, each taking work items b, b + grid, ...,
 * the kernel's blocks; so the L1 is the kernel's, not cut by shared memory) and U 2 / 4. TB/s = bytes / time, the
 * median of 15 calls, each over a different set of 99 of 256 experts (1 GB), so L2 holds little of it. If `few` is
 * near `flat`, the access shape is not what holds the kernel back (its arithmetic and dependences are); if `row512` /
 * `flat` are well above `few`, a layout with contiguous row loads (and a reshuffle to the mma fragments) is worth it.
 * Then the kernel itself (mma_kernel: few_rows' loads and mma steps on the same grid) on row-major rows and on rows
 * interleaved by 8-row groups, so that its loads are 512 contiguous bytes a warp with no reshuffle at all; then
 * row-major with padded rows, and the model's grid shape (a block an item) against a persistent one.
 * Measured (H200, 2026-12-04; dev/gpu_notes.md rounds 35-36): flat 4.1-4.3 TB/s, few 2.8-2.9, row512 4.0-4.2; the mma
 * kernel row-major 3.7-3.8 at 2 blocks an SM, interleaved 4.1-4.2; padding and the grid's shape change nothing. */
#include "../laguna.cu"

#include <algorithm>
#include <vector>

static const int E = 256, I = 512, H = 2048, NACT = 99;        /* XS-2.1's experts; 99 active at 16 tokens */
static const size_t EXPERT_BYTES = (size_t)2 * I * H * 2;       /* gate and up rows, bf16: 4 MB */

enum { FEW = 0, FEW_X = 1, ROW512 = 2, ROW128 = 3, FLAT = 4 };
static const char *names[] = {"few", "few+x", "row512", "row128", "flat"};

/* a block: expert active[b / 8], units (b % 8) * 64 .. + 63; warp w: units j0 = that + 8 w .. + 7, its rows the 8 gate
 * rows j0 .. j0 + 7 and the 8 up rows I + j0 .. (as moe_gate_up_few's) */
template <int P, int U>
__global__ void __launch_bounds__(256) access_kernel(const uint8_t *w, const int *active, const bf16 *x, uint32_t *sink) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    uint32_t acc = 0;
    for (int b = blockIdx.x; b < NACT * 8; b += gridDim.x) {
        const int j0 = (b % 8) * 64 + warp * 8;
        const uint8_t *ex = w + (size_t)active[b / 8] * EXPERT_BYTES;
        if (P == FEW || P == FEW_X) {
            const uint8_t *w0 = ex + (size_t)(j0 + g) * H * 2, *w1 = ex + (size_t)(I + j0 + g) * H * 2;
            const bf16 *x0 = x + (size_t)g * H, *x1 = x + (size_t)(g + 8) * H;
            for (int c = 0; c < H / 32; c += U) {
                uint4 a[U], bb[U], xa[U], xb[U];
#pragma unroll
                for (int u = 0; u < U; u++) {
                    const int k = (c + u) * 32 + 8 * t;
                    a[u] = ld_stream(w0 + 2 * k);
                    bb[u] = ld_stream(w1 + 2 * k);
                    if (P == FEW_X) { xa[u] = __ldg((const uint4 *)(x0 + k)); xb[u] = __ldg((const uint4 *)(x1 + k)); }
                }
#pragma unroll
                for (int u = 0; u < U; u++) {
                    acc ^= a[u].x ^ a[u].y ^ a[u].z ^ a[u].w ^ bb[u].x ^ bb[u].y ^ bb[u].z ^ bb[u].w;
                    if (P == FEW_X) acc += xa[u].x ^ xa[u].w ^ xb[u].y ^ xb[u].z;
                }
            }
        } else if (P == ROW512 || P == ROW128) {
            /* ROW512: load i of a piece is row i (16 rows), 512 bytes at k-piece p; ROW128: rows 4 i + lane / 8 */
            const int per = P == ROW512 ? 32 : 8, rows_at_once = 32 / per, piece = per * 16;   /* bytes a row a load */
            const int nload = 16 / rows_at_once * (H * 2 / piece);     /* loads a warp makes: 128 either way */
            for (int i0 = 0; i0 < nload; i0 += 2 * U) {
                uint4 v[2 * U];
#pragma unroll
                for (int u = 0; u < 2 * U; u++) {
                    const int i = i0 + u, rg = i % (16 / rows_at_once), p = i / (16 / rows_at_once);
                    const int r = rg * rows_at_once + lane / per;      /* 0..15: gate rows 0..7, up rows 8..15 */
                    const size_t row = r < 8 ? j0 + r : I + j0 + r - 8;
                    v[u] = ld_stream(ex + row * H * 2 + (size_t)p * piece + (lane % per) * 16);
                }
#pragma unroll
                for (int u = 0; u < 2 * U; u++) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
            }
        } else {                                                    /* FLAT: the block's 512 KB share, read linearly */
            const uint8_t *base = ex + (size_t)(b % 8) * (EXPERT_BYTES / 8);
            for (int i0 = 0; i0 < (int)(EXPERT_BYTES / 8 / 16 / 256); i0 += 2 * U) {
                uint4 v[2 * U];
#pragma unroll
                for (int u = 0; u < 2 * U; u++) v[u] = ld_stream(base + ((size_t)(i0 + u) * 256 + threadIdx.x) * 16);
#pragma unroll
                for (int u = 0; u < 2 * U; u++) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
            }
        }
    }
    if (acc == 0x9e3779b9u) sink[blockIdx.x] = acc;             /* never, but the loads can't be dropped */
}

/* The kernel itself, both layouts: moe_gate_up_few's few_rows (HALVES 1 for 2 tokens an expert, the verify's usual
 * count; 2 for 16), reading either the file's row-major rows or the same rows interleaved by 8-row groups (IL 1: group
 * q's 8 rows as [32-k chunk c][row g][64 bytes], so the 32 lanes' 16-byte loads of a chunk are 512 contiguous bytes).
 * Out: the lanes' sums (the two layouts' must be bit-equal: the same products in the same order). */
__device__ __forceinline__ const uint8_t *il_row(const uint8_t *ex, size_t r, int il, size_t ld) {   /* (row r, k 0) */
    return il ? ex + r / 8 * 8 * H * 2 + r % 8 * 64 : ex + r * ld;
}
template <int IL, int HALVES, int U, int OCC = 1>   /* OCC: the blocks an SM the registers must allow */
__global__ void __launch_bounds__(256, OCC) mma_kernel(const uint8_t *w, const int *active, const bf16 *x, float *out,
                                                  size_t ld, int nitems) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    for (int b = blockIdx.x; b < nitems; b += gridDim.x) {
        const int j0 = (b % 8) * 64 + warp * 8, cnt = HALVES == 2 ? 16 : 2;
        const uint8_t *ex = w + (size_t)active[b / 8 % NACT] * 2 * I * ld;   /* items past NACT * 8: again */
        const uint8_t *w0 = il_row(ex, j0 + g, IL, ld), *w1 = il_row(ex, I + j0 + g, IL, ld);
        const bf16 *x0 = x + (size_t)min(g, cnt - 1) * H, *x1 = x + (size_t)min(g + 8, cnt - 1) * H;
        float acc[2][4] = {};
        for (int c = 0; c < H / 32; c += U) {
            uint4 la[U], lb[U], xv[U][2];
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int k = (c + u) * 32 + 8 * t;
                const size_t off = IL ? (size_t)(c + u) * 512 + 16 * t : 2 * (size_t)k;
                la[u] = ld_stream(w0 + off);
                lb[u] = ld_stream(w1 + off);
                xv[u][0] = few_x8(x0 + k);
                if (HALVES == 2) xv[u][1] = few_x8(x1 + k);
            }
#pragma unroll
            for (int u = 0; u < U; u++)
#pragma unroll
                for (int s2 = 0; s2 < 2; s2++) {
                    const uint4 wa = la[u], wb = lb[u];
                    const uint32_t a[4] = {s2 ? wa.z : wa.x, s2 ? wb.z : wb.x, s2 ? wa.w : wa.y, s2 ? wb.w : wb.y};
#pragma unroll
                    for (int h = 0; h < HALVES; h++)
                        mma_bf16(acc[h], a, s2 ? xv[u][h].z : xv[u][h].x, s2 ? xv[u][h].w : xv[u][h].y);
                }
        }
        float *o = out + ((size_t)(b % (NACT * 8)) * 256 + threadIdx.x) * 8;
#pragma unroll
        for (int i = 0; i < 8; i++) o[i] = acc[i / 4][i % 4];
    }
}

/* dst = src with every 8-row group of every expert interleaved as mma_kernel's IL 1 reads it (a thread a 16 bytes) */
__global__ void interleave(const uint8_t *src, uint8_t *dst, size_t n16) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += (size_t)gridDim.x * blockDim.x) {
        const size_t row = i / (H * 2 / 16), ch = i % (H * 2 / 16);          /* 16-byte chunk ch of row `row` */
        const size_t q = row / 8, g = row % 8, c = ch / 4, t = ch % 4;
        ((uint4 *)dst)[q * 8 * (H * 2 / 16) + c * 32 + g * 4 + t] = ((const uint4 *)src)[i];
    }
}

/* TB/s of `bytes` read by launch(rep) (rep 0..15, each a launch; the first a warm-up): the median of 15 */
template <typename F> static double median_tbps(double bytes, F launch) {
    cudaEvent_t e0, e1;
    CUDA_CHECK(cudaEventCreate(&e0));
    CUDA_CHECK(cudaEventCreate(&e1));
    std::vector<float> ms;
    for (int rep = 0; rep < 16; rep++) {
        CUDA_CHECK(cudaEventRecord(e0));
        launch(rep);
        LAUNCH_CHECK();
        CUDA_CHECK(cudaEventRecord(e1));
        CUDA_CHECK(cudaEventSynchronize(e1));
        float t;
        CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
        if (rep) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    CUDA_CHECK(cudaEventDestroy(e0));
    CUDA_CHECK(cudaEventDestroy(e1));
    return bytes / (ms[ms.size() / 2] * 1e-3) / 1e12;
}

template <int IL, int HALVES, int U, int occ>
static double run_mma(const uint8_t *w, const std::vector<int *> &sets, const bf16 *x, float *out, int nsm,
                      size_t ld = H * 2, int nitems = NACT * 8, bool one_shot = false) {
    auto k = mma_kernel<IL, HALVES, U, occ>;
    int fit = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, k, 256, 0));
    if (fit < occ) return 0.0;                                  /* printed as 0.00: does not fit */
    return median_tbps((double)nitems * (EXPERT_BYTES / 8), [&](int rep) {
        k<<<one_shot ? nitems : std::min(nitems, occ * nsm), 256>>>(w, sets[rep % sets.size()], x, out, ld, nitems);
    });
}

template <int HALVES>
static void mma_row(const uint8_t *w, const uint8_t *wil, const std::vector<int *> &sets, const bf16 *x, float *out,
                    int nsm, int *fails) {
    const size_t n = (size_t)NACT * 8 * 256 * 8;
    std::vector<float> a(n), b(n);
    mma_kernel<0, HALVES, 4><<<NACT * 8, 256>>>(w, sets[0], x, out, H * 2, NACT * 8);
    LAUNCH_CHECK();
    CUDA_CHECK(cudaMemcpy(a.data(), out, n * 4, cudaMemcpyDeviceToHost));
    mma_kernel<1, HALVES, 4><<<NACT * 8, 256>>>(wil, sets[0], x, out, H * 2, NACT * 8);
    LAUNCH_CHECK();
    CUDA_CHECK(cudaMemcpy(b.data(), out, n * 4, cudaMemcpyDeviceToHost));
    const int same = !memcmp(a.data(), b.data(), n * 4);
    if (!same) ++*fails;
    for (int il = 0; il < 2; il++) {
        printf("  mma %s %2d tok", il ? "interleaved" : "row-major  ", HALVES == 2 ? 16 : 2);
        const uint8_t *src = il ? wil : w;
        auto occ_row = [&](auto occ) {
            constexpr int O = decltype(occ)::value;
            printf("  %d/SM: U2 %.2f U4 %.2f U8 %.2f", O,
                   il ? run_mma<1, HALVES, 2, O>(src, sets, x, out, nsm) : run_mma<0, HALVES, 2, O>(src, sets, x, out, nsm),
                   il ? run_mma<1, HALVES, 4, O>(src, sets, x, out, nsm) : run_mma<0, HALVES, 4, O>(src, sets, x, out, nsm),
                   il ? run_mma<1, HALVES, 8, O>(src, sets, x, out, nsm) : run_mma<0, HALVES, 8, O>(src, sets, x, out, nsm));
            fflush(stdout);
        };
        occ_row(IntC<2>());
        occ_row(IntC<3>());
        occ_row(IntC<4>());
        printf("%s\n", il ? (same ? "  (sums bit-equal to row-major's)" : "  SUMS DIFFER from row-major's") : "");
    }
}

template <int P, int U>
static double run(const uint8_t *w, const std::vector<int *> &sets, const bf16 *x, uint32_t *sink, int occ, int nsm) {
    auto k = access_kernel<P, U>;
    int fit = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, k, 256, 0));
    if (fit < occ) return 0.0;                                  /* printed as 0.00: does not fit */
    return median_tbps((double)NACT * EXPERT_BYTES, [&](int rep) {
        k<<<std::min(NACT * 8, occ * nsm), 256>>>(w, sets[rep % sets.size()], x, sink);
    });
}

template <int P>
static void row(const uint8_t *w, const std::vector<int *> &sets, const bf16 *x, uint32_t *sink, int nsm) {
    printf("  %-7s", names[P]);
    for (int occ : {2, 3, 4, 8}) {
        printf("  %d/SM: U2 %.2f U4 %.2f", occ, run<P, 2>(w, sets, x, sink, occ, nsm), run<P, 4>(w, sets, x, sink, occ, nsm));
        fflush(stdout);
    }
    printf("\n");
}

int main(void) {
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    printf("%s, %d SMs; %d experts' gate/up (%.1f MB), grid %d x 256, TB/s (median of 15):\n", prop.name,
           prop.multiProcessorCount, NACT, NACT * EXPERT_BYTES / 1e6, NACT * 8);
    uint8_t *w;
    CUDA_CHECK(cudaMalloc(&w, E * EXPERT_BYTES));
    CUDA_CHECK(cudaMemset(w, 0x3c, E * EXPERT_BYTES));
    bf16 *x;
    CUDA_CHECK(cudaMalloc(&x, (size_t)16 * H * 2));
    CUDA_CHECK(cudaMemset(x, 0x3c, (size_t)16 * H * 2));
    uint32_t *sink;
    CUDA_CHECK(cudaMalloc(&sink, 16 * 1024 * 4));
    std::vector<int *> sets;                                    /* 16 sets of 99 distinct experts, ascending */
    uint32_t s = 12345;
    for (int r = 0; r < 16; r++) {
        std::vector<int> all(E);
        for (int e = 0; e < E; e++) all[e] = e;
        for (int e = E - 1; e > 0; e--) { s = s * 1664525u + 1013904223u; std::swap(all[e], all[s % (e + 1)]); }
        std::vector<int> pick(all.begin(), all.begin() + NACT);
        std::sort(pick.begin(), pick.end());
        int *d;
        CUDA_CHECK(cudaMalloc(&d, NACT * 4));
        CUDA_CHECK(cudaMemcpy(d, pick.data(), NACT * 4, cudaMemcpyHostToDevice));
        sets.push_back(d);
    }
    const int nsm = prop.multiProcessorCount;
    row<FLAT>(w, sets, x, sink, nsm);
    row<FEW>(w, sets, x, sink, nsm);
    row<FEW_X>(w, sets, x, sink, nsm);
    row<ROW512>(w, sets, x, sink, nsm);
    row<ROW128>(w, sets, x, sink, nsm);
    uint8_t *wil;                                               /* the same experts, 8-row groups interleaved */
    CUDA_CHECK(cudaMalloc(&wil, E * EXPERT_BYTES));
    fill_random<bf16><<<4096, 256>>>((bf16 *)w, E * EXPERT_BYTES / 2, 7, 1, 0, 0.05f);   /* real values: sums to check */
    LAUNCH_CHECK();
    {
        std::vector<bf16> xs((size_t)16 * H);
        for (size_t i = 0; i < xs.size(); i++) xs[i] = __float2bfloat16((float)((i * 2654435761u) % 2001) / 1000.0f - 1.0f);
        CUDA_CHECK(cudaMemcpy(x, xs.data(), xs.size() * 2, cudaMemcpyHostToDevice));
    }
    interleave<<<4096, 256>>>(w, wil, E * EXPERT_BYTES / 16);
    LAUNCH_CHECK();
    float *out;
    CUDA_CHECK(cudaMalloc(&out, (size_t)NACT * 8 * 256 * 8 * 4));
    int fails = 0;
    mma_row<1>(w, wil, sets, x, out, nsm, &fails);
    mma_row<2>(w, wil, sets, x, out, nsm, &fails);
    /* The grid's shape: the model launches a block an item (824 at 16 tokens: 99 experts' 8 and the shared expert's
     * 32, 3.12 waves at 2 an SM), the rows above a persistent grid of 792 items (3 waves exactly). Row-major, the
     * model's U. (Rows padded to 4096 + 64 .. 512 bytes were measured too, 2026-12-04: no change, so the 4 KB stride
     * between a warp's rows is not what costs.) */
    for (int items : {NACT * 8, NACT * 8 + 32})
        for (int one_shot = 0; one_shot < 2; one_shot++)
            printf("  mma row-major, %d items, %s: 2 tok 2/SM U8 %.2f 3/SM U4 %.2f; 16 tok 2/SM U4 %.2f 3/SM U2 %.2f\n",
                   items, one_shot ? "a block an item " : "persistent grid",
                   run_mma<0, 1, 8, 2>(w, sets, x, out, nsm, H * 2, items, one_shot),
                   run_mma<0, 1, 4, 3>(w, sets, x, out, nsm, H * 2, items, one_shot),
                   run_mma<0, 2, 4, 2>(w, sets, x, out, nsm, H * 2, items, one_shot),
                   run_mma<0, 2, 2, 3>(w, sets, x, out, nsm, H * 2, items, one_shot));
    CUDA_CHECK(cudaFree(out));
    for (int *d : sets) CUDA_CHECK(cudaFree(d));
    CUDA_CHECK(cudaFree(w));
    CUDA_CHECK(cudaFree(x));
    CUDA_CHECK(cudaFree(sink));
    printf("%s\n", fails ? "FAILED" : "all checks passed");
    return fails != 0;
}
