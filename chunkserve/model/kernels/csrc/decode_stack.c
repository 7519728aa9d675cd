/* A decode step's whole decoder stack in one call: every layer of a Llama-shaped model whose
 * linears run on one group GEMM with a team entry (group_gemm_avx2.c: float32 activations;
 * group_gemm_vnni.c: float32 or bfloat16 ones), for steps whose tokens are all decodes
 * (model/fused_decode.py decides, and runs the embedding and the final norm around it).
 *
 * Why: at one decode a step, each of a layer's ~10 ops cost its time plus a fixed ~5-15 us in
 * Python, ctypes, a tensor allocation and an OpenMP fork-join; measured on a Zen 3 (SmolLM2,
 * 30 layers), a third of the step, with the second thread spinning idle meanwhile. Here one
 * parallel region runs all layers: each stage is the same kernel the op-by-op path calls (its
 * "team" entry, team.h), so the numbers are the same bit for bit, and the only cost between
 * stages is the barrier closing each stage's `omp for`.
 *
 * Per layer, with h the float32 residual stream [T, H] (updated in place):
 *   x = RMSNorm(h += mlp_out of the layer before) ; qkv = x W_qkv (+ bias)
 *   q = RoPE(q), K/V rows RoPE'd into the paged caches ; a = attention(q, caches)
 *   x = RMSNorm(h += a W_o (+ bias)) ; g = x W_gate_up ; mlp_out = (silu(g0) * g1) W_down
 * The last layer's mlp_out is left in `mlp_out` for the caller's final norm.
 *
 * A bfloat16 model (`act_bf16`, vnni GEMM only): the op-by-op path hands each op bfloat16
 * tensors, so the stack keeps q and the attention's output in bfloat16 (the attention kernel
 * takes its bfloat16 path, as op by op) and rounds the GEMM outputs to bfloat16's values (after
 * the bias, as PyTorch's bfloat16 add rounds); the norms' and SiLU's float32 outputs feed only
 * a GEMM, which rounds its rows to bfloat16 first, as the op-by-op path's rows are.
 */
#include <stdint.h>
#include <stdlib.h>

#include "storage.h"
#include "team.h"

typedef struct {
    const void *levels, *scales; /* the group GEMM's layout (group_gemm.py) */
    const float *bias; /* [n] or NULL */
    int64_t n, bits; /* output channels (no padding), 4 or 8 */
} StackLinear;

typedef struct {
    const float *input_norm, *post_norm; /* [H] */
    const float *q_norm, *k_norm; /* [D] each, or NULL */
    StackLinear qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* [blocks, block_size, kv_heads, D] */
} StackLayer;

enum { GEMM_AVX2 = 0, GEMM_VNNI = 1 };

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, rotary_dim, intermediate;
    int64_t kv_kind, block_size; /* storage.h's kind: float32 or bfloat16 */
    int64_t gemm, act_bf16; /* GEMM_*; whether the model's activations are bfloat16 */
    float eps, scale;
} StackShape;

/* The step's activations between stages; T rows each. */
typedef struct {
    float *x, *qkv, *q, *attn, *y, *gate_up, *act; /* (q, attn: bfloat16 where act_bf16) */
    int8_t *xq; /* the group GEMM's quantized rows, and their scales and sums (d: 3 floats a
                 * group of 32, as either GEMM's team entry takes them) */
    float *d;
} Workspace;

static void *alloc_workspace(Workspace *w, const StackShape *s, const StackLayer *l, int64_t T)
{
    const int64_t H = s->hidden, QD = s->heads * s->head_dim, I = s->intermediate;
    const int64_t k_max = H > QD ? (H > I ? H : I) : (QD > I ? QD : I);
    const int64_t floats = T * (H + l->qkv.n + 2 * QD + H + 2 * I + I) + 3 * T * k_max / 32;
    float *f = malloc(sizeof(float) * floats);
    int8_t *b = malloc(T * k_max);
    if (f == NULL || b == NULL) {
        free(f), free(b);
        return NULL;
    }
    w->x = f, w->qkv = w->x + T * H, w->q = w->qkv + T * l->qkv.n, w->attn = w->q + T * QD;
    w->y = w->attn + T * QD, w->gate_up = w->y + T * H, w->act = w->gate_up + T * 2 * I;
    w->d = w->act + T * I, w->xq = b;
    return f;
}

/* y = x W^T (+ bias), T rows of K inputs; x float32, or bfloat16 where `x_bf16` (the
 * attention's output in a bfloat16 model; only the vnni GEMM takes it). Returns nonzero in a
 * thread that failed. */
