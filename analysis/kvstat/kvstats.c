/* kvstats.c — see kvstats.h. */
#include "kvstats.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "progress.h"
#include "quant.h"

/* ---- names ------------------------------------------------------------------ */

const char *kvq_kvt_name(kvq_kvt t)
{
    static const char *const n[KVQ_KVT_COUNT] = {"k_pre_rope", "k", "v", "fisher_k_pre_rope", "fisher_v",
                                                 "attn_received"};
    return (unsigned)t < KVQ_KVT_COUNT ? n[t] : "?";
}

const char *kvq_kvt_title(kvq_kvt t)
{
    static const char *const n[KVQ_KVT_COUNT] = {"pre-RoPE keys", "post-RoPE keys", "values",
                                                 "Fisher of pre-RoPE keys", "Fisher of values",
                                                 "attention received"};
    return (unsigned)t < KVQ_KVT_COUNT ? n[t] : "?";
}

const char *kvq_outlier_stat_name(kvq_outlier_stat s)
{
    switch (s) {
    case KVQ_OUTLIER_MEAN_ABS: return "mean";
    case KVQ_OUTLIER_ABSMAX: return "absmax";
    case KVQ_OUTLIER_P99: return "p99";
    }
    return "?";
}

double kvq_chan_stat_value(const kvq_chan_stats *c, kvq_outlier_stat s)
{
    switch (s) {
    case KVQ_OUTLIER_ABSMAX: return c->absmax;
    case KVQ_OUTLIER_P99: return c->p99;
    case KVQ_OUTLIER_MEAN_ABS: break;
    }
    return c->mean_abs;
}

/* ---- memory source ------------------------------------------------------------ */

static kvq_status mem_read_rows(void *ctx, int layer, kvq_kvt t, int64_t sample, int64_t t0, int64_t n,
                                float *out, kvq_err *err)
{
    const kvq_kvsrc_mem *m = ctx;
    const kvq_kvsrc *sh = &m->shape;
    if ((unsigned)t >= KVQ_KVT_COUNT || !m->t[t])
        return kvq_fail(err, KVQ_EINVAL, "memory source: tensor '%s' absent", kvq_kvt_name(t));
    if (layer < sh->layer_first || layer > sh->layer_last)
        return kvq_fail(err, KVQ_EINVAL, "memory source: layer %d outside %d..%d", layer, sh->layer_first,
                        sh->layer_last);
    if (sample < 0 || sample >= sh->n_samples || t0 < 0 || n < 0 || t0 + n > sh->seq_len)
        return kvq_fail(err, KVQ_EINVAL, "memory source: sample %lld rows [%lld, %lld) outside [0, %lld) x [0, %lld)",
                        (long long)sample, (long long)t0, (long long)(t0 + n), (long long)sh->n_samples,
                        (long long)sh->seq_len);
    const float *a = m->t[t][layer - sh->layer_first];
    size_t L = (size_t)sh->seq_len;
    if (t == KVQ_KVT_ATTN_RECEIVED) {
        for (int h = 0; h < sh->n_heads; h++)
            memcpy(out + (size_t)h * (size_t)n, a + ((size_t)sample * (size_t)sh->n_heads + (size_t)h) * L + (size_t)t0,
                   (size_t)n * sizeof(float));
    } else {
        size_t row = (size_t)sh->n_kv_heads * (size_t)sh->head_dim;
        memcpy(out, a + ((size_t)sample * L + (size_t)t0) * row, (size_t)n * row * sizeof(float));
    }
    return KVQ_OK;
}

static kvq_status mem_read_tokens(void *ctx, int64_t s0, int64_t n, int32_t *out, kvq_err *err)
{
    const kvq_kvsrc_mem *m = ctx;
    if (s0 < 0 || n < 0 || s0 + n > m->shape.n_samples)
        return kvq_fail(err, KVQ_EINVAL, "memory source: token samples [%lld, %lld) outside [0, %lld)",
                        (long long)s0, (long long)(s0 + n), (long long)m->shape.n_samples);
    memcpy(out, m->tokens + (size_t)s0 * (size_t)m->shape.seq_len, (size_t)n * (size_t)m->shape.seq_len * sizeof(int32_t));
    return KVQ_OK;
}

static kvq_status check_shape(const kvq_kvsrc *s, kvq_err *err)
{
    if (s->n_layers < 1 || s->n_heads < 1 || s->n_kv_heads < 1 || s->head_dim < 1 || s->n_samples < 1 ||
        s->seq_len < 1)
        return kvq_fail(err, KVQ_EINVAL,
                        "source shape: expected positive n_layers, n_heads, n_kv_heads, head_dim, n_samples, "
                        "seq_len; found %d, %d, %d, %d, %lld, %lld",
                        s->n_layers, s->n_heads, s->n_kv_heads, s->head_dim, (long long)s->n_samples,
                        (long long)s->seq_len);
    if (s->layer_first < 0 || s->layer_last < s->layer_first || s->layer_last >= s->n_layers)
        return kvq_fail(err, KVQ_EINVAL, "source shape: layer range %d..%d is not inside 0..%d", s->layer_first,
                        s->layer_last, s->n_layers - 1);
    if (s->n_heads % s->n_kv_heads)
        return kvq_fail(err, KVQ_EINVAL, "source shape: n_heads %d is not a multiple of n_kv_heads %d", s->n_heads,
                        s->n_kv_heads);
    size_t a, b;
    if (kvq_mul_size((size_t)s->n_kv_heads, (size_t)s->head_dim, &a) ||
        kvq_mul_size((size_t)s->n_samples, (size_t)s->seq_len, &b) || kvq_mul_size(a, b, &a) ||
        kvq_mul_size((size_t)s->n_heads, b, &b) || a > (size_t)INT32_MAX * 64)
        return kvq_fail(err, KVQ_ENOMEM, "source shape: N x L x kv_dim overflows");
    return KVQ_OK;
}

