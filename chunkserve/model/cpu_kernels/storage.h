/* float32 or bfloat16 storage, for the CPU kernels (included by each .c file).
 * bfloat16 is only how values are stored: the top half of a float32's bits; the arithmetic
 * is float32. Rounding to bfloat16 is to nearest even, as PyTorch's conversion. */
#ifndef CHUNKSERVE_STORAGE_H
#define CHUNKSERVE_STORAGE_H
#include <stdint.h>
#include <string.h>

/* Element i of a float32 or bfloat16 array. */
static inline __attribute__((always_inline)) float load(const void *p, int64_t i, const int bf16)
{
    if (!bf16)
        return ((const float *)p)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

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
#endif
