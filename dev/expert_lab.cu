/* dev/expert_lab.cu -- an expert's gate/up and down in one kernel, against laguna.cu's two (make dev/expert_lab &&
 * ./dev/expert_lab).
 *
 * A decode MoE layer runs three kernels in a row: the router (with its top-k in the last block; on bf16 files the
 * shared expert's gate/up rides in its launch), the experts' gate/up (moe_gate_up_cols: 4 units a block, every
 * active expert) and the down projections (moe_down_cols: 4 output rows a block over every expert's columns, the
 * weighted sum and the residual). The down kernel needs every expert's h, so it waits for the whole gate/up grid.
 * This lab weighs the one structural change left on that chain (dev/gpu_notes.md, "For the next session", 29th):
 *   fused  one thread-block cluster of C = 16 blocks a routed expert (and, on q8 / q4 files, a ninth cluster for
 *          the shared expert). Block c streams its 32 units' gate and up rows through registers (x in registers,
 *          NB row groups in flight), and meanwhile cp.async brings its 128 rows of the expert's down matrix into
 *          shared memory. Each h value goes to all 16 blocks' shared memory (distributed shared memory), one cluster
 *          barrier, then each block multiplies its 128 down rows by the whole h from shared memory and writes
 *          w_a * (down . h) as a partial row part[a][j]. bf16: the shared expert's h comes from the router's launch,
 *          as in laguna.cu, and its down rows are spread over the 128 blocks (16 rows each, loaded before the wait).
 *          The next kernel adds the partials: x[j] += sh[j] + scaling * sum_a part[a][j] (ascending a).
 * The cost of that sum falls on the next kernel: its stand-in here (`next`) reads x as the q/k/v/g matvec does
 * (8 values a thread, a block sum of squares), and in the fused chain also the 9 partial rows, block 0 writing x.
 * Rows (one H200; us per layer, a graph of 32 layers replayed 20 times, programmatic dependent launch on every
 * kernel as in the decode graph; experts drawn by the real router from 256 over 16 layers' router weights, so the
 * 8 experts' 6 MB (bf16) come from HBM):
 *   router + next          the part of the chain both variants share
 *   router + gate/up + down + next   laguna.cu's kernels
 *   router + fused + next  the fused kernel
 * Before the rows, the fused chain's x after one layer is compared with laguna.cu's (max |diff| / the MoE output).
 * Measured (H200, 2026-12-03, thirtieth session; dev/gpu_notes.md, round 29): every check within 5.8e-7 of the MoE
 * output; the MoE's part of a layer (the chain less router + next), us, laguna.cu's kernels -> the best fused one:
 * bf16 16.06 -> 22.73 (down via L2; in shared memory 26.29: 128 KB a block leaves one block an SM, and only 7 of the
 * 8 clusters of 16 fit at once), q8 12.63 -> 16.60, q4 12.02 -> 16.02 (down in shared memory). Slower in every format:
 * a block's 8 row groups one after another (NB in flight) take longer than the kernel boundary that the fusion
 * removes, where laguna.cu's gate/up runs each group as its own block, all in flight at once. */
#include "../laguna.cu"
#include "lab_graph.h"

#include <cooperative_groups.h>
#include <vector>
#include <string.h>

static const int H = 2048, I = 512, E = 256, K = 8, S = 512, NL = 16, C = 16;   /* XS-2.1's MoE layers */
static const float SCALING = 2.5f;
static int nsm;

/* a random matrix in format W: bf16 values, or q8 / q4 groups with their scales (fill_random_q, as the loader does) */
template <typename W> static WPtr make_mat(size_t rows, int cols, uint64_t key, float a) {
    if constexpr (!is_q<W>) {
        bf16 *p;
        CUDA_CHECK(cudaMalloc(&p, rows * cols * sizeof(bf16)));
        fill_random<bf16><<<1024, 256>>>(p, rows * cols, 1234, key, 0, a);
        CUDA_CHECK(cudaGetLastError());
        return WPtr(p);
    } else {
        const size_t groups = (cols + LAGUNA_QGROUP - 1) / LAGUNA_QGROUP, ng = rows * groups;
        uint8_t *v;
        uint16_t *s;
        CUDA_CHECK(cudaMalloc(&v, ng * Fmt<W>::GB));
        CUDA_CHECK(cudaMalloc(&s, ng * sizeof(uint16_t)));
        fill_random_q<<<1024, 256>>>(v, s, ng, cols, Fmt<W>::DT, 1234, key, a);
        CUDA_CHECK(cudaGetLastError());
        return WPtr(v, s);
    }
}

