/* y = x . W^T for weights quantized in groups of 32 along K, bfloat16 activations, on CPUs with
 * AVX512_VNNI: the int4 and int8 layers' GEMMs (model/layers/group_gemm.py), every row count,
 * where group_gemm_bf16.c took decode rows and a dense bf16 copy the rest. The same two formats,
 * GGUF's blocks:
 *   int4 (Q4_0/Q4_1): w = minimum + level * scale, levels 0..15;
 *   int8 (Q8_0): w = scale * level, levels -127..127.
 *
 * Why integer dot products here too: the bf16 kernel widens every 4-bit level to a bfloat16
 * (a load, a widening shuffle and three logic ops per 32 weights) before one vdpbf16ps does 32
 * multiply-adds, and a row cannot share that work: on a Zen 5, 8 rows took 2.8x one row's time.
 * vpdpbusd multiplies 64 unsigned bytes by 64 signed bytes and sums each 4 into int32: 64
 * multiply-adds an instruction, at the same rate as vdpbf16ps's 32, on levels that need only a
 * mask (or a shift and a mask) to become bytes. So, as group_gemm_avx2.c and llama.cpp's
 * Q4_0 x Q8_0 do, each row of x is first quantized to int8 per group of 32 (d = max|x| / 127,
 * levels xq = round(x / d)):
 *   int4: y += scale * d * sum_k (level_k - 8) xq_k + (minimum + 8 scale) * sum_k x_k
 *   int8: y += scale * d * sum_k level_k xq_k
 * with the integer sums exact. The bytes vpdpbusd takes unsigned are the weights: int4 levels
 * as they are, int8 levels stored as level + 128 (0..255). The sums it makes are then
 * sum_k u_k xq_k, and the accumulator starts at -8 sum_k xq_k (int4) or -128 sum_k xq_k (int8)
 * to leave the sums above. (int4 levels are centred, as the avx2 kernel's are, so that x's
 * rounding errors meet weights of either sign: measured there to halve the error.) The error
 * against bfloat16 activations is int8's rounding of x, ~0.3% of a group's largest value.
 * Measured on a Zen 5 over Llama-3.2-1B's layers (docs/performance.md, issue 54): 0.34x the
 * dense bf16 GEMM's time at 1 row, 0.60x at 8-32, 0.85-0.90x at 64-2,048 rows.
 *
 * Layout: 16 output channels (int32 lanes) a block, per group, 4 consecutive inputs a channel
 * per lane, the order vpdpbusd sums in:
 *   int4  qw [N/16, K/32, 4 pairs of quads, 64 bytes]: in pair j, byte 4c + i holds channel c's
 *         level of input 4j + i in its low nibble and of input 4(j + 4) + i in its high one;
 *         sc [N/16, K/32, 2, 16] float16: the group's scale, then its minimum (as the bf16
 *         kernel's);
 *   int8  qw [N/16, K/32, 8 quads, 64 bytes]: byte 4c + i = channel c's level + 128 of input
 *         4j + i; sc [N/16, K/32, 16] float16 scales.
 * Tasks: two blocks (32 channels) each, statically spread, a lone last block its own. A task
 * takes its rows in passes of PAIR_ROWS (ROWS for a lone block), whose sums and outputs stay in
 * registers; each line of levels serves every row of a pass, and later passes find the task's
 * levels in cache. Two blocks a pass: each broadcast of x serves two vpdpbusd, and 2 x 6
 * independent sums hide its latency (1.3x the rate of one block's passes of 8, from cache).
 *
 * x [M, K] bfloat16, y [M, N] bfloat16 or float32 (flag y_bf16); K % 32 == 0, N % 16 == 0.
 * Returns 0; 1 if a buffer could not be allocated; 2 if this build has no AVX512_VNNI (and
 * AVX512_BF16, see below) or bits is neither 4 nor 8.
 */
#include <stdint.h>
#include <stdlib.h>

#include "team.h"

#define GROUP 32
#define LANES 16
/* Rows a pass over one block (8 sums + 8 outputs) and over two (2 x 2 x 6) in registers;
 * PREFETCH: bytes ahead of a group's levels asked for (1-2 KB measured alike, 4 KB slower at
 * 16 rows). -D builds the others for tuning. */
