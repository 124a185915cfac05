/* ggml_dequant.c — ggml block dequantization; see ggml_dequant.h for the
 * layouts and sources. Every block decoder mirrors the float32 operation
 * order of gguf/quants.py (and ggml-quants.c), one rounding per operation:
 * the build uses -std=c17 (GCC: -ffp-contract=off), and clang is told the
 * same below, so no multiply-add is fused. */
#include "ggml_dequant.h"
#include "half.h"

#include <stdio.h>
#include <string.h>

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#define QK 32
#define QK_K 256

static inline uint16_t le16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline uint32_t le32(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }

static inline float f16at(const uint8_t *p) { return kvq_f16_to_f32(le16(p)); }

/* ---- 32-element blocks ---------------------------------------------------- */

static void dq_q4_0(const uint8_t *b, float *y)
{
    const float d = f16at(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < QK / 2; j++) {
        y[j] = d * (float)((qs[j] & 0x0F) - 8);
        y[j + QK / 2] = d * (float)((qs[j] >> 4) - 8);
    }
}

static void dq_q4_1(const uint8_t *b, float *y)
{
    const float d = f16at(b), m = f16at(b + 2);
    const uint8_t *qs = b + 4;
    for (int j = 0; j < QK / 2; j++) {
        float v0 = d * (float)(qs[j] & 0x0F);
        float v1 = d * (float)(qs[j] >> 4);
        y[j] = v0 + m;
        y[j + QK / 2] = v1 + m;
    }
}

static void dq_q5_0(const uint8_t *b, float *y)
{
    const float d = f16at(b);
    const uint32_t qh = le32(b + 2);
    const uint8_t *qs = b + 6;
    for (int j = 0; j < QK / 2; j++) {
        int x0 = (int)((qs[j] & 0x0F) | (((qh >> j) & 1u) << 4)) - 16;
        int x1 = (int)((qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4)) - 16;
        y[j] = d * (float)x0;
        y[j + QK / 2] = d * (float)x1;
    }
}

static void dq_q5_1(const uint8_t *b, float *y)
{
    const float d = f16at(b), m = f16at(b + 2);
    const uint32_t qh = le32(b + 4);
    const uint8_t *qs = b + 8;
    for (int j = 0; j < QK / 2; j++) {
        uint32_t x0 = (qs[j] & 0x0Fu) | ((qh >> j) & 1u) << 4;
        uint32_t x1 = (qs[j] >> 4) | ((qh >> (j + 16)) & 1u) << 4;
        float v0 = d * (float)x0;
        float v1 = d * (float)x1;
        y[j] = v0 + m;
        y[j + QK / 2] = v1 + m;
    }
}

/* IQ4_NL: 4-bit indices into a fixed non-linear codebook (ggml-common.h
 * kvalues_iq4nl; also gguf/quants.py IQ4_NL.kvalues); y = d * kvalues[q]. */
static const int8_t kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static void dq_iq4_nl(const uint8_t *b, float *y)
{
    const float d = f16at(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < QK / 2; j++) {
        y[j] = d * (float)kvalues_iq4nl[qs[j] & 0x0F];
        y[j + QK / 2] = d * (float)kvalues_iq4nl[qs[j] >> 4];
    }
}

static void dq_q8_0(const uint8_t *b, float *y)
{
    const float d = f16at(b);
    const int8_t *qs = (const int8_t *)(b + 2);
    for (int j = 0; j < QK; j++) y[j] = (float)qs[j] * d;
}

/* ---- 256-element super-blocks (k-quants) ---------------------------------- */

static void dq_q2_k(const uint8_t *b, float *y)
{
    const uint8_t *scales = b, *q = b + 16;
    const float d = f16at(b + 80), dmin = f16at(b + 82);
    int is = 0;
    for (int n = 0; n < QK_K; n += 128) {
        for (int shift = 0; shift < 8; shift += 2) {
            for (int half = 0; half < 2; half++) {
                uint8_t sc = scales[is++];
                const float dl = d * (float)(sc & 0x0F), ml = dmin * (float)(sc >> 4);
                const uint8_t *qq = q + 16 * half;
                for (int l = 0; l < 16; l++) {
                    float v = dl * (float)((qq[l] >> shift) & 3);
                    *y++ = v - ml;
                }
            }
        }
        q += 32;
    }
}

