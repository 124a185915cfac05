/* quant_fp8.c — E4M3FN / E5M2 encode/decode, scaled KV round trips and
 * scale calibration; see quant_fp8.h for the semantics and sources. */
#include "quant_fp8.h"

#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int mbits;          /* mantissa bits */
    int bias;           /* exponent bias */
    uint8_t max_mag;    /* code of the largest finite magnitude */
    uint8_t nan_mag;    /* code of the canonical NaN (sign added) */
} fp8_desc;

static fp8_desc desc(kvq_fp8_format f)
{
    return f == KVQ_FP8_E5M2 ? (fp8_desc){2, 15, 0x7B, 0x7E} : (fp8_desc){3, 7, 0x7E, 0x7F};
}

float kvq_fp8_max(kvq_fp8_format f) { return f == KVQ_FP8_E5M2 ? 57344.0f : 448.0f; }
const char *kvq_fp8_name(kvq_fp8_format f) { return f == KVQ_FP8_E5M2 ? "e5m2" : "e4m3fn"; }

uint8_t kvq_fp8_encode(kvq_fp8_format f, float x)
{
    const fp8_desc d = desc(f);
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    const uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint8_t)(sign | d.nan_mag);
    if (a == 0x7F800000u) return (uint8_t)(sign | d.max_mag); /* saturate inf */
    const int emin = 1 - d.bias;                                /* exponent of the smallest normal */
    const uint32_t min_normal_bits = (uint32_t)(emin + 127) << 23;
    uint32_t mag;
    if (a < min_normal_bits) {
        /* subnormal range: multiples of 2^(emin - mbits); scaling by a power
         * of two is exact, nearbyintf rounds half to even */
        float ax;
        memcpy(&ax, &a, sizeof ax);
        const float n = nearbyintf(ldexpf(ax, d.mbits - emin));
        mag = (uint32_t)n; /* 0 .. 2^mbits; 2^mbits is the smallest normal's code */
    } else {
        /* normal: round the float32 magnitude bits to mbits mantissa bits
         * (nearest, ties to even; a carry moves into the exponent), then
         * rebias the exponent from 127 to the format's bias */
        const int shift = 23 - d.mbits;
        uint32_t r = a + ((1u << (shift - 1)) - 1u) + ((a >> shift) & 1u);
        r >>= shift;
        const uint32_t rebias = (uint32_t)(127 - d.bias) << d.mbits;
        mag = r - rebias;
        if (mag > d.max_mag) mag = d.max_mag; /* saturate (also keeps E4M3FN off its NaN code) */
    }
    return (uint8_t)(sign | mag);
}

float kvq_fp8_decode(kvq_fp8_format f, uint8_t code)
{
    const fp8_desc d = desc(f);
    const int ebits = 7 - d.mbits;
    const int e = (code >> d.mbits) & ((1 << ebits) - 1);
    const int m = code & ((1 << d.mbits) - 1);
    const float s = (code & 0x80) ? -1.0f : 1.0f;
    if (f == KVQ_FP8_E4M3FN && e == 15 && m == 7) return copysignf(NAN, s);
    if (f == KVQ_FP8_E5M2 && e == 31) return m ? copysignf(NAN, s) : s * INFINITY;
    if (e == 0) return s * ldexpf((float)m, 1 - d.bias - d.mbits);
    return s * ldexpf((float)((1 << d.mbits) | m), e - d.bias - d.mbits);
}

static kvq_status check_kv(const char *what, size_t n_tokens, size_t n_kv_heads, size_t head_dim,
                           const float *scales, size_t n_scales, size_t *total, kvq_err *err)
{
    if (!n_tokens || !n_kv_heads || !head_dim)
        return kvq_fail(err, KVQ_EINVAL, "%s: empty block [%zu][%zu][%zu]", what, n_tokens, n_kv_heads, head_dim);
    if (n_scales != 1 && n_scales != n_kv_heads)
        return kvq_fail(err, KVQ_EINVAL, "%s: %zu scales (expected 1 per tensor or n_kv_heads = %zu per head)", what,
                        n_scales, n_kv_heads);
    for (size_t i = 0; i < n_scales; i++)
        if (!(isfinite(scales[i]) && scales[i] > 0.0f))
            return kvq_fail(err, KVQ_EINVAL, "%s: scale[%zu] = %g (expected finite and > 0)", what, i, (double)scales[i]);
    size_t row;
    if (kvq_mul_size(n_kv_heads, head_dim, &row) || kvq_mul_size(row, n_tokens, total))
        return kvq_fail(err, KVQ_ENOMEM, "%s: [%zu][%zu][%zu] overflows", what, n_tokens, n_kv_heads, head_dim);
    return KVQ_OK;
}

