/* dev/chain_lab.cu -- what one kernel of a decode-style chain costs (make dev/chain_lab && ./dev/chain_lab).
 *
 * A decode step is ~240 small kernels in a row, each waiting for the previous one (programmatic dependent launch,
 * captured in a CUDA graph). The in-graph costs measured with LAGUNA_DUP (dev/gpu_notes.md) are 7-17 us per kernel
 * against 0.3-10 us of weight bytes. This lab separates the two parts on synthetic kernels built like laguna.cu's:
 *   stream  G blocks of 256 threads; each thread loads 8 16-byte chunks of "weights" (32 KB a block, a fresh part
 *           of a 2 GB buffer at every launch, so HBM and not L2), BEFORE griddep_wait (pre) or after it (post);
 *           then reads an 8 KB input vector that the previous kernel wrote, reduces over the block and writes one
 *           float per block (the next kernel's input). G sweeps 1 .. 4096 blocks (32 KB .. 128 MB a launch):
 *           the fit of time against bytes gives the fixed cost of a kernel in the chain and the streaming rate.
 *   last    stream plus the last-block-done merge of laguna.cu's router and attention (fence, atomic counter, the
 *           last block reads every block's output).
 *   cluster stream in thread-block clusters of 16 (sm_90) with the merge through distributed shared memory.
 *   waves   the stream kernel's bytes in one wave: 2 blocks per SM, each looping over S steps of 32 KB (the next
 *           step's loads issued before the current one is summed), against stream's S waves of blocks
 *           (H200, round 20: 0.68 us + 0.219 us/MB, 4573 GB/s, against stream's 1.02 + 0.220).
 *   nc      stream with laguna.cu's weight loads (ld_stream: ld.global.nc.L1::no_allocate) instead of __ldcs.
 *   nc2     nc with at most 2 blocks an SM (a dynamic shared-memory reservation), as laguna's 124-register matvecs.
 *   matvec  laguna.cu's bf16 decode matvec itself (matvec_warp<bf16, 8, 2>, RMSNorm folded in): 16 rows of 2048 a
 *           block, 64 KB of fresh weights a block. nc / nc2 / matvec move the stream kernel one step at a time toward
 *           the q/k/v/g matvec, which streams at ~2.5 TB/s in the decode graph (dev/gpu_notes.md, round 8).
 *   mv1     matvec_warp<bf16, 8, 1>: one row step a warp, 32 KB a block, all of it loaded before the wait.
 *   mvnn    matvec without its RMSNorm (no block reduction of x's squares before the rows).
 *   mvc16 / mvc8  laguna.cu's matvec_cols<bf16, R> (a thread owns 8 columns of R rows; x in registers).
 * Before the rows, --check compares matvec_cols with matvec_warp on random data (q/k/v/g's 8240 x 2048, normed).
 *   dep     a dependent step with no weights: the wait, the 8 KB input from L2, a block reduction, a float out:
 *           the floor of any step of the decode chain (H200, round 30: 0.93 us at 1 block, 1.18 at 132, 1.52 at
 *           528, 1.98 at 1024; empty 0.52-0.57).
 *   empty   griddep_wait / griddep_launch only.
 * With --icache instead: what running code costs when the SM's instruction cache is cold. code_kernel runs U
 * independent FMAs (8 chains, ~16 bytes of SASS each, so U = 4096 is ~64 KB of code) between two clock64 reads, one
 * block an SM; its cycles are read (a) launched back to back (warm), (b) alternated with a second copy of itself
 * (other code of the same size: the first copy's lines leave the instruction caches), (c) alternated with the stream
 * kernel reading 64 MB (the code's lines leave L2 too). If (b) or (c) cost microseconds per 16-64 KB, every decode
 * kernel pays that at its start (the fused attention is 52-67 KB of SASS; dev/gpu_notes.md, round 8).
 * Each row: N launches captured into one graph (with and without programmatic dependent launch), replayed R times;
 * us per kernel = the replay time / N. One H200, results in dev/gpu_notes.md. */
