/* tables.c — per-(layer, K|V) nuqX / threshold tables; see tables.h. */
#include "tables.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "quant.h"  /* defines: kvq_outliers_per_side, kvq_token_range */
#include "select.h" /* defines: kvq_percentile_pair_f32 */

kvq_status kvq_calib_opts_validate(const kvq_calib_opts *o, kvq_err *err)
{
    if (!o) return kvq_fail(err, KVQ_EINVAL, "calibration options: NULL");
    if (o->bits < 1 || o->bits > 8) return kvq_fail(err, KVQ_EINVAL, "bits: expected 1..8, found %d", o->bits);
    if (!(o->outlier_frac >= 0 && o->outlier_frac < 0.5))
        return kvq_fail(err, KVQ_EINVAL, "outlier fraction: expected [0, 0.5), found %g", o->outlier_frac);
    if (o->n_kv_heads == 0 || o->head_dim == 0)
        return kvq_fail(err, KVQ_EINVAL, "n_kv_heads, head_dim: expected > 0, found %zu, %zu", o->n_kv_heads, o->head_dim);
    if (o->n_kv_heads > 65536 || o->head_dim > 65536)
        return kvq_fail(err, KVQ_EINVAL, "n_kv_heads, head_dim: at most 65536, found %zu, %zu", o->n_kv_heads, o->head_dim);
    if ((unsigned)o->fit.method > KVQ_FIT_EXACT)
        return kvq_fail(err, KVQ_EINVAL, "fit method: unknown value %d", (int)o->fit.method);
    return KVQ_OK;
}

static bool is_sink(const kvq_calib_opts *o, size_t t)
{
    size_t pos = o->sample_len ? t % o->sample_len : t;
    return pos < o->n_sink;
}

static kvq_status check_inputs(const float *x, const float *fisher, size_t n_tokens, size_t kv_dim, const char *what,
                               kvq_err *err)
{
    size_t n;
    if (kvq_mul_size(n_tokens, kv_dim, &n)) return kvq_fail(err, KVQ_ENOMEM, "%s: %zu x %zu overflows", what, n_tokens, kv_dim);
    if (!x && n) return kvq_fail(err, KVQ_EINVAL, "%s: NULL data", what);
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(x[i]))
            return kvq_fail(err, KVQ_ENUMERIC, "%s: token %zu, channel %zu: not finite (%g)", what, i / kv_dim,
                            i % kv_dim, (double)x[i]);
        if (fisher && !(isfinite(fisher[i]) && fisher[i] >= 0))
            return kvq_fail(err, KVQ_ENUMERIC, "%s Fisher: token %zu, channel %zu: expected finite and >= 0, found %g",
                            what, i / kv_dim, i % kv_dim, (double)fisher[i]);
    }
    return KVQ_OK;
}

static size_t count_used(const kvq_calib_opts *o, size_t n_tokens)
{
    size_t u = 0;
    for (size_t t = 0; t < n_tokens; t++) u += !is_sink(o, t);
    return u;
}

kvq_status kvq_calib_key_thresholds(const float *k, size_t n_tokens, const kvq_calib_opts *o, float *lower,
                                    float *upper, uint64_t *n_out, uint64_t *n_elems, kvq_err *err)
{
    KVQ_TRY(kvq_calib_opts_validate(o, err));
    size_t kv_dim = o->n_kv_heads * o->head_dim;
    KVQ_TRY(check_inputs(k, NULL, n_tokens, kv_dim, "keys", err));
    size_t used = count_used(o, n_tokens);
    if (used == 0)
        return kvq_fail(err, KVQ_EINVAL, "keys: no calibration tokens left after excluding %zu sink tokens per sample of %zu",
                        o->n_sink, o->sample_len ? o->sample_len : n_tokens);
    size_t *rows = malloc(used * sizeof *rows);
    float *col = malloc(used * sizeof *col);
    if (!rows || !col) {
        free(rows);
        free(col);
        return kvq_fail(err, KVQ_ENOMEM, "keys: cannot allocate %zu-token scratch", used);
    }
    size_t u = 0;
    for (size_t t = 0; t < n_tokens; t++)
        if (!is_sink(o, t)) rows[u++] = t;
    double tq = 1.0 - o->outlier_frac / 2;
    uint64_t outl = 0;
    for (size_t c = 0; c < kv_dim; c++) {
        for (size_t i = 0; i < used; i++) col[i] = k[rows[i] * kv_dim + c];
        kvq_percentile_pair_f32(col, used, tq, &lower[c], &upper[c]);
        for (size_t i = 0; i < used; i++) {
            float x = k[rows[i] * kv_dim + c];
            outl += x > upper[c] || x < lower[c];
        }
    }
    free(rows);
    free(col);
    if (n_out) *n_out = outl;
    if (n_elems) *n_elems = (uint64_t)used * kv_dim;
    return KVQ_OK;
}

/* ---- fitting ------------------------------------------------------------------- */

typedef struct {
    size_t n_tables, cap;
    float *x, *w;   /* [n_tables][cap] */
    size_t *n;      /* [n_tables] */
} pointsets;

