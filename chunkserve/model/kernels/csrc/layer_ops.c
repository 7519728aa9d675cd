/* A decoder layer's small ops on the CPU, one call each instead of several PyTorch ops.
 *
 * At 64 decodes a step ran ~12 ms of them (torch.profiler: RMSNorm 36 us a call, RoPE 110 us,
 * SiLU-and-mul 44 us, residual adds, dtype casts), next to ~35 ms of GEMMs; at one decode each
 * op is mostly PyTorch's fixed cost per call. Each function here is one pass over its rows.
 * The arithmetic is float32, as in the PyTorch ops they replace; tensors are float32 or
 * bfloat16 (flag `bf16`: bfloat16 is only how values are stored, rounded to nearest even).
 * Rows are split over PyTorch's OpenMP threads (libgomp, see paged_decode.c) when there are
 * enough of them to pay for waking the threads.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "storage.h"
#include "team.h"

#define PARALLEL_MIN_ELEMENTS 32768 /* below this, one thread: a fork-join costs ~5-10 us */

/* Row t of add_rms_norm. */
static inline void add_rms_norm_row(float *h, const void *delta, int delta_bf16,
                                    const float *weight, void *out, int out_bf16, int64_t t,
                                    int64_t H, float eps)
{
    float *x = h + t * H, sum = 0.0f;
    if (delta != NULL)
        for (int64_t i = 0; i < H; i++)
            x[i] += load(delta, t * H + i, delta_bf16);
    for (int64_t i = 0; i < H; i++)
        sum += x[i] * x[i];
    const float inv = 1.0f / sqrtf(sum / (float)H + eps);
    for (int64_t i = 0; i < H; i++)
        store(out, t * H + i, x[i] * inv * weight[i], out_bf16);
}

/* h[t] += delta[t] (when delta is not NULL; delta stored as `delta_bf16` says), then
 * out[t] = h[t] / rms(h[t]) * weight, for T rows of H. h and weight float32; out as `out_bf16`.
 * The residual stream stays float32 (h); delta is a linear layer's output. */
void add_rms_norm(float *h, const void *delta, int64_t delta_bf16, const float *weight,
                  void *out, int64_t out_bf16, int64_t T, int64_t H, float eps,
                  int64_t num_threads)
{
#pragma omp parallel for num_threads(num_threads) if (T * H >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < T; t++)
        add_rms_norm_row(h, delta, (int)delta_bf16, weight, out, (int)out_bf16, t, H, eps);
}

void add_rms_norm_team(float *h, const float *delta, const float *weight, float *out,
                       int64_t T, int64_t H, float eps)
{
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++)
        add_rms_norm_row(h, delta, 0, weight, out, 0, t, H, eps);
}

/* Row t of silu_and_mul. */
static inline void silu_and_mul_row(const void *gate_up, void *out, int bf16, int64_t t,
                                    int64_t I)
{
    for (int64_t i = 0; i < I; i++) {
        const float g = load(gate_up, t * 2 * I + i, bf16);
        const float u = load(gate_up, t * 2 * I + I + i, bf16);
        store(out, t * I + i, g / (1.0f + expf(-g)) * u, bf16);
    }
}

/* out[t] = silu(gate_up[t, :I]) * gate_up[t, I:], for T rows; in and out share `bf16`. */
void silu_and_mul(const void *gate_up, void *out, int64_t bf16, int64_t T, int64_t I,
                  int64_t num_threads)
{
#pragma omp parallel for num_threads(num_threads) if (T * I >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < T; t++)
        silu_and_mul_row(gate_up, out, (int)bf16, t, I);
}

void silu_and_mul_team(const float *gate_up, float *out, int64_t T, int64_t I)
{
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++)
        silu_and_mul_row(gate_up, out, 0, t, I);
}

#define MAX_HEAD_DIM 512 /* a head is normed and rotated in a stack buffer (the caller checks) */

/* One head of D values from `src` (stored as `src_bf16` says) to `dst` (`dst_bf16`):
 * RMSNorm'd first when `norm` is not NULL (Qwen3's per-head q/k norm, float32 weights), then
 * NeoX-style RoPE (rotate half) over its first R values with cos/sin [R / 2]; values past R
 * (partial rotary) pass through. */
