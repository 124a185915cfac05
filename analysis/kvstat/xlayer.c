/* xlayer.c — kvstat's cross-layer view; see xlayer.h. */
#include "xlayer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "family.h"

void kvq_xlayer_free(kvq_xlayer *x)
{
    if (!x) return;
    free(x->cos_k);
    free(x->cos_v);
    free(x->dist_k);
    free(x->dist_v);
    free(x->ret_k);
    free(x->ret_v);
    free(x->merged);
    memset(x, 0, sizeof *x);
}

/* cosine of two head vectors (double); *ok false when a norm is 0 */
static double cosine(const float *a, const float *b, int hd, bool *ok)
{
    double s = 0, sa = 0, sb = 0;
    for (int i = 0; i < hd; i++) {
        s += (double)a[i] * b[i];
        sa += (double)a[i] * a[i];
        sb += (double)b[i] * b[i];
    }
    *ok = sa > 0 && sb > 0;
    if (!*ok) return 0;
    double c = s / (sqrt(sa) * sqrt(sb));
    return c > 1 ? 1 : c < -1 ? -1 : c;
}

kvq_status kvq_xlayer_compute(const kvq_kvsrc *src, const kvq_artifact *a, double gamma, int64_t n_sink, bool quiet,
                              kvq_xlayer *out, kvq_err *err)
{
    memset(out, 0, sizeof *out);
    const int np = src->layer_last - src->layer_first;
    if (np < 1) return kvq_fail(err, KVQ_EINVAL, "cross-layer view: the dump holds one layer (%d); adjacent pairs need two", src->layer_first);
    if (a && (!a->k || !a->v || a->p.n_layers != (size_t)src->n_layers || a->p.n_kv_heads != (size_t)src->n_kv_heads))
        return kvq_fail(err, KVQ_EINVAL, "cross-layer view: the artifact's %zu layers x %zu KV heads do not match the dump's %d x %d",
                        a->p.n_layers, a->p.n_kv_heads, src->n_layers, src->n_kv_heads);
    if (a) n_sink = (int64_t)a->p.n_sink;
    const int H = src->n_kv_heads, hd = src->head_dim, kvd = H * hd;
    const int64_t N = src->n_samples, L = src->seq_len, ns = n_sink < L ? n_sink : L;
    const size_t nv = (size_t)N * (size_t)(L - ns) * (size_t)H;
    out->n_pairs = np;
    out->layer_first = src->layer_first;
    out->gamma = gamma;
    out->artifact = a != NULL;
    out->n_vectors = nv;
    double **fields[6] = {&out->cos_k, &out->cos_v, &out->dist_k, &out->dist_v, &out->ret_k, &out->ret_v};
    for (int i = 0; i < 6; i++) *fields[i] = calloc((size_t)np, sizeof(double));
    out->merged = malloc((size_t)np);
    float *xa = malloc((size_t)L * kvd * sizeof(float)), *xb = malloc((size_t)L * kvd * sizeof(float));
    double *d = malloc((nv ? nv : 1) * sizeof(double));
    kvq_status st = KVQ_OK;
    for (int i = 0; i < 6; i++)
        if (!*fields[i]) st = KVQ_ENOMEM;
    if (st || !out->merged || !xa || !xb || !d) {
        free(xa);
        free(xb);
        free(d);
        kvq_xlayer_free(out);
        return kvq_fail(err, KVQ_ENOMEM, "cross-layer view: cannot hold %zu distances", nv);
    }
    for (int j = 0; j < np && !st; j++) {
        const int l = src->layer_first + j;
        out->merged[j] = a ? (signed char)(kvq_kv_table_get(&a->k[l], "merge") &&
                                           kvq_kv_table_get(&a->k[l], "merge")->data[0] == 1)
                           : -1;
        for (int side = 0; side < 2 && !st; side++) {
            const kvq_kvt t = side ? KVQ_KVT_V : KVQ_KVT_K;
            const kvq_fam_tensor *th = a ? kvq_kv_table_get(side ? &a->v[l] : &a->k[l], "theta") : NULL;
            if (a && (!th || th->shape[0] != (uint64_t)H)) {
                st = kvq_fail(err, KVQ_EINVAL, "cross-layer view: layers.%d.%c.theta: expected [%d] (a minicache artifact)", l,
                              side ? 'v' : 'k', H);
                break;
            }
            double cs = 0, ds = 0;
            size_t k = 0;
            for (int64_t s = 0; s < N && !st; s++) {
                st = src->read_rows(src->ctx, l, t, s, 0, L, xa, err);
                if (!st) st = src->read_rows(src->ctx, l + 1, t, s, 0, L, xb, err);
                if (st) {
                    kvq_err_prefix(err, "cross-layer view: layers %d and %d", l, l + 1);
                    break;
                }
                for (int64_t p = ns; p < L; p++)
                    for (int h = 0; h < H; h++) {
                        bool ok;
                        double c = cosine(xa + p * kvd + h * hd, xb + p * kvd + h * hd, hd, &ok);
                        double dd = ok ? acos(c) / M_PI : 1.0;
                        cs += c;
                        ds += dd;
                        d[k++] = ok ? dd : 2.0; /* zero norm: always retained */
                    }
            }
            if (st) break;
            /* the retention thresholds per KV head: the artifact's, or the rule over the dump */
            size_t ret = 0;
            for (int h = 0; h < H; h++) {
                double mn = 2, mx = -1;
                for (size_t i = (size_t)h; i < nv; i += (size_t)H)
                    if (d[i] <= 1) {
                        mn = fmin(mn, d[i]);
                        mx = fmax(mx, d[i]);
                    }
                double thr = a ? (double)th->data[h] : mx - (mx - mn) * gamma;
                for (size_t i = (size_t)h; i < nv; i += (size_t)H) ret += d[i] > thr;
            }
            double n = nv ? (double)nv : NAN;
            (side ? out->cos_v : out->cos_k)[j] = cs / n;
            (side ? out->dist_v : out->dist_k)[j] = ds / n;
            (side ? out->ret_v : out->ret_k)[j] = (double)ret / n;
        }
        if (!quiet) fprintf(stderr, "\rkvstat: cross-layer view: pair %d/%d", j + 1, np);
    }
    if (!quiet) fprintf(stderr, "\n");
    free(xa);
    free(xb);
    free(d);
    if (st) kvq_xlayer_free(out);
    return st;
}
