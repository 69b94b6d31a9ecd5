/* dev/bulk_lab.cu -- can a decode matvec stream its weights through shared memory with bulk copies (TMA) faster than
 * through registers?  (make dev/bulk_lab && ./dev/bulk_lab)
 *
 * dev/chain_lab measured a plain streaming kernel in a PDL chain at ~1 us + 0.22 us/MB (4.5 TB/s) when every block is
 * resident and all its loads are issued before the wait. laguna.cu's bf16 q/k/v/g matvec (matvec_warp, 33.7 MB)
 * costs 16.9 us in the decode graph, ~2 TB/s: at 116 registers only 2 blocks fit an SM, so its 515 blocks run in two
 * waves, and each thread keeps at most 16 chunks in flight. The variant here, matvec_bulk, is one wave of blocks that
 * each own a ring of ST shared-memory stages of TR rows; one thread issues cp.async.bulk for a stage (completion on
 * an mbarrier), the first ST stages BEFORE the wait on the previous kernel, and the 8 warps compute rows out of
 * shared memory, refilling a stage as soon as all warps are done with it. The bytes in flight are bounded by shared
 * memory (up to ~200 KB an SM) instead of registers.
 *
 * Each row of the table: 240 launches of one kernel in a graph (with programmatic dependent launch, as laguna's
 * decode graph), each reading a fresh part of a 2 GB weight buffer, replayed 10 times; us per kernel. The outputs of
 * every variant are checked against matvec_warp / matvec_kernel (laguna.cu's) on the same input (x0, which the
 * chains do not touch).
 *
 * Measured (H200, 2026-11-30, dev/gpu_notes.md round 5): in this chain bulk wins at every shape (q/k/v/g 11.8 us
 * against 14.9, lm_head 96 against 124, o_proj 11.5 against 13.7), outputs identical. In laguna's decode graph
 * (bulk for every bf16 decode matvec: <8, 6> for lm_head, <8, 2> for the rest) decode fell from 334.9 to 301.3
 * tok/s at 512 (8K: 291.8 to 265.4), with make test-gpu passing. In the chain a bulk kernel follows a bulk kernel; in
 * the model it follows attention, the router or the experts, and its 72-216 KB of shared memory a block keep it
 * off an SM until the previous kernel's blocks there have left, so (a guess, not measured) none of it starts early
 * under PDL. Not used. */
#include "../laguna.cu"
#include "lab_graph.h"

#include <vector>

static const size_t BUF = (size_t)2 << 30;

/* the kernel (was in laguna.cu for one device run; see the header for why it is here) */
__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_wait(uint64_t *b, uint32_t parity) {   /* until phase `parity` has completed */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    uint32_t done = 0;
    while (!done)
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done) : "r"(smem_u32(b)), "r"(parity) : "memory");
#endif
}
/* bytes (a multiple of 16; both ends 16-byte aligned) from global src to shared dst, counted in on mbarrier b */
__device__ __forceinline__ void bulk_load(void *dst, const void *src, uint32_t bytes, uint64_t *b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(b)), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(b)) : "memory");
#endif
}
template <int TR, int ST>
constexpr size_t bulk_smem(int in) { return 128 + (size_t)ST * TR * in * sizeof(bf16) + (size_t)in * sizeof(float); }

template <int TR, int ST>
__global__ void __launch_bounds__(256) matvec_bulk(float *out, const bf16 *w, int rows, int in, const float *x,
                                                   const float *norm_w, float eps, float *xb_out, const float *bias,
                                                   int accumulate) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    __trap();                                                  /* the host uses it on sm_90 and later only */
