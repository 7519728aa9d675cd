/* Prefill-chunk attention on the CPU for bfloat16 caches: every chunk of a step (a query run of
 * more than one token), one call per layer, K/V read in place from the paged cache.
 *
 * Why not PyTorch's fused CPU SDPA, as before: on a Zen 5 it ran causal attention at ~130
 * GFLOP/s, 80% of a 4,096-token prefill step, against ~800 for the same CPU's GEMMs; it also
 * needs K/V gathered out of the blocks and repeated per query head (GQA), and a chunk after a
 * prefix took two calls merged by their log-sum-exps (docs/performance.md).
 *
 * This is flash attention (online softmax over steps of KEYS keys) shaped for AVX-512:
 *   - a task is TILE = 16 query rows of one chunk for every query head of one KV head (GQA:
 *     the step's K/V rows are read from the blocks and rearranged once for the whole group);
 *   - a head's scores for 16 keys are 16 vectors, one per key, whose 16 lanes are the 16 query
 *     rows, so the row-wise max and sum of the online softmax are lane-wise operations across
 *     vectors: no horizontal sums;
 *   - Q.K^T: vdpbf16ps multiplies bf16 pairs along head_dim exactly and sums in float32; the
 *     task's query rows are transposed once into pairs-by-row (qp), each key's pair broadcast;
 *   - P.V: vdpbf16ps again, two keys a multiply: V rows interleaved by key pairs, P rounded to
 *     bf16 pairs (as flash attention rounds P to its inputs' type; the row sums stay float32);
 *   - causal, aligned to the bottom right: query i of a chunk of T after a prefix of
 *     start = seq_len - T tokens sees keys 0..start+i; only steps on the diagonal are masked;
 *   - a sliding window (`window` > 0) also hides keys more than window - 1 before a query: a
 *     task's key loop starts at its first row's oldest visible key (so the blocks before it,
 *     which the KV cache may have freed, are never read) and the steps at the window's edge
 *     are masked per row too.
 * Tasks go to threads with a dynamic schedule, each chunk's longest (last) tiles first.
 * Against PyTorch's SDPA on a Zen 5: ~4x the attention FLOP rate (docs/performance.md).
 *
 * Layouts (contiguous, bfloat16; the caches bfloat16 or fp8, `kv_kind` (storage.h's kinds):
 * fp8 rows are widened to bfloat16 as they are read, exactly):
 *   q, out       [T, heads, head_dim]; chunk s owns rows q_starts[s] .. + q_lens[s]
 *   k/v_cache    [num_blocks, block_size, kv_heads, head_dim]
 *   block_table  [num_seqs, table_width] int64; seq_lens, q_starts, q_lens [num_seqs] int64
 *   head_dim     64, 128 or 256
 * Returns 0; 1 if a buffer could not be allocated; 2 if this build or head_dim is not supported
 * (chunk_attention_bf16_supported says which beforehand).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "chunk_masks.h"
#include "storage.h"

#define TILE 16 /* query rows of a task = float32 lanes of a vector = keys a score pass holds */
#define KEYS 32 /* keys per online-softmax step: two score passes */
#define MAX_D 256 /* the largest head size (Gemma 3's) */

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_CHUNK_KERNEL 1

typedef struct {
    const uint16_t *q;
    const void *k_cache, *v_cache; /* stored as kv_kind */
    uint16_t *out;
    const int64_t *block_table, *seq_lens, *q_starts, *q_lens;
    int64_t table_width, heads, kv_heads, block_size;
    int64_t window; /* 0: none */
    float scale;
    int kv_kind;
} Chunks;

/* exp(x) for x <= 0 (the softmax's arguments): 2^(x log2 e) split into 2^n * 2^f, |f| <= 1/2,
 * 2^f by its Taylor series to degree 6 (relative error < 2e-7), 2^n by vscalefps. Arguments
 * below -87 (exp < 2e-38) are clamped there; masked scores are zeroed apart from this. */
static inline __attribute__((always_inline)) __m512 exp_ps(__m512 x)
{
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)),
                                   _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    const __m512 p = EXP2_TAYLOR6(_mm512_fmadd_ps, _mm512_set1_ps, f);
    return _mm512_scalef_ps(p, n);
}

/* The keys j0 .. j0+n-1 of a step (the rest, up to KEYS, repeat key j0 and are masked): K rows
 * into kt [KEYS, D] bfloat16; V rows as pairs of consecutive keys, vp [KEYS/2, D] dwords
 * (V[2k][d], V[2k+1][d]): the layout vdpbf16ps reduces over, two keys per multiply. The caches
 * are stored as `kind`. */
