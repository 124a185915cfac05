/* attention.c — causal GQA attention with prefix and per-query boundaries; see attention.h.
 *
 * Layout choice: keys are stored per kv head in tiles of 16 keys x head_dim
 * channels (key index fastest), so the scores of one query against 16 keys
 * are 16 independent sums built channel by channel in vector registers
 * (vectorised without reassociating any reduction, i.e. without -ffast-math),
 * for up to 4 query heads of the GQA group at once. The boundary only splits
 * the key range of a row into [prefix | alternative keys | full keys]; no
 * score is computed twice, so a boundary pass costs what a plain pass costs.
 * Work is spread over (query, group) items with OpenMP, one parallel region
 * per call. */
#include "attention.h"

#include <math.h>
#include <stdint.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define KVQ_ATT_QB 4  /* query heads of one GQA group processed together */
#define KVQ_ATT_JT 16 /* keys per tile / channels per PV tile */

kvq_status kvq_attn_ws_init(kvq_attn_ws *ws, int max_T, int max_P, int n_kv_heads, int head_dim, int n_threads, kvq_err *err)
{
    memset(ws, 0, sizeof *ws);
    if (max_T <= 0 || max_P < 0 || n_kv_heads <= 0 || head_dim <= 0 || head_dim > 512 || n_threads <= 0)
        return kvq_fail(err, KVQ_EINVAL, "attention workspace: bad sizes (max_T %d, max_P %d, kv heads %d, head_dim %d (max 512), threads %d)",
                        max_T, max_P, n_kv_heads, head_dim, n_threads);
    size_t ld = (size_t)max_P + max_T, nkt, nkq, nsc;
    /* tiled keys: whole tiles of KVQ_ATT_JT keys per kv head */
    ws->kt_gs = (ld + KVQ_ATT_JT - 1) / KVQ_ATT_JT * KVQ_ATT_JT * head_dim;
    ws->kq_gs = ((size_t)max_T + KVQ_ATT_JT - 1) / KVQ_ATT_JT * KVQ_ATT_JT * head_dim;
    if (kvq_mul_size(n_kv_heads, ws->kt_gs, &nkt) || kvq_mul_size(n_kv_heads, ws->kq_gs, &nkq) ||
        kvq_mul_size((size_t)n_threads * 4, ld, &nsc))
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

/* Up to KVQ_ATT_QB query heads of one GQA group are processed together for
 * one query position: they share the key range, the boundary and every K/V
 * load. Hot loops use kernels/model/simd.h (ISA clones, same fp32 operations on
 * every clone, so results are bit-identical whatever the CPU). */

/* Keys of one kv head are stored in tiles of 16 keys: element (key j, channel
 * d) at r[((j/16)*hd + d)*16 + j%16], so one tile (16 keys x hd channels) is
 * contiguous. s[q][j] = sum_d qs[q][d] * k[j][d] for j in [lo, hi), q < QB;
 * each element accumulated from 0 in d order (full and partial tiles alike). */
#define KT_TILE(r, hd, j) ((r) + (size_t)((j) / KVQ_ATT_JT) * (hd) * KVQ_ATT_JT + (j) % KVQ_ATT_JT)
#define SCORE_FN(QB)                                                                                                  \
    KVQ_HOT static void score_range_##QB(float *restrict s, size_t lds, const float *restrict qs, int hd,               \
                                          const float *restrict r, int lo, int hi)                                     \
    {                                                                                                                  \
        for (int j = lo; j < hi;) {                                                                                    \
            int n = KVQ_ATT_JT - j % KVQ_ATT_JT;                                                                       \
            if (n > hi - j) n = hi - j;                                                                                \
            const float *tb = KT_TILE(r, hd, j);                                                                       \
            if (n == KVQ_ATT_JT) {                                                                                     \
                kvq_v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, k;                                                     \
                for (int d = 0; d < hd; d++) {                                                                         \
                    V16_LOAD(k, tb + d * KVQ_ATT_JT);                                                                  \
                    a0 += qs[d] * k;                                                                                   \
                    if (QB > 1) a1 += qs[hd + d] * k;                                                                  \
                    if (QB > 2) a2 += qs[2 * hd + d] * k;                                                              \
                    if (QB > 3) a3 += qs[3 * hd + d] * k;                                                              \
                }                                                                                                      \
                V16_STORE(s + j, a0);                                                                                  \
                if (QB > 1) V16_STORE(s + lds + j, a1);                                                                \
                if (QB > 2) V16_STORE(s + 2 * lds + j, a2);                                                            \
                if (QB > 3) V16_STORE(s + 3 * lds + j, a3);                                                            \
            } else {                                                                                                   \
                float acc[QB][KVQ_ATT_JT] = {{0}};                                                                     \
                for (int d = 0; d < hd; d++) {                                                                         \
                    const float *kr = tb + d * KVQ_ATT_JT;                                                             \
                    for (int q = 0; q < QB; q++)                                                                       \
                        for (int jj = 0; jj < n; jj++) acc[q][jj] += qs[q * hd + d] * kr[jj];                          \
                }                                                                                                      \
                for (int q = 0; q < QB; q++)                                                                           \
                    for (int jj = 0; jj < n; jj++) s[q * lds + j + jj] = acc[q][jj];                                   \
            }                                                                                                          \
            j += n;                                                                                                    \
        }                                                                                                              \
    }
