/* dev/few_lab.cu -- kernel lab for the few-token tensor-core kernels (make dev/few_lab && ./dev/few_lab).
 *
 * gemm_few (y = W x for 2..16 tokens, bf16 / q8 / q4 W, x in bf16 or f32) and the experts' moe_gate_up_few /
 * moe_down_few (bf16 / q8 / q4) on random data, checked against a CPU double-precision reference on the same
 * bf16-rounded inputs (q8 / q4: the bf16 values of value * scale, what the kernels make in registers), and timed against
 * cuBLAS (what n > 1 GEMMs used before) and the warp-per-row expert kernels (moe_gate_up / moe_down). Shapes: the
 * XS-2.1 verification's (q/k/v/g 10304 x 2048, o_proj 2048 x 8192, the router 256 x 2048, lm_head 100352 x 2048; 16
 * tokens top-8 of 256 experts, I 512, shared 512) and odd small ones (rows not a multiple of 16, K not a multiple
 * of 32, fewer than 8 tokens). Matrices smaller than 256 MB are timed over rotating copies so L2 does not serve
 * them. GB/s = weight bytes / time. Exit code 1 if a check fails. `./dev/few_lab experts` runs the MoE cases alone
 * (`experts-q`: the q8 / q4 ones); their timed cases also sweep the expert kernels' MINB (blocks an SM their registers allow), U (chunks in flight)
 * and WF (few_rows' load order), and KC / ST (the weights through a ring of shared memory, few_rows_staged),
 * each variant's outputs bit-equal to those of the variant the model takes (few_moe_pick); `./dev/few_lab gemm-sweep`
 * does the same for gemm_few at the verification's shapes. */
#include "../laguna.cu"
#include "lab_graph.h"

#include <algorithm>
#include <vector>

