/* Prefill-chunk attention on the CPU for bfloat16 caches: every chunk of a step (a query run of
 * more than one token), one call per layer, K/V read in place from the paged cache.
 *
 * Why not PyTorch's fused CPU SDPA, as before: on a Zen 5 it ran causal attention at ~130
 * GFLOP/s, 80% of a 4,096-token prefill step, against ~800 for the same CPU's GEMMs; it also
 * needs K/V gathered out of the blocks and repeated per query head (GQA), and a chunk after a
 * prefix took two calls merged by their log-sum-exps (docs/performance.md).
 *
 * This is flash attention (online softmax over key tiles) shaped for AVX-512:
 *   - a task is TILE = 16 query rows of one head; its scores for a tile of 16 keys are 16
 *     vectors, one per key, whose 16 lanes are the 16 query rows. So the row-wise max and sum
 *     of the online softmax are plain lane-wise operations across vectors: no horizontal sums.
 *   - Q·K^T: vdpbf16ps multiplies bf16 pairs along head_dim exactly and sums in float32: the
 *     task's query rows are transposed once into pairs-by-row (qp), each key's pair broadcast.
 *   - P·V: float32 FMAs, probabilities kept in float32; a tile's V rows are widened once.
 *   - causal, aligned to the bottom right: query i of a chunk of T after a prefix of
 *     start = seq_len - T tokens sees keys 0..start+i; only tiles on the diagonal are masked.
 * GQA needs nothing: a task reads its KV head's rows; the tasks of a group share them in cache.
 * Tasks go to threads with a dynamic schedule, each chunk's longest (last) tiles first.
 *
 * Layouts (contiguous, bfloat16):
 *   q, out       [T, heads, head_dim]; chunk s owns rows q_starts[s] .. + q_lens[s]
 *   k/v_cache    [num_blocks, block_size, kv_heads, head_dim]
 *   block_table  [num_seqs, table_width] int64; seq_lens, q_starts, q_lens [num_seqs] int64
 * Returns 0; 1 if a buffer could not be allocated; 2 if this build or head_dim is not supported
 * (chunk_attention_bf16_supported says which beforehand).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 16 /* query rows of a task = keys of a tile = float32 lanes of a vector */

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_CHUNK_KERNEL 1

typedef struct {
    const uint16_t *q, *k_cache, *v_cache;
    uint16_t *out;
    const int64_t *block_table, *seq_lens, *q_starts, *q_lens;
    int64_t table_width, heads, kv_heads, block_size;
    float scale;
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
    __m512 p = _mm512_set1_ps(1.5403530393381609e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* The keys of tile j0 (n of them; the rest repeat key j0, to be masked): K rows as stored
 * into kt [TILE, D], V rows widened to float32 into vf [TILE, D]. */
static inline __attribute__((always_inline)) void
load_kv_tile(const Chunks *c, const int64_t D, const int64_t *table, int64_t kvh, int64_t j0,
             int64_t n, uint16_t *kt, float *vf)
{
    for (int64_t jj = 0; jj < TILE; jj++) {
        const int64_t j = j0 + (jj < n ? jj : 0);
        const int64_t slot = table[j / c->block_size] * c->block_size + j % c->block_size;
        const int64_t at = (slot * c->kv_heads + kvh) * D;
        memcpy(kt + jj * D, c->k_cache + at, D * sizeof(uint16_t));
        for (int64_t d = 0; d < D; d += 16) {
            const __m512i x = _mm512_cvtepu16_epi32(
                _mm256_loadu_si256((const __m256i *)(c->v_cache + at + d)));
            _mm512_store_ps(vf + jj * D + d, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)));
        }
    }
}

/* Lane i (query at position pos0 + i) sees key j iff j <= pos0 + i; keys past n are padding. */
static inline __attribute__((always_inline)) __mmask16 causal_lanes(int64_t j, int64_t pos0,
                                                                    int64_t jj, int64_t n)
{
    const int64_t first_lane = j - pos0;
    if (jj >= n || first_lane >= TILE)
        return 0;
    return first_lane <= 0 ? (__mmask16)0xFFFF : (__mmask16)(0xFFFFu << first_lane);
}

