/* laguna.c -- inference for poolside's Laguna-XS in one readable C file.
 *
 *   make && ./laguna model.bin "def quicksort(arr):"
 *
 * Sections: utilities | loading the file | the forward pass (model order) | sampling |
 * generation, scoring and chat | main. The CPU forward is the reference that the GPU backend
 * (laguna.cu) is checked against; both follow the same steps with the same names.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "laguna.h"
#include "tokenizer.h"

/* ----------------------------------------------------------------------------
 * utilities */

static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "laguna: error: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    exit(1);
}

static void *xcalloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) die("out of memory allocating %zu x %zu bytes", n, size);
    return p;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

float bf16_to_float(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Bytes of a tensor's data in the file (see laguna.h for the quantized layout). */
uint64_t tensor_bytes(int dtype, int ndim, const int64_t *shape) {
    uint64_t n = 1, rows = 1;
    for (int d = 0; d < ndim; d++) n *= (uint64_t)shape[d];
    for (int d = 0; d + 1 < ndim; d++) rows *= (uint64_t)shape[d];
    uint64_t groups = ((uint64_t)shape[ndim - 1] + LAGUNA_QGROUP - 1) / LAGUNA_QGROUP;
    switch (dtype) {
    case DT_F32: return n * 4;
    case DT_BF16: return n * 2;
    case DT_Q8: return rows * groups * (LAGUNA_QGROUP + 2);
    case DT_Q4: return rows * groups * (LAGUNA_QGROUP / 2 + 2);
    default: return n;
    }
}

/* ----------------------------------------------------------------------------
 * loading: mmap the file, check everything, point the weights into it */

#define FAIL(...) do { snprintf(err, errsz, __VA_ARGS__); return -1; } while (0)
static const char *HINT_REEXPORT = "re-run export.py on the checkpoint with this version of laguna";

const TensorEntry *find_tensor(const Model *m, const char *name) {
    for (uint64_t i = 0; i < m->n_tensors; i++)
        if (strncmp(m->dir[i].name, name, sizeof m->dir[i].name) == 0) return &m->dir[i];
    return NULL;
}

/* Bind tensor `name`, checking its dtype class and exact shape (ndim dims, -1 = any). */
static int bind(const Model *m, Tensor *t, const char *name, int want_f32, int ndim, int64_t d0, int64_t d1,
                int64_t d2, char *err, size_t errsz) {
    const TensorEntry *e = find_tensor(m, name);
    if (!e) FAIL("tensor %s is missing from %s\n  hint: %s", name, m->path, HINT_REEXPORT);
    if (want_f32 && e->dtype != DT_F32) FAIL("tensor %s should be f32, is dtype %u\n  hint: %s", name, e->dtype,
                                              HINT_REEXPORT);
    if (!want_f32 && e->dtype != DT_F32 && e->dtype != DT_BF16 && e->dtype != DT_Q8 && e->dtype != DT_Q4)
        FAIL("tensor %s has dtype %u, not a weight type (f32, bf16, q8, q4)\n  hint: %s", name, e->dtype, HINT_REEXPORT);
    int64_t want[3] = {d0, d1, d2};
    if ((int)e->ndim != ndim) FAIL("tensor %s has %u dims, expected %d\n  hint: %s", name, e->ndim, ndim,
                                   HINT_REEXPORT);
    for (int i = 0; i < ndim; i++)
        if (e->shape[i] != want[i])
            FAIL("tensor %s has shape[%d] = %lld, expected %lld from the config\n  hint: %s", name, i,
                 (long long)e->shape[i], (long long)want[i], HINT_REEXPORT);
    t->data = (const char *)m->map + e->offset;
    t->dtype = (int)e->dtype;
    t->ndim = ndim;
    for (int i = 0; i < 4; i++) t->shape[i] = e->shape[i];
    t->scales = NULL;
    t->groups = 0;
    if (t->dtype == DT_Q8 || t->dtype == DT_Q4) {    /* the scale plane follows the value plane */
        int64_t rows = 1;
        for (int i = 0; i + 1 < ndim; i++) rows *= e->shape[i];
        t->groups = (int)((e->shape[ndim - 1] + LAGUNA_QGROUP - 1) / LAGUNA_QGROUP);
        int64_t vbytes = rows * t->groups * (t->dtype == DT_Q8 ? LAGUNA_QGROUP : LAGUNA_QGROUP / 2);
        t->scales = (const uint16_t *)((const char *)t->data + vbytes);
    }
    return 0;
}

/* Parse "a b c" into ints; returns the count. */
static int parse_int_list(const char *s, int *out, int max) {
    int n = 0;
    while (*s && n < max) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s) break;
        out[n++] = (int)v;
        s = end;
    }
    return n;
}

static int parse_config(Model *m, const char *text, size_t len, char *err, size_t errsz) {
    Config *c = &m->config;
    memset(c, 0, sizeof *c);
    c->bos_id = c->pad_id = c->mask_id = -1;
    c->gate_per_head = 1;
    c->gated = 1;
    c->causal = 1;
    char *buf = xcalloc(len + 1, 1);
    memcpy(buf, text, len);
    int seen_layers = 0, n_heads_n = 0, n_lt = 0, n_mt = 0;
    char lt[LAGUNA_MAX_LAYERS][16], mt[LAGUNA_MAX_LAYERS][16];
    int rc = 0;
    for (char *line = strtok(buf, "\n"); line; line = strtok(NULL, "\n")) {
        char *eq = strchr(line, '=');
        if (!eq) { snprintf(err, errsz, "malformed config line '%s'\n  hint: %s", line, HINT_REEXPORT); rc = -1; break; }
        *eq = 0;
        const char *k = line, *v = eq + 1;
#define KEY(name) (strcmp(k, name) == 0)
        if (KEY("model_type")) { if (strcmp(v, "laguna")) { snprintf(err, errsz, "model_type %s is not laguna", v); rc = -1; break; } }
        else if (KEY("vocab_size")) c->vocab_size = atoi(v);
        else if (KEY("hidden_size")) c->dim = atoi(v);
        else if (KEY("n_layers")) { c->n_layers = atoi(v); seen_layers = 1; }
        else if (KEY("n_kv_heads")) c->n_kv_heads = atoi(v);
        else if (KEY("head_dim")) c->head_dim = atoi(v);
        else if (KEY("n_heads")) n_heads_n = parse_int_list(v, c->n_heads, LAGUNA_MAX_LAYERS);
        else if (KEY("layer_types") || KEY("mlp_types")) {
            int *cnt = KEY("layer_types") ? &n_lt : &n_mt;
            char (*dst)[16] = KEY("layer_types") ? lt : mt;
            char tmp[16];
            int off = 0, used;
            while (*cnt < LAGUNA_MAX_LAYERS && sscanf(v + off, "%15s%n", tmp, &used) == 1) {
                snprintf(dst[(*cnt)++], 16, "%s", tmp);
                off += used;
            }
        }
        else if (KEY("sliding_window")) c->sliding_window = atoi(v);
        else if (KEY("intermediate_size")) c->hidden_dim = atoi(v);
        else if (KEY("moe_intermediate_size")) c->moe_hidden_dim = atoi(v);
        else if (KEY("shared_expert_intermediate_size")) c->shared_hidden_dim = atoi(v);
        else if (KEY("n_experts")) c->n_experts = atoi(v);
        else if (KEY("n_experts_per_tok")) c->n_experts_active = atoi(v);
        else if (KEY("routed_scaling_factor")) c->routed_scaling = (float)strtod(v, NULL);
        else if (KEY("router_logit_softcapping")) c->router_softcap = (float)strtod(v, NULL);
        else if (KEY("rms_norm_eps")) c->norm_eps = (float)strtod(v, NULL);
        else if (KEY("max_position_embeddings")) c->max_seq_len = atoi(v);
        else if (KEY("gating")) { c->gate_per_head = !strcmp(v, "per-head"); c->gated = strcmp(v, "none") != 0; }
        else if (KEY("attention_bias")) c->attention_bias = atoi(v);
        else if (KEY("tie_word_embeddings")) c->tied_embeddings = atoi(v);
        else if (KEY("bos_token_id")) c->bos_id = atoi(v);
        else if (KEY("pad_token_id")) c->pad_id = atoi(v);
        else if (KEY("mask_token_id")) c->mask_id = atoi(v);
        else if (KEY("eos_token_ids")) c->n_eos = parse_int_list(v, c->eos_ids, LAGUNA_MAX_EOS);
        else if (KEY("rope_full_rotary_dim")) c->rotary_dim[ATTN_FULL] = atoi(v);
        else if (KEY("rope_sliding_rotary_dim")) c->rotary_dim[ATTN_SLIDING] = atoi(v);
        else if (KEY("rope_full_attention_scaling")) c->rope_scaling[ATTN_FULL] = (float)strtod(v, NULL);
        else if (KEY("rope_sliding_attention_scaling")) c->rope_scaling[ATTN_SLIDING] = (float)strtod(v, NULL);
        else if (KEY("dflash_block_size")) c->block_size = atoi(v);
        else if (KEY("dflash_target_layer_ids")) c->n_taps = parse_int_list(v, c->tap_layers, LAGUNA_MAX_TAPS);
        else if (KEY("dflash_causal")) c->causal = atoi(v);
        else if (KEY("dflash_num_target_layers")) c->n_target_layers = atoi(v);
        else {
            snprintf(err, errsz, "unknown config key '%s' in %s\n  hint: the file was written by a newer "
                     "export.py; update laguna", k, m->path);
            rc = -1;
            break;
        }
#undef KEY
    }
    free(buf);
    if (rc) return rc;
    if (!seen_layers || c->n_layers <= 0 || c->n_layers > LAGUNA_MAX_LAYERS)
        FAIL("bad n_layers %d in %s\n  hint: %s", c->n_layers, m->path, HINT_REEXPORT);
    if (n_heads_n != c->n_layers || n_lt != c->n_layers || n_mt != c->n_layers)
        FAIL("per-layer lists do not have n_layers=%d entries\n  hint: %s", c->n_layers, HINT_REEXPORT);
    if (c->vocab_size <= 0 || c->dim <= 0 || c->n_kv_heads <= 0 || c->head_dim <= 0 ||
        c->norm_eps <= 0 || c->max_seq_len <= 0)
        FAIL("config in %s has a zero or negative size\n  hint: %s", m->path, HINT_REEXPORT);
    c->kv_dim = c->n_kv_heads * c->head_dim;
    if (c->bos_id >= c->vocab_size || c->pad_id >= c->vocab_size || c->mask_id >= c->vocab_size)
        FAIL("a special token id in %s is outside the vocabulary (%d)\n  hint: %s", m->path, c->vocab_size, HINT_REEXPORT);
    for (int l = 0; l < c->n_layers; l++) {
        if (!strcmp(lt[l], "full")) c->layer_type[l] = ATTN_FULL;
        else if (!strcmp(lt[l], "sliding")) c->layer_type[l] = ATTN_SLIDING;
        else FAIL("layer %d has unknown attention type '%s'", l, lt[l]);
        if (!strcmp(mt[l], "dense")) c->mlp_type[l] = MLP_DENSE;
        else if (!strcmp(mt[l], "sparse")) c->mlp_type[l] = MLP_SPARSE;
        else FAIL("layer %d has unknown mlp type '%s'", l, mt[l]);
        if (c->n_heads[l] <= 0 || c->n_heads[l] % c->n_kv_heads)
            FAIL("layer %d: %d query heads is not a multiple of %d kv heads", l, c->n_heads[l], c->n_kv_heads);
        if (c->n_heads[l] > c->max_heads) c->max_heads = c->n_heads[l];
        int t = c->layer_type[l];
        if (c->rotary_dim[t] <= 0 || c->rotary_dim[t] > c->head_dim || c->rotary_dim[t] % 2)
            FAIL("bad rotary dim %d for layer %d\n  hint: %s", c->rotary_dim[t], l, HINT_REEXPORT);
        if (t == ATTN_SLIDING && c->sliding_window <= 0) FAIL("sliding layer %d but sliding_window is 0", l);
        if (c->mlp_type[l] == MLP_SPARSE &&
            (c->n_experts <= 0 || c->n_experts_active <= 0 || c->n_experts_active > c->n_experts ||
             c->moe_hidden_dim <= 0 || c->shared_hidden_dim <= 0))
            FAIL("layer %d is MoE but the expert sizes are invalid", l);
        if (c->mlp_type[l] == MLP_DENSE && c->hidden_dim <= 0) FAIL("layer %d is dense but intermediate_size is 0", l);
    }
    return 0;
}