#endif
    extern __shared__ __align__(16) unsigned char smem[];
    uint64_t *bar = (uint64_t *)smem;                          /* ST mbarriers, then the stages, then x */
    bf16 *stage = (bf16 *)(smem + 128);
    const size_t tile = (size_t)TR * in;                       /* values a stage */
    float *xs = (float *)(stage + ST * tile);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, G = gridDim.x, ntiles = (rows + TR - 1) / TR;
    auto fill = [&](int t, int s) {                            /* tile t (rows t * TR ..) into stage s */
        bulk_load(stage + s * tile, w + (size_t)t * tile, (uint32_t)(min(TR, rows - t * TR) * in * sizeof(bf16)), &bar[s]);
    };
    if (tid == 0) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        for (int s = 0; s < ST; s++)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&bar[s])) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
        for (int s = 0; s < ST && blockIdx.x + s * G < ntiles; s++) fill(blockIdx.x + s * G, s);
    }
    griddep_wait();                                            /* x is the previous kernel's output */
    griddep_launch();
    float ss = stage_x<8>(xs, x, in);                           /* (CH 8: the plain layout) */
    float inv = norm_w ? 1.0f / sqrtf(block_sum(ss) / in + eps) : 1.0f;   /* block_sum syncs */
    if (norm_w)
        for (int k = tid; k < in; k += 256) {
            xs[k] = norm_w[k] * (xs[k] * inv);
            if (xb_out && blockIdx.x == 0) xb_out[k] = xs[k];
        }
    __syncthreads();                                           /* x staged; the barriers' init seen by all */
    for (int it = 0, t = blockIdx.x; t < ntiles; it++, t += G) {
        const int s = it % ST;
        mbar_wait(&bar[s], (it / ST) & 1);
#pragma unroll
        for (int rr = 0; rr < TR / 8; rr++) {                  /* warp w: rows w, w + 8, .. of the tile */
            const int r = t * TR + rr * 8 + warp;
            const bf16 *row = stage + s * tile + (size_t)(rr * 8 + warp) * in;
            float acc = 0.0f, wv[8], xv[8];
            if (r < rows)
                for (int k = lane * 8; k < in; k += 256) {
                    to_f32x8(*(const uint4 *)(row + k), wv);
                    load_x8(xs + k, xv);
                    acc += dot8(wv, xv);
                }
            acc = warp_sum(acc);
            if (lane == 0 && r < rows) {
                if (bias) acc += bias[r];
                out[r] = accumulate ? out[r] + acc : acc;
            }
        }
        __syncthreads();                                       /* every warp is done with stage s */
        if (tid == 0 && t + ST * G < ntiles) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   /* those reads before the copy's writes */
#endif
            fill(t + ST * G, s);
        }
    }
}

struct Var { const char *name; int kind, tr, st, bps; };     /* kind 0: laguna's matvec; 1: bulk<tr, st>, bps blocks an SM */
static int nsm;

static void launch_var(const Var &v, int rows, int in, const bf16 *w, const float *x, float *out, const float *nw,
                       int pdl, cudaStream_t st) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.blockDim = dim3(256);
    cfg.stream = st;
    cfg.attrs = attr;
    cfg.numAttrs = pdl;
    WPtr m(w);
    if (v.kind == 0 && in <= 2048) {                           /* what laguna.cu's matvec<bf16> launches */
        cfg.gridDim = dim3((rows + 15) / 16);
        CUDA_CHECK(cudaLaunchKernelEx(&cfg, matvec_warp<bf16, 8, 2>, out, m, rows, in, x, nw, 1e-6f, (float *)NULL,
                                      (const float *)NULL, 0));
    } else if (v.kind == 0) {
        int nch = (in + 2047) / 2048;
        if (nch <= 2) { cfg.gridDim = dim3((rows + 3) / 4); CUDA_CHECK(cudaLaunchKernelEx(&cfg, matvec_kernel<bf16, 4, 2>, out, m, rows, in, x, nw, 1e-6f, (float *)NULL, (const float *)NULL, 0)); }
        else if (nch <= 4) { cfg.gridDim = dim3((rows + 1) / 2); CUDA_CHECK(cudaLaunchKernelEx(&cfg, matvec_kernel<bf16, 2, 4>, out, m, rows, in, x, nw, 1e-6f, (float *)NULL, (const float *)NULL, 0)); }
        else { cfg.gridDim = dim3(rows); CUDA_CHECK(cudaLaunchKernelEx(&cfg, matvec_kernel<bf16, 1, 8>, out, m, rows, in, x, nw, 1e-6f, (float *)NULL, (const float *)NULL, 0)); }
    } else {
        int ntiles = (rows + v.tr - 1) / v.tr, G = nsm * v.bps;
        cfg.gridDim = dim3(G < ntiles ? G : ntiles);
#define BULK(TR, ST) if (v.tr == TR && v.st == ST) { cfg.dynamicSmemBytes = bulk_smem<TR, ST>(in); \
            CUDA_CHECK(cudaLaunchKernelEx(&cfg, matvec_bulk<TR, ST>, out, w, rows, in, x, nw, 1e-6f, (float *)NULL, \
            (const float *)NULL, 0)); return; }
        BULK(8, 6) BULK(8, 3) BULK(8, 2) BULK(16, 3) BULK(8, 1) BULK(16, 1)
