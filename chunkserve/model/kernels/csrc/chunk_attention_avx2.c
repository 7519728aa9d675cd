/* Prefill-chunk attention on the CPU for float32 queries, on CPUs with AVX2 and FMA (x86-64-v3):
 * every chunk of a step (a query run of more than one token), one call per layer, K/V read in
 * place from the paged cache. The float32 counterpart of chunk_attention_bf16.c, for the CPUs
 * without AVX512_BF16, whose engine runs float32 activations over a float32 cache, or a
 * bfloat16 one (`--kv-cache-dtype bfloat16`: half the bytes a decode reads).
 *
 * Why not PyTorch's SDPA, as before: each chunk was one call, over K/V gathered out of the
 * blocks and repeated per query head (GQA), and a chunk after a prefix took two calls merged by
 * their log-sum-exps (torch_backend.py). Here, as in the bf16 kernel (flash attention, online
 * softmax over steps of KEYS keys):
 *   - a task is TILE = 24 query rows of one chunk for every query head of one KV head: a step's
 *     K/V rows, read in place, serve the whole group;
 *   - everything is kept with the task's rows as the float32 lanes of ROWV = 3 vectors: scores
 *     (three vectors per key), the queries transposed once (qt [D, TILE]), the output transposed
 *     (ot [D, TILE]), the row maxima and sums; so the online softmax, its rescaling of the
 *     output and the masks are lane-wise, with no horizontal sums or transposes per step;
 *   - Q.K^T: for each d, the rows' q[d] (three vectors) times key j's k[d] (broadcast from the
 *     cache) into key j's scores, KPASS keys a pass; P.V the same way round: for each key, its
 *     probabilities (three vectors) times v[d] (broadcast) into ot[d], DPASS columns a pass.
 *     Loads, not FMAs, bound these loops: a broadcast serves ROWV multiply-adds, a row vector
 *     KPASS (or DPASS). With one vector of rows (8) the kernel was 2-10% slower than with two;
 *     three (12 accumulators either way: 7 loads per 12 FMAs, not 8) 1.02-1.07x faster than
 *     two on top of the longer steps below. The row vectors are pinned in registers
 *     (in_register): left to GCC, all 16 registers taken, it reloaded them for every key (16
 *     loads per 12 FMAs), and the kernel ran 1.27x slower on a Zen 3 (two vector loads a
 *     cycle; docs/performance.md, issue 33);
 *   - causal, aligned to the bottom right, and a sliding window: chunk_masks.h's rule, applied
 *     as a lane mask on every step; a task's key loop starts at its first row's oldest visible
 *     key, so blocks before it (which the KV cache may have freed) are never read.
 * Tasks go to threads with a dynamic schedule, each chunk's longest (last) tiles first.
 * A bfloat16 cache's rows of a step are widened to float32 once (into the task's scratch) and
 * then serve every query head of the group as a float32 cache's rows would: the widening is
 * one shift per 8 values against 2 * group * TILE / 8 multiply-adds.
 *
 * Layouts (contiguous; q, out float32; the caches as `kv_kind`: storage.h's KIND_F32 or
 * KIND_BF16):
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

#define LANES 8 /* float32 lanes of a 256-bit vector */
#define ROWV 3 /* vectors of query rows a task holds */
#define TILE (LANES * ROWV) /* query rows of a task */
#define KPASS 4 /* keys a score pass holds: KPASS * ROWV = 12 accumulators */
/* Keys per online-softmax step: nine score passes. A step pays its own fixed work (the output's
 * rescaling by alpha: a load, a multiply and a store per output vector; the maxima's exp): with
 * 12 keys a step the kernel (then two row vectors) was 1.14-1.18x slower on a 512-token chunk,
 * with or without a 1,536-token prefix; 24 and 48 keys measured as 36, 96 slower (AVX2 build,
 * one core; docs/performance.md, issue 33). */
#define KEYS (9 * KPASS)
#define DPASS 4 /* columns a P.V pass holds: DPASS * ROWV = 12 accumulators */
#define MAX_D 256 /* the largest head size (Gemma 3's) */

