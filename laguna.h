/* laguna.h -- the structs shared by laguna.c (CPU reference) and laguna.cu (GPU backend).
 *
 * The model file (written by export.py, read by load_model in laguna.c), little-endian:
 *   [0, 256)      FileHeader
 *   config        text, one "key=value" per line (per-layer lists space-separated)
 *   directory     n_tensors TensorEntry records of 128 bytes
 *   tensors       raw data, each at a 256-byte aligned absolute offset
 */
#ifndef LAGUNA_H
#define LAGUNA_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#define LAGUNA_MAGIC 0x414E474Cu /* "LGNA" */
#define LAGUNA_VERSION 1
#define LAGUNA_ALIGN 256
#define LAGUNA_MAX_LAYERS 1024
#define LAGUNA_MAX_EOS 16
#define LAGUNA_MAX_TAPS 16

enum { DT_F32 = 0, DT_BF16 = 1, DT_U8 = 2, DT_Q8 = 3, DT_Q4 = 4 };
/* q8 / q4: symmetric, one fp16 scale per group of LAGUNA_QGROUP consecutive weights of a row. A quantized
 * tensor's data is two planes: every row's values (padded to whole groups; int8, or 4-bit pairs with the
 * low nibble first, value = nibble - 8), then every row's scales. w = value * scale. */
#define LAGUNA_QGROUP 32
enum { KIND_MODEL = 0, KIND_DRAFTER = 1 };
enum { ATTN_FULL = 0, ATTN_SLIDING = 1 };  /* also the index of the rope tables */
enum { MLP_DENSE = 0, MLP_SPARSE = 1 };

typedef struct {
    uint32_t magic;          /* LAGUNA_MAGIC */
    uint32_t version;        /* LAGUNA_VERSION */
    uint32_t kind;           /* KIND_MODEL or KIND_DRAFTER */
    uint32_t alignment;      /* LAGUNA_ALIGN */
    uint64_t file_size;      /* total bytes: a shorter file is truncated */
    uint64_t config_offset;  /* the key=value text block */
    uint64_t config_size;
    uint64_t dir_offset;     /* the tensor directory */
    uint64_t n_tensors;
    uint8_t reserved[256 - 56];
} FileHeader;

typedef struct {
    char name[80];           /* NUL-terminated, e.g. "model.layers.3.self_attn.q_proj.weight" */
    uint32_t dtype;          /* DT_* */
    uint32_t ndim;           /* 1..4 */
    int64_t shape[4];        /* row-major, shape[0] outermost */
    uint64_t offset;         /* absolute byte offset of the data */
} TensorEntry;

/* A tensor inside the mapped file: weights are read in place (bf16 or f32), never copied. */
typedef struct {
    const void *data;        /* f32 / bf16 values, or the q8 / q4 value plane */
    int dtype;
    int ndim;
    int64_t shape[4];
    const uint16_t *scales;  /* q8 / q4: fp16 scales [rows][groups] */
    int groups;              /* q8 / q4: groups per row = ceil(shape[ndim-1] / LAGUNA_QGROUP) */
} Tensor;

typedef struct {
    int vocab_size;          /* rows of the embedding and lm_head */
    int dim;                 /* hidden size H (2048) */
    int n_layers;            /* 40 */
    int n_kv_heads;          /* 8 */
    int head_dim;            /* D (128) */
    int n_heads[LAGUNA_MAX_LAYERS];    /* query heads per layer (48 full / 64 sliding on XS) */
    int layer_type[LAGUNA_MAX_LAYERS]; /* ATTN_FULL / ATTN_SLIDING */
    int mlp_type[LAGUNA_MAX_LAYERS];   /* MLP_DENSE / MLP_SPARSE */
    int sliding_window;      /* W: keys p-W+1..p (512) */
    int hidden_dim;          /* dense SwiGLU intermediate (8192) */
    int moe_hidden_dim;      /* per routed expert (512) */
    int shared_hidden_dim;   /* shared expert (512) */
    int n_experts;           /* 256 */
    int n_experts_active;    /* top-k (8) */
    float routed_scaling;    /* x2.5 on the routed sum */
    float router_softcap;    /* tanh cap on router logits, 0 = off */
    float norm_eps;          /* RMSNorm epsilon */
    int max_seq_len;         /* max_position_embeddings */
    int gate_per_head;       /* 1: g_proj [nh, H]; 0: per element [nh*D, H] */
    int gated;               /* 0: no output gate (a drafter with gating disabled) */
    int attention_bias;      /* q/k/v/o biases present */
    int tied_embeddings;     /* lm_head is the embedding */
    int bos_id, pad_id, mask_id;
    int eos_ids[LAGUNA_MAX_EOS];
    int n_eos;
    int rotary_dim[2];       /* per attention type: dims rotated (64 full / 128 sliding) */
    float rope_scaling[2];   /* per attention type: cos/sin multiplier (YaRN attention factor) */
    /* DFlash drafter files only (KIND_DRAFTER) */
    int block_size;          /* tokens per draft block: the bonus token + block_size-1 drafts (16) */
    int n_taps;              /* target layers whose outputs feed the drafter (5) */
    int tap_layers[LAGUNA_MAX_TAPS]; /* e.g. 1 13 25 33 39: the residual stream after these target layers */
    int causal;              /* attention inside the draft block is causal (Laguna: yes) */
    int n_target_layers;     /* the target the drafter was trained on (0 = not recorded) */
    /* derived */
    int max_heads;           /* max over layers of n_heads */
    int kv_dim;              /* n_kv_heads * head_dim */
} Config;

