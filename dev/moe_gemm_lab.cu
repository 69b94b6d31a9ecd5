/* dev/moe_gemm_lab.cu -- kernel lab for the MoE of many tokens (make dev/moe_gemm_lab && ./dev/moe_gemm_lab).
 *
 * The n > 1 expert path of laguna.cu on random data: routing + pair sort (route_many_topk / _scan / _scatter),
 * the inputs gathered in expert order, the tensor-core grouped GEMMs (moe_gemm: gate_up with SwiGLU fused, down)
 * and moe_combine, checked against
 *   - the one-block route_plan (top-k and weights must be bit-identical; the sort is checked exactly),
 *   - a CPU double-precision reference of the MoE output for a sample of tokens (bf16-rounded inputs as on the GPU),
 *   - the previous path (padded cublasGemmBatchedEx, or a GEMM per expert when routing is too uneven to pad),
 * with outputs poisoned (NaN) before each run and a second run compared bit for bit (determinism). Shapes: the
 * real XS-2.1 ones (E 256, top-8, H 2048, I 512) at 512 and 2048 tokens, uniform and skewed routing, and odd
 * small ones like the test fixtures. Timed with events (median of 15 after warm-up), in TFLOP/s of useful work
 * (2 P (3 H I) flops, P = pairs). Then attention_flash (see attn_case). Prints tables; exit code 1 if any check
 * fails. */
#include "../laguna.cu"

#include <algorithm>
#include <vector>

/* the one-block routing laguna.cu had before route_many_* (kept here as the lab's reference): route_token per token,
 * then counts, one scan by one warp and an atomic fill (so the order of pairs within an expert is not fixed) */
