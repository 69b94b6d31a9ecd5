/* laguna.cu -- the GPU backend: the forward of laguna.c, step by step, on one NVIDIA GPU.
 *
 *   make cuda && ./laguna model.bin "def quicksort(arr):"
 *
 * The CPU forward in laguna.c is the reference; this file follows it with the same step names in the
 * same order (embed | attention block: rmsnorm, q/k/v/g projection, q/k norm + RoPE + KV append,
 * attention, softplus gate, o_proj | MLP block: rmsnorm, dense SwiGLU or MoE (route, experts, shared) |
 * final norm, lm_head) and is checked against it by test/test_gpu.py.
 *
 * Precision: weights and the KV cache keep the file's dtype (bf16 for real and synthetic checkpoints; the
 * tiny f32 fixtures run entirely in fp32 so their bar stays tight). Accumulation and the residual stream are
 * fp32 everywhere. cuBLAS GEMMs on bf16 weights take bf16 activations (rounded from fp32).
 *
 * Two paths through the same steps:
 *   n == 1 (decode): hand-written matvecs that read each weight once with 16-byte loads (q/k/v/g fused into one
 *     matrix, the RMSNorm folded into the matvec, the 8 routed experts + shared expert as one launch each for
 *     gate/up and for down), replayed as one CUDA graph with the position in device memory.
 *   n > 1 (prefill chunks, verification): cuBLAS GEMMs, a tensor-core flash attention, and the MoE grouped by
 *     expert (a few tokens: one launch over the active experts; many tokens: one grouped cuBLAS GEMM).
 * dev/gpu_notes.md has the measurements behind these choices. */
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "laguna.h"
}

typedef __nv_bfloat16 bf16;

/* ----------------------------------------------------------------------------
 * errors: every CUDA and cuBLAS call is checked; a failure after init is fatal */

static void fatal(const char *what, const char *msg, const char *file, int line) {
    fprintf(stderr, "laguna: error: %s failed: %s (%s:%d)\n", what, msg, file, line);
    exit(1);
}
#define CUDA_CHECK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) fatal(#x, cudaGetErrorString(e_), __FILE__, __LINE__); } while (0)
#define CUBLAS_CHECK(x) do { cublasStatus_t s_ = (x); if (s_ != CUBLAS_STATUS_SUCCESS) fatal(#x, cublasGetStatusString(s_), __FILE__, __LINE__); } while (0)
#define LAUNCH_CHECK() CUDA_CHECK(cudaGetLastError())

/* ----------------------------------------------------------------------------
 * small device helpers */

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
/* sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the result */
__device__ float block_sum(float v) {
    __shared__ float red[32];
    __syncthreads();
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float s = 0.0f;
    for (int i = 0; i < (int)(blockDim.x >> 5); i++) s += red[i];
    return s;
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* 8 consecutive weights as floats, one 16-byte load (bf16) or two (f32); weights are streamed once, so
 * they skip L1 */
__device__ __forceinline__ uint4 ld_stream(const void *p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
__device__ __forceinline__ void to_f32x8(uint4 u, float f[8]) {
    const __nv_bfloat162 *h = (const __nv_bfloat162 *)&u;
#pragma unroll
    for (int i = 0; i < 4; i++) { float2 v = __bfloat1622float2(h[i]); f[2 * i] = v.x; f[2 * i + 1] = v.y; }
}
struct W8 { uint4 a, b; };   /* 8 weights in flight: bf16 uses a, f32 uses a and b */
__device__ __forceinline__ W8 load_w8(const bf16 *p) { W8 w; w.a = ld_stream(p); return w; }
__device__ __forceinline__ W8 load_w8(const float *p) { W8 w; w.a = ld_stream(p); w.b = ld_stream(p + 4); return w; }
__device__ __forceinline__ void unpack_w8(const W8 &w, const bf16 *, float f[8]) { to_f32x8(w.a, f); }
__device__ __forceinline__ void unpack_w8(const W8 &w, const float *, float f[8]) {
    memcpy(f, &w.a, 16); memcpy(f + 4, &w.b, 16);
}
/* 8 activations (fp32, usually L1/L2 or shared-memory resident) */
__device__ __forceinline__ void load_x8(const float *p, float f[8]) {
    float4 a = ((const float4 *)p)[0], b = ((const float4 *)p)[1];
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}
__device__ __forceinline__ float dot8(const float a[8], const float b[8]) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) s += a[i] * b[i];
    return s;
}
__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f<bf16>(float x) { return __float2bfloat16(x); }

/* ----------------------------------------------------------------------------
 * --random-weights: the same counter hash as laguna.c, so both backends see identical weights */

template <typename T>
__global__ void fill_random(T *dst, size_t n, uint64_t seed, uint64_t key, uint64_t elem0, float a) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = from_f<T>(random_weight(seed, key, elem0 + i, a));
}

template <typename Tin, typename Tout>
__global__ void convert(Tout *dst, const Tin *src, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = from_f<Tout>(to_f(src[i]));
}

/* ----------------------------------------------------------------------------
 * the kernels, in model order */

/* h = embed[token] (no scaling) */
template <typename W>
__global__ void embed_kernel(float *x, const W *embed, const int *tokens, int H) {
    int t = blockIdx.x;
    const W *row = embed + (size_t)tokens[t] * H;
    for (int i = threadIdx.x; i < H; i += blockDim.x) x[(size_t)t * H + i] = to_f(row[i]);
}

/* out[t] = w * (x[t] / sqrt(mean(x[t]^2) + eps)); one block per row */
__global__ void rmsnorm_kernel(float *out, const float *x, int ldx, const float *w, int H, float eps) {
    int t = blockIdx.x;
    const float *xt = x + (size_t)t * ldx;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) ss += xt[i] * xt[i];
    ss = block_sum(ss);
    float inv = 1.0f / sqrtf(ss / H + eps);
    for (int i = threadIdx.x; i < H; i += blockDim.x) out[(size_t)t * H + i] = w[i] * (xt[i] * inv);
}

/* Decode matvec: out[r] (+)= W[r, :] . norm(x) + bias[r], for one token.
 * x is staged once per block in shared memory (RMSNorm applied there when norm_w is given, and block 0 writes
 * the normed x to xb_out for later steps); each warp owns R rows and streams them with 16-byte loads, 4 chunks
 * of every row in flight. R = 4 for tall matrices (fewer blocks re-reading x), 1 for wide ones (more warps). */
template <typename W, int R>
__global__ void __launch_bounds__(256) matvec_kernel(float *out, const W *w, int rows, int in, const float *x,
                                                     const float *norm_w, float eps, float *xb_out,
                                                     const float *bias, int accumulate) {
    extern __shared__ float xs[];
    float ss = 0.0f;
    for (int i = threadIdx.x; i < in; i += blockDim.x) { float v = x[i]; xs[i] = v; ss += v * v; }
    if (norm_w) {
        float inv = 1.0f / sqrtf(block_sum(ss) / in + eps);
        for (int i = threadIdx.x; i < in; i += blockDim.x) {
            xs[i] = norm_w[i] * (xs[i] * inv);
            if (xb_out && blockIdx.x == 0) xb_out[i] = xs[i];
        }
    }
    __syncthreads();
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int r0 = (blockIdx.x * (blockDim.x >> 5) + warp) * R;
    if (r0 >= rows) return;
    const W *wr[R];
#pragma unroll
    for (int j = 0; j < R; j++) wr[j] = w + (size_t)min(r0 + j, rows - 1) * in;
    float acc[R] = {};
    constexpr int U = 8 / R;                       /* 8 loads of 16 bytes in flight per lane */
    int k = lane * 8;
    for (; k + (U - 1) * 256 < in; k += U * 256) {
        W8 c[U][R];
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int j = 0; j < R; j++) c[u][j] = load_w8(wr[j] + k + u * 256);
#pragma unroll
        for (int u = 0; u < U; u++) {
            float xv[8], wv[8];
            load_x8(xs + k + u * 256, xv);
#pragma unroll
            for (int j = 0; j < R; j++) { unpack_w8(c[u][j], wr[j], wv); acc[j] += dot8(wv, xv); }
        }
    }
    for (; k < in; k += 256) {
        float xv[8], wv[8];
        load_x8(xs + k, xv);
#pragma unroll
        for (int j = 0; j < R; j++) { W8 c = load_w8(wr[j] + k); unpack_w8(c, wr[j], wv); acc[j] += dot8(wv, xv); }
    }
#pragma unroll
    for (int j = 0; j < R; j++) {
        float s = warp_sum(acc[j]);
        int r = r0 + j;
        if (lane == 0 && r < rows) {
            if (bias) s += bias[r];
            out[r] = accumulate ? out[r] + s : s;
        }
    }
}

__global__ void add_bias_kernel(float *y, const float *b, int n, int d) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < (size_t)n * d) y[i] += b[i % d];
}

/* Per-head q/k RMSNorm (one [D] weight shared by all heads), NeoX RoPE on the first rd dims, and the K/V
 * append at row pos % rows. One warp per head vector: nh query heads, then nkv key heads, then nkv value heads.
 * q is rewritten in place in the projection buffer; k and v go to the cache. */
template <typename KV>
__global__ void qk_norm_rope_kernel(float *qkvg, int NQ, int nh, int nkv, int D, const float *q_norm,
                                    const float *k_norm, const float *inv_freq, int rd, float scaling,
                                    KV *kc, KV *vc, int rows, const int *pos_ptr, float eps) {
    __shared__ float buf[4][256];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int t = blockIdx.x, vi = blockIdx.y * 4 + warp;
    if (vi >= nh + 2 * nkv) return;
    int p = *pos_ptr + t, KVD = nkv * D;
    float *v = qkvg + (size_t)t * NQ + (size_t)vi * D;    /* q heads, then k, then v: contiguous */
    size_t crow = (size_t)(p % rows) * KVD;
    if (vi >= nh + nkv) {                                  /* v: copied as is */
        int kh = vi - nh - nkv;
        for (int d = lane; d < D; d += 32) vc[crow + kh * D + d] = from_f<KV>(v[d]);
        return;
    }
    const float *nw = vi < nh ? q_norm : k_norm;
    float ss = 0.0f;
    for (int d = lane; d < D; d += 32) ss += v[d] * v[d];
    float inv = 1.0f / sqrtf(warp_sum(ss) / D + eps);
    float *b = buf[warp];
    for (int d = lane; d < D; d += 32) b[d] = nw[d] * (v[d] * inv);
    __syncwarp();
    int half = rd / 2;
    for (int d = lane; d < D; d += 32) {
        float o = b[d];
        if (d < rd) {
            int i = d < half ? d : d - half;
            float f = (float)p * inv_freq[i];
            float c = cosf(f) * scaling, s = sinf(f) * scaling;
            o = d < half ? b[d] * c - b[d + half] * s : b[d] * c + b[d - half] * s;
        }
        if (vi < nh) v[d] = o;
        else kc[crow + (vi - nh) * D + d] = from_f<KV>(o);
    }
}

/* ---- attention ----
 * Query rows are (token t, query head j of the kv head's group): r = t * g + j. Each block takes one kv head,
 * a tile of query rows and one split of their key range; it writes unnormalised partial outputs with their
 * running max and sum (log2 domain), and attention_combine merges the splits and applies the softplus gate.
 * Keys of a row at position p: 0..p (full) or p-W+1..p (sliding); key u lives at cache row u % rows. */

__device__ __forceinline__ void key_range(int pos, int t_first, int t_last, int window, int nsplit, int split,
                                          int *k_begin, int *k_end) {
    int kmin = window ? max(0, pos + t_first - window + 1) : 0, kmax = pos + t_last;
    int per = ((kmax - kmin + 1 + nsplit - 1) / nsplit + 63) / 64 * 64;
    *k_begin = kmin + split * per;
    *k_end = min(kmax + 1, *k_begin + per);
}