#undef BULK
        fprintf(stderr, "no such variant\n");
        exit(1);
    }
}

static double time_chain(const Var &v, int rows, int in, const bf16 *w, float *xa, float *xb, const float *nw,
                         cudaStream_t st) {
    const int N = 240, R = 10;
    size_t per = (size_t)rows * in, nv = BUF / 2;
    cudaGraph_t graph;
    CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < N; i++) {
        size_t off = ((size_t)i * per) % (nv - per) / 8 * 8;   /* a fresh part of the buffer, 16-byte aligned */
        launch_var(v, rows, in, w + off, i & 1 ? xb : xa, i & 1 ? xa : xb, nw, 1, st);
    }
    CUDA_CHECK(cudaStreamEndCapture(st, &graph));
    return graph_us(graph, st, N, R);
}

__global__ void fill_bf16(bf16 *p, size_t n, uint32_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u ^ seed;
        h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
        p[i] = __float2bfloat16(((h & 0xffff) / 65536.0f - 0.5f) * 0.05f);
    }
}

int main(void) {
    cudaDeviceProp p;
    CUDA_CHECK(cudaGetDeviceProperties(&p, 0));
    nsm = p.multiProcessorCount;
    printf("bulk_lab: %s, %d SMs, %zu KB shared memory a block at most\n\n", p.name, nsm, p.sharedMemPerBlockOptin / 1024);
    bf16 *w;
    float *xa, *xb, *x0, *nw, *o1, *o2;
    const int XMAX = 1 << 20;
    CUDA_CHECK(cudaMalloc(&w, BUF));
    fill_bf16<<<4096, 256>>>(w, BUF / 2, 7);
    LAUNCH_CHECK();
    CUDA_CHECK(cudaMalloc(&xa, XMAX * 4));
    CUDA_CHECK(cudaMalloc(&xb, XMAX * 4));
    CUDA_CHECK(cudaMalloc(&x0, XMAX * 4));
    CUDA_CHECK(cudaMalloc(&nw, XMAX * 4));
    CUDA_CHECK(cudaMalloc(&o1, XMAX * 4));
    CUDA_CHECK(cudaMalloc(&o2, XMAX * 4));
    {
        std::vector<float> h(XMAX);
        for (int i = 0; i < XMAX; i++) h[i] = sinf(0.37f * i) + 0.1f;
        CUDA_CHECK(cudaMemcpy(xa, h.data(), XMAX * 4, cudaMemcpyHostToDevice));
        CUDA_CHECK(cudaMemcpy(xb, h.data(), XMAX * 4, cudaMemcpyHostToDevice));
        CUDA_CHECK(cudaMemcpy(x0, h.data(), XMAX * 4, cudaMemcpyHostToDevice));
        for (int i = 0; i < XMAX; i++) h[i] = 1.0f + 0.01f * (i % 7);
        CUDA_CHECK(cudaMemcpy(nw, h.data(), XMAX * 4, cudaMemcpyHostToDevice));
    }
    size_t static_smem = 0;                                   /* block_sum's: the dynamic part gets the rest */
#define ALLOW(TR, ST) { cudaFuncAttributes fa; CUDA_CHECK(cudaFuncGetAttributes(&fa, matvec_bulk<TR, ST>)); \
        static_smem = fa.sharedSizeBytes > static_smem ? fa.sharedSizeBytes : static_smem; \
        CUDA_CHECK(cudaFuncSetAttribute(matvec_bulk<TR, ST>, cudaFuncAttributeMaxDynamicSharedMemorySize, \
                                        (int)(p.sharedMemPerBlockOptin - fa.sharedSizeBytes))); }
    ALLOW(8, 6) ALLOW(8, 3) ALLOW(8, 2) ALLOW(16, 3) ALLOW(8, 1) ALLOW(16, 1)
