/* y = x . W^T for weights quantized in groups of 32 along K, on CPUs with AVX2 (x86-64-v3: AVX2,
 * FMA, F16C), float32 activations: the decode-sized GEMMs of int4 and int8 layers where there is
 * no AVX512_BF16 (group_gemm_bf16.c is that path). The same two formats, GGUF's blocks:
 *   int4 (Q4_1): w = minimum + level * scale, levels 0..15;
 *   int8 (Q8_0): w = scale * level, levels -127..127.
 *
 * Why integer dot products: AVX2's float FMA does 8 multiply-adds an instruction, its byte
 * multiply-add (vpmaddubsw) 32, and a 4-bit level must be widened to float before an FMA can use
 * it, an instruction or two per 8 weights that a decode row cannot share. So, as llama.cpp does
 * for its Q4_1 x Q8_1 and Q8_0 x Q8_0 dot products, each row of x is first quantized to int8 in
 * groups of 32 (a scale d = max|x| / 127 per group, and the group's float sum for the
 * minimums), and a group's dot product of 32 levels is summed exactly in int32:
 *   int4: y += scale * d * sum_k (level_k - 8) xq_k + (minimum + 8 scale) * sum_k x_k
 *   int8: y += scale * d * sum_k level_k xq_k
 * (int4 levels are centred, as level - 8, so that x's rounding errors meet weights of either
 * sign, as int8's do: with levels 0..15 they all add up one way, measured to double the
 * error. sum_k (level_k - 8) xq_k is the int32 sum of level_k xq_k less 8 sum_k xq_k.)
 * The error against float32 activations is int8's rounding of x, ~0.3% of a group's largest
 * value, the same as llama.cpp's on these formats.
 *
 * Layout: 8 output channels (float32 lanes) at a time, per group, 4 consecutive inputs a
 * channel per 32-bit lane, the order vpmaddubsw + vpmaddwd sum in:
 *   int4  qw [N/8, K/32, 8 quads, 16 bytes]: in quad j (inputs 4j..4j+3 of the group), byte b
 *         holds channel b/4's level of input 4j + b%4 in its low nibble and channel 4 + b/4's
 *         in its high nibble: one load, a shift and a mask give the 32 levels of a quad;
 *         sc [N/8, K/32, 2, 8] float16: the group's scale, then its minimum, per channel;
 *   int8  qw [N/8, K/32, 8 quads, 32 bytes]: byte 4c + i = channel c's level of input 4j + i;
 *         sc [N/8, K/32, 8] float16 scales.
 * vpmaddubsw takes unsigned bytes times signed ones: int4 levels are unsigned already; int8
 * levels give their magnitude, and x takes their sign (vpsignb), as llama.cpp does. int4's
 * pair sums stay in int16 for a whole group (no overflow at 15 x 127) and are widened once a
 * group; int8's (up to 2 x 127 x 127) are widened every quad.
 * Each quad's levels serve every row of a pass (up to ROWS rows, whose sums and outputs stay
 * in registers). Tasks: one per 8 output channels, statically spread.
 * int4 from WIDE_MIN_ROWS rows on (prefill chunks) takes another path: a task of 16 channels
 * unpacks its levels to bytes once, then runs every row through them (see unpack_int4).
 *
 * x [M, K] float32, y [M, N] float32; K % 32 == 0, N % 8 == 0.
 * Returns 0; 1 if a buffer could not be allocated; 2 if this build has no AVX2/FMA/F16C or
 * bits is neither 4 nor 8.
 */
#include <stdint.h>
#include <stdlib.h>

#include "team.h"

#define GROUP 32
#define LANES 8
/* Rows a pass: 4 sums + 4 outputs + the levels stay in 16 registers. -DROWS=6 or 8 builds
 * the others for tuning; on SmolLM2's shapes (AVX2 build on a Zen 4) neither was faster
 * beyond the noise at 1-64 rows. */
#ifndef ROWS
#define ROWS 4
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define HAVE_AVX2_KERNEL 1

/* An empty instruction that reads and writes *a in a register: placed after each quad, it keeps
 * the sums where they are. Without it GCC unrolls a group's 8 quads, reassociates the integer
 * sums into a tree, and spills every product to the stack first: 1.3x slower at 256 rows
 * (docs/performance.md, issue 33). */
static inline __attribute__((always_inline)) void keep_in_register(__m256i *a)
{
    __asm__("" : "+x"(*a));
}

/* Row m of x, group by group: xq the levels (int8), d the scale, s the float sum, c the
 * centring term of int4 levels, 8 d sum_k xq_k. */
