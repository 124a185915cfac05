/* quant_ggml.c — ggml KV block quantizers; see quant_ggml.h for the formulas
 * and sources. Written from the description of ggml's reference quantizers
 * (ggml-quants.c) and checked bit for bit against gguf.quants.quantize and a
 * float32 Python transcription (tests/scripts/ggml_kv_fixture.py).
 *
 * Float -> integer conversions: ggml casts (int8_t)(x + 8.5f) etc. For finite
 * inputs whose 1/d is finite the argument is always inside [0, 2^bits], so
 * the clamp below changes nothing; it only keeps the degenerate cases (1/d
 * overflowing to inf for |max| < ~1e-38, where fp16(d) is 0 and every
 * dequantized value is +-0 anyway) free of undefined behaviour. */
#include "quant_ggml.h"

#include <float.h>
#include <math.h>
#include <string.h>

#include "ggml_dequant.h"
#include "half.h"
#include "safetensors.h" /* kvq_f32_to_f16 */

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#define QK KVQ_GGML_KV_BLOCK

static const int8_t kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static inline void put_f16(uint8_t *p, float f)
{
    uint16_t h = kvq_f32_to_f16(f); /* RNE, as GGML_FP32_TO_FP16 */
    p[0] = (uint8_t)(h & 0xFF);
    p[1] = (uint8_t)(h >> 8);
}

/* trunc(t) clamped to [0, hi]; NaN -> 0 */
static inline int trunc_clamp(float t, int hi)
{
    if (!(t > 0.0f)) return 0;
    if (t >= (float)hi) return hi;
    return (int)t;
}

/* value of largest magnitude, the first one on ties (ggml: `if (amax < fabsf(v))`) */
static inline float signed_absmax(const float *x)
{
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < QK; j++) {
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    }
    return max;
}

static void q8_0_block(const float *x, uint8_t *b)
{
    float amax = 0.0f;
    for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(x[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    put_f16(b, d);
    for (int j = 0; j < QK; j++) {
        float r = roundf(x[j] * id);
        int q = r != r ? 0 : r > 127.0f ? 127 : r < -127.0f ? -127 : (int)r;
        b[2 + j] = (uint8_t)(int8_t)q;
    }
}

/* Q4_0 (bits 4) and Q5_0 (bits 5): symmetric, offset 2^(bits-1) */
static void qx_0_block(const float *x, uint8_t *b, int bits)
{
    const int off = 1 << (bits - 1), qmax = (1 << bits) - 1;
    const float max = signed_absmax(x);
    const float d = max / (float)-off;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const float bias = (float)off + 0.5f;
    put_f16(b, d);
    uint8_t *qs = b + (bits == 5 ? 6 : 2);
    uint32_t qh = 0;
    for (int j = 0; j < QK / 2; j++) {
        const int q0 = trunc_clamp(x[j] * id + bias, qmax);
        const int q1 = trunc_clamp(x[j + QK / 2] * id + bias, qmax);
        qs[j] = (uint8_t)((q0 & 0x0F) | (q1 & 0x0F) << 4);
        qh |= (uint32_t)(q0 >> 4 & 1) << j | (uint32_t)(q1 >> 4 & 1) << (j + QK / 2);
    }
    if (bits == 5)
        for (int k = 0; k < 4; k++) b[2 + k] = (uint8_t)(qh >> (8 * k));
}

/* Q4_1 (bits 4) and Q5_1 (bits 5): affine with the block min */
static void qx_1_block(const float *x, uint8_t *b, int bits)
{
    const int qmax = (1 << bits) - 1;
    float min = FLT_MAX, max = -FLT_MAX;
    for (int j = 0; j < QK; j++) {
        if (x[j] < min) min = x[j];
        if (x[j] > max) max = x[j];
    }
    const float d = (max - min) / (float)qmax;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    put_f16(b, d);
    put_f16(b + 2, min);
    uint8_t *qs = b + (bits == 5 ? 8 : 4);
    uint32_t qh = 0;
    for (int j = 0; j < QK / 2; j++) {
        const int q0 = trunc_clamp((x[j] - min) * id + 0.5f, qmax);
        const int q1 = trunc_clamp((x[j + QK / 2] - min) * id + 0.5f, qmax);
        qs[j] = (uint8_t)((q0 & 0x0F) | (q1 & 0x0F) << 4);
        qh |= (uint32_t)(q0 >> 4 & 1) << j | (uint32_t)(q1 >> 4 & 1) << (j + QK / 2);
    }
    if (bits == 5)
        for (int k = 0; k < 4; k++) b[4 + k] = (uint8_t)(qh >> (8 * k));
}

/* Index of the codebook entry nearest to v: the number of midpoints
 * (kv[k-1]+kv[k])/2 that v reaches, compared as 2v >= kv[k-1]+kv[k] so both
 * sides are exact; a tie picks the larger entry; NaN -> 0. Same result as
 * ggml's best_index_int8 binary search over the sorted table. */
static inline int iq4nl_index(float v)
{
    const float v2 = v + v;
    int idx = 0;
    for (int k = 1; k < 16; k++) idx += v2 >= (float)(kvalues_iq4nl[k - 1] + kvalues_iq4nl[k]);
    return idx;
}

static void iq4_nl_block(const float *x, uint8_t *b)
{
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < QK; j++) {
        const float ax = fabsf(x[j]);
        if (ax > amax) {
            amax = ax;
            max = x[j];
        }
    }
    uint8_t L[QK];
    float d = 0.0f;
    if (amax < 1e-15f) { /* GROUP_MAX_EPS */
        memset(L, 0, sizeof L);
    } else {
        const float id = 1.0f / (max / (float)kvalues_iq4nl[0]);
        float sumqx = 0.0f, sumq2 = 0.0f;
        for (int j = 0; j < QK; j++) {
            const int l = iq4nl_index(id * x[j]);
            L[j] = (uint8_t)l;
            const float q = (float)kvalues_iq4nl[l];
            const float w = x[j] * x[j];
            sumqx += w * q * x[j];
            sumq2 += w * q * q;
        }
        d = sumq2 > 0.0f ? sumqx / sumq2 : 0.0f;
    }
    put_f16(b, d);
    for (int j = 0; j < QK / 2; j++) b[2 + j] = (uint8_t)(L[j] | L[j + QK / 2] << 4);
}

int kvq_ggml_can_quantize(kvq_ggml_type t)
{
    switch (t) {
    case KVQ_GGML_Q8_0: case KVQ_GGML_Q4_0: case KVQ_GGML_Q4_1:
    case KVQ_GGML_Q5_0: case KVQ_GGML_Q5_1: case KVQ_GGML_IQ4_NL: return 1;
    default: return 0;
    }
}

static void quantize_unchecked(kvq_ggml_type t, const float *x, size_t n, uint8_t *dst, uint32_t bb)
{
    for (size_t i = 0; i < n / QK; i++) {
        const float *xb = x + i * QK;
        uint8_t *b = dst + i * bb;
        switch (t) {
        case KVQ_GGML_Q8_0: q8_0_block(xb, b); break;
        case KVQ_GGML_Q4_0: qx_0_block(xb, b, 4); break;
        case KVQ_GGML_Q5_0: qx_0_block(xb, b, 5); break;
        case KVQ_GGML_Q4_1: qx_1_block(xb, b, 4); break;
        case KVQ_GGML_Q5_1: qx_1_block(xb, b, 5); break;
        case KVQ_GGML_IQ4_NL: iq4_nl_block(xb, b); break;
        default: break;
        }
    }
}

static kvq_status check_type(kvq_ggml_type t, const char **name, uint32_t *bb, kvq_err *err)
{
    uint32_t be;
    if (!kvq_ggml_can_quantize(t) || !kvq_ggml_type_info(t, &be, bb, name))
        return kvq_fail(err, KVQ_EUNSUPPORTED,
                        "ggml type %d is not a KV-cache block format kvq can quantize (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL)",
                        (int)t);
    return KVQ_OK;
}

static kvq_status check_finite(const float *x, size_t n, const char *what, kvq_err *err)
{
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i]))
            return kvq_fail(err, KVQ_ENUMERIC, "%s: element %zu is %s (expected finite values)", what, i,
                            isnan(x[i]) ? "NaN" : "infinite");
    return KVQ_OK;
}