#undef ALLOW
    cudaStream_t st;
    CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    struct Shape { const char *name; int rows, in; } shapes[] = {
        {"q/k/v/g 8240 x 2048", 8240, 2048}, {"lm_head 100352 x 2048", 100352, 2048},
        {"o_proj 2048 x 6144", 2048, 6144}, {"shared gate/up 1024 x 2048", 1024, 2048}};
    Var vars[] = {{"laguna matvec", 0, 0, 0, 0},
                  {"bulk 8 rows x 6 stages, 1 block/SM", 1, 8, 6, 1}, {"bulk 8 x 3, 2 blocks/SM", 1, 8, 3, 2},
                  {"bulk 8 x 2, 3 blocks/SM", 1, 8, 2, 3}, {"bulk 16 x 3, 1 block/SM", 1, 16, 3, 1},
                  {"bulk 8 x 1, 6 blocks/SM", 1, 8, 1, 6}, {"bulk 16 x 1, 3 blocks/SM", 1, 16, 1, 3},
                  {"bulk 8 x 2, 1 block/SM", 1, 8, 2, 1}, {"bulk 8 x 1, 2 blocks/SM", 1, 8, 1, 2}};
    printf("| shape | kernel | MB | us per kernel | GB/s | max |diff| vs laguna |\n|---|---|---|---|---|---|\n");
    for (auto &s : shapes) {
        double mb = (double)s.rows * s.in * 2 / 1e6;
        launch_var(vars[0], s.rows, s.in, w, x0, o1, nw, 0, st);
        for (auto &v : vars) {
            if (v.kind == 1) {
                size_t sm = 128 + (size_t)v.st * v.tr * s.in * 2 + (size_t)s.in * 4;
                if (sm + static_smem > p.sharedMemPerBlockOptin ||
                    (sm + static_smem + 1024) * v.bps > (size_t)p.sharedMemPerMultiprocessor) continue;
            }
            CUDA_CHECK(cudaMemsetAsync(o2, 0, s.rows * 4, st));
            launch_var(v, s.rows, s.in, w, x0, o2, nw, 0, st);
            CUDA_CHECK(cudaStreamSynchronize(st));
            std::vector<float> a(s.rows), b(s.rows);
            CUDA_CHECK(cudaMemcpy(a.data(), o1, s.rows * 4, cudaMemcpyDeviceToHost));
            CUDA_CHECK(cudaMemcpy(b.data(), o2, s.rows * 4, cudaMemcpyDeviceToHost));
            double md = 0, ma = 0;
            for (int i = 0; i < s.rows; i++) { md = fmax(md, fabs(a[i] - b[i])); ma = fmax(ma, fabs(a[i])); }
            double t = time_chain(v, s.rows, s.in, w, xa, xb, nw, st);
            printf("| %s | %s | %.1f | %.2f | %.0f | %.2g (of %.2g) |\n", s.name, v.name, mb, t, mb * 1e3 / t, md, ma);
            fflush(stdout);
        }
    }
    return 0;
}