static void quantize_row(const float *x, int64_t K, int8_t *xq, float *d, float *s, float *c)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t g = 0; g < K / GROUP; g++) {
        const float *v = x + g * GROUP;
        __m256 a[4], top = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            a[i] = _mm256_loadu_ps(v + 8 * i);
            top = _mm256_max_ps(top, _mm256_andnot_ps(sign, a[i]));
            sum = _mm256_add_ps(sum, a[i]);
        }
        __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
        t = _mm_max_ps(t, _mm_movehl_ps(t, t));
        t = _mm_max_ss(t, _mm_movehdup_ps(t));
        const float amax = _mm_cvtss_f32(t);
        __m128 u = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
        u = _mm_add_ps(u, _mm_movehl_ps(u, u));
        u = _mm_add_ss(u, _mm_movehdup_ps(u));
        d[g] = amax / 127.0f;
        s[g] = _mm_cvtss_f32(u);
        const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        __m256i q[4];
        for (int i = 0; i < 4; i++) /* rounds to nearest even, as the reference does */
            q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(a[i], inv));
        const __m256i qs = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]),
                                            _mm256_add_epi32(q[2], q[3]));
        __m128i h = _mm_add_epi32(_mm256_castsi256_si128(qs), _mm256_extracti128_si256(qs, 1));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
        c[g] = 8.0f * d[g] * (float)_mm_cvtsi128_si32(h);
        /* packs work within 128-bit lanes: the permute puts the 32 bytes back in order */
        const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                             _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)(xq + g * GROUP), _mm256_permutevar8x32_epi32(w, order));
    }
}

/* Rows m0 .. m0+R-1 of y for channels 8b .. 8b+7 (R a constant: the row loops unroll).
 * qw, sc: this block's levels and scales; xq [M, K], d, s and c [M, K/32]; out: [R, 8]. */