static int bind_weights(Model *m, char *err, size_t errsz) {
    Config *c = &m->config;
    Weights *w = &m->weights;
    int64_t H = c->dim, D = c->head_dim, KVD = c->kv_dim, V = c->vocab_size;
    int64_t E = c->n_experts, I = c->moe_hidden_dim, S = c->shared_hidden_dim, F = c->hidden_dim;
    char name[128];
#define B(t, f32, nd, a, b, cc) do { if (bind(m, t, name, f32, nd, a, b, cc, err, errsz)) return -1; } while (0)
#define N(...) snprintf(name, sizeof name, __VA_ARGS__)
    N("model.norm.weight"); B(&w->final_norm, 1, 1, H, 0, 0);
    if (c->block_size) {     /* a DFlash drafter: context fusion; embed and lm_head come from the target */
        if (c->n_taps <= 0 || c->block_size < 2 || c->block_size > 64)      /* export.py's bounds */
            FAIL("drafter %s has no taps or a block size outside 2..64 (%d)\n  hint: %s", m->path, c->block_size,
                 HINT_REEXPORT);
        N("dflash.fc.weight"); B(&w->fc, 0, 2, H, (int64_t)c->n_taps * H, 0);
        N("dflash.hidden_norm.weight"); B(&w->hidden_norm, 1, 1, H, 0, 0);
        for (int i = 0; i < c->n_taps; i++) { N("dflash.aux_hidden_norms.%d.weight", i); B(&w->aux_norm[i], 1, 1, H, 0, 0); }
    } else {
        N("model.embed_tokens.weight"); B(&w->embed, 0, 2, V, H, 0);
        if (c->tied_embeddings) w->lm_head = w->embed;
        else { N("lm_head.weight"); B(&w->lm_head, 0, 2, V, H, 0); }
    }
    for (int t = 0; t < 2; t++) {
        int used = 0;
        for (int l = 0; l < c->n_layers; l++) used |= c->layer_type[l] == t;
        if (!used) continue;
        Tensor inv;
        N("rope.%s_attention.inv_freq", t == ATTN_FULL ? "full" : "sliding");
        B(&inv, 1, 1, c->rotary_dim[t] / 2, 0, 0);
        w->inv_freq[t] = inv.data;
    }
    for (int l = 0; l < c->n_layers; l++) {
        LayerWeights *lw = &w->layers[l];
        int64_t nh = c->n_heads[l];
        N("model.layers.%d.input_layernorm.weight", l); B(&lw->attn_norm, 1, 1, H, 0, 0);
        N("model.layers.%d.self_attn.q_proj.weight", l); B(&lw->wq, 0, 2, nh * D, H, 0);
        N("model.layers.%d.self_attn.k_proj.weight", l); B(&lw->wk, 0, 2, KVD, H, 0);
        N("model.layers.%d.self_attn.v_proj.weight", l); B(&lw->wv, 0, 2, KVD, H, 0);
        if (c->attention_bias) {
            N("model.layers.%d.self_attn.q_proj.bias", l); B(&lw->bq, 1, 1, nh * D, 0, 0);
            N("model.layers.%d.self_attn.k_proj.bias", l); B(&lw->bk, 1, 1, KVD, 0, 0);
            N("model.layers.%d.self_attn.v_proj.bias", l); B(&lw->bv, 1, 1, KVD, 0, 0);
            N("model.layers.%d.self_attn.o_proj.bias", l); B(&lw->bo, 1, 1, H, 0, 0);
        }
        N("model.layers.%d.self_attn.q_norm.weight", l); B(&lw->q_norm, 1, 1, D, 0, 0);
        N("model.layers.%d.self_attn.k_norm.weight", l); B(&lw->k_norm, 1, 1, D, 0, 0);
        if (c->gated) { N("model.layers.%d.self_attn.g_proj.weight", l); B(&lw->wg, 0, 2, c->gate_per_head ? nh : nh * D, H, 0); }
        N("model.layers.%d.self_attn.o_proj.weight", l); B(&lw->wo, 0, 2, H, nh * D, 0);
        N("model.layers.%d.post_attention_layernorm.weight", l); B(&lw->ffn_norm, 1, 1, H, 0, 0);
        if (c->mlp_type[l] == MLP_DENSE) {
            N("model.layers.%d.mlp.gate_proj.weight", l); B(&lw->w_gate, 0, 2, F, H, 0);
            N("model.layers.%d.mlp.up_proj.weight", l); B(&lw->w_up, 0, 2, F, H, 0);
            N("model.layers.%d.mlp.down_proj.weight", l); B(&lw->w_down, 0, 2, H, F, 0);
        } else {
            N("model.layers.%d.mlp.gate.weight", l); B(&lw->router, 0, 2, E, H, 0);
            N("model.layers.%d.mlp.experts.e_score_correction_bias", l); B(&lw->expert_bias, 1, 1, E, 0, 0);
            N("model.layers.%d.mlp.experts.gate_up_proj", l); B(&lw->experts_gate_up, 0, 3, E, 2 * I, H);
            N("model.layers.%d.mlp.experts.down_proj", l); B(&lw->experts_down, 0, 3, E, H, I);
            N("model.layers.%d.mlp.shared_expert.gate_proj.weight", l); B(&lw->shared_gate, 0, 2, S, H, 0);
            N("model.layers.%d.mlp.shared_expert.up_proj.weight", l); B(&lw->shared_up, 0, 2, S, H, 0);
            N("model.layers.%d.mlp.shared_expert.down_proj.weight", l); B(&lw->shared_down, 0, 2, H, S, 0);
        }
    }
#undef B
#undef N
    return 0;
}

int load_model(Model *m, const char *path, int kind, char *err, size_t errsz) {
    memset(m, 0, sizeof *m);
    m->fd = -1;
    m->path = path;
    int fd = open(path, O_RDONLY);
    if (fd < 0) FAIL("cannot open %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) { close(fd); FAIL("%s is not a regular file", path); }
    uint64_t size = (uint64_t)st.st_size;
    FileHeader h;
    if (size < sizeof h || pread(fd, &h, sizeof h, 0) != (ssize_t)sizeof h) {
        close(fd);
        FAIL("%s is too short to be a laguna file (%llu bytes)\n  hint: convert a checkpoint with export.py",
             path, (unsigned long long)size);
    }
    if (h.magic != LAGUNA_MAGIC) {
        close(fd);
        FAIL("%s is not a laguna model file (bad magic)\n  hint: convert the checkpoint with "
             "`python3 export.py HF_DIR OUT.bin`", path);
    }
    if (h.version != LAGUNA_VERSION) {
        close(fd);
        if (h.version > LAGUNA_VERSION)
            FAIL("%s has format version %u, newer than this laguna reads (%d)\n  hint: update laguna",
                 path, h.version, LAGUNA_VERSION);
        FAIL("%s has old format version %u (this laguna reads %d)\n  hint: %s", path, h.version,
             LAGUNA_VERSION, HINT_REEXPORT);
    }
    if (h.kind != (uint32_t)kind) {
        close(fd);
        if (kind == KIND_MODEL)
            FAIL("%s is a DFlash drafter, not a model\n  hint: give the target model first and the drafter with -d", path);
        FAIL("%s is not a DFlash drafter\n  hint: -d takes a drafter exported with export.py from its checkpoint", path);
    }
    if (h.file_size != size) {
        close(fd);
        FAIL("%s is %llu bytes but its header says %llu: the file is %s\n  hint: copy or export it again",
             path, (unsigned long long)size, (unsigned long long)h.file_size,
             size < h.file_size ? "truncated" : "corrupt");
    }
    if (h.config_offset < sizeof h || h.config_size > size || h.config_offset > size - h.config_size ||
        h.n_tensors > size / sizeof(TensorEntry) || h.dir_offset > size - h.n_tensors * sizeof(TensorEntry)) {
        close(fd);
        FAIL("%s has a corrupt header\n  hint: %s", path, HINT_REEXPORT);
    }
    void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) { close(fd); FAIL("cannot mmap %s: %s", path, strerror(errno)); }
    m->fd = fd;
    m->map = map;
    m->file_size = size;
    m->dir = (const TensorEntry *)((const char *)map + h.dir_offset);
    m->n_tensors = h.n_tensors;
    /* every tensor must lie inside the file, aligned, with a sane shape */
    for (uint64_t i = 0; i < m->n_tensors; i++) {
        const TensorEntry *e = &m->dir[i];
        if (memchr(e->name, 0, sizeof e->name) == NULL) FAIL("tensor %llu has an unterminated name", (unsigned long long)i);
        if (e->ndim < 1 || e->ndim > 4 || e->dtype > DT_Q4)
            FAIL("tensor %s has ndim %u / dtype %u\n  hint: %s", e->name, e->ndim, e->dtype, HINT_REEXPORT);
        uint64_t n = 1;
        for (uint32_t d = 0; d < e->ndim; d++) {
            if (e->shape[d] <= 0 || (uint64_t)e->shape[d] > size) FAIL("tensor %s has a bad shape", e->name);
            n *= (uint64_t)e->shape[d];
            if (n > size) FAIL("tensor %s is larger than the file", e->name);
        }
        uint64_t bytes = tensor_bytes((int)e->dtype, (int)e->ndim, e->shape);
        /* the next tensor (in file order) must not start inside this one: sizes and scales are consistent */
        uint64_t next = size;
        for (uint64_t j = 0; j < m->n_tensors; j++)
            if (m->dir[j].offset > e->offset && m->dir[j].offset < next) next = m->dir[j].offset;
        if (e->offset <= size && bytes > next - e->offset && next != size)
            FAIL("tensor %s (%llu bytes as %s) overlaps the next tensor\n  hint: the file is corrupt or its sizes "
                 "and scales are inconsistent; %s", e->name, (unsigned long long)bytes,
                 e->dtype == DT_Q8 ? "q8" : e->dtype == DT_Q4 ? "q4" : "stored", HINT_REEXPORT);
        if (e->offset % LAGUNA_ALIGN || e->offset > size || bytes > size - e->offset)
            FAIL("tensor %s lies outside the file (offset %llu, %llu bytes)\n  hint: the file is corrupt; %s",
                 e->name, (unsigned long long)e->offset, (unsigned long long)bytes, HINT_REEXPORT);
    }
    if (parse_config(m, (const char *)map + h.config_offset, h.config_size, err, errsz)) return -1;
    return bind_weights(m, err, errsz);
}

/* ----------------------------------------------------------------------------
 * the run state: activations for up to max_tokens tokens, and the KV cache */

static int64_t cache_rows_for(const Config *c, int l, int ctx, int max_tokens) {
    if (c->layer_type[l] == ATTN_FULL) return ctx;
    /* a ring: the oldest key a query still needs is p-W+1, and a forward writes max_tokens rows
     * before attending, so W + max_tokens - 1 rows are always enough */
    int64_t r = (int64_t)c->sliding_window + max_tokens - 1;
    return r < ctx ? r : ctx;
}

/* KV-cache bytes for a context of ctx positions (f32 on the CPU). */
static uint64_t kv_cache_bytes(const Config *c, int ctx, int max_tokens) {
    uint64_t b = 0;
    for (int l = 0; l < c->n_layers; l++) b += (uint64_t)cache_rows_for(c, l, ctx, max_tokens) * c->kv_dim * 2 * 4;
    return b;
}

static void alloc_state(Model *m, int ctx, int max_tokens) {
    Config *c = &m->config;
    RunState *s = &m->state;
    s->ctx = ctx;
    s->max_tokens = max_tokens;
    size_t T = (size_t)max_tokens, H = c->dim, QD = (size_t)c->max_heads * c->head_dim;
    size_t hid = (size_t)c->hidden_dim;
    if ((size_t)2 * c->moe_hidden_dim > hid) hid = (size_t)2 * c->moe_hidden_dim;
    if ((size_t)2 * c->shared_hidden_dim > hid) hid = (size_t)2 * c->shared_hidden_dim;
    size_t K = c->n_experts_active > 0 ? (size_t)c->n_experts_active : 1;
    s->x = xcalloc(T * H, sizeof(float));
    s->xb = xcalloc(T * H, sizeof(float));
    s->q = xcalloc(T * QD, sizeof(float));
    s->k = xcalloc(T * c->kv_dim, sizeof(float));
    s->v = xcalloc(T * c->kv_dim, sizeof(float));
    s->att = xcalloc(T * QD, sizeof(float));
    s->gate = xcalloc(T * QD, sizeof(float));
    s->hb = xcalloc(T * hid, sizeof(float));
    s->hb2 = xcalloc(T * hid, sizeof(float));
    s->mlp_out = xcalloc(T * H, sizeof(float));
    s->router_logits = xcalloc(T * (c->n_experts > 0 ? c->n_experts : 1), sizeof(float));
    s->topk_idx = xcalloc(T * K, sizeof(int));
    s->topk_w = xcalloc(T * K, sizeof(float));
    s->expert_in = xcalloc(T * H, sizeof(float));
    s->expert_out = xcalloc(T * K * H, sizeof(float));
#ifdef _OPENMP
    s->n_threads = omp_get_max_threads();
#else
    s->n_threads = 1;
#endif
    s->scores = xcalloc((size_t)s->n_threads * ctx, sizeof(float));
    s->logits = xcalloc(T * c->vocab_size, sizeof(float));
    s->key_cache = xcalloc(c->n_layers, sizeof(float *));
    s->value_cache = xcalloc(c->n_layers, sizeof(float *));
    s->cache_rows = xcalloc(c->n_layers, sizeof(int));
    for (int l = 0; l < c->n_layers; l++) {
        s->cache_rows[l] = (int)cache_rows_for(c, l, ctx, max_tokens);
        /* calloc: pages are only touched as the context fills */
        s->key_cache[l] = xcalloc((size_t)s->cache_rows[l] * c->kv_dim, sizeof(float));
        s->value_cache[l] = xcalloc((size_t)s->cache_rows[l] * c->kv_dim, sizeof(float));
    }
}

