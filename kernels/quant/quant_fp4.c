/* quant_fp4.c — E2M1 encode/decode and the NVFP4 / MXFP4 / fp4_mx_block16
 * block round trips; see quant_fp4.h for the rules and their sources. */
#include "quant_fp4.h"

#include <math.h>
#include <string.h>

#include "quant_fp8.h"

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

static const float E2M1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
/* midpoints between adjacent magnitudes (SGLang's E2M1_BOUNDS) */
static const float MID[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};

size_t kvq_fp4_block(kvq_fp4_format f) { return f == KVQ_FP4_MXFP4 ? 32 : 16; }

const char *kvq_fp4_name(kvq_fp4_format f)
{
    return f == KVQ_FP4_MXFP4 ? "mxfp4" : f == KVQ_FP4_MX16_SGL ? "fp4_mx_block16" : "nvfp4";
}

uint8_t kvq_e2m1_encode(float x)
{
    const uint8_t sign = signbit(x) ? 8 : 0;
    const float a = fabsf(x);
    if (isnan(x)) return (uint8_t)(sign | 7);
    uint8_t m = 7;
    for (uint8_t i = 0; i < 7; i++) {
        if (a < MID[i]) { m = i; break; }
        if (a == MID[i]) { m = (i & 1) ? (uint8_t)(i + 1) : i; break; } /* tie: the even code */
    }
    return (uint8_t)(sign | m);
}

uint8_t kvq_e2m1_encode_ties_up(float x)
{
    const float a = fabsf(x);
    uint8_t m = 0;
    for (int i = 0; i < 7; i++) m = (uint8_t)(m + (a >= MID[i]));
    return (uint8_t)((x < 0 ? 8 : 0) | m);
}

float kvq_e2m1_decode(uint8_t c)
{
    const float v = E2M1[c & 7];
    return (c & 8) ? -v : v;
}

float kvq_e8m0_decode(uint8_t c) { return c == 0xFF ? NAN : ldexpf(1.0f, (int)c - 127); }

/* floor(log2(a)) and ceil(log2(a)) of a finite a > 0, exactly */
static int floor_log2(float a)
{
    int e;
    (void)frexpf(a, &e); /* a = m 2^e, m in [0.5, 1) */
    return e - 1;
}

static int ceil_log2(float a)
{
    int e;
    const float m = frexpf(a, &e);
    return m == 0.5f ? e - 1 : e;
}

static size_t block_nvfp4(const float *x, float g, uint8_t *codes, uint8_t *sc, float *y)
{
    float vmax = 0.0f;
    for (int j = 0; j < 16; j++) vmax = fmaxf(vmax, fabsf(x[j]));
    const float rg = 1.0f / g, r6 = 1.0f / 6.0f;
    const float sf = rg * (vmax * r6);
    const uint8_t s8 = kvq_fp8_encode(KVQ_FP8_E4M3FN, sf);
    const float sfv = kvq_fp8_decode(KVQ_FP8_E4M3FN, s8);
    if (sc) *sc = s8;
    const float deq = sfv * g;
    size_t clipped = 0;
    if (vmax == 0.0f || sfv == 0.0f) { /* all zero, or a block scale underflowing E4M3: reads back 0 */
        for (int j = 0; j < 16; j++) {
            if (codes) codes[j] = signbit(x[j]) ? 8 : 0;
            y[j] = copysignf(0.0f, x[j]);
        }
        return 0;
    }
    const float os = 1.0f / deq;
    for (int j = 0; j < 16; j++) {
        const float t = x[j] * os;
        clipped += fabsf(t) >= 7.0f;
        const uint8_t c = kvq_e2m1_encode(t);
        if (codes) codes[j] = c;
        y[j] = kvq_e2m1_decode(c) * deq;
    }
    return clipped;
}

static size_t block_mxfp4(const float *x, uint8_t *codes, uint8_t *sc, float *y)
{
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
    int e = amax > 0.0f ? floor_log2(amax) - 2 : -127;
    if (e < -127) e = -127;
    if (e > 127) e = 127;
    if (sc) *sc = (uint8_t)(e + 127);
    size_t clipped = 0;
    for (int j = 0; j < 32; j++) {
        const float t = ldexpf(x[j], -e); /* x / 2^e: exact unless it underflows float32 */
        clipped += fabsf(t) >= 7.0f;
        const uint8_t c = kvq_e2m1_encode(t);
        if (codes) codes[j] = c;
        y[j] = ldexpf(kvq_e2m1_decode(c), e);
    }
    return clipped;
}

