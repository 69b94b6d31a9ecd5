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
 * tiny f32 fixtures run entirely in fp32 so their bar stays tight); --kv f32 / fp8 choose the cache's type (fp8:
 * OCP e4m3, scale 1, the values the CPU rounds to with --kv fp8). Accumulation and the residual stream are
 * fp32 everywhere. cuBLAS GEMMs on bf16 weights take bf16 activations (rounded from fp32).
 *
 * Two paths through the same steps:
 *   n == 1 (decode): hand-written matvecs that read each weight once with 16-byte loads (q/k/v/g fused into one
 *     matrix, the RMSNorm folded into the matvec, the 8 routed experts + shared expert as one launch each for
 *     gate/up and for down), replayed as one CUDA graph with the position in device memory.
 *   n > 1 (prefill chunks, verification): cuBLAS GEMMs, a tensor-core flash attention, and the MoE grouped by
 *     expert (a few tokens: one launch over the active experts; many tokens: a tensor-core grouped GEMM per
 *     projection for bf16 files, padded batched cuBLAS for the f32 fixtures).
 * dev/gpu_notes.md has the measurements behind these choices. */
#include <cooperative_groups.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <type_traits>

extern "C" {
#include "laguna.h"
}

typedef __nv_bfloat16 bf16;
typedef __nv_fp8_e4m3 fp8;   /* the --kv fp8 cache's element: OCP e4m3, fp8_e4m3_bits() in laguna.h on the host */

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

/* ---- the decode-step trace: only with -DLAGUNA_TRACE (make dev/bench_gpu_trace; dev/trace_summary.py) ----
 * TRACE_BLOCK(); as a kernel's first statement records, for each of its blocks, when it started, when its
 * griddep_wait() returned and when its last thread left: %globaltimer (ns, one clock for the whole GPU) and, in case
 * that timer is coarse, clock64() (cycles of the block's SM). Thread 0 notes the start and takes a record slot (the
 * atomic's result is first needed at the end); griddep_wait() notes its return in thread 0; at exit (a destructor:
 * every return path) each group of threads leaving together counts itself, and the group that completes the count
 * writes the record, so the end is the block's last thread. Costs: a barrier at the start, a global atomic, a shared
 * atomic per warp and a record store at the end. Tracing is on while trace_next < TRACE_CAP (gpu_decode_trace sets
 * it to 0 for one step); records past the buffer are dropped. Without LAGUNA_TRACE both macros are empty. */
#ifdef LAGUNA_TRACE
struct TraceRec {
    uint64_t gridid;                  /* %gridid: the launch (dev/trace_summary.py groups blocks by it) */
    uint32_t block, smid;             /* the linear block index, the SM it ran on */
    uint64_t t_start, t_wait, t_end;  /* %globaltimer, ns; t_wait 0: the block left before any griddep_wait() */
    uint64_t clk_start;               /* clock64() at the start (per SM: for aligning SMs' clocks) */
    uint32_t cyc_wait, cyc_end;       /* clock64() cycles start -> wait return, wait return (or start) -> end */
    uint32_t mark[6];                 /* TRACE_MARK(i) in thread 0: ns after t_start (0: not reached) */
};
constexpr unsigned TRACE_CAP = 1u << 20, TRACE_OFF = 1u << 31;
__device__ int trace_mode = 0;                      /* LAGUNA_TRACE_MODE: which set of marks (TRACE_MARK_IF) */
__device__ TraceRec trace_buf[TRACE_CAP];
__device__ unsigned trace_next = TRACE_OFF;        /* the next record; >= TRACE_CAP: off */
struct TraceShared { uint64_t t_start, t_wait, c_start, c_wait, mark[6]; unsigned slot, done; int mode; };
__shared__ TraceShared trace_sh;                    /* one per block, in every kernel that uses it */
__device__ __forceinline__ uint64_t trace_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ bool trace_thread0() { return threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0; }
struct TraceBlock {
    unsigned slot = TRACE_CAP;                      /* thread 0: this block's record */
    __device__ TraceBlock() {
        if (trace_thread0()) {
            trace_sh.t_start = trace_ns();
            trace_sh.c_start = clock64();
            trace_sh.t_wait = 0;
            trace_sh.done = 0;
            trace_sh.mode = trace_mode;
            for (int i = 0; i < 6; i++) trace_sh.mark[i] = 0;
        }
        __syncthreads();                            /* done = 0 before any thread can leave */
        /* = atomicAdd(&trace_next, 1), but ptxas does not warp-aggregate it: the aggregation's shuffle would wait
         * for the result here */
        if (trace_thread0()) slot = atomicInc(&trace_next, ~1u);
    }
    __device__ ~TraceBlock() {
        if (trace_thread0()) {
            trace_sh.slot = slot;
            __threadfence_block();                  /* slot and t_wait before thread 0 counts itself */
        }
        cooperative_groups::coalesced_group left = cooperative_groups::coalesced_threads();
        if (left.thread_rank() != 0) return;
        unsigned n = left.size(), all = blockDim.x * blockDim.y * blockDim.z;
        if (atomicAdd(&trace_sh.done, n) + n != all) return;
        __threadfence_block();                      /* the last to leave: thread 0's notes are visible */
        uint64_t t_end = trace_ns(), c_end = clock64();
        const TraceShared &s = trace_sh;
        if (s.slot >= TRACE_CAP) return;
        TraceRec r;
        asm volatile("mov.u64 %0, %%gridid;" : "=l"(r.gridid));
        asm volatile("mov.u32 %0, %%smid;" : "=r"(r.smid));
        r.block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
        r.t_start = s.t_start;
        r.t_wait = s.t_wait;
        r.t_end = t_end;
        r.clk_start = s.c_start;
        uint64_t c_wait = s.t_wait ? s.c_wait : s.c_start;
        r.cyc_wait = (uint32_t)(c_wait - s.c_start);
        r.cyc_end = (uint32_t)(c_end - c_wait);
        for (int i = 0; i < 6; i++) r.mark[i] = s.mark[i] ? (uint32_t)(s.mark[i] - s.t_start) : 0;
        trace_buf[s.slot] = r;
    }
};
__device__ __forceinline__ void trace_waited() {
    if (trace_thread0()) { trace_sh.t_wait = trace_ns(); trace_sh.c_wait = clock64(); }
}
#define TRACE_BLOCK() TraceBlock trace_block_
#define TRACE_WAITED() trace_waited()
#define TRACE_MARK(i) do { if (trace_thread0()) trace_sh.mark[i] = trace_ns(); } while (0)   /* a step inside a kernel */
/* LAGUNA_TRACE_MODE=m (gpu_decode_trace): kernels with other sets of marks record those of set m (0 by default; read
 * once a block, into its shared notes). A mark meant to time a load's arrival sits behind a test of the loaded value
 * (`if (v != 1.2345e-30f)`), which makes thread 0 wait for it; without LAGUNA_TRACE the test has no body and goes. */
#define TRACE_MARK_IF(m, i) do { if (trace_thread0() && trace_sh.mode == (m)) trace_sh.mark[i] = trace_ns(); } while (0)
#else
#define TRACE_BLOCK() do { } while (0)
#define TRACE_WAITED() do { } while (0)
#define TRACE_MARK(i) do { } while (0)
#define TRACE_MARK_IF(m, i) do { } while (0)
#endif

/* Programmatic dependent launch (sm_90). The decode kernels are launched with it (see launch() below): a kernel
 * may then start while the previous one in the stream is still running, and must call griddep_wait() before it
 * reads or writes anything an earlier kernel touches (weights it may load before: they never change). Once all of
 * a kernel's blocks have waited they call griddep_launch(), which lets the next kernel start its blocks and its
 * weight loads early. Without the launch attribute both are no-ops. */
__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    TRACE_WAITED();
}
__device__ __forceinline__ void griddep_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
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
__device__ __forceinline__ uint2 ld_stream8(const void *p) {   /* 8 bytes: 8 fp8 KV values */
    uint2 r;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
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
__device__ __forceinline__ float to_f(fp8 x) { return __half2float(__half(__nv_cvt_fp8_to_halfraw(x.__x, __NV_E4M3))); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f<bf16>(float x) { return __float2bfloat16(x); }
template <> __device__ __forceinline__ fp8 from_f<fp8>(float x) {   /* round to nearest even, saturate to +-448 */
    fp8 r;
    r.__x = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
    return r;
}
/* 4 e4m3 values (the bytes of w, lowest first) to floats: exact, through fp16 */
__device__ __forceinline__ void fp8x4_to_f32(uint32_t w, float f[4]) {
#pragma unroll
    for (int i = 0; i < 2; i++) {
        float2 v = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w >> 16 * i), __NV_E4M3)));
        f[2 * i] = v.x;
        f[2 * i + 1] = v.y;
    }
}

/* ---- weight formats ----
 * The weight kernels are templates over the format W of the rows they stream: bf16 or float (the file's dtype), or
 * Q8 / Q4 (quantized files: int8 or 4-bit values, one fp16 scale per group of 32 weights of a row). A matrix, or a
 * stack of expert matrices, travels as a WPtr: the values and, for Q8 / Q4, the scale plane, as in the file (rows
 * padded to whole groups). A lane's unit of work is a chunk of CH consecutive weights of a row, read with one
 * 16-byte load (f32: two): bf16 / f32 8 weights, Q8 16 (half a group), Q4 32 (one group), plus for Q8 / Q4 the
 * group's fp16 scale. wvals8 turns 8 weights of a chunk into floats in registers; chunk_dot multiplies a chunk's
 * partial dot product by its scale. The warp-per-row decode kernels (matvec_warp, moe_gate_up_decode) can work on RG
 * rows at once, so that each x value a lane loads serves RG rows; every format uses RG = 1: Q8 at 2 and Q4 at 4 rows
 * gave a quarter (Q4) or half (Q8) as many warps over the same bytes, and decode was slower (H200, XS-2.1 at 512:
 * q4 344.7 tok/s with RG 4, 360.5 with 2, 371.8 with 1; q8 371.0 with RG 2, 382.1 with 1; dev/gpu_notes.md). */
struct Q8 {};
struct Q4 {};
struct WPtr {
    const void *v;           /* the values: bf16 / f32 weights, or the q8 / q4 value plane */
    const uint16_t *s;       /* Q8 / Q4: fp16 scales [rows][groups]; NULL otherwise */
    WPtr() = default;
    __host__ __device__ WPtr(const void *v_, const uint16_t *s_ = NULL) : v(v_), s(s_) {}
};
struct QChunk { uint4 a; uint16_t s; };      /* 16 bytes of q8 / q4 values and their group's scale */
template <typename W> struct Fmt;
template <> struct Fmt<bf16> { typedef W8 Chunk; enum { DT = DT_BF16, CH = 8, RG = 1, GB = 0 }; };
template <> struct Fmt<float> { typedef W8 Chunk; enum { DT = DT_F32, CH = 8, RG = 1, GB = 0 }; };
template <> struct Fmt<Q8> { typedef QChunk Chunk; enum { DT = DT_Q8, CH = 16, RG = 1, GB = LAGUNA_QGROUP }; };
template <> struct Fmt<Q4> { typedef QChunk Chunk; enum { DT = DT_Q4, CH = 32, RG = 1, GB = LAGUNA_QGROUP / 2 }; };
template <typename W> constexpr bool is_q = Fmt<W>::GB != 0;    /* GB: value bytes per group */

/* row r of a matrix with rows of `in` weights */
template <typename W> __host__ __device__ __forceinline__ WPtr wrow(WPtr m, size_t r, int in) {
    if constexpr (!is_q<W>) return WPtr((const W *)m.v + r * in);
    else {
        size_t groups = (in + LAGUNA_QGROUP - 1) / LAGUNA_QGROUP;
        return WPtr((const char *)m.v + r * groups * Fmt<W>::GB, m.s + r * groups);
    }
}
/* the chunk of a row that starts at column k (a multiple of CH) */
template <typename W> __device__ __forceinline__ typename Fmt<W>::Chunk wload(WPtr row, int k) {
    if constexpr (!is_q<W>) return load_w8((const W *)row.v + k);
    else {
        QChunk c;
        c.a = ld_stream((const char *)row.v + (size_t)k * Fmt<W>::GB / LAGUNA_QGROUP);
        c.s = __ldg(row.s + k / LAGUNA_QGROUP);
        return c;
    }
}
/* weights 8b..8b+7 of a chunk as floats, before the scale. q8 / q4 values are small integers, made exactly with the
 * float trick (2^23 + n) - (2^23 + offset): the byte or nibble dropped into the mantissa, no int -> float conversion */
template <typename W> __device__ __forceinline__ void wvals8(const typename Fmt<W>::Chunk &c, int b, float f[8]) {
    if constexpr (!is_q<W>) { (void)b; unpack_w8(c, (const W *)NULL, f); }
    else if constexpr (Fmt<W>::DT == DT_Q8) {
        const uint32_t *w = (const uint32_t *)&c.a + 2 * b;
#pragma unroll
        for (int j = 0; j < 2; j++) {
            uint32_t u = w[j] ^ 0x80808080u;                 /* int8 v -> the byte v + 128 */
#pragma unroll
            for (int i = 0; i < 4; i++) f[4 * j + i] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7440 + i)) - 8388736.0f;
        }
    } else {
        uint32_t w = ((const uint32_t *)&c.a)[b];            /* low nibble first: nibble i is weight i, value - 8 */
#pragma unroll
        for (int i = 0; i < 8; i++) f[i] = __uint_as_float(0x4B000000u | ((w >> (4 * i)) & 15u)) - 8388616.0f;
    }
}
template <typename W> __device__ __forceinline__ float wscale(const typename Fmt<W>::Chunk &c) {
    if constexpr (!is_q<W>) return 1.0f;
    else return __half2float(__ushort_as_half(c.s));
}
/* The column-slice kernels' unit: 8 consecutive weights of a row (column k, a multiple of 8) and, for q8 / q4, their
 * group's scale (8 divides the group of 32): bf16 / f32 Fmt's 16-byte chunk; q8 8 bytes; q4 4 bytes. So a thread
 * holds the same 8 values of x in every format. */
template <typename W> struct Cols8 { typedef typename Fmt<W>::Chunk T; };
struct Q8Cols { uint2 v; uint16_t s; };
struct Q4Cols { uint32_t v; uint16_t s; };
template <> struct Cols8<Q8> { typedef Q8Cols T; };
template <> struct Cols8<Q4> { typedef Q4Cols T; };
__device__ __forceinline__ uint32_t ld_stream4(const void *p) {
    uint32_t r;
    asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(r) : "l"(p));
    return r;
}
template <typename W> __device__ __forceinline__ typename Cols8<W>::T load8(WPtr row, int k) {
    if constexpr (!is_q<W>) return wload<W>(row, k);
    else {
        typename Cols8<W>::T c;
        const char *p = (const char *)row.v + (size_t)k * Fmt<W>::GB / LAGUNA_QGROUP;
        if constexpr (Fmt<W>::DT == DT_Q8) c.v = ld_stream8(p);
        else c.v = ld_stream4(p);
        c.s = __ldg(row.s + k / LAGUNA_QGROUP);
        return c;
    }
}
/* The column-slice kernels' q8 / q4 dot products, in integers. A thread holds the same 8 values of x for all its rows,
 * so it writes them once as integers over a power-of-two scale of its own: x ~ s * q, s = 2^(e - 21) where 2^e <= the
 * largest magnitude < 2^(e + 1), so |q| <= 2^22 and q is x to 2^-22 of the largest magnitude -- two ulps of it, near
 * a float's own precision: nothing is rounded in steps that float arithmetic would not make, and the results agree
 * with the float kernels' (and the CPU's) to float rounding. Each q is three bytes, q = 65536 * hi + 256 * mid + lo
 * (hi signed, mid and lo not). A row's 8 weights then take 6 dp4a (four byte products added to an int32) for the hi,
 * mid and lo bytes' sums; the float path took 8 byte_perm + 8 subtractions + 8 FMAs. q4: the nibbles split into even
 * and odd bytes (an AND; a shift and an AND), x's bytes are arranged to match, and the values' offset of 8 is in the
 * sums' start values (-8 * the byte sums).
 * No int <-> float conversions: they run on the SM's conversion unit at 16 a clock, which would cap a kernel near
 * the float path's rate. The rounding of x * (1 / s) + 1.5 * 2^23 leaves a float whose bits less 0x4B400000 are q;
 * a dp4a sum started at 0x4B400000 (the bits of 1.5 * 2^23) is, as a float, 1.5 * 2^23 + the sum, exact while
 * |sum| < 2^22 (every byte sum here), so a subtraction gives it.
 * Measured on the H200 (XS-2.1, 512 / 8K; dev/gpu_notes.md, rounds 22 and 23): the float path q8 543.0 / 495.1 tok/s,
 * q4 521.7 / 480.2; these integers with I2F / F2I conversions q8 550.3 / 503.4, q4 550.4 / 503.7; without them q8
 * 551.5 / 504.3, q4 561.0 / 512.8. x as int16 (4 dp2a a row's 8 weights) was faster still (q8 570, q4 609 at 512) but
 * rounds x to 2^-16 of the largest: a rounding that floats don't make, whose steps flipped routes of the random test
 * models against the CPU (dev/patches/x16_dp2a.patch, with the CPU doing the same rounding: still ~1e-3 apart). */
struct XQ8 { uint32_t lo[2], mid[2], hi[2]; float s; int start_l, start_m, start_h; };
constexpr int MAGIC_1P5_2P23 = 0x4B400000;          /* the bits of 1.5 * 2^23 = 12582912.0f */
template <typename W> __device__ __forceinline__ XQ8 quant_x8(const float x[8]) {
    XQ8 q = {};
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) m = fmaxf(m, fabsf(x[i]));
    const int e = (int)(__float_as_uint(m) >> 23);  /* the biased exponent of the largest magnitude */
    if (e < 22) return q;                           /* 0 (or below 2^-105: taken as 0): s = 0 */
    if (e == 255) { q.s = __int_as_float(0x7fc00000); return q; }   /* inf / NaN in x: NaN sums, as floats give */
    q.s = __uint_as_float((uint32_t)(e - 21) << 23);             /* 2^(e - 127 - 21) */
    const float inv = __uint_as_float((uint32_t)(254 + 21 - e) << 23);   /* 1 / s, exactly */
    constexpr bool Q4 = Fmt<W>::DT == DT_Q4;       /* words of x: q8 (0 1 2 3) (4 5 6 7), q4 (0 2 4 6) (1 3 5 7) */
    int sl = 0, sm = 0, sh = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int v = __float_as_int(fmaf(x[i], inv, 12582912.0f)) - MAGIC_1P5_2P23;   /* round(x * inv) */
        const int w = Q4 ? i & 1 : i / 4, b = Q4 ? i / 2 : i % 4;
        q.lo[w] |= (uint32_t)(v & 255) << (8 * b);
        q.mid[w] |= (uint32_t)((v >> 8) & 255) << (8 * b);
        q.hi[w] |= (uint32_t)((v >> 16) & 255) << (8 * b);
        sl += v & 255; sm += (v >> 8) & 255; sh += v >> 16;
    }
    if constexpr (Q4) { q.start_l = -8 * sl; q.start_m = -8 * sm; q.start_h = -8 * sh; }
    return q;
}
/* c + the sum of a's 4 bytes times b's: AS / BS whether a's / b's bytes are signed */
template <bool AS, bool BS> __device__ __forceinline__ int dp4a(uint32_t a, uint32_t b, int c) {
    int d;
    if constexpr (AS && BS) asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    else if constexpr (AS) asm("dp4a.s32.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    else if constexpr (BS) asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    else asm("dp4a.u32.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
/* acc[j] += c[j] . x for the R rows' units (x as xq; times the group's scale and xq's) */
template <typename W, int R>
__device__ __forceinline__ void cols8_dot(const typename Cols8<W>::T *c, const XQ8 &xq, float *acc) {
    constexpr bool S8 = Fmt<W>::DT == DT_Q8;       /* q8 values are signed bytes; q4's nibbles are not */
    constexpr int M = MAGIC_1P5_2P23;
#pragma unroll
    for (int j = 0; j < R; j++) {
        uint32_t w0, w1;
        if constexpr (S8) { w0 = c[j].v.x; w1 = c[j].v.y; }
        else { w0 = c[j].v & 0x0F0F0F0Fu; w1 = (c[j].v >> 4) & 0x0F0F0F0Fu; }
        const int h = dp4a<true, S8>(xq.hi[1], w1, dp4a<true, S8>(xq.hi[0], w0, M + xq.start_h));
        const int m = dp4a<false, S8>(xq.mid[1], w1, dp4a<false, S8>(xq.mid[0], w0, M + xq.start_m));
        const int l = dp4a<false, S8>(xq.lo[1], w1, dp4a<false, S8>(xq.lo[0], w0, M + xq.start_l));
        const float d = fmaf(__int_as_float(h) - 12582912.0f, 65536.0f,          /* 65536 hi + 256 mid + lo */
                             fmaf(__int_as_float(m) - 12582912.0f, 256.0f, __int_as_float(l) - 12582912.0f));
        acc[j] = fmaf(__half2float(__ushort_as_half(c[j].s)) * xq.s, d, acc[j]);
    }
}
/* x's 8 values as quant_x8 leaves them, stored once (by the router's block 0, for decode's gate/up blocks, which
 * would each quantize the same values again): 3 x 16 bytes a chunk of 8 (q8 reads the first 2) */
__device__ __forceinline__ void store_xq(uint4 *p, const XQ8 &q) {
    p[0] = make_uint4(q.lo[0], q.lo[1], q.mid[0], q.mid[1]);
    p[1] = make_uint4(q.hi[0], q.hi[1], __float_as_uint(q.s), 0u);
    p[2] = make_uint4((uint32_t)q.start_l, (uint32_t)q.start_m, (uint32_t)q.start_h, 0u);
}
template <typename W> __device__ __forceinline__ XQ8 load_xq(const uint4 *p) {
    XQ8 q;
    const uint4 a = p[0], b = p[1];
    q.lo[0] = a.x; q.lo[1] = a.y; q.mid[0] = a.z; q.mid[1] = a.w;
    q.hi[0] = b.x; q.hi[1] = b.y; q.s = __uint_as_float(b.z);
    if constexpr (Fmt<W>::DT == DT_Q4) {
        const uint4 c = p[2];
        q.start_l = (int)c.x; q.start_m = (int)c.y; q.start_h = (int)c.z;
    } else q.start_l = q.start_m = q.start_h = 0;
    return q;
}
/* 4 values at one scale, quant_x8's rounding: (lo, mid, hi, the scale's bits). Decode's gate/up blocks write h 4
 * units a block, so a chunk of 8 h values (what a down thread reads) comes from two blocks, each quantizing its half:
 * h quantized once for every down block, which would each quantize the same values again. q4's bytes are in the
 * order 0 2 1 3, as cols8_dot_halves splits a q4 unit's nibbles. On the H200 (XS-2.1, 512 / 8K): q4 568.8 / 518.7 ->
 * 572.8 / 522.7 tok/s, q8 unchanged (556.4 / 507.9 -> 556.5 / 508.1; dev/gpu_notes.md, round 24). */
template <typename W> __device__ __forceinline__ uint4 quant_x4(const float x[4]) {
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) m = fmaxf(m, fabsf(x[i]));
    const int e = (int)(__float_as_uint(m) >> 23);
    if (e < 22) return make_uint4(0u, 0u, 0u, 0u);
    if (e == 255) return make_uint4(0u, 0u, 0u, 0x7fc00000u);
    const float inv = __uint_as_float((uint32_t)(254 + 21 - e) << 23);
    uint32_t lo = 0, mid = 0, hi = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int v = __float_as_int(fmaf(x[i], inv, 12582912.0f)) - MAGIC_1P5_2P23;   /* round(x * inv) */
        const int b = Fmt<W>::DT == DT_Q4 ? (i == 1 ? 2 : i == 2 ? 1 : i) : i;
        lo |= (uint32_t)(v & 255) << (8 * b);
        mid |= (uint32_t)((v >> 8) & 255) << (8 * b);
        hi |= (uint32_t)((v >> 16) & 255) << (8 * b);
    }
    return make_uint4(lo, mid, hi, (uint32_t)(e - 21) << 23);
}
/* start + the sum of a's 4 bytes times b's, as a float (exact: the dp4a starts at the bits of 1.5 * 2^23) */
template <bool AS, bool BS> __device__ __forceinline__ float byte_sum(uint32_t a, uint32_t b, int start) {
    return __int_as_float(dp4a<AS, BS>(a, b, MAGIC_1P5_2P23 + start)) - 12582912.0f;
}
/* cols8_dot with x as two quant_x4 halves (values 0-3 in a, 4-7 in b), each at its own scale */
template <typename W, int R>
__device__ __forceinline__ void cols8_dot_halves(const typename Cols8<W>::T *c, const uint4 &a, const uint4 &b,
                                                 float *acc) {
    constexpr bool S8 = Fmt<W>::DT == DT_Q8;
    int sa[3] = {0, 0, 0}, sb[3] = {0, 0, 0};      /* q4: -8 * the byte sums (lo, mid, hi): the nibbles' offset */
    if constexpr (!S8) {
        sa[0] = -8 * dp4a<false, false>(a.x, 0x01010101u, 0); sb[0] = -8 * dp4a<false, false>(b.x, 0x01010101u, 0);
        sa[1] = -8 * dp4a<false, false>(a.y, 0x01010101u, 0); sb[1] = -8 * dp4a<false, false>(b.y, 0x01010101u, 0);
        sa[2] = -8 * dp4a<true, false>(a.z, 0x01010101u, 0); sb[2] = -8 * dp4a<true, false>(b.z, 0x01010101u, 0);
    }
    const float as = __uint_as_float(a.w), bs = __uint_as_float(b.w);
#pragma unroll
    for (int j = 0; j < R; j++) {
        uint32_t w0, w1;                            /* the weights of values 0-3 and 4-7, in x's byte order */
        if constexpr (S8) { w0 = c[j].v.x; w1 = c[j].v.y; }
        else {                                      /* even (0 2 4 6) and odd (1 3 5 7) nibbles -> (0 2 1 3) (4 6 5 7) */
            const uint32_t ev = c[j].v & 0x0F0F0F0Fu, od = (c[j].v >> 4) & 0x0F0F0F0Fu;
            w0 = __byte_perm(ev, od, 0x5410); w1 = __byte_perm(ev, od, 0x7632);
        }
        const float d0 = fmaf(byte_sum<true, S8>(a.z, w0, sa[2]), 65536.0f,   /* 65536 hi + 256 mid + lo */
                              fmaf(byte_sum<false, S8>(a.y, w0, sa[1]), 256.0f, byte_sum<false, S8>(a.x, w0, sa[0])));
        const float d1 = fmaf(byte_sum<true, S8>(b.z, w1, sb[2]), 65536.0f,
                              fmaf(byte_sum<false, S8>(b.y, w1, sb[1]), 256.0f, byte_sum<false, S8>(b.x, w1, sb[0])));
        acc[j] = fmaf(__half2float(__ushort_as_half(c[j].s)), fmaf(as, d0, bs * d1), acc[j]);
    }
}
/* acc[j] += c[j] . x for R chunks of R rows at the same columns: n of the chunk's CH columns lie inside the row (the
 * last chunk of a quantized row may be partial; n is a multiple of 8); x8(b, f) loads the 8 activations of sub-chunk
 * b. Quantized: the sub-chunks' sum times the group's scale. */
template <typename W, int R, typename X>
__device__ __forceinline__ void chunk_dot(const typename Fmt<W>::Chunk *c, int n, X x8, float *acc) {
    float xv[8], wv[8];
    if constexpr (!is_q<W>) {
        (void)n;
        x8(0, xv);
#pragma unroll
        for (int j = 0; j < R; j++) { wvals8<W>(c[j], 0, wv); acc[j] += dot8(wv, xv); }
    } else {
        float part[R];
#pragma unroll
        for (int j = 0; j < R; j++) part[j] = 0.0f;
#pragma unroll
        for (int b = 0; b < Fmt<W>::CH / 8; b++) {
            if (8 * b >= n) break;
            x8(b, xv);
#pragma unroll
            for (int j = 0; j < R; j++) { wvals8<W>(c[j], b, wv); part[j] += dot8(wv, xv); }
        }
#pragma unroll
        for (int j = 0; j < R; j++) acc[j] += wscale<W>(c[j]) * part[j];
    }
}
/* x staged in shared memory for chunks of CH columns. A quantized chunk is 64 or 128 bytes of x per lane, so lanes
 * reading the same float4 of their own chunks would all hit one bank group; inside each chunk the float4s are
 * XOR-swizzled by the chunk index, which spreads 8 such lanes over the 8 bank groups. CH = 8 keeps the plain layout. */
template <int CH> __device__ __forceinline__ int xs_slot(int q) {    /* float4 q of x -> its float4 slot */
    constexpr int F = CH / 4;
    if constexpr (CH <= 8) return q;
    else { int c = q / F; return c * F + ((q % F) ^ ((c / (8 / F)) % F)); }
}
template <int CH> __device__ __forceinline__ void xs_put4(float *xs, int k, float4 v) {   /* x[k..k+3], k % 4 == 0 */
    if constexpr (CH <= 8) *(float4 *)(xs + k) = v;
    else ((float4 *)xs)[xs_slot<CH>(k / 4)] = v;
}
template <int CH> __device__ __forceinline__ float &xs_at(float *xs, int k) {
    if constexpr (CH <= 8) return xs[k];
    else return xs[xs_slot<CH>(k / 4) * 4 + (k & 3)];
}
template <int CH> __device__ __forceinline__ void xs_load8(const float *xs, int k, float f[8]) {   /* k % 8 == 0 */
    if constexpr (CH <= 8) load_x8(xs + k, f);
    else {
        const float4 *x4 = (const float4 *)xs;
        float4 a = x4[xs_slot<CH>(k / 4)], b = x4[xs_slot<CH>(k / 4 + 1)];
        f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
    }
}

/* ----------------------------------------------------------------------------
 * --random-weights: the same counter hash as laguna.c, so both backends see identical weights */

template <typename T>
__global__ void fill_random(T *dst, size_t n, uint64_t seed, uint64_t key, uint64_t elem0, float a) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = from_f<T>(random_weight(seed, key, elem0 + i, a));
}

/* a q8 / q4 tensor of ng groups: each thread quantizes whole groups (random_qgroup, as laguna.c does) */
__global__ void fill_random_q(uint8_t *vals, uint16_t *scales, size_t ng, int64_t cols, int dtype, uint64_t seed,
                              uint64_t key, float a) {
    int64_t groups = (cols + LAGUNA_QGROUP - 1) / LAGUNA_QGROUP, gb = dtype == DT_Q8 ? LAGUNA_QGROUP : LAGUNA_QGROUP / 2;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < ng; i += (size_t)gridDim.x * blockDim.x)
        random_qgroup(dtype, seed, key, i / groups, cols, i % groups, a, vals + i * gb, scales + i);
}

template <typename Tin, typename Tout>
__global__ void convert(Tout *dst, const Tin *src, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = from_f<Tout>(to_f(src[i]));
}

/* x[0 .. in) into shared memory in CH's layout (xs_put4) by a block of 256 threads; returns this thread's sum of
 * the squares of what it staged (for the RMSNorm) */
template <int CH> __device__ __forceinline__ float stage_x(float *xs, const float *x, int in) {
    float ss = 0.0f;
    for (int k = threadIdx.x * 4; k < in; k += 1024) {
        float4 v = *(const float4 *)(x + k);
        ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        xs_put4<CH>(xs, k, v);
    }
    return ss;
}

/* ----------------------------------------------------------------------------
 * the kernels, in model order */

/* 8 floats to 8 consecutive elements (16-byte aligned), in one or two 16-byte stores */
__device__ __forceinline__ void store8(float *d, const float f[8]) {
    ((float4 *)d)[0] = make_float4(f[0], f[1], f[2], f[3]);
    ((float4 *)d)[1] = make_float4(f[4], f[5], f[6], f[7]);
}
__device__ __forceinline__ void store8(bf16 *d, const float f[8]) {
    uint4 u;
    __nv_bfloat162 *h = (__nv_bfloat162 *)&u;
#pragma unroll
    for (int i = 0; i < 4; i++) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    *(uint4 *)d = u;
}
/* the chunk of a quantized row at column k (of n), dequantized (value * its group's scale) into dst[0 ..]: 8 values
 * at a time where dst is 16-byte aligned, else (and the row's last ones: n need not be a multiple of 8) singly */
template <typename W, typename T>
__device__ __forceinline__ void dequant_chunk(WPtr row, int k, int n, T *dst) {
    typename Fmt<W>::Chunk c = wload<W>(row, k);
    float sc = wscale<W>(c), f[8];
#pragma unroll
    for (int b = 0; b < Fmt<W>::CH / 8; b++) {
        if (k + 8 * b >= n) break;
        wvals8<W>(c, b, f);
#pragma unroll
        for (int j = 0; j < 8; j++) f[j] *= sc;
        if (k + 8 * b + 8 <= n && (reinterpret_cast<uintptr_t>(dst + 8 * b) & 15) == 0) store8(dst + 8 * b, f);
        else for (int j = 0; j < 8 && k + 8 * b + j < n; j++) dst[8 * b + j] = from_f<T>(f[j]);
    }
}

/* A decode step's parameters. The host writes them into mapped (pinned, device-visible) memory before it launches
 * the step; the embedding kernel copies them to the device (d_step, and the position to g->pos) and the sampler
 * writes the token it picks to both, so the step's graph is kernels only: no copy nodes before or after it.
 * Two such slots on the host, step seq in slot seq & 1, so the host can launch step seq + 1 (token -1: the token
 * step seq samples, read on the device) while step seq runs (gpu_decode_launch). seq: the step's number, counted on
 * the device (embed_kernel; the host's own count is g->seq). */
struct Step { int token, pos; float temperature, topp, coin; int out, seq; };

/* h = embed[token] (no scaling); a quantized row is dequantized here (value * scale, as laguna.c's weight_row).
 * A decode step (ring != NULL, one block): its parameters from the host's slot for the step after st's, copied to st
 * and pos on the way; token -1 is the token the previous step sampled (st->out). */
template <typename W>
__global__ void embed_kernel(float *x, WPtr embed, const int *tokens, int H, const Step *ring, Step *st, int *pos) {
    TRACE_BLOCK();
    int t = blockIdx.x;
    __shared__ int tok;
    if (ring) {
        if (threadIdx.x == 0) {
            const int seq = st->seq + 1;
            const volatile Step *s = ring + (seq & 1);
            Step v;
            v.token = s->token; v.pos = s->pos; v.temperature = s->temperature; v.topp = s->topp; v.coin = s->coin;
            v.out = -1;
            v.seq = seq;
            if (v.token < 0) v.token = st->out;
            *st = v;
            *pos = v.pos;
            tok = v.token;
        }
    } else if (threadIdx.x == 0) {
        tok = tokens[t];
    }
    __syncthreads();
    if constexpr (!is_q<W>) {
        const W *row = (const W *)embed.v + (size_t)tok * H;
        for (int i = threadIdx.x; i < H; i += blockDim.x) x[(size_t)t * H + i] = to_f(row[i]);
    } else {
        constexpr int CH = Fmt<W>::CH;
        WPtr row = wrow<W>(embed, tok, H);
        for (int k = threadIdx.x * CH; k < H; k += blockDim.x * CH) dequant_chunk<W>(row, k, H, x + (size_t)t * H + k);
    }
}

/* out[t] = w * (x[t] / sqrt(mean(x[t]^2) + eps)); one block per row. out16 (if not NULL) gets a bf16 copy: the
 * GEMM input of bf16 files, so the GEMM that follows needs no conversion launch (norm_rows) */
__global__ void rmsnorm_kernel(float *out, const float *x, int ldx, const float *w, int H, float eps, bf16 *out16) {
    TRACE_BLOCK();
    griddep_wait();
    griddep_launch();
    int t = blockIdx.x;
    const float *xt = x + (size_t)t * ldx;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) ss += xt[i] * xt[i];
    ss = block_sum(ss);
    float inv = 1.0f / sqrtf(ss / H + eps);
    for (int i = threadIdx.x; i < H; i += blockDim.x) {
        const float v = w[i] * (xt[i] * inv);
        out[(size_t)t * H + i] = v;
        if (out16) out16[(size_t)t * H + i] = __float2bfloat16(v);
    }
}

/* Decode matvec: out[r] (+)= W[r, :] . norm(x) + bias[r], for one token.
 * A block of 256 threads owns ROWS whole rows; thread t owns the chunks t, t + 256, ... (NCH of them), the same
 * columns in every row. So its slice of x lives in registers (no shared-memory staging of x before the first
 * weight load), the RMSNorm's sum of squares is one block reduction, and the row sums are one reduction at the
 * end. Each thread's ROWS * NCH = 8 weight chunks (16-byte streaming loads) are issued first, before the wait on the
 * previous kernel (programmatic dependent launch), so a block's weights are in flight while x is still being
 * written. Block 0 writes the normed x to xb_out for later steps. */
template <typename W, int ROWS, int NCH>
__device__ __forceinline__ void matvec_rows(float *out, WPtr w, int rows, int in, const float *x,
                                            const float *norm_w, float eps, float *xb_out, const float *bias,
                                            int accumulate) {
    constexpr int CH = Fmt<W>::CH;
    __shared__ float red[8][ROWS];
    const int tid = threadIdx.x, r0 = blockIdx.x * ROWS, C = is_q<W> ? (in + CH - 1) / CH : in / CH;
    typename Fmt<W>::Chunk c[ROWS][NCH];            /* the weights: loaded before anything else */
#pragma unroll
    for (int j = 0; j < ROWS; j++) {
        WPtr wr = wrow<W>(w, min(r0 + j, rows - 1), in);
#pragma unroll
        for (int u = 0; u < NCH; u++)
            if (tid + u * 256 < C) c[j][u] = wload<W>(wr, (tid + u * 256) * CH);
    }
    constexpr bool NWE = !is_q<W> && NCH <= 2;      /* the router's case: its norm weights before the wait too */
    float nwr[NWE ? NCH : 1][CH];
    if constexpr (NWE)
        if (norm_w)
#pragma unroll
            for (int u = 0; u < NCH; u++)
#pragma unroll
                for (int b = 0; b < CH / 8; b++) {
                    int k = (tid + u * 256) * CH + 8 * b;
                    if (k < in) load_x8(norm_w + k, &nwr[u][8 * b]);
                }
    const float prev = accumulate && tid < ROWS && r0 + tid < rows ? out[r0 + tid] : 0.0f;   /* see matvec() */
    griddep_wait();                                 /* x is the previous kernel's output */
    griddep_launch();
    float xv[NCH][CH], ss = 0.0f;
#pragma unroll
    for (int u = 0; u < NCH; u++)
#pragma unroll
        for (int b = 0; b < CH / 8; b++) {
            int k = (tid + u * 256) * CH + 8 * b;
            if (k < in) load_x8(x + k, &xv[u][8 * b]);
            else for (int i = 0; i < 8; i++) xv[u][8 * b + i] = 0.0f;
            ss += dot8(&xv[u][8 * b], &xv[u][8 * b]);
        }
    if (norm_w) {
        float inv = 1.0f / sqrtf(block_sum(ss) / in + eps);
#pragma unroll
        for (int u = 0; u < NCH; u++)
#pragma unroll
            for (int b = 0; b < CH / 8; b++) {
                int k = (tid + u * 256) * CH + 8 * b;
                if (k >= in) continue;
                float nw[8], *xu = &xv[u][8 * b];
                if constexpr (NWE) for (int i = 0; i < 8; i++) nw[i] = nwr[u][8 * b + i];
                else load_x8(norm_w + k, nw);
                for (int i = 0; i < 8; i++) xu[i] = nw[i] * (xu[i] * inv);
                if (xb_out && blockIdx.x == 0) for (int i = 0; i < 8; i++) xb_out[k + i] = xu[i];
            }
    }
    const int warp = tid >> 5, lane = tid & 31;
#pragma unroll
    for (int j = 0; j < ROWS; j++) {
        float acc = 0.0f;
#pragma unroll
        for (int u = 0; u < NCH; u++) {
            int k = (tid + u * 256) * CH;
            if (tid + u * 256 < C)
                chunk_dot<W, 1>(&c[j][u], in - k, [&](int b, float f[8]) {
#pragma unroll
                    for (int i = 0; i < 8; i++) f[i] = xv[u][8 * b + i];
                }, &acc);
        }
        acc = warp_sum(acc);
        if (lane == 0) red[warp][j] = acc;
    }
    __syncthreads();
    if (tid < ROWS && r0 + tid < rows) {
        float s = 0.0f;
        for (int i = 0; i < 8; i++) s += red[i][tid];
        int r = r0 + tid;
        if (bias) s += bias[r];
        out[r] = accumulate ? prev + s : s;
    }
}

