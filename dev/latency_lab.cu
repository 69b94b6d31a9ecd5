/* dev/latency_lab.cu -- what a dependent load costs while weights stream (make dev/latency_lab && ./dev/latency_lab).
 *
 * The decode step's critical path is a chain of dependent loads (an activation from L2, the attention's K tile from
 * DRAM, the router's plan) issued while other blocks stream weights; the traces put the K tile ~4 us after its issue
 * (dev/gpu_notes.md, round 27), several times DRAM's unloaded latency. This lab measures that trade on its own:
 *   stream  B blocks (one an SM up to 132, then 2 or 4), each thread keeping U 16-byte loads in flight (issue U, use them, issue U
 *           more) over a 2 GB buffer: B * 256 * U * 16 bytes in flight, run for a fixed number of rounds;
 *   probe   one thread on another stream, chasing pointers through a buffer (each load's address is the previous
 *           load's value): 1 GB of random hops (DRAM misses) or 1 MB (L2 hits); ns a hop from %globaltimer.
 * Each row: the stream alone (TB/s), then the stream with the probe beside it (the probe's ns a hop and the stream's
 * TB/s then). A knee where the bandwidth is near the copy rate and the latency still near the unloaded one would say
 * how many bytes a decode step needs in flight, and how much latency the chain pays for more.
 * The stream's addresses do not depend on its loads, so a thread's next rounds issue before the previous ones are used:
 * the "MB in flight" column is a lower bound, and the blocks, not U, set the rate. Rates above the 4.3 TB/s copy
 * ceiling (528 blocks) were not looked into.
 * Measured (H200, 2026-12-03; dev/gpu_notes.md, round 29): unloaded a DRAM hop 336 ns, an L2 hop 142 ns; beside the
 * stream (U 4, typical of every U): 132 blocks 3.5 TB/s, DRAM 404 / L2 176 ns; 264 blocks 4.4 TB/s, 597 / 363 ns; 528
 * blocks 4.7 TB/s, 1089 / 734 ns. */
#include "../laguna.cu"

#include <vector>
#include <string.h>

static const size_t SBUF = (size_t)2 << 30, PBUF = (size_t)1 << 30;

/* U loads of 16 bytes a thread in flight per round; R rounds; the block's sum keeps the loads alive */
template <int U>
__global__ void __launch_bounds__(256) stream_kernel(const uint4 *w, size_t n16, int rounds, float *sink) {
    const size_t stride = (size_t)gridDim.x * 256 * U;
    size_t i = ((size_t)blockIdx.x * 256 + threadIdx.x);
    uint32_t acc = 0;
    for (int r = 0; r < rounds; r++) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; u++) v[u] = ld_stream(w + ((i + (size_t)u * gridDim.x * 256) & (n16 - 1)));   /* n16: 2^27 */
#pragma unroll
        for (int u = 0; u < U; u++) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
        i += stride;
    }
    if (acc == 0x12345678u) sink[blockIdx.x] = 1.0f;   /* never, but the loads can't be dropped */
}

__device__ __forceinline__ uint64_t gtimer() {
    uint64_t t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}

/* hops dependent loads from p (each a 64-bit index into p); ns a hop into out[0]. It first spins for delay ns, so
 * that the stream beside it is running at full rate */
__global__ void probe_kernel(const uint64_t *p, int hops, double *out, uint64_t delay, uint64_t start, int warm) {
    const uint64_t ts = gtimer();
    while (gtimer() - ts < delay) { }
    uint64_t j = start;                                     /* a new part of the cycle at every call: lines not in L2 */
    for (int h = 0; h < warm; h++) j = __ldcg(p + j);         /* DRAM: the TLB a little; L2: the whole cycle in */
    const uint64_t t0 = gtimer();
    for (int h = 0; h < hops; h++) j = __ldcg(p + j);
    const uint64_t t1 = gtimer();
    out[0] = (double)(t1 - t0) / hops;
    out[1] = (double)j;                                     /* keeps the chain */
}

/* a random cycle over n slots, spaced a 256-byte line (or more) apart */
static uint64_t *make_chase(size_t bytes, uint64_t seed) {
    const size_t slots = bytes / 256, step = 256 / 8;
    std::vector<uint64_t> order(slots), h(bytes / 8, 0);
    for (size_t i = 0; i < slots; i++) order[i] = i;
    for (size_t i = slots - 1; i > 0; i--) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        size_t k = (size_t)((seed >> 33) % (i + 1));
        uint64_t t = order[i]; order[i] = order[k]; order[k] = t;
    }
    for (size_t i = 0; i < slots; i++) h[order[i] * step] = order[(i + 1) % slots] * step;
    uint64_t *d;
    CUDA_CHECK(cudaMalloc(&d, bytes));
    CUDA_CHECK(cudaMemcpy(d, h.data(), bytes, cudaMemcpyHostToDevice));
    return d;
}

static uint64_t seed_ = 99;
static uint64_t next_start(size_t bytes) {        /* a random slot's index (its first uint64) */
    seed_ = seed_ * 6364136223846793005ull + 1442695040888963407ull;
    return ((seed_ >> 33) % (bytes / 256)) * (256 / 8);
}

