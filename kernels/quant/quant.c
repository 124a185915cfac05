/* quant.c — quantize→dequantize reference primitives; see quant.h. */
#include "quant.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "safetensors.h" /* defines: kvq_f32_to_f16, kvq_f16_to_f32 */
#include "select.h"
#include "half.h"

/* ---- shared checks -------------------------------------------------------- */

static kvq_status check_bits(int bits, const char *field, kvq_err *err)
{
    if (bits < 1 || bits > KVQ_QUANT_MAX_BITS)
        return kvq_fail(err, KVQ_EINVAL, "%s: expected 1..%d, found %d", field, KVQ_QUANT_MAX_BITS, bits);
    return KVQ_OK;
}

static kvq_status check_shape(const float *out, const float *in, size_t n_tokens, size_t kv_dim,
                              const char *fn, kvq_err *err)
{
    size_t n;
    if (kv_dim == 0) return kvq_fail(err, KVQ_EINVAL, "%s: kv_dim: expected > 0, found 0", fn);
    if (kvq_mul_size(n_tokens, kv_dim, &n))
        return kvq_fail(err, KVQ_ENOMEM, "%s: n_tokens %zu x kv_dim %zu overflows", fn, n_tokens, kv_dim);
    if (n_tokens && (!out || !in)) return kvq_fail(err, KVQ_EINVAL, "%s: NULL data pointer", fn);
    return KVQ_OK;
}

static void count_add(kvq_quant_counts *c, uint64_t elems, uint64_t outl, uint64_t sink, uint64_t exact)
{
    if (!c) return;
    c->n_elems += elems;
    c->n_outliers += outl;
    c->n_sink += sink;
    c->n_exact += exact;
}

static void copy_rows(float *out, const float *in, size_t n)
{
    if (out != in) memmove(out, in, n * sizeof *out);
}

/* ---- fp16 ------------------------------------------------------------------ */

float kvq_round_fp16(float x)
{
    if (x > 65504.0f) return 65504.0f;
    if (x < -65504.0f) return -65504.0f;
    return kvq_f16_to_f32(kvq_f32_to_f16(x));
}

void kvq_quant_fp16(float *out, const float *in, size_t n, kvq_quant_counts *counts)
{
    uint64_t clipped = 0;
    for (size_t i = 0; i < n; i++) {
        clipped += fabsf(in[i]) >= KVQ_FP16_OVERFLOW;
        out[i] = kvq_round_fp16(in[i]);
    }
    count_add(counts, n, 0, 0, 0);
    if (counts) counts->n_clipped += clipped;
}

/* ---- uniform -------------------------------------------------------------- */

/* x̂ for one value; s == 0 reproduces mn exactly */
static inline float uq(float x, double mn, double s, double qmax)
{
    if (s == 0) return (float)mn;
    double q = rint(((double)x - mn) / s);
    if (q < 0) q = 0;
    if (q > qmax) q = qmax;
    return (float)(q * s + mn);
}

static void uq_span(float *out, const float *in, size_t n, int bits)
{
    float mn = in[0], mx = in[0];
    for (size_t i = 1; i < n; i++) {
        if (in[i] < mn) mn = in[i];
        if (in[i] > mx) mx = in[i];
    }
    double qmax = (double)((1u << bits) - 1);
    double s = ((double)mx - (double)mn) / qmax;
    for (size_t i = 0; i < n; i++) out[i] = uq(in[i], mn, s, qmax);
}

kvq_status kvq_quant_int_token(float *out, const float *in, size_t n_tokens, size_t kv_dim,
                               size_t group, int bits, size_t n_sink,
                               kvq_quant_counts *counts, kvq_err *err)
{
    KVQ_TRY(check_shape(out, in, n_tokens, kv_dim, "int per-token", err));
    KVQ_TRY(check_bits(bits, "int per-token: bits", err));
    if (group == 0) group = kv_dim;
    if (kv_dim % group)
        return kvq_fail(err, KVQ_EINVAL, "int per-token: group size %zu does not divide kv_dim %zu", group, kv_dim);
    size_t ns = n_sink < n_tokens ? n_sink : n_tokens;
    copy_rows(out, in, ns * kv_dim);
    for (size_t t = ns; t < n_tokens; t++)
        for (size_t g = 0; g < kv_dim; g += group)
            uq_span(out + t * kv_dim + g, in + t * kv_dim + g, group, bits);
    count_add(counts, (uint64_t)n_tokens * kv_dim, 0, (uint64_t)ns * kv_dim, 0);
    return KVQ_OK;
}