#include "../laguna.cu"
#include "lab_graph.h"

#include <cooperative_groups.h>
#include <vector>
#include <string.h>

static const size_t BUF = (size_t)2 << 30;         /* the weight buffer: 2 GB, many times the 50 MB L2 */
static const int XN = 2048;                         /* the input vector: 8 KB of floats */

/* the shared part: this block's 32 KB of weights into registers, (pre or post) the wait, the input, a reduction */
template <bool PRE, bool NC = false>
__device__ __forceinline__ float stream_body(const uint4 *w, size_t off, const float *x) {
    const int tid = threadIdx.x;
    const uint4 *wb = w + off + (size_t)blockIdx.x * 8 * 256;
    uint4 c[8];
    if (PRE) {
#pragma unroll
        for (int u = 0; u < 8; u++) c[u] = NC ? ld_stream(wb + u * 256 + tid) : __ldcs(wb + u * 256 + tid);
    }
    griddep_wait();
    griddep_launch();
    if (!PRE) {
#pragma unroll
        for (int u = 0; u < 8; u++) c[u] = __ldcs(wb + u * 256 + tid);
    }
    float xv[8];
    load_x8(x + (tid * 8) % XN, xv);
    float acc = 0.0f;
#pragma unroll
    for (int u = 0; u < 8; u++) {              /* a stand-in for the dot product: every loaded byte is used */
        const uint32_t *q = (const uint32_t *)&c[u];
        acc += xv[u] * (float)((q[0] ^ q[1] ^ q[2] ^ q[3]) & 0xff);
    }
    return block_sum(acc);
}

template <bool PRE, bool NC = false>
__global__ void __launch_bounds__(256) stream_kernel(const uint4 *w, size_t off, const float *x, float *y) {
    float s = stream_body<PRE, NC>(w, off, x);
    if (threadIdx.x == 0) y[blockIdx.x % XN] = s * 1e-9f;
}

/* stream's bytes from a grid of one wave: each block S steps of 32 KB, the next step loaded while this one is used.
 * Two named buffers and the loop unrolled by two, so both stay in registers: the first version indexed one
 * uint4[2][8] array by the step's parity, which put it in local memory (a 256-byte stack frame, ptxas -v), and its
 * 2.2 TB/s (dev/gpu_notes.md round 5) measured that, not the design (found in round 20). */
__global__ void __launch_bounds__(256, 2) waves_kernel(const uint4 *w, size_t off, const float *x, float *y, int S) {
    const int tid = threadIdx.x;
    uint4 a[8], b[8];
    auto load = [&](uint4 (&c)[8], int s) {
#pragma unroll
        for (int u = 0; u < 8; u++) c[u] = __ldcs(w + off + ((size_t)s * gridDim.x + blockIdx.x) * 8 * 256 + u * 256 + tid);
    };
    float xv[8], acc = 0.0f;
    auto use = [&](const uint4 (&c)[8]) {
#pragma unroll
        for (int u = 0; u < 8; u++) {
            const uint32_t *q = (const uint32_t *)&c[u];
            acc += xv[u] * (float)((q[0] ^ q[1] ^ q[2] ^ q[3]) & 0xff);
        }
    };
    load(a, 0);
    griddep_wait();
    griddep_launch();
    load_x8(x + (tid * 8) % XN, xv);
    for (int s = 0; s < S; s += 2) {
        if (s + 1 < S) load(b, s + 1);
        use(a);
        if (s + 1 >= S) break;
        if (s + 2 < S) load(a, s + 2);
        use(b);
    }
    acc = block_sum(acc);
    if (tid == 0) y[blockIdx.x % XN] = acc * 1e-9f;
}