#ifndef ROWS
#define ROWS 8
#endif
#ifndef PAIR_ROWS
#define PAIR_ROWS 6
#endif
#ifndef PREFETCH
#define PREFETCH 1024
#endif

/* AVX512_BF16 is not used, but asked for: it is where the engine runs bfloat16 activations and
 * where this kernel was measured against group_gemm_bf16.c. A CPU with VNNI and no BF16 (Ice
 * Lake, Cascade Lake) runs float32 activations, group_gemm_avx2.c and its fused decode step. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__) &&                  \
    defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_VNNI_KERNEL 1

/* x quantized, row by row and group by group: xq [M, K] int8; per group (index m K/32 + g)
 * d, the float sum s, and the accumulator's start `start` (-8 or -128 times sum_k xq_k). */
typedef struct {
    int8_t *xq;
    float *d, *s;
    int32_t *start;
} Quantized;

/* 16 float32 values rounded to the nearest bfloat16 (ties to even), as float32: what the
 * op-by-op path's bfloat16 tensors hold (storage.h's `store`, PyTorch's conversion). */
static inline __m512 round_bf16(__m512 v)
{
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
    return _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32((int)0xFFFF0000)));
}

/* Row m of x quantized: x bfloat16 (`f32` 0), or float32 rounded to bfloat16 first (the fused
 * decode step's rows: the same levels as the op-by-op path's bfloat16 rows). */
static void quantize_row(const void *x, int f32, int64_t m, int64_t K, int bits,
                         const Quantized *q)
{
    const int32_t centre = bits == 4 ? -8 : -128;
    for (int64_t g = 0; g < K / GROUP; g++) {
        const int64_t at = m * K + g * GROUP, i = m * (K / GROUP) + g;
        __m512 lo, hi;
        if (f32) {
            lo = round_bf16(_mm512_loadu_ps((const float *)x + at));
            hi = round_bf16(_mm512_loadu_ps((const float *)x + at + 16));
        } else {
            const __m512i a = _mm512_loadu_si512((const uint16_t *)x + at); /* 32 bf16 */
            lo = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(a)), 16));
            hi = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(a, 1)), 16));
        }
        const float top =
            _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        const float d = top / 127.0f, inv = top > 0.0f ? 127.0f / top : 0.0f;
        const __m512i ql = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));
        const __m512i qh = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
        _mm_storeu_si128((__m128i *)(q->xq + at), _mm512_cvtsepi32_epi8(ql));
        _mm_storeu_si128((__m128i *)(q->xq + at + 16), _mm512_cvtsepi32_epi8(qh));
        q->d[i] = d;
        q->s[i] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
        q->start[i] = centre * _mm512_reduce_add_epi32(_mm512_add_epi32(ql, qh));
    }
}

/* Rows m0 .. m0+R-1 of y for NB blocks of 16 channels (NB = 2: 32 channels, each row's
 * broadcast of x serving two vpdpbusd, and 2R independent sums to hide vpdpbusd's latency; a
 * lone last block takes NB = 1). `stride`: bytes of levels (and float16s of scales) from one
 * block to the next. NB, R and bits are constants (the callers' switch), so the loops unroll
 * and the sums stay in registers. out: [R, NB, 16]. */