static size_t block_mx16_sgl(const float *x, uint8_t *codes, uint8_t *sc, float *y)
{
    float amax = 0.0f;
    for (int j = 0; j < 16; j++) amax = fmaxf(amax, fabsf(x[j]));
    const float r = fmaxf(amax / 6.0f, 1e-10f); /* torch.clamp(block_max / E2M1_MAX, min=1e-10) */
    const int e = ceil_log2(r);
    if (sc) *sc = (uint8_t)(e + 127);
    size_t clipped = 0;
    for (int j = 0; j < 16; j++) {
        const float t = ldexpf(x[j], -e);
        clipped += fabsf(t) >= 7.0f;
        const uint8_t c = kvq_e2m1_encode_ties_up(t);
        if (codes) codes[j] = c;
        y[j] = ldexpf(kvq_e2m1_decode(c), e);
    }
    return clipped;
}

size_t kvq_fp4_block_roundtrip(kvq_fp4_format f, const float *x, float g, uint8_t *codes, uint8_t *scale_code, float *y)
{
    float tmp[32];
    const size_t n = kvq_fp4_block(f);
    memcpy(tmp, x, n * sizeof *tmp); /* y may equal x */
    switch (f) {
    case KVQ_FP4_MXFP4: return block_mxfp4(tmp, codes, scale_code, y);
    case KVQ_FP4_MX16_SGL: return block_mx16_sgl(tmp, codes, scale_code, y);
    default: return block_nvfp4(tmp, g, codes, scale_code, y);
    }
}

kvq_status kvq_fp4_kv_roundtrip(kvq_fp4_format f, const float *x, float *y, size_t n_tokens, size_t n_kv_heads,
                                size_t head_dim, float g, uint64_t *n_clipped, kvq_err *err)
{
    const char *name = kvq_fp4_name(f);
    const size_t B = kvq_fp4_block(f);
    if (!n_tokens || !n_kv_heads || !head_dim)
        return kvq_fail(err, KVQ_EINVAL, "%s KV round trip: empty block [%zu][%zu][%zu]", name, n_tokens, n_kv_heads, head_dim);
    if (head_dim % B)
        return kvq_fail(err, KVQ_EUNSUPPORTED, "%s KV round trip: head_dim %zu is not a multiple of the %zu-value block", name,
                        head_dim, B);
    if (f == KVQ_FP4_NVFP4 && !(isfinite(g) && g > 0.0f))
        return kvq_fail(err, KVQ_EINVAL, "%s KV round trip: per-tensor scale %g (expected finite and > 0)", name, (double)g);
    size_t row, total;
    if (kvq_mul_size(n_kv_heads, head_dim, &row) || kvq_mul_size(row, n_tokens, &total))
        return kvq_fail(err, KVQ_ENOMEM, "%s KV round trip: [%zu][%zu][%zu] overflows", name, n_tokens, n_kv_heads, head_dim);
    for (size_t i = 0; i < total; i++)
        if (!isfinite(x[i]))
            return kvq_fail(err, KVQ_ENUMERIC, "%s KV round trip: element %zu (token %zu, head %zu, dim %zu) is %s", name, i,
                            i / row, (i % row) / head_dim, i % head_dim, isnan(x[i]) ? "NaN" : "infinite");
    const size_t nb = total / B;
    uint64_t clipped = 0;
#pragma omp parallel for schedule(static) reduction(+ : clipped) if (total > (1u << 16))
    for (size_t b = 0; b < nb; b++) clipped += kvq_fp4_block_roundtrip(f, x + b * B, g, NULL, NULL, y + b * B);
    if (n_clipped) *n_clipped = clipped;
    return KVQ_OK;
}

double kvq_fp4_bits_per_element(kvq_fp4_format f, size_t n_elems)
{
    const double b = 4.0 + 8.0 / (double)kvq_fp4_block(f);
    return f == KVQ_FP4_NVFP4 && n_elems ? b + 32.0 / (double)n_elems : b;
}

float kvq_nvfp4_global_scale(double stat)
{
    const float s = (float)(stat / (448.0 * 6.0));
    return s > 0.0f && isfinite(s) ? s : 1.0f;
}