template <typename W, int ROWS, int NCH>
__global__ void __launch_bounds__(256, NCH == 1 && ROWS < 8 ? 3 : 2) matvec_kernel(float *out, WPtr w, int rows, int in, const float *x,
                                                     const float *norm_w, float eps, float *xb_out,
                                                     const float *bias, int accumulate) {
    TRACE_BLOCK();
    matvec_rows<W, ROWS, NCH>(out, w, rows, in, x, norm_w, eps, xb_out, bias, accumulate);
}

/* Decode matvec for tall matrices with in <= 32 * CH * NCH inputs (q/k/v/g, dense gate+up, lm_head): a warp per RG
 * rows (a step), RPW steps per warp. Each lane's NCH chunks of the first step's rows are loaded before the wait on
 * the previous kernel; later steps' before the current one is summed. Quantized formats (EARLY: their chunks are
 * small) also load the second step and the thread's RMSNorm weights before the wait, so that after it only x is
 * read: in the decode graph +4.5% tok/s for q4, +2% for q8. bf16 lost 3% with that register version, so bf16 / f32
 * copy their norm weights into shared memory before the wait instead (no registers held across it): +1.6% at 512
 * (dev/gpu_notes.md, rounds 5 and 7). x (normed when norm_w is given: the block's sum of squares) is staged once per
 * block in shared memory: RPW > 1 spreads that L2 read over more rows. */
template <typename W, int NCH, int RPW>
__global__ void __launch_bounds__(256) matvec_warp(float *out, WPtr w, int rows, int in, const float *x,
                                                   const float *norm_w, float eps, float *xb_out, const float *bias,
                                                   int accumulate) {
    TRACE_BLOCK();
    constexpr int CH = Fmt<W>::CH, RG = Fmt<W>::RG, NW = CH * NCH / 8;   /* NW: norm weights a thread applies */
    __shared__ __align__(16) float xs[32 * CH * NCH];
    const int tid = threadIdx.x, lane = tid & 31, r0 = (blockIdx.x * 8 + (tid >> 5)) * RPW * RG;
    typename Fmt<W>::Chunk c[2][NCH][RG];          /* [step & 1][u][row of the step]; past the end: the last row */
    auto load_step = [&](int j) {
#pragma unroll
        for (int u = 0; u < NCH; u++)
            if ((lane + 32 * u) * CH < in)
#pragma unroll
                for (int i = 0; i < RG; i++)
                    c[j & 1][u][i] = wload<W>(wrow<W>(w, min(r0 + j * RG + i, rows - 1), in), (lane + 32 * u) * CH);
    };
    constexpr bool EARLY = is_q<W>;
    load_step(0);
    __shared__ float nws[EARLY ? 1 : 32 * CH * NCH];  /* !EARLY: the norm weights, copied before the wait */
    if constexpr (!EARLY)
        if (norm_w)
            for (int k = tid; k < in; k += 256) nws[k] = norm_w[k];
    float nwv[NW];                                  /* EARLY: the norm weights of the elements this thread stages */
    if constexpr (EARLY) {
        if (RPW > 1) load_step(1);
#pragma unroll
        for (int i = 0; i < NW; i++) nwv[i] = norm_w && tid + 256 * i < in ? norm_w[tid + 256 * i] : 0.0f;
    }
    float prev[RPW][RG];                            /* accumulate: the rows' old values, read before the wait */
#pragma unroll
    for (int j = 0; j < RPW; j++)
#pragma unroll
        for (int i = 0; i < RG; i++) prev[j][i] = accumulate && lane == 0 && r0 + j * RG + i < rows ? out[r0 + j * RG + i] : 0.0f;
    griddep_wait();                                 /* x is the previous kernel's output */
    griddep_launch();
    float ss = stage_x<CH>(xs, x, in);
    if (norm_w) {                                   /* each thread rescales the elements it staged */
        float inv = 1.0f / sqrtf(block_sum(ss) / in + eps);
        auto put = [&](int k, float wk) {
            float &v = xs_at<CH>(xs, k);
            v = wk * (v * inv);
            if (xb_out && blockIdx.x == 0) xb_out[k] = v;
        };
        if constexpr (EARLY) {
#pragma unroll
            for (int i = 0; i < NW; i++) {
                if (tid + 256 * i >= in) break;
                put(tid + 256 * i, nwv[i]);
            }
        } else {
            for (int k = tid; k < in; k += 256) put(k, nws[k]);   /* each thread its own elements: no barrier */
        }
    }
    __syncthreads();
    TRACE_MARK(0);
#pragma unroll
    for (int j = 0; j < RPW; j++) {
        if (j + 1 < RPW && !(EARLY && j == 0)) load_step(j + 1);
        float acc[RG] = {};
#pragma unroll
        for (int u = 0; u < NCH; u++) {
            int k = (lane + 32 * u) * CH;
            if (k < in) chunk_dot<W, RG>(c[j & 1][u], in - k, [&](int b, float f[8]) { xs_load8<CH>(xs, k + 8 * b, f); }, acc);
        }
        auto finish = [&](int i) {                  /* row r0 + j * RG + i */
            float a = warp_sum(acc[i]);
            int r = r0 + j * RG + i;
            if (lane == 0 && r < rows) {
                if (bias) a += bias[r];
                out[r] = accumulate ? prev[j][i] + a : a;
            }
        };
        if (j == 0) TRACE_MARK(1);
        if constexpr (RG == 1) finish(0);           /* (a loop here, even of one trip, kept nvcc from unrolling j) */
        else
#pragma unroll
            for (int i = 0; i < RG; i++) finish(i);
    }
}

/* Decode matvec by column slices (bf16 / f32, in <= 256 * CH = 2048): each thread owns the same chunk (CH = 8
 * columns) of all the block's R rows, so it needs only those 8 values of x: in registers, read straight from global
 * memory after the wait (as a plain streaming kernel reads its input), and every one of its weights is loaded before
 * the wait. When a row's cpr chunks fill whole warps and divide 256, the block's threads form SUB = 256 / cpr
 * subgroups, each with its own R rows; otherwise one subgroup, the row's chunks on its first cpr threads. A thread's
 * R partial sums are reduced over its warp by halving exchanges (warp_reduce_rows: 8 shuffles for R = 8 where 8
 * warp_sums take 40), then over the subgroup's warps in shared memory.
 * Why not matvec_warp (a warp per row, x staged in shared memory): that kernel reads 8 bytes of x from shared memory
 * for every 2 bytes of weight, this one 32 bytes of x per 128 of weights in registers. In a chain of itself on the
 * H200 (dev/chain_lab) it streams 4.2 TB/s against matvec_warp's 3.1 (a plain stream: 4.5); in the decode graph
 * bf16 356 -> 386 tok/s at 512 (dev/gpu_notes.md, round 9). For q8 / q4 it was slower (408 -> 386): they keep
 * matvec_warp.
 * The layout is matvec_rows's (the block-rows kernel: the router's, and q8 / q4's o_proj) at ROWS = 8, NCH = 1;
 * this kernel adds the subgroups, the halving reduction and the column slices over a cluster (o_proj, below), and
 * compiles to 64 registers (4 blocks an SM) where matvec_kernel<bf16, 8, 1> takes 96 (2). For o_proj in bf16 the
 * split took 397.2 -> 401.9 and 411.2 -> 412.7 tok/s at 512 in two calls against the block-rows kernel
 * (matvec_kernel<bf16, 2, 4>, which reads all 32 KB of x per 32 KB of weights), 8 rows a block; 4 rows: 387.1
 * (dev/gpu_notes.md, round 10). Small, so kept mostly for the x side's sake. */
template <int R> __device__ __forceinline__ float warp_reduce_rows(float (&v)[R], int lane) {
    static_assert(R >= 1 && R <= 32 && (R & (R - 1)) == 0, "R: a power of two <= 32");
    int n = R;
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1) {
        if (n > 1) {                               /* lanes with this bit keep the upper half of the rows they hold */
            const bool up = lane & off;
#pragma unroll
            for (int i = 0; i < n / 2; i++) {
                float send = up ? v[i] : v[i + n / 2], keep = up ? v[i + n / 2] : v[i];
                v[i] = keep + __shfl_xor_sync(0xffffffffu, send, off);
            }
            n /= 2;
        } else {
            v[0] += __shfl_xor_sync(0xffffffffu, v[0], off);
        }
    }
    return v[0];                                   /* the warp's sum for row lane / (32 / R) */
}
/* SUB for a row of cpr chunks (the host sizes the grid with the same rule) */
__host__ __device__ __forceinline__ int col_subgroups(int cpr) {
    return cpr <= 256 && 256 % cpr == 0 && cpr % 32 == 0 ? 256 / cpr : 1;
}

/* Rows wider than one block's 256 chunks (o_proj: 8192 inputs) are split over a thread-block cluster along y
 * (SPLIT): block s of the cluster owns columns [s * 256 * CH, (s + 1) * 256 * CH) of the same R rows, and the blocks'
 * partial sums meet in block 0's shared memory (distributed shared memory, one cluster barrier on the way): block 0
 * adds them in slice order. So x is read 2 KB per 8 KB of weights as on narrow rows, where the block-rows kernel
 * (matvec_kernel<bf16, 2, 4>) reads 32 KB of x per 32 KB of weights. No RMSNorm on split rows (o_proj has none). */
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_arrive_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait_acquire() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
    __trap();                                      /* clusters need sm_90: the host never splits rows then */
#endif
}

/* matvec_cols' and matvec_loop's x: this thread's 8 values (0 when its columns lie past the row), RMS-normed with its
 * norm weights nw when norm_w is given (each subgroup holds all of x: the first one's squares are counted); block 0's
 * first subgroup writes the normed x to xb_out */
__device__ __forceinline__ void cols_x8(float xv[8], const float *x, int k, bool mine, int sg, int in,
                                        const float *norm_w, const float nw[8], float eps, float *xb_out) {
    if (mine) load_x8(x + k, xv);
    else for (int i = 0; i < 8; i++) xv[i] = 0.0f;
    if (norm_w) {
        float inv = 1.0f / sqrtf(block_sum(sg == 0 ? dot8(xv, xv) : 0.0f) / in + eps);
        if (mine) {
            for (int i = 0; i < 8; i++) xv[i] = nw[i] * (xv[i] * inv);
            if (xb_out && blockIdx.x == 0 && sg == 0) store8(xb_out + k, xv);
        }
    }
}
/* the sum over subgroup tid / R's warps of row tid % R (red: each warp's row sums; 8 / sub warps a subgroup) */
template <int R> __device__ __forceinline__ float subgroup_sum(const float (*red)[R], int sub, int tid) {
    const int wpg = 8 / sub, g = tid / R, j = tid % R;
    float s = 0.0f;
    for (int i = 0; i < wpg; i++) s += red[g * wpg + i][j];
    return s;
}

/* The trace build's bookkeeping took q/k/v/g's instance from 64 registers to 68, 4 blocks an SM to 3, so its traces
 * timed a slower kernel than the real one (dev/gpu_notes.md, round 15): traced, the bf16 / q8 / q4 instances are held
 * to 4 blocks an SM, as they run untraced (f32's take ~95 registers either way). */
#ifdef LAGUNA_TRACE
#define MATVEC_COLS_BOUNDS __launch_bounds__(256, std::is_same<W, float>::value ? 1 : 4)
#else
#define MATVEC_COLS_BOUNDS __launch_bounds__(256)
#endif
template <typename W, int R, bool SPLIT>
__global__ void MATVEC_COLS_BOUNDS matvec_cols(float *out, WPtr w, int rows, int in, const float *x,
                                                   const float *norm_w, float eps, float *xb_out, const float *bias,
                                                   int accumulate) {
    TRACE_BLOCK();
    constexpr int CH = 8;                          /* columns a thread (Cols8) */
    if constexpr (SPLIT) cluster_arrive_relaxed();  /* phase 0: this block has started (its shared memory exists) */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int sub = SPLIT ? 1 : col_subgroups((in + CH - 1) / CH);
    const int sg = tid / (256 / sub), k = (SPLIT ? blockIdx.y * 256 * CH : 0) + (tid % (256 / sub)) * CH;
    const int r0 = (blockIdx.x * sub + sg) * R;    /* the subgroup's first row */
    const bool mine = k < in, writer = !SPLIT || blockIdx.y == 0;
    typename Cols8<W>::T c[R];
    float nw[CH];                                  /* the RMSNorm weights of this thread's columns */
    if (mine) {
#pragma unroll
        for (int j = 0; j < R; j++) c[j] = load8<W>(wrow<W>(w, min(r0 + j, rows - 1), in), k);
        if (!SPLIT && norm_w) load_x8(norm_w + k, nw);
    }
    const int rb = blockIdx.x * sub * R + tid;     /* the row thread tid < sub * R writes: subgroup tid / R */
    const float prev = writer && accumulate && tid < sub * R && rb < rows ? out[rb] : 0.0f;   /* see matvec() */
    griddep_wait();                                /* x is the previous kernel's output */
    griddep_launch();
    float xv[CH];
    cols_x8(xv, x, k, mine, sg, in, SPLIT ? NULL : norm_w, nw, eps, xb_out);
    float acc[R] = {};
    if constexpr (!is_q<W>) {
        if (mine) chunk_dot<W, R>(c, in - k, [&](int, float f[8]) { for (int i = 0; i < 8; i++) f[i] = xv[i]; }, acc);
    } else {
        if (mine) cols8_dot<W, R>(c, quant_x8<W>(xv), acc);
    }
    __shared__ float red[8][R];
    float v = warp_reduce_rows<R>(acc, lane);
    if (lane % (32 / R) == 0) red[warp][lane / (32 / R)] = v;
    __syncthreads();
    if constexpr (!SPLIT) {
        if (tid < sub * R && rb < rows) {
            float s = subgroup_sum<R>(red, sub, tid);
            if (bias) s += bias[rb];
            out[rb] = accumulate ? prev + s : s;
        }
    } else {                                       /* the slices' partial sums into block 0, in slice order */
        __shared__ float part[8][R];
        namespace cg = cooperative_groups;
        float s = 0.0f;
        if (tid < R) for (int i = 0; i < 8; i++) s += red[i][tid];
        cluster_wait_acquire();                    /* phase 0 done: every block of the cluster is running */
        if (tid < R) cg::this_cluster().map_shared_rank(&part[0][0], 0)[blockIdx.y * R + tid] = s;
        cluster_arrive_release();                  /* phase 1: the partial sums are written */
        if (!writer) return;
        cluster_wait_acquire();
        if (tid < R && rb < rows) {
            s = 0.0f;
            for (int i = 0; i < (int)gridDim.y; i++) s += part[i][tid];
            if (bias) s += bias[rb];
            out[rb] = accumulate ? prev + s : s;
        }
    }
}

/* matvec_cols as one wave of blocks that loop (the q8 / q4 whole-row matvecs: q/k/v/g and lm_head). The host launches
 * at most as many blocks as fit the GPU at once; block b owns row groups b, b + G, b + 2G, ... (G: the grid), each
 * group sub * R rows in matvec_cols' layout (a thread owns 8 columns of its subgroup's R rows, x in registers). Two
 * named register buffers: the next group's weights are loaded before the current group is summed, so the memory
 * system stays busy while a block does its arithmetic. A q8 / q4 block's time was its arithmetic (~3 float
 * instructions a weight before cols8_dot's integer dot products, done by every block of a wave at once:
 * dev/gpu_notes.md, round 20), which a block of matvec_cols cannot overlap with its own loads. One barrier a group: the group's warp sums alternate between two halves of red. The
 * products and sums are matvec_cols', in the same order, so the result is the same to the bit. Measured on the H200
 * (round 21): q8 523.0 -> 543.7 tok/s, q4 506.5 -> 524.1; bf16 473.2 -> 466.7, so bf16 / f32 stay on matvec_cols
 * (LAGUNA_MV_LOOP=1 / 0 sends every format / none here: a test and timing hook). */
#ifndef LAGUNA_LOOP_MINB
#define LAGUNA_LOOP_MINB 0      /* bf16 / f32: blocks an SM for __launch_bounds__ (0: as ptxas likes; bf16 110 registers) */
#endif
#ifndef LAGUNA_LOOP_QMINB
#define LAGUNA_LOOP_QMINB 3     /* q8 / q4: 80 registers, no spills. Measured (q8, 512): 2 blocks an SM 539.0 tok/s,
                                   3 543.5, 4 503.0 (64 registers, 132 bytes spilled; q4 fits 64 without: not timed);
                                   a grid of 1 or 2 blocks an SM at 3 resident: 420.2, 511.9 */
#endif
#define MATVEC_LOOP_BOUNDS __launch_bounds__(256, is_q<W> ? LAGUNA_LOOP_QMINB : LAGUNA_LOOP_MINB)
template <typename W, int R>
__global__ void MATVEC_LOOP_BOUNDS matvec_loop(float *out, WPtr w, int rows, int in, const float *x, const float *norm_w,
                                               float eps, float *xb_out, const float *bias, int accumulate) {
    TRACE_BLOCK();
    constexpr int CH = 8;
    typedef typename Cols8<W>::T U;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int sub = col_subgroups((in + CH - 1) / CH);
    const int sg = tid / (256 / sub), k = (tid % (256 / sub)) * CH, rg = sub * R;   /* rg: rows a group */
    const int ng = (rows + rg - 1) / rg, G = gridDim.x;    /* the host launches at most ng blocks */
    const bool mine = k < in;
    U a[R], b[R];
    auto load = [&](U (&c)[R], int grp) {
        const int r0 = (grp * sub + sg) * R;
        if (mine)
#pragma unroll
            for (int j = 0; j < R; j++) c[j] = load8<W>(wrow<W>(w, min(r0 + j, rows - 1), in), k);
    };
    int grp = blockIdx.x;
    load(a, grp);                                  /* the first group before the wait */
    float nw[CH];
    if (mine && norm_w) load_x8(norm_w + k, nw);
    griddep_wait();                                /* x is the previous kernel's output */
    griddep_launch();
    float xv[CH];
    cols_x8(xv, x, k, mine, sg, in, norm_w, nw, eps, xb_out);
    XQ8 xq = {};                                   /* q8 / q4: x as integers, once for all groups */
    if constexpr (is_q<W>) xq = quant_x8<W>(xv);
    __shared__ float red[2][8][R];
    int par = 0;
    auto finish = [&](const U (&c)[R], int gi) {   /* group gi's dots, warp sums, and its rows written */
        float acc[R] = {};
        if constexpr (!is_q<W>) {
            if (mine) chunk_dot<W, R>(c, in - k, [&](int, float f[8]) { for (int i = 0; i < 8; i++) f[i] = xv[i]; }, acc);
        } else {
            if (mine) cols8_dot<W, R>(c, xq, acc);
        }
        float v = warp_reduce_rows<R>(acc, lane);
        if (lane % (32 / R) == 0) red[par][warp][lane / (32 / R)] = v;
        __syncthreads();
        const int rr = gi * rg + tid;
        if (tid < rg && rr < rows) {
            float s = subgroup_sum<R>(red[par], sub, tid);
            if (bias) s += bias[rr];
            out[rr] = accumulate ? out[rr] + s : s;
        }
        par ^= 1;
    };
    for (;;) {                                     /* unrolled by two: a and b stay registers */
        const int g1 = grp + G, g2 = grp + 2 * G;
        if (g1 < ng) load(b, g1);
        finish(a, grp);
        if (g1 >= ng) break;
        if (g2 < ng) load(a, g2);
        finish(b, g1);
        if (g2 >= ng) break;
        grp = g2;
    }
}

__global__ void add_bias_kernel(float *y, const float *b, int n, int d) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < (size_t)n * d) y[i] += b[i % d];
}

/* ---- per-head q/k RMSNorm and NeoX RoPE ----
 * The same three steps in qk_norm_rope_kernel and in the two one-token attention kernels that do it themselves
 * (attention_decode_fused, attention_flash<KS>): x -> w * x / rms(x) with one [D] weight shared by all heads, then
 * the first rd dims rotated in pairs (d, d + rd / 2) by the angle pos * inv_freq[d mod rd / 2].
 * RoPE's table at position pos: cs[i] = cos(pos * inv_freq[i]) * scaling, sn[i] likewise (the threads of a block
 * share it, thread tid of nthreads filling every nthreads-th entry) */
__device__ __forceinline__ void rope_table(float *cs, float *sn, int pos, const float *inv_freq, int rd, float scaling,
                                           int tid, int nthreads) {
    for (int i = tid; i < rd / 2; i += nthreads) {
        float f = (float)pos * inv_freq[i];
        cs[i] = cosf(f) * scaling;
        sn[i] = sinf(f) * scaling;
    }
}
/* 1 / rms of a D-vector from each lane's sum of squares over its dims (a warp a vector) */
__device__ __forceinline__ float rms_inv(float ss, int D, float eps) { return 1.0f / sqrtf(warp_sum(ss) / D + eps); }
/* dim d of a normed vector after RoPE: x its value, xe its partner's (dim d + rd / 2, or d - rd / 2); past rd as is */
__device__ __forceinline__ float rope_dim(int d, int rd, float x, float xe, const float *cs, const float *sn) {
    if (d >= rd) return x;
    const int half = rd / 2, i = d < half ? d : d - half;
    return d < half ? x * cs[i] - xe * sn[i] : x * cs[i] + xe * sn[i];
}

/* The q/k norm, RoPE and the K/V append at row pos % rows, for n tokens (prefill, verify, the drafter and short
 * one-token contexts). A block a token (blockIdx.x) and four head vectors, a warp each: nh query heads, then nkv key
 * heads, then nkv value heads. q is rewritten in place in the projection buffer; k and v go to the cache. */