typedef struct {
    Tensor attn_norm;        /* [H] f32 input_layernorm */
    Tensor wq, wk, wv;       /* [nh*D, H], [KV*D, H], [KV*D, H] */
    Tensor bq, bk, bv, bo;   /* optional biases (attention_bias) */
    Tensor q_norm, k_norm;   /* [D] f32, shared by all heads */
    Tensor wg;               /* [nh, H] per-head gate (or [nh*D, H]) */
    Tensor wo;               /* [H, nh*D] */
    Tensor ffn_norm;         /* [H] f32 post_attention_layernorm */
    /* dense MLP (MLP_DENSE) */
    Tensor w_gate, w_up;     /* [F, H] */
    Tensor w_down;           /* [H, F] */
    /* MoE (MLP_SPARSE) */
    Tensor router;           /* [E, H] */
    Tensor expert_bias;      /* [E] f32 e_score_correction_bias: selection only */
    Tensor experts_gate_up;  /* [E, 2*I, H]: per expert gate rows then up rows */
    Tensor experts_down;     /* [E, H, I] */
    Tensor shared_gate, shared_up; /* [S, H] */
    Tensor shared_down;      /* [H, S] */
} LayerWeights;

typedef struct {
    Tensor embed;            /* [V, H] */
    LayerWeights layers[LAGUNA_MAX_LAYERS];
    Tensor final_norm;       /* [H] f32 */
    Tensor lm_head;          /* [V, H] */
    const float *inv_freq[2];/* per attention type: [rotary_dim/2] */
    /* DFlash drafter: context fusion (embed and lm_head are the target's) */
    Tensor fc;               /* [H, n_taps*H] */
    Tensor hidden_norm;      /* [H] f32 */
    Tensor aux_norm[LAGUNA_MAX_TAPS]; /* [H] f32 per tap */
} Weights;

/* Everything one forward pass over up to max_tokens tokens needs (CPU path). */
typedef struct {
    int ctx;                 /* positions the KV cache holds */
    int max_tokens;          /* most tokens one forward() call takes (prefill chunk, verify block) */
    float *x;                /* [T, H] residual stream */
    float *xb;               /* [T, H] normed input of the current block */
    float *q;                /* [T, max_heads*D] */
    float *k, *v;            /* [T, KV*D] */
    float *att;              /* [T, max_heads*D] attention output (gated) */
    float *gate;             /* [T, max_heads*D] softplus gate */
    float *hb, *hb2;         /* [T, max(F, 2*I, S)] MLP hidden */
    float *mlp_out;          /* [T, H] */
    float *router_logits;    /* [T, E] */
    int *topk_idx;           /* [T, k] selected experts */
    float *topk_w;           /* [T, k] their weights */
    float *expert_in;        /* [T, H] tokens gathered for one expert */
    float *expert_out;       /* [T, k, H] per (token, slot) expert output */
    float *scores;           /* [n_threads, ctx] attention scores scratch */
    float *logits;           /* [T, V] */
    float *taps;             /* [T, n_taps, H] residual stream after the tap layers (NULL: not captured) */
    const int *tap_layers;   /* which layers to capture (the drafter's list) */
    int n_taps;
    float **key_cache;       /* per layer: [rows, KV*D], K after k_norm and RoPE */
    float **value_cache;     /* per layer: [rows, KV*D] */
    int *cache_rows;         /* per layer: ctx (full) or a ring of W + max_tokens - 1 (sliding) */
    int n_threads;
} RunState;

