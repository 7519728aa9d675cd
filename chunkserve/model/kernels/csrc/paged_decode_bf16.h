/* The bfloat16 fast path of paged_decode.c, for CPUs with AVX512_BF16 (included from there).
 *
 * The generic loop scores one (token, head) at a time: a dot product over head_dim and then a
 * horizontal sum of its vector, ~8 shuffles and adds for 64 multiply-adds; and it adds each
 * token's V row into accumulators that live in memory. Here:
 *   - scores: vdpbf16ps multiplies bf16 q and K pairs straight from the cache (no conversion;
 *     products are exact in float32 and accumulate in float32), one accumulator vector per
 *     token, and the 16 accumulators of a run of 16 tokens are summed together by one
 *     transpose-and-add tree (`sum16`): ~3 operations per score instead of ~8;
 *   - output: a run's V rows are widened to float32 once per KV head and added into the
 *     accumulators of up to ACC_VECTORS vectors of that head's query heads, held in registers
 *     for the whole run (GQA: one K/V row serves `group` query heads).
 * A run is up to RUN consecutive slots of one block (paged_runs.h). fp8 caches
 * (--kv-cache-dtype) widen a run's rows to bfloat16 first, into a scratch buffer that stays in
 * L1, and then take the same two loops: half the bytes read from memory for a few instructions
 * per 32 values (storage.h's load32_bf16).
 */
#include <immintrin.h>

#include "paged_runs.h"

#define RUN 16 /* tokens per run: a 512-bit vector holds 16 float32 scores */
#define ACC_VECTORS 16 /* float32 accumulator vectors a run keeps in registers (of 32) */

/* r[i] = the sum of v[i]'s 16 lanes, for 16 vectors at once. After each level a vector holds
 * partial sums of twice as many inputs: 32-bit, 64-bit, then 128-bit lane interleaves. */
static inline __attribute__((always_inline)) __m512 sum16(const __m512 v[RUN])
{
    __m512 t[8], u[4], w[2];
    for (int k = 0; k < 8; k++)
        t[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                             _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; k++) {
        const __m512d x = _mm512_castps_pd(t[2 * k]), y = _mm512_castps_pd(t[2 * k + 1]);
        u[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int k = 0; k < 2; k++) /* 0x88: 128-bit lanes 0 and 2 of each; 0xDD: lanes 1 and 3 */
        w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88),
                         _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

static inline __attribute__((always_inline)) __m512bh load_bh(const uint16_t *p)
{
    return (__m512bh)_mm512_loadu_si512(p);
}

/* 16 bfloat16 values widened to float32 (a bf16 is the top half of a float32's bits). */
static inline __attribute__((always_inline)) __m512 load_bf16_ps(const uint16_t *p)
{
    const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
}

/* Scores of the n (<= RUN) tokens at k (row `row` apart) for every query head: scores[hq * PART]
 * gets q[hq] . k[token] * scale for the run's tokens. q: [heads, D] bfloat16. */
static inline __attribute__((always_inline)) void
score_run(const Cache *c, const int64_t D, const uint16_t *q, const uint16_t *k, int64_t n,
          float *scores)
{
    const int64_t group = c->heads / c->kv_heads, row = c->kv_heads * D;
    const __mmask16 mask = (__mmask16)((1u << n) - 1);
    for (int64_t hq = 0; hq < c->heads; hq++) {
        const uint16_t *kh = k + (hq / group) * D;
        __m512 acc[RUN];
#pragma GCC unroll 16
        for (int i = 0; i < RUN; i++) {
            acc[i] = _mm512_setzero_ps();
            if (i < n)
                for (int64_t d = 0; d < D; d += 32)
                    acc[i] = _mm512_dpbf16_ps(acc[i], load_bh(q + hq * D + d),
                                              load_bh(kh + i * row + d));
        }
        _mm512_mask_storeu_ps(scores + hq * PART, mask,
                              _mm512_mul_ps(sum16(acc), _mm512_set1_ps(c->scale)));
    }
}

/* acc[hq] += sum over the run's n tokens of p[hq * PART + i] * v[token i], for every query
 * head; `heads_per_pass` query heads of one KV head at a time, their accumulators in registers.
 * Head sizes over 128 (Gemma 3's 256) go in slices of 128 columns: a whole row of 256 would
 * take 16 accumulators and 16 widened V vectors, every one of the 32 registers and more. */
static inline __attribute__((always_inline)) void
accumulate_run(const Cache *c, const int64_t D, const uint16_t *v, int64_t n, const float *p,
               float *acc)
{
    enum { MAX_VECS = 8 }; /* a slice of 128 columns */
    const int64_t group = c->heads / c->kv_heads, row = c->kv_heads * D;
    const int64_t width = D < 16 * MAX_VECS ? D : 16 * MAX_VECS, vecs = width / 16;
    const int64_t heads_per_pass = ACC_VECTORS / vecs;
    for (int64_t kh = 0; kh < c->kv_heads; kh++)
        for (int64_t c0 = 0; c0 < D; c0 += width)
            for (int64_t g0 = 0; g0 < group; g0 += heads_per_pass) {
                const int64_t h0 = kh * group + g0;
                const int64_t nh = group - g0 < heads_per_pass ? group - g0 : heads_per_pass;
                float *out = acc + h0 * D + c0;
                const uint16_t *vs = v + kh * D + c0;
                __m512 a[ACC_VECTORS];
                for (int h = 0; h < ACC_VECTORS / vecs; h++)
                    for (int e = 0; e < vecs; e++)
                        a[h * vecs + e] = h < nh ? _mm512_loadu_ps(out + h * D + 16 * e)
                                                 : _mm512_setzero_ps();
                for (int64_t i = 0; i < n; i++) {
                    __m512 x[MAX_VECS];
                    for (int e = 0; e < vecs; e++)
                        x[e] = load_bf16_ps(vs + i * row + 16 * e);
                    for (int h = 0; h < ACC_VECTORS / vecs; h++) {
                        if (h >= nh)
                            break;
                        const __m512 w = _mm512_set1_ps(p[(h0 + h) * PART + i]);
                        for (int e = 0; e < vecs; e++)
                            a[h * vecs + e] = _mm512_fmadd_ps(w, x[e], a[h * vecs + e]);
                    }
                }
                for (int h = 0; h < nh; h++)
                    for (int e = 0; e < vecs; e++)
                        _mm512_storeu_ps(out + h * D + 16 * e, a[h * vecs + e]);
            }
}

/* The n tokens' rows from `slot` on of a cache stored as `kind`, as bfloat16: in place for a
 * bfloat16 cache, else widened into `run`. */
static inline __attribute__((always_inline)) const uint16_t *
run_rows(const void *cache, const int kind, int64_t slot, int64_t n, int64_t row, uint16_t *run)
{
    if (kind == KIND_BF16)
        return (const uint16_t *)cache + slot * row;
    for (int64_t i = 0; i < n * row; i += 32) /* row = kv_heads * D: a multiple of 32 */
        _mm512_storeu_si512(run + i, load32_bf16(cache, slot * row + i, kind));
    return run;
}

/* attend_part for bfloat16 queries and bfloat16 or fp8 caches (`kind`): the same partial
 * softmax, in runs. run: scratch for RUN tokens' rows. */
static inline __attribute__((always_inline)) void
attend_part_bf16(const Cache *c, const int64_t D, const int kind, const uint16_t *q,
                 const int64_t *table, int64_t begin, int64_t end, float *scores, float *m,
                 float *l, float *acc, uint16_t *run)
{
    ATTEND_PART_IN_RUNS(RUN, run_rows, score_run, accumulate_run);
}