/* Tensor-core flash attention (bf16 K/V, mma.sync m16n8k16, fp32 accumulators, online softmax).
 * WARPS warps x 16 query rows; tiles of 64 keys staged in shared memory with cp.async. */
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *(uint32_t *)&v;
}
__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void *p, bool trans) {
    uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    if (trans)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void cp_async16(void *smem, const void *g, bool valid) {
    uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(a), "l"(g), "r"(valid ? 16 : 0));
}

template <int D, int WARPS>
__global__ void __launch_bounds__(WARPS * 32)
attention_flash(const float *qkvg, int NQ, int n, int g, int nh, const bf16 *kc, const bf16 *vc, int rows,
                int KVD, const int *pos_ptr, int window, int causal, int nsplit, float *part_o, float2 *part_ml,
                float scale_log2) {
    constexpr int BM = 16 * WARPS, BN = 64, LD = D + 8;   /* +8: conflict-free ldmatrix rows */
    __shared__ __align__(16) bf16 Ks[BN][LD];
    __shared__ __align__(16) bf16 Vs[BN][LD];
    const int h = blockIdx.y, split = blockIdx.z, pos = *pos_ptr, nrows = n * g;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
    const int row_first = blockIdx.x * BM, row_last = min(nrows, row_first + BM) - 1;
    int k_begin, k_end;
    key_range(pos, row_first / g, causal ? row_last / g : n - 1, window, nsplit, split, &k_begin, &k_end);

    /* this thread's two rows (gid and gid + 8 of the warp's 16) and their key windows [lo, hi]; a non-causal
     * block (a DFlash drafter) also sees the keys after it */
    int rr[2], pr[2], lo[2], hi[2];
    bool ok[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        rr[i] = row_first + warp * 16 + gid + 8 * i;
        ok[i] = rr[i] < nrows;
        pr[i] = pos + (ok[i] ? rr[i] / g : 0);
        lo[i] = window ? pr[i] - window + 1 : 0;
        hi[i] = causal ? pr[i] : pos + n - 1;
    }
    /* Q fragments in registers for the whole key loop */
    uint32_t qf[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++)
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const float *q = qkvg + (size_t)(rr[i] / g) * NQ + (size_t)(h * g + rr[i] % g) * D + kk * 16 + tig * 2;
            qf[kk][i] = ok[i] ? pack_bf16(q[0], q[1]) : 0u;
            qf[kk][2 + i] = ok[i] ? pack_bf16(q[8], q[9]) : 0u;
        }
    float o[D / 8][4] = {};
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

    for (int kt = k_begin; kt < k_end; kt += BN) {
        for (int c = threadIdx.x; c < BN * D / 8; c += WARPS * 32) {
            int key = c / (D / 8), ch = c % (D / 8), u = kt + key;
            bool valid = u < k_end;                                 /* beyond: zeros (no NaN from stale rows) */
            size_t off = valid ? (size_t)(u % rows) * KVD + (size_t)h * D + ch * 8 : 0;
            cp_async16(&Ks[key][ch * 8], kc + off, valid);
            cp_async16(&Vs[key][ch * 8], vc + off, valid);
        }
        asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;" ::: "memory");
        __syncthreads();

        float s[BN / 8][4] = {};                                    /* S = Q K^T */
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++)
#pragma unroll
            for (int np = 0; np < BN / 16; np++) {
                uint32_t b[4];
                int mi = lane >> 3, r = lane & 7;
                ldmatrix_x4(b, &Ks[np * 16 + (mi >> 1) * 8 + r][kk * 16 + (mi & 1) * 8], false);
                mma_bf16(s[2 * np], qf[kk], b[0], b[1]);
                mma_bf16(s[2 * np + 1], qf[kk], b[2], b[3]);
            }
        float mx[2] = {-INFINITY, -INFINITY};                       /* mask, scale, row max */
#pragma unroll
        for (int nt = 0; nt < BN / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int i = e >> 1, u = kt + nt * 8 + tig * 2 + (e & 1);
                bool valid = ok[i] && u < k_end && u <= hi[i] && u >= lo[i];
                s[nt][e] = valid ? s[nt][e] * scale_log2 : -INFINITY;
                mx[i] = fmaxf(mx[i], s[nt][e]);
            }
        float corr[2];
#pragma unroll
        for (int i = 0; i < 2; i++) {                               /* the 4 threads of a quad share a row */
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
            float mn = fmaxf(m[i], mx[i]);
            corr[i] = mn == -INFINITY ? 1.0f : exp2f(m[i] - mn);
            m[i] = mn;
            l[i] *= corr[i];
        }
#pragma unroll
        for (int nt = 0; nt < BN / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int i = e >> 1;
                s[nt][e] = m[i] == -INFINITY ? 0.0f : exp2f(s[nt][e] - m[i]);
                l[i] += s[nt][e];
            }
#pragma unroll
        for (int dt = 0; dt < D / 8; dt++) {
            o[dt][0] *= corr[0]; o[dt][1] *= corr[0]; o[dt][2] *= corr[1]; o[dt][3] *= corr[1];
        }
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) {                      /* O += P V */
            uint32_t a[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]), pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                             pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int dp = 0; dp < D / 16; dp++) {
                uint32_t b[4];
                int mi = lane >> 3, r = lane & 7;
                ldmatrix_x4(b, &Vs[kk * 16 + (mi & 1) * 8 + r][dp * 16 + (mi >> 1) * 8], true);
                mma_bf16(o[2 * dp], a, b[0], b[1]);
                mma_bf16(o[2 * dp + 1], a, b[2], b[3]);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
        if (!ok[i]) continue;
        size_t idx = ((size_t)(rr[i] / g) * nh + h * g + rr[i] % g) * nsplit + split;
        float *po = part_o + idx * D;
#pragma unroll
        for (int dt = 0; dt < D / 8; dt++) {
            po[dt * 8 + tig * 2] = o[dt][2 * i];
            po[dt * 8 + tig * 2 + 1] = o[dt][2 * i + 1];
        }
        if (tig == 0) part_ml[idx] = make_float2(m[i], l[i]);
    }
}

/* Plain fp32 attention (f32 caches: the tiny fixtures): one warp per (token, query head), lanes split the head
 * dims, online softmax key by key. Simple and slow; the bf16 path above is the fast one. */
template <typename KV>
__global__ void attention_scalar(const float *qkvg, int NQ, int n, int g, int nh, int D, const KV *kc,
                                 const KV *vc, int rows, int KVD, const int *pos_ptr, int window, int causal,
                                 float *part_o, float2 *part_ml, float scale_log2) {
    int t = blockIdx.x, hd = blockIdx.y, lane = threadIdx.x, kvh = hd / g;
    int p = *pos_ptr + t, lo = window ? max(0, p - window + 1) : 0, hi = causal ? p : *pos_ptr + n - 1;
    const float *q = qkvg + (size_t)t * NQ + (size_t)hd * D;
    float qv[4], o[4] = {}, m = -INFINITY, l = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; j++) qv[j] = lane + 32 * j < D ? q[lane + 32 * j] : 0.0f;
    for (int u = lo; u <= hi; u++) {
        const KV *k = kc + (size_t)(u % rows) * KVD + (size_t)kvh * D, *v = vc + (size_t)(u % rows) * KVD + (size_t)kvh * D;
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; j++) if (lane + 32 * j < D) s += qv[j] * to_f(k[lane + 32 * j]);
        s = warp_sum(s) * scale_log2;
        float mn = fmaxf(m, s), corr = exp2f(m - mn), pw = exp2f(s - mn);
        l = l * corr + pw;
#pragma unroll
        for (int j = 0; j < 4; j++) if (lane + 32 * j < D) o[j] = o[j] * corr + pw * to_f(v[lane + 32 * j]);
        m = mn;
    }
    size_t idx = (size_t)t * nh + hd;     /* one split */
#pragma unroll
    for (int j = 0; j < 4; j++) if (lane + 32 * j < D) part_o[idx * D + lane + 32 * j] = o[j];
    if (lane == 0) part_ml[idx] = make_float2(m, l);
}

/* Merge the splits of each (token, head), then the softplus output gate (per head or per element; none when
 * gate_off < 0: a drafter with gating disabled).
 * The split weights go through shared memory; splits left empty by a short context are skipped. */
__global__ void attention_combine(float *att, const float *part_o, const float2 *part_ml, int nsplit, int nh,
                                  int D, const float *qkvg, int NQ, int gate_off, int gate_per_head) {
    __shared__ float wsp[64];
    __shared__ float sh_L;
    int t = blockIdx.x / nh, hd = blockIdx.x % nh;
    size_t idx = (size_t)blockIdx.x * nsplit;
    if (threadIdx.x < 32) {
        float M = -INFINITY;
        for (int s = threadIdx.x; s < nsplit; s += 32) M = fmaxf(M, part_ml[idx + s].x);
        M = warp_max(M);
        float L = 0.0f;
        for (int s = threadIdx.x; s < nsplit; s += 32) {
            float2 ml = part_ml[idx + s];
            float w = ml.y > 0.0f ? exp2f(ml.x - M) : 0.0f;
            wsp[s] = w;
            L += ml.y * w;
        }
        L = warp_sum(L);
        if (threadIdx.x == 0) sh_L = L;
    }
    __syncthreads();
    const float *gate = qkvg + (size_t)t * NQ + gate_off;
    float L = sh_L;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float acc = 0.0f;
#pragma unroll 4
        for (int s = 0; s < nsplit; s++)
            if (wsp[s] > 0.0f) acc += part_o[(idx + s) * D + d] * wsp[s];
        float gt = gate_off < 0 ? 1.0f : softplus(gate[gate_per_head ? hd : hd * D + d]);
        att[((size_t)t * nh + hd) * D + d] = acc / L * gt;
    }
}

/* ---- MoE ----
 * route_plan (one block): sigmoid router (optional tanh softcap), top-k of score + correction bias (ties to the
 * lower id), weights = unbiased scores renormalised; then the (token, slot) pairs sorted by expert so each
 * active expert's weights are read once: start[e]..start[e+1] are expert e's pairs, pair_tok / pair_w their
 * token and weight, inv[t*K + j] where pair (t, j) went, active[0..n_active) the experts used (ascending). */