typedef struct Model {
    Config config;
    Weights weights;
    RunState state;
    /* the mapped file */
    int fd;
    void *map;
    uint64_t file_size;
    const TensorEntry *dir;
    uint64_t n_tensors;
    const char *path;
    /* --random-weights SEED: every matmul weight is replaced by a counter hash of (seed, tensor name, element),
     * identically on the CPU (laguna.c) and the GPU (laguna.cu); for benchmarks on sparse synthetic files */
    int random_weights;
    uint64_t random_seed;
    int kv;                  /* --kv: KV_AUTO (the weights' dtype on the GPU), KV_BF16, KV_F32 or KV_FP8 */
    const struct Model *target;   /* a DFlash drafter: the model it drafts for (dflash_init); NULL otherwise */
} Model;

/* The KV cache's element type (--kv). The GPU stores it; the CPU always stores fp32, and with KV_FP8 (or KV_BF16 given
 * explicitly on a file whose plain dtype is bf16) rounds each K and V element to e4m3 (bf16) as it is appended, so
 * both backends attend over the same values. KV_BF16 on an f32 file keeps the cache in f32, as KV_AUTO does. */
enum { KV_AUTO = 0, KV_BF16 = 1, KV_F32 = 2, KV_FP8 = 3 };

/* The dtype of a model's unquantized weights: the embedding's, or in a q8 / q4 file (whose embedding is q8 too) the
 * routers'; a drafter follows its target (it shares the target's embedding and lm_head, and a q8 / q4 drafter has no
 * unquantized matrix to ask). bf16 means bf16 activations for the GPU's GEMMs and, by default, a bf16 KV cache there. */
static inline int model_plain_dtype(const Model *m) {
    if (m->target) return model_plain_dtype(m->target);
    int dt = m->weights.embed.dtype;
    for (int l = 0; l < m->config.n_layers && (dt == DT_Q8 || dt == DT_Q4); l++)
        if (m->config.mlp_type[l] == MLP_SPARSE) dt = m->weights.layers[l].router.dtype;
    return dt;
}

/* laguna.c */
int load_model(Model *m, const char *path, int kind, char *err, size_t errsz);
void free_model(Model *m);
const TensorEntry *find_tensor(const Model *m, const char *name);
float bf16_to_float(uint16_t b);
uint64_t tensor_bytes(int dtype, int ndim, const int64_t *shape);

/* laguna.cu (GPU backend); a CPU-only build provides stubs that report no GPU */
typedef struct GpuModel GpuModel;
int gpu_available(char *info, size_t infosz);
/* does the GPU backend take this model (its head_dim, sizes, weight formats)? 0: why says what it lacks */
int gpu_supports(const Model *m, char *why, size_t whysz);
GpuModel *gpu_init(const Model *m, int ctx, int max_tokens, char *err, size_t errsz);
/* forward over n tokens at positions pos..pos+n-1; returns host logits [n or 1, V] */
float *gpu_forward(GpuModel *g, const int *tokens, int n, int pos, int all_logits);
/* one decode step on the device (a CUDA graph): forward `token` at `pos`, then sample the next token there
 * (temperature 0 = argmax; coin in [0,1) drives the top-p draw); only token ids cross to the host */
int gpu_decode_step(GpuModel *g, int token, int pos, float temperature, float topp, float coin);
/* the same, launched ahead (at most two in flight): gpu_decode_launch enqueues a step and returns at once, token -1
 * meaning the token the step launched before it samples (on the device); gpu_decode_wait returns the token of the
 * oldest step not yet waited for. A forward waits for the steps in flight first. */
void gpu_decode_launch(GpuModel *g, int token, int pos, float temperature, float topp, float coin);
int gpu_decode_wait(GpuModel *g);
#ifdef LAGUNA_TRACE
/* make dev/bench_gpu_trace (laguna.cu built with -DLAGUNA_TRACE): gpu_decode_step with each kernel block's start,
 * wait return and end recorded, written to path as CSV (dev/trace_summary.py) */