/* One task: query rows i0 .. i0+TILE-1 (those < T) of chunk s, head h. */
static inline __attribute__((always_inline)) void
attend_tile(const Chunks *c, const int64_t D, int64_t s, int64_t h, int64_t i0)
{
    enum { RB = 256 / 64 }; /* rows whose outputs a P·V pass holds: RB * D/16 <= 16 vectors */
    const int64_t rows_per_pass = D == 64 ? RB : RB / 2;
    const int64_t T = c->q_lens[s], pos0 = c->seq_lens[s] - T + i0;
    const int64_t rows = T - i0 < TILE ? T - i0 : TILE;
    const int64_t kv_end = pos0 + rows; /* the last row sees keys [0, kv_end) */
    const int64_t kvh = h / (c->heads / c->kv_heads), q_row = c->heads * D;
    const int64_t *table = c->block_table + s * c->table_width;
    uint32_t qp[64 * TILE] __attribute__((aligned(64))); /* [D/2, TILE] bf16 pairs */
    float o[TILE * 128] __attribute__((aligned(64)));    /* [TILE, D] unnormalised output */
    uint16_t kt[TILE * 128] __attribute__((aligned(64)));
    float vf[TILE * 128] __attribute__((aligned(64)));
    float pb[TILE * TILE] __attribute__((aligned(64))); /* [key, row] probabilities */
    float ab[TILE] __attribute__((aligned(64)));

    for (int64_t i = 0; i < TILE; i++) {
        const uint32_t *src = (const uint32_t *)(c->q + (c->q_starts[s] + i0 + i) * q_row + h * D);
        for (int64_t p = 0; p < D / 2; p++)
            qp[p * TILE + i] = i < rows ? src[p] : 0;
    }
    memset(o, 0, sizeof(float) * TILE * D);
    __m512 m = _mm512_set1_ps(-1e30f), l = _mm512_setzero_ps();

    for (int64_t j0 = 0; j0 < kv_end; j0 += TILE) {
        const int64_t n = kv_end - j0 < TILE ? kv_end - j0 : TILE;
        load_kv_tile(c, D, table, kvh, j0, n, kt, vf);
        __m512 sc[TILE];
        for (int jj = 0; jj < TILE; jj++)
            sc[jj] = _mm512_setzero_ps();
        for (int64_t p = 0; p < D / 2; p++) {
            const __m512bh qv = (__m512bh)_mm512_load_si512(qp + p * TILE);
            for (int jj = 0; jj < TILE; jj++)
                sc[jj] = _mm512_dpbf16_ps(
                    sc[jj], qv, (__m512bh)_mm512_set1_epi32(((const int32_t *)(kt + jj * D))[p]));
        }
        /* Online softmax: new row maxima, rescale factors, probabilities (masked ones 0). */
        __mmask16 km[TILE];
        __m512 mnew = m;
        for (int jj = 0; jj < TILE; jj++) {
            km[jj] = causal_lanes(j0 + jj, pos0, jj, n);
            sc[jj] = _mm512_mask_mul_ps(_mm512_set1_ps(-1e30f), km[jj], sc[jj],
                                        _mm512_set1_ps(c->scale));
            mnew = _mm512_max_ps(mnew, sc[jj]);
        }
        const __m512 alpha = exp_ps(_mm512_sub_ps(m, mnew));
        __m512 sum = _mm512_setzero_ps();
        for (int jj = 0; jj < TILE; jj++) {
            const __m512 p = _mm512_maskz_mov_ps(km[jj], exp_ps(_mm512_sub_ps(sc[jj], mnew)));
            sum = _mm512_add_ps(sum, p);
            _mm512_store_ps(pb + jj * TILE, p);
        }
        l = _mm512_fmadd_ps(l, alpha, sum);
        m = mnew;
        _mm512_store_ps(ab, alpha);
        /* o[i] = o[i] * alpha[i] + sum_j p[j][i] * v[j], a few rows at a time in registers. */
        for (int64_t i = 0; i < rows; i += rows_per_pass) {
            __m512 acc[RB][128 / 16];
            for (int64_t r = 0; r < rows_per_pass; r++)
                for (int64_t d = 0; d < D / 16; d++)
                    acc[r][d] = _mm512_mul_ps(_mm512_load_ps(o + (i + r) * D + d * 16),
                                              _mm512_set1_ps(ab[i + r]));
            for (int jj = 0; jj < TILE; jj++)
                for (int64_t d = 0; d < D / 16; d++) {
                    const __m512 vv = _mm512_load_ps(vf + jj * D + d * 16);
                    for (int64_t r = 0; r < rows_per_pass; r++)
                        acc[r][d] = _mm512_fmadd_ps(_mm512_set1_ps(pb[jj * TILE + i + r]), vv,
                                                    acc[r][d]);
                }
            for (int64_t r = 0; r < rows_per_pass; r++)
                for (int64_t d = 0; d < D / 16; d++)
                    _mm512_store_ps(o + (i + r) * D + d * 16, acc[r][d]);
        }
    }
    float lb[TILE] __attribute__((aligned(64)));
    _mm512_store_ps(lb, l);
    for (int64_t i = 0; i < rows; i++) {
        const __m512 inv = _mm512_set1_ps(1.0f / lb[i]);
        uint16_t *dst = c->out + (c->q_starts[s] + i0 + i) * q_row + h * D;
        for (int64_t d = 0; d < D; d += 16)
            _mm256_storeu_si256((__m256i *)(dst + d),
                                (__m256i)_mm512_cvtneps_pbh(
                                    _mm512_mul_ps(_mm512_load_ps(o + i * D + d), inv)));
    }
}
#else
#define HAVE_CHUNK_KERNEL 0
#endif

int chunk_attention_bf16_supported(int64_t head_dim)
{
    return HAVE_CHUNK_KERNEL && (head_dim == 64 || head_dim == 128);
}

int chunk_attention_bf16(void *out, const void *q, const void *k_cache, const void *v_cache,
                         const int64_t *block_table, int64_t table_width, const int64_t *seq_lens,
                         const int64_t *q_starts, const int64_t *q_lens, int64_t num_seqs,
                         int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                         float scale, int64_t num_threads)
{
    if (!chunk_attention_bf16_supported(head_dim))
        return 2;
#if HAVE_CHUNK_KERNEL
    const Chunks c = {q, k_cache, v_cache, out, block_table, seq_lens, q_starts, q_lens,
                      table_width, heads, kv_heads, block_size, scale};
    int64_t *first = malloc(sizeof(int64_t) * (num_seqs + 1)); /* chunk s's first task */
    if (first == NULL)
        return 1;
    first[0] = 0;
    for (int64_t s = 0; s < num_seqs; s++)
        first[s + 1] = first[s] + (q_lens[s] + TILE - 1) / TILE * heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t t = 0; t < first[num_seqs]; t++) {
        int64_t s = 0;
        while (first[s + 1] <= t)
            s++;
        const int64_t task = t - first[s], tiles = (q_lens[s] + TILE - 1) / TILE;
        const int64_t i0 = (tiles - 1 - task / heads) * TILE; /* the longest tiles first */
        if (head_dim == 64)
            attend_tile(&c, 64, s, task % heads, i0);
        else
            attend_tile(&c, 128, s, task % heads, i0);
    }
    free(first);
#endif
    return 0;
}
