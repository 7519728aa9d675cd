/* The AVX2 + FMA path of paged_decode.c (included from there): float32 arithmetic over
 * bfloat16 or fp8 caches, for any head size that is a multiple of 8. (Float32 caches stay on
 * the generic loop, which reads them at DRAM's rate: this path measured slower there.)
 *
 * The generic loop is compute-bound on a narrow cache (measured on a Zen 3: a bfloat16 cache,
 * half a float32 one's bytes, no faster than it): each score is one chain of dependent
 * multiply-adds over head_dim (latency, not throughput) and a horizontal sum, and each token's
 * V row is added into accumulators in memory (a load and a store per 8 values). Here, as in
 * paged_decode_bf16.h but 8 lanes wide:
 *   - scores: one accumulator per token of a run of 8, so 8 independent chains, and the 8
 *     accumulators summed together by one transpose-and-add tree (`sum8`);
 *   - output: each query head's accumulators for a slice of up to 64 columns (8 of the 16
 *     vector registers) stay in registers over the whole run; V rows are FMA memory operands.
 * A run's rows are widened to float32 once into a scratch buffer that stays in L1 (bfloat16
 * with a shift, fp8 through storage.h's table): every query head of a GQA group then reads
 * them from there.
 */
#include <immintrin.h>

#include "paged_runs.h"

#define RUN8 8 /* tokens per run: a 256-bit vector holds 8 float32 scores */
#define SLICE_VECS 8 /* accumulator vectors of one head kept in registers: 64 columns */

/* r[i] = the sum of v[i]'s 8 lanes, for 8 vectors at once: 32-bit interleaves, 64-bit
 * interleaves, then the two 128-bit halves. */
static inline __attribute__((always_inline)) __m256 sum8(const __m256 v[RUN8])
{
    __m256 t[4], u[2];
    for (int k = 0; k < 4; k++)
        t[k] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                             _mm256_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 2; k++) {
        const __m256d x = _mm256_castps_pd(t[2 * k]), y = _mm256_castps_pd(t[2 * k + 1]);
        u[k] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
                             _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20),
                         _mm256_permute2f128_ps(u[0], u[1], 0x31));
}

/* Scores of the n (<= RUN8) tokens at k (row `row` apart, float32) for every query head:
 * scores[hq * PART + i] = q[hq] . k[token i] * scale. q: [heads, D] float32. */
static inline __attribute__((always_inline)) void
score_run8(const Cache *c, const int64_t D, const float *q, const float *k, int64_t n,
           float *scores)
{
    const int64_t group = c->heads / c->kv_heads, row = c->kv_heads * D;
    const __m256 scale = _mm256_set1_ps(c->scale);
    for (int64_t hq = 0; hq < c->heads; hq++) {
        const float *kh = k + (hq / group) * D, *qh = q + hq * D;
        __m256 acc[RUN8];
        for (int i = 0; i < RUN8; i++)
            acc[i] = _mm256_setzero_ps();
        if (n == RUN8) {
            for (int64_t d = 0; d < D; d += 8) {
                const __m256 qv = _mm256_loadu_ps(qh + d);
#pragma GCC unroll 8
                for (int i = 0; i < RUN8; i++)
                    acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kh + i * row + d), acc[i]);
            }
            _mm256_storeu_ps(scores + hq * PART, _mm256_mul_ps(sum8(acc), scale));
        } else { /* a run cut short by its block or part: the rows after n are not there */
            for (int64_t d = 0; d < D; d += 8) {
                const __m256 qv = _mm256_loadu_ps(qh + d);
                for (int i = 0; i < n; i++)
                    acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kh + i * row + d), acc[i]);
            }
            float r[RUN8];
            _mm256_storeu_ps(r, _mm256_mul_ps(sum8(acc), scale));
            for (int i = 0; i < n; i++)
                scores[hq * PART + i] = r[i];
        }
    }
}

/* acc[hq] += sum over the run's n tokens of p[hq * PART + i] * v[token i], for every query
 * head, a slice of up to SLICE_VECS * 8 columns at a time with its accumulators in registers. */
static inline __attribute__((always_inline)) void
accumulate_run8(const Cache *c, const int64_t D, const float *v, int64_t n, const float *p,
                float *acc)
{
    const int64_t group = c->heads / c->kv_heads, row = c->kv_heads * D;
    for (int64_t hq = 0; hq < c->heads; hq++) {
        const float *vh = v + (hq / group) * D, *ph = p + hq * PART;
        for (int64_t c0 = 0; c0 < D; c0 += 8 * SLICE_VECS) {
            const int64_t vecs = (D - c0) / 8 < SLICE_VECS ? (D - c0) / 8 : SLICE_VECS;
            float *out = acc + hq * D + c0;
            __m256 a[SLICE_VECS];
            for (int e = 0; e < SLICE_VECS; e++)
                a[e] = e < vecs ? _mm256_loadu_ps(out + 8 * e) : _mm256_setzero_ps();
            for (int64_t i = 0; i < n; i++) {
                const __m256 w = _mm256_set1_ps(ph[i]);
                const float *x = vh + i * row + c0;
                for (int e = 0; e < SLICE_VECS; e++)
                    if (e < vecs)
                        a[e] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + 8 * e), a[e]);
            }
            for (int e = 0; e < vecs; e++)
                _mm256_storeu_ps(out + 8 * e, a[e]);
        }
    }
}

/* The n tokens' rows (`row` values each) from `slot` on of a bfloat16 or fp8 cache (`kind`),
 * widened to float32 into `run`. */
static inline const float *run_rows_f32(const void *cache, const int kind, int64_t slot,
                                        int64_t n, int64_t row, float *run)
{
    const int64_t first = slot * row, count = n * row; /* row = kv_heads * D: a multiple of 8 */
    if (kind == KIND_BF16) {
        const uint16_t *b = (const uint16_t *)cache + first;
        for (int64_t i = 0; i < count; i += 8) { /* a bfloat16 is a float32's top 16 bits */
            const __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(b + i)));
            _mm256_storeu_ps(run + i, _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)));
        }
        return run;
    }
    for (int64_t i = 0; i < count; i++)
        run[i] = load_cache(cache, first + i, kind);
    return run;
}

/* attend_part for float32 queries (`q`, [heads, D]) and any cache (`kind`): the same partial
 * softmax, in runs of RUN8 tokens. run: scratch for RUN8 tokens' rows in float32. */
static inline __attribute__((always_inline)) void
attend_part_avx2(const Cache *c, const int64_t D, const int kind, const float *q,
                 const int64_t *table, int64_t begin, int64_t end, float *scores, float *m,
                 float *l, float *acc, float *run)
{
    ATTEND_PART_IN_RUNS(RUN8, run_rows_f32, score_run8, accumulate_run8);
}
