/* quant_pth.c — vLLM's per-token-head KV caches; see quant_pth.h. float32 arithmetic
 * throughout, as vLLM's Triton kernels compute (no FMA contraction under -std=c17). */
#include "quant_pth.h"

#include <math.h>
#include <string.h>

#include "hadamard.h"
#include "quant_fp8.h"

static float absmax(const float *x, size_t n)
{
    float m = 0;
    for (size_t i = 0; i < n; i++) m = fmaxf(m, fabsf(x[i]));
    return m;
}

static float clampf(float v, float lo, float hi) { return v < lo ? lo : v > hi ? hi : v; }

float kvq_pth_int8_encode(const float *x, size_t n, int8_t *q)
{
    float scale = fmaxf(absmax(x, n) / 127.0f, 1e-6f), inv = 1.0f / scale;
    for (size_t i = 0; i < n; i++) q[i] = (int8_t)clampf(x[i] * inv, -128.0f, 127.0f); /* truncation toward zero */
    return scale;
}

float kvq_pth_fp8_encode(const float *x, size_t n, uint8_t *q)
{
    const float m = kvq_fp8_max(KVQ_FP8_E4M3FN);
    float scale = fmaxf(absmax(x, n) / m, 1e-6f), inv = 1.0f / scale;
    for (size_t i = 0; i < n; i++) q[i] = kvq_fp8_encode(KVQ_FP8_E4M3FN, clampf(x[i] * inv, -m, m));
    return scale;
}

/* Triton's where(v >= 0, (v + 0.5).to(int32), (v - 0.5).to(int32)): round half away from zero */
static float round_away(float v) { return (float)(v >= 0 ? (int32_t)(v + 0.5f) : (int32_t)(v - 0.5f)); }

float kvq_pth_int4_encode(const float *y, size_t n, uint8_t *q)
{
    float lo = INFINITY, hi = -INFINITY;
    for (size_t i = 0; i < n; i++) {
        lo = fminf(lo, y[i]);
        hi = fmaxf(hi, y[i]);
    }
    float scale = fmaxf((hi - lo) / 15.0f, 1e-6f);
    float zp = clampf(round_away(-lo / scale), 0.0f, 15.0f), inv = 1.0f / scale;
    for (size_t i = 0; i < n; i++) q[i] = (uint8_t)clampf(round_away(y[i] * inv + zp), 0.0f, 15.0f);
    uint32_t bits;
    memcpy(&bits, &scale, 4);
    bits = (bits & ~(uint32_t)15) | ((uint32_t)zp & 15u);
    float word;
    memcpy(&word, &bits, 4);
    return word;
}

/* vLLM's unnormalised fast Walsh-Hadamard butterfly (fast_hadamard_transform, tier 3), float32 */
static void fwht_unnorm(float *x, size_t d)
{
    for (size_t h = 1; h < d; h *= 2)
        for (size_t i = 0; i < d; i += 2 * h)
            for (size_t j = i; j < i + h; j++) {
                float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
}

kvq_status kvq_quant_pth(kvq_pth_kind k, float *out, const float *in, size_t n_tokens, size_t n_kv_heads, size_t head_dim,
                         size_t n_sink, kvq_quant_counts *c, kvq_err *err)
{
    if (!n_tokens || !n_kv_heads || !head_dim)
        return kvq_fail(err, KVQ_EINVAL, "per-token-head cache: empty size (%zu tokens, %zu heads, head_dim %zu)", n_tokens,
                        n_kv_heads, head_dim);
    if (k != KVQ_PTH_INT8 && k != KVQ_PTH_FP8 && k != KVQ_PTH_INT4)
        return kvq_fail(err, KVQ_EINVAL, "per-token-head cache: unknown kind %d", (int)k);
    if (head_dim > KVQ_HADAMARD_MAX || (k == KVQ_PTH_INT4 && (head_dim < 2 || (head_dim & (head_dim - 1)))))
        return kvq_fail(err, KVQ_EINVAL,
                        "int4-pth: head_dim %zu: vLLM's int4_per_token_head rotates the whole head with a Walsh-Hadamard "
                        "transform and needs a power of two in 2..%d",
                        head_dim, KVQ_HADAMARD_MAX);
    size_t kvd = n_kv_heads * head_dim;
    float sg[KVQ_HADAMARD_MAX], y[KVQ_HADAMARD_MAX];
    uint8_t q8[KVQ_HADAMARD_MAX];
    if (k == KVQ_PTH_INT4)
        for (size_t d = 0; d < head_dim; d++) sg[d] = (float)kvq_rht_sign(KVQ_PTH_RHT_SEED, d);
    for (size_t t = 0; t < n_tokens; t++) {
        if (t < n_sink) {
            if (out != in) memcpy(out + t * kvd, in + t * kvd, kvd * sizeof *out);
            if (c) c->n_sink += kvd;
            continue;
        }
        for (size_t h = 0; h < n_kv_heads; h++) {
            const float *x = in + t * kvd + h * head_dim;
            float *o = out + t * kvd + h * head_dim;
            if (k == KVQ_PTH_INT8) {
                int8_t qi[KVQ_HADAMARD_MAX];
                float s = kvq_pth_int8_encode(x, head_dim, qi);
                for (size_t d = 0; d < head_dim; d++) o[d] = (float)qi[d] * s;
            } else if (k == KVQ_PTH_FP8) {
                float s = kvq_pth_fp8_encode(x, head_dim, q8);
                for (size_t d = 0; d < head_dim; d++) o[d] = kvq_fp8_decode(KVQ_FP8_E4M3FN, q8[d]) * s;
            } else {
                for (size_t d = 0; d < head_dim; d++) y[d] = x[d] * sg[d];
                fwht_unnorm(y, head_dim);
                float w = kvq_pth_int4_encode(y, head_dim, q8);
                uint32_t bits;
                memcpy(&bits, &w, 4);
                float zp = (float)(bits & 15u);
                bits &= ~(uint32_t)15;
                float st;
                memcpy(&st, &bits, 4);
                for (size_t d = 0; d < head_dim; d++) y[d] = ((float)q8[d] - zp) * st;
                fwht_unnorm(y, head_dim);
                for (size_t d = 0; d < head_dim; d++) o[d] = y[d] * sg[d] / (float)head_dim;
            }
        }
    }
    if (c) c->n_elems += n_tokens * kvd;
    return KVQ_OK;
}