SCORE_FN(1)
SCORE_FN(2)
SCORE_FN(3)
SCORE_FN(4)

static void score_range(int nq, float *s, size_t lds, const float *qs, int hd, const float *r, int lo, int hi)
{
    if (hi <= lo) return;
    switch (nq) {
    case 1: score_range_1(s, lds, qs, hd, r, lo, hi); break;
    case 2: score_range_2(s, lds, qs, hd, r, lo, hi); break;
    case 3: score_range_3(s, lds, qs, hd, r, lo, hi); break;
    default: score_range_4(s, lds, qs, hd, r, lo, hi); break;
    }
}

/* o[q][d] += sum_{j in [lo,hi)} p[q][j] * v[j*vstride + d], accumulated in j
 * order per element (d tiles of 16 in registers, scalar tail alike). */
#define PV_FN(QB)                                                                                                     \
    KVQ_HOT static void pv_range_##QB(float *restrict o, const float *restrict p, size_t lds, const float *restrict v, \
                                       size_t vstride, int hd, int lo, int hi)                                         \
    {                                                                                                                  \
        int d0 = 0;                                                                                                    \
        for (; d0 + KVQ_ATT_JT <= hd; d0 += KVQ_ATT_JT) {                                                              \
            kvq_v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, vv;                                                        \
            V16_LOAD(a0, o + d0);                                                                                      \
            if (QB > 1) V16_LOAD(a1, o + hd + d0);                                                                     \
            if (QB > 2) V16_LOAD(a2, o + 2 * hd + d0);                                                                 \
            if (QB > 3) V16_LOAD(a3, o + 3 * hd + d0);                                                                 \
            for (int j = lo; j < hi; j++) {                                                                            \
                V16_LOAD(vv, v + j * vstride + d0);                                                                    \
                a0 += p[j] * vv;                                                                                       \
                if (QB > 1) a1 += p[lds + j] * vv;                                                                     \
                if (QB > 2) a2 += p[2 * lds + j] * vv;                                                                 \
                if (QB > 3) a3 += p[3 * lds + j] * vv;                                                                 \
            }                                                                                                          \
            V16_STORE(o + d0, a0);                                                                                     \
            if (QB > 1) V16_STORE(o + hd + d0, a1);                                                                    \
            if (QB > 2) V16_STORE(o + 2 * hd + d0, a2);                                                                \
            if (QB > 3) V16_STORE(o + 3 * hd + d0, a3);                                                                \
        }                                                                                                              \
        for (int d = d0; d < hd; d++)                                                                                  \
            for (int q = 0; q < QB; q++) {                                                                             \
                float acc = o[q * hd + d];                                                                             \
                for (int j = lo; j < hi; j++) acc += p[q * lds + j] * v[j * vstride + d];                              \
                o[q * hd + d] = acc;                                                                                   \
            }                                                                                                          \
    }
PV_FN(1)
PV_FN(2)
PV_FN(3)
PV_FN(4)

static void pv_range(int nq, float *o, const float *p, size_t lds, const float *v, size_t vstride, int hd, int lo, int hi)
{
    if (hi <= lo) return;
    switch (nq) {
    case 1: pv_range_1(o, p, lds, v, vstride, hd, lo, hi); break;
    case 2: pv_range_2(o, p, lds, v, vstride, hd, lo, hi); break;
    case 3: pv_range_3(o, p, lds, v, vstride, hd, lo, hi); break;
    default: pv_range_4(o, p, lds, v, vstride, hd, lo, hi); break;
    }
}