/* Also in builds for AVX-512 CPUs (float32 activations there: `--dtype float32`, or no
 * AVX512_BF16), where it measured 1.4-2.1x PyTorch's AVX-512 SDPA on 2 cores of an EPYC, chunks
 * of 512 to 2,048 tokens, with and without a prefix (docs/performance.md, issue 33). */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_CHUNK_KERNEL 1

typedef struct {
    const float *q;
    const void *k_cache, *v_cache; /* stored as kv_kind */
    float *out;
    const int64_t *block_table, *seq_lens, *q_starts, *q_lens;
    int64_t table_width, heads, kv_heads, block_size;
    int64_t window; /* 0: none */
    float scale;
    int kv_kind;
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
    const __m256 p = EXP2_TAYLOR6(_mm256_fmadd_ps, _mm256_set1_ps, f);
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* An empty instruction that reads and writes *a in a register: a vector loaded once then stays
 * there for every multiply-add that uses it. Without it GCC folds the load into each multiply-add
 * as a memory operand (the 16 registers are all taken), so each row vector was loaded KPASS (or
 * DPASS) times: 16 loads per 12 multiply-adds, more than a Zen 3's two vector loads a cycle
 * feed. */
static inline __attribute__((always_inline)) void in_register(__m256 *a)
{
    __asm__("" : "+x"(*a));
}

/* Lanes 8h .. 8h+7 of a row-set of chunk_masks.h as a vector: all bits set in lane i iff bit
 * 8h + i is. */
static inline __attribute__((always_inline)) __m256 lane_mask(uint32_t rows, int h)
{
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(
        _mm256_and_si256(_mm256_set1_epi32((int)(rows >> (LANES * h))), bit), bit));
}

/* A query head's running state in a task: its rows transposed (qt [D, TILE]), unnormalised
 * output transposed (ot [D, TILE]), row maxima and sums (m, l [TILE]). */
typedef struct {
    float *qt, *ot, *m, *l;
} HeadState;

/* (A multiple of 8 floats: every state, and each array in it, stays 32-byte aligned.) */
static size_t head_state_floats(int64_t D) { return 2 * D * TILE + 2 * TILE; }

/* A task's scratch: the group's HeadStates, then a step's K and V rows widened to float32
 * (used with a bfloat16 cache only). */
static size_t task_floats(int64_t D, int64_t group)
{
    return head_state_floats(D) * group + 2 * KEYS * D;
}