kvq_status kvq_fp8_kv_roundtrip(kvq_fp8_format f, const float *x, float *y, size_t n_tokens, size_t n_kv_heads,
                                size_t head_dim, const float *scales, size_t n_scales, kvq_err *err)
{
    size_t total;
    KVQ_TRY(check_kv("fp8 KV round trip", n_tokens, n_kv_heads, head_dim, scales, n_scales, &total, err));
    const size_t row = n_kv_heads * head_dim;
#pragma omp parallel for schedule(static) if (total > (1u << 16))
    for (size_t t = 0; t < n_tokens; t++)
        for (size_t h = 0; h < n_kv_heads; h++) {
            const float s = scales[n_scales == 1 ? 0 : h];
            const size_t at = t * row + h * head_dim;
            for (size_t j = 0; j < head_dim; j++) y[at + j] = kvq_fp8_decode(f, kvq_fp8_encode(f, x[at + j] / s)) * s;
        }
    return KVQ_OK;
}

kvq_status kvq_fp8_kv_quantize(kvq_fp8_format f, const float *x, uint8_t *codes, size_t n_tokens,
                               size_t n_kv_heads, size_t head_dim, const float *scales, size_t n_scales,
                               kvq_err *err)
{
    size_t total;
    KVQ_TRY(check_kv("fp8 KV quantize", n_tokens, n_kv_heads, head_dim, scales, n_scales, &total, err));
    const size_t row = n_kv_heads * head_dim;
#pragma omp parallel for schedule(static) if (total > (1u << 16))
    for (size_t t = 0; t < n_tokens; t++)
        for (size_t h = 0; h < n_kv_heads; h++) {
            const float s = scales[n_scales == 1 ? 0 : h];
            const size_t at = t * row + h * head_dim;
            for (size_t j = 0; j < head_dim; j++) codes[at + j] = kvq_fp8_encode(f, x[at + j] / s);
        }
    return KVQ_OK;
}

double kvq_fp8_bits_per_element(size_t n_scales, size_t n_tokens, size_t n_kv_heads, size_t head_dim)
{
    const double n = (double)n_tokens * (double)n_kv_heads * (double)head_dim;
    return n > 0 ? 8.0 + 32.0 * (double)n_scales / n : 8.0;
}

/* ---- calibration ---------------------------------------------------------- */

/* k-th smallest of a[0..n-1] (0-based); afterwards a[0..k-1] <= a[k] <=
 * a[k+1..n-1]. Wirth's selection (Algorithms + Data Structures = Programs,
 * 1976); no NaNs in a. */
static float select_kth(float *a, size_t n, size_t k)
{
    ptrdiff_t l = 0, m = (ptrdiff_t)n - 1;
    const ptrdiff_t kk = (ptrdiff_t)k;
    while (l < m) {
        const float x = a[kk];
        ptrdiff_t i = l, j = m;
        do {
            while (a[i] < x) i++;
            while (x < a[j]) j--;
            if (i <= j) {
                const float tmp = a[i];
                a[i] = a[j];
                a[j] = tmp;
                i++;
                j--;
            }
        } while (i <= j);
        if (j < kk) l = i;
        if (kk < i) m = j;
    }
    return a[kk];
}

/* p-th percentile (numpy "linear") of a[0..n-1], n >= 1; reorders a. */
static double percentile_of(float *a, size_t n, double p)
{
    if (n == 0) return 0.0;
    const double r = p / 100.0 * (double)(n - 1);
    size_t k = (size_t)floor(r);
    if (k >= n - 1) k = n - 1;
    const double lo = select_kth(a, n, k);
    if (k + 1 >= n) return lo;
    /* the next order statistic is the minimum of the part above k */
    float hi = a[k + 1];
    for (size_t i = k + 2; i < n; i++)
        if (a[i] < hi) hi = a[i];
    const double t = r - (double)k;
    const double diff = (double)hi - lo;
    return t >= 0.5 ? (double)hi - diff * (1.0 - t) : lo + diff * t;
}

static kvq_status check_calib(const char *what, const float *x, size_t n_tokens, size_t n_kv_heads, size_t head_dim,
                              double percentile, size_t *total, kvq_err *err)
{
    if (!n_tokens || !n_kv_heads || !head_dim)
        return kvq_fail(err, KVQ_EINVAL, "%s: empty block [%zu][%zu][%zu]", what, n_tokens, n_kv_heads, head_dim);
    if (!(percentile > 0.0 && percentile <= 100.0))
        return kvq_fail(err, KVQ_EINVAL, "%s: percentile %g (expected in (0, 100])", what, percentile);
    size_t row;
    if (kvq_mul_size(n_kv_heads, head_dim, &row) || kvq_mul_size(row, n_tokens, total))
        return kvq_fail(err, KVQ_ENOMEM, "%s: [%zu][%zu][%zu] overflows", what, n_tokens, n_kv_heads, head_dim);
    for (size_t i = 0; i < *total; i++)
        if (!isfinite(x[i]))
            return kvq_fail(err, KVQ_ENUMERIC, "%s: element %zu (token %zu, head %zu, dim %zu) is %s", what, i, i / row,
                            (i % row) / head_dim, i % head_dim, isnan(x[i]) ? "NaN" : "infinite");
    return KVQ_OK;
}