static inline __attribute__((always_inline)) void
vnni_block(const int bits, const int NB, const Quantized *x, int64_t K, const uint8_t *qw,
           int64_t stride, const uint16_t *sc, int64_t sc_stride, int64_t m0, const int R,
           float *out)
{
    const int64_t groups = K / GROUP;
    const int64_t group_bytes = (bits == 4 ? GROUP / 2 : GROUP) * LANES;
    const int per_group = bits == 4 ? 2 : 1; /* float16 vectors of scales (and minimums) */
    const int quads = bits == 4 ? 4 : 8; /* 64-byte lines of levels a group and block */
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 y[2][ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
        for (int b = 0; b < NB; b++)
            y[b][r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        /* row r's 8 quads of x in this group, as int32 to broadcast */
        const int32_t *xr = (const int32_t *)(x->xq + m0 * K + g * GROUP);
        __m512i acc[2][ROWS];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
#pragma GCC unroll 2
            for (int b = 0; b < NB; b++)
                acc[b][r] = _mm512_set1_epi32(x->start[(m0 + r) * groups + g]);
#pragma GCC unroll 2
        for (int b = 0; b < NB; b++) {
            const uint8_t *q = qw + b * stride + g * group_bytes;
            /* The levels PREFETCH bytes ahead, asked for now: at 4-8 rows a group's sums take
             * longer than its bytes take to come, and without it the two did not overlap. */
#pragma GCC unroll 8
            for (int64_t line = 0; line < group_bytes; line += 64)
                _mm_prefetch((const char *)(q + PREFETCH + line), _MM_HINT_T0);
        }
#pragma GCC unroll 8
        for (int j = 0; j < quads; j++)
#pragma GCC unroll 2
            for (int b = 0; b < NB; b++) {
                const __m512i v =
                    _mm512_load_si512((const void *)(qw + b * stride + g * group_bytes + 64 * j));
                if (bits == 4) {
                    const __m512i lo = _mm512_and_si512(v, low4);
                    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
#pragma GCC unroll 8
                    for (int r = 0; r < R; r++) {
                        acc[b][r] = _mm512_dpbusd_epi32(acc[b][r], lo,
                                                        _mm512_set1_epi32(xr[r * K / 4 + j]));
                        acc[b][r] = _mm512_dpbusd_epi32(acc[b][r], hi,
                                                        _mm512_set1_epi32(xr[r * K / 4 + j + 4]));
                    }
                } else {
#pragma GCC unroll 8
                    for (int r = 0; r < R; r++)
                        acc[b][r] = _mm512_dpbusd_epi32(acc[b][r], v,
                                                        _mm512_set1_epi32(xr[r * K / 4 + j]));
                }
            }
#pragma GCC unroll 2
        for (int b = 0; b < NB; b++) {
            const uint16_t *s = sc + b * sc_stride + g * per_group * LANES;
            const __m512 scale = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)s));
            /* int4: (minimum + 8 scale), the weight of the group's sum of x */
            const __m512 shift = bits == 4 ? _mm512_fmadd_ps(
                _mm512_set1_ps(8.0f), scale,
                _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(s + LANES)))) : scale;
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const int64_t i = (m0 + r) * groups + g;
                const __m512 sum =
                    _mm512_mul_ps(_mm512_cvtepi32_ps(acc[b][r]), _mm512_set1_ps(x->d[i]));
                y[b][r] = _mm512_fmadd_ps(scale, sum, y[b][r]);
                if (bits == 4)
                    y[b][r] = _mm512_fmadd_ps(shift, _mm512_set1_ps(x->s[i]), y[b][r]);
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
        for (int b = 0; b < NB; b++)
            _mm512_store_ps(out + (r * NB + b) * LANES, y[b][r]);
}

/* How a task stores its outputs: float32, bfloat16, or float32 rounded to bfloat16's values
 * (the fused decode step of a bfloat16 model: what the op-by-op path's bfloat16 outputs hold). */
enum { OUT_F32 = 0, OUT_BF16 = 1, OUT_F32_ROUNDED = 2 };

static inline void store_row(void *y, int mode, int64_t at, __m512 v)
{
    if (mode == OUT_BF16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)y + at),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(
                                _mm512_castps_si512(round_bf16(v)), 16)));
    else
        _mm512_storeu_ps((float *)y + at, mode == OUT_F32_ROUNDED ? round_bf16(v) : v);
}

/* One pass of `rows` rows (1..ROWS for one block, 1..PAIR_ROWS for two), NB, R and bits made
 * compile-time constants. */
