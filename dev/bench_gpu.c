/* dev/bench_gpu.c -- the GPU benchmark behind `make bench` (results: dev/gpu_notes.md).
 *
 *   python3 export.py --synthetic XS-2.1 /dev/shm/xs21.bin && ./dev/bench_gpu /dev/shm/xs21.bin [contexts...]
 *   (quantized: add --dtype q8 or q4 to the export; an fp8 KV cache: ./dev/bench_gpu FILE --kv fp8 [contexts...])
 *   make dev/bench_gpu_trace && LAGUNA_TRACE_OUT=trace.csv ./dev/bench_gpu_trace FILE 512: the same, plus one traced
 *   decode step at the first context (dev/trace_summary.py trace.csv)
 *
 * The synthetic file has the exact Laguna-XS-2.1 shapes with its matmul weights left as holes; the weights are
 * filled on the GPU with the --random-weights hash (seed 1; q8 / q4 files get those values quantized, as the CPU
 * does). One GpuModel with the full 262,144-token window:
 * for each context L, prefill L random tokens (timed: prefill tok/s; at 131,072 the time to first token), then
 * 128 greedy decode steps through the CUDA graph (timed after 8 warm-up steps), then 16-token forwards at L
 * (the DFlash verification shape, timed, rolled back each time). Achieved GB/s counts the bytes each token must
 * read: the attention, dense, router, 8 routed + shared experts and lm_head weights in the file's formats, plus
 * the K/V cache at that context (shared/spec/performance.md).
 * LAGUNA_BENCH_TEMP=T (and LAGUNA_BENCH_TOPP=P, default 0.95): the decode steps sample at temperature T with top-p P
 * (laguna's defaults are 0.6 / 0.95) instead of greedy, so the sampler's cost shows; a fixed coin sequence. */
#define TESTING
#include "../laguna.c"

/* bytes of tensor t in its format (q8 / q4 with their scales) */
static double tbytes(const Tensor *t) { return t->data ? (double)tensor_bytes(t->dtype, t->ndim, t->shape) : 0.0; }

static double weight_bytes_per_token(const Model *m) {
    const Config *c = &m->config;
    const Weights *w = &m->weights;
    double b = 0;
    for (int l = 0; l < c->n_layers; l++) {
        const LayerWeights *lw = &w->layers[l];
        b += tbytes(&lw->wq) + tbytes(&lw->wk) + tbytes(&lw->wv) + tbytes(&lw->wg) + tbytes(&lw->wo);
        if (c->mlp_type[l] == MLP_DENSE) b += tbytes(&lw->w_gate) + tbytes(&lw->w_up) + tbytes(&lw->w_down);
        else b += tbytes(&lw->router) + (tbytes(&lw->experts_gate_up) + tbytes(&lw->experts_down)) *
                  c->n_experts_active / c->n_experts + tbytes(&lw->shared_gate) + tbytes(&lw->shared_up) +
                  tbytes(&lw->shared_down);
    }
    return b + tbytes(c->tied_embeddings ? &w->embed : &w->lm_head);
}

static double kv_bytes_per_token(const Config *c, int ctx, int elem) {
    double b = 0;
    for (int l = 0; l < c->n_layers; l++) {
        int keys = c->layer_type[l] == ATTN_FULL ? ctx : (ctx < c->sliding_window ? ctx : c->sliding_window);
        b += (double)keys * c->kv_dim * 2 * elem;
    }
    return b;
}

static int argmax_row(const float *x, int n) { return argmax(x, n); }