static void free_state(Model *m) {
    RunState *s = &m->state;
    if (!s->x) return;
    free(s->x); free(s->xb); free(s->q); free(s->k); free(s->v); free(s->att); free(s->gate);
    free(s->hb); free(s->hb2); free(s->mlp_out); free(s->router_logits); free(s->topk_idx); free(s->topk_w);
    free(s->expert_in); free(s->expert_out); free(s->scores); free(s->logits); free(s->taps);
    for (int l = 0; l < m->config.n_layers; l++) { free(s->key_cache[l]); free(s->value_cache[l]); }
    free(s->key_cache); free(s->value_cache); free(s->cache_rows);
    memset(s, 0, sizeof *s);
}

void free_model(Model *m) {
    free_state(m);
    if (m->map) munmap(m->map, m->file_size);
    if (m->fd >= 0) close(m->fd);
    m->map = NULL;
    m->fd = -1;
}

/* ----------------------------------------------------------------------------
 * the math: small functions named after what they compute (all fp32) */

/* out[t, :] = w * x[t, :] / sqrt(mean(x[t, :]^2) + eps) for n rows of size d */
static void rmsnorm(float *out, const float *x, const float *w, int n, int d, float eps) {
    for (int t = 0; t < n; t++) {
        const float *xt = x + (size_t)t * d;
        double ss = 0.0;
        for (int j = 0; j < d; j++) ss += (double)xt[j] * xt[j];
        float inv = 1.0f / sqrtf((float)(ss / d) + eps);
        for (int j = 0; j < d; j++) out[(size_t)t * d + j] = w[j] * (xt[j] * inv);
    }
}

/* Dot products: fp32 sums over blocks of 32 (they vectorise), the blocks added in double, so long rows
 * stay accurate (fixtures agree with transformers to ~3e-5) at close to plain fp32 speed. */
#define DOT_BLOCK 32
static float dot_f32(const float *w, const float *x, int n) {
    double s = 0.0;
    int j = 0;
    for (; j + DOT_BLOCK <= n; j += DOT_BLOCK) {
        float b = 0.0f;
#pragma omp simd reduction(+ : b)
        for (int k = 0; k < DOT_BLOCK; k++) b += w[j + k] * x[j + k];
        s += b;
    }
    for (; j < n; j++) s += (double)w[j] * x[j];
    return (float)s;
}

static float dot_bf16(const uint16_t *w, const float *x, int n) {
    double s = 0.0;
    int j = 0;
    for (; j + DOT_BLOCK <= n; j += DOT_BLOCK) {
        float b = 0.0f;
#pragma omp simd reduction(+ : b)
        for (int k = 0; k < DOT_BLOCK; k++) b += bf16_to_float(w[j + k]) * x[j + k];
        s += b;
    }
    for (; j < n; j++) s += (double)bf16_to_float(w[j]) * x[j];
    return (float)s;
}

/* q8 / q4 rows: per group of 32, scale * sum(value * x) (the last group may be partial) */
static float dot_q8(const int8_t *q, const uint16_t *scales, const float *x, int n) {
    double s = 0.0;
    for (int g = 0; g * LAGUNA_QGROUP < n; g++) {
        int len = n - g * LAGUNA_QGROUP < LAGUNA_QGROUP ? n - g * LAGUNA_QGROUP : LAGUNA_QGROUP;
        const int8_t *qg = q + g * LAGUNA_QGROUP;
        const float *xg = x + g * LAGUNA_QGROUP;
        float acc = 0.0f;
        for (int i = 0; i < len; i++) acc += (float)qg[i] * xg[i];
        s += (double)fp16_value(scales[g]) * acc;
    }
    return (float)s;
}

static float dot_q4(const uint8_t *q, const uint16_t *scales, const float *x, int n) {
    double s = 0.0;
    for (int g = 0; g * LAGUNA_QGROUP < n; g++) {
        int len = n - g * LAGUNA_QGROUP < LAGUNA_QGROUP ? n - g * LAGUNA_QGROUP : LAGUNA_QGROUP;
        const uint8_t *qg = q + g * LAGUNA_QGROUP / 2;
        const float *xg = x + g * LAGUNA_QGROUP;
        float acc = 0.0f;
        for (int i = 0; i < len; i++) acc += (float)(((qg[i / 2] >> (4 * (i & 1))) & 15) - 8) * xg[i];
        s += (double)fp16_value(scales[g]) * acc;
    }
    return (float)s;
}

/* row r of a weight as fp32 (the embedding lookup) */
static void weight_row(float *out, const Tensor *w, int64_t r, int n) {
    if (w->dtype == DT_F32) { memcpy(out, (const float *)w->data + r * n, n * sizeof(float)); return; }
    for (int i = 0; i < n; i++) {
        if (w->dtype == DT_BF16) { out[i] = bf16_to_float(((const uint16_t *)w->data)[r * n + i]); continue; }
        float sc = fp16_value(w->scales[r * w->groups + i / LAGUNA_QGROUP]);
        int v = w->dtype == DT_Q8 ? ((const int8_t *)w->data)[r * w->groups * LAGUNA_QGROUP + i]
              : ((((const uint8_t *)w->data)[r * w->groups * LAGUNA_QGROUP / 2 + i / 2] >> (4 * (i & 1))) & 15) - 8;
        out[i] = v * sc;
    }
}

/* out[t, i] = sum_j W[row0 + i, j] * x[t, j]   for t < n, i < d;  W is [*, in] (f32, bf16, q8, q4), read in place.
 * Each weight row is read once for all n tokens: prefill and verification pay for the weights once. */
static void matmul(float *out, const float *x, const Tensor *w, int64_t row0, int n, int in, int d) {
#pragma omp parallel for schedule(static)
    for (int i = 0; i < d; i++) {
        int64_t r = row0 + i;
        if (w->dtype == DT_BF16) {
            const uint16_t *wr = (const uint16_t *)w->data + r * in;
            for (int t = 0; t < n; t++) out[(size_t)t * d + i] = dot_bf16(wr, x + (size_t)t * in, in);
        } else if (w->dtype == DT_Q8) {
            const int8_t *wr = (const int8_t *)w->data + r * w->groups * LAGUNA_QGROUP;
            for (int t = 0; t < n; t++)
                out[(size_t)t * d + i] = dot_q8(wr, w->scales + r * w->groups, x + (size_t)t * in, in);
        } else if (w->dtype == DT_Q4) {
            const uint8_t *wr = (const uint8_t *)w->data + r * w->groups * LAGUNA_QGROUP / 2;
            for (int t = 0; t < n; t++)
                out[(size_t)t * d + i] = dot_q4(wr, w->scales + r * w->groups, x + (size_t)t * in, in);
        } else {
            const float *wr = (const float *)w->data + r * in;
            for (int t = 0; t < n; t++) out[(size_t)t * d + i] = dot_f32(wr, x + (size_t)t * in, in);
        }
    }
}

static void add_bias(float *x, const Tensor *b, int n, int d) {
    if (!b->data) return;
    const float *bb = b->data;
    for (int t = 0; t < n; t++)
        for (int i = 0; i < d; i++) x[(size_t)t * d + i] += bb[i];
}

static float silu(float x) { return x / (1.0f + expf(-x)); }
static float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }
static float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

static void softmax(float *x, int n) {
    float max = x[0];
    for (int i = 1; i < n; i++) if (x[i] > max) max = x[i];
    float sum = 0.0f;
    for (int i = 0; i < n; i++) { x[i] = expf(x[i] - max); sum += x[i]; }
    for (int i = 0; i < n; i++) x[i] /= sum;
}

/* NeoX-style RoPE on the first rd dims of one head vector: pairs (i, i + rd/2); dims >= rd pass through.
 * cos/sin of (pos * inv_freq[i]) in fp32, times the YaRN attention scaling. */
static void rope(float *v, int pos, const float *inv_freq, int rd, float scaling) {
    int half = rd / 2;
    for (int i = 0; i < half; i++) {
        float f = (float)pos * inv_freq[i];
        float c = cosf(f) * scaling, s = sinf(f) * scaling;
        float a = v[i], b = v[i + half];
        v[i] = a * c - b * s;
        v[i + half] = b * c + a * s;
    }
}

/* ----------------------------------------------------------------------------
 * the forward pass, in model order
 *
 * forward(m, tokens, n, pos, all_logits): run n tokens at positions pos..pos+n-1 through the model,
 * appending their K/V to the cache. Returns logits [n, V] (all_logits) or [1, V] for the last token.
 * Truncating the cache (DFlash rollback) is just calling forward again at a smaller pos. */

static void attention(Model *m, int l, int n, int pos) {
    Config *c = &m->config;
    RunState *s = &m->state;
    int D = c->head_dim, nh = c->n_heads[l], KVD = c->kv_dim, group = nh / c->n_kv_heads;
    int sliding = c->layer_type[l] == ATTN_SLIDING, rows = s->cache_rows[l];
    const float scale = 1.0f / sqrtf((float)D);
    float *kc = s->key_cache[l], *vc = s->value_cache[l];
#pragma omp parallel for schedule(dynamic)
    for (int th = 0; th < n * nh; th++) {
        int t = th / nh, h = th % nh, p = pos + t;
#ifdef _OPENMP
        float *sc = s->scores + (size_t)omp_get_thread_num() * s->ctx;
#else
        float *sc = s->scores;
#endif
        const float *q = s->q + (size_t)t * nh * D + (size_t)h * D;
        int kvh = h / group;                  /* GQA: contiguous groups of query heads share a kv head */
        int start = sliding ? p - c->sliding_window + 1 : 0;  /* window: keys p-W+1..p, self included */
        if (start < 0) start = 0;
        int end = c->causal ? p : pos + n - 1;  /* a non-causal drafter block also sees the keys after it */
        for (int u = start; u <= end; u++) {
            const float *k = kc + (size_t)(u % rows) * KVD + (size_t)kvh * D;
            sc[u - start] = dot_f32(q, k, D) * scale;
        }
        softmax(sc, end - start + 1);
        float *o = s->att + (size_t)t * nh * D + (size_t)h * D;
        memset(o, 0, D * sizeof(float));
        for (int u = start; u <= end; u++) {
            const float *v = vc + (size_t)(u % rows) * KVD + (size_t)kvh * D;
            float a = sc[u - start];
            for (int d = 0; d < D; d++) o[d] += a * v[d];
        }
    }
}

/* Sigmoid router: bias picks the experts, the unbiased scores weigh them (renormalised over the top-k). */
static void route(Model *m, int l, int n) {
    Config *c = &m->config;
    RunState *s = &m->state;
    LayerWeights *w = &m->weights.layers[l];
    int E = c->n_experts, K = c->n_experts_active;
    matmul(s->router_logits, s->xb, &w->router, 0, n, c->dim, E);
    const float *bias = w->expert_bias.data;
    for (int t = 0; t < n; t++) {
        float *lg = s->router_logits + (size_t)t * E;
        int *idx = s->topk_idx + (size_t)t * K;
        float *wt = s->topk_w + (size_t)t * K;
        for (int e = 0; e < E; e++) {
            if (c->router_softcap > 0.0f) lg[e] = tanhf(lg[e] / c->router_softcap) * c->router_softcap;
            lg[e] = sigmoid(lg[e]);           /* lg now holds the scores */
        }
        float sum = 0.0f;
        for (int j = 0; j < K; j++) {         /* top-k of score + bias, descending; ties -> lower id */
            int best = -1;
            float bv = 0.0f;
            for (int e = 0; e < E; e++) {
                int taken = 0;
                for (int i = 0; i < j; i++) taken |= idx[i] == e;
                if (taken) continue;
                float v = lg[e] + bias[e];
                if (best < 0 || v > bv) { best = e; bv = v; }
            }
            idx[j] = best;
            wt[j] = lg[best];
            sum += wt[j];
        }
        for (int j = 0; j < K; j++) wt[j] /= sum;
    }
}

/* SwiGLU: out = down(silu(gate(x)) * up(x)); gate and up are consecutive row blocks of gu when fused. */
static void swiglu_act(float *hb, const float *g, const float *u, int n, int hid, int gstride, int ustride) {
    for (int t = 0; t < n; t++)
        for (int i = 0; i < hid; i++)
            hb[(size_t)t * hid + i] = silu(g[(size_t)t * gstride + i]) * u[(size_t)t * ustride + i];
}

static void dense_mlp(Model *m, const Tensor *wg, const Tensor *wu, const Tensor *wd, int hid, int n, float *out) {
    Config *c = &m->config;
    RunState *s = &m->state;
    matmul(s->hb, s->xb, wg, 0, n, c->dim, hid);
    matmul(s->hb2, s->xb, wu, 0, n, c->dim, hid);
    swiglu_act(s->hb, s->hb, s->hb2, n, hid, hid, hid);
    matmul(out, s->hb, wd, 0, n, hid, c->dim);
}

/* MoE: route, run each selected expert once over the tokens that chose it, then sum per token in
 * ascending expert id (the order transformers' eager experts add them), x scaling, + shared expert. */