static inline void rope_head(const void *src, int64_t s, int src_bf16, void *dst, int64_t d,
                             int dst_bf16, int64_t D, int64_t R, const float *cos,
                             const float *sin, const float *norm, float eps)
{
    float x[MAX_HEAD_DIM];
    for (int64_t i = 0; i < D; i++)
        x[i] = load(src, s + i, src_bf16);
    if (norm != NULL) {
        float sum = 0.0f;
        for (int64_t i = 0; i < D; i++)
            sum += x[i] * x[i];
        const float inv = 1.0f / sqrtf(sum / (float)D + eps);
        for (int64_t i = 0; i < D; i++)
            x[i] = x[i] * inv * norm[i];
    }
    const int64_t half = R / 2;
    for (int64_t i = 0; i < half; i++) {
        store(dst, d + i, x[i] * cos[i] - x[half + i] * sin[i], dst_bf16);
        store(dst, d + half + i, x[half + i] * cos[i] + x[i] * sin[i], dst_bf16);
    }
    for (int64_t i = R; i < D; i++)
        store(dst, d + i, x[i], dst_bf16);
}

/* Splits a fused QKV projection [T, (heads + 2 kv_heads) * D] into contiguous q [T, heads, D],
 * k and v [T, kv_heads, D], rotating the first R values of each q and k head by their token's
 * cos/sin rows [T, R / 2] (float32), after an RMSNorm of each head by q_norm / k_norm [D]
 * where those are not NULL. All of q, k, v and qkv share `bf16`; D <= MAX_HEAD_DIM. */
void rope_split_qkv(const void *qkv, const float *cos, const float *sin, void *q, void *k,
                    void *v, int64_t bf16, int64_t T, int64_t heads, int64_t kv_heads,
                    int64_t D, int64_t R, const float *q_norm, const float *k_norm, float eps,
                    int64_t num_threads)
{
    const int64_t width = (heads + 2 * kv_heads) * D, elem = bf16 ? 2 : 4;
    const int b = (int)bf16;
#pragma omp parallel for num_threads(num_threads) if (T * width >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * (R / 2), *s = sin + t * (R / 2);
        for (int64_t h = 0; h < heads; h++)
            rope_head(qkv, t * width + h * D, b, q, (t * heads + h) * D, b, D, R, c, s, q_norm,
                      eps);
        for (int64_t h = 0; h < kv_heads; h++)
            rope_head(qkv, t * width + (heads + h) * D, b, k, (t * kv_heads + h) * D, b, D, R,
                      c, s, k_norm, eps);
        memcpy((char *)v + t * kv_heads * D * elem,
               (const char *)qkv + (t * width + (heads + kv_heads) * D) * elem,
               kv_heads * D * elem);
    }
}

void rope_qkv_to_cache_team(const float *qkv, const float *cos, const float *sin, void *q,
                            int64_t q_bf16, void *k_cache, void *v_cache, int64_t kv_bf16,
                            const int64_t *slots, int64_t T, int64_t heads, int64_t kv_heads,
                            int64_t D, int64_t R, const float *q_norm, const float *k_norm,
                            float eps)
{
    const int64_t width = (heads + 2 * kv_heads) * D, row = kv_heads * D;
    const int b = (int)kv_bf16;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * (R / 2), *s = sin + t * (R / 2);
        for (int64_t h = 0; h < heads; h++)
            rope_head(qkv, t * width + h * D, 0, q, (t * heads + h) * D, (int)q_bf16, D, R, c, s,
                      q_norm, eps);
        if (slots[t] < 0)
            continue; /* a padding token's */
        for (int64_t h = 0; h < kv_heads; h++)
            rope_head(qkv, t * width + (heads + h) * D, 0, k_cache, slots[t] * row + h * D, b,
                      D, R, c, s, k_norm, eps);
        const float *v = qkv + t * width + (heads + kv_heads) * D;
        for (int64_t i = 0; i < row; i++)
            store(v_cache, slots[t] * row + i, v[i], b);
    }
}

/* k_cache[slots[t]] = k[t] and v_cache[slots[t]] = v[t] for T rows of `row_bytes`: the new
 * tokens' K/V into the paged caches, viewed as [num_blocks * block_size] rows. Slot -1 is a
 * padding token's: skipped. */
void write_kv(void *k_cache, void *v_cache, const void *k, const void *v, const int64_t *slots,
              int64_t T, int64_t row_bytes)
{
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0)
            continue;
        memcpy((char *)k_cache + slots[t] * row_bytes, (const char *)k + t * row_bytes, row_bytes);
        memcpy((char *)v_cache + slots[t] * row_bytes, (const char *)v + t * row_bytes, row_bytes);
    }
}