int main(int argc, char **argv) {
    if (argc < 2) { fprintf(stderr, "usage: bench_gpu XS21.bin [--kv fp8] [contexts...]\n"); return 1; }
    static Model m;
    char err[1024], info[256];
    if (load_model(&m, argv[1], KIND_MODEL, err, sizeof err)) die("%s", err);
    if (!gpu_available(info, sizeof info)) die("no GPU");
    Config *c = &m.config;
    m.random_weights = 1;
    m.random_seed = 1;
    int a0 = 2, kv_elem = 2;                       /* bytes per cached K/V value: bf16, or fp8 with --kv fp8 */
    if (argc > 3 && !strcmp(argv[2], "--kv")) {
        if (strcmp(argv[3], "fp8")) die("bench_gpu: --kv takes fp8 (the default is bf16)");
        m.kv = KV_FP8;
        kv_elem = 1;
        a0 = 4;
    }
    int ctx = c->max_seq_len, T = 2048;
    double t0 = now_s();
    GpuModel *g = gpu_init(&m, ctx, T, err, sizeof err);
    if (!g) die("%s", err);
    printf("gpu: %s\n%s\ninit (random fill on the device) %.1f s\n", info, gpu_summary(g), now_s() - t0);

    const char *te = getenv("LAGUNA_BENCH_TEMP"), *pe = getenv("LAGUNA_BENCH_TOPP");
    const float temp = te ? (float)atof(te) : 0.0f, topp = pe ? (float)atof(pe) : 0.95f;
    if (temp > 0.0f) printf("decode samples at temperature %.2f, top-p %.2f (LAGUNA_BENCH_TEMP / _TOPP)\n", temp, topp);
    const int chain = !getenv("LAGUNA_BENCH_CHAIN") || atoi(getenv("LAGUNA_BENCH_CHAIN"));
    if (!chain) printf("decode one step at a time (LAGUNA_BENCH_CHAIN=0)\n");
    unsigned long long coin_rng = 7;
#define COIN() (temp > 0.0f ? random_f32(&coin_rng) : 0.0f)
    int contexts[16] = {512, 2048, 8192, 32768, 131072}, nc = 5;
    if (argc > a0) { nc = 0; for (int i = a0; i < argc && nc < 16; i++) contexts[nc++] = atoi(argv[i]); }
    int maxL = 0;
    for (int i = 0; i < nc; i++) if (contexts[i] > maxL) maxL = contexts[i];
    int *ids = xcalloc((size_t)maxL + 256, sizeof(int));
    unsigned long long rng = 42;
    for (int i = 0; i < maxL + 256; i++) ids[i] = 3 + (int)(random_u32(&rng) % (unsigned)(c->vocab_size - 3));

    double wb = weight_bytes_per_token(&m);
    const char *fmt = m.weights.layers[0].wq.dtype == DT_Q8 ? "q8" : m.weights.layers[0].wq.dtype == DT_Q4 ? "q4"
                    : m.weights.layers[0].wq.dtype == DT_BF16 ? "bf16" : "f32";
    printf("\nfile %s: %.2f GB (%s)\nweights read per decoded token: %.3f GB (%s)\n\n", argv[1], m.file_size / 1e9,
           fmt, wb / 1e9, fmt);
    printf("| context | prefill tok/s | prefill s | decode tok/s | ms/token | GB/token | GB/s | of 4.3 TB/s | "
           "verify 16 ms | verify / decode |\n|---|---|---|---|---|---|---|---|---|---|\n");
    for (int ci = 0; ci < nc; ci++) {
        int L = contexts[ci];
        /* prefill L tokens in chunks of T (the first run of a shape also warms cuBLAS; 512 is first) */
        double tp = now_s();
        float *logits = NULL;
        for (int i = 0; i < L; i += T) logits = gpu_forward(g, ids + i, L - i < T ? L - i : T, i, 0);
        int next = argmax_row(logits, c->vocab_size);
        double prefill_s = now_s() - tp;
        /* decode: 8 warm-up steps, then 128 timed; each step launched before the previous one's token is read, as
         * ./laguna does (LAGUNA_BENCH_CHAIN=0: one step at a time, launch and wait) */
        int pos = L;
        for (int i = 0; i < 8; i++) next = gpu_decode_step(g, next, pos++, temp, topp, COIN());
        int steps = 128;
        double td = now_s();
        if (chain) {
            gpu_decode_launch(g, next, pos++, temp, topp, COIN());
            for (int i = 0; i < steps; i++) {
                if (i + 1 < steps) gpu_decode_launch(g, -1, pos++, temp, topp, COIN());
                next = gpu_decode_wait(g);
            }
        } else {
            for (int i = 0; i < steps; i++) next = gpu_decode_step(g, next, pos++, temp, topp, COIN());
        }
        double dec_s = (now_s() - td) / steps;
#ifdef LAGUNA_TRACE
        /* make dev/bench_gpu_trace: one more step at the first context, every kernel block timed (untimed here) */
        const char *trace_out = getenv("LAGUNA_TRACE_OUT");
        if (ci == 0 && trace_out) next = gpu_decode_trace(g, next, pos++, temp, topp, COIN(), trace_out);
#endif
        /* verification: 16 tokens at L with all their logits (rolled back: same position every time) */
        for (int i = 0; i < 2; i++) gpu_forward(g, ids + L, 16, L, 1);
        double tv = now_s();
        int reps = 10;
        for (int i = 0; i < reps; i++) gpu_forward(g, ids + L, 16, L, 1);
        double ver_s = (now_s() - tv) / reps;
        double bytes = wb + kv_bytes_per_token(c, L + 72, kv_elem);
        printf("| %d | %.0f | %.2f | %.1f | %.3f | %.3f | %.0f | %.1f%% | %.2f | %.2fx |\n", L, L / prefill_s,
               prefill_s, 1.0 / dec_s, dec_s * 1e3, bytes / 1e9, bytes / dec_s / 1e9, 100 * bytes / dec_s / 4.3e12,
               ver_s * 1e3, ver_s / dec_s);
        fflush(stdout);
    }
    printf("\n%s\n", gpu_summary(g));
    gpu_free(g);
    free(ids);
    free_model(&m);
    return 0;
}