int gpu_decode_trace(GpuModel *g, int token, int pos, float temperature, float topp, float coin, const char *path);
#endif
/* DFlash on the GPU: laguna.c's loop calls these where the CPU calls forward() and drafter_add_context().
 * gpu_drafter_init puts the drafter (dflash_init has checked it fits) beside the target, sharing its embedding
 * and lm_head, and makes the target capture its taps for every row it runs. */
GpuModel *gpu_drafter_init(GpuModel *target, const Model *drafter, int ctx, int block, char *err, size_t errsz);
/* drafter context from rows row0..row0+n-1 of the target's last forward, at positions pos..pos+n-1 */
void gpu_drafter_add_context(GpuModel *drafter, GpuModel *target, int row0, int n, int pos);
/* a forward whose logits stay on the device: out[t] = argmax of row t (greedy verify, the drafter's block) */
void gpu_forward_argmax(GpuModel *g, const int *tokens, int n, int pos, int *out);
/* the last forward's taps [n, n_taps, H] to the host (--taps) */
void gpu_copy_taps(GpuModel *g, int n, float *dst);
/* "weights X GiB, KV cache Y GiB, ..." for the load line */
const char *gpu_summary(GpuModel *g);
void gpu_free(GpuModel *g);

/* --random-weights: the counter hash both backends use, so the CPU and the GPU fill identical weights
 * (uniform in [-a, a), a = sqrt(3 / fan_in), rounded to bf16; key = FNV-1a of the tensor name). */
#ifdef __CUDACC__
#define LAGUNA_HD __host__ __device__
#else
#define LAGUNA_HD
#endif
static inline LAGUNA_HD uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}
/* fp32 rounded to the nearest bf16 value, ties to even (NaN stays NaN, infinities stay): what a bf16 cache holds,
 * and the random weights below */
static inline LAGUNA_HD float bf16_round(float f) {
    union { float f; uint32_t u; } b;
    b.f = f;
    if ((b.u & 0x7F800000u) == 0x7F800000u) b.u = (b.u & 0x7FFFFFu) ? (b.u | 0x400000u) : b.u;   /* NaN: quiet */
    else b.u += 0x7FFFu + ((b.u >> 16) & 1u);
    b.u &= 0xFFFF0000u;
    return b.f;
}
static inline LAGUNA_HD float random_weight(uint64_t seed, uint64_t key, uint64_t i, float a) {
    uint64_t h = splitmix64(splitmix64(seed ^ key) + i);
    int s = (int)(h >> 40) - (1 << 23);                      /* 24 random bits, centred */
    return bf16_round((float)s * (a * (1.0f / 8388608.0f)));  /* one rounding to fp32, then to bf16 */
}
/* fp32 -> fp16 bits, round to nearest even; and back (exact). Host and device alike: the CPU reads the q8 / q4
 * scales with fp16_value, and the --random-weights fill below makes them with fp16_bits. */
static inline LAGUNA_HD uint16_t fp16_bits(float f) {
    union { float f; uint32_t u; } b;
    b.f = f;
    uint32_t sign = (b.u >> 16) & 0x8000u, u = b.u & 0x7FFFFFFFu, e = u >> 23;
    if (u > 0x7F800000u) return (uint16_t)(sign | 0x7E00u);                  /* nan */
    if (e >= 143) return (uint16_t)(sign | 0x7C00u);                          /* >= 2^16: inf */
    uint32_t m = (u & 0x7FFFFFu) | 0x800000u, shift, h;
    if (e >= 113) { shift = 13; h = ((e - 112) << 10) | ((m >> 13) & 0x3FFu); } /* normal */
    else if (e >= 102) { shift = 126 - e; h = m >> shift; }                    /* subnormal: units of 2^-24 */
    else return (uint16_t)sign;                                               /* below half of 2^-24 */
    uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1))) h++;                          /* a carry may reach inf: right */
    return (uint16_t)(sign | h);
}
static inline LAGUNA_HD float fp16_value(uint16_t h) {
    uint32_t e = (h >> 10) & 0x1F, m = h & 0x3FF;
    float v;
    if (e == 0) v = (float)m * (1.0f / 16777216.0f);                         /* subnormal: m * 2^-24 */
    else {
        union { uint32_t u; float f; } b;
        b.u = e == 31 ? 0x7F800000u | (m << 13) : ((e + 112) << 23) | (m << 13);
        v = b.f;
    }
    return h & 0x8000 ? -v : v;
}
/* --random-weights on a q8 / q4 tensor: group g (32 columns) of row r takes the hash values a bf16 file would get
 * (element index r * cols + c), quantized as export.py quantizes: q8 d = max|w| / 127, q = round(w / d); q4
 * d = m / -8 with m the value of largest magnitude, q = clamp(round(w / d) + 8, 0, 15); columns past cols are 0.
 * Writes the group's 32 (q8) or 16 (q4) value bytes and its fp16 scale. */
