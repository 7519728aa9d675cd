/* Paged decode attention on the CPU: every decode of a step, one call per layer.
 *
 * Each decode has one query token and attends over its whole context, read in place from the
 * paged cache through its block table: no gather, no copy. A decode's context is cut into
 * parts of PART tokens (flash-decoding's split-K), so one long context still spreads over all
 * threads; a task is one part of one decode, all heads: it walks the part's tokens once, each
 * token's K (then V) row for every KV head read contiguously, and leaves a partial softmax
 * (max, sum, unnormalised output) that a second loop merges per decode. Decode attention is
 * bound by reading K and V; the loops run over head_dim on contiguous rows and are left to the
 * compiler to vectorize (-O3 -ffast-math -march=native; head_dim 64, 128 and 256 are compiled
 * as constants; glibc's vector expf for the softmax). Two hand-vectorized paths take over where
 * they can: bfloat16 queries and caches with head_dim 64, 128 or 256 on a CPU with AVX512_BF16
 * (paged_decode_bf16.h: 2x faster on a Zen 5, where the generic loop reached 8 GB/s of K/V),
 * and the other bfloat16 and fp8 caches with a head_dim that is a multiple of 8 on a CPU with
 * AVX2 and FMA (paged_decode_avx2.h, in float32). The generic loop is left for the rest:
 * float32 caches, whose bytes, not its arithmetic, bound it.
 *
 * A sliding window (`window` > 0, Gemma 3's local layers) limits a decode to its last `window`
 * tokens: its parts start there, so the blocks before (which the KV cache may have freed and
 * the block table then points at another request's block) are never read.
 *
 * Tasks are spread with OpenMP. The library is linked against libgomp.so.1, which PyTorch has
 * already loaded (its wheels ship one under that soname), so the kernel runs on PyTorch's own
 * thread pool: a second pool (numba's, say) spins against PyTorch's between ops, measured at
 * about twice the kernel's time on 2 cores.
 *
 * Layouts (all contiguous; q and out both float32 or both bfloat16, flag `bf16`; the caches
 * the same, or fp8 (`kv_kind`, storage.h's kinds); the arithmetic is float32 either way, the
 * storage types are only how values are kept):
 *   q, out       [T, heads, head_dim]; decode s reads/writes row rows[s]
 *   k/v_cache    [num_blocks, block_size, kv_heads, head_dim]
 *   block_table  [num_seqs, table_width] int64; seq_lens, rows [num_seqs] int64
 *   window       tokens a decode attends back, itself included; 0: all of them
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "storage.h"
#include "team.h"

#define PART 256 /* most tokens a task: 2 tasks per thread at 16 decodes of 512 on 2 cores */
#define MIN_PART 32 /* fewest: a part's fixed costs (softmax pass, merge) stay small */
#define MIN_TASKS_PER_THREAD 4
#define RUN_MAX 16 /* tokens in a run of the bfloat16 path (paged_decode_bf16.h's RUN) */

typedef struct {
    const void *k_cache, *v_cache;
    int64_t heads, kv_heads, block_size;
    float scale;
} Cache;

