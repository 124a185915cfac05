/* kmeans.c — weighted 1-D k-means (Lloyd + exact DP); see kmeans.h. */
#include "kmeans.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "quant.h" /* defines: kvq_nuq_nearest */

#define KMEANS_MAX_K 256

const char *kvq_fit_method_name(kvq_fit_method m)
{
    switch (m) {
    case KVQ_FIT_AUTO: return "auto";
    case KVQ_FIT_LLOYD: return "lloyd";
    case KVQ_FIT_EXACT: return "exact";
    }
    return "?";
}

/* ---- atoms ------------------------------------------------------------------ */

typedef struct {
    size_t m;
    double *w, *s1, *s2; /* [m] moments per atom, atoms in ascending x order */
    double *mean;        /* [m] s1 / w */
} atoms;

static void atoms_free(atoms *a)
{
    free(a->w);
    a->w = a->s1 = a->s2 = a->mean = NULL;
}

static kvq_status atoms_alloc(atoms *a, size_t m, kvq_err *err)
{
    a->m = m;
    a->w = calloc(4 * (m ? m : 1), sizeof(double));
    if (!a->w) return kvq_fail(err, KVQ_ENOMEM, "k-means: cannot allocate %zu atoms", m);
    a->s1 = a->w + m;
    a->s2 = a->s1 + m;
    a->mean = a->s2 + m;
    return KVQ_OK;
}

typedef struct {
    float x, w;
} xw;

static int cmp_xw(const void *a, const void *b)
{
    float x = ((const xw *)a)->x, y = ((const xw *)b)->x;
    return (x > y) - (x < y);
}

static kvq_status build_atoms(const float *x, const float *w, size_t n, size_t n_bins, float xmin, float xmax,
                              atoms *a, bool *hist, kvq_err *err)
{
    if (n <= n_bins) { /* exact: distinct values */
        *hist = false;
        xw *p = malloc(n * sizeof *p);
        if (!p) return kvq_fail(err, KVQ_ENOMEM, "k-means: cannot allocate %zu points", n);
        size_t np = 0;
        for (size_t i = 0; i < n; i++) {
            float wi = w ? w[i] : 1.0f;
            if (wi > 0) p[np++] = (xw){x[i], wi};
        }
        qsort(p, np, sizeof *p, cmp_xw);
        size_t m = 0;
        for (size_t i = 0; i < np; i++)
            if (i == 0 || p[i].x != p[i - 1].x) m++;
        kvq_status s = atoms_alloc(a, m, err);
        if (s != KVQ_OK) { free(p); return s; }
        size_t j = 0;
        for (size_t i = 0; i < np; i++) {
            if (i && p[i].x != p[i - 1].x) j++;
            double xi = p[i].x, wi = p[i].w;
            a->w[j] += wi;
            a->s1[j] += wi * xi;
            a->s2[j] += wi * xi * xi;
        }
        free(p);
    } else { /* histogram */
        *hist = true;
        double *h = calloc(3 * n_bins, sizeof *h);
        if (!h) return kvq_fail(err, KVQ_ENOMEM, "k-means: cannot allocate a %zu-bin histogram", n_bins);
        double lo = xmin, span = (double)xmax - (double)xmin;
        double scale = span > 0 ? (double)n_bins / span : 0;
        for (size_t i = 0; i < n; i++) {
            double wi = w ? w[i] : 1.0;
            if (!(wi > 0)) continue;
            double xi = x[i];
            size_t b = (size_t)((xi - lo) * scale);
            if (b >= n_bins) b = n_bins - 1;
            h[3 * b] += wi;
            h[3 * b + 1] += wi * xi;
            h[3 * b + 2] += wi * xi * xi;
        }
        size_t m = 0;
        for (size_t b = 0; b < n_bins; b++) m += h[3 * b] > 0;
        kvq_status s = atoms_alloc(a, m, err);
        if (s != KVQ_OK) { free(h); return s; }
        size_t j = 0;
        for (size_t b = 0; b < n_bins; b++)
            if (h[3 * b] > 0) {
                a->w[j] = h[3 * b];
                a->s1[j] = h[3 * b + 1];
                a->s2[j] = h[3 * b + 2];
                j++;
            }
        free(h);
    }
    for (size_t j = 0; j < a->m; j++) a->mean[j] = a->s1[j] / a->w[j];
    return KVQ_OK;
}

/* ---- shared helpers ----------------------------------------------------------- */