__global__ void route_plan(float *logits, const float *bias, int n, int E, int K, float softcap, int *topk_idx,
                           float *topk_w, int *start, int *pair_tok, float *pair_w, int *inv, int *active,
                           int *n_active) {
    extern __shared__ int cnt[];          /* [E] counts, then [E] fill */
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    for (int t = warp; t < n; t += nw) {
        float *lg = logits + (size_t)t * E;
        for (int e = lane; e < E; e += 32) {
            float v = lg[e];
            if (softcap > 0.0f) v = tanhf(v / softcap) * softcap;
            lg[e] = 1.0f / (1.0f + expf(-v));
        }
        __syncwarp();
        uint32_t taken = 0;               /* bit i: expert lane + 32 i already chosen (E <= 1024) */
        float sum = 0.0f;
        for (int j = 0; j < K; j++) {
            float bv = -INFINITY;
            int be = E;
            for (int i = 0, e = lane; e < E; i++, e += 32) {
                float v = lg[e] + bias[e];
                if (!(taken >> i & 1) && (v > bv || be == E)) { bv = v; be = e; }
            }
            for (int o = 16; o > 0; o >>= 1) {
                float ov = __shfl_xor_sync(0xffffffffu, bv, o);
                int oe = __shfl_xor_sync(0xffffffffu, be, o);
                if (oe < E && (be == E || ov > bv || (ov == bv && oe < be))) { bv = ov; be = oe; }
            }
            if ((be & 31) == lane) taken |= 1u << (be >> 5);
            float w = lg[be];
            sum += w;
            if (lane == 0) { topk_idx[t * K + j] = be; topk_w[t * K + j] = w; }
        }
        __syncwarp();
        if (lane < K) topk_w[t * K + lane] /= sum;
    }
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

/* SwiGLU gate/up for the active experts and the always-on matrix (shared expert, or the dense MLP):
 * h = silu(x . gate_i) * (x . up_i). One warp per hidden unit i, every token of that expert, so the expert's
 * rows are read once. Blocks [0, max_active * nbI) are routed experts, the rest the always-on matrix. */
template <typename W>
__global__ void __launch_bounds__(256) moe_gate_up(const W *experts_gu, int I, const W *always_gu, int S, int H,
                                                   const float *xb, int n, const int *start, const int *pair_tok,
                                                   const int *active, const int *n_active, int max_active,
                                                   float *h_pair, float *hs) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nbI = (I + 7) / 8;
    int b = blockIdx.x, hid, i, cnt, first = 0;
    const W *base;
    const int *toks = NULL;
    float *out;
    if (b < max_active * nbI) {
        int a = b / nbI;
        if (a >= *n_active) return;
        int e = active[a];
        i = (b % nbI) * 8 + warp;
        hid = I;
        base = experts_gu + (size_t)e * 2 * I * H;
        first = start[e];
        cnt = start[e + 1] - first;
        toks = pair_tok + first;
        out = h_pair + (size_t)first * I;
    } else {
        i = (b - max_active * nbI) * 8 + warp;
        hid = S;
        base = always_gu;
        cnt = n;
        out = hs;
    }
    if (i >= hid) return;
    const W *wg = base + (size_t)i * H, *wu = base + (size_t)(hid + i) * H;
    for (int t0 = 0; t0 < cnt; t0 += 4) {       /* 4 tokens per pass; later passes hit L1/L2 */
        float ag[4] = {}, au[4] = {};
        const float *xr[4];
#pragma unroll
        for (int tt = 0; tt < 4; tt++) {
            int tok = t0 + tt < cnt ? (toks ? toks[t0 + tt] : t0 + tt) : -1;
            xr[tt] = tok >= 0 ? xb + (size_t)tok * H : NULL;
        }
        for (int k0 = lane * 8; k0 < H; k0 += 4 * 256) {   /* 4 chunks of both rows in flight */
            W8 cg[4], cu[4];
#pragma unroll
            for (int u = 0; u < 4; u++)
                if (k0 + u * 256 < H) { cg[u] = load_w8(wg + k0 + u * 256); cu[u] = load_w8(wu + k0 + u * 256); }
#pragma unroll
            for (int u = 0; u < 4; u++) {
                int k = k0 + u * 256;
                if (k >= H) break;
                float g8[8], u8[8], x8[8];
                unpack_w8(cg[u], wg, g8);
                unpack_w8(cu[u], wu, u8);
#pragma unroll
                for (int tt = 0; tt < 4; tt++)
                    if (xr[tt]) { load_x8(xr[tt] + k, x8); ag[tt] += dot8(g8, x8); au[tt] += dot8(u8, x8); }
            }
        }
#pragma unroll
        for (int tt = 0; tt < 4; tt++) {
            float g = warp_sum(ag[tt]), u = warp_sum(au[tt]);
            if (lane == 0 && xr[tt]) out[(size_t)(t0 + tt) * hid + i] = silu(g) * u;
        }
    }
}

/* Expert down projections for n > 1: y_pair[k] = down_e . h_pair[k] per pair, ys[t] = always_down . hs[t].
 * One warp per output row, every pair of the expert. moe_combine adds them up. */
template <typename W>
__global__ void __launch_bounds__(256) moe_down(const W *experts_down, int I, const W *always_down, int S, int H,
                                                int n, const int *start, const int *active, const int *n_active,
                                                int max_active, const float *h_pair, const float *hs,
                                                float *y_pair, float *ys) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nbH = (H + 7) / 8;
    int b = blockIdx.x, j, cnt, hid;
    const W *w;
    const float *hin;
    float *out;
    if (b < max_active * nbH) {
        int a = b / nbH;
        if (a >= *n_active) return;
        int e = active[a], first = start[e];
        j = (b % nbH) * 8 + warp;
        hid = I;
        w = experts_down + ((size_t)e * H + j) * I;
        cnt = start[e + 1] - first;
        hin = h_pair + (size_t)first * I;
        out = y_pair + (size_t)first * H;
    } else {
        j = (b - max_active * nbH) * 8 + warp;
        hid = S;
        w = always_down + (size_t)j * S;
        cnt = n;
        hin = hs;
        out = ys;
    }
    if (j >= H) return;
    for (int t0 = 0; t0 < cnt; t0 += 4) {
        float acc[4] = {};
#pragma unroll 4
        for (int k = lane * 8; k < hid; k += 256) {
            W8 c = load_w8(w + k);
            float w8[8], x8[8];
            unpack_w8(c, w, w8);
#pragma unroll
            for (int tt = 0; tt < 4; tt++)
                if (t0 + tt < cnt) { load_x8(hin + (size_t)(t0 + tt) * hid + k, x8); acc[tt] += dot8(w8, x8); }
        }
#pragma unroll
        for (int tt = 0; tt < 4; tt++) {
            float s = warp_sum(acc[tt]);
            if (lane == 0 && t0 + tt < cnt) out[(size_t)(t0 + tt) * H + j] = s;
        }
    }
}

/* Decode (one token): all down projections of a layer in one launch with the weighted sum and the residual:
 * x[j] += always_down[j] . hs + scaling * sum_a w_a * down_{e_a}[j] . h_a, experts in ascending id (the CPU's
 * order). One warp per output row; the 8 experts' rows are all in flight together. */
template <typename W>
__global__ void __launch_bounds__(256, 2) moe_down_decode(float *x, const W *experts_down, int I, const W *always_down,
                                                       int S, int H, const int *active, const int *n_active,
                                                       const int *start, const float *pair_w, const float *h_pair,
                                                       const float *hs, float scaling) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, j = blockIdx.x * 8 + warp;
    if (j >= H) return;
    float routed = 0.0f;
    int na = n_active ? *n_active : 0;
    for (int a0 = 0; a0 < na; a0 += 8) {
        float acc[8] = {};
        const W *wrow[8];
        const float *hrow[8];
#pragma unroll
        for (int a = 0; a < 8; a++) {
            int e = a0 + a < na ? active[a0 + a] : active[a0];
            wrow[a] = experts_down + ((size_t)e * H + j) * I;
            hrow[a] = h_pair + (size_t)start[e] * I;
        }
        for (int k0 = lane * 8; k0 < I; k0 += 2 * 256) {   /* 2 chunks of all 8 experts in flight */
            W8 c[8][2];
#pragma unroll
            for (int a = 0; a < 8; a++)
#pragma unroll
                for (int u = 0; u < 2; u++)
                    if (a0 + a < na && k0 + u * 256 < I) c[a][u] = load_w8(wrow[a] + k0 + u * 256);
#pragma unroll
            for (int a = 0; a < 8; a++)
#pragma unroll
                for (int u = 0; u < 2; u++)
                    if (a0 + a < na && k0 + u * 256 < I) {
                        float w8[8], x8[8];
                        unpack_w8(c[a][u], experts_down, w8);
                        load_x8(hrow[a] + k0 + u * 256, x8);
                        acc[a] += dot8(w8, x8);
                    }
        }
#pragma unroll
        for (int a = 0; a < 8; a++)
            if (a0 + a < na) routed += pair_w[start[active[a0 + a]]] * warp_sum(acc[a]);
    }
    float sh = 0.0f;
    for (int k = lane * 8; k < S; k += 256) {
        float w8[8], x8[8];
        W8 c = load_w8(always_down + (size_t)j * S + k);
        unpack_w8(c, always_down, w8);
        load_x8(hs + k, x8);
        sh += dot8(w8, x8);
    }
    sh = warp_sum(sh);
    if (lane == 0) x[j] += sh + routed * scaling;
}

/* x[t] += ys[t] + scaling * sum_j w_j * y_pair[(t, j)], the slots summed in ascending expert id */
__global__ void moe_combine(float *x, const float *y_pair, const float *ys, const int *inv, const int *topk_idx,
                            const float *topk_w, int K, int H, float scaling) {
    __shared__ int order[64];
    int t = blockIdx.x;
    if (threadIdx.x == 0) {
        for (int j = 0; j < K; j++) order[j] = j;
        for (int a = 1; a < K; a++)
            for (int b = a; b > 0 && topk_idx[t * K + order[b]] < topk_idx[t * K + order[b - 1]]; b--) {
                int tmp = order[b]; order[b] = order[b - 1]; order[b - 1] = tmp;
            }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < H; i += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < K; j++) {
            int p = t * K + order[j];
            acc += y_pair[(size_t)inv[p] * H + i] * topk_w[p];
        }
        x[(size_t)t * H + i] += ys[(size_t)t * H + i] + acc * scaling;
    }
}

/* many tokens, padded batched GEMM: pair p's output row becomes rank[e] * maxc + (its row within expert e) */
__global__ void remap_pairs(int *inv, const int *topk_idx, const int *start, const int *rank, int maxc, int P) {
    int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= P) return;
    int e = topk_idx[p];
    inv[p] = rank[e] * maxc + (inv[p] - start[e]);
}

/* many tokens: gather the pairs' inputs in expert order (the batched GEMM's B) */
template <typename T>
__global__ void gather_rows(T *dst, const float *xb, const int *pair_tok, int H) {
    int k = blockIdx.x;
    const float *src = xb + (size_t)pair_tok[k] * H;
    for (int i = threadIdx.x; i < H; i += blockDim.x) dst[(size_t)k * H + i] = from_f<T>(src[i]);
}

/* act[r, i] = silu(h[r, i]) * h[r, hid + i]  (gate and up side by side in one GEMM output row) */
template <typename T>
__global__ void swiglu_kernel(T *act, const float *h, size_t rows, int hid) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= rows * hid) return;
    size_t r = i / hid, c = i % hid;
    act[i] = from_f<T>(silu(h[r * 2 * hid + c]) * h[r * 2 * hid + hid + c]);
}

/* ---- sampling on the device: only the token id crosses to the host ----
 * One block. Greedy: argmax (first index on ties). Otherwise softmax(logits / T) and top-p: the nucleus is
 * {p >= threshold}, the threshold found by a 3-pass radix select over the float bits of p (positive floats
 * order like their bits) so that its mass first exceeds top-p; then the token where the running mass, in
 * index order, passes coin * mass. Same distribution as the CPU sampler (which walks the sorted order). */
struct Step { int token, pos; float temperature, topp, coin; int out; };

__global__ void __launch_bounds__(1024) sample_kernel(const float *logits, int V, Step *st) {
    __shared__ float red_v[32];
    __shared__ int red_i[32];
    __shared__ float hist[2048];
    __shared__ float sh_f[4];
    __shared__ uint32_t sh_u[2];
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nt = blockDim.x;
    float T = st->temperature, topp = st->topp;
    /* argmax (also the max for the softmax) */
    float bv = -INFINITY;
    int bi = V;
    for (int i = tid; i < V; i += nt) if (logits[i] > bv) { bv = logits[i]; bi = i; }
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
    }
    if (lane == 0) { red_v[warp] = bv; red_i[warp] = bi; }
    __syncthreads();
    if (tid == 0) {
        for (int w = 1; w < nt / 32; w++)
            if (red_v[w] > red_v[0] || (red_v[w] == red_v[0] && red_i[w] < red_i[0])) { red_v[0] = red_v[w]; red_i[0] = red_i[w]; }
    }
    __syncthreads();
    if (T == 0.0f) { if (tid == 0) st->out = red_i[0]; return; }
    float mx = red_v[0] / T, sum = 0.0f;
    for (int i = tid; i < V; i += nt) sum += expf(logits[i] / T - mx);
    sum = block_sum(sum);