/* bytes of a row of `cols` weights of format W: its values, and its scales */
template <typename W> __host__ __device__ constexpr int row_vals(int cols) { return is_q<W> ? cols / LAGUNA_QGROUP * Fmt<W>::GB : cols * 2; }
template <typename W> __host__ __device__ constexpr int row_scales(int cols) { return is_q<W> ? cols / LAGUNA_QGROUP * 2 : 0; }

/* a Cols8 unit (8 weights from column k of row r) out of shared memory holding rows of `cols` weights */
template <typename W, int COLS>
__device__ __forceinline__ typename Cols8<W>::T smem_load8(const char *vals, const uint16_t *scales, int r, int k) {
    typename Cols8<W>::T c;
    const char *p = vals + (size_t)r * row_vals<W>(COLS) + (size_t)k * row_vals<W>(COLS) / COLS;
    if constexpr (!is_q<W>) c.a = *(const uint4 *)p;   /* bf16: W8's first half */
    else {
        if constexpr (Fmt<W>::DT == DT_Q8) c.v = *(const uint2 *)p;
        else c.v = *(const uint32_t *)p;
        c.s = scales[r * (COLS / LAGUNA_QGROUP) + k / LAGUNA_QGROUP];
    }
    return c;
}

/* acc[j] += c[j] . x8 for bf16 (floats) or q8 / q4 (x as integers) */
template <typename W, int R>
__device__ __forceinline__ void unit_dot(const typename Cols8<W>::T *c, const float x8[8], const XQ8 &xq, float *acc) {
    if constexpr (!is_q<W>) chunk_dot<W, R>(c, 8, [&](int, float f[8]) { for (int i = 0; i < 8; i++) f[i] = x8[i]; }, acc);
    else cols8_dot<W, R>(c, xq, acc);
}

/* The fused kernel. grid (C, slots), clusters of C along x; slot a < K: the a-th active expert; slot K (SHARED_OWN):
 * the shared expert with its own gate/up. bf16 (!SHARED_OWN): hs from the router; block (a, c) also owns shared-down
 * rows [16 (a C + c), + 16). R units a row group, NB groups in flight. Dynamic shared memory: the down slice. */