static inline LAGUNA_HD void random_qgroup(int dtype, uint64_t seed, uint64_t key, uint64_t r, int64_t cols,
                                           int64_t g, float a, uint8_t *vals, uint16_t *scale) {
    float w[32], amax = 0.0f, m = 0.0f;
    for (int i = 0; i < 32; i++) {
        int64_t c = g * 32 + i;
        w[i] = c < cols ? random_weight(seed, key, r * (uint64_t)cols + (uint64_t)c, a) : 0.0f;
        if (fabsf(w[i]) > amax) { amax = fabsf(w[i]); m = w[i]; }
    }
    uint16_t h = fp16_bits(dtype == DT_Q8 ? amax / 127.0f : m / -8.0f);
    float d = fp16_value(h), inv = d != 0.0f ? 1.0f / d : 0.0f;
    *scale = h;
    for (int i = 0; i < 32; i++) {                           /* w[i] becomes the stored code */
        float q = rintf(w[i] * inv);
        w[i] = dtype == DT_Q8 ? (q < -127.0f ? -127.0f : q > 127.0f ? 127.0f : q)
                              : (q + 8.0f < 0.0f ? 0.0f : q + 8.0f > 15.0f ? 15.0f : q + 8.0f);
    }
    if (dtype == DT_Q8)
        for (int i = 0; i < 32; i++) vals[i] = (uint8_t)(int8_t)w[i];
    else
        for (int i = 0; i < 16; i++) vals[i] = (uint8_t)((int)w[2 * i] | (int)w[2 * i + 1] << 4);
}
/* OCP FP8 E4M3 ("e4m3fn", the --kv fp8 cache): 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; no
 * infinities, 0x7F / 0xFF are NaN, the largest finite value is 448 and the subnormals are m * 2^-9 (m = 1..7).
 * fp32 -> e4m3 rounds to nearest even and saturates to +-448, infinities included; NaN stays NaN: CUDA's
 * __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3). Scale 1 (no per-tensor scale). Every e4m3 value is exactly
 * a bf16 (and an fp16) value. */
static inline LAGUNA_HD uint8_t fp8_e4m3_bits(float f) {
    union { float f; uint32_t u; } b;
    b.f = f;
    uint32_t sign = (b.u >> 24) & 0x80u, u = b.u & 0x7FFFFFFFu, e = u >> 23, m = (u & 0x7FFFFFu) | 0x800000u;
    if (u > 0x7F800000u) return (uint8_t)(sign | 0x7Fu);                     /* nan */
    if (e > 135) return (uint8_t)(sign | 0x7Eu);                              /* >= 512, inf: saturate to 448 */
    uint32_t shift, h;
    if (e >= 121) { shift = 20; h = ((e - 120) << 3) | ((m >> 20) & 7u); }   /* normal: 2^-6 .. 2^8 */
    else if (e >= 117) { shift = 141 - e; h = m >> shift; }                  /* subnormal: units of 2^-9 */
    else return (uint8_t)sign;                                               /* below half of 2^-9: zero */
    uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1))) h++;                         /* a carry may reach the exponent */
    return (uint8_t)(sign | (h > 0x7Eu ? 0x7Eu : h));                        /* past 448 (0x7F is nan): 448 */
}
static inline LAGUNA_HD float fp8_e4m3_value(uint8_t x) {
    uint32_t e = (x >> 3) & 0xFu, m = x & 7u;
    union { uint32_t u; float f; } b;
    if (e == 15 && m == 7) b.u = 0x7FC00000u;                                /* nan */
    else if (e == 0) b.f = (float)m * (1.0f / 512.0f);                       /* subnormal: m * 2^-9 */
    else b.u = ((e + 120) << 23) | (m << 20);
    if (x & 0x80) b.u ^= 0x80000000u;
    return b.f;
}
/* the nearest e4m3 value of f, as a float (what an fp8 KV cache holds) */
static inline LAGUNA_HD float fp8_e4m3_round(float f) { return fp8_e4m3_value(fp8_e4m3_bits(f)); }

static inline uint64_t name_key(const char *s) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
    return h;
}

#endif
