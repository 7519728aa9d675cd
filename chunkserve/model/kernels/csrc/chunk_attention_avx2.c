/* Prefill-chunk attention on the CPU for float32 caches, on CPUs with AVX2 and FMA (x86-64-v3):
 * every chunk of a step (a query run of more than one token), one call per layer, K/V read in
 * place from the paged cache. The float32 counterpart of chunk_attention_bf16.c, for the CPUs
 * without AVX512_BF16, whose engine runs float32 activations and caches.
 *
 * Why not PyTorch's SDPA, as before: each chunk was one call, over K/V gathered out of the
 * blocks and repeated per query head (GQA), and a chunk after a prefix took two calls merged by
 * their log-sum-exps (torch_backend.py). Here, as in the bf16 kernel (flash attention, online
 * softmax over steps of KEYS keys):
 *   - a task is TILE = 8 query rows of one chunk for every query head of one KV head: a step's
 *     K/V rows, read in place, serve the whole group;
 *   - everything is kept with the task's 8 rows as the 8 float32 lanes of a vector: scores (a
 *     vector per key), the queries transposed once (qt [D, TILE]), the output transposed
 *     (ot [D, TILE]), the row maxima and sums; so the online softmax, its rescaling of the
 *     output and the masks are lane-wise, with no horizontal sums or transposes per step;
 *   - Q.K^T: for each d, the rows' q[d] (a vector) times key j's k[d] (broadcast from the
 *     cache) into key j's score vector, 8 keys a pass; P.V the same way round: for each key,
 *     its probabilities (a vector over the rows) times v[d] (broadcast) into ot[d], 8 columns
 *     a pass. Each multiply-add costs one broadcast load, the vector loads are shared by 8;
 *   - causal, aligned to the bottom right, and a sliding window: chunk_masks.h's rule, applied
 *     as a lane mask on every step; a task's key loop starts at its first row's oldest visible
 *     key, so blocks before it (which the KV cache may have freed) are never read.
 * Tasks go to threads with a dynamic schedule, each chunk's longest (last) tiles first.
 *
 * Layouts (contiguous, float32; `kv_kind` must be storage.h's KIND_F32):
 *   q, out       [T, heads, head_dim]; chunk s owns rows q_starts[s] .. + q_lens[s]
 *   k/v_cache    [num_blocks, block_size, kv_heads, head_dim]
 *   block_table  [num_seqs, table_width] int64; seq_lens, q_starts, q_lens [num_seqs] int64
 *   head_dim     a multiple of 8 up to MAX_D (Llama's 64 and 128, Gemma 3's 256)
 * Returns 0; 1 if a buffer could not be allocated; 2 if this build, the caches or head_dim are
 * not supported (chunk_attention_avx2_supported says which head sizes beforehand).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "chunk_masks.h"
#include "storage.h"

#define TILE 8 /* query rows of a task = float32 lanes of a 256-bit vector */
#define KEYS 16 /* keys per online-softmax step: two score passes of 8 */
#define PASS 8 /* keys a score pass holds, columns a P.V pass holds: 8 accumulators */
#define MAX_D 256 /* the largest head size (Gemma 3's) */

/* Not in builds with AVX-512 (-march=native on such a CPU), where float32 chunks keep PyTorch's
 * SDPA, whose AVX-512 kernels were faster over long key ranges on an AVX-512 EPYC: this kernel
 * 1.4x SDPA's speed for a 512-token chunk, 0.95x after a 1,536-token prefix, 0.84x for 2,048
 * tokens (docs/performance.md, issue 33). */
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_CHUNK_KERNEL 1

typedef struct {
    const float *q, *k_cache, *v_cache;
    float *out;
    const int64_t *block_table, *seq_lens, *q_starts, *q_lens;
    int64_t table_width, heads, kv_heads, block_size;
    int64_t window; /* 0: none */
    float scale;
} Chunks;

/* exp(x) for x <= 0 (the softmax's arguments): 2^(x log2 e) split into 2^n * 2^f, |f| <= 1/2,
 * 2^f by its Taylor series to degree 6 (relative error < 2e-7; chunk_attention_bf16.c's
 * exp_ps), 2^n built in the exponent bits. Arguments below -87 are clamped there (2^n stays a
 * normal number); masked probabilities are zeroed apart from this. */
static inline __attribute__((always_inline)) __m256 exp8(__m256 x)
{
    const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)),
                                   _mm256_set1_ps(1.44269504088896341f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(t, n);
    __m256 p = _mm256_set1_ps(1.5403530393381609e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* A row-set of chunk_masks.h as a vector: all bits set in lane i iff bit i is. */
static inline __attribute__((always_inline)) __m256 lane_mask(uint32_t rows)
{
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_castsi256_ps(
        _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)rows), bit), bit));
}

/* A query head's running state in a task: its rows transposed (qt [D, TILE]), unnormalised
 * output transposed (ot [D, TILE]), row maxima and sums (m, l [TILE]). */