/* s[j] = exp(s[j] - max); returns the sum and stores the max in *mx_out. The
 * sum is accumulated in 16 fixed lanes (then lanes in order), the same on every
 * ISA clone. */
KVQ_HOT static float row_softmax_unnorm(float *restrict s, int n, float *mx_out)
{
    float mx = s[0];
    for (int j = 1; j < n; j++) mx = s[j] > mx ? s[j] : mx;
    *mx_out = mx;
    kvq_v16 acc = {0}, x, y;
    int j = 0;
    for (; j + KVQ_ATT_JT <= n; j += KVQ_ATT_JT) {
        V16_LOAD(x, s + j);
        x = x - mx;
        KVQ_V16_EXP(y, x);
        V16_STORE(s + j, y);
        acc += y;
    }
    float sum = 0;
    for (int l = 0; l < KVQ_ATT_JT; l++) sum += acc[l];
    for (; j < n; j++) {
        s[j] = kvq_exp_s(s[j] - mx);
        sum += s[j];
    }
    return sum;
}

/* Heads h0 .. h0+nq-1 (one GQA group, nq <= KVQ_ATT_QB) at query i: scores
 * into s[q][0..P+i] (exp(score - max) on return), outputs into a->out;
 * sums[q] receives the softmax normalisers. */
static void attn_rows(const kvq_attn_args *a, const kvq_attn_ws *ws, int h0, int nq, int i, float *restrict s, float *sums)
{
    const int hd = a->head_dim, P = a->P, n = P + i + 1;
    const int g = h0 / (a->n_heads / a->n_kv_heads);
    const size_t lds = (size_t)ws->max_P + ws->max_T;
    const float *ktg = ws->kt + (size_t)g * ws->kt_gs;
    const float *kqg = ws->kqt + (size_t)g * ws->kq_gs;
    const int kb = a->kq ? a->kb[i] : 0;
    const float scale = 1.0f / sqrtf((float)hd);
    float qs[KVQ_ATT_QB * 512];
    float o[KVQ_ATT_QB * 512];
    for (int q = 0; q < nq; q++) {
        const float *qi = a->q + ((size_t)i * a->n_heads + h0 + q) * hd;
        for (int d = 0; d < hd; d++) qs[q * hd + d] = qi[d] * scale;
    }
    if (kb == 0) {
        score_range(nq, s, lds, qs, hd, ktg, 0, n);
    } else {
        score_range(nq, s, lds, qs, hd, ktg, 0, P);
        score_range(nq, s + P, lds, qs, hd, kqg, 0, kb);
        score_range(nq, s, lds, qs, hd, ktg, P + kb, n);
    }
    int plo = 0, wlo = 0;
    kvq_attn_key_lo(a->window, a->pos0, P, i, &plo, &wlo);
    const int masked = plo > 0 || wlo > 0;
    for (int q = 0; q < nq; q++) {
        float mx, *sq = s + q * lds;
        if (masked) { /* sliding window: masked keys out of the max, then probability exactly 0 */
            for (int j = 0; j < plo; j++) sq[j] = -INFINITY;
            for (int j = P; j < P + wlo; j++) sq[j] = -INFINITY;
        }
        sums[q] = row_softmax_unnorm(sq, n, &mx);
        if (masked) {
            float sum = 0;
            for (int j = 0; j < plo; j++) sq[j] = 0;
            for (int j = P; j < P + wlo; j++) sq[j] = 0;
            for (int j = 0; j < n; j++) sum += sq[j];
            sums[q] = sum;
        }
        if (a->lse) a->lse[(size_t)(h0 + q) * a->T + i] = (float)((double)mx + log((double)sums[q]));
    }
    memset(o, 0, (size_t)nq * hd * sizeof *o);
    const size_t vstride = (size_t)a->n_kv_heads * hd;
    const int vb = a->vq ? a->vb[i] : 0;
    if (P > 0) pv_range(nq, o, s, lds, a->pv + (size_t)g * hd, vstride, hd, 0, P);
    if (vb > 0) pv_range(nq, o, s + P, lds, a->vq + (size_t)g * hd, vstride, hd, 0, vb);
    pv_range(nq, o, s + P, lds, a->v + (size_t)g * hd, vstride, hd, vb, i + 1);
    for (int q = 0; q < nq; q++) {
        float inv = 1.0f / sums[q];
        float *out = a->out + ((size_t)i * a->n_heads + h0 + q) * hd;
        for (int d = 0; d < hd; d++) out[d] = o[q * hd + d] * inv;
    }
}