kvq_status kvq_ggml_quantize(kvq_ggml_type t, const float *src, size_t n, void *dst, size_t dst_bytes,
                             kvq_err *err)
{
    const char *name;
    uint32_t bb;
    KVQ_TRY(check_type(t, &name, &bb, err));
    if (n % QK)
        return kvq_fail(err, KVQ_EINVAL, "%s quantize: %zu elements are not a whole number of blocks of %d", name, n, QK);
    size_t need;
    if (kvq_mul_size(n / QK, bb, &need)) return kvq_fail(err, KVQ_ENOMEM, "%s quantize: size of %zu elements overflows", name, n);
    if (dst_bytes < need)
        return kvq_fail(err, KVQ_EINVAL, "%s quantize: %zu elements need %zu bytes, destination has %zu", name, n, need, dst_bytes);
    KVQ_TRY(check_finite(src, n, name, err));
    quantize_unchecked(t, src, n, dst, bb);
    return KVQ_OK;
}

kvq_status kvq_ggml_kv_roundtrip(kvq_ggml_type t, const float *x, float *y, size_t n_tokens, size_t n_kv_heads,
                                 size_t head_dim, kvq_err *err)
{
    const char *name;
    uint32_t bb;
    KVQ_TRY(check_type(t, &name, &bb, err));
    if (!n_tokens || !n_kv_heads || !head_dim)
        return kvq_fail(err, KVQ_EINVAL, "%s KV round trip: empty block [%zu][%zu][%zu]", name, n_tokens, n_kv_heads, head_dim);
    if (head_dim % QK)
        return kvq_fail(err, KVQ_EUNSUPPORTED,
                        "%s KV cache: head_dim %zu is not a multiple of the block size %d; llama.cpp refuses such caches",
                        name, head_dim, QK);
    size_t row, total;
    if (kvq_mul_size(n_kv_heads, head_dim, &row) || kvq_mul_size(row, n_tokens, &total))
        return kvq_fail(err, KVQ_ENOMEM, "%s KV round trip: [%zu][%zu][%zu] overflows", name, n_tokens, n_kv_heads, head_dim);
    KVQ_TRY(check_finite(x, total, name, err));
    const kvq_ggml_type ty = t;
#pragma omp parallel for schedule(static) if (total > (1u << 16))
    for (size_t tok = 0; tok < n_tokens; tok++) {
        uint8_t blk[64]; /* one block; the largest handled (Q8_0) is 34 bytes */
        for (size_t i = 0; i < row / QK; i++) {
            const size_t at = tok * row + i * QK;
            quantize_unchecked(ty, x + at, QK, blk, bb);
            kvq_ggml_dequantize(ty, blk, bb, y + at, QK, NULL, NULL); /* cannot fail: type and sizes checked */
        }
    }
    return KVQ_OK;
}

double kvq_ggml_kv_bits_per_element(kvq_ggml_type t)
{
    uint32_t be, bb;
    if (!kvq_ggml_can_quantize(t) || !kvq_ggml_type_info(t, &be, &bb, NULL)) return 0.0;
    return (double)bb * 8.0 / (double)be;
}