static void ps_free(pointsets *p)
{
    free(p->x);
    free(p->w);
    free(p->n);
}

static kvq_status ps_alloc(pointsets *p, size_t n_tables, size_t cap, bool weights, kvq_err *err)
{
    memset(p, 0, sizeof *p);
    p->n_tables = n_tables;
    p->cap = cap;
    size_t tot;
    if (kvq_mul_size(n_tables, cap ? cap : 1, &tot)) return kvq_fail(err, KVQ_ENOMEM, "calibration points overflow");
    p->x = malloc(tot * sizeof *p->x);
    p->w = weights ? malloc(tot * sizeof *p->w) : NULL;
    p->n = calloc(n_tables, sizeof *p->n);
    if (!p->x || (weights && !p->w) || !p->n) {
        ps_free(p);
        return kvq_fail(err, KVQ_ENOMEM, "cannot allocate %zu calibration points", tot);
    }
    return KVQ_OK;
}

static inline void ps_push(pointsets *p, size_t table, float x, float w)
{
    size_t i = table * p->cap + p->n[table]++;
    p->x[i] = x;
    if (p->w) p->w[i] = w;
}

static inline float normalise(float x, double zp, double r)
{
    double xn = ((double)x - zp) / r;
    if (xn > 1) xn = 1;
    if (xn < -1) xn = -1;
    return (float)xn;
}

static kvq_status alloc_table(kvq_kv_table *t, const kvq_calib_opts *o, bool levels, bool thresholds, kvq_err *err)
{
    memset(t, 0, sizeof *t);
    size_t kv_dim = o->n_kv_heads * o->head_dim;
    t->bits = o->bits;
    t->kv_dim = kv_dim;
    t->n_tables = levels ? (o->per_head ? o->n_kv_heads : 1) : 0;
    size_t nl = (size_t)1 << o->bits;
    bool ok = true;
    if (levels) {
        t->levels = malloc(t->n_tables * nl * sizeof *t->levels);
        t->obj_lloyd = malloc(t->n_tables * sizeof *t->obj_lloyd);
        t->obj_exact = malloc(t->n_tables * sizeof *t->obj_exact);
        t->chosen = calloc(t->n_tables, 1);
        ok = t->levels && t->obj_lloyd && t->obj_exact && t->chosen;
    }
    if (thresholds) {
        t->channel_lower = malloc(kv_dim * sizeof *t->channel_lower);
        t->channel_upper = malloc(kv_dim * sizeof *t->channel_upper);
        ok = ok && t->channel_lower && t->channel_upper;
    }
    if (!ok) {
        kvq_kv_table_free(t);
        return kvq_fail(err, KVQ_ENOMEM, "cannot allocate calibration tables");
    }
    return KVQ_OK;
}

static kvq_status fit_tables(const pointsets *ps, const kvq_calib_opts *o, kvq_kv_table *t, const char *what,
                             kvq_err *err)
{
    size_t nl = (size_t)1 << o->bits;
    t->n_points = 0;
    for (size_t h = 0; h < ps->n_tables; h++) {
        float *lv = t->levels + h * nl;
        const float *x = ps->x + h * ps->cap, *w = ps->w ? ps->w + h * ps->cap : NULL;
        size_t n = ps->n[h];
        bool any = false;
        for (size_t i = 0; i < n && !any; i++) any = !w || w[i] > 0;
        if (!any) { /* nothing to fit (constant data, or zero Fisher everywhere) */
            for (size_t j = 0; j < nl; j++) lv[j] = nl > 1 ? (float)(-1.0 + 2.0 * (double)j / (double)(nl - 1)) : 0.0f;
            t->obj_lloyd[h] = t->obj_exact[h] = -1;
            t->chosen[h] = KVQ_FIT_CHOSEN_NONE;
            continue;
        }
        kvq_kmeans_info info;
        kvq_status s = kvq_kmeans1d(x, w, n, (int)nl, &o->fit, lv, &info, err);
        if (s != KVQ_OK) {
            if (ps->n_tables > 1) return kvq_err_prefix(err, "%s head %zu", what, h);
            return kvq_err_prefix(err, "%s", what);
        }
        for (size_t j = 0; j < nl; j++) { /* points are in [-1, 1]; keep levels there exactly */
            if (lv[j] > 1.0f) lv[j] = 1.0f;
            if (lv[j] < -1.0f) lv[j] = -1.0f;
        }
        t->obj_lloyd[h] = info.obj_lloyd;
        t->obj_exact[h] = info.obj_exact;
        t->chosen[h] = info.chosen == KVQ_FIT_LLOYD ? KVQ_FIT_CHOSEN_LLOYD : KVQ_FIT_CHOSEN_EXACT;
        t->n_points += info.n_points;
    }
    return KVQ_OK;
}