kvq_status kvq_attention(const kvq_attn_args *a, kvq_attn_ws *ws, kvq_err *err)
{
    const int T = a->T, P = a->P, hd = a->head_dim, nkv = a->n_kv_heads, nh = a->n_heads;
    if (T <= 0 || T > ws->max_T || P < 0 || P > ws->max_P || hd != ws->head_dim || hd > 512 || nkv != ws->n_kv_heads || nh <= 0 || nh % nkv)
        return kvq_fail(err, KVQ_EINVAL, "attention: T %d (max %d), P %d (max %d), heads %d/%d, head_dim %d do not fit the workspace (kv heads %d, head_dim %d <= 512)",
                        T, ws->max_T, P, ws->max_P, nh, nkv, hd, ws->n_kv_heads, ws->head_dim);
    if ((a->kq == NULL) != (a->kb == NULL) || (a->vq == NULL) != (a->vb == NULL))
        return kvq_fail(err, KVQ_EINVAL, "attention: an alternative K/V representation needs both its values and its boundary");
    if (P > 0 && (!a->pk || !a->pv)) return kvq_fail(err, KVQ_EINVAL, "attention: P = %d prefix entries but no prefix K/V", P);
    if (a->kb) KVQ_TRY(kvq_attn_check_bounds(a->kb, T, "key boundary", err));
    if (a->vb) KVQ_TRY(kvq_attn_check_bounds(a->vb, T, "value boundary", err));

    const size_t ldk = (size_t)ws->max_P + ws->max_T, stride = (size_t)nkv * hd;
    const int has_q = a->kq != NULL;
    /* work items: (query i, group g, chunk of <= KVQ_ATT_QB heads of the group) */
    const int gs = nh / nkv, nchunk = (gs + KVQ_ATT_QB - 1) / KVQ_ATT_QB;
    const int stats = a->mass || a->entropy;
    const long n_items = (long)T * nkv * nchunk;
    /* one parallel region per call (fewer wake-ups next to OpenBLAS's threads) */
#pragma omp parallel num_threads(ws->n_threads)
    {
        /* keys into the tiled layout (prefix then window; alternative keys apart) */
#pragma omp for collapse(2) schedule(static)
        for (int g = 0; g < nkv; g++)
            for (int d = 0; d < hd; d++) {
                float *r = ws->kt + (size_t)g * ws->kt_gs, *rq = ws->kqt + (size_t)g * ws->kq_gs;
                for (int j = 0; j < P; j++) KT_TILE(r, hd, j)[d * KVQ_ATT_JT] = a->pk[j * stride + (size_t)g * hd + d];
                for (int j = 0; j < T; j++) KT_TILE(r, hd, P + j)[d * KVQ_ATT_JT] = a->k[j * stride + (size_t)g * hd + d];
                if (has_q)
                    for (int j = 0; j < T; j++) KT_TILE(rq, hd, j)[d * KVQ_ATT_JT] = a->kq[j * stride + (size_t)g * hd + d];
            }

        if (stats) {
            /* statistics mode: one thread per (group, chunk), queries in order (deterministic sums) */
#pragma omp for schedule(dynamic, 1)
            for (int w = 0; w < nkv * nchunk; w++) {
                int tid = omp_get_thread_num(), g = w / nchunk, c = w % nchunk;
                int h0 = g * gs + c * KVQ_ATT_QB, nq = gs - c * KVQ_ATT_QB < KVQ_ATT_QB ? gs - c * KVQ_ATT_QB : KVQ_ATT_QB;
                float *s = ws->scores + (size_t)tid * KVQ_ATT_QB * ldk, sums[KVQ_ATT_QB];
                double *acc = ws->acc + (size_t)tid * KVQ_ATT_QB * ldk;
                memset(acc, 0, (size_t)KVQ_ATT_QB * ldk * sizeof *acc);
                for (int i = 0; i < T; i++) {
                    attn_rows(a, ws, h0, nq, i, s, sums);
                    for (int q = 0; q < nq; q++) {
                        double inv = 1.0 / sums[q], hsum = 0;
                        for (int j = 0; j < P + i + 1; j++) {
                            double p = s[q * ldk + j] * inv;
                            acc[q * ldk + j] += p;
                            if (p > 0) hsum -= p * log(p);
                        }
                        if (a->entropy) a->entropy[(size_t)(h0 + q) * T + i] = (float)hsum;
                    }
                }
                if (a->mass)
                    for (int q = 0; q < nq; q++)
                        for (int j = 0; j < P + T; j++) a->mass[(size_t)(h0 + q) * (P + T) + j] = (float)acc[q * ldk + j];
            }
        } else {
#pragma omp for schedule(dynamic, 4)
            for (long w = 0; w < n_items; w++) {
                int tid = omp_get_thread_num();
                int i = (int)(w / (nkv * nchunk)), gc = (int)(w % (nkv * nchunk)), g = gc / nchunk, c = gc % nchunk;
                int h0 = g * gs + c * KVQ_ATT_QB, nq = gs - c * KVQ_ATT_QB < KVQ_ATT_QB ? gs - c * KVQ_ATT_QB : KVQ_ATT_QB;
                float sums[KVQ_ATT_QB];
                attn_rows(a, ws, h0, nq, i, ws->scores + (size_t)tid * KVQ_ATT_QB * ldk, sums);
            }
        }
    }
    return KVQ_OK;
}