template <typename KV>
__global__ void qk_norm_rope_kernel(float *qkvg, int NQ, int nh, int nkv, int D, const float *q_norm,
                                    const float *k_norm, const float *inv_freq, int rd, float scaling,
                                    KV *kc, KV *vc, int rows, const int *pos_ptr, float eps) {
    TRACE_BLOCK();
    griddep_wait();
    griddep_launch();
    __shared__ float buf[4][256], cs[128], sn[128];    /* (D <= 256) */
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int t = blockIdx.x, vi = blockIdx.y * 4 + warp;
    int p = *pos_ptr + t, KVD = nkv * D;
    rope_table(cs, sn, p, inv_freq, rd, scaling, threadIdx.x, blockDim.x);
    __syncthreads();
    if (vi >= nh + 2 * nkv) return;
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
    float inv = rms_inv(ss, D, eps);
    float *b = buf[warp];
    for (int d = lane; d < D; d += 32) b[d] = nw[d] * (v[d] * inv);
    __syncwarp();
    int half = rd / 2;
    for (int d = lane; d < D; d += 32) {
        float o = rope_dim(d, rd, b[d], d < rd ? b[d < half ? d + half : d - half] : 0.0f, cs, sn);
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
 * WARPS warps x 16 query rows; tiles of 64 keys staged in shared memory with cp.async, double-buffered (the next
 * tile loads while this one is computed); the masks are applied only to tiles that cross a row's key window.
 * An fp8 cache (KV = fp8) fills the same bf16 tiles, widened (exactly) from 8-byte loads, so everything after the
 * load is the bf16 kernel's. With 4 warps the next tile's fp8 bytes go to registers before this tile's math and
 * are widened into the other buffer after it, so the loads overlap the math as cp.async does for bf16: 131K prefill
 * 15.6 s (bf16 cache: 17.5; the first version, which widened them before the math, 32.0). 1 warp keeps that simpler
 * form (its registers would not hold a tile's share).
 * With one split (prefill) the kernel finishes the rows itself (normalise, softplus gate) and attention_combine
 * is skipped. */
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *(uint32_t *)&v;
}
/* what pack_bf16 drops: lo + hi = the bf16 pair plus this pair, within 2^-16 of (lo, hi) */
__device__ __forceinline__ uint32_t pack_bf16_rest(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    float2 f = __bfloat1622float2(v);
    return pack_bf16(lo - f.x, hi - f.y);
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

/* What attention_flash<KS> (one token at long context) may take beyond the n-token kernel's arguments: the q / k
 * RMSNorm and RoPE of qk_norm_rope_kernel, done in the kernel when q_norm is set (that launch is then skipped). */
struct FlashLong {
    const float *q_norm, *k_norm, *inv_freq;
    int rd;
    float scaling, eps;
};
constexpr int FLASH_GMAX = 16;                      /* KS: query heads a kv head at most (one tile of 16 rows) */
/* K and V tiles of 64 keys, two buffers each; KS adds the group's q rows, a scratch row and RoPE's cos / sin */
constexpr int flash_smem_bytes(int D, bool ks = false) {
    return 4 * 64 * (D + 8) * (int)sizeof(bf16) + (ks ? (FLASH_GMAX + 1) * D * 4 + D * 4 : 0);
}
/* 8 e4m3 values to 8 bf16 values, exactly (every e4m3 value is a bf16 value) */
__device__ __forceinline__ uint4 fp8x8_to_bf16x8(uint2 w) {
    float f[8];
    fp8x4_to_f32(w.x, f);
    fp8x4_to_f32(w.y, f + 4);
    return make_uint4(pack_bf16(f[0], f[1]), pack_bf16(f[2], f[3]), pack_bf16(f[4], f[5]), pack_bf16(f[6], f[7]));
}

template <typename KV, int D, int WARPS, bool KS = false>
__global__ void __launch_bounds__(WARPS * 32)
attention_flash(const float *qkvg, int NQ, int n, int g, int nh, KV *kc, KV *vc, int rows,
                int KVD, const int *pos_ptr, int window, int causal, int nsplit, float *part_o, float2 *part_ml,
                float scale_log2, float *att, int gate_off, int gate_per_head, bf16 *att16, FlashLong fl) {
    TRACE_BLOCK();
    /* KS (one token's <= 16 rows): the warps share the rows and split each tile's keys, 16 each, then merge */
    constexpr int BM = KS ? 16 : 16 * WARPS, BN = 64, LD = D + 8;   /* +8: conflict-free ldmatrix rows */
    constexpr int NP = KS ? 1 : BN / 16, NT = 2 * NP;      /* 16-key blocks and 8-key tiles of a tile per warp */
    extern __shared__ __align__(16) unsigned char flash_smem[];           /* [2][BN][LD] K, then [2][BN][LD] V */
    bf16 (*Ks)[BN][LD] = reinterpret_cast<bf16 (*)[BN][LD]>(flash_smem);
    bf16 (*Vs)[BN][LD] = reinterpret_cast<bf16 (*)[BN][LD]>(flash_smem + 2 * BN * LD * sizeof(bf16));
    /* KS with q_norm set (fold): the group's q rows, normed and rotated, then a scratch row, after the tiles */
    const bool fold = KS && fl.q_norm;
    float (*qs)[D] = reinterpret_cast<float (*)[D]>(flash_smem + 4 * BN * LD * sizeof(bf16));
    float *cs = qs[FLASH_GMAX + 1], *sn = cs + D / 2;                          /* fold: RoPE's cos / sin at pos */
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
        rr[i] = row_first + (KS ? 0 : warp * 16) + gid + 8 * i;
        ok[i] = rr[i] < nrows;
        pr[i] = pos + (ok[i] ? rr[i] / g : 0);
        lo[i] = window ? pr[i] - window + 1 : 0;
        hi[i] = causal ? pr[i] : pos + n - 1;
    }
    float o[D / 8][4] = {};
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    /* keys every row of this block may see: tiles inside [lo_all, hi_all] need no mask */
    const int hi_all = pos + row_first / g, lo_all = window ? pos + row_last / g - window + 1 : 0;

    auto load = [&](int buf, int kt) {
        for (int c = threadIdx.x; c < BN * D / 8; c += WARPS * 32) {
            int key = c / (D / 8), ch = c % (D / 8), u = kt + key;
            bool valid = u < k_end;                                 /* beyond: zeros (no NaN from stale rows) */
            size_t off = valid ? (size_t)(u % rows) * KVD + (size_t)h * D + ch * 8 : 0;
            if constexpr (std::is_same<KV, bf16>::value) {
                cp_async16(&Ks[buf][key][ch * 8], kc + off, valid);
                cp_async16(&Vs[buf][key][ch * 8], vc + off, valid);
            } else {                                                /* fp8: 8 bytes, widened to bf16 */
                static_assert(std::is_same<KV, fp8>::value, "attention_flash reads bf16 or fp8 caches");
                const uint2 z = make_uint2(0, 0);
                *(uint4 *)&Ks[buf][key][ch * 8] = fp8x8_to_bf16x8(valid ? *(const uint2 *)(kc + off) : z);
                *(uint4 *)&Vs[buf][key][ch * 8] = fp8x8_to_bf16x8(valid ? *(const uint2 *)(vc + off) : z);
            }
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    /* fp8 with 4 warps: the next tile's bytes in registers during this tile's math (fetch), widened after (widen) */
    constexpr bool F8R = !std::is_same<KV, bf16>::value && WARPS == 4;
    constexpr int NC = F8R ? BN * D / 8 / (WARPS * 32) : 1;        /* 8-value chunks per thread and tile */
    uint2 k8[NC], v8[NC];
    auto fetch = [&](int kt) {
#pragma unroll
        for (int j = 0; j < NC; j++) {
            int c = threadIdx.x + j * WARPS * 32, key = c / (D / 8), ch = c % (D / 8), u = kt + key;
            size_t off = (size_t)(u % rows) * KVD + (size_t)h * D + ch * 8;
            k8[j] = u < k_end ? *(const uint2 *)(kc + off) : make_uint2(0, 0);
            v8[j] = u < k_end ? *(const uint2 *)(vc + off) : make_uint2(0, 0);
        }
    };
    auto widen = [&](int buf) {
#pragma unroll
        for (int j = 0; j < NC; j++) {
            int c = threadIdx.x + j * WARPS * 32, key = c / (D / 8), ch = c % (D / 8);
            *(uint4 *)&Ks[buf][key][ch * 8] = fp8x8_to_bf16x8(k8[j]);
            *(uint4 *)&Vs[buf][key][ch * 8] = fp8x8_to_bf16x8(v8[j]);
        }
    };
    /* One token (KS, launched with programmatic dependent launch): a first tile of keys all older than the token
     * was written by earlier steps, so it loads before the wait, while the previous kernel runs; q and the token's
     * own k / v are read after it. With the fold, RoPE's angles (they need only the position) are ready before it. */
    const bool early = KS && k_begin < k_end && min(k_end, k_begin + BN) <= pos;
    if (early) load(0, k_begin);
    if (fold) {
        rope_table(cs, sn, pos, fl.inv_freq, fl.rd, fl.scaling, threadIdx.x, WARPS * 32);
        __syncthreads();
    }
    griddep_wait();
    griddep_launch();
    if constexpr (KS)
        if (fold) {
            /* qk_norm_rope_kernel's math, a warp a vector: this group's g query heads into qs (every block: the
             * same values), and in the block whose keys end at the token, its key and value into the cache */
            const bool own = k_begin <= pos && pos < k_end;
            const size_t crow = (size_t)(pos % rows) * KVD + (size_t)h * D;
            constexpr int EL = (D + 31) / 32;                   /* dims a lane: lane, lane + 32, ... */
            for (int j = warp; j < g + (own ? 2 : 0); j += WARPS) {
                const float *src = qkvg + (j < g ? (size_t)(h * g + j) * D : (size_t)nh * D + (j - g) * KVD + h * D);
                float xv[EL], ss = 0.0f;
#pragma unroll
                for (int i = 0; i < EL; i++) {
                    const int d = lane + 32 * i;
                    xv[i] = d < D ? src[d] : 0.0f;
                    ss += xv[i] * xv[i];
                }
                if (j == g + 1) {                               /* v: as is */
#pragma unroll
                    for (int i = 0; i < EL; i++)
                        if (lane + 32 * i < D) vc[crow + lane + 32 * i] = from_f<KV>(xv[i]);
                    continue;
                }
                const float inv = rms_inv(ss, D, fl.eps);
                const float *nw = j < g ? fl.q_norm : fl.k_norm;
                float *b = qs[j < g ? j : FLASH_GMAX];
#pragma unroll
                for (int i = 0; i < EL; i++)
                    if (lane + 32 * i < D) b[lane + 32 * i] = nw[lane + 32 * i] * (xv[i] * inv);
                __syncwarp();
                const int half = fl.rd / 2;
#pragma unroll
                for (int i = 0; i < EL; i++) {
                    const int d = lane + 32 * i;
                    if (d < D) xv[i] = rope_dim(d, fl.rd, b[d], d < fl.rd ? b[d < half ? d + half : d - half] : 0.0f, cs, sn);
                }
                __syncwarp();
#pragma unroll
                for (int i = 0; i < EL; i++) {
                    const int d = lane + 32 * i;
                    if (d >= D) continue;
                    if (j < g) b[d] = xv[i];
                    else kc[crow + d] = from_f<KV>(xv[i]);
                }
            }
            __syncthreads();                                    /* q rows for every warp; k / v before the loads */
        }
    if (k_begin < k_end && !early) load(0, k_begin);
    /* Q fragments in registers for the whole key loop; KS (decode) also keeps what bf16 drops of q (qr) and of p,
     * a second MMA each: q.k and p.v as exact as the fused kernel's fp32 math, where the tensor cores are idle */
    uint32_t qf[D / 16][4], qr[KS ? D / 16 : 1][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++)
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const float *q = fold ? &qs[rr[i] % g][kk * 16 + tig * 2]
                                  : qkvg + (size_t)(rr[i] / g) * NQ + (size_t)(h * g + rr[i] % g) * D + kk * 16 + tig * 2;
            qf[kk][i] = ok[i] ? pack_bf16(q[0], q[1]) : 0u;
            qf[kk][2 + i] = ok[i] ? pack_bf16(q[8], q[9]) : 0u;
            if constexpr (KS) {
                qr[kk][i] = ok[i] ? pack_bf16_rest(q[0], q[1]) : 0u;
                qr[kk][2 + i] = ok[i] ? pack_bf16_rest(q[8], q[9]) : 0u;
            }
        }
    for (int kt = k_begin, it = 0; kt < k_end; kt += BN, it++) {
        const int buf = it & 1;
        if (kt + BN < k_end && F8R) fetch(kt + BN);                  /* widened into buf ^ 1 after the math */
        else if (kt + BN < k_end) load(buf ^ 1, kt + BN);           /* the next tile, into the other buffer */
        if (kt + BN >= k_end || F8R) asm volatile("cp.async.commit_group;" ::: "memory");
        asm volatile("cp.async.wait_group 1;" ::: "memory");       /* this tile has landed */
        __syncthreads();

        const int k0 = KS ? warp * 16 : 0;                          /* this warp's first key in the tile */
        float s[NT][4] = {};                                        /* S = Q K^T */
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++)
#pragma unroll
            for (int np = 0; np < NP; np++) {
                uint32_t b[4];
                int mi = lane >> 3, r = lane & 7;
                ldmatrix_x4(b, &Ks[buf][k0 + np * 16 + (mi >> 1) * 8 + r][kk * 16 + (mi & 1) * 8], false);
                mma_bf16(s[2 * np], qf[kk], b[0], b[1]);
                mma_bf16(s[2 * np + 1], qf[kk], b[2], b[3]);
                if constexpr (KS) {
                    mma_bf16(s[2 * np], qr[kk], b[0], b[1]);
                    mma_bf16(s[2 * np + 1], qr[kk], b[2], b[3]);
                }
            }
        float mx[2] = {-INFINITY, -INFINITY};                       /* mask, scale, row max */
        if (kt + BN <= k_end && kt + BN - 1 <= hi_all && kt >= lo_all) {
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) { s[nt][e] *= scale_log2; mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]); }
        } else {
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int i = e >> 1, u = kt + k0 + nt * 8 + tig * 2 + (e & 1);
                    bool valid = ok[i] && u < k_end && u <= hi[i] && u >= lo[i];
                    s[nt][e] = valid ? s[nt][e] * scale_log2 : -INFINITY;
                    mx[i] = fmaxf(mx[i], s[nt][e]);
                }
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
        for (int nt = 0; nt < NT; nt++)
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
        for (int kk = 0; kk < NP; kk++) {                           /* O += P V */
            uint32_t a[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]), pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                             pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
            uint32_t ar[4] = {};
            if constexpr (KS) {
                ar[0] = pack_bf16_rest(s[2 * kk][0], s[2 * kk][1]);
                ar[1] = pack_bf16_rest(s[2 * kk][2], s[2 * kk][3]);
                ar[2] = pack_bf16_rest(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                ar[3] = pack_bf16_rest(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            }
#pragma unroll
            for (int dp = 0; dp < D / 16; dp++) {
                uint32_t b[4];
                int mi = lane >> 3, r = lane & 7;
                ldmatrix_x4(b, &Vs[buf][k0 + kk * 16 + (mi & 1) * 8 + r][dp * 16 + (mi >> 1) * 8], true);
                mma_bf16(o[2 * dp], a, b[0], b[1]);
                mma_bf16(o[2 * dp + 1], a, b[2], b[3]);
                if constexpr (KS) {
                    mma_bf16(o[2 * dp], ar, b[0], b[1]);
                    mma_bf16(o[2 * dp + 1], ar, b[2], b[3]);
                }
            }
        }
        if constexpr (F8R)
            if (kt + BN < k_end) widen(buf ^ 1);                    /* buf ^ 1 was last read before the last sync */
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    }
    if constexpr (KS) {
        /* merge the warps' (max, sum, output) of the shared rows through shared memory (the tiles are done); warp 0
         * goes on with the merged row, in warp order */
        asm volatile("cp.async.wait_group 0;" ::: "memory");
        float *ow = reinterpret_cast<float *>(flash_smem);                         /* [WARPS][16][D] */
        float2 *ml = reinterpret_cast<float2 *>(flash_smem + WARPS * 16 * D * sizeof(float));   /* [WARPS][16] */
#pragma unroll
        for (int i = 0; i < 2; i++) {
            int r = gid + 8 * i;
#pragma unroll
            for (int dt = 0; dt < D / 8; dt++)
                *(float2 *)&ow[((size_t)warp * 16 + r) * D + dt * 8 + tig * 2] = make_float2(o[dt][2 * i], o[dt][2 * i + 1]);
            if (tig == 0) ml[warp * 16 + r] = make_float2(m[i], l[i]);
        }
        __syncthreads();
        if (warp != 0) return;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            int r = gid + 8 * i;
            float M = -INFINITY, w[WARPS];
#pragma unroll
            for (int k = 0; k < WARPS; k++) M = fmaxf(M, ml[k * 16 + r].x);
            l[i] = 0.0f;
#pragma unroll
            for (int k = 0; k < WARPS; k++) {
                w[k] = M == -INFINITY ? 0.0f : exp2f(ml[k * 16 + r].x - M);
                l[i] += ml[k * 16 + r].y * w[k];
            }
            m[i] = M;
#pragma unroll
            for (int dt = 0; dt < D / 8; dt++) {
                float a = 0.0f, b = 0.0f;
#pragma unroll
                for (int k = 0; k < WARPS; k++) {
                    float2 v = *(const float2 *)&ow[((size_t)k * 16 + r) * D + dt * 8 + tig * 2];
                    a += v.x * w[k];
                    b += v.y * w[k];
                }
                o[dt][2 * i] = a;
                o[dt][2 * i + 1] = b;
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        if (!ok[i]) continue;
        if (nsplit == 1) {                                          /* the whole row: normalise and gate here */
            int t = rr[i] / g, hd = h * g + rr[i] % g;
            const float *gate = qkvg + (size_t)t * NQ + gate_off;
            float *out = att + ((size_t)t * nh + hd) * D;
#pragma unroll
            for (int dt = 0; dt < D / 8; dt++)
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    int d = dt * 8 + tig * 2 + j;
                    float gt = gate_off < 0 ? 1.0f : softplus(gate[gate_per_head ? hd : hd * D + d]);   /* < 0: no gate */
                    out[d] = o[dt][2 * i + j] / l[i] * gt;
                    if (att16) att16[((size_t)t * nh + hd) * D + d] = __float2bfloat16(out[d]);
                }
            continue;
        }
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

/* Plain fp32 attention (f32 caches, and any cache of an f32 file: the tiny fixtures): one warp per (token, query
 * head), lanes split the head dims, online softmax key by key. Simple and slow; the bf16 path above is the fast one. */
template <typename KV>
__global__ void attention_scalar(const float *qkvg, int NQ, int n, int g, int nh, int D, const KV *kc,
                                 const KV *vc, int rows, int KVD, const int *pos_ptr, int window, int causal,
                                 float *part_o, float2 *part_ml, float scale_log2) {
    TRACE_BLOCK();
    griddep_wait();
    griddep_launch();
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

/* Decode attention with the q/k RMSNorm, RoPE and K/V append folded in (one query token; bf16, f32 or fp8 cache; g <= 8;
 * D 16..128): grid (kv head, split), 256 threads; a split is a run of tiles of KT = 4096 / D keys (32 at D = 128).
 * Per tile each thread holds 2 chunks (8 dims each) of K and 2 of V in registers: K as 2 neighbouring chunks of one
 * key (CH / 2 lanes per key, so a score is a 3-step shuffle at D = 128), V as the same dim chunk of 2 keys.
 * - Splits past the context's keys exit at once (the grid is sized for the whole window; the active ones count).
 * - The first tile's cache rows and RoPE's angles are taken before the wait on the q/k/v/g matvec: only the new
 *   key's row is written this step, and it comes from shared memory instead (pos itself is written before the
 *   step's kernels).
 * - After the wait each block norms and ropes its group's q heads and the new k (v as is): a warp a vector, in the
 *   registers the vector is loaded into (D >= 32 with rd / 2 a multiple of 32: +1.0% decode, dev/gpu_notes.md
 *   round 18), else through a copy in shared memory (16-byte loads, all in flight at once, round 16); the block that
 *   owns the new key writes it to the cache (rounded to the cache type, as used here).
 * - Per tile: scores (each thread's partial dots for every head, then one transposing shuffle reduction) and the
 *   tile's values (unpacked to f32) to shared memory; per head the running max and sum (fixed shuffle trees); then
 *   p . V with a thread a dim for HP = max(1, 8 D / 256) heads, so an output needs no sum across threads (round
 *   15's warp a head: +2.0% / +0.9%; a thread a dim: 0.27 us less in the trace, round 16).
 *   The next tile's loads are issued before the current one is computed.
 * - The last active block of each kv head merges the splits in split order (deterministic) and applies the gate;
 *   with CL > 0 (on sm_90: sliding layers, and full layers that never see more than full_cluster_keys keys) the CL
 *   splits of a kv head are one thread-block cluster instead, and block j merges head j from the others' shared
 *   memory (no fence, counter or global partials). */
struct KV8 { uint4 a, b; };   /* 8 cache values in flight: fp8 uses a.x and a.y, bf16 a, f32 a and b */
__device__ __forceinline__ KV8 kv_raw(const fp8 *p) {
    uint2 w = ld_stream8(p);
    KV8 r;
    r.a = make_uint4(w.x, w.y, 0, 0);
    r.b = make_uint4(0, 0, 0, 0);
    return r;
}
__device__ __forceinline__ KV8 kv_raw(const bf16 *p) { KV8 r; r.a = ld_stream(p); r.b = make_uint4(0, 0, 0, 0); return r; }
__device__ __forceinline__ KV8 kv_raw(const float *p) { KV8 r; r.a = ld_stream(p); r.b = ld_stream(p + 4); return r; }
__device__ __forceinline__ void kv_unpack(const KV8 &r, const fp8 *, float f[8]) { fp8x4_to_f32(r.a.x, f); fp8x4_to_f32(r.a.y, f + 4); }
__device__ __forceinline__ void kv_unpack(const KV8 &r, const bf16 *, float f[8]) { to_f32x8(r.a, f); }
__device__ __forceinline__ void kv_unpack(const KV8 &r, const float *, float f[8]) { memcpy(f, &r.a, 16); memcpy(f + 4, &r.b, 16); }

/* attention_decode_fused keeps q (per head, D floats) in shared memory with its 16-byte chunks swizzled: chunk c at
 * c ^ ((c >> 3) & 3). The scores loop's KL threads of a key read 4 consecutive chunks each, 64 bytes apart; in order,
 * those fall into 2 of the 8 16-byte bank groups (4-way conflicts on every read), swizzled into all 8. The loop took
 * ~3.8 us of the kernel's ~11 at 512 keys before; the swizzle alone made decode 4.3% faster (dev/gpu_notes.md,
 * round 11). */
__device__ __forceinline__ int qs_swz(int d) {
    const int c = d >> 2;
    return ((c ^ ((c >> 3) & 3)) << 2) | (d & 3);
}

/* this thread's K chunks (2 of key t0 + tid / KL) and V chunks (chunk tid % CH of keys t0 + tid / CH, + KT / 2);
 * keys past ke and the new key (pos) are zeros */
template <typename KV, int D>
__device__ __forceinline__ void kv_tile_load(const KV *kc, const KV *vc, int rows, int KVD, int kvh, int t0, int ke,
                                             int pos, KV8 kr[2], KV8 vr[2]) {
    constexpr int CH = D / 8, KT = 512 / CH, KL = CH / 2;
    const int tid = threadIdx.x, uk = t0 + tid / KL;
    const KV8 z = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
#pragma unroll
    for (int i = 0; i < 2; i++) {
        kr[i] = uk < ke && uk != pos ? kv_raw(kc + (size_t)(uk % rows) * KVD + kvh * D + (2 * (tid % KL) + i) * 8) : z;
        int uv = t0 + tid / CH + i * (KT / 2);
        vr[i] = uv < ke && uv != pos ? kv_raw(vc + (size_t)(uv % rows) * KVD + kvh * D + (tid % CH) * 8) : z;
    }
}

#ifndef LAGUNA_NORM_REG
#define LAGUNA_NORM_REG 1
#endif
template <typename KV, int D, int CL>
__global__ void __launch_bounds__(256, 2)
attention_decode_fused(const float *qkvg, int g, int nh, int nkv, KV *kc, KV *vc, int rows, int KVD,
                       const int *pos_ptr, int window, int nsplit, const float *q_norm, const float *k_norm,
                       const float *inv_freq, int rd, float rscale, float eps, float *part_o, float2 *part_ml,
                       int *counter, float *att, int gate_off, int gate_per_head, float scale_log2) {
    TRACE_BLOCK();
    constexpr int G = 8, CH = D / 8, KT = 512 / CH, KL = CH / 2;
    __shared__ __align__(16) float qs[G][D];            /* q, normed, roped, times scale * log2(e) */
    __shared__ __align__(16) float kn[D], vn[D];        /* the new key and value, as the cache holds them */
    __shared__ float cs[D / 2], sn[D / 2], hm[G], hl[G], hc[G], sw[CL ? 1 : 128][G], sL[G];   /* sw: !CL's merge */
    __shared__ float nws[2][D];                         /* q_norm, k_norm: weights, read before the wait */
    /* p . V: thread tid owns dim pd of heads ph0 .. ph0 + HP - 1 (D = 16: the upper 128 threads have none) */
    constexpr int GR = 256 / D < G ? 256 / D : G, HP = G / GR;
    const int pd = threadIdx.x % D, ph0 = (threadIdx.x / D) * HP;
    __shared__ __align__(16) float pt[KT][G];           /* the tile's probabilities, key-major */
    __shared__ __align__(16) union { float raw[G + 2][D]; float sc[G][KT]; } sm;
    __shared__ __align__(16) float vs[KT][D];           /* the tile's values, unpacked */
    __shared__ int last;
    if constexpr (CL) cluster_arrive_relaxed();     /* phase 0: this block has started (its shared memory exists) */
    const int kvh = blockIdx.x, split = blockIdx.y, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int pos = *pos_ptr, kmin = window ? max(0, pos - window + 1) : 0, keys = pos - kmin + 1;
    const int per = ((keys + nsplit - 1) / nsplit + KT - 1) / KT * KT, nact = (keys + per - 1) / per;
    const int kb = kmin + split * per, ke = min(pos + 1, kb + per);
    if (!CL && split >= nact) return;                   /* no keys here (the grid is sized for the whole context) */
    KV8 kr[2], vr[2];
    kv_tile_load<KV, D>(kc, vc, rows, KVD, kvh, kb, ke, pos, kr, vr);    /* before the wait: older rows only */
    rope_table(cs, sn, pos, inv_freq, rd, rscale, tid, 256);   /* RoPE's angles need only the position: also before */
    for (int i = tid; i < D; i += 256) { nws[0][i] = q_norm[i]; nws[1][i] = k_norm[i]; }
    /* REG: a warp a vector straight from global memory into registers, lane l holding dims l, l + 32, ...: the sum
     * of squares in the same order as the shared-memory path below (so the same bits), and each dim's RoPE partner
     * (d -+ rd / 2, a multiple of 32 away) in the same lane. Needs D >= 32 and rd / 2 % 32 == 0 (every XS layer);
     * saves the raw copy through shared memory and a block barrier (dev/gpu_notes.md, round 18). */
    const bool reg = LAGUNA_NORM_REG && D >= 32 && (rd / 2) % 32 == 0;
    if (reg) __syncthreads();                           /* the tables above, read without the raw copy's barrier */
    griddep_wait();                                     /* q/k/v/g come from the matvec */
    griddep_launch();
    const bool owner = kb <= pos && pos < ke;
    const size_t crow = (size_t)(pos % rows) * KVD + (size_t)kvh * D;
    /* element d of vector j (j < g: a q head, g: the key), normed and rotated; xd its raw value, xe that of its RoPE
     * partner (dim d -+ rd / 2), inv the vector's 1 / rms */
    auto qk_elem = [&](int j, int d, float xd, float xe, float inv) {
        const float *nw = nws[j < g ? 0 : 1];
        const int e = d < rd / 2 ? d + rd / 2 : d - rd / 2;
        return rope_dim(d, rd, nw[d] * (xd * inv), d < rd ? nw[e] * (xe * inv) : 0.0f, cs, sn);
    };
    auto put = [&](int j, int d, float o) {             /* a q head's element scaled into qs; k / v into the cache */
        if (j < g) { qs[j][qs_swz(d)] = o * scale_log2; return; }
        KV e = from_f<KV>(o);
        if (j == g) { kn[d] = to_f(e); if (owner) kc[crow + d] = e; }
        else { vn[d] = to_f(e); if (owner) vc[crow + d] = e; }
    };
    auto src_of = [&](int j) {                          /* vector j's row in qkvg: q heads of this group, k, v */
        return j < g ? (kvh * g + j) * D : j == g ? (nh + kvh) * D : (nh + nkv + kvh) * D;
    };
    /* CL: block j of the cluster (its split: the cluster spans the splits) merges head j; its gate now, not after
     * the merge's barriers */
    const bool has_gate = CL && split < g && tid < D && gate_off >= 0;
    const int hd = kvh * g + split;
    float gate_v = 1.0f;
    if (reg) {
        constexpr int EL = D >= 32 ? D / 32 : 1;        /* dims a lane */
        float xr[2][EL];                                /* vectors warp and warp + 8 (g + 2 <= 10) */
#pragma unroll
        for (int r = 0; r < 2; r++)
            if (warp + 8 * r < g + 2)
#pragma unroll
                for (int i = 0; i < EL; i++) xr[r][i] = qkvg[src_of(warp + 8 * r) + lane + 32 * i];
        const float graw = has_gate ? qkvg[gate_off + (gate_per_head ? hd : hd * D + tid)] : 0.0f;
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int j = warp + 8 * r;
            if (j >= g + 2) break;
            if (j == g + 1) {                           /* v: as is */
#pragma unroll
                for (int i = 0; i < EL; i++) put(j, lane + 32 * i, xr[r][i]);
                continue;
            }
            float ss = 0.0f;
#pragma unroll
            for (int i = 0; i < EL; i++) ss += xr[r][i] * xr[r][i];
            const float inv = rms_inv(ss, D, eps);
            if (r == 0) TRACE_MARK_IF(1, 0);            /* (set 1: thread 0's first vector in and its norm) */
            const int hs = rd / 64;                     /* the partner: hs elements of this lane away */
#pragma unroll
            for (int i = 0; i < EL; i++) {
                const int d = lane + 32 * i, ip = d < rd ? (d < rd / 2 ? i + hs : i - hs) : i;
                float xe = 0.0f;
#pragma unroll
                for (int k = 0; k < EL; k++) if (k == ip) xe = xr[r][k];   /* (registers: a static index) */
                put(j, d, qk_elem(j, d, xr[r][i], xe, inv));
            }
        }
        TRACE_MARK_IF(1, 1);                            /* (set 1: warp 0's vectors done) */
        if (has_gate) gate_v = softplus(graw);
        if (tid < G) { hm[tid] = -INFINITY; hl[tid] = 0.0f; }
        __syncthreads();
        TRACE_MARK_IF(0, 0);
        TRACE_MARK_IF(1, 2);
        TRACE_MARK_IF(2, 0);
    } else {
        /* the raw vectors into shared memory (16-byte loads, all of this thread's and the gate's issued before the
         * first store: one round trip), then a warp a vector: its norm and RoPE */
        constexpr int NR = ((G + 2) * D / 4 + 255) / 256;
        const int nr = (g + 2) * (D / 4);
        float4 rv[NR];
#pragma unroll
        for (int u = 0; u < NR; u++) {
            const int i = tid + 256 * u, j = i / (D / 4), d = (i % (D / 4)) * 4;
            if (i < nr) rv[u] = *(const float4 *)(qkvg + src_of(j) + d);
        }
        const float graw = has_gate ? qkvg[gate_off + (gate_per_head ? hd : hd * D + tid)] : 0.0f;
#pragma unroll
        for (int u = 0; u < NR; u++) {
            const int i = tid + 256 * u, j = i / (D / 4), d = (i % (D / 4)) * 4;
            if (i < nr) *(float4 *)&sm.raw[j][d] = rv[u];
        }
        if (has_gate) gate_v = softplus(graw);
        if (tid < G) { hm[tid] = -INFINITY; hl[tid] = 0.0f; }
        __syncthreads();
        TRACE_MARK_IF(0, 0);
        for (int j = warp; j < g + 2; j += 8) {
            const float *b = sm.raw[j];
            if (j == g + 1) {                           /* v: as is */
                for (int d = lane; d < D; d += 32) put(j, d, b[d]);
                continue;
            }
            float ss = 0.0f;
            for (int d = lane; d < D; d += 32) ss += b[d] * b[d];
            const float inv = rms_inv(ss, D, eps);
            for (int d = lane; d < D; d += 32) {
                const int half = rd / 2;
                put(j, d, qk_elem(j, d, b[d], d < rd ? b[d < half ? d + half : d - half] : 0.0f, inv));
            }
        }
    }
    __syncthreads();
    TRACE_MARK_IF(0, 1);

    float o[HP];                                        /* heads ph0 + i's output at dim pd */
#pragma unroll
    for (int i = 0; i < HP; i++) o[i] = 0.0f;
    for (int t0 = kb; t0 < ke; t0 += KT) {
        KV8 nk[2], nv[2];
        if (t0 + KT < ke) kv_tile_load<KV, D>(kc, vc, rows, KVD, kvh, t0 + KT, ke, pos, nk, nv);
        /* scores */
        const int uk = t0 + tid / KL, c0 = 2 * (tid % KL);
        int qo[4];                                      /* this thread's 4 chunks of q (swizzled) */
#pragma unroll
        for (int i = 0; i < 4; i++) qo[i] = qs_swz(c0 * 8 + 4 * i);
        float kf[2][8];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            if (uk == pos) load_x8(kn + (c0 + i) * 8, kf[i]);
            else kv_unpack(kr[i], kc, kf[i]);
        }
        if (t0 == kb && kf[0][0] != 1.2345e-30f) { TRACE_MARK_IF(1, 3); TRACE_MARK_IF(2, 1); }   /* (thread 0's K in) */
        /* every head's partial dot first (8 independent sums; before, a head at a time with its own butterfly, not
         * unrolled: 0.13 us more in the trace, round 16), then a transposing reduction over the key's KL lanes:
         * at each step a lane keeps half of its heads and sends the other half to its partner, which adds them to its
         * own (log2 KL steps, G - G / KL shuffles instead of g log2 KL); the lanes' partials meet in the same order
         * as the plain butterfly's, so the scores are the same bits */
        {
            float sv[G];
#pragma unroll
            for (int j = 0; j < G; j++) {
                float qa[8], qb[8];
                *(float4 *)&qa[0] = *(const float4 *)&qs[j][qo[0]];
                *(float4 *)&qa[4] = *(const float4 *)&qs[j][qo[1]];
                *(float4 *)&qb[0] = *(const float4 *)&qs[j][qo[2]];
                *(float4 *)&qb[4] = *(const float4 *)&qs[j][qo[3]];
                sv[j] = j < g ? dot8(qa, kf[0]) + dot8(qb, kf[1]) : 0.0f;
            }
            if (t0 == kb && sv[0] != 1.2345e-30f) TRACE_MARK_IF(2, 2);   /* (set 2: the dots done) */
            int n = G, base = 0;                        /* this lane holds heads base .. base + n - 1 */
#pragma unroll
            for (int off = 1; off < KL; off <<= 1) {
                n /= 2;
                const bool up = (tid & off) != 0;       /* keeps the upper half of its heads */
#pragma unroll
                for (int i = 0; i < G / 2; i++) {
                    if (i >= n) break;
                    const float send = up ? sv[i] : sv[i + n], keep = up ? sv[i + n] : sv[i];
                    sv[i] = keep + __shfl_xor_sync(0xffffffffu, send, off);
                }
                base += up ? n : 0;
            }
#pragma unroll
            for (int i = 0; i < G; i++)
                if (i < n && base + i < g) sm.sc[base + i][tid / KL] = uk < ke ? sv[i] : -INFINITY;
            if (t0 == kb) TRACE_MARK_IF(2, 3);          /* (set 2: reduced and stored) */
        }
        {                                               /* this thread's 2 V chunks into vs */
            const int vk = tid / CH, dc = (tid % CH) * 8;
#pragma unroll
            for (int i = 0; i < 2; i++) {
                float vf[8];
                if (t0 + vk + i * (KT / 2) == pos) load_x8(vn + dc, vf);
                else kv_unpack(vr[i], vc, vf);
                *(float4 *)&vs[vk + i * (KT / 2)][dc] = make_float4(vf[0], vf[1], vf[2], vf[3]);
                *(float4 *)&vs[vk + i * (KT / 2)][dc + 4] = make_float4(vf[4], vf[5], vf[6], vf[7]);
            }
        }
        if (t0 == kb) { TRACE_MARK_IF(1, 4); TRACE_MARK_IF(2, 4); }   /* (thread 0's scores and V stored) */
        __syncthreads();
        if (t0 == kb) { TRACE_MARK_IF(0, 2); TRACE_MARK_IF(1, 5); TRACE_MARK_IF(2, 5); }
        /* per head: the running max, this tile's probabilities and the running sum */
        for (int j = warp; j < g; j += 8) {
            float mx = -INFINITY;
            for (int k = lane; k < KT; k += 32) mx = fmaxf(mx, sm.sc[j][k]);
            mx = warp_max(mx);
            float mo = hm[j], mn = fmaxf(mo, mx), corr = exp2f(mo - mn), sum = 0.0f;
            for (int k = lane; k < KT; k += 32) { float p = exp2f(sm.sc[j][k] - mn); pt[k][j] = p; sum += p; }
            sum = warp_sum(sum);
            __syncwarp();                               /* every lane has read hm[j]: lane 0 may rewrite it (a shuffle
                                                         * orders no memory; compute-sanitizer's racecheck) */
            if (lane == 0) { hl[j] = hl[j] * corr + sum; hm[j] = mn; hc[j] = corr; }
        }
        __syncthreads();
        if (t0 == kb) TRACE_MARK_IF(0, 3);
        /* p . V: a thread a dim, for HP heads, over the tile's keys, so nothing is summed across threads afterwards;
         * per key one value and HP probabilities (one 16-byte read at D = 128) from shared memory. (A warp a head,
         * lanes owning dims, the same sums in the same order: 4 value reads a key at D = 128, ~0.27 us slower in the
         * trace, dev/gpu_notes.md round 16.) */
        if (ph0 < g) {
#pragma unroll
            for (int i = 0; i < HP; i++) o[i] *= ph0 + i < g ? hc[ph0 + i] : 0.0f;
#pragma unroll 4
            for (int t = 0; t < KT; t++) {
                const float v = vs[t][pd];
                float p[HP];
                if constexpr (HP == 4) {
                    const float4 q4 = *(const float4 *)&pt[t][ph0];
                    p[0] = q4.x; p[1] = q4.y; p[2] = q4.z; p[3] = q4.w;
                } else if constexpr (HP == 2) {
                    const float2 q2 = *(const float2 *)&pt[t][ph0];
                    p[0] = q2.x; p[1] = q2.y;
                } else {
#pragma unroll
                    for (int i = 0; i < HP; i++) p[i] = pt[t][ph0 + i];
                }
#pragma unroll
                for (int i = 0; i < HP; i++) o[i] += p[i] * v;
            }
        }
        __syncthreads();                                /* sc, pt and vs are rewritten by the next tile */
        if (t0 == kb) TRACE_MARK_IF(0, 4);
#pragma unroll
        for (int i = 0; i < 2; i++) { kr[i] = nk[i]; vr[i] = nv[i]; }
    }
    /* CL: block j's inbox, split s's unnormalised output of head j and its (max, sum); the other blocks write it */
    __shared__ __align__(16) float inbox[CL ? CL : 1][D];
    __shared__ float2 inbox_ml[CL ? CL : 1];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    namespace cg = cooperative_groups;
    if constexpr (CL) {                                 /* phase 0 done: every block of the cluster is running */
        cluster_wait_acquire();
        if (tid < g) cg::this_cluster().map_shared_rank(inbox_ml, tid)[split] = make_float2(hm[tid], hl[tid]);
    }
#endif
    if (kb < ke) {
        const size_t pbase = ((size_t)kvh * nsplit + split) * g;
#pragma unroll
        for (int i = 0; i < HP; i++) {
            const int h = ph0 + i;
            if (h >= g) break;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
            if constexpr (CL) cg::this_cluster().map_shared_rank(&inbox[0][0], h)[split * D + pd] = o[i];
            else
#endif
                part_o[(pbase + h) * D + pd] = o[i];
        }
        if (!CL && tid < g) part_ml[pbase + tid] = make_float2(hm[tid], hl[tid]);
    } else if constexpr (CL) {                          /* a split without keys: weight 0 in the merge */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        for (int i = tid; i < g * D; i += 256) cg::this_cluster().map_shared_rank(&inbox[0][0], i / D)[split * D + i % D] = 0.0f;
#endif
    }
    if constexpr (CL) {
        /* The kv head's CL splits are one thread-block cluster: each block has written its (max, sum) and output of
         * head j into block j's inbox (distributed shared memory: stores, no round trips); after one cluster barrier
         * (release / acquire) block j merges head j from its own shared memory (threads = dims; splits in order). No
         * fence, counter or global round trip; nothing is read remotely, so no second barrier. */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        TRACE_MARK_IF(0, 5);
        cluster_arrive_release();
        cluster_wait_acquire();
        const int j = split;                            /* the head this block merges (gate_v is its gate) */
        if (j < g && tid < D) {
            float M = -INFINITY, L = 0.0f, acc = 0.0f;
            for (int r = 0; r < CL; r++) M = fmaxf(M, inbox_ml[r].x);
            for (int r = 0; r < CL; r++) {
                float w = exp2f(inbox_ml[r].x - M);
                L += inbox_ml[r].y * w;
                acc += inbox[r][tid] * w;
            }
            att[(size_t)(kvh * g + j) * D + tid] = acc / L * gate_v;
        }
#else
        __trap();                                       /* clusters need sm_90: the host never picks CL then */
#endif
        return;
    }
    /* the last block of this kv head merges the active splits and applies the gate */
    __threadfence();
    __syncthreads();
    if (tid == 0) last = atomicAdd(&counter[kvh], 1) == nact - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (warp < g) {                                     /* warp j: split weights of head j */
        int j = warp;
        float M = -INFINITY, L = 0.0f;
        for (int s = lane; s < nact; s += 32) M = fmaxf(M, __ldcg(&part_ml[((size_t)kvh * nsplit + s) * g + j].x));
        M = warp_max(M);
        for (int s = lane; s < nact; s += 32) {
            float2 ml = __ldcg(&part_ml[((size_t)kvh * nsplit + s) * g + j]);
            float w = exp2f(ml.x - M);
            sw[s][j] = w;
            L += ml.y * w;
        }
        L = warp_sum(L);
        if (lane == 0) sL[j] = L;
    }
    __syncthreads();
    for (int c = tid; c < g * D / 4; c += 256) {        /* 4 dims of one head per thread */
        int j = c / (D / 4), d = (c % (D / 4)) * 4;
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 4
        for (int s = 0; s < nact; s++) {
            float w = sw[s][j];
            float4 v = __ldcg((const float4 *)&part_o[(((size_t)kvh * nsplit + s) * g + j) * D + d]);
            acc.x += v.x * w; acc.y += v.y * w; acc.z += v.z * w; acc.w += v.w * w;
        }
        int hd = kvh * g + j;
        const float *gate = qkvg + gate_off;
        float a[4] = {acc.x, acc.y, acc.z, acc.w};
        for (int i = 0; i < 4; i++)
            att[(size_t)hd * D + d + i] = a[i] / sL[j] * (gate_off < 0 ? 1.0f : softplus(gate[gate_per_head ? hd : hd * D + d + i]));
    }
    if (tid == 0) counter[kvh] = 0;
}

/* Merge the splits of each (token, head), then the softplus output gate (per head or per element; none when
 * gate_off < 0: a drafter with gating disabled).
 * The split weights go through shared memory; splits left empty by a short context are skipped. */
__global__ void attention_combine(float *att, const float *part_o, const float2 *part_ml, int nsplit, int nh,
                                  int D, const float *qkvg, int NQ, int gate_off, int gate_per_head, bf16 *att16) {
    TRACE_BLOCK();
    griddep_wait();
    griddep_launch();
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
        const float v = acc / L * gt;
        att[((size_t)t * nh + hd) * D + d] = v;
        if (att16) att16[((size_t)t * nh + hd) * D + d] = __float2bfloat16(v);
    }
}

/* One token's merge (decode: n * nh = 48 blocks at XS-2.1, latency-bound): the same math as attention_combine, but
 * a block is SG = ceil(nsplit / 16) groups of threads, a thread per head dim in each; group j takes splits j, j + SG,
 * ... and loads all of them at once with their running max and sum, so the merge waits for one trip to L2, not one a
 * split (attention_combine took 10.4 us a full layer at 8K beside o_proj's early weight loads, this 4.9, in the
 * decode trace: round 38 in dev/gpu_notes.md). The groups' max, sum and output meet in shared memory; splits left
 * empty (sum 0) are skipped. Not for many rows: at 64 registers its blocks made the 16-token verify's 1,024-block
 * merge 0.5-1% slower than attention_combine's. */
constexpr int COMBINE_PER = 16, COMBINE_SG = 4;    /* splits a group at most; groups (nsplit <= 64: split_for) */
static dim3 combine_block(int nsplit, int D) { return dim3((nsplit + COMBINE_PER - 1) / COMBINE_PER * (D < 32 ? 32 : D)); }
__global__ void __launch_bounds__(COMBINE_SG * 128)
attention_combine_one(float *att, const float *part_o, const float2 *part_ml, int nsplit, int nh, int D,
                      const float *qkvg, int NQ, int gate_off, int gate_per_head, bf16 *att16) {
    TRACE_BLOCK();
    griddep_wait();
    griddep_launch();
    __shared__ float3 part[COMBINE_SG][128];       /* a group's (max, sum, output) per head dim (D <= 128) */
    const int SG = (nsplit + COMBINE_PER - 1) / COMBINE_PER, W = blockDim.x / SG, j = threadIdx.x / W,
              d = threadIdx.x % W;
    const int t = blockIdx.x / nh, hd = blockIdx.x % nh;
    const size_t idx = (size_t)blockIdx.x * nsplit;
    if (d < D) {
        float2 ml[COMBINE_PER];
        float v[COMBINE_PER];
#pragma unroll
        for (int i = 0; i < COMBINE_PER; i++) {
            const int s = j + i * SG;
            ml[i] = s < nsplit ? part_ml[idx + s] : make_float2(-INFINITY, 0.0f);
            v[i] = s < nsplit ? part_o[(idx + s) * D + d] : 0.0f;
        }
        float m = -INFINITY, l = 0.0f, o = 0.0f;
#pragma unroll
        for (int i = 0; i < COMBINE_PER; i++) if (ml[i].y > 0.0f) m = fmaxf(m, ml[i].x);
#pragma unroll
        for (int i = 0; i < COMBINE_PER; i++)
            if (ml[i].y > 0.0f) {
                const float w = exp2f(ml[i].x - m);
                l += ml[i].y * w;
                o += v[i] * w;
            }
        part[j][d] = make_float3(m, l, o);
    }
    __syncthreads();
    if (j != 0 || d >= D) return;
    float M = -INFINITY, L = 0.0f, O = 0.0f;
    for (int k = 0; k < SG; k++) M = fmaxf(M, part[k][d].x);
    for (int k = 0; k < SG; k++)
        if (part[k][d].y > 0.0f) {
            const float w = exp2f(part[k][d].x - M);
            L += part[k][d].y * w;
            O += part[k][d].z * w;
        }
    const float *gate = qkvg + (size_t)t * NQ + gate_off;
    const float gt = gate_off < 0 ? 1.0f : softplus(gate[gate_per_head ? hd : hd * D + d]);
    const float out = O / L * gt;
    att[((size_t)t * nh + hd) * D + d] = out;
    if (att16) att16[((size_t)t * nh + hd) * D + d] = __float2bfloat16(out);
}

/* ---- MoE ----
 * Routing: sigmoid router (optional tanh softcap), top-k of score + correction bias (ties to the lower id), weights
 * = unbiased scores renormalised; then the plan: the (token, slot) pairs sorted by expert so each active expert's
 * weights are read once: start[e]..start[e+1] are expert e's pairs, pair_tok / pair_w their token and weight,
 * inv[t*K + j] where pair (t, j) went, active[0..n_active) the experts used (ascending). One token: router_decode;
 * n > 1: route_many_topk, route_many_scan, route_many_scatter (below). */
/* One token's routing, by one warp: sigmoid (optional tanh softcap) of the logits in place, top-k of
 * score + correction bias (ties to the lower id), weights = the unbiased scores renormalised. */
__device__ void route_token(float *lg, const float *bias, int E, int K, float softcap, int *idx, float *wt) {
    int lane = threadIdx.x & 31;
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
        if (lane == 0) { idx[j] = be; wt[j] = w; }
    }
    __syncwarp();
    if (lane < K) wt[lane] /= sum;
}

/* One token's routing by one block (router_decode's last block). An expert's rank is how many experts beat it
 * (greater score + bias, or equal with a lower id: route_token's order); rank < K makes it slot `rank`. Only
 * candidates are ranked: the block's threads form G >= K groups (lanes of a warp, G = 8, 16 or 32) and each group's
 * best value belongs to a different expert, so the K-th best value is at least T, the smallest group best, and every
 * expert that can be in the top K (or beat one that is) has a value >= T. The candidates (typically a few over K)
 * are each ranked against the candidates alone. The weights are renormalised in slot order (as in laguna.c), then
 * stored by ascending expert id, the pair order: ae[k], aw[k] (shared memory). Every thread of the block calls it.
 * Logits are read through L2 (__ldcg): other blocks wrote them. (Ranking every expert against all E cost ~2 us a
 * layer; one warp picking the K by redux.sync was slower still; run in every block of the expert kernels, the
 * routing cost more than the fence and counter it saves: dev/gpu_notes.md.) */
__device__ void decode_route(const float *logits, const float *bias, int E, int K, float softcap, int *ae,
                             float *aw) {
    __shared__ float score[1024];
    __shared__ float sel[1024];
    __shared__ float2 cand[1024];                   /* (value, expert id as bits) */
    __shared__ float gbest[32];
    __shared__ int n_cand;
    __shared__ int slot_e[32];
    __shared__ float slot_w[32];
    const int tid = threadIdx.x, nt = blockDim.x;
    const int LG = K <= nt / 32 ? 32 : K <= nt / 16 ? 16 : 8;   /* lanes a group: nt / LG >= K groups (K <= 32) */
    if (tid < K) { slot_e[tid] = tid; slot_w[tid] = 0.0f; }     /* NaN logits rank nowhere: slots stay valid ids */
    if (tid == 0) n_cand = 0;
    float best = -INFINITY;                         /* a group with no experts: -inf, so T = -inf, all ranked */
    for (int e = tid; e < E; e += nt) {
        float v = __ldcg(logits + e);
        if (softcap > 0.0f) v = tanhf(v / softcap) * softcap;
        score[e] = 1.0f / (1.0f + expf(-v));
        sel[e] = score[e] + bias[e];
        best = fmaxf(best, sel[e]);
    }
    for (int off = 1; off < LG; off <<= 1) best = fmaxf(best, __shfl_xor_sync(0xffffffffu, best, off));
    if (tid % LG == 0) gbest[tid / LG] = best;
    __syncthreads();
    TRACE_MARK(3);                                  /* (trace builds: the scores are in; router_decode's marks 0-2) */
    float T = INFINITY;
    for (int i = 0; i < nt / LG; i++) T = fminf(T, gbest[i]);
    for (int e = tid; e < E; e += nt)
        if (sel[e] >= T) cand[atomicAdd(&n_cand, 1)] = make_float2(sel[e], __int_as_float(e));
    __syncthreads();
    const int nc = n_cand;                          /* >= K (the groups' bests), unless logits are NaN */
    for (int c = tid; c < nc; c += nt) {
        const float v = cand[c].x;
        const int e = __float_as_int(cand[c].y);
        int rank = 0;
        for (int j = 0; j < nc; j++) {
            const float2 t = cand[j];
            rank += t.x > v || (t.x == v && __float_as_int(t.y) < e);
        }
        if (rank < K) { slot_e[rank] = e; slot_w[rank] = score[e]; }
    }
    __syncthreads();
    TRACE_MARK(4);                                  /* the ranks are in */
    if (tid < K) {
        int j = tid, e = slot_e[j], k = 0;
        float sum = 0.0f;
        for (int i = 0; i < K; i++) { sum += slot_w[i]; k += slot_e[i] < e; }
        ae[k] = e;
        aw[k] = slot_w[j] / sum;
    }
    __syncthreads();
}

/* Decode (one token): the router matvec and the routing plan in one launch. Every block computes 2 logits (128
 * blocks: 1 MB of router weights wants many SMs pulling); the last block to finish (a counter in device memory,
 * reset by that block) picks the top-k (decode_route; H <= 2048 * NCH). The plan is then trivial: one token, K pairs,
 * each expert once, sorted by id (start[] and pair_tok[] for the general gate/up kernel). */
/* The shared expert's gate/up inside the router's launch (SH; bf16 / f32, H <= 2048): blocks past the router's
 * (R units a block, moe_gate_up_cols's layout) each norm x themselves with the router's partition of the sum of
 * squares, so hs is bitwise what moe_gate_up_cols would write. The router is latency-bound (its last block's top-k
 * runs alone), so the shared expert's 4 MB stream in its shadow and gate/up has only the routed experts left:
 * +1.35% decode at 512 (dev/gpu_notes.md, round 11). */
template <typename W, int R>
__device__ __forceinline__ void shared_gate_up_block(int b, WPtr gu, int S, int H, const float *x, const float *norm_w,
                                                     float eps, float *hs) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, k = tid * 8, i0 = b * R;
    typename Fmt<W>::Chunk c[2 * R];
    float nw[8], xv[8];
    if (k < H) {
#pragma unroll
        for (int j = 0; j < R; j++) {
            const int i = min(i0 + j, S - 1);
            c[j] = wload<W>(wrow<W>(gu, i, H), k);
            c[R + j] = wload<W>(wrow<W>(gu, S + i, H), k);
        }
        load_x8(norm_w + k, nw);
    }
    griddep_wait();                                 /* x: o_proj's */
    griddep_launch();
    if (k < H) load_x8(x + k, xv);
    else for (int i = 0; i < 8; i++) xv[i] = 0.0f;
    const float inv = 1.0f / sqrtf(block_sum(dot8(xv, xv)) / H + eps);
    float acc[2 * R] = {};
    if (k < H) {
        for (int i = 0; i < 8; i++) xv[i] = nw[i] * (xv[i] * inv);
        chunk_dot<W, 2 * R>(c, H - k, [&](int, float f[8]) { for (int i = 0; i < 8; i++) f[i] = xv[i]; }, acc);
    }
    __shared__ float red[8][2 * R];
    float v = warp_reduce_rows<2 * R>(acc, lane);
    if (lane % (16 / R) == 0) red[warp][lane / (16 / R)] = v;
    __syncthreads();
    if (tid < R && i0 + tid < S) {
        float gs = 0.0f, us = 0.0f;
        for (int w = 0; w < 8; w++) { gs += red[w][tid]; us += red[w][R + tid]; }
        hs[i0 + tid] = silu(gs) * us;
    }
}

