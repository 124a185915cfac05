/* half.c — see half.h. */
#include "half.h"

#include <string.h>

uint16_t kvq_f32_to_f16(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a >= 0x7f800000u) /* Inf, or NaN made quiet with its top payload bits */
        return (uint16_t)(sign | (a > 0x7f800000u ? 0x7e00u | ((a >> 13) & 0x3ffu) : 0x7c00u));
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 (halfway above 65504) → Inf */
    if (a < 0x38800000u) {
        /* |x| < 2^-14: subnormal result. Adding 0.5 (ulp 2^-24 = the f16 subnormal
         * step) lets the FPU round to nearest even; the low bits are the mantissa. */
        float f;
        memcpy(&f, &a, sizeof f);
        f += 0.5f;
        uint32_t r;
        memcpy(&r, &f, sizeof r);
        return (uint16_t)(sign | (r - 0x3f000000u));
    }
    uint32_t odd = (a >> 13) & 1u;
    a += 0xc8000fffu + odd; /* exponent rebias 127 → 15 (-112 << 23), plus RNE rounding bias */
    return (uint16_t)(sign | (a >> 13));
}

float kvq_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t mant = h & 0x3FFu;
    uint32_t bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: mant * 2^-24; normalise so bit 10 is the implicit one */
            uint32_t e = 113;
            while (!(mant & 0x400u)) {
                mant <<= 1;
                e--;
            }
            bits = sign | e << 23 | (mant & 0x3FFu) << 13;
        }
    } else if (exp == 0x1F) {
        bits = sign | 0x7F800000u | mant << 13 | (mant ? 0x00400000u : 0);
    } else {
        bits = sign | (exp + 112) << 23 | mant << 13;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

uint16_t kvq_f32_to_bf16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

float kvq_bf16_to_f32(uint16_t h)
{
    uint32_t x = (uint32_t)h << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}