static inline __attribute__((always_inline)) void
load_kv(const Chunks *c, const int64_t D, const int kind, const int64_t *table, int64_t kvh,
        int64_t j0, int64_t n, uint16_t *kt, uint32_t *vp)
{
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                        40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                        32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    int64_t vr[2]; /* the pair's V rows: element offsets into the cache */
    for (int64_t jj = 0; jj < KEYS; jj++) {
        const int64_t j = j0 + (jj < n ? jj : 0);
        const int64_t slot = table[j / c->block_size] * c->block_size + j % c->block_size;
        const int64_t at = (slot * c->kv_heads + kvh) * D;
        for (int64_t d = 0; d < D; d += 32)
            _mm512_store_si512(kt + jj * D + d, load32_bf16(c->k_cache, at + d, kind));
        vr[jj & 1] = at;
        if (jj & 1)
            for (int64_t d = 0; d < D; d += 32) {
                const __m512i a = load32_bf16(c->v_cache, vr[0] + d, kind);
                const __m512i b = load32_bf16(c->v_cache, vr[1] + d, kind);
                uint32_t *dst = vp + (jj / 2) * D + d;
                _mm512_store_si512(dst, _mm512_permutex2var_epi16(a, lo, b));
                _mm512_store_si512(dst + 16, _mm512_permutex2var_epi16(a, hi, b));
            }
    }
}

/* Scores of keys kt[0..TILE) for the task's rows (qp: [D/2, TILE] bf16 pairs), scaled, the
 * masked ones -1e30: sc[jj] lane i = q[i] . k[jj] * scale. */
static inline __attribute__((always_inline)) void
score_keys(const int64_t D, const uint32_t *qp, const uint16_t *kt, const __mmask16 *km,
           float scale, __m512 *mx, float *sc)
{
    __m512 acc[TILE];
    for (int jj = 0; jj < TILE; jj++)
        acc[jj] = _mm512_setzero_ps();
    for (int64_t p = 0; p < D / 2; p++) {
        const __m512bh qv = (__m512bh)_mm512_load_si512(qp + p * TILE);
        for (int jj = 0; jj < TILE; jj++)
            acc[jj] = _mm512_dpbf16_ps(
                acc[jj], qv, (__m512bh)_mm512_set1_epi32(((const int32_t *)(kt + jj * D))[p]));
    }
    for (int jj = 0; jj < TILE; jj++) {
        acc[jj] = _mm512_mask_mul_ps(_mm512_set1_ps(-1e30f), km[jj], acc[jj],
                                     _mm512_set1_ps(scale));
        *mx = _mm512_max_ps(*mx, acc[jj]);
        _mm512_store_ps(sc + jj * TILE, acc[jj]);
    }
}

/* A query head's running state in a task: its rows transposed into bf16 pairs (qp [D/2, TILE]),
 * unnormalised output (o [TILE, D]), row maxima and sums (m, l [TILE]). */
typedef struct {
    uint32_t *qp;
    float *o, *m, *l;
} HeadState;

/* (A multiple of 16 floats: every state, and each array in it, stays 64-byte aligned.) */
static size_t head_state_floats(int64_t D) { return D / 2 * TILE + TILE * D + 2 * TILE; }

static inline __attribute__((always_inline)) HeadState head_state(float *buf, int64_t D, int64_t g)
{
    float *at = buf + g * head_state_floats(D);
    const HeadState st = {(uint32_t *)at, at + D / 2 * TILE, at + D / 2 * TILE + TILE * D,
                          at + D / 2 * TILE + TILE * D + TILE};
    return st;
}