static void channel_rows(int bits, int NB, const Quantized *x, int64_t K, const uint8_t *qw,
                         int64_t stride, const uint16_t *sc, int64_t sc_stride, int64_t m0,
                         int64_t rows, float *out)
{
    switch (rows * 4 + (NB - 1) * 2 + (bits == 8)) {
#define CASE(n, nb, bb)                                                                           \
    case n * 4 + (nb - 1) * 2 + (bb == 8):                                                        \
        vnni_block(bb, nb, x, K, qw, stride, sc, sc_stride, m0, n, out);                          \
        break;
#define ROW(n) CASE(n, 1, 4) CASE(n, 1, 8) CASE(n, 2, 4) CASE(n, 2, 8)
#define ONE(n) CASE(n, 1, 4) CASE(n, 1, 8)
        ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) ROW(6) ONE(7) ONE(8)
#undef ONE
#undef ROW
#undef CASE
    }
}
/* Task t (two blocks of 16 channels, or the lone last one) over every row of x. */
static void run_task(int64_t t, void *y, int mode, const Quantized *q, int64_t M, int64_t K,
                     const void *qw, const void *sc, int64_t N, int bits)
{
    const int64_t level_bytes = bits == 4 ? K / 2 : K;
    const int64_t scales = bits == 4 ? 2 * K / GROUP : K / GROUP; /* a channel's */
    const int64_t blocks = N / LANES, b0 = 2 * t, nb = blocks - b0 < 2 ? 1 : 2;
    const int64_t step = nb == 2 ? PAIR_ROWS : ROWS;
    const uint8_t *w = (const uint8_t *)qw + b0 * level_bytes * LANES;
    const uint16_t *s = (const uint16_t *)sc + b0 * scales * LANES;
    float out[ROWS * 2 * LANES] __attribute__((aligned(64)));
    for (int64_t m0 = 0; m0 < M; m0 += step) {
        const int64_t rows = M - m0 < step ? M - m0 : step;
        channel_rows(bits, (int)nb, q, K, w, level_bytes * LANES, s, scales * LANES, m0, rows,
                     out);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t b = 0; b < nb; b++)
                store_row(y, mode, (m0 + r) * N + (b0 + b) * LANES,
                          _mm512_load_ps(out + (r * nb + b) * LANES));
    }
}
#else
#define HAVE_VNNI_KERNEL 0
#endif

int group_gemm_vnni_supported(void) { return HAVE_VNNI_KERNEL; }

int group_gemm_vnni(void *y, int64_t y_bf16, const void *x, int64_t M, int64_t K, const void *qw,
                    const void *sc, int64_t N, int64_t bits, int64_t num_threads)
{
#if HAVE_VNNI_KERNEL
    if (bits != 4 && bits != 8)
        return 2;
    const int64_t groups = M * (K / GROUP);
    Quantized q = {malloc((size_t)(M * K)), malloc(sizeof(float) * groups),
                   malloc(sizeof(float) * groups), malloc(sizeof(int32_t) * groups)};
    const int failed = q.xq == NULL || q.d == NULL || q.s == NULL || q.start == NULL;
    if (!failed) {
        /* threads only for prefill-sized inputs: a decode row's groups cost less than a fork */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * K >= 1 << 16)
        for (int64_t m = 0; m < M; m++)
            quantize_row(x, 0, m, K, (int)bits, &q);
        const int64_t tasks = (N / LANES + 1) / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t t = 0; t < tasks; t++)
            run_task(t, y, y_bf16 ? OUT_BF16 : OUT_F32, &q, M, K, qw, sc, N, (int)bits);
    }
    free(q.xq), free(q.d), free(q.s), free(q.start);
    return failed;
#else
    (void)y, (void)y_bf16, (void)x, (void)M, (void)K, (void)qw, (void)sc, (void)N, (void)bits,
        (void)num_threads;
    return 2;
#endif
}

/* The fused decode step's entry (team.h): bfloat16 rows, or float32 ones rounded to bfloat16
 * as the op-by-op path's are; float32 outputs (`round_out`: rounded to bfloat16's values).
 * xq [M, K] and d [3 M K / 32] are the caller's scratch. */
int group_gemm_vnni_team(float *y, const void *x, int64_t x_bf16, int64_t M, int64_t K,
                         const void *qw, const void *sc, int64_t N, int64_t bits,
                         int64_t round_out, int8_t *xq, float *d)
{
#if HAVE_VNNI_KERNEL
    const int64_t groups = M * (K / GROUP);
    const Quantized q = {xq, d, d + groups, (int32_t *)(d + 2 * groups)};
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++)
        quantize_row(x, !x_bf16, m, K, (int)bits, &q);
    const int64_t tasks = (N / LANES + 1) / 2;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; t++)
        run_task(t, y, round_out ? OUT_F32_ROUNDED : OUT_F32, &q, M, K, qw, sc, N, (int)bits);
    return 0;
#else
    (void)y, (void)x, (void)x_bf16, (void)M, (void)K, (void)qw, (void)sc, (void)N, (void)bits,
        (void)round_out, (void)xq, (void)d;
    return 1;
#endif
}