template <typename W, int NCH, bool SH, typename Q>   /* Q: the experts' format (q8 / q4: xq_out) */
__global__ void __launch_bounds__(256) router_decode(float *logits, WPtr w, int E, int H, const float *x,
                                                     const float *norm_w, float eps, float *xb_out,
                                                     const float *bias, int K, float softcap, int *start,
                                                     int *pair_tok, float *pair_w, int *active, int *n_active,
                                                     int *counter, WPtr shared_gu, int S, float *hs, int nbr,
                                                     uint4 *xq_out) {
    TRACE_BLOCK();
    if constexpr (SH && !is_q<Q>)                  /* bf16 / f32: the experts' format is the router's */
        if ((int)blockIdx.x >= nbr) {               /* a shared-expert gate/up block */
            shared_gate_up_block<W, 4>(blockIdx.x - nbr, shared_gu, S, H, x, norm_w, eps, hs);
            return;
        }
    /* the routing bias (1 KB a layer, out of L2 by the next token) read before the wait by every block: the last
     * block's top-k then has no DRAM read on its path; +1.1% decode at 512, +1.5% at 8K (dev/gpu_notes.md, round 13) */
    float bpre[4];
#pragma unroll
    for (int i = 0; i < 4; i++) bpre[i] = threadIdx.x + 256 * i < E ? bias[threadIdx.x + 256 * i] : 0.0f;
    matvec_rows<W, 2, NCH>(logits, w, E, H, x, norm_w, eps, xb_out, NULL, 0);
    TRACE_MARK(0);
    /* Count the block: the barrier orders its logits before thread 0's acquire-release atomic (the release is
     * cumulative), and the barrier after it passes the acquire to the whole block. One atomic instead of a fence in
     * every thread, the atomic and a second fence: +0.5% decode at 512 (dev/gpu_notes.md, round 8). */
    __shared__ int last;
    __syncthreads();
    if (threadIdx.x == 0) {
        int old;
        asm volatile("atom.add.acq_rel.gpu.s32 %0, [%1], 1;" : "=r"(old) : "l"(counter) : "memory");
        last = old == (SH ? nbr : (int)gridDim.x) - 1;   /* the router's blocks only */
    }
    __syncthreads();
    /* q8 / q4: block 0 quantizes the normed x it wrote (each thread its own 8 values, H <= 2048: moe_gate_up_cols's
     * columns) once for all the gate/up blocks, after counting itself, so the top-k does not wait for it. On the H200
     * (XS-2.1, 512 / 8K): q8 552.8 / 505.3 -> 556.7 / 507.9 tok/s, q4 561.8 / 513.0 -> 568.8 / 519.1 (dev/gpu_notes.md,
     * round 24) */
    if constexpr (is_q<Q>)
        if (xq_out && blockIdx.x == 0 && threadIdx.x * 8 < H) {
            float v[8];
            load_x8(xb_out + threadIdx.x * 8, v);    /* this thread's own stores */
            store_xq(xq_out + 3 * threadIdx.x, quant_x8<Q>(v));
        }
    if (!last) return;
    TRACE_MARK(1);
    __shared__ int ae[32];
    __shared__ float aw[32];
    __shared__ float bias_s[1024];                 /* E <= 1024 (decode_route's bound) */
#pragma unroll
    for (int i = 0; i < 4; i++) if (threadIdx.x + 256 * i < E) bias_s[threadIdx.x + 256 * i] = bpre[i];
    decode_route(logits, bias_s, E, K, softcap, ae, aw);   /* its thread e reads bias[e]: the value it wrote */
    TRACE_MARK(2);
    if (threadIdx.x < K) {                         /* pair k: the k-th expert by id, token 0 */
        active[threadIdx.x] = ae[threadIdx.x];
        pair_w[threadIdx.x] = aw[threadIdx.x];
        pair_tok[threadIdx.x] = 0;
    }
    for (int e = threadIdx.x; e <= E; e += blockDim.x) {
        int s = 0;
        for (int i = 0; i < K; i++) s += ae[i] < e;
        start[e] = s;
    }
    if (threadIdx.x == 0) { *n_active = K; *counter = 0; }
}

/* SwiGLU gate/up for the active experts and the always-on matrix (shared expert, or the dense MLP):
 * h = silu(x . gate_i) * (x . up_i). One warp per hidden unit i, every token of that expert, so the expert's
 * rows are read once. Blocks [0, max_active * nbI) are routed experts, the rest the always-on matrix. */
template <typename W>
__global__ void __launch_bounds__(256) moe_gate_up(WPtr experts_gu, int I, WPtr always_gu, int S, int H,
                                                   const float *xb, int n, const int *start, const int *pair_tok,
                                                   const int *active, const int *n_active, int max_active,
                                                   float *h_pair, float *hs) {
    TRACE_BLOCK();
    griddep_wait();
    griddep_launch();
    constexpr int CH = Fmt<W>::CH, STEP = 32 * CH;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nbI = (I + 7) / 8;
    int b = blockIdx.x, hid, i, cnt, first = 0;
    WPtr base;
    size_t row0 = 0;
    const int *toks = NULL;
    float *out;
    if (b < max_active * nbI) {
        int a = b / nbI;
        if (a >= *n_active) return;
        int e = active[a];
        i = (b % nbI) * 8 + warp;
        hid = I;
        base = experts_gu;
        row0 = (size_t)e * 2 * I;
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
    WPtr wg = wrow<W>(base, row0 + i, H), wu = wrow<W>(base, row0 + hid + i, H);
    for (int t0 = 0; t0 < cnt; t0 += 4) {       /* 4 tokens per pass; later passes hit L1/L2 */
        float ag[4] = {}, au[4] = {};
        const float *xr[4];
#pragma unroll
        for (int tt = 0; tt < 4; tt++) {
            int tok = t0 + tt < cnt ? (toks ? toks[t0 + tt] : t0 + tt) : -1;
            xr[tt] = tok >= 0 ? xb + (size_t)tok * H : NULL;
        }
        for (int k0 = lane * CH; k0 < H; k0 += 4 * STEP) {   /* 4 chunks of both rows in flight */
            typename Fmt<W>::Chunk c[4][2];
#pragma unroll
            for (int u = 0; u < 4; u++)
                if (k0 + u * STEP < H) { c[u][0] = wload<W>(wg, k0 + u * STEP); c[u][1] = wload<W>(wu, k0 + u * STEP); }
#pragma unroll
            for (int u = 0; u < 4; u++) {
                int k = k0 + u * STEP;
                if (k >= H) break;
                float pg[4] = {}, pu[4] = {};       /* quantized: this chunk's sums, before its scales */
#pragma unroll
                for (int bb = 0; bb < CH / 8; bb++) {
                    if (k + 8 * bb >= H) break;
                    float g8[8], u8[8], x8[8];
                    wvals8<W>(c[u][0], bb, g8);
                    wvals8<W>(c[u][1], bb, u8);
#pragma unroll
                    for (int tt = 0; tt < 4; tt++)
                        if (xr[tt]) {
                            load_x8(xr[tt] + k + 8 * bb, x8);
                            if constexpr (is_q<W>) { pg[tt] += dot8(g8, x8); pu[tt] += dot8(u8, x8); }
                            else { ag[tt] += dot8(g8, x8); au[tt] += dot8(u8, x8); }
                        }
                }
                if constexpr (is_q<W>) {
                    float sg = wscale<W>(c[u][0]), su = wscale<W>(c[u][1]);
#pragma unroll
                    for (int tt = 0; tt < 4; tt++) { ag[tt] += sg * pg[tt]; au[tt] += su * pu[tt]; }
                }
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
 * A warp owns RPW output rows of one expert, every pair of it: each lane loads its chunks of the RPW rows together and
 * reads each token's h values once for all of them. moe_combine adds the outputs up. With one row a warp (60
 * registers, 4 blocks an SM of 8 KB: 32 KB in flight an SM) the down projections of a 16-token verification streamed
 * ~1.8 TB/s where gate/up (2 blocks an SM of 32 KB in flight each) streamed ~2.9; at RPW = 4 (120 registers, 2 blocks
 * an SM of 32 KB) the step went 4.78 -> 3.87 ms a forward and the verification 15.5 -> 14.7 ms (dev/gpu_notes.md,
 * round 10). */
template <typename W, int RPW>
__global__ void __launch_bounds__(256) moe_down(WPtr experts_down, int I, WPtr always_down, int S, int H,
                                                int n, const int *start, const int *active, const int *n_active,
                                                int max_active, const float *h_pair, const float *hs,
                                                float *y_pair, float *ys) {
    constexpr int CH = Fmt<W>::CH, STEP = 32 * CH, TT = 4, RT = RPW * TT;   /* sums a lane keeps: [row][token] */
    static_assert(RT <= 32, "RPW * 4 sums a warp");
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nbH = (H + 8 * RPW - 1) / (8 * RPW);
    int b = blockIdx.x, j0, cnt, hid;
    size_t row0 = 0;
    WPtr base;
    const float *hin;
    float *out;
    if (b < max_active * nbH) {
        int a = b / nbH;
        if (a >= *n_active) return;
        int e = active[a], first = start[e];
        j0 = ((b % nbH) * 8 + warp) * RPW;
        hid = I;
        base = experts_down;
        row0 = (size_t)e * H;
        cnt = start[e + 1] - first;
        hin = h_pair + (size_t)first * I;
        out = y_pair + (size_t)first * H;
    } else {
        j0 = ((b - max_active * nbH) * 8 + warp) * RPW;
        hid = S;
        base = always_down;
        cnt = n;
        hin = hs;
        out = ys;
    }
    if (j0 >= H) return;
    WPtr w[RPW];
#pragma unroll
    for (int r = 0; r < RPW; r++) w[r] = wrow<W>(base, row0 + min(j0 + r, H - 1), hid);   /* past H: row H - 1 again */
    for (int t0 = 0; t0 < cnt; t0 += TT) {
        float acc[RT] = {};
#pragma unroll 2
        for (int k = lane * CH; k < hid; k += STEP) {
            typename Fmt<W>::Chunk c[RPW];
#pragma unroll
            for (int r = 0; r < RPW; r++) c[r] = wload<W>(w[r], k);
            float part[RT] = {};                    /* quantized: this chunk's sums, before its scales */
#pragma unroll
            for (int bb = 0; bb < CH / 8; bb++) {
                if (k + 8 * bb >= hid) break;
                float w8[8], x8[8];
#pragma unroll
                for (int tt = 0; tt < TT; tt++) {
                    if (t0 + tt >= cnt) break;
                    load_x8(hin + (size_t)(t0 + tt) * hid + k + 8 * bb, x8);
#pragma unroll
                    for (int r = 0; r < RPW; r++) {
                        wvals8<W>(c[r], bb, w8);
                        if constexpr (is_q<W>) part[r * TT + tt] += dot8(w8, x8);
                        else acc[r * TT + tt] += dot8(w8, x8);
                    }
                }
            }
            if constexpr (is_q<W>)
#pragma unroll
                for (int r = 0; r < RPW; r++) {
                    const float sc = wscale<W>(c[r]);
#pragma unroll
                    for (int tt = 0; tt < TT; tt++) acc[r * TT + tt] += sc * part[r * TT + tt];
                }
        }
        const float v = warp_reduce_rows<RT>(acc, lane);   /* lane holds sum i = lane / (32 / RT) */
        const int i = lane / (32 / RT), r = i / TT, tt = i % TT;
        if (lane % (32 / RT) == 0 && j0 + r < H && t0 + tt < cnt) out[(size_t)(t0 + tt) * H + j0 + r] = v;
    }
}

/* SwiGLU gate/up for one token (n = 1 decode): hs = silu(x . gate_i) * (x . up_i) for the always-on matrix (shared
 * expert, or the dense MLP), then h_pair[a] likewise for the a-th active expert (ascending id, = its pair index).
 * A warp per RG hidden units (Fmt: one in every format), each lane's NCH chunks of the gate and up rows (16 loads
 * at H = 2048) issued together; the always-on blocks come first in the grid and issue their loads before the wait on
 * the router (their weights don't depend on it). Quantized formats stage x in shared memory (swizzled, see xs_slot): a lane's
 * x is CH floats per chunk, read once for RG units. Every block waits before it exits (moe_down_decode relies on
 * that, see there). */
template <typename W, int NCH>
__global__ void __launch_bounds__(256) moe_gate_up_decode(WPtr experts_gu, int I, WPtr always_gu, int S,
                                                          int H, const float *xb, const int *active,
                                                          const int *n_active, float *h_pair, float *hs) {
    TRACE_BLOCK();
    constexpr int CH = Fmt<W>::CH, RG = Fmt<W>::RG;
    __shared__ __align__(16) float xs[is_q<W> ? 32 * CH * NCH : 4];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nbS = (S + 8 * RG - 1) / (8 * RG), b = blockIdx.x;
    WPtr base;
    size_t row0 = 0;
    int hid = 0, i0 = 0;
    float *dst = NULL;
    typename Fmt<W>::Chunk c[NCH][2 * RG];       /* [u][j]: gate row of unit i0 + j; [u][RG + j]: its up row */
    auto load = [&]() {
#pragma unroll
        for (int u = 0; u < NCH; u++)
            if ((lane + 32 * u) * CH < H)
#pragma unroll
                for (int j = 0; j < RG; j++) {
                    int i = RG == 1 ? i0 : min(i0 + j, hid - 1);   /* past the end: the last unit again */
                    c[u][j] = wload<W>(wrow<W>(base, row0 + i, H), (lane + 32 * u) * CH);
                    c[u][RG + j] = wload<W>(wrow<W>(base, row0 + hid + i, H), (lane + 32 * u) * CH);
                }
    };
    if (b < nbS) {
        i0 = (b * 8 + warp) * RG;
        if (i0 < S) { base = always_gu; hid = S; dst = hs; load(); }
    }
    griddep_wait();                                   /* the router's plan and xb */
    griddep_launch();
    if constexpr (is_q<W>) {                        /* every thread, before any exits */
        for (int k = threadIdx.x * 4; k < H; k += 1024) xs_put4<CH>(xs, k, *(const float4 *)(xb + k));
        __syncthreads();
    }
    if (b >= nbS) {
        int nbI = (I + 8 * RG - 1) / (8 * RG), a = (b - nbS) / nbI;
        i0 = (((b - nbS) % nbI) * 8 + warp) * RG;
        if (a >= *n_active || i0 >= I) return;
        base = experts_gu;
        row0 = (size_t)active[a] * 2 * I;
        hid = I;
        dst = h_pair + (size_t)a * I;
        TRACE_MARK(0);
        load();
    }
    if (!dst) return;
    float acc[2 * RG];
#pragma unroll
    for (int j = 0; j < 2 * RG; j++) acc[j] = 0.0f;
#pragma unroll
    for (int u = 0; u < NCH; u++) {
        int k = (lane + 32 * u) * CH;
        if (k >= H) break;
        chunk_dot<W, 2 * RG>(c[u], H - k, [&](int bb, float f[8]) {
            if constexpr (is_q<W>) xs_load8<CH>(xs, k + 8 * bb, f);
            else load_x8(xb + k, f);
        }, acc);
    }
#pragma unroll
    for (int j = 0; j < RG; j++) {
        float g = warp_sum(acc[j]), u = warp_sum(acc[RG + j]);
        if (lane == 0 && i0 + j < hid) dst[i0 + j] = silu(g) * u;
    }
}

/* The same by column slices (bf16 / f32, H <= 2048): each thread owns one chunk (8 columns) of the block's R units'
 * gate and up rows, and so only those 8 values of xb, in registers (matvec_cols's layout). The always-on blocks come
 * first and load before the wait; each routed block, after it, learns its expert from the plan. In the decode graph
 * on the H200, bf16 at 512, in a build with o_proj and the down projections also by column slices: 366.4 tok/s with
 * moe_gate_up_decode, 375.6 with this (R = 4; R = 8: 372.1) (dev/gpu_notes.md, round 9). */
template <typename W, int R>
__global__ void __launch_bounds__(256) moe_gate_up_cols(WPtr experts_gu, int I, WPtr always_gu, int S, int H,
                                                        const float *xb, const int *active, const int *n_active,
                                                        float *h_pair, float *hs, const uint4 *xq, uint4 *hq) {
    TRACE_BLOCK();
    constexpr int CH = 8;                           /* columns a thread (Cols8) */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nbS = (S + R - 1) / R, b = blockIdx.x;
    const int k = tid * CH;                         /* this thread's columns */
    typename Cols8<W>::T c[2 * R];                 /* [j]: the gate row of unit i0 + j; [R + j]: its up row */
    WPtr base;
    size_t row0 = 0;
    int hid = 0, i0 = 0;
    float *dst = NULL;
    auto load = [&]() {
        if (k < H)
#pragma unroll
            for (int j = 0; j < R; j++) {
                int i = min(i0 + j, hid - 1);       /* past the end: the last unit again */
                c[j] = load8<W>(wrow<W>(base, row0 + i, H), k);
                c[R + j] = load8<W>(wrow<W>(base, row0 + hid + i, H), k);
            }
    };
    uint4 *hq_dst = hq;                             /* q8 / q4: h quantized (hq: S units, then the pairs') */
    if (b < nbS) { i0 = b * R; base = always_gu; hid = S; dst = hs; load(); }
    griddep_wait();                                 /* the router's plan and xb */
    griddep_launch();
    if (b >= nbS) {                                 /* block-uniform: the whole block leaves or stays */
        const int nbI = (I + R - 1) / R, a = (b - nbS) / nbI;
        if (a >= *n_active) return;
        i0 = ((b - nbS) % nbI) * R;
        base = experts_gu;
        row0 = (size_t)active[a] * 2 * I;
        hid = I;
        dst = h_pair + (size_t)a * I;
        hq_dst = hq + (S + (size_t)a * I) / 4;
        TRACE_MARK(0);
        load();
    }
    float acc[2 * R] = {};
    if (k < H) {
        float xv[CH];
        if constexpr (is_q<W>) {
            if (xq) cols8_dot<W, 2 * R>(c, load_xq<W>(xq + 3 * tid), acc);   /* quantized by the router */
            else {
                load_x8(xb + k, xv);
                cols8_dot<W, 2 * R>(c, quant_x8<W>(xv), acc);
            }
        } else {
#pragma unroll
            for (int bb = 0; bb < CH / 8; bb++) load_x8(xb + k + 8 * bb, &xv[8 * bb]);
            chunk_dot<W, 2 * R>(c, H - k, [&](int bb, float f[8]) {
#pragma unroll
                for (int i = 0; i < 8; i++) f[i] = xv[8 * bb + i];
            }, acc);
        }
    }
    __shared__ float red[8][2 * R];
    float v = warp_reduce_rows<2 * R>(acc, lane);
    if (lane % (16 / R) == 0) red[warp][lane / (16 / R)] = v;
    __syncthreads();
    if (warp == 0) {
        float hv = 0.0f;
        if (lane < R && i0 + lane < hid) {
            float gs = 0.0f, us = 0.0f;
            for (int w = 0; w < 8; w++) { gs += red[w][lane]; us += red[w][R + lane]; }
            dst[i0 + lane] = hv = silu(gs) * us;
        }
        if constexpr (is_q<W> && R % 4 == 0)
            if (hq) {                               /* every 4 units' h as one quant_x4 (for moe_down_cols) */
                float v[4];
#pragma unroll
                for (int t = 0; t < 4; t++) v[t] = __shfl_sync(0xffffffffu, hv, (lane & ~3) + t);
                if (lane < R && lane % 4 == 0) hq_dst[(i0 + lane) / 4] = quant_x4<W>(v);
            }
    }
}

/* Decode's down projections by column slices (bf16 / f32; I and S multiples of 8, K * I + S <= 6144): a row's
 * columns are the active experts' I columns in plan order, then the always-on matrix's S; each thread owns NC chunks
 * of them for the block's R rows. Before the wait: the weights (two or more kernels old, see moe_down_decode) and
 * the residual; after it, all NC chunks' h values and routing weights in one go, then the dots. Routed and always-on
 * sums are kept apart and combined as the CPU does: x[j] += sh + scaling * routed. On the H200 in the decode graph
 * (bf16, 512 / 8K): 401.9 / 377.5 tok/s with moe_down_decode, 413.5 / 385.9 with this at R = 4, 372.4 / 351.0 at
 * R = 2 (dev/gpu_notes.md, round 10). Round 9's version read each chunk's h after the previous chunk's sums (likely
 * dependent L2 round trips) and was not faster than moe_down_decode. */
template <typename W, int R, int NC, bool HQ>     /* HQ: q8 / q4 h read as gate/up's quant_x4 halves (hq) */
__global__ void __launch_bounds__(256) moe_down_cols(float *x, WPtr experts_down, int I, WPtr always_down, int S,
                                                     int H, const int *active, const int *n_active,
                                                     const float *pair_w, const float *h_pair, const float *hs,
                                                     const uint4 *hq, float scaling) {
    TRACE_BLOCK();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, r0 = blockIdx.x * R;
    const int na = n_active ? *n_active : 0, cI = I / 8, nq = na * cI + S / 8;
    typename Cols8<W>::T c[NC][R];
    int seg[NC], kk[NC];                            /* chunk u: its expert slot (na: the always-on matrix), column */
#pragma unroll
    for (int u = 0; u < NC; u++) {
        const int q = tid + 256 * u;
        seg[u] = q < na * cI ? q / cI : na;
        kk[u] = q < na * cI ? (q % cI) * 8 : (q - na * cI) * 8;
        if (q >= nq) continue;
#pragma unroll
        for (int j = 0; j < R; j++) {
            const int r = min(r0 + j, H - 1);
            c[u][j] = seg[u] < na ? load8<W>(wrow<W>(experts_down, (size_t)active[seg[u]] * H + r, I), kk[u])
                                  : load8<W>(wrow<W>(always_down, r, S), kk[u]);
        }
    }
    const float xj = tid < R && r0 + tid < H ? x[r0 + tid] : 0.0f;   /* the residual */
    griddep_wait();                                 /* h_pair and hs */
    griddep_launch();
    float h[NC][8], wa[NC];
    uint4 hx[NC][2];                                /* HQ: chunk u's two quantized halves */
#pragma unroll
    for (int u = 0; u < NC; u++) {                  /* every h value first: the loads go out together */
        const bool live = tid + 256 * u < nq, routed = seg[u] < na;
        if constexpr (HQ) {
            const uint4 *p = hq + (routed ? S + (size_t)seg[u] * I + kk[u] : kk[u]) / 4;
            hx[u][0] = live ? p[0] : make_uint4(0u, 0u, 0u, 0u);
            hx[u][1] = live ? p[1] : make_uint4(0u, 0u, 0u, 0u);
        } else if (live) load_x8(routed ? h_pair + (size_t)seg[u] * I + kk[u] : hs + kk[u], h[u]);
        else for (int i = 0; i < 8; i++) h[u][i] = 0.0f;
        wa[u] = live && routed ? pair_w[seg[u]] : 0.0f;
    }
    float acc[2 * R] = {};                          /* [j]: routed (weighted), [R + j]: always-on */
#pragma unroll
    for (int u = 0; u < NC; u++) {
        if (tid + 256 * u >= nq) continue;
        float part[R] = {};
        if constexpr (!is_q<W>)
            chunk_dot<W, R>(c[u], 8, [&](int, float f[8]) { for (int i = 0; i < 8; i++) f[i] = h[u][i]; }, part);
        else if constexpr (HQ) cols8_dot_halves<W, R>(c[u], hx[u][0], hx[u][1], part);
        else cols8_dot<W, R>(c[u], quant_x8<W>(h[u]), part);
#pragma unroll
        for (int j = 0; j < R; j++) {
            if (seg[u] < na) acc[j] += wa[u] * part[j];
            else acc[R + j] += part[j];
        }
    }
    __shared__ float red[8][2 * R];
    float v = warp_reduce_rows<2 * R>(acc, lane);
    if (lane % (16 / R) == 0) red[warp][lane / (16 / R)] = v;
    __syncthreads();
    if (tid < R && r0 + tid < H) {
        float routed = 0.0f, sh = 0.0f;
        for (int w = 0; w < 8; w++) { routed += red[w][tid]; sh += red[w][R + tid]; }
        x[r0 + tid] = xj + (sh + routed * scaling);
    }
}

/* Decode (one token): all down projections of a layer in one launch with the weighted sum and the residual:
 * x[j] += always_down[j] . hs + scaling * sum_a w_a * down_{e_a}[j] . h_a, experts in ascending id (the CPU's
 * order). One warp per output row; the first 8 experts' and the always-on row's first 512 columns (all of them at
 * I = S = 512: 18 loads per lane; quantized, UD = 1 chunk per lane and row: 16 (Q8) or 32 (Q4) columns per lane)
 * are loaded BEFORE the wait on moe_gate_up_decode. The plan (active, n_active, pair_w) is the router's, two
 * kernels back: every kernel of the chain waits before it lets its successor start, so when this one starts the
 * router has completed. So the row's residual x[j] (o_proj's, three kernels back) is read before the wait too; only
 * h_pair / hs (the previous kernel's) need it. */
template <typename W>
__global__ void __launch_bounds__(256, 2) moe_down_decode(float *x, WPtr experts_down, int I, WPtr always_down,
                                                       int S, int H, const int *active, const int *n_active,
                                                       const float *pair_w, const float *h_pair, const float *hs,
                                                       float scaling) {
    TRACE_BLOCK();
    constexpr int CH = Fmt<W>::CH, UD = is_q<W> ? 1 : 2, KS = 32 * UD * CH;   /* KS: columns per step */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, j = blockIdx.x * 8 + warp;
    const bool row = j < H;
    const int na = n_active ? *n_active : 0;
    typename Fmt<W>::Chunk c[8][UD], cs[UD];
    auto load_group = [&](int a0, int k0) {          /* UD chunks (from column k0 + lane * CH) of experts a0..a0+7 */
#pragma unroll
        for (int a = 0; a < 8; a++)
#pragma unroll
            for (int u = 0; u < UD; u++)
                if (row && a0 + a < na && k0 + (lane + 32 * u) * CH < I)
                    c[a][u] = wload<W>(wrow<W>(experts_down, (size_t)active[a0 + a] * H + j, I), k0 + (lane + 32 * u) * CH);
    };
    load_group(0, 0);
    const WPtr ws = wrow<W>(always_down, j, S);
#pragma unroll
    for (int u = 0; u < UD; u++)
        if (row && (lane + 32 * u) * CH < S) cs[u] = wload<W>(ws, (lane + 32 * u) * CH);
    const float xj = row ? x[j] : 0.0f;              /* the residual */
    griddep_wait();                                   /* h_pair and hs */
    griddep_launch();
    if (!row) return;
    float routed = 0.0f;
    for (int a0 = 0; a0 < na; a0 += 8) {
        float acc[8] = {};
        for (int k0 = 0; k0 < I; k0 += KS) {
            if (a0 || k0) load_group(a0, k0);
#pragma unroll
            for (int a = 0; a < 8; a++)
#pragma unroll
                for (int u = 0; u < UD; u++) {
                    int k = k0 + (lane + 32 * u) * CH;
                    if (a0 + a < na && k < I)
                        chunk_dot<W, 1>(&c[a][u], I - k, [&](int bb, float f[8]) {
                            load_x8(h_pair + (size_t)(a0 + a) * I + k + 8 * bb, f);
                        }, &acc[a]);
                }
        }
#pragma unroll
        for (int a = 0; a < 8; a++)
            if (a0 + a < na) routed += pair_w[a0 + a] * warp_sum(acc[a]);
    }
    float sh = 0.0f;
    for (int k0 = 0; k0 < S; k0 += KS) {
        if (k0)
#pragma unroll
            for (int u = 0; u < UD; u++)
                if (k0 + (lane + 32 * u) * CH < S) cs[u] = wload<W>(ws, k0 + (lane + 32 * u) * CH);
#pragma unroll
        for (int u = 0; u < UD; u++) {
            int k = k0 + (lane + 32 * u) * CH;
            if (k < S) chunk_dot<W, 1>(&cs[u], S - k, [&](int bb, float f[8]) { load_x8(hs + k + 8 * bb, f); }, &sh);
        }
    }
    sh = warp_sum(sh);
    if (lane == 0) x[j] = xj + (sh + routed * scaling);
}

/* ---- GEMMs of a few tokens (n = 2..16: the DFlash verification, drafting, short prompts), bf16 weights ----
 * y[t, r] = W[r, :] . x[t, :] for up to 16 tokens, the weights streamed like the decode matvecs and the 16 tokens
 * riding along on the tensor cores (the experts' kernels below: every active expert read once, whatever n is; for
 * plain matrices cuBLAS stays faster above ~8 MB, see gemm()):
 *   a warp owns 16 rows of W, the mma's A (lane (g, t) holds rows g and g + 8), and the tokens are its B in two
 *   halves of 8 (lane (g, t) loads tokens g and g + 8). Per 32-k chunk a lane loads 16 bytes of each of its rows and
 *   of each of its tokens, k = 8t .. 8t + 7, and the chunk is two m16n8k16 steps per half. An mma sums over k in any
 *   order as long as A and B agree: step s hands the lane's k = 8t + 4s .. 8t + 4s + 3 to the places the
 *   instruction calls k = 2t, 2t + 1, 2t + 8, 2t + 9, for A and B alike. Lane (g, t) ends with rows g and g + 8
 *   times tokens 2t and 2t + 1 of each half (acc[h][0..1] row g, acc[h][2..3] row g + 8).
 * The weights are read once whatever n is; the tokens' 16 bytes come from L1 / L2. */
__device__ __forceinline__ uint4 few_x8(const bf16 *p) { return __ldg((const uint4 *)p); }
__device__ __forceinline__ uint4 few_x8(const float *p) {     /* f32 inputs (gemm's x of f32 rows): to bf16 */
    float4 a = __ldg((const float4 *)p), b = __ldg((const float4 *)p + 1);
    return make_uint4(pack_bf16(a.x, a.y), pack_bf16(a.z, a.w), pack_bf16(b.x, b.y), pack_bf16(b.z, b.w));
}

/* A lane's 8 weights of a row at column k (a multiple of 8) for the mma's A operand, as 8 bf16: bf16 as stored; q8 /
 * q4 (FewW: the column-slice unit, 8 or 4 bytes and the group's scale) dequantized, value * scale rounded to bf16:
 * the bf16 matrix dequant_kernel writes for the cuBLAS path, made in registers instead of global memory. */
template <typename W> struct FewW { typedef uint4 T; };
template <> struct FewW<Q8> { typedef Q8Cols T; };
template <> struct FewW<Q4> { typedef Q4Cols T; };
template <typename W> __device__ __forceinline__ typename FewW<W>::T few_wload(WPtr row, int k) {
    if constexpr (!is_q<W>) return ld_stream((const bf16 *)row.v + k);
    else return load8<W>(row, k);
}
template <typename W> __device__ __forceinline__ uint4 few_w8(const typename FewW<W>::T &c) {
    if constexpr (!is_q<W>) return c;
    else {
        QChunk q = {};                             /* wvals8's layout: the values in the first word(s) */
        if constexpr (Fmt<W>::DT == DT_Q8) { q.a.x = c.v.x; q.a.y = c.v.y; }
        else q.a.x = c.v;
        float f[8];
        wvals8<W>(q, 0, f);
        const float sc = __half2float(__ushort_as_half(c.s));
        return make_uint4(pack_bf16(f[0] * sc, f[1] * sc), pack_bf16(f[2] * sc, f[3] * sc),
                          pack_bf16(f[4] * sc, f[5] * sc), pack_bf16(f[6] * sc, f[7] * sc));
    }
}

/* one warp: acc[h] += rows (w0, w1) times tokens (x0, x1) of half h over chunks c0, c0 + cs, ... of K (K % 8 == 0).
 * Every pointer must be a real row: a row or token past the end is some other row whose results the caller drops
 * (an mma's outputs for row m / token n depend on that row / token alone). U chunks' loads are in flight at once.
 * W: the rows' format (bf16, or q8 / q4 dequantized to bf16 on the way, see few_w8). WF: a group's weight loads all
 * issue before its token loads (whose addresses may still be on their way: the experts' token lists), else they
 * alternate; which is faster depends on the format and the occupancy (few_moe_pick), the sums are the same. */
template <typename W, typename X, int HALVES, int U, bool WF = false>
__device__ __forceinline__ void few_rows(float (&acc)[2][4], WPtr w0, WPtr w1, const X *x0, const X *x1,
                                         int K, int c0, int cs, int lane) {
    const int kl = 8 * (lane & 3), nch = (K + 31) / 32;
    for (int c = c0; c < nch; c += U * cs) {
        typename FewW<W>::T la[U], lb[U];
        uint4 xv[U][2];
        auto load_x = [&](int u) {
            const int k = (c + u * cs) * 32 + kl, kk = min(k, K - 8);
            xv[u][0] = few_x8(x0 + kk);
            if (HALVES == 2) xv[u][1] = few_x8(x1 + kk);
            if (k >= K) xv[u][0] = xv[u][1] = make_uint4(0, 0, 0, 0);   /* past K (K % 32 != 0): adds nothing */
        };
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (c + u * cs >= nch) break;                      /* the same for the whole warp */
            const int kk = min((c + u * cs) * 32 + kl, K - 8);
            la[u] = few_wload<W>(w0, kk);
            lb[u] = few_wload<W>(w1, kk);
            if (!WF) load_x(u);
        }
        if (WF) {
#pragma unroll
            for (int u = 0; u < U; u++) {
                if (c + u * cs >= nch) break;
                load_x(u);
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (c + u * cs >= nch) break;
            const uint4 wa = few_w8<W>(la[u]), wb = few_w8<W>(lb[u]);
#pragma unroll
            for (int s = 0; s < 2; s++) {
                const uint32_t a[4] = {s ? wa.z : wa.x, s ? wb.z : wb.x, s ? wa.w : wa.y, s ? wb.w : wb.y};
#pragma unroll
                for (int h = 0; h < HALVES; h++)
                    mma_bf16(acc[h], a, s ? xv[u][h].z : xv[u][h].x, s ? xv[u][h].w : xv[u][h].y);
            }
        }
    }
}

/* few_rows with the weights brought through shared memory: the warp's own ring of ST stages, each its 16 rows' next KC
 * columns, copied by cp.async with consecutive lanes on consecutive 16 bytes of one row (bf16 at KC 128: an
 * instruction is 256 contiguous bytes of 2 rows; q8 / q4, whose rows are 1 / 0.5 bytes a value, the value bytes alike
 * at twice / four times the columns), where few_rows' loads from global memory are 8 rows x 64 bytes an instruction
 * (q8 32, q4 16; dev/access_lab: that shape streams ~10% below contiguous rows). Each lane then reads from the ring
 * exactly the bytes few_rows would have loaded (rows g and g + 8 at 8 t of each 32-k chunk; q8 / q4 with the group's
 * scale, still from global memory), so the products and their order, and the sums, are few_rows' bit for bit. Rows:
 * r < 8 is row min(lo0 + r, lo_last) of mat (K values a row), r >= 8 row min(hi0 + r - 8, hi_last); w0 / w1 are the
 * lane's rows g and g + 8 (their scales). The ring's 16-byte units are swizzled so that the lanes' reads are free of
 * bank conflicts: unit u of row r at u ^ (r % RPP) * (8 / RPP), RPP the rows one read phase (128 bytes) covers.
 * K % KC == 0 (the caller checks). */
template <typename W> __host__ __device__ constexpr int few_chunk_bytes() {   /* a row's bytes in a 32-k chunk */
    return is_q<W> ? 32 * Fmt<W>::GB / LAGUNA_QGROUP : 64;
}
template <typename W, int HALVES, int KC, int ST>
__device__ __forceinline__ void few_rows_staged(float (&acc)[2][4], WPtr mat, int lo0, int lo_last, int hi0, int hi_last,
                                                WPtr w0, WPtr w1, const bf16 *x0, const bf16 *x1, int K, int lane,
                                                unsigned char *ring) {
    constexpr int CB = few_chunk_bytes<W>(), LB = CB / 4, RB = KC / 32 * CB;   /* bytes a 32-k chunk, a lane, a stage */
    static_assert(KC % 32 == 0 && RB >= 128 && RB <= 512 && ST >= 2,
                  "a stage is 128..512 bytes a row (the swizzle needs 8 units), two stages at least");
    constexpr int UPR = RB / 16, RPI = 32 / UPR, CPL = 16 / RPI;  /* units a row; rows an instruction; copies a lane */
    constexpr int RPP = 128 / CB, SW = 8 / RPP;                    /* rows a read phase; the swizzle's step */
    const int g = lane >> 2, t = lane & 3, ul = lane % UPR, nst = K / KC;
    int row[CPL];                                              /* the rows of this lane's copies */
#pragma unroll
    for (int i = 0; i < CPL; i++) {
        const int r = i * RPI + lane / UPR;
        row[i] = r < 8 ? min(lo0 + r, lo_last) : min(hi0 + r - 8, hi_last);
    }
    auto issue = [&](int st) {                                 /* stage st into its slot (an empty group past the end) */
        if (st < nst) {
            unsigned char *buf = ring + (st % ST) * 16 * RB;
#pragma unroll
            for (int i = 0; i < CPL; i++) {
                const int r = i * RPI + lane / UPR;
                cp_async16(buf + r * RB + ((ul ^ (r % RPP) * SW) * 16),
                           (const unsigned char *)wrow<W>(mat, row[i], K).v + (size_t)st * RB + ul * 16, true);
            }
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    /* a lane's bytes of row r at chunk cc of a stage, as few_rows' load of them (FewW) */
    auto chunk = [&](const unsigned char *buf, int r, int cc, WPtr w, int k) {
        const int b = cc * CB + LB * t;                        /* byte in the row's stage */
        const unsigned char *p = buf + r * RB + (((b >> 4) ^ (r % RPP) * SW) << 4) + (b & 15);
        typename FewW<W>::T c;
        if constexpr (!is_q<W>) c = *(const uint4 *)p;
        else {
            if constexpr (Fmt<W>::DT == DT_Q8) c.v = *(const uint2 *)p;
            else c.v = *(const uint32_t *)p;
            c.s = __ldg(w.s + k / LAGUNA_QGROUP);
        }
        return c;
    };
#pragma unroll
    for (int s = 0; s < ST - 1; s++) issue(s);
    for (int st = 0; st < nst; st++) {
        issue(st + ST - 1);
        asm volatile("cp.async.wait_group %0;" ::"n"(ST - 1) : "memory");   /* this lane's copies of stage st */
        __syncwarp();                                          /* and every lane's */
        const unsigned char *buf = ring + (st % ST) * 16 * RB;
#pragma unroll
        for (int cc = 0; cc < KC / 32; cc++) {
            const int k = st * KC + cc * 32 + 8 * t;
            const uint4 wa = few_w8<W>(chunk(buf, g, cc, w0, k)), wb = few_w8<W>(chunk(buf, g + 8, cc, w1, k));
            uint4 xv[2];
            xv[0] = few_x8(x0 + k);
            if (HALVES == 2) xv[1] = few_x8(x1 + k);
#pragma unroll
            for (int s = 0; s < 2; s++) {
                const uint32_t a[4] = {s ? wa.z : wa.x, s ? wb.z : wb.x, s ? wa.w : wa.y, s ? wb.w : wb.y};
#pragma unroll
                for (int h = 0; h < HALVES; h++)
                    mma_bf16(acc[h], a, s ? xv[h].z : xv[h].x, s ? xv[h].w : xv[h].y);
            }
        }
        __syncwarp();                                          /* the slot is refilled by the next issue */
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
}
/* the dynamic shared memory of a few-token expert kernel of format W staged at KC columns in ST stages (8 warps) */
template <typename W> __host__ __device__ constexpr size_t few_ring_bytes(int KC, int ST) {
    return KC ? (size_t)8 * ST * 16 * (KC / 32) * few_chunk_bytes<W>() : 0;
}
/* does format W take the staged path (bf16, q8, q4: not f32 rows) */
template <typename W> constexpr bool few_stages = std::is_same<W, bf16>::value || is_q<W>;

/* a warp's 16 rows (rows as few_rows_staged's; w0 / w1 the lane's rows g and g + 8) times its tokens (x0 / x1: both
 * halves when the expert has more than 8, cnt): through the ring when KC > 0 and the matrix allows it (K % KC == 0,
 * 16-byte aligned for cp.async), else straight into registers (few_rows); the same sums either way */
template <typename W, int U, int U2, bool WF, int KC, int ST>
__device__ __forceinline__ void few_rows_pick(float (&acc)[2][4], WPtr mat, int lo0, int lo_last, int hi0, int hi_last,
                                              WPtr w0, WPtr w1, const bf16 *x0, const bf16 *x1, int cnt, int K,
                                              int warp, int lane) {
    if constexpr (KC > 0 && few_stages<W>)
        if (K % KC == 0 && ((size_t)mat.v & 15) == 0) {
            extern __shared__ __align__(16) unsigned char few_ring[];
            unsigned char *ring = few_ring + warp * few_ring_bytes<W>(KC, ST) / 8;
            if (cnt > 8)
                few_rows_staged<W, 2, KC, ST>(acc, mat, lo0, lo_last, hi0, hi_last, w0, w1, x0, x1, K, lane, ring);
            else few_rows_staged<W, 1, KC, ST>(acc, mat, lo0, lo_last, hi0, hi_last, w0, w1, x0, x1, K, lane, ring);
            return;
        }
    if (cnt > 8) few_rows<W, bf16, 2, U2, WF>(acc, w0, w1, x0, x1, K, 0, 1, lane);
    else few_rows<W, bf16, 1, U, WF>(acc, w0, w1, x0, x1, K, 0, 1, lane);
}

/* y[t, r] = beta * y[t, r] + W[r, :] . x[t, :] for n <= 16 tokens (x rows of `in` values, bf16 or f32). A block: 8
 * warps on 8 / KS tiles of 16 rows, KS warps splitting a tile's chunks (then summed through shared memory, in warp
 * order), so small matrices (o_proj: 128 tiles, the router: 16) still spread over the GPU. Measured at 16 tokens
 * (dev/few_lab, H200) it beats cuBLAS only on small matrices (the router), so gemm() sends it those (few_max), and
 * q8 / q4 ones of every size (cuBLAS would need them dequantized first). MINB (blocks an SM the registers must allow)
 * and U (chunks in flight) are gemm_few_launch's choice; the sums' order does not depend on them. */
template <typename W, typename X, int KS, int HALVES, int MINB = 1, int U = 4>   /* MINB, U: as moe_gate_up_few's */
__global__ void __launch_bounds__(256, MINB) gemm_few(float *y, int ldy, WPtr w, int out, int in, const X *x, int n,
                                                      float beta) {
    __shared__ float part[8][8][32];                           /* [warp][acc value][lane] */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int r0 = (blockIdx.x * (8 / KS) + warp / KS) * 16, ks = warp % KS;
    float acc[2][4] = {};
    if (r0 < out)
        few_rows<W, X, HALVES, U>(acc, wrow<W>(w, min(r0 + g, out - 1), in), wrow<W>(w, min(r0 + g + 8, out - 1), in),
                                  x + (size_t)min(g, n - 1) * in, x + (size_t)min(g + 8, n - 1) * in, in, ks, KS, lane);
    if (KS > 1) {
        if (ks)
#pragma unroll
            for (int i = 0; i < 8; i++) part[warp][i][lane] = acc[i / 4][i % 4];
        __syncthreads();
        if (ks) return;
        for (int j = 1; j < KS; j++)
#pragma unroll
            for (int i = 0; i < 8; i++) acc[i / 4][i % 4] += part[warp + j][i][lane];
    }
#pragma unroll
    for (int h = 0; h < HALVES; h++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int r = r0 + g + (i & 2 ? 8 : 0), tok = 8 * h + 2 * t + (i & 1);
            if (r < out && tok < n) {
                float *p = y + (size_t)tok * ldy + r;
                *p = beta != 0.0f ? beta * *p + acc[h][i] : acc[h][i];
            }
        }
}

/* the experts' gate/up for a few tokens (W: bf16, or q8 / q4 dequantized in registers, see few_w8): act =
 * silu(x . gate_j) * (x . up_j) in bf16, for every pair of each active expert (sorted pair order: act[first + i]) and
 * every token through the always-on matrix (act_s). A warp owns 8 hidden units j0 .. j0 + 7: its 16 mma rows are
 * their gate rows (g) and up rows (g + 8), so lane (g, t) ends with gate and up of unit j0 + g for its tokens and
 * applies the SwiGLU itself. A block: 64 units of one expert. An expert has at most n <= 16 pairs (a token picks an
 * expert once). */
template <typename W, int MINB, int U, int U2, bool WF, int KC = 0, int ST = 2>   /* MINB: blocks an SM the
           registers must allow; U / U2: chunks in flight for experts of <= 8 / > 8 tokens; WF: few_rows'; KC > 0 (bf16,
           q8, q4): the weights through shared memory, few_rows_staged's KC and ST (see few_moe_pick) */
__global__ void __launch_bounds__(256, MINB) moe_gate_up_few(WPtr experts_gu, int I, WPtr always_gu, int S, int H,
                                                      const bf16 *x, int n, const int *start, const int *pair_tok,
                                                      const int *active, const int *n_active, int max_active,
                                                      bf16 *act, bf16 *act_s) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, nb = (I + 63) / 64;
    int b = blockIdx.x, j0, hid, cnt;
    WPtr base;                                                 /* the matrix; row0: its first row there */
    size_t row0 = 0;
    const int *toks = NULL;
    bf16 *out;
    if (b < max_active * nb) {
        const int a = b / nb;
        if (a >= *n_active) return;
        const int e = active[a], first = start[e];
        j0 = (b % nb) * 64 + warp * 8;
        hid = I;
        base = experts_gu;
        row0 = (size_t)e * 2 * I;
        cnt = start[e + 1] - first;
        toks = pair_tok + first;
        out = act + (size_t)first * I;
    } else {
        j0 = (b - max_active * nb) * 64 + warp * 8;
        hid = S;
        base = always_gu;
        cnt = n;
        out = act_s;
    }
    if (j0 >= hid) return;
    const int j = min(j0 + g, hid - 1);
    const int s0 = min(g, cnt - 1), s1 = min(g + 8, cnt - 1);  /* the lane's two token slots */
    const bf16 *x0 = x + (size_t)(toks ? toks[s0] : s0) * H, *x1 = x + (size_t)(toks ? toks[s1] : s1) * H;
    float acc[2][4] = {};
    const WPtr wg = wrow<W>(base, row0 + j, H), wu = wrow<W>(base, row0 + hid + j, H);
    const int lo0 = (int)row0 + j0, lo_last = (int)row0 + hid - 1;   /* gate rows; the up rows hid further */
    few_rows_pick<W, U, U2, WF, KC, ST>(acc, base, lo0, lo_last, lo0 + hid, lo_last + hid, wg, wu, x0, x1, cnt, H, warp,
                                        lane);
    if (j0 + g >= hid) return;
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int slot = 8 * h + 2 * t + i;
            if (slot < cnt) out[(size_t)slot * hid + j] = __float2bfloat16(silu(acc[h][i]) * acc[h][2 + i]);
        }
}

/* the experts' down projections for a few tokens (W as in moe_gate_up_few): y_pair[first + i] = down_e . act[first +
 * i] for each pair, ys[t] = always_down . act_s[t]. A warp owns 16 rows of H, a block 128 rows of one expert. */
template <typename W, int MINB, int U, int U2, bool WF, int KC = 0, int ST = 2>   /* as moe_gate_up_few's */
__global__ void __launch_bounds__(256, MINB) moe_down_few(WPtr experts_down, int I, WPtr always_down, int S, int H, int n,
                                                   const int *start, const int *active, const int *n_active,
                                                   int max_active, const bf16 *act, const bf16 *act_s, float *y_pair,
                                                   float *ys) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, nb = (H + 127) / 128;
    int b = blockIdx.x, r0, hid, cnt;
    WPtr base;                                                 /* the matrix; row0: its first row there */
    size_t row0 = 0;
    const bf16 *xin;
    float *out;
    if (b < max_active * nb) {
        const int a = b / nb;
        if (a >= *n_active) return;
        const int e = active[a], first = start[e];
        r0 = (b % nb) * 128 + warp * 16;
        hid = I;
        base = experts_down;
        row0 = (size_t)e * H;
        cnt = start[e + 1] - first;
        xin = act + (size_t)first * I;
        out = y_pair + (size_t)first * H;
    } else {
        r0 = (b - max_active * nb) * 128 + warp * 16;
        hid = S;                                               /* 0 without a shared expert: ys = 0 */
        base = always_down;
        cnt = n;
        xin = act_s;
        out = ys;
    }
    if (r0 >= H) return;
    const int s0 = min(g, cnt - 1), s1 = min(g + 8, cnt - 1);
    const WPtr w0 = wrow<W>(base, row0 + min(r0 + g, H - 1), hid), w1 = wrow<W>(base, row0 + min(r0 + g + 8, H - 1), hid);
    float acc[2][4] = {};
    const int lo0 = (int)row0 + r0, last = (int)row0 + H - 1;
    few_rows_pick<W, U, U2, WF, KC, ST>(acc, base, lo0, last, lo0 + 8, last, w0, w1, xin + (size_t)s0 * hid,
                                        xin + (size_t)s1 * hid, cnt, hid, warp, lane);
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int r = r0 + g + (i & 2 ? 8 : 0), slot = 8 * h + 2 * t + (i & 1);
            if (r < H && slot < cnt) out[(size_t)slot * H + r] = acc[h][i];
        }
}

/* x[t] += ys[t] + scaling * sum_j w_j * y_pair[(t, j)], the slots summed in ascending expert id. Block (t, y): 256
 * values of token t (it was one block a token looping over H; this grid and route_few's warp a token took the
 * 16-token verification's cuBLAS path from 14.36 to 13.85 ms: dev/gpu_notes.md, round 12) */
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
    for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < H; i += gridDim.y * blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < K; j++) {
            int p = t * K + order[j];
            acc += y_pair[(size_t)inv[p] * H + i] * topk_w[p];
        }
        x[(size_t)t * H + i] += ys[(size_t)t * H + i] + acc * scaling;
    }
}

