/* The fp8 tables of storage.h, filled once when the library loads. */
#include "storage.h"

uint16_t FP8_AS_BF16[2][256];

/* bfloat16 bits of fp8 byte x with `mbits` mantissa bits and exponent bias `bias`: a normal
 * value 2^(e - bias) * (1 + m / 2^mbits), a subnormal (e = 0) 2^(1 - bias) * m / 2^mbits. */
static uint16_t fp8_bits(unsigned x, int mbits, int bias)
{
    const unsigned mag = x & 0x7F, e = mag >> mbits, m = mag & ((1u << mbits) - 1);
    const float scale = (float)(1u << mbits);
    float v = e ? ldexpf(1.0f + (float)m / scale, (int)e - bias)
                : ldexpf((float)m / scale, 1 - bias);
    if (x & 0x80)
        v = -v;
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    return (uint16_t)(bits >> 16); /* exact: at most 3 mantissa bits */
}

__attribute__((constructor)) static void fill_fp8_tables(void)
{
    for (unsigned x = 0; x < 256; x++) {
        FP8_AS_BF16[0][x] = fp8_bits(x, 3, 7);  /* E4M3 */
        FP8_AS_BF16[1][x] = fp8_bits(x, 2, 15); /* E5M2 */
    }
}
