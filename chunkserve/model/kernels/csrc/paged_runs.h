/* Runs and prefetches of paged_decode.c's hand-vectorized paths (paged_decode_bf16.h,
 * paged_decode_avx2.h; included from there).
 *
 * A run is up to `max_run` consecutive slots of one block, so its K/V rows are contiguous.
 * Blocks are scattered over the pool, so the hardware prefetcher, which follows addresses,
 * stops at every block's end: the paths ask for the rows ahead themselves. Measured on a Zen 5
 * (30 layers of 64 decodes x 512 tokens, blocks of 16, from DRAM): no prefetch 11.6 GB/s, L1
 * only 15.1, both 18-20 (a pure read of 6 KB blocks in random order reaches ~20 GB/s there).
 */
#ifndef CHUNKSERVE_PAGED_RUNS_H
#define CHUNKSERVE_PAGED_RUNS_H
#include <stdint.h>
#include <xmmintrin.h>

#define NEAR 32 /* tokens ahead of the run being computed asked into L1 */
#define FAR 128 /* and into L2 */

/* The run starting at token j: its first slot, and its length (to the end of the block, of
 * the part, or max_run tokens). */
static inline int64_t next_run(const int64_t *table, int64_t bs, int64_t j, int64_t end,
                               int64_t max_run, int64_t *slot)
{
    *slot = table[j / bs] * bs + j % bs;
    const int64_t n = bs - j % bs < end - j ? bs - j % bs : end - j;
    return n < max_run ? n : max_run;
}

/* Asks for tokens [from, to) of a cache (clipped to `end`; `row` bytes a token), into L1
 * (`l1`) or L2. */
static inline __attribute__((always_inline)) void
prefetch_tokens(const char *cache, const int64_t *table, int64_t bs, int64_t from,
                int64_t to, int64_t end, int64_t row, const int l1)
{
    to = to < end ? to : end;
    for (int64_t j = from, n, slot; j < to; j += n) {
        n = next_run(table, bs, j, to, bs, &slot);
        const char *p = cache + slot * row;
        for (int64_t b = 0; b < n * row; b += 64)
            if (l1)
                _mm_prefetch(p + b, _MM_HINT_T0);
            else
                _mm_prefetch(p + b, _MM_HINT_T1);
    }
}

/* The run [j, j + n) is being computed: ask for the rows NEAR and FAR tokens later. */
static inline __attribute__((always_inline)) void
prefetch_ahead(const char *cache, const int64_t *table, int64_t bs, int64_t j, int64_t n,
               int64_t end, int64_t row)
{
    prefetch_tokens(cache, table, bs, j + NEAR, j + NEAR + n, end, row, 1);
    prefetch_tokens(cache, table, bs, j + FAR, j + FAR + n, end, row, 0);
}

/* The two passes over a part [begin, end) of one decode, in runs of up to MAX_RUN tokens, as
 * both hand-vectorized paths take them: each run's K rows scored, the partial softmax, then
 * each run's V rows added into the output; rows ahead prefetched in both passes. The path's
 * own functions, called as
 *   ROWS(cache, kind, slot, n, row, run)      a run's rows as it reads them (in place, or
 *                                              widened into its scratch `run`),
 *   SCORE(c, D, q, rows, n, scores)           the run's n scores of every head,
 *   ACCUMULATE(c, D, rows, n, probs, acc)     the run's V rows into the output,
 * with the caller's `c`, `D`, `kind`, `q`, `table`, `begin`, `end`, `scores`, `m`, `l`, `acc`
 * and `run`. A macro rather than a function over function pointers so that each path's
 * compile-time head size and storage kind still reach its loops. */
#define ATTEND_PART_IN_RUNS(MAX_RUN, ROWS, SCORE, ACCUMULATE)                                     \
    do {                                                                                          \
        const int64_t bs_ = c->block_size, row_ = c->kv_heads * D;                                \
        const int64_t row_bytes_ = row_ * kind_bytes(kind);                                       \
        const char *kc_ = c->k_cache, *vc_ = c->v_cache;                                          \
        prefetch_tokens(kc_, table, bs_, begin, begin + NEAR, end, row_bytes_, 1);                \
        for (int64_t j = begin, n, slot; j < end; j += n) {                                       \
            n = next_run(table, bs_, j, end, MAX_RUN, &slot);                                     \
            prefetch_ahead(kc_, table, bs_, j, n, end, row_bytes_);                               \
            SCORE(c, D, q, ROWS(kc_, kind, slot, n, row_, run), n, scores + (j - begin));         \
        }                                                                                         \
        prefetch_tokens(vc_, table, bs_, begin, begin + NEAR, end, row_bytes_, 1);                \
        softmax_parts(c->heads, end - begin, scores, m, l);                                       \
        memset(acc, 0, sizeof(float) * c->heads * D);                                             \
        for (int64_t j = begin, n, slot; j < end; j += n) {                                       \
            n = next_run(table, bs_, j, end, MAX_RUN, &slot);                                     \
            prefetch_ahead(vc_, table, bs_, j, n, end, row_bytes_);                               \
            ACCUMULATE(c, D, ROWS(vc_, kind, slot, n, row_, run), n, scores + (j - begin), acc);  \
        }                                                                                         \
    } while (0)
#endif