static void moe(Model *m, int l, int n) {
    Config *c = &m->config;
    RunState *s = &m->state;
    LayerWeights *w = &m->weights.layers[l];
    int H = c->dim, E = c->n_experts, K = c->n_experts_active, I = c->moe_hidden_dim;
    route(m, l, n);
    int rows[n > 0 ? n : 1], slots[n > 0 ? n : 1];
    for (int e = 0; e < E; e++) {
        int cnt = 0;                          /* gather the tokens routed to expert e */
        for (int t = 0; t < n; t++)
            for (int j = 0; j < K; j++)
                if (s->topk_idx[t * K + j] == e) {
                    rows[cnt] = t; slots[cnt] = j;
                    memcpy(s->expert_in + (size_t)cnt * H, s->xb + (size_t)t * H, H * sizeof(float));
                    cnt++;
                }
        if (!cnt) continue;
        matmul(s->hb, s->expert_in, &w->experts_gate_up, (int64_t)e * 2 * I, cnt, H, 2 * I); /* [cnt, 2I] */
        swiglu_act(s->hb2, s->hb, s->hb + I, cnt, I, 2 * I, 2 * I);
        matmul(s->mlp_out, s->hb2, &w->experts_down, (int64_t)e * H, cnt, I, H);             /* [cnt, H] */
        for (int r = 0; r < cnt; r++) {
            float wgt = s->topk_w[rows[r] * K + slots[r]];
            float *dst = s->expert_out + ((size_t)rows[r] * K + slots[r]) * H;
            for (int i = 0; i < H; i++) dst[i] = s->mlp_out[(size_t)r * H + i] * wgt;
        }
    }
    /* shared expert into mlp_out, then out = routed * scaling + shared */
    dense_mlp(m, &w->shared_gate, &w->shared_up, &w->shared_down, c->shared_hidden_dim, n, s->mlp_out);
    for (int t = 0; t < n; t++) {
        int order[K];                          /* this token's slots sorted by expert id */
        for (int j = 0; j < K; j++) order[j] = j;
        for (int a = 1; a < K; a++)
            for (int b = a; b > 0 && s->topk_idx[t * K + order[b]] < s->topk_idx[t * K + order[b - 1]]; b--) {
                int tmp = order[b]; order[b] = order[b - 1]; order[b - 1] = tmp;
            }
        for (int i = 0; i < H; i++) {
            float acc = 0.0f;
            for (int j = 0; j < K; j++) acc += s->expert_out[((size_t)t * K + order[j]) * H + i];
            s->mlp_out[(size_t)t * H + i] += acc * c->routed_scaling;
        }
    }
}

/* one K or V row into the cache: as is, or each element rounded to the nearest e4m3 (--kv fp8) or bf16 value (--kv bf16
 * on a bf16 file): the values the GPU's cache holds, kept in fp32 storage so the attention below is unchanged */
static void cache_put(float *dst, const float *src, int n, int kv) {
    for (int i = 0; i < n; i++)
        dst[i] = kv == KV_FP8 ? fp8_e4m3_round(src[i]) : kv == KV_BF16 ? bf16_round(src[i]) : src[i];
}

float *forward(Model *m, const int *tokens, int n, int pos, int all_logits) {
    Config *c = &m->config;
    Weights *w = &m->weights;
    RunState *s = &m->state;
    int H = c->dim, D = c->head_dim, KVD = c->kv_dim;
    /* what the K/V cache rounds to (--kv): fp8, bf16 (asked for, on a bf16 file: as the GPU keeps it), or nothing */
    int kv_round = m->kv == KV_FP8 ? KV_FP8 : m->kv == KV_BF16 && model_plain_dtype(m) != DT_F32 ? KV_BF16 : 0;

    /* token embedding: h = embed[token] (no scaling) */
    for (int t = 0; t < n; t++) weight_row(s->x + (size_t)t * H, &w->embed, tokens[t], H);

    for (int l = 0; l < c->n_layers; l++) {
        LayerWeights *lw = &w->layers[l];
        int nh = c->n_heads[l], QD = nh * D, type = c->layer_type[l], rows = s->cache_rows[l];

        /* ---- attention block ---- */
        rmsnorm(s->xb, s->x, lw->attn_norm.data, n, H, c->norm_eps);
        matmul(s->q, s->xb, &lw->wq, 0, n, H, QD);
        matmul(s->k, s->xb, &lw->wk, 0, n, H, KVD);
        matmul(s->v, s->xb, &lw->wv, 0, n, H, KVD);
        add_bias(s->q, &lw->bq, n, QD);
        add_bias(s->k, &lw->bk, n, KVD);
        add_bias(s->v, &lw->bv, n, KVD);
        /* per-head QK-norm (one [D] weight shared by all heads), then RoPE; V is left as is */
        rmsnorm(s->q, s->q, lw->q_norm.data, n * nh, D, c->norm_eps);
        rmsnorm(s->k, s->k, lw->k_norm.data, n * c->n_kv_heads, D, c->norm_eps);
        for (int t = 0; t < n; t++) {
            for (int h = 0; h < nh; h++)
                rope(s->q + (size_t)t * QD + (size_t)h * D, pos + t, w->inv_freq[type], c->rotary_dim[type],
                     c->rope_scaling[type]);
            for (int h = 0; h < c->n_kv_heads; h++)
                rope(s->k + (size_t)t * KVD + (size_t)h * D, pos + t, w->inv_freq[type], c->rotary_dim[type],
                     c->rope_scaling[type]);
            /* append K/V at the position's row (full layers: the position; sliding: a ring) */
            size_t row = (size_t)((pos + t) % rows);
            cache_put(s->key_cache[l] + row * KVD, s->k + (size_t)t * KVD, KVD, kv_round);
            cache_put(s->value_cache[l] + row * KVD, s->v + (size_t)t * KVD, KVD, kv_round);
        }
        attention(m, l, n, pos);
        /* softplus output gate from the normed layer input, per head (or per element) */
        int GD = c->gate_per_head ? nh : QD;
        if (c->gated) matmul(s->gate, s->xb, &lw->wg, 0, n, H, GD);
        for (int t = 0; c->gated && t < n; t++)
            for (int i = 0; i < QD; i++) {
                float g = softplus(s->gate[(size_t)t * GD + (c->gate_per_head ? i / D : i)]);
                s->att[(size_t)t * QD + i] *= g;
            }
        matmul(s->mlp_out, s->att, &lw->wo, 0, n, QD, H);
        add_bias(s->mlp_out, &lw->bo, n, H);
        for (size_t i = 0; i < (size_t)n * H; i++) s->x[i] += s->mlp_out[i];

        /* ---- MLP block: dense SwiGLU or MoE ---- */
        rmsnorm(s->xb, s->x, lw->ffn_norm.data, n, H, c->norm_eps);
        if (c->mlp_type[l] == MLP_DENSE) dense_mlp(m, &lw->w_gate, &lw->w_up, &lw->w_down, c->hidden_dim, n, s->mlp_out);
        else moe(m, l, n);
        for (size_t i = 0; i < (size_t)n * H; i++) s->x[i] += s->mlp_out[i];

        /* DFlash taps: the residual stream after this layer, for every row (the last layer's before the final norm) */
        for (int i = 0; s->taps && i < s->n_taps; i++)
            if (s->tap_layers[i] == l)
                for (int t = 0; t < n; t++)
                    memcpy(s->taps + ((size_t)t * s->n_taps + i) * H, s->x + (size_t)t * H, H * sizeof(float));
    }

    /* final norm and lm_head (for every row, or just the last) */
    int first = all_logits ? 0 : n - 1, rows_out = all_logits ? n : 1;
    rmsnorm(s->xb, s->x + (size_t)first * H, w->final_norm.data, rows_out, H, c->norm_eps);
    matmul(s->logits, s->xb, &w->lm_head, 0, rows_out, H, c->vocab_size);
    return s->logits;
}

/* ----------------------------------------------------------------------------
 * backends: the CPU forward above, or the GPU one in laguna.cu */

typedef struct {
    Model *m;
    GpuModel *gpu;           /* NULL: CPU */
} Engine;

static float *engine_forward(Engine *e, const int *tokens, int n, int pos, int all_logits) {
    if (e->gpu) return gpu_forward(e->gpu, tokens, n, pos, all_logits);
    return forward(e->m, tokens, n, pos, all_logits);
}

static int engine_max_tokens(Engine *e) { return e->m->state.max_tokens; }

/* Run a prompt of any length in chunks of max_tokens; returns the last token's logits. */
static float *prefill(Engine *e, const int *tokens, int n, int pos) {
    float *logits = NULL;
    int step = engine_max_tokens(e);
    for (int i = 0; i < n; i += step) {
        int k = n - i < step ? n - i : step;
        logits = engine_forward(e, tokens + i, k, pos + i, 0);
    }
    return logits;
}

/* ----------------------------------------------------------------------------
 * sampling: greedy, temperature, top-p (nucleus) */

typedef struct {
    float temperature, topp;
    unsigned long long rng;
    int vocab;
    float *probs;
    int *idx;
} Sampler;

static unsigned int random_u32(unsigned long long *state) {
    *state ^= *state >> 12;  /* xorshift rng */
    *state ^= *state << 25;
    *state ^= *state >> 27;
    return (unsigned int)((*state * 0x2545F4914F6CDD1Dull) >> 32);
}
static float random_f32(unsigned long long *state) { return (random_u32(state) >> 8) / 16777216.0f; }

static int argmax(const float *x, int n) {
    int best = 0;
    for (int i = 1; i < n; i++) if (x[i] > x[best]) best = i;
    return best;
}

static int cmp_desc(const void *a, const void *b, void *arg) {
    const float *p = arg;
    float x = p[*(const int *)a], y = p[*(const int *)b];
    return x < y ? 1 : x > y ? -1 : 0;
}

static int sample(Sampler *sp, const float *logits) {
    if (sp->temperature == 0.0f) return argmax(logits, sp->vocab);
    float *p = sp->probs;
    for (int i = 0; i < sp->vocab; i++) p[i] = logits[i] / sp->temperature;
    softmax(p, sp->vocab);
    float r = random_f32(&sp->rng);
    if (sp->topp <= 0.0f || sp->topp >= 1.0f) {     /* plain sampling from the full distribution */
        float cdf = 0.0f;
        for (int i = 0; i < sp->vocab; i++) { cdf += p[i]; if (r < cdf) return i; }
        return sp->vocab - 1;
    }
    /* top-p: the smallest set of most likely tokens whose mass exceeds topp; drop tiny ones first */
    int n = 0;
    const float cutoff = (1.0f - sp->topp) / (sp->vocab - 1);
    for (int i = 0; i < sp->vocab; i++) if (p[i] >= cutoff) sp->idx[n++] = i;
    qsort_r(sp->idx, n, sizeof(int), cmp_desc, p);
    float mass = 0.0f;
    int last = n - 1;
    for (int i = 0; i < n; i++) { mass += p[sp->idx[i]]; if (mass > sp->topp) { last = i; break; } }
    float cdf = 0.0f;
    r *= mass;
    for (int i = 0; i <= last; i++) { cdf += p[sp->idx[i]]; if (r < cdf) return sp->idx[i]; }
    return sp->idx[last];
}

/* ----------------------------------------------------------------------------
 * generation, scoring and chat */

typedef struct DFlash DFlash;   /* speculative decoding state, below */

typedef struct {
    const char *model_path;
    const char *prompt;
    const char *prompt_file;
    const char *system;
    const char *score_file;
    const char *logits_out;
    const char *tokenize_text;
    const char *mode;
    const char *draft_path;
    const char *taps_out;
    const char *draft_logits_out;
    int steps, ctx, seed_set, raw, cpu, ids_mode, think, chunk, quiet, kv;
    int draft_max, compare, samples;
    int random_weights;               /* --random-weights SEED */
    unsigned long long random_seed;
    float temperature, topp;
    unsigned long long seed;
} Options;

static int is_eos(const Config *c, int tok) {
    for (int i = 0; i < c->n_eos; i++) if (c->eos_ids[i] == tok) return 1;
    return 0;
}

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) die("cannot open %s: %s", path, strerror(errno));
    size_t cap = 1 << 16, n = 0;
    char *buf = xcalloc(cap, 1);
    size_t r;
    while ((r = fread(buf + n, 1, cap - n - 1, f)) > 0) {
        n += r;
        if (n + 1 == cap) { cap *= 2; buf = realloc(buf, cap); if (!buf) die("out of memory"); }
    }
    fclose(f);
    buf[n] = 0;
    if (len) *len = n;
    return buf;
}

/* Whitespace-separated token ids, each checked against the vocabulary. */
static int *parse_ids(const char *text, int vocab, int *n_out, const char *what) {
    int cap = 64, n = 0;
    int *ids = xcalloc(cap, sizeof(int));
    const char *s = text;
    while (*s) {
        while (*s && isspace((unsigned char)*s)) s++;
        if (!*s) break;
        char *end;
        errno = 0;
        long v = strtol(s, &end, 10);
        if (end == s || (*end && !isspace((unsigned char)*end)))
            die("%s: '%.20s' is not a token id\n  hint: give whitespace-separated integers", what, s);
        if (v < 0 || v >= vocab || errno)
            die("%s: token id %ld is out of range (the vocabulary has %d ids, 0..%d)", what, v, vocab, vocab - 1);
        if (n == cap) { cap *= 2; ids = realloc(ids, cap * sizeof(int)); if (!ids) die("out of memory"); }
        ids[n++] = (int)v;
        s = end;
    }
    *n_out = n;
    return ids;
}

static void check_fits(int n_prompt, int ctx) {
    if (n_prompt > ctx) die("prompt (%d tokens) exceeds the context size (%d tokens)\n  hint: shorten the prompt "
                            "or raise -c (up to the model's maximum)", n_prompt, ctx);
}