static kvq_status check_thresholds(const float *lower, const float *upper, size_t kv_dim,
                                   const char *fn, kvq_err *err)
{
    if (!lower || !upper) return kvq_fail(err, KVQ_EINVAL, "%s: channel thresholds missing", fn);
    for (size_t c = 0; c < kv_dim; c++) {
        if (!isfinite(lower[c]) || !isfinite(upper[c]) || lower[c] > upper[c])
            return kvq_fail(err, KVQ_EINVAL,
                            "%s: channel %zu: thresholds must be finite with lower <= upper, found [%g, %g]",
                            fn, c, (double)lower[c], (double)upper[c]);
    }
    return KVQ_OK;
}

kvq_status kvq_quant_int_channel(float *out, const float *in, size_t n_tokens, size_t kv_dim,
                                 const float *lower, const float *upper, int bits, bool outliers,
                                 size_t n_sink, kvq_quant_counts *counts, kvq_err *err)
{
    KVQ_TRY(check_shape(out, in, n_tokens, kv_dim, "int per-channel", err));
    KVQ_TRY(check_bits(bits, "int per-channel: bits", err));
    KVQ_TRY(check_thresholds(lower, upper, kv_dim, "int per-channel", err));
    size_t ns = n_sink < n_tokens ? n_sink : n_tokens;
    copy_rows(out, in, ns * kv_dim);
    double qmax = (double)((1u << bits) - 1);
    uint64_t n_out = 0;
    for (size_t t = ns; t < n_tokens; t++) {
        const float *x = in + t * kv_dim;
        float *y = out + t * kv_dim;
        for (size_t c = 0; c < kv_dim; c++) {
            float v = x[c];
            if (outliers && (v > upper[c] || v < lower[c])) { y[c] = v; n_out++; continue; }
            double s = ((double)upper[c] - (double)lower[c]) / qmax;
            y[c] = uq(v, lower[c], s, qmax);
        }
    }
    count_add(counts, (uint64_t)n_tokens * kv_dim, n_out, (uint64_t)ns * kv_dim, 0);
    return KVQ_OK;
}

/* ---- nuq ------------------------------------------------------------------- */

size_t kvq_nuq_nearest(const float *lv, size_t n, float x)
{
    size_t lo = 0, hi = n; /* lo = number of levels <= x */
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (lv[mid] <= x) lo = mid + 1;
        else hi = mid;
    }
    size_t best;
    if (lo == 0) best = 0;
    else if (lo == n) best = n - 1;
    else best = fabsf(lv[lo] - x) < fabsf(x - lv[lo - 1]) ? lo : lo - 1;
    float bd = fabsf(x - lv[best]);
    while (best > 0 && fabsf(x - lv[best - 1]) <= bd) { best--; bd = fabsf(x - lv[best]); }
    return best;
}

static inline float nuq_one(float x, double zp, double r, const float *lv, size_t nl)
{
    if (r == 0) return (float)zp;
    double xn = ((double)x - zp) / r;
    if (!(xn >= lv[0])) xn = lv[0]; /* also maps NaN somewhere finite */
    if (xn > lv[nl - 1]) xn = lv[nl - 1];
    size_t i = kvq_nuq_nearest(lv, nl, (float)xn);
    return (float)((double)lv[i] * r + zp);
}

static kvq_status check_lut(const kvq_nuq_lut *lut, size_t kv_dim, const char *fn, kvq_err *err)
{
    if (!lut || !lut->levels) return kvq_fail(err, KVQ_EINVAL, "%s: nuq levels missing", fn);
    if (lut->bits < 1 || lut->bits > KVQ_QUANT_MAX_BITS)
        return kvq_fail(err, KVQ_EINVAL, "%s: nuq bits: expected 1..%d, found %d", fn, KVQ_QUANT_MAX_BITS, lut->bits);
    if (lut->n_tables == 0) return kvq_fail(err, KVQ_EINVAL, "%s: nuq n_tables: expected >= 1, found 0", fn);
    if (lut->n_tables > 1 && (lut->head_dim == 0 || lut->head_dim * lut->n_tables != kv_dim))
        return kvq_fail(err, KVQ_EINVAL, "%s: per-head nuq tables: n_tables %zu x head_dim %zu != kv_dim %zu",
                        fn, lut->n_tables, lut->head_dim, kv_dim);
    size_t nl = (size_t)1 << lut->bits;
    for (size_t h = 0; h < lut->n_tables; h++) {
        const float *lv = lut->levels + h * nl;
        for (size_t j = 0; j < nl; j++) {
            if (!isfinite(lv[j]) || (j && lv[j] < lv[j - 1]))
                return kvq_fail(err, KVQ_EINVAL, "%s: nuq table %zu level %zu: expected finite and ascending, found %g",
                                fn, h, j, (double)lv[j]);
        }
    }
    return KVQ_OK;
}