#define PROB(i) (expf(logits[i] / T - mx) / sum)
    uint32_t thr = 0;                       /* bits of the nucleus threshold; 0 = every token */
    if (topp > 0.0f && topp < 1.0f) {
        /* radix select, 11 + 11 + 10 bits from the top: the largest threshold whose mass (sum of p >= it)
         * exceeds topp. above = mass of the bins already known to be above the current prefix. */
        float above = 0.0f;
        uint32_t prefix = 0;
        const int shifts[3] = {21, 10, 0}, widths[3] = {11, 11, 10};
        for (int pass = 0; pass < 3; pass++) {
            int nb = 1 << widths[pass], sft = shifts[pass];
            for (int b = tid; b < nb; b += nt) hist[b] = 0.0f;
            __syncthreads();
            uint32_t himask = pass == 0 ? 0u : ~0u << (sft + widths[pass]);
            for (int i = tid; i < V; i += nt) {
                float p = PROB(i);
                uint32_t u = __float_as_uint(p);
                if ((u & himask) == prefix) atomicAdd(&hist[(u >> sft) & (nb - 1)], p);
            }
            __syncthreads();
            if (tid == 0) {
                float acc = above;
                int b = nb - 1;
                for (; b > 0; b--) { if (acc + hist[b] > topp) break; acc += hist[b]; }
                sh_f[0] = acc;
                sh_u[0] = prefix | ((uint32_t)b << sft);
            }
            __syncthreads();
            above = sh_f[0];
            prefix = sh_u[0];
            __syncthreads();
        }
        thr = prefix;
    }
    /* the nucleus mass, then the token where the running mass in index order passes coin * mass */
    int per = (V + nt - 1) / nt, i0 = tid * per, i1 = min(V, i0 + per);
    float mine = 0.0f;
    for (int i = i0; i < i1; i++) { float p = PROB(i); if (__float_as_uint(p) >= thr) mine += p; }
    /* exclusive scan of the per-thread masses */
    float incl = mine;
    for (int o = 1; o < 32; o <<= 1) { float v = __shfl_up_sync(0xffffffffu, incl, o); if (lane >= o) incl += v; }
    if (lane == 31) red_v[warp] = incl;
    __syncthreads();
    if (tid == 0) { float s = 0.0f; for (int w = 0; w < nt / 32; w++) { float v = red_v[w]; red_v[w] = s; s += v; } sh_f[1] = s; }
    __syncthreads();
    float excl = red_v[warp] + incl - mine, target = st->coin * sh_f[1];
    if (tid == 0) sh_u[1] = 0xFFFFFFFFu;
    __syncthreads();
    if (excl <= target && target < excl + mine) {
        float c = excl;
        int pick = -1;
        for (int i = i0; i < i1; i++) {
            float p = PROB(i);
            if (__float_as_uint(p) < thr) continue;
            pick = i;
            c += p;
            if (target < c) break;
        }
        if (pick >= 0) atomicMin(&sh_u[1], (uint32_t)pick);
    }
    __syncthreads();
    if (tid == 0) {
        uint32_t pick = sh_u[1];
        if (pick == 0xFFFFFFFFu) {          /* rounding left the target past the end: the last nucleus token */
            for (int i = V - 1; i >= 0; i--) if (__float_as_uint(PROB(i)) >= thr) { pick = i; break; }
        }
        st->out = (int)pick;
    }
#undef PROB
}

/* ----------------------------------------------------------------------------
 * the model on the device */

struct GpuLayer {
    void *wqkvg;             /* [NQ, H]: wq, wk, wv, wg rows stacked (NQ = nh*D + 2*KVD + GD) */
    float *bqkvg;            /* [NQ] biases (g part zero) or NULL */
    void *wo;                /* [H, nh*D] */
    float *bo;               /* [H] or NULL */
    float *attn_norm, *ffn_norm, *q_norm, *k_norm;   /* [H], [H], [D], [D] */
    void *gate_up;           /* dense [2F, H] (gate rows, then up rows) or shared expert [2S, H] */
    void *down;              /* dense [H, F] or shared [H, S] */
    void *router;            /* [E, H] */
    float *expert_bias;      /* [E] */
    void *experts_gate_up;   /* [E, 2I, H] */
    void *experts_down;      /* [E, H, I] */
    void *kc, *vc;           /* KV cache [rows, KVD] (bf16 or f32, the weights' dtype) */
    int rows;                /* ctx (full) or a ring of W + max_tokens - 1 (sliding) */
    int nh, NQ, GD, dense, hid;  /* hid: F (dense) or S (shared) */
};

struct GpuModel {
    Config c;
    int ctx, T, bf;          /* bf: weights and KV in bf16 (else f32) */
    int decode_split[2];     /* attention splits per layer type for one token (fixed: the graph is reused) */
    int kv_bf;               /* KV cache in bf16 (the weights' dtype; LAGUNA_KV_F32=1 forces f32, a debug hook) */
    int attn_scalar;         /* LAGUNA_ATTN_SCALAR=1: the plain attention kernel on bf16 KV (a debug hook) */
    int nsm;
    char *wbuf;              /* all weights: one allocation */
    char *kvbuf;             /* all KV caches: one allocation */
    size_t wbytes, kvbytes, actbytes;
    void *embed, *lm_head;   /* [V, H] */
    float *final_norm, *inv_freq[2];
    GpuLayer L[LAGUNA_MAX_LAYERS];
    /* activations for up to T tokens */
    float *x, *xb, *qkvg, *att, *mlp_h, *mlp_act, *router_logits, *topk_w, *pair_w, *h_pair, *hs, *y_pair, *ys;
    float *part_o, *logits;
    float2 *part_ml;
    void *act16;             /* GEMM inputs in the weights' dtype */
    void *x_sorted, *act_sorted;
    int *tokens, *pos, *topk_idx, *start, *pair_tok, *inv, *active, *n_active;
    size_t part_cap;         /* floats in part_o */
    void **gptr;             /* device pointer arrays for the grouped GEMMs [6 * E] */
    /* host side */
    int *h_tokens, *h_start;
    void **h_gptr;
    float *h_logits;
    Step *h_step, *d_step;
    cudaStream_t stream;
    cublasHandle_t blas;
    cudaGraphExec_t graph;
    int use_graph;
    char summary[256];
    /* DFlash (the section at the end of this file) */
    int *ids, *h_ids;        /* [T] each row's argmax (gpu_forward_argmax), on the device and pinned on the host */
    float *taps;             /* target: [T, n_taps, H] the residual stream after the tap layers, every row */
    int n_taps, tap_layers[LAGUNA_MAX_TAPS];
    void *fc;                /* drafter: [H, n_taps*H] */
    float *hidden_norm;      /* drafter: [H] */
    float *aux_norm;         /* drafter: [n_taps, H] the per-tap norms, stacked */
    float *cat, *ctxv;       /* drafter: [T, n_taps*H] normed taps side by side, [T, H] the fused context */
};

static size_t dsize(const GpuModel *g) { return g->bf ? 2 : 4; }
static cudaDataType_t dtype_of(const GpuModel *g) { return g->bf ? CUDA_R_16BF : CUDA_R_32F; }
static unsigned grid_for(size_t n, int block) { size_t b = (n + block - 1) / block; return (unsigned)(b < 65535 * 16 ? b : 65535 * 16); }

/* ---- upload: every weight goes to its place in the one allocation, converted to the model dtype, or is
 * filled on the device with the --random-weights hash (no copy of a file full of holes). */

struct Uploader {
    GpuModel *g;
    const Model *m;
    char *cursor;            /* NULL: the sizing pass */
    size_t bytes;
    void *staging;
    size_t staging_bytes;
};

static const TensorEntry *entry_of(const Model *m, const Tensor *t) {
    for (uint64_t i = 0; i < m->n_tensors; i++)
        if ((const char *)m->map + m->dir[i].offset == (const char *)t->data) return &m->dir[i];
    return NULL;
}

static void *reserve(Uploader *u, size_t bytes) {
    size_t off = (u->bytes + 255) & ~(size_t)255;
    u->bytes = off + bytes;
    return u->cursor ? u->cursor + off : NULL;
}

/* count elements of tensor t (starting at element elem0) into dst (model dtype, or f32 when keep_f32) */
static void put(Uploader *u, void *dst, const Tensor *t, size_t elem0, size_t count, int keep_f32) {
    if (!u->cursor) return;
    GpuModel *g = u->g;
    int to_bf = g->bf && !keep_f32;
    size_t src_es = t->dtype == DT_BF16 ? 2 : 4;
    const TensorEntry *e = entry_of(u->m, t);
    if (u->m->random_weights && !keep_f32 && t->ndim >= 2) {
        float a = sqrtf(3.0f / (float)t->shape[t->ndim - 1]);
        uint64_t key = name_key(e ? e->name : "");
        if (to_bf) fill_random<bf16><<<grid_for(count, 256), 256, 0, g->stream>>>((bf16 *)dst, count, u->m->random_seed, key, elem0, a);
        else fill_random<float><<<grid_for(count, 256), 256, 0, g->stream>>>((float *)dst, count, u->m->random_seed, key, elem0, a);
        LAUNCH_CHECK();
        return;
    }
    const char *src = (const char *)t->data + elem0 * src_es;
    int same = (t->dtype == DT_BF16) == (bool)to_bf;
    if (same) { CUDA_CHECK(cudaMemcpy(dst, src, count * src_es, cudaMemcpyHostToDevice)); return; }
    for (size_t done = 0; done < count;) {     /* convert through the staging buffer */
        size_t k = count - done, cap = u->staging_bytes / 4;
        if (k > cap) k = cap;
        CUDA_CHECK(cudaMemcpy(u->staging, src + done * src_es, k * src_es, cudaMemcpyHostToDevice));
        if (t->dtype == DT_BF16) convert<bf16, float><<<grid_for(k, 256), 256, 0, g->stream>>>((float *)dst + done, (const bf16 *)u->staging, k);
        else convert<float, bf16><<<grid_for(k, 256), 256, 0, g->stream>>>((bf16 *)dst + done, (const float *)u->staging, k);
        LAUNCH_CHECK();
        CUDA_CHECK(cudaStreamSynchronize(g->stream));
        done += k;
    }
}

static size_t numel(const Tensor *t) { size_t n = 1; for (int i = 0; i < t->ndim; i++) n *= (size_t)t->shape[i]; return n; }

static void *weight(Uploader *u, const Tensor *t) {
    void *d = reserve(u, numel(t) * dsize(u->g));
    put(u, d, t, 0, numel(t), 0);
    return d;
}
static float *f32(Uploader *u, const Tensor *t) {
    if (!t->data) return NULL;
    float *d = (float *)reserve(u, numel(t) * 4);
    put(u, d, t, 0, numel(t), 1);
    return d;
}
/* several tensors stacked by rows into one matrix */
static void *stacked(Uploader *u, const Tensor **ts, int k) {
    size_t total = 0;
    for (int i = 0; i < k; i++) total += numel(ts[i]);
    char *d = (char *)reserve(u, total * dsize(u->g));
    size_t off = 0;
    for (int i = 0; i < k; i++) { put(u, d ? d + off * dsize(u->g) : NULL, ts[i], 0, numel(ts[i]), 0); off += numel(ts[i]); }
    return d;
}