kvq_status kvq_kvsrc_mem_init(kvq_kvsrc *src, kvq_kvsrc_mem *m, kvq_err *err)
{
    KVQ_TRY(check_shape(src, err));
    for (int t = 0; t < KVQ_KVT_N_STAT; t++)
        if (!m->t[t]) return kvq_fail(err, KVQ_EINVAL, "memory source: required tensor '%s' is NULL", kvq_kvt_name((kvq_kvt)t));
    if (!m->tokens) return kvq_fail(err, KVQ_EINVAL, "memory source: tokens are NULL");
    src->has_fisher = m->t[KVQ_KVT_FISHER_K_PRE_ROPE] && m->t[KVQ_KVT_FISHER_V];
    src->has_attn = m->t[KVQ_KVT_ATTN_RECEIVED] != NULL;
    src->ctx = m;
    src->read_rows = mem_read_rows;
    src->read_tokens = mem_read_tokens;
    m->shape = *src;
    return KVQ_OK;
}

/* Positions per slab read by the helpers below. */
#define KVQ_HEAD_CHUNK 256

kvq_status kvq_kvsrc_read_head(const kvq_kvsrc *src, int layer, kvq_kvt t, int64_t sample, int head, float *out,
                               kvq_err *err)
{
    if (t >= KVQ_KVT_ATTN_RECEIVED)
        return kvq_fail(err, KVQ_EINVAL, "read_head: '%s' is not a per-token tensor", kvq_kvt_name(t));
    if (layer < src->layer_first || layer > src->layer_last)
        return kvq_fail(err, KVQ_EINVAL, "layer %d is not in the dump (layers %d..%d)", layer, src->layer_first,
                        src->layer_last);
    if (head < 0 || head >= src->n_kv_heads)
        return kvq_fail(err, KVQ_EINVAL, "KV head %d does not exist (the model has %d KV heads: 0..%d)", head,
                        src->n_kv_heads, src->n_kv_heads - 1);
    if (sample < 0 || sample >= src->n_samples)
        return kvq_fail(err, KVQ_EINVAL, "sample %lld does not exist (the dump has %lld samples: 0..%lld)",
                        (long long)sample, (long long)src->n_samples, (long long)src->n_samples - 1);
    size_t kv_dim = (size_t)src->n_kv_heads * (size_t)src->head_dim, D = (size_t)src->head_dim;
    float *buf = malloc(KVQ_HEAD_CHUNK * kv_dim * sizeof(float));
    if (!buf) return kvq_fail(err, KVQ_ENOMEM, "read_head: out of memory");
    kvq_status st = KVQ_OK;
    for (int64_t t0 = 0; t0 < src->seq_len && st == KVQ_OK; t0 += KVQ_HEAD_CHUNK) {
        int64_t n = src->seq_len - t0 < KVQ_HEAD_CHUNK ? src->seq_len - t0 : KVQ_HEAD_CHUNK;
        st = src->read_rows(src->ctx, layer, t, sample, t0, n, buf, err);
        for (int64_t i = 0; st == KVQ_OK && i < n; i++)
            memcpy(out + (size_t)(t0 + i) * D, buf + (size_t)i * kv_dim + (size_t)head * D, D * sizeof(float));
    }
    free(buf);
    return st;
}

/* ---- moments ------------------------------------------------------------------ */

void kvq_moments_push(kvq_moments *m, double x)
{
    double n1 = m->n, n = n1 + 1;
    double d = x - m->mean, dn = d / n, dn2 = dn * dn, t1 = d * dn * n1;
    m->mean += dn;
    m->m4 += t1 * dn2 * (n * n - 3 * n + 3) + 6 * dn2 * m->m2 - 4 * dn * m->m3;
    m->m3 += t1 * dn * (n - 2) - 3 * dn * m->m2;
    m->m2 += t1;
    m->n = n;
}

void kvq_moments_merge(kvq_moments *a, const kvq_moments *b)
{
    if (b->n == 0) return;
    if (a->n == 0) { *a = *b; return; }
    double na = a->n, nb = b->n, n = na + nb;
    double d = b->mean - a->mean, d2 = d * d, d3 = d2 * d, d4 = d2 * d2;
    double m2 = a->m2 + b->m2 + d2 * na * nb / n;
    double m3 = a->m3 + b->m3 + d3 * na * nb * (na - nb) / (n * n) + 3 * d * (na * b->m2 - nb * a->m2) / n;
    double m4 = a->m4 + b->m4 + d4 * na * nb * (na * na - na * nb + nb * nb) / (n * n * n) +
                6 * d2 * (na * na * b->m2 + nb * nb * a->m2) / (n * n) + 4 * d * (na * b->m3 - nb * a->m3) / n;
    a->mean += d * nb / n;
    a->m2 = m2;
    a->m3 = m3;
    a->m4 = m4;
    a->n = n;
}

/* Two-pass moments of x[i*stride] (or |x| when absval). */
static kvq_moments moments_of(const float *x, size_t n, size_t stride, bool absval)
{
    kvq_moments m = {0};
    if (n == 0) return m;
    double s = 0;
    for (size_t i = 0; i < n; i++) s += absval ? fabs((double)x[i * stride]) : (double)x[i * stride];
    double mean = s / (double)n, m2 = 0, m3 = 0, m4 = 0;
    for (size_t i = 0; i < n; i++) {
        double v = absval ? fabs((double)x[i * stride]) : (double)x[i * stride];
        double d = v - mean, d2 = d * d;
        m2 += d2;
        m3 += d2 * d;
        m4 += d2 * d2;
    }
    m.n = (double)n;
    m.mean = mean;
    m.m2 = m2;
    m.m3 = m3;
    m.m4 = m4;
    return m;
}

kvq_moments kvq_moments_of(const float *x, size_t n, size_t stride) { return moments_of(x, n, stride, false); }

double kvq_moments_var(const kvq_moments *m) { return m->n > 0 ? m->m2 / m->n : 0; }

double kvq_moments_kurtosis(const kvq_moments *m) { return m->m2 > 0 ? m->n * m->m4 / (m->m2 * m->m2) : 0; }

/* ---- sketch ------------------------------------------------------------------- */

kvq_status kvq_sketch_init(kvq_sketch *s, double alpha, double vmin, double vmax, kvq_err *err)
{
    if (!(alpha > 0 && alpha < 0.5))
        return kvq_fail(err, KVQ_EINVAL, "sketch alpha: expected (0, 0.5), found %g", alpha);
    if (!(vmin > 0 && vmax > vmin && isfinite(vmax)))
        return kvq_fail(err, KVQ_EINVAL, "sketch range: expected 0 < vmin < vmax, found %g, %g", vmin, vmax);
    s->alpha = alpha;
    s->vmin = vmin;
    s->vmax = vmax;
    s->gamma = (1 + alpha) / (1 - alpha);
    s->log_gamma = log(s->gamma);
    double nb = ceil(log(vmax / vmin) / s->log_gamma) + 2;
    if (nb > 1e6) return kvq_fail(err, KVQ_EINVAL, "sketch: %g buckets (alpha %g, range %g..%g) is too many", nb, alpha, vmin, vmax);
    s->n_bins = (int)nb;
    return KVQ_OK;
}