__global__ void route_plan(float *logits, const float *bias, int n, int E, int K, float softcap, int *topk_idx,
                           float *topk_w, int *start, int *pair_tok, float *pair_w, int *inv, int *active,
                           int *n_active) {
    extern __shared__ int cnt[];          /* [E] counts, then [E] fill */
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    for (int t = warp; t < n; t += nw)
        route_token(logits + (size_t)t * E, bias, E, K, softcap, topk_idx + (size_t)t * K, topk_w + (size_t)t * K);
    for (int e = threadIdx.x; e < 2 * E; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    int P = n * K;
    for (int p = threadIdx.x; p < P; p += blockDim.x) atomicAdd(&cnt[topk_idx[p]], 1);
    __syncthreads();
    if (warp == 0) {                      /* exclusive scan of the counts, and the active list, by one warp */
        int per = (E + 31) / 32, e0 = lane * per, e1 = min(E, e0 + per), s = 0, a = 0;
        for (int e = e0; e < e1; e++) { s += cnt[e]; a += cnt[e] > 0; }
        int si = s, ai = a;
        for (int o = 1; o < 32; o <<= 1) {
            int vs = __shfl_up_sync(0xffffffffu, si, o), va = __shfl_up_sync(0xffffffffu, ai, o);
            if (lane >= o) { si += vs; ai += va; }
        }
        s = si - s;
        a = ai - a;
        for (int e = e0; e < e1; e++) {
            start[e] = s;
            if (cnt[e]) active[a++] = e;
            s += cnt[e];
        }
        if (lane == 31) { start[E] = si; *n_active = ai; }
    }
    __syncthreads();
    for (int p = threadIdx.x; p < P; p += blockDim.x) {
        int e = topk_idx[p], k = start[e] + atomicAdd(&cnt[E + e], 1);
        pair_tok[k] = p / K;
        pair_w[k] = topk_w[p];
        inv[p] = k;
    }
}

static float bf2f(bf16 v) { uint16_t b; memcpy(&b, &v, 2); uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
static float round_bf(float x) { return bf2f(__float2bfloat16(x)); }

struct Timer {
    cudaEvent_t a, b;
    Timer() { CUDA_CHECK(cudaEventCreate(&a)); CUDA_CHECK(cudaEventCreate(&b)); }
    void start(cudaStream_t s) { CUDA_CHECK(cudaEventRecord(a, s)); }
    float stop_us(cudaStream_t s) { CUDA_CHECK(cudaEventRecord(b, s)); CUDA_CHECK(cudaEventSynchronize(b)); float ms; CUDA_CHECK(cudaEventElapsedTime(&ms, a, b)); return ms * 1e3f; }
};

template <typename F> static float median_us(cudaStream_t s, F f) {
    Timer t;
    for (int i = 0; i < 3; i++) f();
    std::vector<float> v;
    for (int i = 0; i < 15; i++) { t.start(s); f(); v.push_back(t.stop_us(s)); }
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

template <typename T> static T *dalloc(size_t n) { T *p; CUDA_CHECK(cudaMalloc(&p, n * sizeof(T) + 256)); return p; }
template <typename T> static std::vector<T> down(const T *d, size_t n) { std::vector<T> h(n); CUDA_CHECK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost)); return h; }
template <typename T> static void fill(T *d, size_t n, uint64_t key, float a, cudaStream_t s) {
    fill_random<T><<<grid_for(n, 256), 256, 0, s>>>(d, n, 1234, key, 0, a);
    LAUNCH_CHECK();
}

struct Case { const char *name; int n, E, K, H, I; float skew; int check; };

static int failures = 0;
#define CHECK(cond, ...) do { if (!(cond)) { failures++; printf("  FAIL: " __VA_ARGS__); printf("\n"); } } while (0)

static void run_case(const Case &cs, cublasHandle_t blas, cudaStream_t s) {
    const int n = cs.n, E = cs.E, K = cs.K, H = cs.H, I = cs.I, P = n * K, nblk = (n + ROUTE_TOK - 1) / ROUTE_TOK;
    const float scaling = 2.5f;
    /* inputs */
    float *logits0 = dalloc<float>((size_t)n * E), *logits = dalloc<float>((size_t)n * E), *bias = dalloc<float>(E);
    float *xb = dalloc<float>((size_t)n * H), *ys = dalloc<float>((size_t)n * H), *x0 = dalloc<float>((size_t)n * H);
    bf16 *wgu = dalloc<bf16>((size_t)E * 2 * I * H), *wd = dalloc<bf16>((size_t)E * H * I);
    fill(logits0, (size_t)n * E, 1, 2.0f, s);
    fill(xb, (size_t)n * H, 3, 1.7f, s);
    fill(ys, (size_t)n * H, 4, 0.1f, s);
    fill(x0, (size_t)n * H, 5, 1.0f, s);
    fill(wgu, (size_t)E * 2 * I * H, 6, sqrtf(3.0f / H), s);
    fill(wd, (size_t)E * H * I, 7, sqrtf(3.0f / I), s);
    std::vector<float> hb(E);
    for (int e = 0; e < E; e++) hb[e] = random_weight(9, E, e, 0.05f) + (e % 16 == 3 ? cs.skew : 0.0f);   /* skew: hot experts */
    CUDA_CHECK(cudaMemcpy(bias, hb.data(), E * 4, cudaMemcpyHostToDevice));
    /* routing outputs (new and old) and the MoE buffers */
    int *idx = dalloc<int>(P), *start = dalloc<int>(E + 1), *pair_tok = dalloc<int>(P), *inv = dalloc<int>(P);
    int *active = dalloc<int>(E), *n_active = dalloc<int>(1), *blk = dalloc<int>((size_t)(nblk + 1) * E), *tiles = dalloc<int>(E + 1);
    float *w = dalloc<float>(P), *pair_w = dalloc<float>(P);
    int *idx_old = dalloc<int>(P), *start_old = dalloc<int>(E + 1), *tok_old = dalloc<int>(P), *inv_old = dalloc<int>(P);
    float *w_old = dalloc<float>(P), *pw_old = dalloc<float>(P);
    bf16 *xs = dalloc<bf16>((size_t)(P + n) * H), *act = dalloc<bf16>((size_t)P * I);
    float *y = dalloc<float>((size_t)P * H), *x = dalloc<float>((size_t)n * H);
    const int bm = moe_bm(P, E);

    auto route_new = [&]() {
        CUDA_CHECK(cudaMemcpyAsync(logits, logits0, (size_t)n * E * 4, cudaMemcpyDeviceToDevice, s));
        route_many_topk<<<nblk, 256, E * sizeof(int), s>>>(logits, bias, n, E, K, 0.0f, idx, w, blk);
        LAUNCH_CHECK();
        route_many_scan<<<1, (E + 31) / 32 * 32, 0, s>>>(blk, nblk, E, bm, start, active, n_active, tiles);
        LAUNCH_CHECK();
        route_many_scatter<<<nblk, 32, E * sizeof(int), s>>>(idx, w, n, E, K, blk, pair_tok, pair_w, inv);
        LAUNCH_CHECK();
    };
    auto route_old = [&]() {
        CUDA_CHECK(cudaMemcpyAsync(logits, logits0, (size_t)n * E * 4, cudaMemcpyDeviceToDevice, s));
        route_plan<<<1, 1024, 2 * E * sizeof(int), s>>>(logits, bias, n, E, K, 0.0f, idx_old, w_old, start_old, tok_old,
                                                         pw_old, inv_old, active, n_active);
        LAUNCH_CHECK();
    };
    auto experts_new = [&]() {
        gather_rows<bf16><<<P, 256, 0, s>>>(xs, xb, pair_tok, H);
        LAUNCH_CHECK();
        moe_gemm_launch<true>(bm, xs, wgu, I, H, start, tiles, E, P, act, s);
        moe_gemm_launch<false>(bm, act, wd, H, I, start, tiles, E, P, y, s);
    };
    auto combine = [&](const int *inv_) {
        CUDA_CHECK(cudaMemcpyAsync(x, x0, (size_t)n * H * 4, cudaMemcpyDeviceToDevice, s));
        moe_combine<<<n, 256, 0, s>>>(x, y, ys, inv_, idx, w, K, H, scaling);
        LAUNCH_CHECK();
    };
    auto poison = [&]() {
        CUDA_CHECK(cudaMemsetAsync(act, 0xFF, (size_t)P * I * 2, s));
        CUDA_CHECK(cudaMemsetAsync(y, 0xFF, (size_t)P * H * 4, s));
        CUDA_CHECK(cudaMemsetAsync(xs, 0xFF, (size_t)P * H * 2, s));
    };

    /* 1. routing: identical to route_plan, and a valid deterministic sort */
    route_old();
    poison();
    route_new();
    CUDA_CHECK(cudaStreamSynchronize(s));
    auto hi = down(idx, P), hio = down(idx_old, P), hst = down(start, E + 1), htok = down(pair_tok, P), hinv = down(inv, P);
    auto hw = down(w, P), hwo = down(w_old, P), hpw = down(pair_w, P);
    auto hts = down(tiles, E + 1), hact = down(active, E);
    auto hna = down(n_active, 1);
    CHECK(!memcmp(hi.data(), hio.data(), P * 4) && !memcmp(hw.data(), hwo.data(), P * 4), "top-k differs from route_plan");
    std::vector<int> cnt(E, 0);
    for (int p = 0; p < P; p++) cnt[hi[p]]++;
    int bad = 0, na = 0, ts = 0, maxc = 0;
    for (int e = 0, s0 = 0; e < E; e++) {
        bad += hst[e] != s0 || hts[e] != ts;
        if (cnt[e]) bad += hact[na++] != e;
        s0 += cnt[e]; ts += (cnt[e] + bm - 1) / bm; maxc = std::max(maxc, cnt[e]);
    }
    bad += hst[E] != P || hts[E] != ts || hna[0] != na;
    for (int p = 0; p < P; p++) {
        int k = hinv[p], e = hi[p];
        bad += k < hst[e] || k >= hst[e + 1] || htok[k] != p / K || hpw[k] != hw[p];
        if (k > hst[e]) bad += htok[k - 1] >= p / K;            /* ascending tokens within an expert */
    }
    CHECK(bad == 0, "pair sort: %d inconsistencies", bad);

    /* 2. experts + combine vs a CPU reference on sampled tokens */
    experts_new();
    combine(inv);
    CUDA_CHECK(cudaStreamSynchronize(s));
    auto hx = down(x, (size_t)n * H);
    auto hxb = down(xb, (size_t)n * H), hys = down(ys, (size_t)n * H), hx0 = down(x0, (size_t)n * H);
    auto hgu = down(wgu, (size_t)E * 2 * I * H), hd = down(wd, (size_t)E * H * I);
    int step = std::max(1, n / cs.check);
    double err2 = 0, ref2 = 0, maxerr = 0;
    int nan = 0, checked = 0;
    std::vector<double> acc(H), h(I);
    std::vector<float> xr(H);
    for (int t = 0; t < n; t += step, checked++) {
        for (int i = 0; i < H; i++) xr[i] = round_bf(hxb[(size_t)t * H + i]);
        std::fill(acc.begin(), acc.end(), 0.0);
        std::vector<int> ord(K);
        for (int j = 0; j < K; j++) ord[j] = j;
        std::sort(ord.begin(), ord.end(), [&](int a, int b) { return hi[t * K + a] < hi[t * K + b]; });
        for (int j : ord) {
            int e = hi[t * K + j];
            const bf16 *G = hgu.data() + (size_t)e * 2 * I * H, *D = hd.data() + (size_t)e * H * I;
            for (int i = 0; i < I; i++) {
                double gs = 0, us = 0;
                for (int k = 0; k < H; k++) { gs += (double)bf2f(G[(size_t)i * H + k]) * xr[k]; us += (double)bf2f(G[(size_t)(I + i) * H + k]) * xr[k]; }
                h[i] = round_bf((float)(gs / (1.0 + exp(-gs)) * us));
            }
            for (int o = 0; o < H; o++) {
                double d = 0;
                for (int i = 0; i < I; i++) d += (double)bf2f(D[(size_t)o * I + i]) * h[i];
                acc[o] += hw[t * K + j] * d;
            }
        }
        for (int o = 0; o < H; o++) {
            double r = acc[o] * scaling, got = hx[(size_t)t * H + o] - hx0[(size_t)t * H + o] - hys[(size_t)t * H + o];
            if (!std::isfinite(hx[(size_t)t * H + o])) nan++;
            err2 += (got - r) * (got - r); ref2 += r * r;
            maxerr = std::max(maxerr, fabs(got - r));
        }
    }
    double rel = sqrt(err2 / std::max(ref2, 1e-30));
    CHECK(nan == 0 && rel < 2e-3, "MoE output vs CPU: rel %.3g, %d non-finite", rel, nan);

    /* 3. determinism: a second run, bit for bit */
    poison();
    route_new();
    experts_new();
    combine(inv);
    CUDA_CHECK(cudaStreamSynchronize(s));
    auto hx2 = down(x, (size_t)n * H);
    CHECK(!memcmp(hx.data(), hx2.data(), hx.size() * 4), "second run differs");

    /* 4. the previous path: padded batched GEMM (or a GEMM per expert), same combine */
    bool padded = (size_t)na * maxc <= 2 * (size_t)P;
    size_t hrows = padded ? (size_t)na * maxc : (size_t)P;
    float *hbuf = dalloc<float>(hrows * 2 * I), *ybuf = dalloc<float>(hrows * H);
    bf16 *abuf = dalloc<bf16>(hrows * I);
    void **dp = dalloc<void *>(6 * (size_t)E + E);
    std::vector<void *> hp(7 * (size_t)E);
    int *inv2 = dalloc<int>(P);
    const float one = 1.0f, zero = 0.0f;
    auto experts_old = [&]() {
        gather_rows<bf16><<<P, 256, 0, s>>>(xs, xb, pair_tok, H);
        LAUNCH_CHECK();
        CUDA_CHECK(cudaStreamSynchronize(s));                     /* the old path's host round trip */
        int *rank = (int *)(hp.data() + 6 * (size_t)E), a = 0;
        for (int e = 0; e < E; e++) {
            rank[e] = a;
            if (!cnt[e]) continue;
            hp[0 * E + a] = wgu + (size_t)e * 2 * I * H; hp[1 * E + a] = xs + (size_t)hst[e] * H;
            hp[2 * E + a] = hbuf + (size_t)a * maxc * 2 * I; hp[3 * E + a] = wd + (size_t)e * H * I;
            hp[4 * E + a] = abuf + (size_t)a * maxc * I; hp[5 * E + a] = ybuf + (size_t)a * maxc * H;
            a++;
        }
        if (padded) {
            CUDA_CHECK(cudaMemcpyAsync(dp, hp.data(), 7 * (size_t)E * sizeof(void *), cudaMemcpyHostToDevice, s));
            CUBLAS_CHECK(cublasGemmBatchedEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, 2 * I, maxc, H, &one, (const void *const *)dp, CUDA_R_16BF, H,
                                             (const void *const *)(dp + E), CUDA_R_16BF, H, &zero, (void *const *)(dp + 2 * E), CUDA_R_32F,
                                             2 * I, na, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
            swiglu_kernel<bf16><<<grid_for((size_t)na * maxc * I, 256), 256, 0, s>>>(abuf, hbuf, (size_t)na * maxc, I);
            LAUNCH_CHECK();
            CUBLAS_CHECK(cublasGemmBatchedEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, H, maxc, I, &one, (const void *const *)(dp + 3 * E), CUDA_R_16BF, I,
                                             (const void *const *)(dp + 4 * E), CUDA_R_16BF, I, &zero, (void *const *)(dp + 5 * E), CUDA_R_32F,
                                             H, na, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
            CUDA_CHECK(cudaMemcpyAsync(inv2, inv, P * 4, cudaMemcpyDeviceToDevice, s));
            remap_pairs<<<(P + 255) / 256, 256, 0, s>>>(inv2, idx, start, (const int *)(dp + 6 * (size_t)E), maxc, P);
            LAUNCH_CHECK();
        } else {
            for (int e = 0; e < E; e++) if (cnt[e])
                CUBLAS_CHECK(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, 2 * I, cnt[e], H, &one, wgu + (size_t)e * 2 * I * H, CUDA_R_16BF, H,
                                          xs + (size_t)hst[e] * H, CUDA_R_16BF, H, &zero, hbuf + (size_t)hst[e] * 2 * I, CUDA_R_32F, 2 * I,
                                          CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
            swiglu_kernel<bf16><<<grid_for((size_t)P * I, 256), 256, 0, s>>>(abuf, hbuf, P, I);
            LAUNCH_CHECK();
            for (int e = 0; e < E; e++) if (cnt[e])
                CUBLAS_CHECK(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, H, cnt[e], I, &one, wd + (size_t)e * H * I, CUDA_R_16BF, I,
                                          abuf + (size_t)hst[e] * I, CUDA_R_16BF, I, &zero, ybuf + (size_t)hst[e] * H, CUDA_R_32F, H,
                                          CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
            CUDA_CHECK(cudaMemcpyAsync(inv2, inv, P * 4, cudaMemcpyDeviceToDevice, s));
        }
    };
    experts_old();
    CUDA_CHECK(cudaMemcpyAsync(x, x0, (size_t)n * H * 4, cudaMemcpyDeviceToDevice, s));
    moe_combine<<<n, 256, 0, s>>>(x, ybuf, ys, inv2, idx, w, K, H, scaling);
    LAUNCH_CHECK();
    CUDA_CHECK(cudaStreamSynchronize(s));
    auto hx3 = down(x, (size_t)n * H);
    double d2 = 0, r2 = 0;
    for (size_t i = 0; i < hx.size(); i++) { double d = hx[i] - hx3[i], r = hx3[i] - hx0[i] - hys[i]; d2 += d * d; r2 += r * r; }
    double rel_old = sqrt(d2 / std::max(r2, 1e-30));
    CHECK(rel_old < 2e-3, "new vs previous path: rel %.3g", rel_old);

    /* 5. timing */
    float t_route_old = median_us(s, route_old), t_route_new = median_us(s, route_new);
    float t_new = median_us(s, experts_new), t_old = median_us(s, experts_old);
    float t_gu = median_us(s, [&]() { moe_gemm_launch<true>(bm, xs, wgu, I, H, start, tiles, E, P, act, s); });
    float t_dn = median_us(s, [&]() { moe_gemm_launch<false>(bm, act, wd, H, I, start, tiles, E, P, y, s); });
    double fl = 2.0 * P * 3.0 * H * I;
    printf("| %s | %d | %d/%d | %d | %d/%d | %s | %.3g | %.3g | %.1f / %.1f | %.1f (%.1f + %.1f) | %.0f | %.1f %s | %.1f |\n",
           cs.name, n, E, K, bm, na, maxc, checked == n ? "all" : "sample", rel, rel_old, t_route_old, t_route_new, t_new,
           t_gu, t_dn, fl / t_new * 1e-6, t_old, padded ? "padded" : "per-expert", fl / t_old * 1e-6);
    fflush(stdout);
    void *fr[] = {logits0, logits, bias, xb, ys, x0, wgu, wd, idx, start, pair_tok, inv, active, n_active, blk, tiles, w, pair_w,
                  idx_old, start_old, tok_old, inv_old, w_old, pw_old, xs, act, y, x, hbuf, ybuf, abuf, dp, inv2};
    for (void *p : fr) CUDA_CHECK(cudaFree(p));
}

/* attention_flash (double-buffered, masks on boundary tiles only, the rows finished in the kernel with one split)
 * against attention_scalar + attention_combine (fp32 math on the same bf16 cache) on every row, and against
 * itself with 4 splits (the combine path); head_dim 128, per-head gate; timed in TFLOP/s of causal work. */
static void attn_case(const char *name, int n, int pos, int nh, int nkv, int window, bool check, cudaStream_t s) {
    const int D = 128, KVD = nkv * D, g = nh / nkv, NQ = nh * D + 2 * KVD + nh, gate_off = nh * D + 2 * KVD;
    const int rows = window ? window + n - 1 : pos + n;
    const float scale_log2 = 1.4426950408889634f / sqrtf((float)D);
    float *qkvg = dalloc<float>((size_t)n * NQ), *att = dalloc<float>((size_t)n * nh * D), *ref = dalloc<float>((size_t)n * nh * D);
    size_t pcap = (size_t)n * nh * 4;
    float *part_o = dalloc<float>(pcap * D);
    float2 *part_ml = dalloc<float2>(pcap);
    bf16 *kc = dalloc<bf16>((size_t)rows * KVD), *vc = dalloc<bf16>((size_t)rows * KVD);
    int *pos_d = dalloc<int>(1);
    CUDA_CHECK(cudaMemcpy(pos_d, &pos, 4, cudaMemcpyHostToDevice));
    fill(qkvg, (size_t)n * NQ, 21, 2.0f, s);
    fill(kc, (size_t)rows * KVD, 22, 2.0f, s);
    fill(vc, (size_t)rows * KVD, 23, 1.0f, s);
    const int warps = n * g <= 16 ? 1 : 4, rb = (n * g + 16 * warps - 1) / (16 * warps);
    auto flash = [&](int nsplit, float *out) {
        dim3 grid(rb, nkv, nsplit);
        if (warps == 1) attention_flash<bf16, 128, 1><<<grid, 32, flash_smem_bytes(128), s>>>(qkvg, NQ, n, g, nh, kc, vc, rows, KVD,
            pos_d, window, 1 /* causal */, nsplit, part_o, part_ml, scale_log2, out, gate_off, 1, (bf16 *)NULL, FlashLong{});
        else attention_flash<bf16, 128, 4><<<grid, 128, flash_smem_bytes(128), s>>>(qkvg, NQ, n, g, nh, kc, vc, rows, KVD,
            pos_d, window, 1 /* causal */, nsplit, part_o, part_ml, scale_log2, out, gate_off, 1, (bf16 *)NULL, FlashLong{});
        LAUNCH_CHECK();
        if (nsplit > 1) {
            attention_combine<<<n * nh, D, 0, s>>>(out, part_o, part_ml, nsplit, nh, D, qkvg, NQ, gate_off, 1, (bf16 *)NULL);
            LAUNCH_CHECK();
        }
    };
    double keys = 0;                                 /* causal (and windowed) keys summed over tokens */
    for (int t = 0; t < n; t++) { int p = pos + t; keys += window ? std::min(window, p + 1) : p + 1; }
    double fl = 4.0 * D * nh * keys;
    double rel = -1, rel_split = -1;
    int nsplit_big = std::min(4, (window ? window + n : pos + n) / 64 + 1);
    if (check) {
        attention_scalar<bf16><<<dim3(n, nh), 32, 0, s>>>(qkvg, NQ, n, g, nh, D, kc, vc, rows, KVD, pos_d, window, 1 /* causal */, part_o,
                                                          part_ml, scale_log2);
        LAUNCH_CHECK();
        attention_combine<<<n * nh, D, 0, s>>>(ref, part_o, part_ml, 1, nh, D, qkvg, NQ, gate_off, 1, (bf16 *)NULL);
        LAUNCH_CHECK();
        auto compare = [&](int nsplit) {
            CUDA_CHECK(cudaMemsetAsync(att, 0xFF, (size_t)n * nh * D * 4, s));
            flash(nsplit, att);
            CUDA_CHECK(cudaStreamSynchronize(s));
            auto a = down(att, (size_t)n * nh * D), r = down(ref, (size_t)n * nh * D);
            double e2 = 0, r2 = 0;
            int nan = 0;
            for (size_t i = 0; i < a.size(); i++) { if (!std::isfinite(a[i])) nan++; e2 += (a[i] - r[i]) * (a[i] - r[i]); r2 += (double)r[i] * r[i]; }
            return nan ? 1e30 : sqrt(e2 / r2);
        };
        rel = compare(1);
        rel_split = compare(nsplit_big);
        CHECK(rel < 1e-2 && rel_split < 1e-2, "%s: flash vs scalar rel %.3g, with %d splits %.3g", name, rel, nsplit_big, rel_split);
    }
    float us = median_us(s, [&]() { flash(1, att); });
    printf("| %s | %d | %d | %d/%d | %s | %.3g | %.3g | %.1f | %.0f |\n", name, n, pos, nh, nkv, window ? "sliding" : "full",
           rel, rel_split, us, fl / us * 1e-6);
    fflush(stdout);
    void *fr[] = {qkvg, att, ref, part_o, part_ml, kc, vc, pos_d};
    for (void *p : fr) CUDA_CHECK(cudaFree(p));
}

int main() {
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    printf("%s, %d SMs\n\n", prop.name, prop.multiProcessorCount);
    cudaStream_t s;
    CUDA_CHECK(cudaStreamCreate(&s));
    cublasHandle_t blas;
    CUBLAS_CHECK(cublasCreate(&blas));
    CUBLAS_CHECK(cublasSetStream(blas, s));
    prefill_kernels_setup();
    Case cases[] = {
        {"XS-2.1", 2048, 256, 8, 2048, 512, 0.0f, 48},
        {"XS-2.1 skewed (16 hot experts)", 2048, 256, 8, 2048, 512, 3.0f, 48},
        {"XS-2.1", 512, 256, 8, 2048, 512, 0.0f, 48},
        {"XS-2.1", 65, 256, 8, 2048, 512, 0.0f, 65},
        {"fixture-like H64 I32", 300, 8, 3, 64, 32, 0.0f, 1 << 30},
        {"odd H72 I40", 777, 16, 4, 72, 40, 0.5f, 1 << 30},
        {"many experts H136 I24", 1000, 1000, 5, 136, 24, 0.0f, 1 << 30},
        {"one expert H64 I8", 70, 1, 1, 64, 8, 0.0f, 1 << 30},
    };
    printf("| case | tokens | E/top-k | BM | active/max pairs | checked | rel err vs CPU | vs previous | route_plan / route_many us | "
           "new experts us (gate_up + down) | TFLOP/s | previous us | TFLOP/s |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (auto &c : cases) run_case(c, blas, s);
    printf("\n| attention | tokens | pos | heads/kv | layer | rel err vs scalar | 4 splits | us | TFLOP/s |\n|---|---|---|---|---|---|---|---|---|\n");
    attn_case("prefill chunk, full", 2048, 14336, 48, 8, 0, true, s);
    attn_case("prefill chunk, sliding ring", 2048, 5000, 64, 8, 512, true, s);
    attn_case("odd: 37 tokens, group 3, window 5", 37, 100, 6, 2, 5, true, s);
    attn_case("decode-like: 1 token", 1, 3000, 48, 8, 0, true, s);
    attn_case("verify: 16 tokens", 16, 3000, 48, 8, 0, true, s);
    attn_case("last chunk of 131072, full", 2048, 129024, 48, 8, 0, false, s);
    printf("\n%s\n", failures ? "SOME CHECKS FAILED" : "all checks passed");
    return failures ? 1 : 0;
}
