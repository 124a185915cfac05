/* attention.c — causal GQA attention with prefix and per-query boundaries; see attention.h.
 *
 * Layout choice: keys are transposed per kv head to kt[g][d][key] so that the
 * scores of one query against all its keys are built as head_dim AXPYs over a
 * contiguous key range (vectorisable without reassociating a reduction, i.e.
 * without -ffast-math). The boundary only splits the key range of a row into
 * [prefix | alternative keys | full keys]; no score is computed twice. */
#include "attention.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

kvq_status kvq_attn_ws_init(kvq_attn_ws *ws, int max_T, int max_P, int n_kv_heads, int head_dim, int n_threads, kvq_err *err)
{
    memset(ws, 0, sizeof *ws);
    if (max_T <= 0 || max_P < 0 || n_kv_heads <= 0 || head_dim <= 0 || n_threads <= 0)
        return kvq_fail(err, KVQ_EINVAL, "attention workspace: bad sizes (max_T %d, max_P %d, kv heads %d, head_dim %d, threads %d)",
                        max_T, max_P, n_kv_heads, head_dim, n_threads);
    size_t ld = (size_t)max_P + max_T, nkt, nkq, nsc;
    if (kvq_mul_size((size_t)n_kv_heads * head_dim, ld, &nkt) || kvq_mul_size((size_t)n_kv_heads * head_dim, max_T, &nkq) ||
        kvq_mul_size(n_threads, ld, &nsc))
        return kvq_fail(err, KVQ_ENOMEM, "attention workspace: size overflows (max_T %d, max_P %d)", max_T, max_P);
    ws->max_T = max_T;
    ws->max_P = max_P;
    ws->n_kv_heads = n_kv_heads;
    ws->head_dim = head_dim;
    ws->n_threads = n_threads;
    ws->kt = malloc(nkt * sizeof(float));
    ws->kqt = malloc(nkq * sizeof(float));
    ws->scores = malloc(nsc * sizeof(float));
    ws->acc = malloc(nsc * sizeof(double));
    if (!ws->kt || !ws->kqt || !ws->scores || !ws->acc) {
        kvq_attn_ws_free(ws);
        return kvq_fail(err, KVQ_ENOMEM, "attention workspace: cannot allocate %.1f MiB",
                        ((nkt + nkq + nsc) * 4.0 + nsc * 8.0) / (1 << 20));
    }
    return KVQ_OK;
}

void kvq_attn_ws_free(kvq_attn_ws *ws)
{
    free(ws->kt);
    free(ws->kqt);
    free(ws->scores);
    free(ws->acc);
    memset(ws, 0, sizeof *ws);
}

kvq_status kvq_attn_check_bounds(const int *b, int T, const char *what, kvq_err *err)
{
    for (int i = 0; i < T; i++) {
        if (b[i] < 0 || b[i] > i + 1)
            return kvq_fail(err, KVQ_EINVAL, "%s[%d] = %d: expected 0 <= b <= %d (query i may use the alternative for keys j < b <= i+1)",
                            what, i, b[i], i + 1);
        if (i > 0 && b[i] < b[i - 1])
            return kvq_fail(err, KVQ_EINVAL, "%s[%d] = %d < %s[%d] = %d: the boundary must be non-decreasing", what, i, b[i], what, i - 1, b[i - 1]);
    }
    return KVQ_OK;
}

/* s[lo..hi) += a * r[lo..hi) */
static inline void axpy_range(float *restrict s, float a, const float *restrict r, int lo, int hi)
{
    for (int j = lo; j < hi; j++) s[j] += a * r[j];
}

/* One (head h, query i) row: scores into s[0..P+i], then out row. Returns the
 * softmax normaliser; s holds exp(score - max) on return, *mx the max. */
static float attn_row(const kvq_attn_args *a, const kvq_attn_ws *ws, int h, int i, float *restrict s, float *mx_out)
{
    const int hd = a->head_dim, P = a->P, n = P + i + 1;
    const int g = h / (a->n_heads / a->n_kv_heads);
    const size_t ldk = (size_t)ws->max_P + ws->max_T, ldq = ws->max_T;
    const float *ktg = ws->kt + (size_t)g * hd * ldk;
    const float *kqg = ws->kqt + (size_t)g * hd * ldq;
    const float *qi = a->q + ((size_t)i * a->n_heads + h) * hd;
    const int kb = a->kq ? a->kb[i] : 0;
    const float scale = 1.0f / sqrtf((float)hd);
    memset(s, 0, (size_t)n * sizeof *s);
    for (int d = 0; d < hd; d++) {
        float qd = qi[d] * scale;
        const float *r = ktg + d * ldk;
        if (kb == 0) {
            axpy_range(s, qd, r, 0, n);
        } else {
            axpy_range(s, qd, r, 0, P);
            axpy_range(s + P, qd, kqg + d * ldq, 0, kb);
            axpy_range(s, qd, r, P + kb, n);
        }
    }
    float mx = s[0];
    for (int j = 1; j < n; j++) mx = s[j] > mx ? s[j] : mx;
    float sum = 0;
    for (int j = 0; j < n; j++) {
        s[j] = expf(s[j] - mx);
        sum += s[j];
    }
    /* out = sum_j p_j v_j, normalised at the end */
    float *o = a->out + ((size_t)i * a->n_heads + h) * hd;
    memset(o, 0, (size_t)hd * sizeof *o);
    const size_t vstride = (size_t)a->n_kv_heads * hd;
    const int vb = a->vq ? a->vb[i] : 0;
    for (int j = 0; j < P; j++) axpy_range(o, s[j], a->pv + j * vstride + (size_t)g * hd, 0, hd);
    for (int j = 0; j <= i; j++) {
        const float *vr = (j < vb ? a->vq : a->v) + j * vstride + (size_t)g * hd;
        axpy_range(o, s[P + j], vr, 0, hd);
    }
    float inv = 1.0f / sum;
    for (int d = 0; d < hd; d++) o[d] *= inv;
    *mx_out = mx;
    return sum;
}