template <int U>
static void row(int B, const uint4 *w, float *sink, const uint64_t *chase_dram, const uint64_t *chase_l2, double *pout,
                cudaStream_t s1, cudaStream_t s2) {
    const size_t n16 = SBUF / 16;
    const double inflight = (double)B * 256 * U * 16;
    const int rounds = 10000;                                /* 8-25 ms a launch */
    cudaEvent_t e0, e1;
    CUDA_CHECK(cudaEventCreate(&e0));
    CUDA_CHECK(cudaEventCreate(&e1));
    float ms_alone = 0, ms_with[2] = {0, 0};
    double lat[2] = {0, 0};
    stream_kernel<U><<<B, 256, 0, s1>>>(w, n16, 4, sink);     /* warm-up */
    CUDA_CHECK(cudaEventRecord(e0, s1));
    stream_kernel<U><<<B, 256, 0, s1>>>(w, n16, rounds, sink);
    CUDA_CHECK(cudaEventRecord(e1, s1));
    CUDA_CHECK(cudaEventSynchronize(e1));
    CUDA_CHECK(cudaEventElapsedTime(&ms_alone, e0, e1));
    for (int k = 0; k < 2; k++) {                            /* the probe beside the stream: DRAM, then L2 */
        CUDA_CHECK(cudaDeviceSynchronize());
        CUDA_CHECK(cudaEventRecord(e0, s1));
        stream_kernel<U><<<B, 256, 0, s1>>>(w, n16, rounds, sink);
        CUDA_CHECK(cudaEventRecord(e1, s1));
        probe_kernel<<<1, 1, 0, s2>>>(k ? chase_l2 : chase_dram, k ? 4000 : 2000, pout + 2 * k, 1000000,   /* 1 ms in */
                                      next_start(k ? ((size_t)1 << 20) : PBUF), k ? 4096 : 64);
        CUDA_CHECK(cudaGetLastError());
        CUDA_CHECK(cudaDeviceSynchronize());
        CUDA_CHECK(cudaEventElapsedTime(&ms_with[k], e0, e1));
    }
    CUDA_CHECK(cudaMemcpy(lat, pout, sizeof(double), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(&lat[1], pout + 2, sizeof(double), cudaMemcpyDeviceToHost));
    const double bytes = inflight * rounds;
    printf("| %d | %d | %.2f | %.2f | %.0f | %.0f | %.2f |\n", B, U, inflight / 1e6, bytes / (ms_alone * 1e9),
           lat[0], lat[1], bytes / (ms_with[0] * 1e9));
    fflush(stdout);
    CUDA_CHECK(cudaEventDestroy(e0));
    CUDA_CHECK(cudaEventDestroy(e1));
}

int main() {
    cudaDeviceProp p;
    CUDA_CHECK(cudaGetDeviceProperties(&p, 0));
    const int nsm = p.multiProcessorCount;
    printf("latency_lab: %s, %d SMs, L2 %.0f MB\n\n", p.name, nsm, p.l2CacheSize / 1e6);
    uint4 *w;
    float *sink;
    double *pout;
    CUDA_CHECK(cudaMalloc(&w, SBUF));
    CUDA_CHECK(cudaMemset(w, 1, SBUF));
    CUDA_CHECK(cudaMalloc(&sink, 4096 * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&pout, 4 * sizeof(double)));
    uint64_t *chase_dram = make_chase(PBUF, 1), *chase_l2 = make_chase((size_t)1 << 20, 2);
    cudaStream_t s1, s2;
    CUDA_CHECK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    CUDA_CHECK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    {   /* unloaded latency, after 50 ms of work so the clocks are up */
        const uint64_t hz = 50000000;
        probe_kernel<<<1, 1, 0, s2>>>(chase_l2, 10, pout, hz, 0, 0);
        probe_kernel<<<1, 1, 0, s2>>>(chase_dram, 2000, pout, 0, next_start(PBUF), 64);
        probe_kernel<<<1, 1, 0, s2>>>(chase_l2, 4000, pout + 2, 0, next_start((size_t)1 << 20), 4096);
        CUDA_CHECK(cudaStreamSynchronize(s2));
        double h[4];
        CUDA_CHECK(cudaMemcpy(h, pout, sizeof h, cudaMemcpyDeviceToHost));
        printf("unloaded: a DRAM hop %.0f ns, an L2 hop %.0f ns\n\n", h[0], h[2]);
    }
    printf("| blocks | loads in flight a thread | MB in flight | stream TB/s alone | DRAM hop ns beside it | L2 hop ns beside it "
           "| stream TB/s with the probe |\n|---|---|---|---|---|---|---|\n");
    const int Bs[] = {16, 33, 66, nsm, 2 * nsm, 4 * nsm};
    for (int B : Bs) {
        row<1>(B, w, sink, chase_dram, chase_l2, pout, s1, s2);
        row<2>(B, w, sink, chase_dram, chase_l2, pout, s1, s2);
        row<4>(B, w, sink, chase_dram, chase_l2, pout, s1, s2);
        row<8>(B, w, sink, chase_dram, chase_l2, pout, s1, s2);
        row<16>(B, w, sink, chase_dram, chase_l2, pout, s1, s2);
    }
    return 0;
}