static inline __attribute__((always_inline)) void
block_rows(int bits, const int8_t *xq, const float *d, const float *s, const float *c, int64_t K,
           const uint8_t *qw, const uint16_t *sc, int64_t m0, const int R, float *out)
{
    const int64_t groups = K / GROUP;
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 y[ROWS];
    for (int r = 0; r < R; r++)
        y[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256i acc[ROWS];
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_setzero_si256();
        for (int j = 0; j < GROUP / 4; j++) {
            __m256i w, sign = _mm256_setzero_si256();
            if (bits == 4) {
                const __m128i b = _mm_loadu_si128((const __m128i *)(qw + (g * 8 + j) * 16));
                w = _mm256_and_si256(
                    _mm256_inserti128_si256(_mm256_castsi128_si256(b), _mm_srli_epi16(b, 4), 1),
                    low4);
            } else {
                sign = _mm256_loadu_si256((const __m256i *)(qw + (g * 8 + j) * 32));
                w = _mm256_abs_epi8(sign);
            }
            for (int r = 0; r < R; r++) {
                __m256i xv = _mm256_set1_epi32(
                    *(const int32_t *)(xq + (m0 + r) * K + g * GROUP + 4 * j));
                if (bits == 8) {
                    xv = _mm256_sign_epi8(xv, sign);
                    acc[r] = _mm256_add_epi32(
                        acc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones));
                } else { /* int16 sums: 16 products of 15 x 127 at most, 30,480 < 2^15 */
                    acc[r] = _mm256_add_epi16(acc[r], _mm256_maddubs_epi16(w, xv));
                }
            }
            for (int r = 0; r < R; r++)
                keep_in_register(&acc[r]);
        }
        if (bits == 4) /* each channel's two int16 halves into its int32 lane, once a group */
            for (int r = 0; r < R; r++)
                acc[r] = _mm256_madd_epi16(acc[r], ones);
        const uint16_t *gs = sc + g * (bits == 4 ? 2 * LANES : LANES);
        const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)gs));
        /* int4: the minimum of centred levels, minimum + 8 scale */
        const __m256 minimum = bits == 4
            ? _mm256_fmadd_ps(_mm256_set1_ps(8.0f), scale,
                              _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(gs + LANES))))
            : _mm256_setzero_ps();
        for (int r = 0; r < R; r++) {
            const int64_t at = (m0 + r) * groups + g;
            if (bits == 4) {
                const __m256 dot = _mm256_fmsub_ps(_mm256_set1_ps(d[at]),
                                                   _mm256_cvtepi32_ps(acc[r]),
                                                   _mm256_set1_ps(c[at]));
                y[r] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(s[at]),
                                       _mm256_fmadd_ps(scale, dot, y[r]));
            } else {
                y[r] = _mm256_fmadd_ps(_mm256_mul_ps(scale, _mm256_set1_ps(d[at])),
                                       _mm256_cvtepi32_ps(acc[r]), y[r]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        _mm256_storeu_ps(out + r * LANES, y[r]);
}

/* ---- int4 at prefill sizes: levels unpacked once a task, tiles of TROWS rows x 16 channels ----
 * With many rows, unpacking a quad's nibbles again for every pass of ROWS rows (a shift, an
 * insert and a mask per 8 channels) and broadcasting each row's x once per 8 channels cost more
 * than the multiply-adds. So from WIDE_MIN_ROWS rows on, a task takes WIDE blocks of 8 channels,
 * unpacks their levels to bytes and their scales to float32 once into a buffer of its own
 * (K x 16 bytes: in L1 or L2), and runs every row through it, TROWS rows a tile: each x
 * broadcast serves WIDE multiply-adds, each weight vector TROWS. The 12 int16 sums and the 2
 * weight vectors of a quad fill the 16 registers; the tile's float32 outputs live in memory
 * (an L1 line a row), updated once a group. Sums, rounding and order of operations are the
 * other path's, so the two give the same bits. */
#define WIDE 2
#define TROWS 6
/* Below 20 rows (decode steps) the weights stream from DRAM once a call either way, and
 * unpacking them to the buffer first was slower: 16.0 against 12.8 ms at 8 rows, 26.7 against
 * 25.0 at 16, even at 20 (SmolLM2's 120 GEMMs, each its own weights, one core). From cache, at
 * 64-512 rows on 2 threads, the kernel with this path and keep_in_register takes 0.69-0.71 of
 * the time it took before both (docs/performance.md, issue 33). */
#define WIDE_MIN_ROWS 20

/* Blocks b .. b+V-1's levels as bytes lv [groups, 8 quads, V, 32], their scales fs and centred
 * minimums fm (minimum + 8 scale) as float32 [groups, V, 8]. qw, sc: block b's. */
static void unpack_int4(const uint8_t *qw, const uint16_t *sc, int64_t groups, int V,
                        int8_t *lv, float *fs, float *fm)
{
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int v = 0; v < V; v++) {
        const uint8_t *q = qw + v * groups * GROUP / 2 * LANES;
        const uint16_t *bs = sc + v * groups * 2 * LANES;
        for (int64_t g = 0; g < groups; g++) {
            for (int j = 0; j < GROUP / 4; j++) {
                const __m128i b = _mm_loadu_si128((const __m128i *)(q + (g * 8 + j) * 16));
                const __m256i w = _mm256_and_si256(
                    _mm256_inserti128_si256(_mm256_castsi128_si256(b), _mm_srli_epi16(b, 4), 1),
                    low4);
                _mm256_store_si256((__m256i *)(lv + ((g * 8 + j) * V + v) * 32), w);
            }
            const __m256 scale = _mm256_cvtph_ps(
                _mm_loadu_si128((const __m128i *)(bs + g * 2 * LANES)));
            const __m256 minimum = _mm256_cvtph_ps(
                _mm_loadu_si128((const __m128i *)(bs + g * 2 * LANES + LANES)));
            _mm256_store_ps(fs + (g * V + v) * LANES, scale);
            _mm256_store_ps(fm + (g * V + v) * LANES,
                            _mm256_fmadd_ps(_mm256_set1_ps(8.0f), scale, minimum));
        }
    }
}

/* Rows m0 .. m0+R-1 of y, channels n0 .. n0+8V-1, from a task's unpacked levels (R and V
 * constants: the loops unroll). y [M, N]. */