/* ---- per-key schedules ------------------------------------------------------------------- */

#include "forward.h" /* kvq_kv_sched, kvq_sched_rep */

/* Per KV head: the current representation of every window key in the tiled layout (prefix keys
 * first, as kvq_attention's ws->kt), the current values [T][hd], and which representation each
 * key / value holds now (-1 = not yet inserted). */
typedef struct {
    float *kt;          /* tiled keys: ceil((P+T)/16)*16*hd */
    float *cv;          /* [T][hd] */
    signed char *rk, *rv; /* [T] */
    float *s;           /* [QB][P+T] scores / exp */
    float *pr;          /* [gs][P+T] probabilities for the step */
    double *acc;        /* [gs][P+T] mass (stats) */
} sched_head;

static kvq_status sched_check(const kvq_kv_sched *s, int T, int nkv, kvq_err *err)
{
    if (s->n_k < 1 || s->n_k > KVQ_KV_MAX_REPS || s->n_v < 1 || s->n_v > KVQ_KV_MAX_REPS)
        return kvq_fail(err, KVQ_EINVAL, "attention schedule: %d key / %d value representations, expected 1..%d", s->n_k,
                        s->n_v, KVQ_KV_MAX_REPS);
    for (int r = 0; r < s->n_k; r++)
        if (!s->k[r]) return kvq_fail(err, KVQ_EINVAL, "attention schedule: key representation %d missing", r);
    for (int r = 0; r < s->n_v; r++)
        if (!s->v[r]) return kvq_fail(err, KVQ_EINVAL, "attention schedule: value representation %d missing", r);
    if ((s->n_k > 1 && !s->k_from && !s->k_sel) || (s->n_v > 1 && !s->v_from && !s->v_sel))
        return kvq_fail(err, KVQ_EINVAL, "attention schedule: switch times missing");
    for (int w = 0; w < 2; w++) {
        const signed char *sel = w ? s->v_sel : s->k_sel;
        const int n = w ? s->n_v : s->n_k;
        if (sel) {
            for (size_t x = 0; x < (size_t)nkv * T; x++)
                if (sel[x] < 0 || sel[x] >= n)
                    return kvq_fail(err, KVQ_EINVAL, "attention schedule: %s of KV head %zu, token %zu selects representation %d, "
                                    "expected 0..%d", w ? "value" : "key", x / T, x % T, sel[x], n - 1);
            continue;
        }
        const int *from = w ? s->v_from : s->k_from;
        for (int r = 2; r < n; r++)
            for (size_t x = 0; x < (size_t)nkv * T; x++)
                if (from[(size_t)(r - 1) * nkv * T + x] < from[(size_t)(r - 2) * nkv * T + x])
                    return kvq_fail(err, KVQ_EINVAL,
                                    "attention schedule: %s of KV head %zu, token %zu switches to representation %d (step %d) "
                                    "before %d (step %d)", w ? "value" : "key", x / T, x % T, r,
                                    from[(size_t)(r - 1) * nkv * T + x], r - 1, from[(size_t)(r - 2) * nkv * T + x]);
    }
    return KVQ_OK;
}