template <typename W, int R, int NB, bool SHARED_OWN, bool DL2>
__global__ void __launch_bounds__(256, DL2 ? 2 : 1) moe_fused(WPtr egu, WPtr edn, WPtr sgu, WPtr sdn, const float *xb,
                                                    const uint4 *xq_in, const float *hs_in, const int *active,
                                                    const float *pair_w, float *part) {
    namespace cg = cooperative_groups;
    constexpr int U = I / C, J = H / C, NG = U / R, JS = H / (K * C);   /* units, down rows, groups; shared rows */
    static_assert(H == 256 * 8 && U % R == 0 && J == 128 && I == 512, "the lab's shapes");
    typedef typename Cols8<W>::T T8;
    extern __shared__ __align__(16) char dsm[];    /* J rows of down: values, then scales */
    __shared__ __align__(16) float h_all[I];
    __shared__ float red[2][8][2 * R];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, c = blockIdx.x, a = blockIdx.y, k = tid * 8;
    const bool shared_slot = SHARED_OWN && a == K;
    cluster_arrive_relaxed();                      /* phase 0: this block's shared memory exists */
    T8 buf[NB][2 * R];
    WPtr gu, dn;
    size_t gu0 = 0, dn0 = 0;                       /* the expert's first gate row / first down row of this block */
    auto load_group = [&](T8 (&b)[2 * R], int g) {
#pragma unroll
        for (int j = 0; j < R; j++) {
            const size_t u = (size_t)c * U + g * R + j;
            b[j] = load8<W>(wrow<W>(gu, gu0 + u, H), k);
            b[R + j] = load8<W>(wrow<W>(gu, gu0 + I + u, H), k);
        }
    };
    auto copy_down = [&]() {                       /* this block's J rows of the expert's down matrix, cp.async */
        const char *v = (const char *)wrow<W>(dn, dn0, I).v;
        if constexpr (DL2) {                       /* or only asked of L2, read from there after the exchange */
            for (int o = tid * 128; o < J * row_vals<W>(I); o += 256 * 128)
                asm volatile("prefetch.global.L2 [%0];" ::"l"(v + o));
            if constexpr (is_q<W>) {
                const char *s = (const char *)wrow<W>(dn, dn0, I).s;
                for (int o = tid * 128; o < J * row_scales<W>(I); o += 256 * 128)
                    asm volatile("prefetch.global.L2 [%0];" ::"l"(s + o));
            }
        } else {
            for (int o = tid * 16; o < J * row_vals<W>(I); o += 256 * 16) cp_async16(dsm + o, v + o, true);
            if constexpr (is_q<W>) {
                const char *s = (const char *)wrow<W>(dn, dn0, I).s;
                for (int o = tid * 16; o < J * row_scales<W>(I); o += 256 * 16)
                    cp_async16(dsm + J * row_vals<W>(I) + o, s + o, true);
            }
            asm volatile("cp.async.commit_group;" ::: "memory");
        }
    };
    /* bf16: the shared expert's down rows of this block, before the wait (they don't depend on the router): warp w
     * rows s_row0 + 2 w + i (i < 2), lane's chunks lane and lane + 32 */
    T8 sc[2][2];
    const int s_row0 = (a * C + c) * JS;
    if constexpr (!SHARED_OWN)
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int h = 0; h < 2; h++) sc[i][h] = load8<W>(wrow<W>(sdn, s_row0 + 2 * warp + i, I), (lane + 32 * h) * 8);
    if (shared_slot) {                             /* known weights: the first groups and the down slice now */
        gu = sgu; dn = sdn; dn0 = (size_t)c * J;
        copy_down();
#pragma unroll
        for (int g = 0; g < NB - 1; g++) load_group(buf[g], g);
    }
    griddep_wait();                                /* the router's plan, xb / xq and hs */
    griddep_launch();
    if (!shared_slot) {
        const int e = active[a];
        gu = egu; gu0 = (size_t)e * 2 * I; dn = edn; dn0 = (size_t)e * H + (size_t)c * J;
        copy_down();
#pragma unroll
        for (int g = 0; g < NB - 1; g++) load_group(buf[g], g);
    }
    float xv[8];
    XQ8 xq = {};
    if constexpr (is_q<W>) xq = load_xq<W>(xq_in + 3 * tid);
    else load_x8(xb + k, xv);
    cluster_wait_acquire();                        /* phase 0 done: every block of the cluster is running */
#pragma unroll
    for (int g = 0; g < NG; g++) {                 /* gate/up: group g's dots while groups g+1 .. g+NB-1 load */
        if (g + NB - 1 < NG) load_group(buf[(g + NB - 1) % NB], g + NB - 1);
        float acc[2 * R] = {};
        unit_dot<W, 2 * R>(buf[g % NB], xv, xq, acc);
        float v = warp_reduce_rows<2 * R>(acc, lane);
        if (lane % (32 / (2 * R)) == 0) red[g & 1][warp][lane / (32 / (2 * R))] = v;
        __syncthreads();
        if (tid < R * C) {                         /* unit j's h to block r of the cluster */
            const int j = tid % R, r = tid / R;
            float gs = 0.0f, us = 0.0f;
            for (int w = 0; w < 8; w++) { gs += red[g & 1][w][j]; us += red[g & 1][w][R + j]; }
            cg::this_cluster().map_shared_rank(h_all, r)[c * U + g * R + j] = silu(gs) * us;
        }
    }
    cluster_arrive_release();                      /* phase 1: every h value is written */
    /* bf16: the shared expert's rows meanwhile (hs is the router's) */
    if constexpr (!SHARED_OWN) {
        static_assert(JS == 16, "2 shared rows a warp");
        float h8[2][8], acc[2] = {};
        XQ8 hq[2] = {};
#pragma unroll
        for (int h = 0; h < 2; h++) {
            load_x8(hs_in + (lane + 32 * h) * 8, h8[h]);
            if constexpr (is_q<W>) hq[h] = quant_x8<W>(h8[h]);
        }
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int h = 0; h < 2; h++) unit_dot<W, 1>(&sc[i][h], h8[h], hq[h], &acc[i]);
        const float v = warp_reduce_rows<2>(acc, lane);   /* lane: row 2 warp + lane / 16 */
        if (lane % 16 == 0) part[(size_t)K * H + s_row0 + 2 * warp + lane / 16] = v;
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    cluster_wait_acquire();
    __syncthreads();                               /* the down slice of every thread has landed */
    /* down: warp w owns rows 16 w .. 16 w + 15 of the slice, lane its chunks lane and lane + 32 (I = 512) */
    float h8[2][8];
    XQ8 hq[2] = {};
