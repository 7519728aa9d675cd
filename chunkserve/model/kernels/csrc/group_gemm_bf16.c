/* y = x . W^T for weights quantized in groups of 32 along K, bfloat16 activations, on CPUs with
 * AVX512_BF16: the decode-sized GEMMs of int4 and int8 layers (model/layers/linear_int4.py,
 * model/layers/linear.py). Two formats, GGUF's blocks:
 *   int4 (Q4_1): w = minimum + level * scale, levels 0..15;
 *   int8 (Q8_0): w = scale * level, levels -127..127.
 *
 * Why not PyTorch's kernels (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`), as before:
 * on a Zen 5 the int4 one read SmolLM2's 66 MB of int4 weights at ~21 GB/s for one row and did
 * not get faster per row with more (8 rows took 2.6x one row's time: it unpacks the levels for
 * every row); the int8 one has one scale per output channel, the largest error left in the
 * default model's logits (its Q8_0 head re-quantized per channel: docs/performance.md).
 *
 * The weights are laid out 16 output channels (vector lanes) at a time, per group:
 *   int4  qw [N/16, K/32, 16 pairs, 16 channels] bytes: byte (p, n) holds the levels of inputs
 *         2p (low nibble) and 2p+1 (high nibble) of the group for channel n;
 *         sc [N/16, K/32, 2, 16] float16: the group's scale, then its minimum, per channel;
 *   int8  qw [N/16, K/32, 16 pairs, 16 channels, 2] int8 levels (inputs 2p, 2p+1);
 *         sc [N/16, K/32, 16] float16 scales.
 * (float16 as GGUF stores them: exact for a Q4_0/Q4_1/Q8_0 file.)
 * int4: a level q becomes the bfloat16 number 128 + q by OR-ing its bits into 0x4300 (q < 128
 * fits the 7-bit mantissa exactly), so one vdpbf16ps multiplies 16 channels' pairs of levels by
 * a broadcast pair of x and sums sum_k x_k (128 + q_k) exactly into float32; per group,
 *   y += scale * (that - 128 sum_k x_k) + minimum * sum_k x_k
 * with the group sums of x taken once per call. int8: levels are exact in bf16 too, widened
 * to bf16 pairs once per pass (no trick needed) for the same vdpbf16ps; per group
 * y += scale * sum_k x_k q_k.
 * Each line of levels serves every row of x in a pass (up to ROWS rows), so more rows cost
 * mostly multiplies, not bytes. Tasks: one per 16 output channels, statically spread.
 *
 * x [M, K] bfloat16, y [M, N] bfloat16 or float32 (flag y_bf16); K % 32 == 0, N % 16 == 0.
 * Returns 0; 1 if a buffer could not be allocated; 2 if this build has no AVX512_BF16 or bits
 * is neither 4 nor 8.
 */
#include <stdint.h>
#include <stdlib.h>

#define GROUP 32
#define LANES 16
#define ROWS 16 /* rows of x a pass takes: their group sums in registers */
#define REG_ROWS 8 /* passes of up to this many rows keep their outputs in registers too */

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_GROUP_KERNEL 1

/* int4: rows m0 .. m0+R-1 of y for channels 16b .. 16b+15; R is a constant, so the row loops unroll
 * and the R group accumulators stay in registers, and up to REG_ROWS rows the outputs too
 * (with 16 rows they live in out: 24 ms against 27 for passes of 8 rows at 64 rows, but 5%
 * slower at 1-4 rows). One accumulator a row: more, to shorten vdpbf16ps's dependency chains,
 * measured slower at every row count. xs: [M, K/32] group sums of x; out: [R, 16]. */