int kvq_sketch_bucket(const kvq_sketch *s, double v)
{
    if (!(v >= s->vmin)) return 0;
    double k = ceil(log(v / s->vmin) / s->log_gamma);
    if (k > s->n_bins - 2) k = s->n_bins - 2;
    return (int)k + 1;
}

double kvq_sketch_value(const kvq_sketch *s, int k)
{
    if (k <= 0) return 0;
    return 2 * s->vmin * pow(s->gamma, k - 1) / (1 + s->gamma);
}

double kvq_sketch_quantile(const kvq_sketch *s, const uint64_t *counts, uint64_t total, double q, double cap)
{
    if (total == 0) return 0;
    double rr = ceil(q * (double)total);
    uint64_t r = rr < 1 ? 1 : rr > (double)total ? total : (uint64_t)rr;
    uint64_t c = 0;
    for (int k = 0; k < s->n_bins; k++) {
        c += counts[k];
        if (c >= r) {
            double v = kvq_sketch_value(s, k);
            return v < cap ? v : cap;
        }
    }
    return cap;
}

/* ---- statistics ------------------------------------------------------------------ */

kvq_kvstats_opts kvq_kvstats_opts_default(void)
{
    kvq_kvstats_opts o = {
        .outlier_mult = 4,
        .outlier_stat = KVQ_OUTLIER_MEAN_ABS,
        .sink_share = 0.2,
        .sink_min_queries = 0,
        .max_sinks = 16,
        .sketch_alpha = 0.005,
        .sketch_vmin = 1e-6,
        .sketch_vmax = 1e6,
        .chunk_tokens = 256,
        .quiet = false,
        .progress_label = "kvstat",
    };
    return o;
}

/* Accumulators of one tensor of one layer (reused across tensors). */
typedef struct {
    size_t kv_dim;
    int n_bins;
    kvq_moments *mx, *ma; /* [kv_dim] moments of x and |x| */
    double *absmax, *mn, *mx_; /* [kv_dim] */
    uint32_t *hist;       /* [kv_dim][n_bins] */
    uint64_t *tmp;        /* [n_bins] */
    float *buf;           /* [chunk][kv_dim] */
    double *sortbuf;      /* [kv_dim] */
} acc_t;

static void acc_free(acc_t *a)
{
    free(a->mx); free(a->ma); free(a->absmax); free(a->mn); free(a->mx_);
    free(a->hist); free(a->tmp); free(a->buf); free(a->sortbuf);
}

static kvq_status acc_alloc(acc_t *a, size_t kv_dim, int n_bins, size_t chunk, kvq_err *err)
{
    memset(a, 0, sizeof *a);
    a->kv_dim = kv_dim;
    a->n_bins = n_bins;
    size_t hb, bb;
    if (kvq_mul_size(kv_dim, (size_t)n_bins, &hb) || kvq_mul_size(hb, sizeof(uint32_t), &hb) ||
        kvq_mul_size(kv_dim, chunk, &bb) || kvq_mul_size(bb, sizeof(float), &bb))
        return kvq_fail(err, KVQ_ENOMEM, "kvstats: accumulator size overflows (kv_dim %zu, %d buckets)", kv_dim, n_bins);
    a->mx = calloc(kv_dim, sizeof *a->mx);
    a->ma = calloc(kv_dim, sizeof *a->ma);
    a->absmax = calloc(kv_dim, sizeof(double));
    a->mn = calloc(kv_dim, sizeof(double));
    a->mx_ = calloc(kv_dim, sizeof(double));
    a->hist = malloc(hb);
    a->tmp = calloc((size_t)n_bins, sizeof(uint64_t));
    a->buf = malloc(bb);
    a->sortbuf = calloc(kv_dim, sizeof(double));
    if (!a->mx || !a->ma || !a->absmax || !a->mn || !a->mx_ || !a->hist || !a->tmp || !a->buf || !a->sortbuf) {
        acc_free(a);
        return kvq_fail(err, KVQ_ENOMEM, "kvstats: out of memory for accumulators (%zu bytes of histograms)", hb);
    }
    return KVQ_OK;
}

static void acc_reset(acc_t *a)
{
    memset(a->mx, 0, a->kv_dim * sizeof *a->mx);
    memset(a->ma, 0, a->kv_dim * sizeof *a->ma);
    for (size_t c = 0; c < a->kv_dim; c++) {
        a->absmax[c] = 0;
        a->mn[c] = INFINITY;
        a->mx_[c] = -INFINITY;
    }
    memset(a->hist, 0, a->kv_dim * (size_t)a->n_bins * sizeof(uint32_t));
}