/* stream, then the last block to finish (a counter) reads every block's output: laguna.cu's router / attention */
__global__ void __launch_bounds__(256) last_kernel(const uint4 *w, size_t off, const float *x, float *y, float *part,
                                                   int *counter) {
    float s = stream_body<true>(w, off, x);
    __shared__ int last;
    if (threadIdx.x == 0) part[blockIdx.x] = s;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counter, 1) == (int)gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    float v = 0.0f;
    for (int b = threadIdx.x; b < (int)gridDim.x; b += 256) v += __ldcg(part + b);
    v = block_sum(v);
    if (threadIdx.x == 0) { y[0] = v * 1e-9f; *counter = 0; }
    for (int i = threadIdx.x + 1; i < XN; i += 256) y[i] = v * 1e-12f;
}

/* stream in clusters of 16 blocks; block 0 of each cluster reads the others' sums from their shared memory */
__global__ void __launch_bounds__(256) cluster_kernel(const uint4 *w, size_t off, const float *x, float *y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    namespace cg = cooperative_groups;
    cg::cluster_group cluster = cg::this_cluster();
    __shared__ float mine;
    float s = stream_body<true>(w, off, x);
    if (threadIdx.x == 0) mine = s;
    cluster.sync();
    if (cluster.block_rank() == 0 && threadIdx.x < 32) {
        float v = threadIdx.x < cluster.num_blocks() ? *cluster.map_shared_rank(&mine, threadIdx.x) : 0.0f;
        v = warp_sum(v);
        if (threadIdx.x == 0) y[(blockIdx.x / 16) % XN] = v * 1e-9f;
    }
    cluster.sync();
#else
    __trap();
#endif
}

/* a dependent step with no weights: the wait, the 8 KB input the previous kernel wrote (L2), a block reduction, one
 * float a block out -- what every decode kernel does around its bytes, so the floor of a chain of them */
__global__ void __launch_bounds__(256) dep_kernel(const float *x, float *y) {
    griddep_wait();
    griddep_launch();
    float xv[8];
    load_x8(x + (threadIdx.x * 8) % XN, xv);
    float s = block_sum(dot8(xv, xv));
    if (threadIdx.x == 0) y[blockIdx.x % XN] = s * 1e-9f;
}

__global__ void empty_kernel(float *y) {
    griddep_wait();
    griddep_launch();
    if (threadIdx.x == 0 && blockIdx.x == 0) y[0] += 1.0f;
}

/* U FMAs in 8 independent chains between two clock reads; TAG makes a second copy with its own code */
template <int U, int TAG>
__global__ void __launch_bounds__(256) code_kernel(float *out, long long *cyc, int slot) {
    griddep_wait();
    griddep_launch();
    long long t0 = clock64();
    float a[8];
#pragma unroll
    for (int j = 0; j < 8; j++) a[j] = threadIdx.x * (j + 1) * 1e-3f + (float)(t0 & 1) + TAG;   /* after t0 */
#pragma unroll
    for (int i = 0; i < U / 8; i++)
#pragma unroll
        for (int j = 0; j < 8; j++) a[j] = fmaf(a[j], 1.0000001f, (float)(i + j + TAG));
    asm volatile("" ::"f"(a[0]), "f"(a[1]), "f"(a[2]), "f"(a[3]), "f"(a[4]), "f"(a[5]), "f"(a[6]), "f"(a[7]));
    long long t1 = clock64();
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; j++) sum += a[j];
    if (sum == 12345.0f) out[threadIdx.x] = sum;    /* keeps the chains */
    if (threadIdx.x == 0) cyc[(size_t)slot * gridDim.x + blockIdx.x] = t1 - t0;
}