/* --score: one teacher-forced pass; mean NLL and perplexity of tokens 2..n, logits optionally saved */
static int run_score(Engine *e, DFlash *df, const Options *o) {
    Config *c = &e->m->config;
    char *text = read_file(o->score_file, NULL);
    int n;
    int *ids = parse_ids(text, c->vocab_size, &n, o->score_file);
    free(text);
    if (n < 2) die("%s: --score needs at least 2 token ids", o->score_file);
    check_fits(n, e->m->state.ctx);
    FILE *lf = NULL, *tf = NULL;
    if (o->logits_out && !(lf = fopen(o->logits_out, "wb"))) die("cannot write %s: %s", o->logits_out, strerror(errno));
    if (o->taps_out && !df) die("--taps needs -d DRAFTER (it names the tap layers)");
    if (o->taps_out && !(tf = fopen(o->taps_out, "wb"))) die("cannot write %s: %s", o->taps_out, strerror(errno));
    double nll = 0.0;
    int step = engine_max_tokens(e), V = c->vocab_size;
    double t0 = now_s();
    for (int i = 0; i < n; i += step) {
        int k = n - i < step ? n - i : step;
        float *logits = engine_forward(e, ids + i, k, i, 1);
        if (lf && fwrite(logits, sizeof(float), (size_t)k * V, lf) != (size_t)k * V) die("write to %s failed", o->logits_out);
        size_t nt = tf ? (size_t)k * e->m->state.n_taps * c->dim : 0;
        if (tf && e->gpu) gpu_copy_taps(e->gpu, k, e->m->state.taps);
        if (tf && fwrite(e->m->state.taps, sizeof(float), nt, tf) != nt) die("write to %s failed", o->taps_out);
        for (int r = 0; r < k; r++) {
            int t = i + r;                 /* row t predicts token t+1 */
            if (t + 1 >= n) break;
            const float *lg = logits + (size_t)r * V;
            float max = lg[argmax(lg, V)];
            double sum = 0.0;
            for (int j = 0; j < V; j++) sum += exp((double)lg[j] - max);
            nll += -((double)lg[ids[t + 1]] - max - log(sum));
        }
    }
    double dt = now_s() - t0;
    if (lf) fclose(lf);
    if (tf) fclose(tf);
    nll /= (n - 1);
    printf("tokens %d  mean_nll %.6f  perplexity %.4f\n", n, nll, exp(nll));
    fprintf(stderr, "scored %d tokens in %.2f s (%.1f tok/s)\n", n, dt, n / dt);
    free(ids);
    return 0;
}

typedef struct {
    Tokenizer *tok;          /* NULL for a file without a tokenizer (ids only) */
    TokenDecoder dec;
    int dim;                 /* showing reasoning: dimmed until </think> (on a terminal) */
    int think_end;           /* id of </think> */
    int silent;              /* print nothing (the --compare rerun) */
    FILE *trace;             /* test hook (--logits while generating): the logits row behind each token */
    int vocab;
} Printer;

static void trace_logits(Printer *p, const float *row) {
    if (p->trace && fwrite(row, sizeof(float), p->vocab, p->trace) != (size_t)p->vocab) die("writing --logits failed");
}

static void print_token(Printer *p, int id, int ids_mode) {
    if (p->silent) return;
    if (ids_mode || !p->tok) { printf("%d ", id); fflush(stdout); return; }
    size_t len;
    const char *text = tokenizer_decode_next(&p->dec, id, &len);
    fwrite(text, 1, len, stdout);
    if (p->dim && id == p->think_end) { fputs("\033[0m", stdout); p->dim = 0; }
    fflush(stdout);
}

/* A decode step on the GPU: forward `token` at `pos` and sample the next token on the device (a CUDA graph; only
 * token ids cross). Launched ahead: token -1 is the token of the step launched before it, so the GPU runs step t + 1
 * while the host prints step t's token (gpu_decode_wait returns it). The coin comes from the same rng stream as
 * sample(): the same distribution, though the device walks the nucleus in id order rather than sorted order. */
static void engine_decode_launch(Engine *e, Sampler *sp, int token, int pos) {
    float coin = sp->temperature > 0.0f ? random_f32(&sp->rng) : 0.0f;
    gpu_decode_launch(e->gpu, token, pos, sp->temperature, sp->topp, coin);
}

/* Generate up to `steps` tokens after a prompt already in the cache; returns the count. On the GPU each step
 * is launched before the previous one's token is read (it takes that token on the device), so the token that
 * follows a stop token is computed and thrown away: its coin goes back to the rng (the same stream as without
 * launching ahead), and the next forward overwrites its cache row. */
static int generate(Engine *e, Sampler *sp, Printer *pr, const float *logits, int pos, int steps, int ids_mode,
                    int stop_id, int *out_ids, double *decode_s) {
    Config *c = &e->m->config;
    int n = 0, next = -1, inflight = 0, stopped = 0;
    unsigned long long rng_ahead = 0;        /* the rng before the coin of the step launched last */
    int on_device = e->gpu && !pr->trace;    /* --logits tracing needs the logits rows on the host */
    int ahead = !getenv("LAGUNA_NO_AHEAD");  /* (a test and timing hook: each step launched once its token is read) */
    double t0 = now_s();
    while (n < steps && pos < e->m->state.ctx) {
        if (!on_device || n == 0) {
            next = sample(sp, logits);
            trace_logits(pr, logits);
        } else {
            next = gpu_decode_wait(e->gpu);      /* the step launched for the token before */
            inflight--;
        }
        if (out_ids) out_ids[n] = next;
        n++;
        if (is_eos(c, next) || next == stop_id) { stopped = 1; break; }
        print_token(pr, next, ids_mode);
        if (!on_device) {
            logits = engine_forward(e, &next, 1, pos, 0);
        } else {
            if (n == 1 || !ahead) { engine_decode_launch(e, sp, next, pos); inflight++; }   /* a token the host has */
            if (ahead && n < steps && pos + 1 < e->m->state.ctx) {   /* the step after, if its token will be kept */
                rng_ahead = sp->rng;
                engine_decode_launch(e, sp, -1, pos + 1);
                inflight++;
            }
        }
        pos++;
    }
    if (stopped && inflight) sp->rng = rng_ahead;   /* the step after the stop token: thrown away */
    for (; inflight > 0; inflight--) gpu_decode_wait(e->gpu);
    *decode_s = now_s() - t0;
    return n;
}

static void report(int n_prompt, double prefill_s, int n_gen, double decode_s) {
    fprintf(stderr, "\nprompt: %d tokens, %.1f tok/s | generated: %d tokens, %.2f tok/s\n", n_prompt,
            prefill_s > 0 ? n_prompt / prefill_s : 0.0, n_gen, decode_s > 0 && n_gen > 1 ? (n_gen - 1) / decode_s : 0.0);
}


/* ----------------------------------------------------------------------------
 * speculative decoding with a DFlash drafter
 *
 * The drafter sees the target's residual stream at a few layers ("taps") for every committed token,
 * fused into one context vector per position and projected into each draft layer's K/V cache. One
 * drafter forward over [bonus, MASK x (B-1)] at positions P..P+B-1 proposes B-1 tokens (slot o predicts
 * position P+o); one target forward over [bonus, drafts] verifies them all. The longest prefix the
 * target agrees with is kept, plus the target's own next token; the target cache simply continues from
 * the first rejected position (the ring holds W + max_tokens - 1 rows, so that rollback is safe) and
 * only the accepted positions' taps become new drafter context.
 *
 * One loop for both backends: the steps below (add_context, draft, verify_forward) call the CPU functions here
 * or their GPU versions in laguna.cu, where the taps stay on the device and, greedy, only token ids cross. */

struct DFlash {
    Model *d;                /* the drafter; on the CPU its RunState holds its K/V cache (context + block) */
    GpuModel *gpu;           /* the drafter on the GPU (its weights and ring cache there), or NULL: the CPU */
    int block;               /* tokens per verify: bonus + up to block-1 drafts */
    float *cat;              /* CPU: [max_tokens, n_taps*H] per-tap normed target states, concatenated */
    float *ctx;              /* CPU: [max_tokens, H] fused context */
    long steps, drafted, accepted;
    long accepted_at[64];    /* verify steps whose draft slot i (0-based) was accepted */
};

/* Append target taps [n, n_taps, H] for positions pos..pos+n-1 as drafter context: per-tap RMSNorm,
 * fc, hidden_norm; then per draft layer input_layernorm -> K (k_norm, RoPE at the absolute position), V. */
static void drafter_add_context(DFlash *df, const float *taps, int n, int pos) {
    Model *d = df->d;
    Config *c = &d->config;
    RunState *s = &d->state;
    Weights *w = &d->weights;
    int H = c->dim, KVD = c->kv_dim, NT = c->n_taps;
    for (int r0 = 0; r0 < n; r0 += s->max_tokens) {
        int k = n - r0 < s->max_tokens ? n - r0 : s->max_tokens;
        for (int t = 0; t < k; t++)
            for (int i = 0; i < NT; i++)
                rmsnorm(df->cat + ((size_t)t * NT + i) * H, taps + ((size_t)(r0 + t) * NT + i) * H,
                        w->aux_norm[i].data, 1, H, c->norm_eps);
        matmul(df->ctx, df->cat, &w->fc, 0, k, NT * H, H);
        rmsnorm(df->ctx, df->ctx, w->hidden_norm.data, k, H, c->norm_eps);
        for (int l = 0; l < c->n_layers; l++) {
            LayerWeights *lw = &w->layers[l];
            int type = c->layer_type[l], rows = s->cache_rows[l];
            rmsnorm(s->xb, df->ctx, lw->attn_norm.data, k, H, c->norm_eps);
            matmul(s->k, s->xb, &lw->wk, 0, k, H, KVD);
            matmul(s->v, s->xb, &lw->wv, 0, k, H, KVD);
            rmsnorm(s->k, s->k, lw->k_norm.data, k * c->n_kv_heads, c->head_dim, c->norm_eps);
            for (int t = 0; t < k; t++) {
                int p = pos + r0 + t;
                for (int h = 0; h < c->n_kv_heads; h++)
                    rope(s->k + (size_t)t * KVD + (size_t)h * c->head_dim, p, w->inv_freq[type], c->rotary_dim[type],
                         c->rope_scaling[type]);
                memcpy(s->key_cache[l] + (size_t)(p % rows) * KVD, s->k + (size_t)t * KVD, KVD * sizeof(float));
                memcpy(s->value_cache[l] + (size_t)(p % rows) * KVD, s->v + (size_t)t * KVD, KVD * sizeof(float));
            }
        }
    }
}

/* Drafter context from rows row0..row0+n-1 of the target's last forward (its taps), at positions pos..pos+n-1. */
static void add_context(Engine *e, DFlash *df, int row0, int n, int pos) {
    RunState *s = &e->m->state;
    if (df->gpu) gpu_drafter_add_context(df->gpu, e->gpu, row0, n, pos);
    else drafter_add_context(df, s->taps + (size_t)row0 * s->n_taps * e->m->config.dim, n, pos);
}

/* The drafter's input: [bonus, MASK x (nblk-1)] */
static void block_tokens(const DFlash *df, int bonus, int nblk, int *toks) {
    toks[0] = bonus;
    for (int o = 1; o < nblk; o++) toks[o] = df->d->config.mask_id;
}

/* One drafter forward: the block at P..P+nblk-1 -> logits [nblk, V]; drafts are rows 1..nblk-1. */
static float *draft_block(DFlash *df, int bonus, int P, int nblk) {
    int toks[64];
    block_tokens(df, bonus, nblk, toks);
    if (df->gpu) return gpu_forward(df->gpu, toks, nblk, P, 1);
    return forward(df->d, toks, nblk, P, 1);
}

/* The drafts d[0..nblk-2]: the argmax of block slots 1..nblk-1 (on the GPU computed there: only ids cross). */
static void draft(DFlash *df, int bonus, int P, int nblk, int *d) {
    int V = df->d->config.vocab_size, toks[64], top[64];
    if (df->gpu) {
        block_tokens(df, bonus, nblk, toks);
        gpu_forward_argmax(df->gpu, toks, nblk, P, top);
    } else {
        float *dl = draft_block(df, bonus, P, nblk);
        for (int o = 1; o < nblk; o++) top[o] = argmax(dl + (size_t)o * V, V);
    }
    for (int o = 1; o < nblk; o++) d[o - 1] = top[o];
}

/* The target forward that also captures the taps; rows from ctx_from on become drafter context. */
static float *forward_with_taps(Engine *e, DFlash *df, const int *tokens, int n, int pos, int all_logits,
                                int ctx_from) {
    float *logits = engine_forward(e, tokens, n, pos, all_logits);
    int skip = ctx_from > pos ? ctx_from - pos : 0;   /* context older than the drafter's window is never read */
    if (skip < n) add_context(e, df, skip, n - skip, pos + skip);
    return logits;
}

/* The verify forward: the target over the block (taps captured). Greedy needs only each row's argmax, top[j]:
 * on the GPU only those ids cross to the host, and no logits are returned, unless `rows` asks for the logits
 * rows (sampling, or --logits tracing). */
static float *verify_forward(Engine *e, const int *toks, int nblk, int P, int rows, int *top) {
    if (e->gpu && !rows) { gpu_forward_argmax(e->gpu, toks, nblk, P, top); return NULL; }
    int V = e->m->config.vocab_size;
    float *logits = engine_forward(e, toks, nblk, P, 1);
    for (int j = 0; j < nblk; j++) top[j] = argmax(logits + (size_t)j * V, V);
    return logits;
}