#pragma unroll
    for (int h = 0; h < 2; h++) {
        load_x8(h_all + (lane + 32 * h) * 8, h8[h]);
        if constexpr (is_q<W>) hq[h] = quant_x8<W>(h8[h]);
    }
    const char *vals = dsm;
    const uint16_t *scales = (const uint16_t *)(dsm + J * row_vals<W>(I));
    float acc[2][8];                               /* rows 16 warp + 8 b + i (two halves: warp_reduce_rows<16>'s
                                                      selects went to local memory) */
#pragma unroll
    for (int b = 0; b < 2; b++)
#pragma unroll
        for (int i = 0; i < 8; i++) {
            acc[b][i] = 0.0f;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int row = 16 * warp + 8 * b + i, col = (lane + 32 * h) * 8;
                T8 u = DL2 ? load8<W>(wrow<W>(dn, dn0 + row, I), col) : smem_load8<W, I>(vals, scales, row, col);
                unit_dot<W, 1>(&u, h8[h], hq[h], &acc[b][i]);
            }
        }
    const float wa = shared_slot ? 1.0f : pair_w[a];
#pragma unroll
    for (int b = 0; b < 2; b++) {
        const float v = warp_reduce_rows<8>(acc[b], lane);   /* lane: row 16 warp + 8 b + lane / 4 */
        if (lane % 4 == 0) part[(size_t)a * H + (size_t)c * J + 16 * warp + 8 * b + lane / 4] = wa * v;
    }
}

/* The next kernel's stand-in: x read as q/k/v/g's matvec reads it (8 values a thread, a block sum of squares).
 * SUM: x is first completed from the partials (x + sh + scaling * sum_a part[a], a ascending), block 0 writing it.
 * (Other blocks may then read block 0's x: only their stand-in sums, which nothing uses, change; a real next kernel
 * would write the completed x to a second buffer.) */
template <bool SUM>
__global__ void __launch_bounds__(256) next_kernel(float *x, const float *part, float *out) {
    const int k = threadIdx.x * 8;
    griddep_wait();
    griddep_launch();
    float xv[8];
    load_x8(x + k, xv);
    if constexpr (SUM) {
        float p[K + 1][8];
#pragma unroll
        for (int a = 0; a <= K; a++) load_x8(part + (size_t)a * H + k, p[a]);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float routed = 0.0f;
#pragma unroll
            for (int a = 0; a < K; a++) routed += p[a][i];
            xv[i] += p[K][i] + routed * SCALING;
        }
        if (blockIdx.x == 0) store8(x + k, xv);
    }
    const float s = block_sum(dot8(xv, xv));
    if (threadIdx.x == 0) out[blockIdx.x] = s;
}

struct Bufs {
    WPtr egu, edn, router[NL], sgu[NL], sdn[NL];
    float *norm[NL], *bias[NL];
    float *x, *xb, *logits, *pair_w, *h_pair, *hs, *part, *out;
    int *start, *pair_tok, *active, *n_active, *counter;
    uint4 *xq, *hq;
};