typedef struct {
    float *qt, *ot, *m, *l;
} HeadState;

/* (A multiple of 8 floats: every state, and each array in it, stays 32-byte aligned.) */
static size_t head_state_floats(int64_t D) { return 2 * D * TILE + 2 * TILE; }

static inline __attribute__((always_inline)) HeadState head_state(float *buf, int64_t D, int64_t g)
{
    float *at = buf + g * head_state_floats(D);
    const HeadState st = {at, at + D * TILE, at + 2 * D * TILE, at + 2 * D * TILE + TILE};
    return st;
}

/* Scores of the PASS keys whose rows are k[0..PASS) for the task's rows, scaled, the hidden ones
 * -1e30 (masks km): sc[jj] lane i = q[i] . k[jj] * scale. mx: the lane-wise running max. */
static inline __attribute__((always_inline)) void
score_keys(const int64_t D, const float *qt, const float *const *k, const __m256 *km,
           float scale, __m256 *mx, float *sc)
{
    __m256 acc[PASS];
    for (int jj = 0; jj < PASS; jj++)
        acc[jj] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const __m256 qv = _mm256_load_ps(qt + d * TILE);
        for (int jj = 0; jj < PASS; jj++)
            acc[jj] = _mm256_fmadd_ps(qv, _mm256_broadcast_ss(k[jj] + d), acc[jj]);
    }
    for (int jj = 0; jj < PASS; jj++) {
        acc[jj] = _mm256_blendv_ps(_mm256_set1_ps(-1e30f),
                                   _mm256_mul_ps(acc[jj], _mm256_set1_ps(scale)), km[jj]);
        *mx = _mm256_max_ps(*mx, acc[jj]);
        _mm256_store_ps(sc + jj * TILE, acc[jj]);
    }
}

/* ot[d] = ot[d] * alpha + sum over the n keys of p[key] * v[key][d], PASS columns at a time. */
static inline __attribute__((always_inline)) void
accumulate_keys(const int64_t D, const float *p, const float *const *v, int64_t n, __m256 alpha,
                float *ot)
{
    for (int64_t d0 = 0; d0 < D; d0 += PASS) {
        __m256 acc[PASS];
        for (int e = 0; e < PASS; e++)
            acc[e] = _mm256_mul_ps(_mm256_load_ps(ot + (d0 + e) * TILE), alpha);
        for (int64_t jj = 0; jj < n; jj++) {
            const __m256 pv = _mm256_load_ps(p + jj * TILE);
            for (int e = 0; e < PASS; e++)
                acc[e] = _mm256_fmadd_ps(pv, _mm256_broadcast_ss(v[jj] + d0 + e), acc[e]);
        }
        for (int e = 0; e < PASS; e++)
            _mm256_store_ps(ot + (d0 + e) * TILE, acc[e]);
    }
}

/* One head's online-softmax step over the n (<= KEYS) keys whose rows are k[..], v[..]. */
static inline __attribute__((always_inline)) void
attend_keys(const int64_t D, const HeadState *st, const float *const *k, const float *const *v,
            const __m256 *km, int64_t n, float scale)
{
    float sc[KEYS * TILE] __attribute__((aligned(32))); /* [key, row] scores, then P */
    const __m256 m = _mm256_load_ps(st->m);
    __m256 mnew = m;
    for (int64_t half = 0; half < n; half += PASS)
        score_keys(D, st->qt, k + half, km + half, scale, &mnew, sc + half * TILE);
    const __m256 alpha = exp8(_mm256_sub_ps(m, mnew));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t jj = 0; jj < n; jj++) {
        const __m256 p = _mm256_and_ps(
            km[jj], exp8(_mm256_sub_ps(_mm256_load_ps(sc + jj * TILE), mnew)));
        sum = _mm256_add_ps(sum, p);
        _mm256_store_ps(sc + jj * TILE, p);
    }
    _mm256_store_ps(st->l, _mm256_fmadd_ps(_mm256_load_ps(st->l), alpha, sum));
    _mm256_store_ps(st->m, mnew);
    accumulate_keys(D, sc, v, n, alpha, st->ot);
}

/* Each head of the group: its rows of q transposed into qt, output and sums zeroed. */
static inline __attribute__((always_inline)) void
start_heads(const Chunks *c, const int64_t D, int64_t s, int64_t kvh, int64_t i0, int64_t rows,
            float *buf)
{
    const int64_t group = c->heads / c->kv_heads, q_row = c->heads * D;
    for (int64_t g = 0; g < group; g++) {
        const HeadState st = head_state(buf, D, g);
        const float *q = c->q + (c->q_starts[s] + i0) * q_row + (kvh * group + g) * D;
        for (int64_t i = 0; i < TILE; i++)
            for (int64_t d = 0; d < D; d++)
                st.qt[d * TILE + i] = i < rows ? q[i * q_row + d] : 0.0f;
        memset(st.ot, 0, sizeof(float) * D * TILE);
        _mm256_store_ps(st.m, _mm256_set1_ps(-1e30f));
        _mm256_store_ps(st.l, _mm256_setzero_ps());
    }
}

