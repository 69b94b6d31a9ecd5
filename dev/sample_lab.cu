/* dev/sample_lab.cu -- the device sampler's kernels on their own (make dev/sample_lab && ./dev/sample_lab).
 *
 * For random logits rows (V from 16 to the real 100,352, odd sizes that leave a partial block and a partial thread;
 * flat to peaked; several temperatures and top-p values) the chain sample_stats -> sample_radix x 3 -> sample_mass ->
 * sample_pick runs once, and its nucleus threshold is checked against the CPU's rule in double precision: the
 * tokens at or above it must hold more than top-p, and without the smallest of them no more than top-p (up to
 * 1e-5 of slack for float p and the 2^-31 integer masses). Then sample_pick alone draws N tokens for N coins
 * (what it reads is unchanged between draws): every draw must lie in the nucleus, and the counts must fit the
 * nucleus's distribution (Pearson's chi-square, bins with an expected count under 5 pooled, p = 1e-4). The whole
 * chain is timed at V = 100,352 (plain launches: launch gaps included; the decode graph hides most of them).
 * Exit code 1 if a check fails. */
#include "../laguna.cu"

#include <algorithm>
#include <cmath>
#include <vector>

static uint64_t rng = 88172645463325252ull;
static double urand() { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return (rng >> 11) * (1.0 / 9007199254740992.0); }
static double nrand() { double u = urand() + 1e-300, v = urand(); return sqrt(-2 * log(u)) * cos(6.283185307179586 * v); }
static int fails = 0;
static float bits_f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

struct Lab {
    float *logits;
    Step *st, *h_st;
    SampleScratch *s;
    Step *ring_host, *ring_dev;                     /* the sampler's token: slot st->seq & 1 (seq 0 here: slot 0) */
};