kvq_status kvq_calib_keys(const float *k, const float *fisher, size_t n_tokens, const kvq_calib_opts *o,
                          kvq_kv_table *out, kvq_err *err)
{
    memset(out, 0, sizeof *out);
    KVQ_TRY(kvq_calib_opts_validate(o, err));
    size_t kv_dim = o->n_kv_heads * o->head_dim;
    KVQ_TRY(check_inputs(k, fisher, n_tokens, kv_dim, "keys", err));
    kvq_kv_table t;
    KVQ_TRY(alloc_table(&t, o, true, true, err));
    kvq_status s = kvq_calib_key_thresholds(k, n_tokens, o, t.channel_lower, t.channel_upper, &t.n_outliers,
                                            &t.n_elems, err);
    if (s != KVQ_OK) { kvq_kv_table_free(&t); return s; }
    size_t used = count_used(o, n_tokens);
    size_t per_table = used * (t.n_tables > 1 ? o->head_dim : kv_dim);
    pointsets ps;
    s = ps_alloc(&ps, t.n_tables, per_table, fisher != NULL, err);
    if (s != KVQ_OK) { kvq_kv_table_free(&t); return s; }
    for (size_t tk = 0; tk < n_tokens; tk++) {
        if (is_sink(o, tk)) continue;
        const float *row = k + tk * kv_dim;
        for (size_t c = 0; c < kv_dim; c++) {
            float x = row[c], lo = t.channel_lower[c], hi = t.channel_upper[c];
            if (x > hi || x < lo || hi == lo) continue;
            double zp = ((double)hi + (double)lo) * 0.5, r = ((double)hi - (double)lo) * 0.5;
            ps_push(&ps, t.n_tables > 1 ? c / o->head_dim : 0, normalise(x, zp, r), fisher ? fisher[tk * kv_dim + c] : 1);
        }
    }
    s = fit_tables(&ps, o, &t, "keys", err);
    ps_free(&ps);
    if (s != KVQ_OK) { kvq_kv_table_free(&t); return s; }
    *out = t;
    return KVQ_OK;
}

kvq_status kvq_calib_values(const float *v, const float *fisher, size_t n_tokens, const kvq_calib_opts *o,
                            kvq_kv_table *out, kvq_err *err)
{
    memset(out, 0, sizeof *out);
    KVQ_TRY(kvq_calib_opts_validate(o, err));
    size_t kv_dim = o->n_kv_heads * o->head_dim;
    KVQ_TRY(check_inputs(v, fisher, n_tokens, kv_dim, "values", err));
    size_t used = count_used(o, n_tokens);
    if (used == 0)
        return kvq_fail(err, KVQ_EINVAL, "values: no calibration tokens left after excluding %zu sink tokens per sample",
                        o->n_sink);
    kvq_kv_table t;
    KVQ_TRY(alloc_table(&t, o, true, false, err));
    size_t per_table = used * (t.n_tables > 1 ? o->head_dim : kv_dim);
    pointsets ps;
    kvq_status s = ps_alloc(&ps, t.n_tables, per_table, fisher != NULL, err);
    float *scratch = malloc(kv_dim * sizeof *scratch);
    if (s == KVQ_OK && !scratch) { ps_free(&ps); s = kvq_fail(err, KVQ_ENOMEM, "values: out of memory"); }
    if (s != KVQ_OK) { free(scratch); kvq_kv_table_free(&t); return s; }
    size_t kps = kvq_outliers_per_side(kv_dim, o->outlier_frac);
    for (size_t tk = 0; tk < n_tokens; tk++) {
        if (is_sink(o, tk)) continue;
        const float *row = v + tk * kv_dim;
        float lo, hi;
        kvq_token_range(row, kv_dim, kps, scratch, &lo, &hi);
        double zp = ((double)hi + (double)lo) * 0.5, r = ((double)hi - (double)lo) * 0.5;
        t.n_elems += kv_dim;
        for (size_t c = 0; c < kv_dim; c++) {
            float x = row[c];
            if (kps && (x < lo || x > hi)) { t.n_outliers++; continue; }
            if (r == 0) continue;
            ps_push(&ps, t.n_tables > 1 ? c / o->head_dim : 0, normalise(x, zp, r), fisher ? fisher[tk * kv_dim + c] : 1);
        }
    }
    free(scratch);
    s = fit_tables(&ps, o, &t, "values", err);
    ps_free(&ps);
    if (s != KVQ_OK) { kvq_kv_table_free(&t); return s; }
    *out = t;
    return KVQ_OK;
}

kvq_status kvq_calib_int_pc_keys(const float *k, size_t n_tokens, const kvq_calib_opts *o, kvq_kv_table *out,
                                 kvq_err *err)
{
    memset(out, 0, sizeof *out);
    KVQ_TRY(kvq_calib_opts_validate(o, err));
    kvq_kv_table t;
    KVQ_TRY(alloc_table(&t, o, false, true, err));
    kvq_status s = kvq_calib_key_thresholds(k, n_tokens, o, t.channel_lower, t.channel_upper, &t.n_outliers,
                                            &t.n_elems, err);
    if (s != KVQ_OK) { kvq_kv_table_free(&t); return s; }
    *out = t;
    return KVQ_OK;
}