static void fill_stats(kvq_chan_stats *cs, const kvq_moments *mx, const kvq_moments *ma, double absmax, double mn,
                       double mxv, const kvq_sketch *sk, const uint64_t *hist)
{
    cs->n = (uint64_t)mx->n;
    cs->absmax = absmax;
    cs->min = mn;
    cs->max = mxv;
    cs->mean = mx->mean;
    cs->std = sqrt(kvq_moments_var(mx));
    cs->mean_abs = ma->mean;
    cs->std_abs = sqrt(kvq_moments_var(ma));
    cs->kurtosis = kvq_moments_kurtosis(mx);
    cs->p99 = kvq_sketch_quantile(sk, hist, cs->n, 0.99, absmax);
    cs->p999 = kvq_sketch_quantile(sk, hist, cs->n, 0.999, absmax);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median_of(double *v, size_t n)
{
    if (n == 0) return 0;
    qsort(v, n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

typedef struct {
    int idx;
    double key;
} rank_t;

static int cmp_rank_desc(const void *a, const void *b)
{
    const rank_t *x = a, *y = b;
    if (x->key != y->key) return x->key < y->key ? 1 : -1;
    return (x->idx > y->idx) - (x->idx < y->idx);
}

typedef struct {
    const kvq_kvsrc *src;
    const kvq_kvstats_opts *o;
    kvq_kvstats *s;
    kvq_progress *prog;
    uint64_t done;
} run_t;

/* Stream one tensor of one layer into acc, then reduce into ts. */
static kvq_status tensor_stats(run_t *r, acc_t *a, int layer, kvq_kvt t, kvq_tensor_stats *ts, kvq_err *err)
{
    const kvq_kvsrc *src = r->src;
    kvq_kvstats *s = r->s;
    const kvq_sketch *sk = &s->sketch;
    size_t kv_dim = a->kv_dim, L = (size_t)s->seq_len, N = (size_t)s->n_samples, D = (size_t)s->head_dim;
    acc_reset(a);
    ts->tok_norm = malloc(N * L * sizeof(float));
    ts->chan = calloc(kv_dim, sizeof *ts->chan);
    ts->head = calloc((size_t)s->n_kv_heads, sizeof *ts->head);
    if (!ts->tok_norm || !ts->chan || !ts->head) return kvq_fail(err, KVQ_ENOMEM, "kvstats: out of memory");
    int64_t chunk = r->o->chunk_tokens;
    for (int64_t smp = 0; smp < s->n_samples; smp++) {
        for (int64_t t0 = 0; t0 < s->seq_len; t0 += chunk) {
            int64_t n = s->seq_len - t0 < chunk ? s->seq_len - t0 : chunk;
            kvq_status st = src->read_rows(src->ctx, layer, t, smp, t0, n, a->buf, err);
            if (st != KVQ_OK)
                return kvq_err_prefix(err, "layer %d %s sample %lld positions %lld..%lld", layer, kvq_kvt_name(t),
                                      (long long)smp, (long long)t0, (long long)(t0 + n - 1));
            const float *b = a->buf;
            for (int64_t i = 0; i < n; i++) {
                const float *row = b + (size_t)i * kv_dim;
                double ss = 0;
                for (size_t c = 0; c < kv_dim; c++) {
                    double x = row[c];
                    if (!isfinite(x))
                        return kvq_fail(err, KVQ_ENUMERIC,
                                        "layer %d %s: sample %lld, position %lld, head %zu, channel %zu: value %g is not finite",
                                        layer, kvq_kvt_name(t), (long long)smp, (long long)(t0 + i), c / D, c % D, x);
                    double ax = fabs(x);
                    ss += x * x;
                    if (ax > a->absmax[c]) a->absmax[c] = ax;
                    if (x < a->mn[c]) a->mn[c] = x;
                    if (x > a->mx_[c]) a->mx_[c] = x;
                    a->hist[c * (size_t)a->n_bins + (size_t)kvq_sketch_bucket(sk, ax)]++;
                }
                ts->tok_norm[(size_t)smp * L + (size_t)(t0 + i)] = (float)sqrt(ss);
            }
            for (size_t c = 0; c < kv_dim; c++) {
                kvq_moments m = moments_of(b + c, (size_t)n, kv_dim, false);
                kvq_moments_merge(&a->mx[c], &m);
                m = moments_of(b + c, (size_t)n, kv_dim, true);
                kvq_moments_merge(&a->ma[c], &m);
            }
            r->done += (uint64_t)n;
            kvq_progress_update(r->prog, r->done);
        }
    }
    /* per channel */
    for (size_t c = 0; c < kv_dim; c++) {
        const uint32_t *h = a->hist + c * (size_t)a->n_bins;
        for (int k = 0; k < a->n_bins; k++) a->tmp[k] = h[k];
        fill_stats(&ts->chan[c], &a->mx[c], &a->ma[c], a->absmax[c], a->mn[c], a->mx_[c], sk, a->tmp);
    }
    /* per head and pooled over the layer */
    kvq_moments lx = {0}, la = {0};
    double labs = 0, lmn = INFINITY, lmx = -INFINITY;
    uint64_t *lhist = calloc((size_t)a->n_bins, sizeof(uint64_t));
    if (!lhist) return kvq_fail(err, KVQ_ENOMEM, "kvstats: out of memory");
    for (int h = 0; h < s->n_kv_heads; h++) {
        kvq_moments hx = {0}, ha = {0};
        double habs = 0, hmn = INFINITY, hmx = -INFINITY;
        memset(a->tmp, 0, (size_t)a->n_bins * sizeof(uint64_t));
        for (size_t d = 0; d < D; d++) {
            size_t c = (size_t)h * D + d;
            kvq_moments_merge(&hx, &a->mx[c]);
            kvq_moments_merge(&ha, &a->ma[c]);
            if (a->absmax[c] > habs) habs = a->absmax[c];
            if (a->mn[c] < hmn) hmn = a->mn[c];
            if (a->mx_[c] > hmx) hmx = a->mx_[c];
            const uint32_t *hh = a->hist + c * (size_t)a->n_bins;
            for (int k = 0; k < a->n_bins; k++) a->tmp[k] += hh[k];
        }
        fill_stats(&ts->head[h], &hx, &ha, habs, hmn, hmx, sk, a->tmp);
        kvq_moments_merge(&lx, &hx);
        kvq_moments_merge(&la, &ha);
        if (habs > labs) labs = habs;
        if (hmn < lmn) lmn = hmn;
        if (hmx > lmx) lmx = hmx;
        for (int k = 0; k < a->n_bins; k++) lhist[k] += a->tmp[k];
    }
    fill_stats(&ts->all, &lx, &la, labs, lmn, lmx, sk, lhist);
    free(lhist);
    /* outlier channels */
    kvq_outlier_stat os = r->o->outlier_stat;
    for (size_t c = 0; c < kv_dim; c++) a->sortbuf[c] = kvq_chan_stat_value(&ts->chan[c], os);
    ts->median_stat = median_of(a->sortbuf, kv_dim);
    double med = ts->median_stat > 0 ? ts->median_stat : DBL_MIN;
    rank_t *rk = malloc(kv_dim * sizeof *rk);
    if (!rk) return kvq_fail(err, KVQ_ENOMEM, "kvstats: out of memory");
    int no = 0;
    for (size_t c = 0; c < kv_dim; c++) {
        double v = kvq_chan_stat_value(&ts->chan[c], os);
        if (v > 0 && v >= r->o->outlier_mult * med) rk[no++] = (rank_t){(int)c, v / med};
    }
    qsort(rk, (size_t)no, sizeof *rk, cmp_rank_desc);
    ts->n_outliers = no;
    ts->outlier_chan = malloc((size_t)(no ? no : 1) * sizeof(int));
    ts->outlier_ratio = malloc((size_t)(no ? no : 1) * sizeof(double));
    if (!ts->outlier_chan || !ts->outlier_ratio) { free(rk); return kvq_fail(err, KVQ_ENOMEM, "kvstats: out of memory"); }
    for (int i = 0; i < no; i++) {
        ts->outlier_chan[i] = rk[i].idx;
        ts->outlier_ratio[i] = rk[i].key;
    }
    free(rk);
    return KVQ_OK;
}

static double var_over(const kvq_chan_stats *c, size_t n)
{
    kvq_moments m = {0};
    for (size_t i = 0; i < n; i++) kvq_moments_push(&m, c[i].mean_abs);
    return kvq_moments_var(&m);
}

static void spread_metrics(kvq_layer_stats *ls, size_t kv_dim, double *tmp)
{
    const kvq_tensor_stats *pre = &ls->t[KVQ_KVT_K_PRE_ROPE], *post = &ls->t[KVQ_KVT_K];
    double vpre = var_over(pre->chan, kv_dim), vpost = var_over(post->chan, kv_dim);
    ls->spread_var_ratio = vpost > 0 ? vpre / vpost : NAN;
    for (int w = 0; w < 2; w++) {
        const kvq_tensor_stats *ts = w ? post : pre;
        double mx = 0, cv = 0;
        for (size_t c = 0; c < kv_dim; c++) {
            tmp[c] = ts->chan[c].mean_abs;
            if (tmp[c] > mx) mx = tmp[c];
            cv += ts->chan[c].mean_abs > 0 ? ts->chan[c].std_abs / ts->chan[c].mean_abs : 0;
        }
        double med = median_of(tmp, kv_dim);
        double mm = med > 0 ? mx / med : NAN;
        if (w) { ls->maxmed_post = mm; ls->cv_post = cv / (double)kv_dim; }
        else { ls->maxmed_pre = mm; ls->cv_pre = cv / (double)kv_dim; }
    }
}

typedef struct {
    int64_t sample, pos;
    double share, recv;
} cand_t;

static int cmp_cand(const void *a, const void *b)
{
    const cand_t *x = a, *y = b;
    if (x->share != y->share) return x->share < y->share ? 1 : -1;
    if (x->sample != y->sample) return (x->sample > y->sample) - (x->sample < y->sample);
    return (x->pos > y->pos) - (x->pos < y->pos);
}

static kvq_status attn_stats(run_t *r, int layer, kvq_layer_stats *ls, kvq_err *err)
{
    const kvq_kvsrc *src = r->src;
    kvq_kvstats *s = r->s;
    size_t H = (size_t)s->n_heads, L = (size_t)s->seq_len, N = (size_t)s->n_samples;
    ls->attn_recv = calloc(H * L, sizeof(double));
    ls->attn_share = calloc(N * L, sizeof(double));
    float *buf = malloc(H * L * sizeof(float));
    cand_t *cand = malloc(N * L * sizeof *cand);
    if (!ls->attn_recv || !ls->attn_share || !buf || !cand) {
        free(buf); free(cand);
        return kvq_fail(err, KVQ_ENOMEM, "kvstats: out of memory for attention statistics");
    }
    size_t nc = 0;
    int64_t minq = r->o->sink_min_queries;
    kvq_status st = KVQ_OK;
    for (size_t smp = 0; smp < N && st == KVQ_OK; smp++) {
        st = src->read_rows(src->ctx, layer, KVQ_KVT_ATTN_RECEIVED, (int64_t)smp, 0, (int64_t)L, buf, err);
        if (st != KVQ_OK) { kvq_err_prefix(err, "layer %d attn_received sample %zu", layer, smp); break; }
        for (size_t j = 0; j < L; j++) {
            double sum = 0;
            for (size_t h = 0; h < H; h++) {
                double v = buf[h * L + j];
                if (!isfinite(v)) {
                    st = kvq_fail(err, KVQ_ENUMERIC, "layer %d attn_received: sample %zu, head %zu, position %zu: value %g is not finite",
                                  layer, smp, h, j, v);
                    break;
                }
                ls->attn_recv[h * L + j] += v / (double)N;
                sum += v;
            }
            if (st != KVQ_OK) break;
            double recv = sum / (double)H, share = recv / (double)(L - j);
            ls->attn_share[smp * L + j] = share;
            if ((int64_t)(L - j) >= minq && share >= r->o->sink_share)
                cand[nc++] = (cand_t){(int64_t)smp, (int64_t)j, share, recv};
        }
        r->done += L;
        kvq_progress_update(r->prog, r->done);
    }
    free(buf);
    if (st != KVQ_OK) { free(cand); return st; }
    double best = -1, total = 0;
    ls->top_pos = 0;
    for (size_t j = 0; j < L; j++) {
        double a = 0;
        for (size_t h = 0; h < H; h++) a += ls->attn_recv[h * L + j];
        total += a;
        if (a > best) { best = a; ls->top_pos = (int64_t)j; }
    }
    ls->top_frac = total > 0 ? best / total : 0;
    qsort(cand, nc, sizeof *cand, cmp_cand);
    if (nc > (size_t)r->o->max_sinks) nc = (size_t)r->o->max_sinks;
    ls->n_sinks = (int)nc;
    ls->sinks = calloc(nc ? nc : 1, sizeof *ls->sinks);
    if (!ls->sinks) { free(cand); return kvq_fail(err, KVQ_ENOMEM, "kvstats: out of memory"); }
    for (size_t i = 0; i < nc; i++)
        ls->sinks[i] = (kvq_sink){cand[i].sample, cand[i].pos, s->tokens[(size_t)cand[i].sample * L + (size_t)cand[i].pos],
                                  cand[i].share, cand[i].recv};
    free(cand);
    return KVQ_OK;
}

static int cmp_pivot(const void *a, const void *b)
{
    const kvq_pivot *x = a, *y = b;
    if (x->n_layers != y->n_layers) return y->n_layers - x->n_layers;
    if (x->max_share != y->max_share) return x->max_share < y->max_share ? 1 : -1;
    if (x->sample != y->sample) return (x->sample > y->sample) - (x->sample < y->sample);
    return (x->pos > y->pos) - (x->pos < y->pos);
}

static kvq_status pivots(kvq_kvstats *s, kvq_err *err)
{
    size_t cap = 0;
    for (int j = 0; j < s->n_stat_layers; j++) cap += (size_t)s->layers[j].n_sinks;
    s->pivots = calloc(cap ? cap : 1, sizeof *s->pivots);
    if (!s->pivots) return kvq_fail(err, KVQ_ENOMEM, "kvstats: out of memory");
    int n = 0;
    for (int j = 0; j < s->n_stat_layers; j++) {
        const kvq_layer_stats *ls = &s->layers[j];
        for (int i = 0; i < ls->n_sinks; i++) {
            const kvq_sink *k = &ls->sinks[i];
            int f = -1;
            for (int p = 0; p < n && f < 0; p++)
                if (s->pivots[p].sample == k->sample && s->pivots[p].pos == k->pos) f = p;
            if (f < 0) { f = n++; s->pivots[f] = (kvq_pivot){k->sample, k->pos, k->token, 0, 0}; }
            s->pivots[f].n_layers++;
            if (k->share > s->pivots[f].max_share) s->pivots[f].max_share = k->share;
        }
    }
    qsort(s->pivots, (size_t)n, sizeof *s->pivots, cmp_pivot);
    s->n_pivots = n;
    return KVQ_OK;
}

void kvq_kvstats_free(kvq_kvstats *s)
{
    if (!s) return;
    if (s->layers)
        for (int j = 0; j < s->n_stat_layers; j++) {
            kvq_layer_stats *ls = &s->layers[j];
            for (int t = 0; t < KVQ_KVT_N_STAT; t++) {
                free(ls->t[t].chan); free(ls->t[t].head); free(ls->t[t].outlier_chan);
                free(ls->t[t].outlier_ratio); free(ls->t[t].tok_norm);
            }
            free(ls->attn_recv); free(ls->attn_share); free(ls->sinks);
        }
    free(s->layers);
    free(s->tokens);
    free(s->pivots);
    free(s);
}

const kvq_layer_stats *kvq_kvstats_layer(const kvq_kvstats *s, int layer)
{
    if (!s || layer < s->layer_first || layer > s->layer_last) return NULL;
    return &s->layers[layer - s->layer_first];
}

static kvq_status check_opts(const kvq_kvstats_opts *o, kvq_err *err)
{
    if (!(o->outlier_mult > 0 && isfinite(o->outlier_mult)))
        return kvq_fail(err, KVQ_EINVAL, "outlier multiple: expected a positive number, found %g", o->outlier_mult);
    if (!(o->sink_share > 0 && o->sink_share <= 1))
        return kvq_fail(err, KVQ_EINVAL, "sink share: expected (0, 1], found %g", o->sink_share);
    if (o->chunk_tokens < 1) return kvq_fail(err, KVQ_EINVAL, "chunk_tokens: expected >= 1, found %lld", (long long)o->chunk_tokens);
    if (o->max_sinks < 1) return kvq_fail(err, KVQ_EINVAL, "max_sinks: expected >= 1, found %d", o->max_sinks);
    if ((unsigned)o->outlier_stat > KVQ_OUTLIER_P99) return kvq_fail(err, KVQ_EINVAL, "outlier statistic: unknown value %d", (int)o->outlier_stat);
    return KVQ_OK;
}

kvq_status kvq_kvstats_compute(const kvq_kvsrc *src, const kvq_kvstats_opts *opts, kvq_kvstats **out, kvq_err *err)
{
    *out = NULL;
    kvq_kvstats_opts o = opts ? *opts : kvq_kvstats_opts_default();
    KVQ_TRY(check_opts(&o, err));
    KVQ_TRY(check_shape(src, err));
    if ((uint64_t)src->n_samples * (uint64_t)src->seq_len > UINT32_MAX)
        return kvq_fail(err, KVQ_EINVAL, "kvstats: N x L = %lld x %lld exceeds 2^32-1 values per channel",
                        (long long)src->n_samples, (long long)src->seq_len);
    if (o.sink_min_queries <= 0) o.sink_min_queries = src->seq_len / 8 > 1 ? src->seq_len / 8 : 1;
    if (o.chunk_tokens > src->seq_len) o.chunk_tokens = src->seq_len;
    if (!o.progress_label) o.progress_label = "kvstat";
    kvq_kvstats *s = calloc(1, sizeof *s);
    if (!s) return kvq_fail(err, KVQ_ENOMEM, "kvstats: out of memory");
    kvq_status st = kvq_sketch_init(&s->sketch, o.sketch_alpha, o.sketch_vmin, o.sketch_vmax, err);
    if (st != KVQ_OK) { free(s); return st; }
    s->n_layers = src->n_layers;
    s->layer_first = src->layer_first;
    s->layer_last = src->layer_last;
    s->n_stat_layers = src->layer_last - src->layer_first + 1;
    s->n_heads = src->n_heads;
    s->n_kv_heads = src->n_kv_heads;
    s->head_dim = src->head_dim;
    s->kv_dim = src->n_kv_heads * src->head_dim;
    s->n_samples = src->n_samples;
    s->seq_len = src->seq_len;
    s->has_attn = src->has_attn;
    snprintf(s->model, sizeof s->model, "%s", src->model);
    s->opts = o;
    size_t NL = (size_t)src->n_samples * (size_t)src->seq_len;
    s->tokens = malloc(NL * sizeof(int32_t));
    s->layers = calloc((size_t)s->n_stat_layers, sizeof *s->layers);
    if (!s->tokens || !s->layers) { kvq_kvstats_free(s); return kvq_fail(err, KVQ_ENOMEM, "kvstats: out of memory"); }
    st = src->read_tokens(src->ctx, 0, src->n_samples, s->tokens, err);
    if (st != KVQ_OK) { kvq_err_prefix(err, "tokens"); kvq_kvstats_free(s); return st; }
    acc_t a;
    st = acc_alloc(&a, (size_t)s->kv_dim, s->sketch.n_bins, (size_t)o.chunk_tokens, err);
    if (st != KVQ_OK) { kvq_kvstats_free(s); return st; }
    kvq_progress prog;
    uint64_t per_layer = (uint64_t)NL * (KVQ_KVT_N_STAT + (src->has_attn ? 1 : 0));
    kvq_progress_init(&prog, o.progress_label, "pos", per_layer * (uint64_t)s->n_stat_layers, o.quiet);
    run_t r = {src, &s->opts, s, &prog, 0};
    for (int j = 0; j < s->n_stat_layers && st == KVQ_OK; j++) {
        kvq_layer_stats *ls = &s->layers[j];
        ls->layer = s->layer_first + j;
        ls->top_pos = -1;
        for (int t = 0; t < KVQ_KVT_N_STAT && st == KVQ_OK; t++)
            st = tensor_stats(&r, &a, ls->layer, (kvq_kvt)t, &ls->t[t], err);
        if (st != KVQ_OK) break;
        spread_metrics(ls, (size_t)s->kv_dim, a.sortbuf);
        if (src->has_attn) st = attn_stats(&r, ls->layer, ls, err);
    }
    acc_free(&a);
    if (st == KVQ_OK) st = pivots(s, err);
    if (st != KVQ_OK) { kvq_kvstats_free(s); return st; }
    kvq_progress_finish(&prog);
    *out = s;
    return KVQ_OK;
}

/* ---- quantization error ----------------------------------------------------------- */

void kvq_qerr_free(kvq_qerr *q)
{
    if (!q) return;
    free(q->names); free(q->mse_k); free(q->mse_v); free(q->fw_k); free(q->fw_v);
    free(q->sig_k); free(q->sig_v); free(q->outl_k); free(q->outl_v); free(q->calib_k); free(q->calib_v);
    memset(q, 0, sizeof *q);
}

static kvq_status read_sample(const kvq_kvsrc *src, int layer, kvq_kvt t, int64_t smp, float *out, kvq_err *err)
{
    kvq_status st = src->read_rows(src->ctx, layer, t, smp, 0, src->seq_len, out, err);
    if (st != KVQ_OK) return kvq_err_prefix(err, "layer %d %s sample %lld", layer, kvq_kvt_name(t), (long long)smp);
    if (t == KVQ_KVT_FISHER_K_PRE_ROPE || t == KVQ_KVT_FISHER_V) { /* weights: finite and >= 0, as kvcalib requires */
        const size_t kvd = (size_t)src->n_kv_heads * (size_t)src->head_dim, hd = (size_t)src->head_dim;
        for (size_t i = 0, n = (size_t)src->seq_len * kvd; i < n; i++)
            if (!isfinite(out[i]) || out[i] < 0)
                return kvq_fail(err, KVQ_ENUMERIC,
                                "layer %d %s: sample %lld, position %zu, head %zu, channel %zu: value %g is %s (squared gradients "
                                "are finite and >= 0)",
                                layer, kvq_kvt_name(t), (long long)smp, i / kvd, (i % kvd) / hd, i % hd, (double)out[i],
                                isfinite(out[i]) ? "negative" : "not finite");
    }
    return st;
}

kvq_status kvq_qerr_compute(const kvq_kvsrc *src, const kvq_qscheme *schemes, int n_schemes, bool quiet,
                            kvq_qerr *q, kvq_err *err)
{
    memset(q, 0, sizeof *q);
    KVQ_TRY(check_shape(src, err));
    if (n_schemes < 1) return kvq_fail(err, KVQ_EINVAL, "quantization error: no scheme given");
    int nl = src->layer_last - src->layer_first + 1;
    size_t ns = (size_t)n_schemes, NLy = (size_t)nl, L = (size_t)src->seq_len;
    size_t kv_dim = (size_t)src->n_kv_heads * (size_t)src->head_dim, el = L * kv_dim;
    q->n_schemes = n_schemes;
    q->n_stat_layers = nl;
    q->layer_first = src->layer_first;
    q->names = calloc(ns, sizeof *q->names);
    double **arr[] = {&q->mse_k, &q->mse_v, &q->fw_k, &q->fw_v, &q->outl_k, &q->outl_v, &q->calib_k, &q->calib_v};
    bool ok = q->names != NULL;
    for (size_t i = 0; i < sizeof arr / sizeof *arr; i++) ok = ok && (*arr[i] = calloc(ns * NLy, sizeof(double)));
    ok = ok && (q->sig_k = calloc(NLy, sizeof(double))) && (q->sig_v = calloc(NLy, sizeof(double)));
    float *kp = malloc(el * sizeof(float)), *kr = malloc(el * sizeof(float)), *v = malloc(el * sizeof(float));
    float *fk = src->has_fisher ? malloc(el * sizeof(float)) : NULL, *fv = src->has_fisher ? malloc(el * sizeof(float)) : NULL;
    float *o = malloc(el * sizeof(float));
    uint64_t *cnt = calloc(4 * ns, sizeof(uint64_t)); /* per scheme: k outliers, k elems, v outliers, v elems */
    kvq_status st = KVQ_OK;
    if (!ok || !kp || !kr || !v || !o || !cnt || (src->has_fisher && (!fk || !fv)))
        st = kvq_fail(err, KVQ_ENOMEM, "quantization error: out of memory (%zu floats per buffer)", el);
    for (size_t i = 0; st == KVQ_OK && i < ns; i++) snprintf(q->names[i], sizeof q->names[i], "%s", schemes[i].name);
    kvq_progress prog;
    kvq_progress_init(&prog, "kvstat quant-error", "sample", (uint64_t)nl * (uint64_t)src->n_samples, quiet);
    for (int j = 0; st == KVQ_OK && j < nl; j++) {
        int layer = src->layer_first + j;
        double *ek = calloc(ns, sizeof(double)), *ev = calloc(ns, sizeof(double));
        double *wk = calloc(ns, sizeof(double)), *wv = calloc(ns, sizeof(double));
        if (!ek || !ev || !wk || !wv) st = kvq_fail(err, KVQ_ENOMEM, "quantization error: out of memory");
        memset(cnt, 0, 4 * ns * sizeof(uint64_t));
        double sk = 0, sv = 0;
        for (int64_t smp = 0; st == KVQ_OK && smp < src->n_samples; smp++) {
            st = read_sample(src, layer, KVQ_KVT_K_PRE_ROPE, smp, kp, err);
            if (st == KVQ_OK) st = read_sample(src, layer, KVQ_KVT_K, smp, kr, err);
            if (st == KVQ_OK) st = read_sample(src, layer, KVQ_KVT_V, smp, v, err);
            if (st == KVQ_OK && fk) st = read_sample(src, layer, KVQ_KVT_FISHER_K_PRE_ROPE, smp, fk, err);
            if (st == KVQ_OK && fv) st = read_sample(src, layer, KVQ_KVT_FISHER_V, smp, fv, err);
            for (size_t i = 0; st == KVQ_OK && i < el; i++) { sk += (double)kp[i] * kp[i]; sv += (double)v[i] * v[i]; }
            for (size_t si = 0; st == KVQ_OK && si < ns; si++) {
                const kvq_qscheme *sc = &schemes[si];
                const float *kin = sc->keys_post_rope ? kr : kp;
                st = sc->quantize(sc->ctx, layer, false, kin, L, kv_dim, o, &cnt[4 * si], &cnt[4 * si + 1], err);
                if (st != KVQ_OK) { kvq_err_prefix(err, "scheme %s, layer %d keys, sample %lld", sc->name, layer, (long long)smp); break; }
                for (size_t i = 0; i < el; i++) {
                    double d = (double)kin[i] - o[i], d2 = d * d;
                    ek[si] += d2;
                    if (fk && !sc->keys_post_rope) wk[si] += fk[i] * d2;
                }
                st = sc->quantize(sc->ctx, layer, true, v, L, kv_dim, o, &cnt[4 * si + 2], &cnt[4 * si + 3], err);
                if (st != KVQ_OK) { kvq_err_prefix(err, "scheme %s, layer %d values, sample %lld", sc->name, layer, (long long)smp); break; }
                for (size_t i = 0; i < el; i++) {
                    double d = (double)v[i] - o[i], d2 = d * d;
                    ev[si] += d2;
                    if (fv) wv[si] += fv[i] * d2;
                }
            }
            kvq_progress_update(&prog, (uint64_t)j * (uint64_t)src->n_samples + (uint64_t)smp + 1);
        }
        if (st == KVQ_OK) {
            double ne = (double)el * (double)src->n_samples;
            q->sig_k[j] = sk / ne;
            q->sig_v[j] = sv / ne;
            for (size_t si = 0; si < ns; si++) {
                size_t x = si * NLy + (size_t)j;
                const kvq_qscheme *sc = &schemes[si];
                q->mse_k[x] = ek[si] / ne;
                q->mse_v[x] = ev[si] / ne;
                q->fw_k[x] = (fk && !sc->keys_post_rope) ? wk[si] / ne : NAN;
                q->fw_v[x] = fv ? wv[si] / ne : NAN;
                q->outl_k[x] = cnt[4 * si + 1] ? (double)cnt[4 * si] / (double)cnt[4 * si + 1] : 0;
                q->outl_v[x] = cnt[4 * si + 3] ? (double)cnt[4 * si + 2] / (double)cnt[4 * si + 3] : 0;
                q->calib_k[x] = sc->calib_outlier_frac_k ? sc->calib_outlier_frac_k[layer] : NAN;
                q->calib_v[x] = sc->calib_outlier_frac_v ? sc->calib_outlier_frac_v[layer] : NAN;
            }
        }
        free(ek); free(ev); free(wk); free(wv);
    }
    free(kp); free(kr); free(v); free(fk); free(fv); free(o); free(cnt);
    if (st != KVQ_OK) { kvq_qerr_free(q); return st; }
    kvq_progress_finish(&prog);
    return KVQ_OK;
}

kvq_status kvq_normhist_layer(const kvq_kvsrc *src, int layer, kvq_kvt t, const float *lower, const float *upper,
                              double v_outlier_frac, double lo_x, double hi_x, int n_bins, uint64_t *counts,
                              uint64_t *under, uint64_t *over, kvq_err *err)
{
    if (!(hi_x > lo_x) || n_bins < 1)
        return kvq_fail(err, KVQ_EINVAL, "normalised histogram: bad range [%g, %g] or %d bins", lo_x, hi_x, n_bins);
    if ((lower == NULL) != (upper == NULL))
        return kvq_fail(err, KVQ_EINVAL, "normalised histogram: give both lower and upper or neither");
    if (t >= KVQ_KVT_ATTN_RECEIVED) return kvq_fail(err, KVQ_EINVAL, "normalised histogram: '%s' is not a per-token tensor", kvq_kvt_name(t));
    if (layer < src->layer_first || layer > src->layer_last)
        return kvq_fail(err, KVQ_EINVAL, "layer %d is not in the dump (layers %d..%d)", layer, src->layer_first,
                        src->layer_last);
    size_t kv_dim = (size_t)src->n_kv_heads * (size_t)src->head_dim;
    size_t kps = kvq_outliers_per_side(kv_dim, v_outlier_frac);
    float *buf = malloc(KVQ_HEAD_CHUNK * kv_dim * sizeof(float)), *scratch = malloc(kv_dim * sizeof(float));
    if (!buf || !scratch) { free(buf); free(scratch); return kvq_fail(err, KVQ_ENOMEM, "normalised histogram: out of memory"); }
    double w = (hi_x - lo_x) / n_bins;
    kvq_status st = KVQ_OK;
    for (int64_t smp = 0; smp < src->n_samples && st == KVQ_OK; smp++)
        for (int64_t t0 = 0; t0 < src->seq_len && st == KVQ_OK; t0 += KVQ_HEAD_CHUNK) {
            int64_t n = src->seq_len - t0 < KVQ_HEAD_CHUNK ? src->seq_len - t0 : KVQ_HEAD_CHUNK;
            st = src->read_rows(src->ctx, layer, t, smp, t0, n, buf, err);
            for (int64_t i = 0; st == KVQ_OK && i < n; i++) {
                const float *row = buf + (size_t)i * kv_dim;
                float tlo = 0, thi = 0;
                if (!lower) kvq_token_range(row, kv_dim, kps, scratch, &tlo, &thi);
                for (size_t c = 0; c < kv_dim; c++) {
                    double U = lower ? upper[c] : thi, Lo = lower ? lower[c] : tlo;
                    double r = (U - Lo) / 2, zp = (U + Lo) / 2;
                    if (!(r > 0)) continue;
                    double xn = ((double)row[c] - zp) / r;
                    if (xn < lo_x) (*under)++;
                    else if (xn > hi_x) (*over)++;
                    else {
                        int b = (int)((xn - lo_x) / w);
                        counts[b >= n_bins ? n_bins - 1 : b]++;
                    }
                }
            }
        }
    free(buf);
    free(scratch);
    return st;
}
