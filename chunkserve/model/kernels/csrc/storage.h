/* How the CPU kernels' arrays are stored (included by each .c file): float32, bfloat16, or, for
 * KV caches only (`--kv-cache-dtype fp8*`), one byte per value in FP8 E4M3 or E5M2. Only storage:
 * the arithmetic is float32 (or bfloat16 products summed in float32). Rounding to bfloat16 is to
 * nearest even, as PyTorch's conversion; fp8 caches are written by PyTorch's conversion.
 *
 * The `kind` of an array is an int, as the Python side passes it (attention/cpu_backend.py's
 * STORAGE_KINDS): */
#ifndef CHUNKSERVE_STORAGE_H
#define CHUNKSERVE_STORAGE_H
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { KIND_F32 = 0, KIND_BF16 = 1, KIND_FP8_E4M3 = 2, KIND_FP8_E5M2 = 3 };

/* Every fp8 byte's value as bfloat16 bits, per format (E4M3, E5M2): exact, as bfloat16 holds
 * every fp8 value (3 or 2 mantissa bits, exponents within its range). Filled when the library
 * loads (storage.c's constructor), by the same rule as load32_bf16 below. The bytes that are NaN
 * or infinity in a format never occur in a cache (keys and values stay far below E4M3's 448 and
 * E5M2's 57344) and read as finite values past the largest. */
extern uint16_t FP8_AS_BF16[2][256];

static inline __attribute__((always_inline)) float bf16_bits_to_float(uint16_t b)
{
    const uint32_t bits = (uint32_t)b << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* Element i of a float32 or bfloat16 array (`bf16`: kinds 0 and 1). Two cases only, so that
 * loops over it (the layer ops') stay vectorized (with fp8's table lookup as a third case,
 * GCC vectorized 15 of layer_ops.c's 23 loops); KV caches, which may be fp8, use load_cache. */
static inline __attribute__((always_inline)) float load(const void *p, int64_t i, const int bf16)
{
    return bf16 ? bf16_bits_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Element i of a KV cache stored as `kind` says. */
static inline __attribute__((always_inline)) float load_cache(const void *p, int64_t i,
                                                              const int kind)
{
    if (kind == KIND_F32 || kind == KIND_BF16)
        return load(p, i, kind);
    return bf16_bits_to_float(FP8_AS_BF16[kind - KIND_FP8_E4M3][((const uint8_t *)p)[i]]);
}

static inline size_t kind_bytes(const int kind)
{
    return kind == KIND_F32 ? 4 : kind == KIND_BF16 ? 2 : 1;
}

/* x rounded to the nearest bfloat16 (ties to even, as `store`), as float32. */
static inline float round_to_bf16(float x)
{
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    bits += 0x7FFF + ((bits >> 16) & 1);
    return bf16_bits_to_float((uint16_t)(bits >> 16));
}

/* Stores x as float32 or bfloat16 (`bf16`: kinds 0 and 1; outputs are never fp8). */
static inline void store(void *p, int64_t i, float x, const int bf16)
{
    if (!bf16) {
        ((float *)p)[i] = x;
        return;
    }
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    bits += 0x7FFF + ((bits >> 16) & 1);
    ((uint16_t *)p)[i] = (uint16_t)(bits >> 16);
}

#if defined(__AVX512BW__)
#include <immintrin.h>

/* 32 consecutive values of an fp8 or bfloat16 array (kind 1-3) as 32 bfloat16 in a vector.
 * fp8: the sign moves to bit 15; exponent and mantissa move up into bfloat16's fields (3 bits
 * for E4M3, 2 for E5M2) with the exponent re-biased by an add; the subnormals and zero
 * (exponent field 0: magnitude byte < 8 or < 4) come from the table's first entries. */
static inline __attribute__((always_inline)) __m512i load32_bf16(const void *p, int64_t i,
                                                                const int kind)
{
    if (kind == KIND_BF16)
        return _mm512_loadu_si512((const uint16_t *)p + i);
    const int e5m2 = kind == KIND_FP8_E5M2;
    const int mbits = e5m2 ? 2 : 3, bias = e5m2 ? 15 : 7;
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)((const uint8_t *)p + i));
    const __m512i x = _mm512_cvtepu8_epi16(bytes);
    const __m512i mag = _mm512_and_si512(x, _mm512_set1_epi16(0x7F));
    __m512i v = _mm512_add_epi16(_mm512_sll_epi16(mag, _mm_cvtsi32_si128(7 - mbits)),
                                 _mm512_set1_epi16((int16_t)((127 - bias) << 7)));
    const __mmask32 sub = _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16((int16_t)(1 << mbits)));
    v = _mm512_mask_permutexvar_epi16(v, sub, mag, _mm512_loadu_si512(FP8_AS_BF16[e5m2]));
    return _mm512_or_si512(v, _mm512_slli_epi16(_mm512_and_si512(x, _mm512_set1_epi16(0x80)), 8));
}
#endif
#endif