enum { K_PRE, K_POST, K_LAST, K_CLUSTER, K_WAVES, K_NC, K_NC2, K_MATVEC, K_MV1, K_MVNN, K_MVC16, K_MVC8, K_DEP, K_EMPTY };
static const char *kname[] = {"stream, loads before the wait", "stream, loads after the wait",
                              "stream + last-block merge", "stream in clusters of 16 + DSMEM merge",
                              "one wave (2 blocks per SM) looping", "stream, laguna's ld_stream loads",
                              "the same, 2 blocks an SM at most", "laguna's matvec_warp<bf16, 8, 2>",
                              "matvec_warp<bf16, 8, 1> (one step, 32 KB a block)", "matvec_warp<bf16, 8, 2>, no RMSNorm",
                              "matvec_cols<bf16, 16> (64 KB a block)", "matvec_cols<bf16, 8> (32 KB a block)",
                              "dependent step, no weights", "empty"};
static int nsm;
static size_t smem_half;                           /* K_NC2: dynamic shared memory that leaves room for 2 blocks */
static float *mv_out, *mv_norm;                    /* K_MATVEC: its output rows and RMSNorm weights */
static size_t block_bytes(int kind) { return kind == K_MATVEC || kind == K_MVNN || kind == K_MVC16 ? 65536 : 32768; }

static void enqueue(int kind, int G, int pdl, int i, const uint4 *w, float *xa, float *xb, float *part, int *counter,
                    cudaStream_t st) {
    cudaLaunchAttribute attr[2];
    int na = 0;
    if (pdl) {
        attr[na].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[na++].val.programmaticStreamSerializationAllowed = 1;
    }
    if (kind == K_CLUSTER) {
        attr[na].id = cudaLaunchAttributeClusterDimension;
        attr[na].val.clusterDim.x = 16;
        attr[na].val.clusterDim.y = 1;
        attr[na++].val.clusterDim.z = 1;
    }
    cudaLaunchConfig_t cfg = {};
    int S = 1;                                      /* waves: G blocks' bytes from 2 blocks per SM */
    if (kind == K_WAVES) { S = (G + 2 * nsm - 1) / (2 * nsm); G = 2 * nsm; }
    cfg.gridDim = dim3(G);
    cfg.blockDim = dim3(kind == K_EMPTY ? 32 : 256);
    cfg.dynamicSmemBytes = kind == K_NC2 ? smem_half : 0;
    cfg.stream = st;
    cfg.attrs = attr;
    cfg.numAttrs = na;
    /* launch i reads a fresh 32 KB (matvec: 64 KB) per block: offsets walk the 2 GB buffer */
    size_t per = (size_t)G * S * block_bytes(kind) / 16, n16 = BUF / 16;
    size_t off = ((size_t)i * per) % (n16 - per);
    const float *x = i & 1 ? xb : xa;
    float *y = i & 1 ? xa : xb;
    switch (kind) {
    case K_PRE: CUDA_CHECK(cudaLaunchKernelEx(&cfg, stream_kernel<true>, w, off, x, y)); break;
    case K_POST: CUDA_CHECK(cudaLaunchKernelEx(&cfg, stream_kernel<false>, w, off, x, y)); break;
    case K_LAST: CUDA_CHECK(cudaLaunchKernelEx(&cfg, last_kernel, w, off, x, y, part, counter)); break;
    case K_CLUSTER: CUDA_CHECK(cudaLaunchKernelEx(&cfg, cluster_kernel, w, off, x, y)); break;
    case K_WAVES: CUDA_CHECK(cudaLaunchKernelEx(&cfg, waves_kernel, w, off, x, y, S)); break;
    case K_NC:
    case K_NC2: CUDA_CHECK(cudaLaunchKernelEx(&cfg, stream_kernel<true, true>, w, off, x, y)); break;
    case K_MATVEC:
        CUDA_CHECK(cudaLaunchKernelEx(&cfg, matvec_warp<bf16, 8, 2>, mv_out, WPtr(w + off), G * 16, XN, x,
                                      (const float *)mv_norm, 1e-6f, (float *)NULL, (const float *)NULL, 0));
        break;
    case K_MV1:
        CUDA_CHECK(cudaLaunchKernelEx(&cfg, matvec_warp<bf16, 8, 1>, mv_out, WPtr(w + off), G * 8, XN, x,
                                      (const float *)mv_norm, 1e-6f, (float *)NULL, (const float *)NULL, 0));
        break;
    case K_MVC16:
        CUDA_CHECK(cudaLaunchKernelEx(&cfg, matvec_cols<bf16, 16, false>, mv_out, WPtr(w + off), G * 16, XN, x,
                                      (const float *)mv_norm, 1e-6f, (float *)NULL, (const float *)NULL, 0));
        break;
    case K_MVC8:
        CUDA_CHECK(cudaLaunchKernelEx(&cfg, matvec_cols<bf16, 8, false>, mv_out, WPtr(w + off), G * 8, XN, x,
                                      (const float *)mv_norm, 1e-6f, (float *)NULL, (const float *)NULL, 0));
        break;
    case K_MVNN:
        CUDA_CHECK(cudaLaunchKernelEx(&cfg, matvec_warp<bf16, 8, 2>, mv_out, WPtr(w + off), G * 16, XN, x,
                                      (const float *)NULL, 1e-6f, (float *)NULL, (const float *)NULL, 0));
        break;
    case K_DEP: CUDA_CHECK(cudaLaunchKernelEx(&cfg, dep_kernel, x, y)); break;
    default: CUDA_CHECK(cudaLaunchKernelEx(&cfg, empty_kernel, y));
    }
}