/* Each head's n scores (scores[hq * PART + j]) become exp(score - max); m, l: max and sum. */
static inline void softmax_parts(int64_t heads, int64_t n, float *scores, float *m, float *l)
{
    for (int64_t hq = 0; hq < heads; hq++) {
        float *s = scores + hq * PART, top = s[0], sum = 0.0f;
        for (int64_t j = 1; j < n; j++)
            top = s[j] > top ? s[j] : top;
        for (int64_t j = 0; j < n; j++) {
            s[j] = expf(s[j] - top);
            sum += s[j];
        }
        m[hq] = top;
        l[hq] = sum;
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include "paged_decode_bf16.h"
#define HAVE_BF16_PATH 1
#else
#define HAVE_BF16_PATH 0
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include "paged_decode_avx2.h"
#define HAVE_AVX2_PATH 1
#else
#define HAVE_AVX2_PATH 0
#endif

/* One part [begin, end) of one decode: scores, partial softmax and unnormalised output.
 * q: [heads, D] float32; m, l: [heads]; acc: [heads, D]; scores: [heads, PART] scratch; the
 * caches stored as `kv_kind`. */
static inline __attribute__((always_inline)) void
attend_part(const Cache *c, const int64_t D, const int kv_kind, const float *q,
            const int64_t *table, int64_t begin, int64_t end, float *scores, float *m, float *l,
            float *acc)
{
    const int64_t group = c->heads / c->kv_heads, row = c->kv_heads * D;
    const int64_t n = end - begin;
    for (int64_t j = begin; j < end; j++) {
        const int64_t slot = table[j / c->block_size] * c->block_size + j % c->block_size;
        for (int64_t hq = 0; hq < c->heads; hq++) {
            const int64_t kh = slot * row + (hq / group) * D;
            const float *qh = q + hq * D;
            float dot = 0.0f;
            for (int64_t d = 0; d < D; d++)
                dot += qh[d] * load_cache(c->k_cache, kh + d, kv_kind);
            scores[hq * PART + (j - begin)] = dot * c->scale;
        }
    }
    softmax_parts(c->heads, n, scores, m, l);
    memset(acc, 0, sizeof(float) * c->heads * D);
    for (int64_t j = begin; j < end; j++) {
        const int64_t slot = table[j / c->block_size] * c->block_size + j % c->block_size;
        for (int64_t hq = 0; hq < c->heads; hq++) {
            const float p = scores[hq * PART + (j - begin)];
            const int64_t vh = slot * row + (hq / group) * D;
            float *a = acc + hq * D;
            for (int64_t d = 0; d < D; d++)
                a[d] += p * load_cache(c->v_cache, vh + d, kv_kind);
        }
    }
}

/* The generic loop with its head size and cache storage as constants, so that the compiler
 * unrolls and vectorizes it fully. */
static void attend_part_generic(const Cache *c, int64_t D, int kv_kind, const float *qf,
                                const int64_t *table, int64_t begin, int64_t end, float *scores,
                                float *m, float *l, float *acc)
{
#define CASE(d, k) attend_part(c, d, k, qf, table, begin, end, scores, m, l, acc)
#define BY_HEAD_SIZE(k) \
    if (D == 64) CASE(64, k); else if (D == 128) CASE(128, k); \
    else if (D == 256) CASE(256, k); else CASE(D, k)
    switch (kv_kind) {
    case KIND_F32: BY_HEAD_SIZE(KIND_F32); break;
    case KIND_BF16: BY_HEAD_SIZE(KIND_BF16); break;
    case KIND_FP8_E4M3: BY_HEAD_SIZE(KIND_FP8_E4M3); break;
    default: BY_HEAD_SIZE(KIND_FP8_E5M2); break;
    }
#undef BY_HEAD_SIZE
#undef CASE
}

/* q: this decode's query row as stored; qf: scratch for it in float32; run: scratch for a
 * run's K or V rows in bfloat16 (fp8 caches on the fast path). */
static void attend_part_any(const Cache *c, int64_t D, int bf16, int kv_kind, const void *q,
                            float *qf, uint16_t *run, const int64_t *table, int64_t begin,
                            int64_t end, float *scores, float *m, float *l, float *acc)
{
#if HAVE_BF16_PATH
    if (bf16 && kv_kind != KIND_F32 && D == 64)
        return attend_part_bf16(c, 64, kv_kind, q, table, begin, end, scores, m, l, acc, run);
    if (bf16 && kv_kind != KIND_F32 && D == 128)
        return attend_part_bf16(c, 128, kv_kind, q, table, begin, end, scores, m, l, acc, run);
    if (bf16 && kv_kind != KIND_F32 && D == 256)
        return attend_part_bf16(c, 256, kv_kind, q, table, begin, end, scores, m, l, acc, run);
#endif
    for (int64_t i = 0; i < c->heads * D; i++)
        qf[i] = load(q, i, bf16);
#if HAVE_AVX2_PATH
    /* Not float32 caches: the generic loop reads them at the DRAM's rate already (16.9 GB/s
     * on a Zen 3, where a random read of 6 KB blocks reaches ~17), and this path measured
     * slower there (14.3 GB/s). */
    if (D % 8 == 0 && kv_kind != KIND_F32) {
        float *rows = (float *)run; /* RUN_MAX bfloat16 rows are RUN8 float32 ones */
#define AVX2_CASE(d) attend_part_avx2(c, d, kv_kind, qf, table, begin, end, scores, m, l, acc, rows)
        if (D == 64) AVX2_CASE(64); else if (D == 128) AVX2_CASE(128);
        else if (D == 256) AVX2_CASE(256); else AVX2_CASE(D);
#undef AVX2_CASE
        return;
    }
#endif
    (void)run;
    attend_part_generic(c, D, kv_kind, qf, table, begin, end, scores, m, l, acc);
}

/* out[hq] = sum_p acc_p[hq] * exp(m_p - M) / sum_p l_p * exp(m_p - M), M = max_p m_p.
 * o: [D] float32 scratch; out: this decode's row, stored as `bf16` says. */
static void merge_parts(void *out, int bf16, int64_t parts, int64_t heads, int64_t D,
                        const float *m, const float *l, const float *acc, float *o)
{
    for (int64_t hq = 0; hq < heads; hq++) {
        float top = m[hq], total = 0.0f;
        for (int64_t p = 1; p < parts; p++)
            top = m[p * heads + hq] > top ? m[p * heads + hq] : top;
        memset(o, 0, sizeof(float) * D);
        for (int64_t p = 0; p < parts; p++) {
            const float w = expf(m[p * heads + hq] - top), *a = acc + (p * heads + hq) * D;
            total += l[p * heads + hq] * w;
            for (int64_t d = 0; d < D; d++)
                o[d] += w * a[d];
        }
        const float inv = 1.0f / total;
        for (int64_t d = 0; d < D; d++)
            store(out, hq * D + d, o[d] * inv, bf16);
    }
}

/* The first token a decode of seq_len tokens attends: the window's oldest, or 0. */
static inline int64_t first_token(int64_t seq_len, int64_t window)
{
    return window > 0 && seq_len > window ? seq_len - window : 0;
}

/* Tokens a part: PART, or fewer when there are few decodes, so that every thread gets
 * MIN_TASKS_PER_THREAD parts (one decode of 554 tokens in 256-token parts is 3 tasks: one of 2
 * threads would do two). Fills first[s], the index of decode s's first part (parts are
 * numbered decode by decode; first[num_seqs] = the number of parts). Only the tokens a decode
 * attends (its window) count. */
static int64_t plan_parts(const int64_t *seq_lens, int64_t num_seqs, int64_t window,
                          int64_t num_threads, int64_t *first)
{
    int64_t total = 0;
    for (int64_t s = 0; s < num_seqs; s++)
        total += seq_lens[s] - first_token(seq_lens[s], window);
    const int64_t want = MIN_TASKS_PER_THREAD * num_threads;
    int64_t part = (total + want - 1) / want;
    part = part < MIN_PART ? MIN_PART : part > PART ? PART : part;
    first[0] = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t n = seq_lens[s] - first_token(seq_lens[s], window);
        first[s + 1] = first[s] + (n + part - 1) / part;
    }
    return part;
}

int decode_plan_init(DecodePlan *p, const int64_t *seq_lens, int64_t num_seqs, int64_t window,
                     int64_t heads, int64_t head_dim, int64_t num_threads)
{
    p->first = malloc(sizeof(int64_t) * (num_seqs + 1));
    p->m = p->l = p->acc = NULL;
    if (p->first == NULL)
        return 1;
    p->part = plan_parts(seq_lens, num_seqs, window, num_threads, p->first);
    p->tasks = p->first[num_seqs];
    p->m = malloc(sizeof(float) * p->tasks * heads);
    p->l = malloc(sizeof(float) * p->tasks * heads);
    p->acc = malloc(sizeof(float) * p->tasks * heads * head_dim);
    if (p->m == NULL || p->l == NULL || p->acc == NULL) {
        decode_plan_free(p);
        return 1;
    }
    return 0;
}

void decode_plan_free(DecodePlan *p)
{
    free(p->first), free(p->m), free(p->l), free(p->acc);
    p->first = NULL, p->m = p->l = p->acc = NULL;
}

/* scores: [heads, PART]; then the query in float32 [heads, D] (the merge's row too); then a
 * run of RUN_MAX tokens' K or V rows in bfloat16 (kv_heads * D each), or of RUN_MAX / 2 tokens'
 * in float32 (the AVX2 path's RUN8). */
float *decode_scratch(int64_t heads, int64_t kv_heads, int64_t head_dim)
{
    return malloc(sizeof(float) * (heads * (PART + head_dim) + RUN_MAX * kv_heads * head_dim / 2
                                   + 16));
}

/* The tasks, then the merges, of this thread (all of them must call it; `scratch` NULL in a
 * thread whose buffer could not be allocated: it skips its tasks, and the caller must not use
 * the output). q and out are stored as `bf16` says. */
static void decode_team(const DecodePlan *p, float *scratch, void *out, const void *q, int bf16,
                        const Cache *c, int64_t kv_kind, const int64_t *block_table,
                        int64_t table_width, const int64_t *seq_lens, const int64_t *rows,
                        int64_t num_seqs, int64_t window, int64_t head_dim)
{
    const int64_t heads = c->heads, row_stride = heads * head_dim;
    float *qf = scratch == NULL ? NULL : scratch + heads * PART;
    uint16_t *run = scratch == NULL ? NULL : (uint16_t *)(qf + heads * head_dim);
    const size_t elem = bf16 ? 2 : 4;
    int64_t s = 0;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < p->tasks; t++) {
        if (scratch == NULL)
            continue;
        while (p->first[s + 1] <= t) /* this thread's tasks come in order: s only grows */
            s++;
        while (p->first[s] > t)
            s--;
        const int64_t begin = first_token(seq_lens[s], window) + (t - p->first[s]) * p->part;
        const int64_t end = begin + p->part < seq_lens[s] ? begin + p->part : seq_lens[s];
        attend_part_any(c, head_dim, bf16, (int)kv_kind,
                        (const char *)q + rows[s] * row_stride * elem, qf, run,
                        block_table + s * table_width, begin, end, scratch, p->m + t * heads,
                        p->l + t * heads, p->acc + t * heads * head_dim);
    }
#pragma omp for schedule(static)
    for (int64_t s2 = 0; s2 < num_seqs; s2++)
        if (scratch != NULL)
            merge_parts((char *)out + rows[s2] * row_stride * elem, bf16,
                        p->first[s2 + 1] - p->first[s2], heads, head_dim,
                        p->m + p->first[s2] * heads, p->l + p->first[s2] * heads,
                        p->acc + p->first[s2] * heads * head_dim, qf);
}