/* Complete `have` sorted centres to k by repeatedly splitting the widest gap. */
static void fill_centres(double *c, int have, int k)
{
    while (have < k) {
        int best = -1;
        double gap = -1;
        for (int j = 0; j + 1 < have; j++)
            if (c[j + 1] - c[j] > gap) { gap = c[j + 1] - c[j]; best = j; }
        if (best < 0) { /* a single value: duplicate it */
            for (int j = have; j < k; j++) c[j] = c[0];
            return;
        }
        memmove(c + best + 2, c + best + 1, (size_t)(have - best - 1) * sizeof *c);
        c[best + 1] = c[best] + gap / 2;
        have++;
    }
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double kvq_kmeans1d_objective(const float *x, const float *w, size_t n, const float *centres, int k)
{
    double J = 0;
    for (size_t i = 0; i < n; i++) {
        double wi = w ? w[i] : 1.0;
        if (!(wi > 0)) continue;
        size_t j = kvq_nuq_nearest(centres, (size_t)k, x[i]);
        double d = (double)x[i] - (double)centres[j];
        J += wi * d * d;
    }
    return J;
}

/* ---- Lloyd ---------------------------------------------------------------------- */

typedef struct {
    uint64_t s;
} rng64;

static uint64_t splitmix64(rng64 *r)
{
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double rng_unit(rng64 *r) { return (double)(splitmix64(r) >> 11) * (1.0 / 9007199254740992.0); }

/* index of the atom where the cumulative weight first exceeds u * total */
static size_t sample_atom(const double *wt, size_t m, double total, double u)
{
    double target = u * total, acc = 0;
    size_t last = 0;
    for (size_t i = 0; i < m; i++) {
        if (wt[i] <= 0) continue;
        acc += wt[i];
        last = i;
        if (acc > target) return i;
    }
    return last;
}

static kvq_status lloyd(const atoms *a, int k, int max_iter, uint64_t seed, double *c, int *iters, bool *conv,
                        kvq_err *err)
{
    size_t m = a->m;
    *iters = 0;
    *conv = true;
    if (m <= (size_t)k) {
        for (size_t j = 0; j < m; j++) c[j] = a->mean[j];
        fill_centres(c, (int)m, k);
        return KVQ_OK;
    }
    double *d2 = malloc(3 * m * sizeof *d2);
    size_t *start = malloc(2 * ((size_t)k + 1) * sizeof *start);
    if (!d2 || !start) {
        free(d2);
        free(start);
        return kvq_fail(err, KVQ_ENOMEM, "k-means: cannot allocate Lloyd buffers for %zu atoms", m);
    }
    double *cand = d2 + m, *tmp = cand + m;
    rng64 r = {seed};
    /* k-means++ (weighted, greedy local trials) */
    double total = 0;
    for (size_t i = 0; i < m; i++) total += a->w[i];
    size_t first = sample_atom(a->w, m, total, rng_unit(&r));
    c[0] = a->mean[first];
    double pot = 0;
    for (size_t i = 0; i < m; i++) {
        double d = a->mean[i] - c[0];
        d2[i] = d * d;
        pot += a->w[i] * d2[i];
    }
    int n_local = 2 + (int)log((double)k);
    for (int j = 1; j < k; j++) {
        for (size_t i = 0; i < m; i++) tmp[i] = a->w[i] * d2[i];
        double best_pot = INFINITY;
        size_t best = 0;
        for (int t = 0; t < n_local; t++) {
            size_t ci = pot > 0 ? sample_atom(tmp, m, pot, rng_unit(&r)) : (size_t)j % m;
            double cp = 0;
            for (size_t i = 0; i < m; i++) {
                double d = a->mean[i] - a->mean[ci];
                double v = d * d < d2[i] ? d * d : d2[i];
                cand[i] = v;
                cp += a->w[i] * v;
            }
            if (cp < best_pot) { best_pot = cp; best = ci; }
        }
        c[j] = a->mean[best];
        pot = 0;
        for (size_t i = 0; i < m; i++) {
            double d = a->mean[i] - c[j];
            if (d * d < d2[i]) d2[i] = d * d;
            pot += a->w[i] * d2[i];
        }
    }
    qsort(c, (size_t)k, sizeof *c, cmp_double);
    /* Lloyd iterations: atoms sorted, so clusters are runs [start[j], start[j+1]) */
    size_t *prev = start + (k + 1);
    for (int j = 0; j <= k; j++) prev[j] = (size_t)-1;
    *conv = false;
    for (int it = 0; it < max_iter; it++) {
        size_t i = 0;
        for (int j = 0; j < k; j++) {
            start[j] = i;
            if (j == k - 1) { i = m; break; }
            double mid = (c[j] + c[j + 1]) / 2;
            while (i < m && a->mean[i] <= mid) i++; /* ties at the midpoint → lower cluster */
        }
        start[k] = m;
        *iters = it + 1;
        if (memcmp(start, prev, ((size_t)k + 1) * sizeof *start) == 0) { *conv = true; break; }
        memcpy(prev, start, ((size_t)k + 1) * sizeof *start);
        for (int j = 0; j < k; j++) {
            double W = 0, S = 0;
            for (size_t q = start[j]; q < start[j + 1]; q++) { W += a->w[q]; S += a->s1[q]; }
            if (W > 0) c[j] = S / W; /* empty cluster keeps its centre */
        }
    }
    free(d2);
    free(start);
    return KVQ_OK;
}

/* ---- exact DP ------------------------------------------------------------------- */

typedef struct {
    const double *W, *S1, *S2; /* prefix sums [m+1] */
    const double *prev;        /* D[j-1][0..m] */
    double *cur;               /* D[j][0..m] */
    uint32_t *arg;             /* back-pointers for layer j, [m+1] */
} dp_ctx;

static inline double seg_cost(const dp_ctx *d, size_t a, size_t b) /* atoms [a, b) */
{
    double w = d->W[b] - d->W[a];
    if (!(w > 0)) return 0;
    double s = d->S1[b] - d->S1[a];
    double v = (d->S2[b] - d->S2[a]) - s * s / w;
    return v > 0 ? v : 0;
}

/* D[j][i] for i in [lo, hi], optimal split in [olo, ohi] (monotone) */
static void dp_solve(dp_ctx *d, size_t lo, size_t hi, size_t olo, size_t ohi)
{
    while (lo <= hi) {
        size_t mid = lo + (hi - lo) / 2;
        size_t top = ohi < mid - 1 ? ohi : mid - 1;
        double best = INFINITY;
        size_t bi = olo;
        for (size_t q = olo; q <= top; q++) {
            double v = d->prev[q] + seg_cost(d, q, mid);
            if (v < best) { best = v; bi = q; }
        }
        d->cur[mid] = best;
        d->arg[mid] = (uint32_t)bi;
        if (mid > lo) dp_solve(d, lo, mid - 1, olo, bi);
        lo = mid + 1; /* tail-iterate on the right half */
        olo = bi;
    }
}

static kvq_status exact_dp(const atoms *a, int k, double *c, kvq_err *err)
{
    size_t m = a->m;
    if (m <= (size_t)k) {
        for (size_t j = 0; j < m; j++) c[j] = a->mean[j];
        fill_centres(c, (int)m, k);
        return KVQ_OK;
    }
    if (m >= UINT32_MAX) return kvq_fail(err, KVQ_EINVAL, "k-means: %zu atoms exceed the exact solver's limit", m);
    size_t n1 = m + 1, nb;
    if (kvq_mul_size(n1, (size_t)k, &nb)) return kvq_fail(err, KVQ_ENOMEM, "k-means: DP table overflows");
    double *buf = malloc(5 * n1 * sizeof *buf);
    uint32_t *arg = malloc(nb * sizeof *arg);
    if (!buf || !arg) {
        free(buf);
        free(arg);
        return kvq_fail(err, KVQ_ENOMEM, "k-means: cannot allocate the %d x %zu DP table", k, n1);
    }
    double *W = buf, *S1 = W + n1, *S2 = S1 + n1, *prev = S2 + n1, *cur = prev + n1;
    W[0] = S1[0] = S2[0] = 0;
    for (size_t i = 0; i < m; i++) {
        W[i + 1] = W[i] + a->w[i];
        S1[i + 1] = S1[i] + a->s1[i];
        S2[i + 1] = S2[i] + a->s2[i];
    }
    dp_ctx d = {W, S1, S2, prev, cur, arg};
    for (size_t i = 0; i <= m; i++) { prev[i] = seg_cost(&d, 0, i); arg[i] = 0; }
    for (int j = 2; j <= k; j++) {
        d.arg = arg + (size_t)(j - 1) * n1;
        for (size_t i = 0; i < (size_t)j; i++) { cur[i] = INFINITY; d.arg[i] = 0; }
        dp_solve(&d, (size_t)j, m, (size_t)j - 1, m - 1);
        double *t = prev;
        prev = cur;
        cur = t;
        d.prev = prev;
        d.cur = cur;
    }
    /* backtrack: clusters [b_{j}, b_{j+1}) */
    size_t end = m;
    for (int j = k; j >= 1; j--) {
        size_t beg = j == 1 ? 0 : arg[(size_t)(j - 1) * n1 + end];
        double w = W[end] - W[beg];
        c[j - 1] = w > 0 ? (S1[end] - S1[beg]) / w : a->mean[beg < m ? beg : m - 1];
        end = beg;
    }
    free(buf);
    free(arg);
    qsort(c, (size_t)k, sizeof *c, cmp_double);
    return KVQ_OK;
}

/* ---- driver ------------------------------------------------------------------- */

static void to_float_sorted(const double *c, int k, float *out)
{
    for (int j = 0; j < k; j++) out[j] = (float)c[j];
    for (int j = 1; j < k; j++) /* rounding cannot unsort, but be explicit */
        if (out[j] < out[j - 1]) out[j] = out[j - 1];
}

kvq_status kvq_kmeans1d(const float *x, const float *w, size_t n, int k, const kvq_kmeans_opts *opts,
                        float *centres, kvq_kmeans_info *info, kvq_err *err)
{
    kvq_kmeans_opts o = opts ? *opts : (kvq_kmeans_opts){0};
    if (o.n_bins == 0) o.n_bins = 65536;
    if (o.max_iter <= 0) o.max_iter = 100;
    kvq_kmeans_info inf = {.obj_lloyd = -1, .obj_exact = -1, .chosen = KVQ_FIT_EXACT};
    if (k < 1 || k > KMEANS_MAX_K) return kvq_fail(err, KVQ_EINVAL, "k-means: k: expected 1..%d, found %d", KMEANS_MAX_K, k);
    if (n == 0 || !x) return kvq_fail(err, KVQ_EINVAL, "k-means: no points");
    if ((unsigned)o.method > KVQ_FIT_EXACT) return kvq_fail(err, KVQ_EINVAL, "k-means: method: unknown value %d", (int)o.method);
    float xmin = INFINITY, xmax = -INFINITY;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(x[i])) return kvq_fail(err, KVQ_ENUMERIC, "k-means: point %zu is not finite (%g)", i, (double)x[i]);
        double wi = w ? w[i] : 1.0;
        if (!(wi >= 0) || !isfinite(wi))
            return kvq_fail(err, KVQ_ENUMERIC, "k-means: weight %zu: expected finite and >= 0, found %g", i, wi);
        if (wi > 0) {
            inf.n_points++;
            inf.total_weight += wi;
            if (x[i] < xmin) xmin = x[i];
            if (x[i] > xmax) xmax = x[i];
        }
    }
    if (!(inf.total_weight > 0)) return kvq_fail(err, KVQ_ENUMERIC, "k-means: total weight of %zu points is zero", n);
    atoms a = {0};
    KVQ_TRY(build_atoms(x, w, n, o.n_bins, xmin, xmax, &a, &inf.histogram, err));
    inf.n_atoms = a.m;
    double cl[KMEANS_MAX_K], ce[KMEANS_MAX_K];
    float fl[KMEANS_MAX_K], fe[KMEANS_MAX_K];
    kvq_status s = KVQ_OK;
    if (o.method != KVQ_FIT_EXACT) {
        s = lloyd(&a, k, o.max_iter, o.seed, cl, &inf.lloyd_iters, &inf.lloyd_converged, err);
        if (s == KVQ_OK) {
            to_float_sorted(cl, k, fl);
            inf.obj_lloyd = kvq_kmeans1d_objective(x, w, n, fl, k);
        }
    }
    if (s == KVQ_OK && o.method != KVQ_FIT_LLOYD) {
        s = exact_dp(&a, k, ce, err);
        if (s == KVQ_OK) {
            to_float_sorted(ce, k, fe);
            inf.obj_exact = kvq_kmeans1d_objective(x, w, n, fe, k);
        }
    }
    atoms_free(&a);
    if (s != KVQ_OK) return s;
    bool use_exact = o.method == KVQ_FIT_EXACT || (o.method == KVQ_FIT_AUTO && inf.obj_exact <= inf.obj_lloyd);
    inf.chosen = use_exact ? KVQ_FIT_EXACT : KVQ_FIT_LLOYD;
    memcpy(centres, use_exact ? fe : fl, (size_t)k * sizeof *centres);
    if (info) *info = inf;
    return KVQ_OK;
}