/* KV head h: every query row in order. */
static kvq_status sched_head_run(const kvq_attn_args *a, kvq_kv_sched *sc, int layer, int h, sched_head *w, kvq_err *err)
{
    const int T = a->T, P = a->P, hd = a->head_dim, nkv = a->n_kv_heads, gs = a->n_heads / nkv;
    const size_t ld = (size_t)P + T, stride = (size_t)nkv * hd;
    const float scale = 1.0f / sqrtf((float)hd);
    const int stats = a->mass || a->entropy;
    for (int j = 0; j < P; j++)
        for (int d = 0; d < hd; d++) KT_TILE(w->kt, hd, j)[d * KVQ_ATT_JT] = a->pk[j * stride + (size_t)h * hd + d];
    memset(w->rk, -1, (size_t)T);
    memset(w->rv, -1, (size_t)T);
    if (stats) memset(w->acc, 0, (size_t)gs * ld * sizeof *w->acc);
    float qs[KVQ_ATT_QB * 512], o[KVQ_ATT_QB * 512], sums[KVQ_ATT_QB];
    for (int i = 0; i < T; i++) {
        /* the representation every key <= i holds at step i */
        for (int j = 0; j <= i; j++) {
            int rk = sc->k_sel ? sc->k_sel[(size_t)h * T + j] : sc->n_k > 1 ? kvq_sched_rep(sc->k_from, sc->n_k, nkv, T, h, j, i) : 0;
            int rv = sc->v_sel ? sc->v_sel[(size_t)h * T + j] : sc->n_v > 1 ? kvq_sched_rep(sc->v_from, sc->n_v, nkv, T, h, j, i) : 0;
            if (rk < 0 || rk >= sc->n_k || rv < 0 || rv >= sc->n_v)
                return kvq_fail(err, KVQ_EINVAL, "attention schedule: KV head %d, token %d selects key representation %d / value "
                                "representation %d at query %d, expected 0..%d / 0..%d", h, j, rk, rv, i, sc->n_k - 1, sc->n_v - 1);
            if (rk != w->rk[j]) {
                const float *src = sc->k[rk] + j * stride + (size_t)h * hd;
                for (int d = 0; d < hd; d++) KT_TILE(w->kt, hd, P + j)[d * KVQ_ATT_JT] = src[d];
                w->rk[j] = (signed char)rk;
            }
            if (rv != w->rv[j]) {
                memcpy(w->cv + (size_t)j * hd, sc->v[rv] + j * stride + (size_t)h * hd, (size_t)hd * sizeof(float));
                w->rv[j] = (signed char)rv;
            }
        }
        const int n = P + i + 1;
        for (int c0 = 0; c0 < gs; c0 += KVQ_ATT_QB) {
            const int nq = gs - c0 < KVQ_ATT_QB ? gs - c0 : KVQ_ATT_QB, h0 = h * gs + c0;
            for (int q = 0; q < nq; q++) {
                const float *qi = a->q + ((size_t)i * a->n_heads + h0 + q) * hd;
                for (int d = 0; d < hd; d++) qs[q * hd + d] = qi[d] * scale;
            }
            score_range(nq, w->s, ld, qs, hd, w->kt, 0, n);
            for (int q = 0; q < nq; q++) {
                float mx;
                sums[q] = row_softmax_unnorm(w->s + q * ld, n, &mx);
            }
            memset(o, 0, (size_t)nq * hd * sizeof *o);
            if (P > 0) pv_range(nq, o, w->s, ld, a->pv + (size_t)h * hd, stride, hd, 0, P);
            pv_range(nq, o, w->s + P, ld, w->cv, (size_t)hd, hd, 0, i + 1);
            for (int q = 0; q < nq; q++) {
                float inv = 1.0f / sums[q];
                float *out = a->out + ((size_t)i * a->n_heads + h0 + q) * hd;
                for (int d = 0; d < hd; d++) out[d] = o[q * hd + d] * inv;
                double dinv = 1.0 / sums[q], hsum = 0;
                float *pr = w->pr + (size_t)(c0 + q) * ld;
                for (int j = 0; j < n; j++) {
                    double p = w->s[q * ld + j] * dinv;
                    pr[j] = (float)p;
                    if (stats) {
                        w->acc[(size_t)(c0 + q) * ld + j] += p;
                        if (p > 0) hsum -= p * log(p);
                    }
                }
                if (a->entropy) a->entropy[(size_t)(h0 + q) * T + i] = (float)hsum;
            }
        }
        if (sc->step) {
            /* the step reads [n_q][P+i+1] rows: compact the probabilities */
            for (int q = 1; q < gs; q++) memmove(w->pr + (size_t)q * n, w->pr + (size_t)q * ld, (size_t)n * sizeof(float));
            kvq_sched_step st = {.layer = layer, .i = i, .kv_head = h, .T = T, .P = P, .n_q = gs, .probs = w->pr};
            kvq_status s = sc->step(sc->user, &st, sc, err);
            if (s) return kvq_err_prefix(err, "attention schedule step (KV head %d, query %d)", h, i);
        }
    }
    if (a->mass)
        for (int q = 0; q < gs; q++)
            for (size_t j = 0; j < ld; j++) a->mass[(size_t)(h * gs + q) * ld + j] = (float)w->acc[(size_t)q * ld + j];
    return KVQ_OK;
}