kvq_status kvq_attention(const kvq_attn_args *a, kvq_attn_ws *ws, kvq_err *err)
{
    const int T = a->T, P = a->P, hd = a->head_dim, nkv = a->n_kv_heads, nh = a->n_heads;
    if (T <= 0 || T > ws->max_T || P < 0 || P > ws->max_P || hd != ws->head_dim || nkv != ws->n_kv_heads || nh <= 0 || nh % nkv)
        return kvq_fail(err, KVQ_EINVAL, "attention: T %d (max %d), P %d (max %d), heads %d/%d, head_dim %d do not fit the workspace (kv heads %d, head_dim %d)",
                        T, ws->max_T, P, ws->max_P, nh, nkv, hd, ws->n_kv_heads, ws->head_dim);
    if ((a->kq == NULL) != (a->kb == NULL) || (a->vq == NULL) != (a->vb == NULL))
        return kvq_fail(err, KVQ_EINVAL, "attention: an alternative K/V representation needs both its values and its boundary");
    if (P > 0 && (!a->pk || !a->pv)) return kvq_fail(err, KVQ_EINVAL, "attention: P = %d prefix entries but no prefix K/V", P);
    if (a->kb) KVQ_TRY(kvq_attn_check_bounds(a->kb, T, "key boundary", err));
    if (a->vb) KVQ_TRY(kvq_attn_check_bounds(a->vb, T, "value boundary", err));

    const size_t ldk = (size_t)ws->max_P + ws->max_T, ldq = ws->max_T, stride = (size_t)nkv * hd;
    const int has_q = a->kq != NULL;
    /* transpose keys: kt[g][d][j] (prefix then window), kqt[g][d][j] */
#pragma omp parallel for collapse(2) schedule(static) num_threads(ws->n_threads)
    for (int g = 0; g < nkv; g++)
        for (int d = 0; d < hd; d++) {
            float *r = ws->kt + ((size_t)g * hd + d) * ldk;
            for (int j = 0; j < P; j++) r[j] = a->pk[j * stride + (size_t)g * hd + d];
            for (int j = 0; j < T; j++) r[P + j] = a->k[j * stride + (size_t)g * hd + d];
            if (has_q) {
                float *rq = ws->kqt + ((size_t)g * hd + d) * ldq;
                for (int j = 0; j < T; j++) rq[j] = a->kq[j * stride + (size_t)g * hd + d];
            }
        }

    if (a->mass || a->entropy) {
        /* statistics mode: one thread per head, queries in order (deterministic sums) */
#pragma omp parallel for schedule(dynamic, 1) num_threads(ws->n_threads)
        for (int h = 0; h < nh; h++) {
            int tid = omp_get_thread_num();
            float *s = ws->scores + (size_t)tid * ldk;
            double *acc = ws->acc + (size_t)tid * ldk;
            memset(acc, 0, (size_t)(P + T) * sizeof *acc);
            for (int i = 0; i < T; i++) {
                float mx;
                float sum = attn_row(a, ws, h, i, s, &mx);
                double inv = 1.0 / sum, hsum = 0;
                for (int j = 0; j < P + i + 1; j++) {
                    double p = s[j] * inv;
                    acc[j] += p;
                    if (p > 0) hsum -= p * log(p);
                }
                if (a->entropy) a->entropy[(size_t)h * T + i] = (float)hsum;
            }
            if (a->mass)
                for (int j = 0; j < P + T; j++) a->mass[(size_t)h * (P + T) + j] = (float)acc[j];
        }
    } else {
        const long n_rows = (long)T * nh;
#pragma omp parallel for schedule(dynamic, 16) num_threads(ws->n_threads)
        for (long r = 0; r < n_rows; r++) {
            int tid = omp_get_thread_num();
            float mx;
            attn_row(a, ws, (int)(r % nh), (int)(r / nh), ws->scores + (size_t)tid * ldk, &mx);
        }
    }
    return KVQ_OK;
}
