/* What the chunk kernels (chunk_attention_bf16.c and chunk_attention_avx2.c) share: how a
 * step's chunks are cut into tasks, and which keys the query rows of a task see: causal,
 * aligned to the bottom right (the query at position p sees keys 0..p), and with a sliding
 * window (`window` > 0) only the keys less than `window` before it. A task's rows are
 * consecutive queries, one per vector lane.
 */
#ifndef CHUNKSERVE_CHUNK_MASKS_H
#define CHUNKSERVE_CHUNK_MASKS_H
#include <stdint.h>
#include <stdlib.h>

/* Tasks: one per tile of `tile` query rows and KV head of each chunk, chunk by chunk. Returns
 * first[] (malloc'd; first[s]: chunk s's first task; first[num_seqs]: the count), or NULL. */
static inline int64_t *plan_tile_tasks(const int64_t *q_lens, int64_t num_seqs,
                                       int64_t kv_heads, int64_t tile)
{
    int64_t *first = malloc(sizeof(int64_t) * (num_seqs + 1));
    if (first == NULL)
        return NULL;
    first[0] = 0;
    for (int64_t s = 0; s < num_seqs; s++)
        first[s + 1] = first[s] + (q_lens[s] + tile - 1) / tile * kv_heads;
    return first;
}

/* Task t's chunk (*s), KV head (*kv_head) and first query row (*i0). A chunk's longest tiles
 * (its last rows, which see the most keys) come first, so dynamic scheduling ends evenly. */
static inline void tile_task(const int64_t *first, const int64_t *q_lens, int64_t t,
                             int64_t tile, int64_t kv_heads, int64_t *s, int64_t *kv_head,
                             int64_t *i0)
{
    int64_t c = 0;
    while (first[c + 1] <= t)
        c++;
    const int64_t task = t - first[c], tiles = (q_lens[c] + tile - 1) / tile;
    *s = c;
    *kv_head = task % kv_heads;
    *i0 = (tiles - 1 - task / kv_heads) * tile;
}

/* The oldest key the query at position pos0 sees: a task whose first row is there never reads
 * a key (nor its block, which the KV cache may have freed) before it. */
static inline int64_t first_visible_key(int64_t pos0, int64_t window)
{
    return window > 0 && pos0 >= window ? pos0 - window + 1 : 0;
}

/* The bits of the `lanes` rows (lane i: the query at position pos0 + i) that see key j, the
 * jj-th of a step of n real keys (keys past n are padding, seen by none). */
static inline __attribute__((always_inline)) uint32_t
visible_rows(int64_t j, int64_t pos0, int64_t jj, int64_t n, int64_t window, const int lanes)
{
    const uint32_t all = lanes == 32 ? 0xFFFFFFFFu : (1u << lanes) - 1;
    const int64_t first_lane = j - pos0; /* lanes before it are earlier queries: causal */
    if (jj >= n || first_lane >= lanes)
        return 0;
    uint32_t rows = first_lane <= 0 ? all : (all << first_lane) & all;
    if (window > 0) { /* lanes from first_lane + window on are too far past key j */
        const int64_t end_lane = first_lane + window;
        if (end_lane <= 0)
            return 0;
        if (end_lane < lanes)
            rows &= (1u << end_lane) - 1;
    }
    return rows;
}
/* 2^f for |f| <= 1/2 by its Taylor series to degree 6 (relative error < 2e-7), in Horner's
 * form over a vector type: `fma` and `set1` are the width's intrinsics (the kernels' exp). */
#define EXP2_TAYLOR6(fma, set1, f)                                                            \
    fma(fma(fma(fma(fma(fma(set1(1.5403530393381609e-4f), f, set1(1.3333558146428443e-3f)),  \
                        f, set1(9.6181291076284772e-3f)),                                    \
                    f, set1(5.5504108664821580e-2f)),                                        \
                f, set1(2.4022650695910071e-1f)),                                            \
            f, set1(6.9314718055994531e-1f)),                                                \
        f, set1(1.0f))
#endif