static void dq_q3_k(const uint8_t *b, float *y)
{
    const uint8_t *hm = b, *q = b + 32, *sc = b + 96;
    const float d_all = f16at(b + 108);
    /* 16 6-bit scales: low 4 bits from sc[0..7] (low nibbles = scales 0..7,
     * high nibbles = 8..15), high 2 bits from sc[8..11] (2 bits each). */
    int scales[16];
    for (int i = 0; i < 16; i++) {
        int lo = (i < 8 ? sc[i] : sc[i - 8] >> 4) & 0x0F;
        int hi = (sc[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
        scales[i] = (lo | hi << 4) - 32;
    }
    int is = 0;
    uint8_t m = 1;
    for (int n = 0; n < QK_K; n += 128) {
        for (int shift = 0; shift < 8; shift += 2) {
            for (int half = 0; half < 2; half++) {
                const float dl = d_all * (float)scales[is++];
                const uint8_t *qq = q + 16 * half, *hh = hm + 16 * half;
                for (int l = 0; l < 16; l++) {
                    int v = ((qq[l] >> shift) & 3) - ((hh[l] & m) ? 0 : 4);
                    *y++ = dl * (float)v;
                }
            }
            m <<= 1;
        }
        q += 32;
    }
}

/* 6-bit scale and min j (0..7) of Q4_K/Q5_K (ggml get_scale_min_k4). */
static inline void scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m)
{
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (uint8_t)((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

static void dq_q4_k(const uint8_t *b, float *y)
{
    const float d = f16at(b), dmin = f16at(b + 2);
    const uint8_t *scales = b + 4, *q = b + 16;
    for (int j = 0, is = 0; j < QK_K; j += 64, is += 2) {
        uint8_t sc, mn;
        scale_min_k4(is, scales, &sc, &mn);
        const float d1 = d * (float)sc, m1 = dmin * (float)mn;
        scale_min_k4(is + 1, scales, &sc, &mn);
        const float d2 = d * (float)sc, m2 = dmin * (float)mn;
        for (int l = 0; l < 32; l++) {
            float v = d1 * (float)(q[l] & 0x0F);
            *y++ = v - m1;
        }
        for (int l = 0; l < 32; l++) {
            float v = d2 * (float)(q[l] >> 4);
            *y++ = v - m2;
        }
        q += 32;
    }
}

static void dq_q5_k(const uint8_t *b, float *y)
{
    const float d = f16at(b), dmin = f16at(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *ql = b + 48;
    uint8_t u1 = 1, u2 = 2;
    for (int j = 0, is = 0; j < QK_K; j += 64, is += 2) {
        uint8_t sc, mn;
        scale_min_k4(is, scales, &sc, &mn);
        const float d1 = d * (float)sc, m1 = dmin * (float)mn;
        scale_min_k4(is + 1, scales, &sc, &mn);
        const float d2 = d * (float)sc, m2 = dmin * (float)mn;
        for (int l = 0; l < 32; l++) {
            float v = d1 * (float)((ql[l] & 0x0F) + ((qh[l] & u1) ? 16 : 0));
            *y++ = v - m1;
        }
        for (int l = 0; l < 32; l++) {
            float v = d2 * (float)((ql[l] >> 4) + ((qh[l] & u2) ? 16 : 0));
            *y++ = v - m2;
        }
        ql += 32;
        u1 = (uint8_t)(u1 << 2);
        u2 = (uint8_t)(u2 << 2);
    }
}

static void dq_q6_k(const uint8_t *b, float *y)
{
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = f16at(b + 208);
    for (int n = 0; n < QK_K; n += 128) {
        for (int l = 0; l < 32; l++) {
            int is = l / 16;
            int q1 = (int)((ql[l] & 0x0F) | ((qh[l] >> 0) & 3) << 4) - 32;
            int q2 = (int)((ql[l + 32] & 0x0F) | ((qh[l] >> 2) & 3) << 4) - 32;
            int q3 = (int)((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32;
            int q4 = (int)((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32;
            y[l] = d * (float)sc[is] * (float)q1;
            y[l + 32] = d * (float)sc[is + 2] * (float)q2;
            y[l + 64] = d * (float)sc[is + 4] * (float)q3;
            y[l + 96] = d * (float)sc[is + 6] * (float)q4;
        }
        y += 128;
        ql += 64;
        qh += 32;
        sc += 8;
    }
}

static void dq_q8_k(const uint8_t *b, float *y)
{
    float d;
    memcpy(&d, b, 4); /* little-endian hosts only (as the whole reader) */
    const int8_t *qs = (const int8_t *)(b + 4);
    for (int j = 0; j < QK_K; j++) y[j] = d * (float)qs[j];
}

typedef void (*block_fn)(const uint8_t *, float *);

static block_fn block_decoder(kvq_ggml_type t)
{
    switch (t) {
    case KVQ_GGML_Q4_0: return dq_q4_0;
    case KVQ_GGML_Q4_1: return dq_q4_1;
    case KVQ_GGML_Q5_0: return dq_q5_0;
    case KVQ_GGML_Q5_1: return dq_q5_1;
    case KVQ_GGML_Q8_0: return dq_q8_0;
    case KVQ_GGML_Q2_K: return dq_q2_k;
    case KVQ_GGML_Q3_K: return dq_q3_k;
    case KVQ_GGML_Q4_K: return dq_q4_k;
    case KVQ_GGML_Q5_K: return dq_q5_k;
    case KVQ_GGML_Q6_K: return dq_q6_k;
    case KVQ_GGML_Q8_K: return dq_q8_k;
    case KVQ_GGML_IQ4_NL: return dq_iq4_nl;
    default: return NULL;
    }
}

int kvq_ggml_can_dequantize(kvq_ggml_type t)
{
    return t == KVQ_GGML_F32 || t == KVQ_GGML_F16 || t == KVQ_GGML_BF16 || block_decoder(t) != NULL;
}

/* Decode n elements known to be valid (type supported, n whole blocks). */
static void dequant_unchecked(kvq_ggml_type t, const uint8_t *src, float *dst, size_t n)
{
    switch (t) {
    case KVQ_GGML_F32: memcpy(dst, src, n * sizeof(float)); return;
    case KVQ_GGML_F16: for (size_t i = 0; i < n; i++) dst[i] = kvq_f16_to_f32(le16(src + 2 * i)); return;
    case KVQ_GGML_BF16: for (size_t i = 0; i < n; i++) dst[i] = kvq_bf16_to_f32(le16(src + 2 * i)); return;
    default: break;
    }
    uint32_t be = 1, bb = 1;
    kvq_ggml_type_info(t, &be, &bb, NULL);
    block_fn fn = block_decoder(t);
    for (size_t i = 0; i < n / be; i++) fn(src + i * bb, dst + i * be);
}

static const char *type_name(kvq_ggml_type t, char *buf, size_t n)
{
    const char *name;
    if (kvq_ggml_type_info(t, NULL, NULL, &name)) return name;
    snprintf(buf, n, "ggml type %d", (int)t);
    return buf;
}

static kvq_status unsupported(kvq_ggml_type t, const char *what, kvq_err *err)
{
    char buf[32];
    return kvq_fail(err, KVQ_EUNSUPPORTED,
                    "%s: tensor type %s (%d) cannot be dequantized (kvq supports F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K, IQ4_NL)",
                    what ? what : "tensor", type_name(t, buf, sizeof buf), (int)t);
}

kvq_status kvq_ggml_nbytes(kvq_ggml_type t, size_t n, size_t *nbytes, const char *what, kvq_err *err)
{
    uint32_t be, bb;
    const char *name;
    if (!kvq_ggml_type_info(t, &be, &bb, &name)) return unsupported(t, what, err);
    if (n % be)
        return kvq_fail(err, KVQ_EFORMAT, "%s: %zu elements are not a whole number of %s blocks of %u",
                        what ? what : "tensor", n, name, be);
    if (kvq_mul_size(n / be, bb, nbytes))
        return kvq_fail(err, KVQ_EFORMAT, "%s: byte size of %zu %s elements overflows", what ? what : "tensor", n, name);
    return KVQ_OK;
}

kvq_status kvq_ggml_dequantize(kvq_ggml_type t, const void *src, size_t src_bytes, float *dst, size_t n,
                               const char *what, kvq_err *err)
{
    if (!kvq_ggml_can_dequantize(t)) return unsupported(t, what, err);
    size_t need;
    KVQ_TRY(kvq_ggml_nbytes(t, n, &need, what, err));
    if (src_bytes < need)
        return kvq_fail(err, KVQ_EFORMAT, "%s: %zu elements need %zu bytes, only %zu available",
                        what ? what : "tensor", n, need, src_bytes);
    dequant_unchecked(t, src, dst, n);
    return KVQ_OK;
}

kvq_status kvq_gguf_tensor_dequantize(const kvq_gguf *g, const kvq_gguf_tensor *t, float *dst, kvq_err *err)
{
    char what[4096 + 200];
    snprintf(what, sizeof what, "%s: tensor '%.*s'", g->path, (int)(t->name.len < 160 ? t->name.len : 160), t->name.str);
    if (!kvq_ggml_can_dequantize(t->type)) return unsupported(t->type, what, err);
    size_t row = (size_t)t->ne[0], rows = (size_t)(t->n_elements / t->ne[0]), row_bytes, total;
    KVQ_TRY(kvq_ggml_nbytes(t->type, row, &row_bytes, what, err));
    if (kvq_mul_size(row_bytes, rows, &total) || total != t->n_bytes || !t->data)
        return kvq_fail(err, KVQ_EFORMAT, "%s: %zu rows of %zu bytes do not match its %llu data bytes", what, rows,
                        row_bytes, (unsigned long long)t->n_bytes);
    const uint8_t *src = t->data;
    const kvq_ggml_type ty = t->type;
#pragma omp parallel for schedule(static) if (t->n_elements > (1u << 16))
    for (size_t r = 0; r < rows; r++) dequant_unchecked(ty, src + r * row_bytes, dst + r * row, row);
    return KVQ_OK;
}