static float stat_to_scale(kvq_fp8_format f, double stat)
{
    const float s = (float)stat / kvq_fp8_max(f);
    return s > 0.0f ? s : 1.0f; /* all-zero data (or a statistic underflowing) -> engine default */
}

/* statistic of |x| over head h (or all heads when h == n_kv_heads) */
static kvq_status group_stat(const float *x, size_t n_tokens, size_t n_kv_heads, size_t head_dim, size_t h,
                             double percentile, double *out, kvq_err *err)
{
    const int all = h == n_kv_heads;
    const size_t row = n_kv_heads * head_dim, per_tok = all ? row : head_dim, n = n_tokens * per_tok;
    if (percentile >= 100.0) {
        float amax = 0.0f;
        for (size_t t = 0; t < n_tokens; t++) {
            const float *p = x + t * row + (all ? 0 : h * head_dim);
            for (size_t j = 0; j < per_tok; j++) amax = fmaxf(amax, fabsf(p[j]));
        }
        *out = amax;
        return KVQ_OK;
    }
    float *a = malloc(n * sizeof *a);
    if (!a) return kvq_fail(err, KVQ_ENOMEM, "fp8 calibration: cannot allocate %zu floats for the percentile", n);
    for (size_t t = 0; t < n_tokens; t++) {
        const float *p = x + t * row + (all ? 0 : h * head_dim);
        for (size_t j = 0; j < per_tok; j++) a[t * per_tok + j] = fabsf(p[j]);
    }
    *out = percentile_of(a, n, percentile);
    free(a);
    return KVQ_OK;
}

kvq_status kvq_fp8_calib_stat(const float *x, size_t n_tokens, size_t n_kv_heads, size_t head_dim, double percentile,
                              double *stat, kvq_err *err)
{
    size_t total;
    KVQ_TRY(check_calib("per-tensor calibration", x, n_tokens, n_kv_heads, head_dim, percentile, &total, err));
    return group_stat(x, n_tokens, n_kv_heads, head_dim, n_kv_heads, percentile, stat, err);
}

kvq_status kvq_fp8_calib_tensor(kvq_fp8_format f, const float *x, size_t n_tokens, size_t n_kv_heads,
                                size_t head_dim, double percentile, float *scale, kvq_err *err)
{
    size_t total;
    KVQ_TRY(check_calib("fp8 per-tensor calibration", x, n_tokens, n_kv_heads, head_dim, percentile, &total, err));
    double st;
    KVQ_TRY(group_stat(x, n_tokens, n_kv_heads, head_dim, n_kv_heads, percentile, &st, err));
    *scale = stat_to_scale(f, st);
    return KVQ_OK;
}

kvq_status kvq_fp8_calib_heads(kvq_fp8_format f, const float *x, size_t n_tokens, size_t n_kv_heads,
                               size_t head_dim, double percentile, float *scales, kvq_err *err)
{
    size_t total;
    KVQ_TRY(check_calib("fp8 per-head calibration", x, n_tokens, n_kv_heads, head_dim, percentile, &total, err));
    for (size_t h = 0; h < n_kv_heads; h++) {
        double st;
        KVQ_TRY(group_stat(x, n_tokens, n_kv_heads, head_dim, h, percentile, &st, err));
        scales[h] = stat_to_scale(f, st);
    }
    return KVQ_OK;
}

float kvq_fp8_saturation_edge(kvq_fp8_format f)
{
    return f == KVQ_FP8_E4M3FN ? 464.0f : 61440.0f;
}

uint64_t kvq_fp8_count_saturated(kvq_fp8_format f, const float *x, size_t n_tokens, size_t n_kv_heads, size_t head_dim,
                                 const float *scales, size_t n_scales)
{
    const float edge = kvq_fp8_saturation_edge(f);
    const size_t kvd = n_kv_heads * head_dim;
    uint64_t n = 0;
    for (size_t i = 0; i < n_tokens * kvd; i++) {
        const float sc = scales[n_scales == 1 ? 0 : (i % kvd) / head_dim];
        n += fabsf(x[i] / sc) >= edge;
    }
    return n;
}