/* ---- MoE of many tokens (n > 1): routing and the pair sort in three multi-block launches ----
 * route_many_topk: a warp per token (route_token), and each block's per-expert counts of its ROUTE_TOK tokens;
 * route_many_scan (one block, a thread per expert): each block's offset within each expert, start[], the active
 *   list and the GEMM tile map tile_start[] (expert e owns m-tiles tile_start[e]..tile_start[e+1] of bm pairs);
 * route_many_scatter: a warp per block of tokens places its pairs in token-then-slot order within each expert,
 *   so the sort is deterministic (same order as the CPU walks the pairs). */
#define ROUTE_TOK 32

/* the three steps' bodies (block b's share; a block of any size for topk, >= E threads for scan, one warp for
 * scatter); cnt / fill: E ints of shared memory */
__device__ void route_topk_block(int b, float *logits, const float *bias, int n, int E, int K, float softcap,
                                 int *topk_idx, float *topk_w, int *blk_cnt, int *cnt) {
    for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
    int t0 = b * ROUTE_TOK, t1 = min(n, t0 + ROUTE_TOK);
    for (int t = t0 + (threadIdx.x >> 5); t < t1; t += blockDim.x >> 5)
        route_token(logits + (size_t)t * E, bias, E, K, softcap, topk_idx + (size_t)t * K, topk_w + (size_t)t * K);
    __syncthreads();                                /* the block's top-k (global) and the zeroed counts */
    for (int p = t0 * K + threadIdx.x; p < t1 * K; p += blockDim.x) atomicAdd(&cnt[topk_idx[p]], 1);
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) blk_cnt[(size_t)b * E + e] = cnt[e];
}