/* Prefill the prompt on the target, capturing taps, and give the drafter its context. */
static float *prefill_dflash(Engine *e, DFlash *df, const int *tokens, int n) {
    const Config *dc = &df->d->config;
    int ctx_from = dc->sliding_window ? n - dc->sliding_window : 0;
    float *logits = NULL;
    int step = engine_max_tokens(e);
    for (int i = 0; i < n; i += step) {
        int k = n - i < step ? n - i : step;
        logits = forward_with_taps(e, df, tokens + i, k, i, 0, ctx_from);
    }
    return logits;
}

/* The sampler's distribution for one row of logits (temperature, then top-p), into p. */
static void target_probs(Sampler *sp, const float *logits, float *p) {
    int V = sp->vocab;
    for (int i = 0; i < V; i++) p[i] = logits[i] / sp->temperature;
    softmax(p, V);
    if (sp->topp <= 0.0f || sp->topp >= 1.0f) return;
    for (int i = 0; i < V; i++) sp->idx[i] = i;
    qsort_r(sp->idx, V, sizeof(int), cmp_desc, p);
    float mass = 0.0f;
    int keep = V;
    for (int i = 0; i < V; i++) { mass += p[sp->idx[i]]; if (mass > sp->topp) { keep = i + 1; break; } }
    for (int i = keep; i < V; i++) p[sp->idx[i]] = 0.0f;
    for (int i = 0; i < V; i++) p[i] /= mass;
}

static int sample_from(const float *p, int V, float r) {
    float cdf = 0.0f;
    int last = 0;
    for (int i = 0; i < V; i++) {
        if (p[i] <= 0.0f) continue;
        cdf += p[i];
        last = i;
        if (r < cdf) return i;
    }
    return last;
}

/* Verify drafts d[0..nd-1] against the target's rows [nd+1] (row j predicts position P+j+1).
 * Greedy: keep drafts while they equal the target's argmax top[j]. Sampling (the logits rows): accept d[j] with
 * probability p_j(d[j]); on a rejection sample from p_j with d[j] removed; this leaves the output distribution
 * exactly the target's (drafts are point masses). Returns the number accepted; *next is the token after them. */
static int verify(Sampler *sp, const float *logits, const int *top, const int *d, int nd, int *next) {
    int V = sp->vocab;
    if (sp->temperature == 0.0f) {
        int acc = 0;
        while (acc < nd && d[acc] == top[acc]) acc++;
        *next = top[acc];
        return acc;
    }
    static int biased = -1;          /* test hook: a deliberately wrong rule the statistical test must catch */
    if (biased < 0) biased = getenv("LAGUNA_TEST_BIASED_ACCEPT") != NULL;
    float *p = sp->probs;
    for (int j = 0; j < nd; j++) {
        target_probs(sp, logits + (size_t)j * V, p);
        float r = random_f32(&sp->rng);
        if (biased ? p[d[j]] > 0.0f : r < p[d[j]]) continue;
        p[d[j]] = 0.0f;              /* rejected: the residual max(p - point mass, 0), renormalised */
        float z = 0.0f;
        for (int i = 0; i < V; i++) z += p[i];
        *next = sample_from(p, V, random_f32(&sp->rng) * z);
        return j;
    }
    target_probs(sp, logits + (size_t)nd * V, p);
    *next = sample_from(p, V, random_f32(&sp->rng));
    return nd;
}

/* Generate with the drafter; same contract as generate(). */
static int generate_dflash(Engine *e, DFlash *df, Sampler *sp, Printer *pr, const float *logits, int P, int steps,
                           int ids_mode, int *out_ids, double *decode_s) {
    Config *c = &e->m->config;
    int V = c->vocab_size, ctx = e->m->state.ctx, n = 0;
    double t0 = now_s();
    int bonus = sample(sp, logits);
    trace_logits(pr, logits);
    for (;;) {
        /* the bonus token is committed output */
        if (out_ids) out_ids[n] = bonus;
        n++;
        if (is_eos(c, bonus)) break;
        print_token(pr, bonus, ids_mode);
        if (n >= steps || P >= ctx) break;
        int nblk = df->block;
        if (nblk > ctx - P) nblk = ctx - P;
        if (nblk > steps - n + 1) nblk = steps - n + 1;    /* no point drafting past -n */
        int toks[64], top[64] = {0};
        toks[0] = bonus;
        if (nblk > 1) draft(df, bonus, P, nblk, toks + 1);
        /* the target over the block; its taps are kept for the context below */
        float *tl = verify_forward(e, toks, nblk, P, sp->temperature > 0.0f || pr->trace, top);
        int next, acc = verify(sp, tl, top, toks + 1, nblk - 1, &next);
        df->steps++;
        df->drafted += nblk - 1;
        df->accepted += acc;
        for (int j = 0; j < acc; j++) df->accepted_at[j]++;
        /* drafter context: the taps of the committed rows P..P+acc (the bonus and the accepted drafts) */
        add_context(e, df, 0, acc + 1, P);
        int stop = 0;
        for (int j = 0; j < acc; j++) {          /* the accepted drafts are committed output */
            int tok = toks[1 + j];
            if (tl) trace_logits(pr, tl + (size_t)j * V);
            if (out_ids) out_ids[n] = tok;
            n++;
            if (is_eos(c, tok)) { stop = 1; break; }
            print_token(pr, tok, ids_mode);
            if (n >= steps) { stop = 1; break; }
        }
        if (stop) break;
        if (tl) trace_logits(pr, tl + (size_t)acc * V);
        P += acc + 1;
        bonus = next;
    }
    *decode_s = now_s() - t0;
    return n;
}

static void dflash_report(const DFlash *df, double tok_s) {
    if (!df->steps) return;
    fprintf(stderr, "dflash: %ld verify steps, %ld drafted, %ld accepted, acceptance %.3f, mean length tau %.2f, "
            "%.2f tok/s\n", df->steps, df->drafted, df->accepted,
            df->drafted ? (double)df->accepted / df->drafted : 0.0, 1.0 + (double)df->accepted / df->steps, tok_s);
    fprintf(stderr, "dflash: acceptance per block position:");
    for (int i = 0; i < df->block - 1; i++) fprintf(stderr, " %.2f", (double)df->accepted_at[i] / df->steps);
    fprintf(stderr, "\n");
}

static void randomize_weights(Model *m, uint64_t seed);

/* Check that the drafter (loaded by main) fits the target; put it beside the target (on the GPU when gpu is set). */
static void dflash_init(DFlash *df, Model *d, Model *target, GpuModel *gpu, int draft_max, int ctx) {
    char err[1024];
    memset(df, 0, sizeof *df);
    Config *dc = &d->config, *tc = &target->config;
    if (dc->vocab_size != tc->vocab_size)
        die("the drafter's vocabulary (%d) does not match the target's (%d)\n  hint: use the drafter trained for this "
            "model", dc->vocab_size, tc->vocab_size);
    if (dc->dim != tc->dim)
        die("the drafter's hidden size (%d) does not match the target's (%d)\n  hint: use the drafter trained for this "
            "model", dc->dim, tc->dim);
    if (dc->n_target_layers && dc->n_target_layers != tc->n_layers)
        die("the drafter was trained on a %d-layer target, this model has %d layers", dc->n_target_layers, tc->n_layers);
    for (int i = 0; i < dc->n_taps; i++)
        if (dc->tap_layers[i] < 0 || dc->tap_layers[i] >= tc->n_layers)
            die("the drafter taps target layer %d, but the model has layers 0..%d\n  hint: use the drafter trained "
                "for this model", dc->tap_layers[i], tc->n_layers - 1);
    if (dc->mask_id < 0 || dc->mask_id >= tc->vocab_size) die("the drafter's mask token %d is outside the vocabulary", dc->mask_id);
    d->weights.embed = target->weights.embed;       /* the drafter shares the target's embedding and lm_head */
    d->weights.lm_head = target->weights.lm_head;
    d->target = target;                             /* its plain dtype is the target's (model_plain_dtype) */
    df->d = d;
    df->block = dc->block_size;
    if (draft_max > 0 && draft_max + 1 < df->block) df->block = draft_max + 1;
    else if (draft_max + 1 > df->block)
        fprintf(stderr, "note: --draft-max %d is more than this drafter's block allows; it drafts %d\n", draft_max,
                df->block - 1);
    /* rollback is safe when the target's sliding rings hold W + block - 1 rows: they hold W + max_tokens - 1 */
    if (target->state.max_tokens < df->block && target->state.max_tokens < ctx)
        die("a verify block of %d tokens does not fit a forward of %d\n  hint: raise --chunk", df->block,
            target->state.max_tokens);
    d->random_weights = target->random_weights;     /* --random-weights fills both files */
    d->random_seed = target->random_seed;
    if (gpu) {
        df->gpu = gpu_drafter_init(gpu, d, ctx, df->block, err, sizeof err);
        if (!df->gpu) die("%s", err);
    } else {
        if (d->random_weights) randomize_weights(d, d->random_seed);
        alloc_state(d, ctx, df->block);
        df->cat = xcalloc((size_t)df->block * dc->n_taps * dc->dim, sizeof(float));
        df->ctx = xcalloc((size_t)df->block * dc->dim, sizeof(float));
    }
    /* the target captures the taps of every row it runs (on the GPU in device memory; this host copy is what
     * --taps writes) */
    RunState *ts = &target->state;
    ts->taps = xcalloc((size_t)ts->max_tokens * dc->n_taps * tc->dim, sizeof(float));
    ts->tap_layers = dc->tap_layers;
    ts->n_taps = dc->n_taps;
}

static void dflash_free(DFlash *df) {
    if (df->gpu) gpu_free(df->gpu);
    free(df->cat);
    free(df->ctx);
    free_model(df->d);
}

/* ----------------------------------------------------------------------------
 * --random-weights SEED: hash-random matmul weights, for benchmarks and GPU tests on the sparse files of
 * `export.py --synthetic` (real shapes, no 67 GB download).
 *
 * Every bf16/f32 tensor of 2+ dims (embedding, attention, dense MLP, router, experts, shared expert, lm_head)
 * gets uniform values of std 1/sqrt(fan_in) from a counter hash of (seed, FNV-1a of its name, element index),
 * rounded to bf16. laguna.cu computes the same numbers on the device (no copy of the file's zeros), so the
 * CPU and the GPU run identical weights. A q8 / q4 tensor gets those values quantized per group as export.py
 * would (random_qgroup in laguna.h). Norms, biases, the correction bias and the rope tables keep the file's
 * values. The private mapping is made writable: the written pages become this process's memory. */

static void randomize_weights(Model *m, uint64_t seed) {
    if (mprotect(m->map, m->file_size, PROT_READ | PROT_WRITE) != 0) die("--random-weights: mprotect: %s", strerror(errno));
    for (uint64_t t = 0; t < m->n_tensors; t++) {
        const TensorEntry *e = &m->dir[t];
        if ((e->dtype != DT_BF16 && e->dtype != DT_F32 && e->dtype != DT_Q8 && e->dtype != DT_Q4) || e->ndim < 2)
            continue;
        uint64_t key = name_key(e->name);
        int64_t n = 1;
        for (uint32_t d = 0; d < e->ndim; d++) n *= e->shape[d];
        int64_t cols = e->shape[e->ndim - 1];
        float a = sqrtf(3.0f / (float)cols);
        char *data = (char *)m->map + e->offset;
        if (e->dtype == DT_Q8 || e->dtype == DT_Q4) {   /* planar: every row's values, then every row's scales */
            int64_t groups = (cols + LAGUNA_QGROUP - 1) / LAGUNA_QGROUP, ng = n / cols * groups;
            int gb = e->dtype == DT_Q8 ? LAGUNA_QGROUP : LAGUNA_QGROUP / 2;
            uint16_t *scales = (uint16_t *)(data + ng * gb);
#pragma omp parallel for schedule(static)
            for (int64_t i = 0; i < ng; i++)
                random_qgroup((int)e->dtype, seed, key, (uint64_t)(i / groups), cols, i % groups, a,
                              (uint8_t *)data + i * gb, scales + i);
            continue;
        }
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; i++) {
            float v = random_weight(seed, key, (uint64_t)i, a);
            if (e->dtype == DT_BF16) {
                uint32_t u;
                memcpy(&u, &v, 4);
                ((uint16_t *)data)[i] = (uint16_t)(u >> 16);
            } else {
                ((float *)data)[i] = v;
            }
        }
    }
}

/* ----------------------------------------------------------------------------
 * main */