/* us per kernel over a graph of N launches replayed R times */
static double time_chain(int kind, int G, int pdl, const uint4 *w, float *xa, float *xb, float *part, int *counter,
                         cudaStream_t st) {
    const int N = 240, R = 10;
    cudaGraph_t graph;
    CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < N; i++) enqueue(kind, G, pdl, i, w, xa, xb, part, counter, st);
    CUDA_CHECK(cudaStreamEndCapture(st, &graph));
    return graph_us(graph, st, N, R);
}

/* --icache: code_kernel<U, 0>'s mean cycles a block over N launches (the first left out), with nothing, another copy
 * of the code, or a 64 MB stream between its launches */
template <int U>
static void icache_row(const char *what, int between, const uint4 *w, float *xa, float *xb, long long *cyc,
                       cudaStream_t st) {
    const int N = 40;
    cudaGraph_t graph;
    CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < N; i++) {
        code_kernel<U, 0><<<nsm, 256, 0, st>>>(xb, cyc, i);
        if (between == 1) code_kernel<U, 1><<<nsm, 256, 0, st>>>(xb, cyc, N + i);
        if (between == 2) stream_kernel<true><<<2048, 256, 0, st>>>(w, ((size_t)i * 2048 * 8 * 256) % (BUF / 16 - 2048 * 8 * 256), xa, xb);
    }
    CUDA_CHECK(cudaStreamEndCapture(st, &graph));
    graph_us(graph, st, N, 1);
    std::vector<long long> h((size_t)N * nsm);
    CUDA_CHECK(cudaMemcpy(h.data(), cyc, h.size() * sizeof(long long), cudaMemcpyDeviceToHost));
    double sum = 0;
    for (int i = 1; i < N; i++)
        for (int b = 0; b < nsm; b++) sum += (double)h[(size_t)i * nsm + b];
    double mean = sum / ((N - 1) * (double)nsm);
    printf("| %d | %.0f | %s | %.0f | %.2f |\n", U, U * 16 / 1024.0, what, mean, mean / U);
}

static void icache_lab(const uint4 *w, float *xa, float *xb, cudaStream_t st) {
    long long *cyc;
    CUDA_CHECK(cudaMalloc(&cyc, (size_t)80 * nsm * sizeof(long long)));
    printf("| FMAs | ~KB of code | between launches | cycles a block | cycles an FMA |\n|---|---|---|---|---|\n");
    const char *what[] = {"nothing (warm)", "another copy of the code", "a 64 MB stream"};
    for (int b = 0; b < 3; b++) icache_row<1024>(what[b], b, w, xa, xb, cyc, st);
    for (int b = 0; b < 3; b++) icache_row<4096>(what[b], b, w, xa, xb, cyc, st);
    CUDA_CHECK(cudaFree(cyc));
}