/* exclusive prefix sum over the block (blockDim.x a multiple of 32); *total gets the sum */
__device__ int block_exclusive_scan(int v, int *total) {
    __shared__ int wsum[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int incl = v;
    for (int o = 1; o < 32; o <<= 1) { int u = __shfl_up_sync(0xffffffffu, incl, o); if (lane >= o) incl += u; }
    __syncthreads();                                /* wsum may still be read by a previous call */
    if (lane == 31) wsum[warp] = incl;
    __syncthreads();
    int before = 0, all = 0;
    for (int w = 0; w < nw; w++) { if (w < warp) before += wsum[w]; all += wsum[w]; }
    *total = all;
    return before + incl - v;
}

__device__ void route_scan_block(int *blk_cnt, int nblk, int E, int bm, int *start, int *active, int *n_active,
                                 int *tile_start) {
    int e = threadIdx.x, cnt = 0;
    if (e < E)
        for (int b = 0; b < nblk; b++) {            /* counts -> offsets within the expert, in block order */
            int c = blk_cnt[(size_t)b * E + e];
            blk_cnt[(size_t)b * E + e] = cnt;
            cnt += c;
        }
    int P, na, nt;
    int s = block_exclusive_scan(cnt, &P);
    int a = block_exclusive_scan(cnt > 0, &na);
    int ts = block_exclusive_scan((cnt + bm - 1) / bm, &nt);
    if (e < E) {
        start[e] = s;
        tile_start[e] = ts;
        if (cnt) active[a] = e;
        for (int b = 0; b < nblk; b++) blk_cnt[(size_t)b * E + e] += s;
    }
    if (e == 0) { start[E] = P; tile_start[E] = nt; *n_active = na; }
}

__device__ void route_scatter_block(int b, const int *topk_idx, const float *topk_w, int n, int E, int K,
                                    const int *blk_off, int *pair_tok, float *pair_w, int *inv, int *fill) {
    int lane = threadIdx.x;                         /* fill: pairs placed so far in this block, per expert */
    for (int e = lane; e < E; e += 32) fill[e] = 0;
    __syncwarp();
    const int *off = blk_off + (size_t)b * E;
    int p0 = b * ROUTE_TOK * K, p1 = min(n, (b + 1) * ROUTE_TOK) * K;
    for (int base = p0; base < p1; base += 32) {
        int p = base + lane;
        int e = p < p1 ? topk_idx[p] : E + lane;    /* idle lanes: keys no expert has */
        unsigned peers = __match_any_sync(0xffffffffu, e);
        if (p < p1) {
            int k = off[e] + fill[e] + __popc(peers & ((1u << lane) - 1));
            pair_tok[k] = p / K;
            pair_w[k] = topk_w[p];
            inv[p] = k;
        }
        __syncwarp();
        if (p < p1 && lane == 31 - __clz(peers)) fill[e] += __popc(peers);   /* the last peer counts them */
        __syncwarp();
    }
}

__global__ void __launch_bounds__(256) route_many_topk(float *logits, const float *bias, int n, int E, int K,
                                                       float softcap, int *topk_idx, float *topk_w, int *blk_cnt) {
    extern __shared__ int cnt[];                    /* [E] */
    route_topk_block(blockIdx.x, logits, bias, n, E, K, softcap, topk_idx, topk_w, blk_cnt, cnt);
}
__global__ void __launch_bounds__(1024) route_many_scan(int *blk_cnt, int nblk, int E, int bm, int *start,
                                                        int *active, int *n_active, int *tile_start) {
    route_scan_block(blk_cnt, nblk, E, bm, start, active, n_active, tile_start);
}
__global__ void __launch_bounds__(32) route_many_scatter(const int *topk_idx, const float *topk_w, int n, int E, int K,
                                                         const int *blk_off, int *pair_tok, float *pair_w, int *inv) {
    extern __shared__ int fill[];                   /* [E] */
    route_scatter_block(blockIdx.x, topk_idx, topk_w, n, E, K, blk_off, pair_tok, pair_w, inv, fill);
}
/* up to ROUTE_TOK tokens (verification): the three steps in one block of >= E threads, one launch instead of three
 * (the block's global writes are visible to its own threads after each barrier). The same plan; a 16-token
 * verification 14.40 -> 14.33 ms on the H200 (dev/gpu_notes.md, round 10). */
__global__ void __launch_bounds__(1024) route_few(float *logits, const float *bias, int n, int E, int K, float softcap,
                                                  int *topk_idx, float *topk_w, int *blk_cnt, int bm, int *start,
                                                  int *active, int *n_active, int *tile_start, int *pair_tok,
                                                  float *pair_w, int *inv) {
    extern __shared__ int cnt[];                    /* [E]: counts, then the scatter's fill */
    route_topk_block(0, logits, bias, n, E, K, softcap, topk_idx, topk_w, blk_cnt, cnt);
    __syncthreads();
    route_scan_block(blk_cnt, 1, E, bm, start, active, n_active, tile_start);
    __syncthreads();
    if (threadIdx.x < 32) route_scatter_block(0, topk_idx, topk_w, n, E, K, blk_cnt, pair_tok, pair_w, inv, cnt);
}

/* ---- grouped expert GEMM on tensor cores (bf16 weights, many pairs) ----
 * out[k, f] = sum_j A[k, j] W_e[f, j] for the pairs k of expert e (rows start[e]..start[e+1] of A, which holds the
 * pairs' inputs gathered in expert order). One launch per projection: blockIdx.y is an m-tile of BM pairs of one
 * expert (found in tile_start by binary search; the grid is an upper bound, extra tiles exit), blockIdx.x a block
 * of output features, so the m-tiles of one expert and the feature blocks of one m-tile run side by side and
 * share weights and inputs through L2. 4 warps, mma.sync m16n8k16 (bf16 in, fp32 accumulators), ldmatrix,
 * 3-stage cp.async pipeline over K in steps of 64; rows, features and K past the ends are zero-filled, so any
 * size with K % 8 == 0 works.
 *   GATED (gate_up, W_e [2N, K]): the tile takes gate rows f0..f0+63 and the matching up rows N+f0..; each thread
 *     holds gate and up of the same features, so SwiGLU is the epilogue: out = bf16 silu(gate) * up, [P, N].
 *   else (down, W_e [N, K]): out = fp32 [P, N], one row per pair (moe_combine weights and sums them). */
constexpr int MOE_BN = 128, MOE_BK = 64, MOE_LDS = MOE_BK + 8, MOE_STAGES = 3;   /* +8: conflict-free ldmatrix */

template <int BM>
constexpr int moe_gemm_smem() { return MOE_STAGES * (BM + MOE_BN) * MOE_LDS * 2; }

template <int BM, bool GATED>
__global__ void __launch_bounds__(128) moe_gemm(const bf16 *A, const bf16 *W, int N, int K, const int *start,
                                                const int *tile_start, int E, void *out) {
    constexpr int BN = MOE_BN, BK = MOE_BK, LDS = MOE_LDS, ST = MOE_STAGES;
    constexpr int WM = BM / 32, WN = 4 / WM, WNW = BN / WN, NT = WNW / 8, NP = NT / 2;   /* warp tile 32 x WNW */
    static_assert(WM * WN == 4 && NP % 2 == 0, "tile shape");
    extern __shared__ __align__(16) unsigned char smem[];
    bf16 (*As)[BM][LDS] = reinterpret_cast<bf16 (*)[BM][LDS]>(smem);
    bf16 (*Bs)[BN][LDS] = reinterpret_cast<bf16 (*)[BN][LDS]>(smem + ST * BM * LDS * sizeof(bf16));

    int y = blockIdx.y;
    if (y >= tile_start[E]) return;
    int lo = 0, hi = E;                             /* the expert: the last e with tile_start[e] <= y */
    while (hi - lo > 1) { int mid = (lo + hi) / 2; if (tile_start[mid] <= y) lo = mid; else hi = mid; }
    const int e = lo, row0 = start[e] + (y - tile_start[e]) * BM, rows = min(BM, start[e + 1] - row0);
    const int f0 = blockIdx.x * (GATED ? BN / 2 : BN);
    const bf16 *Ae = A + (size_t)row0 * K, *We = W + (size_t)e * (GATED ? 2 : 1) * N * K;

    auto load = [&](int st, int k0) {
        for (int c = threadIdx.x; c < BM * BK / 8; c += 128) {
            int r = c / (BK / 8), k = k0 + c % (BK / 8) * 8;
            bool v = r < rows && k < K;
            cp_async16(&As[st][r][k - k0], v ? Ae + (size_t)r * K + k : A, v);
        }
        for (int c = threadIdx.x; c < BN * BK / 8; c += 128) {
            int r = c / (BK / 8), k = k0 + c % (BK / 8) * 8;
            int f = f0 + (GATED ? r % (BN / 2) : r);
            size_t wrow = GATED && r >= BN / 2 ? (size_t)N + f : (size_t)f;
            bool v = f < N && k < K;
            cp_async16(&Bs[st][r][k - k0], v ? We + wrow * K + k : W, v);
        }
    };
    const int nk = (K + BK - 1) / BK;
#pragma unroll
    for (int s = 0; s < ST - 1; s++) {
        if (s < nk) load(s, s * BK);
        asm volatile("cp.async.commit_group;" ::: "memory");
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wm = warp / WN, wn = warp % WN;
    float acc[2][NT][4] = {};
    for (int kt = 0; kt < nk; kt++) {
        asm volatile("cp.async.wait_group %0;" ::"n"(ST - 2) : "memory");
        __syncthreads();                            /* tile kt landed; every warp is done with tile kt - 1 */
        if (kt + ST - 1 < nk) load((kt + ST - 1) % ST, (kt + ST - 1) * BK);
        asm volatile("cp.async.commit_group;" ::: "memory");
        const int st = kt % ST;
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++) {
            uint32_t a[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
                ldmatrix_x4(a[mt], &As[st][wm * 32 + mt * 16 + (lane & 15)][kk * 16 + (lane >> 4) * 8], false);
#pragma unroll
            for (int np = 0; np < NP; np++) {
                /* this warp's feature rows: gate then up halves (GATED), or one run of WNW rows */
                int br = GATED ? (np < NP / 2 ? wn * (WNW / 2) + np * 16 : BN / 2 + wn * (WNW / 2) + (np - NP / 2) * 16)
                               : wn * WNW + np * 16;
                uint32_t b[4];
                int mi = lane >> 3;
                ldmatrix_x4(b, &Bs[st][br + (mi >> 1) * 8 + (lane & 7)][kk * 16 + (mi & 1) * 8], false);
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
                    mma_bf16(acc[mt][2 * np], a[mt], b[0], b[1]);
                    mma_bf16(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
                }
            }
        }
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    const int gid = lane >> 2, tig = lane & 3;
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int i = 0; i < 2; i++) {
            int r = wm * 32 + mt * 16 + gid + 8 * i;
            if (r >= rows) continue;
            size_t orow = (size_t)(row0 + r) * N;
            if (GATED) {
#pragma unroll
                for (int nt = 0; nt < NT / 2; nt++) {
                    int f = f0 + wn * (WNW / 2) + nt * 8 + tig * 2;
                    if (f >= N) continue;
                    const float *gt = acc[mt][nt], *up = acc[mt][nt + NT / 2];
                    *(__nv_bfloat162 *)((bf16 *)out + orow + f) =
                        __floats2bfloat162_rn(silu(gt[2 * i]) * up[2 * i], silu(gt[2 * i + 1]) * up[2 * i + 1]);
                }
            } else {
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    int f = f0 + wn * WNW + nt * 8 + tig * 2;
                    if (f < N) *(float2 *)((float *)out + orow + f) = make_float2(acc[mt][nt][2 * i], acc[mt][nt][2 * i + 1]);
                }
            }
        }
}

/* the m-tile height for P pairs over E experts: 64 once experts average >= 48 pairs, else 32 (less padding) */
static int moe_bm(int P, int E) { return P >= 48 * E ? 64 : 32; }

/* launch one grouped projection: gate_up (GATED, N = I, K = H) or down (N = H, K = I) */
template <bool GATED>
static void moe_gemm_launch(int bm, const bf16 *A, const bf16 *W, int N, int K, const int *start, const int *tile_start,
                            int E, int P, void *out, cudaStream_t s) {
    int fb = GATED ? MOE_BN / 2 : MOE_BN;
    int max_active = P < E ? P : E;
    dim3 grid((N + fb - 1) / fb, (P + bm - 1) / bm + max_active);   /* an upper bound on the m-tiles */
    if (bm == 64) moe_gemm<64, GATED><<<grid, 128, moe_gemm_smem<64>(), s>>>(A, W, N, K, start, tile_start, E, out);
    else moe_gemm<32, GATED><<<grid, 128, moe_gemm_smem<32>(), s>>>(A, W, N, K, start, tile_start, E, out);
    LAUNCH_CHECK();
}

/* the grouped GEMMs and the double-buffered flash attention at head_dim 128 take more than the default 48 KB
 * of shared memory */
static void prefill_kernels_setup() {
    CUDA_CHECK(cudaFuncSetAttribute(attention_flash<bf16, 128, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize, flash_smem_bytes(128)));
    CUDA_CHECK(cudaFuncSetAttribute(attention_flash<bf16, 128, 4>, cudaFuncAttributeMaxDynamicSharedMemorySize, flash_smem_bytes(128)));
    CUDA_CHECK(cudaFuncSetAttribute(attention_flash<fp8, 128, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize, flash_smem_bytes(128)));
    CUDA_CHECK(cudaFuncSetAttribute(attention_flash<fp8, 128, 4>, cudaFuncAttributeMaxDynamicSharedMemorySize, flash_smem_bytes(128)));
    /* the long-context kernel (KS): the tiles and its q rows (D 128: over 48 KB) */
    CUDA_CHECK(cudaFuncSetAttribute(attention_flash<bf16, 128, 4, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, flash_smem_bytes(128, true)));
    CUDA_CHECK(cudaFuncSetAttribute(attention_flash<fp8, 128, 4, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, flash_smem_bytes(128, true)));
    CUDA_CHECK(cudaFuncSetAttribute(moe_gemm<64, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, moe_gemm_smem<64>()));
    CUDA_CHECK(cudaFuncSetAttribute(moe_gemm<64, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, moe_gemm_smem<64>()));
    CUDA_CHECK(cudaFuncSetAttribute(moe_gemm<32, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, moe_gemm_smem<32>()));
    CUDA_CHECK(cudaFuncSetAttribute(moe_gemm<32, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, moe_gemm_smem<32>()));
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

/* n > 1 on quantized files: rows of a q8 / q4 matrix dequantized (value * scale) for the GEMMs, into dst in the same
 * row order. With sel (the active experts: sel[0..*n_sel)) the matrix is a stack of experts of `rows` rows each and
 * only the active ones are written, each at its own place (output row r of slot a = row r of expert sel[a]); the
 * grid covers max_sel slots, the ones past *n_sel return. */
template <typename W, typename T>
__global__ void dequant_kernel(T *dst, WPtr w, int in, int rows, int max_sel, const int *sel, const int *n_sel) {
    constexpr int CH = Fmt<W>::CH;
    size_t per = (in + CH - 1) / CH, total = (size_t)(sel ? max_sel : 1) * rows * per;
    int ns = sel ? *n_sel : 1;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        size_t r = i / per, a = r / rows;
        if ((int)a >= ns) break;                     /* slots past the active experts (i grows: none after) */
        size_t src = sel ? (size_t)sel[a] * rows + r % rows : r;
        int k = (int)(i % per) * CH;
        dequant_chunk<W>(wrow<W>(w, src, in), k, in, dst + src * in + k);
    }
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
 * Greedy: one block takes the argmax (first index on ties). Otherwise softmax(logits / T) and top-p: the nucleus is
 * {p >= threshold}, the threshold found by a 3-pass radix select over the float bits of p (positive floats order
 * like their bits) so that its mass first exceeds top-p; then the token where the running mass, in index order,
 * passes coin * mass. Same distribution as the CPU sampler (which walks the sorted order).
 * A token's probability counts as the integer q = p * 2^31 rounded to nearest (p <= 1: the q of all tokens add to at
 * most 2^31 + V / 2, so 32 bits hold every sum): integer sums do not depend on their order, so the histograms take
 * native atomics (shared-memory float atomics are compare-and-swap loops, which queue when many threads hit one
 * bin), and the scans and the pick are exact and the same on every run. A q is off p * 2^31 by at most 1/2, and the
 * errors of many tokens mostly cancel (truncating instead biased a flat 100K-token nucleus by ~4e-5 of mass, 5 tokens
 * too many: dev/sample_lab).
 * The work is spread over the GPU: SAMPLE_CHUNK tokens a block, one launch per step of the math --
 *   sample_stats: each block's max logit and its sum of exp(logit / T - that max);
 *   sample_radix (x 3): the global max and sum from those (every block, the same order: the same bits), then the
 *     bins already chosen (the earlier passes' histograms, scanned by every block alike), then this pass's
 *     histogram of p over the tokens still in play: a block's in shared memory, added into the global one;
 *   sample_mass: the nucleus mass of each block's tokens;
 *   sample_pick (one block): the block where coin * mass falls, then the token inside it.
 * The radix passes skip p < (1 - topp) / 4V: those tokens hold under a quarter of 1 - topp, so the tokens at or
 * above them hold more than topp, the threshold is above them, and no bin the select reads changes.
 * Why several launches: one block of 1024 threads did it all before and was bound by its one SM's issue rate
 * (~50 instructions a token in each of 5 passes over 100K tokens): 137 us a token at T 0.6, top-p 0.95 even with
 * 16-byte loads, 8 histogram copies and block-wide scans, ~350 us before those. The chain takes 31 us in plain
 * launches (dev/sample_lab, V 100,352), less in the decode graph: decode at T 0.6 / top-p 0.95 went 404 -> 464-473
 * tok/s at 512 against 472-478 greedy (H200, dev/gpu_notes.md, round 17). dev/sample_lab checks the threshold
 * against the CPU's rule and the draws against the distribution from V 16 to 100,352. */
constexpr int SB = 8;                       /* argmax: 16-byte loads a thread has in flight */
constexpr int SAMPLE_THREADS = 256, SAMPLE_PER = 8, SAMPLE_CHUNK = SAMPLE_THREADS * SAMPLE_PER;  /* tokens a block */
/* radix pass k reads bits [RADIX_SHIFT(k), + RADIX_BITS(k)) of p (from bit 30 down: p >= 0, the sign bit is 0) */
__host__ __device__ constexpr int RADIX_SHIFT(int k) { return k == 0 ? 20 : k == 1 ? 10 : 0; }
__host__ __device__ constexpr int RADIX_BITS(int k) { return k == 0 ? 11 : 10; }
__host__ __device__ constexpr int RADIX_OFF(int k) { return k == 0 ? 0 : k == 1 ? 2048 : 3072; }
constexpr int RADIX_BINS = 4096;            /* the three passes' histograms, side by side */

/* the sampler's scratch on the device (gpu_init sizes stats and mass for ceil(V / SAMPLE_CHUNK) blocks) */
struct SampleScratch {
    uint32_t hist[RADIX_BINS];              /* pass k's bins at RADIX_OFF(k) (q units); zeroed by sample_stats */
    float mx, sum;                          /* max logit / T and the sum of exp(logit / T - mx) (sample_radix's block 0) */
    uint32_t thr, pad;                      /* the nucleus threshold's bits (sample_mass's block 0) */
    float2 stats[1];                        /* [blocks]: (block's max logit, sum of exp(logit / T - its max / T)) */
};
static size_t sample_scratch_bytes(int V) {
    const int nb = (V + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK;
    return sizeof(SampleScratch) + nb * sizeof(float2) + nb * sizeof(uint32_t);
}
/* the nucleus masses of the nblk chunks: after the stats */
__device__ __forceinline__ uint32_t *sample_masses(SampleScratch *s, int nblk) { return (uint32_t *)(s->stats + nblk); }

/* the token, to the device's Step and to the step's host slot (mapped memory: the host reads it once the step has
 * finished) */
__device__ __forceinline__ void put_token(Step *st, Step *ring, int token) {
    st->out = token;
    *(volatile int *)&ring[st->seq & 1].out = token;
    __threadfence_system();
}
__device__ __forceinline__ uint32_t qmass(float p) { return __float2uint_rn(p * 2147483648.0f); }
__device__ __forceinline__ bool top_p_on(float topp) { return topp > 0.0f && topp < 1.0f; }
__device__ __forceinline__ uint32_t topp_target(float topp) { return (uint32_t)((double)topp * 2147483648.0); }   /* q units */

/* this thread's SAMPLE_PER consecutive logits of the block's chunk (-inf past V: p = 0, never drawn) */
__device__ __forceinline__ int chunk_logits(const float *logits, int V, int blk, float l[SAMPLE_PER]) {
    const int i0 = blk * SAMPLE_CHUNK + threadIdx.x * SAMPLE_PER;
    if (i0 + SAMPLE_PER <= V && ((uintptr_t)(logits + i0) & 15) == 0) {
        const float4 a = *(const float4 *)(logits + i0), b = *(const float4 *)(logits + i0 + 4);
        l[0] = a.x; l[1] = a.y; l[2] = a.z; l[3] = a.w; l[4] = b.x; l[5] = b.y; l[6] = b.z; l[7] = b.w;
    } else {
        for (int k = 0; k < SAMPLE_PER; k++) l[k] = i0 + k < V ? logits[i0 + k] : -INFINITY;
    }
    return i0;
}

/* sum / max / exclusive scan over the block (SAMPLE_THREADS threads), every thread gets the result */
template <typename T, typename Op> __device__ T sample_block_reduce(T v, Op op) {
    __shared__ T red[SAMPLE_THREADS / 32];
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    T r = red[0];
    for (int w = 1; w < SAMPLE_THREADS / 32; w++) r = op(r, red[w]);
    return r;
}
__device__ uint32_t sample_block_excl_scan(uint32_t v, uint32_t *total) {
    __shared__ uint32_t wsum[SAMPLE_THREADS / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint32_t incl = v;
    for (int o = 1; o < 32; o <<= 1) { uint32_t u = __shfl_up_sync(0xffffffffu, incl, o); if (lane >= o) incl += u; }
    __syncthreads();
    if (lane == 31) wsum[warp] = incl;
    __syncthreads();
    uint32_t before = 0, all = 0;
    for (int w = 0; w < SAMPLE_THREADS / 32; w++) { if (w < warp) before += wsum[w]; all += wsum[w]; }
    *total = all;
    return before + incl - v;
}

/* the radix select's scan of one pass's histogram h (nb bins), by the whole block: the highest bin b > 0 whose mass
 * plus above plus the mass of the bins above it exceeds target (bin 0 if none); above grows by the bins above b.
 * Each thread owns nb / SAMPLE_THREADS consecutive bins; the mass above a thread's bins is a suffix sum (in the warp
 * by shuffles, then over the warps). Exact integers: the one bin where the mass above is still <= target. */
__device__ int radix_scan(const uint32_t *h, int nb, uint32_t target, uint32_t &above) {
    __shared__ uint32_t wt[SAMPLE_THREADS / 32], s_acc, s_acc0;
    __shared__ int s_bin;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, per = nb / SAMPLE_THREADS;   /* 8 or 4 */
    uint32_t hb[8], m = 0;
#pragma unroll
    for (int k = 0; k < 8; k++) { hb[k] = k < per ? __ldcg(h + tid * per + k) : 0; m += hb[k]; }
    uint32_t S = m;                                  /* the bins from this thread's first up to the warp's last */
    for (int o = 1; o < 32; o <<= 1) { uint32_t v = __shfl_down_sync(0xffffffffu, S, o); if (lane + o < 32) S += v; }
    __syncthreads();                                 /* (the shared words may still be read by a previous call) */
    if (lane == 0) wt[warp] = S;
    if (tid == 0) s_bin = -1;
    __syncthreads();
    uint32_t run = above + S - m;
    for (int w = warp + 1; w < SAMPLE_THREADS / 32; w++) run += wt[w];
    for (int k = per - 1; k >= 0; k--) {
        const int b = tid * per + k;
        if (b == 0) { s_acc0 = run; break; }         /* the mass above bin 0, if no bin is found */
        if (run <= target && run + hb[k] > target) { s_bin = b; s_acc = run; break; }
        run += hb[k];
    }
    __syncthreads();
    const int bin = s_bin;
    above = bin >= 0 ? s_acc : s_acc0;
    return bin >= 0 ? bin : 0;
}
/* the bits chosen by the first `passes` passes (and the mass above them) */
__device__ uint32_t radix_prefix(const uint32_t *hist, int passes, uint32_t target, uint32_t &above) {
    uint32_t prefix = 0;
    above = 0;
    for (int k = 0; k < passes; k++)
        prefix |= (uint32_t)radix_scan(hist + RADIX_OFF(k), 1 << RADIX_BITS(k), target, above) << RADIX_SHIFT(k);
    return prefix;
}
/* the global max (of logit / T) and sum from the blocks' stats; every block computes the same (warp 0, in order) */
__device__ void softmax_norm(const SampleScratch *s, int nblk, float T, float &mx, float &sum) {
    __shared__ float s_mx, s_sum;
    if (threadIdx.x < 32) {
        float m = -INFINITY;
        for (int b = threadIdx.x; b < nblk; b += 32) m = fmaxf(m, __ldcg(&s->stats[b].x));
        m = warp_max(m) / T;
        float t = 0.0f;
        for (int b = threadIdx.x; b < nblk; b += 32) {
            const float2 st = __ldcg(&s->stats[b]);
            t += st.y * expf(st.x / T - m);
        }
        t = warp_sum(t);
        if (threadIdx.x == 0) { s_mx = m; s_sum = t; }
    }
    __syncthreads();
    mx = s_mx;
    sum = s_sum;
}

/* greedy: the argmax, one block, 16-byte loads with SB in flight a thread, then the tail; each thread sees its
 * indices in increasing order, so a strict > keeps the first of equal values */
__global__ void __launch_bounds__(1024) sample_greedy(const float *logits, int V, Step *st, Step *ring) {
    TRACE_BLOCK();
    griddep_wait();
    griddep_launch();
    __shared__ float red_v[32];
    __shared__ int red_i[32];
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nt = blockDim.x;
    float bv = -INFINITY;
    int bi = V;
    const int V4 = ((uintptr_t)logits & 15) == 0 ? V / 4 : 0;
    const float4 *l4 = (const float4 *)logits;
    for (int b = tid; b < V4; b += SB * nt) {
        float4 v[SB];
#pragma unroll
        for (int u = 0; u < SB; u++) v[u] = b + u * nt < V4 ? l4[b + u * nt] : make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
#pragma unroll
        for (int u = 0; u < SB; u++) {
            const int i = 4 * (b + u * nt);
            if (v[u].x > bv) { bv = v[u].x; bi = i; }
            if (v[u].y > bv) { bv = v[u].y; bi = i + 1; }
            if (v[u].z > bv) { bv = v[u].z; bi = i + 2; }
            if (v[u].w > bv) { bv = v[u].w; bi = i + 3; }
        }
    }
    for (int i = 4 * V4 + tid; i < V; i += nt) if (logits[i] > bv) { bv = logits[i]; bi = i; }
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
        put_token(st, ring, red_i[0]);
    }
}

/* each block's max logit and its sum of exp(logit / T - max / T); block 0 zeroes the radix histograms */
__global__ void __launch_bounds__(SAMPLE_THREADS) sample_stats(const float *logits, int V, const Step *st,
                                                               SampleScratch *s) {
    TRACE_BLOCK();
    griddep_wait();
    griddep_launch();
    const float T = st->temperature;
    float l[SAMPLE_PER];
    chunk_logits(logits, V, blockIdx.x, l);
    float m = -INFINITY;
    for (int k = 0; k < SAMPLE_PER; k++) m = fmaxf(m, l[k]);
    m = sample_block_reduce(m, [](float a, float b) { return fmaxf(a, b); });
    float t = 0.0f;
    for (int k = 0; k < SAMPLE_PER; k++) t += expf(l[k] / T - m / T);
    t = sample_block_reduce(t, [](float a, float b) { return a + b; });
    if (threadIdx.x == 0) s->stats[blockIdx.x] = make_float2(m, t);
    if (blockIdx.x == 0) for (int b = threadIdx.x; b < RADIX_BINS; b += SAMPLE_THREADS) s->hist[b] = 0;
}

/* radix pass `pass` (0..2): the tokens of this block whose bits match the bins the earlier passes chose, into this
 * pass's histogram (a block's in shared memory first: one global atomic per bin it touched) */
__global__ void __launch_bounds__(SAMPLE_THREADS) sample_radix(const float *logits, int V, const Step *st,
                                                               SampleScratch *s, int pass) {
    TRACE_BLOCK();
    __shared__ uint32_t hist[2048];
    griddep_wait();
    griddep_launch();
    const float T = st->temperature, topp = st->topp;
    float mx, sum;                                  /* pass 0 finds them (with top-p or not), the later passes read them */
    if (pass == 0) {
        softmax_norm(s, gridDim.x, T, mx, sum);
        if (blockIdx.x == 0 && threadIdx.x == 0) { s->mx = mx; s->sum = sum; }
    }
    if (!top_p_on(topp)) return;
    if (pass > 0) {
        mx = __ldcg(&s->mx);
        sum = __ldcg(&s->sum);
    }
    const uint32_t target = topp_target(topp);
    uint32_t above;
    const uint32_t prefix = radix_prefix(s->hist, pass, target, above);
    const int nb = 1 << RADIX_BITS(pass), sft = RADIX_SHIFT(pass);
    const uint32_t himask = ~0u << (sft + RADIX_BITS(pass));  /* the bits already chosen (pass 0: the sign bit) */
    for (int b = threadIdx.x; b < nb; b += SAMPLE_THREADS) hist[b] = 0;
    __syncthreads();
    const float skip = topp <= 0.999f ? (1.0f - topp) / (4.0f * (float)V) : 0.0f;
    float l[SAMPLE_PER];
    chunk_logits(logits, V, blockIdx.x, l);
    int cb = -1;                                    /* this thread's run: its bin and the mass it has gathered */
    uint32_t ca = 0;
    for (int k = 0; k < SAMPLE_PER; k++) {
        const float p = expf(l[k] / T - mx) / sum;
        const uint32_t bits = __float_as_uint(p);
        if (p >= skip && (bits & himask) == prefix) {
            const int bin = (bits >> sft) & (nb - 1);
            if (bin != cb) { if (cb >= 0) atomicAdd(&hist[cb], ca); cb = bin; ca = 0; }
            ca += qmass(p);
        }
    }
    if (cb >= 0) atomicAdd(&hist[cb], ca);
    __syncthreads();
    for (int b = threadIdx.x; b < nb; b += SAMPLE_THREADS)
        if (hist[b]) atomicAdd(&s->hist[RADIX_OFF(pass) + b], hist[b]);
}

/* the nucleus threshold (block 0 keeps it for the pick) and each block's nucleus mass */
__global__ void __launch_bounds__(SAMPLE_THREADS) sample_mass(const float *logits, int V, const Step *st,
                                                              SampleScratch *s) {
    TRACE_BLOCK();
    griddep_wait();
    griddep_launch();
    const float T = st->temperature, topp = st->topp, mx = __ldcg(&s->mx), sum = __ldcg(&s->sum);
    uint32_t above;                                 /* thr 0: every token (no top-p) */
    const uint32_t thr = top_p_on(topp) ? radix_prefix(s->hist, 3, topp_target(topp), above) : 0u;
    if (blockIdx.x == 0 && threadIdx.x == 0) s->thr = thr;
    float l[SAMPLE_PER];
    chunk_logits(logits, V, blockIdx.x, l);
    uint32_t m = 0;
    for (int k = 0; k < SAMPLE_PER; k++) {
        const float p = expf(l[k] / T - mx) / sum;
        if (__float_as_uint(p) >= thr) m += qmass(p);
    }
    m = sample_block_reduce(m, [](uint32_t a, uint32_t b) { return a + b; });
    if (threadIdx.x == 0) sample_masses(s, gridDim.x)[blockIdx.x] = m;
}

/* one block: the chunk where coin * (nucleus mass) falls, then the token inside it, in index order */
__global__ void __launch_bounds__(SAMPLE_THREADS) sample_pick(const float *logits, int V, int nblk, Step *st,
                                                              SampleScratch *s, Step *ring) {
    TRACE_BLOCK();
    griddep_wait();
    griddep_launch();
    __shared__ int s_blk, s_tok;
    __shared__ uint32_t s_base;
    const float T = st->temperature, mx = __ldcg(&s->mx), sum = __ldcg(&s->sum);
    const uint32_t thr = __ldcg(&s->thr);
    const uint32_t *mass = sample_masses(s, nblk);
    /* each thread a run of consecutive chunks' masses; the exclusive scan gives each chunk's start */
    const int per = (nblk + SAMPLE_THREADS - 1) / SAMPLE_THREADS, c0 = threadIdx.x * per;
    uint32_t mine = 0;
    for (int c = c0; c < c0 + per && c < nblk; c++) mine += __ldcg(mass + c);
    uint32_t M;
    uint32_t run = sample_block_excl_scan(mine, &M);
    const uint32_t target = (uint32_t)((double)st->coin * (double)M);   /* coin < 1: target < M */
    if (threadIdx.x == 0) { s_blk = -1; s_tok = -1; }
    __syncthreads();
    if (run <= target && target < run + mine)       /* exactly one thread */
        for (int c = c0; c < c0 + per && c < nblk; c++) {
            const uint32_t mc = __ldcg(mass + c);
            if (target < run + mc) { s_blk = c; s_base = run; break; }
            run += mc;
        }
    __syncthreads();
    const int blk = s_blk;
    if (blk >= 0) {                                 /* (always, but for a mass of 0: then the argmax below) */
        float l[SAMPLE_PER];
        const int i0 = chunk_logits(logits, V, blk, l);
        uint32_t q[SAMPLE_PER], t = 0;
        for (int k = 0; k < SAMPLE_PER; k++) {
            const float p = expf(l[k] / T - mx) / sum;
            q[k] = __float_as_uint(p) >= thr ? qmass(p) : 0u;
            t += q[k];
        }
        uint32_t tot, c = s_base + sample_block_excl_scan(t, &tot);
        if (c <= target && target < c + t)
            for (int k = 0; k < SAMPLE_PER; k++) {
                c += q[k];
                if (target < c) { s_tok = i0 + k; break; }
            }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int tok = s_tok;
        if (tok < 0) {                              /* a zero mass (cannot happen: the max token has p >= 1 / V) */
            float bv = -INFINITY;
            for (int i = 0; i < V; i++) if (logits[i] > bv) { bv = logits[i]; tok = i; }
        }
        put_token(st, ring, tok);
    }
}

/* ----------------------------------------------------------------------------
 * the model on the device */

#define ARGMAX_SLICES 32      /* blocks a row of the n-row argmax (argmax_slices; one lane each in argmax_merge) */

struct GpuLayer {
    void *wqkvg;             /* [NQ, H]: wq, wk, wv, wg rows stacked (NQ = nh*D + 2*KVD + GD) */
    void *wkv;               /* drafter: [2*KVD, H], the k and v rows (the context add): a slice of wqkvg, or for
                              * q8 / q4 (whose scale plane follows all NQ rows) a copy of their own */
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
    void *kc, *vc;           /* KV cache [rows, KVD] (GpuModel.kv: bf16, f32 or fp8) */
    int rows;                /* ctx (full) or a ring of W + max_tokens - 1 (sliding) */
    int nh, NQ, GD, dense, hid;  /* hid: F (dense) or S (shared) */
};

#define BLOCK_GRAPHS 24       /* cached graphs of n-token forwards and context adds (GpuModel.bg) */
#define BLAS_WORKSPACE (32u << 20)   /* cuBLAS' workspace (its default size on Hopper) */
struct GpuModel {
    Config c;
    int ctx, T, bf;          /* bf: weights and KV in bf16 (else f32); quantized files: what is not quantized */
    int wdt, edt, ldt;       /* DT_* of the matmul weights (DT_BF16 / DT_F32 as bf says, or DT_Q8 / DT_Q4), of the
                                embedding and of lm_head (quantized files: q8 / q4 as in the file); the router never is */
    void *wdq;               /* quantized files, n > 1: a matrix (or the active experts) dequantized for the GEMMs */
    int decode_split[2];     /* attention splits per layer type for one token (fixed: the graph is reused) */
    int kv;                  /* the KV cache's type: KV_BF16, KV_F32 or KV_FP8 (--kv; default: the weights' dtype) */
    int attn_scalar;         /* LAGUNA_ATTN_SCALAR=1: the plain attention kernel on a bf16 / fp8 cache (a debug hook) */
    int long_from;           /* from this position on, full layers' one-token attention is attention_flash<KS> */
    int long_attn;           /* set per forward: pos >= long_from (read while enqueuing; each graph has its own) */
    int long_fold;           /* attention_flash<KS> does the q/k norm and RoPE (LAGUNA_LONG_FOLD=0: a launch before) */
    int pdl;                 /* programmatic dependent launch for the decode kernels (LAGUNA_NO_PDL=1: off) */
    int pdl_now;             /* set while enqueueing a one-token forward */
    int dup, nlaunch;        /* LAGUNA_DUP=k: the k-th decode launch of every layer enqueued twice (a timing hook) */
    int down_warp;           /* LAGUNA_DOWN_WARP=1: decode's down projections by moe_down_decode (q8 / q4's kernel) */
    uint4 *xq;               /* q8 / q4 decode: the normed x quantized once by the router for gate/up (quant_x8) */
    uint4 *hq;               /* q8 / q4 decode: h quantized once by gate/up for down (quant_x4: shared, then routed) */
    int qwarp;               /* LAGUNA_QWARP=1: q8 / q4 decode matvecs and experts by the warp kernels, not column slices */
    int few;                 /* bf16 GEMMs and experts of 2..16 tokens on tensor cores (gemm_few; LAGUNA_NO_FEW=1: cuBLAS
                                and the warp kernels, a test and timing hook) */
    int split_max;           /* LAGUNA_SPLIT_MAX: at most this many key splits for n-token attention (0: no cap) */
    /* forwards of 2..64 tokens (the drafter's block, the verify; ids or logits back) and the drafter's context add as
     * CUDA graphs, by the key of what their launches take from the host (block_graph()); a slot with no exec yet is a
     * key seen once, run as plain launches (LAGUNA_NO_BLOCK_GRAPH=1: always plain, a test hook) */
    int block_graphs;
    struct { long long key; cudaGraphExec_t exec; } bg[BLOCK_GRAPHS];
    int bg_used, bg_next;
    long bg_captured, bg_replayed;  /* counts, printed at gpu_free with LAGUNA_GRAPH_STATS=1 (for the tests) */
    void *blas_ws;           /* cuBLAS' workspace, ours (so its calls can be captured) */
    double few_max;          /* gemm_few for matrices of at most this many elements, cuBLAS above (LAGUNA_FEW_MAX: a timing
                                hook) */
    int few_q;               /* q8 / q4 matrices and experts of 2..16-token forwards (bf16-based files) by gemm_few and
                                moe_*_few, dequantized in registers (LAGUNA_NO_FEW_Q=1: dequantize + cuBLAS and the
                                warp kernels, a test and timing hook) */
    int split_cols;          /* o_proj by column slices over a cluster (LAGUNA_NO_SPLIT_COLS=1: the block-rows kernel) */
    int mv_loop;             /* whole-row matvecs by matvec_loop: -1 q8 / q4 (the default), 1 every format, 0 none
                                (LAGUNA_MV_LOOP=1 / 0: a test and timing hook) */
    int loop_blocks;         /* matvec_loop's grid at most this many blocks (LAGUNA_LOOP_BLOCKS: so the tests' small
                                matrices loop; 0: as many as fit the GPU) */
    /* LAGUNA_PROF=1 (a timing hook, dev/bench_gpu): forwards of 2..64 tokens (verification) record an event after
     * each step; the time between events is summed per step name and printed by gpu_free */
    int prof, prof_on, prof_n, prof_cap, prof_calls, prof_nstep;
    cudaEvent_t *prof_ev;
    const char **prof_name;
    const char *prof_step[32];
    double prof_ms[32];
    int moe_general;         /* LAGUNA_MOE_GENERAL=1: decode's gate/up by the general kernel (what H > 2048 takes) */
    int attn_cluster;        /* one-token attention of sliding layers as clusters of this many splits (0: global merge) */
    int full_cluster_keys;   /* ... and of full layers that never see more keys than this (full_cluster()) */
    int cluster_y;           /* set while launching a clustered kernel (launch()) */
    int cc_major;            /* compute capability (clusters need 9) */
    int fused_split[2];      /* attention_decode_fused splits per layer type */
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
    bf16 *act_few;           /* n <= 16, bf16: the experts' SwiGLU outputs [16 * K, I], then the shared expert's [16, S] */
    int *tokens, *pos, *topk_idx, *start, *pair_tok, *inv, *active, *n_active;
    int *blk_cnt, *tile_start;  /* n > 1 routing: per-block expert counts/offsets [T/ROUTE_TOK + 1, E]; GEMM m-tiles [E + 1] */
    int *counters;           /* last-block-done counters: [0] router_decode, [1 + kv head] attention_decode */
    size_t part_cap;         /* floats in part_o */
    void **gptr;             /* device pointer arrays for the grouped GEMMs [6 * E] */
    /* host side */
    int *h_tokens, *h_start;
    void **h_gptr;
    float *h_logits;
    Step *h_step, *d_step;   /* decode parameters: on the host (2 slots, mapped memory, pinned) and on the device */
    Step *m_step;            /* h_step as the device sees it */
    int seq, inflight;       /* decode steps launched so far, and how many of them not yet waited for */
    int chained;             /* the last thing on the stream is a decode step (a step may take its token) */
    cudaEvent_t step_done[2];   /* recorded after the step of each slot */
    int step_in;             /* set while enqueueing a decode step: the embedding reads its parameters from m_step */
    SampleScratch *sample_s; /* the sampler's histograms and per-block sums (sample_scratch_bytes) */
    cudaStream_t stream;
    cublasHandle_t blas;
    cudaGraphExec_t graph[2], graph_long[2];   /* the decode step before long_from, and from it (if ctx reaches it);
                                                  [0] greedy, [1] sampled (temperature > 0) */
    int use_graph;
    char summary[256];
    /* DFlash (the section at the end of this file) */
    int *ids, *h_ids;        /* [T] each row's argmax (gpu_forward_argmax), on the device and pinned on the host */
    int2 *amax_part;         /* [T, ARGMAX_SLICES] the argmax's slices: (value bits, index) */
    float *taps;             /* target: [T, n_taps, H] the residual stream after the tap layers, every row */
    int n_taps, tap_layers[LAGUNA_MAX_TAPS];
    void *fc;                /* drafter: [H, n_taps*H] */
    int fcdt;                /* drafter: fc's format (bf16 / f32: -1, as gemm's wdt; or q8 / q4) */
    float *hidden_norm;      /* drafter: [H] */
    float *aux_norm;         /* drafter: [n_taps, H] the per-tap norms, stacked */
    float *cat, *ctxv;       /* drafter: [T, n_taps*H] normed taps side by side, [T, H] the fused context */
};

static size_t dsize(const GpuModel *g) { return g->bf ? 2 : 4; }
static size_t kv_size(const GpuModel *g) { return g->kv == KV_FP8 ? 1 : g->kv == KV_BF16 ? 2 : 4; }
static const char *kv_name(const GpuModel *g) { return g->kv == KV_FP8 ? "fp8" : g->kv == KV_BF16 ? "bf16" : "f32"; }
/* X(T) with T the KV cache's element type: every kernel that touches the cache is dispatched through here */
#define KV_SWITCH(g, X) do { if ((g)->kv == KV_BF16) { X(bf16); } else if ((g)->kv == KV_FP8) { X(fp8); } else { X(float); } } while (0)
static cudaDataType_t dtype_of(const GpuModel *g) { return g->bf ? CUDA_R_16BF : CUDA_R_32F; }
static int is_quant(int dt) { return dt == DT_Q8 || dt == DT_Q4; }
static size_t group_bytes(int dt) { return dt == DT_Q8 ? LAGUNA_QGROUP : LAGUNA_QGROUP / 2; }
/* a rows x in matrix of format dt at p (q8 / q4: its scale plane follows the values) */
static WPtr wmat(int dt, const void *p, size_t rows, int in) {
    if (!is_quant(dt)) return WPtr(p);
    size_t groups = (in + LAGUNA_QGROUP - 1) / LAGUNA_QGROUP;
    return WPtr(p, (const uint16_t *)((const char *)p + rows * groups * group_bytes(dt)));
}
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

/* q8 / q4 tensors go up as they are in the file: value plane, then scale plane. k tensors stacked by rows (same
 * columns) become one such matrix: all their values, then all their scales. --random-weights fills them on the
 * device with the values laguna.c computes (random_qgroup). */
static void *stacked_q(Uploader *u, const Tensor **ts, int k) {
    int dt = ts[0]->dtype;
    size_t gb = group_bytes(dt), vbytes = 0;
    for (int i = 0; i < k; i++) vbytes += numel(ts[i]) / ts[i]->shape[ts[i]->ndim - 1] * ts[i]->groups * gb;
    char *d = (char *)reserve(u, vbytes + vbytes / gb * 2);
    if (!u->cursor) return d;
    char *v = d, *sc = d + vbytes;
    for (int i = 0; i < k; i++) {
        const Tensor *t = ts[i];
        int64_t cols = t->shape[t->ndim - 1];
        size_t ng = numel(t) / cols * t->groups;
        if (u->m->random_weights) {
            const TensorEntry *e = entry_of(u->m, t);
            fill_random_q<<<grid_for(ng, 256), 256, 0, u->g->stream>>>((uint8_t *)v, (uint16_t *)sc, ng, cols, dt,
                u->m->random_seed, name_key(e ? e->name : ""), sqrtf(3.0f / (float)cols));
            LAUNCH_CHECK();
        } else {
            CUDA_CHECK(cudaMemcpy(v, t->data, ng * gb, cudaMemcpyHostToDevice));
            CUDA_CHECK(cudaMemcpy(sc, t->scales, ng * 2, cudaMemcpyHostToDevice));
        }
        v += ng * gb;
        sc += ng * 2;
    }
    return d;
}

static void *weight(Uploader *u, const Tensor *t) {
    if (is_quant(t->dtype)) return stacked_q(u, &t, 1);
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
    if (is_quant(ts[0]->dtype)) return stacked_q(u, ts, k);
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
        g->fcdt = is_quant(w->fc.dtype) ? w->fc.dtype : -1;
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
        if (c->block_size) {
            const Tensor *kv[2] = {&lw->wk, &lw->wv};
            L->wkv = is_quant(lw->wk.dtype) ? stacked(u, kv, 2)
                   : L->wqkvg ? (char *)L->wqkvg + (size_t)L->nh * c->head_dim * c->dim * dsize(g) : NULL;
        }
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

/* can clusters of cl blocks of attention_decode_fused<KV, D, cl> run here (sm_90, and co-scheduled at all)? */
template <typename KV, int D, int CL>
static int cluster_fits_d(const GpuModel *g) {
    if (g->cc_major < 9) return 0;
    auto kernel = attention_decode_fused<KV, D, CL>;
    if (CL > 8 && cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = 1;
    attr.val.clusterDim.y = CL;
    attr.val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(g->c.n_kv_heads, CL);
    cfg.blockDim = dim3(256);
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess) { cudaGetLastError(); return 0; }
    return clusters > 0;
}
template <typename KV>
static int cluster_fits(const GpuModel *g, int D, int cl) {
    switch (D) {
    case 16: return cl == 16 ? cluster_fits_d<KV, 16, 16>(g) : cluster_fits_d<KV, 16, 8>(g);
    case 32: return cl == 16 ? cluster_fits_d<KV, 32, 16>(g) : cluster_fits_d<KV, 32, 8>(g);
    case 64: return cl == 16 ? cluster_fits_d<KV, 64, 16>(g) : cluster_fits_d<KV, 64, 8>(g);
    default: return cl == 16 ? cluster_fits_d<KV, 128, 16>(g) : cluster_fits_d<KV, 128, 8>(g);
    }
}

static int split_for(const GpuModel *g, int keys, int row_blocks, int n) {
    int s = (2 * g->nsm + row_blocks * g->c.n_kv_heads - 1) / (row_blocks * g->c.n_kv_heads);
    int most = (keys + 63) / 64;
    if (s > most) s = most;
    if (s > 64) s = 64;
    if (n > 1 && g->split_max > 0 && s > g->split_max) s = g->split_max;
    size_t cap = g->part_cap / ((size_t)n * g->c.max_heads * g->c.head_dim);
    if ((size_t)s > cap) s = (int)cap;
    return s < 1 ? 1 : s;
}

static void capture_decode(GpuModel *g);
static int fused_decode_attention(const GpuModel *g, int l, int n);
static int full_cluster(const GpuModel *g, int l);
static void capture_taps(GpuModel *g, int l, int n);

/* Does the GPU backend take this model? The shapes and weight formats its kernels are written for; anything else
 * runs on the CPU (main() says so and falls back; gpu_init refuses it). why: what it lacks, one line. */
#define NOT_TAKEN(...) do { snprintf(why, whysz, __VA_ARGS__); return 0; } while (0)
extern "C" int gpu_supports(const Model *m, char *why, size_t whysz) {
    const Config *c = &m->config;
    const Weights *mw = &m->weights;
    const int D = c->head_dim, H = c->dim, E = c->n_experts, K = c->n_experts_active;
    if (D != 16 && D != 32 && D != 64 && D != 128)
        NOT_TAKEN("head_dim %d is not supported by the GPU backend (16, 32, 64 or 128)", D);
    /* formats: the matmul weights all quantized alike (q8 or q4) or none of them; the embedding (and with it a tied
     * lm_head) and lm_head may be quantized on their own (export.py: the embedding is q8 in q4 files too); the
     * router never is */
    const int wdt = mw->layers[0].wq.dtype;
    for (int l = 0; l < c->n_layers; l++) {
        const LayerWeights *lw = &mw->layers[l];
        const Tensor *ts[] = {&lw->wq, &lw->wk, &lw->wv, &lw->wg, &lw->wo, &lw->w_gate, &lw->w_up, &lw->w_down,
                              &lw->shared_gate, &lw->shared_up, &lw->shared_down, &lw->experts_gate_up, &lw->experts_down};
        for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++)
            if (ts[i]->data && (is_quant(wdt) ? ts[i]->dtype != wdt : is_quant(ts[i]->dtype)))
                NOT_TAKEN("layer %d: the GPU backend needs every matmul weight in one format (q8, q4, or unquantized;"
                          " re-export with one --dtype)", l);
        if (lw->router.data && is_quant(lw->router.dtype))
            NOT_TAKEN("layer %d: a quantized router is not supported by the GPU backend", l);
        if ((c->n_heads[l] * D) % 8) NOT_TAKEN("layer %d: projection sizes not multiples of 8", l);
    }
    if (H % 8 || (E && (c->moe_hidden_dim % 8 || c->shared_hidden_dim % 8)) || c->hidden_dim % 8)
        NOT_TAKEN("the GPU backend needs hidden sizes that are multiples of 8");
    if (H > 16384 || c->max_heads * D > 16384)
        NOT_TAKEN("the GPU backend's decode matvec takes inputs of at most 16384");
    if (E > 1024 || K > 32) NOT_TAKEN("the GPU backend handles at most 1024 experts and top-32");
    return 1;
}
#undef NOT_TAKEN

#define GFAIL(...) do { snprintf(err, errsz, __VA_ARGS__); gpu_free(g); return NULL; } while (0)

extern "C" GpuModel *gpu_init(const Model *m, int ctx, int max_tokens, char *err, size_t errsz) {
    const Config *c = &m->config;
    GpuModel *g = (GpuModel *)calloc(1, sizeof(GpuModel));
    if (!g) { snprintf(err, errsz, "out of host memory"); return NULL; }
    g->c = *c;
    g->ctx = ctx;
    g->T = max_tokens;
    /* the dtype of what is not quantized: the embedding's, or in a quantized file the router's */
    const Weights *mw = &m->weights;
    int plain = model_plain_dtype(m);
    g->bf = plain != DT_F32;
    /* the target's --kv (a drafter's Model says KV_AUTO: its ring keeps its weights' dtype); bf16 on an f32 file
     * stays f32 */
    g->kv = m->kv == KV_F32 || m->kv == KV_FP8 ? m->kv : g->bf ? KV_BF16 : KV_F32;
    g->attn_scalar = getenv("LAGUNA_ATTN_SCALAR") != NULL;
    g->use_graph = !getenv("LAGUNA_NO_GRAPH");    /* for the test that graph replay equals plain launches */
    g->pdl = !getenv("LAGUNA_NO_PDL");
    g->dup = getenv("LAGUNA_DUP") ? atoi(getenv("LAGUNA_DUP")) : -1;
    g->moe_general = getenv("LAGUNA_MOE_GENERAL") != NULL;     /* so the tests reach that path at small shapes */
    g->prof = getenv("LAGUNA_PROF") != NULL;
    g->split_cols = getenv("LAGUNA_NO_SPLIT_COLS") == NULL;
    g->mv_loop = getenv("LAGUNA_MV_LOOP") ? atoi(getenv("LAGUNA_MV_LOOP")) != 0 : -1;
    g->loop_blocks = getenv("LAGUNA_LOOP_BLOCKS") ? atoi(getenv("LAGUNA_LOOP_BLOCKS")) : 0;
    g->down_warp = getenv("LAGUNA_DOWN_WARP") != NULL;     /* so the tests reach that path in bf16 / f32 */
    g->qwarp = getenv("LAGUNA_QWARP") != NULL;            /* so the tests reach those kernels */
    g->few = getenv("LAGUNA_NO_FEW") == NULL;
    g->few_q = getenv("LAGUNA_NO_FEW_Q") == NULL;
    g->few_max = getenv("LAGUNA_FEW_MAX") ? atof(getenv("LAGUNA_FEW_MAX")) : 4194304.0;   /* 8 MB of bf16 */
    g->split_max = getenv("LAGUNA_SPLIT_MAX") ? atoi(getenv("LAGUNA_SPLIT_MAX")) : 0;      /* a tuning hook */
    g->block_graphs = !getenv("LAGUNA_NO_BLOCK_GRAPH");
    int D = c->head_dim, H = c->dim, KVD = c->kv_dim, T = max_tokens, E = c->n_experts, K = c->n_experts_active;
    /* formats (gpu_supports has checked them): one for the matmul weights, the embedding's and lm_head's own */
    int plain_dt = g->bf ? DT_BF16 : DT_F32;
    g->wdt = is_quant(mw->layers[0].wq.dtype) ? mw->layers[0].wq.dtype : plain_dt;
    /* from where full layers' one-token attention takes the flash kernel (long_capable): 3584 for bf16 files, 2560
     * for q8 / q4, whose decode lost 1.5-2% with the clusters at 3072-3456 where bf16 gained 0.4-0.9%
     * (dev/gpu_notes.md, round 26); LAGUNA_LONG_FROM: a test / tuning hook */
    const int long_default = is_quant(g->wdt) ? 2560 : 3584;   /* (also full_cluster_keys' default) */
    g->long_from = getenv("LAGUNA_LONG_FROM") ? atoi(getenv("LAGUNA_LONG_FROM")) : long_default;
    g->edt = is_quant(mw->embed.dtype) ? mw->embed.dtype : plain_dt;
    g->ldt = c->tied_embeddings ? g->edt : is_quant(mw->lm_head.dtype) ? mw->lm_head.dtype : plain_dt;
    if (!gpu_supports(m, err, errsz)) {
        size_t used = strlen(err);
        snprintf(err + used, errsz - used, "\n  hint: use --cpu");
        gpu_free(g);
        return NULL;
    }
    for (int l = 0; l < c->n_layers; l++) {
        GpuLayer *L = &g->L[l];
        L->nh = c->n_heads[l];
        L->GD = !c->gated ? 0 : c->gate_per_head ? L->nh : L->nh * D;   /* 0: a drafter with gating disabled */
        L->NQ = L->nh * D + 2 * KVD + L->GD;
        L->dense = c->mlp_type[l] == MLP_DENSE;
        L->hid = L->dense ? c->hidden_dim : c->shared_hidden_dim;
        int64_t r = c->layer_type[l] == ATTN_FULL ? ctx : (int64_t)c->sliding_window + max_tokens - 1;
        L->rows = (int)(r < ctx ? r : ctx);
    }
    CUDA_CHECK(cudaSetDevice(0));
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    g->nsm = prop.multiProcessorCount;
    g->cc_major = prop.major;
    CUDA_CHECK(cudaStreamCreateWithFlags(&g->stream, cudaStreamNonBlocking));
    CUBLAS_CHECK(cublasCreate(&g->blas));
    CUBLAS_CHECK(cublasSetStream(g->blas, g->stream));
    /* a workspace of its default size, given rather than left to cuBLAS, so the GEMMs inside a stream capture
     * allocate nothing (block_graph) */
    if (cudaMalloc(&g->blas_ws, BLAS_WORKSPACE) != cudaSuccess) { cudaGetLastError(); GFAIL("out of GPU memory for cuBLAS' workspace"); }
    CUBLAS_CHECK(cublasSetWorkspace(g->blas, g->blas_ws, BLAS_WORKSPACE));

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
    size_t kvs = kv_size(g);
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
    ALLOC(g->xq, (size_t)3 * ((H + 7) / 8), uint4);
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
    ALLOC(g->sample_s, sample_scratch_bytes(c->vocab_size), char);
    ALLOC(g->counters, 1 + c->n_kv_heads, int);
    ALLOC(g->ids, T, int);
    ALLOC(g->amax_part, (size_t)T * ARGMAX_SLICES, int2);
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
        ALLOC(g->hq, ((size_t)hid + (size_t)K * I) / 4 + 1, uint4);
        ALLOC(g->y_pair, 2 * P * H, float);
        ALLOC(g->ys, (size_t)T * H, float);
        ALLOC(g->x_sorted, (P + T) * H * dsize(g), char);   /* + T rows: padding reads past the last expert */
        ALLOC(g->act_sorted, 2 * P * I * dsize(g), char);
        if (g->bf) ALLOC(g->act_few, (size_t)(T < 16 ? T : 16) * (K * I + S), bf16);
        ALLOC(g->gptr, 7 * (size_t)E, void *);              /* 6 pointer arrays and the expert ranks */
        ALLOC(g->blk_cnt, ((size_t)T / ROUTE_TOK + 1) * E, int);
        ALLOC(g->tile_start, E + 1, int);
    }
    const int fc_q = is_quant(g->fcdt);           /* a drafter's q8 / q4 fc (upload_weights set fcdt) */
    if (is_quant(g->wdt) || is_quant(g->ldt) || fc_q) {
        /* the largest matrix the GEMMs read dequantized: a layer's projections, lm_head, one projection of all
         * experts (only the active ones are written, each at its place), or a drafter's fc */
        size_t most = is_quant(g->ldt) ? (size_t)c->vocab_size * H : 0;
        if (fc_q && (size_t)c->n_taps * H * H > most) most = (size_t)c->n_taps * H * H;
        if (is_quant(g->wdt)) {
            size_t cand[] = {(size_t)NQ * H, (size_t)QD * H, (size_t)2 * hid * H, (size_t)E * 2 * I * H};
            for (size_t i = 0; i < sizeof cand / sizeof cand[0]; i++) if (cand[i] > most) most = cand[i];
        }
        ALLOC(g->wdq, most * dsize(g), char);
    }
#undef ALLOC
    g->actbytes = act0;
    CUDA_CHECK(cudaMemset(g->counters, 0, (1 + c->n_kv_heads) * sizeof(int)));   /* each user resets its own */
    CUDA_CHECK(cudaMallocHost(&g->h_tokens, T * sizeof(int)));
    CUDA_CHECK(cudaMallocHost(&g->h_logits, (size_t)T * c->vocab_size * sizeof(float)));
    CUDA_CHECK(cudaHostAlloc(&g->h_step, 2 * sizeof(Step), cudaHostAllocMapped));
    CUDA_CHECK(cudaHostGetDevicePointer((void **)&g->m_step, g->h_step, 0));
    memset(g->h_step, 0, 2 * sizeof(Step));
    g->h_step[0].seq = -1;                          /* the device's Step before the first decode step (seq 0) */
    CUDA_CHECK(cudaMemcpy(g->d_step, &g->h_step[0], sizeof(Step), cudaMemcpyHostToDevice));
    for (int i = 0; i < 2; i++) CUDA_CHECK(cudaEventCreateWithFlags(&g->step_done[i], cudaEventDisableTiming));
    CUDA_CHECK(cudaMallocHost(&g->h_ids, T * sizeof(int)));
    if (E) {
        CUDA_CHECK(cudaMallocHost(&g->h_start, (E + 1) * sizeof(int)));
        CUDA_CHECK(cudaMallocHost(&g->h_gptr, 7 * (size_t)E * sizeof(void *)));
    }
    /* attention splits for one token: sliding layers see at most W keys, full layers up to ctx */
    g->decode_split[ATTN_FULL] = split_for(g, ctx, 1, 1);
    if (getenv("LAGUNA_DECODE_SPLITS")) {           /* a tuning hook: the long-context kernel's splits (1..64) */
        int s = atoi(getenv("LAGUNA_DECODE_SPLITS"));
        if (s >= 1 && s <= 64) g->decode_split[ATTN_FULL] = s;     /* (part_o holds 1024 a head) */
    }
    g->decode_split[ATTN_SLIDING] = split_for(g, c->sliding_window, 1, 1);
    g->long_fold = !getenv("LAGUNA_LONG_FOLD") || atoi(getenv("LAGUNA_LONG_FOLD")) != 0;   /* a test / timing hook */
    /* fused decode attention: tiles of 4096 / D keys; sliding layers one tile per split, full layers up to
     * ~4 blocks per SM (splits then run several tiles each); at most 128 splits (its merge's shared memory) */
    {
        int kt = 4096 / D, most = 4 * g->nsm / c->n_kv_heads;
        if (getenv("LAGUNA_FULL_SPLITS")) most = atoi(getenv("LAGUNA_FULL_SPLITS"));   /* a test hook: many tiles a split */
        int sw = (c->sliding_window + kt - 1) / kt, fu = (ctx + kt - 1) / kt;
        g->fused_split[ATTN_SLIDING] = sw < 1 ? 1 : sw > 128 ? 128 : sw;
        int f = fu < most ? fu : most;
        g->fused_split[ATTN_FULL] = f < 1 ? 1 : f > 128 ? 128 : f;
        /* sliding layers: clusters of 16 splits (non-portable size) if this GPU can co-schedule them, else 8;
         * LAGUNA_ATTN_CLUSTER=0/8/16 chooses (0: the global merge everywhere) */
        const char *e = getenv("LAGUNA_ATTN_CLUSTER");
        int want = e ? atoi(e) : 16;
        g->attn_cluster = 0;
        for (int cl = want; cl >= 8 && !g->attn_cluster; cl /= 2) {
            if (cl != 8 && cl != 16) continue;
            int ok = 0;
#define CLOK(KV) ok = cluster_fits<KV>(g, D, cl)
            KV_SWITCH(g, CLOK);
#undef CLOK
            if (ok) g->attn_cluster = cl;
        }
        if (g->attn_cluster) g->fused_split[ATTN_SLIDING] = g->attn_cluster;
        e = getenv("LAGUNA_FULL_CLUSTER_KEYS");      /* a test / tuning hook: 0 keeps full layers on the global merge */
        g->full_cluster_keys = e ? atoi(e) : long_default;
    }
    prefill_kernels_setup();
    if (g->use_graph && !c->block_size) capture_decode(g);    /* captured once here; replayed at every position */
    CUDA_CHECK(cudaDeviceSynchronize());
    size_t fr, tot;
    CUDA_CHECK(cudaMemGetInfo(&fr, &tot));
    int full_clusters = 0, la = g->long_attn;       /* (as the step before long_from runs them) */
    g->long_attn = 0;
    for (int l = 0; l < c->n_layers; l++) full_clusters |= fused_decode_attention(g, l, 1) && full_cluster(g, l);
    g->long_attn = la;
    snprintf(g->summary, sizeof g->summary, "weights %.2f GiB (%s), KV cache %.2f GiB (%s, %d positions), "
             "activations %.2f GiB, GPU memory in use %.1f of %.1f GiB%s%s",
             g->wbytes / 1073741824.0, g->wdt == DT_Q8 ? "q8" : g->wdt == DT_Q4 ? "q4" : g->bf ? "bf16" : "f32",
             g->kvbytes / 1073741824.0, kv_name(g), ctx,
             g->actbytes / 1073741824.0, (tot - fr) / 1073741824.0, tot / 1073741824.0,
             g->attn_cluster == 16 ? ", attention clusters 16" : g->attn_cluster == 8 ? ", attention clusters 8" : "",
             full_clusters ? " (full layers too)" : "");
    return g;
}

extern "C" const char *gpu_summary(GpuModel *g) { return g->summary; }

static void prof_report(GpuModel *g);
/* ---- n-token work as CUDA graphs ----
 * The drafter's block forward, the greedy verify and the drafter's context add repeat the same launches from one
 * DFlash step to the next: their token ids and position reach the kernels through device memory (copied in first),
 * and what the launches take from the host fits in a key (forward_key, and the context add's rows). block_graph runs
 * such work: a key's first time as plain launches (which also loads every kernel and warms cuBLAS' choices), its
 * second time captured into a graph, then replayed; the newest BLOCK_GRAPHS keys are kept. A replay saves the host's
 * launches and the gaps between the kernels (dev/gpu_notes.md, round 32). */
static void block_graphs_clear(GpuModel *g) {
    for (int i = 0; i < g->bg_used; i++)
        if (g->bg[i].exec) cudaGraphExecDestroy(g->bg[i].exec);
    g->bg_used = g->bg_next = 0;
}
template <typename F>
static void block_graph(GpuModel *g, long long key, F enqueue) {
    if (!g->block_graphs || g->prof_on) { enqueue(); return; }     /* (LAGUNA_PROF's events are plain launches) */
    int i = 0;
    while (i < g->bg_used && g->bg[i].key != key) i++;
    if (i == g->bg_used) {                          /* a new key: remembered, run plain */
        if (g->bg_used < BLOCK_GRAPHS) i = g->bg_used++;
        else {
            i = g->bg_next;
            g->bg_next = (g->bg_next + 1) % BLOCK_GRAPHS;
            if (g->bg[i].exec) CUDA_CHECK(cudaGraphExecDestroy(g->bg[i].exec));
        }
        g->bg[i].key = key;
        g->bg[i].exec = NULL;
        enqueue();
        return;
    }
    if (!g->bg[i].exec) {                           /* the second time: captured */
        cudaGraph_t graph;
        CUDA_CHECK(cudaStreamBeginCapture(g->stream, cudaStreamCaptureModeThreadLocal));
        enqueue();
        CUDA_CHECK(cudaStreamEndCapture(g->stream, &graph));
        CUDA_CHECK(cudaGraphInstantiate(&g->bg[i].exec, graph, 0));
        CUDA_CHECK(cudaGraphDestroy(graph));
        g->bg_captured++;
    }
    CUDA_CHECK(cudaGraphLaunch(g->bg[i].exec, g->stream));
    g->bg_replayed++;
}

extern "C" void gpu_free(GpuModel *g) {
    if (!g) return;
    prof_report(g);
    for (int i = 0; i < 2; i++) {
        if (g->graph[i]) cudaGraphExecDestroy(g->graph[i]);
        if (g->graph_long[i]) cudaGraphExecDestroy(g->graph_long[i]);
    }
    if (getenv("LAGUNA_GRAPH_STATS"))
        fprintf(stderr, "block graphs: %ld captured, %ld replays\n", g->bg_captured, g->bg_replayed);
    block_graphs_clear(g);
    if (g->blas) cublasDestroy(g->blas);
    void *dev[] = {g->wbuf, g->kvbuf, g->x, g->xb, g->qkvg, g->att, g->mlp_h, g->mlp_act, g->act16, g->logits,
                   g->part_o, g->part_ml, g->tokens, g->pos, g->d_step, g->sample_s, g->counters, g->router_logits, g->topk_idx, g->topk_w,
                   g->pair_w, g->pair_tok, g->inv, g->start, g->active, g->n_active, g->h_pair, g->hs, g->y_pair,
                   g->ys, g->x_sorted, g->act_sorted, g->gptr, g->blk_cnt, g->tile_start, g->ids, g->amax_part, g->taps, g->cat,
                   g->ctxv, g->wdq, g->act_few, g->xq, g->hq, g->blas_ws};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) if (dev[i]) cudaFree(dev[i]);
    for (int i = 0; i < 2; i++) if (g->step_done[i]) cudaEventDestroy(g->step_done[i]);
    void *host[] = {g->h_tokens, g->h_logits, g->h_step, g->h_start, g->h_gptr, g->h_ids};
    for (size_t i = 0; i < sizeof host / sizeof host[0]; i++) if (host[i]) cudaFreeHost(host[i]);
    if (g->stream) cudaStreamDestroy(g->stream);
    free(g);
}

/* ----------------------------------------------------------------------------
 * the forward pass, in model order (same steps as forward() in laguna.c) */

/* rows of a q8 / q4 matrix (total_rows x in, format dt) into g->wdq in the GEMMs' dtype: all of them, or with sel the
 * active experts sel[0..*n_sel) of a stack of `rows`-row matrices, each at its own place (max_sel bounds *n_sel) */
static void dequantize(GpuModel *g, int dt, const void *w, size_t total_rows, int in, int rows, int max_sel,
                       const int *sel, const int *n_sel) {
    WPtr m = wmat(dt, w, total_rows, in);
    size_t chunks = (sel ? (size_t)max_sel * rows : total_rows) * ((in + 31) / 32) * (dt == DT_Q8 ? 2 : 1);
    unsigned grid = grid_for(chunks, 256);
    int r = sel ? rows : (int)total_rows;
#define DQ(WW, TT) dequant_kernel<WW, TT><<<grid, 256, 0, g->stream>>>((TT *)g->wdq, m, in, r, max_sel, sel, n_sel)
    if (dt == DT_Q8) { if (g->bf) DQ(Q8, bf16); else DQ(Q8, float); }
    else { if (g->bf) DQ(Q4, bf16); else DQ(Q4, float); }
#undef DQ
    LAUNCH_CHECK();
}

/* whether n tokens through bf16 weights (wdt; -1: the file's unquantized dtype) take the tensor-core kernels for a
 * few tokens (gemm_few, moe_gate_up_few, moe_down_few) */
/* whether gemm_few and the experts' few-token kernels take n tokens of a matrix in format wdt (-1: the file's own):
 * bf16-based files, n <= 16, bf16 matrices and q8 / q4 ones (dequantized in registers, few_w8) */
static int few_ok(const GpuModel *g, int n, int wdt) {
    return g->few && g->bf && n <= 16 && (wdt == -1 || wdt == DT_BF16 || (g->few_q && is_quant(wdt)));
}
/* gemm_few only for matrices of up to few_max elements: at 16 tokens on the H200 (dev/few_lab) it beat cuBLAS on the
 * router (256 x 2048: 6.1 against 10.5 us) and lost on the big ones (q/k/v/g 19.7 against 15.4, o_proj 22.8 / 15.0,
 * lm_head 124 / 105), whose many tiles cuBLAS keeps streaming; the experts' few-token kernels win at every size.
 * At 3 blocks an SM (round 35) q/k/v/g is 15.4 against cuBLAS' 15.1 us: still no reason to raise few_max. */
static void gemm_few_launch(GpuModel *g, float *y, int ldy, int wdt, const void *W, int out, int in, const void *x,
                            int x_bf16, int n, float beta);

/* y[n, out] = beta * y + x[n, in] . W[out, in]^T  (cuBLAS; bf16 weights take a bf16 copy of x; n <= 16 tokens through
 * a bf16 matrix of at most few_max elements: gemm_few). A q8 / q4 W (wdt): n <= 16 tokens of a bf16 file through
 * gemm_few at every size, the weights dequantized in registers; otherwise dequantized first, to bf16 (bf16 files) or
 * f32 (files from f32 checkpoints), then cuBLAS. */
static void gemm(GpuModel *g, float *y, int ldy, const void *W, int out, int in, const float *x, int n, float beta,
                 int wdt = -1, int x_in_act16 = 0) {
    const float one = 1.0f;
    const void *xin = g->bf && x_in_act16 ? g->act16 : x;   /* x_in_act16: norm_rows left x in act16 already */
    /* gemm_few, x as it is (bf16 or f32); q8 / q4 matrices at every size: the cuBLAS path below reads the quantized
     * bytes, writes twice as many in bf16 and reads those again. A 16-token verification at XS-2.1 (H200): q8 16.6 ->
     * 15.2 ms, q4 21.7 -> 19.7; with the experts by moe_*_few too 11.9 / 12.3 (dev/gpu_notes.md, round 23) */
    if (few_ok(g, n, wdt) && in % 8 == 0 && (is_quant(wdt) || (double)out * in <= g->few_max)) {
        gemm_few_launch(g, y, ldy, is_quant(wdt) ? wdt : DT_BF16, W, out, in, xin, x_in_act16, n, beta);
        return;
    }
    if (is_quant(wdt)) {
        dequantize(g, wdt, W, out, in, out, 0, NULL, NULL);
        W = g->wdq;
    }
    if (g->bf && !x_in_act16) {
        convert<float, bf16><<<grid_for((size_t)n * in, 256), 256, 0, g->stream>>>((bf16 *)g->act16, x, (size_t)n * in);
        LAUNCH_CHECK();
        xin = g->act16;
    }
    CUBLAS_CHECK(cublasGemmEx(g->blas, CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, &one, W, dtype_of(g), in, xin,
                              dtype_of(g), in, &beta, y, CUDA_R_32F, ldy, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

/* the RMSNorm of n rows of x into g->xb, and for bf16 files also into g->act16 (what gemm(..., x_in_act16 = 1) reads):
 * one launch instead of the norm and gemm's conversion (the same bf16 values). A 16-token verification on the H200:
 * 14.68 -> 14.40 ms (dev/gpu_notes.md, round 10). */
static void norm_rows(GpuModel *g, const float *x, const float *w, int n) {
    const int H = g->c.dim;
    rmsnorm_kernel<<<n, 256, 0, g->stream>>>(g->xb, x, H, w, H, g->c.norm_eps, g->bf ? (bf16 *)g->act16 : NULL);
    LAUNCH_CHECK();
}

/* LAGUNA_PROF: mark the end of step `name` of the forward being enqueued (see GpuModel.prof) */
static void prof_mark(GpuModel *g, const char *name) {
    if (!g->prof_on) return;
    if (g->prof_n == g->prof_cap) {
        int cap = g->prof_cap ? 2 * g->prof_cap : 1024;
        g->prof_ev = (cudaEvent_t *)realloc(g->prof_ev, cap * sizeof(cudaEvent_t));
        g->prof_name = (const char **)realloc(g->prof_name, cap * sizeof(char *));
        if (!g->prof_ev || !g->prof_name) { fprintf(stderr, "laguna: error: out of host memory\n"); exit(1); }
        for (int i = g->prof_cap; i < cap; i++) CUDA_CHECK(cudaEventCreate(&g->prof_ev[i]));
        g->prof_cap = cap;
    }
    g->prof_name[g->prof_n] = name;
    CUDA_CHECK(cudaEventRecord(g->prof_ev[g->prof_n++], g->stream));
}
/* after the forward has finished: add each step's time (since the previous mark) to its name's sum */
static void prof_collect(GpuModel *g) {
    if (!g->prof_on) return;
    CUDA_CHECK(cudaEventSynchronize(g->prof_ev[g->prof_n - 1]));
    for (int i = 1; i < g->prof_n; i++) {
        float ms;
        CUDA_CHECK(cudaEventElapsedTime(&ms, g->prof_ev[i - 1], g->prof_ev[i]));
        int s = 0;
        while (s < g->prof_nstep && strcmp(g->prof_step[s], g->prof_name[i])) s++;
        if (s == g->prof_nstep) { if (s == 32) continue; g->prof_step[g->prof_nstep++] = g->prof_name[i]; }
        g->prof_ms[s] += ms;
    }
    g->prof_calls++;
    g->prof_on = 0;
}
static void prof_report(GpuModel *g) {
    if (g->prof_calls) {
        double total = 0.0;
        for (int s = 0; s < g->prof_nstep; s++) total += g->prof_ms[s];
        fprintf(stderr, "LAGUNA_PROF: %d forwards of 2..64 tokens, ms per forward (%.3f in all):\n", g->prof_calls,
                total / g->prof_calls);
        for (int s = 0; s < g->prof_nstep; s++)
            fprintf(stderr, "  %-16s %8.3f  %5.1f%%\n", g->prof_step[s], g->prof_ms[s] / g->prof_calls,
                    100.0 * g->prof_ms[s] / total);
    }
    for (int i = 0; i < g->prof_cap; i++) cudaEventDestroy(g->prof_ev[i]);
    free(g->prof_ev);
    free(g->prof_name);
}

/* Launch on the model's stream; while a one-token forward is enqueued (pdl_now), with programmatic dependent
 * launch, so each kernel's blocks start, and load their weights, while the previous kernel finishes (every
 * kernel so launched calls griddep_wait() before touching what earlier kernels wrote). */
template <typename... P, typename... A>
static void launch(GpuModel *g, void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, A... args) {
    cudaLaunchAttribute attr[2];
    int na = 0;
    if (g->pdl_now) {
        attr[na].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[na++].val.programmaticStreamSerializationAllowed = 1;
    }
    if (g->cluster_y) {            /* thread-block clusters of cluster_y blocks along y (the caller sets and clears it) */
        attr[na].id = cudaLaunchAttributeClusterDimension;
        attr[na].val.clusterDim.x = 1;
        attr[na].val.clusterDim.y = g->cluster_y;
        attr[na++].val.clusterDim.z = 1;
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = g->stream;
    cfg.attrs = attr;
    cfg.numAttrs = na;
    CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, ((P)args)...));
    /* LAGUNA_DUP=k (dev/device_decode.sh): the k-th launch of each layer's decode runs twice; the step's extra time
     * is that kernel's cost inside the graph (0 q/k/v/g, 1 attention, 2 o_proj, 3 router, 4 gate/up, 5 down) */
    if (g->pdl_now && g->nlaunch++ == g->dup) CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, ((P)args)...));
}

/* a kernel's dynamic shared memory above the default 48 KB, allowed once (kept apart per kernel: never under a graph's
 * capture, whose key always runs plain first) */
static void allow_smem(const void *kernel, size_t bytes) {
    static const void *done[64];
    static int nd = 0;
    if (bytes <= 48 * 1024) return;
    for (int i = 0; i < nd; i++) if (done[i] == kernel) return;
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
    if (nd < 64) done[nd++] = kernel;
}

/* gemm_few over out / 16 tiles: the fewest warps a tile (KS) that still give every SM two blocks */
static void gemm_few_launch(GpuModel *g, float *y, int ldy, int wdt, const void *W, int out, int in, const void *x,
                            int x_bf16, int n, float beta) {
    int tiles = (out + 15) / 16, ks = 1;
    while (ks < 8 && (tiles * ks + 7) / 8 < 2 * g->nsm) ks *= 2;
    dim3 grid((tiles * ks + 7) / 8);
    const WPtr w = wmat(wdt, W, out, in);
/* n > 8 at KS <= 4 (tall matrices): 3 blocks an SM, 2 chunks in flight (./dev/few_lab gemm-sweep, H200, 16 tokens,
 * us: q/k/v/g 10304 x 2048 bf16 20.0 -> 15.4, q8 22.9 -> 16.3, q4 23.7 -> 18.5; q8 / q4 lm_head 115 / 119 -> 105 / 107;
 * no gain at KS 8 or at 5 tokens; dev/gpu_notes.md round 35) */
#define FEW(WF, X, KS) do { if (n > 8 && KS <= 4) gemm_few<WF, X, KS, 2, 3, 2><<<grid, 256, 0, g->stream>>>(y, ldy, w, out, in, (const X *)x, n, beta); \
                            else if (n > 8) gemm_few<WF, X, KS, 2><<<grid, 256, 0, g->stream>>>(y, ldy, w, out, in, (const X *)x, n, beta); \
                            else gemm_few<WF, X, KS, 1><<<grid, 256, 0, g->stream>>>(y, ldy, w, out, in, (const X *)x, n, beta); } while (0)
#define FEW_KS(WF, X) switch (ks) { case 1: FEW(WF, X, 1); break; case 2: FEW(WF, X, 2); break; case 4: FEW(WF, X, 4); break; default: FEW(WF, X, 8); }
#define FEW_X(WF) do { if (x_bf16) FEW_KS(WF, bf16) else FEW_KS(WF, float) } while (0)
    if (wdt == DT_Q8) FEW_X(Q8);
    else if (wdt == DT_Q4) FEW_X(Q4);
    else FEW_X(bf16);
#undef FEW_X
#undef FEW_KS
#undef FEW
    LAUNCH_CHECK();
}