static void upload_weights(Uploader *u) {
    GpuModel *g = u->g;
    const Model *m = u->m;
    const Config *c = &m->config;
    const Weights *w = &m->weights;
    u->bytes = 0;
    if (c->block_size) {     /* a DFlash drafter: the context fusion; embed and lm_head are the target's (linked later) */
        g->fc = weight(u, &w->fc);
        g->hidden_norm = f32(u, &w->hidden_norm);
        g->aux_norm = (float *)reserve(u, (size_t)c->n_taps * c->dim * 4);
        for (int i = 0; i < c->n_taps; i++)
            put(u, g->aux_norm ? g->aux_norm + (size_t)i * c->dim : NULL, &w->aux_norm[i], 0, c->dim, 1);
    } else {
        g->embed = weight(u, &w->embed);
        g->lm_head = c->tied_embeddings ? g->embed : weight(u, &w->lm_head);
    }
    g->final_norm = f32(u, &w->final_norm);
    for (int t = 0; t < 2; t++) {
        g->inv_freq[t] = NULL;
        if (!w->inv_freq[t]) continue;
        g->inv_freq[t] = (float *)reserve(u, c->rotary_dim[t] / 2 * 4);
        if (u->cursor) CUDA_CHECK(cudaMemcpy(g->inv_freq[t], w->inv_freq[t], c->rotary_dim[t] / 2 * 4, cudaMemcpyHostToDevice));
    }
    for (int l = 0; l < c->n_layers; l++) {
        const LayerWeights *lw = &w->layers[l];
        GpuLayer *L = &g->L[l];
        const Tensor *qkvg[4] = {&lw->wq, &lw->wk, &lw->wv, &lw->wg};
        L->wqkvg = stacked(u, qkvg, c->gated ? 4 : 3);
        L->bqkvg = NULL;
        if (c->attention_bias) {
            L->bqkvg = (float *)reserve(u, (size_t)L->NQ * 4);
            const Tensor *b[3] = {&lw->bq, &lw->bk, &lw->bv};
            size_t off = 0;
            for (int i = 0; i < 3; i++) { put(u, L->bqkvg ? L->bqkvg + off : NULL, b[i], 0, numel(b[i]), 1); off += numel(b[i]); }
            if (u->cursor) CUDA_CHECK(cudaMemset(L->bqkvg + off, 0, (L->NQ - off) * 4));
        }
        L->wo = weight(u, &lw->wo);
        L->bo = f32(u, &lw->bo);
        L->attn_norm = f32(u, &lw->attn_norm);
        L->ffn_norm = f32(u, &lw->ffn_norm);
        L->q_norm = f32(u, &lw->q_norm);
        L->k_norm = f32(u, &lw->k_norm);
        if (L->dense) {
            const Tensor *gu[2] = {&lw->w_gate, &lw->w_up};
            L->gate_up = stacked(u, gu, 2);
            L->down = weight(u, &lw->w_down);
        } else {
            const Tensor *gu[2] = {&lw->shared_gate, &lw->shared_up};
            L->gate_up = stacked(u, gu, 2);
            L->down = weight(u, &lw->shared_down);
            L->router = weight(u, &lw->router);
            L->expert_bias = f32(u, &lw->expert_bias);
            L->experts_gate_up = weight(u, &lw->experts_gate_up);
            L->experts_down = weight(u, &lw->experts_down);
        }
    }
    if (u->cursor) CUDA_CHECK(cudaStreamSynchronize(g->stream));
}

/* ----------------------------------------------------------------------------
 * the public interface */

extern "C" int gpu_available(char *info, size_t infosz) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) { cudaGetLastError(); if (infosz) info[0] = 0; return 0; }
    cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, 0) != cudaSuccess) { if (infosz) info[0] = 0; return 0; }
    snprintf(info, infosz, "%s, %.1f GiB, %d SMs, sm_%d%d", p.name, p.totalGlobalMem / 1073741824.0,
             p.multiProcessorCount, p.major, p.minor);
    return 1;
}

static int split_for(const GpuModel *g, int keys, int row_blocks, int n) {
    int s = (2 * g->nsm + row_blocks * g->c.n_kv_heads - 1) / (row_blocks * g->c.n_kv_heads);
    int most = (keys + 63) / 64;
    if (s > most) s = most;
    if (s > 64) s = 64;
    size_t cap = g->part_cap / ((size_t)n * g->c.max_heads * g->c.head_dim);
    if ((size_t)s > cap) s = (int)cap;
    return s < 1 ? 1 : s;
}

static void capture_decode(GpuModel *g);
static void capture_taps(GpuModel *g, int l, int n);

#define GFAIL(...) do { snprintf(err, errsz, __VA_ARGS__); gpu_free(g); return NULL; } while (0)

extern "C" GpuModel *gpu_init(const Model *m, int ctx, int max_tokens, char *err, size_t errsz) {
    const Config *c = &m->config;
    GpuModel *g = (GpuModel *)calloc(1, sizeof(GpuModel));
    if (!g) { snprintf(err, errsz, "out of host memory"); return NULL; }
    g->c = *c;
    g->ctx = ctx;
    g->T = max_tokens;
    g->bf = m->weights.embed.dtype == DT_BF16;
    g->kv_bf = g->bf && !getenv("LAGUNA_KV_F32");
    g->attn_scalar = getenv("LAGUNA_ATTN_SCALAR") != NULL;
    g->use_graph = !getenv("LAGUNA_NO_GRAPH");    /* for the test that graph replay equals plain launches */
    int D = c->head_dim, H = c->dim, KVD = c->kv_dim, T = max_tokens, E = c->n_experts, K = c->n_experts_active;
    for (uint64_t i = 0; i < m->n_tensors; i++)
        if (m->dir[i].dtype != DT_F32 && m->dir[i].dtype != DT_BF16 && strcmp(m->dir[i].name, "tokenizer"))
            GFAIL("tensor %s is quantized (dtype %u): the GPU backend reads bf16 and f32 weights\n"
                  "  hint: use --cpu, or export with --dtype bf16", m->dir[i].name, m->dir[i].dtype);
    if (D != 16 && D != 32 && D != 64 && D != 128)
        GFAIL("head_dim %d is not supported by the GPU backend (16, 32, 64 or 128)\n  hint: use --cpu", D);
    if (H % 8 || (E && (c->moe_hidden_dim % 8 || c->shared_hidden_dim % 8)) || c->hidden_dim % 8)
        GFAIL("the GPU backend needs hidden sizes that are multiples of 8\n  hint: use --cpu");
    if (E > 1024 || K > 32) GFAIL("the GPU backend handles at most 1024 experts and top-32\n  hint: use --cpu");
    for (int l = 0; l < c->n_layers; l++) {
        GpuLayer *L = &g->L[l];
        L->nh = c->n_heads[l];
        L->GD = !c->gated ? 0 : c->gate_per_head ? L->nh : L->nh * D;   /* 0: a drafter with gating disabled */
        L->NQ = L->nh * D + 2 * KVD + L->GD;
        L->dense = c->mlp_type[l] == MLP_DENSE;
        L->hid = L->dense ? c->hidden_dim : c->shared_hidden_dim;
        if ((L->nh * D) % 8) GFAIL("layer %d: projection sizes not multiples of 8\n  hint: use --cpu", l);
        int64_t r = c->layer_type[l] == ATTN_FULL ? ctx : (int64_t)c->sliding_window + max_tokens - 1;
        L->rows = (int)(r < ctx ? r : ctx);
    }
    CUDA_CHECK(cudaSetDevice(0));
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    g->nsm = prop.multiProcessorCount;
    CUDA_CHECK(cudaStreamCreateWithFlags(&g->stream, cudaStreamNonBlocking));
    CUBLAS_CHECK(cublasCreate(&g->blas));
    CUBLAS_CHECK(cublasSetStream(g->blas, g->stream));

    /* weights: size, allocate once, place */
    Uploader u = {g, m, NULL, 0, NULL, 0};
    upload_weights(&u);
    g->wbytes = u.bytes;
    if (cudaMalloc(&g->wbuf, g->wbytes) != cudaSuccess) {
        cudaGetLastError();
        GFAIL("cannot allocate %.2f GiB for the weights on the GPU\n  hint: use --cpu", g->wbytes / 1073741824.0);
    }
    u.cursor = g->wbuf;
    u.staging_bytes = 64 << 20;
    CUDA_CHECK(cudaMalloc(&u.staging, u.staging_bytes));
    upload_weights(&u);
    CUDA_CHECK(cudaFree(u.staging));

    /* KV cache: one allocation, zeroed (no NaN in rows not yet written) */
    size_t kv = 0;
    size_t kvs = g->kv_bf ? 2 : 4;
    for (int l = 0; l < c->n_layers; l++) kv += (size_t)g->L[l].rows * KVD * 2 * kvs;
    g->kvbytes = kv;
    if (cudaMalloc(&g->kvbuf, kv) != cudaSuccess) {
        cudaGetLastError();
        GFAIL("cannot allocate %.2f GiB for the KV cache of %d positions on the GPU\n  hint: lower -c", kv / 1073741824.0, ctx);
    }
    CUDA_CHECK(cudaMemset(g->kvbuf, 0, kv));
    char *p = g->kvbuf;
    for (int l = 0; l < c->n_layers; l++) {
        size_t b = (size_t)g->L[l].rows * KVD * kvs;
        g->L[l].kc = p; p += b;
        g->L[l].vc = p; p += b;
    }

    /* activations */
    int QD = c->max_heads * D, NQ = 0, F = c->hidden_dim, I = c->moe_hidden_dim, S = c->shared_hidden_dim;
    for (int l = 0; l < c->n_layers; l++) if (g->L[l].NQ > NQ) NQ = g->L[l].NQ;
    int hid = F > S ? F : S;
    size_t P = (size_t)T * (K ? K : 1), widest = H;
    if ((size_t)QD > widest) widest = QD;
    if ((size_t)hid > widest) widest = hid;
    if (c->block_size && (size_t)c->n_taps * H > widest) widest = (size_t)c->n_taps * H;   /* a drafter's fc input */
    g->part_cap = (size_t)(T > 1024 ? T : 1024) * c->max_heads * D;
    size_t act0 = 0;
#define ALLOC(ptr, count, type) do { size_t b_ = ((size_t)(count) * sizeof(type) + 255) & ~(size_t)255; \
        if (cudaMalloc((void **)&(ptr), b_) != cudaSuccess) { cudaGetLastError(); GFAIL("out of GPU memory for activations (--chunk %d)\n  hint: lower --chunk", T); } \
        act0 += b_; } while (0)
    ALLOC(g->x, (size_t)T * H, float);
    ALLOC(g->xb, (size_t)T * H, float);
    ALLOC(g->qkvg, (size_t)T * NQ, float);
    ALLOC(g->att, (size_t)T * QD, float);
    ALLOC(g->mlp_h, (size_t)T * 2 * hid, float);
    ALLOC(g->mlp_act, (size_t)T * hid, float);
    ALLOC(g->act16, (size_t)T * widest * dsize(g), char);
    ALLOC(g->logits, (size_t)T * c->vocab_size, float);
    ALLOC(g->part_o, g->part_cap, float);
    ALLOC(g->part_ml, g->part_cap / D, float2);
    ALLOC(g->tokens, T, int);
    ALLOC(g->pos, 1, int);
    ALLOC(g->d_step, 1, Step);
    ALLOC(g->ids, T, int);
    if (E) {
        ALLOC(g->router_logits, (size_t)T * E, float);
        ALLOC(g->topk_idx, P, int);
        ALLOC(g->topk_w, P, float);
        ALLOC(g->pair_w, P, float);
        ALLOC(g->pair_tok, P, int);
        ALLOC(g->inv, P, int);
        ALLOC(g->start, E + 1, int);
        ALLOC(g->active, E, int);
        ALLOC(g->n_active, 1, int);
        ALLOC(g->h_pair, 2 * P * 2 * I, float);        /* x2: the padded batched GEMM */
        ALLOC(g->hs, (size_t)T * S, float);
        ALLOC(g->y_pair, 2 * P * H, float);
        ALLOC(g->ys, (size_t)T * H, float);
        ALLOC(g->x_sorted, (P + T) * H * dsize(g), char);   /* + T rows: padding reads past the last expert */
        ALLOC(g->act_sorted, 2 * P * I * dsize(g), char);
        ALLOC(g->gptr, 7 * (size_t)E, void *);              /* 6 pointer arrays and the expert ranks */
    }