static inline const float *lut_for(const kvq_nuq_lut *lut, size_t c)
{
    size_t nl = (size_t)1 << lut->bits;
    return lut->n_tables > 1 ? lut->levels + (c / lut->head_dim) * nl : lut->levels;
}

kvq_status kvq_quant_nuq_keys(float *out, const float *in, size_t n_tokens, size_t kv_dim,
                              const kvq_nuq_lut *lut, const float *lower, const float *upper,
                              bool outliers, size_t n_sink, kvq_quant_counts *counts, kvq_err *err)
{
    KVQ_TRY(check_shape(out, in, n_tokens, kv_dim, "nuq keys", err));
    KVQ_TRY(check_lut(lut, kv_dim, "nuq keys", err));
    KVQ_TRY(check_thresholds(lower, upper, kv_dim, "nuq keys", err));
    size_t nl = (size_t)1 << lut->bits;
    size_t ns = n_sink < n_tokens ? n_sink : n_tokens;
    copy_rows(out, in, ns * kv_dim);
    uint64_t n_out = 0;
    for (size_t t = ns; t < n_tokens; t++) {
        const float *x = in + t * kv_dim;
        float *y = out + t * kv_dim;
        for (size_t c = 0; c < kv_dim; c++) {
            float v = x[c];
            if (outliers && (v > upper[c] || v < lower[c])) { y[c] = v; n_out++; continue; }
            double zp = ((double)upper[c] + (double)lower[c]) * 0.5;
            double r = ((double)upper[c] - (double)lower[c]) * 0.5;
            y[c] = nuq_one(v, zp, r, lut_for(lut, c), nl);
        }
    }
    count_add(counts, (uint64_t)n_tokens * kv_dim, n_out, (uint64_t)ns * kv_dim, 0);
    return KVQ_OK;
}

size_t kvq_outliers_per_side(size_t n, double f)
{
    if (!(f > 0) || n < 2) return 0;
    double p = (1.0 - f / 2) * (double)(n - 1);
    double r = nearbyint(p);
    if (fabs(p - r) <= 1e-9 * (double)n) p = r; /* 0.99*100 is 99.00000000000001 */
    double c = ceil(p);
    size_t k = c >= (double)n ? 0 : n - (size_t)c;
    size_t cap = (n - 1) / 2;
    return k > cap ? cap : k;
}

void kvq_token_range(const float *row, size_t n, size_t k, float *scratch, float *lo, float *hi)
{
    if (k == 0) {
        float mn = row[0], mx = row[0];
        for (size_t i = 1; i < n; i++) {
            if (row[i] < mn) mn = row[i];
            if (row[i] > mx) mx = row[i];
        }
        *lo = mn;
        *hi = mx;
        return;
    }
    memcpy(scratch, row, n * sizeof *row);
    *hi = kvq_select_f32(scratch, n, n - 1 - k);
    *lo = kvq_select_f32(scratch, n, k);
}

kvq_status kvq_quant_nuq_values(float *out, const float *in, size_t n_tokens, size_t kv_dim,
                                const kvq_nuq_lut *lut, double outlier_frac, size_t n_sink,
                                kvq_quant_counts *counts, kvq_err *err)
{
    KVQ_TRY(check_shape(out, in, n_tokens, kv_dim, "nuq values", err));
    KVQ_TRY(check_lut(lut, kv_dim, "nuq values", err));
    if (!(outlier_frac >= 0 && outlier_frac < 0.5))
        return kvq_fail(err, KVQ_EINVAL, "nuq values: outlier fraction: expected [0, 0.5), found %g", outlier_frac);
    size_t nl = (size_t)1 << lut->bits;
    size_t k = kvq_outliers_per_side(kv_dim, outlier_frac);
    float *scratch = NULL;
    if (k && !(scratch = malloc(kv_dim * sizeof *scratch)))
        return kvq_fail(err, KVQ_ENOMEM, "nuq values: cannot allocate %zu floats", kv_dim);
    size_t ns = n_sink < n_tokens ? n_sink : n_tokens;
    copy_rows(out, in, ns * kv_dim);
    uint64_t n_out = 0;
    for (size_t t = ns; t < n_tokens; t++) {
        const float *x = in + t * kv_dim;
        float *y = out + t * kv_dim;
        float lo, hi;
        kvq_token_range(x, kv_dim, k, scratch, &lo, &hi);
        double zp = ((double)hi + (double)lo) * 0.5, r = ((double)hi - (double)lo) * 0.5;
        for (size_t c = 0; c < kv_dim; c++) {
            float v = x[c];
            if (k && (v < lo || v > hi)) { y[c] = v; n_out++; continue; }
            y[c] = nuq_one(v, zp, r, lut_for(lut, c), nl);
        }
    }
    free(scratch);
    count_add(counts, (uint64_t)n_tokens * kv_dim, n_out, (uint64_t)ns * kv_dim, 0);
    return KVQ_OK;
}