static void launch_ex(const void *fn, void **args, dim3 grid, size_t smem, int cluster, cudaStream_t st) {
    cudaLaunchAttribute attr[2];
    int na = 0;
    attr[na].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[na++].val.programmaticStreamSerializationAllowed = 1;
    if (cluster) {
        attr[na].id = cudaLaunchAttributeClusterDimension;
        attr[na].val.clusterDim.x = cluster;
        attr[na].val.clusterDim.y = 1;
        attr[na++].val.clusterDim.z = 1;
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(256);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cfg.attrs = attr;
    cfg.numAttrs = na;
    CUDA_CHECK(cudaLaunchKernelExC(&cfg, fn, args));
}

/* kinds of chain */
enum { CH_BASE, CH_TWO, CH_FUSED };

template <typename W, int R, int NB, bool DL2>
static void enqueue_layer(Bufs &b, int kind, int l, cudaStream_t st) {
    const bool sh_router = !is_q<W>;
    const int nbr = E / 2, shb = sh_router ? S / 4 : 0;
    {   /* the router (laguna.cu's router_decode; bf16: the shared expert's gate/up in its launch) */
        float eps = 1e-6f, softcap = 0.0f;
        int e_ = E, h_ = H, k_ = K, s_ = S, nbr_ = nbr;
        uint4 *xq = is_q<W> ? b.xq : NULL;
        void *args[] = {&b.logits, &b.router[l], &e_, &h_, &b.x, &b.norm[l], &eps, &b.xb, &b.bias[l], &k_, &softcap,
                        &b.start, &b.pair_tok, &b.pair_w, &b.active, &b.n_active, &b.counter, &b.sgu[l], &s_, &b.hs,
                        &nbr_, &xq};
        const void *fn = sh_router ? (const void *)router_decode<bf16, 1, true, W> : (const void *)router_decode<bf16, 1, false, W>;
        launch_ex(fn, args, dim3(nbr + shb), 0, 0, st);
    }
    if (kind == CH_TWO) {
        int i_ = I, hid = sh_router ? 0 : S, h_ = H;
        uint4 *hq = is_q<W> ? b.hq : NULL;
        const uint4 *xq = is_q<W> ? b.xq : NULL;
        void *gargs[] = {&b.egu, &i_, &b.sgu[l], &hid, &h_, &b.xb, &b.active, &b.n_active, &b.h_pair, &b.hs, &xq, &hq};
        launch_ex((const void *)moe_gate_up_cols<W, 4>, gargs, dim3(hid / 4 + K * (I / 4)), 0, 0, st);
        int s_ = S;
        float sc = SCALING;
        const uint4 *hqc = hq;
        void *dargs[] = {&b.x, &b.edn, &i_, &b.sdn[l], &s_, &h_, &b.active, &b.n_active, &b.pair_w, &b.h_pair, &b.hs,
                         &hqc, &sc};
        launch_ex(is_q<W> ? (const void *)moe_down_cols<W, 4, 3, is_q<W>> : (const void *)moe_down_cols<W, 4, 3, false>,
                  dargs, dim3(H / 4), 0, 0, st);
    }
    if (kind == CH_FUSED) {
        const uint4 *xq = b.xq;
        const float *hs = b.hs;
        void *args[] = {&b.egu, &b.edn, &b.sgu[l], &b.sdn[l], &b.xb, &xq, &hs, &b.active, &b.pair_w, &b.part};
        const size_t smem = DL2 ? 0 : (size_t)(H / C) * (row_vals<W>(I) + row_scales<W>(I));
        launch_ex(sh_router ? (const void *)moe_fused<W, R, NB, false, DL2> : (const void *)moe_fused<W, R, NB, true, DL2>, args,
                  dim3(C, sh_router ? K : K + 1), smem, C, st);
    }
    void *nargs[] = {&b.x, &b.part, &b.out};
    launch_ex(kind == CH_FUSED ? (const void *)next_kernel<true> : (const void *)next_kernel<false>, nargs, dim3(2 * nsm),
              0, 0, st);
}

template <typename W, int R, int NB, bool DL2>
static double time_kind(Bufs &b, int kind, cudaStream_t st) {
    const int N = 32, REP = 20;
    cudaGraph_t graph;
    CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < N; i++) enqueue_layer<W, R, NB, DL2>(b, kind, i % NL, st);
    CUDA_CHECK(cudaStreamEndCapture(st, &graph));
    return graph_us(graph, st, N, REP);
}