void paged_decode_team(const DecodePlan *p, float *scratch, void *out, const void *q,
                       int64_t bf16, const void *k_cache, const void *v_cache, int64_t kv_kind,
                       const int64_t *block_table, int64_t table_width, const int64_t *seq_lens,
                       const int64_t *rows, int64_t num_seqs, int64_t window, int64_t heads,
                       int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale)
{
    const Cache c = {k_cache, v_cache, heads, kv_heads, block_size, scale};
    decode_team(p, scratch, out, q, (int)bf16, &c, kv_kind, block_table, table_width, seq_lens,
                rows, num_seqs, window, head_dim);
}

int paged_decode_attention(void *out, const void *q, const void *k_cache, const void *v_cache,
                           int64_t bf16, int64_t kv_kind, const int64_t *block_table,
                           int64_t table_width,
                           const int64_t *seq_lens, const int64_t *rows, int64_t num_seqs,
                           int64_t window, int64_t heads, int64_t kv_heads, int64_t head_dim,
                           int64_t block_size, float scale, int64_t num_threads)
{
    const Cache c = {k_cache, v_cache, heads, kv_heads, block_size, scale};
    DecodePlan plan;
    if (decode_plan_init(&plan, seq_lens, num_seqs, window, heads, head_dim, num_threads))
        return 1;
    int failed = 0;
    /* The caller's thread count (PyTorch's): a thread it did not start has libgomp's default. */
#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = decode_scratch(heads, kv_heads, head_dim);
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        decode_team(&plan, scratch, out, q, (int)bf16, &c, kv_kind, block_table, table_width,
                    seq_lens, rows, num_seqs, window, head_dim);
        free(scratch);
    }
    decode_plan_free(&plan);
    return failed;
}