static inline __attribute__((always_inline)) void
tile_int4(const int8_t *lv, const float *fs, const float *fm, const int8_t *xq, const float *d,
          const float *s, const float *c, int64_t K, int64_t m0, const int R, const int V,
          const int centred, float *y, int64_t N, int64_t n0)
{
    const int64_t groups = K / GROUP;
    const __m256i ones = _mm256_set1_epi16(1);
    float out[TROWS * WIDE * LANES] __attribute__((aligned(32)));
    for (int a = 0; a < R * V; a++)
        _mm256_store_ps(out + a * LANES, _mm256_setzero_ps());
    for (int64_t g = 0; g < groups; g++) {
        __m256i acc[TROWS * WIDE];
        for (int a = 0; a < R * V; a++)
            acc[a] = _mm256_setzero_si256();
        const int8_t *x = xq + m0 * K + g * GROUP;
        for (int j = 0; j < GROUP / 4; j++) {
            __m256i w[WIDE];
            for (int v = 0; v < V; v++)
                w[v] = _mm256_load_si256((const __m256i *)(lv + ((g * 8 + j) * V + v) * 32));
            for (int r = 0; r < R; r++) { /* int16 sums, as block_rows' */
                const __m256i xv = _mm256_set1_epi32(*(const int32_t *)(x + r * K + 4 * j));
                for (int v = 0; v < V; v++)
                    acc[r * V + v] = _mm256_add_epi16(acc[r * V + v],
                                                      _mm256_maddubs_epi16(w[v], xv));
            }
            for (int a = 0; a < R * V; a++)
                keep_in_register(&acc[a]);
        }
        for (int r = 0; r < R; r++) { /* block_rows' float32 steps, in its order */
            const int64_t at = (m0 + r) * groups + g;
            const __m256 dr = _mm256_set1_ps(d[at]), cr = _mm256_set1_ps(c[at]),
                         sr = _mm256_set1_ps(s[at]);
            for (int v = 0; v < V; v++) {
                float *o = out + (r * V + v) * LANES;
                const __m256 dot = _mm256_fmsub_ps(
                    dr, _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[r * V + v], ones)), cr);
                const __m256 scaled = _mm256_fmadd_ps(
                    _mm256_load_ps(fs + (g * V + v) * LANES), dot, _mm256_load_ps(o));
                /* centred: every minimum term is 0 (Q4_0's blocks, minimum = -8 scale), and
                 * 0 * s + scaled is scaled, bit for bit: a load and an FMA saved */
                _mm256_store_ps(o, centred ? scaled
                                           : _mm256_fmadd_ps(
                                                 _mm256_load_ps(fm + (g * V + v) * LANES),
                                                 sr, scaled));
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++)
            _mm256_storeu_ps(y + (m0 + r) * N + n0 + v * LANES,
                             _mm256_load_ps(out + (r * V + v) * LANES));
}

/* Every row of x through a task's unpacked levels (V a constant), TROWS rows a tile. */
static inline __attribute__((always_inline)) void
rows_int4(const int8_t *lv, const float *fs, const float *fm, const int8_t *xq, const float *d,
          const float *s, const float *c, int64_t M, int64_t K, const int V, const int centred,
          float *y, int64_t N, int64_t n0)
{
    int64_t m0 = 0;
    for (; m0 + TROWS <= M; m0 += TROWS)
        tile_int4(lv, fs, fm, xq, d, s, c, K, m0, TROWS, V, centred, y, N, n0);
#define TAIL(n)                                                                                   \
    case n:                                                                                       \
        tile_int4(lv, fs, fm, xq, d, s, c, K, m0, n, V, centred, y, N, n0);                       \
        break;
    switch (M - m0) {
        TAIL(1) TAIL(2) TAIL(3) TAIL(4) TAIL(5)
    }
#undef TAIL
}

/* Whether all n floats are +0 or -0 (n % 8 == 0): a task's centred minimums, checked once
 * (K / 4 floats) before its rows use them M times. */
static int all_zero(const float *v, int64_t n)
{
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 any = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += LANES)
        any = _mm256_or_ps(any, _mm256_and_ps(_mm256_load_ps(v + i), magnitude));
    return _mm256_testz_si256(_mm256_castps_si256(any), _mm256_castps_si256(any));
}

/* The tasks of the int4 prefill path (this thread's share): WIDE blocks each, the last one
 * fewer when N / 8 is odd. Returns 1 if its buffer could not be allocated. */
static int wide_int4(const uint8_t *qw, const uint16_t *sc, const int8_t *xq, const float *d,
                     const float *s, const float *c, int64_t M, int64_t K, float *y, int64_t N)
{
    const int64_t groups = K / GROUP, blocks = N / LANES;
    int8_t *lv = aligned_alloc(32, K * LANES * WIDE);
    float *fs = aligned_alloc(32, sizeof(float) * 2 * groups * WIDE * LANES);
    const int failed = lv == NULL || fs == NULL;
    float *fm = failed ? NULL : fs + groups * WIDE * LANES;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < (blocks + WIDE - 1) / WIDE; t++) {
        const int64_t b = t * WIDE;
        const int V = blocks - b < WIDE ? (int)(blocks - b) : WIDE;
        if (failed)
            continue;
        unpack_int4(qw + b * K / 2 * LANES, sc + b * 2 * groups * LANES, groups, V, lv, fs, fm);
        if (V == WIDE && all_zero(fm, groups * V * LANES))
            rows_int4(lv, fs, fm, xq, d, s, c, M, K, WIDE, 1, y, N, b * LANES);
        else if (V == WIDE)
            rows_int4(lv, fs, fm, xq, d, s, c, M, K, WIDE, 0, y, N, b * LANES);
        else
            rows_int4(lv, fs, fm, xq, d, s, c, M, K, 1, 0, y, N, b * LANES);
    }
    free(lv), free(fs);
    return failed;
}