kvq_status kvq_attention_sched(const kvq_attn_args *a, kvq_kv_sched *sched, int layer, int n_threads, kvq_err *err)
{
    const int T = a->T, P = a->P, hd = a->head_dim, nkv = a->n_kv_heads, nh = a->n_heads;
    if (T <= 0 || P < 0 || hd <= 0 || hd > 512 || nkv <= 0 || nh <= 0 || nh % nkv)
        return kvq_fail(err, KVQ_EINVAL, "attention schedule: T %d, P %d, heads %d/%d, head_dim %d (<= 512)", T, P, nh, nkv, hd);
    if (a->k || a->v || a->kq || a->vq || a->kb || a->vb || a->lse)
        return kvq_fail(err, KVQ_EINVAL, "attention schedule: window K/V, alternatives and lse must not be given");
    if (P > 0 && (!a->pk || !a->pv)) return kvq_fail(err, KVQ_EINVAL, "attention schedule: P = %d prefix entries but no prefix K/V", P);
    KVQ_TRY(sched_check(sched, T, nkv, err));
    const int gs = nh / nkv;
    const size_t ld = (size_t)P + T, ntile = (ld + KVQ_ATT_JT - 1) / KVQ_ATT_JT * KVQ_ATT_JT;
    sched_head *w = calloc((size_t)nkv, sizeof *w);
    kvq_status *st = calloc((size_t)nkv, sizeof *st);
    kvq_err *errs = calloc((size_t)nkv, sizeof *errs);
    bool ok = w && st && errs;
    for (int h = 0; ok && h < nkv; h++) {
        w[h].kt = calloc(ntile * (size_t)hd, sizeof(float));
        w[h].cv = malloc((size_t)T * hd * sizeof(float));
        w[h].rk = malloc((size_t)T);
        w[h].rv = malloc((size_t)T);
        w[h].s = malloc((size_t)KVQ_ATT_QB * ld * sizeof(float));
        w[h].pr = malloc((size_t)gs * ld * sizeof(float));
        w[h].acc = a->mass || a->entropy ? malloc((size_t)gs * ld * sizeof(double)) : NULL;
        ok = w[h].kt && w[h].cv && w[h].rk && w[h].rv && w[h].s && w[h].pr && (w[h].acc || !(a->mass || a->entropy));
    }
    kvq_status s = KVQ_OK;
    if (!ok) s = kvq_fail(err, KVQ_ENOMEM, "attention schedule: cannot allocate scratch for %d KV heads x %zu keys", nkv, ld);
    if (!s) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads > 0 ? n_threads : 1)
        for (int h = 0; h < nkv; h++) st[h] = sched_head_run(a, sched, layer, h, &w[h], &errs[h]);
        for (int h = 0; h < nkv && !s; h++)
            if (st[h]) {
                s = st[h];
                if (err) *err = errs[h];
            }
    }
    for (int h = 0; w && h < nkv; h++) {
        free(w[h].kt);
        free(w[h].cv);
        free(w[h].rk);
        free(w[h].rv);
        free(w[h].s);
        free(w[h].pr);
        free(w[h].acc);
    }
    free(w);
    free(st);
    free(errs);
    return s;
}