static inline __attribute__((always_inline)) void
int4_block(const uint16_t *x, int64_t K, const uint8_t *qw, const uint16_t *sc,
              const float *xs, int64_t m0, const int R, float *out)
{
    const int64_t groups = K / GROUP;
    const __m512i nibbles = _mm512_set1_epi32(0x000F000F);
    const __m512i bias = _mm512_set1_epi32(0x43004300); /* bf16 128.0 in both halves */
    __m512 y[REG_ROWS]; /* the outputs, in registers up to REG_ROWS rows, else in out */
    for (int r = 0; r < R; r++)
        if (R <= REG_ROWS)
            y[r] = _mm512_setzero_ps();
        else
            _mm512_store_ps(out + r * LANES, _mm512_setzero_ps());
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *q = qw + g * (GROUP / 2) * LANES;
        __m512 acc[ROWS];
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_setzero_ps();
        for (int p = 0; p < GROUP / 2; p++) {
            const __m128i bytes = _mm_load_si128((const __m128i *)(q + p * LANES));
            const __m512i b = _mm512_cvtepu8_epi32(bytes);
            /* dword n = (128 + level of 2p) | (128 + level of 2p+1) << 16, as two bf16:
             * low nibble to bits 0-3, high nibble to bits 16-19, then 0x4300 in each half. */
            const __m512i t = _mm512_or_si512(b, _mm512_slli_epi32(b, 12));
            const __m512i w = _mm512_ternarylogic_epi32(t, nibbles, bias, 0xEA); /* t&n | b */
            for (int r = 0; r < R; r++)
                acc[r] = _mm512_dpbf16_ps(
                    acc[r], (__m512bh)w,
                    (__m512bh)_mm512_set1_epi32(
                        *(const int32_t *)(x + (m0 + r) * K + g * GROUP + 2 * p)));
        }
        const __m512 scale = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(sc + g * 32)));
        const __m512 minimum =
            _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(sc + g * 32 + LANES)));
        /* minimum * xs + scale * (acc - 128 xs) = scale * acc + (minimum - 128 scale) * xs */
        const __m512 shift = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), scale, minimum);
        for (int r = 0; r < R; r++) {
            const __m512 before = R <= REG_ROWS ? y[r] : _mm512_load_ps(out + r * LANES);
            const __m512 after = _mm512_fmadd_ps(
                shift, _mm512_set1_ps(xs[(m0 + r) * groups + g]),
                _mm512_fmadd_ps(scale, acc[r], before));
            if (R <= REG_ROWS)
                y[r] = after;
            else
                _mm512_store_ps(out + r * LANES, after);
        }
    }
    if (R <= REG_ROWS)
        for (int r = 0; r < R; r++)
            _mm512_store_ps(out + r * LANES, y[r]);
}

/* int8: rows m0 .. m0+R-1 of y for channels 16b .. 16b+15, as int4_block. Levels -127..127 are
 * exact in bfloat16 (8 significant bits), so each pair of inputs is widened once, to float32
 * and packed to bf16 pairs (vcvtne2ps2bf16 keeps the pair-interleaved order), and serves every
 * row with one vdpbf16ps. */
static inline __attribute__((always_inline)) void
int8_block(const uint16_t *x, int64_t K, const int8_t *qw, const uint16_t *sc, int64_t m0,
           const int R, float *out)
{
    __m512 y[REG_ROWS];
    for (int r = 0; r < R; r++)
        if (R <= REG_ROWS)
            y[r] = _mm512_setzero_ps();
        else
            _mm512_store_ps(out + r * LANES, _mm512_setzero_ps());
    for (int64_t g = 0; g < K / GROUP; g++) {
        const int8_t *q = qw + g * GROUP * LANES;
        __m512 acc[ROWS];
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_setzero_ps();
        for (int p = 0; p < GROUP / 2; p++) {
            /* 32 bytes: (input 2p, input 2p+1) for channels 0..15 */
            const __m512 lo = _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_load_si128((const __m128i *)(q + p * 2 * LANES))));
            const __m512 hi = _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_load_si128((const __m128i *)(q + p * 2 * LANES + 16))));
            const __m512bh w = _mm512_cvtne2ps_pbh(hi, lo);
            for (int r = 0; r < R; r++)
                acc[r] = _mm512_dpbf16_ps(
                    acc[r], w,
                    (__m512bh)_mm512_set1_epi32(
                        *(const int32_t *)(x + (m0 + r) * K + g * GROUP + 2 * p)));
        }
        const __m512 scale = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(sc + g * LANES)));
        for (int r = 0; r < R; r++)
            if (R <= REG_ROWS)
                y[r] = _mm512_fmadd_ps(scale, acc[r], y[r]);
            else
                _mm512_store_ps(out + r * LANES,
                                _mm512_fmadd_ps(scale, acc[r], _mm512_load_ps(out + r * LANES)));
    }
    if (R <= REG_ROWS)
        for (int r = 0; r < R; r++)
            _mm512_store_ps(out + r * LANES, y[r]);
}