/* One head's online-softmax step over the KEYS keys in kt/vp (n real ones, masks km). */
static inline __attribute__((always_inline)) void
attend_keys(const int64_t D, const HeadState *st, const uint16_t *kt, const uint32_t *vp,
            const __mmask16 *km, int64_t n, int64_t rows, float scale)
{
    enum { RB = 4 }; /* rows whose outputs a P·V pass holds: RB * D/16 <= 16 vectors */
    const int64_t rows_per_pass = D == 64 ? RB : D == 128 ? RB / 2 : RB / 4;
    float sc[KEYS * TILE] __attribute__((aligned(64)));        /* [key, row] scores */
    uint32_t pp[KEYS / 2 * TILE] __attribute__((aligned(64))); /* [key pair, row] bf16 pairs */
    float ab[TILE] __attribute__((aligned(64)));
    /* vpermw: word 2i <- word i (key 2k's P of row i), word 2i+1 <- word 16+i (key 2k+1's). */
    const __m512i pair = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                          24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                          16, 0);
    const __m512 m = _mm512_load_ps(st->m);
    __m512 mnew = m;
    for (int64_t half = 0; half < KEYS; half += TILE)
        if (half < n)
            score_keys(D, st->qp, kt + half * D, km + half, scale, &mnew, sc + half * TILE);
        else
            for (int jj = 0; jj < TILE; jj++)
                _mm512_store_ps(sc + (half + jj) * TILE, _mm512_set1_ps(-1e30f));
    /* Rescale factors; probabilities (masked ones 0), summed in float32 and rounded to bf16
     * pairs for the P·V multiplies (as flash attention rounds P to the input type). */
    const __m512 alpha = exp_ps(_mm512_sub_ps(m, mnew));
    __m512 sum = _mm512_setzero_ps();
    for (int k = 0; k < KEYS / 2; k++) {
        const __m512 p0 = _mm512_maskz_mov_ps(
            km[2 * k], exp_ps(_mm512_sub_ps(_mm512_load_ps(sc + 2 * k * TILE), mnew)));
        const __m512 p1 = _mm512_maskz_mov_ps(
            km[2 * k + 1], exp_ps(_mm512_sub_ps(_mm512_load_ps(sc + (2 * k + 1) * TILE), mnew)));
        sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
        _mm512_store_si512(pp + k * TILE,
                           _mm512_permutexvar_epi16(pair, (__m512i)_mm512_cvtne2ps_pbh(p1, p0)));
    }
    _mm512_store_ps(st->l, _mm512_fmadd_ps(_mm512_load_ps(st->l), alpha, sum));
    _mm512_store_ps(st->m, mnew);
    _mm512_store_ps(ab, alpha);
    /* o[i] = o[i] * alpha[i] + sum over key pairs of (p[2k][i], p[2k+1][i]) . vp[k]. */
    const int64_t pairs = (n + 1) / 2;
    const int64_t vecs = D / 16; /* a row's output vectors: rows_per_pass * vecs == 16 */
    for (int64_t i = 0; i < rows; i += rows_per_pass) {
        __m512 acc[16];
        for (int64_t r = 0; r < rows_per_pass; r++)
            for (int64_t d = 0; d < vecs; d++)
                acc[r * vecs + d] = _mm512_mul_ps(_mm512_load_ps(st->o + (i + r) * D + d * 16),
                                                  _mm512_set1_ps(ab[i + r]));
        for (int64_t k = 0; k < pairs; k++)
            for (int64_t d = 0; d < vecs; d++) {
                const __m512bh vv = (__m512bh)_mm512_load_si512(vp + k * D + d * 16);
                for (int64_t r = 0; r < rows_per_pass; r++)
                    acc[r * vecs + d] = _mm512_dpbf16_ps(
                        acc[r * vecs + d], (__m512bh)_mm512_set1_epi32(pp[k * TILE + i + r]), vv);
            }
        for (int64_t r = 0; r < rows_per_pass; r++)
            for (int64_t d = 0; d < vecs; d++)
                _mm512_store_ps(st->o + (i + r) * D + d * 16, acc[r * vecs + d]);
    }
}

/* One task: query rows i0 .. i0+TILE-1 (those < T) of chunk s for every query head of KV head
 * kvh, so each tile of K/V is read and rearranged once for the whole group. buf: the group's
 * HeadStates; kind: how the caches are stored. */