/* n bfloat16 values at src as float32 at dst (n a multiple of 8): the bits shifted up. */
static inline __attribute__((always_inline)) void widen_bf16(const uint16_t *src, float *dst,
                                                             int64_t n)
{
    for (int64_t i = 0; i < n; i += LANES) {
        const __m128i h = _mm_loadu_si128((const __m128i *)(src + i));
        _mm256_store_ps(dst + i, _mm256_castsi256_ps(
                                     _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
    }
}

/* The address of row `at` (an element offset) of a cache as float32: in place for a float32
 * cache; for a bfloat16 one, widened into `scratch` (D floats), which is returned. */
static inline __attribute__((always_inline)) const float *
cache_row(const void *cache, int kv_kind, int64_t at, int64_t D, float *scratch)
{
    if (kv_kind == KIND_F32)
        return (const float *)cache + at;
    widen_bf16((const uint16_t *)cache + at, scratch, D);
    return scratch;
}

static inline __attribute__((always_inline)) HeadState head_state(float *buf, int64_t D, int64_t g)
{
    float *at = buf + g * head_state_floats(D);
    const HeadState st = {at, at + D * TILE, at + 2 * D * TILE, at + 2 * D * TILE + TILE};
    return st;
}

/* Scores of the KPASS keys whose rows are k[0..KPASS) for the task's rows, scaled, the hidden
 * ones -1e30 (masks km, ROWV a key): sc[jj] row i = q[i] . k[jj] * scale. mx: the lane-wise
 * running maxima of each row vector. */
static inline __attribute__((always_inline)) void
score_keys(const int64_t D, const float *qt, const float *const *k, const __m256 *km,
           float scale, __m256 *mx, float *sc)
{
    __m256 acc[KPASS * ROWV];
    for (int a = 0; a < KPASS * ROWV; a++)
        acc[a] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        __m256 qv[ROWV];
        for (int h = 0; h < ROWV; h++) {
            qv[h] = _mm256_load_ps(qt + d * TILE + LANES * h);
            in_register(&qv[h]);
        }
        for (int jj = 0; jj < KPASS; jj++) {
            const __m256 kv = _mm256_broadcast_ss(k[jj] + d);
            for (int h = 0; h < ROWV; h++)
                acc[jj * ROWV + h] = _mm256_fmadd_ps(qv[h], kv, acc[jj * ROWV + h]);
        }
    }
    for (int a = 0; a < KPASS * ROWV; a++) {
        acc[a] = _mm256_blendv_ps(_mm256_set1_ps(-1e30f),
                                  _mm256_mul_ps(acc[a], _mm256_set1_ps(scale)), km[a]);
        mx[a % ROWV] = _mm256_max_ps(mx[a % ROWV], acc[a]);
        _mm256_store_ps(sc + a * LANES, acc[a]);
    }
}

/* ot[d] = ot[d] * alpha + sum over the n keys of p[key] * v[key][d], DPASS columns at a time. */
static inline __attribute__((always_inline)) void
accumulate_keys(const int64_t D, const float *p, const float *const *v, int64_t n,
                const __m256 *alpha, float *ot)
{
    for (int64_t d0 = 0; d0 < D; d0 += DPASS) {
        __m256 acc[DPASS * ROWV];
        for (int e = 0; e < DPASS; e++)
            for (int h = 0; h < ROWV; h++)
                acc[e * ROWV + h] = _mm256_mul_ps(
                    _mm256_load_ps(ot + (d0 + e) * TILE + LANES * h), alpha[h]);
        for (int64_t jj = 0; jj < n; jj++) {
            __m256 pv[ROWV];
            for (int h = 0; h < ROWV; h++) {
                pv[h] = _mm256_load_ps(p + jj * TILE + LANES * h);
                in_register(&pv[h]);
            }
            for (int e = 0; e < DPASS; e++) {
                const __m256 x = _mm256_broadcast_ss(v[jj] + d0 + e);
                for (int h = 0; h < ROWV; h++)
                    acc[e * ROWV + h] = _mm256_fmadd_ps(pv[h], x, acc[e * ROWV + h]);
            }
        }
        for (int e = 0; e < DPASS; e++)
            for (int h = 0; h < ROWV; h++)
                _mm256_store_ps(ot + (d0 + e) * TILE + LANES * h, acc[e * ROWV + h]);
    }
}

/* One head's online-softmax step over the n (<= KEYS) keys whose rows are k[..], v[..]. */
static inline __attribute__((always_inline)) void
attend_keys(const int64_t D, const HeadState *st, const float *const *k, const float *const *v,
            const __m256 *km, int64_t n, float scale)
{
    float sc[KEYS * TILE] __attribute__((aligned(32))); /* [key, row] scores, then P */
    __m256 m[ROWV], mnew[ROWV], alpha[ROWV], sum[ROWV];
    for (int h = 0; h < ROWV; h++)
        mnew[h] = m[h] = _mm256_load_ps(st->m + LANES * h);
    for (int64_t j = 0; j < n; j += KPASS)
        score_keys(D, st->qt, k + j, km + j * ROWV, scale, mnew, sc + j * TILE);
    for (int h = 0; h < ROWV; h++) {
        alpha[h] = exp8(_mm256_sub_ps(m[h], mnew[h]));
        sum[h] = _mm256_setzero_ps();
    }
    for (int64_t jj = 0; jj < n; jj++)
        for (int h = 0; h < ROWV; h++) {
            float *at = sc + jj * TILE + LANES * h;
            const __m256 p = _mm256_and_ps(
                km[jj * ROWV + h], exp8(_mm256_sub_ps(_mm256_load_ps(at), mnew[h])));
            sum[h] = _mm256_add_ps(sum[h], p);
            _mm256_store_ps(at, p);
        }
    for (int h = 0; h < ROWV; h++) {
        float *l = st->l + LANES * h;
        _mm256_store_ps(l, _mm256_fmadd_ps(_mm256_load_ps(l), alpha[h], sum[h]));
        _mm256_store_ps(st->m + LANES * h, mnew[h]);
    }
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
        for (int64_t i = 0; i < TILE; i++) {
            st.m[i] = -1e30f;
            st.l[i] = 0.0f;
        }
    }
}

