/* dev/bench_dflash.c -- DFlash on the GPU at the full XS-2.1 shapes (`make bench`; results: dev/gpu_notes.md).
 *
 *   python3 export.py --synthetic XS-2.1 /dev/shm/xs21.bin
 *   python3 export.py --synthetic XS-2.1-DFlash /dev/shm/xs21-dflash.bin
 *   ./dev/bench_dflash /dev/shm/xs21.bin /dev/shm/xs21-dflash.bin [contexts...]
 *
 * Both files' weights are filled on the GPU with the --random-weights hash (seed 1). The drafter goes through
 * laguna.c's own dflash_init and the loop's own steps (prefill_dflash, add_context, draft, verify_forward), so what
 * is timed is what generate_dflash runs. For each context L: prefill L random tokens (taps and drafter context
 * included), then time, wall clock with the host syncs the loop has:
 *   decode   one target decode step (the CUDA graph, greedy): the baseline without a drafter;
 *   verify   the target over a 16-token block, every row's argmax back (the greedy verify; taps captured);
 *   logits   the same with the 16 logits rows downloaded (the verify at temperature > 0);
 *   context  the drafter's context add of 16 rows (the most a step adds: the bonus + 15 accepted);
 *   draft    one drafter block forward of 16 with the argmax per slot;
 * and print the drafter's cost per step against a decode step, (context + draft) / decode (the bar: 0.3),
 * and the projected speedup at a mean accepted length tau: tau * decode / (verify + draft + context). */
#define TESTING
#include "../laguna.c"

/* seconds per run of stmt: 3 warm-up runs, then the mean of reps */
#define TIME(out, reps, stmt) do { for (int w_ = 0; w_ < 3; w_++) { stmt; } double t_ = now_s(); \
                                   for (int r_ = 0; r_ < (reps); r_++) { stmt; } (out) = (now_s() - t_) / (reps); } while (0)

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: bench_dflash XS21.bin XS21-DFLASH.bin [contexts...]\n"); return 1; }
    static Model m, d;
    char err[1024], info[256];
    if (load_model(&m, argv[1], KIND_MODEL, err, sizeof err)) die("%s", err);
    if (!gpu_available(info, sizeof info)) die("no GPU");
    Config *c = &m.config;
    int contexts[16] = {512, 2048, 8192, 32768}, nc = 4;
    if (argc > 3) { nc = 0; for (int i = 3; i < argc && nc < 16; i++) contexts[nc++] = atoi(argv[i]); }
    int maxL = 0;
    for (int i = 0; i < nc; i++) if (contexts[i] > maxL) maxL = contexts[i];
    int ctx = maxL + 1024, T = 2048, B = 16;
    m.random_weights = 1;
    m.random_seed = 1;
    double t0 = now_s();
    GpuModel *g = gpu_init(&m, ctx, T, err, sizeof err);
    if (!g) die("%s", err);
    alloc_state(&m, ctx, T);                     /* sizes the chunking, as in main() */
    Engine e = {&m, g};
    DFlash df;
    dflash_init(&df, &d, argv[2], &m, g, B - 1, ctx);
    printf("gpu: %s\ntarget: %s\ndrafter: %s\ninit (random fill on the device) %.1f s\n", info, gpu_summary(g),
           gpu_summary(df.gpu), now_s() - t0);
    printf("drafter: %d layers, hidden %d, %d q / %d kv heads, head_dim %d, intermediate %d, taps %d, block %d, "
           "window %d\n\n", d.config.n_layers, d.config.dim, d.config.n_heads[0], d.config.n_kv_heads,
           d.config.head_dim, d.config.hidden_dim, d.config.n_taps, df.block, d.config.sliding_window);

    int *ids = xcalloc((size_t)maxL + 256, sizeof(int));
    unsigned long long rng = 42;
    for (int i = 0; i < maxL + 256; i++) ids[i] = 3 + (int)(random_u32(&rng) % (unsigned)(c->vocab_size - 3));

    printf("| context | prefill s | decode ms | verify 16 ms | verify / decode | verify 16 + logits ms | "
           "context 16 ms | draft 16 ms | (context + draft) / decode | speedup at tau 11 | at tau 6 |\n"
           "|---|---|---|---|---|---|---|---|---|---|---|\n");
    double ratio_max = 0.0;
    for (int ci = 0; ci < nc; ci++) {
        int L = contexts[ci], top[64], drafts[64];
        double tp = now_s();
        float *logits = prefill_dflash(&e, &df, ids, L);
        int next = argmax(logits, c->vocab_size);
        double prefill_s = now_s() - tp;
        /* decode steps at L.. (the verify below overwrites the same positions: a rollback) */
        int pos = L;
        double t_decode, t_verify, t_logits, t_context, t_draft;
        TIME(t_decode, 64, next = gpu_decode_step(g, next, pos, 0.0f, 0.0f, 0.0f); pos++);
        TIME(t_verify, 20, gpu_forward_argmax(g, ids + L, B, L, top));
        TIME(t_logits, 10, engine_forward(&e, ids + L, B, L, 1));
        TIME(t_context, 20, add_context(&e, &df, 0, B, L));
        TIME(t_draft, 20, draft(&df, top[0], L, B, drafts));
        double ratio = (t_context + t_draft) / t_decode, step = t_verify + t_draft + t_context;
        if (ratio > ratio_max) ratio_max = ratio;
        printf("| %d | %.2f | %.3f | %.3f | %.2fx | %.3f | %.3f | %.3f | %.3fx | %.2fx | %.2fx |\n", L, prefill_s,
               t_decode * 1e3, t_verify * 1e3, t_verify / t_decode, t_logits * 1e3, t_context * 1e3, t_draft * 1e3,
               ratio, 11.0 * t_decode / step, 6.0 * t_decode / step);
        fflush(stdout);
    }
    printf("\ndrafter cost per step (context add of 16 + block forward) / one decode step: at most %.3fx (bar 0.3x): %s\n",
           ratio_max, ratio_max <= 0.3 ? "met" : "NOT met");
    printf("speedup projection: tau * t_decode / (t_verify16 + t_draft + t_context16); tau 11 is vLLM's on XS-2.1\n");
    dflash_free(&df);
    gpu_free(g);
    free(ids);
    free_model(&m);
    return 0;
}