/* least squares t = a + b * MB over the rows with at least min_mb */
static void fit(const double *mb, const double *us, int n, double min_mb, double *a, double *b) {
    double s = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
    for (int i = 0; i < n; i++) {
        if (mb[i] < min_mb) continue;
        s += 1; sx += mb[i]; sy += us[i]; sxx += mb[i] * mb[i]; sxy += mb[i] * us[i];
    }
    *b = (s * sxy - sx * sy) / (s * sxx - sx * sx);
    *a = (sy - *b * sx) / s;
}

/* matvec_cols<bf16, R> against matvec_warp<bf16, 8, 2> on random weights, x and norm weights */
static void check_cols(uint4 *w, float *xa, cudaStream_t st) {
    const int rows = 8240;
    fill_random<bf16><<<1024, 256, 0, st>>>((bf16 *)w, (size_t)rows * XN, 7, 1, 0, 0.05f);
    fill_random<float><<<8, 256, 0, st>>>(xa, XN, 7, 2, 0, 1.0f);
    fill_random<float><<<8, 256, 0, st>>>(mv_norm, XN, 7, 3, 0, 1.0f);
    float *o[3];
    for (int i = 0; i < 3; i++) CUDA_CHECK(cudaMalloc(&o[i], rows * sizeof(float)));
    matvec_warp<bf16, 8, 2><<<(rows + 15) / 16, 256, 0, st>>>(o[0], WPtr(w), rows, XN, xa, mv_norm, 1e-6f, NULL, NULL, 0);
    matvec_cols<bf16, 16, false><<<(rows + 15) / 16, 256, 0, st>>>(o[1], WPtr(w), rows, XN, xa, mv_norm, 1e-6f, NULL, NULL, 0);
    matvec_cols<bf16, 8, false><<<(rows + 7) / 8, 256, 0, st>>>(o[2], WPtr(w), rows, XN, xa, mv_norm, 1e-6f, NULL, NULL, 0);
    CUDA_CHECK(cudaStreamSynchronize(st));
    std::vector<float> h[3];
    for (int i = 0; i < 3; i++) {
        h[i].resize(rows);
        CUDA_CHECK(cudaMemcpy(h[i].data(), o[i], rows * sizeof(float), cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaFree(o[i]));
    }
    double d16 = 0, d8 = 0, mx = 0;
    for (int r = 0; r < rows; r++) {
        d16 = fmax(d16, fabs(h[1][r] - h[0][r]));
        d8 = fmax(d8, fabs(h[2][r] - h[0][r]));
        mx = fmax(mx, fabs(h[0][r]));
    }
    printf("check: matvec_cols vs matvec_warp over %d rows (max |y| %.3f): R=16 max diff %.3g, R=8 %.3g\n\n", rows,
           mx, d16, d8);
}

int main(int argc, char **argv) {
    cudaDeviceProp p;
    CUDA_CHECK(cudaGetDeviceProperties(&p, 0));
    nsm = p.multiProcessorCount;
    printf("chain_lab: %s, %d SMs; each row: 240 launches in one graph, replayed 10 times\n\n", p.name, nsm);
    uint4 *w;
    float *xa, *xb, *part;
    int *counter;
    CUDA_CHECK(cudaMalloc(&w, BUF));
    CUDA_CHECK(cudaMemset(w, 1, BUF));
    CUDA_CHECK(cudaMalloc(&xa, XN * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&xb, XN * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&part, 8192 * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&counter, sizeof(int)));
    CUDA_CHECK(cudaMemset(xa, 0, XN * sizeof(float)));
    CUDA_CHECK(cudaMemset(xb, 0, XN * sizeof(float)));
    CUDA_CHECK(cudaMemset(counter, 0, sizeof(int)));
    cudaStream_t st;
    CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    CUDA_CHECK(cudaFuncSetAttribute(cluster_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    smem_half = p.sharedMemPerMultiprocessor / 2 - 4096;
    CUDA_CHECK(cudaFuncSetAttribute(stream_kernel<true, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_half));
    CUDA_CHECK(cudaMalloc(&mv_out, (size_t)4096 * 16 * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&mv_norm, XN * sizeof(float)));
    CUDA_CHECK(cudaMemset(mv_norm, 0, XN * sizeof(float)));

    if (argc > 1 && !strcmp(argv[1], "--check")) {
        check_cols(w, xa, st);
        CUDA_CHECK(cudaMemset(w, 1, BUF));
        CUDA_CHECK(cudaMemset(xa, 0, XN * sizeof(float)));
        argc = 1;
    }
    if (argc > 1 && !strcmp(argv[1], "--icache")) {
        icache_lab(w, xa, xb, st);
        return 0;
    }
    const int Gs[] = {1, 16, 128, 132, 256, 264, 512, 528, 1024, 2048, 4096};
    const int nG = sizeof Gs / sizeof Gs[0];
    printf("| kernel | PDL | blocks | MB a launch | us per kernel | GB/s |\n|---|---|---|---|---|---|\n");
    const char *only = getenv("CHAIN_KINDS");      /* e.g. CHAIN_KINDS=,7,11,12, : only those rows (enum order) */
    for (int kind = K_PRE; kind <= K_EMPTY; kind++)
        for (int pdl = 1; pdl >= 0; pdl--) {
            char tag[16];
            snprintf(tag, sizeof tag, ",%d,", kind);
            if (only && !strstr(only, tag)) continue;
            if (kind != K_PRE && !pdl) continue;       /* without PDL: the stream kernel only */
            double mb[16], us[16];
            int n = 0;
            for (int gi = 0; gi < nG; gi++) {
                int G = Gs[gi];
                if (kind == K_CLUSTER && G % 16) continue;
                if (kind == K_LAST && G > 8192) continue;
                if (kind == K_EMPTY && G > 128) continue;
                if (kind == K_DEP && G > 1024) continue;
                if (kind == K_WAVES && G < 2 * nsm) continue;
                double t = time_chain(kind, G, pdl, w, xa, xb, part, counter, st);
                int Gw = kind == K_WAVES ? (G + 2 * nsm - 1) / (2 * nsm) * 2 * nsm : G;   /* blocks' worth of bytes */
                double m = kind == K_EMPTY || kind == K_DEP ? 0.0 : Gw * (double)block_bytes(kind) / 1e6;
                mb[n] = m;
                us[n++] = t;
                printf("| %s | %s | %d | %.2f | %.2f | %.0f |\n", kname[kind], pdl ? "yes" : "no", G, m, t,
                       m > 0 ? m * 1e6 / (t * 1e3) : 0.0);
                fflush(stdout);
            }
            if (kind != K_EMPTY && kind != K_DEP && n >= 3) {
                double a, b;
                fit(mb, us, n, 4.0, &a, &b);
                printf("| fit (>= 4 MB): %s, PDL %s | | | | %.2f us + MB x %.3f us | %.0f |\n", kname[kind],
                       pdl ? "yes" : "no", a, b, 1e3 / b);
            }
        }
    CUDA_CHECK(cudaFree(w));
    CUDA_CHECK(cudaFree(xa));
    CUDA_CHECK(cudaFree(xb));
    CUDA_CHECK(cudaFree(part));
    CUDA_CHECK(cudaFree(counter));
    CUDA_CHECK(cudaFree(mv_out));
    CUDA_CHECK(cudaFree(mv_norm));
    return 0;
}