static void usage(FILE *f) {
    fprintf(f,
        "usage: laguna MODEL.bin [options] \"prompt\"\n"
        "\n"
        "  -n N          tokens to generate (default 256)\n"
        "  -t T          temperature; 0 = greedy (default 0.6)\n"
        "  -p P          top-p for sampling (default 0.95)\n"
        "  -s SEED       random seed (default: time)\n"
        "  -c N          context length (default: the model's maximum, lowered to fit memory)\n"
        "  -i FILE       read the prompt from a file\n"
        "  -y TEXT       system prompt (default: the template's)\n"
        "  -m MODE       generate (default) or chat (interactive, multi-turn, on stdin)\n"
        "  --think       reasoning on (the template's <think>); off by default\n"
        "  --raw         send the prompt as-is (BOS + text), not through the chat template\n"
        "  --ids         the prompt is whitespace-separated token ids; print generated ids\n"
        "  --cpu         use the CPU even when a GPU is available\n"
        "  --chunk N     most tokens per forward pass (prefill chunk; default 64 on the CPU, 2048 on the GPU)\n"
        "  --kv TYPE     KV cache: bf16 (the GPU's default for bf16 models), f32 (GPU: 2x the memory, exact\n"
        "                attention inputs) or fp8 (e4m3, half of bf16); the CPU keeps fp32 unless asked for\n"
        "                fp8, or bf16 on a bf16 model: then it rounds K and V to it, as the GPU stores them\n"
        "  --tokenize TEXT        print the token ids of TEXT (no BOS) and exit\n"
        "  --score IDS_FILE       teacher-forced pass over the ids: mean NLL and perplexity of tokens 2..n\n"
        "  --logits OUT           with --score: write float32 logits [n][vocab] to OUT; while generating:\n"
        "                         the logits row each generated token was sampled from\n"
        "  -d DRAFT.bin  speculative decoding with a DFlash drafter (export.py converts it too)\n"
        "  --draft-max N draft at most N tokens per step (default and most: the drafter's block - 1, 15 for\n"
        "                Laguna-XS-2.1-DFlash)\n"
        "  --compare     with -d: run again without the drafter and print the speedup\n"
        "  -q            quiet: no load or speed lines\n"
        "\n"
        "test hooks:\n"
        "  --samples N            run N times with seeds derived from -s; one line of token ids each\n"
        "  --taps OUT             with --score and -d: write the target's tap states float32 [n][taps][hidden]\n"
        "  --draft-logits OUT     with --ids and -d: prefill all but the last id, draft a block with the last\n"
        "                         id as the bonus token, write float32 logits [block-1][vocab]\n"
        "  --random-weights SEED  replace every matmul weight by seeded hash-random values (benchmarks on\n"
        "                         export.py --synthetic files; identical on the CPU and the GPU)\n"
        "  -h, --help    this help\n");
}

/* Numbers on the command line: the whole argument must parse, else a clear error. */
static long arg_int(const char *flag, const char *v) {
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (end == v || *end || errno || x < -2147483647L || x > 2147483647L)
        die("%s expects an integer, got '%s' (see --help)", flag, v);
    return x;
}

static float arg_float(const char *flag, const char *v) {
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (end == v || *end || errno || !isfinite(x)) die("%s expects a number, got '%s' (see --help)", flag, v);
    return (float)x;
}

static unsigned long long arg_u64(const char *flag, const char *v) {
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (end == v || *end || errno || v[0] == '-') die("%s expects a non-negative integer, got '%s'", flag, v);
    return x;
}

static void parse_args(int argc, char **argv, Options *o) {
    memset(o, 0, sizeof *o);
    o->steps = 256;
    o->temperature = 0.6f;
    o->topp = 0.95f;
    o->mode = "generate";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int has_next = i + 1 < argc;
#define NEXT() (has_next ? argv[++i] : (die("%s needs a value (see --help)", a), (char *)NULL))
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(stdout); exit(0); }
        else if (!strcmp(a, "-n")) o->steps = (int)arg_int(a, NEXT());
        else if (!strcmp(a, "-t")) o->temperature = arg_float(a, NEXT());
        else if (!strcmp(a, "-p")) o->topp = arg_float(a, NEXT());
        else if (!strcmp(a, "-s")) { o->seed = arg_u64(a, NEXT()); o->seed_set = 1; }
        else if (!strcmp(a, "-c")) { o->ctx = (int)arg_int(a, NEXT()); if (o->ctx <= 0) die("-c must be > 0"); }
        else if (!strcmp(a, "-i")) o->prompt_file = NEXT();
        else if (!strcmp(a, "-y")) o->system = NEXT();
        else if (!strcmp(a, "-m")) o->mode = NEXT();
        else if (!strcmp(a, "--think")) o->think = 1;
        else if (!strcmp(a, "--raw")) o->raw = 1;
        else if (!strcmp(a, "--ids")) o->ids_mode = 1;
        else if (!strcmp(a, "--cpu")) o->cpu = 1;
        else if (!strcmp(a, "--kv")) {
            const char *v = NEXT();
            if (!strcmp(v, "f32")) o->kv = KV_F32;
            else if (!strcmp(v, "bf16")) o->kv = KV_BF16;
            else if (!strcmp(v, "fp8")) o->kv = KV_FP8;
            else die("--kv takes bf16, f32 or fp8 (got '%s')", v);
        }
        else if (!strcmp(a, "--chunk")) { o->chunk = (int)arg_int(a, NEXT()); if (o->chunk <= 0) die("--chunk must be > 0"); }
        else if (!strcmp(a, "--tokenize")) o->tokenize_text = NEXT();
        else if (!strcmp(a, "--score")) o->score_file = NEXT();
        else if (!strcmp(a, "--logits")) o->logits_out = NEXT();
        else if (!strcmp(a, "-q")) o->quiet = 1;
        else if (!strcmp(a, "-d")) o->draft_path = NEXT();
        else if (!strcmp(a, "--draft-max")) {
            o->draft_max = (int)arg_int(a, NEXT());
            if (o->draft_max < 1) die("--draft-max must be at least 1 (it drafts at most the drafter's block - 1)");
        }
        else if (!strcmp(a, "--compare")) o->compare = 1;
        else if (!strcmp(a, "--samples")) o->samples = (int)arg_int(a, NEXT());
        else if (!strcmp(a, "--taps")) o->taps_out = NEXT();
        else if (!strcmp(a, "--draft-logits")) o->draft_logits_out = NEXT();
        else if (!strcmp(a, "--random-weights")) { o->random_seed = arg_u64(a, NEXT()); o->random_weights = 1; }
        else if (a[0] == '-' && a[1]) die("unknown option %s (see --help)", a);
        else if (!o->model_path) o->model_path = a;
        else if (!o->prompt) o->prompt = a;
        else die("unexpected argument '%s' (quote the prompt)", a);
#undef NEXT
    }
    if (!o->model_path) { usage(stderr); exit(1); }
    if (o->steps < 0) die("-n must be >= 0");
    if (o->temperature < 0) die("-t must be >= 0");
    if (o->topp < 0 || o->topp > 1) die("-p must be in [0, 1]");
    if (strcmp(o->mode, "generate") && strcmp(o->mode, "chat")) die("-m must be generate or chat");
    if ((o->compare || o->draft_max) && !o->draft_path) die("--compare and --draft-max go with -d DRAFTER");
    if (o->samples < 0) die("--samples must be >= 0");
}

/* Choose the context: the model's maximum by default, lowered when the KV cache would not fit. */
static int choose_ctx(const Config *c, const Options *o, int max_tokens) {
    if (o->ctx > c->max_seq_len)
        die("-c %d exceeds the model's maximum context (%d tokens)", o->ctx, c->max_seq_len);
    if (o->ctx) return o->ctx;
    int ctx = c->max_seq_len;
    uint64_t mem = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE);
    uint64_t budget = mem / 2;
    while (ctx > 1024 && kv_cache_bytes(c, ctx, max_tokens) > budget) ctx /= 2;
    if (ctx != c->max_seq_len && !o->quiet)
        fprintf(stderr, "note: context lowered from %d to %d tokens so the KV cache fits in memory (-c to choose)\n",
                c->max_seq_len, ctx);
    return ctx;
}

static int *encode_or_die(Tokenizer *tok, const char *text, int *n) {
    int *ids = NULL;
    char err[512];
    if (tokenizer_encode(tok, text, strlen(text), &ids, n, err, sizeof err) != 0) die("%s", err);
    return ids;
}

static int chat_loop(Engine *e, Sampler *sp, Printer *pr, const Options *o);

/* The prompt as token ids: --ids, --raw (BOS + text), or the chat template (default). malloc'd. */
static int *build_prompt(const Options *o, const Config *c, Tokenizer *tok, const char *prompt, int *n) {
    char err[1024];
    *n = 0;
    if (o->ids_mode) return parse_ids(prompt, c->vocab_size, n, "prompt");
    if (!tok) die("%s has no tokenizer: give the prompt as token ids with --ids", o->model_path);
    if (o->raw) {
        int m = 0, *body = encode_or_die(tok, prompt, &m);
        int *ids = xcalloc(m + 1, sizeof(int));
        if (c->bos_id >= 0) ids[(*n)++] = c->bos_id;
        memcpy(ids + *n, body, m * sizeof(int));
        *n += m;
        free(body);
        return ids;
    }
    ChatMessage msgs[2];
    int nm = 0;
    if (o->system) msgs[nm++] = (ChatMessage){"system", o->system, NULL};
    msgs[nm++] = (ChatMessage){"user", prompt, NULL};
    char *text = tokenizer_render_chat(tok, msgs, nm, 1, o->think, err, sizeof err);
    if (!text) die("%s", err);
    int *ids = encode_or_die(tok, text, n);
    free(text);
    return ids;
}

/* Prefill and generate once (with the drafter when df is set); out_ids gets what was sampled. */
static int run_once(Engine *e, DFlash *df, Sampler *sp, Printer *pr, const Options *o, const int *ids, int n,
                    int *out_ids, double *prefill_s, double *decode_s) {
    int ctx = e->m->state.ctx;
    int steps = o->steps < ctx - n ? o->steps : ctx - n;
    double t0 = now_s();
    float *logits = df ? prefill_dflash(e, df, ids, n) : prefill(e, ids, n, 0);
    *prefill_s = now_s() - t0;
    if (steps <= 0) { *decode_s = 0; return 0; }
    if (df) return generate_dflash(e, df, sp, pr, logits, n, steps, o->ids_mode, out_ids, decode_s);
    return generate(e, sp, pr, logits, n, steps, o->ids_mode, -1, out_ids, decode_s);
}

static void finish_output(Printer *pr) {
    if (pr->tok) { size_t len; const char *rest = tokenizer_decode_flush(&pr->dec, &len); fwrite(rest, 1, len, stdout); }
    if (pr->dim) { fputs("\033[0m", stdout); pr->dim = 0; }
    printf("\n");
    fflush(stdout);
}

/* --draft-logits: the drafter's logits for a block whose bonus token is the last prompt id (a test hook). */
static void dump_draft_logits(Engine *e, DFlash *df, const int *ids, int n, const char *path) {
    if (n < 2) die("--draft-logits needs at least 2 prompt ids");
    if (n - 1 + df->block > e->m->state.ctx)
        die("--draft-logits: %d prompt ids and a block of %d pass the context (%d)\n  hint: raise -c", n, df->block,
            e->m->state.ctx);
    prefill_dflash(e, df, ids, n - 1);
    float *dl = draft_block(df, ids[n - 1], n - 1, df->block);
    FILE *f = fopen(path, "wb");
    if (!f) die("cannot write %s: %s", path, strerror(errno));
    size_t cnt = (size_t)(df->block - 1) * e->m->config.vocab_size;
    if (fwrite(dl + e->m->config.vocab_size, sizeof(float), cnt, f) != cnt) die("write to %s failed", path);
    fclose(f);
}

#ifndef TESTING
/* Do the GPU kernels take this model (gpu_supports: head_dim, sizes, weight formats)? If not, say why: it runs on
 * the CPU (printed even with -q: a user with a GPU should know). */
static int gpu_takes(const Model *m, const char *who) {
    char why[512];
    if (gpu_supports(m, why, sizeof why)) return 1;
    fprintf(stderr, "note: %s%s: running on the CPU\n", who, why);
    return 0;
}