static float bf2f(bf16 v) { uint16_t b; memcpy(&b, &v, 2); uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
static uint64_t rng = 88172645463325252ull;
static float urand() { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return (float)((rng >> 11) * (1.0 / 9007199254740992.0)) * 2 - 1; }
static int fails = 0;

static std::vector<bf16> rand_bf(size_t n, float a) {
    std::vector<bf16> v(n);
    for (size_t i = 0; i < n; i++) v[i] = __float2bfloat16(a * urand());
    return v;
}
template <typename T> static T *up(const std::vector<T> &v) {
    T *d;
    CUDA_CHECK(cudaMalloc(&d, v.size() * sizeof(T)));
    CUDA_CHECK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
}
static void check(const char *what, double err, double bar) {
    if (!(err <= bar)) fails++;
    printf("  %-44s max |err| / scale %.2e (bar %.0e)%s\n", what, err, bar, err <= bar ? "" : "  FAIL");
}

/* a random matrix of `rows` x `in` in format W as the file holds it (bytes: q8 / q4 values and fp16 scales planar,
 * rows padded to whole groups of 32) and the bf16 values the kernels must use (ref; q8 / q4: value * scale rounded
 * to bf16, as dequant_kernel writes them), weights of magnitude up to about a */
template <typename W> struct LabMat { std::vector<bf16> ref; std::vector<uint8_t> bytes; };
template <typename W> static LabMat<W> lab_mat(int rows, int in, float a) {
    LabMat<W> m;
    if constexpr (!is_q<W>) {
        m.ref = rand_bf((size_t)rows * in, a);
        m.bytes.resize(m.ref.size() * 2);
        memcpy(m.bytes.data(), m.ref.data(), m.bytes.size());
    } else {
        const int dt = Fmt<W>::DT, groups = (in + 31) / 32, gb = Fmt<W>::GB;
        const size_t vb = (size_t)rows * groups * gb;
        m.bytes.assign(vb + (size_t)rows * groups * 2, 0);
        uint16_t *scales = (uint16_t *)(m.bytes.data() + vb);
        m.ref.resize((size_t)rows * in);
        for (int r = 0; r < rows; r++)
            for (int gi = 0; gi < groups; gi++) {
                __half h = __float2half(a * (0.5f + 0.25f * (urand() + 1.0f)) / (dt == DT_Q8 ? 127.0f : 8.0f));
                memcpy(&scales[(size_t)r * groups + gi], &h, 2);
                const float sc = __half2float(h);
                uint8_t *row = m.bytes.data() + (size_t)r * groups * gb;
                for (int i = 0; i < 32 && gi * 32 + i < in; i++) {
                    const int k = gi * 32 + i;
                    int v = dt == DT_Q8 ? (int)lrintf(127.0f * urand()) : (int)lrintf(7.5f * urand() + 7.5f) - 8;
                    if (dt == DT_Q8) row[k] = (uint8_t)(int8_t)v;
                    else row[k / 2] |= (uint8_t)((v + 8) << (4 * (k & 1)));
                    m.ref[(size_t)r * in + k] = __float2bfloat16((float)v * sc);
                }
            }
    }
    return m;
}
/* `copies` copies of m's bytes on the device, one after the other */
template <typename W> static uint8_t *up_copies(const LabMat<W> &m, int copies) {
    uint8_t *d;
    CUDA_CHECK(cudaMalloc(&d, m.bytes.size() * copies));
    for (int c = 0; c < copies; c++)
        CUDA_CHECK(cudaMemcpy(d + m.bytes.size() * c, m.bytes.data(), m.bytes.size(), cudaMemcpyHostToDevice));
    return d;
}

/* gemm_few for one shape and token count (W: bf16, or q8 / q4 dequantized in registers), x in bf16 (xf32 = 0) or f32;
 * beta 1 checks the accumulate. Timed against what gemm() does otherwise: cuBLAS on the bf16 matrix, or for q8 / q4
 * dequant_kernel to a bf16 matrix, then cuBLAS. GB/s = the matrix's bytes in the file / time. */
template <typename W>
static void gemm_case(GpuModel *g, cublasHandle_t blas, int out, int in, int n, int xf32, float beta, int timed) {
    const int dt = Fmt<W>::DT;
    const LabMat<W> m = lab_mat<W>(out, in, 0.05f);
    const size_t mb = m.bytes.size();
    int copies = timed ? (int)std::min<size_t>(64, std::max<size_t>(1, (256ull << 20) / mb + 1)) : 1;
    std::vector<bf16> xb = rand_bf((size_t)n * in, 1.0f);
    std::vector<float> xf((size_t)n * in), y0((size_t)n * out);
    for (size_t i = 0; i < xf.size(); i++) xf[i] = xf32 ? urand() : bf2f(xb[i]);
    for (auto &v : y0) v = urand();
    uint8_t *dw = up_copies(m, copies);
    bf16 *dxb = up(xb);
    float *dxf = up(xf), *dy = up(y0);
    const void *x = xf32 ? (const void *)dxf : (const void *)dxb;
    gemm_few_launch(g, dy, out, dt, dw, out, in, x, !xf32, n, beta);
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> y((size_t)n * out);
    CUDA_CHECK(cudaMemcpy(y.data(), dy, y.size() * 4, cudaMemcpyDeviceToHost));
    double err = 0, scale = 0;
    for (int t = 0; t < n; t++)
        for (int r = 0; r < out; r++) {
            double s = 0;
            for (int k = 0; k < in; k++) s += (double)bf2f(m.ref[(size_t)r * in + k]) * bf2f(__float2bfloat16(xf[(size_t)t * in + k]));
            s += beta * y0[(size_t)t * out + r];
            err = std::max(err, fabs(s - y[(size_t)t * out + r]));
            scale = std::max(scale, fabs(s));
        }
    char what[96];
    snprintf(what, sizeof what, "%s%6d x %5d, %2d tokens, x %s, beta %g", dt == DT_Q8 ? "q8 " : dt == DT_Q4 ? "q4 " : "",
             out, in, n, xf32 ? "f32" : "bf16", beta);
    check(what, err / scale, 1e-5);
    if (timed) {
        const float one = 1.0f, zero = 0.0f;
        bf16 *dq = NULL;                                     /* q8 / q4: the dequantized copy */
        if (is_q<W>) CUDA_CHECK(cudaMalloc(&dq, (size_t)out * in * 2));
        float t_few = time_ms([&](int i) { gemm_few_launch(g, dy, out, dt, dw + mb * (i % copies), out, in, x, !xf32, n, 0.0f); }, 50);
        float t_blas = time_ms([&](int i) {
            const bf16 *wb = (const bf16 *)(dw + mb * (i % copies));
            if constexpr (is_q<W>) {
                const size_t chunks = (size_t)out * ((in + 31) / 32) * (dt == DT_Q8 ? 2 : 1);
                dequant_kernel<W, bf16><<<grid_for(chunks, 256), 256>>>(dq, wmat(dt, wb, out, in), in, out, 0, NULL, NULL);
                wb = dq;
            }
            CUBLAS_CHECK(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, &one, wb, CUDA_R_16BF, in,
                                      dxb, CUDA_R_16BF, in, &zero, dy, CUDA_R_32F, out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        }, 50);
        printf("    gemm_few %7.2f us (%6.0f GB/s)   %s %7.2f us (%6.0f GB/s)\n", 1e3 * t_few, mb / (1e6 * t_few),
               is_q<W> ? "dequantize + cuBLAS" : "cuBLAS", 1e3 * t_blas, mb / (1e6 * t_blas));
        if (dq) CUDA_CHECK(cudaFree(dq));
    }
    CUDA_CHECK(cudaFree(dw)); CUDA_CHECK(cudaFree(dxb)); CUDA_CHECK(cudaFree(dxf)); CUDA_CHECK(cudaFree(dy));
}

/* gemm_few's occupancy (MINB blocks an SM its registers allow) and chunks in flight (U), for n tokens (HALVES 2 above
 * 8, else 1) and bf16 x at gemm_few_launch's KS: us a call, each variant's output bit-equal to the default's (1/4) */
template <typename W> static void gemm_sweep(int out, int in, int n, int nsm) {
    const LabMat<W> m = lab_mat<W>(out, in, 0.05f);
    const size_t mb = m.bytes.size();
    const int copies = (int)std::min<size_t>(64, std::max<size_t>(1, (256ull << 20) / mb + 1));
    uint8_t *dw = up_copies(m, copies);
    bf16 *dx = up(rand_bf((size_t)n * in, 1.0f));
    float *dy;
    CUDA_CHECK(cudaMalloc(&dy, (size_t)n * out * 4));
    const int dt = Fmt<W>::DT, tiles = (out + 15) / 16;
    int ks = 1;
    while (ks < 8 && (tiles * ks + 7) / 8 < 2 * nsm) ks *= 2;
    std::vector<float> ref((size_t)n * out), y((size_t)n * out);
    printf("  %s%d x %d, %d tokens, KS %d:", dt == DT_Q8 ? "q8 " : dt == DT_Q4 ? "q4 " : "", out, in, n, ks);
    auto variant = [&](auto mbc, auto uc, int first) {
        constexpr int MB = decltype(mbc)::value, U = decltype(uc)::value;
        auto go = [&](int i) {
            const WPtr w = wmat(dt, dw + mb * (i % copies), out, in);
            const dim3 grid((tiles * ks + 7) / 8);
            auto launch = [&](auto ksc, auto hc) {
                gemm_few<W, bf16, decltype(ksc)::value, decltype(hc)::value, MB, U><<<grid, 256>>>(dy, out, w, out, in,
                                                                                                   dx, n, 0.0f);
            };
            auto by_ks = [&](auto hc) {
                switch (ks) {
                case 1: launch(IntC<1>(), hc); break;
                case 2: launch(IntC<2>(), hc); break;
                case 4: launch(IntC<4>(), hc); break;
                default: launch(IntC<8>(), hc);
                }
            };
            if (n > 8) by_ks(IntC<2>()); else by_ks(IntC<1>());
        };
        const float t = time_ms(go, 50);
        go(0);
        CUDA_CHECK(cudaMemcpy(y.data(), dy, y.size() * 4, cudaMemcpyDeviceToHost));
        if (first) ref = y;
        const int same = !memcmp(y.data(), ref.data(), y.size() * 4);
        if (!same) fails++;
        printf("  %d/%d %.2f%s", MB, U, 1e3 * t, same ? "" : " DIFFERS");
    };
    variant(IntC<1>(), IntC<4>(), 1);
    variant(IntC<3>(), IntC<2>(), 0);
    variant(IntC<3>(), IntC<3>(), 0);
    variant(IntC<4>(), IntC<2>(), 0);
    variant(IntC<2>(), IntC<6>(), 0);
    variant(IntC<4>(), IntC<3>(), 0);
    variant(IntC<2>(), IntC<4>(), 0);
    printf("\n");
    CUDA_CHECK(cudaFree(dw)); CUDA_CHECK(cudaFree(dx)); CUDA_CHECK(cudaFree(dy));
}

/* the experts of n tokens (top-K of E, uniform routing; W: the experts' format): moe_gate_up_few + moe_down_few
 * against the CPU, timed against moe_gate_up + moe_down (the warp-per-row kernels, f32 activations) */
template <typename W>
static void moe_case(int E, int K, int H, int I, int S, int n, int timed) {
    std::vector<int> topk(n * K);
    for (int t = 0; t < n; t++)
        for (int j = 0; j < K; j++) {
            int e;
            do { e = (int)((urand() + 1) * 0.5f * E) % E; } while (std::find(&topk[t * K], &topk[t * K + j], e) != &topk[t * K + j]);
            topk[t * K + j] = e;
        }
    std::vector<int> start(E + 1, 0), active, pair_tok;   /* pairs sorted by expert, then token */
    for (int p = 0; p < n * K; p++) start[topk[p] + 1]++;
    for (int e = 0; e < E; e++) { if (start[e + 1]) active.push_back(e); start[e + 1] += start[e]; }
    for (int e = 0; e < E; e++)
        for (int p = 0; p < n * K; p++) if (topk[p] == e) pair_tok.push_back(p / K);
    int na = (int)active.size(), P = n * K, max_active = std::min(P, E);
    const int dt = Fmt<W>::DT;
    const LabMat<W> mgu = lab_mat<W>(E * 2 * I, H, 0.05f), mdn = lab_mat<W>(E * H, I, 0.05f),
                    msgu = lab_mat<W>(2 * S, H, 0.05f), msdn = lab_mat<W>(H, S, 0.05f);
    const std::vector<bf16> &egu = mgu.ref, &edn = mdn.ref, &sgu = msgu.ref, &sdn = msdn.ref;
    uint8_t *d_egu = up_copies(mgu, 1), *d_edn = up_copies(mdn, 1), *d_sgu = up_copies(msgu, 1), *d_sdn = up_copies(msdn, 1);
    const WPtr w_egu = wmat(dt, d_egu, (size_t)E * 2 * I, H), w_edn = wmat(dt, d_edn, (size_t)E * H, I),
               w_sgu = wmat(dt, d_sgu, 2 * (size_t)S, H), w_sdn = wmat(dt, d_sdn, H, S);
    std::vector<bf16> x = rand_bf((size_t)n * H, 1.0f);
    std::vector<float> xf((size_t)n * H);
    for (size_t i = 0; i < xf.size(); i++) xf[i] = bf2f(x[i]);
    bf16 *d_x = up(x);
    float *d_xf = up(xf);
    std::vector<int> na_v(1, na);
    int *d_start = up(start), *d_active = up(active), *d_tok = up(pair_tok), *d_na = up(na_v);
    bf16 *d_act;
    float *d_yp, *d_ys, *d_hp, *d_hs;
    CUDA_CHECK(cudaMalloc(&d_act, ((size_t)P * I + (size_t)n * S) * 2));
    CUDA_CHECK(cudaMalloc(&d_yp, (size_t)P * H * 4));
    CUDA_CHECK(cudaMalloc(&d_ys, (size_t)n * H * 4));
    CUDA_CHECK(cudaMalloc(&d_hp, (size_t)P * I * 4));
    CUDA_CHECK(cudaMalloc(&d_hs, (size_t)n * S * 4));
    bf16 *d_acts = d_act + (size_t)P * I;
    /* the two kernels at template arguments (MINB, U, U2, WF, KC, ST), IntC values; run_few: the model's pick */
    auto gate_up = [&](auto mb, auto u, auto u2, auto wf, auto kc, auto st) {
        auto k = moe_gate_up_few<W, decltype(mb)::value, decltype(u)::value, decltype(u2)::value,
                                 (bool)decltype(wf)::value, decltype(kc)::value, decltype(st)::value>;
        const size_t ring = few_ring_bytes<W>(decltype(kc)::value, decltype(st)::value);
        allow_smem((const void *)k, ring);
        k<<<max_active * ((I + 63) / 64) + (S + 63) / 64, 256, ring>>>(w_egu, I, w_sgu, S, H, d_x, n, d_start, d_tok,
                                                                      d_active, d_na, max_active, d_act, d_acts);
    };
    auto down = [&](auto mb, auto u, auto u2, auto wf, auto kc, auto st) {
        auto k = moe_down_few<W, decltype(mb)::value, decltype(u)::value, decltype(u2)::value,
                              (bool)decltype(wf)::value, decltype(kc)::value, decltype(st)::value>;
        const size_t ring = few_ring_bytes<W>(decltype(kc)::value, decltype(st)::value);
        allow_smem((const void *)k, ring);
        k<<<(max_active + 1) * ((H + 127) / 128), 256, ring>>>(w_edn, I, w_sdn, S, H, n, d_start, d_active, d_na,
                                                               max_active, d_act, d_acts, d_yp, d_ys);
    };
    auto run_few = [&]() {
        few_moe_pick<W>(n, [&](auto mb, auto u, auto u2, auto wf, auto kc, auto st) {
            gate_up(mb, u, u2, wf, kc, st);
            down(mb, u, u2, wf, kc, st);
        });
    };
    run_few();
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<bf16> act((size_t)P * I + (size_t)n * S);
    std::vector<float> yp((size_t)P * H), ys((size_t)n * H);
    CUDA_CHECK(cudaMemcpy(act.data(), d_act, act.size() * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(yp.data(), d_yp, yp.size() * 4, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(ys.data(), d_ys, ys.size() * 4, cudaMemcpyDeviceToHost));
    /* CPU: gate/up of every pair and token (double), against the kernel's bf16 SwiGLU; down from the kernel's act */
    double e_act = 0, s_act = 0, e_y = 0, s_y = 0;
    auto gu = [&](const bf16 *wg, const bf16 *wu, int t) {
        double a = 0, b = 0;
        for (int k = 0; k < H; k++) { a += (double)bf2f(wg[k]) * xf[(size_t)t * H + k]; b += (double)bf2f(wu[k]) * xf[(size_t)t * H + k]; }
        return a / (1 + exp(-a)) * b;
    };
    for (int e = 0; e < E; e++)
        for (int p = start[e]; p < start[e + 1]; p++)
            for (int j = 0; j < I; j++) {
                double r = gu(&egu[((size_t)e * 2 * I + j) * H], &egu[((size_t)e * 2 * I + I + j) * H], pair_tok[p]);
                e_act = std::max(e_act, fabs(r - bf2f(act[(size_t)p * I + j])));
                s_act = std::max(s_act, fabs(r));
            }
    for (int t = 0; t < n; t++)
        for (int j = 0; j < S; j++) {
            double r = gu(&sgu[(size_t)j * H], &sgu[(size_t)(S + j) * H], t);
            e_act = std::max(e_act, fabs(r - bf2f(act[(size_t)P * I + (size_t)t * S + j])));
            s_act = std::max(s_act, fabs(r));
        }
    for (int e = 0; e < E; e++)
        for (int p = start[e]; p < start[e + 1]; p++)
            for (int r = 0; r < H; r++) {
                double s = 0;
                for (int k = 0; k < I; k++) s += (double)bf2f(edn[((size_t)e * H + r) * I + k]) * bf2f(act[(size_t)p * I + k]);
                e_y = std::max(e_y, fabs(s - yp[(size_t)p * H + r]));
                s_y = std::max(s_y, fabs(s));
            }
    for (int t = 0; t < n; t++)
        for (int r = 0; r < H; r++) {
            double s = 0;
            for (int k = 0; k < S; k++) s += (double)bf2f(sdn[(size_t)r * S + k]) * bf2f(act[(size_t)P * I + (size_t)t * S + k]);
            e_y = std::max(e_y, fabs(s - ys[(size_t)t * H + r]));
            s_y = std::max(s_y, fabs(s ? s : 1e-30));
        }
    char what[96];
    const char *fmt = dt == DT_Q8 ? "q8 " : dt == DT_Q4 ? "q4 " : "";
    snprintf(what, sizeof what, "%smoe_gate_up_few E %d top-%d H %d I %d S %d, %d tokens", fmt, E, K, H, I, S, n);
    check(what, e_act / s_act, 8e-3);                 /* bf16 outputs: half an ulp is 2^-9 of the value */
    snprintf(what, sizeof what, "%smoe_down_few (%d active experts)", fmt, na);
    check(what, e_y / s_y, 1e-5);
    if (timed) {
        const double bytes = (double)(mgu.bytes.size() + mdn.bytes.size()) * na / E + msgu.bytes.size() +
                             msdn.bytes.size();                 /* what is read */
        float t_few = time_ms([&](int) { run_few(); }, 30);
        float t_warp = time_ms([&](int) {
            moe_gate_up<W><<<max_active * ((I + 7) / 8) + (S + 7) / 8, 256>>>(w_egu, I, w_sgu, S, H, d_xf, n,
                d_start, d_tok, d_active, d_na, max_active, d_hp, d_hs);
            moe_down<W, 4><<<max_active * ((H + 31) / 32) + (H + 31) / 32, 256>>>(w_edn, I, w_sdn, S, H, n,
                d_start, d_active, d_na, max_active, d_hp, d_hs, d_yp, d_ys);
        }, 30);
        printf("    few %7.2f us (%6.0f GB/s)   warp kernels %7.2f us (%6.0f GB/s), %.1f MB\n", 1e3 * t_few,
               bytes / (1e6 * t_few), 1e3 * t_warp, bytes / (1e6 * t_warp), bytes / 1e6);
        /* the few kernels' occupancy (MINB blocks an SM the registers allow) and chunks in flight (U): each kernel
         * alone, its outputs bit-equal to the default's (the sums' order does not depend on either) */
        const double b_gu = (double)mgu.bytes.size() * na / E + msgu.bytes.size(),
                     b_dn = (double)mdn.bytes.size() * na / E + msdn.bytes.size();
        std::vector<bf16> act_v(act.size());
        std::vector<float> yp_v(yp.size());
        auto variant = [&](auto mb, auto u, auto u2, auto wf, auto kc, auto st) {
            const float tg = time_ms([&](int) { gate_up(mb, u, u2, wf, kc, st); }, 30),
                        td = time_ms([&](int) { down(mb, u, u2, wf, kc, st); }, 30);
            CUDA_CHECK(cudaMemcpy(act_v.data(), d_act, act_v.size() * 2, cudaMemcpyDeviceToHost));
            CUDA_CHECK(cudaMemcpy(yp_v.data(), d_yp, yp_v.size() * 4, cudaMemcpyDeviceToHost));
            const int same = !memcmp(act_v.data(), act.data(), act.size() * 2) && !memcmp(yp_v.data(), yp.data(), yp.size() * 4);
            if (!same) fails++;
            printf("    MINB %d U %d/%d WF %d KC %3d ST %d: gate/up %7.2f us (%5.0f GB/s), down %6.2f us (%5.0f GB/s), "
                   "sum %7.2f%s\n", decltype(mb)::value, decltype(u)::value, decltype(u2)::value, decltype(wf)::value,
                   decltype(kc)::value, decltype(st)::value, 1e3 * tg,
                   b_gu / (1e6 * tg), 1e3 * td, b_dn / (1e6 * td), 1e3 * (tg + td), same ? "" : "  OUTPUTS DIFFER");
        };
        variant(IntC<2>(), IntC<8>(), IntC<4>(), IntC<0>(), IntC<0>(), IntC<2>());
        variant(IntC<3>(), IntC<4>(), IntC<2>(), IntC<0>(), IntC<0>(), IntC<2>());
        variant(IntC<4>(), IntC<2>(), IntC<2>(), IntC<0>(), IntC<0>(), IntC<2>());
        variant(IntC<3>(), IntC<4>(), IntC<2>(), IntC<1>(), IntC<0>(), IntC<2>());
        variant(IntC<3>(), IntC<2>(), IntC<2>(), IntC<1>(), IntC<0>(), IntC<2>());
        variant(IntC<4>(), IntC<2>(), IntC<2>(), IntC<1>(), IntC<0>(), IntC<2>());
        variant(IntC<4>(), IntC<3>(), IntC<2>(), IntC<1>(), IntC<0>(), IntC<2>());
        if constexpr (std::is_same<W, bf16>::value) {   /* bf16: the weights through a warp's ring (KC, ST) */
            variant(IntC<2>(), IntC<2>(), IntC<2>(), IntC<0>(), IntC<128>(), IntC<3>());
            variant(IntC<3>(), IntC<2>(), IntC<2>(), IntC<0>(), IntC<128>(), IntC<2>());
            variant(IntC<1>(), IntC<2>(), IntC<2>(), IntC<0>(), IntC<256>(), IntC<2>());
            variant(IntC<3>(), IntC<2>(), IntC<2>(), IntC<0>(), IntC<64>(), IntC<4>());
            variant(IntC<1>(), IntC<2>(), IntC<2>(), IntC<0>(), IntC<256>(), IntC<3>());
            variant(IntC<2>(), IntC<2>(), IntC<2>(), IntC<0>(), IntC<64>(), IntC<6>());
        }
        if constexpr (is_q<W>) {          /* q8 / q4: their value bytes through the ring (KC values, ST) */
            variant(IntC<3>(), IntC<2>(), IntC<2>(), IntC<0>(), IntC<256>(), IntC<2>());
            variant(IntC<2>(), IntC<2>(), IntC<2>(), IntC<0>(), IntC<256>(), IntC<3>());
            variant(IntC<4>(), IntC<2>(), IntC<2>(), IntC<0>(), IntC<256>(), IntC<2>());
            variant(IntC<2>(), IntC<2>(), IntC<2>(), IntC<0>(), IntC<512>(), IntC<2>());
            if constexpr ((int)Fmt<W>::DT == (int)DT_Q8) {   /* (q4 at KC 128: 64-byte stages, too short) */
                variant(IntC<4>(), IntC<2>(), IntC<2>(), IntC<0>(), IntC<128>(), IntC<2>());
                variant(IntC<3>(), IntC<2>(), IntC<2>(), IntC<0>(), IntC<128>(), IntC<4>());
            }
        }
    }
    void *fr[] = {d_egu, d_edn, d_sgu, d_sdn, d_x, d_xf, d_start, d_active, d_tok, d_na, d_act, d_yp, d_ys, d_hp, d_hs};
    for (void *p : fr) CUDA_CHECK(cudaFree(p));
}

int main(int argc, char **argv) {
    /* ./dev/few_lab experts: the MoE cases; experts-q: the q8 / q4 ones */
    const int experts_q = argc > 1 && !strcmp(argv[1], "experts-q");
    const int experts_only = experts_q || (argc > 1 && !strcmp(argv[1], "experts"));
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    GpuModel g = lab_few_model(prop);
    cublasHandle_t blas;
    CUBLAS_CHECK(cublasCreate(&blas));
    printf("%s, %d SMs\n", prop.name, g.nsm);
    if (argc > 1 && !strcmp(argv[1], "gemm-sweep")) {      /* ./dev/few_lab gemm-sweep: gemm_few's variants alone */
        printf("gemm_few variants (MINB/U us):\n");
        const int shapes[][2] = {{10304, 2048}, {2048, 8192}, {100352, 2048}, {2048, 2048}};
        for (int n : {16, 5})
            for (auto &sh : shapes) {
                gemm_sweep<bf16>(sh[0], sh[1], n, g.nsm);
                gemm_sweep<Q8>(sh[0], sh[1], n, g.nsm);
                gemm_sweep<Q4>(sh[0], sh[1], n, g.nsm);
            }
        printf("%s\n", fails ? "FAILED" : "all checks passed");
        return fails != 0;
    }
    if (!experts_only) {
        printf("gemm_few (y = W x, bf16 W), the verification's shapes, 16 tokens:\n");
        gemm_case<bf16>(&g, blas, 10304, 2048, 16, 0, 0.0f, 1);     /* q/k/v/g of a sliding layer */
        gemm_case<bf16>(&g, blas, 2048, 8192, 16, 1, 1.0f, 1);      /* o_proj into the residual, f32 input */
        gemm_case<bf16>(&g, blas, 256, 2048, 16, 0, 0.0f, 1);       /* the router */
        gemm_case<bf16>(&g, blas, 100352, 2048, 16, 0, 0.0f, 1);    /* lm_head, every row */
        printf("odd shapes:\n");
        int shapes[][3] = {{37, 72, 2}, {40, 40, 5}, {16, 8, 8}, {100, 264, 9}, {1000, 200, 16}, {24, 2056, 13}, {7, 96, 3}};
        for (auto &s : shapes) {
            gemm_case<bf16>(&g, blas, s[0], s[1], s[2], 0, 0.0f, 0);
            gemm_case<bf16>(&g, blas, s[0], s[1], s[2], 1, 1.0f, 0);
        }
        printf("gemm_few on q8 / q4 matrices (dequantized in registers), 16 tokens:\n");
        gemm_case<Q8>(&g, blas, 10304, 2048, 16, 0, 0.0f, 1);
        gemm_case<Q8>(&g, blas, 2048, 8192, 16, 1, 1.0f, 1);
        gemm_case<Q8>(&g, blas, 100352, 2048, 16, 0, 0.0f, 1);
        for (auto &s : shapes) gemm_case<Q8>(&g, blas, s[0], s[1], s[2], s[2] & 1, s[2] & 1 ? 1.0f : 0.0f, 0);
        gemm_case<Q4>(&g, blas, 10304, 2048, 16, 0, 0.0f, 1);
        gemm_case<Q4>(&g, blas, 2048, 8192, 16, 1, 1.0f, 1);
        gemm_case<Q4>(&g, blas, 100352, 2048, 16, 0, 0.0f, 1);
        for (auto &s : shapes) gemm_case<Q4>(&g, blas, s[0], s[1], s[2], s[2] & 1, s[2] & 1 ? 1.0f : 0.0f, 0);
    }
    if (!experts_q) {
        printf("experts:\n");
        moe_case<bf16>(256, 8, 2048, 512, 512, 16, 1);
        moe_case<bf16>(256, 8, 2048, 512, 512, 5, 1);
        moe_case<bf16>(256, 8, 2048, 512, 512, 2, 1);
        moe_case<bf16>(16, 4, 64, 40, 24, 9, 0);
        moe_case<bf16>(8, 2, 72, 24, 0, 16, 0);               /* no shared expert */
        moe_case<bf16>(32, 8, 136, 72, 40, 3, 0);
    }
    printf("experts, q8 / q4 (dequantized in registers):\n");
    moe_case<Q8>(256, 8, 2048, 512, 512, 16, 1);
    moe_case<Q4>(256, 8, 2048, 512, 512, 16, 1);
    moe_case<Q8>(256, 8, 2048, 512, 512, 5, 1);
    moe_case<Q8>(256, 8, 2048, 512, 512, 2, 1);
    moe_case<Q8>(16, 4, 64, 40, 24, 9, 0);                /* I 40, S 24: rows shorter than a group of 32 */
    moe_case<Q4>(16, 4, 72, 40, 24, 9, 0);
    moe_case<Q8>(8, 2, 72, 24, 0, 16, 0);
    moe_case<Q4>(32, 8, 136, 72, 40, 3, 0);
    CUBLAS_CHECK(cublasDestroy(blas));
    printf("%s\n", fails ? "FAILED" : "all checks passed");
    return fails != 0;
}