/* the decode matvec: 8 weight loads per thread, spread over ROWS rows x NCH chunks per row (in <= 256 * CH * NCH).
 * accumulate (out += W x: o_proj into the residual stream) reads out before the wait on the previous kernel, so out
 * must be older than that kernel's output (the residual: the previous layer's down projection, 3+ kernels back). */
template <typename W>
static void matvec(GpuModel *g, float *out, const void *w, int rows, int in, const float *x, const float *norm_w,
                   float *xb_out, const float *bias, int accumulate) {
    constexpr int CH = Fmt<W>::CH, RG = Fmt<W>::RG;
    const WPtr m = wmat(Fmt<W>::DT, w, rows, in);
#define MV(R, N) launch(g, matvec_kernel<W, R, N>, dim3((rows + R - 1) / R), dim3(256), 0, out, m, rows, in, \
                        x, norm_w, g->c.norm_eps, xb_out, bias, accumulate)
    /* Column slices (matvec_cols: a thread owns 8 columns of the block's rows, x in registers) for every format; q8 /
     * q4 need in % 8 == 0. in <= 2048 (q/k/v/g, lm_head): whole rows a block, 8 rows a subgroup. Wider rows (o_proj):
     * ns slices of 2048 columns over a cluster (sm_90, up to 8 slices). Otherwise a warp per RG rows (matvec_warp,
     * in <= 2048: 2 steps per warp, 4 for lm_head-sized quantized matrices) or the block-rows kernel. Measured on the
     * H200 in the decode graph (dev/gpu_notes.md, rounds 2, 5, 9, 10 and 11): bf16 by matvec_warp 355.6 tok/s, by
     * column slices 398.0; o_proj by the block-rows kernel 411.2, by a cluster of column slices 412.7; q4 407.6 ->
     * 446.1 and q8 416.2 -> 448.1 by column slices (16 or 32 rows a subgroup: slower). LAGUNA_QWARP=1 keeps q8 / q4 on
     * the warp and block-rows kernels (a test and timing hook). q8 / q4's whole rows go to matvec_loop (the same
     * sums, by one wave of blocks that loop: round 21), bf16 / f32's to matvec_cols (slower looped). */
#define MVW(R) launch(g, matvec_warp<W, 64 / CH, R>, dim3((rows + 8 * R * RG - 1) / (8 * R * RG)), dim3(256), 0, out, m, \
                      rows, in, x, norm_w, g->c.norm_eps, xb_out, bias, accumulate)
    const int ns = (in + 2047) / 2048;              /* column slices of 2048 */
    if (!is_q<W> || (!g->qwarp && in % 8 == 0)) {
        if (in <= 2048 && (g->mv_loop < 0 ? is_q<W> : g->mv_loop)) {
            static int per_sm = 0;                      /* blocks an SM (one count per format) */
            if (!per_sm) CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, matvec_loop<W, 8>, 256, 0));
            const int rb = 8 * col_subgroups((in + 7) / 8), ng = (rows + rb - 1) / rb;
            int nb = per_sm * g->nsm;                   /* one wave */
            if (g->loop_blocks > 0 && g->loop_blocks < nb) nb = g->loop_blocks;
            launch(g, matvec_loop<W, 8>, dim3(ng < nb ? ng : nb), dim3(256), 0, out, m, rows, in, x, norm_w,
                   g->c.norm_eps, xb_out, bias, accumulate);
            return;
        }
        if (in <= 2048) {
            const int rb = 8 * col_subgroups((in + 7) / 8);     /* rows a block */
            launch(g, matvec_cols<W, 8, false>, dim3((rows + rb - 1) / rb), dim3(256), 0, out, m, rows, in, x, norm_w,
                   g->c.norm_eps, xb_out, bias, accumulate);
            return;
        }
        if (g->split_cols && !norm_w && ns <= 8 && g->cc_major >= 9) {
            g->cluster_y = ns;                          /* the slices of a row block: one cluster */
            launch(g, matvec_cols<W, 8, true>, dim3((rows + 7) / 8, ns), dim3(256), 0, out, m, rows, in, x, norm_w,
                   g->c.norm_eps, xb_out, bias, accumulate);
            g->cluster_y = 0;
            return;
        }
    }
    const int nch = (in + 256 * CH - 1) / (256 * CH);   /* chunks a thread per row (block-rows kernel) */
    if (in <= 2048 && rows >= 32768 && is_q<W>) MVW(4);
    else if (in <= 2048) MVW(2);
#undef MVW
    else if (nch <= 1) MV(8, 1);
    else if (nch <= 2) MV(4, 2);
    else if (nch <= 4) MV(2, 4);
    else MV(1, 8);
#undef MV
}
/* the same for a format known at run time (lm_head: the lm_head's or the embedding's) */
static void matvec_dt(GpuModel *g, int dt, float *out, const void *w, int rows, int in, const float *x,
                      const float *norm_w, float *xb_out, const float *bias, int accumulate) {
    switch (dt) {
    case DT_BF16: matvec<bf16>(g, out, w, rows, in, x, norm_w, xb_out, bias, accumulate); break;
    case DT_Q8: matvec<Q8>(g, out, w, rows, in, x, norm_w, xb_out, bias, accumulate); break;
    case DT_Q4: matvec<Q4>(g, out, w, rows, in, x, norm_w, xb_out, bias, accumulate); break;
    default: matvec<float>(g, out, w, rows, in, x, norm_w, xb_out, bias, accumulate);
    }
}

/* One token on a full layer at long context: the fused kernel's tile loop does its q.k and p.v on CUDA cores, ~1,500
 * FMAs per 512 bytes of K/V (GQA group 6), and streams only ~0.8 TB/s; the tensor-core flash kernel with its 4 warps
 * splitting each tile's keys (attention_flash<KS>, the q/k norm and RoPE inside, merged by attention_combine_one)
 * streams ~3 TB/s at 32K-128K (~2.2 at 8K, round 38). Measured on the H200 (dev/gpu_notes.md, round 6): decode at 8K /
 * 32K / 128K 290.5 / 214.3 / 104 tok/s before, 316.8 / 290.9 / 215.5 after; at 512 the two extra launches cost 0.8%, at 2048 it was 1.8%
 * faster and at 4096 4.5% (round 7), against the fused kernel's global merge over many splits. Full layers' fused
 * kernel as a cluster (full_cluster(), round 25) is faster than this one at 2048: 446.0 -> 460.1 tok/s at positions
 * 2048-2183 (5 tiles a split), and at 3072-3207 441.1 -> 444.7 (7 tiles); at 4096 (9 tiles) slower, 439.0 -> 433.1
 * (round 26; q8 / q4 files lost 1.5-2% there, so theirs stays 2560). So positions below long_from (bf16 3584: at most
 * 224 keys, 7 tiles, a split) keep the fused kernel (a second decode graph). Serves bf16 files with a bf16 or fp8
 * cache (the flash kernel's inputs). Its merge loading every split at once (round 38, H100): 8K 353.4 -> 362.0 tok/s,
 * 32K 313.2 -> 319.8. The q/k norm inside it (round 39, H100): one launch less a full layer; bf16 cache unchanged
 * (361.9 -> 362.0 at 8K), fp8 cache 361.7 -> 365.0. */
static int long_capable(const GpuModel *g, int l) {   /* could layer l take attention_flash<KS> (from long_from)? */
    return g->c.layer_type[l] == ATTN_FULL && g->c.causal && g->kv != KV_F32 && g->bf && !g->attn_scalar &&
           g->L[l].nh / g->c.n_kv_heads <= 16;
}
static int long_decode_attention(const GpuModel *g, int l, int n) {
    return n == 1 && g->long_attn && long_capable(g, l);
}
/* one token with the fused decode attention (q/k norm and RoPE inside): group <= 8, D a power of two 16..128 */
static int fused_decode_attention(const GpuModel *g, int l, int n) {
    int D = g->c.head_dim;
    return n == 1 && g->c.gated && g->c.causal && g->L[l].nh / g->c.n_kv_heads <= 8 && !g->attn_scalar &&
           (D == 16 || D == 32 || D == 64 || D == 128) && !long_decode_attention(g, l, n);
}

/* does layer l's attention kernel do the q/k norm, RoPE and the K/V append itself (else qk_norm_rope_kernel first)? */
static int attention_norms_qk(const GpuModel *g, int l, int n) {
    return fused_decode_attention(g, l, n) || (long_decode_attention(g, l, n) && g->long_fold);
}

/* Full layers' one-token fused attention as clusters too, where it never sees more than full_cluster_keys keys: below
 * long_from where the long-context kernel takes the rest, or a context that small. A cluster of 16 splits then runs
 * at most 224 keys a split (7 tiles at D = 128) and merges in shared memory; the global merge (up to 4 blocks an SM
 * of splits, a fence, a counter and the last block reloading the partials) is for the contexts past that. On the
 * H200 (XS-2.1, bf16, 512): a full layer's attention 12.05 -> 9.76 us in the trace, decode 475.8 -> 479.6 tok/s;
 * at 2048 (positions 2048-2183) 450.7 (the global merge) or 446.0 (the long-context kernel) -> 460.1
 * (dev/gpu_notes.md, round 25). Decided per model, so the graph and plain launches run the same kernel at every position. */
static int full_cluster(const GpuModel *g, int l) {
    const int most = long_capable(g, l) && g->long_from < g->ctx ? g->long_from : g->ctx;
    return g->c.layer_type[l] == ATTN_FULL && g->attn_cluster && most <= g->full_cluster_keys;
}

static void attention(GpuModel *g, int l, int n, int pos) {
    const Config *c = &g->c;
    GpuLayer *L = &g->L[l];
    int D = c->head_dim, nkv = c->n_kv_heads, gq = L->nh / nkv, sliding = c->layer_type[l] == ATTN_SLIDING;
    int window = sliding ? c->sliding_window : 0;
    float scale_log2 = 1.4426950408889634f / sqrtf((float)D);
    const int *pos_ptr = g->pos;
    /* n > 1 on a bf16 file: the output also in bf16 into act16, o_proj's GEMM input (the values gemm's conversion
     * of att would write) */
    bf16 *att16 = n > 1 && g->bf ? (bf16 *)g->act16 : NULL;
    int nsplit = 1;
    if (fused_decode_attention(g, l, n)) {
        /* one token: q/k norm, RoPE, the K/V append, split-K attention, merge and gate in one launch; sliding layers
         * (at most W keys) and full layers below full_cluster_keys as one cluster of attn_cluster splits per kv head,
         * merged in shared memory */
        const int CLU = sliding || full_cluster(g, l) ? g->attn_cluster : 0;
        nsplit = CLU ? CLU : g->fused_split[c->layer_type[l]];
        int gate_off = L->nh * D + 2 * c->kv_dim, t = c->layer_type[l];
        g->cluster_y = CLU;
#define FUSED_CL(KV, DD, CC) launch(g, attention_decode_fused<KV, DD, CC>, dim3(nkv, nsplit), dim3(256), 0, (const float *)g->qkvg, \
        gq, L->nh, nkv, (KV *)L->kc, (KV *)L->vc, L->rows, c->kv_dim, pos_ptr, window, nsplit, (const float *)L->q_norm, \
        (const float *)L->k_norm, (const float *)g->inv_freq[t], c->rotary_dim[t], c->rope_scaling[t], c->norm_eps, \
        g->part_o, g->part_ml, g->counters + 1, g->att, gate_off, c->gate_per_head, scale_log2)
#define FUSED(KV, DD) do { if (CLU == 16) FUSED_CL(KV, DD, 16); else if (CLU == 8) FUSED_CL(KV, DD, 8); else FUSED_CL(KV, DD, 0); } while (0)
#define FUSED_D(KV) switch (D) { case 16: FUSED(KV, 16); break; case 32: FUSED(KV, 32); break; case 64: FUSED(KV, 64); break; default: FUSED(KV, 128); }
        KV_SWITCH(g, FUSED_D);
#undef FUSED_D
#undef FUSED
#undef FUSED_CL
        g->cluster_y = 0;
        return;
    }
    /* the flash kernel rounds q and p to bf16: it serves bf16 files with a bf16 or fp8 cache; an f32 cache, any cache
     * of an f32 file (fp32 math, the fixtures' tight bar) and the LAGUNA_ATTN_SCALAR hook take the scalar kernel */
    if (g->kv == KV_F32 || !g->bf || g->attn_scalar) {
#define SCALAR(KV) attention_scalar<KV><<<dim3(n, L->nh), 32, 0, g->stream>>>(g->qkvg, L->NQ, n, gq, L->nh, D, \
            (const KV *)L->kc, (const KV *)L->vc, L->rows, c->kv_dim, pos_ptr, window, c->causal, g->part_o, g->part_ml, \
            scale_log2)
        KV_SWITCH(g, SCALAR);
#undef SCALAR
    } else {
        const bool ks = long_decode_attention(g, l, n);
        int warps = n * gq <= 16 && !ks ? 1 : 4, rb = ks ? 1 : (n * gq + 16 * warps - 1) / (16 * warps);
        if (n == 1) nsplit = g->decode_split[c->layer_type[l]];
        else nsplit = split_for(g, sliding ? window + n - 1 : pos + n, rb, n);
        dim3 grid(rb, nkv, nsplit);
        FlashLong fl = {};                          /* the long-context kernel: the q/k norm and RoPE inside */
        if (ks && g->long_fold) {
            const int t = c->layer_type[l];
            fl.q_norm = L->q_norm; fl.k_norm = L->k_norm; fl.inv_freq = g->inv_freq[t];
            fl.rd = c->rotary_dim[t]; fl.scaling = c->rope_scaling[t]; fl.eps = c->norm_eps;
        }
        const int fsmem = flash_smem_bytes(D, ks);
#define FLASH(KV, DD, WW) launch(g, ks ? attention_flash<KV, DD, WW, true> : attention_flash<KV, DD, WW, false>, grid, \
        dim3(WW * 32), fsmem, (const float *)g->qkvg, L->NQ, n, gq, L->nh, (KV *)L->kc, \
        (KV *)L->vc, L->rows, c->kv_dim, pos_ptr, window, c->causal, nsplit, g->part_o, g->part_ml, scale_log2, \
        g->att, c->gated ? L->nh * D + 2 * c->kv_dim : -1, c->gate_per_head, att16, fl)
#define FLASH_W(KV) \
        if (warps == 1) { switch (D) { case 16: FLASH(KV, 16, 1); break; case 32: FLASH(KV, 32, 1); break; case 64: FLASH(KV, 64, 1); break; default: FLASH(KV, 128, 1); } } \
        else { switch (D) { case 16: FLASH(KV, 16, 4); break; case 32: FLASH(KV, 32, 4); break; case 64: FLASH(KV, 64, 4); break; default: FLASH(KV, 128, 4); } }
        if (g->kv == KV_FP8) { FLASH_W(fp8) } else { FLASH_W(bf16) }
#undef FLASH_W
#undef FLASH
        LAUNCH_CHECK();
        if (nsplit == 1) return;                    /* the flash kernel finished the rows */
    }
    LAUNCH_CHECK();
    if (n == 1) launch(g, attention_combine_one, dim3(L->nh), combine_block(nsplit, D), 0, g->att,
                       (const float *)g->part_o, (const float2 *)g->part_ml, nsplit, L->nh, D, (const float *)g->qkvg,
                       L->NQ, c->gated ? L->nh * D + 2 * c->kv_dim : -1, c->gate_per_head, att16);
    else launch(g, attention_combine, dim3(n * L->nh), dim3(D < 32 ? 32 : D), 0, g->att, (const float *)g->part_o,
                (const float2 *)g->part_ml, nsplit, L->nh, D, (const float *)g->qkvg, L->NQ,
                c->gated ? L->nh * D + 2 * c->kv_dim : -1, c->gate_per_head, att16);
    LAUNCH_CHECK();
}

template <typename W, typename P>
static void mlp_decode(GpuModel *g, int l) {
    const Config *c = &g->c;
    GpuLayer *L = &g->L[l];
    int H = c->dim, I = c->moe_hidden_dim, K = c->n_experts_active, E = c->n_experts, DT = Fmt<W>::DT, RG = Fmt<W>::RG;
    const WPtr gate_up = wmat(DT, L->gate_up, 2 * (size_t)L->hid, H), down = wmat(DT, L->down, H, L->hid);
    const WPtr egu = wmat(DT, L->experts_gate_up, (size_t)E * 2 * I, H), edn = wmat(DT, L->experts_down, (size_t)E * H, I);
    /* gate/up: by column slices (H <= 2048; q8 / q4 with H % 8 == 0), 4 units a block in every format, the
     * warp-per-unit kernel (LAGUNA_QWARP=1), or the general one; the always-on matrix's blocks first. q8 / q4 had 8
     * units a block (a block's bytes as bf16's): 4 made decode 4.4% (q8) and 2.0% (q4) faster at 512, 2 slower (-2.4%
     * against 4), and bf16 at 2 no different (H200, XS-2.1; dev/gpu_notes.md round 20). */
    const bool gu_cols = (!is_q<W> || (!g->qwarp && H % 8 == 0)) && H <= 2048 && !g->moe_general;
    /* down: by column slices where the row fits 3 chunks a thread, else a warp a row */
    const bool down_cols = (!is_q<W> || !g->qwarp) && !g->down_warp && (K * I + L->hid) / 8 <= 3 * 256 &&
                           I % 8 == 0 && L->hid % 8 == 0;
    /* q8 / q4: gate/up by column slices leaves h quantized for them (hq; the shared expert's S units, then the pairs') */
    uint4 *hq = is_q<W> && gu_cols && down_cols && !L->dense ? g->hq : NULL;
    constexpr int RU = 4;                           /* units a column-slice block */
#define GATE_UP(EGU, NI, KA, XQ) do { \
        if (gu_cols) { \
            launch(g, moe_gate_up_cols<W, RU>, dim3((L->hid + RU - 1) / RU + (KA) * ((I + RU - 1) / RU)), dim3(256), 0, \
                   EGU, I, gate_up, L->hid, H, (const float *)g->xb, (const int *)g->active, (const int *)(NI), \
                   g->h_pair, (KA) ? g->hs : g->mlp_act, (const uint4 *)(XQ), (KA) ? hq : NULL); \
        } else if (H <= 2048 && !g->moe_general) launch(g, moe_gate_up_decode<W, 64 / Fmt<W>::CH>, \
                              dim3((L->hid + 8 * RG - 1) / (8 * RG) + (KA) * ((I + 8 * RG - 1) / (8 * RG))), dim3(256), 0, \
                              EGU, I, gate_up, L->hid, H, (const float *)g->xb, \
                              (const int *)g->active, (const int *)(NI), g->h_pair, (KA) ? g->hs : g->mlp_act); \
        else launch(g, moe_gate_up<W>, dim3((KA) * ((I + 7) / 8) + (L->hid + 7) / 8), dim3(256), 0, EGU, I, \
                    gate_up, L->hid, H, (const float *)g->xb, 1, (const int *)g->start, \
                    (const int *)g->pair_tok, (const int *)g->active, (const int *)(NI), KA, g->h_pair, \
                    (KA) ? g->hs : g->mlp_act); \
    } while (0)
    if (L->dense) {
        launch(g, rmsnorm_kernel, dim3(1), dim3(256), 0, g->xb, (const float *)g->x, H, (const float *)L->ffn_norm, H,
               c->norm_eps, (bf16 *)NULL);
        GATE_UP(WPtr(NULL), NULL, 0, NULL);
        launch(g, moe_down_decode<W>, dim3((H + 7) / 8), dim3(256), 0, g->x, WPtr(NULL), 0, down,
               L->hid, H, NULL, NULL, NULL, NULL, (const float *)g->mlp_act, 0.0f);
        return;
    }
    /* route: router logits from the normed x (the norm folded into the matvec, which also leaves xb) and the
     * top-k plan, one launch; the router is never quantized (P: bf16 or f32) */
    /* bf16 / f32: the shared expert's gate/up as more blocks of the router's launch (router_decode's SH) */
    /* (q8 / q4 there too was +0.4% for q8, nothing for q4, and slower with xq below: dev/gpu_notes.md, round 24) */
    const bool shared_in_router = !is_q<W> && gu_cols && H % 8 == 0 && L->hid > 0;
    const int nbr = (c->n_experts + 1) / 2, sh = shared_in_router ? (L->hid + 3) / 4 : 0;   /* router, shared blocks */
    /* q8 / q4: the router's block 0 leaves x quantized for the gate/up blocks (xq) */
    uint4 *xq = is_q<W> && gu_cols && H % 8 == 0 ? g->xq : NULL;
#define ROUTE(N) launch(g, shared_in_router ? router_decode<P, N, !is_q<W>, W> : router_decode<P, N, false, W>, \
        dim3(nbr + sh), /* (q8 / q4: never shared_in_router, no SH instance) */ \
        dim3(256), 0, g->router_logits, \
        WPtr(L->router), c->n_experts, H, (const float *)g->x, (const float *)L->ffn_norm, c->norm_eps, g->xb, \
        (const float *)L->expert_bias, K, c->router_softcap, g->start, g->pair_tok, g->pair_w, g->active, \
        g->n_active, g->counters, gate_up, L->hid, g->hs, nbr, xq)
    if (H <= 2048) ROUTE(1);
    else if (H <= 4096) ROUTE(2);
    else if (H <= 8192) ROUTE(4);
    else ROUTE(8);
#undef ROUTE
    if (shared_in_router)                           /* the routed experts only */
        launch(g, moe_gate_up_cols<W, RU>, dim3(K * ((I + RU - 1) / RU)), dim3(256), 0, egu, I, gate_up, 0, H,
               (const float *)g->xb, (const int *)g->active, (const int *)g->n_active, g->h_pair, g->hs,
               (const uint4 *)xq, (uint4 *)NULL);   /* (bf16 / f32 only: no hq) */
    else GATE_UP(egu, g->n_active, K, xq);
#undef GATE_UP
    if (down_cols) {
        launch(g, hq ? moe_down_cols<W, 4, 3, is_q<W>> : moe_down_cols<W, 4, 3, false>, dim3((H + 3) / 4), dim3(256), 0,
               g->x, edn, I, down, L->hid, H, (const int *)g->active, (const int *)g->n_active,
               (const float *)g->pair_w, (const float *)g->h_pair, (const float *)g->hs, (const uint4 *)hq,
               c->routed_scaling);
        return;
    }
    launch(g, moe_down_decode<W>, dim3((H + 7) / 8), dim3(256), 0, g->x, edn, I, down, L->hid, H,
           (const int *)g->active, (const int *)g->n_active, (const float *)g->pair_w, (const float *)g->h_pair,
           (const float *)g->hs, c->routed_scaling);
}

