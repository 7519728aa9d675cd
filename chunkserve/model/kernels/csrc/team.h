/* The kernels' "team" entry points: the same work as their own calls, run by the threads of an
 * OpenMP parallel region the caller has already opened (each shares its loops with `omp for`,
 * whose closing barrier is also what orders one stage after the last). decode_stack.c runs a
 * whole decode step's layers in one such region: one fork, one ctypes call and no tensor
 * allocations a step, instead of a few of each per op. Every thread of the team must call
 * them, in the same order, with the same arguments (but its own scratch). Float32 activations.
 */
#ifndef CHUNKSERVE_TEAM_H
#define CHUNKSERVE_TEAM_H
#include <stdint.h>

/* layer_ops.c. h += delta (delta may be NULL), out = RMSNorm(h) * weight; T rows of H. */
void add_rms_norm_team(float *h, const float *delta, const float *weight, float *out,
                       int64_t T, int64_t H, float eps);
/* out[t] = silu(gate_up[t, :I]) * gate_up[t, I:]. */
void silu_and_mul_team(const float *gate_up, float *out, int64_t T, int64_t I);
/* rope_split_qkv's q ([T, heads, D], float32 or bfloat16 as a bfloat16 model's: `q_bf16`),
 * with each token's K and V rows written straight into the paged caches (float32 or
 * bfloat16: `kv_bf16`) at slots[t] (-1: skipped), rounded as write_kv's caller rounds them. */
void rope_qkv_to_cache_team(const float *qkv, const float *cos, const float *sin, void *q,
                            int64_t q_bf16, void *k_cache, void *v_cache, int64_t kv_bf16,
                            const int64_t *slots, int64_t T, int64_t heads, int64_t kv_heads,
                            int64_t D, int64_t R, const float *q_norm, const float *k_norm,
                            float eps);

/* group_gemm_avx2.c. y [M, N] = x [M, K] . W^T; xq [M, K] and d [3 M K / 32]: the caller's
 * scratch for x quantized. Returns 1 in a thread whose buffer could not be allocated. */
int group_gemm_avx2_team(float *y, const float *x, int64_t M, int64_t K, const void *qw,
                         const void *sc, int64_t N, int64_t bits, int8_t *xq, float *d);

/* group_gemm_vnni.c. The same, for its layout: x bfloat16 (`x_bf16`) or float32, rounded to
 * bfloat16 first (as the op-by-op path's rows are); y float32, rounded to bfloat16's values
 * where `round_out`; xq [M, K] and d [3 M K / 32] the caller's scratch. Returns 1 where this
 * build has no such kernel. */
int group_gemm_vnni_team(float *y, const void *x, int64_t x_bf16, int64_t M, int64_t K,
                         const void *qw, const void *sc, int64_t N, int64_t bits,
                         int64_t round_out, int8_t *xq, float *d);

/* paged_decode.c. A step's split of its decodes into tasks (the same for every layer that
 * shares the step's block tables and window), and the partial results of each task. */
typedef struct {
    int64_t part, tasks;
    int64_t *first; /* [num_seqs + 1]: decode s's first task */
    float *m, *l, *acc; /* [tasks, heads], [tasks, heads], [tasks, heads, head_dim] */
} DecodePlan;
int decode_plan_init(DecodePlan *p, const int64_t *seq_lens, int64_t num_seqs, int64_t window,
                     int64_t heads, int64_t head_dim, int64_t num_threads);
void decode_plan_free(DecodePlan *p);
/* A thread's scratch for paged_decode_team (free() it), or NULL. */
float *decode_scratch(int64_t heads, int64_t kv_heads, int64_t head_dim);
/* paged_decode_attention's work, queries and output (q, out: [T, heads, D]) float32 or
 * bfloat16 (`bf16`). */
void paged_decode_team(const DecodePlan *p, float *scratch, void *out, const void *q,
                       int64_t bf16, const void *k_cache, const void *v_cache, int64_t kv_kind,
                       const int64_t *block_table, int64_t table_width, const int64_t *seq_lens,
                       const int64_t *rows, int64_t num_seqs, int64_t window, int64_t heads,
                       int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale);
#endif