#undef ALLOC
    g->actbytes = act0;
    CUDA_CHECK(cudaMallocHost(&g->h_tokens, T * sizeof(int)));
    CUDA_CHECK(cudaMallocHost(&g->h_logits, (size_t)T * c->vocab_size * sizeof(float)));
    CUDA_CHECK(cudaMallocHost(&g->h_step, sizeof(Step)));
    CUDA_CHECK(cudaMallocHost(&g->h_ids, T * sizeof(int)));
    if (E) {
        CUDA_CHECK(cudaMallocHost(&g->h_start, (E + 1) * sizeof(int)));
        CUDA_CHECK(cudaMallocHost(&g->h_gptr, 7 * (size_t)E * sizeof(void *)));
    }
    /* attention splits for one token: sliding layers see at most W keys, full layers up to ctx */
    g->decode_split[ATTN_FULL] = split_for(g, ctx, 1, 1);
    g->decode_split[ATTN_SLIDING] = split_for(g, c->sliding_window, 1, 1);
    size_t dyn = (size_t)(QD > hid ? (QD > H ? QD : H) : (hid > H ? hid : H)) * 4;
    if (dyn > 48 * 1024) {
        CUDA_CHECK(cudaFuncSetAttribute(matvec_kernel<bf16, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)dyn));
        CUDA_CHECK(cudaFuncSetAttribute(matvec_kernel<bf16, 4>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)dyn));
        CUDA_CHECK(cudaFuncSetAttribute(matvec_kernel<float, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)dyn));
        CUDA_CHECK(cudaFuncSetAttribute(matvec_kernel<float, 4>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)dyn));
    }
    if (g->use_graph && !c->block_size) capture_decode(g);    /* captured once here; replayed at every position */
    CUDA_CHECK(cudaDeviceSynchronize());
    size_t fr, tot;
    CUDA_CHECK(cudaMemGetInfo(&fr, &tot));
    snprintf(g->summary, sizeof g->summary, "weights %.2f GiB (%s), KV cache %.2f GiB (%d positions), "
             "activations %.2f GiB, GPU memory in use %.1f of %.1f GiB",
             g->wbytes / 1073741824.0, g->bf ? "bf16" : "f32", g->kvbytes / 1073741824.0, ctx,
             g->actbytes / 1073741824.0, (tot - fr) / 1073741824.0, tot / 1073741824.0);
    return g;
}

extern "C" const char *gpu_summary(GpuModel *g) { return g->summary; }

extern "C" void gpu_free(GpuModel *g) {
    if (!g) return;
    if (g->graph) cudaGraphExecDestroy(g->graph);
    if (g->blas) cublasDestroy(g->blas);
    void *dev[] = {g->wbuf, g->kvbuf, g->x, g->xb, g->qkvg, g->att, g->mlp_h, g->mlp_act, g->act16, g->logits,
                   g->part_o, g->part_ml, g->tokens, g->pos, g->d_step, g->router_logits, g->topk_idx, g->topk_w,
                   g->pair_w, g->pair_tok, g->inv, g->start, g->active, g->n_active, g->h_pair, g->hs, g->y_pair,
                   g->ys, g->x_sorted, g->act_sorted, g->gptr, g->ids, g->taps, g->cat, g->ctxv};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) if (dev[i]) cudaFree(dev[i]);
    void *host[] = {g->h_tokens, g->h_logits, g->h_step, g->h_start, g->h_gptr, g->h_ids};
    for (size_t i = 0; i < sizeof host / sizeof host[0]; i++) if (host[i]) cudaFreeHost(host[i]);
    if (g->stream) cudaStreamDestroy(g->stream);
    free(g);
}

/* ----------------------------------------------------------------------------
 * the forward pass, in model order (same steps as forward() in laguna.c) */