/* One task: query rows i0 .. i0+TILE-1 (those < T) of chunk s for every query head of KV head
 * kvh, so each step's K/V rows serve the whole group. buf: the group's HeadStates. */
static inline __attribute__((always_inline)) void
attend_tile(const Chunks *c, const int64_t D, int64_t s, int64_t kvh, int64_t i0, float *buf)
{
    const int64_t T = c->q_lens[s], pos0 = c->seq_lens[s] - T + i0;
    const int64_t rows = T - i0 < TILE ? T - i0 : TILE;
    const int64_t kv_end = pos0 + rows; /* the last row sees keys [.., kv_end) */
    const int64_t group = c->heads / c->kv_heads, bs = c->block_size;
    const int64_t *table = c->block_table + s * c->table_width;
    start_heads(c, D, s, kvh, i0, rows, buf);
    for (int64_t j0 = first_visible_key(pos0, c->window); j0 < kv_end; j0 += KEYS) {
        const int64_t n = kv_end - j0 < KEYS ? kv_end - j0 : KEYS;
        const float *k[KEYS], *v[KEYS]; /* the step's rows, in place; padding repeats key j0 */
        __m256 km[KEYS];
        for (int64_t jj = 0; jj < KEYS; jj++) {
            const int64_t j = j0 + (jj < n ? jj : 0);
            const int64_t at = ((table[j / bs] * bs + j % bs) * c->kv_heads + kvh) * D;
            k[jj] = c->k_cache + at;
            v[jj] = c->v_cache + at;
            km[jj] = lane_mask(visible_rows(j0 + jj, pos0, jj, n, c->window, TILE));
        }
        for (int64_t g = 0; g < group; g++) {
            const HeadState st = head_state(buf, D, g);
            attend_keys(D, &st, k, v, km, n, c->scale);
        }
    }
    for (int64_t g = 0; g < group; g++) {
        const HeadState st = head_state(buf, D, g);
        float *out = c->out + (c->q_starts[s] + i0) * c->heads * D + (kvh * group + g) * D;
        for (int64_t i = 0; i < rows; i++) {
            const float inv = 1.0f / st.l[i];
            for (int64_t d = 0; d < D; d++)
                out[i * c->heads * D + d] = st.ot[d * TILE + i] * inv;
        }
    }
}
#else
#define HAVE_CHUNK_KERNEL 0
#endif

int chunk_attention_avx2_supported(int64_t head_dim)
{
    return HAVE_CHUNK_KERNEL && head_dim % PASS == 0 && head_dim > 0 && head_dim <= MAX_D;
}

int chunk_attention_avx2(void *out, const void *q, const void *k_cache, const void *v_cache,
                         int64_t kv_kind, const int64_t *block_table, int64_t table_width,
                         const int64_t *seq_lens,
                         const int64_t *q_starts, const int64_t *q_lens, int64_t num_seqs,
                         int64_t window, int64_t heads, int64_t kv_heads, int64_t head_dim,
                         int64_t block_size, float scale, int64_t num_threads)
{
    if (!chunk_attention_avx2_supported(head_dim) || kv_kind != KIND_F32)
        return 2;
#if HAVE_CHUNK_KERNEL
    const Chunks c = {q, k_cache, v_cache, out, block_table, seq_lens, q_starts, q_lens,
                      table_width, heads, kv_heads, block_size, window, scale};
    int64_t *first = malloc(sizeof(int64_t) * (num_seqs + 1)); /* chunk s's first task */
    if (first == NULL)
        return 1;
    first[0] = 0;
    for (int64_t s = 0; s < num_seqs; s++)
        first[s + 1] = first[s] + (q_lens[s] + TILE - 1) / TILE * kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *buf = aligned_alloc(32, sizeof(float) * head_state_floats(head_dim) *
                                           (heads / kv_heads));
        if (buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < first[num_seqs]; t++) {
            if (buf == NULL)
                continue;
            int64_t s = 0;
            while (first[s + 1] <= t)
                s++;
            const int64_t task = t - first[s], tiles = (q_lens[s] + TILE - 1) / TILE;
            const int64_t i0 = (tiles - 1 - task / kv_heads) * TILE; /* longest tiles first */
            /* Llama's and Gemma 3's head sizes as constants: each its own unrolled copy. */
            if (head_dim == 64)
                attend_tile(&c, 64, s, task % kv_heads, i0, buf);
            else if (head_dim == 128)
                attend_tile(&c, 128, s, task % kv_heads, i0, buf);
            else if (head_dim == 256)
                attend_tile(&c, 256, s, task % kv_heads, i0, buf);
            else
                attend_tile(&c, head_dim, s, task % kv_heads, i0, buf);
        }
        free(buf);
    }
    free(first);
    return failed;
#endif
    return 0;
}