/* One pass of `rows` (1..ROWS) rows, R made a compile-time constant. xs: the group sums of x
 * (int4 only). */
static void channel_rows(int bits, const uint16_t *x, int64_t K, const void *qw,
                         const uint16_t *sc, const float *xs, int64_t m0, int64_t rows,
                         float *out)
{
    switch (rows) {
#define CASE(n)                                                                                   \
    case n:                                                                                       \
        if (bits == 4)                                                                            \
            int4_block(x, K, qw, sc, xs, m0, n, out);                                             \
        else                                                                                      \
            int8_block(x, K, qw, sc, m0, n, out);                                                 \
        break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
        CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
#undef CASE
    }
}

static void group_sums(const uint16_t *x, int64_t M, int64_t K, float *xs)
{
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < K / GROUP; g++) {
            const __m512i a = _mm512_loadu_si512(x + m * K + g * GROUP); /* 32 bf16 */
            const __m512 lo = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(a)), 16));
            const __m512 hi = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(a, 1)), 16));
            xs[m * (K / GROUP) + g] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
        }
}
#else
#define HAVE_GROUP_KERNEL 0
#endif

int group_gemm_bf16_supported(void) { return HAVE_GROUP_KERNEL; }

int group_gemm_bf16(void *y, int64_t y_bf16, const void *x, int64_t M, int64_t K, const void *qw,
                    const void *sc, int64_t N, int64_t bits, int64_t num_threads)
{
#if HAVE_GROUP_KERNEL
    if (bits != 4 && bits != 8)
        return 2;
    float *xs = NULL; /* int4: the group sums of x [M, K/32] */
    if (bits == 4) {
        xs = malloc(sizeof(float) * M * (K / GROUP));
        if (xs == NULL)
            return 1;
        group_sums(x, M, K, xs);
    }
    const int64_t level_bytes = bits == 4 ? K / 2 : K;
    const int64_t scales = bits == 4 ? 2 * K / GROUP : K / GROUP; /* (and minimums) a channel */
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < N / LANES; b++) {
        const uint8_t *q = (const uint8_t *)qw + b * level_bytes * LANES;
        const uint16_t *s = (const uint16_t *)sc + b * scales * LANES;
        float out[ROWS * LANES] __attribute__((aligned(64)));
        for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
            const int64_t rows = M - m0 < ROWS ? M - m0 : ROWS;
            channel_rows((int)bits, x, K, q, s, xs, m0, rows, out);
            for (int64_t r = 0; r < rows; r++) {
                const __m512 v = _mm512_load_ps(out + r * LANES);
                const int64_t at = (m0 + r) * N + b * LANES;
                if (y_bf16)
                    _mm256_storeu_si256((__m256i *)((uint16_t *)y + at),
                                        (__m256i)_mm512_cvtneps_pbh(v));
                else
                    _mm512_storeu_ps((float *)y + at, v);
            }
        }
    }
    free(xs);
    return 0;
#else
    (void)y, (void)y_bf16, (void)x, (void)M, (void)K, (void)qw, (void)sc, (void)N, (void)bits,
        (void)num_threads;
    return 2;
#endif
}