/* One pass of `rows` (1..ROWS) rows, with bits and R made compile-time constants. */
static void pass(int bits, const int8_t *xq, const float *d, const float *s, const float *c,
                 int64_t K,
                 const uint8_t *qw, const uint16_t *sc, int64_t m0, int64_t rows, float *out)
{
#define CASE(n)                                                                                   \
    case n:                                                                                       \
        if (bits == 4)                                                                            \
            block_rows(4, xq, d, s, c, K, qw, sc, m0, n, out);                                    \
        else                                                                                      \
            block_rows(8, xq, d, s, c, K, qw, sc, m0, n, out);                                    \
        break;
    switch (rows) {
        CASE(1) CASE(2) CASE(3) CASE(4)
#if ROWS > 4
        CASE(5) CASE(6)
#endif
#if ROWS > 6
        CASE(7) CASE(8)
#endif
    }
#undef CASE
}
/* The tasks of the path for every row count and both formats (this thread's share): one per 8
 * channels, ROWS rows a pass. */
static void blocks_of_8(int bits, const void *qw, const void *sc, const int8_t *xq,
                        const float *d, const float *s, const float *c, int64_t M, int64_t K,
                        float *y, int64_t N)
{
    const int64_t groups = K / GROUP;
    const int64_t level_bytes = bits == 4 ? K / 2 : K; /* a channel's */
    const int64_t scales = bits == 4 ? 2 * groups : groups; /* (and minimums) */
#pragma omp for schedule(static)
    for (int64_t b = 0; b < N / LANES; b++) {
        const uint8_t *q = (const uint8_t *)qw + b * level_bytes * LANES;
        const uint16_t *bs = (const uint16_t *)sc + b * scales * LANES;
        float out[ROWS * LANES];
        for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
            const int64_t rows = M - m0 < ROWS ? M - m0 : ROWS;
            pass(bits, xq, d, s, c, K, q, bs, m0, rows, out);
            for (int64_t r = 0; r < rows; r++)
                _mm256_storeu_ps(y + (m0 + r) * N + b * LANES, _mm256_loadu_ps(out + r * LANES));
        }
    }
}

/* This thread's share of the whole call: x quantized into xq/d/s/c, then the tasks. */
static int team_body(float *y, const float *x, int64_t M, int64_t K, const void *qw,
                     const void *sc, int64_t N, int bits, int8_t *xq, float *d)
{
    const int64_t groups = K / GROUP;
    float *s = d + M * groups, *c = s + M * groups;
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++)
        quantize_row(x + m * K, K, xq + m * K, d + m * groups, s + m * groups, c + m * groups);
    if (bits == 4 && M >= WIDE_MIN_ROWS)
        return wide_int4(qw, sc, xq, d, s, c, M, K, y, N);
    blocks_of_8(bits, qw, sc, xq, d, s, c, M, K, y, N);
    return 0;
}

#else
#define HAVE_AVX2_KERNEL 0
#endif

int group_gemm_avx2_supported(void) { return HAVE_AVX2_KERNEL; }

int group_gemm_avx2(float *y, const float *x, int64_t M, int64_t K, const void *qw,
                    const void *sc, int64_t N, int64_t bits, int64_t num_threads)
{
#if HAVE_AVX2_KERNEL
    if (bits != 4 && bits != 8)
        return 2;
    const int64_t groups = K / GROUP;
    int8_t *xq = malloc(M * K);
    float *d = malloc(sizeof(float) * 3 * M * groups); /* then s, then c */
    if (xq == NULL || d == NULL) {
        free(xq), free(d);
        return 1;
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        if (team_body(y, x, M, K, qw, sc, N, (int)bits, xq, d)) {
#pragma omp atomic write
            failed = 1;
        }
    }
    free(xq), free(d);
    return failed;
#else
    (void)y, (void)x, (void)M, (void)K, (void)qw, (void)sc, (void)N, (void)bits,
        (void)num_threads;
    return 2;
#endif
}

int group_gemm_avx2_team(float *y, const float *x, int64_t M, int64_t K, const void *qw,
                         const void *sc, int64_t N, int64_t bits, int8_t *xq, float *d)
{
#if HAVE_AVX2_KERNEL
    return team_body(y, x, M, K, qw, sc, N, (int)bits, xq, d);
#else
    (void)y, (void)x, (void)M, (void)K, (void)qw, (void)sc, (void)N, (void)bits, (void)xq,
        (void)d;
    return 1;
#endif
}