/* One task: query rows i0 .. i0+TILE-1 (those < T) of chunk s for every query head of KV head
 * kvh, so each step's K/V rows serve the whole group. buf: task_floats() scratch. */
static inline __attribute__((always_inline)) void
attend_tile(const Chunks *c, const int64_t D, int64_t s, int64_t kvh, int64_t i0, float *buf)
{
    const int64_t T = c->q_lens[s], pos0 = c->seq_lens[s] - T + i0;
    const int64_t rows = T - i0 < TILE ? T - i0 : TILE;
    const int64_t kv_end = pos0 + rows; /* the last row sees keys [.., kv_end) */
    const int64_t group = c->heads / c->kv_heads, bs = c->block_size;
    const int64_t *table = c->block_table + s * c->table_width;
    float *wide = buf + head_state_floats(D) * group; /* [KEYS] K rows, then [KEYS] V rows */
    start_heads(c, D, s, kvh, i0, rows, buf);
    for (int64_t j0 = first_visible_key(pos0, c->window); j0 < kv_end; j0 += KEYS) {
        const int64_t n = kv_end - j0 < KEYS ? kv_end - j0 : KEYS;
        const float *k[KEYS], *v[KEYS]; /* the step's rows, in place; padding repeats key j0 */
        __m256 km[KEYS * ROWV];
        for (int64_t jj = 0; jj < KEYS; jj++) {
            const int64_t j = j0 + (jj < n ? jj : 0);
            const int64_t at = ((table[j / bs] * bs + j % bs) * c->kv_heads + kvh) * D;
            k[jj] = cache_row(c->k_cache, c->kv_kind, at, D, wide + jj * D);
            v[jj] = cache_row(c->v_cache, c->kv_kind, at, D, wide + (KEYS + jj) * D);
            const uint32_t seen = visible_rows(j0 + jj, pos0, jj, n, c->window, TILE);
            for (int h = 0; h < ROWV; h++)
                km[jj * ROWV + h] = lane_mask(seen, h);
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
    return HAVE_CHUNK_KERNEL && head_dim % 8 == 0 && head_dim > 0 && head_dim <= MAX_D;
}

int chunk_attention_avx2(void *out, const void *q, const void *k_cache, const void *v_cache,
                         int64_t kv_kind, const int64_t *block_table, int64_t table_width,
                         const int64_t *seq_lens,
                         const int64_t *q_starts, const int64_t *q_lens, int64_t num_seqs,
                         int64_t window, int64_t heads, int64_t kv_heads, int64_t head_dim,
                         int64_t block_size, float scale, int64_t num_threads)
{
    if (!chunk_attention_avx2_supported(head_dim) ||
        (kv_kind != KIND_F32 && kv_kind != KIND_BF16))
        return 2;
#if HAVE_CHUNK_KERNEL
    const Chunks c = {q, k_cache, v_cache, out, block_table, seq_lens, q_starts, q_lens,
                      table_width, heads, kv_heads, block_size, window, scale, (int)kv_kind};
    int64_t *first = plan_tile_tasks(q_lens, num_seqs, kv_heads, TILE);
    if (first == NULL)
        return 1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *buf = aligned_alloc(32, sizeof(float) * task_floats(head_dim, heads / kv_heads));
        if (buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < first[num_seqs]; t++) {
            if (buf == NULL)
                continue;
            int64_t s, kvh, i0;
            tile_task(first, q_lens, t, TILE, kv_heads, &s, &kvh, &i0);
            /* Llama's and Gemma 3's head sizes as constants: each its own unrolled copy. */
            if (head_dim == 64)
                attend_tile(&c, 64, s, kvh, i0, buf);
            else if (head_dim == 128)
                attend_tile(&c, 128, s, kvh, i0, buf);
            else if (head_dim == 256)
                attend_tile(&c, 256, s, kvh, i0, buf);
            else
                attend_tile(&c, head_dim, s, kvh, i0, buf);
        }
        free(buf);
    }
    free(first);
    return failed;
#endif
    return 0;
}