static void chain(Lab &L, int V) {
    const int nblk = (V + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK;
    sample_stats<<<nblk, SAMPLE_THREADS>>>(L.logits, V, L.st, L.s);
    for (int pass = 0; pass < 3; pass++) sample_radix<<<nblk, SAMPLE_THREADS>>>(L.logits, V, L.st, L.s, pass);
    sample_mass<<<nblk, SAMPLE_THREADS>>>(L.logits, V, L.st, L.s);
    sample_pick<<<1, SAMPLE_THREADS>>>(L.logits, V, nblk, L.st, L.s, L.ring_dev);
    CUDA_CHECK(cudaGetLastError());
}

static double chi2_critical(int df, double z = 3.72) {   /* Wilson-Hilferty; z 3.72: p = 1e-4 */
    return df * pow(1 - 2.0 / (9 * df) + z * sqrt(2.0 / (9 * df)), 3);
}

static void one_case(Lab &L, int V, double scale, float T, float topp, int draws) {
    std::vector<float> lg(V);
    for (int i = 0; i < V; i++) lg[i] = (float)(scale * nrand());
    CUDA_CHECK(cudaMemcpy(L.logits, lg.data(), V * sizeof(float), cudaMemcpyHostToDevice));
    /* the CPU's distribution in double, and its nucleus by the CPU sampler's rule (sorted, the smallest prefix whose
     * mass exceeds topp) */
    double mx = -INFINITY, sum = 0;
    for (int i = 0; i < V; i++) mx = std::max(mx, (double)lg[i] / T);
    std::vector<double> p(V);
    for (int i = 0; i < V; i++) sum += p[i] = exp((double)lg[i] / T - mx);
    for (int i = 0; i < V; i++) p[i] /= sum;
    const bool on = topp > 0 && topp < 1;
    std::vector<int> order(V);
    for (int i = 0; i < V; i++) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
    int keep = V;
    if (on) { double m = 0; for (int i = 0; i < V; i++) { m += p[order[i]]; if (m > topp) { keep = i + 1; break; } } }

    L.h_st->temperature = T; L.h_st->topp = topp; L.h_st->coin = 0.5f; L.h_st->token = 0; L.h_st->pos = 0;
    CUDA_CHECK(cudaMemcpy(L.st, L.h_st, sizeof(Step), cudaMemcpyHostToDevice));
    chain(L, V);
    CUDA_CHECK(cudaDeviceSynchronize());
    SampleScratch s;
    CUDA_CHECK(cudaMemcpy(&s, L.s, sizeof s, cudaMemcpyDeviceToHost));
    const double thr = on ? (double)bits_f(s.thr) : 0.0;
    /* the device's nucleus, by the reference p: the tokens at or above its threshold */
    double mass = 0, smallest = 1;
    int n = 0;
    std::vector<char> in(V, 0);
    /* the device's p is float (logit / T rounded, expf, a float sum): a few 1e-6 off the double p at |logit / T| ~ 50,
     * so a token at the threshold (the threshold is the last included token's p) counts as in with 1e-5 of slack */
    for (int i = 0; i < V; i++)
        if (p[i] >= thr * (1 - 1e-5)) { in[i] = 1; n++; mass += p[i]; smallest = std::min(smallest, p[i]); }
    bool ok = true;
    if (on) ok = mass > topp - 2e-5 && mass - smallest <= topp + 2e-5;
    /* draws */
    std::vector<int> count(V, 0);
    int outside = 0;
    for (int d = 0; d < draws; d++) {
        L.h_st->coin = (float)urand();
        if (L.h_st->coin >= 1.0f) L.h_st->coin = 0.0f;
        CUDA_CHECK(cudaMemcpy(&L.st->coin, &L.h_st->coin, sizeof(float), cudaMemcpyHostToDevice));
        sample_pick<<<1, SAMPLE_THREADS>>>(L.logits, V, (V + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK, L.st, L.s, L.ring_host);
        CUDA_CHECK(cudaDeviceSynchronize());
        const int t = *(volatile int *)&L.ring_host[0].out;
        if (t < 0 || t >= V) { outside++; continue; }
        count[t]++;
        if (!in[t]) outside++;
    }
    /* chi-square over the nucleus: bins with an expected count under 5 pooled, and the pool joined to the smallest
     * bin if it is still under 5 (a pool expecting 0.5 that got 3 would add 12.5 on its own) */
    std::vector<double> bc, be;
    double pool_c = 0, pool_e = 0;
    for (int i = 0; i < V; i++) {
        if (!in[i]) continue;
        const double e = draws * p[i] / mass;
        if (e >= 5) { bc.push_back(count[i]); be.push_back(e); }
        else { pool_c += count[i]; pool_e += e; }
    }
    if (pool_e >= 5 || (pool_e > 0 && be.empty())) { bc.push_back(pool_c); be.push_back(pool_e); }
    else if (pool_e > 0) {
        const size_t k = std::min_element(be.begin(), be.end()) - be.begin();
        bc[k] += pool_c;
        be[k] += pool_e;
    }
    double stat = 0;
    for (size_t k = 0; k < be.size(); k++) stat += (bc[k] - be[k]) * (bc[k] - be[k]) / be[k];
    const int df = (int)be.size() - 1;
    const bool fit = df < 1 || stat < chi2_critical(df);
    ok = ok && outside == 0 && fit;
    printf("V %6d  logits sd %4.1f  T %.2f  top-p %.2f: nucleus %6d tokens (CPU rule %6d), mass %.6f; %d draws, "
           "%d outside, chi2 %.1f with %d dof (critical %.1f)  %s\n", V, scale, T, topp, n, keep, mass, draws, outside,
           stat, df, df >= 1 ? chi2_critical(df) : 0.0, ok ? "ok" : "FAIL");
    if (!ok) fails++;
}

int main() {
    const int VMAX = 100352;
    Lab L;
    CUDA_CHECK(cudaMalloc(&L.logits, VMAX * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&L.st, sizeof(Step)));
    CUDA_CHECK(cudaMallocHost(&L.h_st, sizeof(Step)));
    CUDA_CHECK(cudaMalloc(&L.s, sample_scratch_bytes(VMAX)));
    CUDA_CHECK(cudaHostAlloc(&L.ring_host, 2 * sizeof(Step), cudaHostAllocMapped));
    CUDA_CHECK(cudaMalloc(&L.ring_dev, 2 * sizeof(Step)));
    memset(L.h_st, 0, sizeof(Step));
    const int Vs[] = {16, 18, 2048, 2049, 5003, VMAX};
    const double scales[] = {0.5, 3.0, 10.0};
    const float params[][2] = {{0.6f, 0.95f}, {1.0f, 1.0f}, {0.8f, 0.5f}};
    for (int V : Vs)
        for (double sc : scales)
            for (auto &tp : params) one_case(L, V, sc, tp[0], tp[1], V <= 2049 ? 4000 : 8000);
    /* the whole chain at the real vocabulary, T 0.6, top-p 0.95 */
    std::vector<float> lg(VMAX);
    for (int i = 0; i < VMAX; i++) lg[i] = (float)(3.0 * nrand());
    CUDA_CHECK(cudaMemcpy(L.logits, lg.data(), VMAX * sizeof(float), cudaMemcpyHostToDevice));
    L.h_st->temperature = 0.6f; L.h_st->topp = 0.95f; L.h_st->coin = 0.3f;
    CUDA_CHECK(cudaMemcpy(L.st, L.h_st, sizeof(Step), cudaMemcpyHostToDevice));
    cudaEvent_t a, b;
    CUDA_CHECK(cudaEventCreate(&a));
    CUDA_CHECK(cudaEventCreate(&b));
    chain(L, VMAX);
    CUDA_CHECK(cudaEventRecord(a));
    const int reps = 200;
    for (int r = 0; r < reps; r++) chain(L, VMAX);
    CUDA_CHECK(cudaEventRecord(b));
    CUDA_CHECK(cudaEventSynchronize(b));
    float ms;
    CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    printf("the chain at V %d (T 0.6, top-p 0.95): %.1f us (plain launches)\n", VMAX, 1e3 * ms / reps);
    printf("%s: %d failed\n", fails ? "FAIL" : "ok", fails);
    return fails ? 1 : 0;
}