/* y[n, out] = beta * y + x[n, in] . W[out, in]^T  (cuBLAS; bf16 weights take a bf16 copy of x) */
static void gemm(GpuModel *g, float *y, int ldy, const void *W, int out, int in, const float *x, int n, float beta) {
    const float one = 1.0f;
    const void *xin = x;
    if (g->bf) {
        convert<float, bf16><<<grid_for((size_t)n * in, 256), 256, 0, g->stream>>>((bf16 *)g->act16, x, (size_t)n * in);
        LAUNCH_CHECK();
        xin = g->act16;
    }
    CUBLAS_CHECK(cublasGemmEx(g->blas, CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, &one, W, dtype_of(g), in, xin,
                              dtype_of(g), in, &beta, y, CUDA_R_32F, ldy, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

template <typename W>
static void matvec(GpuModel *g, float *out, const void *w, int rows, int in, const float *x, const float *norm_w,
                   float *xb_out, const float *bias, int accumulate) {
    size_t smem = (size_t)in * 4;
    if (rows >= 8192) {
        matvec_kernel<W, 4><<<(rows + 31) / 32, 256, smem, g->stream>>>(out, (const W *)w, rows, in, x, norm_w,
                                                                        g->c.norm_eps, xb_out, bias, accumulate);
    } else {
        matvec_kernel<W, 1><<<(rows + 7) / 8, 256, smem, g->stream>>>(out, (const W *)w, rows, in, x, norm_w,
                                                                      g->c.norm_eps, xb_out, bias, accumulate);
    }
    LAUNCH_CHECK();
}

static void attention(GpuModel *g, int l, int n, int pos) {
    const Config *c = &g->c;
    GpuLayer *L = &g->L[l];
    int D = c->head_dim, nkv = c->n_kv_heads, gq = L->nh / nkv, sliding = c->layer_type[l] == ATTN_SLIDING;
    int window = sliding ? c->sliding_window : 0;
    float scale_log2 = 1.4426950408889634f / sqrtf((float)D);
    const int *pos_ptr = g->pos;
    int nsplit = 1;
    if (!g->kv_bf) {
        attention_scalar<float><<<dim3(n, L->nh), 32, 0, g->stream>>>(g->qkvg, L->NQ, n, gq, L->nh, D,
            (const float *)L->kc, (const float *)L->vc, L->rows, c->kv_dim, pos_ptr, window, c->causal, g->part_o, g->part_ml,
            scale_log2);
    } else if (g->attn_scalar) {
        attention_scalar<bf16><<<dim3(n, L->nh), 32, 0, g->stream>>>(g->qkvg, L->NQ, n, gq, L->nh, D,
            (const bf16 *)L->kc, (const bf16 *)L->vc, L->rows, c->kv_dim, pos_ptr, window, c->causal, g->part_o, g->part_ml,
            scale_log2);
    } else {
        int warps = n * gq <= 16 ? 1 : 4, rb = (n * gq + 16 * warps - 1) / (16 * warps);
        if (n == 1) nsplit = g->decode_split[c->layer_type[l]];
        else nsplit = split_for(g, sliding ? window + n - 1 : pos + n, rb, n);
        dim3 grid(rb, nkv, nsplit);
#define FLASH(DD, WW) attention_flash<DD, WW><<<grid, WW * 32, 0, g->stream>>>(g->qkvg, L->NQ, n, gq, L->nh, \
        (const bf16 *)L->kc, (const bf16 *)L->vc, L->rows, c->kv_dim, pos_ptr, window, c->causal, nsplit, g->part_o, g->part_ml, \
        scale_log2)
        if (warps == 1) { switch (D) { case 16: FLASH(16, 1); break; case 32: FLASH(32, 1); break; case 64: FLASH(64, 1); break; default: FLASH(128, 1); } }
        else { switch (D) { case 16: FLASH(16, 4); break; case 32: FLASH(32, 4); break; case 64: FLASH(64, 4); break; default: FLASH(128, 4); } }
#undef FLASH
    }
    LAUNCH_CHECK();
    attention_combine<<<n * L->nh, D < 32 ? 32 : D, 0, g->stream>>>(g->att, g->part_o, g->part_ml, nsplit, L->nh, D,
        g->qkvg, L->NQ, c->gated ? L->nh * D + 2 * c->kv_dim : -1, c->gate_per_head);
    LAUNCH_CHECK();
}

template <typename W>
static void mlp_decode(GpuModel *g, int l) {
    const Config *c = &g->c;
    GpuLayer *L = &g->L[l];
    int H = c->dim, I = c->moe_hidden_dim, K = c->n_experts_active;
    if (L->dense) {
        rmsnorm_kernel<<<1, 256, 0, g->stream>>>(g->xb, g->x, H, L->ffn_norm, H, c->norm_eps);
        LAUNCH_CHECK();
        moe_gate_up<W><<<(L->hid + 7) / 8, 256, 0, g->stream>>>(NULL, 0, (const W *)L->gate_up, L->hid, H, g->xb, 1,
            NULL, NULL, NULL, NULL, 0, NULL, g->mlp_act);
        LAUNCH_CHECK();
        moe_down_decode<W><<<(H + 7) / 8, 256, 0, g->stream>>>(g->x, NULL, 0, (const W *)L->down, L->hid, H, NULL, NULL,
            NULL, NULL, NULL, g->mlp_act, 0.0f);
        LAUNCH_CHECK();
        return;
    }
    /* route: router logits from the normed x (the norm is folded into the matvec, which also leaves xb) */
    matvec<W>(g, g->router_logits, L->router, c->n_experts, H, g->x, L->ffn_norm, g->xb, NULL, 0);
    route_plan<<<1, 256, 2 * c->n_experts * sizeof(int), g->stream>>>(g->router_logits, L->expert_bias, 1, c->n_experts,
        K, c->router_softcap, g->topk_idx, g->topk_w, g->start, g->pair_tok, g->pair_w, g->inv, g->active, g->n_active);
    LAUNCH_CHECK();
    int nbI = (I + 7) / 8;
    moe_gate_up<W><<<K * nbI + (L->hid + 7) / 8, 256, 0, g->stream>>>((const W *)L->experts_gate_up, I,
        (const W *)L->gate_up, L->hid, H, g->xb, 1, g->start, g->pair_tok, g->active, g->n_active, K, g->h_pair, g->hs);
    LAUNCH_CHECK();
    moe_down_decode<W><<<(H + 7) / 8, 256, 0, g->stream>>>(g->x, (const W *)L->experts_down, I, (const W *)L->down,
        L->hid, H, g->active, g->n_active, g->start, g->pair_w, g->h_pair, g->hs, c->routed_scaling);
    LAUNCH_CHECK();
}

/* the MoE of n > 1 tokens, grouped by expert */
template <typename W>
static void moe_many(GpuModel *g, int l, int n) {
    const Config *c = &g->c;
    GpuLayer *L = &g->L[l];
    int H = c->dim, I = c->moe_hidden_dim, S = L->hid, E = c->n_experts, K = c->n_experts_active, P = n * K;
    gemm(g, g->router_logits, E, L->router, E, H, g->xb, n, 0.0f);
    route_plan<<<1, 1024, 2 * E * sizeof(int), g->stream>>>(g->router_logits, L->expert_bias, n, E, K, c->router_softcap,
        g->topk_idx, g->topk_w, g->start, g->pair_tok, g->pair_w, g->inv, g->active, g->n_active);
    LAUNCH_CHECK();
    int max_active = P < E ? P : E;
    if (P <= 512) {
        /* a few tokens (verification): one launch over the active experts' rows, each read once */
        moe_gate_up<W><<<max_active * ((I + 7) / 8) + (S + 7) / 8, 256, 0, g->stream>>>((const W *)L->experts_gate_up, I,
            (const W *)L->gate_up, S, H, g->xb, n, g->start, g->pair_tok, g->active, g->n_active, max_active, g->h_pair, g->hs);
        LAUNCH_CHECK();
        moe_down<W><<<max_active * ((H + 7) / 8) + (H + 7) / 8, 256, 0, g->stream>>>((const W *)L->experts_down, I,
            (const W *)L->down, S, H, n, g->start, g->active, g->n_active, max_active, g->h_pair, g->hs, g->y_pair, g->ys);
        LAUNCH_CHECK();
    } else {
        /* many tokens (prefill): one batched cuBLAS GEMM over the active experts for gate/up and one for down,
         * each expert's token count padded to the largest (cuBLAS' grouped GEMM does not take bf16 -> f32 here).
         * The counts come to the host: one small copy and a sync per layer. Padding rows read neighbouring
         * experts' inputs and write padding outputs that nothing reads. */
        gather_rows<W><<<P, 256, 0, g->stream>>>((W *)g->x_sorted, g->xb, g->pair_tok, H);
        LAUNCH_CHECK();
        CUDA_CHECK(cudaMemcpyAsync(g->h_start, g->start, (E + 1) * sizeof(int), cudaMemcpyDeviceToHost, g->stream));
        CUDA_CHECK(cudaStreamSynchronize(g->stream));
        int na = 0, maxc = 0;
        for (int e = 0; e < E; e++) {
            int cnt = g->h_start[e + 1] - g->h_start[e];
            if (cnt > maxc) maxc = cnt;
            na += cnt > 0;
        }
        size_t es = dsize(g);
        void **hp = g->h_gptr;
        int *rank = (int *)(hp + 6 * (size_t)E);          /* expert -> its slot among the active ones */
        int a = 0;
        for (int e = 0; e < E; e++) {
            int cnt = g->h_start[e + 1] - g->h_start[e], s0 = g->h_start[e];
            rank[e] = a;
            if (!cnt) continue;
            hp[0 * E + a] = (char *)L->experts_gate_up + (size_t)e * 2 * I * H * es;
            hp[1 * E + a] = (char *)g->x_sorted + (size_t)s0 * H * es;
            hp[2 * E + a] = g->h_pair + (size_t)a * maxc * 2 * I;
            hp[3 * E + a] = (char *)L->experts_down + (size_t)e * H * I * es;
            hp[4 * E + a] = (char *)g->act_sorted + (size_t)a * maxc * I * es;
            hp[5 * E + a] = g->y_pair + (size_t)a * maxc * H;
            a++;
        }
        const float one = 1.0f, zero = 0.0f;
        cudaDataType_t dt = dtype_of(g);
        if ((size_t)na * maxc <= 2 * (size_t)P) {
            CUDA_CHECK(cudaMemcpyAsync(g->gptr, hp, (6 * (size_t)E) * sizeof(void *) + E * sizeof(int), cudaMemcpyHostToDevice, g->stream));
            void **dp = g->gptr;
            CUBLAS_CHECK(cublasGemmBatchedEx(g->blas, CUBLAS_OP_T, CUBLAS_OP_N, 2 * I, maxc, H, &one, (const void *const *)dp, dt, H,
                                             (const void *const *)(dp + E), dt, H, &zero, (void *const *)(dp + 2 * E), CUDA_R_32F,
                                             2 * I, na, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
            swiglu_kernel<W><<<grid_for((size_t)na * maxc * I, 256), 256, 0, g->stream>>>((W *)g->act_sorted, g->h_pair, (size_t)na * maxc, I);
            LAUNCH_CHECK();
            CUBLAS_CHECK(cublasGemmBatchedEx(g->blas, CUBLAS_OP_T, CUBLAS_OP_N, H, maxc, I, &one, (const void *const *)(dp + 3 * E), dt, I,
                                             (const void *const *)(dp + 4 * E), dt, I, &zero, (void *const *)(dp + 5 * E), CUDA_R_32F,
                                             H, na, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
            /* where each (token, slot) pair's output now lives: slot rank[e] * maxc + its row within the expert */
            remap_pairs<<<(P + 255) / 256, 256, 0, g->stream>>>(g->inv, g->topk_idx, g->start, (const int *)(dp + 6 * (size_t)E), maxc, P);
            LAUNCH_CHECK();
        } else {
            /* routing too uneven to pad: one GEMM per active expert, outputs in sorted-pair order */
            for (int e = 0; e < E; e++) {
                int cnt = g->h_start[e + 1] - g->h_start[e], s0 = g->h_start[e];
                if (!cnt) continue;
                CUBLAS_CHECK(cublasGemmEx(g->blas, CUBLAS_OP_T, CUBLAS_OP_N, 2 * I, cnt, H, &one,
                                          (char *)L->experts_gate_up + (size_t)e * 2 * I * H * es, dt, H,
                                          (char *)g->x_sorted + (size_t)s0 * H * es, dt, H, &zero, g->h_pair + (size_t)s0 * 2 * I,
                                          CUDA_R_32F, 2 * I, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
            }
            swiglu_kernel<W><<<grid_for((size_t)P * I, 256), 256, 0, g->stream>>>((W *)g->act_sorted, g->h_pair, P, I);
            LAUNCH_CHECK();
            for (int e = 0; e < E; e++) {
                int cnt = g->h_start[e + 1] - g->h_start[e], s0 = g->h_start[e];
                if (!cnt) continue;
                CUBLAS_CHECK(cublasGemmEx(g->blas, CUBLAS_OP_T, CUBLAS_OP_N, H, cnt, I, &one,
                                          (char *)L->experts_down + (size_t)e * H * I * es, dt, I,
                                          (char *)g->act_sorted + (size_t)s0 * I * es, dt, I, &zero, g->y_pair + (size_t)s0 * H,
                                          CUDA_R_32F, H, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
            }
        }
        /* the shared expert: plain GEMMs over all tokens */
        gemm(g, g->mlp_h, 2 * S, L->gate_up, 2 * S, H, g->xb, n, 0.0f);
        swiglu_kernel<float><<<grid_for((size_t)n * S, 256), 256, 0, g->stream>>>(g->mlp_act, g->mlp_h, n, S);
        LAUNCH_CHECK();
        gemm(g, g->ys, H, L->down, H, S, g->mlp_act, n, 0.0f);
    }
    moe_combine<<<n, 256, 0, g->stream>>>(g->x, g->y_pair, g->ys, g->inv, g->topk_idx, g->topk_w, K, H, c->routed_scaling);
    LAUNCH_CHECK();
}

/* forward over n tokens already in g->tokens at the position in g->pos (pos: the same, on the host) */
template <typename W>
static void forward_gpu(GpuModel *g, int n, int pos, int all_logits) {
    const Config *c = &g->c;
    int H = c->dim, D = c->head_dim, V = c->vocab_size;
    embed_kernel<W><<<n, 256, 0, g->stream>>>(g->x, (const W *)g->embed, g->tokens, H);
    LAUNCH_CHECK();
    for (int l = 0; l < c->n_layers; l++) {
        GpuLayer *L = &g->L[l];
        int type = c->layer_type[l], QD = L->nh * D;
        /* ---- attention block ---- */
        if (n == 1) {
            matvec<W>(g, g->qkvg, L->wqkvg, L->NQ, H, g->x, L->attn_norm, NULL, L->bqkvg, 0);
        } else {
            rmsnorm_kernel<<<n, 256, 0, g->stream>>>(g->xb, g->x, H, L->attn_norm, H, c->norm_eps);
            LAUNCH_CHECK();
            gemm(g, g->qkvg, L->NQ, L->wqkvg, L->NQ, H, g->xb, n, 0.0f);
            if (L->bqkvg) {
                add_bias_kernel<<<grid_for((size_t)n * L->NQ, 256), 256, 0, g->stream>>>(g->qkvg, L->bqkvg, n, L->NQ);
                LAUNCH_CHECK();
            }
        }
        dim3 rg(n, (L->nh + 2 * c->n_kv_heads + 3) / 4);
        if (g->kv_bf)
            qk_norm_rope_kernel<bf16><<<rg, 128, 0, g->stream>>>(g->qkvg, L->NQ, L->nh, c->n_kv_heads, D, L->q_norm,
                L->k_norm, g->inv_freq[type], c->rotary_dim[type], c->rope_scaling[type], (bf16 *)L->kc, (bf16 *)L->vc,
                L->rows, g->pos, c->norm_eps);
        else
            qk_norm_rope_kernel<float><<<rg, 128, 0, g->stream>>>(g->qkvg, L->NQ, L->nh, c->n_kv_heads, D, L->q_norm,
                L->k_norm, g->inv_freq[type], c->rotary_dim[type], c->rope_scaling[type], (float *)L->kc, (float *)L->vc,
                L->rows, g->pos, c->norm_eps);
        LAUNCH_CHECK();
        attention(g, l, n, pos);
        /* o_proj straight into the residual stream */
        if (n == 1) matvec<W>(g, g->x, L->wo, H, QD, g->att, NULL, NULL, L->bo, 1);
        else {
            gemm(g, g->x, H, L->wo, H, QD, g->att, n, 1.0f);
            if (L->bo) { add_bias_kernel<<<grid_for((size_t)n * H, 256), 256, 0, g->stream>>>(g->x, L->bo, n, H); LAUNCH_CHECK(); }
        }
        /* ---- MLP block: dense SwiGLU or MoE ---- */
        if (n == 1) { mlp_decode<W>(g, l); capture_taps(g, l, n); continue; }
        rmsnorm_kernel<<<n, 256, 0, g->stream>>>(g->xb, g->x, H, L->ffn_norm, H, c->norm_eps);
        LAUNCH_CHECK();
        if (L->dense) {
            gemm(g, g->mlp_h, 2 * L->hid, L->gate_up, 2 * L->hid, H, g->xb, n, 0.0f);
            swiglu_kernel<float><<<grid_for((size_t)n * L->hid, 256), 256, 0, g->stream>>>(g->mlp_act, g->mlp_h, n, L->hid);
            LAUNCH_CHECK();
            gemm(g, g->x, H, L->down, H, L->hid, g->mlp_act, n, 1.0f);
        } else {
            moe_many<W>(g, l, n);
        }
        capture_taps(g, l, n);
    }
    /* final norm and lm_head (every row, or the last) */
    int rows = all_logits ? n : 1, first = all_logits ? 0 : n - 1;
    rmsnorm_kernel<<<rows, 256, 0, g->stream>>>(g->xb, g->x + (size_t)first * H, H, g->final_norm, H, c->norm_eps);
    LAUNCH_CHECK();
    if (rows == 1) matvec<W>(g, g->logits, g->lm_head, V, H, g->xb, NULL, NULL, NULL, 0);
    else gemm(g, g->logits, V, g->lm_head, V, H, g->xb, rows, 0.0f);
}

static void forward_any(GpuModel *g, int n, int pos, int all_logits) {
    if (g->bf) forward_gpu<bf16>(g, n, pos, all_logits);
    else forward_gpu<float>(g, n, pos, all_logits);
}

/* upload the tokens and the position, then enqueue the forward (the caller downloads what it needs and syncs) */
static void enqueue_forward(GpuModel *g, const int *tokens, int n, int pos, int all_logits) {
    if (n < 1 || n > g->T || pos < 0 || pos + n > g->ctx) {
        fprintf(stderr, "laguna: error: gpu_forward of %d tokens at %d (chunk %d, context %d)\n", n, pos, g->T, g->ctx);
        exit(1);
    }
    memcpy(g->h_tokens, tokens, n * sizeof(int));
    g->h_step->pos = pos;
    CUDA_CHECK(cudaMemcpyAsync(g->tokens, g->h_tokens, n * sizeof(int), cudaMemcpyHostToDevice, g->stream));
    CUDA_CHECK(cudaMemcpyAsync(g->pos, &g->h_step->pos, sizeof(int), cudaMemcpyHostToDevice, g->stream));
    forward_any(g, n, pos, all_logits);
}

extern "C" float *gpu_forward(GpuModel *g, const int *tokens, int n, int pos, int all_logits) {
    enqueue_forward(g, tokens, n, pos, all_logits);
    size_t count = (size_t)(all_logits ? n : 1) * g->c.vocab_size;
    CUDA_CHECK(cudaMemcpyAsync(g->h_logits, g->logits, count * sizeof(float), cudaMemcpyDeviceToHost, g->stream));
    CUDA_CHECK(cudaStreamSynchronize(g->stream));
    return g->h_logits;
}

/* One decode step: forward `token` at `pos` and sample the next token on the device. The whole step (the
 * parameters' upload, ~370 kernels, the sampler, the token's download) is one CUDA graph, captured on the first
 * call; the token and position live in device memory, so the same graph serves every position. A graph rather
 * than a persistent kernel: the kernels stay small and separately testable, and replay removes the launch gaps. */
static void enqueue_decode(GpuModel *g) {
    CUDA_CHECK(cudaMemcpyAsync(g->d_step, g->h_step, sizeof(Step), cudaMemcpyHostToDevice, g->stream));
    CUDA_CHECK(cudaMemcpyAsync(g->tokens, &g->d_step->token, sizeof(int), cudaMemcpyDeviceToDevice, g->stream));
    CUDA_CHECK(cudaMemcpyAsync(g->pos, &g->d_step->pos, sizeof(int), cudaMemcpyDeviceToDevice, g->stream));
    forward_any(g, 1, 0, 0);
    sample_kernel<<<1, 1024, 0, g->stream>>>(g->logits, g->c.vocab_size, g->d_step);
    LAUNCH_CHECK();
    CUDA_CHECK(cudaMemcpyAsync(&g->h_step->out, &g->d_step->out, sizeof(int), cudaMemcpyDeviceToHost, g->stream));
}

static void capture_decode(GpuModel *g) {
    cudaGraph_t graph;
    CUDA_CHECK(cudaStreamBeginCapture(g->stream, cudaStreamCaptureModeThreadLocal));
    enqueue_decode(g);
    CUDA_CHECK(cudaStreamEndCapture(g->stream, &graph));
    CUDA_CHECK(cudaGraphInstantiate(&g->graph, graph, 0));
    CUDA_CHECK(cudaGraphDestroy(graph));
}

extern "C" int gpu_decode_step(GpuModel *g, int token, int pos, float temperature, float topp, float coin) {
    if (pos < 0 || pos >= g->ctx) { fprintf(stderr, "laguna: error: decode at %d past the context %d\n", pos, g->ctx); exit(1); }
    Step *s = g->h_step;
    s->token = token; s->pos = pos; s->temperature = temperature; s->topp = topp; s->coin = coin; s->out = -1;
    if (g->graph) CUDA_CHECK(cudaGraphLaunch(g->graph, g->stream));
    else enqueue_decode(g);
    CUDA_CHECK(cudaStreamSynchronize(g->stream));
    return s->out;
}

/* ----------------------------------------------------------------------------
 * DFlash on the GPU: the same steps as the DFlash section of laguna.c, which drives them.
 *
 * The target captures its residual stream after the tap layers for every row it runs (capture_taps in
 * forward_gpu) into a device buffer. The drafter is a second GpuModel made by gpu_init from the drafter file:
 * its layers, a ring KV cache of W + block - 1 rows per layer (the CPU's), the context fusion weights, and the
 * target's embedding and lm_head (pointers, not copies). Its block forward is forward_gpu itself, as on the CPU
 * draft_block is forward(): with the block's K/V written into the ring at P..P+B-1, causal sliding-window
 * attention over the ring is exactly the drafter's attention (context keys, then the block causally). The
 * context add reads the taps on the device, so per verify step only token ids cross to the host (greedy).
 * The drafter runs on its own stream; every call here ends with a sync, so the target's next forward never
 * overwrites taps the drafter still reads. */

/* out[r] = w[r % n_w] * rmsnorm(x[r]) over rows of H: the per-tap norms (aux_hidden_norms) of taps [n, n_w, H];
 * one block per row */
__global__ void rmsnorm_groups_kernel(float *out, const float *x, const float *w, int n_w, int H, float eps) {
    size_t r = blockIdx.x;
    const float *xr = x + r * H, *wr = w + (size_t)(r % n_w) * H;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss);
    float inv = 1.0f / sqrtf(ss / H + eps);
    for (int i = threadIdx.x; i < H; i += blockDim.x) out[r * H + i] = wr[i] * (xr[i] * inv);
}

/* out[t] = argmax of row t, the first index on ties (argmax() in laguna.c); one block per row */
__global__ void __launch_bounds__(1024) argmax_rows_kernel(const float *x, int V, int *out) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const float *row = x + (size_t)blockIdx.x * V;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float bv = -INFINITY;
    int bi = V;                                        /* V: no element seen */
    for (int i = threadIdx.x; i < V; i += blockDim.x)
        if (bi == V || row[i] > bv) { bv = row[i]; bi = i; }
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (oi < V && (bi == V || ov > bv || (ov == bv && oi < bi))) { bv = ov; bi = oi; }
    }
    if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); w++)
            if (si[w] < V && (si[0] == V || sv[w] > sv[0] || (sv[w] == sv[0] && si[w] < si[0]))) { sv[0] = sv[w]; si[0] = si[w]; }
        out[blockIdx.x] = si[0] < V ? si[0] : 0;
    }
}

/* the residual stream after layer l, every row, into taps[t, slot, :] (the last layer's is before the final norm) */
static void capture_taps(GpuModel *g, int l, int n) {
    if (!g->taps) return;
    size_t H = (size_t)g->c.dim, row = (size_t)g->n_taps * H;
    for (int i = 0; i < g->n_taps; i++)
        if (g->tap_layers[i] == l)
            CUDA_CHECK(cudaMemcpy2DAsync(g->taps + i * H, row * sizeof(float), g->x, H * sizeof(float), H * sizeof(float),
                                         (size_t)n, cudaMemcpyDeviceToDevice, g->stream));
}

/* A forward over n tokens whose logits stay on the device: only each row's argmax comes back (the greedy verify,
 * and the drafter's block). */
extern "C" void gpu_forward_argmax(GpuModel *g, const int *tokens, int n, int pos, int *out) {
    enqueue_forward(g, tokens, n, pos, 1);
    argmax_rows_kernel<<<n, 1024, 0, g->stream>>>(g->logits, g->c.vocab_size, g->ids);
    LAUNCH_CHECK();
    CUDA_CHECK(cudaMemcpyAsync(g->h_ids, g->ids, n * sizeof(int), cudaMemcpyDeviceToHost, g->stream));
    CUDA_CHECK(cudaStreamSynchronize(g->stream));
    memcpy(out, g->h_ids, n * sizeof(int));
}

/* the last forward's taps [n, n_taps, H] to the host (the --taps test hook) */
extern "C" void gpu_copy_taps(GpuModel *g, int n, float *dst) {
    CUDA_CHECK(cudaMemcpyAsync(dst, g->taps, (size_t)n * g->n_taps * g->c.dim * sizeof(float), cudaMemcpyDeviceToHost,
                               g->stream));
    CUDA_CHECK(cudaStreamSynchronize(g->stream));
}

/* The drafter on the device beside the target (dflash_init has checked that it fits the target); from now on the
 * target captures its taps. */
extern "C" GpuModel *gpu_drafter_init(GpuModel *target, const Model *dm, int ctx, int block, char *err, size_t errsz) {
    const Config *c = &dm->config;
    GpuModel *g = gpu_init(dm, ctx, block, err, errsz);   /* dm's embed/lm_head are the target's: same dtype */
    if (!g) return NULL;
    if (g->bf != target->bf) GFAIL("the drafter's weight dtype does not follow the target's");
    g->embed = target->embed;
    g->lm_head = target->lm_head;
    size_t H = (size_t)c->dim, NT = (size_t)c->n_taps;
    void *cat = NULL, *ctxv = NULL, *taps = NULL;
    if (cudaMalloc(&cat, (size_t)block * NT * H * sizeof(float)) != cudaSuccess ||
        cudaMalloc(&ctxv, (size_t)block * H * sizeof(float)) != cudaSuccess ||
        cudaMalloc(&taps, (size_t)target->T * NT * H * sizeof(float)) != cudaSuccess) {
        cudaGetLastError();
        if (cat) cudaFree(cat);
        if (ctxv) cudaFree(ctxv);
        GFAIL("out of GPU memory for the DFlash buffers (taps of %d rows)\n  hint: lower --chunk", target->T);
    }
    g->cat = (float *)cat;
    g->ctxv = (float *)ctxv;
    if (target->taps) CUDA_CHECK(cudaFree(target->taps));
    target->taps = (float *)taps;
    target->n_taps = c->n_taps;
    memcpy(target->tap_layers, c->tap_layers, NT * sizeof(int));
    return g;
}

/* Drafter context from rows row0..row0+n-1 of the target's last forward, at positions pos..pos+n-1 (laguna.c's
 * drafter_add_context): per-tap RMSNorm, fc, hidden_norm; then per layer input_layernorm -> K (k_norm, RoPE at
 * the absolute position), V, into the ring. In chunks of the drafter's T rows, like the CPU. */
extern "C" void gpu_drafter_add_context(GpuModel *g, GpuModel *target, int row0, int n, int pos) {
    const Config *c = &g->c;
    int H = c->dim, NT = c->n_taps, D = c->head_dim, nkv = c->n_kv_heads, KVD = c->kv_dim;
    if (row0 < 0 || n < 0 || row0 + n > target->T || pos < 0 || pos + n > g->ctx) {
        fprintf(stderr, "laguna: error: drafter context of %d rows from %d at %d (chunk %d, context %d)\n", n, row0, pos,
                target->T, g->ctx);
        exit(1);
    }
    for (int r0 = 0; r0 < n; r0 += g->T) {
        int k = n - r0 < g->T ? n - r0 : g->T;
        g->h_step->pos = pos + r0;
        CUDA_CHECK(cudaMemcpyAsync(g->pos, &g->h_step->pos, sizeof(int), cudaMemcpyHostToDevice, g->stream));
        /* the fused context vector of each position */
        rmsnorm_groups_kernel<<<k * NT, 256, 0, g->stream>>>(g->cat, target->taps + (size_t)(row0 + r0) * NT * H,
                                                             g->aux_norm, NT, H, c->norm_eps);
        LAUNCH_CHECK();
        gemm(g, g->ctxv, H, g->fc, H, NT * H, g->cat, k, 0.0f);
        rmsnorm_kernel<<<k, 256, 0, g->stream>>>(g->ctxv, g->ctxv, H, g->hidden_norm, H, c->norm_eps);
        LAUNCH_CHECK();
        for (int l = 0; l < c->n_layers; l++) {
            GpuLayer *L = &g->L[l];
            int type = c->layer_type[l], QD = L->nh * D;
            /* the layer's input norm, then only the k and v rows of the stacked projection, into their columns of qkvg */
            rmsnorm_kernel<<<k, 256, 0, g->stream>>>(g->xb, g->ctxv, H, L->attn_norm, H, c->norm_eps);
            LAUNCH_CHECK();
            gemm(g, g->qkvg + QD, L->NQ, (const char *)L->wqkvg + (size_t)QD * H * dsize(g), 2 * KVD, H, g->xb, k, 0.0f);
            /* k_norm, RoPE at the absolute positions and the ring append: the q/k-norm kernel with no query heads */
            dim3 rg(k, (2 * nkv + 3) / 4);
            if (g->kv_bf)
                qk_norm_rope_kernel<bf16><<<rg, 128, 0, g->stream>>>(g->qkvg + QD, L->NQ, 0, nkv, D, L->q_norm, L->k_norm,
                    g->inv_freq[type], c->rotary_dim[type], c->rope_scaling[type], (bf16 *)L->kc, (bf16 *)L->vc, L->rows,
                    g->pos, c->norm_eps);
            else
                qk_norm_rope_kernel<float><<<rg, 128, 0, g->stream>>>(g->qkvg + QD, L->NQ, 0, nkv, D, L->q_norm, L->k_norm,
                    g->inv_freq[type], c->rotary_dim[type], c->rope_scaling[type], (float *)L->kc, (float *)L->vc, L->rows,
                    g->pos, c->norm_eps);
            LAUNCH_CHECK();
        }
        /* h_step->pos is rewritten for the next chunk, and the target's next forward rewrites the taps */
        CUDA_CHECK(cudaStreamSynchronize(g->stream));
    }
}