static inline __attribute__((always_inline)) void
attend_tile(const Chunks *c, const int64_t D, const int kind, int64_t s, int64_t kvh, int64_t i0,
            float *buf)
{
    const int64_t T = c->q_lens[s], pos0 = c->seq_lens[s] - T + i0;
    const int64_t rows = T - i0 < TILE ? T - i0 : TILE;
    const int64_t kv_end = pos0 + rows; /* the last row sees keys [.., kv_end) */
    /* The first row's oldest visible key: no row sees one before it (nor reads its block). */
    const int64_t kv_begin = first_visible_key(pos0, c->window);
    const int64_t group = c->heads / c->kv_heads, q_row = c->heads * D;
    const int64_t *table = c->block_table + s * c->table_width;
    uint16_t kt[KEYS * MAX_D] __attribute__((aligned(64)));
    uint32_t vp[KEYS / 2 * MAX_D] __attribute__((aligned(64)));

    for (int64_t g = 0; g < group; g++) {
        const HeadState st = head_state(buf, D, g);
        const int64_t h = kvh * group + g;
        for (int64_t i = 0; i < TILE; i++) {
            const uint32_t *src =
                (const uint32_t *)(c->q + (c->q_starts[s] + i0 + i) * q_row + h * D);
            for (int64_t p = 0; p < D / 2; p++)
                st.qp[p * TILE + i] = i < rows ? src[p] : 0;
        }
        memset(st.o, 0, sizeof(float) * TILE * D);
        _mm512_store_ps(st.m, _mm512_set1_ps(-1e30f));
        _mm512_store_ps(st.l, _mm512_setzero_ps());
    }
    for (int64_t j0 = kv_begin; j0 < kv_end; j0 += KEYS) {
        const int64_t n = kv_end - j0 < KEYS ? kv_end - j0 : KEYS;
        load_kv(c, D, kind, table, kvh, j0, n, kt, vp);
        __mmask16 km[KEYS];
        for (int jj = 0; jj < KEYS; jj++)
            km[jj] = (__mmask16)visible_rows(j0 + jj, pos0, jj, n, c->window, TILE);
        for (int64_t g = 0; g < group; g++) {
            const HeadState st = head_state(buf, D, g);
            attend_keys(D, &st, kt, vp, km, n, rows, c->scale);
        }
    }
    for (int64_t g = 0; g < group; g++) {
        const HeadState st = head_state(buf, D, g);
        for (int64_t i = 0; i < rows; i++) {
            const __m512 inv = _mm512_set1_ps(1.0f / st.l[i]);
            uint16_t *dst = c->out + (c->q_starts[s] + i0 + i) * q_row + (kvh * group + g) * D;
            for (int64_t d = 0; d < D; d += 16)
                _mm256_storeu_si256((__m256i *)(dst + d),
                                    (__m256i)_mm512_cvtneps_pbh(
                                        _mm512_mul_ps(_mm512_load_ps(st.o + i * D + d), inv)));
        }
    }
}
#else
#define HAVE_CHUNK_KERNEL 0
#endif

int chunk_attention_bf16_supported(int64_t head_dim)
{
    return HAVE_CHUNK_KERNEL && (head_dim == 64 || head_dim == 128 || head_dim == 256);
}

int chunk_attention_bf16(void *out, const void *q, const void *k_cache, const void *v_cache,
                         int64_t kv_kind, const int64_t *block_table, int64_t table_width,
                         const int64_t *seq_lens,
                         const int64_t *q_starts, const int64_t *q_lens, int64_t num_seqs,
                         int64_t window, int64_t heads, int64_t kv_heads, int64_t head_dim,
                         int64_t block_size, float scale, int64_t num_threads)
{
    if (!chunk_attention_bf16_supported(head_dim))
        return 2;
#if HAVE_CHUNK_KERNEL
    if (kv_kind == KIND_F32)
        return 2;
    const Chunks c = {q, k_cache, v_cache, out, block_table, seq_lens, q_starts, q_lens,
                      table_width, heads, kv_heads, block_size, window, scale, (int)kv_kind};
    int64_t *first = plan_tile_tasks(q_lens, num_seqs, kv_heads, TILE);
    if (first == NULL)
        return 1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *buf = aligned_alloc(64, sizeof(float) * head_state_floats(head_dim) *
                                           (heads / kv_heads));
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
            /* Head size and storage as constants: each pair is its own unrolled copy. */
#define TILE_CASE(d, k) attend_tile(&c, d, k, s, kvh, i0, buf)
#define BY_KIND(d)                                                              \
    if (c.kv_kind == KIND_BF16) TILE_CASE(d, KIND_BF16);                        \
    else if (c.kv_kind == KIND_FP8_E4M3) TILE_CASE(d, KIND_FP8_E4M3);           \
    else TILE_CASE(d, KIND_FP8_E5M2)
            if (head_dim == 64) {
                BY_KIND(64);
            } else if (head_dim == 128) {
                BY_KIND(128);
            } else {
                BY_KIND(256);
            }
#undef BY_KIND
#undef TILE_CASE
        }
        free(buf);
    }
    free(first);
    return failed;
#endif
    return 0;
}