/* the shared expert of n tokens: plain GEMMs over all tokens */
static void moe_shared_many(GpuModel *g, GpuLayer *L, int n) {
    int H = g->c.dim, S = L->hid;
    gemm(g, g->mlp_h, 2 * S, L->gate_up, 2 * S, H, g->xb, n, 0.0f, g->wdt);
    swiglu_kernel<float><<<grid_for((size_t)n * S, 256), 256, 0, g->stream>>>(g->mlp_act, g->mlp_h, n, S);
    LAUNCH_CHECK();
    gemm(g, g->ys, H, L->down, H, S, g->mlp_act, n, 0.0f, g->wdt);
}

/* The few-token expert kernels' template arguments (MINB, U, U2, WF, KC, ST) for n tokens of format W, passed to
 * launch as IntC values: chosen by dev/few_lab's sweep (H200, XS-2.1 experts; us for gate/up + down, the outputs
 * bit-equal in every variant since the sums' order does not depend on them).
 * Weights in registers (KC 0; few_rows), 2026-12-03 / 04: bf16 16 tokens MINB 4 U 2/2 WF 1 189.3 (WF 0's best, MINB 2
 * U 8/4, 203.2); 5 tokens MINB 3 U 2/2 WF 1 75.3; 2 tokens MINB 2 U 8/4 37.6; q8 / q4 16 tokens MINB 4 U 2/2 WF 0
 * 162.0 / 169.6 (WF 1 7-8% slower: their loads come with a scale load and the dequantizing).
 * bf16 weights through shared memory (KC > 0; few_rows_staged: row-contiguous copies), 2026-12-04: 16 tokens KC 128
 * ST 3 MINB 2 (96 KB a block, 2 an SM) **169.0** (gate/up 109.3 us, 3.95 TB/s; KC 256 ST 2 187.2, KC 64 ST 4 178.3);
 * 5 tokens KC 128 ST 2 MINB 3 **69.2** (KC 128 ST 3 74.9); 2 tokens KC 128 ST 3 **29.5**. The 16-token verify (bench_gpu,
 * bf16) 10.77 -> 9.66 ms at 512. q8 / q4 value bytes through it, 16 tokens: KC 256 ST 3 MINB 2 **144.1 / 152.6**
 * against the registers' 162.2 / 170.1 (q8 KC 128 ST 2 MINB 4 143.5; q4 rows of 64 bytes a stage are too short for
 * the swizzle), verify 10.41 -> 9.16 / 10.55 -> 9.58 ms; n <= 8 was not measured for them and keeps the registers
 * (dev/gpu_notes.md, round 37). LAGUNA_FEW_STAGED=0 takes the register path everywhere (the same sums: the tests
 * compare the two bit for bit).
 * The bytes are read once in every variant; what differs is how they are asked for and how many an SM has in flight. */
template <int V> struct IntC { static constexpr int value = V; };
static bool few_staged() {
    static int v = -1;
    if (v < 0) { const char *e = getenv("LAGUNA_FEW_STAGED"); v = !(e && !strcmp(e, "0")); }
    return v;
}
template <typename W, typename F> static void few_moe_pick(int n, F launch) {
    if constexpr (is_q<W>) {
        if (n > 8 && few_staged()) launch(IntC<2>(), IntC<2>(), IntC<2>(), IntC<0>(), IntC<256>(), IntC<3>());
        else launch(IntC<4>(), IntC<2>(), IntC<2>(), IntC<0>(), IntC<0>(), IntC<2>());
    } else {
        if constexpr (std::is_same<W, bf16>::value)
            if (few_staged()) {
                if (n > 8 || n <= 2) launch(IntC<2>(), IntC<2>(), IntC<2>(), IntC<0>(), IntC<128>(), IntC<3>());
                else launch(IntC<3>(), IntC<2>(), IntC<2>(), IntC<0>(), IntC<128>(), IntC<2>());
                return;
            }
        if (n > 8) launch(IntC<4>(), IntC<2>(), IntC<2>(), IntC<1>(), IntC<0>(), IntC<2>());
        else if (n > 2) launch(IntC<3>(), IntC<2>(), IntC<2>(), IntC<1>(), IntC<0>(), IntC<2>());
        else launch(IntC<3>(), IntC<4>(), IntC<2>(), IntC<0>(), IntC<0>(), IntC<2>());
    }
}

/* the MoE of n > 1 tokens, grouped by expert (W: the experts' format; P: bf16 or f32, the router's and the GEMMs') */
template <typename W, typename P_>
static void moe_many(GpuModel *g, int l, int n) {
    const Config *c = &g->c;
    GpuLayer *L = &g->L[l];
    int H = c->dim, I = c->moe_hidden_dim, S = L->hid, E = c->n_experts, K = c->n_experts_active, P = n * K;
    const int DT = Fmt<W>::DT, q = is_q<W>;
    /* quantized experts for the GEMMs: the active ones dequantized into g->wdq, each at its own place (gate/up first,
     * down once gate/up has been read); unquantized ones are read in place */
    const char *egu = q ? (const char *)g->wdq : (const char *)L->experts_gate_up;
    const char *edn = q ? (const char *)g->wdq : (const char *)L->experts_down;
    gemm(g, g->router_logits, E, L->router, E, H, g->xb, n, 0.0f, -1, 1);   /* xb and act16: forward_gpu's norm_rows */
    /* route and sort the pairs by expert (multi-block; see route_many_topk) */
    int nblk = (n + ROUTE_TOK - 1) / ROUTE_TOK, bm = moe_bm(P, E);
    if (nblk == 1) {                                /* a few tokens: one launch */
        int thr = max(E < 256 ? 256 : (E + 31) / 32 * 32, min(1024, 32 * n));   /* >= E threads, a warp a token */
        route_few<<<1, thr, E * sizeof(int), g->stream>>>(g->router_logits,
            L->expert_bias, n, E, K, c->router_softcap, g->topk_idx, g->topk_w, g->blk_cnt, bm, g->start, g->active,
            g->n_active, g->tile_start, g->pair_tok, g->pair_w, g->inv);
        LAUNCH_CHECK();
    } else {
        route_many_topk<<<nblk, 256, E * sizeof(int), g->stream>>>(g->router_logits, L->expert_bias, n, E, K,
            c->router_softcap, g->topk_idx, g->topk_w, g->blk_cnt);
        LAUNCH_CHECK();
        route_many_scan<<<1, (E + 31) / 32 * 32, 0, g->stream>>>(g->blk_cnt, nblk, E, bm, g->start, g->active,
            g->n_active, g->tile_start);
        LAUNCH_CHECK();
        route_many_scatter<<<nblk, 32, E * sizeof(int), g->stream>>>(g->topk_idx, g->topk_w, n, E, K, g->blk_cnt,
            g->pair_tok, g->pair_w, g->inv);
        LAUNCH_CHECK();
    }
    prof_mark(g, "router");
    int max_active = P < E ? P : E;
    if (few_ok(g, n, DT) && H % 8 == 0 && I % 8 == 0 && S % 8 == 0) {
        /* a few tokens of a bf16-based file (verification): the active experts' rows read once (q8 / q4 dequantized
         * in registers), the tokens on tensor cores */
        bf16 *act_s = g->act_few + (size_t)n * K * I;
        const WPtr wgu = wmat(DT, L->experts_gate_up, (size_t)E * 2 * I, H), wsgu = wmat(DT, L->gate_up, 2 * (size_t)S, H),
                   wdn = wmat(DT, L->experts_down, (size_t)E * H, I), wsdn = wmat(DT, L->down, H, S);
        few_moe_pick<W>(n, [&](auto mb, auto u, auto u2, auto wf, auto kc, auto st) {
            constexpr int MB = decltype(mb)::value, U = decltype(u)::value, U2 = decltype(u2)::value;
            constexpr bool WF = decltype(wf)::value;
            constexpr int KC = decltype(kc)::value, ST = decltype(st)::value;
            const size_t ring = few_ring_bytes<W>(KC, ST);
            allow_smem((const void *)moe_gate_up_few<W, MB, U, U2, WF, KC, ST>, ring);
            allow_smem((const void *)moe_down_few<W, MB, U, U2, WF, KC, ST>, ring);
            moe_gate_up_few<W, MB, U, U2, WF, KC, ST><<<max_active * ((I + 63) / 64) + (S + 63) / 64, 256, ring,
                                                      g->stream>>>(
                wgu, I, wsgu, S, H, (const bf16 *)g->act16, n, g->start, g->pair_tok, g->active, g->n_active,
                max_active, g->act_few, act_s);
            LAUNCH_CHECK();
            prof_mark(g, "experts gate/up");
            moe_down_few<W, MB, U, U2, WF, KC, ST><<<(max_active + 1) * ((H + 127) / 128), 256, ring, g->stream>>>(
                wdn, I, wsdn, S, H, n, g->start, g->active, g->n_active, max_active, g->act_few, act_s, g->y_pair,
                g->ys);
            LAUNCH_CHECK();
        });
        prof_mark(g, "experts down");
    } else if (P <= 512) {
        /* a few tokens (verification): one launch over the active experts' rows, each read once */
        moe_gate_up<W><<<max_active * ((I + 7) / 8) + (S + 7) / 8, 256, 0, g->stream>>>(
            wmat(DT, L->experts_gate_up, (size_t)E * 2 * I, H), I, wmat(DT, L->gate_up, 2 * (size_t)S, H), S, H, g->xb, n,
            g->start, g->pair_tok, g->active, g->n_active, max_active, g->h_pair, g->hs);
        LAUNCH_CHECK();
        prof_mark(g, "experts gate/up");
        moe_down<W, 4><<<max_active * ((H + 31) / 32) + (H + 31) / 32, 256, 0, g->stream>>>(
            wmat(DT, L->experts_down, (size_t)E * H, I), I, wmat(DT, L->down, H, S), S, H, n, g->start, g->active,
            g->n_active, max_active, g->h_pair, g->hs, g->y_pair, g->ys);
        LAUNCH_CHECK();
        prof_mark(g, "experts down");
    } else if (g->bf) {
        /* many tokens (prefill), bf16: the pairs' inputs gathered in expert order, then one tensor-core grouped
         * GEMM per projection (SwiGLU fused into gate_up); the tile map comes from route_many_scan, no host sync */
        gather_rows<bf16><<<P, 256, 0, g->stream>>>((bf16 *)g->x_sorted, g->xb, g->pair_tok, H);
        LAUNCH_CHECK();
        if (q) dequantize(g, DT, L->experts_gate_up, (size_t)E * 2 * I, H, 2 * I, max_active, g->active, g->n_active);
        moe_gemm_launch<true>(bm, (const bf16 *)g->x_sorted, (const bf16 *)egu, I, H, g->start,
                              g->tile_start, E, P, g->act_sorted, g->stream);
        if (q) dequantize(g, DT, L->experts_down, (size_t)E * H, I, H, max_active, g->active, g->n_active);
        moe_gemm_launch<false>(bm, (const bf16 *)g->act_sorted, (const bf16 *)edn, H, I, g->start,
                               g->tile_start, E, P, g->y_pair, g->stream);
        moe_shared_many(g, L, n);
    } else {
        /* many tokens (prefill), f32 files: one batched cuBLAS GEMM over the active experts for gate/up and one for down,
         * each expert's token count padded to the largest (cuBLAS' grouped GEMM does not take bf16 -> f32 here).
         * The counts come to the host: one small copy and a sync per layer. Padding rows read neighbouring
         * experts' inputs and write padding outputs that nothing reads. */
        gather_rows<P_><<<P, 256, 0, g->stream>>>((P_ *)g->x_sorted, g->xb, g->pair_tok, H);
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
        if (q) dequantize(g, DT, L->experts_gate_up, (size_t)E * 2 * I, H, 2 * I, max_active, g->active, g->n_active);
        void **hp = g->h_gptr;
        int *rank = (int *)(hp + 6 * (size_t)E);          /* expert -> its slot among the active ones */
        int a = 0;
        for (int e = 0; e < E; e++) {
            int cnt = g->h_start[e + 1] - g->h_start[e], s0 = g->h_start[e];
            rank[e] = a;
            if (!cnt) continue;
            hp[0 * E + a] = (char *)egu + (size_t)e * 2 * I * H * es;
            hp[1 * E + a] = (char *)g->x_sorted + (size_t)s0 * H * es;
            hp[2 * E + a] = g->h_pair + (size_t)a * maxc * 2 * I;
            hp[3 * E + a] = (char *)edn + (size_t)e * H * I * es;
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
            swiglu_kernel<P_><<<grid_for((size_t)na * maxc * I, 256), 256, 0, g->stream>>>((P_ *)g->act_sorted, g->h_pair, (size_t)na * maxc, I);
            LAUNCH_CHECK();
            if (q) dequantize(g, DT, L->experts_down, (size_t)E * H, I, H, max_active, g->active, g->n_active);
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
                                          egu + (size_t)e * 2 * I * H * es, dt, H,
                                          (char *)g->x_sorted + (size_t)s0 * H * es, dt, H, &zero, g->h_pair + (size_t)s0 * 2 * I,
                                          CUDA_R_32F, 2 * I, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
            }
            swiglu_kernel<P_><<<grid_for((size_t)P * I, 256), 256, 0, g->stream>>>((P_ *)g->act_sorted, g->h_pair, P, I);
            LAUNCH_CHECK();
            if (q) dequantize(g, DT, L->experts_down, (size_t)E * H, I, H, max_active, g->active, g->n_active);
            for (int e = 0; e < E; e++) {
                int cnt = g->h_start[e + 1] - g->h_start[e], s0 = g->h_start[e];
                if (!cnt) continue;
                CUBLAS_CHECK(cublasGemmEx(g->blas, CUBLAS_OP_T, CUBLAS_OP_N, H, cnt, I, &one,
                                          edn + (size_t)e * H * I * es, dt, I,
                                          (char *)g->act_sorted + (size_t)s0 * I * es, dt, I, &zero, g->y_pair + (size_t)s0 * H,
                                          CUDA_R_32F, H, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
            }
        }
        moe_shared_many(g, L, n);
    }
    moe_combine<<<dim3(n, (H + 255) / 256), 256, 0, g->stream>>>(g->x, g->y_pair, g->ys, g->inv, g->topk_idx, g->topk_w, K, H, c->routed_scaling);
    LAUNCH_CHECK();
    prof_mark(g, "moe combine");
}

/* forward over n tokens already in g->tokens at the position in g->pos (pos: the same, on the host). W: the format
 * of the matmul weights; P: bf16 or float, that of what is not quantized (router, GEMM inputs, the KV cache's default) */
template <typename W, typename P>
static void forward_gpu(GpuModel *g, int n, int pos, int all_logits) {
    const Config *c = &g->c;
    int H = c->dim, D = c->head_dim, V = c->vocab_size, DT = Fmt<W>::DT;
    g->pdl_now = 0;        /* the embedding: a plain launch (it follows the previous step or the host's copies) */
    const Step *in = g->step_in ? g->m_step : NULL;   /* a decode step: the token from the host's Step */
#define EMBED(WT, M) embed_kernel<WT><<<n, 256, 0, g->stream>>>(g->x, M, g->tokens, H, in, g->d_step, g->pos)
    switch (g->edt) {      /* a quantized embedding: q8 (also in q4 files) */
    case DT_Q8: EMBED(Q8, wmat(DT_Q8, g->embed, V, H)); break;
    case DT_Q4: EMBED(Q4, wmat(DT_Q4, g->embed, V, H)); break;
    default: EMBED(P, WPtr(g->embed));
    }
#undef EMBED
    LAUNCH_CHECK();
    prof_mark(g, "embed");
    g->pdl_now = g->pdl && n == 1;
    for (int l = 0; l < c->n_layers; l++) {
        GpuLayer *L = &g->L[l];
        int type = c->layer_type[l], QD = L->nh * D;
        g->nlaunch = 0;                             /* LAGUNA_DUP counts each layer's launches */
        /* ---- attention block ---- */
        if (n == 1) {
            matvec<W>(g, g->qkvg, L->wqkvg, L->NQ, H, g->x, L->attn_norm, NULL, L->bqkvg, 0);
        } else {
            norm_rows(g, g->x, L->attn_norm, n);
            gemm(g, g->qkvg, L->NQ, L->wqkvg, L->NQ, H, g->xb, n, 0.0f, DT, 1);
            if (L->bqkvg) {
                add_bias_kernel<<<grid_for((size_t)n * L->NQ, 256), 256, 0, g->stream>>>(g->qkvg, L->bqkvg, n, L->NQ);
                LAUNCH_CHECK();
            }
            prof_mark(g, "q/k/v/g");
        }
        dim3 rg(n, (L->nh + 2 * c->n_kv_heads + 3) / 4);
#define QKR(KV) launch(g, qk_norm_rope_kernel<KV>, rg, dim3(128), 0, g->qkvg, L->NQ, L->nh, c->n_kv_heads, D, \
        (const float *)L->q_norm, (const float *)L->k_norm, (const float *)g->inv_freq[type], c->rotary_dim[type], \
        c->rope_scaling[type], (KV *)L->kc, (KV *)L->vc, L->rows, (const int *)g->pos, c->norm_eps)
        if (!attention_norms_qk(g, l, n)) KV_SWITCH(g, QKR);
#undef QKR
        attention(g, l, n, pos);
        prof_mark(g, "attention");
        /* o_proj straight into the residual stream */
        if (n == 1) matvec<W>(g, g->x, L->wo, H, QD, g->att, NULL, NULL, L->bo, 1);
        else {
            gemm(g, g->x, H, L->wo, H, QD, g->att, n, 1.0f, DT, g->bf);   /* bf16 files: att16 in act16 */
            if (L->bo) { add_bias_kernel<<<grid_for((size_t)n * H, 256), 256, 0, g->stream>>>(g->x, L->bo, n, H); LAUNCH_CHECK(); }
            prof_mark(g, "o_proj");
        }
        /* ---- MLP block: dense SwiGLU or MoE ---- */
        if (n == 1) { mlp_decode<W, P>(g, l); capture_taps(g, l, n); continue; }
        norm_rows(g, g->x, L->ffn_norm, n);
        if (L->dense) {
            gemm(g, g->mlp_h, 2 * L->hid, L->gate_up, 2 * L->hid, H, g->xb, n, 0.0f, DT, 1);
            /* bf16 files: the SwiGLU output straight into act16, the bf16 values gemm's conversion would write */
            if (g->bf) swiglu_kernel<bf16><<<grid_for((size_t)n * L->hid, 256), 256, 0, g->stream>>>((bf16 *)g->act16, g->mlp_h, n, L->hid);
            else swiglu_kernel<float><<<grid_for((size_t)n * L->hid, 256), 256, 0, g->stream>>>(g->mlp_act, g->mlp_h, n, L->hid);
            LAUNCH_CHECK();
            gemm(g, g->x, H, L->down, H, L->hid, g->mlp_act, n, 1.0f, DT, g->bf);
            prof_mark(g, "dense mlp");
        } else {
            moe_many<W, P>(g, l, n);
        }
        capture_taps(g, l, n);
    }
    /* final norm and lm_head (every row, or the last) */
    int rows = all_logits ? n : 1, first = all_logits ? 0 : n - 1;
    if (rows == 1) {   /* the final norm folded into the matvec */
        matvec_dt(g, g->ldt, g->logits, g->lm_head, V, H, g->x + (size_t)first * H, g->final_norm, NULL, NULL, 0);
        return;
    }
    norm_rows(g, g->x + (size_t)first * H, g->final_norm, rows);
    gemm(g, g->logits, V, g->lm_head, V, H, g->xb, rows, 0.0f, g->ldt, 1);
    prof_mark(g, "lm_head");
}

static void forward_any(GpuModel *g, int n, int pos, int all_logits) {
    switch (g->wdt) {
    case DT_Q8: if (g->bf) forward_gpu<Q8, bf16>(g, n, pos, all_logits); else forward_gpu<Q8, float>(g, n, pos, all_logits); break;
    case DT_Q4: if (g->bf) forward_gpu<Q4, bf16>(g, n, pos, all_logits); else forward_gpu<Q4, float>(g, n, pos, all_logits); break;
    default: if (g->bf) forward_gpu<bf16, bf16>(g, n, pos, all_logits); else forward_gpu<float, float>(g, n, pos, all_logits);
    }
}

static void decode_drain(GpuModel *g);
/* upload the tokens and the position of an n-token forward */
static void upload_forward(GpuModel *g, const int *tokens, int n, int pos) {
    if (n < 1 || n > g->T || pos < 0 || pos + n > g->ctx) {
        fprintf(stderr, "laguna: error: gpu_forward of %d tokens at %d (chunk %d, context %d)\n", n, pos, g->T, g->ctx);
        exit(1);
    }
    decode_drain(g);                                /* (h_step is about to be reused) */
    g->chained = 0;
    memcpy(g->h_tokens, tokens, n * sizeof(int));
    g->h_step->pos = pos;
    g->long_attn = pos >= g->long_from;
    CUDA_CHECK(cudaMemcpyAsync(g->tokens, g->h_tokens, n * sizeof(int), cudaMemcpyHostToDevice, g->stream));
    CUDA_CHECK(cudaMemcpyAsync(g->pos, &g->h_step->pos, sizeof(int), cudaMemcpyHostToDevice, g->stream));
    g->prof_on = g->prof && n > 1 && n <= 64;
    g->prof_n = 0;
    prof_mark(g, "start");
}

/* What an n-token forward's launches take from the host: n, and the key splits of full layers (split_for), which
 * follow the keys up to the last row in blocks of 64 up to 64 of them: the key of its graph (block_graph), or -1
 * for forwards left to plain launches: one token (the decode step has its graph), more than 64 (prefill, where
 * launches cost nothing that counts) and more than 512 MoE pairs (an f32 file's path for them syncs with the host). */
static long long forward_key(const GpuModel *g, int n, int pos) {
    if (n == 1 || n > 64 || (long long)n * g->c.n_experts_active > 512) return -1;
    int full = 0;
    for (int l = 0; l < g->c.n_layers; l++) full |= g->c.layer_type[l] != ATTN_SLIDING;
    const int blocks = full ? min((pos + n + 63) / 64, 64) : 0;
    return (long long)blocks << 20 | n;
}

extern "C" float *gpu_forward(GpuModel *g, const int *tokens, int n, int pos, int all_logits) {
    upload_forward(g, tokens, n, pos);
    const long long key = forward_key(g, n, pos);
    if (key < 0) forward_any(g, n, pos, all_logits);
    else block_graph(g, key | (long long)all_logits << 16, [&] { forward_any(g, n, pos, all_logits); });
    size_t count = (size_t)(all_logits ? n : 1) * g->c.vocab_size;
    CUDA_CHECK(cudaMemcpyAsync(g->h_logits, g->logits, count * sizeof(float), cudaMemcpyDeviceToHost, g->stream));
    prof_mark(g, "logits copy");
    CUDA_CHECK(cudaStreamSynchronize(g->stream));
    prof_collect(g);
    return g->h_logits;
}

/* One decode step: forward `token` at `pos` and sample the next token on the device. The whole step (~245 kernels,
 * 6 per layer, then the sampler's 1 or 6) is one CUDA graph, captured at init; the step's parameters come from the
 * host's mapped slots and the token and position live in device memory, so the same graph serves every position.
 * A graph rather than a persistent kernel: the kernels stay small and separately testable, and replay removes
 * the launch gaps; a persistent kernel for the whole step was built and measured slower (dev/gpu_notes.md). */
static void enqueue_decode(GpuModel *g, int sampled) {
    const int V = g->c.vocab_size, nblk = (V + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK;
    const float *lg = g->logits;
    g->step_in = 1;
    forward_any(g, 1, 0, 0);
    g->step_in = 0;
    if (!sampled) {
        launch(g, sample_greedy, dim3(1), dim3(1024), 0, lg, V, g->d_step, g->m_step);
    } else {        /* the blocks' sums, the 3 radix passes (pass 0 the softmax's max and sum; all return at once without
                     * top-p), the masses, the pick */
        launch(g, sample_stats, dim3(nblk), dim3(SAMPLE_THREADS), 0, lg, V, (const Step *)g->d_step, g->sample_s);
        for (int pass = 0; pass < 3; pass++)
            launch(g, sample_radix, dim3(nblk), dim3(SAMPLE_THREADS), 0, lg, V, (const Step *)g->d_step, g->sample_s,
                   pass);
        launch(g, sample_mass, dim3(nblk), dim3(SAMPLE_THREADS), 0, lg, V, (const Step *)g->d_step, g->sample_s);
        launch(g, sample_pick, dim3(1), dim3(SAMPLE_THREADS), 0, lg, V, nblk, g->d_step, g->sample_s, g->m_step);
    }
    g->pdl_now = 0;
}

static void capture_decode_one(GpuModel *g, int long_attn, int sampled, cudaGraphExec_t *exec) {
    cudaGraph_t graph;
    g->long_attn = long_attn;
    CUDA_CHECK(cudaStreamBeginCapture(g->stream, cudaStreamCaptureModeThreadLocal));
    enqueue_decode(g, sampled);
    CUDA_CHECK(cudaStreamEndCapture(g->stream, &graph));
    CUDA_CHECK(cudaGraphInstantiate(exec, graph, 0));
    CUDA_CHECK(cudaGraphDestroy(graph));
}
/* the step for positions below long_from, and, if the context reaches it and some layer would differ, from it;
 * each greedy and sampled */
static void capture_decode(GpuModel *g) {
    int differs = 0;
    g->long_attn = 1;
    for (int l = 0; l < g->c.n_layers; l++) differs |= long_decode_attention(g, l, 1);
    for (int sampled = 0; sampled < 2; sampled++) {
        capture_decode_one(g, 0, sampled, &g->graph[sampled]);
        if (differs && g->ctx > g->long_from) capture_decode_one(g, 1, sampled, &g->graph_long[sampled]);
    }
}

/* Decode steps, launched ahead: gpu_decode_launch enqueues a step (its parameters into host slot seq & 1) and returns
 * at once; gpu_decode_wait returns the token of the oldest step not yet waited for. With token -1 a step takes the
 * token the step before it samples, on the device, so the host can launch step t + 1 before it has read step t's
 * token: the GPU goes from one step to the next without waiting for the host's read, launch and the graph's start
 * (measured in dev/gpu_notes.md, round 18). At most two steps are in flight. */
extern "C" void gpu_decode_launch(GpuModel *g, int token, int pos, float temperature, float topp, float coin) {
    if (pos < 0 || pos >= g->ctx) { fprintf(stderr, "laguna: error: decode at %d past the context %d\n", pos, g->ctx); exit(1); }
    if (g->inflight == 2) { fprintf(stderr, "laguna: error: internal: a third decode step in flight\n"); exit(1); }
    if (token < 0 && !g->chained) {
        fprintf(stderr, "laguna: error: internal: a decode step takes the previous step's token, but none ran before it\n");
        exit(1);
    }
    const int slot = g->seq & 1;
    Step *s = &g->h_step[slot];
    s->token = token; s->pos = pos; s->temperature = temperature; s->topp = topp; s->coin = coin; s->out = -1;
    g->long_attn = pos >= g->long_from;
    const int sampled = temperature > 0.0f;
    cudaGraphExec_t ge = g->long_attn && g->graph_long[sampled] ? g->graph_long[sampled] : g->graph[sampled];
    if (ge) CUDA_CHECK(cudaGraphLaunch(ge, g->stream));
    else enqueue_decode(g, sampled);
    CUDA_CHECK(cudaEventRecord(g->step_done[slot], g->stream));
    g->seq++;
    g->inflight++;
    g->chained = 1;
}
extern "C" int gpu_decode_wait(GpuModel *g) {
    if (!g->inflight) { fprintf(stderr, "laguna: error: internal: no decode step in flight\n"); exit(1); }
    const int slot = (g->seq - g->inflight) & 1;
    CUDA_CHECK(cudaEventSynchronize(g->step_done[slot]));
    g->inflight--;
    return *(volatile int *)&g->h_step[slot].out;   /* the sampler wrote it through the mapping */
}
/* every launched step finished (before anything else uses the stream's state or the host slots) */
static void decode_drain(GpuModel *g) {
    while (g->inflight) gpu_decode_wait(g);
}
extern "C" int gpu_decode_step(GpuModel *g, int token, int pos, float temperature, float topp, float coin) {
    decode_drain(g);
    gpu_decode_launch(g, token, pos, temperature, topp, coin);
    return gpu_decode_wait(g);
}

#ifdef LAGUNA_TRACE
static int trace_cmp(const void *a, const void *b) {
    const TraceRec *x = (const TraceRec *)a, *y = (const TraceRec *)b;
    if (x->t_start != y->t_start) return x->t_start < y->t_start ? -1 : 1;
    if (x->gridid != y->gridid) return x->gridid < y->gridid ? -1 : 1;
    return x->block < y->block ? -1 : x->block > y->block;
}
/* gpu_decode_step with the trace on (TRACE_BLOCK above): every block of the step's kernels, sorted by start, to path
 * as CSV (dev/trace_summary.py reads it) */
extern "C" int gpu_decode_trace(GpuModel *g, int token, int pos, float temperature, float topp, float coin,
                                const char *path) {
    unsigned zero = 0, off = TRACE_OFF, n = 0;
    CUDA_CHECK(cudaStreamSynchronize(g->stream));
    CUDA_CHECK(cudaMemcpyToSymbolAsync(trace_next, &zero, sizeof zero, 0, cudaMemcpyHostToDevice, g->stream));
    const int mode = getenv("LAGUNA_TRACE_MODE") ? atoi(getenv("LAGUNA_TRACE_MODE")) : 0;
    CUDA_CHECK(cudaMemcpyToSymbolAsync(trace_mode, &mode, sizeof mode, 0, cudaMemcpyHostToDevice, g->stream));
    int out = gpu_decode_step(g, token, pos, temperature, topp, coin);   /* ends with a sync */
    CUDA_CHECK(cudaMemcpyFromSymbolAsync(&n, trace_next, sizeof n, 0, cudaMemcpyDeviceToHost, g->stream));
    CUDA_CHECK(cudaMemcpyToSymbolAsync(trace_next, &off, sizeof off, 0, cudaMemcpyHostToDevice, g->stream));
    CUDA_CHECK(cudaStreamSynchronize(g->stream));
    size_t kept = n < TRACE_CAP ? n : TRACE_CAP;
    TraceRec *r = (TraceRec *)malloc(kept * sizeof(TraceRec) + 1);
    if (!r) { fprintf(stderr, "laguna: error: out of memory for %zu trace records\n", kept); exit(1); }
    CUDA_CHECK(cudaMemcpyFromSymbolAsync(r, trace_buf, kept * sizeof(TraceRec), 0, cudaMemcpyDeviceToHost, g->stream));
    CUDA_CHECK(cudaStreamSynchronize(g->stream));
    qsort(r, kept, sizeof(TraceRec), trace_cmp);
    FILE *f = fopen(path, "w");
    if (!f) { fprintf(stderr, "laguna: error: cannot write the trace to %s\n", path); exit(1); }
    fprintf(f, "gridid,block,smid,t_start,t_wait,t_end,cyc_wait,cyc_end,clk_start,m0,m1,m2,m3,m4,m5\n");
    for (size_t i = 0; i < kept; i++) {
        fprintf(f, "%llu,%u,%u,%llu,%llu,%llu,%u,%u,%llu", (unsigned long long)r[i].gridid, r[i].block, r[i].smid,
                (unsigned long long)r[i].t_start, (unsigned long long)r[i].t_wait, (unsigned long long)r[i].t_end,
                r[i].cyc_wait, r[i].cyc_end, (unsigned long long)r[i].clk_start);
        for (int k = 0; k < 6; k++) fprintf(f, ",%u", r[i].mark[k]);
        fprintf(f, "\n");
    }
    if (fclose(f)) { fprintf(stderr, "laguna: error: writing the trace to %s failed\n", path); exit(1); }
    fprintf(stderr, "trace: %zu block records of the step at position %d -> %s (%u dropped: buffer of %u)\n", kept,
            pos, path, n - (unsigned)kept, TRACE_CAP);
    free(r);
    return out;
}
#endif

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

/* The argmax of each of n rows, the first index on ties (argmax() in laguna.c), in two passes: ARGMAX_SLICES blocks a
 * row each take their slice's (argmax_slices), then a warp a row merges the slices in index order (argmax_merge). One
 * block a row took 25-39 us for a 16-row DFlash block at V 100,352 (16 rows on 16 of the H200's SMs). */
/* (v, i) into (bv, bi) where i is the better index: larger value, or equal and smaller; i == V: nothing seen */
__device__ __forceinline__ void argmax_take(float &bv, int &bi, float v, int i, int V) {
    if (i < V && (bi == V || v > bv || (v == bv && i < bi))) { bv = v; bi = i; }
}
__global__ void __launch_bounds__(256) argmax_slices(const float *x, int V, int2 *part) {
    __shared__ float sv[8];
    __shared__ int si[8];
    const int row = blockIdx.y, per = (V + ARGMAX_SLICES - 1) / ARGMAX_SLICES;
    const int lo = blockIdx.x * per, hi = min(V, lo + per);
    const float *r = x + (size_t)row * V;
    float bv = -INFINITY;
    int bi = V;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x)          /* each thread's indices increase: keep the first */
        if (bi == V || r[i] > bv) { bv = r[i]; bi = i; }
    for (int o = 16; o > 0; o >>= 1)
        argmax_take(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o), V);
    if ((threadIdx.x & 31) == 0) { sv[threadIdx.x >> 5] = bv; si[threadIdx.x >> 5] = bi; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); w++) argmax_take(bv, bi, sv[w], si[w], V);
        part[(size_t)row * ARGMAX_SLICES + blockIdx.x] = make_int2(__float_as_int(bv), bi);
    }
}
__global__ void argmax_merge(const int2 *part, int V, int *out) {
    const int2 p = part[(size_t)blockIdx.x * ARGMAX_SLICES + threadIdx.x];    /* one lane a slice */
    float bv = __int_as_float(p.x);
    int bi = p.y;
    for (int o = 16; o > 0; o >>= 1)
        argmax_take(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o), V);
    if (threadIdx.x == 0) out[blockIdx.x] = bi < V ? bi : 0;
}
static_assert(ARGMAX_SLICES == 32, "argmax_merge: one lane a slice");

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
    upload_forward(g, tokens, n, pos);
    auto forward_ids = [&] {
        forward_any(g, n, pos, 1);
        argmax_slices<<<dim3(ARGMAX_SLICES, n), 256, 0, g->stream>>>(g->logits, g->c.vocab_size, g->amax_part);
        LAUNCH_CHECK();
        argmax_merge<<<n, ARGMAX_SLICES, 0, g->stream>>>(g->amax_part, g->c.vocab_size, g->ids);
        LAUNCH_CHECK();
        prof_mark(g, "argmax");
    };
    const long long key = forward_key(g, n, pos);
    if (key < 0) forward_ids();
    else block_graph(g, key | 1ll << 17, forward_ids);
    CUDA_CHECK(cudaMemcpyAsync(g->h_ids, g->ids, n * sizeof(int), cudaMemcpyDeviceToHost, g->stream));
    CUDA_CHECK(cudaStreamSynchronize(g->stream));
    prof_collect(g);
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
    block_graphs_clear(target);                     /* its forwards now also capture taps */
    target->taps = (float *)taps;
    target->n_taps = c->n_taps;
    memcpy(target->tap_layers, c->tap_layers, NT * sizeof(int));
    return g;
}

/* The drafter's context for k rows of the target's taps from row0 on, at the position in g->pos: per-tap RMSNorm,
 * fc, hidden_norm; then per layer input_layernorm -> K (k_norm, RoPE at the absolute position), V, into the ring */
static void context_rows(GpuModel *g, const GpuModel *target, int row0, int k) {
    const Config *c = &g->c;
    int H = c->dim, NT = c->n_taps, D = c->head_dim, nkv = c->n_kv_heads, KVD = c->kv_dim;
    /* the fused context vector of each position */
    rmsnorm_groups_kernel<<<k * NT, 256, 0, g->stream>>>(g->cat, target->taps + (size_t)row0 * NT * H, g->aux_norm, NT,
                                                         H, c->norm_eps);
    LAUNCH_CHECK();
    gemm(g, g->ctxv, H, g->fc, H, NT * H, g->cat, k, 0.0f, g->fcdt);
    rmsnorm_kernel<<<k, 256, 0, g->stream>>>(g->ctxv, g->ctxv, H, g->hidden_norm, H, c->norm_eps, NULL);
    LAUNCH_CHECK();
    for (int l = 0; l < c->n_layers; l++) {
        GpuLayer *L = &g->L[l];
        int type = c->layer_type[l], QD = L->nh * D;
        /* the layer's input norm, then only the k and v rows of the stacked projection, into their columns of qkvg */
        rmsnorm_kernel<<<k, 256, 0, g->stream>>>(g->xb, g->ctxv, H, L->attn_norm, H, c->norm_eps, NULL);
        LAUNCH_CHECK();
        gemm(g, g->qkvg + QD, L->NQ, L->wkv, 2 * KVD, H, g->xb, k, 0.0f, is_quant(g->wdt) ? g->wdt : -1);
        /* k_norm, RoPE at the absolute positions and the ring append: the q/k-norm kernel with no query heads */
        dim3 rg(k, (2 * nkv + 3) / 4);
#define QKR(KV) qk_norm_rope_kernel<KV><<<rg, 128, 0, g->stream>>>(g->qkvg + QD, L->NQ, 0, nkv, D, L->q_norm, L->k_norm, \
                g->inv_freq[type], c->rotary_dim[type], c->rope_scaling[type], (KV *)L->kc, (KV *)L->vc, L->rows, g->pos, \
                c->norm_eps)
        KV_SWITCH(g, QKR);   /* the drafter's ring: its weights' dtype */
#undef QKR
        LAUNCH_CHECK();
    }
}

/* Drafter context from rows row0..row0+n-1 of the target's last forward, at positions pos..pos+n-1 (laguna.c's
 * drafter_add_context), in chunks of the drafter's T rows, like the CPU; each chunk's launches as a graph by its
 * row count and first row (block_graph) */
extern "C" void gpu_drafter_add_context(GpuModel *g, GpuModel *target, int row0, int n, int pos) {
    if (row0 < 0 || n < 0 || row0 + n > target->T || pos < 0 || pos + n > g->ctx) {
        fprintf(stderr, "laguna: error: drafter context of %d rows from %d at %d (chunk %d, context %d)\n", n, row0, pos,
                target->T, g->ctx);
        exit(1);
    }
    for (int r0 = 0; r0 < n; r0 += g->T) {
        int k = n - r0 < g->T ? n - r0 : g->T;
        g->h_step->pos = pos + r0;
        CUDA_CHECK(cudaMemcpyAsync(g->pos, &g->h_step->pos, sizeof(int), cudaMemcpyHostToDevice, g->stream));
        block_graph(g, 1ll << 40 | (long long)(row0 + r0) << 20 | k, [&] { context_rows(g, target, row0 + r0, k); });
        /* h_step->pos is rewritten for the next chunk, and the target's next forward rewrites the taps */
        CUDA_CHECK(cudaStreamSynchronize(g->stream));
    }
}