template <typename W, int R, int NB, bool DL2>
static void run(const char *name) {
    Bufs b;
    const float wa = 0.03f;
    b.egu = make_mat<W>((size_t)E * 2 * I, H, 1, wa);
    b.edn = make_mat<W>((size_t)E * H, I, 2, wa);
    for (int l = 0; l < NL; l++) {
        b.router[l] = make_mat<bf16>(E, H, 100 + l, wa);
        b.sgu[l] = make_mat<W>(2 * S, H, 200 + l, wa);
        b.sdn[l] = make_mat<W>(H, S, 300 + l, wa);
        CUDA_CHECK(cudaMalloc(&b.norm[l], H * sizeof(float)));
        CUDA_CHECK(cudaMalloc(&b.bias[l], E * sizeof(float)));
        fill_random<float><<<8, 256>>>(b.norm[l], H, 1234, 400 + l, 0, 1.0f);
        fill_random<float><<<8, 256>>>(b.bias[l], E, 1234, 500 + l, 0, 0.01f);
    }
    CUDA_CHECK(cudaMalloc(&b.x, H * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&b.xb, H * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&b.logits, E * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&b.pair_w, K * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&b.h_pair, K * I * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&b.hs, S * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&b.part, (K + 1) * H * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&b.out, 4 * nsm * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&b.start, (E + 1) * sizeof(int)));
    CUDA_CHECK(cudaMalloc(&b.pair_tok, K * sizeof(int)));
    CUDA_CHECK(cudaMalloc(&b.active, K * sizeof(int)));
    CUDA_CHECK(cudaMalloc(&b.n_active, sizeof(int)));
    CUDA_CHECK(cudaMalloc(&b.counter, 4 * sizeof(int)));
    CUDA_CHECK(cudaMemset(b.counter, 0, 4 * sizeof(int)));
    CUDA_CHECK(cudaMalloc(&b.xq, 3 * 256 * sizeof(uint4)));
    CUDA_CHECK(cudaMalloc(&b.hq, (S + K * I) / 4 * sizeof(uint4)));
    const size_t smem = DL2 ? 0 : (size_t)(H / C) * (row_vals<W>(I) + row_scales<W>(I));
    const void *fused = !is_q<W> ? (const void *)moe_fused<W, R, NB, false, DL2> : (const void *)moe_fused<W, R, NB, true, DL2>;
    CUDA_CHECK(cudaFuncSetAttribute(fused, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    CUDA_CHECK(cudaFuncSetAttribute(fused, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    {   /* how many clusters of C can run at once: fewer than the grid's and some wait for others to finish */
        cudaLaunchAttribute attr;
        attr.id = cudaLaunchAttributeClusterDimension;
        attr.val.clusterDim.x = C; attr.val.clusterDim.y = 1; attr.val.clusterDim.z = 1;
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(C, is_q<W> ? K + 1 : K);
        cfg.blockDim = dim3(256);
        cfg.dynamicSmemBytes = smem;
        cfg.attrs = &attr;
        cfg.numAttrs = 1;
        int ncl = 0;
        CUDA_CHECK(cudaOccupancyMaxActiveClusters(&ncl, fused, &cfg));
        cudaFuncAttributes fa;
        CUDA_CHECK(cudaFuncGetAttributes(&fa, fused));
        printf("%s fused R %d NB %d %s: %d registers, %zu + %zu bytes of shared memory; %d clusters of %d at once (the grid: %d)\n",
               name, R, NB, DL2 ? "down via L2" : "down in shared memory", fa.numRegs, fa.sharedSizeBytes, smem, ncl, C,
               is_q<W> ? K + 1 : K);
    }
    cudaStream_t st;
    CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    CUDA_CHECK(cudaDeviceSynchronize());

    /* the check: x after one layer, laguna.cu's kernels against the fused one, from the same x */
    std::vector<float> x0(H), xa(H), xf(H);
    for (int i = 0; i < H; i++) x0[i] = (float)((i * 2654435761u) % 2001) / 1000.0f - 1.0f;
    double worst = 0;
    for (int l = 0; l < 3; l++) {
        CUDA_CHECK(cudaMemcpy(b.x, x0.data(), H * sizeof(float), cudaMemcpyHostToDevice));
        enqueue_layer<W, R, NB, DL2>(b, CH_TWO, l, st);
        CUDA_CHECK(cudaStreamSynchronize(st));
        CUDA_CHECK(cudaMemcpy(xa.data(), b.x, H * sizeof(float), cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaMemcpy(b.x, x0.data(), H * sizeof(float), cudaMemcpyHostToDevice));
        enqueue_layer<W, R, NB, DL2>(b, CH_FUSED, l, st);
        CUDA_CHECK(cudaStreamSynchronize(st));
        CUDA_CHECK(cudaMemcpy(xf.data(), b.x, H * sizeof(float), cudaMemcpyDeviceToHost));
        double d = 0, m = 0, dm = 0;
        for (int i = 0; i < H; i++) {
            d = fmax(d, fabs(xa[i] - xf[i]));
            m = fmax(m, fabs(xa[i]));
            dm = fmax(dm, fabs(xa[i] - x0[i]));
        }
        printf("%s check, layer %d: max |x_fused - x_two| %.3g (max |x| %.3f, max |moe out| %.3f) -> %.3g of the out\n",
               name, l, d, m, dm, d / dm);
        worst = fmax(worst, d / dm);
    }
    printf("%s check: %s (worst %.3g of the MoE output, bar 1e-4)\n", name, worst < 1e-4 ? "ok" : "FAILED", worst);
    CUDA_CHECK(cudaMemcpy(b.x, x0.data(), H * sizeof(float), cudaMemcpyHostToDevice));

    double t[3][3];
    for (int rep = 0; rep < 3; rep++)
        for (int kind = 0; kind < 3; kind++) t[rep][kind] = time_kind<W, R, NB, DL2>(b, kind, st);
    const char *names[] = {"router + next", "router + gate/up + down + next (laguna.cu)", "router + fused + next"};
    const double mb = (K + 1) * 3.0 * I * H * (is_q<W> ? (Fmt<W>::GB + 2.0) / LAGUNA_QGROUP : 2.0) / 1e6;
    for (int kind = 0; kind < 3; kind++) {
        printf("| %s | %s | R %d NB %d %s |", name, names[kind], R, NB, DL2 ? "L2" : "smem");
        for (int rep = 0; rep < 3; rep++) printf(" %.2f", t[rep][kind]);
        double best = fmin(t[0][kind], fmin(t[1][kind], t[2][kind])), base = fmin(t[0][0], fmin(t[1][0], t[2][0]));
        if (kind) printf(" | MoE %.2f us (%.0f GB/s over %.1f MB) |\n", best - base, mb * 1e3 / (best - base), mb);
        else printf(" | |\n");
    }
    fflush(stdout);
    CUDA_CHECK(cudaStreamDestroy(st));
    /* (the lab's buffers are left to the process's exit) */
}

int main(int argc, char **argv) {
    cudaDeviceProp p;
    CUDA_CHECK(cudaGetDeviceProperties(&p, 0));
    nsm = p.multiProcessorCount;
    const char *only = argc > 1 ? argv[1] : "all";
    printf("expert_lab: %s, %d SMs; us per layer (32 layers a graph, 20 replays), three samples\n\n", p.name, nsm);
    printf("| format | chain | fused's groups | us per layer | |\n|---|---|---|---|---|\n");
    if (!strcmp(only, "all") || !strcmp(only, "bf16")) {
        run<bf16, 4, 2, false>("bf16"); run<bf16, 4, 3, false>("bf16"); run<bf16, 4, 2, true>("bf16");
    }
    if (!strcmp(only, "all") || !strcmp(only, "q8")) { run<Q8, 4, 3, false>("q8"); run<Q8, 4, 3, true>("q8"); }
    if (!strcmp(only, "all") || !strcmp(only, "q4")) { run<Q4, 4, 4, false>("q4"); run<Q4, 4, 4, true>("q4"); }
    return 0;
}