static int linear(const StackShape *s, const StackLinear *w, const void *x, int x_bf16,
                  float *y, int64_t T, int64_t K, const Workspace *ws)
{
    const int round = (int)s->act_bf16;
    const int failed =
        s->gemm == GEMM_VNNI
            ? group_gemm_vnni_team(y, x, x_bf16, T, K, w->levels, w->scales, w->n, w->bits,
                                   round, ws->xq, ws->d)
            : group_gemm_avx2_team(y, x, T, K, w->levels, w->scales, w->n, w->bits, ws->xq,
                                   ws->d);
    if (w->bias != NULL) {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < w->n; i++) {
                const float v = y[t * w->n + i] + w->bias[i];
                y[t * w->n + i] = round ? round_to_bf16(v) : v;
            }
    }
    return failed;
}

/* The per-step arguments of the attention stage (CpuMetadata.decode_args) and the slots. */
typedef struct {
    const int64_t *slots, *block_table, *seq_lens, *rows;
    int64_t table_width, num_seqs, window;
} StepAttention;

/* One layer, by every thread of the team. Returns nonzero in a thread that failed. */
static int layer(const StackShape *s, const StackLayer *l, const float *delta, float *h,
                 float *mlp_out, const float *cos, const float *sin, const StepAttention *a,
                 const DecodePlan *plan, float *scratch, const Workspace *w, int64_t T)
{
    const int64_t H = s->hidden, QD = s->heads * s->head_dim, I = s->intermediate;
    int failed = 0;
    add_rms_norm_team(h, delta, l->input_norm, w->x, T, H, s->eps);
    failed |= linear(s, &l->qkv, w->x, 0, w->qkv, T, H, w);
    rope_qkv_to_cache_team(w->qkv, cos, sin, w->q, s->act_bf16, l->k_cache, l->v_cache,
                           s->kv_kind == KIND_BF16, a->slots, T, s->heads, s->kv_heads,
                           s->head_dim, s->rotary_dim, l->q_norm, l->k_norm, s->eps);
    paged_decode_team(plan, scratch, w->attn, w->q, s->act_bf16, l->k_cache, l->v_cache,
                      s->kv_kind, a->block_table, a->table_width, a->seq_lens, a->rows, a->num_seqs,
                      a->window, s->heads, s->kv_heads, s->head_dim, s->block_size, s->scale);
    failed |= linear(s, &l->o, w->attn, (int)s->act_bf16, w->y, T, QD, w);
    add_rms_norm_team(h, w->y, l->post_norm, w->x, T, H, s->eps);
    failed |= linear(s, &l->gate_up, w->x, 0, w->gate_up, T, H, w);
    silu_and_mul_team(w->gate_up, w->act, T, I);
    failed |= linear(s, &l->down, w->act, 0, mlp_out, T, I, w);
    return failed;
}

/* Runs `num_layers` layers over T decode tokens. h [T, hidden] float32 in place; mlp_out
 * [T, hidden]: the last layer's MLP output (not yet added to h). cos/sin [T, rotary_dim / 2].
 * Returns 0, or 1 if a buffer could not be allocated (the outputs are then not to be used). */
int decode_stack(const StackShape *s, const StackLayer *layers, int64_t num_layers, float *h,
                 float *mlp_out, const float *cos, const float *sin, int64_t T,
                 const int64_t *slots, const int64_t *block_table, int64_t table_width,
                 const int64_t *seq_lens, const int64_t *rows, int64_t num_seqs, int64_t window,
                 int64_t num_threads)
{
    const StepAttention a = {slots, block_table, seq_lens, rows, table_width, num_seqs, window};
    Workspace w;
    void *block = alloc_workspace(&w, s, &layers[0], T);
    DecodePlan plan;
    if (block == NULL)
        return 1;
    if (decode_plan_init(&plan, seq_lens, num_seqs, window, s->heads, s->head_dim,
                         num_threads)) {
        free(block), free(w.xq);
        return 1;
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = decode_scratch(s->heads, s->kv_heads, s->head_dim);
        int mine = scratch == NULL;
        for (int64_t i = 0; i < num_layers; i++)
            mine |= layer(s, &layers[i], i == 0 ? NULL : mlp_out, h, mlp_out, cos, sin, &a,
                          &plan, scratch, &w, T);
        if (mine) {
#pragma omp atomic write
            failed = 1;
        }
        free(scratch);
    }
    decode_plan_free(&plan);
    free(block), free(w.xq);
    return failed;
}