int main(int argc, char **argv) {
    Options o;
    parse_args(argc, argv, &o);
    static Model model, draft;
    char err[1024];
    if (load_model(&model, o.model_path, KIND_MODEL, err, sizeof err)) die("%s", err);
    Config *c = &model.config;

    Tokenizer tok;
    Tokenizer *tk = NULL;
    const TensorEntry *te = find_tensor(&model, "tokenizer");
    if (te) {
        if (tokenizer_init(&tok, (const unsigned char *)model.map + te->offset, (uint64_t)te->shape[0], err,
                           sizeof err) != 0)
            die("%s", err);
        if (tokenizer_vocab_size(&tok) > c->vocab_size)
            die("the tokenizer has %d ids but the model only %d\n  hint: re-run export.py", tokenizer_vocab_size(&tok),
                c->vocab_size);
        tk = &tok;
    }
    if (o.tokenize_text) {
        if (!tk) die("%s has no tokenizer\n  hint: export it from a directory with tokenizer.json", o.model_path);
        int n;
        int *ids = encode_or_die(tk, o.tokenize_text, &n);
        for (int i = 0; i < n; i++) printf(i ? " %d" : "%d", ids[i]);
        printf("\n");
        free(ids);
        tokenizer_free(tk);
        free_model(&model);
        return 0;
    }

    if (o.draft_path && load_model(&draft, o.draft_path, KIND_DRAFTER, err, sizeof err)) die("%s", err);
    char info[256] = "";
    /* the backend first: it sets the default chunk. The GPU when there is one and it takes the model and the
     * drafter; else the CPU (gpu_takes notes why). */
    int use_gpu = !o.cpu && gpu_available(info, sizeof info) && gpu_takes(&model, "")
                  && (!o.draft_path || gpu_takes(&draft, "the drafter: "));
    int max_tokens = o.chunk ? o.chunk : use_gpu ? 2048 : 64;   /* GPU: big prefill chunks */
    if (o.draft_path && max_tokens < 64) {                   /* a verify block must fit in one forward */
        if (!o.quiet) fprintf(stderr, "note: --chunk %d raised to 64 with a drafter (a verify block is one forward)\n",
                              max_tokens);
        max_tokens = 64;
    }
    int ctx = choose_ctx(c, &o, max_tokens);
    if (max_tokens > ctx) max_tokens = ctx;
    Engine eng = {&model, NULL};
    model.random_weights = o.random_weights;
    model.random_seed = o.random_seed;
    model.kv = o.kv;   /* the target's cache only: the drafter keeps its ring in its weights' dtype */
    if (use_gpu) {
        eng.gpu = gpu_init(&model, ctx, max_tokens, err, sizeof err);   /* fills random weights itself */
        if (!eng.gpu) die("%s", err);
        if (!o.quiet) fprintf(stderr, "gpu: %s | %s\n", info, gpu_summary(eng.gpu));
    }
    if (o.random_weights && !eng.gpu) randomize_weights(&model, o.random_seed);
    alloc_state(&model, ctx, max_tokens);   /* the CPU state also sizes the chunking for the GPU */
    DFlash dfs, *df = NULL;
    if (o.draft_path) {
        dflash_init(&dfs, &draft, &model, eng.gpu, o.draft_max, ctx);
        df = &dfs;
        if (df->gpu && !o.quiet) fprintf(stderr, "gpu drafter: %s\n", gpu_summary(df->gpu));
    }
    if (!o.quiet)
        fprintf(stderr, "laguna: %s | %d layers, vocab %d, context %d | %s%s\n", o.model_path, c->n_layers,
                c->vocab_size, ctx, eng.gpu ? info : "CPU", df ? " | DFlash drafter" : "");

    int rc = 0;
    if (o.score_file) {
        rc = run_score(&eng, df, &o);
    } else {
        Sampler sp = {o.temperature, o.topp, o.seed_set ? o.seed : (unsigned long long)time(NULL), c->vocab_size,
                      xcalloc(c->vocab_size, sizeof(float)), xcalloc(c->vocab_size, sizeof(int))};
        if (sp.rng == 0) sp.rng = 0x9E3779B97F4A7C15ull;
        Printer pr = {0};
        pr.tok = tk;
        pr.vocab = c->vocab_size;
        if (o.logits_out && !(pr.trace = fopen(o.logits_out, "wb"))) die("cannot write %s: %s", o.logits_out, strerror(errno));
        if (tk) {
            tokenizer_decoder_init(&pr.dec, tk);
            pr.think_end = tokenizer_token_id(tk, "</think>");
        }
        if (!strcmp(o.mode, "chat")) {
            if (!tk) die("chat needs a tokenizer in the model file");
            if (!tk->has_chat)
                die("-m chat needs the model's chat template, and %s has none\n  hint: send one prompt as it is "
                    "with --raw (generate mode)", o.model_path);
            if (df) die("-m chat does not use a drafter yet\n  hint: drop -d for chat");
            rc = chat_loop(&eng, &sp, &pr, &o);
        } else {
            size_t prompt_len = 0;
            char *prompt_buf = o.prompt_file ? read_file(o.prompt_file, &prompt_len) : NULL;
            const char *nul = prompt_buf ? memchr(prompt_buf, 0, prompt_len) : NULL;
            if (nul) die("%s has a NUL byte at offset %zu\n  hint: the prompt file must be text (UTF-8)", o.prompt_file,
                         (size_t)(nul - prompt_buf));
            int n = 0, *ids = build_prompt(&o, c, tk, prompt_buf ? prompt_buf : o.prompt ? o.prompt : "", &n);
            if (n == 0) die("empty prompt\n  hint: give a prompt, or use --raw with a BOS-only start");
            check_fits(n, ctx);
            int *out = xcalloc((size_t)(o.steps < ctx ? o.steps : ctx) + 1, sizeof(int));
            double prefill_s = 0, decode_s = 0;
            if (o.draft_logits_out) {
                if (!df) die("--draft-logits needs -d DRAFTER");
                dump_draft_logits(&eng, df, ids, n, o.draft_logits_out);
            } else if (o.samples > 0) {          /* many seeded runs, one line of ids each (statistics) */
                for (int r = 0; r < o.samples; r++) {
                    sp.rng = (o.seed_set ? o.seed : 1) + (unsigned long long)r * 0x9E3779B97F4A7C15ull;
                    if (!sp.rng) sp.rng = 1;
                    run_once(&eng, df, &sp, &pr, &o, ids, n, out, &prefill_s, &decode_s);
                    finish_output(&pr);
                }
            } else {
                if (o.think && !o.raw && !o.ids_mode && isatty(1)) { fputs("\033[2m", stdout); pr.dim = 1; }
                int n_gen = run_once(&eng, df, &sp, &pr, &o, ids, n, out, &prefill_s, &decode_s);
                finish_output(&pr);
                if (!o.quiet) report(n, prefill_s, n_gen, decode_s);
                if (df && !o.quiet) dflash_report(df, n_gen > 1 ? (n_gen - 1) / decode_s : 0.0);
                if (df && o.compare) {           /* the same prompt without the drafter */
                    int *plain = xcalloc((size_t)(o.steps < ctx ? o.steps : ctx) + 1, sizeof(int));
                    Printer quiet_pr = {0};
                    quiet_pr.silent = 1;
                    float *saved_taps = model.state.taps;
                    model.state.taps = NULL;     /* no taps needed */
                    double p2, d2;
                    sp.rng = o.seed_set ? o.seed : 1;
                    int n2 = run_once(&eng, NULL, &sp, &quiet_pr, &o, ids, n, plain, &p2, &d2);
                    double with = n_gen > 1 ? (n_gen - 1) / decode_s : 0, without = n2 > 1 ? (n2 - 1) / d2 : 0;
                    int same = n2 == n_gen && !memcmp(plain, out, n2 * sizeof(int));
                    fprintf(stderr, "compare: without the drafter %.2f tok/s, with %.2f tok/s: speedup %.2fx; "
                            "outputs %s\n", without, with, without > 0 ? with / without : 0.0,
                            same ? "identical" : o.temperature == 0 ? "DIFFER" : "differ (sampling)");
                    free(plain);
                    model.state.taps = saved_taps;
                }
            }
            free(out);
            free(ids);
            free(prompt_buf);
        }
        if (pr.tok) tokenizer_decoder_free(&pr.dec);
        if (pr.trace) fclose(pr.trace);
        free(sp.probs);
        free(sp.idx);
    }
    if (df) dflash_free(df);
    if (eng.gpu) gpu_free(eng.gpu);
    if (tk) tokenizer_free(tk);
    free_model(&model);
    return rc;
}
#endif

/* -m chat: a multi-turn conversation on stdin; the KV cache is kept between turns, so each turn only
 * prefills what the template adds. Each reply stops at </assistant> or EOS. */
static int chat_loop(Engine *e, Sampler *sp, Printer *pr, const Options *o) {
    Config *c = &e->m->config;
    Tokenizer *tok = pr->tok;
    int ctx = e->m->state.ctx;
    int *cache = xcalloc(ctx, sizeof(int));   /* the tokens in the KV cache */
    int n_cache = 0;
    int cap = 16, nm = 0;
    ChatMessage *msgs = xcalloc(cap, sizeof(ChatMessage));
    if (o->system) msgs[nm++] = (ChatMessage){"system", strdup(o->system), NULL};
    char *line = NULL;                        /* one user turn: a whole line of stdin, however long */
    size_t line_cap = 0;
    int end_id = tokenizer_token_id(tok, "</assistant>");
    int *reply = xcalloc((size_t)(o->steps < ctx ? o->steps : ctx) + 1, sizeof(int));
    for (;;) {
        fprintf(stderr, "\n> ");
        ssize_t got = getline(&line, &line_cap, stdin);
        if (got < 0) break;
        size_t L = (size_t)got;
        if (memchr(line, 0, L)) { fprintf(stderr, "(skipped: the line has a NUL byte, which text cannot hold)\n"); continue; }
        while (L && (line[L - 1] == '\n' || line[L - 1] == '\r')) line[--L] = 0;
        if (!L) continue;
        if (nm + 2 >= cap) { cap *= 2; msgs = realloc(msgs, cap * sizeof(ChatMessage)); if (!msgs) die("out of memory"); }
        msgs[nm++] = (ChatMessage){"user", strdup(line), NULL};
        char err[512];
        char *text = tokenizer_render_chat(tok, msgs, nm, 1, o->think, err, sizeof err);
        if (!text) die("%s", err);
        int n, *ids = encode_or_die(tok, text, &n);
        free(text);
        /* reuse the cached prefix: the conversation so far renders to the same tokens */
        int same = 0;
        while (same < n && same < n_cache && ids[same] == cache[same]) same++;
        /* a sliding-window ring (W + max_tokens - 1 rows) only survives a short rollback: otherwise prefill from the
         * start. The rows written since `same` reach position n_cache at most (the GPU computes and throws away the
         * step after a stop token, which writes row n_cache; generate()), so a row the prefill still needs (from
         * same - W + 1 on) can have been overwritten only when n_cache - same >= max_tokens. */
        if (n_cache - same >= e->m->state.max_tokens) same = 0;
        if (same == n) same = n - 1;          /* always run at least the last token for its logits */
        if (o->think && isatty(1)) { fputs("\033[2m", stdout); pr->dim = 1; }
        if (n >= ctx) { fprintf(stderr, "(the conversation is longer than the context, %d tokens)\n", ctx); free(ids); break; }
        float *logits = prefill(e, ids + same, n - same, same);
        memcpy(cache, ids, n * sizeof(int));
        n_cache = n;
        double dt;
        int steps = o->steps < ctx - n ? o->steps : ctx - n;
        int g = generate(e, sp, pr, logits, n, steps, o->ids_mode, end_id, reply, &dt);
        size_t len;
        const char *rest = tokenizer_decode_flush(&pr->dec, &len);
        fwrite(rest, 1, len, stdout);
        printf("\n");
        fflush(stdout);
        /* the reply (without its stop token) becomes an assistant turn of the history */
        int body = g;
        if (g > 0 && (is_eos(c, reply[g - 1]) || reply[g - 1] == end_id)) body--;
        if (pr->dim) { fputs("\033[0m", stdout); pr->dim = 0; }
        char *reply_text = tokenizer_decode(tok, reply, body, NULL);
        /* with reasoning on, the reply is "reasoning</think>content": the template wants them apart */
        char *reasoning = NULL, *split = o->think ? strstr(reply_text, "</think>") : NULL;
        if (split) {
            *split = 0;
            reasoning = reply_text;
            reply_text = strdup(split + strlen("</think>"));
        }
        msgs[nm++] = (ChatMessage){"assistant", reply_text, reasoning};
        memcpy(cache + n, reply, body * sizeof(int));
        n_cache = n + body;
        free(ids);
    }
    for (int i = 0; i < nm; i++) { free((char *)msgs[i].content); free((char *)msgs[i].reasoning); }
    free(msgs);
    free(reply);
    free(line);
    free(cache);
    return 0;
}

/* ----------------------------------------------------------------------------
 * a CPU-only build: no GPU backend */
#ifndef LAGUNA_CUDA
int gpu_available(char *info, size_t infosz) { if (infosz) info[0] = 0; return 0; }
int gpu_supports(const Model *m, char *why, size_t whysz) {
    (void)m;
    snprintf(why, whysz, "this laguna was built without CUDA");
    return 0;
}
GpuModel *gpu_init(const Model *m, int ctx, int max_tokens, char *err, size_t errsz) {
    (void)m; (void)ctx; (void)max_tokens;
    snprintf(err, errsz, "this laguna was built without CUDA\n  hint: build with `make cuda`");
    return NULL;
}
float *gpu_forward(GpuModel *g, const int *tokens, int n, int pos, int all_logits) {
    (void)g; (void)tokens; (void)n; (void)pos; (void)all_logits;
    return NULL;
}
int gpu_decode_step(GpuModel *g, int token, int pos, float temperature, float topp, float coin) {
    (void)g; (void)token; (void)pos; (void)temperature; (void)topp; (void)coin;
    return -1;
}
void gpu_decode_launch(GpuModel *g, int token, int pos, float temperature, float topp, float coin) {
    (void)g; (void)token; (void)pos; (void)temperature; (void)topp; (void)coin;
}
int gpu_decode_wait(GpuModel *g) { (void)g; return -1; }
const char *gpu_summary(GpuModel *g) { (void)g; return ""; }
GpuModel *gpu_drafter_init(GpuModel *target, const Model *drafter, int ctx, int block, char *err, size_t errsz) {
    (void)target; (void)drafter; (void)ctx; (void)block;
    snprintf(err, errsz, "this laguna was built without CUDA");
    return NULL;
}
void gpu_drafter_add_context(GpuModel *drafter, GpuModel *target, int row0, int n, int pos) {
    (void)drafter; (void)target; (void)row0; (void)n; (void)pos;
}
void gpu_forward_argmax(GpuModel *g, const int *tokens, int n, int pos, int *out) {
    (void)g; (void)tokens; (void)n; (void)pos; (void)out;
}
void gpu_copy_taps(GpuModel *g, int n, float *dst) { (void)g; (void)n; (void)dst; }
void gpu_free(GpuModel *g) { (void)g; }
#endif