/* ---- KIVI ------------------------------------------------------------------ */

kvq_status kvq_kivi_keys(float *out, const float *in, size_t n_tokens, size_t kv_dim,
                         size_t group, int bits, size_t n_sink,
                         kvq_quant_counts *counts, kvq_err *err)
{
    KVQ_TRY(check_shape(out, in, n_tokens, kv_dim, "kivi keys", err));
    KVQ_TRY(check_bits(bits, "kivi keys: bits", err));
    if (group == 0) return kvq_fail(err, KVQ_EINVAL, "kivi keys: group size: expected > 0, found 0");
    size_t ns = n_sink < n_tokens ? n_sink : n_tokens;
    size_t n_groups = (n_tokens - ns) / group, qend = ns + n_groups * group;
    float *mn = malloc(2 * kv_dim * sizeof *mn);
    if (!mn) return kvq_fail(err, KVQ_ENOMEM, "kivi keys: cannot allocate %zu floats", 2 * kv_dim);
    float *mx = mn + kv_dim;
    copy_rows(out, in, ns * kv_dim);
    double qmax = (double)((1u << bits) - 1);
    for (size_t g = 0; g < n_groups; g++) {
        const float *x0 = in + (ns + g * group) * kv_dim;
        memcpy(mn, x0, kv_dim * sizeof *mn);
        memcpy(mx, x0, kv_dim * sizeof *mx);
        for (size_t t = 1; t < group; t++)
            for (size_t c = 0; c < kv_dim; c++) {
                float v = x0[t * kv_dim + c];
                if (v < mn[c]) mn[c] = v;
                if (v > mx[c]) mx[c] = v;
            }
        float *y0 = out + (ns + g * group) * kv_dim;
        for (size_t t = 0; t < group; t++)
            for (size_t c = 0; c < kv_dim; c++) {
                double s = ((double)mx[c] - (double)mn[c]) / qmax;
                y0[t * kv_dim + c] = uq(x0[t * kv_dim + c], mn[c], s, qmax);
            }
    }
    copy_rows(out + qend * kv_dim, in + qend * kv_dim, (n_tokens - qend) * kv_dim);
    free(mn);
    count_add(counts, (uint64_t)n_tokens * kv_dim, 0, (uint64_t)ns * kv_dim, (uint64_t)(n_tokens - qend) * kv_dim);
    return KVQ_OK;
}

kvq_status kvq_kivi_values(float *out, const float *in, size_t n_tokens, size_t kv_dim,
                           size_t head_dim, size_t group, int bits, size_t n_sink,
                           kvq_quant_counts *counts, kvq_err *err)
{
    if (group == 0 || head_dim == 0 || head_dim % group || kv_dim % head_dim)
        return kvq_fail(err, KVQ_EINVAL,
                        "kivi values: group size %zu must divide head_dim %zu, which must divide kv_dim %zu",
                        group, head_dim, kv_dim);
    return kvq_quant_int_token(out, in, n_tokens, kv_dim, group, bits, n_sink, counts, err);
}

size_t kvq_kivi_key_boundary(size_t t, size_t group, size_t residual, size_t n_sink)
{
    size_t f = residual ? residual : group;
    if (t < n_sink) return t + 1; /* only sink tokens so far: all exact either way */
    if (f == 0) return n_sink;
    return n_sink + f * ((t - n_sink) / f);
}

size_t kvq_kivi_value_boundary(size_t t, size_t residual, size_t n_sink)
{
    if (t < n_sink) return t + 1;
    if (t < n_sink + residual) return n_sink;
    return t - residual;
}

/* ---- schemes ------------------------------------------------------------- */

